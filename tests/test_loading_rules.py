"""Rules of the checkpoint readers (headers, verification, quantization sections, renames)
that only show on inputs the other tests do not build: each test pins one of them."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from test_checkpoint import header_error, one_line, raw_file, write_file

from voxtral_mlx.checkpoint import (
    CheckpointMismatch,
    QuantSpec,
    TensorInfo,
    checkpoint_dtype,
    expected_tensors,
    load_tensors,
    quantized_shapes,
    read_safetensors_header,
    some_names,
    verify_tensors,
)
from voxtral_mlx.config import ModelConfig
from voxtral_mlx.errors import CheckpointError, ConfigError, ModelNotFoundError
from voxtral_mlx.loader import (
    TensorRef,
    _first_difference,
    _infer_spec,
    _quantized_layers,
    _read_headers,
    _rename_refs,
    check_tokenizer,
    find_weight_files,
)
from voxtral_mlx.mlx_layout import (
    LayerQuant,
    QuantConfig,
    check_format,
    loose_weight_files,
    params_from_config,
    read_index,
    read_quantization,
    to_mistral_name,
    uses_mlx_audio_names,
    weight_files,
)
from voxtral_mlx.synthetic.checkpoint import make_params

WQ = "layers.0.attention.wq"  # [64, 64] in the tiny preset


@pytest.fixture(scope="module")
def config() -> ModelConfig:
    return ModelConfig.from_params(make_params("tiny"))


def refs(**entries: tuple[str, tuple[int, ...]]) -> dict[str, TensorRef]:
    """Header-only tensors (name with ``__`` for ``.``) -> (dtype, shape)."""
    out = {}
    for key, (dtype, shape) in entries.items():
        name = key.replace("__", ".")
        out[name] = TensorRef(Path("model.safetensors"), name, TensorInfo(dtype, shape, 0, 0))
    return out


def packed_wq(width: int, groups: int, scales_dtype: str = "BF16") -> dict[str, TensorRef]:
    weight, scales = ("U32", (64, width)), (scales_dtype, (64, groups))
    return refs(layers__0__attention__wq__weight=weight, layers__0__attention__wq__scales=scales)


# --------------------------------------------------------------------------- headers


def test_a_header_filling_the_whole_file_is_a_file_without_tensors(tmp_path: Path) -> None:
    path = raw_file(tmp_path / "empty.safetensors", {"__metadata__": None})
    assert read_safetensors_header(path) == {}


def test_a_zero_length_header_is_called_truncated(tmp_path: Path) -> None:
    path = raw_file(tmp_path / "z.safetensors", b"", b"\0" * 16)
    assert header_error(path) == (
        "<path> is truncated or not a safetensors file (header of 0 bytes, file of 24 bytes): "
        "re-download it"
    )


def test_header_numbers_must_fit_in_64_bits(tmp_path: Path) -> None:
    entry = {"dtype": "U8", "shape": [2**63], "data_offsets": [0, 2**63]}
    path = raw_file(tmp_path / "b.safetensors", {"w": entry}, b"\0" * 4)
    assert header_error(path) == (
        "<path>: malformed header entry for tensor 'w' (its dtype, shape or offsets); the "
        "file is damaged: re-download or re-convert it"
    )


# --------------------------------------------------------------------------- reading


def test_bf16_tensors_beside_a_float64_one_keep_their_values(tmp_path: Path) -> None:
    half = (np.array([1.5, -2.0], np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
    header = {
        "half": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]},
        "double": {"dtype": "F64", "shape": [1], "data_offsets": [4, 12]},
    }
    path = raw_file(tmp_path / "mixed.safetensors", header, half + np.float64(0.25).tobytes())
    arrays = load_tensors(path)
    assert arrays["half"].dtype == mx.bfloat16 and arrays["half"].tolist() == [1.5, -2.0]
    assert arrays["double"].dtype == mx.float32 and arrays["double"].tolist() == [0.25]


def test_checkpoint_dtype_counts_bytes_not_tensors(tmp_path: Path) -> None:
    tensors = {f"f32_{i}": np.ones(2, np.float32) for i in range(3)}
    path = write_file(tmp_path / "small.safetensors", tensors)
    big = write_file(tmp_path / "big.safetensors", {"big": np.ones(64, np.float32)}, "BF16")
    infos = {**read_safetensors_header(path), **read_safetensors_header(big)}
    assert checkpoint_dtype(infos) == mx.bfloat16


def test_checkpoint_dtype_without_float_tensors_is_float32(tmp_path: Path) -> None:
    path = write_file(tmp_path / "ints.safetensors", {"n": np.arange(4, dtype=np.int32)}, "I32")
    assert checkpoint_dtype(read_safetensors_header(path)) == mx.float32


# --------------------------------------------------------------------------- verification


def test_quantized_shapes_need_whole_uint32_words() -> None:
    assert quantized_shapes((8, 48), QuantSpec(bits=3, group_size=16)) is None
    assert quantized_shapes((8, 64), QuantSpec(bits=3, group_size=32)) == ((8, 6), (8, 2))


def test_verify_ignores_every_tensor_of_a_quantized_text_head(config: ModelConfig) -> None:
    shapes = {n: e.shape for n, e in expected_tensors(config).items()}
    head = {"output.weight": (2048, 8), "output.scales": (2048, 1), "output.biases": (2048, 1)}
    verify_tensors({**shapes, **head}, expected_tensors(config), "x.safetensors")


def test_wrong_dtypes_beside_wrong_shapes_blame_the_config(config: ModelConfig) -> None:
    expected = expected_tensors(config)
    shapes = {n: e.shape for n, e in expected.items()}
    shapes["norm.weight"] = (3,)
    dtypes = dict.fromkeys(shapes, "F32") | {"layers.0.ffn_norm.weight": "I32"}
    with pytest.raises(CheckpointMismatch) as exc:
        verify_tensors(shapes, expected, "x.safetensors", dtypes=dtypes)
    assert one_line(exc.value) == (
        "x.safetensors does not match params.json: 1 mis-shaped (norm.weight [3] expected [64]); "
        "1 of the wrong dtype (layers.0.ffn_norm.weight I32 expected a float). Check that "
        "params.json and the weights come from the same model."
    )


def test_mismatch_message_counts_the_misshaped_it_does_not_show(config: ModelConfig) -> None:
    expected = expected_tensors(config)
    shapes = {n: e.shape for n, e in expected.items()}
    for i in range(5):
        shapes[f"layers.{i % 2}.{'attention_norm' if i < 2 else 'ffn_norm'}.weight"] = (1,)
    shapes["norm.weight"] = (1,)
    with pytest.raises(CheckpointMismatch) as exc:
        verify_tensors(shapes, expected, "x")
    assert len(exc.value.misshaped) == 5
    assert "5 mis-shaped (" in str(exc.value) and ", ... 1 more)" in str(exc.value)


def test_some_names_adds_no_count_at_the_limit() -> None:
    assert some_names(["a", "b"], 2) == "a, b"
    assert some_names(["a", "b", "c"], 2) == "a, b, ... 1 more"


# --------------------------------------------------------------------------- files and names


@pytest.mark.parametrize("version", [0, True])
def test_format_version_must_be_a_positive_integer(version: object) -> None:
    with pytest.raises(ConfigError) as exc:
        check_format({"format": "voxtral-mlx", "format_version": version}, Path("/m"))
    assert one_line(exc.value) == (
        f"/m/config.json key 'format_version' must be a positive integer, got {version!r}: "
        "re-convert the model"
    )


def test_the_current_format_version_loads_and_the_next_is_refused() -> None:
    check_format({"format": "voxtral-mlx", "format_version": 2}, Path("/m"))
    with pytest.raises(ConfigError, match=r"format version 3; this one reads up to 2"):
        check_format({"format": "voxtral-mlx", "format_version": 3}, Path("/m"))


def test_params_nested_under_params_are_the_model_config() -> None:
    assert params_from_config({"params": {"dim": 4}, "multimodal": {}}) == {"dim": 4}


def test_old_mlx_audio_backbone_names_rename() -> None:
    name = "language_model.model.layers.0.mlp.gate_proj.weight"
    assert to_mistral_name(name) == "layers.0.feed_forward.w1.weight"
    assert to_mistral_name("language_model.model.norm.weight") == "norm.weight"


def test_an_audio_table_alone_marks_mlx_audio_names() -> None:
    assert uses_mlx_audio_names(["audio_codebook_embeddings.embeddings.weight"])
    assert not uses_mlx_audio_names(["mm_audio_embeddings.tok_embeddings.weight"])


def test_hidden_safetensors_files_are_not_weights(tmp_path: Path) -> None:
    for name in (".model.safetensors", "weights.safetensors", "consolidated.safetensors"):
        write_file(tmp_path / name, {"a": np.zeros(1, np.float32)})
    assert loose_weight_files(tmp_path) == [tmp_path / "weights.safetensors"]


def test_model_safetensors_comes_with_the_shards_beside_it(tmp_path: Path) -> None:
    for name in ("model.safetensors", "model-00001-of-00001.safetensors"):
        write_file(tmp_path / name, {name: np.zeros(1, np.float32)})
    files, index = weight_files(tmp_path)
    assert [p.name for p in files] == ["model.safetensors", "model-00001-of-00001.safetensors"]
    assert index is None


def test_an_empty_first_shard_left_out_of_the_index_is_fine(tmp_path: Path) -> None:
    raw_file(tmp_path / "model-00001-of-00002.safetensors", {})
    write_file(tmp_path / "model-00002-of-00002.safetensors", {"a": np.zeros(1, np.float32)})
    weight_map = {"a": "model-00002-of-00002.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert weight_files(tmp_path) == ([tmp_path / "model-00002-of-00002.safetensors"], weight_map)


def test_a_missing_shard_is_an_incomplete_download(tmp_path: Path) -> None:
    write_file(tmp_path / "model-00001-of-00002.safetensors", {"a": np.zeros(1, np.float32)})
    with pytest.raises(ModelNotFoundError) as exc:
        weight_files(tmp_path)
    assert str(exc.value) == (
        f"{tmp_path} is missing model-00002-of-00002.safetensors: the download is incomplete; "
        "fetch it again"
    )


def test_an_empty_weight_map_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors.index.json"
    path.write_text('{"weight_map": {}}')
    with pytest.raises(CheckpointError, match=r"lists no tensors \(its 'weight_map' is empty\)"):
        read_index(path)


@pytest.mark.parametrize("file", ["sub\\model.safetensors", ".model.safetensors"])
def test_an_index_naming_a_file_elsewhere_is_refused(tmp_path: Path, file: str) -> None:
    path = tmp_path / "model.safetensors.index.json"
    path.write_text(json.dumps({"weight_map": {"a": file}}))
    with pytest.raises(CheckpointError, match="which is not a safetensors file of this directory"):
        read_index(path)


def test_consolidated_weights_win_over_mlx_files_without_a_config_json(tmp_path: Path) -> None:
    for name in ("consolidated.safetensors", "model.safetensors"):
        write_file(tmp_path / name, {"norm.weight": np.zeros(1, np.float32)})
    assert find_weight_files(tmp_path) == ("mistral", [tmp_path / "consolidated.safetensors"], None)


def test_a_stray_voice_file_beside_consolidated_weights_is_no_conversion(tmp_path: Path) -> None:
    write_file(tmp_path / "consolidated.safetensors", {"norm.weight": np.zeros(1, np.float32)})
    write_file(tmp_path / "casual_male.safetensors", {"embedding": np.zeros(1, np.float32)})
    (tmp_path / "config.json").write_text("{}")
    assert find_weight_files(tmp_path) == ("mistral", [tmp_path / "consolidated.safetensors"], None)


def test_a_tensor_in_two_files_is_refused(tmp_path: Path) -> None:
    a = write_file(tmp_path / "a.safetensors", {"norm.weight": np.zeros(1, np.float32)})
    b = write_file(tmp_path / "b.safetensors", {"norm.weight": np.zeros(1, np.float32)})
    with pytest.raises(CheckpointError) as exc:
        _read_headers([a, b], None, tmp_path)
    assert str(exc.value) == (
        "tensor 'norm.weight' is in both a.safetensors and b.safetensors: remove the stale "
        "file or re-download the model"
    )


def test_an_index_putting_a_tensor_in_the_wrong_file_is_refused(tmp_path: Path) -> None:
    a = write_file(tmp_path / "a.safetensors", {"norm.weight": np.zeros(1, np.float32)})
    b = write_file(tmp_path / "b.safetensors", {"x": np.zeros(1, np.float32)})
    with pytest.raises(CheckpointError, match=r"puts 'norm.weight' in b.safetensors but that"):
        _read_headers([a, b], {"norm.weight": "b.safetensors", "x": "b.safetensors"}, tmp_path)


def test_two_names_for_one_tensor_are_refused(tmp_path: Path) -> None:
    keys = ["language_model.model.model.norm.weight", "language_model.model.norm.weight"]
    path = write_file(tmp_path / "m.safetensors", dict.fromkeys(keys, np.zeros(1, np.float32)))
    with pytest.raises(CheckpointError) as exc:
        _rename_refs(_read_headers([path], None, tmp_path))
    assert "both map to 'norm.weight': the weights are not a Voxtral TTS checkpoint" in str(
        exc.value
    )


# --------------------------------------------------------------------------- quantization section


def quant(section: dict, key: str = "quantization") -> QuantConfig | None:
    return read_quantization({key: section}, rename=False)


def test_quantization_config_is_read_when_quantization_is_absent() -> None:
    q = quant({"bits": 4, "group_size": 64}, key="quantization_config")
    assert q == QuantConfig(4, 64, "affine", {})


def test_quantization_bits_of_zero_are_refused() -> None:
    with pytest.raises(ConfigError) as exc:
        quant({"bits": 0, "group_size": 64})
    assert str(exc.value) == "config.json key 'quantization.bits' must be a positive integer, got 0"


@pytest.mark.parametrize(
    ("entry", "field", "shown"),
    [
        ({"bits": 0, "group_size": 0}, "bits", "0"),
        (0, "bits", "0"),
        ({"bits": False}, "bits", "False"),
        ({"group_size": 0}, "group_size", "0"),
    ],
)
def test_a_layers_zero_bits_or_group_size_is_refused_not_defaulted(
    entry: object, field: str, shown: str
) -> None:
    """As at the section's level: a 0 is no "not given" (it once took the section's 4 / 64)."""
    with pytest.raises(ConfigError) as exc:
        quant({"bits": 4, "group_size": 64, "layers": {WQ: entry}})
    assert str(exc.value) == (
        f"config.json key 'quantization.{WQ}.{field}' must be a positive integer, got {shown}"
    )


def test_components_summary_is_not_a_layer() -> None:
    q = quant({"bits": 4, "group_size": 64, "components": {"backbone": 4}})
    assert q is not None and q.layers == {}


def test_a_true_entry_takes_the_sections_mode_bits_and_group() -> None:
    q = quant({"mode": "affine", "bits": 8, "group_size": 32, WQ: True})
    assert q is not None and q.layers == {WQ: LayerQuant(8, 32, "affine")}


def test_an_mlx_lm_entry_defaults_as_to_quantized_does() -> None:
    q = quant({"mode": "mxfp8", "bits": 8, "group_size": 32, WQ: {}})
    assert q is not None and q.layers == {WQ: LayerQuant(4, 64, "affine")}


def test_an_entry_of_the_layers_map_defaults_to_the_section() -> None:
    q = quant({"bits": 8, "group_size": 32, WQ: {"bits": 3}, "layers": {WQ: {"bits": 3}}})
    assert q is not None and q.layers == {WQ: LayerQuant(3, 32, "affine")}


def test_a_false_entry_leaves_its_layer_unquantized() -> None:
    q = quant({"bits": 4, "group_size": 64, WQ: False})
    assert q is not None and q.layers == {WQ: None}


# --------------------------------------------------------------------------- quantized layers


def test_widths_that_are_no_whole_bit_count_are_not_inferred(config: ModelConfig) -> None:
    base = expected_tensors(config)
    assert _infer_spec(WQ, packed_wq(width=3, groups=2), base) is None
    assert _infer_spec(WQ, packed_wq(width=8, groups=2), base) == QuantSpec(4, 32)


def test_uint8_scales_name_a_float_mode(config: ModelConfig) -> None:
    spec = _infer_spec(
        WQ, packed_wq(width=8, groups=2, scales_dtype="U8"), expected_tensors(config)
    )
    assert spec == QuantSpec(4, 32, "mxfp4")


def test_affine_group_size_16_is_refused(config: ModelConfig) -> None:
    with pytest.raises(CheckpointError) as exc:
        _quantized_layers(packed_wq(width=8, groups=4), None, expected_tensors(config), "src")
    assert "layer 'layers.0.attention.wq' is quantized with 4 bits and group size 16" in str(
        exc.value
    )


def test_a_section_giving_only_the_group_size_agrees_with_the_shapes(config: ModelConfig) -> None:
    qconfig = QuantConfig(bits=None, group_size=32, mode="affine", layers={})
    got = _quantized_layers(packed_wq(width=8, groups=2), qconfig, expected_tensors(config), "src")
    assert got == {WQ: QuantSpec(4, 32)}


def test_a_section_disagreeing_with_the_packed_shapes_is_blamed(config: ModelConfig) -> None:
    qconfig = QuantConfig(bits=8, group_size=32, mode="affine", layers={})
    with pytest.raises(CheckpointError) as exc:
        _quantized_layers(packed_wq(width=8, groups=2), qconfig, expected_tensors(config), "src")
    assert str(exc.value) == (
        "src: config.json's quantization section gives layer 'layers.0.attention.wq' 8 bits and "
        "group size 32, but its tensors are 4 bits and group size 32: correct config.json (or "
        "remove its quantization section: the format is then read off the tensors), or "
        "re-download the model"
    )


def test_a_layer_with_other_rows_is_left_to_verification(config: ModelConfig) -> None:
    """63 rows where params.json implies 64: the shapes are wrong, not config.json's bits."""
    tensors = refs(
        layers__0__attention__wq__weight=("U32", (63, 8)),
        layers__0__attention__wq__scales=("BF16", (63, 2)),
    )
    qconfig = QuantConfig(bits=8, group_size=32, mode="affine", layers={})
    got = _quantized_layers(tensors, qconfig, expected_tensors(config), "src")
    assert got == {WQ: QuantSpec(8, 32)}


