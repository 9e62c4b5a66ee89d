"""How many frames a stream decodes at a time once its listener holds audio ahead.

The codec reads all its weights and launches its whole step once per decoded chunk, so
one-frame chunks (what first audio needs) cost the most per frame: on a Mac the codec is
~3-9 % of what a frame reads (``benchmarks/weights_per_frame.py``), here on the CPU
~1.5 ms of a tiny frame's ~7 ms. Once the listener (a player, an HTTP client) holds audio
ahead of what it is playing, chunks can grow without a gap: a chunk of ``n`` frames
arrives ``n`` frame times after the previous one, which that audio covers with a margin.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

# The sizes asked for. A chunk may hold fewer frames (a segment's end; what is pending when
# the size shrinks): each length is compiled once, a few ms on first use.
LIVE_CHUNK_FRAMES = (1, 2, 4, 8)
# The buffer must hold this many times a chunk's arrival time: chunks arrive in bursts
# and generation speed varies (another stream joins the batch, a long prefill).
MARGIN = 3.0


def live_chunk_frames(buffered_s: float, speed: float | None, started: bool, frame_s: float) -> int:
    """Frames per chunk for the next chunk of a stream a player is fed with.

    ``buffered_s``: audio queued in the player and not yet played; ``speed``: audio
    seconds generated per wall second (None: not measured yet); ``started``: whether the
    player is playing (before that, chunks of one frame reach its pre-roll soonest);
    ``frame_s``: audio seconds per frame.
    """
    if not started or speed is None or not speed > 0:
        return 1
    return frames_covered(buffered_s, frame_s / speed)


def frames_covered(ahead_s: float, wall_per_frame: float) -> int:
    """The largest chunk size whose arrival (``wall_per_frame`` seconds per frame) the
    listener's ``ahead_s`` seconds of audio cover ``MARGIN`` times over (1 at least)."""
    if not math.isfinite(ahead_s) or not wall_per_frame >= 0:
        return 1
    best = 1
    for n in LIVE_CHUNK_FRAMES:
        if MARGIN * (n + 1) * wall_per_frame <= ahead_s:
            best = n
    return best


class ClientBuffer:
    """What a client playing a streamed response holds at least, for a sender with no view
    of it (the HTTP server): the audio sent since the first chunk, less the time since then,
    as if playback had started at the first chunk and ran at real time (later or slower
    playback holds more). ``rate``: seconds of the client's audio per second of the model's
    (1 / the response's speed)."""

    def __init__(self, rate: float = 1.0, clock: Callable[[], float] = time.monotonic):
        self.rate, self._clock = rate, clock
        self._first_at: float | None = None
        self._sent_s = 0.0  # the model's audio seconds sent, pauses included
        self._frames = 0  # frames generated after the first chunk
        self._segment_pace = _SegmentPace()

    def sent(self, audio_s: float, frames: int, chunk: Any = None) -> int:
        """A chunk of ``audio_s`` seconds (``frames`` generated; ``chunk``: the
        :class:`~voxtral_mlx.engine.AudioChunk`, whose segment's own pace counts too) was
        sent: the chunk size to ask for next."""
        now = self._clock()
        self._sent_s += audio_s
        pace = self._segment_pace.update(chunk)
        if self._first_at is None:
            if audio_s > 0:
                self._first_at = now
            return 1
        self._frames += frames
        elapsed = now - self._first_at
        if self._frames == 0 or elapsed <= 0:
            return 1
        wall_per_frame = max(elapsed / self._frames, pace)
        return frames_covered(self._sent_s * self.rate - elapsed, wall_per_frame)


class _SegmentPace:
    """Wall seconds per frame of the segment being heard, as its job measured them (from
    joining the batch to its latest chunk). Audio arriving per wall second overstates it
    when segments generated beside it arrive in bursts: their frames came at the same
    pace, not one after another."""

    def __init__(self) -> None:
        self.wall_per_frame = 0.0

    def update(self, chunk: Any) -> float:
        timings = getattr(chunk, "timings", None)
        if getattr(chunk, "frames", 0) and timings is not None:
            ms = getattr(timings, "ms_per_frame", 0.0)
            if isinstance(ms, (int, float)) and math.isfinite(ms) and ms > 0:
                self.wall_per_frame = ms / 1000.0
        return self.wall_per_frame


class PlayerPace:
    """Sizes a stream's chunks (``set_chunk_frames``) by what an
    :class:`~voxtral_mlx.audio.player.AudioPlayer` holds ahead, after each chunk it is fed
    (:meth:`fed`). A player that does not say (a stand-in with ``feed`` alone) leaves
    chunks of one frame."""

    def __init__(self, stream: Any, player: Any, frame_s: float):
        self.stream, self.player, self.frame_s = stream, player, frame_s
        self._segment_pace = _SegmentPace()

    def fed(self, chunk: Any) -> None:
        speed = getattr(self.player, "generation_speed", None)
        pace = self._segment_pace.update(chunk)
        if not callable(speed) or not hasattr(self.player, "buffered_s"):
            return
        started = bool(getattr(self.player, "started", False))
        frames = live_chunk_frames(self.player.buffered_s, speed(), started, self.frame_s)
        if frames > 1 and pace > 0:
            frames = min(frames, frames_covered(self.player.buffered_s, pace))
        self.stream.set_chunk_frames(frames)
