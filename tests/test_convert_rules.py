"""Rules of convert, prefix_store and config that the neighbouring suites leave unchecked:
limits at their exact boundary, validations and the precise messages they give."""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from test_config import AM, ENC, TOK, config_error, real_params, with_value
from test_convert import source  # noqa: F401  (the module's tiny bf16 checkpoint)

import voxtral_mlx.convert as convert_mod
from tests.spec_reference import codec_windows
from voxtral_mlx.config import ModelConfig
from voxtral_mlx.convert import QuantOptions, convert_model
from voxtral_mlx.errors import InputError
from voxtral_mlx.model.cache import KVCache
from voxtral_mlx.prefix_store import (
    PrefixCacheWarning,
    PrefixStore,
    _digest,
    model_fingerprint,
)

# --------------------------------------------------------------------------- config


def with_values(values: dict[str, Any]) -> dict[str, Any]:
    params = real_params()
    for path, value in values.items():
        params = with_value(path, value, params)
    return params


def test_an_infinite_float_is_named_as_not_finite() -> None:
    message = config_error(with_value("rope_theta", float("inf")))
    assert "params.json key 'rope_theta' must be finite, got inf" in message


def test_a_float_beyond_float32_is_refused() -> None:
    largest = float(np.finfo(np.float32).max)
    assert ModelConfig.from_params(with_value("rope_theta", largest)).backbone.rope_theta == largest
    message = config_error(with_value("rope_theta", 3.5e38))
    assert "key 'rope_theta' must lie within float32's range (+-3.4e38), got 3.5e+38" in message


def test_at_most_32_codec_stages_are_listed() -> None:
    message = config_error(with_value(f"{TOK}.decoder_transformer_lengths_str", ",".join("2" * 33)))
    assert message.endswith(
        f"key '{TOK}.decoder_transformer_lengths_str' lists 33 values, more than the 32 "
        "supported; restore params.json from the model's download (or correct that value)"
    )


def test_a_stage_list_value_above_its_maximum_is_refused() -> None:
    path = f"{TOK}.decoder_transformer_lengths_str"
    assert ModelConfig.from_params(with_value(path, "2,2,2,1024")).codec.transformer_lengths == (
        2,
        2,
        2,
        1024,
    )
    message = config_error(with_value(path, "2,2,2,1025"))
    assert f"key '{path}' is out of range: every value must be at most 1024" in message


def test_voice_ids_that_are_not_integers_are_left_out_of_the_index() -> None:
    voices = {"a": 3, "b": "x", "c": 2.5, "d": True, "e": -1, "f": 0}
    config = ModelConfig.from_params(with_value(f"{TOK}.voice", voices))
    assert config.voice_index == {"a": 3, "f": 0}


def test_an_odd_backbone_head_dim_is_refused() -> None:
    message = config_error(with_value("head_dim", 127))
    assert "key 'head_dim' is inconsistent: RoPE needs an even head_dim, got 127" in message


def test_encoder_conv_lists_of_different_lengths_are_refused() -> None:
    params = with_values(
        {
            f"{TOK}.encoder_convs_kernels_str": "4,4,4",
            f"{TOK}.encoder_convs_strides_str": "2,2,2,1",
        }
    )
    assert (
        "encoder_convs_kernels_str and encoder_convs_strides_str must have the same length, "
        "got 3 and 4" in config_error(params)
    )


def test_an_fsq_of_one_level_is_refused() -> None:
    params = with_values({f"{AM}.acoustic_codebook_size": 1, f"{TOK}.acoustic_codebook_size": 1})
    assert "FSQ needs at least 2 levels, got 1" in config_error(params)


def test_the_lowest_audio_rate_is_accepted_and_one_below_refused() -> None:
    def at_rate(rate: int) -> dict[str, Any]:
        return with_values(
            {
                f"{ENC}.sampling_rate": rate,
                f"{TOK}.sampling_rate": rate,
                f"{ENC}.frame_rate": rate / 1920,
            }
        )

    assert ModelConfig.from_params(at_rate(1000)).sampling_rate == 1000
    assert "999 Hz is no audio rate" in config_error(at_rate(999))


