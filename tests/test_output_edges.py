"""Audio files at the edges of the file system: what the final rename cannot do, other
runs' leftovers, OS errors named for what they are, paths that name a directory."""

from __future__ import annotations

import errno
import io
import os
import shutil
import stat
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from voxtral_mlx.audio import io as aio
from voxtral_mlx.audio.io import AudioFileWriter, WavStreamWriter, check_output_path, write_audio
from voxtral_mlx.errors import AudioOutputError
from voxtral_mlx.output_dir import staged_dir

REPO = Path(__file__).resolve().parents[1]
SR = 24000
FRAME = 1920
# Root may read and rename anything: dropped, these let it meet the permissions a user does.
_NO_OVERRIDES = "-fowner,-dac_override,-dac_read_search"


def hidden(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def run_as_a_user(code: str, *args: str) -> subprocess.CompletedProcess:
    """Run Python ``code`` with the permissions of an ordinary user: as such a user, or as
    root without the capabilities that let it ignore them (skipped where that cannot be)."""
    prefix: list[str] = []
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv to drop its overrides")
        prefix = [setpriv, f"--bounding-set={_NO_OVERRIDES}"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [*prefix, sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


_WRITE = """
import sys
import numpy as np
from voxtral_mlx.audio.io import write_audio
from voxtral_mlx.errors import AudioOutputError
try:
    write_audio(sys.argv[1], np.zeros(1920, np.float32), 24000)
except AudioOutputError as e:
    print(e)
    sys.exit(3)
"""


# -- 1: what the final rename could not do is refused before any generation --------


def test_another_users_file_in_a_sticky_folder_is_refused_up_front(tmp_path, monkeypatch):
    """In /tmp a rename onto another user's file fails (EPERM) whatever the file's mode:
    found at the end, it lost the whole synthesis."""
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(0o1777)
    target = folder / "x.wav"
    target.write_bytes(b"old")
    target.chmod(0o666)
    check_output_path(target)  # this user's own file (and folder): replaced as usual
    monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 4242)  # someone else
    real_access = os.access
    # Not writable by this user either (root's own access() would say it is).
    monkeypatch.setattr(os, "access", lambda p, m: real_access(p, m) and Path(p) != target)
    for mode in (0o666, 0o644):  # 0644 said "make it writable (chmod u+w)": not theirs to do
        target.chmod(mode)
        with pytest.raises(AudioOutputError) as e:
            check_output_path(target)
        message = str(e.value)
        assert "another user's, in a sticky folder" in message and "choose another name" in message
        assert "\n" not in message
    monkeypatch.setattr(os, "access", real_access)
    target.chmod(0o666)
    check_output_path(folder / "new.wav")  # a new name is theirs to create
    folder.chmod(0o777)
    check_output_path(target)  # without the sticky bit the rename may replace it


@pytest.mark.skipif(os.name != "posix" or os.geteuid() != 0, reason="needs another user's file")
def test_another_users_file_in_a_sticky_folder_for_real(tmp_path):
    folder = tmp_path / "sticky"
    folder.mkdir()
    tmp_path.chmod(0o755)
    target = folder / "x.wav"
    target.write_bytes(b"old")
    target.chmod(0o666)
    os.chown(folder, 65534, 65534)  # nobody's, like /tmp is root's
    os.chown(target, 65534, 65534)
    folder.chmod(0o1777)
    proc = run_as_a_user(_WRITE, str(target))
    assert proc.returncode == 3, (proc.stdout, proc.stderr)
    assert "another user's, in a sticky folder" in proc.stdout
    assert target.read_bytes() == b"old" and hidden(folder) == []


@pytest.mark.skipif(os.name != "posix", reason="POSIX permissions")
def test_a_write_only_file_is_replaced_and_keeps_its_mode(tmp_path):
    """Its mode (0200) went onto the temp file at once, which then could not be read back
    to check it: EACCES at the end, with the temp file's name."""
    target = tmp_path / "wo.wav"
    target.write_bytes(b"old")
    target.chmod(0o200)
    proc = run_as_a_user(_WRITE, str(target))
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert stat.S_IMODE(target.stat().st_mode) == 0o200
    target.chmod(0o600)
    assert sf.info(str(target)).frames == FRAME and hidden(tmp_path) == []


def test_a_failed_rename_names_neither_the_temp_file_nor_an_errno(tmp_path, monkeypatch):
    target = tmp_path / "x.wav"
    w = AudioFileWriter(target, SR)
    w.write(np.zeros(FRAME, np.float32))

    def refused(src, dst):
        raise PermissionError(errno.EPERM, "Operation not permitted", str(src), str(dst))

    monkeypatch.setattr(aio.os, "replace", refused)
    with pytest.raises(AudioOutputError) as e:
        w.close()
    message = str(e.value)
    assert message.endswith(
        "Operation not permitted; check the permissions of the file and its folder"
    )
    assert ".partial-" not in message and "Errno" not in message
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("where", ["open", "finish"])
def test_an_interrupt_while_a_failure_is_explained_leaves_no_temp_file(
    tmp_path, monkeypatch, where
):
    """The failure is looked into before the temp file goes (it may tell why): a Ctrl-C
    meanwhile left the temp file and its descriptor behind."""

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(aio, "_failure", interrupted)
    monkeypatch.setattr(aio, "_format_refused", lambda *a: None)
    if where == "open":
        monkeypatch.setattr(aio.sf, "SoundFile", lambda *a, **k: (_ for _ in ()).throw(OSError()))
        with pytest.raises(KeyboardInterrupt):
            AudioFileWriter(tmp_path / "x.wav", SR)
    else:
        w = AudioFileWriter(tmp_path / "x.wav", SR)
        w.write(np.zeros(FRAME, np.float32))
        monkeypatch.setattr(aio.os, "replace", lambda *a: (_ for _ in ()).throw(OSError()))
        with pytest.raises(KeyboardInterrupt):
            w.close()
    assert list(tmp_path.iterdir()) == []


# -- 2: a live run's temp file is not another run's orphan -------------------------


def _dead_pid() -> int:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    return dead.pid


def _lock(path: Path) -> int:
    """An open descriptor holding the writer's lock on ``path``, as a run in another PID
    namespace (whose PID looks dead here) holds it."""
    fcntl = pytest.importorskip("fcntl")
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def _locked_by_someone(path: Path) -> bool:
    fcntl = pytest.importorskip("fcntl")
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def locks_seen_at_rename(monkeypatch) -> list[bool]:
    """Whether each file ``os.replace`` moves into place is still locked as it does."""
    seen: list[bool] = []
    real_replace = os.replace

    def replace(src, dst):
        seen.append(_locked_by_someone(Path(src)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    return seen


def test_a_locked_temp_file_of_a_pid_not_seen_here_is_left_alone(tmp_path):
    pid = _dead_pid()
    live, dead = (
        tmp_path / f".x.partial-{pid}-0123abcd.wav",
        tmp_path / f".x.partial-{pid}-4567abcd.wav",
    )
    live.write_bytes(b"RIFF")
    dead.write_bytes(b"RIFF")
    fd = _lock(live)
    try:
        write_audio(tmp_path / "x.wav", np.zeros(FRAME, np.float32), SR)
    finally:
        os.close(fd)
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name, "x.wav"]


def test_the_writer_holds_its_lock_until_the_file_is_in_place(tmp_path, monkeypatch):
    w = AudioFileWriter(tmp_path / "x.wav", SR)
    w.write(np.zeros(FRAME, np.float32))
    assert _locked_by_someone(w.temp_path)
    seen = locks_seen_at_rename(monkeypatch)
    w.close()
    assert seen == [True]
    assert not _locked_by_someone(tmp_path / "x.wav")  # let go once it is in place


def test_atomic_write_holds_its_lock_until_the_rename(tmp_path, monkeypatch):
    """The writer's close let go of the lock before the rename: a cache file could be
    taken for an orphan in between."""
    from voxtral_mlx import fileio

    seen = locks_seen_at_rename(monkeypatch)
    fileio.atomic_write(tmp_path / "cache.bin", lambda f: f.write(b"data"))
    assert seen == [True] and (tmp_path / "cache.bin").read_bytes() == b"data"
    assert not _locked_by_someone(tmp_path / "cache.bin")


def test_atomic_write_out_of_descriptors_leaves_no_temp_file(tmp_path, monkeypatch):
    from voxtral_mlx import fileio

    def no_more(fd):
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(fileio.os, "dup", no_more)
    with pytest.raises(OSError, match="Too many open files"):
        fileio.atomic_write(tmp_path / "cache.bin", lambda f: f.write(b"data"))
    assert list(tmp_path.iterdir()) == []


def test_a_lock_briefly_held_by_another_runs_check_is_still_taken(tmp_path):
    """Another run's orphan check takes a shared lock for a moment: a writer asking just
    then went without its lock for the whole run."""
    import threading

    from voxtral_mlx.fileio import hold_lock

    fcntl = pytest.importorskip("fcntl")
    path = tmp_path / ".x.partial-1-0123abcd.wav"
    path.write_bytes(b"")
    checker = os.open(path, os.O_RDONLY)
    fcntl.flock(checker, fcntl.LOCK_SH | fcntl.LOCK_NB)
    let_go = threading.Timer(0.003, os.close, [checker])
    let_go.start()
    fd = os.open(path, os.O_WRONLY)
    try:
        hold_lock(fd)
        let_go.join()  # the check is over: only the writer's own lock can be seen now
        assert _locked_by_someone(path)
    finally:
        os.close(fd)


def test_a_locked_staging_folder_of_a_pid_not_seen_here_is_left_alone(tmp_path):
    out = tmp_path / "model"
    live = tmp_path / f".model.partial-{_dead_pid()}-0123abcd"
    live.mkdir()
    fd = _lock(live)
    try:
        with staged_dir(out) as tmp:
            assert _locked_by_someone(tmp)  # this run's, too
            (tmp / "config.json").write_text("{}")
    finally:
        os.close(fd)
    assert live.is_dir() and (out / "config.json").is_file()
    assert not _locked_by_someone(out)


def test_a_locked_voice_staging_folder_of_a_pid_not_seen_here_is_left_alone(tmp_path, monkeypatch):
    """convert-voices' staging folder was judged by its PID alone."""
    from voxtral_mlx import voices
    from voxtral_mlx.torch_pickle import write_pt

    src = tmp_path / "casual_male.pt"
    write_pt(src, np.ones((3, 8), np.float32))
    out = tmp_path / "out"
    out.mkdir()
    live = out / f".voices.partial-{_dead_pid()}-0123abcd"
    live.mkdir()
    fd = _lock(live)
    seen = []
    real = voices._write_safetensors

    def spy(path, tensor):
        seen.append(_locked_by_someone(path.parent))  # this run's stage, while it is written
        real(path, tensor)

    monkeypatch.setattr(voices, "_write_safetensors", spy)
    try:
        assert voices.convert_voice_files([src], out) == [out / "casual_male.safetensors"]
    finally:
        os.close(fd)
    assert live.is_dir() and seen == [True]


# -- 3: OS errors other than a full disk are named, with their own fix -------------

_LIMITED = """
import resource, sys
import numpy as np
from voxtral_mlx.audio.io import AudioFileWriter
from voxtral_mlx.errors import AudioOutputError
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), resource.RLIM_INFINITY))
try:
    with AudioFileWriter(sys.argv[1], 24000) as w:
        for _ in range(10):
            w.write(np.random.default_rng(0).uniform(-0.5, 0.5, 4800).astype(np.float32))
except AudioOutputError as e:
    print(e)
    sys.exit(3)
"""


@pytest.mark.parametrize(
    ("ext", "limit"), [(".wav", 10), (".flac", 10), (".ogg", 10), (".wav", 30000), (".flac", 30000)]
)
def test_a_file_size_limit_is_named_as_such(tmp_path, ext, limit):
    """libsndfile said "System error.", "problem with initialization of the flac decoder"
    or (opening) "choose another format"."""
    pytest.importorskip("resource")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = [sys.executable, "-c", _LIMITED, str(tmp_path / f"x{ext}"), str(limit)]
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 3, (proc.stdout, proc.stderr)
    assert "the file size limit was reached (ulimit -f" in proc.stdout
    assert "format" not in proc.stdout and proc.stdout.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("code", "words"),
    [
        (errno.ENOSPC, "no space left on the device; free some space"),
        (getattr(errno, "EDQUOT", errno.ENOSPC), "quota exceeded; free some space"),
        (errno.EFBIG, "file size limit was reached"),
        (errno.EROFS, "read-only; write elsewhere"),
    ],
)
def test_os_errors_are_named_with_their_fix(tmp_path, code, words):
    error = OSError(code, os.strerror(code), str(tmp_path / ".x.partial-1-0123abcd.wav"))
    message = aio._failure(error, tmp_path)
    assert words in message and "Errno" not in message and ".partial-" not in message


# -- 4: a read-only file system is said to be one ----------------------------------


@pytest.mark.skipif(not hasattr(os, "ST_RDONLY"), reason="no statvfs flags")
@pytest.mark.parametrize("exists", [False, True])
def test_a_read_only_file_system_is_named_as_such(tmp_path, monkeypatch, exists):
    """Its folder read as "not writable ... fix its permissions", its files as "make it
    writable (chmod u+w)": neither can help."""
    target = tmp_path / "x.wav"
    if exists:
        target.write_bytes(b"old")
    real_statvfs, real_access = os.statvfs, os.access

    def statvfs(path):
        result = real_statvfs(path)
        if Path(path) != tmp_path:
            return result
        fields = list(result)
        fields[8] |= os.ST_RDONLY  # f_flag
        return os.statvfs_result(fields)

    monkeypatch.setattr(os, "statvfs", statvfs)
    # As the OS says on one: no writing there (root included).
    monkeypatch.setattr(
        os,
        "access",
        lambda p, m, **kw: (
            False
            if m & os.W_OK and tmp_path in (Path(p), Path(p).parent)
            else real_access(p, m, **kw)
        ),
    )
    with pytest.raises(AudioOutputError) as e:
        check_output_path(target)
    message = str(e.value)
    assert message.endswith("is on a read-only file system; write elsewhere")
    assert "chmod" not in message and "permissions" not in message


# -- 5: a path ending in . or .. names a directory ---------------------------------


@pytest.mark.parametrize("ending", ["/.", "/.."])
def test_a_path_ending_in_a_dot_names_a_directory(tmp_path, ending):
    """pathlib drops a final "/.", so `-o new.wav/.` wrote new.wav."""
    given = f"{tmp_path}/new.wav{ending}"
    with pytest.raises(AudioOutputError, match=r"ends with '\.\.?', so it names a directory") as e:
        check_output_path(given)
    assert "\n" not in str(e.value)
    with pytest.raises(AudioOutputError):
        AudioFileWriter(given, SR)
    assert list(tmp_path.iterdir()) == []


# -- 6: a working folder deleted meanwhile ------------------------------------------


@pytest.mark.skipif(sys.platform == "win32", reason="a folder in use cannot be deleted there")
def test_a_deleted_working_folder_is_named_as_such(tmp_path, monkeypatch):
    """It was "it takes no new files (a system folder?)"."""
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    with pytest.raises(AudioOutputError, match=r"it has been deleted \(cd to an existing folder\)"):
        AudioFileWriter("x.wav", SR)


# -- 7: a stream that failed midway gets a header counting what it holds -----------


class LimitedFile(io.BytesIO):
    """A seekable stream (stdout redirected to a file) on which writes past ``limit``
    bytes fail after writing what fits, as with a full disk or a file size limit."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def write(self, data) -> int:
        room = self.limit - self.tell()
        if len(data) > room:
            super().write(bytes(data)[: max(room, 0)])
            raise OSError(errno.EFBIG, "File too large")
        return super().write(data)


def test_a_failed_write_to_a_seekable_stream_leaves_a_header_counting_all_it_holds():
    stream = LimitedFile(44 + 3 * 2 * FRAME + 1001)  # the last sample cut in half
    w = WavStreamWriter(stream, SR)
    with pytest.raises(AudioOutputError, match="File too large"):
        for _ in range(5):
            w.write(np.full(FRAME, 0.25, np.float32))
    w.close()
    data = stream.getvalue()
    assert len(data) - 44 == 3 * 2 * FRAME + 1001
    assert struct.unpack("<I", data[40:44])[0] == 3 * 2 * FRAME + 1000  # whole samples
    assert struct.unpack("<I", data[4:8])[0] == 36 + 3 * 2 * FRAME + 1000
    audio, _ = sf.read(io.BytesIO(data), dtype="int16")
    assert len(audio) == 3 * FRAME + 500
