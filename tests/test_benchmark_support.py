"""The benchmarks' in-memory END suppression: any random checkpoint (not only those built
with END suppressed) runs the requested number of frames, in both implementations alike."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from benchmarks.common import (
    TEXT,
    VOICE,
    EndMasked,
    load_reference,
    mask_end,
    reference_voice,
    suppress_end,
)
from tests.mlx_audio_reference import injected_noise, recorded_frames, spec_codebook_floor
from voxtral_mlx.config import END_AUDIO

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

FRAMES = 12


@pytest.fixture(scope="module", params=["seed-3", "zero-head"])
def early_end_checkpoint(tmp_path_factory, request):
    """A float32 tiny checkpoint whose END wins at once: seed 3 with the benchmarks' text,
    or a semantic head of zeros, where every logit ties at 0 and END comes first (so a
    zeroed END row does not stop it)."""
    from safetensors.numpy import load_file, save_file

    from voxtral_mlx.synthetic.checkpoint import build_random_checkpoint

    path = build_random_checkpoint(
        tmp_path_factory.mktemp("early-end"), "tiny", seed=3, dtype="float32"
    )
    if request.param == "zero-head":
        weights = load_file(path / "consolidated.safetensors")
        name = "acoustic_transformer.semantic_codebook_output.weight"
        weights[name] = np.zeros_like(weights[name])
        save_file(weights, path / "consolidated.safetensors")
    return path


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


@pytest.mark.parametrize("quantized", [False, True])
def test_end_is_masked_even_where_every_other_logit_is_negative(quantized):
    """Zeroing END's row left it a logit of 0, which won where all others were negative
    (an outside random checkpoint ended at frame 1 and the benchmarks timed nothing)."""
    from types import SimpleNamespace

    head = nn.Linear(64, 16, bias=False)
    head.weight = mx.zeros((16, 64))
    head.weight[:, 0] = -1.0  # every logit negative for positive inputs...
    head.weight[END_AUDIO] = 0.0  # ...but END's
    if quantized:
        head = nn.QuantizedLinear.from_linear(head, group_size=64, bits=8)
    x = mx.ones((3, 64))
    assert (mx.argmax(head(x), axis=-1) == END_AUDIO).all()
    before = head(x)
    flow = SimpleNamespace(semantic_codebook_output=head)
    mask_end(flow)
    mask_end(flow)  # once only
    wrapped = flow.semantic_codebook_output
    assert isinstance(wrapped, EndMasked) and wrapped.head is head
    after = wrapped(x)
    assert not (mx.argmax(after, axis=-1) == END_AUDIO).any()
    keep = [i for i in range(16) if i != END_AUDIO]
    np.testing.assert_array_equal(np.array(after[:, keep]), np.array(before[:, keep]))


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_the_end_mask_stays_finite_in_the_logits_dtype(dtype):
    """-1e9 is -inf in float16: the engine took it for an overflow and every benchmark
    refused float16 checkpoints as damaged."""
    head = nn.Linear(64, 16, bias=False)
    head.set_dtype(dtype)
    wrapped = EndMasked(head)
    x = mx.random.normal((3, 64)).astype(dtype)
    out = wrapped(x)
    assert out.dtype == dtype and bool(mx.isfinite(out).all())
    assert not (mx.argmax(out, axis=-1) == END_AUDIO).any()
    assert float(out[:, END_AUDIO].max()) < -1000


def test_the_default_voice_is_picked_only_if_tekken_lists_it(tiny_checkpoint, tmp_path):
    import shutil

    from benchmarks.common import pick_voice

    model = tmp_path / "m"
    shutil.copytree(tiny_checkpoint, model)
    assert pick_voice(model) == VOICE
    tekken = json.loads((model / "tekken.json").read_text())
    del tekken["audio"]["voice_num_audio_tokens"][VOICE]
    (model / "tekken.json").write_text(json.dumps(tekken))
    picked = pick_voice(model)
    assert picked != VOICE and picked in tekken["audio"]["voice_num_audio_tokens"]


def test_a_directory_named_with_a_comma_is_one_config(tmp_path):
    from benchmarks.common import config_list

    odd = tmp_path / "a,b"
    odd.mkdir()
    assert config_list(str(odd)) == [str(odd)]
    assert config_list("tiny,wide") == ["tiny", "wide"]
    assert config_list(f"tiny,{tmp_path}") == ["tiny", str(tmp_path)]
    # A trailing comma was the current directory, refused only after the first run.
    with pytest.raises(SystemExit, match="holds an empty name"):
        config_list("tiny,")


def test_voice_files_named_but_for_case_are_picked_by_tekken_spelling(tiny_checkpoint, tmp_path):
    """Neutral_Female.pt (load() finds it as neutral_female) made the comparisons pick
    Ar_Male.pt and refuse it: not in tekken.json's list, which spells it ar_male."""
    import shutil

    from benchmarks.common import check_comparable, pick_voice

    model = tmp_path / "m"
    shutil.copytree(tiny_checkpoint, model)
    for f in (model / "voice_embedding").iterdir():
        f.rename(f.with_name(f.stem.title() + f.suffix))
    assert pick_voice(model) == VOICE
    (model / "voice_embedding" / f"{VOICE.title()}.pt").unlink()
    picked = pick_voice(model)
    assert picked == picked.lower() and picked != VOICE
    assert check_comparable(model, picked) == "mistral"


