"""Codec decoder speed: exact streaming (caller-held state) vs one-shot vs mlx-audio.

mlx-audio streams by re-decoding every chunk with 16 frames of left context
(``voxtral_tts.py``, ``generate(stream=True)``, ``context_frames = 16``); its default chunk
is 25 frames (2 s). Both decoders get the same random weights; mlx-audio is patched to
Mistral's ALiBi slopes and codebook floor (SPEC §6) so the parity line compares like with
like. Times are wall-clock per decoded frame (80 ms of audio for Voxtral), evaluated at every chunk
boundary as a player would; streaming times are steady state (chunks from frame 16 on).
"ours/mlx-audio" compares each of our rows with mlx-audio's doing the same job (streaming
in one-frame chunks, in 25-frame chunks, one-shot).

    python benchmarks/codec_bench.py [--configs tiny full CHECKPOINT_DIR] [--frames N]
        [--slow-frames N] [--dtype float32] [--streams 4] [--repeats 5]

A built-in config runs in float32 unless ``--dtype`` says otherwise; a checkpoint directory
in its own dtype (``--dtype`` converts it).

The "streams" rows decode several concurrent streams one frame at a time, as the engine
does for a batch of streaming requests: one batched step for all of them
(``CodecDecoder.decode_chunks``) against one step per stream.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from voxtral_mlx.checkpoint import sanitize
from voxtral_mlx.config import ModelConfig
from voxtral_mlx.model.codec import CodecDecoder
from voxtral_mlx.model.codec_layers import alibi_slopes
from voxtral_mlx.synthetic.checkpoint import make_params, random_weights
from voxtral_mlx.tts import DECODE_PART_FRAMES

PREFIX = "audio_tokenizer."
MLX_AUDIO_CONTEXT = 16
MLX_AUDIO_WINDOWS = (2, 4, 8, 16)  # per stage, whatever params.json says


def codec_config(config_name: str) -> ModelConfig:
    """A built-in size's config, or a checkpoint directory's (any layout)."""
    from common import check_model_dir, model_config

    if config_name in DEFAULT_FRAMES:
        return ModelConfig.from_params(make_params(config_name))
    path = Path(config_name).expanduser()
    if not path.is_dir():
        raise SystemExit(
            f"{config_name}: not {' or '.join(DEFAULT_FRAMES)} nor a checkpoint directory"
        )
    check_model_dir(path)  # one line, without the loader's advice about repo ids
    return model_config(path)


def own_dtype(config_name: str) -> mx.Dtype:
    """The dtype a config runs in without ``--dtype``: float32 for a built-in size, the
    one most of a checkpoint directory's weights are stored in (as ``load`` picks it)."""
    if config_name in DEFAULT_FRAMES:
        return mx.float32
    from voxtral_mlx.checkpoint import checkpoint_dtype
    from voxtral_mlx.errors import VoxtralError
    from voxtral_mlx.loader import open_weights

    path = Path(config_name).expanduser()
    try:
        return checkpoint_dtype(open_weights(path, codec_config(config_name)).infos)
    except VoxtralError as e:
        raise SystemExit(str(e)) from None


def codec_weights(config_name: str) -> tuple[ModelConfig, dict[str, mx.array]]:
    """A built-in size's random codec weights, or those of a checkpoint directory (only the
    ``audio_tokenizer.*`` tensors are read)."""
    config = codec_config(config_name)
    if config_name in DEFAULT_FRAMES:
        weights = random_weights(config, 0, prefix="audio_tokenizer")
        return config, {k: mx.array(v) for k, v in weights.items()}
    from voxtral_mlx.errors import VoxtralError
    from voxtral_mlx.loader import open_weights

    try:
        # Every tensor checked against the config, by Mistral's names; read lazily.
        stored = open_weights(Path(config_name).expanduser(), config).load()
    except VoxtralError as e:
        raise SystemExit(str(e)) from None
    return config, {k: v for k, v in stored.items() if k.startswith(PREFIX)}


