"""The generation loop and the SPEC pitfalls, checked against small numpy references."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

import voxtral_mlx
from voxtral_mlx.config import END_AUDIO
from voxtral_mlx.errors import InputError
from voxtral_mlx.model.flow import cfg_weights
from voxtral_mlx.synthetic.checkpoint import build_random_checkpoint, make_params

TEXT = "Hello there."
VOICE = "fr_male"


def np_rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def np_rope_interleaved(x, positions, theta):
    """x [T, H, D]: rotate consecutive pairs (x[2i], x[2i+1]) by pos * theta^(-2i/D)."""
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2) / d)
    ang = positions[:, None] * inv[None, :]  # [T, D/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = a * sin + b * cos
    return out


def np_backbone(weights, cfg, x, rope=np_rope_interleaved):
    """Causal Mistral decoder over all positions of x [T, dim] -> final-normed hidden states."""
    b = cfg.backbone
    t = x.shape[0]
    pos = np.arange(t, dtype=np.float64)
    mask = np.triu(np.full((t, t), -np.inf), 1)
    g = b.n_heads // b.n_kv_heads
    for i in range(b.n_layers):
        p = f"layers.{i}."
        h = np_rms_norm(x, weights[p + "attention_norm.weight"], b.norm_eps)
        q = (h @ weights[p + "attention.wq.weight"].T).reshape(t, b.n_heads, b.head_dim)
        k = (h @ weights[p + "attention.wk.weight"].T).reshape(t, b.n_kv_heads, b.head_dim)
        v = (h @ weights[p + "attention.wv.weight"].T).reshape(t, b.n_kv_heads, b.head_dim)
        q, k = rope(q, pos, b.rope_theta), rope(k, pos, b.rope_theta)
        k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / math.sqrt(b.head_dim) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        o = np.einsum("hts,shd->thd", s, v).reshape(t, -1)
        x = x + o @ weights[p + "attention.wo.weight"].T
        h = np_rms_norm(x, weights[p + "ffn_norm.weight"], b.norm_eps)
        a = h @ weights[p + "feed_forward.w1.weight"].T
        gate = a / (1 + np.exp(-a)) * (h @ weights[p + "feed_forward.w3.weight"].T)
        x = x + gate @ weights[p + "feed_forward.w2.weight"].T
    return np_rms_norm(x, weights["norm.weight"], b.norm_eps)


@pytest.fixture(scope="module")
def weights(tiny_checkpoint):
    from safetensors.numpy import load_file

    return {
        k: v.astype(np.float64)
        for k, v in load_file(tiny_checkpoint / "consolidated.safetensors").items()
    }


def test_interleaved_rope_and_kv_cache_match_numpy(tiny_tts, weights):
    """Prefill + two cached steps equal a numpy decoder with interleaved-pair RoPE; the
    split-half convention would not (checked too, so the comparison can fail)."""
    model = tiny_tts.model
    prompt = tiny_tts.prompt_embeddings(TEXT, VOICE)
    extra = mx.array(
        np.random.default_rng(0).standard_normal((2, model.config.backbone.dim)), mx.float32
    )

    def run():  # on the model's worker thread (MLX arrays are bound to their thread)
        cache = model.make_cache()
        out = [model(prompt, cache)[0]]
        for j in range(2):
            out.append(model(extra[j][None, None], cache)[0])
        return mx.concatenate(out)

    ours = np.array(tiny_tts.call(run))
    x = np.concatenate([np.array(prompt[0]), np.array(extra)]).astype(np.float64)
    ref = np_backbone(weights, tiny_tts.config, x)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=2e-4 * np.abs(ref).max())

    def split_half(x, positions, theta):
        d = x.shape[-1]
        y = np.concatenate([x[..., : d // 2, None], x[..., d // 2 :, None]], -1).reshape(x.shape)
        r = np_rope_interleaved(y, positions, theta)
        return np.concatenate([r[..., 0::2], r[..., 1::2]], -1)

    wrong = np_backbone(weights, tiny_tts.config, x, rope=split_half)
    assert np.abs(wrong - ours).max() > 1e-2


def test_time_tokens_are_cos_then_sin(tiny_tts, weights):
    f = tiny_tts.config.flow
    half = f.dim // 2
    freqs = np.exp(-math.log(1e4) * np.arange(half) / half)
    for i in range(f.n_decoding_steps):
        t = i / f.n_decoding_steps
        temb = np.concatenate([np.cos(t * freqs), np.sin(t * freqs)])
        ref = weights["acoustic_transformer.time_projection.weight"] @ temb
        ours = np.array(
            tiny_tts.call(lambda i=i: tiny_tts.model.acoustic_transformer.time_tokens[i])
        )
        np.testing.assert_allclose(ours, ref, atol=1e-4 * np.abs(ref).max())


def test_first_frame_comes_from_the_last_prompt_position(tiny_tts):
    """No extra [AUDIO] step after prefill: frame 0 is predicted by the prompt's last state."""
    noise = np.random.default_rng(1).standard_normal((3, 36)).astype(np.float32)
    speech = tiny_tts.synthesize(TEXT, VOICE, noise=noise, max_frames=3)
    model = tiny_tts.model
    prompt = tiny_tts.prompt_embeddings(TEXT, VOICE)
    assert prompt.shape[1] == len(tiny_tts.prompt_ids(TEXT, VOICE))
    assert tiny_tts.prompt_ids(TEXT, VOICE)[-2:] == [35, 25]

    def run():
        h = model(prompt, model.make_cache())[:, -1]
        return model.frame(h, mx.array(noise[:1]), cfg_weights([1.2]))[1]

    frame0 = np.array(tiny_tts.call(run))[0]
    np.testing.assert_array_equal(speech.codes[0], frame0)