@pytest.mark.parametrize("key", ["qk_norm", "layer_scale"])
def test_a_codec_without_qk_norm_or_layer_scale_is_refused_with_its_fix_only(key: str) -> None:
    """The message names its fix: no "restore params.json" is added to it."""
    assert config_error(with_value(f"{TOK}.{key}", False)) == (
        f"params.json key '{TOK}.qk_norm' is inconsistent: the Voxtral codec decoder uses "
        "qk_norm and layer_scale; both must be true"
    )


def test_a_small_codec_window_is_never_halved_to_zero() -> None:
    config = ModelConfig.from_params(with_value(f"{TOK}.attn_sliding_window_size", 4))
    assert config.codec.windows == (1, 2, 4, 8)


def test_codec_windows_double_only_at_strided_decoder_stages() -> None:
    params = with_values(
        {
            f"{TOK}.decoder_convs_kernels_str": "3,4,3,4",
            f"{TOK}.decoder_convs_strides_str": "1,2,1,2",
            f"{ENC}.frame_rate": 25.0,
        }
    )
    config = ModelConfig.from_params(params)
    codec = params["multimodal"]["audio_tokenizer_args"]
    assert config.codec.windows == tuple(codec_windows(codec)) == (4, 8, 8, 16)


@pytest.mark.parametrize(("kernel", "frames"), [(7, 1), (8, 1), (9, 2), (16, 2), (17, 3)])
def test_first_chunk_frames_round_up(kernel: int, frames: int) -> None:
    config = ModelConfig.from_params(with_value(f"{TOK}.patch_proj_kernel_size", kernel))
    assert config.codec.first_chunk_frames == frames


# --------------------------------------------------------------------------- convert


def shard_tensors(path: Path) -> dict[str, mx.array]:
    return mx.load(str(path))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            # the group size that fits no backbone layer: the largest that does is named
            {"q_bits": 4, "q_group_size": 128},
            "--q-bits 4 with group size 128 quantizes no backbone layer: their input widths "
            "(64, 192) are not multiples of 128; use --q-group-size 64",
        ),
        ({"max_shard_bytes": 0}, "max_shard_bytes must be a whole number >= 1, got 0"),
        ({"progress": 5}, "progress must be a function or None, got int"),
    ],
    ids=["group-size-fits-no-layer", "shard-limit-below-one-byte", "progress-not-a-function"],
)
def test_bad_conversion_arguments_are_refused_before_writing(
    source: Path,  # noqa: F811
    tmp_path: Path,
    kwargs: dict[str, Any],
    message: str,
) -> None:
    with pytest.raises(InputError) as exc:
        convert_model(source, tmp_path / "out", **kwargs)
    assert str(exc.value) == message
    assert list(tmp_path.iterdir()) == []


