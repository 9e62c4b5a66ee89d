"""Requests to audio: the voice-prefix cache, the shared frame batch, the codec.

Every request (a stream, a synthesis, a text segment, a server request) becomes a
:class:`Job` submitted to the model's one :class:`Engine`, which runs on the model's
worker thread: concurrent callers from any thread are served in one batch and never
corrupt each other. Chunks go back through each job's thread-safe queue (or a callback).
"""

from __future__ import annotations

import contextlib
import copy
import decimal
import math
import numbers
import queue
import threading
import time
import warnings
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from .config import N_SPECIAL_AUDIO_CODES
from .errors import InputError, NonFiniteError, VoxtralError
from .fileio import one_line
from .generate import FrameBatch, Sequence, prefill, prefill_part
from .model.cache import KVCache
from .model.voxtral import VoxtralModel
from .prefix_store import PrefixStore
from .residency import Residency

PREFIX_CACHE_VOICES = 8
# A longer prompt text is prefilled in parts, one per frame step: a cancel() takes effect
# and the sequences already running get their next frame after at most one part. A part
# is sized to take about as long as a frame (measured as they run), within these bounds;
# the first starts at FIRST_PREFILL_PART_TOKENS and each may double the last.
PREFILL_PART_TOKENS = 256
MIN_PREFILL_PART_TOKENS = 16
FIRST_PREFILL_PART_TOKENS = 64
FRAME_TIMES_KEPT = 8
# A voice's prompt prefix (70-220 positions for the released voices) is prefilled in parts
# of this many, one per frame step like a long text, but always the same split: a fresh
# prefix is then bit-identical to a cached one (and to one from an earlier process) on any
# device, whatever the frame times.
PREFIX_PART_TOKENS = 64
# Short prompts a long prompt's prefill lets go first with none of its own parts between,
# at most. Each part it runs gives one back, and it resumes before the next short one
# starts: they alternate, so it keeps at least half its pace and a short request waits
# about a part per one ahead of it (a fixed total of 8 made the ninth wait for the whole
# long prefill).
MAX_OVERTAKES = 8
# Buffers freed while generating (outgrown KV caches, a long prompt's attention) stay in
# MLX's cache for reuse; once idle, an engine lets go of them beyond this (a frame's own
# working set stays below it, so a short request after another allocates nothing anew).
IDLE_CACHE_BYTES = 256 * 2**20


@dataclass
class Timings:
    """Wall-clock figures of one request (seconds unless named otherwise), from when it
    was submitted: ``queued_s`` waiting for a batch slot, then ``prefill_s`` prefilling its
    prompt (frames of requests running beside it included), then its frames.

    Of a split text, a :class:`Speech`'s timings are the whole text's, counted from when it
    was first read; a streamed audio chunk carries its own segment's (from when that
    segment was submitted), a pause chunk the whole text's.

    Attributes:
        prompt_tokens: tokens of the prompt (voice rows included).
        first_audio_s: until the first audio was decoded.
        total_s: until the latest chunk.
        frames: frames generated (80 ms each).
        audio_s: seconds of audio so far, ``pause_s`` of them the silence put between a
            split text's segments.
        peak_memory_bytes: MLX's peak memory as the process has seen it so far (weights
            and every request included: ``mx.get_peak_memory()`` when the latest chunk
            was made).
        prefix_cached: the voice's prompt prefix came from the cache (``prefix_from_disk``:
            from the cache on disk).
        cut_short: utterances (segments, with split) that reached ``max_frames`` (or the
            end of the given noise) before the model's END, their audio cut short (0 with
            ``max_frames=0``, which asks for no frames).
    """

    prompt_tokens: int = 0
    queued_s: float = 0.0
    prefill_s: float = 0.0
    first_audio_s: float = 0.0
    total_s: float = 0.0
    frames: int = 0
    audio_s: float = 0.0
    pause_s: float = 0.0
    peak_memory_bytes: int = 0
    prefix_cached: bool = False
    prefix_from_disk: bool = False
    cut_short: int = 0

    @property
    def ms_per_frame(self) -> float:
        """Wall milliseconds per frame from joining the batch to the latest chunk."""
        gen = self.total_s - self.queued_s - self.prefill_s
        return 1000.0 * gen / self.frames if self.frames else 0.0

    @property
    def rtf(self) -> float:
        """Real-time factor: wall time / seconds of speech generated (below 1 is faster
        than real time; the pauses put between segments are not generated, not counted)."""
        speech = self.audio_s - self.pause_s
        return self.total_s / speech if speech > 0 else float("inf")


