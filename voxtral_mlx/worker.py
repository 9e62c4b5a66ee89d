"""The one thread that runs a model's MLX work.

MLX binds unevaluated arrays to the stream of the thread that built them (a lazily loaded
weight cannot be evaluated from another thread), so each loaded model gets one worker
thread that loads it, generates, decodes and batches every request. Callers in any thread
(UI code, asyncio, server handlers) hand it work and wait for results.

The thread ends when its model is closed, and every model is closed at interpreter exit,
each thread first handing back its MLX state (see :meth:`Worker.close`).
"""

from __future__ import annotations

import atexit
import contextlib
import queue
import sys
import threading
import time
import weakref
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from typing import Any, TypeVar

from .errors import UsageError

T = TypeVar("T")

_WORKERS: weakref.WeakSet[Worker] = weakref.WeakSet()
CLOSE_WAIT_S = 10.0  # longest close() waits for a frame in progress to end
WAIT_SLICE_S = 0.1  # callers wait for the worker in waits this long (see wait_for)


@atexit.register
def _close_all() -> None:
    # A worker still inside MLX while the interpreter tears down aborts the process.
    for worker in list(_WORKERS):
        worker.close()


class Worker:
    """A daemon thread running submitted callables in order, plus a background ``pump``.

    ``pump()`` is called between tasks while it reports more work (the frame loop of the
    running requests), so new requests and calls are picked up at every frame boundary.
    """

    def __init__(self, name: str = "voxtral-mlx") -> None:
        self._tasks: queue.SimpleQueue[tuple[Callable[[], Any], Future] | None] = (
            queue.SimpleQueue()
        )
        self.pump: Callable[[], bool] = lambda: False
        self.on_close: Callable[[], None] = lambda: None  # run on the thread before it ends
        self._busy = False
        self._closed = False
        # A task is never queued behind the closing marker. Reentrant: close() can run
        # inside submit() on the same thread (a finalizer run by the garbage collector).
        self._lock = threading.RLock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        _WORKERS.add(self)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called: new work is refused."""
        return self._closed

    def raise_if_closed(self) -> None:
        """Raise :func:`closed_error` once :meth:`close` was called: long work on the
        thread (a model's load) calls it between parts, so that a close ends it there."""
        if self._closed:
            raise closed_error()

    @property
    def in_worker(self) -> bool:
        return threading.current_thread() is self._thread

    def refuse_wait(self) -> None:
        """Raise :func:`worker_wait_error` when called on the worker thread: whatever the
        caller would wait for next needs that thread."""
        if self.in_worker:
            raise worker_wait_error()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn()`` on the worker; the future holds its result or exception."""
        future: Future[T] = Future()
        task = (fn, future)  # made before the lock: an allocation can run a finalizer
        with self._lock:
            if not self._closed:
                self._tasks.put(task)
                return future
        future.set_exception(closed_error())
        return future

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` on the worker and wait for it (direct if already there)."""
        if self.in_worker:
            return fn(*args, **kwargs)
        future = self.submit(lambda: fn(*args, **kwargs))
        wait_for(future)
        return future.result()

    def close(self, wait: bool = True) -> None:
        """Stop taking work and drop the model's references (in-flight calls finish first);
        ``wait`` for the thread to end, up to :data:`CLOSE_WAIT_S` (a frame of a large model
        on a slow machine can take longer: the thread then ends when it is done, on its
        own).

        Before it ends, the thread hands back its MLX state (``mx.clear_streams()``: its
        streams, random key, compiled graphs). Kept past the thread's end, that state is
        freed by the thread's exit, which needs the interpreter: at interpreter exit the
        thread could then be ended by the interpreter's teardown and abort the process
        ("terminate called without an active exception").
        """
        with self._lock:
            if not self._closed:
                self._closed = True
                self._tasks.put(None)
        if wait and not self.in_worker:
            self._thread.join(timeout=CLOSE_WAIT_S)

    def _run(self) -> None:
        while True:
            try:
                item = self._tasks.get(block=not self._busy)
            except queue.Empty:
                item = ...
            if item is None:
                break
            if item is not ...:
                _run_task(*item)
            item = None  # the waiting frame must not keep the last task's objects alive
            try:
                self._busy = self.pump()
            except BaseException:  # (pump fails its jobs itself) the thread must live on:
                self._busy = False  # every later request would wait for it for ever
        with contextlib.suppress(BaseException):  # the thread must end cleanly regardless
            self.on_close()
        with self._lock:  # taken once a submit() that close() interrupted has queued
            self._refuse_rest()
        self.pump = lambda: False
        self.on_close = lambda: None
        _release_mlx_state()

    def _refuse_rest(self) -> None:
        # Queued behind the closing marker only by a submit() that close() interrupted on
        # its own thread (from a finalizer or a signal handler): its caller gets the closed
        # error, not a wait without end.
        while True:
            try:
                item = self._tasks.get_nowait()
            except queue.Empty:
                return
            if item is not None and item[1].set_running_or_notify_cancel():
                item[1].set_exception(closed_error())


def wait_for(future: Future, timeout: float | None = None) -> None:
    """Wait until ``future`` is done (or ``timeout`` passes) in short waits, between which
    Python raises a pending interrupt. One untimed wait would hold Ctrl-C back until the
    worker hands the result over (a whole model's load): on macOS a signal never interrupts
    it, on Linux only when it reaches the waiting thread, and an interrupt raised without a
    signal (``_thread.interrupt_main()``, as IDLE and other hosts stop code) never does."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not future.done():
        left = WAIT_SLICE_S if deadline is None else deadline - time.monotonic()
        if left <= 0:
            return
        futures.wait([future], timeout=min(left, WAIT_SLICE_S))


def get_in_slices(q: queue.Queue | queue.SimpleQueue, slice_s: float = WAIT_SLICE_S) -> Any:
    """``q.get()`` in waits of ``slice_s`` (see :func:`wait_for`): a job's next chunk can be
    many frames away."""
    while True:
        try:
            return q.get(timeout=slice_s)
        except queue.Empty:
            continue


def _release_mlx_state() -> None:
    """Free this thread's MLX state while the interpreter can still take it (see
    :meth:`Worker.close`); nothing of MLX runs on the thread after this."""
    mx = sys.modules.get("mlx.core")  # not imported: the thread never used MLX
    if mx is None:
        return
    with contextlib.suppress(Exception):
        mx.synchronize()  # work queued on the thread's streams ends first
    with contextlib.suppress(Exception):
        mx.clear_streams()
        mx.clear_cache()  # what that freed (the thread's random key) goes back too


def _run_task(fn: Callable[[], Any], future: Future) -> None:
    if future.set_running_or_notify_cancel():
        try:
            future.set_result(fn())
        except BaseException as e:  # handed to the caller
            future.set_exception(e)


def worker_wait_error() -> UsageError:
    """What a request that would wait for the worker gets when made on the worker itself."""
    return UsageError(
        "a blocking speech request cannot be made on the model's worker thread (inside "
        "tts.call() or a job's on_output callback): make it from another thread"
    )


class WorkerFuture(Future):
    """A future whose result the worker computes: waiting for it on the worker thread
    itself, which would never end (and stall every request), raises instead; a wait
    elsewhere can be interrupted (see :func:`wait_for`)."""

    def __init__(self, worker: Worker) -> None:
        super().__init__()
        self._worker = worker

    def result(self, timeout: float | None = None) -> Any:
        self._refuse()
        wait_for(self, timeout)
        return super().result(0)  # (not done by now: the TimeoutError a timeout gives)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._refuse()
        wait_for(self, timeout)
        return super().exception(0)

    def _refuse(self) -> None:
        if not self.done():
            self._worker.refuse_wait()


def closed_error() -> UsageError:
    """What requests to a closed model get."""
    return UsageError("this model was closed: load it again to use it")
