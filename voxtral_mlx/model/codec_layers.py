"""Building blocks of the codec decoder, each a step function over caller-held context.

Every layer takes the new time steps plus the context it needs from earlier steps and
returns its output plus the context for the next call, so a whole utterance and any
split of it into chunks give the same result (SPEC §6). Convolutions are written as one
matmul against a free reshape of the MLX-layout weight ``[out, k, in]``: no per-call
weight copies, which matters when the decoder runs once per 80 ms frame.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from .layers import FeedForward, Fused, fuse_linears, products


def alibi_slopes(n_heads: int) -> list[float]:
    """Mistral's codec ALiBi slopes: ``r**h`` with ``r = 2**(-8/n)`` (1, 1/2, ..., 1/128 for 8).

    For a head count that is not a power of two: the slopes of the largest power of two
    ``m`` below it, then every other slope of the rule for ``2m``, as Mistral computes them.
    """

    def rule(n: int) -> list[float]:
        r = 2.0 ** (-8.0 / n)
        return [r**h for h in range(n)]

    if n_heads & (n_heads - 1) == 0:
        return rule(n_heads)
    m = 2 ** math.floor(math.log2(n_heads))
    return rule(m) + rule(2 * m)[0::2][: n_heads - m]


def attention_bias(slopes: mx.array, window: int, n: int, n_valid: int,
                   dtype: mx.Dtype = mx.float32) -> mx.array:  # fmt: skip
    """Additive mask ``[heads, n, window + n]`` for ``n`` queries over ``window`` cached keys
    followed by the ``n`` new ones.

    Query ``i`` sees keys ``i - window .. i`` with ALiBi bias ``slope * (j - i)``; only the
    last ``n_valid`` cache slots hold real keys (fewer than ``window`` at the start). Built
    lazily on the device: nothing crosses to the host.
    """
    i = mx.arange(n)[:, None]
    j = mx.arange(window + n)[None, :]
    rel = j - window - i  # key position minus query position
    keep = (rel <= 0) & (rel >= -window) & (j >= window - n_valid)
    bias = slopes.astype(mx.float32)[:, None, None] * rel.astype(mx.float32)
    return mx.where(keep, bias, -mx.inf).astype(dtype)


def banded_attention_bias(slopes: mx.array, window: int, block: int, n: int, n_valid: int,
                          dtype: mx.Dtype = mx.float32) -> mx.array:  # fmt: skip
    """Additive mask ``[blocks, heads, block, block + window]`` for banded attention.

    The ``n`` queries are cut into ``ceil(n / block)`` blocks (``block >= window``); block
    ``j`` sees the ``block + window`` keys starting at its first query's earliest key, so the
    work grows linearly with ``n`` instead of quadratically. Same keep rule and ALiBi bias as
    :func:`attention_bias`; only block 0 can see cache slots that hold no key yet.
    """
    blocks = -(-n // block)
    r = mx.arange(block)[:, None]
    c = mx.arange(block + window)[None, :]
    rel = c - window - r
    keep = (rel <= 0) & (rel >= -window)
    first = keep & (c >= window - n_valid)
    keep = mx.concatenate([first[None], mx.broadcast_to(keep, (blocks - 1, *keep.shape))])
    bias = slopes.astype(mx.float32)[None, :, None, None] * rel.astype(mx.float32)
    return mx.where(keep[:, None], bias, -mx.inf).astype(dtype)


def banded_attention(
    q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array
) -> mx.array:
    """Sliding-window attention of ``q [B, H, n, D]`` over ``k, v [B, Hk, window + n, D]``
    (``window`` cached steps, then the ``n`` new ones) with a :func:`banded_attention_bias`
    mask: each block of queries attends only to the keys its window can reach."""
    b, heads, n, d = q.shape
    blocks, _, block, width = mask.shape
    window = width - block
    kv_heads = k.shape[1]
    q = mx.pad(q, [(0, 0), (0, 0), (0, blocks * block - n), (0, 0)])
    q = q.reshape(b, heads, blocks, block, d).transpose(0, 2, 1, 3, 4)

    def spans(x: mx.array) -> mx.array:
        x = mx.pad(x, [(0, 0), (0, 0), (0, (blocks + 1) * block - x.shape[2]), (0, 0)])
        x = x.reshape(b, kv_heads, blocks + 1, block, x.shape[-1])
        x = mx.concatenate([x[:, :, :-1], x[:, :, 1:, :window]], axis=3)
        return x.transpose(0, 2, 1, 3, 4).reshape(b * blocks, kv_heads, width, -1)

    if b > 1:
        mask = mx.tile(mask, (b, 1, 1, 1))
    out = mx.fast.scaled_dot_product_attention(
        q.reshape(b * blocks, heads, block, d), spans(k), spans(v), scale=scale, mask=mask
    )
    out = out.reshape(b, blocks, heads, block, -1).transpose(0, 2, 1, 3, 4)
    return out.reshape(b, heads, blocks * block, -1)[:, :, :n]


def replicate_context(x: mx.array, n: int) -> mx.array:
    """Left context of a replicate-padded conv at the very start: ``n`` copies of step 0."""
    return mx.repeat(x[:, :1], n, axis=1)


def reflect_context(x: mx.array, n: int) -> mx.array:
    """Left context of a reflect-padded conv at the very start: steps ``n .. 1`` of ``x``.

    Inputs of ``n`` steps or fewer are first extended with zeros on the right, as Mistral's
    ``pad1d`` does (torch's reflect padding needs more steps than the pad).
    """
    if x.shape[1] <= n:
        x = mx.pad(x, [(0, 0), (0, n + 1 - x.shape[1]), (0, 0)])
    return x[:, n:0:-1]


class CausalConv1d(nn.Module):
    """Stride-1 causal Conv1d, weight ``[out, k, in]``; the caller supplies ``k - 1`` steps of
    left context (the padding at the start, the previous inputs afterwards)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int):
        super().__init__()
        self.weight = mx.zeros((out_channels, kernel_size, in_channels))

    @property
    def context(self) -> int:
        return self.weight.shape[1] - 1

    def __call__(self, x: mx.array, context: mx.array) -> tuple[mx.array, mx.array]:
        """``x [B, n, in]`` and ``context [B, k-1, in]`` -> ``([B, n, out], next context)``."""
        out_ch, k, in_ch = self.weight.shape
        n = x.shape[1]
        full = mx.concatenate([context, x], axis=1) if k > 1 else x
        cols = full if k == 1 else mx.concatenate([full[:, i : i + n] for i in range(k)], axis=-1)
        y = cols @ self.weight.reshape(out_ch, k * in_ch).T
        return y, full[:, n:]


