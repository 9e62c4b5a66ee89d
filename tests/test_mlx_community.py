"""mlx-community layout: directories built with mlx-audio's OWN conversion code (its Model,
sanitize, model_quant_predicate, mlx-lm's quantize_model / save_model / save_config, sharded
with an index) load in voxtral_mlx, and speak exactly like mlx-audio's model loaded from the
same directory with mlx-audio's own loader (patched to SPEC, same injected noise, float32).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

import voxtral_mlx
from tests.mlx_audio_reference import (
    build_mlx_community,
    injected_noise,
    load_converted_reference,
    recorded_frames,
    spec_codebook_floor,
)
from voxtral_mlx.checkpoint import affine_bits, expected_tensors
from voxtral_mlx.config import ModelConfig
from voxtral_mlx.errors import CheckpointError, ConfigError, ModelNotFoundError, VoxtralError
from voxtral_mlx.loader import load_model_dir
from voxtral_mlx.mlx_layout import to_mistral_name, to_mlx_audio_name
from voxtral_mlx.synthetic.checkpoint import build_random_checkpoint, make_params

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

TEXT = "Hello world. This is a test of the speech model."
VOICE = "ar_male"
VOICES = {"ar_male": 67, "casual_male": 9}
FRAMES = 24
SHARD_BYTES = 4 << 20  # forces several shards on the tiny model, as >5 GB does on the real one


def one_line(e: BaseException) -> str:
    assert isinstance(e, VoxtralError), type(e)
    text = str(e)
    assert text and "\n" not in text, repr(text)
    return text


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    # Feed-forward widths a multiple of 64, as the real model's: mlx-audio quantizes
    # w2/down_proj then too (with the tiny preset's 160 it left them unquantized).
    params = make_params("tiny")
    params["hidden_dim"] = 192
    params["multimodal"]["audio_model_args"]["acoustic_transformer_args"]["hidden_dim"] = 192
    return build_random_checkpoint(
        tmp_path_factory.mktemp("mc-src"),
        params,
        seed=3,
        voices=VOICES,
        voice_format="safetensors",
        suppress_end=True,
    )


@pytest.fixture(scope="module")
def community(source: Path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mc")
    built = {
        name: build_mlx_community(source, root / name, bits, SHARD_BYTES)
        for name, bits in (("bf16", None), ("4bit", 4), ("6bit", 6))
    }
    # As the published 4-bit and 6-bit repos are: one model.safetensors, and its index.
    built["4bit-one-file"] = build_mlx_community(source, root / "4bit-one-file", 4)
    return built


def load_mlx_audio(path: Path):
    """mlx-audio's own loader on the directory, in float32, with SPEC's codec patches."""
    model = load_converted_reference(path)
    model.update(
        tree_map(
            lambda a: a.astype(mx.float32) if mx.issubdtype(a.dtype, mx.floating) else a,
            model.parameters(),
        )
    )
    voice = mx.load(str(path / "voice_embedding" / f"{VOICE}.safetensors"))["embedding"]
    model._voice_embeddings[VOICE] = voice.astype(mx.float32)
    return model


def reference_run(model, noise: np.ndarray, frames: int) -> tuple[np.ndarray, np.ndarray]:
    with recorded_frames(model) as recorded, injected_noise(noise), spec_codebook_floor():
        results = list(model.generate(TEXT, voice=VOICE, max_tokens=frames))
    return np.stack(recorded), np.array(results[-1].audio)


# --------------------------------------------------------------------------- the layout


def test_the_layout_is_mlx_audios(community: dict[str, Path]) -> None:
    for name, path in community.items():
        files = sorted(p.name for p in path.iterdir())
        shards = [f for f in files if f.startswith("model-")]
        if name.endswith("one-file"):
            assert not shards and "model.safetensors" in files, files
        else:
            assert len(shards) >= 2, files
        assert "model.safetensors.index.json" in files and "config.json" in files
        assert {"params.json", "tekken.json", "voice_embedding"} <= set(files)
        assert sorted(p.name for p in (path / "voice_embedding").iterdir()) == sorted(
            f"{v}.safetensors" for v in VOICES
        )
        index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
        assert "language_model.model.model.layers.0.self_attn.q_proj.weight" in index
        assert "audio_codebook_embeddings.embeddings.weight" in index
        config = json.loads((path / "config.json").read_text())
        if name == "bf16":
            assert "quantization" not in config and not any(k.endswith(".scales") for k in index)
        else:
            bits = int(name[0])
            assert config["quantization"] == {"group_size": 64, "bits": bits, "mode": "affine"}
            scales = {k[: -len(".scales")] for k in index if k.endswith(".scales")}
            # mlx-audio quantizes the flow head and the text embeddings too, never the codec
            assert "acoustic_transformer.semantic_codebook_output" in scales
            assert "language_model.model.model.embed_tokens" in scales
            assert not any(s.startswith(("audio_tokenizer", "audio_codebook")) for s in scales)


def test_rename_table_agrees_with_mlx_audio_sanitize(source: Path) -> None:
    from mlx_audio.tts.models.voxtral_tts import voxtral_tts as ma

    params = json.loads((source / "params.json").read_text())
    model = ma.Model(ma.ModelConfig.from_dict(params))
    ours = expected_tensors(ModelConfig.from_params(params))
    theirs = model.sanitize({name: name for name in ours})  # values: the original names
    assert len(theirs) == len(ours)
    for mlx_name, mistral_name in theirs.items():
        assert to_mistral_name(mlx_name) == mistral_name
        assert to_mlx_audio_name(mistral_name) == mlx_name
    # module paths (quantization config keys) map the same way, older exports too
    assert to_mistral_name("language_model.model.model.layers.3.mlp.down_proj") == (
        "layers.3.feed_forward.w2"
    )
    assert to_mistral_name("language_model.model.layers.1.input_layernorm.weight") == (
        "layers.1.attention_norm.weight"
    )
    assert to_mistral_name("language_model.model.model.layers.1.self_attn.rope.x") is None


@pytest.mark.parametrize("name", ["bf16", "4bit", "6bit", "4bit-one-file"])
def test_loads_with_exactly_the_stored_layers_quantized(community, name: str) -> None:
    path = community[name]
    loaded = load_model_dir(path, "float32")
    assert loaded.layout == "mlx-community" and loaded.dtype == mx.float32
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    stored = {to_mistral_name(k[: -len(".scales")]) for k in index if k.endswith(".scales")}
    quantized = {
        p: m for p, m in loaded.model.named_modules() if isinstance(m, nn.QuantizedLinear)
    } | {p: m for p, m in loaded.model.named_modules() if isinstance(m, nn.QuantizedEmbedding)}
    assert set(quantized) == stored == set(loaded.quantized)
    if name == "bf16":
        assert not quantized
        return
    assert all(m.bits == int(name[0]) and m.group_size == 64 for m in quantized.values())
    assert "mm_audio_embeddings.tok_embeddings" in quantized
    # Every Linear and Embedding of the backbone and flow head, as in the published ones.
    assert {"layers.0.feed_forward.w2", "acoustic_transformer.layers.0.feed_forward.w2"} <= set(
        quantized
    )
    params = dict(tree_flatten(loaded.model.parameters()))
    assert {v.dtype for k, v in params.items() if not k.endswith(".weight")} <= {mx.float32}
    assert params["layers.0.attention.wq.weight"].dtype == mx.uint32


def test_default_dtype_is_bf16(community) -> None:
    assert load_model_dir(community["4bit"]).dtype == mx.bfloat16
    assert load_model_dir(community["bf16"]).dtype == mx.bfloat16


@pytest.mark.parametrize("name", ["bf16", "4bit", "6bit", "4bit-one-file"])
def test_same_codes_and_audio_as_mlx_audio(community, name: str) -> None:
    path = community[name]
    noise = np.random.default_rng(0).standard_normal((FRAMES, 36)).astype(np.float32)
    tts = voxtral_mlx.load(path, dtype="float32")
    try:
        speech = tts.synthesize(TEXT, VOICE, noise=noise, max_frames=FRAMES)
    finally:
        tts.close()
    codes, audio = reference_run(load_mlx_audio(path), noise, FRAMES)
    assert len(speech.codes) == len(codes) == FRAMES
    np.testing.assert_array_equal(speech.codes, codes)
    assert speech.audio.shape == audio.shape == (FRAMES * 1920,)
    err = float(np.max(np.abs(speech.audio - audio)) / np.max(np.abs(audio)))
    assert err < 1e-4, err


@pytest.mark.parametrize(
    "options", [{}, {"q_bits": 8}, {"q_bits": 4}, {"q_bits": 6, "q_group_size": 32}]
)
def test_mlx_audio_loads_voxtral_mlx_conversions(source, tmp_path, options) -> None:
    """What `voxtral-mlx convert` writes is also an mlx-community directory: mlx-audio's own
    loader reads it (its names, config.json, the per-layer bits of the flow head) and speaks
    exactly like voxtral_mlx on it."""
    from voxtral_mlx.convert import convert_model

    path = convert_model(source, tmp_path / "out", **options).path
    noise = np.random.default_rng(1).standard_normal((FRAMES, 36)).astype(np.float32)
    loaded = load_model_dir(path, "float32")
    assert loaded.layout == "voxtral-mlx"
    tts = voxtral_mlx.load(path, dtype="float32")
    try:
        speech = tts.synthesize(TEXT, VOICE, noise=noise, max_frames=FRAMES)
    finally:
        tts.close()
    model = load_mlx_audio(path)
    theirs = {
        p: (m.bits, m.group_size)
        for p, m in model.named_modules()
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
    }
    ours = {to_mlx_audio_name(p): (q.bits, q.group_size) for p, q in loaded.quantized.items()}
    assert theirs == ours and bool(ours) == bool(options)
    if options.get("q_bits") == 4:  # the flow head keeps 8 bits (SPEC §8)
        assert theirs["acoustic_transformer.semantic_codebook_output"] == (8, 64)
    codes, audio = reference_run(model, noise, FRAMES)
    np.testing.assert_array_equal(speech.codes, codes)
    err = float(np.max(np.abs(speech.audio - audio)) / np.max(np.abs(audio)))
    assert err < 1e-4, err


# --------------------------------------------------------------------------- broken copies


@pytest.fixture
def broken(community, tmp_path: Path) -> Path:
    return Path(shutil.copytree(community["4bit"], tmp_path / "m"))


def test_params_json_and_config_json_must_agree(broken: Path) -> None:
    """mlx-audio reads config.json, voxtral_mlx params.json: a directory where they differ
    would speak differently in each, so it is refused, naming the key."""
    params = json.loads((broken / "params.json").read_text())
    params["rope_theta"] = 10.0
    (broken / "params.json").write_text(json.dumps(params))
    with pytest.raises(ConfigError) as exc:
        load_model_dir(broken)
    message = one_line(exc.value)
    assert "params.json and config.json disagree on backbone.rope_theta" in message
    assert "10.0 vs 1000000.0" in message


@pytest.mark.parametrize(("key", "value"), [("n_heads", "four"), ("n_layers", 0)])
def test_a_config_json_model_config_that_does_not_parse_is_refused(broken, key, value) -> None:
    """It was ignored beside params.json (mlx-audio, which reads it, would fail or differ);
    a valid but different value was refused."""
    config = json.loads((broken / "config.json").read_text())
    config[key] = value
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as exc:
        load_model_dir(broken)
    assert "config.json" in one_line(exc.value) and key in one_line(exc.value)


def test_config_json_params_may_differ_in_what_does_not_shape_the_model(broken: Path) -> None:
    """Keys the model does not read, and the voice list (the voice files decide), may differ:
    only a disagreement about the model itself is refused."""
    config = json.loads((broken / "config.json").read_text())
    config["max_seq_len"] = 1234
    config["multimodal"]["audio_tokenizer_args"]["voice"] = {}
    (broken / "config.json").write_text(json.dumps(config))
    assert load_model_dir(broken).config == ModelConfig.from_file(broken / "params.json")


def test_decoding_steps_edited_in_params_json_are_used(broken: Path) -> None:
    """SPEC: users raise the Euler steps by editing params.json; config.json that does not
    set them (it takes the default) does not contradict that. One that sets them does."""
    params = json.loads((broken / "params.json").read_text())
    params["multimodal"]["audio_model_args"]["acoustic_transformer_args"]["n_decoding_steps"] = 10
    (broken / "params.json").write_text(json.dumps(params))
    config = json.loads((broken / "config.json").read_text())
    assert "n_decoding_steps" not in json.dumps(config)
    assert load_model_dir(broken).config.flow.n_decoding_steps == 10
    config["multimodal"]["audio_model_args"]["acoustic_transformer_args"]["n_decoding_steps"] = 7
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as exc:
        load_model_dir(broken)
    assert "disagree on flow.n_decoding_steps (10 vs 7)" in one_line(exc.value)


def test_missing_shard_is_an_incomplete_download(broken: Path) -> None:
    shard = sorted(broken.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelNotFoundError) as exc:
        load_model_dir(broken)
    message = one_line(exc.value)
    assert shard.name in message and "fetch it again" in message


@pytest.mark.parametrize("kind", ["directory", "fifo", "broken link"])
@pytest.mark.parametrize("with_index", [True, False])
def test_a_shard_that_is_no_file_is_named_as_such(
    broken: Path, kind: str, with_index: bool
) -> None:
    """It was reported missing (fetch it again), though it is there as something else."""
    shard = sorted(broken.glob("model-*.safetensors"))[-1]
    shard.unlink()
    if kind == "directory":
        shard.mkdir()
    elif kind == "fifo":
        os.mkfifo(shard)
    else:
        shard.symlink_to(broken / "gone.safetensors")
    if not with_index:
        (broken / "model.safetensors.index.json").unlink()
    with pytest.raises(CheckpointError) as exc:
        load_model_dir(broken)
    message = one_line(exc.value)
    assert f"{shard} is not a readable file" in message
    assert "remove it and fetch the model again" in message


@pytest.mark.parametrize("beside_original", [False, True])
def test_weight_files_of_any_name_load_without_an_index(
    broken: Path, source: Path, beside_original: bool
) -> None:
    """mlx-audio reads every top-level *.safetensors; such a directory was called an
    incomplete download. With the original's consolidated.safetensors copied beside them
    (as mlx-audio's converter leaves it) the conversion still wins (the original used to
    load, unquantized, without a word)."""
    want = load_model_dir(broken)
    for i, shard in enumerate(sorted(broken.glob("model-*.safetensors"))):
        shard.rename(broken / f"weights.{i:02d}.safetensors")
    (broken / "model.safetensors.index.json").unlink()
    if beside_original:
        shutil.copy(source / "consolidated.safetensors", broken)
    got = load_model_dir(broken)
    assert got.quantized == want.quantized and got.layout == want.layout == "mlx-community"
    assert len(got.quantized) > 0
    theirs = dict(tree_flatten(want.model.parameters()))
    ours = dict(tree_flatten(got.model.parameters()))
    assert set(ours) == set(theirs)
    for name, value in theirs.items():
        assert mx.array_equal(ours[name], value), name


def test_an_index_listing_no_tensors_says_so(broken: Path) -> None:
    """It was called a directory without weights, beside model-*.safetensors."""
    path = broken / "model.safetensors.index.json"
    path.write_text(json.dumps({"metadata": {}, "weight_map": {}}))
    with pytest.raises(CheckpointError) as exc:
        load_model_dir(broken)
    message = one_line(exc.value)
    assert "lists no tensors" in message and "delete the index" in message


def test_a_stray_file_beside_mistral_weights_and_a_config_json_is_not_a_conversion(
    source: Path, tmp_path: Path
) -> None:
    """Mistral's layout given a config.json (mlx-audio's converter wants one in its source)
    and a voice file copied to the top: that file was read as the weights, and the error
    blamed params.json; the weights are consolidated.safetensors, as mlx-audio reads them."""
    want = load_model_dir(source)
    folder = Path(shutil.copytree(source, tmp_path / "m"))
    (folder / "config.json").write_text((folder / "params.json").read_text())
    shutil.copy(folder / "voice_embedding" / "casual_male.safetensors", folder / "mine.safetensors")
    got = load_model_dir(folder)
    assert got.layout == want.layout == "mistral"
    theirs = dict(tree_flatten(want.model.parameters()))
    ours = dict(tree_flatten(got.model.parameters()))
    assert set(ours) == set(theirs)
    for name, value in theirs.items():
        assert mx.array_equal(ours[name], value), name


def test_a_stray_weight_file_is_named_with_its_tensors(broken: Path, source: Path) -> None:
    """Loose weight files were all called model-*.safetensors in a mismatch, whatever their
    names, and an unexpected tensor did not say which file holds it."""
    for i, shard in enumerate(sorted(broken.glob("model-*.safetensors"))):
        shard.rename(broken / f"weights.{i:02d}.safetensors")
    (broken / "model.safetensors.index.json").unlink()
    shutil.copy(
        broken / "voice_embedding" / "casual_male.safetensors", broken / "stray.safetensors"
    )
    with pytest.raises(CheckpointError) as exc:
        load_model_dir(broken)
    message = one_line(exc.value)
    assert "model-*" not in message and "stray.safetensors" in message
    assert "unexpected (embedding in stray.safetensors)" in message


@pytest.mark.parametrize(
    ("key", "value", "stated"),
    [("bits", 8, "8 bits and group size 64"), ("group_size", 32, "4 bits and group size 32")],
)
def test_a_config_json_contradicting_the_tensors_is_named(
    broken: Path, key: str, value: int, stated: str
) -> None:
    """config.json's bits or group size disagreeing with the packed shapes: config.json is
    named, with what the tensors hold (it was a list of mis-shaped tensors, blaming them)."""
    config = json.loads((broken / "config.json").read_text())
    config["quantization"][key] = value
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as exc:
        load_model_dir(broken)
    message = one_line(exc.value)
    assert "config.json's quantization section gives layer '" in message
    assert f"{stated}, but its tensors are 4 bits and group size 64" in message
    assert "mis-shaped" not in message
    # As the file names it.
    assert "language_model.model.model." in message or "acoustic_transformer." in message
    del config["quantization"]
    (broken / "config.json").write_text(json.dumps(config))
    assert load_model_dir(broken).quantized  # the fix the message offers


def test_a_group_size_the_width_cannot_take_names_the_files(broken: Path) -> None:
    config = json.loads((broken / "config.json").read_text())
    config["quantization"]["group_size"] = 128  # the tiny widths are 64
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as exc:
        load_model_dir(broken)
    message = one_line(exc.value)
    assert message.startswith(str(broken))
    assert "group size 128" in message


def test_a_quantized_layer_without_scales_is_a_damaged_file(broken: Path) -> None:
    """Packed weights whose .scales are gone: named as a damaged file (it was reported as a
    mis-shaped weight and unexpected biases, under names the file does not use)."""
    index_path = broken / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    layer = "language_model.model.model.layers.1.self_attn.q_proj"
    shard = broken / index["weight_map"].pop(f"{layer}.scales")
    tensors = mx.load(str(shard))
    del tensors[f"{layer}.scales"]
    mx.save_safetensors(str(shard), tensors)
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as exc:
        load_model_dir(broken)
    message = one_line(exc.value)
    assert f"layer '{layer}' has quantized weights but no .scales" in message
    assert "re-download or re-convert" in message


def _edit_quantization(model: Path, edit) -> None:
    """Apply ``edit`` to both quantization sections of config.json (mlx-lm writes both)."""
    config = json.loads((model / "config.json").read_text())
    for key in ("quantization", "quantization_config"):
        edit(config[key])
    (model / "config.json").write_text(json.dumps(config))


def _stored(model: Path) -> tuple[list[str], list[str]]:
    """(module paths stored quantized, float weights of 2-D layers) under mlx-audio's names."""
    index = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]
    quantized = sorted(k[: -len(".scales")] for k in index if k.endswith(".scales"))
    plain = sorted(
        k[: -len(".weight")]
        for k in index
        if k.endswith(".weight")
        and k[: -len(".weight")] not in quantized
        and k.startswith("audio_tokenizer.")
        and ".attention.wq." in k
    )
    return quantized, plain


