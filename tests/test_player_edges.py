"""Live playback under adverse conditions: a device that fails mid-stream, Ctrl-C and
SIGTERM landing at awkward moments, say()'s handle used from several threads, and the
last samples of a one-frame utterance reaching a real (ALSA file) output device."""

from __future__ import annotations

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
import soundfile as sf
from test_cli import _alsa_env, _portaudio_available, one_line_error, run
from test_player import SR, FakeSD, frame, make_player

from voxtral_mlx import cli
from voxtral_mlx.audio.io import float_to_int16
from voxtral_mlx.audio.player import AudioPlayer
from voxtral_mlx.engine import Timings
from voxtral_mlx.errors import AudioOutputError

# -- a device that fails while playing -------------------------------------------------


def _started_player(**kwargs: Any):
    p, sd = make_player(**kwargs)
    p.feed(frame(0))
    sd.clock.advance(0.01)
    p.feed(frame(1))
    assert p.started
    return p, sd


def test_device_gone_mid_stream_fails_the_next_feed():
    """Unplugged headphones must stop the run at once, not after the whole text has been
    generated into a dead stream."""
    p, sd = _started_player()
    s = sd.streams[0]
    s.pump()
    s.end_by_host()
    with pytest.raises(AudioOutputError, match="ended unexpectedly") as e:
        p.feed(frame(2))
    assert "\n" not in str(e.value)


def test_device_that_stops_calling_back_fails_the_next_feed():
    p, sd = _started_player()
    sd.streams[0].pump()
    sd.clock.advance(5.0)  # no callback for 5 s: the device is gone
    with pytest.raises(AudioOutputError, match="stopped taking audio"):
        p.feed(frame(2))


def test_feeding_a_live_stream_after_a_long_generation_pause_is_fine():
    p, sd = _started_player()
    s = sd.streams[0]
    for _ in range(40):  # 4 s of silence while the next segment is prefilled
        s.pump()
        sd.clock.advance(0.1)
    p.feed(frame(2))
    assert np.array_equal(s.pump(), frame(2))
    assert p.stats.underruns == 1


class _AbortingSD(FakeSD):
    class CallbackAbort(Exception):
        pass


def test_error_inside_the_callback_is_silenced_and_reported_once(capsys):
    sd = _AbortingSD()
    p = AudioPlayer(SR, sd=sd, clock=sd.clock)
    p.feed(frame(0))
    sd.clock.advance(0.01)
    p.feed(frame(1))
    s = sd.streams[0]

    def broken(out: np.ndarray, frames: int) -> int:
        out[:10] = 0.5  # partly written when it fails
        raise RuntimeError("device vanished")

    p._pop_into = broken  # type: ignore[method-assign]
    out = np.full((s.blocksize, 1), np.nan, np.float32)
    ti = SimpleNamespace(currentTime=0.0, outputBufferDacTime=0.0)
    with pytest.raises(_AbortingSD.CallbackAbort):  # PortAudio aborts the stream
        s.callback(out, s.blocksize, ti, None)
    assert not out.any()  # silence, not half a block of stale data
    with pytest.raises(AudioOutputError, match=r"RuntimeError: device vanished") as e:
        p.feed(frame(2))
    assert "\n" not in str(e.value)
    assert capsys.readouterr() == ("", "")  # the library prints nothing


def test_callback_error_without_callback_abort_still_ends_finish():
    p, sd = _started_player()
    s = sd.streams[0]

    def broken(out: np.ndarray, frames: int) -> int:
        raise ValueError("bad buffer")

    p._pop_into = broken  # type: ignore[method-assign]
    assert not s.pump().any()
    with pytest.raises(AudioOutputError, match="bad buffer"):
        p.finish()
    assert s.closed


