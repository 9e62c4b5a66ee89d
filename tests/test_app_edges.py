"""Requests from apps: bad arguments are one-line InputErrors, cancel() ends a stream at once
and spends no more work on it."""

from __future__ import annotations

import asyncio
import itertools
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

import voxtral_mlx
import voxtral_mlx.engine as engine_mod
from voxtral_mlx.engine import CallbackWarning
from voxtral_mlx.errors import InputError, VoxtralError
from voxtral_mlx.segment import PARAGRAPH, PAUSE_AFTER, split_text

VOICE = "neutral_male"
TEXT = "A stream that is cancelled before its first chunk is due. " * 4


@pytest.fixture(scope="module")
def tts(tiny_checkpoint_noend):
    model = voxtral_mlx.load(tiny_checkpoint_noend)
    yield model
    model.close()


BAD_ARGUMENTS = [
    ("max_frames", None),
    ("max_frames", "3"),
    ("max_frames", 3.5),
    ("max_frames", True),
    ("chunk_frames", None),
    ("chunk_frames", 1.5),
    ("cfg_alpha", None),
    ("cfg_alpha", "1.2"),
    ("max_chars", "100"),
    ("max_chars", 100.5),
    ("max_chars", 1),
    ("lookahead", "2"),
    ("lookahead", -1),
    ("lookahead", 0),  # nothing in flight would be nothing generated
    ("split", "no"),  # a truthy string must not mean yes
    ("add_period", None),
]


@pytest.mark.parametrize(("name", "value"), BAD_ARGUMENTS)
def test_bad_arguments_are_input_errors(tts, name, value):
    kwargs = {"seed": 0, "split": True, name: value}
    with pytest.raises(InputError, match=name):
        tts.stream("Hello there.", VOICE, **kwargs)
    with pytest.raises(InputError, match=name):
        tts.astream("Hello there.", VOICE, **kwargs)
    if name not in ("chunk_frames", "lookahead"):
        with pytest.raises(InputError, match=name):
            tts.synthesize("Hello there.", VOICE, **kwargs)
    assert tts.engine.stats()["waiting"] == 0


@pytest.mark.parametrize(("name", "value"), [("pause", 0.5), ("pause", 0), ("lookahead", 2)])
def test_segment_options_without_split_are_refused_not_ignored(tts, name, value):
    calls = (tts.stream, tts.astream) + ((tts.synthesize,) if name == "pause" else ())
    for call in calls:
        with pytest.raises(InputError, match=f"{name}= applies to the segments.*split=True"):
            call("One. Two.", VOICE, seed=0, **{name: value})
    # A bad value is named as such, split or not.
    with pytest.raises(InputError, match="pause must be a number of seconds"):
        tts.synthesize("One. Two.", VOICE, seed=0, pause=-1)
    assert tts.engine.stats()["waiting"] == 0


@pytest.mark.parametrize(
    "text", [" \t\n\u3000", "\u200b\u2060\ufeff", "\u200e \x00\x1f", "\u3164\u115f \uffa0"]
)
@pytest.mark.parametrize("split", [False, True])
def test_text_with_nothing_visible_is_empty(tts, text, split):
    """Zero-width, format and control characters alone are no text to speak."""
    for call in (tts.synthesize, tts.stream, tts.astream):
        with pytest.raises(InputError, match="text is empty"):
            call(text, VOICE, seed=0, split=split, max_frames=2)
    assert tts.engine.stats()["waiting"] == 0


@pytest.mark.parametrize("text", ["...", " !? ", "«—»", "\u200b."])
def test_text_of_punctuation_alone_is_spoken(tts, text):
    """It is what its writer asked for (a hesitation, a pause): not an error, not silence."""
    one = tts.synthesize(text.strip(), VOICE, seed=0, max_frames=2)
    split = tts.synthesize(text, VOICE, seed=0, max_frames=2, split=True)
    assert len(one.codes) == 2 and np.array_equal(split.codes, one.codes)


def test_a_period_cut_off_from_a_long_url_is_only_a_pause(tts):
    """A URL of exactly max_chars before its period leaves the period alone (a URL is never
    cut): it is a pause, not an utterance of "." (the model would babble)."""
    text = "https://example.com/" + "a" * 30 + ".\n\nThen stop."
    chunks = list(tts.stream(text, VOICE, seed=1, split=True, max_chars=50, max_frames=3))
    segments = split_text(text, target_chars=25, max_chars=50)
    assert [s.text for s in segments][1] == "."
    assert [c.segment for c in chunks if c.frames] == [0, 0, 0, 2, 2, 2]


def test_invisible_characters_next_to_words_are_spoken(tts, tiny_checkpoint_noend):
    """Zero-width characters beside words are kept in the prompt as written (prompt_ids:
    raw text, no normalisation): the ids are mistral-common's encode_speech_request ones,
    both as built and as the engine runs them, and the request is spoken, not refused."""
    from mistral_common.protocol.speech.request import SpeechRequest
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    text = "Hi \u200bthere\u2060."
    ref = MistralTokenizer.from_file(str(tiny_checkpoint_noend / "tekken.json"))
    request = SpeechRequest(input=text, voice=VOICE)
    expected = ref.instruct_tokenizer.encode_speech_request(request).tokens
    visible = SpeechRequest(input="Hi there.", voice=VOICE)
    assert expected != ref.instruct_tokenizer.encode_speech_request(visible).tokens
    assert tts.prompt_ids(text, VOICE) == expected
    text_start = expected.index(tts.tokenizer.special_id("[NEXT_AUDIO_TEXT]")) + 1
    job = tts.job(text, VOICE, seed=0, max_frames=2)
    assert list(job.text_ids) == expected[text_start:]
    speech = tts.synthesize(text, VOICE, seed=0, max_frames=2)
    assert len(speech.codes) == 2


@pytest.mark.parametrize("add_period", [True, False])
def test_a_paragraph_of_invisible_characters_is_only_a_pause(tts, add_period):
    """Split text whose middle paragraph is zero-width characters alone: that segment keeps
    its place (segments and seeds as split_text numbers them) but makes no sound; the real
    paragraphs are spoken exactly as on their own with seed + index, one paragraph's pause
    apart (the blank one's own pause once doubled it). Without add_period that segment's
    text is blank: the request failed with 'text is empty'."""
    text = "Hello there.\n\n\u200b\u2060\ufeff\n\nWorld again."
    kwargs = {"split": True, "max_frames": 2, "add_period": add_period}
    chunks = list(tts.stream(text, VOICE, seed=3, **kwargs))
    assert {c.segments for c in chunks} == {3}
    assert [c.segment for c in chunks if c.frames] == [0, 0, 2, 2]
    silent = [c for c in chunks if c.segment == 1]
    assert silent and not any(c.frames or c.audio.any() for c in silent)
    first = tts.synthesize("Hello there.", VOICE, seed=3, max_frames=2)
    last = tts.synthesize("World again.", VOICE, seed=5, max_frames=2)
    got = tts.synthesize(text, VOICE, seed=3, **kwargs)
    np.testing.assert_array_equal(got.codes, np.concatenate([first.codes, last.codes]))
    pauses = sum(len(c.audio) for c in chunks if not c.frames)
    assert len(got.audio) == len(first.audio) + len(last.audio) + pauses
    assert pauses == round(PAUSE_AFTER[PARAGRAPH] * tts.sample_rate)


