"""Audio files (atomic, every format round-trips) and the streaming WAV writer."""

from __future__ import annotations

import gc
import io
import os
import shutil
import stat
import struct
import subprocess
import sys
import threading
import wave
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from voxtral_mlx.audio import io as aio
from voxtral_mlx.audio.io import (
    FORMATS,
    AudioFileWriter,
    WavStreamWriter,
    check_output_path,
    float_to_int16,
    float_to_pcm16,
    write_audio,
)
from voxtral_mlx.errors import AudioFileFullError, AudioOutputError

SR = 24000
FRAME = 1920


def speechlike(seconds: float = 1.5, seed: int = 0) -> np.ndarray:
    """A few harmonics with a slow envelope plus a little noise, within [-0.8, 0.8]."""
    t = np.arange(int(seconds * SR)) / SR
    rng = np.random.default_rng(seed)
    f0 = 140 + 20 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / SR
    x = sum(np.sin(k * phase) / k for k in range(1, 6))
    x = x * (0.5 + 0.5 * np.sin(2 * np.pi * 1.3 * t) ** 2) + 0.01 * rng.standard_normal(t.size)
    return (0.8 * x / np.abs(x).max()).astype(np.float32)


def chunks(x: np.ndarray, size: int = FRAME):
    for i in range(0, x.size, size):
        yield x[i : i + size]


def aligned_correlation(x: np.ndarray, y: np.ndarray, max_lag: int = 2400) -> float:
    """Correlation of x and y after shifting y by the best lag (codecs add delay)."""
    n = min(x.size, y.size)
    fx, fy = np.fft.rfft(x[:n], 2 * n), np.fft.rfft(y[:n], 2 * n)
    xc = np.fft.irfft(fy * np.conj(fx), 2 * n)
    lags = np.arange(-max_lag, max_lag + 1)
    lag = int(lags[np.argmax(xc[lags % (2 * n)])])
    a = x[max(0, -lag) : n - max(0, lag)]
    b = y[max(0, lag) : n - max(0, -lag)]
    return float(np.corrcoef(a, b)[0, 1])


def hidden_leftovers(directory: Path) -> list[str]:
    return [p.name for p in directory.iterdir() if p.name.startswith(".")]


# -- float_to_pcm16 ----------------------------------------------------------------


def test_float_to_int16_convention():
    x = np.array([0.0, 1.0, -1.0, 2.0, -3.0, 0.5, -0.5, np.inf, -np.inf, np.nan], np.float32)
    expected = [0, 32767, -32768, 32767, -32768, 16384, -16384, 32767, -32768, 0]
    assert float_to_int16(x).tolist() == expected
    # rounding: to nearest, ties to even
    half = np.array([0.5, 1.5, 2.5, -0.5, -1.5, 0.4, 0.6], np.float32) / 32768
    assert float_to_int16(half).tolist() == [0, 2, 2, 0, -2, 0, 1]


def test_float_to_int16_inverts_the_usual_reading():
    k = np.arange(-32768, 32768, dtype=np.int32).astype(np.int16)
    assert np.array_equal(float_to_int16(k.astype(np.float32) / 32768), k)


def test_float_to_pcm16_bytes_are_little_endian():
    b = float_to_pcm16(np.array([1 / 32768, -2 / 32768, 0.25], np.float32))
    assert b == struct.pack("<3h", 1, -2, 8192)
    assert float_to_pcm16(np.zeros(0, np.float32)) == b""


# -- formats ------------------------------------------------------------------------


def test_lossless_formats_include_the_ones_macos_say_writes():
    assert {".wav", ".flac", ".aiff", ".aif", ".caf"} <= aio.LOSSLESS_EXTENSIONS


def test_this_libsndfile_writes_every_format():
    # Everything in FORMATS is expected from the soundfile wheels this project uses
    # (libsndfile >= 1.1); a missing one would show up as a clear AudioOutputError.
    assert set(aio.available_formats()) == set(FORMATS)


@pytest.mark.parametrize("ext", sorted(aio.LOSSLESS_EXTENSIONS))
def test_lossless_round_trip_is_exact_to_16_bits(tmp_path, ext):
    x = speechlike()
    x[100] = 1.7  # out of range: clipped, not wrapped
    x[101] = -1.7
    path = tmp_path / f"out{ext}"
    with AudioFileWriter(path, SR) as w:
        for c in chunks(x):
            w.write(c)
    info = sf.info(path)
    assert (info.samplerate, info.channels, info.subtype) == (SR, 1, "PCM_16")
    y, sr = sf.read(path, dtype="int16")
    assert sr == SR
    assert np.array_equal(y, float_to_int16(x))
    assert y[100] == 32767 and y[101] == -32768


@pytest.mark.parametrize("ext", [".ogg", ".mp3", ".opus"])
def test_lossy_round_trip_keeps_duration_and_shape(tmp_path, ext):
    x = speechlike()
    path = tmp_path / f"out{ext}"
    with AudioFileWriter(path, SR) as w:
        for c in chunks(x):
            w.write(c)
    y, sr = sf.read(path, dtype="float32")
    assert sr == SR
    assert abs(y.size - x.size) <= 0.05 * SR  # encoder delay/padding at most
    assert aligned_correlation(x, y) > 0.98


