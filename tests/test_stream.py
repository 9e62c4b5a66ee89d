"""The streaming API: chunks as they decode, equal to one-shot synthesis, stoppable."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from voxtral_mlx.engine import AudioChunk, Job
from voxtral_mlx.errors import InputError

TEXT = "Streaming test sentence number one."
VOICE = "casual_female"


@pytest.fixture(scope="module")
def noise():
    return np.random.default_rng(7).standard_normal((40, 36)).astype(np.float32)


@pytest.mark.parametrize("chunk_frames", [1, 2, 3, 5, 25])
def test_stream_concatenation_equals_synthesize(tiny_tts, noise, chunk_frames):
    one_shot = tiny_tts.synthesize(TEXT, VOICE, noise=noise)
    chunks = list(tiny_tts.stream(TEXT, VOICE, noise=noise, chunk_frames=chunk_frames))
    assert len(one_shot.codes) > 0
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


def test_closing_the_stream_stops_generation(tiny_tts, noise, monkeypatch):
    model = tiny_tts.model
    steps = {"n": 0}
    original = model.step

    def step(*args, **kwargs):
        steps["n"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(model, "step", step)
    stream = tiny_tts.stream(TEXT, VOICE, noise=noise, chunk_frames=1)
    next(stream)
    next(stream)
    stream.close()
    after_close = steps["n"]
    assert after_close <= 3  # frames 1 and 2 (queued ahead), nothing more
    # The model is free again: another thread can use it right away.
    done = threading.Event()

    def other():
        tiny_tts.synthesize(TEXT, VOICE, seed=1, max_frames=2)
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
