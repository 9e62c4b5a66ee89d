"""Read and write PyTorch ``.pt`` tensor files without torch, refusing anything but tensors.

``torch.save`` writes a zip archive: ``<archive>/data.pkl`` is a pickle that rebuilds the
tensor from a *persistent id* naming a raw little-endian storage record ``<archive>/data/<key>``.
Unpickling an arbitrary pickle runs arbitrary code, so :func:`read_pt` uses an unpickler whose
``find_class`` hands out inert placeholders for the few globals ``torch.save`` emits for plain
tensors and refuses every other global before anything runs (:class:`UnsafePickleError`).
The placeholders only record what the pickle asked for; values are then copied out of the
storage record with numpy after checking every size, offset and stride against it.
The legacy format (``_use_new_zipfile_serialization=False``: pickles followed by the raw
storages) is read the same way.

:func:`write_pt` writes the same layout (pickle opcodes emitted by hand, storage records
64-byte aligned through a zip extra field as torch does) so that ``torch.load(weights_only=True)``
reads it back bit-exactly, without torch installed.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import pickle
import pickletools
import re
import struct
import sys
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import mlx.core as mx
import numpy as np

from .errors import UnsafePickleError, VoiceError
from .fileio import atomic_write, one_line, unreadable_fix

# safetensors dtype name -> numpy dtype holding the values (BF16 as raw uint16 bit patterns).
DTYPES: dict[str, np.dtype] = {
    "BF16": np.dtype("<u2"),
    "F16": np.dtype("<f2"),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}

# torch's legacy typed-storage class names (what torch.save pickles) -> dtype name.
STORAGE_TYPES: dict[str, str] = {
    "BFloat16Storage": "BF16",
    "HalfStorage": "F16",
    "FloatStorage": "F32",
    "DoubleStorage": "F64",
    "LongStorage": "I64",
    "IntStorage": "I32",
    "ShortStorage": "I16",
    "CharStorage": "I8",
    "ByteStorage": "U8",
    "BoolStorage": "BOOL",
}
_STORAGE_NAMES = {dtype: name for name, dtype in STORAGE_TYPES.items()}

_MX_DTYPES: dict[str, mx.Dtype] = {
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

_SUPPORTED = ", ".join(DTYPES)
# A tensor file's pickle is tiny (a voice's: under 1 KB; a dict of a thousand tensors: about
# 100 KB). Beyond these, a small file could build gigabytes of objects, or nest tuples so
# deep that hashing one overflows the C stack (a crash no exception handler sees).
_MAX_PICKLE_BYTES = 4 << 20
_MAX_PICKLE_OPS = 500_000
_MAX_NESTING = 32  # a tensor in a dict nests 4 deep
# Opcodes that change the container below their arguments in place.
_IN_PLACE_OPS = frozenset({"APPEND", "APPENDS", "SETITEM", "SETITEMS", "BUILD"})
# Hashing keys chosen to collide makes building a dict or set quadratic: 40,000 such keys in
# a 0.5 MB pickle took 9 s, the pickle's limits allow minutes. No tensor file builds a set,
# and dicts of this many entries in all take half a second at worst.
_SET_OPS = frozenset({"EMPTY_SET", "ADDITEMS", "FROZENSET"})
_MAX_DICT_ENTRIES = 10_000
_MAX_COMPRESSION_RATIO = 32  # inflated / deflated size of one zip record, beyond: a bomb
_BOMB_MIN_BYTES = 1 << 20  # small records may compress well (a zero voice): no ratio check
# Overlapping strides (torch's expand()) may make a tensor larger than its storage, which
# torch.save never writes for a voice: beyond 1 MB, a small file asking for gigabytes.
_MAX_EXPANSION = 1
# A shape numpy can still describe (its byte size must fit in 64 bits), even when a zero
# dimension makes the tensor empty.
_MAX_SHAPE_PRODUCT = 1 << 48
_ALIGNMENT = 64  # torch aligns every record's data to 64 bytes
_ZIP64_LIMIT = 0xFFFFFFFF


@dataclass(frozen=True)
class PtTensor:
    """A dense tensor as stored in a ``.pt`` file: dtype name, shape and C-contiguous values."""

    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise VoiceError(f"unsupported tensor dtype {self.dtype!r}; supported: {_SUPPORTED}")
        shape = tuple(int(d) for d in self.shape)
        object.__setattr__(self, "shape", shape)
        data = self.data
        if not isinstance(data, np.ndarray):
            raise VoiceError(f"PtTensor data must be a numpy array, got {type(data).__name__}")
        expected = DTYPES[self.dtype]
        if data.dtype != expected:
            raise VoiceError(
                f"PtTensor of dtype {self.dtype} needs numpy {expected} data, got {data.dtype}"
            )
        if data.shape != shape:
            raise VoiceError(f"PtTensor shape {shape} does not match its data's {data.shape}")
        if not data.flags.c_contiguous:
            raise VoiceError("PtTensor data must be C-contiguous (use np.ascontiguousarray)")

    def __eq__(self, other: object) -> bool:
        """Bit-exact equality (NaNs with equal bits are equal)."""
        if not isinstance(other, PtTensor):
            return NotImplemented
        return (
            self.dtype == other.dtype
            and self.shape == other.shape
            and self.data.tobytes() == other.data.tobytes()
        )

    __hash__ = None  # type: ignore[assignment]  # holds a mutable array


def to_mlx(t: PtTensor) -> mx.array:
    """The tensor as an mlx array of the same dtype, bit-exact (BF16 via a uint16 view)."""
    if t.dtype == "BF16":
        return mx.array(t.data).view(mx.bfloat16)
    return mx.array(t.data, dtype=_MX_DTYPES[t.dtype])


def from_mlx(a: mx.array) -> PtTensor:
    """An mlx array as a :class:`PtTensor` of the same dtype, bit-exact."""
    names = [name for name, mx_dtype in _MX_DTYPES.items() if a.dtype == mx_dtype]
    if not names:
        raise VoiceError(f"cannot store an mlx array of dtype {a.dtype}; supported: {_SUPPORTED}")
    if names[0] == "BF16":
        a = a.view(mx.uint16)
    data = np.array(a, dtype=DTYPES[names[0]], order="C", copy=True)
    return PtTensor(names[0], tuple(a.shape), data)


def _from_numpy(array: np.ndarray) -> PtTensor:
    for name, np_dtype in DTYPES.items():
        if name != "BF16" and array.dtype.newbyteorder("<") == np_dtype.newbyteorder("<"):
            data = np.asarray(array, dtype=np_dtype, order="C")
            return PtTensor(name, tuple(array.shape), data)
    raise VoiceError(
        f"cannot write a numpy array of dtype {array.dtype} to a .pt file; supported: "
        f"{_SUPPORTED} (wrap BF16 bit patterns as PtTensor('BF16', shape, uint16_data))"
    )


# --------------------------------------------------------------------------- reading


class _Malformed(Exception):
    """Raised by placeholders while unpickling; turned into a VoiceError naming the file."""


class _Inert:
    """Base of the placeholders: pickle's BUILD opcode may not poke at them."""

    __slots__ = ()

    def __setstate__(self, state: Any) -> None:
        raise _Malformed("the pickle tries to set state on a torch placeholder")


