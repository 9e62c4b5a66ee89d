"""``voxtral-mlx voices`` and ``speak -a '?'``: what there is to speak with and on."""

from __future__ import annotations

import argparse

from ..errors import VoxtralError, printable
from ..fileio import one_line
from .loading import load_voice_list
from .output import note, result_line


def print_voices(args: argparse.Namespace) -> None:
    """The model's usable voices, one per line (their files read and checked, the model's
    weights not read), and notes on the unusable ones."""
    from ..voices import LANGUAGE_NAMES, no_voices_error, unreadable

    model_dir, voices = load_voice_list(args)
    if not voices and not voices.broken:
        raise no_voices_error(model_dir)
    damaged = []
    for name in sorted(voices):
        try:  # a voice file is a megabyte or two: read each, list only what speak can use
            voices.embedding(name)
        except VoxtralError as e:
            named = f"voice {one_line(repr(name))}"
            # Most voice errors already begin with the voice's name.
            damaged.append(str(e) if str(e).startswith(named) else f"{named} is unusable: {e}")
            continue
        lang = voices[name].language or "?"
        result_line(f"{one_line(name, 80):<20} {lang:<3} {LANGUAGE_NAMES.get(lang, 'unknown')}")
    for name, path in sorted(voices.broken.items()):
        note(f"voice {one_line(repr(name))} is unusable: {unreadable(path)}")
    for message in damaged:
        note(printable(message))
    if voices.missing:
        names = one_line(", ".join(voices.missing), 400)
        note(
            f"tekken.json lists voices that have no file (an incomplete download?): "
            f"{names}; fetch the model again"
        )


def cmd_voices(args: argparse.Namespace) -> int:
    print_voices(args)
    return 0


def print_devices() -> None:
    from ..audio.player import list_output_devices, no_output_device_error

    devices = list_output_devices()
    if not devices:
        raise no_output_device_error()
    for dev in devices:
        mark = "*" if dev.get("default") else " "
        result_line(f"{mark} {dev['index']:>3}  {dev['name']}  ({dev['channels']} ch)")
