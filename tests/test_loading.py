"""voxtral_mlx.load on checkpoints in Mistral's published layout: dtypes, voices, prompts,
odd sizes, broken directories, hostile voices, no writes, and deterministic generation."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import stat
import subprocess
import sys
import threading
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mistral_common.protocol.speech.request import SpeechRequest
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
from mlx.utils import tree_flatten

import voxtral_mlx
from voxtral_mlx.checkpoint import CheckpointMismatch
from voxtral_mlx.errors import (
    CheckpointError,
    ConfigError,
    InputError,
    ModelNotFoundError,
    TokenizerError,
    UnsafePickleError,
    VoiceError,
    VoxtralError,
)
from voxtral_mlx.generate import NOISE_BLOCK, NoiseSource
from voxtral_mlx.synthetic.checkpoint import REAL_VOICES, build_random_checkpoint, make_params
from voxtral_mlx.synthetic.tekken import mistral_common_tekken_path

SMALL_VOICES = {"casual_male": 5, "fr_male": 3}
BACKBONE_LAYER = [
    "attention.wq.weight",
    "attention.wk.weight",
    "attention.wv.weight",
    "attention.wo.weight",
    "attention_norm.weight",
    "ffn_norm.weight",
    "feed_forward.w1.weight",
    "feed_forward.w2.weight",
    "feed_forward.w3.weight",
]


def one_line(e: BaseException) -> str:
    assert isinstance(e, VoxtralError), type(e)
    text = str(e)
    assert text and "\n" not in text and "\r" not in text, repr(text)
    return text


def small_params(**overrides: Any) -> dict[str, Any]:
    """Tiny params with a small vocabulary: a checkpoint of ~1 MB, built in ~0.1 s."""
    return make_params("tiny", vocab_size=2048, **overrides)


def build_small(path: Path, params: dict[str, Any] | None = None, **kwargs: Any) -> Path:
    kwargs = {"seed": 0, "dtype": "float32", "vocab_source": None, "voices": SMALL_VOICES, **kwargs}
    return build_random_checkpoint(path, small_params() if params is None else params, **kwargs)


def param_dtypes(tts: voxtral_mlx.VoxtralTTS) -> set[mx.Dtype]:
    return {v.dtype for _, v in tree_flatten(tts.model.parameters())}


def check_speech(tts: voxtral_mlx.VoxtralTTS, frames: int = 3, **kwargs: Any) -> Any:
    speech = tts.synthesize("Hi.", max_frames=frames, seed=0, **kwargs)
    n = len(speech.codes)
    assert 1 <= n <= frames
    assert speech.codes.shape == (n, 37) and speech.codes.dtype == np.int32
    assert speech.audio.dtype == np.float32
    assert speech.audio.shape == (n * tts.samples_per_frame,)
    assert np.isfinite(speech.audio).all()
    assert speech.sample_rate == 24000
    return speech


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory) -> Path:
    return build_small(tmp_path_factory.mktemp("small") / "model")


@pytest.fixture(scope="module")
def small_bf16_checkpoint(tmp_path_factory) -> Path:
    return build_small(tmp_path_factory.mktemp("small-bf16") / "model", dtype="bfloat16")


@pytest.fixture
def small_copy(small_checkpoint: Path, tmp_path: Path) -> Path:
    """A private copy of the small checkpoint that a test may break."""
    return Path(shutil.copytree(small_checkpoint, tmp_path / "model"))


@pytest.fixture(scope="module")
def tiny_bf16_tts(tiny_checkpoint_bf16: Path) -> voxtral_mlx.VoxtralTTS:
    return voxtral_mlx.load(tiny_checkpoint_bf16)


# --------------------------------------------------------------------------- dtypes


def test_float32_checkpoint_loads_in_float32(tiny_tts, tiny_checkpoint: Path) -> None:
    assert tiny_tts.dtype == mx.float32
    assert param_dtypes(tiny_tts) == {mx.float32}
    assert tiny_tts.path == tiny_checkpoint.resolve()
    assert tiny_tts.sample_rate == 24000 and tiny_tts.samples_per_frame == 1920
    check_speech(tiny_tts)


def test_bf16_checkpoint_computes_in_bf16(tiny_bf16_tts) -> None:
    assert tiny_bf16_tts.dtype == mx.bfloat16
    assert param_dtypes(tiny_bf16_tts) == {mx.bfloat16}
    assert tiny_bf16_tts.voices.embedding("casual_male", tiny_bf16_tts.dtype).dtype == mx.bfloat16
    check_speech(tiny_bf16_tts)


def test_float32_override_on_the_bf16_checkpoint(tiny_checkpoint_bf16: Path) -> None:
    tts = voxtral_mlx.load(tiny_checkpoint_bf16, dtype="float32")
    assert tts.dtype == mx.float32 and param_dtypes(tts) == {mx.float32}
    check_speech(tts, frames=2)


def test_bf16_override_on_the_float32_checkpoint(tiny_checkpoint: Path) -> None:
    tts = voxtral_mlx.load(tiny_checkpoint, dtype="bfloat16")
    assert tts.dtype == mx.bfloat16 and param_dtypes(tts) == {mx.bfloat16}
    check_speech(tts, frames=2)


@pytest.mark.parametrize("dtype", ["float32", "fp32", "FLOAT32", mx.float32])
def test_float32_spellings(small_bf16_checkpoint: Path, dtype) -> None:
    tts = voxtral_mlx.load(small_bf16_checkpoint, dtype=dtype)
    assert tts.dtype == mx.float32 and param_dtypes(tts) == {mx.float32}


@pytest.mark.parametrize("dtype", ["bfloat16", "bf16", "BFloat16", mx.bfloat16])
def test_bf16_spellings(small_checkpoint: Path, dtype) -> None:
    tts = voxtral_mlx.load(small_checkpoint, dtype=dtype)
    assert tts.dtype == mx.bfloat16 and param_dtypes(tts) == {mx.bfloat16}


def test_small_bf16_checkpoint_defaults_to_bf16(small_bf16_checkpoint: Path) -> None:
    assert voxtral_mlx.load(small_bf16_checkpoint).dtype == mx.bfloat16


def test_float16_override(small_checkpoint: Path) -> None:
    tts = voxtral_mlx.load(small_checkpoint, dtype="float16")
    assert tts.dtype == mx.float16 and param_dtypes(tts) == {mx.float16}


def test_float16_checkpoint_computes_in_float16(tmp_path: Path) -> None:
    tts = voxtral_mlx.load(build_small(tmp_path / "m", dtype="float16"))
    assert tts.dtype == mx.float16 and param_dtypes(tts) == {mx.float16}


@pytest.mark.parametrize("dtype", ["int8", "float64", "q4", "", mx.int8, mx.float64, mx.uint32])
def test_unsupported_dtype_is_an_input_error(small_checkpoint: Path, dtype: str) -> None:
    """A bad argument (InputError), not a bad params.json (ConfigError)."""
    with pytest.raises(InputError) as exc:
        voxtral_mlx.load(small_checkpoint, dtype=dtype)
    assert "bfloat16" in one_line(exc.value)


def test_float64_checkpoint_loads_as_float32(small_checkpoint: Path, tmp_path: Path) -> None:
    """F64 is a valid safetensors dtype that mx.load refuses: such files are read through
    numpy and computed in float32, giving exactly what the float32 checkpoint gives."""
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    model = Path(shutil.copytree(small_checkpoint, tmp_path / "model"))
    weights = model / "consolidated.safetensors"
    tensors = safetensors_numpy.load_file(str(weights))
    some = sorted(tensors)[::3]  # a mixed file: F64 beside F32
    safetensors_numpy.save_file(
        {k: v.astype(np.float64) if k in some else v for k, v in tensors.items()}, str(weights)
    )
    tts = voxtral_mlx.load(model)
    assert tts.dtype == mx.float32 and param_dtypes(tts) == {mx.float32}
    ref = voxtral_mlx.load(small_checkpoint)
    ours = dict(tree_flatten(tts.call(tts.model.parameters)))
    theirs = dict(tree_flatten(ref.call(ref.model.parameters)))
    assert ours.keys() == theirs.keys()
    assert all(mx.array_equal(ours[k], theirs[k]).item() for k in ours)
    assert np.array_equal(check_speech(tts).codes, check_speech(ref).codes)


def test_float32_override_equals_the_bf16_weights_upcast(small_bf16_checkpoint: Path) -> None:
    """Upcasting changes the arithmetic, never the weights: every parameter is the bf16 value."""
    tts = voxtral_mlx.load(small_bf16_checkpoint, dtype="float32")
    ours = dict(tree_flatten(tts.call(tts.model.parameters)))
    bf16 = voxtral_mlx.load(small_bf16_checkpoint)
    ref = dict(tree_flatten(bf16.call(bf16.model.parameters)))
    assert ours.keys() == ref.keys()
    for name in ours:
        if ".conv." in name or "semantic_codebook" in name:
            continue  # folded in float32 from bf16 inputs, then rounded (or not) once
        assert mx.array_equal(ours[name], ref[name].astype(mx.float32)).item(), name


# --------------------------------------------------------------------- voices, tokenizer, prompt


def test_the_twenty_voices(tiny_tts) -> None:
    assert sorted(tiny_tts.voices) == sorted(REAL_VOICES)
    assert len(tiny_tts.voices) == 20
    for name, rows in REAL_VOICES.items():
        voice = tiny_tts.voices[name]
        assert voice.num_tokens == rows and voice.path.suffix == ".pt"
    assert tiny_tts.voices["fr_female"].language == "fr"
    assert tiny_tts.voices["casual_male"].language == "en"
    assert tiny_tts.default_voice == "casual_male"
    assert tiny_tts.tokenizer.voice_num_audio_tokens == REAL_VOICES


def test_a_missing_or_broken_default_voice_is_an_error_not_another_voice(
    tiny_checkpoint, tmp_path
) -> None:
    """Without casual_male (deleted, or a Hub cache's link to a deleted blob) a request
    naming no voice fails saying so; it used to be spoken by the first voice by name
    (ar_male), silently. Named voices still speak."""
    import os
    import shutil

    from voxtral_mlx.errors import VoiceError

    model = tmp_path / "model"
    shutil.copytree(tiny_checkpoint, model)
    default = model / "voice_embedding" / "casual_male.pt"
    default.unlink()
    tts = voxtral_mlx.load(model, prefix_cache_dir=None)
    try:
        # The tokenizer lists it: its file is what is missing.
        with pytest.raises(VoiceError, match=r"the default one \(tekken.json lists it, but its"):
            tts.default_voice  # noqa: B018
        for call in (lambda: tts.synthesize("Hi.", max_frames=1), tts.warmup):
            with pytest.raises(VoiceError, match="name a voice"):
                call()
        assert tts.synthesize("Hi.", "ar_male", max_frames=1).voice == "ar_male"
    finally:
        tts.close()
    os.symlink(tmp_path / "deleted-blob", default)
    tts = voxtral_mlx.load(model, prefix_cache_dir=None)
    try:
        assert tts.default_voice == "casual_male"
        with pytest.raises(VoiceError, match=r"symbolic link.*restore it from the checkpoint"):
            tts.synthesize("Hi.", max_frames=1)
    finally:
        tts.close()


def test_the_default_voice_is_found_but_for_case_as_a_named_one(tiny_checkpoint, tmp_path):
    """A casual_male file renamed Casual_Male was found by -v casual_male but not as the
    default: "has no voice 'casual_male' (its file is missing)", listing Casual_Male."""
    import shutil

    from voxtral_mlx.errors import VoiceError

    model = tmp_path / "model"
    shutil.copytree(tiny_checkpoint, model)
    vdir = model / "voice_embedding"
    (vdir / "casual_male.pt").rename(vdir / "Casual_Male.pt")
    tts = voxtral_mlx.load(model, prefix_cache_dir=None)
    try:
        assert tts.default_voice == "Casual_Male" and tts.voices.missing == []
        a = tts.synthesize("Hi.", seed=1, max_frames=2)
        b = tts.synthesize("Hi.", "casual_male", seed=1, max_frames=2)
        assert a.voice == b.voice == "Casual_Male"
        np.testing.assert_array_equal(a.codes, b.codes)
    finally:
        tts.close()
    shutil.copy(vdir / "Casual_Male.pt", vdir / "CASUAL_MALE.pt")
    tts = voxtral_mlx.load(model, prefix_cache_dir=None)
    try:
        with pytest.raises(VoiceError, match="'casual_male' is ambiguous"):
            tts.synthesize("Hi.", max_frames=1)
    finally:
        tts.close()


def test_voice_embeddings_have_the_tekken_row_counts(tiny_tts) -> None:
    for name in ("ar_male", "neutral_female"):
        assert tiny_tts.voices.embedding(name).shape == (REAL_VOICES[name], 64)


def test_tokenizer_encode(tiny_tts) -> None:
    ids = tiny_tts.tokenizer.encode("Hello.")
    assert ids and all(i >= 1000 for i in ids)  # text ids come after the 1000 specials
    assert tiny_tts.tokenizer.decode(ids) == "Hello."
    if mistral_common_tekken_path() is not None:  # the real BPE vocabulary
        assert ids == [22177, 1046]


@pytest.fixture(scope="module")
def speech_reference(tiny_checkpoint):
    """mistral-common's instruct tokenizer on the checkpoint's tekken.json (its real BPE
    vocabulary and voices)."""
    return MistralTokenizer.from_file(str(tiny_checkpoint / "tekken.json")).instruct_tokenizer


@pytest.mark.parametrize("voice", sorted(REAL_VOICES))
def test_prompt_ids_layout(tiny_tts, speech_reference, voice: str) -> None:
    """mistral-common's encode_speech_request, in SPEC §2's layout: [BOS, BEGIN_AUDIO],
    one [AUDIO] per voice row, [NEXT_AUDIO_TEXT], text, [REPEAT_AUDIO_TEXT, BEGIN_AUDIO]."""
    text = "Bonjour, ça va? 123"
    ids = tiny_tts.prompt_ids(text, voice)
    request = SpeechRequest(input=text, voice=voice)
    assert ids == speech_reference.encode_speech_request(request).tokens
    n = REAL_VOICES[voice]
    assert ids[: n + 3] == [1, 25] + [24] * n + [36]
    assert ids[-2:] == [35, 25] and len(ids) > n + 5


def test_prompt_ids_of_the_spec_example(tiny_tts) -> None:
    if mistral_common_tekken_path() is None:
        pytest.skip("needs mistral-common's tekken vocabulary")
    ids = tiny_tts.prompt_ids("Hello.", "ar_male")
    assert ids == [1, 25] + [24] * 67 + [36, 22177, 1046, 35, 25]
    assert len(ids) == 74


def test_prompt_ids_default_voice(tiny_tts) -> None:
    assert tiny_tts.prompt_ids("Hi.") == tiny_tts.prompt_ids("Hi.", "casual_male")


def test_unknown_voice(tiny_tts) -> None:
    with pytest.raises(VoiceError) as exc:
        tiny_tts.synthesize("Hi.", voice="klingon_male", max_frames=1)
    assert "casual_male" in one_line(exc.value)


# --------------------------------------------------------------------------- odd sizes


def _hand(edit: Callable[[dict[str, Any]], None], **overrides: Any) -> dict[str, Any]:
    params = small_params(**overrides)
    edit(params)
    return params


def _at(p: dict[str, Any]) -> dict[str, Any]:
    return p["multimodal"]["audio_model_args"]["acoustic_transformer_args"]


def _codec(p: dict[str, Any]) -> dict[str, Any]:
    return p["multimodal"]["audio_tokenizer_args"]


ODD_CONFIGS: dict[str, Callable[[], dict[str, Any]]] = {
    "3-layers-1-flow-layer-128-codes": lambda: small_params(
        n_layers=3, flow_layers=1, semantic_codebook_size=128
    ),
    "1-layer-3-flow-layers": lambda: small_params(n_layers=1, flow_layers=3),
    "backbone-8q-1kv-heads": lambda: _hand(lambda p: p.update(n_heads=8, n_kv_heads=1, head_dim=8)),
    "flow-2q-1kv-heads-wide-head": lambda: _hand(
        lambda p: _at(p).update(n_heads=2, n_kv_heads=1, head_dim=24, hidden_dim=96)
    ),
    "codec-lengths-1,3,1,2": lambda: _hand(
        lambda p: _codec(p).update(decoder_transformer_lengths_str="1,3,1,2")
    ),
    "codec-6-heads-gqa": lambda: _hand(
        lambda p: _codec(p).update(dim=48, n_heads=6, n_kv_heads=3, head_dim=8)
    ),
    "codec-3-stages": lambda: _hand(
        lambda p: _codec(p).update(
            decoder_transformer_lengths_str="2,1,2",
            decoder_convs_kernels_str="3,4,8",
            decoder_convs_strides_str="1,2,4",
            attn_sliding_window_size=8,
        )
    ),
    "patch-120-at-25-fps": lambda: _hand(
        lambda p: (
            _codec(p).update(pretransform_patch_size=120, patch_proj_kernel_size=5),
            p["multimodal"]["audio_model_args"]["audio_encoding_args"].update(frame_rate=25.0),
        )
    ),
    "3-euler-steps": lambda: _hand(lambda p: _at(p).update(n_decoding_steps=3)),
    # Head counts that do not divide dim (wq/wo carry n_heads * head_dim channels).
    "backbone-5q-1kv-heads-on-64": lambda: _hand(
        lambda p: p.update(n_heads=5, n_kv_heads=1, head_dim=10)
    ),
    "flow-3q-3kv-heads-on-64": lambda: _hand(
        lambda p: _at(p).update(n_heads=3, n_kv_heads=3, head_dim=6)
    ),
    "codec-3-heads-on-64": lambda: _hand(
        lambda p: _codec(p).update(n_heads=3, n_kv_heads=1, head_dim=12)
    ),
}


@pytest.mark.parametrize("name", list(ODD_CONFIGS))
def test_odd_sized_configs_load_and_speak(name: str, tmp_path: Path) -> None:
    params = ODD_CONFIGS[name]()
    build_small(tmp_path / "m", params)
    tts = voxtral_mlx.load(tmp_path / "m")
    assert tts.config.backbone.n_layers == params["n_layers"]
    assert tts.config.codec.transformer_lengths == tuple(
        int(x) for x in _codec(params)["decoder_transformer_lengths_str"].split(",")
    )
    speech = check_speech(tts)
    assert len(speech.codes) == 3  # these seeds do not end early; a change would be visible
    expected_spf = _codec(params)["pretransform_patch_size"] * tts.config.codec.upsample
    assert tts.samples_per_frame == expected_spf
    sem = tts.config.flow.semantic_codebook_size
    assert (speech.codes[:, 0] >= 2).all() and (speech.codes[:, 0] < sem + 2).all()
    assert (speech.codes[:, 1:] >= 2).all() and (speech.codes[:, 1:] <= 22).all()


# --------------------------------------------------------------------------- broken directories


def edit_params(model: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    params = json.loads((model / "params.json").read_text())
    edit(params)
    (model / "params.json").write_text(json.dumps(params))


def test_params_with_more_layers_than_the_weights(small_copy: Path) -> None:
    edit_params(small_copy, lambda p: p.update(n_layers=3))
    with pytest.raises(CheckpointMismatch) as exc:
        voxtral_mlx.load(small_copy)
    e = exc.value
    assert e.missing == sorted(f"layers.2.{n}" for n in BACKBONE_LAYER)
    assert e.unexpected == [] and e.misshaped == []
    message = one_line(e)
    assert "9 missing" in message and "layers.2.attention.wk.weight" in message
    assert "consolidated.safetensors" in message


def test_params_with_fewer_layers_than_the_weights(small_copy: Path) -> None:
    edit_params(small_copy, lambda p: p.update(n_layers=1))
    with pytest.raises(CheckpointMismatch) as exc:
        voxtral_mlx.load(small_copy)
    assert exc.value.unexpected == sorted(f"layers.1.{n}" for n in BACKBONE_LAYER)
    assert exc.value.missing == []


def test_params_with_other_codec_lengths(small_copy: Path) -> None:
    edit_params(small_copy, lambda p: _codec(p).update(decoder_transformer_lengths_str="2,2,2,3"))
    with pytest.raises(CheckpointMismatch) as exc:
        voxtral_mlx.load(small_copy)
    assert exc.value.missing
    assert all(
        n.startswith("audio_tokenizer.decoder_blocks.7.layers.2.") for n in exc.value.missing
    )


def test_params_with_other_widths(small_copy: Path) -> None:
    edit_params(small_copy, lambda p: p.update(hidden_dim=192))
    with pytest.raises(CheckpointMismatch) as exc:
        voxtral_mlx.load(small_copy)
    names = {m[0] for m in exc.value.misshaped}
    assert names == {f"layers.{i}.feed_forward.w{j}.weight" for i in range(2) for j in (1, 2, 3)}


def test_tied_output_head_in_the_weights_is_ignored(small_copy: Path) -> None:
    """Some exports carry the (tied, unused) LM head as output.weight: it must not matter."""
    weights = small_copy / "consolidated.safetensors"
    tensors = dict(mx.load(str(weights)))
    tensors["output.weight"] = mx.zeros((2048, 64))
    mx.save_safetensors(str(weights), tensors)
    check_speech(voxtral_mlx.load(small_copy))


def test_truncated_weights(small_copy: Path) -> None:
    weights = small_copy / "consolidated.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as exc:
        voxtral_mlx.load(small_copy)
    message = one_line(exc.value).replace(str(weights), "<weights>")
    assert "<weights>" in message and "truncated" in message and "re-download" in message


def test_garbage_weights(small_copy: Path) -> None:
    (small_copy / "consolidated.safetensors").write_bytes(b"<html>404 not found</html>" * 10)
    with pytest.raises(CheckpointError) as exc:
        voxtral_mlx.load(small_copy)
    assert "consolidated.safetensors" in one_line(exc.value)


@pytest.mark.parametrize(
    ("missing", "error"),
    [
        ("params.json", ModelNotFoundError),
        ("tekken.json", TokenizerError),
        ("consolidated.safetensors", ModelNotFoundError),
    ],
)
def test_missing_file_is_named(small_copy: Path, missing: str, error: type) -> None:
    (small_copy / missing).unlink()
    with pytest.raises(error) as exc:
        voxtral_mlx.load(small_copy)
    assert missing in one_line(exc.value)


@pytest.mark.parametrize("tokenizer_fault", ["missing", "special ids"])
def test_a_tokenizer_fault_is_named_before_a_weights_fault(
    small_copy: Path, tokenizer_fault: str
) -> None:
    """The tokenizer is built beside the weights' loading; when both are broken, the
    tokenizer's error still comes first, as when it was built first."""
    if tokenizer_fault == "missing":
        (small_copy / "tekken.json").unlink()
        expected: type = TokenizerError
    else:
        edit_params(small_copy, lambda p: p["multimodal"].update(bos_token_id=2))
        expected = ConfigError
    (small_copy / "consolidated.safetensors").write_bytes(b"<html>404 not found</html>" * 10)
    with pytest.raises(expected) as exc:
        voxtral_mlx.load(small_copy)
    assert "consolidated" not in one_line(exc.value)


def test_the_tokenizer_is_built_while_the_weights_load(
    small_copy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """About 0.4 s of a load (Tekken's 270,000 merges) overlaps the weights' loading."""
    from voxtral_mlx import loader
    from voxtral_mlx.tokenizer import TekkenTokenizer

    opened = threading.Event()
    seen: dict[str, Any] = {}
    open_weights, from_file = loader.open_weights, TekkenTokenizer.from_file

    def spy_open(*args: Any) -> Any:
        opened.set()
        return open_weights(*args)

    def spy_tokenizer(path: Path, *args: Any, **kwargs: Any) -> TekkenTokenizer:
        seen["thread"] = threading.current_thread().name
        seen["weights opened meanwhile"] = opened.wait(10)  # would wait in vain if serial
        return from_file(path, *args, **kwargs)

    monkeypatch.setattr(loader, "open_weights", spy_open)
    monkeypatch.setattr(TekkenTokenizer, "from_file", spy_tokenizer)
    tts = voxtral_mlx.load(small_copy)
    try:
        assert seen == {"thread": "voxtral-mlx-tokenizer", "weights opened meanwhile": True}
        assert tts.prompt_ids("Hi.", sorted(tts.voices)[0])[0] == 1
    finally:
        tts.close()


def test_empty_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError) as exc:
        voxtral_mlx.load(tmp_path)
    assert "params.json" in one_line(exc.value)


def test_broken_params_json(small_copy: Path) -> None:
    (small_copy / "params.json").write_text('{"dim": 64,')
    with pytest.raises(ConfigError) as exc:
        voxtral_mlx.load(small_copy)
    assert "line 1" in one_line(exc.value)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("audio_token_id", 23),
        ("begin_audio_token_id", 26),
        ("bos_token_id", 2),
    ],
)
def test_tekken_special_ids_must_agree_with_params(small_copy: Path, key: str, value: int) -> None:
    def edit(p: dict[str, Any]) -> None:
        section = p["multimodal"] if key == "bos_token_id" else p["multimodal"]["audio_model_args"]
        section[key] = value

    edit_params(small_copy, edit)
    with pytest.raises(ConfigError) as exc:
        voxtral_mlx.load(small_copy)
    message = one_line(exc.value)
    assert key in message and "tekken.json" in message
    assert message.endswith("use the tekken.json and params.json of one download")


