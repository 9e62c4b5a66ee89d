"""Checkpoints that are not our built-in ``tiny``: other widths, head counts, codebook counts,
codec strides and frame rates, written by our builder or by torch + safetensors' own
writer, and mlx-community directories made with mlx-audio's own conversion code at bit
widths, group sizes and dtypes the other tests do not cover. The benchmarks run on them
(or refuse in one line), voxtral_mlx gives the same codes as mlx-audio, and the voice-prefix
cache changes nothing.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_map

import voxtral_mlx
from benchmarks.common import (
    VOICE,
    frame_ms,
    load_reference,
    pick_voice,
    reference_voice,
    start_noise,
)
from tests.mlx_audio_reference import (
    build_mlx_community,
    injected_noise,
    recorded_frames,
    spec_alibi_slopes,
    spec_codebook_floor,
)
from voxtral_mlx.config import END_AUDIO, ModelConfig
from voxtral_mlx.loader import load_model_dir
from voxtral_mlx.synthetic.checkpoint import build_random_checkpoint, make_params, random_weights

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

REPO = Path(__file__).resolve().parents[1]
TEXT = "Hello world. This is a test of the speech model."
FRAMES = 10
N_ACOUSTIC = 12  # not the release's 36: 13 codes per frame
SAMPLES_PER_FRAME = 40 * 6  # patch 40, strides 1, 2, 3: 10 ms frames at 24 kHz


def odd_params(**codec: Any) -> dict[str, Any]:
    """A consistent params.json unlike the release in every dimension it can express."""
    p = make_params("tiny")
    p.update(dim=96, n_layers=1, head_dim=8, hidden_dim=200, n_heads=6, n_kv_heads=3)
    audio = p["multimodal"]["audio_model_args"]
    audio.update(semantic_codebook_size=100, acoustic_codebook_size=5)
    audio["n_acoustic_codebook"] = N_ACOUSTIC
    audio["audio_encoding_args"].update(num_codebooks=N_ACOUSTIC + 1, frame_rate=100.0)
    audio["acoustic_transformer_args"].update(
        input_dim=96, dim=96, n_layers=1, head_dim=32, hidden_dim=100, n_heads=2, n_kv_heads=1
    )
    p["multimodal"]["audio_tokenizer_args"].update(
        dict(
            dim=48,
            hidden_dim=96,
            head_dim=12,
            n_heads=4,
            n_kv_heads=2,
            semantic_codebook_size=100,
            semantic_dim=8,
            acoustic_codebook_size=5,
            acoustic_dim=N_ACOUSTIC,
            pretransform_patch_size=40,
            patch_proj_kernel_size=5,
            attn_sliding_window_size=8,
            decoder_transformer_lengths_str="1,1,1",
            decoder_convs_kernels_str="3,4,6",
            decoder_convs_strides_str="1,2,3",
        ),
        **codec,
    )
    return p


@pytest.fixture(scope="module")
def odd(tmp_path_factory) -> Path:
    """bf16 weights and .pt voices as published; no ``neutral_female`` voice; END kept."""
    return build_random_checkpoint(
        tmp_path_factory.mktemp("odd"), odd_params(), seed=1, voices={"alice": 7, "bob": 5}
    )


@pytest.fixture(scope="module")
def bench_env(tmp_path_factory) -> dict[str, str]:
    env = dict(os.environ)
    env["VOXTRAL_MLX_BENCH_DIR"] = str(tmp_path_factory.mktemp("bench-cache"))
    return env


def run_script(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        cwd=REPO / "benchmarks",
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def mlx_audio_codes(model, voice_rows: mx.array, voice: str, noise: np.ndarray) -> np.ndarray:
    """mlx-audio's codes (SPEC-patched, float32) for the same prompt and start noise."""
    model.update(
        tree_map(
            lambda a: a.astype(mx.float32) if mx.issubdtype(a.dtype, mx.floating) else a,
            model.parameters(),
        )
    )
    model.audio_tokenizer._alibi_slopes = spec_alibi_slopes(model.audio_tokenizer.args.n_heads)
    model._voice_embeddings[voice] = voice_rows.astype(mx.float32)
    with recorded_frames(model) as frames, injected_noise(noise), spec_codebook_floor():
        list(model.generate(TEXT, voice=voice, max_tokens=len(noise)))
    return np.stack(frames)


