"""The progress line ``speak`` draws on a terminal."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .output import PROG, to_stderr

if TYPE_CHECKING:  # the engine imports MLX: not at start-up (see voxtral_mlx/entry.py)
    from ..engine import AudioChunk, Timings


class Progress:
    """One self-rewriting line on stderr: segments, seconds of audio, ETA. ``total`` None:
    text still arriving (``--follow``), whose segments are counted as they end."""

    REDRAW_S = 0.1  # at most ten redraws a second (a chunk comes every frame)

    def __init__(self, total: int | None, sizes: Sequence[int] | None = None):
        self.total = total
        # How much text each segment holds: the ETA weighs what is left by it.
        self.sizes = [max(1, int(n)) for n in sizes] if sizes is not None else [1] * (total or 0)
        self.text_total = sum(self.sizes)
        self.t0 = time.perf_counter()
        self.done = 0
        self._mark = (0.0, 0)  # (elapsed, text done) when the latest segment ended
        self._shown = ""
        self._shown_done = -1
        self._shown_at = 0.0
        self._due = ""  # a line held back by the rate limit, drawn by close()

    def update(self, chunk: AudioChunk, timings: Timings) -> None:
        before = self.done
        if chunk.is_final or (chunk.frames == 0 and len(chunk.audio)):  # a segment ended
            self.done = chunk.segment + 1
        else:  # the ones before it have ended, even with no pause (0 s) to say so
            self.done = max(self.done, chunk.segment)
        elapsed = time.perf_counter() - self.t0
        if self.done != before:
            self._mark = (elapsed, self._mark[1] + sum(self.sizes[before : self.done]))
        eta = ""
        if self.total is not None and 0 < self.done < self.total:
            # Measured when a segment ends, then counted down: segments end in bursts (a
            # batch's later ones are done when the first is), and a rate re-measured at
            # every chunk climbed between the bursts.
            at, text_done = self._mark
            left = max(0.0, at / text_done * (self.text_total - text_done) - (elapsed - at))
            eta = f", ETA {int(left // 60)}:{int(left % 60):02d}"
        if self.total is None:
            n = self.done
            line = f"{PROG}: {n} segment{'s' * (n != 1)} done, {timings.audio_s:.1f} s of audio"
        else:
            line = (
                f"{PROG}: segment {min(self.done + 1, self.total)}/{self.total}, "
                f"{timings.audio_s:.1f} s of audio{eta}"
            )
        now = time.perf_counter()
        if line == self._shown:
            return
        if self.done == self._shown_done and now - self._shown_at < self.REDRAW_S:
            self._due = line
            return
        self._draw(line)
        self._shown_done, self._shown_at = self.done, now

    def _draw(self, line: str) -> None:
        # The state first: a Ctrl-C landing after the write would leave an older held line
        # for close() to draw, and the count would step back.
        self._shown, self._due = line, ""
        # Cut to the terminal: a line that wraps is rewritten below itself at each update.
        # \x1b[K clears what a longer previous line left at the end.
        to_stderr(f"\r{line[: max(1, _columns() - 1)]}\x1b[K")

    def close(self) -> None:
        if self._due:
            self._draw(self._due)
        to_stderr("\n")


def _columns() -> int:
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns or 80
    except (OSError, ValueError, AttributeError):
        return 80
