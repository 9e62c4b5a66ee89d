"""Bytes of weights a frame reads at each precision, and the floor that sets on Apple Silicon.

Decoding a frame on a GPU is bound by reading weights: the backbone once, the flow head
once per Euler step (7 times), the semantic head and the flow head's input from the
backbone once, the codec once per decoded chunk (here: streaming, one chunk per frame), and
37 rows of the code embedding table. This counts those bytes for the real config
(params.json's shapes, built by the project, not read from a download) at the precisions
`voxtral-mlx convert` writes and at mlx-community's quantization, and divides them by the
memory bandwidth Apple publishes for each chip: the time below which no implementation can
decode a frame there. It is a lower bound, not a measurement (no Mac here): a real frame
also pays kernel dispatches and reaches only part of the peak bandwidth.

    python benchmarks/weights_per_frame.py [--codec-chunk FRAMES] [--no-record]
"""

from __future__ import annotations

import argparse
import math
import sys

from common import command_line, record, run_script

from voxtral_mlx.checkpoint import QuantSpec, expected_tensors, quantized_shapes
from voxtral_mlx.config import ModelConfig
from voxtral_mlx.convert import QuantOptions, component
from voxtral_mlx.synthetic.checkpoint import make_params

FRAME_MS = 80.0  # audio per frame: a frame decoded slower than this cannot play live

# Apple's published unified-memory bandwidth, GB/s (the top configuration of each chip).
CHIPS = {
    "M1": 68.25,
    "M2 / M3": 100.0,
    "M4": 120.0,
    "M3 Pro": 150.0,
    "M1 Pro / M2 Pro": 200.0,
    "M4 Pro": 273.0,
    "M1 Max / M2 Max / M3 Max": 400.0,
}

BF16 = 2  # bytes per unquantized parameter (the release's dtype)


def presets() -> list[tuple[str, object]]:
    """(label, how a layer is stored: (module path, weight shape) -> QuantSpec or None)."""

    def ours(bits: int | None, flow_bits: int | None = None):
        opts = QuantOptions.make(bits, None, flow_bits)
        return opts.spec if bits is not None else (lambda _p, _s: None)

    def community(bits: int):
        def spec(path: str, shape: tuple[int, ...]) -> QuantSpec | None:
            if path.startswith(("audio_tokenizer.", "mm_audio_embeddings.audio_codebook")):
                return None
            return QuantSpec(bits=bits, group_size=64)

        return spec

    return [
        ("bf16 (Mistral's release)", ours(None)),
        ("convert --q-bits 8", ours(8)),
        ("convert --q-bits 6 (flow head 8)", ours(6)),
        ("convert --q-bits 4 (flow head 8)", ours(4)),
        ("convert --q-bits 4 --q-flow-bits 6", ours(4, 6)),
        ("convert --q-bits 4 --q-flow-bits 4", ours(4, 4)),
        ("mlx-community 6bit", community(6)),
        ("mlx-community 4bit", community(4)),
    ]


def tensor_bytes(shape: tuple[int, ...], spec: QuantSpec | None) -> float:
    """Stored bytes of a weight, packed with bf16 scales and biases when quantized."""
    if spec is None:
        return BF16 * math.prod(shape)
    rows, width = shape
    return rows * width * spec.bits / 8 + 2 * BF16 * rows * (width // spec.group_size)


def reads_per_frame(name: str, config: ModelConfig, chunk_frames: int, rows: int) -> float:
    """How many times a frame reads the tensor ``name`` (a fraction: part of it)."""
    if name.startswith("layers.") or name == "norm.weight":
        return 1
    if name.startswith("acoustic_transformer."):
        if "time_projection" in name:
            return 0  # its 7 outputs are computed once at load
        if "semantic_codebook_output" in name or "llm_projection" in name:
            return 1
        return config.flow.n_decoding_steps  # the layers, the norm, input and output: each step
    if name.startswith("audio_tokenizer."):
        if name.endswith(("cluster_usage", "embedding_sum")):
            return 0  # the codebook: looked up row by row (a few KB)
        return 1 / chunk_frames
    if name.endswith("audio_codebook_embeddings.embeddings.weight"):
        return config.num_codebooks / rows  # one row per codebook
    return 0  # the text embedding: prompts only


def layer_specs(config: ModelConfig, spec) -> dict[str, QuantSpec]:
    """Module path -> how it is packed, for every layer ``spec`` quantizes at its shape."""
    out = {}
    for name, exp in expected_tensors(config).items():
        if not name.endswith(".weight") or len(exp.shape) != 2:
            continue
        path = name.removesuffix(".weight")
        s = spec(path, exp.shape)
        if s is not None and quantized_shapes(exp.shape, s) is not None:
            out[path] = s
    return out


def frame_bytes(config: ModelConfig, spec, chunk_frames: int) -> dict[str, float]:
    """Bytes read per frame by component, and the weights' whole size ("stored")."""
    packed = layer_specs(config, spec)
    parts = {"backbone": 0.0, "flow_head": 0.0, "codec": 0.0, "embeddings": 0.0, "stored": 0.0}
    for name, exp in expected_tensors(config).items():
        size = tensor_bytes(exp.shape, packed.get(name.removesuffix(".weight")))
        parts["stored"] += size
        parts[component(name)] += reads_per_frame(name, config, chunk_frames, exp.shape[0]) * size
    return parts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--codec-chunk",
        type=int,
        default=1,
        help="frames per decoded codec chunk (1: streaming, as playback does)",
    )
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args(argv)
    if args.codec_chunk < 1:
        raise SystemExit("--codec-chunk must be at least 1")
    config = ModelConfig.from_params(make_params("full"))
    gb = 1e9
    rows = [
        (
            "precision",
            "stored GB",
            "GB read per frame",
            "backbone / flow head / codec",
            "bandwidth for 80 ms/frame",
            *(f"{chip} floor" for chip in CHIPS),
        )
    ]
    for label, spec in presets():
        p = frame_bytes(config, spec, args.codec_chunk)
        per_frame = p["backbone"] + p["flow_head"] + p["codec"] + p["embeddings"]
        shares = " / ".join(
            f"{100 * p[k] / per_frame:.0f} %" for k in ("backbone", "flow_head", "codec")
        )
        floors = []
        for bw in CHIPS.values():
            ms = 1000 * per_frame / (bw * gb)
            floors.append(f"{ms:.0f} ms" + ("" if ms <= FRAME_MS else " (slower than live)"))
        rows.append(
            (
                label,
                f"{p['stored'] / gb:.2f}",
                f"{per_frame / gb:.2f}",
                shares,
                f"{per_frame / gb / (FRAME_MS / 1000):.0f} GB/s",
                *floors,
            )
        )
    for r in rows:
        print(" | ".join(r))
    notes = (
        "Counted, not measured: bytes of weights a frame reads (backbone once, flow head once "
        "per Euler step, semantic head once, codec once per "
        f"{args.codec_chunk}-frame chunk) at the real config's shapes, packed weights with "
        "bf16 scales and biases (group 64). Floor = bytes / Apple's published bandwidth of "
        "the chip (top configuration); a frame must take at least that long, and needs at "
        "most 80 ms to keep up with playback. Real frames add dispatches and reach only part "
        "of the peak bandwidth, unmeasured here."
    )
    if not args.no_record:
        print(
            record(
                "Weights read per frame and the Apple Silicon floor (real config)",
                command_line(__file__, argv or sys.argv[1:]),
                rows,
                notes,
            )
        )
    return 0


if __name__ == "__main__":
    run_script(main)
