"""Read a model directory into a ready :class:`VoxtralModel`, checking everything on the way.

Three layouts load (see :mod:`voxtral_mlx.mlx_layout`):

* ``mistral``: Mistral's release, ``params.json`` + ``consolidated.safetensors``;
* ``voxtral-mlx``: what :mod:`voxtral_mlx.convert` writes (``config.json`` says so),
  mlx-audio's tensor names in ``model*.safetensors`` (Mistral's in format version 1),
  optionally quantized;
* ``mlx-community``: mlx-audio's conversions, mlx-audio's tensor names, optionally quantized.

Weights are mapped lazily by MLX from every layout and read (cast to the compute dtype)
once the model is built, before its steps are compiled: a compiled step would otherwise
capture them unread and read and cast them again at every call. Names are mapped to
Mistral's, then every tensor is verified against the shapes ``params.json`` implies (packed
shapes for quantized layers); quantized layers are exactly those whose ``.scales`` are in
the files, and the model is loaded with ``strict=True``.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from .checkpoint import (
    FLOAT_QUANT_MODES,
    IGNORED_TENSORS,
    QUANT_GROUP_SIZES,
    CheckpointMismatch,
    Expected,
    QuantSpec,
    TensorInfo,
    affine_bits,
    checkpoint_dtype,
    expected_tensors,
    load_tensors,
    read_safetensors_header,
    sanitize,
    some_names,
    verify_tensors,
)
from .config import ModelConfig
from .errors import CheckpointError, ConfigError, InputError, ModelNotFoundError
from .fileio import one_line
from .mlx_layout import (
    CONSOLIDATED,
    FORMAT,
    INDEX_NAME,
    QuantConfig,
    check_format,
    loose_weight_files,
    params_from_config,
    read_config,
    read_quantization,
    refuse_unreadable,
    to_mistral_name,
    to_mlx_audio_name,
    uses_mlx_audio_names,
    weight_files,
)
from .model.layers import Float32QuantizedLinear
from .model.voxtral import VoxtralModel
from .tokenizer import NEXT_AUDIO_TEXT, REPEAT_AUDIO_TEXT, TekkenTokenizer
from .voices import VoiceRegistry

DTYPES = {
    "bfloat16": mx.bfloat16,
    "bf16": mx.bfloat16,
    "float16": mx.float16,
    "fp16": mx.float16,
    "float32": mx.float32,
    "fp32": mx.float32,
}
SEMANTIC_HEAD = "acoustic_transformer.semantic_codebook_output.weight"
AUDIO_TABLE = "mm_audio_embeddings.audio_codebook_embeddings.embeddings.weight"


@dataclass
class LoadedModel:
    model: VoxtralModel
    config: ModelConfig
    tokenizer: TekkenTokenizer
    voices: VoiceRegistry
    dtype: mx.Dtype
    path: Path
    layout: str = "mistral"
    quantized: dict[str, QuantSpec] = field(default_factory=dict)
    weight_files: tuple[Path, ...] = ()

    @property
    def weight_bytes(self) -> int:
        """Bytes of every parameter as loaded (packed quantized weights included)."""
        return sum(a.nbytes for _, a in tree_flatten(self.model.parameters()))


def parse_dtype(dtype: str | mx.Dtype | None) -> mx.Dtype | None:
    if dtype is None:
        return None
    if isinstance(dtype, mx.Dtype):
        if dtype in DTYPES.values():
            return dtype
    elif isinstance(dtype, str) and dtype.lower() in DTYPES:
        return DTYPES[dtype.lower()]
    # mx.int8 / mx.float64 would build a model MLX cannot run (or quantize); refuse them here.
    raise InputError(f"unsupported dtype {dtype!r}: use bfloat16, float16 or float32")


def check_tokenizer(config: ModelConfig, tokenizer: TekkenTokenizer) -> None:
    pairs = [
        ("<s>", config.bos_token_id, "multimodal.bos_token_id"),
        ("[AUDIO]", config.audio_token_id, "multimodal.audio_model_args.audio_token_id"),
        (
            "[BEGIN_AUDIO]",
            config.begin_audio_token_id,
            "multimodal.audio_model_args.begin_audio_token_id",
        ),
    ]
    for token, expected, key in pairs:
        got = tokenizer.special_id(token)
        if got != expected:
            raise ConfigError(
                f"tekken.json puts {token} at id {got} but params.json key '{key}' says "
                f"{expected}: the tokenizer and the weights come from different models; use the "
                "tekken.json and params.json of one download"
            )
    for token in (NEXT_AUDIO_TEXT, REPEAT_AUDIO_TEXT):  # every prompt has them
        tokenizer.special_id(token)
    if tokenizer.vocab_size > config.backbone.vocab_size:
        raise ConfigError(
            f"tekken.json has {tokenizer.vocab_size} ids but params.json key 'vocab_size' is "
            f"{config.backbone.vocab_size}: the tokenizer and the weights do not match; use the "
            "tekken.json and params.json of one download"
        )


# --------------------------------------------------------------------------- weights


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor lives: its file, its name in that file and its header entry."""

    path: Path
    key: str
    info: TensorInfo


