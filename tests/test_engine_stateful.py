"""Stateful (hypothesis) test of the engine's scheduling, through the public API.

Streams are opened, read a few chunks at a time, cancelled, and run beside one-shot
syntheses while ``max_batch`` changes and the voice-prefix cache is cleared: whatever is
batched, set aside (parked), prefilled in parts or cancelled beside it, each request's
audio and codes must be exactly those of the same request run alone with the same seed.
Nothing may block (every blocking call runs under a watchdog that dumps all thread stacks),
a cancelled stream stops promptly, and once every stream is done the engine is idle.

References are computed at teardown, with nothing else open, on the same model (memoised
across examples: a reference that changed from one example to the next also fails).
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    precondition,
    rule,
    run_state_machine_as_test,
)

import voxtral_mlx
import voxtral_mlx.engine as engine_mod
from voxtral_mlx.synthetic.checkpoint import build_random_checkpoint

STEP_TIMEOUT_S = 20.0  # no call may block longer
MAX_OPEN = 6  # streams open at once, at most
# More examples search deeper (the audit that wrote this test ran 30 to 40 per configuration).
EXAMPLES = int(os.environ.get("VOXTRAL_MLX_STATEFUL_EXAMPLES", "8"))
SETTINGS = settings(
    max_examples=EXAMPLES,
    stateful_step_count=12,
    deadline=None,
    derandomize=True,  # a fixed sequence of examples: the same run every time
    database=None,
    print_blob=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

TEXTS = (
    "Hello there.",
    "Wait, what? No!",
    "The first sentence is short. The second one, with a comma, is a bit longer. "
    "Then a third! And a fourth one ends it.",
    # Long enough (about 250 tokens) to be prefilled in several parts when not split.
    " ".join(
        f"Sentence number {i} of the long text goes on for a while, then stops." for i in range(16)
    ),
    # A blank paragraph of zero-width marks: with split, a pause-only segment (no frames).
    "First line here.\n\n\u200b\u200b\n\nSecond line, after a blank one.",
)
VOICES = ("casual_male", "casual_female", "ar_male")  # prefixes of 147, 214, 67 positions
SEEDS = (0, 1, 12345)
MAX_FRAMES = (1, 4, 8, 12, 20)
# Each frame step is slowed by this much (timing only): the jobs of one rule are still
# running at the next, so requests meet in the batch, and segments are set aside.
SLOW_PUMP_S = 0.002
# (split, max_chars): one utterance, segments of the default size, small segments.
SPLITS = ((False, None), (True, None), (True, 40))

requests = st.tuples(
    st.integers(0, len(TEXTS) - 1),
    st.sampled_from(VOICES),
    st.sampled_from(SEEDS),
    st.sampled_from(MAX_FRAMES),
    st.sampled_from(SPLITS),
)


def stacks() -> str:
    """Every thread's Python stack, for a report of something blocked."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        out.append(f"--- thread {names.get(ident, ident)} ---")
        out.extend(traceback.format_stack(frame))
    return "".join(out)


