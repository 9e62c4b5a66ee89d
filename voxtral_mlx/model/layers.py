"""Transformer pieces shared by the backbone and the flow-matching head.

Parameter names follow Mistral's checkpoint (``attention.wq``, ``feed_forward.w1``,
``attention_norm``, ``ffn_norm``) so loading it is the identity.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn


class Attention(nn.Module):
    """GQA attention; K/V are never repeated (the fused kernel handles the grouping).

    With ``rope_theta`` set, RoPE is applied in the interleaved-pair convention
    (``traditional=True``): Mistral's native checkpoint stores wq/wk for it, and the
    split-half convention gives plausible-looking garbage.
    """

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        rope_theta: float | None = None,
    ):
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.rope_theta = rope_theta
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)

    def __call__(
        self, x: mx.array, cache: Any = None, mask: mx.array | str | None = None
    ) -> mx.array:
        b, t, _ = x.shape
        q = self.wq(x).reshape(b, t, self.n_heads, self.head_dim).transpose(0, 2, 1, 3)
        k = self.wk(x).reshape(b, t, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        v = self.wv(x).reshape(b, t, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        if self.rope_theta is not None:
            offset = cache.offset if cache is not None else 0
            q = mx.fast.rope(
                q, self.head_dim, traditional=True, base=self.rope_theta, scale=1.0, offset=offset
            )
            k = mx.fast.rope(
                k, self.head_dim, traditional=True, base=self.rope_theta, scale=1.0, offset=offset
            )
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.wo(out.transpose(0, 2, 1, 3).reshape(b, t, -1))

    def attend(self, xq: mx.array, xkv: mx.array) -> mx.array:
        """Queries from ``xq [B, n, dim]`` over keys/values from ``xkv [B, t, dim]``, with no
        mask, cache or positions (the flow head's bidirectional layers)."""
        b, n, _ = xq.shape
        t = xkv.shape[1]
        q = self.wq(xq).reshape(b, n, self.n_heads, self.head_dim).transpose(0, 2, 1, 3)
        k = self.wk(xkv).reshape(b, t, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        v = self.wv(xkv).reshape(b, t, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale)
        return self.wo(out.transpose(0, 2, 1, 3).reshape(b, n, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.w2(nn.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: attention and SwiGLU, each with a residual."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        hidden_dim: int,
        norm_eps: float,
        rope_theta: float | None = None,
    ):
        super().__init__()
        self.attention = Attention(dim, n_heads, n_kv_heads, head_dim, rope_theta)
        self.feed_forward = FeedForward(dim, hidden_dim)
        self.attention_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.ffn_norm = nn.RMSNorm(dim, eps=norm_eps)

    def __call__(
        self, x: mx.array, cache: Any = None, mask: mx.array | str | None = None
    ) -> mx.array:
        h = x + self.attention(self.attention_norm(x), cache, mask)
        return h + self.feed_forward(self.ffn_norm(h))

    def first_position(self, x: mx.array) -> mx.array:
        """The block's output at position 0 only, ``[B, 1, dim]``, for a bidirectional block
        without positions: every position is still a key, but the queries, output
        projection and SwiGLU of the other positions are never computed."""
        h = self.attention_norm(x)
        h0 = x[:, :1] + self.attention.attend(h[:, :1], h)
        return h0 + self.feed_forward(self.ffn_norm(h0))


class Float32QuantizedLinear(nn.QuantizedLinear):
    """A quantized linear layer whose product takes float32 activations.

    MLX's CPU kernel for quantized products is off by 5-11 % with bfloat16 or float16
    activations (measured against the dequantized weights) and exact with float32 ones;
    the loader uses this layer on the CPU only (Metal's kernels are exact in any dtype).
    The output keeps the input's dtype.
    """

    @classmethod
    def from_quantized(cls, layer: nn.QuantizedLinear) -> Float32QuantizedLinear:
        """The same weights, scales and biases (shared, not copied)."""
        out_dims, packed = layer.weight.shape
        out = cls(
            packed * 32 // layer.bits,
            out_dims,
            "bias" in layer,
            layer.group_size,
            layer.bits,
            mode=layer.mode,
        )
        out.update(dict(layer.parameters()))
        return out

    def __call__(self, x: mx.array) -> mx.array:
        return super().__call__(x.astype(mx.float32)).astype(x.dtype)