def test_config_entries_for_unquantized_or_missing_layers_are_ignored(broken: Path) -> None:
    """mlx-lm style per-layer entries that name an unquantized layer or no module at all
    change nothing (mlx-audio ignores them too): the same codes as before."""
    before = load_model_dir(broken, "float32")
    _, plain = _stored(broken)
    assert plain

    def add(q: dict) -> None:
        q[plain[0]] = {"group_size": 64, "bits": 8}
        q["some.module.that.does.not.exist"] = {"group_size": 32, "bits": 4}

    _edit_quantization(broken, add)
    after = load_model_dir(broken, "float32")
    assert after.quantized == before.quantized


def test_params_json_giving_other_widths_is_named_not_the_quantization_section(
    broken: Path,
) -> None:
    """Wider attention heads in params.json (and config.json, which must agree): the
    output projections' bits and group size read at that width are 2 and 128 instead of
    4 and 64, and config.json's quantization section was blamed for them."""

    def widen(node: object) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "head_dim" and isinstance(value, int):
                    node[key] = 2 * value
                else:
                    widen(value)

    for name in ("params.json", "config.json"):
        config = json.loads((broken / name).read_text())
        widen(config)
        (broken / name).write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as exc:
        load_model_dir(broken)
    message = one_line(exc.value)
    assert "mis-shaped" in message and "does not match params.json" in message
    assert "quantization section" not in message