@dataclass(eq=False)  # compared by identity: ``==`` on its arrays would be ambiguous
class AudioChunk:
    """A piece of a streamed utterance, playable as soon as it arrives.

    Of a split text, a segment's pause comes as a chunk of its own after the segment's
    ``ends_segment`` chunk, before the next segment's audio: silence (empty for a pause of
    0), ``frames`` 0, ``seed`` None, ``segment`` the segment it follows. Blank segments
    (zero-width marks alone) make no pause of their own: the one they fall in is the
    longest of the run, and none comes before the first words or after the last.

    Attributes:
        audio: ``[frames * samples_per_frame]`` float32, mono, at ``sample_rate``
            (silence of a pause chunk: ``frames`` 0).
        frame_index: the chunk's first frame in its utterance (its segment, with split;
            0 for a pause chunk).
        frames: frames in the chunk; 0 for a pause, and for a chunk that only marks an
            end (``ends_segment`` or ``is_final`` found after the last frame was sent,
            e.g. on the model's END): skip empty chunks for their audio, not their flags.
        is_final: the last chunk of the whole stream.
        codes: ``[frames, 37]`` int32, as in :class:`~voxtral_mlx.tts.Speech`.
        timings: see :class:`Timings` (a segment's own, or for a pause the whole text's).
        seed: the noise seed (None when the noise was given explicitly, and for a pause).
        segment: which segment of a split text, of ``segments``
            (see ``VoxtralTTS.stream(split=True)``).
        ends_segment: the last chunk of its segment's audio: a player of text still
            arriving learns here that nothing more is on its way yet.
    """

    audio: np.ndarray
    sample_rate: int
    frame_index: int
    frames: int
    is_final: bool
    codes: np.ndarray
    timings: Timings
    seed: int | None
    segment: int = 0
    segments: int = 1
    ends_segment: bool = False


class CallbackWarning(UserWarning):
    """A job's ``on_output`` callback raised: the job was stopped (the worker thread, which
    serves the other jobs, goes on)."""


class ConsumerGone(Exception):
    """Raised by an ``on_output`` callback whose consumer has gone away (an event loop
    closed): the job stops without a :class:`CallbackWarning`."""


class _Done:
    """Queued after a job's last chunk."""


DONE = _Done()
_CLAIM_LOCK = threading.Lock()


@dataclass(eq=False)  # a job is an identity: comparing two would compare their arrays
class Job:
    """One utterance to generate. Its chunks, then :data:`DONE` (or the exception that
    stopped it), arrive in ``output`` or, when ``on_output`` is set, through that callback
    (called on the worker thread: it must only hand the item over)."""

    voice: str
    voice_rows: mx.array | None = field(repr=False)  # None: ``load_voice()`` reads them
    text_ids: list[int] = field(repr=False)
    seq: Sequence
    chunk_frames: int
    sample_rate: int
    on_output: Callable[[AudioChunk | _Done | BaseException], None] | None = None
    # Reads the voice's rows on the worker thread when the job starts: whoever makes a job
    # for a voice not used before need not wait for the worker (a frame, a prefill part).
    load_voice: Callable[[], mx.array] | None = field(default=None, repr=False)
    timings: Timings = field(default_factory=Timings)
    output: queue.SimpleQueue = field(default_factory=queue.SimpleQueue, repr=False)
    done: bool = False
    submitted_at: float = field(default_factory=time.perf_counter)
    segment: int = 0  # its index in a split text: earlier segments of any text wait less
    # Generated ahead of the segment its text's consumer is waiting for: such a job gives
    # up its batch slot or its prefill (set aside, resumed later) to a job someone is
    # waiting for. Jobs someone waits for are served first come, first served, from
    # ``waited_since`` (when it was submitted, or stopped being ahead: see :meth:`needed`).
    ahead: bool = False
    waited_since: float = field(default_factory=time.perf_counter)
    # Frames per chunk after the first (None: ``chunk_frames``), changed by its reader while
    # it runs: a player holding audio ahead takes larger chunks, which cost less per frame.
    later_chunk_frames: int | None = None
    _codes: list[mx.array] = field(default_factory=list, repr=False)
    _next_index: int = 0  # frames handed to the codec
    _delivered_frames: int = 0
    _codec_state: object = field(default=None, repr=False)
    _suspended: _Prefill | None = field(default=None, repr=False)  # a prefill set aside
    _claimed: bool = field(default=False, repr=False)  # handed to an engine (see claim())
    _error: VoxtralError | None = field(default=None, repr=False)  # ends it, once it leaves
    # Its consumer started waiting for it (needed()): what it generated ahead and has not
    # decoded yet goes out in the next chunk, whatever size later chunks have.
    _flush: bool = field(default=False, repr=False)
    _callback_failed: bool = field(default=False, repr=False)
    # The model that made it: an app holding only the job must not see the model closed
    # (collected) under it.
    owner: object = field(default=None, repr=False, compare=False)

    def cancel(self) -> None:
        """Stop generating (any thread); takes effect at the next frame boundary."""
        self.seq.cancel()

    def rows(self) -> mx.array:
        """The voice's embedding rows, read by ``load_voice`` the first time (on the worker)."""
        if self.voice_rows is None:
            if self.load_voice is None:
                raise InputError("a job needs voice_rows or load_voice")
            self.voice_rows = self.load_voice()
        return self.voice_rows

    def claim(self) -> None:
        """Mark it handed to an engine (any thread): a job runs once, a second submission
        would interleave two generations in one output."""
        with _CLAIM_LOCK:
            if self._claimed:
                raise InputError(
                    "this job was already submitted: make a new one (tts.job(...)) for each "
                    "submission"
                )
            self._claimed = True

    def needed(self) -> None:
        """Its text's consumer now waits for it (any thread): no longer generated ahead."""
        if self.ahead:
            self.waited_since = time.perf_counter()
            self._flush = True
            self.ahead = False

    def _emit(self, item: AudioChunk | _Done | BaseException) -> None:
        if self.on_output is None:
            self.output.put(item)
            return
        try:
            self.on_output(item)
        except ConsumerGone:
            self.cancel()
        except BaseException as e:
            # Even sys.exit() in the callback must not end the worker thread that serves
            # the other jobs: this job stops, and the failure is told once.
            self.cancel()
            if not self._callback_failed:
                self._callback_failed = True
                # Suppressed: under -W error the warning would be raised here, on the worker.
                with contextlib.suppress(Exception):
                    warnings.warn(
                        f"a job's on_output callback raised {one_line(repr(e), 200)}: the job "
                        "was stopped (its output is cut short); make the callback only hand "
                        "items over",
                        CallbackWarning,
                        stacklevel=2,
                    )


