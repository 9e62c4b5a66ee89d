"""``voxtral-mlx``: speak text like macOS ``say``, list voices, convert files.

The only module that prints. Errors are one line on stderr and a non-zero exit code:
1 for bad input or environment, 130 when interrupted.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from .errors import InputError, VoxtralError

PROG = "voxtral-mlx"
MODEL_ENV = "VOXTRAL_MLX_MODEL"
SECONDS_PER_TEXT_TOKEN = 0.3  # rough speaking rate, only a hint for the player's pre-roll


def _default_model() -> str:
    from .hub import DEFAULT_REPO

    return os.environ.get(MODEL_ENV) or DEFAULT_REPO


def _err(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr)


def _info(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _read_text(args: argparse.Namespace) -> str:
    if args.file is not None and args.text:
        raise InputError("give the text either as arguments or with -f FILE, not both")
    if args.file is not None:
        if args.file == "-":
            return sys.stdin.read()
        try:
            return Path(args.file).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise InputError(f"text file {args.file} not found") from None
        except UnicodeDecodeError:
            raise InputError(f"text file {args.file} is not UTF-8 text") from None
        except OSError as e:
            raise InputError(f"cannot read {args.file}: {e.strerror}") from None
    if args.text:
        return " ".join(args.text)
    if not sys.stdin.isatty():
        return sys.stdin.read()
    raise InputError("no text: pass TEXT, -f FILE, or pipe text on stdin")


def _load(args: argparse.Namespace):
    from . import load

    t0 = time.perf_counter()
    tts = load(args.model, dtype=args.dtype)
    if getattr(args, "verbose", False):
        _info(f"loaded {tts.path} ({tts.dtype}) in {time.perf_counter() - t0:.2f} s")
    return tts


def _print_voices(tts) -> None:
    from .voices import LANGUAGE_NAMES

    for name in sorted(tts.voices):
        voice = tts.voices[name]
        lang = voice.language or "?"
        print(f"{name:<20} {lang:<3} {LANGUAGE_NAMES.get(lang, 'unknown')}")


def cmd_voices(args: argparse.Namespace) -> int:
    _print_voices(_load(args))
    return 0


def _print_devices() -> None:
    from .audio.player import list_output_devices

    for dev in list_output_devices():
        mark = "*" if dev.get("default") else " "
        print(f"{mark} {dev['index']:>3}  {dev['name']}  ({dev['channels']} ch)")


def cmd_speak(args: argparse.Namespace) -> int:
    if args.device == "?":
        _print_devices()
        return 0
    raw_out = args.raw
    to_stdout = args.output == "-"
    if raw_out and args.output is not None:
        raise InputError("--raw writes PCM to stdout; do not combine it with -o")
    if args.output is not None and not to_stdout:
        from .audio.io import check_output_path

        check_output_path(args.output)
    play = args.play or (args.output is None and not raw_out)
    if args.voice == "?":
        _print_voices(_load(args))
        return 0
    text = _read_text(args)
    if not text.strip():
        raise InputError("text is empty: give some words to speak")

    player = None
    if play:
        from .audio.player import AudioPlayer

        player = AudioPlayer(device=args.device)  # fails early without PortAudio/devices
    tts = _load(args)
    if args.voice is not None:
        tts.voices.get_voice(args.voice)

    sinks = []
    file_writer = None
    if args.output is not None and not to_stdout:
        from .audio.io import AudioFileWriter

        file_writer = AudioFileWriter(args.output, tts.sample_rate)
        sinks.append(file_writer.write)
    if to_stdout:
        from .audio.io import WavStreamWriter

        wav = WavStreamWriter(sys.stdout.buffer, tts.sample_rate)
        sinks.append(wav.write)
    if raw_out:
        from .audio.io import float_to_pcm16

        def write_raw(chunk):
            sys.stdout.buffer.write(float_to_pcm16(chunk))
            sys.stdout.buffer.flush()

        sinks.append(write_raw)

    expected = None
    if player is not None:
        n_tokens = len(tts.tokenizer.encode(text))
        expected = max(1.0, n_tokens * SECONDS_PER_TEXT_TOKEN)

    timings = None
    ok = False
    try:
        for chunk in tts.stream(
            text, voice=args.voice, seed=args.seed, chunk_frames=1, max_frames=args.max_frames
        ):
            timings = chunk.timings
            if len(chunk.audio):
                for sink in sinks:
                    sink(chunk.audio)
                if player is not None:
                    player.feed(chunk.audio, expected_total_s=expected)
        if player is not None:
            player.finish()
        ok = True
    finally:
        if player is not None and not ok:
            player.stop()
        if file_writer is not None:
            if ok:
                file_writer.close()
            else:
                file_writer.abort()
        if to_stdout:
            wav.close()
    if timings is None or timings.frames == 0:
        raise VoxtralError("the model produced no audio for this text (END on the first frame)")
    if args.verbose:
        _report(timings, player)
    return 0


def _report(t, player) -> None:
    _info(f"prompt: {t.prompt_tokens} tokens, prefill {t.prefill_s * 1000:.0f} ms")
    _info(f"first audio after {t.first_audio_s * 1000:.0f} ms")
    _info(f"frames: {t.frames}, {t.ms_per_frame:.1f} ms/frame, audio {t.audio_s:.2f} s")
    _info(
        f"wall {t.total_s:.2f} s, real-time factor {t.rtf:.3f} "
        f"({1 / t.rtf if t.rtf else 0:.2f}x real time)"
    )
    _info(f"peak memory {t.peak_memory_bytes / 2**30:.2f} GiB")
    if player is not None:
        s = player.stats
        _info(
            f"playback: {s.underruns} underruns ({s.underrun_s:.2f} s of silence), "
            f"pre-roll {s.preroll_s * 1000:.0f} ms"
        )


def cmd_convert_voices(args: argparse.Namespace) -> int:
    from .voices import convert_voice_files

    for path in convert_voice_files([Path(s) for s in args.sources], Path(args.output)):
        print(path)
    return 0


def cmd_random_checkpoint(args: argparse.Namespace) -> int:
    from .synthetic.checkpoint import build_random_checkpoint, make_params

    params = make_params(args.size, n_layers=args.layers, flow_layers=args.flow_layers)
    t0 = time.perf_counter()
    out = build_random_checkpoint(
        args.output,
        params,
        seed=args.seed,
        dtype=args.dtype,
        voice_format=args.voice_format,
        suppress_end=args.suppress_end,
    )
    _info(f"wrote a random {args.size} checkpoint to {out} in {time.perf_counter() - t0:.1f} s")
    print(out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Mistral's Voxtral-4B-TTS on Apple Silicon with MLX.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    def model_args(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "-m",
            "--model",
            default=_default_model(),
            help=f"local directory or Hugging Face repo (default: ${MODEL_ENV} or "
            "mistralai/Voxtral-4B-TTS-2603)",
        )
        p.add_argument(
            "--dtype", default=None, help="bfloat16 | float16 | float32 (default: the checkpoint's)"
        )

    speak = sub.add_parser("speak", help="speak text (plays it, or writes it with -o)")
    speak.add_argument("text", nargs="*", help="text to speak")
    speak.add_argument("-f", "--file", help="read the text from FILE ('-' for stdin)")
    speak.add_argument("-v", "--voice", help="voice name ('?' lists them)")
    speak.add_argument(
        "-o",
        "--output",
        help="write audio to FILE (.wav .flac .ogg .mp3; "
        "'-' writes WAV to stdout) instead of playing",
    )
    speak.add_argument("--play", action="store_true", help="play even when writing a file")
    speak.add_argument(
        "--raw",
        action="store_true",
        help="write raw 16-bit little-endian mono PCM to stdout as it is generated",
    )
    speak.add_argument("-a", "--device", help="output device index or name ('?' lists them)")
    speak.add_argument("--seed", type=int, help="seed of the flow-matching noise")
    speak.add_argument(
        "--max-frames",
        type=int,
        default=2400,
        help="stop after this many 80 ms frames (default 2400 = 192 s)",
    )
    speak.add_argument("--verbose", action="store_true", help="print timings to stderr")
    model_args(speak)
    speak.set_defaults(func=cmd_speak)

    voices = sub.add_parser("voices", help="list the voices and their languages")
    model_args(voices)
    voices.set_defaults(func=cmd_voices)

    conv = sub.add_parser("convert-voices", help="convert voice .pt files to .safetensors")
    conv.add_argument("sources", nargs="+", metavar="SRC", help=".pt files or directories")
    conv.add_argument("-o", "--output", required=True, metavar="OUT_DIR")
    conv.set_defaults(func=cmd_convert_voices)

    rnd = sub.add_parser(
        "random-checkpoint", help="build a random checkpoint in Mistral's layout (for tests)"
    )
    rnd.add_argument("output", metavar="OUT_DIR")
    rnd.add_argument("--size", choices=["tiny", "wide", "full"], default="tiny")
    rnd.add_argument("--layers", type=int, help="override the backbone's layer count")
    rnd.add_argument("--flow-layers", type=int, help="override the flow head's layer count")
    rnd.add_argument("--seed", type=int, default=0)
    rnd.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    rnd.add_argument("--voice-format", choices=["pt", "safetensors"], default="pt")
    rnd.add_argument(
        "--suppress-end",
        action="store_true",
        help="zero the END row of the semantic head so generation runs to --max-frames",
    )
    rnd.set_defaults(func=cmd_random_checkpoint)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except VoxtralError as e:
        _err(str(e))
        return 1
    except KeyboardInterrupt:
        _err("interrupted")
        return 130
    except BrokenPipeError:
        # The reader of stdout went away (e.g. `| head`): not an error of ours.
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        return 141


if __name__ == "__main__":
    sys.exit(main())
