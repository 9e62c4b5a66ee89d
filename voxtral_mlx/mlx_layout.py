"""MLX model directories: weight files, ``model.safetensors.index.json``, ``config.json``,
and the one rename table between mlx-audio's module tree and Mistral's checkpoint names.

Two MLX layouts exist, told apart by their tensor names (never by the repo name):

* mlx-community conversions (made with mlx-audio): ``config.json`` (params.json's keys,
  ``model_type`` and mlx-lm's ``quantization`` section), ``params.json``, ``tekken.json``,
  ``model.safetensors`` or ``model-0000N-of-0000M.safetensors`` with an index, voices as
  ``voice_embedding/<name>.safetensors``. Weight names follow mlx-audio's module tree
  (``language_model.model.model.layers.N.self_attn.q_proj.weight``, ...); the flow head and
  the codec keep Mistral's names. Quantized layers carry ``.scales``/``.biases``.
* voxtral_mlx's own conversions (:mod:`voxtral_mlx.convert`): the same files and names
  (so mlx-audio loads them too), with ``config.json`` also recording how it was converted
  (:data:`FORMAT`) and an entry per quantized layer (the flow head keeps more bits than the
  backbone). Format version 1 used Mistral's names and a ``layers`` map; it still loads.

Everything is renamed to Mistral's names before verification; errors name tensors and
layers as their files do.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .checkpoint import FLOAT_QUANT_MODES, read_safetensors_header
from .errors import CheckpointError, ConfigError, ModelNotFoundError
from .fileio import MAX_JSON_BYTES, one_line, read_limited, unreadable_fix

FORMAT = "voxtral-mlx"  # config.json "format" of the directories voxtral_mlx.convert writes
FORMAT_VERSION = 2  # 1: Mistral's tensor names and a `layers` map (still read)
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
SHARD_NAME = "model-{:05d}-of-{:05d}.safetensors"
CONSOLIDATED = "consolidated.safetensors"  # Mistral's layout, never an MLX weight file
_SHARD_RE = re.compile(r"^model-(\d+)-of-(\d+)\.safetensors$")
# Keys of voxtral_mlx's quantization section that are not layers.
_SUMMARY_KEYS = frozenset({"layers", "components"})
# ``to_quantized``'s defaults by mode: (group size, bits).
MODE_DEFAULTS = {"affine": (64, 4)} | {m: (g, b) for m, (b, g) in FLOAT_QUANT_MODES.items()}

# --------------------------------------------------------------------------- rename table

_BACKBONE = "language_model.model.model."
_LM_HEAD = "language_model.model.lm_head."  # the untied text head (unused for speech)
# (Mistral name prefix, mlx-audio name prefix); the first match wins.
PREFIXES: tuple[tuple[str, str], ...] = (
    ("output.", _LM_HEAD),
    ("mm_audio_embeddings.tok_embeddings.", _BACKBONE + "embed_tokens."),
    ("mm_audio_embeddings.audio_codebook_embeddings.", "audio_codebook_embeddings."),
    ("norm.", _BACKBONE + "norm."),
    ("layers.", _BACKBONE + "layers."),
    ("acoustic_transformer.", "acoustic_transformer."),
    ("audio_tokenizer.", "audio_tokenizer."),
)
# Inside a backbone layer ``layers.N.``: (Mistral, mlx-audio / mlx-lm Llama).
LAYER_PARTS: tuple[tuple[str, str], ...] = (
    ("attention.wq.", "self_attn.q_proj."),
    ("attention.wk.", "self_attn.k_proj."),
    ("attention.wv.", "self_attn.v_proj."),
    ("attention.wo.", "self_attn.o_proj."),
    ("feed_forward.w1.", "mlp.gate_proj."),
    ("feed_forward.w2.", "mlp.down_proj."),
    ("feed_forward.w3.", "mlp.up_proj."),
    ("attention_norm.", "input_layernorm."),
    ("ffn_norm.", "post_attention_layernorm."),
)
_LAYER = re.compile(r"^(\d+)\.(.*)$")
# Older mlx-audio exports wrote ``language_model.model.X`` for ``language_model.model.model.X``.
_OLD_BACKBONE = "language_model.model."


def _rename(name: str, src: int) -> str | None:
    dst = 1 - src
    dotted = name + "."  # module paths ("layers.0.attention.wq") rename like tensor names
    for pair in PREFIXES:
        if not dotted.startswith(pair[src]):
            continue
        rest = dotted[len(pair[src]) :]
        if pair[0] == "layers.":
            m = _LAYER.match(rest)
            if m is None:
                return None
            for part in LAYER_PARTS:
                if m.group(2).startswith(part[src]):
                    rest = f"{m.group(1)}.{part[dst]}{m.group(2)[len(part[src]) :]}"
                    break
            else:
                return None
        return (pair[dst] + rest)[:-1]
    return None


def to_mistral_name(name: str) -> str | None:
    """mlx-audio name -> Mistral name (tensor or module path); None if the table has no rule."""
    if name.startswith(_OLD_BACKBONE) and not (name + ".").startswith((_BACKBONE, _LM_HEAD)):
        name = _BACKBONE + name[len(_OLD_BACKBONE) :]
    return _rename(name, 1)


def to_mlx_audio_name(name: str) -> str | None:
    """Mistral name -> mlx-audio name (tensor or module path); None if the table has no rule."""
    return _rename(name, 0)


def uses_mlx_audio_names(names: Iterable[str]) -> bool:
    """True when the tensor names follow mlx-audio's module tree rather than Mistral's."""
    return any(n.startswith(("language_model.", "audio_codebook_embeddings.")) for n in names)


# --------------------------------------------------------------------------- weight files


def loose_weight_files(model_dir: Path) -> list[Path]:
    """The directory's ``*.safetensors`` files that could hold MLX weights under any name:
    not hidden, not Mistral's ``consolidated.safetensors``; sorted."""
    return sorted(
        p
        for p in model_dir.glob("*.safetensors")
        if not p.name.startswith(".") and p.name != CONSOLIDATED and p.is_file()
    )


