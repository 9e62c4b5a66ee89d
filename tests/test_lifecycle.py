"""A model's life cycle seen from apps: close() ends every request with an error (none is left
waiting), frees the model, and misuse (max_batch < 1, a request from the worker thread
itself) is refused instead of hanging."""

from __future__ import annotations

import _thread
import asyncio
import concurrent.futures
import gc
import json
import shutil
import subprocess
import sys
import threading
import time
import warnings
import weakref

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import voxtral_mlx
from tests.players import NullPlayer
from voxtral_mlx.engine import DONE, CallbackWarning
from voxtral_mlx.errors import CheckpointError, InputError, UsageError, VoxtralError
from voxtral_mlx.worker import Worker, WorkerFuture

VOICE = "neutral_male"


@pytest.fixture
def tts(tiny_checkpoint_noend):
    model = voxtral_mlx.load(tiny_checkpoint_noend, prefix_cache_dir=None)
    yield model
    model.close()


def test_close_fails_a_stream_in_progress(tts):
    stream = tts.stream("A long utterance.", VOICE, seed=1, max_frames=500)
    next(stream)
    tts.close()
    with pytest.raises(VoxtralError, match="closed"):
        for _ in stream:
            pass


def test_close_fails_an_async_stream_in_progress(tts):
    async def consume() -> None:
        stream = tts.astream("A long utterance.", VOICE, seed=1, max_frames=500)
        await stream.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, tts.close)
        async for _ in stream:
            pass

    with pytest.raises(VoxtralError, match="closed"):
        asyncio.run(asyncio.wait_for(consume(), timeout=60))


def test_close_fails_a_background_warmup_and_waiting_requests(tts):
    future = tts.warmup(wait=False)
    waiting = tts.stream("Queued behind the warm-up.", VOICE, seed=2, max_frames=50)
    tts.close()
    with pytest.raises(VoxtralError, match="closed"):
        future.result(timeout=60)
    with pytest.raises(VoxtralError, match="closed"):
        list(waiting)


def test_say_reports_the_close(tts):
    playback = tts.say("One. Two. Three.", VOICE, wait=False, max_frames=300, player=NullPlayer())
    tts.close()
    with pytest.raises(VoxtralError, match="closed"):
        playback.wait(60)
    assert playback.done


def test_a_submitted_job_keeps_its_model(tiny_checkpoint_noend):
    """An app that keeps only the job it submitted: the model is not collected (and so
    closed) under it."""

    def start():
        model = voxtral_mlx.load(tiny_checkpoint_noend, prefix_cache_dir=None)
        return model.submit(model.job("Hello there.", VOICE, seed=1, max_frames=40))

    job = start()
    gc.collect()
    frames = 0
    while (item := job.output.get(timeout=60)) is not DONE:
        assert not isinstance(item, BaseException), item
        frames += item.frames
    assert frames == 40
    model = job.owner
    del job
    model.close()


class _PlayingSink:
    """A player that plays out in "real time": finish() returns when stop() is called, or
    after 30 s."""

    def __init__(self) -> None:
        self.finishing = threading.Event()
        self.stopped = threading.Event()

    def feed(self, audio):
        pass

    def finish(self):
        self.finishing.set()
        self.stopped.wait(30)

    def stop(self):
        self.stopped.set()


def test_close_silences_say_whose_audio_is_all_generated(tts):
    """The generation is over, the player still has audio to play: close() stops it, and
    wait() says why, as when it closes mid-generation."""
    sink = _PlayingSink()
    playback = tts.say("Hi.", VOICE, wait=False, max_frames=2, player=sink)
    assert sink.finishing.wait(30)
    tts.close()
    assert sink.stopped.is_set()
    with pytest.raises(VoxtralError, match="closed"):
        playback.wait(5)
    assert playback.done