class CausalConvTranspose1d(nn.Module):
    """Causal ConvTranspose1d, weight ``[out, k, in]``, whose full output is trimmed by
    ``k - stride`` on the right: ``n`` inputs give exactly ``n * stride`` outputs.

    Output step ``s*t + r`` is ``sum_j x[t - j] @ W[j*s + r]``, so it needs
    ``ceil(k / s) - 1`` earlier inputs (zeros at the start, where the full convolution
    has nothing either).
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int):
        super().__init__()
        self.weight = mx.zeros((out_channels, kernel_size, in_channels))
        self.stride = stride

    @property
    def context(self) -> int:
        return -(-self.weight.shape[1] // self.stride) - 1

    def __call__(self, x: mx.array, context: mx.array) -> tuple[mx.array, mx.array]:
        """``x [B, n, in]`` and ``context [B, ceil(k/s)-1, in]`` -> ``[B, n*s, out]``, context."""
        out_ch, k, in_ch = self.weight.shape
        s = self.stride
        taps = -(-k // s)
        b, n, _ = x.shape
        full = mx.concatenate([context, x], axis=1) if taps > 1 else x
        z = (full @ self.weight.reshape(out_ch * k, in_ch).T).reshape(b, -1, out_ch, k)
        if taps * s != k:
            z = mx.pad(z, [(0, 0), (0, 0), (0, 0), (0, taps * s - k)])
        z = z.reshape(b, -1, out_ch, taps, s)
        y = z[:, taps - 1 : taps - 1 + n, :, 0]
        for j in range(1, taps):
            y = y + z[:, taps - 1 - j : taps - 1 - j + n, :, j]
        y = y.transpose(0, 1, 3, 2).reshape(b, n * s, out_ch)
        return y, full[:, n:]


class ConvBlock(nn.Module):
    """Holds a conv as ``.conv`` so names match the checkpoint (``decoder_blocks.0.conv``)."""

    def __init__(self, conv: nn.Module):
        super().__init__()
        self.conv = conv


class CodecAttention(nn.Module):
    """Sliding-window ALiBi attention with q/k RMSNorm over the full width (before the
    head split), no RoPE; K/V are never repeated for grouped heads."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, qk_norm_eps: float):
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)
        self.q_norm = nn.RMSNorm(n_heads * head_dim, eps=qk_norm_eps)
        self.k_norm = nn.RMSNorm(n_kv_heads * head_dim, eps=qk_norm_eps)
        self._qkv: Fused | None = None

    def fuse(self) -> None:
        """Compute wq, wk and wv as one product from now on (after the weights are loaded)."""
        self._qkv = fuse_linears([self.wq, self.wk, self.wv])

    def __call__(
        self, x: mx.array, keys: mx.array, values: mx.array, mask: mx.array
    ) -> tuple[mx.array, mx.array, mx.array]:
        """``x [B, n, dim]``, cached ``keys``/``values [B, kv_heads, W, head_dim]`` (keys after
        k_norm), ``mask [heads, n, W + n]`` (or banded: see :func:`banded_attention_bias`)
        -> output and the ``W + n`` keys/values."""
        b, n, _ = x.shape
        q, k, v = products(self._qkv, [self.wq, self.wk, self.wv], x)
        q = self.q_norm(q).reshape(b, n, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = self.k_norm(k).reshape(b, n, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = v.reshape(b, n, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        k = mx.concatenate([keys, k], axis=2)
        v = mx.concatenate([values, v], axis=2)
        if mask.ndim == 4:  # banded (see banded_attention_bias)
            out = banded_attention(q, k, v, self.scale, mask)
        else:
            out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.wo(out.transpose(0, 2, 1, 3).reshape(b, n, -1)), k, v


class CodecTransformerLayer(nn.Module):
    """``h = x + attention_scale * attn(norm(x))``; ``out = h + ffn_scale * ffn(norm(h))``."""

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        norm_eps: float,
        qk_norm_eps: float,
    ):
        super().__init__()
        self.attention = CodecAttention(dim, n_heads, n_kv_heads, head_dim, qk_norm_eps)
        self.feed_forward = FeedForward(dim, hidden_dim)
        self.attention_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.ffn_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.attention_scale = mx.ones((dim,))
        self.ffn_scale = mx.ones((dim,))

    def fuse(self) -> None:
        """Fuse the projections (see :meth:`CodecAttention.fuse`)."""
        self.attention.fuse()
        self.feed_forward.fuse()

    def __call__(
        self, x: mx.array, keys: mx.array, values: mx.array, mask: mx.array
    ) -> tuple[mx.array, mx.array, mx.array]:
        r, keys, values = self.attention(self.attention_norm(x), keys, values, mask)
        h = x + self.attention_scale * r
        return h + self.ffn_scale * self.feed_forward(self.ffn_norm(h)), keys, values


class CodecTransformer(nn.Module):
    """The transformer block of one decoder stage (``decoder_blocks.{2s+1}.layers``)."""

    def __init__(self, n_layers: int, **layer_args):
        super().__init__()
        self.layers = [CodecTransformerLayer(**layer_args) for _ in range(n_layers)]
