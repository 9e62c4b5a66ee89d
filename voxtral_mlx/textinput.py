"""The text ``voxtral-mlx speak`` reads: its arguments, a file, stdin, or text still arriving
(``--follow``), decoded as text editors save it (UTF-8, or UTF-16/32 by their byte-order
mark; line ends made ``\\n``: a Windows file must sound like the same text saved on a Mac),
without the terminal's escape sequences and control characters (colours a program writes
into a pipe, a man page's overstrike): none of them is speech, and each would reach the
model as text."""

from __future__ import annotations

import codecs
import errno
import os
import re
import stat
import sys
from collections.abc import Callable, Iterator, Sequence
from functools import partial

from .errors import InputError
from .fileio import one_line

MAX_TEXT_BYTES = 64 << 20  # -f FILE or stdin: more is not text to speak
READ_CHARS = 1 << 16  # --follow: at most this much read at a time (less if less came)
_NUL_SAMPLE = 4096  # bytes looked at to tell UTF-16 from binary data
_WIDE_BOMS = (codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE, codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)


class EmptyTextError(InputError):
    """The text file or stdin held nothing at all."""


def read_text(file: str | None, words: Sequence[str]) -> str:
    """The whole text: of ``-f FILE`` (``-``: stdin), else the words given as arguments,
    else stdin when it is not a terminal."""
    _one_source(file, words)
    if file is not None:
        if file == "-":
            return _read_stdin()
        what = f"text file {one_line(file)}"
        try:
            with open(file, "rb") as f:  # a FIFO is read like cat reads it
                raw = f.read(MAX_TEXT_BYTES + 1)
            _check_size(raw, what)
            if not raw:
                raise EmptyTextError(f"{what} is empty: give a file with some text to speak")
            return without_terminal_codes(decode_text(raw, what))
        except UnicodeDecodeError as e:
            raise _not_text(what, e) from None
        except OSError as e:
            raise _file_error(file, e) from None
    if words:
        text = " ".join(words)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # bytes the locale could not decode (surrogate escapes)
            raise InputError(
                "the text given as arguments is not UTF-8; convert it first (e.g. with iconv)"
            ) from None
        return without_terminal_codes(_one_newline(text))
    if reads_stdin(file, words):
        return _read_stdin()
    raise InputError("no text: pass TEXT, -f FILE, or pipe text on stdin")


def reads_stdin(file: str | None, words: Sequence[str]) -> bool:
    """Whether :func:`read_text` reads the text from stdin for these arguments."""
    if file is not None:
        return file == "-"
    return not words and sys.stdin is not None and not sys.stdin.isatty()


def text_source(file: str | None, words: Sequence[str]) -> tuple[Callable[[], bytes | str], str]:
    """For ``--follow``: a function returning what has arrived of the text (stdin or ``-f
    FILE``, which may be a FIFO; empty at its end), opened now so that a wrong path fails
    before the model loads, and the source's name. Read with ``os.read``: a thread left
    blocked in a buffered read at exit holds its lock, which Python's shutdown waits for.
    A FIFO is only checked now: opening it waits for its writer, and the model loads
    meanwhile (its first read opens it)."""
    _one_source(file, words)
    if words:
        raise InputError(
            "--follow reads text as it arrives on stdin or from -f FILE; text given as "
            "arguments is all there already: drop --follow"
        )
    if file is not None and file != "-":
        name = f"text file {one_line(file)}"
        try:
            mode = os.stat(file).st_mode
            if stat.S_ISFIFO(mode):
                if not os.access(file, os.R_OK):
                    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
                return _read_fifo(file), name
            if stat.S_ISDIR(mode):  # os.open() takes a folder: its first read would fail
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR))
            fd = os.open(file, os.O_RDONLY)
        except OSError as e:
            raise _file_error(file, e) from None
        return partial(_read_fd, fd, close=True), name
    if sys.stdin is None:
        raise _stdin_closed()
    try:
        fd = sys.stdin.fileno()
    except (OSError, ValueError, AttributeError):  # a stdin of Python objects (embedded use)
        return sys.stdin.readline, "stdin"
    return partial(_read_fd, fd, close=False), "stdin"


