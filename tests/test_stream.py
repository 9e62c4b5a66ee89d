"""The streaming API: chunks as they decode, equal to one-shot synthesis, stoppable."""

from __future__ import annotations

import queue
import threading
import time
import traceback

import numpy as np
import pytest

import voxtral_mlx
from voxtral_mlx.engine import DONE, AudioChunk, Job, Timings
from voxtral_mlx.errors import InputError, UsageError, VoxtralError
from voxtral_mlx.segment import Segment
from voxtral_mlx.textstream import TextStream

TEXT = "Streaming test sentence number one."
VOICE = "casual_female"


@pytest.fixture(scope="module")
def noise():
    return np.random.default_rng(7).standard_normal((40, 36)).astype(np.float32)


@pytest.fixture(scope="module")
def noend_tts(tiny_checkpoint_noend):
    model = voxtral_mlx.load(tiny_checkpoint_noend, prefix_cache_dir=None)
    yield model
    model.close()


@pytest.mark.parametrize("chunk_frames", [1, 2, 3, 5, 25])
def test_stream_concatenation_equals_synthesize(noend_tts, noise, chunk_frames):
    """Without END the 40 rows of noise make 40 frames: every chunk size streams several
    chunks, the last one partial where 40 is not a multiple."""
    one_shot = noend_tts.synthesize(TEXT, VOICE, noise=noise)
    chunks = list(noend_tts.stream(TEXT, VOICE, noise=noise, chunk_frames=chunk_frames))
    assert len(one_shot.codes) == len(noise) and len(chunks) >= len(noise) // chunk_frames
    assert [c.is_final for c in chunks] == [False] * (len(chunks) - 1) + [True]
    starts = [c.frame_index for c in chunks]
    assert starts == list(np.cumsum([0] + [c.frames for c in chunks[:-1]]))
    assert all(c.frames == chunk_frames for c in chunks[:-1])
    assert all(len(c.audio) == c.frames * 1920 for c in chunks)
    np.testing.assert_array_equal(np.concatenate([c.codes for c in chunks]), one_shot.codes)
    audio = np.concatenate([c.audio for c in chunks])
    assert audio.dtype == np.float32 and audio.shape == one_shot.audio.shape
    assert np.max(np.abs(audio - one_shot.audio)) <= 1e-5


def test_stream_with_seed_equals_synthesize(tiny_tts):
    a = np.concatenate([c.audio for c in tiny_tts.stream(TEXT, VOICE, seed=42, max_frames=30)])
    b = tiny_tts.synthesize(TEXT, VOICE, seed=42, max_frames=30).audio
    assert a.shape == b.shape and np.max(np.abs(a - b)) <= 1e-5


def test_first_chunk_needs_only_one_frame(tiny_tts, noise, monkeypatch):
    """The first chunk is handed over after prefill and one frame: the engine has waited for
    exactly one frame (one END check); the second is at most queued, not waited for."""
    batch = tiny_tts.engine._batch
    polls = {"n": 0}
    original = batch.poll

    def poll():
        produced = original()
        polls["n"] += bool(produced)
        return produced

    monkeypatch.setattr(batch, "poll", poll)
    at_emit = []
    original_emit = Job._emit

    def emit(job, item):
        if isinstance(item, AudioChunk) and not at_emit:
            at_emit.append(polls["n"])
        original_emit(job, item)

    monkeypatch.setattr(Job, "_emit", emit)
    stream = tiny_tts.stream(TEXT, VOICE, noise=noise, chunk_frames=1)
    first = next(stream)
    assert first.frames == 1 and len(first.audio) == 1920
    assert at_emit == [1]
    assert first.timings.first_audio_s > 0
    stream.close()