def bounded(fn, what: str, timeout: float = STEP_TIMEOUT_S):
    """``fn()`` on a thread of its own, failing (with every thread's stack) if it takes
    longer than ``timeout``: a scheduling bug shows as a failure, not a hung run."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the test thread
            box["error"] = e

    thread = threading.Thread(target=run, name=f"audit-{what}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise AssertionError(f"{what} blocked for more than {timeout} s\n{stacks()}")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def kwargs_of(key: tuple) -> dict:
    """The keyword arguments of a request (its text and voice are passed by position)."""
    _, _, seed, max_frames, (split, max_chars) = key
    kw = {"seed": seed, "max_frames": max_frames, "split": split}
    if max_chars is not None:
        kw["max_chars"] = max_chars
    return kw


@dataclass(eq=False)
class Rec:
    """A request and what it gave so far."""

    key: tuple
    stream: object = None
    audio: list = field(default_factory=list)
    codes: list = field(default_factory=list)
    finals: list = field(default_factory=list)  # is_final of each chunk
    ended: bool = False  # StopIteration seen (or a whole synthesis)
    cancelled: bool = False

    def __repr__(self) -> str:
        return f"Rec({self.key}, {len(self.audio)} chunks)"


class EngineMachine(RuleBasedStateMachine):
    """Streams read from the test thread, one call at a time."""

    def __init__(self, tts, references: dict):
        super().__init__()
        self.tts = tts
        self.refs = references  # key -> (audio, codes), shared by the examples of a model
        self.recs: list[Rec] = []

    # -- helpers -------------------------------------------------------------------------

    def open_recs(self) -> list[Rec]:
        return [r for r in self.recs if r.stream is not None and not r.ended and not r.cancelled]

    def read(self, rec: Rec, k: int | None) -> None:
        """Read ``k`` chunks (None: to the end) of ``rec``'s stream, on this thread."""
        n = 0
        while k is None or n < k:
            try:
                chunk = next(rec.stream)
            except StopIteration:
                rec.ended = True
                return
            rec.audio.append(chunk.audio)
            rec.codes.append(chunk.codes)
            rec.finals.append(chunk.is_final)
            n += 1

    def after_cancel(self, rec: Rec) -> None:
        """A cancelled stream hands out at most what it already held, then ends quietly."""
        extra = 0
        while True:
            try:
                chunk = next(rec.stream)
            except StopIteration:
                break
            extra += 1
            assert extra <= 2, "a cancelled stream kept yielding chunks"
            rec.audio.append(chunk.audio)
            rec.codes.append(chunk.codes)
            rec.finals.append(chunk.is_final)
        with pytest.raises(StopIteration):  # and stays ended
            next(rec.stream)
        rec.ended = True

    def engine_state(self):
        engine = self.tts.engine
        return self.tts.call(lambda: (engine.busy, engine.stats()))

    def wait_idle(self, what: str) -> None:
        t0 = time.monotonic()
        while True:
            busy, stats = self.engine_state()
            if not busy and stats["active"] == stats["waiting"] == stats["parked"] == 0:
                return
            if time.monotonic() - t0 > STEP_TIMEOUT_S:
                raise AssertionError(f"the engine is still busy {what}: {stats}\n{stacks()}")
            time.sleep(0.005)

    # -- rules ---------------------------------------------------------------------------

    @initialize(batch=st.sampled_from((1, 2, 2, 3, 4, 4)))
    def start(self, batch: int) -> None:
        self.wait_idle("before the example starts")
        self.tts.engine.max_batch = batch

    @precondition(lambda self: len(self.open_recs()) < MAX_OPEN)
    @rule(
        req=requests,
        chunk_frames=st.sampled_from((1, 2, 5)),
        lookahead=st.sampled_from((None, None, 1, 3)),
    )
    def open_stream(self, req, chunk_frames: int, lookahead: int | None) -> None:
        self.open(req, chunk_frames, lookahead)

    def open(self, req, chunk_frames: int = 1, lookahead: int | None = None) -> Rec:
        text_i, voice = req[0], req[1]
        kw = kwargs_of(req)
        if lookahead is not None and kw["split"]:
            kw["lookahead"] = lookahead
        stream = self.tts.stream(TEXTS[text_i], voice, chunk_frames=chunk_frames, **kw)
        rec = Rec(req, stream)
        self.recs.append(rec)
        return rec

    @precondition(lambda self: len(self.open_recs()) <= MAX_OPEN - 3)
    @rule(reqs=st.lists(requests, min_size=2, max_size=3), k=st.integers(1, 3))
    def burst(self, reqs, k: int) -> None:
        """Requests one right after another, each read at once: they meet in the batch
        (the first one's segments ahead are set aside for the next, or its prefill)."""
        for req in reqs:
            rec = self.open(req)
            bounded(lambda rec=rec: self.read(rec, k), "reading a stream")

    @precondition(lambda self: len(self.open_recs()) <= MAX_OPEN - 2)
    @rule(
        long=st.tuples(
            st.sampled_from((2, 3)),
            st.sampled_from(VOICES),
            st.sampled_from(SEEDS),
            st.sampled_from((8, 12, 20)),
            st.sampled_from(((True, None), (True, 40))),
        ),
        short=requests.filter(lambda r: r[0] < 2),
        k=st.sampled_from((1, 3, None)),
    )
    def newcomer_beside_a_long_text(self, long, short, k: int | None) -> None:
        """A long text's first chunk is read (its later segments are generated ahead and
        fill the batch), then a short request is: a segment is set aside for it."""
        first = self.open(long)
        bounded(lambda: self.read(first, 1), "reading a stream")
        newcomer = self.open(short)
        bounded(lambda: self.read(newcomer, k), "reading a stream")

    @precondition(lambda self: self.open_recs())
    @rule(data=st.data(), k=st.integers(1, 8))
    def read_chunks(self, data, k: int) -> None:
        rec = data.draw(st.sampled_from(self.open_recs()), label="stream")
        bounded(lambda: self.read(rec, k), "reading a stream")

    @precondition(lambda self: self.open_recs())
    @rule(data=st.data())
    def read_to_end(self, data) -> None:
        rec = data.draw(st.sampled_from(self.open_recs()), label="stream")
        bounded(lambda: self.read(rec, None), "reading a stream to its end")

    @precondition(lambda self: self.open_recs())
    @rule(data=st.data(), read_after=st.booleans())
    def cancel(self, data, read_after: bool) -> None:
        rec = data.draw(st.sampled_from(self.open_recs()), label="stream")
        rec.stream.cancel()
        rec.cancelled = True
        if read_after:
            bounded(lambda: self.after_cancel(rec), "reading a cancelled stream")

    @precondition(lambda self: self.open_recs())
    @rule(data=st.data(), frames=st.integers(1, 6))
    def set_chunk_frames(self, data, frames: int) -> None:
        rec = data.draw(st.sampled_from(self.open_recs()), label="stream")
        rec.stream.set_chunk_frames(frames)

    @rule(batch=st.integers(1, 4))
    def set_max_batch(self, batch: int) -> None:
        self.tts.engine.max_batch = batch

    @rule(req=requests)
    def synthesize(self, req) -> None:
        speech = bounded(
            lambda: self.tts.synthesize(TEXTS[req[0]], req[1], **kwargs_of(req)), "synthesize()"
        )
        self.recs.append(Rec(req, None, [speech.audio], [speech.codes], [True], ended=True))

    @rule(req=requests, stop_after=st.sampled_from((None, 1, 3)))
    def astream(self, req, stop_after: int | None) -> None:
        """An ``async for`` over astream() on an event loop of its own, whole or left after
        ``stop_after`` chunks (``async with`` cancels the rest)."""
        rec = Rec(req)

        async def consume() -> None:
            async with self.tts.astream(TEXTS[req[0]], req[1], **kwargs_of(req)) as stream:
                async for chunk in stream:
                    rec.audio.append(chunk.audio)
                    rec.codes.append(chunk.codes)
                    rec.finals.append(chunk.is_final)
                    if stop_after is not None and len(rec.audio) >= stop_after:
                        rec.cancelled = True
                        return
            rec.ended = True

        bounded(lambda: asyncio.run(consume()), "astream()")
        self.recs.append(rec)

    @rule()
    def clear_prefix_cache(self) -> None:
        bounded(self.tts.clear_prefix_cache, "clear_prefix_cache()")

    # -- teardown: everything ends, then every output is checked -------------------------

    def teardown(self) -> None:
        try:
            # Generation does not depend on reading: with streams left open and unread,
            # every job submitted still ends and the engine falls idle.
            self.wait_idle("with its streams left unread")
            for rec in self.open_recs():
                bounded(lambda rec=rec: self.read(rec, None), "draining a stream at teardown")
            self.wait_idle("after every stream ended")
        finally:
            for rec in self.recs:
                if rec.stream is not None:
                    rec.stream.close()
        self.wait_idle("after every stream was closed")
        for rec in self.recs:
            self.check(rec)

    def reference(self, key: tuple) -> tuple[np.ndarray, np.ndarray]:
        if key not in self.refs:
            speech = bounded(
                lambda: self.tts.synthesize(TEXTS[key[0]], key[1], **kwargs_of(key)),
                "a reference synthesize()",
            )
            self.refs[key] = (speech.audio, speech.codes)
        return self.refs[key]

    def check(self, rec: Rec) -> None:
        audio_ref, codes_ref = self.reference(rec.key)
        audio = np.concatenate(rec.audio) if rec.audio else np.zeros(0, np.float32)
        codes = (
            np.concatenate(rec.codes).reshape(-1, codes_ref.shape[1])
            if rec.codes
            else np.zeros((0, codes_ref.shape[1]), np.int32)
        )
        where = f"request {rec.key} (text {TEXTS[rec.key[0]][:30]!r})"
        if rec.ended and not rec.cancelled:
            assert audio.shape == audio_ref.shape, f"{where}: {audio.shape} != {audio_ref.shape}"
            np.testing.assert_array_equal(codes, codes_ref, err_msg=f"{where}: codes differ")
            np.testing.assert_array_equal(audio, audio_ref, err_msg=f"{where}: audio differs")
            assert rec.finals and rec.finals[-1] and not any(rec.finals[:-1]), (
                f"{where}: is_final on chunks {rec.finals}"
            )
        else:  # cut short: what came is the start of the solo output
            assert len(audio) <= len(audio_ref) and len(codes) <= len(codes_ref), where
            np.testing.assert_array_equal(
                codes, codes_ref[: len(codes)], err_msg=f"{where}: codes differ"
            )
            np.testing.assert_array_equal(
                audio, audio_ref[: len(audio)], err_msg=f"{where}: audio differs"
            )


