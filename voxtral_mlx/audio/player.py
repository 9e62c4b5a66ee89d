"""Live playback of audio as it is generated, over a sounddevice callback stream.

The generator feeds chunks; a PortAudio callback drains them at the device's pace. Two
things keep speech from stuttering:

* an adaptive pre-roll: the stream starts only once enough audio is buffered to play to
  the end without a gap at the generation speed measured so far (see
  :meth:`AudioPlayer.required_preroll_s`);
* the stream is never stopped and restarted on an underrun: the callback plays silence
  for the missing part and resumes as soon as data arrives, or, when generation is slower
  than real time, once enough is buffered again to play on without a gap (one pause, not
  a stutter of short ones: see :meth:`AudioPlayer.resume_need_s`) when the feeder said
  more was coming (``feed(..., more_coming=True)``; not where text is still being waited
  for).

A generator faster than real time is held back once ``max_buffer_s`` of audio waits to be
played (``feed()`` blocks), so memory stays flat however long the text is.

sounddevice is imported lazily, so importing this module never needs PortAudio.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import re
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType, TracebackType
from typing import Any

import numpy as np

from ..errors import AudioDeviceError, AudioOutputError, InputError, UsageError
from ..fileio import one_line

# Said by the command line and by tts.say() alike, so advice names both ways.
_NO_DEVICE_HINT = (
    "or write a file instead (voxtral-mlx speak -o FILE; in Python, tts.synthesize() and "
    "soundfile.write)"
)
_PICK_DEVICE = "choose another device (speak --device; device= in Python)"
_LIST_DEVICES = (
    "voxtral-mlx speak -a '?' or voxtral_mlx.audio.player.list_output_devices() lists them"
)
_POLL_S = 0.02  # how often blocking waits look at stop() and the clock
_STALL_S = 3.0  # a device whose callback stops for this long is considered gone
# ... unless a callback comes within this grace once the silence is noticed (at least
# 2 x the stream's latency): a process stopped (Ctrl-Z) and continued, or starved, sees the
# time that passed before the device's thread has run again.
_STALL_GRACE_S = 0.5
_MAX_STALL_GRACE_S = 2.0
_CLOSE_WAIT_S = 1.0  # longest a stream's abort and close may take before it is left open
_CALLBACK_LOCK_S = 0.02  # longest the audio callback waits for the buffer lock

# Pre-roll when generation is slower than real time.
PREROLL_SAFETY = 1.1  # margin on the computed deficit: the speed is an estimate
UNKNOWN_HORIZON_S = 10.0  # assumed remaining length when the total is unknown ...
MAX_UNKNOWN_PREROLL_S = 3.0  # ... and the most audio buffered for it before playing
MAX_BUFFER_S = 60.0  # audio waiting to be played at most: feed() blocks beyond it


# PortAudio restarts (refresh_output_devices) and stream openings take turns; the players
# whose stream may be open are known, as a restart would end their streams.
_PORTAUDIO_LOCK = threading.RLock()
_PLAYERS: weakref.WeakSet[AudioPlayer] = weakref.WeakSet()


_EXIT_WAIT = threading.Lock()
_exit_wait_registered = False


def _close_before_exit() -> None:
    """Make the interpreter's exit wait for streams still closing (``stop(wait=False)``):
    sounddevice's own exit handler terminates PortAudio, which must not run beside a close.
    Registered when a player is made, after sounddevice's handler (at its import), so run
    before it; not at the stop, which may itself come from an exit handler (too late to
    register one)."""
    global _exit_wait_registered
    with _EXIT_WAIT:
        if not _exit_wait_registered:
            atexit.register(_await_closing_streams)
            _exit_wait_registered = True


def _await_closing_streams() -> None:
    for player in list(_PLAYERS):
        if player._closing is not None:
            player._close_stream(abort=True)
        if player.abandoned and not player._released:
            # Unregistering sounddevice's handler from inside the exit run does not stop it
            # on Python 3.14+ (the run goes over a copy): leave it nothing to do instead, or
            # it would wait on the stream PortAudio could not close, for ever.
            sd = player._sd
            with contextlib.suppress(Exception):
                if getattr(sd, "_last_callback", None) is not None:
                    sd._last_callback = None
                if isinstance(getattr(sd, "_initialized", None), int):
                    sd._initialized = 0


def _check_alsa_config_path() -> None:
    """On Linux, ALSA_CONFIG_PATH replaces ALSA's own configuration: when none of the files
    it names exists with something in it, PortAudio's start at import aborts the whole
    process (SIGABRT, no message). Say so instead. (Files that exist but define no PCM
    device abort it too; telling those apart would mean parsing ALSA's syntax.)"""
    value = os.environ.get("ALSA_CONFIG_PATH")
    if not sys.platform.startswith("linux") or not value or "sounddevice" in sys.modules:
        return
    # As libasound reads it: entries split at ":" or " ", up to the first empty one, "~/"
    # the home folder.
    named = []
    for entry in re.split("[: ]", value):
        if not entry:
            break
        named.append(os.path.expanduser(entry) if entry.startswith("~/") else entry)
    for path in named:
        try:
            if os.path.isfile(path) and os.path.getsize(path) > 0:
                return
        except OSError:
            continue
    shown = one_line(repr(value), 400)
    raise AudioOutputError(
        f"ALSA_CONFIG_PATH={shown} names no ALSA configuration file with anything in it, "
        "and PortAudio would abort on it: point it at a configuration that defines a PCM "
        f"device or unset it (ALSA then reads the system's), {_NO_DEVICE_HINT}"
    )


def import_sounddevice() -> ModuleType:
    """Import sounddevice, turning a missing PortAudio into a one-line AudioOutputError."""
    _check_alsa_config_path()
    try:
        import sounddevice
    except OSError as e:  # sounddevice raises OSError when libportaudio cannot be loaded
        raise AudioOutputError(
            "PortAudio library not found; install it (macOS: pip install --force-reinstall "
            "sounddevice, whose wheel bundles it; Debian/Ubuntu: apt install libportaudio2) "
            f"{_NO_DEVICE_HINT}"
        ) from e
    except ImportError as e:
        if e.name not in (None, "sounddevice"):  # on macOS: its bundled PortAudio library
            raise AudioOutputError(
                f"sounddevice cannot load PortAudio ({one_line(str(e), 120)}); reinstall it: "
                f"pip install --force-reinstall sounddevice {_NO_DEVICE_HINT}"
            ) from e
        raise AudioOutputError(
            f"the sounddevice package is not installed; pip install sounddevice {_NO_DEVICE_HINT}"
        ) from e
    except Exception as e:
        # sounddevice starts PortAudio at import; a broken audio setup (an ALSA configuration
        # it cannot use, no audio service) raises its PortAudioError from there.
        if type(e).__name__ != "PortAudioError":
            raise
        raise AudioOutputError(
            f"PortAudio could not start ({one_line(str(e), 120)}); check the system's audio "
            f"setup (Linux: the ALSA configuration and ALSA_CONFIG_PATH) {_NO_DEVICE_HINT}"
        ) from e
    return sounddevice


def _portaudio_errors(sd: Any) -> tuple[type[BaseException], ...]:
    err = getattr(sd, "PortAudioError", None)
    return (err, OSError, ValueError) if isinstance(err, type) else (OSError, ValueError)


def _default_output_index(sd: Any) -> int | None:
    try:
        info = sd.query_devices(kind="output")
    except Exception:
        return None
    idx = info.get("index") if isinstance(info, dict) else None
    return int(idx) if isinstance(idx, int) and idx >= 0 else None


def _device_rate(sd: Any, device: int | None) -> str:
    """The device's own rate as an error message puts it, or "" if unknown."""
    try:
        info = sd.query_devices(kind="output") if device is None else sd.query_devices(device)
        rate = float(info["default_samplerate"])
    except Exception:
        return ""
    return f" (the device's own rate is {rate:.0f} Hz)" if rate > 0 else ""


def _stream_channels(device: int | None, sd: Any) -> int:
    """Channels to open on ``device`` (None: the default output): 2 for a Core Audio device
    with two outputs or more, both then carrying the mono signal, else 1.

    Core Audio can route a one-channel stream to a device's first output alone (reported
    for audio interfaces with more than two outputs, and for some headphones): the voice
    would come from the left only. Elsewhere the host API or the sound server spreads
    mono over the speakers itself.
    """
    try:
        info = sd.query_devices(device, kind="output")
        api = sd.query_hostapis(int(info["hostapi"]))["name"]
        outputs = int(info["max_output_channels"])
    except (*_portaudio_errors(sd), LookupError, TypeError, AttributeError):
        return 1  # the device cannot be described: open it as before, mono
    return 2 if api == "Core Audio" and outputs >= 2 else 1


def list_output_devices(sd: Any = None) -> list[dict[str, Any]]:
    """Output devices as ``{"index", "name", "channels", "default"}`` dicts."""
    sd = sd if sd is not None else import_sounddevice()
    with _PORTAUDIO_LOCK:  # not while refresh_output_devices() restarts PortAudio
        try:
            devices = list(sd.query_devices())
        except _portaudio_errors(sd) as e:
            raise AudioOutputError(f"cannot list audio devices: {e}; {_NO_DEVICE_HINT[3:]}") from e
        default = _default_output_index(sd)
    out = []
    for i, d in enumerate(devices):
        channels = int(d.get("max_output_channels", 0))
        if channels <= 0:
            continue
        index = int(d.get("index", i))
        name = str(d["name"])
        out.append(
            {"index": index, "name": name, "channels": channels, "default": index == default}
        )
    return out


def refresh_output_devices(sd: Any = None) -> list[dict[str, Any]]:
    """Re-read the output devices and the default output; returns them as
    :func:`list_output_devices` does.

    PortAudio lists the devices once, when it starts (at ``import sounddevice``): headphones
    connected or removed since, or another default output chosen in System Settings, are not
    seen by later players until it restarts. This restarts it: call it when the system says
    the devices changed (on macOS, e.g. an ``AVAudioEngineConfigurationChange`` or
    Core Audio's ``kAudioHardwarePropertyDevices`` notification), or before a ``say()`` after
    a long idle. The restart ends every PortAudio stream of the process, so it is refused
    (:class:`~voxtral_mlx.errors.UsageError`) while one of this library's players is open;
    an app that plays or records through sounddevice itself must close those streams first.
    """
    sd = sd if sd is not None else import_sounddevice()
    terminate, initialize = getattr(sd, "_terminate", None), getattr(sd, "_initialize", None)
    if not (callable(terminate) and callable(initialize)):
        raise AudioOutputError(
            f"this sounddevice ({getattr(sd, '__version__', 'unknown version')}) cannot "
            "restart PortAudio; restart the app to see new audio devices"
        )
    for player in list(_PLAYERS):  # stopped without waiting (Playback.stop()): let it close
        if player._sd is sd and player._closing is not None:
            player._close_stream(abort=True)
    with _PORTAUDIO_LOCK:
        if any(p._sd is sd and p.abandoned and not p._released for p in list(_PLAYERS)):
            raise UsageError(
                "cannot re-read the audio devices: an audio device stopped responding and "
                "its stream could not be closed; restart the app"
            )
        if any(p._sd is sd and not p._released for p in list(_PLAYERS)):
            raise UsageError(
                "cannot re-read the audio devices while audio is playing: stop() the "
                "playback or wait() for it first"
            )
        try:
            terminate()
        except _portaudio_errors(sd) as e:
            raise AudioOutputError(f"cannot restart PortAudio ({e}); restart the app") from e
        try:
            initialize()
        except _portaudio_errors(sd) as e:
            raise AudioOutputError(
                f"PortAudio did not start again ({e}); restart the app {_NO_DEVICE_HINT}"
            ) from e
        return list_output_devices(sd)


def prepare_output(sample_rate: int = 24000, sd: Any = None) -> int | None:
    """Start PortAudio (importing sounddevice initialises it: 0.05-0.2 s, longer with many
    devices), find the default output device and open it once without playing (a host API's
    first stream costs more than the next), so that the first player opens at once.
    Returns the device's index; a one-line AudioOutputError when there is none or it cannot
    be opened."""
    player = AudioPlayer(sample_rate, sd=sd)
    player.stop()
    return player.device


def no_output_device_error() -> AudioOutputError:
    return AudioOutputError(f"no audio output device found; connect one {_NO_DEVICE_HINT}")


def _describe(devices: list[dict[str, Any]]) -> str:
    if not devices:
        return "none"
    return ", ".join(f"{d['index']} {d['name']!r}" for d in devices)


def resolve_device(spec: str | int | None, sd: Any = None) -> int | None:
    """Turn a device spec into a PortAudio index (None = the default output).

    ``spec`` is an index (int or digits) or a case-insensitive substring of the device
    name; an exact name wins over substring matches. Raises AudioOutputError (one line,
    listing the output devices) when nothing or more than one device matches, or when
    there is no output device at all.
    """
    if spec is not None and (
        isinstance(spec, bool) or not isinstance(spec, (str, int, np.integer))
    ):
        raise InputError(
            f"device must be an output device's name or index, got {type(spec).__name__} "
            f"{spec!r}: pass e.g. 'MacBook Pro Speakers' or 2 ({_LIST_DEVICES})"
        )
    devices = list_output_devices(sd)
    if not devices:
        raise no_output_device_error()
    if spec is None or (isinstance(spec, str) and not spec.strip()):
        if not any(d["default"] for d in devices):
            raise AudioOutputError(
                "no default audio output device; pick one (speak --device; device= in "
                f"Python; available: {_describe(devices)}) {_NO_DEVICE_HINT}"
            )
        return None
    text = str(spec).strip()
    if isinstance(spec, int) or re.fullmatch(r"-?[0-9]+", text):  # not "²", nor "--2"
        idx = int(text)
        if any(d["index"] == idx for d in devices):
            return idx
        raise AudioOutputError(
            f"no audio output device with index {idx}; available: {_describe(devices)}"
        )
    needle = text.casefold()
    exact = [d for d in devices if d["name"].casefold() == needle]
    matches = exact or [d for d in devices if needle in d["name"].casefold()]
    if len(matches) == 1:
        return int(matches[0]["index"])
    if not matches:
        raise AudioOutputError(
            f"no audio output device matches {text!r}; available: {_describe(devices)}"
        )
    raise AudioOutputError(
        f"audio output device {text!r} is ambiguous: it matches {_describe(matches)}; "
        "give more of the name or the index"
    )


@dataclass
class PlaybackStats:
    """What happened during playback. Times are in the player's clock (time.monotonic)."""

    started_at: float | None = None  # when the stream was started
    first_audio_at: float | None = None  # when the first real sample reached the DAC
    # gaps inside the audio (trailing silence at the end is not one, nor silence while
    # feed() said no audio was on its way until more input arrived)
    underruns: int = 0
    underrun_s: float = 0.0  # total silence played inside those gaps
    played_s: float = 0.0  # real audio handed to the device
    preroll_s: float = 0.0  # audio buffered when the stream started
    generation_speed: float | None = None  # audio s per wall s when the stream started
    device_xruns: int = 0  # callbacks PortAudio flagged as output underflow (late callback)


class _StopFlag:
    """``threading.Event``'s ``set``/``is_set``/``wait`` without its lock, which a blocking
    wait holds for moments: ``stop()`` from a signal handler that interrupted such a wait on
    the same thread would wait for that lock forever. Waits poll (``timeout`` <= a poll)."""

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float) -> bool:
        if not self._set:
            time.sleep(timeout)
        return self._set


