"""The Mistral decoder that reads the prompt and emits one hidden state per audio frame."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..config import BackboneArgs
from .cache import KVCache
from .layers import TransformerBlock


class CodebookEmbeddings(nn.Module):
    """``audio_codebook_embeddings``: one table for the 37 offset codebooks."""

    def __init__(self, rows: int, dim: int):
        super().__init__()
        self.embeddings = nn.Embedding(rows, dim)


class AudioEmbeddings(nn.Module):
    """``mm_audio_embeddings``: text token table and the audio codebook table."""

    def __init__(self, vocab_size: int, dim: int, audio_rows: int):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.audio_codebook_embeddings = CodebookEmbeddings(audio_rows, dim)


class Backbone(nn.Module):
    """26 pre-norm layers with interleaved RoPE and a KV cache passed in by the caller."""

    def __init__(self, args: BackboneArgs):
        super().__init__()
        self.args = args
        self.layers = [
            TransformerBlock(
                args.dim,
                args.n_heads,
                args.n_kv_heads,
                args.head_dim,
                args.hidden_dim,
                args.norm_eps,
                rope_theta=args.rope_theta,
            )
            for _ in range(args.n_layers)
        ]
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self._final_norm: Callable[[mx.array], mx.array] | None = None

    def prepare(self, compile: bool = True, check: Callable[[], None] | None = None) -> None:
        """Fuse each layer's projections (after the weights are loaded) and, with
        ``compile``, compile the fixed-shape parts of a one-position step. ``check`` is
        called before each layer (it raises to stop: weights not yet read are read here)."""
        for layer in self.layers:
            if check is not None:
                check()
            layer.prepare(compile_decode=compile)
        self._final_norm = mx.compile(self.norm) if compile else None

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.layers]

    def __call__(self, x: mx.array, cache: list[Any]) -> mx.array:
        """Embeddings ``[B, T, dim]`` -> final-normed hidden states ``[B, T, dim]``."""
        mask = cache[0].mask(x.shape[1])
        for layer, layer_cache in zip(self.layers, cache):
            x = layer(x, layer_cache, mask)
        # Compiled for one position only: each prompt length would be a graph of its own.
        return (self._final_norm if x.shape[1] == 1 and self._final_norm else self.norm)(x)
