"""read_pt / write_pt against real torch: bit-exact values, and hostile files refused unexecuted."""

from __future__ import annotations

import collections
import io
import os
import pickle
import pickletools
import struct
import subprocess
import sys
import tracemalloc
import warnings
import zipfile
import zlib
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch

import voxtral_mlx.torch_pickle as tp
from voxtral_mlx.errors import UnsafePickleError, VoiceError, VoxtralError
from voxtral_mlx.torch_pickle import PtTensor, from_mlx, read_pt, to_mlx, write_pt

TORCH_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}

MX_DTYPES = {
    "BF16": mx.bfloat16,
    "F16": mx.float16,
    "F32": mx.float32,
    "F64": mx.float64,
    "I64": mx.int64,
    "I32": mx.int32,
    "I16": mx.int16,
    "I8": mx.int8,
    "U8": mx.uint8,
    "BOOL": mx.bool_,
}


def torch_bits(t: torch.Tensor) -> bytes:
    """The raw bytes of a tensor's values in C order."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        bits = {torch.bfloat16: 16, torch.float16: 16, torch.float32: 32, torch.float64: 64}
        if bits[dtype] == 16:  # every bit pattern, NaNs and infinities included
            raw = torch.randint(0, 2**16, shape, generator=g, dtype=torch.int32).to(torch.int16)
            return raw.view(dtype)
        return torch.randn(shape, generator=g, dtype=dtype) * 100
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=dtype)


def assert_same(ours: PtTensor, ref: torch.Tensor) -> None:
    assert ours.dtype == {v: k for k, v in TORCH_DTYPES.items()}[ref.dtype]
    assert ours.shape == tuple(ref.shape)
    assert ours.data.flags.c_contiguous
    assert ours.data.tobytes() == torch_bits(ref)


def one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text and "\r" not in text
    assert isinstance(exc.value, VoxtralError)
    return text


# --------------------------------------------------------------------------- reading torch files


@pytest.mark.parametrize("name", list(TORCH_DTYPES))
def test_read_every_dtype_bit_exact(tmp_path: Path, name: str) -> None:
    ref = random_tensor(TORCH_DTYPES[name], (7, 12))
    torch.save(ref, tmp_path / "t.pt")
    assert_same(read_pt(tmp_path / "t.pt"), torch.load(tmp_path / "t.pt", weights_only=True))


def test_read_voice_like_bf16(tmp_path: Path) -> None:
    ref = random_tensor(torch.bfloat16, (97, 384), seed=3)
    torch.save(ref, tmp_path / "fr_male.pt")
    ours = read_pt(tmp_path / "fr_male.pt")
    assert ours.dtype == "BF16" and ours.data.dtype == np.uint16
    assert_same(ours, ref)
    # mlx sees the same bfloat16 bits
    arr = to_mlx(ours)
    assert arr.dtype == mx.bfloat16
    assert np.array(arr.view(mx.uint16)).tobytes() == torch_bits(ref)


@pytest.mark.parametrize(
    "make",
    [
        lambda t: t[2:7, ::2],
        lambda t: t.T,
        lambda t: t[3],
        lambda t: t[1:, 3:5].T,
        lambda t: t[5, 2],
        lambda t: t[:, None, 1:4].expand(10, 3, 3),
        lambda t: t[4:4],
        # a size-1 dimension's stride is never used; torch keeps any (numpy overflowed)
        lambda t: t.flatten()[:9].as_strided((1, 9), (2**62, 1)),
    ],
    ids=[
        "slice-step",
        "transpose",
        "row",
        "slice-transpose",
        "scalar-element",
        "expand",
        "empty",
        "huge-unused-stride",
    ],
)
def test_read_views(tmp_path: Path, make) -> None:
    base = random_tensor(torch.bfloat16, (10, 9), seed=1)
    view = make(base)
    torch.save(view, tmp_path / "v.pt")
    loaded = torch.load(tmp_path / "v.pt", weights_only=True)
    assert loaded.stride() == view.stride()  # torch kept the view: we must resolve it
    assert_same(read_pt(tmp_path / "v.pt"), loaded)


def test_read_shared_storage(tmp_path: Path) -> None:
    big = random_tensor(torch.float32, (6, 5), seed=2)
    torch.save({"big": big, "small": big[2:4, 1:], "again": big}, tmp_path / "s.pt")
    with zipfile.ZipFile(tmp_path / "s.pt") as zf:
        assert sum("/data/" in n for n in zf.namelist()) == 1  # one storage, three tensors
    ref = torch.load(tmp_path / "s.pt", weights_only=True)
    for key in ("big", "small", "again"):
        assert_same(read_pt(tmp_path / "s.pt", key=key), ref[key])


def test_read_slice_of_bigger_storage(tmp_path: Path) -> None:
    big = random_tensor(torch.int64, (50, 4), seed=4)
    torch.save(big[40:43], tmp_path / "s.pt")
    assert_same(read_pt(tmp_path / "s.pt"), big[40:43])


def test_read_parameter_and_requires_grad(tmp_path: Path) -> None:
    p = torch.nn.Parameter(random_tensor(torch.float32, (3, 4)))
    torch.save(p, tmp_path / "p.pt")
    assert_same(read_pt(tmp_path / "p.pt"), p)
    g = random_tensor(torch.float32, (5,)).requires_grad_()
    torch.save(g, tmp_path / "g.pt")
    assert_same(read_pt(tmp_path / "g.pt"), g)


def test_read_dict_wrapped(tmp_path: Path) -> None:
    t = random_tensor(torch.bfloat16, (4, 8))
    torch.save({"embedding": t}, tmp_path / "d.pt")
    assert_same(read_pt(tmp_path / "d.pt"), t)
    torch.save(collections.OrderedDict(emb=t, note="hello", n=3), tmp_path / "od.pt")
    assert_same(read_pt(tmp_path / "od.pt"), t)  # exactly one tensor among other values
    assert_same(read_pt(tmp_path / "od.pt", key="emb"), t)


def test_read_dict_several_tensors_needs_key(tmp_path: Path) -> None:
    a, b = random_tensor(torch.float16, (2, 3)), random_tensor(torch.float16, (3,), seed=9)
    torch.save({"alpha": a, "beta": b}, tmp_path / "two.pt")
    with pytest.raises(VoiceError) as exc:
        read_pt(tmp_path / "two.pt")
    text = one_line(exc)
    assert "'alpha'" in text and "'beta'" in text and "key=" in text and "two.pt" in text
    assert_same(read_pt(tmp_path / "two.pt", key="beta"), b)
    with pytest.raises(VoiceError) as exc:
        read_pt(tmp_path / "two.pt", key="gamma")
    assert "'gamma'" in one_line(exc) and "'alpha'" in str(exc.value)


def test_a_dict_of_several_tensors_gives_its_embedding_entry(tmp_path: Path) -> None:
    """As a voice .safetensors holding more than one tensor is read: the "embedding" one
    (such a .pt was refused, with advice to pass key=, which no command offers). Tensors
    nested a dict deeper are named as such, not as missing."""
    emb, sid = random_tensor(torch.bfloat16, (4, 8)), torch.tensor(3)
    torch.save({"speaker_id": sid, "embedding": emb}, tmp_path / "multi.pt")
    assert_same(read_pt(tmp_path / "multi.pt"), emb)
    assert_same(read_pt(tmp_path / "multi.pt", key="speaker_id"), sid)
    torch.save({"voice": {"embedding": emb}, "name": "x"}, tmp_path / "nested.pt")
    with pytest.raises(VoiceError) as exc:
        read_pt(tmp_path / "nested.pt")
    assert "inside another dict (entries 'voice')" in one_line(exc)
    torch.save({"meta": {"rows": 5}, "name": "x"}, tmp_path / "none.pt")
    with pytest.raises(VoiceError, match="holds a dict without any tensor"):
        read_pt(tmp_path / "none.pt")


def test_read_state_dict_module(tmp_path: Path) -> None:
    lin = torch.nn.Linear(4, 3)
    torch.save(lin.state_dict(), tmp_path / "sd.pt")
    assert_same(read_pt(tmp_path / "sd.pt", key="weight"), lin.weight)
    assert_same(read_pt(tmp_path / "sd.pt", key="bias"), lin.bias)


def test_read_scalar_and_empty(tmp_path: Path) -> None:
    for i, t in enumerate([torch.tensor(2.5), torch.zeros(0, 3), torch.ones(2, 0, 4)]):
        torch.save(t, tmp_path / f"{i}.pt")
        ours = read_pt(tmp_path / f"{i}.pt")
        assert_same(ours, t)


def test_read_only_needed_storage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = random_tensor(torch.float32, (1000,))
    b = random_tensor(torch.float32, (3,), seed=5)
    torch.save({"a": a, "b": b}, tmp_path / "ab.pt")
    read: list[str] = []
    original = zipfile.ZipFile.open

    def spy(self, name, *args, **kwargs):
        read.append(name if isinstance(name, str) else name.filename)
        return original(self, name, *args, **kwargs)

    monkeypatch.setattr(zipfile.ZipFile, "open", spy)
    assert_same(read_pt(tmp_path / "ab.pt", key="b"), b)
    storages = [n for n in read if "/data/" in n]
    assert storages == ["ab/data/1"]


def big_endian_copy(src: Path, dst: Path, itemsize: int) -> None:
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info)
            if info.filename.endswith("/byteorder"):
                data = b"big"
            elif "/data/" in info.filename and not info.filename.endswith("serialization_id"):
                data = np.frombuffer(data, f"<u{itemsize}").astype(f">u{itemsize}").tobytes()
            zout.writestr(info.filename, data)


@pytest.mark.parametrize("name", ["BF16", "F32", "I64", "I16"])
def test_read_big_endian(tmp_path: Path, name: str) -> None:
    ref = random_tensor(TORCH_DTYPES[name], (3, 5))
    torch.save(ref, tmp_path / "le.pt")
    big_endian_copy(tmp_path / "le.pt", tmp_path / "be.pt", ref.element_size())
    assert torch.equal(torch.load(tmp_path / "be.pt", weights_only=True).view(-1), ref.view(-1))
    assert_same(read_pt(tmp_path / "be.pt"), ref)


# --------------------------------------------------------------------------- to_mlx / from_mlx


@pytest.mark.parametrize("name", list(TORCH_DTYPES))
def test_mlx_round_trip(tmp_path: Path, name: str) -> None:
    """to_mlx gives torch's own values, bit for bit, in the matching mlx dtype (BF16 too,
    every bit pattern: NaNs, infinities, subnormals); from_mlx gives them back."""
    ref = random_tensor(TORCH_DTYPES[name], (3, 4))
    torch.save(ref, tmp_path / "t.pt")
    arr = to_mlx(read_pt(tmp_path / "t.pt"))
    assert arr.dtype == MX_DTYPES[name]
    assert tuple(arr.shape) == (3, 4)
    if name == "BF16":
        bits = np.array(arr.view(mx.uint16))
        assert np.array_equal(bits, ref.view(torch.uint16).numpy())
        values, want = np.array(arr.astype(mx.float32)), ref.float().numpy()
        np.testing.assert_array_equal(values, want)  # NaN == NaN here
        assert np.array_equal(np.signbit(values), np.signbit(want))
    else:
        assert np.array(arr).tobytes() == torch_bits(ref)
        np.testing.assert_array_equal(np.array(arr), ref.numpy())
    assert_same(from_mlx(arr), ref)


def test_pttensor_validates() -> None:
    with pytest.raises(VoiceError):
        PtTensor("BF16", (2,), np.zeros(2, np.float32))
    with pytest.raises(VoiceError):
        PtTensor("F32", (3,), np.zeros(2, np.float32))
    with pytest.raises(VoiceError):
        PtTensor("C64", (2,), np.zeros(2, np.complex64))
    with pytest.raises(VoiceError):
        PtTensor("F32", (2, 2), np.zeros((2, 2), np.float32).T.copy(order="F"))
    t = PtTensor("F32", [2], np.array([1.0, np.nan], np.float32))
    assert t.shape == (2,) and t == PtTensor("F32", (2,), t.data.copy())


# --------------------------------------------------------------------------- writing


@pytest.mark.parametrize("name", list(TORCH_DTYPES))
@pytest.mark.parametrize("shape", [(5, 7), (3,), (), (0, 4), (2, 3, 4)])
def test_write_round_trip_through_torch(tmp_path: Path, name: str, shape) -> None:
    ref = random_tensor(TORCH_DTYPES[name], shape, seed=11)
    if name == "BF16":
        tensor = PtTensor("BF16", shape, ref.view(torch.uint16).numpy().copy())
    else:
        tensor = ref.numpy().copy()
    write_pt(tmp_path / "w.pt", tensor)
    back = torch.load(tmp_path / "w.pt", weights_only=True)
    assert back.dtype == ref.dtype and back.shape == ref.shape
    assert back.stride() == ref.stride()
    assert torch_bits(back) == torch_bits(ref)
    assert_same(read_pt(tmp_path / "w.pt"), ref)


@pytest.mark.parametrize(
    ("name", "shape"),
    [
        ("BF16", (9, 16)),
        ("F32", ()),
        ("I8", (0, 4)),
        ("BOOL", (2, 3, 4, 5)),
        ("U8", (70000,)),
        ("F16", (300, 300)),
    ],
)
def test_write_matches_torch_layout(tmp_path: Path, name: str, shape) -> None:
    ref = random_tensor(TORCH_DTYPES[name], shape)
    torch.save(ref, tmp_path / "voice.pt")
    ours = tmp_path / "mine" / "voice.pt"
    ours.parent.mkdir()
    bits = ref.view(torch.uint16) if name == "BF16" else ref
    write_pt(ours, PtTensor(name, shape, bits.numpy().copy()))
    with zipfile.ZipFile(tmp_path / "voice.pt") as theirs, zipfile.ZipFile(ours) as mine:
        assert mine.namelist() == theirs.namelist()
        for n in theirs.namelist():
            if not n.endswith("serialization_id"):
                assert mine.read(n) == theirs.read(n), n
        assert mine.testzip() is None
    # every record's data starts on a 64-byte boundary, as torch aligns them
    raw = ours.read_bytes()
    with zipfile.ZipFile(ours) as zf:
        for info in zf.infolist():
            name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26 :][:4])
            assert (info.header_offset + 30 + name_len + extra_len) % 64 == 0
    mapped = torch.load(ours, weights_only=True, mmap=True)
    assert torch_bits(mapped) == torch_bits(ref)


def test_write_normalises_numpy_input(tmp_path: Path) -> None:
    base = np.arange(40, dtype=">f4").reshape(5, 8)
    view = base[::2, 1::3]  # big-endian and non-contiguous
    write_pt(tmp_path / "n.pt", view)
    back = torch.load(tmp_path / "n.pt", weights_only=True)
    assert back.dtype == torch.float32 and np.array_equal(back.numpy(), view)


def test_write_rejects_unsupported(tmp_path: Path) -> None:
    for bad in (np.zeros(3, np.uint16), np.zeros(3, np.complex64), np.array(["a"])):
        with pytest.raises(VoiceError) as exc:
            write_pt(tmp_path / "bad.pt", bad)
        one_line(exc)
    assert not list(tmp_path.iterdir())


def test_write_zip64_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tp, "_ZIP64_LIMIT", 16)  # exercise the >4 GiB code path on tiny data
    ref = random_tensor(torch.float32, (10, 10))
    write_pt(tmp_path / "z.pt", ref.numpy())
    with zipfile.ZipFile(tmp_path / "z.pt") as zf:
        assert zf.testzip() is None
    assert torch_bits(torch.load(tmp_path / "z.pt", weights_only=True)) == torch_bits(ref)
    assert_same(read_pt(tmp_path / "z.pt"), ref)


def test_write_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "v.pt"
    write_pt(target, np.ones(3, np.float32))
    before = target.read_bytes()

    def boom(f, records):
        f.write(b"PK\x03\x04 partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tp, "_write_zip", boom)
    with pytest.raises(VoiceError) as exc:
        write_pt(target, np.zeros(3, np.float32))
    assert "No space left" in one_line(exc)
    assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["v.pt"]


def test_write_to_missing_dir(tmp_path: Path) -> None:
    with pytest.raises(VoiceError) as exc:
        write_pt(tmp_path / "nope" / "v.pt", np.ones(2, np.float32))
    assert "nope" in one_line(exc)


def test_library_needs_no_torch(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import numpy as np\n"
        "from voxtral_mlx.torch_pickle import PtTensor, read_pt, write_pt\n"
        "import voxtral_mlx.voices\n"
        f"p = {str(tmp_path / 'x.pt')!r}\n"
        "write_pt(p, PtTensor('BF16', (2, 2), np.arange(4, dtype=np.uint16).reshape(2, 2)))\n"
        "assert read_pt(p).data.tolist() == [[0, 1], [2, 3]]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path)
    back = torch.load(tmp_path / "x.pt", weights_only=True)
    assert back.view(torch.uint16).tolist() == [[0, 1], [2, 3]]


# --------------------------------------------------------------------------- hostile files


def op_global(module: str, name: str) -> bytes:
    return f"c{module}\n{name}\n".encode()


def op_str(text: str) -> bytes:
    raw = text.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def op_int(value: int) -> bytes:
    return b"J" + struct.pack("<i", value)


def op_tuple(*items: bytes) -> bytes:
    return b"(" + b"".join(items) + b"t"


def tensor_pickle(
    storage: str = "FloatStorage",
    numel: int = 4,
    offset: int = 0,
    shape: tuple[int, ...] = (4,),
    stride: tuple[int, ...] = (1,),
    key: str = "0",
) -> bytes:
    """The opcodes torch.save emits for a tensor, with every field under the test's control."""
    pid = op_tuple(op_str("storage"), op_global("torch", storage), op_str(key), op_str("cpu"))
    pid = pid[:-1] + op_int(numel) + b"t"
    args = (
        pid
        + b"Q"
        + op_int(offset)
        + op_tuple(*(op_int(s) for s in shape))
        + op_tuple(*(op_int(s) for s in stride))
        + b"\x89"
        + op_global("collections", "OrderedDict")
        + b")R"
    )
    return b"\x80\x02" + op_global("torch._utils", "_rebuild_tensor_v2") + b"(" + args + b"tR."


