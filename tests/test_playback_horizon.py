"""`speak`'s pre-roll for a split text: the player must start once the segment being heard
can play through, not wait for the whole text at that segment's rate (the segments after
it are generated beside it and arrive in a burst when it ends)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from test_player import FRAME, FRAME_S, SR, FakeClock, frame, make_player

from voxtral_mlx.audio.horizon import TOKENIZED_AHEAD, PlaybackHorizon
from voxtral_mlx.playback import Playback

SEGMENTS = 3
FRAMES = 25  # per segment (2 s): --max-frames 25
STEP_S = FRAME_S / 0.6  # one engine step: a frame for every segment, 0.6x real time each


def fake_tts() -> SimpleNamespace:
    # Plenty of words: each segment's guess is capped by max_frames (2 s).
    return SimpleNamespace(
        sample_rate=SR,
        samples_per_frame=FRAME,
        tokenizer=SimpleNamespace(encode=lambda text: text.split()),
    )


def fake_stream(pause: float = 0.0) -> SimpleNamespace:
    segments = [
        SimpleNamespace(text="word " * 40, spoken="word " * 40, pause_after=pause)
        for _ in range(SEGMENTS)
    ]
    return SimpleNamespace(segments=segments, timings=SimpleNamespace(audio_s=0.0), ahead_s=0.0)


def counted_horizon(spoken: list[str]) -> tuple[PlaybackHorizon, SimpleNamespace, list[str]]:
    """A horizon over segments of ``spoken`` text, the stream it reads, and the texts its
    tokenizer was asked to encode (in order)."""
    calls: list[str] = []

    def encode(text: str) -> list[str]:
        calls.append(text)
        return text.split()

    tts = fake_tts()
    tts.tokenizer = SimpleNamespace(encode=encode)
    segments = [SimpleNamespace(text=s, spoken=s, pause_after=0.0) for s in spoken]
    stream = SimpleNamespace(segments=segments, timings=SimpleNamespace(audio_s=0.0), ahead_s=0.0)
    return PlaybackHorizon(tts, stream, FRAMES, None, started=0.0), stream, calls


def simulate(horizon_for) -> tuple[float, float, int, float]:
    """Three segments generated side by side, delivered in order, played by a device that
    takes one block every 80 ms. Returns (start time, end of generation, underruns,
    seconds played)."""
    clock = FakeClock(0.0)
    player, sd = make_player(clock)
    device = sd.streams[0]
    stream = fake_stream()
    horizon = horizon_for(stream, clock)
    generated = [0] * SEGMENTS  # frames made per segment
    delivered = [0] * SEGMENTS
    head = 0
    next_step, next_block, end_of_generation, played = STEP_S, FRAME_S, None, 0
    for _ in range(100_000):  # bounded: a bug here must fail, not hang
        t = min(next_step, next_block)
        clock.advance(t - clock.t)
        step_due, block_due = t == next_step, t == next_block
        if step_due:
            next_step += STEP_S
        if step_due and head < SEGMENTS:
            for i in range(head, SEGMENTS):
                generated[i] = min(FRAMES, generated[i] + 1)
            if all(g == FRAMES for g in generated) and end_of_generation is None:
                end_of_generation = t
            stream.ahead_s = sum(generated[head + 1 :]) * FRAME_S
            while head < SEGMENTS and delivered[head] < generated[head]:
                chunk = SimpleNamespace(audio=frame(delivered[head]), segment=head)
                delivered[head] += 1
                stream.timings.audio_s += FRAME_S
                player.feed(chunk.audio, expected_total_s=horizon(chunk, now=t))
                if delivered[head] == FRAMES:  # the next segment is now the one heard
                    head += 1
                    stream.ahead_s = sum(generated[head + 1 :]) * FRAME_S
            if head == SEGMENTS:
                player._start(t)  # as finish() does, without its blocking drain
        if block_due:
            next_block += FRAME_S
            if device.active:
                device.pump()
                played += 1
                if played * FRAME >= SEGMENTS * FRAMES * FRAME:
                    break
    else:
        pytest.fail("the simulation did not play everything")
    return player.stats.started_at, end_of_generation, player.stats.underruns, played


def test_a_split_text_starts_once_its_first_segment_can_play_through():
    def ours(stream, clock):
        return PlaybackHorizon(fake_tts(), stream, FRAMES, None, started=clock.t)

    def whole_text(stream, clock):  # what speak did before: the whole text at the head's rate
        return lambda chunk, now=None: SEGMENTS * FRAMES * FRAME_S

    start, end, underruns, _ = simulate(ours)
    old_start, _, old_underruns, _ = simulate(whole_text)
    # The first segment alone: 0.16 + 1.1 * (1 - 0.6) * 2 s = 1.04 s buffered, 1.73 s in.
    assert start == pytest.approx(1.04 / 0.6 + STEP_S, abs=2 * STEP_S)
    assert start < end - 1.0 and underruns == 0
    assert old_start >= end - STEP_S and old_underruns == 0


def test_slower_than_real_time_overall_plans_for_the_whole_text():
    """When all segments together are generated slower than real time, the ones ahead do
    not keep up either: the whole text's length is the horizon, as for one utterance."""
    stream = fake_stream(pause=0.5)
    horizon = PlaybackHorizon(fake_tts(), stream, FRAMES, None, started=0.0)
    assert horizon.total_s == pytest.approx(3 * 2.0 + 2 * 0.5)
    chunk = SimpleNamespace(audio=frame(0), segment=0)
    stream.timings.audio_s, stream.ahead_s = FRAME_S, 2 * FRAME_S
    assert horizon(chunk, now=1.0) == pytest.approx(horizon.total_s)  # 0.24 s in 1 s
    assert horizon(chunk, now=0.1) == pytest.approx(2.0)  # 2.4x: fed + the rest of segment 0
    single = SimpleNamespace(segments=stream.segments[:1], timings=stream.timings, ahead_s=0.0)
    assert PlaybackHorizon(fake_tts(), single, FRAMES, None, 0.0)(chunk, now=0.1) == 2.0


