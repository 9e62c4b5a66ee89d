"""Random checkpoints in Mistral's published layout, at any size.

The weights cannot be downloaded here, so tests and benchmarks run on checkpoints built
by this module: ``params.json``, ``tekken.json``, ``consolidated.safetensors`` and
``voice_embedding/<voice>.pt``, laid out exactly as in ``mistralai/Voxtral-4B-TTS-2603``.
Values are random but scaled so activations stay finite through every stage; the loader
that reads them is the one a Mac user runs against the real download.
"""

from __future__ import annotations

import copy
import json
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..checkpoint import expected_tensors
from ..config import END_AUDIO, ModelConfig
from ..errors import InputError
from ..fileio import atomic_write_text
from ..output_dir import check_output_dir, directory_path, staged_dir
from .safetensors_writer import TensorSpec, encode, float32_to_bf16_bits, write_safetensors

# The 20 preset voices of the real checkpoint and their row counts (tekken.json).
REAL_VOICES: dict[str, int] = {
    "casual_female": 214,
    "casual_male": 147,
    "cheerful_female": 132,
    "neutral_female": 218,
    "neutral_male": 169,
    "pt_male": 144,
    "pt_female": 175,
    "nl_male": 138,
    "nl_female": 146,
    "it_male": 168,
    "it_female": 172,
    "fr_male": 97,
    "fr_female": 97,
    "es_male": 208,
    "es_female": 138,
    "de_male": 163,
    "de_female": 147,
    "ar_male": 67,
    "hi_male": 94,
    "hi_female": 86,
}

REAL_PARAMS: dict[str, Any] = {
    "dim": 3072,
    "n_layers": 26,
    "head_dim": 128,
    "hidden_dim": 9216,
    "n_heads": 32,
    "n_kv_heads": 8,
    "use_biases": False,
    "causal": True,
    "rope_theta": 1000000.0,
    "norm_eps": 1e-05,
    "vocab_size": 131072,
    "model_parallel": 1,
    "tied_embeddings": True,
    "multimodal": {
        "bos_token_id": 1,
        "audio_model_args": {
            "semantic_codebook_size": 8192,
            "acoustic_codebook_size": 21,
            "n_acoustic_codebook": 36,
            "audio_encoding_args": {
                "codebook_pattern": "parallel",
                "interleave_audio_tokens_per_segment": 8192,
                "interleave_text_tokens_per_segment": 8192,
                "single_trailing_segment": False,
                "num_codebooks": 37,
                "sampling_rate": 24000,
                "frame_rate": 12.5,
            },
            "audio_token_id": 24,
            "begin_audio_token_id": 25,
            "input_embedding_concat_type": "sum",
            "acoustic_transformer_args": {
                "input_dim": 3072,
                "dim": 3072,
                "n_layers": 3,
                "head_dim": 128,
                "hidden_dim": 9216,
                "n_heads": 32,
                "n_kv_heads": 8,
                "use_biases": False,
                "rope_theta": 10000.0,
                "sigma": 1e-05,
                "sigma_max": 1.0,
            },
            "p_uncond": 0.0,
            "text_feature_bugged": False,
            "condition_dropped_token_id": 42,
        },
        "audio_tokenizer_args": {
            "channels": 1,
            "sampling_rate": 24000,
            "pretransform_patch_size": 240,
            "patch_proj_kernel_size": 7,
            "semantic_codebook_size": 8192,
            "semantic_dim": 256,
            "acoustic_codebook_size": 21,
            "acoustic_dim": 36,
            "conv_weight_norm": True,
            "causal": True,
            "attn_sliding_window_size": 16,
            "half_attn_window_upon_downsampling": True,
            "dim": 1024,
            "hidden_dim": 4096,
            "head_dim": 128,
            "n_heads": 8,
            "n_kv_heads": 8,
            "qk_norm_eps": 1e-06,
            "qk_norm": True,
            "use_biases": False,
            "norm_eps": 0.01,
            "layer_scale": True,
            "layer_scale_init": 0.01,
            "decoder_transformer_lengths_str": "2,2,2,2",
            "decoder_convs_kernels_str": "3,4,4,4",
            "decoder_convs_strides_str": "1,2,2,2",
            "voice": {name: i for i, name in enumerate(REAL_VOICES)},
        },
    },
    "max_seq_len": 65536,
    "model_type": "voxtral_tts",
    "max_position_embeddings": 128000,
}


