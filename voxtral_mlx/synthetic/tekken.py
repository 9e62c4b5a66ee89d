"""Builds ``tekken.json`` files in the published Voxtral TTS layout (tests, random checkpoints).

The layout: ``config`` (tiktoken pattern, vocab sizes, version ``v7``), ``vocab`` (rank,
base64 bytes, display string), 1000 ``special_tokens`` and an ``audio`` section with the
per-voice ``[AUDIO]`` counts. The BPE vocab comes from an existing tekken.json (by default
the one mistral-common ships, whose vocab and pattern equal the TTS model's) or is the
minimal byte-level vocab of the 256 single bytes.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import InputError, TokenizerError
from ..fileio import atomic_write_text

NUM_SPECIAL_TOKENS = 1000

# Tekken's pre-tokenizer regex (identical in mistral-common's tekken_240911.json and the TTS file).
TEKKEN_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Ranks 0-19 are mistral-common's standard control tokens (its Tekkenizer's defaults);
# 24, 25, 35, 36 are the real TTS tokenizer's audio ids; 34 [TRANSCRIBE] follows
# mistral-common's audio layout (34-36) and its V7 instruct tokenizer requires it for audio.
# Everything else is a <SPECIAL_i> filler.
_NAMED_SPECIALS = {
    0: "<unk>",
    1: "<s>",
    2: "</s>",
    3: "[INST]",
    4: "[/INST]",
    5: "[AVAILABLE_TOOLS]",
    6: "[/AVAILABLE_TOOLS]",
    7: "[TOOL_RESULTS]",
    8: "[/TOOL_RESULTS]",
    9: "[TOOL_CALLS]",
    10: "[IMG]",
    11: "<pad>",
    12: "[IMG_BREAK]",
    13: "[IMG_END]",
    14: "[PREFIX]",
    15: "[MIDDLE]",
    16: "[SUFFIX]",
    17: "[SYSTEM_PROMPT]",
    18: "[/SYSTEM_PROMPT]",
    19: "[TOOL_CONTENT]",
    24: "[AUDIO]",
    25: "[BEGIN_AUDIO]",
    34: "[TRANSCRIBE]",
    35: "[REPEAT_AUDIO_TEXT]",
    36: "[NEXT_AUDIO_TEXT]",
}

AUDIO_ENCODING_CONFIG = {"num_mel_bins": 128, "hop_length": 160, "window_size": 400}


def special_tokens() -> list[dict[str, Any]]:
    """The 1000 special-token entries of the TTS tokenizer layout."""
    return [
        {"rank": i, "token_str": _NAMED_SPECIALS.get(i, f"<SPECIAL_{i}>"), "is_control": True}
        for i in range(NUM_SPECIAL_TOKENS)
    ]


def byte_vocab() -> list[dict[str, Any]]:
    """The 256 single-byte tokens, rank = byte value (``token_str`` null where not UTF-8)."""
    return [
        {
            "rank": b,
            "token_bytes": base64.b64encode(bytes([b])).decode("ascii"),
            "token_str": chr(b) if b < 0x80 else None,
        }
        for b in range(256)
    ]


def mistral_common_tekken_path() -> Path | None:
    """mistral-common's ``data/tekken_240911.json`` if that package is installed (not imported)."""
    try:
        spec = importlib.util.find_spec("mistral_common")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        candidate = Path(root) / "data" / "tekken_240911.json"
        if candidate.is_file():
            return candidate
    return None


def _load_source(path: str | Path) -> tuple[str, list[dict[str, Any]], int | None]:
    """(pattern, vocab, text vocab size) of an existing tekken.json."""
    path = Path(path)
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise TokenizerError(f"vocab source {path} not found") from None
    except (OSError, ValueError) as e:
        raise TokenizerError(f"vocab source {path} is not a readable JSON file ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("config"), dict):
        raise TokenizerError(f"vocab source {path} is not a tekken.json (no 'config' object)")
    config = data["config"]
    vocab = data.get("vocab")
    if not isinstance(config.get("pattern"), str) or not isinstance(vocab, list):
        raise TokenizerError(f"vocab source {path} lacks config.pattern or the vocab list")
    try:
        n_text = int(config["default_vocab_size"]) - int(config["default_num_special_tokens"])
    except (KeyError, TypeError, ValueError):
        n_text = None
    return config["pattern"], vocab, n_text


def build_tekken(
    voice_num_audio_tokens: Mapping[str, int],
    vocab_source: str | Path | None = "auto",
    n_vocab: int | None = None,
) -> dict[str, Any]:
    """A tekken.json dict in the published TTS layout.

    ``vocab_source``: path of a tekken.json to take ``config.pattern`` and ``vocab`` from;
    ``"auto"``: mistral-common's ``tekken_240911.json`` if installed, else the 256-byte
    vocab; ``None``: always the 256-byte vocab. ``n_vocab`` keeps only the first ``n_vocab``
    BPE ranks (``default_vocab_size`` = 1000 + text vocab size).
    """
    voices: dict[str, int] = {}
    for name, count in dict(voice_num_audio_tokens).items():
        if not isinstance(name, str) or isinstance(count, bool) or not isinstance(count, int):
            raise InputError(f"voice counts must map names to ints, got {name!r}: {count!r}")
        if count < 0:
            raise InputError(f"voice {name} has a negative [AUDIO] count {count}")
        voices[name] = count

    source: str | Path | None = vocab_source
    if source is not None and not isinstance(source, (str, os.PathLike)):
        raise InputError(
            f"vocab_source must be a tekken.json path, 'auto' or None, got {type(source).__name__}"
        )
    if isinstance(source, str) and source == "auto":
        source = mistral_common_tekken_path()
    if source is None:
        pattern, vocab, n_text = TEKKEN_PATTERN, byte_vocab(), 256
    else:
        pattern, vocab, n_text = _load_source(source)
        if n_text is None or n_text > len(vocab):
            n_text = len(vocab)

    if n_vocab is not None:
        if isinstance(n_vocab, bool) or not isinstance(n_vocab, int):
            raise InputError(f"n_vocab must be an int, got {n_vocab!r}")
        if not 256 <= n_vocab <= len(vocab):
            raise InputError(
                f"n_vocab must be between 256 (the byte tokens) and {len(vocab)}, got {n_vocab}"
            )
        vocab = vocab[:n_vocab]
        n_text = n_vocab

    return {
        "config": {
            "pattern": pattern,
            "num_vocab_tokens": len(vocab),
            "default_vocab_size": NUM_SPECIAL_TOKENS + n_text,
            "default_num_special_tokens": NUM_SPECIAL_TOKENS,
            "version": "v7",
        },
        "vocab": vocab,
        "special_tokens": special_tokens(),
        "audio": {
            "sampling_rate": 24000,
            "frame_rate": 12.5,
            "voice_num_audio_tokens": voices,
            "audio_encoding_config": dict(AUDIO_ENCODING_CONFIG),
            "chunk_length_s": 30.0,  # in the released file (read by its audio encoder only)
        },
    }


def write_tekken(path: str | Path, data: Mapping[str, Any]) -> Path:
    """Write ``data`` as JSON to ``path`` atomically (temp file in the same folder, then rename),
    indented as the released file is (14.9 MB: what loading it is timed on)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(data, ensure_ascii=False, indent=2) + "\n")
    return path