def test_voice_rows_replace_audio_placeholders(tiny_tts):
    ids = tiny_tts.prompt_ids(TEXT, VOICE)
    n = tiny_tts.voices[VOICE].num_tokens
    assert ids[:2] == [1, 25] and ids[2 : 2 + n] == [24] * n and ids[2 + n] == 36
    emb = np.array(tiny_tts.prompt_embeddings(TEXT, VOICE)[0])
    voice = np.array(tiny_tts.voices.embedding(VOICE, mx.float32))
    np.testing.assert_array_equal(emb[2 : 2 + n], voice)
    table = np.array(
        tiny_tts.call(lambda: tiny_tts.model.mm_audio_embeddings.tok_embeddings.weight)
    )
    np.testing.assert_array_equal(emb[:2], table[[1, 25]])
    np.testing.assert_array_equal(emb[2 + n :], table[ids[2 + n :]])


class _ScriptedSemantic:
    """Wraps ``model.frame`` so that the semantic code follows a script: END at frame
    ``end_at`` (counted per sequence row 0), other codes arbitrary but valid."""

    def __init__(self, model, end_at):
        self.model, self.end_at, self.calls = model, end_at, 0
        self.original = model.frame

    def __call__(self, h, noise, cfg):
        _sem, codes = self.original(h, noise, cfg)
        i = self.calls
        self.calls += 1
        code = END_AUDIO if i == self.end_at else 2 + (i % 7)
        sem = mx.full((h.shape[0],), code, dtype=mx.int32)
        return sem, mx.concatenate([sem[:, None], codes[:, 1:]], axis=-1)


