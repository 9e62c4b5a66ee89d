"""Rules of the restricted .pt reader that the suite did not pin down (found by mutation)."""

from __future__ import annotations

import pickle
import pickletools
import struct
import zipfile
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from test_torch_pickle import make_pt, op_global, op_int, op_str, op_tuple, tensor_pickle

import voxtral_mlx.voices as voices_mod
from voxtral_mlx.errors import InputError, UnsafePickleError, VoiceError
from voxtral_mlx.torch_pickle import _LEGACY_MAGIC, _MAX_PICKLE_OPS, _shown, read_pt
from voxtral_mlx.voices import MAX_VOICE_ROWS, VoiceRegistry, convert_voice_files


def op_long(value: int) -> bytes:
    raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8b" + struct.pack("<I", len(raw)) + raw  # LONG4


BODY = tensor_pickle()[2:-1]  # the tensor's opcodes without PROTO and STOP


def refused(path: Path, key: str | None = None) -> str:
    with pytest.raises(VoiceError) as exc:
        read_pt(path, key)
    text = str(exc.value)
    assert "\n" not in text and path.name in text
    return text


# --------------------------------------------------------------------------- globals


@pytest.mark.parametrize(
    "module, name",
    [
        ("builtins", "print"),
        ("builtins", "dict"),
        ("collections", "defaultdict"),
        ("numpy.core.multiarray", "_reconstruct"),
        ("torch", "Tensor"),
    ],
)
def test_harmless_looking_globals_outside_torchs_list_are_refused(
    tmp_path: Path, module: str, name: str, capsys: pytest.CaptureFixture
) -> None:
    """Only torch.save's tensor globals are allowed: any other, even a harmless one, is refused."""
    pkl = b"\x80\x02" + op_global(module, name) + op_tuple(op_str("HELLO")) + b"R."
    with pytest.raises(UnsafePickleError) as exc:
        read_pt(make_pt(tmp_path / "g.pt", pkl))
    assert name in str(exc.value)
    assert "HELLO" not in capsys.readouterr().out


# --------------------------------------------------------------------------- limits


def nested_key_pickle(levels: int) -> bytes:
    """A dict {((..(0,)..),): tensor} whose key nests ``levels`` deep (the dict one more)."""
    return b"\x80\x02}" + b"K\x00" + b"\x85" * levels + BODY + b"s."


def test_nesting_limit_is_exactly_32_levels(tmp_path: Path) -> None:
    """Objects nested 32 deep are read; 33 deep are refused."""
    assert read_pt(make_pt(tmp_path / "ok.pt", nested_key_pickle(31))).data.tolist() == [0, 1, 2, 3]
    assert "nests objects over 32 deep" in refused(
        make_pt(tmp_path / "d.pt", nested_key_pickle(32))
    )


def test_nesting_through_appends_counts(tmp_path: Path) -> None:
    """A list nested 40 deep by APPEND (an in-place opcode) is refused as too deep."""
    pkl = b"\x80\x02" + b"]" * 40 + b"a" * 39 + b"."
    assert "nests objects over 32 deep" in refused(make_pt(tmp_path / "l.pt", pkl))


def entries_pickle(n: int) -> bytes:
    """A dict of ``n`` int entries plus an "embedding" tensor: n + 1 entries in all."""
    pairs = b"".join(b"M" + struct.pack("<H", k) + b"K\x00" for k in range(n))
    return b"\x80\x02}(" + pairs + b"u" + op_str("embedding") + BODY + b"s."


def test_dict_entry_limit_is_exactly_10000(tmp_path: Path) -> None:
    """Dicts of 10,000 entries in all are read; 10,001 are refused."""
    assert read_pt(make_pt(tmp_path / "ok.pt", entries_pickle(9_999))).data.tolist() == [0, 1, 2, 3]
    text = refused(make_pt(tmp_path / "big.pt", entries_pickle(10_000)))
    assert "builds dicts of over 10000 entries" in text


