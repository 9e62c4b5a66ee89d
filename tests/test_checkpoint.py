"""consolidated.safetensors: expected tensors, header parsing, verification, folding, laziness."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch

from voxtral_mlx.checkpoint import (
    CheckpointMismatch,
    Expected,
    checkpoint_dtype,
    expected_tensors,
    load_tensors,
    read_safetensors_header,
    sanitize,
    verify_tensors,
)
from voxtral_mlx.config import ModelConfig
from voxtral_mlx.errors import CheckpointError, VoxtralError
from voxtral_mlx.synthetic.checkpoint import make_params, random_weights
from voxtral_mlx.synthetic.safetensors_writer import TensorSpec, encode, write_safetensors

REFERENCE = Path(__file__).with_name("data") / "reference"
TABLE = "mm_audio_embeddings.audio_codebook_embeddings.embeddings.weight"
SEMANTIC_OUT = "acoustic_transformer.semantic_codebook_output.weight"
TOK = "audio_tokenizer"


def one_line(e: BaseException) -> str:
    assert isinstance(e, VoxtralError)
    text = str(e)
    assert text and "\n" not in text and "\r" not in text, repr(text)
    return text


@pytest.fixture(scope="module")
def real_config() -> ModelConfig:
    return ModelConfig.from_file(REFERENCE / "params.json")


@pytest.fixture(scope="module")
def manifest() -> dict[str, tuple[int, ...]]:
    raw = json.loads((REFERENCE / "checkpoint_manifest.json").read_text())
    return {name: tuple(entry["shape"]) for name, entry in raw.items()}


@pytest.fixture(scope="module")
def tiny_config() -> ModelConfig:
    return ModelConfig.from_params(make_params("tiny"))


# --------------------------------------------------------------------------- expected tensors


def test_expected_tensors_match_the_published_manifest(
    real_config: ModelConfig, manifest: dict[str, tuple[int, ...]]
) -> None:
    expected = expected_tensors(real_config)
    assert len(expected) == len(manifest) == 386
    assert set(expected) == set(manifest)
    for name, shape in manifest.items():
        e = expected[name]
        assert e.matches(shape), (name, shape, e)
        if name in (TABLE, SEMANTIC_OUT):
            continue
        assert e.min_rows is None and e.shape == shape, name
    verify_tensors(manifest, expected, "manifest")  # no exception


def test_padded_tables(real_config: ModelConfig, manifest: dict[str, tuple[int, ...]]) -> None:
    expected = expected_tensors(real_config)
    table = expected[TABLE]
    assert table.min_rows == 9022 and manifest[TABLE] == (9088, 3072)
    assert table.matches((9022, 3072)) and table.matches((9088, 3072))
    assert not table.matches((9021, 3072))
    assert not table.matches((9088, 3071))
    assert not table.matches((9088,))
    assert table.describe() == "[>=9022, 3072]"
    sem = expected[SEMANTIC_OUT]
    assert sem.min_rows == 8194 and manifest[SEMANTIC_OUT] == (8320, 3072)
    assert not sem.matches((8193, 3072))


def test_manifest_is_all_bf16() -> None:
    raw = json.loads((REFERENCE / "checkpoint_manifest.json").read_text())
    assert {e["dtype"] for e in raw.values()} == {"BF16"}


def test_expected_tensors_follow_the_config() -> None:
    params = make_params("tiny", n_layers=3, flow_layers=1)
    params["multimodal"]["audio_tokenizer_args"]["decoder_transformer_lengths_str"] = "1,3,1,2"
    expected = expected_tensors(ModelConfig.from_params(params))
    assert "layers.2.attention.wq.weight" in expected and "layers.3.ffn_norm.weight" not in expected
    assert "acoustic_transformer.layers.0.attention.wq.weight" in expected
    assert "acoustic_transformer.layers.1.attention.wq.weight" not in expected
    counts = [
        len({n.split(".")[4] for n in expected if n.startswith(f"{TOK}.decoder_blocks.{b}.layers")})
        for b in (1, 3, 5, 7)
    ]
    assert counts == [1, 3, 1, 2]
    # stride-1 stage: Conv1d [out, in, k]; upsampling stages: ConvTranspose1d [in, out, k]
    conv0 = expected[f"{TOK}.decoder_blocks.0.conv.parametrizations.weight.original1"]
    assert conv0.shape == (64, 16 + 36, 3)
    conv2 = expected[f"{TOK}.decoder_blocks.2.conv.parametrizations.weight.original1"]
    assert conv2.shape == (64, 64, 4)


# --------------------------------------------------------------------------- verify_tensors


def test_verify_reports_missing_unexpected_and_misshaped(
    real_config: ModelConfig, manifest: dict[str, tuple[int, ...]]
) -> None:
    shapes = dict(manifest)
    del shapes["layers.25.attention.wq.weight"]
    del shapes["norm.weight"]
    shapes["layers.26.attention.wq.weight"] = (4096, 3072)
    shapes["layers.3.feed_forward.w1.weight"] = (9216, 3071)
    shapes[TABLE] = (9000, 3072)  # fewer rows than the 37 codebooks need
    with pytest.raises(CheckpointMismatch) as exc:
        verify_tensors(shapes, expected_tensors(real_config), "model.safetensors")
    e = exc.value
    assert isinstance(e, CheckpointError)
    assert e.missing == ["layers.25.attention.wq.weight", "norm.weight"]
    assert e.unexpected == ["layers.26.attention.wq.weight"]
    assert [m[0] for m in e.misshaped] == sorted([TABLE, "layers.3.feed_forward.w1.weight"])
    by_name = {m[0]: m for m in e.misshaped}
    assert by_name[TABLE][1:] == ((9000, 3072), "[>=9022, 3072]")
    assert by_name["layers.3.feed_forward.w1.weight"][1:] == ((9216, 3071), "[9216, 3072]")
    message = one_line(e)
    assert message.startswith("model.safetensors does not match params.json")
    for name in ("layers.25.attention.wq.weight", "layers.26.attention.wq.weight", TABLE):
        assert name in message
    assert "2 missing" in message and "1 unexpected" in message and "2 mis-shaped" in message


def test_verify_lists_every_name_on_the_exception_but_keeps_the_message_short(
    real_config: ModelConfig,
) -> None:
    with pytest.raises(CheckpointMismatch) as exc:
        verify_tensors({}, expected_tensors(real_config), "empty.safetensors")
    assert len(exc.value.missing) == 386 and exc.value.unexpected == exc.value.misshaped == []
    message = one_line(exc.value)
    assert "386 missing" in message and "382 more" in message
    assert len(message) < 500


def test_verify_ignores_the_tied_output_head(
    real_config: ModelConfig, manifest: dict[str, tuple[int, ...]]
) -> None:
    verify_tensors(
        {**manifest, "output.weight": (131072, 3072)}, expected_tensors(real_config), "x"
    )


def test_verify_message_stays_one_line_for_hostile_names() -> None:
    with pytest.raises(CheckpointMismatch) as exc:
        verify_tensors({"evil\nname": (1,)}, {}, "x.safetensors")
    one_line(exc.value)


def test_header_message_stays_one_line_for_hostile_names(tmp_path: Path) -> None:
    entry = {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}
    path = raw_file(tmp_path / "n.safetensors", {"evil\nname": entry}, b"\0" * 8)
    with pytest.raises(CheckpointError) as exc:
        read_safetensors_header(path)
    one_line(exc.value)


# --------------------------------------------------------------------------- safetensors header


def write_file(path: Path, tensors: dict[str, np.ndarray], dtype: str = "F32") -> Path:
    specs = [TensorSpec(n, dtype, a.shape) for n, a in tensors.items()]
    write_safetensors(path, specs, lambda s: iter([encode(tensors[s.name], dtype)]))
    return path


def raw_file(path: Path, header: object, data: bytes = b"", n: int | None = None) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if n is None else n) + raw + data)
    return path


def header_error(path: Path) -> str:
    """The one-line message, with the file's path (which holds the test's name) as <path>."""
    with pytest.raises(CheckpointError) as exc:
        read_safetensors_header(path)
    message = one_line(exc.value)
    assert str(path) in message
    return message.replace(str(path), "<path>")


@pytest.fixture
def small_file(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    return write_file(
        tmp_path / "w.safetensors",
        {"a": rng.standard_normal((3, 5), dtype=np.float32), "b": np.arange(7, dtype=np.float32)},
    )


def test_header_of_a_valid_file(small_file: Path) -> None:
    infos = read_safetensors_header(small_file)
    assert set(infos) == {"a", "b"}  # __metadata__ skipped
    assert infos["a"].dtype == "F32" and infos["a"].shape == (3, 5)
    assert infos["a"].end - infos["a"].start == 60
    assert infos["b"].shape == (7,) and infos["b"].end - infos["b"].start == 28
    assert checkpoint_dtype(infos) == mx.float32


def test_header_of_the_tiny_checkpoint(
    tiny_checkpoint_bf16: Path, tiny_config: ModelConfig
) -> None:
    infos = read_safetensors_header(tiny_checkpoint_bf16 / "consolidated.safetensors")
    assert {n: i.shape for n, i in infos.items()} == {
        n: e.shape for n, e in expected_tensors(tiny_config).items()
    }
    assert {i.dtype for i in infos.values()} == {"BF16"}
    assert checkpoint_dtype(infos) == mx.bfloat16


def _cut_in_data(data: bytes) -> bytes:
    return data[: len(data) - 10]


def _cut_in_header(data: bytes) -> bytes:
    return data[:20]


def _cut_below_8(data: bytes) -> bytes:
    return data[:5]


@pytest.mark.parametrize(
    "cut",
    [
        _cut_in_data,
        _cut_in_header,
        _cut_below_8,
        pytest.param(lambda data: b"", id="empty"),
    ],
)
def test_truncated_file_says_truncated_and_re_download(small_file: Path, cut) -> None:
    small_file.write_bytes(cut(small_file.read_bytes()))
    message = header_error(small_file)
    assert "truncated" in message
    assert "re-download" in message


@pytest.mark.parametrize("size", [0, 5])
def test_tiny_file_is_a_checkpoint_error(tmp_path: Path, size: int) -> None:
    path = tmp_path / "w.safetensors"
    path.write_bytes(b"\x01" * size)
    assert "re-download" in header_error(path)


def test_real_layout_cut_in_the_data_names_a_tensor(tiny_checkpoint: Path, tmp_path: Path) -> None:
    data = (tiny_checkpoint / "consolidated.safetensors").read_bytes()
    path = tmp_path / "consolidated.safetensors"
    path.write_bytes(data[: len(data) * 2 // 3])
    message = header_error(path)
    assert "truncated" in message and "re-download" in message and "tensor '" in message


@pytest.mark.parametrize(
    "header",
    [
        b"\x00\xff garbage \x13\x37!",  # not UTF-8 / not JSON
        b"[1, 2, 3]",  # JSON but not an object
        b'{"a": 5}',  # entry not an object
        b'{"a": {"shape": [1], "data_offsets": [0, 4]}}',  # no dtype
        b'{"a": {"dtype": "F32", "shape": "ab", "data_offsets": [0, 4]}}',
        b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}}',
        b'{"a": {"dtype": "F32", "shape": [1]}}',
    ],
)
def test_garbage_header(tmp_path: Path, header: bytes) -> None:
    message = header_error(raw_file(tmp_path / "g.safetensors", header, b"\0" * 16))
    assert "header" in message


def test_random_bytes_are_not_a_header(tmp_path: Path) -> None:
    path = tmp_path / "r.safetensors"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    header_error(path)


def test_zero_length_header(tmp_path: Path) -> None:
    header_error(raw_file(tmp_path / "z.safetensors", b"", b"\0" * 16))


@pytest.mark.parametrize(
    "entry",
    [
        {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]},  # 24 bytes expected
        {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 24]},  # 12 bytes expected
        {"dtype": "F32", "shape": [2, 3], "data_offsets": [-4, 20]},
        {"dtype": "F32", "shape": [-2, -3], "data_offsets": [0, 24]},
    ],
)
def test_offsets_inconsistent_with_shape(tmp_path: Path, entry: dict) -> None:
    message = header_error(raw_file(tmp_path / "o.safetensors", {"w": entry}, b"\0" * 64))
    assert "'w'" in message and "inconsistent" in message


@pytest.mark.parametrize("dtype", ["C64", "F8_E4M3", "f32", "Q4"])
def test_unsupported_dtype(tmp_path: Path, dtype: str) -> None:
    entry = {"dtype": dtype, "shape": [4], "data_offsets": [0, 4]}
    message = header_error(raw_file(tmp_path / "d.safetensors", {"w": entry}, b"\0" * 4))
    assert "unsupported dtype" in message and dtype in message


def test_missing_file_and_directory(tmp_path: Path) -> None:
    assert "not found" in header_error(tmp_path / "nope.safetensors")
    (tmp_path / "dir.safetensors").mkdir()
    assert "directory" in header_error(tmp_path / "dir.safetensors")


def test_checkpoint_dtype_is_the_majority_by_bytes(tmp_path: Path) -> None:
    big = np.ones((64, 64), np.float32)
    path = tmp_path / "mixed.safetensors"
    specs = [TensorSpec("big", "BF16", big.shape), TensorSpec("small", "F32", (4,))]
    data = {"big": encode(big, "BF16"), "small": encode(np.ones(4, np.float32), "F32")}
    write_safetensors(path, specs, lambda s: iter([data[s.name]]))
    assert checkpoint_dtype(read_safetensors_header(path)) == mx.bfloat16


# --------------------------------------------------------------------------- sanitize


def np_weight_norm(g: np.ndarray, v: np.ndarray) -> np.ndarray:
    """PyTorch weight_norm(dim=0): g * v / ||v||, the norm over every axis but 0, no epsilon."""
    v64 = v.astype(np.float64)
    norm = np.sqrt((v64 * v64).sum(axis=tuple(range(1, v.ndim)), keepdims=True))
    return (g.astype(np.float64) * v64 / norm).astype(np.float32)


@pytest.fixture(scope="module")
def tiny_weights(tiny_config: ModelConfig) -> dict[str, np.ndarray]:
    return random_weights(tiny_config, seed=3)


@pytest.fixture(scope="module")
def sanitized(tiny_config, tiny_weights) -> dict[str, mx.array]:
    return sanitize({k: mx.array(v) for k, v in tiny_weights.items()}, tiny_config, mx.float32)


def conv_names(config: ModelConfig) -> list[tuple[str, bool]]:
    """(prefix, is_transposed) of every weight-normed conv."""
    out = [
        (f"{TOK}.decoder_blocks.{2 * s}.conv", config.codec.conv_strides[s] > 1)
        for s in range(config.codec.n_stages)
    ]
    return [*out, (f"{TOK}.output_proj.conv", False)]


def test_sanitize_folds_weight_norm_into_mlx_layout(tiny_config, tiny_weights, sanitized) -> None:
    names = conv_names(tiny_config)
    assert [t for _, t in names] == [False, True, True, True, False]
    for prefix, transposed in names:
        g = tiny_weights[f"{prefix}.parametrizations.weight.original0"]
        v = tiny_weights[f"{prefix}.parametrizations.weight.original1"]
        folded = np_weight_norm(g, v)
        ref = folded.transpose(1, 2, 0) if transposed else folded.transpose(0, 2, 1)
        got = np.array(sanitized[f"{prefix}.weight"])
        assert got.shape == ref.shape
        np.testing.assert_allclose(got, ref, rtol=2e-6, atol=1e-7, err_msg=prefix)


def test_weight_norm_matches_torch(tiny_config, tiny_weights, sanitized) -> None:
    for prefix, transposed in conv_names(tiny_config):
        g = torch.from_numpy(tiny_weights[f"{prefix}.parametrizations.weight.original0"])
        v = torch.from_numpy(tiny_weights[f"{prefix}.parametrizations.weight.original1"])
        w = torch._weight_norm(v, g, 0).numpy()
        ref = w.transpose(1, 2, 0) if transposed else w.transpose(0, 2, 1)
        np.testing.assert_allclose(np.array(sanitized[f"{prefix}.weight"]), ref, rtol=1e-5)


def test_folded_convs_compute_what_torch_computes(tiny_config, tiny_weights, sanitized) -> None:
    """The layout is right if MLX's convs with the folded weights equal PyTorch's."""
    rng = np.random.default_rng(1)
    for prefix, transposed in conv_names(tiny_config):
        g = torch.from_numpy(tiny_weights[f"{prefix}.parametrizations.weight.original0"])
        v = torch.from_numpy(tiny_weights[f"{prefix}.parametrizations.weight.original1"])
        w_torch = torch._weight_norm(v, g, 0)
        w_mlx = sanitized[f"{prefix}.weight"]
        in_ch = w_torch.shape[0] if transposed else w_torch.shape[1]
        x = rng.standard_normal((1, 9, in_ch), dtype=np.float32)
        xt = torch.from_numpy(x).transpose(1, 2)
        if transposed:
            ref = torch.nn.functional.conv_transpose1d(xt, w_torch, stride=2)
            got = mx.conv_transpose1d(mx.array(x), w_mlx, stride=2)
        else:
            ref = torch.nn.functional.conv1d(xt, w_torch)
            got = mx.conv1d(mx.array(x), w_mlx)
        np.testing.assert_allclose(
            np.array(got), ref.transpose(1, 2).numpy(), rtol=1e-4, atol=1e-4, err_msg=prefix
        )


def test_sanitize_folds_the_semantic_codebook(tiny_weights, sanitized) -> None:
    q = f"{TOK}.quantizer.semantic_codebook"
    usage = tiny_weights[f"{q}.cluster_usage"]
    total = tiny_weights[f"{q}.embedding_sum"]
    assert (usage == 0).any()  # the random checkpoint has unused clusters: the floor matters
    ref = total / np.maximum(usage, np.float32(1e-5))[:, None]
    got = np.array(sanitized[f"{TOK}.semantic_codebook"])
    np.testing.assert_allclose(got, ref, rtol=1e-6)
    unused = usage == 0
    np.testing.assert_allclose(got[unused], total[unused] * 1e5, rtol=1e-5)


def test_sanitize_renames_and_passes_the_rest(tiny_config, tiny_weights, sanitized) -> None:
    assert not any(".parametrizations." in n or ".quantizer." in n for n in sanitized)
    for name, value in tiny_weights.items():
        if ".parametrizations." in name or ".quantizer." in name:
            continue
        assert np.array_equal(np.array(sanitized[name]), value), name
    n_convs = len(conv_names(tiny_config))
    assert len(sanitized) == len(tiny_weights) - 2 * n_convs + n_convs - 2 + 1


def test_sanitize_drops_the_output_head(tiny_config, tiny_weights) -> None:
    weights = {k: mx.array(v) for k, v in tiny_weights.items()}
    weights["output.weight"] = mx.zeros((4, 4))
    assert "output.weight" not in sanitize(weights, tiny_config, mx.float32)


def test_sanitize_folds_in_float32_then_casts(tiny_config, tiny_weights) -> None:
    bf16 = {k: mx.array(v).astype(mx.bfloat16) for k, v in tiny_weights.items()}
    out = sanitize(bf16, tiny_config, mx.bfloat16)
    assert {v.dtype for v in out.values()} == {mx.bfloat16}
    prefix = f"{TOK}.decoder_blocks.2.conv"
    g = np.array(bf16[f"{prefix}.parametrizations.weight.original0"].astype(mx.float32))
    v = np.array(bf16[f"{prefix}.parametrizations.weight.original1"].astype(mx.float32))
    ref = mx.array(np_weight_norm(g, v).transpose(1, 2, 0)).astype(mx.bfloat16)
    got = out[f"{prefix}.weight"]
    # one rounding to bf16 at the end: at most one bf16 ulp away from the exact fold
    diff = np.abs(np.array(got.astype(mx.float32)) - np.array(ref.astype(mx.float32)))
    scale = np.abs(np.array(ref.astype(mx.float32))) * 2.0**-7
    assert (diff <= scale + 1e-30).all()


# --------------------------------------------------------------------------- lazy loading


def test_load_tensors_is_lazy(tmp_path: Path) -> None:
    path = tmp_path / "big.safetensors"
    shape = (1024, 4096)  # 16 MiB per tensor
    specs = [TensorSpec(f"t{i}", "F32", shape) for i in range(4)]
    write_safetensors(path, specs, lambda s: iter([np.full(shape, 0.5, np.float32).tobytes()]))
    size = path.stat().st_size
    mx.eval(mx.zeros(1))
    before = mx.get_active_memory()
    arrays = load_tensors(path)
    after_load = mx.get_active_memory()
    assert set(arrays) == {"t0", "t1", "t2", "t3"}
    assert arrays["t0"].shape == shape and arrays["t0"].dtype == mx.float32
    assert after_load - before < size // 16, "load_tensors read the data eagerly"
    mx.eval(list(arrays.values()))
    assert mx.get_active_memory() - before >= size // 2  # the measure does see the data
    assert float(arrays["t3"][5, 7]) == 0.5
    del arrays


def test_load_tensors_reads_the_tensors_named(small_file: Path) -> None:
    header = read_safetensors_header(small_file)
    assert len(header) > 1 and set(load_tensors(small_file, {"b": header["b"]})) == {"b"}
    np.testing.assert_array_equal(np.array(load_tensors(small_file)["b"]), np.arange(7))


def test_load_tensors_reads_float64_as_float32(tmp_path: Path) -> None:
    """mx.load refuses F64 files; the model's weights and the voices read them the same way."""
    from safetensors.numpy import save_file

    values = np.linspace(-1, 1, 12).reshape(3, 4)
    save_file({"x": values, "y": np.arange(3, dtype=np.float32)}, str(tmp_path / "f64.safetensors"))
    arrays = load_tensors(tmp_path / "f64.safetensors")
    assert arrays["x"].dtype == mx.float32 and set(arrays) == {"x", "y"}
    np.testing.assert_array_equal(np.array(arrays["x"]), values.astype(np.float32))


