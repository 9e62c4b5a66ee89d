"""Time loading tekken.json: cold (build + write cache), warm (cache hit), no cache.

Usage: python benchmarks/tokenizer_load.py [path/to/tekken.json] [--repeat N]

Without a path, a TTS-layout tekken.json is built from mistral-common's bundled vocab
(identical to the real model's) in a temporary folder. Caches go to temporary folders too.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from voxtral_mlx.errors import VoxtralError
from voxtral_mlx.synthetic.tekken import build_tekken, mistral_common_tekken_path, write_tekken
from voxtral_mlx.tokenizer import TekkenTokenizer


def timed(fn: Callable[[], object], repeat: int, setup: Callable[[], None] | None = None):
    walls, cpus = [], []
    for _ in range(repeat):
        if setup is not None:
            setup()
        w, c = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return walls, cpus


def report(name: str, walls: list[float], cpus: list[float]) -> None:
    def ms(xs: list[float]) -> str:
        return f"min {min(xs) * 1e3:6.0f} ms, median {statistics.median(xs) * 1e3:6.0f} ms"

    print(f"{name:28s} wall {ms(walls)} | cpu {ms(cpus)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tekken", nargs="?", type=Path, help="a tekken.json or a model directory")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error(f"--repeat must be at least 1, got {args.repeat}")
    if args.tekken is not None and args.tekken.is_dir():
        args.tekken = args.tekken / "tekken.json"
    if args.tekken is not None and not args.tekken.is_file():
        raise SystemExit(f"{args.tekken}: no such file; pass a tekken.json or a model directory")

    with tempfile.TemporaryDirectory(prefix="tok-bench-") as tmp:
        tmp_path = Path(tmp)
        path = args.tekken
        if path is None:
            if mistral_common_tekken_path() is None:
                raise SystemExit("pass a tekken.json (mistral-common is not installed)")
            path = write_tekken(tmp_path / "model" / "tekken.json", build_tekken({"v": 1}))
        print(f"tekken.json: {path} ({path.stat().st_size / 1e6:.1f} MB), repeat {args.repeat}")

        counter = iter(range(10**6))
        fresh: list[Path] = []

        def new_cache() -> None:
            fresh.append(tmp_path / f"cold-{next(counter)}")

        report(
            "cold (build + write cache)",
            *timed(
                lambda: TekkenTokenizer.from_file(path, cache_dir=fresh[-1]), args.repeat, new_cache
            ),
        )

        warm_dir = tmp_path / "warm"
        TekkenTokenizer.from_file(path, cache_dir=warm_dir)
        report(
            "warm (cache hit)",
            *timed(lambda: TekkenTokenizer.from_file(path, cache_dir=warm_dir), args.repeat),
        )

        blocker = tmp_path / "blocker"
        blocker.write_text("")
        report(
            "no cache (unwritable dir)",
            *timed(lambda: TekkenTokenizer.from_file(path, cache_dir=blocker / "x"), args.repeat),
        )

        tok = TekkenTokenizer.from_file(path, cache_dir=warm_dir)
        text = (
            "The quick brown fox jumps over the lazy dog. Où est la bibliothèque ? 你好，世界！ "
            * 200
        )
        walls, cpus = timed(lambda: tok.encode(text), args.repeat)
        report(f"encode {len(text)} chars", walls, cpus)


if __name__ == "__main__":
    try:
        main()
    except VoxtralError as e:  # a tekken.json the tokenizer refuses: its one-line reason
        raise SystemExit(f"{e}") from None
