"""voxtral_mlx: Mistral's Voxtral-4B-TTS on Apple Silicon with MLX.

>>> import voxtral_mlx
>>> tts = voxtral_mlx.load()                       # mistralai/Voxtral-4B-TTS-2603
>>> speech = tts.synthesize("Hello!", voice="casual_male", seed=0)
>>> speech.audio, speech.sample_rate               # float32 mono at 24 kHz
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import TYPE_CHECKING

from .errors import InputError, VoxtralError, is_mlx_import_error, mlx_import_error

# Here rather than in .hub: the command line takes over Ctrl-C once this package has been
# imported, and importing .hub (pathlib, shutil and what they import) took ~15 ms of that.
DEFAULT_REPO = "mistralai/Voxtral-4B-TTS-2603"

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path
    from typing import Any

    import mlx.core as mx

    from .tts import (
        AsyncTextStream,
        AudioChunk,
        Playback,
        Speech,
        TextStream,
        Timings,
        Voice,
        VoxtralTTS,
    )


def _import_tts():
    try:
        from . import tts
    except ImportError as e:
        if is_mlx_import_error(e):
            raise mlx_import_error(e) from None
        raise
    return tts


def __getattr__(name: str) -> object:
    if name in _FROM_TTS:
        tts = _import_tts()

        value = getattr(tts, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_FROM_TTS})


__all__ = [
    "DEFAULT_REPO",
    "AsyncTextStream",
    "AudioChunk",
    "Playback",
    "Speech",
    "TextStream",
    "Timings",
    "Voice",
    "VoxtralError",
    "VoxtralTTS",
    "load",
]
# MLX and the model code load on first use, so that `voxtral-mlx --help` is quick and
# Ctrl-C right after starting the command ends it with one line, not a traceback.
_FROM_TTS = frozenset(__all__) - {"DEFAULT_REPO", "VoxtralError", "load"}
__version__ = "0.1.0"


def load(
    path_or_repo: str | os.PathLike[str] | None = DEFAULT_REPO,
    dtype: str | mx.Dtype | None = None,
    *,
    max_batch: int = 4,
    prefix_cache_dir: str | os.PathLike[str] | None = "auto",
) -> VoxtralTTS:
    """Load Voxtral TTS from a local directory or a Hugging Face repo id.

    ``dtype``: compute dtype (``"bfloat16"``, ``"float16"``, ``"float32"``); default: the
    checkpoint's own (bfloat16 for Mistral's release). ``max_batch``: sequences (requests or
    text segments) generated together in one batch. ``prefix_cache_dir``: where each
    voice's prefilled prompt prefix is kept between processes (``"auto"``: the
    ``prefixes`` folder of :func:`voxtral_mlx.tokenizer.default_cache_dir`:
    ``$VOXTRAL_MLX_CACHE``, else ``$XDG_CACHE_HOME/voxtral_mlx``, else
    ``~/.cache/voxtral_mlx``; None: memory only), so the first request with a voice skips its
    prefill; see :mod:`voxtral_mlx.prefix_store`. ``$VOXTRAL_MLX_MODEL`` (the CLI's default
    model) is not read here.

    On a Mac, the weights are kept resident in GPU memory while requests run (see
    :mod:`voxtral_mlx.residency`); a model larger than the GPU can keep resident loads with
    a :class:`~voxtral_mlx.residency.MemoryWarning`.
    """
    _import_tts()  # MLX missing: one clear error
    from .engine import check_max_batch
    from .fileio import one_line, usable_path
    from .hub import cached_main_snapshot, resolve_model_dir
    from .loader import load_model_dir, parse_dtype
    from .prefix_store import PrefixCacheWarning, PrefixStore, model_fingerprint
    from .read_ahead import ReadAhead
    from .residency import Residency
    from .tokenizer import default_cache_dir
    from .tts import VoxtralTTS
    from .worker import Worker

    check_max_batch(max_batch)  # before the model is read (or downloaded), not after
    parse_dtype(dtype)
    directory = None
    if prefix_cache_dir is not None:
        if not isinstance(prefix_cache_dir, (str, os.PathLike)):
            raise InputError(
                f"prefix_cache_dir must be a directory path, 'auto' or None, got "
                f"{type(prefix_cache_dir).__name__}"
            )
        if os.path.normpath(os.fspath(prefix_cache_dir) or ".") == ".":  # "", "./", "a/.."
            raise InputError(
                "prefix_cache_dir is an empty path (the current directory): give a directory, "
                "'auto', or None"
            )
        auto = isinstance(prefix_cache_dir, str) and prefix_cache_dir == "auto"
        directory = (
            default_cache_dir() / "prefixes"
            if auto
            else usable_path(prefix_cache_dir, "prefix_cache_dir")
        )

    def files_state(path: Path) -> str | None:
        # Taken before the weights are read and again after: files replaced meanwhile (a
        # copy or a conversion finishing into the folder) would have prefixes of the
        # weights in memory saved under the new files' fingerprint, for later processes.
        if directory is None:
            return None
        with contextlib.suppress(OSError):  # an unreadable folder: the loader says so
            return model_fingerprint(path)
        return None

    # Stopped at the next part by a close: at interpreter exit (an app quitting while it
    # loads) or here, when this thread is interrupted.
    def read(path: Path, check: Callable[[], None]) -> Any:
        return load_model_dir(path, dtype, check)

    model_dir = None
    worker = Worker()
    try:
        early = cached_main_snapshot(path_or_repo)
        ahead = None
        if early is not None:  # read while the Hub is asked whether it is current
            ahead = ReadAhead(worker, early, read, files_state(early))
        model_dir = resolve_model_dir(
            path_or_repo, before_download=ahead.stop if ahead is not None else None
        )
        if directory is not None and _same_dir(directory, model_dir):
            raise InputError(
                f"prefix_cache_dir {one_line(str(directory))} is the model's folder, whose "
                "files would mix with the weights: give a folder of its own (e.g. a "
                "prefix-cache folder inside it), 'auto', or None"
            )
        if directory is not None and _same_dir(directory, model_dir / "voice_embedding"):
            raise InputError(
                f"prefix_cache_dir {one_line(str(directory))} is the model's voice folder, "
                "where its files would be taken for voices: give a folder of its own, "
                "'auto', or None"
            )
        if ahead is not None and not ahead.stopped and _same_dir(ahead.path, model_dir):
            loaded, before = ahead.take(), ahead.state
        else:
            if ahead is not None:
                # The Hub named another copy (an update), or its download failed after
                # the read was stopped and the copy read ahead serves after all.
                ahead.drop()
            before = files_state(model_dir)
            loaded = worker.call(read, model_dir, worker.raise_if_closed)
        store = None
        if directory is not None:
            fingerprint = model_fingerprint(loaded.path)
            if fingerprint == before:
                store = PrefixStore(directory, fingerprint)
            else:
                warnings.warn(
                    f"the model's files in {one_line(str(loaded.path))} changed while they "
                    "were read: voice prefixes are kept in memory only (load the model "
                    "again to use the cache on disk)",
                    PrefixCacheWarning,
                    stacklevel=2,
                )
        residency = Residency(loaded.weight_bytes)
        residency.check_fit()  # a warning, an exception under -W error
        return VoxtralTTS(
            loaded, worker, max_batch=max_batch, prefix_store=store, residency=residency
        )
    except BaseException as e:
        worker.close()
        if model_dir is not None:
            _name_the_cache_fix(e, model_dir)
        raise


def _same_dir(a: os.PathLike[str], b: os.PathLike[str]) -> bool:
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):  # the cache folder does not exist yet
        return os.path.abspath(a) == os.path.abspath(b)


def _name_the_cache_fix(error: BaseException, model_dir: os.PathLike[str]) -> None:
    """A damaged file of a Hub download: rerunning will not fetch it again (the snapshot
    looks complete), so the message says how; a missing one, how to fetch just that."""
    from .errors import CheckpointError, ConfigError, ModelNotFoundError, TokenizerError
    from .hub import cached_repo

    repo = cached_repo(model_dir)
    if repo is None or len(error.args) != 1 or not isinstance(error.args[0], str):
        return
    # A weights file that does not read, or a file the message says to fetch again (not a
    # wrong dtype or a conversion by a newer version, which a download would not mend).
    damaged = isinstance(error, CheckpointError) or (
        isinstance(error, (ConfigError, ModelNotFoundError, TokenizerError))
        and "download" in error.args[0]
    )
    if damaged:
        message = error.args[0]
        for said in ("; fetch it again", ": fetch it again"):  # said once, with the how
            message = message.removesuffix(said)
        if "incomplete" in message:  # files missing: fetched on their own, not 8 GB again
            how = f"`hf download {repo}` fetches what is missing (so does a run online)"
        else:
            how = f"fetch it again with `hf download {repo} --force-download`"
        error.args = (f"{message}; this copy is in the Hugging Face cache: {how}",)
