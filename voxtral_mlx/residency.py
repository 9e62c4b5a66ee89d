"""Keep the weights resident in GPU memory while a Mac generates (Metal only).

Every frame reads all the weights (8 GB for Mistral's bf16 release). Metal may evict
buffers it was not told to keep, and a frame that has to page its weights back in costs
many times a normal one (MLX keeps buffers resident on macOS 15 and later; before, the
limit is accepted and changes nothing). While requests run, the process's wired
limit is raised to what the GPU can keep resident (``max_recommended_working_set_size``,
as mlx-lm does while it generates), and put back when the model goes idle, so an app that
loaded the model but is not speaking does not pin memory. Models in one process share
the setting (it is process-wide): it is raised by the first that starts and restored by
the last that stops. Off Metal all of this does nothing.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Any

import mlx.core as mx

# A model above this share of the residency budget will page during every frame.
FIT_FRACTION = 0.9


class MemoryWarning(UserWarning):
    """The model does not fit the memory the GPU can keep resident."""


def _device_info(backend: Any) -> dict[str, Any]:
    info = getattr(backend, "device_info", None) or backend.metal.device_info
    return dict(info())


def _warn(what: str, error: BaseException) -> None:
    detail = str(error).splitlines()[0] if str(error) else type(error).__name__
    # Warnings turned into errors must not fail generation (acquire and release run on the
    # model's worker, between frames): it goes on without residency.
    with contextlib.suppress(Exception):
        warnings.warn(MemoryWarning(f"{what}: {detail}"), stacklevel=3)


class _Wiring:
    """The process-wide wired limit, raised while at least one holder runs."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.holders = 0
        self.previous = 0


_WIRING = _Wiring()


class Residency:
    """Raises the wired limit while a model generates (:meth:`acquire` / :meth:`release`).

    ``backend`` is ``mlx.core`` unless given (tests give a fake Metal). On a machine without
    Metal every method does nothing.
    """

    def __init__(self, model_bytes: int, backend: Any = None):
        backend = backend if backend is not None else mx
        self._backend = backend
        self._held = False
        self.limit = 0  # bytes the GPU can keep resident; 0 off Metal
        self.model_bytes = model_bytes
        metal = getattr(backend, "metal", None)
        if metal is None or not metal.is_available():
            return
        try:
            self.limit = int(_device_info(backend).get("max_recommended_working_set_size", 0))
        except Exception as e:  # an MLX without the query: generate without residency
            _warn("weights not kept resident (no GPU memory budget)", e)

    @property
    def active(self) -> bool:
        return self.limit > 0

    def check_fit(self) -> None:
        """Warn (:class:`MemoryWarning`) when the weights alone exceed the resident budget."""
        if self.active and self.model_bytes > FIT_FRACTION * self.limit:
            gb = 1e9
            warnings.warn(
                MemoryWarning(
                    f"the model's weights take {self.model_bytes / gb:.1f} GB but this Mac's "
                    f"GPU keeps at most {self.limit / gb:.1f} GB resident, so every frame "
                    "will page: use a quantized model (voxtral-mlx convert MODEL -o OUT "
                    "--q-bits 4, or mlx-community/Voxtral-4B-TTS-2603-mlx-4bit)"
                ),
                stacklevel=3,
            )

    def acquire(self) -> None:
        """Generation starts: keep memory resident (idempotent per holder)."""
        if not self.active or self._held:
            return
        with _WIRING.lock:
            if _WIRING.holders == 0:
                try:
                    _WIRING.previous = self._backend.set_wired_limit(self.limit)
                except Exception as e:  # a limit refused: generate without it
                    self.limit = 0
                    _warn("weights not kept resident (wired limit refused)", e)
                    return
            _WIRING.holders += 1
        self._held = True

    def release(self) -> None:
        """Generation stopped: the last holder puts the previous limit back."""
        if not self._held:
            return
        self._held = False
        with _WIRING.lock:
            _WIRING.holders -= 1
            if _WIRING.holders == 0:
                try:
                    self._backend.synchronize()  # nothing in flight needs wired buffers
                except Exception as e:  # the limit still goes back: not raised for good
                    _warn("waiting for the GPU failed (the wired limit is restored anyway)", e)
                try:
                    self._backend.set_wired_limit(_WIRING.previous)
                except Exception as e:
                    _warn("the previous wired memory limit could not be restored", e)