def test_a_voice_mlx_audio_cannot_use_is_refused_in_one_line(tiny_checkpoint, tmp_path):
    """mlx-audio's tokenizer knows only the voices tekken.json lists; voxtral_mlx takes any
    voice file. The comparison picks a listed voice, or says why there is none."""
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


def test_a_built_in_name_is_the_built_in_config_beside_a_directory_of_that_name(
    tmp_path, monkeypatch
):
    from benchmarks.common import is_model_dir

    (tmp_path / "tiny").mkdir()
    (tmp_path / "mine").mkdir()
    monkeypatch.chdir(tmp_path)
    assert not is_model_dir("tiny")
    assert is_model_dir("./tiny") and is_model_dir("mine")


def test_a_voxtral_error_in_a_script_is_one_line(monkeypatch):
    from benchmarks.common import run_script
    from voxtral_mlx.errors import VoiceError

    def main():
        raise VoiceError("voice 'x' has 218 rows but tekken.json expects 150")

    monkeypatch.setattr("sys.argv", ["frame_speed.py"])
    with pytest.raises(SystemExit) as exc:
        run_script(main)
    assert exc.value.code == "frame_speed.py: voice 'x' has 218 rows but tekken.json expects 150"
    with pytest.raises(SystemExit) as exc:
        run_script(lambda: 3)
    assert exc.value.code == 3


@pytest.fixture(scope="module")
def converted(tiny_checkpoint_noend, tmp_path_factory) -> Path:
    """An 8-bit float32 MLX conversion (mlx-audio's names, voices as .safetensors)."""
    from voxtral_mlx.convert import convert_model

    out = tmp_path_factory.mktemp("converted") / "q8"
    return convert_model(tiny_checkpoint_noend, out, q_bits=8, dtype="float32").path


def test_a_conversion_is_compared_with_mlx_audio_reading_it_with_its_own_loader(converted):
    """``make bench MODEL=DIR`` on an MLX conversion (mlx-community's layout, quantized):
    mlx-audio reads the same directory with its loader, and on the same noise both speak the
    same codes, so the timings compare like with like (float32: exact on this CPU)."""
    import voxtral_mlx
    from benchmarks.common import check_comparable

    assert check_comparable(converted, VOICE) == "mlx"
    ref = load_reference(converted)
    assert isinstance(ref.acoustic_transformer.semantic_codebook_output, nn.QuantizedLinear)
    reference_voice(ref, converted, VOICE, mx.float32)
    noise = np.random.default_rng(1).standard_normal((FRAMES, 36)).astype(np.float32)
    tts = voxtral_mlx.load(converted, prefix_cache_dir=None)
    try:
        suppress_end(tts, ref)
        ours = tts.synthesize(TEXT, VOICE, noise=noise, max_frames=FRAMES)
    finally:
        tts.close()
    with recorded_frames(ref) as recorded, injected_noise(noise), spec_codebook_floor():
        list(ref.generate(TEXT, voice=VOICE, max_tokens=FRAMES))
    assert len(ours.codes) == FRAMES
    np.testing.assert_array_equal(ours.codes, np.stack(recorded))