@pytest.mark.parametrize("end_at", [0, 1, 5])
def test_end_stops_and_is_neither_decoded_nor_fed_back(tiny_tts, monkeypatch, end_at):
    model = tiny_tts.model
    monkeypatch.setattr(model, "frame", _ScriptedSemantic(model, end_at))
    fed = []
    original_embed = model.embed_codes

    def embed_codes(codes):
        fed.append(np.array(codes))
        return original_embed(codes)

    monkeypatch.setattr(model, "embed_codes", embed_codes)
    monkeypatch.setattr(model, "_embed", None)  # the compiled one would bypass the spy
    speech = tiny_tts.synthesize(TEXT, VOICE, seed=0, max_frames=20)
    assert len(speech.codes) == end_at
    assert speech.audio.shape == (end_at * 1920,)
    assert not (speech.codes[:, 0] == END_AUDIO).any()
    # Frames are fed back as they are generated; the END frame never is (the one frame
    # queued ahead of the END check may have been fed, but never the END codes themselves).
    assert len(fed) >= end_at and all(f[0, 0] != END_AUDIO for f in fed)


def test_max_frames_and_noise_limit(tiny_tts, monkeypatch):
    monkeypatch.setattr(tiny_tts.model, "frame", _ScriptedSemantic(tiny_tts.model, 10**9))
    assert len(tiny_tts.synthesize(TEXT, VOICE, seed=3, max_frames=7).codes) == 7
    noise = np.zeros((4, 36), np.float32)
    assert len(tiny_tts.synthesize(TEXT, VOICE, noise=noise, max_frames=7).codes) == 4
    assert len(tiny_tts.synthesize(TEXT, VOICE, seed=3, max_frames=0).codes) == 0


def test_same_seed_same_audio_and_noise_rows_drive_frames(tiny_tts):
    a = tiny_tts.synthesize(TEXT, VOICE, seed=11, max_frames=12)
    b = tiny_tts.synthesize(TEXT, VOICE, seed=11, max_frames=12)
    np.testing.assert_array_equal(a.codes, b.codes)
    np.testing.assert_array_equal(a.audio, b.audio)
    # The global random state plays no part.
    mx.random.seed(123)
    c = tiny_tts.synthesize(TEXT, VOICE, seed=11, max_frames=12)
    np.testing.assert_array_equal(a.codes, c.codes)
    # Frame i's noise depends only on (seed, i): a shorter run is a prefix of a longer one.
    d = tiny_tts.synthesize(TEXT, VOICE, seed=11, max_frames=5)
    np.testing.assert_array_equal(d.codes, a.codes[: len(d.codes)])
    assert a.seed == 11


@pytest.mark.parametrize(
    "bad", [np.zeros((3, 35)), np.zeros((3, 36), np.int32), np.full((2, 36), np.nan)]
)
def test_bad_noise_is_rejected(tiny_tts, bad):
    with pytest.raises(InputError, match="noise") as exc:
        tiny_tts.synthesize(TEXT, VOICE, noise=bad)
    assert "or a seed instead" in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize("text", [None, 3, b"Hello."])
def test_text_that_is_not_a_string_is_rejected(tiny_tts, text):
    for call in (tiny_tts.synthesize, tiny_tts.stream):
        with pytest.raises(InputError, match=r"text must be a string.*pass the text itself"):
            call(text, VOICE)


@pytest.mark.parametrize("text", ["", "   \n\t "])
def test_empty_text_is_rejected(tiny_tts, text):
    with pytest.raises(InputError, match="empty"):
        tiny_tts.synthesize(text, VOICE)


REAL_EVAL, REAL_ASYNC_EVAL = mx.eval, mx.async_eval


def _count_evals(monkeypatch):
    counts = {"eval": 0, "async_eval": 0}
    real_eval, real_async = REAL_EVAL, REAL_ASYNC_EVAL

    def eval_(*a, **k):
        counts["eval"] += 1
        return real_eval(*a, **k)

    def async_eval(*a, **k):
        counts["async_eval"] += 1
        return real_async(*a, **k)

    monkeypatch.setattr(mx, "eval", eval_)
    monkeypatch.setattr(mx, "async_eval", async_eval)
    return counts


@pytest.fixture(scope="module")
def deep_tts(tmp_path_factory):
    params = make_params("tiny", n_layers=6, flow_layers=4)
    path = build_random_checkpoint(tmp_path_factory.mktemp("deep"), params, dtype="float32")
    return voxtral_mlx.load(path)