def test_closing_the_stream_stops_generation(noend_tts, monkeypatch):
    """On a model whose END never comes (500 frames asked for), close() stops the job
    within a frame: cancelled, not run to its end."""
    model = noend_tts.model
    steps = {"n": 0}
    original = model.step

    def step(*args, **kwargs):
        steps["n"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(model, "step", step)
    stream = noend_tts.stream(TEXT, VOICE, seed=1, chunk_frames=1, max_frames=500)
    next(stream)
    next(stream)
    job = stream.jobs[0][1]
    stream.close()
    at_close = steps["n"]
    time.sleep(0.2)  # ~25 frames' time on this config
    # A frame already queued may finish; nothing after it. (How many frames ran before
    # close() depends on how soon this thread got to run after its second chunk.)
    assert steps["n"] <= at_close + 1
    assert job.done and job.seq.stop_reason == "cancelled" and job.seq.frames < 100
    # The model is free again: another thread can use it right away.
    done = threading.Event()

    def other():
        noend_tts.synthesize(TEXT, VOICE, seed=1, max_frames=2)
        done.set()

    t = threading.Thread(target=other)
    t.start()
    t.join(timeout=60)
    assert done.is_set()


def test_bad_chunk_size(tiny_tts):
    with pytest.raises(InputError):
        next(tiny_tts.stream(TEXT, VOICE, seed=0, chunk_frames=0))


def test_voice_prefix_cache_gives_identical_output(tiny_tts, noise):
    engine = tiny_tts.engine
    tiny_tts.clear_prefix_cache()
    fresh = tiny_tts.synthesize(TEXT, VOICE, noise=noise)
    assert not fresh.timings.prefix_cached
    cached = tiny_tts.synthesize(TEXT, VOICE, noise=noise)
    assert cached.timings.prefix_cached
    np.testing.assert_array_equal(fresh.codes, cached.codes)
    np.testing.assert_array_equal(fresh.audio, cached.audio)
    # With the cache off every request prefills its own prefix: still identical.
    engine.prefix_cache_voices = 0
    try:
        tiny_tts.clear_prefix_cache()
        uncached = tiny_tts.synthesize(TEXT, VOICE, noise=noise)
        assert not uncached.timings.prefix_cached
        np.testing.assert_array_equal(uncached.audio, fresh.audio)
    finally:
        engine.prefix_cache_voices = 8


# -- TextStream's bookkeeping, on a fake engine (no model) ---------------------------


class FakeJob:
    """Answers like the engine: one chunk and DONE when submitted; a final chunk and DONE
    when cancelled."""

    def __init__(self, i: int, on_cancel=None) -> None:
        self.i = i
        self.output: queue.SimpleQueue = queue.SimpleQueue()
        self.cancelled = False
        self.on_cancel = on_cancel
        self.ahead = False

    def needed(self) -> None:
        self.ahead = False

    def put_chunk(self, final: bool) -> None:
        audio = np.full(1920, self.i + 1, np.float32)
        codes = np.zeros((1, 37), np.int32)
        self.output.put(AudioChunk(audio, 24000, 0, 1, final, codes, Timings(), self.i))

    def cancel(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            self.put_chunk(final=True)
            self.output.put(DONE)
        if self.on_cancel is not None:
            self.on_cancel()


def _segments(n: int) -> list[Segment]:
    return [Segment(f"Part {i}.", 0, 0, 0.4, f"Part {i}.") for i in range(n)]


def _answer(jobs: list[FakeJob]) -> None:
    for job in jobs:
        if not job.cancelled:
            job.put_chunk(final=True)
            job.output.put(DONE)


def test_cancel_while_a_segment_job_is_being_made_cancels_that_job_too():
    entered, go = threading.Event(), threading.Event()
    made: list[FakeJob] = []

    def make_job(i, seg):
        if i == 1:
            entered.set()
            assert go.wait(10)
        made.append(FakeJob(i))
        return made[-1]

    stream = TextStream(_answer, make_job, _segments(3), 24000, 1, None)
    got: list = []
    consumer = threading.Thread(target=lambda: got.extend(stream))
    consumer.start()
    assert entered.wait(10)  # the consumer is making segment 1's job
    stream.cancel()
    go.set()
    consumer.join(10)
    assert not consumer.is_alive()
    assert len(made) == 2 and made[1].cancelled  # nothing left generating for nobody
    assert [float(c.audio[0]) for c in got if c.frames] == [1.0]


def test_cancel_from_another_thread_while_the_consumer_adds_a_job():
    entered, go = threading.Event(), threading.Event()
    made: list[FakeJob] = []

    def let_consumer_run() -> None:
        go.set()
        time.sleep(0.05)

    def make_job(i, seg):
        if i == 2:
            entered.set()
            assert go.wait(10)
        made.append(FakeJob(i, on_cancel=let_consumer_run))
        return made[-1]

    stream = TextStream(_answer, make_job, _segments(5), 24000, 2, None)
    errors: list[BaseException] = []

    def consume():
        try:
            list(stream)
        except BaseException as e:
            errors.append(e)

    consumer = threading.Thread(target=consume)
    consumer.start()
    assert entered.wait(10)  # segment 0 consumed, segment 2's job being made
    stream.cancel()  # the consumer appends segment 2's job while cancel() goes through
    consumer.join(10)
    assert not consumer.is_alive() and not errors
    assert len(made) == 3 and all(j.cancelled for j in made[1:])


def test_no_pause_is_returned_after_cancel():
    made: list[FakeJob] = []

    def make_job(i, seg):
        made.append(FakeJob(i))
        return made[-1]

    stream = TextStream(lambda jobs: None, make_job, _segments(3), 24000, 1, None)
    made[0].put_chunk(final=True)  # segment 0 is complete but for its DONE
    first = next(stream)
    stream.cancel()  # its DONE arrives: no pause (and nothing else) should follow
    assert first.frames == 1
    assert stream._on_item(DONE) == []


def test_timings_count_the_frames_delivered_before_cancel(noend_tts):
    """A cancelled segment sends no final chunk: its frames delivered so far still count."""
    text = "One sentence here. Another sentence there."
    with noend_tts.stream(text, VOICE, seed=1, split=True, max_frames=40, chunk_frames=2) as s:
        got = [next(s), next(s), next(s)]
        s.cancel()
        got += list(s)
    frames = sum(c.frames for c in got)
    assert frames >= 3 and not any(c.is_final for c in got)
    assert s.timings.frames == frames


def test_interrupted_wait_cancels_the_segments_generating_ahead():
    made: list[FakeJob] = []

    class Interrupting(queue.SimpleQueue):
        def get(self, *args, **kwargs):
            raise KeyboardInterrupt

    def make_job(i, seg):
        made.append(FakeJob(i))
        made[-1].output = Interrupting()
        return made[-1]

    stream = TextStream(lambda jobs: None, make_job, _segments(5), 24000, 4, None)
    with pytest.raises(KeyboardInterrupt):
        next(stream)
    assert len(made) == 4 and all(j.cancelled for j in made)
    with pytest.raises(UsageError, match=r"stopped on an error \(KeyboardInterrupt\)"):
        next(stream)  # not a quiet end: its audio is cut short


@pytest.mark.parametrize("pause", [-0.5, float("nan"), float("inf"), 1e9, 10**400, "1"])
def test_bad_pause_is_an_input_error_when_the_stream_is_made(pause):
    # Not a crash in numpy at the first segment boundary (or a 87 TiB allocation).
    with pytest.raises(InputError, match="pause"):
        TextStream(_answer, lambda i, seg: FakeJob(i), _segments(2), 24000, 1, pause)
    assert TextStream(_answer, lambda i, seg: FakeJob(i), _segments(2), 24000, 1, 0.25).pause


def test_a_failed_segment_reaches_say_wait_and_stops_the_others():
    """An error in generation is not a stop() by the user: say()'s wait() re-raises it."""
    from voxtral_mlx.playback import Playback

    made: list[FakeJob] = []

    def make_job(i, seg):
        made.append(FakeJob(i))
        return made[-1]

    def submit(jobs):
        for job in jobs:
            if job.i == 0:
                job.output.put(RuntimeError("the codec failed"))

    class Player:
        fed, finished, stopped = 0, False, False

        def feed(self, audio, **_):
            self.fed += 1

        def finish(self):
            self.finished = True

        def stop(self):
            self.stopped = True

    player = Player()
    playback = Playback(TextStream(submit, make_job, _segments(4), 24000, 3, None), player)
    with pytest.raises(RuntimeError, match="codec failed"):
        playback.wait(10)
    assert player.stopped and not player.finished
    assert len(made) == 3 and all(j.cancelled for j in made)  # nothing left generating


def test_an_error_before_stop_is_still_reported_by_wait():
    """stop() silences what it causes itself, not a failure that came before it."""
    from voxtral_mlx.playback import Playback

    class Player:
        stopped = False

        def feed(self, audio, **_):
            raise RuntimeError("the device went away")

        def finish(self):
            pass

        def stop(self):
            self.stopped = True

    player = Player()
    stream = TextStream(_answer, lambda i, seg: FakeJob(i), _segments(2), 24000, 1, None)
    playback = Playback(stream, player)
    playback._thread.join(10)
    assert playback.done and player.stopped
    playback.stop()
    with pytest.raises(RuntimeError, match="device went away"):
        playback.wait(10)


def test_jobs_generated_ahead_are_marked_until_the_consumer_reaches_them():
    """The engine lets a job generated ahead give way to one someone waits for: the stream
    says which is which, and a job stops being ahead when the one before it is done."""
    made: list[FakeJob] = []

    def make_job(i, seg):
        made.append(FakeJob(i))
        return made[-1]

    stream = TextStream(_answer, make_job, _segments(4), 24000, 3, None)
    first = next(stream)
    assert first.segment == 0 and [j.ahead for j in made] == [False, True, True]
    pause = next(stream)  # segment 0's DONE: the pause after it, and segment 1 is needed
    assert pause.segment == 0 and not pause.frames
    assert [j.ahead for j in made] == [False, False, True]
    assert len(list(stream)) > 0 and not any(j.ahead for j in made)


def test_a_player_whose_stop_fails_too_reports_the_first_error_and_wait_repeats_it():
    """The device went away: feed() and then stop() raise. stop()'s error escaped the
    playback thread as a traceback on stderr, and each wait() grew the error's traceback."""
    from voxtral_mlx.playback import Playback

    class Player:
        def feed(self, audio, **_):
            raise RuntimeError("the device went away")

        def finish(self):
            pass

        def stop(self):
            raise OSError("no such device")

    escaped: list[object] = []
    old_hook = threading.excepthook
    threading.excepthook = escaped.append
    try:
        stream = TextStream(_answer, lambda i, seg: FakeJob(i), _segments(2), 24000, 1, None)
        playback = Playback(stream, Player())
        playback._thread.join(10)
    finally:
        threading.excepthook = old_hook
    assert playback.done and escaped == []
    depths = []
    for _ in range(3):
        with pytest.raises(RuntimeError, match="device went away") as e:
            playback.wait(10)
        depths.append(len(traceback.extract_tb(e.value.__traceback__)))
    assert depths[0] == depths[1] == depths[2]


def test_waiting_for_playback_on_the_model_worker_raises_instead_of_hanging():
    from voxtral_mlx.playback import Playback
    from voxtral_mlx.worker import worker_wait_error

    def refuse():
        raise worker_wait_error()

    gate = threading.Event()

    class Player:
        def feed(self, audio, **_):
            gate.wait(10)

        def finish(self):
            pass

        def stop(self):
            gate.set()

    stream = TextStream(_answer, lambda i, seg: FakeJob(i), _segments(2), 24000, 1, None)
    playback = Playback(stream, Player(), refuse_wait=refuse)
    with pytest.raises(VoxtralError, match="worker thread"):
        playback.wait()
    playback.stop()
    playback._thread.join(10)
    assert playback.wait() is True  # done: nothing left to wait for, so no refusal


@pytest.mark.parametrize(("lookahead", "later"), [(3, 8), (1, None)])
def test_set_chunk_frames_reaches_segments_in_flight_and_ahead(lookahead, later):
    """Segments submitted ahead take the size set; one the consumer waits for from its
    start (nothing in flight: live text that stalled, lookahead 1) starts at its own."""
    made: list[FakeJob] = []

    def make_job(i, seg):
        made.append(FakeJob(i))
        made[-1].later_chunk_frames = None
        return made[-1]

    stream = TextStream(_answer, make_job, _segments(5), 24000, lookahead, None)
    stream.set_chunk_frames(8)
    assert [j.later_chunk_frames for j in made] == [8] * lookahead  # in flight
    chunks = list(stream)
    assert len(made) == 5 and chunks[-1].is_final
    assert [j.later_chunk_frames for j in made[lookahead:]] == [later] * (5 - lookahead)