def test_a_layer_the_section_leaves_unquantized_must_not_be_packed(config: ModelConfig) -> None:
    qconfig = QuantConfig(bits=4, group_size=32, mode="affine", layers={WQ: None})
    with pytest.raises(
        CheckpointError, match=r"leaves layer 'layers\.0\.attention\.wq' unquantized"
    ):
        _quantized_layers(packed_wq(width=8, groups=2), qconfig, expected_tensors(config), "src")


def test_a_float_mode_with_other_bits_than_its_own_is_refused(config: ModelConfig) -> None:
    qconfig = QuantConfig(4, 32, "affine", {WQ: LayerQuant(8, 32, "mxfp4")})
    with pytest.raises(CheckpointError) as exc:
        _quantized_layers(packed_wq(width=3, groups=2), qconfig, expected_tensors(config), "src")
    assert str(exc.value) == (
        "src: layer 'layers.0.attention.wq' is quantized in mode mxfp4 with 8 bits and group "
        "size 32, but mxfp4 has 4 bits and group size 32: re-convert it"
    )


def test_an_unknown_quantization_mode_is_refused(config: ModelConfig) -> None:
    qconfig = QuantConfig(bits=4, group_size=32, mode="q4k", layers={})
    with pytest.raises(CheckpointError, match=r"uses quantization mode 'q4k', which MLX does"):
        _quantized_layers(packed_wq(width=8, groups=2), qconfig, expected_tensors(config), "src")


