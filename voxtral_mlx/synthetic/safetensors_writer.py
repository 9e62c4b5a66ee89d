"""Write safetensors files tensor by tensor, so memory stays bounded for 8 GB checkpoints."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ITEM_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "I32": 4, "I64": 8, "U32": 4, "U8": 1}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = ITEM_BYTES[self.dtype]
        for d in self.shape:
            n *= d
        return n


def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bfloat16, returned as uint16 bit patterns."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def encode(values: np.ndarray, dtype: str) -> bytes:
    """float32/int values -> little-endian bytes of a safetensors dtype."""
    if dtype == "BF16":
        return float32_to_bf16_bits(values).tobytes()
    np_dtype = {"F16": "<f2", "F32": "<f4", "I32": "<i4", "I64": "<i8", "U32": "<u4", "U8": "u1"}
    return np.ascontiguousarray(values, dtype=np_dtype[dtype]).tobytes()


PT_METADATA = {"format": "pt"}  # what safetensors.torch.save_file writes when asked to


def write_safetensors(
    path: str | Path,
    specs: Iterable[TensorSpec],
    produce: Callable[[TensorSpec], Iterator[bytes]],
    metadata: dict[str, str] | None = PT_METADATA,
) -> None:
    """Write ``specs`` in order; ``produce(spec)`` yields the tensor's bytes in pieces.
    ``metadata``: the header's ``__metadata__`` (None: none, as Mistral's files have).

    Written to a temporary file beside ``path`` and renamed at the end, so an interrupted
    build never leaves a file that looks complete.
    """
    path = Path(path)
    specs = list(specs)
    header: dict[str, object] = {} if metadata is None else {"__metadata__": dict(metadata)}
    offset = 0
    for spec in specs:
        header[spec.name] = {
            "dtype": spec.dtype,
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path.with_name(f".{path.name}.partial")
    try:
        with open(tmp, "wb") as fh:
            fh.write(len(raw).to_bytes(8, "little"))
            fh.write(raw)
            for spec in specs:
                written = 0
                for piece in produce(spec):
                    fh.write(piece)
                    written += len(piece)
                if written != spec.nbytes:
                    raise ValueError(
                        f"{spec.name}: produced {written} bytes, expected {spec.nbytes}"
                    )
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
