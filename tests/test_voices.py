"""Voice registry (scan, lazy loading, validation) and the .pt -> safetensors converter."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import unicodedata
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import voxtral_mlx.voices as voices_mod
from voxtral_mlx.errors import UnsafePickleError, VoiceError, VoxtralError
from voxtral_mlx.torch_pickle import PtTensor, write_pt
from voxtral_mlx.voices import (
    LANGUAGE_NAMES,
    MAX_VOICE_ROWS,
    Voice,
    VoiceRegistry,
    convert_voice_files,
    voice_language,
)

REFERENCE = Path(__file__).with_name("data") / "reference" / "voices.json"
REPO = Path(__file__).resolve().parent.parent
DIM = 48


def expected_tokens() -> dict[str, int]:
    if REFERENCE.exists():
        return json.loads(REFERENCE.read_text())["voice_num_audio_tokens"]
    return {"casual_male": 147, "fr_female": 97, "hi_male": 94}


def bf16_voice(rows: int, dim: int = DIM, seed: int = 0, finite: bool = True) -> torch.Tensor:
    """Random bf16 bit patterns; ``finite=False`` keeps the NaN/inf patterns too (a damaged
    voice, which the converter and the registry refuse)."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 2**16, (rows, dim), generator=g, dtype=torch.int32)
    if finite:  # exponent all ones (NaN/inf) -> clear its lowest bit
        bits = torch.where(bits & 0x7F80 == 0x7F80, bits ^ 0x0080, bits)
    return bits.to(torch.int16).view(torch.bfloat16)


def raw_bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def mx_bits(a: mx.array) -> bytes:
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.array(a).tobytes()


def one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text and isinstance(exc.value, VoxtralError)
    return text


# --------------------------------------------------------------------------- languages


def test_voice_languages() -> None:
    langs = {name: voice_language(name) for name in expected_tokens()}
    for name, lang in langs.items():
        prefix = name.split("_")[0]
        assert lang == ("en" if prefix in ("casual", "cheerful", "neutral") else prefix), name
        assert lang in LANGUAGE_NAMES
    assert set(LANGUAGE_NAMES) == {"en", "fr", "es", "de", "it", "pt", "nl", "ar", "hi"}
    assert LANGUAGE_NAMES["fr"] == "French" and LANGUAGE_NAMES["en"] == "English"
    assert voice_language("my_clone") is None
    assert voice_language("fr") is None
    assert voice_language("de_custom") == "de"


# --------------------------------------------------------------------------- registry


def make_voice_dir(root: Path, names: dict[str, int], kind: str = "pt") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i, (name, rows) in enumerate(names.items()):
        t = bf16_voice(rows, seed=i)
        if kind == "pt":
            torch.save(t, root / f"{name}.pt")
        else:
            arr = mx.array(t.view(torch.uint16).numpy()).view(mx.bfloat16)
            mx.save_safetensors(str(root / f"{name}.safetensors"), {"embedding": arr})
    return root


def test_scan_by_name_only(tmp_path: Path) -> None:
    tokens = expected_tokens()
    vdir = tmp_path / "voice_embedding"
    vdir.mkdir()
    for name in ["casual_male", "fr_female", "my_clone"]:
        (vdir / f"{name}.pt").write_bytes(b"not read during the scan")
    (vdir / "fr_female.safetensors").write_bytes(b"also not read")
    (vdir / "README.md").write_text("ignored")
    (vdir / "._casual_male.pt").write_bytes(b"macOS resource fork")
    (vdir / "notes.json").write_text("{}")
    (vdir / "subdir.pt").mkdir()

    reg = VoiceRegistry.from_dir(vdir, tokens, DIM)
    assert list(reg) == ["casual_male", "fr_female", "my_clone"]
    assert len(reg) == 3 and "fr_female" in reg and "hi_male" not in reg  # no file, no voice
    assert reg["fr_female"].path.name == "fr_female.safetensors"  # preferred over .pt
    assert reg["casual_male"] == Voice(
        "casual_male", vdir / "casual_male.pt", "en", tokens["casual_male"]
    )
    assert reg.get_voice("my_clone").num_tokens is None
    assert reg.get_voice("my_clone").language is None
    assert reg.get("nope") is None


def test_missing_dir_gives_empty_registry(tmp_path: Path) -> None:
    for vdir in (None, tmp_path / "absent"):
        reg = VoiceRegistry.from_dir(vdir, expected_tokens(), DIM)
        assert len(reg) == 0
        with pytest.raises(VoiceError) as exc:
            reg.get_voice("casual_male")
        assert "no voice files" in one_line(exc)
    (tmp_path / "file").write_text("x")
    with pytest.raises(VoiceError):
        VoiceRegistry.from_dir(tmp_path / "file", {}, DIM)


def test_voice_names_ignore_case_when_unambiguous(tmp_path: Path) -> None:
    """As `say -v`: another case of one name is that voice; of two names, neither."""
    vdir = make_voice_dir(tmp_path / "v", {"neutral_male": 5, "Mixed": 5, "mixed": 5})
    reg = VoiceRegistry.from_dir(vdir, {}, DIM)
    assert reg.get_voice("Neutral_Male").name == "neutral_male"
    assert reg.get_voice("mixed").name == "mixed" and reg.get_voice("Mixed").name == "Mixed"
    with pytest.raises(VoiceError, match="voice 'MIXED' is ambiguous: it matches Mixed, mixed"):
        reg.get_voice("MIXED")
    first = reg.embedding("NEUTRAL_MALE")  # read once, kept under the voice's own name
    assert reg.embedding("Neutral_male") is first and reg.cached("neutral_male") is first


