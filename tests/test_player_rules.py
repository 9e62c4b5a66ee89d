"""AudioPlayer and Playback rules the main player tests leave open: refill sizing, a device
that fails while feed() is held back, timing fallbacks, partial blocks, an abandoned
stream's second stop, and what Playback reports after a stop.

Driven by the fake sounddevice of test_player (the test calls the callback and moves
the clock itself), so no test depends on the machine's speed beyond generous bounds.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from test_player import (
    FRAME,
    FRAME_S,
    SR,
    FakeSD,
    FrameStream,
    _slow_to_close,
    frame,
    make_player,
    run_in_thread,
)

from voxtral_mlx.audio import player as player_module
from voxtral_mlx.audio.player import AudioPlayer
from voxtral_mlx.errors import AudioDeviceError


def _wait_until(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


# -- refilling after the buffer ran dry ---------------------------------------------------


def test_a_dry_buffer_resumes_at_once_when_generation_keeps_real_time():
    """Generation exactly as fast as real time: a hiccup resumes with the next chunk, no refill."""
    # 3000 samples = 0.125 s, fed every 0.125 s: the measured speed is exactly 1.0.
    n = 3000
    p, sd = make_player()
    s = sd.streams[0]
    p.feed(frame(0, n), more_coming=True)
    sd.clock.advance(n / SR)
    p.feed(frame(1, n), more_coming=True)
    sd.clock.advance(n / SR)
    p.feed(frame(2, n), more_coming=True)
    assert p.started and p.generation_speed() == 1.0
    s.pump(frames=3 * n)  # everything played
    assert not s.pump(frames=n).any()  # ran dry: a hiccup
    assert p.resume_need_s() == 0.0
    sd.clock.advance(n / SR)
    p.feed(frame(3, n), more_coming=True)  # still real time
    assert np.array_equal(s.pump(frames=n), frame(3, n))


def test_a_refill_once_the_guessed_total_is_all_fed_uses_the_unknown_length_rule():
    """Played plus buffered reaching the expected total means the guess is used up: at most 3 s."""
    p, sd = make_player()
    p.feed(frame(0), expected_total_s=40 * FRAME_S)
    sd.clock.advance(2 * FRAME_S)
    p.feed(frame(1), expected_total_s=40 * FRAME_S)  # half real time
    p._played = 38 * FRAME  # as if 38 frames had played: 38 + 2 buffered = the guess
    assert p.resume_need_s() == pytest.approx(3.0)


def test_a_refill_never_waits_for_more_than_feed_lets_in():
    """Slow generation, a small max_buffer_s: the refill resumes at max_buffer_s, no deadlock."""
    p, sd = make_player(max_buffer_s=7 * FRAME_S)
    s = sd.streams[0]
    i = 0
    while not p.started:  # half real time, a long text: starts at max_buffer_s (7 frames)
        p.feed(frame(i), expected_total_s=100.0, more_coming=True)
        sd.clock.advance(2 * FRAME_S)
        i += 1
    while s.pump().any():  # plays it out, then runs dry
        pass
    assert p._refilling
    assert p.resume_need_s() <= p.max_buffer_s
    fed: list[int] = []

    def produce() -> None:
        for j in range(i, i + 20):
            sd.clock.advance(2 * FRAME_S)
            p.feed(frame(j), expected_total_s=100.0, more_coming=True)
            fed.append(j)

    t, result = run_in_thread(produce)
    played = []
    deadline = time.monotonic() + 10
    while t.is_alive() and time.monotonic() < deadline:
        played.append(s.pump())
        time.sleep(0.03)  # longer than feed()'s poll: it catches up each time
    stuck = t.is_alive()
    p.stop()
    t.join(2)
    assert not stuck, "feed() and the callback wait for each other"
    assert "error" not in result and len(fed) == 20
    assert any(b.any() for b in played)


def test_without_more_coming_a_slow_generation_plays_each_chunk_as_it_comes():
    """feed() without more_coming (Playback with no horizon): a dry buffer is no refill."""
    p, sd = make_player()
    s = sd.streams[0]
    i = 0
    while not p.started:  # half real time, total unknown: a bounded pre-roll
        p.feed(frame(i))
        sd.clock.advance(2 * FRAME_S)
        i += 1
    while s.pump().any():
        pass
    assert not p._refilling
    p.feed(frame(i))  # the next chunk, still at half real time
    assert np.array_equal(s.pump(), frame(i))  # played at once, not after a refill


# -- a device that fails while feed() is held back --------------------------------------


@pytest.mark.parametrize("failure", ["stalls", "ends"])
def test_a_feed_held_back_at_max_buffer_fails_when_the_device_goes(failure):
    """feed() waiting for room raises AudioDeviceError once the device stalls or ends."""
    p, sd = make_player(max_buffer_s=0.5)
    fed: list[int] = []

    def produce() -> None:
        for i in range(20):
            p.feed(frame(i))
            fed.append(i)
            sd.clock.advance(0.001)

    t, result = run_in_thread(produce)
    assert _wait_until(lambda: len(fed) == 6)
    time.sleep(0.05)
    assert t.is_alive() and len(fed) == 6  # held back: nothing plays
    if failure == "stalls":
        sd.clock.advance(10.0)  # no callback for 10 s
    else:
        sd.streams[0].end_by_host()  # headphones unplugged
    t.join(2)
    hung = t.is_alive()
    p.stop()
    t.join(2)
    assert not hung, "feed() kept waiting on a dead device"
    assert isinstance(result.get("error"), AudioDeviceError)


@pytest.mark.parametrize("waiting_in", ["feed", "finish"])
def test_a_process_stopped_and_continued_plays_on(waiting_in):
    """Ctrl-Z, then fg ten minutes later: PortAudio's thread was stopped with the rest of
    the process, and the thread checking on the device runs first, having seen the ten
    minutes pass without a callback. The device calls back a moment later: playback goes
    on, from where it was, instead of failing as a device that is gone."""
    p, sd = make_player(max_buffer_s=0.5)
    s = sd.streams[0]
    fed: list[int] = []
    frames = 20 if waiting_in == "feed" else 5

    def produce() -> None:
        for i in range(frames):
            p.feed(frame(i))
            fed.append(i)
            sd.clock.advance(0.001)
        p.finish()

    t, result = run_in_thread(produce)
    held = 6 if waiting_in == "feed" else frames  # held back at max_buffer_s, or all fed
    assert _wait_until(lambda: len(fed) == held)
    time.sleep(0.05)
    assert t.is_alive() and len(fed) == held and p.started
    sd.clock.advance(600.0)  # stopped: no callback, and no check either
    time.sleep(0.2)  # continued: the checking thread polls first (every 20 ms)
    played = []
    deadline = time.monotonic() + 10
    while t.is_alive() and time.monotonic() < deadline:
        played.append(s.pump())  # PortAudio's thread runs again
        sd.clock.advance(FRAME_S)
        time.sleep(0.03)
    stuck = t.is_alive()
    p.stop()
    t.join(2)
    assert not stuck
    assert "error" not in result, result.get("error")
    assert len(fed) == frames
    audio = np.concatenate([b for b in played if b is not None])
    expected = np.concatenate([frame(i) for i in range(frames)])
    assert np.array_equal(audio[: frames * FRAME], expected)


def test_a_high_latency_device_is_allowed_four_latencies_before_it_counts_as_stalled():
    """The stall limit is max(3 s, 4 x the stream's latency): 3.5 s is fine at 1 s latency."""
    sd = FakeSD()
    sd.latency = 1.0
    p = AudioPlayer(SR, sd=sd, clock=sd.clock)
    p.feed(frame(0))
    sd.clock.advance(0.01)
    p.feed(frame(1))
    sd.streams[0].pump()
    sd.clock.advance(3.5)
    p.feed(frame(2))  # no error: within four latencies
    sd.clock.advance(1.0)
    with pytest.raises(AudioDeviceError, match="stopped taking audio"):
        p.feed(frame(3))


# -- timing and blocks --------------------------------------------------------------------


@pytest.mark.parametrize(
    "now, dac",
    [(0.0, 0.0), (100.0, 99.0), (100.0, 125.0)],
    ids=["no timing", "dac in the past", "dac too far"],
)
def test_a_block_without_usable_dac_time_falls_back_on_the_stream_latency(now, dac):
    """No or implausible outputBufferDacTime: first audio is timed with the stream's latency."""
    p, sd = make_player()
    p.feed(frame(0))
    sd.clock.advance(0.01)
    p.feed(frame(1))
    s = sd.streams[0]
    out = np.full((FRAME, s.channels), np.nan, np.float32)
    s.callback(out, FRAME, SimpleNamespace(currentTime=now, outputBufferDacTime=dac), None)
    assert p.stats.first_audio_at == pytest.approx(sd.clock.t + sd.latency)


def test_a_block_one_sample_short_of_audio_ends_in_silence():
    """The buffer running dry one sample before the block's end: that sample is written as 0."""
    p, sd = make_player()
    p.feed(frame(0, FRAME - 1))
    p._start()
    block = sd.streams[0].pump()  # pump() fails on any sample left unwritten
    assert np.array_equal(block[:-1], frame(0, FRAME - 1)) and block[-1] == 0.0


def test_finish_after_all_audio_was_handed_out_still_waits_for_the_dac():
    """finish() with the buffer empty but the stream playing waits for the last sample."""
    p, sd = make_player()
    s = sd.streams[0]
    p.feed(frame(0))
    sd.clock.advance(0.01)
    p.feed(frame(1))
    s.pump(dac_delay=0.05)
    s.pump(dac_delay=0.05)  # the last sample leaves the DAC 0.05 s + a block from now
    assert p.buffered_s == 0
    t, result = run_in_thread(p.finish)
    time.sleep(0.1)
    assert t.is_alive()  # its last block is still on its way to the DAC
    while t.is_alive() and s.pump() is not None:
        sd.clock.advance(FRAME_S)
        time.sleep(0.005)
    t.join(2)
    assert not t.is_alive() and "error" not in result
    assert s.calls == ["start", "abort", "close"]


# -- an abandoned stream ------------------------------------------------------------------


def test_stop_after_a_stream_was_abandoned_returns_at_once(monkeypatch):
    """A stream left to a hung device is not waited for again by a later stop()."""
    unregistered: list[object] = []
    monkeypatch.setattr(player_module.atexit, "unregister", unregistered.append)
    monkeypatch.setattr(player_module, "_CLOSE_WAIT_S", 0.5)
    p, sd = make_player()
    sd._exit_handler = lambda: None
    hung = threading.Event()
    sd.streams[0].abort = lambda: hung.wait(30)  # type: ignore[method-assign]
    p.feed(frame(0))
    sd.clock.advance(0.01)
    p.feed(frame(1))
    p.stop()
    assert p.abandoned and unregistered == [sd._exit_handler]
    t0 = time.monotonic()
    p.stop()
    p.finish()
    assert time.monotonic() - t0 < 0.4
    assert unregistered == [sd._exit_handler]
    hung.set()
    assert _wait_until(lambda: sd.streams[0].closed)


# -- Playback -----------------------------------------------------------------------------


def test_playback_end_after_stop_leaves_wait_without_an_error():
    """end(error) after stop() does not turn the user's stop into an error from wait()."""
    from voxtral_mlx.playback import Playback

    p, sd = make_player(autoplay=True)
    playback = Playback(FrameStream(), p)  # type: ignore[arg-type]
    assert _wait_until(lambda: p.started)
    _slow_to_close(sd.streams[0], 0.3)  # the thread is still closing when end() comes
    playback.stop()
    playback.end(RuntimeError("the model was closed"))
    assert playback.wait(5) is True
    assert playback.error is None


def test_an_empty_chunk_never_starts_the_stream_even_with_a_zero_expected_total():
    """feed() of no audio with expected_total_s=0 does not start the device on nothing."""
    p, sd = make_player()
    p.feed(np.zeros(0, np.float32), expected_total_s=0.0)
    assert not p.started and sd.streams[0].count("start") == 0
    p.finish()
    assert sd.streams[0].calls == ["close"]


class _ReadyStream(FrameStream):
    """Hands out the chunks it already holds even after cancel(), as TextStream does with
    those it has made ready."""

    def __init__(self, chunks: list[np.ndarray]) -> None:
        super().__init__()
        self.chunks = chunks

    def __iter__(self):
        for audio in self.chunks:
            yield SimpleNamespace(audio=audio, frames=-(-len(audio) // FRAME), segment=0)


def test_playback_feeds_nothing_to_an_apps_player_after_stop():
    """Chunks the stream still hands out after stop() are not fed to the app's player."""
    from voxtral_mlx.playback import Playback

    in_feed, go = threading.Event(), threading.Event()

    class Player:
        def __init__(self) -> None:
            self.fed, self.stopped_at, self.finished = 0, None, False

        def feed(self, audio, **_):
            self.fed += 1
            if self.fed == 2:
                in_feed.set()
                go.wait(5)

        def finish(self):
            self.finished = True

        def stop(self):
            self.stopped_at = self.fed

    player = Player()
    playback = Playback(_ReadyStream([frame(i) for i in range(5)]), player)  # type: ignore[arg-type]
    assert in_feed.wait(5)
    playback.stop()
    go.set()
    assert playback.wait(5) is True
    assert player.stopped_at == 2 and player.fed == 2 and not player.finished


def test_playback_without_a_horizon_feeds_only_chunks_with_audio():
    """Chunks without audio (pauses' ends, a live segment's empty last chunk) are not fed."""
    from voxtral_mlx.playback import Playback

    class Player:
        def __init__(self) -> None:
            self.sizes: list[int] = []

        def feed(self, audio, **_):
            self.sizes.append(len(audio))

        def finish(self):
            pass

        def stop(self):
            pass

    player = Player()
    chunks = [frame(0), np.zeros(0, np.float32), frame(1, 100), np.zeros(0, np.float32)]
    playback = Playback(_ReadyStream(chunks), player)  # type: ignore[arg-type]
    assert playback.wait(5) is True
    assert player.sizes == [FRAME, 100]


def test_playback_with_a_horizon_feeds_audio_and_segment_ends_only():
    """With a horizon, an empty chunk reaches the player only when it ends a segment."""
    from voxtral_mlx.playback import Playback

    seen: list[tuple[int, bool]] = []

    class Horizon:
        more_coming = True

        def __call__(self, chunk):
            seen.append((len(chunk.audio), chunk.ends_segment))
            return 1.0

    class Player:
        def __init__(self) -> None:
            self.fed: list[tuple[int, float | None, bool | None]] = []

        def feed(self, audio, expected_total_s=None, more_coming=None):
            self.fed.append((len(audio), expected_total_s, more_coming))

        def finish(self):
            pass

        def stop(self):
            pass

    empty = np.zeros(0, np.float32)
    chunks = [(frame(0), False), (empty, False), (frame(1, 10), False), (empty, True)]

    class Stream(FrameStream):
        def __iter__(self):
            for audio, ends in chunks:
                yield SimpleNamespace(
                    audio=audio, frames=-(-len(audio) // FRAME), segment=0, ends_segment=ends
                )

    player = Player()
    playback = Playback(Stream(), player, horizon=Horizon)  # type: ignore[arg-type]
    assert playback.wait(5) is True
    assert player.fed == [(FRAME, 1.0, True), (10, 1.0, True), (0, 1.0, True)]
    assert seen == [(FRAME, False), (10, False), (0, True)]


def test_an_error_that_stop_causes_in_the_apps_player_is_not_raised_by_wait():
    """A feed() that fails because stop() interrupted it is no error for wait() to raise."""
    from voxtral_mlx.playback import Playback

    in_feed, stopped = threading.Event(), threading.Event()

    class Player:
        def feed(self, audio, **_):
            in_feed.set()
            stopped.wait(5)
            raise RuntimeError("feed() interrupted by stop()")

        def finish(self):
            pass

        def stop(self):
            stopped.set()

    playback = Playback(FrameStream(), Player())  # type: ignore[arg-type]
    assert in_feed.wait(5)
    playback.stop()
    assert playback.wait(5) is True
    assert playback.error is None


def test_playback_end_keeps_an_error_that_came_first():
    """end(error) while a failure is still being handled keeps the failure for wait()."""
    from voxtral_mlx.playback import Playback

    release = threading.Event()

    class Player:
        def feed(self, audio, **_):
            raise RuntimeError("the device went away")

        def finish(self):
            pass

        def stop(self):
            if threading.current_thread().name == "voxtral-mlx-say":
                release.wait(5)  # the playback thread is still handling its failure

    playback = Playback(FrameStream(), Player())  # type: ignore[arg-type]
    assert _wait_until(lambda: playback.error is not None)
    assert not playback.done
    playback.end(RuntimeError("the model was closed"))
    release.set()
    with pytest.raises(RuntimeError, match="device went away"):
        playback.wait(5)


def test_a_stop_during_the_split_skips_the_horizon_and_the_stream():
    """stop() while the text is being split: no horizon is made and no chunk is asked for."""
    from voxtral_mlx.playback import Playback

    splitting, stopped = threading.Event(), threading.Event()
    made: list[str] = []

    class Stream(FrameStream):
        def prepare(self) -> None:
            splitting.set()
            stopped.wait(5)

        def __iter__(self):
            made.append("iter")
            return super().__iter__()

    class Player:
        def feed(self, audio, **_):
            made.append("feed")

        def finish(self):
            made.append("finish")

        def stop(self):
            pass

    def horizon():
        made.append("horizon")
        return lambda chunk: 1.0

    playback = Playback(Stream(), Player(), horizon=horizon)  # type: ignore[arg-type]
    assert splitting.wait(5)
    playback.stop()
    stopped.set()
    assert playback.wait(5) is True
    assert made == []


# -- pause and resume -----------------------------------------------------------------------


def test_a_paused_player_plays_silence_and_resumes_where_it_was():
    """pause(): silence from the next block, nothing lost, no underrun counted, the stream
    left open; resume(): the next block carries on with the next sample."""
    p, sd = make_player()
    s = sd.streams[0]
    for i in range(6):
        p.feed(frame(i))
    assert p.started and np.array_equal(s.pump(), frame(0))
    assert p.played_samples == FRAME
    p.pause()
    p.pause()  # twice: still one pause
    assert p.paused
    for _ in range(4):
        sd.clock.advance(FRAME_S)
        assert not s.pump().any()
    assert p.played_samples == FRAME and p.buffered_s == 5 * FRAME_S
    p.resume()
    assert not p.paused
    for i in range(1, 6):
        assert np.array_equal(s.pump(), frame(i))
    assert p.stats.underruns == 0 and p.stats.underrun_s == 0.0
    assert s.active and not s.closed and s.count("abort") == 0


def test_a_paused_player_is_no_stalled_device_and_finishes_after_resume():
    """finish() waits through a pause of any length (the device keeps calling back), and
    returns once the rest has played after resume(); stop() ends a paused player at once."""
    p, sd = make_player()
    s = sd.streams[0]
    for i in range(3):
        p.feed(frame(i))
    p.pause()
    t, result = run_in_thread(p.finish)
    for _ in range(20):  # a long pause: callbacks go on, in silence
        sd.clock.advance(1.0)
        assert not s.pump().any()
        time.sleep(0.005)
    assert t.is_alive() and "error" not in result
    p.resume()
    played = []
    deadline = time.monotonic() + 5
    while t.is_alive() and time.monotonic() < deadline:
        played.append(s.pump())
        sd.clock.advance(FRAME_S)
        time.sleep(0.01)
    t.join(2)
    assert not t.is_alive() and "error" not in result
    audio = np.concatenate([b for b in played if b is not None])
    assert np.array_equal(audio[: 3 * FRAME], np.concatenate([frame(i) for i in range(3)]))

    p2, _ = make_player()
    for i in range(3):
        p2.feed(frame(i))
    p2.pause()
    t, result = run_in_thread(p2.finish)
    time.sleep(0.05)
    p2.stop()
    t.join(2)
    assert not t.is_alive() and "error" not in result and p2.closed
