"""Speech playing in the background, as ``VoxtralTTS.say(wait=False)`` returns it: a thread
feeding a text stream's audio to a player, with ``stop()`` and ``wait()``."""

from __future__ import annotations

import bisect
import contextlib
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

from .audio.chunking import PlayerPace
from .audio.horizon import plays
from .audio.player import AudioPlayer
from .audio.stretch import SegmentStretcher
from .engine import finite_float
from .errors import InputError, UsageError
from .fileio import one_line
from .segment import Segment
from .textstream import TextStream

_JOIN_SLICE_S = 0.1


class Playback:
    """Speech playing in the background: ``stop()`` silences it within 200 ms, ``wait()``
    blocks until the last sample has played (re-raising any error), ``pause()`` and
    ``resume()`` hold it and play on, ``segment`` and ``played_s`` say where it is."""

    def __init__(
        self,
        stream: TextStream,
        player: Any,
        horizon: Callable[[], Callable] | None = None,
        refuse_wait: Callable[[], None] = lambda: None,
        frame_s: float = 0.08,
        speed: float = 1.0,
    ) -> None:
        self.stream = stream
        self.player = player
        self.speed = speed  # played this many times faster (at the same pitch)
        self._horizon = horizon  # makes the per-chunk expected_total_s (for AudioPlayer)
        self._frame_s = frame_s  # audio seconds per frame, to size chunks (for AudioPlayer)
        self._refuse_wait = refuse_wait  # raises on the model's worker thread
        self.error: BaseException | None = None  # raised before stop(), if any
        self._error_tb: TracebackType | None = None
        self._stopped = False
        # Where each segment's audio starts among the samples fed, in order: (sample, index).
        self._starts: list[tuple[int, int]] = []
        self._thread = threading.Thread(target=self._run, name="voxtral-mlx-say", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._play()
        finally:
            if self._stopped and isinstance(self.player, AudioPlayer):
                # wait() returns once the device is released, not while stop()'s close runs
                with contextlib.suppress(Exception):
                    self.player.stop()

    def _play(self) -> None:
        try:
            self.stream.prepare()
            if self._stopped:  # while the text was being split
                return
            # Made here, not in say(): it tokenizes every segment (a chapter's worth).
            horizon = self._horizon() if self._horizon is not None else None
            # The player's seconds are the stretched ones: a frame plays 1 / speed as long.
            pace = PlayerPace(self.stream, self.player, self._frame_s / self.speed)
            stretch = SegmentStretcher(self.speed, self.stream.sample_rate)
            for chunk in self.stream:
                if self._stopped:
                    break
                if chunk.frames and (not self._starts or self._starts[-1][1] != chunk.segment):
                    self._starts.append((stretch.position, chunk.segment))
                audio = stretch(chunk)
                if horizon is None:
                    if len(audio):
                        self.player.feed(audio)
                elif plays(chunk):
                    total = horizon(chunk) / self.speed
                    self.player.feed(audio, expected_total_s=total, more_coming=horizon.more_coming)
                    pace.fed(chunk)
            if not self._stopped:  # a stopped player has nothing left to play out
                self.player.finish()
        except BaseException as e:  # handed to wait()
            if not self._stopped:  # what stop() itself causes is not an error
                self.error, self._error_tb = e, e.__traceback__
            self.stream.cancel()  # e.g. the device went away: stop generating too
            with contextlib.suppress(Exception):  # the first error is the one to report
                if e is self.stream.text_error and not self._stopped:
                    self.player.finish()  # live text failed: what came before it is heard
                else:
                    self.player.stop()

    @property
    def done(self) -> bool:
        """Whether playback has ended: played out, stopped or failed."""
        return not self._thread.is_alive()

    def stop(self) -> None:
        """Silence it within 200 ms and stop generating; from any thread, any number of
        times, returning at once (the audio device is closed in the background: a UI
        thread does not wait for it). :meth:`wait` then returns once the device is
        released, raising only an error that came before the stop."""
        self._stopped = True
        self.stream.cancel()
        if isinstance(self.player, AudioPlayer):
            self.player.stop(wait=False)
        else:  # an app's own player
            self.player.stop()

    def pause(self) -> None:
        """Hold the speech where it is until :meth:`resume` (from any thread; it falls
        silent within the device's latency, a few ms to ~100 ms). Generation goes on until a
        minute of audio waits, then waits too; :meth:`wait` returns only once the speech
        has played out after a resume, or was stopped. Needs a player with ``pause()`` and
        ``resume()``, as the speakers' has."""
        self._player_method("pause")()

    def resume(self) -> None:
        """Play on from where :meth:`pause` held the speech (from any thread)."""
        self._player_method("resume")()

    @property
    def paused(self) -> bool:
        """Whether :meth:`pause` holds the speech (False for a player that cannot pause)."""
        return bool(getattr(self.player, "paused", False))

    def _player_method(self, name: str) -> Callable[[], None]:
        method = getattr(self.player, name, None)
        if not callable(method):
            raise UsageError(
                f"this playback's player (a {type(self.player).__name__}) has no {name}(): "
                "give say() a player with pause() and resume(), or stop() it"
            )
        return method

    @property
    def played_s(self) -> float | None:
        """Seconds of the speech (pauses between segments included; at say()'s ``speed``)
        handed to the audio device so far, heard within its latency; None for a player that
        does not count them (one without ``played_samples``)."""
        samples = self._played_samples()
        return None if samples is None else samples / self.stream.sample_rate

    @property
    def segment(self) -> Segment | None:
        """The segment of the text being heard (``text``, and ``start``/``end`` in the text
        given to say(); for live text, in all the text read so far), or during the pause
        after it; None before the first sound, and for a player that does not count what
        it played (see :attr:`played_s`). Poll it to follow the text as it is read."""
        samples = self._played_samples()
        starts = self._starts
        if not samples or not starts or samples <= starts[0][0]:
            return None
        i = bisect.bisect_left(starts, (samples, -1)) - 1
        return self.stream.segments[starts[i][1]]

    def _played_samples(self) -> int | None:
        samples = getattr(self.player, "played_samples", None)
        return samples if isinstance(samples, int) else None

    def end(self, error: BaseException) -> None:
        """Stop, with ``error`` for :meth:`wait` to raise (the model was closed), unless
        playback had already ended or failed."""
        if self.done or self._stopped:
            return
        if self.error is None:
            self.error, self._error_tb = error, None
        self.stop()

    def wait(self, timeout: float | None = None) -> bool:
        """True once playback has ended (False on timeout). Ctrl-C stops playback."""
        if timeout is not None:
            seconds = finite_float(timeout)
            if seconds is None or seconds < 0:
                raise InputError(
                    f"timeout must be a number of seconds >= 0 or None, got "
                    f"{one_line(repr(timeout), 60)}"
                )
            timeout = seconds
        if not self.done:
            self._refuse_wait()
            if threading.current_thread() is self._thread and timeout != 0:  # 0: a poll
                raise UsageError(
                    "wait() was called from this playback's own thread (its player's "
                    "feed() or finish()): it would wait for itself; call it from elsewhere"
                )
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            # In slices: an interrupt raised without a signal (``_thread.interrupt_main()``,
            # as IDLE and other hosts stop code) lands only between them.
            while self._thread.is_alive():
                left = _JOIN_SLICE_S if deadline is None else deadline - time.monotonic()
                if left <= 0:
                    break
                self._thread.join(min(left, _JOIN_SLICE_S))
        except KeyboardInterrupt:
            self.stop()
            raise
        if self.error is not None:
            # As it was first raised: re-raising the same object would grow its traceback.
            raise self.error.with_traceback(self._error_tb)
        return self.done