@dataclass
class WeightSet:
    """The verified weights of a model directory, by Mistral name (nothing read yet)."""

    model_dir: Path
    layout: str  # "mistral" | "voxtral-mlx" | "mlx-community"
    files: list[Path]
    tensors: dict[str, TensorRef]
    quantized: dict[str, QuantSpec]  # module path (Mistral names) -> how it is packed
    source: str

    @property
    def infos(self) -> dict[str, TensorInfo]:
        return {n: r.info for n, r in self.tensors.items()}

    def rows(self, name: str) -> int:
        return self.tensors[name].info.shape[0]

    def load(self) -> dict[str, mx.array]:
        """Lazy arrays (memory-mapped by MLX; nothing is read until evaluated)."""
        wanted: dict[Path, dict[str, str]] = {}
        for name, ref in self.tensors.items():
            wanted.setdefault(ref.path, {})[ref.key] = name
        out: dict[str, mx.array] = {}
        for path, names in wanted.items():
            infos = {key: self.tensors[name].info for key, name in names.items()}
            arrays = load_tensors(path, infos)
            for key, name in names.items():
                out[name] = arrays[key]
        return out


# Weight files other tools write and read that voxtral_mlx does not.
_UNREAD_WEIGHTS = frozenset({".npz", ".gguf", ".bin", ".pth", ".ckpt"})


def find_weight_files(model_dir: Path) -> tuple[str, list[Path], dict[str, str] | None]:
    """``("mistral", [consolidated], None)`` or ``("mlx", files, index weight map or None)``.

    A conversion (``config.json`` + an index or other ``*.safetensors`` files, whatever
    their names, as :func:`~voxtral_mlx.hub.layout_patterns` decides) wins over a
    ``consolidated.safetensors`` beside it: mlx-audio's converter copies the source's
    weights into its output, and the converted (often quantized) model is the one meant.
    """
    consolidated = model_dir / CONSOLIDATED
    has_mlx = (model_dir / INDEX_NAME).is_file() or bool(loose_weight_files(model_dir))
    if consolidated.is_file() and not (has_mlx and (model_dir / "config.json").is_file()):
        return "mistral", [consolidated], None
    files, index = weight_files(model_dir)
    if files and index is None and consolidated.is_file() and not _any_model_tensor(files):
        # A stray file (a voice copied to the top, say) beside Mistral's weights and a
        # config.json: the weights are consolidated.safetensors, as mlx-audio reads them.
        return "mistral", [consolidated], None
    if files:
        return "mlx", files, index
    refuse_unreadable(consolidated)
    other = sorted(p.name for p in model_dir.glob("*") if p.suffix in _UNREAD_WEIGHTS)
    if other:
        raise CheckpointError(
            f"{model_dir} holds weights only as {some_names(other, 2)}, a format voxtral_mlx "
            "does not read: use Mistral's download or an MLX conversion in .safetensors "
            "(voxtral-mlx convert, mlx-audio's converter)"
        )
    raise ModelNotFoundError(
        f"{model_dir} has no {CONSOLIDATED} (Mistral's layout) and no *.safetensors weights "
        "(an MLX conversion): the download is incomplete; fetch it again"
    )


