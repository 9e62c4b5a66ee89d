"""A cached model read on the worker while the Hub is asked whether it is still current.

A repo id's later runs ask the Hub one question (a request of up to
``HF_HUB_ETAG_TIMEOUT``) before anything is read; the answer is nearly always that the
copy in the cache is current. The copy is read meanwhile; if the Hub names another one,
this read stops at its next part and lets go of what it read before the other is read.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from .worker import Worker, wait_for


class ReadAheadDropped(Exception):
    """Ends a read the Hub's answer made useless (never seen by callers)."""


class ReadAhead:
    """``load(path, check)`` started on ``worker`` now; :meth:`take` its result, or
    :meth:`drop` it. ``state`` is what the caller noted of ``path`` before the read began
    (its files' fingerprint)."""

    def __init__(
        self,
        worker: Worker,
        path: Path,
        load: Callable[[Path, Callable[[], None]], Any],
        state: Any = None,
    ) -> None:
        self.path = path
        self.state = state
        self._dropped = threading.Event()

        def check() -> None:
            worker.raise_if_closed()
            if self._dropped.is_set():
                raise ReadAheadDropped(str(path))

        def read() -> Any:
            try:
                loaded = load(path, check)
                if not self._dropped.is_set():  # (stopped after its last part: let go too)
                    return loaded
                loaded = None
            except ReadAheadDropped:
                pass
            gc.collect()  # what was read goes now, not when the caller next looks
            return None

        self._future: Future | None = worker.submit(read)

    @property
    def stopped(self) -> bool:
        """Whether :meth:`stop` was called (what it read may be gone: read again)."""
        return self._dropped.is_set()

    def take(self) -> Any:
        """The loaded model (or the read's error), once the read is done; not after
        :meth:`stop`."""
        assert self._future is not None and not self.stopped, "taken after it was stopped"
        wait_for(self._future)
        return self._future.result()

    def stop(self) -> None:
        """Stop the read at its next part, without waiting (before an update's download:
        what it read is let go meanwhile); a read already done lets go of its model."""
        self._dropped.set()
        if self._future is not None and self._future.done():
            self._future = None
            gc.collect()  # the model's compiled steps hold it in reference cycles

    def drop(self) -> None:
        """:meth:`stop`, then wait for the read to end (so that the model read next never
        shares memory with it)."""
        self.stop()
        if self._future is not None:
            wait_for(self._future)
            self._future = None
            gc.collect()
