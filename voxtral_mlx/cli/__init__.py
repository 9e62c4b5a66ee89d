"""``voxtral-mlx``: speak text like macOS ``say``, list voices, convert files.

The only package that prints. Errors are one line on stderr and a non-zero exit code:
1 for bad input or environment, 130 when interrupted (143 / 129 / 131 for SIGTERM, SIGHUP,
SIGQUIT); ``serve`` exits 0 on Ctrl-C, the way it is meant to stop.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import warnings
from collections.abc import Sequence

from ..errors import VoxtralError, is_mlx_import_error, mlx_import_error
from ..fileio import one_line
from ..interrupts import FINISHED, Terminated, exit_on_signals
from .output import PROG, STDOUT_FIX, err, show_warning
from .parser import HelpNotWritten, build_parser


def main(argv: Sequence[str] | None = None, own_process: bool | None = None) -> int:
    """Run the command line; returns the exit status.

    ``argv=None`` (the ``voxtral-mlx`` script, ``python -m voxtral_mlx``), or
    ``own_process=True`` (the scripts in ``convert/``), means the process is the command's
    own: signals end it cleanly, and once an interrupted command has cleaned up, it exits
    at once (see :func:`_exit_now`).
    """
    own_process = argv is None if own_process is None else own_process
    if own_process:  # the process is ours: before the command starts, a signal just ends it
        exit_on_signals(f"{PROG}: error: interrupted")
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help or a usage error (already on stderr)
        error = _release_stdout()
        if error is None:
            raise e
        return _stdout_failed(error)
    except HelpNotWritten as e:
        _release_stdout()
        return _stdout_failed(e.error)
    warnings.showwarning = show_warning  # one line each, without Python's source echo
    if own_process:
        # huggingface_hub logs each retry of a download ("Trying to resume download..."),
        # a dozen lines before the one-line error that says what to do.
        os.environ.setdefault("HF_HUB_VERBOSITY", "error")
    try:
        code = _run(args, own_process=own_process)
    except VoxtralError as e:
        _release_stdout()
        err(str(e))
        return 1
    except ImportError as e:
        if not is_mlx_import_error(e):
            raise
        _release_stdout()
        err(str(mlx_import_error(e)))
        return 1
    except KeyboardInterrupt as e:
        err(getattr(e, "detail", "interrupted"))
        code = 128 + e.signum if isinstance(e, Terminated) else 130
        if own_process:
            _exit_now(code)
        return code
    except BrokenPipeError:
        # The reader of stdout went away (e.g. `| head`): not an error of ours.
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        return 141
    except OSError as e:  # a path no check foresaw (a name too long, a link loop, ...)
        _release_stdout()
        where = f" {one_line(str(e.filename), 200)!r}" if e.filename else ""
        err(f"cannot use{where}: {e.strerror or e}; check the path")
        return 1
    error = _release_stdout()
    return code if error is None else _stdout_failed(error)


def _stdout_failed(error: OSError) -> int:
    """The exit status for output that could not be written, said on stderr unless the
    reader went away (``| head``: not an error of ours)."""
    if isinstance(error, BrokenPipeError):
        return 141
    err(f"writing to stdout failed: {error.strerror or error}; {STDOUT_FIX}")
    return 1


def _run(args: argparse.Namespace, own_process: bool) -> int:
    try:
        return args.func(args)
    finally:
        if own_process:  # the command is over: its output kept or removed
            exit_on_signals(f"{PROG}: error: interrupted {FINISHED}")


def _exit_now(code: int) -> None:
    """End the process without the interpreter's teardown.

    After an interrupt the output is already kept or removed; a normal exit would then
    wait for the model's worker to finish the frame (or prefill) it is computing, up to a
    second or more, and free every array of the model before the shell prompt returns.
    """
    for f in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            if f is not None:
                f.flush()
    os._exit(code)


def _release_stdout() -> OSError | None:
    """Flush stdout now and return the error if that fails; stdout then points at
    /dev/null, so that Python's own flush at exit prints no traceback."""
    if sys.stdout is None:
        return None
    try:
        sys.stdout.flush()
        return None
    except OSError as e:
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        return e
