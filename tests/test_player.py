"""AudioPlayer: pre-roll, underruns, draining and stopping.

Most tests drive a fake sounddevice by hand: the test calls the stream's callback
itself (one block per ``pump()``) and moves a fake clock, so timing is exact. The last
tests play through the real PortAudio into an ALSA ``file`` device (tests/alsa/) in a
subprocess and compare the recording with what was played.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from voxtral_mlx.audio import player as player_module
from voxtral_mlx.audio.io import float_to_int16
from voxtral_mlx.audio.player import (
    AudioPlayer,
    import_sounddevice,
    list_output_devices,
    refresh_output_devices,
    resolve_device,
)
from voxtral_mlx.errors import AudioDeviceError, AudioOutputError, InputError, UsageError

SR = 24000
FRAME = 1920
FRAME_S = FRAME / SR
REPO = Path(__file__).resolve().parents[1]
ALSA_TEMPLATE = Path(__file__).with_name("alsa") / "asoundrc.in"


# -- a fake sounddevice ------------------------------------------------------------


class FakeClock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


class FakePortAudioError(Exception):
    pass


class FakeCallbackStop(Exception):
    pass


class FakeStream:
    def __init__(self, sd: FakeSD, **kwargs: Any) -> None:
        if sd.open_error:
            raise FakePortAudioError(sd.open_error)
        self.sd = sd
        self.kwargs = kwargs
        self.callback = kwargs["callback"]
        self.finished_callback = kwargs.get("finished_callback")
        self.blocksize = kwargs["blocksize"]
        self.channels = kwargs["channels"]
        self.latency = sd.latency
        self.active = False
        self.closed = False
        self.calls: list[str] = []
        self.blocks: list[np.ndarray] = []
        self._pump_lock = threading.Lock()

    def count(self, name: str) -> int:
        return self.calls.count(name)

    def start(self) -> None:
        self.calls.append("start")
        if self.sd.start_error:
            raise FakePortAudioError(self.sd.start_error)
        assert not self.closed
        self.active = True
        if self.sd.autoplay:
            threading.Thread(target=self._autoplay, daemon=True).start()

    def abort(self) -> None:
        self.calls.append("abort")
        self.active = False

    def stop(self) -> None:
        self.calls.append("stop")
        self.active = False

    def close(self) -> None:
        self.calls.append("close")
        self.active = False
        self.closed = True

    def pump(
        self, dac_delay: float = 0.0, frames: int | None = None, status: Any = None
    ) -> np.ndarray | None:
        """Run one callback as PortAudio would; returns the block (mono).

        Like PortAudio, no callback runs on a stream that is not active (None then).
        """
        with self._pump_lock:
            if not self.active:
                return None
            frames = frames or self.blocksize
            out = np.full((frames, self.channels), np.nan, np.float32)
            now = self.sd.clock()
            ti = SimpleNamespace(currentTime=now, outputBufferDacTime=now + dac_delay)
            try:
                self.callback(out, frames, ti, status)
            except FakeCallbackStop:
                self.end_by_host()
            assert not np.isnan(out).any(), "callback left part of the block unwritten"
            block = out[:, 0].copy()
            assert (out == out[:, :1]).all(), "the channels must carry the same signal"
            self.blocks.append(block)
            return block

    def end_by_host(self) -> None:
        """The stream ends on its own (CallbackStop, device gone): finished_callback."""
        self.active = False
        if self.finished_callback is not None:
            self.finished_callback()

    def _autoplay(self) -> None:
        while self.pump(dac_delay=0.001) is not None:
            time.sleep(0.001)


class FakeSD:
    """Just enough of the sounddevice module for AudioPlayer."""

    PortAudioError = FakePortAudioError
    CallbackStop = FakeCallbackStop

    def __init__(
        self,
        devices: list[dict[str, Any]] | None = None,
        default_output: int | None = 1,
        clock: FakeClock | None = None,
        *,
        autoplay: bool = False,
        hostapi: str = "Core Audio",
    ) -> None:
        self.hostapi = hostapi
        self.devices = (
            devices
            if devices is not None
            else [
                {"name": "Built-in Microphone", "max_input_channels": 2, "max_output_channels": 0},
                {"name": "MacBook Pro Speakers", "max_input_channels": 0, "max_output_channels": 2},
                {"name": "USB Audio CODEC", "max_input_channels": 2, "max_output_channels": 2},
                {"name": "USB Audio CODEC 2", "max_input_channels": 0, "max_output_channels": 2},
            ]
        )
        self.default_output = default_output
        self.clock = clock or FakeClock()
        self.autoplay = autoplay
        self.latency = 0.05
        self.open_error: str | None = None
        self.start_error: str | None = None
        self.streams: list[FakeStream] = []

    def query_devices(self, device: Any = None, kind: str | None = None) -> Any:
        listing = [dict(d, index=i, hostapi=0) for i, d in enumerate(self.devices)]
        if device is not None:
            return listing[device]
        if kind == "output":
            if self.default_output is None:
                raise FakePortAudioError("Error querying device -1")
            return listing[self.default_output]
        return listing

    def query_hostapis(self, index: int) -> dict[str, Any]:
        assert index == 0
        return {"name": self.hostapi, "devices": list(range(len(self.devices)))}

    def OutputStream(self, **kwargs: Any) -> FakeStream:
        s = FakeStream(self, **kwargs)
        self.streams.append(s)
        return s


def make_player(
    clock: FakeClock | None = None, *, autoplay: bool = False, **kwargs: Any
) -> tuple[AudioPlayer, FakeSD]:
    sd = FakeSD(clock=clock or FakeClock(), autoplay=autoplay)
    clk = time.monotonic if autoplay else sd.clock
    if autoplay:
        sd.clock = time.monotonic  # type: ignore[assignment]
    p = AudioPlayer(SR, sd=sd, clock=clk, **kwargs)
    return p, sd


def frame(i: int, n: int = FRAME) -> np.ndarray:
    """A recognisable block: sample j of frame i is (i * FRAME + j + 1) / 2**20."""
    return (np.arange(n, dtype=np.float32) + i * FRAME + 1) / 2**20


def _wait_for(cond, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def run_in_thread(fn) -> tuple[threading.Thread, dict[str, Any]]:
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = fn()
        except BaseException as e:
            result["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, result


# -- construction, devices -----------------------------------------------------------


def test_module_import_does_not_import_sounddevice():
    code = (
        "import sys, voxtral_mlx.audio.player, voxtral_mlx.audio.io; "
        "assert 'sounddevice' not in sys.modules, 'imported at module level'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=120)


def test_opens_float32_stream_on_resolved_device():
    sd = FakeSD(hostapi="ALSA")
    p = AudioPlayer(SR, device="speakers", sd=sd, clock=sd.clock)
    kw = sd.streams[0].kwargs
    assert kw["device"] == 1 and p.device == 1
    assert (kw["samplerate"], kw["blocksize"], kw["channels"], kw["dtype"]) == (
        SR,
        FRAME,
        1,
        "float32",
    )
    assert sd.streams[0].count("start") == 0  # nothing buffered yet


@pytest.mark.parametrize(
    ("hostapi", "outputs", "device", "channels"),
    [
        ("Core Audio", 2, None, 2),  # the default output
        ("Core Audio", 8, "interface", 2),  # an audio interface: its first two outputs
        ("Core Audio", 1, "headset", 1),  # a Bluetooth headset in call mode
        ("ALSA", 8, "interface", 1),  # the host API or the sound server upmixes mono
        ("Windows WASAPI", 2, None, 1),
    ],
)
def test_core_audio_plays_the_voice_on_both_speakers(hostapi, outputs, device, channels):
    devices = [
        {"name": "Speakers", "max_input_channels": 0, "max_output_channels": 2},
        {"name": "Interface", "max_input_channels": 2, "max_output_channels": outputs},
        {"name": "Headset", "max_input_channels": 1, "max_output_channels": outputs},
    ]
    sd = FakeSD(devices, default_output=1 if device is None else 0, hostapi=hostapi)
    p = AudioPlayer(SR, device=device, sd=sd, clock=sd.clock)
    stream = sd.streams[0]
    assert stream.kwargs["channels"] == p.channels == channels
    p.feed(frame(0))
    sd.clock.advance(0.001)
    p.feed(frame(1))  # fast generation: it starts
    p.feed(frame(2, FRAME // 2))
    blocks = [stream.pump() for _ in range(3)]
    # pump() checks that every channel of a block holds the same samples.
    np.testing.assert_array_equal(np.concatenate(blocks[:2]), np.concatenate([frame(0), frame(1)]))
    np.testing.assert_array_equal(blocks[2][: FRAME // 2], frame(2, FRAME // 2))
    assert not blocks[2][FRAME // 2 :].any()


def test_a_device_that_cannot_be_described_opens_mono():
    sd = FakeSD()
    sd.query_hostapis = None  # an older sounddevice, or a host API index out of range
    p = AudioPlayer(SR, sd=sd, clock=sd.clock)
    assert sd.streams[0].kwargs["channels"] == p.channels == 1


def test_list_output_devices():
    devs = list_output_devices(FakeSD())
    assert devs == [
        {"index": 1, "name": "MacBook Pro Speakers", "channels": 2, "default": True},
        {"index": 2, "name": "USB Audio CODEC", "channels": 2, "default": False},
        {"index": 3, "name": "USB Audio CODEC 2", "channels": 2, "default": False},
    ]


def test_resolve_device():
    sd = FakeSD()
    assert resolve_device(None, sd) is None
    assert resolve_device("", sd) is None
    assert resolve_device(2, sd) == 2
    assert resolve_device("3", sd) == 3
    assert resolve_device("macbook", sd) == 1
    assert resolve_device("usb audio codec", sd) == 2  # an exact name beats substrings
    assert resolve_device("CODEC 2", sd) == 3


@pytest.mark.parametrize(
    ("spec", "pattern"),
    [
        ("headphones", "no audio output device matches 'headphones'"),
        ("usb", "ambiguous"),
        ("²", "no audio output device matches '²'"),  # a digit to str.isdigit, not to int()
        ("--2", "no audio output device matches '--2'"),
        (0, "index 0"),  # an input-only device
        (9, "index 9"),
    ],
)
def test_resolve_device_errors_list_devices(spec, pattern):
    with pytest.raises(AudioOutputError, match=pattern) as e:
        resolve_device(spec, FakeSD())
    msg = str(e.value)
    assert "\n" not in msg
    assert "MacBook Pro Speakers" in msg or "USB Audio CODEC" in msg


@pytest.mark.parametrize("spec", [1.5, True, b"speakers", ["speakers"]])
def test_a_device_that_is_neither_name_nor_index_is_an_input_error(spec):
    # Checked before the devices are listed: no device at all must not hide the type error.
    with pytest.raises(InputError, match="device must be an output device's name or index"):
        resolve_device(spec, FakeSD(devices=[]))
    assert resolve_device(np.int64(2), FakeSD()) == 2


def test_no_output_device():
    sd = FakeSD(devices=[{"name": "Mic", "max_input_channels": 1, "max_output_channels": 0}])
    with pytest.raises(AudioOutputError, match="-o FILE"):
        AudioPlayer(SR, sd=sd)
    with pytest.raises(AudioOutputError, match=r"-o FILE; in Python, tts\.synthesize\(\)"):
        AudioPlayer(SR, sd=FakeSD(devices=[]))


def test_no_default_output_device():
    with pytest.raises(AudioOutputError, match=r"no default audio output.*Speakers"):
        AudioPlayer(SR, sd=FakeSD(default_output=None))
    # naming one still works
    assert AudioPlayer(SR, device=2, sd=FakeSD(default_output=None)).device == 2


def test_stream_open_and_start_errors():
    sd = FakeSD()
    sd.open_error = "Invalid sample rate"
    with pytest.raises(AudioOutputError, match=r"Invalid sample rate.*-o FILE") as e:
        AudioPlayer(SR, sd=sd)
    # The rate asked for is named (a device fixed at 48 kHz refuses 24 kHz), and the
    # device's own when it is known.
    assert f"cannot open audio output at {SR} Hz (Invalid" in str(e.value)
    sd.devices[1]["default_samplerate"] = 48000.0
    with pytest.raises(AudioOutputError) as e:
        AudioPlayer(SR, sd=sd)
    assert f"at {SR} Hz (the device's own rate is 48000 Hz) (Invalid sample" in str(e.value)
    sd = FakeSD()
    sd.start_error = "Device unavailable"
    p = AudioPlayer(SR, sd=sd, clock=sd.clock)
    p.feed(frame(0))
    with pytest.raises(AudioOutputError, match="Device unavailable"):
        p.feed(frame(1))
    assert sd.streams[0].closed


@pytest.mark.parametrize(
    "body, words",
    [
        # macOS: no PortAudio on the library path and no bundled copy (a source build)
        ("import _no_such_sounddevice_data\n", "sounddevice cannot load PortAudio"),
        (None, "the sounddevice package is not installed"),
    ],
)
def test_a_failed_sounddevice_import_names_what_is_missing(tmp_path, monkeypatch, body, words):
    """A missing piece of sounddevice was reported as sounddevice not being installed."""
    if body is not None:
        (tmp_path / "sounddevice.py").write_text(body)
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.delitem(sys.modules, "sounddevice", raising=False)
    else:
        monkeypatch.setitem(sys.modules, "sounddevice", None)  # import raises ImportError
    with pytest.raises(AudioOutputError) as e:
        import_sounddevice()
    message = str(e.value)
    assert words in message and "\n" not in message and "-o FILE" in message
    if body is not None:
        assert "_no_such_sounddevice_data" in message and "--force-reinstall" in message


def test_portaudio_failing_to_start_at_import_is_one_line_error(tmp_path, monkeypatch):
    """sounddevice starts PortAudio at import: a broken ALSA configuration made its
    PortAudioError escape as a traceback."""
    (tmp_path / "sounddevice.py").write_text(
        "class PortAudioError(Exception):\n    pass\n"
        "raise PortAudioError('Error initializing PortAudio: Unanticipated host error')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "sounddevice", raising=False)
    with pytest.raises(AudioOutputError) as e:
        import_sounddevice()
    message = str(e.value)
    assert "PortAudio could not start" in message and "Unanticipated host error" in message
    assert "ALSA" in message and "-o FILE" in message and "\n" not in message


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ALSA is Linux's")
@pytest.mark.parametrize("named", ["missing", "empty", "a folder", "two, neither usable"])
def test_alsa_config_path_naming_no_configuration_is_one_line_error(tmp_path, named):
    """libasound with ALSA_CONFIG_PATH naming no configuration made PortAudio's start at
    import abort the process (SIGABRT, nothing said)."""
    (tmp_path / "empty.conf").write_text("")
    value = {
        "missing": str(tmp_path / "no-such.conf"),
        "empty": str(tmp_path / "empty.conf"),
        "a folder": str(tmp_path),
        "two, neither usable": f"{tmp_path / 'empty.conf'}:{tmp_path / 'no-such.conf'}",
    }[named]
    env = {**os.environ, "ALSA_CONFIG_PATH": value, "JACK_NO_START_SERVER": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    script = (
        "from voxtral_mlx.audio.player import import_sounddevice\n"
        "from voxtral_mlx.errors import AudioOutputError\n"
        "try:\n    import_sounddevice()\nexcept AudioOutputError as e:\n"
        "    print(e)\n    raise SystemExit(3)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 3, (proc.returncode, proc.stderr[-2000:])
    message = proc.stdout.strip()
    assert "\n" not in message and f"ALSA_CONFIG_PATH={value!r}" in message
    assert "unset it" in message and "-o FILE" in message


def test_alsa_config_path_is_read_as_libasound_reads_it(tmp_path, monkeypatch):
    """A missing file beside a usable one is skipped by libasound: no error for it. Entries
    are split at ":" and " ", read up to the first empty one, "~/" is the home folder."""
    from voxtral_mlx.audio.player import _check_alsa_config_path

    conf = tmp_path / "asoundrc"
    conf.write_text(ALSA_TEMPLATE.read_text())
    missing = tmp_path / "no-such.conf"
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.delitem(sys.modules, "sounddevice", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    for usable in (f"{missing}:{conf}", f"{missing} {conf}", "~/asoundrc", f"{conf}::{missing}"):
        monkeypatch.setenv("ALSA_CONFIG_PATH", usable)
        _check_alsa_config_path()
    for unusable in (str(missing), f":{conf}", f"{missing}::{conf}", "~/no-such.conf"):
        monkeypatch.setenv("ALSA_CONFIG_PATH", unusable)
        with pytest.raises(AudioOutputError, match="names no ALSA configuration file"):
            _check_alsa_config_path()


def test_missing_portaudio_is_one_line_error(tmp_path, monkeypatch):
    # sounddevice raises OSError at import when libportaudio cannot be found.
    (tmp_path / "sounddevice.py").write_text("raise OSError('PortAudio library not found')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "sounddevice", raising=False)
    with pytest.raises(AudioOutputError) as e:
        import_sounddevice()
    assert "PortAudio" in str(e.value) and "-o FILE" in str(e.value)
    assert "\n" not in str(e.value)
    with pytest.raises(AudioOutputError, match="PortAudio"):
        AudioPlayer(SR)
    with pytest.raises(AudioOutputError, match="PortAudio"):
        list_output_devices()


# -- pre-roll ----------------------------------------------------------------------


def test_fast_generation_starts_after_min_preroll():
    p, sd = make_player()
    clock = sd.clock
    p.feed(frame(0))
    assert not p.started  # one chunk: speed unknown yet
    clock.advance(0.02)
    p.feed(frame(1))
    assert p.started and sd.streams[0].count("start") == 1
    assert p.stats.preroll_s == pytest.approx(0.16)
    assert p.stats.generation_speed == pytest.approx(FRAME_S / 0.02)
    assert p.stats.started_at == clock.t


def test_out_of_range_and_nan_samples_reach_the_device_as_full_scale_and_silence():
    p, sd = make_player()
    p.feed(np.array([2.0, -3.0, np.nan, 0.5, np.inf, -np.inf], np.float32))
    p._start()
    block = sd.streams[0].pump()
    assert block is not None
    assert np.array_equal(block[:6], [1.0, -1.0, 0.0, 0.5, 1.0, -1.0])
    p.stop()


def test_fast_generation_with_expected_total_still_starts_early():
    p, sd = make_player()
    p.feed(frame(0), expected_total_s=30.0)
    sd.clock.advance(0.04)
    p.feed(frame(1), expected_total_s=30.0)
    assert p.started and p.stats.preroll_s == pytest.approx(0.16)


def _feed_every(p: AudioPlayer, clock: FakeClock, period: float, n: int, **kw: Any) -> int:
    """Feed frames every `period` s until the player starts; returns frames fed."""
    for i in range(n):
        if i:
            clock.advance(period)
        p.feed(frame(i), **kw)
        if p.started:
            return i + 1
    return n


def test_slow_generation_with_expected_total_waits_for_computed_preroll():
    # Half real time (one 80 ms frame every 160 ms), 4 s expected in total:
    # pre-roll = 0.16 + 1.1 * (1 - 0.5) * 4.0 = 2.36 s -> the 30th frame (2.40 s).
    p, sd = make_player()
    fed = _feed_every(p, sd.clock, 2 * FRAME_S, 50, expected_total_s=4.0)
    assert fed == 30
    assert p.stats.generation_speed == pytest.approx(0.5)
    assert p.stats.preroll_s == pytest.approx(30 * FRAME_S)
    assert p.required_preroll_s() == pytest.approx(2.36)


def test_slow_generation_preroll_plays_through_without_gaps():
    # Simulate the whole utterance: 50 frames generated at half real time; the device
    # takes one block every 80 ms once started. The computed pre-roll must be enough.
    clock = FakeClock()
    p, sd = make_player(clock)
    s = sd.streams[0]
    played: list[np.ndarray] = []
    for step in range(100):
        if step % 2 == 0:
            p.feed(frame(step // 2), expected_total_s=4.0)
        if s.active:
            played.append(s.pump())
        clock.advance(FRAME_S)
    t, result = run_in_thread(p.finish)
    _wait_for(lambda: p._eof)
    while (block := s.pump()) is not None:  # until finish() has played out and aborted
        played.append(block)
        clock.advance(FRAME_S)
        time.sleep(0.002)
    t.join(2)
    assert not t.is_alive() and "error" not in result
    assert p.stats.preroll_s == pytest.approx(30 * FRAME_S)
    assert p.stats.underruns == 0 and p.stats.underrun_s == 0
    audio = np.concatenate(played)
    assert np.array_equal(audio[: 50 * FRAME], np.concatenate([frame(i) for i in range(50)]))
    assert p.stats.played_s == pytest.approx(50 * FRAME_S)


def test_slow_generation_unknown_total_uses_bounded_heuristic():
    # speed 0.5, total unknown: min(3.0, 0.16 + 1.1 * 0.5 * 10) = 3.0 s -> 38 frames.
    p, sd = make_player()
    fed = _feed_every(p, sd.clock, 2 * FRAME_S, 60)
    assert fed == 38
    assert p.stats.preroll_s == pytest.approx(38 * FRAME_S)


def test_preroll_never_exceeds_expected_total():
    # Very slow (0.1x) but only 1 s expected: start once that second is buffered.
    p, sd = make_player()
    fed = _feed_every(p, sd.clock, 10 * FRAME_S, 30, expected_total_s=1.0)
    assert fed == 13  # 13 frames = 1.04 s >= 1.0 s
    assert p.required_preroll_s() == pytest.approx(1.04)  # the total grows to what was fed


def test_short_utterance_starts_at_finish():
    p, sd = make_player(autoplay=True)
    x = frame(0, 700)
    p.feed(x)
    assert not p.started
    p.finish()
    s = sd.streams[0]
    assert s.calls == ["start", "abort", "close"]  # aborted after the end played
    played = np.concatenate(s.blocks)
    assert np.array_equal(played[:700], x) and not played[700:].any()


def test_finish_without_audio_never_starts():
    p, sd = make_player()
    p.finish()
    assert sd.streams[0].calls == ["close"]
    p.finish()
    p.stop()
    assert sd.streams[0].calls == ["close"]


# -- back-pressure: a long text does not pile up in memory ------------------------------


def _produce(p: AudioPlayer, clock: FakeClock, n: int) -> tuple[threading.Thread, list[int]]:
    """Feed n frames from a thread, 10x faster than real time; returns (thread, fed)."""
    fed: list[int] = []

    def produce() -> None:
        for i in range(n):
            clock.advance(FRAME_S / 10)
            p.feed(frame(i))
            fed.append(i)

    t, _ = run_in_thread(produce)
    return t, fed


def test_fast_generator_is_held_back_at_max_buffer():
    p, sd = make_player(max_buffer_s=0.5)
    s = sd.streams[0]
    t, fed = _produce(p, sd.clock, 20)
    _wait_for(lambda: len(fed) == 6)
    time.sleep(0.1)
    assert len(fed) == 6 and t.is_alive()  # the 7th feed (0.56 s buffered) waits
    assert p.started and p.buffered_s == pytest.approx(7 * FRAME_S)
    played, most = [], 0.0
    while t.is_alive():
        played.append(s.pump())
        most = max(most, p.buffered_s)
        time.sleep(0.03)  # longer than the feed's poll: it catches up each time
    assert len(fed) == 20 and most <= 0.5 + FRAME_S
    t, result = run_in_thread(p.finish)
    _wait_for(lambda: p._eof)
    while (block := s.pump()) is not None:
        played.append(block)
        sd.clock.advance(FRAME_S)
        time.sleep(0.002)
    t.join(2)
    assert not t.is_alive() and "error" not in result
    audio = np.concatenate(played)
    assert np.array_equal(audio[: 20 * FRAME], np.concatenate([frame(i) for i in range(20)]))


def test_stop_releases_a_feed_waiting_for_room():
    p, sd = make_player(max_buffer_s=0.5)
    t, fed = _produce(p, sd.clock, 20)
    _wait_for(lambda: len(fed) == 6)
    t0 = time.monotonic()
    p.stop()
    t.join(2)
    assert not t.is_alive() and time.monotonic() - t0 < 0.2
    assert len(fed) == 20  # later feeds are no-ops


def test_slow_generation_preroll_is_capped_at_max_buffer():
    # 0.5x real time, 100 s expected: the computed pre-roll (55 s) exceeds max_buffer_s,
    # so the stream starts once max_buffer_s (13 frames) is buffered.
    p, sd = make_player(max_buffer_s=13 * FRAME_S)
    fed = _feed_every(p, sd.clock, 2 * FRAME_S, 50, expected_total_s=100.0)
    assert fed == 13
    assert p.stats.preroll_s == pytest.approx(13 * FRAME_S)


# -- underruns -----------------------------------------------------------------------


def test_underrun_plays_silence_counts_and_resumes_without_restart():
    p, sd = make_player()
    s = sd.streams[0]
    p.feed(frame(0))
    sd.clock.advance(0.01)
    p.feed(frame(1))
    assert np.array_equal(s.pump(), frame(0))
    assert np.array_equal(s.pump(), frame(1))
    for _ in range(2):  # generation stalls: silence, not a stopped stream
        assert not s.pump().any()
    p.feed(frame(2))
    assert np.array_equal(s.pump(), frame(2))
    assert p.stats.underruns == 1
    assert p.stats.underrun_s == pytest.approx(2 * FRAME_S)
    # a partial block: the rest is silence, counted once data resumes
    p.feed(frame(3, 500))
    b = s.pump()
    assert np.array_equal(b[:500], frame(3, 500)) and not b[500:].any()
    p.feed(frame(4))
    assert np.array_equal(s.pump(), frame(4))
    assert p.stats.underruns == 2
    assert p.stats.underrun_s == pytest.approx(2 * FRAME_S + (FRAME - 500) / SR)
    assert s.count("start") == 1
    assert s.count("stop") == 0 and s.count("abort") == 0 and s.active
    assert p.stats.played_s == pytest.approx((4 * FRAME + 500) / SR)


@pytest.mark.parametrize("waiting", [False, True])
def test_silence_while_waiting_for_input_is_no_underrun(waiting: bool):
    """Live text: the buffer runs dry after a sentence because the next one has not been
    written yet (feed(more_coming=False)). `speak --follow --verbose` reported that wait as
    an underrun, which says generation is too slow."""
    p, sd = make_player()
    s = sd.streams[0]
    p.feed(frame(0), more_coming=True)
    sd.clock.advance(0.01)
    p.feed(frame(1), more_coming=not waiting)
    assert np.array_equal(s.pump(), frame(0))
    assert np.array_equal(s.pump(), frame(1))
    for _ in range(3):
        assert not s.pump().any()
    p.feed(frame(2), more_coming=True)
    assert np.array_equal(s.pump(), frame(2))
    assert p.stats.underruns == (0 if waiting else 1)
    assert p.stats.underrun_s == pytest.approx(0.0 if waiting else 3 * FRAME_S)


def play_slowly(p: AudioPlayer, sd: FakeSD, frames: int, guess: int, waits: bool = False):
    """Generation at half real time (a frame fed every second block) of ``frames`` frames
    whose expected length is ``guess`` frames, pumped block by block, then finish(): the
    blocks played, split into runs of audio and of silence (lengths in blocks)."""
    s, fed, played = sd.streams[0], 0, []
    p.feed(frame(0), expected_total_s=guess * FRAME_S, more_coming=not waits)
    fed = 1
    step = 0
    while fed < frames:
        step += 1
        sd.clock.advance(FRAME_S)
        if step % 2 == 0:
            p.feed(frame(fed), expected_total_s=guess * FRAME_S, more_coming=not waits)
            fed += 1
        block = s.pump()
        if block is not None:
            played.append(block)
    t, _ = run_in_thread(p.finish)
    while (block := s.pump()) is not None:
        played.append(block)
        sd.clock.advance(FRAME_S)
        time.sleep(0.002)
    t.join(2)
    assert not t.is_alive()
    runs: list[list] = []  # [is audio, blocks]
    for block in played:
        audio = bool(block.any())
        if runs and runs[-1][0] == audio:
            runs[-1][1] += 1
        else:
            runs.append([audio, 1])
    audio = np.concatenate([b for b in played if b.any()])
    assert np.array_equal(audio, np.concatenate([frame(i) for i in range(frames)]))
    while runs and not runs[-1][0]:  # trailing silence before the stream ends
        runs.pop()
    return runs


def test_a_slow_generation_that_runs_dry_refills_once_rather_than_stuttering():
    """Speech running longer than its guess while generated at half real time: the buffer
    runs dry, and playback waits to refill, one gap, instead of playing each frame as it
    comes (a gap of a frame between every two, heard as a stutter)."""
    p, sd = make_player()
    runs = play_slowly(p, sd, frames=30, guess=10)
    gaps = [n for audio, n in runs if not audio]
    assert len(gaps) == 1 and p.stats.underruns == 1, runs
    assert p.stats.underrun_s == pytest.approx(gaps[0] * FRAME_S)


def test_a_gap_where_the_input_waits_resumes_at_once():
    """Live text whose writer has not gone further: the next audio plays as it comes."""
    p, sd = make_player()
    runs = play_slowly(p, sd, frames=30, guess=10, waits=True)
    assert len([n for audio, n in runs if not audio]) > 3, runs  # each frame when it came


def test_a_segments_last_chunk_plays_while_the_text_is_awaited_after_a_refill_began():
    """Live text generated at half real time: the buffer ran dry mid-segment (a refill),
    then the segment's last chunk came with nothing known to follow. It used to stay
    silent until more text came (or the input ended)."""
    p, sd = make_player()
    s, fed, step = None, 0, 0
    while not p._refilling:  # half real time, more coming: runs dry, refills
        assert step < 200
        if step % 2 == 0:
            fed += 1
            p.feed(frame(fed), expected_total_s=(fed + 5) * FRAME_S, more_coming=True)
        sd.clock.advance(FRAME_S)
        s = s or (sd.streams[0] if sd.streams else None)
        if s is not None:
            s.pump()
        step += 1
    last = np.concatenate([frame(100), frame(101)])
    p.feed(last, expected_total_s=(fed + 2) * FRAME_S, more_coming=False)
    played = []
    for _ in range(6):  # the writer of the text is still thinking: nothing more is fed
        sd.clock.advance(FRAME_S)
        played.append(s.pump())
    assert np.array_equal(np.concatenate([b for b in played if b.any()])[-len(last) :], last)
    assert p.buffered_s == 0


def test_a_refill_after_a_short_guess_waits_for_the_guessed_rest():
    """The expected total not yet reached: refill for what is still to play, as the
    pre-roll would, not for the unknown-length maximum."""
    p, sd = make_player()
    p.feed(frame(0), expected_total_s=40 * FRAME_S)
    sd.clock.advance(2 * FRAME_S)
    p.feed(frame(1), expected_total_s=40 * FRAME_S)
    p._played = 20 * FRAME  # as if 20 frames had played
    need = p.resume_need_s()
    left = 20 * FRAME_S
    assert need == pytest.approx(min(left, p.min_preroll_s + 1.1 * (1 - 0.5) * left))
    p._played = 45 * FRAME  # past the guess: the unknown-length rule, at most 3 s
    assert p.resume_need_s() == pytest.approx(3.0)


def test_chunks_spanning_blocks_are_played_in_order():
    p, sd = make_player()
    x = np.concatenate([frame(i) for i in range(5)])
    p.feed(x[:1000])
    sd.clock.advance(0.001)
    p.feed(x[1000:4000])
    p.feed(x[4000:4001])
    p.feed(x[4001:])
    s = sd.streams[0]
    got = np.concatenate([s.pump() for _ in range(5)])
    assert np.array_equal(got, x) and p.stats.underruns == 0


def test_device_xruns_count_only_portaudio_output_underflow_flags():
    # PortAudio passes CallbackFlags; only output_underflow means the device went without.
    p, sd = make_player()
    for i in range(4):
        p.feed(frame(i))
    stream = sd.streams[0]
    stream.pump(status=SimpleNamespace(output_underflow=True, output_overflow=False))
    stream.pump(status=SimpleNamespace(output_underflow=False, output_overflow=True))
    stream.pump(status=None)
    stream.pump(status=SimpleNamespace(output_underflow=True, output_overflow=False))
    assert p.stats.device_xruns == 2
    assert p.stats.underruns == 0  # the player's own buffer never ran dry


def test_trailing_silence_before_finish_is_not_an_underrun():
    p, sd = make_player()
    s = sd.streams[0]
    p.feed(frame(0))
    sd.clock.advance(0.01)
    p.feed(frame(1))
    s.pump()
    s.pump()
    s.pump()  # the generator is done but finish() has not been called yet
    t, _ = run_in_thread(p.finish)
    while s.pump() is not None:
        sd.clock.advance(FRAME_S)
        time.sleep(0.005)
    t.join(2)
    assert not t.is_alive()
    assert p.stats.underruns == 0 and p.stats.underrun_s == 0


def test_gap_followed_by_audio_is_counted_even_after_finish():
    # The buffer ran dry, more audio arrived, then finish() before that audio played:
    # the silence sits inside the audio, so it is an underrun.
    p, sd = make_player()
    s = sd.streams[0]
    p.feed(frame(0))
    sd.clock.advance(0.01)
    p.feed(frame(1))
    s.pump()
    s.pump()
    assert not s.pump().any()
    p.feed(frame(2))
    t, _ = run_in_thread(p.finish)
    _wait_for(lambda: p._eof)
    assert np.array_equal(s.pump(), frame(2))
    assert p.stats.underruns == 1 and p.stats.underrun_s == pytest.approx(FRAME_S)
    while s.pump() is not None:
        sd.clock.advance(FRAME_S)
        time.sleep(0.005)
    t.join(2)
    assert not t.is_alive() and p.stats.underruns == 1


# -- draining -------------------------------------------------------------------------


def test_finish_returns_only_after_last_partial_block_is_played():
    p, sd = make_player()
    s = sd.streams[0]
    x = np.concatenate([frame(0), frame(1), frame(2, FRAME // 2)])
    p.feed(x[:FRAME])
    sd.clock.advance(0.01)
    p.feed(x[FRAME:])
    t, result = run_in_thread(p.finish)
    b1 = s.pump(dac_delay=0.05)
    assert p.stats.first_audio_at == pytest.approx(sd.clock.t + 0.05)
    time.sleep(0.1)
    assert t.is_alive()
    b2 = s.pump(dac_delay=0.05)
    time.sleep(0.1)
    assert t.is_alive()
    b3 = s.pump(dac_delay=0.05)  # last: half real audio, half zero padding
    assert np.array_equal(np.concatenate([b1, b2, b3])[: x.size], x)
    assert not b3[FRAME // 2 :].any()
    # The stream keeps running (silence) while the end plays out.
    assert not s.pump(dac_delay=0.05).any()
    # The last sample leaves the DAC 50 ms + half a block after the third callback;
    # finish() allows one more block for PortAudio's buffer adaptation.
    time.sleep(0.1)
    assert t.is_alive()
    sd.clock.advance(0.05 + FRAME_S / 2 + FRAME_S - 0.001)
    time.sleep(0.1)
    assert t.is_alive()
    sd.clock.advance(0.002)
    t.join(1)
    assert not t.is_alive() and "error" not in result
    assert s.calls == ["start", "abort", "close"]  # aborted only once the end has played
    assert p.stats.played_s == pytest.approx(x.size / SR)
    assert p.stats.underruns == 0


def test_finish_exactly_on_block_boundary():
    p, sd = make_player()
    s = sd.streams[0]
    p.feed(frame(0))
    sd.clock.advance(0.01)
    p.feed(frame(1))
    t, _ = run_in_thread(p.finish)
    _wait_for(lambda: p._eof)
    assert np.array_equal(s.pump(), frame(0))
    assert not p._drained.is_set()
    assert np.array_equal(s.pump(), frame(1))
    assert p._drained.is_set()  # the block that held the last sample marks the end
    sd.clock.advance(2 * FRAME_S)
    t.join(1)
    assert not t.is_alive() and s.closed


def test_stream_ending_on_its_own_is_an_error_not_a_hang():
    p, sd = make_player()
    p.feed(frame(0))
    sd.clock.advance(0.01)
    p.feed(frame(1))
    t, result = run_in_thread(p.finish)
    time.sleep(0.05)
    sd.streams[0].end_by_host()
    t.join(1)
    assert isinstance(result.get("error"), AudioOutputError)
    assert "ended unexpectedly" in str(result["error"])


def test_context_manager_finishes_on_normal_exit():
    with make_player(autoplay=True)[0] as p:
        for i in range(6):
            p.feed(frame(i))
    s = p._sd.streams[0]
    assert s.calls == ["start", "abort", "close"]
    played = np.concatenate(s.blocks)
    # The autoplaying fake outruns the feeder, so gaps of silence may sit in between.
    assert np.array_equal(played[played != 0], np.concatenate([frame(i) for i in range(6)]))


def test_feed_after_finish_is_an_error():
    p, _ = make_player()
    p.finish()
    with pytest.raises(RuntimeError, match=r"feed\(\) called after finish\(\)"):
        p.feed(frame(0))


def test_stalled_device_raises_instead_of_hanging():
    p, sd = make_player()
    p.feed(frame(0))
    sd.clock.advance(0.01)
    p.feed(frame(1))
    t, result = run_in_thread(p.finish)
    time.sleep(0.05)
    sd.clock.advance(10.0)
    t.join(2)
    assert isinstance(result.get("error"), AudioOutputError)
    assert sd.streams[0].count("abort") == 1 and sd.streams[0].closed


def test_a_device_that_hangs_its_stream_is_left_open_not_waited_for(monkeypatch):
    """PortAudio's abort and close wait for its audio thread, which a hung device holds in
    a write: finish() waited for the device to come back (for ever, if it never did),
    Ctrl-C included, and so did PortAudio's termination at exit."""
    sd = RestartableSD()
    p = AudioPlayer(SR, sd=sd, clock=sd.clock)
    hung = threading.Event()
    stream = sd.streams[0]
    stream.abort = lambda: hung.wait(30)  # type: ignore[method-assign]
    sd._exit_handler = lambda: None
    unregistered: list[object] = []
    monkeypatch.setattr(player_module.atexit, "unregister", unregistered.append)
    p.feed(frame(0))
    sd.clock.advance(0.01)
    p.feed(frame(1))
    t, result = run_in_thread(p.finish)
    time.sleep(0.05)
    sd.clock.advance(10.0)  # no callback since: the device stalled
    t.join(player_module._CLOSE_WAIT_S + 2)
    assert not t.is_alive() and isinstance(result.get("error"), AudioDeviceError)
    assert p.abandoned and not stream.closed
    assert unregistered == [sd._exit_handler]  # the exit would wait on the stream too
    with pytest.raises(UsageError, match=r"stopped responding.*restart the app"):
        refresh_output_devices(sd)
    assert sd.restarts == 0
    hung.set()  # the device comes back: the stream is closed after all
    _wait_for(lambda: stream.closed)