# The first part of every tensor name of the model, in Mistral's names (and of mlx-audio's
# names the rename table does not know).
_MODEL_ROOTS = frozenset(
    {
        "layers",
        "norm",
        "output",
        "mm_audio_embeddings",
        "acoustic_transformer",
        "audio_tokenizer",
        "language_model",
        "audio_codebook_embeddings",
    }
)


def _any_model_tensor(files: list[Path]) -> bool:
    """Whether any of ``files`` holds a tensor of the model (under either naming)."""
    return any(
        (to_mistral_name(key) or key).split(".")[0] in _MODEL_ROOTS
        for path in files
        for key in read_safetensors_header(path)
    )


def _read_headers(
    files: list[Path], index: Mapping[str, str] | None, model_dir: Path
) -> dict[str, TensorRef]:
    refs: dict[str, TensorRef] = {}
    for path in files:
        for key, info in read_safetensors_header(path).items():
            if key in refs:
                raise CheckpointError(
                    f"tensor '{one_line(key, 80)}' is in both {refs[key].path.name} and "
                    f"{path.name}: remove the stale file or re-download the model"
                )
            refs[key] = TensorRef(path, key, info)
    if index is not None:
        for key, file in index.items():
            ref = refs.get(key)
            if ref is None or ref.path.name != file:
                raise CheckpointError(
                    f"{model_dir / INDEX_NAME} puts '{one_line(key, 80)}' in {one_line(file, 80)}"
                    f" but that file does not hold it: re-download or re-convert the model"
                )
    return refs


def _rename_refs(refs: dict[str, TensorRef]) -> dict[str, TensorRef]:
    out: dict[str, TensorRef] = {}
    for key, ref in refs.items():
        name = to_mistral_name(key) or key  # unknown names stay as they are, to be reported
        if name in out:
            raise CheckpointError(
                f"tensors '{one_line(out[name].key, 80)}' and '{one_line(key, 80)}' both map to "
                f"'{one_line(name, 80)}': the weights are not a Voxtral TTS checkpoint"
            )
        out[name] = ref
    return out


def _infer_spec(
    path: str, tensors: Mapping[str, TensorRef], base: Mapping[str, Expected]
) -> QuantSpec | None:
    """Bits and group size read off the packed shapes (for files that do not record them)."""
    expected, weight, scales = (
        base.get(f"{path}.weight"),
        tensors.get(f"{path}.weight"),
        tensors.get(f"{path}.scales"),
    )
    if expected is None or weight is None or scales is None or len(expected.shape) != 2:
        return None
    if len(weight.info.shape) != 2 or len(scales.info.shape) != 2:  # damaged: verify names it
        return None
    width = expected.shape[1]
    packed, groups = weight.info.shape[-1], scales.info.shape[-1]
    if not groups or width % groups or (packed * 32) % width:
        return None
    bits, group = packed * 32 // width, width // groups
    if scales.info.dtype == "U8":  # a float format: its bits and group size name it
        modes = [m for m, shape in FLOAT_QUANT_MODES.items() if shape == (bits, group)]
        return QuantSpec(bits, group, modes[0]) if modes else None
    return QuantSpec(bits=bits, group_size=group)