def _own_copy(error: BaseException) -> BaseException:
    """``error`` for one consumer: the consumers raise what they get in their own threads,
    and one object raised by all collects all their tracebacks (keeping their frames
    alive). An original raised on the worker, with that traceback, is the copy's cause."""
    try:
        twin = copy.copy(error)
    except Exception:  # an exception class that cannot be rebuilt from its args
        return error
    twin.__cause__ = error if error.__traceback__ is not None else error.__cause__
    twin.__traceback__ = None
    return twin


def check_whole(name: str, value: object, minimum: int) -> int:
    """``value`` as an int if it is a whole number >= ``minimum``, else a one-line
    :class:`InputError` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        shown = one_line(repr(value), 60)
        raise InputError(f"{name} must be a whole number >= {minimum}, got {shown}")
    return int(value)


def check_flag(name: str, value: object) -> bool:
    """``value`` if it is True or False (numpy's too), else a one-line :class:`InputError`:
    ``split="no"`` must not mean yes."""
    if not isinstance(value, (bool, np.bool_)):
        raise InputError(f"{name} must be True or False, got {one_line(repr(value), 60)}")
    return bool(value)


def finite_float(value: object) -> float | None:
    """``value`` as a Python float if it is a finite real number (numpy scalars and
    Fractions and Decimals too, which MLX does not take as they are), else None."""
    if not isinstance(value, (numbers.Real, decimal.Decimal)) or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (OverflowError, ValueError):  # 10**400, Decimal("sNaN")
        return None
    return number if math.isfinite(number) else None


# Beyond this a batch only adds memory (a KV cache per sequence) and warm-up time (one
# compiled step per batch size); the weights are already read once per frame for all.
MAX_BATCH = 64


def not_finite_error(dtype: mx.Dtype, where: str, frame: int) -> NonFiniteError:
    """The error that stops a request whose ``where`` produced NaN or inf at ``frame``
    (counted from 1) in a model computing in ``dtype``."""
    overflow = " or float16 overflowed (load it in bfloat16)" if dtype == mx.float16 else ""
    return NonFiniteError(
        f"the model produced NaN or infinite values in {where} at frame {frame}: the "
        f"checkpoint's weights hold NaN/inf (re-download or re-convert it){overflow}"
    )


def check_max_batch(value: object, name: str = "max_batch") -> int:
    """``value`` if it is a valid batch size, else a one-line :class:`InputError`."""
    value = check_whole(name, value, 1)
    if value > MAX_BATCH:
        raise InputError(f"{name} must be at most {MAX_BATCH}, got {value}")
    return value


@dataclass
class _VoicePrefix:
    """A voice's prompt prefix being prefilled (see :data:`PREFIX_PART_TOKENS`)."""

    key: tuple[str, str]  # (voice, dtype): its place in the engine's memory
    disk_key: str | None  # its file in the prefix store, if there is one
    embeds: mx.array  # [1, positions, dim]: those not yet run
    cache: list[KVCache]
    cleared: int  # Engine._cleared when it began: a clear meanwhile means it is not kept


@dataclass
class _Prefill:
    """A job whose prompt is being prefilled, part by part: its voice's prefix first when
    that is not cached, then its text."""

    job: Job
    cache: list[KVCache] | None  # None while ``prefix`` is being prefilled
    text: mx.array  # [1, tokens, dim]: the embeddings not yet run
    hit: bool  # the voice prefix came from the cache
    overtaken: int = 0  # short prompts let through, less one per part run (Engine._admit)
    prefix: _VoicePrefix | None = None


def _priority(job: Job) -> tuple[int, int, float]:
    """Admission order: jobs someone waits for, first come first served (a text's later
    segment, once its consumer reaches it, is not overtaken by every new request); then
    segments generated ahead, earliest segment first (stable among equals)."""
    return (1, job.segment, 0.0) if job.ahead else (0, 0, job.waited_since)


class Engine:
    """Runs jobs in one :class:`FrameBatch` of up to ``max_batch`` sequences."""

    def __init__(
        self,
        model: VoxtralModel,
        prefix_ids: list[int],
        voice_start: int,
        max_batch: int = 4,
        prefix_store: PrefixStore | None = None,
        residency: Residency | None = None,
    ):
        self.model = model
        self.residency = residency
        self.prefix_store = prefix_store
        self._pending_saves: list[tuple[str, list[KVCache]]] = []
        self.max_batch = max_batch  # validated by the property
        self._prefix_ids = prefix_ids  # [BOS, BEGIN_AUDIO, AUDIO (one per voice row), ...]
        self._voice_start = voice_start
        self._first_chunk = model.config.codec.first_chunk_frames
        self._batch = FrameBatch(model)
        self._inflight: list[tuple[Job, mx.array, mx.array, bool]] = []
        self._first: list[tuple[Job, mx.array, mx.array, bool]] = []
        self._waiting: list[Job] = []
        self._prefilling: _Prefill | None = None
        self._parked: list[Job] = []  # set aside from the batch, their state in their seq
        self._jobs: dict[int, Job] = {}  # by id(seq): in the batch, or parked
        self._prefixes: OrderedDict[tuple[str, str], list[KVCache]] = OrderedDict()
        self.prefix_cache_voices = PREFIX_CACHE_VOICES
        self._cleared = 0  # clear_prefix_cache() calls
        self._part_tokens = FIRST_PREFILL_PART_TOKENS  # adapted by _learn_part
        self._frame_times: deque[float] = deque(maxlen=FRAME_TIMES_KEPT)
        self._ran_part = False  # in this pump
        self.idle_cache_bytes = IDLE_CACHE_BYTES

    @property
    def max_batch(self) -> int:
        """Sequences generated together at most (settable; takes effect at the next frame)."""
        return self._max_batch

    @max_batch.setter
    def max_batch(self, value: int) -> None:
        self._max_batch = check_max_batch(value)

    # -- voice prefix -------------------------------------------------------------------

    def _voice_prefix(self, job: Job) -> tuple[list[KVCache] | _VoicePrefix, bool]:
        """KV state after ``[BOS, BEGIN_AUDIO, voice rows..., NEXT_AUDIO_TEXT]`` (a copy for
        ``job``), or the prefix to prefill when it is cached neither in memory nor on disk;
        and whether it was cached.

        The same for every request with this voice, so it is computed once per (voice,
        dtype) and each request starts from a copy. It is always computed on its own, never
        as part of a longer prefill, and in the same parts, so a cached start is
        bit-identical to a fresh one.
        """
        rows = job.rows()
        key = (job.voice, str(rows.dtype))
        cached = self._prefixes.get(key)
        if cached is not None:
            self._prefixes.move_to_end(key)
            return [c.copy() for c in cached], True
        n = rows.shape[0]
        ids = self._prefix_ids[: self._voice_start] + [self._prefix_ids[self._voice_start]] * n
        ids += self._prefix_ids[self._voice_start + 1 :]
        disk_key = None
        store = self.prefix_store if self.prefix_cache_voices > 0 else None
        if store is not None:
            disk_key = store.key(ids, rows)
            a = self.model.args
            shape = (1, a.n_kv_heads, len(ids), a.head_dim)
            cached = store.load(disk_key, len(self.model.layers), shape, rows.dtype)
            if cached is not None:
                job.timings.prefix_from_disk = True
                return self._keep_prefix(key, cached), True
        embeds = self.model.embed_prompt(ids, rows, self._voice_start)
        return _VoicePrefix(key, disk_key, embeds, self.model.make_cache(), self._cleared), False

    def _keep_prefix(self, key: tuple[str, str], cache: list[KVCache]) -> list[KVCache]:
        """Keep a voice's prefix in memory (the most recent :attr:`prefix_cache_voices`);
        the state a request starts from: a copy, or ``cache`` itself when none are kept."""
        if self.prefix_cache_voices <= 0:
            return cache
        self._prefixes[key] = cache
        self._prefixes.move_to_end(key)  # computed again (by two jobs at once): used last
        while len(self._prefixes) > self.prefix_cache_voices:
            self._prefixes.popitem(last=False)
        return [c.copy() for c in cache]

    def _prefill_prefix(self, p: _Prefill) -> None:
        """Run the next part of the voice prefix ``p`` waits for; after the last one it is
        kept (and queued for the disk) and ``p`` goes on with its text."""
        v = p.prefix
        assert v is not None
        prefill_part(self.model, v.embeds[:, :PREFIX_PART_TOKENS], v.cache)
        v.embeds = v.embeds[:, PREFIX_PART_TOKENS:]
        if v.embeds.shape[1]:
            return
        p.prefix = None
        if v.cleared != self._cleared:  # clear_prefix_cache() came meanwhile: used, not kept
            p.cache = v.cache
            return
        p.cache = self._keep_prefix(v.key, v.cache)
        if v.disk_key is not None:  # written once the next frame is queued
            self._pending_saves.append((v.disk_key, v.cache))

    def clear_prefix_cache(self) -> None:
        """Forget every cached prefix, in memory and this model's files on disk (one being
        computed is used by its job and not kept)."""
        self._cleared += 1
        self._prefixes.clear()
        self._pending_saves.clear()
        if self.prefix_store is not None:
            self.prefix_store.clear()

    # -- jobs (all on the worker thread) -------------------------------------------------

    def submit(self, job: Job) -> Job:
        job.submitted_at = time.perf_counter()
        if not job.ahead:
            job.waited_since = job.submitted_at
        self._waiting.append(job)
        return job

    def stats(self) -> dict[str, int]:
        """Jobs generating in the batch (``active``, set-aside ones included), waiting to join
        it, and set aside (``parked``; safe from any thread)."""
        return {
            "active": len(self._jobs) + (self._prefilling is not None),
            "waiting": len(self._waiting),
            "parked": len(self._parked),
            "max_batch": self.max_batch,
        }

    @property
    def busy(self) -> bool:
        return bool(
            self._jobs
            or self._waiting
            or self._prefilling is not None
            or len(self._batch)
            or self._inflight
        )

    def _admit(self) -> None:
        """Take one waiting job (if the batch has room) towards the batch, one prefill part
        per call, in :func:`_priority` order. Set-aside jobs rejoin without a prefill. A job
        someone waits for takes the place of a segment generated ahead: of its prefill (set
        aside, to resume where it stopped), or of its batch slot when the batch is full."""
        # A cancelled job leaves the queue at the next frame even while the batch is full;
        # so does one that may make no frame (a pause segment) once its voice's prefix is
        # known: its prefill would compute nothing anyone uses (warmup's zero-frame jobs
        # are there to compute that prefix, and still do).
        if any(job.seq.cancelled or self._says_nothing(job) for job in self._waiting):
            waiting, self._waiting = self._waiting, []
            for job in waiting:  # one read of each flag: cancel() may come from any thread
                if job.seq.cancelled:
                    self._finish(job)
                elif self._says_nothing(job):
                    job.seq.stop_reason = "max_frames"
                    self._finish(job)
                else:
                    self._waiting.append(job)
        if any(job.seq.cancelled for job in self._parked):
            parked, self._parked = self._parked, []
            for job in parked:
                if job.seq.cancelled:  # its last chunk (and DONE) come from _decode
                    job.seq.finished, job.seq.stop_reason = True, "cancelled"
                    job.seq._h = job.seq._cache = None
                else:
                    self._parked.append(job)
        if self._prefilling is not None:
            short = self._short_newcomer()
            if short is not None:
                # A long prompt takes a frame per part: a short request that came meanwhile
                # (an app's "speak now") is prefilled first, in one part, while the batch
                # has room for both; a few at most, so the long one is delayed boundedly.
                self._prefilling.overtaken += 1
                self._suspend_prefill()
                self._waiting = [job for job in self._waiting if job is not short]
                self._start(short)
                return
            if not (self._prefilling.job.ahead and self._someone_waits()):
                # Set-aside jobs need no prefill: they take the free slots meanwhile
                # (one is kept for the job being prefilled).
                self._rejoin_parked(reserve=1)
                self._prefill_next()
                return
            # A long prompt generated ahead must not hold up a job someone waits for: its
            # prefill goes back to the queue, to resume where it stopped.
            self._suspend_prefill()
        self._make_room()
        while self._batch.live() < self.max_batch and (self._waiting or self._parked):
            queue = [*self._parked, *self._waiting]  # set-aside jobs first among equals
            k = min(range(len(queue)), key=lambda k: _priority(queue[k]))
            if k < len(self._parked):
                self._batch.add(self._parked.pop(k).seq)
                continue
            job = self._waiting.pop(k - len(self._parked))
            if job.seq.cancelled:
                self._finish(job)
                continue
            # One prefill (part) per frame: the first job in the queue (the first segment of
            # a text) reaches its first audio without waiting for the prefills of the
            # others, which join at the following frames.
            if self._start(job):
                break

    def _says_nothing(self, job: Job) -> bool:
        """Whether ``job`` may make no frame and its voice's prefix is cached in memory."""
        rows = job.voice_rows  # None: a voice not read yet, whose prefix cannot be cached
        if job.seq.max_frames > 0 or job._suspended is not None or rows is None:
            return False
        return (job.voice, str(rows.dtype)) in self._prefixes

    def _rejoin_parked(self, reserve: int) -> None:
        """Set-aside jobs back into the batch, in :func:`_priority` order, while it has
        room beyond ``reserve`` slots; only those that would go before every waiting job
        (a slot taken now must not be one a job before them needs next)."""
        first_waiting = min(map(_priority, self._waiting), default=None)
        while self._parked and self._batch.live() + reserve < self.max_batch:
            k = min(range(len(self._parked)), key=lambda k: _priority(self._parked[k]))
            if first_waiting is not None and _priority(self._parked[k]) > first_waiting:
                return
            self._batch.add(self._parked.pop(k).seq)

    def _start(self, job: Job) -> bool:
        """Begin (or resume) ``job``'s prefill and run its first part; False if it failed
        before starting (the error went to its consumer)."""
        p, job._suspended = job._suspended, None
        try:
            if p is None:
                job.timings.queued_s = time.perf_counter() - job.submitted_at
                text = self.model.embed_text(job.text_ids)
                p = _Prefill(job, None, text[None], False)
            if p.cache is None and p.prefix is None:  # new, or its prefix went on elsewhere
                cache, p.hit = self._voice_prefix(job)
                if isinstance(cache, _VoicePrefix):
                    p.prefix = self._adopt(cache)
                else:
                    p.cache = cache
        except Exception as e:  # handed to the job's consumer
            job.seq.finished = job.done = True
            job._emit(e)
            return False
        self._prefilling = p
        self._prefill_next()
        return True

    def _adopt(self, prefix: _VoicePrefix) -> _VoicePrefix:
        """The same voice's prefix, partly computed by a prefill set aside, if there is one:
        the new job goes on with it (the other, when it resumes, starts from the cached
        prefix), rather than computing it a second time."""
        mine = (prefix.key, prefix.cleared)
        for other in self._waiting:
            p = other._suspended
            if p is not None and p.prefix is not None and (p.prefix.key, p.prefix.cleared) == mine:
                taken, p.prefix = p.prefix, None
                return taken
        return prefix

    def _suspend_prefill(self) -> None:
        """The prefilling job goes back to the queue, to resume where it stopped."""
        p, self._prefilling = self._prefilling, None
        assert p is not None
        p.job._suspended = p
        self._waiting.append(p.job)

    def _short_newcomer(self) -> Job | None:
        """A waiting job someone waits for whose prompt is short (at most
        :data:`PREFILL_PART_TOKENS` tokens: one part, or a few where parts are sized down
        to a frame) and whose voice's prefix is cached, to go before the long prompt being
        prefilled (see :meth:`_admit`), if it may. (A prefix to compute is several parts,
        and may be the very one being computed.)"""
        p = self._prefilling
        if (
            p is None
            or p.overtaken >= MAX_OVERTAKES
            or self._batch.live() + 2 > self.max_batch  # room for the newcomer and for it
            or (p.prefix is None and p.text.shape[1] <= self.part_tokens)  # its last part
        ):
            return None
        cached = {voice for voice, _ in self._prefixes}
        short = [
            job
            for job in self._waiting
            if not job.ahead
            and job._suspended is None
            and not job.seq.cancelled
            and job.voice in cached
            and len(job.text_ids) <= PREFILL_PART_TOKENS
        ]
        return min(short, key=_priority) if short else None

    def _someone_waits(self) -> bool:
        """A job someone waits for is outside the batch (waiting, or set aside)."""
        return any(not job.ahead for job in [*self._waiting, *self._parked])

    def _make_room(self) -> None:
        """With the batch full and a job someone waits for outside it, set aside the running
        job generated furthest ahead (it leaves at the next frame)."""
        if self._batch.live() < self.max_batch or not self._someone_waits():
            return
        ahead = [
            self._jobs[id(seq)]
            for seq in self._batch.running()
            if not seq.finished and self._jobs[id(seq)].ahead
        ]
        if ahead:
            self._batch.set_aside(max(ahead, key=lambda j: j.segment).seq)

    @property
    def part_tokens(self) -> int:
        """Tokens of the next prefill part (see :data:`PREFILL_PART_TOKENS`)."""
        low = min(MIN_PREFILL_PART_TOKENS, PREFILL_PART_TOKENS)
        return max(low, min(self._part_tokens, PREFILL_PART_TOKENS))

    def _learn_part(self, tokens: int, seconds: float) -> None:
        """Size the next part to take about one frame (the fastest of the recent ones):
        on a machine where a frame is cheap next to a prefill (a CPU), 256 tokens would
        hold a cancel and the running sequences for several frames."""
        grown = 2 * tokens
        if self._frame_times and seconds > 0:
            grown = min(grown, int(tokens * min(self._frame_times) / seconds))
        self._part_tokens = max(MIN_PREFILL_PART_TOKENS, min(grown, PREFILL_PART_TOKENS))

    def _prefill_next(self) -> None:
        """Run the next part of the prefilling job's prompt; the last part adds it to the
        batch."""
        p = self._prefilling
        job = p.job
        if job.seq.cancelled:
            self._prefilling = None
            self._finish(job)
            return
        self._ran_part = True
        p.overtaken = max(0, p.overtaken - 1)  # a part run earns a short prompt a turn
        try:
            if p.prefix is not None:
                self._prefill_prefix(p)
                return
            part = self.part_tokens
            if p.text.shape[1] > part:
                t0 = time.perf_counter()
                prefill_part(self.model, p.text[:, :part], p.cache)
                self._learn_part(part, time.perf_counter() - t0)
                p.text = p.text[:, part:]
                return
            prefill(self.model, job.seq, p.text, p.cache)
        except Exception as e:  # handed to the job's consumer
            self._prefilling = None
            job.seq.finished = job.done = True
            job._emit(e)
            return
        self._prefilling = None
        t = job.timings
        t.prefix_cached, t.prompt_tokens = p.hit, job.seq.prompt_tokens
        t.prefill_s = time.perf_counter() - job.submitted_at - t.queued_s
        try:
            job._codec_state = self.model.audio_tokenizer.new_state(1)
            self._batch.add(job.seq)
        except Exception as e:  # in no list of the engine's any more: fail_all would miss it
            job.seq._h = job.seq._cache = None
            job.seq.finished = job.done = True
            job._emit(e)
            return
        if job.seq.finished:
            self._finish(job)
        else:
            self._jobs[id(job.seq)] = job

    def pump(self) -> bool:
        """One frame for every running job (and the next waiting one joins). Returns False
        when there is nothing left to do. An error fails every running job, not the thread.
        Weights are kept resident on the GPU (:mod:`~voxtral_mlx.residency`) from the first
        job until the engine is idle again, and MLX's cache of freed buffers is emptied
        then if it holds more than :attr:`idle_cache_bytes`."""
        try:
            if self.residency is not None and self.busy:
                self.residency.acquire()
            busy = self._pump()
        except Exception as e:
            self.fail_all(e)
            busy = self.busy  # a job a callback submitted while told of the failure
        if not busy:
            try:
                if self.residency is not None:
                    self.residency.release()
                if mx.get_cache_memory() > self.idle_cache_bytes:
                    mx.clear_cache()
            except Exception:  # housekeeping: ending the worker would hang every caller
                pass
        return busy

    def fail_all(self, error: BaseException) -> None:
        """End every job, running or waiting, with ``error`` (a failed frame, or the model
        being closed): their consumers get it instead of waiting forever."""
        failed = {id(j): j for j in [*self._jobs.values(), *self._waiting]}
        self._parked.clear()
        if self._prefilling is not None:
            failed[id(self._prefilling.job)] = self._prefilling.job
            self._prefilling = None
        failed.update((id(r[0]), r[0]) for r in [*self._inflight, *self._first])
        # Emptied before the consumers hear: a callback may submit a new job meanwhile.
        self._jobs.clear()
        self._waiting = []
        self._inflight, self._first = [], []
        self._batch = FrameBatch(self.model)
        for job in failed.values():
            job.seq._h = job.seq._cache = job._suspended = None  # their KV rows: let go
            job._codec_state = None
            if not job.done:
                job.seq.finished = job.done = True
                job._emit(_own_copy(error))

    def release(self) -> None:
        """Let go of the model and every array (once :meth:`fail_all` has ended the jobs, when
        the model is closed): its memory comes back while this object is still referenced."""
        self._prefixes.clear()
        self._pending_saves.clear()
        self._batch.model = None
        self.model = None

    def _pump(self) -> bool:
        """One frame: END check, then the next frame queued before this one is decoded.

        Audio decoded in one pump is delivered in the next, after the next frame has been
        queued, so the device never idles while Python builds graphs. A job's first chunk
        is the exception: it is decoded and delivered before the next frame is queued, and
        before a newcomer's prefill.
        """
        t0, self._ran_part = time.perf_counter(), False
        framed = len(self._batch) > 0
        for seq, codes in self._batch.poll():
            self._jobs[id(seq)]._codes.append(codes)
        # Held by the engine while evaluated: a failure reaches their consumers (fail_all).
        self._first = first = self._decode(first_chunks=True)
        if first:
            mx.eval([r[2] for r in first if r[2] is not None])
            self._deliver(first)
        self._first = []
        self._admit()  # after the first chunks: they never wait for a newcomer's prefill
        for seq in self._batch.advance():
            self._parked.append(self._jobs[id(seq)])
        while self._pending_saves:  # file writes overlap the frame just queued
            self.prefix_store.save(*self._pending_saves.pop())
        self._deliver(self._inflight)
        self._inflight = self._decode(first_chunks=False)
        mx.async_eval([r[2] for r in self._inflight if r[2] is not None])
        if not len(self._batch):  # nothing left to overlap with
            self._deliver(self._inflight)
            self._inflight = []
        elif framed and not self._ran_part:  # a frame step alone: how long a frame takes
            self._frame_times.append(time.perf_counter() - t0)
        return self.busy

    def _decode(self, first_chunks: bool) -> list[tuple[Job, mx.array, mx.array, bool]]:
        """Queue the decoding of every job's due chunk: ``(job, codes, audio, final)``.

        With ``first_chunks``, only jobs that have not produced audio yet. The due chunks
        of all jobs go to the codec together, which batches those in step with each other.
        """
        ready: list[tuple[Job, mx.array | None, mx.array | None, bool]] = []
        due: list[int] = []
        ended: list[int] = []
        for key, job in list(self._jobs.items()):
            if first_chunks and job._next_index:
                continue
            n, final = len(job._codes), job.seq.finished
            if job.seq.stop_reason == "not_finite" and job._error is None:
                job._error = not_finite_error(
                    job.rows().dtype, "its hidden state or semantic head", job.seq.frames + 1
                )
            if job.seq.stop_reason == "cancelled" or job._error is not None:
                job._codes = []  # nobody wants its audio, or it is unusable: no decoding
                if final:
                    ready.append((job, None, None, True))
            elif n and (n >= self._chunk_due(job) or final):
                due.append(len(ready))
                ready.append((job, mx.stack(job._codes), None, final))
                job._codes = []
                job._next_index += n
                job._flush = False
            elif final:
                ready.append((job, None, None, True))
            if final:
                ended.append(key)
        chunks = [(ready[i][1][None], ready[i][0]._codec_state) for i in due]
        for i, audio in zip(due, self.model.audio_tokenizer.decode_chunks(chunks)):
            job, codes, _, final = ready[i]
            ready[i] = (job, codes, audio[0].astype(mx.float32), final)
        for key in ended:  # only now: if decoding failed, fail_all() still finds them
            del self._jobs[key]
        return ready

    def _chunk_due(self, job: Job) -> int:
        """Frames that make a job's next chunk due: its first chunk is ``chunk_frames``
        (or more, as the codec's start needs), however large later chunks have grown."""
        if not job._next_index:
            return max(job.chunk_frames, self._first_chunk)
        if job._flush:
            return 1
        return job.later_chunk_frames or job.chunk_frames

    def _deliver(self, ready: list[tuple[Job, mx.array, mx.array, bool]]) -> None:
        now = time.perf_counter()
        peak = mx.get_peak_memory()
        for job, codes, audio, final in ready:
            if final:  # its stream state (conv tails, attention windows) is not needed
                job._codec_state = None
            t = job.timings
            if audio is not None and job._error is None:
                codes_np = np.array(codes)
                audio_np = np.array(audio)
                self._check_finite(job, codes_np, audio_np)
            if job._error is not None:  # it ends with the error once it has left the batch
                if final:
                    job.done = True
                    job._emit(job._error)
                continue
            if audio is None:
                codes_np = np.zeros((0, self.model.config.num_codebooks), np.int32)
                audio_np = np.zeros(0, np.float32)
            t.total_s = now - job.submitted_at
            if t.first_audio_s == 0.0 and len(audio_np):
                t.first_audio_s = t.total_s
            t.frames = job._delivered_frames = job._delivered_frames + len(codes_np)
            if final and job.seq.stop_reason == "max_frames" and job.seq.max_frames > 0:
                t.cut_short = 1
            t.audio_s += len(audio_np) / job.sample_rate
            t.peak_memory_bytes = max(t.peak_memory_bytes, peak)
            chunk = AudioChunk(
                audio_np,
                job.sample_rate,
                job._delivered_frames - len(codes_np),
                len(codes_np),
                final,
                codes_np,
                t,
                job.seq.noise.seed,
                ends_segment=final,
            )
            job._emit(chunk)
            if final:
                job.done = True
                job._emit(DONE)

    def _check_finite(self, job: Job, codes: np.ndarray, audio: np.ndarray) -> None:
        """Stop ``job`` with an error if its flow-matching head or the codec produced NaN or
        inf (acoustic codes of :data:`~voxtral_mlx.model.flow.NOT_FINITE`, audio)."""
        bad_codes = np.flatnonzero((codes[:, 1:] < N_SPECIAL_AUDIO_CODES).any(axis=1))
        if len(bad_codes):
            where, row = "its flow-matching head", bad_codes[0]
        elif not np.isfinite(audio).all():
            spf = len(audio) // max(len(codes), 1)
            where, row = "the codec", np.flatnonzero(~np.isfinite(audio))[0] // max(spf, 1)
        else:
            return
        job._error = not_finite_error(job.rows().dtype, where, job._delivered_frames + int(row) + 1)
        job.cancel()

    def _finish(self, job: Job) -> None:
        """End a job that never joined the batch (cancelled, or zero frames allowed)."""
        job._suspended = None  # a prefill set aside: its cache is not needed any more
        job.seq.finished = job.done = True
        job.timings.total_s = time.perf_counter() - job.submitted_at
        empty = np.zeros((0, self.model.config.num_codebooks), np.int32)
        chunk = AudioChunk(
            np.zeros(0, np.float32),
            job.sample_rate,
            0,
            0,
            True,
            empty,
            job.timings,
            job.seq.noise.seed,
            ends_segment=True,
        )
        job._emit(chunk)
        job._emit(DONE)
