"""Seconds of audio per second of wall time for a 20-sentence text: batched vs sequential.

Batched: ``synthesize(split=True)`` with the engine's batch of B segments at a time.
Sequential: the same segments one after another (batch of 1). Same seeds, same frames
(END is suppressed in memory for any checkpoint, so every segment runs ``--frames`` frames).

    python benchmarks/batch_throughput.py [--config wide|CHECKPOINT_DIR] [--batch 4] [--frames 6]
                                          [--dtype bfloat16|float32] [--repeats 5]

A built-in config computes in bfloat16 unless ``--dtype`` says otherwise; a checkpoint
directory in its own dtype (``--dtype`` converts it on load).

Wall times are medians of ``--repeats`` runs of each mode, interleaved.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from common import (
    SENTENCES,
    TINY_WIDE_FULL,
    at_least_one,
    command_line,
    label,
    pick_voice,
    record,
    resolve,
    run_script,
    suppress_end,
)

CONFIGS = TINY_WIDE_FULL


def main(argv: list[str] | None = None) -> int:
    import voxtral_mlx
    from voxtral_mlx.fileio import dtype_name

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="wide", help=f"{sorted(CONFIGS)} or a directory")
    parser.add_argument("--batch", type=at_least_one, default=4)
    parser.add_argument("--frames", type=at_least_one, default=6)
    parser.add_argument("--repeats", type=at_least_one, default=5, help="runs per mode (median)")
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        help="compute dtype (default: bfloat16 for a built-in config, a directory's own)",
    )
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args(argv)
    path = resolve(args.config, CONFIGS, args.dtype or "bfloat16")
    voice = pick_voice(path)
    tts = voxtral_mlx.load(path, dtype=args.dtype)
    dtype = dtype_name(tts.dtype)
    print(f"{label(args.config)}: {dtype} compute", flush=True)
    suppress_end(tts)
    kwargs = {"seed": 1, "split": True, "max_chars": 80, "max_frames": args.frames, "pause": 0.0}
    tts.synthesize(SENTENCES[:200], voice, **kwargs)  # warm-up

    walls: dict[str, list[float]] = {"sequential": [], "batched": []}
    durations: dict[str, float] = {}
    for _ in range(max(1, args.repeats)):  # interleaved: a slow spell hits both modes
        for mode, batch in (("sequential", 1), ("batched", args.batch)):
            tts.engine.max_batch = batch
            t0 = time.perf_counter()
            speech = tts.synthesize(SENTENCES, voice, **kwargs)
            wall = time.perf_counter() - t0
            walls[mode].append(wall)
            durations[mode] = speech.duration
            print(f"{mode}: {speech.duration:.1f} s of audio in {wall:.1f} s", flush=True)
    results = {}
    for mode, times in walls.items():
        wall = statistics.median(times)
        results[mode] = (durations[mode] / wall, wall, durations[mode])
    ratio = results["batched"][0] / results["sequential"][0]
    rows = [("mode", "audio s", "wall s", "audio s / wall s")]
    for mode, (speed, wall, dur) in results.items():
        rows.append(
            (
                f"{mode} (B={args.batch if mode == 'batched' else 1})",
                f"{dur:.1f}",
                f"{wall:.1f}",
                f"{speed:.3f}",
            )
        )
    rows.append(("batched / sequential", "", "", f"{ratio:.2f}x"))
    for r in rows:
        print(" | ".join(r))
    if not args.no_record:
        print(
            record(
                f"Batched throughput, 20 sentences ({label(args.config)}, {dtype})",
                command_line(__file__, argv or sys.argv[1:]),
                rows,
                runs=args.repeats,
            )
        )
    return 0


if __name__ == "__main__":
    run_script(main)
