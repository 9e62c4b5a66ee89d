"""Codec decoder streaming: any chunking of a stream equals the one-shot decode, states
are independent, and a state's memory does not grow with the stream."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from voxtral_mlx.checkpoint import sanitize
from voxtral_mlx.config import ModelConfig
from voxtral_mlx.errors import InputError
from voxtral_mlx.model.codec import WHOLE_CHUNK_FRAMES, CodecDecoder, CodecState, piece_frames
from voxtral_mlx.synthetic.checkpoint import make_params, random_weights

PREFIX = "audio_tokenizer."
CHUNKS = (1, 2, 3, 5, 25)
MAX_FRAMES = 300
SPF = 1920
TOL = 1e-5


def _decoder(seed: int, **overrides) -> tuple[ModelConfig, CodecDecoder]:
    params = make_params("tiny")
    params["multimodal"]["audio_tokenizer_args"].update(overrides)
    config = ModelConfig.from_params(params)
    raw = {
        k: mx.array(v) for k, v in random_weights(config, seed, prefix="audio_tokenizer").items()
    }
    folded = sanitize(raw, config, dtype=mx.float32)
    decoder = CodecDecoder(config.codec)
    decoder.load_weights([(k[len(PREFIX) :], v) for k, v in folded.items()], strict=True)
    mx.eval(decoder.parameters())
    decoder.prepare()  # as load() does: steady-state chunks run compiled
    return config, decoder


def _codes(config: ModelConfig, seed: int, frames: int, batch: int = 1) -> mx.array:
    rng = np.random.default_rng(seed)
    c = config.codec
    sem = rng.integers(0, c.semantic_codebook_size, (batch, frames, 1))
    sem[:, ::4] = 16 * rng.integers(0, c.semantic_codebook_size // 16, sem[:, ::4].shape)
    ac = rng.integers(0, c.acoustic_codebook_size, (batch, frames, c.acoustic_dim))
    return mx.array((np.concatenate([sem, ac], -1) + 2).astype(np.int32))


def _stream(decoder: CodecDecoder, codes: mx.array, schedule, state: CodecState | None = None):
    """Decode ``codes [B, T, 37]`` chunk by chunk, evaluating at every chunk like a player."""
    state = state or decoder.new_state(codes.shape[0])
    parts, start, i = [], 0, 0
    while start < codes.shape[1]:
        size = schedule[i % len(schedule)]
        part = decoder.decode_chunk(codes[:, start : start + size], state)
        mx.eval(part)
        parts.append(part)
        start += size
        i += 1
    return mx.concatenate(parts, axis=1), state


def _max_diff(a: mx.array, b: mx.array) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(mx.abs(a - b).max())


@pytest.fixture(scope="module")
def setup():
    """The tiny decoder, 300 frames of codes and their one-shot decode."""
    config, decoder = _decoder(0)
    codes = _codes(config, 0, MAX_FRAMES)
    full = decoder.decode(codes)
    mx.eval(full)
    return config, decoder, codes, full


def test_decode_is_causal(setup):
    """One-shot decode of a prefix is the prefix of the one-shot decode: so streaming
    results can be checked against slices of one reference."""
    _, decoder, codes, full = setup
    for t in (1, 2, 9, 64, 65, 130):
        assert _max_diff(decoder.decode(codes[:, :t]), full[:, : t * SPF]) <= TOL


@pytest.mark.parametrize("chunk", CHUNKS)
def test_fixed_chunks_300_frames(setup, chunk):
    _, decoder, codes, full = setup
    streamed, state = _stream(decoder, codes, [chunk])
    diff = _max_diff(streamed, full)
    print(f"[chunk {chunk}, 300 frames] max abs diff {diff:.2e}")
    assert diff <= TOL
    assert state.position == MAX_FRAMES


def test_first_frame_alone(setup):
    _, decoder, codes, full = setup
    state = decoder.new_state()
    first = decoder.decode_chunk(codes[:, :1], state)
    assert first.shape == (1, SPF)
    assert _max_diff(first, decoder.decode(codes[:, :1])) <= TOL
    assert _max_diff(first, full[:, :SPF]) <= TOL


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    frames=st.one_of(st.integers(1, 40), st.integers(41, MAX_FRAMES)),
    schedule=st.lists(st.sampled_from(CHUNKS), min_size=1, max_size=8),
    offset=st.integers(0, MAX_FRAMES - 1),
)
def test_any_chunking_equals_one_shot(setup, frames, schedule, offset):
    # decode() is itself chunked (64 frames per chunk): this compares schedules of one
    # implementation. That it equals a dense one-shot decode is test_parity_spec's
    # test_codec_matches_the_spec_reference (torch, unchunked, 150 frames).
    _, decoder, codes, _ = setup
    # A window of the stored codes (rolled so every example sees other codes first).
    window = mx.roll(codes, -offset, axis=1)[:, :frames]
    expected = decoder.decode(window)
    streamed, state = _stream(decoder, window, schedule)
    assert _max_diff(streamed, expected) <= TOL
    assert state.position == frames


def test_batched_stream_equals_rows(setup):
    config, decoder, _, _ = setup
    codes = _codes(config, 11, 37, batch=3)
    streamed, _ = _stream(decoder, codes, [2, 5, 1])
    for b in range(3):
        assert _max_diff(streamed[b : b + 1], decoder.decode(codes[b : b + 1])) <= TOL


def test_a_chunk_runs_as_compiled_steps_of_a_few_lengths():
    for t in range(1, 400):
        pieces = piece_frames(t)
        assert sum(pieces) == t
        assert all(1 <= n <= WHOLE_CHUNK_FRAMES or n in (32, 64) for n in pieces)
        assert pieces == sorted(pieces, reverse=True)
        assert len(pieces) <= t // 64 + 3
        if t <= WHOLE_CHUNK_FRAMES:
            assert pieces == [t]


def test_chunk_lengths_chosen_freely_compile_a_bounded_number_of_steps(setup):
    """Every compiled length stays for the model's life: chunks of 17 to 79 frames (as
    ``stream(chunk_frames=N)`` makes) add the lengths 16, 32, 64 and those below 16, not
    one each; the audio is the one-shot decode's."""
    config, decoder = _decoder(0)
    traced: list[tuple[bool, int]] = []

    def counted(first: bool):
        def step(codes, *rest):
            traced.append((first, codes.shape[1]))
            return decoder._step(codes, *rest, first=first)

        return mx.compile(step)

    decoder._compiled_steps = {first: counted(first) for first in (True, False)}
    schedule = [17, 19, 23, 29, 31, 37, 41, 47, 53, 59, 61, 67, 71, 79]
    codes = _codes(config, 5, sum(schedule))
    streamed, _ = _stream(decoder, codes, schedule)
    assert _max_diff(streamed, decoder.decode(codes)) <= TOL
    lengths = {n for _, n in traced}
    assert lengths <= {*range(1, WHOLE_CHUNK_FRAMES + 1), 32, 64}
    assert len(traced) == len(set(traced)) <= 2 * (WHOLE_CHUNK_FRAMES + 2)