def make_pt(
    path: Path, pkl: bytes, records: dict[str, bytes] | None = None, byteorder: bytes = b"little"
) -> Path:
    records = {"data/0": np.arange(4, dtype=np.float32).tobytes()} if records is None else records
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("archive/data.pkl", pkl)
        zf.writestr("archive/byteorder", byteorder)
        for name, data in records.items():
            zf.writestr(f"archive/{name}", data)
        zf.writestr("archive/version", b"3\n")
    return path


def test_crafted_tensor_pickle_is_accepted(tmp_path: Path) -> None:
    path = make_pt(tmp_path / "ok.pt", tensor_pickle())
    assert read_pt(path).data.tolist() == [0, 1, 2, 3]
    assert torch.load(path, weights_only=True).tolist() == [0, 1, 2, 3]


class _Reduce:
    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def hostile_payloads(marker: Path) -> dict[str, bytes]:
    cmd = f"touch {marker}"
    code = f"open({str(marker)!r}, 'w').write('pwned')"
    payloads = {
        "os.system GLOBAL": b"\x80\x02" + op_global("os", "system") + op_tuple(op_str(cmd)) + b"R.",
        "posix.system proto0": b"cposix\nsystem\n(V" + cmd.encode() + b"\ntR.",
        "builtins.exec STACK_GLOBAL": b"\x80\x04"
        + op_str("builtins")
        + op_str("exec")
        + b"\x93"
        + op_tuple(op_str(code))
        + b"R.",
        "__builtin__.exec": b"\x80\x02"
        + op_global("__builtin__", "exec")
        + op_tuple(op_str(code))
        + b"R.",
        "builtins.eval": b"\x80\x02"
        + op_global("builtins", "eval")
        + op_tuple(op_str(code))
        + b"R.",
        "after a tensor": tensor_pickle()[:-1]
        + op_global("os", "system")
        + op_tuple(op_str(cmd))
        + b"R\x86.",
        "before a tensor GLOBAL only": b"\x80\x02"
        + op_global("subprocess", "Popen")
        + b"0"
        + tensor_pickle()[2:],
        "getattr chain": b"\x80\x02"
        + op_global("builtins", "getattr")
        + op_tuple(op_global("os", "system"), op_str("__call__"))
        + b"R.",
    }
    for proto in (0, 2, 4, 5):
        payloads[f"__reduce__ os.system p{proto}"] = pickle.dumps(
            _Reduce(os.system, cmd), protocol=proto
        )
        payloads[f"__reduce__ subprocess p{proto}"] = pickle.dumps(
            _Reduce(subprocess.Popen, ["touch", str(marker)]), protocol=proto
        )
        payloads[f"__reduce__ exec p{proto}"] = pickle.dumps(_Reduce(exec, code), protocol=proto)
    return payloads