def our_codes(path: Path, voice: str, noise: np.ndarray, cache: Path | None = None) -> Any:
    tts = voxtral_mlx.load(path, dtype="float32", prefix_cache_dir=cache)
    try:
        return tts.synthesize(TEXT, voice, noise=noise, max_frames=len(noise))
    finally:
        tts.close()


# --------------------------------------------------------------------------- benchmarks


def test_benchmark_helpers_follow_the_checkpoint(odd: Path, tiny_checkpoint: Path) -> None:
    assert start_noise(odd, 5).shape == (5, N_ACOUSTIC)
    assert start_noise(tiny_checkpoint, 3).shape == (3, 36)
    assert frame_ms(odd) == pytest.approx(1000 * SAMPLES_PER_FRAME / 24000)
    assert frame_ms(tiny_checkpoint) == pytest.approx(80.0)
    assert pick_voice(odd) == "alice"  # the release's voice is not there
    assert pick_voice(tiny_checkpoint) == VOICE


def test_reference_voice_reads_safetensors_voices(tmp_path: Path) -> None:
    path = build_random_checkpoint(
        tmp_path / "st", "tiny", voices={"bob": 4}, voice_format="safetensors"
    )
    ref = SimpleNamespace(_voice_embeddings={})
    reference_voice(ref, path, "bob", mx.float32)
    stored = mx.load(str(path / "voice_embedding" / "bob.safetensors"))["embedding"]
    assert mx.array_equal(ref._voice_embeddings["bob"], stored.astype(mx.float32)).item()