def test_a_quantized_text_head_is_no_layer_to_quantize(config: ModelConfig) -> None:
    head = refs(output__weight=("U32", (2048, 8)), output__scales=("BF16", (2048, 2)))
    qconfig = QuantConfig(bits=4, group_size=32, mode="affine", layers={})
    assert _quantized_layers(head, qconfig, expected_tensors(config), "src") == {}


@pytest.mark.parametrize(
    "tensors",
    [
        refs(layers__0__attention__wq__biases=("BF16", (64, 2))),
        refs(layers__0__attention__wq__weight=("U32", (64, 8))),
    ],
    ids=["biases", "packed-weight"],
)
def test_quantized_tensors_without_scales_are_a_damaged_file(
    config: ModelConfig, tensors: dict[str, TensorRef]
) -> None:
    with pytest.raises(CheckpointError) as exc:
        _quantized_layers(tensors, None, expected_tensors(config), "src")
    assert str(exc.value) == (
        "src: layer 'layers.0.attention.wq' has quantized weights but no .scales: the file is "
        "incomplete; re-download or re-convert the model"
    )


# --------------------------------------------------------------------------- config and tokenizer


def test_configs_differing_in_voice_names_only_agree(config: ModelConfig) -> None:
    other = dataclasses.replace(config, voice_index={"someone": 0})
    assert _first_difference(config, other) is None


class _Tokenizer:
    """What check_tokenizer asks of a tokenizer: the config's special ids, ``vocab_size``."""

    def __init__(self, config: ModelConfig, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.ids = {
            "<s>": config.bos_token_id,
            "[AUDIO]": config.audio_token_id,
            "[BEGIN_AUDIO]": config.begin_audio_token_id,
        }

    def special_id(self, token: str) -> int:
        return self.ids.get(token, 5)


def test_a_tokenizer_one_id_larger_than_the_vocabulary_is_refused(config: ModelConfig) -> None:
    vocab = config.backbone.vocab_size
    check_tokenizer(config, _Tokenizer(config, vocab))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=rf"tekken.json has {vocab + 1} ids but params.json"):
        check_tokenizer(config, _Tokenizer(config, vocab + 1))  # type: ignore[arg-type]