def text_pieces(read: Callable[[], bytes | str], what: str) -> Iterator[str]:
    """The text ``read`` returns as it arrives, decoded as :func:`decode_text` decodes a
    whole file; bytes that are not text end it with an error after the text before them."""
    head = b""  # the first bytes, until there are enough to tell a byte-order mark
    decoder: codecs.IncrementalDecoder | None = None
    held = ""  # a piece's final "\r": the next piece may start with its "\n"
    codes = TerminalCodes()
    first = True
    consumed = 0  # bytes of the stream before ``data``
    failure: InputError | None = None
    while failure is None:
        try:
            data = read()
        except OSError as e:
            raise InputError(
                f"cannot read {what}: {e.strerror}; pass a readable text file, or pipe the "
                "text on stdin"
            ) from None
        end = not data
        if isinstance(data, str):  # a stdin of Python objects (embedded use): decoded already
            text = data.removeprefix("\ufeff") if first else data
        else:
            if decoder is None:
                head += data
                if not end and any(len(head) < len(b) and b.startswith(head) for b in _WIDE_BOMS):
                    continue  # a UTF-16/32 byte-order mark may be on its way
                decoder, data = _incremental_decoder(head), head
            try:
                text = decoder.decode(data, final=end)
            except UnicodeDecodeError as e:
                failure = _not_text(what, e)
                # The text before the bad bytes is spoken first (the error says so).
                text, end = e.object[: e.start].decode(e.encoding), True
                if first:  # the bytes given to the decoder may still hold the mark
                    text = text.removeprefix("\ufeff")
        first = False
        if "\x00" in text:  # as bytes that are not text: what came before it is spoken
            if isinstance(data, str):  # decoded already: NUL characters, not bytes
                failure = _nul_error(what, wide=True)
            else:  # parity counted from the stream's start: a read may begin at an odd byte
                failure = _nul_error(
                    what, wide=head.startswith(_WIDE_BOMS), raw=data, offset=consumed
                )
            text, end = text[: text.index("\x00")], True
        consumed += len(data)
        text = held + text
        held = "\r" if not end and text.endswith("\r") else ""
        text = codes.remove(_one_newline(text[: len(text) - len(held)]), end)
        if text:
            yield text
        if end:
            break
    if failure is not None:
        raise failure


def decode_text(raw: bytes, what: str) -> str:
    """A text file's bytes as text: UTF-8, or UTF-16 or UTF-32 when it starts with their
    byte-order mark (Windows' "Unicode" text files are UTF-16). A UTF-8 byte-order mark is
    dropped and line ends become ``\\n``: neither is meant to be spoken (each ``\\r`` would
    be a prompt token)."""
    if raw.startswith((b"\xff\xfe\x00\x00", b"\x00\x00\xfe\xff")):  # before UTF-16's
        text = raw.decode("utf-32")
    elif raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        text = raw.decode("utf-16")
    else:
        text = raw.decode("utf-8-sig")  # editors that save a byte-order mark
    if "\x00" in text:  # valid UTF-8, but no text has it: each would be a prompt token
        raise _nul_error(what, wide=raw.startswith(_WIDE_BOMS), raw=raw)
    return _one_newline(text)


def _one_source(file: str | None, words: Sequence[str]) -> None:
    if file is not None and words:
        raise InputError("give the text either as arguments or with -f FILE, not both")


def _file_error(path: str, error: OSError) -> InputError:
    what = f"text file {one_line(path)}"
    if isinstance(error, FileNotFoundError):
        return InputError(f"{what} not found: check the path")
    return InputError(
        f"cannot read {what}: {error.strerror}; pass a readable text file, or - for stdin"
    )


def _nul_error(what: str, wide: bool = False, raw: bytes = b"", offset: int = 0) -> InputError:
    """The error for NULs in text; ``raw``: the bytes they came in (from ``offset`` in the
    stream), which tell UTF-16 without a byte-order mark (a NUL in most pairs of bytes,
    all on the side of its byte order) from stray NULs."""
    if wide:  # read as UTF-16 or UTF-32 by its byte-order mark: NUL characters, not bytes
        return InputError(
            f"{what} holds NUL characters, which no text has (binary data in it?): remove "
            "them, or pass a text file"
        )
    sample = raw[:_NUL_SAMPLE]
    nuls = sample.count(0)
    odd = sample[1 - offset % 2 :: 2].count(0)  # at odd offsets in the stream
    # Neither stray NULs nor all NULs, and on one side: "H\0" is UTF-16LE's "H".
    if len(sample) >= 8 and len(sample) <= 4 * nuls <= 3 * len(sample):
        order = "LE" if odd >= 0.9 * nuls else "BE" if odd <= 0.1 * nuls else None
    else:
        order = None
    if order is not None:
        return InputError(
            f"{what} holds NUL bytes: it looks like UTF-16{order} without a byte-order "
            f"mark; convert it to UTF-8 first (e.g. iconv -f UTF-16{order} -t UTF-8)"
        )
    return InputError(
        f"{what} holds NUL bytes, which no text has (binary data in it, or UTF-16 without "
        "a byte-order mark?): remove them (e.g. tr -d '\\000'), or convert it to UTF-8"
    )


def _read_fifo(path: str) -> Callable[[], bytes]:
    fd: int | None = None

    def read() -> bytes:
        nonlocal fd
        if fd is None:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise _file_error(path, e) from None
        return _read_fd(fd, close=True)

    return read


def _read_fd(fd: int, *, close: bool) -> bytes:
    data = os.read(fd, READ_CHARS)
    if not data and close:
        os.close(fd)
    return data


def _incremental_decoder(head: bytes) -> codecs.IncrementalDecoder:
    if head.startswith((b"\xff\xfe\x00\x00", b"\x00\x00\xfe\xff")):
        return codecs.getincrementaldecoder("utf-32")()
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):
        return codecs.getincrementaldecoder("utf-16")()
    return codecs.getincrementaldecoder("utf-8-sig")()


