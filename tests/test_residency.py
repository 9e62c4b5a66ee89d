"""Weights kept resident on a Mac's GPU while requests run: the wired limit is raised at
the first job, restored when the engine is idle or the model closes, shared by models in
one process, and a model too large for the GPU's resident budget loads with a warning.
This machine has no Metal, so a fake ``mlx.core`` stands in for the Metal calls; the
engine, worker and loading code are the real ones."""

from __future__ import annotations

import threading
import types
import warnings

import pytest

import voxtral_mlx
from voxtral_mlx import residency
from voxtral_mlx.residency import MemoryWarning, Residency
from voxtral_mlx.synthetic.checkpoint import build_random_checkpoint

VOICE = "neutral_male"
BUDGET = 10_000_000_000


class FakeMetal:
    """The few ``mlx.core`` calls residency makes, recording the wired limit."""

    def __init__(self, available: bool = True, budget: int = BUDGET):
        self.limit = 123  # whatever the app had set before
        self.history: list[int] = []
        self.lock = threading.Lock()
        self.metal = types.SimpleNamespace(is_available=lambda: available)
        self.budget = budget

    def device_info(self) -> dict:
        return {"max_recommended_working_set_size": self.budget, "memory_size": 2 * self.budget}

    def set_wired_limit(self, limit: int) -> int:
        with self.lock:
            previous, self.limit = self.limit, limit
            self.history.append(limit)
            return previous

    def synchronize(self) -> None:
        pass


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_random_checkpoint(
        tmp_path_factory.mktemp("res"), "tiny", seed=4, dtype="float32", suppress_end=True
    )


@pytest.fixture
def fake(monkeypatch):
    metal = FakeMetal()
    monkeypatch.setattr(residency, "mx", metal)
    monkeypatch.setattr(residency, "_WIRING", residency._Wiring())
    return metal


def test_off_metal_nothing_is_touched():
    metal = FakeMetal(available=False)
    r = Residency(10**12, backend=metal)
    assert not r.active
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r.check_fit()
    r.acquire()
    r.release()
    assert metal.history == [] and metal.limit == 123


def test_limit_is_raised_while_generating_and_restored_when_idle(checkpoint, fake):
    tts = voxtral_mlx.load(checkpoint, prefix_cache_dir=None)
    try:
        assert fake.history == []  # loading alone pins nothing
        seen, frame = [], tts.model.frame

        def recording_frame(*args):  # the limit in force while each frame is computed
            seen.append(fake.limit)
            return frame(*args)

        tts.model.frame = recording_frame
        chunks = list(tts.stream("One. Two.", VOICE, seed=0, max_frames=4))
        assert sum(c.frames for c in chunks) == 4 and len(seen) >= 4
        assert set(seen) == {BUDGET}
        tts.worker.call(lambda: None)  # the engine has gone idle after the last chunk
        assert fake.limit == 123 and fake.history == [BUDGET, 123]

        # Concurrent requests: raised and restored in pairs (once if they overlap), never
        # restored while a frame runs.
        seen.clear()
        done = []
        threads = [
            threading.Thread(
                target=lambda i=i: done.append(
                    tts.synthesize("Hi there.", VOICE, seed=i, max_frames=4)
                )
            )
            for i in range(2)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        tts.worker.call(lambda: None)
        assert len(done) == 2 and set(seen) == {BUDGET}
        pairs = len(fake.history) // 2
        assert 2 <= pairs <= 3 and fake.history == [BUDGET, 123] * pairs
    finally:
        tts.close()


def test_closing_mid_request_restores_the_limit(checkpoint, fake):
    tts = voxtral_mlx.load(checkpoint, prefix_cache_dir=None)
    stream = tts.stream("A long sentence that keeps going.", VOICE, seed=1, max_frames=500)
    next(iter(stream))
    assert fake.limit == BUDGET
    tts.close()
    assert fake.limit == 123


def test_models_in_one_process_share_the_limit(fake):
    a, b = Residency(1, backend=fake), Residency(1, backend=fake)
    a.acquire()
    b.acquire()
    a.acquire()  # a holder counts once
    a.release()
    assert fake.limit == BUDGET  # b still generating
    b.release()
    b.release()
    assert fake.limit == 123 and fake.history == [BUDGET, 123]


def test_a_model_too_large_for_the_gpu_warns_once_at_load(checkpoint, monkeypatch):
    small = FakeMetal(budget=1000)  # the tiny model's weights are far above 900 bytes
    monkeypatch.setattr(residency, "mx", small)
    monkeypatch.setattr(residency, "_WIRING", residency._Wiring())
    with pytest.warns(MemoryWarning) as caught:
        tts = voxtral_mlx.load(checkpoint, prefix_cache_dir=None)
    tts.close()
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "\n" not in message and "0.0 GB resident" in message and "--q-bits 4" in message
    assert caught[0].filename == __file__  # attributed to the caller of load()

    roomy = FakeMetal(budget=10**12)
    monkeypatch.setattr(residency, "mx", roomy)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MemoryWarning)
        voxtral_mlx.load(checkpoint, prefix_cache_dir=None).close()