def test_load_tensors_errors_are_checkpoint_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as exc:
        load_tensors(tmp_path / "missing.safetensors")
    one_line(exc.value)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file at all")
    with pytest.raises(CheckpointError) as exc:
        load_tensors(bad)
    assert "bad.safetensors" in one_line(exc.value)


def test_expected_describe() -> None:
    assert Expected((3, 4)).describe() == "[3, 4]"
    assert Expected((128, 4), min_rows=100).describe() == "[>=100, 4]"


@pytest.mark.parametrize("dtype", [[], {"a": 1}, 5], ids=["list", "dict", "int"])
def test_non_string_dtype_is_a_checkpoint_error(tmp_path: Path, dtype: object) -> None:
    """An unhashable dtype used to escape as a TypeError traceback."""
    entry = {"dtype": dtype, "shape": [1], "data_offsets": [0, 4]}
    message = header_error(raw_file(tmp_path / "d.safetensors", {"w": entry}, b"\0" * 4))
    assert "'w'" in message and "unsupported dtype" in message


def test_overlapping_tensors_are_refused(tmp_path: Path) -> None:
    """The format forbids tensors sharing bytes; MLX would load them without a word."""
    header = {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
    }
    message = header_error(raw_file(tmp_path / "o.safetensors", header, b"\0" * 16))
    assert "'a'" in message and "'b'" in message and "overlap" in message


