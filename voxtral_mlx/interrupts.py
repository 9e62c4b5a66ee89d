"""Ctrl-C, SIGTERM, SIGHUP and SIGQUIT for the command line: raised where the CLI can clean up.

Python raises a signal's exception at whatever bytecode the main thread is running. Three
places make that harmful, and there the exception is held back and raised at the first
safe moment instead (a timer looks again every few milliseconds):

- a weakref callback or a ``__del__`` (run by the garbage collector anywhere): Python
  prints the exception as "ignored" and goes on, so the interrupt was lost (one raised
  in a callback not recognised as such comes back through ``sys.unraisablehook``);
- an import: the module stays half-initialised (numpy then fails to import at all);
- the clean-up after a first interrupt: a second one cut it short (a lock of
  ``threading`` released twice, a temp file left behind). Once one interrupt has been
  raised, later ones are dropped; one that comes after :data:`FORCE_AFTER_S`, when the
  clean-up seems stuck, ends the process the signal's default way.

Commands also hold signals back around steps that must not be cut in half
(:func:`signals_held`).
"""

from __future__ import annotations

import _weakrefset
import contextlib
import functools
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, TypeVar

T = TypeVar("T")

RETRY_S = 0.005  # how soon a held-back signal is tried again
FORCE_AFTER_S = 3.0  # a signal this long after the first one ends the process at once

_UNSAFE_FILES = frozenset(m.__file__ for m in (weakref, _weakrefset))
# SIGQUIT: Ctrl-\ on a terminal, pressed to quit at once: it too leaves no temp file.
_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")
_QUICK_EXITS: set[Any] = set()  # handlers of exit_on_signals()
FINISHED = "after the command had finished"  # what a signal once a command is over says


class Terminated(KeyboardInterrupt):
    """SIGTERM, SIGHUP or SIGQUIT during a command that writes: cleaned up like Ctrl-C, exit status
    128 + signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _State:
    """Signals of the running command (main thread only)."""

    depth = 0  # inside signals_held()
    pending: KeyboardInterrupt | None = None  # held back, to be raised
    raised_at: float | None = None  # when the first one was raised (time.monotonic())
    last: KeyboardInterrupt | None = None  # the one raised
    retrying = False  # the retry timer is installed
    previous_hook: Callable[[Any], object] = sys.__unraisablehook__

    @classmethod
    def reset(cls) -> None:
        cls.depth, cls.pending, cls.raised_at, cls.last = 0, None, None, None


def _unsafe(frame: FrameType | None) -> bool:
    while frame is not None:
        code = frame.f_code
        name = code.co_filename
        if (
            name in _UNSAFE_FILES
            or name.startswith("<frozen importlib")
            or code.co_name == "__del__"
        ):
            return True
        frame = frame.f_back
    return False


def _raise(exc: KeyboardInterrupt) -> None:
    _State.pending, _State.raised_at, _State.last = None, time.monotonic(), exc
    raise exc


def _unraisable(info: Any) -> None:
    """``sys.unraisablehook`` while a command runs: an interrupt raised where Python could
    only print it (a callback of the garbage collector that :func:`_unsafe` did not
    recognise) is raised again at the next safe moment."""
    if info.exc_value is not None and info.exc_value is _State.last:
        _State.pending, _State.raised_at, _State.last = info.exc_value, None, None
        _retry_soon()
        return
    _State.previous_hook(info)


def _arrived(exc: KeyboardInterrupt, signum: int, frame: FrameType | None) -> None:
    if _State.raised_at is not None:
        if time.monotonic() - _State.raised_at > FORCE_AFTER_S:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        return
    if _State.pending is None:
        _State.pending = exc
    if _State.depth:
        return
    if _unsafe(frame):
        _retry_soon()
        return
    _raise(_State.pending)


def _on_interrupt(signum: int, frame: FrameType | None) -> None:
    _arrived(KeyboardInterrupt(), signum, frame)


def _on_termination(signum: int, frame: FrameType | None) -> None:
    _arrived(Terminated(signum), signum, frame)


def _on_retry(signum: int, frame: FrameType | None) -> None:
    if _State.pending is None or _State.depth or _State.raised_at is not None:
        return
    if _unsafe(frame):
        _retry_soon()
        return
    _raise(_State.pending)


def _retry_soon() -> None:
    if _State.retrying:
        signal.setitimer(signal.ITIMER_REAL, RETRY_S)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM/SIGHUP back until the block is done, then raise them.

    For short steps that must not be cut in half: an interrupt between libsndfile's write
    and the writer's frame count made the kept file look cut short, and lost it.
    Only with the handlers of :func:`catching_termination` installed.
    """
    _State.depth += 1
    try:
        yield
    finally:
        _State.depth -= 1
    if not _State.depth and _State.pending is not None and _State.raised_at is None:
        _raise(_State.pending)


