"""Sending generated audio: an ASGI response fed by an async iterator of bytes.

The status line and headers go out with the first bytes, so a request that fails before
any audio still gets a proper error response. Streaming responses use chunked transfer;
buffered ones (a FLAC file) are sent whole with their length. A client that goes away
stops the body at once (its ``finally`` blocks run: generation is cancelled), and
``on_close`` always runs, exactly once.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import math
import socket
import struct
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextvars import ContextVar

import anyio
import anyio.lowlevel
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import VoxtralError
from .errors import APIError, request_failed, server_error, shutting_down

log = logging.getLogger("uvicorn.error")
SSE_PIECE = 48 * 1024  # bytes of audio per SSE event at most
_PIECE_BYTES = 64 * 1024  # a whole file (FLAC) is sent in messages of this size
# Set in the task of a response cut off on purpose (its client stopped reading): uvicorn's
# "returned without completing response" line, logged next in that task, is noise then.
CUT_OFF_ON_PURPOSE: ContextVar[bool] = ContextVar("voxtral_cut_off", default=False)


# Scope key of the connection's transport, when the server exposes it (uvicorn's ``send`` is
# a method of an object holding it; see :func:`with_transport`).
TRANSPORT = "voxtral_mlx.transport"


def with_transport(app: ASGIApp) -> ASGIApp:
    """``app`` with each HTTP request's transport in its scope: a response cut off because
    its client stopped reading is then aborted. Closed, the connection would wait for that
    client to take the megabytes already buffered, holding its socket (and a shutdown)."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            transport = getattr(getattr(send, "__self__", None), "transport", None)
            if callable(getattr(transport, "abort", None)):
                scope[TRANSPORT] = transport
        await app(scope, receive, send)

    return wrapped


def _drop_connection(scope: Scope) -> None:
    transport = scope.get(TRANSPORT)
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        # Closed plainly, the kernel would go on offering the megabytes in its send queue
        # to a client that does not read: with a zero linger it resets the connection.
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()  # the bytes asyncio still holds are dropped too


def _unsent(scope: Scope) -> bool:
    """Whether bytes sent wait in the server for room in the socket's send queue."""
    transport = scope.get(TRANSPORT)
    return transport is not None and transport.get_write_buffer_size() > 0


async def _pieces(data: bytes) -> AsyncGenerator[bytes, None]:
    """``data`` in messages of :data:`_PIECE_BYTES`."""
    view = memoryview(data)
    for at in range(0, len(data), _PIECE_BYTES):
        yield bytes(view[at : at + _PIECE_BYTES])


