"""warmup(): the first requests find the weights read, the frame compiled for every batch
size and their voices' prefixes prefilled, and get exactly the output they would have got."""

from __future__ import annotations

import time

import numpy as np
import pytest

import voxtral_mlx
from voxtral_mlx.engine import PREFIX_PART_TOKENS
from voxtral_mlx.errors import InputError, VoiceError
from voxtral_mlx.generate import FrameBatch
from voxtral_mlx.tts import WARMUP_TEXT

TEXT = "A first request, right after the app starts."


@pytest.fixture
def fresh(tiny_checkpoint_noend):
    models = []

    def make(**kwargs):
        kwargs.setdefault("prefix_cache_dir", None)
        models.append(voxtral_mlx.load(tiny_checkpoint_noend, **kwargs))
        return models[-1]

    yield make
    for m in models:
        m.close()


def _speak(tts, voice: str, seed: int):
    chunks = list(tts.stream(TEXT, voice, seed=seed, max_frames=5, chunk_frames=2))
    codes = np.concatenate([c.codes for c in chunks])
    audio = np.concatenate([c.audio for c in chunks])
    return codes, audio, chunks[0].timings


def test_output_after_warmup_equals_a_cold_start(fresh):
    cold_codes, cold_audio, cold_t = _speak(fresh(), "neutral_male", 11)
    assert not cold_t.prefix_cached

    warm = fresh()
    assert warm.warmup(["neutral_male", "fr_female"]).result() > 0
    codes, audio, t = _speak(warm, "neutral_male", 11)
    assert t.prefix_cached  # its prefix was prefilled by warmup()
    np.testing.assert_array_equal(codes, cold_codes)
    np.testing.assert_array_equal(audio, cold_audio)
    _, _, t2 = _speak(warm, "fr_female", 12)
    assert t2.prefix_cached


@pytest.fixture
def batch_sizes(monkeypatch) -> list[int]:
    """The size of every batch a frame is computed for, as they come."""
    sizes: list[int] = []
    original = FrameBatch._frame

    def spy(self, h, rows):
        sizes.append(len(rows))
        return original(self, h, rows)

    monkeypatch.setattr(FrameBatch, "_frame", spy)
    return sizes


def test_every_batch_size_is_run(fresh, batch_sizes):
    sizes = batch_sizes
    tts = fresh(max_batch=3)
    tts.warmup()
    assert set(sizes) == {1, 2, 3}
    assert sizes[0] == 1


def test_every_batch_size_is_run_when_the_model_says_end_at_once(tiny_checkpoint, batch_sizes):
    sizes = batch_sizes
    tts = voxtral_mlx.load(tiny_checkpoint, max_batch=8, prefix_cache_dir=None)
    try:
        # Warm-up job i (seed i) joins at frame i: here some end (END) before the eighth
        # has joined.
        frames = [
            sum(c.frames for c in tts.stream(WARMUP_TEXT, seed=i, max_frames=9)) for i in range(8)
        ]
        assert any(n < 8 - i for i, n in enumerate(frames))
        sizes.clear()
        tts.warmup()
    finally:
        tts.close()
    assert set(sizes) == set(range(1, 9))


def test_background_warmup_serves_requests_meanwhile(fresh):
    reference = _speak(fresh(), "ar_male", 5)[0]
    tts = fresh()
    future = tts.warmup("ar_male", wait=False)
    codes = _speak(tts, "ar_male", 5)[0]  # issued while warming up
    assert future.result(timeout=120) > 0
    np.testing.assert_array_equal(codes, reference)