class ThreadedEngineMachine(EngineMachine):
    """As :class:`EngineMachine`, plus streams read at once from several threads, and
    cancelled from the test thread while another thread waits on them."""

    @precondition(lambda self: len(self.open_recs()) >= 2)
    @rule(data=st.data())
    def read_concurrently(self, data) -> None:
        recs = data.draw(
            st.lists(st.sampled_from(self.open_recs()), min_size=2, max_size=3, unique=True),
            label="streams",
        )
        ks = [data.draw(st.sampled_from((1, 3, 8, None)), label="chunks") for _ in recs]
        self.read_in_threads(recs, ks)

    @precondition(lambda self: len(self.open_recs()) <= MAX_OPEN - 3)
    @rule(reqs=st.lists(requests, min_size=2, max_size=3), k=st.sampled_from((1, 3, None)))
    def burst_threads(self, reqs, k: int | None) -> None:
        """New requests read at once, each from its own thread: a short one may arrive
        while a long prompt is prefilled in parts."""
        recs = [self.open(req) for req in reqs]
        self.read_in_threads(recs, [k] * len(recs))

    def read_in_threads(self, recs: list[Rec], ks: list) -> None:
        errors: list[BaseException] = []

        def run(rec: Rec, k: int | None) -> None:
            try:
                self.read(rec, k)
            except BaseException as e:
                errors.append(e)

        def all_of_them() -> None:
            threads = [threading.Thread(target=run, args=rk) for rk in zip(recs, ks)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

        bounded(all_of_them, "reading streams from several threads")
        if errors:
            raise errors[0]

    @precondition(lambda self: self.open_recs())
    @rule(data=st.data(), delay_ms=st.sampled_from((0, 2, 10, 30)))
    def cancel_while_read(self, data, delay_ms: int) -> None:
        rec = data.draw(st.sampled_from(self.open_recs()), label="stream")
        errors: list[BaseException] = []

        def reader() -> None:
            try:
                self.read(rec, None)
            except BaseException as e:
                errors.append(e)

        def run() -> None:
            thread = threading.Thread(target=reader)
            thread.start()
            time.sleep(delay_ms / 1000)
            rec.stream.cancel()
            rec.cancelled = True
            thread.join()

        bounded(run, "a stream cancelled while read")
        if errors:
            raise errors[0]
        bounded(lambda: self.after_cancel(rec), "reading a cancelled stream")


# -- models: loaded once per module ---------------------------------------------------------


@pytest.fixture(scope="module")
def noend_path(tmp_path_factory):
    """Float32, END never fires: every segment runs exactly ``max_frames`` frames."""
    return build_random_checkpoint(
        tmp_path_factory.mktemp("stateful-noend"),
        "tiny",
        seed=2,
        dtype="float32",
        suppress_end=True,
    )


@pytest.fixture(scope="module")
def end_path(tmp_path_factory):
    """Float32 with END at random frames: segments finish early."""
    return build_random_checkpoint(
        tmp_path_factory.mktemp("stateful-end"), "tiny", seed=3, dtype="float32"
    )


@pytest.fixture(scope="module")
def model(noend_path, end_path):
    loaded: dict = {}

    def get(which: str, dtype: str):
        if (which, dtype) not in loaded:
            path = noend_path if which == "noend" else end_path
            tts = voxtral_mlx.load(path, dtype=dtype, prefix_cache_dir=None)
            loaded[which, dtype] = (tts, {})
        return loaded[which, dtype]

    yield get
    for tts, _ in loaded.values():
        tts.close()


@pytest.fixture
def slowed(monkeypatch):
    """Slow a model's frame steps (:data:`SLOW_PUMP_S`) and, with ``small_parts``, prefill
    prompts in parts of 16 tokens (a long prompt then takes many frame steps, during which
    short requests arrive and overtake it). Neither may change any output."""

    def slow(tts, small_parts: bool) -> None:
        pump = tts.engine.pump

        def slow_pump() -> bool:
            time.sleep(SLOW_PUMP_S)
            return pump()

        monkeypatch.setattr(tts.worker, "pump", slow_pump)
        if small_parts:
            for name in ("PREFILL_PART_TOKENS", "MIN_PREFILL_PART_TOKENS"):
                monkeypatch.setattr(engine_mod, name, 16)
            monkeypatch.setattr(tts.engine, "_part_tokens", 16)

    return slow


# Two of the configurations the audit ran (float32 and bfloat16, with and without END,
# parts of 16 tokens or the learned size, one reading thread or several: all passed, about
# 2 minutes each at 30 examples); these two cover early ends, set-aside segments, threads
# and parted prefills in under a minute.
def test_engine_scheduling_stateful_with_end(model, slowed):
    tts, refs = model("end", "float32")
    slowed(tts, small_parts=False)
    run_state_machine_as_test(lambda: EngineMachine(tts, refs), settings=SETTINGS)


def test_engine_scheduling_stateful_threads(model, slowed):
    tts, refs = model("noend", "float32")
    slowed(tts, small_parts=True)
    run_state_machine_as_test(lambda: ThreadedEngineMachine(tts, refs), settings=SETTINGS)