def test_a_name_stored_decomposed_is_found_as_typed(tmp_path: Path) -> None:
    """macOS's older disks and zips made on a Mac store "café" decomposed (e + U+0301): the
    name typed composed found no voice, while the error listed "café" as available; and
    one unprintable name escaped every other accented name in that list."""
    nfd = unicodedata.normalize("NFD", "café")
    vdir = make_voice_dir(tmp_path / "v", {nfd: 5, "naïve": 5, "x\x1bred": 5})
    reg = VoiceRegistry.from_dir(vdir, {}, DIM)
    assert reg.get_voice("café").name == nfd and reg.get_voice("CAFÉ").name == nfd
    assert reg.get_voice(unicodedata.normalize("NFD", "naïve")).name == "naïve"
    with pytest.raises(VoiceError) as exc:
        reg.get_voice("nope")
    assert "naïve" in one_line(exc) and "\\x1b" in one_line(exc)
    # tekken.json names it composed: the file is no "missing" voice, its row count applies.
    reg = VoiceRegistry.from_dir(vdir, {"café": 6, "naïve": 5}, DIM)
    assert reg.missing == [] and reg.get_voice("café").num_tokens == 6
    with pytest.raises(VoiceError, match=r"has 5 rows but tekken\.json expects 6"):
        reg.embedding("café")


def test_a_broken_safetensors_voice_names_the_pt_beside_it(tmp_path: Path) -> None:
    """The .safetensors of a name is taken before its .pt: when it is damaged, the error
    says that removing it lets the intact .pt beside it be used."""
    vdir = make_voice_dir(tmp_path / "v", {"fr_male": 5})
    (vdir / "fr_male.safetensors").write_bytes(b"not a safetensors file at all")
    reg = VoiceRegistry.from_dir(vdir, {}, DIM)
    with pytest.raises(VoiceError) as exc:
        reg.embedding("fr_male")
    assert one_line(exc).endswith("(or remove it: fr_male.pt beside it is used then)")
    (vdir / "fr_male.safetensors").unlink()
    assert VoiceRegistry.from_dir(vdir, {}, DIM).embedding("fr_male").shape == (5, DIM)


def test_a_voice_of_integers_is_named_with_its_dtype(tmp_path: Path) -> None:
    """The message said "holds mlx.core.int64 values" (MLX's repr) where convert-voices
    says "I64": the dtype's own name now."""
    vdir = tmp_path / "v"
    vdir.mkdir()
    torch.save(torch.zeros(5, DIM, dtype=torch.int64), vdir / "ints.pt")
    reg = VoiceRegistry.from_dir(vdir, {}, DIM)
    with pytest.raises(VoiceError) as exc:
        reg.embedding("ints")
    assert "holds int64 values, not floats" in one_line(exc)


def test_a_voice_beyond_float16_names_the_dtype(tmp_path: Path) -> None:
    vdir = tmp_path / "v"
    vdir.mkdir()
    torch.save(torch.full((5, DIM), 1e5), vdir / "loud.pt")
    reg = VoiceRegistry.from_dir(vdir, {}, DIM)
    with pytest.raises(VoiceError) as exc:
        reg.embedding("loud", mx.float16)
    assert "beyond the range of float16; load the model in float32" in one_line(exc)


def test_unknown_voice_lists_names(tmp_path: Path) -> None:
    vdir = make_voice_dir(tmp_path / "v", {"neutral_male": 5, "de_female": 5, "ar_male": 5})
    reg = VoiceRegistry.from_dir(vdir, {}, DIM)
    with pytest.raises(VoiceError) as exc:
        reg.get_voice("klingon_male")
    text = one_line(exc)
    assert "'klingon_male'" in text
    assert "ar_male, de_female, neutral_male" in text  # sorted
    assert "voxtral-mlx voices" in text
    with pytest.raises(VoiceError):
        reg.embedding("klingon_male")
    with pytest.raises(KeyError):
        reg["klingon_male"]


def test_a_listed_voice_without_a_file_is_named_as_missing(tmp_path: Path) -> None:
    """A snapshot missing one voice file said "unknown voice" (or "has no voice
    'casual_male', the default one"), as if the model never had it."""
    vdir = make_voice_dir(tmp_path / "v", {"neutral_male": 5, "de_female": 5})
    listed = {"neutral_male": 5, "de_female": 5, "casual_male": 5}
    reg = VoiceRegistry.from_dir(vdir, listed, DIM)
    assert list(reg) == ["de_female", "neutral_male"] and reg.missing == ["casual_male"]
    for name in ("casual_male", "Casual_Male"):
        with pytest.raises(VoiceError) as exc:
            reg.get_voice(name)
        text = one_line(exc)
        assert f"voice '{name}' is listed in tekken.json but has no file in {vdir}" in text
        assert "fetch the model again" in text
    with pytest.raises(VoiceError, match="unknown voice 'klingon_male'"):
        reg.get_voice("klingon_male")


def test_the_cli_names_a_missing_default_voice_file(tiny_checkpoint, tmp_path, capsys) -> None:
    from voxtral_mlx import cli

    model = tmp_path / "model"
    shutil.copytree(tiny_checkpoint, model)
    (model / "voice_embedding" / "casual_male.pt").unlink()
    assert cli.main(["speak", "-m", str(model), "Hi.", "-o", str(tmp_path / "x.wav")]) == 1
    err = capsys.readouterr().err
    assert "has no voice 'casual_male', the default one (tekken.json lists it, but its " in err
    assert "file is missing: an incomplete download? fetch the model again): name a voice" in err
    args = ["speak", "-m", str(model), "-v", "casual_male", "Hi.", "-o", str(tmp_path / "x.wav")]
    assert cli.main(args) == 1
    assert "voice 'casual_male' is listed in tekken.json but has no file" in capsys.readouterr().err
    assert cli.main(["voices", "-m", str(model)]) == 0
    out, err = capsys.readouterr()
    assert "casual_male" not in out and "neutral_male" in out
    assert "tekken.json lists voices that have no file" in err and "casual_male" in err
    for path in (model / "voice_embedding").iterdir():
        path.unlink()
    # No voice file at all: the folder is what is missing, as before.
    assert cli.main(["voices", "-m", str(model)]) == 1
    assert "has no voices in voice_embedding/" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["pt", "safetensors"])
