"""Loading the model a command names (downloading it first if need be)."""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

from ..errors import InputError
from ..fileio import dtype_name, one_line
from ..interrupts import signals_held
from .output import PROG, info, to_stderr
from .waiting import interruptibly

MODEL_ENV = "VOXTRAL_MLX_MODEL"


def default_model() -> str:
    from ..hub import DEFAULT_REPO

    # Set but empty (an unset shell variable in `VOXTRAL_MLX_MODEL=$DIR`) is refused as
    # `-m ""` is, not taken for the 8 GB default.
    return os.environ.get(MODEL_ENV, DEFAULT_REPO)


def _say_downloading(repo_id: str, cache: Path) -> None:
    # Also where no progress bar shows (stderr not a terminal): minutes of silence else.
    info(f"{PROG}: downloading {repo_id} into {one_line(str(cache), 200)} (once; Ctrl-C stops it)")


def _say_downloading_voices(repo_id: str, cache: Path) -> None:
    info(
        f"{PROG}: downloading the voices of {repo_id} (its config, tokenizer and voice files, "
        f"not its weights) into {one_line(str(cache), 200)}"
    )


def _say_download_failed(repo_id: str, why: str) -> None:
    info(
        f"{PROG}: could not download the update of {repo_id} ({one_line(why, 200)}): "
        "using the copy already in the cache"
    )


def _end_download() -> None:
    """The process is interrupted: a download under way ends with it, and its partial files
    go (up to 8 GB that the next run cannot resume)."""
    from ..hub import download_bars_drawn, remove_partial_downloads

    with signals_held():
        remove_partial_downloads()
        if download_bars_drawn():  # the error line goes below the bars, not over them
            to_stderr("\n")


@contextlib.contextmanager
def downloads_reported(args: argparse.Namespace) -> Iterator[None]:
    """While a command resolves its model: a download says that it begins (unless -q), and
    an interrupt ends it cleanly. The library's own state is left as it was."""
    from .. import hub
    from ..interrupts import QUICK_EXIT_CLEANUPS

    before = hub.download_started, hub.download_failed
    quiet = getattr(args, "quiet", False)
    hub.download_started = None if quiet else _say_downloading
    hub.download_failed = None if quiet else _say_download_failed
    # Commands that end at once on a signal (serve, voices) clean up in its handler.
    QUICK_EXIT_CLEANUPS.append(hub.remove_partial_downloads)
    try:
        yield
    except KeyboardInterrupt:
        _end_download()
        raise
    finally:
        QUICK_EXIT_CLEANUPS.remove(hub.remove_partial_downloads)
        hub.download_started, hub.download_failed = before


def check_dtype(args: argparse.Namespace) -> None:
    from ..loader import parse_dtype

    try:
        parse_dtype(args.dtype)
    except InputError:
        raise InputError(
            f"--dtype {one_line(args.dtype, 40)} is not supported: use bfloat16, float16 or float32"
        ) from None


def ask_for_the_compiler() -> None:
    """Have MLX's CPU backend look for its C++ compiler now. It asks once per process, the
    first time it compiles, by running ``g++ --version`` through C's ``system()``, which
    ignores Ctrl-C while it runs: asked as the first frame started, an interrupt sent as
    the output file appeared was lost and the command went on generating. (Metal
    compiles in-process.)"""
    import mlx.core as mx

    try:
        os.getcwd()
    except OSError:  # its shell would print "getcwd() failed" (and the command then fails)
        return
    if mx.default_device() == mx.cpu:
        mx.eval(mx.compile(lambda x: x * 2.0 + 1.0)(mx.zeros((1,))))


def load_voice_list(args: argparse.Namespace):
    """The model directory a command names and its voices, read without the weights
    (``voices``, ``speak -v '?'``): of a model not in the cache, only the files that list
    them are downloaded."""
    from .. import hub
    from ..hub import resolve_model_dir
    from ..loader import load_voices

    def loaded():
        model_dir = resolve_model_dir(args.model, weights=False)
        return model_dir, load_voices(model_dir)

    with downloads_reported(args):
        if hub.download_started is not None:  # not -q (restored as the block ends)
            hub.download_started = _say_downloading_voices
        return interruptibly(loaded)


def load_model(args: argparse.Namespace):
    from .. import load

    check_dtype(args)
    t0 = time.perf_counter()
    prefixes = None if getattr(args, "no_prefix_cache", False) else "auto"

    def loaded():
        ask_for_the_compiler()
        return load(args.model, dtype=args.dtype, prefix_cache_dir=prefixes)

    with downloads_reported(args):
        tts = interruptibly(loaded)
    if getattr(args, "verbose", False):
        info(
            f"loaded {tts.path} in {time.perf_counter() - t0:.2f} s: {weights_summary(tts)} "
            "(every weight read into memory)"
        )
    return tts


def weights_summary(tts) -> str:
    """Which files were read, in which layout, quantized how, computing in which dtype."""
    from ..checkpoint import some_names

    shown = some_names([p.name for p in tts.weight_files], 2)
    bits: dict[str, int] = {}
    for spec in tts.quantized.values():
        kind = f"{spec.bits}-bit" if spec.mode == "affine" else spec.mode
        bits[kind] = bits.get(kind, 0) + 1
    quant = ", ".join(f"{n} layer{'s' * (n != 1)} {kind}" for kind, n in sorted(bits.items()))
    dtype = dtype_name(tts.dtype)
    return f"{tts.layout} layout ({shown}), {quant + ', ' if quant else ''}{dtype} compute"
