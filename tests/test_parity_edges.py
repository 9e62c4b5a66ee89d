"""Streaming against one-shot synthesis, bit for bit, at the edges: chunk sizes, frame
limits, guidance weights, split text and concurrent streams in one batch. (Prompts for
adversarial text are checked against mistral-common in test_prompt.py.)"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import voxtral_mlx


@pytest.fixture(scope="module")
def tts(tiny_checkpoint_noend):
    model = voxtral_mlx.load(tiny_checkpoint_noend, prefix_cache_dir=None, max_batch=4)
    yield model
    model.close()


def joined(chunks) -> tuple[np.ndarray, np.ndarray]:
    return np.concatenate([c.audio for c in chunks]), np.concatenate([c.codes for c in chunks])


def assert_same(chunks, speech) -> None:
    audio, codes = joined(chunks)
    assert audio.shape == speech.audio.shape
    assert np.array_equal(audio, speech.audio)
    assert np.array_equal(codes, speech.codes)


CFG = [0, 1, 1.2, 3]


@pytest.mark.parametrize("max_frames", [0, 1, 2, 25])
@pytest.mark.parametrize("chunk_frames", [1, 2, 3, 7, 64])
def test_stream_is_bit_identical_to_synthesize(tts, chunk_frames, max_frames):
    alpha = CFG[(chunk_frames + max_frames) % 4]
    seed = chunk_frames * 31 + max_frames
    kw = dict(seed=seed, max_frames=max_frames, cfg_alpha=alpha)
    one = tts.synthesize("Streaming test sentence.", "ar_male", **kw)
    assert len(one.codes) == max_frames
    chunks = list(
        tts.stream("Streaming test sentence.", "ar_male", chunk_frames=chunk_frames, **kw)
    )
    assert_same(chunks, one)


@pytest.mark.parametrize("max_batch", [1, 2, 4])
def test_split_stream_is_bit_identical_to_synthesize(tiny_checkpoint_noend, max_batch):
    model = voxtral_mlx.load(tiny_checkpoint_noend, prefix_cache_dir=None, max_batch=max_batch)
    try:
        text = "First sentence here. Second one, a bit longer! Third? A fourth without a period"
        for chunk_frames, max_frames, alpha, seed in [(1, 3, 1.2, 0), (3, 7, 3, 11), (64, 2, 0, 4)]:
            kw = dict(seed=seed, max_frames=max_frames, cfg_alpha=alpha, split=True, max_chars=40)
            one = model.synthesize(text, "ar_male", **kw)
            chunks = list(model.stream(text, "ar_male", chunk_frames=chunk_frames, **kw))
            assert len({c.segment for c in chunks}) == 3
            assert_same(chunks, one)
    finally:
        model.close()


def test_unseeded_speech_reports_the_seed_that_reproduces_it(tts):
    text = "One. Two three. Four."
    for split in (False, True):
        kw = dict(max_frames=3, split=split, **({"max_chars": 8} if split else {}))
        first = tts.synthesize(text, "ar_male", **kw)
        again = tts.synthesize(text, "ar_male", seed=first.seed, **kw)
        assert np.array_equal(first.audio, again.audio)
        assert np.array_equal(first.codes, again.codes)


REQUESTS = [  # text, voice, seed, max_frames, cfg_alpha, chunk_frames
    ("Short one.", "ar_male", 3, 5, 1.2, 1),
    ("A somewhat longer sentence here.", "fr_female", 11, 25, 3, 2),
    ("Third.", "casual_female", 7, 2, 0, 3),
    ("Fourth request text!", "ar_male", 9, 70, 1, 64),
    ("Fifth, zero frames.", "de_male", 1, 0, 1.2, 7),
]


@pytest.fixture(scope="module")
def alone(tiny_checkpoint_noend):
    model = voxtral_mlx.load(tiny_checkpoint_noend, prefix_cache_dir=None, max_batch=1)
    try:
        return [
            model.synthesize(t, v, seed=s, max_frames=m, cfg_alpha=a)
            for t, v, s, m, a, _ in REQUESTS
        ]
    finally:
        model.close()


@pytest.mark.parametrize("max_batch", [1, 2, 3, 4])
def test_concurrent_streams_equal_each_alone(tiny_checkpoint_noend, alone, max_batch, batch_sizes):
    model = voxtral_mlx.load(tiny_checkpoint_noend, prefix_cache_dir=None, max_batch=max_batch)
    try:
        order = [0, 1, 2, 3, 4] if max_batch % 2 else [4, 3, 1, 0, 2]
        streams = {}
        for i in order:
            t, v, s, m, a, c = REQUESTS[i]
            streams[i] = model.stream(t, v, seed=s, max_frames=m, cfg_alpha=a, chunk_frames=c)
        out: dict[int, list] = {}

        def consume(i: int) -> None:
            out[i] = list(streams[i])

        threads = [threading.Thread(target=consume, args=(i,)) for i in order]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        for i in order:
            assert_same(out[i], alone[i])
    finally:
        model.close()
    assert max(batch_sizes) == 1 if max_batch == 1 else max(batch_sizes) > 1


def test_stream_is_exact_when_the_first_chunk_needs_several_frames(tmp_path):
    """A codec whose output conv reaches back more than one frame (kernel 17 > 8 steps)."""
    from voxtral_mlx.synthetic.checkpoint import build_random_checkpoint, make_params

    params = make_params("tiny")
    params["multimodal"]["audio_tokenizer_args"]["patch_proj_kernel_size"] = 17
    path = build_random_checkpoint(
        tmp_path / "k17", params, seed=5, dtype="float32", suppress_end=True, voices={"v": 3},
        vocab_source=None,
    )  # fmt: skip
    model = voxtral_mlx.load(path, prefix_cache_dir=None)
    try:
        assert model.config.codec.first_chunk_frames == 3
        for max_frames in (1, 2, 3, 5):
            one = model.synthesize("Hi there.", "v", seed=1, max_frames=max_frames)
            for chunk_frames in (1, 2, 7):
                chunks = model.stream(
                    "Hi there.", "v", seed=1, max_frames=max_frames, chunk_frames=chunk_frames
                )
                assert_same(list(chunks), one)
    finally:
        model.close()
