"""Convert a checkpoint into a self-contained MLX directory, optionally quantized.

Output (``voxtral-mlx`` layout, see :mod:`voxtral_mlx.mlx_layout`)::

    config.json                      how it was converted, incl. the quantization section
    params.json, tekken.json         copied unchanged
    model.safetensors                or model-0000N-of-0000M.safetensors above 5 GiB
    model.safetensors.index.json     tensor -> file (always written)
    voice_embedding/<name>.safetensors   one tensor, key ``embedding``

The directory is also an mlx-community-style one that mlx-audio loads: tensor names follow
mlx-audio's module tree (:func:`~voxtral_mlx.mlx_layout.to_mlx_audio_name`), and
``config.json`` holds params.json's keys, how it was converted (``format``, ``source``, ...)
and mlx-lm's quantization section (``group_size``, ``bits``, ``mode`` and an entry per
quantized layer, keyed by its mlx-audio module path). The codec keeps its weight-norm
parametrization (``original0``/``original1``) and the EMA codebook
(``cluster_usage``/``embedding_sum``) as Mistral stores them: they are folded at load in
float32, so an unquantized conversion loads bit-identically to its source. Precision per
component:

* backbone Linear layers (``layers.*``): ``q_bits``;
* flow head Linear layers (``acoustic_transformer.*`` incl. the semantic and acoustic
  outputs): ``q_flow_bits``, by default ``max(8, q_bits)`` (4-bit flow heads are reported
  to miss END; SPEC §8). ``time_projection`` runs 7 rows once at load and stays
  unquantized, as does ``input_projection``, whose 36 inputs fit no group size;
* codec (``audio_tokenizer.*``), embeddings (``mm_audio_embeddings.*``) and every norm:
  ``dtype`` (bfloat16 by default), never quantized;
* a Linear whose input width is not a multiple of the group size stays unquantized.

Quantization is ``mx.quantize``'s affine mode, group size 64 by default, computed row block by
row block (identical to quantizing the whole matrix: groups never cross rows).

Conversion streams: tensors are read with ``pread`` in blocks of at most ``chunk_bytes`` and
written straight out, so memory stays bounded whatever the checkpoint size. Everything is
written into a hidden temporary directory beside ``out_dir``, verified, and renamed into
place at the end: a failed or interrupted conversion leaves nothing that would load.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from .checkpoint import (
    IGNORED_TENSORS,
    SAFETENSORS_DTYPES,
    QuantSpec,
    expected_tensors,
    quantized_shapes,
    read_safetensors_header,
    safetensors_data_start,
)
from .engine import check_flag, check_whole
from .errors import CheckpointError, InputError, VoiceError
from .fileio import atomic_write_text, one_line
from .hub import cached_repo, resolve_model_dir
from .loader import (
    TensorRef,
    WeightSet,
    check_tokenizer,
    open_weights,
    parse_dtype,
    read_model_config,
)
from .mlx_layout import (
    FORMAT,
    FORMAT_VERSION,
    INDEX_NAME,
    SHARD_NAME,
    SINGLE_NAME,
    to_mlx_audio_name,
)
from .output_dir import check_output_dir, directory_path, resolve_output, staged_dir
from .synthetic.safetensors_writer import TensorSpec, write_safetensors
from .tokenizer import TekkenTokenizer
from .voices import EMBEDDING_KEY, VoiceRegistry, convert_voice_files, folded_name, unreadable

SUPPORTED_BITS = (4, 6, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 64
MIN_FLOW_BITS = 8
MAX_SHARD_BYTES = 5 << 30  # mlx-lm's limit per file
CHUNK_BYTES = 16 << 20
OUTPUT_DTYPES: dict[str, tuple[str, mx.Dtype]] = {
    "bfloat16": ("BF16", mx.bfloat16),
    "float16": ("F16", mx.float16),
    "float32": ("F32", mx.float32),
}
_NP_DTYPES = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32, "F64": np.float64}
# time_projection runs once at load (7 rows): quantizing it would only add error.
# input_projection's 36 inputs (the acoustic codebooks) fit no group size.
UNQUANTIZED_LINEARS = frozenset(
    {"acoustic_transformer.time_projection", "acoustic_transformer.input_projection"}
)

Progress = Callable[[str, int, int], None]  # (tensor name, bytes done, bytes total)


@dataclass(frozen=True)
class QuantOptions:
    """What to quantize: backbone Linears at ``bits``, flow head Linears at ``flow_bits``."""

    bits: int | None = None
    flow_bits: int | None = None
    group_size: int = DEFAULT_GROUP_SIZE

    @classmethod
    def make(
        cls, bits: int | None, group_size: int | None = None, flow_bits: int | None = None
    ) -> QuantOptions:
        """Checked options; ``flow_bits`` defaults to ``max(8, bits)``."""
        bits, group_size, flow_bits = (_whole_or_none(v) for v in (bits, group_size, flow_bits))
        if bits is None:
            for flag, value in (("--q-flow-bits", flow_bits), ("--q-group-size", group_size)):
                if value is not None:  # named as the command line and convert_model() do
                    raise InputError(
                        f"{flag} ({flag[2:].replace('-', '_')}=) needs --q-bits (q_bits=): "
                        "pass both, or neither"
                    )
            return cls(None, None, DEFAULT_GROUP_SIZE)
        group_size = DEFAULT_GROUP_SIZE if group_size is None else group_size
        for flag, value in (("--q-bits", bits), ("--q-flow-bits", flow_bits)):
            if value is not None and not _one_of(value, SUPPORTED_BITS):
                raise InputError(
                    f"{flag} ({flag[2:].replace('-', '_')}=) {value!r} is not supported: use "
                    f"{', '.join(map(str, SUPPORTED_BITS[:-1]))} or {SUPPORTED_BITS[-1]}"
                )
        if not _one_of(group_size, SUPPORTED_GROUP_SIZES):
            raise InputError(
                f"--q-group-size (q_group_size=) {group_size!r} is not supported: use 32, 64 or 128"
            )
        flow = max(MIN_FLOW_BITS, bits) if flow_bits is None else flow_bits
        return cls(bits, flow, group_size)

    def wanted(self, path: str) -> QuantSpec | None:
        """How the layer ``path`` is to be quantized if its shape allows; None = never."""
        bits = None
        if path.startswith("layers."):
            bits = self.bits
        elif path.startswith("acoustic_transformer.") and path not in UNQUANTIZED_LINEARS:
            bits = self.flow_bits
        return None if bits is None else QuantSpec(bits=bits, group_size=self.group_size)

    def spec(self, path: str, shape: tuple[int, ...]) -> QuantSpec | None:
        """How the layer ``path`` (weight ``shape``) is stored; None = unquantized."""
        spec = self.wanted(path)
        return spec if spec is not None and quantized_shapes(shape, spec) is not None else None


def _one_of(value: object, allowed: tuple[int, ...]) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value in allowed


def _whole_or_none(value: object) -> object:
    """A numpy integer as a Python int (JSON and MLX take only those); anything else as it
    is, for the checks to name."""
    return int(value) if isinstance(value, np.integer) else value


def component(name: str) -> str:
    """The component a tensor belongs to: backbone, flow_head, codec or embeddings."""
    if name.startswith("acoustic_transformer."):
        return "flow_head"
    if name.startswith("audio_tokenizer."):
        return "codec"
    if name.startswith("mm_audio_embeddings."):
        return "embeddings"
    return "backbone"


@dataclass
class _Job:
    """One source tensor and what becomes of it."""

    name: str
    ref: TensorRef
    data_start: int
    spec: QuantSpec | None
    outputs: list[TensorSpec] = field(default_factory=list)

    @property
    def shown(self) -> str:
        """Its name in its file, for a message (header text: made printable)."""
        return one_line(self.ref.key, 80)


@dataclass(frozen=True)
class ConvertResult:
    path: Path
    files: list[Path]
    quantized: dict[str, QuantSpec]
    total_bytes: int
    voices: list[str]  # the voices written to voice_embedding/ (none if the source had none)
    # Layers the options quantize whose input width is not a multiple of the group size
    # (none at the release's widths): written unquantized.
    unfit: list[str] = field(default_factory=list)
    # Voices tekken.json lists that the source had no file for, beside others it had (an
    # incomplete download): the output has none of them either.
    missing_voices: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- checks


def _identities(path: Path) -> set[tuple[int, int]]:
    """(device, inode) of ``path`` and of each of its parents that exists."""
    found = set()
    for p in (path, *path.parents):
        with contextlib.suppress(OSError):
            st = p.stat()
            found.add((st.st_dev, st.st_ino))
    return found


def _overlaps(a: Path, b: Path) -> bool:
    """Whether directory ``a`` is ``b``, inside it, or holds it: compared as directories on
    disk, not as names (on a Mac's case-insensitive disk ``~/Models/Voxtral`` and
    ``~/models/voxtral`` are one folder; so are two paths through a mount)."""
    if a == b or b in a.parents or a in b.parents:
        return True
    try:
        sb = b.stat()
    except OSError:
        return False
    if (sb.st_dev, sb.st_ino) in _identities(a):
        return True
    try:
        sa = a.stat()
    except OSError:  # not there yet: it cannot hold b
        return False
    return (sa.st_dev, sa.st_ino) in _identities(b)


def _check_output(out: Path, src: Path, force: bool) -> Path:
    real = resolve_output(out)
    if _overlaps(real, src):
        raise InputError(
            f"output {one_line(str(out))} overlaps the source model {one_line(str(src))}: "
            "choose another output directory"
        )
    return check_output_dir(out, force)


def output_dtype(dtype: str) -> str:
    """The name in :data:`OUTPUT_DTYPES` of ``dtype`` (aliases such as ``bf16`` included)."""
    try:
        parsed = parse_dtype(dtype)
    except InputError:
        parsed = None
    if parsed is not None:
        for name, (_, mx_dtype) in OUTPUT_DTYPES.items():
            if parsed == mx_dtype:
                return name
    raise InputError(
        f"--dtype (dtype=) {one_line(repr(dtype), 60)} is not supported: use bfloat16, float16 "
        "or float32"
    )


# --------------------------------------------------------------------------- planning


def _plan(weights: WeightSet, options: QuantOptions, dtype: str) -> list[_Job]:
    st_dtype = OUTPUT_DTYPES[dtype][0]
    starts: dict[Path, int] = {}
    jobs = []
    for name, ref in sorted(
        weights.tensors.items(), key=lambda kv: (str(kv[1].path), kv[1].info.start)
    ):
        if name in IGNORED_TENSORS:
            continue
        if ref.path not in starts:
            starts[ref.path] = safetensors_data_start(ref.path)
        shape = ref.info.shape
        spec = options.spec(name[: -len(".weight")], shape) if name.endswith(".weight") else None
        job = _Job(name, ref, starts[ref.path], spec)
        out_name = _output_name(name)
        if spec is None:
            job.outputs = [TensorSpec(out_name, st_dtype, shape)]
        else:
            packed, groups = quantized_shapes(shape, spec)  # type: ignore[misc]
            path = out_name[: -len(".weight")]
            job.outputs = [
                TensorSpec(out_name, "U32", packed),
                TensorSpec(f"{path}.scales", st_dtype, groups),
                TensorSpec(f"{path}.biases", st_dtype, groups),
            ]
        jobs.append(job)
    return jobs


def _output_name(name: str) -> str:
    renamed = to_mlx_audio_name(name)
    if renamed is None:  # pragma: no cover - every verified tensor has a rule
        raise InputError(f"no mlx-audio name for tensor '{name}'; please report this")
    return renamed


def _check_backbone_quantized(jobs: list[_Job], options: QuantOptions) -> None:
    """``--q-bits`` that quantizes none of the backbone (no Linear input width is a multiple
    of the group size) is refused rather than written as an unquantized copy."""
    if options.bits is None or any(j.spec and j.name.startswith("layers.") for j in jobs):
        return
    widths = sorted(
        {
            j.ref.info.shape[1]
            for j in jobs
            if j.name.startswith("layers.") and len(j.ref.info.shape) == 2
        }
    )
    fits = [
        g
        for g in SUPPORTED_GROUP_SIZES
        if any(quantized_shapes((1, w), QuantSpec(options.bits, g)) for w in widths)
    ]
    fix = f"use --q-group-size {fits[-1]}" if fits else "convert without --q-bits"
    raise InputError(
        f"--q-bits {options.bits} with group size {options.group_size} quantizes no backbone "
        f"layer: their input widths ({', '.join(map(str, widths))}) are not multiples of "
        f"{options.group_size}; {fix}"
    )


def _shards(jobs: list[_Job], max_bytes: int) -> list[list[_Job]]:
    shards: list[list[_Job]] = [[]]
    size = 0
    for job in jobs:
        nbytes = sum(o.nbytes for o in job.outputs)
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(job)
        size += nbytes
    return shards


# --------------------------------------------------------------------------- tensor data


def _to_bytes(a: mx.array) -> bytes:
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.asarray(a).tobytes()


def _blocks(job: _Job, chunk_bytes: int, fd: int) -> Iterator[mx.array]:
    """The source tensor in row blocks of at most ``chunk_bytes`` (at least one row)."""
    info = job.ref.info
    item = SAFETENSORS_DTYPES[info.dtype][0]
    shape = info.shape if info.shape else (1,)
    row_items = int(np.prod(shape[1:], dtype=np.int64))
    row_bytes = max(1, row_items * item)
    step = max(1, chunk_bytes // row_bytes)
    for r0 in range(0, shape[0], step):
        r1 = min(shape[0], r0 + step)
        offset = job.data_start + info.start + r0 * row_bytes
        raw = os.pread(fd, (r1 - r0) * row_bytes, offset)
        if len(raw) != (r1 - r0) * row_bytes:
            raise CheckpointError(
                f"{job.ref.path} is truncated at tensor '{job.shown}': re-download it"
            )
        values = np.frombuffer(raw, dtype=_NP_DTYPES[info.dtype]).reshape((r1 - r0, *shape[1:]))
        block = mx.array(values.astype(np.float32) if info.dtype == "F64" else values)
        yield block.view(mx.bfloat16) if info.dtype == "BF16" else block


def _produce(
    job: _Job,
    dtype: mx.Dtype,
    st_dtype: str,
    chunk_bytes: int,
    stash: dict[str, list[bytes]],
) -> Iterator[bytes]:
    """Bytes of ``job``'s first output; the scales and biases of a quantized layer are kept
    in ``stash`` for the two outputs that follow (they are ~3 % of the weight)."""
    info = job.ref.info
    if job.spec is None and info.dtype == st_dtype:
        yield from _raw_copy(job, chunk_bytes)
        return
    fd = os.open(job.ref.path, os.O_RDONLY)
    try:
        for source in _blocks(job, chunk_bytes, fd):
            _check_finite(job, source)
            block = source.astype(dtype)
            if dtype == mx.float16 and source.dtype != mx.float16:
                _check_float16_range(job, source, block)
            if job.spec is None:
                mx.eval(block)
                yield _to_bytes(block)
                continue
            wq, scales, biases = mx.quantize(
                block, group_size=job.spec.group_size, bits=job.spec.bits, mode="affine"
            )
            mx.eval(wq, scales, biases)
            stash.setdefault(job.outputs[1].name, []).append(_to_bytes(scales))
            stash.setdefault(job.outputs[2].name, []).append(_to_bytes(biases))
            yield _to_bytes(wq)
            del wq, scales, biases
            mx.clear_cache()
    finally:
        os.close(fd)
        mx.clear_cache()


def _check_finite(job: _Job, source: mx.array) -> None:
    """NaN or infinity in the source is damage: quantizing would hide it (a NaN becomes its
    group's extreme value), and a converted copy must not pass for a sound one."""
    if not mx.all(mx.isfinite(source)).item():
        raise _not_finite(job)


def _not_finite(job: _Job) -> CheckpointError:
    return CheckpointError(
        f"{job.ref.path}: tensor '{job.shown}' holds NaN or infinite values: the "
        "checkpoint is damaged; re-download it"
    )


def _check_float16_range(job: _Job, source: mx.array, block: mx.array) -> None:
    """float16 tops out at 65504: a larger weight would be written as infinity."""
    if mx.any(mx.isinf(block) & mx.isfinite(source)).item():
        largest = mx.max(mx.where(mx.isfinite(source), mx.abs(source), 0)).item()
        raise InputError(
            f"{job.ref.path}: tensor '{job.shown}' holds values beyond float16's range "
            f"(up to {largest:.4g}; float16 ends at 65504): convert with --dtype bfloat16 "
            "or float32"
        )


# Bits that are all ones in the exponent of a NaN or an infinity, per float format.
_NOT_FINITE_BITS = {"BF16": (np.uint16, 0x7F80), "F16": (np.uint16, 0x7C00)}


def _raw_copy(job: _Job, chunk_bytes: int) -> Iterator[bytes]:
    """The tensor's bytes as stored (checked for NaN and infinity as converted ones are)."""
    info = job.ref.info
    start = job.data_start + info.start
    total = info.end - info.start
    item = SAFETENSORS_DTYPES[info.dtype][0]
    chunk_bytes = max(item, chunk_bytes - chunk_bytes % item)  # whole values per piece
    fd = os.open(job.ref.path, os.O_RDONLY)
    try:
        done = 0
        while done < total:
            piece = os.pread(fd, min(chunk_bytes, total - done), start + done)
            if not piece or len(piece) % item:
                raise CheckpointError(
                    f"{job.ref.path} is truncated at tensor '{job.shown}': re-download it"
                )
            if not _all_finite(piece, info.dtype):
                raise _not_finite(job)
            done += len(piece)
            yield piece
    finally:
        os.close(fd)


def _all_finite(raw: bytes, dtype: str) -> bool:
    if dtype in _NOT_FINITE_BITS:
        words, exponent = _NOT_FINITE_BITS[dtype]
        return not np.any((np.frombuffer(raw, words) & exponent) == exponent)
    if dtype in ("F32", "F64"):
        return bool(np.isfinite(np.frombuffer(raw, _NP_DTYPES[dtype])).all())
    return True  # integers (packed quantized weights)


def _write_shard(
    path: Path,
    jobs: list[_Job],
    dtype: str,
    chunk_bytes: int,
    progress: Progress | None,
    done: list[int],
    total: int,
) -> None:
    st_dtype, mx_dtype = OUTPUT_DTYPES[dtype]
    first = {job.outputs[0].name: job for job in jobs}
    stash: dict[str, list[bytes]] = {}

    def produce(spec: TensorSpec) -> Iterator[bytes]:
        job = first.get(spec.name)
        pieces = (
            _produce(job, mx_dtype, st_dtype, chunk_bytes, stash)
            if job is not None
            else iter(stash.pop(spec.name))
        )
        for piece in pieces:
            done[0] += len(piece)
            yield piece
        if progress is not None:
            progress(spec.name, done[0], total)

    specs = [o for job in jobs for o in job.outputs]
    write_safetensors(path, specs, produce, metadata={"format": "mlx"})


# --------------------------------------------------------------------------- config


def _without_quantization(params: dict) -> dict:
    return {k: v for k, v in params.items() if k not in ("quantization", "quantization_config")}


# What config.json records of a conversion, beside params.json's keys (model_type is one).
_CONVERSION_KEYS = frozenset(
    {
        "format",
        "format_version",
        "source",
        "source_layout",
        "dtype",
        "weight_names",
        "codec_weight_norm",
    }
)


def _params_of(config: dict) -> dict:
    """params.json's keys in an MLX directory's config.json: without what an earlier
    conversion recorded there (its source, dtype, quantization)."""
    return {k: v for k, v in _without_quantization(config).items() if k not in _CONVERSION_KEYS}


def _config_json(
    params: dict,
    source: str,
    weights: WeightSet,
    options: QuantOptions,
    dtype: str,
    jobs: list[_Job],
) -> dict:
    config: dict = {
        **_without_quantization(params),
        "model_type": "voxtral_tts",
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "source": source,
        "source_layout": weights.layout,
        "dtype": dtype,
        "weight_names": "mlx-audio",
        "codec_weight_norm": "unfolded",
    }
    layers = {
        job.outputs[0].name[: -len(".weight")]: job.spec.as_dict()
        for job in jobs
        if job.spec is not None
    }
    if layers:
        # mlx-lm's form, which mlx-audio reads: defaults, then one entry per quantized layer
        # (the flow head's bits differ from the backbone's).
        config["quantization"] = {
            "group_size": options.group_size,
            "bits": options.bits,
            "mode": "affine",
            "components": {
                "backbone": options.bits,
                "flow_head": options.flow_bits,
                "codec": None,
                "embeddings": None,
            },
            **layers,
        }
    return config


def _check_voices(src: Path, tokenizer: TekkenTokenizer, dim: int) -> VoiceRegistry:
    """Every voice the output would carry must load with this model (shape, width, rows,
    finite values), checked before anything is written: a converted directory never holds
    a voice that fails at its first use. Returns them, read."""
    registry = VoiceRegistry.from_dir(
        src / "voice_embedding", tokenizer.voice_num_audio_tokens, dim
    )
    for path in registry.broken.values():
        raise VoiceError(f"voice file {unreadable(path)}; restore or remove it, then convert again")
    seen: dict[str, str] = {}
    for name in registry:
        other = seen.setdefault(folded_name(name), name)
        if other != name:  # one file on a Mac (APFS ignores case): which would it hold?
            raise VoiceError(
                f"voices {one_line(repr(other))} and {one_line(repr(name))} in "
                f"{one_line(str(src / 'voice_embedding'))} differ only in case: rename or "
                "remove one, then convert again"
            )
        registry.embedding(name)
    return registry


_MLX_VOICE_DTYPES = ("BF16", "F16", "F32")  # a voice file in these is copied as it is


def _copy_voices(src: Path, dst: Path, registry: VoiceRegistry) -> None:
    """The voices the model speaks with (the registry's choice of file for each name) as
    ``<name>.safetensors`` holding one tensor under ``embedding``: such files in a dtype MLX
    reads are copied byte for byte, others (another key, extra tensors, float64) rewritten,
    .pt converted (:func:`_check_voices` has read them all)."""
    if not (src / "voice_embedding").is_dir():
        return
    out = dst / "voice_embedding"
    out.mkdir()
    pts = []
    for name in registry:
        path = registry[name].path
        if path.suffix != ".safetensors":
            pts.append(path)
            continue
        header = read_safetensors_header(path)
        if list(header) == [EMBEDDING_KEY] and header[EMBEDDING_KEY].dtype in _MLX_VOICE_DTYPES:
            shutil.copyfile(path, out / path.name)
            continue
        # (A float64 file is read as float32, which MLX, and so mlx-audio, can read back.)
        mx.save_safetensors(str(out / path.name), {EMBEDDING_KEY: registry.embedding(name)})
    if pts:
        try:
            convert_voice_files(pts, out)
        except KeyboardInterrupt as e:
            # "written (complete)" would name the staged voices of an output not written.
            e.__dict__.pop("detail", None)
            raise
        except VoiceError as e:
            # Its message names the staging directory and asks for another output
            # directory: a failed write is reported as the weights' are.
            if isinstance(e.__cause__, OSError):
                raise e.__cause__ from None
            raise


# --------------------------------------------------------------------------- entry point


def convert_model(
    model: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    q_bits: int | None = None,
    q_group_size: int | None = None,
    q_flow_bits: int | None = None,
    dtype: str = "bfloat16",
    force: bool = False,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    chunk_bytes: int = CHUNK_BYTES,
    progress: Progress | None = None,
) -> ConvertResult:
    """Convert ``model`` (a local directory or a Hub repo) into ``out_dir``; see the module
    docstring for the layout and the precision rules. Raises :class:`VoxtralError` subclasses
    with one-line messages; on any failure ``out_dir`` is left as it was."""
    force = check_flag("force", force)
    options = QuantOptions.make(q_bits, q_group_size, q_flow_bits)
    dtype = output_dtype(dtype)
    max_shard_bytes = check_whole("max_shard_bytes", max_shard_bytes, 1)
    chunk_bytes = check_whole("chunk_bytes", chunk_bytes, 1)
    if progress is not None and not callable(progress):
        raise InputError(f"progress must be a function or None, got {type(progress).__name__}")
    out_path = directory_path(out_dir)
    if model is None:  # resolve_model_dir's default would download 8 GB unasked
        raise InputError("model is None: give a model directory or a Hugging Face repo id")
    src = resolve_model_dir(model)
    out = _check_output(out_path.absolute(), src, force)

    config = read_model_config(src)
    tokenizer = TekkenTokenizer.from_file(src / "tekken.json")
    check_tokenizer(config, tokenizer)
    voice_registry = _check_voices(src, tokenizer, config.backbone.dim)
    voices = list(voice_registry)
    weights = open_weights(src, config)
    if weights.quantized:
        raise InputError(
            f"{src} is already quantized ({len(weights.quantized)} layers): convert from the "
            "original or an unquantized checkpoint"
        )
    jobs = _plan(weights, options, dtype)
    _check_backbone_quantized(jobs, options)
    shards = _shards(jobs, max_shard_bytes)
    names = (
        [SINGLE_NAME]
        if len(shards) == 1
        else [SHARD_NAME.format(i + 1, len(shards)) for i in range(len(shards))]
    )
    total = sum(o.nbytes for job in jobs for o in job.outputs)

    with staged_dir(out, force) as tmp:
        done = [0]
        for name, shard in zip(names, shards, strict=True):
            _write_shard(tmp / name, shard, dtype, chunk_bytes, progress, done, total)
        weight_map = {
            o.name: n for n, shard in zip(names, shards) for j in shard for o in j.outputs
        }
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        atomic_write_text(tmp / INDEX_NAME, json.dumps(index, indent=4) + "\n")
        source = (
            model
            if isinstance(model, str) and not Path(model).exists()
            else cached_repo(src) or src.name
        )
        config_json = _config_json(config.raw, str(source), weights, options, dtype, jobs)
        atomic_write_text(tmp / "config.json", json.dumps(config_json, indent=4) + "\n")
        if (src / "params.json").is_file():
            shutil.copyfile(src / "params.json", tmp / "params.json")
        else:  # an MLX directory keeping its params in config.json only
            params = _params_of(config.raw)  # the source's, not this output's
            atomic_write_text(tmp / "params.json", json.dumps(params, indent=4) + "\n")
        shutil.copyfile(src / "tekken.json", tmp / "tekken.json")
        _copy_voices(src, tmp, voice_registry)

        written = open_weights(tmp, config)  # the loader's own checks, on what was written
        planned = {j.name[: -len(".weight")]: j.spec for j in jobs if j.spec is not None}
        if written.quantized != planned:  # pragma: no cover - a bug of ours, not of the input
            raise InputError("the converted weights do not match the plan; please report this")
    files = [out / n for n in names]
    linears = [j for j in jobs if j.name.endswith(".weight") and len(j.ref.info.shape) == 2]
    layers = [j.name[: -len(".weight")] for j in linears if j.spec is None]
    # In the model's order (backbone layer by layer, then flow head), whatever the files'.
    order = {name[: -len(".weight")]: i for i, name in enumerate(expected_tensors(config))}
    unfit = sorted(
        (path for path in layers if options.wanted(path) is not None),
        key=lambda path: order.get(path, len(order)),
    )
    return ConvertResult(out, files, planned, total, voices, unfit, voice_registry.missing)
