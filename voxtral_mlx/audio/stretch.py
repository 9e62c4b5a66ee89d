"""Pitch-preserving time stretch (WSOLA): speech played faster or slower, as ``speak
--speed``, ``say(speed=...)`` and the ``speed`` field of ``/v1/audio/speech`` ask.

Waveform-similarity overlap-add: output frames of 40 ms (Hann windows, 50 % overlap) are
read from the input ``speed`` times one output hop apart, each shifted by up to 10 ms so
that it continues the waveform of the previous frame as closely as possible (normalised
cross-correlation). Copying whole stretches of waveform keeps the pitch; aligning them
avoids phase jumps. It works incrementally, with a latency of about two frames: audio fed
in any chunking gives exactly the output of feeding it at once.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from typing import Any

import numpy as np

from ..errors import InputError
from ..fileio import one_line

MIN_SPEED = 0.25
MAX_SPEED = 4.0


def check_speed(speed: object) -> float:
    """``speed`` as a float, or an InputError naming the range."""
    value = math.nan
    if isinstance(speed, numbers.Real) and not isinstance(speed, bool):
        with contextlib.suppress(OverflowError):  # an int past float's range
            value = float(speed)
    if not MIN_SPEED <= value <= MAX_SPEED:
        raise InputError(
            f"speed must be a number from {MIN_SPEED} to {MAX_SPEED} (1: as generated; 2: "
            f"twice as fast), got {one_line(repr(speed), 60)}"
        )
    return value


class TimeStretcher:
    """``process(chunk)`` returns the output that is final so far; ``flush()`` the rest.

    The output of ``n`` input samples has ``round(n / speed)`` samples, or up to a frame
    hop more when a short input at a high speed has already played out further.
    """

    def __init__(
        self,
        speed: float,
        sample_rate: int,
        frame_s: float = 0.040,
        tolerance_s: float = 0.010,
    ) -> None:
        if not MIN_SPEED <= speed <= MAX_SPEED:
            raise ValueError(f"speed must lie in [{MIN_SPEED}, {MAX_SPEED}], got {speed}")
        self.speed = float(speed)
        self._n = n = 2 * max(2, round(frame_s * sample_rate / 2))
        self._hs = n // 2
        self._tol = max(1, round(tolerance_s * sample_rate))
        self._win = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n) / n)  # sums to 1 at 50 %
        self._first = np.concatenate([np.ones(self._hs), self._win[self._hs :]])
        self._x = np.zeros(0)  # input not yet consumed, starting at absolute sample _x0
        self._x0 = 0
        self._fed = 0
        self._acc = np.zeros(0)  # overlap-add sums and window sums from output sample _out0
        self._wacc = np.zeros(0)
        self._out0 = 0
        self._k = 0  # next output frame
        self._prev: int | None = None  # input position of the previous frame
        self._flushed = False

    def _nominal(self, k: int) -> int:
        return round(k * self._hs * self.speed)

    def _needs(self, k: int) -> int:
        """Input samples frame ``k`` reads (its search region and its template)."""
        end = self._nominal(k) + self._tol + self._n
        if self._prev is not None:
            end = max(end, self._prev + self._hs + self._n)
        return end

    def _input(self, start: int, end: int) -> np.ndarray:
        """Input samples [start, end) (absolute), zeros past the end of what was fed."""
        i, j = start - self._x0, end - self._x0
        part = self._x[i:j]
        return part if len(part) == j - i else np.pad(part, (0, j - i - len(part)))

    def _frame(self) -> None:
        n, k = self._n, self._k
        a = self._nominal(k)
        if self._prev is None:
            p = a
        else:
            # At the end of the input (only in flush(): before it a frame waits for its
            # whole region) the search moves back so frames repeat the last stretch of
            # input instead of fading into the zeros past it.
            hi = max(0, min(a + self._tol, self._fed - n))
            lo = max(0, min(a - self._tol, hi))
            region = self._input(lo, hi + n)
            template = self._input(self._prev + self._hs, self._prev + self._hs + n)
            corr = np.correlate(region, template, "valid")
            energy = np.cumsum(np.concatenate([[0.0], region * region]))
            score = corr / np.sqrt(np.maximum(energy[n:] - energy[:-n], 1e-12))
            best = int(np.argmax(score))
            nominal = min(a, hi) - lo
            if score[best] <= score[nominal]:  # ties (silence) keep the nominal position
                best = nominal
            p = lo + best
        o = k * self._hs - self._out0
        if len(self._acc) < o + n:  # grown geometrically: one-shot use stays linear
            size = max(o + n, 2 * len(self._acc))
            self._acc = np.concatenate([self._acc, np.zeros(size - len(self._acc))])
            self._wacc = np.concatenate([self._wacc, np.zeros(size - len(self._wacc))])
        # The first frame has a flat first half: the output starts exactly as the input.
        win = self._first if k == 0 else self._win
        self._acc[o : o + n] += self._input(p, p + n) * win
        self._wacc[o : o + n] += win
        self._prev, self._k = p, k + 1

    def _emit(self, end: int) -> np.ndarray:
        """Output samples [_out0, end), normalised by the window sum."""
        m = end - self._out0
        acc, w = self._acc[:m], self._wacc[:m]
        out = np.divide(acc, w, out=np.zeros(m), where=w > 0)
        self._acc, self._wacc, self._out0 = self._acc[m:].copy(), self._wacc[m:].copy(), end
        return out.astype(np.float32)

    def process(self, audio: np.ndarray) -> np.ndarray:
        if self._flushed:
            raise RuntimeError("process() after flush()")
        x = np.asarray(audio, np.float64).reshape(-1)
        self._x = np.concatenate([self._x, x])
        self._fed += len(x)
        while self._needs(self._k) <= self._fed:
            self._frame()
        keep = max(0, self._nominal(self._k) - self._tol)
        if self._prev is not None:
            keep = min(keep, self._prev + self._hs)
        if keep > self._x0:
            self._x, self._x0 = self._x[keep - self._x0 :], keep
        # Frame k starts at output sample k * hs: everything before it is final.
        return self._emit(self._k * self._hs)

    def flush(self) -> np.ndarray:
        """The rest of the output (the input ended)."""
        if self._flushed:
            return np.zeros(0, np.float32)
        self._flushed = True
        total = round(self._fed / self.speed)
        while self._k * self._hs < total:
            self._frame()
        return self._emit(max(total, self._out0))


def time_stretch(audio: np.ndarray, speed: float, sample_rate: int) -> np.ndarray:
    """``audio`` played ``speed`` times faster at the same pitch (``speed=1``: unchanged)."""
    if speed == 1.0:
        return np.asarray(audio, np.float32)
    stretcher = TimeStretcher(speed, sample_rate)
    return np.concatenate([stretcher.process(audio), stretcher.flush()])


class SegmentStretcher:
    """A text stream's chunks played ``speed`` times faster: ``stretcher(chunk)`` returns
    the audio to play for ``chunk`` (an :class:`~voxtral_mlx.engine.AudioChunk`).

    Each segment (with the pause before it) is stretched on its own and flushed at its
    end, so nothing of a segment waits for the next one's audio (text still being written
    may have none yet); the cut falls in the silence between them. At speed 1 the audio
    passes through as it is (``position`` still counts it).
    """

    def __init__(self, speed: float, sample_rate: int) -> None:
        self.speed = check_speed(speed)
        self.sample_rate = sample_rate
        self._stretcher = TimeStretcher(self.speed, sample_rate)
        self._returned = 0  # samples returned so far
        self._unit_start = 0  # ... when the current segment's stretch began
        self._unit_in = 0  # samples given to the current segment's stretch

    @property
    def position(self) -> int:
        """Where the audio of the next chunk given starts among the samples returned (as
        played: the stretch holds back up to a few tens of ms meanwhile)."""
        return self._unit_start + round(self._unit_in / self.speed)

    def __call__(self, chunk: Any) -> np.ndarray:
        audio = np.asarray(chunk.audio, np.float32).reshape(-1)
        self._unit_in += len(audio)
        if self.speed == 1.0:
            self._returned += len(audio)
            return audio
        parts = [self._stretcher.process(audio)] if len(audio) else []
        if chunk.ends_segment or chunk.is_final:
            parts.append(self._stretcher.flush())
            self._stretcher = TimeStretcher(self.speed, self.sample_rate)
            self._unit_in = 0
            self._unit_start = self._returned + sum(len(p) for p in parts)
        out = np.concatenate(parts) if parts else np.zeros(0, np.float32)
        self._returned += len(out)
        return out