class _StorageType(_Inert):
    """Stands in for ``torch.<X>Storage``; only ever used as a marker in a persistent id."""

    __slots__ = ("dtype",)

    def __init__(self, dtype: str):
        self.dtype = dtype


class _StorageRef(_Inert):
    """A storage record the pickle refers to: ``<archive>/data/<key>``, ``numel`` elements."""

    __slots__ = ("dtype", "key", "numel")

    def __init__(self, dtype: str, key: str, numel: int):
        self.dtype = dtype
        self.key = key
        self.numel = numel


class _TensorRef(_Inert):
    """A strided view of a storage record, not yet read."""

    __slots__ = ("offset", "shape", "storage", "stride")

    def __init__(self, storage: _StorageRef, offset: int, shape: tuple, stride: tuple):
        self.storage = storage
        self.offset = offset
        self.shape = shape
        self.stride = stride


def _is_int(value: Any) -> bool:
    """An integer torch could have written (sizes, strides and offsets are int64)."""
    return isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63


def _shown(value: Any, limit: int = 160) -> str:
    """``repr(value)`` for a message; Python refuses to print integers of over 4,300 digits,
    and a container whose parts are shared many times over (``t = (t, t)``, grown in place
    after it was shared) is named, not printed (its repr may need gigabytes)."""
    if not _few_parts(value, limit):
        return f"<a {type(value).__name__} of many parts>"
    try:
        return one_line(repr(value), limit)
    except (ValueError, RecursionError):
        return f"<an integer of {value.bit_length()} bits>" if isinstance(value, int) else "<?>"


def _few_parts(value: Any, most: int) -> bool:
    """Whether ``value`` holds at most ``most`` parts, shared ones counted each time (as
    repr would print them)."""
    todo, seen = [value], 0
    while todo:
        item = todo.pop()
        seen += 1
        if seen > most:
            return False
        if isinstance(item, dict):
            todo.extend(item.keys())
            todo.extend(item.values())
        elif isinstance(item, (tuple, list, frozenset, set)):
            todo.extend(item)
    return True


def _int_tuple(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple) or not all(_is_int(v) and v >= 0 for v in value):
        raise _Malformed(f"tensor {what} must be a tuple of non-negative integers")
    return value


class _RebuildTensorV2(_Inert):
    """Stands in for ``torch._utils._rebuild_tensor_v2``."""

    __slots__ = ()

    def __call__(
        self,
        storage: Any,
        storage_offset: Any,
        size: Any,
        stride: Any,
        requires_grad: Any,
        backward_hooks: Any,
        metadata: Any = None,
    ) -> _TensorRef:
        if not isinstance(storage, _StorageRef):
            raise _Malformed("a tensor is rebuilt from something that is not a storage record")
        if not _is_int(storage_offset) or storage_offset < 0:
            raise _Malformed("tensor storage offset must be a non-negative integer")
        shape = _int_tuple(size, "shape")
        strides = _int_tuple(stride, "stride")
        if len(shape) != len(strides):
            raise _Malformed(f"tensor shape {shape} and stride {strides} differ in length")
        if len(shape) > 32:
            raise _Malformed(f"tensor has {len(shape)} dimensions; at most 32 are supported")
        if math.prod(d for d in shape if d) > _MAX_SHAPE_PRODUCT:
            raise _Malformed(f"tensor shape {one_line(str(list(shape)), 80)} is absurdly large")
        if not isinstance(requires_grad, bool) or not isinstance(backward_hooks, dict):
            raise _Malformed("tensor requires_grad / backward_hooks arguments are malformed")
        if metadata is not None and not isinstance(metadata, dict):
            raise _Malformed("tensor metadata must be a dict")
        if metadata and any(metadata.values()):
            flags = ", ".join(_shown(k, 80) for k, v in metadata.items() if v)
            raise _Malformed(f"tensor carries lazy {flags} bits, which are not supported")
        return _TensorRef(storage, storage_offset, shape, strides)


