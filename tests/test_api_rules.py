"""Rules of the public API object, its worker thread and residency that the other tests
leave open (found by mutation testing): each test pins one rule with exact values."""

from __future__ import annotations

import types
import warnings

import numpy as np
import pytest

import voxtral_mlx
import voxtral_mlx.tts as tts_module
from voxtral_mlx.errors import InputError, UsageError
from voxtral_mlx.residency import FIT_FRACTION, MemoryWarning, Residency
from voxtral_mlx.worker import Worker, WorkerFuture


class _FakeMetal:
    """The Metal queries residency makes, for a GPU keeping ``budget`` bytes resident."""

    def __init__(self, budget: int):
        self.budget = budget
        self.metal = type("Metal", (), {"is_available": staticmethod(lambda: True)})()

    def device_info(self) -> dict:
        return {"max_recommended_working_set_size": self.budget}


def test_a_model_just_under_the_whole_budget_is_warned_about():
    budget = 1_000_000_000
    near = Residency(int(FIT_FRACTION * budget) + 1, backend=_FakeMetal(budget))
    with pytest.warns(MemoryWarning, match="take 0.9 GB but .* keeps at most 1.0 GB resident"):
        near.check_fit()
    assert FIT_FRACTION == 0.9
    within = Residency(int(FIT_FRACTION * budget), backend=_FakeMetal(budget))
    with warnings.catch_warnings():
        warnings.simplefilter("error", MemoryWarning)
        within.check_fit()


def test_a_pump_that_raises_does_not_end_the_worker():
    worker = Worker("test-pump-raises")
    raised = []

    def pump() -> bool:
        if not raised:
            raised.append(True)
            raise RuntimeError("a frame failed outside its jobs")
        return False

    worker.pump = pump
    try:
        assert worker.call(lambda: 1) == 1  # the pump runs (and raises) after this task
        # The thread lives on (a generous timeout: a dead thread would never answer).
        assert worker.submit(lambda: 2).result(timeout=30) == 2
        assert raised == [True]
    finally:
        worker.close()


def test_a_failing_on_close_still_ends_the_worker():
    worker = Worker("test-on-close-raises")

    def on_close() -> None:
        raise RuntimeError("releasing the model failed")

    worker.on_close = on_close
    worker.close()
    assert not worker._thread.is_alive()  # close() did not have to give up after 10 s
    with pytest.raises(UsageError, match="this model was closed: load it again to use it"):
        worker.call(lambda: 1)


VOICE = "neutral_male"


def test_job_refuses_text_with_nothing_to_say(tiny_tts):
    with pytest.raises(InputError, match=r"^text is empty \(nothing but spaces"):
        tiny_tts.job(" \u200b\n", VOICE)


def _codes(tts, frames: int, semantic: int = 2, acoustic: int = 2) -> np.ndarray:
    codes = np.full((frames, tts.config.num_codebooks), acoustic, np.int32)
    codes[:, 0] = semantic
    return codes


@pytest.mark.parametrize("semantic", [0, 1])  # EMPTY and END are no audio
def test_decode_refuses_semantic_codes_below_two(tiny_tts, semantic):
    with pytest.raises(InputError, match=r"^codes out of range: semantic codes must lie in \[2, "):
        tiny_tts.decode(_codes(tiny_tts, 3, semantic=semantic))


def test_a_finished_worker_future_can_be_read_on_the_worker_thread():
    worker = Worker("test-worker-future")
    try:
        done, pending = WorkerFuture(worker), WorkerFuture(worker)
        done.set_result(1.5)
        assert worker.call(done.result) == 1.5
        assert worker.call(done.exception) is None
        with pytest.raises(UsageError, match="cannot be made on the model's worker thread"):
            worker.call(pending.result)  # would wait for ever: refused
    finally:
        worker.close()


def test_a_background_warmup_cancelled_before_it_starts_does_nothing(tiny_tts, monkeypatch):
    started, warmed = [], []

    class Thread:  # holds warmup's thread until the test runs it
        def __init__(self, target, name, daemon):
            self.target = target

        def start(self):
            started.append(self.target)

    monkeypatch.setattr(tts_module, "threading", types.SimpleNamespace(Thread=Thread))
    monkeypatch.setattr(tiny_tts, "_warm", lambda voices: warmed.append(voices) or 0.0)
    future = tiny_tts.warmup(VOICE, wait=False)
    assert future.cancel()
    started[0]()
    assert future.cancelled() and warmed == []


def test_warmup_warms_each_voice_once(tiny_tts, monkeypatch):
    warmed = []
    monkeypatch.setattr(tiny_tts, "_warm", lambda voices: warmed.append(voices) or 0.25)
    assert tiny_tts.warmup([VOICE, "ar_male", VOICE]).result() == 0.25
    assert warmed == [[VOICE, "ar_male"]]


def test_a_closed_model_refuses_streams_at_the_call(tiny_checkpoint_noend):
    model = voxtral_mlx.load(tiny_checkpoint_noend, prefix_cache_dir=None)
    model.close()
    closed = "^this model was closed: load it again to use it$"
    with pytest.raises(UsageError, match=closed):
        model.stream("Hi.", VOICE)
    with pytest.raises(UsageError, match=closed):
        model.astream("Hi. There.", VOICE, split=True)


def test_an_async_iterable_given_to_stream_is_told_to_use_astream(tiny_tts):
    async def pieces():
        yield "Hi."

    for call in (tiny_tts.stream, tiny_tts.synthesize):
        with pytest.raises(InputError, match=r"^text is an async iterable \(async_generator\)"):
            call(pieces(), VOICE, split=True)


def test_text_in_pieces_needs_split(tiny_tts):
    with pytest.raises(InputError, match=r"^text given in pieces .*: pass split=True$"):
        tiny_tts.stream(["Hi", " there."], VOICE)


def test_lookahead_of_65_is_one_too_many(tiny_tts):
    with pytest.raises(InputError, match=r"^lookahead must be at most 64 .*, got 65$"):
        tiny_tts.stream("One. Two.", VOICE, split=True, lookahead=65)
    tiny_tts.stream("One. Two.", VOICE, split=True, lookahead=64, max_frames=1).close()


def test_noise_cannot_be_split(tiny_tts):
    noise = np.zeros((4, tiny_tts.config.flow.n_acoustic_codebook), np.float32)
    with pytest.raises(InputError, match=r"^noise= gives one utterance's noise: it cannot"):
        tiny_tts.stream("One. Two.", VOICE, noise=noise, split=True)
