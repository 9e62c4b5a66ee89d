"""The speech server against hostile or sloppy clients: slow bodies, odd JSON, clients
that vanish mid-stream. The server runs in-process (uvicorn on a thread) so that its
config, the body deadline included, can be set to what a fast test needs."""

from __future__ import annotations

import asyncio
import errno
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import mlx.core as mx
import pytest
import uvicorn
from test_server import idle, start_server, stop_server, wait_until

import voxtral_mlx
from voxtral_mlx.config import END_AUDIO
from voxtral_mlx.server import ServerConfig, bind, create_app, url_of
from voxtral_mlx.server.app import BODY_TIMEOUT_S, SEND_TIMEOUT_S
from voxtral_mlx.server.response import BodyResponse

KEY = "edge-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_TIMEOUT = 0.6
SEND_TIMEOUT = 0.5
MAX_CHARS = 2000
LONG = " ".join(f"This is sentence number {i}, which goes on for a while." for i in range(30))


@dataclass
class Live:
    url: str
    host: str
    port: int

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=10).json()

    def connect(self) -> socket.socket:
        return socket.create_connection((self.host, self.port), timeout=10)


@pytest.fixture(scope="module")
def tts(tiny_checkpoint_noend):
    model = voxtral_mlx.load(tiny_checkpoint_noend)
    yield model
    model.close()


@pytest.fixture(scope="module")
def live(tts) -> Iterator[Live]:
    config = ServerConfig(
        api_key=KEY,
        max_input_chars=MAX_CHARS,
        max_queue=2,
        max_frames=20,
        body_timeout=BODY_TIMEOUT,
        send_timeout=SEND_TIMEOUT,
    )
    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(tts, config),
            lifespan="off",
            log_level="warning",
            timeout_graceful_shutdown=5,
        )
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_until(lambda: server.started)
    host, port = sock.getsockname()[:2]
    try:
        yield Live(url_of(sock), host, port)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
    assert not thread.is_alive()


def head(length: int | None, *, chunked: bool = False, close: bool = False) -> bytes:
    lines = [
        "POST /v1/audio/speech HTTP/1.1",
        "Host: test",
        "Content-Type: application/json",
        f"Authorization: Bearer {KEY}",
    ]
    if chunked:
        lines.append("Transfer-Encoding: chunked")
    if close:
        lines.append("Connection: close")
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def read_response(sock: socket.socket, timeout: float = 10) -> tuple[int, dict, bytes]:
    """Status, headers and body of one response; the connection must then be closed."""
    sock.settimeout(timeout)
    data = b""
    while part := sock.recv(65536):
        data += part
    raw_head, _, body = data.partition(b"\r\n\r\n")
    lines = raw_head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


def assert_openai_error(status: int, body: bytes, expected: int) -> dict:
    assert status == expected, body
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and "\n" not in error["message"]
    assert len(error["message"]) < 1000  # a 50 kB value is not echoed back
    return error


# -- the body deadline -----------------------------------------------------------------------


def test_the_default_deadlines_are_bounded():
    assert ServerConfig().body_timeout == BODY_TIMEOUT_S
    assert 5 <= BODY_TIMEOUT_S <= 120
    assert ServerConfig().send_timeout == SEND_TIMEOUT_S
    assert 10 <= SEND_TIMEOUT_S <= 600


@pytest.mark.parametrize("how", ["stalled", "dribbled", "chunked"])
def test_a_body_that_does_not_arrive_in_time_gets_408(live, how):
    body = json.dumps({"input": "Never finished.", "response_format": "pcm"}).encode()
    sock = live.connect()
    try:
        t0 = time.monotonic()
        if how == "chunked":
            sock.sendall(head(None, chunked=True) + b"5\r\n" + body[:5] + b"\r\n")
        else:
            sock.sendall(head(len(body)) + body[:5])
        if how == "dribbled":  # a byte now and then: each arrives, the whole never does
            for byte in body[5:9]:
                time.sleep(BODY_TIMEOUT / 5)
                sock.sendall(bytes([byte]))
        status, headers, data = read_response(sock)
        elapsed = time.monotonic() - t0
    finally:
        sock.close()
    error = assert_openai_error(status, data, 408)
    assert error["code"] == "request_timeout" and error["type"] == "invalid_request_error"
    assert f"within {BODY_TIMEOUT:g} s" in error["message"]
    assert headers["connection"] == "close"  # read_response returned: the server closed it
    assert BODY_TIMEOUT <= elapsed < BODY_TIMEOUT + 3
    assert idle(live)["requests"] == 0