def ops_pickle(total: int) -> bytes:
    """A tensor pickle padded with NONE/POP pairs to exactly ``total`` opcodes."""
    base = len(list(pickletools.genops(tensor_pickle())))
    pad = total - base
    pkl = b"\x80\x02" + b"N0" * (pad // 2) + b"N" * (pad % 2) + BODY + b"."
    assert len(list(pickletools.genops(pkl))) == total
    return pkl


def test_operation_limit_is_exact(tmp_path: Path) -> None:
    """A pickle of 500,000 opcodes is read; one of 500,001 is refused."""
    ok = make_pt(tmp_path / "ok.pt", ops_pickle(_MAX_PICKLE_OPS))
    assert read_pt(ok).data.tolist() == [0, 1, 2, 3]
    text = refused(make_pt(tmp_path / "many.pt", ops_pickle(_MAX_PICKLE_OPS + 1)))
    assert "over 500000 operations" in text


def test_a_mark_popped_by_pop_is_followed_like_pickle_does(tmp_path: Path) -> None:
    """POP right after MARK removes the mark (as pickle does), so a valid pickle stays readable."""
    pkl = b"\x80\x02}" + op_str("embedding") + b"(0" + BODY + b"s."
    assert read_pt(make_pt(tmp_path / "m.pt", pkl)).data.tolist() == [0, 1, 2, 3]


# --------------------------------------------------------------------------- tensor fields


def test_more_than_32_dimensions_are_refused(tmp_path: Path) -> None:
    """A tensor of 33 dimensions is refused, however few its values."""
    pkl = tensor_pickle(shape=(1,) * 29 + (2, 2, 1, 1), stride=(4,) * 29 + (2, 1, 1, 1))
    assert "at most 32" in refused(make_pt(tmp_path / "n.pt", pkl))


@pytest.mark.parametrize(
    "old, new",
    [
        (op_tuple(op_int(4)), op_tuple(b"\x88")),  # shape (True,)
        (
            b"\x89" + op_global("collections", "OrderedDict"),
            b"K\x00" + op_global("collections", "OrderedDict"),
        ),
        (op_global("collections", "OrderedDict") + b")R", b"]"),  # hooks a list
        (
            op_global("collections", "OrderedDict") + b")R",
            op_global("collections", "OrderedDict") + op_tuple(b"]") + b"R",
        ),
        (
            op_global("collections", "OrderedDict") + b")R",
            op_global("collections", "OrderedDict") + b")R]b",
        ),
    ],
    ids=[
        "bool-shape",
        "int-requires-grad",
        "list-hooks",
        "ordereddict-with-args",
        "ordereddict-list-state",
    ],
)
def test_rebuild_arguments_of_the_wrong_type_are_refused(
    tmp_path: Path, old: bytes, new: bytes
) -> None:
    """Shapes hold ints (not bools), requires_grad a bool, hooks an argument-less OrderedDict."""
    pkl = tensor_pickle()
    assert pkl.count(old) == 1
    refused(make_pt(tmp_path / "f.pt", pkl.replace(old, new)))


def test_setting_state_on_a_tensor_placeholder_is_refused(tmp_path: Path) -> None:
    """BUILD on a rebuilt tensor (state torch.save never writes) is refused."""
    refused(make_pt(tmp_path / "b.pt", tensor_pickle()[:-1] + b"}b."))


def test_a_neg_view_saved_by_torch_is_refused_not_misread(tmp_path: Path) -> None:
    """A tensor with torch's lazy negation bit is refused rather than read without the sign."""
    torch.save(torch._neg_view(torch.arange(4.0)), tmp_path / "neg.pt")
    assert "neg" in refused(tmp_path / "neg.pt")


@pytest.mark.parametrize("second", ["int", "numel"])
def test_a_storage_declared_twice_differently_is_refused(tmp_path: Path, second: str) -> None:
    """Two dict entries declaring one record with another dtype or size are refused."""
    other = (
        tensor_pickle(storage="IntStorage")
        if second == "int"
        else tensor_pickle(numel=2, shape=(2,))
    )
    pkl = b"\x80\x02}(" + op_str("a") + BODY + op_str("embedding") + other[2:-1] + b"u."
    assert "declared twice differently" in refused(make_pt(tmp_path / "d.pt", pkl), "embedding")


def test_a_key_naming_a_non_tensor_entry_is_a_voice_error(tmp_path: Path) -> None:
    """key= naming an entry that is no tensor gives a VoiceError naming what it is."""
    pkl = b"\x80\x02}(" + op_str("embedding") + BODY + op_str("meta") + b"K\x07u."
    assert "not a tensor" in refused(make_pt(tmp_path / "k.pt", pkl), "meta")


# --------------------------------------------------------------------------- archive records


def test_an_archive_with_two_data_pkl_records_is_refused(tmp_path: Path) -> None:
    """Two top-level data.pkl records make the archive ambiguous: refused, not the first taken."""
    path = make_pt(tmp_path / "two.pt", tensor_pickle())
    with zipfile.ZipFile(path, "a") as zf:
        zf.writestr("other/data.pkl", tensor_pickle())
    assert "2 data.pkl records" in refused(path)


def test_an_oversized_byteorder_record_is_refused_as_malformed(tmp_path: Path) -> None:
    """A byteorder record over 16 bytes is refused as malformed before it is read."""
    path = make_pt(tmp_path / "o.pt", tensor_pickle(), byteorder=b"little" + b" " * 11)
    assert "malformed byteorder record" in refused(path)


def test_a_legacy_storage_declaring_more_than_the_file_holds_is_refused(tmp_path: Path) -> None:
    """A legacy file whose storage claims 2**40 values in 16 bytes is refused before reading."""
    # The legacy format's storage ids carry a sixth field (None).
    tensor = tensor_pickle(numel=7771).replace(op_int(7771) + b"t", op_long(2**40) + b"Nt")
    raw = (
        pickle.dumps(_LEGACY_MAGIC, protocol=2)
        + pickle.dumps(1001, protocol=2)
        + pickle.dumps({}, protocol=2)
        + tensor
        + pickle.dumps(["0"], protocol=2)
        + struct.pack("<q", 2**40)
        + np.arange(4, dtype=np.float32).tobytes()
    )
    (tmp_path / "l.pt").write_bytes(raw)
    assert "truncated" in refused(tmp_path / "l.pt")


# --------------------------------------------------------------------------- shared parts


def dag_key_pickle(depth: int) -> bytes:
    """{t_depth: tensor} where t_0 = () and t_i = (t_{i-1}, t_{i-1}) via the memo."""
    key = b")q\x00"
    for i in range(1, depth + 1):
        key += b"0h" + bytes([i - 1]) + b"h" + bytes([i - 1]) + b"\x86q" + bytes([i])
    return b"\x80\x02}" + key + BODY + b"s."


@pytest.mark.parametrize("depth", [18, 31])
def test_a_key_whose_size_doubles_per_level_is_refused(tmp_path: Path, depth: int) -> None:
    """A tuple of shared tuples (2**depth parts, within 32 levels) is refused before it is
    hashed or shown: at depth 31, an 867-byte file, hashing took minutes and the key
    listing's repr 13 GB."""
    text = refused(make_pt(tmp_path / "dag.pt", dag_key_pickle(depth)))
    assert "shares objects into one of over 500000 parts" in text


def test_a_key_of_a_few_shared_parts_is_still_read(tmp_path: Path) -> None:
    """Sharing itself is allowed (torch.save memoises its globals): 2**12 parts are read."""
    assert read_pt(make_pt(tmp_path / "dag.pt", dag_key_pickle(12))).data.tolist() == [0, 1, 2, 3]


def test_a_message_names_a_value_of_many_shared_parts_without_printing_it() -> None:
    """repr of a tuple of 2**40 shared parts would never end: a message names its type."""
    value: tuple = ()
    for _ in range(40):
        value = (value, value)
    assert _shown(value) == "<a tuple of many parts>"
    assert _shown((1, "a", [2.5])) == "(1, 'a', [2.5])"


# --------------------------------------------------------------------------- voices

DIM = 48


def test_a_safetensors_voice_row_limit_is_exactly_max_rows(tmp_path: Path) -> None:
    """A .safetensors voice of MAX_VOICE_ROWS rows loads; one row more is refused."""
    vdir = tmp_path / "v"
    vdir.mkdir()
    for name, rows in (("big", MAX_VOICE_ROWS), ("huge", MAX_VOICE_ROWS + 1)):
        mx.save_safetensors(str(vdir / f"{name}.safetensors"), {"embedding": mx.zeros((rows, DIM))})
    registry = VoiceRegistry.from_dir(vdir, {}, DIM)
    assert registry.embedding("big").shape == (MAX_VOICE_ROWS, DIM)
    with pytest.raises(VoiceError, match=f"has {MAX_VOICE_ROWS + 1} rows"):
        registry.embedding("huge")


def test_a_broken_voice_file_is_named_when_asked_in_another_case(tmp_path: Path) -> None:
    """A dangling voice link asked for in other case is reported as broken, not unknown."""
    vdir = tmp_path / "v"
    vdir.mkdir()
    torch.save(torch.zeros(3, DIM), vdir / "other.pt")
    (vdir / "Casual_Male.pt").symlink_to(tmp_path / "gone.pt")
    registry = VoiceRegistry.from_dir(vdir, {}, DIM)
    with pytest.raises(VoiceError, match="symbolic link"):
        registry.get_voice("casual_male")


def test_convert_skips_hidden_pt_files_of_a_directory(tmp_path: Path) -> None:
    """Hidden files in a voice folder (macOS's ._x.pt) are not converted."""
    src = tmp_path / "src"
    src.mkdir()
    torch.save(torch.ones(3, DIM), src / "a.pt")
    (src / "._a.pt").write_bytes(b"\x00\x05\x16\x07 AppleDouble")
    written = convert_voice_files(src, tmp_path / "out")
    assert [p.name for p in written] == ["a.safetensors"]


def test_convert_refuses_an_overwrite_that_is_not_a_bool(tmp_path: Path) -> None:
    """overwrite="no" is refused rather than read as true."""
    torch.save(torch.ones(3, DIM), tmp_path / "a.pt")
    with pytest.raises(InputError, match="overwrite must be True or False"):
        convert_voice_files(tmp_path / "a.pt", tmp_path / "out", overwrite="no")
    assert not (tmp_path / "out").exists()


def test_convert_refuses_a_voice_wider_than_any_before_reading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Conversion bounds a voice's size by MAX_VOICE_ROWS x MAX_VOICE_WIDTH values."""
    monkeypatch.setattr(voices_mod, "MAX_VOICE_WIDTH", 8)
    torch.save(torch.ones(2, 20_000, dtype=torch.float16), tmp_path / "wide.pt")
    with pytest.raises(VoiceError, match="more than a voice embedding's"):
        convert_voice_files(tmp_path / "wide.pt", tmp_path / "out")


def test_converted_voice_data_is_8_byte_aligned(tmp_path: Path) -> None:
    """The converted safetensors header is padded so the tensor data starts 8-byte aligned."""
    for rows in (1, 3, 12, 123, 1000):  # header lengths of every remainder mod 8 or so
        torch.save(torch.ones(rows, DIM, dtype=torch.bfloat16), tmp_path / f"v{rows}.pt")
    for path in convert_voice_files(sorted(tmp_path.glob("*.pt")), tmp_path / "out"):
        header = struct.unpack("<Q", path.read_bytes()[:8])[0]
        assert header % 8 == 0
