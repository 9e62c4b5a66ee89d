"""An OpenAI-compatible speech server: ``voxtral-mlx serve`` (Starlette + uvicorn).

Start it with ``voxtral-mlx serve [-m MODEL] [--host 127.0.0.1] [--port 8000]`` and use any
OpenAI client::

    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    client.audio.speech.create(model="tts-1", voice="alloy", input="Hello!").write_to_file(...)

Endpoints
    ``POST /v1/audio/speech``  OpenAI's body: ``input`` (required; at most
    ``--max-input-chars``, default 4096 as OpenAI), ``voice`` (a voice of the model or an
    OpenAI name, below, case ignored when unambiguous; a string or ``{"id": name}``; default
    ``casual_male``),
    ``response_format`` (``mp3`` default, ``opus``, ``wav``, ``pcm``, ``flac``; ``aac`` is
    refused with 400), ``speed`` (0.25 to 4.0), ``stream_format`` (``audio`` default, or
    ``sse``). ``model`` is accepted and ignored (any string: the loaded model speaks; nothing
    is ever downloaded); ``instructions`` too (the model takes none). Extension: ``seed``
    (integer in [0, 2**62)) fixes the noise, so a request is reproducible: its audio equals
    ``tts.synthesize(input, voice, seed=seed, split=True, max_frames=--max-frames)``
    (byte for byte, in every format: an opus stream's Ogg serial number is fixed).
    Other fields are refused (400) so that typos do not pass silently.
    ``GET /v1/audio/voices``  the voices with their languages, and the OpenAI aliases.
    Every voice file is read when the server starts; one that cannot be used (damaged,
    refused) is logged and left out, and a request naming it is a 500.
    ``GET /v1/models``  the loaded model (id: the directory name or repo given with -m);
    ``GET /v1/models/{id}`` that model (404 for another id).
    ``GET /health``  ``{"status": "ok", "model": the id /v1/models lists, "requests":
    speech requests in progress,
    "active": text segments generating in the engine's batch (or set aside), "waiting":
    segments waiting to join it, "parked": read-ahead segments set aside for a newcomer,
    "max_batch", "max_queue", and counts since start: "completed",
    "cancelled" (client went away), "failed", "rejected" (429), "frames" (generated for
    responses, counted as they go)}``. Never needs the API key.

OpenAI voices (their presented gender, onto the model's English voices)
    alloy, shimmer: neutral_female; coral, nova: cheerful_female; marin, sage:
    casual_female; ballad, cedar, echo, onyx: neutral_male; ash, fable, verse: casual_male.

Audio and streaming
    Mono, 24 kHz. Long input is split into segments at natural pauses and the segments are
    generated as one batch (``split=True``); concurrent requests share the engine's batch
    frame by frame. Bytes go out as frames are decoded (chunked transfer, first bytes after
    the first 80 ms frame; later frames in chunks of up to 8, as far as a client playing in
    real time from the first byte is ahead, so the codec runs once per chunk): ``pcm`` is
    raw 16-bit little-endian; ``wav`` is PCM16 whose
    header declares an unknown length (0xFFFFFFFF); ``mp3`` (128 kbit/s CBR) is one MPEG
    stream without a LAME/Xing header, so it starts with the encoder's delay (about 80 ms,
    one silent frame included) and players learn its length only at the end; ``opus`` is
    one Ogg Opus stream (about 60 kbit/s; an Ogg page leaves the encoder every 60 ms).
    ``flac`` is encoded while generating but sent whole at the end with Content-Length
    (its header holds the sample count). With ``stream_format: "sse"`` the same bytes come
    as ``data: {"type": "speech.audio.delta", "audio": base64}`` events, then
    ``{"type": "speech.audio.done", "usage": {"input_tokens", "output_tokens" (frames),
    "total_tokens"}}``. ``speed`` other than 1 is a pitch-preserving WSOLA time stretch
    (:mod:`voxtral_mlx.audio.stretch`) applied as the audio streams.

Limits and errors
    At most ``--max-queue`` speech requests are in progress (generating, or waiting for
    room in the batch); more get 429 with ``Retry-After: 1``. A request generates two of
    its text segments at once only while the batch has room to spare (two per request
    in progress and one free), otherwise one at a time: concurrent requests share the
    batch, and a new one joins it at the next frame instead of waiting for another
    request's read-ahead segment. A client that disconnects cancels its request: its
    segments leave the batch at the next frame (and the queue at once). Errors use
    OpenAI's JSON ``{"error": {"message", "type", "param", "code"}}``: 400 bad body or
    JSON (strict: a key given twice, ``NaN`` or ``Infinity`` are refused; an input with
    nothing but spaces, control or zero-width characters is empty), 401 missing or wrong
    ``Authorization: Bearer`` key (when ``--api-key`` or ``$VOXTRAL_MLX_API_KEY`` is set),
    404 unknown route, 405 wrong method, 408 body not fully received within 30 s of the
    headers (``--body-timeout``; then the connection is closed), 413 body far beyond the
    input limit (refused at once when Content-Length declares it), 415 a Content-Type
    other than JSON or a compressed body (``Content-Encoding``), 422 ``no_audio`` when the
    model ends the text before its first frame (as ``speak`` refuses to write an empty
    file: rephrase it or send another seed), 429 queue full, 500 a
    server failure (details only in the server's log). A request whose body is still
    arriving is not yet in the queue; a client that stops reading the audio for 60 s
    (``--send-timeout``) is cut off and leaves it (its connection is reset, dropping what
    was buffered for it; so is one cut off by shutdown while not reading). A failure after
    audio has started closes the connection without the end of the chunked
    body. uvicorn has no deadline for the request line and headers: a connection that
    never completes them stays open (it holds a socket, not a queue slot) until the client
    or shutdown closes it; put a reverse proxy with a header timeout in front of a server
    exposed to untrusted clients. A request HTTP cannot parse (a malformed Content-Length, an
    oversized header) gets uvicorn's plain-text 400. A client that half-closes its side after
    sending the request (``nc -N``) is taken by uvicorn as gone: its request is cancelled.

Shutdown
    Ctrl-C (or SIGTERM) stops accepting connections, answers a request whose body is still
    arriving with 503 ``server_shutting_down`` at once, lets speech requests finish for up
    to 3 s, then cuts them off (their generation is cancelled; one that has sent no audio
    yet gets that 503, the others a truncated body) and exits. The log says so in one line
    each, at INFO. ``voxtral-mlx serve`` exits with status 0 after Ctrl-C and 143 after
    SIGTERM (the signal is re-raised once the server has stopped, as supervisors expect of
    a process that obeyed it); SIGHUP ends it at once (129). An error before it serves (a
    taken port, a model that does not load) is one line on stderr and status 1.
"""

from __future__ import annotations

from .app import ServerConfig, create_app
from .run import API_KEY_ENV, ServerError, bind, serve, url_of

__all__ = [
    "API_KEY_ENV",
    "ServerConfig",
    "ServerError",
    "bind",
    "create_app",
    "serve",
    "url_of",
]
