"""Typed model configuration, read from Mistral's ``params.json``.

The published file nests the flow-matching head under
``multimodal.audio_model_args.acoustic_transformer_args`` and the codec under
``multimodal.audio_tokenizer_args``; the codec's stage lists are comma-separated
strings (``"2,2,2,2"``). Unknown keys are ignored, missing required keys and
inconsistent values raise :class:`ConfigError` naming the key.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .fileio import MAX_JSON_BYTES, one_line, read_limited, unreadable_fix

N_SPECIAL_AUDIO_CODES = 2  # 0 = EMPTY_AUDIO, 1 = END_AUDIO; real codes start at 2
END_AUDIO = 1
EMPTY_AUDIO = 0

# Far above any real model, low enough that a hostile params.json cannot make the checks
# themselves slow: every layer adds a dozen expected tensors before a single one is read.
MAX_INT = 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38
MIN_SAMPLE_RATE, MAX_SAMPLE_RATE = 1000, 768_000
MAX_LAYERS = 1024
MAX_CODEC_STAGES = 32
MAX_CODEBOOKS = 1024
# These size buffers made at load or per stream (the release has 7 and 16), not tensors a
# shape check would catch: a huge value must be an error, not a crash allocating it.
MAX_DECODING_STEPS = 1024
MAX_WINDOW = 4096


def pad_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class _Reader:
    """Reads typed values out of one JSON object, naming the full key path in errors."""

    def __init__(self, data: Any, path: str, source: str):
        if not isinstance(data, Mapping):
            where = f"{source} key '{path}'" if path else source
            raise ConfigError(f"{where} must be a JSON object, got {type(data).__name__}")
        self.data = data
        self.path = path
        self.source = source  # the file, for messages

    def _name(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def section(self, key: str) -> _Reader:
        if key not in self.data:
            raise ConfigError(f"{self.source} is missing required key '{self._name(key)}'")
        return _Reader(self.data[key], self._name(key), self.source)

    def get(
        self,
        key: str,
        kind: type,
        default: Any = ...,
        *,
        positive: bool = False,
        maximum: int = MAX_INT,
    ) -> Any:
        if key not in self.data:
            if default is ...:
                raise ConfigError(f"{self.source} is missing required key '{self._name(key)}'")
            return default
        value = self.data[key]
        where = f"{self.source} key '{self._name(key)}'"
        if kind is bool:
            if not isinstance(value, bool):
                raise ConfigError(f"{where} must be true or false, got {one_line(repr(value), 60)}")
        elif kind is int:
            if isinstance(value, bool) or not isinstance(value, int):
                if isinstance(value, float) and value.is_integer():
                    value = int(value)
                else:
                    shown = one_line(repr(value), 60)
                    raise ConfigError(f"{where} must be an integer, got {shown}")
            lowest = 1 if positive else -MAX_INT
            if not lowest <= value <= maximum:
                raise ConfigError(
                    f"{where} must be between {lowest} and {maximum}, got {_short(value)}"
                )
        elif kind is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"{where} must be a number, got {one_line(repr(value), 60)}")
            value = float(value)
            if not math.isfinite(value):
                raise ConfigError(f"{where} must be finite, got {one_line(repr(value), 60)}")
            if abs(value) > FLOAT32_MAX:  # computed in float32 (or less): it would be inf
                raise ConfigError(
                    f"{where} must lie within float32's range (+-3.4e38), got {_short(value)}"
                )
        elif kind is str and not isinstance(value, str):
            raise ConfigError(f"{where} must be a string, got {one_line(repr(value), 60)}")
        if positive and not value > 0:
            raise ConfigError(f"{where} must be positive, got {one_line(repr(value), 60)}")
        return value

    def only(self, key: str, kind: type, value: Any, why: str) -> None:
        """Refuse any value of ``key`` but ``value`` (also its default): one that selects a
        variant of the model this code does not implement."""
        got = self.get(key, kind, value)
        if got != value:
            raise ConfigError(
                f"{self.source} key '{self._name(key)}' is {_json(got)}, not {_json(value)}: {why}"
            )

    def int_list(
        self, key: str, maximum: int = MAX_INT, default: Any = ...
    ) -> tuple[int, ...] | Any:
        """A comma-separated list of positive integers stored as a string ("2,2,2,2")."""
        if key not in self.data and default is not ...:
            return default
        raw = self.get(key, str)
        where = f"{self.source} key '{self._name(key)}'"
        parts = raw.split(",")
        if len(parts) > MAX_CODEC_STAGES:
            raise ConfigError(
                f"{where} lists {len(parts)} values, more than the {MAX_CODEC_STAGES} supported"
            )
        try:
            values = tuple(int(part) for part in parts)
        except ValueError:
            raise ConfigError(
                f'{where} must be comma-separated integers like "2,2,2,2", got {_short(raw)}'
            ) from None
        if not values or any(v <= 0 for v in values):
            raise ConfigError(f"{where} must list positive integers, got {_short(raw)}")
        if any(v > maximum for v in values):
            raise ConfigError(f"{where} is out of range: every value must be at most {maximum}")
        return values


def _json(value: Any) -> str:
    """``value`` as the JSON file spells it (true, not True), shortened."""
    return _short(value) if not isinstance(value, bool) else str(value).lower()


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class _Inconsistent(Exception):
    def __init__(self, key: str, message: str):
        self.key, self.message = key, message


FLOW_NORM_EPS = 1e-5  # the flow head's RMSNorm epsilon when params.json gives none


def _require(condition: bool, key: str, message: str) -> None:
    if not condition:
        raise _Inconsistent(key, message)


@dataclass(frozen=True)
class BackboneArgs:
    """The 26-layer Mistral decoder (top level of params.json)."""

    dim: int
    n_layers: int
    head_dim: int
    hidden_dim: int
    n_heads: int
    n_kv_heads: int
    rope_theta: float
    norm_eps: float
    vocab_size: int


@dataclass(frozen=True)
class FlowArgs:
    """Semantic head + flow-matching acoustic transformer (``acoustic_transformer``)."""

    input_dim: int
    dim: int
    n_layers: int
    head_dim: int
    hidden_dim: int
    n_heads: int
    n_kv_heads: int
    norm_eps: float
    sigma_max: float  # read and checked, but unused: Mistral's flow starts from plain noise
    n_decoding_steps: int
    semantic_codebook_size: int
    acoustic_codebook_size: int
    n_acoustic_codebook: int

    @property
    def semantic_output_rows(self) -> int:
        """Rows of ``semantic_codebook_output`` written by Mistral: size + 2 specials, padded."""
        return pad_to(self.semantic_codebook_size + N_SPECIAL_AUDIO_CODES, 128)


@dataclass(frozen=True)
class CodecArgs:
    """The codec decoder (``audio_tokenizer``)."""

    dim: int
    hidden_dim: int
    head_dim: int
    n_heads: int
    n_kv_heads: int
    norm_eps: float
    qk_norm_eps: float
    qk_norm: bool
    layer_scale: bool
    attn_sliding_window_size: int
    half_attn_window_upon_downsampling: bool
    patch_size: int
    patch_proj_kernel_size: int
    semantic_codebook_size: int
    semantic_dim: int
    acoustic_codebook_size: int
    acoustic_dim: int
    transformer_lengths: tuple[int, ...]
    conv_kernels: tuple[int, ...]
    conv_strides: tuple[int, ...]
    sampling_rate: int
    # The (unshipped) encoder's convs: only the attention windows depend on them. None:
    # the decoder's mirrored, which is what Mistral's defaults are for the real codec.
    encoder_conv_kernels: tuple[int, ...] | None = None
    encoder_conv_strides: tuple[int, ...] | None = None

    @property
    def n_stages(self) -> int:
        return len(self.conv_strides)

    @property
    def codebook_dim(self) -> int:
        return self.semantic_dim + self.acoustic_dim

    @property
    def upsample(self) -> int:
        return math.prod(self.conv_strides)

    @property
    def samples_per_frame(self) -> int:
        return self.upsample * self.patch_size

    @property
    def first_chunk_frames(self) -> int:
        """Fewest frames a stream's first codec chunk must hold to decode exactly as one
        shot: its output conv's start padding mirrors ``patch_proj_kernel_size - 1`` steps
        (1 for the release: a frame gives 8 steps, the kernel is 7)."""
        return -(-self.patch_proj_kernel_size // self.upsample)

    @property
    def windows(self) -> tuple[int, ...]:
        """Causal attention window of each decoder stage (2, 4, 8, 16 for the real codec).

        As Mistral's codec builds them: with ``half_attn_window_upon_downsampling`` the
        configured window is halved (rounding down) at every downsampling conv of the
        encoder, then doubled at every upsampling conv of the decoder. A window that does
        not divide by two that often ends smaller than configured (20 gives 2, 4, 8, 16).
        """
        kernels = self.encoder_conv_kernels or self.conv_kernels[::-1]
        strides = self.encoder_conv_strides or self.conv_strides[::-1]
        half = self.half_attn_window_upon_downsampling
        w = self.attn_sliding_window_size
        for i, (k, st) in enumerate(zip(kernels, strides)):
            has_conv = k != 1 or st != 1 or i == len(strides) - 1
            if half and has_conv and st > 1:
                w = max(1, w // 2)
        out = []
        for s in range(self.n_stages):
            out.append(w)
            if half and s + 1 < self.n_stages and self.conv_strides[s + 1] > 1:
                w *= 2
        return tuple(out)


@dataclass(frozen=True)
class ModelConfig:
    """Everything the model needs from ``params.json``."""

    backbone: BackboneArgs
    flow: FlowArgs
    codec: CodecArgs
    sampling_rate: int
    frame_rate: float
    num_codebooks: int
    bos_token_id: int
    audio_token_id: int
    begin_audio_token_id: int
    voice_index: dict[str, int] = field(default_factory=dict)
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def samples_per_frame(self) -> int:
        return self.codec.samples_per_frame

    @property
    def audio_embedding_rows(self) -> int:
        """Rows the 37 offset codebooks need in ``audio_codebook_embeddings`` (before padding)."""
        f = self.flow
        return (f.semantic_codebook_size + N_SPECIAL_AUDIO_CODES) + f.n_acoustic_codebook * (
            f.acoustic_codebook_size + N_SPECIAL_AUDIO_CODES
        )

    @property
    def codebook_offsets(self) -> tuple[int, ...]:
        """Offset of each of the 37 codebooks in the shared embedding table."""
        f = self.flow
        sem = f.semantic_codebook_size + N_SPECIAL_AUDIO_CODES
        ac = f.acoustic_codebook_size + N_SPECIAL_AUDIO_CODES
        return (0, *(sem + k * ac for k in range(f.n_acoustic_codebook)))

    @classmethod
    def from_params(cls, params: Mapping[str, Any], source: str = "params.json") -> ModelConfig:
        """Build the config from a parsed ``params.json`` (Mistral layout); ``source`` names
        the file in error messages (``config.json`` holds the same keys in MLX layouts)."""
        try:
            return cls._from_params(params, source)
        except ConfigError as e:
            if ";" in str(e):  # it names its fix
                raise
            raise ConfigError(
                f"{e}; restore {source} from the model's download (or correct that value)"
            ) from None

    @classmethod
    def _from_params(cls, params: Mapping[str, Any], source: str) -> ModelConfig:
        top = _Reader(params, "", source)
        backbone = BackboneArgs(
            dim=top.get("dim", int, positive=True),
            n_layers=top.get("n_layers", int, positive=True, maximum=MAX_LAYERS),
            head_dim=top.get("head_dim", int, positive=True),
            hidden_dim=top.get("hidden_dim", int, positive=True),
            n_heads=top.get("n_heads", int, positive=True),
            n_kv_heads=top.get("n_kv_heads", int, positive=True),
            rope_theta=top.get("rope_theta", float, positive=True),
            norm_eps=top.get("norm_eps", float, positive=True),
            vocab_size=top.get("vocab_size", int, positive=True),
        )
        top.only("use_biases", bool, False, "Voxtral TTS has no biases")
        top.only("causal", bool, True, "Voxtral TTS's backbone is causal")

        mm = top.section("multimodal")
        audio = mm.section("audio_model_args")
        enc = audio.section("audio_encoding_args")
        at = audio.section("acoustic_transformer_args")
        codec_r = mm.section("audio_tokenizer_args")
        audio.only(
            "input_embedding_concat_type",
            str,
            "sum",
            "Voxtral TTS sums a frame's code embeddings and that is what is implemented",
        )
        enc.only(
            "codebook_pattern",
            str,
            "parallel",
            "Voxtral TTS generates a frame's 37 codes together and that is what is implemented",
        )
        codec_r.only("causal", bool, True, "Voxtral TTS's codec decoder is causal")

        flow = FlowArgs(
            input_dim=at.get("input_dim", int, backbone.dim, positive=True),
            dim=at.get("dim", int, positive=True),
            n_layers=at.get("n_layers", int, positive=True, maximum=MAX_LAYERS),
            head_dim=at.get("head_dim", int, positive=True),
            hidden_dim=at.get("hidden_dim", int, positive=True),
            n_heads=at.get("n_heads", int, positive=True),
            n_kv_heads=at.get("n_kv_heads", int, positive=True),
            # Mistral's AcousticTransformerArgs default, not the backbone's norm_eps
            norm_eps=at.get("norm_eps", float, FLOW_NORM_EPS, positive=True),
            sigma_max=at.get("sigma_max", float, 1.0, positive=True),
            n_decoding_steps=at.get(
                "n_decoding_steps", int, 7, positive=True, maximum=MAX_DECODING_STEPS
            ),
            semantic_codebook_size=audio.get("semantic_codebook_size", int, positive=True),
            acoustic_codebook_size=audio.get("acoustic_codebook_size", int, positive=True),
            n_acoustic_codebook=audio.get(
                "n_acoustic_codebook", int, positive=True, maximum=MAX_CODEBOOKS
            ),
        )
        at.only("use_biases", bool, False, "Voxtral TTS has no biases")

        codec = CodecArgs(
            dim=codec_r.get("dim", int, positive=True),
            hidden_dim=codec_r.get("hidden_dim", int, positive=True),
            head_dim=codec_r.get("head_dim", int, positive=True),
            n_heads=codec_r.get("n_heads", int, positive=True),
            n_kv_heads=codec_r.get("n_kv_heads", int, positive=True),
            norm_eps=codec_r.get("norm_eps", float, positive=True),
            qk_norm_eps=codec_r.get("qk_norm_eps", float, 1e-6, positive=True),
            qk_norm=codec_r.get("qk_norm", bool, True),
            layer_scale=codec_r.get("layer_scale", bool, True),
            attn_sliding_window_size=codec_r.get(
                "attn_sliding_window_size", int, positive=True, maximum=MAX_WINDOW
            ),
            half_attn_window_upon_downsampling=codec_r.get(
                "half_attn_window_upon_downsampling", bool, True
            ),
            patch_size=codec_r.get("pretransform_patch_size", int, positive=True),
            patch_proj_kernel_size=codec_r.get("patch_proj_kernel_size", int, positive=True),
            semantic_codebook_size=codec_r.get("semantic_codebook_size", int, positive=True),
            semantic_dim=codec_r.get("semantic_dim", int, positive=True),
            acoustic_codebook_size=codec_r.get("acoustic_codebook_size", int, positive=True),
            acoustic_dim=codec_r.get("acoustic_dim", int, positive=True),
            transformer_lengths=codec_r.int_list(
                "decoder_transformer_lengths_str", maximum=MAX_LAYERS
            ),
            conv_kernels=codec_r.int_list("decoder_convs_kernels_str"),
            conv_strides=codec_r.int_list("decoder_convs_strides_str"),
            sampling_rate=codec_r.get("sampling_rate", int, positive=True),
            encoder_conv_kernels=codec_r.int_list("encoder_convs_kernels_str", default=None),
            encoder_conv_strides=codec_r.int_list("encoder_convs_strides_str", default=None),
        )
        codec_r.only("use_biases", bool, False, "Voxtral TTS has no biases")
        codec_r.only("channels", int, 1, "Voxtral TTS's codec is mono")

        voice_index = {}
        raw_voice = codec_r.data.get("voice", {})
        if isinstance(raw_voice, Mapping):
            voice_index = {str(k): v for k, v in raw_voice.items() if type(v) is int and v >= 0}

        config = cls(
            backbone=backbone,
            flow=flow,
            codec=codec,
            sampling_rate=enc.get("sampling_rate", int, positive=True),
            frame_rate=enc.get("frame_rate", float, positive=True),
            num_codebooks=enc.get("num_codebooks", int, positive=True),
            bos_token_id=mm.get("bos_token_id", int, 1),
            audio_token_id=audio.get("audio_token_id", int),
            begin_audio_token_id=audio.get("begin_audio_token_id", int),
            voice_index=voice_index,
            raw=dict(params),
        )
        try:
            config._check()
        except _Inconsistent as e:
            raise ConfigError(f"{source} key '{e.key}' is inconsistent: {e.message}") from None
        return config

    def _check(self) -> None:
        # dim need not be n_heads * head_dim nor a multiple of n_heads (the real backbone has
        # 32 x 128 = 4096 query channels on a 3072 stream): wq/wo carry the width.
        b, f, c = self.backbone, self.flow, self.codec
        at = "multimodal.audio_model_args.acoustic_transformer_args"
        tok = "multimodal.audio_tokenizer_args"
        enc = "multimodal.audio_model_args.audio_encoding_args"
        _require(
            b.n_heads % b.n_kv_heads == 0,
            "n_kv_heads",
            f"n_heads {b.n_heads} is not a multiple of n_kv_heads {b.n_kv_heads}",
        )
        _require(b.head_dim % 2 == 0, "head_dim", f"RoPE needs an even head_dim, got {b.head_dim}")
        _require(
            f.input_dim == b.dim,
            f"{at}.input_dim",
            f"input_dim {f.input_dim} must equal the backbone dim {b.dim}",
        )
        _require(
            f.dim == f.input_dim,
            f"{at}.dim",
            f"dim {f.dim} must equal input_dim {f.input_dim}: the semantic head reads the "
            "backbone's hidden state",
        )
        _require(
            f.n_heads % f.n_kv_heads == 0,
            f"{at}.n_kv_heads",
            f"n_heads {f.n_heads} is not a multiple of n_kv_heads {f.n_kv_heads}",
        )
        _require(f.dim % 2 == 0, f"{at}.dim", f"the time embedding needs an even dim, got {f.dim}")
        _require(
            c.n_heads % c.n_kv_heads == 0,
            f"{tok}.n_kv_heads",
            f"n_heads {c.n_heads} is not a multiple of n_kv_heads {c.n_kv_heads}",
        )
        _require(
            c.qk_norm and c.layer_scale,
            f"{tok}.qk_norm",
            "the Voxtral codec decoder uses qk_norm and layer_scale; both must be true",
        )
        n = c.n_stages
        _require(
            len(c.conv_kernels) == n and len(c.transformer_lengths) == n,
            f"{tok}.decoder_convs_kernels_str",
            "decoder_transformer_lengths_str, decoder_convs_kernels_str and "
            "decoder_convs_strides_str must have the same length, got "
            f"{len(c.transformer_lengths)}, "
            f"{len(c.conv_kernels)} and {n}",
        )
        for s, (k, st) in enumerate(zip(c.conv_kernels, c.conv_strides)):
            _require(
                k >= st,
                f"{tok}.decoder_convs_kernels_str",
                f"stage {s}: kernel {k} is smaller than its stride {st}",
            )
        # Mistral's decoder opens with a plain (downsampling if strided) Conv1d, and builds
        # no conv at all for a later stage of kernel 1 and stride 1 (renumbering the blocks).
        _require(
            c.conv_strides[0] == 1,
            f"{tok}.decoder_convs_strides_str",
            f"the first stride must be 1 (the decoder's first conv does not upsample), got "
            f"{c.conv_strides[0]}",
        )
        for s in range(1, n):
            _require(
                (c.conv_kernels[s], c.conv_strides[s]) != (1, 1),
                f"{tok}.decoder_convs_kernels_str",
                f"stage {s} has kernel 1 and stride 1, for which Mistral's codec has no conv "
                "(voxtral_mlx does not support that layout)",
            )
        ek, es = c.encoder_conv_kernels, c.encoder_conv_strides
        if ek is not None and es is not None:
            _require(
                len(ek) == len(es),
                f"{tok}.encoder_convs_kernels_str",
                "encoder_convs_kernels_str and encoder_convs_strides_str must have the same "
                f"length, got {len(ek)} and {len(es)}",
            )
        if es is not None:
            _require(
                math.prod(es) == c.upsample,
                f"{tok}.encoder_convs_strides_str",
                f"the encoder downsamples x{math.prod(es)} but the decoder upsamples "
                f"x{c.upsample}; they must match",
            )
        _require(
            f.semantic_codebook_size == c.semantic_codebook_size,
            f"{tok}.semantic_codebook_size",
            f"{c.semantic_codebook_size} differs from audio_model_args.semantic_codebook_size "
            f"{f.semantic_codebook_size}",
        )
        _require(
            f.acoustic_codebook_size == c.acoustic_codebook_size,
            f"{tok}.acoustic_codebook_size",
            f"{c.acoustic_codebook_size} differs from audio_model_args.acoustic_codebook_size "
            f"{f.acoustic_codebook_size}",
        )
        _require(
            f.acoustic_codebook_size >= 2,
            "multimodal.audio_model_args.acoustic_codebook_size",
            f"FSQ needs at least 2 levels, got {f.acoustic_codebook_size}",
        )
        _require(
            f.n_acoustic_codebook == c.acoustic_dim,
            f"{tok}.acoustic_dim",
            f"acoustic_dim {c.acoustic_dim} must equal n_acoustic_codebook {f.n_acoustic_codebook}",
        )
        _require(
            self.num_codebooks == 1 + f.n_acoustic_codebook,
            f"{enc}.num_codebooks",
            f"num_codebooks {self.num_codebooks} must be 1 + n_acoustic_codebook "
            f"({1 + f.n_acoustic_codebook})",
        )
        _require(
            c.sampling_rate == self.sampling_rate,
            f"{tok}.sampling_rate",
            f"{c.sampling_rate} differs from audio_encoding_args.sampling_rate "
            f"{self.sampling_rate}",
        )
        _require(
            MIN_SAMPLE_RATE <= self.sampling_rate <= MAX_SAMPLE_RATE,
            f"{enc}.sampling_rate",
            f"{self.sampling_rate} Hz is no audio rate (Voxtral's is 24000; audio files and "
            f"devices take {MIN_SAMPLE_RATE} to {MAX_SAMPLE_RATE})",
        )
        per_frame = self.sampling_rate / self.frame_rate
        _require(
            c.samples_per_frame <= 2**53 and math.isclose(per_frame, c.samples_per_frame),
            f"{enc}.frame_rate",
            f"sampling_rate / frame_rate = {per_frame:g} samples per frame, but the codec "
            f"produces pretransform_patch_size x strides = {c.samples_per_frame}",
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            # utf-8-sig: a byte-order mark left by a Windows editor is not an error.
            text = read_limited(path, MAX_JSON_BYTES).decode("utf-8-sig")
        except FileNotFoundError:
            raise ConfigError(f"{path} not found: the model directory needs params.json") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{path} is not UTF-8 text: re-download the model") from None
        except OSError as e:
            fix = unreadable_fix(e, "restore it from the model's download")
            raise ConfigError(f"cannot read {path}: {e.strerror}; {fix}") from None
        try:
            params = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(
                f"{path} is not valid JSON (line {e.lineno}, column {e.colno}): "
                "re-download the model"
            ) from None
        except (ValueError, RecursionError):  # a 5000-digit number, arrays nested 10^5 deep
            raise ConfigError(
                f"{path} is not a usable params.json (absurdly long numbers or nesting): "
                "re-download the model"
            ) from None
        return cls.from_params(params, str(path))