def _quantized_layers(
    tensors: Mapping[str, TensorRef],
    qconfig: QuantConfig | None,
    base: Mapping[str, Expected],
    source: str,
) -> dict[str, QuantSpec]:
    """Module path -> spec for every layer stored quantized, with bits and group size from
    config.json or the shapes. A layer is stored quantized when its ``.scales`` are present
    (a packed weight or ``.biases`` without them is a damaged file, said so): the weights
    decide, so config.json entries for other layers (unquantized ones, or modules that do
    not exist) are ignored (mlx-audio ignores those of codec layers and of missing modules,
    and refuses a directory with such an entry for a backbone or flow-head layer)."""
    _check_scales(tensors, source)
    paths = {n[: -len(".scales")] for n in tensors if n.endswith(".scales")}
    # A layer with other rows than params.json gives: the files do not fit params.json, and
    # verification names the shapes; config.json is not blamed for the widths this implies.
    rows_fit = all(
        base[f"{p}.weight"].shape[:1] == tensors[f"{p}.weight"].info.shape[:1]
        for p in paths
        if f"{p}.weight" in base and f"{p}.weight" in tensors
    )
    out: dict[str, QuantSpec] = {}
    for path in sorted(paths):
        named = one_line(tensors[f"{path}.scales"].key.removesuffix(".scales"), 80)  # as filed
        if qconfig is not None and path in qconfig.layers and qconfig.layers[path] is None:
            raise CheckpointError(
                f"{source}: config.json's quantization section leaves layer "
                f"'{named}' unquantized, but the files hold it quantized: "
                "config.json and the weights come from different conversions; re-download "
                "or re-convert the model"
            )
        if f"{path}.weight" in IGNORED_TENSORS:
            continue  # read by no module
        layer = qconfig.layers.get(path) if qconfig is not None else None
        bits = (layer.bits if layer else None) or (qconfig.bits if qconfig else None)
        group = (layer.group_size if layer else None) or (qconfig.group_size if qconfig else None)
        mode = layer.mode if layer else (qconfig.mode if qconfig else None)
        if mode is not None and mode != "affine" and mode not in FLOAT_QUANT_MODES:
            raise CheckpointError(
                f"{source}: layer '{named}' uses quantization mode "
                f"{one_line(str(mode), 40)!r}, which MLX does not know (affine, "
                f"{', '.join(FLOAT_QUANT_MODES)}): convert the original (unquantized) "
                "checkpoint with `voxtral-mlx convert --q-bits N`"
            )
        if mode in FLOAT_QUANT_MODES:
            bits, group = bits or FLOAT_QUANT_MODES[mode][0], group or FLOAT_QUANT_MODES[mode][1]
        if qconfig is not None and rows_fit:
            _check_recorded_spec(path, (mode, bits, group), tensors, base, source)
        if bits is None or group is None or mode is None:
            inferred = _infer_spec(path, tensors, base)
            if inferred is None:
                continue  # its tensors are reported by verification
            bits, group = bits or inferred.bits, group or inferred.group_size
            mode = mode or inferred.mode
        if mode in FLOAT_QUANT_MODES and (bits, group) != FLOAT_QUANT_MODES[mode]:
            want_bits, want_group = FLOAT_QUANT_MODES[mode]
            raise CheckpointError(
                f"{source}: layer '{named}' is quantized in mode {mode} with "
                f"{bits} bits and group size {group}, but {mode} has {want_bits} bits and "
                f"group size {want_group}: re-convert it"
            )
        if mode == "affine" and (bits not in affine_bits() or group not in QUANT_GROUP_SIZES):
            raise CheckpointError(
                f"{source}: layer '{named}' is quantized with {bits} bits and group "
                f"size {group}, which this MLX's affine quantization does not support (bits "
                f"{', '.join(map(str, affine_bits()))}; group size 32, 64 or 128): re-convert "
                "it, or upgrade mlx if a newer one supports it"
            )
        out[path] = QuantSpec(bits=bits, group_size=group, mode=mode)
    return out


def _check_recorded_spec(
    path: str,
    given: tuple[str | None, int | None, int | None],
    tensors: Mapping[str, TensorRef],
    base: Mapping[str, Expected],
    source: str,
) -> None:
    """config.json's mode, bits and group size for ``path`` (None where it gives none)
    against its tensors: a section that disagrees with the packed shapes is named as such
    (verification would list every layer as mis-shaped and blame the weights)."""
    read = _infer_spec(path, tensors, base)
    if read is None or (
        read.mode == "affine"
        and (read.bits not in affine_bits() or read.group_size not in QUANT_GROUP_SIZES)
    ):
        return  # the tensors are in no format MLX reads: verification names them
    found = (read.mode, read.bits, read.group_size)
    if all(g is None or g == f for g, f in zip(given, found)):
        return
    layer = tensors[f"{path}.scales"].key.removesuffix(".scales")
    raise CheckpointError(
        f"{source}: config.json's quantization section gives layer '{one_line(layer, 80)}' "
        f"{_spec_words(*given)}, but its tensors are {_spec_words(*found)}: correct "
        "config.json (or remove its quantization section: the format is then read off the "
        "tensors), or re-download the model"
    )


