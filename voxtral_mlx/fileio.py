"""Small file helpers shared by every writer: atomic replacement and one-line messages."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import shutil
import stat
import time
from collections.abc import Callable
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]
from typing import BinaryIO

from .errors import InputError


def one_line(text: str, limit: int = 160) -> str:
    """Text from a file or the OS (names, keys, reasons) made safe for a one-line message."""
    if not text.isprintable():  # escaped character by character: "café" stays readable
        text = "".join(
            ch if ch.isprintable() and ch != "\\" else ch.encode("unicode_escape").decode("ascii")
            for ch in text
        )
    return text if len(text) <= limit else text[: limit - 3] + "..."


def path_text(path: object) -> str:
    """A path a message asks the user to act on (remove, move): escaped as :func:`one_line`
    does, but whole up to the longest path macOS allows, as a path cut to fit a line can
    leave out the very file it names."""
    return one_line(str(path), 1024)


MAX_JSON_BYTES = 64 << 20  # params.json, config.json, an index: kilobytes in any release


def dtype_name(dtype: object) -> str:
    """An MLX dtype as messages name it: ``float16``, not its repr ``mlx.core.float16``."""
    return str(dtype).removeprefix("mlx.core.")


def unreadable_fix(error: OSError, fix: str) -> str:
    """``fix`` for a file that could not be read, unless the error is a permission one:
    a new copy would not help, letting this user read it does."""
    if isinstance(error, PermissionError):
        return "let this user read it (chmod or chown), or run as its owner"
    return fix


def read_limited(path: str | os.PathLike[str], limit: int) -> bytes:
    """The bytes of ``path`` if it is a regular file of at most ``limit`` bytes.

    A FIFO would block the reader and ``/dev/zero`` never end, so anything else is an
    ``OSError`` whose ``strerror`` says so (as are FileNotFoundError, IsADirectoryError and
    the like from opening it): callers report ``strerror`` as the reason.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, "it is a directory", str(path))
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, "it is not a regular file (a pipe or a device?)")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise OSError(
            errno.EFBIG, f"it is larger than {limit >> 20} MiB, far more than such a file holds"
        )
    return data


def full_fsync(fd: int) -> None:
    """Make ``fd``'s data durable before a rename that publishes it: on macOS ``fsync``
    leaves it in the drive's cache (reordered after a crash); ``F_FULLFSYNC`` flushes it."""
    full = getattr(fcntl, "F_FULLFSYNC", None) if fcntl is not None else None
    if full is not None:
        try:
            fcntl.fcntl(fd, full)
            return
        except OSError:  # a file system that does not support it
            pass
    os.fsync(fd)


def atomic_write(
    path: str | os.PathLike[str], write: Callable[[BinaryIO], None], durable: bool = True
) -> None:
    """Write ``path`` through ``write(f)`` into a temp file beside it, then rename it in place.

    A failure (including in ``write``) leaves no partial file behind. Raises ``OSError``.
    ``durable=False`` skips flushing the data to the drive before the rename, for caches
    that check their content when read (on macOS the flush empties the drive's whole write
    cache: tens of milliseconds, on the thread that runs the frames).
    """
    path = Path(path)
    tmp = path.with_name(owned_name(path.name, TEMP_KIND))
    # os.open with mode 0o666 lets the umask decide the final permissions, like open() does.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    lock = None
    try:
        with os.fdopen(fd, "wb") as f:
            if fcntl is not None:
                # The lock belongs to the open file: a duplicate keeps it past this close,
                # until the rename is done.
                lock = os.dup(fd)
                hold_lock(lock)
            write(f)
            f.flush()
            if durable:
                full_fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        close_quietly(lock)


TEMP_KIND = "tmp"  # :func:`atomic_write`'s temp files: ``remove_orphans(dir, NAMES, TEMP_KIND)``
NAME_MAX = 255  # bytes in a file name (APFS, HFS+, ext4)


def _path_max() -> int:
    try:
        return os.pathconf("/", "PC_PATH_MAX")  # 4096 on Linux, 1024 on macOS
    except (OSError, ValueError):
        return 1024


