"""The loaded text-to-speech object: prompts, one-shot synthesis, streaming, decoding."""

from __future__ import annotations

import contextlib
import gc
import queue
import secrets
import threading
import time
import weakref
from collections.abc import AsyncIterable, Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import mlx.core as mx
import numpy as np

from .audio.stretch import check_speed
from .checkpoint import QuantSpec
from .config import ModelConfig
from .engine import (
    DONE,
    AudioChunk,
    Engine,
    Job,
    Timings,
    check_flag,
    check_whole,
    finite_float,
    not_finite_error,
)
from .errors import InputError, VoiceError, VoxtralError
from .fileio import one_line
from .generate import NoiseSource, Sequence, to_numpy
from .livetext import LiveText, is_text_pieces, is_unordered
from .loader import LoadedModel
from .model.flow import DEFAULT_CFG_ALPHA, MAX_CFG_ALPHA
from .playback import Playback
from .prefix_store import PrefixStore
from .residency import Residency
from .segment import EMPTY_TEXT, Segment, SplitStopped, is_blank, is_silent, split_text
from .textstream import AsyncTextStream, TextStream, check_pause
from .tokenizer import TekkenTokenizer, speech_prompt_ids
from .voices import Voice, VoiceRegistry, case_matches, no_voices_error
from .worker import WAIT_SLICE_S, Worker, WorkerFuture, closed_error

T = TypeVar("T")

__all__ = ["AudioChunk", "Speech", "Timings", "VoxtralTTS"]

DEFAULT_VOICE = "casual_male"
DEFAULT_MAX_FRAMES = 2400  # 192 s of audio at 12.5 frames/s
MAX_TEXT_TOKENS = 8192
SYNTH_CHUNK_FRAMES = 16
DECODE_PART_FRAMES = 16  # decode() runs this many frames per worker call
DEFAULT_MAX_CHARS = 400  # longest segment when splitting text (target: half of it)
MAX_LOOKAHEAD = 64  # segments of one text in flight at most (as many as a batch holds)
WARMUP_TEXT = "Hello."
# How long warmup() lets requests made meanwhile go first before it takes its turn.
WARMUP_YIELDS_S = 2.0


@dataclass(eq=False)  # compared by identity: ``==`` on its arrays would be ambiguous
class Speech:
    """A whole utterance.

    Attributes:
        audio: ``[samples]`` float32, mono, at ``sample_rate`` (24000 Hz); of a split text,
            the segments with their pauses.
        codes: ``[frames, 37]`` int32, the codes as generated (semantic first, each with
            its +2 offset).
        voice: the voice's name.
        seed: the noise seed (of a split text, segment ``i`` used ``seed + i``); None when
            the noise was given explicitly.
        timings: see :class:`~voxtral_mlx.engine.Timings`.
        segment_frames: frames of each segment, in order (one entry unless the text was
            split): where :meth:`VoxtralTTS.decode` starts the codec afresh, as generation
            did.
    """

    audio: np.ndarray
    sample_rate: int
    codes: np.ndarray
    voice: str
    seed: int | None
    timings: Timings = field(default_factory=Timings)
    segment_frames: tuple[int, ...] = ()

    @property
    def duration(self) -> float:
        """Seconds of audio (pauses included)."""
        return len(self.audio) / self.sample_rate


def _may_not_fit(text: str) -> bool:
    """Whether ``text`` could hold more tokens than one utterance takes: a token is at least
    one byte and a character at most four, so shorter texts need no tokenizing to know."""
    return 4 * len(text) > MAX_TEXT_TOKENS


def utterance_ids(tokenizer: TekkenTokenizer, text: str, what: str, fix: str) -> list[int]:
    """The token ids of ``text``, or a one-line :class:`InputError` (naming ``what`` and
    ``fix``) if they cannot fit one utterance; a text whose length alone shows it is never
    tokenized."""
    n = tokenizer.min_tokens(text)
    ids = None if n > MAX_TEXT_TOKENS else tokenizer.encode(text)
    if ids is None or len(ids) > MAX_TEXT_TOKENS:
        count = f"at least {n}" if ids is None else str(len(ids))
        raise InputError(
            f"{what} is too long for one utterance ({count} tokens, limit {MAX_TEXT_TOKENS}): {fix}"
        )
    return ids


