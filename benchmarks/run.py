"""The benchmark suite (`make bench` = --quick, `make bench-full` = --full).

Every script builds its random checkpoint once (cached under ~/.cache/voxtral_mlx/bench),
measures voxtral_mlx and, where one exists, mlx-audio in the same process run, and appends
a section to benchmarks/RESULTS.md with the command, machine, date and medians.

    quick: the overhead-bound figures on the tiny config (frame speed, time to first audio,
           the first request after start-up, codec cost, batched throughput,
           quantized-code agreement), the weight-bound
           analysis of one wide frame, the bytes of weights a real frame reads at
           each precision (with the floor that sets on each Apple Silicon chip) and a
           played stream's cost per frame as its chunks grow
           -- a few minutes here
    full:  the same plus the real widths (frame speed, time to first audio and batched
           throughput against mlx-audio; the real codec), the full 26+3-layer model and
           how long loading the wide and full models takes
           -- an hour or more on a 2-core CPU
    model DIR: the quick comparisons on a checkpoint directory: Mistral's layout (any
           random checkpoint, e.g. from ``voxtral-mlx random-checkpoint``) or an MLX
           conversion (mlx-community's or ``voxtral-mlx convert``'s, quantized or not)
    openblas: on a Linux CPU only, the batching and overhead figures again in float32
           with the system OpenBLAS preloaded (``apt-get install libopenblas0-pthread``).
           MLX's own bf16 CPU matmuls run at 2-4 GFLOP/s, so there a product costs in
           proportion to its rows and batching cannot amortise anything; float32 through
           OpenBLAS is bound by reading the weights, as a GPU is -- about 25 minutes
"""

from __future__ import annotations

import argparse
import ctypes.util
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

QUICK = [
    ["frame_speed.py", "--configs", "tiny", "--repeats", "5"],
    ["ttfa.py", "--configs", "tiny", "--repeats", "5"],
    ["first_request.py", "--configs", "tiny", "--repeats", "5"],
    ["codec_bench.py", "--configs", "tiny", "--dtype", "bfloat16", "--record"],
    ["batch_throughput.py", "--config", "tiny", "--frames", "20"],
    ["weight_bound.py", "--config", "wide", "--repeats", "5"],
    ["quant_agreement.py", "--record"],
    ["weights_per_frame.py"],
    ["live_chunks.py", "--configs", "tiny"],
]
FULL = [
    *QUICK,
    # Medians of 5 runs, as everywhere, except the 26-layer model's: a frame takes minutes
    # on this CPU, so 3 runs there (each recorded section states its number of runs).
    ["frame_speed.py", "--configs", "wide", "--repeats", "5"],
    # mlx-audio's default 25-frame first chunk takes ~10 minutes per run at these widths.
    ["ttfa.py", "--configs", "wide", "--repeats", "5", "--no-default-interval"],
    # The real codec: some 6 minutes per run here (a third of it mlx-audio re-decoding 17
    # frames per one-frame chunk), so about half an hour.
    ["codec_bench.py", "--configs", "full", "--dtype", "bfloat16", "--record", "--repeats", "5"],
    [
        "batch_throughput.py",
        "--config",
        "wide",
        "--frames",
        "3",
        "--repeats",
        "5",
    ],  # bf16: see --openblas
    ["frame_speed.py", "--configs", "full", "--repeats", "3", "--no-reference"],
    ["weight_bound.py", "--config", "full", "--repeats", "3"],
    ["long_prompt.py", "--configs", "tiny", "--tokens", "1000,2000"],
    ["newcomer.py", "--configs", "tiny"],
    ["new_voice.py", "--configs", "tiny"],
    ["live_text.py", "--configs", "tiny"],
    ["model_load.py", "--configs", "wide,full"],
]