@pytest.mark.parametrize("pause", [None, 0.5])
def test_invisible_characters_at_either_end_add_no_silence(tts, pause):
    """A zero-width space or byte order mark after the last paragraph (or before the
    first, as files joined with `cat` have them) is a segment of its own that says nothing:
    the audio neither starts nor ends with a paragraph's silence for it; a run of them
    between two sentences makes one pause, however many there are."""
    kwargs = {"split": True, "max_frames": 2, "pause": pause}
    alone = tts.synthesize("Hello.", VOICE, seed=1, **kwargs)
    for text in ("Hello.\n\n\u200b", "Hello.\n\n\u200b\n\n\ufeff\n\n\u2060"):
        got = tts.synthesize(text, VOICE, seed=1, **kwargs)
        np.testing.assert_array_equal(got.audio, alone.audio)
    later = tts.synthesize("Hello.", VOICE, seed=3, **kwargs)  # segment 2's seed
    got = tts.synthesize("\ufeff\n\n\u200b\n\nHello.", VOICE, seed=1, **kwargs)
    np.testing.assert_array_equal(got.audio, later.audio)
    two = tts.synthesize("Hello.\n\nAgain.", VOICE, seed=1, **kwargs)
    many = "Hello.\n\n" + "\u200b\n\n" * 3 + "Again."  # "Again." is segment 4
    got = tts.synthesize(many, VOICE, seed=1, **kwargs)
    again = tts.synthesize("Again.", VOICE, seed=5, max_frames=2)
    gap = round((PAUSE_AFTER[PARAGRAPH] if pause is None else pause) * tts.sample_rate)
    assert len(two.audio) - len(alone.audio) - gap == len(again.audio)  # same lengths
    np.testing.assert_array_equal(got.audio[: len(alone.audio)], alone.audio)
    assert not got.audio[len(alone.audio) : len(alone.audio) + gap].any()
    np.testing.assert_array_equal(got.audio[len(alone.audio) + gap :], again.audio)


@pytest.mark.parametrize("live", [False, True])
def test_a_pause_of_invisible_characters_prefills_no_text(tts, live, monkeypatch):
    """A run of zero-width characters between two sentences is cut into pause segments,
    which generate nothing: each was still prefilled with its hundreds of invisible
    characters' tokens, one part per frame, holding up the words after them (seconds on
    the real model). Its prompt is a lone "." now, and the audio is the same."""
    made: list[tuple[str, int]] = []
    real_job = tts.job

    def job(text, *args, **kwargs):
        made.append((text, kwargs["max_frames"]))
        return real_job(text, *args, **kwargs)

    monkeypatch.setattr(tts, "job", job)
    prefills: list[int] = []
    real_prefill = engine_mod.prefill

    def prefill(model, seq, text, cache):
        prefills.append(text.shape[1])
        return real_prefill(model, seq, text, cache)

    monkeypatch.setattr(engine_mod, "prefill", prefill)
    tts.synthesize("Hi.", VOICE, seed=0, max_frames=1)  # the voice's prefix is cached
    made.clear()
    prefills.clear()
    text = "Hello." + "\u200b" * 3000 + " Bye."
    source = (text[i : i + 700] for i in range(0, len(text), 700)) if live else text
    got = tts.synthesize(source, VOICE, seed=1, split=True, max_frames=2)
    pauses = [t for t, frames in made if frames == 0]
    assert len(pauses) > 1 and set(pauses) == {"."}
    spoken = [t.strip("\u200b ") for t, frames in made if frames]
    assert spoken == ["Hello.", "Bye."]
    assert len(got.codes) == 4 and got.timings.frames == 4
    # Nor is a pause prefilled at all once its voice's prefix is cached: they make no frame.
    assert len(prefills) == 2
    # A text that begins with one: its timings are those of its first prefill (the pause's
    # empty ones were taken: no prompt, no prefill, the first words' prefill in ms/frame).
    stream = tts.stream("\u200b" * 2000 + "\n\nHello there.", VOICE, split=True, max_frames=2)
    assert sum(c.frames for c in stream) == 2
    assert stream.timings.prompt_tokens > 0 and stream.timings.prefix_cached
    assert stream.timings.prefill_s > 0


def test_numpy_integers_are_accepted(tts):
    speech = tts.synthesize(
        "Hi.", VOICE, seed=0, max_frames=np.int64(2), split=True, max_chars=np.int32(50)
    )
    assert len(speech.codes) == 2


def _count_decodes(tts, monkeypatch) -> list[int]:
    decoded: list[int] = []
    codec = tts.model.audio_tokenizer
    original = codec.decode_chunks

    def decode_chunks(chunks):
        decoded.extend(int(codes.shape[1]) for codes, _ in chunks)
        return original(chunks)

    monkeypatch.setattr(codec, "decode_chunks", decode_chunks)
    return decoded


def _wait_for_frames(job, n: int) -> None:
    deadline = time.monotonic() + 30
    while job.seq.frames < n and time.monotonic() < deadline:
        time.sleep(0.002)
    assert job.seq.frames >= n


def _wait_done(job) -> None:
    deadline = time.monotonic() + 10
    while not job.done and time.monotonic() < deadline:
        time.sleep(0.002)
    assert job.done and job.seq.stop_reason == "cancelled"


def test_cancel_hands_out_nothing_more_and_decodes_nothing(tts, monkeypatch):
    """A consumer blocked on the stream when cancel() comes gets no further chunk, and the
    frames generated but not yet decoded are dropped, not decoded for nobody."""
    decoded = _count_decodes(tts, monkeypatch)
    # No chunk is due before the end: all audio would be decoded at once when it stops.
    stream = tts.stream(TEXT, VOICE, seed=3, max_frames=500, chunk_frames=10_000)
    got: list = []
    consumer = threading.Thread(target=lambda: got.extend(stream))
    consumer.start()
    deadline = time.monotonic() + 30
    while not stream.jobs and time.monotonic() < deadline:
        time.sleep(0.002)
    job = stream.jobs[0][1]
    _wait_for_frames(job, 4)
    stream.cancel()
    consumer.join(timeout=10)
    assert not consumer.is_alive()
    _wait_done(job)
    assert got == []
    assert decoded == []
    assert tts.engine.stats()["active"] == 0


def test_async_cancel_handle_ends_the_stream_without_a_chunk(tts, monkeypatch):
    decoded = _count_decodes(tts, monkeypatch)

    async def main():
        stream = tts.astream(TEXT, VOICE, seed=4, max_frames=500, chunk_frames=10_000)

        async def consume() -> list:
            return [chunk async for chunk in stream]

        task = asyncio.create_task(consume())
        deadline = time.monotonic() + 30
        while not (stream.jobs and stream.jobs[0][1].seq.frames >= 4):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.002)
        job = stream.jobs[0][1]
        stream.cancel()
        chunks = await asyncio.wait_for(task, 10)
        return chunks, job

    chunks, job = asyncio.run(main())
    _wait_done(job)
    assert chunks == []
    assert decoded == []