def test_config_leaving_a_stored_quantized_layer_unquantized_names_config_json(
    broken: Path,
) -> None:
    quantized, _ = _stored(broken)
    _edit_quantization(broken, lambda q: q.update({quantized[0]: False}))
    with pytest.raises(CheckpointError) as exc:
        load_model_dir(broken)
    message = one_line(exc.value)
    assert "config.json" in message and "unquantized" in message and "re-convert" in message


def test_an_unknown_quantization_mode_says_to_convert_the_original(broken: Path) -> None:
    _edit_quantization(broken, lambda q: q.update(mode="fp3"))
    with pytest.raises(CheckpointError) as exc:
        load_model_dir(broken)
    message = one_line(exc.value)
    assert "'fp3'" in message and "mxfp4" in message and "original (unquantized)" in message


def test_a_float_mode_that_does_not_fit_the_stored_shapes_is_named(broken: Path) -> None:
    """config.json naming a mode its tensors are not in blamed the layer ("re-convert it"),
    not config.json, as a wrong bits or group size does."""
    _edit_quantization(broken, lambda q: q.update(mode="mxfp4"))  # the weights are affine g64
    with pytest.raises(CheckpointError) as exc:
        load_model_dir(broken)
    message = one_line(exc.value)
    assert "config.json's quantization section gives layer '" in message
    assert "mode mxfp4 (4 bits and group size 64), but its tensors are 4 bits and group" in message
    assert "correct config.json (or remove its quantization section" in message


