"""What the command line says: its one-line errors and notes on stderr, results on stdout."""

from __future__ import annotations

import contextlib
import sys

from ..errors import VoxtralError, printable

PROG = "voxtral-mlx"
STDOUT_FIX = "check the file or pipe stdout goes to (a full disk?)"


def to_stderr(text: str) -> None:
    """Write to stderr if there is one: closed (``2>&-``: ``print`` would then write to
    stdout, into the audio of ``-o -``) or failing (``2>/dev/full``), messages are lost
    and the job's outcome stands."""
    if sys.stderr is None:
        return
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(text)
        sys.stderr.flush()


def err(message: str) -> None:
    to_stderr(f"{PROG}: error: {printable(message)}\n")


def info(message: str) -> None:
    """A note on stderr, one line whatever a path in it holds (a newline, a terminal escape)."""
    to_stderr(f"{printable(message)}\n")


class StdoutError(VoxtralError):
    """stdout cannot take the command's output (a full disk, a closed device)."""


def result_line(line: str) -> None:
    """One line of a command's result on stdout."""
    if sys.stdout is None:  # started with stdout closed: print() would drop it silently
        raise StdoutError("stdout is closed: redirect it to a file or a pipe")
    try:
        print(printable(line))  # one line, and no terminal escapes from a file name
    except BrokenPipeError:
        raise
    except OSError as e:
        raise StdoutError(f"writing to stdout failed: {e.strerror or e}; {STDOUT_FIX}") from None


def note(message: str) -> None:
    """Something the user may want to act on, though the command did its job."""
    info(f"{PROG}: note: {message}")


def show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    info(f"{PROG}: warning: {message}")