def test_embedding_loads_lazily_and_caches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    tokens = {"casual_male": 7, "fr_female": 4}
    vdir = make_voice_dir(tmp_path / "v", tokens, kind)
    calls: list[str] = []
    if kind == "pt":
        real = voices_mod.read_pt
        monkeypatch.setattr(
            voices_mod, "read_pt", lambda p, *a, **kw: calls.append(p.name) or real(p, **kw)
        )
    else:
        real_load = mx.load
        monkeypatch.setattr(mx, "load", lambda p, *a: calls.append(Path(p).name) or real_load(p))

    reg = VoiceRegistry.from_dir(vdir, tokens, DIM)
    assert calls == []
    emb = reg.embedding("casual_male")
    assert calls == [f"casual_male.{kind}"]
    assert emb.dtype == mx.bfloat16 and tuple(emb.shape) == (7, DIM)
    assert mx_bits(emb) == raw_bits(bf16_voice(7, seed=0))
    assert reg.embedding("casual_male") is emb
    as_f32 = reg.embedding("casual_male", mx.float32)
    assert as_f32.dtype == mx.float32 and reg.embedding("casual_male", mx.float32) is as_f32
    assert reg.embedding("casual_male", mx.bfloat16) is emb
    assert calls == [f"casual_male.{kind}"]  # casts reuse the loaded array
    reg.embedding("fr_female")
    assert calls == [f"casual_male.{kind}", f"fr_female.{kind}"]


