"""Read a model directory into a ready :class:`VoxtralModel`, checking everything on the way."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from .checkpoint import (
    checkpoint_dtype,
    expected_tensors,
    load_tensors,
    read_safetensors_header,
    sanitize,
    verify_tensors,
)
from .config import ModelConfig
from .errors import CheckpointError, ConfigError, ModelNotFoundError
from .model.voxtral import VoxtralModel
from .tokenizer import TekkenTokenizer
from .voices import VoiceRegistry

DTYPES = {
    "bfloat16": mx.bfloat16,
    "bf16": mx.bfloat16,
    "float16": mx.float16,
    "fp16": mx.float16,
    "float32": mx.float32,
    "fp32": mx.float32,
}


@dataclass
class LoadedModel:
    model: VoxtralModel
    config: ModelConfig
    tokenizer: TekkenTokenizer
    voices: VoiceRegistry
    dtype: mx.Dtype
    path: Path


def parse_dtype(dtype: str | mx.Dtype | None) -> mx.Dtype | None:
    if dtype is None or isinstance(dtype, mx.Dtype):
        return dtype
    try:
        return DTYPES[str(dtype).lower()]
    except KeyError:
        raise ConfigError(
            f"unsupported dtype {dtype!r}: use bfloat16, float16 or float32"
        ) from None


def _check_tokenizer(config: ModelConfig, tokenizer: TekkenTokenizer) -> None:
    pairs = [
        ("<s>", config.bos_token_id, "multimodal.bos_token_id"),
        ("[AUDIO]", config.audio_token_id, "multimodal.audio_model_args.audio_token_id"),
        (
            "[BEGIN_AUDIO]",
            config.begin_audio_token_id,
            "multimodal.audio_model_args.begin_audio_token_id",
        ),
    ]
    for token, expected, key in pairs:
        got = tokenizer.special_id(token)
        if got != expected:
            raise ConfigError(
                f"tekken.json puts {token} at id {got} but params.json key '{key}' says "
                f"{expected}: the tokenizer and the weights come from different models"
            )
    if tokenizer.vocab_size > config.backbone.vocab_size:
        raise ConfigError(
            f"tekken.json has {tokenizer.vocab_size} ids but params.json key 'vocab_size' is "
            f"{config.backbone.vocab_size}: the tokenizer and the weights do not match"
        )


def load_model_dir(model_dir: Path, dtype: str | mx.Dtype | None = None) -> LoadedModel:
    """Load Mistral's layout: params.json, tekken.json, consolidated.safetensors, voices."""
    if not (model_dir / "params.json").is_file():
        raise ModelNotFoundError(
            f"{model_dir} has no params.json: it is not a Voxtral TTS model directory"
        )
    config = ModelConfig.from_file(model_dir / "params.json")
    tokenizer = TekkenTokenizer.from_file(model_dir / "tekken.json")
    _check_tokenizer(config, tokenizer)

    weights_path = model_dir / "consolidated.safetensors"
    if not weights_path.is_file():
        raise ModelNotFoundError(
            f"{model_dir} has no consolidated.safetensors: the download is incomplete; fetch "
            "it again"
        )
    infos = read_safetensors_header(weights_path)
    verify_tensors(
        {n: i.shape for n, i in infos.items()}, expected_tensors(config), str(weights_path)
    )
    compute_dtype = parse_dtype(dtype) or checkpoint_dtype(infos)
    weights = load_tensors(weights_path)
    params = sanitize(weights, config, compute_dtype)

    model = VoxtralModel(
        config,
        semantic_rows=infos["acoustic_transformer.semantic_codebook_output.weight"].shape[0],
        audio_rows=infos["mm_audio_embeddings.audio_codebook_embeddings.embeddings.weight"].shape[
            0
        ],
    )
    try:
        model.load_weights(list(params.items()), strict=True)
    except ValueError as e:  # shapes were verified; this guards the renames themselves
        raise CheckpointError(f"{weights_path}: {str(e).splitlines()[0]}") from None
    # Folded codec weights and the flow head's constants are computed once, here.
    mx.eval(model.audio_tokenizer.parameters())
    model.acoustic_transformer.prepare()

    voices = VoiceRegistry.from_dir(
        model_dir / "voice_embedding", tokenizer.voice_num_audio_tokens, config.backbone.dim
    )
    return LoadedModel(model, config, tokenizer, voices, compute_dtype, model_dir)
