"""Before/after of the codec's two hot-path changes, measured in one process, interleaved:
banded sliding-window attention (blocks of 16 steps) vs dense masked attention over the
chunk, and the compiled streaming step vs the plain one. Outputs are compared too (they are
bit-identical in float32).

    python benchmarks/codec_ablation.py [--configs tiny full] [--dtype bfloat16] [--no-record]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import mlx.core as mx
import numpy as np
from codec_bench import build, random_codes
from common import at_least_one, command_line, record, run_script, show_row

import voxtral_mlx.model.codec as codec_module

CHUNKS = {"tiny": (1, 16, 64), "full": (1, 16)}
FRAMES = {"tiny": 64, "full": 32}


def stream_ms(dec, codes: mx.array, chunk: int) -> tuple[float, np.ndarray]:
    """ms per frame of streaming ``codes`` in chunks (the first chunk untimed)."""
    state = dec.new_state()
    parts, ms, n = [], 0.0, 0
    for s in range(0, codes.shape[1], chunk):
        t0 = time.perf_counter()
        part = dec.decode_chunk(codes[:, s : s + chunk], state)
        mx.eval(part, state.arrays())
        if s:
            ms += 1000 * (time.perf_counter() - t0)
            n += part.shape[1] // dec.samples_per_frame
        parts.append(part)
    return ms / n, np.array(mx.concatenate(parts, axis=1).astype(mx.float32))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["tiny", "full"], choices=sorted(CHUNKS))
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=at_least_one, default=3)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args(argv)
    dtype = getattr(mx, args.dtype)
    variants = {
        "before (dense, not compiled)": (10**9, False),
        "banded only": (codec_module.BAND_BLOCK, False),
        "compiled only": (10**9, True),
        "after (banded + compiled)": (codec_module.BAND_BLOCK, True),
    }
    rows = [("config", "chunk (frames)", *variants, "after / before", "max abs diff")]
    for size in args.configs:
        config, dec, _ref, _ = build(size, dtype)
        for chunk in CHUNKS[size]:
            codes = random_codes(config, max(FRAMES[size], 3 * chunk))
            times: dict[str, list[float]] = {k: [] for k in variants}
            audio = {}
            for _ in range(args.rounds):
                for name, (block, compiled) in variants.items():
                    codec_module.BAND_BLOCK = block
                    dec._plan.masks.clear()
                    dec.prepare(compile=compiled)
                    ms, audio[name] = stream_ms(dec, codes, chunk)
                    times[name].append(ms)
            med = {k: statistics.median(v) for k, v in times.items()}
            first, last = next(iter(variants)), list(variants)[-1]
            diff = float(np.abs(audio[first] - audio[last]).max())
            rows.append(
                (
                    f"{size} ({args.dtype})",
                    str(chunk),
                    *(f"{med[k]:.2f} ms" for k in variants),
                    f"{med[last] / med[first]:.2f}",
                    f"{diff:.1e}",
                )
            )
            show_row(rows)
    if not args.no_record:
        record(
            "Codec hot path, before/after (ms per frame, streaming)",
            command_line(__file__, argv or sys.argv[1:]),
            rows,
            "Each variant streams the same codes in chunks of the given size; medians of "
            "interleaved rounds. Chunk 1 is live streaming; 16 is synthesize(); 64 is decode().",
        )
    return 0


if __name__ == "__main__":
    run_script(main)