_STOP_IN_A_SIGNAL_HANDLER = """
import random, signal, sys, time
import numpy as np
from voxtral_mlx.audio.player import AudioPlayer

class Stream:
    latency = 0.05
    def __init__(self, **kwargs): pass
    def start(self): pass
    def abort(self): pass
    def close(self): pass

class SD:
    PortAudioError = OSError
    OutputStream = Stream
    def query_devices(self, kind=None):
        d = {"name": "fake", "index": 0, "max_output_channels": 2}
        return d if kind else [d]

current = [None]
signal.signal(signal.SIGALRM, lambda *a: current[0].stop())
end, n = time.monotonic() + 1.5, 0
while time.monotonic() < end:
    # The fake device never takes audio: feed() waits for room until stop() ends it.
    current[0] = AudioPlayer(24000, sd=SD(), clock=lambda: 0.0, max_buffer_s=0.01)
    signal.setitimer(signal.ITIMER_REAL, 1e-6 + random.random() * 3e-4)
    current[0].feed(np.zeros(2400, np.float32))
    n += 1
print(n)
"""


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs signal.setitimer")
def test_stop_from_a_signal_handler_interrupting_a_wait_returns():
    """stop() is documented as safe in a signal handler; one landing while feed() waited
    for room waited for ever for the lock threading.Event holds inside its wait (this
    loop hung within 2 s every time)."""
    proc = subprocess.run(
        [sys.executable, "-c", _STOP_IN_A_SIGNAL_HANDLER],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert int(proc.stdout) > 10


# -- the CLI under Ctrl-C and SIGTERM, in process, with a model that hangs -------------


class _HangingStream:
    """One frame of audio, then a wait no signal interrupts (like a Queue.get() on macOS,
    or on Linux when the signal reaches another thread) until cancel() or ``hang_s``."""

    def __init__(self, hang_s: float) -> None:
        self.segments = ["one"]
        self.timings = SimpleNamespace(frames=0, audio_s=0.0)
        self.cancelled = threading.Event()
        self._gate = threading.Lock()
        self._gate.acquire()
        self._timer = threading.Timer(hang_s, self._release)
        self._timer.daemon = True
        self.audio = (np.arange(1920, dtype=np.float32) % 200 - 100) / 1000

    def _release(self) -> None:
        if self._gate.locked():
            self._gate.release()

    def __iter__(self):
        self._timer.start()
        self.timings.frames, self.timings.audio_s = 1, 0.08
        yield SimpleNamespace(
            audio=self.audio, is_final=False, frames=1, segment=0, ends_segment=False
        )
        self._gate.acquire()  # untimed: only the release wakes it

    def cancel(self) -> None:
        self.cancelled.set()
        self._release()


class _FakeTTS:
    sample_rate = 24000

    def __init__(self, stream: _HangingStream) -> None:
        self._stream = stream
        self.voices = SimpleNamespace(get_voice=lambda name: name)
        self.tokenizer = SimpleNamespace(encode=lambda text: [0] * 5)

    def stream(self, text: str, **kwargs: Any) -> _HangingStream:
        return self._stream

    def load_voice(self, voice: str | None = None) -> str:
        return voice or "casual_male"


def _signal_from_elsewhere(sig: int, after_s: float) -> threading.Thread:
    """Deliver ``sig`` to a thread other than the main one after ``after_s``: the main
    thread's blocked lock wait then sees no EINTR, as on macOS always."""
    park = threading.Event()
    target = threading.Thread(target=park.wait, daemon=True)
    target.start()

    def fire() -> None:
        time.sleep(after_s)
        signal.pthread_kill(target.ident, sig)
        time.sleep(0.5)
        park.set()

    t = threading.Thread(target=fire, daemon=True)
    t.start()
    return t


@pytest.fixture
def main_thread_sigint():
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals are handled on the main thread")
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="POSIX only")
@pytest.mark.parametrize(
    ("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["ctrl-c", "sigterm"]
)
def test_signal_during_a_blocked_frame_wait_is_handled_promptly(
    tmp_path, monkeypatch, capsys, main_thread_sigint, sig, code
):
    stream = _HangingStream(hang_s=4.0)
    monkeypatch.setattr(cli.speak, "load_model", lambda args: _FakeTTS(stream))
    out = tmp_path / "out.wav"
    _signal_from_elsewhere(sig, after_s=0.3)
    t0 = time.monotonic()
    assert cli.main(["speak", "-m", "fake", "-o", str(out), "Hello."]) == code
    assert time.monotonic() - t0 < 0.3 + 1.5  # the frame wait would last 4 s
    assert stream.cancelled.is_set()
    err = capsys.readouterr().err
    assert err.startswith("voxtral-mlx: error: interrupted: kept 0.1 s") and err.count("\n") == 1, (
        err
    )
    audio, sr = sf.read(out, dtype="float32")  # what was finished is kept, valid
    assert sr == 24000 and np.array_equal(float_to_int16(audio), float_to_int16(stream.audio))
    assert [p.name for p in tmp_path.iterdir()] == ["out.wav"]


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="POSIX only")
def test_a_second_ctrl_c_while_keeping_the_file_still_says_what_was_kept(
    tmp_path, monkeypatch, capsys, main_thread_sigint
):
    """An impatient user presses Ctrl-C twice: the second one lands while the first one's
    file is being finalised. The file is kept, and the message says so."""
    from voxtral_mlx.audio.io import AudioFileWriter

    stream = _HangingStream(hang_s=4.0)
    monkeypatch.setattr(cli.speak, "load_model", lambda args: _FakeTTS(stream))
    real_commit = AudioFileWriter.commit_partial

    def commit_after_a_second_ctrl_c(self):
        signal.raise_signal(signal.SIGINT)  # held back: the commit must not be cut
        return real_commit(self)

    monkeypatch.setattr(AudioFileWriter, "commit_partial", commit_after_a_second_ctrl_c)
    out = tmp_path / "out.wav"
    _signal_from_elsewhere(signal.SIGINT, after_s=0.3)
    assert cli.main(["speak", "-m", "fake", "-o", str(out), "Hello."]) == 130
    err = capsys.readouterr().err
    assert err.startswith("voxtral-mlx: error: interrupted: kept 0.1 s") and err.count("\n") == 1
    assert sf.info(out).frames == 1920
    assert [p.name for p in tmp_path.iterdir()] == ["out.wav"]