def test_write_audio_one_shot(tmp_path):
    x = speechlike(0.3)
    out = write_audio(tmp_path / "one.flac", x, SR)
    assert out == tmp_path / "one.flac"
    y, _ = sf.read(out, dtype="int16")
    assert np.array_equal(y, float_to_int16(x))
    assert hidden_leftovers(tmp_path) == []


@pytest.mark.parametrize("stem", ["a" * 250, "é" * 125])  # 250 and 250 bytes + ".wav"
def test_a_name_at_the_file_system_limit_is_writable(tmp_path, stem):
    """The hidden temporary name adds ".…partial-XXXXXXXX"; it must not push a legal target
    name past the 255-byte limit."""
    path = tmp_path / f"{stem}.wav"
    audio = np.linspace(-0.5, 0.5, FRAME, dtype=np.float32)
    with AudioFileWriter(path, SR) as w:
        w.write(audio)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    assert sf.info(str(path)).frames == FRAME


def test_a_killed_writers_temp_file_is_removed_by_the_next_writer(tmp_path):
    """Only files named for this target and format by a process that no longer runs go."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = f".x.partial-{dead.pid}-0123abcd.wav"
    kept = [
        f".x.partial-{os.getpid()}-0123abcd.wav",  # this process: perhaps another writer's
        ".x.partial-1-0123abcd.wav",  # a running process (init)
        f".y.partial-{dead.pid}-0123abcd.wav",  # another target
        f".x.partial-{dead.pid}-0123abcd.flac",  # another format
        f".x.partial-{dead.pid}-notmine.wav",
        f"x.partial-{dead.pid}-0123abcd.wav",  # not hidden
    ]
    for name in [orphan, *kept]:
        (tmp_path / name).write_bytes(b"RIFF")
    with AudioFileWriter(tmp_path / "x.wav", SR) as w:
        w.write(np.zeros(FRAME, np.float32))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*kept, "x.wav"])


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
def test_a_link_to_a_pipe_is_refused_in_one_line(tmp_path):
    """/dev/stdout piped elsewhere: /proc/self/fd/1 leads to "pipe:[N]", which no path
    names; it read as a missing file with no extension."""
    read, write = os.pipe()
    try:
        link = tmp_path / "out.wav"
        link.symlink_to(f"/proc/self/fd/{write}")
        with pytest.raises(AudioOutputError) as exc:
            check_output_path(link, SR)
        message = str(exc.value)
        assert "leads to a pipe, socket or deleted file" in message and "-o -" in message
    finally:
        os.close(read)
        os.close(write)
    assert [p.name for p in tmp_path.iterdir()] == ["out.wav"]


def test_a_name_without_extension_takes_the_one_of_the_file_it_leads_to(tmp_path):
    """`-o /dev/stdout > speech.wav`: the format comes from the file the link leads to."""
    target = tmp_path / "speech.wav"
    target.write_bytes(b"")
    link = tmp_path / "stdout"
    link.symlink_to(target)
    with AudioFileWriter(link, SR) as w:
        w.write(np.zeros(FRAME, np.float32))
    assert link.is_symlink() and sf.info(str(target)).format == "WAV"
    bare = tmp_path / "noext"
    with pytest.raises(AudioOutputError, match=r"'.*noext': the name has no extension; end"):
        check_output_path(bare, SR)
    with pytest.raises(AudioOutputError, match=r"'.wav' is all name and no extension"):
        check_output_path(tmp_path / ".wav", SR)
    # The extension at fault is not in the name given: the error says where it comes from.
    (tmp_path / "speech.out").write_bytes(b"")
    odd = tmp_path / "stdout2"
    odd.symlink_to(tmp_path / "speech.out")
    with pytest.raises(AudioOutputError, match=r"'.out' is not supported \(that of '.*speech.out'"):
        check_output_path(odd, SR)


def test_an_output_that_is_a_symbolic_link_is_written_through(tmp_path):
    """As a shell's `>` does: the file the link points to gets the audio, the link stays."""
    audio = np.zeros(FRAME, np.float32)
    (tmp_path / "audio").mkdir()
    target = tmp_path / "audio" / "today.wav"
    target.write_bytes(b"old")
    link = tmp_path / "latest.wav"
    link.symlink_to(target)
    with AudioFileWriter(link, SR) as w:
        w.write(audio)
    assert link.is_symlink() and sf.info(str(target)).frames == FRAME
    assert sorted(p.name for p in (tmp_path / "audio").iterdir()) == ["today.wav"]

    dangling = tmp_path / "new.wav"
    dangling.symlink_to(tmp_path / "audio" / "created.wav")
    with AudioFileWriter(dangling, SR) as w:
        w.write(audio)
    assert sf.info(str(tmp_path / "audio" / "created.wav")).frames == FRAME


def test_a_looping_link_or_a_device_is_refused(tmp_path):
    loop = tmp_path / "loop.wav"
    loop.symlink_to(loop)
    with pytest.raises(AudioOutputError, match="symbolic link that loops"):
        check_output_path(loop)
    device = tmp_path / "dev.wav"
    device.symlink_to(os.devnull)
    for path in (device, Path(os.devnull)):
        with pytest.raises(AudioOutputError, match="not a regular file") as exc:
            check_output_path(path)
        assert "-o -" in str(exc.value) and "\n" not in str(exc.value)


