"""Long text and apps: batched segments equal sequential synthesis, bounded memory, threads,
asyncio, cancellation and say()."""

from __future__ import annotations

import _thread
import asyncio
import threading
import time

import mlx.core as mx
import numpy as np
import pytest

import voxtral_mlx
import voxtral_mlx.engine as engine_mod
from voxtral_mlx.segment import split_text

VOICE = "neutral_male"
STORY = (
    "The lighthouse keeper woke before dawn. He climbed the stairs, one hundred and twelve "
    "of them, as he had for thirty years. The lamp was still warm; the sea was calm! "
    "Far away, a ship sounded its horn, and he waved, although nobody could see him. "
    "Then he made tea. It was, he thought, a perfectly ordinary morning"
)


@pytest.fixture(scope="module")
def tts(tiny_checkpoint_noend):
    """Float32 tiny model whose END never fires, so every segment runs ``max_frames``."""
    model = voxtral_mlx.load(tiny_checkpoint_noend)
    yield model
    model.close()


def test_the_types_the_api_returns_are_exported(tts):
    from voxtral_mlx.playback import Playback

    assert set(voxtral_mlx.__all__) <= set(dir(voxtral_mlx))
    stream = tts.stream("Hi.", seed=1, max_frames=1)
    assert isinstance(stream, voxtral_mlx.TextStream)
    stream.close()
    astream = tts.astream("Hi.", seed=1, max_frames=1)
    assert isinstance(astream, voxtral_mlx.AsyncTextStream)
    asyncio.run(astream.aclose())
    assert isinstance(tts.voices["casual_male"], voxtral_mlx.Voice)
    assert voxtral_mlx.Playback is Playback


def test_the_documented_attributes_are_there(tts, tiny_checkpoint_noend):
    """What VoxtralTTS's docstring lists for apps (a voice picker among them)."""
    from voxtral_mlx.voices import Voice

    picker = {name: v.language for name, v in tts.voices.items()}
    assert picker["casual_male"] == "en" and picker["fr_male"] == "fr"
    assert all(isinstance(v, Voice) for v in tts.voices.values())
    assert tts.default_voice == "casual_male"
    assert tts.path == tiny_checkpoint_noend and tts.layout == "mistral"
    assert [p.name for p in tts.weight_files] == ["consolidated.safetensors"]
    assert tts.quantized == {} and tts.dtype == mx.float32  # the checkpoint's own
    assert tts.config.sampling_rate == tts.sample_rate == 24000
    assert tts.samples_per_frame == 1920 and tts.tokenizer.encode("Hi") != []
    assert tts.engine.idle_cache_bytes >= 0


def test_batched_segments_equal_sequential_synthesis(tts, batch_sizes, monkeypatch):
    segments = split_text(STORY, target_chars=60, max_chars=120)
    assert len(segments) >= 4
    chunks = list(
        tts.stream(
            STORY,
            VOICE,
            seed=100,
            split=True,
            max_chars=120,
            max_frames=9,
            pause=0.25,
            chunk_frames=2,
        )
    )
    monkeypatch.undo()  # the references below run one at a time
    assert max(batch_sizes) == tts.engine.max_batch == 4  # the segments ran as one batch
    by_segment: dict[int, list] = {}
    for c in chunks:
        by_segment.setdefault(c.segment, []).append(c)
    assert sorted(by_segment) == list(range(len(segments)))
    assert [c.segment for c in chunks] == sorted(c.segment for c in chunks)  # text order
    assert chunks[-1].is_final and not any(c.is_final for c in chunks[:-1])
    for i, seg in enumerate(segments):
        assert seg.spoken[-1] in ".!?;"
        ref = tts.synthesize(seg.spoken, VOICE, seed=100 + i, max_frames=9)
        got = by_segment[i]
        codes = np.concatenate([c.codes for c in got])
        np.testing.assert_array_equal(codes, ref.codes)
        speech = np.concatenate([c.audio for c in got if c.frames])
        np.testing.assert_allclose(speech, ref.audio, atol=1e-5)
        pauses = [c for c in got if c.frames == 0 and len(c.audio)]
        if i < len(segments) - 1:
            assert len(pauses) == 1 and len(pauses[0].audio) == round(0.25 * 24000)
            assert not pauses[0].audio.any()
        else:
            assert not pauses
    whole = tts.synthesize(
        STORY, VOICE, seed=100, split=True, max_chars=120, max_frames=9, pause=0.25
    )
    np.testing.assert_array_equal(whole.audio, np.concatenate([c.audio for c in chunks]))
    assert whole.seed == 100 and whole.timings.frames == 9 * len(segments)