def _spec_words(mode: str | None, bits: int | None, group: int | None) -> str:
    sizes = [f"{bits} bits"] * (bits is not None) + [f"group size {group}"] * (group is not None)
    size = " and ".join(sizes)
    if mode in (None, "affine"):
        return size or "affine quantization"
    return f"mode {mode}" + (f" ({size})" if size else "")


def open_weights(model_dir: Path, config: ModelConfig) -> WeightSet:
    """Find, rename (to Mistral's names) and verify the weights of ``model_dir``.

    MLX layouts: ``config.json``'s quantization section (if any) gives bits and group
    sizes; files without one have them read off the packed shapes. Raises
    :class:`ModelNotFoundError` for missing files and :class:`CheckpointError`
    (:class:`~voxtral_mlx.checkpoint.CheckpointMismatch`) for tensors that do not fit
    ``config``. Reads headers only.
    """
    kind, files, index = find_weight_files(model_dir)
    refs = _read_headers(files, index, model_dir)
    source = weight_source(model_dir, files)
    if kind == "mistral":
        layout, tensors, qconfig, mlx_audio = "mistral", refs, None, False
    else:
        mlx_audio = uses_mlx_audio_names(refs)
        config_json = read_config(model_dir)
        check_format(config_json, model_dir)
        ours = not mlx_audio or (config_json or {}).get("format") == FORMAT
        layout = "voxtral-mlx" if ours else "mlx-community"
        tensors = _rename_refs(refs) if mlx_audio else refs
        try:
            qconfig = read_quantization(config_json, rename=mlx_audio)
        except ConfigError as e:
            raise ConfigError(
                f"{model_dir / 'config.json'}: {str(e).removeprefix('config.json ')}; convert "
                "the model again or restore config.json from its download"
            ) from None
    base = expected_tensors(config)
    quantized = _quantized_layers(tensors, qconfig, base, source)
    try:
        expected = expected_tensors(config, quantized)
    except CheckpointError as e:  # a group size a layer's width cannot take: name the files
        raise CheckpointError(f"{source}: {e}") from None
    try:
        verify_tensors(
            {n: r.info.shape for n, r in tensors.items()},
            expected,
            source,
            dtypes={n: r.info.dtype for n, r in tensors.items()},
            against="params.json" if qconfig is None else "params.json and config.json",
        )
    except CheckpointMismatch as e:
        if not mlx_audio and len(files) == 1:
            raise
        raise _in_file_names(e, tensors, len(files) > 1) from None
    return WeightSet(model_dir, layout, files, tensors, quantized, source)


def _check_scales(tensors: Mapping[str, TensorRef], source: str) -> None:
    """A layer with packed (U32) weights or ``.biases`` but no ``.scales`` is a damaged file
    (verification would list it as mis-shaped and unexpected tensors)."""
    for name, ref in tensors.items():
        path, _, leaf = name.rpartition(".")
        packed = leaf == "weight" and ref.info.dtype == "U32"
        if (packed or leaf == "biases") and f"{path}.scales" not in tensors:
            layer = ref.key.rpartition(".")[0]
            raise CheckpointError(
                f"{source}: layer '{one_line(layer, 80)}' has quantized weights but no "
                ".scales: the file is incomplete; re-download or re-convert the model"
            )


def weight_source(model_dir: Path, files: list[Path]) -> str:
    """How errors name the weight files: the one file, or the directory and a few names."""
    if len(files) == 1:
        return str(files[0])
    return f"{model_dir}/{{{some_names([p.name for p in files], 3)}}}"


def _in_file_names(
    e: CheckpointMismatch, tensors: Mapping[str, TensorRef], say_file: bool = False
) -> CheckpointMismatch:
    """``e`` with the tensors named as the files name them (mlx-audio's names), and with
    ``say_file`` the file holding each unexpected one."""

    def key(name: str) -> str:
        ref = tensors.get(name)
        return ref.key if ref is not None else (to_mlx_audio_name(name) or name)

    def found(name: str) -> str:
        ref = tensors.get(name)
        return f"{key(name)} in {ref.path.name}" if say_file and ref is not None else key(name)

    return CheckpointMismatch(
        e.source,
        [key(n) for n in e.missing],
        [found(n) for n in e.unexpected],
        [(key(n), shape, want) for n, shape, want in e.misshaped],
        [(key(n), dtype, want) for n, dtype, want in e.mistyped],
        e.against,
    )