def _pretend_free(monkeypatch, path: Path, free: int) -> None:
    usage = shutil.disk_usage(path)
    monkeypatch.setattr(shutil, "disk_usage", lambda d: usage._replace(free=free))


def _assert_says_what_failed(error: Exception, directory: Path, free: int, fix: str) -> None:
    """One line, nothing left behind; libsndfile's "System error." is named for what it is
    when the disk is full, and passed on with ``fix`` otherwise."""
    message = str(error)
    assert "\n" not in message and not list(directory.iterdir())
    if free:
        assert "System error." in message and fix in message
    else:
        assert "no space left on the device" in message


@pytest.mark.parametrize("free", [0, 10 << 30])
def test_a_failed_open_says_when_the_disk_is_full(tmp_path, monkeypatch, free):
    """A WAV header written into a full disk fails in the open, also as "System error.":
    an OS error, which another format would not help with."""
    import voxtral_mlx.audio.io as audio_io

    def failing(*args, **kwargs):
        raise RuntimeError("Error opening 4: System error.")

    monkeypatch.setattr(audio_io.sf, "SoundFile", failing)
    _pretend_free(monkeypatch, tmp_path, free)
    with pytest.raises(AudioOutputError) as exc:
        AudioFileWriter(tmp_path / "full.wav", SR)
    _assert_says_what_failed(exc.value, tmp_path, free, "check free space and permissions")
    assert "choose another format" not in str(exc.value)


def test_a_format_libsndfile_refuses_says_to_choose_another(tmp_path, monkeypatch):
    def refusing(*args, **kwargs):
        raise RuntimeError("Error opening 4: Sample rate chosen is not supported.")

    monkeypatch.setattr(aio.sf, "SoundFile", refusing)
    with pytest.raises(AudioOutputError, match=r"not supported\.; choose another format$"):
        AudioFileWriter(tmp_path / "x.wav", SR)
    assert hidden_leftovers(tmp_path) == []


@pytest.mark.parametrize("free", [0, 10 << 30])
def test_a_failed_write_says_when_the_disk_is_full(tmp_path, monkeypatch, free):
    """libsndfile says "System error." when the disk is full: the message says what it is."""
    path = tmp_path / "full.wav"
    with AudioFileWriter(path, SR) as w:

        def failing(data):
            raise RuntimeError("Internal psf_fwrite error.\nSystem error.")

        monkeypatch.setattr(w._sf, "write", failing)
        _pretend_free(monkeypatch, tmp_path, free)
        with pytest.raises(AudioOutputError) as exc:
            w.write(np.zeros(FRAME, np.float32))
    _assert_says_what_failed(exc.value, tmp_path, free, "check free space and permissions")


def test_writer_accepts_column_vectors_and_empty_chunks(tmp_path):
    x = speechlike(0.2)
    with AudioFileWriter(tmp_path / "a.wav", SR) as w:
        w.write(x[:100].reshape(-1, 1))
        w.write(np.zeros(0, np.float32))
        w.write(x[100:])
        assert w.frames_written == x.size
        assert w.duration_s == pytest.approx(x.size / SR)
    assert sf.info(tmp_path / "a.wav").frames == x.size


def test_opus_rejects_unsupported_sample_rate(tmp_path):
    with pytest.raises(AudioOutputError, match="Opus"):
        AudioFileWriter(tmp_path / "a.opus", 22050)
    assert hidden_leftovers(tmp_path) == []


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="Linux /proc")
def test_each_descriptor_is_closed_once(tmp_path, monkeypatch):
    """A failed open closed the temp file's descriptor after libsndfile had (a second close
    can hit a file another thread opened meanwhile); every way out closes each once."""
    failed: list[int] = []
    real_close = os.close

    def close(fd: int) -> None:
        try:
            real_close(fd)
        except OSError as e:  # EBADF: closed already (here, with nothing reusing the number)
            failed.append(e.errno)
            raise

    monkeypatch.setattr(aio.os, "close", close)
    before = _open_fds()
    real_soundfile = sf.SoundFile

    def refused_by_libsndfile(*args, **kwargs):  # past our checks: libsndfile's own refusal
        return real_soundfile(*args, **{**kwargs, "samplerate": 1000})

    monkeypatch.setattr(aio.sf, "SoundFile", refused_by_libsndfile)
    with pytest.raises(AudioOutputError, match="Opus only supports"):
        AudioFileWriter(tmp_path / "a.opus", SR)
    monkeypatch.setattr(aio.sf, "SoundFile", real_soundfile)
    for finish in ("close", "abort", "commit_partial", "dropped"):
        w = AudioFileWriter(tmp_path / f"{finish}.flac", SR)
        w.write(speechlike(0.05))
        if finish == "dropped":
            del w
            gc.collect()
        else:
            getattr(w, finish)()
    assert _open_fds() == before and failed == []
    assert hidden_leftovers(tmp_path) == []


