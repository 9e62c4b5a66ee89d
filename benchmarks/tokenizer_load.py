"""Time loading tekken.json: cold (build + write cache), warm (cache hit), no cache.

Usage: python benchmarks/tokenizer_load.py [path/to/tekken.json] [--repeat N] [--no-record]

Without a path, a TTS-layout tekken.json is built from mistral-common's bundled vocab
(identical to the real model's) in a temporary folder. Caches go to temporary folders too.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from common import command_line, record, show_row

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


def row(name: str, walls: list[float], cpus: list[float]) -> tuple[str, ...]:
    def ms(xs: list[float]) -> tuple[str, str]:
        return f"{min(xs) * 1e3:.0f}", f"{statistics.median(xs) * 1e3:.0f}"

    return (name, *ms(walls), *ms(cpus))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tekken", nargs="?", type=Path, help="a tekken.json or a model directory")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args(argv)
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
        size_mb = path.stat().st_size / 1e6
        print(f"tekken.json: {path} ({size_mb:.1f} MB), repeat {args.repeat}")
        rows = [("load", "wall min ms", "wall median ms", "cpu min ms", "cpu median ms")]

        counter = iter(range(10**6))
        fresh: list[Path] = []

        def new_cache() -> None:
            fresh.append(tmp_path / f"cold-{next(counter)}")

        rows.append(
            row(
                "cold (build + write cache)",
                *timed(
                    lambda: TekkenTokenizer.from_file(path, cache_dir=fresh[-1]),
                    args.repeat,
                    new_cache,
                ),
            )
        )
        show_row(rows)

        warm_dir = tmp_path / "warm"
        TekkenTokenizer.from_file(path, cache_dir=warm_dir)
        rows.append(
            row(
                "warm (cache hit)",
                *timed(lambda: TekkenTokenizer.from_file(path, cache_dir=warm_dir), args.repeat),
            )
        )
        show_row(rows)

        blocker = tmp_path / "blocker"
        blocker.write_text("")
        rows.append(
            row(
                "no cache (unwritable dir)",
                *timed(
                    lambda: TekkenTokenizer.from_file(path, cache_dir=blocker / "x"), args.repeat
                ),
            )
        )
        show_row(rows)

        tok = TekkenTokenizer.from_file(path, cache_dir=warm_dir)
        text = (
            "The quick brown fox jumps over the lazy dog. Où est la bibliothèque ? 你好，世界！ "
            * 200
        )
        rows.append(row(f"encode {len(text)} chars", *timed(lambda: tok.encode(text), args.repeat)))
        show_row(rows)
    if not args.no_record:
        source = "built from mistral-common's vocab" if args.tekken is None else "as given"
        record(
            "Loading tekken.json",
            command_line(__file__, sys.argv[1:] if argv is None else argv),
            rows,
            notes=f"tekken.json of {size_mb:.1f} MB ({source}); caches in temporary folders. "
            "Cold: the tokenizer built from the JSON and its cache written; warm: read from "
            "that cache; no cache: built, the cache folder unwritable.",
            runs=args.repeat,
        )


if __name__ == "__main__":
    try:
        main()
    except VoxtralError as e:  # a tekken.json the tokenizer refuses: its one-line reason
        raise SystemExit(f"{e}") from None
