"""Text that arrives in pieces (an LLM's tokens, a pipe) cut into segments as they become sure.

:func:`voxtral_mlx.segment.split_text` sees the whole text; here the text's end is not known
yet, so a segment is only cut where more text cannot move the cut:

* a paragraph break followed by text: that paragraph is split as :func:`split_text` would;
* more than a window of text waiting (``max_chars`` and some): the cut
  :func:`split_text` would choose there (it weighs only that window);
* a sentence end within ``max_chars`` that the next word confirms (``"Mr. Smith"`` and
  ``"etc. and"`` are no sentence ends; a word needs its following space to be known): of
  several, the one whose length :func:`split_text` weighs cheapest;
* the input stalled for ``idle_s`` after a line break (someone typing lines) or a sentence
  end as :func:`split_text` would see it before a capitalised word (an LLM thinking; not
  after "Dr." or "3."): all that waits;
* the input's end: all that waits, as :func:`split_text` splits it.

Segments are taken when the reader has room for one (:meth:`LiveText.take`), so text that
arrives faster than it is spoken makes longer segments and a slow trickle short ones. Memory
is bounded: a producer far ahead of the speech waits once ``max_buffer_chars`` are waiting.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterable, Callable, Iterable, Mapping, MappingView, Set

import numpy as np

from .errors import InputError
from .segment import (
    _KINDS,
    _LINE_ENDS,
    PARAGRAPH,
    PAUSE_AFTER,
    SENTENCE,
    Segment,
    _best_split,
    _ends_terminal,
    _find_splits,
    _length_cost,
    _line_breaks,
    _spoken,
    split_text,
)

IDLE_S = 0.6  # a pause in the input this long after a sentence's end cuts it
MAX_BUFFER_CHARS = 1 << 20  # text waiting beyond this makes the producer wait
_NEXT_WORD = re.compile(r"\S\s")  # a whole word: its following space has arrived
_LEADING_SPACE = re.compile(r"\s*")
_POLL_S = 0.05
END = object()  # take(): the input ended and every segment was taken


class LiveText:
    """Segments of text given piece by piece, with ``put()`` and ``end()`` or from an
    iterable read on a thread of its own (:meth:`read_from`). ``take()`` hands them out in
    order; offsets count from the start of all the text given."""

    def __init__(
        self,
        *,
        target_chars: int,
        max_chars: int,
        add_period: bool = True,
        idle_s: float = IDLE_S,
        max_buffer_chars: int = MAX_BUFFER_CHARS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.target_chars, self.max_chars = target_chars, max_chars
        self.add_period = add_period
        self.idle_s = idle_s
        self.max_buffer_chars = max(max_buffer_chars, 4 * max_chars)
        self._clock = clock
        self._cond = threading.Condition()
        self._rest = ""  # text given and not yet in a segment (but for ``_pieces``)
        self._pieces: list[str] = []  # given since ``_rest`` was last joined
        self._waiting = 0  # characters in both
        self._wakers: list[Callable[[], None]] = []
        self._base = 0  # where ``_rest`` starts in all the text given
        self._ended = False
        self._closed = False
        self._error: BaseException | None = None
        self._last_put = clock()
        self._ready: deque[Segment] = deque()
        self._added = 0  # segments made so far (the next one's index)
        # A segment cut at a stall, with the whitespace after it seen so far: a blank line
        # completed by the next piece makes its pause a paragraph's (see pause_after()).
        self._open: tuple[int, str] | None = None
        self._later_pauses: dict[int, float] = {}
        self._checked = -1  # ``_version`` when the text last gave no segment
        self._checked_idle = False
        self._version = 0

    # -- producer side ------------------------------------------------------------------

    def put(self, piece: str) -> None:
        """Add text (any length, any boundary: a word may come in several pieces). Waits
        while ``max_buffer_chars`` are waiting to be spoken; returns at once once closed."""
        if not isinstance(piece, str):
            raise InputError(
                f"text pieces must be str, got {type(piece).__name__}: give the text itself"
            )
        with self._cond:
            if self._ended:
                raise InputError("put() after end(): this text has ended")
            while self._waiting > self.max_buffer_chars and not self._closed:
                self._cond.wait(_POLL_S)
            if self._closed or not piece:
                return
            # Joined when cut: ``_rest += piece`` copied all the waiting text per piece.
            self._pieces.append(piece)
            self._waiting += len(piece)
            self._last_put = self._clock()
            self._changed()

    def end(self, error: BaseException | None = None) -> None:
        """No more text; ``error`` (the producer's failure) is raised by ``take()`` once the
        segments before it are taken."""
        with self._cond:
            self._ended = True
            if error is not None and self._error is None:
                self._error = error
            self._changed()

    def close(self) -> None:
        """Stop: a waiting ``put()`` returns, the reading thread stops at its next piece."""
        with self._cond:
            self._closed = True
            self._changed()

    def read_from(self, pieces: Iterable[str]) -> threading.Thread:
        """Read ``pieces`` on a daemon thread, ``put()`` each, then ``end()`` (with the
        iterable's error if it raises)."""

        def run() -> None:
            error = None
            try:
                for piece in pieces:
                    if self._closed:
                        break
                    self.put(piece)
            except BaseException as e:  # handed to the reader: this thread has no caller
                error = e
            finally:
                self.end(error)
                close = getattr(pieces, "close", None)  # a generator's finally runs now
                if self._closed and callable(close):
                    with contextlib.suppress(Exception):  # the reader stopped: nobody to tell
                        close()

        thread = threading.Thread(target=run, name="voxtral-mlx-text", daemon=True)
        thread.start()
        return thread

    async def read_from_async(self, pieces: AsyncIterable[str]) -> None:
        """``read_from`` for an async iterable, run as a task on the caller's loop (its
        ``put()`` never waits long: the buffer's limit is polled off the loop)."""
        import asyncio

        error: BaseException | None = None
        try:
            if self._closed:  # stopped before this task first ran
                return
            async for piece in pieces:
                if self._closed:
                    break
                while self._waiting > self.max_buffer_chars and not self._closed:
                    await asyncio.sleep(_POLL_S)
                self.put(piece)
        except asyncio.CancelledError:
            if self._closed:  # this task, cancelled by the stream it reads for
                raise
            # The iterable's own: a cut-off text must not pass for a whole one.
            error = InputError(
                "the text's async iterable was cancelled before its end (CancelledError); "
                "the speech stops there"
            )
        except BaseException as e:
            error = e
        finally:
            self.end(error)
            close = getattr(pieces, "aclose", None)  # an async generator's finally runs now
            if self._closed and callable(close):
                # Awaited once more after a cancellation: the source (an HTTP response, an
                # LLM request) is released, as read_from() closes a generator.
                with contextlib.suppress(Exception):
                    await close()

    async def changed(self, timeout: float = _POLL_S) -> None:
        """Return when text is given, ends or the stream closes, or after ``timeout``: what
        an async reader awaits instead of a blocking ``take()`` (which would hold a thread
        of the loop's pool, where the text's own producer may need one)."""
        import asyncio

        loop = asyncio.get_running_loop()
        woken = loop.create_future()
        # Weakly: the waker stays registered if the loop is closed while it waits, and must
        # not keep the waiting task, and so the stream and its reading thread, alive.
        ref = weakref.ref(woken)

        def settle() -> None:
            future = ref()
            if future is not None and not future.done():
                future.set_result(None)

        def wake() -> None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits
                loop.call_soon_threadsafe(settle)

        # A timer, not asyncio.wait_for: before Python 3.12 that lost a cancellation of the
        # waiting task when the future completed at the same moment (CPython gh-86296).
        timer = loop.call_later(timeout, settle)
        with self._cond:
            self._wakers.append(wake)
        try:
            await woken
        finally:
            timer.cancel()
            with self._cond:
                self._wakers.remove(wake)

    def _changed(self) -> None:
        """Tell waiting readers (lock held)."""
        self._version += 1
        self._cond.notify_all()
        for wake in self._wakers:
            wake()

    # -- consumer side ------------------------------------------------------------------

    def take(self, block: bool, stop: Callable[[], bool] = lambda: False):
        """The next segment, ``None`` if none is sure yet (``block=False``, or ``stop()``
        said so while waiting), or :data:`END`. Raises what the producer failed with."""
        while True:
            with self._cond:
                while not self._ready and self._cut():
                    pass
                if self._ready:
                    return self._ready.popleft()
                if self._ended and not self._waiting:
                    if self._error is not None:
                        raise self._error
                    return END
                if not block or stop():
                    return None
                wait = _POLL_S
                if not self._ended:
                    until_idle = self._last_put + self.idle_s - self._clock()
                    if until_idle > 0:
                        wait = min(wait, until_idle + 1e-3)
                self._cond.wait(wait)

    def _cut(self) -> bool:
        """Move the segments that are sure now from ``_rest`` to ``_ready`` (lock held);
        False if no text was used."""
        idle = self._clock() - self._last_put >= self.idle_s
        if self._version == self._checked and (idle == self._checked_idle or self._ended):
            return False  # nothing new since the text last gave nothing
        if self._pieces:
            self._rest += "".join(self._pieces)
            self._pieces.clear()
        rest = self._rest
        lead = _LEADING_SPACE.match(rest).end()  # no copy of a long text per call
        if self._open is not None and lead:
            i, space = self._open
            space += rest[:lead]
            self._open = (i, space)
            if _line_breaks(space) > 1:
                self._later_pauses[i] = PAUSE_AFTER[PARAGRAPH]
                self._open = None
        if lead < len(rest):  # text follows: the whitespace after that segment is whole
            self._open = None
        if lead == len(rest):
            self._drop(lead)
            return bool(lead)
        target, max_chars = self.target_chars, self.max_chars
        # Beyond ``window`` no cut split_text would choose at the text's start depends on
        # what follows (its look-ahead: max_chars, a short tail's target / 4, a next word).
        window = max_chars + target // 4 + 64
        view = rest[lead : lead + 2 * window]
        if self._ended and len(rest) - lead <= 2 * window:
            segments = split_text(
                view, target_chars=target, max_chars=max_chars, add_period=self.add_period
            )
            self._add(segments, lead, last_pause=0.0)
            self._drop(len(rest))
            return True
        paragraphs, cands, forbid = _find_splits(view, lambda units=1: None)
        if len(paragraphs) > 1:  # a blank line with text after it: that paragraph is whole
            p1 = paragraphs[0][1]
            segments = split_text(
                view[:p1], target_chars=target, max_chars=max_chars, add_period=self.add_period
            )
            self._add(segments, lead, last_pause=PAUSE_AFTER[PARAGRAPH])
            self._drop(lead + paragraphs[1][0])
            return True
        if len(view) > window:
            e, s, kind = _best_split(view, 0, len(view), cands, forbid, target, max_chars)
            self._add([self._segment(view, 0, e, kind)], lead)
            self._drop(lead + s)
            return True
        best, best_cost = None, float("inf")
        for e, s, k in zip(cands.ends, cands.starts, cands.kinds, strict=True):
            if e > max_chars:
                break
            # A cut with no space after it needs the next character, and a "-" the one
            # after that: "！-" may yet be "！--", which ends the cut further on.
            glued = e == s and (s + 1 < len(view) or view[s:] != "-")
            if _KINDS[k] == SENTENCE and (glued or _NEXT_WORD.search(view, s)):
                cost = _length_cost(e, target, max_chars)  # as split_text weighs lengths
                if cost < best_cost:  # the first of equals, as split_text chooses
                    best, best_cost = (e, s), cost
        if best is not None:
            e, s = best
            self._add([self._segment(view, 0, e, SENTENCE)], lead)
            self._drop(lead + s)
            return True
        if idle and (view[-1] in _LINE_ENDS or _sentence_end(view.rstrip())):
            segments = split_text(
                view, target_chars=target, max_chars=max_chars, add_period=self.add_period
            )
            trailing = view[len(view.rstrip()) :]
            kind = PARAGRAPH if _line_breaks(trailing) > 1 else SENTENCE
            self._add(segments, lead, last_pause=PAUSE_AFTER[kind])
            self._drop(len(rest))
            self._open = (self._added - 1, trailing) if kind != PARAGRAPH else None
            return True
        self._checked, self._checked_idle = self._version, idle
        return False

    def pause_after(self, index: int) -> float | None:
        """The pause after segment ``index`` if it has changed since the segment was cut
        (any thread): cut at a stall after a line break, it gets a paragraph's pause when
        the next piece completes the blank line (someone typing lines); else None."""
        with self._cond:
            return self._later_pauses.get(index)

    def _segment(self, text: str, a: int, b: int, kind: str) -> Segment:
        piece = text[a:b]
        return Segment(piece, a, b, PAUSE_AFTER[kind], _spoken(piece, self.add_period))

    def _add(self, segments: list[Segment], lead: int, last_pause: float | None = None) -> None:
        offset = self._base + lead
        for i, seg in enumerate(segments):
            pause = seg.pause_after
            if i == len(segments) - 1 and last_pause is not None:
                pause = last_pause
            self._ready.append(
                dataclasses.replace(
                    seg, start=seg.start + offset, end=seg.end + offset, pause_after=pause
                )
            )
            self._added += 1

    def _drop(self, n: int) -> None:
        self._rest = self._rest[n:]
        self._base += n
        self._waiting -= n
        self._changed()  # a producer may be waiting for room


def _sentence_end(text: str) -> bool:
    """Whether ``text`` ends a sentence as :func:`split_text` would see it if a capitalised
    word followed: not after "Dr." or "e.g.", nor after a number ("$3." may go on as 3.50,
    "Version 2.0." as 2.0.1) or in a URL or e-mail address."""
    if not _ends_terminal(text) or (text.endswith(".") and text[-2:-1].isdigit()):
        return False
    word = text[text.rfind(" ") + 1 :].rsplit(None, 1)[-1]
    if "://" in word or "@" in word or word[:4].lower() == "www.":
        return False  # "https://example." may go on as ".com": what follows decides
    probe = text + " A"
    _, cands, _ = _find_splits(probe, lambda units=1: None)
    n = len(cands.ends)
    return bool(n) and cands.ends[n - 1] == len(text) and _KINDS[cands.kinds[n - 1]] == SENTENCE


def is_text_pieces(text: object) -> bool:
    """Whether ``text`` is pieces of text to read as they come (an iterable or async
    iterable that is not itself a str or bytes)."""
    if isinstance(text, (str, bytes, bytearray, memoryview, np.ndarray)):
        return False  # an array is data, not text: refused as not a string
    if is_unordered(text):
        return False  # a set's order is arbitrary, a dict's items are no text pieces
    return isinstance(text, (Iterable, AsyncIterable))


def is_unordered(text: object) -> bool:
    """Whether ``text`` is a mapping, a set or a dict view (no pieces of text in order)."""
    return isinstance(text, (Mapping, Set, MappingView))
