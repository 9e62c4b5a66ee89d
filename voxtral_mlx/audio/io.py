"""Writing generated audio: atomic files on disk and a streaming WAV for pipes.

Audio is mono float32 in [-1, 1]. Every integer encoding here uses one convention
(see :func:`float_to_int16`), so what is written, streamed or played through an int16
device is the same sample for sample.

Files are written as they are generated into a hidden temp file next to the target and
moved onto it with :func:`os.replace` only when the run ends well (or when the caller
asks to keep what is finished), so a failed run never leaves a half-written file and
never clobbers an existing one.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import struct
import time
import weakref
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

import numpy as np
import soundfile as sf

from ..errors import AudioFileFullError, AudioOutputError
from ..fileio import (
    creation_failure,
    full_fsync,
    hold_lock,
    one_line,
    owned_name,
    remove_orphans,
)
from .ogg import renumber_file

# extension -> (libsndfile major format, subtype). AIFF and CAF are what macOS `say -o`
# writes, so a Mac user's `-o hello.aiff` works as it does there.
FORMATS: dict[str, tuple[str, str]] = {
    ".wav": ("WAV", "PCM_16"),
    ".flac": ("FLAC", "PCM_16"),
    ".aiff": ("AIFF", "PCM_16"),
    ".aif": ("AIFF", "PCM_16"),
    ".caf": ("CAF", "PCM_16"),
    ".ogg": ("OGG", "VORBIS"),
    ".mp3": ("MP3", "MPEG_LAYER_III"),
    ".opus": ("OGG", "OPUS"),
}
# libsndfile writes nothing readable for these without a sample (FLAC and MP3 nothing at
# all, Opus its headers alone).
_NO_EMPTY_FILES = frozenset({".flac", ".mp3", ".opus"})
LOSSLESS_EXTENSIONS = frozenset(ext for ext, (_, sub) in FORMATS.items() if sub == "PCM_16")
OPUS_SAMPLE_RATES = (8000, 12000, 16000, 24000, 48000)
# libvorbis's encoder takes up to 200 kHz; libsndfile crashes (SIGSEGV) above it.
VORBIS_MAX_RATE = 200_000

_INT16_SCALE = 32768.0
# Formats whose sizes are 32-bit header fields (AIFF's signed): bytes of samples at most,
# less room for the header.
_MAX_SAMPLE_BYTES = {"WAV": 2**32 - 2**16, "AIFF": 2**31 - 2**16}
_WAV_UNKNOWN_SIZE = 0xFFFFFFFF


def float_to_int16(audio: np.ndarray) -> np.ndarray:
    """Float samples to int16: ``clip(rint(x * 32768), -32768, 32767)``.

    Scaling by 32768 (not 32767) makes this the exact inverse of the usual int16 to
    float reading (``k / 32768``, which soundfile, numpy users and ALSA all use), so
    int16 -> float -> int16 is the identity. Rounding is to nearest, ties to even
    (:func:`numpy.rint`). Values beyond full scale clip (+1.0 becomes 32767, the only
    in-range value that clips); NaN becomes 0.
    """
    with np.errstate(over="ignore"):  # beyond float32's range: inf, which clips below
        scaled = np.asarray(audio, dtype=np.float32) * np.float32(_INT16_SCALE)
    if np.isnan(scaled).any():
        scaled = np.nan_to_num(scaled, nan=0.0)
    np.rint(scaled, out=scaled)
    np.clip(scaled, -32768.0, 32767.0, out=scaled)
    return scaled.astype(np.int16)


def float_to_unit(audio: np.ndarray) -> np.ndarray:
    """Float samples as the lossy encoders take them: clipped to [-1, 1], NaN as 0 (as
    :func:`float_to_int16` has it; LAME aborts the whole process on a NaN sample)."""
    a = np.asarray(audio, dtype=np.float32)
    if np.isnan(a).any():
        a = np.nan_to_num(a, nan=0.0)
    return np.clip(a, -1.0, 1.0)


def float_to_pcm16(audio: np.ndarray) -> bytes:
    """Float samples to little-endian int16 bytes (convention of :func:`float_to_int16`)."""
    return float_to_int16(audio).astype("<i2", copy=False).tobytes()


def available_formats() -> dict[str, tuple[str, str]]:
    """The entries of :data:`FORMATS` that the linked libsndfile can write."""
    return {ext: fs for ext, fs in FORMATS.items() if _supported(*fs)}


def _supported(fmt: str, subtype: str) -> bool:
    try:
        return fmt in sf.available_formats() and subtype in sf.available_subtypes(fmt)
    except Exception:  # an old libsndfile may not even know the major format
        return False


def _extension(path: Path) -> str:
    return path.suffix.lower()


def output_target(path: str | os.PathLike[str]) -> Path:
    """The file to write for ``path``: ``path`` itself, or what a symbolic link ``path``
    points to (written through, as a shell's ``>`` does; the link stays a link)."""
    p = Path(path)
    if not p.is_symlink():
        return p
    try:
        target = p.resolve()
        target.stat()
    except FileNotFoundError:  # a dangling link: the file it names is created...
        if not _opens(p):
            return target
        # ...but this one leads somewhere no path names: /dev/stdout to a pipe
        raise AudioOutputError(
            f"output path {str(p)!r} leads to a pipe, socket or deleted file, not a file "
            "with a name; write to a file, or to stdout with -o -"
        ) from None
    except (RuntimeError, OSError):  # a loop (RuntimeError before Python 3.13)
        raise AudioOutputError(
            f"output path {str(p)!r} is a symbolic link that loops; remove it or choose "
            "another path"
        ) from None
    if target.parent == Path("/dev/fd"):  # macOS: /dev/stdout ends there, not at the file
        raise AudioOutputError(
            f"output path {str(p)!r} leads to {target}, a file descriptor without a file "
            "name to tell the format by; name the file (-o speech.wav), or write WAV to "
            "stdout with -o -"
        )
    return target


def _opens(path: Path) -> bool:
    try:
        os.stat(path)
    except OSError:
        return False
    return True


def check_output_path(path: str | os.PathLike[str], sample_rate: int | None = None) -> None:
    """Fail early, before any generation, if audio cannot be written to ``path``.

    Raises :class:`AudioOutputError` (one line: the problem and the fix) for an unknown
    extension, a format the linked libsndfile cannot write, a sample rate the format
    cannot hold, a path that is a directory, or a missing or unwritable parent directory.
    An existing file at ``path`` is fine: it is replaced only when writing succeeds.
    """
    _check_names_a_file(path)
    p = output_target(path)
    if p.is_dir():
        raise AudioOutputError(
            f"output path {str(p)!r} is a directory; give a file name such as "
            f"{str(p / 'speech.wav')!r}"
        )
    if p.exists() and not p.is_file():
        raise AudioOutputError(
            f"output path {str(p)!r} is not a regular file (a device, pipe or socket); "
            "write to a file, or to stdout with -o -"
        )
    # The name given says the format, even through a link; a name without an extension
    # (/dev/stdout redirected to a file) takes the one of the file it leads to.
    ext = _extension(Path(path)) or _extension(p)
    supported = ", ".join(FORMATS)
    if ext not in FORMATS:
        what = f"extension {ext!r} is not supported" if ext else "the name has no extension"
        name = Path(path).name
        if not ext and name.startswith(".") and "." not in name[1:]:  # "-o .wav"
            what = f"{name!r} is all name and no extension (a leading dot starts none)"
        if ext and not _extension(Path(path)):  # /dev/stdout redirected to a file: say so
            what = f"{what} (that of {str(p)!r}, where it leads)"
        raise AudioOutputError(
            f"cannot write audio to {str(path)!r}: {what}; end the file name with one of "
            f"{supported}"
        )
    fmt, subtype = FORMATS[ext]
    if not _supported(fmt, subtype):
        ok = ", ".join(available_formats()) or "none"
        raise AudioOutputError(
            f"the linked libsndfile {sf.__libsndfile_version__} cannot write {ext} "
            f"({fmt}/{subtype}); use one of {ok} or install a newer soundfile "
            "(libsndfile >= 1.1 writes MP3 and Opus)"
        )
    if subtype == "OPUS" and sample_rate is not None and sample_rate not in OPUS_SAMPLE_RATES:
        raise AudioOutputError(
            f"Opus cannot hold {sample_rate} Hz audio (only {OPUS_SAMPLE_RATES} Hz); "
            "write .ogg, .flac or .wav instead"
        )
    if subtype == "VORBIS" and sample_rate is not None and sample_rate > VORBIS_MAX_RATE:
        raise AudioOutputError(
            f"Ogg Vorbis cannot hold {sample_rate} Hz audio (at most {VORBIS_MAX_RATE} Hz); "
            "write .flac or .wav instead"
        )
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.exists():
        raise AudioOutputError(
            f"cannot write {str(p)!r}: directory {str(parent)!r} does not exist; "
            "create it first or choose another path"
        )
    if not parent.is_dir():
        raise AudioOutputError(
            f"cannot write {str(p)!r}: {str(parent)!r} is not a directory; choose another path"
        )
    _check_writable(p, parent)


def _check_names_a_file(path: str | os.PathLike[str]) -> None:
    """Refuse a path that names a directory by its ending, which :class:`Path` drops
    (``out.wav/`` and ``out.wav/.`` would both write ``out.wav``)."""
    text = os.fspath(path)
    text = text if isinstance(text, str) else os.fsdecode(text)
    if text.endswith(("/", os.sep)):
        raise AudioOutputError(
            f"output path {text!r} ends with a slash, so it names a directory; "
            "give a file name without it"
        )
    last = text.replace(os.sep, "/").rsplit("/", 1)[-1]
    if last in (".", ".."):
        raise AudioOutputError(
            f"output path {text!r} ends with {last!r}, so it names a directory; "
            "give a file name without it"
        )


def _check_writable(p: Path, parent: Path) -> None:
    """Refuse, before any generation, a ``p`` that the final rename into ``parent`` could
    not create or replace: the whole run would be lost at its very end."""
    if _on_read_only_file_system(parent):  # write access would not help: no chmod fix
        raise AudioOutputError(
            f"cannot write {str(p)!r}: {str(parent)!r} is on a read-only file system; "
            "write elsewhere"
        )
    # Before the file's own mode: neither chmod nor removing it is this user's to do.
    if p.is_file() and _sticky_keeps(p, parent):
        raise AudioOutputError(
            f"output file {str(p)!r} is another user's, in a sticky folder (as /tmp is: "
            "only a file's owner may replace it there); have it removed or choose another name"
        )
    if p.is_file() and not os.access(p, os.W_OK):  # as a shell's > would refuse it
        raise AudioOutputError(
            f"output file {str(p)!r} is read-only; make it writable (chmod u+w), remove it, "
            "or choose another path"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise AudioOutputError(
            f"cannot write {str(p)!r}: directory {str(parent)!r} is not writable; "
            "choose another location or fix its permissions"
        )


def _on_read_only_file_system(folder: Path) -> bool:
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except (AttributeError, OSError):  # no statvfs (Windows): the write will tell
        return False


def _sticky_keeps(target: Path, folder: Path) -> bool:
    """Whether ``folder``'s sticky bit forbids this user to replace ``target``: only the
    owner of the file or of the folder may, whatever the file's own mode says (a shell's
    ``>`` writes into the file, so it may; a rename onto it fails with EPERM)."""
    try:
        folder_stat, file_stat = os.stat(folder), os.lstat(target)
    except OSError:
        return False
    if not folder_stat.st_mode & stat.S_ISVTX:
        return False
    uid = os.geteuid()
    return uid not in (folder_stat.st_uid, file_stat.st_uid) and not _overrides_owners(uid)


_CAP_FOWNER = 3  # linux/capability.h: may act on files as their owner


def _overrides_owners(uid: int) -> bool:
    """Whether this process may replace other users' files in sticky folders: root, with
    CAP_FOWNER on Linux (a container may run as root without it)."""
    if uid != 0:
        return False
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_FOWNER & 1)
    except (OSError, ValueError, IndexError):
        pass
    return True  # macOS, or no /proc to ask: root may


def _as_mono_float(chunk: np.ndarray, channels: int) -> np.ndarray:
    a = np.asarray(chunk, dtype=np.float32)
    if channels == 1:
        if a.ndim == 2 and a.shape[1] == 1:
            a = a[:, 0]
        if a.ndim != 1:
            raise ValueError(f"expected 1-D mono audio, got shape {a.shape}")
    elif a.ndim != 2 or a.shape[1] != channels:
        raise ValueError(f"expected audio of shape (n, {channels}), got {a.shape}")
    return a


def _discard(
    handle: sf.SoundFile | None, tmp: Path, folder_fd: int | None = None, fd: int | None = None
) -> None:
    """Close the encoder (and ``fd``, the descriptor it writes to) and delete the temp file
    (used on error paths), in the folder ``folder_fd`` names if given (it may have been
    moved or renamed since).

    Raises nothing of its own; a Ctrl-C that lands while the encoder closes still lets the
    temp file be deleted before it propagates.
    """
    try:
        if handle is not None:
            with contextlib.suppress(Exception):
                handle.close()
    finally:
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
        with contextlib.suppress(OSError):
            if folder_fd is None:
                tmp.unlink()
            else:
                os.unlink(tmp.name, dir_fd=folder_fd)


def _discard_and_let_go(
    handle: sf.SoundFile | None, tmp: Path, folder_fd: int | None, fd: int
) -> None:
    try:
        _discard(handle, tmp, folder_fd, fd)
    finally:
        if folder_fd is not None:
            with contextlib.suppress(OSError):
                os.close(folder_fd)


def _open_folder(folder: Path) -> int | None:
    """A descriptor of ``folder`` (None where folders cannot be opened so)."""
    if os.unlink not in os.supports_dir_fd:
        return None
    try:
        return os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return None


def _folder_moved(folder: Path, folder_fd: int | None) -> bool:
    """Whether ``folder`` is no longer the folder ``folder_fd`` was opened on."""
    if folder_fd is None:
        return False
    try:
        now, then = os.stat(folder), os.fstat(folder_fd)
    except OSError:
        return True
    return (now.st_dev, now.st_ino) != (then.st_dev, then.st_ino)


def _mp3_stream_bytes(path: Path) -> int | None:
    """The stream size LAME records in the Xing/Info frame at the start of an MP3, if any."""
    with open(path, "rb") as fh:
        head = fh.read(256)
    for tag in (b"Xing", b"Info"):
        i = head.find(tag)
        if i < 0 or len(head) < i + 16:
            continue
        (flags,) = struct.unpack(">I", head[i + 4 : i + 8])
        if flags & 2:  # the byte count follows the frame count when flag 1 is set
            at = i + 12 if flags & 1 else i + 8
            return struct.unpack(">I", head[at : at + 4])[0]
    return None


def _frames_in(path: Path) -> int:
    # Opened here: soundfile encodes a path name as UTF-8, which a name that is not fails.
    with open(path, "rb") as f:
        return sf.info(f).frames


def _complete(tmp: Path, fmt: str, frames: int, pending: int = 0) -> bool:
    """Whether ``tmp`` (format ``fmt``) holds all ``frames`` (or ``frames + pending``: a
    chunk whose write an interrupt may have cut from its count)."""
    if fmt == "MP3":  # the frame count is in a header written at the end; mpg123 would
        # also print a warning on stderr when opening a cut-short file
        expected = _mp3_stream_bytes(tmp)
        return expected is None or expected == tmp.stat().st_size
    if fmt in ("WAV", "FLAC", "AIFF", "CAF"):
        return _frames_in(tmp) in (frames, frames + pending)
    return _frames_in(tmp) >= frames  # lossy: a truncated stream has fewer; more is padding


def _keep_mode(fd: int, target: Path) -> None:
    """Give the temp file ``fd`` the mode of the ``target`` it replaces (a private 0600
    stays private). Only now, just before the rename: a write-only mode (0200) copied
    earlier would keep the checks above from reading it back."""
    with contextlib.suppress(OSError):
        os.fchmod(fd, stat.S_IMODE(os.stat(target).st_mode))


LOW_SPACE_BYTES = 1 << 20


_NO_SPACE = "no space left on the device; free some space or write elsewhere"


def _disk_full(directory: Path) -> bool:
    try:
        return shutil.disk_usage(directory).free < LOW_SPACE_BYTES
    except OSError:
        return False


# OS errors that say what is wrong and what helps, whichever format was being written.
_NAMED_ERRORS = {
    errno.ENOSPC: _NO_SPACE,
    errno.EFBIG: "the file size limit was reached (ulimit -f, or the largest file the file "
    "system holds); raise the limit or write elsewhere",
    errno.EROFS: "the file system is read-only; write elsewhere",
}
if hasattr(errno, "EDQUOT"):  # (not on Windows)
    _NAMED_ERRORS[errno.EDQUOT] = "disk quota exceeded; free some space or write elsewhere"
_PERMISSION_ERRORS = (errno.EACCES, errno.EPERM)


def _failure(
    error: BaseException,
    directory: Path,
    fd: int | None = None,
    handle: sf.SoundFile | None = None,
) -> str:
    """Why a write into ``directory`` failed, in words, and what helps.

    libsndfile reports any OS error as "System error." (or, failing mid-setup, as some
    encoder's trouble), so the OS error is looked for: in ``error`` itself, in what
    libsndfile kept of it on ``handle``, or by writing to ``fd`` again.
    """
    code = _os_error(error, fd, handle)
    if code in _NAMED_ERRORS:
        return _NAMED_ERRORS[code]
    if _disk_full(directory):  # a 1-byte probe can still fit in a full disk's last block
        return _NO_SPACE
    if code is not None:  # its words alone: an OSError's text names the hidden temp file
        if code in _PERMISSION_ERRORS:
            return f"{os.strerror(code)}; check the permissions of the file and its folder"
        return f"{one_line(os.strerror(code))}; check free space and permissions"
    return f"{one_line(str(error), 200) or type(error).__name__}; check free space and permissions"


def _os_error(error: BaseException, fd: int | None, handle: sf.SoundFile | None) -> int | None:
    """The errno behind ``error``, if it can be found (see :func:`_failure`)."""
    if isinstance(error, OSError) and error.errno:
        return error.errno
    code = _libsndfile_errno(handle)
    if code is None and fd is not None:
        code = _probe_write(fd)
    return code


def _libsndfile_errno(handle: sf.SoundFile | None) -> int | None:
    """The OS error libsndfile noted on ``handle`` ("System error : File too large."),
    matched back to its errno (the text is the C library's strerror, as os.strerror's)."""
    if handle is None or handle.closed:
        return None
    try:  # soundfile's own binding: the exception it raises carries none of this
        text = sf._ffi.string(sf._snd.sf_strerror(handle._file)).decode("utf-8", "replace")
    except Exception:
        return None
    for code in (*_NAMED_ERRORS, *_PERMISSION_ERRORS):
        if os.strerror(code) in text:
            return code
    return None


def _probe_write(fd: int) -> int | None:
    """The errno a write past the end of ``fd`` meets now, if any (used on a temp file that
    failed and is about to be deleted; the byte written is taken back)."""
    pwrite = getattr(os, "pwrite", None)
    if pwrite is None:
        return None
    try:
        size = os.fstat(fd).st_size
        pwrite(fd, b"\0", size)
    except OSError as e:
        return e.errno
    with contextlib.suppress(OSError):
        os.ftruncate(fd, size)
    return None


def _cut_short(fd: int) -> str:
    """Why a file came out short, and what helps (see :func:`_failure`)."""
    return _NAMED_ERRORS.get(
        _probe_write(fd), "the disk may be full; free some space or choose another location"
    )


def _format_refused(error: Exception, directory: Path, fd: int) -> str | None:
    """Why libsndfile refused to open ``fd`` when the format (or its settings) is what it
    refused, else None: an OS error reads "System error." (or is found behind it)."""
    if _os_error(error, fd, None) is not None or _disk_full(directory):
        return None
    text = one_line(str(error), 200)
    return None if "System error" in text else text


class AudioFileWriter:
    """Streams audio chunks into a file that appears atomically when finished.

    Chunks go straight to libsndfile (memory does not grow with length) in a hidden
    temp file in the target's directory (``.<stem>.partial-<pid>-<random><ext>``; one
    that a killed process left is removed by the next writer of that target). Then:

    * ``close()`` / leaving the ``with`` block normally: the temp file is finalised and
      renamed onto the target with :func:`os.replace` (atomic on POSIX).
    * ``abort()`` / ``close(keep=False)`` / an exception in the ``with`` block: the temp
      file is deleted; an existing target is untouched.
    * ``commit_partial()``: for "interrupted, keep what is finished" (Ctrl-C in a long
      chapter): finalise and keep the audio written so far, a valid file.

    WAV and FLAC are 16-bit PCM encoded with :func:`float_to_int16` (so reading the file
    back gives exactly those integers); lossy formats get the float samples clipped to
    [-1, 1]. A file with no audio is refused when kept as a ``.flac``, ``.mp3`` or
    ``.opus``, whose empty files cannot be read back (the other formats can be empty).
    """

    def __init__(
        self, path: str | os.PathLike[str], sample_rate: int, *, channels: int = 1
    ) -> None:
        self.path = Path(path)
        self.sample_rate = int(sample_rate)
        self.channels = int(channels)
        check_output_path(path, self.sample_rate)  # as given: Path() drops a final "/."
        self._target = output_target(self.path)  # through a symbolic link
        ext = _extension(self.path) or _extension(self._target)  # as check_output_path
        fmt, subtype = FORMATS[ext]
        self._ext = ext
        self._format = fmt
        self._pcm16 = subtype == "PCM_16"
        limit = _MAX_SAMPLE_BYTES.get(fmt)
        self.max_frames = None if limit is None else limit // (2 * self.channels)
        self.frames_written = 0
        self._pending = 0  # frames of the chunk being written, until they are counted
        self._closed = False
        self._kept = False
        remove_orphans(self._target.parent, self._target.stem, "partial", ext)
        self._tmp = self._target.parent / owned_name(self._target.stem, "partial", ext)
        try:
            # O_EXCL: never reuse someone else's file; mode 0o666 lets the umask decide.
            fd = os.open(self._tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
        except OSError as e:
            # Its hidden temp name is longer than the target's: a path near the system's
            # limit fits as the target and not as that.
            fix = (
                "choose a shorter path"
                if e.errno == errno.ENAMETOOLONG
                else "choose another location"
            )
            raise AudioOutputError(
                f"cannot create a file in {one_line(repr(str(self._target.parent)), 200)}: "
                f"{creation_failure(e, self._target.parent)}; {fix}"
            ) from e
        hold_lock(fd)  # a run in another PID namespace must not take it for an orphan
        # A private target (0600) keeps its temp file private while it is written; its
        # exact mode (a write-only 0200 too) only once the file is read back (_keep_mode).
        with contextlib.suppress(OSError):
            os.fchmod(fd, stat.S_IMODE(os.stat(self._target).st_mode) | stat.S_IRUSR | stat.S_IWUSR)
        try:
            self._sf: sf.SoundFile | None = sf.SoundFile(
                fd,
                mode="w",
                samplerate=self.sample_rate,
                channels=self.channels,
                format=fmt,
                subtype=subtype,
                # Ours to close: given to own, libsndfile closes it on some failed opens and
                # not on others, and a second close could hit a file another thread opened.
                closefd=False,
            )
        except Exception as e:
            # Asked while the temp file is still there: writing the header may have failed.
            try:
                refused = _format_refused(e, self._target.parent, fd)
                why = None if refused else _failure(e, self._target.parent, fd)
            finally:  # (a Ctrl-C meanwhile must not leave the temp file either)
                _discard(None, self._tmp, fd=fd)
            if why is not None:
                raise AudioOutputError(f"cannot write {str(self.path)!r}: {why}") from e
            raise AudioOutputError(
                f"cannot open {str(self.path)!r} for {fmt}/{subtype} at {self.sample_rate} Hz: "
                f"{refused}; choose another format"
            ) from e
        self._fd: int | None = fd
        # Kept to delete the temp file even if its folder is moved or renamed meanwhile.
        self._folder_fd = _open_folder(self._target.parent)
        # Deletes the temp file if the writer is dropped without close() (or at exit).
        self._finalizer = weakref.finalize(
            self, _discard_and_let_go, self._sf, self._tmp, self._folder_fd, fd
        )

    @property
    def temp_path(self) -> Path:
        return self._tmp

    @property
    def duration_s(self) -> float:
        return self.frames_written / self.sample_rate

    @property
    def closed(self) -> bool:
        return self._closed

    def write(self, chunk: np.ndarray) -> None:
        """Append samples (float, nominally in [-1, 1]; clipped before encoding)."""
        if self._closed or self._sf is None:
            raise AudioOutputError(f"write to {str(self.path)!r} after it was closed")
        a = _as_mono_float(chunk, self.channels)
        if a.shape[0] == 0:
            return
        if self.max_frames is not None and self.frames_written + a.shape[0] > self.max_frames:
            # Beyond it the header's sizes would wrap around: refused, what is written stays
            # a valid file (commit_partial() keeps it).
            hours = self.max_frames / self.sample_rate / 3600
            raise AudioFileFullError(
                f"{str(self.path)!r} is full: a {self._format} file holds at most "
                f"{hours:.1f} hours of audio at {self.sample_rate} Hz",
                "write .flac or .caf for longer audio",
            )
        data = float_to_int16(a) if self._pcm16 else float_to_unit(a)
        # Ctrl-C lands between bytecodes: right after libsndfile's write, before the count.
        # The close-time check then accepts the file with or without that chunk.
        self._pending = a.shape[0]
        try:
            self._sf.write(data)
        except Exception as e:
            try:
                why = _failure(e, self._target.parent, self._fd, self._sf)  # before it is gone
            finally:
                self.abort()
            raise AudioOutputError(f"writing {str(self.path)!r} failed: {why}") from e
        self.frames_written += a.shape[0]
        self._pending = 0

    def close(self, *, keep: bool = True) -> Path | None:
        """Finish the file: keep=True moves it onto the target, keep=False deletes it.

        Returns the target path when kept. A second call does nothing (and returns the
        same).
        """
        if self._closed:
            return self.path if self._kept else None
        self._closed = True
        handle, self._sf = self._sf, None
        folder_fd, self._folder_fd = self._folder_fd, None
        data_fd, self._fd = self._fd, None
        try:
            self._finish(handle, keep, folder_fd, data_fd)
        finally:
            if folder_fd is not None:
                os.close(folder_fd)
        return self.path if self._kept else None

    def _finish(
        self, handle: sf.SoundFile | None, keep: bool, folder_fd: int | None, data_fd: int | None
    ) -> None:
        try:
            self._finalizer.detach()
            if not keep:
                _discard(handle, self._tmp, folder_fd, data_fd)
                return
            assert handle is not None and data_fd is not None
            if self.frames_written == 0 and self._ext in _NO_EMPTY_FILES:
                with contextlib.suppress(Exception):
                    handle.close()  # the temp file and its descriptor go below
                raise AudioOutputError(
                    f"{str(self.path)!r} was not written: there is no audio for it, and an "
                    f"empty {self._ext} file cannot be read back (a .wav can be empty)"
                )
            handle.close()
            if self._format == "OGG":  # the same audio, the same bytes (see audio.ogg)
                renumber_file(self._tmp)
            if self.frames_written and not _complete(
                self._tmp, self._format, self.frames_written, self._pending
            ):
                # libsndfile ignores write errors while it finalises a file (the last FLAC
                # frame, the Ogg and MP3 encoder flush): the file must be checked, not trusted
                raise AudioOutputError(
                    f"finishing {str(self.path)!r} failed: the file was cut short: "
                    f"{_cut_short(data_fd)}"
                )
            full_fsync(data_fd)  # the rename must not land before the data after a crash
            _keep_mode(data_fd, self._target)
            os.replace(self._tmp, self._target)
        except AudioOutputError:
            _discard(None, self._tmp, folder_fd, data_fd)
            raise
        except Exception as e:
            try:
                if _folder_moved(self._target.parent, folder_fd):
                    why = (
                        "its folder was moved or deleted while it was being written; write it again"
                    )
                else:
                    why = _failure(e, self._target.parent, data_fd)
            finally:  # (a Ctrl-C meanwhile must not leave the temp file either)
                _discard(None, self._tmp, folder_fd, data_fd)
            raise AudioOutputError(f"finishing {str(self.path)!r} failed: {why}") from e
        except BaseException:  # a second Ctrl-C while finishing: no temp file stays behind
            _discard(handle, self._tmp, folder_fd, data_fd)
            raise
        with contextlib.suppress(OSError):  # (its data is on the disk already)
            os.close(data_fd)  # only now: its lock marked the temp file as in use until here
        self._kept = True

    def abort(self) -> None:
        """Delete the temp file; an existing target is left as it was."""
        self.close(keep=False)

    def commit_partial(self) -> bool:
        """Keep what was written so far as a valid file (for interrupted runs).

        Returns True if a file was written; with no audio yet nothing is written and an
        existing target is left alone.
        """
        if self.frames_written == 0:
            self.abort()
            return False
        return self.close(keep=True) is not None

    def __enter__(self) -> AudioFileWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(keep=exc_type is None)


def write_audio(path: str | os.PathLike[str], audio: np.ndarray, sample_rate: int) -> Path:
    """Write a whole signal at once (atomically, like :class:`AudioFileWriter`)."""
    a = np.asarray(audio)
    channels = 1 if a.ndim == 1 else a.shape[1]
    with AudioFileWriter(path, sample_rate, channels=channels) as w:
        w.write(a)
    return w.path


def wav_header(sample_rate: int, channels: int = 1, data_bytes: int | None = None) -> bytes:
    """A 44-byte PCM16 WAV header; ``data_bytes=None`` writes the unknown-length sizes."""
    if data_bytes is None or data_bytes > _WAV_UNKNOWN_SIZE - 36:
        riff_size = data_size = _WAV_UNKNOWN_SIZE
    else:
        riff_size, data_size = 36 + data_bytes, data_bytes
    block_align = 2 * channels
    return (
        b"RIFF"
        + struct.pack("<I", riff_size)
        + b"WAVEfmt "
        + struct.pack(
            "<IHHIIHH", 16, 1, channels, sample_rate, sample_rate * block_align, block_align, 16
        )
        + b"data"
        + struct.pack("<I", data_size)
    )


def write_stream(stream: BinaryIO, data: bytes) -> None:
    """Write all of ``data`` to ``stream`` and flush it (for stdout: pipes, files, ttys).

    :class:`BrokenPipeError` propagates (the reader went away: not an error of ours); any
    other failure, such as a full disk, becomes a one-line :class:`AudioOutputError`.
    """
    view = memoryview(data)
    try:
        while view:  # raw (unbuffered) streams may write only part
            n = stream.write(view)
            if n is None:  # a non-blocking stream with no room yet
                time.sleep(0.001)
                continue
            view = view[n:]
        flush = getattr(stream, "flush", None)
        if flush is not None:
            flush()
    except BrokenPipeError:
        raise
    except OSError as e:
        name = getattr(stream, "name", None)
        where = "stdout" if name in (1, "<stdout>") else "the output stream"
        raise AudioOutputError(
            f"writing audio to {where} failed: {e.strerror or e}; "
            "check free space or write to a file with -o FILE"
        ) from None


def _appends(stream: BinaryIO) -> bool:
    """True for a stream opened with O_APPEND (``>>``): every write lands at the end, so
    seeking back to patch a header would corrupt it instead."""
    try:
        import fcntl

        return bool(fcntl.fcntl(stream.fileno(), fcntl.F_GETFL) & os.O_APPEND)
    except (ImportError, AttributeError, OSError, ValueError):
        return False


class WavStreamWriter:
    """PCM16 WAV onto a binary stream (e.g. ``sys.stdout.buffer``) of unknown total length.

    The header goes out at once with both size fields 0xFFFFFFFF, the convention for
    "length unknown" on pipes; chunks follow as they arrive, flushed so a consumer
    (``| aplay``, ``| ffmpeg``) hears them promptly. If the stream is seekable (stdout
    redirected to a file, not in append mode) the real sizes are patched in at :meth:`close`.

    libsndfile (and so soundfile) reads such a stream: it notes that the declared sizes
    exceed the file and uses the bytes actually present; Python's :mod:`wave` does too.
    The stream itself is flushed but not closed.
    """

    def __init__(self, stream: BinaryIO, sample_rate: int, *, channels: int = 1) -> None:
        self.stream = stream
        self.sample_rate = int(sample_rate)
        self.channels = int(channels)
        self.data_bytes = 0
        self._closed = False
        self._start: int | None = None
        try:
            if stream.seekable() and not _appends(stream):
                self._start = stream.tell()
        except (AttributeError, OSError, ValueError):
            self._start = None
        write_stream(self.stream, wav_header(self.sample_rate, self.channels))

    @property
    def seekable(self) -> bool:
        return self._start is not None

    @property
    def frames_written(self) -> int:
        return self.data_bytes // (2 * self.channels)

    def write(self, chunk: np.ndarray) -> None:
        if self._closed:
            raise AudioOutputError("write to a WAV stream after it was closed")
        a = _as_mono_float(chunk, self.channels)
        if a.shape[0] == 0:
            return
        data = float_to_pcm16(a)
        write_stream(self.stream, data)
        self.data_bytes += len(data)

    def close(self) -> None:
        """Patch the sizes if the stream is seekable, then flush. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._start is None:
            return
        try:
            end = self.stream.tell()
            # Where the stream is, not what was counted: a failed write (a full disk) may
            # have put part of its chunk there, which the header must not leave out (whole
            # sample frames only: a cut sample is no audio).
            frame = 2 * self.channels
            present = (end - self._start - 44) // frame * frame
            self.data_bytes = max(self.data_bytes, present)
            header = wav_header(self.sample_rate, self.channels, self.data_bytes)
            self.stream.seek(self._start + 4)
            self.stream.write(header[4:8])
            self.stream.seek(self._start + 40)
            self.stream.write(header[40:44])
            self.stream.seek(end)
            self.stream.flush()
        except (OSError, ValueError):
            pass  # seekable() lied (e.g. some character devices): unknown sizes stay

    def __enter__(self) -> WavStreamWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
