"""Ogg pages with a fixed stream serial number.

libsndfile numbers the one logical stream of an ``.ogg``/``.opus`` file at random, so the
same audio made different bytes on every run (a cache keyed by a hash of the response
missed, two runs could not be compared with ``cmp``). Every page is given
:data:`SERIAL` instead, its CRC recomputed; nothing else changes, and a page keeps its size
(a file is rewritten in place, page by page). The same audio means the same samples
written in the same chunks for Vorbis (``.ogg``), whose encoder's output depends on how
the audio was split into writes; Opus's (and MP3's) does not.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

SERIAL = b"VoxT"  # any fixed number; a file holds one logical stream
_HEADER = 27  # "OggS", version, flags, granule (8), serial (4), sequence (4), CRC (4), n
_BIT_REVERSED = bytes(int(f"{i:08b}"[::-1], 2) for i in range(256))


def _crc(page: bytes | bytearray) -> int:
    """Ogg's CRC-32 (polynomial 0x04C11DB7, most significant bit first, no pre- or
    post-inversion) of ``page`` with its CRC field zeroed, computed by zlib's reflected
    CRC-32 on the bit-reversed bytes."""
    reflected = zlib.crc32(bytes(page).translate(_BIT_REVERSED), 0xFFFFFFFF) ^ 0xFFFFFFFF
    return int(f"{reflected:032b}"[::-1], 2)


def _page_size(head: bytes | bytearray) -> int | None:
    """The size of the page whose header (and segment table) ``head`` starts with; None
    until enough of it is there. ValueError if it is no Ogg page."""
    if len(head) < _HEADER:
        return None
    if head[:4] != b"OggS" or head[4] != 0:
        raise ValueError("not an Ogg page")
    segments = head[26]
    if len(head) < _HEADER + segments:
        return None
    return _HEADER + segments + sum(head[_HEADER : _HEADER + segments])


def _renumbered(page: bytearray) -> bytearray:
    page[14:18] = SERIAL
    page[22:26] = bytes(4)
    page[22:26] = _crc(page).to_bytes(4, "little")
    return page


class PageRenumberer:
    """Renumbers a stream of Ogg bytes as it is produced: :meth:`feed` returns the whole
    pages it completes (libsndfile writes a page at a time, so little is held back)."""

    def __init__(self) -> None:
        self._held = bytearray()
        self._passthrough = False  # after bytes that are no Ogg page: left as they are

    def feed(self, data: bytes) -> bytes:
        if self._passthrough:
            return data
        self._held += data
        out = bytearray()
        while True:
            try:
                size = _page_size(self._held)
            except ValueError:
                self._passthrough = True
                out += self._held
                self._held.clear()
                break
            if size is None or len(self._held) < size:
                break
            out += _renumbered(self._held[:size])
            del self._held[:size]
        return bytes(out)

    def finish(self) -> bytes:
        rest, self._held = bytes(self._held), bytearray()
        return rest


def renumber_file(path: str | os.PathLike[str]) -> bool:
    """Renumber the pages of the Ogg file at ``path`` in place (memory: one page). A file
    that is not a single well-formed Ogg stream is left as it is (False)."""
    path = Path(path)
    with open(path, "r+b") as f:
        pages: list[tuple[int, int]] = []
        serials = set()
        end = os.fstat(f.fileno()).st_size
        offset = 0
        while offset < end:  # headers only, first: change nothing unless all are pages
            f.seek(offset)
            head = f.read(_HEADER + 255)
            try:
                size = _page_size(head)
            except ValueError:
                return False
            if size is None or offset + size > end:
                return False
            serials.add(head[14:18])
            pages.append((offset, size))
            offset += size
        if len(serials) > 1:
            return False
        for offset, size in pages:
            f.seek(offset)
            page = _renumbered(bytearray(f.read(size)))
            f.seek(offset + 14)
            f.write(page[14:18])
            f.seek(offset + 22)
            f.write(page[22:26])
    return True
