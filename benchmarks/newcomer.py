"""A new request while a long text fills the batch: its time to first audio.

A long ``split=True`` text generates ``max_batch`` segments at once (its default
look-ahead), so every batch slot is taken. A segment generated ahead gives its slot to a
request someone is waiting for (it is set aside and resumes later); without that, the new
request would wait for one of the long text's segments to finish. Measured on the same
model in one run: a short request's first audio on an idle engine, and beside the long text.

    python benchmarks/newcomer.py [--configs tiny,CHECKPOINT_DIR] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from common import (
    TINY_AND_WIDE,
    at_least_one,
    command_line,
    config_list,
    label,
    pick_voice,
    record,
    resolve,
    run_script,
    show_row,
    suppress_end,
)

CONFIGS = TINY_AND_WIDE
CHAPTER = " ".join(f"Sentence number {i} of a long chapter, read aloud." for i in range(40))
SHORT = "Quick one."


def first_audio(tts, voice: str, seed: int) -> float:
    t0 = time.perf_counter()
    with tts.stream(SHORT, voice, seed=seed, max_frames=4) as stream:
        next(stream)
        return time.perf_counter() - t0


def measure(name: str, repeats: int) -> dict[str, float]:
    import voxtral_mlx

    path = resolve(name, CONFIGS)
    voice = pick_voice(path)
    tts = voxtral_mlx.load(path)
    suppress_end(tts)
    tts.synthesize("Warm up.", voice, seed=0, max_frames=2)
    idle = statistics.median(first_audio(tts, voice, seed) for seed in range(repeats))
    beside = []
    for seed in range(repeats):
        with tts.stream(CHAPTER, voice, seed=seed, split=True, max_frames=400) as chapter:
            next(chapter)
            deadline = time.monotonic() + 600
            while tts.engine.stats()["active"] < tts.engine.max_batch:
                if time.monotonic() > deadline:
                    raise SystemExit("the long text never filled the batch")
                time.sleep(0.002)
            beside.append(first_audio(tts, voice, seed))
    tts.close()
    return {"idle": idle, "beside": statistics.median(beside), "worst": max(beside)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="tiny")
    parser.add_argument("--repeats", type=at_least_one, default=5)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args(argv)
    rows = [
        (
            "config",
            "first audio, idle engine",
            "first audio beside a long text filling the batch (median)",
            "worst",
        )
    ]
    for name in config_list(args.configs):
        m = measure(name, args.repeats)
        rows.append((label(name), *(f"{1000 * m[k]:.0f} ms" for k in ("idle", "beside", "worst"))))
        show_row(rows)
    if not args.no_record:
        command = command_line(__file__, argv or sys.argv[1:])
        print(record("A new request beside a long text", command, rows, runs=args.repeats))
    return 0


if __name__ == "__main__":
    run_script(main)