def test_a_conversion_beside_the_original_is_compared_without_it(
    tiny_checkpoint_noend, converted, tmp_path
):
    """mlx-audio's converter leaves the source's consolidated.safetensors beside its output:
    voxtral_mlx loads the conversion, and mlx-audio is shown the directory without the
    original (its loader would read every *.safetensors), so both run the conversion."""
    import shutil

    from benchmarks.common import check_comparable

    both = tmp_path / "both"
    shutil.copytree(converted, both)
    shutil.copy(tiny_checkpoint_noend / "consolidated.safetensors", both)
    assert check_comparable(both, VOICE) == "mlx"
    ref = load_reference(both)
    assert isinstance(ref.acoustic_transformer.semantic_codebook_output, nn.QuantizedLinear)
    assert (both / "consolidated.safetensors").is_file()  # the directory is left as it was
    (both / "consolidated.safetensors").unlink()
    (both / "config.json").unlink()
    with pytest.raises(SystemExit) as exc:
        check_comparable(both)
    assert "config.json" in str(exc.value) and "\n" not in str(exc.value)


def test_voices_under_another_key_reach_mlx_audio_as_voxtral_mlx_reads_them(converted, tmp_path):
    import shutil

    other = tmp_path / "other"
    shutil.copytree(converted, other)
    path = other / "voice_embedding" / f"{VOICE}.safetensors"
    rows = mx.load(str(path))["embedding"]
    mx.save_safetensors(str(path), {"voice": rows})
    ref = load_reference(other)
    reference_voice(ref, other, VOICE, mx.float32)
    assert mx.array_equal(ref._voice_embeddings[VOICE], rows.astype(mx.float32)).item()


def test_the_codec_benchmark_reads_a_conversions_codec(tiny_checkpoint_noend, converted, scripts):
    from codec_bench import codec_weights

    config, source = codec_weights(str(tiny_checkpoint_noend))
    config_c, theirs = codec_weights(str(converted))
    assert config_c.codec == config.codec
    assert sorted(theirs) == sorted(source) and len(source) > 20
    for name, value in source.items():
        np.testing.assert_array_equal(np.array(theirs[name]), np.array(value), err_msg=name)


def test_the_suite_on_a_quantized_checkpoint_leaves_out_the_quantization_agreement(
    tiny_checkpoint_noend, converted, scripts
):
    from run import model_suite

    scripts_of = lambda model: [cmd[0] for cmd in model_suite(str(model))]  # noqa: E731
    assert "quant_agreement.py" in scripts_of(tiny_checkpoint_noend)
    on_converted = scripts_of(converted)
    assert "quant_agreement.py" not in on_converted
    assert {"frame_speed.py", "ttfa.py", "codec_bench.py"} <= set(on_converted)


def test_the_suite_leaves_out_comparisons_mlx_audio_cannot_make(
    converted, scripts, tmp_path, capsys
):
    """MLX weights without config.json load, but mlx-audio cannot read them: three scripts
    failed one after the other and the suite exited 1."""
    import shutil

    from run import model_suite

    bare = Path(shutil.copytree(converted, tmp_path / "bare"))
    (bare / "config.json").unlink()
    suite = model_suite(str(bare))
    assert [cmd[0] for cmd in suite][:3] == [
        "frame_speed.py",
        "codec_bench.py",
        "batch_throughput.py",
    ]
    assert suite[0][-1] == "--no-reference"
    assert "MLX weights without config.json" in capsys.readouterr().out


def test_repeats_and_frames_must_be_at_least_one(scripts, capsys):
    from frame_speed import main as frame_speed
    from ttfa import main as ttfa

    for main in (frame_speed, ttfa):
        with pytest.raises(SystemExit):
            main(["--repeats", "0", "--no-record"])
        assert "must be at least 1, got 0" in capsys.readouterr().err


def test_long_prompt_sets_every_part_mode(scripts):
    """The "parts" and "one" modes crashed on int("parts") before sizes were looked at."""
    from long_prompt import ONE_PASS, set_parts

    class Engine:
        MIN_PREFILL_PART_TOKENS = PREFILL_PART_TOKENS = 0

    for mode, want in (("parts", (16, 256)), ("one", (ONE_PASS, ONE_PASS)), ("64", (64, 64))):
        set_parts(Engine, mode, (16, 256))
        got = (Engine.MIN_PREFILL_PART_TOKENS, Engine.PREFILL_PART_TOKENS)
        assert got == want, mode


