"""Writing a whole model directory: which outputs may be replaced, and a staging directory
that is renamed into place only when complete, so a failed or interrupted write leaves
nothing behind."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

from .errors import InputError
from .fileio import (
    close_quietly,
    creation_failure,
    full_fsync,
    one_line,
    open_locked,
    orphans,
    owned_name,
    remove_orphans,
    usable_path,
)

_MODEL_FILES = {"config.json", "params.json", "tekken.json", "model.safetensors.index.json"}
# What --force may delete with a model directory: its files, and what a Hub download or a
# conversion puts beside them. Anything else (a user's own files) makes --force refuse.
_REPLACEABLE = _MODEL_FILES | {
    "voice_embedding",
    "README.md",
    ".gitattributes",
    ".cache",
    ".DS_Store",
}


OLD_KIND = "old"  # an output being replaced, renamed aside until the new one is in place
_LITTER = ".DS_Store"  # what the Finder leaves in any folder it has shown


def _has_content(path: Path) -> bool:
    """Whether directory ``path`` holds anything but the Finder's litter."""
    return any(p.name != _LITTER for p in path.iterdir())


def looks_like_model_dir(path: Path) -> bool:
    names = {p.name for p in path.iterdir()}
    return bool(names & _MODEL_FILES or any(n.endswith(".safetensors") for n in names))


_VOICE_FILES = (".pt", ".safetensors")


def _foreign(path: Path) -> list[str]:
    """Entries of ``path`` that are not part of a model directory (in ``voice_embedding/``:
    anything but voice files)."""
    found = sorted(
        p.name
        for p in path.iterdir()
        if p.name not in _REPLACEABLE and not p.name.endswith(".safetensors")
    )
    voices = path / "voice_embedding"
    if voices.is_dir() and not voices.is_symlink():
        # A killed convert-voices run's staging directory is ours, and goes with the rest.
        left = {e.name for e in orphans(voices, "voices", "partial")}
        found += sorted(
            f"voice_embedding/{p.name}"
            for p in voices.iterdir()
            if p.name != _LITTER
            and p.name not in left
            and not (p.is_file() and p.name.endswith(_VOICE_FILES))
        )
    return found


def directory_path(value: object, name: str = "out_dir", error: type = InputError) -> Path:
    """``value`` as a Path if it is a path (a ``str`` or ``os.PathLike``, not empty: Path("")
    is the current directory), else a one-line ``error`` naming ``name``."""
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise error(f"{name} must be a directory path, got {one_line(repr(value), 60)}")
    return usable_path(value, name, error)


def resolve_output(out: Path) -> Path:
    """``out`` with its symbolic links resolved; a one-line :class:`InputError` for a loop.

    Only a strict resolve reports a loop on every Python (RuntimeError before 3.13,
    OSError ELOOP from 3.13, where the lenient one returns the looping link itself); the
    lenient one then resolves a path that does not exist yet.
    """
    try:
        return out.resolve(strict=True)
    except RuntimeError:
        loops = True
    except OSError as e:
        loops = e.errno == errno.ELOOP
    if not loops:
        try:
            return out.resolve()
        except (RuntimeError, OSError):
            pass
    raise InputError(
        f"output {one_line(str(out))} is (or is inside) a symbolic link that loops; "
        "remove it or choose another output directory"
    )