def test_vorbis_refuses_rates_libsndfile_would_crash_on(tmp_path):
    """Above 200 kHz (a checkpoint's params.json may say so) libsndfile's Vorbis encoder
    segfaulted, leaving a hidden partial file."""
    with AudioFileWriter(tmp_path / "ok.ogg", 200_000) as w:
        w.write(np.zeros(1000, np.float32))
    assert sf.info(str(tmp_path / "ok.ogg")).samplerate == 200_000
    with pytest.raises(AudioOutputError, match="Ogg Vorbis cannot hold 384000 Hz") as exc:
        AudioFileWriter(tmp_path / "a.ogg", 384_000)
    assert "\n" not in str(exc.value)
    assert hidden_leftovers(tmp_path) == [] and not (tmp_path / "a.ogg").exists()


# -- atomic behaviour ----------------------------------------------------------------


def test_file_appears_only_when_finished(tmp_path):
    target = tmp_path / "speech.wav"
    with AudioFileWriter(target, SR) as w:
        w.write(speechlike(0.2))
        assert not target.exists()
        assert w.temp_path.parent == tmp_path
        assert w.temp_path.name.startswith(".") and w.temp_path.suffix == ".wav"
        assert w.temp_path.exists()
    assert target.exists()
    assert hidden_leftovers(tmp_path) == []


def test_exception_mid_write_leaves_no_file(tmp_path):
    target = tmp_path / "speech.mp3"
    with pytest.raises(RuntimeError), AudioFileWriter(target, SR) as w:
        w.write(speechlike(0.2))
        raise RuntimeError("generation failed")
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("ext", list(FORMATS))
def test_exception_mid_write_keeps_existing_file(tmp_path, ext):
    target = tmp_path / f"speech{ext}"
    target.write_bytes(b"previous contents")
    with pytest.raises(KeyboardInterrupt), AudioFileWriter(target, SR) as w:
        w.write(speechlike(0.2))
        raise KeyboardInterrupt
    assert target.read_bytes() == b"previous contents"
    assert hidden_leftovers(tmp_path) == []


def test_abort_and_double_close(tmp_path):
    target = tmp_path / "x.flac"
    w = AudioFileWriter(target, SR)
    w.write(speechlike(0.1))
    w.abort()
    w.abort()
    w.close()  # already closed: nothing happens
    assert not target.exists() and hidden_leftovers(tmp_path) == []
    with pytest.raises(AudioOutputError):
        w.write(speechlike(0.1))


def test_successful_write_replaces_existing_file(tmp_path):
    target = tmp_path / "x.wav"
    target.write_bytes(b"old")
    write_audio(target, speechlike(0.1), SR)
    assert sf.info(target).frames == int(0.1 * SR)


@pytest.mark.parametrize("ext", list(FORMATS))
def test_keep_partial_on_interrupt_leaves_valid_file(tmp_path, ext):
    x = speechlike(1.0)
    target = tmp_path / f"chapter{ext}"
    target.write_bytes(b"old")
    with pytest.raises(KeyboardInterrupt), AudioFileWriter(target, SR) as w:
        try:
            for i, c in enumerate(chunks(x)):
                w.write(c)
                if i == 4:
                    raise KeyboardInterrupt
        except KeyboardInterrupt:
            assert w.commit_partial() is True
            raise
    y, sr = sf.read(target, dtype="int16")
    assert sr == SR
    if ext in aio.LOSSLESS_EXTENSIONS:
        assert np.array_equal(y, float_to_int16(x[: 5 * FRAME]))
    else:
        assert abs(y.size - 5 * FRAME) <= 0.05 * SR
    assert hidden_leftovers(tmp_path) == []


