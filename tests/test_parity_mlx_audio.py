"""voxtral_mlx equals an independent implementation (mlx-audio's Voxtral modules) on the same
random weights, in float32: backbone hidden states, flow velocities and codes, codec waveform,
and the whole pipeline frame by frame (same injected noise), including the stopping frame.

The reference is patched to SPEC's ALiBi slopes and codebook floor (see mlx_audio_reference).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch

from tests.mlx_audio_reference import (
    injected_noise,
    load_reference,
    recorded_frames,
    spec_codebook_floor,
)
from voxtral_mlx.model.flow import cfg_weights

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

TEXT = "Hello world. This is a test of the speech model."
VOICE = "ar_male"


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-12))


@pytest.fixture(scope="module")
def ref(tiny_checkpoint):
    from mlx_audio.tts.models.voxtral_tts.text_preprocess import sanitize_tts_input_text_for_demo

    # mlx-audio normalises text before tokenizing; use text it leaves unchanged.
    assert sanitize_tts_input_text_for_demo(TEXT) == TEXT
    model = load_reference(tiny_checkpoint)
    voice = torch.load(tiny_checkpoint / "voice_embedding" / f"{VOICE}.pt", weights_only=True)
    model._voice_embeddings[VOICE] = mx.array(voice.float().numpy())
    return model


def test_prompt_ids_match_reference(tiny_tts, ref):
    assert tiny_tts.prompt_ids(TEXT, VOICE) == ref._encode_text(TEXT, VOICE)


def test_backbone_hidden_states(tiny_tts, ref):
    ids = tiny_tts.prompt_ids(TEXT, VOICE)
    prompt = tiny_tts.prompt_embeddings(TEXT, VOICE)
    ours = tiny_tts.call(lambda: tiny_tts.model(prompt, tiny_tts.model.make_cache()))

    from mlx_audio.lm.models.cache import make_prompt_cache

    ids_mx = mx.array(ids)[None]
    emb = ref._build_input_embeddings(ids_mx, VOICE)
    theirs = ref.language_model.model.model(
        ids_mx, cache=make_prompt_cache(ref.language_model.model), input_embeddings=emb
    )
    a, b = np.array(ours), np.array(theirs)
    assert a.shape == b.shape == (1, len(ids), tiny_tts.config.backbone.dim)
    assert np.all(np.isfinite(a))
    assert rel_err(a, b) < 1e-5, rel_err(a, b)


def test_flow_velocity_and_codes(tiny_tts, ref):
    head = tiny_tts.model.acoustic_transformer
    rng = np.random.default_rng(3)
    dim = tiny_tts.config.backbone.dim
    h = mx.array(rng.standard_normal((1, dim)).astype(np.float32))
    x = mx.array(rng.standard_normal((1, 36)).astype(np.float32))
    n = tiny_tts.config.flow.n_decoding_steps

    def velocity(i: int) -> mx.array:
        llm = head.llm_projection(h)
        return head.velocity(x, i, head.step_tokens(llm, head.first_projections(llm)))

    for i in range(n):
        ours = np.array(tiny_tts.call(lambda i=i: velocity(i)))
        theirs = np.array(
            ref.acoustic_transformer._predict_velocity(
                mx.concatenate([x, x]), mx.full((2,), i / n), mx.concatenate([h, mx.zeros_like(h)])
            )
        )
        assert rel_err(ours, theirs) < 1e-5, (i, rel_err(ours, theirs))

    noise = rng.standard_normal((1, 36)).astype(np.float32)
    for _ in range(5):
        h = mx.array(rng.standard_normal((1, dim)).astype(np.float32) * 4)
        ours = np.array(
            tiny_tts.call(lambda h=h: tiny_tts.model.frame(h, mx.array(noise), cfg_weights([1.2])))[
                1
            ]
        )
        with injected_noise(noise):
            theirs = np.array(ref.acoustic_transformer.decode_one_frame(h))
        np.testing.assert_array_equal(ours, theirs)


def test_codec_waveform(tiny_tts, ref):
    rng = np.random.default_rng(4)
    f = tiny_tts.config.flow
    codes = np.concatenate(
        [
            rng.integers(2, f.semantic_codebook_size + 2, (12, 1)),
            rng.integers(2, f.acoustic_codebook_size + 2, (12, 36)),
        ],
        axis=1,
    ).astype(np.int32)
    codes[::3, 0] = 2 + 16 * rng.integers(0, f.semantic_codebook_size // 16, 4)  # unused clusters
    ours = tiny_tts.decode(codes)
    with spec_codebook_floor():
        theirs = np.array(ref.audio_tokenizer.decode(mx.array(codes)[None]))[0]
    assert ours.shape == theirs.shape == (12 * 1920,)
    assert rel_err(ours, theirs) < 1e-4, rel_err(ours, theirs)


def _long_run_noise(tts, max_frames: int) -> np.ndarray:
    """Noise for which generation runs at least 20 frames and ends by END before max_frames.

    Random weights predict END often; scanning a few deterministic seeds finds a run that
    exercises both a long stretch of frames and the stop.
    """
    for seed in range(200):
        noise = np.random.default_rng(seed).standard_normal((max_frames, 36)).astype(np.float32)
        n = len(tts.synthesize(TEXT, VOICE, noise=noise, max_frames=max_frames).codes)
        if 20 <= n < max_frames:
            return noise
    raise AssertionError("no seed gives a 20+ frame run ending by END")


def test_whole_pipeline_frame_by_frame(tiny_tts, ref):
    max_frames = 80
    noise = _long_run_noise(tiny_tts, max_frames)
    speech = tiny_tts.synthesize(TEXT, VOICE, noise=noise, max_frames=max_frames)

    with recorded_frames(ref) as recorded, injected_noise(noise), spec_codebook_floor():
        results = list(ref.generate(TEXT, voice=VOICE, max_tokens=max_frames))
    ref_audio = np.array(results[-1].audio)

    # The reference decodes a frame, sees END in its semantic code and stops: the last
    # recorded frame is the END frame, which neither implementation turns into audio.
    assert recorded[-1][0] == 1
    ref_frames = np.stack(recorded[:-1])
    assert len(speech.codes) >= 20
    assert len(speech.codes) == len(ref_frames)  # same stopping frame
    np.testing.assert_array_equal(speech.codes, ref_frames)
    assert speech.audio.shape == ref_audio.shape == (len(ref_frames) * 1920,)
    assert rel_err(speech.audio, ref_audio) < 1e-4, rel_err(speech.audio, ref_audio)


def test_other_codebook_sizes_and_euler_steps_frame_by_frame(tmp_path):
    """A checkpoint of other sizes than the release's (3 Euler steps, 200 semantic codes,
    20 acoustic codebooks of 13 levels), as an outside benchmark may build: mlx-audio, given
    the checkpoint's steps and its code table at its own size (see mlx_audio_reference),
    makes the same codes. Unpatched, it runs 7 steps (and cannot load the table)."""
    import voxtral_mlx
    from tests.mlx_audio_reference import load_converted_reference
    from voxtral_mlx.convert import convert_model
    from voxtral_mlx.synthetic.checkpoint import build_random_checkpoint, make_params

    params = make_params("tiny")
    audio = params["multimodal"]["audio_model_args"]
    audio["acoustic_transformer_args"]["n_decoding_steps"] = 3
    audio.update(semantic_codebook_size=200, acoustic_codebook_size=13, n_acoustic_codebook=20)
    audio["audio_encoding_args"]["num_codebooks"] = 21
    codec = params["multimodal"]["audio_tokenizer_args"]
    codec.update(semantic_codebook_size=200, acoustic_codebook_size=13, acoustic_dim=20)
    path = build_random_checkpoint(
        tmp_path / "other", params, seed=5, dtype="float32", voices={VOICE: 9}, suppress_end=True
    )
    frames = 6
    noise = np.random.default_rng(2).standard_normal((frames, 20)).astype(np.float32)
    tts = voxtral_mlx.load(path, prefix_cache_dir=None)
    try:
        assert tts.config.flow.n_decoding_steps == 3
        speech = tts.synthesize(TEXT, VOICE, noise=noise, max_frames=frames)
    finally:
        tts.close()
    voice = torch.load(path / "voice_embedding" / f"{VOICE}.pt", weights_only=True)
    # Mistral's layout, and a conversion that mlx-audio's own loader reads.
    converted = convert_model(path, tmp_path / "converted", dtype="float32").path
    for ref in (load_reference(path), load_converted_reference(converted)):
        assert ref.acoustic_transformer.args.n_denoising_steps == 4
        ref._voice_embeddings[VOICE] = mx.array(voice.float().numpy())
        with recorded_frames(ref) as recorded, injected_noise(noise), spec_codebook_floor():
            list(ref.generate(TEXT, voice=VOICE, max_tokens=frames))
        assert len(speech.codes) == frames
        np.testing.assert_array_equal(speech.codes, np.stack(recorded[:frames]))
    with pytest.raises(ValueError):  # what the benchmarks reported as "cannot load"
        load_reference(path, patch=False)
    with pytest.raises(ValueError):
        load_converted_reference(converted, patch=False)