class _RebuildParameter(_Inert):
    """Stands in for ``torch._utils._rebuild_parameter``: an nn.Parameter is its data."""

    __slots__ = ()

    def __call__(self, data: Any, requires_grad: Any, backward_hooks: Any) -> _TensorRef:
        if not isinstance(data, _TensorRef):
            raise _Malformed("an nn.Parameter wraps something that is not a tensor")
        if not isinstance(requires_grad, bool) or not isinstance(backward_hooks, dict):
            raise _Malformed("nn.Parameter requires_grad / backward_hooks are malformed")
        return data


class _AttrDict(dict):
    """What the OrderedDict placeholder builds: a dict that ignores attributes set on it.

    ``state_dict()`` results carry a ``_metadata`` attribute, pickled as BUILD with a dict.
    """

    __slots__ = ()

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, dict):
            raise _Malformed("the pickle sets a non-dict state on an OrderedDict")


class _OrderedDict(_Inert):
    """Stands in for ``collections.OrderedDict``: returns an empty (insertion-ordered) dict."""

    __slots__ = ()

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        if args or kwargs:
            raise _Malformed("OrderedDict is built with arguments; torch.save never does that")
        return _AttrDict()


# The complete list of globals a torch.save'd tensor file may name. Everything else is refused.
_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _RebuildTensorV2(),
    ("torch._utils", "_rebuild_parameter"): _RebuildParameter(),
    ("collections", "OrderedDict"): _OrderedDict(),
    **{("torch", name): _StorageType(dtype) for name, dtype in STORAGE_TYPES.items()},
}


class _UnreadDtype(VoiceError):
    """A plain tensor of a dtype without a reader here (float8, uint16, complex)."""


def _python3_name(module: str, name: str) -> tuple[str, str]:
    """What a protocol-2 pickle's Python 2 name (``__builtin__.exec``) means in Python 3,
    as pickle itself would map it, for the refusal to name."""
    import _compat_pickle

    if (module, name) in _compat_pickle.NAME_MAPPING:
        return _compat_pickle.NAME_MAPPING[(module, name)]
    return _compat_pickle.IMPORT_MAPPING.get(module, module), name


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file: BinaryIO, source: str, legacy: bool = False):
        super().__init__(file)
        self._source = source
        # The legacy format's storage ids carry a sixth field, a storage view's metadata
        # (never written since torch 1.0: always None).
        self._id_length = 6 if legacy else 5
        self.storages: dict[str, _StorageRef] = {}

    def find_class(self, module: str, name: str) -> Any:
        placeholder = _ALLOWED.get((module, name))
        if placeholder is not None:
            return placeholder
        what = one_line(".".join(_python3_name(module, name)), 100)
        if (module, name) == ("torch._utils", "_rebuild_tensor_v3") or (
            module == "torch" and name.endswith("Storage")
        ):  # a plain tensor file, of a dtype without a reader here (float8, uint16, complex)
            raise _UnreadDtype(
                f"cannot load {self._source}: it holds a tensor of a dtype this reader does "
                f"not support (its pickle asks for {what}); save it as one of {_SUPPORTED} "
                "(e.g. torch.save(tensor.float(), path))"
            )
        if module == "torch" or module.startswith("torch."):
            raise UnsafePickleError(
                f"refusing to load {self._source}: its pickle asks for {what}, which is not "
                f"part of a plain tensor file; only tensors (or a dict of them) of dtype "
                f"{_SUPPORTED} saved with torch.save are accepted"
            )
        raise UnsafePickleError(
            f"refusing to load {self._source}: its pickle asks for {what}, which is not part "
            f"of a tensor file; only tensors saved with torch.save are accepted"
        )

    def persistent_load(self, pid: Any) -> _StorageRef:
        if (
            not isinstance(pid, tuple)
            or len(pid) != self._id_length
            or pid[0] != "storage"
            or not isinstance(pid[1], _StorageType)
            or not isinstance(pid[2], str)
            or not isinstance(pid[3], str)
            or not _is_int(pid[4])
            or pid[4] < 0
        ):
            raise _Malformed("a persistent id is not a torch storage record")
        if pid[5:] not in ((), (None,)):
            raise _Malformed("it holds a storage view (written by torch before 1.0)")
        storage_type, key, numel = pid[1], pid[2], pid[4]
        known = self.storages.get(key)
        if known is None:
            known = self.storages[key] = _StorageRef(storage_type.dtype, key, numel)
        elif known.dtype != storage_type.dtype or known.numel != numel:
            raise _Malformed(f"storage record data/{one_line(key)} is declared twice differently")
        return known


class _NoStorages(_RestrictedUnpickler):
    """For the legacy format's pickles around the tensor's, which name no storage."""

    def persistent_load(self, pid: Any) -> _StorageRef:
        raise _Malformed("a pickle other than the tensor's names a storage")


_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C  # torch's legacy serialization magic number


def _is_legacy_pickle(head: bytes) -> bool:
    # torch.save(..., _use_new_zipfile_serialization=False) starts with a pickled magic number
    # (LONG1 after the protocol mark; a text LONG with pickle protocol 0 or 1).
    # A file cut inside the magic number still opens with part of it (then: "truncated").
    magic = b"\x8a\x0a" + _LEGACY_MAGIC.to_bytes(10, "little")
    if head[:1] == b"\x80":  # PROTO n, and from protocol 4 a FRAME (opcode, 8-byte length)
        body = head[11:] if head[2:3] == b"\x95" else head[2:]
        return _opens_with(body, magic, 2)
    return _opens_with(head, magic, 2) or _opens_with(head, b"L" + str(_LEGACY_MAGIC).encode(), 3)


def _opens_with(data: bytes, prefix: bytes, least: int) -> bool:
    """Whether ``data`` starts with ``prefix``, or is a start of it ``least`` bytes long."""
    if len(data) >= len(prefix):
        return data.startswith(prefix)
    return len(data) >= least and prefix.startswith(data)