def read_model_config(model_dir: Path) -> ModelConfig:
    """The model config: ``params.json``, else the params ``config.json`` holds. When both
    hold a complete model config they must describe the same model (mlx-audio reads
    ``config.json``: a disagreement would make the two speak differently from one directory)."""
    params_path = model_dir / "params.json"
    if os.path.lexists(params_path):  # a FIFO or directory is reported as what it is
        config = ModelConfig.from_file(params_path)
        try:
            in_config = params_from_config(read_config(model_dir))
        except ConfigError:  # not a model config to compare with; reported where it is needed
            in_config = None
        # A model config that does not even parse is as wrong as one that disagrees:
        # mlx-audio would read it.
        other = (
            None
            if in_config is None
            else ModelConfig.from_params(in_config, str(model_dir / "config.json"))
        )
        if other is not None and not _sets_decoding_steps(in_config):
            # The one knob users turn by editing params.json (SPEC): a config.json that
            # only takes the default does not contradict it.
            flow = dataclasses.replace(other.flow, n_decoding_steps=config.flow.n_decoding_steps)
            other = dataclasses.replace(other, flow=flow)
        if other is not None and (diff := _first_difference(config, other)) is not None:
            name, mine, theirs = diff
            raise ConfigError(
                f"{model_dir}: params.json and config.json disagree on {name} "
                f"({one_line(repr(mine), 60)} vs {one_line(repr(theirs), 60)}); re-download "
                "or re-convert the model (or make the two files agree)"
            )
        return config
    config_json = read_config(model_dir)
    params = params_from_config(config_json)
    if params is None and config_json is not None:
        raise ConfigError(
            f"{model_dir} has no params.json and its config.json holds no Voxtral parameters "
            "(no 'multimodal' section): re-download the model, or copy params.json from "
            "Mistral's checkpoint beside it"
        )
    if params is None:
        raise ModelNotFoundError(
            f"{model_dir} has no params.json: it is not a Voxtral TTS model directory; pass "
            "the folder holding params.json, tekken.json and the weights, or a Hugging Face "
            "repo id"
        )
    return ModelConfig.from_params(params, str(model_dir / "config.json"))


def _sets_decoding_steps(params: Mapping[str, Any]) -> bool:
    section: Any = params
    for key in ("multimodal", "audio_model_args", "acoustic_transformer_args"):
        section = section.get(key) if isinstance(section, Mapping) else None
    return isinstance(section, Mapping) and "n_decoding_steps" in section


def _first_difference(a: Any, b: Any, name: str = "") -> tuple[str, Any, Any] | None:
    """The first field (dotted name) where two configs differ; voice names are left out
    (the voice files decide which voices exist)."""
    if not dataclasses.is_dataclass(a):
        return None if a == b else (name, a, b)
    for f in dataclasses.fields(a):
        if not f.compare or f.name == "voice_index":
            continue
        found = _first_difference(getattr(a, f.name), getattr(b, f.name), f"{name}{f.name}.")
        if found is not None:
            return found[0].rstrip("."), found[1], found[2]
    return None


def _quantize_model(
    model: nn.Module, quantized: Mapping[str, QuantSpec], compute_dtype: mx.Dtype
) -> None:
    def predicate(path: str, module: nn.Module) -> bool | dict[str, Any]:
        spec = quantized.get(path)
        return False if spec is None else spec.as_dict()

    nn.quantize(model, class_predicate=predicate)
    if mx.default_device() == mx.cpu and compute_dtype != mx.float32:
        exact = [
            (path, Float32QuantizedLinear.from_quantized(m))
            for path, m in model.named_modules()
            if type(m) is nn.QuantizedLinear
        ]
        model.update_modules(tree_unflatten(exact))
    missing = sorted(set(quantized) - {p for p, m in model.named_modules() if hasattr(m, "scales")})
    if missing:  # verified tensors for a module that cannot be quantized (not Linear/Embedding)
        raise CheckpointError(
            f"layer '{one_line(missing[0], 80)}' is stored quantized but cannot be quantized "
            "in MLX: re-convert the model"
        )


