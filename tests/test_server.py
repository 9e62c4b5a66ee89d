"""`voxtral-mlx serve`: a real server process, real HTTP clients (httpx, openai)."""

from __future__ import annotations

import base64
import gzip
import io
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf

import voxtral_mlx
from voxtral_mlx.audio.io import float_to_int16
from voxtral_mlx.audio.stretch import TimeStretcher, time_stretch
from voxtral_mlx.server.errors import APIError
from voxtral_mlx.synthetic.checkpoint import build_random_checkpoint

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_FRAMES = 40  # every segment runs exactly this long: the checkpoint never says END
MAX_QUEUE = 6
MAX_CHARS = 2000
SR = 24000
STORY = (
    "The lighthouse keeper woke before dawn. He climbed the stairs, one hundred and twelve "
    "of them, as he had for thirty years. The lamp was still warm; the sea was calm! "
    "Far away, a ship sounded its horn, and he waved, although nobody could see him. "
    "Then he made tea. It was, he thought, a perfectly ordinary morning. "
)
TEXT = STORY * 2  # two or three segments, generated as one batch
LONG = " ".join(f"This is sentence number {i}, which goes on for a while." for i in range(32))


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log: Path

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=10).json()


def start_server(workdir: Path, checkpoint: Path, *extra: str) -> Server:
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "stderr.txt"
    cmd = [sys.executable, "-m", "voxtral_mlx", "serve", "-m", str(checkpoint), "--port", "0"]
    with open(log, "w") as err, open(workdir / "stdout.txt", "w") as out:
        proc = subprocess.Popen([*cmd, *extra], stdout=out, stderr=err)
    deadline = time.monotonic() + 120
    while True:
        match = re.search(r"serving \S+ at (http://127\.0\.0\.1:\d+)", log.read_text())
        if match:
            break
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"server did not start: {log.read_text()}")
        time.sleep(0.05)
    server = Server(proc, match.group(1), log)
    assert server.health()["status"] == "ok"
    return server


def stop_server(server: Server, timeout: float = 30) -> int:
    server.proc.send_signal(signal.SIGINT)
    try:
        return server.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait()
        raise


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return build_random_checkpoint(
        tmp_path_factory.mktemp("serve-ckpt"), "tiny", seed=3, dtype="float32", suppress_end=True
    )


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    srv = start_server(
        tmp_path_factory.mktemp("serve"),
        checkpoint,
        "--api-key",
        KEY,
        "--max-frames",
        str(MAX_FRAMES),
        "--max-queue",
        str(MAX_QUEUE),
        "--max-input-chars",
        str(MAX_CHARS),
        "--max-batch",
        "4",
    )
    yield srv
    assert stop_server(srv) == 0


@pytest.fixture(scope="module")
def tts(checkpoint):
    model = voxtral_mlx.load(checkpoint)
    yield model
    model.close()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as c:
        yield c


def reference(tts, text: str, voice: str, seed: int) -> np.ndarray:
    return tts.synthesize(text, voice, seed=seed, split=True, max_frames=MAX_FRAMES).audio


def pcm16(data: bytes) -> np.ndarray:
    return np.frombuffer(data, "<i2")