def _is_pickle(head: bytes) -> bool:
    # Protocol 2 and later open with PROTO and the protocol's number.
    return len(head) > 1 and head[0] == 0x80 and 2 <= head[1] <= 5


def read_pt(
    path: str | os.PathLike[str], key: str | None = None, *, max_values: int | None = None
) -> PtTensor:
    """Read the tensor a ``torch.save`` file holds, without torch and without running its pickle.

    The file may hold a bare tensor, an ``nn.Parameter`` or a dict (``dict``/``OrderedDict``)
    of tensors: ``key`` picks an entry of a dict (a bare tensor is returned whatever the key);
    without it the dict must hold exactly one tensor. Views (offsets, slices, transposes,
    shared storages) come out materialised C-contiguous. Raises :class:`UnsafePickleError`
    if the pickle names any global other than the torch tensor-rebuilding ones, and
    :class:`VoiceError` for every other problem. ``max_values`` refuses a larger tensor
    before any of its data is read (a few kilobytes can declare gigabytes of repeats).
    """
    path = Path(path)
    src = one_line(str(path))
    try:
        with open(path, "rb") as f:
            head = f.read(32)
            if head[:4] != b"PK\x03\x04" and _is_legacy_pickle(head):
                f.seek(0)
                return _read_legacy(f, src, key, max_values)
    except FileNotFoundError:
        raise VoiceError(f"{src} does not exist; check the path") from None
    except OSError as e:
        fix = unreadable_fix(e, "re-download or re-create it")
        raise VoiceError(f"cannot read {src}: {one_line(e.strerror or str(e))}; {fix}") from e
    if not head:
        raise VoiceError(f"{src} is empty; re-download or re-create it")
    if head[:4] != b"PK\x03\x04":
        if _is_pickle(head):
            raise VoiceError(
                f"{src} is a bare Python pickle, not a torch.save file (nothing in it was run); "
                f"use the voice files the model came with"
            )
        raise VoiceError(f"{src} is not a torch.save zip archive; check the file")
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError) as e:
        raise VoiceError(
            f"{src} is a truncated or corrupt zip archive ({one_line(str(e))}); "
            f"re-download or re-create it"
        ) from e
    with zf:
        return _read_zip(zf, src, key, max_values)


def _archive_bytes(zf: zipfile.ZipFile) -> int:
    try:
        return os.fstat(zf.fp.fileno()).st_size
    except (AttributeError, OSError, ValueError):  # an archive in memory
        return sys.maxsize


def _read_record(zf: zipfile.ZipFile, info: zipfile.ZipInfo, src: str) -> bytes:
    # torch.save stores records uncompressed; a re-zipped voice may be deflated. zipfile
    # inflates bzip2 and LZMA in one unbounded call whatever size the record declares.
    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        method = zipfile.compressor_names.get(info.compress_type, f"method {info.compress_type}")
        raise VoiceError(
            f"{src} stores its record {one_line(info.filename)} compressed with {method}, "
            "which torch.save never does; re-save it with torch.save"
        )
    # A deflated record that inflates far beyond its size on disk is a decompression bomb
    # (3 MB of deflated zeros declaring 3 GB): refused before inflating anything. Real
    # tensor data deflates by 2x at most.
    # The compressed size is the archive's own word too: no more than the whole file.
    compressed = min(info.compress_size, _archive_bytes(zf))
    if (
        info.compress_type != zipfile.ZIP_STORED
        and info.file_size > _BOMB_MIN_BYTES
        and info.file_size > _MAX_COMPRESSION_RATIO * max(compressed, 1)
    ):
        raise VoiceError(
            f"{src} is refused: its record {one_line(info.filename)} would inflate "
            f"{compressed} bytes to {info.file_size} (a zip bomb); re-save it with "
            "torch.save"
        )
    try:
        # Read to the declared size only: read() would inflate up to 2 GB in one call
        # for a record declaring a few bytes.
        with zf.open(info) as f:
            data = f.read(info.file_size)
    except Exception as e:  # zipfile raises many types for damaged members
        raise VoiceError(
            f"cannot read record {one_line(info.filename)} of {src} "
            f"({one_line(str(e)) or type(e).__name__}); "
            f"the file is corrupt: re-download or re-create it"
        ) from e
    if len(data) != info.file_size:
        raise VoiceError(f"record {one_line(info.filename)} of {src} is truncated; re-download it")
    return data


def _read_zip(zf: zipfile.ZipFile, src: str, key: str | None, max_values: int | None) -> PtTensor:
    seen: set[str] = set()
    for info in zf.infolist():
        # Lookups by name find the last of two records and torch the first: which one holds
        # the voice cannot be told, so a damaged (or doctored) archive is refused.
        if info.filename in seen:
            raise VoiceError(
                f"{src} holds two records named {one_line(info.filename, 100)!r}: the file is "
                "damaged; re-download it or re-save the tensor with torch.save"
            )
        seen.add(info.filename)
    pickles = [
        i for i in zf.infolist() if i.filename.endswith("/data.pkl") and i.filename.count("/") == 1
    ]
    if not pickles:
        raise VoiceError(
            f"{src} is a zip archive without a data.pkl record, so not a torch.save file; "
            f"re-save it with torch.save"
        )
    if len(pickles) > 1:
        raise VoiceError(
            f"{src} holds {len(pickles)} data.pkl records, not one: it is no torch.save file; "
            "re-save the tensor with torch.save"
        )
    info = pickles[0]
    prefix = info.filename[: -len("data.pkl")]
    if info.file_size > _MAX_PICKLE_BYTES:
        raise VoiceError(
            f"{src}: data.pkl is {info.file_size} bytes, too large for a tensor file; re-save "
            "the tensor alone with torch.save"
        )

    payload, _ = _unpickle(_read_record(zf, info, src), _RestrictedUnpickler, src)
    tensor = _select(payload, key, src)
    return _materialise(zf, prefix, tensor, src, max_values)