# -- stopping -------------------------------------------------------------------------


def _playing_player() -> tuple[AudioPlayer, FakeSD]:
    p, sd = make_player()
    for i in range(50):
        p.feed(frame(i))
        sd.clock.advance(0.001)
    assert p.started
    sd.streams[0].pump()
    return p, sd


def test_stop_from_another_thread_ends_blocking_finish_quickly():
    p, sd = _playing_player()
    s = sd.streams[0]
    t, result = run_in_thread(p.finish)
    time.sleep(0.1)
    assert t.is_alive()
    t0 = time.monotonic()
    stopper = threading.Thread(target=p.stop)
    stopper.start()
    t.join(0.2)
    elapsed = time.monotonic() - t0
    stopper.join(1)
    assert not t.is_alive() and elapsed < 0.2, elapsed
    assert "error" not in result
    assert s.count("abort") == 1 and s.count("close") == 1 and s.closed
    assert p.buffered_s == 0
    p.stop()  # twice is fine
    p.feed(frame(0))  # the generator may still be running: ignored
    assert p.buffered_s == 0
    assert s.count("abort") == 1 and s.count("close") == 1


def _slow_to_close(stream: FakeStream, seconds: float) -> None:
    """PortAudio's abort as some hosts do it (ALSA: about 0.25 s)."""
    abort = stream.abort

    def slow_abort() -> None:
        time.sleep(seconds)
        abort()

    stream.abort = slow_abort  # type: ignore[method-assign]