def test_ctrl_c_inside_a_file_write_keeps_the_whole_chunk(
    tmp_path, monkeypatch, capsys, main_thread_sigint
):
    """Ctrl-C landing between libsndfile's write and the writer's frame count used to make
    the kept file look cut short ("the disk may be full"), exit 1 and lose it."""
    import soundfile

    stream = _HangingStream(hang_s=4.0)
    monkeypatch.setattr(cli.speak, "load_model", lambda args: _FakeTTS(stream))
    real_write = soundfile.SoundFile.write

    def write_then_interrupt(self, data):
        real_write(self, data)
        signal.raise_signal(signal.SIGINT)  # handled as soon as this C call returns

    monkeypatch.setattr(soundfile.SoundFile, "write", write_then_interrupt)
    out = tmp_path / "out.wav"
    assert cli.main(["speak", "-m", "fake", "-o", str(out), "Hello."]) == 130
    assert "interrupted: kept 0.1 s" in capsys.readouterr().err
    assert sf.info(out).frames == 1920
    assert [p.name for p in tmp_path.iterdir()] == ["out.wav"]


def test_interrupted_command_line_exits_without_teardown(tmp_path):
    """`voxtral-mlx` (main() without argv) ends the process right after cleaning up: the
    interpreter's teardown would wait for the model's frame in flight."""
    script = tmp_path / "run.py"
    script.write_text(
        "import atexit, sys, types\n"
        "from voxtral_mlx import cli\n"
        "atexit.register(lambda: print('teardown ran', file=sys.stderr))\n"
        "def boom(args):\n"
        "    raise KeyboardInterrupt\n"
        "cli.speak.load_model = boom\n"
        "sys.argv = ['voxtral-mlx', 'speak', '-m', 'x', '-o', sys.argv[1], 'Hi.']\n"
        "sys.exit(cli.main())\n"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "o.wav")],
        capture_output=True,
        env=env,
        timeout=120,
    )
    err = proc.stderr.decode()
    assert proc.returncode == 130, err
    assert err == "voxtral-mlx: error: interrupted\n"
    assert not (tmp_path / "o.wav").exists()


# -- say()'s handle ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def endless_tts(tiny_checkpoint_noend):
    import voxtral_mlx

    tts = voxtral_mlx.load(tiny_checkpoint_noend, prefix_cache_dir=None)
    yield tts
    tts.close()


def _autoplayer():
    return make_player(autoplay=True)


def test_say_handle_stop_twice_from_another_thread_and_after_the_end(endless_tts):
    player, sd = _autoplayer()
    playback = endless_tts.say("Keep talking.", seed=0, max_frames=2000, wait=False, player=player)
    assert playback.wait(timeout=0.3) is False and not playback.done
    stoppers = [threading.Thread(target=playback.stop) for _ in range(2)]
    t0 = time.monotonic()
    for t in stoppers:
        t.start()
    for t in stoppers:
        t.join(2)
    assert playback.wait(timeout=2.0) is True
    assert time.monotonic() - t0 < 1.0 and playback.done
    assert playback.error is None
    playback.stop()  # after the end: nothing happens, nothing raises
    assert playback.wait() is True
    s = sd.streams[0]
    assert s.count("abort") == 1 and s.count("close") == 1