def test_an_affine_section_over_float_mode_tensors_names_config_json(float_modes, tmp_path):
    """An mxfp4 conversion whose config.json says affine: a list of 29 missing biases and
    wrongly typed scales, blaming the weights."""
    path = Path(shutil.copytree(float_modes["mxfp4"], tmp_path / "m"))
    _edit_quantization(path, lambda q: q.update(mode="affine"))
    with pytest.raises(CheckpointError) as exc:
        load_model_dir(path)
    message = one_line(exc.value)
    assert "config.json's quantization section gives layer '" in message
    assert ", but its tensors are mode mxfp4 (4 bits and group size 32): correct" in message
    assert "missing" not in message


FLOAT_MODES = ["mxfp4", "mxfp8", "nvfp4"]


@pytest.fixture(scope="module")
def float_modes(source: Path, tmp_path_factory) -> dict[str, Path]:
    """What ``mlx_audio.convert -q --q-mode MODE`` writes."""
    root = tmp_path_factory.mktemp("mc-float")
    return {
        m: build_mlx_community(source, root / m, None, None, group=None, mode=m)
        for m in FLOAT_MODES
    }


def _float32_text_table(model) -> None:
    """mlx-audio's text table quantized to a float format dequantizes to bfloat16, into
    which it writes the float32 voice rows (rounding them) even when it computes in
    float32: the reference's table is made to return float32, as voxtral_mlx's does."""
    table = model.language_model.model.model.embed_tokens

    class Float32Rows(type(table)):
        def __call__(self, x):
            return super().__call__(x).astype(mx.float32)

    table.__class__ = Float32Rows


