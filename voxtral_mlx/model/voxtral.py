"""The whole Voxtral TTS network, with parameter names equal to ``consolidated.safetensors``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

from ..config import ModelConfig
from .backbone import AudioEmbeddings, Backbone
from .codec import CodecDecoder
from .flow import FlowHead


class VoxtralModel(Backbone):
    """Backbone (its layers and norm sit at the checkpoint's top level) plus its heads.

    ``mm_audio_embeddings`` holds the text and audio-code tables, ``acoustic_transformer``
    the semantic and flow-matching heads, ``audio_tokenizer`` the codec decoder.
    """

    def __init__(
        self, config: ModelConfig, semantic_rows: int | None = None, audio_rows: int | None = None
    ):
        super().__init__(config.backbone)
        self.config = config
        b = config.backbone
        self.mm_audio_embeddings = AudioEmbeddings(
            b.vocab_size, b.dim, audio_rows or config.audio_embedding_rows
        )
        self.acoustic_transformer = FlowHead(config.flow, semantic_rows)
        self.audio_tokenizer = CodecDecoder(config.codec)
        self._code_offsets = mx.array(config.codebook_offsets, dtype=mx.int32)
        self._embed: Callable[[mx.array], mx.array] | None = None

    def prepare(self, compile: bool = True, check: Callable[[], None] | None = None) -> None:
        """Once the weights are loaded (and again after they change): fuse projections,
        precompute constants, compile the fixed-shape steps of the backbone, the flow head
        and the codec. ``check`` is called between layers (see :meth:`Backbone.prepare`)."""
        super().prepare(compile, check)
        self._embed = mx.compile(self.embed_codes) if compile else None
        for part in (self.acoustic_transformer, self.audio_tokenizer):
            if check is not None:
                check()
            part.prepare(compile)

    @property
    def compute_dtype(self) -> mx.Dtype:
        """The dtype activations are computed in (that of the unquantized weights)."""
        return self.norm.weight.dtype

    def embed_text(self, ids: list[int]) -> mx.array:
        """Token embeddings ``[T, dim]`` in the compute dtype (a table quantized to a float
        format, mxfp4 and the like, dequantizes to bfloat16 whatever that is)."""
        table = self.mm_audio_embeddings.tok_embeddings
        return table(mx.array(ids)).astype(self.compute_dtype)

    def embed_prompt(self, ids: list[int], voice: mx.array, voice_start: int) -> mx.array:
        """Token embeddings ``[1, T, dim]`` with the ``[AUDIO]`` rows replaced by the voice."""
        n = voice.shape[0]
        before = self.embed_text(ids[:voice_start])
        after = self.embed_text(ids[voice_start + n :])
        return mx.concatenate([before, voice.astype(before.dtype), after], axis=0)[None]

    def embed_codes(self, codes: mx.array) -> mx.array:
        """Sum of the 37 offset codebook embeddings: ``[B, 37]`` -> ``[B, 1, dim]``."""
        rows = self.mm_audio_embeddings.audio_codebook_embeddings.embeddings(
            codes + self._code_offsets
        )
        if rows.dtype != self.compute_dtype:  # a table quantized to a float format
            rows = rows.astype(self.compute_dtype)
        return rows.sum(axis=-2)[:, None, :]

    def frame(self, h: mx.array, noise: mx.array, cfg: mx.array) -> tuple[mx.array, mx.array]:
        """Semantic codes ``[B]`` and codes ``[B, 37]`` of the frame ``h [B, dim]`` predicts
        (``cfg [B, 2]``: see :func:`~voxtral_mlx.model.flow.cfg_weights`)."""
        return self.acoustic_transformer(h, noise, cfg)

    def step(self, codes: mx.array, cache: list[Any]) -> mx.array:
        """Feed one frame's codes back: next hidden state ``[B, dim]``."""
        return self((self._embed or self.embed_codes)(codes), cache)[:, -1]
