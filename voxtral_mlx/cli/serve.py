"""``voxtral-mlx serve``: the HTTP server."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from ..errors import InputError, VoxtralError
from ..interrupts import default_signals
from .loading import load_model
from .output import PROG, info
from .waiting import interruptibly

MAX_TIMEOUT_S = 86400.0  # serve's --body-timeout and --send-timeout


def cmd_serve(args: argparse.Namespace) -> int:
    import contextlib

    from ..engine import check_max_batch
    from ..server import API_KEY_ENV, ServerConfig, bind, create_app, serve

    check_max_batch(args.max_batch, "--max-batch")
    for name in ("max_queue", "max_input_chars", "max_frames"):
        if getattr(args, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} must be at least 1")
    if not 0 <= args.port <= 65535:
        raise InputError(f"--port {args.port} is not a TCP port: use 1 to 65535 (0: any free port)")
    for name in ("body_timeout", "send_timeout"):
        value = getattr(args, name)
        if not (math.isfinite(value) and 0 < value <= MAX_TIMEOUT_S):
            raise InputError(
                f"--{name.replace('_', '-')} must be a number of seconds from 0 (exclusive) "
                f"to {MAX_TIMEOUT_S:g}, got {value:g}"
            )
    if args.api_key is not None and not args.api_key:
        raise InputError(
            "--api-key is empty (an unset shell variable?): give the key, or leave --api-key "
            "out to serve without one"
        )
    if args.api_key is None and os.environ.get(API_KEY_ENV) == "":
        raise InputError(
            f"${API_KEY_ENV} is empty (an unset shell variable?): give the key, or unset it "
            "to serve without one"
        )
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if api_key is not None and (api_key != api_key.strip() or not api_key.isprintable()):
        raise InputError(
            "the API key starts or ends with spaces or holds control characters, which "
            "HTTP headers cannot carry: give one without them"
        )
    if api_key is not None and not api_key.isascii():
        raise InputError(
            "the API key holds characters beyond ASCII, which HTTP clients (openai's among "
            "them) refuse to send in a header: give an ASCII one"
        )
    sock = bind(args.host, args.port)  # a taken port fails before the model loads
    try:
        tts = load_model(args)
    except BaseException:
        sock.close()
        raise
    tts.engine.max_batch = args.max_batch
    voice = None if args.no_warmup else warmup_voice(tts)
    if voice is not None:  # the first clients must not wait for compilation or page-ins
        seconds = interruptibly(lambda: tts.warmup(voice).result())  # Ctrl-C on macOS too
        if args.log_level in ("info", "debug"):
            info(f"{PROG}: warmed up in {seconds:.1f} s")
    local = Path(args.model)
    model_id = local.resolve().name if local.is_dir() else args.model
    config = ServerConfig(
        model_id=model_id,
        api_key=api_key,
        max_input_chars=args.max_input_chars,
        max_queue=args.max_queue,
        max_frames=args.max_frames,
        body_timeout=args.body_timeout,
        send_timeout=args.send_timeout,
    )
    if api_key is None and not _is_loopback(args.host):
        info(f"{PROG}: warning: serving on {args.host} without an API key (--api-key)")

    def ready(url: str) -> None:
        info(f"{PROG}: serving {model_id} at {url} (POST {url}/v1/audio/speech; Ctrl-C stops)")

    # uvicorn stops gracefully on Ctrl-C or SIGTERM, then re-raises the signal to the
    # handler it found: Python's own, so that Ctrl-C ends here and SIGTERM ends the process.
    default_signals()
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how a server stops: no error
        serve(create_app(tts, config), sock, ready, log_level=args.log_level)
    # serve() has cancelled every request and the engine is idle; the model is closed at
    # exit, as every model is (by voxtral_mlx.worker's exit handler).
    return 0


def warmup_voice(tts) -> str | None:
    """The voice ``serve`` warms up: the default one, else the first that can be used (the
    server offers the others; a damaged file is the log's to report, not a reason not to
    start)."""
    from ..tts import DEFAULT_VOICE

    for name in [DEFAULT_VOICE, *(v for v in tts.voices if v != DEFAULT_VOICE)]:
        if name in tts.voices:
            try:
                return tts.load_voice(name)
            except VoxtralError:
                continue
    return None


def _is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (127.0.0.0/8, ::1 however written,
    localhost in any case): no warning for serving there without an API key."""
    import ipaddress

    if host.strip().lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False
