"""voxtral_mlx.convert: Mistral-layout checkpoints -> MLX directories, unquantized and
quantized (4, 6, 8 bits, flow-head override), loaded back with voxtral_mlx.load.

Quantized paths run in float32 (bf16 activations through quantized matmuls are off by several
percent on the CPU backend).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import torch
from mlx.utils import tree_flatten

import voxtral_mlx
import voxtral_mlx.convert as convert_mod
from voxtral_mlx.checkpoint import CheckpointMismatch, Expected, QuantSpec, expected_tensors
from voxtral_mlx.cli import main as cli_main
from voxtral_mlx.config import ModelConfig
from voxtral_mlx.convert import convert_model
from voxtral_mlx.errors import (
    CheckpointError,
    ConfigError,
    InputError,
    ModelNotFoundError,
    VoiceError,
    VoxtralError,
)
from voxtral_mlx.loader import LoadedModel, load_model_dir
from voxtral_mlx.mlx_layout import to_mistral_name, to_mlx_audio_name
from voxtral_mlx.model.layers import Float32QuantizedLinear
from voxtral_mlx.synthetic.checkpoint import build_random_checkpoint, make_params
from voxtral_mlx.tokenizer import speech_prompt_ids
from voxtral_mlx.torch_pickle import read_pt, to_mlx

TEXT = "Hello there, this is a longer test sentence."
VOICES = {"casual_male": 7, "fr_male": 4}
FRAMES = 40
VARIANTS: dict[str, dict[str, Any]] = {
    "bf16": {},
    "q4": {"q_bits": 4},
    "q6": {"q_bits": 6},
    "q8": {"q_bits": 8},
    "q4-flow4": {"q_bits": 4, "q_flow_bits": 4},
}


def one_line(e: BaseException) -> str:
    assert isinstance(e, VoxtralError), type(e)
    text = str(e)
    assert text and "\n" not in text and "\r" not in text, repr(text)
    return text


def params(hidden: int = 192) -> dict[str, Any]:
    """Tiny params whose Linear widths are multiples of 64 (every layer quantizable)."""
    p = make_params("tiny", vocab_size=2048)
    p["hidden_dim"] = hidden
    p["multimodal"]["audio_model_args"]["acoustic_transformer_args"]["hidden_dim"] = hidden
    return p


def noise(frames: int = FRAMES, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((frames, 36)).astype(np.float32)


def speak(path: Path, dtype: str = "float32", frames: int = FRAMES) -> Any:
    tts = voxtral_mlx.load(path, dtype=dtype)
    try:
        return tts.synthesize(TEXT, "casual_male", noise=noise(frames), max_frames=frames)
    finally:
        close = getattr(tts, "close", None)
        if close is not None:
            close()


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """BF16 as published, .pt voices, END suppressed so runs last FRAMES frames."""
    return build_random_checkpoint(
        tmp_path_factory.mktemp("cv-src") / "model",
        params(),
        seed=2,
        vocab_source=None,
        voices=VOICES,
        suppress_end=True,
    )


@pytest.fixture(scope="module")
def converted(source: Path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cv-out")
    return {name: convert_model(source, root / name, **kw).path for name, kw in VARIANTS.items()}


@pytest.fixture(scope="module")
def loaded(converted: dict[str, Path]) -> dict[str, LoadedModel]:
    return {name: load_model_dir(path, "float32") for name, path in converted.items()}


# --------------------------------------------------------------------------- the layout


def test_a_conversion_without_params_json_converts_to_mistrals_params(
    converted: dict[str, Path], source: Path, tmp_path: Path
) -> None:
    """Its params come from its config.json, which also records the earlier conversion
    (format, source, dtype, ...): those were copied into the new params.json."""
    src = Path(shutil.copytree(converted["bf16"], tmp_path / "src"))
    (src / "params.json").unlink()
    out = convert_model(src, tmp_path / "q4", q_bits=4, dtype="float32").path
    params = json.loads((source / "params.json").read_text())
    assert json.loads((out / "params.json").read_text()) == params
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "float32" and config["source"] == "src"


def test_directory_layout(converted: dict[str, Path], source: Path) -> None:
    for name, path in converted.items():
        files = sorted(p.name for p in path.iterdir())
        assert files == [
            "config.json",
            "model.safetensors",
            "model.safetensors.index.json",
            "params.json",
            "tekken.json",
            "voice_embedding",
        ], (name, files)
        assert (path / "params.json").read_bytes() == (source / "params.json").read_bytes()
        assert (path / "tekken.json").read_bytes() == (source / "tekken.json").read_bytes()
        config = json.loads((path / "config.json").read_text())
        assert config["format"] == "voxtral-mlx" and config["dtype"] == "bfloat16"
        assert config["format_version"] == 2 and config["weight_names"] == "mlx-audio"
        params = json.loads((source / "params.json").read_text())
        assert {k: config[k] for k in params} == params  # mlx-audio reads them here
        index = json.loads((path / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"].values()) == {"model.safetensors"}
        assert set(index["weight_map"]) == set(mx.load(str(path / "model.safetensors")))
        if name == "bf16":
            assert "quantization" not in config
        else:
            q = config["quantization"]
            bits, flow = VARIANTS[name]["q_bits"], VARIANTS[name].get("q_flow_bits")
            flow = flow or max(8, bits)
            assert (q["mode"], q["group_size"], q["bits"]) == ("affine", 64, bits)
            assert q["components"] == {
                "backbone": bits,
                "flow_head": flow,
                "codec": None,
                "embeddings": None,
            }
            assert q["language_model.model.model.layers.1.mlp.down_proj"] == {
                "group_size": 64,
                "bits": bits,
                "mode": "affine",
            }
            assert q["acoustic_transformer.semantic_codebook_output"]["bits"] == flow
            assert "language_model.model.model.layers.1.mlp.down_proj.scales" in index["weight_map"]


def test_format_version_1_still_loads(converted, loaded, tmp_path: Path) -> None:
    """Version 1 of the format had Mistral's tensor names and the layers under `layers`."""
    out = Path(shutil.copytree(converted["q4"], tmp_path / "v1"))
    (out / "model.safetensors.index.json").unlink()
    tensors = mx.load(str(out / "model.safetensors"))
    mx.save_safetensors(
        str(out / "model.safetensors"), {to_mistral_name(k): v for k, v in tensors.items()}
    )
    config = json.loads((out / "config.json").read_text())
    q = config["quantization"]
    layers = {to_mistral_name(k): q.pop(k) for k in list(q) if "." in k}
    config.update(format_version=1, weight_names="mistral", quantization={**q, "layers": layers})
    (out / "config.json").write_text(json.dumps(config))
    old = load_model_dir(out, "float32")
    assert old.layout == "voxtral-mlx" and old.quantized == loaded["q4"].quantized
    a = dict(tree_flatten(old.model.parameters()))
    b = dict(tree_flatten(loaded["q4"].model.parameters()))
    assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]).item() for k in a)


def config_error(model: Path, out: Path, **edits: Any) -> str:
    """The one-line ConfigError of loading a copy of ``model`` (at ``out``) whose config.json
    has ``edits``."""
    shutil.copytree(model, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **edits}))
    with pytest.raises(ConfigError) as exc:
        load_model_dir(out)
    return one_line(exc.value)