PATH_MAX = _path_max()  # bytes in a path handed to the OS, its terminating NUL included


def usable_path(
    path: str | os.PathLike[str], what: str, error: type[Exception] = InputError
) -> Path:
    """``path`` (``~`` expanded) if it can name a file, else a one-line ``error`` about
    ``what``: a NUL character, a ``~user`` with no such user, or a name longer than a file
    name can be (the OS would say "embedded null byte", "Could not determine home
    directory" or "File name too long" from deep inside whatever used it), or a whole
    path longer than the OS takes."""
    text = os.fsdecode(os.fspath(path))
    shown = one_line(text, 100)
    if "\0" in text:
        raise error(f"{what} {shown} holds a NUL character, which no path can: remove it")
    try:
        os.fsencode(text)
    except UnicodeEncodeError:  # a lone surrogate: no file name holds one
        raise error(f"{what} {shown} is not valid text (a lone surrogate): fix the path") from None
    try:
        out = Path(text).expanduser()
    except RuntimeError:
        user = text.split("/", 1)[0]
        raise error(
            f"{what} {shown}: {one_line(user, 40)} names no user of this machine; write the "
            "path out"
        ) from None
    for part in out.parts:
        size = len(os.fsencode(part))
        if size > NAME_MAX:
            raise error(
                f"{what} {shown}: the name {one_line(part, 40)!r} is too long ({size} bytes, "
                f"more than a file name can be: {NAME_MAX}); shorten it"
            )
    size = len(os.fsencode(str(out)))
    if size >= PATH_MAX:
        raise error(
            f"{what} {shown} is too long ({size} bytes; the system takes paths of at most "
            f"{PATH_MAX - 1}): shorten it, or give it relative to a nearer directory"
        )
    return out


def creation_failure(error: OSError, folder: Path) -> str:
    """Why a file or folder could not be made in ``folder``, for an error message: /proc and
    its like answer "No such file or directory" for a folder that plainly exists."""
    if error.errno == errno.ENOENT and folder.is_dir():
        if _deleted(folder):  # a shell's working folder removed meanwhile: it still stats
            return "it has been deleted (cd to an existing folder)"
        return "it takes no new files (a system folder?)"
    return one_line(error.strerror or str(error))


def _deleted(folder: Path) -> bool:
    """Whether ``folder`` is one removed while open (no name links to it any longer)."""
    try:
        return os.stat(folder).st_nlink == 0
    except OSError:
        return False


def hidden_name(stem: str, tail: str) -> str:
    """``.<stem><tail>``, the stem shortened (never inside a character) so that the name
    fits the file system: a legal long target name must still get its hidden sibling."""
    room = NAME_MAX - 1 - len(os.fsencode(tail))
    kept = []
    for ch in stem:  # os.fsencode: a name that is not UTF-8 holds surrogate escapes
        room -= len(os.fsencode(ch))
        if room < 0:
            break
        kept.append(ch)
    return f".{''.join(kept)}{tail}"


def owned_name(stem: str, kind: str, ext: str = "") -> str:
    """``.<stem>.<kind>-<pid>-<random><ext>``: a hidden working name beside a target that
    says which process writes it, so that a later run can remove it once that process is
    gone (killed before it could clean up; see :func:`remove_orphans`)."""
    return hidden_name(stem, f".{kind}-{os.getpid()}-{secrets.token_hex(4)}{ext}")


def orphans(
    directory: Path, stem: str | re.Pattern[str], kind: str, ext: str = ""
) -> list[os.DirEntry]:
    """What :func:`owned_name` named for ``stem`` (a pattern: for any target name it matches
    whole, such as a cache's files; a folder shared with others holds theirs too) in
    ``directory`` whose process no longer runs, and that no writer holds
    :func:`hold_lock`'s lock on (older versions took none: their PID decides)."""
    tail = re.compile(rf"\.{re.escape(kind)}-(\d{{1,10}})-[0-9a-f]{{8}}{re.escape(ext)}$")
    try:
        with os.scandir(directory) as it:
            entries = [e for e in it if e.name.startswith(".")]
    except OSError:
        return []
    found = []
    for entry in entries:
        match = tail.search(entry.name)
        if match is None:
            continue
        if isinstance(stem, str):
            if entry.name != hidden_name(stem, match[0]):
                continue
        elif not stem.fullmatch(entry.name[1 : match.start()]):
            continue
        if not _process_exists(int(match.group(1))) and not _locked_by_another(entry):
            found.append(entry)
    return found