def build(size: str, dtype: mx.Dtype):
    from mlx_audio.tts.models.voxtral_tts import audio_tokenizer as at

    config, raw = codec_weights(size)
    ours = CodecDecoder(config.codec)
    folded = sanitize(raw, config, dtype=dtype)
    ours.load_weights([(k[len(PREFIX) :], v) for k, v in folded.items()], strict=True)
    mx.eval(ours.parameters())
    ours.prepare()  # as load() does: the steady-state streaming step is compiled

    tok = config.raw["multimodal"]["audio_tokenizer_args"]
    fields = at.AudioTokenizerArgs.__dataclass_fields__
    ref = at.VoxtralTTSAudioTokenizer(
        at.AudioTokenizerArgs(**{k: v for k, v in tok.items() if k in fields})
    )
    try:
        ref.load_weights([(k[len(PREFIX) :], v.astype(dtype)) for k, v in raw.items()], strict=True)
    except ValueError as e:  # e.g. an upsampling first stage, which mlx-audio cannot build
        raise SystemExit(
            f"{size}: mlx-audio's codec cannot hold this checkpoint's codec "
            f"({str(e).splitlines()[0]}), so there is nothing to compare with"
        ) from None
    theirs = [MLX_AUDIO_WINDOWS[min(s, 3)] for s in range(config.codec.n_stages)]
    if list(config.codec.windows) != theirs:
        print(
            f"[{size}] note: mlx-audio fixes the codec's attention windows at {theirs}; "
            f"this codec's are {list(config.codec.windows)}, so the two decoders' audio differs"
        )
    ref._alibi_slopes = mx.array(alibi_slopes(config.codec.n_heads), dtype=mx.float32)
    sc = ref.quantizer.semantic_codebook
    sc.cluster_usage = mx.maximum(sc.cluster_usage.astype(mx.float32), 1e-5)
    mx.eval(ref.parameters())
    n_params = sum(v.size for v in folded.values())
    return config, ours, ref, n_params


def random_codes(config: ModelConfig, frames: int) -> mx.array:
    rng = np.random.default_rng(0)
    c = config.codec
    sem = rng.integers(0, c.semantic_codebook_size, (1, frames, 1))
    ac = rng.integers(0, c.acoustic_codebook_size, (1, frames, c.acoustic_dim))
    return mx.array((np.concatenate([sem, ac], -1) + 2).astype(np.int32))


def ours_stream(dec: CodecDecoder, codes: mx.array, chunk: int, timed_from: int):
    """Exact streaming; chunks starting before ``timed_from`` run untimed (they build the
    state). Returns the audio and ms per frame over the timed chunks."""
    state = dec.new_state()
    parts, ms, n = [], 0.0, 0
    for s in range(0, codes.shape[1], chunk):
        start = time.perf_counter()
        part = dec.decode_chunk(codes[:, s : s + chunk], state)
        mx.eval(part)
        if s >= timed_from:
            ms += (time.perf_counter() - start) * 1e3
            n += min(chunk, codes.shape[1] - s)
        parts.append(part)
    return mx.concatenate(parts, axis=1), ms / n


def ours_streams(dec: CodecDecoder, codes: mx.array, streams: int, together: bool, timed_from: int):
    """``streams`` concurrent streams (different codes), chunk 1, as the engine serves them:
    one :meth:`decode_chunks` call per frame (``together``) or one ``decode_chunk`` call per
    stream. Returns the first stream's audio and ms per frame per stream."""
    rows = [mx.roll(codes, 7 * i, axis=1) for i in range(streams)]
    states = [dec.new_state() for _ in range(streams)]
    parts, ms = [], 0.0
    for s in range(codes.shape[1]):
        start = time.perf_counter()
        chunks = [(r[:, s : s + 1], st) for r, st in zip(rows, states)]
        if together:
            audio = dec.decode_chunks(chunks)
        else:
            audio = [dec.decode_chunk(c, st) for c, st in chunks]
        mx.eval(audio)
        if s >= timed_from:
            ms += (time.perf_counter() - start) * 1e3
        parts.append(audio[0])
    return mx.concatenate(parts, axis=1), ms / ((codes.shape[1] - timed_from) * streams)