def test_a_directory_that_is_no_model_is_named_as_such(tmp_path, scripts):
    from batch_throughput import main as batch_throughput
    from first_request import main as first_request

    (tmp_path / "voice_embedding").mkdir()
    for main, flag in ((first_request, "--configs"), (batch_throughput, "--config")):
        with pytest.raises(SystemExit, match=r"no params\.json: it is not a Voxtral TTS model"):
            main([flag, str(tmp_path), "--no-record"])


def test_batch_throughput_measures_a_directory_in_its_own_dtype(tmp_path, scripts, capsys):
    from batch_throughput import main

    from voxtral_mlx.synthetic.checkpoint import build_random_checkpoint

    path = build_random_checkpoint(tmp_path / "f32", "tiny", dtype="float32")
    assert main(["--config", str(path), "--frames", "1", "--repeats", "1", "--no-record"]) == 0
    assert "f32: float32 compute" in capsys.readouterr().out


def test_new_voice_measures_both_ways_and_restores_the_part_size(tiny_checkpoint, scripts):
    import new_voice

    import voxtral_mlx.engine as engine

    m = new_voice.measure(str(tiny_checkpoint), 1)
    assert engine.PREFIX_PART_TOKENS == 64
    assert m["positions"] > 64  # the longest voice: more than one part
    for key in ("ttfa", "stall", "cancel"):
        assert 0 < m[f"{key}_parts"] < 60 and 0 < m[f"{key}_one"] < 60, m


def _presets(wpf) -> dict[str, object]:
    return dict(wpf.presets())


def test_weights_per_frame_counts_the_release_as_its_manifest(scripts):
    """The real config's bf16 tensors come to the bytes of Mistral's published file, and
    a frame reads the backbone once and the flow layers at each of the 7 Euler steps."""
    import weights_per_frame as wpf

    from voxtral_mlx.config import ModelConfig
    from voxtral_mlx.synthetic.checkpoint import make_params

    manifest = json.loads(
        (Path(__file__).parent / "data/reference/checkpoint_manifest.json").read_text()
    )

    def bf16_bytes(prefix: str) -> int:
        return sum(
            2 * int(np.prod(t["shape"])) for n, t in manifest.items() if n.startswith(prefix)
        )

    config = ModelConfig.from_params(make_params("full"))
    parts = wpf.frame_bytes(config, _presets(wpf)["bf16 (Mistral's release)"], 1)
    assert parts["stored"] == bf16_bytes("")
    assert parts["backbone"] == bf16_bytes("layers.") + bf16_bytes("norm.")
    flow = bf16_bytes("acoustic_transformer.")
    once = sum(
        bf16_bytes(f"acoustic_transformer.{n}")
        for n in ("semantic_codebook_output", "llm_projection")
    )
    never = bf16_bytes("acoustic_transformer.time_projection")
    assert parts["flow_head"] == once + 7 * (flow - once - never)


@pytest.mark.parametrize(
    ("label", "bits", "flow_bits"),
    [
        ("convert --q-bits 4 (flow head 8)", 4, None),
        ("convert --q-bits 6 (flow head 8)", 6, None),
        ("convert --q-bits 4 --q-flow-bits 4", 4, 4),
    ],
)
def test_weights_per_frame_counts_what_convert_writes(
    tiny_checkpoint_bf16, tmp_path, scripts, label, bits, flow_bits
):
    import weights_per_frame as wpf

    from voxtral_mlx.convert import convert_model
    from voxtral_mlx.loader import open_weights, read_model_config

    out = convert_model(
        tiny_checkpoint_bf16, tmp_path / "q", q_bits=bits, q_flow_bits=flow_bits
    ).path
    config = read_model_config(out)
    weights = open_weights(out, config)
    spec = _presets(wpf)[label]
    assert wpf.layer_specs(config, spec) == weights.quantized
    written = sum(r.info.end - r.info.start for r in weights.tensors.values())
    assert wpf.frame_bytes(config, spec, 1)["stored"] == written