def load_model_dir(
    model_dir: Path,
    dtype: str | mx.Dtype | None = None,
    check: Callable[[], None] = lambda: None,
) -> LoadedModel:
    """Load a model directory in any supported layout (see the module docstring).

    ``check`` is called between parts of the weights (a layer's, or ~:data:`LOAD_PART_BYTES`
    of them): an exception it raises ends the load there (a model closed while it loads: at
    interpreter exit, a load still reading would make the process abort).
    """
    compute = parse_dtype(dtype)
    config = read_model_config(model_dir)
    # The tokenizer (about 0.4 s in Rust, holding the GIL) is built while the weights load
    # (MLX lets the GIL go); its errors still come first, as when it was built first.
    pending = _in_background(lambda: TekkenTokenizer.from_file(model_dir / "tekken.json"))
    try:
        model, weights, compute_dtype = _load_weights(model_dir, config, compute, check)
    except Exception:
        check()  # a stopped load ends at once, whatever the tokenizer says
        check_tokenizer(config, pending.result())
        raise
    tokenizer = pending.result()
    check_tokenizer(config, tokenizer)
    voices = _voices(model_dir, config, tokenizer)
    return LoadedModel(
        model,
        config,
        tokenizer,
        voices,
        compute_dtype,
        model_dir,
        layout=weights.layout,
        quantized=dict(weights.quantized),
        weight_files=tuple(weights.files),
    )


def load_voices(model_dir: Path) -> VoiceRegistry:
    """The voices of a model directory, without its weights (listing them reads a few
    megabytes, not the model's gigabytes): its config gives their width, tekken.json their
    row counts."""
    config = read_model_config(model_dir)
    tokenizer = TekkenTokenizer.from_file(model_dir / "tekken.json")
    check_tokenizer(config, tokenizer)
    return _voices(model_dir, config, tokenizer)


def _voices(model_dir: Path, config: ModelConfig, tokenizer: TekkenTokenizer) -> VoiceRegistry:
    return VoiceRegistry.from_dir(
        model_dir / "voice_embedding", tokenizer.voice_num_audio_tokens, config.backbone.dim
    )


def _in_background(fn: Callable[[], Any]) -> Future:
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as e:  # a Rust panic too: handed to the loading thread
            future.set_exception(e)

    threading.Thread(target=run, name="voxtral-mlx-tokenizer", daemon=True).start()
    return future


def _load_weights(
    model_dir: Path, config: ModelConfig, compute: mx.Dtype | None, check: Callable[[], None]
) -> tuple[VoxtralModel, WeightSet, mx.Dtype]:
    weights = open_weights(model_dir, config)
    compute_dtype = compute or checkpoint_dtype(weights.infos)
    params = sanitize(weights.load(), config, compute_dtype)

    model = VoxtralModel(
        config, semantic_rows=weights.rows(SEMANTIC_HEAD), audio_rows=weights.rows(AUDIO_TABLE)
    )
    if weights.quantized:
        _quantize_model(model, weights.quantized, compute_dtype)
    try:
        model.load_weights(list(params.items()), strict=True)
    except ValueError as e:  # shapes were verified; this guards the renames themselves
        raise CheckpointError(f"{weights.source}: {str(e).splitlines()[0]}") from None
    # The model holds the weights now: kept here too, the separate projections would stay
    # in memory beside their fused copies while prepare() makes them.
    del params
    # Fusing the projections first reads their parts from the files straight into the fused
    # copies (each part's buffer reused for the next); read beforehand, every part took
    # memory of its own that the fused copy then took again (loads here took 5-10 %
    # longer). Then every other weight (cast, codec weights folded), in parts, before the
    # compiled steps capture them.
    model.prepare(check=check)
    _evaluate_in_parts(tree_flatten(model.parameters()), check)
    return model, weights, compute_dtype


LOAD_PART_BYTES = 256 << 20  # weights read between two calls of a load's check


def _evaluate_in_parts(named: list[tuple[str, mx.array]], check: Callable[[], None]) -> None:
    part: list[mx.array] = []
    size = 0
    for _, array in named:
        part.append(array)
        size += array.nbytes
        if size >= LOAD_PART_BYTES:
            check()
            mx.eval(part)
            part, size = [], 0
    check()
    mx.eval(part)
