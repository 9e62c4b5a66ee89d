"""Text of any length as one stream of audio: segments in order, batched, with pauses.

Segments are submitted ahead of the one being consumed (``lookahead`` in flight, that one
included), so the engine batches them, while memory stays bounded by the look-ahead however
long the text is. The same logic serves blocking iteration and ``async for``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterable, Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from .engine import DONE, AudioChunk, ConsumerGone, Job, Timings, check_whole, finite_float
from .errors import InputError, UsageError
from .fileio import one_line
from .livetext import END, LiveText
from .segment import EMPTY_TEXT, Segment, SplitStopped, is_blank
from .worker import get_in_slices

if TYPE_CHECKING:  # imported where used: a process that never awaits skips its import time
    import asyncio

MAX_PAUSE_S = 60.0


class _Reader:
    def __init__(
        self,
        make_job: Callable[[int, Segment], Job],
        segments: list[Segment] | Callable[[Callable[[], bool]], list[Segment]] | LiveText,
        sample_rate: int,
        lookahead: int,
        pause: float | None,
        refuse_wait: Callable[[], None] = lambda: None,
    ):
        self._make_job = make_job
        self._refuse_wait = refuse_wait  # raises on the model's worker thread
        self.segments: list[Segment] = []
        self.sample_rate = sample_rate
        self.lookahead = lookahead  # at least 1 (checked by VoxtralTTS)
        self.pause = pause
        self.jobs: deque[tuple[int, Job]] = deque()
        self._next = 0
        self._cancelled = False
        self._finished = False
        self._codes_width = 0  # codes per frame, as the segments' own chunks have them
        self._t0 = time.perf_counter()  # from the first read on: see _reading_starts()
        self._read_yet = False
        self.timings = Timings()  # the whole text's figures
        # Text still arriving: ``segments`` grows as its segments are cut; a segment's pause
        # is played before the next one's audio, as there may be none.
        self._live = segments if isinstance(segments, LiveText) else None
        self._source = self._live  # kept after its end, to close it on cancel()
        self._final_sent = False
        self._source_error: BaseException | None = None  # the text's, due after its audio
        self.text_error: BaseException | None = None  # raised: reading the live text failed
        self._waited = 0.0  # seconds waiting for live text with nothing to generate
        self._stopped_by: str | None = None  # the error that stopped it, if one did
        self._ready: deque[AudioChunk] = deque()
        self._pause_due: tuple[int, float] | None = None  # (segment, seconds) to play next
        self._pauses: list[float | None] = []  # of a text split up front: planned_pauses()
        check_pause(pause)
        self._unsubmitted: list[Job] = []
        self._chunk_frames: int | None = None  # set_chunk_frames(): for jobs made later
        # A callable splits the text later, at the first item or prepare(): ``segments`` is
        # empty until then. It is given a function saying whether the stream was stopped
        # meanwhile (a book takes a second to split).
        self._plan = segments if callable(segments) and self._live is None else None
        if self._live is None and self._plan is None:
            self._start(segments)

    def prepare(self) -> None:
        """Split the text now if that was left for later (on the calling thread; a failure
        is the caller's to handle, as iteration's and Playback's handlers do)."""
        if self._plan is not None:
            try:
                segments = self._plan(lambda: self._finished)
            except SplitStopped:
                self._plan = None
                return
            self._start(segments)

    def _start(self, segments: list[Segment]) -> None:
        """Take the text's segments and make the first jobs (validating their requests), so
        that bad input raises when the stream is created, not at its first item."""
        self._plan = None
        self.segments = segments
        self._pauses = planned_pauses(segments, self.pause)
        if not segments:
            self._finished = True
        self._unsubmitted = self._pending()

    def _pending(self) -> list[Job]:
        """Jobs to submit now, keeping ``lookahead`` segments in flight."""
        new, self._unsubmitted = self._unsubmitted, []
        while not self._finished and len(self.jobs) < self.lookahead:
            if self._next == len(self.segments) and not self._take(block=False):
                break
            i = self._next
            self._next += 1
            job = self._make_job(i, self.segments[i])
            job.ahead = bool(self.jobs)  # the consumer waits for the first job in flight only
            # Listed before the size is read: a set_chunk_frames() from another thread in
            # between then sets it in the job, or is read here.
            self.jobs.append((i, job))
            if self._chunk_frames is not None and job.ahead:
                # One the consumer already waits for (live text that stalled) keeps its own
                # size: whatever was buffered ahead may have played out meanwhile.
                job.later_chunk_frames = self._chunk_frames
            if self._finished:  # cancel() ran while the job was being made: it missed it
                job.cancel()
            new.append(job)
        return new

    @property
    def live(self) -> bool:
        """Whether the text is still arriving (``segments`` grows as it is cut)."""
        return self._live is not None

    def _take(self, block: bool, idle: bool = False) -> bool:
        """Append the live text's next segment to ``segments``: False if there is none yet
        (``block``: until there is one, the text ends or the stream stops). ``block`` or
        ``idle`` (no segment in flight) raise the text's error; else it waits for them."""
        if self._live is None or self._finished:
            return False
        if self._source_error is not None and not (block or idle):
            return False  # (raised once, when delivered: each raise lengthens its traceback)
        if block:
            self._refuse_wait()  # the worker would wait for text instead of generating
        t0 = time.perf_counter()
        try:
            if self._source_error is not None:
                raise self._source_error
            seg = self._live.take(block, stop=lambda: self._finished)
        except BaseException as e:
            if not (block or idle):  # raised once the segments in flight have been heard
                self._source_error = e
                return False
            self._source_error = None  # the traceback holds frames: not kept
            # The audio before it is whole: a player may play it out, a file keep it.
            self.text_error = e
            self._abandon(e)
            raise
        finally:
            if block:  # time spent waiting for text is no generation time (timings)
                self._waited += time.perf_counter() - t0
        if seg is None:
            return False
        if seg is END:
            if all(is_blank(s.text) for s in self.segments):  # nothing but zero-width marks
                self._abandon()
                raise InputError(EMPTY_TEXT)
            self._live = None
            if not self.jobs:
                self._finished = True
                self._ready.append(self._final_chunk())
            return False
        self.segments.append(seg)
        return True

    def _final_chunk(self) -> AudioChunk:
        """Live text ended after its last segment's audio: an empty last chunk says so."""
        chunk = self._pause(len(self.segments) - 1, 0.0)
        chunk.is_final = self._final_sent = True
        return chunk

    def _on_item(self, item) -> list[AudioChunk]:
        """What the consumer sees for one item of the head job."""
        i = self.jobs[0][0]
        last = self._live is None and i == len(self.segments) - 1
        if self._cancelled:  # what was still on its way after cancel() is not handed out
            self._finished = True
            return []
        if isinstance(item, BaseException):
            self._abandon(item)
            raise item
        if item is DONE:
            self.jobs.popleft()
            if self.jobs:  # now the consumer waits for it: it keeps its batch slot
                self.jobs[0][1].needed()
            if last or self._finished:  # no pause after the end or after cancel()
                self._finished = True
                if last and self._source is not None and not self._final_sent:
                    return [self._final_chunk()]
                return []
            if self._source is not None:  # before the next segment's audio, if any
                seconds = self._own_pause(i)
                if is_blank(self.segments[i].text):  # it lengthens the pause it falls in
                    if self._pause_due is not None:
                        j, due = self._pause_due
                        self._pause_due = (j, max(due, seconds))
                    return []
                self._pause_due = (i, seconds)
                return []
            seconds = self._pauses[i]
            return [] if seconds is None else [self._pause(i, seconds)]
        t, c = self.timings, item.timings
        if not t.prompt_tokens and c.prompt_tokens:  # the first prefill: a pause may have none
            t.prompt_tokens, t.queued_s, t.prefill_s = c.prompt_tokens, c.queued_s, c.prefill_s
            t.prefix_cached, t.prefix_from_disk = c.prefix_cached, c.prefix_from_disk
        if not t.first_audio_s and len(item.audio):
            t.first_audio_s = self._elapsed()
        t.frames += item.frames  # as they come: a cancelled segment sends no final chunk
        if item.is_final:
            t.cut_short += c.cut_short
        t.peak_memory_bytes = max(t.peak_memory_bytes, c.peak_memory_bytes)
        out = []
        if self._pause_due is not None and not is_blank(self.segments[i].text):
            j, seconds = self._pause_due
            if self.pause is None and self._source is not None:
                # A blank line completed after its cut (of segment j or a blank one after it).
                for k in range(j, i):
                    later = self._source.pause_after(k)
                    if later is not None:
                        seconds = later if k == j else max(seconds, later)
                        self.segments[k] = dataclasses.replace(self.segments[k], pause_after=later)
            out.append(self._pause(i - 1, seconds))  # after blank segments, if any
            self._pause_due = None
        self._add_audio(item.audio)
        self._codes_width = item.codes.shape[-1]  # every segment ends with a chunk
        item.segment, item.segments = i, len(self.segments)
        item.is_final = item.is_final and last
        self._final_sent = item.is_final
        out.append(item)
        return out

    def _own_pause(self, i: int) -> float:
        return _pause_of(self.segments[i], self.pause)

    def _pause(self, i: int, seconds: float) -> AudioChunk:
        codes = np.zeros((0, self._codes_width), np.int32)
        silence = np.zeros(round(seconds * self.sample_rate), np.float32)
        self.timings.pause_s += len(silence) / self.sample_rate
        return self._chunk(silence, i, 0, codes)

    @property
    def ahead_s(self) -> float:
        """Seconds of audio already generated for the segments after the one being read:
        they arrive at once when it ends (a player's pre-roll may count on them)."""
        return sum(job.timings.audio_s for _, job in list(self.jobs)[1:])

    def _add_audio(self, audio: np.ndarray) -> None:
        self.timings.audio_s += len(audio) / self.sample_rate
        self.timings.total_s = self._elapsed()

    def _reading_starts(self) -> None:
        """The whole text's figures count from its first read: a stream made and read
        later, as an app may, was not generating meanwhile (its first segments are handed
        to the model at that read)."""
        if not self._read_yet:
            self._read_yet = True
            self._t0, self._waited = time.perf_counter(), 0.0

    def _elapsed(self) -> float:
        """Seconds since the first read, less those spent waiting for live text."""
        return time.perf_counter() - self._t0 - self._waited

    def _chunk(self, audio, i, frames, codes) -> AudioChunk:
        self._add_audio(audio)
        chunk = AudioChunk(audio, self.sample_rate, 0, frames, False, codes, self.timings, None)
        chunk.segment, chunk.segments = i, len(self.segments)
        return chunk

    def set_chunk_frames(self, frames: int) -> None:
        """Decode ``frames`` frames per chunk from now on (any thread; frames already
        generated go out at the next chunk), in the segments in flight and those submitted
        ahead of the one being read. A segment's first chunk keeps the stream's own
        ``chunk_frames``, as does a segment submitted when nothing is in flight (the text
        came late), and a segment generated ahead sends what it holds at once when the
        reader reaches it. Larger chunks cost less per frame, smaller ones arrive sooner:
        a player that holds audio ahead can take larger ones (see
        :func:`~voxtral_mlx.audio.chunking.live_chunk_frames`)."""
        frames = check_whole("frames", frames, 1)
        self._chunk_frames = frames
        for _, job in list(self.jobs):  # a snapshot: the consumer may be changing it
            job.later_chunk_frames = frames

    def _end(self) -> Exception:
        """What reading past the end raises: the end, or, after an error stopped the stream
        (and no cancel() since), that error's news: ending quietly would pass its cut-off
        audio for the whole text's."""
        if self._stopped_by is None or self._cancelled:
            return StopAsyncIteration() if isinstance(self, AsyncTextStream) else StopIteration()
        return UsageError(
            f"this audio stream stopped on an error ({self._stopped_by}), so its audio is cut "
            "short: start a new stream"
        )

    def cancel(self) -> None:
        """Stop generating (any thread); already queued segments are cancelled too."""
        self._cancelled = True
        self._abandon()

    def _abandon(self, error: BaseException | None = None) -> None:
        """Stop the jobs after an error; unlike cancel(), nobody asked the stream to stop
        (``_cancelled`` stays False, so say()'s wait() still reports the error)."""
        if error is not None and self._stopped_by is None:
            self._stopped_by = type(error).__name__
        self._finished = True
        if self._source is not None:  # its producer stops too
            self._source.close()
        # A snapshot: the consumer's thread may be adding or removing jobs meanwhile.
        for _, job in list(self.jobs):
            job.cancel()


def _pause_of(segment: Segment, pause: float | None) -> float:
    """A segment's own pause after it: its boundary's, or ``pause`` for every one."""
    return segment.pause_after if pause is None else pause


def planned_pauses(segments: Sequence[Segment], pause: float | None) -> list[float | None]:
    """Seconds of silence after each segment of a text split up front (``pause`` for every
    boundary, if given), None for none. A blank segment (zero-width marks alone) has none
    of its own: the pause it falls in takes the longest of the run, and none comes before
    the text's first words or after its last (a stray mark at either end would add a
    paragraph's silence)."""
    out: list[float | None] = [None] * len(segments)
    spoken_after, run = False, 0.0
    for i in reversed(range(len(segments))):
        own = _pause_of(segments[i], pause)
        if is_blank(segments[i].text):
            run = max(run, own)
            continue
        if spoken_after:
            out[i] = max(own, run)
        spoken_after, run = True, 0.0
    return out


def check_pause(pause: object) -> None:
    """Raise InputError unless ``pause`` is None or a number of seconds a pause may last."""
    seconds = None if pause is None else finite_float(pause)
    if pause is not None and (seconds is None or not 0 <= seconds <= MAX_PAUSE_S):
        raise InputError(
            f"pause must be a number of seconds from 0 to {MAX_PAUSE_S:g}, got "
            f"{one_line(repr(pause), 60)}"
        )


_ONE_READER = (
    "this audio stream is already being read (by another thread or task): read each stream "
    "in one loop; for another listener, start another stream"
)


class TextStream(_Reader):
    """Blocking iterator of :class:`AudioChunk`; ``cancel()`` or ``close()`` stops it. One
    reader at a time: a second thread asking while the first waits gets a ``UsageError``."""

    def __init__(self, submit: Callable[[list[Job]], object], *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._submit = submit
        self._reading = threading.Lock()

    def __iter__(self) -> TextStream:
        return self

    def __next__(self) -> AudioChunk:
        # Two readers would wait on one queue: the one not given its end would wait forever.
        if not self._reading.acquire(blocking=False):
            raise UsageError(_ONE_READER)
        try:
            return self._next_chunk()
        finally:
            self._reading.release()

    def _next_chunk(self) -> AudioChunk:
        if not self._ready and not self._finished:
            # Refused before anything changes: the stream stays readable from another thread.
            self._refuse_wait()
        self._reading_starts()
        try:
            while not self._ready:
                if self._finished:
                    raise self._end()
                self._refuse_wait()  # what comes next needs the worker, or waits for text
                self.prepare()
                pending = self._pending()
                if pending:  # one hand-over for all: the first segment is not held back
                    self._submit(pending)
                if self._finished:  # cancel() from another thread meanwhile
                    continue
                if not self.jobs:  # live text: nothing in flight until more of it comes
                    self._take(block=True)
                    continue
                _, job = self.jobs[0]
                self._ready.extend(self._on_item(get_in_slices(job.output)))
        except StopIteration:
            raise
        except BaseException as e:
            # Ctrl-C while waiting, a failed segment: the segments generating ahead must
            # not keep the model busy for an abandoned stream.
            self._abandon(e)
            raise
        return self._ready.popleft()

    def close(self) -> None:
        """Stop generation (as :meth:`cancel`); the ``with`` block's end does the same."""
        self.cancel()

    def __enter__(self) -> TextStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Leaving a ``with`` block stops generation, however the loop inside ended."""
        self.close()

    def __aiter__(self):
        raise UsageError(
            "this is stream()'s stream, read with `for` or `with`: for `async for`, make it "
            "with astream()"
        )

    def __del__(self) -> None:
        if hasattr(self, "_source"):  # an __init__ cut short (Ctrl-C) started nothing
            self.cancel()


def _to_loop(
    loop: asyncio.AbstractEventLoop,
    queue: asyncio.Queue,
    stream: weakref.ref[AsyncTextStream],
    item: object,
) -> None:
    """A job's output, handed to the stream's loop (from the model's worker thread)."""
    try:
        loop.call_soon_threadsafe(queue.put_nowait, item)
    except RuntimeError:  # the loop has closed: the stream stops, its text reader too
        reader = stream()
        if reader is not None:
            reader._loop_closed = True
            reader._abandon()
        raise ConsumerGone from None  # the engine stops the job


class AsyncTextStream(_Reader):
    """``async for`` over :class:`AudioChunk`; generation runs on the model's worker thread,
    never on the event loop. Cancelling the consuming task or ``aclose()`` stops it. Given a
    callable for its segments, it calls it in a thread at its first item."""

    def __init__(self, submit_async: Callable[[list[Job]], object], *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._submit = submit_async
        self._async_pieces: AsyncIterable[str] | None = None
        self._pump: asyncio.Task | None = None
        self._queues: dict[int, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wait_cancelled = False
        self._loop_closed = False  # its loop ended before it: what is left never comes
        self._reading = False

    def __aiter__(self) -> AsyncTextStream:
        return self

    def read_later(self, pieces: AsyncIterable[str]) -> None:
        """Read the live text from ``pieces`` on the loop that iterates this stream, from
        its first item on."""
        self._async_pieces = pieces

    async def __anext__(self) -> AudioChunk:
        if self._reading:
            raise UsageError(_ONE_READER)
        self._reading = True
        try:
            return await self._next_chunk()
        finally:
            self._reading = False

    async def _next_chunk(self) -> AudioChunk:
        import asyncio

        if self._wait_cancelled:
            # Ending quietly here would pass a cut-off stream for a whole one.
            raise UsageError(
                "this audio stream stopped when a wait for its next chunk was cancelled "
                "(a timeout such as asyncio.wait_for's cancels it): to time out without "
                "stopping it, wait on asyncio.shield(task) of the pending __anext__(), or "
                "start a new stream"
            )
        self._reading_starts()
        try:
            loop = asyncio.get_running_loop()
            if self._loop is None:
                self._loop = loop
            elif loop is not self._loop and (
                self._ready or not self._finished or self._loop_closed
            ):
                # Its segments report to the first loop; checked before a chunk already
                # here is handed to another loop, as the next would never come.
                raise UsageError(
                    "this audio stream was started on another event loop: iterate it "
                    "within one loop (call astream() again inside each asyncio.run())"
                )
            while not self._ready:
                if self._finished:
                    raise self._end()
                if self._plan is not None:
                    # The first jobs are made there too: each tokenizes its text.
                    await asyncio.to_thread(self.prepare)
                    continue
                if self._async_pieces is not None and self._source is not None:
                    pieces, self._async_pieces = self._async_pieces, None
                    self._pump = loop.create_task(self._source.read_from_async(pieces))
                    if self._finished:  # cancel() from another thread meanwhile
                        self._abandon()
                        continue
                pending = self._pending()
                for job in pending:
                    q: asyncio.Queue = asyncio.Queue()
                    self._queues[id(job)] = q
                    job.on_output = partial(_to_loop, loop, q, weakref.ref(self))
                if pending:
                    await self._submit(pending)
                if self._finished:  # cancel() meanwhile
                    continue
                if not self.jobs:  # live text: nothing in flight until more of it comes
                    # Awaited on the loop: a pool thread blocked per waiting stream starved
                    # the pool, which the text's own producer may need.
                    t0 = time.perf_counter()
                    source = self._source
                    while not self._take(False, idle=True) and self.live and not self._finished:
                        await source.changed()
                    self._waited += time.perf_counter() - t0
                    continue
                _, job = self.jobs[0]
                item = await self._queues[id(job)].get()
                if item is DONE:
                    del self._queues[id(job)]
                self._ready.extend(self._on_item(item))
            return self._ready.popleft()
        except StopAsyncIteration:
            raise
        except asyncio.CancelledError:
            self._wait_cancelled = not self._finished
            self.cancel()
            raise
        except GeneratorExit:
            self.cancel()
            raise
        except BaseException as e:  # Ctrl-C, a failed segment
            self._abandon(e)
            raise

    def _abandon(self, error: BaseException | None = None) -> None:
        super()._abandon(error)
        pump, self._pump = getattr(self, "_pump", None), None  # None: __init__ failed
        loop = getattr(self, "_loop", None)
        if pump is not None and loop is not None:
            # From any thread: the task belongs to the stream's loop (closed: nothing runs).
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(pump.cancel)

    async def aclose(self) -> None:
        """Stop generation (as :meth:`cancel`); the ``async with`` block's end does the same."""
        self.cancel()

    async def __aenter__(self) -> AsyncTextStream:
        return self

    def __iter__(self):
        raise UsageError(
            "this is astream()'s stream, read with `async for` or `async with`: for `for`, "
            "make it with stream()"
        )

    def __enter__(self):
        raise UsageError(
            "this is astream()'s stream: use `async with`, or make it with stream() for `with`"
        )

    def __exit__(self, *exc_info: object) -> None:  # `with` needs both to call __enter__
        pass

    async def __aexit__(self, *exc_info: object) -> None:
        """Leaving an ``async with`` block stops generation."""
        self.cancel()

    def __del__(self) -> None:
        if hasattr(self, "_source"):  # an __init__ cut short (Ctrl-C) started nothing
            self.cancel()
