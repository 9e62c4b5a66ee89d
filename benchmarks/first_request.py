"""The first request after start-up: what an app's first click (or a server's first client)
waits for, in a fresh process each time.

* cold: ``load()``, then at once a streamed request (1-frame chunks): its first audio pays
  for reading the weights in, compiling the frame and codec step and prefilling the voice;
* after warmup: ``load()``, ``warmup(voice)`` (as an app does at launch, while its window
  opens), then the request;
* mlx-audio: its model loaded, then ``generate(stream=True, streaming_interval=0.08)``
  (one-frame chunks, its fastest first chunk).

Times run from the call to the first playable sample; each run uses a fresh voice-prefix
directory, so "cold" is a voice never used on the machine. MLX's compiled CPU kernels are
cached on disk between processes, so here "cold" does not include g++ (it does on a
machine's very first run).

    python benchmarks/first_request.py [--configs tiny,wide,CHECKPOINT_DIR] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import (
    TEXT,
    TINY_AND_WIDE,
    at_least_one,
    check_comparable,
    command_line,
    config_list,
    label,
    load_reference,
    mask_end,
    pick_voice,
    record,
    reference_voice,
    require_audio,
    resolve,
    run_script,
    show_row,
    suppress_end,
)

CONFIGS = TINY_AND_WIDE


def child(mode: str, path: str, cache: str) -> dict[str, float]:
    """One fresh process's figures (seconds)."""
    voice = pick_voice(Path(path))
    t0 = time.perf_counter()
    if mode == "mlx-audio":
        ref = load_reference(Path(path))
        reference_voice(
            ref, Path(path), voice, ref.audio_codebook_embeddings["embeddings"].weight.dtype
        )
        loaded = time.perf_counter() - t0
        mask_end(ref.acoustic_transformer)  # END at once would give it no chunk to time
        t1 = time.perf_counter()
        it = ref.generate(TEXT, voice=voice, max_tokens=4, stream=True, streaming_interval=0.08)
        require_audio(next(iter(it)).audio, mode)
        return {"load": loaded, "warmup": 0.0, "first_audio": time.perf_counter() - t1}
    import voxtral_mlx

    tts = voxtral_mlx.load(path, prefix_cache_dir=cache)
    loaded = time.perf_counter() - t0
    suppress_end(tts)  # before anything is compiled: a checkpoint may end at once
    warm = tts.warmup(voice).result() if mode == "warmup" else 0.0
    t1 = time.perf_counter()
    stream = tts.stream(TEXT, voice, seed=0, max_frames=4)
    require_audio(next(iter(stream)).audio, mode)
    first = time.perf_counter() - t1
    stream.close()
    tts.close()
    return {"load": loaded, "warmup": warm, "first_audio": first}


def run(mode: str, path: Path) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as cache:
        out = subprocess.run(
            [sys.executable, __file__, "--child", mode, str(path), cache],
            capture_output=True,
            text=True,
            check=False,
        )
    if out.returncode:
        lines = out.stderr.strip().splitlines() or ["(no output)"]
        raise SystemExit(f"{mode} run failed: {lines[-1]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    if args_in[:1] == ["--child"]:
        print(json.dumps(child(*args_in[1:4])))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="tiny")
    parser.add_argument("--repeats", type=at_least_one, default=5)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args(args_in)
    rows = [
        (
            "config",
            "ours cold: first audio",
            "ours: warmup()",
            "ours after warmup: first audio",
            "mlx-audio: first audio",
            "cold / mlx-audio",
            "warm / mlx-audio",
        )
    ]
    for name in config_list(args.configs):
        path = resolve(name, CONFIGS)
        check_comparable(path, pick_voice(path))  # not after the runs of ours
        runs: dict[str, list[dict[str, float]]] = {"cold": [], "warmup": [], "mlx-audio": []}
        for _ in range(args.repeats):  # interleaved: drift hits all three alike
            for mode, results in runs.items():
                results.append(run(mode, path))

        def med(mode: str, key: str, runs=runs) -> float:
            return statistics.median(r[key] for r in runs[mode])

        cold, warm = med("cold", "first_audio"), med("warmup", "first_audio")
        theirs = med("mlx-audio", "first_audio")
        rows.append(
            (
                label(name),
                f"{cold * 1e3:.0f} ms",
                f"{med('warmup', 'warmup'):.2f} s",
                f"{warm * 1e3:.0f} ms",
                f"{theirs * 1e3:.0f} ms",
                f"{cold / theirs:.2f}",
                f"{warm / theirs:.2f}",
            )
        )
        show_row(rows)
    if not args.no_record:
        notes = (
            "Fresh process per run, medians; first audio from the call to the first chunk "
            "(one frame). Cold: the first request right after load(). After warmup: "
            "load(), warmup(voice) (an app at launch, a server before it accepts "
            "requests), then the request. mlx-audio: its first one-frame chunk after loading."
        )
        print(
            record(
                "First request after start-up",
                command_line(__file__, args_in),
                rows,
                notes,
                runs=args.repeats,
            )
        )
    return 0


if __name__ == "__main__":
    run_script(main)
