"""How long splitting a long text holds the GIL: the longest gap of a thread ticking every
millisecond beside ``split_text``, for texts with and without whitespace.

Usage: python benchmarks/split_stall.py [--repeat N] [--mb M] [--no-record]

An app's event loop or UI thread waits for whatever one C call of the splitter holds; the
split itself takes about a second per MB either way.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

from common import command_line, record, show_row

from voxtral_mlx.segment import split_text


def texts(mb: float) -> dict[str, str]:
    n = int(mb * 1_000_000)
    sentence = "The quick brown fox jumps over the lazy dog. "
    cjk = "这是一个测试句子，我们在这里说话。"
    return {
        "one run of letters": "a" * n,
        "Chinese, no line breaks": cjk * (n // (3 * len(cjk))),  # about n bytes of UTF-8
        "English words": sentence * (n // len(sentence)),
    }


def stall(text: str) -> tuple[float, float]:
    """Seconds the split took, and the longest gap between two ticks beside it."""
    gaps: list[float] = []
    done = threading.Event()

    def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    t0 = time.perf_counter()
    split_text(text)
    took = time.perf_counter() - t0
    done.set()
    ticker.join()
    return took, max(gaps)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--mb", type=float, default=3.0, help="size of each text (default 3)")
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args(argv)
    if args.repeat < 1 or args.mb <= 0:
        parser.error("--repeat must be at least 1 and --mb positive")
    rows = [("text", "characters", "split ms", "longest stall ms")]
    for name, text in texts(args.mb).items():
        runs = [stall(text) for _ in range(args.repeat)]
        took = statistics.median(r[0] for r in runs)
        longest = statistics.median(r[1] for r in runs)
        rows.append((name, f"{len(text):,}", f"{took * 1e3:.0f}", f"{longest * 1e3:.0f}"))
        show_row(rows)
    if not args.no_record:
        record(
            "Splitting a long text: how long the GIL is held",
            command_line(__file__, sys.argv[1:] if argv is None else argv),
            rows,
            notes="Longest stall: the longest gap of a thread ticking every millisecond "
            "beside `split_text` (what an app's event loop or UI thread would wait).",
            runs=args.repeat,
        )


if __name__ == "__main__":
    main()