def hold_lock(fd: int) -> None:
    """Mark what ``fd`` opens (a working file, or a staging folder) as in use until ``fd``
    is closed: its PID alone misleads :func:`orphans` run from another PID namespace (a
    container sharing the folder), where that PID looks dead. Best effort: a file system
    without locks leaves the PID to decide."""
    if fcntl is None:
        return
    for _ in range(_LOCK_TRIES):  # another run's check holds it for a moment at most
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            time.sleep(0.001)
        except OSError:
            return


_LOCK_TRIES = 20


def open_locked(path: str | os.PathLike[str]) -> int | None:
    """A descriptor of the folder (or file) ``path`` holding :func:`hold_lock`'s lock, for
    the caller to close when done with it; None if it cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    hold_lock(fd)
    return fd


def close_quietly(fd: int | None) -> None:
    """Close ``fd`` (releasing any lock it holds), if there is one; errors are ignored."""
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)


def _locked_by_another(entry: os.DirEntry) -> bool:
    """Whether a writer holds :func:`hold_lock`'s lock on ``entry`` (briefly taken here to
    find out). What cannot be opened, or has no locks, is left to its PID."""
    if fcntl is None:
        return False
    flags = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:  # (a link is what would be removed, not what it leads to; a device is not opened)
        if entry.is_dir(follow_symlinks=False):
            fd = os.open(entry.path, os.O_RDONLY | flags)
        elif entry.is_file(follow_symlinks=False):
            try:
                fd = os.open(entry.path, os.O_RDONLY | flags)
            except PermissionError:  # a write-only (0200) file, just before its rename
                fd = os.open(entry.path, os.O_WRONLY | flags)
        else:
            return False
    except OSError:
        return False
    try:
        # Shared: it still conflicts with the writer's exclusive lock, and NFS (which
        # emulates flock with byte-range locks) grants it on a file opened for reading.
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # (which releases the lock, if it was taken)
    return False


def remove_orphans(
    directory: Path, stem: str | re.Pattern[str], kind: str, ext: str = ""
) -> list[Path]:
    """Remove the :func:`orphans`: a killed conversion's hidden staging directory can hold
    gigabytes. Returns what was removed; errors are ignored (this is tidying up, never the
    job)."""
    removed: list[Path] = []
    for entry in orphans(directory, stem, kind, ext):
        with contextlib.suppress(OSError):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
            removed.append(Path(entry.path))
    return removed


def prune_oldest(directory: Path, names: re.Pattern[str], keep: str, max_files: int) -> None:
    """Delete the least recently modified files of ``directory`` whose names ``names``
    matches whole, beyond ``max_files``; never ``keep`` (the file just written, counted:
    files with times in the future would be newer). Errors are ignored: this is a cache's
    tidying, never its job."""
    files = []
    try:
        with os.scandir(directory) as it:
            for entry in it:
                if entry.name == keep or not names.fullmatch(entry.name):
                    continue
                with contextlib.suppress(OSError):  # (the times os.utime() sets on a hit)
                    files.append((entry.stat().st_mtime_ns, entry.path))
    except OSError:
        return
    files.sort()
    excess = len(files) + 1 - max_files
    for _, path in files:
        if excess <= 0:
            break
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass  # another process pruned it
        except OSError:  # one that cannot go (a folder of that name, another user's)
            continue
        excess -= 1


def _process_exists(pid: int) -> bool:
    if os.name != "posix" or pid <= 0 or pid == os.getpid():
        return True  # (elsewhere signal 0 is not a probe; 0 and below are groups)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # EPERM: it exists, as another user's
        return True
    return True


def atomic_write_text(path: str | os.PathLike[str], text: str, durable: bool = True) -> None:
    atomic_write(path, lambda f: f.write(text.encode("utf-8")), durable)
