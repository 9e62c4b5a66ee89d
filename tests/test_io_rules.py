"""Rules of audio-file output and file writing that the rest of the suite leaves open
(found by mutation testing of voxtral_mlx/audio/io.py, fileio.py and output_dir.py)."""

from __future__ import annotations

import errno
import io
import os
import re
import stat
import struct
import warnings
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from voxtral_mlx import fileio, output_dir
from voxtral_mlx.audio import io as aio
from voxtral_mlx.audio.io import (
    AudioFileWriter,
    WavStreamWriter,
    check_output_path,
    float_to_int16,
    wav_header,
    write_audio,
)
from voxtral_mlx.errors import AudioFileFullError, AudioOutputError, InputError
from voxtral_mlx.fileio import NAME_MAX, hidden_name, one_line, prune_oldest
from voxtral_mlx.output_dir import check_output_dir, staged_dir

SR = 24000


def sine(seconds: float = 0.5, amplitude: float = 0.5, freq: float = 220.0) -> np.ndarray:
    t = np.arange(int(seconds * SR)) / SR
    return (amplitude * np.sin(2 * np.pi * freq * t)).astype(np.float32)


# -- samples ---------------------------------------------------------------------------


def test_nan_becomes_zero_without_relying_on_an_undefined_cast():
    """NaN samples are zeroed before the int16 cast (a NaN cast is undefined and warns)."""
    x = np.array([np.nan, 0.5, -np.nan], np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert float_to_int16(x).tolist() == [0, 16384, 0]


@pytest.mark.parametrize("ext", [".ogg", ".mp3"])
def test_lossy_formats_clip_samples_beyond_full_scale(tmp_path, ext):
    """Lossy files get float samples clipped to [-1, 1] before encoding, as PCM ones do."""
    out = write_audio(tmp_path / f"loud{ext}", sine(1.0, amplitude=2.5), SR)
    y, _ = sf.read(out, dtype="float32")
    assert np.abs(y).max() < 1.5  # clipped: ~1.05 after the codec; unclipped: ~2.5


# -- formats and paths -------------------------------------------------------------------


def test_a_link_named_for_one_format_writes_that_format_through_to_its_target(tmp_path):
    """Through a symbolic link the link's own extension says the format, not the target's."""
    target = tmp_path / "real.flac"
    target.write_bytes(b"old")
    link = tmp_path / "out.wav"
    link.symlink_to(target)
    write_audio(link, sine(0.1), SR)
    assert link.is_symlink()
    assert sf.info(target).format == "WAV"


def test_opus_rates_are_refused_before_any_generation(tmp_path):
    """check_output_path alone refuses a sample rate Opus cannot hold, and names the fix."""
    with pytest.raises(AudioOutputError, match="Opus cannot hold 22050 Hz"):
        check_output_path(tmp_path / "a.opus", 22050)
    check_output_path(tmp_path / "a.opus", 24000)
    check_output_path(tmp_path / "a.ogg", 22050)


def test_write_audio_writes_two_channel_audio(tmp_path):
    """write_audio takes (n, 2) audio as a stereo file, sample for sample."""
    left, right = sine(0.1, 0.5), sine(0.1, -0.25)
    stereo = np.stack([left, right], axis=1)
    out = write_audio(tmp_path / "st.wav", stereo, SR)
    y, rate = sf.read(out, dtype="int16")
    assert rate == SR and y.shape == stereo.shape
    assert np.array_equal(y, float_to_int16(stereo))


# -- format size limits --------------------------------------------------------------------


def test_a_file_may_be_filled_exactly_to_its_format_limit(tmp_path, monkeypatch):
    """Exactly max_frames frames fit in a WAV file; only one more is refused."""
    monkeypatch.setitem(aio._MAX_SAMPLE_BYTES, "WAV", 2 * 1000)
    out = tmp_path / "full.wav"
    w = AudioFileWriter(out, SR)
    assert w.max_frames == 1000
    w.write(np.full(1000, 0.25, np.float32))
    with pytest.raises(AudioFileFullError):
        w.write(np.full(1, 0.25, np.float32))
    w.close()
    assert sf.info(out).frames == 1000


def test_the_format_limit_of_a_stereo_file_counts_bytes_of_both_channels(tmp_path):
    """A stereo WAV holds half the frames of a mono one: its limit is in bytes of samples."""
    w = AudioFileWriter(tmp_path / "st.wav", SR, channels=2)
    try:
        assert 2**32 - 2**17 < 4 * w.max_frames < 2**32
    finally:
        w.abort()


# -- the streamed WAV header -------------------------------------------------------------


def test_a_stereo_wav_header_gives_the_byte_rate_of_both_channels():
    """The header's byte rate is rate * channels * 2 and its block align channels * 2."""
    h = wav_header(SR, 2, 400)
    _, _, channels, rate, byte_rate, align, bits = struct.unpack("<IHHIIHH", h[16:36])
    assert (channels, rate, byte_rate, align, bits) == (2, SR, SR * 4, 4, 16)
    y, r = sf.read(io.BytesIO(h + bytes(400)), dtype="int16")
    assert r == SR and y.shape == (100, 2)


def test_the_largest_countable_wav_size_is_written_not_marked_unknown():
    """A data size whose RIFF size still fits 32 bits is written as is; one more is unknown."""
    top = 0xFFFFFFFF - 36
    riff, data = struct.unpack("<I", wav_header(SR, 1, top)[4:8]), wav_header(SR, 1, top)[40:44]
    assert riff[0] == 0xFFFFFFFF and struct.unpack("<I", data)[0] == top
    over = wav_header(SR, 1, top + 1)
    assert struct.unpack("<I", over[40:44])[0] == 0xFFFFFFFF


def test_a_failed_write_to_stdout_says_stdout():
    """A write error on stdout names stdout (other streams: "the output stream")."""

    class FullStdout(io.RawIOBase):
        name = "<stdout>"

        def writable(self) -> bool:
            return True

        def write(self, b) -> int:
            raise OSError(28, "No space left on device")

    with pytest.raises(AudioOutputError, match="writing audio to stdout failed"):
        WavStreamWriter(FullStdout(), SR)


# -- the writer's life cycle ---------------------------------------------------------------


def test_close_after_abort_returns_none(tmp_path):
    """A writer that was aborted reports no kept file when closed again."""
    w = AudioFileWriter(tmp_path / "x.wav", SR)
    w.write(sine(0.1))
    w.abort()
    assert w.close() is None
    assert not (tmp_path / "x.wav").exists()


def test_the_owner_of_a_sticky_folder_may_replace_another_users_file_in_it(tmp_path, monkeypatch):
    """In a sticky folder of this user's own, another user's file may be replaced."""
    folder = tmp_path / "mine"
    folder.mkdir()
    folder.chmod(0o1777)
    target = folder / "x.wav"
    target.write_bytes(b"old")
    me, other = os.getuid() + 4242, os.getuid() + 4343
    real_stat, real_lstat = os.stat, os.lstat

    def with_owner(st: os.stat_result, uid: int) -> os.stat_result:
        fields = list(st)
        fields[stat.ST_UID] = uid
        return os.stat_result(fields)

    def fake_stat(p, *a, **k):
        st = real_stat(p, *a, **k)
        return with_owner(st, me) if isinstance(p, (str, Path)) and Path(p) == folder else st

    def fake_lstat(p, *a, **k):
        st = real_lstat(p, *a, **k)
        return with_owner(st, other) if isinstance(p, (str, Path)) and Path(p) == target else st

    monkeypatch.setattr(os, "geteuid", lambda: me)
    monkeypatch.setattr(os, "stat", fake_stat)
    monkeypatch.setattr(os, "lstat", fake_lstat)
    check_output_path(target)  # the folder's owner: the rename may replace it


# -- fileio: names, messages, pruning ------------------------------------------------------


def test_a_hidden_name_for_a_long_stem_uses_the_whole_name_limit():
    """hidden_name shortens a long stem to exactly NAME_MAX bytes, not one byte fewer."""
    tail = ".partial-123-0123abcd.wav"
    name = hidden_name("a" * 400, tail)
    assert len(os.fsencode(name)) == NAME_MAX and name.endswith(tail)
    assert hidden_name("short", tail) == ".short" + tail


def test_one_line_shortens_long_text_to_its_limit_ellipsis_included():
    """one_line cuts text longer than limit to exactly limit characters, "..." included."""
    text = one_line("x" * 500, 160)
    assert len(text) == 160 and text.endswith("...")
    assert one_line("y" * 160, 160) == "y" * 160


def _aged(directory: Path, names: list[str]) -> None:
    for age, name in enumerate(names):  # the first is the oldest
        p = directory / name
        p.write_bytes(b"x")
        os.utime(p, ns=(10**18 + age * 10**9, 10**18 + age * 10**9))


def test_pruning_leaves_files_whose_names_only_start_like_the_cache_s(tmp_path):
    """prune_oldest matches names whole: "t1.bin.bak" is not a "t<n>.bin" cache file."""
    _aged(tmp_path, ["t1.bin.bak", "t2.bin", "t3.bin", "t9.bin"])
    prune_oldest(tmp_path, re.compile(r"t\d+\.bin"), "t9.bin", 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t1.bin.bak", "t3.bin", "t9.bin"]


def test_a_file_another_process_pruned_meanwhile_counts_as_pruned(tmp_path, monkeypatch):
    """A file gone before its unlink (pruned concurrently) counts: no extra file is deleted."""
    _aged(tmp_path, ["t1.bin", "t2.bin", "t3.bin", "t9.bin"])
    real_unlink = os.unlink

    def raced(path, *a, **k):
        if os.path.basename(path) == "t1.bin":
            real_unlink(path)  # another process got there first
            raise FileNotFoundError(2, "No such file or directory", path)
        return real_unlink(path, *a, **k)

    monkeypatch.setattr(fileio.os, "unlink", raced)
    prune_oldest(tmp_path, re.compile(r"t\d+\.bin"), "t9.bin", 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t2.bin", "t3.bin", "t9.bin"]


# -- output_dir: staging and replacing a model directory -----------------------------------


_GONE_PID = 4_194_303  # above Linux's default pid_max and far past macOS's: no such process


def test_of_two_models_left_aside_by_killed_runs_the_newest_is_put_back(tmp_path):
    """A missing output is restored from the most recently modified model left aside."""
    out = tmp_path / "model"
    for age, tag in enumerate(["aaaaaaaa", "bbbbbbbb"]):
        old = tmp_path / f".model.old-{_GONE_PID}-{tag}"
        old.mkdir()
        (old / "params.json").write_text(tag)
        os.utime(old, (10**9 + age * 100, 10**9 + age * 100))
    check_output_dir(out, force=True)
    assert (out / "params.json").read_text() == "bbbbbbbb"


def test_a_failed_swap_with_force_puts_the_old_model_back(tmp_path, monkeypatch):
    """If the new directory cannot be renamed in, the model moved aside is renamed back."""
    out = tmp_path / "model"
    out.mkdir()
    (out / "params.json").write_text("old")
    real_rename = os.rename

    def failing(src, dst, *a, **k):
        if Path(src).name.startswith(".model.partial-"):
            raise OSError(errno.EIO, "Input/output error")
        return real_rename(src, dst, *a, **k)

    monkeypatch.setattr(output_dir.os, "rename", failing)
    with pytest.raises(InputError), staged_dir(out, force=True) as tmp:
        (tmp / "params.json").write_text("new")
    assert (out / "params.json").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_staging_failure_removes_the_parent_folders_it_made(tmp_path, monkeypatch):
    """When the staging folder cannot be set up, the parents made for it are removed again."""

    def refused(*a, **k):
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(output_dir.os, "chmod", refused)
    with pytest.raises(InputError), staged_dir(tmp_path / "a" / "b" / "model"):
        pass
    assert list(tmp_path.iterdir()) == []