@pytest.mark.parametrize("mode", ["thread", "asyncio"])
def test_the_first_segment_speaks_before_the_others_are_prefilled(tts, monkeypatch, mode):
    """A long text hands its first segments to the worker in one task, and the engine
    prefills one job per frame after delivering first chunks: the first segment's first
    audio waits for neither the other segments' hand-over nor their prefill."""
    events: list[str] = []
    prefill, deliver, submit = engine_mod.prefill, tts.engine._deliver, tts.worker.submit

    def recording_prefill(model, seq, *args):
        events.append("prefill")
        return prefill(model, seq, *args)

    def recording_deliver(ready):
        events.extend("audio" for _, _, audio, _ in ready if audio is not None)
        return deliver(ready)

    def recording_submit(fn):
        events.append("task")
        return submit(fn)

    monkeypatch.setattr(engine_mod, "prefill", recording_prefill)
    monkeypatch.setattr(tts.engine, "_deliver", recording_deliver)
    monkeypatch.setattr(tts.worker, "submit", recording_submit)
    kwargs = {"seed": 0, "split": True, "max_chars": 80, "max_frames": 3}
    if mode == "thread":
        chunks = list(tts.stream(STORY, VOICE, **kwargs))
    else:

        async def collect():
            return [c async for c in tts.astream(STORY, VOICE, **kwargs)]

        chunks = asyncio.run(collect())
    assert len({c.segment for c in chunks}) == chunks[0].segments >= 4
    tts.worker.call(lambda: None)
    first_audio = events.index("audio")
    assert events[:first_audio].count("prefill") == 1, events
    assert events[:first_audio].count("task") == 1, events  # all four handed over at once
    assert events.count("prefill") == chunks[0].segments


def test_memory_stays_flat_over_a_long_text(tts):
    """Six times the segments, the same peak: at most ``lookahead`` segments are in flight
    (each holds its KV cache, ~0.2 MiB here), and nothing of a finished one is kept. (The
    bound was 15 % of the peak + 4 MiB, mostly the weights: 40 segments' KV caches kept
    passed it.)"""
    sentence = "This sentence is one of many in a very long chapter. "

    def peak_for(n_segments: int) -> int:
        text = sentence * n_segments
        tts.call(mx.reset_peak_memory)
        total = 0
        stream = tts.stream(text, VOICE, seed=0, split=True, max_chars=60, max_frames=4)
        in_flight = set()
        for chunk in stream:
            total += len(chunk.audio)  # consumed and dropped, like a file writer
            in_flight.add(len(stream.jobs))
        assert len(stream.segments) == n_segments
        assert total >= n_segments * 4 * 1920 and max(in_flight) <= stream.lookahead
        return tts.call(mx.get_peak_memory)

    peak_for(8)  # a first run settles what any run allocates once
    small, large = peak_for(8), peak_for(48)
    assert large - small <= (1 << 20), (small, large)


def test_threads_share_the_model_safely(tts):
    texts = [f"Thread number {i} says hello to everyone." for i in range(4)]
    expected = [tts.synthesize(t, VOICE, seed=i, max_frames=12).codes for i, t in enumerate(texts)]
    results: dict[int, np.ndarray] = {}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            results[i] = tts.synthesize(texts[i], VOICE, seed=i, max_frames=12).codes
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors
    for i in range(4):
        np.testing.assert_array_equal(results[i], expected[i])