class AudioPlayer:
    """Plays fed audio through a sounddevice OutputStream with an adaptive jitter buffer.

    ``feed()`` from the generating thread, then ``finish()`` to play out the end (or use
    it as a context manager: a normal exit finishes, an exception stops). ``stop()`` may
    be called from any thread or a signal handler and silences output within one poll.
    The audio is mono; on a Core Audio device with two outputs or more it is played on
    both (``channels`` is then 2). ``abandoned`` is True once a stream PortAudio could not
    close within a second (a device that hangs) was left to it.
    """

    def __init__(
        self,
        sample_rate: int = 24000,
        device: str | int | None = None,
        blocksize: int = 1920,
        *,
        sd: Any = None,
        clock: Callable[[], float] = time.monotonic,
        min_preroll_s: float = 0.16,
        latency: float | str | None = None,
        max_buffer_s: float = MAX_BUFFER_S,
    ) -> None:
        self._sd = sd if sd is not None else import_sounddevice()
        _close_before_exit()
        self.sample_rate = int(sample_rate)
        self.blocksize = int(blocksize)
        self.min_preroll_s = float(min_preroll_s)
        self.max_buffer_s = float(max_buffer_s)
        self._clock = clock
        self.stats = PlaybackStats()

        # Buffer state, shared with the callback thread. RLock: stop() may run in a
        # signal handler on a thread that already holds it.
        self._lock = threading.RLock()
        self._chunks: deque[np.ndarray] = deque()
        self._head = 0  # read position in self._chunks[0]
        self._buffered = 0  # samples fed and not yet handed to the device
        self._fed = 0
        self._played = 0
        self._first_feed_at: float | None = None
        self._first_chunk = 0
        self._expected_total_s: float | None = None
        self._eof = False
        self._gap = 0  # silence samples played since the buffer ran dry
        self._refilling = False  # ran dry: silence until resume_need_s() is buffered
        self._paused = False  # pause(): silence, the buffered audio kept, until resume()
        # The latest feed's word: more audio on its way (True), none until more input
        # arrives (False), or not said (None).
        self._more_coming: bool | None = None
        self._missed = 0  # silence played because the lock was busy
        self._last_end_at: float | None = None  # when the latest real sample leaves the DAC
        self._last_sample_at: float | None = None  # same, for the very last sample
        self._last_callback_at: float | None = None
        self._callbacks = 0  # callbacks run, counted even when the lock was busy
        self._callback_error: Exception | None = None

        self._started = False
        self._closed = False
        self._closing: threading.Event | None = None  # set once PortAudio has closed it
        self._released = False  # PortAudio is done with the stream: it is closed
        # The stream could not be closed in time (a device that hangs) and was left open.
        self.abandoned = False
        self._stream_lock = threading.RLock()
        self._stopped = _StopFlag()
        self._drained = threading.Event()  # the callback has handed out the last sample
        self._finished = threading.Event()  # PortAudio says the stream has ended

        with _PORTAUDIO_LOCK:  # not while refresh_output_devices() restarts PortAudio
            self.device = resolve_device(device, self._sd)
            self.channels = _stream_channels(self.device, self._sd)
            self._stream = self._open(latency)
            _PLAYERS.add(self)
        lat = getattr(self._stream, "latency", 0.0)
        self._latency = float(lat) if isinstance(lat, (int, float)) else 0.0

    def _open(self, latency: float | str | None) -> Any:
        kwargs: dict[str, Any] = {
            "samplerate": self.sample_rate,
            "blocksize": self.blocksize,
            "device": self.device,
            "channels": self.channels,
            "dtype": "float32",
            "callback": self._callback,
            "finished_callback": self._finished.set,
            # A device that takes no float32 gets PortAudio's conversion: undithered, the
            # samples are the ones generated (dithered, about half were 1 LSB off).
            "dither_off": True,
        }
        if latency is not None:
            kwargs["latency"] = latency
        try:
            return self._sd.OutputStream(**kwargs)
        except _portaudio_errors(self._sd) as e:
            rate = ""
            if "sample rate" in str(e).lower():  # e.g. an ALSA hw: device fixed at 48 kHz
                rate = f" at {self.sample_rate} Hz{_device_rate(self._sd, self.device)}"
            raise AudioOutputError(
                f"cannot open audio output{rate} ({e}); {_PICK_DEVICE} {_NO_DEVICE_HINT}"
            ) from e

    # -- measurements ---------------------------------------------------------------

    @property
    def buffered_s(self) -> float:
        return self._buffered / self.sample_rate

    @property
    def started(self) -> bool:
        return self._started

    def generation_speed(self, now: float | None = None) -> float | None:
        """Audio seconds produced per wall second since the first feed (None: one feed yet).

        The first chunk is left out of the numerator: it was produced before the first
        feed, whose time starts the measurement.
        """
        if self._first_feed_at is None or self._fed == self._first_chunk:
            return None
        elapsed = (self._clock() if now is None else now) - self._first_feed_at
        produced = (self._fed - self._first_chunk) / self.sample_rate
        return math.inf if elapsed <= 0 else produced / elapsed

    def required_preroll_s(self, now: float | None = None) -> float:
        """Audio to buffer before starting so playback can reach the end without a gap.

        With r = :meth:`generation_speed` and B the buffered audio at start, playback at
        real time needs B + r·t ≥ t for every t up to the end, i.e. B ≥ (1 − r)·E for a
        remaining length E. Hence:

        * r unknown (only one feed so far): wait for a second feed (inf), unless the
          expected total is already buffered;
        * r ≥ 1: ``min_preroll_s`` (covers jitter in chunk arrival);
        * r < 1, ``expected_total_s`` known: ``min_preroll_s + 1.1·(1 − r)·E`` with E the
          expected total (never more than E itself: everything buffered always starts);
        * r < 1, total unknown: as if ``E = 10 s``, capped at 3 s: a bounded wait that
          smooths short utterances; longer ones may underrun later (counted in stats).

        ``finish()`` starts playback whatever is buffered.
        """
        speed = self.generation_speed(now)
        total = self._expected_total_s
        fed_s = self._fed / self.sample_rate
        if total is not None:
            total = max(total, fed_s)
        if speed is None:
            need = math.inf
        elif speed >= 1.0:
            need = self.min_preroll_s
        elif total is not None:
            need = self.min_preroll_s + PREROLL_SAFETY * (1.0 - speed) * total
        else:
            need = min(
                MAX_UNKNOWN_PREROLL_S,
                self.min_preroll_s + PREROLL_SAFETY * (1.0 - speed) * UNKNOWN_HORIZON_S,
            )
        if total is not None:
            need = min(need, total)
        return need

    def resume_need_s(self, now: float | None = None) -> float:
        """Audio to buffer again after the buffer ran dry mid-audio before playing on.

        Generation at least as fast as real time (or unmeasured): none, the gap was a
        hiccup. Slower: as :meth:`required_preroll_s` for what is still to play (the
        expected total less what was played), or, when that guess is used up (the speech
        runs longer than the text suggested), as for an unknown total: at most
        ``MAX_UNKNOWN_PREROLL_S``. Never more than ``max_buffer_s``, where ``feed()`` holds
        the generator."""
        speed = self.generation_speed(now)
        if speed is None or speed >= 1.0:
            return 0.0
        played_s = self._played / self.sample_rate
        total = self._expected_total_s
        # (1e-9: the expected total all buffered, in float sums, is the guess used up.)
        if total is not None and total > played_s + self.buffered_s + 1e-9:
            left = total - played_s
            need = min(left, self.min_preroll_s + PREROLL_SAFETY * (1.0 - speed) * left)
        else:
            need = min(
                MAX_UNKNOWN_PREROLL_S,
                self.min_preroll_s + PREROLL_SAFETY * (1.0 - speed) * UNKNOWN_HORIZON_S,
            )
        return min(need, self.max_buffer_s)

    @property
    def played_samples(self) -> int:
        """Samples of fed audio handed to the device so far (it plays them within its
        latency)."""
        return self._played

    # -- pausing ----------------------------------------------------------------------

    def pause(self) -> None:
        """Hold the audio where it is until :meth:`resume`: the device plays silence from
        its next block on (the stream stays open, so resuming is immediate) and what was
        fed waits. ``feed()`` goes on taking audio up to ``max_buffer_s``, then blocks;
        ``finish()`` returns only once the end has played, after a resume (or a stop).
        From any thread; pausing a paused player does nothing."""
        with self._lock:
            self._paused = True

    def resume(self) -> None:
        """Play on from where :meth:`pause` held the audio (from any thread)."""
        with self._lock:
            self._paused = False

    @property
    def paused(self) -> bool:
        return self._paused

    # -- producer side --------------------------------------------------------------

    def feed(
        self,
        chunk: np.ndarray,
        *,
        expected_total_s: float | None = None,
        more_coming: bool | None = None,
    ) -> None:
        """Queue audio for playback; starts the stream once the pre-roll is buffered.

        ``expected_total_s`` (the whole utterance's expected length, if known) sharpens
        the pre-roll when generation is slower than real time; the latest value wins.
        ``more_coming``: more audio is on its way after this (not text still being
        written that has gone no further): if the buffer runs dry meanwhile, generation
        is too slow, and playback waits to refill (:meth:`resume_need_s`) rather than
        playing each chunk as it comes. Without it, the next audio plays as it comes;
        ``False`` says that none is on its way until more input arrives (text still being
        written), so silence meanwhile is not counted as an underrun.
        Feeding after ``stop()`` is a no-op (the generator may still be running). Blocks
        while more than ``max_buffer_s`` of audio waits to be played (the stream starts
        then, whatever the pre-roll): a long text must not pile up in memory.
        """
        if self._stopped.is_set():
            return
        if self._eof:
            raise RuntimeError("AudioPlayer.feed() called after finish()")
        # Out-of-range floats are clipped here: devices differ on what they do with them
        # (ALSA's float-to-int16 conversion wraps around); NaN, which clipping keeps, is
        # silence, as float_to_int16 writes it to files.
        a = np.array(chunk, dtype=np.float32, copy=True).reshape(-1)
        a = np.clip(np.nan_to_num(a, copy=False, nan=0.0), -1.0, 1.0)
        now = self._clock()
        with self._lock:
            if self._stopped.is_set():  # stop() came since the check above: it emptied the
                return  # buffer, which must stay empty
            if expected_total_s is not None:
                self._expected_total_s = float(expected_total_s)
            self._more_coming = None if more_coming is None else bool(more_coming)
            if not more_coming:  # nothing known to follow (text still being written): what
                self._refilling = False  # is buffered plays now, not after the next text
            if a.size:
                if self._first_feed_at is None:
                    self._first_feed_at = now
                    self._first_chunk = a.size
                self._chunks.append(a)
                self._buffered += a.size
                self._fed += a.size
            start = not self._started and self._buffered > 0
            start = start and (
                self.buffered_s >= min(self.required_preroll_s(now), self.max_buffer_s) - 1e-9
            )
        if start:
            self._start(now)
        elif self._started:
            # A device that went away must not go unnoticed until finish(), after the
            # whole text has been generated into silence.
            self._check_alive()
        self._wait_for_room()

    def _wait_for_room(self) -> None:
        limit = round(self.max_buffer_s * self.sample_rate)
        while self._started and self._buffered > limit and not self._stopped.is_set():
            self._stopped.wait(_POLL_S)
            self._check_alive()

    def _start(self, now: float | None = None) -> None:
        with self._stream_lock:
            if self._started or self._closed or self._stopped.is_set():
                return
            with self._lock:
                self._started = True
                t = self._clock()
                self.stats.started_at = t
                self.stats.preroll_s = self.buffered_s
                self.stats.generation_speed = self.generation_speed(now)
                self._last_callback_at = t
            try:
                self._stream.start()
            except _portaudio_errors(self._sd) as e:
                self._close_stream(abort=True)
                raise AudioOutputError(
                    f"cannot start audio output ({e}); {_PICK_DEVICE} {_NO_DEVICE_HINT}"
                ) from e

    # -- device side (PortAudio's thread) -------------------------------------------

    def _dac_delay(self, time_info: Any) -> float:
        """Seconds from now until this block's first sample leaves the DAC."""
        try:
            now = float(time_info.currentTime)
            dac = float(time_info.outputBufferDacTime)
        except (AttributeError, TypeError, ValueError):
            return self._latency
        delay = dac - now
        if (now == 0.0 and dac == 0.0) or not 0.0 <= delay < 10.0:
            return self._latency  # host API gives no timing: fall back on its latency
        return delay

    def _callback(self, outdata: np.ndarray, frames: int, time_info: Any, status: Any) -> None:
        self._callbacks += 1
        try:
            self._fill(outdata, frames, time_info, status)
        except Exception as e:
            # Raised out of here, it would be printed by cffi on every block while the
            # device plays whatever was left in the buffer: silence it and report it once.
            outdata.fill(0)
            if self._callback_error is None:
                self._callback_error = e
            abort = getattr(self._sd, "CallbackAbort", None)
            if isinstance(abort, type) and issubclass(abort, BaseException):
                raise abort from e

    def _fill(self, outdata: np.ndarray, frames: int, time_info: Any, status: Any) -> None:
        now = self._clock()
        out = outdata[:, 0]
        # Bounded wait: if stop() runs in a signal handler that interrupted feed() while
        # it held the lock, abort() waits for this callback, which must not wait forever.
        if not self._lock.acquire(timeout=_CALLBACK_LOCK_S):
            outdata.fill(0)
            self._missed += frames  # written by this thread only; folded in below
            return
        try:
            self._last_callback_at = now
            if self._missed:
                if not self._paused:  # silence while paused is no gap
                    self._gap += self._missed
                self._missed = 0
            if status and getattr(status, "output_underflow", False):
                self.stats.device_xruns += 1
            if self._stopped.is_set() or self._paused:
                outdata.fill(0)
                return
            if self._refilling and not self._eof:
                if self._buffered < self.resume_need_s(now) * self.sample_rate:
                    outdata.fill(0)
                    self._gap += frames
                    return
                self._refilling = False
            n = self._pop_into(out, frames)
            if n < frames:
                outdata[n:] = 0
            if n and outdata.shape[1] > 1:
                outdata[:n, 1:] = outdata[:n, :1]
            delay = self._dac_delay(time_info)
            sr = self.sample_rate
            if n:
                if self.stats.first_audio_at is None:
                    self.stats.first_audio_at = now + delay
                if self._gap:
                    self.stats.underruns += 1
                    self.stats.underrun_s += self._gap / sr
                    self._gap = 0
                self._played += n
                self.stats.played_s = self._played / sr
                self._last_end_at = now + delay + n / sr
            if self._eof:
                # No CallbackStop at the end: CoreAudio's PortAudio answers it by stopping
                # the audio unit at once, which can cut the last block. The stream plays
                # silence instead until finish() has waited out the DAC time and aborts.
                if self._buffered == 0 and not self._drained.is_set():
                    self._last_sample_at = (
                        self._last_end_at if self._last_end_at is not None else now + delay
                    )
                    self._gap = 0
                    self._drained.set()
                return
            if n < frames:
                if self._more_coming is not False:  # not waiting for input: an underrun
                    self._gap += frames - n
                self._refilling = bool(self._more_coming)
        finally:
            self._lock.release()

    def _pop_into(self, out: np.ndarray, frames: int) -> int:
        n = 0
        while n < frames and self._chunks:
            head = self._chunks[0]
            take = min(frames - n, head.size - self._head)
            out[n : n + take] = head[self._head : self._head + take]
            n += take
            self._head += take
            if self._head == head.size:
                self._chunks.popleft()
                self._head = 0
        self._buffered -= n
        return n

    # -- ending ---------------------------------------------------------------------

    def finish(self) -> None:
        """Mark the end of input, play everything out, then close the stream.

        Starts the stream if the pre-roll was never reached (short utterances). Returns
        once the callback has handed out the last sample and the clock has passed the
        time that sample leaves the DAC: PortAudio's ``outputBufferDacTime`` for its
        block (``stream.latency`` where the host API gives no timing) plus its offset in
        the block, plus one block for PortAudio's adaptation of our block size to the
        host's buffers. After ``stop()``, returns once the stream is closed (at once but
        after a ``stop(wait=False)`` whose close is under way). KeyboardInterrupt (or any
        exception) while waiting stops playback and propagates.
        """
        try:
            with self._lock:
                ended = self._closed or self._stopped.is_set()
                if not ended:
                    self._eof = True
                    if self._buffered == 0:
                        self._gap = 0  # silence after the last sample is not a gap
                nothing = self._buffered == 0 and not self._started
            if ended:  # by stop(wait=False), perhaps: its close may still be under way
                self._close_stream(abort=True)
                return
            if nothing:
                self._close_stream(abort=False)
                return
            self._start()
            self._wait_drained()
            self._wait_until_played()
            # Only silence is left in the host's buffers: no need to wait for it.
            self._close_stream(abort=True)
        except BaseException:
            self.stop()
            raise

    def _check_alive(self) -> None:
        fix = f"check the output device {_NO_DEVICE_HINT}"
        if self._callback_error is not None and not self._stopped.is_set():
            e = self._callback_error
            raise AudioDeviceError(f"audio output failed ({type(e).__name__}: {e})", fix) from e
        if self._finished.is_set() and not self._stopped.is_set():
            raise AudioDeviceError("the audio stream ended unexpectedly", fix)
        last = self._last_callback_at
        limit = max(_STALL_S, 4 * self._latency)
        if last is not None and self._clock() - last > limit and not self._calls_back_soon():
            raise AudioDeviceError(
                f"the audio device stopped taking audio (no callback for {limit:.3g} s)", fix
            )

    def _calls_back_soon(self) -> bool:
        """Whether the device calls back (or stop() comes) within a short grace, in real
        time: after ``fg`` a stopped process's threads all run again, and the one checking
        may run before PortAudio's, having seen the whole suspension pass without a
        callback. A device that is gone stays silent through the grace too."""
        seen = self._callbacks
        grace = min(_MAX_STALL_GRACE_S, max(_STALL_GRACE_S, 2 * self._latency))
        deadline = time.monotonic() + grace
        while self._callbacks == seen and not self._stopped.is_set():
            if time.monotonic() >= deadline:
                return False
            self._stopped.wait(_POLL_S)
        return True

    def _wait_drained(self) -> None:
        while not self._drained.wait(_POLL_S):
            if self._stopped.is_set():
                return
            self._check_alive()

    def _wait_until_played(self) -> None:
        if self._stopped.is_set() or self._last_sample_at is None:
            return
        end = self._last_sample_at + self.blocksize / self.sample_rate
        while (remaining := end - self._clock()) > 0:
            if self._stopped.wait(min(remaining, _POLL_S)):
                return
            self._check_alive()

    def stop(self, *, wait: bool = True) -> None:
        """Silence output now: abort the stream, drop buffered audio, close.

        Safe from any thread, from a signal handler, and more than once. PortAudio's abort
        and close take a few hundred ms on some hosts: ``wait=False`` returns once they are
        under way (a UI thread's Stop button), and a later ``stop()`` or ``finish()``,
        :func:`refresh_output_devices` or the interpreter's exit waits for them.
        """
        self._stopped.set()
        with self._lock:
            self._chunks.clear()
            self._head = 0
            self._buffered = 0
        self._close_stream(abort=True, wait=wait)

    def _close_stream(self, *, abort: bool, wait: bool = True) -> None:
        with self._stream_lock:
            if not self._closed:
                self._closed = True
                self._closing = threading.Event()
                threading.Thread(
                    target=self._end_stream,
                    args=(abort and self._started, self._closing),
                    name="voxtral-mlx-audio-close",
                    daemon=True,
                ).start()
            closing = self._closing
        if not wait:
            return
        if closing is None or self.abandoned:
            return
        # A device that stopped taking audio holds PortAudio's abort and close for as long
        # as its thread is blocked writing to it (minutes, or for ever): the stream is then
        # left to them, and stop(), finish() and Ctrl-C return.
        if not closing.wait(_CLOSE_WAIT_S):
            self.abandoned = True
            # sounddevice terminates PortAudio at exit, which would wait on this stream
            # too: the process could never end.
            handler = getattr(self._sd, "_exit_handler", None)
            if callable(handler):
                atexit.unregister(handler)

    def _end_stream(self, abort: bool, closed: threading.Event) -> None:
        # Closing anyway: an error on the way out has nothing useful to report.
        if abort:
            with contextlib.suppress(Exception):
                self._stream.abort()
        with contextlib.suppress(Exception):
            self._stream.close()
        self._released = True  # only now may refresh_output_devices() restart PortAudio
        closed.set()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> AudioPlayer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.finish()
        else:
            self.stop()