def _unpickle(data: bytes, unpickler: type[_RestrictedUnpickler], src: str, **kw: Any) -> Any:
    """The object one pickle builds, with the storages it named, or a :class:`VoiceError`."""
    reader = unpickler(io.BytesIO(data), src, **kw)
    try:
        _check_shape(data)
        return reader.load(), reader.storages
    except (UnsafePickleError, _UnreadDtype):
        raise
    except _Malformed as e:
        raise VoiceError(
            f"{src} is not a plain tensor file: {e}; re-save it with torch.save"
        ) from e
    except Exception as e:  # any other failure of a hostile or damaged pickle
        raise VoiceError(
            f"{src} holds a malformed pickle ({type(e).__name__}: {one_line(str(e), 100)}); "
            f"re-download or re-save it with torch.save"
        ) from e


_LEGACY_PROTOCOL = 1001  # torch's legacy format version, its second pickle


def _read_legacy(f: BinaryIO, src: str, key: str | None, max_values: int | None) -> PtTensor:
    """A legacy ``torch.save`` file: pickles of the magic number, the format version and
    the saving machine's facts, the tensor's pickle, the sorted storage keys; then per key
    the storage's element count (int64) and its little-endian bytes."""
    size = os.fstat(f.fileno()).st_size
    head = f.read(_MAX_PICKLE_BYTES)
    pos = 0

    def refuse(problem: str) -> VoiceError:
        return VoiceError(f"{src} is not a valid legacy torch.save file: {problem}; re-save it")

    def next_pickle(what: str, unpickler: type[_RestrictedUnpickler] = _NoStorages) -> Any:
        nonlocal pos
        stream = io.BytesIO(head)
        stream.seek(pos)
        count, damage = 0, None
        try:  # to the pickle's end (STOP), within the limit _check_shape sets
            for count, _ in enumerate(pickletools.genops(stream)):
                if count > _MAX_PICKLE_OPS:
                    break
        except ValueError as e:  # an unknown opcode, or the data ends early
            damage = e
        if count > _MAX_PICKLE_OPS:
            raise refuse(f"its {what} has over {_MAX_PICKLE_OPS} operations")
        if damage is not None and stream.tell() >= len(head):  # the data ran out
            if len(head) < size:
                raise VoiceError(
                    f"{src}: its {what} goes on beyond {_MAX_PICKLE_BYTES >> 20} MiB, too "
                    "large for a tensor file; re-save the tensor alone with torch.save"
                )
            raise VoiceError(
                f"{src} is truncated (its {what} ends early); re-download or re-create it"
            )
        if damage is not None:
            raise refuse(f"its {what} is damaged ({one_line(str(damage), 80)})")
        data, pos = head[pos : stream.tell()], stream.tell()
        return _unpickle(data, unpickler, src, legacy=True)

    if next_pickle("magic number")[0] != _LEGACY_MAGIC:
        raise refuse("its magic number is wrong")
    version = next_pickle("format version")[0]
    if version != _LEGACY_PROTOCOL:
        raise refuse(f"its format version is {_shown(version, 40)}, not {_LEGACY_PROTOCOL}")
    if not isinstance(next_pickle("system information")[0], dict):
        raise refuse("its system information is not a dict")
    payload, storages = next_pickle("tensor pickle", _RestrictedUnpickler)
    keys = next_pickle("storage keys")[0]
    if (
        not isinstance(keys, list)
        or not all(isinstance(k, str) for k in keys)
        or len(set(keys)) != len(keys)
        or set(keys) != set(storages)
    ):
        raise refuse("its list of storages does not match the storages its pickle names")
    tensor = _select(payload, key, src)
    _check_size(tensor, src, max_values)
    for k in keys:
        storage = storages[k]
        nbytes = storage.numel * DTYPES[storage.dtype].itemsize
        if pos + 8 + nbytes > size:
            raise VoiceError(
                f"{src} is truncated: storage {one_line(k, 40)} needs {nbytes} bytes after "
                f"byte {pos + 8} of a {size}-byte file; re-download or re-create it"
            )
        f.seek(pos)
        (count,) = struct.unpack("<q", _read_exact(f, 8, src))
        if count != storage.numel:
            raise refuse(
                f"storage {one_line(k, 40)} holds {count} values but its pickle declares "
                f"{storage.numel}"
            )
        if k == tensor.storage.key:
            return _view(tensor, src, lambda n=nbytes: _read_exact(f, n, src), "little")
        pos += 8 + nbytes
    raise AssertionError("the tensor's storage is among the checked keys")


def _read_exact(f: BinaryIO, n: int, src: str) -> bytes:
    data = f.read(n)
    if len(data) != n:  # cut since its size was checked
        raise VoiceError(f"{src} is truncated; re-download or re-create it")
    return data