def test_stop_without_waiting_returns_before_portaudio_has_closed(monkeypatch):
    """A UI thread's Stop button waited for PortAudio's abort and close (0.2-0.25 s on ALSA,
    up to a second): with wait=False it returns at once, silent; a later stop() and the
    interpreter's exit wait for the close."""
    registered: list[object] = []
    monkeypatch.setattr(player_module.atexit, "register", registered.append)
    monkeypatch.setattr(player_module, "_exit_wait_registered", False)
    p, sd = _playing_player()
    # When a player is made (after sounddevice's handler: run before it), not at a stop
    # that may come from an exit handler itself, too late to register one.
    assert registered == [player_module._await_closing_streams]
    s = sd.streams[0]
    _slow_to_close(s, 0.3)
    t0 = time.monotonic()
    p.stop(wait=False)
    assert time.monotonic() - t0 < 0.1
    assert not s.closed and p.buffered_s == 0 and p.closed
    p.feed(frame(0))  # ignored, as after any stop()
    p.stop()  # waits for the close under way; no second one
    assert s.closed and s.count("abort") == 1 and s.count("close") == 1
    q, sd2 = _playing_player()
    _slow_to_close(sd2.streams[0], 0.3)
    q.stop(wait=False)
    q.finish()  # as a `with` block's normal end: waits for the close too
    assert sd2.streams[0].closed
    r, sd3 = _playing_player()
    _slow_to_close(sd3.streams[0], 0.3)
    r.stop(wait=False)
    assert not sd3.streams[0].closed
    player_module._await_closing_streams()  # what the exit runs
    assert sd3.streams[0].closed
    assert registered == [player_module._await_closing_streams]  # once