def test_a_cancelled_job_next_to_running_ones_leaves_their_audio_intact(tts):
    """Dropping a cancelled job's frames must not touch the others in the batch."""
    expected = tts.synthesize("Keep talking.", VOICE, seed=7, max_frames=40)
    doomed = tts.stream(TEXT, VOICE, seed=8, max_frames=500, chunk_frames=10_000)
    doomed_iter = threading.Thread(target=lambda: list(doomed))
    doomed_iter.start()
    deadline = time.monotonic() + 30
    while not doomed.jobs and time.monotonic() < deadline:
        time.sleep(0.002)
    _wait_for_frames(doomed.jobs[0][1], 3)
    other = tts.stream("Keep talking.", VOICE, seed=7, max_frames=40, chunk_frames=4)
    chunks = [next(other)]  # both are in the batch now
    assert tts.engine.stats()["active"] == 2
    doomed.cancel()
    chunks += list(other)
    doomed_iter.join(timeout=10)
    assert not doomed_iter.is_alive()
    codes = np.concatenate([c.codes for c in chunks])
    audio = np.concatenate([c.audio for c in chunks])
    np.testing.assert_array_equal(codes, expected.codes)
    np.testing.assert_allclose(audio, expected.audio, atol=1e-5)


def test_a_long_run_of_flags_is_split_in_linear_time(monkeypatch):
    import voxtral_mlx.segment as segment

    calls = {"n": 0}
    original = segment._is_regional

    def counting(ch: str) -> bool:
        calls["n"] += 1
        return original(ch)

    monkeypatch.setattr(segment, "_is_regional", counting)
    n = 40_000
    segments = segment.split_text("\U0001f1eb" * n, target_chars=200, max_chars=400)
    assert "".join(s.text for s in segments) == "\U0001f1eb" * n
    assert all(len(s.text) % 2 == 0 for s in segments)  # flags stay whole
    assert calls["n"] < 10 * n  # quadratic before: every cut looked back to the run's start


def test_warmup_with_a_non_iterable_is_an_input_error(tts):
    with pytest.raises(InputError, match="voices must be"):
        tts.warmup(5, wait=False)