def make_params(size: str = "tiny", **overrides: Any) -> dict[str, Any]:
    """A params.json dict in the published layout.

    ``size``: ``"full"`` (the real config), ``"wide"`` (real widths, 2 backbone layers: the
    real per-layer shapes at a cost that fits a benchmark) or ``"tiny"`` (seconds to build
    and run, same structure: 8 codec heads, 4 codec stages, 36 acoustic codebooks,
    1920 samples per frame). ``overrides``: ``n_layers``, ``flow_layers``, ``vocab_size``,
    ``semantic_codebook_size``, ``dim``.
    """
    p = copy.deepcopy(REAL_PARAMS)
    audio = p["multimodal"]["audio_model_args"]
    at = audio["acoustic_transformer_args"]
    codec = p["multimodal"]["audio_tokenizer_args"]
    if size == "wide":
        p["n_layers"] = 2
    elif size == "tiny":
        p.update(dim=64, n_layers=2, head_dim=16, hidden_dim=160, n_heads=4, n_kv_heads=2)
        at.update(
            input_dim=64, dim=64, n_layers=2, head_dim=16, hidden_dim=160, n_heads=4, n_kv_heads=2
        )
        audio["semantic_codebook_size"] = 64
        codec.update(
            dim=64,
            hidden_dim=128,
            head_dim=8,
            n_heads=8,
            n_kv_heads=8,
            semantic_codebook_size=64,
            semantic_dim=16,
        )
    elif size != "full":
        raise ValueError(f"unknown checkpoint size {size!r}: use tiny, wide or full")
    for key, value in overrides.items():
        if value is None:
            continue
        if key == "n_layers":
            p["n_layers"] = value
        elif key == "flow_layers":
            at["n_layers"] = value
        elif key == "vocab_size":
            p["vocab_size"] = value
        elif key == "semantic_codebook_size":
            audio["semantic_codebook_size"] = codec["semantic_codebook_size"] = value
        elif key == "dim":
            p["dim"] = at["input_dim"] = at["dim"] = value
        else:
            raise ValueError(f"unknown override {key!r}")
    return p


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def _values(name: str, shape: tuple[int, ...], rng: np.random.Generator, rows: slice) -> np.ndarray:
    """Random float32 values for rows ``rows`` of tensor ``name``, scaled by role."""
    n_rows = len(range(*rows.indices(shape[0])))
    part = (n_rows, *shape[1:])
    if name.endswith(("_norm.weight", "norm.weight")):
        return 1.0 + 0.1 * rng.standard_normal(part, dtype=np.float32)
    if name.endswith(("attention_scale", "ffn_scale")):
        return rng.uniform(0.05, 0.3, part).astype(np.float32)
    if name.endswith("original0"):
        return rng.uniform(0.5, 1.5, part).astype(np.float32)
    if name.endswith("cluster_usage"):
        usage = rng.uniform(0.5, 4.0, part).astype(np.float32)
        usage[::16] = 0.0  # unused clusters: the codebook's 1e-5 floor matters here
        return usage
    if name.endswith("embedding_sum"):
        x = rng.standard_normal(part, dtype=np.float32)
        x[::16] *= 1e-6
        return x
    x = rng.standard_normal(part, dtype=np.float32)
    if name.endswith("tok_embeddings.weight") or name.endswith("original1"):
        return x
    if name.endswith("audio_codebook_embeddings.embeddings.weight"):
        return x / np.sqrt(37.0, dtype=np.float32)
    return x / np.float32(np.sqrt(shape[-1]))  # Linear [out, in]: unit-variance outputs


