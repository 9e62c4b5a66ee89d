"""Codec decoder: parity with mlx-audio (patched to SPEC §6), SPEC pitfalls against numpy
references, dequantization, long inputs, errors."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

from tests.mlx_audio_reference import spec_alibi_slopes
from voxtral_mlx.checkpoint import sanitize
from voxtral_mlx.config import ModelConfig
from voxtral_mlx.errors import InputError
from voxtral_mlx.model.codec import CodecDecoder
from voxtral_mlx.model.codec_layers import (
    CausalConv1d,
    CausalConvTranspose1d,
    CodecAttention,
    alibi_slopes,
    attention_bias,
    reflect_context,
    replicate_context,
)
from voxtral_mlx.synthetic.checkpoint import make_params, random_weights

PREFIX = "audio_tokenizer."

# Config variants: (name, codec overrides, seed). The odd ones change the semantic width,
# the layers per stage, the FFN width, grouped K/V heads and a non-power-of-two head count.
VARIANTS = [
    ("tiny", {}, 0),
    ("tiny-seed7", {}, 7),
    (
        "gqa-odd",
        dict(n_heads=4, n_kv_heads=2, head_dim=16, semantic_dim=24, hidden_dim=96,
             decoder_transformer_lengths_str="1,3,1,3"),
        1,
    ),
    (
        "six-heads",
        dict(dim=48, n_heads=6, n_kv_heads=6, head_dim=8, hidden_dim=112,
             decoder_transformer_lengths_str="3,1,2,1"),
        2,
    ),
]  # fmt: skip


def codec_config(**overrides) -> ModelConfig:
    params = make_params("tiny")
    params["multimodal"]["audio_tokenizer_args"].update(overrides)
    return ModelConfig.from_params(params)


def raw_weights(config: ModelConfig, seed: int) -> dict[str, mx.array]:
    """Mistral's (unfolded) codec tensors, names without the ``audio_tokenizer.`` prefix."""
    raw = random_weights(config, seed, prefix="audio_tokenizer")
    return {k[len(PREFIX) :]: mx.array(v) for k, v in raw.items()}


def build_decoder(config: ModelConfig, raw: dict[str, mx.array], dtype=mx.float32) -> CodecDecoder:
    folded = sanitize({PREFIX + k: v for k, v in raw.items()}, config, dtype=dtype)
    decoder = CodecDecoder(config.codec)
    decoder.load_weights([(k[len(PREFIX) :], v) for k, v in folded.items()], strict=True)
    mx.eval(decoder.parameters())
    return decoder


def build_reference(config: ModelConfig, raw: dict[str, mx.array], patch: str = "both"):
    """mlx-audio's decoder on the same raw weights.

    SPEC §6: mlx-audio uses ALiBi slopes [1/2 .. 1/256] and a 1e-8 codebook floor; Mistral
    uses [1 .. 1/128] and 1e-5. ``patch`` selects which of the two to set to Mistral's
    (the slopes from tests.mlx_audio_reference, not from voxtral_mlx).
    """
    from mlx_audio.tts.models.voxtral_tts import audio_tokenizer as at

    fields = at.AudioTokenizerArgs.__dataclass_fields__
    tok = config.raw["multimodal"]["audio_tokenizer_args"]
    ref = at.VoxtralTTSAudioTokenizer(at.AudioTokenizerArgs(**{k: v for k, v in tok.items()
                                                               if k in fields}))  # fmt: skip
    ref.load_weights(list(raw.items()), strict=True)
    if patch in ("both", "slopes"):
        ref._alibi_slopes = spec_alibi_slopes(config.codec.n_heads)
    if patch in ("both", "floor"):
        # max(max(u, 1e-5), 1e-8) == max(u, 1e-5): Mistral's floor through mlx-audio's code.
        sc = ref.quantizer.semantic_codebook
        sc.cluster_usage = mx.maximum(sc.cluster_usage, 1e-5)
    mx.eval(ref.parameters())
    return ref