def _assert_speaks_like_mlx_audio(path: Path, prepare_reference=None) -> None:
    """voxtral_mlx (float32) and mlx-audio on ``path``, same noise: equal codes, audio
    within 1e-4. ``prepare_reference(model)`` adjusts mlx-audio's model first."""
    noise = np.random.default_rng(0).standard_normal((FRAMES, 36)).astype(np.float32)
    tts = voxtral_mlx.load(path, dtype="float32", prefix_cache_dir=None)
    try:
        speech = tts.synthesize(TEXT, VOICE, noise=noise, max_frames=FRAMES)
    finally:
        tts.close()
    reference = load_mlx_audio(path)
    if prepare_reference is not None:
        prepare_reference(reference)
    codes, audio = reference_run(reference, noise, FRAMES)
    np.testing.assert_array_equal(speech.codes, codes)
    err = float(np.max(np.abs(speech.audio - audio)) / np.max(np.abs(audio)))
    assert err < 1e-4, err


@pytest.mark.parametrize("mode", FLOAT_MODES)
def test_float_quantization_modes_load_and_match_mlx_audio(float_modes, mode: str) -> None:
    path = float_modes[mode]
    loaded = load_model_dir(path, "float32")
    modes = {m.mode for _, m in loaded.model.named_modules() if hasattr(m, "scales")}
    assert modes == {mode} and {s.mode for s in loaded.quantized.values()} == {mode}
    _assert_speaks_like_mlx_audio(path, _float32_text_table)