def test_a_long_text_is_not_tokenized_before_it_plays():
    """A book's segments were all tokenized before its first chunk could play (0.26 s for
    100,000 words here); later ones are guessed from their length until they start."""
    n = TOKENIZED_AHEAD + 100
    spoken = ["word " * 3] * TOKENIZED_AHEAD + ["word " * 3] * 99 + ["longer word " * 3]
    horizon, stream, calls = counted_horizon(spoken)
    assert len(calls) == TOKENIZED_AHEAD
    # 0.2 tokens per character: the last segment guessed at 7.2 tokens, capped at 2 s
    assert horizon.total_s == pytest.approx((n - 1) * 0.9 + 2.0)
    stream.timings.audio_s = stream.ahead_s = 100.0
    horizon(SimpleNamespace(audio=frame(0), segment=n - 1), now=1.0)
    assert len(calls) == TOKENIZED_AHEAD + 1 and horizon.segment_s[n - 1] == pytest.approx(1.8)


def test_live_text_plans_for_the_segment_playing_only():
    """Text still arriving has no known length: the horizon is the audio fed plus what the
    segment being heard still has to come, so what has come plays when the text stalls."""
    segments = [SimpleNamespace(spoken="word " * 5, pause_after=0.4)]
    stream = SimpleNamespace(
        segments=segments, timings=SimpleNamespace(audio_s=0.0), ahead_s=0.0, live=True
    )
    horizon = PlaybackHorizon(fake_tts(), stream, FRAMES, None, started=0.0)
    assert horizon.total_s is None and horizon.segment_s == []
    assert horizon(live_chunk(0), now=5.0) == pytest.approx(1.5)
    for _ in range(18):  # 19 frames: 1.52 s, more than its 5 words' guess
        fed = horizon(live_chunk(0), now=5.0)
    assert fed == pytest.approx(19 * FRAME_S)
    segments.append(SimpleNamespace(spoken="word " * 6, pause_after=0.0))  # cut meanwhile
    got = horizon(live_chunk(1), now=5.0)
    assert got == pytest.approx(20 * FRAME_S + 1.8 - FRAME_S)
    assert horizon.segment_s == pytest.approx([1.5, 1.8])


def live_chunk(segment: int, ends_segment: bool = False) -> SimpleNamespace:
    return SimpleNamespace(audio=frame(0), segment=segment, ends_segment=ends_segment)