def weight_files(model_dir: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The ``model*.safetensors`` files of an MLX directory and the index's weight map.

    With ``model.safetensors.index.json`` the files are the ones it names (each must exist);
    without it, ``model.safetensors`` or a complete ``model-0000N-of-0000M`` series; with
    neither, every ``*.safetensors`` at the top (as mlx-audio reads a directory: weight files
    of any name, e.g. ``weights.00.safetensors``). Raises :class:`ModelNotFoundError` for a
    missing piece (an incomplete download).
    """
    index_path = model_dir / INDEX_NAME
    if os.path.lexists(index_path):
        weight_map = read_index(index_path)
        names = set(weight_map.values())
        for total in sorted({int(m.group(2)) for n in names if (m := _SHARD_RE.match(n))}):
            series = [SHARD_NAME.format(i + 1, total) for i in range(total)]
            left_out = [
                n for n in series if n not in names and not _holds_no_tensors(model_dir / n)
            ]
            if left_out and any(n in names for n in series):
                # Its tensors would be reported missing, as if the config were the culprit.
                raise CheckpointError(
                    f"{index_path} names {sum(n in names for n in series)} of the {total} files of "
                    f"its series, not {left_out[0]}: the index is stale or damaged; "
                    "re-download or re-convert the model"
                )
        files = [model_dir / name for name in sorted(names)]
        for path in files:
            refuse_unreadable(path)
            if not path.is_file():
                raise ModelNotFoundError(
                    f"{model_dir} is missing {path.name}, which {INDEX_NAME} lists: the "
                    "download is incomplete; fetch it again"
                )
        return files, weight_map
    single = model_dir / SINGLE_NAME
    shards = sorted(p for p in model_dir.glob("model-*-of-*.safetensors") if p.is_file())
    if single.is_file():
        return [single, *shards], None
    if not shards:
        return loose_weight_files(model_dir), None
    totals = {int(m.group(2)) for p in shards if (m := _SHARD_RE.match(p.name))}
    if len(totals) == 1:
        total = totals.pop()
        expected = [model_dir / SHARD_NAME.format(i + 1, total) for i in range(total)]
        for path in expected:
            refuse_unreadable(path)
        missing = [p.name for p in expected if not p.is_file()]
        if missing:
            raise ModelNotFoundError(
                f"{model_dir} is missing {missing[0]}"
                + (f" and {len(missing) - 1} more shards" if len(missing) > 1 else "")
                + ": the download is incomplete; fetch it again"
            )
    return shards, None


def _holds_no_tensors(path: Path) -> bool:
    """Whether ``path`` is a safetensors file with no tensors in it: mlx-lm's sharding (which
    mlx-audio's converter uses) writes an empty first shard, left out of the index, when the
    first tensor alone exceeds the shard size."""
    if not path.is_file():
        return False
    try:
        return not read_safetensors_header(path)
    except CheckpointError:
        return False


def refuse_unreadable(path: Path) -> None:
    """A weight file that is there but cannot be read as a file (a directory, a FIFO, a
    broken link) is named as such: it is no incomplete download."""
    if os.path.lexists(path) and not path.is_file():
        raise CheckpointError(
            f"{one_line(str(path))} is not a readable file (a directory, a pipe or device, "
            "or a broken link): remove it and fetch the model again"
        )


def read_index(path: Path) -> dict[str, str]:
    """The ``weight_map`` of a ``model.safetensors.index.json`` (tensor name -> file name)."""
    data = _read_json(path, CheckpointError)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(f"{path} has no valid 'weight_map': re-download or re-convert it")
    if not weight_map:
        raise CheckpointError(
            f"{path} lists no tensors (its 'weight_map' is empty): re-download or re-convert "
            "the model (or delete the index to load the *.safetensors files beside it)"
        )
    for file in set(weight_map.values()):
        if "/" in file or "\\" in file or not file.endswith(".safetensors") or file[0] == ".":
            raise CheckpointError(
                f"{path} names the weight file {one_line(file, 80)!r}, which is not a "
                "safetensors file of this directory: re-download or re-convert it"
            )
    return weight_map


def _read_json(path: Path, error: type[Exception]) -> Any:
    try:
        return json.loads(read_limited(path, MAX_JSON_BYTES).decode("utf-8"))
    except FileNotFoundError:
        raise error(f"{path} not found") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        where = (
            f" (line {e.lineno}, column {e.colno})" if isinstance(e, json.JSONDecodeError) else ""
        )
        raise error(f"{path} is not valid JSON{where}: re-download or re-convert it") from None
    except OSError as e:
        fix = unreadable_fix(e, "restore it from the model's download")
        raise error(f"cannot read {path}: {e.strerror}; {fix}") from None
    except (ValueError, RecursionError):  # a 5000-digit number, arrays nested 10^5 deep
        raise error(
            f"{path} is not usable JSON (absurdly long numbers or nesting): re-download or "
            "re-convert it"
        ) from None


def read_config(model_dir: Path) -> dict[str, Any] | None:
    """``config.json`` as a dict, or None when the directory has none."""
    path = model_dir / "config.json"
    if not os.path.lexists(path):  # one that is a FIFO or directory is reported as such
        return None
    data = _read_json(path, ConfigError)
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object: re-download or re-convert it")
    return data


def check_format(config: Mapping[str, Any] | None, where: Path) -> None:
    """A directory written by a later voxtral_mlx (a ``format_version`` this one does not
    know) is refused rather than misread."""
    if not config or config.get("format") != FORMAT:
        return
    version = config.get("format_version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ConfigError(
            f"{where}/config.json key 'format_version' must be a positive integer, got "
            f"{one_line(repr(version), 40)}: re-convert the model"
        )
    if version > FORMAT_VERSION:
        raise ConfigError(
            f"{where} was converted by a newer voxtral_mlx (format version {version}; this one "
            f"reads up to {FORMAT_VERSION}): upgrade voxtral-mlx, or re-convert the model"
        )


def params_from_config(config: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Mistral's params held by ``config.json`` (under ``params``, or at its top level)."""
    if not config:
        return None
    if isinstance(config.get("params"), dict):
        return dict(config["params"])
    if isinstance(config.get("multimodal"), dict):
        return dict(config)
    return None


# --------------------------------------------------------------------------- quantization


@dataclass(frozen=True)
class LayerQuant:
    """How one layer is quantized (``mx.quantize``'s arguments)."""

    bits: int | None  # None: not recorded, read it off the packed shapes
    group_size: int | None
    mode: str = "affine"


@dataclass(frozen=True)
class QuantConfig:
    """``config.json``'s quantization section: defaults plus per-layer entries.

    ``layers`` maps module paths (Mistral names) to a :class:`LayerQuant`, or to None for a
    layer the file leaves unquantized.
    """

    bits: int | None
    group_size: int | None
    mode: str
    layers: dict[str, LayerQuant | None]


def _int(value: Any, key: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        shown = one_line(repr(value), 60)
        raise ConfigError(f"config.json key '{key}' must be a positive integer, got {shown}")
    return value


def _mode(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(
            f"config.json key '{where}' must be a quantization mode's name (affine, mxfp4, "
            f"...), got {one_line(repr(value), 40)}"
        )
    return value


def read_quantization(config: Mapping[str, Any] | None, rename: bool) -> QuantConfig | None:
    """Parse ``quantization`` (or ``quantization_config``) of ``config.json``.

    Accepts mlx-lm's form (``group_size``, ``bits``, ``mode`` and per-layer entries keyed
    by module path) and voxtral_mlx's ``layers`` map. ``rename``: the paths are mlx-audio
    names (mapped through :func:`to_mistral_name`).
    """
    if not config:
        return None
    section = config.get("quantization", config.get("quantization_config"))
    if section is None:
        return None
    if not isinstance(section, dict):
        raise ConfigError("config.json key 'quantization' must be an object")
    key = "quantization"
    mode = _mode(section.get("mode", "affine"), f"{key}.mode")
    bits = _int(section.get("bits"), f"{key}.bits")
    group = _int(section.get("group_size"), f"{key}.group_size")
    entries: dict[str, Any] = {}
    # An mlx-lm entry is what MLX passes to ``to_quantized``: what it leaves out is that
    # function's default (affine; the mode's own bits and group size), not the section's.
    own_defaults: set[str] = set()
    for path, value in section.items():
        if isinstance(value, (dict, bool)) and path not in _SUMMARY_KEYS:
            entries[path] = value
            own_defaults.add(path)
    layers = section.get("layers", {})
    if not isinstance(layers, dict):
        raise ConfigError(f"config.json key '{key}.layers' must be an object")
    entries.update(layers)
    own_defaults -= layers.keys()

    out: dict[str, LayerQuant | None] = {}
    for path, value in entries.items():
        name = to_mistral_name(path) if rename else path
        name = name or path
        where = f"{key}.{one_line(path, 80)}"
        if value is False:
            out[name] = None
            continue
        # ``true``: MLX quantizes it with the section's mode, bits and group size.
        own = path in own_defaults and value is not True
        if value is True:
            value = {}
        if isinstance(value, int) and not isinstance(value, bool):
            value = {"bits": value}
        if not isinstance(value, dict):
            raise ConfigError(f"config.json key '{where}' must be an object, a bit count or false")
        if own:
            layer_mode = _mode(value.get("mode", "affine"), f"{where}.mode")
            default_group, default_bits = MODE_DEFAULTS.get(layer_mode, (None, None))
        else:
            layer_mode = _mode(value.get("mode", mode), f"{where}.mode")
            default_group, default_bits = group, bits
        own_bits, own_group = value.get("bits"), value.get("group_size")
        out[name] = LayerQuant(
            bits=_int(default_bits if own_bits is None else own_bits, f"{where}.bits"),
            group_size=_int(
                default_group if own_group is None else own_group, f"{where}.group_size"
            ),
            mode=layer_mode,
        )
    return QuantConfig(bits, group, mode, out)