OTHER_BITS = [1, 2, 3, 5, 8]  # mlx-audio's --q-bits beyond the community's 4 and 6


@pytest.mark.parametrize("bits", OTHER_BITS)
def test_every_affine_width_mlx_supports_loads_and_matches_mlx_audio(source, tmp_path, bits):
    """1-bit conversions (mlx-audio writes and reads them) were refused: the supported
    widths were a fixed list, not asked of MLX."""
    if bits not in affine_bits():
        pytest.skip(f"this MLX does not quantize to {bits} bits")
    path = build_mlx_community(source, tmp_path / f"{bits}bit", bits, group=32)
    loaded = load_model_dir(path, "float32")
    assert loaded.quantized and {s.bits for s in loaded.quantized.values()} == {bits}
    _assert_speaks_like_mlx_audio(path)


def test_per_layer_entries_default_as_mlx_does(float_modes, tmp_path) -> None:
    """An mlx-lm entry goes to ``to_quantized`` as it is: what it leaves out takes that
    function's defaults (affine; the mode's bits and group size), not the section's."""
    path = Path(shutil.copytree(float_modes["nvfp4"], tmp_path / "nvfp4"))
    config = json.loads((path / "config.json").read_text())
    layers = [
        name.removesuffix(".scales")
        for file in path.glob("model*.safetensors")
        for name in mx.load(str(file))
        if name.endswith(".scales")
    ]
    assert len(layers) > 10
    for key in ("quantization", "quantization_config"):
        config[key] = {"group_size": 64, "bits": 8, "mode": "affine"}
        config[key].update({k: {"mode": "nvfp4"} for k in layers})
    (path / "config.json").write_text(json.dumps(config))
    loaded = load_model_dir(path, "float32")
    assert loaded.quantized == load_model_dir(float_modes["nvfp4"], "float32").quantized
    _assert_speaks_like_mlx_audio(path, _float32_text_table)


def test_per_layer_true_entries_take_the_sections_bits(community, tmp_path) -> None:
    """``"layer": true`` is what an mlx-lm quantization predicate returning True leaves:
    MLX quantizes such a layer with the section's bits and group size (6 here), not
    ``to_quantized``'s defaults (4 bits, which refused the directory)."""
    path = Path(shutil.copytree(community["6bit"], tmp_path / "6bit"))
    quantized, _ = _stored(path)
    assert quantized
    _edit_quantization(path, lambda q: q.update({layer: True for layer in quantized}))
    loaded = load_model_dir(path, "float32")
    assert loaded.quantized == load_model_dir(community["6bit"], "float32").quantized
    assert {s.bits for s in loaded.quantized.values()} == {6}
    _assert_speaks_like_mlx_audio(path)


