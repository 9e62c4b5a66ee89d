"""The command line's options, and argparse with the project's one-line errors."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from typing import NoReturn

from .. import __version__
from ..fileio import one_line
from .conversions import cmd_convert, cmd_convert_voices, cmd_random_checkpoint
from .listing import cmd_voices
from .loading import MODEL_ENV, default_model
from .output import PROG, err, to_stderr
from .serve import cmd_serve
from .speak import cmd_speak


def _given(what: str, fix: str = "give a path") -> Callable[[str], str]:
    """An argparse type for an argument that must not be blank (an unset shell variable):
    an empty path would be the current directory, an empty device the first one."""

    def check(value: str) -> str:
        if not value.strip():
            raise argparse.ArgumentTypeError(f"{what} is empty (an unset shell variable?): {fix}")
        return value

    return check


class HelpNotWritten(Exception):
    def __init__(self, error: OSError):
        super().__init__(str(error))
        self.error = error


class _Parser(argparse.ArgumentParser):
    """argparse with the project's error format: one line, exit status 1 (argparse prints
    the usage block and exits with 2)."""

    def error(self, message: str, help_prog: str | None = None) -> NoReturn:
        hint = ""
        # "-hello" is read as -h with "ello"; "-hello" unknown as a whole is likely text too.
        if "ignored explicit argument" in message or re.search(
            r"unrecognized arguments: (.* )?-[^-\s]\S{2,}", message
        ):
            hint = " (text that starts with '-' goes last, after --)"
        err(f"{one_line(message, 300)}{hint}; see `{help_prog or self.prog} --help`")
        sys.exit(1)

    def _print_message(self, message: str, file=None) -> None:
        # argparse drops a failed write (Python >= 3.12): `--help > /dev/full` said nothing
        # and exited 0. Only stdout's failure matters; stderr's is dropped as err does.
        if not message:
            return
        if file is None or file is sys.stderr:
            to_stderr(message)
            return
        try:
            file.write(message)
            file.flush()
        except OSError as e:
            raise HelpNotWritten(e) from None

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        argv = sys.argv[1:] if args is None else list(args)
        commands = self._commands()
        first = next((i for i, a in enumerate(argv) if a in commands), None)
        known = commands[argv[first]]._option_string_actions if first is not None else {}
        if first and argv[0].split("=")[0] in known and argv[0] not in ("-h", "--help"):
            # `voxtral-mlx -m DIR speak ...`: argparse would call DIR an invalid command.
            self.error(
                f"{argv[0]} goes after the command: {PROG} {argv[first]} {argv[0]} ...",
                f"{PROG} {argv[first]}",
            )
        for arg in argv[: argv.index("--") if "--" in argv else len(argv)]:
            flags = all(f"-{c}" in known for c in arg[1:])  # "-hq": -h and -q, as argparse
            if re.fullmatch(r"-h[^-\s]\S*", arg) and arg not in known and not flags:
                # Python 3.13's argparse reads "-hello" as -h and prints the help (exit 0);
                # earlier ones call it an error. Text it is, on every version.
                self.error(
                    f"argument -h/--help: ignored explicit argument {arg[2:]!r}",
                    f"{PROG} {argv[first]}" if first is not None else None,
                )
        # The command is checked here, not by argparse: it would report a missing COMMAND
        # for `voxtral-mlx --bogus`, hiding the option it did not know.
        parsed, unknown = self.parse_known_args(args, namespace)
        command = getattr(parsed, "command", "")
        if unknown:
            self.error(
                f"unrecognized arguments: {' '.join(unknown)}",
                f"{PROG} {command}" if command else None,
            )
        if command is None:
            self.error("the following arguments are required: COMMAND")
        return parsed

    def _commands(self) -> dict[str, argparse.ArgumentParser]:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return dict(action.choices)
        return {}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Mistral's Voxtral-4B-TTS on Apple Silicon with MLX.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def model_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "-m",
            "--model",
            type=_given(
                f"the model (-m, or ${MODEL_ENV})", "give a directory or a Hugging Face repo id"
            ),
            default=default_model(),
            help=f"local directory or Hugging Face repo (default: ${MODEL_ENV} or "
            "mistralai/Voxtral-4B-TTS-2603)",
        )

    def model_args(p: argparse.ArgumentParser) -> None:
        model_arg(p)
        p.add_argument(
            "--dtype", default=None, help="bfloat16 | float16 | float32 (default: the checkpoint's)"
        )
        p.add_argument(
            "--no-prefix-cache",
            action="store_true",
            help="do not keep prefilled voice prefixes on disk (in 'prefixes' of "
            "$VOXTRAL_MLX_CACHE, else of $XDG_CACHE_HOME/voxtral_mlx or ~/.cache/voxtral_mlx)",
        )

    speak = sub.add_parser("speak", help="speak text (plays it, or writes it with -o)")
    speak.add_argument("text", nargs="*", help="text to speak ('-' alone: stdin)")
    speak.add_argument(
        "-f", "--file", type=_given("-f FILE"), help="read the text from FILE ('-' for stdin)"
    )
    speak.add_argument("-v", "--voice", help="voice name (default: casual_male; '?' lists them)")
    speak.add_argument(
        "-o",
        "--output",
        type=_given("-o FILE"),
        metavar="FILE",
        help="write audio to FILE (.wav .flac .aiff .caf .ogg .mp3 .opus; "
        "'-' writes WAV to stdout) instead of playing; an existing FILE is replaced once "
        "the new one is complete (or interrupted)",
    )
    speak.add_argument("--play", action="store_true", help="play even when writing a file")
    speak.add_argument(
        "--raw",
        action="store_true",
        help="write raw 16-bit little-endian mono PCM to stdout as it is generated",
    )
    speak.add_argument(
        "-a",
        "--device",
        type=_given("--device", "name a device (-a '?' lists them), or leave -a out"),
        help="output device index or name ('?' lists them)",
    )
    speak.add_argument("--seed", type=int, help="seed of the flow-matching noise")
    speak.add_argument(
        "--max-frames",
        type=int,
        default=2400,
        help="stop each text segment after this many 80 ms frames (default 2400 = 192 s)",
    )
    speak.add_argument("--verbose", action="store_true", help="print timings to stderr")
    speak.add_argument("-q", "--quiet", action="store_true", help="no progress line")
    speak.add_argument(
        "--no-split",
        action="store_true",
        help="speak the text as one utterance (default: split long text at natural pauses); "
        "it too gets a period if it lacks final punctuation, unless --no-period",
    )
    speak.add_argument(
        "--no-period",
        action="store_true",
        help="do not end the text's segments (or, with --no-split, the text) with a period "
        "where they lack final punctuation",
    )
    speak.add_argument(
        "--pause", type=float, help="seconds of silence between segments (default: natural)"
    )
    speak.add_argument(
        "--speed",
        type=float,
        default=1.0,
        help="play the speech faster (e.g. 1.5) or slower (0.8) at the same pitch, in files "
        "too: 0.25 to 4 (default 1: as generated)",
    )
    speak.add_argument(
        "--follow",
        action="store_true",
        help="speak text from stdin (or -f FILE, e.g. a FIFO) as it arrives, a sentence or "
        "more at a time, until its end (for a program that writes it gradually, such as an "
        "LLM; a regular file ends where it ends now: use tail -f FILE | ...); without it "
        "the text is read to its end first",
    )
    model_args(speak)
    speak.set_defaults(func=cmd_speak)

    voices = sub.add_parser("voices", help="list the voices and their languages")
    model_arg(voices)  # the voice files are read, not the weights
    voices.set_defaults(func=cmd_voices)

    conv = sub.add_parser("convert-voices", help="convert voice .pt files to .safetensors")
    conv.add_argument(
        "sources", nargs="+", type=_given("SRC"), metavar="SRC", help=".pt files or directories"
    )
    conv.add_argument(
        "-o",
        "--output",
        "--out",
        dest="output",
        type=_given("-o OUT_DIR"),
        required=True,
        metavar="OUT_DIR",
        help="directory to write <name>.safetensors into (created if needed)",
    )
    conv.add_argument(
        "--force", action="store_true", help="overwrite voice files already in OUT_DIR"
    )
    conv.set_defaults(func=cmd_convert_voices)

    rnd = sub.add_parser(
        "random-checkpoint", help="build a random checkpoint in Mistral's layout (for tests)"
    )
    rnd.add_argument("output", type=_given("OUT_DIR"), metavar="OUT_DIR")
    rnd.add_argument(
        "--size",
        choices=["tiny", "wide", "full"],
        default="tiny",
        help="tiny: 64 wide, for tests; wide: the real layer widths with 2 backbone layers; "
        "full: the real 26 + 3 layers, 8 GB (default: tiny)",
    )
    rnd.add_argument("--layers", type=int, help="override the backbone's layer count")
    rnd.add_argument("--flow-layers", type=int, help="override the flow head's layer count")
    rnd.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: 0)")
    rnd.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    rnd.add_argument("--voice-format", choices=["pt", "safetensors"], default="pt")
    rnd.add_argument(
        "--suppress-end",
        action="store_true",
        help="zero the END row of the semantic head so generation runs to --max-frames",
    )
    rnd.add_argument(
        "--force", action="store_true", help="replace an existing OUT_DIR holding a model"
    )
    rnd.set_defaults(func=cmd_random_checkpoint)

    cvt = sub.add_parser(
        "convert", help="convert a checkpoint to an MLX directory (optionally quantized)"
    )
    cvt.add_argument(
        "model", type=_given("MODEL"), metavar="MODEL", help="local directory or Hugging Face repo"
    )
    cvt.add_argument(
        "-o",
        "--output",
        type=_given("-o OUT_DIR"),
        required=True,
        metavar="OUT_DIR",
        help="directory to write the converted model into (written aside, renamed in at the end)",
    )
    cvt.add_argument(
        "--q-bits", type=int, help="quantize the backbone's Linear layers to 4, 6 or 8 bits"
    )
    cvt.add_argument(
        "--q-group-size", type=int, help="quantization group size: 32, 64 or 128 (default 64)"
    )
    cvt.add_argument(
        "--q-flow-bits",
        type=int,
        help="bits of the flow head's Linear layers (default: max(8, --q-bits))",
    )
    cvt.add_argument(
        "--dtype",
        default="bfloat16",
        help="bfloat16 | float16 | float32: dtype of every unquantized tensor (default bfloat16)",
    )
    cvt.add_argument("--force", action="store_true", help="replace an existing OUT_DIR")
    cvt.add_argument("--verbose", action="store_true", help="print progress to stderr")
    cvt.set_defaults(func=cmd_convert)

    srv = sub.add_parser(
        "serve", help="serve speech over HTTP (OpenAI-compatible /v1/audio/speech)"
    )
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    srv.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free)")
    srv.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $VOXTRAL_MLX_API_KEY)",
    )
    srv.add_argument(
        "--max-batch",
        type=int,
        default=4,
        help="text segments generated as one batch (4; at most 64)",
    )
    srv.add_argument(
        "--max-queue",
        type=int,
        default=32,
        help="speech requests in progress at most, generating or waiting; more get 429 (32)",
    )
    srv.add_argument(
        "--max-input-chars", type=int, default=4096, help="longest input text (default 4096)"
    )
    srv.add_argument(
        "--max-frames",
        type=int,
        default=2400,
        help="stop a text segment after this many 80 ms frames (default 2400 = 192 s)",
    )
    srv.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        help="seconds a client has to send its whole request body; then 408 (default 30)",
    )
    srv.add_argument(
        "--send-timeout",
        type=float,
        default=60.0,
        help="seconds a client may stop reading the audio before it is cut off (default 60)",
    )
    srv.add_argument(
        "--no-warmup",
        action="store_true",
        help="start serving at once (default: first compile the frame for every batch size "
        "and prefill the default voice, so the first requests do not wait for it)",
    )
    srv.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="server log level (default info: one line per request)",
    )
    model_args(srv)
    srv.set_defaults(func=cmd_serve)
    return parser