def wait_until(predicate, timeout: float = 10.0, every: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError("condition not reached in time")


def idle(server: Server, timeout: float = 10.0) -> dict:
    """/health once no request is in progress and the engine has no job left."""

    def check() -> dict | None:
        h = server.health()
        return h if h["requests"] == h["active"] == h["waiting"] == 0 else None

    return wait_until(check, timeout)


# -- listing endpoints -------------------------------------------------------------------


def test_the_model_is_warmed_up_before_the_server_accepts_requests(server):
    log = server.log.read_text()
    assert re.search(r"warmed up in \d+\.\d s", log)
    assert log.index("warmed up in") < log.index("serving ")


def test_health_models_voices(server, http):
    health = httpx.get(f"{server.url}/health").json()  # open without a key
    assert health["status"] == "ok" and health["max_batch"] == 4
    assert health["max_queue"] == MAX_QUEUE
    models = http.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["object"] == "model"
    model_id = models["data"][0]["id"]
    assert http.get(f"/v1/models/{model_id}").json() == models["data"][0]
    other = _assert_openai_error(http.get("/v1/models/tts-1"), 404, "model")
    assert other["code"] == "model_not_found"
    voices = http.get("/v1/audio/voices").json()
    by_name = {v["id"]: v for v in voices["data"]}
    assert by_name["fr_female"]["language"] == "fr"
    assert by_name["casual_male"]["language_name"] == "English"
    assert voices["aliases"]["alloy"] == "neutral_female"
    assert all(by_name[t]["language"] == "en" for t in voices["aliases"].values())


# -- formats -------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["pcm", "wav", "flac", "mp3", "opus"])
def test_every_format_decodes_to_the_synthesized_audio(tts, client, fmt):
    speech = client.audio.speech.create(
        model="tts-1", voice="alloy", input=TEXT, response_format=fmt, extra_body={"seed": 7}
    )
    ref = reference(tts, TEXT, "neutral_female", 7)
    data = speech.content
    if fmt == "pcm":
        np.testing.assert_array_equal(pcm16(data), float_to_int16(ref))
        return
    info = sf.info(io.BytesIO(data))
    assert info.samplerate == SR and info.channels == 1
    if fmt in ("wav", "flac"):
        got, _ = sf.read(io.BytesIO(data), dtype="int16")
        np.testing.assert_array_equal(got, float_to_int16(ref))
        return
    got, _ = sf.read(io.BytesIO(data), dtype="float32")
    # A streamed MP3 has no LAME header: it starts with the encoder's delay (< 0.1 s).
    assert 0 <= len(got) - len(ref) <= 0.1 * SR
    lags = range(0, len(got) - len(ref) + 1)
    lag = max(lags, key=lambda k: float(np.dot(got[k : k + SR], ref[:SR])))
    corr = np.corrcoef(got[lag : lag + len(ref)], ref)[0, 1]
    assert corr > 0.85, corr


def _ogg_granules(data: bytes) -> list[int]:
    """Granule positions (48 kHz samples) of the Ogg pages in ``data``."""
    return [
        int.from_bytes(data[m.start() + 6 : m.start() + 14], "little", signed=True)
        for m in re.finditer(b"OggS", data)
    ]


def test_opus_pages_leave_the_encoder_every_frame():
    """A streamed Opus response carries each 80 ms frame's audio as it is encoded, not
    once a second (libsndfile's default page latency)."""
    from voxtral_mlx.server.formats import make_encoder

    audio = _tone(1.0)
    encoder = make_encoder("opus", SR)
    parts = [encoder.write(audio[i : i + 1920]) for i in range(0, len(audio), 1920)]
    parts.append(encoder.finish())
    assert _ogg_granules(parts[0])[:2] == [0, 0]  # the two header pages come first
    for i, part in enumerate(parts[:-1]):
        assert max(_ogg_granules(part)) > 0, i  # audio out after every frame
    got, sr = sf.read(io.BytesIO(b"".join(parts)), dtype="float32")
    assert sr == SR and len(got) == len(audio)
    assert np.corrcoef(got, audio)[0, 1] > 0.95
    # The same audio, the same bytes (libsndfile numbered each stream at random).
    again = make_encoder("opus", SR)
    same = [again.write(audio[i : i + 1920]) for i in range(0, len(audio), 1920)]
    assert [*same, again.finish()] == parts


def test_wav_streams_with_an_unknown_length_header(http):
    body = {"input": "Short one.", "response_format": "wav", "seed": 1}
    with http.stream("POST", "/v1/audio/speech", json=body) as r:
        assert r.headers["content-type"] == "audio/wav"
        assert r.headers.get("transfer-encoding") == "chunked"
        data = r.read()
    assert data[:4] == b"RIFF" and data[8:16] == b"WAVEfmt "
    assert data[4:8] == b"\xff\xff\xff\xff" and data[40:44] == b"\xff\xff\xff\xff"
    assert len(data) == 44 + MAX_FRAMES * 1920 * 2


def test_flac_is_one_whole_file_with_its_length(http):
    r = http.post("/v1/audio/speech", json={"input": "Short one.", "response_format": "flac"})
    assert r.headers["content-type"] == "audio/flac"
    assert int(r.headers["content-length"]) == len(r.content)
    assert sf.info(io.BytesIO(r.content)).frames == MAX_FRAMES * 1920


def test_default_format_is_mp3(http):
    r = http.post("/v1/audio/speech", json={"model": "anything", "input": "Hi.", "voice": "echo"})
    assert r.status_code == 200 and r.headers["content-type"] == "audio/mpeg"
    assert sf.info(io.BytesIO(r.content)).format == "MP3"


def test_lenient_parts_of_the_body(http):
    """No Content-Type is read as JSON, a voice may be {"id": name}, instructions are
    accepted (and ignored), speed 1 changes nothing."""
    body = {
        "input": "Hi.",
        "voice": {"id": "nova"},
        "instructions": "Speak softly.",
        "speed": 1,
        "response_format": "pcm",
    }
    r = http.post("/v1/audio/speech", content=json.dumps(body).encode())
    assert "content-type" not in r.request.headers
    assert r.status_code == 200 and len(r.content) == MAX_FRAMES * 1920 * 2


def test_sse_events_carry_the_audio(tts, http):
    body = {"input": TEXT, "voice": "fr_male", "response_format": "pcm", "stream_format": "sse"}
    with http.stream("POST", "/v1/audio/speech", json={**body, "seed": 11}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    deltas, done = events[:-1], events[-1]
    assert deltas and all(e["type"] == "speech.audio.delta" for e in deltas)
    audio = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    ref = tts.synthesize(TEXT, "fr_male", seed=11, split=True, max_frames=MAX_FRAMES)
    np.testing.assert_array_equal(pcm16(audio), float_to_int16(ref.audio))
    assert done["type"] == "speech.audio.done"
    usage = done["usage"]
    assert usage["output_tokens"] == len(ref.codes) and usage["input_tokens"] > 10
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


# -- speed -------------------------------------------------------------------------------


@pytest.mark.parametrize("speed", [0.5, 1.5])
def test_speed_stretches_without_changing_the_samples_otherwise(tts, client, speed):
    speech = client.audio.speech.create(
        model="tts-1",
        voice="neutral_male",
        input="Speed test sentence.",
        response_format="pcm",
        speed=speed,
        extra_body={"seed": 5},
    )
    ref = reference(tts, "Speed test sentence.", "neutral_male", 5)
    expected = float_to_int16(time_stretch(ref, speed, SR))
    assert len(expected) == round(len(ref) / speed)
    np.testing.assert_array_equal(pcm16(speech.content), expected)


def _tone(seconds: float = 2.0) -> np.ndarray:
    t = np.arange(int(seconds * SR)) / SR
    voiced = 0.3 * np.sin(2 * np.pi * 180 * t) + 0.15 * np.sin(2 * np.pi * 360 * t + 1)
    return (voiced * (0.6 + 0.4 * np.sin(2 * np.pi * 2 * t))).astype(np.float32)


def _peak_hz(x: np.ndarray) -> float:
    spectrum = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    return float(np.argmax(spectrum)) * SR / len(x)


@pytest.mark.parametrize("speed", [0.25, 0.5, 0.8, 1.25, 2.0, 4.0])
def test_time_stretch_keeps_pitch_and_level(speed):
    x = _tone()
    y = time_stretch(x, speed, SR)
    assert len(y) == round(len(x) / speed)
    mid = y[len(y) // 4 : 3 * len(y) // 4]
    assert abs(_peak_hz(mid) - 180) <= SR / len(mid) + 0.5  # within one FFT bin
    assert 0.95 < np.sqrt(np.mean(mid**2)) / np.sqrt(np.mean(x[len(x) // 4 :] ** 2)) < 1.05
    # No clicks: no step between samples is larger than the tone's own.
    assert np.abs(np.diff(y)).max() <= 1.01 * np.abs(np.diff(x)).max()
    np.testing.assert_array_equal(y[:240], x[:240])  # it starts exactly as the input


def test_time_stretch_is_the_same_in_any_chunking():
    x = _tone(1.3)
    rng = np.random.default_rng(0)
    for speed in (0.6, 1.7):
        whole = time_stretch(x, speed, SR)
        stretcher, parts, i = TimeStretcher(speed, SR), [], 0
        while i < len(x):
            n = int(rng.integers(1, 4000))
            parts.append(stretcher.process(x[i : i + n]))
            i += n
        parts.append(stretcher.flush())
        np.testing.assert_array_equal(np.concatenate(parts), whole)
    np.testing.assert_array_equal(time_stretch(x, 1.0, SR), x)
    assert len(time_stretch(x[:7], 2.0, SR)) == 4
    with pytest.raises(ValueError):
        TimeStretcher(4.5, SR)


# -- streaming, cancellation, concurrency --------------------------------------------------


def test_audio_flows_before_generation_ends(client, tts):
    t0 = time.perf_counter()
    first = None
    parts = []
    with client.audio.speech.with_streaming_response.create(
        model="tts-1",
        voice="nova",
        input=LONG[:1200],
        response_format="pcm",
        extra_body={"seed": 3},
    ) as response:
        for part in response.iter_bytes():
            if first is None and part:
                first = time.perf_counter() - t0
            parts.append(part)
    total = time.perf_counter() - t0
    assert first is not None and total > 1.0, total
    assert first < 0.25 * total, (first, total)
    ref = reference(tts, LONG[:1200], "cheerful_female", 3)
    np.testing.assert_array_equal(pcm16(b"".join(parts)), float_to_int16(ref))


def test_client_disconnect_stops_generation(server, http, tts):
    segments = len(tts.stream(LONG, split=True).segments)
    before = idle(server)
    body = {"input": LONG, "response_format": "pcm"}
    with http.stream("POST", "/v1/audio/speech", json=body) as r:
        assert r.status_code == 200
        parts, got = r.iter_bytes(), 0
        while got < 20 * 1920 * 2:
            got += len(next(parts))
        during = server.health()
        assert during["requests"] == 1 and during["active"] >= 1
        assert during["frames"] >= before["frames"] + 20  # counted as they are sent
        r.close()  # the client goes away mid-stream
    # The server cancels the request: its jobs leave the batch, nothing waits.
    after = idle(server)
    assert after["cancelled"] == before["cancelled"] + 1
    time.sleep(0.3)
    assert server.health()["frames"] == after["frames"]  # nothing is generated any more
    assert segments >= 8
    assert after["frames"] - before["frames"] < segments * MAX_FRAMES // 2


def test_concurrent_requests_share_the_batch(server, tts, client):
    texts = [f"Caller number {i} asks a question." for i in range(4)]
    results: dict[int, bytes] = {}
    errors: list[BaseException] = []
    active: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            active.append(server.health()["active"])
            time.sleep(0.01)

    def call(i: int) -> None:
        try:
            results[i] = client.audio.speech.create(
                model="tts-1",
                voice="casual_female",
                input=texts[i],
                response_format="pcm",
                extra_body={"seed": 20 + i},
            ).content
        except BaseException as e:
            errors.append(e)

    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    stop.set()
    watcher.join()
    assert not errors
    assert max(active) >= 2, active  # several requests in one batch
    for i, text in enumerate(texts):
        ref = reference(tts, text, "casual_female", 20 + i)
        np.testing.assert_array_equal(pcm16(results[i]), float_to_int16(ref))


@pytest.fixture(scope="module")
def pair_server(checkpoint, tmp_path_factory):
    """A batch of two and long segments (1000 frames, seconds each): whoever waits for a
    slot waits long."""
    args = ("--max-batch", "2", "--max-frames", "1000")
    srv = start_server(tmp_path_factory.mktemp("serve-pair"), checkpoint, *args)
    yield srv
    assert stop_server(srv) == 0


def _first_audio(sock: socket.socket) -> bytes:
    data = sock.recv(65536)
    assert data.startswith(b"HTTP/1.1 200"), data[:100]
    return data


def test_a_new_request_joins_the_batch_at_the_next_frame(pair_server):
    """A long text alone does not take the whole batch for its read-ahead segments: a
    second request starts at once instead of waiting for a segment (1000 frames) to end."""
    srv = pair_server
    idle(srv)
    first = _raw_request(srv.url, {"input": LONG, "response_format": "pcm"}, key=None)
    try:
        _first_audio(first)
        time.sleep(0.2)
        assert srv.health()["active"] == 1  # one segment: the other slot stays free
        t0 = time.monotonic()
        body = {"input": "Me too.", "response_format": "pcm"}
        with httpx.stream("POST", f"{srv.url}/v1/audio/speech", json=body, timeout=60) as r:
            assert r.status_code == 200
            parts = r.iter_bytes()  # kept: a dropped iterator closes the response
            next(parts)
            ttfb = time.monotonic() - t0
            assert srv.health()["active"] == 2
        assert ttfb < 3.0, ttfb
    finally:
        first.close()
    idle(srv)


def test_a_cancelled_request_leaves_the_queue_at_once(pair_server):
    """A request waiting for room in a full batch whose client goes away is dropped from
    the engine's queue right away, not when a slot frees (a whole segment later)."""
    srv = pair_server
    idle(srv)
    running = [_raw_request(srv.url, {"input": LONG, "response_format": "pcm"}, key=None)]
    running.append(_raw_request(srv.url, {"input": LONG, "response_format": "pcm"}, key=None))
    try:
        for sock in running:
            _first_audio(sock)
        waiting = _raw_request(srv.url, {"input": "Later.", "response_format": "pcm"}, key=None)
        wait_until(lambda: srv.health()["waiting"] == 1)
        waiting.close()
        t0 = time.monotonic()
        health = wait_until(lambda: (h := srv.health())["waiting"] == 0 and h, timeout=20)
        assert time.monotonic() - t0 < 2.0
        assert health["active"] == 2 and health["requests"] == 2 and health["cancelled"] >= 1
    finally:
        for sock in running:
            sock.close()
    idle(srv)


def _raw_request(
    url: str, body: dict, key: str | None = KEY, recv_buffer: int | None = None
) -> socket.socket:
    """A speech request on a plain socket whose response is never read (``recv_buffer``:
    a receive buffer that small, so the server's send blocks after a few frames)."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/audio/speech HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n"
    )
    if key:
        head += f"Authorization: Bearer {key}\r\n"
    sock = socket.socket()
    try:
        if recv_buffer is not None:  # before connecting: it sets the window offered
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, recv_buffer)
        sock.connect((host, int(port)))
        sock.sendall(head.encode() + b"\r\n" + data)
    except BaseException:
        sock.close()
        raise
    return sock


def test_a_full_queue_answers_429(server, client, http):
    idle(server)
    socks = [_raw_request(server.url, {"input": LONG, "response_format": "pcm"})]
    socks += [_raw_request(server.url, {"input": LONG}) for _ in range(MAX_QUEUE - 1)]
    try:
        wait_until(lambda: server.health()["requests"] == MAX_QUEUE)
        r = http.post("/v1/audio/speech", json={"input": "One more."})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        error = r.json()["error"]
        assert error["code"] == "rate_limit_exceeded" and error["type"] == "rate_limit_error"
        with pytest.raises(openai.RateLimitError):
            client.audio.speech.create(model="tts-1", voice="alloy", input="Me too.")
    finally:
        for s in socks:
            s.close()
    health = idle(server)
    assert health["rejected"] >= 2
    ok = http.post("/v1/audio/speech", json={"input": "Room again.", "response_format": "pcm"})
    assert ok.status_code == 200


# -- errors --------------------------------------------------------------------------------

JSON = {"Content-Type": "application/json", **AUTH}
BAD_REQUESTS = [
    ("empty input", {"input": ""}, 400, "input"),
    ("blank input", {"input": " \n\t "}, 400, "input"),
    ("missing input", {"voice": "alloy"}, 400, "input"),
    ("input not text", {"input": 42}, 400, "input"),
    ("oversized input", {"input": "a" * (MAX_CHARS + 1)}, 400, "input"),
    ("unknown voice", {"input": "Hi.", "voice": "bob"}, 400, "voice"),
    ("unknown format", {"input": "Hi.", "response_format": "ogg"}, 400, "response_format"),
    ("aac", {"input": "Hi.", "response_format": "aac"}, 400, "response_format"),
    ("speed too low", {"input": "Hi.", "speed": 0.1}, 400, "speed"),
    ("speed too high", {"input": "Hi.", "speed": 4.5}, 400, "speed"),
    ("speed not a number", {"input": "Hi.", "speed": "fast"}, 400, "speed"),
    ("unknown stream format", {"input": "Hi.", "stream_format": "ws"}, 400, "stream_format"),
    ("bad seed", {"input": "Hi.", "seed": -1}, 400, "seed"),
    ("unknown field", {"input": "Hi.", "sped": 2}, 400, "sped"),
    ("not an object", ["Hi."], 400, None),
]


def _assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and "\n" not in error["message"]
    assert "Traceback" not in r.text
    assert error["param"] == param
    return error


@pytest.mark.parametrize(("what", "body", "status", "param"), BAD_REQUESTS)
def test_bad_requests_get_openai_errors(http, what, body, status, param):
    r = http.post("/v1/audio/speech", content=json.dumps(body), headers=JSON)
    error = _assert_openai_error(r, status, param)
    assert error["type"] == "invalid_request_error"
    if what == "unknown voice":
        assert "casual_male" in error["message"] and "alloy" in error["message"]
    if what == "oversized input":
        assert error["code"] == "string_above_max_length"


def test_transport_level_mistakes(server, http):
    speech = f"{server.url}/v1/audio/speech"
    _assert_openai_error(http.post(speech, content=b"{not json", headers=JSON), 400)
    _assert_openai_error(http.post(speech, content=b"[" * 50000, headers=JSON), 400)
    huge = http.post(speech, content=b" " * (13 * MAX_CHARS + 65536), headers=JSON)
    assert _assert_openai_error(huge, 413)["code"] == "request_too_large"
    form = http.post(speech, data={"input": "Hi."})
    assert _assert_openai_error(form, 415)["code"] == "unsupported_media_type"
    body = '{"input": "Caf\u00e9."}'.encode("latin-1")
    latin = http.post(
        speech, content=body, headers={"Content-Type": "application/json; charset=latin-1"}
    )
    assert "unsupported charset 'latin-1'" in _assert_openai_error(latin, 415)["message"]
    ascii_json = {"Content-Type": "application/json; charset=US-ASCII"}
    ascii_ok = http.post(speech, content=b'{"input": "Hi.", "seed": 1}', headers=ascii_json)
    assert ascii_ok.status_code == 200, ascii_ok.text
    # A compressed body was read as JSON: "it holds NUL bytes, as UTF-16 or UTF-32 does".
    gzipped = http.post(
        speech,
        content=gzip.compress(b'{"input": "Hi."}'),
        headers={**JSON, "Content-Encoding": "gzip"},
    )
    assert "unsupported Content-Encoding 'gzip'" in _assert_openai_error(gzipped, 415)["message"]
    plain = http.post(
        speech,
        content=b'{"input": "Hi.", "seed": 1}',
        headers={**JSON, "Content-Encoding": "identity"},
    )
    assert plain.status_code == 200, plain.text
    cut = http.post(speech, content=b'{"input": "abc', headers=JSON)
    assert (
        "Unterminated string starting at line 1 column 11"
        in _assert_openai_error(cut, 400)["message"]
    )
    two = [("Content-Type", "application/json"), ("Content-Type", "text/plain")]
    twice = http.post(speech, content=b'{"input": "Hi."}', headers=two)
    assert "more than one Content-Type" in _assert_openai_error(twice, 400)["message"]
    missing = httpx.post(speech, json={"input": "Hi."})
    assert _assert_openai_error(missing, 401)["code"] == "missing_api_key"
    assert missing.headers["www-authenticate"] == "Bearer"
    wrong = httpx.post(speech, json={"input": "Hi."}, headers={"Authorization": "Bearer no"})
    assert _assert_openai_error(wrong, 401)["code"] == "invalid_api_key"
    assert "--api-key" in wrong.json()["error"]["message"]
    empty = httpx.post(speech, json={"input": "Hi."}, headers={"Authorization": "Bearer"})
    assert _assert_openai_error(empty, 401)["code"] == "missing_api_key"
    basic = httpx.post(speech, json={"input": "Hi."}, headers={"Authorization": "Basic eDp5"})
    basic_error = _assert_openai_error(basic, 401)
    assert basic_error["code"] == "invalid_api_key" and "Bearer scheme" in basic_error["message"]
    for bare in (KEY, f"Token\t{KEY}"):  # a key sent without its scheme is not echoed back
        response = httpx.post(speech, json={"input": "Hi."}, headers={"Authorization": bare})
        assert _assert_openai_error(response, 401)["code"] == "invalid_api_key"
        assert KEY not in response.text
    for order in ((f"Bearer {KEY}", "Bearer no"), ("Bearer no", f"Bearer {KEY}")):
        both = [("Authorization", v) for v in order]
        response = http.post(speech, json={"input": "Hi."}, headers=both)
        error = _assert_openai_error(response, 401)
        assert "more than one Authorization header" in error["message"]
    assert _assert_openai_error(http.get("/v1/nothing"), 404)["code"] == "not_found"
    assert _assert_openai_error(http.get("/nothing"), 404)["code"] == "not_found"
    slash = http.post("/v1/audio/speech/", json={"input": "Hi."}, headers={"host": "evil.example"})
    assert _assert_openai_error(slash, 404)["code"] == "not_found"
    assert "location" not in slash.headers
    not_allowed = http.get("/v1/audio/speech")
    _assert_openai_error(not_allowed, 405)
    assert not_allowed.headers["allow"] == "POST"
    _assert_openai_error(http.delete("/v1/models"), 405)


def test_voice_names_ignore_case_when_unambiguous():
    from voxtral_mlx.server.request import resolve_voice

    voices = {"casual_male": 1, "neutral_female": 2}
    assert resolve_voice("CASUAL_MALE", voices, "casual_male") == "casual_male"
    assert resolve_voice("Alloy", voices, "casual_male") == "neutral_female"
    both = {"a_voice": 1, "A_Voice": 2}
    with pytest.raises(APIError, match="is ambiguous: it matches A_Voice, a_voice"):
        resolve_voice("A_VOICE", both, "a_voice")


def test_the_openai_client_retrieves_the_model(server, client):
    (model,) = client.models.list().data
    assert client.models.retrieve(model.id).id == model.id
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("tts-1")


def test_the_openai_client_sees_its_own_exceptions(server, client):
    with pytest.raises(openai.BadRequestError) as err:
        client.audio.speech.create(model="tts-1", voice="nobody", input="Hi.")
    assert err.value.status_code == 400 and err.value.param == "voice"
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.audio.speech.create(model="tts-1", voice="alloy", input="Hi.")
    bad.close()


class _Voices(dict):
    broken: ClassVar[dict] = {}


def _fake_model(**parts) -> SimpleNamespace:
    """What create_app() reads of a loaded model, one voice, with ``parts`` (how its
    requests are run) added."""
    return SimpleNamespace(
        voices=_Voices(casual_male=SimpleNamespace(language="en")),
        default_voice="casual_male",
        load_voice=lambda name: name,
        sample_rate=SR,
        engine=SimpleNamespace(
            max_batch=4, stats=lambda: {"active": 0, "waiting": 0, "parked": 0, "max_batch": 4}
        ),
        **parts,
    )


def test_server_errors_are_json_without_details():
    """An internal failure is a 500 in OpenAI's shape (in-process: it cannot be provoked
    from outside a healthy server)."""
    from concurrent.futures import Future

    from starlette.testclient import TestClient

    from voxtral_mlx.server import ServerConfig, create_app

    def failing_submit(fn):
        future: Future = Future()
        future.set_exception(RuntimeError("secret internal detail"))
        return future

    app = create_app(_fake_model(worker=SimpleNamespace(submit=failing_submit)), ServerConfig())
    with TestClient(app, raise_server_exceptions=False) as tc:
        r = tc.post("/v1/audio/speech", json={"input": "Hi.", "response_format": "wav"})
        error = _assert_openai_error(r, 500)
        assert error["type"] == "server_error" and "secret" not in r.text
        assert tc.get("/health").json()["requests"] == 0


def test_a_request_whose_stream_cannot_be_opened_or_set_up_counts_as_failed(monkeypatch):
    """The model refusing a request when its stream is opened (a voice file damaged since
    start-up, say), or its encoder failing to start, frees the request's slot and shows in
    /health's failed count, as a failure while generating does; an opened stream is
    cancelled."""
    from starlette.testclient import TestClient

    from voxtral_mlx.errors import CheckpointError
    from voxtral_mlx.server import ServerConfig, create_app
    from voxtral_mlx.server import app as app_module

    opened = []

    def refusing_astream(*args, **kwargs):
        if not opened:
            opened.append(None)
            raise CheckpointError("/srv/voices/casual_male.pt: damaged since start-up")
        stream = SimpleNamespace(cancelled=False)
        stream.cancel = lambda: setattr(stream, "cancelled", True)
        opened.append(stream)
        return stream

    def failing_encoder(*args, **kwargs):
        raise RuntimeError("the encoder's library went missing")

    app = create_app(_fake_model(astream=refusing_astream), ServerConfig())
    with TestClient(app, raise_server_exceptions=False) as tc:
        r = tc.post("/v1/audio/speech", json={"input": "Hi.", "response_format": "wav"})
        error = _assert_openai_error(r, 500)
        assert "/srv" not in error["message"]
        health = tc.get("/health").json()
        assert health["requests"] == 0 and health["failed"] == 1
        monkeypatch.setattr(app_module, "make_encoder", failing_encoder)
        r = tc.post("/v1/audio/speech", json={"input": "Hi.", "response_format": "wav"})
        assert r.status_code == 500 and "went missing" not in r.text
        assert len(opened) == 2 and opened[1].cancelled
        health = tc.get("/health").json()
        assert health["requests"] == 0 and health["failed"] == 2


class _Reduce:
    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def test_a_voice_whose_file_is_unusable_is_not_offered_and_fails_as_the_servers_fault(
    tiny_checkpoint, tmp_path, caplog
):
    """Found when the app is made (as `voxtral-mlx voices` does): not listed, and a request
    for it is a 500 (the request was valid), logged; the other voices still speak."""
    import logging
    import os
    import shutil

    import torch
    from starlette.testclient import TestClient

    from voxtral_mlx.server import ServerConfig, create_app

    model = tmp_path / "model"
    shutil.copytree(tiny_checkpoint, model)
    marker = tmp_path / "PWNED"
    tts = voxtral_mlx.load(model, prefix_cache_dir=None)
    bad = "neutral_female"  # OpenAI's alloy and shimmer
    assert bad in tts.voices and bad != tts.default_voice
    tts.close()
    evil = _Reduce(os.system, f"touch {marker}")
    torch.save({"embedding": torch.ones(3), "extra": evil}, model / "voice_embedding" / f"{bad}.pt")
    tts = voxtral_mlx.load(model, prefix_cache_dir=None)
    try:
        assert bad in tts.voices  # the damage shows only when the file is read
        with caplog.at_level(logging.WARNING, logger="uvicorn.error"):
            app = create_app(tts, ServerConfig(max_frames=3))
        assert f"voice '{bad}' is unusable and not offered" in caplog.text
        with TestClient(app, raise_server_exceptions=False) as tc:
            listed = [v["id"] for v in tc.get("/v1/audio/voices").json()["data"]]
            assert bad not in listed and tts.default_voice in listed
            r = tc.post("/v1/audio/speech", json={"input": "Hi.", "voice": bad})
            error = _assert_openai_error(r, 500)
            assert error["type"] == "server_error"
            assert f"voice '{bad}' is unavailable on this server" in error["message"]
            assert str(model) not in r.text
            assert tc.get("/health").json()["failed"] == 1  # counted as the server's failure
            # Asked by its OpenAI name: that name is what the client knows.
            r = tc.post("/v1/audio/speech", json={"input": "Hi.", "voice": "Shimmer"})
            error = _assert_openai_error(r, 500)
            assert f"voice 'Shimmer' ('{bad}') is unavailable" in error["message"]
            assert tc.get("/health").json()["failed"] == 2
            r = tc.post("/v1/audio/speech", json={"input": "Hi.", "response_format": "wav"})
            assert r.status_code == 200 and sf.info(io.BytesIO(r.content)).frames > 0
            # An unknown voice's error lists what can be asked for, as the listing does.
            r = tc.post("/v1/audio/speech", json={"input": "Hi.", "voice": "nobody"})
            offered = _assert_openai_error(r, 400, "voice")["message"].split("available voices: ")[
                1
            ]
            assert bad not in offered and tts.default_voice in offered
            assert "alloy" not in offered and "shimmer" not in offered  # bad's OpenAI names
    finally:
        tts.close()
    assert not marker.exists()


def test_a_model_without_its_default_voice_serves_requests_that_name_one(tiny_checkpoint, tmp_path):
    """No casual_male: `serve` warms up another voice and starts; a request naming no voice
    is told to name one (no other voice speaks in its place). casual_male as a dangling
    link or a damaged file: such a request is the server's fault, as for any unusable file,
    and the server still starts."""
    import os
    import shutil

    from starlette.testclient import TestClient

    from voxtral_mlx.cli.serve import warmup_voice
    from voxtral_mlx.server import ServerConfig, create_app

    model = tmp_path / "model"
    shutil.copytree(tiny_checkpoint, model)
    default = model / "voice_embedding" / "casual_male.pt"
    for damage in ("absent", "dangling", "damaged"):
        default.unlink(missing_ok=True)
        if damage == "dangling":
            os.symlink(tmp_path / "deleted-blob", default)
        elif damage == "damaged":
            default.write_bytes(b"not a pickle")
        tts = voxtral_mlx.load(model, prefix_cache_dir=None)
        try:
            assert warmup_voice(tts) == "ar_male"
            app = create_app(tts, ServerConfig(max_frames=3))
            with TestClient(app, raise_server_exceptions=False) as tc:
                listed = [v["id"] for v in tc.get("/v1/audio/voices").json()["data"]]
                assert "casual_male" not in listed and "ar_male" in listed
                r = tc.post("/v1/audio/speech", json={"input": "Hi."})
                if damage == "absent":
                    error = _assert_openai_error(r, 400, "voice")
                    assert "voice is required" in error["message"]
                else:
                    error = _assert_openai_error(r, 500)
                    assert "voice 'casual_male' is unavailable" in error["message"]
                r = tc.post("/v1/audio/speech", json={"input": "Hi.", "voice": "casual_male"})
                if damage == "absent":
                    error = _assert_openai_error(r, 400, "voice")
                    assert "unknown voice 'casual_male'" in error["message"]
                else:  # the voice is there, its file is not usable: not the request's fault
                    error = _assert_openai_error(r, 500)
                    assert "voice 'casual_male' is unavailable" in error["message"]
                body = {"input": "Hi.", "voice": "ar_male", "response_format": "wav"}
                r = tc.post("/v1/audio/speech", json=body)
                assert r.status_code == 200 and sf.info(io.BytesIO(r.content)).frames > 0
        finally:
            tts.close()


def test_a_request_stopped_by_the_model_is_a_logged_500_and_bad_input_a_400(caplog):
    """Errors met when a request's stream is opened: the request's fault or the server's."""
    import logging

    from voxtral_mlx.errors import CheckpointError, InputError
    from voxtral_mlx.server.errors import request_failed

    with caplog.at_level(logging.ERROR, logger="uvicorn.error"):
        bad_input = request_failed(InputError("text is empty: give some words to speak"))
        damaged = request_failed(CheckpointError("/srv/models/x/consolidated.safetensors: bad"))
    assert bad_input.status == 400 and "text is empty" in bad_input.message
    assert damaged.status == 500 and damaged.type == "server_error"
    assert "/srv/models" not in damaged.message and "/srv/models" in caplog.text
    assert b'{"error":{"message":' in damaged.response().body


# -- lifecycle -----------------------------------------------------------------------------


def _read_all(sock: socket.socket, timeout: float = 20) -> bytes:
    sock.settimeout(timeout)
    data = b""
    while part := sock.recv(65536):
        data += part
    return data


def test_ctrl_c_stops_the_server_cleanly_mid_stream(checkpoint, tmp_path):
    srv = start_server(tmp_path, checkpoint, "--max-frames", "400", "--max-batch", "1")
    sock = _raw_request(srv.url, {"input": LONG, "response_format": "pcm"}, key=None)
    waiting = None
    try:
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")  # audio is flowing
        # A second request waits for room in the batch (of one).
        waiting = _raw_request(srv.url, {"input": "Wait.", "response_format": "flac"}, key=None)
        wait_until(lambda: srv.health()["requests"] == 2)
        t0 = time.monotonic()
        assert stop_server(srv) == 0
        assert time.monotonic() - t0 < 15
        # Cut off before any audio: a 503 in OpenAI's shape, not a bare 500.
        head, _, body = _read_all(waiting).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503"), head
        assert b"retry-after: 1" in head.lower()
        error = json.loads(body)["error"]
        assert error["code"] == "server_shutting_down" and error["type"] == "server_error"
    finally:
        sock.close()
        if waiting is not None:
            waiting.close()
    log = srv.log.read_text()
    assert "Traceback" not in log and "Finished server process" in log
    assert "without starting response" not in log
    # the cut-off requests are said once, at INFO, not as an ASGI error per response
    assert "stopping: cutting off 2 speech request(s)" in log
    assert "ERROR" not in log and "without completing response" not in log


def test_a_client_that_stops_reading_is_cut_off_with_one_warning(checkpoint, tmp_path):
    """uvicorn's "ASGI callable returned without completing response." ERROR followed the
    warning for every such cut-off, made on purpose."""
    srv = start_server(tmp_path, checkpoint, "--max-frames", "400", "--send-timeout", "2")
    body = {"input": LONG, "response_format": "pcm"}
    sock = _raw_request(srv.url, body, key=None, recv_buffer=4096)  # full after a few frames
    try:
        wait_until(lambda: srv.health()["cancelled"] == 1, timeout=60)
        # The connection is dropped with what the server held for it: it stayed open (the
        # server waiting to flush megabytes to a client that does not read), so clients
        # that never read held sockets and buffers without end.
        received = _read_until_closed(sock, timeout=10)
        assert received < 512 * 1024, received
    finally:
        sock.close()
    assert stop_server(srv) == 0
    log = srv.log.read_text()
    assert "client stopped reading for 2 s: its speech response is cut off" in log
    assert "ERROR" not in log and "without completing response" not in log


def test_a_stalled_client_does_not_hold_up_a_shutdown(checkpoint, tmp_path):
    """Cut off by Ctrl-C while its client did not read, a response's connection waited to
    be flushed: the server exited after uvicorn's own 3 s more, with an ERROR line."""
    srv = start_server(tmp_path, checkpoint, "--max-frames", "400")
    body = {"input": LONG, "response_format": "pcm", "speed": 0.25}
    sock = _raw_request(srv.url, body, key=None, recv_buffer=4096)
    try:
        wait_until(lambda: srv.health()["frames"] > 40, timeout=60)  # its buffers are full
        t0 = time.monotonic()
        assert stop_server(srv) == 0
        took = time.monotonic() - t0
    finally:
        sock.close()
    log = srv.log.read_text()
    assert "stopping: cutting off 1 speech request(s)" in log
    assert "ERROR" not in log and "Traceback" not in log, log
    assert took < 6.0, took  # the 3 s grace, not 3 s more waiting for the connection


def _read_until_closed(sock: socket.socket, timeout: float) -> int:
    """Bytes read until the server closes the connection (or resets it)."""
    sock.settimeout(timeout)
    total = 0
    try:
        while chunk := sock.recv(65536):
            total += len(chunk)
    except ConnectionResetError:
        pass
    return total


def test_a_second_ctrl_c_cuts_the_grace_short(checkpoint, tmp_path):
    """As uvicorn's own: the first Ctrl-C lets streams finish for 3 s, the second stops now."""
    srv = start_server(tmp_path, checkpoint, "--max-frames", "400")
    sock = _raw_request(srv.url, {"input": LONG, "response_format": "pcm"}, key=None)
    try:
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")  # audio is flowing
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGINT)
        wait_until(lambda: "letting 1 speech request(s) finish" in srv.log.read_text())
        srv.proc.send_signal(signal.SIGINT)
        assert srv.proc.wait(30) == 0
        assert time.monotonic() - t0 < 2.5  # the grace is 3 s
    finally:
        sock.close()
        if srv.proc.poll() is None:
            srv.proc.kill()
    log = srv.log.read_text()
    assert "Traceback" not in log and "Finished server process" in log


def test_sigterm_stops_gracefully_then_ends_by_the_signal(checkpoint, tmp_path):
    """As the docs say: a supervisor's SIGTERM gets uvicorn's graceful stop, and the exit
    status of a process the signal ended (143 in a shell), not 0."""
    srv = start_server(tmp_path, checkpoint, "--no-warmup")
    try:
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(30) == -signal.SIGTERM
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
    log = srv.log.read_text()
    assert "Traceback" not in log and "Finished server process" in log


def test_ctrl_c_while_a_body_is_arriving_answers_503_at_once(checkpoint, tmp_path):
    """The half-sent request waited for uvicorn's grace to run out, then got a text/plain
    500 and the log a traceback after 'Finished server process'."""
    srv = start_server(tmp_path, checkpoint)
    host, port = srv.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    try:
        sock.sendall(
            b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"input":'
        )
        wait_until(lambda: srv.health()["requests"] == 0)  # the server is up and reading
        time.sleep(0.3)
        t0 = time.monotonic()
        assert stop_server(srv) == 0
        head, _, body = _read_all(sock).partition(b"\r\n\r\n")
    finally:
        sock.close()
    assert time.monotonic() - t0 < 3  # not after the 3 s grace
    assert head.startswith(b"HTTP/1.1 503") and b"application/json" in head.lower()
    assert json.loads(body)["error"]["code"] == "server_shutting_down"
    log = srv.log.read_text()
    assert "Traceback" not in log and "ERROR" not in log and "Finished server process" in log


def test_a_taken_port_is_a_one_line_error(server, checkpoint):
    port = server.url.rsplit(":", 1)[1]
    cmd = [sys.executable, "-m", "voxtral_mlx", "serve", "-m", str(checkpoint), "--port", port]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and "cannot listen on" in done.stderr
