"""Rules of the text input that the suite did not pin down (found by mutation testing):
terminal codes, NUL diagnostics, stdin handling, live-text cuts and the pauses between
segments. No model needed."""

from __future__ import annotations

import io
import os
import queue
import sys
import threading
from types import SimpleNamespace

import numpy as np
import pytest
from test_livetext import Clock, live, texts

from voxtral_mlx.engine import DONE, AudioChunk, Timings
from voxtral_mlx.errors import InputError
from voxtral_mlx.livetext import LiveText, is_text_pieces, is_unordered
from voxtral_mlx.segment import PARAGRAPH, PAUSE_AFTER, SENTENCE, Segment, split_text
from voxtral_mlx.textinput import (
    TerminalCodes,
    decode_text,
    read_text,
    reads_stdin,
    text_pieces,
    text_source,
    without_terminal_codes,
)
from voxtral_mlx.textstream import MAX_PAUSE_S, TextStream, check_pause, planned_pauses


def _followed(*reads: bytes) -> list[str]:
    it = iter([*reads, b""])
    return list(text_pieces(lambda: next(it), "stdin"))


# ------------------------------------------------------------------ terminal codes


@pytest.mark.parametrize(
    "raw, spoken",
    [
        ("x\x1b[5;1Hy", "x y"),  # cursor position (CUP): the words stay apart
        ("\x1b[2J\x1b[HTop line", " Top line"),  # clear screen, cursor home
        ("a\x1b[2 qb", "ab"),  # a CSI with an intermediate byte (cursor shape)
        ("\x1b]0;ti\x18tle\x07 rest", "0;title rest"),  # CAN cancels the control string
        ("\x1bParis is nice.\nDing\x07 done.", "aris is nice.\nDing done."),
        ("a\n\bb", "a\nb"),  # a backspace at a line's start erases no line end
    ],
)
def test_terminal_code_edge_cases(raw, spoken):
    assert without_terminal_codes(raw) == spoken
    assert "".join(_followed(raw.encode())) == spoken


def test_a_stray_escape_before_a_line_end_does_not_hold_the_lines_after_it():
    """--follow: a control string never ends at a line end, so the first line is handed on
    as soon as it is whole, not held until a BEL or the text's end."""
    reads = iter([b"\x1bParis is nice.\nThen Rome.\n", b"More.\n", b""])
    pieces = text_pieces(lambda: next(reads), "stdin")
    assert next(pieces) == "aris is nice.\nThen Rome.\n"


def test_an_unended_control_string_longer_than_any_terminals_is_not_held():
    codes = TerminalCodes()
    body = "a" * 10_000  # no terminal has an escape sequence this long
    assert codes.remove("\x1b]" + body, end=False) == body  # only the escape goes
    assert codes.remove("", end=True) == ""


# ------------------------------------------------------------------ NUL diagnostics


@pytest.mark.parametrize(
    "raw",
    [
        "Hell".encode("utf-16-le"),  # 8 bytes: the shortest sample judged
        b"A\x00BCDEF\x00",  # a quarter of the bytes NUL, all on one side
        b"Some ASCII header:  " + "Hello world text".encode("utf-16-le"),  # past byte 16
    ],
)
def test_utf16le_without_a_mark_is_named_at_the_thresholds(raw):
    with pytest.raises(InputError, match="looks like UTF-16LE without a byte-order mark"):
        decode_text(raw, "text file t.txt")


# ------------------------------------------------------------------ sources


def test_a_terminal_on_stdin_is_not_read_for_the_text(monkeypatch):
    monkeypatch.setattr(sys, "stdin", SimpleNamespace(isatty=lambda: True))
    assert not reads_stdin(None, [])
    with pytest.raises(InputError, match="no text: pass TEXT, -f FILE, or pipe text"):
        read_text(None, [])
    monkeypatch.setattr(sys, "stdin", SimpleNamespace(isatty=lambda: False))
    assert reads_stdin(None, [])