@pytest.mark.parametrize("bits", [4, 6])
def test_weights_per_frame_quantizes_what_mlx_audio_converts(
    tiny_checkpoint_bf16, tmp_path, scripts, bits
):
    """The mlx-community rows pack the layers mlx-audio's own converter packs."""
    import weights_per_frame as wpf

    from tests.mlx_audio_reference import build_mlx_community
    from voxtral_mlx.loader import open_weights, read_model_config

    out = build_mlx_community(tiny_checkpoint_bf16, tmp_path / f"{bits}bit", bits)
    config = read_model_config(out)
    packed = wpf.layer_specs(config, _presets(wpf)[f"mlx-community {bits}bit"])
    assert packed == open_weights(out, config).quantized
    assert "acoustic_transformer.layers.0.attention.wq" in packed


def test_marginal_cost_is_the_median_of_each_pairs_difference():
    """Drift between repeats cancels within a pair: the difference of the two separate
    medians (3.5 - 3.0 s here) would give half the per-pair figure."""
    from benchmarks.common import median_marginal_ms

    pairs = [(1.0, 2.0), (3.0, 3.5), (5.0, 7.0)]  # (n1 frames, n2 frames) seconds
    assert median_marginal_ms(pairs, 1, 3) == pytest.approx(500.0)  # 1 s over 2 frames


def test_a_recorded_section_states_its_number_of_runs(tmp_path, monkeypatch):
    import benchmarks.common as common

    monkeypatch.setattr(common, "RESULTS", tmp_path / "RESULTS.md")
    table = [("a", "b"), ("1", "2")]
    assert "- runs: medians of 5\n" in common.record("T", "cmd", table, runs=5)
    assert "- runs:" not in common.record("T", "cmd", table)


def test_memory_bandwidth_is_measured_on_one_core_and_on_all(scripts):
    import os

    from weight_bound import bandwidths

    if mx.default_device() == mx.gpu:
        pytest.skip("on a GPU one figure is measured, MLX's own sum")
    figures = bandwidths(1 << 22)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    want = ["1 core"] + ([f"{cores} cores"] if cores > 1 else [])
    assert [who for who, _ in figures] == want  # the bound uses the last: all cores
    assert all(gbs > 0 for _, gbs in figures)


