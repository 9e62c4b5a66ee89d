"""Running the app with uvicorn on a socket bound up front (so a taken port is a one-line
error, ``--port 0`` picks a free one, and the URL is known when the server is ready)."""

from __future__ import annotations

import errno
import logging
import socket
import sys
from collections.abc import Awaitable, Callable

import uvicorn
from starlette.types import ASGIApp

from ..errors import VoxtralError
from .response import CUT_OFF_ON_PURPOSE, with_transport

API_KEY_ENV = "VOXTRAL_MLX_API_KEY"
SHUTDOWN_GRACE_S = 3.0  # then open streams are cancelled (their generation stops)


# BSD sockets (macOS): with SO_REUSEADDR, 127.0.0.1:P binds beside a program listening on
# *:P (or the reverse) and takes its local clients; Linux refuses such a bind itself.
OVERLAPPING_BINDS = sys.platform == "darwin" or "bsd" in sys.platform


class ServerError(VoxtralError):
    """The server cannot start (address in use, bad host)."""


_PORT_TAKEN_FIX = "choose another --port or stop the program using it"


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (port 0: any free port) and listening, so the port
    is this server's while the model loads (connections wait until :func:`serve` accepts
    them): two sockets bound with SO_REUSEADDR and not listening can share a port on
    Linux, and the second ``listen()`` would fail only after the load."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ServerError(f"cannot resolve host {host!r}: {e.strerror}; use an IP address") from e
    family, kind, proto, _, address = infos[0]
    if port and OVERLAPPING_BINDS and _someone_listens(family, address):
        # Probed before binding: once bound, a connection to the address could reach
        # this very socket (BSD matches bound sockets, listening or not).
        raise ServerError(
            f"cannot listen on {host}:{port}: another program listens on port {port}; "
            f"{_PORT_TAKEN_FIX}"
        )
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen()
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            fix = _PORT_TAKEN_FIX
        elif e.errno in (errno.EACCES, errno.EPERM):
            fix = "ports below 1024 need administrator rights: choose a --port of 1024 or above"
        elif e.errno == errno.EADDRNOTAVAIL:
            fix = "this machine has no such address: use 127.0.0.1, 0.0.0.0 or one of its own"
        else:
            fix = "check --host and --port"
        raise ServerError(f"cannot listen on {host}:{port}: {e.strerror}; {fix}") from e
    return sock


def _someone_listens(family: int, address: tuple) -> bool:
    """Whether a connection to ``address`` (a wildcard one: to loopback) is accepted."""
    host = address[0]
    if host in ("0.0.0.0", "::", ""):
        host = "::1" if family == socket.AF_INET6 else "127.0.0.1"
    probe = socket.socket(family, socket.SOCK_STREAM)
    probe.settimeout(0.5)
    try:
        return probe.connect_ex((host, *address[1:])) == 0
    except OSError:
        return False
    finally:
        probe.close()


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class _Server(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        on_ready: Callable[[], None],
        before_shutdown: Callable[[Callable[[], bool]], Awaitable[None]] | None,
    ) -> None:
        super().__init__(config)
        self._on_ready = on_ready
        self._before_shutdown = before_shutdown

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            self._on_ready()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:  # no new connections while requests wind down
            server.close()
        if self._before_shutdown is not None:
            await self._before_shutdown(lambda: self.force_exit)
        await super().shutdown(sockets=sockets)


def serve(
    app: ASGIApp,
    sock: socket.socket,
    on_ready: Callable[[str], None],
    log_level: str = "info",
) -> None:
    """Serve ``app`` (from :func:`create_app`) on ``sock`` (from :func:`bind`) until Ctrl-C
    or SIGTERM; ``on_ready(url)`` once it accepts connections.

    On shutdown, speech requests in progress get :data:`SHUTDOWN_GRACE_S` seconds to
    finish, then are cut off and their generation cancelled. After a clean shutdown the
    signal is re-raised (KeyboardInterrupt for Ctrl-C). Closes ``sock``.
    """
    url = url_of(sock)
    api = getattr(getattr(app, "state", None), "api", None)

    async def before_shutdown(hurry: Callable[[], bool]) -> None:
        if api is not None:
            await api.shutdown(SHUTDOWN_GRACE_S, hurry)

    config = uvicorn.Config(
        with_transport(app),
        log_level=log_level,
        lifespan="off",
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        server_header=False,
    )
    quiet = _IntendedCutOffs(api)
    logging.getLogger("uvicorn.error").addFilter(quiet)
    try:
        _Server(config, lambda: on_ready(url), before_shutdown).run(sockets=[sock])
    finally:
        logging.getLogger("uvicorn.error").removeFilter(quiet)
        sock.close()


class _IntendedCutOffs(logging.Filter):
    """Once shutdown has cut streams off (logged once, as such), or a response was cut off
    because its client stopped reading (logged as such, in the task uvicorn logs from),
    uvicorn's error line for the response left incomplete on purpose is noise: it is
    dropped then, only then."""

    MESSAGE = "ASGI callable returned without completing response."

    def __init__(self, api: object) -> None:
        super().__init__()
        self.api = api

    def filter(self, record: logging.LogRecord) -> bool:
        stopping = getattr(self.api, "stopping", False) or CUT_OFF_ON_PURPOSE.get()
        return not (stopping and record.getMessage() == self.MESSAGE)
