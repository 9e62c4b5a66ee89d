"""ModelConfig from Mistral's params.json: real values, unknown keys, missing and bad keys."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.spec_reference import codec_windows
from voxtral_mlx.config import MAX_DECODING_STEPS, MAX_WINDOW, ModelConfig
from voxtral_mlx.errors import ConfigError
from voxtral_mlx.synthetic.checkpoint import REAL_PARAMS, make_params

REFERENCE = Path(__file__).with_name("data") / "reference"
PARAMS_JSON = REFERENCE / "params.json"

AM = "multimodal.audio_model_args"
ENC = f"{AM}.audio_encoding_args"
AT = f"{AM}.acoustic_transformer_args"
TOK = "multimodal.audio_tokenizer_args"

# Keys the model cannot be built without (no sensible default exists).
REQUIRED_KEYS = [
    "dim",
    "n_layers",
    "head_dim",
    "hidden_dim",
    "n_heads",
    "n_kv_heads",
    "rope_theta",
    "norm_eps",
    "vocab_size",
    "multimodal",
    AM,
    f"{AM}.semantic_codebook_size",
    f"{AM}.acoustic_codebook_size",
    f"{AM}.n_acoustic_codebook",
    f"{AM}.audio_token_id",
    f"{AM}.begin_audio_token_id",
    ENC,
    f"{ENC}.num_codebooks",
    f"{ENC}.sampling_rate",
    f"{ENC}.frame_rate",
    AT,
    f"{AT}.dim",
    f"{AT}.n_layers",
    f"{AT}.head_dim",
    f"{AT}.hidden_dim",
    f"{AT}.n_heads",
    f"{AT}.n_kv_heads",
    TOK,
    f"{TOK}.sampling_rate",
    f"{TOK}.pretransform_patch_size",
    f"{TOK}.patch_proj_kernel_size",
    f"{TOK}.semantic_codebook_size",
    f"{TOK}.semantic_dim",
    f"{TOK}.acoustic_codebook_size",
    f"{TOK}.acoustic_dim",
    f"{TOK}.attn_sliding_window_size",
    f"{TOK}.dim",
    f"{TOK}.hidden_dim",
    f"{TOK}.head_dim",
    f"{TOK}.n_heads",
    f"{TOK}.n_kv_heads",
    f"{TOK}.norm_eps",
    f"{TOK}.decoder_transformer_lengths_str",
    f"{TOK}.decoder_convs_kernels_str",
    f"{TOK}.decoder_convs_strides_str",
]


def real_params() -> dict[str, Any]:
    return json.loads(PARAMS_JSON.read_text())


def key_paths(d: dict[str, Any], prefix: str = "") -> Iterator[str]:
    """Every key of a nested dict as a dotted path, parents before children."""
    for key, value in d.items():
        path = f"{prefix}.{key}" if prefix else key
        yield path
        if isinstance(value, dict):
            yield from key_paths(value, path)


def parent_of(params: dict[str, Any], path: str) -> tuple[dict[str, Any], str]:
    *parents, leaf = path.split(".")
    node = params
    for p in parents:
        node = node[p]
    return node, leaf


def with_value(path: str, value: Any, params: dict[str, Any] | None = None) -> dict[str, Any]:
    params = copy.deepcopy(real_params() if params is None else params)
    node, leaf = parent_of(params, path)
    node[leaf] = value
    return params


def without(path: str) -> dict[str, Any]:
    params = real_params()
    node, leaf = parent_of(params, path)
    del node[leaf]
    return params


def config_error(params: Any) -> str:
    with pytest.raises(ConfigError) as exc:
        ModelConfig.from_params(params)
    return one_line(exc.value)


def one_line(e: BaseException) -> str:
    text = str(e)
    assert text and "\n" not in text and "\r" not in text, repr(text)
    return text


@pytest.fixture(scope="module")
def real() -> ModelConfig:
    return ModelConfig.from_file(PARAMS_JSON)


# --------------------------------------------------------------------------- the real file


def test_real_backbone(real: ModelConfig) -> None:
    b = real.backbone
    assert (b.dim, b.n_layers, b.head_dim, b.hidden_dim) == (3072, 26, 128, 9216)
    assert (b.n_heads, b.n_kv_heads, b.vocab_size) == (32, 8, 131072)
    assert b.rope_theta == 1e6 and b.norm_eps == 1e-5


def test_real_flow_head(real: ModelConfig) -> None:
    f = real.flow
    assert (f.input_dim, f.dim, f.n_layers, f.head_dim, f.hidden_dim) == (3072, 3072, 3, 128, 9216)
    assert (f.n_heads, f.n_kv_heads) == (32, 8)
    assert f.norm_eps == 1e-5 and f.sigma_max == 1.0
    assert f.n_decoding_steps == 7  # no key in params.json: Mistral's default
    assert (f.semantic_codebook_size, f.acoustic_codebook_size, f.n_acoustic_codebook) == (
        8192,
        21,
        36,
    )
    assert f.semantic_output_rows == 8320


def test_real_codec(real: ModelConfig) -> None:
    c = real.codec
    assert (c.dim, c.hidden_dim, c.head_dim, c.n_heads, c.n_kv_heads) == (1024, 4096, 128, 8, 8)
    assert c.norm_eps == 0.01 and c.qk_norm_eps == 1e-6
    assert c.qk_norm and c.layer_scale and c.half_attn_window_upon_downsampling
    assert (c.patch_size, c.patch_proj_kernel_size) == (240, 7)
    assert (c.semantic_codebook_size, c.semantic_dim, c.acoustic_codebook_size, c.acoustic_dim) == (
        8192,
        256,
        21,
        36,
    )
    # the comma-separated strings are parsed (unparsed they would give a codec with no blocks)
    assert c.transformer_lengths == (2, 2, 2, 2)
    assert c.conv_kernels == (3, 4, 4, 4)
    assert c.conv_strides == (1, 2, 2, 2)
    assert c.n_stages == 4 and c.upsample == 8 and c.codebook_dim == 292
    assert c.attn_sliding_window_size == 16
    assert c.windows == (2, 4, 8, 16)
    assert c.samples_per_frame == 1920 and c.sampling_rate == 24000


def test_real_top_level(real: ModelConfig) -> None:
    assert real.sampling_rate == 24000 and real.frame_rate == 12.5
    assert real.samples_per_frame == 1920
    assert real.num_codebooks == 37
    assert (real.bos_token_id, real.audio_token_id, real.begin_audio_token_id) == (1, 24, 25)
    assert real.audio_embedding_rows == 8194 + 36 * 23 == 9022
    offsets = real.codebook_offsets
    assert len(offsets) == 37
    assert offsets[:3] == (0, 8194, 8217)
    assert offsets == (0, *(8194 + 23 * (k - 1) for k in range(1, 37)))


def test_real_voice_index(real: ModelConfig) -> None:
    voices = json.loads((REFERENCE / "voices.json").read_text())
    assert real.voice_index == voices["params_voice_index"]
    assert len(real.voice_index) == 20
    assert real.voice_index["casual_female"] == 0 and real.voice_index["hi_female"] == 19


def test_from_file_equals_from_params(real: ModelConfig) -> None:
    assert ModelConfig.from_params(real_params()) == real


def test_synthetic_full_params_are_the_real_file() -> None:
    """The test checkpoints are built from REAL_PARAMS: it must be the published file."""
    assert real_params() == REAL_PARAMS
    assert make_params("full") == real_params()


@pytest.mark.parametrize("size", ["tiny", "wide", "full"])
def test_synthetic_sizes_parse(size: str) -> None:
    config = ModelConfig.from_params(make_params(size))
    assert config.samples_per_frame == 1920
    assert config.num_codebooks == 37 and config.codec.n_stages == 4


def test_n_decoding_steps_is_read_when_present() -> None:
    config = ModelConfig.from_params(with_value(f"{AT}.n_decoding_steps", 16))
    assert config.flow.n_decoding_steps == 16


def test_input_params_are_not_mutated() -> None:
    params = real_params()
    before = copy.deepcopy(params)
    ModelConfig.from_params(params)
    assert params == before


# ------------------------------------------------------------------------ unknown / optional keys


def test_unknown_keys_are_ignored(real: ModelConfig) -> None:
    params = real_params()
    params["some_future_key"] = {"nested": [1, 2, 3]}
    params["multimodal"]["whatever"] = "x"
    params["multimodal"]["audio_model_args"]["new_flag"] = True
    params["multimodal"]["audio_model_args"]["audio_encoding_args"]["extra"] = None
    params["multimodal"]["audio_model_args"]["acoustic_transformer_args"]["rope_scaling"] = {}
    params["multimodal"]["audio_tokenizer_args"]["encoder_stuff_str"] = "not,numbers"
    assert ModelConfig.from_params(params) == real


OPTIONAL_KEYS = [
    p
    for p in key_paths(real_params())
    if p not in REQUIRED_KEYS and not p.startswith(f"{TOK}.voice")
]


@pytest.mark.parametrize("path", OPTIONAL_KEYS)
def test_optional_keys_default_to_the_real_values(path: str, real: ModelConfig) -> None:
    """Every key not in REQUIRED_KEYS may be absent; its default is the published value."""
    assert ModelConfig.from_params(without(path)) == real


def test_missing_voice_map_gives_empty_index() -> None:
    assert ModelConfig.from_params(without(f"{TOK}.voice")).voice_index == {}


# --------------------------------------------------------------------------- missing keys


def test_required_key_list_is_complete() -> None:
    """Guard against typos in REQUIRED_KEYS: every entry is in the real file."""
    assert set(REQUIRED_KEYS) <= set(key_paths(real_params()))


@pytest.mark.parametrize("path", REQUIRED_KEYS)
def test_missing_required_key_names_its_full_path(path: str) -> None:
    message = config_error(without(path))
    assert f"'{path}'" in message
    assert "missing" in message


# --------------------------------------------------------------------------- wrong types


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("dim", "3072"),  # string for an int
        ("n_layers", True),  # bool for an int
        ("n_heads", 32.5),
        ("vocab_size", None),
        ("head_dim", [128]),
        ("rope_theta", "1e6"),  # string for a float
        ("norm_eps", True),  # bool for a float
        ("rope_theta", float("nan")),
        ("norm_eps", float("inf")),
        (f"{AT}.n_layers", "3"),
        (f"{AT}.n_kv_heads", False),
        (f"{AT}.n_decoding_steps", "7"),
        (f"{AM}.audio_token_id", "24"),
        (f"{AM}.n_acoustic_codebook", True),
        (f"{ENC}.frame_rate", "12.5"),
        (f"{ENC}.num_codebooks", 37.5),
        (f"{TOK}.dim", "1024"),
        (f"{TOK}.n_heads", True),
        (f"{TOK}.qk_norm", 1),  # int for a bool
        (f"{TOK}.use_biases", "false"),
        (f"{TOK}.decoder_convs_strides_str", [1, 2, 2, 2]),  # must be the published string
        (f"{TOK}.decoder_transformer_lengths_str", 2),
    ],
)
def test_wrong_type_names_the_key(path: str, value: Any) -> None:
    message = config_error(with_value(path, value))
    assert f"'{path}'" in message


def test_integral_float_is_accepted_for_an_int() -> None:
    """JSON writers may emit 3072.0; it means 3072."""
    assert ModelConfig.from_params(with_value("dim", 3072.0)).backbone.dim == 3072


@pytest.mark.parametrize(
    ("path", "limit"),
    [
        (f"{AT}.n_decoding_steps", MAX_DECODING_STEPS),
        (f"{TOK}.attn_sliding_window_size", MAX_WINDOW),
    ],
)
def test_sizes_of_buffers_built_from_the_config_are_bounded(path: str, limit: int) -> None:
    """No tensor's shape checks these: a huge value allocated its buffer and crashed. The
    limit itself is taken as written (the codec windows as Mistral derives them from it:
    tests/spec_reference.codec_windows)."""
    params = with_value(path, limit)
    config = ModelConfig.from_params(params)
    assert config.flow.n_decoding_steps == (limit if path.startswith(AT) else 7)
    codec = params["multimodal"]["audio_tokenizer_args"]
    assert config.codec.attn_sliding_window_size == codec["attn_sliding_window_size"]
    assert config.codec.windows == tuple(codec_windows(codec))
    if path.startswith(TOK):
        assert config.codec.windows == (limit // 8, limit // 4, limit // 2, limit)
    for value in (limit + 1, 10**9):
        message = config_error(with_value(path, value))
        assert f"key '{path}' must be between 1 and {limit}" in message


def test_messages_name_the_file_the_keys_came_from() -> None:
    for params, words in [
        (with_value("dim", "64"), "config.json key 'dim' must be an integer"),
        (without("dim"), "config.json is missing required key 'dim'"),
        (with_value(f"{AT}.n_kv_heads", 3), f"config.json key '{AT}.n_kv_heads' is inconsistent"),
        (with_value(AT, 5), f"config.json key '{AT}' must be a JSON object"),
        ([], "config.json must be a JSON object"),
    ]:
        with pytest.raises(ConfigError) as exc:
            ModelConfig.from_params(params, "config.json")
        message = one_line(exc.value)
        assert words in message and "params.json" not in message
        assert message.endswith(
            "; restore config.json from the model's download (or correct that value)"
        ), message


@pytest.mark.parametrize("params", [[], "params", 5, None], ids=["list", "str", "int", "null"])
def test_top_level_must_be_an_object(params: Any) -> None:
    assert "JSON object" in config_error(params)


@pytest.mark.parametrize("path", ["multimodal", AM, ENC, AT, TOK])
def test_section_must_be_an_object(path: str) -> None:
    message = config_error(with_value(path, [1, 2]))
    assert path in message and "JSON object" in message


# --------------------------------------------------------------------------- bad values


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("dim", 0),
        ("n_layers", -1),
        ("head_dim", 0),
        ("hidden_dim", -9216),
        ("n_heads", 0),
        ("n_kv_heads", -8),
        ("vocab_size", 0),
        ("rope_theta", -1e6),
        ("norm_eps", 0.0),
        (f"{AT}.dim", 0),
        (f"{AT}.n_layers", 0),
        (f"{AT}.n_decoding_steps", 0),
        (f"{AT}.sigma_max", -1.0),
        (f"{AM}.semantic_codebook_size", 0),
        (f"{AM}.n_acoustic_codebook", -36),
        (f"{ENC}.frame_rate", 0),
        (f"{ENC}.sampling_rate", -24000),
        (f"{ENC}.num_codebooks", 0),
        (f"{TOK}.dim", 0),
        (f"{TOK}.n_heads", -8),
        (f"{TOK}.norm_eps", -0.01),
        (f"{TOK}.attn_sliding_window_size", 0),
        (f"{TOK}.pretransform_patch_size", -240),
        (f"{TOK}.patch_proj_kernel_size", 0),
        (f"{TOK}.semantic_dim", 0),
    ],
)
def test_non_positive_size_names_the_key(path: str, value: Any) -> None:
    message = config_error(with_value(path, value))
    assert f"'{path}'" in message


@pytest.mark.parametrize(
    ("section", "changes"),
    [
        ("", {"n_heads": 5, "n_kv_heads": 5}),  # 3072 % 5 != 0
        (AT, {"n_heads": 5, "n_kv_heads": 1}),
        (TOK, {"n_heads": 5, "n_kv_heads": 5}),  # 1024 % 5 != 0
        (TOK, {"dim": 1020}),  # 1020 % 8 != 0
    ],
    ids=["backbone", "flow", "codec-heads", "codec-dim"],
)
def test_dim_need_not_be_a_multiple_of_the_head_count(
    section: str, changes: dict[str, int]
) -> None:
    """wq/wo carry n_heads * head_dim channels whatever dim is (the real backbone has
    32 x 128 = 4096 on a 3072 stream): a head count that does not divide dim is valid."""
    params = real_params()
    node = parent_of(params, f"{section}.x")[0] if section else params
    node.update(changes)
    config = ModelConfig.from_params(params)
    args = {"": config.backbone, AT: config.flow, TOK: config.codec}[section]
    assert (args.dim, args.n_heads) == (node["dim"], node["n_heads"])


@pytest.mark.parametrize("section", ["", AT, TOK])
def test_heads_not_multiple_of_kv_heads(section: str) -> None:
    prefix = f"{section}." if section else ""
    message = config_error(with_value(f"{prefix}n_kv_heads", 3))
    assert f"'{prefix}n_kv_heads'" in message
    assert "n_heads" in message


@pytest.mark.parametrize(
    "key",
    ["decoder_transformer_lengths_str", "decoder_convs_kernels_str", "decoder_convs_strides_str"],
)
@pytest.mark.parametrize("value", ["2,2,2", "2,2,2,2,2"])
def test_stage_lists_of_different_lengths(key: str, value: str) -> None:
    params = real_params()
    codec = params["multimodal"]["audio_tokenizer_args"]
    codec[key] = {
        "decoder_transformer_lengths_str": value,
        "decoder_convs_kernels_str": value.replace("2", "4"),
        "decoder_convs_strides_str": value,
    }[key]
    message = config_error(params)
    assert TOK in message and key in message


@pytest.mark.parametrize(
    "key",
    ["decoder_transformer_lengths_str", "decoder_convs_kernels_str", "decoder_convs_strides_str"],
)
@pytest.mark.parametrize(
    "value", ["2,x,2,2", "", "2,,2,2", "2;2;2;2", "1.5,2,2,2", "0,2,2,2", "-1,2,2,2", ","]
)
def test_malformed_stage_list_names_the_key(key: str, value: str) -> None:
    message = config_error(with_value(f"{TOK}.{key}", value))
    assert f"'{TOK}.{key}'" in message
    assert repr(value) in message


def test_stage_list_with_spaces_is_accepted() -> None:
    config = ModelConfig.from_params(with_value(f"{TOK}.decoder_convs_kernels_str", "3, 4, 4, 4"))
    assert config.codec.conv_kernels == (3, 4, 4, 4)


def test_kernel_smaller_than_stride() -> None:
    message = config_error(with_value(f"{TOK}.decoder_convs_kernels_str", "3,4,1,4"))
    assert f"'{TOK}.decoder_convs_kernels_str'" in message and "stage 2" in message


@pytest.mark.parametrize("value", [36, 38, 1])
def test_num_codebooks_must_be_one_plus_acoustic(value: int) -> None:
    message = config_error(with_value(f"{ENC}.num_codebooks", value))
    assert f"'{ENC}.num_codebooks'" in message and "37" in message


def test_acoustic_dim_must_equal_n_acoustic_codebook() -> None:
    message = config_error(with_value(f"{TOK}.acoustic_dim", 35))
    assert f"'{TOK}.acoustic_dim'" in message


@pytest.mark.parametrize(
    "path, value",
    [
        (f"{ENC}.frame_rate", 25.0),
        (f"{ENC}.frame_rate", 12.0),
        (f"{ENC}.sampling_rate", 16000),  # and the codec's stays 24000: caught either way
        (f"{TOK}.pretransform_patch_size", 480),
        (f"{TOK}.decoder_convs_strides_str", "1,2,2,4"),
    ],
)
def test_frame_rate_must_match_patch_size_times_strides(path: str, value: Any) -> None:
    message = config_error(with_value(path, value))
    assert "frame_rate" in message or "sampling_rate" in message


def test_frame_rate_error_names_the_frame_rate_key() -> None:
    message = config_error(with_value(f"{ENC}.frame_rate", 25.0))
    assert f"'{ENC}.frame_rate'" in message
    assert "1920" in message or "960" in message


def test_consistent_non_default_frame_rate_is_accepted() -> None:
    params = with_value(f"{ENC}.frame_rate", 25.0)
    params = with_value(f"{TOK}.pretransform_patch_size", 120, params)
    config = ModelConfig.from_params(params)
    assert config.samples_per_frame == 960


@pytest.mark.parametrize(
    "path, value",
    [
        (f"{TOK}.semantic_codebook_size", 4096),
        (f"{TOK}.acoustic_codebook_size", 20),
        (f"{TOK}.sampling_rate", 22050),
        (f"{AT}.input_dim", 4096),
    ],
)
def test_cross_section_mismatch_names_the_key(path: str, value: Any) -> None:
    assert f"'{path}'" in config_error(with_value(path, value))


@pytest.mark.parametrize("path", ["use_biases", f"{AT}.use_biases", f"{TOK}.use_biases"])
def test_use_biases_true_is_refused(path: str) -> None:
    message = config_error(with_value(path, True))
    assert f"'{path}'" in message and "bias" in message


@pytest.mark.parametrize(
    "path, value",
    [
        ("causal", False),
        (f"{TOK}.causal", False),
        (f"{AM}.input_embedding_concat_type", "concat"),
        (f"{ENC}.codebook_pattern", "delay"),
        (f"{TOK}.channels", 2),
    ],
)
def test_a_model_variant_that_is_not_implemented_is_refused(path: str, value: Any) -> None:
    """A params.json selecting a variant this code does not implement is refused, naming the
    key (all but channels were read by nobody: such a file loaded and spoke as the release's
    model)."""
    message = config_error(with_value(path, value))
    assert f"'{path}'" in message and "restore params.json" in message
    assert (str(value).lower() if isinstance(value, bool) else repr(value)) in message


def test_flow_dim_must_equal_input_dim() -> None:
    # The semantic head is [rows, flow dim] and reads the backbone's hidden state.
    params = make_params("tiny", dim=96)
    params["n_heads"], params["n_kv_heads"] = 6, 3
    params["multimodal"]["audio_model_args"]["acoustic_transformer_args"]["dim"] = 64
    message = config_error(params)
    assert f"'{AT}.dim'" in message or f"'{AT}.input_dim'" in message


# --------------------------------------------------------------------------- the file itself


def test_invalid_json_reports_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "params.json"
    path.write_text('{\n    "dim": 3072,\n    "n_layers": ,\n}\n')
    with pytest.raises(ConfigError) as exc:
        ModelConfig.from_file(path)
    message = one_line(exc.value)
    assert "line 3, column 17" in message
    assert str(path) in message


@pytest.mark.parametrize("content", ["", "{", '{"dim": 3072', "nul"], ids=repr)
def test_empty_or_cut_json(tmp_path: Path, content: str) -> None:
    path = tmp_path / "params.json"
    path.write_text(content)
    with pytest.raises(ConfigError) as exc:
        ModelConfig.from_file(path)
    assert "line 1" in one_line(exc.value)


def test_truncated_real_file(tmp_path: Path) -> None:
    path = tmp_path / "params.json"
    path.write_bytes(PARAMS_JSON.read_bytes()[:1500])
    with pytest.raises(ConfigError) as exc:
        ModelConfig.from_file(path)
    assert "not valid JSON" in one_line(exc.value)


def test_missing_file_names_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as exc:
        ModelConfig.from_file(tmp_path / "params.json")
    message = one_line(exc.value)
    assert str(tmp_path / "params.json") in message and "not found" in message


def test_directory_instead_of_file(tmp_path: Path) -> None:
    (tmp_path / "params.json").mkdir()
    with pytest.raises(ConfigError) as exc:
        ModelConfig.from_file(tmp_path / "params.json")
    assert one_line(exc.value).startswith(f"cannot read {tmp_path / 'params.json'}")


def test_non_utf8_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "params.json"
    path.write_bytes(b'{"dim": 3072, "\xff\xfe": 1}')
    with pytest.raises(ConfigError) as exc:
        ModelConfig.from_file(path)
    assert "params.json" in one_line(exc.value)


def test_from_file_accepts_str_path() -> None:
    assert ModelConfig.from_file(str(PARAMS_JSON)).backbone.n_layers == 26


@pytest.mark.parametrize(
    "content",
    ["[" * 100_000 + "]" * 100_000, '{"dim": ' + "9" * 5000 + "}"],
    ids=["nested-100000-deep", "5000-digit-number"],
)
def test_pathological_json_is_a_config_error(tmp_path: Path, content: str) -> None:
    """json raises RecursionError / ValueError (not JSONDecodeError) for these."""
    path = tmp_path / "params.json"
    path.write_text(content)
    with pytest.raises(ConfigError) as exc:
        ModelConfig.from_file(path)
    assert str(path) in one_line(exc.value)


def test_byte_order_mark_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "params.json"
    path.write_bytes(b"\xef\xbb\xbf" + PARAMS_JSON.read_bytes())
    assert ModelConfig.from_file(path) == ModelConfig.from_file(PARAMS_JSON)


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (f"{TOK}.pretransform_patch_size", 1e308),  # an integral float: was an OverflowError
        (f"{TOK}.pretransform_patch_size", 10**30),
        ("dim", 2**31),
        ("n_layers", 1_000_000),  # took minutes and gigabytes before failing
        (f"{AT}.n_layers", 5000),
        (f"{AM}.n_acoustic_codebook", 10**6),
        (f"{TOK}.decoder_transformer_lengths_str", "2,2,2,100000"),
        (f"{TOK}.decoder_convs_strides_str", "1,2,2,99999999999999999999"),
        (f"{TOK}.decoder_convs_strides_str", ",".join(["2"] * 1000)),
    ],
)
def test_absurdly_large_values_name_the_key(path: str, value: Any) -> None:
    message = config_error(with_value(path, value))
    assert f"'{path}'" in message and len(message) < 300


def test_a_params_json_larger_than_any_is_refused_before_reading(tmp_path: Path) -> None:
    """An 8 GiB params.json (or /dev/zero behind a link) was read whole into memory."""
    from voxtral_mlx.fileio import MAX_JSON_BYTES

    path = tmp_path / "params.json"
    with path.open("wb") as f:
        f.truncate(MAX_JSON_BYTES + 1)  # sparse
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_file(path)
    message = str(info.value)
    assert "larger than 64 MiB" in message and "\n" not in message
    zero = tmp_path / "zero.json"
    zero.symlink_to("/dev/zero")
    with pytest.raises(ConfigError, match="not a regular file"):
        ModelConfig.from_file(zero)


@pytest.mark.parametrize(
    ("kernels", "strides", "words"),
    [
        ("3,4,4,4", "2,2,2,1", "the first stride must be 1"),
        ("3,1,4,4", "1,1,2,2", "stage 1 has kernel 1 and stride 1"),
    ],
)
def test_codec_layouts_mistral_builds_otherwise_are_refused(kernels, strides, words) -> None:
    """A strided first conv downsamples in Mistral's decoder, and a later (1, 1) stage has
    no conv block at all (its blocks renumbered): both were built as something else."""
    params = with_value(f"{TOK}.decoder_convs_kernels_str", kernels)
    message = config_error(with_value(f"{TOK}.decoder_convs_strides_str", strides, params))
    assert words in message and "decoder_convs" in message


def test_flow_norm_eps_defaults_to_mistrals_not_the_backbones() -> None:
    params = with_value("norm_eps", 1e-2)
    assert ModelConfig.from_params(params).flow.norm_eps == 1e-5
    params = with_value(f"{AT}.norm_eps", 1e-3, params)
    assert ModelConfig.from_params(params).flow.norm_eps == 1e-3


def test_encoder_and_decoder_strides_must_multiply_alike() -> None:
    """Mistral's codec asserts it; the windows would be halved a wrong number of times."""
    message = config_error(with_value(f"{TOK}.encoder_convs_strides_str", "2,2,1,1"))
    assert "downsamples x4 but the decoder upsamples x8" in message