class BodyResponse:
    def __init__(
        self,
        body: AsyncGenerator[bytes, None],
        media_type: str,
        *,
        streams: bool,
        on_close: Callable[[str], Awaitable[None]],
        headers: dict[str, str] | None = None,
        send_timeout: float = math.inf,
    ) -> None:
        self.body = body
        self.media_type = media_type
        self.streams = streams
        self.on_close = on_close  # called with "completed", "cancelled" or "failed"
        self.headers = dict(headers or {})
        self.send_timeout = send_timeout  # a client not reading for this long is cut off
        self.started = False
        self._aborted = False
        self._scope: anyio.CancelScope | None = None
        self._sending = False  # inside the server's send: its write buffer may be full

    def abort(self) -> None:
        """Stop sending (server shutdown): the connection is closed without the end of the
        body, so the client sees a truncated transfer (a 503 error if nothing was sent)."""
        self._aborted = True
        if self._scope is not None:
            self._scope.cancel()

    def _head(self, length: int | None = None) -> dict:
        headers = {"content-type": self.media_type, **self.headers}
        if length is not None:
            headers["content-length"] = str(length)
        raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        return {"type": "http.response.start", "status": 200, "headers": raw}

    async def _send_body(self, send: Send) -> None:
        parts = self.body
        if not self.streams:
            data = b"".join([part async for part in self.body])
            self.started = True
            await send(self._head(len(data)))
            # In pieces: the server's send waits for room only before it writes, so one
            # message of the whole file would be "sent" at once into a client that never
            # reads, past the send timeout's watch.
            parts = _pieces(data)
        async for part in parts:
            if not part:
                continue
            if not self.started:
                self.started = True
                await send(self._head())
            await send({"type": "http.response.body", "body": part, "more_body": True})
            # The server's send returns without yielding while the socket takes the bytes:
            # yield, so that a client gone away is noticed before the next part (a whole
            # FLAC file's SSE events would otherwise all go to a closed socket) and other
            # responses get their turn.
            await anyio.lowlevel.checkpoint()
        if not self.started:
            self.started = True
            await send(self._head())
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        outcome = "cancelled"
        try:
            async with anyio.create_task_group() as tg:
                self._scope = tg.cancel_scope
                if self._aborted:
                    tg.cancel_scope.cancel()

                async def watch() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(watch)
                try:
                    await self._send_body(self._guarded(send))
                    outcome = "completed"
                except _Stalled:
                    # Its slot in the queue is freed, and the connection dropped.
                    CUT_OFF_ON_PURPOSE.set(True)
                    _drop_connection(scope)
                    log.warning(
                        "client stopped reading for %g s: its speech response is cut off",
                        self.send_timeout,
                    )
                except APIError as e:
                    outcome = "failed"
                    await self._fail(send, e)
                except VoxtralError as e:  # bad input found late, or the model's fault
                    outcome = "failed"
                    await self._fail(send, request_failed(e))
                except Exception:
                    outcome = "failed"
                    log.exception("speech generation failed")
                    await self._fail(send, server_error())
                tg.cancel_scope.cancel()
            if self._aborted and (self._sending or _unsent(scope)):
                # Cut off by shutdown while its client is not reading (the server's send
                # waits, or bytes wait that the socket has no room for): closed, the
                # connection would wait for that client, and hold up the shutdown.
                _drop_connection(scope)
            if self._aborted and not self.started:
                # Cut off by shutdown before any audio (waiting for room in the batch): a
                # proper error, not the bare 500 the server sends for an unanswered request.
                await self._fail(send, shutting_down())
        finally:
            with anyio.CancelScope(shield=True):
                await self.body.aclose()
                await self.on_close(outcome)

    def _guarded(self, send: Send) -> Send:
        """``send`` that gives up when the client has not taken the bytes for
        ``send_timeout`` seconds (the server waits while its write buffer is full)."""

        async def guarded(message: Message) -> None:
            self._sending = True
            with anyio.move_on_after(self.send_timeout) as scope:
                await send(message)
            self._sending = False
            if scope.cancelled_caught:
                raise _Stalled

        return guarded

    async def _fail(self, send: Send, error: APIError) -> None:
        if self.started:
            # Too late for a status: returning without the final chunk makes the server
            # close the connection, so the client sees a truncated transfer, not success.
            return
        self.started = True
        data = error.response().body  # spelled as every other error body
        head = {"type": "http.response.start", "status": error.status}
        head["headers"] = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(data)).encode()),
            *((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in error.headers.items()),
        ]
        await send(head)
        await send({"type": "http.response.body", "body": data, "more_body": False})


class _Stalled(Exception):
    pass


async def sse_events(
    audio: AsyncGenerator[bytes, None], usage: Callable[[], dict[str, int]]
) -> AsyncGenerator[bytes, None]:
    """OpenAI's speech events: ``speech.audio.delta`` (base64 audio) and
    ``speech.audio.done`` (with token usage)."""
    try:
        async for data in audio:
            for i in range(0, len(data), SSE_PIECE):
                piece = base64.b64encode(data[i : i + SSE_PIECE]).decode("ascii")
                yield _event({"type": "speech.audio.delta", "audio": piece})
        yield _event({"type": "speech.audio.done", "usage": usage()})
    finally:
        await audio.aclose()


def _event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"
