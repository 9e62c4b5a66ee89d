"""Checkpoint tensors: expected names and shapes, lazy reading, verification, folding.

Nothing is materialised here beyond the headers: tensors come back as lazy MLX arrays
backed by the files (a float64 tensor, which MLX does not map, is read and narrowed); the
loader reads them once the model is built.
Every tensor is checked against the shapes ``params.json`` implies (packed shapes for
quantized layers) before any of it is used. The codec's weight norm and the semantic
codebook are folded once here (``sanitize``), never per call.
"""

from __future__ import annotations

import functools
import itertools
import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from .config import N_SPECIAL_AUDIO_CODES, ModelConfig, pad_to
from .errors import CheckpointError
from .fileio import one_line, unreadable_fix

# safetensors dtype name -> (bytes per element, MLX dtype)
SAFETENSORS_DTYPES: dict[str, tuple[int, mx.Dtype]] = {
    "BF16": (2, mx.bfloat16),
    "F16": (2, mx.float16),
    "F32": (4, mx.float32),
    "F64": (8, mx.float32),
    "I64": (8, mx.int64),
    "I32": (4, mx.int32),
    "U32": (4, mx.uint32),
    "I16": (2, mx.int16),
    "U16": (2, mx.uint16),
    "I8": (1, mx.int8),
    "U8": (1, mx.uint8),
    "BOOL": (1, mx.bool_),
}

# Valid safetensors dtypes that mx.load refuses ("[safetensor] unsupported dtype F64"):
# files holding one are read through numpy instead (see read_tensors_numpy).
UNLOADABLE_DTYPES = frozenset({"F64"})
_NUMPY_DTYPES = {
    "BF16": "<u2",
    "F16": "<f2",
    "F32": "<f4",
    "F64": "<f8",
    "I64": "<i8",
    "I32": "<i4",
    "U32": "<u4",
    "I16": "<i2",
    "U16": "<u2",
    "I8": "i1",
    "U8": "u1",
    "BOOL": "?",
}

CODEBOOK_EPS = 1e-5  # Mistral's value; mlx-audio uses 1e-8
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class Expected:
    """A tensor the config implies. ``min_rows`` marks a padded table (rows >= needed);
    ``dtype`` a required safetensors dtype (``U32`` for packed quantized weights)."""

    shape: tuple[int, ...]
    min_rows: int | None = None
    dtype: str | None = None

    def matches(self, shape: tuple[int, ...]) -> bool:
        if self.min_rows is None:
            return shape == self.shape
        return (
            len(shape) == len(self.shape)
            and shape[0] >= self.min_rows
            and (shape[1:] == self.shape[1:])
        )

    def describe(self) -> str:
        if self.min_rows is None:
            return str(list(self.shape))
        return f"[>={self.min_rows}, {', '.join(map(str, self.shape[1:]))}]"


@dataclass(frozen=True)
class QuantSpec:
    """Quantization of one Linear/Embedding layer, as ``mx.quantize`` makes it: ``affine``
    (float scales and biases), or a microscaling float format (``mxfp4``, ``mxfp8``,
    ``nvfp4``: 8-bit scales, no biases) as ``mlx_audio.convert --q-mode`` writes it."""

    bits: int
    group_size: int
    mode: str = "affine"

    def as_dict(self) -> dict[str, int | str]:
        """Keyword arguments of ``to_quantized`` (and mlx-lm's per-layer config entry)."""
        return {"group_size": self.group_size, "bits": self.bits, "mode": self.mode}


_AFFINE_BITS_CANDIDATES = range(1, 9)


@functools.cache
def affine_bits() -> tuple[int, ...]:
    """The bit widths this MLX quantizes and multiplies in affine mode (2-6 and 8 for
    years; 1 since 0.30 or so): asked of MLX itself, on its default device, once."""
    found = []
    for bits in _AFFINE_BITS_CANDIDATES:
        try:
            w, scales, biases = mx.quantize(mx.ones((8, 32)), group_size=32, bits=bits)
            y = mx.quantized_matmul(
                mx.ones((1, 32)), w, scales, biases, transpose=True, group_size=32, bits=bits
            )
            mx.eval(y)
        except (ValueError, RuntimeError):
            continue
        found.append(bits)
    return tuple(found)


