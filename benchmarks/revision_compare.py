"""ms per frame of two revisions of voxtral_mlx on the same checkpoint, same process run.

Used to record before/after figures of hot-path changes. Each revision runs in its own
subprocess (working directory and ``PYTHONPATH``: its tree), alternating, so machine load
hits both alike.

    python benchmarks/revision_compare.py BEFORE_TREE AFTER_TREE [--config tiny|wide]
                                          [--streams N]

With ``--streams N``: N concurrent streaming requests (one-frame chunks, each from its own
thread, as a server or an app with several voices makes them) served as one batch; the
figure is wall time per batch frame.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from common import TEXT, VOICE, at_least_one, checkpoint, command_line, record, run_script

CHILD = """
import json, sys, time
import numpy as np
import voxtral_mlx
path, text, voice = sys.argv[1:4]
n1, n2, repeats = (int(a) for a in sys.argv[4:7])
tts = voxtral_mlx.load(path)
noise = np.random.default_rng(0).standard_normal((n2, 36)).astype(np.float32)
def run(n):
    t0 = time.perf_counter()
    s = tts.synthesize(text, voice, noise=noise[:n], max_frames=n)
    assert len(s.codes) == n
    return time.perf_counter() - t0
run(n1)
out = [1000 * (run(n2) - run(n1)) / (n2 - n1) for _ in range(repeats)]
print(json.dumps(out))
"""

STREAMS_CHILD = """
import json, sys, threading, time
import voxtral_mlx
path, text, voice = sys.argv[1:4]
n1, n2, repeats, streams = (int(a) for a in sys.argv[4:8])
tts = voxtral_mlx.load(path)
def one(i):
    for _ in tts.stream(text, voice, seed=i, chunk_frames=1, max_frames=n2):
        pass
def run():
    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return 1000 * (time.perf_counter() - t0) / n2
run()
print(json.dumps([run() for _ in range(repeats)]))
"""

# Printed first by every child: which voxtral_mlx it imported.
WHERE = "import voxtral_mlx as _v; print(_v.__file__)\n"


def run_child(tree: str, child: str, args: list[str]) -> list[float]:
    """``child``'s timings (the JSON list it prints last), run with ``tree``'s voxtral_mlx.

    The working directory is the tree too: ``python -c`` puts it first on ``sys.path``, so
    run from another checkout (the repository root) both revisions would import that one.
    Stops if the child imported voxtral_mlx from anywhere else.
    """
    tree = str(Path(tree).resolve())
    proc = subprocess.run(
        [sys.executable, "-c", WHERE + child, *args],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": tree},
        capture_output=True,
        text=True,
    )
    lines = proc.stdout.strip().splitlines()
    where = lines[0] if lines else ""
    if where and not Path(where).resolve().is_relative_to(tree):
        raise SystemExit(f"{tree}: the run imported voxtral_mlx from {where}, not from this tree")
    if proc.returncode:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"{tree}: the run failed (exit status {proc.returncode})")
    return json.loads(lines[-1])


CONFIGS = {"tiny": ("tiny", None, None, 8, 40), "wide": ("wide", 2, 3, 1, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--config", default="tiny", choices=sorted(CONFIGS))
    parser.add_argument("--rounds", type=at_least_one, default=3)
    parser.add_argument("--streams", type=int, default=0, help="concurrent streaming requests")
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args(argv)
    child = STREAMS_CHILD if args.streams else CHILD
    size, layers, flow_layers, n1, n2 = CONFIGS[args.config]
    path = checkpoint(size, n_layers=layers, flow_layers=flow_layers)
    results: dict[str, list[float]] = {"before": [], "after": []}
    child_args = [str(path.resolve()), TEXT, VOICE, str(n1), str(n2), "3", str(args.streams)]
    for _ in range(args.rounds):
        for label in ("before", "after"):
            results[label] += run_child(getattr(args, label), child, child_args)
    before, after = (statistics.median(results[k]) for k in ("before", "after"))
    rows = [
        ("revision", "ms per batch frame" if args.streams else "ms/frame", "runs (median)"),
        (f"before ({args.before})", f"{before:.1f}", str(len(results["before"]))),
        (f"after ({args.after})", f"{after:.1f}", str(len(results["after"]))),
        ("after / before", f"{after / before:.2f}", ""),
    ]
    for r in rows:
        print(" | ".join(r))
    if not args.no_record:
        print(
            record(
                f"Lean frame step, before/after ({args.config}"
                + (f", {args.streams} concurrent streams)" if args.streams else ")"),
                command_line(__file__, argv or sys.argv[1:]),
                rows,
            )
        )
    return 0


if __name__ == "__main__":
    run_script(main)