def test_interleaved_states_do_not_interfere(setup):
    config, decoder, _, _ = setup
    a, b = _codes(config, 21, 60), _codes(config, 22, 45, batch=2)
    sa, sb = decoder.new_state(1), decoder.new_state(2)
    out_a, out_b = [], []
    pa = pb = 0
    schedule_a, schedule_b = [1, 3, 5], [2, 25, 1]
    i = 0
    while pa < a.shape[1] or pb < b.shape[1]:
        if pa < a.shape[1]:
            n = schedule_a[i % 3]
            out_a.append(decoder.decode_chunk(a[:, pa : pa + n], sa))
            pa += n
        if pb < b.shape[1]:
            n = schedule_b[i % 3]
            out_b.append(decoder.decode_chunk(b[:, pb : pb + n], sb))
            pb += n
        mx.eval(out_a[-1], out_b[-1])
        i += 1
    assert _max_diff(mx.concatenate(out_a, 1), decoder.decode(a)) <= TOL
    assert _max_diff(mx.concatenate(out_b, 1), decoder.decode(b)) <= TOL


def test_state_memory_is_constant(setup):
    _, decoder, codes, _ = setup
    fresh = decoder.new_state()
    shapes0 = [a.shape for a in fresh.arrays()]
    _, state = _stream(decoder, codes[:, :10], [1])
    shapes10, bytes10 = [a.shape for a in state.arrays()], [a.nbytes for a in state.arrays()]
    _stream(decoder, codes[:, 10:200], [1, 3, 25], state)
    assert state.position == 200
    assert [a.shape for a in state.arrays()] == shapes10 == shapes0
    assert [a.nbytes for a in state.arrays()] == bytes10
    # Conv tails and K/V windows only: a few KiB for the tiny codec, independent of length.
    print(f"[state] {state.nbytes} bytes in {len(state.arrays())} arrays")
    assert state.nbytes == fresh.nbytes < 64 * 1024