def test_real_codec_windows_with_the_encoder_given_or_not(real: ModelConfig) -> None:
    assert real.codec.windows == (2, 4, 8, 16)
    params = with_value(f"{TOK}.encoder_convs_strides_str", "2,2,2,1")
    params = with_value(f"{TOK}.encoder_convs_kernels_str", "4,4,4,3", params)
    assert ModelConfig.from_params(params).codec.windows == (2, 4, 8, 16)


@pytest.mark.parametrize(
    ("path", "value"),
    [("rope_theta", 1e39), ("norm_eps", 1e300), (f"{AT}.sigma_max", 1e308)],
)
def test_a_number_beyond_float32_names_its_key(path: str, value: float) -> None:
    """rope_theta 1e39 is finite in Python but infinite in float32: it loaded, and frame 1
    blamed the weights for the NaN it made ("re-download it")."""
    message = config_error(with_value(path, value))
    assert f"'{path}' must lie within float32's range" in message


def test_a_sampling_rate_no_audio_has_is_refused() -> None:
    """sampling_rate 1 (frame_rate 1/1920 to match) loaded and wrote 1 Hz audio files."""
    params = with_value(f"{ENC}.sampling_rate", 1)
    params = with_value(f"{TOK}.sampling_rate", 1, params)
    params = with_value(f"{ENC}.frame_rate", 1 / 1920, params)
    message = config_error(params)
    assert f"'{ENC}.sampling_rate'" in message and "1 Hz is no audio rate" in message


def test_an_unreadable_params_json_says_to_let_the_user_read_it(tmp_path, monkeypatch):
    """Permission denied said "restore it from the model's download", which would not help
    (as root here chmod 000 cannot deny a read: the read is made to fail)."""
    import voxtral_mlx.config as config_mod

    def denied(path, limit):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(config_mod, "read_limited", denied)
    with pytest.raises(ConfigError) as exc:
        ModelConfig.from_file(tmp_path / "params.json")
    message = one_line(exc.value)
    assert "Permission denied; let this user read it (chmod or chown)" in message
    assert "download" not in message
