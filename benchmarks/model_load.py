"""Loading a model: how long ``load()`` takes in a fresh process, its peak memory, and how
soon an app that quits while its model is still loading exits.

* load: ``voxtral_mlx.load(path, prefix_cache_dir=None)`` in a fresh process (the weights
  mostly in the page cache after the first run: the figure is reading, casting and fusing
  them, not the drive);
* quit while loading: a fresh process starts ``load()`` on a background thread (as an app
  does at launch), and its main thread returns halfway through the median load time; the
  figure is the time from that return to the process's end (interpreter exit closes the
  model, which stops a load between parts of its weights).

    python benchmarks/model_load.py [--configs tiny,wide,CHECKPOINT_DIR] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import (
    TINY_WIDE_FULL,
    at_least_one,
    command_line,
    config_list,
    label,
    record,
    resolve,
    run_script,
    show_row,
)

CONFIGS = TINY_WIDE_FULL


def child_load(path: str) -> dict:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    import voxtral_mlx

    t0 = time.perf_counter()
    tts = voxtral_mlx.load(path, prefix_cache_dir=None)
    loaded = time.perf_counter() - t0
    weights = sum(a.nbytes for _, a in tree_flatten(tts.model.parameters()))
    out = {"load": loaded, "peak": mx.get_peak_memory(), "weights": weights}
    tts.close()
    return out


def child_quit(path: str, after: str) -> None:
    import threading

    import voxtral_mlx

    def load() -> None:
        voxtral_mlx.load(path, prefix_cache_dir=None)

    t0 = time.perf_counter()
    threading.Thread(target=load, daemon=True).start()
    time.sleep(max(0.0, float(after) - (time.perf_counter() - t0)))
    print("quitting", flush=True)


def fresh(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, __file__, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run_load(path: Path) -> dict:
    proc = fresh("--child-load", str(path))
    out, err = proc.communicate()
    if proc.returncode:
        lines = err.strip().splitlines() or ["(no output)"]
        raise SystemExit(f"load failed: {lines[-1]}")
    return json.loads(out.strip().splitlines()[-1])


def run_quit(path: Path, after: float) -> float:
    """Seconds from the main thread's return to the process's end."""
    proc = fresh("--child-quit", str(path), str(after))
    proc.stdout.readline()
    quit_at = time.perf_counter()
    _, err = proc.communicate()
    waited = time.perf_counter() - quit_at
    if proc.returncode:
        lines = err.strip().splitlines() or ["(no output)"]
        raise SystemExit(f"the quitting process ended with status {proc.returncode}: {lines[-1]}")
    return waited


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    if args_in[:1] == ["--child-load"]:
        print(json.dumps(child_load(args_in[1])))
        return 0
    if args_in[:1] == ["--child-quit"]:
        child_quit(args_in[1], args_in[2])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="tiny,wide")
    parser.add_argument("--repeats", type=at_least_one, default=5)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args(args_in)
    rows = [
        (
            "config",
            "weights",
            "load()",
            "weights read per second",
            "peak MLX memory",
            "quit halfway through a load: exit after",
        )
    ]
    for name in config_list(args.configs):
        path = resolve(name, CONFIGS)
        run_load(path)  # the files into the page cache; MLX's kernels compiled
        loads = [run_load(path) for _ in range(args.repeats)]
        median = statistics.median(r["load"] for r in loads)
        quits = [run_quit(path, median / 2) for _ in range(args.repeats)]
        weights = loads[0]["weights"]
        rows.append(
            (
                label(name),
                f"{weights / 2**20:.0f} MiB",
                f"{median:.2f} s",
                f"{weights / median / 1e9:.2f} GB/s",
                f"{statistics.median(r['peak'] for r in loads) / 2**20:.0f} MiB",
                f"{statistics.median(quits):.2f} s",
            )
        )
        show_row(rows)
    if not args.no_record:
        notes = (
            "Fresh process per run, medians; the files were read once before the timed runs "
            "(page cache warm). Quit: load() started on a background thread, the main thread "
            "returning at half the median load time; exit after = from that return to the "
            "process's end (the interpreter's exit closes the model: a load stops at its "
            "next part of ~256 MiB)."
        )
        print(record("Loading a model", command_line(__file__, args_in), rows, notes, args.repeats))
    return 0


if __name__ == "__main__":
    run_script(main)