def test_decode_chunk_does_not_evaluate(setup, monkeypatch):
    """The caller evaluates at frame boundaries: decode_chunk itself never forces a sync."""
    _, decoder, codes, full = setup
    state = decoder.new_state()

    def forbidden(*args, **kwargs):
        raise AssertionError("decode_chunk evaluated")

    with monkeypatch.context() as m:
        m.setattr(mx, "eval", forbidden)
        m.setattr(mx, "async_eval", forbidden)
        parts = [decoder.decode_chunk(codes[:, i : i + 1], state) for i in range(4)]
    assert _max_diff(mx.concatenate(parts, 1), full[:, : 4 * SPF]) <= TOL


@pytest.mark.parametrize("seed", [3])
def test_odd_config_streams_exactly(seed):
    """Odd layer counts per stage and grouped K/V heads stream exactly too."""
    odd = dict(n_heads=4, n_kv_heads=2, head_dim=16, semantic_dim=24, hidden_dim=96,
               decoder_transformer_lengths_str="3,1,3,1")  # fmt: skip
    config, decoder = _decoder(seed, **odd)
    codes = _codes(config, seed, 53)
    full = decoder.decode(codes)
    for schedule in ([1], [2, 3], [5, 25]):
        streamed, _ = _stream(decoder, codes, schedule)
        assert _max_diff(streamed, full) <= TOL


@pytest.mark.parametrize("chunk", [1, 3, 25])
def test_compiled_steady_step_equals_uncompiled(setup, chunk):
    _, decoder, codes, _ = setup
    _, plain = _decoder(0)
    plain.prepare(compile=False)
    got, _ = _stream(decoder, codes[:, :60], [chunk])
    want, _ = _stream(plain, codes[:, :60], [chunk])
    assert _max_diff(got, want) == 0.0


def test_decode_chunks_batches_streams_in_step_and_equals_each_alone(setup, monkeypatch):
    """Five streams starting at different frames with different chunk sizes: each equals
    its own one-shot decode, and streams in the same phase share one step."""
    config, decoder, _, _ = setup
    streams = [_codes(config, 30 + i, 40) for i in range(5)]
    starts = [0, 0, 1, 3, 3]  # the frame at which each stream begins
    sizes = [1, 1, 1, 2, 1]  # frames per chunk
    states = [decoder.new_state() for _ in streams]
    done, outs = [0] * 5, [[] for _ in streams]
    batches = []
    real = decoder.decode_chunk

    def spy(codes, state):
        batches.append(codes.shape[0])
        return real(codes, state)

    monkeypatch.setattr(decoder, "decode_chunk", spy)
    for tick in range(60):
        due = [i for i in range(5) if tick >= starts[i] and done[i] < 40 and tick % sizes[i] == 0]
        if not due:
            continue
        chunks = [(streams[i][:, done[i] : done[i] + sizes[i]], states[i]) for i in due]
        for i, audio in zip(due, decoder.decode_chunks(chunks)):
            mx.eval(audio)
            outs[i].append(audio)
            done[i] += sizes[i]
    # Once their windows are full, the four one-frame streams step together.
    assert max(batches) == 4 and sum(batches) == sum(len(o) for o in outs)
    for i, stream in enumerate(streams):
        assert states[i].position == 40
        assert _max_diff(mx.concatenate(outs[i], axis=1), decoder.decode(stream)) <= TOL


def test_decode_chunks_refuses_a_state_twice(setup):
    config, decoder, _, _ = setup
    state = decoder.new_state()
    codes = _codes(config, 40, 2)
    with pytest.raises(InputError, match="only one chunk"):
        decoder.decode_chunks([(codes[:, :1], state), (codes[:, 1:], state)])
    assert state.position == 0
