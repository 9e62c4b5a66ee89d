"""Errors raised by voxtral_mlx.

Every message is one line that names the problem and, where there is one, the fix;
the CLI prints it as is.
"""

from __future__ import annotations

import re


def printable(text: str) -> str:
    """``text`` with its unprintable characters (newlines, terminal escapes) escaped: one
    line whatever a path or name in a message holds."""
    if text.isprintable():
        return text
    return "".join(
        c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text
    )


class VoxtralError(Exception):
    """Base class of every error voxtral_mlx raises on purpose."""

    def __str__(self) -> str:
        return printable(super().__str__())


class ConfigError(VoxtralError, ValueError):
    """params.json / config.json is missing a key or holds an inconsistent value."""


class CheckpointError(VoxtralError):
    """The weights file is missing, truncated, malformed or does not match the config."""


class ModelNotFoundError(VoxtralError, FileNotFoundError):
    """A model directory or Hub repo could not be found or is incomplete."""


class TokenizerError(VoxtralError, ValueError):
    """tekken.json is missing or malformed."""


class VoiceError(VoxtralError, ValueError):
    """Unknown voice or a voice file that does not fit the model."""


class UnsafePickleError(VoxtralError):
    """A .pt file asked for something other than a plain tensor: refused unexecuted."""


class InputError(VoxtralError, ValueError):
    """Bad request input: empty or oversized text, bad arguments."""


class UsageError(VoxtralError, RuntimeError):
    """A call the object cannot serve in its state: a model that was closed, a blocking
    request made on the model's own worker thread, a stream read by a second reader at
    once or read again after an error stopped it, an async stream continued on another
    event loop or after a cancelled wait for its next chunk, a ``say()`` handle waited on
    from its own player's callbacks."""


class AudioOutputError(VoxtralError):
    """No audio device, no PortAudio library, or an output file that cannot be written."""


class AudioStoppedError(AudioOutputError):
    """Output stopped partway for a reason outside the audio (a device, a format limit):
    what was written before it stays valid and can be kept."""

    def __init__(self, problem: str, fix: str | None = None) -> None:
        super().__init__(problem if fix is None else f"{problem}; {fix}")
        # What happened and its fix apart, for a caller that words the message its own way.
        self.problem, self.fix = problem, fix or ""


class AudioDeviceError(AudioStoppedError):
    """The output device failed while playing (unplugged, stopped taking audio)."""


class AudioFileFullError(AudioStoppedError):
    """An output file reached the most its format holds (4 GiB of WAV, 2 GiB of AIFF)."""


class NonFiniteError(VoxtralError, ArithmeticError):
    """The model produced NaN or infinite values while generating (damaged weights, or an
    overflow in float16): the request stops instead of speaking noise."""


class PlatformError(VoxtralError, ImportError):
    """MLX cannot be imported: not installed, or no build for this platform."""


def mlx_import_error(cause: ImportError) -> PlatformError:
    """The one-line error for ``cause``, an ImportError of MLX."""
    return PlatformError(
        f"MLX cannot be imported ({cause}): voxtral_mlx runs on Apple Silicon Macs "
        "(pip install mlx) and on Linux (pip install 'mlx[cpu]'); Intel Macs and Windows "
        "have no MLX build"
    )


def is_mlx_import_error(error: ImportError) -> bool:
    """Whether MLX itself failed to import (not, say, a module of this package, whose name
    holds "mlx" too)."""
    name = error.name or ""
    if name:
        return name == "mlx" or name.startswith("mlx.")
    # No name: a failing native library ("libmlx.so: cannot open shared object file").
    return re.search(r"(?<![\w.])(lib)?mlx\b", str(error).split(":")[0]) is not None