def test_a_slow_body_does_not_take_a_queue_slot_and_a_prompt_one_is_served(live):
    body = json.dumps({"input": "On time.", "response_format": "pcm"}).encode()
    stalled = [live.connect() for _ in range(3)]  # more than --max-queue (2)
    try:
        for sock in stalled:
            sock.sendall(head(len(body)) + body[:3])
        time.sleep(0.1)
        assert live.health()["requests"] == 0
        # Split across writes but complete within the deadline: served normally.
        sock = live.connect()
        sock.sendall(head(len(body), close=True) + body[:4])
        time.sleep(BODY_TIMEOUT / 4)
        sock.sendall(body[4:])
        status, _, data = read_response(sock)
        sock.close()
        assert status == 200 and len(data) > 0
        for s in stalled:
            assert read_response(s)[0] == 408
    finally:
        for s in stalled:
            s.close()
    idle(live)


def test_a_declared_oversized_body_is_refused_before_it_is_sent(live):
    sock = live.connect()
    try:
        sock.sendall(head(10**9))  # no body follows: the answer must not wait for it
        status, headers, data = read_response(sock, timeout=BODY_TIMEOUT / 2)
    finally:
        sock.close()
    error = assert_openai_error(status, data, 413)
    assert error["code"] == "request_too_large" and headers["connection"] == "close"


# -- odd JSON --------------------------------------------------------------------------------

ODD_BODIES = [
    ("array", b'["Hi."]', "got an array", None),
    ("number", b"42", "got a number", None),
    ("null", b"null", "got null", None),
    ("empty", b"", "the body is empty", None),
    ("syntax", b'{"input": "Hi.",}', "line 1 column", None),
    ("duplicate key", b'{"input": "a", "input": "Hello there."}', "duplicate key 'input'", "input"),
    ("NaN", b'{"input": "Hi.", "speed": NaN}', "NaN is not a JSON number", None),
    ("Infinity", b'{"input": "Hi.", "speed": Infinity}', "Infinity is not a JSON number", None),
    ("-Infinity", b'{"input": "Hi.", "seed": -Infinity}', "-Infinity is not a JSON number", None),
    ("not UTF-8", b'{"input": "caf\xe9"}', "not UTF-8 text (byte 0xe9 at offset 14)", None),
    (
        "not UTF-8 after a BOM",
        b'\xef\xbb\xbf{"input": "caf\xe9"}',
        "not UTF-8 text (byte 0xe9 at offset 17)",
        None,
    ),
    # json.loads() of bytes guesses UTF-16 and UTF-32, and such bodies were spoken.
    ("UTF-16", '{"input": "Grüße."}'.encode("utf-16"), "NUL bytes, as UTF-16", None),
    ("UTF-16-LE", '{"input": "Grüße."}'.encode("utf-16-le"), "NUL bytes, as UTF-16", None),
    ("UTF-32-BE", '{"input": "Grüße."}'.encode("utf-32-be"), "NUL bytes, as UTF-16", None),
    ("400-digit speed", b'{"input": "Hi.", "speed": 1' + b"0" * 400 + b"}", "speed must", "speed"),
    ("400-digit seed", b'{"input": "Hi.", "seed": 1' + b"0" * 400 + b"}", "seed must", "seed"),
    (
        "5000-digit seed",
        b'{"input": "Hi.", "seed": 1' + b"0" * 5000 + b"}",
        "too many digits",
        None,
    ),
    ("huge float", b'{"input": "Hi.", "speed": 1e400}', "got a number too large", "speed"),
    ("boolean speed", b'{"input": "Hi.", "speed": true}', "got true", "speed"),
    ("number input", b'{"input": 5}', "input must be a string, got a number", "input"),
    ("deep nesting", b'{"input": ' + b"[" * 20000 + b"]" * 20000 + b"}", "nested too deeply", None),
    ("zero-width input", b'{"input": "\\u200b\\u2060\\ufeff"}', "input is empty", "input"),
    ("odd spaces input", '{"input": "\u00a0\u3000\u2003\\n"}'.encode(), "input is empty", "input"),
    (
        "long voice",
        b'{"input": "Hi.", "voice": "' + b"v" * 50_000 + b'"}',
        "unknown voice",
        "voice",
    ),
    (
        "long field",
        b'{"' + b"f" * 50_000 + b'": 1, "input": "Hi."}',
        "unrecognized",
        "f" * 57 + "...",
    ),
    ("lone surrogate field", b'{"input": "Hi.", "\\ud800": 1}', "unrecognized", "\\ud800"),
]