def test_eval_calls_per_frame_do_not_grow_with_layers(tiny_tts, deep_tts, monkeypatch):
    per_frame = []
    for tts in (tiny_tts, deep_tts):
        monkeypatch.setattr(tts.model, "frame", _ScriptedSemantic(tts.model, 10**9))
        tts.synthesize(TEXT, VOICE, seed=0, max_frames=2)  # voice prefix cached, graphs compiled
        counts = {}
        for frames in (4, 12):
            c = _count_evals(monkeypatch)
            tts.synthesize(TEXT, VOICE, seed=0, max_frames=frames)
            counts[frames] = c["eval"] + c["async_eval"]
        per_frame.append((counts[12] - counts[4]) / 8)
    assert per_frame[0] == per_frame[1], per_frame
    assert per_frame[0] <= 2, per_frame


def test_a_cancelled_job_leaves_the_queue_while_the_batch_is_full(tiny_tts, monkeypatch):
    monkeypatch.setattr(tiny_tts.model, "frame", _ScriptedSemantic(tiny_tts.model, 10**9))
    engine = tiny_tts.engine

    def run() -> None:
        saved, engine.max_batch = engine.max_batch, 1
        try:
            running = tiny_tts.job(TEXT, VOICE, seed=0, max_frames=50)
            waiting = tiny_tts.job(TEXT, VOICE, seed=1, max_frames=50)
            engine.submit(running)
            engine.submit(waiting)
            engine.pump()
            assert engine._waiting == [waiting]
            waiting.cancel()
            engine.pump()
            assert engine._waiting == [] and waiting.done
            assert not running.done
            running.cancel()
            while engine.pump():
                pass
            assert running.done and running.seq.stop_reason == "cancelled"
        finally:
            engine.max_batch = saved

    tiny_tts.call(run)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"seed": -5},
        {"seed": 2**64},
        {"seed": "7"},
        {"seed": 1.5},
        {"cfg_alpha": float("nan")},
        {"cfg_alpha": float("inf")},
        {"pause": -1.0, "split": True},
        {"pause": float("nan"), "split": True},
    ],
)
def test_bad_request_parameters_are_input_errors(tiny_tts, kwargs):
    name = next(iter(kwargs))
    with pytest.raises(InputError, match=f"^{name} must be"):  # that value's own error
        tiny_tts.synthesize(TEXT, VOICE, max_frames=2, **kwargs)


def test_largest_seed_and_split_segments_wrap_around(tiny_tts):
    """Segment i uses seed (seed + i) mod 2**64: after 2**64 - 1 comes 0."""
    top, text, kwargs = 2**64 - 1, "One.\n\nTwo.", {"max_frames": 3, "split": True}
    chunks = list(tiny_tts.stream(text, VOICE, seed=top, **kwargs))
    seeds = {c.segment: c.seed for c in chunks if c.frames}  # a pause has no seed
    assert seeds == {0: top, 1: 0}
    speech = tiny_tts.synthesize(text, VOICE, seed=top, **kwargs)
    assert speech.seed == top
    first = tiny_tts.synthesize("One.", VOICE, seed=top, max_frames=3).codes
    second = tiny_tts.synthesize("Two.", VOICE, seed=0, max_frames=3).codes
    assert len(first) == len(second) == 3
    assert not np.array_equal(
        second, tiny_tts.synthesize("Two.", VOICE, seed=top, max_frames=3).codes
    )
    np.testing.assert_array_equal(speech.codes, np.concatenate([first, second]))


