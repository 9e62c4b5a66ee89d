"""The backbone's KV cache, one object per layer, created and held by the caller.

mlx-lm's ``KVCache`` has the same interface, but importing ``mlx_lm`` pulls in
``transformers`` (2.7-4.8 s measured on a CLI start), so the few lines are kept here.
"""

from __future__ import annotations

import mlx.core as mx


class KVCache:
    """Keys and values ``[B, kv_heads, T, head_dim]`` grown in steps of 256 positions."""

    step = 256

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        prev, n = self.offset, keys.shape[2]
        if self.keys is None or prev + n > self.keys.shape[2]:
            grow = -(-n // self.step) * self.step
            b, h, _, d = keys.shape
            new_k = mx.zeros((b, h, grow, d), keys.dtype)
            new_v = mx.zeros((b, h, grow, values.shape[3]), values.dtype)
            if self.keys is None:
                self.keys, self.values = new_k, new_v
            else:
                self.keys = mx.concatenate([self.keys[..., :prev, :], new_k], axis=2)
                self.values = mx.concatenate([self.values[..., :prev, :], new_v], axis=2)
        self.offset += n
        self.keys[..., prev : self.offset, :] = keys
        self.values[..., prev : self.offset, :] = values
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    def mask(self, n_queries: int) -> str | None:
        return "causal" if n_queries > 1 else None

    def copy(self) -> KVCache:
        """An independent cache starting from this one's content (e.g. a cached voice prefix).

        The copy holds views trimmed to ``offset``, so its first update reallocates instead of
        writing into buffers the original still uses.
        """
        out = KVCache()
        if self.keys is not None:
            out.keys = self.keys[..., : self.offset, :]
            out.values = self.values[..., : self.offset, :]
            out.offset = self.offset
        return out

    @property
    def state(self) -> list[mx.array]:
        if self.keys is None:
            return []
        return [self.keys[..., : self.offset, :], self.values[..., : self.offset, :]]

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


class BatchKVCache:
    """Keys/values of several sequences of different lengths, right-aligned.

    Row ``b`` holds ``left_padding[b]`` empty slots, then its own positions; every decode
    step writes one slot for all rows at index ``length``. Sequences join (:meth:`merge`)
    and leave (:meth:`filter`) between steps. RoPE takes each row's own position
    (``offset``) and the mask hides the padding.
    """

    step = 256

    def __init__(self, keys: mx.array, values: mx.array, left_padding: list[int], length: int):
        self.keys = keys
        self.values = values
        self.left_padding = list(left_padding)
        self.length = length  # slots used, padding included
        self._offset = mx.array([length - p for p in self.left_padding], dtype=mx.int32)

    @classmethod
    def from_single(cls, cache: KVCache) -> BatchKVCache:
        k, v = cache.state
        return cls(k, v, [0], cache.offset)

    @property
    def batch(self) -> int:
        return len(self.left_padding)

    @property
    def offset(self) -> mx.array:
        """Position of the next token of each row ``[B]`` (for RoPE)."""
        return self._offset

    def mask(self, n_queries: int) -> mx.array | None:
        """Additive mask ``[B, 1, 1, length + 1]`` hiding each row's padding (None if none)."""
        if n_queries != 1:
            raise ValueError("a batch cache only decodes one position per step")
        if not any(self.left_padding):
            return None
        slots = mx.arange(self.length + 1)[None, :]
        pad = mx.array(self.left_padding)[:, None]
        return mx.where(slots < pad, -mx.inf, 0.0)[:, None, None, :].astype(self.keys.dtype)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        i = self.length
        if i + 1 > self.keys.shape[2]:
            b, h, _, d = self.keys.shape
            pad_k = mx.zeros((b, h, self.step, d), self.keys.dtype)
            pad_v = mx.zeros((b, h, self.step, self.values.shape[3]), self.values.dtype)
            self.keys = mx.concatenate([self.keys[..., :i, :], pad_k], axis=2)
            self.values = mx.concatenate([self.values[..., :i, :], pad_v], axis=2)
        self.keys[..., i : i + 1, :] = keys
        self.values[..., i : i + 1, :] = values
        self.length += 1
        self._offset = self._offset + 1
        return self.keys[..., : i + 1, :], self.values[..., : i + 1, :]

    def filter(self, rows: list[int]) -> None:
        """Keep only ``rows`` (in that order); drop the padding no remaining row needs."""
        idx = mx.array(rows)
        pads = [self.left_padding[r] for r in rows]
        trim = min(pads) if pads else 0
        self.keys = self.keys[idx, :, trim : self.length, :]
        self.values = self.values[idx, :, trim : self.length, :]
        self.left_padding = [p - trim for p in pads]
        self.length -= trim
        self._offset = self._offset[idx]

    def extract(self, row: int) -> BatchKVCache:
        """Row ``row`` alone, without its padding (for a sequence leaving the batch for a
        while, to :meth:`merge` back later)."""
        pad = self.left_padding[row]
        # Copies: a slice would keep the whole batch's buffer alive while the row is away.
        return BatchKVCache(
            mx.contiguous(self.keys[row : row + 1, :, pad : self.length, :]),
            mx.contiguous(self.values[row : row + 1, :, pad : self.length, :]),
            [0],
            self.length - pad,
        )

    def merge(self, other: BatchKVCache) -> None:
        """Append ``other``'s rows, padding whichever side is shorter on the left."""
        n = max(self.length, other.length)
        k1, v1, p1 = _left_pad(self, n)
        k2, v2, p2 = _left_pad(other, n)
        self.keys = mx.concatenate([k1, k2], axis=0)
        self.values = mx.concatenate([v1, v2], axis=0)
        self._offset = mx.concatenate([self._offset, other._offset])
        self.left_padding = p1 + p2
        self.length = n

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


def _left_pad(cache: BatchKVCache, n: int) -> tuple[mx.array, mx.array, list[int]]:
    k = cache.keys[..., : cache.length, :]
    v = cache.values[..., : cache.length, :]
    extra = n - cache.length
    if extra:
        b, h, _, d = k.shape
        k = mx.concatenate([mx.zeros((b, h, extra, d), k.dtype), k], axis=2)
        v = mx.concatenate([mx.zeros((b, h, extra, v.shape[3]), v.dtype), v], axis=2)
    return k, v, [p + extra for p in cache.left_padding]
