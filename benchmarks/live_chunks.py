"""A played stream: one-frame codec chunks throughout vs chunks that grow once playing.

``speak`` and ``say()`` stream one frame per chunk for first audio; once the player holds
audio ahead, they let chunks grow to 2, 4, 8 frames (``voxtral_mlx.audio.chunking``),
which runs the codec's step (and reads its weights) once per chunk instead of once per
frame. Measured on the same model in one run, interleaved: wall time per frame of a
stream whose first chunk is one frame and whose later chunks are ``n`` frames, for n = 1
(before) and 2, 4, 8, and its first chunk's time (unchanged by design).

    python benchmarks/live_chunks.py [--configs tiny,wide,CHECKPOINT_DIR] [--frames 48]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from common import (
    TEXT,
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
SIZES = (1, 2, 4, 8)


def run(tts, voice: str, frames: int, later: int) -> tuple[float, float]:
    """(first chunk s, wall s per frame after it) of a stream of ``frames`` frames."""
    t0 = time.perf_counter()
    with tts.stream(TEXT, voice, seed=0, max_frames=frames) as stream:
        first = next(stream)
        t1 = time.perf_counter()
        stream.set_chunk_frames(later)
        rest = sum(chunk.frames for chunk in stream)
        t2 = time.perf_counter()
    if first.frames + rest != frames:
        raise SystemExit(f"the stream made {first.frames + rest} frames, not {frames}")
    return t1 - t0, (t2 - t1) / rest


def measure(name: str, frames: int, repeats: int) -> dict[int, tuple[float, float]]:
    import voxtral_mlx

    path = resolve(name, CONFIGS)
    voice = pick_voice(path)
    tts = voxtral_mlx.load(path, prefix_cache_dir=None)
    suppress_end(tts)
    for n in SIZES:  # warm up: each chunk size is one more compiled codec graph
        run(tts, voice, min(frames, 2 * n + 1), n)
    runs: dict[int, list[tuple[float, float]]] = {n: [] for n in SIZES}
    for _ in range(repeats):
        for n in SIZES:
            runs[n].append(run(tts, voice, frames, n))
    tts.close()
    return {
        n: (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs))
        for n, rs in runs.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="tiny")
    parser.add_argument("--frames", type=at_least_one, default=48)
    parser.add_argument("--repeats", type=at_least_one, default=5)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args(argv)
    if args.frames < 2 * max(SIZES) + 1:
        raise SystemExit(f"--frames must be at least {2 * max(SIZES) + 1}")
    header = ["config", "first chunk, 1-frame chunks"]
    for n in SIZES:
        header.append(f"ms/frame, later chunks of {n}")
    header += [f"{n} / 1" for n in SIZES[1:]]
    rows = [tuple(header)]
    for name in config_list(args.configs):
        m = measure(name, args.frames, args.repeats)
        per = {n: m[n][1] for n in SIZES}
        rows.append(
            (
                label(name),
                f"{1000 * m[1][0]:.0f} ms",
                *(f"{1000 * per[n]:.2f}" for n in SIZES),
                *(f"{per[n] / per[1]:.2f}" for n in SIZES[1:]),
            )
        )
        show_row(rows)
    if not args.no_record:
        print(
            record(
                "A played stream: one-frame chunks vs chunks that grow once playing",
                command_line(__file__, argv or sys.argv[1:]),
                rows,
                f"Medians of {args.repeats} interleaved runs of {args.frames} frames (END "
                "suppressed), one stream, cached voice: wall time per frame after the "
                "first chunk, whose own chunk is one frame in every run. speak and say() "
                "grow chunks to 8 frames once the player holds ~3 chunk-times of audio "
                "ahead (a frame generated 10x faster than real time: after ~0.2 s of audio).",
                runs=args.repeats,
            )
        )
    return 0


if __name__ == "__main__":
    run_script(main)