@pytest.mark.parametrize(
    ("version", "words"),
    [(3, "converted by a newer voxtral_mlx (format version 3"), ("2", "positive integer")],
)
def test_a_format_version_this_release_does_not_know_is_refused(
    converted, tmp_path: Path, version, words: str
) -> None:
    assert words in config_error(converted["q4"], tmp_path / "m", format_version=version)


@pytest.mark.parametrize(
    ("quantization", "words"),
    [
        ("yes", "key 'quantization' must be an object"),
        ({"bits": 0}, "key 'quantization.bits' must be a positive integer, got 0"),
        (
            {"bits": 4, "group_size": 64, "mode": []},
            "key 'quantization.mode' must be a quantization mode's name (affine, mxfp4, ...), "
            "got []",
        ),
        (
            {"bits": 4, "group_size": 64, "audio_tokenizer.x": {"bits": 4, "mode": {}}},
            "key 'quantization.audio_tokenizer.x.mode' must be a quantization mode's name "
            "(affine, mxfp4, ...), got {}",
        ),
    ],
)
def test_a_broken_quantization_section_names_the_file_and_the_fix(
    converted, tmp_path: Path, quantization, words: str
) -> None:
    out = tmp_path / "m"
    assert config_error(converted["q4"], out, quantization=quantization) == (
        f"{out / 'config.json'}: {words}; convert the model again or restore config.json "
        "from its download"
    )


def test_voices_are_converted_from_pt(converted: dict[str, Path], source: Path) -> None:
    out = converted["q4"] / "voice_embedding"
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{v}.safetensors" for v in VOICES)
    for voice in VOICES:
        stored = mx.load(str(out / f"{voice}.safetensors"))
        assert list(stored) == ["embedding"]
        original = torch.load(source / "voice_embedding" / f"{voice}.pt", weights_only=True)
        assert original.dtype == torch.bfloat16 and stored["embedding"].dtype == mx.bfloat16
        assert tuple(stored["embedding"].shape) == tuple(original.shape)
        bits = np.array(stored["embedding"].view(mx.uint16))
        np.testing.assert_array_equal(bits, original.view(torch.uint16).numpy())


def test_safetensors_voices_come_out_keyed_embedding(source: Path, tmp_path: Path) -> None:
    """A source voice stored under another key (which load() reads) is rewritten under
    ``embedding``, as mlx-audio and the layout expect; one keyed so is copied unchanged."""
    src = Path(shutil.copytree(source, tmp_path / "src"))
    rows = {v: to_mlx(read_pt(src / "voice_embedding" / f"{v}.pt")) for v in VOICES}
    keyed, other = sorted(VOICES)
    for voice, key in ((keyed, "embedding"), (other, "voice")):
        (src / "voice_embedding" / f"{voice}.pt").unlink()
        mx.save_safetensors(
            str(src / "voice_embedding" / f"{voice}.safetensors"), {key: rows[voice]}
        )
    out = convert_model(src, tmp_path / "out", q_bits=8).path / "voice_embedding"
    for voice in VOICES:
        stored = mx.load(str(out / f"{voice}.safetensors"))
        assert list(stored) == ["embedding"]
        assert stored["embedding"].dtype == rows[voice].dtype
        assert mx.array_equal(stored["embedding"], rows[voice]).item()
    name = f"{keyed}.safetensors"
    assert (out / name).read_bytes() == (src / "voice_embedding" / name).read_bytes()


def test_voices_come_out_as_the_model_reads_them(source: Path, tmp_path: Path) -> None:
    """The copy took every *.safetensors name: a link to nothing beside the .pt the loader
    uses failed the conversion after all the weights were written; a float64 file was
    copied as it was, which MLX (mlx-audio) cannot read."""
    from safetensors.numpy import save_file

    src = Path(shutil.copytree(source, tmp_path / "src"))
    dangling, wide = sorted(VOICES)
    (src / "voice_embedding" / f"{dangling}.safetensors").symlink_to(tmp_path / "gone")
    rows = to_mlx(read_pt(src / "voice_embedding" / f"{wide}.pt"))
    (src / "voice_embedding" / f"{wide}.pt").unlink()
    as_f64 = np.array(rows.astype(mx.float32)).astype(np.float64)
    save_file({"embedding": as_f64}, str(src / "voice_embedding" / f"{wide}.safetensors"))
    loaded = load_model_dir(src)
    assert loaded.voices[dangling].path.suffix == ".pt"
    out = convert_model(src, tmp_path / "out").path / "voice_embedding"
    assert sorted(p.name for p in out.iterdir()) == [f"{v}.safetensors" for v in sorted(VOICES)]
    assert mx.load(str(out / f"{wide}.safetensors"))["embedding"].dtype == mx.float32
    for voice in VOICES:
        stored = mx.load(str(out / f"{voice}.safetensors"))["embedding"]
        assert mx.array_equal(stored, loaded.voices.embedding(voice)).item()


def test_unquantized_conversion_is_bit_identical(converted, source: Path) -> None:
    ours = load_model_dir(converted["bf16"], "float32")
    ref = load_model_dir(source, "float32")
    assert ours.layout == "voxtral-mlx" and ref.layout == "mistral" and not ours.quantized
    a, b = dict(tree_flatten(ours.model.parameters())), dict(tree_flatten(ref.model.parameters()))
    assert a.keys() == b.keys()
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)
    x, y = speak(converted["bf16"]), speak(source)
    assert len(x.codes) == FRAMES
    np.testing.assert_array_equal(x.codes, y.codes)
    np.testing.assert_array_equal(x.audio, y.audio)


def test_unquantized_conversion_computes_in_bf16_by_default(converted) -> None:
    assert load_model_dir(converted["bf16"]).dtype == mx.bfloat16
    assert load_model_dir(converted["q4"]).dtype == mx.bfloat16


@pytest.mark.parametrize("name", ["q4", "q6", "q8", "q4-flow4"])
def test_exactly_the_expected_layers_are_quantized(loaded, name: str) -> None:
    model = loaded[name].model
    bits = VARIANTS[name]["q_bits"]
    flow = VARIANTS[name].get("q_flow_bits") or max(8, bits)
    modules = dict(model.named_modules())
    quantized = {p: m for p, m in modules.items() if isinstance(m, nn.QuantizedLinear)}
    assert not any(isinstance(m, nn.QuantizedEmbedding) for m in modules.values())
    linears = {p for p, m in modules.items() if isinstance(m, (nn.Linear, nn.QuantizedLinear))}
    backbone = {p for p in linears if p.startswith("layers.")}
    flow_head = {
        p
        for p in linears
        if p.startswith("acoustic_transformer.")
        and p
        not in ("acoustic_transformer.input_projection", "acoustic_transformer.time_projection")
    }
    assert len(backbone) == 14 and len(flow_head) == 17
    assert set(quantized) == backbone | flow_head == set(loaded[name].quantized)
    for path, module in quantized.items():
        want = bits if path.startswith("layers.") else flow
        assert (module.bits, module.group_size, module.mode) == (want, 64, "affine"), path
        assert loaded[name].quantized[path] == QuantSpec(want, 64)
    # 36 inputs (not a multiple of 64) and the load-time-only time projection stay plain
    assert type(modules["acoustic_transformer.input_projection"]) is nn.Linear
    assert type(modules["acoustic_transformer.time_projection"]) is nn.Linear
    assert not any(isinstance(m, nn.QuantizedLinear) for p, m in modules.items() if "audio_" in p)
    params = dict(tree_flatten(model.parameters()))
    assert {v.dtype for k, v in params.items() if k.endswith((".scales", ".biases"))} == {
        mx.float32
    }
    assert params["mm_audio_embeddings.tok_embeddings.weight"].dtype == mx.float32