@pytest.mark.parametrize("levels", [5_000, 200_000])
def test_deeply_nested_pickles_are_refused_before_they_are_built(tmp_path: Path, levels) -> None:
    """A tuple nested 5,000 deep as a dict key gave a RecursionError traceback; 200,000 deep
    (a 200 KB file) crashed the process while hashing it."""
    key = b"K" + b"\x85" * levels  # BININT1 0, then TUPLE1 again and again
    pkl = b"\x80\x02}" + key + tensor_pickle()[2:-1] + b"s."
    with pytest.raises(VoiceError) as exc:
        read_pt(make_pt(tmp_path / "deep.pt", pkl))
    assert "nests objects over 32 deep" in one_line(exc)
    shallow = b"\x80\x02}" + b"K" + b"\x85" * 3 + tensor_pickle()[2:-1] + b"s."
    assert read_pt(make_pt(tmp_path / "ok.pt", shallow)).data.tolist() == [0, 1, 2, 3]


def test_a_pickle_building_a_million_objects_is_refused(tmp_path: Path) -> None:
    """2.6 MB of deflated empty-set opcodes took 2.6 GB of memory."""
    pkl = b"\x80\x02" + b"}0" * 600_000 + tensor_pickle()[2:]
    with pytest.raises(VoiceError) as exc:
        read_pt(make_pt(tmp_path / "many.pt", pkl))
    assert "over 500000 operations" in one_line(exc)
    pkl = b"\x80\x02" + b"}0" * 2_500_000 + tensor_pickle()[2:]
    with pytest.raises(VoiceError, match="too large for a tensor file"):
        read_pt(make_pt(tmp_path / "big.pt", pkl))


