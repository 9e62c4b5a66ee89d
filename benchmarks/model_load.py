"""Loading a model: how long ``load()`` takes in a fresh process, its peak memory, and how
soon an app that quits while its model is still loading exits.

* load: ``voxtral_mlx.load(path, prefix_cache_dir=None)`` in a fresh process (the weights
  mostly in the page cache after the first run: the figure is reading, casting and fusing
  them, not the drive);
* load by repo id: the same files laid out as a Hugging Face cache (links, refs/main) and
  loaded by repo id, the Hub's answer to whether the repo changed (one request on a real
  run) simulated by a listing that answers the copy is current after ``--hub-latency``
  seconds; "Hub wait paid" is the extra time over the load by path, as a fraction of that
  latency (1: the load waited for the answer; 0: it read meanwhile);
* quit while loading: a fresh process starts ``load()`` on a background thread (as an app
  does at launch), and its main thread returns halfway through the median load time; the
  figure is the time from that return to the process's end (interpreter exit closes the
  model, which stops a load between parts of its weights).

    python benchmarks/model_load.py [--configs tiny,wide,CHECKPOINT_DIR] [--repeats 5]
                                    [--hub-latency 1.0]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
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


REPO = "bench/voxtral-load"
COMMIT = "0" * 40


def hub_cache(model_dir: Path, root: Path) -> Path:
    """``model_dir`` laid out as a Hugging Face cache holding :data:`REPO` at :data:`COMMIT`
    (its snapshot's files linked to the originals, as the cache links them to its blobs)."""
    repo = root / f"models--{REPO.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    for file in model_dir.rglob("*"):
        if file.is_file():
            link = snapshot / file.relative_to(model_dir)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(file.resolve())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


def child_repo(model_dir: str, latency: str) -> dict:
    """``load(REPO)`` from the cache in ``$HF_HUB_CACHE``, the Hub's listing simulated."""
    import voxtral_mlx
    import voxtral_mlx.hub as hub

    source = Path(model_dir)
    files = {
        p.relative_to(source).as_posix(): p.stat().st_size for p in source.rglob("*") if p.is_file()
    }

    def listing(repo_id: str):
        time.sleep(float(latency))
        return files, COMMIT

    hub._list_files = listing
    t0 = time.perf_counter()
    tts = voxtral_mlx.load(REPO, prefix_cache_dir=None)
    loaded = time.perf_counter() - t0
    tts.close()
    return {"load": loaded}


def child_quit(path: str, after: str) -> None:
    import threading

    import voxtral_mlx

    def load() -> None:
        voxtral_mlx.load(path, prefix_cache_dir=None)

    t0 = time.perf_counter()
    threading.Thread(target=load, daemon=True).start()
    time.sleep(max(0.0, float(after) - (time.perf_counter() - t0)))
    print("quitting", flush=True)


def fresh(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, __file__, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def run_load(path: Path, *args: str, env: dict | None = None) -> dict:
    proc = fresh(*(args or ("--child-load", str(path))), env=env)
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
    if args_in[:1] == ["--child-repo"]:
        print(json.dumps(child_repo(args_in[1], args_in[2])))
        return 0
    if args_in[:1] == ["--child-quit"]:
        child_quit(args_in[1], args_in[2])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="tiny,wide")
    parser.add_argument("--repeats", type=at_least_one, default=5)
    parser.add_argument("--hub-latency", type=float, default=1.0, help="seconds")
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args(args_in)
    rows = [
        (
            "config",
            "weights",
            "load()",
            "weights read per second",
            "peak MLX memory",
            f"load(repo id), the Hub answering in {args.hub_latency:g} s",
            "Hub wait paid",
            "quit halfway through a load: exit after",
        )
    ]
    for name in config_list(args.configs):
        path = resolve(name, CONFIGS)
        run_load(path)  # the files into the page cache; MLX's kernels compiled
        loads = [run_load(path) for _ in range(args.repeats)]
        median = statistics.median(r["load"] for r in loads)
        root = Path(tempfile.mkdtemp(prefix="voxtral-bench-hub-"))
        try:
            hub_cache(path, root)
            env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
            env["HF_HUB_CACHE"] = str(root)
            child = ("--child-repo", str(path), str(args.hub_latency))
            by_repo = statistics.median(
                run_load(path, *child, env=env)["load"] for _ in range(args.repeats)
            )
        finally:
            shutil.rmtree(root, ignore_errors=True)
        paid = (by_repo - median) / args.hub_latency if args.hub_latency > 0 else 0.0
        quits = [run_quit(path, median / 2) for _ in range(args.repeats)]
        weights = loads[0]["weights"]
        rows.append(
            (
                label(name),
                f"{weights / 2**20:.0f} MiB",
                f"{median:.2f} s",
                f"{weights / median / 1e9:.2f} GB/s",
                f"{statistics.median(r['peak'] for r in loads) / 2**20:.0f} MiB",
                f"{by_repo:.2f} s",
                f"{paid:.2f}",
                f"{statistics.median(quits):.2f} s",
            )
        )
        show_row(rows)
    if not args.no_record:
        notes = (
            "Fresh process per run, medians; the files were read once before the timed runs "
            "(page cache warm). Load by repo id: the same files as a Hugging Face cache, the "
            "Hub's answer that the copy is current simulated (a listing answering after the "
            "latency); Hub wait paid = (load by repo id - load()) / latency. Quit: load() "
            "started on a background thread, the main thread "
            "returning at half the median load time; exit after = from that return to the "
            "process's end (the interpreter's exit closes the model: a load stops at its "
            "next part of ~256 MiB)."
        )
        print(record("Loading a model", command_line(__file__, args_in), rows, notes, args.repeats))
    return 0


if __name__ == "__main__":
    run_script(main)
