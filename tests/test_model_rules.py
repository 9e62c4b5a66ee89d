"""Rules of voxtral_mlx/model/ that the parity tests leave unpinned, each checked against an
independent numpy/float64 reference or exact values on a tiny config."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import torch
from test_codec import _np_rms

import voxtral_mlx
from tests.spec_reference import SpecReference, rms
from voxtral_mlx.model.flow import cfg_weights


def test_ode_state_starts_from_the_float32_noise_in_a_bfloat16_model(tiny_checkpoint_bf16):
    """With zero velocities the codes are the float32 noise quantized: noise just above a
    level's rounding boundary must not be rounded to bfloat16 first (0.3501 would become
    0.3496 and drop a level)."""
    tts = voxtral_mlx.load(tiny_checkpoint_bf16, prefix_cache_dir=None)
    try:
        head = tts.model.acoustic_transformer
        levels = tts.config.flow.acoustic_codebook_size - 1
        k = np.arange(36) % levels
        noise = ((2 * k + 1) / levels - 1 + 1e-4).clip(-1, 1).astype(np.float32)[None]

        def run() -> np.ndarray:
            def velocity(x, step, tokens, x_token=None):
                return mx.zeros((2 * x.shape[0], x.shape[1]), mx.float32)

            head.velocity = velocity  # an instance attribute: the class is untouched
            try:
                h = mx.ones((1, tts.config.backbone.dim), dtype=mx.bfloat16)
                return np.array(head.acoustic_codes(h, mx.array(noise), cfg_weights([1.2])))
            finally:
                del head.velocity

        want = np.round((noise.astype(np.float64) + 1) / 2 * levels).astype(np.int32) + 2
        np.testing.assert_array_equal(tts.call(run), want)
    finally:
        tts.close()


def test_codec_qk_norm_uses_its_own_epsilon_on_small_activations():
    """q/k RMSNorm takes ``qk_norm_eps`` (1e-6), not another epsilon: with activations whose
    mean square is near 1e-6 the epsilon decides the attention pattern."""
    from voxtral_mlx.model.codec_layers import CodecAttention, alibi_slopes, attention_bias

    rng = np.random.default_rng(1)
    dim, heads, hd, n, eps = 16, 4, 4, 5, 1e-6
    attn = CodecAttention(dim, heads, heads, hd, qk_norm_eps=eps)
    p = {k: rng.standard_normal((dim, dim)) / 4 for k in ("wq", "wk", "wv", "wo")}
    qn, kn = 4 + rng.standard_normal(dim), 4 + rng.standard_normal(dim)
    attn.update({k: {"weight": mx.array(v.astype(np.float32))} for k, v in p.items()})
    attn.update(
        {
            "q_norm": {"weight": mx.array(qn.astype(np.float32))},
            "k_norm": {"weight": mx.array(kn.astype(np.float32))},
        }
    )
    x = rng.standard_normal((n, dim)) * 2e-3
    mask = attention_bias(mx.array(alibi_slopes(heads)), window=n, n=n, n_valid=0)
    cache = mx.zeros((1, heads, n, hd))
    got, _, _ = attn(mx.array(x[None].astype(np.float32)), cache, cache, mask)

    q, k, v = x @ p["wq"].T, x @ p["wk"].T, x @ p["wv"].T
    q, k = _np_rms(q, qn, eps), _np_rms(k, kn, eps)
    bias = np.asarray(mask)[:, :, n:]
    want = np.zeros((n, dim))
    for h in range(heads):
        sl = slice(h * hd, (h + 1) * hd)
        scores = q[:, sl] @ k[:, sl].T / np.sqrt(hd) + bias[h]
        prob = np.exp(scores - scores.max(-1, keepdims=True))
        want[:, sl] = (prob / prob.sum(-1, keepdims=True)) @ v[:, sl]
    want = want @ p["wo"].T
    np.testing.assert_allclose(np.asarray(got)[0], want, rtol=0, atol=1e-4 * np.abs(want).max())


def test_flow_head_norms_use_the_flow_epsilon_on_small_activations(tiny_tts, tiny_checkpoint):
    """The flow head's RMSNorms take Mistral's flow epsilon (1e-5 when params.json gives
    none), which decides the result for activations whose mean square is near it."""
    ref = SpecReference(tiny_checkpoint)
    eps = ref.flow.get("norm_eps", 1e-5)
    x = np.random.default_rng(2).standard_normal((3, tiny_tts.config.flow.dim)) * 3e-3
    head = tiny_tts.model.acoustic_transformer
    norms = {
        "acoustic_transformer.norm.weight": head.norm,
        "acoustic_transformer.layers.0.attention_norm.weight": head.layers[0].attention_norm,
        "acoustic_transformer.layers.0.ffn_norm.weight": head.layers[0].ffn_norm,
    }
    for name, norm in norms.items():
        got = tiny_tts.call(lambda norm=norm: np.array(norm(mx.array(x.astype(np.float32)))))
        want = rms(torch.as_tensor(x), ref.w[name], eps).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=0, err_msg=name)