def test_concurrent_first_use_reads_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    vdir = make_voice_dir(tmp_path / "v", {"it_male": 6})
    calls: list[int] = []
    real = voices_mod.read_pt
    monkeypatch.setattr(voices_mod, "read_pt", lambda p, *a, **kw: calls.append(1) or real(p, **kw))
    reg = VoiceRegistry.from_dir(vdir, {"it_male": 6}, DIM)
    results: list[mx.array] = []
    threads = [
        threading.Thread(target=lambda: results.append(reg.embedding("it_male"))) for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(results) == 8 and all(r is results[0] for r in results)


def test_validation_errors(tmp_path: Path) -> None:
    vdir = tmp_path / "v"
    vdir.mkdir()
    torch.save(bf16_voice(5), vdir / "casual_male.pt")  # tekken expects 6
    torch.save(bf16_voice(6, dim=DIM + 1), vdir / "fr_male.pt")  # wrong width
    torch.save(torch.zeros(DIM, dtype=torch.bfloat16), vdir / "es_male.pt")  # 1-D
    torch.save(torch.zeros(0, DIM, dtype=torch.bfloat16), vdir / "x_empty.pt")  # no rows
    torch.save(torch.zeros(3, DIM, dtype=torch.int32), vdir / "x_int.pt")
    torch.save(bf16_voice(9), vdir / "my_clone.pt")  # not in tekken: any rows
    (vdir / "nl_male.pt").write_bytes(b"garbage")
    reg = VoiceRegistry.from_dir(vdir, {"casual_male": 6, "fr_male": 6, "es_male": 1}, DIM)
    checks = {
        "casual_male": ("5 rows", "expects 6", "re-download it from the checkpoint"),
        "fr_male": (f"{DIM + 1} wide", str(DIM)),
        "es_male": ("2-D",),
        "x_empty": ("no rows",),
        "x_int": ("int32",),
        "nl_male": ("nl_male.pt",),
    }
    for name, needles in checks.items():
        with pytest.raises(VoiceError) as exc:
            reg.embedding(name)
        text = one_line(exc)
        for needle in needles:
            assert needle in text, (name, text)
    assert tuple(reg.embedding("my_clone").shape) == (9, DIM)
    save_file(
        {"embedding": torch.zeros(5, DIM, dtype=torch.bfloat16)}, str(vdir / "de_male.safetensors")
    )
    reg = VoiceRegistry.from_dir(vdir, {"de_male": 6}, DIM)
    with pytest.raises(
        VoiceError,
        match=r"expects 6 \(one of the two files is damaged\); re-convert it from the checkpoint's "
        r"\.pt .*, or tekken\.json if the voice is intact",
    ):
        reg.embedding("de_male")


def test_float64_voice_is_served_as_float32(tmp_path: Path) -> None:
    """Metal has no float64: a float64 .pt voice must come out as float32 (the cast to the
    compute dtype would fail on the GPU), with the values of the file."""
    vdir = tmp_path / "v"
    vdir.mkdir()
    t = torch.randn(4, DIM, dtype=torch.float64)
    torch.save(t, vdir / "x_f64.pt")
    emb = VoiceRegistry.from_dir(vdir, {}, DIM).embedding("x_f64")
    assert emb.dtype == mx.float32
    assert np.array_equal(np.array(emb), t.numpy().astype(np.float32))


def test_a_float64_voice_converts_to_a_file_the_model_reads(tmp_path: Path) -> None:
    """convert-voices wrote F64, which MLX cannot read: the .safetensors (read before the
    .pt) then broke a voice that worked. It is written as the float32 the model serves."""
    vdir = tmp_path / "v"
    vdir.mkdir()
    t = torch.randn(4, DIM, dtype=torch.float64)
    torch.save(t, vdir / "x_f64.pt")
    served = np.array(VoiceRegistry.from_dir(vdir, {}, DIM).embedding("x_f64"))
    convert_voice_files([vdir / "x_f64.pt"], vdir)
    assert load_file(str(vdir / "x_f64.safetensors"))["embedding"].dtype == torch.float32
    emb = VoiceRegistry.from_dir(vdir, {}, DIM).embedding("x_f64")
    assert emb.dtype == mx.float32 and np.array_equal(np.array(emb), served)


def test_a_float64_safetensors_voice_is_served_as_float32(tmp_path: Path) -> None:
    """mx.load refuses F64 safetensors; the voice was reported as damaged ("re-download")."""
    vdir = tmp_path / "v"
    vdir.mkdir()
    t = torch.randn(4, DIM, dtype=torch.float64)
    save_file({"embedding": t}, str(vdir / "x_f64.safetensors"))
    emb = VoiceRegistry.from_dir(vdir, {}, DIM).embedding("x_f64")
    assert emb.dtype == mx.float32
    assert np.array_equal(np.array(emb), t.numpy().astype(np.float32))


def test_a_voice_of_thousands_of_rows_is_refused(tmp_path: Path) -> None:
    """A 70,000-row voice was prefilled as one prompt: tens of GB, then a segfault."""
    vdir = tmp_path / "v"
    vdir.mkdir()
    torch.save(torch.zeros(MAX_VOICE_ROWS + 1, DIM, dtype=torch.bfloat16), vdir / "huge.pt")
    torch.save(torch.zeros(MAX_VOICE_ROWS, DIM, dtype=torch.bfloat16), vdir / "big.pt")
    registry = VoiceRegistry.from_dir(vdir, {}, DIM)
    assert registry.embedding("big").shape == (MAX_VOICE_ROWS, DIM)
    # Refused from its header, before its data is read.
    with pytest.raises(VoiceError, match=rf"shape \[{MAX_VOICE_ROWS + 1}, {DIM}\]"):
        registry.embedding("huge")
    with pytest.raises(VoiceError, match="rows"):
        convert_voice_files([vdir / "huge.pt"], tmp_path / "out")


@pytest.mark.parametrize("kind", ["pt", "safetensors"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=str)
def test_non_finite_voice_is_refused(tmp_path: Path, kind: str, bad: float) -> None:
    """One NaN/inf value used to reach the model and crash the process (segfault) at the
    first frame; it is a VoiceError naming the voice now."""
    vdir = tmp_path / "v"
    vdir.mkdir()
    t = bf16_voice(4)
    t[2, 5] = bad
    if kind == "pt":
        torch.save(t, vdir / "x_bad.pt")
    else:
        from safetensors.torch import save_file

        save_file({"embedding": t}, str(vdir / "x_bad.safetensors"))
    reg = VoiceRegistry.from_dir(vdir, {}, DIM)
    with pytest.raises(VoiceError) as exc:
        reg.embedding("x_bad")
    assert "x_bad" in one_line(exc) and "NaN or infinite" in one_line(exc)


def test_voice_beyond_the_compute_dtype_is_refused(tmp_path: Path) -> None:
    """A finite float32 voice that overflows float16 would reach the model as inf."""
    vdir = tmp_path / "v"
    vdir.mkdir()
    t = torch.randn(4, DIM)
    t[1, 1] = 1e5
    torch.save(t, vdir / "x_big.pt")
    reg = VoiceRegistry.from_dir(vdir, {}, DIM)
    assert reg.embedding("x_big", mx.bfloat16).dtype == mx.bfloat16  # bf16 holds 1e5
    with pytest.raises(VoiceError) as exc:
        reg.embedding("x_big", mx.float16)
    assert "x_big" in one_line(exc) and "float16" in one_line(exc)


def test_voice_directory_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "voice_embedding").write_text("not a folder")
    with pytest.raises(VoiceError) as exc:
        VoiceRegistry.from_dir(tmp_path / "voice_embedding", {}, DIM)
    assert "is a file" in one_line(exc) and "voice_embedding folder" in one_line(exc)


def test_safetensors_keys(tmp_path: Path) -> None:
    vdir = tmp_path / "v"
    vdir.mkdir()
    arr = mx.ones((3, DIM), dtype=mx.float16)
    mx.save_safetensors(str(vdir / "single.safetensors"), {"weird_key": arr})
    mx.save_safetensors(str(vdir / "two.safetensors"), {"a": arr, "b": arr})
    (vdir / "broken.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    reg = VoiceRegistry.from_dir(vdir, {}, DIM)
    assert reg.embedding("single").dtype == mx.float16
    with pytest.raises(VoiceError) as exc:
        reg.embedding("two")
    assert "a, b" in one_line(exc)
    with pytest.raises(VoiceError) as exc:
        reg.embedding("broken")
    assert "broken.safetensors" in one_line(exc)


def test_a_truncated_safetensors_voice_is_named_once_in_full(tmp_path: Path) -> None:
    """The header reader's own message (file, what is wrong, the fix) was wrapped in
    "cannot read voice file X (X is truncated: ... the file ha...)", cut off mid-word."""
    vdir = tmp_path / "v"
    vdir.mkdir()
    whole = vdir / "whole.safetensors"
    mx.save_safetensors(str(whole), {"embedding": mx.ones((3, DIM), dtype=mx.bfloat16)})
    data = whole.read_bytes()
    (vdir / "cut.safetensors").write_bytes(data[:-10])
    reg = VoiceRegistry.from_dir(vdir, {}, DIM)
    with pytest.raises(VoiceError) as exc:
        reg.embedding("cut")
    message = one_line(exc)
    cut = vdir / "cut.safetensors"
    assert message == (
        f"voice file {cut} is truncated: tensor 'embedding' ends at byte {len(data)} but the "
        f"file has {len(data) - 10} bytes; re-download it"
    )


def test_full_preset_layout(tmp_path: Path) -> None:
    tokens = expected_tokens()
    vdir = make_voice_dir(tmp_path / "voice_embedding", tokens)
    reg = VoiceRegistry.from_dir(vdir, tokens, DIM)
    assert sorted(reg) == sorted(tokens)
    for name, rows in tokens.items():
        assert tuple(reg.embedding(name).shape) == (rows, DIM)
        assert reg[name].language == voice_language(name)


# --------------------------------------------------------------------------- converter


def test_convert_bit_exact(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    refs = {
        "casual_female": bf16_voice(21, seed=1),
        "de_male": bf16_voice(16, seed=2),
        "f32_voice": torch.randn(5, DIM),
    }
    for name, t in refs.items():
        torch.save(t, src / f"{name}.pt")
    torch.save(refs["casual_female"][3:9, ::2], src / "sliced.pt")
    refs["sliced"] = refs["casual_female"][3:9, ::2]
    # torch's legacy (non-zip) format, which torch.load still reads: it was refused
    torch.save(refs["de_male"][2:], src / "legacy.pt", _use_new_zipfile_serialization=False)
    refs["legacy"] = refs["de_male"][2:]
    out = tmp_path / "out" / "nested"
    written = convert_voice_files([src], out)
    assert [p.name for p in written] == sorted(f"{n}.safetensors" for n in refs)
    for name, ref in refs.items():
        loaded = load_file(str(out / f"{name}.safetensors"))
        assert list(loaded) == ["embedding"]
        ours = loaded["embedding"]
        theirs = torch.load(src / f"{name}.pt", weights_only=True)
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
        assert raw_bits(ours) == raw_bits(theirs) == raw_bits(ref)
        assert mx_bits(mx.load(str(out / f"{name}.safetensors"))["embedding"]) == raw_bits(theirs)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in written)

    # the converted directory works as a registry
    reg = VoiceRegistry.from_dir(out, {"casual_female": 21, "f32_voice": 5}, DIM)
    assert mx_bits(reg.embedding("f32_voice")) == raw_bits(refs["f32_voice"])
    assert mx_bits(reg.embedding("casual_female")) == raw_bits(refs["casual_female"])
    # and a model's own voice folder may hold a legacy file too
    reg = VoiceRegistry.from_dir(src, {"legacy": 14}, DIM)
    assert mx_bits(reg.embedding("legacy")) == raw_bits(refs["legacy"])


@pytest.mark.parametrize(
    ("tensor", "words"),
    [
        (bf16_voice(4, finite=False, seed=5), "NaN or infinite"),
        (torch.full((3, DIM), float("inf")), "NaN or infinite"),
        (torch.randn(2, 3, DIM), f"shape [2, 3, {DIM}]"),
        (torch.zeros(0, DIM), f"shape [0, {DIM}]"),
        (torch.zeros(3, DIM, dtype=torch.int64), "not floats"),
    ],
    ids=["bf16-nan", "inf", "3-d", "empty", "int64"],
)
def test_convert_refuses_what_no_model_can_load(tmp_path: Path, tensor, words: str) -> None:
    """Refused at conversion, not later at load (whose message would send the user back to
    convert-voices); nothing is written."""
    torch.save(bf16_voice(3), tmp_path / "good.pt")
    torch.save(tensor, tmp_path / "bad.pt")
    with pytest.raises(VoiceError) as exc:
        convert_voice_files([tmp_path / "good.pt", tmp_path / "bad.pt"], tmp_path / "out")
    text = one_line(exc)
    assert words in text and "bad.pt" in text and "not a voice embedding" in text
    assert not (tmp_path / "out").exists()


def test_convert_files_and_our_own_pt(tmp_path: Path) -> None:
    t = bf16_voice(4)
    write_pt(tmp_path / "hi_male.pt", PtTensor("BF16", (4, DIM), t.view(torch.uint16).numpy()))
    torch.save({"embedding": t}, tmp_path / "wrapped.pt")
    out = tmp_path / "out"
    written = convert_voice_files([tmp_path / "hi_male.pt", tmp_path / "wrapped.pt", tmp_path], out)
    assert [p.name for p in written] == ["hi_male.safetensors", "wrapped.safetensors"]
    for p in written:
        assert raw_bits(load_file(str(p))["embedding"]) == raw_bits(t)


def test_convert_overwrite(tmp_path: Path) -> None:
    torch.save(bf16_voice(3), tmp_path / "a.pt")
    out = tmp_path / "out"
    out.mkdir()
    (out / "a.safetensors").write_bytes(b"old")
    with pytest.raises(VoiceError) as exc:
        convert_voice_files([tmp_path / "a.pt"], out, overwrite=False)
    assert "already exists" in one_line(exc)
    assert (out / "a.safetensors").read_bytes() == b"old"
    convert_voice_files([tmp_path / "a.pt"], out)
    assert raw_bits(load_file(str(out / "a.safetensors"))["embedding"]) == raw_bits(bf16_voice(3))


def test_convert_bad_sources(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "v.txt").write_text("x")
    for sources in ([tmp_path / "missing.pt"], [tmp_path / "empty"], [tmp_path / "v.txt"]):
        with pytest.raises(VoiceError) as exc:
            convert_voice_files(sources, tmp_path / "out")
        one_line(exc)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "first, second",
    [("a/x.pt", "b/x.pt"), ("a/x.pt", "b/X.pt"), ("a/\u00e9.pt", "b/e\u0301.pt")],
    ids=["same-name", "case-only", "nfc-nfd"],
)
def test_convert_refuses_two_sources_for_one_target(
    tmp_path: Path, first: str, second: str
) -> None:
    """On APFS X.safetensors overwrites x.safetensors, and an NFD "é" an NFC one."""
    for name in (first, second):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        torch.save(bf16_voice(3), tmp_path / name)
    with pytest.raises(VoiceError, match="would both be written to"):
        convert_voice_files([tmp_path / first, tmp_path / second], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_one_file_named_as_apfs_names_it_converts_once(tmp_path: Path) -> None:
    """On APFS v/A.pt and v/a.pt (or an NFC and an NFD "é") name one file: it was refused
    as two sources for one target. Hard links stand in for that here; a link under another
    name is another voice and is converted too."""
    torch.save(bf16_voice(3), tmp_path / "a.pt")
    nfc, nfd = "\u00e9.pt", "e\u0301.pt"
    torch.save(bf16_voice(2), tmp_path / nfc)
    os.link(tmp_path / "a.pt", tmp_path / "A.pt")
    os.link(tmp_path / nfc, tmp_path / nfd)
    os.link(tmp_path / "a.pt", tmp_path / "narrator.pt")
    sources = [tmp_path / n for n in ("a.pt", "A.pt", nfc, nfd, "narrator.pt")]
    written = convert_voice_files(sources, tmp_path / "out")
    assert sorted(p.name for p in written) == sorted(
        ["a.safetensors", f"{nfc[:-3]}.safetensors", "narrator.safetensors"]
    )


def test_convert_unwritable_output(tmp_path: Path) -> None:
    torch.save(bf16_voice(3), tmp_path / "a.pt")
    (tmp_path / "blocker").write_text("a file, so nothing can be created under it")
    for out in (tmp_path / "blocker" / "voices", tmp_path / "blocker"):
        with pytest.raises(VoiceError) as exc:
            convert_voice_files([tmp_path / "a.pt"], out)
        assert "blocker" in one_line(exc)
    assert (tmp_path / "blocker").read_text().startswith("a file")


def test_convert_failure_leaves_no_partial_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.save(bf16_voice(3), tmp_path / "a.pt")
    out = tmp_path / "out"

    def no_space(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(VoiceError) as exc:
        convert_voice_files([tmp_path / "a.pt"], out)
    assert "No space left" in one_line(exc)
    assert list(tmp_path.iterdir()) == [tmp_path / "a.pt"]  # nor the directory it made


def test_convert_checks_every_target_before_writing(tmp_path: Path) -> None:
    for name in ("a", "b", "c"):
        torch.save(bf16_voice(3, seed=ord(name)), tmp_path / f"{name}.pt")
    out = tmp_path / "out"
    (out / "b.safetensors").mkdir(parents=True)  # a target that cannot be written
    with pytest.raises(VoiceError) as exc:
        convert_voice_files([tmp_path / f"{n}.pt" for n in "abc"], out)
    assert "b.safetensors" in one_line(exc) and "not a file" in one_line(exc)
    assert sorted(p.name for p in out.iterdir()) == ["b.safetensors"]


@pytest.mark.parametrize("hard_links", [True, False])
def test_convert_without_force_never_replaces_a_file_written_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hard_links: bool
) -> None:
    """Two conversions into one new directory both passed the up-front check; the later
    one replaced the other's files and said it had written them."""
    for name in ("a", "b", "c"):
        torch.save(bf16_voice(3, seed=ord(name)), tmp_path / f"{name}.pt")
    out = tmp_path / "out"
    real = voices_mod._write_safetensors

    def and_another_run(path: Path, tensor: PtTensor) -> None:
        real(path, tensor)
        if path.name == "c.safetensors":  # the other run finishes first
            (out / "b.safetensors").write_bytes(b"theirs")

    monkeypatch.setattr(voices_mod, "_write_safetensors", and_another_run)
    if not hard_links:

        def no_links(src, dst):
            raise OSError(1, "Operation not permitted")

        monkeypatch.setattr(voices_mod.os, "link", no_links)
    with pytest.raises(VoiceError) as exc:
        convert_voice_files([tmp_path / f"{n}.pt" for n in "abc"], out, overwrite=False)
    assert "b.safetensors was written by something else" in one_line(exc)
    assert sorted(p.name for p in out.iterdir()) == ["b.safetensors"]  # none of ours kept
    assert (out / "b.safetensors").read_bytes() == b"theirs"


def test_convert_failure_midway_writes_none_of_the_voices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("a", "b", "c"):
        torch.save(bf16_voice(3, seed=ord(name)), tmp_path / f"{name}.pt")
    out = tmp_path / "out"
    out.mkdir()
    (out / "a.safetensors").write_bytes(b"old")
    real = voices_mod._write_safetensors
    calls = []

    def third_fails(path: Path, tensor: PtTensor) -> None:
        calls.append(path)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        real(path, tensor)

    monkeypatch.setattr(voices_mod, "_write_safetensors", third_fails)
    with pytest.raises(VoiceError) as exc:
        convert_voice_files([tmp_path / f"{n}.pt" for n in "abc"], out / "nested" / "deeper")
    assert "No space left" in one_line(exc)
    assert list(out.iterdir()) == [out / "a.safetensors"]  # no half set, no new directories
    calls.clear()
    with pytest.raises(VoiceError):
        convert_voice_files([tmp_path / f"{n}.pt" for n in "abc"], out)
    assert sorted(p.name for p in out.iterdir()) == ["a.safetensors"]
    assert (out / "a.safetensors").read_bytes() == b"old"  # replaced only when all succeed


def _three_voices_over_old_ones(tmp_path: Path) -> Path:
    for name in ("a", "b", "c"):
        torch.save(bf16_voice(3, seed=ord(name)), tmp_path / f"{name}.pt")
    out = tmp_path / "out"
    out.mkdir()
    for name in ("a", "b", "c"):
        (out / f"{name}.safetensors").write_bytes(f"old {name}".encode())
    return out


def test_a_rename_failing_midway_puts_the_replaced_voices_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With overwrite, the voices renamed into place before a failing rename stayed: a mix
    of old and new files (and a new directory kept a file)."""
    out = _three_voices_over_old_ones(tmp_path)
    real = os.replace

    def third_fails(src, dst) -> None:
        if Path(dst).name == "c.safetensors" and Path(src).parent.name.startswith(
            ".voices.partial"
        ):
            raise OSError(5, "Input/output error")
        real(src, dst)

    monkeypatch.setattr(voices_mod.os, "replace", third_fails)
    with pytest.raises(VoiceError) as exc:
        convert_voice_files([tmp_path / f"{n}.pt" for n in "abc"], out)
    assert "Input/output error" in one_line(exc)
    assert sorted(p.name for p in out.iterdir()) == [
        "a.safetensors",
        "b.safetensors",
        "c.safetensors",
    ]
    for name in ("a", "b", "c"):
        assert (out / f"{name}.safetensors").read_bytes() == f"old {name}".encode()
    new = tmp_path / "new"
    with pytest.raises(VoiceError):
        convert_voice_files([tmp_path / f"{n}.pt" for n in "abc"], new)
    assert not new.exists()


def test_ctrl_c_while_the_voices_go_into_place_comes_after_all_of_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C landing between two renames left the files renamed so far in a directory
    the run had created (and a run with overwrite a mix of old and new voices)."""
    import signal

    for name in ("a", "b", "c"):
        torch.save(bf16_voice(3, seed=ord(name)), tmp_path / f"{name}.pt")
    out = tmp_path / "out"
    real = os.replace

    def interrupted(src, dst) -> None:
        real(src, dst)
        if Path(dst) == out / "a.safetensors":
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(voices_mod.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt) as exc:
        convert_voice_files([tmp_path / f"{n}.pt" for n in "abc"], out)
    assert "was written (it is complete)" in exc.value.detail  # the CLI's one error line
    assert sorted(p.name for p in out.iterdir()) == [
        "a.safetensors",
        "b.safetensors",
        "c.safetensors",
    ]
    for name in ("a", "b", "c"):
        want = raw_bits(bf16_voice(3, seed=ord(name)))
        assert raw_bits(load_file(out / f"{name}.safetensors")["embedding"]) == want
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_replaced_voice_is_never_missing_while_the_new_ones_go_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Moving each old file aside before the new one came left a moment without the voice
    (a model reading its voices then failed)."""
    out = _three_voices_over_old_ones(tmp_path)
    real = os.replace
    missing: list[str] = []

    def watched(src, dst) -> None:
        if Path(dst).parent == out and not Path(dst).exists():
            missing.append(Path(dst).name)
        if Path(src).parent == out:
            missing.append(f"moved {Path(src).name}")
        real(src, dst)

    monkeypatch.setattr(voices_mod.os, "replace", watched)
    convert_voice_files([tmp_path / f"{n}.pt" for n in "abc"], out)
    assert missing == []
    for name in ("a", "b", "c"):
        want = raw_bits(bf16_voice(3, seed=ord(name)))
        assert raw_bits(load_file(out / f"{name}.safetensors")["embedding"]) == want
    assert sorted(p.name for p in out.iterdir()) == [f"{n}.safetensors" for n in "abc"]


def _failing_to_put_back_a(out: Path, interrupt: bool):
    real = os.replace

    def failing(src, dst) -> None:
        if Path(dst) == out / "c.safetensors" and Path(src).parent.name.startswith(
            ".voices.partial"
        ):
            raise OSError(5, "Input/output error")
        if Path(dst) == out / "a.safetensors" and Path(src).parent.name == "replaced":
            raise OSError(5, "Input/output error")
        real(src, dst)
        if interrupt and Path(dst) == out / "b.safetensors":
            signal.raise_signal(signal.SIGINT)

    return failing


@pytest.mark.parametrize("interrupt", [False, True])
def test_replaced_voices_that_cannot_be_put_back_are_kept_and_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, interrupt: bool
) -> None:
    """The stage holding the only copy of a replaced voice was deleted after a put-back
    failed. Kept in a folder of a new name each time (a later run removes stages), named by
    the error, or by the interrupt's line after a Ctrl-C. In a folder of a long path, the
    file was named by a path cut to 80 characters, which left its name out."""
    base = tmp_path / ("a-folder-with-a-long-name-" * 4)
    base.mkdir()
    out = _three_voices_over_old_ones(base)
    sources = [base / f"{n}.pt" for n in "abc"]
    monkeypatch.setattr(voices_mod.os, "replace", _failing_to_put_back_a(out, interrupt))
    for attempt in (1, 2):
        with pytest.raises(KeyboardInterrupt if interrupt else VoiceError) as exc:
            convert_voice_files(sources, out)
        line = exc.value.detail if interrupt else one_line(exc)
        kept = sorted(out.glob("replaced-voices-*"))
        assert len(kept) == attempt
        here = next(k for k in kept if f"the voices it replaced are in {k / 'voices'};" in line)
        assert line.startswith("a.safetensors could not be put back after the conversion")
        assert line.endswith(f"move them back into {out}")
        assert (here / "voices" / "a.safetensors").read_bytes() == b"old a"
        (out / "a.safetensors").write_bytes(b"old a")  # moved back, as the line asks
        for name in ("b", "c"):
            assert (out / f"{name}.safetensors").read_bytes() == f"old {name}".encode()
    assert sorted(p.name for p in out.glob("*.safetensors")) == [f"{n}.safetensors" for n in "abc"]
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


def test_new_voices_that_cannot_be_removed_are_named_with_their_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A voice placed before a later rename failed, that could not then be removed, is named
    by its file name and the folder it is in (a long path is not cut off before its name)."""
    base = tmp_path / ("a-folder-with-a-long-name-" * 4)
    base.mkdir()
    for name in ("a", "b", "c"):
        torch.save(bf16_voice(3, seed=ord(name)), base / f"{name}.pt")
    out = base / "out"
    real_replace, real_unlink = os.replace, Path.unlink

    def failing_replace(src, dst) -> None:
        if Path(dst) == out / "c.safetensors":
            raise OSError(5, "Input/output error")
        real_replace(src, dst)

    def failing_unlink(self: Path, missing_ok: bool = False) -> None:
        if self == out / "a.safetensors":
            raise PermissionError(13, "Permission denied")
        real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(voices_mod.os, "replace", failing_replace)
    monkeypatch.setattr(Path, "unlink", failing_unlink)
    with pytest.raises(VoiceError) as exc:
        convert_voice_files([base / f"{n}.pt" for n in "abc"], out)
    assert one_line(exc) == (
        f"a.safetensors could not be removed from {out} after the conversion failed "
        "([Errno 5] Input/output error): remove it"
    )
    monkeypatch.undo()
    assert sorted(p.name for p in out.iterdir()) == ["a.safetensors"]


def test_ctrl_c_then_a_failure_while_placing_is_still_an_interrupt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Ctrl-C held while the files went into place was dropped when a rename then
    failed: the run ended as a write error (exit 1), not as interrupted."""
    import signal

    out = _three_voices_over_old_ones(tmp_path)
    real = os.replace

    def failing(src, dst) -> None:
        if Path(dst) == out / "c.safetensors" and Path(src).parent.name.startswith(
            ".voices.partial"
        ):
            raise OSError(5, "Input/output error")
        real(src, dst)
        if Path(dst) == out / "a.safetensors":
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(voices_mod.os, "replace", failing)
    with pytest.raises(KeyboardInterrupt):
        convert_voice_files([tmp_path / f"{n}.pt" for n in "abc"], out)
    for name in ("a", "b", "c"):
        assert (out / f"{name}.safetensors").read_bytes() == f"old {name}".encode()
    assert sorted(p.name for p in out.iterdir()) == [f"{n}.safetensors" for n in "abc"]


def test_a_voice_removed_after_the_checks_is_written_all_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = _three_voices_over_old_ones(tmp_path)
    real = voices_mod._write_safetensors

    def and_one_removed(path: Path, tensor: PtTensor) -> None:
        real(path, tensor)
        (out / "b.safetensors").unlink(missing_ok=True)

    monkeypatch.setattr(voices_mod, "_write_safetensors", and_one_removed)
    convert_voice_files([tmp_path / f"{n}.pt" for n in "abc"], out)
    want = raw_bits(bf16_voice(3, seed=ord("b")))
    assert raw_bits(load_file(out / "b.safetensors")["embedding"]) == want


def test_convert_refuses_hostile_before_writing(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"

    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    torch.save(bf16_voice(3), tmp_path / "a_good.pt")
    torch.save({"embedding": bf16_voice(3), "x": Evil()}, tmp_path / "b_evil.pt")
    out = tmp_path / "out"
    with pytest.raises(UnsafePickleError) as exc:
        convert_voice_files([tmp_path], out)
    assert "b_evil.pt" in one_line(exc)
    assert not marker.exists()
    assert not out.exists()  # every source is checked before anything is written


def test_registry_refuses_hostile_voice(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"

    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    vdir = tmp_path / "v"
    vdir.mkdir()
    torch.save({"embedding": bf16_voice(3), "x": Evil()}, vdir / "casual_male.pt")
    reg = VoiceRegistry.from_dir(vdir, {}, DIM)
    with pytest.raises(UnsafePickleError) as exc:
        reg.embedding("casual_male")
    assert "casual_male.pt" in one_line(exc)
    assert not marker.exists()


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "convert" / "convert_voices.py"), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )


def test_convert_script(tmp_path: Path) -> None:
    torch.save(bf16_voice(3), tmp_path / "a.pt")
    torch.save(bf16_voice(4), tmp_path / "b.pt")
    done = run_script(str(tmp_path), "-o", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 2 and lines[0].endswith("a.safetensors")
    again = run_script(str(tmp_path), "-o", str(tmp_path / "out"))  # as the CLI: --force
    assert again.returncode == 1 and "--force" in again.stderr
    assert run_script(str(tmp_path), "-o", str(tmp_path / "out"), "--force").returncode == 0
    failed = run_script(str(tmp_path / "missing.pt"), "-o", str(tmp_path / "out"))
    assert failed.returncode == 1
    assert len(failed.stderr.strip().splitlines()) == 1 and "missing.pt" in failed.stderr


def test_an_unknown_voice_suggests_the_names_it_looks_like():
    from voxtral_mlx.voices import _close_names

    names = ["casual_female", "casual_male", "fr_female", "fr_male", "neutral_male"]
    assert _close_names("casual_mal", names)[0] == "casual_male"
    assert _close_names("fr-female", names) == ["fr_female"]
    assert _close_names("Neutral Male", names) == ["neutral_male"]
    assert _close_names("bob", names) == [] and _close_names("  ", names) == []
    # Part of a name, or a language in full: -v neutral, -v french were not understood.
    assert _close_names("neutral", names) == ["neutral_male"]
    assert _close_names("French", names) == ["fr_female", "fr_male"]
    assert _close_names("french female", names) == ["fr_female"]
    assert _close_names("english", names) == ["casual_female", "casual_male", "neutral_male"]
    assert _close_names("male", names) == ["casual_male", "fr_male", "neutral_male"]


def test_the_unknown_voice_error_names_the_likely_one_and_an_empty_name(tmp_path: Path) -> None:
    vdir = tmp_path / "voice_embedding"
    vdir.mkdir()
    for name in ["casual_male", "fr_female", "fr_male"]:
        (vdir / f"{name}.pt").write_bytes(b"not read")
    reg = VoiceRegistry.from_dir(vdir, expected_tokens(), DIM)
    with pytest.raises(VoiceError, match="did you mean casual_male\\?") as e:
        reg.get_voice("casual_mal")
    with pytest.raises(VoiceError, match="did you mean fr_female or fr_male\\? "):
        reg.get_voice("French")

    assert "\n" not in str(e.value)
    with pytest.raises(VoiceError, match="empty \\(an unset shell variable\\?\\)"):
        reg.get_voice("")
    with pytest.raises(VoiceError) as e:
        reg.get_voice("bob")
    assert "did you mean" not in str(e.value) and "available voices" in str(e.value)