def _check_shape(data: bytes) -> None:
    """Walk the pickle's opcodes, building nothing, and refuse one that would make more
    objects than :data:`_MAX_PICKLE_OPS`, nest them deeper than :data:`_MAX_NESTING`, build
    a set, dicts of over :data:`_MAX_DICT_ENTRIES` entries in all, or an object of over
    :data:`_MAX_PICKLE_OPS` parts counting shared ones each time: ``t = (t, t)`` 31 times
    over is 31 deep and a few hundred bytes, yet hashing it as a key takes 2**31 steps.

    The stack holds object numbers; ``depth[n]`` is how deep object ``n`` nests and
    ``parts[n]`` how many parts it has. The memo holds numbers too, so a container changed
    after it was memoised is still seen whole.
    """
    stack: list[int] = []
    marks: list[int] = []
    memo: dict[Any, int] = {}
    depth: list[int] = []
    parts: list[int] = []
    entries = 0  # of all dicts: one per dict would let many dicts add up
    try:
        ops = pickletools.genops(data)
        for count, (op, arg, _) in enumerate(ops):
            if count >= _MAX_PICKLE_OPS:
                raise _Malformed(f"its pickle has over {_MAX_PICKLE_OPS} operations")
            name = op.name
            if name == "STOP":
                return
            if name in _SET_OPS:
                raise _Malformed("its pickle builds a set, which no tensor file holds")
            if name == "MARK":
                marks.append(len(stack))
            elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
                if arg > count:  # Python's unpickler allocates a memo this large
                    raise _Malformed(
                        f"its pickle stores an object under memo index {arg}, beyond the "
                        f"{count} it could have made so far"
                    )
                memo[arg] = stack[-1]
            elif name == "MEMOIZE":
                memo[len(memo)] = stack[-1]
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                stack.append(memo[arg])
            elif name == "POP":
                if marks and marks[-1] == len(stack):
                    marks.pop()
                else:
                    stack.pop()
            elif name == "POP_MARK":
                del stack[marks.pop() :]
            elif name == "DUP":
                stack.append(stack[-1])
            else:
                before = op.stack_before
                if pickletools.markobject in before:
                    start = marks.pop() - before.index(pickletools.markobject)
                else:
                    start = len(stack) - len(before)
                if start < 0:
                    raise _Malformed("its pickle takes more from its stack than it put there")
                taken = stack[start:]
                del stack[start:]
                if not op.stack_after:
                    continue
                if name in _IN_PLACE_OPS:
                    target, items = taken[0], taken[1:]
                    inner = max((depth[i] for i in items), default=-1) + 1
                    depth[target] = max(depth[target], inner)
                    parts[target] += sum(parts[i] for i in items)
                else:
                    target, items = len(depth), taken
                    depth.append(max((depth[i] for i in taken), default=-1) + 1)
                    parts.append(1 + sum(parts[i] for i in taken))
                if parts[target] > _MAX_PICKLE_OPS:
                    raise _Malformed(
                        f"its pickle shares objects into one of over {_MAX_PICKLE_OPS} parts"
                    )
                if name in ("DICT", "SETITEM", "SETITEMS"):
                    entries += len(items) // 2
                    if entries > _MAX_DICT_ENTRIES:
                        raise _Malformed(
                            f"its pickle builds dicts of over {_MAX_DICT_ENTRIES} entries"
                        )
                if depth[target] > _MAX_NESTING:
                    raise _Malformed(f"its pickle nests objects over {_MAX_NESTING} deep")
                stack.append(target)
    except (IndexError, KeyError):
        raise _Malformed("its pickle refers to objects it never made") from None
    except ValueError as e:  # genops: an unknown opcode, or the data ends early
        raise _Malformed(f"its pickle is damaged ({one_line(str(e), 80)})") from None
    raise _Malformed("its pickle has no end (STOP)")


def _describe(value: Any) -> str:
    if isinstance(value, _TensorRef):
        return "a tensor"
    if isinstance(value, (_StorageRef, _StorageType)):
        return "a bare storage"
    name = type(value).__name__
    return f"{'an' if name[:1] in 'aeiou' else 'a'} {name}"


def _select(payload: Any, key: str | None, src: str) -> _TensorRef:
    if isinstance(payload, _TensorRef):
        return payload
    if not isinstance(payload, dict):
        raise VoiceError(
            f"{src} holds {_describe(payload)}, not a tensor; save the tensor itself "
            f"(torch.save(t, path)) or a dict of tensors"
        )
    tensors = [k for k, v in payload.items() if isinstance(v, _TensorRef)]
    listed = ", ".join(_shown(k, 60) for k in tensors[:20]) or "none"
    if key is not None:
        if key not in payload:
            raise VoiceError(f"{src} has no entry {_shown(key)}; its tensors are: {listed}")
        if not isinstance(payload[key], _TensorRef):
            raise VoiceError(
                f"entry {_shown(key)} of {src} is {_describe(payload[key])}, not a tensor"
            )
        return payload[key]
    if len(tensors) == 1:
        return payload[tensors[0]]
    if "embedding" in tensors:  # as a voice .safetensors with more than one tensor is read
        return payload["embedding"]
    if not tensors:
        nested = [
            k
            for k, v in payload.items()
            if isinstance(v, dict) and any(isinstance(t, _TensorRef) for t in v.values())
        ]
        if nested:
            raise VoiceError(
                f"{src} holds a dict whose tensors are inside another dict (entries "
                f"{', '.join(_shown(k, 60) for k in nested[:5])}); save the voice embedding "
                "itself (torch.save(tensor, path))"
            )
        raise VoiceError(f"{src} holds a dict without any tensor; expected a voice embedding")
    raise VoiceError(
        f"{src} holds {len(tensors)} tensors ({listed}); a voice file holds one: save just "
        "the embedding (torch.save(tensor, path)), or in Python pass key= to pick one"
    )


def _check_size(t: _TensorRef, src: str, max_values: int | None) -> None:
    numel = math.prod(t.shape)
    if max_values is not None and numel > max_values:
        raise VoiceError(
            f"{src} holds a tensor of shape {list(t.shape)} ({numel} values), more than a "
            f"voice embedding's {max_values} at most; it is not a voice (take the .pt files "
            "from the checkpoint's voice_embedding folder)"
        )