def test_quantization_matches_mx_quantize_on_the_whole_matrix(source: Path, tmp_path: Path) -> None:
    """Row blocks (forced tiny here) give the same bits as quantizing each matrix at once."""
    out = convert_model(source, tmp_path / "m", q_bits=6, chunk_bytes=1000).path
    stored = mx.load(str(out / "model.safetensors"))
    original = mx.load(str(source / "consolidated.safetensors"))
    for path, bits in (("layers.0.feed_forward.w1", 6), ("acoustic_transformer.llm_projection", 8)):
        w, s, b = mx.quantize(original[f"{path}.weight"], group_size=64, bits=bits)
        name = to_mlx_audio_name(path)
        assert mx.array_equal(stored[f"{name}.weight"], w).item()
        assert mx.array_equal(stored[f"{name}.scales"], s).item()
        assert mx.array_equal(stored[f"{name}.biases"], b).item()
    norm = stored["language_model.model.model.norm.weight"]
    assert mx.array_equal(norm, original["norm.weight"]).item()


def test_non_multiple_widths_stay_unquantized(tmp_path: Path) -> None:
    src = build_random_checkpoint(
        tmp_path / "src", params(hidden=160), vocab_source=None, voices=VOICES
    )
    out = convert_model(src, tmp_path / "out", q_bits=4)
    assert "layers.0.feed_forward.w2" not in out.quantized  # 160 inputs
    assert "layers.0.feed_forward.w1" in out.quantized
    model = load_model_dir(out.path, "float32").model
    assert type(dict(model.named_modules())["layers.0.feed_forward.w2"]) is nn.Linear


def teacher_forced_semantic(loaded: LoadedModel, codes: np.ndarray) -> np.ndarray:
    """The semantic code ``loaded`` predicts at every frame when fed ``codes`` as history."""
    model = loaded.model
    ids = speech_prompt_ids(loaded.tokenizer, TEXT, VOICES["casual_male"])
    rows = loaded.voices.embedding("casual_male", loaded.dtype)
    cache = model.make_cache()
    h = model(model.embed_prompt(ids, rows, ids.index(loaded.config.audio_token_id)), cache)
    h = h[:, -1]
    out = []
    for frame in codes:
        out.append(int(model.acoustic_transformer.semantic_code(h)[0]))
        h = model(model.embed_codes(mx.array(frame[None])), cache)[:, -1]
    return np.array(out)


@pytest.mark.parametrize("name", ["q8", "q6", "q4"])
def test_quantized_semantic_codes_agree_with_float32(loaded, source: Path, name: str) -> None:
    """Per-frame agreement with the same history (teacher forcing: the unquantized run's
    codes fed to both), and free-running agreement with the same noise (which diverges for
    good at the first differing frame on random weights)."""
    ref = speak(source)
    assert len(ref.codes) == FRAMES
    reference = load_model_dir(source, "float32")
    np.testing.assert_array_equal(teacher_forced_semantic(reference, ref.codes), ref.codes[:, 0])
    forced = float(np.mean(teacher_forced_semantic(loaded[name], ref.codes) == ref.codes[:, 0]))
    free = speak(loaded[name].path)
    assert len(free.codes) == FRAMES and np.isfinite(free.audio).all()
    same = free.codes[:, 0] == ref.codes[:, 0]
    first = int(np.argmin(same)) if not same.all() else FRAMES
    print(
        f"{name}: semantic codes agree with float32 on {forced:.0%} of {FRAMES} frames "
        f"(same history); free-running: first {first} frames identical, {same.mean():.0%} overall"
    )
    # Random weights give flat logits (a proxy: see benchmarks/RESULTS.md); measured here
    # 100 / 95 / 85 %, while a broken quantizer agrees by chance (~0 %).
    assert forced >= {"q8": 0.9, "q6": 0.8, "q4": 0.6}[name], forced


def test_bf16_quantized_products_are_exact_on_the_cpu(converted, source: Path) -> None:
    """MLX's CPU quantized product is off by 5-11 % with bf16 activations; on the CPU the
    loader gives quantized layers float32 activations, so a bf16 q8 model's products equal
    the float32-activation ones to bf16 rounding, and its semantic codes keep agreeing."""
    if mx.default_device() != mx.cpu:
        pytest.skip("on Metal the quantized kernel is exact with bf16 activations")
    bf16 = load_model_dir(converted["q8"], "bfloat16")
    layers = {p: m for p, m in bf16.model.named_modules() if isinstance(m, nn.QuantizedLinear)}
    assert layers and all(type(m) is Float32QuantizedLinear for m in layers.values())
    x = mx.random.normal((6, bf16.config.backbone.dim), key=mx.random.key(0))
    for path in ("layers.0.attention.wq", "acoustic_transformer.layers.1.feed_forward.w1"):
        layer = layers[path]
        exact = mx.quantized_matmul(
            x,
            layer.weight,
            layer.scales,
            layer.biases,
            transpose=True,
            group_size=layer.group_size,
            bits=layer.bits,
        )
        got = layer(x.astype(mx.bfloat16))
        plain = nn.QuantizedLinear.__call__(layer, x.astype(mx.bfloat16))
        assert got.dtype == mx.bfloat16
        err = float(mx.abs(got.astype(mx.float32) - exact).max() / mx.abs(exact).max())
        raw = float(mx.abs(plain.astype(mx.float32) - exact).max() / mx.abs(exact).max())
        print(f"{path}: bf16 relative error {err:.2%} (the plain CPU kernel: {raw:.2%})")
        assert err < 0.01, (path, err)

    ref = speak(source)
    forced = float(np.mean(teacher_forced_semantic(bf16, ref.codes) == ref.codes[:, 0]))
    print(f"q8 in bf16: semantic codes agree with float32 on {forced:.0%} of {FRAMES} frames")
    assert forced >= 0.8, forced


def test_converting_twice_gives_identical_files(converted, source: Path, tmp_path: Path) -> None:
    again = convert_model(source, tmp_path / "again", q_bits=4).path
    assert tree_bytes(again) == tree_bytes(converted["q4"])


def test_sharding_and_float32_output(source: Path, tmp_path: Path) -> None:
    out = convert_model(source, tmp_path / "m", dtype="float32", max_shard_bytes=1 << 20)
    names = sorted(p.name for p in out.path.glob("model*.safetensors"))
    assert len(names) > 1 and names[0] == f"model-00001-of-{len(names):05d}.safetensors"
    assert not (out.path / "model.safetensors").exists()
    loaded = load_model_dir(out.path)
    assert loaded.dtype == mx.float32
    x, y = speak(out.path, frames=5), speak(source, frames=5)
    np.testing.assert_array_equal(x.codes, y.codes)
    np.testing.assert_array_equal(x.audio, y.audio)


