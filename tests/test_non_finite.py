"""NaN or inf produced while generating (damaged weights, float16 overflow) stops the request
with a one-line error instead of speaking noise for up to max_frames, and spares the other
requests of the batch."""

from __future__ import annotations

import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import voxtral_mlx
from voxtral_mlx.engine import DONE
from voxtral_mlx.errors import NonFiniteError

TEXT = "Hello there."
VOICE = "fr_male"


def damaged_copy(src: Path, dst: Path, prefix: str, ndim: int = 2) -> Path:
    """``src`` with one entry of the first ``ndim``-dimensional weight under ``prefix`` NaN."""
    shutil.copytree(src, dst)
    path = dst / "consolidated.safetensors"
    weights = load_file(path)
    name = next(k for k, v in weights.items() if k.startswith(prefix) and v.ndim == ndim)
    weights[name] = weights[name].copy()
    weights[name].reshape(-1)[0] = np.nan
    save_file(weights, path)
    return dst


def collect(job):
    items = []
    while (item := job.output.get()) is not DONE:
        items.append(item)
        if isinstance(item, BaseException):
            break
    return items


@pytest.mark.parametrize(
    ("prefix", "ndim", "where"),
    [
        ("layers.0.attention.wq", 2, "its hidden state or semantic head at frame 1"),
        # Argmax over NaN logits still picks a valid-looking code: it spoke noise.
        (
            "acoustic_transformer.semantic_codebook_output",
            2,
            "its hidden state or semantic head at frame 1",
        ),
        ("acoustic_transformer.layers.0.attention.wq", 2, "its flow-matching head at frame 1"),
        ("audio_tokenizer.decoder_blocks.0.conv", 3, "the codec at frame 1"),
    ],
)
def test_nan_weights_stop_the_request_with_one_line(
    tiny_checkpoint_noend, tmp_path, prefix, ndim, where
):
    model_dir = damaged_copy(tiny_checkpoint_noend, tmp_path / "damaged", prefix, ndim)
    tts = voxtral_mlx.load(model_dir, prefix_cache_dir=None)
    try:
        with pytest.raises(NonFiniteError) as err:
            tts.synthesize(TEXT, voice=VOICE, seed=0, max_frames=200)
        message = str(err.value)
        assert where in message and "re-download or re-convert" in message
        assert "\n" not in message and "float16" not in message
        # The stream stops there: the engine is free and serves the next request the same way.
        with pytest.raises(NonFiniteError):
            list(tts.stream(TEXT, voice=VOICE, seed=1, max_frames=200))
        assert not tts.call(lambda: tts.engine.busy)
    finally:
        tts.close()


def test_float16_names_the_overflow(tiny_checkpoint_noend, tmp_path):
    model_dir = damaged_copy(tiny_checkpoint_noend, tmp_path / "damaged", "layers.1.attention.wo")
    tts = voxtral_mlx.load(model_dir, dtype="float16", prefix_cache_dir=None)
    try:
        with pytest.raises(NonFiniteError, match=r"float16 overflowed \(load it in bfloat16\)"):
            tts.synthesize(TEXT, voice=VOICE, seed=0, max_frames=20)
    finally:
        tts.close()


def test_a_failing_request_spares_the_others_in_its_batch(tiny_checkpoint_noend):
    tts = voxtral_mlx.load(tiny_checkpoint_noend, prefix_cache_dir=None)
    try:
        alone = tts.synthesize(TEXT, voice=VOICE, seed=3, max_frames=12).audio
        good = tts.job(TEXT, voice=VOICE, seed=3, max_frames=12)
        bad = tts.job("Another sentence, longer.", voice=VOICE, seed=4, max_frames=12)
        # Its own voice name keeps the damaged prefix out of the voice's cache entry.
        bad.voice = "damaged"
        bad.voice_rows = mx.array(np.full(bad.voice_rows.shape, np.nan, np.float32))
        tts.submit(bad)
        tts.submit(good)
        bad_items, good_items = collect(bad), collect(good)
        assert len(bad_items) == 1 and isinstance(bad_items[0], NonFiniteError)
        assert "hidden state or semantic head at frame 1" in str(bad_items[0])
        audio = np.concatenate([c.audio for c in good_items])
        assert good_items[-1].is_final and sum(c.frames for c in good_items) == 12
        np.testing.assert_array_equal(audio, alone)
    finally:
        tts.close()


def test_decode_of_a_damaged_codec_is_an_error(tiny_checkpoint_noend, tmp_path, tiny_tts):
    codes = tiny_tts.synthesize(TEXT, voice=VOICE, seed=0, max_frames=6).codes
    model_dir = damaged_copy(
        tiny_checkpoint_noend, tmp_path / "damaged", "audio_tokenizer.decoder_blocks.0.conv", 3
    )
    tts = voxtral_mlx.load(model_dir, prefix_cache_dir=None)
    try:
        with pytest.raises(NonFiniteError, match="in the codec at frame 1:"):
            tts.decode(codes)
    finally:
        tts.close()


def test_the_server_answers_500_naming_the_damage(tiny_checkpoint_noend, tmp_path):
    from starlette.testclient import TestClient

    from voxtral_mlx.server import ServerConfig, create_app

    model_dir = damaged_copy(tiny_checkpoint_noend, tmp_path / "damaged", "layers.0.attention.wq")
    tts = voxtral_mlx.load(model_dir, prefix_cache_dir=None)
    try:
        app = create_app(tts, ServerConfig(max_frames=20))
        with TestClient(app, raise_server_exceptions=False) as tc:
            r = tc.post("/v1/audio/speech", json={"input": TEXT, "response_format": "wav"})
            assert r.status_code == 500
            error = r.json()["error"]
            assert error["type"] == "server_error"
            assert "NaN or infinite values in its hidden state" in error["message"]
    finally:
        tts.close()


def test_model_files_that_are_no_regular_files_are_named(tiny_checkpoint_noend, tmp_path):
    """params.json as a FIFO read as missing; config.json or the index as one was ignored."""
    import os

    from voxtral_mlx.errors import VoxtralError

    if not hasattr(os, "mkfifo"):
        pytest.skip("needs FIFOs")
    from voxtral_mlx.convert import convert_model

    mlx_dir = convert_model(tiny_checkpoint_noend, tmp_path / "mlx").path
    for source, name in [
        (tiny_checkpoint_noend, "params.json"),
        (mlx_dir, "config.json"),
        (mlx_dir, "model.safetensors.index.json"),
    ]:
        model_dir = tmp_path / name
        shutil.copytree(source, model_dir)
        (model_dir / name).unlink(missing_ok=True)
        os.mkfifo(model_dir / name)
        with pytest.raises(VoxtralError) as err:
            voxtral_mlx.load(model_dir, prefix_cache_dir=None)
        assert f"{name}: it is not a regular file" in str(err.value)


def test_a_cache_variable_naming_no_user_is_one_line(tiny_checkpoint_noend, monkeypatch):
    from voxtral_mlx.errors import InputError

    monkeypatch.setenv("VOXTRAL_MLX_CACHE", "~nosuchuser_vx/cache")
    with pytest.raises(InputError, match=r"\$VOXTRAL_MLX_CACHE ~nosuchuser_vx/cache: .* no user"):
        voxtral_mlx.load(tiny_checkpoint_noend, prefix_cache_dir=None)
