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