def test_bits_mlx_does_not_support_are_one_line_errors(broken: Path) -> None:
    # config.json's 7 bits over 4-bit tensors: config.json is what is wrong.
    config = json.loads((broken / "config.json").read_text())
    _edit_quantization(broken, lambda q: q.update(bits=7))
    with pytest.raises(CheckpointError) as exc:
        load_model_dir(broken, "float32")
    assert "gives layer '" in one_line(exc.value) and "7 bits and group size 64, but its " in (
        one_line(exc.value)
    )
    # A layer whose tensors are 7-bit (packed as MLX would, if it could) and say so.
    (broken / "config.json").write_text(json.dumps(config))
    index = json.loads((broken / "model.safetensors.index.json").read_text())["weight_map"]
    layer = _stored(broken)[0][0]
    shard = broken / index[f"{layer}.weight"]
    tensors = dict(mx.load(str(shard)))
    rows, packed = tensors[f"{layer}.weight"].shape
    tensors[f"{layer}.weight"] = mx.zeros((rows, packed * 7 // 4), mx.uint32)
    mx.save_safetensors(str(shard), tensors, metadata={"format": "mlx"})
    _edit_quantization(broken, lambda q: q.update({layer: {"bits": 7, "group_size": 64}}))
    with pytest.raises(CheckpointError) as exc:
        load_model_dir(broken, "float32")
    message = one_line(exc.value)
    assert "quantized with 7 bits" in message and "does not support" in message
    assert ", ".join(map(str, affine_bits())) in message


def test_float_modes_are_read_off_the_shapes_without_config(float_modes, tmp_path) -> None:
    """Without a quantization section, 8-bit scales and no biases name the format."""
    for mode in FLOAT_MODES:
        path = Path(shutil.copytree(float_modes[mode], tmp_path / mode))
        config = json.loads((path / "config.json").read_text())
        del config["quantization"], config["quantization_config"]
        (path / "config.json").write_text(json.dumps(config))
        loaded = load_model_dir(path, "float32")
        assert {s.mode for s in loaded.quantized.values()} == {mode}
        assert loaded.quantized == load_model_dir(float_modes[mode], "float32").quantized


def test_scales_without_config_are_read_off_the_shapes(broken: Path) -> None:
    config = json.loads((broken / "config.json").read_text())
    del config["quantization"], config["quantization_config"]
    (broken / "config.json").write_text(json.dumps(config))
    loaded = load_model_dir(broken, "float32")
    assert {s.bits for s in loaded.quantized.values()} == {4}


@pytest.mark.parametrize("part", ["scales", "weight"])
@pytest.mark.parametrize("recorded", [True, False], ids=["config", "no-config"])
def test_a_scalar_where_a_packed_tensor_belongs_is_named(
    broken: Path, part: str, recorded: bool
) -> None:
    """A 0-d .scales or packed weight raised IndexError out of load() (a traceback)."""
    if not recorded:
        config = json.loads((broken / "config.json").read_text())
        del config["quantization"], config["quantization_config"]
        (broken / "config.json").write_text(json.dumps(config))
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    name = f"language_model.model.model.layers.1.self_attn.q_proj.{part}"
    shard = broken / index["weight_map"][name]
    tensors = mx.load(str(shard))
    tensors[name] = mx.array(1, dtype=tensors[name].dtype)
    mx.save_safetensors(str(shard), tensors)
    with pytest.raises(CheckpointError) as exc:
        load_model_dir(broken)
    message = one_line(exc.value)
    assert name in message and "mis-shaped" in message


def test_an_index_leaving_out_a_shard_of_its_series_says_so(broken: Path) -> None:
    """Its tensors were reported missing, with advice to check params.json and config.json."""
    path = broken / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    names = sorted(set(index["weight_map"].values()))
    assert len(names) > 1 and names[-1].startswith(f"model-{len(names):05d}-of-")
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != names[-1]}
    path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as exc:
        load_model_dir(broken)
    message = one_line(exc.value)
    assert f"names {len(names) - 1} of the {len(names)} files of its series, not {names[-1]}" in (
        message
    )
    assert "params.json" not in message


def test_an_empty_first_shard_left_out_of_the_index_loads(broken: Path) -> None:
    """mlx-lm's sharding (mlx-audio's converter) writes an empty model-00001-of-N, which its
    index does not name, when the first tensor alone exceeds the shard size; mlx-audio loads
    such a directory. It was refused as a stale index."""
    want = load_model_dir(broken)
    path = broken / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    names = sorted(set(index["weight_map"].values()))
    total = len(names) + 1
    renamed = {old: f"model-{i + 2:05d}-of-{total:05d}.safetensors" for i, old in enumerate(names)}
    for old, new in renamed.items():
        (broken / old).rename(broken / new)
    mx.save_safetensors(str(broken / f"model-00001-of-{total:05d}.safetensors"), {})
    index["weight_map"] = {k: renamed[v] for k, v in index["weight_map"].items()}
    path.write_text(json.dumps(index))
    got = load_model_dir(broken)
    theirs = dict(tree_flatten(want.model.parameters()))
    ours = dict(tree_flatten(got.model.parameters()))
    assert set(ours) == set(theirs)
    for name, value in theirs.items():
        assert mx.array_equal(ours[name], value), name
    # A left-out file that does hold tensors is still a stale index.
    first = broken / f"model-00001-of-{total:05d}.safetensors"
    mx.save_safetensors(str(first), {"stale": mx.zeros((2,))})
    with pytest.raises(CheckpointError) as exc:
        load_model_dir(broken)
    assert f"names {len(names)} of the {total} files of its series" in one_line(exc.value)


def test_index_pointing_at_the_wrong_shard(broken: Path) -> None:
    path = broken / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    names = sorted({v for v in index["weight_map"].values()})
    key = next(k for k, v in index["weight_map"].items() if v == names[0])
    index["weight_map"][key] = names[1]
    path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as exc:
        load_model_dir(broken)
    assert "index" in one_line(exc.value)


def test_converting_the_bf16_conversion_equals_converting_the_original(
    community, source: Path, tmp_path: Path
) -> None:
    """mlx-community bf16 is a valid `voxtral-mlx convert` source, even with its params only
    in config.json: same tensors as converting Mistral's original. A quantization section
    that quantized nothing (mlx-audio writes one when no layer fits the group size) was
    copied into the output's params.json."""
    from voxtral_mlx.convert import convert_model

    mc = Path(shutil.copytree(community["bf16"], tmp_path / "mc"))
    (mc / "params.json").unlink()
    config = json.loads((mc / "config.json").read_text())
    config["quantization"] = config["quantization_config"] = {"group_size": 128, "bits": 4}
    (mc / "config.json").write_text(json.dumps(config))
    a = convert_model(mc, tmp_path / "a", q_bits=4).path
    b = convert_model(source, tmp_path / "b", q_bits=4).path
    ta, tb = mx.load(str(a / "model.safetensors")), mx.load(str(b / "model.safetensors"))
    assert ta.keys() == tb.keys()
    assert all(mx.array_equal(ta[k], tb[k]).item() for k in ta)
    assert json.loads((a / "params.json").read_text()) == json.loads(
        (source / "params.json").read_text()
    )
    assert json.loads((a / "config.json").read_text())["source_layout"] == "mlx-community"


def test_without_params_json_errors_name_config_json(community, tmp_path: Path) -> None:
    mc = Path(shutil.copytree(community["4bit"], tmp_path / "mc"))
    (mc / "params.json").unlink()
    config = json.loads((mc / "config.json").read_text())
    config["dim"] = "64"
    (mc / "config.json").write_text(json.dumps(config))
    with pytest.raises(VoxtralError) as exc:
        load_model_dir(mc)
    assert "config.json key 'dim' must be an integer" in one_line(exc.value)
    del config["multimodal"]
    (mc / "config.json").write_text(json.dumps(config))
    with pytest.raises(VoxtralError) as exc:
        load_model_dir(mc)
    message = one_line(exc.value)
    assert "no params.json and its config.json holds no Voxtral parameters" in message


def test_quantized_community_models_are_not_a_conversion_source(community, tmp_path) -> None:
    from voxtral_mlx.convert import convert_model

    with pytest.raises(VoxtralError) as exc:
        convert_model(community["4bit"], tmp_path / "out", q_bits=8)
    assert "already quantized" in one_line(exc.value)


@pytest.mark.parametrize(
    "content",
    ["[" * 100_000 + "]" * 100_000, '{"weight_map": ' + "9" * 5000 + "}"],
    ids=["nested-100000-deep", "5000-digit-number"],
)
def test_pathological_config_and_index_json_are_one_line_errors(
    tmp_path: Path, content: str
) -> None:
    """json raises RecursionError / ValueError (not JSONDecodeError) for these."""
    from voxtral_mlx.mlx_layout import INDEX_NAME, read_config, read_index

    (tmp_path / "config.json").write_text(content)
    with pytest.raises(ConfigError) as exc:
        read_config(tmp_path)
    assert "config.json" in one_line(exc.value)
    (tmp_path / INDEX_NAME).write_text(content)
    with pytest.raises(CheckpointError) as exc:
        read_index(tmp_path / INDEX_NAME)
    assert INDEX_NAME in one_line(exc.value)