def model_suite(model: str) -> list[list[str]]:
    """The quick suite's comparisons on a given checkpoint directory: Mistral's layout (for
    instance one from ``voxtral-mlx random-checkpoint``; END need not be suppressed) or an
    MLX conversion (mlx-community's, mlx-audio's or ``voxtral-mlx convert``'s, quantized or
    not), which mlx-audio then reads with its own loader. The quantized-code agreement
    measures conversions of an unquantized checkpoint: it is left out for a quantized one."""
    from voxtral_mlx.loader import open_weights, read_model_config

    path = Path(model)
    suite = [
        ["frame_speed.py", "--configs", model, "--repeats", "5"],
        ["ttfa.py", "--configs", model, "--repeats", "5"],
        ["first_request.py", "--configs", model, "--repeats", "5"],
        # In the checkpoint's own dtype, as every script measures a directory.
        ["codec_bench.py", "--configs", model, "--record"],
        ["batch_throughput.py", "--config", model, "--frames", "20"],
    ]
    from common import check_comparable, pick_voice

    voice = pick_voice(path)  # no voices: every script needs one, so the run stops here
    try:
        check_comparable(path, voice)
    except SystemExit as e:  # e.g. MLX weights without config.json: mlx-audio cannot run
        print(
            f"{e} -- so ttfa.py and first_request.py, which compare with mlx-audio, are left "
            "out and frame_speed.py times voxtral_mlx alone",
            flush=True,
        )
        suite = [cmd for cmd in suite if cmd[0] not in ("ttfa.py", "first_request.py")]
        suite[0] = [*suite[0], "--no-reference"]
    quantized = open_weights(path, read_model_config(path)).quantized
    if quantized:
        print(
            f"{model} is quantized ({len(quantized)} layers): quant_agreement.py, which "
            "converts an unquantized checkpoint, is left out",
            flush=True,
        )
    else:
        suite.append(["quant_agreement.py", "--model", model, "--record"])
    return suite


OPENBLAS = [
    ["frame_speed.py", "--configs", "tiny", "--repeats", "5", "--dtype", "float32"],
    ["batch_throughput.py", "--config", "tiny", "--frames", "20", "--dtype", "float32"],
    [
        "batch_throughput.py",
        "--config",
        "wide",
        "--frames",
        "20",
        "--dtype",
        "float32",
        "--repeats",
        "3",
    ],
]


def openblas_env() -> dict[str, str]:
    """The environment that makes MLX's float32 CPU matmuls call the system OpenBLAS."""
    if sys.platform != "linux":
        raise SystemExit("--openblas is for Linux CPU runs (a Mac uses Metal and Accelerate)")
    lib = ctypes.util.find_library("openblas")
    if lib is None:
        raise SystemExit("no OpenBLAS found: apt-get install libopenblas0-pthread, then rerun")
    env = dict(os.environ)
    env["LD_PRELOAD"] = " ".join(filter(None, [lib, env.get("LD_PRELOAD")]))
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="the default")
    mode.add_argument("--full", action="store_true")
    mode.add_argument("--openblas", action="store_true")
    mode.add_argument(
        "--model", type=Path, help="run the quick comparisons on this checkpoint directory"
    )
    parser.add_argument(
        "--no-record", action="store_true", help="print the results only (RESULTS.md untouched)"
    )
    args = parser.parse_args(argv)
    env = openblas_env() if args.openblas else None
    if args.model is not None:
        args.model = args.model.expanduser()
        if not args.model.is_dir():
            raise SystemExit(f"{args.model}: no such checkpoint directory")
        from common import check_model_dir

        from voxtral_mlx.errors import VoxtralError

        check_model_dir(args.model)  # not a model: one line without the loader's Hub advice
        try:
            suite = model_suite(str(args.model.resolve()))
        except VoxtralError as e:  # no weights, a damaged or mismatched checkpoint
            raise SystemExit(str(e)) from None
    else:
        suite = OPENBLAS if args.openblas else FULL if args.full else QUICK
    if args.no_record:
        suite = [[a for a in cmd if a != "--record"] + ["--no-record"] for cmd in suite]
    failed = []
    for cmd in suite:
        print(f"== {' '.join(cmd)}", flush=True)
        script = [sys.executable, str(HERE / cmd[0]), *cmd[1:]]
        if subprocess.run(script, cwd=HERE, env=env).returncode:
            failed.append(cmd[0])
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
