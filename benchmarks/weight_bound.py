"""How close a frame gets to the hardware: measured ms/frame vs the bare matrix products.

For a checkpoint with the real layer widths this prints, per frame:
  * bytes of weights the frame must read (backbone once, flow head once per Euler step,
    semantic head, codec once per decoded chunk) and the lower bound bytes / bandwidth,
    with the machine's memory bandwidth measured here (large-array sums: on a CPU with one
    core and with all, the bound from all);
  * the time of the bare matmuls at the frame's shapes and dtype (the same weights, no
    attention, norms or Python), i.e. what any implementation must spend; the codec's
    products at the rows of the chunks the timed runs decode (per frame, the difference
    between n2 frames' chunks and n1's, as the marginal ms/frame counts them);
  * voxtral_mlx's measured ms/frame (marginal, as frame_speed.py) and its overhead over
    the bare matmuls; achieved weight GB/s.

Each repeat runs ours(n2), ours(n1) and the bare matmuls back to back, so that drift in the
machine's speed hits all three alike; figures are medians over repeats.

    python benchmarks/weight_bound.py [--config wide|full|CHECKPOINT_DIR] [--no-record]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from common import (
    TEXT,
    at_least_one,
    command_line,
    is_narrow,
    label,
    median_marginal_ms,
    pick_voice,
    record,
    resolve,
    run_script,
    start_noise,
    suppress_end,
)

from voxtral_mlx.tts import SYNTH_CHUNK_FRAMES

BANDWIDTH_NOTE = (
    "Memory bandwidth: the best of 5 reads of 1 GiB (on a CPU numpy sums, on one core and on "
    "every core at once, a sum per core over its own buffer; on a GPU an MLX sum); the bound "
    "uses the last."
)
CONFIGS = {"wide": ("wide", 2, 3, 1, 3), "full": ("full", None, None, 1, 3)}


def bandwidths(n_bytes: int = 1 << 30) -> list[tuple[str, float]]:
    """Read bandwidth (GB/s) of what runs the frame, streaming ``n_bytes`` of arrays, as
    (label, figure) pairs, the one the bound uses last: on a GPU (Metal), MLX summing on it;
    on a CPU, numpy's SIMD sum (MLX's CPU reduction is slower than memory on this machine)
    on one core, then on every core at once (one sum per core on threads over separate
    buffers: numpy lets the GIL go while it sums), as a frame's matmuls use them all."""
    if mx.default_device() == mx.gpu:
        x = mx.ones((n_bytes // 4,), mx.float32)
        mx.eval(x)
        return [("the GPU", _best_gbs(lambda: mx.eval(mx.sum(x)), n_bytes))]
    one = np.ones(n_bytes // 4, np.float32)
    single = _best_gbs(one.sum, n_bytes)
    del one
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if (cores or 1) == 1:
        return [("1 core", single)]
    parts = [np.ones(n_bytes // 4 // cores, np.float32) for _ in range(cores)]

    def read_all() -> None:
        threads = [threading.Thread(target=part.sum) for part in parts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    every = _best_gbs(read_all, sum(p.nbytes for p in parts))
    return [("1 core", single), (f"{cores} cores", every)]


def _best_gbs(read, n_bytes: int) -> float:
    """GB/s of ``read()`` over ``n_bytes``, the best of 5 after a warm-up (a bandwidth is
    what the memory can do: slower runs are other work getting in the way)."""
    read()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        read()
        times.append(time.perf_counter() - t0)
    return n_bytes / min(times) / 1e9


def frame_shapes(
    tts,
) -> tuple[list[tuple[mx.array, int]], list[tuple[mx.array, int]], int]:
    """(weight, rows multiplying it) for every matmul of one frame, those of the codec
    decoding one frame, and the frame's weight bytes (the codec's left out).

    Rows are those a frame must multiply: the backbone decodes one position; each Euler step
    runs the flow head on 2 x 3 tokens (cond and uncond), except that its first layer
    projects only the new ``x`` token (the time tokens' projections are constants, the llm
    token's are made with the first step's, the zeroed token's are zeros) and its last layer
    computes the queries and everything after the attention at position 0 only (the only
    one read out); the codec runs each stage at its own rate (1, 2, 4, 8 steps per frame)
    (``synthesize`` decodes chunks of ``SYNTH_CHUNK_FRAMES`` frames: see :func:`codec_parts`).
    """
    m, cfg = tts.model, tts.config
    mats: list[tuple[mx.array, int]] = []

    def linears(module, rows, times=1):
        for _path, arr in _linear_weights(module):
            mats.extend([(arr, rows)] * times)

    for layer in m.layers:
        linears(layer, 1)
    head = m.acoustic_transformer
    n = cfg.flow.n_decoding_steps
    last = len(head.layers) - 1
    for step in range(n):
        for i, layer in enumerate(head.layers):
            attn = layer.attention
            after = 2 if i == last else 6  # rows of the attention's output onwards
            if i == 0:  # the new x token; at the first step with the llm token
                rows = 2 if step == 0 else 1
                projections = [(attn.wq, rows), (attn.wk, rows), (attn.wv, rows)]
            else:
                projections = [(attn.wq, after), (attn.wk, 6), (attn.wv, 6)]
            rest = [(lin, after) for lin in (attn.wo, *vars_linears(layer.feed_forward))]
            mats.extend((lin.weight, rows) for lin, rows in projections + rest)
    mats.append((head.semantic_codebook_output.weight, 1))
    mats.append((head.llm_projection.weight, 1))
    mats.extend([(head.input_projection.weight, 1)] * n)
    mats.extend([(head.acoustic_codebook_output.weight, 2)] * n)
    total = sum(w.nbytes for w, _ in mats)
    frame_mats, mats = mats, []
    codec = m.audio_tokenizer
    chunk = 1
    rates = codec._plan.rates
    for s, rate in enumerate(rates):
        conv = codec.decoder_blocks[2 * s].conv
        w = conv.weight
        if s == 0:
            mats.append((w.reshape(w.shape[0], -1), rate * chunk))
        else:  # transposed conv: one matmul per input step (the previous stage's rate)
            mats.append((w.reshape(-1, w.shape[-1]), rates[s - 1] * chunk))
        linears(codec.decoder_blocks[2 * s + 1], rate * chunk)
    w = codec.output_proj.conv.weight
    mats.append((w.reshape(w.shape[0], -1), rates[-1] * chunk))
    return frame_mats, mats, total


def codec_parts(frames: int) -> list[int]:
    """The chunks ``synthesize`` decodes ``frames`` frames in."""
    whole, rest = divmod(frames, SYNTH_CHUNK_FRAMES)
    return [SYNTH_CHUNK_FRAMES] * whole + ([rest] if rest else [])


def vars_linears(ffn) -> list:
    return [ffn.w1, ffn.w2, ffn.w3]


def _linear_weights(module):
    from mlx.utils import tree_flatten

    for path, arr in tree_flatten(module.parameters()):
        if path.endswith(".weight") and arr.ndim == 2:
            yield path, arr


def bare_matmuls(mats, dtype):
    """A function that runs the bare matmuls once and returns its seconds (inputs made and
    one warm-up run done here)."""
    xs = {(r, w.shape[1]): mx.random.normal((r, w.shape[1])).astype(dtype) for w, r in mats}
    mx.eval(list(xs.values()))

    def run() -> float:
        t0 = time.perf_counter()
        mx.eval([(xs[(r, w.shape[1])] @ w.T).sum() for w, r in mats])
        return time.perf_counter() - t0

    run()
    return run


def main(argv: list[str] | None = None) -> int:
    import voxtral_mlx

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="wide", help=f"{sorted(CONFIGS)} or a directory")
    parser.add_argument("--repeats", type=at_least_one, default=5)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args(argv)
    path = resolve(args.config, CONFIGS)
    if args.config in CONFIGS:
        n1, n2 = CONFIGS[args.config][3:]
    else:  # a directory: as frame_speed.py chooses
        n1, n2 = (8, 40) if is_narrow(path) else (1, 3)
    tts = voxtral_mlx.load(path)
    if any(isinstance(m, nn.QuantizedLinear) for _, m in tts.model.named_modules()):
        raise SystemExit(
            f"{args.config} is quantized: this compares a frame with dense products at its "
            "shapes; run it on the unquantized checkpoint (time a quantized frame with "
            "frame_speed.py --no-reference)"
        )
    suppress_end(tts)
    noise = start_noise(path, n2)
    voice = pick_voice(path)

    def ours(n) -> float:
        t0 = time.perf_counter()
        tts.synthesize(TEXT, voice, noise=noise[:n], max_frames=n)
        return time.perf_counter() - t0

    def prepare():
        from mlx.utils import tree_flatten

        mats, codec_mats, total = frame_shapes(tts)
        codec = tts.model.audio_tokenizer
        codec_bytes = sum(a.nbytes for _, a in tree_flatten(codec.parameters()))
        frame = bare_matmuls(mats, tts.dtype)
        # The codec's products as the timed runs do them: one per decoded chunk, at its
        # rows; per frame, the difference between n2's chunks and n1's, as ms/frame is.
        sizes = sorted(set(codec_parts(n1) + codec_parts(n2)))
        chunk = {k: bare_matmuls([(w, r * k) for w, r in codec_mats], tts.dtype) for k in sizes}

        def run() -> float:
            seconds = {k: fn() for k, fn in chunk.items()}
            codec_s = sum(seconds[k] for k in codec_parts(n2))
            codec_s -= sum(seconds[k] for k in codec_parts(n1))
            return frame() + codec_s / (n2 - n1)

        return run, total, codec_bytes

    # On the worker thread, which owns the model's arrays.
    bare_run, weight_bytes, codec_bytes = tts.call(prepare)
    ours(n1)  # warm-up: graphs compiled, voice prefix cached
    pairs, bare_s = [], []
    for _ in range(args.repeats):
        t2 = ours(n2)
        pairs.append((ours(n1), t2))
        bare_s.append(tts.call(bare_run))
    ms = median_marginal_ms(pairs, n1, n2)
    bare = 1000 * statistics.median(bare_s)
    bws = tts.call(bandwidths)
    bw_label, bw = bws[-1]
    per_frame = weight_bytes + codec_bytes / SYNTH_CHUNK_FRAMES  # codec: once per chunk
    bound_ms = 1000 * per_frame / (bw * 1e9)
    rows = [
        ("quantity", "value"),
        ("weights read per frame", f"{per_frame / 2**20:.0f} MiB"),
        *((f"memory bandwidth, {who}", f"{gbs:.1f} GB/s") for who, gbs in bws),
        (f"bandwidth bound (bytes / bandwidth of {bw_label})", f"{bound_ms:.1f} ms"),
        ("bare matmuls at the frame's shapes", f"{bare:.1f} ms"),
        ("voxtral_mlx ms/frame", f"{ms:.1f} ms"),
        ("overhead over bare matmuls", f"{100 * (ms / bare - 1):+.0f} %"),
        ("achieved weight GB/s", f"{per_frame / (ms / 1000) / 1e9:.1f}"),
    ]
    for r in rows:
        print(" | ".join(r))
    if not args.no_record:
        print(
            record(
                f"Weight-bound frame ({label(args.config)})",
                command_line(__file__, argv or sys.argv[1:]),
                rows,
                BANDWIDTH_NOTE,
                runs=args.repeats,
            )
        )
    return 0


if __name__ == "__main__":
    run_script(main)