def ref_stream(ref, codes: mx.array, chunk: int, timed_from: int, spf: int, skip: bool = False):
    """mlx-audio's streaming: each chunk re-decoded with up to 16 frames of left context.

    It keeps no state, so with ``skip`` the untimed chunks are not run at all (no audio)."""
    parts, ms, n = [], 0.0, 0
    for s in range(0, codes.shape[1], chunk):
        if skip and s < timed_from:
            continue
        start = time.perf_counter()
        ctx = max(0, s - MLX_AUDIO_CONTEXT)
        audio = ref.decode(codes[:, ctx : s + chunk])[:, (s - ctx) * spf :]
        mx.eval(audio)
        if s >= timed_from:
            ms += (time.perf_counter() - start) * 1e3
            n += min(chunk, codes.shape[1] - s)
        parts.append(audio)
    return (None if skip else mx.concatenate(parts, axis=1)), ms / n


def one_shot(decode, codes: mx.array):
    start = time.perf_counter()
    out = decode(codes)
    mx.eval(out)
    return out, (time.perf_counter() - start) * 1e3 / codes.shape[1]


def bench(
    size: str, frames: int, slow_frames: int, dtype: mx.Dtype, streams: int, repeats: int
) -> list[tuple]:
    """Streaming times are steady state: only chunks that start at frame >= 16 (whole
    mlx-audio context, full attention windows) are timed. Each figure is the median of
    ``repeats`` runs."""
    config, ours, ref, n_params = build(size, dtype)
    spf = config.codec.samples_per_frame
    codes = random_codes(config, frames)
    few = codes[:, :slow_frames]
    label = f"{Path(size).name} ({n_params / 1e6:.1f}M params, {str(dtype).split('.')[-1]})"
    steady = MLX_AUDIO_CONTEXT

    # Warm-up (mask construction, allocator) on a few frames.
    mx.eval(ours.decode(codes[:, :3]), ref.decode(codes[:, :3]))

    times: dict[str, list[float]] = {}
    order: list[tuple[str, int]] = []

    def timed(method: str, n: int, result: tuple) -> mx.array:
        if method not in times:
            times[method] = []
            order.append((method, n))
        times[method].append(result[1])
        return result[0]

    from25 = -(-steady // 25) * 25
    n = slow_frames - steady
    # Our rows and mlx-audio's doing the same job, for the ours/mlx-audio column.
    pairs = {
        "ours: streaming, chunk 1 (exact state)": "mlx-audio: re-decode chunk 1 + 16 ctx",
        "ours: streaming, chunk 25 (exact state)": "mlx-audio: re-decode chunk 25 + 16 ctx",
        "ours: one-shot decode": "mlx-audio: one-shot decode",
    }
    for _ in range(repeats):  # interleaved, so a slow spell of the machine hits every row
        s1 = timed("ours: streaming, chunk 1 (exact state)", n, ours_stream(ours, few, 1, steady))
        alone = timed(
            f"ours: {streams} streams, chunk 1, one call each",
            n * streams,
            ours_streams(ours, few, streams, False, steady),
        )
        together = timed(
            f"ours: {streams} streams, chunk 1, decoded together",
            n * streams,
            ours_streams(ours, few, streams, True, steady),
        )
        s25 = timed(
            "ours: streaming, chunk 25 (exact state)",
            frames - from25,
            ours_stream(ours, codes, 25, from25),
        )
        s16 = timed(
            "ours: chunk 16, as tts.decode() runs it",
            frames - DECODE_PART_FRAMES,
            ours_stream(ours, codes, DECODE_PART_FRAMES, DECODE_PART_FRAMES),
        )
        one = timed("ours: one-shot decode", frames, one_shot(ours.decode, codes))
        timed(
            "mlx-audio: re-decode chunk 1 + 16 ctx",
            n,
            ref_stream(ref, few, 1, steady, spf, skip=True),
        )
        r25 = timed(
            "mlx-audio: re-decode chunk 25 + 16 ctx",
            frames - from25,
            ref_stream(ref, codes, 25, from25, spf),
        )
        ref_full = timed("mlx-audio: one-shot decode", frames, one_shot(ref.decode, codes))
    med = {method: statistics.median(t) for method, t in times.items()}
    rows = [
        (label, method, n, med[method], med[pairs[method]] if method in pairs else None)
        for method, n in order
    ]

    def err(a: mx.array, b: mx.array) -> str:
        a, b = a.astype(mx.float32), b.astype(mx.float32)
        d = float(mx.abs(a - b).max())
        return f"max abs {d:.2e} / max rel {d / float(mx.abs(b).max()):.2e}"

    n1 = slow_frames * spf
    print(f"[{size}] ours one-shot vs mlx-audio one-shot: {err(one, ref_full)}")
    print(f"[{size}] ours chunk-1 stream vs ours one-shot: {err(s1, one[:, :n1])}")
    print(f"[{size}] {streams} streams together vs alone: {err(together, alone)}")
    print(f"[{size}] ours chunk-25 stream vs ours one-shot: {err(s25, one)}")
    print(f"[{size}] ours chunk-16 (decode()) vs ours one-shot: {err(s16, one)}")
    print(f"[{size}] mlx-audio re-decode chunk 25 vs its one-shot (seams): {err(r25, ref_full)}")
    audio_ms = 1000.0 * spf / config.codec.sampling_rate
    return [(*row, audio_ms) for row in rows]


# Frames per config: (chunk-25 and one-shot runs, chunk-1 runs); the real width is slow on CPU.
DEFAULT_FRAMES = {"tiny": (200, 100), "wide": (75, 24), "full": (75, 24)}


def codec_size(path: str) -> str:
    """The built-in size whose frame counts suit a checkpoint's codec width."""
    config = codec_config(path)
    return "tiny" if config.codec.dim < 1024 else "full"


def main() -> None:
    from common import at_least_one

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--configs",
        nargs="+",
        default=["tiny", "full"],
        help=f"{', '.join(sorted(DEFAULT_FRAMES))} or checkpoint directories (any layout)",
    )
    parser.add_argument(
        "--frames", type=at_least_one, help="frames for the chunk-25 and one-shot runs"
    )
    parser.add_argument("--slow-frames", type=at_least_one, help="frames for the chunk-1 runs")
    parser.add_argument("--streams", type=at_least_one, default=4, help="concurrent streams")
    parser.add_argument("--repeats", type=at_least_one, default=5, help="runs per figure (median)")
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="default: float32 for a built-in config, a directory's own",
    )
    parser.add_argument("--record", action="store_true", help="append to benchmarks/RESULTS.md")
    parser.add_argument("--no-record", action="store_true", help="the default")
    args = parser.parse_args()
    rows = []
    for size in args.configs:
        default = DEFAULT_FRAMES.get(size) or DEFAULT_FRAMES[codec_size(size)]
        frames = args.frames or default[0]
        slow = min(frames, args.slow_frames or default[1])
        if slow <= MLX_AUDIO_CONTEXT or frames < 2 * 25:
            parser.error("need --slow-frames > 16 and --frames >= 50 (steady state is timed)")
        dtype = getattr(mx, args.dtype) if args.dtype else own_dtype(size)
        rows += bench(size, frames, slow, dtype, max(1, args.streams), max(1, args.repeats))

    frame_ms = sorted({f"{r[5]:g}" for r in rows})
    print(f"\nbackend: {mx.default_device()}; real time = {', '.join(frame_ms)} ms per frame\n")
    head = ("config", "method", "frames", "ms/frame", "x real time", "ours/mlx-audio")
    table = [head] + [
        (c, m, str(n), f"{ms:.2f}", f"{a / ms:.2f}", "" if ref is None else f"{ms / ref:.2f}")
        for c, m, n, ms, ref, a in rows
    ]
    width = [max(len(r[i]) for r in table) for i in range(len(head))]
    for cells in table:  # the table recorded, aligned
        print("  ".join(c.ljust(w) for c, w in zip(cells, width)).rstrip())
    if args.record and not args.no_record:
        from common import command_line, record

        record(
            "Codec cost per frame (streaming vs one-shot vs mlx-audio)",
            command_line(__file__, sys.argv[1:]),
            table,
            runs=args.repeats,
        )


if __name__ == "__main__":
    from common import run_script

    run_script(main)