def test_a_dict_of_many_tensors_is_within_the_limits(tmp_path: Path) -> None:
    torch.save({f"t{i}": torch.full((2,), float(i)) for i in range(2000)}, tmp_path / "d.pt")
    assert read_pt(tmp_path / "d.pt", key="t1999").data.tolist() == [1999.0, 1999.0]


def test_hostile_pickles_refused_unexecuted(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    for label, pkl in hostile_payloads(marker).items():
        globals_named = [
            arg for op, arg, _ in pickletools.genops(pkl) if op.name in ("GLOBAL", "STACK_GLOBAL")
        ]
        assert globals_named or b"\x93" in pkl, label  # the payload does name a global
        path = make_pt(tmp_path / "voice.pt", pkl)
        with pytest.raises(UnsafePickleError) as exc:
            read_pt(path)
        text = one_line(exc)
        assert "voice.pt" in text and "refusing" in text, label
        assert any(w in text for w in ("system", "exec", "eval", "Popen", "getattr")), label
        assert not marker.exists(), f"{label} executed"


def test_hostile_payloads_are_live(tmp_path: Path) -> None:
    """Control: unrestricted pickle.loads does run these payloads (in a child process)."""
    control = tmp_path / "CONTROL"
    payloads = hostile_payloads(control)
    for label in ("os.system GLOBAL", "builtins.exec STACK_GLOBAL", "__reduce__ subprocess p2"):
        code = f"import pickle, time; pickle.loads({payloads[label]!r}); time.sleep(0.2)"
        subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path)
        assert control.exists(), label
        control.unlink()


def test_hostile_object_saved_by_torch(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    evil = _Reduce(os.system, f"touch {marker}")
    torch.save({"embedding": torch.ones(3), "extra": evil}, tmp_path / "evil.pt")
    with pytest.raises(UnsafePickleError) as exc:
        read_pt(tmp_path / "evil.pt")
    assert "system" in one_line(exc)  # posix.system or nt.system
    assert not marker.exists()


def test_refusal_message_example(tmp_path: Path) -> None:
    path = make_pt(tmp_path / "voice.pt", hostile_payloads(tmp_path / "m")["os.system GLOBAL"])
    with pytest.raises(UnsafePickleError) as exc:
        read_pt(path)
    assert "its pickle asks for os.system, which is not part of a tensor file" in str(exc.value)


def test_a_python2_name_is_refused_under_its_python3_name(tmp_path: Path) -> None:
    """A protocol-2 pickle's __builtin__.exec was named so (pickle would run builtins.exec)."""
    pkl = b"\x80\x02" + op_global("__builtin__", "exec") + op_tuple(op_str("1")) + b"R."
    with pytest.raises(UnsafePickleError, match=r"asks for builtins\.exec, which"):
        read_pt(make_pt(tmp_path / "p2.pt", pkl))


def test_refused_global_with_newline_stays_one_line(tmp_path: Path) -> None:
    pkl = b"\x80\x04" + op_str("os\nx") + op_str("sys\ntem") + b"\x93."
    with pytest.raises(UnsafePickleError) as exc:
        read_pt(make_pt(tmp_path / "n.pt", pkl))
    one_line(exc)


@pytest.mark.parametrize(
    "pkl",
    [
        # NEWOBJ on a storage placeholder
        b"\x80\x02" + op_global("torch", "FloatStorage") + b")\x81.",
        # BUILD (setstate) on a placeholder
        b"\x80\x02" + op_global("torch._utils", "_rebuild_tensor_v2") + b"}b.",
        # calling a storage class
        b"\x80\x02" + op_global("torch", "FloatStorage") + b")R.",
        # OrderedDict with arguments
        b"\x80\x02" + op_global("collections", "OrderedDict") + op_tuple(op_str("x")) + b"R.",
        # persistent id that is not a storage tuple
        b"\x80\x02" + op_str("oops") + b"Q.",
        # rebuild with a non-storage first argument
        b"\x80\x02"
        + op_global("torch._utils", "_rebuild_tensor_v2")
        + op_tuple(op_str("x"), op_int(0), b")", b")", b"\x89", b"}")
        + b"R.",
        b"\x80\x02garbage",
        b"",
    ],
    ids=[
        "newobj",
        "build",
        "call-storage",
        "odict-args",
        "bad-pid",
        "bad-storage",
        "junk",
        "empty",
    ],
)
def test_malformed_pickles_are_voice_errors(tmp_path: Path, pkl: bytes) -> None:
    with pytest.raises(VoiceError) as exc:
        read_pt(make_pt(tmp_path / "m.pt", pkl))
    assert "m.pt" in one_line(exc)


def op_long(value: int) -> bytes:
    raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8b" + struct.pack("<I", len(raw)) + raw  # LONG4


@pytest.mark.parametrize("field", ["key", "numel", "offset", "shape", "stride"])
def test_integers_torch_never_writes_are_voice_errors(tmp_path: Path, field: str) -> None:
    """An integer of over 4,300 digits made the error message itself fail (Python refuses to
    print it): a ValueError and a traceback instead of a one-line VoiceError."""
    big = op_long(10**5000)
    if field == "key":
        body = tensor_pickle()[2:-1]
        pkl = b"\x80\x02}(" + big + body + op_str("b") + body + b"u."
    else:
        markers = {"numel": 7771, "offset": 7772, "shape": 7773, "stride": 7774}
        pkl = tensor_pickle(numel=7771, offset=7772, shape=(7773,), stride=(7774,))
        pkl = pkl.replace(op_int(markers[field]), big)
    with pytest.raises(VoiceError) as exc:
        read_pt(make_pt(tmp_path / "m.pt", pkl))
    message = one_line(exc)
    assert "m.pt" in message and len(message) < 400


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "uint16", "complex64"])
def test_tensor_of_an_unread_dtype_names_the_dtype_fix(tmp_path: Path, dtype: str) -> None:
    """A plain torch.save'd tensor of a dtype without a reader here is not called unsafe:
    the message says to save it in a supported dtype."""
    path = tmp_path / "voice.pt"
    torch.save(torch.zeros(4, 8, dtype=getattr(torch, dtype)), path)
    with pytest.raises(VoiceError) as exc:
        read_pt(path)
    text = one_line(exc)
    assert "voice.pt" in text and "BF16" in text and "tensor.float()" in text
    assert "refusing" not in text