def test_mlx_directories_convert_again(converted, source: Path, tmp_path: Path) -> None:
    """An unquantized MLX directory is a valid source (same result as from the original)."""
    out = convert_model(converted["bf16"], tmp_path / "m", q_bits=4).path
    a = mx.load(str(out / "model.safetensors"))
    b = mx.load(str(converted["q4"] / "model.safetensors"))
    assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]).item() for k in a)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"q_bits": 3}, "--q-bits (q_bits=) 3"),
        ({"q_bits": 16}, "--q-bits (q_bits=) 16"),
        ({"q_bits": 4, "q_flow_bits": 5}, "--q-flow-bits (q_flow_bits=) 5"),
        ({"q_flow_bits": 8}, "--q-flow-bits (q_flow_bits=) needs --q-bits (q_bits=)"),
        ({"q_group_size": 7}, "--q-group-size (q_group_size=) needs --q-bits (q_bits=)"),
        ({"q_group_size": 64}, "--q-group-size (q_group_size=) needs --q-bits"),
        ({"q_bits": 4, "q_group_size": 48}, "--q-group-size (q_group_size=) 48"),
        ({"dtype": "int8"}, "--dtype (dtype=) 'int8' is not supported"),
    ],
)
def test_bad_options(source: Path, tmp_path: Path, kwargs: dict, words: str) -> None:
    with pytest.raises(InputError) as exc:
        convert_model(source, tmp_path / "out", **kwargs)
    assert words in one_line(exc.value)
    assert list(tmp_path.iterdir()) == []


def test_existing_output_needs_force(converted, source: Path, tmp_path: Path) -> None:
    out = Path(shutil.copytree(converted["bf16"], tmp_path / "out"))
    before = tree_bytes(out)
    with pytest.raises(InputError) as exc:
        convert_model(source, out, q_bits=4)
    assert "--force" in one_line(exc.value)
    assert tree_bytes(out) == before
    convert_model(source, out, q_bits=4, force=True)
    assert tree_bytes(out) == tree_bytes(converted["q4"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no leftovers


def test_empty_output_directory_is_used(source: Path, tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    assert convert_model(source, tmp_path / "out").path == (tmp_path / "out").absolute()


def test_force_never_deletes_unrelated_files(source: Path, tmp_path: Path) -> None:
    out = tmp_path / "documents"
    out.mkdir()
    (out / "thesis.txt").write_text("precious")
    with pytest.raises(InputError) as exc:
        convert_model(source, out, force=True)
    assert "refusing" in one_line(exc.value)
    assert (out / "thesis.txt").read_text() == "precious"


def test_output_inside_the_source_is_refused(source: Path) -> None:
    with pytest.raises(InputError) as exc:
        convert_model(source, source / "mlx", force=True)
    assert "overlaps" in one_line(exc.value)
    assert not (source / "mlx").exists()


def test_the_source_under_another_name_is_refused(source: Path, tmp_path: Path) -> None:
    # On a Mac's case-insensitive disk `-o ~/Models/Voxtral` names the source folder
    # `~/models/voxtral`: the guard compares folders on disk, not their names (a bind
    # mount gives a second name here, where a mount namespace can be made).
    alias = tmp_path / "alias"
    alias.mkdir()
    script = textwrap.dedent(
        f"""
        set -e
        mount --bind {source.parent} {alias}
        {sys.executable} -m voxtral_mlx convert {alias / source.name} --force \\
            -o {source} 2>&1 || true
        {sys.executable} -m voxtral_mlx convert {source} --force \\
            -o {alias / source.name / "mlx"} 2>&1 || true
        """
    )
    before = tree_bytes(source)
    try:
        run = subprocess.run(
            ["unshare", "-m", "bash", "-c", script], capture_output=True, text=True, timeout=300
        )
    except FileNotFoundError:
        pytest.skip("no unshare here")
    if "mount" in run.stdout + run.stderr and "overlaps" not in run.stdout:
        pytest.skip(f"no mount namespace here: {(run.stdout + run.stderr).strip()[-200:]}")
    lines = [line for line in run.stdout.splitlines() if line.strip()]
    assert len(lines) == 2 and all("overlaps the source model" in line for line in lines), lines
    assert tree_bytes(source) == before


def test_overlap_is_judged_by_identity_not_by_name(tmp_path: Path, monkeypatch) -> None:
    real = tmp_path / "models" / "voxtral"
    (real / "sub").mkdir(parents=True)
    other = tmp_path / "Models" / "Voxtral"  # another name of `real`, as on a Mac
    other.parent.mkdir()
    stat = Path.stat

    def same_folder(self: Path, **kwargs: Any):
        text = str(self)
        if text.startswith(str(other)):
            self = Path(str(real) + text[len(str(other)) :])
        return stat(self, **kwargs)

    monkeypatch.setattr(Path, "stat", same_folder)
    assert convert_mod._overlaps(other, real)
    assert convert_mod._overlaps(other / "sub" / "new", real)  # output inside the source
    assert convert_mod._overlaps(other, real / "sub")  # source inside the output
    assert not convert_mod._overlaps(tmp_path / "elsewhere", real)
    assert not convert_mod._overlaps(other.parent / "voxtral-4bit", real)


def test_every_written_file_is_made_durable_before_it_is_published(
    source: Path, tmp_path: Path, monkeypatch
) -> None:
    import voxtral_mlx.output_dir as output_dir

    synced: set[int] = set()
    sync = output_dir.full_fsync

    def record(fd: int) -> None:
        synced.add(os.fstat(fd).st_ino)
        sync(fd)

    monkeypatch.setattr(output_dir, "full_fsync", record)
    out = convert_model(source, tmp_path / "out", q_bits=4).path
    written = [out, *out.rglob("*")]
    assert len(written) > 5
    assert [p for p in written if p.stat().st_ino not in synced] == []


def test_a_file_system_that_cannot_sync_directories_still_converts(
    source: Path, tmp_path: Path, monkeypatch
) -> None:
    import errno
    import stat

    import voxtral_mlx.output_dir as output_dir

    sync = output_dir.full_fsync

    def no_directories(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):  # as some network and FUSE file systems
            raise OSError(errno.EINVAL, "Invalid argument")
        sync(fd)

    monkeypatch.setattr(output_dir, "full_fsync", no_directories)
    out = convert_model(source, tmp_path / "out").path
    assert (out / "config.json").is_file()


def test_no_model_is_refused_not_taken_for_the_default(tmp_path: Path) -> None:
    with pytest.raises(InputError) as exc:
        convert_model(None, tmp_path / "out")
    assert "model is None" in one_line(exc.value)
    assert list(tmp_path.iterdir()) == []


def test_unwritable_output(source: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(InputError) as exc:
        convert_model(source, blocker / "out")
    assert "cannot write" in one_line(exc.value)
    with pytest.raises(InputError) as exc:
        convert_model(source, blocker)
    assert "not a directory" in one_line(exc.value)


def test_outputs_the_finished_directory_cannot_be_renamed_onto_are_refused_first(
    source, tmp_path, monkeypatch
) -> None:
    """'..' and a mount point failed at the final rename, after the whole conversion was
    written (8 GB, on the mount point's parent file system), saying "check the free disk
    space and permissions"."""
    calls = []
    monkeypatch.setattr(convert_mod, "_produce", lambda *a: calls.append(a) or iter(()))
    with pytest.raises(InputError) as exc:
        convert_model(source, tmp_path / "new" / "..", q_bits=4)
    assert "ends in '..': name the directory itself" in one_line(exc.value)
    mount = tmp_path / "mnt"
    mount.mkdir()
    real_ismount = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: Path(p) == mount or real_ismount(p))
    with pytest.raises(InputError) as exc:
        convert_model(source, mount, q_bits=4)
    assert "is a mount point" in one_line(exc.value)
    assert calls == [] and sorted(p.name for p in tmp_path.iterdir()) == ["mnt"]


def test_weights_beyond_float16_are_refused_not_written_as_infinity(source, tmp_path) -> None:
    wide = convert_model(source, tmp_path / "f32", dtype="float32").path
    file = wide / "model.safetensors"
    weights = mx.load(str(file))
    name = next(k for k, v in weights.items() if ".layers.0." in k and v.ndim == 2)
    big = np.array(weights[name])
    big[0, 0] = 1e6
    weights[name] = mx.array(big)
    mx.save_safetensors(str(file), weights, metadata={"format": "mlx"})
    for q_bits in (None, 8):
        with pytest.raises(InputError) as exc:
            convert_model(wide, tmp_path / "f16", dtype="float16", q_bits=q_bits)
        message = one_line(exc.value)
        # named as its file names it (mlx-audio's tree here), after the file
        said = f"{file}: tensor '{name}' holds values beyond float16's range (up to 1e+06"
        assert said in message
        assert "--dtype bfloat16 or float32" in message
        assert not (tmp_path / "f16").exists()
    assert convert_model(wide, tmp_path / "bf16", dtype="bfloat16").path.is_dir()


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("stored", ["float32", "bfloat16", "float16"])
def test_a_damaged_weight_is_refused_not_quantized_away(source, tmp_path, value, stored) -> None:
    """Quantizing turned a NaN into its group's extreme value: a damaged checkpoint came
    out looking sound, and the runtime's check for non-finite values could not catch it.
    Nor may a tensor copied as it is stored (the output's dtype) pass unchecked."""
    wide = convert_model(source, tmp_path / "src", dtype=stored).path
    file = wide / "model.safetensors"
    weights = mx.load(str(file))
    name = next(k for k, v in weights.items() if ".layers.0." in k and v.ndim == 2)
    damaged = np.array(weights[name].astype(mx.float32))
    damaged[0, 0] = value
    weights[name] = mx.array(damaged).astype(weights[name].dtype)
    mx.save_safetensors(str(file), weights, metadata={"format": "mlx"})
    for dtype, q_bits in (("bfloat16", 4), ("bfloat16", None), (stored, None)):
        with pytest.raises(CheckpointError) as exc:
            convert_model(wide, tmp_path / "out", dtype=dtype, q_bits=q_bits)
        message = one_line(exc.value)
        assert f"{file}: tensor '{name}' holds NaN or infinite values" in message
        assert message.endswith("re-download it")
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), KeyboardInterrupt])
def test_failure_midway_leaves_nothing(source, tmp_path: Path, monkeypatch, error) -> None:
    def fail(*_args):
        raise error

    monkeypatch.setattr(convert_mod, "_copy_voices", fail)  # after the weights are written
    with pytest.raises(InputError if isinstance(error, OSError) else KeyboardInterrupt) as exc:
        convert_model(source, tmp_path / "out", q_bits=4)
    if isinstance(error, OSError):
        assert "No space left" in one_line(exc.value)
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_while_voices_are_converted_names_the_output(source, tmp_path, monkeypatch):
    """The voices' own error named the hidden staging directory and asked for another
    output directory; it is now said as for the weights."""
    import voxtral_mlx.voices as voices_mod

    def full(*_args):
        raise OSError(28, "No space left on device")

    assert any((source / "voice_embedding").glob("*.pt"))
    monkeypatch.setattr(voices_mod, "_write_safetensors", full)
    with pytest.raises(InputError) as exc:
        convert_model(source, tmp_path / "out", q_bits=4)
    message = one_line(exc.value)
    assert "No space left" in message and ".partial" not in message, message
    assert str(tmp_path / "out") in message
    assert list(tmp_path.iterdir()) == []


