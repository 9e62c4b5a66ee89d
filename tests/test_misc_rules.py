"""Rules of the signal handling, the Ogg page renumbering, the playback horizon and the
chunk sizing that the other tests left unchecked (found by mutation testing)."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import soundfile as sf
from test_audio_io import _ogg_crc_bitwise, _ogg_pages
from test_interrupts import _child, _wait_for_interrupt
from test_live_chunks import FRAME_S, _ChunkSink, _Clock, _MeasuredPlayer
from test_playback_horizon import FRAMES, counted_horizon, fake_stream, fake_tts, live_chunk
from test_player import frame

from voxtral_mlx.audio.chunking import ClientBuffer, PlayerPace, frames_covered
from voxtral_mlx.audio.horizon import TOKENIZED_AHEAD, PlaybackHorizon
from voxtral_mlx.audio.ogg import SERIAL, PageRenumberer, renumber_file
from voxtral_mlx.interrupts import (
    Terminated,
    catching_termination,
    held_after,
    hold_from_now,
    signals_held,
)

posix = pytest.mark.skipif(not hasattr(signal, "SIGALRM"), reason="POSIX signals")


# --- interrupts -------------------------------------------------------------------------


@posix
def test_the_first_of_two_held_signals_is_the_one_raised():
    with pytest.raises(KeyboardInterrupt) as raised, catching_termination(), signals_held():
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGINT)
    assert type(raised.value) is Terminated and raised.value.signum == signal.SIGTERM


@posix
def test_held_after_no_first_interrupt_lets_an_interrupt_through():
    with pytest.raises(KeyboardInterrupt), catching_termination(), held_after(None):
        signal.raise_signal(signal.SIGINT)


@posix
def test_a_del_interrupted_by_a_signal_runs_to_its_end():
    finished = []

    class SignalsWhenCollected:
        def __del__(self) -> None:
            signal.raise_signal(signal.SIGINT)
            finished.append(True)

    with pytest.raises(KeyboardInterrupt), catching_termination():
        obj = SignalsWhenCollected()
        del obj
        _wait_for_interrupt()
    assert finished == [True]


@posix
def test_a_sigalrm_handler_of_the_caller_is_left_alone():
    def mine(signum, frame):
        pass

    previous = signal.signal(signal.SIGALRM, mine)
    try:
        with catching_termination():
            assert signal.getsignal(signal.SIGALRM) is mine
        assert signal.getsignal(signal.SIGALRM) is mine
    finally:
        signal.signal(signal.SIGALRM, previous)


@posix
def test_the_unraisable_hook_in_place_before_a_command_is_put_back(monkeypatch):
    def sentinel(info):
        pass

    monkeypatch.setattr(sys, "unraisablehook", sentinel)
    with catching_termination():
        assert sys.unraisablehook is not sentinel
    assert sys.unraisablehook is sentinel


@posix
def test_no_retry_timer_outlives_a_command():
    """A retry armed at a command's end, or asked for after it, must not fire SIGALRM with
    its default action (which ends the process)."""
    proc = _child(
        """
        import time
        from voxtral_mlx import interrupts
        with interrupts.catching_termination():
            interrupts._retry_soon()
        time.sleep(0.1)
        interrupts._retry_soon()
        time.sleep(0.1)
        print("alive")
        """
    )
    assert proc.returncode == 0 and proc.stdout == "alive\n", proc


@posix
def test_an_interrupted_command_hands_back_start_ups_message_unchanged():
    proc = _child(
        """
        import signal
        from voxtral_mlx.interrupts import catching_termination, exit_on_signals
        exit_on_signals("ended at once")
        try:
            with catching_termination():
                raise KeyboardInterrupt
        except KeyboardInterrupt:
            pass
        signal.raise_signal(signal.SIGTERM)
        """
    )
    assert proc.returncode == 128 + signal.SIGTERM and proc.stderr == "ended at once\n", proc


@posix
def test_two_finished_commands_say_they_had_finished_once():
    proc = _child(
        """
        import signal
        from voxtral_mlx.interrupts import catching_termination, exit_on_signals
        exit_on_signals("ended at once")
        for _ in range(2):
            with catching_termination():
                pass
        signal.raise_signal(signal.SIGINT)
        """
    )
    assert proc.returncode == 128 + signal.SIGINT, proc
    assert proc.stderr == "ended at once after the command had finished\n"


@posix
def test_a_quick_exit_runs_its_clean_ups_first():
    proc = _child(
        """
        import os, signal
        from voxtral_mlx import interrupts
        interrupts.exit_on_signals("ended at once")
        interrupts.QUICK_EXIT_CLEANUPS.append(lambda: os.write(1, b"cleaned "))
        signal.raise_signal(signal.SIGHUP)
        """
    )
    assert proc.returncode == 128 + signal.SIGHUP and proc.stdout == "cleaned ", proc
    assert proc.stderr == "ended at once\n"


@posix
def test_default_signals_gives_ctrl_c_back_to_keyboard_interrupt():
    proc = _child(
        """
        import signal
        from voxtral_mlx import interrupts
        interrupts.exit_on_signals("ended at once")
        interrupts.default_signals()
        print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)
        print(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)
        """
    )
    assert proc.returncode == 0 and proc.stdout == "True\nTrue\n", proc


@posix
def test_a_quick_exit_flushes_block_buffered_stdout():
    """_child's environment may say PYTHONUNBUFFERED, which hides a missing flush."""
    code = """
        import signal, sys
        from voxtral_mlx.interrupts import exit_on_signals
        exit_on_signals("ended at once")
        sys.stdout.write("flushed first")
        signal.raise_signal(signal.SIGTERM)
        """
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 128 + signal.SIGTERM and proc.stdout == "flushed first", proc