# --------------------------------------------------------------------------- broken files


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(VoiceError) as exc:
        read_pt(tmp_path / "absent.pt")
    assert "absent.pt" in one_line(exc)


def test_empty_and_non_zip_files(tmp_path: Path) -> None:
    (tmp_path / "empty.pt").write_bytes(b"")
    (tmp_path / "text.pt").write_text("hello\nworld\n")
    (tmp_path / "mark.pt").write_bytes(b"\x80")  # a pickle's first byte alone
    for name in ("empty.pt", "text.pt", "mark.pt"):
        with pytest.raises(VoiceError) as exc:
            read_pt(tmp_path / name)
        assert name in one_line(exc)


def save_legacy(obj: object, path: Path, protocol: int = 2) -> Path:
    torch.save(obj, path, _use_new_zipfile_serialization=False, pickle_protocol=protocol)
    return path


@pytest.mark.parametrize("protocol", [1, 2, 4, 5])
def test_legacy_format_is_read_bit_exact(tmp_path: Path, protocol: int) -> None:
    """torch.save(..., _use_new_zipfile_serialization=False) files were refused, though
    torch reads them (protocol 1 pickles the magic number as text)."""
    big = random_tensor(torch.bfloat16, (10, 16), seed=4)
    cases = {
        "bf16": (big, None),
        "f32": (random_tensor(torch.float32, (3, 5)), None),
        "slice": (big[3:7, 2:10], None),
        "transposed": (big.t(), None),
        "parameter": (torch.nn.Parameter(big.float()), None),
        "empty": (torch.zeros(0, 4), None),
        "scalar": (torch.tensor(3.5, dtype=torch.float64), None),
        # Two storages: the second tensor's is read, the first's skipped.
        "dict": ({"other": big.float()[:2], "embedding": big[5:]}, "embedding"),
    }
    for name, (obj, key) in cases.items():
        path = save_legacy(obj, tmp_path / f"{name}.pt", protocol)
        ref = torch.load(path, weights_only=False)  # its own file: weights_only lacks protocol 1
        assert_same(read_pt(path, key), ref if key is None else ref[key])


