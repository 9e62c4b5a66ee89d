"""The body of ``POST /v1/audio/speech``: OpenAI's fields, checked and resolved.

Extensions to OpenAI's body: ``seed`` (integer: fixes the flow-matching noise, so the same
request gives the same audio). ``model`` is accepted and ignored (any string: the server
speaks with the model it loaded and never downloads one); so is ``instructions`` (the model
takes no style instructions).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from ..audio.stretch import MAX_SPEED, MIN_SPEED
from ..fileio import one_line
from ..segment import is_blank
from ..voices import case_matches
from .errors import bad_request, shown
from .formats import FORMATS, UNSUPPORTED_FORMATS

# OpenAI's voice names onto this model's English voices (gender as OpenAI presents them).
OPENAI_VOICES: dict[str, str] = {
    "alloy": "neutral_female",
    "ash": "casual_male",
    "ballad": "neutral_male",
    "cedar": "neutral_male",
    "coral": "cheerful_female",
    "echo": "neutral_male",
    "fable": "casual_male",
    "marin": "casual_female",
    "nova": "cheerful_female",
    "onyx": "neutral_male",
    "sage": "casual_female",
    "shimmer": "neutral_female",
    "verse": "casual_male",
}
FIELDS = (
    "model",
    "input",
    "voice",
    "instructions",
    "response_format",
    "speed",
    "stream_format",
    "seed",
)
STREAM_FORMATS = ("audio", "sse")
MAX_SEED = 2**62  # segment i of a split text uses seed + i


@dataclass(frozen=True)
class SpeechRequest:
    input: str
    voice: str  # one of the model's voices (OpenAI names resolved)
    response_format: str
    speed: float
    stream_format: str
    seed: int | None
    model: str | None


def voice_aliases(voices: Mapping[str, Any]) -> dict[str, str]:
    """OpenAI voice name -> the model's voice, for the targets this model has (a voice
    of the model's own with the same name wins)."""
    return {
        alias: target
        for alias, target in OPENAI_VOICES.items()
        if target in voices and alias not in voices
    }


def resolve_voice(
    value: Any,
    voices: Mapping[str, Any],
    default: str | None,
    offered: Collection[str] | None = None,
) -> str:
    """The voice ``value`` names among ``voices`` (an OpenAI alias too; case ignored where
    unambiguous); an unknown one's error lists ``offered`` (default: all of ``voices``)."""
    if value is None:
        if default is None:
            raise bad_request(
                "voice is required: this server's model has no default voice; name one "
                "(GET /v1/audio/voices lists them)",
                "voice",
            )
        return default
    if isinstance(value, dict) and set(value) == {"id"}:
        value = value["id"]
    if not isinstance(value, str):
        raise bad_request("voice must be a voice name (a string)", "voice")
    if value in voices:
        return value
    aliases = voice_aliases(voices)
    if value in aliases:
        return aliases[value]
    # As the CLI's -v: a name equal to exactly one voice or alias but for case is that one.
    folded = set(case_matches(value, [*((v, v) for v in voices), *aliases.items()]))
    if len(folded) == 1:
        return folded.pop()
    if folded:
        raise bad_request(
            f"voice {shown(value)} is ambiguous: it matches {', '.join(sorted(folded))} but "
            "for case; give the exact name",
            "voice",
        )
    listed = voices if offered is None else offered
    names = ", ".join([*listed, *(a for a, target in aliases.items() if target in listed)])
    raise bad_request(
        f"unknown voice {shown(value)}; available voices: {names} "
        "(GET /v1/audio/voices lists them)",
        "voice",
    )


def _text(body: dict, max_chars: int) -> str:
    if "input" not in body or body["input"] is None:
        raise bad_request("input is required: the text to speak", "input")
    text = body["input"]
    if not isinstance(text, str):
        raise bad_request(f"input must be a string, got {_json_type(text)}", "input")
    if is_blank(text):
        raise bad_request("input is empty: give some text to speak", "input")
    if len(text) > max_chars:
        raise bad_request(
            f"input is too long ({len(text)} characters, this server's limit is {max_chars}): "
            "split it into several requests",
            "input",
            "string_above_max_length",
        )
    return text


def _choice(body: dict, name: str, default: str, allowed: tuple[str, ...]) -> str:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, str) and value in allowed:
        return value
    if name == "response_format" and isinstance(value, str) and value in UNSUPPORTED_FORMATS:
        raise bad_request(
            f"response_format {shown(value)} is not supported by this server; use one of "
            f"{', '.join(allowed)}",
            name,
        )
    raise bad_request(f"unknown {name} {shown(value)}; use one of {', '.join(allowed)}", name)


def _speed(body: dict) -> float:
    value = body.get("speed")
    if value is None:
        return 1.0
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    # Compared, never converted first: float() of a 400-digit integer raises OverflowError;
    # NaN fails the comparison.
    if not ok or not MIN_SPEED <= value <= MAX_SPEED:
        raise bad_request(
            f"speed must be a number from {MIN_SPEED} to {MAX_SPEED}, got {shown(value)}",
            "speed",
        )
    return float(value)


def _seed(body: dict) -> int | None:
    value = body.get("seed")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_SEED:
        raise bad_request(
            f"seed must be an integer from 0 to 2**62 - 1, got {shown(value)}", "seed"
        )
    return value


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, dict):
        return "an object"
    return "a string" if isinstance(value, str) else "an array"


def parse_speech_request(
    body: Any,
    voices: Mapping[str, Any],
    default_voice: str | None,
    max_chars: int,
    offered: Collection[str] | None = None,
) -> SpeechRequest:
    """Check a decoded JSON body; :class:`APIError` (400) names the first problem (an
    unknown voice's lists the ``offered`` ones: see :func:`resolve_voice`)."""
    if not isinstance(body, dict):
        raise bad_request(
            f"the request body must be a JSON object ({{...}}), got {_json_type(body)}: send "
            '{"input": "...", "voice": "..."}'
        )
    unknown = [k for k in body if k not in FIELDS]
    if unknown:
        name = one_line(unknown[0], 60)
        raise bad_request(
            f"unrecognized request argument supplied: {name} (accepted: {', '.join(FIELDS)})",
            name,
        )
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("model must be a string (a model id, or leave it out)", "model")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request(
            "instructions must be a string (or leave it out: this model ignores it)", "instructions"
        )
    return SpeechRequest(
        input=_text(body, max_chars),
        voice=resolve_voice(body.get("voice"), voices, default_voice, offered),
        response_format=_choice(body, "response_format", "mp3", tuple(FORMATS)),
        speed=_speed(body),
        stream_format=_choice(body, "stream_format", "audio", STREAM_FORMATS),
        seed=_seed(body),
        model=model,
    )