class VoxtralTTS:
    """Voxtral-4B-TTS loaded for inference. Create it with :func:`voxtral_mlx.load`.

    Safe to use from several threads: all MLX work runs on the model's own worker thread,
    and concurrent requests share one batch of frames.

    Attributes (read them, do not assign):
        voices: the voices by name (a mapping of :class:`~voxtral_mlx.voices.Voice`, each
            with ``language``, e.g. ``{n: v.language for n, v in tts.voices.items()}`` for
            a voice picker).
        default_voice: the voice used when none is named.
        path: the model's folder; ``layout``: which weights were read (``"mistral"``,
            ``"voxtral-mlx"`` or ``"mlx-community"``), ``weight_files`` their files,
            ``quantized`` the quantized layers (by Mistral name).
        dtype: the compute dtype; ``config``: the model's configuration; ``tokenizer``: its
            Tekken tokenizer.
        engine: the batch scheduler (``engine.idle_cache_bytes``: see the README).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        worker: Worker,
        max_batch: int = 4,
        prefix_store: PrefixStore | None = None,
        residency: Residency | None = None,
    ):
        self.worker = worker
        # say()'s handles still playing: close() silences them (audio already generated
        # would otherwise play on, up to a minute of it).
        self._playbacks: weakref.WeakSet[Playback] = weakref.WeakSet()
        self._playbacks_lock = threading.Lock()
        self.model = loaded.model
        self.config: ModelConfig = loaded.config
        self.tokenizer: TekkenTokenizer = loaded.tokenizer
        self.voices: VoiceRegistry = loaded.voices
        self.dtype: mx.Dtype = loaded.dtype
        self.path: Path = loaded.path
        # Which weights were read: "mistral" (consolidated.safetensors), "voxtral-mlx" (our
        # conversion) or "mlx-community" (mlx-audio's names); quantized layers by Mistral name.
        self.layout: str = loaded.layout
        self.weight_files: tuple[Path, ...] = loaded.weight_files
        self.quantized: dict[str, QuantSpec] = dict(loaded.quantized)
        # The prompt up to the text: [BOS, BEGIN_AUDIO, AUDIO, NEXT_AUDIO_TEXT] with the one
        # AUDIO standing for the voice's rows.
        prefix = speech_prompt_ids(self.tokenizer, "", 1)[:-2]
        self.engine = Engine(
            self.model,
            prefix,
            prefix.index(self.config.audio_token_id),
            max_batch=max_batch,
            prefix_store=prefix_store,
            residency=residency,
        )
        worker.pump = self.engine.pump
        engine, release = self.engine, residency.release if residency is not None else None
        voices = self.voices

        def on_close() -> None:  # on the worker thread, before it ends
            engine.fail_all(closed_error())
            engine.release()
            voices.clear_cache()
            if release is not None:
                release()
            # The memory goes back to the system now: the flow head and the codec hold their
            # compiled steps (reference cycles only the collector breaks; in an idle app it
            # may not run for a long time), and MLX keeps freed buffers for reuse.
            gc.collect()
            mx.clear_cache()

        worker.on_close = on_close
        # An app that drops the object without close() must get the memory back: the worker
        # thread (which holds the engine, so the model) is told to let go once this object
        # is collected. Streams, handles and pending calls hold the object, so it outlives
        # them. At exit the worker module closes every worker itself, waiting for it.
        self._finalizer = weakref.finalize(self, worker.close, False)
        self._finalizer.atexit = False

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` on the model's worker thread and return its result.

        Needed for direct use of ``self.model`` (MLX arrays built on one thread cannot be
        evaluated on another); array results are evaluated before they are returned.
        """

        if not callable(fn):
            raise InputError(f"call() takes a function, got {type(fn).__name__}")

        def run() -> T:
            out = fn(*args, **kwargs)
            if isinstance(out, (mx.array, list, tuple, dict)):
                mx.eval(out)
            return out

        return self.worker.call(run)

    def warmup(
        self,
        voices: str | Iterable[str] | None = None,
        *,
        wait: bool = True,
        playback: bool = False,
    ) -> Future[float]:
        """Do now what the first requests would otherwise wait for: read the weights into
        memory, compile the frame for every batch size up to ``max_batch`` and the codec's
        steps, and prefill the prompt prefix of each of ``voices`` (a name or names; default:
        the default voice), kept in memory and on disk (see ``load(prefix_cache_dir=...)``).

        Call it when an app or server starts. It generates a few throwaway frames and
        changes no later output. ``wait=False`` returns at once; requests made meanwhile go
        first (warmup's own work waits, set aside, while they run) for up to 2 s, then
        warm-up takes its turn among them (so a stream of requests cannot hold it back for
        ever). The 8 most recent
        prefixes stay in memory, the others are read back from disk on use. Returns a future
        holding the seconds it took (or the error that stopped it, e.g. ``close()``; with
        ``wait=True`` that error is raised here instead); unknown voices are reported here,
        before anything runs.

        ``playback=True`` also starts the audio output library, finds the default output
        device and opens it once without playing (0.03-0.2 s the first :meth:`say` would
        otherwise spend before it returns); a missing PortAudio or output device is then the
        future's error, after the voices have been warmed up all the same.
        """
        playback, wait = check_flag("playback", playback), check_flag("wait", wait)
        if voices is None:
            names = [self.default_voice]
        elif isinstance(voices, str):
            names = [voices]
        elif isinstance(voices, Iterable) and not isinstance(voices, (bytes, bytearray)):
            names = list(voices)
            if not names:
                raise InputError("warmup() was given no voices: name one, or pass None")
        else:
            raise InputError(f"voices must be a voice name or several, got {type(voices).__name__}")
        names = list(dict.fromkeys(self._voice(v).name for v in names))
        future: Future[float] = WorkerFuture(self.worker)

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                audio_error = None
                if playback:
                    from .audio import player

                    try:
                        player.prepare_output(self.sample_rate)
                    except VoxtralError as e:  # the model's warm-up is still wanted
                        audio_error = e
                seconds = self._warm(names)
                if audio_error is not None:
                    raise audio_error
                future.set_result(seconds)
            except BaseException as e:
                future.set_exception(e)

        if wait:
            run()
            future.result()  # raises what stopped it
        else:
            threading.Thread(target=run, name="voxtral-mlx-warmup", daemon=True).start()
        return future

    def _warm(self, voices: list[str]) -> float:
        self.worker.refuse_wait()  # it waits for the jobs below, which need the worker
        t0 = time.perf_counter()
        batch = self.engine.max_batch
        # Jobs join one per frame, so with batch + 1 frames each the batch passes through
        # every size from 1 to max_batch (each a compiled shape of its own), and the first
        # job's audio goes through the codec's first and steady-state steps.
        jobs = [
            self.job(WARMUP_TEXT, voices[0], seed=i, max_frames=batch + 1) for i in range(batch)
        ]
        # The other voices only need their prefix: no frames.
        jobs += [self.job(WARMUP_TEXT, v, seed=0, max_frames=0) for v in voices[1:]]
        for job in jobs:
            job.ahead = True  # nobody waits for its audio: a real request goes first
            job.seq.ignore_end = True
        self._submit_all(jobs)
        # Requests go first for a while; then warm-up takes its turn among them, or a batch
        # kept full by requests would keep it waiting for as long as they come.
        yield_until = time.monotonic() + WARMUP_YIELDS_S
        for job in jobs:
            while True:
                # In slices, as every blocking call waits (see worker.wait_for).
                left = yield_until - time.monotonic() if job.ahead else WAIT_SLICE_S
                try:
                    item = job.output.get(timeout=max(0.0, min(left, WAIT_SLICE_S)))
                except queue.Empty:
                    if job.ahead and time.monotonic() >= yield_until:
                        for j in jobs:
                            j.needed()
                    continue
                if item is DONE:
                    break
                if isinstance(item, BaseException):
                    raise item
        return time.perf_counter() - t0

    def clear_prefix_cache(self) -> None:
        """Forget the cached voice prefixes, in memory and on disk (they are recomputed on
        next use)."""
        self.worker.call(self.engine.clear_prefix_cache)

    def close(self) -> None:
        """Stop this model's work (pending requests fail; say() stops playing, its wait()
        raising) and free the model; its worker thread ends.
        The object is unusable after. Dropping the last reference to the object does the
        same, later."""
        self._finalizer.detach()
        try:
            with self._playbacks_lock:
                playing = list(self._playbacks)
            for playback in playing:
                # An app's own player whose stop() fails must not keep the model loaded.
                with contextlib.suppress(Exception):
                    playback.end(closed_error())
        finally:
            # The memory comes back now, not when this object goes: switching models (close,
            # then load) must not hold both. The worker lets go of the rest.
            self.model = _ClosedModel()
            self.worker.close()

    def __enter__(self) -> VoxtralTTS:
        return self

    def __exit__(self, *exc_info: object) -> None:
        """``with voxtral_mlx.load(...) as tts:`` closes the model at the block's end."""
        self.close()

    @property
    def sample_rate(self) -> int:
        """Samples per second of the audio (24000 for Voxtral)."""
        return self.config.sampling_rate

    @property
    def samples_per_frame(self) -> int:
        """Samples of audio per generated frame (1920: 80 ms at 24 kHz)."""
        return self.config.samples_per_frame

    @property
    def max_batch(self) -> int:
        """Sequences (requests, text segments) generated together at most: the
        ``load(max_batch=...)`` given; further requests wait for a free slot."""
        return self.engine.max_batch

    @property
    def default_voice(self) -> str:
        """The voice used when none is named: ``casual_male``, as in Mistral's release. A
        model without it has no default (another voice would speak in another language or
        manner unasked); a damaged file of it is reported when it is used."""
        if DEFAULT_VOICE in self.voices or DEFAULT_VOICE in self.voices.broken:
            return DEFAULT_VOICE
        # Named but for case, as -v takes it (a voice file renamed Casual_Male.pt).
        found = case_matches(DEFAULT_VOICE, [(n, n) for n in [*self.voices, *self.voices.broken]])
        if found:  # two such files: the voice lookup says which are ambiguous
            return found[0] if len(found) == 1 else DEFAULT_VOICE
        if not self.voices:
            raise no_voices_error(self.path)
        names = one_line(", ".join(self.voices), 400)
        missing = (
            " (tekken.json lists it, but its file is missing: an incomplete download? fetch "
            "the model again)"
            if DEFAULT_VOICE in self.voices.missing
            else ""
        )
        raise VoiceError(
            f"{one_line(str(self.path))} has no voice {DEFAULT_VOICE!r}, the default one"
            f"{missing}: name a voice (-v on the command line, voice= in Python): {names}"
        )

    def _voice(self, voice: str | None) -> Voice:
        return self.voices.get_voice(self.default_voice if voice is None else voice)

    def _voice_tokens(self, v: Voice) -> int:
        return v.num_tokens if v.num_tokens is not None else self._rows(v.name).shape[0]

    def _rows(self, name: str, dtype: mx.Dtype | None = None) -> mx.array:
        """Voice ``name``'s embedding, read and evaluated on the worker thread the first time
        (MLX work belongs to one thread: on Metal before MLX 0.31.2, two threads evaluating
        at once crash); later calls take the cached array on any thread."""
        rows = self.voices.cached(name, dtype)
        return rows if rows is not None else self.worker.call(self.voices.embedding, name, dtype)

    def load_voice(self, voice: str | None = None) -> str:
        """Read ``voice``'s embedding now (on the worker thread; requests read it when they
        start), so that a damaged voice file is reported before any output is opened.
        Returns the voice's name."""
        v = self._voice(voice)
        self._rows(v.name, self.dtype)
        return v.name

    def prompt_ids(self, text: str, voice: str | None = None) -> list[int]:
        """The prompt's token ids: ``[BOS, BEGIN_AUDIO] + [AUDIO]*N + [NEXT_AUDIO_TEXT] +
        text + [REPEAT_AUDIO_TEXT, BEGIN_AUDIO]`` (raw text, no normalisation)."""
        v = self._voice(voice)
        return speech_prompt_ids(self.tokenizer, text, self._voice_tokens(v))

    def prompt_embeddings(self, text: str, voice: str | None = None) -> mx.array:
        """Prompt embeddings ``[1, T, dim]``: token rows with the voice spliced in."""
        v = self._voice(voice)
        ids = self.prompt_ids(text, v.name)
        rows = self._rows(v.name, self.dtype)
        start = ids.index(self.config.audio_token_id)
        return self.call(self.model.embed_prompt, ids, rows, start)

    def job(
        self,
        text: str,
        voice: str | None = None,
        *,
        seed: int | None = None,
        noise: np.ndarray | None = None,
        max_frames: int = DEFAULT_MAX_FRAMES,
        cfg_alpha: float = DEFAULT_CFG_ALPHA,
        chunk_frames: int = 1,
    ) -> Job:
        """Validate a request and turn it into a :class:`Job` (not yet submitted: see
        :meth:`submit`). Its chunks arrive in ``job.output``, or through ``job.on_output``
        when that is set before submitting (called on the worker thread: hand them over)."""
        if self.worker.closed:  # its submit() would refuse it: say so now
            raise closed_error()
        if not isinstance(text, str):
            raise InputError(
                f"text must be a string, got {type(text).__name__}: pass the text itself (str)"
            )
        if is_blank(text):
            raise InputError(EMPTY_TEXT)
        max_frames, chunk_frames, alpha = _job_options(max_frames, chunk_frames, cfg_alpha)
        v = self._voice(voice)
        text_ids = utterance_ids(
            self.tokenizer, text, "text", "pass split=True to speak it in segments"
        )
        tail = speech_prompt_ids(self.tokenizer, "", 0)[-2:]  # [REPEAT_AUDIO_TEXT, BEGIN_AUDIO]
        source = NoiseSource(self.config.flow.n_acoustic_codebook, seed=seed, noise=noise)
        seq = Sequence(source, max_frames, alpha)
        # A voice not used before is read when the job starts, on the worker thread: making
        # the job must not wait for the worker's current frame or prefill part.
        rows = self.voices.cached(v.name, self.dtype)
        load = None if rows is not None else partial(self.voices.embedding, v.name, self.dtype)
        return Job(
            v.name,
            rows,
            text_ids + tail,
            seq,
            chunk_frames,
            self.sample_rate,
            load_voice=load,
            owner=self,
        )

    def _reader(
        self,
        cls: type,
        submit: Callable,
        text: str | Iterable[str] | AsyncIterable[str],
        voice: str | None,
        seed: int | None,
        noise: np.ndarray | None,
        chunk_frames: int,
        max_frames: int,
        cfg_alpha: float,
        split: bool,
        pause: float | None,
        max_chars: int,
        add_period: bool = True,
        lookahead: int | None = None,
        defer_split: bool = False,
    ):
        if self.worker.closed:  # as synthesize() and say() do: at the call, not the first item
            raise closed_error()
        pieces = is_text_pieces(text)
        if pieces and isinstance(text, AsyncIterable) and cls is not AsyncTextStream:
            raise InputError(
                f"text is an async iterable ({type(text).__name__}): read it with astream(), "
                "or give an iterable of str"
            )
        if pieces and not split:
            raise InputError(
                "text given in pieces (an iterable of str) is spoken as it arrives, cut into "
                "segments at natural pauses: pass split=True"
            )
        # say() always splits, and a caller who passed split=True needs no telling
        also = "or" if split else "or, with split=True,"
        if is_unordered(text):
            raise InputError(
                f"text must be a string, got a {type(text).__name__}, whose order is not the "
                f"text's: pass the text itself (str; {also} a list or generator of str pieces "
                "in order)"
            )
        if not pieces and not isinstance(text, str):
            raise InputError(
                f"text must be a string, got {type(text).__name__}: pass the text itself "
                f"(str; {also} an iterable of str pieces)"
            )
        if not pieces and is_blank(text):
            raise InputError(EMPTY_TEXT)
        # Each job checks these again; checked here too, so that every bad argument is
        # refused by the call itself (an async stream's jobs may be made at its first item).
        NoiseSource.checked(self.config.flow.n_acoustic_codebook, seed, noise)
        _job_options(max_frames, chunk_frames, cfg_alpha)
        split, add_period = check_flag("split", split), check_flag("add_period", add_period)
        voice = self._voice(voice).name
        if lookahead is not None:
            lookahead = check_whole("lookahead", lookahead, 1)
            if lookahead > MAX_LOOKAHEAD:  # each segment in flight holds its KV cache
                raise InputError(
                    f"lookahead must be at most {MAX_LOOKAHEAD} (segments in flight), got "
                    f"{lookahead}"
                )
        max_chars = check_whole("max_chars", max_chars, 2)
        check_pause(pause)
        changed_max = None if max_chars == DEFAULT_MAX_CHARS else max_chars
        no_period = None if add_period else False
        for name, value in (
            ("pause", pause),
            ("lookahead", lookahead),
            ("max_chars", changed_max),
            ("add_period", no_period),
        ):
            if value is not None and not split:  # one utterance: no segments to apply it to
                raise InputError(
                    f"{name}= applies to the segments of a split text: pass split=True, or "
                    f"leave {name} out"
                )
        if split:
            if noise is not None:
                raise InputError("noise= gives one utterance's noise: it cannot be split")

            def plan(stop: Callable[[], bool] = lambda: False) -> list[Segment]:
                segments = split_text(
                    text,
                    target_chars=max_chars // 2,
                    max_chars=max_chars,
                    add_period=add_period,
                    stop=stop,
                )
                # Every segment is checked before the first is submitted: a too-long one
                # must not fail mid-stream.
                for seg in segments:
                    if _may_not_fit(seg.spoken):
                        if stop():
                            raise SplitStopped
                        fix = f"lower max_chars (now {max_chars})"
                        utterance_ids(self.tokenizer, seg.spoken, "a segment of the text", fix)
                return segments

            if pieces:
                segments = LiveText(
                    target_chars=max_chars // 2, max_chars=max_chars, add_period=add_period
                )
            else:
                # A chapter takes ~0.1 s: an async stream splits it in a thread at its first
                # item and say() on its playback thread, not on an event loop or a UI thread.
                segments = plan if defer_split else plan()
        elif defer_split and _may_not_fit(text):
            # Finding out means tokenizing it all (0.3 s for 100,000 words), which an async
            # stream does in a thread at its first item too.
            segments = lambda stop: [Segment(text, 0, len(text), 0.0, text)]  # noqa: E731
        else:
            segments = [Segment(text, 0, len(text), 0.0, text)]
        base = secrets.randbits(62) if seed is None and noise is None else seed
        # A segment of zero-width or format characters alone, or a lone "." cut off by a
        # hard cut, has nothing to say (sent as ".", the model would babble): it keeps its
        # place, as a pause. Text that is punctuation alone ("...") is what its writer
        # asked for: it is spoken.
        pause_only = is_blank if not pieces and is_silent(text) else is_silent
        heard = [not pieces]  # live text: whether a segment with words has come yet

        def make_job(i: int, seg: Segment) -> Job:
            # Live text is punctuation alone so far: spoken, as such a text is whole.
            pause = pause_only(seg.text) if heard[0] else is_blank(seg.text)
            heard[0] = heard[0] or not is_silent(seg.text)
            # A pause generates nothing: its prompt is a lone "." (its own text, a run of
            # invisible characters, would be prefilled for nothing: hundreds of tokens).
            spoken = "." if pause else seg.spoken
            if not pause and pieces and _may_not_fit(spoken):  # split text checks up front
                fix = f"lower max_chars (now {max_chars})"
                utterance_ids(self.tokenizer, spoken, "a segment of the text", fix)
            job = self.job(
                spoken,
                voice,
                seed=None if base is None else (int(base) + i) % 2**64,
                noise=noise,
                max_frames=0 if pause else max_frames,
                cfg_alpha=cfg_alpha,
                chunk_frames=chunk_frames,
            )
            job.segment = i
            return job

        if lookahead is None:
            lookahead = self.engine.max_batch if split else 1
        stream = cls(
            submit,
            make_job,
            segments,
            self.sample_rate,
            lookahead,
            0.0 if max_frames == 0 else pause,  # nothing is spoken: no pauses either
            refuse_wait=self.worker.refuse_wait,
        )
        if pieces:  # read once the stream exists: a refused call leaves no thread behind
            if isinstance(text, AsyncIterable):
                stream.read_later(text)
            else:
                segments.read_from(text)
        return stream

    def stream(
        self,
        text: str | Iterable[str],
        voice: str | None = None,
        *,
        seed: int | None = None,
        noise: np.ndarray | None = None,
        chunk_frames: int = 1,
        max_frames: int = DEFAULT_MAX_FRAMES,
        cfg_alpha: float = DEFAULT_CFG_ALPHA,
        split: bool = False,
        pause: float | None = None,
        max_chars: int = DEFAULT_MAX_CHARS,
        add_period: bool = True,
        lookahead: int | None = None,
    ) -> TextStream:
        """Yield audio as it is decoded, ``chunk_frames`` frames (80 ms each) at a time.

        Generation starts when the first chunk is asked for (not when the stream is made),
        and the first chunk is ready after the prompt's prefill and one frame. The last chunk has
        ``is_final=True`` (it may be empty when END falls on a chunk boundary).
        ``cancel()`` (any thread) or ``close()`` stops generation within a frame.
        ``set_chunk_frames(n)`` (any thread) sizes the chunks from then on: larger ones
        cost less per frame (the codec runs once per chunk), as a player holding audio
        ahead can take (``speak`` and :meth:`say` do so).
        Concatenated chunks equal :meth:`synthesize` for the same seed or noise.

        ``split=True`` reads text of any length: it is cut into segments at natural pauses
        (:func:`voxtral_mlx.segment.split_text`; a segment without final punctuation gets a
        period), the segments are generated as one batch, and their audio follows in order
        with the pause each boundary implies (``pause`` seconds instead, if given);
        ``add_period=False`` sends segments as written (END is less reliable without
        final punctuation; without ``split`` the one utterance is always sent as written);
        a segment of invisible characters alone (zero-width spaces, format marks) makes no
        sound and adds no pause of its own. Segment ``i`` uses seed
        ``(seed + i) % 2**64``; ``max_frames`` applies per segment; chunks carry ``segment``
        and ``segments``, and ``ends_segment`` on a segment's last chunk of audio; a pause
        is a chunk of its own (see :class:`AudioChunk`); memory stays bounded whatever the
        length. ``max_chars`` is the longest segment (the split aims at half of it).
        ``pause``, ``lookahead``, ``max_chars`` and ``add_period=False`` need ``split=True``.
        ``lookahead``: segments in flight, the one being consumed included (1 to 64;
        default: the batch size). A segment generated ahead gives
        up its batch slot to another request's segment that someone is waiting for (it is
        set aside and resumes later, its output unchanged; so does its prompt's prefill), so
        a new request starts at once even while a long text fills the batch. Segments
        someone waits for join first come, first served; segments generated ahead follow,
        earliest first.

        Text still being written (an LLM's tokens) can be given as an iterable of str
        pieces, with ``split=True``, joined as given (tokens carry their own spaces; a list
        of sentences needs them too): it is read on a thread of its own and spoken as it
        arrives, a segment at a time (:mod:`voxtral_mlx.livetext` says where it is cut: at
        a sentence end once the next word has come, a paragraph break, ``max_chars``, or a
        sentence end or line break followed by a pause in the input). ``live`` is True and
        ``segments`` grows until the text ends; a segment's pause comes before the next
        one's audio; the last chunk (``is_final``) may be empty. An error the iterable
        raises is raised by the stream after the text before it is spoken.
        """
        return self._reader(
            TextStream,
            self._submit_all,
            text,
            voice,
            seed,
            noise,
            chunk_frames,
            max_frames,
            cfg_alpha,
            split,
            pause,
            max_chars,
            add_period,
            lookahead,
        )

    def astream(
        self,
        text: str | Iterable[str] | AsyncIterable[str],
        voice: str | None = None,
        *,
        seed: int | None = None,
        noise: np.ndarray | None = None,
        chunk_frames: int = 1,
        max_frames: int = DEFAULT_MAX_FRAMES,
        cfg_alpha: float = DEFAULT_CFG_ALPHA,
        split: bool = False,
        pause: float | None = None,
        max_chars: int = DEFAULT_MAX_CHARS,
        add_period: bool = True,
        lookahead: int | None = None,
    ) -> AsyncTextStream:
        """:meth:`stream` for ``async for``: generation runs on the model's worker thread, the
        event loop only receives chunks. Cancelling the consuming task stops generation.

        With ``split=True`` the text is split in a thread when the first chunk is awaited
        (about 0.1 s for a 10,000-word chapter, which would otherwise hold up the loop):
        ``segments`` is empty until then, and a segment too long for one utterance (only
        possible with a large ``max_chars``) raises there. Without it, a text of more than
        2,048 characters is tokenized there too, so a text too long for one utterance
        raises there. Every other bad argument raises here. Live text may also come from an
        async iterable (an LLM client's stream), read as a task on the loop iterating this
        stream."""

        async def submit(jobs: list[Job]) -> None:
            import asyncio  # here: the CLI and blocking callers skip its import time

            self.worker.refuse_wait()  # an event loop run inside tts.call() or a callback
            await asyncio.wrap_future(self.worker.submit(lambda: self._enqueue(jobs)))

        return self._reader(
            AsyncTextStream,
            submit,
            text,
            voice,
            seed,
            noise,
            chunk_frames,
            max_frames,
            cfg_alpha,
            split,
            pause,
            max_chars,
            add_period,
            lookahead,
            defer_split=True,
        )

    def submit(self, job: Job) -> Job:
        """Hand ``job`` to the engine (from any thread, a job's ``on_output`` callback and
        :meth:`call` included: it does not wait for audio); its output arrives in
        ``job.output`` (or its ``on_output`` callback). A job runs once: submitting it again
        is an :class:`InputError`."""
        if not isinstance(job, Job):
            raise InputError(f"submit() takes a Job made by tts.job(...), got {type(job).__name__}")
        if job.owner is not self:  # its prompt, voice rows and noise are another model's
            raise InputError(
                "this job was made by another model (tts.job() of another load()): make it "
                "with this model's job(...)"
            )
        self._submit_all([job])
        return job

    def _submit_all(self, jobs: list[Job]) -> None:
        # One hand-over to the worker, which takes tasks only between frames: one per job
        # would hold the caller (and so the first job's audio) for a frame each.
        if self.worker.in_worker:  # a callback chaining jobs: queue them, nothing to wait for
            if self.worker.closed:
                raise closed_error()
            self._enqueue(jobs)
            return
        self.worker.submit(lambda: self._enqueue(jobs)).result()

    def _enqueue(self, jobs: list[Job]) -> None:
        for job in jobs:
            job.claim()
        for job in jobs:
            self.engine.submit(job)

    def synthesize(
        self,
        text: str | Iterable[str],
        voice: str | None = None,
        *,
        seed: int | None = None,
        noise: np.ndarray | None = None,
        max_frames: int = DEFAULT_MAX_FRAMES,
        cfg_alpha: float = DEFAULT_CFG_ALPHA,
        split: bool = False,
        pause: float | None = None,
        max_chars: int = DEFAULT_MAX_CHARS,
        add_period: bool = True,
    ) -> Speech:
        """Speak ``text`` with ``voice``; returns the whole utterance.

        ``seed`` fixes the flow-matching start noise (the only randomness; the semantic code
        is greedy; None draws a fresh seed, reported in ``Speech.seed``), ``noise`` gives it
        explicitly as ``[frames, 36]`` floats (frame i uses row i; generation stops after
        ``len(noise)`` frames at most). ``max_frames`` bounds runaway generation (80 ms per
        frame); ``Speech.timings.cut_short`` counts the utterances (segments, with
        ``split``) it stopped before the model's END (``max_frames=0`` asks for none: not
        counted), and the audio is empty when the model
        ends at once. ``cfg_alpha`` weighs the flow-matching head's conditional velocity
        against the unconditional one (classifier-free guidance: ``a * v_cond + (1 - a) *
        v_uncond``; 1.2 as Mistral's release uses; -100 to 100). ``split``, ``pause``,
        ``max_chars``, ``add_period``: see :meth:`stream`.
        """
        stream = self.stream(
            text,
            voice,
            seed=seed,
            noise=noise,
            chunk_frames=SYNTH_CHUNK_FRAMES,
            max_frames=max_frames,
            cfg_alpha=cfg_alpha,
            split=split,
            pause=pause,
            max_chars=max_chars,
            add_period=add_period,
        )
        return speech_from_chunks(list(stream), stream, self._voice(voice).name)

    async def asynthesize(
        self,
        text: str | Iterable[str] | AsyncIterable[str],
        voice: str | None = None,
        *,
        seed: int | None = None,
        noise: np.ndarray | None = None,
        max_frames: int = DEFAULT_MAX_FRAMES,
        cfg_alpha: float = DEFAULT_CFG_ALPHA,
        split: bool = False,
        pause: float | None = None,
        max_chars: int = DEFAULT_MAX_CHARS,
        add_period: bool = True,
    ) -> Speech:
        """:meth:`synthesize` without blocking the event loop; cancelling stops generation."""
        stream = self.astream(
            text,
            voice,
            seed=seed,
            noise=noise,
            chunk_frames=SYNTH_CHUNK_FRAMES,
            max_frames=max_frames,
            cfg_alpha=cfg_alpha,
            split=split,
            pause=pause,
            max_chars=max_chars,
            add_period=add_period,
        )
        chunks = [chunk async for chunk in stream]
        return speech_from_chunks(chunks, stream, self._voice(voice).name)

    def say(
        self,
        text: str | Iterable[str],
        voice: str | None = None,
        *,
        wait: bool = True,
        device: str | int | None = None,
        seed: int | None = None,
        pause: float | None = None,
        max_frames: int = DEFAULT_MAX_FRAMES,
        player: object | None = None,
        speed: float = 1.0,
    ) -> Playback:
        """Speak ``text`` through the speakers as it is generated (like macOS ``say``).

        Long text is split (on the playback thread: ``wait=False`` returns at once even for a
        chapter) and batched (see :meth:`stream`); an iterable of str pieces is spoken as
        it arrives (as :meth:`stream` does with ``split=True``). With ``wait=True`` this returns
        when the last sample has played; with ``wait=False`` it returns at once with a
        :class:`Playback` handle (``stop()``, ``wait()``, ``done``, ``pause()`` and
        ``resume()``, and ``segment``: the part of the text being heard). Needs PortAudio,
        unless ``player`` supplies another sink with ``feed(audio)``, ``finish()`` and
        ``stop()`` (and, to be paused, ``pause()`` and ``resume()``; to tell what is heard,
        ``played_samples``).
        Each call opens its own output stream, so two at once play together (as two ``say``
        processes do): ``stop()`` the first to replace it. ``device`` (a name or index) and
        the default output are looked up among the devices PortAudio found when it started;
        :func:`voxtral_mlx.audio.player.refresh_output_devices` re-reads them. ``seed``,
        ``pause`` and ``max_frames`` are :meth:`stream`'s. ``speed`` plays the speech that many
        times faster (0.25 to 4; below 1 slower) at the same pitch (a WSOLA time stretch of
        each segment).

        A ``player``'s ``feed(audio)`` is called on the playback thread with non-empty mono
        float32 arrays at :attr:`sample_rate` (it may block to pace generation), then
        ``finish()`` once all is fed (:meth:`Playback.wait` returns after it does: return
        when the audio has played); ``stop()`` may come from any thread, during a
        ``feed()``, and should make a ``feed()`` or ``finish()`` blocked then return.
        """
        wait = check_flag("wait", wait)
        speed = check_speed(speed)
        if wait:
            self.worker.refuse_wait()  # before anything opens: playing needs the worker
        if isinstance(player, type):
            raise InputError(
                f"player must be a player object, got the class {player.__name__}: pass "
                f"{player.__name__}(...)"
            )
        if player is not None:
            needed = ("feed", "finish", "stop")
            missing = [m for m in needed if not callable(getattr(player, m, None))]
            if missing:
                raise InputError(
                    f"player must have feed(audio), finish() and stop(); a "
                    f"{type(player).__name__} lacks {', '.join(missing)}"
                )
        if self.worker.closed:  # the handle would only say so later, in silence
            raise closed_error()
        # The request is checked before the audio output is opened: bad input opens nothing.
        # Split on the playback thread: a chapter's ~0.1 s would hold up a UI thread.
        stream = self._reader(
            TextStream,
            self._submit_all,
            text,
            voice,
            seed=seed,
            noise=None,
            chunk_frames=1,
            max_frames=max_frames,
            cfg_alpha=DEFAULT_CFG_ALPHA,
            split=True,
            pause=pause,
            max_chars=DEFAULT_MAX_CHARS,
            defer_split=True,
        )
        try:
            self.load_voice(voice)  # a damaged voice file opens nothing either
        except BaseException:
            stream.close()
            raise
        horizon = None
        try:
            if player is None:
                from .audio.horizon import PlaybackHorizon
                from .audio.player import AudioPlayer

                player = AudioPlayer(self.sample_rate, device=device)
                # As speak's: the pre-roll plans for the text's length, so audio generated
                # slower than real time plays without gaps.
                started = time.monotonic()

                def horizon() -> PlaybackHorizon:
                    return PlaybackHorizon(self, stream, max_frames, pause, started)

            playback = Playback(
                stream,
                player,
                horizon,
                refuse_wait=self.worker.refuse_wait,
                frame_s=self.samples_per_frame / self.sample_rate,
                speed=speed,
            )
        except BaseException:  # e.g. Ctrl-C as the thread starts: nothing plays on unseen
            stream.close()
            if player is not None:
                with contextlib.suppress(Exception):
                    player.stop()
            raise
        with self._playbacks_lock:
            self._playbacks.add(playback)
        if self.worker.closed:  # close() ran meanwhile, before it could see this one
            playback.end(closed_error())
        if wait:
            playback.wait()
        return playback

    def decode(
        self, codes: np.ndarray | mx.array, segment_frames: Iterable[int] | None = None
    ) -> np.ndarray:
        """Waveform (float32, 24 kHz) of a ``[frames, 37]`` array of +2-offset codes.

        The codec runs over all frames as one utterance, unless ``segment_frames`` (frames
        per segment, summing to ``frames``) says where it starts afresh: a split text's
        ``decode(speech.codes, speech.segment_frames)`` is its segments' audio exactly,
        without the pauses (each segment was decoded on its own).
        """
        arr = to_numpy(codes, "codes")
        n = self.config.num_codebooks
        if arr.ndim != 2 or arr.shape[1] != n or not np.issubdtype(arr.dtype, np.integer):
            # As given: an MLX bfloat16 array is float32 by now, None an object array.
            given = codes.dtype if isinstance(codes, (np.ndarray, mx.array)) else arr.dtype
            got = f"{given} {list(arr.shape)}" if arr.dtype != np.object_ else type(codes).__name__
            raise InputError(f"codes must be an integer array of shape [frames, {n}], got {got}")
        f = self.config.flow
        sem, ac = arr[:, 0], arr[:, 1:]
        if arr.size and (
            sem.min() < 2
            or sem.max() >= f.semantic_codebook_size + 2
            or ac.min() < 2
            or ac.max() >= f.acoustic_codebook_size + 2
        ):
            raise InputError(
                "codes out of range: semantic codes must lie in "
                f"[2, {f.semantic_codebook_size + 1}] and acoustic codes in "
                f"[2, {f.acoustic_codebook_size + 1}] (END=1 is not audio)"
            )

        bounds = _segment_bounds(segment_frames, len(arr))
        codec = self.model.audio_tokenizer
        state = None

        def run(part: np.ndarray, fresh: bool) -> np.ndarray:
            nonlocal state
            if state is None or fresh:
                state = codec.new_state()
            audio = codec.decode_chunk(mx.array(part.astype(np.int32))[None], state)
            mx.eval(audio, state.arrays())
            return np.array(audio[0].astype(mx.float32))

        # One worker call per part (exact: the state carries over): running requests get a
        # frame between parts, and a cancel() or close() need not wait for the whole decode.
        parts = [
            self.worker.call(run, arr[i : min(i + DECODE_PART_FRAMES, end)], i == start)
            for start, end in bounds
            for i in range(start, end, DECODE_PART_FRAMES)
        ]
        audio = np.concatenate(parts) if parts else np.zeros(0, np.float32)
        bad = np.flatnonzero(~np.isfinite(audio))
        if len(bad):
            frame = bad[0] * len(arr) // len(audio) + 1
            raise not_finite_error(self.dtype, "the codec", int(frame))
        return audio