def test_nan_in_the_flow_head_marks_codes_in_range(tiny_checkpoint):
    """Damaged (NaN) weights: the frame's acoustic codes are 1 (never generated), which the
    engine reports as an error, yet a row of each codebook's embedding, so the step fed
    back before the host sees them cannot gather out of range."""
    import voxtral_mlx

    tts = voxtral_mlx.load(tiny_checkpoint)
    try:

        def poisoned_frame() -> np.ndarray:
            head = tts.model.acoustic_transformer
            wq = head.layers[0].attention.wq
            wq.weight = mx.full(wq.weight.shape, mx.nan, dtype=wq.weight.dtype)
            head.prepare()  # recompile: the compiled frame captured the old weights
            h = mx.ones((1, tts.config.backbone.dim))
            semantic, codes = tts.model.frame(h, mx.zeros((1, 36)), cfg_weights([1.2]))
            return np.array(semantic), np.array(codes)

        semantic, codes = tts.call(poisoned_frame)
        assert semantic.tolist() == codes[:, 0].tolist() and codes[0, 0] >= 2
        assert (codes[:, 1:] == 1).all()
        rows = tts.config.flow.acoustic_codebook_size + 2
        assert codes[:, 1:].max() < rows
    finally:
        tts.close()


@pytest.mark.parametrize("bad", [mx.inf, -mx.inf, mx.nan])
def test_an_ode_state_that_is_not_finite_becomes_code_1(tiny_tts, bad):
    """Infinite velocities would otherwise clip to the first or last level, a valid code."""
    head = tiny_tts.model.acoustic_transformer

    def run() -> np.ndarray:
        def velocity(x, step, tokens, x_token=None):  # conditional rows first, then unconditional
            cond = mx.full(x.shape, bad, dtype=mx.float32)
            return mx.concatenate([cond, mx.zeros(x.shape, mx.float32)])

        head.velocity = velocity  # an instance attribute: the class's method is untouched
        try:
            h = mx.ones((2, tiny_tts.config.backbone.dim))
            return np.array(head.acoustic_codes(h, mx.zeros((2, 36)), cfg_weights([1.0, 1.0])))
        finally:
            del head.velocity

    assert (tiny_tts.call(run) == 1).all()


def test_a_row_taken_out_of_a_batch_cache_owns_its_memory():
    """A set-aside sequence keeps only its own rows: its copy must not pin the buffer of
    the whole (padded) batch while it waits to rejoin."""
    from voxtral_mlx.model.cache import BatchKVCache

    def cache(rows: int, length: int) -> BatchKVCache:
        k = mx.random.normal((rows, 2, length, 16))
        return BatchKVCache(k, k + 1, [0] * rows, length)

    batch = cache(1, 40)
    batch.merge(cache(7, 512))  # row 0 is left-padded to the others' length
    mx.eval(batch.keys, batch.values)
    row = batch.extract(0)
    mx.eval(row.keys, row.values)
    assert row.length == 40 and row.left_padding == [0]
    np.testing.assert_array_equal(np.array(row.keys[0, :, :, :]), np.array(batch.keys[0, :, -40:]))
    before = mx.get_active_memory()
    freed = batch.keys.nbytes + batch.values.nbytes
    del batch
    assert before - mx.get_active_memory() >= freed  # nothing of the batch is kept alive


def test_empty_audio_and_padding_rows_are_never_predicted(tiny_tts):
    """Code 0 (EMPTY_AUDIO) and the rows padding the semantic head to a multiple of 128 are
    masked: the greedy code is the best of the others however large their logits are."""
    from voxtral_mlx.model.flow import FlowHead

    args = tiny_tts.config.flow
    head = FlowHead(args)
    rows, limit = args.semantic_output_rows, args.semantic_codebook_size + 2
    assert rows > limit  # the tiny config has padding rows too
    w = np.zeros((rows, args.dim), np.float32)
    w[0], w[limit:], w[7] = 50.0, 80.0, 1.0
    head.semantic_codebook_output.weight = mx.array(w)
    h = mx.ones((3, args.dim))
    assert head.semantic_code(h).tolist() == [7, 7, 7]
    w[7], w[1] = -1.0, 0.5  # END (1) is now the best unmasked row
    head.semantic_codebook_output.weight = mx.array(w)
    assert head.semantic_code(h).tolist() == [1, 1, 1]
    w[limit - 1] = 0.75  # the last code is no padding row
    head.semantic_codebook_output.weight = mx.array(w)
    assert head.semantic_code(h).tolist() == [limit - 1] * 3