def test_shards_split_exactly_at_the_byte_limit_and_none_is_empty(
    source: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    one_each = convert_model(source, tmp_path / "one", max_shard_bytes=1)
    shards = [shard_tensors(f) for f in one_each.files]
    assert [len(s) for s in shards] == [1] * len(shards)  # one tensor per file, no empty one
    n = len(shards)
    assert one_each.files[0].name == f"model-00001-of-{n:05d}.safetensors"
    first, second = (sum(v.nbytes for v in s.values()) for s in shards[:2])
    below = convert_model(source, tmp_path / "below", max_shard_bytes=first + second - 1)
    assert shard_tensors(below.files[0]).keys() == shards[0].keys()
    at = convert_model(source, tmp_path / "at", max_shard_bytes=first + second)
    assert shard_tensors(at.files[0]).keys() == shards[0].keys() | shards[1].keys()


def test_the_index_records_the_total_size_and_files_are_marked_mlx(
    source: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    out = convert_model(source, tmp_path / "out", q_bits=4, max_shard_bytes=1 << 16)
    index = json.loads((out.path / "model.safetensors.index.json").read_text())
    sizes = 0
    for file in out.files:
        tensors, meta = mx.load(str(file), return_metadata=True)
        assert meta == {"format": "mlx"}
        sizes += sum(v.nbytes for v in tensors.values())
    assert index["metadata"]["total_size"] == sizes == out.total_bytes


def test_a_quantization_section_in_the_source_params_is_not_carried_over(
    source: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """An unquantized output whose config.json kept it would be read as quantized."""
    src = Path(shutil.copytree(source, tmp_path / "src"))
    params = json.loads((src / "params.json").read_text())
    params["quantization"] = {"group_size": 64, "bits": 4}
    params["quantization_config"] = {"group_size": 64, "bits": 4}
    (src / "params.json").write_text(json.dumps(params))
    out = convert_model(src, tmp_path / "out").path
    config = json.loads((out / "config.json").read_text())
    assert "quantization" not in config and "quantization_config" not in config


def test_an_untied_output_head_in_the_source_is_left_out(
    source: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    src = Path(shutil.copytree(source, tmp_path / "src"))
    file = src / "consolidated.safetensors"
    weights = mx.load(str(file))
    weights["output.weight"] = weights["mm_audio_embeddings.tok_embeddings.weight"]
    mx.save_safetensors(str(file), weights)
    out = convert_model(src, tmp_path / "out", q_bits=4)
    plain = convert_model(source, tmp_path / "plain", q_bits=4)
    written, expected = ({k for f in r.files for k in shard_tensors(f)} for r in (out, plain))
    assert written == expected


def test_row_blocks_are_read_within_chunk_bytes(
    source: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reads: list[int] = []
    pread = convert_mod.os.pread

    def spy(fd: int, n: int, offset: int) -> bytes:
        reads.append(n)
        return pread(fd, n, offset)

    monkeypatch.setattr(convert_mod.os, "pread", spy)
    convert_model(source, tmp_path / "out", q_bits=4, chunk_bytes=1000)
    assert reads and max(reads) <= 1000  # every row of the tiny model is < 1000 bytes


def test_numpy_integers_are_taken_as_python_ints() -> None:
    options = QuantOptions.make(np.int64(4), np.int32(32), np.int64(6))
    assert options == QuantOptions(4, 6, 32)
    assert all(type(v) is int for v in (options.bits, options.flow_bits, options.group_size))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bits": 4.0}, "--q-bits (q_bits=) 4.0 is not supported: use 4, 6 or 8"),
        ({"bits": 4, "flow_bits": 8.0}, "--q-flow-bits (q_flow_bits=) 8.0 is not supported"),
        ({"bits": 4, "group_size": 64.0}, "--q-group-size (q_group_size=) 64.0 is not supported"),
    ],
)
def test_float_bits_and_group_sizes_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(InputError) as exc:
        QuantOptions.make(**kwargs)
    assert message in str(exc.value)


def test_an_odd_chunk_size_copies_whole_values(
    source: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Tensors copied as stored are read in pieces of whole values, whatever chunk_bytes."""
    odd = convert_model(source, tmp_path / "odd", chunk_bytes=1001).path
    plain = convert_model(source, tmp_path / "plain").path
    assert (odd / "model.safetensors").read_bytes() == (plain / "model.safetensors").read_bytes()


def test_a_local_path_given_as_a_string_is_recorded_by_its_name(
    source: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    out = convert_model(str(source), tmp_path / "out").path
    assert json.loads((out / "config.json").read_text())["source"] == source.name


# --------------------------------------------------------------------------- prefix_store

SHAPE = (1, 2, 5, 4)  # [1, kv_heads, positions, head_dim]


def kv_caches(n_layers: int = 2, dtype: mx.Dtype = mx.float32, seed: int = 0) -> list[KVCache]:
    caches = []
    for i in range(n_layers):
        k1, k2 = mx.random.split(mx.random.key(seed * 100 + i))
        cache = KVCache()
        cache.update_and_fetch(
            mx.random.normal(SHAPE, key=k1).astype(dtype),
            mx.random.normal(SHAPE, key=k2).astype(dtype),
        )
        caches.append(cache)
    mx.eval([c.state for c in caches])
    return caches


def store_in(directory: Path, max_files: int = 32) -> PrefixStore:
    return PrefixStore(directory, "f" * 64, max_files=max_files)


def write_prefix_file(store: PrefixStore, key: str, arrays: dict[str, mx.array]) -> Path:
    """A prefix file as save() writes one, of any content (its digest matching it)."""
    store.directory.mkdir(parents=True, exist_ok=True)
    path = store.directory / f"{store.fingerprint[:16]}-{key[:32]}.safetensors"
    meta = {"format": "voxtral_mlx.prefix/3", "key": key, "sha256": _digest(arrays)}
    mx.save_safetensors(str(path), arrays, metadata=meta)
    return path


def arrays_of(caches: list[KVCache]) -> dict[str, mx.array]:
    out = {}
    for i, cache in enumerate(caches):
        out[f"keys.{i}"], out[f"values.{i}"] = cache.state
    return out


def test_a_saved_prefix_loads_back_identically(tmp_path: Path) -> None:
    store, caches = store_in(tmp_path), kv_caches()
    key = store.key([1, 2, 3], mx.ones((3, 8)))
    store.save(key, caches)
    loaded = store.load(key, 2, SHAPE, mx.float32)
    assert loaded is not None and [c.offset for c in loaded] == [SHAPE[2]] * 2
    for a, b in zip(loaded, caches, strict=True):
        assert all(mx.array_equal(x, y).item() for x, y in zip(a.state, b.state, strict=True))


def test_the_key_names_the_prompt_the_voice_rows_their_shape_and_dtype(tmp_path: Path) -> None:
    store = store_in(tmp_path)
    rows = mx.zeros((3, 8), dtype=mx.bfloat16)
    key = store.key([1, 2], rows)
    assert store.key([1, 2], mx.zeros((3, 8), dtype=mx.bfloat16)) == key
    others = [
        store.key([1, 3], rows),  # another prompt
        store.key([1, 2], rows.at[0, 0].add(1)),  # another voice
        store.key([1, 2], rows.reshape(4, 6)),  # the same bytes in another shape
        store.key([1, 2], rows.astype(mx.float16)),  # the same (zero) bytes in another dtype
    ]
    assert len({key, *others}) == 5


def test_a_file_stored_under_another_key_is_a_miss_and_is_removed(tmp_path: Path) -> None:
    store = store_in(tmp_path)
    mine, other = "a" * 32 + "1" * 32, "a" * 32 + "2" * 32  # one file name, two keys
    path = write_prefix_file(store, other, arrays_of(kv_caches()))
    assert store.load(mine, 2, SHAPE, mx.float32) is None
    assert not path.exists()


def test_values_of_another_shape_than_the_keys_are_a_miss(tmp_path: Path) -> None:
    store, key = store_in(tmp_path), "b" * 64
    arrays = arrays_of(kv_caches())
    arrays["values.1"] = mx.zeros((1, 2, 5, 8))
    path = write_prefix_file(store, key, arrays)
    assert store.load(key, 2, SHAPE, mx.float32) is None
    assert not path.exists()


def test_a_prefix_stored_in_another_dtype_is_a_miss(tmp_path: Path) -> None:
    store, key = store_in(tmp_path), "c" * 64
    write_prefix_file(store, key, arrays_of(kv_caches(dtype=mx.float32)))
    assert store.load(key, 2, SHAPE, mx.bfloat16) is None


def test_a_prefix_with_more_layers_than_the_model_is_a_miss(tmp_path: Path) -> None:
    store, key = store_in(tmp_path), "d" * 64
    write_prefix_file(store, key, arrays_of(kv_caches(n_layers=3)))
    assert store.load(key, 2, SHAPE, mx.float32) is None
    write_prefix_file(store, key, arrays_of(kv_caches(n_layers=2)))
    assert store.load(key, 2, SHAPE, mx.float32) is not None


def test_a_hit_makes_its_file_the_most_recently_used(tmp_path: Path) -> None:
    store = store_in(tmp_path, max_files=2)
    old, new, third = "1" * 64, "2" * 64, "3" * 64
    store.save(old, kv_caches(seed=1))
    store.save(new, kv_caches(seed=2))
    for i, key in enumerate((old, new)):  # old was written first, a while ago
        path = store.directory / f"{store.fingerprint[:16]}-{key[:32]}.safetensors"
        os.utime(path, ns=(10**18 + i, 10**18 + i))
    assert store.load(old, 2, SHAPE, mx.float32) is not None
    store.save(third, kv_caches(seed=3))
    assert store.load(old, 2, SHAPE, mx.float32) is not None
    assert store.load(new, 2, SHAPE, mx.float32) is None  # the least recently used went


def test_a_folder_that_cannot_be_made_warns_once_per_store(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    store = PrefixStore(blocker / "cache", "f" * 64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store.save("1" * 64, kv_caches())
        store.save("2" * 64, kv_caches())
    assert [w.category for w in caught] == [PrefixCacheWarning]
    message = str(caught[0].message)
    assert message.startswith(f"cannot write the voice-prefix cache in {blocker / 'cache'}: ")
    assert message.endswith("prefix_cache_dir=None in load())")


class _FrozenTimes:
    """A stat result whose times are fixed: what only the files' contents tell apart."""

    st_mtime_ns = 1_700_000_000_000_000_000
    st_ctime_ns = 1_700_000_000_000_000_000

    def __init__(self, real: os.stat_result):
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


@pytest.fixture
def frozen_times(monkeypatch: pytest.MonkeyPatch) -> None:
    stat = Path.stat
    monkeypatch.setattr(Path, "stat", lambda self, **kw: _FrozenTimes(stat(self, **kw)))


def fingerprint_of(directory: Path, files: dict[str, dict[str, mx.array] | str]) -> str:
    directory.mkdir()
    for name, content in files.items():
        if isinstance(content, str):
            (directory / name).write_text(content)
        else:
            mx.save_safetensors(str(directory / name), content)
    return model_fingerprint(directory)


@pytest.mark.usefixtures("frozen_times")
def test_the_fingerprint_reads_headers_tensor_samples_and_json_files(tmp_path: Path) -> None:
    """Same names, sizes and times: only the contents differ."""
    zeros = np.zeros(1000, np.float32)
    last = zeros.copy()
    last[-1] = 1
    middle = zeros.copy()
    middle[500] = 1
    base = {"w.safetensors": {"a": mx.array(zeros)}, "params.json": '{"x": 1}'}
    variants = [
        {**base, "w.safetensors": {"b": mx.array(zeros)}},  # the header only
        {**base, "w.safetensors": {"a": mx.array(last)}},  # the last value only
        {**base, "w.safetensors": {"a": mx.array(middle)}},  # a middle value only
        {**base, "params.json": '{"x": 2}'},
    ]
    first = fingerprint_of(tmp_path / "base", base)
    assert fingerprint_of(tmp_path / "again", base) == first
    prints = [fingerprint_of(tmp_path / f"v{i}", v) for i, v in enumerate(variants)]
    assert first not in prints and len(set(prints)) == len(prints)


def test_hidden_files_do_not_change_the_fingerprint(tmp_path: Path) -> None:
    """A download or copy in progress beside the model (``.x.safetensors``) is no part of it."""
    model = tmp_path / "m"
    before = fingerprint_of(model, {"w.safetensors": {"a": mx.zeros((4,))}})
    mx.save_safetensors(str(model / ".partial.safetensors"), {"a": mx.ones((4,))})
    (model / ".notes.json").write_text("{}")
    assert model_fingerprint(model) == before