def test_a_request_during_warmup_goes_first(fresh):
    """Warmup's jobs are nobody's audio: a request made meanwhile is admitted before them
    (it waited one frame step per warmup job: 14 steps with 8 voices, most of the warmup).
    It takes a step per part of its voice's prefix, one for its text and one for its frame."""
    tts = fresh()
    steps = [0]
    pump = tts.worker.pump

    def counting_pump():
        steps[0] += 1
        return pump()

    tts.worker.pump = counting_pump
    voices = sorted(tts.voices)[:8]
    future = tts.warmup(voices, wait=False)
    deadline = time.monotonic() + 60
    while tts.engine.stats()["active"] == 0 and time.monotonic() < deadline:
        time.sleep(0.0005)  # warmup's first job is in the batch
    assert not future.done()
    prefix = len(tts.prompt_ids("", voices[-1])) - 2  # the prompt without its last two ids
    prefix_parts = -(-prefix // PREFIX_PART_TOKENS)
    with tts.stream(TEXT, voices[-1], seed=5, max_frames=3) as stream:
        before = steps[0]
        first = next(iter(stream))
        taken = steps[0] - before
        assert first.frames and taken <= prefix_parts + 2, (taken, prefix_parts)
        assert not future.done()  # its later voices' prefills still wait
        rest = list(stream)
    assert future.result(timeout=120) > 0
    codes = np.concatenate([c.codes for c in [first, *rest]])
    alone = fresh().synthesize(TEXT, voices[-1], seed=5, max_frames=3).codes
    np.testing.assert_array_equal(codes, alone)


def test_requests_keeping_the_batch_full_do_not_hold_warmup_back_for_ever(fresh, monkeypatch):
    """Requests go first, but only for WARMUP_YIELDS_S: under a load that kept the batch
    full, a background warmup was still pending when the load stopped (17 minutes in an
    app-like run)."""
    import threading

    import voxtral_mlx.tts as tts_module

    monkeypatch.setattr(tts_module, "WARMUP_YIELDS_S", 0.3)
    tts = fresh(max_batch=1)
    tts.warmup()  # compiled: the load below is steady from the start
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            tts.synthesize(TEXT, "neutral_male", seed=1, max_frames=20)

    threads = [threading.Thread(target=load) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.3)
        future = tts.warmup(["fr_female", "ar_male"], wait=False)
        seconds = future.result(timeout=60)  # forever, before
        assert not stop.is_set() and all(t.is_alive() for t in threads)
        assert 0.3 <= seconds < 30
    finally:
        stop.set()
        for t in threads:
            t.join()


def test_prefixes_are_kept_on_disk(fresh, tmp_path):
    tts = fresh(prefix_cache_dir=tmp_path)
    tts.warmup(["neutral_male", "ar_male"])
    assert len(list(tmp_path.glob("*.safetensors"))) == 2
    again = fresh(prefix_cache_dir=tmp_path)
    assert _speak(again, "ar_male", 1)[2].prefix_from_disk


def test_bad_voices_are_reported_before_anything_runs(fresh):
    tts = fresh()
    with pytest.raises(VoiceError, match="no_such_voice"):
        tts.warmup(["neutral_male", "no_such_voice"])
    with pytest.raises(InputError, match="no voices"):
        tts.warmup([])
    assert not tts.engine.busy and not tts.engine._prefixes


class _FakeStream:
    latency = 0.05

    def __init__(self, sd, **kwargs):
        self.sd, self.kwargs = sd, kwargs

    def close(self):
        self.sd.closed += 1


class _FakeSounddevice:
    """What prepare_output() asks of sounddevice: the devices, the default output, and a
    stream opened and closed without playing."""

    PortAudioError = OSError

    def __init__(self, outputs: int):
        self.queries = self.opened = self.closed = 0
        self.devices = [{"name": f"out {i}", "max_output_channels": 2} for i in range(outputs)]

    def OutputStream(self, **kwargs):
        self.opened += 1
        return _FakeStream(self, **kwargs)

    def query_devices(self, device=None, kind=None):
        self.queries += 1
        listing = [dict(d, index=i) for i, d in enumerate(self.devices)]
        if kind == "output":
            if not listing:
                raise OSError("Error querying device -1")
            return listing[0]
        return listing


def test_warmup_can_start_the_audio_output(fresh, monkeypatch):
    """playback=True starts PortAudio and finds the output device during the warm-up (the
    first say() did it before returning); without an output device the future holds that
    one-line error, and the voices are warmed up all the same."""
    import voxtral_mlx.audio.player as player

    sd = _FakeSounddevice(outputs=2)
    monkeypatch.setattr(player, "import_sounddevice", lambda: sd)
    tts = fresh()
    assert tts.warmup("ar_male").result() > 0 and sd.queries == sd.opened == 0  # not asked
    assert tts.warmup("ar_male", wait=False, playback=True).result(timeout=120) > 0
    assert sd.queries > 0 and sd.opened == sd.closed == 1

    monkeypatch.setattr(player, "import_sounddevice", lambda: _FakeSounddevice(outputs=0))
    with pytest.raises(voxtral_mlx.VoxtralError, match="no audio output device") as e:
        tts.warmup("fr_female", playback=True)
    assert "\n" not in str(e.value)
    t = _speak(tts, "fr_female", 1)[2]
    assert t.prefix_cached  # warmed up before the audio error was raised
    with pytest.raises(InputError, match="playback must be True or False"):
        tts.warmup(playback="yes")
