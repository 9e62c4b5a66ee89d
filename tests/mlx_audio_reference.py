"""mlx-audio's Voxtral TTS modules, loaded on our random checkpoints, as an independent reference.

mlx-audio differs from Mistral's reference (SPEC) in three places, each adjusted by the tests:
  * codec ALiBi slopes (SPEC §6): mlx-audio uses [1/2, ..., 1/256] for 8 heads, Mistral
    [1, ..., 1/128] (patched here: :func:`spec_alibi_slopes`);
  * semantic codebook floor (SPEC §6): mlx-audio divides by max(cluster_usage, 1e-8),
    Mistral 1e-5 (patched here: :func:`spec_codebook_floor`);
  * voice rows (SPEC §2: they replace the [AUDIO] rows, they are not added to them):
    mlx-audio writes them as ``e + (v - e)`` in the text table's dtype. With a text table
    quantized to a float format (mxfp4, nvfp4, mxfp8) that dtype is bfloat16, and the two
    bf16 roundings change even rows exactly representable in bf16, so the prompt is no
    longer the voice's rows. This is a precision flaw of the reference, not of voxtral_mlx;
    tests/test_mlx_community.py::_float32_text_table makes that table return float32.
Two more only show on checkpoints of other sizes than the release's, each adjusted here:
  * Euler steps (SPEC §5): mlx-audio runs 7 whatever ``n_decoding_steps`` params.json gives
    (:func:`spec_decoding_steps`);
  * its audio code table has ``(s // 128 + 1) * 128 + pad(n * a, 128)`` rows for ``s``
    semantic and ``n`` acoustic codebooks of ``a`` codes, Mistral's ``pad(s + 2 + n * (a + 2),
    128)``: equal at the release's sizes only. Both index it with the same offsets, so zero
    rows fill it to mlx-audio's size (:func:`fit_code_table`).
Its start noise comes from the global ``mx.random.normal``; :func:`injected_noise` replaces
that with given rows so both implementations integrate the same ODE.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import numpy as np


def spec_alibi_slopes(n_heads: int) -> mx.array:
    def rule(n: int) -> list[float]:
        r = 2.0 ** (-8.0 / n)
        return [r**h for h in range(n)]

    if n_heads & (n_heads - 1) == 0:
        return mx.array(rule(n_heads), dtype=mx.float32)
    m = 2 ** math.floor(math.log2(n_heads))
    return mx.array(rule(m) + rule(2 * m)[0::2][: n_heads - m], dtype=mx.float32)


@contextlib.contextmanager
def spec_codebook_floor() -> Iterator[None]:
    from mlx_audio.tts.models.voxtral_tts import audio_tokenizer as at

    original = at.SemanticCodebook.codebook

    def codebook(self):
        usage = mx.maximum(self.cluster_usage.astype(mx.float32), 1e-5)
        return self.embedding_sum.astype(mx.float32) / usage[:, None]

    at.SemanticCodebook.codebook = property(codebook)
    try:
        yield
    finally:
        at.SemanticCodebook.codebook = original


@contextlib.contextmanager
def injected_noise(rows: np.ndarray) -> Iterator[list[int]]:
    """Make ``mx.random.normal`` return successive rows of ``rows`` (one call per frame)."""
    original = mx.random.normal
    used = [0]

    def normal(shape, *args, **kwargs):
        i = used[0]
        used[0] += 1
        out = mx.array(rows[i : i + 1].astype(np.float32))
        assert tuple(shape) == tuple(out.shape), (shape, out.shape)
        return out

    mx.random.normal = normal
    try:
        yield used
    finally:
        mx.random.normal = original


@contextlib.contextmanager
def recorded_frames(model) -> Iterator[list[np.ndarray]]:
    """Collect the codes ``[37]`` of every frame mlx-audio's ``model`` decodes (END frame
    included) while the block runs."""
    frames: list[np.ndarray] = []
    original = model.acoustic_transformer.decode_one_frame

    def record(h):
        codes = original(h)
        frames.append(np.array(codes)[0])
        return codes

    model.acoustic_transformer.decode_one_frame = record
    try:
        yield frames
    finally:
        del model.acoustic_transformer.decode_one_frame


def spec_decoding_steps(model, model_dir: Path) -> None:
    """Give mlx-audio's flow head the checkpoint's Euler steps (it counts the time points:
    one more)."""
    params_json = model_dir / "params.json"
    if not params_json.is_file():  # a conversion keeping its params in config.json only
        params_json = model_dir / "config.json"
    params = json.loads(params_json.read_text())
    flow = params.get("multimodal", {}).get("audio_model_args", {})
    steps = flow.get("acoustic_transformer_args", {}).get("n_decoding_steps", 7)
    model.acoustic_transformer.args.n_denoising_steps = steps + 1


def fit_code_table(model, weights: dict) -> dict:
    """``weights`` (mlx-audio's names) with the audio code table padded with zero rows to
    the size mlx-audio's model has for the checkpoint's codebooks (see the module's notes);
    a quantized table's scales and biases too (zero rows of all three dequantize to 0)."""
    rows = model.audio_codebook_embeddings["embeddings"].weight.shape[0]
    padded = dict(weights)
    for part in ("weight", "scales", "biases"):
        name = f"audio_codebook_embeddings.embeddings.{part}"
        table = weights.get(name)
        if table is not None and table.shape[0] < rows:
            extra = mx.zeros((rows - table.shape[0], *table.shape[1:]), dtype=table.dtype)
            padded[name] = mx.concatenate([table, extra])
    return padded


def load_reference(model_dir: Path, patch: bool = True):
    """mlx-audio's Model with our checkpoint's weights (and its tokenizer from tekken.json)."""
    from mlx_audio.tts.models.voxtral_tts.voxtral_tts import Model, ModelConfig

    params = json.loads((model_dir / "params.json").read_text())
    model = Model(ModelConfig.from_dict(params))
    weights = model.sanitize(mx.load(str(model_dir / "consolidated.safetensors")))
    if patch:
        weights = fit_code_table(model, weights)
    model.load_weights(list(weights.items()), strict=True)
    if patch:
        model.audio_tokenizer._alibi_slopes = spec_alibi_slopes(model.audio_tokenizer.args.n_heads)
        spec_decoding_steps(model, model_dir)
    Model.post_load_hook(model, model_dir)
    mx.eval(model.parameters())
    return model


def load_converted_reference(model_dir: Path, patch: bool = True):
    """mlx-audio's Model read by mlx-audio's own loader from a directory in its layout (an
    mlx-community conversion, mlx-audio's converter's output or ``voxtral-mlx convert``'s)."""
    from mlx_audio.tts.models.voxtral_tts.voxtral_tts import Model
    from mlx_audio.tts.utils import load_model

    sanitize = Model.sanitize
    if patch:  # its loader sanitizes the weights it read before quantizing and loading them
        Model.sanitize = lambda self, weights: fit_code_table(self, sanitize(self, weights))
    try:
        model = load_model(Path(model_dir))  # evaluates the weights (lazy=False)
    finally:
        Model.sanitize = sanitize
    if patch:
        model.audio_tokenizer._alibi_slopes = spec_alibi_slopes(model.audio_tokenizer.args.n_heads)
        spec_decoding_steps(model, Path(model_dir))
    return model


def _small_shards(max_bytes: int):
    """mlx-lm's make_shards greedy rule with a byte limit instead of whole gigabytes."""

    def make_shards(weights: dict, max_file_size_gb: int = 0) -> list:
        shards, shard, size = [], {}, 0
        for name, weight in weights.items():
            if shard and size + weight.nbytes > max_bytes:
                shards.append(shard)
                shard, size = {}, 0
            shard[name] = weight
            size += weight.nbytes
        shards.append(shard)
        return shards

    return make_shards


def build_mlx_community(
    src: Path,
    out: Path,
    bits: int | None,
    shard_bytes: int | None = None,
    *,
    group: int | None = 64,
    dtype: mx.Dtype = mx.bfloat16,
    mode: str = "affine",
) -> Path:
    """What ``python -m mlx_audio.convert --hf-path SRC [-q --q-bits B]`` writes from a
    Mistral-layout ``src``, step by step with mlx-audio's own functions (its CLI needs a
    config.json the source does not have); ``shard_bytes`` forces small shards, as > 5 GB
    does on the real model. ``mode``: mlx-audio's ``--q-mode`` (with ``group`` and ``bits``
    None, that mode's own)."""
    from mlx.utils import tree_flatten
    from mlx_audio.convert import build_quant_predicate, copy_model_files
    from mlx_audio.lm import convert as lm_convert
    from mlx_audio.tts.models.voxtral_tts.voxtral_tts import Model, ModelConfig

    config = json.loads((src / "params.json").read_text())
    model = Model(ModelConfig.from_dict(config))
    model.load_weights(list(model.sanitize(mx.load(str(src / "consolidated.safetensors"))).items()))
    model.load_weights([(k, v.astype(dtype)) for k, v in tree_flatten(model.parameters())])
    if bits is not None or mode != "affine":
        model, config = lm_convert.quantize_model(
            model, config, group, bits, mode=mode, quant_predicate=build_quant_predicate(model)
        )
    staging = out.parent / f"{out.name}-staging"  # the Hub snapshot mlx-audio would copy from
    shutil.copytree(src, staging, ignore=shutil.ignore_patterns("*.safetensors", "*.pt"))
    for voice in (src / "voice_embedding").glob("*.safetensors"):
        shutil.copy(voice, staging / "voice_embedding" / voice.name)
    out.mkdir(parents=True)
    copy_model_files(staging, out)
    shutil.rmtree(staging)
    original = lm_convert.make_shards
    if shard_bytes is not None:
        lm_convert.make_shards = _small_shards(shard_bytes)
    try:
        lm_convert.save_model(out, model, donate_model=True)
    finally:
        lm_convert.make_shards = original
    config["model_type"] = "voxtral_tts"
    lm_convert.save_config(config, config_path=out / "config.json")
    return out