def _materialise(
    zf: zipfile.ZipFile, prefix: str, t: _TensorRef, src: str, max_values: int | None
) -> PtTensor:
    _check_size(t, src, max_values)
    dtype = DTYPES[t.storage.dtype]
    record = f"{prefix}data/{t.storage.key}"
    try:
        info = zf.getinfo(record)
    except KeyError:
        raise VoiceError(
            f"{src} lacks storage record {one_line(record)} its pickle refers to; "
            f"the file is incomplete: re-download or re-create it"
        ) from None

    byteorder = "little"
    try:
        order_info = zf.getinfo(f"{prefix}byteorder")
    except KeyError:
        order_info = None  # written before torch 1.12: little-endian on every platform we run on
    if order_info is not None:
        if order_info.file_size > 16:
            raise VoiceError(f"{src} has a malformed byteorder record; re-save it with torch.save")
        raw_order = _read_record(zf, order_info, src)
        if raw_order not in (b"little", b"big"):
            raise VoiceError(
                f"{src} has an unknown byteorder {_shown(raw_order)}; re-save it with torch"
            )
        byteorder = raw_order.decode()

    storage_bytes = t.storage.numel * dtype.itemsize
    if info.file_size != storage_bytes:  # torch writes exactly numel * itemsize bytes
        state = "truncated" if info.file_size < storage_bytes else "malformed"
        raise VoiceError(
            f"storage record {one_line(record)} of {src} holds {info.file_size} bytes but its "
            f"pickle declares {storage_bytes}; the file is {state}: re-download or re-create it"
        )
    return _view(t, src, lambda: _read_record(zf, info, src), byteorder)


def _view(t: _TensorRef, src: str, read: Callable[[], bytes], byteorder: str) -> PtTensor:
    """The tensor's values from its storage's bytes (``read()``, called only when needed),
    after checking its shape, strides and offset against the storage."""
    dtype_name = t.storage.dtype
    dtype = DTYPES[dtype_name]
    shape, strides, offset = t.shape, t.stride, t.offset
    numel = math.prod(shape)
    storage_bytes = t.storage.numel * dtype.itemsize
    if numel == 0:
        return PtTensor(dtype_name, shape, np.zeros(shape, dtype))
    # A dimension of size 1 is never stepped along: its stride can be anything (torch
    # allows 2**62), which numpy's as_strided cannot take.
    strides = tuple(0 if d == 1 else st for d, st in zip(shape, strides, strict=True))
    needed = offset + sum((d - 1) * s for d, s in zip(shape, strides, strict=True)) + 1
    if needed > t.storage.numel:
        raise VoiceError(
            f"{src} is malformed: a tensor of shape {list(shape)}, stride {list(strides)} and "
            f"offset {offset} needs {needed} elements but its storage has {t.storage.numel}; "
            f"re-save it with torch.save"
        )
    if numel * dtype.itemsize > _MAX_EXPANSION * max(storage_bytes, 1 << 20):
        raise VoiceError(
            f"{src} is malformed: a tensor of shape {list(shape)} with overlapping strides would "
            f"be larger than its {storage_bytes}-byte storage; re-save it with torch.save"
        )

    raw = read()
    stored = dtype.newbyteorder(">") if byteorder == "big" else dtype
    base = np.frombuffer(raw, dtype=stored, count=t.storage.numel)
    view = np.lib.stride_tricks.as_strided(
        base[offset:],
        shape=shape,
        strides=tuple(s * dtype.itemsize for s in strides),
        writeable=False,
    )
    # np.ascontiguousarray would turn a 0-d tensor into 1-d; np.array keeps the shape.
    return PtTensor(dtype_name, shape, np.array(view, dtype=dtype, order="C", copy=True))


# --------------------------------------------------------------------------- writing


class _PickleWriter:
    """Emits protocol-2 opcodes the way Python's pickler does, memo puts (BINPUT) included,
    so the result is byte-identical to what torch.save writes for the same tensor."""

    def __init__(self) -> None:
        self.out = bytearray(b"\x80\x02")  # PROTO 2
        self._memo = 0

    def _put(self) -> None:
        self.out += b"q" + bytes([self._memo])  # BINPUT (well under 256 entries here)
        self._memo += 1

    def op(self, raw: bytes) -> None:
        self.out += raw

    def global_(self, module: str, name: str) -> None:
        self.out += f"c{module}\n{name}\n".encode()  # GLOBAL
        self._put()

    def str_(self, text: str) -> None:
        raw = text.encode("utf-8")
        self.out += b"X" + struct.pack("<I", len(raw)) + raw  # BINUNICODE
        self._put()

    def int_(self, value: int) -> None:
        if 0 <= value < 256:
            self.out += b"K" + bytes([value])  # BININT1
        elif 0 <= value < 65536:
            self.out += b"M" + struct.pack("<H", value)  # BININT2
        elif -(2**31) <= value < 2**31:
            self.out += b"J" + struct.pack("<i", value)  # BININT
        else:
            raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
            self.out += b"\x8a" + bytes([len(raw)]) + raw  # LONG1

    def int_tuple(self, values: tuple[int, ...]) -> None:
        if not values:
            self.out += b")"  # EMPTY_TUPLE (never memoised)
            return
        if len(values) > 3:
            self.out += b"("  # MARK
        for v in values:
            self.int_(v)
        self.out += b"t" if len(values) > 3 else b"\x85\x86\x87"[len(values) - 1 :][:1]
        self._put()

    def end_tuple(self) -> None:
        self.out += b"t"  # TUPLE (from the last MARK)
        self._put()

    def reduce(self) -> None:
        self.out += b"R"  # REDUCE
        self._put()


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)  # torch's rule for empty dims
    return tuple(reversed(strides))