@posix
def test_a_signal_ignored_before_the_command_stays_ignored():
    """``nohup``: SIGHUP ignored must not become a Terminated."""
    proc = _child(
        """
        import signal
        from voxtral_mlx.interrupts import catching_termination
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        with catching_termination():
            signal.raise_signal(signal.SIGHUP)
        print(signal.getsignal(signal.SIGHUP) is signal.SIG_IGN)
        """
    )
    assert proc.returncode == 0 and proc.stdout == "True\n", proc


def test_a_command_off_the_main_thread_installs_no_handlers():
    errors: list[BaseException] = []

    def run() -> None:
        try:
            with catching_termination():
                pass
        except BaseException as e:
            errors.append(e)

    before = signal.getsignal(signal.SIGINT)
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert errors == [] and signal.getsignal(signal.SIGINT) is before


@posix
def test_a_command_starts_with_nothing_held_from_before():
    done = []
    hold_from_now()  # left over outside any command
    with pytest.raises(KeyboardInterrupt), catching_termination():
        signal.raise_signal(signal.SIGINT)
        _wait_for_interrupt()
        done.append("not reached")
    assert done == []


# --- Ogg --------------------------------------------------------------------------------


def _page(segments: int, serial: bytes = b"abcd", version: int = 0) -> bytes:
    """One Ogg page built by hand (RFC 3533): ``segments`` lacing values of 1 byte each, a
    BOS flag, a granule position, and its CRC computed the spec's way."""
    head = b"OggS" + bytes([version, 0x02]) + (123456).to_bytes(8, "little") + serial
    head += (7).to_bytes(4, "little") + bytes(4) + bytes([segments]) + bytes([1] * segments)
    page = bytearray(head + bytes(range(segments)))
    page[22:26] = _ogg_crc_bitwise(bytes(page)).to_bytes(4, "little")
    return bytes(page)


def test_a_page_of_255_segments_is_renumbered_keeping_the_rest(tmp_path):
    original = _page(255)
    path = tmp_path / "x.ogg"
    path.write_bytes(original)
    assert renumber_file(path)
    (page,) = _ogg_pages(path.read_bytes())
    assert page[14:18] == SERIAL
    assert int.from_bytes(page[22:26], "little") == _ogg_crc_bitwise(page)
    assert page[:14] + page[18:22] + page[26:] == original[:14] + original[18:22] + original[26:]


def test_a_page_of_another_ogg_version_is_left_alone(tmp_path):
    path = tmp_path / "x.ogg"
    data = _page(3, version=1)
    path.write_bytes(data)
    assert not renumber_file(path)
    assert path.read_bytes() == data


def test_a_file_of_two_logical_streams_is_left_alone(tmp_path):
    path = tmp_path / "x.ogg"
    data = _page(3, b"abcd") + _page(3, b"efgh")
    path.write_bytes(data)
    assert not renumber_file(path)
    assert path.read_bytes() == data


def test_bytes_streamed_one_at_a_time_are_renumbered_as_the_file_is(tmp_path):
    path = tmp_path / "x.opus"
    sf.write(path, np.zeros(24000, np.float32), 24000, format="OGG", subtype="OPUS")
    raw = path.read_bytes()
    assert renumber_file(path)
    pages = PageRenumberer()
    streamed = b"".join(pages.feed(raw[i : i + 1]) for i in range(len(raw)))
    assert streamed + pages.finish() == path.read_bytes()


def test_after_bytes_that_are_no_page_everything_passes_unchanged():
    pages = PageRenumberer()
    junk, page = b"not an ogg page at all" * 3, _page(3)
    assert pages.feed(junk) == junk
    assert pages.feed(page) == page
    assert pages.finish() == b""


def test_finish_hands_back_a_page_cut_short():
    pages = PageRenumberer()
    page = _page(255)
    assert pages.feed(page[:100]) == b""
    assert pages.finish() == page[:100]
    assert pages.finish() == b""