def test_a_stream_abandoned_at_exit_leaves_sounddevices_exit_handler_nothing_to_do(
    monkeypatch,
):
    """Unregistering sounddevice's handler from inside the exit run does not stop it on
    Python 3.14+ (it runs over a copy): it would stop and close the hung stream and
    terminate PortAudio, waiting for ever."""
    monkeypatch.setattr(player_module, "_CLOSE_WAIT_S", 0.1)
    monkeypatch.setattr(player_module.atexit, "unregister", lambda handler: None)
    p, sd = _playing_player()
    hung = threading.Event()
    sd.streams[0].abort = lambda: hung.wait(30)  # type: ignore[method-assign]
    sd._last_callback = object()
    sd._initialized = 1
    p.stop(wait=False)
    player_module._await_closing_streams()
    assert p.abandoned and sd._last_callback is None and sd._initialized == 0
    hung.set()  # the device came back and the stream closed after all: nothing to disarm
    _wait_for(lambda: p._released)
    sd._last_callback, sd._initialized = object(), 1
    player_module._await_closing_streams()
    assert sd._last_callback is not None and sd._initialized == 1


class FrameStream:
    """A text stream for Playback yielding one frame every 10 ms until cancelled."""

    text_error = None
    sample_rate = SR

    def __init__(self) -> None:
        self.cancelled = False

    def prepare(self) -> None:
        pass

    def __iter__(self):
        while not self.cancelled:
            time.sleep(0.01)
            yield SimpleNamespace(audio=frame(0), frames=1, segment=0)

    def cancel(self) -> None:
        self.cancelled = True