def test_say_handle_reports_a_device_failure(endless_tts):
    player, sd = make_player()
    playback = endless_tts.say("Keep talking.", seed=0, max_frames=2000, wait=False, player=player)
    deadline = time.monotonic() + 30
    while not player.started:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    sd.streams[0].end_by_host()
    with pytest.raises(AudioOutputError, match="ended unexpectedly"):
        playback.wait(timeout=10)
    assert playback.done
    playback.stop()


# -- the last samples reach the device --------------------------------------------------


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ALSA recording device")
def test_one_frame_utterance_is_played_to_the_last_sample(tiny_checkpoint, tmp_path):
    """A one-frame text: the stream starts at finish() and must not be cut before its end."""
    if not _portaudio_available():
        pytest.skip("PortAudio is not installed")
    import voxtral_mlx

    expected = voxtral_mlx.load(tiny_checkpoint, prefix_cache_dir=None).synthesize(
        "Hi.", "neutral_female", seed=5, max_frames=1
    )
    assert len(expected.audio) == 1920
    env, rec = _alsa_env(tmp_path)
    args = ["speak", "-m", str(tiny_checkpoint), "-v", "neutral_female", "--seed", "5"]
    proc = run(*args, "--max-frames", "1", "--no-prefix-cache", "Hi.", env=env)
    assert proc.returncode == 0, proc.stderr.decode()
    recorded = np.fromfile(rec, dtype="<i2").astype(np.int64)
    rec.unlink()
    nz = np.flatnonzero(recorded)
    # ALSA's plug converts float to int16 as floor(x * 32768): within one step of ours.
    want = np.clip(expected.audio.astype(np.float64), -1.0, 1.0) * 32768
    first = int(np.flatnonzero(np.floor(want) != 0)[0])
    start = nz[0] - first
    played = recorded[start : start + len(want)]
    assert len(played) == len(want)
    assert np.abs(played - want).max() <= 1.0
    assert not recorded[start + len(want) :].any()  # nothing after it but silence


def test_unknown_and_ambiguous_device_names_are_one_line_errors(tiny_checkpoint, tmp_path):
    if not sys.platform.startswith("linux") or not _portaudio_available():
        pytest.skip("needs PortAudio with the test ALSA configuration")
    env, _ = _alsa_env(tmp_path)
    err = one_line_error(run("speak", "-m", str(tiny_checkpoint), "-a", "voxtral", "Hi.", env=env))
    assert "ambiguous" in err and "voxtral_record" in err and "voxtral_null" in err
    err = one_line_error(run("speak", "-m", str(tiny_checkpoint), "-a", "nope", "Hi.", env=env))
    assert "'nope'" in err and "available:" in err and "voxtral_record" in err


def test_speak_feeds_a_live_segments_empty_last_chunk_to_the_player(monkeypatch, capsys):
    """END on a frame of its own leaves a segment's last chunk empty: speak must still hand
    it to the player with the horizon it implies (the audio fed: no text after it yet), or
    what came waits in the pre-roll while the text stalls."""
    feeds: list[tuple[int, float | None]] = []

    class Player:
        sample_rate = 24000

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def feed(self, audio, expected_total_s=None, more_coming=False):
            feeds.append((len(audio), expected_total_s))

        def finish(self):
            pass

        def stop(self):
            pass

    class LiveStream:
        live, text_error, ahead_s = True, None, 0.0

        def __init__(self):
            self.segments = [SimpleNamespace(spoken="word " * 20, pause_after=0.5)]
            self.timings = SimpleNamespace(audio_s=0.0, frames=0, cut_short=0)

        def __iter__(self):
            for i in range(5):
                self.timings.frames += 1
                yield SimpleNamespace(audio=frame(i), segment=0, ends_segment=False)
            yield SimpleNamespace(
                audio=np.zeros(0, np.float32), segment=0, ends_segment=True, timings=Timings()
            )

        def cancel(self):
            pass

    tts = _FakeTTS(LiveStream())
    tts.samples_per_frame = 1920
    monkeypatch.setattr(cli.speak, "load_model", lambda args: tts)
    monkeypatch.setattr("voxtral_mlx.audio.player.AudioPlayer", Player)
    assert cli.main(["speak", "-m", "fake", "--max-frames", "25", "Hello."]) == 0, (
        capsys.readouterr().err
    )
    assert [n for n, _ in feeds] == [1920] * 5 + [0]
    assert feeds[-1][1] == pytest.approx(5 * 0.08)  # was never told: 2 s guessed
