"""Errors of the HTTP API in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import logging
import math

from starlette.responses import JSONResponse

from ..errors import InputError, NonFiniteError, VoxtralError
from ..fileio import one_line

log = logging.getLogger("uvicorn.error")


class APIError(Exception):
    """A request the server answers with ``status`` and OpenAI's error JSON."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = one_line(message, 2000)
        self.type = type
        # A field's name comes from the client: escaped and cut like any echoed string.
        self.param = None if param is None else one_line(param, 200)
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def shown(value: object, limit: int = 60) -> str:
    """``repr(value)`` for an error message, cut to about ``limit`` characters (a client's
    megabyte string or 4000-digit number is not echoed back whole), in JSON's words where
    Python's differ (true, null; 1e400 is read as infinity)."""
    if value is None or isinstance(value, bool):
        return "null" if value is None else str(value).lower()
    if isinstance(value, float) and not math.isfinite(value):
        return "a number too large"
    return one_line(repr(value), limit)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def server_error(
    message: str = "the server failed to process the request; its log has the details",
) -> APIError:
    return APIError(500, message, type="server_error")


def no_audio() -> APIError:
    """The model ended the request before its first frame: no audio to send (an empty
    FLAC, MP3 or Opus body would not even be a readable file)."""
    return APIError(
        422,
        "the model produced no audio for this text (END on the first frame): rephrase it "
        "or send another seed",
        code="no_audio",
    )


def shutting_down() -> APIError:
    return APIError(
        503,
        "the server is shutting down: retry the request later",
        type="server_error",
        code="server_shutting_down",
        headers={"Retry-After": "1"},
    )


def request_failed(error: VoxtralError) -> APIError:
    """The answer to a speech request that ``error`` stopped: the request's own fault (bad
    input, found when its text is read) is a 400 saying why; anything else (a damaged voice
    file, damaged weights) is the server's, logged here, a 500 whose details stay in the log
    (they name the server's files)."""
    if isinstance(error, InputError):
        return bad_request(str(error))
    log.error("speech request failed: %s", error)
    if isinstance(error, NonFiniteError):  # names no file; says what to do about it
        return server_error(str(error))
    return server_error()