def test_playback_stop_returns_at_once_and_wait_after_the_device_is_released():
    from voxtral_mlx.playback import Playback

    p, sd = make_player(autoplay=True)
    s = sd.streams[0]
    playback = Playback(FrameStream(), p)  # type: ignore[arg-type]
    _wait_for(lambda: p.started)
    _slow_to_close(s, 0.3)
    t0 = time.monotonic()
    playback.stop()
    assert time.monotonic() - t0 < 0.1 and not s.closed
    assert playback.wait(5) and s.closed


def test_stop_before_start():
    p, sd = make_player()
    p.feed(frame(0))
    p.stop()
    assert sd.streams[0].calls == ["close"]
    p.finish()  # returns at once


def test_ctrl_c_during_finish_stops_and_reraises(monkeypatch):
    p, sd = _playing_player()
    assert threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        timer = threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            p.finish()
        assert time.monotonic() - t0 < 1.0
    finally:
        signal.signal(signal.SIGINT, old)
    s = sd.streams[0]
    assert s.count("abort") == 1 and s.closed and p.buffered_s == 0


def test_stop_from_a_signal_handler():
    p, sd = _playing_player()
    old = signal.signal(signal.SIGINT, lambda *_: p.stop())
    try:
        threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGINT)).start()
        t0 = time.monotonic()
        p.finish()  # returns (without raising) once the handler has stopped playback
        assert time.monotonic() - t0 < 1.0
    finally:
        signal.signal(signal.SIGINT, old)
    assert sd.streams[0].count("abort") == 1 and sd.streams[0].closed