def test_cli_no_split_with_a_chapter_says_to_drop_the_flag(tiny_checkpoint, tmp_path):
    chapter = tmp_path / "chapter.txt"
    chapter.write_text("Word after word goes on and on. " * 2000, encoding="utf-8")
    out = tmp_path / "chapter.flac"
    args = ["speak", "-m", str(tiny_checkpoint), "-f", str(chapter), "-o", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "voxtral_mlx", *args, "--no-split"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and "drop --no-split" in proc.stderr, proc.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == [chapter]


def test_a_chapter_is_not_tokenized_up_front(tts, monkeypatch):
    """Creating a stream of a long text only encodes the segments it submits; short
    segments cannot exceed the token limit."""
    chapter = "One sentence of a long chapter, read aloud. " * 400
    calls = {"n": 0}
    original = tts.tokenizer.encode

    def encode(text: str) -> list[int]:
        calls["n"] += bool(text)
        return original(text)

    monkeypatch.setattr(tts.tokenizer, "encode", encode)
    stream = tts.stream(chapter, VOICE, split=True, lookahead=2)
    assert len(stream.segments) > 50
    assert calls["n"] <= 2
    stream.cancel()
    with pytest.raises(InputError, match="too long"):
        tts.stream("x" * 40_000, VOICE, split=True, max_chars=40_000)
    with pytest.raises(InputError, match="pass split=True"):
        tts.synthesize("word " * 10_000, VOICE, split=False)


def test_another_texts_first_segment_waits_less_than_segments_generated_ahead(
    tiny_checkpoint_noend,
):
    """With one batch slot, text A's segments 1 and 2 (generated ahead) were queued before
    text B's first segment: B's first audio waited for all of A."""
    from voxtral_mlx.engine import DONE

    tts = voxtral_mlx.load(tiny_checkpoint_noend, prefix_cache_dir=None, max_batch=1)
    done: list[str] = []
    try:
        jobs = []
        for name, segment in (("a0", 0), ("a1", 1), ("a2", 2), ("b0", 0)):
            job = tts.job("Words to say.", VOICE, seed=1, max_frames=2, chunk_frames=2)
            job.segment, job.ahead = segment, segment > 0
            job.on_output = lambda item, name=name: done.append(name) if item is DONE else None
            jobs.append(job)
        tts.worker.call(lambda: [tts.engine.submit(job) for job in jobs])  # one hand-over
        deadline = time.monotonic() + 60
        while len(done) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        tts.close()
    assert done == ["a0", "b0", "a1", "a2"]


def test_a_segment_its_consumer_reached_is_not_overtaken_by_every_new_request(
    tiny_checkpoint_noend,
):
    """Once text A's consumer waits for segment a1, a1 is served first come, first served
    with new requests: d0, submitted after a1 became needed, goes after it (new requests
    arriving non-stop used to keep a1 waiting for as long as they came)."""
    from voxtral_mlx.engine import DONE

    tts = voxtral_mlx.load(tiny_checkpoint_noend, prefix_cache_dir=None, max_batch=1)
    done: list[str] = []
    jobs: dict[str, object] = {}

    def on_output(name: str, item) -> None:  # on the worker thread
        if item is DONE:
            done.append(name)
            if name == "a0":
                jobs["a1"].needed()  # A's consumer reached a1
                jobs["d0"] = make("d0", 0)  # and a new request comes
                tts.engine.submit(jobs["d0"])

    def make(name: str, segment: int):
        job = tts.job("Words to say.", VOICE, seed=1, max_frames=2, chunk_frames=1)
        job.segment, job.ahead = segment, segment > 0
        job.on_output = lambda item: on_output(name, item)
        return job

    try:
        for name, segment in (("a0", 0), ("a1", 1), ("b0", 0)):
            jobs[name] = make(name, segment)
        tts.worker.call(lambda: [tts.engine.submit(jobs[n]) for n in ("a0", "a1", "b0")])
        _wait_for(lambda: len(done) == 4)
    finally:
        tts.close()
    assert done == ["a0", "b0", "a1", "d0"]


CHAPTER = "First part of it. Second part of it. Third part of it. Fourth one. Fifth one."


def _wait_for(condition, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _codes_of(job) -> np.ndarray:
    """A submitted job's codes, once it is done (the error it ended with is raised)."""
    codes = []
    while (item := job.output.get(timeout=60)) is not engine_mod.DONE:
        if isinstance(item, BaseException):
            raise item
        codes.append(item.codes)
    return np.concatenate(codes)


def test_a_new_request_takes_the_slot_of_a_segment_generated_ahead(tts):
    """A long text's segments fill the batch (lookahead = max_batch): a new request does not
    wait for one of them to finish; the segment generated furthest ahead is set aside and
    resumes later, and both outputs equal their solo runs."""
    long_kwargs = dict(seed=1, split=True, max_chars=20, max_frames=60)
    solo_long = tts.synthesize(CHAPTER, VOICE, **long_kwargs)
    solo_short = tts.synthesize("Quick one.", VOICE, seed=2, max_frames=6)
    assert tts.engine.max_batch == 4 and len(solo_long.codes) == 5 * 60

    with tts.stream(CHAPTER, VOICE, chunk_frames=4, **long_kwargs) as chapter:
        chunks = [next(chapter)]
        _wait_for(lambda: tts.engine.stats()["active"] == 4 and not tts.engine.stats()["waiting"])
        short = list(tts.stream("Quick one.", VOICE, seed=2, max_frames=6))
        head = chapter.jobs[0][1]
        assert not head.seq.finished and head.seq.frames < 60  # it never waited for one
        chunks += list(chapter)
    assert not tts.engine.busy and tts.engine.stats()["parked"] == 0
    np.testing.assert_array_equal(np.concatenate([c.codes for c in short]), solo_short.codes)
    np.testing.assert_array_equal(np.concatenate([c.codes for c in chunks]), solo_long.codes)
    np.testing.assert_array_equal(np.concatenate([c.audio for c in chunks]), solo_long.audio)


def test_a_new_request_does_not_wait_for_the_prefill_of_a_segment_generated_ahead(tts, monkeypatch):
    """A segment generated ahead is prefilled in parts; a request someone waits for that
    arrives meanwhile is prefilled first (the other resumes where it stopped), and both
    outputs equal their solo runs."""
    sentence = " ".join(f"word{i}" for i in range(40)) + "."
    text = f"{sentence} {sentence}"
    kwargs = dict(seed=3, split=True, max_chars=len(sentence) + 10, max_frames=8)
    monkeypatch.setattr(engine_mod, "PREFILL_PART_TOKENS", 4)
    solo_long = tts.synthesize(text, VOICE, **kwargs)
    solo_short = tts.synthesize("Quick one.", VOICE, seed=2, max_frames=6)

    events: list[tuple[str, int]] = []
    watched: dict[str, object] = {}
    started = threading.Event()
    prefill_part, prefill = engine_mod.prefill_part, engine_mod.prefill

    def part(model, text_embeds, cache):
        job = tts.engine._prefilling.job
        events.append(("part", id(job)))
        if job is watched.get("job"):
            started.set()
        time.sleep(0.01)  # the newcomer arrives during these parts
        return prefill_part(model, text_embeds, cache)

    def last(model, seq, text_embeds, cache):
        events.append(("last", id(tts.engine._prefilling.job)))
        return prefill(model, seq, text_embeds, cache)

    monkeypatch.setattr(engine_mod, "prefill_part", part)
    monkeypatch.setattr(engine_mod, "prefill", last)
    with tts.stream(text, VOICE, lookahead=2, **kwargs) as chapter:
        assert len(chapter.segments) >= 2
        watched["job"] = long_job = chapter.jobs[1][1]
        first = next(chapter)
        assert started.wait(30)
        short_stream = tts.stream("Quick one.", VOICE, seed=2, max_frames=6)
        short_job = short_stream.jobs[0][1]
        short = list(short_stream)
        rest = list(chapter)
    long_events = [i for i, (_, j) in enumerate(events) if j == id(long_job)]
    short_last = events.index(("last", id(short_job)))
    assert long_events[0] < short_last < long_events[-1]  # it came in between the parts
    assert events[long_events[-1]] == ("last", id(long_job))
    np.testing.assert_array_equal(np.concatenate([c.codes for c in short]), solo_short.codes)
    got = np.concatenate([c.codes for c in [first, *rest]])
    np.testing.assert_array_equal(got, solo_long.codes)
    _wait_for(lambda: not tts.engine.busy)


def test_a_set_aside_segment_that_is_cancelled_ends(tts):
    """Cancelling a text while one of its segments is set aside ends every segment."""
    long_kwargs = dict(seed=1, split=True, max_chars=20, max_frames=200)
    chapter = tts.stream(CHAPTER, VOICE, **long_kwargs)
    next(chapter)
    _wait_for(lambda: tts.engine.stats()["active"] == 4 and not tts.engine.stats()["waiting"])
    short = tts.stream("Quick one.", VOICE, seed=2, max_frames=200)
    next(short)
    _wait_for(lambda: tts.engine.stats()["parked"] == 1)
    chapter.cancel()
    short.cancel()
    _wait_for(lambda: not tts.engine.busy)
    assert tts.engine.stats() == {"active": 0, "waiting": 0, "parked": 0, "max_batch": 4}


def test_an_async_stream_splits_its_text_off_the_event_loop(tts, split_threads):
    """A chapter's split (~0.1 s) would hold up an app's event loop: astream() does it in a
    thread at the first item; other bad arguments still raise at once, and a segment too
    long for one utterance raises at the first item."""
    threads = split_threads
    text = "First sentence here. Second sentence there. A third one to finish."

    async def first_chunks():
        loop_thread = threading.current_thread()
        async with tts.astream(text, VOICE, seed=5, split=True, max_chars=30) as stream:
            before = list(stream.segments)
            first = await stream.__anext__()
        return loop_thread, before, first, stream

    loop_thread, before, first, stream = asyncio.run(first_chunks())
    assert before == [] and len(stream.segments) == 3
    assert first.segments == 3 and len(first.audio)
    assert len(threads) == 1 and threads[0] is not loop_thread
    with pytest.raises(InputError, match="pause"):
        tts.astream(text, VOICE, split=True, pause=-1)

    async def too_long():
        async for _ in tts.astream("x" * 40_000, VOICE, split=True, max_chars=40_000):
            pass

    with pytest.raises(InputError, match="too long") as exc:
        asyncio.run(too_long())
    assert "\n" not in str(exc.value)


def test_an_async_stream_tokenizes_a_long_unsplit_text_off_the_event_loop(tts, monkeypatch):
    """Without split, a long text is tokenized to learn whether it fits one utterance (0.3 s
    for 100,000 words, all on the event loop): astream() does it in a thread at the first
    item, where a text too long raises."""
    long_encodes: list[threading.Thread] = []
    encode = tts.tokenizer.encode

    def spy(text: str, *args, **kwargs):
        if len(text) > 2048:
            long_encodes.append(threading.current_thread())
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tts.tokenizer, "encode", spy)
    fits = "Words to say. " * 200

    async def first_chunk(text: str):
        loop_thread = threading.current_thread()
        stream = tts.astream(text, VOICE, seed=5, max_frames=2)
        made = list(long_encodes)
        try:
            return loop_thread, made, await stream.__anext__()
        finally:
            await stream.aclose()

    loop_thread, made, first = asyncio.run(first_chunk(fits))
    assert made == [] and first.frames == 1
    assert len(long_encodes) == 1 and long_encodes[0] is not loop_thread
    with pytest.raises(InputError, match="too long for one utterance") as exc:
        asyncio.run(first_chunk("x" * 40_000))
    assert "\n" not in str(exc.value) and long_encodes[-1] is not loop_thread


def test_an_async_stream_made_off_the_event_loop_iterates_on_it(tts):
    """The README's advice for a chapter: create the stream with asyncio.to_thread."""
    text = "First sentence here. Second sentence there. A third one to finish."

    async def collect(make) -> np.ndarray:
        stream = await make()
        return np.concatenate([c.codes async for c in stream])

    async def on_loop():
        return tts.astream(text, VOICE, seed=5, split=True, max_chars=30, max_frames=3)

    async def off_loop():
        return await asyncio.to_thread(
            tts.astream, text, VOICE, seed=5, split=True, max_chars=30, max_frames=3
        )

    here, there = asyncio.run(collect(on_loop)), asyncio.run(collect(off_loop))
    assert len(here) == 3 * 3
    np.testing.assert_array_equal(here, there)


def test_an_async_stream_whose_loop_ended_says_so_on_the_next(tts):
    """Its first loop closed while it generated (the chunk it was handed next was lost and
    the stream stopped): read on another loop, it must not end as if it were whole. A
    consumer gone is no failing callback: nothing is warned."""
    stream = tts.astream("Hello there.", VOICE, seed=1, max_frames=50)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert asyncio.run(stream.__anext__()).frames == 1
        deadline = time.monotonic() + 10
        while tts.engine.busy:  # the next chunk found the loop closed: the job was stopped
            assert time.monotonic() < deadline
            time.sleep(0.01)
    assert not [w for w in caught if w.category is CallbackWarning]

    async def rest() -> list:
        return [c async for c in stream]

    with pytest.raises(VoxtralError, match="another event loop"):
        asyncio.run(rest())


def test_an_async_stream_continued_on_another_event_loop_says_so_and_stops(tts):
    """Its segments hand their chunks to the loop that started it; a second loop would
    wait on queues that loop can never fill."""
    stream = tts.astream(TEXT, VOICE, seed=1, split=True, max_chars=60, max_frames=50)
    first = asyncio.run(stream.__anext__())
    assert first.frames == 1
    with pytest.raises(VoxtralError) as exc:  # a RuntimeError that apps catching ours missed
        asyncio.run(stream.__anext__())
    assert isinstance(exc.value, RuntimeError)
    assert "another event loop" in str(exc.value) and "\n" not in str(exc.value)
    jobs = [job for _, job in stream.jobs]
    assert jobs and all(job.seq.cancelled for job in jobs)
    deadline = time.monotonic() + 10
    while tts.engine.busy and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not tts.engine.busy


LONG_PROMPT = " ".join(f"Sentence number {i} goes on a little." for i in range(30))


def test_a_long_prompt_prefilled_in_parts_equals_one_pass(tts, monkeypatch):
    parts: list[int] = []
    prefill_part = engine_mod.prefill_part

    def recording(model, text, cache):
        parts.append(text.shape[1])
        return prefill_part(model, text, cache)

    monkeypatch.setattr(engine_mod, "prefill_part", recording)
    monkeypatch.setattr(engine_mod, "PREFILL_PART_TOKENS", 10**6)
    monkeypatch.setattr(engine_mod, "MIN_PREFILL_PART_TOKENS", 10**6)
    whole = tts.synthesize(LONG_PROMPT, VOICE, seed=2, max_frames=4)
    assert parts == []
    monkeypatch.setattr(engine_mod, "PREFILL_PART_TOKENS", 16)
    parted = tts.synthesize(LONG_PROMPT, VOICE, seed=2, max_frames=4)
    tokens = len(tts.job(LONG_PROMPT, VOICE).text_ids)
    assert parts == [16] * ((tokens - 1) // 16)
    assert parted.timings.prompt_tokens == whole.timings.prompt_tokens
    np.testing.assert_array_equal(parted.codes, whole.codes)
    np.testing.assert_array_equal(parted.audio, whole.audio)


@pytest.mark.parametrize(("frame_s", "expected"), [(1e-9, [64, 16, 16]), (1e9, [64, 128, 256])])
def test_prefill_parts_are_sized_to_take_about_a_frame(tts, monkeypatch, frame_s, expected):
    """Where a frame is cheap next to a prefill (a CPU), parts shrink so that a cancel and
    the running sequences wait about a frame; where it is dear, they grow to 256 tokens.
    Either way the output equals one pass."""
    parts: list[int] = []
    prefill_part = engine_mod.prefill_part

    def recording(model, text, cache):
        parts.append(text.shape[1])
        return prefill_part(model, text, cache)

    text = LONG_PROMPT * 2
    tokens = len(tts.job(text, VOICE).text_ids)
    assert tokens > 64 + 128 + 256
    monkeypatch.setattr(engine_mod, "PREFILL_PART_TOKENS", 10**6)
    monkeypatch.setattr(engine_mod, "MIN_PREFILL_PART_TOKENS", 10**6)
    whole = tts.synthesize(text, VOICE, seed=2, max_frames=3)
    monkeypatch.undo()
    monkeypatch.setattr(engine_mod, "prefill_part", recording)

    def reset(engine):
        engine._part_tokens = engine_mod.FIRST_PREFILL_PART_TOKENS
        engine._frame_times.clear()
        engine._frame_times.append(frame_s)  # no other sequence runs: none is measured

    tts.call(lambda: reset(tts.engine))
    parted = tts.synthesize(text, VOICE, seed=2, max_frames=3)
    assert parts[:3] == expected and sum(parts) < tokens
    assert set(parts[3:]) <= {expected[-1]}
    np.testing.assert_array_equal(parted.codes, whole.codes)
    np.testing.assert_array_equal(parted.audio, whole.audio)


def test_frames_run_beside_a_prefill_are_measured(tts, monkeypatch):
    """A running stream's frame steps are timed (a pump that ran a prefill part is not)."""
    tts.call(lambda: tts.engine._frame_times.clear())
    with tts.stream("A stream to time.", VOICE, seed=1, max_frames=12) as stream:
        list(stream)
    times = tts.call(lambda: list(tts.engine._frame_times))
    assert 5 <= len(times) <= engine_mod.FRAME_TIMES_KEPT and min(times) > 0


def test_cancel_during_a_long_prefill_stops_after_one_part(tts, monkeypatch):
    """A consumer blocked on a stream whose long prompt is being prefilled: cancel() takes
    effect after the part being run, and the rest of the prompt is never computed."""
    calls: list[str] = []
    stream = tts.stream(LONG_PROMPT, VOICE, seed=2, max_frames=4)
    prefill_part, prefill = engine_mod.prefill_part, engine_mod.prefill

    def part(model, text, cache):
        calls.append("part")
        stream.cancel()  # from the worker thread, while the consumer waits
        return prefill_part(model, text, cache)

    def last(*args):
        calls.append("last")
        return prefill(*args)

    monkeypatch.setattr(engine_mod, "PREFILL_PART_TOKENS", 16)
    monkeypatch.setattr(engine_mod, "prefill_part", part)
    monkeypatch.setattr(engine_mod, "prefill", last)
    assert list(stream) == []
    tts.worker.call(lambda: None)
    assert calls == ["part"]
    assert tts.engine.stats() == {
        "active": 0,
        "waiting": 0,
        "parked": 0,
        "max_batch": tts.engine.max_batch,
    }


def test_a_short_request_goes_before_the_rest_of_a_long_prefill(tts, monkeypatch):
    """An app's "speak now" while a long unsplit prompt is prefilled part by part: the short
    prompt is prefilled first and speaks at once; both outputs are as on their own."""
    solo_long = tts.synthesize(LONG_PROMPT, VOICE, seed=2, max_frames=3)
    solo_short = tts.synthesize("Speak now.", VOICE, seed=5, max_frames=3)
    parts: list[int] = []
    prefill_part = engine_mod.prefill_part

    def slow_part(model, text, cache):
        parts.append(text.shape[1])
        time.sleep(0.02)  # a long prompt on a big model: the newcomer comes mid-prefill
        return prefill_part(model, text, cache)

    monkeypatch.setattr(engine_mod, "PREFILL_PART_TOKENS", 16)
    monkeypatch.setattr(engine_mod, "prefill_part", slow_part)
    total = (len(tts.job(LONG_PROMPT, VOICE).text_ids) - 1) // 16
    long_job = tts.submit(tts.job(LONG_PROMPT, VOICE, seed=2, max_frames=3))
    _wait_for(lambda: parts, 30)
    short = tts.synthesize("Speak now.", VOICE, seed=5, max_frames=3)
    parts_before_short_ended = len(parts)
    codes = _codes_of(long_job)
    assert total >= 10 and parts_before_short_ended < total, (parts_before_short_ended, total)
    np.testing.assert_array_equal(short.codes, solo_short.codes)
    np.testing.assert_array_equal(codes, solo_long.codes)
    assert len(parts) == total  # resumed where it stopped, nothing run twice


def test_running_streams_get_frames_between_the_parts_of_a_long_prefill(tts, monkeypatch):
    events: list[str] = []
    prefill_part, deliver = engine_mod.prefill_part, tts.engine._deliver

    def part(model, text, cache):
        events.append("part")
        return prefill_part(model, text, cache)

    def recording_deliver(ready):
        events.extend("audio" for _, _, audio, _ in ready if audio is not None)
        return deliver(ready)

    monkeypatch.setattr(engine_mod, "PREFILL_PART_TOKENS", 16)
    monkeypatch.setattr(engine_mod, "prefill_part", part)
    monkeypatch.setattr(tts.engine, "_deliver", recording_deliver)
    running = tts.stream("Keep talking.", VOICE, seed=7, max_frames=60)
    got = [next(running)]
    newcomer = tts.synthesize(LONG_PROMPT, VOICE, seed=2, max_frames=2, split=False)
    got.extend(running)
    assert len(newcomer.codes) == 2 and sum(c.frames for c in got) == 60
    first, last = events.index("part"), len(events) - events[::-1].index("part") - 1
    between = events[first : last + 1]
    assert between.count("part") >= 10
    # A frame of the running stream between every two parts; its audio is handed out one
    # step after the frame (the step that queued it may have had none to hand out yet).
    pairs = list(itertools.pairwise(i for i, e in enumerate(between) if e == "part"))
    for a, b in pairs[1:]:
        assert "audio" in between[a:b], between


def _prefix_length(tts, voice: str) -> int:
    return len(tts.prompt_ids("", voice)) - 2  # the prompt without its last two ids


def _recording_parts(monkeypatch, parts: list[int], before=None) -> None:
    prefill_part = engine_mod.prefill_part

    def recording(model, embeds, cache):
        parts.append(embeds.shape[1])
        if before is not None:
            before()
        return prefill_part(model, embeds, cache)

    monkeypatch.setattr(engine_mod, "prefill_part", recording)


def test_a_new_voice_is_prefilled_in_fixed_parts_equal_to_one_pass(tts, monkeypatch):
    """A voice not cached yet has its prompt prefix prefilled in parts of
    PREFIX_PART_TOKENS, one per frame step, so a cancel or the streams already running wait
    a part rather than the whole prefix; the output equals the prefix run in one pass, and
    a later request from the cached prefix equals both."""
    voice, text, kwargs = "casual_female", "Hello there.", dict(seed=4, max_frames=4)
    parts: list[int] = []
    _recording_parts(monkeypatch, parts)
    monkeypatch.setattr(engine_mod, "PREFIX_PART_TOKENS", 10**6)
    tts.clear_prefix_cache()
    whole = tts.synthesize(text, voice, **kwargs)
    n = _prefix_length(tts, voice)
    assert parts == [n] and not whole.timings.prefix_cached
    monkeypatch.setattr(engine_mod, "PREFIX_PART_TOKENS", 16)
    tts.clear_prefix_cache()
    parts.clear()
    parted = tts.synthesize(text, voice, **kwargs)
    assert parts == [16] * (n // 16) + [n % 16] * (n % 16 > 0)
    assert len(parts) >= 4 and not parted.timings.prefix_cached
    cached = tts.synthesize(text, voice, **kwargs)
    assert cached.timings.prefix_cached and len(parts) == -(-n // 16)  # no part ran again
    for other in (parted, cached):
        np.testing.assert_array_equal(other.codes, whole.codes)
        np.testing.assert_array_equal(other.audio, whole.audio)


def test_cancel_during_a_new_voice_prefix_stops_after_one_part(tts, monkeypatch):
    """cancel() while a new voice's prefix is being prefilled takes effect after the part
    being run: the rest is never computed, and the unfinished prefix is not kept."""
    voice = "hi_female"
    tts.clear_prefix_cache()
    stream = tts.stream("Hi.", voice, seed=2, max_frames=4)
    parts: list[int] = []
    _recording_parts(monkeypatch, parts, before=stream.cancel)  # on the worker thread
    monkeypatch.setattr(engine_mod, "PREFIX_PART_TOKENS", 16)
    assert list(stream) == []
    tts.worker.call(lambda: None)
    assert parts == [16] and _prefix_length(tts, voice) > 16
    assert tts.call(lambda: list(tts.engine._prefixes)) == []
    assert tts.engine.stats()["active"] == 0


def test_a_request_takes_over_the_prefix_a_set_aside_segment_began(tts, monkeypatch):
    """A segment generated ahead begins a new voice's prefix; a request someone waits for,
    in that voice, sets it aside after one part and goes on with that prefix rather than
    computing it again; the segment then starts from the cached prefix. Both outputs are
    as on their own."""
    voice = "de_male"
    solo_ahead = tts.synthesize("Ahead segment text.", voice, seed=1, max_frames=3)
    solo_waited = tts.synthesize("Someone waits.", voice, seed=2, max_frames=3)
    tts.clear_prefix_cache()
    waited = tts.job("Someone waits.", voice, seed=2, max_frames=3)
    ahead = tts.job("Ahead segment text.", voice, seed=1, max_frames=3)
    ahead.ahead = True
    parts: list[str] = []

    def before():
        parts[-1] = "ahead" if tts.engine._prefilling.job is ahead else "waited"
        if len(parts) == 1:  # a consumer's request arrives (we are on the worker thread)
            waited.claim()
            tts.engine.submit(waited)

    prefill_part = engine_mod.prefill_part

    def recording(model, embeds, cache):
        parts.append("")
        before()
        return prefill_part(model, embeds, cache)

    monkeypatch.setattr(engine_mod, "prefill_part", recording)
    monkeypatch.setattr(engine_mod, "PREFIX_PART_TOKENS", 16)
    tts.submit(ahead)
    got = {"ahead": _codes_of(ahead), "waited": _codes_of(waited)}
    total = -(-_prefix_length(tts, voice) // 16)
    assert parts == ["ahead"] + ["waited"] * (total - 1), parts  # each part once
    assert ahead.timings.prefix_cached and not waited.timings.prefix_cached
    np.testing.assert_array_equal(got["ahead"], solo_ahead.codes)
    np.testing.assert_array_equal(got["waited"], solo_waited.codes)


def test_a_prefix_being_computed_when_the_cache_is_cleared_is_not_kept(tts, monkeypatch):
    """clear_prefix_cache() between the parts of a new voice's prefix: its request still
    speaks as ever, but the prefix is kept neither in memory nor on disk."""
    voice = "nl_male"
    tts.clear_prefix_cache()
    alone = tts.synthesize("Cleared.", voice, seed=2, max_frames=3)
    tts.clear_prefix_cache()
    parts: list[int] = []
    _recording_parts(
        monkeypatch, parts, before=lambda: len(parts) == 1 and tts.engine.clear_prefix_cache()
    )
    monkeypatch.setattr(engine_mod, "PREFIX_PART_TOKENS", 16)
    speech = tts.synthesize("Cleared.", voice, seed=2, max_frames=3)
    assert len(parts) > 2 and not speech.timings.prefix_cached
    np.testing.assert_array_equal(speech.codes, alone.codes)
    assert tts.call(lambda: list(tts.engine._prefixes)) == []
    store = tts.engine.prefix_store
    assert store is not None and tts.call(store._files) == []
    assert not tts.synthesize("Cleared.", voice, seed=2, max_frames=3).timings.prefix_cached


def test_running_streams_get_frames_between_the_parts_of_a_new_voice_prefix(tts, monkeypatch):
    events: list[str] = []
    deliver = tts.engine._deliver

    def recording_deliver(ready):
        events.extend("audio" for _, _, audio, _ in ready if audio is not None)
        return deliver(ready)

    voice = "es_male"
    tts.clear_prefix_cache()
    running = tts.stream("Keep talking.", VOICE, seed=7, max_frames=60)
    got = [next(running)]
    _recording_parts(monkeypatch, [], before=lambda: events.append("part"))
    monkeypatch.setattr(engine_mod, "PREFIX_PART_TOKENS", 8)
    monkeypatch.setattr(tts.engine, "_deliver", recording_deliver)
    newcomer = tts.synthesize("A new voice.", voice, seed=2, max_frames=2)
    got.extend(running)
    assert len(newcomer.codes) == 2 and sum(c.frames for c in got) == 60
    first, last = events.index("part"), len(events) - events[::-1].index("part") - 1
    between = events[first : last + 1]
    assert between.count("part") == -(-_prefix_length(tts, voice) // 8)
    pairs = list(itertools.pairwise(i for i, e in enumerate(between) if e == "part"))
    for a, b in pairs[1:]:  # audio is handed out a step after its frame (see above)
        assert "audio" in between[a:b], between


def test_a_short_request_goes_before_the_rest_of_a_new_voice_prefix(tts, monkeypatch):
    """A request for a cached voice arriving while a new voice's prefix is prefilled goes
    first; the prefix resumes where it stopped (no part runs twice) and both outputs are as
    on their own."""
    voice = "de_female"
    tts.clear_prefix_cache()
    solo_new = tts.synthesize("New voice here.", voice, seed=2, max_frames=3)
    solo_short = tts.synthesize("Speak now.", VOICE, seed=5, max_frames=3)
    prefixes = tts.engine._prefixes
    tts.call(lambda: [prefixes.pop(k) for k in list(prefixes) if k[0] == voice])
    assert [k[0] for k in tts.call(lambda: list(prefixes))] == [VOICE]
    parts: list[int] = []
    _recording_parts(monkeypatch, parts, before=lambda: time.sleep(0.02))
    monkeypatch.setattr(engine_mod, "PREFIX_PART_TOKENS", 8)
    monkeypatch.setattr(tts.engine, "prefix_store", None)  # not read back from disk
    total = -(-_prefix_length(tts, voice) // 8)
    new_job = tts.submit(tts.job("New voice here.", voice, seed=2, max_frames=3))
    _wait_for(lambda: parts, 30)
    short = tts.synthesize("Speak now.", VOICE, seed=5, max_frames=3)
    parts_before_short_ended = len(parts)
    codes = _codes_of(new_job)
    assert total >= 8 and parts_before_short_ended < total, (parts_before_short_ended, total)
    assert len(parts) == total  # resumed where it stopped, nothing run twice
    np.testing.assert_array_equal(short.codes, solo_short.codes)
    np.testing.assert_array_equal(codes, solo_new.codes)


def test_a_short_request_in_a_new_voice_waits_for_a_long_prefill(tts, monkeypatch):
    """Only a request whose voice prefix is cached goes before a long prefill (it is one
    part); one in a new voice would take several, and waits its turn."""
    voice = "it_female"
    tts.clear_prefix_cache()
    tts.synthesize("Warm.", VOICE, seed=1, max_frames=1)  # VOICE cached, voice not
    events: list[str] = []

    def before():
        job = tts.engine._prefilling.job
        events.append("long" if job is long_job else "new")
        time.sleep(0.01)  # the newcomer arrives during these parts

    _recording_parts(monkeypatch, [], before=before)
    monkeypatch.setattr(engine_mod, "PREFILL_PART_TOKENS", 16)
    long_job = tts.job(LONG_PROMPT, VOICE, seed=2, max_frames=2)
    tts.submit(long_job)
    _wait_for(lambda: len(events) >= 2)
    newcomer = tts.synthesize("New voice.", voice, seed=3, max_frames=2)
    assert len(_codes_of(long_job)) == 2  # max_frames: the model never says END
    assert len(newcomer.codes) == 2 and "new" in events
    first_new = events.index("new")
    assert "long" not in events[first_new:], events  # the long prompt was done first


def test_leaving_a_with_block_stops_the_stream(tts):
    with tts.stream(TEXT, VOICE, seed=1, max_frames=500) as stream:
        next(stream)
        job = stream.jobs[0][1]
    _wait_done(job)
    assert job.seq.frames < 500

    async def main():
        async with tts.astream(TEXT, VOICE, seed=1, max_frames=500) as stream:
            async for _ in stream:
                break
            return stream.jobs[0][1]

    job = asyncio.run(main())
    _wait_done(job)
    assert job.seq.frames < 500


def test_a_second_reader_of_one_stream_is_refused_not_left_waiting(tts):
    """Two readers waited on one queue: the one not handed the end waited forever."""
    expected = tts.synthesize(TEXT, VOICE, seed=4, max_frames=12).codes
    stream = tts.stream(TEXT, VOICE, seed=4, max_frames=12)
    chunks: list = []
    reader = threading.Thread(target=lambda: chunks.extend(stream), daemon=True)
    reader.start()
    deadline = time.monotonic() + 30
    while not stream._reading.locked() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert reader.is_alive()
    with pytest.raises(VoxtralError, match="already being read"):
        next(stream)
    reader.join(60)
    assert not reader.is_alive()
    np.testing.assert_array_equal(np.concatenate([c.codes for c in chunks]), expected)

    async def main():
        stream = tts.astream(TEXT, VOICE, seed=4, max_frames=12)
        first = asyncio.ensure_future(stream.__anext__())
        while not stream._reading:
            await asyncio.sleep(0)
        with pytest.raises(VoxtralError, match="already being read"):
            await stream.__anext__()
        return [await first] + [chunk async for chunk in stream]

    chunks = asyncio.run(main())
    np.testing.assert_array_equal(np.concatenate([c.codes for c in chunks]), expected)


def test_flags_and_the_start_noise_are_checked(tts):
    with pytest.raises(InputError, match="wait must be True or False"):
        tts.say("Hello.", VOICE, wait="no", player=object())
    noise = np.zeros((3, tts.config.flow.n_acoustic_codebook), np.float32)
    with pytest.raises(InputError, match="seed and noise both"):
        tts.synthesize("Hello.", VOICE, seed=1, noise=noise)
    with pytest.raises(InputError, match="seed and noise both"):
        tts.job("Hello.", VOICE, seed=1, noise=noise)
    with tts.stream("Hello.", VOICE, split=np.bool_(False), max_frames=1) as stream:
        assert len(list(stream)) == 1
    assert tts.engine.stats()["waiting"] == 0


def test_a_stream_for_a_voice_not_used_before_does_not_wait_for_the_worker(
    tiny_checkpoint_noend,
):
    """Making the job read the voice on the worker thread: stream() waited there for the
    frame or prefill part in progress (an event loop stalled by up to a whole decode)."""
    model = voxtral_mlx.load(tiny_checkpoint_noend, prefix_cache_dir=None)
    try:
        release = threading.Event()
        busy = model.worker.submit(lambda: release.wait(30))
        made: list = []
        maker = threading.Thread(
            target=lambda: made.append(model.stream("Hi there.", "fr_female", seed=3, max_frames=4))
        )
        maker.start()
        maker.join(10)
        returned_while_busy = bool(made)
        release.set()
        busy.result()
        maker.join()
        assert returned_while_busy
        audio = np.concatenate([chunk.audio for chunk in made[0]])
        ref = model.synthesize("Hi there.", "fr_female", seed=3, max_frames=4)
        np.testing.assert_array_equal(audio, ref.audio)
    finally:
        model.close()


def test_running_streams_get_frames_while_decode_runs(tts, monkeypatch):
    """decode() of a long utterance runs in parts with a frame between them: it was one
    worker call, so every stream stalled for the whole decode, and a cancel() waited."""
    import voxtral_mlx.tts as tts_mod

    codes = tts.synthesize("Something to decode.", VOICE, seed=4, max_frames=48).codes
    ref = tts.decode(codes)
    events: list[str] = []
    codec, deliver = tts.model.audio_tokenizer, tts.engine._deliver
    decode_chunk = codec.decode_chunk

    def recording_decode_chunk(chunk, state):
        if chunk.shape[1] == 4:
            events.append("part")
        return decode_chunk(chunk, state)

    def recording_deliver(ready):
        events.extend("audio" for _, _, audio, _ in ready if audio is not None)
        return deliver(ready)

    monkeypatch.setattr(tts_mod, "DECODE_PART_FRAMES", 4)
    monkeypatch.setattr(codec, "decode_chunk", recording_decode_chunk)
    monkeypatch.setattr(tts.engine, "_deliver", recording_deliver)
    with tts.stream("Keep talking.", VOICE, seed=7, max_frames=400) as running:
        next(running)
        audio = tts.decode(codes)
    np.testing.assert_array_equal(audio, ref)
    parts = [i for i, e in enumerate(events) if e == "part"]
    assert len(parts) == 12
    gaps = [events[a:b] for a, b in itertools.pairwise(parts)]
    assert sum("audio" in gap for gap in gaps) >= 8, events


def test_decode_of_a_split_texts_codes_restarts_the_codec_at_each_segment(tts):
    """Each segment was decoded from a fresh codec state; decode() ran one state over all
    of them, so every later segment began in the previous one's context."""
    text = "The first sentence is here. A second one follows. And a third one ends it."
    speech = tts.synthesize(text, VOICE, seed=2, max_frames=5, split=True, max_chars=30)
    assert len(speech.segment_frames) >= 3 and sum(speech.segment_frames) == len(speech.codes)
    chunks = list(tts.stream(text, VOICE, seed=2, max_frames=5, split=True, max_chars=30))
    spoken = np.concatenate([c.audio for c in chunks if c.frames])  # without the pauses
    np.testing.assert_array_equal(tts.decode(speech.codes, speech.segment_frames), spoken)
    assert not np.array_equal(tts.decode(speech.codes), spoken)  # one state throughout
    one = tts.synthesize("Just one.", VOICE, seed=2, max_frames=5)
    assert one.segment_frames == (len(one.codes),)
    np.testing.assert_array_equal(tts.decode(one.codes, one.segment_frames), one.audio)
    for bad, words in (
        ([1, 2], "add up to 3 frames"),
        (5, "list of frame counts"),
        ([-1, len(speech.codes) + 1], "whole number >= 0"),
    ):
        with pytest.raises(InputError, match=words):
            tts.decode(speech.codes, bad)


# A one-frame request's only chunk (decoded as a first chunk), a 3-frame one's last chunk.
@pytest.mark.parametrize(("failing_call", "frames"), [(1, 1), (2, 3)])
def test_a_failed_decode_reaches_the_consumer(tts, monkeypatch, failing_call, frames):
    """A job whose last chunk was being decoded had already left the engine's books: a
    decode that failed (an MLX error) left its consumer waiting forever."""
    deadline = time.monotonic() + 10  # an earlier test's cancelled job may still be ending
    while tts.engine.busy and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not tts.engine.busy
    codec = tts.model.audio_tokenizer
    real, calls = codec.decode_chunks, [0]

    def flaky(chunks):
        if chunks:
            calls[0] += 1
            if calls[0] == failing_call:
                raise RuntimeError("simulated decode failure")
        return real(chunks)

    monkeypatch.setattr(codec, "decode_chunks", flaky)
    stream = tts.stream("Hi.", VOICE, seed=0, max_frames=frames, chunk_frames=2)
    outcome: list[object] = []

    def consume() -> None:
        try:
            outcome.append([c.frames for c in stream])
        except RuntimeError as e:
            outcome.append(str(e))

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    consumer.join(30)
    assert not consumer.is_alive(), "the consumer was left waiting"
    assert outcome == ["simulated decode failure"] and calls[0] == failing_call
    monkeypatch.undo()
    assert len(tts.synthesize("Hi.", VOICE, seed=0, max_frames=2).codes) == 2  # still serves


def test_the_real_time_factor_counts_speech_not_the_pauses_put_between_segments(tts):
    """A pause between segments is silence the library adds, not audio it generated: a
    split text's ``rtf`` divides the wall time by the seconds of speech alone (with a
    30 s pause it once claimed hundreds of times real time)."""
    text = "Hello there.\n\nAgain."
    stream = tts.stream(text, VOICE, seed=1, split=True, max_frames=2, pause=30)
    chunks = list(stream)
    t = stream.timings
    assert (
        tts.synthesize(text, VOICE, seed=1, split=True, max_frames=2, pause=30).timings.pause_s
        == 30
    )
    speech = sum(len(c.audio) for c in chunks if c.frames) / tts.sample_rate
    assert t.pause_s == 30 and t.audio_s == pytest.approx(speech + 30)
    assert t.rtf == pytest.approx(t.total_s / speech)
    one = tts.synthesize("Hello there.", VOICE, seed=1, max_frames=2).timings
    assert one.pause_s == 0 and one.rtf == pytest.approx(one.total_s / one.audio_s)


def test_a_split_streams_figures_count_from_its_first_read(tts):
    """A stream made and read a second later (as an app may make one ahead) was timed from
    its creation: a second of first audio and an rtf many times too large, unlike the
    same text in one segment."""
    stream = tts.stream("Hello there.\n\nAgain.", VOICE, seed=1, split=True, max_frames=2)
    time.sleep(1.0)
    list(stream)
    assert 0 < stream.timings.first_audio_s < 0.5 and stream.timings.total_s < 0.9