def test_following_stdin_leaves_its_file_descriptor_open_at_its_end(monkeypatch):
    r, w = os.pipe()
    os.write(w, b"Hi.")
    os.close(w)
    with os.fdopen(r, "rb") as stdin:
        monkeypatch.setattr(sys, "stdin", stdin)
        read, name = text_source(None, [])
        assert name == "stdin" and read() == b"Hi." and read() == b""
        os.fstat(r)  # still open: it is stdin's, not ours to close


def test_a_byte_order_mark_is_dropped_from_the_first_decoded_piece_only():
    lines = iter(["\ufeffa ", "\ufeffb", ""])
    assert "".join(text_pieces(lambda: next(lines), "stdin")) == "a \ufeffb"


# ------------------------------------------------------------------ live text


def _put_in_thread(lt: LiveText, piece: str) -> bool:
    """Whether put() returned within a second (it waits while the buffer is full)."""
    t = threading.Thread(target=lt.put, args=(piece,), daemon=True)
    t.start()
    t.join(1.0)
    done = not t.is_alive()
    lt.close()  # lets a waiting put() return
    t.join(5)
    return done


def test_a_tiny_buffer_still_holds_enough_text_for_a_cut():
    """Below 4 * max_chars the producer would wait for room the reader can only make by
    cutting a segment, which needs more text: a deadlock."""
    lt = live(max_buffer_chars=10)
    assert lt.max_buffer_chars == 4 * 200
    lt.put("word " * 100)  # 500 characters, no sentence end
    assert _put_in_thread(lt, "more ")


def test_a_full_buffer_waits_only_beyond_its_limit():
    lt = live(max_buffer_chars=800)
    lt.put("x" * 800)  # exactly the limit: the next piece is taken
    assert _put_in_thread(lt, "y")


def test_empty_pieces_do_not_postpone_a_stall_cut():
    """An LLM's empty deltas (keep-alives) are no text: the stall after a sentence stands."""
    clock = Clock()
    lt = live(clock, idle_s=0.5)
    lt.put("Done thinking.")
    clock.t = 10.0
    lt.put("")
    assert texts(lt) == ["Done thinking."]


def test_the_first_error_given_to_end_is_the_one_raised():
    lt = live()
    first, second = ValueError("first"), ValueError("second")
    lt.end(first)
    lt.end(second)
    with pytest.raises(ValueError, match="first"):
        lt.take(False)


def test_read_from_leaves_an_iterable_it_did_not_make_open():
    """A file object is iterable and has close(): reading it to its end is no reason to
    close the caller's file (only a stopped stream closes its source)."""
    f = io.StringIO("Hello there.\nBye.\n")
    lt = live()
    lt.read_from(f).join(5)
    assert texts(lt) == ["Hello there.\nBye."]
    assert not f.closed


@pytest.mark.parametrize(
    "first, kind, later, rest",
    [
        ("A line.\n", SENTENCE, "  Indented next line.", "Indented next line."),
        ("A paragraph.\n\n", PARAGRAPH, "\n  Next one.", "Next one."),
    ],
    ids=["one-line-break-then-an-indent", "paragraph-then-more-blank-lines"],
)
def test_a_pause_cut_at_a_stall_that_did_not_change_is_not_reported_again(first, kind, later, rest):
    """pause_after(i) is for a pause that changed since the cut: one line break and an
    indented line keep a sentence's pause, a segment cut with its blank line already there
    keeps the paragraph pause it was given."""
    clock = Clock()
    lt = live(clock, idle_s=0.5)
    lt.put(first)
    clock.t = 1.0
    assert lt.take(False).pause_after == PAUSE_AFTER[kind]
    lt.put(later)
    lt.end()
    assert texts(lt) == [rest]
    assert lt.pause_after(0) is None


def test_a_sentence_exactly_max_chars_long_is_cut_once_confirmed():
    lt = live(target_chars=50, max_chars=100)
    sentence = "A" + "b" * 98 + "."
    lt.put(sentence + " Next word ")
    assert texts(lt) == [sentence]


def test_a_stall_after_an_upper_case_web_address_waits_for_what_follows():
    clock = Clock()
    lt = live(clock, idle_s=0.5)
    lt.put("Go to WWW.example.")
    clock.t = 5.0
    assert texts(lt) == []
    lt.put("org today.")
    lt.end()
    assert texts(lt) == ["Go to WWW.example.org today."]