def test_context_manager_stops_on_exception():
    with pytest.raises(KeyboardInterrupt), make_player()[0] as p:
        for i in range(10):
            p.feed(frame(i))
            p._sd.clock.advance(0.001)
        raise KeyboardInterrupt
    s = p._sd.streams[0]
    assert s.count("abort") == 1 and s.closed


def test_callback_never_waits_long_for_the_buffer_lock():
    # stop() from a signal handler may interrupt feed() while it holds the lock, then
    # abort() waits for the callback: the callback must give up and play silence.
    p, sd = _playing_player()
    s = sd.streams[0]
    before = p.buffered_s
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with p._lock:
            held.set()
            release.wait(2)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(1)
    t0 = time.monotonic()
    block = s.pump()
    assert time.monotonic() - t0 < 0.5
    release.set()
    t.join(1)
    assert not block.any() and p.buffered_s == before  # nothing consumed, nothing lost
    assert np.array_equal(s.pump(), frame(1))
    assert p.stats.underruns == 1 and p.stats.underrun_s == pytest.approx(FRAME_S)


def test_callback_after_stop_plays_silence():
    p, sd = _playing_player()
    s = sd.streams[0]
    # A callback already in flight while stop() runs must not play stale audio.
    p._stopped.set()
    assert not s.pump().any()