def _tensor_pickle(t: PtTensor) -> bytes:
    """The pickle torch.save writes for a bare, contiguous tensor held in storage "0"."""
    w = _PickleWriter()
    w.global_("torch._utils", "_rebuild_tensor_v2")
    w.op(b"(")  # MARK: the rebuild arguments
    w.op(b"(")  # MARK: the persistent id naming the storage record
    w.str_("storage")
    w.global_("torch", _STORAGE_NAMES[t.dtype])
    w.str_("0")
    w.str_("cpu")
    w.int_(math.prod(t.shape))
    w.end_tuple()
    w.op(b"Q")  # BINPERSID
    w.int_(0)  # storage offset
    w.int_tuple(t.shape)
    w.int_tuple(_contiguous_strides(t.shape))
    w.op(b"\x89")  # NEWFALSE: requires_grad
    w.global_("collections", "OrderedDict")  # backward_hooks = OrderedDict()
    w.op(b")")
    w.reduce()
    w.end_tuple()
    w.reduce()
    w.op(b".")  # STOP
    return bytes(w.out)


def _write_zip(f: BinaryIO, records: list[tuple[str, bytes | memoryview]]) -> None:
    """A stored (uncompressed) zip whose member data all start on 64-byte boundaries."""
    offset = 0
    central = []
    for name, data in records:
        name_raw = name.encode("utf-8")
        size = memoryview(data).nbytes
        crc = zlib.crc32(data)
        big = size >= _ZIP64_LIMIT
        local_extra = struct.pack("<HHQQ", 1, 16, size, size) if big else b""
        pad = -(offset + 30 + len(name_raw) + len(local_extra) + 4) % _ALIGNMENT
        local_extra += b"FB" + struct.pack("<H", pad) + b"Z" * pad  # torch's padding field
        size32 = 0xFFFFFFFF if big else size
        version = 45 if big else 20
        f.write(
            struct.pack(
                "<IHHHHHIIIHH",
                0x04034B50,
                version,
                0,
                0,
                0,
                0,
                crc,
                size32,
                size32,
                len(name_raw),
                len(local_extra),
            )
        )
        f.write(name_raw)
        f.write(local_extra)
        f.write(data)
        central.append((name_raw, crc, size, offset))
        offset += 30 + len(name_raw) + len(local_extra) + size

    cd_start = offset
    for name_raw, crc, size, header_offset in central:
        zip64 = b""
        if size >= _ZIP64_LIMIT:
            zip64 += struct.pack("<QQ", size, size)
        if header_offset >= _ZIP64_LIMIT:
            zip64 += struct.pack("<Q", header_offset)
        extra = struct.pack("<HH", 1, len(zip64)) + zip64 if zip64 else b""
        version = 45 if zip64 else 20
        size32 = size if size < _ZIP64_LIMIT else 0xFFFFFFFF
        offset32 = header_offset if header_offset < _ZIP64_LIMIT else 0xFFFFFFFF
        header = struct.pack(
            "<IHHHHHHIIIHHHHHII",
            0x02014B50,
            version,
            version,
            0,
            0,
            0,
            0,
            crc,
            size32,
            size32,
            len(name_raw),
            len(extra),
            0,
            0,
            0,
            0,
            offset32,
        )
        f.write(header + name_raw + extra)
        offset += len(header) + len(name_raw) + len(extra)
    cd_size = offset - cd_start

    count = len(central)
    if count >= 0xFFFF or cd_start >= _ZIP64_LIMIT or cd_size >= _ZIP64_LIMIT:
        f.write(
            struct.pack(
                "<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, count, count, cd_size, cd_start
            )
        )
        f.write(struct.pack("<IIQI", 0x07064B50, 0, offset, 1))
        count = min(count, 0xFFFF)
        cd_size = min(cd_size, 0xFFFFFFFF)
        cd_start = min(cd_start, 0xFFFFFFFF)
    f.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, count, count, cd_size, cd_start, 0))


def _archive_name(path: Path) -> str:
    stem = path.stem
    return stem if re.fullmatch(r"[A-Za-z0-9_.\-]{1,100}", stem) else "archive"


def write_pt(path: str | os.PathLike[str], tensor: PtTensor | np.ndarray) -> None:
    """Write ``tensor`` as ``torch.save`` would, so ``torch.load(path, weights_only=True)``
    returns the identical tensor (dtype, shape, bits). Atomic; needs no torch.

    A numpy array is stored with its own dtype; BF16 must come as a :class:`PtTensor`
    (numpy has no bfloat16). Raises :class:`VoiceError` on a bad tensor or a write failure.
    """
    path = Path(path)
    t = tensor if isinstance(tensor, PtTensor) else _from_numpy(np.asarray(tensor))
    archive = _archive_name(path)
    data_pkl = _tensor_pickle(t)
    storage = memoryview(t.data.reshape(-1).view(np.uint8))
    digest = hashlib.sha256(data_pkl + struct.pack("<I", zlib.crc32(storage))).digest()
    serialization_id = f"{int.from_bytes(digest[:16], 'little'):040d}"
    records: list[tuple[str, bytes | memoryview]] = [
        (f"{archive}/data.pkl", data_pkl),
        (f"{archive}/.format_version", b"1"),
        (f"{archive}/.storage_alignment", str(_ALIGNMENT).encode()),
        (f"{archive}/byteorder", b"little"),
        (f"{archive}/data/0", storage),
        (f"{archive}/version", b"3\n"),
        (f"{archive}/.data/serialization_id", serialization_id.encode()),
    ]
    try:
        atomic_write(path, lambda f: _write_zip(f, records))
    except OSError as e:
        raise VoiceError(
            f"cannot write {one_line(str(path))}: {one_line(e.strerror or str(e))}; "
            f"check that its directory exists and is writable"
        ) from e