def test_peak_memory_counts_the_weights_and_what_the_run_held(scripts):
    from frame_speed import peak_mib

    def run():
        held = mx.zeros((4 << 20) // 4, mx.float32)  # 4 MiB, then freed
        mx.eval(held)
        return "done"

    result, mib = peak_mib(run, 1 << 20)  # 1 MiB of weights
    assert result == "done" and mib >= 5


def test_the_codec_benchmark_runs_a_directory_in_its_own_dtype(
    tiny_checkpoint, tiny_checkpoint_bf16, tmp_path, scripts
):
    from codec_bench import codec_config, own_dtype

    assert own_dtype("tiny") == mx.float32
    assert own_dtype(str(tiny_checkpoint)) == mx.float32
    assert own_dtype(str(tiny_checkpoint_bf16)) == mx.bfloat16
    with pytest.raises(SystemExit) as exc:
        codec_config(str(tmp_path))
    assert "give a checkpoint directory" in str(exc.value)
    assert "Hugging Face" not in str(exc.value)


def test_the_suite_runs_a_directory_in_its_own_dtype_and_medians_of_five(tiny_checkpoint, scripts):
    from run import FULL, model_suite

    codec = next(cmd for cmd in model_suite(str(tiny_checkpoint)) if cmd[0] == "codec_bench.py")
    assert "--dtype" not in codec
    for cmd in FULL:  # fewer runs only where a 26-layer frame takes minutes
        if "--repeats" in cmd and int(cmd[cmd.index("--repeats") + 1]) < 5:
            assert cmd[0] in ("frame_speed.py", "weight_bound.py") and "full" in cmd, cmd


def test_time_to_first_audio_leaves_the_users_voice_prefixes_alone(
    tiny_checkpoint_noend, tmp_path, monkeypatch, scripts
):
    """It clears the prefix cache to time a new voice: in a folder of its own, not the
    user's (where a real checkpoint's saved voices are)."""
    import ttfa

    import voxtral_mlx

    monkeypatch.setenv("VOXTRAL_MLX_CACHE", str(tmp_path))
    tts = voxtral_mlx.load(tiny_checkpoint_noend)
    tts.synthesize(TEXT, VOICE, max_frames=1)
    tts.close()
    saved = sorted((tmp_path / "prefixes").iterdir())
    assert saved
    ttfa.measure(str(tiny_checkpoint_noend), 1, default_interval=False)
    assert sorted((tmp_path / "prefixes").iterdir()) == saved


def test_revision_compare_runs_each_tree_whatever_the_working_directory(
    tmp_path, monkeypatch, scripts
):
    """``python -c`` puts the working directory first on sys.path: run from a checkout (the
    repository root), both revisions used to import that checkout's voxtral_mlx."""
    from revision_compare import run_child

    for name in ("before", "after", "cwd"):
        package = tmp_path / name / "voxtral_mlx"
        package.mkdir(parents=True)
        (package / "__init__.py").write_text(f"TREE = {name!r}\n")
    monkeypatch.chdir(tmp_path / "cwd")
    child = "import json, voxtral_mlx; print(json.dumps([voxtral_mlx.TREE]))"
    assert run_child("../before", child, []) == ["before"]
    assert run_child(str(tmp_path / "after"), child, []) == ["after"]
    (tmp_path / "empty").mkdir()  # no voxtral_mlx: the installed one would be timed
    with pytest.raises(SystemExit, match=r"imported voxtral_mlx from .*, not from this tree"):
        run_child(str(tmp_path / "empty"), child, [])


@pytest.mark.parametrize(
    ("codebooks", "words"),
    [
        ({"semantic_codebook_size": 200}, "holds 1024 rows for 1030 codes"),
        ({"semantic_codebook_size": 127}, "semantic head 128 outputs for 129"),
    ],
)
def test_codebooks_mlx_audio_cannot_hold_are_refused_before_timing(tmp_path, codebooks, words):
    """A checkpoint mlx-audio's code table or semantic head is too small for was reported
    only when its load failed, and run.py then failed three scripts instead of timing
    voxtral_mlx alone."""
    from benchmarks.common import check_comparable
    from voxtral_mlx.synthetic.checkpoint import build_random_checkpoint, make_params

    params = make_params("tiny")
    audio = params["multimodal"]["audio_model_args"]
    audio.update(codebooks)
    params["multimodal"]["audio_tokenizer_args"].update(codebooks)
    path = build_random_checkpoint(tmp_path / "m", params, voices={VOICE: 5})
    with pytest.raises(SystemExit) as exc:
        check_comparable(path, VOICE)
    message = str(exc.value)
    assert words in message and "--no-reference" in message and "\n" not in message


def test_model_load_times_a_directory_and_a_quit_while_loading(tiny_checkpoint, scripts, capsys):
    from mlx.utils import tree_flatten
    from model_load import main

    from voxtral_mlx.loader import load_model_dir

    args = ["--configs", str(tiny_checkpoint), "--repeats", "1", "--hub-latency", "0.3"]
    assert main([*args, "--no-record"]) == 0
    header, row = capsys.readouterr().out.strip().splitlines()[-2:]
    assert header.startswith("config | weights | load()")
    assert "the Hub answering in 0.3 s" in header
    name, weights, load, rate, peak, by_repo, paid, quit_wait = row.split(" | ")
    # The Hub's (simulated) answer is awaited: a repo id's load takes at least its latency.
    by_repo_s, load_s = float(by_repo.removesuffix(" s")), float(load.removesuffix(" s"))
    assert by_repo_s >= 0.3
    assert abs(float(paid) - (by_repo_s - load_s) / 0.3) < 0.05  # (rounded to 0.01 s)
    model = load_model_dir(tiny_checkpoint).model
    expected = sum(a.nbytes for _, a in tree_flatten(model.parameters()))
    assert name == tiny_checkpoint.name and weights == f"{expected / 2**20:.0f} MiB"
    assert float(load.removesuffix(" s")) > 0 and rate.endswith(" GB/s")
    assert int(peak.removesuffix(" MiB")) >= expected / 2**20 - 1
    assert 0 < float(quit_wait.removesuffix(" s")) < 10
