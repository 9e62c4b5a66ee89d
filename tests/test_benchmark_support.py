"""The benchmarks' in-memory END suppression: any random checkpoint (not only those built
with END suppressed) runs the requested number of frames, in both implementations alike."""

from __future__ import annotations

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