def test_adjacent_and_empty_tensors_are_not_overlaps(tmp_path: Path) -> None:
    header = {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "e": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]},
    }
    infos = read_safetensors_header(raw_file(tmp_path / "ok.safetensors", header, b"\0" * 16))
    assert set(infos) == {"a", "e", "b"}


@pytest.mark.parametrize("metadata", [[1, 2], {"format": 5}, "pt"], ids=repr)
def test_malformed_metadata_is_named(tmp_path: Path, metadata: object) -> None:
    """MLX rejects these with '[json.exception.type_error.302] type must be string'."""
    header = {"__metadata__": metadata, "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    message = header_error(raw_file(tmp_path / "m.safetensors", header, b"\0" * 4))
    assert "__metadata__" in message and "re-download" in message


@pytest.mark.parametrize("metadata", [None, {}, {"format": "pt"}], ids=repr)
def test_valid_metadata_is_accepted(tmp_path: Path, metadata: object) -> None:
    """mx.save_safetensors writes ``"__metadata__": null``; torch's writer a string map."""
    header = {"__metadata__": metadata, "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    path = raw_file(tmp_path / "m.safetensors", header, b"\0" * 4)
    assert set(read_safetensors_header(path)) == {"a"}
    assert mx.load(str(path))["a"].shape == (1,)


def test_deeply_nested_header_is_a_checkpoint_error(tmp_path: Path) -> None:
    """json raises RecursionError (not JSONDecodeError) for 100000 nested arrays."""
    raw = b"[" * 100_000 + b"]" * 100_000
    assert "header" in header_error(raw_file(tmp_path / "n.safetensors", raw))


@pytest.mark.parametrize(
    "header",
    [
        b'{"w": {"dtype": "F32", "shape": [Infinity], "data_offsets": [0, 4]}}',
        b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, Infinity]}}',
        b'{"w": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 4]}}',
        b'{"w": {"dtype": "F32", "shape": [1e400], "data_offsets": [0, 4]}}',
        b'{"w": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}}',
        b'{"w": {"dtype": "F32", "shape": [true], "data_offsets": [0, 4]}}',
        b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": ["0", "4"]}}',
        b'{"w": {"dtype": "F32", "shape": [0, 99999999999999999999999], "data_offsets": [0, 0]}}',
    ],
    ids=["inf-shape", "inf-offset", "nan", "1e400", "fraction", "bool", "strings", "huge"],
)
def test_header_numbers_must_be_integers(tmp_path: Path, header: bytes) -> None:
    message = header_error(raw_file(tmp_path / "n.safetensors", header, b"\0" * 16))
    assert "malformed header entry for tensor 'w'" in message