def test_legacy_hostile_pickle_is_refused_unexecuted(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    evil = _Reduce(os.system, f"touch {marker}")
    path = save_legacy({"embedding": torch.ones(3), "extra": evil}, tmp_path / "evil.pt")
    with pytest.raises(UnsafePickleError) as exc:
        read_pt(path)
    assert "system" in one_line(exc)
    assert not marker.exists()


def test_legacy_truncated_or_damaged_is_one_voice_error(tmp_path: Path) -> None:
    raw = save_legacy(random_tensor(torch.bfloat16, (20, 32)), tmp_path / "full.pt").read_bytes()
    for cut in range(1, len(raw), 37):
        (tmp_path / "cut.pt").write_bytes(raw[:cut])
        with pytest.raises(VoiceError) as exc:
            read_pt(tmp_path / "cut.pt")
        assert "cut.pt" in one_line(exc)
    # The storage's element count, the int64 before its bytes, disagreeing with the pickle.
    count = struct.pack("<q", 20 * 32)
    assert raw.count(count) == 1
    (tmp_path / "count.pt").write_bytes(raw.replace(count, struct.pack("<q", 20 * 31)))
    with pytest.raises(VoiceError) as exc:
        read_pt(tmp_path / "count.pt")
    assert "holds 620 values but its pickle declares 640" in one_line(exc)


def test_legacy_storage_keys_must_match_the_pickle(tmp_path: Path) -> None:
    raw = save_legacy(torch.ones(4), tmp_path / "ok.pt").read_bytes()
    stream, ends = io.BytesIO(raw), []
    for _ in range(5):
        for _ in pickletools.genops(stream):
            pass
        ends.append(stream.tell())
    # The fifth pickle (after magic, version, system facts, tensor) lists the storage keys.
    forged = raw[: ends[3]] + pickle.dumps(["1", "2"], protocol=2) + raw[ends[4] :]
    (tmp_path / "keys.pt").write_bytes(forged)
    with pytest.raises(VoiceError) as exc:
        read_pt(tmp_path / "keys.pt")
    assert "list of storages does not match" in one_line(exc)
    bad_version = raw.replace(
        pickle.dumps(1001, protocol=2)[2:-1], pickle.dumps(1002, protocol=2)[2:-1], 1
    )
    (tmp_path / "version.pt").write_bytes(bad_version)
    with pytest.raises(VoiceError) as exc:
        read_pt(tmp_path / "version.pt")
    assert "format version is 1002, not 1001" in one_line(exc)


def legacy_pickles(raw: bytes, n: int = 5) -> list[bytes]:
    """The first ``n`` pickles of a legacy file, each whole."""
    stream, out = io.BytesIO(raw), []
    for _ in range(n):
        start = stream.tell()
        for _ in pickletools.genops(stream):
            pass
        out.append(raw[start : stream.tell()])
    return out


def test_colliding_keys_are_refused_before_any_is_hashed(tmp_path: Path) -> None:
    """Keys whose hashes collide make a dict or set quadratic to build: a 3 MB file within
    every other limit held read_pt for over five minutes (either format)."""
    keys = {(2**61 - 1) * k: 0 for k in range(4)} | dict.fromkeys(range(10_001), 0)
    for name, save in (("zip.pt", torch.save), ("legacy.pt", save_legacy)):
        save({"embedding": torch.ones(3), "keys": keys}, tmp_path / name)
        with pytest.raises(VoiceError, match="builds dicts of over 10000 entries"):
            read_pt(tmp_path / name, "embedding")
    # Many dicts, each within the limit, add up (24 of 10,000 colliding keys took 12 s).
    split = {
        "embedding": torch.ones(3),
        **{f"d{i}": dict.fromkeys(range(i, 10_000, 2), 0) for i in range(3)},
    }
    torch.save(split, tmp_path / "many.pt")
    with pytest.raises(VoiceError, match="builds dicts of over 10000 entries"):
        read_pt(tmp_path / "many.pt", "embedding")
    path = make_pt(tmp_path / "set.pt", b"\x80\x04\x8f(K\x01K\x02\x90.")  # {1, 2}
    with pytest.raises(VoiceError, match="builds a set, which no tensor file holds"):
        read_pt(path)
    ok = {"embedding": torch.ones(3), "meta": dict.fromkeys(range(500), 0)}
    torch.save(ok, tmp_path / "ok.pt")
    assert read_pt(tmp_path / "ok.pt", "embedding").shape == (3,)


def test_legacy_damage_is_named_for_what_it_is(tmp_path: Path, monkeypatch) -> None:
    """Every problem of a legacy pickle read "is a truncated legacy torch.save file (its ...
    ends early)", its own operation limit included."""
    raw = save_legacy(torch.ones(4), tmp_path / "ok.pt").read_bytes()
    magic, version, facts, tensor, keys = legacy_pickles(raw)
    rest = raw[len(magic + version + facts + tensor + keys) :]
    cases = {
        "opcode.pt": (magic + version + b"\xff" + raw[len(magic + version) :], "is damaged"),
        "ops.pt": (
            magic + version + b"N0" * 250_001 + b"}." + tensor + keys + rest,
            "has over 500000 operations",
        ),
        "magic.pt": (raw[:12], "is truncated (its magic number ends early)"),
        # a storage where none belongs: torch refuses it too
        "keys.pt": (
            magic + version + facts + tensor + b"\x80\x02K\x01Q." + rest,
            "a pickle other than the tensor's names a storage",
        ),
    }
    for name, (data, words) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(VoiceError) as exc:
            read_pt(tmp_path / name)
        assert words in one_line(exc) and name in one_line(exc), name
    # A file cut after its size was checked (its old size still seen).
    (tmp_path / "cut.pt").write_bytes(raw[:-10])
    real_fstat = os.fstat

    def old_size(fd: int) -> os.stat_result:
        st = list(real_fstat(fd))
        st[6] = len(raw)  # st_size
        return os.stat_result(st)

    monkeypatch.setattr(tp.os, "fstat", old_size)
    with pytest.raises(VoiceError, match=r"cut\.pt is truncated"):
        read_pt(tmp_path / "cut.pt")


class _Shell:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_a_bare_pickle_is_named_as_such_and_never_run(tmp_path: Path, monkeypatch, protocol):
    """pickle.dumps of anything (a hostile object here) was called torch's legacy format,
    whose suggested fix (re-save it) makes no sense for it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "evil.pt").write_bytes(pickle.dumps(_Shell(), protocol=protocol))
    (tmp_path / "dict.pt").write_bytes(pickle.dumps({"a": 1}, protocol=protocol))
    for name in ("evil.pt", "dict.pt"):
        with pytest.raises(VoiceError) as exc:
            read_pt(tmp_path / name)
        assert f"{name} is a bare Python pickle, not a torch.save file" in one_line(exc)
    assert not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize("keep", [0.3, 0.6, 0.95])
def test_truncated_zip(tmp_path: Path, keep: float) -> None:
    torch.save(random_tensor(torch.bfloat16, (20, 32)), tmp_path / "full.pt")
    raw = (tmp_path / "full.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(raw[: int(len(raw) * keep)])
    with pytest.raises(VoiceError) as exc:
        read_pt(tmp_path / "cut.pt")
    assert "cut.pt" in one_line(exc)


def test_corrupt_storage_bytes(tmp_path: Path) -> None:
    torch.save(random_tensor(torch.float32, (8, 8)), tmp_path / "c.pt")
    raw = bytearray((tmp_path / "c.pt").read_bytes())
    with zipfile.ZipFile(io.BytesIO(bytes(raw))) as zf:
        info = zf.getinfo("c/data/0")
    name_len, extra_len = struct.unpack(
        "<HH", raw[info.header_offset + 26 : info.header_offset + 30]
    )
    data_start = info.header_offset + 30 + name_len + extra_len
    raw[data_start + 5] ^= 0xFF
    (tmp_path / "c.pt").write_bytes(bytes(raw))
    with pytest.raises(VoiceError) as exc:
        read_pt(tmp_path / "c.pt")
    assert "corrupt" in one_line(exc)


def test_zip_without_data_pkl(tmp_path: Path) -> None:
    with zipfile.ZipFile(tmp_path / "z.pt", "w") as zf:
        zf.writestr("archive/data/0", b"\0" * 16)
    with pytest.raises(VoiceError) as exc:
        read_pt(tmp_path / "z.pt")
    assert "data.pkl" in one_line(exc)


@pytest.mark.parametrize("record", ["data/0", "byteorder"])
def test_a_record_stored_twice_is_refused(tmp_path: Path, record: str) -> None:
    """torch.load reads the first of two same-named records, a lookup by name the last:
    which one holds the voice cannot be told."""
    path = tmp_path / "d.pt"
    torch.save(torch.arange(4, dtype=torch.float32), path)
    assert read_pt(path).data.view("<f4").tolist() == [0, 1, 2, 3]
    with zipfile.ZipFile(path) as zf:
        name = next(n for n in zf.namelist() if n.endswith("/" + record))
    with warnings.catch_warnings(), zipfile.ZipFile(path, "a") as zf:
        warnings.simplefilter("ignore")  # zipfile's "Duplicate name"
        zf.writestr(name, b"big" if record == "byteorder" else b"\0" * 16)
    with pytest.raises(VoiceError) as exc:
        read_pt(path)
    assert f"two records named '{name}'" in one_line(exc) and "d.pt" in str(exc.value)


def test_storage_record_missing(tmp_path: Path) -> None:
    path = make_pt(tmp_path / "m.pt", tensor_pickle(), records={})
    with pytest.raises(VoiceError) as exc:
        read_pt(path)
    assert "archive/data/0" in one_line(exc)


@pytest.mark.parametrize(
    "fields",
    [
        {"numel": 4, "shape": (5,)},
        {"numel": 4, "offset": 1, "shape": (4,)},
        {"numel": 4, "shape": (2, 2), "stride": (3, 1)},
        {"numel": 4, "shape": (2, 3), "stride": (1, 2)},
    ],
)
def test_storage_too_small(tmp_path: Path, fields: dict) -> None:
    path = make_pt(tmp_path / "s.pt", tensor_pickle(**fields))
    with pytest.raises(VoiceError) as exc:
        read_pt(path)
    assert "needs" in one_line(exc) and "s.pt" in str(exc.value)


def test_storage_record_shorter_than_declared(tmp_path: Path) -> None:
    path = make_pt(tmp_path / "s.pt", tensor_pickle(numel=8, shape=(4,)))
    with pytest.raises(VoiceError) as exc:
        read_pt(path)
    assert "truncated" in one_line(exc)


def test_storage_record_longer_than_declared(tmp_path: Path) -> None:
    path = make_pt(tmp_path / "s.pt", tensor_pickle(numel=2, shape=(2,)))
    with pytest.raises(VoiceError) as exc:
        read_pt(path)
    assert "16 bytes" in one_line(exc) and "declares 8" in str(exc.value)


def test_expansion_bomb_refused(tmp_path: Path) -> None:
    path = make_pt(tmp_path / "b.pt", tensor_pickle(numel=1, shape=(10**9, 10**6), stride=(0, 0)))
    with pytest.raises(VoiceError) as exc:
        read_pt(path)
    one_line(exc)


@pytest.mark.parametrize(
    "pkl",
    [
        tensor_pickle(shape=(2, 2), stride=(1,)),
        tensor_pickle(shape=(-1,)),
        tensor_pickle(offset=-2),
        tensor_pickle(numel=-4),
    ],
    ids=["stride-len", "negative-shape", "negative-offset", "negative-numel"],
)
def test_bad_tensor_fields(tmp_path: Path, pkl: bytes) -> None:
    path = make_pt(tmp_path / "f.pt", pkl)
    with pytest.raises(VoiceError) as exc:
        read_pt(path)
    one_line(exc)


def test_byteorder_record(tmp_path: Path) -> None:
    path = make_pt(tmp_path / "o.pt", tensor_pickle(), byteorder=b"middle\n")
    with pytest.raises(VoiceError) as exc:
        read_pt(path)
    assert "byteorder" in one_line(exc)


@pytest.mark.parametrize(
    "obj",
    [[torch.ones(2)], "text", 42, {"a": 1}, torch.ones(2).untyped_storage()],
    ids=["list", "str", "int", "dict-no-tensor", "storage"],
)
def test_non_tensor_payloads(tmp_path: Path, obj) -> None:
    torch.save(obj, tmp_path / "x.pt")
    with pytest.raises(VoxtralError) as exc:
        read_pt(tmp_path / "x.pt")
    assert "x.pt" in one_line(exc)


def test_duplicate_storage_declarations(tmp_path: Path) -> None:
    one = tensor_pickle()
    two = tensor_pickle(storage="IntStorage")
    pkl = one[:-1] + two[2:-1] + b"\x86."  # a tuple of two tensors on the same record
    with pytest.raises(VoiceError) as exc:
        read_pt(make_pt(tmp_path / "d.pt", pkl))
    one_line(exc)


def test_a_tensor_larger_than_its_storage_is_refused_beyond_a_megabyte(tmp_path: Path) -> None:
    """expand() strides: 4 MB of storage read as 64 MB (16 rows of the same data) used to
    pass, and a few kilobytes of deflated storage went as far as gigabytes."""
    numel = 1 << 20
    records = {"data/0": bytes(4 * numel)}
    pkl = tensor_pickle(numel=numel, shape=(16, numel), stride=(0, 1))
    with pytest.raises(VoiceError) as exc:
        read_pt(make_pt(tmp_path / "e.pt", pkl, records))
    assert "larger than its 4194304-byte storage" in one_line(exc)
    small = tensor_pickle(numel=4, shape=(3, 4), stride=(0, 1))  # 48 bytes: still read
    assert read_pt(make_pt(tmp_path / "s.pt", small)).data.tolist() == [[0, 1, 2, 3]] * 3


def test_a_voice_larger_than_any_is_refused_before_its_data_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = make_pt(tmp_path / "v.pt", tensor_pickle(numel=4, shape=(2, 2), stride=(2, 1)))
    monkeypatch.setattr(tp, "_read_record", _refusing(tp._read_record, "data/0"))
    with pytest.raises(VoiceError) as exc:
        read_pt(path, max_values=3)
    assert "shape [2, 2] (4 values), more than a voice embedding's 3" in one_line(exc)
    monkeypatch.undo()
    assert read_pt(path, max_values=4).data.tolist() == [[0, 1], [2, 3]]


def _refusing(read, record: str):
    def guarded(zf, info, src):
        if info.filename.endswith(record):
            raise AssertionError(f"{record} was read")
        return read(zf, info, src)

    return guarded


def _deflated_zeros_pt(path: Path, numel: int) -> Path:
    """A .pt whose storage record is ``numel`` float32 zeros, deflated (torch never
    compresses): a few hundred kB on disk that inflate to ``4 * numel`` bytes."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        zf.writestr("archive/data.pkl", tensor_pickle(numel=numel, shape=(numel,)))
        zf.writestr("archive/byteorder", b"little")
        with zf.open("archive/data/0", "w") as f:
            chunk = bytes(1 << 20)
            for _ in range(numel * 4 // len(chunk)):
                f.write(chunk)
        zf.writestr("archive/version", b"3\n")
    return path


def _refuse_inflating(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a storage record is opened (inflated)."""
    real_open = zipfile.ZipFile.open

    def no_inflating(self, name, *args, **kwargs):
        if getattr(name, "filename", name).endswith("data/0"):
            raise AssertionError("the bomb was inflated")
        return real_open(self, name, *args, **kwargs)

    monkeypatch.setattr(zipfile.ZipFile, "open", no_inflating)


def _record_headers(path: Path, record: str) -> tuple[bytearray, int, int]:
    """The archive's bytes and the offsets of ``record``'s local and central headers."""
    with zipfile.ZipFile(path) as zf:
        local = zf.getinfo(record).header_offset
    data = bytearray(path.read_bytes())
    central = [
        at
        for at in range(len(data) - 4)
        if data[at : at + 4] == b"PK\x01\x02" and data[at + 46 :].startswith(record.encode())
    ]
    assert len(central) == 1
    return data, local, central[0]


def test_zip_bomb_storage_is_refused_before_inflating(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """64 MB of zeros in ~64 kB: refused from the zip directory alone (a 3 MB file declaring
    3 GB used to take 6 GB of memory and half a minute)."""
    path = _deflated_zeros_pt(tmp_path / "bomb.pt", 16 << 20)
    assert path.stat().st_size < (1 << 20)
    _refuse_inflating(monkeypatch)
    with pytest.raises(VoiceError) as exc:
        read_pt(path)
    message = one_line(exc)
    assert "zip bomb" in message and "bomb.pt" in message


def test_a_compressed_size_beyond_the_file_is_no_excuse(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ratio was taken against the compressed size the archive declares: declaring 4 MB
    for its 64 kB of deflated zeros let 64 MB through (and expand() strides made that
    gigabytes)."""
    path = _deflated_zeros_pt(tmp_path / "liar.pt", 16 << 20)
    data, local, central = _record_headers(path, "archive/data/0")
    for at in (local + 18, central + 20):  # the compressed size
        data[at : at + 4] = struct.pack("<I", 4 << 20)
    path.write_bytes(bytes(data))
    assert path.stat().st_size < (1 << 20)
    _refuse_inflating(monkeypatch)
    with pytest.raises(VoiceError) as exc:
        read_pt(path)
    assert "zip bomb" in one_line(exc)


def test_a_record_inflating_beyond_its_declared_size_reads_only_that(tmp_path: Path) -> None:
    """A deflated record declaring 16 bytes but inflating to 64 MB: zipfile's read() inflated
    up to 2 GB in one call before cutting the data to the declared size."""
    pkl = tensor_pickle()
    zeros = bytes(64 << 20)
    path = tmp_path / "liar.pt"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        zf.writestr("archive/data.pkl", pkl)
        zf.writestr("archive/byteorder", b"little")
        zf.writestr("archive/data/0", zeros)
        zf.writestr("archive/version", b"3\n")
    data, local, central = _record_headers(path, "archive/data/0")
    # CRC-32 then the compressed and uncompressed sizes, at 14 and 28 bytes in.
    for crc_at, size_at in ((local + 14, local + 22), (central + 16, central + 24)):
        data[crc_at : crc_at + 4] = struct.pack("<I", zlib.crc32(bytes(16)))
        data[size_at : size_at + 4] = struct.pack("<I", 16)
    path.write_bytes(bytes(data))
    tracemalloc.start()
    try:
        t = read_pt(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert t.data.tolist() == [0, 0, 0, 0] and peak < (8 << 20), peak


@pytest.mark.parametrize("method", [zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA], ids=["bzip2", "lzma"])
def test_records_compressed_other_than_deflate_are_refused(tmp_path: Path, method) -> None:
    """zipfile inflates bzip2 and LZMA records in one unbounded call (a 2.6 kB file took
    6 GB), and torch.save never compresses."""
    path = tmp_path / "packed.pt"
    with zipfile.ZipFile(path, "w", method) as zf:
        zf.writestr("archive/data.pkl", tensor_pickle())
        zf.writestr("archive/byteorder", b"little")
        zf.writestr("archive/data/0", np.arange(4, dtype=np.float32).tobytes())
        zf.writestr("archive/version", b"3\n")
    with pytest.raises(VoiceError) as exc:
        read_pt(path)
    message = one_line(exc)
    assert zipfile.compressor_names[method] in message and "re-save it with torch.save" in message


def test_a_memo_index_beyond_the_pickle_is_refused(tmp_path: Path) -> None:
    """LONG_BINPUT 2**28 in a 400-byte file made Python's unpickler allocate a 4 GB memo."""
    pkl = tensor_pickle()[:-1] + b"r" + struct.pack("<I", 1 << 28) + b"."
    with pytest.raises(VoiceError) as exc:
        read_pt(make_pt(tmp_path / "memo.pt", pkl))
    assert "memo index 268435456" in one_line(exc)
    ordinary = tensor_pickle()[:-1] + b"r" + struct.pack("<I", 3) + b"."
    assert read_pt(make_pt(tmp_path / "ok.pt", ordinary)).data.tolist() == [0, 1, 2, 3]


def test_a_zip_of_an_unknown_version_is_one_line(tmp_path: Path) -> None:
    """zipfile raises NotImplementedError for a record needing zip version 6.4."""
    path = make_pt(tmp_path / "v64.pt", tensor_pickle())
    data = bytearray(path.read_bytes())
    data[data.find(b"PK\x01\x02") + 6] = 64  # "version needed to extract"
    path.write_bytes(bytes(data))
    with pytest.raises(VoiceError) as exc:
        read_pt(path)
    assert "corrupt zip archive (zip file version 6.4)" in one_line(exc)


def test_small_deflated_records_still_load(tmp_path: Path) -> None:
    """A re-zipped (deflated) voice of ordinary size is not a bomb, even if it is all zeros."""
    path = _deflated_zeros_pt(tmp_path / "zeros.pt", 1 << 18)  # 1 MiB of zeros
    t = read_pt(path)
    assert t.shape == (1 << 18,) and not t.data.any()
    assert torch.load(path, weights_only=True).shape == (1 << 18,)


@pytest.mark.parametrize(
    "shape", [(2**70, 0), (2**40, 2**40, 0), (2**30, 2**30, 2**30, 0)], ids=["2^70", "2^80", "2^90"]
)
def test_empty_tensor_of_absurd_shape_is_refused(tmp_path: Path, shape) -> None:
    # No element is read, so no storage size bounds the shape; numpy cannot even describe it.
    pkl = tensor_pickle(numel=0, shape=(1,) * len(shape), stride=(1,) * len(shape))
    dims = op_tuple(*(op_int(1) for _ in shape))
    huge = op_tuple(*(pickle.dumps(d, protocol=2)[2:-1] for d in shape))
    path = make_pt(tmp_path / "huge.pt", pkl.replace(dims, huge, 1), {"data/0": b""})
    with pytest.raises(VoiceError) as exc:
        read_pt(path)
    message = one_line(exc)  # a size beyond int64 is no size torch writes
    assert "absurdly large" in message or "non-negative integers" in message