@pytest.mark.parametrize("ext", [".wav", ".flac", ".aiff", ".caf"])
@pytest.mark.parametrize("written", [True, False], ids=["after-write", "before-write"])
def test_interrupt_around_libsndfiles_write_keeps_a_valid_file(tmp_path, monkeypatch, ext, written):
    """Ctrl-C is raised between bytecodes: right after (or before) libsndfile's write of a
    chunk, before the writer counted it. The file used to fail its completeness check
    ("cut short") and be lost."""
    x = speechlike(0.5)
    parts = list(chunks(x))
    target = tmp_path / f"out{ext}"
    w = AudioFileWriter(target, SR)
    w.write(parts[0])
    real = sf.SoundFile.write

    def interrupted(self, data):
        if written:
            real(self, data)
        raise KeyboardInterrupt

    monkeypatch.setattr(sf.SoundFile, "write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        w.write(parts[1])
    monkeypatch.undo()
    assert w.commit_partial() is True
    y, _ = sf.read(target, dtype="int16")
    kept = 2 if written else 1
    assert np.array_equal(y, float_to_int16(np.concatenate(parts[:kept])))
    assert hidden_leftovers(tmp_path) == []


def test_close_keep_true_and_false(tmp_path):
    x = speechlike(0.3)
    with AudioFileWriter(tmp_path / "a.wav", SR) as w:
        w.write(x)
        assert w.close(keep=True) == tmp_path / "a.wav"
    assert sf.info(tmp_path / "a.wav").frames == x.size
    with AudioFileWriter(tmp_path / "b.wav", SR) as w:
        w.write(x)
        assert w.close(keep=False) is None
    assert not (tmp_path / "b.wav").exists()


def test_commit_partial_without_audio_keeps_old_file(tmp_path):
    target = tmp_path / "a.wav"
    target.write_bytes(b"old")
    w = AudioFileWriter(target, SR)
    assert w.commit_partial() is False
    assert target.read_bytes() == b"old" and hidden_leftovers(tmp_path) == []


def test_dropped_writer_cleans_up(tmp_path):
    w = AudioFileWriter(tmp_path / "a.ogg", SR)
    w.write(speechlike(0.1))
    tmp = w.temp_path
    assert tmp.exists()
    del w
    gc.collect()
    assert not tmp.exists()


@pytest.mark.parametrize("how", ["moved", "deleted"])
@pytest.mark.parametrize("finish", ["close", "commit_partial", "abort", "dropped"])
def test_a_folder_moved_or_deleted_meanwhile_keeps_no_temp_file(tmp_path, how, finish):
    """The temp file is deleted where the folder went; finishing says what happened."""
    folder = tmp_path / "out"
    folder.mkdir()
    w = AudioFileWriter(folder / "a.flac", SR)
    w.write(speechlike(0.1))
    moved = tmp_path / "moved"
    if how == "moved":
        folder.rename(moved)
    else:
        shutil.rmtree(folder)
    if finish == "dropped":
        del w
        gc.collect()
    elif finish == "abort":
        w.abort()
    else:
        with pytest.raises(AudioOutputError, match="its folder was moved or deleted") as e:
            getattr(w, finish)()
        assert "\n" not in str(e.value)
    if how == "moved":
        assert list(moved.iterdir()) == []


def test_new_file_gets_normal_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        write_audio(tmp_path / "a.wav", speechlike(0.05), SR)
    finally:
        os.umask(old)
    assert (tmp_path / "a.wav").stat().st_mode & 0o777 == 0o644


# -- check_output_path -------------------------------------------------------------


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_check_output_path_accepts_good_paths(tmp_path, monkeypatch):
    for ext in FORMATS:
        check_output_path(tmp_path / f"x{ext}")
        check_output_path(tmp_path / f"X{ext.upper()}")
    (tmp_path / "exists.wav").write_bytes(b"")
    check_output_path(tmp_path / "exists.wav")
    monkeypatch.chdir(tmp_path)
    check_output_path("relative.wav")


@pytest.mark.parametrize("name", ["x.txt", "x", "x.wav.bak", "x.m4a"])
def test_check_output_path_unknown_extension(tmp_path, name):
    with pytest.raises(AudioOutputError) as e:
        check_output_path(tmp_path / name)
    msg = _one_line(e)
    for ext in FORMATS:
        assert ext in msg


def test_check_output_path_missing_directory(tmp_path):
    with pytest.raises(AudioOutputError, match="does not exist") as e:
        check_output_path(tmp_path / "nope" / "x.wav")
    assert "nope" in _one_line(e)


def test_check_output_path_parent_is_a_file(tmp_path):
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(AudioOutputError, match="not a directory") as e:
        check_output_path(tmp_path / "f" / "x.wav")
    _one_line(e)


def test_check_output_path_is_a_directory(tmp_path):
    (tmp_path / "d.wav").mkdir()
    with pytest.raises(AudioOutputError, match="is a directory") as e:
        check_output_path(tmp_path / "d.wav")
    _one_line(e)


def test_check_output_path_unwritable_directory(tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        if os.geteuid() == 0:  # root may write anywhere: make access() say no
            real = os.access
            monkeypatch.setattr(
                os, "access", lambda p, m, **kw: False if Path(p) == ro else real(p, m, **kw)
            )
        with pytest.raises(AudioOutputError, match="not writable") as e:
            check_output_path(ro / "x.wav")
        _one_line(e)
    finally:
        ro.chmod(0o755)


def test_missing_format_in_libsndfile_is_a_clear_error(tmp_path, monkeypatch):
    real = sf.available_subtypes
    monkeypatch.setattr(sf, "available_subtypes", lambda f=None: {} if f == "MP3" else real(f))
    with pytest.raises(AudioOutputError, match=r"cannot write \.mp3") as e:
        check_output_path(tmp_path / "x.mp3")
    assert ".wav" in _one_line(e)
    assert ".mp3" not in aio.available_formats()


# -- streaming WAV -----------------------------------------------------------------


class Unseekable(io.RawIOBase):
    """A write-only, unseekable stream, like a pipe."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.flushes = 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.data += bytes(b)
        return len(b)

    def flush(self) -> None:
        self.flushes += 1


def test_wav_stream_unseekable_uses_unknown_sizes_and_reads_back():
    x = speechlike(0.5)
    out = Unseekable()
    w = WavStreamWriter(out, SR)
    assert not w.seekable
    assert len(out.data) == 44  # header goes out before any audio
    for c in chunks(x):
        w.write(c)
    w.close()
    data = bytes(out.data)
    assert data[:4] == b"RIFF" and data[36:40] == b"data"
    assert struct.unpack("<I", data[4:8])[0] == 0xFFFFFFFF
    assert struct.unpack("<I", data[40:44])[0] == 0xFFFFFFFF
    assert out.flushes >= x.size // FRAME  # every chunk is pushed out promptly
    # libsndfile takes the bytes actually present when the sizes claim more.
    y, sr = sf.read(io.BytesIO(data), dtype="int16")
    assert sr == SR and np.array_equal(y, float_to_int16(x))
    with wave.open(io.BytesIO(data)) as wv:
        got = np.frombuffer(wv.readframes(10**9), "<i2")
    assert np.array_equal(got, float_to_int16(x))


def test_wav_stream_seekable_gets_real_sizes():
    x = speechlike(0.5)
    buf = io.BytesIO()
    buf.write(b"junk")  # the header need not start at offset 0
    with WavStreamWriter(buf, SR) as w:
        assert w.seekable
        for c in chunks(x):
            w.write(c)
        assert w.frames_written == x.size
    data = buf.getvalue()[4:]
    assert buf.tell() == len(buf.getvalue())  # left at the end
    assert struct.unpack("<I", data[4:8])[0] == 36 + 2 * x.size
    assert struct.unpack("<I", data[40:44])[0] == 2 * x.size
    y, sr = sf.read(io.BytesIO(data), dtype="int16")
    assert sr == SR and np.array_equal(y, float_to_int16(x))


def test_wav_stream_through_a_real_pipe():
    x = speechlike(0.3)
    r, wfd = os.pipe()
    received = bytearray()

    def reader():
        with os.fdopen(r, "rb") as f:
            received.extend(f.read())

    t = threading.Thread(target=reader)
    t.start()
    with os.fdopen(wfd, "wb") as pipe, WavStreamWriter(pipe, SR) as w:
        assert not w.seekable
        for c in chunks(x):
            w.write(c)
    t.join(5)
    y, _ = sf.read(io.BytesIO(bytes(received)), dtype="int16")
    assert np.array_equal(y, float_to_int16(x))


def test_wav_stream_empty_and_closed():
    buf = io.BytesIO()
    w = WavStreamWriter(buf, SR)
    w.close()
    w.close()
    assert struct.unpack("<I", buf.getvalue()[40:44])[0] == 0
    with pytest.raises(AudioOutputError):
        w.write(np.zeros(10, np.float32))
    info = sf.info(io.BytesIO(buf.getvalue()))
    assert info.frames == 0 and info.samplerate == SR


def test_wav_stream_in_append_mode_keeps_unknown_sizes(tmp_path):
    # `>> out.wav`: every write lands at the end, so patching the header would corrupt it.
    x = speechlike(0.2)
    path = tmp_path / "appended.wav"
    path.write_bytes(b"earlier")
    with open(path, "ab") as f, WavStreamWriter(f, SR) as w:
        assert not w.seekable
        w.write(x)
    data = path.read_bytes()
    assert data[:7] == b"earlier" and len(data) == 7 + 44 + 2 * x.size
    assert struct.unpack("<I", data[7 + 40 : 7 + 44])[0] == 0xFFFFFFFF
    y, _ = sf.read(io.BytesIO(data[7:]), dtype="int16")
    assert np.array_equal(y, float_to_int16(x))


class FailingStream(Unseekable):
    def __init__(self, error: OSError) -> None:
        super().__init__()
        self.error = error

    def write(self, data) -> int:
        raise self.error


def test_wav_stream_write_errors_are_one_line():
    with pytest.raises(AudioOutputError) as exc:
        WavStreamWriter(FailingStream(OSError(28, "No space left on device")), SR)
    assert "No space left on device" in str(exc.value) and "\n" not in str(exc.value)
    with pytest.raises(BrokenPipeError):  # the reader went away: the CLI exits quietly
        aio.write_stream(FailingStream(BrokenPipeError(32, "Broken pipe")), b"x")


def test_check_output_path_trailing_slash(tmp_path):
    with pytest.raises(AudioOutputError, match="slash"):
        check_output_path(f"{tmp_path}/out.wav/")
    assert not (tmp_path / "out.wav").exists()


def test_second_interrupt_while_finishing_leaves_no_temp_file(tmp_path, monkeypatch):
    target = tmp_path / "x.wav"
    target.write_bytes(b"old")
    w = AudioFileWriter(target, SR)
    w.write(speechlike(0.1))

    def interrupted(fd: int) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(aio.os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        w.commit_partial()
    del w
    gc.collect()
    assert target.read_bytes() == b"old"
    assert hidden_leftovers(tmp_path) == []


_FULL_DISK = """
import resource, sys
import numpy as np
from voxtral_mlx.audio.io import AudioFileWriter
from voxtral_mlx.errors import AudioOutputError
target, limit = sys.argv[1], int(sys.argv[2])
x = np.random.default_rng(0).uniform(-0.5, 0.5, 48000).astype(np.float32)
if limit:  # writes past `limit` bytes fail with EFBIG, as they would on a full disk
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
try:
    with AudioFileWriter(target, 24000) as w:
        w.write(x)
except AudioOutputError as e:
    print(e)
    sys.exit(3)
"""


@pytest.mark.parametrize("ext", list(aio.available_formats()))
def test_disk_full_while_finishing_is_an_error(tmp_path, ext):
    # FLAC, Ogg and MP3 write their last block only when closed, and libsndfile ignores
    # a failure there: the file must be checked, not trusted.
    pytest.importorskip("resource")
    import subprocess
    import sys

    target = tmp_path / f"x{ext}"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}

    def run(limit: int) -> subprocess.CompletedProcess:
        args = [sys.executable, "-c", _FULL_DISK, str(target), str(limit)]
        return subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)

    assert run(0).returncode == 0
    size = target.stat().st_size
    target.unlink()
    proc = run(size - 100)
    assert proc.returncode == 3, (proc.stdout, proc.stderr)
    assert proc.stdout.count("\n") == 1 and proc.stderr == ""
    # The OS error behind libsndfile's silence (or its "System error.") is named.
    assert "the file size limit was reached (ulimit -f" in proc.stdout, proc.stdout
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("supported", [True, False])
def test_files_are_flushed_to_the_disk_itself_where_fsync_is_not(monkeypatch, supported):
    """macOS's fsync leaves data in the drive's cache: F_FULLFSYNC flushes it (and a file
    system that refuses it gets fsync)."""
    from types import SimpleNamespace

    from voxtral_mlx import fileio

    calls: list[str] = []

    def fcntl_call(fd, op):
        calls.append("F_FULLFSYNC")
        if not supported:
            raise OSError(45, "Operation not supported")

    monkeypatch.setattr(fileio, "fcntl", SimpleNamespace(F_FULLFSYNC=51, fcntl=fcntl_call))
    monkeypatch.setattr(fileio.os, "fsync", lambda fd: calls.append("fsync"))
    fileio.full_fsync(3)
    assert calls == (["F_FULLFSYNC"] if supported else ["F_FULLFSYNC", "fsync"])


def test_a_link_into_dev_fd_is_refused_with_the_fix(tmp_path, monkeypatch):
    """On macOS /dev/stdout resolves to /dev/fd/1, whose name tells no format (on Linux it
    resolves through /proc to the redirected file itself)."""
    from voxtral_mlx.audio import io as audio_io

    link = tmp_path / "out"
    link.symlink_to(tmp_path / "target.wav")
    (tmp_path / "target.wav").write_bytes(b"")
    real_resolve = Path.resolve

    def resolve(self, strict=False):
        return Path("/dev/fd/1") if self == link else real_resolve(self, strict)

    monkeypatch.setattr(Path, "resolve", resolve)
    with pytest.raises(AudioOutputError, match=r"a file descriptor without a file name.*-o -"):
        audio_io.output_target(link)


def test_a_replaced_file_keeps_its_permissions(tmp_path):
    """The atomic replace gave a private (0600) file the umask's 0644."""
    target = tmp_path / "private.wav"
    target.write_bytes(b"old")
    target.chmod(0o600)
    write_audio(target, speechlike(0.1), SR)
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert sf.info(target).frames == int(0.1 * SR)
    # ... and the temp file being written is as private as the file it will replace.
    writer = AudioFileWriter(target, SR)
    try:
        (temp,) = [p for p in tmp_path.iterdir() if p.name.startswith(".private")]
        assert stat.S_IMODE(temp.stat().st_mode) == 0o600
    finally:
        writer.abort()


def test_a_read_only_file_is_not_replaced(tmp_path, monkeypatch):
    target = tmp_path / "keep.wav"
    target.write_bytes(b"old")
    target.chmod(0o444)
    real = os.access
    # As a user without the right to write it (root may, as a shell's > would let it).
    monkeypatch.setattr(os, "access", lambda p, m: False if Path(p) == target else real(p, m))
    with pytest.raises(AudioOutputError, match="is read-only; make it writable") as e:
        write_audio(target, speechlike(0.1), SR)
    assert _one_line(e) and target.read_bytes() == b"old"
    assert hidden_leftovers(tmp_path) == []


@pytest.mark.parametrize("ext", [".wav", ".aiff"])
def test_a_file_format_that_is_full_refuses_more_and_keeps_what_it_holds(
    tmp_path, monkeypatch, ext
):
    # WAV's sizes are 32-bit (AIFF's signed): past 4 GiB (2 GiB) they wrap around, and the
    # close-time check deleted a day of audio. Shrunk limits stand for the real ones here.
    fmt = aio.FORMATS[ext][0]
    monkeypatch.setitem(aio._MAX_SAMPLE_BYTES, fmt, 2 * 1000)
    out = tmp_path / f"book{ext}"
    w = AudioFileWriter(out, SR)
    w.write(np.full(600, 0.25, np.float32))
    with pytest.raises(AudioFileFullError, match=r"\.flac or \.caf"):
        w.write(np.full(600, 0.25, np.float32))
    assert w.frames_written == 600 and not out.exists()
    assert w.commit_partial()
    audio, rate = sf.read(out, dtype="int16")
    assert rate == SR and len(audio) == 600


def test_the_format_limits_are_those_of_the_headers(tmp_path):
    wav = AudioFileWriter(tmp_path / "a.wav", SR)
    aiff = AudioFileWriter(tmp_path / "a.aiff", SR)
    flac = AudioFileWriter(tmp_path / "a.flac", SR)
    assert 2**32 - 2**17 < 2 * wav.max_frames < 2**32  # 24.8 hours at 24 kHz
    assert 2**31 - 2**17 < 2 * aiff.max_frames < 2**31
    assert flac.max_frames is None
    for w in (wav, aiff, flac):
        w.abort()


@pytest.mark.skipif(sys.platform == "darwin", reason="macOS file names are always UTF-8")
@pytest.mark.parametrize("where", ["directory", "name", "long name"])
def test_a_path_that_is_not_utf8_is_written(tmp_path, where):
    odd = os.fsdecode(b"caf\xe9")  # Latin-1 bytes: a surrogate escape in Python
    if where == "directory":
        (tmp_path / odd).mkdir()
        out = tmp_path / odd / "x.flac"
    elif where == "name":
        out = tmp_path / f"{odd}.flac"
    else:  # 250 bytes: the temp file's name is shortened to fit
        out = tmp_path / f"{os.fsdecode(bytes(range(0xC0, 0xF2)) * 5)}.flac"
    w = AudioFileWriter(out, SR)
    w.write(np.full(100, 0.5, np.float32))
    w.close()
    assert os.fsencode(out) in [os.fsencode(p) for p in out.parent.iterdir()]
    with open(out, "rb") as f:
        assert sf.info(f).frames == 100
    assert [p.name for p in out.parent.iterdir()] == [out.name]


def _ogg_pages(data: bytes) -> list[bytes]:
    pages, pos = [], 0
    while pos < len(data):
        assert data[pos : pos + 4] == b"OggS"
        n = data[pos + 26]
        size = 27 + n + sum(data[pos + 27 : pos + 27 + n])
        pages.append(data[pos : pos + size])
        pos += size
    assert pos == len(data)  # whole pages, nothing after the last
    return pages


def _ogg_crc_bitwise(page: bytes) -> int:
    """Ogg's CRC-32 the slow way (as the spec writes it), to check the fast one."""
    page = page[:22] + bytes(4) + page[26:]
    crc = 0
    for byte in page:
        crc ^= byte << 24
        for _ in range(8):
            crc = ((crc << 1) ^ 0x04C11DB7) if crc & 0x80000000 else crc << 1
            crc &= 0xFFFFFFFF
    return crc


@pytest.mark.parametrize("ext", [".ogg", ".opus"])
def test_ogg_files_of_the_same_audio_are_the_same_bytes(tmp_path, ext):
    """libsndfile numbers each Ogg stream at random: every run's file differed."""
    from voxtral_mlx.audio.ogg import SERIAL

    audio = (np.random.default_rng(0).standard_normal(24000 * 2) * 0.1).astype(np.float32)
    made = []
    for name in ("a", "b"):
        with AudioFileWriter(tmp_path / f"{name}{ext}", 24000) as w:
            for part in np.array_split(audio, 7):
                w.write(part)
        made.append((tmp_path / f"{name}{ext}").read_bytes())
    assert made[0] == made[1]
    pages = _ogg_pages(made[0])
    assert len(pages) >= 3
    for page in pages:
        assert page[14:18] == SERIAL
        assert int.from_bytes(page[22:26], "little") == _ogg_crc_bitwise(page)
    plain = tmp_path / f"plain{ext}"  # libsndfile's own, written in the same parts
    subtype = "VORBIS" if ext == ".ogg" else "OPUS"
    with sf.SoundFile(plain, "w", 24000, 1, format="OGG", subtype=subtype) as f:
        for part in np.array_split(audio, 7):
            f.write(part)
    decoded, _ = sf.read(tmp_path / f"a{ext}", dtype="float32")
    np.testing.assert_array_equal(decoded, sf.read(plain, dtype="float32")[0])


def test_renumbering_leaves_a_file_that_is_no_ogg_stream_alone(tmp_path):
    from voxtral_mlx.audio.ogg import PageRenumberer, renumber_file

    path = tmp_path / "x.ogg"
    for data in (b"", b"OggS" + b"\0" * 10, b"not an ogg file at all" * 10):
        path.write_bytes(data)
        assert renumber_file(path) == (data == b"")
        assert path.read_bytes() == data
    # Streamed in pieces that cut pages anywhere: the same bytes as the file's rewrite.
    sf.write(path, np.zeros(24000, np.float32), 24000, format="OGG", subtype="OPUS")
    raw = path.read_bytes()
    assert renumber_file(path)
    pages = PageRenumberer()
    streamed = b"".join(pages.feed(raw[i : i + 100]) for i in range(0, len(raw), 100))
    assert streamed + pages.finish() == path.read_bytes() != raw


def test_a_path_too_long_for_the_temp_file_says_to_shorten_it(tmp_path):
    """A folder path near PATH_MAX: the target fits, its longer hidden temp name does not.
    The message held the whole 4 KB path and said "choose another location"."""
    folder = str(tmp_path)
    while len(folder) < 4080 - 200:
        folder = os.path.join(folder, "d" * 200)
    folder = os.path.join(folder, "e" * (4080 - len(folder) - 1))
    try:
        os.makedirs(folder)
    except OSError:
        pytest.skip("this file system refuses paths this long")
    with pytest.raises(AudioOutputError) as e:
        AudioFileWriter(os.path.join(folder, "x.wav"), 24000)
    message = str(e.value)
    assert message.endswith("File name too long; choose a shorter path")
    assert len(message) < 300 and "\n" not in message
    assert os.listdir(folder) == []