def check_output_dir(out: Path, force: bool) -> Path:
    """The directory to write: ``out``, or the directory a symbolic link ``out`` points to
    (the link stays; what it points to is replaced). Raises :class:`InputError` unless it is
    new, empty, or (with ``force``) a model directory."""
    if out.is_symlink():
        target = resolve_output(out)
        if not target.is_dir():
            raise InputError(
                f"output {one_line(str(out))} is a symbolic link to {one_line(str(target))}, "
                "which is not a directory: choose another output directory"
            )
        out = target
    if out.name == "..":  # the rename into place would fail, after the whole write
        raise InputError(f"output {one_line(str(out))} ends in '..': name the directory itself")
    _put_back_replaced(out)  # before the checks: it is what is there
    if out.is_dir() and os.path.ismount(out):
        raise InputError(
            f"output {one_line(str(out))} is a mount point, which the finished directory "
            "cannot be renamed onto: write into a new directory inside it"
        )
    if out.exists():
        if not out.is_dir():
            raise InputError(
                f"output {one_line(str(out))} exists and is not a directory: choose another "
                "output directory, or remove that file"
            )
        try:
            empty = not _has_content(out)
        except OSError as e:
            raise InputError(f"cannot read output {one_line(str(out))}: {e.strerror}") from None
        if not empty and not force:
            raise InputError(
                f"output {one_line(str(out))} exists and is not empty: pass --force (force=True) "
                "to replace it, or choose another directory"
            )
        foreign = [] if empty else _foreign(out)
        if not empty and (foreign or not looks_like_model_dir(out)):
            named = f" ({one_line(', '.join(foreign[:3]), 80)})" if foreign else ""
            raise InputError(
                f"output {one_line(str(out))} holds files that are not a model{named}; "
                "refusing to replace it even with --force: choose another directory"
            )
    return out


def make_dirs(directory: Path) -> list[Path]:
    """Create ``directory`` and its missing parents; returns the ones created, deepest
    first, for :func:`remove_dirs` to undo."""
    missing = [d for d in (directory, *directory.parents) if not d.exists()]
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        remove_dirs(missing)
        raise
    return missing


def make_parents(path: Path) -> list[Path]:
    """:func:`make_dirs` for the directory that will hold ``path``."""
    return make_dirs(path.parent)


def remove_dirs(dirs: list[Path]) -> None:
    """Remove the directories of :func:`make_dirs` that are still empty."""
    for d in dirs:
        with contextlib.suppress(OSError):
            d.rmdir()


@contextlib.contextmanager
def staged_dir(out: Path, force: bool = False) -> Iterator[Path]:
    """Yield a hidden directory beside ``out`` to fill; on success it replaces ``out``.

    On any failure or interrupt the staging directory and the parents made for it are
    removed, and ``out`` is untouched. Without ``force``, an ``out`` that another process
    filled meanwhile is not replaced (an :class:`InputError`). ``OSError`` becomes a
    one-line :class:`InputError`.
    """
    created: list[Path] = []
    lock: int | None = None  # tells other runs (even in other PID namespaces) tmp is in use
    try:
        created = make_parents(out)
        remove_orphans(out.parent, out.name, "partial")  # a killed run's staging directory
        remove_orphans(out.parent, out.name, OLD_KIND)  # or the model it replaced
        tmp = out.parent / owned_name(out.name, "partial")
        tmp.mkdir()  # the umask gives the finished folder's mode (as for its files)...
        lock = open_locked(tmp)
        try:
            mode = stat.S_IMODE(tmp.stat().st_mode)
            os.chmod(tmp, 0o700)  # ...private while it is written
        except OSError:
            with contextlib.suppress(OSError):
                tmp.rmdir()
            raise
    except OSError as e:
        close_quietly(lock)
        remove_dirs(created)
        blocking = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
        reason = (
            f"{one_line(str(blocking))} is a file, not a directory"
            if blocking is not None
            else creation_failure(e, out.parent)
        )
        raise InputError(
            f"cannot write to {one_line(str(out.parent))}: {reason}; choose a writable output "
            "directory"
        ) from None
    received: list[int] = []  # signals held while the output was swapped in
    try:
        yield tmp
        _sync_tree(tmp)
        with signals_deferred() as received:
            _swap_into_place(tmp, out, force, mode)
            close_quietly(lock)
            lock = None  # (not closed twice, should anything still fail)
    except BaseException as e:
        with signals_deferred() as again:  # a second Ctrl-C must not leave half of tmp
            shutil.rmtree(tmp, ignore_errors=True)
            remove_dirs(created)
            close_quietly(lock)
        deliver_signals([*received, *again], None)
        if isinstance(e, OSError) and e.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise InputError(
                f"output {one_line(str(out))} was filled by something else while this was "
                "being written; pass --force (force=True) to replace it, or choose another "
                "directory"
            ) from None
        if isinstance(e, OSError):
            raise InputError(
                f"cannot write {one_line(str(out))}: {one_line(e.strerror or str(e))}; check "
                "the free disk space and permissions"
            ) from None
        raise
    deliver_signals(received, written_detail(out))