def _segment_bounds(segment_frames: Iterable[int] | None, frames: int) -> list[tuple[int, int]]:
    """``[start, end)`` frames of each segment for :meth:`VoxtralTTS.decode`."""
    if segment_frames is None:
        return [(0, frames)]
    shown = one_line(repr(segment_frames), 60)
    try:
        counts = [check_whole("segment_frames", n, 0) for n in segment_frames]
    except TypeError:  # not iterable
        raise InputError(
            f"segment_frames must be a list of frame counts (Speech.segment_frames), got {shown}"
        ) from None
    if sum(counts) != frames:
        raise InputError(
            f"segment_frames {shown} add up to {sum(counts)} frames, but the codes hold "
            f"{frames}: pass the Speech.segment_frames that came with these codes"
        )
    ends = np.cumsum(counts).tolist()
    return [(end - n, end) for n, end in zip(counts, ends)]


class _ClosedModel:
    """``VoxtralTTS.model`` after ``close()``: any use says the model was closed."""

    def __getattr__(self, name: str) -> Any:
        raise closed_error()


def _job_options(max_frames: int, chunk_frames: int, cfg_alpha: float) -> tuple[int, int, float]:
    max_frames = check_whole("max_frames", max_frames, 0)
    chunk_frames = check_whole("chunk_frames", chunk_frames, 1)
    alpha = finite_float(cfg_alpha)
    if alpha is None or abs(alpha) > MAX_CFG_ALPHA:
        shown = one_line(repr(cfg_alpha), 60)
        raise InputError(
            f"cfg_alpha must be a finite number from -{MAX_CFG_ALPHA:g} to "
            f"{MAX_CFG_ALPHA:g} (default {DEFAULT_CFG_ALPHA}), got {shown}"
        )
    return max_frames, chunk_frames, alpha


def speech_from_chunks(
    chunks: list[AudioChunk], stream: TextStream | AsyncTextStream, voice: str
) -> Speech:
    audio = np.concatenate([c.audio for c in chunks]).astype(np.float32, copy=False)
    codes = np.concatenate([c.codes for c in chunks]).reshape(-1, chunks[0].codes.shape[-1])
    single = len(stream.segments) == 1
    # The segment's own last chunk: live text may end with an empty chunk of the stream's.
    last = next((c for c in reversed(chunks) if c.seed is not None), chunks[-1])
    timings = last.timings if single else stream.timings
    seed = last.seed if single else chunks[0].seed
    frames = [0] * len(stream.segments)
    for c in chunks:
        frames[c.segment] += c.frames
    return Speech(
        audio, stream.sample_rate, codes.astype(np.int32), voice, seed, timings, tuple(frames)
    )
