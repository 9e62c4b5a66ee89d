"""Response formats of ``/v1/audio/speech``: one encoder per response, fed as audio arrives.

``pcm`` and ``wav`` stream sample for sample (the WAV header declares the unknown-length
sizes 0xFFFFFFFF). ``mp3`` and ``opus`` are encoded by libsndfile into one continuous
stream whose bytes go out as the encoder writes them: libsndfile's final seek back to
patch the start (the LAME tag of an MP3, written over a silent placeholder frame) is
dropped, so a streamed MP3 is a plain MPEG stream without length header; Ogg pages are
closed every 60 ms of audio (libsndfile's default is a second). ``flac`` is
encoded as the audio arrives but sent whole at the end, because its header (STREAMINFO
with the sample count) is only final then and soundfile cannot read FLAC without it.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass

import numpy as np
import soundfile as sf

from ..audio.io import float_to_int16, float_to_pcm16, float_to_unit, wav_header
from ..audio.ogg import PageRenumberer


@dataclass(frozen=True)
class AudioFormat:
    name: str
    media_type: str
    streams: bool  # bytes go out as audio is generated (False: the whole file at the end)


FORMATS: dict[str, AudioFormat] = {
    "mp3": AudioFormat("mp3", "audio/mpeg", True),
    "opus": AudioFormat("opus", "audio/ogg", True),
    "wav": AudioFormat("wav", "audio/wav", True),
    "pcm": AudioFormat("pcm", "audio/pcm", True),
    "flac": AudioFormat("flac", "audio/flac", False),
}
UNSUPPORTED_FORMATS = frozenset({"aac"})

# format -> libsndfile (major format, subtype, extra SoundFile arguments)
_LIBSNDFILE: dict[str, tuple[str, str, dict]] = {
    # 128 kbit/s constant bit rate: with a constant rate decoders (libsndfile's included)
    # find the length of a stream that has no LAME header.
    "mp3": ("MP3", "MPEG_LAYER_III", {"bitrate_mode": "CONSTANT", "compression_level": 0.25}),
    "opus": ("OGG", "OPUS", {"compression_level": 0.8}),  # about 60 kbit/s
    "flac": ("FLAC", "PCM_16", {}),
}


_SFC_SET_OGG_PAGE_LATENCY_MS = 0x1302  # sndfile.h; takes a double
OGG_PAGE_LATENCY_MS = 60.0  # under one 80 ms frame: every frame's audio goes out at once


class Encoder:
    """Audio (float32 mono) in, bytes of one file out: ``write`` as audio arrives, then
    ``finish`` once. ``close`` releases resources early (a cancelled response)."""

    def write(self, audio: np.ndarray) -> bytes:
        raise NotImplementedError

    def finish(self) -> bytes:
        return b""

    def close(self) -> None:
        """Release the encoder without finishing it."""


class PcmEncoder(Encoder):
    """Raw 16-bit little-endian mono samples."""

    def write(self, audio: np.ndarray) -> bytes:
        return float_to_pcm16(audio)


class WavEncoder(Encoder):
    """PCM16 WAV whose header (sent first) declares an unknown length."""

    def __init__(self, sample_rate: int) -> None:
        self._header: bytes | None = wav_header(sample_rate)

    def write(self, audio: np.ndarray) -> bytes:
        head, self._header = self._header or b"", None
        return head + float_to_pcm16(audio)

    def finish(self) -> bytes:
        head, self._header = self._header or b"", None
        return head


class _Sink(io.RawIOBase):
    """The file libsndfile writes to: bytes are handed over as soon as they are written.

    Writes to bytes already handed over (libsndfile patching a header at close) are
    dropped; in buffered use nothing is handed over before the end, so nothing is lost.
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._base = 0  # absolute offset of _buf[0]; everything before it was handed over
        self._pos = 0

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        end = self._base + len(self._buf)
        self._pos = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: end}[whence] + offset
        return self._pos

    def write(self, data) -> int:
        data = bytes(data)
        start, n = self._pos, len(data)
        self._pos += n
        if start < self._base:  # a patch of bytes already sent: nothing to do
            data, start = data[self._base - start :], self._base
        if not data:
            return n
        i = start - self._base
        if i > len(self._buf):
            self._buf.extend(bytes(i - len(self._buf)))
        self._buf[i : i + len(data)] = data
        return n

    def read(self, size: int = -1) -> bytes:
        i = max(0, self._pos - self._base)
        j = len(self._buf) if size is None or size < 0 else i + size
        data = bytes(self._buf[i:j])
        self._pos += len(data)
        return data

    def take(self) -> bytes:
        """The bytes written since the last call (handed over for good)."""
        data = bytes(self._buf)
        self._base += len(data)
        self._buf.clear()
        return data


class SoundFileEncoder(Encoder):
    """MP3, Ogg Opus or FLAC through libsndfile, streamed or buffered (see module doc)."""

    def __init__(self, name: str, sample_rate: int) -> None:
        fmt, subtype, extra = _LIBSNDFILE[name]
        self.streams = FORMATS[name].streams
        self._pcm16 = subtype == "PCM_16"
        self._sink = _Sink()
        self._sf: sf.SoundFile | None = sf.SoundFile(
            self._sink,
            mode="w",
            samplerate=sample_rate,
            channels=1,
            format=fmt,
            subtype=subtype,
            **extra,
        )
        if name == "opus" and self.streams:
            self._set_ogg_page_latency(OGG_PAGE_LATENCY_MS)
        # The same audio, the same bytes: libsndfile numbers an Ogg stream at random.
        self._pages = PageRenumberer() if fmt == "OGG" else None

    def _set_ogg_page_latency(self, ms: float) -> None:
        # libsndfile closes an Ogg page once it holds this much audio (default 1000 ms):
        # short pages let each frame's audio leave the encoder as soon as it is generated.
        # Not in soundfile's API; a libsndfile without the command keeps its default.
        try:
            value = sf._ffi.new("double*", ms)
            sf._snd.sf_command(self._sf._file, _SFC_SET_OGG_PAGE_LATENCY_MS, value, 8)
        except AttributeError:  # another soundfile: pages every second then
            pass

    def _out(self) -> bytes:
        return self._renumbered(self._sink.take()) if self.streams else b""

    def _renumbered(self, data: bytes, last: bool = False) -> bytes:
        if self._pages is None:
            return data
        return self._pages.feed(data) + (self._pages.finish() if last else b"")

    def write(self, audio: np.ndarray) -> bytes:
        if self._sf is None:
            raise RuntimeError("write to a finished encoder")
        if len(audio):
            # Lossless formats get the integers of float_to_int16 (libsndfile would scale
            # floats by 32767, not 32768); lossy encoders take the floats.
            a = np.asarray(audio, np.float32)
            self._sf.write(float_to_int16(a) if self._pcm16 else float_to_unit(a))
        return self._out()

    def finish(self) -> bytes:
        handle, self._sf = self._sf, None
        if handle is not None:
            handle.close()
        return self._renumbered(self._sink.take(), last=True)

    def close(self) -> None:
        handle, self._sf = self._sf, None
        if handle is not None:
            handle.close()


def make_encoder(name: str, sample_rate: int) -> Encoder:
    """A fresh encoder for one response in format ``name`` (a key of :data:`FORMATS`)."""
    if name == "pcm":
        return PcmEncoder()
    if name == "wav":
        return WavEncoder(sample_rate)
    return SoundFileEncoder(name, sample_rate)