def test_voices_differing_only_in_case_are_refused_before_writing(source, tmp_path) -> None:
    """On a Mac they are one file: refused before the weights are written (they were
    refused after, naming the staging directory)."""
    model = Path(shutil.copytree(source, tmp_path / "model"))
    voices = model / "voice_embedding"
    first = sorted(voices.glob("*.pt"))[0]
    shutil.copyfile(first, voices / f"{first.stem.upper()}.pt")
    with pytest.raises(VoiceError) as exc:
        convert_model(model, tmp_path / "out", q_bits=4)
    assert "differ only in case" in one_line(exc.value)
    assert not (tmp_path / "out").exists()


def _dead_pid() -> int:
    pid = 4_000_000
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            pass
        pid += 1


def test_force_replaces_a_model_holding_a_killed_voice_conversions_leftover(
    converted, source, tmp_path
) -> None:
    """A convert-voices run killed while writing into the model's voice_embedding/ left
    its hidden staging directory: it is ours, not foreign, and goes with the rest. One
    whose process still runs is someone's work in progress, and is refused."""
    out = Path(shutil.copytree(converted["bf16"], tmp_path / "out"))
    left = out / "voice_embedding" / f".voices.partial-{_dead_pid()}-0123abcd"
    left.mkdir()
    assert convert_model(source, out, q_bits=8, force=True).path == out
    assert not left.exists()
    busy = out / "voice_embedding" / f".voices.partial-{os.getpid()}-0123abcd"
    busy.mkdir()
    with pytest.raises(InputError) as exc:
        convert_model(source, out, q_bits=8, force=True)
    assert busy.name in one_line(exc.value)


