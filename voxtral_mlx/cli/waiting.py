"""Waiting on the model's worker in short timed waits, so that Ctrl-C and SIGTERM are
handled at once."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


_POLL_S = 0.05  # longest the main thread waits in one go: signals run between waits


def interruptibly(fn: Callable[[], T]) -> T:
    """``fn()`` on a helper thread while the main thread waits in short timed waits.

    Ctrl-C and SIGTERM are handled by the main thread between bytecodes only: blocked in
    an untimed lock wait (a Future, a Queue), it would not notice them until the model's
    worker hands something over (a whole load or frame; macOS never interrupts such a
    wait, Linux only when the signal reaches the main thread).
    """
    box: queue.Queue[tuple[bool, Any]] = queue.Queue()

    def run() -> None:
        try:
            box.put((True, fn()))
        except BaseException as e:
            box.put((False, e))

    threading.Thread(target=run, name="voxtral-mlx-cli", daemon=True).start()
    from ..worker import get_in_slices  # here: commands that never wait skip its import

    ok, value = get_in_slices(box, _POLL_S)
    if ok:
        return value
    raise value


class Chunks:
    """Iterates a speech stream on a helper thread; see :func:`interruptibly`.

    ``close()`` (or leaving its ``with`` block) cancels the stream and releases the helper.
    """

    def __init__(self, stream: Any, depth: int = 8) -> None:
        self._stream = stream
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=depth)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._pump, name="voxtral-mlx-speak", daemon=True)
        self._thread.start()

    def _put(self, item: tuple[str, Any]) -> bool:
        while not self._closed.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _pump(self) -> None:
        try:
            for chunk in self._stream:
                if not self._put(("chunk", chunk)):
                    return
        except BaseException as e:
            self._put(("error", e))
            return
        self._put(("end", None))

    def __iter__(self) -> Iterator[Any]:
        from ..worker import get_in_slices  # (see interruptibly)

        while True:
            kind, value = get_in_slices(self._queue, _POLL_S)
            if kind == "end":
                return
            if kind == "error":
                raise value
            yield value

    def close(self) -> None:
        self._closed.set()
        self._stream.cancel()

    def __enter__(self) -> Chunks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