def test_asyncio_does_not_block_the_loop(tts):
    expected = tts.synthesize("Async hello.", VOICE, seed=5, max_frames=20)

    async def main():
        gaps = []
        stop = asyncio.Event()

        async def ticker():
            last = time.perf_counter()
            while not stop.is_set():
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        tick = asyncio.create_task(ticker())
        speech = await tts.asynthesize("Async hello.", VOICE, seed=5, max_frames=20)
        chunks = [c async for c in tts.astream("Async hello.", VOICE, seed=5, max_frames=20)]
        stop.set()
        await tick
        return speech, chunks, max(gaps)

    speech, chunks, worst_gap = asyncio.run(main())
    np.testing.assert_array_equal(speech.codes, expected.codes)
    np.testing.assert_allclose(np.concatenate([c.audio for c in chunks]), expected.audio, atol=1e-5)
    assert worst_gap < 0.25, worst_gap


def test_asynthesize_splits_a_long_text_off_the_event_loop(tts, monkeypatch):
    """Splitting a chapter takes ~0.1 s: asynthesize(split=True) does it on another thread
    (it ran on the loop's), with the same result as synthesize."""
    import voxtral_mlx.tts as tts_mod

    threads = []

    def recording_split(*args, **kwargs):
        threads.append(threading.current_thread())
        return split_text(*args, **kwargs)

    monkeypatch.setattr(tts_mod, "split_text", recording_split)
    text = "One small sentence. And another one"
    expected = tts.synthesize(text, VOICE, seed=3, max_frames=3, split=True)

    async def main():
        speech = await tts.asynthesize(text, VOICE, seed=3, max_frames=3, split=True)
        return speech, threading.current_thread()

    speech, loop_thread = asyncio.run(main())
    assert len(threads) == 2 and threads[1] is not loop_thread
    np.testing.assert_array_equal(speech.codes, expected.codes)
    np.testing.assert_array_equal(speech.audio, expected.audio)


def test_timings_count_the_segments_cut_short_by_max_frames(tts):
    """Every segment of this END-less model stops at max_frames: each is counted (the audio
    was cut short without a word); a pause-only segment (no frames asked for) is not."""
    speech = tts.synthesize(STORY, VOICE, seed=1, max_frames=2, split=True, max_chars=120)
    segments = split_text(STORY, target_chars=60, max_chars=120)
    assert len(segments) > 2 and speech.timings.cut_short == len(segments)
    assert tts.synthesize("Hello.", VOICE, seed=1, max_frames=2).timings.cut_short == 1
    text = "Hello.\n\n\u200b\n\nAgain."  # a pause-only segment in the middle
    assert tts.synthesize(text, VOICE, seed=1, max_frames=2, split=True).timings.cut_short == 2


def test_timings_tell_the_wait_for_a_batch_slot_from_the_prefill(tts):
    """A request queued behind a running one (max_batch 1): its wait is ``queued_s``, not
    part of ``prefill_s``, and ``ms_per_frame`` counts from joining the batch."""
    tts.synthesize("Warm.", VOICE, seed=1, max_frames=1)  # the prefix cached, steps compiled
    tts.engine.max_batch = 1
    try:
        first = tts.job("The first request runs for a while.", VOICE, seed=1, max_frames=40)
        second = tts.job("Hello.", VOICE, seed=2, max_frames=3)
        tts.submit(first)
        tts.submit(second)
        outputs = [_drain(job) for job in (first, second)]
    finally:
        tts.engine.max_batch = 4
    t1, t2 = (out[-1].timings for out in outputs)
    assert t2.queued_s > 0.5 * t1.total_s  # it waited for most of the first one's frames
    assert t2.prefill_s < t2.queued_s / 5
    assert t2.frames == 3
    rest = t2.total_s - t2.queued_s - t2.prefill_s
    assert t2.ms_per_frame == pytest.approx(1000 * rest / 3)
    assert 0 < rest < t2.total_s / 2