def test_frame_speed_runs_on_other_codebook_counts(odd: Path, bench_env) -> None:
    """It used to build [frames, 36] noise and expect 1920 samples per frame."""
    out = run_script(
        ["frame_speed.py", "--configs", str(odd), "--repeats", "1", "--no-record"], bench_env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    row = next(line for line in out.stdout.splitlines() if line.startswith(f"{odd.name} |"))
    ours_ms, ref_ms, _, rtf, ours_mib, ref_mib, mib_ratio = (
        cell.strip() for cell in row.split("|")[1:]
    )
    assert float(ref_ms) > 0
    assert float(rtf) == pytest.approx(float(ours_ms) / frame_ms(odd), abs=0.01)
    assert float(ours_mib) > 0 and float(ref_mib) > 0
    # (the MiB shown are rounded: the ratio is of the unrounded figures)
    assert float(mib_ratio) == pytest.approx(float(ours_mib) / float(ref_mib), rel=0.1)


def test_ttfa_runs_on_other_codebook_counts(odd: Path, bench_env) -> None:
    out = run_script(
        [
            "ttfa.py",
            "--configs",
            str(odd),
            "--repeats",
            "1",
            "--no-record",
            "--no-default-interval",
        ],
        bench_env,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert any(line.startswith(f"{odd.name} |") for line in out.stdout.splitlines())


def test_quant_agreement_runs_on_other_codebook_counts(odd: Path, bench_env) -> None:
    """Variants that would quantize nothing (widths 48, 96, 200 at group size 64) are
    skipped with the reason; the others are measured."""
    out = run_script(
        [
            "quant_agreement.py",
            "--model",
            str(odd),
            "--frames",
            "4",
            "--only",
            "8-bit",
            "4-bit g32",
        ],
        bench_env,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    skipped = next(line for line in lines if line.startswith("8-bit "))
    # The reason, without convert's advice: this script takes no --q-group-size.
    assert "skipped" in skipped and "not multiples of 64" in skipped
    assert "--q-group-size" not in skipped
    measured = next(line for line in lines if line.startswith("4-bit g32"))
    assert measured.count("%") == 1 and measured.count("frames") == 2, measured
    # Of the layers it quantizes, those whose widths fit group 32: it said nothing of this.
    quantized, wanted = map(int, re.search(r" (\d+) of (\d+) ", measured).groups())
    assert 0 < quantized < wanted, measured


def test_codec_bench_uses_the_checkpoints_frame_duration(odd: Path, bench_env) -> None:
    out = run_script(
        ["codec_bench.py", "--configs", str(odd), "--frames", "50", "--slow-frames", "18"],
        bench_env,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "real time = 10 ms per frame" in out.stdout


def test_codec_bench_refuses_mismatched_weights_in_one_line(
    odd: Path, tmp_path: Path, bench_env
) -> None:
    broken = Path(shutil.copytree(odd, tmp_path / "broken"))
    params = json.loads((broken / "params.json").read_text())
    params["multimodal"]["audio_tokenizer_args"]["hidden_dim"] = 64
    (broken / "params.json").write_text(json.dumps(params))
    out = run_script(["codec_bench.py", "--configs", str(broken)], bench_env)
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    assert "does not match params.json" in out.stderr and "feed_forward" in out.stderr


def test_a_codec_mlx_audio_cannot_build_is_a_one_line_refusal(tmp_path: Path) -> None:
    """A semantic codebook of 126 is valid for voxtral_mlx (Mistral's table sizes), but
    mlx-audio rounds its audio-code table differently and cannot load it: the comparison
    benchmarks say so instead of a traceback."""
    params = make_params("tiny")
    params["multimodal"]["audio_model_args"]["semantic_codebook_size"] = 126
    params["multimodal"]["audio_tokenizer_args"]["semantic_codebook_size"] = 126
    path = build_random_checkpoint(tmp_path / "up", params, voices={"alice": 3})
    tts = voxtral_mlx.load(path, prefix_cache_dir=None)
    try:
        assert tts.synthesize("Hi.", "alice", seed=0, max_frames=2).audio.ndim == 1
    finally:
        tts.close()
    with pytest.raises(SystemExit) as exc:
        load_reference(path)
    message = str(exc.value)
    assert "mlx-audio cannot run 126 semantic codes" in message and "\n" not in message
    assert "holds 896 rows for 956 codes" in message  # told before loading anything


def test_split_text_on_other_codebook_counts(odd: Path) -> None:
    tts = voxtral_mlx.load(odd, prefix_cache_dir=None)
    try:
        speech = tts.synthesize(
            "One sentence here. And another one.",
            "alice",
            seed=0,
            split=True,
            max_chars=20,
            max_frames=3,
        )
    finally:
        tts.close()
    assert speech.codes.shape[1] == N_ACOUSTIC + 1


def test_random_checkpoint_tokenizer_states_the_params_rates(odd: Path) -> None:
    audio = json.loads((odd / "tekken.json").read_text())["audio"]
    assert audio["sampling_rate"] == 24000 and audio["frame_rate"] == 100.0


def test_convert_refuses_a_quantization_that_quantizes_no_backbone_layer(
    odd: Path, tmp_path: Path
) -> None:
    """It used to write an unquantized copy and call it done."""
    from voxtral_mlx.cli import main as cli_main
    from voxtral_mlx.convert import convert_model
    from voxtral_mlx.errors import InputError

    out = tmp_path / "q8"
    with pytest.raises(InputError) as exc:
        convert_model(odd, out, q_bits=8, q_group_size=128)
    message = str(exc.value)
    assert "\n" not in message and "48, 96, 200" in message and "--q-group-size 32" in message
    assert not out.exists()
    assert cli_main(["convert", str(odd), "-o", str(out), "--q-bits", "8"]) == 1
    assert not out.exists()
    done = convert_model(odd, out, q_bits=8, q_group_size=32)
    assert any(name.startswith("layers.") for name in done.quantized)


# --------------------------------------------------------------------------- parity


def write_independently(out: Path, params: dict[str, Any]) -> Path:
    """Mistral's layout written with safetensors' torch writer and torch.save: voices saved
    as a view into a larger storage and with column-major strides. END is never predicted."""
    import torch
    from safetensors.torch import save_file

    from voxtral_mlx.synthetic.tekken import build_tekken, write_tekken

    voices = {"alice": 6, "bob": 4}
    tekken = build_tekken(voices)
    params = copy.deepcopy(params)
    params["vocab_size"] = max(params["vocab_size"], tekken["config"]["default_vocab_size"])
    config = ModelConfig.from_params(params)
    (out / "voice_embedding").mkdir(parents=True)
    weights = random_weights(config, seed=5)
    weights["acoustic_transformer.semantic_codebook_output.weight"][END_AUDIO] = 0.0
    save_file(
        {k: torch.from_numpy(v).bfloat16() for k, v in weights.items()},
        str(out / "consolidated.safetensors"),
    )
    write_tekken(out / "tekken.json", tekken)
    (out / "params.json").write_text(json.dumps(params))
    gen = torch.Generator().manual_seed(0)
    big = torch.randn(20, config.backbone.dim, generator=gen).bfloat16()
    torch.save(big[3:9], out / "voice_embedding" / "alice.pt")
    torch.save(big.t().contiguous().t()[:4], out / "voice_embedding" / "bob.pt")
    return out


@pytest.mark.parametrize("voice", ["alice", "bob"])
def test_independently_written_checkpoint_speaks_like_mlx_audio(tmp_path: Path, voice: str) -> None:
    import torch

    path = write_independently(tmp_path / "ind", odd_params())
    noise = np.random.default_rng(0).standard_normal((FRAMES, N_ACOUSTIC)).astype(np.float32)
    ours = our_codes(path, voice, noise)
    rows = torch.load(path / "voice_embedding" / f"{voice}.pt", weights_only=True)
    theirs = mlx_audio_codes(load_reference(path), mx.array(rows.float().numpy()), voice, noise)
    assert ours.codes.shape == (FRAMES, N_ACOUSTIC + 1)
    np.testing.assert_array_equal(ours.codes, theirs)


@pytest.fixture(scope="module")
def odd_st(tmp_path_factory) -> Path:
    params = odd_params()
    params.update(dim=128, n_heads=8, n_kv_heads=2, head_dim=24, hidden_dim=256)
    params["multimodal"]["audio_model_args"]["acoustic_transformer_args"].update(
        input_dim=128, dim=128
    )
    return build_random_checkpoint(
        tmp_path_factory.mktemp("odd-st"),
        params,
        seed=4,
        voices={"alice": 7},
        voice_format="safetensors",
        suppress_end=True,
    )


@pytest.mark.parametrize(
    ("bits", "group", "dtype", "shard_bytes"),
    [(3, 32, mx.bfloat16, 200_000), (8, 128, mx.float16, None), (None, 64, mx.float16, 300_000)],
    ids=["3bit-g32-sharded", "8bit-g128-f16", "f16-sharded"],
)
def test_mlx_community_variants_speak_like_mlx_audio(
    odd_st: Path, tmp_path: Path, bits, group, dtype, shard_bytes
) -> None:
    from mlx_audio.tts.utils import load_model

    path = build_mlx_community(odd_st, tmp_path / "mc", bits, shard_bytes, group=group, dtype=dtype)
    assert (len(list(path.glob("model-*.safetensors"))) > 1) == (shard_bytes is not None)
    noise = np.random.default_rng(2).standard_normal((FRAMES, N_ACOUSTIC)).astype(np.float32)
    ours = our_codes(path, "alice", noise)
    rows = mx.load(str(path / "voice_embedding" / "alice.safetensors"))["embedding"]
    theirs = mlx_audio_codes(load_model(path), rows, "alice", noise)
    loaded = load_model_dir(path, "float32")
    assert {(q.bits, q.group_size) for q in loaded.quantized.values()} == (
        set() if bits is None else {(bits, group)}
    )
    np.testing.assert_array_equal(ours.codes, theirs)


def test_untied_lm_head_of_an_mlx_community_conversion_is_ignored(
    odd_st: Path, tmp_path: Path
) -> None:
    """``tied_embeddings: false`` with ``output.weight``: mlx-audio writes it as
    ``language_model.model.lm_head`` (and quantizes it), which used to be
    refused as an unexpected tensor. It is the text head, unused for speech."""
    import torch
    from safetensors.torch import load_file, save_file

    src = Path(shutil.copytree(odd_st, tmp_path / "src"))
    params = json.loads((src / "params.json").read_text()) | {"tied_embeddings": False}
    (src / "params.json").write_text(json.dumps(params))
    tensors = load_file(src / "consolidated.safetensors")
    gen = torch.Generator().manual_seed(0)
    head = torch.randn(params["vocab_size"], params["dim"], generator=gen)
    tensors["output.weight"] = head.bfloat16()
    save_file(tensors, src / "consolidated.safetensors")

    plain = build_mlx_community(src, tmp_path / "bf16", None)
    index = json.loads((plain / "model.safetensors.index.json").read_text())["weight_map"]
    assert "language_model.model.lm_head.weight" in index
    noise = np.random.default_rng(5).standard_normal((FRAMES, N_ACOUSTIC)).astype(np.float32)
    np.testing.assert_array_equal(
        our_codes(plain, "alice", noise).codes, our_codes(src, "alice", noise).codes
    )

    quantized = build_mlx_community(src, tmp_path / "q4", 4)
    index = json.loads((quantized / "model.safetensors.index.json").read_text())["weight_map"]
    assert "language_model.model.lm_head.scales" in index
    loaded = load_model_dir(quantized, "float32")
    assert "output" not in loaded.quantized and "layers.0.attention.wq" in loaded.quantized
    assert len(our_codes(quantized, "alice", noise).codes) == FRAMES


def test_mlx_audio_cli_output_loads_the_conversion_not_the_copied_original(
    odd_st: Path, tmp_path: Path
) -> None:
    """mlx-audio's converter copies the source's consolidated.safetensors into its output;
    the 4-bit conversion beside it, not the original, is what loads (it used to be the
    original, silently unquantized)."""
    from mlx_audio.convert import convert
    from mlx_audio.tts.utils import load_model

    src = Path(shutil.copytree(odd_st, tmp_path / "src"))
    config = json.loads((src / "params.json").read_text()) | {"model_type": "voxtral_tts"}
    (src / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    convert(str(src), str(out), quantize=True, q_bits=4, q_group_size=64, model_domain="tts")
    assert (out / "consolidated.safetensors").is_file() and (out / "model.safetensors").is_file()

    loaded = load_model_dir(out, "float32")
    assert loaded.layout == "mlx-community"
    assert {(q.bits, q.group_size) for q in loaded.quantized.values()} == {(4, 64)}
    noise = np.random.default_rng(4).standard_normal((FRAMES, N_ACOUSTIC)).astype(np.float32)
    ours = our_codes(out, "alice", noise)
    clean = Path(shutil.copytree(out, tmp_path / "clean"))
    (clean / "consolidated.safetensors").unlink()  # mlx-audio cannot load its own output
    rows = mx.load(str(clean / "voice_embedding" / "alice.safetensors"))["embedding"]
    np.testing.assert_array_equal(
        ours.codes, mlx_audio_codes(load_model(clean), rows, "alice", noise)
    )
    # The benchmarks show mlx-audio the directory without the copied original, as above.
    reference = load_reference(out)
    assert isinstance(reference.acoustic_transformer.semantic_codebook_output, nn.QuantizedLinear)
    assert (out / "consolidated.safetensors").is_file()


# --------------------------------------------------------------------------- prefix cache


def test_prefix_cache_changes_nothing_on_other_dimensions(odd: Path, tmp_path: Path) -> None:
    noise = np.random.default_rng(3).standard_normal((FRAMES, N_ACOUSTIC)).astype(np.float32)
    plain = our_codes(odd, "bob", noise)
    cache = tmp_path / "prefixes"
    first = our_codes(odd, "bob", noise, cache)  # computes and stores the prefix
    assert len(list(cache.iterdir())) == 1
    again = our_codes(odd, "bob", noise, cache)  # a new load reads it back
    for speech in (first, again):
        np.testing.assert_array_equal(speech.codes, plain.codes)
        np.testing.assert_array_equal(speech.audio, plain.audio)
    assert plain.audio.shape == (len(plain.codes) * SAMPLES_PER_FRAME,)


def test_a_codec_whose_frame_is_shorter_than_its_output_kernel_streams_exactly(
    tmp_path: Path,
) -> None:
    """Strides 1, 2, 3 give 6 steps a frame; a kernel of 13 mirrors 12 at the start, so the
    first chunk must hold 3 frames. Streaming frame by frame used to differ from the
    one-shot decode on the first frame."""
    path = build_random_checkpoint(
        tmp_path / "k13",
        odd_params(patch_proj_kernel_size=13),
        seed=1,
        voices={"alice": 7},
        dtype="float32",
        suppress_end=True,
    )
    tts = voxtral_mlx.load(path, prefix_cache_dir=None)
    try:
        assert tts.config.codec.first_chunk_frames == 3
        chunks = list(tts.stream(TEXT, "alice", seed=3, max_frames=6, chunk_frames=1))
        codes = np.concatenate([c.codes for c in chunks])
        assert len(codes) == 6
        assert [c.frames for c in chunks] == [3, 1, 1, 1]
        streamed = np.concatenate([c.audio for c in chunks])
        np.testing.assert_allclose(streamed, tts.decode(codes), rtol=1e-5, atol=1e-6)
    finally:
        tts.close()