def test_say_interrupted_as_it_starts_leaves_nothing_playing(tts, monkeypatch):
    """Ctrl-C landing while say() starts its playback thread: the caller never got a
    handle, so nothing may go on generating or playing."""
    import voxtral_mlx.tts as tts_module

    class InterruptedPlayback(tts_module.Playback):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)  # the thread runs: then the signal lands
            raise KeyboardInterrupt

    monkeypatch.setattr(tts_module, "Playback", InterruptedPlayback)
    sink = _PlayingSink()
    with pytest.raises(KeyboardInterrupt):
        tts.say("One. Two. Three.", VOICE, max_frames=300, player=sink)
    assert sink.stopped.is_set()
    deadline = time.monotonic() + 10
    while any(t.name == "voxtral-mlx-say" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the playback thread went on"
        time.sleep(0.01)
    # The worker pumps once after each task: a job cancelled meanwhile (it may be between
    # the parts of its voice's prefix) has left the engine by the second call.
    tts.call(lambda: None)
    assert tts.call(tts.engine.stats)["active"] == 0


def test_loading_again_and_again_leaves_no_thread_behind(tiny_checkpoint_noend, tmp_path):
    """A closed model's worker thread ends (its MLX state handed back first), so repeated
    loads, and failed ones, do not pile up threads."""

    def threads() -> int:
        return sum(t.name == "voxtral-mlx" for t in threading.enumerate())

    broken = tmp_path / "broken"
    shutil.copytree(tiny_checkpoint_noend, broken)
    weights = broken / "consolidated.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # the loader, on its thread, refuses it
    first = voxtral_mlx.load(tiny_checkpoint_noend, prefix_cache_dir=None)
    want = first.synthesize("Hi.", VOICE, seed=1, max_frames=2).codes
    thread = first.worker._thread
    first.close()
    assert not thread.is_alive()
    before = threads()
    for _ in range(5):
        model = voxtral_mlx.load(tiny_checkpoint_noend, prefix_cache_dir=None)
        assert np.array_equal(model.synthesize("Hi.", VOICE, seed=1, max_frames=2).codes, want)
        model.close()
        with pytest.raises(CheckpointError, match=r"consolidated\.safetensors"):
            voxtral_mlx.load(broken, prefix_cache_dir=None)
    assert threads() == before
    closed = Worker()
    closed.close()
    assert not closed._thread.is_alive() and not closed.in_worker
    with pytest.raises(VoxtralError, match="closed"):
        closed.call(lambda: 1)


# The model's worker thread still running Python when the interpreter's teardown begins
# (close() gave up waiting for it): the teardown ends the thread, and MLX state the thread
# still held then (its random key, compiled graphs, streams) aborted the process.
_EXIT_RACE = """
import sys, time
import voxtral_mlx
from voxtral_mlx import worker

_run = worker.Worker._run


def run_then_stay_busy(self):
    _run(self)
    while True:
        time.sleep(0.005)


worker.Worker._run = run_then_stay_busy
worker.CLOSE_WAIT_S = 0.2


class SlowTeardown:
    # Cleared with the globals, once the runtime is finalizing: the GIL is let go here
    # long enough for the worker thread to ask for it, which ends the thread.
    def __init__(self):
        self.sleep = time.sleep

    def __del__(self):
        self.sleep(0.3)


slow = SlowTeardown()
tts = voxtral_mlx.load(sys.argv[1], prefix_cache_dir=None)
tts.synthesize("Hello there. How are you?", "neutral_male", seed=1, max_frames=3)
for _ in tts.stream("One. Two.", "neutral_male", seed=2, max_frames=2, split=True):
    pass
if sys.argv[2] == "close":
    tts.close()
print("done", flush=True)
"""


@pytest.mark.parametrize("close", [False, True])
def test_a_worker_thread_ended_by_the_interpreters_teardown_does_not_abort(
    tiny_checkpoint_noend, close
):
    proc = subprocess.run(
        [sys.executable, "-c", _EXIT_RACE, str(tiny_checkpoint_noend), "close" if close else ""],
        capture_output=True,
        timeout=300,
    )
    assert proc.stdout == b"done\n"
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-2000:]