def _drain(job):
    out = []
    while (item := job.output.get(timeout=60)) is not engine_mod.DONE:
        if isinstance(item, BaseException):
            raise item
        out.append(item)
    return out


def _frames_after_cancel(tts, cancel):
    stream = tts.stream("Cancel me " * 20, VOICE, seed=1, max_frames=500)
    next(stream)
    job = stream.jobs[0][1]
    before = job.seq.frames
    cancel(stream)
    deadline = time.monotonic() + 10
    while not job.done and time.monotonic() < deadline:
        time.sleep(0.005)
    assert job.done and job.seq.stop_reason == "cancelled"
    return job.seq.frames - before


def test_cancel_from_another_thread_stops_within_a_frame(tts):
    def cancel(stream):
        t = threading.Thread(target=stream.cancel)
        t.start()
        t.join()

    # The worker keeps generating while the consumer is slow; after cancel() at most the
    # frame in flight (and the one queued behind it) completes: 0 in 40 runs on an idle
    # machine; one more is allowed for a test thread descheduled between the two reads.
    assert _frames_after_cancel(tts, cancel) <= 3
    assert not tts.engine.busy or tts.engine._jobs == {}


def test_cancelling_an_async_task_stops_generation(tts):
    async def main():
        stream = tts.astream("Cancel me too " * 20, VOICE, seed=2, max_frames=500)

        async def consume():
            async for _ in stream:
                await asyncio.sleep(0)

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        job = stream.jobs[0][1] if stream.jobs else None
        return job

    job = asyncio.run(main())
    deadline = time.monotonic() + 10
    while job is not None and not job.done and time.monotonic() < deadline:
        time.sleep(0.005)
    assert job is not None
    assert job.seq.stop_reason == "cancelled" and job.seq.frames < 500