def test_a_frame_runs_conditional_and_unconditional_as_one_batch(tiny_tts, monkeypatch):
    """Per frame: ``llm_projection(h)`` once and its first-layer projections with the first
    step's ``x`` token's, the time tokens never (precomputed); at each later Euler step the
    first layer's projections of the B new ``x`` rows only; at each step every flow layer
    once on the 2B rows of both passes, the last one at position 0 only (its queries too)."""
    import mlx.nn as nn

    from voxtral_mlx.model.flow import FlowHead, cfg_weights
    from voxtral_mlx.model.layers import Attention, TransformerBlock

    args = tiny_tts.config.flow
    head = FlowHead(args)
    head.prepare(compile=False)
    seen: list[tuple[str, tuple[int, ...]]] = []

    def spy(cls, name, label_of):
        original = getattr(cls, name)

        def wrapper(self, x, *rest, **kw):
            label = label_of(self)
            if label:
                seen.append((label, tuple(x.shape)))
            return original(self, x, *rest, **kw)

        monkeypatch.setattr(cls, name, wrapper)

    projections = {
        id(head.llm_projection): "llm",
        id(head.time_projection): "time",
        id(head.layers[-1].attention.wq): "last queries",
    }
    spy(TransformerBlock, "__call__", lambda _: "layer")
    spy(TransformerBlock, "from_projections", lambda _: "first")
    spy(TransformerBlock, "first_position", lambda _: "last")
    spy(Attention, "projections", lambda _: "first projections")
    spy(nn.Linear, "__call__", lambda m: projections.get(id(m)))
    b, n = 3, args.n_decoding_steps
    h = mx.array(np.random.default_rng(0).standard_normal((b, args.dim)), dtype=mx.float32)
    noise = mx.zeros((b, args.n_acoustic_codebook))
    mx.eval(head.frame(h, noise, cfg_weights([1.2] * b)))
    assert args.n_layers >= 2
    rows = (2 * b, 3, args.dim)
    step = [("first", rows)]
    step += [("layer", rows)] * (args.n_layers - 2)
    step += [("last", rows), ("last queries", (2 * b, 1, args.dim))]
    new_x = [("first projections", (b, args.dim))]
    # The first step's x token is projected with the llm token, in one product.
    want = [("llm", (b, args.input_dim)), ("first projections", (2 * b, args.dim)), *step]
    want += (new_x + step) * (n - 1)
    assert seen == want


def test_a_bfloat16_semantic_head_multiplies_in_bfloat16_then_compares_in_float32(tiny_tts):
    """SPEC's "logits in float32" read as PyTorch's ``semantic_codebook_output(h).float()``:
    the product in the model's dtype, cast before the mask and argmax. A product done in
    float32 picks another code on some rows of near-equal logits."""
    from voxtral_mlx.model.flow import FlowHead

    args = tiny_tts.config.flow
    head = FlowHead(args)
    limit = args.semantic_codebook_size + 2
    rng = np.random.default_rng(3)
    w = mx.array(rng.standard_normal((args.semantic_output_rows, args.dim)) / args.dim**0.5)
    head.semantic_codebook_output.weight = w.astype(mx.bfloat16)
    h = mx.array(rng.standard_normal((600, args.dim))).astype(mx.bfloat16)

    def greedy(logits: mx.array) -> list[int]:
        return (mx.argmax(logits[:, 1:limit], axis=-1) + 1).tolist()

    wb = head.semantic_codebook_output.weight
    in_bf16 = greedy((h @ wb.T).astype(mx.float32))
    in_f32 = greedy(h.astype(mx.float32) @ wb.astype(mx.float32).T)
    assert in_bf16 != in_f32  # the data tells the two readings apart
    assert head.semantic_code(h).tolist() == in_bf16