def test_a_refused_limit_disables_residency_with_one_warning(fake):
    def refuse(limit: int) -> int:
        raise RuntimeError(
            "[set_wired_limit] Setting a wired limit is only supported on macOS 15.0+"
        )

    fake.set_wired_limit = refuse
    r = Residency(1, backend=fake)
    with pytest.warns(MemoryWarning, match="not kept resident.*macOS 15") as caught:
        r.acquire()
    assert len(caught) == 1 and not r.active
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r.acquire()  # disabled: no second attempt, no second warning
        r.release()


def test_residency_problems_never_stop_generation(fake):
    def broken_info() -> dict:
        raise AttributeError("device_info")

    fake.device_info = broken_info
    with pytest.warns(MemoryWarning, match="no GPU memory budget"):
        r = Residency(1, backend=fake)
    assert not r.active

    fake.device_info = lambda: {"max_recommended_working_set_size": BUDGET}
    r = Residency(1, backend=fake)
    r.acquire()

    def refuse(limit: int) -> int:
        raise RuntimeError("busy")

    fake.set_wired_limit = refuse
    with pytest.warns(MemoryWarning, match="could not be restored: busy"):
        r.release()
    r.release()  # released once only


def test_a_failed_synchronize_still_puts_the_limit_back(fake):
    r = Residency(1, backend=fake)
    r.acquire()

    def broken() -> None:
        raise RuntimeError("command buffer failed")

    fake.synchronize = broken
    with pytest.warns(MemoryWarning) as caught:
        r.release()
    assert [str(w.message) for w in caught] == [
        "waiting for the GPU failed (the wired limit is restored anyway): command buffer failed"
    ]
    assert fake.limit == 123 and fake.history == [BUDGET, 123]


@pytest.mark.parametrize("where", ["acquire", "release"])
def test_warnings_raised_as_errors_do_not_stop_the_worker(checkpoint, fake, where):
    """Under ``-W error`` (or pytest's filterwarnings=error) the warning of a refused wired
    limit is an exception on the model's worker thread: it must not end that thread (every
    request would then wait forever)."""
    refusing = [BUDGET] if where == "acquire" else [123]

    def set_wired_limit(limit: int) -> int:
        if limit in refusing:
            raise RuntimeError("refused")
        previous, fake.limit = fake.limit, limit
        return previous

    fake.set_wired_limit = set_wired_limit
    tts = voxtral_mlx.load(checkpoint, prefix_cache_dir=None)
    frames = []

    def requests() -> None:
        for seed in range(2):  # the second request finds the worker serving
            frames.append(len(tts.synthesize("Hi there.", VOICE, seed=seed, max_frames=3).codes))
            tts.worker.call(lambda: None)  # idle again: release has run

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            caller = threading.Thread(target=requests, daemon=True)  # a dead worker hangs it
            caller.start()
            caller.join(60)
        assert frames == [3, 3] and tts.worker._thread.is_alive()
    finally:
        tts.close()
