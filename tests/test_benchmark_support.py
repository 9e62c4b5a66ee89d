"""The benchmarks' in-memory END suppression: any random checkpoint (not only those built
with END suppressed) runs the requested number of frames, in both implementations alike."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from benchmarks.common import (
    TEXT,
    VOICE,
    load_reference,
    reference_voice,
    suppress_end,
    zero_end_row,
)
from tests.mlx_audio_reference import injected_noise, recorded_frames, spec_codebook_floor
from voxtral_mlx.config import END_AUDIO

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

FRAMES = 12


@pytest.fixture(scope="module")
def early_end_checkpoint(tmp_path_factory):
    """A float32 tiny checkpoint whose END wins at once (seed 3, the benchmarks' text)."""
    from voxtral_mlx.synthetic.checkpoint import build_random_checkpoint

    return build_random_checkpoint(
        tmp_path_factory.mktemp("early-end"), "tiny", seed=3, dtype="float32"
    )


def test_both_implementations_run_every_frame_and_agree(early_end_checkpoint):
    import voxtral_mlx

    noise = np.random.default_rng(0).standard_normal((FRAMES, 36)).astype(np.float32)
    tts = voxtral_mlx.load(early_end_checkpoint, prefix_cache_dir=None)
    try:
        before = tts.synthesize(TEXT, VOICE, noise=noise, max_frames=FRAMES)
        assert len(before.codes) < FRAMES  # the premise: this checkpoint ends early

        ref = load_reference(early_end_checkpoint)
        reference_voice(ref, early_end_checkpoint, VOICE, mx.float32)
        suppress_end(tts, ref)
        ours = tts.synthesize(TEXT, VOICE, noise=noise, max_frames=FRAMES)
    finally:
        tts.close()
    assert len(ours.codes) == FRAMES
    assert not (ours.codes[:, 0] == END_AUDIO).any()

    with recorded_frames(ref) as recorded, injected_noise(noise), spec_codebook_floor():
        list(ref.generate(TEXT, voice=VOICE, max_tokens=FRAMES))
    np.testing.assert_array_equal(ours.codes, np.stack(recorded))


def test_zero_end_row_of_a_quantized_head():
    head = nn.QuantizedLinear(64, 16, bias=False, group_size=64, bits=4)
    x = mx.random.normal((3, 64), key=mx.random.key(0))
    before = head(x)
    assert float(mx.abs(before[:, END_AUDIO]).max()) > 0
    zero_end_row(head)
    after = head(x)
    assert float(mx.abs(after[:, END_AUDIO]).max()) == 0.0
    keep = [i for i in range(16) if i != END_AUDIO]
    np.testing.assert_array_equal(np.array(after[:, keep]), np.array(before[:, keep]))


def test_a_voice_mlx_audio_cannot_use_is_refused_in_one_line(tiny_checkpoint, tmp_path):
    """mlx-audio's tokenizer knows only the voices tekken.json lists; voxtral_mlx takes any
    voice file. The comparison picks a listed voice, or says why there is none."""
    import json
    import shutil

    from benchmarks.common import pick_voice

    model = tmp_path / "m"
    shutil.copytree(tiny_checkpoint, model)
    for f in (model / "voice_embedding").iterdir():
        f.unlink()
    source = tiny_checkpoint / "voice_embedding"
    shutil.copy(source / "fr_male.pt", model / "voice_embedding" / "alpha_voice.pt")
    shutil.copy(source / "fr_male.pt", model / "voice_embedding" / "fr_male.pt")
    assert pick_voice(model) == "fr_male"  # listed, though "alpha_voice" sorts first
    (model / "voice_embedding" / "fr_male.pt").unlink()
    assert pick_voice(model) == "alpha_voice"
    with pytest.raises(SystemExit) as exc:
        reference_voice(None, model, "alpha_voice", mx.float32)
    message = str(exc.value)
    assert "'alpha_voice' is not in tekken.json's voice list" in message and "\n" not in message
    assert (
        "fr_male"
        in json.loads((model / "tekken.json").read_text())["audio"]["voice_num_audio_tokens"]
    )


@pytest.fixture
def scripts(monkeypatch):
    """The scripts import ``common`` from their own folder, as when run."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_frame_speed_refuses_a_dtype_for_a_directory(tiny_checkpoint, scripts):
    from frame_speed import measure

    with pytest.raises(SystemExit, match="--dtype applies to the built-in configs"):
        measure(str(tiny_checkpoint), 1, reference=False, dtype="float32")


def test_weight_bound_refuses_a_quantized_checkpoint(tiny_checkpoint, tmp_path, scripts):
    from weight_bound import main

    from voxtral_mlx.convert import convert_model

    out = convert_model(tiny_checkpoint, tmp_path / "q8", q_bits=8).path
    with pytest.raises(SystemExit, match="is quantized: this compares a frame with dense"):
        main(["--config", str(out), "--repeats", "1", "--no-record"])
