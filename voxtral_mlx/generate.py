"""Frames from a prompt: prefill, then one backbone step and one flow-matching step per frame.

Layering (as in mlx-lm): :func:`generate_frames` yields the codes of each frame as soon as
they are known; the TTS object turns frames into audio chunks and whole utterances.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from .config import END_AUDIO
from .errors import InputError
from .model.voxtral import VoxtralModel

NOISE_BLOCK = 64  # frames of start noise drawn per key; independent of max_frames


class NoiseSource:
    """Start noise of the flow-matching ODE, one row of 36 per frame.

    Either given explicitly (row i for frame i) or drawn from a per-request key:
    block b of 64 frames uses the b-th key of a split chain started at ``seed``, so the
    noise of a frame depends only on the seed and the frame index, never on global state.
    """

    def __init__(self, width: int, seed: int | None = None, noise: np.ndarray | None = None):
        self.width = width
        if noise is not None:
            arr = np.asarray(noise)
            if arr.ndim != 2 or arr.shape[1] != width or not np.issubdtype(arr.dtype, np.floating):
                raise InputError(
                    f"noise must be a float array of shape [frames, {width}], got "
                    f"{arr.dtype} {list(arr.shape)}"
                )
            if not np.all(np.isfinite(arr)):
                raise InputError("noise contains NaN or infinite values")
            self.seed = None
            self.limit: int | None = arr.shape[0]
            self._explicit = mx.array(arr.astype(np.float32))
        else:
            self.seed = secrets.randbits(63) if seed is None else int(seed)
            self.limit = None
            self._explicit = None
            self._key = mx.random.key(self.seed)
            self._blocks: list[mx.array] = []

    def row(self, i: int) -> mx.array:
        """Noise of frame ``i`` as ``[1, width]`` float32."""
        if self._explicit is not None:
            return self._explicit[i : i + 1]
        b, r = divmod(i, NOISE_BLOCK)
        while len(self._blocks) <= b:
            self._key, sub = mx.random.split(self._key)
            self._blocks.append(mx.random.normal((NOISE_BLOCK, self.width), key=sub))
        return self._blocks[b][r : r + 1]


@dataclass
class FrameTimings:
    prefill_s: float = 0.0
    first_frame_s: float = 0.0
    frames_s: float = 0.0
    frames: int = 0
    prompt_tokens: int = 0


@dataclass
class Frame:
    index: int
    codes: mx.array  # [37] int32 on the device, +2-offset codes as generated
    timings: FrameTimings = field(repr=False)


def generate_frames(
    model: VoxtralModel,
    prompt: mx.array,
    noise: NoiseSource,
    *,
    max_frames: int,
    cfg_alpha: float,
    cache: list | None = None,
) -> Iterator[Frame]:
    """Yield frames until END_AUDIO or ``max_frames``.

    ``prompt`` holds the prompt embeddings ``[1, T, dim]`` (voice rows spliced in); the
    hidden state of its last position predicts frame 0 directly. The one host sync per
    frame reads the semantic code (END check) as soon as the semantic head is done; the
    next frame is queued right after it, while this frame's flow-matching steps still run,
    and never on an END frame. Codes stay on the device. The first frame is handed over
    before the second is queued, so that its audio is not stuck behind a second frame.
    """
    timings = FrameTimings(prompt_tokens=prompt.shape[1])
    if noise.limit is not None:
        max_frames = min(max_frames, noise.limit)
    if max_frames <= 0:
        return
    cache = model.make_cache() if cache is None else cache
    t0 = time.perf_counter()
    h = model(prompt, cache)[:, -1]
    mx.eval(h)
    start = time.perf_counter()
    timings.prefill_s = start - t0

    def queue(i: int, codes: mx.array) -> tuple[mx.array, mx.array]:
        nxt = model.frame(model.step(codes, cache), noise.row(i), cfg_alpha)
        mx.async_eval(*nxt)
        return nxt

    semantic, codes = model.frame(h, noise.row(0), cfg_alpha)
    mx.async_eval(semantic, codes)
    for i in range(max_frames):
        if semantic.item() == END_AUDIO:
            return
        last = i + 1 == max_frames
        pending = queue(i + 1, codes) if i > 0 and not last else None
        now = time.perf_counter()
        if i == 0:
            timings.first_frame_s = now - t0
        timings.frames = i + 1
        timings.frames_s = now - start
        yield Frame(i, codes[0], timings)
        if i == 0 and not last:
            pending = queue(1, codes)
        if pending is None:
            return
        semantic, codes = pending
