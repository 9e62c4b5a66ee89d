"""Load test of `voxtral-mlx serve` on loopback: N clients for M seconds, then it stops.

A server is started on a random checkpoint (tiny by default; END suppressed, so every
text segment runs exactly --max-frames frames) or on --model. Each client sends speech
requests back to back (streamed PCM), and abandons a fraction of them after the first
audio (a client disconnect: the server must cancel their generation). Printed: requests
per second, time to first byte (p50/p95), completed / cancelled / rejected / failed as
seen by the clients and by the server (nothing may be lost), and the server's resident
memory after warm-up and at the end (it should stay flat).

    python benchmarks/server_load.py [--clients 8] [--seconds 30] [--model DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from common import at_least_one, checkpoint, command_line, run_script

TEXTS = [
    "Hello there! How are you today?",
    "The lighthouse keeper woke before dawn. He climbed the stairs, as he had for years.",
    "Numbers, dates and names: 12 May 2024, Dr. Smith, 3.5 kilograms.",
    " ".join(f"Sentence number {i} of a longer paragraph goes here." for i in range(8)),
]
# OpenAI aliases and real names, as clients send them; a --model without some of them uses
# what its server lists (GET /v1/audio/voices).
VOICES = ["alloy", "nova", "casual_male", "fr_female"]


@dataclass
class Tally:
    completed: int = 0
    cancelled: int = 0
    rejected: int = 0  # 429
    failed: int = 0
    audio_bytes: int = 0
    ttfb: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status")
    if status.exists():
        match = re.search(r"VmRSS:\s+(\d+) kB", status.read_text())
        return int(match.group(1)) / 1024 if match else float("nan")
    out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True)
    return int(out.stdout.strip() or 0) / 1024


def start_server(model: Path, args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "voxtral_mlx", "serve", "-m", str(model), "--port", "0"]
    cmd += ["--max-batch", str(args.max_batch), "--max-queue", str(args.max_queue)]
    cmd += ["--max-frames", str(args.max_frames), "--log-level", "warning"]
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.monotonic() + 300
    while not (match := re.search(r"serving \S+ at (http://[\d.:]+)", log.read_text())):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            sys.exit(f"server did not start:\n{log.read_text()}")
        time.sleep(0.05)
    return proc, match.group(1)


def server_voices(url: str) -> list[str]:
    """Those of :data:`VOICES` the server knows (names or aliases), else its first four."""
    listing = httpx.get(f"{url}/v1/audio/voices", timeout=30).json()
    known = {v["id"].casefold() for v in listing["data"]} | {
        a.casefold() for a in listing.get("aliases", {})
    }
    usable = [v for v in VOICES if v.casefold() in known]
    return usable or [v["id"] for v in listing["data"]][:4]


async def one_request(
    client: httpx.AsyncClient, tally: Tally, cancel: bool, timeout: float, voices: list[str]
):
    body = {
        "input": random.choice(TEXTS),
        "voice": random.choice(voices),
        "response_format": "pcm",
    }
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/audio/speech", json=body, timeout=timeout) as r:
            if r.status_code == 429:
                await r.aread()
                tally.rejected += 1
                await asyncio.sleep(float(r.headers.get("retry-after", "1")))
                return
            if r.status_code != 200:
                tally.failed += 1
                tally.errors.append(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                return
            first, size = None, 0
            async for part in r.aiter_bytes():
                if first is None:
                    first = time.perf_counter() - t0
                    tally.ttfb.append(first)
                    if cancel:
                        tally.cancelled += 1
                        return  # leaving the block closes the connection mid-stream
                size += len(part)
            if size == 0 or size % 2:
                tally.failed += 1
                why = " (the model ended at its first frame?)" if size == 0 else ""
                tally.errors.append(f"bad PCM body of {size} bytes{why}")
                return
            tally.completed += 1
            tally.audio_bytes += size
            tally.latency.append(time.perf_counter() - t0)
    except (httpx.HTTPError, OSError) as e:
        tally.failed += 1
        tally.errors.append(f"{type(e).__name__}: {e}")


async def run_clients(url: str, args: argparse.Namespace, voices: list[str]) -> tuple[Tally, float]:
    tally = Tally()
    limits = httpx.Limits(max_connections=args.clients + 4)
    async with httpx.AsyncClient(base_url=url, limits=limits) as client:
        start = time.perf_counter()
        deadline = start + args.seconds

        async def client_loop(seed: int) -> None:
            rng = random.Random(seed)
            while time.perf_counter() < deadline:
                cancel = rng.random() < args.cancel_fraction
                await one_request(client, tally, cancel, args.request_timeout, voices)

        await asyncio.gather(*(client_loop(i) for i in range(args.clients)))
        return tally, time.perf_counter() - start


def wait_idle(url: str, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(f"{url}/health", timeout=10).json()
        busy = health["requests"] or health["active"] or health["waiting"]
        if not busy or time.monotonic() > deadline:
            return health
        time.sleep(0.05)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return (
        statistics.quantiles(values, n=100, method="inclusive")[q - 1]
        if len(values) > 1
        else values[0]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="model directory (default: random tiny)")
    parser.add_argument("--clients", type=at_least_one, default=8)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--cancel-fraction", type=float, default=0.2)
    parser.add_argument("--max-batch", type=at_least_one, default=4)
    parser.add_argument("--max-queue", type=int, default=64)
    parser.add_argument("--max-frames", type=at_least_one, default=40, help="per text segment")
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--record", action="store_true", help="append to benchmarks/RESULTS.md")
    parser.add_argument("--no-record", action="store_true", help="the default")
    args = parser.parse_args()

    model = args.model or checkpoint("tiny")
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "server.log"
        proc, url = start_server(model, args, log)
        try:
            warm = httpx.post(
                f"{url}/v1/audio/speech",
                json={"input": "Warm up.", "response_format": "pcm"},
                timeout=args.request_timeout,
            )
            warm.raise_for_status()
            if not warm.content:
                raise SystemExit(
                    f"{model}: the model ended the warm-up request at its first frame (END) and "
                    "sent no audio, so there is nothing to load-test: use a checkpoint that "
                    "speaks (voxtral-mlx random-checkpoint DIR --suppress-end)"
                )
            rss_start = rss_mib(proc.pid)
            voices = server_voices(url)
            tally, wall = asyncio.run(run_clients(url, args, voices))
            health = wait_idle(url)
            rss_end = rss_mib(proc.pid)
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                code = proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
        server_log = log.read_text()

    audio_s = tally.audio_bytes / 2 / 24000
    total = tally.completed + tally.cancelled + tally.rejected + tally.failed
    server = {k: health[k] for k in ("completed", "cancelled", "failed", "rejected")}
    server["completed"] -= 1  # the warm-up request
    client = {
        "completed": tally.completed,
        "cancelled": tally.cancelled,
        "failed": tally.failed,
        "rejected": tally.rejected,
    }
    print(f"model {model}  clients {args.clients}  {wall:.1f} s  max_batch {args.max_batch}")
    print(
        f"requests: {total} sent, {tally.completed / wall:.2f} completed/s, "
        f"{audio_s / wall:.2f} s of audio per second"
    )
    print(
        f"time to first byte: p50 {pct(tally.ttfb, 50) * 1000:.0f} ms, "
        f"p95 {pct(tally.ttfb, 95) * 1000:.0f} ms; full response p50 "
        f"{pct(tally.latency, 50):.2f} s, p95 {pct(tally.latency, 95):.2f} s"
    )
    print(f"client counts: {json.dumps(client)}")
    print(f"server counts: {json.dumps(server)}  (engine idle: {health['active'] == 0})")
    print(f"server RSS: {rss_start:.0f} MiB after warm-up, {rss_end:.0f} MiB at the end")
    print(f"server exit code after Ctrl-C: {code}")
    for error in tally.errors[:5]:
        print(f"error: {error}")
    lost = client != server
    if args.record and not args.no_record:
        from common import record

        record(
            f"HTTP server under load ({args.clients} clients, {wall:.0f} s, loopback)",
            command_line(__file__, sys.argv[1:]),
            [
                ("quantity", "value"),
                ("requests sent", str(total)),
                ("completed per second", f"{tally.completed / wall:.2f}"),
                ("seconds of audio per second", f"{audio_s / wall:.2f}"),
                (
                    "time to first byte p50 / p95",
                    f"{pct(tally.ttfb, 50) * 1000:.0f} / {pct(tally.ttfb, 95) * 1000:.0f} ms",
                ),
                (
                    "full response p50 / p95",
                    f"{pct(tally.latency, 50):.2f} / {pct(tally.latency, 95):.2f} s",
                ),
                ("client counts", json.dumps(client)),
                ("server counts", json.dumps(server)),
                ("nothing lost (client == server)", "yes" if not lost else "NO"),
                ("server RSS after warm-up / at the end", f"{rss_start:.0f} / {rss_end:.0f} MiB"),
                ("server exit code after Ctrl-C", str(code)),
            ],
            (
                f"Model: {model} (END as that checkpoint has it; segments run at most "
                f"{args.max_frames} frames)"
                if args.model
                else f"Model: {model.name} (tiny random checkpoint, END suppressed: every "
                f"segment runs {args.max_frames} frames)"
            )
            + f"; voices {', '.join(voices)}; max_batch {args.max_batch}; "
            f"{args.cancel_fraction:.0%} of requests abandoned after their first audio.",
        )
    if lost:
        print("MISMATCH between client and server counts")
    if "Traceback" in server_log:
        print("server log has a traceback:\n" + server_log[-3000:])
    return 1 if lost or tally.failed or code != 0 else 0


if __name__ == "__main__":
    run_script(main)