def test_a_load_stops_between_parts_of_its_weights(tiny_checkpoint, monkeypatch):
    """The check a load is given runs before every part it reads (one array per part here),
    and the first check that raises ends the load: nothing is read after it."""
    from voxtral_mlx import loader

    monkeypatch.setattr(loader, "LOAD_PART_BYTES", 1)
    real_eval = mx.eval
    log: list[str] = []

    def spy_eval(*args):
        log.append("eval")
        return real_eval(*args)

    monkeypatch.setattr(mx, "eval", spy_eval)

    def check_counted() -> None:
        log.append("check")

    loaded = loader.load_model_dir(tiny_checkpoint, check=check_counted)
    arrays = len(tree_flatten(loaded.model.parameters()))
    checks = log.count("check")
    # Each layer fused, and every array of the model read on its own, checked before.
    assert checks >= arrays + loaded.config.backbone.n_layers
    for stop_at in (1, loaded.config.backbone.n_layers, checks // 2, checks):
        log.clear()

        def check_stopping(stop_at=stop_at) -> None:
            # As a closed worker's check: once it raises, it raises every time.
            log.append("check")
            if log.count("check") >= stop_at:
                raise UsageError("stop here")

        with pytest.raises(UsageError, match="stop here"):
            loader.load_model_dir(tiny_checkpoint, check=check_stopping)
        stopped = [i for i, what in enumerate(log) if what == "check"][stop_at - 1]
        assert "eval" not in log[stopped:], f"read on after the load was stopped at {stop_at}"


# An app quitting (its main thread returning) while its model loads on a background thread:
# the load, slowed here to ~20 s by a sleep per array read, ends at the next part instead of
# holding the exit for CLOSE_WAIT_S (and aborting the process if MLX was still reading then).
_QUIT_WHILE_LOADING = """
import sys, threading, time
import mlx.core as mx
from mlx.utils import tree_flatten
import voxtral_mlx
from voxtral_mlx import loader

loader.LOAD_PART_BYTES = 1
real_eval = mx.eval
reading = threading.Event()


def slow_eval(*args):
    reading.set()
    time.sleep(0.1 * len(tree_flatten(list(args))))
    return real_eval(*args)


mx.eval = slow_eval


def load():
    voxtral_mlx.load(sys.argv[1], prefix_cache_dir=None)
    print("loaded", flush=True)


threading.Thread(target=load, daemon=True).start()
reading.wait()
time.sleep(0.3)
print("quitting", flush=True)
"""


def test_an_app_quitting_while_its_model_loads_exits_at_once(tiny_checkpoint):
    proc = subprocess.Popen(
        [sys.executable, "-c", _QUIT_WHILE_LOADING, str(tiny_checkpoint)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stdout.readline() == b"quitting\n"
        quit_at = time.monotonic()
        rest, err = proc.communicate(timeout=120)
        waited = time.monotonic() - quit_at
    finally:
        proc.kill()
    assert proc.returncode == 0, err.decode(errors="replace")[-2000:]
    assert rest == b""  # the load did not finish
    assert waited < 3, f"the exit waited {waited:.1f} s for the load"


def test_an_interrupt_stops_a_load_at_once(tiny_checkpoint, monkeypatch):
    """Ctrl-C in a REPL or notebook while load() reads the weights (here an interrupt without
    a signal, as IDLE sends; on macOS a signal does not break an untimed wait either): it is
    raised within a wait slice, and the load stops at its next part."""
    from voxtral_mlx import loader

    monkeypatch.setattr(loader, "LOAD_PART_BYTES", 1)
    real_eval = mx.eval
    reading = threading.Event()
    reads: list[float] = []

    def slow_eval(*args):
        if threading.current_thread().name == "voxtral-mlx":  # the load's, not the test's
            reading.set()
            reads.append(time.monotonic())
            time.sleep(0.1 * len(tree_flatten(list(args))))  # a load of ~35 s
        return real_eval(*args)

    monkeypatch.setattr(mx, "eval", slow_eval)
    before = {t for t in threading.enumerate() if t.name == "voxtral-mlx"}

    def interrupt() -> None:
        reading.wait(60)
        time.sleep(0.3)
        _thread.interrupt_main()

    threading.Thread(target=interrupt, daemon=True).start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        voxtral_mlx.load(tiny_checkpoint, prefix_cache_dir=None)
    interrupted_at = time.monotonic()
    assert interrupted_at - t0 < 10, f"load() raised after {interrupted_at - t0:.1f} s"
    # load() closed the model's worker: its thread has ended, reading nothing more.
    assert {t for t in threading.enumerate() if t.name == "voxtral-mlx"} <= before
    assert reads[-1] < interrupted_at


@pytest.mark.parametrize(
    "call, frame_s, bound_s",
    [("synthesize", 0.15, 1.5), ("warmup", 1.0, 0.8)],
    ids=["synthesize", "warmup"],
)
def test_an_interrupt_stops_a_blocking_request_between_chunks(
    tts, monkeypatch, call, frame_s, bound_s
):
    """synthesize() waits for 16-frame chunks, warmup() for its jobs' frames: an interrupt
    (Ctrl-C in a REPL) is raised within a wait slice, not after the chunk or frame, and the
    request stops."""
    real_eval, real_async_eval = mx.eval, mx.async_eval
    frames = threading.Event()

    def slowed(real):
        def run(*args):
            if threading.current_thread().name == "voxtral-mlx":
                frames.set()
                time.sleep(frame_s)
            return real(*args)

        return run

    monkeypatch.setattr(mx, "eval", slowed(real_eval))
    monkeypatch.setattr(mx, "async_eval", slowed(real_async_eval))
    sent: list[float] = []

    def interrupt() -> None:
        frames.wait(60)
        time.sleep(0.3)
        sent.append(time.monotonic())
        _thread.interrupt_main()

    threading.Thread(target=interrupt, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        if call == "synthesize":
            tts.synthesize("A long utterance.", VOICE, seed=1, max_frames=500)
        else:
            tts.warmup(VOICE)
    assert time.monotonic() - sent[0] < bound_s
    deadline = time.monotonic() + 10
    while tts.worker._busy:  # the request's frames stop (no other request is running)
        assert time.monotonic() < deadline, "the interrupted request kept generating"
        time.sleep(0.02)
    monkeypatch.undo()
    assert len(tts.synthesize("Hi.", VOICE, seed=1, max_frames=2).codes) == 2


def test_a_worker_futures_timeout_and_result_keep_their_meaning():
    worker = Worker()
    try:
        gate = threading.Event()
        future = WorkerFuture(worker)
        worker.submit(lambda: future.set_result(gate.wait(10) and 7))
        t0 = time.monotonic()
        with pytest.raises(concurrent.futures.TimeoutError):
            future.result(timeout=0.25)
        with pytest.raises(concurrent.futures.TimeoutError):
            future.exception(timeout=0.25)
        assert 0.45 <= time.monotonic() - t0 < 5
        gate.set()
        assert future.result() == 7 and future.exception() is None
        failed = WorkerFuture(worker)
        worker.submit(lambda: failed.set_exception(TimeoutError("the task's own")))
        with pytest.raises(TimeoutError, match="the task's own"):
            failed.result(timeout=5)
        assert worker.call(lambda: 3) == 3
    finally:
        worker.close()


def test_submissions_racing_close_all_resolve():
    for _ in range(20):
        worker = Worker()
        futures = []
        lock = threading.Lock()

        def submit(worker=worker, futures=futures, lock=lock) -> None:
            for _ in range(50):
                f = worker.submit(lambda: 1)
                with lock:
                    futures.append(f)

        threads = [threading.Thread(target=submit) for _ in range(3)]
        for t in threads:
            t.start()
        worker.close()
        for t in threads:
            t.join()
        for f in futures:
            try:
                assert f.result(timeout=10) == 1
            except VoxtralError as e:
                assert "closed" in str(e)


def test_close_inside_submit_on_the_same_thread_neither_hangs_nor_strands_the_task():
    """A finalizer or a signal handler calling close() while its thread is inside submit()
    (holding the worker's lock): it waited for that lock forever; and a task queued after
    the closing marker was never run nor refused."""
    from concurrent.futures import Future

    worker = Worker()
    future: Future = Future()
    with worker._lock:  # inside submit(), after its check that the worker is open
        worker.close(wait=False)  # the finalizer: returns, as the lock is reentrant
        worker._tasks.put((lambda: 1, future))  # submit() goes on
    with pytest.raises(VoxtralError, match="closed"):
        future.result(timeout=30)


def test_each_consumer_of_a_close_gets_its_own_error(tts):
    """One exception object raised in every consumer's thread collected all their
    tracebacks (and kept their frames alive)."""
    streams = [tts.stream(f"Utterance {i}.", VOICE, seed=i, max_frames=500) for i in range(3)]
    for stream in streams:
        next(stream)
    tts.close()
    errors = []
    for stream in streams:
        with pytest.raises(VoxtralError, match="closed") as info:
            list(stream)
        errors.append(info.value)
    assert len({id(e) for e in errors}) == 3
    assert all(str(e) == str(errors[0]) and type(e) is type(errors[0]) for e in errors)


def test_a_callback_that_exits_ends_its_job_not_the_worker(tts):
    """An on_output callback raising SystemExit (or KeyboardInterrupt) ended the worker
    thread: every later request waited for ever. The failure is told (once), not lost."""
    for exc in (SystemExit, KeyboardInterrupt, ValueError):
        job = tts.job("Call back.", VOICE, seed=1, max_frames=50)
        calls = []

        def on_output(item, exc=exc, calls=calls):
            calls.append(item)
            raise exc("in the callback")

        job.on_output = on_output
        with pytest.warns(CallbackWarning) as caught:
            tts.submit(job)
            out = tts.synthesize("Still serving.", VOICE, seed=1, max_frames=2)
            assert len(out.codes) == 2
            _wait_done(job)
        assert job.done and job.seq.stop_reason == "cancelled"  # ended by its callback
        assert job.seq.frames < 50
        assert len(calls) > 1  # the items after the failure still reach it (DONE last)
        told = [w for w in caught if w.category is CallbackWarning]
        assert len(told) == 1 and f"{exc.__name__}('in the callback')" in str(told[0].message)


def test_a_job_chained_from_a_callback_told_of_a_failed_frame_runs(tts):
    """After a frame failed, the worker went to sleep with the retry the failure's callback
    had submitted still waiting: it ran only when some other request came."""
    model, real_frame, calls = tts.model, tts.model.frame, [0]

    def frame(*args):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("a frame fails once")
        return real_frame(*args)

    tts.call(lambda: setattr(model, "frame", frame))
    try:
        retry = tts.job("Again.", VOICE, seed=1, max_frames=5)
        first = tts.job("Fails.", VOICE, seed=0, max_frames=20)

        def on_output(item):
            if isinstance(item, BaseException):
                tts.submit(retry)

        first.on_output = on_output
        tts.submit(first)
        item = retry.output.get(timeout=10)  # (queue.Empty: still waiting)
        assert not isinstance(item, BaseException)
    finally:
        tts.call(lambda: setattr(model, "frame", real_frame))


def test_a_warning_raised_as_an_error_does_not_end_the_worker(tts):
    """Under -W error, the warning told of a failing callback was raised on the worker: every
    running job failed with it, or, while failing jobs, the worker thread ended."""
    job = tts.job("Call back.", VOICE, seed=1, max_frames=50)

    def on_output(item):
        raise ValueError("in the callback")

    job.on_output = on_output
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tts.submit(job)
        beside = tts.synthesize("Still serving.", VOICE, seed=1, max_frames=3)
    assert len(beside.codes) == 3
    _wait_done(job)
    assert job.done and job.seq.stop_reason == "cancelled"


def _wait_done(job, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not job.done and time.monotonic() < deadline:
        time.sleep(0.005)


def _collect(item, codes: list[np.ndarray], done: threading.Event | None) -> None:
    if item is DONE:
        if done is not None:
            done.set()
    elif not isinstance(item, BaseException):
        codes.append(np.asarray(item.codes))


def test_a_callback_can_chain_the_next_job(tts):
    """submit() only hands a job over, yet it was refused on the worker thread like the
    requests that wait for audio: an app could not chain jobs from on_output."""
    done = threading.Event()
    codes: dict[str, list[np.ndarray]] = {"first": [], "second": []}
    second = tts.job("And then this.", VOICE, seed=2, max_frames=6)
    second.on_output = lambda item: _collect(item, codes["second"], done)
    first = tts.job("First this.", VOICE, seed=1, max_frames=4)

    def on_first(item) -> None:
        _collect(item, codes["first"], None)
        if item is DONE:
            tts.submit(second)  # on the worker thread

    first.on_output = on_first
    tts.submit(first)
    assert done.wait(60)
    assert second.seq.stop_reason == "max_frames" and first.seq.stop_reason == "max_frames"
    alone = tts.synthesize("And then this.", VOICE, seed=2, max_frames=6)
    np.testing.assert_array_equal(np.concatenate(codes["second"]), alone.codes)
    # Calling submit() inside tts.call() is a hand-over too.
    third = tts.job("Third.", VOICE, seed=3, max_frames=2)
    assert tts.call(lambda: tts.submit(third)) is third
    chunks = []
    while (item := third.output.get(timeout=60)) is not DONE:
        chunks.append(item)
    assert sum(c.frames for c in chunks) == 2


def test_a_job_chained_while_the_model_closes_gets_the_closed_error(tiny_checkpoint_noend):
    model = voxtral_mlx.load(tiny_checkpoint_noend, prefix_cache_dir=None)
    errors: list[BaseException] = []
    started, ended = threading.Event(), threading.Event()
    job = model.job("A long one.", VOICE, seed=1, max_frames=500)

    def on_output(item) -> None:
        started.set()
        if isinstance(item, BaseException):
            try:
                model.submit(later)
            except BaseException as e:
                errors.append(e)
            ended.set()

    later = model.job("Later.", VOICE, seed=1, max_frames=2)
    job.on_output = on_output
    model.submit(job)
    assert started.wait(60)
    model.close()
    assert ended.wait(60)
    assert len(errors) == 1 and isinstance(errors[0], UsageError)
    assert "closed" in str(errors[0])


def test_a_stream_continued_on_the_worker_thread_is_refused(tts):
    """A stream whose segment was already in flight blocked the worker on its own output
    when iterated there: the model hung."""
    stream = tts.stream("Hello there.", VOICE, seed=1, max_frames=40)
    next(stream)
    with pytest.raises(UsageError, match="worker thread"):
        tts.worker.submit(lambda: list(stream)).result(timeout=60)
    assert len(tts.synthesize("Still serving.", VOICE, seed=1, max_frames=2).codes) == 2


def test_a_stream_refused_on_the_worker_thread_can_still_be_read_elsewhere(tts):
    """As the error says (hand it to another thread): the refusal left the stream stopped
    ("stopped on an error ... cut short") though nothing was lost."""
    stream = tts.stream("Hello there. And again.", VOICE, seed=1, split=True, max_frames=3)
    with pytest.raises(UsageError, match="worker thread"):
        tts.call(lambda: next(stream))
    expected = tts.synthesize("Hello there. And again.", VOICE, seed=1, split=True, max_frames=3)
    np.testing.assert_array_equal(np.concatenate([c.audio for c in stream]), expected.audio)


def test_close_frees_the_model(tiny_checkpoint_noend):
    model = voxtral_mlx.load(tiny_checkpoint_noend, prefix_cache_dir=None)
    model.synthesize("Hi.", VOICE, seed=1, max_frames=2)
    refs = weakref.ref(model), weakref.ref(model.model)
    model.close()
    del model
    gc.collect()
    assert refs[0]() is None and refs[1]() is None


def test_close_frees_the_model_while_the_object_is_still_held(tiny_checkpoint_noend):
    """README: "close() frees the model at once". Switching models (``tts.close(); tts =
    load(other)``) held both while the new one loaded: the closed object kept its model."""
    model = voxtral_mlx.load(tiny_checkpoint_noend, prefix_cache_dir=None)
    model.synthesize("Hi.", VOICE, seed=1, max_frames=2)
    refs = weakref.ref(model.model), weakref.ref(model.model.audio_tokenizer)
    model.close()
    gc.collect()
    assert refs[0]() is None and refs[1]() is None  # ``model`` itself is still held
    with pytest.raises(UsageError, match="this model was closed") as exc:
        model.decode(np.full((2, 37), 2, np.int32))
    assert "\n" not in str(exc.value)
    with pytest.raises(VoxtralError, match="this model was closed"):
        model.prompt_embeddings("Hi.", VOICE)
    with pytest.raises(VoxtralError, match="this model was closed"):
        model.synthesize("Hi.", VOICE, seed=1, max_frames=2)
    for make_stream in (model.stream, model.astream):  # at the call, not at the first item
        with pytest.raises(VoxtralError, match="this model was closed"):
            make_stream("Hi.", VOICE, seed=1, max_frames=2)
    assert model.sample_rate == 24000 and VOICE in model.voices


def test_a_with_block_closes_the_model(tiny_checkpoint_noend):
    with voxtral_mlx.load(tiny_checkpoint_noend, prefix_cache_dir=None) as model:
        speech = model.synthesize("Hi.", VOICE, seed=1, max_frames=2)
        assert len(speech.audio) == 2 * model.samples_per_frame
        assert not model.worker.closed
    assert model.worker.closed
    with pytest.raises(VoxtralError, match="this model was closed"):
        model.synthesize("Hi.", VOICE, seed=1, max_frames=2)
    other = voxtral_mlx.load(tiny_checkpoint_noend, prefix_cache_dir=None)
    with pytest.raises(KeyError), other:  # an error in the block is not swallowed
        raise KeyError("from the block")
    assert other.worker.closed


def test_close_frees_the_model_when_an_apps_player_fails_to_stop(tiny_checkpoint_noend):
    """A player (say(player=...)) whose stop() raised made close() raise before freeing
    anything, with the finalizer already detached: the model stayed loaded for good."""

    class FailingStop(NullPlayer):
        def stop(self) -> None:
            raise RuntimeError("the app's player failed")

    model = voxtral_mlx.load(tiny_checkpoint_noend, prefix_cache_dir=None)
    playback = model.say(
        "One. Two. Three.", VOICE, wait=False, max_frames=300, player=FailingStop()
    )
    refs = weakref.ref(model.model), weakref.ref(model.model.audio_tokenizer)
    model.close()
    assert model.worker.closed
    gc.collect()
    assert refs[0]() is None and refs[1]() is None
    with pytest.raises(VoxtralError, match="closed"):
        playback.wait(60)


def test_a_job_of_another_model_is_refused(tiny_checkpoint_noend, tiny_checkpoint):
    """A job made by one loaded model and submitted to another ran its prompt, voice rows
    and noise on the wrong weights: a raw MLX shape error, or audio of the wrong model."""
    a = voxtral_mlx.load(tiny_checkpoint_noend, prefix_cache_dir=None)
    b = voxtral_mlx.load(tiny_checkpoint, prefix_cache_dir=None)
    try:
        job = a.job("Hi.", VOICE, seed=1, max_frames=2)
        with pytest.raises(InputError) as exc:
            b.submit(job)
        assert "made by another model" in str(exc.value) and "\n" not in str(exc.value)
        a.submit(job)  # not claimed by the refusal: still its own model's to run
        frames = 0
        while (item := job.output.get(timeout=60)) is not DONE:
            assert not isinstance(item, BaseException), item
            frames += item.frames
        assert frames == 2
    finally:
        a.close()
        b.close()


def test_a_dropped_model_is_freed_without_close(tiny_checkpoint_noend):
    """An app that forgets close() must not keep a copy of the weights per load."""

    def use_once() -> tuple[weakref.ref, weakref.ref, object]:
        model = voxtral_mlx.load(tiny_checkpoint_noend, prefix_cache_dir=None)
        model.synthesize("Hi.", VOICE, seed=1, max_frames=2)
        return weakref.ref(model.model), weakref.ref(model.engine), model.worker

    model_ref, engine_ref, worker = use_once()
    deadline = time.monotonic() + 10
    while (model_ref() is not None or engine_ref() is not None) and time.monotonic() < deadline:
        gc.collect()  # the worker lets go on its own thread, after the finalizer asks it
        time.sleep(0.01)
    assert model_ref() is None and engine_ref() is None
    with pytest.raises(VoxtralError, match="closed"):
        worker.submit(lambda: 1).result(timeout=10)


_MEMORY_AFTER_CLOSE = r"""
import gc, json, sys, time
import mlx.core as mx
import voxtral_mlx

gc.disable()  # an idle app may not collect for a long time: nothing may wait for it
path, voice = sys.argv[1:]


def used():
    tts = voxtral_mlx.load(path, prefix_cache_dir=None)
    tts.synthesize("Hi there.", voice, seed=1, max_frames=4)
    return tts


def memory():
    return [mx.get_active_memory(), mx.get_cache_memory()]


tts = used()
out = {"loaded": memory()}
tts.close()
out["closed"] = memory()  # the object is still held
del tts
tts = used()
del tts  # dropped without close(): the worker lets go on its own thread
deadline = time.monotonic() + 10
while mx.get_active_memory() and time.monotonic() < deadline:
    time.sleep(0.01)
time.sleep(0.1)
out["dropped"] = memory()
print(json.dumps(out))
"""


def test_closing_gives_the_memory_back_to_the_system(tiny_checkpoint_noend):
    """The flow head and the codec hold their compiled steps (reference cycles): after
    close() ~1 GB of a full model stayed until the collector ran, and every freed weight
    stayed in MLX's buffer cache (8 GB)."""
    proc = subprocess.run(
        [sys.executable, "-c", _MEMORY_AFTER_CLOSE, str(tiny_checkpoint_noend), VOICE],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["loaded"][0] > 10_000_000  # the weights (the measure sees them)
    # Nothing stays, not even the worker thread's random key (8 bytes, made when the
    # model was built): the thread hands back its MLX state as it ends.
    assert out["closed"] == [0, 0]
    assert out["dropped"] == [0, 0]


def test_an_idle_model_lets_go_of_mlx_cached_buffers_beyond_its_working_set(tts):
    """Outgrown KV caches and a long prompt's temporaries stayed in MLX's buffer cache
    while an app sat idle (hundreds of MB at the real widths); a frame's working set is
    kept, so the next short request allocates nothing anew."""

    def cache_once_idle() -> int:  # runs on the worker, after the pump that went idle
        return tts.call(mx.get_cache_memory)

    tts.synthesize("Hello there, a little longer now.", VOICE, seed=1, max_frames=30)
    kept = cache_once_idle()
    assert kept > 0  # the tiny model's working set, far below the threshold
    tts.engine.idle_cache_bytes = kept // 2
    tts.synthesize("Hello there, a little longer now.", VOICE, seed=1, max_frames=30)
    # Emptied when the engine went idle; what was freed after that (the last chunk's
    # arrays) is a few hundred kB.
    assert cache_once_idle() < kept // 4


def test_a_model_held_only_by_its_stream_keeps_serving(tiny_checkpoint_noend):
    """The stream holds the model: dropping the name of the model must not close it."""
    reference = voxtral_mlx.load(tiny_checkpoint_noend, prefix_cache_dir=None)
    want = reference.synthesize("Hi there.", VOICE, seed=3, max_frames=6).codes
    reference.close()
    stream = voxtral_mlx.load(tiny_checkpoint_noend, prefix_cache_dir=None).stream(
        "Hi there.", VOICE, seed=3, max_frames=6
    )
    gc.collect()
    got = np.concatenate([chunk.codes for chunk in stream if len(chunk.codes)])
    assert np.array_equal(got, want)


def test_a_job_is_submitted_once(tts):
    """A second submission would interleave two generations in one output queue."""
    want = tts.synthesize("Once only.", VOICE, seed=1, max_frames=5).codes
    job = tts.job("Once only.", VOICE, seed=1, max_frames=5)
    assert tts.submit(job) is job
    with pytest.raises(InputError, match="already submitted"):
        tts.submit(job)
    chunks = []
    while (item := job.output.get(timeout=30)) is not DONE:
        chunks.append(item.codes)
    assert np.array_equal(np.concatenate(chunks), want)


def test_max_batch_must_be_from_one_to_64(tiny_checkpoint_noend, tts):
    with pytest.raises(InputError, match="max_batch"):
        voxtral_mlx.load(tiny_checkpoint_noend, max_batch=0)
    with pytest.raises(InputError, match="max_batch must be at most 64, got 65"):
        voxtral_mlx.load(tiny_checkpoint_noend, max_batch=65)
    with pytest.raises(InputError, match="max_batch"):
        tts.engine.max_batch = 0
    assert tts.engine.max_batch == tts.max_batch == 4
    with pytest.raises(AttributeError):
        tts.max_batch = 2  # chosen at load()
    pair = voxtral_mlx.load(tiny_checkpoint_noend, max_batch=2, prefix_cache_dir=None)
    try:
        assert pair.max_batch == 2
    finally:
        pair.close()


def test_requests_from_the_worker_thread_are_refused(tts):
    with pytest.raises(VoxtralError, match="worker thread"):
        tts.worker.submit(lambda: tts.synthesize("Hi.", VOICE, max_frames=2)).result(timeout=30)
    assert len(tts.synthesize("Still serving.", VOICE, seed=1, max_frames=2).codes) == 2


def test_noise_is_checked_as_float32(tts):
    with pytest.raises(InputError, match="infinite"):
        tts.synthesize("Hi.", VOICE, noise=np.full((4, 36), 1e300))


def test_every_segment_is_checked_when_the_stream_is_made(tts):
    text = "Short opening.\n\n" + " ".join(["word"] * 9000) + "."
    with pytest.raises(InputError, match="max_chars"):
        tts.stream(text, VOICE, split=True, max_chars=200_000, lookahead=1, max_frames=2)


def test_say_after_close_raises_at_once_and_opens_no_audio(tiny_checkpoint, monkeypatch):
    """say(wait=False) returned a handle and opened the device; the error came only from
    wait(), so an app that does not wait stayed silent without a word."""
    import voxtral_mlx.audio.player as player_mod

    opened: list[object] = []
    monkeypatch.setattr(player_mod, "AudioPlayer", lambda *a, **k: opened.append(a))
    model = voxtral_mlx.load(tiny_checkpoint, prefix_cache_dir=None)
    model.close()
    for wait in (False, True):
        with pytest.raises(VoxtralError, match="closed"):
            model.say("Hello.", wait=wait)
    assert opened == []


def test_say_with_a_damaged_voice_file_raises_and_opens_no_audio(
    tiny_checkpoint, tmp_path, monkeypatch
):
    import shutil

    import voxtral_mlx.audio.player as player_mod
    from voxtral_mlx.errors import VoiceError

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_checkpoint, model_dir)
    (model_dir / "voice_embedding" / "fr_male.pt").write_bytes(b"not a voice")
    opened: list[object] = []
    monkeypatch.setattr(player_mod, "AudioPlayer", lambda *a, **k: opened.append(a))
    model = voxtral_mlx.load(model_dir, prefix_cache_dir=None)
    try:
        with pytest.raises(VoiceError, match=r"fr_male\.pt"):
            model.say("Hello.", "fr_male", wait=False)
        assert opened == [] and model.engine.stats()["waiting"] == 0
    finally:
        model.close()


def test_say_of_live_text_with_a_damaged_voice_file_lets_the_text_go(
    tiny_checkpoint, tmp_path, monkeypatch
):
    """The stream say() made for the text is closed: its reader does not go on taking the
    app's pieces (an LLM's answer) after say() has raised."""
    import shutil

    import voxtral_mlx.audio.player as player_mod
    from voxtral_mlx.errors import VoiceError

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_checkpoint, model_dir)
    (model_dir / "voice_embedding" / "fr_male.pt").write_bytes(b"not a voice")
    monkeypatch.setattr(player_mod, "AudioPlayer", lambda *a, **k: NullPlayer())
    resumed, released = threading.Event(), threading.Event()

    def answer():
        try:
            yield "Hello there. "
            resumed.wait(10)
            while True:
                yield "More words. "
        finally:
            released.set()

    model = voxtral_mlx.load(model_dir, prefix_cache_dir=None)
    try:
        with pytest.raises(VoiceError, match=r"fr_male\.pt"):
            model.say(answer(), "fr_male", wait=False)
        resumed.set()
        assert released.wait(10)
    finally:
        model.close()


def test_say_and_async_requests_from_the_worker_thread_are_refused(tts):
    """say(), an event loop run inside tts.call(), and a warmup future waited on there all
    waited for the worker from the worker: the model hung for good (and the process
    aborted at exit)."""

    def say_wait():
        return tts.say("Hi.", VOICE, player=NullPlayer(), max_frames=2)

    def say_then_wait():
        return tts.say("Hi.", VOICE, wait=False, player=NullPlayer(), max_frames=2).wait()

    def async_synth():
        return asyncio.run(tts.asynthesize("Hi.", VOICE, max_frames=2))

    def warmup_result():
        return tts.warmup(VOICE, wait=False).result()

    def warmup_wait():
        return tts.warmup(VOICE)

    for request in (say_wait, say_then_wait, async_synth, warmup_result, warmup_wait):
        with pytest.raises(VoxtralError, match="worker thread"):
            tts.worker.submit(request).result(timeout=60)
    assert len(tts.synthesize("Still serving.", VOICE, seed=1, max_frames=2).codes) == 2


def test_a_timed_out_wait_for_a_chunk_stops_the_stream_and_says_so(tts):
    """asyncio.wait_for(stream.__anext__(), t) timing out cancels generation; the next
    __anext__ ended the stream quietly, passing a cut-off stream for a finished one."""

    async def main():
        stream = tts.astream("A long one.", VOICE, seed=1, max_frames=200)
        with pytest.raises(asyncio.TimeoutError):
            while True:
                await asyncio.wait_for(stream.__anext__(), 0.0001)
        with pytest.raises(VoxtralError, match="shield"):
            await stream.__anext__()

        # Shielded, the same wait keeps the stream going.
        stream = tts.astream("A long one.", VOICE, seed=1, max_frames=5)
        frames, pending = 0, None
        while True:
            pending = pending or asyncio.ensure_future(stream.__anext__())
            try:
                chunk = await asyncio.wait_for(asyncio.shield(pending), 0.0001)
            except asyncio.TimeoutError:
                continue
            except StopAsyncIteration:
                break
            pending = None
            frames += chunk.frames
        return frames

    assert asyncio.run(main()) == 5