def hold_from_now() -> None:
    """The command's output is complete: from now on signals are held back, to be raised
    when it returns, saying so (not cut into its report as if it had failed)."""
    _State.depth += 1


@contextlib.contextmanager
def held_after(first: BaseException | None) -> Iterator[None]:
    """:func:`signals_held` for the clean-up after ``first`` (an interrupt, if any): a
    second Ctrl-C during it is dropped, so that ``first``, which says what was kept, is the
    one reported."""
    try:
        with signals_held():
            yield
    except KeyboardInterrupt:
        if first is None:
            raise


@contextlib.contextmanager
def catching_termination() -> Iterator[None]:
    """Turn SIGTERM/SIGHUP (``timeout``, ``kill``, a closed terminal) into :class:`Terminated`,
    so they too keep what was finished and leave no temp file (unless ignored already);
    Ctrl-C still raises KeyboardInterrupt, through the same safe delivery. A signal held
    back until the command has finished is raised then, saying so."""
    installed: dict[int, Any] = {}
    _State.reset()
    if threading.current_thread() is threading.main_thread():
        for name in _SIGNALS:
            sig = getattr(signal, name, None)
            if sig is not None and _replaceable(signal.getsignal(sig)):
                handler = _on_interrupt if sig == signal.SIGINT else _on_termination
                installed[sig] = signal.signal(sig, handler)
        alarm = getattr(signal, "SIGALRM", None)
        if installed and alarm is not None and signal.getsignal(alarm) == signal.SIG_DFL:
            installed[alarm] = signal.signal(alarm, _on_retry)
            _State.retrying = True
    hooked = bool(installed)
    if hooked:
        _State.previous_hook, sys.unraisablehook = sys.unraisablehook, _unraisable
    finished = False
    try:
        yield
        finished = True
    finally:
        if _State.retrying:
            signal.setitimer(signal.ITIMER_REAL, 0)
            _State.retrying = False
        if hooked:
            sys.unraisablehook = _State.previous_hook
        for sig, previous in installed.items():
            if finished and previous in _QUICK_EXITS:
                # The command did its job: a signal from now on must not say "interrupted"
                # alone, as start-up's handler does (the caller installs the same after).
                previous = _after_finishing(previous)
            signal.signal(sig, previous)
        late = _State.pending if _State.raised_at is None else None
        _State.reset()
    if finished and late is not None:
        late.detail = f"interrupted {FINISHED} (its output is complete)"
        raise late


def exit_on_signals(message: str) -> None:
    """Until a command installs the handlers above, and once it is over: Ctrl-C, SIGTERM
    or SIGHUP ends the process at once with ``message`` on stderr and status 128 +
    signal (there is nothing to clean up; Python's own KeyboardInterrupt would print a
    traceback from wherever start-up or teardown was, or break an import half-way)."""
    if threading.current_thread() is not threading.main_thread():
        return
    handler = functools.partial(_exit_at_once, (message + "\n").encode())
    _QUICK_EXITS.add(handler)
    for name in _SIGNALS:
        sig = getattr(signal, name, None)
        if sig is not None and _replaceable(signal.getsignal(sig)):
            signal.signal(sig, handler)


def _after_finishing(quick: functools.partial) -> functools.partial:
    """``quick`` (an :func:`exit_on_signals` handler) saying the command had finished."""
    message: bytes = quick.args[0]
    suffix = f" {FINISHED}\n".encode()
    if message.endswith(suffix):
        return quick
    handler = functools.partial(_exit_at_once, message.removesuffix(b"\n") + suffix)
    _QUICK_EXITS.add(handler)
    return handler


def default_signals() -> None:
    """Give the signals that :func:`exit_on_signals` took back to Python's defaults."""
    if threading.current_thread() is not threading.main_thread():
        return
    for name in _SIGNALS:
        sig = getattr(signal, name, None)
        if sig is not None and signal.getsignal(sig) in _QUICK_EXITS:
            default = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
            signal.signal(sig, default)


# Run before such an exit (deleting a download's partial file): in the signal handler.
QUICK_EXIT_CLEANUPS: list[Callable[[], object]] = []


def _exit_at_once(message: bytes, signum: int, frame: FrameType | None) -> None:
    for cleanup in list(QUICK_EXIT_CLEANUPS):
        with contextlib.suppress(Exception):
            cleanup()
    for f in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a flush this signal cut in half
            if f is not None:
                f.flush()
    with contextlib.suppress(OSError):
        os.write(2, message)
    os._exit(128 + signum)


def _replaceable(handler: object) -> bool:
    return handler in (signal.SIG_DFL, signal.default_int_handler) or handler in _QUICK_EXITS


def terminable(command: Callable[..., T]) -> Callable[..., T]:
    """Run ``command`` under :func:`catching_termination` (every command that writes)."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> T:
        with catching_termination():
            return command(*args, **kwargs)

    return run
