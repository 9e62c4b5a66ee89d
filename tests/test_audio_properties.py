"""Property tests for the streaming audio writers and encoders of voxtral_mlx.

Covers voxtral_mlx/audio/io.py (AudioFileWriter, WavStreamWriter, float_to_int16,
wav_header), voxtral_mlx/audio/ogg.py (page renumbering) and voxtral_mlx/server/formats.py
(the response encoders and their _Sink). A signal split into arbitrary chunks (empty,
one-sample, odd sizes, column vectors) must give what writing it whole gives.

Deterministic (derandomize=True, no example database).
"""

from __future__ import annotations

import io
import itertools
import os
import struct
import subprocess
import sys
import tempfile
import warnings
from contextlib import ExitStack, contextmanager
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import soundfile as sf
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from test_audio_io import _ogg_pages

from voxtral_mlx.audio import io as aio
from voxtral_mlx.audio.io import (
    AudioFileWriter,
    WavStreamWriter,
    float_to_int16,
    float_to_pcm16,
    wav_header,
)
from voxtral_mlx.audio.ogg import SERIAL, PageRenumberer, renumber_file
from voxtral_mlx.errors import AudioFileFullError, AudioOutputError, InputError
from voxtral_mlx.fileio import atomic_write
from voxtral_mlx.output_dir import staged_dir
from voxtral_mlx.server import formats as sfmt
from voxtral_mlx.server.formats import make_encoder

SR = 24000
LOSSLESS = sorted(aio.LOSSLESS_EXTENSIONS)  # .aif .aiff .caf .flac .wav
LOSSY = [".mp3", ".ogg", ".opus"]
ALL_EXTS = LOSSLESS + LOSSY
MP3_FRAME = 576  # MPEG-2 layer III at 24 kHz

SETTINGS = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=50,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# -- strategies ---------------------------------------------------------------------------

_F32_ONE = np.float32(1.0)
_EDGES = [
    0.0,
    -0.0,
    1.0,
    -1.0,
    float(np.nextafter(_F32_ONE, np.float32(2))),
    float(-np.nextafter(_F32_ONE, np.float32(2))),
    float(np.nextafter(_F32_ONE, np.float32(0))),
    float(-np.nextafter(_F32_ONE, np.float32(0))),
    1.5,
    -1.5,
    2.0,
    -3.0,
    1e30,
    -1e30,
    0.5 / 32768,
    1.5 / 32768,
    2.5 / 32768,
    -0.5 / 32768,
    -1.5 / 32768,  # rounding ties
    32766.5 / 32768,
    -32767.5 / 32768,
    32767.5 / 32768,
    -32768.5 / 32768,
    np.inf,
    -np.inf,
]
_FINITE_EDGES = [v for v in _EDGES if np.isfinite(v)]


def _sample(edges: list[float], nan: bool) -> st.SearchStrategy[float]:
    options = [
        st.floats(-1.0, 1.0, width=32),
        st.floats(-1.25, 1.25, width=32),
        st.sampled_from(edges),
        st.integers(-32768, 32767).map(lambda k: k / 32768),  # exact int16 values
    ]
    if nan:
        options.append(st.just(float("nan")))
    return st.one_of(*options)


@st.composite
def signals(draw, max_len: int = 5000, edges=tuple(_EDGES), nan: bool = True) -> np.ndarray:
    """A float32 signal: a smooth base (so lossy codecs have something to do) with drawn
    samples (edge values, out-of-range values, NaN) spliced in."""
    n = draw(st.integers(0, max_len))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    t = np.arange(n)
    x = (0.6 * np.sin(t * rng.uniform(0.01, 0.3)) + 0.05 * rng.standard_normal(n)).astype(
        np.float32
    )
    if n:
        spliced = draw(
            st.lists(st.tuples(st.integers(0, n - 1), _sample(list(edges), nan)), max_size=40)
        )
        for i, v in spliced:
            x[i] = v
    return x