def test_live_text_whose_segment_ended_early_plays_what_came_while_the_text_stalls():
    """A segment whose END came well before its guess, on a machine slower than real time:
    with no text after it yet, what came must start playing, not wait in the pre-roll for
    audio the guess promised (until the next text came, or the end)."""
    clock = FakeClock(0.0)
    player, sd = make_player(clock)
    segments = [SimpleNamespace(spoken="word " * 20, pause_after=0.5)]  # guessed 2 s
    stream = SimpleNamespace(
        segments=segments, timings=SimpleNamespace(audio_s=0.0), ahead_s=0.0, live=True
    )
    horizon = PlaybackHorizon(fake_tts(), stream, FRAMES, None, started=0.0)
    for i in range(5):  # 0.4 s of audio at 0.5x real time, then END
        clock.advance(2 * FRAME_S)
        chunk = live_chunk(0, ends_segment=i == 4)
        player.feed(chunk.audio, expected_total_s=horizon(chunk, now=clock.t))
        assert sd.streams[0].active == (i == 4)
        # The text waits after its segment's end (no next one cut): a gap then is no
        # slow generation, and the player plays the next audio at once (AudioPlayer.feed).
        assert horizon.more_coming == (i != 4)
    assert horizon.segment_s == [2.0]
    # When the next segment was cut already, the horizon is fed + the pause + its guess.
    segments.append(SimpleNamespace(spoken="word " * 3, pause_after=0.0))
    horizon = PlaybackHorizon(fake_tts(), stream, FRAMES, 0.25, started=0.0)
    got = horizon(live_chunk(0, ends_segment=True), now=1.0)
    assert got == pytest.approx(FRAME_S + 0.25 + 0.9)
    assert horizon.more_coming  # the next segment is on its way


def test_an_empty_last_chunk_of_a_live_segment_still_starts_what_came():
    """END on a frame of its own (``chunk_frames=1``, as speak and say stream) makes a
    segment's last chunk empty: it must still reach the horizon and the player, or what
    came waits in the pre-roll for as long as the text stalls."""
    clock = FakeClock(0.0)
    player, sd = make_player(clock)
    text_comes = threading.Event()

    class LiveStream:
        live, text_error, ahead_s, sample_rate = True, None, 0.0, 24000

        def __init__(self):
            self.segments = [SimpleNamespace(spoken="word " * 20, pause_after=0.5)]  # 2 s
            self.timings = SimpleNamespace(audio_s=0.0)

        def prepare(self):
            pass

        def cancel(self):
            text_comes.set()

        def set_chunk_frames(self, frames):
            self.chunk_frames = frames

        def __iter__(self):
            for _ in range(5):  # 0.4 s at 0.5x real time, then END
                clock.advance(2 * FRAME_S)
                yield SimpleNamespace(audio=frame(0), frames=1, segment=0, ends_segment=False)
            yield SimpleNamespace(
                audio=np.zeros(0, np.float32), frames=0, segment=0, ends_segment=True
            )
            text_comes.wait(30)  # the rest of the text has yet to come

    stream = LiveStream()

    def horizon():
        return PlaybackHorizon(fake_tts(), stream, FRAMES, None, started=0.0)

    playback = Playback(stream, player, horizon)
    try:
        deadline = time.monotonic() + 10
        while not sd.streams[0].active and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sd.streams[0].active and not text_comes.is_set()
        assert player.buffered_s == pytest.approx(5 * FRAME_S)
    finally:
        playback.stop()


def test_the_whole_text_plan_leaves_out_pauses_that_blank_segments_no_longer_make():
    """A zero-width mark after the last paragraph is a segment of its own that plays no
    pause now: the plan's total must not count one either (0.75 s too long)."""
    from voxtral_mlx.segment import split_text

    words = "word " * 10
    segments = split_text(f"{words}.\n\n\u200b")
    assert len(segments) == 2 and segments[0].pause_after > 0
    stream = SimpleNamespace(segments=segments, timings=SimpleNamespace(audio_s=0.0), ahead_s=0.0)
    horizon = PlaybackHorizon(fake_tts(), stream, FRAMES, None, started=0.0)
    assert horizon.total_s == pytest.approx(max(1.0, sum(horizon.segment_s)))