def test_cancelling_an_asynthesize_task_stops_generation(tts, monkeypatch):
    made = []
    job = tts.job

    def recording_job(*args, **kwargs):
        made.append(job(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(tts, "job", recording_job)

    async def main():
        task = asyncio.create_task(tts.asynthesize("Cancel me " * 20, VOICE, max_frames=500))
        while not (made and made[0].seq.frames):
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    deadline = time.monotonic() + 10
    while not made[0].done and time.monotonic() < deadline:
        time.sleep(0.005)
    assert made[0].seq.stop_reason == "cancelled" and made[0].seq.frames < 100


class RecordingPlayer:
    def __init__(self):
        self.fed, self.finished, self.stopped = [], False, False
        self.after_stop: list[str] = []

    def feed(self, audio, **_):
        if self.stopped:
            self.after_stop.append("feed")
        self.fed.append(np.array(audio))
        time.sleep(0.002)

    def finish(self):
        if self.stopped:
            self.after_stop.append("finish")
        self.finished = True

    def stop(self):
        self.stopped = True


def test_say_plays_everything_and_can_be_stopped(tts):
    player = RecordingPlayer()
    playback = tts.say(STORY, VOICE, seed=3, player=player, max_frames=10)
    assert playback.done and player.finished and not player.stopped
    played = np.concatenate(player.fed)
    expected = tts.synthesize(STORY, VOICE, seed=3, split=True, max_frames=10)
    np.testing.assert_allclose(played, expected.audio, atol=1e-5)

    player2 = RecordingPlayer()
    playback = tts.say(
        "A long text to interrupt. " * 30, VOICE, seed=4, wait=False, player=player2, max_frames=200
    )
    time.sleep(0.2)
    playback.stop()
    assert playback.wait(timeout=10)
    # A stopped player is not asked to play out the rest (a custom sink would drain).
    assert player2.stopped and player2.after_stop == [] and not player2.finished


class PlayingOutPlayer(RecordingPlayer):
    """finish() plays out for up to 5 s, until stopped; once it starts, the main thread is
    interrupted without a signal, as ``_thread.interrupt_main()`` does (IDLE stops code so)."""

    def __init__(self):
        super().__init__()
        self.released = threading.Event()

    def finish(self):
        super().finish()
        threading.Timer(0.2, _thread.interrupt_main).start()
        self.released.wait(5)

    def stop(self):
        super().stop()
        self.released.set()


def test_an_interrupt_without_a_signal_stops_say_while_it_plays_out(tts):
    player = PlayingOutPlayer()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        tts.say("Hello there.", VOICE, seed=3, player=player, max_frames=4)
    assert time.monotonic() - t0 < 3  # not after the 5 s play-out
    assert player.finished and player.stopped


def test_say_splits_its_text_on_the_playback_thread(tts, split_threads):
    """say(wait=False) from a UI thread returns before a chapter's split (~0.1 s); a bad
    argument still raises at once."""
    threads = split_threads
    player = RecordingPlayer()
    playback = tts.say(STORY, VOICE, seed=3, wait=False, player=player, max_frames=10)
    assert playback.wait(timeout=60) and player.finished
    assert len(threads) == 1 and threads[0] is not threading.current_thread()
    played = np.concatenate(player.fed)
    expected = tts.synthesize(STORY, VOICE, seed=3, split=True, max_frames=10)
    np.testing.assert_allclose(played, expected.audio, atol=1e-5)
    with pytest.raises(voxtral_mlx.errors.InputError, match="max_frames"):
        tts.say(STORY, VOICE, wait=False, player=RecordingPlayer(), max_frames=-1)


def test_say_stops_generating_when_the_player_fails(tts):
    """A player that fails (the device went away) ends generation too, and wait() reports it."""

    class Failing:
        def __init__(self) -> None:
            self.fed = 0

        def feed(self, audio) -> None:
            self.fed += 1
            if self.fed == 3:
                raise RuntimeError("device gone")

        def finish(self) -> None:
            pass

        def stop(self) -> None:
            pass

    playback = tts.say("A long text. " * 40, wait=False, player=Failing(), max_frames=400)
    with pytest.raises(RuntimeError, match="device gone"):
        playback.wait(timeout=30)
    deadline = time.monotonic() + 5
    while tts.engine.stats()["active"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert tts.engine.stats() == {"active": 0, "waiting": 0, "parked": 0, "max_batch": 4}


def test_waiting_on_a_playback_from_its_own_player_is_refused_in_one_line(tts):
    """An app's player calling back into code that waits on the say() handle would wait for
    itself: a UsageError saying so (it was threading's 'cannot join current thread'), which
    also becomes the playback's error for wait() elsewhere."""
    from voxtral_mlx.errors import UsageError

    handle = {}
    seen, polls = [], []
    ready = threading.Event()

    class Waiting:
        def feed(self, audio) -> None:
            ready.wait(10)  # until the handle is stored
            polls.append(handle["playback"].wait(0))  # a poll does not wait: allowed
            try:
                handle["playback"].wait(1)
            except UsageError as e:
                seen.append(e)
                raise

        def finish(self) -> None:
            pass

        def stop(self) -> None:
            pass

    handle["playback"] = tts.say("Hello.", VOICE, wait=False, player=Waiting(), max_frames=3)
    ready.set()
    with pytest.raises(UsageError, match="own thread"):
        handle["playback"].wait(timeout=30)
    assert len(seen) == 1 and polls == [False]


def test_a_voice_is_read_on_the_worker_thread(tiny_checkpoint, monkeypatch):
    """MLX work belongs to the model's worker: a voice's first use read and evaluated it on
    whatever thread made the request (on Metal before MLX 0.31.2, two threads evaluating at
    once crash). Later uses take the cached array."""
    from voxtral_mlx.voices import VoiceRegistry

    threads: list[threading.Thread] = []
    original = VoiceRegistry._load

    def load(self, voice):
        threads.append(threading.current_thread())
        return original(self, voice)

    monkeypatch.setattr(VoiceRegistry, "_load", load)
    model = voxtral_mlx.load(tiny_checkpoint, prefix_cache_dir=None)
    try:
        voices = sorted(model.voices)[:3]
        model.prompt_ids("Hi.", voices[0])  # the row count, from a voice tekken.json lists
        model.job("Hi.", voices[1], seed=0, max_frames=1)  # read when the job starts
        assert threads == []
        model.synthesize("Hi.", voices[1], seed=0, max_frames=1)
        done = threading.Event()

        def from_another_thread():
            model.synthesize("Hi.", voices[2], seed=0, max_frames=1)
            model.synthesize("Hi.", voices[2], seed=1, max_frames=1)  # cached: not read again
            done.set()

        threading.Thread(target=from_another_thread).start()
        assert done.wait(30)
        assert threads and all(t is model.worker._thread for t in threads), threads
        assert len(threads) == 2  # voices[1] and voices[2]; voices[0]'s count is listed
    finally:
        model.close()


def test_say_plans_its_pre_roll_for_the_text_as_speak_does(tts, monkeypatch):
    """say() fed the player no expected length, so its pre-roll assumed a fixed one and
    audio generated slower than real time stuttered where `speak` played through."""
    import voxtral_mlx.audio.player as player_mod

    players: list[RecordingPlayer] = []

    class Player(RecordingPlayer):
        def __init__(self, *args, **kwargs):
            super().__init__()
            self.expected: list[float | None] = []
            players.append(self)

        def feed(self, audio, expected_total_s=None, more_coming=False):
            self.expected.append(expected_total_s)
            super().feed(audio)

    monkeypatch.setattr(player_mod, "AudioPlayer", Player)
    tts.say(STORY, VOICE, seed=3, max_frames=10)
    (player,) = players
    assert player.finished and len(player.expected) == len(player.fed) > 1
    assert all(isinstance(e, float) and e > 0 for e in player.expected), player.expected


def test_stopping_say_while_it_splits_a_book_abandons_the_split(tts):
    """stop() right after say(wait=False): the playback thread went on splitting (about a
    second for 100,000 words) and tokenizing every segment before it noticed."""
    book = " ".join(f"w{i % 89}" if i % 13 else f"word{i}, and more." for i in range(200_000))
    player = RecordingPlayer()
    playback = tts.say(book, VOICE, seed=1, wait=False, player=player, max_frames=2)
    playback.stop()
    assert playback.wait(timeout=60)
    assert playback.stream.segments == [] and player.fed == [] and playback.error is None


def test_cancelling_an_async_stream_while_it_splits_a_book_abandons_the_split(tts):
    book = " ".join(f"w{i % 89}" if i % 13 else f"word{i}, and more." for i in range(200_000))

    async def main():
        stream = tts.astream(book, VOICE, seed=1, split=True, max_frames=2)
        task = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.05)  # the split has started in its thread
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return stream

    stream = asyncio.run(main())  # asyncio.run waits for the split's thread to end
    assert stream.segments == [] and not stream.jobs


@pytest.mark.parametrize("speed", [1.0, 1.5])
def test_say_can_be_paused_resumed_and_followed_segment_by_segment(tts, speed):
    """A reading app's Pause button and sentence highlighting: pause() holds the speech
    (the device plays silence, nothing is lost), resume() plays on from there, and
    `segment` names the segment being heard, each in turn, with `played_s` counting."""
    from test_player import FRAME, FakeSD

    from voxtral_mlx.audio.player import AudioPlayer

    text = "Good morning.\n\nThe tea is ready.\n\nIt is raining outside.\n\nBring an umbrella."
    sd = FakeSD()
    player = AudioPlayer(tts.sample_rate, sd=sd, clock=sd.clock)
    playback = tts.say(text, VOICE, seed=3, wait=False, player=player, max_frames=10, speed=speed)
    assert playback.segment is None and playback.played_s == 0.0 and not playback.paused
    stream = sd.streams[0]
    expected = tts.synthesize(text, VOICE, seed=3, split=True, max_frames=10).audio
    if speed != 1.0:
        from voxtral_mlx.audio.stretch import SegmentStretcher

        stretch = SegmentStretcher(speed, tts.sample_rate)
        chunks = tts.stream(text, VOICE, seed=3, split=True, max_frames=10)
        expected = np.concatenate([stretch(c) for c in chunks])
    expected = np.clip(expected, -1.0, 1.0)  # as the player plays it
    heard, seen, paused = [], [], False
    deadline = time.monotonic() + 60
    while not playback.done and time.monotonic() < deadline:
        if len(heard) == 12 and not paused:
            paused = True
            playback.pause()
            assert playback.paused
            at, segment = playback.played_s, playback.segment
            for _ in range(5):
                sd.clock.advance(FRAME / tts.sample_rate)
                block = stream.pump()
                assert block is not None and not block.any()
            assert playback.played_s == at and playback.segment is segment
            assert not playback.wait(timeout=0)
            playback.resume()
            assert not playback.paused
        buffered = round(player.buffered_s * tts.sample_rate)
        if not player.started or (
            buffered < FRAME and player.played_samples + buffered < len(expected)
        ):
            time.sleep(0.002)  # as a device that never runs dry: a block once one is there
            continue
        block = stream.pump()
        sd.clock.advance(FRAME / tts.sample_rate)
        if block is None:  # closed, once the end has played
            continue
        heard.append(block)
        segment = playback.segment
        if segment is not None and (not seen or seen[-1] is not segment):
            seen.append(segment)
        assert playback.played_s == pytest.approx(min(len(heard) * FRAME, len(expected)) / 24000)
    assert playback.wait(timeout=10) and paused
    played = np.concatenate(heard)
    np.testing.assert_allclose(played[: len(expected)], expected, atol=1e-5)
    assert not played[len(expected) :].any()
    segments = playback.stream.segments
    assert [s.text for s in segments] == [s.text for s in split_text(text)]
    assert len(segments) == 4 and len(seen) == 4
    assert all(a is b for a, b in zip(seen, segments))
    assert [s.text for s in seen] == [text[s.start : s.end] for s in segments]


def test_pausing_a_player_that_cannot_pause_says_so(tts):
    playback = tts.say(STORY, VOICE, wait=False, player=RecordingPlayer(), max_frames=2)
    with pytest.raises(voxtral_mlx.errors.UsageError, match=r"RecordingPlayer\) has no pause"):
        playback.pause()
    with pytest.raises(voxtral_mlx.errors.UsageError, match="has no resume"):
        playback.resume()
    assert not playback.paused and playback.played_s is None and playback.segment is None
    assert playback.wait(timeout=30)


def test_say_speed_plays_the_speech_faster_at_the_same_pitch(tts):
    from voxtral_mlx.audio.stretch import SegmentStretcher

    text = "Good morning.\n\nThe tea is ready.\n\nIt is raining outside."
    player = RecordingPlayer()
    tts.say(text, VOICE, seed=3, player=player, max_frames=10, speed=1.25)
    stretch = SegmentStretcher(1.25, tts.sample_rate)
    chunks = tts.stream(text, VOICE, seed=3, split=True, max_frames=10, chunk_frames=4)
    expected = np.concatenate([stretch(c) for c in chunks])
    np.testing.assert_allclose(np.concatenate(player.fed), expected, atol=1e-5)
    plain = tts.synthesize(text, VOICE, seed=3, split=True, max_frames=10).audio
    assert len(expected) == pytest.approx(len(plain) / 1.25, abs=3 * 480)
    for bad in (0.1, 5, float("nan"), "fast"):
        with pytest.raises(voxtral_mlx.errors.InputError, match="speed must be a number"):
            tts.say(text, VOICE, wait=False, player=RecordingPlayer(), speed=bad)