def test_failure_midway_keeps_the_old_output(converted, source, tmp_path, monkeypatch) -> None:
    out = Path(shutil.copytree(converted["bf16"], tmp_path / "out"))
    before = tree_bytes(out)

    def fail(*_args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(convert_mod, "_copy_voices", fail)
    with pytest.raises(InputError):
        convert_model(source, out, q_bits=4, force=True)
    assert tree_bytes(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_an_output_filled_meanwhile_is_not_replaced_without_force(
    converted, source, tmp_path, monkeypatch
) -> None:
    """Two conversions started into the same new directory: the second to finish fails
    instead of silently replacing the first one's model."""
    out = tmp_path / "out"
    real_copy = convert_mod._copy_voices

    def other_process_finishes_first(src, dst, *args):
        real_copy(src, dst, *args)
        shutil.copytree(converted["bf16"], out)

    monkeypatch.setattr(convert_mod, "_copy_voices", other_process_finishes_first)
    with pytest.raises(InputError) as exc:
        convert_model(source, out, q_bits=4)
    assert "--force" in one_line(exc.value) and "filled" in one_line(exc.value)
    assert tree_bytes(out) == tree_bytes(converted["bf16"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_an_interrupt_while_swapping_in_is_delivered_after_it(
    converted, source, tmp_path, monkeypatch
) -> None:
    """Ctrl-C while the replaced model is being removed: the swap completes (new model in
    place, nothing of the old one left), then the interrupt is raised."""
    import voxtral_mlx.output_dir as output_dir

    out = Path(shutil.copytree(converted["bf16"], tmp_path / "out"))
    real_rmtree = shutil.rmtree
    removed: list[str] = []

    def interrupted_rmtree(path, *args, **kwargs):
        if Path(path).name.startswith(".out.old-"):
            signal.raise_signal(signal.SIGINT)  # held back until the swap is done
            removed.append(Path(path).name)
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(output_dir.shutil, "rmtree", interrupted_rmtree)
    with pytest.raises(KeyboardInterrupt) as exc:
        convert_model(source, out, q_bits=4, force=True)
    assert "was written (it is complete)" in exc.value.detail  # the CLI's one error line
    assert removed  # the interrupt came during the removal of the old model
    assert tree_bytes(out) == tree_bytes(converted["q4"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ctrl_c_then_a_failing_swap_is_still_an_interrupt(source, tmp_path, monkeypatch) -> None:
    """The Ctrl-C held while the output was swapped in was dropped when the swap then
    failed: the run ended as a write error (exit 1), not as interrupted."""
    import voxtral_mlx.output_dir as output_dir

    def interrupted_then_failing(*_args) -> None:
        signal.raise_signal(signal.SIGINT)
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(output_dir, "_swap_into_place", interrupted_then_failing)
    with pytest.raises(KeyboardInterrupt):
        convert_model(source, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_ctrl_c_while_its_voices_go_into_place_says_interrupted_only(
    source, tmp_path, monkeypatch, capsys
) -> None:
    """The voices' "interrupted after ... was written (it is complete)" named the staged
    voice folder of a conversion that was then abandoned, as if the output were written."""
    import voxtral_mlx.voices as voices_mod

    real = os.replace

    def interrupted(src, dst) -> None:
        real(src, dst)
        if Path(dst).parent.name == "voice_embedding":
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(voices_mod.os, "replace", interrupted)
    out = tmp_path / "out"
    assert cli_main(["convert", str(source), "-o", str(out)]) == 130
    assert capsys.readouterr().err.strip() == "voxtral-mlx: error: interrupted"
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_hang_up_while_swapping_in_is_held_too(converted, source, tmp_path, monkeypatch):
    """SIGHUP (a closed terminal; the CLI turns it into an exception) during the removal
    of the replaced model: held back like Ctrl-C, so no hidden copy of it stays."""
    import voxtral_mlx.output_dir as output_dir

    class HungUp(Exception):
        pass

    def hang_up(*_args):
        raise HungUp

    out = Path(shutil.copytree(converted["bf16"], tmp_path / "out"))
    real_rmtree = shutil.rmtree

    def interrupted_rmtree(path, *args, **kwargs):
        if Path(path).name.startswith(".out.old-"):
            signal.raise_signal(signal.SIGHUP)
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(output_dir.shutil, "rmtree", interrupted_rmtree)
    saved = signal.signal(signal.SIGHUP, hang_up)
    try:
        with pytest.raises(HungUp) as exc:
            convert_model(source, out, q_bits=4, force=True)
    finally:
        signal.signal(signal.SIGHUP, saved)
    assert "was written (it is complete)" in exc.value.detail
    assert tree_bytes(out) == tree_bytes(converted["q4"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_replaced_model_left_by_a_killed_run_is_removed_or_put_back(converted, source, tmp_path):
    """A run killed (kill -9, power cut) while replacing a model leaves the old one hidden
    beside the output. Once the new one is in place it is garbage: the next run there
    removes it. Killed before that, it is the only model: it is put back, not removed."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    out = Path(shutil.copytree(converted["q4"], tmp_path / "out"))
    left = tmp_path / f".out.old-{gone.pid}-0123abcd"
    shutil.copytree(converted["bf16"], left)
    kept = tmp_path / f".out.old-{os.getpid()}-0123abcd"  # a running process's: kept
    kept.mkdir()
    convert_model(source, out, q_bits=8, force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [kept.name, "out"]
    assert tree_bytes(out) == tree_bytes(converted["q8"])

    shutil.rmtree(out)  # killed between moving the old model aside and the new one in
    shutil.copytree(converted["bf16"], left)
    with pytest.raises(InputError, match="exists and is not empty"):
        convert_model(source, out, q_bits=4)  # the model is there again
    assert tree_bytes(out) == tree_bytes(converted["bf16"])
    assert sorted(p.name for p in tmp_path.iterdir()) == [kept.name, "out"]

    # Beside one to put back, a link to nothing of that name: it stopped every run there.
    shutil.rmtree(out)
    shutil.copytree(converted["bf16"], left)
    dangling = tmp_path / f".out.old-{gone.pid}-deadbeef"
    dangling.symlink_to(tmp_path / "nowhere")
    with pytest.raises(InputError, match="exists and is not empty"):
        convert_model(source, out, q_bits=4)
    assert tree_bytes(out) == tree_bytes(converted["bf16"])


def test_a_second_interrupt_during_the_cleanup_leaves_nothing(source, tmp_path, monkeypatch):
    """Ctrl-C twice: the second comes while the staging directory is being removed; it is
    held back until the removal is done, so no hidden .partial directory stays."""
    import voxtral_mlx.output_dir as output_dir

    real_rmtree = shutil.rmtree

    def interrupted_rmtree(path, *args, **kwargs):
        signal.raise_signal(signal.SIGINT)  # the second Ctrl-C
        real_rmtree(path, *args, **kwargs)

    def first_interrupt(*_args):
        raise KeyboardInterrupt

    monkeypatch.setattr(convert_mod, "_copy_voices", first_interrupt)
    monkeypatch.setattr(output_dir.shutil, "rmtree", interrupted_rmtree)
    with pytest.raises(KeyboardInterrupt):
        convert_model(source, tmp_path / "out", q_bits=4)
    assert list(tmp_path.iterdir()) == []


def test_force_refuses_foreign_files_inside_voice_embedding(converted, source, tmp_path):
    out = Path(shutil.copytree(converted["bf16"], tmp_path / "out"))
    (out / "voice_embedding" / "sub").mkdir()
    (out / "voice_embedding" / "sub" / "notes.txt").write_text("precious")
    with pytest.raises(InputError) as exc:
        convert_model(source, out, force=True)
    assert "voice_embedding/sub" in one_line(exc.value)
    assert (out / "voice_embedding" / "sub" / "notes.txt").read_text() == "precious"


def test_a_long_but_legal_output_name_converts(source, tmp_path):
    """The hidden staging directory beside it is shortened to fit the file system."""
    out = convert_model(source, tmp_path / ("k" * 250)).path
    assert out.name == "k" * 250 and (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k" * 250]
    again = convert_model(source, out, q_bits=8, force=True).path  # and the .old- name
    assert again == out and sorted(p.name for p in tmp_path.iterdir()) == ["k" * 250]


@pytest.mark.parametrize("broken", ["dangling", "directory", "loop"])
def test_a_source_voice_that_is_not_a_file_is_named(source, tmp_path, broken):
    src = Path(shutil.copytree(source, tmp_path / "src"))
    voice = src / "voice_embedding" / "ghost.safetensors"
    if broken == "dangling":
        voice.symlink_to(tmp_path / "nowhere")
    elif broken == "directory":
        voice.mkdir()
    else:
        voice.symlink_to(voice.name)
    with pytest.raises(VoxtralError) as exc:
        convert_model(src, tmp_path / "out")
    assert "ghost.safetensors is not a readable file" in one_line(exc.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_an_output_that_is_a_looping_link_is_one_line(source, tmp_path):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    for out in (tmp_path / "a", tmp_path / "a" / "sub"):
        with pytest.raises(InputError) as exc:
            convert_model(source, out)
        assert "symbolic link that loops" in one_line(exc.value)


def test_failure_removes_the_parent_directories_it_made(source, tmp_path, monkeypatch) -> None:
    def fail(*_args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(convert_mod, "_copy_voices", fail)
    with pytest.raises(InputError):
        convert_model(source, tmp_path / "new" / "deeper" / "out")
    assert list(tmp_path.iterdir()) == []


def test_symlinked_output_replaces_what_it_points_to(converted, source, tmp_path) -> None:
    real = Path(shutil.copytree(converted["bf16"], tmp_path / "real"))
    (tmp_path / "link").symlink_to(real)
    out = convert_model(source, tmp_path / "link", q_bits=4, force=True).path
    assert out == real and (tmp_path / "link").is_symlink()
    assert tree_bytes(real) == tree_bytes(converted["q4"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]  # no leftovers

    (tmp_path / "empty").mkdir()
    (tmp_path / "to-empty").symlink_to(tmp_path / "empty")
    assert convert_model(source, tmp_path / "to-empty").path == tmp_path / "empty"
    assert (tmp_path / "to-empty" / "config.json").is_file()

    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(InputError) as exc:
        convert_model(source, tmp_path / "dangling")
    assert "symbolic link" in one_line(exc.value)


def test_dtype_names_match_speak(source, tmp_path: Path) -> None:
    out = convert_model(source, tmp_path / "out", dtype="bf16").path
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_quantized_source_is_refused(converted, tmp_path: Path) -> None:
    with pytest.raises(InputError) as exc:
        convert_model(converted["q4"], tmp_path / "out", q_bits=8)
    assert "already quantized" in one_line(exc.value)


def test_missing_source(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError):
        convert_model(tmp_path / "nope", tmp_path / "out")


def test_repo_ids_go_through_the_hub(source, tmp_path: Path, monkeypatch) -> None:
    seen = []

    def resolve(spec):
        seen.append(spec)
        return source

    monkeypatch.setattr(convert_mod, "resolve_model_dir", resolve)
    out = convert_model("mistralai/Voxtral-4B-TTS-2603", tmp_path / "out")
    assert seen == ["mistralai/Voxtral-4B-TTS-2603"]
    config = json.loads((out.path / "config.json").read_text())
    assert config["source"] == "mistralai/Voxtral-4B-TTS-2603"


# --------------------------------------------------------------------------- CLI


def test_cli_convert(source: Path, tmp_path: Path, capsys) -> None:
    assert cli_main(["convert", str(source), "-o", str(tmp_path / "out"), "--q-bits", "8"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == str((tmp_path / "out").absolute())
    assert f"31 quantized layers, {len(VOICES)} voices)" in captured.err
    assert "note:" not in captured.err
    assert cli_main(["convert", str(source), "-o", str(tmp_path / "out"), "--q-bits", "5"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("voxtral-mlx: error: --q-bits (q_bits=) 5") and "\n" not in err


def test_cli_convert_onto_its_own_source_says_so_without_force(source: Path, capsys) -> None:
    """It said "pass --force", and with --force then refused the overlap."""
    before = tree_bytes(source)
    assert cli_main(["convert", str(source), "-o", str(source)]) == 1
    err = capsys.readouterr().err.strip()
    assert "overlaps the source model" in err and "--force" not in err
    assert tree_bytes(source) == before


def test_cli_convert_from_a_path_of_no_user_is_one_line(tmp_path: Path, capsys) -> None:
    assert cli_main(["convert", "~nosuchuser-xyz/model", "-o", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip()
    assert "~nosuchuser-xyz names no user of this machine" in err and "\n" not in err


def test_cli_convert_names_the_layers_the_group_size_leaves_unquantized(
    tmp_path: Path, capsys
) -> None:
    """A SwiGLU width of 160 is no multiple of 64: each w2 stays unquantized, and is named
    (they were left out without a word)."""
    src = build_random_checkpoint(
        tmp_path / "src", params(hidden=160), vocab_source=None, voices=VOICES
    )
    result = convert_model(src, tmp_path / "q4", q_bits=4)
    w2 = [f"layers.{i}.feed_forward.w2" for i in range(2)]
    w2 += [f"acoustic_transformer.layers.{i}.feed_forward.w2" for i in range(2)]
    assert sorted(result.unfit) == sorted(w2)
    assert not set(result.unfit) & set(result.quantized)
    assert cli_main(["convert", str(src), "-o", str(tmp_path / "cli"), "--q-bits", "4"]) == 0
    err = capsys.readouterr().err
    assert "voxtral-mlx: note: 4 layers (layers.0.feed_forward.w2, " in err
    assert "stay unquantized: their input width is not a multiple of the group size 64" in err
    assert convert_model(tmp_path / "src", tmp_path / "q4b", q_bits=4, q_group_size=32).unfit == []


def test_cli_convert_says_when_the_source_has_no_voices(
    source: Path, tmp_path: Path, capsys
) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(source, bare, ignore=shutil.ignore_patterns("voice_embedding"))
    assert cli_main(["convert", str(bare), "-o", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert "(unquantized, no voices)" in err
    assert f"voxtral-mlx: note: {bare} has no voices in voice_embedding/" in err
    assert not (tmp_path / "out" / "voice_embedding").exists()


def test_cli_convert_names_the_voices_the_source_lacks(
    source: Path, tmp_path: Path, capsys
) -> None:
    """A download missing some voice files converts (the others are whole), and says which
    voices the output lacks rather than leave them to fail at their first use."""
    partial = tmp_path / "partial"
    shutil.copytree(source, partial)
    kept = sorted(p.stem for p in (partial / "voice_embedding").iterdir())
    assert len(kept) > 1
    (partial / "voice_embedding" / f"{kept[0]}.pt").unlink()
    result = convert_model(partial, tmp_path / "api")
    assert (result.voices, result.missing_voices) == (kept[1:], [kept[0]])
    assert convert_model(source, tmp_path / "whole").missing_voices == []
    assert cli_main(["convert", str(partial), "-o", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert (
        f"voxtral-mlx: note: the tekken.json of {partial} lists voices that have no file in its "
        f"voice_embedding/ (an incomplete download?), so the conversion has none either: "
        f"{kept[0]}; fetch the model again, then convert again\n"
    ) in err
    assert sorted(p.stem for p in (tmp_path / "out" / "voice_embedding").iterdir()) == kept[1:]


def test_entry_script(source: Path, tmp_path: Path) -> None:
    script = Path(__file__).resolve().parent.parent / "convert" / "convert_checkpoint.py"
    run = subprocess.run(
        [sys.executable, str(script), str(source), "-o", str(tmp_path / "out"), "--q-bits", "4"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert load_model_dir(tmp_path / "out").layout == "voxtral-mlx"


# --------------------------------------------------------------------------- memory


MEMORY_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from voxtral_mlx.convert import convert_model

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024

    import voxtral_mlx.loader, voxtral_mlx.tokenizer, numpy, mlx.core as mx
    mx.array([1.0]) + 1
    base = status("VmRSS:")
    convert_model(sys.argv[1], sys.argv[2], q_bits=4, chunk_bytes=2 << 20)
    print(json.dumps({"base": base, "peak": status("VmHWM:")}))
    """
)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc (Linux)")
def test_conversion_memory_is_bounded(tmp_path: Path) -> None:
    """A ~200 MB checkpoint (largest tensor 64 MB) converts with a few MB of extra memory:
    tensors are streamed in row blocks, never held whole."""
    p = make_params("tiny", vocab_size=32768, semantic_codebook_size=8192)
    p.update(dim=1024, n_heads=8, n_kv_heads=8, head_dim=128, hidden_dim=4096, n_layers=2)
    at = p["multimodal"]["audio_model_args"]["acoustic_transformer_args"]
    at.update(input_dim=1024, dim=1024, n_heads=8, n_kv_heads=8, head_dim=128, hidden_dim=4096)
    at["n_layers"] = 1
    src = build_random_checkpoint(tmp_path / "src", p, vocab_source=None, voices=VOICES)
    size = (src / "consolidated.safetensors").stat().st_size
    assert size > 180 << 20
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    run = subprocess.run(
        [sys.executable, "-c", MEMORY_SCRIPT, str(src), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    rss = json.loads(run.stdout.strip().splitlines()[-1])
    growth = rss["peak"] - rss["base"]
    print(f"converting {size / 2**20:.0f} MB: peak RSS grew by {growth / 2**20:.1f} MB")
    assert growth < 48 << 20, growth


# --------------------------------------------------------------------------- verification


def test_expected_tensors_of_a_quantized_layer(source: Path) -> None:
    config = ModelConfig.from_file(source / "params.json")
    plain = expected_tensors(config)
    packed = expected_tensors(config, {"layers.0.feed_forward.w2": QuantSpec(6, 64)})
    assert plain["layers.0.feed_forward.w2.weight"].shape == (64, 192)
    assert packed["layers.0.feed_forward.w2.weight"] == Expected((64, 192 * 6 // 32), dtype="U32")
    assert packed["layers.0.feed_forward.w2.scales"].shape == (64, 3)
    assert packed["layers.0.feed_forward.w2.biases"].shape == (64, 3)
    head = expected_tensors(
        config, {"acoustic_transformer.semantic_codebook_output": QuantSpec(8, 32)}
    )
    got = head["acoustic_transformer.semantic_codebook_output.weight"]
    assert got.min_rows == 66 and got.matches((128, 16)) and not got.matches((128, 64))


def _rewrite(path: Path, edit) -> None:
    tensors = dict(mx.load(str(path)))
    edit(tensors)
    mx.save_safetensors(str(path), tensors)


def test_missing_scales_are_named(converted, tmp_path: Path) -> None:
    out = Path(shutil.copytree(converted["q4"], tmp_path / "m"))
    index = out / "model.safetensors.index.json"
    index.unlink()  # the index would (rightly) complain first
    scales = to_mlx_audio_name("layers.1.attention.wv.scales")
    _rewrite(out / "model.safetensors", lambda t: t.pop(scales))
    with pytest.raises(CheckpointError) as exc:
        load_model_dir(out)
    layer = scales[: -len(".scales")]
    assert f"layer '{layer}' has quantized weights but no .scales" in one_line(exc.value)


def test_unpacked_weight_beside_scales_is_the_wrong_dtype(converted, tmp_path: Path) -> None:
    out = Path(shutil.copytree(converted["q8"], tmp_path / "m"))
    (out / "model.safetensors.index.json").unlink()

    name = to_mlx_audio_name("layers.0.attention.wq.weight")

    def edit(t: dict) -> None:
        t[name] = t[name].view(mx.float32)

    _rewrite(out / "model.safetensors", edit)
    with pytest.raises(CheckpointMismatch) as exc:
        load_model_dir(out)
    assert exc.value.mistyped == [(name, "F32", "U32")]  # named as in the file
    message = one_line(exc.value)
    # No config fixes a dtype: it said to check that config.json matches the weights.
    assert "wrong dtype" in message and "fetch them again, or convert them again" in message
    assert "come from the same model" not in message


@pytest.mark.parametrize(
    "bad, words",
    [
        (np.zeros((7, 32), np.float32), "32 wide"),
        (np.full((7, 64), np.nan, np.float32), "NaN"),
        (np.zeros((5, 64), np.float32), "5 rows"),
    ],
)
def test_a_voice_that_cannot_load_stops_the_conversion(
    source: Path, tmp_path: Path, bad: np.ndarray, words: str
) -> None:
    """A voice the converted model could not use is refused before anything is written."""
    from voxtral_mlx.torch_pickle import write_pt

    src = Path(shutil.copytree(source, tmp_path / "src"))
    assert read_pt(src / "voice_embedding" / "casual_male.pt").shape == (7, 64)
    write_pt(src / "voice_embedding" / "casual_male.pt", bad)
    with pytest.raises(VoxtralError) as exc:
        convert_model(src, tmp_path / "out")
    assert "casual_male" in one_line(exc.value) and words in str(exc.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.mark.parametrize(("before", "after"), [(0o700, 0o700), (0o2750, 0o2750), (0o555, 0o755)])
@pytest.mark.parametrize("filled", [False, True])
def test_a_folder_written_over_keeps_its_mode(
    tmp_path: Path, before: int, after: int, filled: bool
) -> None:
    """An empty folder, or a model replaced with --force, was given the umask's mode: a
    private model folder became readable by all. Its owner keeps full access (a later
    --force run must be able to delete what is inside)."""
    import stat

    from voxtral_mlx.output_dir import staged_dir

    out = tmp_path / "model"
    out.mkdir()
    if filled:
        (out / "config.json").write_text("{}")
    os.chmod(out, before)
    old = os.umask(0o022)
    try:
        with staged_dir(out, force=True) as tmp:
            (tmp / "config.json").write_text("{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == after


@pytest.mark.parametrize("umask", [0o077, 0o002, 0o022])
def test_a_written_folder_takes_the_umask_as_its_files_do(tmp_path: Path, umask: int) -> None:
    """It was 0755 whatever the umask (private while written, then opened to all)."""
    import stat

    from voxtral_mlx.output_dir import staged_dir

    old = os.umask(umask)
    try:
        with staged_dir(tmp_path / "model") as tmp:
            assert stat.S_IMODE(tmp.stat().st_mode) == 0o700  # private while written
            (tmp / "config.json").write_text("{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "model").stat().st_mode) == 0o777 & ~umask