def _produce(seed: int, dtype: str, spec: TensorSpec, suppress_end: bool) -> Iterator[bytes]:
    rng = _rng(seed, spec.name)
    if suppress_end and spec.name.endswith("semantic_codebook_output.weight"):
        values = _values(spec.name, spec.shape, rng, slice(None))
        values[END_AUDIO] = 0.0
        yield encode(values, dtype)
        return
    if spec.name.endswith(("cluster_usage", "embedding_sum")):
        yield encode(_values(spec.name, spec.shape, rng, slice(None)), dtype)
        return
    row_bytes = max(1, spec.nbytes // max(1, spec.shape[0]))
    step = max(1, (64 << 20) // row_bytes)
    for start in range(0, spec.shape[0], step):
        yield encode(_values(spec.name, spec.shape, rng, slice(start, start + step)), dtype)


def build_random_checkpoint(
    out_dir: str | Path,
    params: Mapping[str, Any] | str = "tiny",
    *,
    seed: int = 0,
    dtype: str = "bfloat16",
    voices: Mapping[str, int] | None = None,
    vocab_source: str | Path | None = "auto",
    voice_format: str = "pt",
    suppress_end: bool = False,
    force: bool = False,
) -> Path:
    """Write a random checkpoint in Mistral's layout to ``out_dir`` and return its path.

    ``params``: a params.json dict or a size name for :func:`make_params`.
    ``dtype``: ``bfloat16`` (as published) or ``float32``. ``voices``: name -> rows
    (default: the 20 real voices). ``vocab_source``: see ``synthetic.tekken.build_tekken``.
    ``voice_format``: ``pt`` (as published) or ``safetensors`` (as converted).
    ``suppress_end``: zero the END row of the semantic head, so that generation runs to
    ``max_frames`` (benchmarks need a fixed number of frames; random weights end early).

    ``out_dir`` must be new or empty, or (with ``force``) a model directory, which is then
    replaced. The checkpoint is built in a hidden directory beside it and renamed into place
    at the end, so a failed or interrupted build leaves nothing behind.
    """
    from .tekken import build_tekken

    out_path = directory_path(out_dir)
    if isinstance(params, str):
        if params not in ("tiny", "wide", "full"):
            raise InputError(f"unknown size {params!r}: use tiny, wide or full, or a params dict")
        params = make_params(params)
    if not isinstance(params, Mapping):
        raise InputError(
            f"params must be a size name or a params.json dict, got {type(params).__name__}"
        )
    params = copy.deepcopy(dict(params))
    if not isinstance(params.get("vocab_size"), int):
        ModelConfig.from_params(params)  # names what is missing or wrong
    st_dtype = {"bfloat16": "BF16", "float32": "F32", "float16": "F16"}.get(
        dtype if isinstance(dtype, str) else ""
    )
    if st_dtype is None:
        raise InputError(f"unsupported dtype {dtype!r}: use bfloat16, float16 or float32")
    if voice_format not in ("pt", "safetensors"):
        raise InputError(f"unknown voice format {voice_format!r}: use pt or safetensors")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise InputError(f"seed must be a whole number >= 0, got {seed!r}: pass e.g. 0")
    voices = _checked_voices(REAL_VOICES if voices is None else voices)
    tekken = build_tekken(voices, vocab_source=vocab_source)
    n_text = tekken["config"]["default_vocab_size"]
    if params["vocab_size"] < n_text:
        params["vocab_size"] = n_text
    config = ModelConfig.from_params(params)
    tekken["audio"].update(sampling_rate=config.sampling_rate, frame_rate=config.frame_rate)

    out = check_output_dir(out_path.absolute(), force)
    with staged_dir(out, force) as tmp:
        _write_checkpoint(
            tmp, params, config, tekken, voices, seed, st_dtype, voice_format, suppress_end
        )
    return out


MAX_VOICE_ROWS = 4096  # the real voices have 67-218 rows


def _checked_voices(voices: object) -> dict[str, int]:
    """``voices`` if it maps plain file names to row counts a model can load."""
    if not isinstance(voices, Mapping) or not voices:
        raise InputError(f"voices must map voice names to row counts, got {voices!r:.80}")
    for name, rows in voices.items():
        if (
            not isinstance(name, str)
            or not name
            or name.startswith(".")
            or any(sep in name for sep in ("/", "\\", "\0"))
        ):
            raise InputError(
                f"voice name {name!r:.60} cannot be a file name in voice_embedding/: use "
                "letters, digits and _"
            )
        if isinstance(rows, bool) or not isinstance(rows, int) or not 1 <= rows <= MAX_VOICE_ROWS:
            raise InputError(f"voice {name!r} needs 1 to {MAX_VOICE_ROWS} rows, got {rows!r:.40}")
    return dict(voices)


def _write_checkpoint(
    out: Path,
    params: dict[str, Any],
    config: ModelConfig,
    tekken: dict[str, Any],
    voices: dict[str, int],
    seed: int,
    st_dtype: str,
    voice_format: str,
    suppress_end: bool,
) -> None:
    from ..torch_pickle import PtTensor, write_pt
    from .tekken import write_tekken

    (out / "voice_embedding").mkdir()
    write_tekken(out / "tekken.json", tekken)
    # As the published file is: tensors in name order, no __metadata__ (its 8,004,752,248
    # bytes are exactly that layout's).
    tensors = expected_tensors(config)
    specs = [TensorSpec(name, st_dtype, tensors[name].shape) for name in sorted(tensors)]
    write_safetensors(
        out / "consolidated.safetensors",
        specs,
        lambda spec: _produce(seed, st_dtype, spec, suppress_end),
        metadata=None,
    )

    dim = config.backbone.dim
    for name, rows in voices.items():
        values = _rng(seed, f"voice/{name}").standard_normal((rows, dim), dtype=np.float32)
        if voice_format == "pt":
            if st_dtype == "BF16":
                tensor = PtTensor("BF16", (rows, dim), float32_to_bf16_bits(values))
            else:
                tensor = PtTensor(
                    st_dtype,
                    (rows, dim),
                    values.astype(np.float16 if st_dtype == "F16" else np.float32),
                )
            write_pt(out / "voice_embedding" / f"{name}.pt", tensor)
        else:
            spec = TensorSpec("embedding", st_dtype, (rows, dim))
            write_safetensors(
                out / "voice_embedding" / f"{name}.safetensors",
                [spec],
                lambda _s, v=values: iter([encode(v, st_dtype)]),
                metadata=None,  # as mlx-community's voice files
            )
    atomic_write_text(out / "params.json", json.dumps(params, indent=4) + "\n")


def random_weights(
    config: ModelConfig, seed: int = 0, prefix: str | None = None
) -> dict[str, np.ndarray]:
    """In-memory float32 random weights with Mistral's names (optionally only ``prefix*``).

    The same values (before dtype rounding) that :func:`build_random_checkpoint` writes.
    """
    out = {}
    for name, e in expected_tensors(config).items():
        if prefix is not None and not name.startswith(prefix):
            continue
        out[name] = _values(name, e.shape, _rng(seed, name), slice(None))
    return out