def test_a_memoryview_or_a_dicts_values_are_no_text_pieces():
    assert not is_text_pieces(memoryview(b"Hello."))
    values = {"a": "Hello."}.values()
    assert is_unordered(values) and not is_text_pieces(values)


# ------------------------------------------------------------------ pauses


def test_the_longest_pause_allowed_is_accepted():
    check_pause(MAX_PAUSE_S)
    check_pause(0)
    with pytest.raises(InputError, match="pause must be a number of seconds"):
        check_pause(MAX_PAUSE_S + 0.001)


def _seg(text: str, pause: float) -> Segment:
    return Segment(text, 0, len(text), pause, text)


@pytest.mark.parametrize(
    "blank_pauses, expected",
    [
        ([0.75], 0.75),  # a blank paragraph after a sentence: the paragraph's pause
        ([0.4, 0.75], 0.75),  # a run of blanks: its longest pause
        ([0.75, 0.4], 0.75),
    ],
)
def test_a_run_of_blank_segments_makes_its_longest_pause(blank_pauses, expected):
    segments = [_seg("Hello.", 0.4), *(_seg("\u200b", p) for p in blank_pauses), _seg("Bye.", 0)]
    pauses = planned_pauses(segments, None)
    assert pauses[0] == expected and pauses[1:] == [None] * (len(segments) - 1)


class _Job:
    def __init__(self, i: int) -> None:
        self.i, self.ahead, self.cancelled = i, False, False
        self.output: queue.SimpleQueue = queue.SimpleQueue()

    def needed(self) -> None:
        pass

    def cancel(self) -> None:
        self.cancelled = True


def _submit(jobs) -> None:
    for job in jobs:
        codes = np.zeros((1, 37), np.int32)
        audio = np.full(1920, job.i + 1, np.float32)
        job.output.put(AudioChunk(audio, 24000, 0, 1, True, codes, Timings(), job.i))
        job.output.put(DONE)


def _silences(chunks) -> list[int]:
    return [len(c.audio) for c in chunks if not c.frames and len(c.audio)]


def test_a_blank_live_segment_does_not_shorten_the_pause_it_falls_in():
    clock = Clock()
    lt = live(clock, idle_s=0.5)
    lt.put("Hello.\n\n\u200b\n")  # a paragraph, then a blank line cut at a stall
    clock.t = 1.0
    stream = TextStream(_submit, lambda i, seg: _Job(i), lt, 24000, 1, None)
    chunks = [next(stream), next(stream)]  # "Hello."; the blank segment's
    assert [s.text for s in stream.segments] == ["Hello.", "\u200b"]
    lt.put("Again.")
    lt.end()
    chunks += list(stream)
    assert _silences(chunks) == [round(PAUSE_AFTER[PARAGRAPH] * 24000)]


def test_a_fixed_pause_stays_when_a_blank_line_completes_after_the_cut():
    clock = Clock()
    lt = live(clock, idle_s=0.5)
    lt.put("First line.\n")
    clock.t = 1.0
    stream = TextStream(_submit, lambda i, seg: _Job(i), lt, 24000, 1, 0.25)
    chunks = [next(stream)]  # "First line.", cut at the stall
    lt.put("\nSecond line.")  # the blank line: a paragraph's pause, had none been given
    lt.end()
    chunks += list(stream)
    assert lt.pause_after(0) == PAUSE_AFTER[PARAGRAPH]
    assert _silences(chunks) == [round(0.25 * 24000)]


def test_live_text_breaks_a_tie_of_lengths_as_split_text_does():
    """Two sentence ends whose lengths weigh the same (80 and 130 with target 100, max
    200): live text cuts at the first, as split_text does with the whole text."""
    first = "A" + "b" * 78 + "."
    second = " C" + "d" * 47 + "."
    rest = " Next words here, and then a good deal more text follows after them, enough of it."
    whole = split_text(first + second + rest, target_chars=100, max_chars=200)
    assert whole[0].text == first
    lt = live(target_chars=100, max_chars=200)
    lt.put(first + second + " Next ")
    assert texts(lt) == [first, second.strip()]
