"""Property-based tests for voxtral_mlx.audio.player.AudioPlayer and voxtral_mlx.playback.

A fake sounddevice whose callback the test drives on a virtual clock (lock-step: the
main thread runs the device, feed() runs inline or, when it would block at max_buffer_s,
in a helper thread while the device drains). Every sample handed to the device is kept,
and which samples of each block came from the player's buffer (``_pop_into``) is
recorded, so the checks are exact:

* the device output is the produced audio in order with only zero runs inserted
  (no sample dropped, duplicated or reordered), a prefix of it after stop()/failure;
* underrun counts/seconds equal the inserted silence between real samples that the
  rules say counts (not while feed(more_coming=False) said the input waits);
* device_xruns equals the number of callbacks flagged output_underflow;
* after stop() nothing more reaches the device; stop()/finish()/blocked feed() return
  promptly; helper threads always end (stacks dumped on a hang).

VOXTRAL_MLX_PLAYER_EXAMPLES sets the examples per property (more search deeper).
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from test_player import FakeClock, FakePortAudioError

from voxtral_mlx.audio import player as player_module
from voxtral_mlx.audio.player import AudioPlayer

SR = 24000
HANG_S = 20.0  # wall seconds any single blocking step may take before it is a hang

SETTINGS = settings(
    derandomize=True,
    deadline=None,
    max_examples=int(os.environ.get("VOXTRAL_MLX_PLAYER_EXAMPLES", "60")),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)


def dump_stacks_and_fail(what: str) -> None:
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    pytest.fail(f"hang: {what} (thread stacks dumped to stderr)")


# -- fake sounddevice -----------------------------------------------------------------


class FakeCallbackAbort(Exception):
    pass


class Stream:
    """Unlike test_player's FakeStream, abort(), stop() and close() wait for a callback
    the simulation is running (its ``lock``), as PortAudio's do: stop() from another
    thread is tested against that."""

    def __init__(self, sd: SD, **kw: Any) -> None:
        self.sd, self.kw = sd, kw
        self.callback = kw["callback"]
        self.finished_callback = kw["finished_callback"]
        self.blocksize = kw["blocksize"]
        self.channels = kw["channels"]
        self.latency = sd.latency
        self.active = self.closed = False
        self.calls: list[str] = []
        self.lock = threading.Lock()

    def start(self) -> None:
        assert not self.closed, "start() on a closed stream"
        self.calls.append("start")
        self.active = True

    def abort(self) -> None:
        self.calls.append("abort")
        with self.lock:  # as PortAudio: returns once no callback is running
            self.active = False

    def stop(self) -> None:
        self.calls.append("stop")
        with self.lock:
            self.active = False

    def close(self) -> None:
        self.calls.append("close")
        with self.lock:
            self.active = False
            self.closed = True


class SD:
    PortAudioError = FakePortAudioError
    CallbackAbort = FakeCallbackAbort

    def __init__(self, latency: float = 0.02) -> None:
        self.latency = latency
        self.streams: list[Stream] = []

    def query_devices(self, device: Any = None, kind: str | None = None) -> Any:
        d = {
            "name": "Fake",
            "index": 0,
            "hostapi": 0,
            "max_output_channels": 2,
            "max_input_channels": 0,
            "default_samplerate": 24000.0,
        }
        return d if (device is not None or kind == "output") else [d]

    def query_hostapis(self, index: int) -> dict:
        return {"name": self.hostapi}

    hostapi = "ALSA"

    def OutputStream(self, **kw: Any) -> Stream:
        s = Stream(self, **kw)
        self.streams.append(s)
        return s


# -- the lock-step simulation ---------------------------------------------------------


@dataclass
class Block:
    data: np.ndarray  # mono
    real: int  # leading samples taken from the player's buffer
    more_coming: bool | None  # the player's _more_coming at the callback
    xrun: bool
    after_stop: bool


@dataclass
class Sim:
    blocksize: int = 1920
    frames_cycle: tuple[int, ...] = ()  # frames per callback, cycled (() = blocksize)
    xrun_cycle: tuple[bool, ...] = (False,)
    max_buffer_s: float = 60.0
    min_preroll_s: float = 0.16
    channels_core_audio: bool = False
    stop_at_pump: int | None = None  # stop() from another thread at this callback
    blocks: list[Block] = field(default_factory=list)
    produced: list[np.ndarray] = field(default_factory=list)
    counter: int = 0

    def __post_init__(self) -> None:
        self.clock = FakeClock(1000.0)
        self.sd = SD()
        if self.channels_core_audio:
            self.sd.hostapi = "Core Audio"  # 2 channels, both carrying the signal
        self.p = AudioPlayer(
            SR,
            sd=self.sd,
            clock=self.clock,
            blocksize=self.blocksize,
            min_preroll_s=self.min_preroll_s,
            max_buffer_s=self.max_buffer_s,
        )
        self.stream = self.sd.streams[0]
        self.limit = round(self.p.max_buffer_s * SR)
        self.next_due: float | None = None
        self.pumps = 0
        self.stop_thread: threading.Thread | None = None
        self.stop_elapsed: float | None = None
        self.stopped_at_block: int | None = None
        self.real_n = 0
        self.refilled = False
        self.blocked_feeds = 0
        orig = self.p._pop_into

        def pop_into(out: np.ndarray, frames: int) -> int:
            n = orig(out, frames)
            self.real_n += n
            return n

        self.p._pop_into = pop_into  # type: ignore[method-assign]

    # producer side

    def make_audio(self, size: int, pause: bool) -> np.ndarray:
        if pause:
            a = np.zeros(size, np.float32)
        else:  # distinct, exactly representable, nonzero values
            a = (np.arange(self.counter, self.counter + size, dtype=np.float64) + 1) / 2**24
            a = a.astype(np.float32)
            self.counter += size
        return a

    def feed(self, a: np.ndarray, **kw: Any) -> None:
        """feed() as a generator would: it may block at max_buffer_s while the device plays."""
        self.produced.append(a)
        if not (self.p._buffered + a.size > self.limit):
            self.p.feed(a, **kw)  # cannot block
            return
        done = threading.Event()
        err: list[BaseException] = []

        def run() -> None:
            try:
                self.p.feed(a, **kw)
            except BaseException as e:
                err.append(e)
            finally:
                done.set()

        self.blocked_feeds += 1
        th = threading.Thread(target=run, daemon=True, name="sim-feed")
        th.start()
        deadline = time.monotonic() + HANG_S
        while not done.wait(0.0005):
            if self.blocked():
                self.pump_next()
            if time.monotonic() > deadline:
                dump_stacks_and_fail("feed() never returned")
        th.join(HANG_S)
        if err:
            raise err[0]

    def blocked(self) -> bool:
        p = self.p
        return (
            p._started
            and self.stream.active
            and p._buffered > self.limit
            and not p._stopped.is_set()
        )

    # device side

    def frames_for(self, i: int) -> int:
        return (
            self.frames_cycle[i % len(self.frames_cycle)] if self.frames_cycle else self.blocksize
        )

    def pump_next(self) -> bool:
        """Advance the clock to the next callback and run it; False if the stream is idle."""
        if not self.stream.active:
            self.next_due = None
            return False
        if self.next_due is None:
            self.next_due = self.clock.t
        self.clock.t = max(self.clock.t, self.next_due)
        frames = self.frames_for(self.pumps)
        self.pump(frames)
        self.next_due += frames / SR
        return True

    def pump(self, frames: int) -> None:
        i = self.pumps
        self.pumps += 1
        if self.stop_at_pump is not None and i == self.stop_at_pump and self.stop_thread is None:
            self.start_stop_thread()
        with self.stream.lock:
            if not self.stream.active:
                return
            xrun = self.xrun_cycle[i % len(self.xrun_cycle)]
            status = SimpleNamespace(output_underflow=xrun, output_overflow=False)
            out = np.full((frames, self.stream.channels), np.nan, np.float32)
            mc = self.p._more_coming
            self.refilled |= bool(self.p._refilling and self.p._buffered)
            after_stop = self.p._stopped.is_set()
            self.real_n = 0
            ti = SimpleNamespace(currentTime=self.clock.t, outputBufferDacTime=self.clock.t + 0.01)
            try:
                self.stream.callback(out, frames, ti, status)
            except FakeCallbackAbort:
                self.stream.active = False
            assert not np.isnan(out).any(), "callback left part of the block unwritten"
            assert (out == out[:, :1]).all(), "channels differ"
            self.blocks.append(Block(out[:, 0].copy(), self.real_n, mc, xrun, after_stop))

    def advance(self, dt: float) -> None:
        """Let dt seconds of virtual time pass, the device taking blocks when due."""
        end = self.clock.t + dt
        while self.stream.active:
            if self.next_due is None:
                self.next_due = self.clock.t
            if self.next_due > end:
                break
            self.pump_next()
        self.clock.t = max(self.clock.t, end)
        if not self.stream.active:
            self.next_due = None

    def start_stop_thread(self) -> None:
        def run() -> None:
            t0 = time.monotonic()
            self.p.stop()
            self.stop_elapsed = time.monotonic() - t0

        self.stopped_at_block = len(self.blocks)
        self.stop_thread = threading.Thread(target=run, daemon=True, name="sim-stop")
        self.stop_thread.start()

    def finish(self) -> BaseException | None:
        """finish() in a thread while the device plays on; returns its error, if any."""
        done = threading.Event()
        err: list[BaseException] = []

        def run() -> None:
            try:
                self.p.finish()
            except BaseException as e:
                err.append(e)
            finally:
                done.set()

        th = threading.Thread(target=run, daemon=True, name="sim-finish")
        th.start()
        deadline = time.monotonic() + HANG_S
        # Wait for finish() to mark the end before playing on (deterministic accounting).
        while not (self.p._eof or done.is_set() or self.p._stopped.is_set()):
            time.sleep(0.0005)
            if time.monotonic() > deadline:
                dump_stacks_and_fail("finish() never marked the end")
        while not done.wait(0.0005):
            if not self.pump_next():
                time.sleep(0.001)
            if time.monotonic() > deadline:
                dump_stacks_and_fail("finish() never returned")
        th.join(HANG_S)
        return err[0] if err else None

    def join_stop(self) -> None:
        if self.stop_thread is not None:
            self.stop_thread.join(HANG_S)
            if self.stop_thread.is_alive():
                dump_stacks_and_fail("stop() never returned")

    # checks

    def device_audio(self) -> np.ndarray:
        return (
            np.concatenate([b.data for b in self.blocks])
            if self.blocks
            else np.zeros(0, np.float32)
        )

    def expected_audio(self) -> np.ndarray:
        return np.concatenate(self.produced) if self.produced else np.zeros(0, np.float32)

    def check_output(self, complete: bool) -> None:
        exp, blocks = self.expected_audio(), self.blocks
        # 1. black box: the device output is the produced audio, zero runs inserted
        # (produced audio samples are distinct and nonzero; pauses are zeros).
        dev = self.device_audio()
        pd, pe = np.flatnonzero(dev), np.flatnonzero(exp)
        assert pd.size <= pe.size, "more audio samples on the device than produced"
        k = pd.size
        assert np.array_equal(dev[pd], exp[pe[:k]]), "audio dropped, duplicated or reordered"
        if k:
            assert pd[0] >= pe[0], "leading pause shortened"
            assert (np.diff(pd) >= np.diff(pe[:k])).all(), "a pause between samples was shortened"
        if complete:
            assert k == pe.size, f"only {k} of {pe.size} produced audio samples reached the device"
            tail_exp = exp.size - (pe[-1] + 1 if pe.size else 0)
            tail_dev = dev.size - (pd[-1] + 1 if pd.size else 0)
            assert tail_dev >= tail_exp, "trailing pause shortened"
        # 2. with what _pop_into handed out: the real samples are exactly a prefix.
        real = np.concatenate([b.data[: b.real] for b in blocks]) if blocks else exp[:0]
        assert real.size <= exp.size
        assert np.array_equal(real, exp[: real.size]), "real samples differ from produced"
        for b in blocks:
            assert not b.data[b.real :].any(), "nonzero sample outside what _pop_into gave"
        if complete:
            assert real.size == exp.size
        assert self.p._played == real.size
        assert self.p.stats.played_s == pytest.approx(real.size / SR, abs=1e-9)

    def check_stats(self, exact: bool = True) -> None:
        """Underruns as the rules define them, computed from the device timeline."""
        underruns, gap, gap_total = 0, 0, 0
        for b in self.blocks:
            if b.after_stop:
                break
            if b.real and gap:
                underruns += 1
                gap_total += gap
                gap = 0
            silent = b.data.size - b.real
            if silent and b.more_coming is not False:
                gap += silent
        st_ = self.p.stats
        if currently_in_test_context():  # coverage, seen with --hypothesis-show-statistics
            event(f"underruns={min(underruns, 3)}")
            event(f"refilled={self.refilled}")
            event(f"blocked feed={self.blocked_feeds > 0}")
        if exact:
            assert st_.underruns == underruns, (st_.underruns, underruns)
            assert st_.underrun_s == pytest.approx(gap_total / SR, abs=1e-9)
        xruns = sum(b.xrun for b in self.blocks)
        assert st_.device_xruns == xruns, (st_.device_xruns, xruns)


# -- strategies -----------------------------------------------------------------------

sizes = st.one_of(
    st.integers(1, 64),  # tiny, down to one sample
    st.integers(64, 4000),
    st.integers(4000, 3 * SR),  # up to several seconds
    st.just(0),
)
delays = st.one_of(
    st.just(0.0),
    st.floats(0.0, 0.2),  # faster and slower than real time
    st.floats(0.2, 1.0),
    st.floats(3.0, 6.0),  # stalls longer than a refill's buffer
)


@st.composite
def chunk_events(draw, max_chunks: int = 14):
    n = draw(st.integers(0, max_chunks))
    policy = draw(st.sampled_from(["none", "true", "false", "mixed"]))
    total_mode = draw(st.sampled_from(["none", "exact", "short", "long"]))
    evs = []
    for _ in range(n):
        size = draw(sizes)
        pause = draw(st.booleans()) if draw(st.integers(0, 4)) == 0 else False
        delay = draw(delays)
        mc = {"none": None, "true": True, "false": False}.get(policy)
        if policy == "mixed":
            mc = draw(st.sampled_from([None, True, False]))
        evs.append((size, pause, delay, mc))
    # keep examples bounded: at most ~25 s of audio
    total = 0
    kept = []
    for e in evs:
        if total + e[0] > 25 * SR:
            break
        total += e[0]
        kept.append(e)
    return kept, total_mode


def total_for(mode: str, total_samples: int) -> float | None:
    s = total_samples / SR
    return {"none": None, "exact": s, "short": s / 3, "long": s * 2 + 1}[mode]


device_cfg = st.fixed_dictionaries(
    {
        "blocksize": st.one_of(st.just(1920), st.integers(256, 6000)),
        "frames_cycle": st.one_of(
            st.just(()), st.lists(st.integers(100, 5000), min_size=1, max_size=4).map(tuple)
        ),
        "xrun_cycle": st.lists(st.booleans(), min_size=1, max_size=5).map(tuple),
        "max_buffer_s": st.sampled_from([60.0, 3.0, 0.5]),
        "min_preroll_s": st.sampled_from([0.16, 0.0, 0.5]),
        "channels_core_audio": st.booleans(),
    }
)


@pytest.fixture(autouse=True)
def fast_poll(monkeypatch):
    # The blocking waits poll every 20 ms of wall time; faster polls keep the lock-step
    # simulation quick without changing what happens (the virtual clock drives timing).
    monkeypatch.setattr(player_module, "_POLL_S", 0.001)


def run_stream(sim: Sim, events, total_mode: str) -> None:
    total_samples = sum(e[0] for e in events)
    total = total_for(total_mode, total_samples)
    for size, pause, delay, mc in events:
        sim.advance(delay)
        sim.feed(sim.make_audio(size, pause), expected_total_s=total, more_coming=mc)


# -- properties -------------------------------------------------------------------------


@SETTINGS
@given(ev=chunk_events(), dev=device_cfg)
def test_finished_stream_plays_every_sample_in_order(ev, dev):
    events, total_mode = ev
    sim = Sim(**dev)
    run_stream(sim, events, total_mode)
    err = sim.finish()
    assert err is None, repr(err)
    assert sim.stream.closed and not sim.stream.active
    sim.check_output(complete=True)
    sim.check_stats()
    # after finish() no callback may hand out audio
    assert not sim.pump_next()
    if sim.expected_audio().size == 0:
        assert "start" not in sim.stream.calls  # an empty stream never opens the device


@SETTINGS
@given(
    ev=chunk_events(),
    dev=device_cfg,
    stop_frac=st.floats(0, 1),
    during=st.sampled_from(["stream", "finish"]),
)
def test_stop_from_another_thread_cuts_cleanly(ev, dev, stop_frac, during):
    events, total_mode = ev
    sim = Sim(**dev)
    # estimate the callbacks the whole run takes to place the stop inside it
    n_audio = sum(e[0] for e in events)
    approx = int(
        n_audio / max(1, dev["blocksize"]) + sum(e[2] for e in events) * SR / dev["blocksize"]
    )
    sim.stop_at_pump = int(stop_frac * max(1, approx))
    if during == "stream":
        run_stream(sim, events, total_mode)
        if sim.stop_thread is None:  # the stop falls after the last feed
            sim.start_stop_thread()
        sim.join_stop()
        err = sim.finish()
    else:
        sim.stop_at_pump = None
        run_stream(sim, events, total_mode)
        sim.stop_at_pump = sim.pumps + int(stop_frac * 10)
        err = sim.finish()
        if sim.stop_thread is None:
            sim.start_stop_thread()
        sim.join_stop()
    assert err is None, repr(err)
    assert sim.stop_elapsed is not None and sim.stop_elapsed < 1.5, sim.stop_elapsed
    cut = len(sim.blocks)
    # nothing more reaches the device: callbacks now play silence or do not run
    for _ in range(5):
        sim.pump(sim.blocksize)
    assert not any(b.real for b in sim.blocks[cut:]), "audio after stop()"
    assert all(not b.data.any() for b in sim.blocks if b.after_stop), (
        "audio in a callback after stop"
    )
    assert sim.p.buffered_s == 0 and sim.p.closed
    assert sim.stream.closed
    sim.check_output(complete=False)
    sim.check_stats()
    # feeding after stop is a no-op, finish() returns at once
    sim.p.feed(np.ones(100, np.float32))
    t0 = time.monotonic()
    sim.p.finish()
    assert time.monotonic() - t0 < 0.5 and sim.p.buffered_s == 0


@SETTINGS
@given(ev=chunk_events(), dev=device_cfg, fail_at=st.integers(0, 14))
def test_producer_error_in_a_with_block_stops_and_propagates(ev, dev, fail_at):
    events, total_mode = ev

    class ProducerError(Exception):
        pass

    sim = Sim(**dev)
    with pytest.raises(ProducerError), sim.p:
        run_stream(sim, events[:fail_at], total_mode)
        raise ProducerError("generation failed")
    assert sim.stream.closed and sim.p.buffered_s == 0
    before = len(sim.blocks)
    sim.pump(sim.blocksize)
    assert not any(b.real for b in sim.blocks[before:])
    sim.check_output(complete=False)
    sim.check_stats()


# -- boundaries ---------------------------------------------------------------------------


def test_empty_stream_and_empty_chunks_never_open_playback():
    sim = Sim()
    for _ in range(3):
        sim.feed(np.zeros(0, np.float32), expected_total_s=0.0, more_coming=True)
    assert sim.finish() is None
    assert sim.stream.calls == ["close"] and sim.blocks == []


@pytest.mark.parametrize("blocksize", [1, 7, 1920])
def test_a_single_one_sample_chunk_is_played(blocksize):
    sim = Sim(blocksize=blocksize)
    sim.feed(sim.make_audio(1, False))
    assert sim.finish() is None
    sim.check_output(complete=True)
    sim.check_stats()
    assert sim.p.stats.underruns == 0


def test_only_pause_chunks_play_as_silence():
    sim = Sim()
    for _ in range(4):
        sim.feed(sim.make_audio(SR // 2, True), more_coming=True)
        sim.advance(0.1)
    assert sim.finish() is None
    sim.check_output(complete=True)
    sim.check_stats()
    assert sim.p.stats.played_s == pytest.approx(2.0)


def test_one_huge_chunk_over_max_buffer():
    sim = Sim(max_buffer_s=1.0)
    sim.feed(sim.make_audio(SR, False))
    sim.feed(sim.make_audio(30 * SR, False))  # 30 s at once: feed() blocks until drained
    assert sim.p.buffered_s <= 1.0 + 1e-9
    assert sim.finish() is None
    sim.check_output(complete=True)
    sim.check_stats()
    assert sim.p.stats.underruns == 0


@SETTINGS
@given(
    chunk=st.integers(200, 3000),
    speed=st.floats(0.3, 3.0),
    n=st.integers(5, 60),
    blocksize=st.sampled_from([480, 960, 1920]),
)
def test_steady_generation_with_exact_total_never_underruns(chunk, speed, n, blocksize):
    """Pre-roll: a steady arrival rate and the true total: playback never runs dry."""
    sim = Sim(blocksize=blocksize)
    total = n * chunk / SR
    for i in range(n):
        if i:
            sim.advance(chunk / SR / speed)
        sim.feed(sim.make_audio(chunk, False), expected_total_s=total, more_coming=True)
    assert sim.finish() is None
    sim.check_output(complete=True)
    sim.check_stats()
    assert sim.p.stats.underruns == 0, (sim.p.stats, chunk, speed, n)


# -- a stateful model ---------------------------------------------------------------------


class PlayerMachine(RuleBasedStateMachine):
    """Random interleavings of feeds, device time passing, xrun flags, stop and finish."""

    def __init__(self) -> None:
        super().__init__()
        player_module._POLL_S = 0.001
        self.sim: Sim | None = None
        self.ended = False
        self.stopped = False

    @initialize(dev=device_cfg)
    def open_device(self, dev):
        self.sim = Sim(**dev)

    @precondition(lambda self: not self.ended)
    @rule(
        size=sizes,
        pause=st.booleans(),
        mc=st.sampled_from([None, True, False]),
        total=st.one_of(st.none(), st.floats(0.0, 20.0)),
    )
    def feed(self, size, pause, mc, total):
        self.sim.feed(self.sim.make_audio(size, pause), expected_total_s=total, more_coming=mc)

    @rule(dt=delays)
    def time_passes(self, dt):
        before = len(self.sim.blocks)
        self.sim.advance(dt)
        if self.ended:
            assert not any(b.real for b in self.sim.blocks[before:])

    @precondition(lambda self: not self.ended)
    @rule(go=st.integers(0, 5))
    def stop(self, go):
        if go:  # rarely: let the stream run first
            return
        self.sim.start_stop_thread()
        self.sim.join_stop()
        assert self.sim.stop_elapsed < 1.5
        self.ended = self.stopped = True

    @precondition(lambda self: not self.ended)
    @rule(go=st.integers(0, 5))
    def finish(self, go):
        if go:
            return
        assert self.sim.finish() is None
        self.ended = True

    @precondition(lambda self: self.ended)
    @rule(size=st.integers(0, 100))
    def after_the_end(self, size):
        """Feeding after stop() is a no-op; after finish() an error; no callback plays audio."""
        before = len(self.sim.blocks)
        if self.stopped:
            self.sim.p.feed(np.ones(size, np.float32))
        else:
            with pytest.raises(RuntimeError):
                self.sim.p.feed(np.ones(size, np.float32))
        self.sim.pump(self.sim.blocksize)
        assert not any(b.real for b in self.sim.blocks[before:])
        assert self.sim.p.buffered_s == 0 and self.sim.stream.closed

    @invariant()
    def output_is_the_produced_audio(self):
        if self.sim is None:
            return
        self.sim.check_output(complete=self.ended and not self.stopped)
        self.sim.check_stats()
        assert self.sim.p.buffered_s >= 0

    def teardown(self):
        if self.sim is not None:
            self.sim.p.stop()
        player_module._POLL_S = 0.02


TestPlayerMachine = PlayerMachine.TestCase
TestPlayerMachine.settings = settings(
    derandomize=True,
    deadline=None,
    max_examples=int(os.environ.get("VOXTRAL_MLX_PLAYER_EXAMPLES", "40")),
    stateful_step_count=25,
    suppress_health_check=[HealthCheck.too_slow],
    database=None,
)


# -- Playback: a producer thread, errors, wait() with timeouts, stop() ------------------


class ScriptStream:
    """A TextStream stand-in yielding scripted chunks; raises ``error`` at ``fail_at``."""

    text_error = None
    sample_rate = 24000

    def __init__(self, chunks, delays, fail_at, error):
        self.chunks, self.delays, self.fail_at, self.error = chunks, delays, fail_at, error
        self.cancelled = threading.Event()

    def prepare(self):
        pass

    def set_chunk_frames(self, n):
        pass

    def cancel(self):
        self.cancelled.set()

    def __iter__(self):
        for i, (a, d) in enumerate(zip(self.chunks, self.delays)):
            if i == self.fail_at:
                raise self.error
            if self.cancelled.wait(d):
                return
            yield SimpleNamespace(audio=a, frames=1, segment=0)
        if self.fail_at is not None and self.fail_at >= len(self.chunks):
            raise self.error


class AutoStream(Stream):
    """A device calling back on its own thread, on the real clock, 20x faster than real time."""

    def start(self) -> None:
        super().start()
        threading.Thread(target=self._run, daemon=True, name="fake-device").start()

    def _run(self) -> None:
        n = 0
        while True:
            with self.lock:
                if not self.active:
                    return
                out = np.full((self.blocksize, self.channels), np.nan, np.float32)
                now = time.monotonic()
                status = SimpleNamespace(output_underflow=(n % 4 == 3))
                self.callback(
                    out,
                    self.blocksize,
                    SimpleNamespace(currentTime=now, outputBufferDacTime=now + 0.001),
                    status,
                )
                assert not np.isnan(out).any()
                self.sd.received.append(out[:, 0].copy())
                n += 1
            time.sleep(self.blocksize / SR / 20)


class AutoSD(SD):
    def __init__(self):
        super().__init__(latency=0.005)
        self.received: list[np.ndarray] = []

    def OutputStream(self, **kw):
        s = AutoStream(self, **kw)
        self.streams.append(s)
        return s


@settings(derandomize=True, deadline=None, max_examples=25, database=None)
@given(
    sizes_=st.lists(st.one_of(st.integers(1, 500), st.integers(500, 20000)), max_size=10),
    delays_=st.lists(st.floats(0, 0.02), min_size=10, max_size=10),
    fail_at=st.one_of(st.none(), st.integers(0, 11)),
    stop_after=st.one_of(st.none(), st.floats(0, 0.1)),
    timeout=st.sampled_from([0.0, 0.01, 0.05]),
)
def test_playback_thread_reports_errors_and_always_ends(
    sizes_, delays_, fail_at, stop_after, timeout
):
    from voxtral_mlx.playback import Playback

    class ProducerError(Exception):
        pass

    counter = 0
    chunks = []
    for s in sizes_:
        chunks.append(((np.arange(counter, counter + s) + 1) / 2**24).astype(np.float32))
        counter += s
    sd = AutoSD()
    p = AudioPlayer(SR, sd=sd, blocksize=1920)
    err = ProducerError("boom")
    stream = ScriptStream(chunks, delays_, fail_at, err)
    pb = Playback(stream, p)  # type: ignore[arg-type]
    failed = None
    t0 = time.monotonic()
    try:
        pb.wait(timeout)  # may return before the end
    except ProducerError as e:
        failed = e
    assert time.monotonic() - t0 < timeout + 0.5
    stopped = False
    if stop_after is not None:
        time.sleep(stop_after)
        t0 = time.monotonic()
        pb.stop()
        assert time.monotonic() - t0 < 0.2, "Playback.stop() must return at once"
        stopped = True
    deadline = time.monotonic() + HANG_S
    while failed is None:
        try:
            if pb.wait(0.5):
                break
        except ProducerError as e:
            failed = e
            break
        if time.monotonic() > deadline:
            dump_stacks_and_fail("Playback thread never ended")
    pb._thread.join(HANG_S)
    assert pb.done
    fails = fail_at is not None  # at fail_at, or after the last chunk
    if failed is not None:
        assert failed is err
    elif fails and not stopped:
        # the error was raised in wait() above unless playback ended before... it must be raised
        pytest.fail("the producer's error never reached wait()")
    if fails and not stopped:
        with pytest.raises(ProducerError):
            pb.wait(0)
    dev = np.concatenate(sd.received) if sd.received else np.zeros(0, np.float32)
    real = dev[dev != 0]
    exp = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
    assert np.array_equal(real, exp[: real.size]), "device got audio out of order"
    if not fails and not stopped:
        assert real.size == exp.size, (real.size, exp.size)
    assert p.closed


# -- races ---------------------------------------------------------------------------------


def test_stop_between_feeds_stop_check_and_its_lock_leaves_nothing_buffered():
    """stop() from another thread landing after feed() checked for it and before feed()
    takes the lock: the chunk is not queued once stop() has emptied the buffer (it was,
    held in memory, never played). Made deterministic by a clock that calls stop() when
    feed() reads it."""

    class StopDuringFeed:
        armed = False

        def __call__(self):
            if self.armed:
                self.armed = False
                p.stop()
            return 0.0

    clock = StopDuringFeed()
    p = AudioPlayer(SR, sd=SD(), clock=clock)
    clock.armed = True
    p.feed(np.ones(SR, np.float32))
    assert p.closed
    assert p.buffered_s == 0 and not p._chunks