@pytest.mark.parametrize(
    ("what", "body", "expected", "param"), ODD_BODIES, ids=[c[0] for c in ODD_BODIES]
)
def test_odd_bodies_get_a_one_line_400(live, what, body, expected, param):
    r = httpx.post(
        f"{live.url}/v1/audio/speech",
        content=body,
        headers={**AUTH, "Content-Type": "application/json"},
        timeout=30,
    )
    error = assert_openai_error(r.status_code, r.content, 400)
    assert expected in error["message"], error["message"]
    if param is not None:
        assert error["param"] == param
    assert error["type"] == "invalid_request_error"


def test_a_utf8_body_may_start_with_a_byte_order_mark(live):
    body = b"\xef\xbb\xbf" + json.dumps({"input": "Grüße.", "response_format": "pcm"}).encode()
    headers = {**AUTH, "Content-Type": "application/json"}
    r = httpx.post(f"{live.url}/v1/audio/speech", content=body, headers=headers, timeout=60)
    assert r.status_code == 200 and len(r.content) > 0


@pytest.mark.parametrize(
    "text", ["😀🎉", "...", "a" * MAX_CHARS, "Hi \u200bthere."], ids=["emoji", "dots", "word", "zw"]
)
def test_unusual_but_visible_input_is_spoken(live, text):
    body = {"input": text, "response_format": "pcm"}
    r = httpx.post(f"{live.url}/v1/audio/speech", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200 and len(r.content) % 2 == 0 and len(r.content) > 0


@pytest.mark.parametrize("stream_format", ["audio", "sse"])
@pytest.mark.parametrize("fmt", ["pcm", "wav", "mp3", "opus", "flac"])
def test_a_text_the_model_ends_at_once_gets_422_not_an_empty_body(
    live, tts, monkeypatch, fmt, stream_format
):
    """END as the first frame: there is no audio, and empty FLAC, MP3 and Opus bodies are
    not even readable files; the client is told so, as `speak` tells its user."""

    def end_at_once(h, noise, cfg):
        sem, codes = original(h, noise, cfg)
        sem = mx.full(sem.shape, END_AUDIO, dtype=sem.dtype)
        return sem, mx.concatenate([sem[:, None], codes[:, 1:]], axis=-1)

    original = tts.model.frame
    monkeypatch.setattr(tts.model, "frame", end_at_once)
    before = idle(live)
    body = {"input": "Hello there.", "response_format": fmt, "stream_format": stream_format}
    r = httpx.post(f"{live.url}/v1/audio/speech", json=body, headers=AUTH, timeout=60)
    error = assert_openai_error(r.status_code, r.content, 422)
    assert error["code"] == "no_audio" and "another seed" in error["message"]
    after = idle(live)
    assert after["failed"] == before["failed"] + 1
    monkeypatch.undo()
    r = httpx.post(f"{live.url}/v1/audio/speech", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.content


# -- clients that go away --------------------------------------------------------------------


@pytest.mark.parametrize("stream_format", ["audio", "sse"])
@pytest.mark.parametrize("fmt", ["pcm", "wav", "mp3", "opus", "flac"])
def test_a_client_gone_mid_response_frees_the_engine(live, fmt, stream_format):
    before = idle(live)
    body = json.dumps({"input": LONG, "response_format": fmt, "stream_format": stream_format})
    sock = live.connect()
    try:
        sock.sendall(head(len(body)) + body.encode())
        wait_until(lambda: live.health()["active"] >= 1)
    finally:
        sock.close()
    after = idle(live)
    assert after["cancelled"] == before["cancelled"] + 1
    assert after["completed"] == before["completed"]
    time.sleep(0.1)
    assert live.health()["frames"] == after["frames"]  # nothing generates any more


@pytest.mark.parametrize("fmt", ["pcm", "flac"])
def test_a_client_that_stops_reading_is_cut_off_and_frees_its_slot(live, fmt):
    """FLAC, made whole and then sent as one message, went into the socket's buffers at
    once: counted completed, its slot freed, megabytes held for a client that never reads."""
    before = idle(live)
    # A paragraph a segment, each its 20 frames: FLAC larger than the loopback's buffers.
    text = "\n\n".join(f"Paragraph number {i} is here." for i in range(32))
    body = json.dumps({"input": text, "response_format": fmt, "speed": 0.25})
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills at once
    sock.settimeout(10)
    sock.connect((live.host, live.port))
    try:
        sock.sendall(head(len(body)) + body.encode())
        wait_until(lambda: live.health()["requests"] == 1)
        # The client never reads: the server gives up on it (FLAC only once all 640
        # frames are made, several seconds on a busy machine).
        after = idle(live, timeout=60)
        assert after["cancelled"] == before["cancelled"] + 1
        assert after["completed"] == before["completed"]
    finally:
        sock.close()


def test_a_disconnect_is_noticed_between_parts_sent_back_to_back():
    """Parts that are ready at once (a FLAC file's SSE events) stop at a disconnect
    instead of all being written to a closed socket."""
    sent: list[dict] = []
    outcomes: list[str] = []

    async def parts():
        for _ in range(5):
            yield b"x" * 10

    async def receive() -> dict:
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    async def on_close(outcome: str) -> None:
        outcomes.append(outcome)

    response = BodyResponse(parts(), "audio/pcm", streams=True, on_close=on_close)
    asyncio.run(response({"type": "http"}, receive, send))
    assert outcomes == ["cancelled"]
    assert len([m for m in sent if m["type"] == "http.response.body"]) == 1


class _Transport:
    """A connection's transport as the server sees it: ``unsent`` bytes it holds."""

    def __init__(self, unsent: int) -> None:
        self.unsent = unsent
        self.aborted = False

    def get_write_buffer_size(self) -> int:
        return self.unsent

    def get_extra_info(self, name: str) -> None:
        return None

    def abort(self) -> None:
        self.aborted = True


@pytest.mark.parametrize("unsent", [0, 4096])
def test_a_shutdown_drops_a_connection_only_while_its_bytes_wait_for_the_client(unsent):
    """Cut off by a shutdown between two parts, while bytes the socket had no room for waited
    in the server (the client had stopped reading, but the server's send had not had to
    wait yet): the connection was closed, which waits for those bytes to go, so the server
    exited only after uvicorn's 3 s with an ERROR line. A client that keeps up is not
    reset: its connection is closed in the ordinary way."""
    from voxtral_mlx.server.response import TRANSPORT

    transport = _Transport(unsent)
    outcomes: list[str] = []

    async def parts():
        yield b"x" * 10
        await asyncio.Event().wait()  # the next frame, never ready

    async def receive() -> dict:
        await asyncio.Event().wait()
        return {}

    async def main() -> None:
        sent = asyncio.Event()

        async def send(message: dict) -> None:
            if message.get("body"):
                sent.set()

        async def on_close(outcome: str) -> None:
            outcomes.append(outcome)

        response = BodyResponse(parts(), "audio/pcm", streams=True, on_close=on_close)
        task = asyncio.create_task(response({"type": "http", TRANSPORT: transport}, receive, send))
        await sent.wait()
        response.abort()
        await asyncio.wait_for(task, 10)

    asyncio.run(main())
    assert outcomes == ["cancelled"]
    assert transport.aborted == (unsent > 0)


def test_the_body_timeout_flag_reaches_the_server(tiny_checkpoint_noend, tmp_path):
    """``serve --body-timeout`` is the deadline the running server applies."""
    srv = start_server(
        tmp_path / "timeout", tiny_checkpoint_noend, "--no-warmup", "--body-timeout", "0.5"
    )
    try:
        host, port = srv.url.removeprefix("http://").rsplit(":", 1)
        body = b'{"input": "Never sent whole."}'
        with socket.create_connection((host, int(port)), timeout=20) as sock:
            t0 = time.monotonic()
            sock.sendall(head(len(body)) + body[:5])
            status, _, data = read_response(sock)
            elapsed = time.monotonic() - t0
        error = assert_openai_error(status, data, 408)
        assert "within 0.5 s" in error["message"]
        assert elapsed < 10
    finally:
        assert stop_server(srv) == 0


def test_bind_errors_name_the_fix_for_their_cause(monkeypatch):
    from voxtral_mlx.server.run import ServerError

    # The port is claimed at bind(), before the model loads: a second server started while
    # the first still loads is refused there (not after its own load, nor the first's).
    taken = bind("127.0.0.1", 0)
    try:
        port = taken.getsockname()[1]
        with pytest.raises(ServerError, match="choose another --port or stop the program"):
            bind("127.0.0.1", port)
    finally:
        taken.close()
    with pytest.raises(ServerError, match=r"no such address: use 127\.0\.0\.1"):
        bind("192.0.2.1", 0)  # TEST-NET-1: never this machine's

    # macOS binds 127.0.0.1:P beside a program listening on 0.0.0.0:P (BSD sockets with
    # SO_REUSEADDR), then serves its local clients: the bind is simulated here.
    from voxtral_mlx.server import run

    other = socket.create_server(("0.0.0.0", 0))
    try:
        port = other.getsockname()[1]
        monkeypatch.setattr(run, "OVERLAPPING_BINDS", True)
        monkeypatch.setattr(socket.socket, "bind", lambda self, address: None)
        for host in ("127.0.0.1", "0.0.0.0"):
            with pytest.raises(ServerError) as exc:
                bind(host, port)
            assert f"another program listens on port {port}" in str(exc.value)
        bind("127.0.0.1", 0).close()  # port 0: nothing to probe, no error
    finally:
        other.close()
        monkeypatch.undo()
    # Nobody there: the probe is refused at once and the real bind goes ahead.
    free = socket.create_server(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    monkeypatch.setattr(run, "OVERLAPPING_BINDS", True)
    t0 = time.perf_counter()
    mine = bind("127.0.0.1", port)
    try:
        assert mine.getsockname()[1] == port and time.perf_counter() - t0 < 0.4
    finally:
        mine.close()
        monkeypatch.undo()

    def refused(self, address):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(socket.socket, "bind", refused)
    with pytest.raises(ServerError, match="ports below 1024 need administrator rights"):
        bind("127.0.0.1", 80)


@pytest.mark.parametrize("speed", [1.0, 2.0])
def test_a_streamed_response_asks_for_larger_chunks_once_the_client_is_ahead(
    live, monkeypatch, speed
):
    """Generated well ahead of real time (5 ms a frame on the server's clock here, so a
    busy machine cannot make it slower), after the first one-frame chunk a client that
    started playing at the first byte holds enough for chunks of 8 frames. The bytes are
    those of one-frame chunks throughout."""
    import itertools

    import voxtral_mlx.audio.chunking as chunking
    import voxtral_mlx.server.app as app_mod
    from voxtral_mlx.textstream import _Reader

    class SteadyClient(chunking.ClientBuffer):
        def __init__(self, rate: float = 1.0):
            ticks = itertools.count()
            super().__init__(rate, clock=lambda: 0.005 * next(ticks))

    monkeypatch.setattr(app_mod, "ClientBuffer", SteadyClient)
    monkeypatch.setattr(chunking._SegmentPace, "update", lambda self, chunk: 0.0)
    asked: list[int] = []
    set_chunk_frames = _Reader.set_chunk_frames

    def recorded(self, frames):
        asked.append(frames)
        set_chunk_frames(self, frames)

    monkeypatch.setattr(_Reader, "set_chunk_frames", recorded)
    body = {"input": "Hello there, how are you?", "response_format": "pcm", "seed": 4}
    body["speed"] = speed

    def post() -> bytes:
        r = httpx.post(f"{live.url}/v1/audio/speech", json=body, headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
        return r.content

    grown = post()
    assert asked[0] == 1 and 8 in asked, asked
    asked.clear()
    monkeypatch.setattr(app_mod.ClientBuffer, "sent", lambda self, *args: 1)
    assert post() == grown
    assert set(asked) == {1}


def test_a_stream_opened_while_shutdown_cuts_off_the_others_is_cut_off_too(tts):
    """A request inside _open when shutdown's cut-off ran was added to the responses after
    it, never cut off: shutdown waited for it to end on its own (up to 10 s more)."""
    from starlette.testclient import TestClient

    app = create_app(tts, ServerConfig(max_frames=20))
    api = app.state.api
    real_open = api._open

    async def open_during_the_cut_off(*args, **kwargs):
        opened = await real_open(*args, **kwargs)
        api._cutting_off = True  # as shutdown() does while this request is being opened
        return opened

    api._open = open_during_the_cut_off
    with TestClient(app, raise_server_exceptions=False) as tc:
        r = tc.post("/v1/audio/speech", json={"input": LONG, "response_format": "pcm"})
        assert r.status_code == 503 and "shutting_down" in r.text
        assert tc.get("/health").json()["frames"] == 0