def test_vocab_larger_than_the_embeddings(small_copy: Path) -> None:
    edit_params(small_copy, lambda p: p.update(vocab_size=1024))  # tekken has 1256 ids
    with pytest.raises(ConfigError) as exc:
        voxtral_mlx.load(small_copy)
    assert "vocab_size" in one_line(exc.value)
    assert one_line(exc.value).endswith("use the tekken.json and params.json of one download")


def test_no_voice_directory(small_copy: Path) -> None:
    shutil.rmtree(small_copy / "voice_embedding")
    tts = voxtral_mlx.load(small_copy)
    assert len(tts.voices) == 0
    with pytest.raises(VoxtralError) as exc:
        tts.synthesize("Hi.", max_frames=1)
    assert "voice" in one_line(exc.value)


def test_mlx_converted_layout_is_not_called_an_incomplete_download(tmp_path: Path) -> None:
    model = build_small(tmp_path / "m", voice_format="safetensors")
    (model / "consolidated.safetensors").rename(model / "model.safetensors")
    (model / "config.json").write_text(json.dumps({"model_type": "voxtral_tts"}))
    try:
        voxtral_mlx.load(model)
    except VoxtralError as e:
        message = one_line(e)
        assert "incomplete" not in message and "fetch it again" not in message


@pytest.mark.parametrize("name", ["weights.npz", "model.gguf"])
def test_weights_in_a_format_not_read_are_named_not_an_incomplete_download(
    tmp_path: Path, name: str
) -> None:
    """mlx-audio reads .npz weights; llama.cpp writes .gguf: neither is a broken download."""
    model = build_small(tmp_path / "m", voice_format="safetensors")
    (model / "consolidated.safetensors").rename(model / name)
    (model / "config.json").write_text(json.dumps({"model_type": "voxtral_tts"}))
    with pytest.raises(CheckpointError) as exc:
        voxtral_mlx.load(model, prefix_cache_dir=None)
    message = one_line(exc.value)
    assert f"holds weights only as {name}, a format voxtral_mlx does not read" in message
    assert "fetch it again" not in message and ".safetensors" in message


