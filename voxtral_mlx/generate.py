"""Frames for one or many sequences at once: prefill, then per frame one backbone step and
one flow-matching step shared by every live sequence.

Layering (as in mlx-lm): :class:`FrameBatch` produces the codes of each frame as soon as
they are known; the TTS object turns frames into audio chunks and whole utterances.
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from .config import END_AUDIO
from .errors import InputError
from .fileio import one_line
from .model.cache import BatchKVCache, KVCache
from .model.flow import NOT_FINITE, cfg_weights
from .model.voxtral import VoxtralModel

NOISE_BLOCK = 64  # frames of start noise drawn per key; independent of max_frames


def check_seed(seed: object) -> None:
    """Raise InputError unless ``seed`` is None or an integer in [0, 2**64)."""
    if seed is not None and (
        isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**64
    ):
        shown = one_line(repr(seed), 60)
        raise InputError(f"seed must be an integer from 0 to 2**64 - 1, got {shown}")


def to_numpy(value: object, what: str) -> np.ndarray:
    """``value`` (numpy, MLX, nested lists) as a numpy array, MLX bfloat16 (which numpy cannot
    hold) as float32; a ragged list or an object that is no array is an :class:`InputError`
    naming ``what``."""
    try:
        if isinstance(value, mx.array) and value.dtype == mx.bfloat16:
            value = value.astype(mx.float32)
        return np.asarray(value)
    except (ValueError, TypeError):
        raise InputError(
            f"{what} must be a rectangular array, got a {type(value).__name__} numpy cannot "
            "make one of (rows of different lengths?)"
        ) from None
    except RuntimeError as e:
        if not isinstance(value, mx.array) or "Stream" not in str(e):
            raise
        # MLX evaluates an array only on the thread that built it (its stream lives there).
        raise InputError(
            f"{what} is an MLX array built on another thread and not evaluated yet: call "
            "mx.eval() on it in that thread first, or pass a numpy array"
        ) from None


# A standard normal sample never comes near this; much larger start points overflow the
# flow head (float16 at 1e6) and would be reported as damaged weights.
MAX_NOISE = 1000.0


class NoiseSource:
    """Start noise of the flow-matching ODE, one row of 36 per frame.

    Either given explicitly (row i for frame i) or drawn from a per-request key:
    block b of 64 frames uses the b-th key of a split chain started at ``seed``, so the
    noise of a frame depends only on the seed and the frame index, never on global state.
    """

    def __init__(self, width: int, seed: int | None = None, noise: np.ndarray | None = None):
        self.width = width
        arr = self.checked(width, seed, noise)
        if arr is not None:
            self.seed = None
            self.limit: int | None = arr.shape[0]
            self._explicit = mx.array(arr)
        else:
            self.seed = secrets.randbits(63) if seed is None else int(seed)
            self.limit = None
            self._explicit = None
            self._key: mx.array | None = None  # made on first use, on the worker thread
            self._blocks: list[mx.array] = []

    @staticmethod
    def checked(width: int, seed: object, noise: object) -> np.ndarray | None:
        """``noise`` as float32 ``[frames, width]`` (None without it), or the one-line
        :class:`InputError` saying what is wrong with it or with ``seed``."""
        if noise is not None and seed is not None:
            raise InputError("seed and noise both set the start noise: pass one of them")
        if noise is None:
            check_seed(seed)
            return None
        arr = to_numpy(noise, "noise")
        if arr.ndim != 2 or arr.shape[1] != width or not np.issubdtype(arr.dtype, np.floating):
            raise InputError(
                f"noise must be a float array of shape [frames, {width}], got "
                f"{arr.dtype} {list(arr.shape)}: pass one row of start noise per frame, "
                "or a seed instead"
            )
        with np.errstate(over="ignore"):
            arr = arr.astype(np.float32)  # checked as used: 1e300 becomes inf here
        if not np.all(np.isfinite(arr)):
            raise InputError(
                "noise contains NaN or infinite values (as float32): pass finite start "
                "noise (standard normal), or a seed instead"
            )
        largest = float(np.max(np.abs(arr))) if arr.size else 0.0
        if largest > MAX_NOISE:
            raise InputError(
                f"noise holds {largest:.3g}: start noise is standard normal, "
                f"and values beyond +-{MAX_NOISE:g} overflow the flow head; pass noise within "
                "that, or a seed instead"
            )
        return arr

    def row(self, i: int) -> mx.array:
        """Noise of frame ``i`` as ``[1, width]`` float32."""
        if self._explicit is not None:
            return self._explicit[i : i + 1]
        b, r = divmod(i, NOISE_BLOCK)
        if self._key is None:
            self._key = mx.random.key(self.seed)
        while len(self._blocks) <= b:
            self._key, sub = mx.random.split(self._key)
            self._blocks.append(mx.random.normal((NOISE_BLOCK, self.width), key=sub))
        return self._blocks[b][r : r + 1]


@dataclass
class Sequence:
    """One utterance inside a :class:`FrameBatch`: its noise, limits and progress.

    ``cancel()`` may be called from any thread; the sequence leaves the batch at the next
    frame boundary.
    """

    noise: NoiseSource
    max_frames: int
    cfg_alpha: float
    frames: int = 0
    finished: bool = False
    stop_reason: str | None = None  # "end", "max_frames", "cancelled" or "not_finite"
    prompt_tokens: int = 0
    # Runs its max_frames whatever the semantic head says (warm-up: every batch size must
    # be reached even if the model says END at once).
    ignore_end: bool = False
    _cancel: threading.Event = field(default_factory=threading.Event, repr=False)
    _h: mx.array | None = field(default=None, repr=False)
    _cache: list[KVCache] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.noise.limit is not None:
            self.max_frames = min(self.max_frames, self.noise.limit)

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()


def prefill_part(model: VoxtralModel, text: mx.array, cache: list[KVCache]) -> None:
    """Run a leading part of the prompt's text into ``cache`` (a long prompt is prefilled
    in parts, so that it can be cancelled and running sequences keep getting frames)."""
    model(text, cache)
    mx.eval([c.state for c in cache])


def prefill(model: VoxtralModel, seq: Sequence, text: mx.array, cache: list[KVCache]) -> None:
    """Run the prompt's text part on top of ``cache`` (which holds the voice prefix).

    The hidden state of the last prompt position predicts the sequence's first frame
    directly (there is no extra ``[AUDIO]`` step).
    """
    h = model(text, cache)[:, -1]
    mx.eval(h)
    seq._h, seq._cache = h, cache
    seq.prompt_tokens = cache[0].offset


class FrameBatch:
    """Advances several sequences by one frame per step, as one batch.

    Each row keeps its own prompt length, positions (RoPE offsets), KV rows, noise and END.
    Sequences join between steps (after :func:`prefill`) and leave when they end, hit their
    frame limit or are cancelled, without disturbing the others.

    A step is split in two so the caller can choose what the device does first:
    :meth:`poll` waits for the semantic codes of the queued frame (the one host sync per
    frame) and returns the frames produced; :meth:`advance` queues the next frame for the
    sequences still running (and those that joined).

    A running sequence can be set aside (:meth:`set_aside`) to make room: at the next
    :meth:`advance` it leaves with its state (as after :func:`prefill`), to be :meth:`add`-ed
    again later; its output is the same as if it had never left.
    """

    def __init__(self, model: VoxtralModel):
        self.model = model
        self.rows: list[Sequence] = []
        self._joining: list[Sequence] = []
        self._cache: list[BatchKVCache] | None = None
        self._queued: tuple[mx.array, mx.array] | None = None
        self._polled = False
        self._continuing: list[int] = []
        self._aside: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        """Add a prefilled sequence; it produces its first frame at the next step."""
        if seq._h is None:
            raise ValueError("prefill() the sequence before adding it")
        if seq.max_frames <= 0:
            seq.finished, seq.stop_reason = True, "max_frames"
            seq._h = seq._cache = None  # its prompt's KV rows are not needed
            return
        self._joining.append(seq)

    def __len__(self) -> int:
        """Sequences in the batch from the next step on (set-aside ones not counted)."""
        return len(self.rows) + len(self._joining) - len(self._aside)

    def live(self) -> int:
        """Sequences that run at the next step: those joining, and the running ones that
        neither finished at this frame nor are set aside (``len()`` still counts the
        finished ones until :meth:`advance` lets them go)."""
        leaving = {id(s) for s in self._aside}
        running = sum(1 for s in self.rows if not s.finished and id(s) not in leaving)
        return running + len(self._joining)

    def running(self) -> list[Sequence]:
        """The rows that generate the next frame (not set aside)."""
        leaving = {id(s) for s in self._aside}
        return [s for s in self.rows if id(s) not in leaving]

    def set_aside(self, seq: Sequence) -> None:
        """Take running ``seq`` out at the next :meth:`advance`, keeping its state in it
        (``advance`` returns it); unless it finishes at this frame."""
        if not any(s is seq for s in self.rows) or any(s is seq for s in self._aside):
            raise ValueError("only a running sequence can be set aside, once")
        self._aside.append(seq)

    def _frame(self, h: mx.array, rows: list[Sequence]) -> tuple[mx.array, mx.array]:
        noise = mx.concatenate([s.noise.row(s.frames) for s in rows])
        cfg = cfg_weights([s.cfg_alpha for s in rows])
        out = self.model.frame(h, noise, cfg)
        mx.async_eval(*out)
        return out

    def advance(self) -> list[Sequence]:
        """Queue the next frame of every continuing and joining sequence (after :meth:`poll`).
        Returns the sequences set aside (still running, their state kept in them)."""
        h = None
        aside, self._aside = self._aside, []
        parked: list[Sequence] = []
        if self._queued is not None:
            if not self._polled:
                raise RuntimeError("FrameBatch.poll() must come before advance()")
            codes = self._queued[1]
            keep = self._continuing
            if len(keep) != len(self.rows):
                self.rows = [self.rows[i] for i in keep]
                if keep:
                    codes = codes[mx.array(keep)]
                    for c in self._cache:
                        c.filter(keep)
                else:
                    self._cache = None
            if self.rows:
                h = self.model.step(codes, self._cache)
                h, parked = self._park(h, aside)
            self._queued = None
        joining, self._joining = self._joining, []
        for seq in joining:
            if seq.cancelled:
                seq.finished, seq.stop_reason = True, "cancelled"
                seq._h = seq._cache = None
                continue
            single = [
                c if isinstance(c, BatchKVCache) else BatchKVCache.from_single(c)
                for c in seq._cache
            ]
            if self._cache is None:
                self._cache = single
            else:
                for mine, theirs in zip(self._cache, single):
                    mine.merge(theirs)
            h = seq._h if h is None else mx.concatenate([h, seq._h])
            seq._h = seq._cache = None
            self.rows.append(seq)
        if self.rows:
            self._queued = self._frame(h, self.rows)
            self._polled = False
        return parked

    def _park(self, h: mx.array, aside: list[Sequence]) -> tuple[mx.array, list[Sequence]]:
        """Move the ``aside`` sequences still running (not finished at this frame) out of the
        batch: each keeps its hidden state and KV rows."""
        if not aside:
            return h, []
        leaving = {id(s) for s in aside} & {id(s) for s in self.rows}
        if not leaving:
            return h, []
        rest = [i for i, s in enumerate(self.rows) if id(s) not in leaving]
        for i, seq in enumerate(self.rows):
            if id(seq) in leaving:
                seq._h = h[i : i + 1]
                seq._cache = [c.extract(i) for c in self._cache]
                mx.async_eval(seq._h, *[a for c in seq._cache for a in (c.keys, c.values)])
        self.rows = [self.rows[i] for i in rest]
        if rest:
            for c in self._cache:
                c.filter(rest)
            h = h[mx.array(rest)]
        else:
            self._cache, h = None, None
        return h, [s for s in aside if id(s) in leaving]

    def poll(self) -> list[tuple[Sequence, mx.array]]:
        """Wait for the queued frame's END check; return ``(sequence, codes [37])`` for every
        sequence that produced a frame. Finished sequences are marked and leave the batch
        at the next :meth:`advance`."""
        if self._queued is None:
            return []
        semantic, codes = self._queued
        sem = np.array(semantic)
        self._polled = True
        produced, self._continuing = [], []
        for i, seq in enumerate(self.rows):
            if seq.cancelled:
                seq.finished, seq.stop_reason = True, "cancelled"
                continue
            if sem[i] == END_AUDIO and not seq.ignore_end:
                seq.finished, seq.stop_reason = True, "end"
                continue
            if sem[i] == NOT_FINITE:
                seq.finished, seq.stop_reason = True, "not_finite"
                continue
            seq.frames += 1
            produced.append((seq, codes[i : i + 1].squeeze(0)))  # a view, not a gather
            if seq.frames >= seq.max_frames:
                seq.finished, seq.stop_reason = True, "max_frames"
            else:
                self._continuing.append(i)
        return produced