def _not_text(what: str, error: UnicodeDecodeError) -> InputError:
    # The encoding it was read as, as its users name it (UTF-8, UTF-16, UTF-32).
    encoding = error.encoding.upper().replace("-SIG", "")[:6]
    return InputError(f"{what} is not {encoding} text; convert it first (e.g. with iconv)")


def _stdin_closed() -> InputError:
    return InputError("stdin is closed: pass the text as arguments or with -f FILE")


def _one_newline(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _check_size(raw: bytes | str, what: str) -> None:
    if len(raw) > MAX_TEXT_BYTES:
        raise InputError(
            f"{what} holds more than {MAX_TEXT_BYTES >> 20} MiB of text (a whole shelf of "
            "books; or /dev/zero?): speak it in parts"
        )


def _read_stdin() -> str:
    """stdin as UTF-8 whatever the locale says, like ``-f FILE`` (a byte-order mark dropped)."""
    if sys.stdin is None:
        raise _stdin_closed()
    buffer = getattr(sys.stdin, "buffer", None)
    try:
        raw = (sys.stdin if buffer is None else buffer).read(MAX_TEXT_BYTES + 1)
    except OSError as e:
        raise InputError(f"cannot read stdin: {e.strerror}") from None
    _check_size(raw, "stdin")
    if not raw:
        raise EmptyTextError("stdin is empty: pipe some text, or pass it as arguments or -f FILE")
    if isinstance(raw, str):  # a text-only stdin (embedded use) is decoded already
        if "\x00" in raw:
            raise _nul_error("stdin", wide=True)
        return without_terminal_codes(_one_newline(raw.removeprefix("\ufeff")))
    try:
        return without_terminal_codes(decode_text(raw, "stdin"))
    except UnicodeDecodeError as e:
        raise _not_text("stdin", e) from None


# ECMA-48: a control sequence (CSI: colours, cursor moves), a control string (OSC: titles,
# links; DCS, SOS, PM, APC) ended by BEL or ST, or any other escape; C1's one-character CSI.
# A control string holds no line end (nor CAN or SUB, which cancel it): an ESC typed by
# habit before "Paris" would else take the text after it along.
_STRING = r"[^\x07\x1b\n\x18\x1a]"
_CSI = r"(?:\x1b\[|\x9b)[0-?]*[ -/]*"
_ESCAPES = re.compile(
    rf"{_CSI}(?P<final>[@-~])"
    rf"|\x1b[\]PX^_]{_STRING}*(?:\x07|\x1b\\)"
    # One not ended at the end of the text: more may come.
    rf"|(?P<open>(?:{_CSI}|\x1b[\]PX^_]{_STRING}*\x1b?|\x1b[!-/]*)\Z)"
    r"|\x1b[!-/]*[0-~]"
)
_MOVES = frozenset("ABCDEFGHdf")  # a cursor move: what comes after it stands apart
# C0 and C1 controls but backspace, tab and the line ends (carriage returns are newlines by
# now; a vertical tab, form feed or NEL separates as a newline does).
_CONTROLS = re.compile(r"[\x00-\x07\x0e-\x1f\x7f-\x84\x86-\x9f]")
_BREAKS = re.compile(r"[\x0b\x0c\x85]")
_CODES = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")  # any of the above, ESC too
MAX_HELD_ESCAPE = 4096  # an escape sequence longer than this is no terminal's


class TerminalCodes:
    """Removes escape sequences and control characters from text that arrives in pieces,
    as from the whole text: a sequence cut at the end of a piece is held until the next
    one completes it. (A backspace that begins a piece cannot erase what an earlier piece
    gave: holding text back for it would hold a line still being written.)"""

    def __init__(self) -> None:
        self._held = ""

    def remove(self, text: str, end: bool = True) -> str:
        """``text`` (after what was held) without terminal codes; with ``end`` nothing is
        held back."""
        text = self._held + text
        self._held = ""
        if not _CODES.search(text):
            return text

        def drop(match: re.Match) -> str:
            final = match.group("final")
            if final is not None:
                return " " if final in _MOVES else ""
            if match.group("open") is None:
                return ""
            if not end and match.end() - match.start() <= MAX_HELD_ESCAPE:
                self._held = match.group()
                return ""
            # Never ended: a stray ESC; only the escape itself goes.
            body = match.group()[2:]
            return body if match.group()[1:2] in ("]", "P", "X", "^", "_") else ""

        cleaned = _BREAKS.sub("\n", _CONTROLS.sub("", _ESCAPES.sub(drop, text)))
        return _overstruck(cleaned) if "\b" in cleaned else cleaned


def without_terminal_codes(text: str) -> str:
    """``text`` without terminal escape sequences (a cursor move leaves a space) and
    control characters (but tab and newline; a vertical tab, form feed or NEL becomes a
    newline); a backspace erases the character before it (overstrike: ``_\\bA`` and
    ``A\\bA`` are ``A``)."""
    return TerminalCodes().remove(text)


def _overstruck(text: str) -> str:
    out: list[str] = []
    for ch in text:
        if ch != "\b":
            out.append(ch)
        elif out and out[-1] != "\n":
            out.pop()
    return "".join(out)