# --------------------------------------------------------------------------- voice file formats


@pytest.fixture(scope="module")
def tiny_safetensors_voices(tmp_path_factory) -> Path:
    """The session's float32 tiny checkpoint (same seed) with converted .safetensors voices."""
    return build_random_checkpoint(
        tmp_path_factory.mktemp("tiny-st"),
        "tiny",
        seed=0,
        dtype="float32",
        voice_format="safetensors",
    )


def test_pt_and_safetensors_voices_speak_identically(tiny_tts, tiny_safetensors_voices) -> None:
    assert not list(tiny_safetensors_voices.glob("voice_embedding/*.pt"))
    tts = voxtral_mlx.load(tiny_safetensors_voices)
    assert sorted(tts.voices) == sorted(tiny_tts.voices)
    assert {v.path.suffix for v in tts.voices.values()} == {".safetensors"}
    for voice in ("casual_male", "hi_female"):
        a = tts.voices.embedding(voice)
        b = tiny_tts.voices.embedding(voice)
        assert a.dtype == b.dtype == mx.float32
        assert mx.array_equal(a, b).item()
        ours = tts.synthesize("Hi there.", voice=voice, max_frames=3, seed=7)
        ref = tiny_tts.synthesize("Hi there.", voice=voice, max_frames=3, seed=7)
        np.testing.assert_array_equal(ours.codes, ref.codes)
        np.testing.assert_array_equal(ours.audio, ref.audio)


