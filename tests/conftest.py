"""Shared fixtures: tiny random checkpoints in Mistral's published layout, built once."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# Keep the tokenizer cache (and anything else cached) out of the user's home, one cache per
# process: pytest-xdist's workers inherit the environment, and tests that look into the
# cache (what a clear left, which files were written) must not see another worker's files.
_CACHE = tempfile.mkdtemp(prefix="voxtral-mlx-test-cache-")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
if os.environ.get("VOXTRAL_MLX_CACHE") in (None, os.environ.get("VOXTRAL_MLX_TEST_CACHE")):
    os.environ["VOXTRAL_MLX_CACHE"] = os.environ["VOXTRAL_MLX_TEST_CACHE"] = _CACHE

# The CLI tests start a few hundred Python processes. Where the environment turns bytecode
# caching off, each of them compiled the package from source (0.3 s apiece): theirs goes to
# one lasting folder instead (never beside the sources; this process is unaffected).
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None):
    os.environ.setdefault(
        "PYTHONPYCACHEPREFIX", str(Path(tempfile.gettempdir()) / "voxtral-mlx-tests-pycache")
    )

# MLX's CPU backend compiles fused kernels with g++ into $TMPDIR/mlx, with no lock between
# processes: a worker could read a source file another is rewriting, or load a library
# another is still linking. Each worker keeps its own (lasting, so later runs reuse it).
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _WORKER:
    _JIT = Path(tempfile.gettempdir()) / f"voxtral-mlx-tests-{_WORKER}"
    _JIT.mkdir(exist_ok=True)
    os.environ["TMPDIR"] = str(_JIT)


def _share_kernel_compiles() -> None:
    """Put tests/gxx_pool.py first on PATH as ``g++``: one compile per kernel for all workers.

    Workers inherit the environment, so the controller's setting reaches all of them (and
    the CLI processes they start). The pool lasts between runs; it is keyed so that another
    MLX, compiler or flag set never reuses a library.
    """
    if sys.platform == "darwin" or os.environ.get("VOXTRAL_MLX_TESTS_GXX"):
        return
    compiler = shutil.which("g++")
    if compiler is None:
        return
    bin_dir = tempfile.mkdtemp(prefix="voxtral-mlx-tests-bin-")
    atexit.register(shutil.rmtree, bin_dir, ignore_errors=True)
    wrapper = Path(bin_dir) / "g++"
    pool = Path(__file__).with_name("gxx_pool.py")
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "{pool}" "$@"\n')
    wrapper.chmod(0o755)
    os.environ["VOXTRAL_MLX_TESTS_GXX"] = os.path.realpath(compiler)
    os.environ["VOXTRAL_MLX_TESTS_JIT_POOL"] = str(
        Path(tempfile.gettempdir()) / "voxtral-mlx-tests-jit-pool"
    )
    os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


_share_kernel_compiles()
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """Float32 tiny checkpoint (parity tests run in float32)."""
    from voxtral_mlx.synthetic.checkpoint import build_random_checkpoint

    return build_random_checkpoint(
        tmp_path_factory.mktemp("tiny-f32"), "tiny", seed=0, dtype="float32"
    )


@pytest.fixture(scope="session")
def tiny_checkpoint_bf16(tmp_path_factory) -> Path:
    """BF16 tiny checkpoint, as published (bf16 weights, bf16 .pt voices)."""
    from voxtral_mlx.synthetic.checkpoint import build_random_checkpoint

    return build_random_checkpoint(tmp_path_factory.mktemp("tiny-bf16"), "tiny", seed=1)


@pytest.fixture(scope="session")
def tiny_checkpoint_noend(tmp_path_factory) -> Path:
    """Float32 tiny checkpoint whose END never fires: every utterance runs ``max_frames``."""
    from voxtral_mlx.synthetic.checkpoint import build_random_checkpoint

    return build_random_checkpoint(
        tmp_path_factory.mktemp("tiny-noend"), "tiny", seed=2, dtype="float32", suppress_end=True
    )


@pytest.fixture(scope="session")
def tiny_tts(tiny_checkpoint):
    import voxtral_mlx

    return voxtral_mlx.load(tiny_checkpoint)


@pytest.fixture
def split_threads(monkeypatch) -> list:
    """The threads ``VoxtralTTS`` splits text on, in call order (``split_text`` recorded)."""
    import threading

    import voxtral_mlx.tts as tts_module

    threads: list[threading.Thread] = []
    original = tts_module.split_text

    def split_text(*args, **kwargs):
        threads.append(threading.current_thread())
        return original(*args, **kwargs)

    monkeypatch.setattr(tts_module, "split_text", split_text)
    return threads


@pytest.fixture
def batch_sizes(monkeypatch) -> set[int]:
    """The numbers of rows the frame steps ran with from here on (finished sequences have
    left: ``FrameBatch.advance`` recorded)."""
    from voxtral_mlx import generate

    sizes: set[int] = set()
    advance = generate.FrameBatch.advance

    def counting(self):
        parked = advance(self)
        sizes.add(len(self.rows))
        return parked

    monkeypatch.setattr(generate.FrameBatch, "advance", counting)
    return sizes