def _put_back_replaced(out: Path) -> None:
    """A run killed between moving the old ``out`` aside and renaming the new one in left
    no ``out``, only the old one hidden beside it: the last complete model, put back (this
    run may fail too), rather than removed."""
    if os.path.lexists(out):
        return
    left = []
    for entry in orphans(out.parent, out.name, OLD_KIND):
        with contextlib.suppress(OSError):  # (a link to nothing is no model to put back)
            if entry.is_dir(follow_symlinks=False):
                left.append((entry.stat(follow_symlinks=False).st_mtime, entry.path))
    if left:
        with contextlib.suppress(OSError):
            os.rename(max(left)[1], out)


def _sync_tree(root: Path) -> None:
    """Make every file under ``root``, and the directories naming them, durable before the
    rename that publishes them: otherwise a power cut soon after a finished conversion can
    leave empty or short files in a directory that looks complete."""
    for parent, _dirs, files in os.walk(root):
        for name in files:
            _sync_path(os.path.join(parent, name))
        # A directory's entries: best effort, as some file systems (network, FUSE) refuse
        # to sync a directory (EINVAL) and a conversion must not fail over it.
        with contextlib.suppress(OSError):
            _sync_path(parent)


def _sync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        full_fsync(fd)
    finally:
        os.close(fd)


def written_detail(out: str | Path) -> str:
    """What an interrupt that came once ``out`` was in place says (the CLI's one line)."""
    return f"interrupted after {one_line(str(out))} was written (it is complete)"


# SIGHUP too: a terminal closed mid-swap must not leave the old model behind, hidden.
_DEFERRED = tuple(
    getattr(signal, name)
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")
    if hasattr(signal, name)
)


@contextlib.contextmanager
def signals_deferred() -> Iterator[list[int]]:
    """Hold Ctrl-C, SIGTERM, SIGHUP and SIGQUIT back (collected in the list it yields, for
    :func:`deliver_signals`) while the output is swapped in or the staging directory removed: an
    interrupt never leaves the old model half-deleted beside the new one, or half a
    staging directory. Only the main thread can do this (elsewhere Python delivers no
    signals anyway)."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return
    saved = {sig: signal.signal(sig, lambda n, _f: received.append(n)) for sig in _DEFERRED}
    try:
        yield received
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def deliver_signals(received: list[int], detail: str | None) -> None:
    """Raise the signals held back, through their own handlers; ``detail`` (for the one
    error line the CLI prints) goes onto the interrupt they raise."""
    try:
        for sig in dict.fromkeys(received):
            signal.raise_signal(sig)
    except BaseException as e:  # KeyboardInterrupt, or the CLI's Terminated
        if detail is not None:
            e.detail = detail
        raise


def _swap_into_place(tmp: Path, out: Path, force: bool, mode: int) -> None:
    with contextlib.suppress(OSError):
        if out.is_dir():  # a folder replaced keeps its mode (a private one stays private)
            mode = stat.S_IMODE(out.stat().st_mode) | stat.S_IRWXU
    os.chmod(tmp, mode)
    if out.is_dir() and not _has_content(out):
        (out / _LITTER).unlink(missing_ok=True)  # an empty folder the Finder has shown
    if force and out.exists() and any(out.iterdir()):
        # Named for this process: if it is killed before removing it, the next run does.
        old = out.with_name(owned_name(out.name, OLD_KIND))
        lock = open_locked(out)  # not put back by another run while it is aside
        try:
            os.rename(out, old)
            try:
                os.rename(tmp, out)
            except BaseException:
                os.rename(old, out)
                raise
            shutil.rmtree(old, ignore_errors=True)
        finally:
            close_quietly(lock)
    else:
        # rename() replaces only a missing or empty directory: an `out` another process
        # filled since it was checked fails here (ENOTEMPTY or EEXIST) instead of being lost.
        os.rename(tmp, out)