QUANT_GROUP_SIZES = (32, 64, 128)
# mx.quantize's float modes: mode -> (bits, group size), both fixed by the format.
FLOAT_QUANT_MODES = {"mxfp4": (4, 32), "mxfp8": (8, 32), "nvfp4": (4, 16)}


def quantized_shapes(
    shape: tuple[int, ...], spec: QuantSpec
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Packed weight shape and scales/biases shape of a ``[rows, in]`` weight, or None when
    ``in`` cannot be quantized with ``spec`` (not a multiple of the group size)."""
    if len(shape) != 2 or shape[1] % spec.group_size or (shape[1] * spec.bits) % 32:
        return None
    rows, width = shape
    return (rows, width * spec.bits // 32), (rows, width // spec.group_size)


def apply_quantization(
    expected: Mapping[str, Expected], quantized: Mapping[str, QuantSpec]
) -> dict[str, Expected]:
    """``expected`` with every layer of ``quantized`` (module path -> spec) in packed form:
    ``<path>.weight`` ``[rows, in * bits / 32]`` uint32 plus ``<path>.scales`` and
    ``<path>.biases`` ``[rows, in / group_size]``. Paths without a 2-D weight are left out
    (their tensors then show up as unexpected)."""
    out = dict(expected)
    for path, spec in quantized.items():
        base = out.get(f"{path}.weight")
        if base is None or len(base.shape) != 2:
            continue
        shapes = quantized_shapes(base.shape, spec)
        if shapes is None:
            raise CheckpointError(
                f"layer '{one_line(path, 80)}' is marked quantized with group size "
                f"{spec.group_size} and {spec.bits} bits, but its input width {base.shape[1]} "
                "is not a multiple of the group size: re-convert the model"
            )
        packed, groups = shapes
        out[f"{path}.weight"] = Expected(packed, base.min_rows, dtype="U32")
        if spec.mode == "affine":
            out[f"{path}.scales"] = Expected(groups, base.min_rows)
            out[f"{path}.biases"] = Expected(groups, base.min_rows)
        else:
            out[f"{path}.scales"] = Expected(groups, base.min_rows, dtype="U8")
    return out


def _transformer_layer(
    prefix: str, dim: int, n_heads: int, n_kv: int, head_dim: int, hidden: int
) -> dict[str, Expected]:
    q, kv = n_heads * head_dim, n_kv * head_dim
    return {
        f"{prefix}.attention.wq.weight": Expected((q, dim)),
        f"{prefix}.attention.wk.weight": Expected((kv, dim)),
        f"{prefix}.attention.wv.weight": Expected((kv, dim)),
        f"{prefix}.attention.wo.weight": Expected((dim, q)),
        f"{prefix}.attention_norm.weight": Expected((dim,)),
        f"{prefix}.ffn_norm.weight": Expected((dim,)),
        f"{prefix}.feed_forward.w1.weight": Expected((hidden, dim)),
        f"{prefix}.feed_forward.w2.weight": Expected((dim, hidden)),
        f"{prefix}.feed_forward.w3.weight": Expected((hidden, dim)),
    }


def conv_is_transposed(config: ModelConfig, stage: int) -> bool:
    """The first stage opens with a causal Conv1d, every later one with a ConvTranspose1d
    (whatever its stride: so Mistral's codec builds them)."""
    return stage > 0


def expected_tensors(
    config: ModelConfig, quantized: Mapping[str, QuantSpec] | None = None
) -> dict[str, Expected]:
    """Every tensor of Mistral's checkpoint with the shape ``config`` implies.

    ``quantized``: module path (Mistral names) -> :class:`QuantSpec` of the layers stored
    quantized; their weights are expected packed, with scales and biases beside them.
    """
    b, f, c = config.backbone, config.flow, config.codec
    out: dict[str, Expected] = {
        "mm_audio_embeddings.tok_embeddings.weight": Expected((b.vocab_size, b.dim)),
        "mm_audio_embeddings.audio_codebook_embeddings.embeddings.weight": Expected(
            (pad_to(config.audio_embedding_rows, 128), b.dim), min_rows=config.audio_embedding_rows
        ),
        "norm.weight": Expected((b.dim,)),
    }
    for i in range(b.n_layers):
        out.update(
            _transformer_layer(
                f"layers.{i}", b.dim, b.n_heads, b.n_kv_heads, b.head_dim, b.hidden_dim
            )
        )

    at = "acoustic_transformer"
    sem_rows = f.semantic_codebook_size + N_SPECIAL_AUDIO_CODES
    out.update(
        {
            f"{at}.input_projection.weight": Expected((f.dim, f.n_acoustic_codebook)),
            f"{at}.llm_projection.weight": Expected((f.dim, f.input_dim)),
            f"{at}.time_projection.weight": Expected((f.dim, f.dim)),
            f"{at}.norm.weight": Expected((f.dim,)),
            f"{at}.semantic_codebook_output.weight": Expected(
                (f.semantic_output_rows, f.dim), min_rows=sem_rows
            ),
            f"{at}.acoustic_codebook_output.weight": Expected((f.n_acoustic_codebook, f.dim)),
        }
    )
    for i in range(f.n_layers):
        out.update(
            _transformer_layer(
                f"{at}.layers.{i}", f.dim, f.n_heads, f.n_kv_heads, f.head_dim, f.hidden_dim
            )
        )

    tok = "audio_tokenizer"
    for s in range(c.n_stages):
        in_ch = c.codebook_dim if s == 0 else c.dim
        k = c.conv_kernels[s]
        # PyTorch layouts: Conv1d [out, in, k]; ConvTranspose1d [in, out, k]. Weight norm
        # (dim=0) keeps one gain per row of axis 0.
        v = (in_ch, c.dim, k) if conv_is_transposed(config, s) else (c.dim, in_ch, k)
        conv = f"{tok}.decoder_blocks.{2 * s}.conv.parametrizations.weight"
        out[f"{conv}.original0"] = Expected((v[0], 1, 1))
        out[f"{conv}.original1"] = Expected(v)
        for j in range(c.transformer_lengths[s]):
            layer = f"{tok}.decoder_blocks.{2 * s + 1}.layers.{j}"
            out.update(
                _transformer_layer(layer, c.dim, c.n_heads, c.n_kv_heads, c.head_dim, c.hidden_dim)
            )
            out[f"{layer}.attention.q_norm.weight"] = Expected((c.n_heads * c.head_dim,))
            out[f"{layer}.attention.k_norm.weight"] = Expected((c.n_kv_heads * c.head_dim,))
            out[f"{layer}.attention_scale"] = Expected((c.dim,))
            out[f"{layer}.ffn_scale"] = Expected((c.dim,))
    conv = f"{tok}.output_proj.conv.parametrizations.weight"
    out[f"{conv}.original0"] = Expected((c.patch_size, 1, 1))
    out[f"{conv}.original1"] = Expected((c.patch_size, c.dim, c.patch_proj_kernel_size))
    out[f"{tok}.quantizer.semantic_codebook.cluster_usage"] = Expected((c.semantic_codebook_size,))
    out[f"{tok}.quantizer.semantic_codebook.embedding_sum"] = Expected(
        (c.semantic_codebook_size, c.semantic_dim)
    )
    return apply_quantization(out, quantized) if quantized else out


# Present in some exports, never used for speech: the text LM head (tied in the release;
# an untied one is ``output.weight``, which mlx-audio calls ``lm_head`` and may quantize).
IGNORED_TENSORS = frozenset({"output.weight", "output.scales", "output.biases"})


def _header_ints(values: object) -> tuple[int, ...]:
    """A shape or offset list of a safetensors header: JSON integers of at most 64 bits.

    Python's JSON reader also returns floats (``2.5``, ``1e400``, ``Infinity``) and
    arbitrarily large integers; none of them describes a tensor.
    """
    if not isinstance(values, list):
        raise TypeError("not a list")
    if not all(type(v) is int and abs(v) < 2**63 for v in values):
        raise ValueError("not a list of 64-bit integers")
    return tuple(values)


def read_safetensors_header(path: str | Path) -> dict[str, TensorInfo]:
    """Parse and sanity-check a safetensors header without reading any tensor data."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise CheckpointError(
                    f"{path} is truncated or not a safetensors file (only {size} bytes): "
                    "re-download it"
                )
            (n,) = struct.unpack("<Q", head)
            if n == 0 or n > MAX_HEADER_BYTES or 8 + n > size:
                raise CheckpointError(
                    f"{path} is truncated or not a safetensors file (header of {n} bytes, file of "
                    f"{size} bytes): re-download it"
                )
            raw = fh.read(n)
    except FileNotFoundError:
        raise CheckpointError(f"{path} not found: the model directory is incomplete") from None
    except IsADirectoryError:
        raise CheckpointError(f"{path} is a directory, expected a safetensors file") from None
    except OSError as e:
        fix = unreadable_fix(e, "re-download it")
        raise CheckpointError(f"cannot read {path}: {e.strerror}; {fix}") from None
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):  # incl. JSONDecodeError
        raise CheckpointError(
            f"{path} has a corrupt safetensors header: re-download or re-convert it"
        ) from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} has a corrupt safetensors header: re-download it")
    data_size = size - 8 - n
    infos: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            # mx.load takes null or a string -> string map; it refuses anything else with a
            # cryptic message. (mx.save_safetensors itself writes null.)
            valid = entry is None or (
                isinstance(entry, dict) and all(isinstance(v, str) for v in entry.values())
            )
            if not valid:
                raise CheckpointError(
                    f"{path} has a corrupt safetensors header (__metadata__ must map strings "
                    "to strings): re-download or re-convert it"
                )
            continue
        try:
            dtype = entry["dtype"]
            shape = _header_ints(entry["shape"])
            start, end = _header_ints(entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(
                f"{path}: malformed header entry for tensor '{one_line(name, 80)}' (its dtype, "
                "shape or offsets); the file is damaged: re-download or re-convert it"
            ) from None
        if not isinstance(dtype, str) or dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(
                f"{path}: tensor '{one_line(name, 80)}' has unsupported dtype "
                f"{one_line(str(dtype), 40)}; re-save the checkpoint in BF16, F16 or F32"
            )
        nbytes = SAFETENSORS_DTYPES[dtype][0]
        for d in shape:
            nbytes *= d
        if start < 0 or end - start != nbytes or any(d < 0 for d in shape):
            raise CheckpointError(
                f"{path}: tensor '{one_line(name, 80)}' has offsets inconsistent with its "
                f"shape {list(shape)}; the file is damaged: re-download or re-convert it"
            )
        if end > data_size:
            raise CheckpointError(
                f"{path} is truncated: tensor '{one_line(name, 80)}' ends at byte {8 + n + end} "
                f"but the file has {size} bytes; re-download it"
            )
        infos[name] = TensorInfo(dtype, shape, start, end)
    # Tensors may not share bytes (the safetensors format forbids it; MLX would not notice).
    spans = sorted((i.start, i.end, k) for k, i in infos.items() if i.end > i.start)
    for (_, end_a, a), (start_b, _, b) in itertools.pairwise(spans):
        if start_b < end_a:
            raise CheckpointError(
                f"{path} is corrupt: tensors '{one_line(a, 80)}' and '{one_line(b, 80)}' "
                "overlap; re-download or re-convert it"
            )
    return infos


class CheckpointMismatch(CheckpointError):
    """Tensors missing, unexpected or mis-shaped with respect to the config."""

    def __init__(
        self,
        source: str,
        missing: list[str],
        unexpected: list[str],
        misshaped: list[tuple[str, tuple[int, ...], str]],
        mistyped: list[tuple[str, str, str]] | None = None,
        against: str = "params.json",
    ):
        self.missing, self.unexpected, self.misshaped = missing, unexpected, misshaped
        self.mistyped = mistyped or []
        self.source, self.against = source, against
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing ({some_names(missing)})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected ({some_names(unexpected)})")
        if misshaped:
            shown = ", ".join(
                f"{one_line(n, 80)} {list(s)} expected {e}" for n, s, e in misshaped[:4]
            )
            more = f", ... {len(misshaped) - 4} more" if len(misshaped) > 4 else ""
            parts.append(f"{len(misshaped)} mis-shaped ({shown}{more})")
        if self.mistyped:
            shown = ", ".join(
                f"{one_line(n, 80)} {d} expected {e}" for n, d, e in self.mistyped[:4]
            )
            more = f", ... {len(self.mistyped) - 4} more" if len(self.mistyped) > 4 else ""
            parts.append(f"{len(self.mistyped)} of the wrong dtype ({shown}{more})")
        if self.mistyped and not (missing or unexpected or misshaped):
            # No config fixes a dtype: the file was written wrongly.
            advice = (
                "The weights were written in other dtypes than a checkpoint holds (packed "
                "quantized weights are uint32, every other tensor a float): fetch them again, "
                "or convert them again if they are a conversion"
            )
        else:
            advice = f"Check that {against} and the weights come from the same model"
        super().__init__(f"{source} does not match {against}: " + "; ".join(parts) + f". {advice}.")


def some_names(names: list[str], limit: int = 4) -> str:
    """The first ``limit`` names, then how many more."""
    shown = ", ".join(one_line(n, 80) for n in names[:limit])
    return shown + (f", ... {len(names) - limit} more" if len(names) > limit else "")


FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")


def verify_tensors(
    shapes: Mapping[str, tuple[int, ...]],
    expected: Mapping[str, Expected],
    source: str,
    dtypes: Mapping[str, str] | None = None,
    against: str = "params.json",
) -> None:
    """Raise :class:`CheckpointMismatch` listing every discrepancy.

    With ``dtypes`` (name -> safetensors dtype) the dtypes are checked too: packed quantized
    weights must be ``U32``, every other expected tensor a float. ``against`` names what
    ``expected`` was derived from, for the message.
    """
    missing = sorted(n for n in expected if n not in shapes)
    unexpected = sorted(n for n in shapes if n not in expected and n not in IGNORED_TENSORS)
    misshaped = [
        (n, tuple(shapes[n]), expected[n].describe())
        for n in sorted(expected)
        if n in shapes and not expected[n].matches(tuple(shapes[n]))
    ]
    mistyped = []
    for n in sorted(expected):
        if dtypes is None or n not in dtypes:
            continue
        want = expected[n].dtype
        if want is not None and dtypes[n] != want:
            mistyped.append((n, dtypes[n], want))
        elif want is None and dtypes[n] not in FLOAT_DTYPES:
            mistyped.append((n, dtypes[n], "a float"))
    if missing or unexpected or misshaped or mistyped:
        raise CheckpointMismatch(source, missing, unexpected, misshaped, mistyped, against)


def load_tensors(
    path: str | Path, infos: Mapping[str, TensorInfo] | None = None
) -> dict[str, mx.array]:
    """The tensors of ``path`` named in ``infos`` (its header entries, default all of them):
    memory-mapped by MLX and read when evaluated, or, for a file holding a dtype ``mx.load``
    refuses (F64), read now through numpy (F64 as float32). Raises :class:`CheckpointError`."""
    path = Path(path)
    if infos is None:
        infos = read_safetensors_header(path)
    if any(info.dtype in UNLOADABLE_DTYPES for info in infos.values()):
        return read_tensors_numpy(path, infos)
    try:
        arrays = mx.load(str(path))
    except Exception as e:  # MLX raises RuntimeError/ValueError with long messages
        raise CheckpointError(f"cannot read {path}: {str(e).splitlines()[0]}") from None
    return {name: array for name, array in arrays.items() if name in infos}


def read_tensors_numpy(path: str | Path, infos: Mapping[str, TensorInfo]) -> dict[str, mx.array]:
    """Read ``infos`` (name -> header entry) of ``path`` eagerly through numpy, for files that
    ``mx.load`` refuses; F64 becomes float32 (MLX computes in 16 or 32 bits anyway)."""
    path = Path(path)
    out: dict[str, mx.array] = {}
    try:
        data_start = safetensors_data_start(path)
        with open(path, "rb") as fh:
            for name, info in infos.items():
                fh.seek(data_start + info.start)
                raw = fh.read(info.end - info.start)
                if len(raw) != info.end - info.start:
                    raise CheckpointError(f"{path} is truncated: re-download it")
                values = np.frombuffer(raw, dtype=_NUMPY_DTYPES[info.dtype]).reshape(info.shape)
                if info.dtype == "F64":
                    values = values.astype(np.float32)
                array = mx.array(values)
                out[name] = array.view(mx.bfloat16) if info.dtype == "BF16" else array
    except OSError as e:
        fix = unreadable_fix(e, "re-download it")
        raise CheckpointError(f"cannot read {path}: {e.strerror}; {fix}") from None
    return out


def checkpoint_dtype(infos: Mapping[str, TensorInfo]) -> mx.Dtype:
    """The floating dtype most of the weights are stored in (bf16 for the real checkpoint)."""
    counts: dict[str, int] = {}
    for info in infos.values():
        if info.dtype in ("BF16", "F16", "F32"):
            counts[info.dtype] = counts.get(info.dtype, 0) + info.end - info.start
    if not counts:
        return mx.float32
    return SAFETENSORS_DTYPES[max(counts, key=counts.__getitem__)][1]


def fold_weight_norm(g: mx.array, v: mx.array) -> mx.array:
    """``g * v / ||v||`` with the norm over every axis but 0 (PyTorch weight_norm, dim=0)."""
    v32 = v.astype(mx.float32)
    norm = mx.sqrt(mx.sum(v32 * v32, axis=tuple(range(1, v.ndim)), keepdims=True))
    return g.astype(mx.float32) * v32 / norm


def fold_codebook(embedding_sum: mx.array, cluster_usage: mx.array) -> mx.array:
    usage = mx.maximum(cluster_usage.astype(mx.float32), CODEBOOK_EPS)
    return embedding_sum.astype(mx.float32) / usage[:, None]


def sanitize(
    weights: Mapping[str, mx.array], config: ModelConfig, dtype: mx.Dtype
) -> dict[str, mx.array]:
    """Mistral checkpoint names -> module parameters (pure; lazy arrays stay lazy).

    Folds the codec's weight norm into MLX-layout conv weights ([out, k, in] for both
    conv1d and conv_transpose1d) and the EMA semantic codebook into a plain table.
    Everything else keeps its checkpoint name; float tensors are cast to ``dtype``, packed
    quantized weights are left as they are.
    """
    out: dict[str, mx.array] = {}
    tok = "audio_tokenizer"
    convs = {f"{tok}.decoder_blocks.{2 * s}.conv": s for s in range(config.codec.n_stages)}
    convs[f"{tok}.output_proj.conv"] = None
    for prefix, stage in convs.items():
        g = weights[f"{prefix}.parametrizations.weight.original0"]
        v = weights[f"{prefix}.parametrizations.weight.original1"]
        w = fold_weight_norm(g, v)
        if stage is not None and conv_is_transposed(config, stage):
            w = w.transpose(1, 2, 0)  # [in, out, k] -> [out, k, in]
        else:
            w = w.transpose(0, 2, 1)  # [out, in, k] -> [out, k, in]
        out[f"{prefix}.weight"] = w.astype(dtype)
    sem = f"{tok}.quantizer.semantic_codebook"
    out[f"{tok}.semantic_codebook"] = fold_codebook(
        weights[f"{sem}.embedding_sum"], weights[f"{sem}.cluster_usage"]
    ).astype(dtype)

    for name, value in weights.items():
        if name in IGNORED_TENSORS or ".parametrizations." in name or name.startswith(sem):
            continue
        # Packed quantized weights (uint32) keep their bits; scales and biases are cast.
        cast = mx.issubdtype(value.dtype, mx.floating) and value.dtype != dtype
        out[name] = value.astype(dtype) if cast else value
    return out


def safetensors_data_start(path: str | Path) -> int:
    """Byte offset of the data section (``TensorInfo`` offsets are relative to it)."""
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
    return 8 + n