# --- playback horizon -------------------------------------------------------------------


def test_a_very_short_text_plans_for_one_second_at_least():
    stream = fake_stream()
    stream.segments = [SimpleNamespace(text="word", spoken="word", pause_after=0.0)]
    horizon = PlaybackHorizon(fake_tts(), stream, FRAMES, None, started=0.0)
    assert horizon.total_s == 1.0


def test_one_utterance_plans_for_its_whole_length_even_when_generated_fast():
    stream = fake_stream()
    stream.segments = [SimpleNamespace(text="a b", spoken="a b", pause_after=0.0)]
    horizon = PlaybackHorizon(fake_tts(), stream, FRAMES, None, started=0.0)
    stream.timings.audio_s, stream.ahead_s = 100.0, 100.0
    assert horizon(SimpleNamespace(audio=frame(0), segment=0), now=0.1) == 1.0


def test_at_the_start_the_whole_text_is_the_horizon():
    """No wall time has passed yet: there is no speed to trust, whatever has come."""
    stream = fake_stream()
    horizon = PlaybackHorizon(fake_tts(), stream, FRAMES, None, started=5.0)
    stream.timings.audio_s, stream.ahead_s = FRAME_S, 2 * FRAME_S
    got = horizon(SimpleNamespace(audio=frame(0), segment=0), now=5.0)
    assert got == pytest.approx(3 * 2.0)


def test_the_segment_at_tokenized_ahead_is_tokenized_when_it_starts():
    horizon, _, calls = counted_horizon(["word " * 3] * TOKENIZED_AHEAD + ["longer word " * 3])
    assert horizon.segment_s[TOKENIZED_AHEAD] == 2.0  # guessed at 7.2 tokens, capped
    horizon(SimpleNamespace(audio=frame(0), segment=TOKENIZED_AHEAD), now=1.0)
    assert len(calls) == TOKENIZED_AHEAD + 1
    assert horizon.segment_s[TOKENIZED_AHEAD] == pytest.approx(1.8)


def test_live_text_says_more_is_coming_again_once_a_new_segment_plays():
    segments = [SimpleNamespace(spoken="word " * 3, pause_after=0.0)]
    stream = SimpleNamespace(
        segments=segments, timings=SimpleNamespace(audio_s=0.0), ahead_s=0.0, live=True
    )
    horizon = PlaybackHorizon(fake_tts(), stream, FRAMES, None, started=0.0)
    horizon(live_chunk(0, ends_segment=True), now=1.0)
    assert not horizon.more_coming
    segments.append(SimpleNamespace(spoken="word " * 3, pause_after=0.0))
    horizon(live_chunk(1), now=2.0)
    assert horizon.more_coming


def test_a_text_of_no_spoken_words_plans_for_one_second():
    stream = fake_stream()
    stream.segments = [SimpleNamespace(text="", spoken="", pause_after=0.0)]
    horizon = PlaybackHorizon(fake_tts(), stream, FRAMES, None, started=0.0)
    assert horizon.total_s == 1.0 and horizon.segment_s == [0.0]


# --- chunk sizing -----------------------------------------------------------------------


def test_an_infinite_buffer_asks_for_one_frame():
    assert frames_covered(math.inf, 0.01) == 1
    assert frames_covered(10.0, 0.01) == 8


def test_an_empty_first_chunk_does_not_start_the_clients_clock():
    clock = _Clock()
    client = ClientBuffer(1.0, clock)
    assert client.sent(0.0, 0) == 1  # a leading pause of nothing
    clock.t = 10.0
    assert client.sent(FRAME_S, 1) == 1  # the first audio: the client starts here
    clock.t = 10.01
    assert client.sent(2.0, 1) == 8  # 2.07 s ahead, a frame per 10 ms


def test_no_time_passed_since_the_first_chunk_asks_for_one_frame():
    clock = _Clock()
    client = ClientBuffer(1.0, clock)
    client.sent(FRAME_S, 1)
    assert client.sent(2.0, 1) == 1


def test_an_infinite_segment_pace_is_ignored():
    stream = _ChunkSink()
    pace = PlayerPace(stream, _MeasuredPlayer(buffered_s=1.0, speed=10.0), FRAME_S)
    pace.fed(SimpleNamespace(frames=1, timings=SimpleNamespace(ms_per_frame=60.0)))
    assert stream.frames == 4
    pace.fed(SimpleNamespace(frames=1, timings=SimpleNamespace(ms_per_frame=math.inf)))
    assert stream.frames == 4  # still the 60 ms it knew


def test_a_player_that_does_not_say_what_it_holds_keeps_chunks_of_one_frame():
    stream = _ChunkSink()
    pace = PlayerPace(stream, SimpleNamespace(generation_speed=lambda: 10.0), FRAME_S)
    pace.fed(SimpleNamespace(frames=1, timings=None))
    assert stream.frames == 1