@st.composite
def chunkings(draw, n: int, allow_columns: bool = True) -> list[tuple[int, int, bool]]:
    """Cut points of [0, n): a list of (start, stop, as_column) covering it in order,
    with empty and one-sample chunks and sizes that are multiples of nothing in particular."""
    cuts = []
    at = 0
    sizes = draw(
        st.lists(
            st.one_of(st.just(0), st.just(1), st.integers(2, 7), st.integers(0, max(n, 1))),
            max_size=12,
        )
    )
    for s in sizes:
        stop = min(n, at + s)
        cuts.append((at, stop, allow_columns and draw(st.booleans())))
        at = stop
    cuts.append((at, n, False))  # the rest
    return cuts


def pieces(x: np.ndarray, cuts) -> list[np.ndarray]:
    return [x[a:b].reshape(-1, 1) if col else x[a:b] for a, b, col in cuts]


def hidden(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


@contextmanager
def tmpdir():
    with tempfile.TemporaryDirectory(prefix="props-") as d:
        yield Path(d)


def write_file(path: Path, parts) -> bytes:
    with AudioFileWriter(path, SR) as w:
        for p in parts:
            w.write(p)
    return path.read_bytes()


def reference_int16(x: np.ndarray) -> np.ndarray:
    """clip(rint(x * 32768), -32768, 32767), NaN -> 0, computed independently in float64."""
    y = np.asarray(x, np.float64) * 32768.0
    y = np.where(np.isnan(y), 0.0, y)
    return np.clip(np.rint(y), -32768, 32767).astype(np.int16)


class Unseekable(io.RawIOBase):
    """A pipe: write-only, unseekable."""

    def __init__(self) -> None:
        self.data = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.data += bytes(b)
        return len(b)


# -- the conversion rule --------------------------------------------------------------------


@SETTINGS
@given(x=signals(max_len=400))
def test_float_to_int16_is_the_documented_rule(x):
    got = float_to_int16(x)
    assert got.dtype == np.int16 and got.shape == x.shape
    assert np.array_equal(got, reference_int16(x))
    assert float_to_pcm16(x) == reference_int16(x).astype("<i2").tobytes()
    # idempotent through the usual reading k / 32768
    assert np.array_equal(float_to_int16(got.astype(np.float32) / 32768), got)


def test_float_to_int16_does_not_warn_on_huge_values():
    """Beyond float32's range once scaled: full scale, without numpy's overflow warning
    (an app running with warnings as errors would fail on it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert float_to_int16(np.array([3e38, -3e38], np.float32)).tolist() == [32767, -32768]


# -- lossless files: chunking does not matter, every sample is float_to_int16's ---------------


@pytest.mark.parametrize("ext", LOSSLESS)
@SETTINGS
@given(data=st.data())
def test_lossless_file_is_chunking_independent_and_exact(ext, data):
    x = data.draw(signals())
    cuts = data.draw(chunkings(x.size))
    with tmpdir() as d:
        if x.size == 0 and ext == ".flac":  # see test_an_empty_file_is_readable_or_refused
            with pytest.raises(AudioOutputError, match="no audio for it"):
                write_file(d / f"chunked{ext}", pieces(x, cuts))
            assert hidden(d) == [] and not (d / f"chunked{ext}").exists()
            return
        whole = write_file(d / f"whole{ext}", [x])
        chunked = write_file(d / f"chunked{ext}", pieces(x, cuts))
        # the same samples given already quantised give the same file
        requant = write_file(d / f"q{ext}", [float_to_int16(x).astype(np.float32) / 32768])
        assert chunked == whole == requant
        y, rate = sf.read(d / f"chunked{ext}", dtype="int16", always_2d=False)
        assert rate == SR
        assert np.array_equal(np.atleast_1d(y), reference_int16(x))
        assert hidden(d) == []


# -- WAV to a pipe / to a seekable stream -------------------------------------------------------


@SETTINGS
@given(data=st.data())
def test_wav_stream_matches_the_file_writer(data):
    x = data.draw(signals())
    parts = pieces(x, data.draw(chunkings(x.size)))
    pcm = reference_int16(x).astype("<i2").tobytes()

    pipe = Unseekable()
    with WavStreamWriter(pipe, SR) as w:
        assert not w.seekable
        for p in parts:
            w.write(p)
    assert bytes(pipe.data) == wav_header(SR) + pcm  # unknown sizes, then the samples
    y, rate = sf.read(io.BytesIO(bytes(pipe.data)), dtype="int16")
    assert rate == SR and np.array_equal(y, reference_int16(x))

    prefix = data.draw(st.binary(max_size=9))
    buf = io.BytesIO()
    buf.write(prefix)
    with WavStreamWriter(buf, SR) as w:
        assert w.seekable
        for p in parts:
            w.write(p)
    body = buf.getvalue()[len(prefix) :]
    assert body == wav_header(SR, 1, len(pcm)) + pcm
    with tmpdir() as d:
        assert body == write_file(d / "f.wav", [x])  # the very bytes libsndfile writes


def test_wav_stream_through_a_real_pipe_reads_back():
    import threading

    x = np.linspace(-1.2, 1.2, 7777, dtype=np.float32)
    r, wfd = os.pipe()
    got = bytearray()
    t = threading.Thread(target=lambda: got.extend(os.fdopen(r, "rb").read()))
    t.start()
    with os.fdopen(wfd, "wb") as pipe, WavStreamWriter(pipe, SR) as w:
        for i in range(0, x.size, 1001):
            w.write(x[i : i + 1001])
    t.join(10)
    y, _ = sf.read(io.BytesIO(bytes(got)), dtype="int16")
    assert np.array_equal(y, reference_int16(x))


# -- the 4 GiB WAV limit -------------------------------------------------------------------


@settings(derandomize=True, database=None, deadline=None, max_examples=200)
@given(
    size=st.one_of(
        st.integers(0, 2**40),
        st.integers(0, 64).map(lambda k: 0xFFFFFFFF - 36 - 32 + k),
        st.integers(0, 64).map(lambda k: 2**32 - 32 + k),
    )
)
def test_wav_header_sizes_never_wrap(size):
    h = wav_header(SR, 1, size)
    assert len(h) == 44
    riff, data_size = struct.unpack("<I", h[4:8])[0], struct.unpack("<I", h[40:44])[0]
    if size + 36 <= 0xFFFFFFFF:
        assert (riff, data_size) == (36 + size, size)
    else:
        assert riff == data_size == 0xFFFFFFFF


class SparseStream(io.RawIOBase):
    """A seekable stream that keeps only the bytes written near its start (the header)
    and otherwise just advances: stands for a multi-GiB file."""

    def __init__(self) -> None:
        self.pos = 0
        self.end = 0
        self.head = bytearray(64)

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, off, whence=0) -> int:
        self.pos = {0: 0, 1: self.pos, 2: self.end}[whence] + off
        return self.pos

    def write(self, b) -> int:
        b = bytes(b)
        for i, byte in enumerate(b[: max(0, 64 - self.pos)]):
            self.head[self.pos + i] = byte
        self.pos += len(b)
        self.end = max(self.end, self.pos)
        return len(b)


@settings(derandomize=True, database=None, deadline=None, max_examples=60)
@given(
    before=st.one_of(st.integers(0, 2**33), st.integers(-40, 40).map(lambda k: 2**32 - 36 + 2 * k)),
    tail=st.integers(0, 50),
)
def test_wav_stream_near_4_gib_patches_true_or_unknown_sizes(before, tail):
    before -= before % 2
    s = SparseStream()
    w = WavStreamWriter(s, SR)
    # pretend `before` bytes of samples were streamed already
    s.pos = s.end = 44 + before
    w.data_bytes = before
    w.write(np.zeros(tail, np.float32))
    w.close()
    total = before + 2 * tail
    riff, size = (
        struct.unpack("<I", bytes(s.head[4:8]))[0],
        struct.unpack("<I", bytes(s.head[40:44]))[0],
    )
    if total + 36 <= 0xFFFFFFFF:
        assert (riff, size) == (36 + total, total)
    else:
        assert riff == size == 0xFFFFFFFF
    assert s.pos == s.end  # left at the end


@pytest.mark.parametrize("ext", [".wav", ".aiff"])
@SETTINGS
@given(data=st.data())
def test_a_full_file_refuses_whole_chunks_and_keeps_what_fits(ext, data):
    """The format limit (shrunk here) is never crossed: the chunk that would cross it is
    refused whole, and commit_partial keeps exactly what was accepted."""
    limit_frames = data.draw(st.integers(1, 3000))
    x = data.draw(signals(max_len=4000, nan=False))
    cuts = data.draw(chunkings(x.size, allow_columns=False))
    fmt = aio.FORMATS[ext][0]
    with tmpdir() as d, mock.patch.dict(aio._MAX_SAMPLE_BYTES, {fmt: 2 * limit_frames}):
        out = d / f"book{ext}"
        w = AudioFileWriter(out, SR)
        assert w.max_frames == limit_frames
        kept = []
        for a, b, _ in cuts:
            if b - a and w.frames_written + (b - a) > limit_frames:
                with pytest.raises(AudioFileFullError):
                    w.write(x[a:b])
            else:
                w.write(x[a:b])
                kept.append(x[a:b])
        kept_x = np.concatenate(kept) if kept else np.zeros(0, np.float32)
        assert w.frames_written == kept_x.size <= limit_frames
        assert w.commit_partial() == (kept_x.size > 0)
        if kept_x.size:
            y, _ = sf.read(out, dtype="int16")
            assert np.array_equal(np.atleast_1d(y), reference_int16(kept_x))
        else:
            assert not out.exists()
        assert hidden(d) == []


def test_the_real_limits_fit_the_headers():
    for fmt, signed in (("WAV", False), ("AIFF", True)):
        top = 2**31 - 1 if signed else 2**32 - 1
        assert aio._MAX_SAMPLE_BYTES[fmt] + 4096 <= top  # room for the header's own bytes


# -- lossy files --------------------------------------------------------------------------


@pytest.mark.parametrize("ext", LOSSY)
@SETTINGS
@given(data=st.data())
def test_lossy_file_length_and_determinism(ext, data):
    x = data.draw(signals(max_len=6000, edges=tuple(_EDGES), nan=False))
    assume(x.size > 0)
    cuts = data.draw(chunkings(x.size))
    with tmpdir() as d:
        whole = write_file(d / f"whole{ext}", [x])
        again = write_file(d / f"again{ext}", [x])
        clipped = write_file(d / f"clipped{ext}", [np.clip(x, -1, 1)])
        chunked = write_file(d / f"chunked{ext}", pieces(x, cuts))
        chunked2 = write_file(d / f"chunked2{ext}", pieces(x, cuts))
        assert whole == again == clipped  # the same audio, the same bytes; clipped first
        assert chunked == chunked2
        if ext in (".mp3", ".opus"):
            assert chunked == whole  # LAME and libsndfile's Opus frame buffer: exact
        # (Vorbis: libvorbis's block decisions depend on the write sizes, see
        #  test_vorbis_bytes_depend_on_chunking; only the length is compared)
        for name in ("whole", "chunked"):
            info = sf.info(d / f"{name}{ext}")
            assert info.samplerate == SR
            assert x.size <= info.frames <= x.size + int(0.05 * SR)
        assert hidden(d) == []


def test_vorbis_bytes_depend_on_chunking():
    """Documents a limitation: 'the same audio, the same bytes' (ogg.py, io.py) holds for
    .ogg only when the audio arrives in the same chunks; .opus and .mp3 do not depend on it."""
    rng = np.random.default_rng(1)
    x = (np.sin(np.arange(30000) * 0.05) * 0.5 + rng.standard_normal(30000) * 0.05).astype(
        np.float32
    )
    with tmpdir() as d:
        whole = write_file(d / "a.ogg", [x])
        parts = write_file(d / "b.ogg", np.array_split(x, 37))
        ya, yb = sf.read(d / "a.ogg")[0], sf.read(d / "b.ogg")[0]
    assert whole != parts and ya.size == yb.size == x.size


@pytest.mark.parametrize("where", ["file", "server"])
def test_nan_in_mp3_does_not_kill_the_process(where):
    """LAME aborts the whole process on a NaN sample (an assertion in its psychoacoustic
    model): NaN is silence for the lossy encoders, as for the others. In a child process,
    so that a regression fails this test rather than ending the run."""
    code = """
import sys, numpy as np
x = np.zeros(4800, np.float32); x[100] = np.nan
if sys.argv[1] == "file":
    from voxtral_mlx.audio.io import write_audio
    write_audio(sys.argv[2], x, 24000)
else:
    from voxtral_mlx.server.formats import make_encoder
    e = make_encoder("mp3", 24000); e.write(x); e.finish()
"""
    with tmpdir() as d:  # an aborted child leaves its hidden partial file here, removed
        r = subprocess.run(
            [sys.executable, "-c", code, where, str(d / "n.mp3")], capture_output=True, timeout=120
        )
    assert r.returncode == 0, r.stderr.decode(errors="replace")[-300:]


@pytest.mark.parametrize("ext", [".ogg", ".opus"])
def test_nan_in_other_lossy_formats_is_survived(ext):
    x = np.zeros(4800, np.float32)
    x[100] = np.nan
    with tmpdir() as d:
        write_file(d / f"n{ext}", [x])
        y, _ = sf.read(d / f"n{ext}")
        assert np.isfinite(y).all()


# -- interrupted writes ---------------------------------------------------------------------


@st.composite
def interruptions(draw):
    ext = draw(st.sampled_from(ALL_EXTS))
    x = draw(signals(max_len=4000, nan=False))
    cuts = draw(chunkings(x.size, allow_columns=False))
    stop = draw(st.integers(0, len(cuts)))  # chunk index at which the interrupt lands
    how = draw(
        st.sampled_from(
            [
                "error-in-with",
                "ctrl-c-commit",
                "ctrl-c-abort",
                "ctrl-c-before-sf-write",
                "ctrl-c-after-sf-write",
            ]
        )
    )
    old = draw(st.sampled_from([None, b"old contents"]))
    return ext, x, cuts, stop, how, old


class Boom(Exception):
    pass


@settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=200,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(case=interruptions())
def test_an_interrupted_write_leaves_the_old_file_or_a_valid_prefix(case):
    ext, x, cuts, stop, how, old = case
    with tmpdir() as d:
        target = d / f"t{ext}"
        if old is not None:
            target.write_bytes(old)
        w = AudioFileWriter(target, SR)
        done = []  # chunks libsndfile was given in full and counted
        maybe = np.zeros(0, np.float32)  # written by libsndfile, interrupted before counted
        real_write = sf.SoundFile.write
        mid_write = how.endswith("sf-write")
        try:
            for i, (a, b, _) in enumerate(cuts):
                chunk = x[a:b]
                if i == stop:
                    if mid_write and b > a:
                        after = how.startswith("ctrl-c-after")

                        def interrupted(self, data, _after=after):
                            if _after:
                                real_write(self, data)
                            raise KeyboardInterrupt

                        with (
                            mock.patch.object(sf.SoundFile, "write", interrupted),
                            pytest.raises(KeyboardInterrupt),
                        ):
                            w.write(chunk)
                        if after:
                            maybe = chunk
                    if how == "error-in-with":
                        with pytest.raises(Boom), w:
                            raise Boom
                    elif how == "ctrl-c-abort":
                        w.abort()
                    else:  # "keep what is finished"
                        w.commit_partial()
                    break
                w.write(chunk)
                done.append(chunk)
            else:
                w.close()
                how = "finished"
        finally:
            if not w.closed:
                w.abort()
        assert hidden(d) == [], how
        written = np.concatenate(done) if done else np.zeros(0, np.float32)
        keeps = how == "finished" or (
            how not in ("error-in-with", "ctrl-c-abort") and written.size > 0
        )
        if not keeps:
            assert (target.read_bytes() if target.exists() else None) == old
            return
        if how == "finished" and written.size == 0:
            return  # an empty run's file (see test_an_empty_file_is_readable)
        info = sf.info(target)
        assert info.samplerate == SR
        if ext in LOSSLESS:
            y, _ = sf.read(target, dtype="int16")
            y = np.atleast_1d(y)
            assert any(
                np.array_equal(y, reference_int16(np.concatenate([written, extra])))
                for extra in (maybe[:0], maybe)
            )
        else:
            assert written.size <= info.frames <= written.size + maybe.size + int(0.05 * SR)


_FINISH_STEPS = [
    "sf-close-before",
    "sf-close-after",
    "renumber",
    "complete",
    "fsync",
    "keep-mode",
    "replace",
]


@settings(derandomize=True, database=None, deadline=None, max_examples=120)
@given(
    ext=st.sampled_from(ALL_EXTS),
    step=st.sampled_from(_FINISH_STEPS),
    n=st.integers(1, 3000),
    old=st.sampled_from([None, b"old"]),
)
def test_a_second_ctrl_c_while_finishing_leaves_no_temp_file(ext, step, n, old):
    x = np.sin(np.arange(n) * 0.1).astype(np.float32)
    assume(step != "renumber" or ext in (".ogg", ".opus"))
    with tmpdir() as d:
        target = d / f"t{ext}"
        if old is not None:
            target.write_bytes(old)
        w = AudioFileWriter(target, SR)
        w.write(x)
        fired = []

        def once(real, after=False):
            def f(*a, **k):
                if not fired:
                    fired.append(1)
                    if after:
                        real(*a, **k)
                    raise KeyboardInterrupt
                return real(*a, **k)

            return f

        patches = {
            "sf-close-before": (sf.SoundFile, "close", once(sf.SoundFile.close)),
            "sf-close-after": (sf.SoundFile, "close", once(sf.SoundFile.close, after=True)),
            "renumber": (aio, "renumber_file", once(aio.renumber_file)),
            "complete": (aio, "_complete", once(aio._complete)),
            "fsync": (aio, "full_fsync", once(aio.full_fsync)),
            "keep-mode": (aio, "_keep_mode", once(aio._keep_mode)),
            "replace": (os, "replace", once(os.replace)),
        }
        obj, name, fn = patches[step]
        with ExitStack() as stack:
            stack.enter_context(mock.patch.object(obj, name, fn))
            with pytest.raises(KeyboardInterrupt):
                w.close()
        assert fired and w.closed
        assert w.close() is None  # a second close does nothing
        assert hidden(d) == []
        assert (target.read_bytes() if target.exists() else None) == old


def test_an_empty_file_is_readable_or_refused():
    """No audio: .flac, .mp3 and .opus, whose empty files cannot be read back (libsndfile
    writes nothing, or Opus headers alone), are refused with the target left as it was;
    the other formats write an empty file that reads back."""
    with tmpdir() as d:
        for ext in ALL_EXTS:
            target = d / f"e{ext}"
            target.write_bytes(b"old")
            if ext in (".flac", ".mp3", ".opus"):
                with pytest.raises(AudioOutputError, match="no audio for it"):
                    write_file(target, [np.zeros(0, np.float32)])
                assert target.read_bytes() == b"old"
            else:
                write_file(target, [np.zeros(0, np.float32)])
                assert sf.info(target).frames == 0
        assert hidden(d) == []


# -- server encoders vs file writers --------------------------------------------------------


def encode(name: str, parts) -> bytes:
    e = make_encoder(name, SR)
    try:
        return b"".join(e.write(p) for p in parts) + e.finish()
    finally:
        e.close()


@pytest.mark.parametrize("name", ["pcm", "wav", "flac"])
@SETTINGS
@given(data=st.data())
def test_server_lossless_bodies_match_the_files(name, data):
    x = data.draw(signals())
    parts = pieces(x, data.draw(chunkings(x.size, allow_columns=False)))
    body = encode(name, parts)
    assert body == encode(name, [x])
    pcm = reference_int16(x).astype("<i2").tobytes()
    if name == "pcm":
        assert body == pcm
        return
    if name == "wav":
        assert body == wav_header(SR) + pcm
    if name == "flac" and not x.size:
        assert body == b""  # the server refuses to send it (see test_server_edges)
        return
    with tmpdir() as d:
        file_bytes = write_file(d / f"f.{name}", [x])
    if name == "flac":
        assert body == file_bytes
        y, _ = sf.read(io.BytesIO(body), dtype="int16")
        assert np.array_equal(np.atleast_1d(y), reference_int16(x))
    else:
        y, _ = sf.read(io.BytesIO(body), dtype="int16")
        assert np.array_equal(y, reference_int16(x))
        yf, _ = sf.read(io.BytesIO(file_bytes), dtype="int16")
        assert np.array_equal(y, yf)


@pytest.mark.parametrize("name", ["mp3", "opus"])
@SETTINGS
@given(data=st.data())
def test_server_lossy_bodies_are_chunking_independent(name, data):
    x = data.draw(signals(max_len=6000, nan=False))
    assume(x.size > 0)
    cuts = data.draw(chunkings(x.size, allow_columns=False))
    e = make_encoder(name, SR)
    streamed = []
    for p in pieces(x, cuts):
        streamed.append(e.write(p))
    streamed.append(e.finish())
    body = b"".join(streamed)
    assert body == encode(name, [x]) == encode(name, [np.clip(x, -1, 1)])
    y, rate = sf.read(io.BytesIO(body), dtype="float32")
    assert rate == SR and np.isfinite(y).all()
    if name == "opus":
        assert y.size == x.size  # the granule position holds the length exactly
        pages = _ogg_pages(body)
        assert all(p[14:18] == SERIAL for p in pages)
        # what went out before finish() is whole pages (none held back half-made)
        early = b"".join(streamed[:-1])
        assert early == b"".join(pages[: _n_pages([early])])
    else:
        # no LAME tag: the silent placeholder frame, encoder delay and padding remain
        assert x.size + MP3_FRAME <= y.size <= x.size + 5 * MP3_FRAME
        assert y.size % MP3_FRAME == 0


def _n_pages(parts: list[bytes]) -> int:
    return len(_ogg_pages(b"".join(parts))) if b"".join(parts) else 0


@pytest.mark.parametrize("name,ext", [("opus", ".opus"), ("flac", ".flac"), ("wav", ".wav")])
@SETTINGS
@given(data=st.data())
def test_server_and_file_decode_to_the_same_length(name, ext, data):
    x = data.draw(signals(max_len=6000, nan=False))
    assume(x.size > 0)
    body = encode(name, [x])
    with tmpdir() as d:
        write_file(d / f"f{ext}", [x])
        assert sf.info(d / f"f{ext}").frames == sf.info(io.BytesIO(body)).frames == x.size


# -- Ogg page renumbering and the server's sink ----------------------------------------------


_OPUS_RAW: dict[int, bytes] = {}


def _plain_opus(n: int) -> bytes:
    if n not in _OPUS_RAW:
        b = io.BytesIO()
        with sf.SoundFile(b, "w", SR, 1, format="OGG", subtype="OPUS") as f:
            f.write(np.sin(np.arange(n) * 0.03).astype(np.float32) * 0.5)
        _OPUS_RAW[n] = b.getvalue()
    return _OPUS_RAW[n]


@SETTINGS
@given(n=st.sampled_from([1, 4800, 48000]), cuts=st.lists(st.integers(0, 40000), max_size=20))
def test_page_renumberer_is_split_independent(n, cuts):
    raw = _plain_opus(n)
    with tmpdir() as d:
        p = d / "x.opus"
        p.write_bytes(raw)
        assert renumber_file(p)
        expected = p.read_bytes()
    bounds = sorted({min(c, len(raw)) for c in cuts} | {0, len(raw)})
    r = PageRenumberer()
    out = b"".join(r.feed(raw[a:b]) for a, b in itertools.pairwise(bounds)) + r.finish()
    assert out == expected != raw
    assert len(out) == len(raw)
    y, _ = sf.read(io.BytesIO(out))
    assert y.size == n


@st.composite
def sink_ops(draw):
    ops = []
    for _ in range(draw(st.integers(0, 25))):
        kind = draw(st.sampled_from(["write", "write", "seek", "take"]))
        if kind == "write":
            ops.append(("write", draw(st.binary(max_size=20))))
        elif kind == "seek":
            ops.append(("seek", draw(st.integers(-10, 60)), draw(st.sampled_from([0, 1, 2]))))
        else:
            ops.append(("take",))
    return ops


@settings(derandomize=True, database=None, deadline=None, max_examples=300)
@given(ops=sink_ops())
def test_sink_hands_over_what_a_file_would_hold_at_that_time(ops):
    """Model: a BytesIO receiving the same writes; each take() hands over the bytes past
    the previous take as the file holds them then; later patches of them are dropped."""
    sink = sfmt._Sink()
    model = bytearray()
    pos = 0
    handed = 0
    out = bytearray()
    expected = bytearray()
    for op in ops:
        if op[0] == "write":
            data = op[1]
            assert sink.write(data) == len(data)
            if data and pos > len(model):
                model.extend(bytes(pos - len(model)))
            model[pos : pos + len(data)] = data
            pos += len(data)
        elif op[0] == "seek":
            base = {0: 0, 1: pos, 2: len(model)}[op[2]]
            target = base + op[1]
            if target < 0:
                continue
            assert sink.seek(op[1], op[2]) == target
            pos = target
        else:
            out += sink.take()
            expected += model[handed:]
            handed = len(model)
        assert sink.tell() == pos
    out += sink.take()
    expected += model[handed:]
    assert bytes(out) == bytes(expected)


# -- fileio.atomic_write and output_dir.staged_dir: all or nothing -------------------------


def _tree(root: Path) -> dict[str, bytes] | None:
    if not root.exists():
        return None
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else b"<dir>")
        for p in sorted(root.rglob("*"))
    }


@SETTINGS
@given(
    old=st.one_of(st.none(), st.binary(max_size=50)),
    new=st.lists(st.binary(max_size=30), max_size=5),
    fail_at=st.one_of(st.none(), st.integers(0, 5)),
    exc=st.sampled_from([Boom, KeyboardInterrupt]),
)
def test_atomic_write_is_all_or_nothing(old, new, fail_at, exc):
    with tmpdir() as d:
        target = d / "f.bin"
        if old is not None:
            target.write_bytes(old)

        def write(f):
            for i, part in enumerate(new):
                if i == fail_at:
                    raise exc
                f.write(part)
            if fail_at is not None and fail_at >= len(new):
                raise exc

        if fail_at is None:
            atomic_write(target, write, durable=False)
            assert target.read_bytes() == b"".join(new)
        else:
            with pytest.raises(exc):
                atomic_write(target, write, durable=False)
            assert (target.read_bytes() if target.exists() else None) == old
        assert hidden(d) == []


@SETTINGS
@given(
    before=st.sampled_from(["absent", "empty", "model"]),
    force=st.booleans(),
    files=st.lists(
        st.tuples(
            st.sampled_from(["config.json", "a.safetensors", "voice_embedding/x.pt", "README.md"]),
            st.binary(max_size=20),
        ),
        max_size=4,
    ),
    fail_at=st.one_of(st.none(), st.integers(0, 4)),
    exc=st.sampled_from([Boom, KeyboardInterrupt]),
)
def test_staged_dir_replaces_whole_or_leaves_untouched(before, force, files, fail_at, exc):
    with tmpdir() as d:
        out = d / "parent" / "model"
        if before != "absent":
            out.mkdir(parents=True)
        if before == "model":
            (out / "config.json").write_bytes(b"old")
            (out / "model.safetensors").write_bytes(b"weights")
        was = _tree(out)
        fails = fail_at is not None
        expected_error = exc if fails else (InputError if before == "model" and not force else None)
        ctx = pytest.raises(expected_error) if expected_error else ExitStack()
        with ctx, staged_dir(out, force=force) as tmp:
            for i, (name, data) in enumerate(files):
                if i == fail_at:
                    raise exc
                (tmp / name).parent.mkdir(parents=True, exist_ok=True)
                (tmp / name).write_bytes(data)
            if fails:
                raise exc
        if expected_error:
            assert _tree(out) == was
        else:
            written = {}
            for name, data in files:
                written[name] = data
                if "/" in name:
                    written[name.split("/")[0]] = b"<dir>"
            assert _tree(out) == written
        parent = out.parent
        if parent.exists():
            assert hidden(parent) == []
        if before == "absent" and expected_error:
            assert not parent.exists()  # the parents it made are removed again