def test_bf16_safetensors_voices(tmp_path: Path) -> None:
    model = build_small(tmp_path / "m", dtype="bfloat16", voice_format="safetensors")
    tts = voxtral_mlx.load(model)
    assert tts.voices.embedding("fr_male").dtype == mx.bfloat16
    check_speech(tts, voice="fr_male")


class _Reduce:
    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def hostile_pt(path: Path, marker: Path) -> Path:
    """A torch-style zip archive whose data.pkl runs os.system when unpickled."""
    payload = pickle.dumps(_Reduce(os.system, f"touch {marker}"), protocol=2)
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("archive/data.pkl", payload)
        zf.writestr("archive/byteorder", b"little")
        zf.writestr("archive/data/0", np.zeros(5 * 64, np.float32).tobytes())
        zf.writestr("archive/version", b"3\n")
    return path


def test_hostile_payload_is_live(tmp_path: Path) -> None:
    """Control: plain pickle does run the payload (in a child process)."""
    marker = tmp_path / "CONTROL"
    path = hostile_pt(tmp_path / "evil.pt", marker)
    with zipfile.ZipFile(path) as zf:
        payload = zf.read("archive/data.pkl")
    subprocess.run([sys.executable, "-c", f"import pickle; pickle.loads({payload!r})"], check=True)
    assert marker.exists()