# -- the real thing: PortAudio -> ALSA file device ------------------------------------

_REAL_SCRIPT = r"""
import dataclasses, json, sys
import numpy as np
try:
    import sounddevice
except OSError as e:  # no libportaudio
    print(json.dumps({"skip": str(e)}))
    sys.exit(77)
from voxtral_mlx.audio.player import AudioPlayer, list_output_devices, resolve_device

args = json.loads(sys.argv[1])
signal = np.load(args["signal"])
player = AudioPlayer(24000, min_preroll_s=args["min_preroll_s"], device=args.get("device"))
for i in range(0, signal.size, args["chunk"]):
    player.feed(signal[i : i + args["chunk"]])
player.finish()
print(json.dumps({
    "stats": dataclasses.asdict(player.stats),
    "devices": list_output_devices(),
    "resolved": resolve_device("VOXTRAL_rec"),
    "latency": player._latency,
}))
"""


def _skip_or_fail(reason: str) -> None:
    if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
        pytest.fail(f"{reason}; CI must run this test: install the packages in ci/apt-packages.txt")
    pytest.skip(reason)


def _run_with_alsa(tmp_path: Path, script: str, arg: str, rec: Path) -> dict:
    """Run ``script`` (given ``arg``) in a fresh interpreter whose environment alone has
    ALSA_CONFIG_PATH set, its devices recording into ``rec``: PortAudio reads the ALSA
    configuration when sounddevice is imported, and the test process (and the user's
    ~/.asoundrc) must stay untouched. Returns the script's last JSON line; "@CONF@" in
    ``arg`` stands for the configuration's path."""
    if not sys.platform.startswith("linux"):
        pytest.skip("the devices are ALSA plugins: Linux only")
    conf = tmp_path / "asoundrc"
    conf.write_text(ALSA_TEMPLATE.read_text().replace("@RECORD_PATH@", str(rec)))
    env = dict(os.environ)
    env["ALSA_CONFIG_PATH"] = str(conf)
    env["JACK_NO_START_SERVER"] = "1"  # PortAudio's JACK host API must not spawn jackd
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run(
        [sys.executable, "-c", script, arg.replace("@CONF@", str(conf))],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if proc.returncode == 77:
        _skip_or_fail(f"PortAudio is not installed ({json.loads(proc.stdout)['skip']})")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _play_through_alsa(tmp_path: Path, signal_f32: np.ndarray, **args: Any):
    """Play `signal_f32` with the real sounddevice into an ALSA file device."""
    rec = tmp_path / "recorded.raw"
    np.save(tmp_path / "signal.npy", signal_f32)
    opts = {"signal": str(tmp_path / "signal.npy"), "chunk": FRAME, "min_preroll_s": 0.16}
    opts.update(args)
    result = _run_with_alsa(tmp_path, _REAL_SCRIPT, json.dumps(opts), rec)
    recorded = np.fromfile(rec, dtype="<i2")
    rec.unlink()  # mostly silence from the unclocked device (tens of MB): don't keep it
    return recorded, result


def _grid_signal(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Noise on the int16 grid (k / 32768) without a zero sample: silence is unambiguous."""
    rng = np.random.default_rng(seed)
    k = (rng.integers(1, 32768, n) * rng.choice([-1, 1], n)).astype(np.int16)
    return k, k.astype(np.float32) / 32768


def test_real_portaudio_plays_exact_samples(tmp_path):
    n = 12 * FRAME + 777  # the last block is partial
    k, x = _grid_signal(n)
    assert np.array_equal(float_to_int16(x), k)
    # min_preroll_s beyond the length: nothing plays before finish(), so the null device
    # (which is not clocked and drains instantly) cannot run dry in the middle.
    recorded, result = _play_through_alsa(tmp_path, x, min_preroll_s=60.0)
    nz = np.flatnonzero(recorded)
    assert nz.size, "nothing was recorded"
    signal_part = recorded[nz[0] : nz[-1] + 1]
    assert signal_part.size == n
    assert np.array_equal(signal_part, k)
    stats = result["stats"]
    assert stats["underruns"] == 0 and stats["played_s"] == pytest.approx(n / SR)
    assert stats["preroll_s"] == pytest.approx(n / SR)
    names = {d["name"]: d for d in result["devices"]}
    assert {"default", "voxtral_record", "voxtral_null"} <= set(names)
    assert names["default"]["default"] is True
    assert result["resolved"] == names["voxtral_record"]["index"]


def test_real_portaudio_converts_for_an_integer_device_without_dither(tmp_path):
    """A device that takes no float32 gets PortAudio's own conversion; with its default
    dither about half the samples came out 1 LSB off."""
    n = 12 * FRAME
    k, x = _grid_signal(n, seed=2)
    recorded, _ = _play_through_alsa(tmp_path, x, min_preroll_s=60.0, device="voxtral_s16")
    nz = np.flatnonzero(recorded)
    assert nz.size, "nothing was recorded"
    assert np.array_equal(recorded[nz[0] : nz[-1] + 1], k)


def test_real_portaudio_streaming_with_underruns(tmp_path):
    n = 20 * FRAME + 123
    k, x = _grid_signal(n, seed=1)
    # Default pre-roll: playback starts after two frames while feeding continues; the
    # unclocked null device outruns the feeder, so gaps of silence are expected. The
    # audio itself must still come out complete, in order and bit-exact, and every gap
    # inside it must be accounted for in stats.underrun_s.
    recorded, result = _play_through_alsa(tmp_path, x)
    nz = np.flatnonzero(recorded)
    span = recorded[nz[0] : nz[-1] + 1]
    assert np.array_equal(span[span != 0], k)
    assert np.array_equal(span[: 2 * FRAME], k[: 2 * FRAME])  # the pre-roll is contiguous
    stats = result["stats"]
    assert stats["preroll_s"] == pytest.approx(2 * FRAME_S)
    assert np.count_nonzero(span == 0) == round(stats["underrun_s"] * SR)
    assert stats["played_s"] == pytest.approx(n / SR)


# -- devices connected while the app runs ---------------------------------------------


class RestartableSD(FakeSD):
    """A fake whose device list changes only when PortAudio restarts, as the real one's."""

    def __init__(self) -> None:
        super().__init__()
        self.plugged_in = [*self.devices, {"name": "AirPods", "max_output_channels": 2}]
        self.restarts = 0

    def _terminate(self) -> None:
        self.restarts += 1

    def _initialize(self) -> None:
        self.devices, self.default_output = self.plugged_in, len(self.plugged_in) - 1


def test_refresh_output_devices_sees_a_device_connected_since_start():
    sd = RestartableSD()
    with pytest.raises(AudioOutputError, match="AirPods"):
        AudioPlayer(SR, device="AirPods", sd=sd)
    devices = refresh_output_devices(sd)
    assert sd.restarts == 1
    assert [d["name"] for d in devices if d["default"]] == ["AirPods"]
    p = AudioPlayer(SR, device="AirPods", sd=sd)
    assert p.device == len(sd.devices) - 1
    p.stop()


def test_refresh_output_devices_right_after_a_stop_waits_for_the_close():
    """Stop, headphones plugged in, refresh: Playback.stop() returns before PortAudio has
    closed the stream, and the refresh was refused as if audio were still playing."""
    sd = RestartableSD()
    p = AudioPlayer(SR, sd=sd, clock=sd.clock)
    for i in range(50):
        p.feed(frame(i))
        sd.clock.advance(0.001)
    assert p.started
    _slow_to_close(sd.streams[0], 0.3)
    p.stop(wait=False)
    assert not sd.streams[0].closed
    devices = refresh_output_devices(sd)
    assert sd.restarts == 1 and sd.streams[0].closed
    assert [d["name"] for d in devices if d["default"]] == ["AirPods"]


def test_refresh_output_devices_is_refused_while_a_player_is_open():
    sd = RestartableSD()
    p = AudioPlayer(SR, sd=sd)  # a restart would end its stream
    with pytest.raises(UsageError, match="playing"):
        refresh_output_devices(sd)
    assert sd.restarts == 0
    p.stop()
    refresh_output_devices(sd)
    assert sd.restarts == 1


def test_listing_devices_waits_for_a_restart_in_another_thread():
    """Queried mid-restart, PortAudio reads freed device tables: a listing waits for it."""
    sd = RestartableSD()
    in_restart, release = threading.Event(), threading.Event()

    def slow_initialize() -> None:
        in_restart.set()
        release.wait(5)
        RestartableSD._initialize(sd)

    sd._initialize = slow_initialize
    restart = threading.Thread(target=refresh_output_devices, args=(sd,))
    restart.start()
    assert in_restart.wait(5)
    listed: list[list[str]] = []
    lister = threading.Thread(
        target=lambda: listed.append([d["name"] for d in list_output_devices(sd)])
    )
    lister.start()
    lister.join(0.3)
    assert lister.is_alive() and not listed  # waiting, not reading the half-restarted list
    release.set()
    restart.join(5)
    lister.join(5)
    assert listed and "AirPods" in listed[0]


def test_refresh_output_devices_needs_a_sounddevice_that_can_restart():
    with pytest.raises(AudioOutputError, match="restart the app"):
        refresh_output_devices(FakeSD())


_HOTPLUG_SCRIPT = r"""
import json, sys
try:
    import sounddevice
except OSError as e:  # no libportaudio
    print(json.dumps({"skip": str(e)}))
    sys.exit(77)
from voxtral_mlx.audio.player import AudioPlayer, list_output_devices, refresh_output_devices

conf = sys.argv[1]
before = [d["name"] for d in list_output_devices()]
with open(conf, "a") as f:  # headphones plugged in
    f.write("\npcm.voxtral_headphones {\n    type null\n}\n")
stale = [d["name"] for d in list_output_devices()]
after = [d["name"] for d in refresh_output_devices()]
player = AudioPlayer(24000, device="voxtral_headphones")
player.stop()
print(json.dumps({"before": before, "stale": stale, "after": after}))
"""


def test_real_portaudio_refresh_sees_a_new_device(tmp_path):
    result = _run_with_alsa(tmp_path, _HOTPLUG_SCRIPT, "@CONF@", tmp_path / "r.raw")
    assert "voxtral_record" in result["before"]
    assert "voxtral_headphones" not in result["before"] + result["stale"]
    assert "voxtral_headphones" in result["after"]
