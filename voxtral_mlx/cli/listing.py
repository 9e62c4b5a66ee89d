"""``voxtral-mlx voices`` and ``speak -a '?'``: what there is to speak with and on."""

from __future__ import annotations

import argparse

from ..errors import VoxtralError, printable
from ..fileio import one_line
from .loading import load_model
from .output import note, result_line


def print_voices(tts) -> None:
    from ..voices import LANGUAGE_NAMES, unreadable

    if not tts.voices and not tts.voices.broken:
        tts.default_voice  # noqa: B018 - raises the one-line "no voices" error
    damaged = []
    for name in sorted(tts.voices):
        try:  # a voice file is a megabyte or two: read each, list only what speak can use
            tts.load_voice(name)
        except VoxtralError as e:
            named = f"voice {one_line(repr(name))}"
            # Most voice errors already begin with the voice's name.
            damaged.append(str(e) if str(e).startswith(named) else f"{named} is unusable: {e}")
            continue
        voice = tts.voices[name]
        lang = voice.language or "?"
        result_line(f"{one_line(name, 80):<20} {lang:<3} {LANGUAGE_NAMES.get(lang, 'unknown')}")
    for name, path in sorted(tts.voices.broken.items()):
        note(f"voice {one_line(repr(name))} is unusable: {unreadable(path)}")
    for message in damaged:
        note(printable(message))
    if tts.voices.missing:
        names = one_line(", ".join(tts.voices.missing), 400)
        note(
            f"tekken.json lists voices that have no file (an incomplete download?): "
            f"{names}; fetch the model again"
        )


def cmd_voices(args: argparse.Namespace) -> int:
    print_voices(load_model(args))
    return 0


def print_devices() -> None:
    from ..audio.player import list_output_devices, no_output_device_error

    devices = list_output_devices()
    if not devices:
        raise no_output_device_error()
    for dev in devices:
        mark = "*" if dev.get("default") else " "
        result_line(f"{mark} {dev['index']:>3}  {dev['name']}  ({dev['channels']} ch)")