def random_codes(rng: np.random.Generator, config: ModelConfig, frames: int,
                 batch: int = 1) -> np.ndarray:  # fmt: skip
    """Codes with the +2 offset; every third frame hits a zero-usage cluster (index % 16 == 0)."""
    c = config.codec
    sem = rng.integers(0, c.semantic_codebook_size, (batch, frames, 1))
    sem[:, ::3] = 16 * rng.integers(0, c.semantic_codebook_size // 16, sem[:, ::3].shape)
    ac = rng.integers(0, c.acoustic_codebook_size, (batch, frames, c.acoustic_dim))
    return (np.concatenate([sem, ac], axis=-1) + 2).astype(np.int32)


def errors(ours: mx.array, ref: mx.array) -> tuple[float, float]:
    a, b = np.asarray(ours, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    diff = float(np.abs(a - b).max())
    return diff, diff / float(np.abs(b).max())


@pytest.fixture(scope="module", params=VARIANTS, ids=[v[0] for v in VARIANTS])
def variant(request):
    name, overrides, seed = request.param
    config = codec_config(**overrides)
    raw = raw_weights(config, seed)
    return name, config, raw, build_decoder(config, raw)


# -- parity with mlx-audio ----------------------------------------------------------------
@pytest.mark.parametrize("frames", [1, 2, 7, 40])
def test_parity_with_patched_mlx_audio(variant, frames):
    name, config, raw, decoder = variant
    ref = build_reference(config, raw)
    codes = mx.array(random_codes(np.random.default_rng(frames), config, frames))
    expected = ref.decode(codes)
    one_shot = decoder.decode(codes)
    state = decoder.new_state()
    streamed = mx.concatenate([decoder.decode_chunk(codes[:, i : i + 1], state)
                               for i in range(frames)], axis=1)  # fmt: skip
    assert one_shot.shape == expected.shape == (1, frames * 1920)
    for label, ours in (("one-shot", one_shot), ("streamed", streamed)):
        abs_err, rel_err = errors(ours, expected)
        print(f"[{name} T={frames} {label}] max abs {abs_err:.2e}, max rel {rel_err:.2e}")
        assert abs_err < 2e-5 and rel_err < 1e-5


@pytest.mark.parametrize("patch", ["none", "slopes", "floor"])
def test_unpatched_mlx_audio_differs(variant, patch):
    """Each of the two SPEC corrections changes the waveform: the parity check can fail."""
    name, config, raw, decoder = variant
    ref = build_reference(config, raw, patch=patch)
    codes = mx.array(random_codes(np.random.default_rng(3), config, 7))
    abs_err, rel_err = errors(decoder.decode(codes), ref.decode(codes))
    print(f"[{name} patch={patch}] max abs {abs_err:.2e}, max rel {rel_err:.2e}")
    assert rel_err > 1e-2


def test_parity_batched(variant):
    _, config, raw, decoder = variant
    ref = build_reference(config, raw)
    codes = mx.array(random_codes(np.random.default_rng(5), config, 9, batch=3))
    _, rel_err = errors(decoder.decode(codes), ref.decode(codes))
    assert rel_err < 1e-5


# -- loading and dequantization -----------------------------------------------------------
def test_parameter_names_are_the_sanitized_checkpoint_names():
    config = codec_config()
    folded = sanitize({PREFIX + k: v for k, v in raw_weights(config, 0).items()}, config,
                      dtype=mx.float32)  # fmt: skip
    names = {k for k, _ in _flatten(CodecDecoder(config.codec).parameters())}
    assert names == {k[len(PREFIX) :] for k in folded}
    assert "decoder_blocks.2.conv.weight" in names and "semantic_codebook" in names


def _flatten(tree, prefix=""):
    from mlx.utils import tree_flatten

    return tree_flatten(tree, prefix)


def test_dequantize_matches_numpy():
    config = codec_config()
    raw = raw_weights(config, 0)
    decoder = build_decoder(config, raw)
    codes = random_codes(np.random.default_rng(0), config, 12)
    codes[0, 0, 1:] = [2, 12, 22] * 12  # -1, 0, +1
    got = np.asarray(decoder.dequantize(mx.array(codes)))

    usage = np.asarray(raw["quantizer.semantic_codebook.cluster_usage"], dtype=np.float64)
    table = np.asarray(raw["quantizer.semantic_codebook.embedding_sum"], dtype=np.float64)
    table = table / np.maximum(usage, 1e-5)[:, None]
    want = np.concatenate([table[codes[..., 0] - 2], (codes[..., 1:] - 2) * 2 / 20 - 1], -1)
    assert got.shape == (1, 12, config.codec.semantic_dim + config.codec.acoustic_dim)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[0, 0, 16:19], [-1.0, 0.0, 1.0])
    assert (usage[::16] == 0).all() and np.abs(table[::16]).max() > 1e-2  # the floor matters


# -- SPEC pitfalls against numpy ------------------------------------------------------------
def np_conv1d(x: np.ndarray, w_torch: np.ndarray, pad_mode: str) -> np.ndarray:
    """Causal Conv1d, PyTorch weight ``[out, in, k]``, left pad k-1 (edge or reflect)."""
    k = w_torch.shape[2]
    xp = np.pad(x, ((k - 1, 0), (0, 0)), mode=pad_mode)
    return sum(xp[i : i + len(x)] @ w_torch[:, :, i].T for i in range(k))


def np_conv_transpose1d(x: np.ndarray, w_torch: np.ndarray, stride: int) -> np.ndarray:
    """Full ConvTranspose1d (PyTorch weight ``[in, out, k]``) truncated on the right."""
    t, k = len(x), w_torch.shape[2]
    full = np.zeros(((t - 1) * stride + k, w_torch.shape[1]))
    for i in range(t):
        for j in range(k):
            full[i * stride + j] += x[i] @ w_torch[:, :, j]
    return full[: t * stride]


def np_fold(raw: dict[str, mx.array], prefix: str) -> np.ndarray:
    g = np.asarray(raw[f"{prefix}.parametrizations.weight.original0"], dtype=np.float64)
    v = np.asarray(raw[f"{prefix}.parametrizations.weight.original1"], dtype=np.float64)
    return g * v / np.sqrt((v * v).sum(axis=(1, 2), keepdims=True))


def test_conv_chain_matches_numpy_with_identity_transformers():
    """With layer scales zeroed the transformers are the identity and the decoder is
    dequantize -> replicate conv -> right-trimmed transposed convs -> reflect conv -> unpatch."""
    config = codec_config()
    raw = raw_weights(config, 4)
    for name in raw:
        if name.endswith(("attention_scale", "ffn_scale")):
            raw[name] = mx.zeros_like(raw[name])
    decoder = build_decoder(config, raw)
    codes = random_codes(np.random.default_rng(1), config, 5)
    got = np.asarray(decoder.decode(mx.array(codes[0])))

    x = np.asarray(decoder.dequantize(mx.array(codes)), dtype=np.float64)[0]
    x = np_conv1d(x, np_fold(raw, "decoder_blocks.0.conv"), "edge")
    for s in range(1, config.codec.n_stages):
        x = np_conv_transpose1d(x, np_fold(raw, f"decoder_blocks.{2 * s}.conv"), 2)
    y = np_conv1d(x, np_fold(raw, "output_proj.conv"), "reflect")
    patch = config.codec.patch_size
    wave = np.zeros(len(y) * patch)
    for t in range(len(y)):
        for j in range(patch):
            wave[t * patch + j] = y[t, j]  # unpatch: sample t*240 + j is channel j at step t
    assert got.shape == wave.shape == (5 * 1920,)
    np.testing.assert_allclose(got, wave, rtol=1e-4, atol=1e-5 * np.abs(wave).max())
    # The padding modes matter: zero padding of either conv gives another waveform.
    y_zero = np_conv1d(x, np_fold(raw, "output_proj.conv"), "constant")
    assert np.abs(y_zero[:1] - y[:1]).max() > 1e-3


def _conv(module, weight: np.ndarray) -> None:
    module.weight = mx.array(weight.astype(np.float32))


def test_first_conv_replicate_pad():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((5, 4, 3))  # torch [out, in, k]
    conv = CausalConv1d(4, 5, 3)
    _conv(conv, w.transpose(0, 2, 1))
    x = rng.standard_normal((6, 4))
    xm = mx.array(x[None].astype(np.float32))
    y, context = conv(xm, replicate_context(xm, 2))
    np.testing.assert_allclose(np.asarray(y)[0], np_conv1d(x, w, "edge"), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(context)[0], x[-2:], rtol=1e-6)
    assert np.abs(np_conv1d(x, w, "edge")[0] - np_conv1d(x, w, "constant")[0]).max() > 1e-2


@pytest.mark.parametrize("steps", [7, 8, 13, 1, 3, 6])
def test_output_conv_reflect_pad(steps):
    rng = np.random.default_rng(steps)
    w = rng.standard_normal((3, 4, 7))
    conv = CausalConv1d(4, 3, 7)
    _conv(conv, w.transpose(0, 2, 1))
    x = rng.standard_normal((steps, 4))
    xm = mx.array(x[None].astype(np.float32))
    y, _ = conv(xm, reflect_context(xm, 6))
    if steps > 6:
        want = np_conv1d(x, w, "reflect")
    else:  # Mistral's pad1d: zero-extend to 7 steps, reflect, drop the extension
        want = np_conv1d(np.pad(x, ((0, 7 - steps), (0, 0))), w, "reflect")[:steps]
    np.testing.assert_allclose(np.asarray(y)[0], want, rtol=1e-5, atol=1e-5)
    if steps > 6:
        np.testing.assert_array_equal(np.asarray(reflect_context(xm, 6))[0], x[6:0:-1].astype(
            np.float32))  # fmt: skip


@pytest.mark.parametrize(("kernel", "stride"), [(4, 2), (3, 2), (5, 2), (3, 3), (2, 2)])
def test_transposed_conv_right_trim(kernel, stride):
    rng = np.random.default_rng(kernel * 10 + stride)
    w = rng.standard_normal((4, 5, kernel))  # torch ConvTranspose1d [in, out, k]
    conv = CausalConvTranspose1d(4, 5, kernel, stride)
    _conv(conv, w.transpose(1, 2, 0))  # -> [out, k, in]
    x = rng.standard_normal((9, 4))
    xm = mx.array(x[None].astype(np.float32))
    fresh = mx.zeros((1, conv.context, 4))
    y, _ = conv(xm, fresh)
    want = np_conv_transpose1d(x, w, stride)
    assert y.shape == (1, 9 * stride, 5)  # the length is multiplied exactly
    np.testing.assert_allclose(np.asarray(y)[0], want, rtol=1e-5, atol=1e-5)
    # The same in two pieces through the carried context.
    y1, ctx = conv(xm[:, :4], fresh)
    y2, _ = conv(xm[:, 4:], ctx)
    np.testing.assert_allclose(np.asarray(mx.concatenate([y1, y2], 1))[0], want, atol=1e-5)


def test_alibi_slopes():
    assert alibi_slopes(8) == [1, 1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64, 1 / 128]
    assert alibi_slopes(4) == [1, 1 / 4, 1 / 16, 1 / 64]
    # Non-powers of two: the 4-head rule, then every other slope of the 8-head rule ...
    assert alibi_slopes(6) == [1, 1 / 4, 1 / 16, 1 / 64, 1, 1 / 4]
    # ... and the 8-head rule, then every other slope of the 16-head rule (r = 2**-0.5).
    np.testing.assert_allclose(
        alibi_slopes(12), [1, 1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64, 1 / 128,
                           1, 1 / 2, 1 / 4, 1 / 8], rtol=1e-12)  # fmt: skip
    assert CodecDecoder(codec_config().codec)._plan.slopes.tolist() == alibi_slopes(8)


def test_attention_bias_layout():
    bias = np.asarray(attention_bias(mx.array([1.0, 0.5]), window=2, n=3, n_valid=1))
    inf = -np.inf
    # keys: 2 cache slots (first invalid), then 3 new; query i sits at key column 2 + i
    want_h0 = [[inf, -1, 0, inf, inf], [inf, -2, -1, 0, inf], [inf, inf, -2, -1, 0]]
    np.testing.assert_array_equal(bias[0], want_h0)
    np.testing.assert_array_equal(bias[1], np.array(want_h0) * 0.5)


def _np_rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def test_qk_norm_over_full_width_before_head_split():
    rng = np.random.default_rng(0)
    dim, heads, hd, n = 16, 4, 4, 5
    attn = CodecAttention(dim, heads, heads, hd, qk_norm_eps=1e-6)
    p = {k: rng.standard_normal((dim, dim)) / 4 for k in ("wq", "wk", "wv", "wo")}
    qn, kn = 1 + rng.standard_normal(dim), 1 + rng.standard_normal(dim)
    attn.update({k: {"weight": mx.array(v.astype(np.float32))} for k, v in p.items()})
    attn.update({"q_norm": {"weight": mx.array(qn.astype(np.float32))},
                 "k_norm": {"weight": mx.array(kn.astype(np.float32))}})  # fmt: skip
    x = rng.standard_normal((n, dim)) * np.linspace(0.2, 3, dim)  # uneven scale per head
    mask = attention_bias(mx.array(alibi_slopes(heads)), window=n, n=n, n_valid=0)
    cache = mx.zeros((1, heads, n, hd))
    got, _, _ = attn(mx.array(x[None].astype(np.float32)), cache, cache, mask)
    mask = np.asarray(mask)

    def reference(per_head: bool) -> np.ndarray:
        q, k, v = x @ p["wq"].T, x @ p["wk"].T, x @ p["wv"].T
        if per_head:
            q = _np_rms(q.reshape(n, heads, hd), qn.reshape(heads, hd), 1e-6).reshape(n, dim)
            k = _np_rms(k.reshape(n, heads, hd), kn.reshape(heads, hd), 1e-6).reshape(n, dim)
        else:
            q, k = _np_rms(q, qn, 1e-6), _np_rms(k, kn, 1e-6)
        out = np.zeros((n, dim))
        for h in range(heads):
            sl = slice(h * hd, (h + 1) * hd)
            scores = q[:, sl] @ k[:, sl].T / np.sqrt(hd) + mask[h][:, n:]
            prob = np.exp(scores - scores.max(-1, keepdims=True))
            out[:, sl] = (prob / prob.sum(-1, keepdims=True)) @ v[:, sl]
        return out @ p["wo"].T

    np.testing.assert_allclose(np.asarray(got)[0], reference(False), rtol=1e-4, atol=1e-5)
    assert np.abs(reference(True) - reference(False)).max() > 1e-2


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_windows_are_honoured(stage):
    """Query i sees keys i-W..i: a key one step outside the window has no influence."""
    config = codec_config()
    decoder = build_decoder(config, raw_weights(config, 0))
    assert decoder.windows == config.codec.windows == (2, 4, 8, 16)
    w = decoder.windows[stage]
    n, i = 48, 47
    rng = np.random.default_rng(stage)
    x = rng.standard_normal((1, n, config.codec.dim)).astype(np.float32)

    def layer0(inp: np.ndarray) -> np.ndarray:  # one layer: reach W
        state = decoder.new_state()
        layer = decoder.decoder_blocks[2 * stage + 1].layers[0]
        mask = decoder._mask(stage, n, 0, mx.float32)
        out, _, _ = layer(mx.array(inp), state.keys[stage][0], state.values[stage][0], mask)
        return np.asarray(out)[0, i]

    def block(inp: np.ndarray) -> np.ndarray:  # the stage's 2 layers: reach 2W
        state = decoder.new_state()
        mask = decoder._mask(stage, n, 0, mx.float32)
        keys, values = state.keys[stage], state.values[stage]
        out = decoder._stage_transformer(stage, mx.array(inp), keys, values, mask)
        return np.asarray(out)[0, i]

    for fn, reach in ((layer0, w), (block, 2 * w)):
        base = fn(x)
        outside, inside = x.copy(), x.copy()
        outside[0, i - reach - 1] += 5.0
        inside[0, i - reach] += 5.0
        np.testing.assert_array_equal(fn(outside), base)
        assert np.abs(fn(inside) - base).max() > 1e-4


# -- long inputs, shapes, errors ----------------------------------------------------------
def test_long_input_bounded_memory():
    config = codec_config()
    decoder = build_decoder(config, raw_weights(config, 0))
    frames = 2000
    codes = mx.array(random_codes(np.random.default_rng(0), config, frames)[0])
    head = decoder.decode(codes[:30])
    mx.eval(head)
    mx.reset_peak_memory()
    base = mx.get_active_memory()  # models that other tests keep loaded
    audio = decoder.decode(codes)
    mx.eval(audio)
    peak = mx.get_peak_memory() - base
    out_bytes = audio.nbytes
    mib = 2**20
    print(f"[long] {frames} frames: output {out_bytes / mib:.1f} MiB, peak {peak / mib:.1f} MiB")
    assert audio.shape == (frames * 1920,)
    # One-shot attention over 16000 steps alone would need 8 x 16000^2 x 4 B = 8 GB.
    assert peak < 3 * out_bytes + 64 * 2**20
    assert bool(mx.all(mx.isfinite(audio)))
    np.testing.assert_allclose(np.asarray(audio[: 30 * 1920]), np.asarray(head), atol=1e-5)


def test_empty_and_shapes():
    config = codec_config()
    decoder = build_decoder(config, raw_weights(config, 0))
    assert decoder.samples_per_frame == 1920
    assert decoder.decode(mx.zeros((0, 37), dtype=mx.int32)).shape == (0,)
    assert decoder.decode(mx.zeros((2, 0, 37), dtype=mx.int32)).shape == (2, 0)
    state = decoder.new_state(2)
    assert decoder.decode_chunk(mx.zeros((2, 0, 37), dtype=mx.int32), state).shape == (2, 0)
    assert state.position == 0
    codes = random_codes(np.random.default_rng(0), config, 3)
    out = decoder.decode(codes[0])  # numpy input is accepted
    assert out.shape == (3 * 1920,) and out.dtype == mx.float32


def test_bad_input_raises_one_line_errors():
    config = codec_config()
    decoder = build_decoder(config, raw_weights(config, 0))
    state = decoder.new_state(1)
    bad = [
        (mx.zeros((1, 2, 36), dtype=mx.int32), "shape [batch, frames, 37], got [1, 2, 36]"),
        (mx.zeros((2, 2, 37), dtype=mx.int32), "2 streams but the codec state was made for 1"),
        (mx.zeros((1, 2, 37), dtype=mx.float32), "must be integers, got float32"),
    ]
    for codes, words in bad:
        with pytest.raises(InputError) as info:
            decoder.decode_chunk(codes, state)
        assert "\n" not in str(info.value) and words in str(info.value)
    with pytest.raises(InputError):
        decoder.decode(mx.zeros((37,), dtype=mx.int32))


def test_bfloat16_compute():
    config = codec_config()
    raw = raw_weights(config, 0)
    decoder = build_decoder(config, raw, dtype=mx.bfloat16)
    codes = mx.array(random_codes(np.random.default_rng(2), config, 6))
    out = decoder.decode(codes)
    assert out.dtype == mx.bfloat16
    state = decoder.new_state()
    assert all(a.dtype == mx.bfloat16 for a in state.arrays())
    streamed = mx.concatenate([decoder.decode_chunk(codes[:, i : i + 1], state)
                               for i in range(6)], 1)  # fmt: skip
    ref = build_decoder(config, raw).decode(codes)
    _, rel_stream = errors(streamed.astype(mx.float32), out.astype(mx.float32))
    _, rel_f32 = errors(out.astype(mx.float32), ref)
    assert rel_stream < 1e-3 and rel_f32 < 3e-2  # measured 0.0 and 1.4e-2


def test_state_is_a_dataclass_of_arrays():
    config = codec_config()
    decoder = build_decoder(config, raw_weights(config, 0))
    state = decoder.new_state(3)
    assert dataclasses.is_dataclass(state) and state.batch == 3 and state.position == 0
    assert all(a.shape[0] == 3 for a in state.arrays())


@pytest.mark.parametrize(
    ("window", "block", "n", "n_valid", "batch", "kv_heads"),
    [(2, 16, 17, 0, 1, 4), (4, 16, 40, 2, 2, 2), (16, 16, 128, 16, 1, 4), (16, 16, 33, 5, 3, 1)],
)
def test_banded_attention_equals_dense(window, block, n, n_valid, batch, kv_heads):
    """Blocked sliding-window attention gives the dense masked result (work linear in n)."""
    from voxtral_mlx.model.codec_layers import banded_attention, banded_attention_bias

    heads, d = 4, 8
    rng = np.random.default_rng(n + window)
    q = mx.array(rng.standard_normal((batch, heads, n, d)).astype(np.float32))
    k = mx.array(rng.standard_normal((batch, kv_heads, window + n, d)).astype(np.float32))
    v = mx.array(rng.standard_normal((batch, kv_heads, window + n, d)).astype(np.float32))
    slopes = mx.array(alibi_slopes(heads))
    dense = mx.fast.scaled_dot_product_attention(
        q, k, v, scale=d**-0.5, mask=attention_bias(slopes, window, n, n_valid)
    )
    mask = banded_attention_bias(slopes, window, block, n, n_valid)
    assert mask.shape == (-(-n // block), heads, block, block + window)
    banded = banded_attention(q, k, v, d**-0.5, mask)
    np.testing.assert_allclose(np.asarray(banded), np.asarray(dense), rtol=1e-5, atol=1e-6)
