"""The commands that write files: ``convert-voices``, ``random-checkpoint``, ``convert``."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from ..errors import InputError
from ..fileio import one_line
from ..interrupts import FINISHED, hold_from_now, terminable
from .loading import downloads_reported
from .output import info, note, result_line
from .waiting import interruptibly

T = TypeVar("T")


@terminable
def cmd_convert_voices(args: argparse.Namespace) -> int:
    from ..voices import convert_voice_files

    sources = [Path(s) for s in args.sources]
    written: list[Path] | None = None
    try:
        written = convert_voice_files(sources, Path(args.output), overwrite=args.force)
        hold_from_now()
    except KeyboardInterrupt as e:  # once they are all written, the command did its job
        if written is not None and getattr(e, "detail", None) is None:
            e.detail = f"interrupted {FINISHED} (its output is complete)"
        raise
    for path in written:
        result_line(str(path))
    return 0


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino


def _written_then_held(output: str, write: Callable[[], T]) -> T:
    """Run ``write``, which renames a finished directory into place at ``output``, and hold
    signals back once it has returned. An interrupt that lands after the rename says so:
    the command did its job. (As a context manager this left a gap, in its ``__exit__``,
    where a finished conversion was reported as "interrupted" alone.)"""
    from ..output_dir import written_detail

    before = _identity(output)
    try:
        result = write()
        hold_from_now()
    except KeyboardInterrupt as e:
        after = _identity(output)
        if getattr(e, "detail", None) is None and after is not None and after != before:
            e.detail = written_detail(output)
        raise
    return result


@terminable
def cmd_random_checkpoint(args: argparse.Namespace) -> int:
    from ..config import MAX_LAYERS
    from ..synthetic.checkpoint import build_random_checkpoint, make_params
    from ..synthetic.tekken import mistral_common_tekken_path

    for flag, value in (("--layers", args.layers), ("--flow-layers", args.flow_layers)):
        if value is not None and not 1 <= value <= MAX_LAYERS:
            raise InputError(f"{flag} must be between 1 and {MAX_LAYERS}, got {value}")
    params = make_params(args.size, n_layers=args.layers, flow_layers=args.flow_layers)
    t0 = time.perf_counter()
    out = _written_then_held(
        args.output,
        lambda: build_random_checkpoint(
            args.output,
            params,
            seed=args.seed,
            dtype=args.dtype,
            voice_format=args.voice_format,
            suppress_end=args.suppress_end,
            force=args.force,
        ),
    )
    vocab = (
        "the real text vocabulary, from mistral-common"
        if mistral_common_tekken_path() is not None
        else "a 256-byte text vocabulary; `pip install mistral-common` gives the real one"
    )
    info(
        f"wrote a random {args.size} checkpoint to {out} in {time.perf_counter() - t0:.1f} s "
        f"({vocab})"
    )
    result_line(str(out))
    return 0


@terminable
def cmd_convert(args: argparse.Namespace) -> int:
    from ..convert import DEFAULT_GROUP_SIZE, convert_model

    last = [0.0]

    def progress(name: str, done: int, total: int) -> None:
        now = time.perf_counter()
        if args.verbose and (now - last[0] > 2.0 or done == total):
            last[0] = now
            info(f"{done / 2**30:6.2f} / {total / 2**30:.2f} GiB  {name}")

    t0 = time.perf_counter()
    with downloads_reported(args):
        model = _fetch_to_convert(args)
    result = _written_then_held(
        args.output,
        lambda: convert_model(
            model,
            args.output,
            q_bits=args.q_bits,
            q_group_size=args.q_group_size,
            q_flow_bits=args.q_flow_bits,
            dtype=args.dtype,
            force=args.force,
            progress=progress,
        ),
    )
    what = f"{len(result.quantized)} quantized layers" if result.quantized else "unquantized"
    n = len(result.voices)
    voices = f"{n} voice{'s' if n != 1 else ''}" if n else "no voices"
    info(
        f"wrote {result.total_bytes / 2**30:.2f} GiB ({what}, {voices}) to {result.path} in "
        f"{time.perf_counter() - t0:.1f} s"
    )
    if result.unfit:
        n, first = len(result.unfit), ", ".join(result.unfit[:3])
        layers, stay, their = ("layers", "stay", "their") if n > 1 else ("layer", "stays", "its")
        note(
            f"{n} {layers} ({first}{', ...' if n > 3 else ''}) {stay} unquantized: "
            f"{their} input width is not a multiple of the group size "
            f"{args.q_group_size or DEFAULT_GROUP_SIZE}"
        )
    if result.missing_voices:
        names = one_line(", ".join(result.missing_voices), 400)
        note(
            f"the tekken.json of {args.model} lists voices that have no file in its "
            f"voice_embedding/ (an incomplete download?), so the conversion has none either: "
            f"{names}; fetch the model again, then convert again"
        )
    if not result.voices:
        note(
            f"{args.model} has no voices in voice_embedding/; to speak with the "
            f"converted model, put voice files (.pt or .safetensors) in "
            f"{result.path / 'voice_embedding'}/ (create it)"
        )
    result_line(str(result.path))
    return 0


def _fetch_to_convert(args: argparse.Namespace) -> Path:
    """The model's folder, a Hub model downloaded on a helper thread (see
    :func:`interruptibly`; in the main thread, Ctrl-C waited for huggingface_hub's threads
    to finish their files; the conversion records the repo of a cached snapshot). The
    options and the output path are checked before: a typo must not cost the download."""
    from ..convert import QuantOptions, output_dtype
    from ..hub import resolve_model_dir
    from ..output_dir import check_output_dir, directory_path

    QuantOptions.make(args.q_bits, args.q_group_size, args.q_flow_bits)
    output_dtype(args.dtype)
    # (os.path: a path of a user that does not exist, or too long, is resolve_model_dir's
    # to name.) A local model is checked with the output, for their overlap first.
    if not os.path.isdir(os.path.expanduser(args.model)):
        check_output_dir(directory_path(args.output), args.force)  # again once it is known
    return interruptibly(lambda: resolve_model_dir(args.model))
