"""Transformer pieces shared by the backbone and the flow-matching head.

Parameter names follow Mistral's checkpoint (``attention.wq``, ``feed_forward.w1``,
``attention_norm``, ``ffn_norm``) so loading it is the identity.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn


class Fused:
    """Several linear layers of one input computed as one product (fewer kernels per step:
    what costs most in a frame of the small flow-matching layers, on a GPU as here).

    Held as a plain attribute, outside the module tree: its weights are the parts' own,
    whose parameters become views of it, so nothing is stored or counted twice.
    """

    def __init__(self, layer: nn.Module, sizes: list[int]):
        self.layer = layer
        self._splits = [sum(sizes[: i + 1]) for i in range(len(sizes) - 1)]

    def __call__(self, x: mx.array) -> list[mx.array]:
        return mx.split(self.layer(x), self._splits, axis=-1)

    def joined(self, x: mx.array) -> mx.array:
        """The parts' outputs side by side, unsplit."""
        return self.layer(x)


def products(fused: Fused | None, parts: list[nn.Module], x: mx.array) -> list[mx.array]:
    """Each of ``parts`` applied to ``x``: by their fused product when there is one."""
    return fused(x) if fused is not None else [part(x) for part in parts]


def fuse_linears(parts: list[nn.Module]) -> Fused | None:
    """``parts`` (linear layers of the same input) as one :class:`Fused` product, their
    weights concatenated along the output axis; None when they differ in kind (a
    checkpoint may quantize them differently)."""

    def kind(m: nn.Module) -> tuple:
        arrays = tuple(sorted((k, v.dtype) for k, v in m.items() if isinstance(v, mx.array)))
        quantized = tuple(getattr(m, a, None) for a in ("bits", "group_size", "mode"))
        return type(m), arrays, quantized

    if len({kind(m) for m in parts}) != 1:
        return None
    names = [k for k, _ in kind(parts[0])[1]]
    joined = {k: mx.concatenate([m[k] for m in parts]) for k in names}
    mx.eval(joined)
    fused = copy.copy(parts[0])
    fused.update(joined)
    start, sizes = 0, []
    for m in parts:
        n = m["weight"].shape[0]
        m.update({k: joined[k][start : start + n] for k in names})
        start += n
        sizes.append(n)
    mx.eval([m.parameters() for m in parts])  # views: the separate buffers are let go
    return Fused(fused, sizes)


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
        self._qkv: Fused | None = None
        self._kv: Fused | None = None

    def fuse(self, query_apart: bool = False) -> None:
        """Compute wq, wk and wv as one product from now on (after the weights are loaded;
        again after they change); with ``query_apart``, wk and wv only (a layer whose
        queries are needed at fewer positions than its keys: see :meth:`first_query`)."""
        if query_apart:
            self._qkv, self._kv = None, fuse_linears([self.wk, self.wv])
        else:
            self._qkv, self._kv = fuse_linears([self.wq, self.wk, self.wv]), None

    def projections(self, x: mx.array) -> mx.array:
        """Queries, keys and values of ``x [..., dim]`` side by side, ``[..., q + k + v]``
        (for :meth:`split_heads`)."""
        if self._qkv is not None:
            return self._qkv.joined(x)
        return mx.concatenate([self.wq(x), *products(self._kv, [self.wk, self.wv], x)], -1)

    def split_heads(self, qkv: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """:meth:`projections` ``[B, T, q + k + v]`` as queries, keys and values
        ``[B, heads, T, head_dim]``."""
        q_size = self.n_heads * self.head_dim
        q, k, v = mx.split(qkv, [q_size, q_size + self.n_kv_heads * self.head_dim], axis=-1)
        return self._heads(q, self.n_heads), *(self._heads(a, self.n_kv_heads) for a in (k, v))

    def _heads(self, x: mx.array, n: int) -> mx.array:
        b, t, _ = x.shape
        return x.reshape(b, t, n, self.head_dim).transpose(0, 2, 1, 3)

    def _keys_values(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """Keys and values ``[B, kv_heads, T, head_dim]`` when wq is not fused with them."""
        k, v = products(self._kv, [self.wk, self.wv], x)
        return self._heads(k, self.n_kv_heads), self._heads(v, self.n_kv_heads)

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """Queries, keys and values ``[B, heads, T, head_dim]`` of ``x [B, T, dim]``."""
        if self._qkv is not None:
            return self.split_heads(self._qkv.joined(x))
        return self._heads(self.wq(x), self.n_heads), *self._keys_values(x)

    def rotate(self, x: mx.array, offset: int | mx.array) -> mx.array:
        """RoPE at positions ``offset`` onwards (an array: one start per row)."""
        return mx.fast.rope(
            x, self.head_dim, traditional=True, base=self.rope_theta, scale=1.0, offset=offset
        )

    def merge_heads(self, out: mx.array) -> mx.array:
        """The output projection of attention outputs ``[B, heads, T, head_dim]``."""
        b, _, t, _ = out.shape
        return self.wo(out.transpose(0, 2, 1, 3).reshape(b, t, -1))

    def __call__(
        self, x: mx.array, cache: Any = None, mask: mx.array | str | None = None
    ) -> mx.array:
        q, k, v = self.project(x)
        if self.rope_theta is not None:
            offset = cache.offset if cache is not None else 0
            q, k = self.rotate(q, offset), self.rotate(k, offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.merge_heads(out)

    def first_query(self, x: mx.array) -> mx.array:
        """Position 0's output ``[B, 1, dim]`` over all positions of ``x [B, t, dim]``, with no
        mask, cache or positions (the flow head's bidirectional layers): the query of
        position 0 only when the layer was fused with ``query_apart``."""
        if self._qkv is not None:
            q, k, v = self.project(x)
            q = q[:, :, :1]
        else:
            q = self._heads(self.wq(x[:, :1]), self.n_heads)
            k, v = self._keys_values(x)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale)
        return self.merge_heads(out)


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self._w13: Fused | None = None

    def fuse(self) -> None:
        """Compute w1 and w3 as one product from now on (see :meth:`Attention.fuse`)."""
        self._w13 = fuse_linears([self.w1, self.w3])

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = products(self._w13, [self.w1, self.w3], x)
        return self.w2(nn.silu(gate) * up)


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
        self._decode: tuple[Callable, Callable] | None = None

    def prepare(self, compile_decode: bool = False, query_apart: bool = False) -> None:
        """Fuse the projections (after the weights are loaded; again after they change; for
        ``query_apart`` see :meth:`Attention.fuse`) and, with ``compile_decode``, compile
        the fixed-shape parts of a one-position step."""
        self.attention.fuse(query_apart)
        self.feed_forward.fuse()
        self._decode = (
            (mx.compile(self._decode_in), mx.compile(self._after_attention))
            if compile_decode
            else None
        )

    def _decode_in(self, x: mx.array, offset: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        q, k, v = self.attention.project(self.attention_norm(x))
        return self.attention.rotate(q, offset), self.attention.rotate(k, offset), v

    def _after_attention(self, x: mx.array, out: mx.array) -> mx.array:
        """The block's output from its input ``x`` and attention outputs ``out``
        ``[B, heads, T, head_dim]``: output projection, residuals and SwiGLU."""
        h = x + self.attention.merge_heads(out)
        return h + self.feed_forward(self.ffn_norm(h))

    def __call__(
        self, x: mx.array, cache: Any = None, mask: mx.array | str | None = None
    ) -> mx.array:
        """``x [B, T, dim]``. One new position per row (``T == 1``) with a cache giving each
        row's position as an array runs compiled (after ``prepare(compile_decode=True)``)
        but for the cache update and the attention itself; a position given as a number
        would be a constant of the graph."""
        if (
            self._decode is not None
            and x.shape[1] == 1
            and isinstance(getattr(cache, "offset", None), mx.array)
        ):
            decode_in, after_attention = self._decode
            q, k, v = decode_in(x, cache.offset)
            k, v = cache.update_and_fetch(k, v)
            out = mx.fast.scaled_dot_product_attention(
                q, k, v, scale=self.attention.scale, mask=mask
            )
            return after_attention(x, out)
        h = x + self.attention(self.attention_norm(x), cache, mask)
        return h + self.feed_forward(self.ffn_norm(h))

    def first_position(self, x: mx.array) -> mx.array:
        """The block's output at position 0 only, ``[B, 1, dim]``, for a bidirectional block
        without positions: every position is still a key, but the attention output, output
        projection and SwiGLU of the other positions are never computed."""
        h0 = x[:, :1] + self.attention.first_query(self.attention_norm(x))
        return h0 + self.feed_forward(self.ffn_norm(h0))

    def from_projections(self, x: mx.array, qkv: mx.array, first_only: bool = False) -> mx.array:
        """The block's output for ``x [B, T, dim]`` whose queries, keys and values are
        already known (``qkv``: :meth:`Attention.projections` of ``attention_norm(x)``), for
        a bidirectional block without positions; with ``first_only``, at position 0 only
        (as :meth:`first_position`)."""
        q, k, v = self.attention.split_heads(qkv)
        if first_only:
            q, x = q[:, :, :1], x[:, :1]
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.attention.scale)
        return self._after_attention(x, out)


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