def test_hostile_pt_voice_is_refused_unexecuted(small_copy: Path, tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    hostile_pt(small_copy / "voice_embedding" / "casual_male.pt", marker)
    tts = voxtral_mlx.load(small_copy)  # voices are read on first use, not at load
    assert "casual_male" in tts.voices
    for attempt in (
        lambda: tts.synthesize("Hi.", voice="casual_male", max_frames=1, seed=0),
        lambda: list(tts.stream("Hi.", voice="casual_male", max_frames=1, seed=0)),
        lambda: tts.voices.embedding("casual_male"),
    ):
        with pytest.raises(UnsafePickleError) as exc:
            attempt()
        message = one_line(exc.value)
        assert "casual_male.pt" in message and "system" in message
    assert not marker.exists()
    check_speech(tts, voice="fr_male")  # the other voices still work
    assert not marker.exists()


# --------------------------------------------------------------------------- no writes


def tree_state(root: Path) -> dict[str, tuple]:
    """Every entry under root with its type, size, mode and mtime."""
    state = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = path.lstat()
            state[str(path.relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns)
    st = root.lstat()
    state["."] = (st.st_mode, st.st_mtime_ns)
    return state


def use_everything(tts: voxtral_mlx.VoxtralTTS) -> None:
    for voice in tts.voices:
        tts.voices.embedding(voice)
    check_speech(tts, frames=2)
    list(tts.stream("Hi.", max_frames=2, seed=1))
    tts.decode(tts.synthesize("Hi.", max_frames=1, seed=2).codes)


def test_load_and_synthesis_never_write_into_the_model(small_copy: Path) -> None:
    before = tree_state(small_copy)
    use_everything(voxtral_mlx.load(small_copy))
    use_everything(voxtral_mlx.load(small_copy, dtype="bfloat16"))
    assert tree_state(small_copy) == before


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX permissions")
def test_read_only_model_directory(small_copy: Path, tmp_path: Path) -> None:
    """A model directory nobody may write (a shared or system-wide install) loads and
    speaks. Run in a process without root's permission bypass, so that a write would fail."""

    def chmod_tree(mode_dir: int, mode_file: int) -> None:
        for dirpath, _dirs, files in os.walk(small_copy, topdown=False):
            for f in files:
                os.chmod(Path(dirpath) / f, mode_file)
            os.chmod(dirpath, mode_dir)

    code = (
        "import sys, voxtral_mlx\n"
        "tts = voxtral_mlx.load(sys.argv[1])\n"
        "for v in tts.voices: tts.voices.embedding(v)\n"
        "s = tts.synthesize('Hi.', max_frames=2, seed=1)\n"
        "list(tts.stream('Hi.', max_frames=2, seed=1))\n"
        "tts.decode(s.codes)\n"
        "print('spoke', len(s.audio))\n"
    )
    cmd = [sys.executable, "-c", code, str(small_copy)]
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("as root, permissions apply only through setpriv (util-linux)")
        cmd = [setpriv, "--bounding-set=-dac_override,-dac_read_search", *cmd]
    r_x = stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH
    chmod_tree(r_x, stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
    try:
        before = tree_state(small_copy)
        env = dict(os.environ, VOXTRAL_MLX_CACHE=str(tmp_path / "cache"))
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.startswith("spoke ") and int(proc.stdout.split()[1]) > 0
        assert tree_state(small_copy) == before
        if os.geteuid() == 0:  # the bypass is really gone: a write is refused
            probe = [*cmd[:2], sys.executable, "-c", f"open({str(small_copy / 'x')!r}, 'w')"]
            assert subprocess.run(probe, capture_output=True).returncode != 0
    finally:
        chmod_tree(0o755, 0o644)


# --------------------------------------------------------------------------- determinism


def test_same_seed_same_codes_and_audio(tiny_tts) -> None:
    a = tiny_tts.synthesize("Hi.", max_frames=4, seed=0)
    b = tiny_tts.synthesize("Hi.", max_frames=4, seed=0)
    np.testing.assert_array_equal(a.codes, b.codes)
    np.testing.assert_array_equal(a.audio, b.audio)
    assert a.seed == 0


def test_generation_does_not_depend_on_global_random_state(tiny_tts) -> None:
    a = tiny_tts.synthesize("Hi.", max_frames=3, seed=5)
    mx.random.seed(1234)
    np.random.seed(1234)
    mx.random.normal((10,))
    b = tiny_tts.synthesize("Hi.", max_frames=3, seed=5)
    np.testing.assert_array_equal(a.codes, b.codes)


def test_different_seeds_different_codes(tiny_tts) -> None:
    runs = [tiny_tts.synthesize("Hi.", max_frames=3, seed=s).codes for s in range(4)]
    for i in range(len(runs)):
        for j in range(i + 1, len(runs)):
            assert not np.array_equal(runs[i], runs[j]), (i, j)
    # frame 0's semantic code is greedy on the prompt alone: the seeds only move acoustics
    assert len({int(r[0, 0]) for r in runs}) == 1
    assert len({tuple(r[0, 1:]) for r in runs}) == 4


def test_unseeded_runs_report_their_seed_and_replay(tiny_tts) -> None:
    a = tiny_tts.synthesize("Hi.", max_frames=2)
    assert isinstance(a.seed, int)
    b = tiny_tts.synthesize("Hi.", max_frames=2, seed=a.seed)
    np.testing.assert_array_equal(a.codes, b.codes)


def seeded_noise(seed: int, frames: int) -> np.ndarray:
    source = NoiseSource(36, seed=seed)
    return np.concatenate([np.array(source.row(i)) for i in range(frames)])


def test_explicit_noise_reproduces_the_seeded_run(tiny_tts) -> None:
    seeded = tiny_tts.synthesize("Hi.", max_frames=4, seed=3)
    noise = seeded_noise(3, 4)
    explicit = tiny_tts.synthesize("Hi.", max_frames=100, noise=noise)
    np.testing.assert_array_equal(explicit.codes, seeded.codes)
    np.testing.assert_array_equal(explicit.audio, seeded.audio)
    assert explicit.seed is None


def test_frame_i_uses_noise_row_i(tiny_tts) -> None:
    noise = seeded_noise(0, 4)
    base = tiny_tts.synthesize("Hi.", noise=noise).codes
    if len(base) < 4:
        pytest.skip("this seed ends early")
    changed = noise.copy()
    changed[2] = -changed[2]
    other = tiny_tts.synthesize("Hi.", noise=changed).codes
    np.testing.assert_array_equal(other[:2], base[:2])  # frames before 2 are untouched
    assert not np.array_equal(other[2, 1:], base[2, 1:])  # frame 2's acoustics follow row 2
    assert other[2, 0] == base[2, 0]  # its semantic code was fixed before the noise is used


def test_generation_stops_after_len_noise_frames(tiny_tts) -> None:
    longer = tiny_tts.synthesize("Hi.", noise=seeded_noise(0, 4))
    noise = seeded_noise(0, 2)
    speech = tiny_tts.synthesize("Hi.", noise=noise, max_frames=10)
    assert len(speech.codes) == min(2, len(longer.codes))
    assert len(speech.audio) == len(speech.codes) * 1920
    np.testing.assert_array_equal(speech.codes, longer.codes[:2])
    assert len(tiny_tts.synthesize("Hi.", noise=noise, max_frames=1).codes) == 1
    empty = tiny_tts.synthesize("Hi.", noise=np.zeros((0, 36), np.float32))
    assert empty.codes.shape == (0, 37) and empty.audio.shape == (0,)


def test_noise_dtype_is_not_significant_beyond_float32(tiny_tts) -> None:
    noise = seeded_noise(1, 2)
    a = tiny_tts.synthesize("Hi.", noise=noise).codes
    b = tiny_tts.synthesize("Hi.", noise=noise.astype(np.float64)).codes
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "noise",
    [
        np.zeros((3, 35), np.float32),
        np.zeros((3, 37), np.float32),
        np.zeros(36, np.float32),
        np.zeros((1, 3, 36), np.float32),
        np.zeros((3, 36), np.int32),
        np.zeros((3, 36), bool),
        np.full((3, 36), np.nan, np.float32),
        np.array([[0.0] * 35 + [np.inf]]),
        np.array([[0.0] * 35 + [-np.inf]] * 2),
        np.array([["a"] * 36]),
    ],
    ids=[
        "35-wide",
        "37-wide",
        "1-d",
        "3-d",
        "int",
        "bool",
        "nan",
        "inf",
        "-inf",
        "strings",
    ],
)
def test_bad_noise_is_an_input_error(tiny_tts, noise: np.ndarray) -> None:
    with pytest.raises(InputError) as exc:
        tiny_tts.synthesize("Hi.", noise=noise)
    assert "noise" in one_line(exc.value)


# --------------------------------------------------------------- a checkpoint written by torch


def _torch_checkpoint(path: Path, torch_dtype: Any) -> Path:
    """A random checkpoint written with torch + safetensors.torch + torch.save, tensor by
    tensor from Mistral's published names (not through expected_tensors or the project's
    writer), at odd sizes: 5 backbone heads on a 40-wide stream, 3 flow heads, 3 codec heads
    of width 10 on a 24-wide codec, 3 codec stages with a stride-3 convT, 37 semantic codes,
    5 acoustic levels and 7 acoustic codebooks."""
    torch = pytest.importorskip("torch")
    save_file = pytest.importorskip("safetensors.torch").save_file
    from voxtral_mlx.synthetic.tekken import build_tekken, write_tekken

    dim, sem, levels, nac, cdim, patch = 40, 37, 5, 7, 24, 10
    lengths, kernels, strides = (1, 2, 1), (3, 5, 4), (1, 3, 2)
    params = make_params("tiny", vocab_size=2048)
    params.update(dim=dim, n_layers=3, head_dim=6, hidden_dim=52, n_heads=5, n_kv_heads=1)
    audio = params["multimodal"]["audio_model_args"]
    audio.update(semantic_codebook_size=sem, acoustic_codebook_size=levels, n_acoustic_codebook=nac)
    audio["audio_encoding_args"].update(num_codebooks=nac + 1, frame_rate=24000 / (patch * 6))
    _at(params).update(input_dim=dim, dim=dim, n_layers=2, head_dim=10, hidden_dim=24)
    _at(params).update(n_heads=3, n_kv_heads=1)
    _codec(params).update(
        dim=cdim,
        hidden_dim=40,
        head_dim=10,
        n_heads=3,
        n_kv_heads=1,
        attn_sliding_window_size=4,
        pretransform_patch_size=patch,
        patch_proj_kernel_size=3,
        semantic_codebook_size=sem,
        semantic_dim=5,
        acoustic_codebook_size=levels,
        acoustic_dim=nac,
        decoder_transformer_lengths_str=",".join(map(str, lengths)),
        decoder_convs_kernels_str=",".join(map(str, kernels)),
        decoder_convs_strides_str=",".join(map(str, strides)),
    )
    path.mkdir(parents=True)
    (path / "params.json").write_text(json.dumps(params))
    g = torch.Generator().manual_seed(0)

    def r(*shape: int) -> Any:
        return torch.randn(*shape, generator=g) * 0.2

    def layer(p: str, d: int, nh: int, nkv: int, hd: int, hidden: int) -> dict[str, Any]:
        return {
            f"{p}.attention.wq.weight": r(nh * hd, d),
            f"{p}.attention.wk.weight": r(nkv * hd, d),
            f"{p}.attention.wv.weight": r(nkv * hd, d),
            f"{p}.attention.wo.weight": r(d, nh * hd),
            f"{p}.attention_norm.weight": 1 + r(d),
            f"{p}.ffn_norm.weight": 1 + r(d),
            f"{p}.feed_forward.w1.weight": r(hidden, d),
            f"{p}.feed_forward.w2.weight": r(d, hidden),
            f"{p}.feed_forward.w3.weight": r(hidden, d),
        }

    w = {
        "mm_audio_embeddings.tok_embeddings.weight": r(2048, dim),
        "mm_audio_embeddings.audio_codebook_embeddings.embeddings.weight": r(128, dim),
        "norm.weight": 1 + r(dim),
        "acoustic_transformer.input_projection.weight": r(dim, nac),
        "acoustic_transformer.llm_projection.weight": r(dim, dim),
        "acoustic_transformer.time_projection.weight": r(dim, dim),
        "acoustic_transformer.norm.weight": 1 + r(dim),
        "acoustic_transformer.semantic_codebook_output.weight": r(128, dim),
        "acoustic_transformer.acoustic_codebook_output.weight": r(nac, dim),
        "audio_tokenizer.quantizer.semantic_codebook.cluster_usage": r(sem).abs() * 10,
        "audio_tokenizer.quantizer.semantic_codebook.embedding_sum": r(sem, 5),
        "audio_tokenizer.output_proj.conv.parametrizations.weight.original0": 1 + r(patch, 1, 1),
        "audio_tokenizer.output_proj.conv.parametrizations.weight.original1": r(patch, cdim, 3),
    }
    for i in range(3):
        w.update(layer(f"layers.{i}", dim, 5, 1, 6, 52))
    for i in range(2):
        w.update(layer(f"acoustic_transformer.layers.{i}", dim, 3, 1, 10, 24))
    for s, (n, k, st) in enumerate(zip(lengths, kernels, strides, strict=True)):
        c_in = 5 + nac if s == 0 else cdim
        conv = f"audio_tokenizer.decoder_blocks.{2 * s}.conv.parametrizations.weight"
        v = (c_in, cdim, k) if st > 1 else (cdim, c_in, k)  # ConvTranspose1d / Conv1d
        w[f"{conv}.original0"] = 1 + r(v[0], 1, 1).abs()
        w[f"{conv}.original1"] = r(*v)
        for j in range(n):
            p = f"audio_tokenizer.decoder_blocks.{2 * s + 1}.layers.{j}"
            w.update(layer(p, cdim, 3, 1, 10, 40))
            w[f"{p}.attention.q_norm.weight"] = 1 + r(30)
            w[f"{p}.attention.k_norm.weight"] = 1 + r(10)
            w[f"{p}.attention_scale"] = r(cdim)
            w[f"{p}.ffn_scale"] = r(cdim)
    save_file(
        {k: v.to(torch_dtype).contiguous() for k, v in w.items()},
        str(path / "consolidated.safetensors"),
    )
    voices = {"casual_male": 4, "fr_female": 2}
    write_tekken(path / "tekken.json", build_tekken(voices, vocab_source=None))
    (path / "voice_embedding").mkdir()
    for name, rows in voices.items():
        torch.save(r(rows, dim).to(torch.bfloat16), path / "voice_embedding" / f"{name}.pt")
    return path


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_checkpoint_written_by_torch_at_odd_sizes_speaks(tmp_path: Path, dtype: str) -> None:
    torch = pytest.importorskip("torch")
    model = _torch_checkpoint(tmp_path / "m", getattr(torch, dtype))
    tts = voxtral_mlx.load(model)
    assert tts.dtype == getattr(mx, dtype)
    assert tts.samples_per_frame == 60 and tts.config.num_codebooks == 8
    assert tts.prompt_ids("Hi.", "casual_male")[:7] == [1, 25, 24, 24, 24, 24, 36]
    speech = tts.synthesize("Hi there.", voice="fr_female", seed=0, max_frames=4)
    n = len(speech.codes)
    assert n >= 1  # this seed does not end on the first frame
    assert speech.codes.shape == (n, 8) and speech.audio.shape == (n * 60,)
    assert np.isfinite(speech.audio).all()
    assert ((speech.codes[:, 0] >= 2) & (speech.codes[:, 0] < 39)).all()
    assert ((speech.codes[:, 1:] >= 2) & (speech.codes[:, 1:] <= 6)).all()
    assert np.array_equal(tts.decode(speech.codes), speech.audio)


def test_each_block_of_start_noise_has_its_own_key() -> None:
    """Noise is drawn in blocks of NOISE_BLOCK frames, each from the next key of the seed's
    chain: frame 64 is no repeat of frame 0, and any frame depends on the seed alone."""
    rows = seeded_noise(5, 3 * NOISE_BLOCK).reshape(3, NOISE_BLOCK, 36)
    assert not np.allclose(rows[0], rows[1]) and not np.allclose(rows[1], rows[2])
    again = NoiseSource(36, seed=5)
    np.testing.assert_array_equal(np.array(again.row(2 * NOISE_BLOCK + 3))[0], rows[2, 3])
