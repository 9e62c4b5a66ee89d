"""``voxtral-mlx``: speak text like macOS ``say``, list voices, convert files.

The only module that prints. Errors are one line on stderr and a non-zero exit code:
1 for bad input or environment, 130 when interrupted (143 / 129 for SIGTERM / SIGHUP);
``serve`` exits 0 on Ctrl-C, the way it is meant to stop.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import queue
import re
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from .audio.horizon import PlaybackHorizon, plays
from .errors import (
    AudioDeviceError,
    AudioOutputError,
    AudioStoppedError,
    ConfigError,
    InputError,
    VoxtralError,
    is_mlx_import_error,
    mlx_import_error,
    printable,
)
from .fileio import one_line
from .interrupts import (
    FINISHED,
    Terminated,
    default_signals,
    exit_on_signals,
    held_after,
    hold_from_now,
    signals_held,
    terminable,
)
from .textinput import read_text, text_pieces, text_source

if TYPE_CHECKING:  # the engine imports MLX: not at start-up (see voxtral_mlx/entry.py)
    from .engine import AudioChunk, Timings

PROG = "voxtral-mlx"
MODEL_ENV = "VOXTRAL_MLX_MODEL"
MAX_TIMEOUT_S = 86400.0  # serve's --body-timeout and --send-timeout
SPLIT_NOTICE_CHARS = 500_000  # splitting takes ~1.7 s a million characters: say so first
T = TypeVar("T")
_STDOUT_FIX = "check the file or pipe stdout goes to (a full disk?)"


def _default_model() -> str:
    from .hub import DEFAULT_REPO

    return os.environ.get(MODEL_ENV) or DEFAULT_REPO


def _to_stderr(text: str) -> None:
    """Write to stderr if there is one: closed (``2>&-``: ``print`` would then write to
    stdout, into the audio of ``-o -``) or failing (``2>/dev/full``), messages are lost
    and the job's outcome stands."""
    if sys.stderr is None:
        return
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(text)
        sys.stderr.flush()


def _err(message: str) -> None:
    _to_stderr(f"{PROG}: error: {printable(message)}\n")


def _info(message: str) -> None:
    _to_stderr(f"{message}\n")


_POLL_S = 0.05  # longest the main thread waits in one go: signals run between waits


def _interruptibly(fn: Callable[[], T]) -> T:
    """``fn()`` on a helper thread while the main thread waits in short timed waits.

    Ctrl-C and SIGTERM are handled by the main thread between bytecodes only: blocked in
    an untimed lock wait (a Future, a Queue), it would not notice them until the model's
    worker hands something over (a whole load or frame; macOS never interrupts such a
    wait, Linux only when the signal reaches the main thread).
    """
    box: queue.Queue[tuple[bool, Any]] = queue.Queue()

    def run() -> None:
        try:
            box.put((True, fn()))
        except BaseException as e:
            box.put((False, e))

    threading.Thread(target=run, name="voxtral-mlx-cli", daemon=True).start()
    ok, value = _get(box)
    if ok:
        return value
    raise value


def _say_downloading(repo_id: str, cache: Path) -> None:
    # Also where no progress bar shows (stderr not a terminal): minutes of silence else.
    _info(f"{PROG}: downloading {repo_id} into {one_line(str(cache), 200)} (once; Ctrl-C stops it)")


def _end_download() -> None:
    """The process is interrupted: a download under way ends with it, and its partial files
    go (up to 8 GB that the next run cannot resume)."""
    from .hub import download_bars_drawn, remove_partial_downloads

    with signals_held():
        remove_partial_downloads()
        if download_bars_drawn():  # the error line goes below the bars, not over them
            _to_stderr("\n")


@contextlib.contextmanager
def _downloads_reported(args: argparse.Namespace) -> Iterator[None]:
    """While a command resolves its model: a download says that it begins (unless -q), and
    an interrupt ends it cleanly. The library's own state is left as it was."""
    from . import hub
    from .interrupts import QUICK_EXIT_CLEANUPS

    before = hub.download_started
    hub.download_started = None if getattr(args, "quiet", False) else _say_downloading
    # Commands that end at once on a signal (serve, voices) clean up in its handler.
    QUICK_EXIT_CLEANUPS.append(hub.remove_partial_downloads)
    try:
        yield
    except KeyboardInterrupt:
        _end_download()
        raise
    finally:
        QUICK_EXIT_CLEANUPS.remove(hub.remove_partial_downloads)
        hub.download_started = before


def _get(q: queue.Queue[T]) -> T:
    """``q.get()`` in timed waits, so that signals are handled while it waits."""
    while True:
        try:
            return q.get(timeout=_POLL_S)
        except queue.Empty:
            continue


class _Chunks:
    """Iterates a speech stream on a helper thread; see :func:`_interruptibly`.

    ``close()`` (or leaving its ``with`` block) cancels the stream and releases the helper.
    """

    def __init__(self, stream: Any, depth: int = 8) -> None:
        self._stream = stream
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=depth)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._pump, name="voxtral-mlx-speak", daemon=True)
        self._thread.start()

    def _put(self, item: tuple[str, Any]) -> bool:
        while not self._closed.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _pump(self) -> None:
        try:
            for chunk in self._stream:
                if not self._put(("chunk", chunk)):
                    return
        except BaseException as e:
            self._put(("error", e))
            return
        self._put(("end", None))

    def __iter__(self) -> Iterator[Any]:
        while True:
            kind, value = _get(self._queue)
            if kind == "end":
                return
            if kind == "error":
                raise value
            yield value

    def close(self) -> None:
        self._closed.set()
        self._stream.cancel()

    def __enter__(self) -> _Chunks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StdoutError(VoxtralError):
    """stdout cannot take the command's output (a full disk, a closed device)."""


def _out(line: str) -> None:
    """One line of a command's result on stdout."""
    if sys.stdout is None:  # started with stdout closed: print() would drop it silently
        raise StdoutError("stdout is closed: redirect it to a file or a pipe")
    try:
        print(line)
    except BrokenPipeError:
        raise
    except OSError as e:
        raise StdoutError(f"writing to stdout failed: {e.strerror or e}; {_STDOUT_FIX}") from None


_ATTACHED_OPTIONS = (
    ("-v", "voice"),
    ("-f", "file"),
    ("-o", "output"),
    ("-a", "device"),
    ("-m", "model"),
)


def _text_as_option_hint(args: argparse.Namespace) -> str:
    """Text such as "-v is cool" reaches argparse as -v with the value " is cool"; say so."""
    for flag, dest in _ATTACHED_OPTIONS:
        value = getattr(args, dest, None)
        if isinstance(value, str) and value[:1].isspace():
            return (
                f" ({one_line(flag + value, 60)!r} was read as the option {flag}: text that "
                "starts with '-' goes last, after --)"
            )
    return ""


def _check_dtype(args: argparse.Namespace) -> None:
    from .loader import parse_dtype

    try:
        parse_dtype(args.dtype)
    except ConfigError:
        raise InputError(
            f"--dtype {one_line(args.dtype, 40)} is not supported: use bfloat16, float16 or float32"
        ) from None


def _load(args: argparse.Namespace):
    from . import load

    _check_dtype(args)
    t0 = time.perf_counter()
    prefixes = None if getattr(args, "no_prefix_cache", False) else "auto"
    with _downloads_reported(args):
        tts = _interruptibly(lambda: load(args.model, dtype=args.dtype, prefix_cache_dir=prefixes))
    if getattr(args, "verbose", False):
        _info(
            f"loaded {tts.path} in {time.perf_counter() - t0:.2f} s: {_weights_summary(tts)} "
            "(most weights are read from disk when first used: in the first prefill and frame)"
        )
    return tts


def _weights_summary(tts) -> str:
    """Which files were read, in which layout, quantized how, computing in which dtype."""
    from .checkpoint import some_names

    shown = some_names([p.name for p in tts.weight_files], 2)
    bits: dict[str, int] = {}
    for spec in tts.quantized.values():
        kind = f"{spec.bits}-bit" if spec.mode == "affine" else spec.mode
        bits[kind] = bits.get(kind, 0) + 1
    quant = ", ".join(f"{n} layer{'s' * (n != 1)} {kind}" for kind, n in sorted(bits.items()))
    dtype = str(tts.dtype).removeprefix("mlx.core.")
    return f"{tts.layout} layout ({shown}), {quant + ', ' if quant else ''}{dtype} compute"


def _print_voices(tts) -> None:
    from .voices import LANGUAGE_NAMES, unreadable

    if not tts.voices and not tts.voices.broken:
        tts.default_voice  # noqa: B018 - raises the one-line "no voices" error
    damaged = []
    for name in sorted(tts.voices):
        try:  # a voice file is a megabyte or two: read each, list only what speak can use
            tts.load_voice(name)
        except VoxtralError as e:
            named = f"voice {one_line(repr(name))}"
            # Most voice errors already begin with the voice's name.
            damaged.append(str(e) if str(e).startswith(named) else f"{named} is unusable: {e}")
            continue
        voice = tts.voices[name]
        lang = voice.language or "?"
        _out(f"{one_line(name, 80):<20} {lang:<3} {LANGUAGE_NAMES.get(lang, 'unknown')}")
    for name, path in sorted(tts.voices.broken.items()):
        _info(f"note: voice {one_line(repr(name))} is unusable: {unreadable(path)}")
    for message in damaged:
        _info(f"note: {printable(message)}")


def cmd_voices(args: argparse.Namespace) -> int:
    _print_voices(_load(args))
    return 0


def _print_devices() -> None:
    from .audio.player import list_output_devices, no_output_device_error

    devices = list_output_devices()
    if not devices:
        raise no_output_device_error()
    for dev in devices:
        mark = "*" if dev.get("default") else " "
        _out(f"{mark} {dev['index']:>3}  {dev['name']}  ({dev['channels']} ch)")


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return False


@terminable
def cmd_speak(args: argparse.Namespace) -> int:
    if args.device == "?":
        _print_devices()
        return 0
    if args.max_frames < 1:
        raise InputError(f"--max-frames must be at least 1, got {args.max_frames}")
    # Before the model is loaded (or downloaded): a typo costs nothing.
    from .generate import check_seed
    from .textstream import check_pause

    try:
        check_seed(args.seed)
        check_pause(args.pause)
    except InputError as e:  # the library's words, with the option's name
        raise InputError(f"--{e}") from None
    _check_dtype(args)
    raw_out = args.raw
    to_stdout = args.output == "-"
    if raw_out and args.output is not None:
        raise InputError("--raw writes PCM to stdout; do not combine it with -o")
    if (raw_out or to_stdout) and sys.stdout is None:
        raise AudioOutputError(
            "stdout is closed: redirect it to a file or a pipe, or write a file with -o FILE"
        )
    if args.output is not None and not to_stdout:
        from .audio.io import check_output_path

        check_output_path(args.output)
        if args.file not in (None, "-") and _same_file(args.file, args.output):
            raise InputError(
                f"-o {args.output} is the text file given with -f: write the audio to another file"
            )
    play = args.play or (args.output is None and not raw_out)
    if args.device is not None and not play:
        raise InputError(
            f"-a {one_line(args.device, 60)} picks the device to play on, but nothing is "
            "played with -o or --raw alone: add --play"
        )
    if args.no_split and args.pause is not None:
        raise InputError(
            "--pause sets the silence between segments, and --no-split makes one: drop one"
        )
    if args.follow and args.no_split:
        raise InputError(
            "--follow speaks text as it arrives, a segment at a time, and --no-split makes "
            "one utterance of all of it: drop one"
        )
    if (raw_out or to_stdout) and sys.stdout.isatty():
        raise InputError(
            f"{'--raw' if raw_out else '-o -'} writes binary audio to stdout, which is a "
            "terminal: pipe it (| play ..., sox's player) or redirect it (> file)"
        )
    if args.voice == "?":
        _print_voices(_load(args))
        return 0
    if args.follow:
        source, source_name = text_source(args.file, args.text)
        text: Any = text_pieces(source, source_name)
    else:
        text = read_text(args.file, args.text)
        from .segment import is_blank

        if is_blank(text):
            raise InputError(f"text is empty: give some words to speak{_text_as_option_hint(args)}")

    player = None
    if play:
        from .audio.player import AudioPlayer

        player = AudioPlayer(device=args.device)  # fails early without PortAudio/devices
    try:
        tts = _load(args)
        if args.voice is not None:
            tts.voices.get_voice(args.voice)
        if args.no_split:
            from .tts import utterance_ids

            utterance_ids(tts.tokenizer, text, "text", "drop --no-split")

        started = time.monotonic()  # the player's clock
        # The stream checks the remaining arguments: nothing may be written before it exists.
        with _splitting_notice(args, text):
            stream = tts.stream(
                text,
                voice=args.voice,
                seed=args.seed,
                chunk_frames=1,
                max_frames=args.max_frames,
                split=not args.no_split,
                pause=args.pause,
                add_period=not args.no_period,
            )
    except BaseException:
        if player is not None:  # opened early to fail early: not left open on bad input
            player.stop()
        raise
    sinks = []
    file_writer = wav = None
    try:
        tts.load_voice(args.voice)  # a damaged voice file fails before any output is begun
        if args.output is not None and not to_stdout:
            from .audio.io import AudioFileWriter

            with signals_held():  # the temp file must not exist unreferenced
                file_writer = AudioFileWriter(args.output, tts.sample_rate)
        if to_stdout:
            from .audio.io import WavStreamWriter

            wav = WavStreamWriter(sys.stdout.buffer, tts.sample_rate)
            sinks.append(wav.write)
        if raw_out:
            from .audio.io import float_to_pcm16, write_stream

            sinks.append(lambda chunk: write_stream(sys.stdout.buffer, float_to_pcm16(chunk)))
    except BaseException:
        stream.cancel()
        if file_writer is not None:
            file_writer.abort()
        if player is not None:
            player.stop()
        raise
    if player is not None:
        horizon = PlaybackHorizon(tts, stream, args.max_frames, args.pause, started)
    progress = chunks = None
    ok = generated = False
    interrupted: KeyboardInterrupt | None = None
    # The device's failure, or the file's format limit: what the file holds is kept.
    failure: AudioStoppedError | None = None
    text_failure: VoxtralError | None = None
    try:
        progress = None
        if _show_progress(args, stream):
            progress = (
                Progress(None)
                if stream.live
                else Progress(len(stream.segments), [len(s.spoken) for s in stream.segments])
            )
        chunks = _Chunks(stream)
        for chunk in chunks:
            if len(chunk.audio):
                if file_writer is not None:
                    with signals_held():
                        file_writer.write(chunk.audio)
                for sink in sinks:
                    sink(chunk.audio)
            if player is not None and plays(chunk):
                player.feed(chunk.audio, expected_total_s=horizon(chunk))
            if progress is not None:
                progress.update(chunk, stream.timings)
        if stream.timings.frames == 0:  # nothing to keep: no empty file is left behind
            raise VoxtralError(
                "the model produced no audio for this text (END on the first frame); "
                "rephrase it or try another --seed"
            )
        generated = True
        if player is not None:
            player.finish()
        ok = True
    except KeyboardInterrupt as e:
        interrupted = e
        raise
    except AudioStoppedError as e:
        failure = e
        raise
    except VoxtralError as e:
        if e is stream.text_error:  # --follow's text failed: the audio before it is whole
            text_failure = e
            if player is not None:  # heard before the error is printed (Ctrl-C stops it)
                with contextlib.suppress(AudioStoppedError):
                    player.finish()
        raise
    finally:
        written = False
        try:
            with held_after(interrupted):  # a second Ctrl-C must not leave the temp file
                stream.cancel()
                if chunks is not None:
                    chunks.close()
                if progress is not None:
                    progress.close()
                if player is not None and not ok:
                    player.stop()
                if file_writer is not None:
                    if ok:
                        file_writer.close()
                        written = True
                    elif interrupted is not None and file_writer.commit_partial():
                        kept = file_writer.duration_s
                        # The one error line main() prints says what was kept.
                        interrupted.detail = (
                            f"interrupted: kept {kept:.1f} s of audio in "
                            f"{one_line(str(args.output))}"
                        )
                    elif text_failure is not None and file_writer.commit_partial():
                        text_failure.args = (
                            f"{text_failure}; kept {file_writer.duration_s:.1f} s of audio of "
                            f"the text before it in {one_line(str(args.output))}",
                        )
                    elif failure is not None and file_writer.commit_partial():
                        path = one_line(str(args.output))
                        kept = (
                            f"all {file_writer.duration_s:.1f} s of audio were written to {path}"
                            if generated
                            else f"kept {file_writer.duration_s:.1f} s of audio in {path}"
                        )
                        # The device's own fix offers a file: here there is one already.
                        fix = (
                            "check the output device"
                            if isinstance(failure, AudioDeviceError)
                            else failure.fix
                        )
                        failure.args = (f"{failure.problem}; {kept}; {fix}",)
                    else:
                        file_writer.abort()
                if wav is not None:
                    wav.close()
        except KeyboardInterrupt as e:  # held while the finished file was flushed
            if written and getattr(e, "detail", None) is None:
                from .output_dir import written_detail

                e.detail = written_detail(args.output)
            raise
    hold_from_now()
    timings = stream.timings
    if timings.cut_short:
        n, of = timings.cut_short, len(stream.segments)
        what = "the text" if of == 1 else f"{n} of {of} segments"
        seconds = args.max_frames * tts.samples_per_frame / tts.sample_rate
        frames = f"{args.max_frames} frame{'s' * (args.max_frames != 1)}"
        _info(
            f"{PROG}: warning: {what} reached --max-frames ({frames}, "
            f"{seconds:g} s) before the model ended {'it' if of == 1 else 'them'}: the audio "
            f"is cut short; raise --max-frames{' or drop --no-split' if args.no_split else ''}"
        )
    if args.verbose:
        _report(timings, player, started, live=args.follow)
    return 0


@contextlib.contextmanager
def _splitting_notice(args: argparse.Namespace, text: str) -> Iterator[None]:
    """A line saying why a long text is silent for a while (tens of seconds for tens of
    megabytes) on a terminal, erased once the text is split."""
    show = (
        isinstance(text, str)
        and len(text) > SPLIT_NOTICE_CHARS
        and not args.no_split
        and not args.quiet
        and _stderr_is_terminal()
    )
    if show:
        _to_stderr(f"\r{PROG}: splitting {len(text):,} characters into segments\x1b[K")
    try:
        yield
    finally:
        if show:
            _to_stderr("\r\x1b[K")


def _show_progress(args: argparse.Namespace, stream) -> bool:
    if args.quiet or not _stderr_is_terminal():
        return False
    if stream.live:  # not over text being typed on the terminal: the line would hide it
        typed = args.file in (None, "-") and sys.stdin is not None and sys.stdin.isatty()
        return not typed
    return len(stream.segments) > 1


def _stderr_is_terminal() -> bool:
    return sys.stderr is not None and sys.stderr.isatty()


class Progress:
    """One self-rewriting line on stderr: segments, seconds of audio, ETA. ``total`` None:
    text still arriving (``--follow``), whose segments are counted as they end."""

    REDRAW_S = 0.1  # at most ten redraws a second (a chunk comes every frame)

    def __init__(self, total: int | None, sizes: Sequence[int] | None = None):
        self.total = total
        # How much text each segment holds: the ETA weighs what is left by it.
        self.sizes = [max(1, int(n)) for n in sizes] if sizes is not None else [1] * (total or 0)
        self.text_total = sum(self.sizes)
        self.t0 = time.perf_counter()
        self.done = 0
        self._mark = (0.0, 0)  # (elapsed, text done) when the latest segment ended
        self._shown = ""
        self._shown_done = -1
        self._shown_at = 0.0
        self._due = ""  # a line held back by the rate limit, drawn by close()

    def update(self, chunk: AudioChunk, timings: Timings) -> None:
        before = self.done
        if chunk.is_final or (chunk.frames == 0 and len(chunk.audio)):  # a segment ended
            self.done = chunk.segment + 1
        else:  # the ones before it have ended, even with no pause (0 s) to say so
            self.done = max(self.done, chunk.segment)
        elapsed = time.perf_counter() - self.t0
        if self.done != before:
            self._mark = (elapsed, self._mark[1] + sum(self.sizes[before : self.done]))
        eta = ""
        if self.total is not None and 0 < self.done < self.total:
            # Measured when a segment ends, then counted down: segments end in bursts (a
            # batch's later ones are done when the first is), and a rate re-measured at
            # every chunk climbed between the bursts.
            at, text_done = self._mark
            left = max(0.0, at / text_done * (self.text_total - text_done) - (elapsed - at))
            eta = f", ETA {int(left // 60)}:{int(left % 60):02d}"
        if self.total is None:
            n = self.done
            line = f"{PROG}: {n} segment{'s' * (n != 1)} done, {timings.audio_s:.1f} s of audio"
        else:
            line = (
                f"{PROG}: segment {min(self.done + 1, self.total)}/{self.total}, "
                f"{timings.audio_s:.1f} s of audio{eta}"
            )
        now = time.perf_counter()
        if line == self._shown:
            return
        if self.done == self._shown_done and now - self._shown_at < self.REDRAW_S:
            self._due = line
            return
        self._draw(line)
        self._shown_done, self._shown_at = self.done, now

    def _draw(self, line: str) -> None:
        # The state first: a Ctrl-C landing after the write would leave an older held line
        # for close() to draw, and the count would step back.
        self._shown, self._due = line, ""
        # Cut to the terminal: a line that wraps is rewritten below itself at each update.
        # \x1b[K clears what a longer previous line left at the end.
        _to_stderr(f"\r{line[: max(1, _columns() - 1)]}\x1b[K")

    def close(self) -> None:
        if self._due:
            self._draw(self._due)
        _to_stderr("\n")


def _columns() -> int:
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns or 80
    except (OSError, ValueError, AttributeError):
        return 80


def _report(t, player, started: float, live: bool = False) -> None:
    _info(f"prompt: {t.prompt_tokens} tokens, prefill {t.prefill_s * 1000:.0f} ms")
    _info(f"first audio after {t.first_audio_s * 1000:.0f} ms")
    _info(f"frames: {t.frames}, {t.ms_per_frame:.1f} ms/frame, audio {t.audio_s:.2f} s")
    waiting = " (leaving out the waits for text)" if live else ""
    _info(
        f"wall {t.total_s:.2f} s{waiting}, real-time factor {t.rtf:.3f} "
        f"({1 / t.rtf if t.rtf else 0:.2f}x real time)"
    )
    _info(f"peak memory {t.peak_memory_bytes / 2**30:.2f} GiB")
    if player is not None:
        s = player.stats
        heard = ""
        if s.first_audio_at is not None:  # time to first audio at the speakers
            heard = f"first sound after {(s.first_audio_at - started) * 1000:.0f} ms, "
        _info(
            f"playback: {heard}{s.underruns} underruns ({s.underrun_s:.2f} s of silence), "
            f"{s.device_xruns} device xruns, pre-roll {s.preroll_s * 1000:.0f} ms"
        )


@terminable
def cmd_convert_voices(args: argparse.Namespace) -> int:
    from .voices import convert_voice_files

    sources = [Path(s) for s in args.sources]
    written: list[Path] | None = None
    try:
        written = convert_voice_files(sources, Path(args.output), overwrite=args.force)
        hold_from_now()
    except KeyboardInterrupt as e:  # once they are all written, the command did its job
        if written is not None and getattr(e, "detail", None) is None:
            e.detail = f"interrupted {FINISHED} (its output is complete)"
        raise
    for path in written:
        _out(str(path))
    return 0


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino


def _written_then_held(output: str, write: Callable[[], T]) -> T:
    """Run ``write``, which renames a finished directory into place at ``output``, and hold
    signals back once it has returned. An interrupt that lands after the rename says so:
    the command did its job. (As a context manager this left a gap, in its ``__exit__``,
    where a finished conversion was reported as "interrupted" alone.)"""
    from .output_dir import written_detail

    before = _identity(output)
    try:
        result = write()
        hold_from_now()
    except KeyboardInterrupt as e:
        after = _identity(output)
        if getattr(e, "detail", None) is None and after is not None and after != before:
            e.detail = written_detail(output)
        raise
    return result


@terminable
def cmd_random_checkpoint(args: argparse.Namespace) -> int:
    from .config import MAX_LAYERS
    from .synthetic.checkpoint import build_random_checkpoint, make_params
    from .synthetic.tekken import mistral_common_tekken_path

    for flag, value in (("--layers", args.layers), ("--flow-layers", args.flow_layers)):
        if value is not None and not 1 <= value <= MAX_LAYERS:
            raise InputError(f"{flag} must be between 1 and {MAX_LAYERS}, got {value}")
    params = make_params(args.size, n_layers=args.layers, flow_layers=args.flow_layers)
    t0 = time.perf_counter()
    out = _written_then_held(
        args.output,
        lambda: build_random_checkpoint(
            args.output,
            params,
            seed=args.seed,
            dtype=args.dtype,
            voice_format=args.voice_format,
            suppress_end=args.suppress_end,
            force=args.force,
        ),
    )
    vocab = (
        "the real text vocabulary, from mistral-common"
        if mistral_common_tekken_path() is not None
        else "a 256-byte text vocabulary; `pip install mistral-common` gives the real one"
    )
    _info(
        f"wrote a random {args.size} checkpoint to {out} in {time.perf_counter() - t0:.1f} s "
        f"({vocab})"
    )
    _out(str(out))
    return 0


@terminable
def cmd_convert(args: argparse.Namespace) -> int:
    from .convert import DEFAULT_GROUP_SIZE, convert_model

    last = [0.0]

    def progress(name: str, done: int, total: int) -> None:
        now = time.perf_counter()
        if args.verbose and (now - last[0] > 2.0 or done == total):
            last[0] = now
            _info(f"{done / 2**30:6.2f} / {total / 2**30:.2f} GiB  {name}")

    t0 = time.perf_counter()
    with _downloads_reported(args):
        model = _fetch_to_convert(args)
    result = _written_then_held(
        args.output,
        lambda: convert_model(
            model,
            args.output,
            q_bits=args.q_bits,
            q_group_size=args.q_group_size,
            q_flow_bits=args.q_flow_bits,
            dtype=args.dtype,
            force=args.force,
            progress=progress,
        ),
    )
    what = f"{len(result.quantized)} quantized layers" if result.quantized else "unquantized"
    n = len(result.voices)
    voices = f"{n} voice{'s' if n != 1 else ''}" if n else "no voices"
    _info(
        f"wrote {result.total_bytes / 2**30:.2f} GiB ({what}, {voices}) to {result.path} in "
        f"{time.perf_counter() - t0:.1f} s"
    )
    if result.unfit:
        n, first = len(result.unfit), ", ".join(result.unfit[:3])
        layers, stay, their = ("layers", "stay", "their") if n > 1 else ("layer", "stays", "its")
        _info(
            f"note: {n} {layers} ({first}{', ...' if n > 3 else ''}) {stay} unquantized: "
            f"{their} input width is not a multiple of the group size "
            f"{args.q_group_size or DEFAULT_GROUP_SIZE}"
        )
    if not result.voices:
        _info(
            f"note: {args.model} has no voices in voice_embedding/; to speak with the "
            f"converted model, put voice files (.pt or .safetensors) in "
            f"{result.path / 'voice_embedding'}/ (create it)"
        )
    _out(str(result.path))
    return 0


def _fetch_to_convert(args: argparse.Namespace) -> Path:
    """The model's folder, a Hub model downloaded on a helper thread (see
    :func:`_interruptibly`; in the main thread, Ctrl-C waited for huggingface_hub's threads
    to finish their files; the conversion records the repo of a cached snapshot). The
    options and the output path are checked before: a typo must not cost the download."""
    from .convert import QuantOptions, output_dtype
    from .hub import resolve_model_dir
    from .output_dir import directory_path

    QuantOptions.make(args.q_bits, args.q_group_size, args.q_flow_bits)
    output_dtype(args.dtype)
    directory_path(args.output)
    return _interruptibly(lambda: resolve_model_dir(args.model))


def cmd_serve(args: argparse.Namespace) -> int:
    import contextlib

    from .engine import check_max_batch
    from .server import API_KEY_ENV, ServerConfig, bind, create_app, serve

    check_max_batch(args.max_batch, "--max-batch")
    for name in ("max_queue", "max_input_chars", "max_frames"):
        if getattr(args, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} must be at least 1")
    if not 0 <= args.port <= 65535:
        raise InputError(f"--port {args.port} is not a TCP port: use 1 to 65535 (0: any free port)")
    for name in ("body_timeout", "send_timeout"):
        value = getattr(args, name)
        if not (math.isfinite(value) and 0 < value <= MAX_TIMEOUT_S):
            raise InputError(
                f"--{name.replace('_', '-')} must be a number of seconds from 0 (exclusive) "
                f"to {MAX_TIMEOUT_S:g}, got {value:g}"
            )
    if args.api_key is not None and not args.api_key:
        raise InputError(
            "--api-key is empty (an unset shell variable?): give the key, or leave --api-key "
            "out to serve without one"
        )
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if api_key is not None and (api_key != api_key.strip() or not api_key.isprintable()):
        raise InputError(
            "the API key starts or ends with spaces or holds control characters, which "
            "HTTP headers cannot carry: give one without them"
        )
    sock = bind(args.host, args.port)  # a taken port fails before the model loads
    try:
        tts = _load(args)
    except BaseException:
        sock.close()
        raise
    tts.engine.max_batch = args.max_batch
    voice = None if args.no_warmup else _warmup_voice(tts)
    if voice is not None:  # the first clients must not wait for compilation or page-ins
        seconds = _interruptibly(lambda: tts.warmup(voice).result())  # Ctrl-C on macOS too
        if args.log_level in ("info", "debug"):
            _info(f"{PROG}: warmed up in {seconds:.1f} s")
    local = Path(args.model)
    model_id = local.resolve().name if local.is_dir() else args.model
    config = ServerConfig(
        model_id=model_id,
        api_key=api_key,
        max_input_chars=args.max_input_chars,
        max_queue=args.max_queue,
        max_frames=args.max_frames,
        body_timeout=args.body_timeout,
        send_timeout=args.send_timeout,
    )
    if api_key is None and args.host not in ("127.0.0.1", "::1", "localhost"):
        _info(f"{PROG}: warning: serving on {args.host} without an API key (--api-key)")

    def ready(url: str) -> None:
        _info(f"{PROG}: serving {model_id} at {url} (POST {url}/v1/audio/speech; Ctrl-C stops)")

    # uvicorn stops gracefully on Ctrl-C or SIGTERM, then re-raises the signal to the
    # handler it found: Python's own, so that Ctrl-C ends here and SIGTERM ends the process.
    default_signals()
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how a server stops: no error
        serve(create_app(tts, config), sock, ready, log_level=args.log_level)
    # The model is not closed: serve() has cancelled every request and the engine is idle,
    # and joining the worker thread right before exit can abort the process in MLX's
    # teardown ("terminate called without an active exception").
    return 0


def _warmup_voice(tts) -> str | None:
    """The voice ``serve`` warms up: the default one, else the first that can be used (the
    server offers the others; a damaged file is the log's to report, not a reason not to
    start)."""
    from .tts import DEFAULT_VOICE

    for name in [DEFAULT_VOICE, *(v for v in tts.voices if v != DEFAULT_VOICE)]:
        if name in tts.voices:
            try:
                return tts.load_voice(name)
            except VoxtralError:
                continue
    return None


def _given(what: str, fix: str = "give a path") -> Callable[[str], str]:
    """An argparse type for an argument that must not be blank (an unset shell variable):
    an empty path would be the current directory, an empty device the first one."""

    def check(value: str) -> str:
        if not value.strip():
            raise argparse.ArgumentTypeError(f"{what} is empty (an unset shell variable?): {fix}")
        return value

    return check


class _HelpNotWritten(Exception):
    def __init__(self, error: OSError):
        super().__init__(str(error))
        self.error = error


class _Parser(argparse.ArgumentParser):
    """argparse with the project's error format: one line, exit status 1 (argparse prints
    the usage block and exits with 2)."""

    def error(self, message: str, help_prog: str | None = None) -> NoReturn:
        hint = ""
        # "-hello" is read as -h with "ello"; "-hello" unknown as a whole is likely text too.
        if "ignored explicit argument" in message or re.search(
            r"unrecognized arguments: (.* )?-[^-\s]\S{2,}", message
        ):
            hint = " (text that starts with '-' goes last, after --)"
        _err(f"{one_line(message, 300)}{hint}; see `{help_prog or self.prog} --help`")
        sys.exit(1)

    def _print_message(self, message: str, file=None) -> None:
        # argparse drops a failed write (Python >= 3.12): `--help > /dev/full` said nothing
        # and exited 0. Only stdout's failure matters; stderr's is dropped as _err does.
        if not message:
            return
        if file is None or file is sys.stderr:
            _to_stderr(message)
            return
        try:
            file.write(message)
            file.flush()
        except OSError as e:
            raise _HelpNotWritten(e) from None

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        argv = sys.argv[1:] if args is None else list(args)
        commands = self._commands()
        first = next((i for i, a in enumerate(argv) if a in commands), None)
        known = commands[argv[first]]._option_string_actions if first else {}
        if first and argv[0].split("=")[0] in known and argv[0] not in ("-h", "--help"):
            # `voxtral-mlx -m DIR speak ...`: argparse would call DIR an invalid command.
            self.error(
                f"{argv[0]} goes after the command: {PROG} {argv[first]} {argv[0]} ...",
                f"{PROG} {argv[first]}",
            )
        for arg in argv[: argv.index("--") if "--" in argv else len(argv)]:
            if re.fullmatch(r"-h[^-\s]{2,}\S*", arg) and arg not in known:
                # Python 3.13's argparse reads "-hello" as -h and prints the help (exit 0);
                # earlier ones call it an error. Text it is, on every version.
                self.error(
                    f"argument -h/--help: ignored explicit argument {arg[2:]!r}",
                    f"{PROG} {argv[first]}" if first is not None else None,
                )
        # The command is checked here, not by argparse: it would report a missing COMMAND
        # for `voxtral-mlx --bogus`, hiding the option it did not know.
        parsed, unknown = self.parse_known_args(args, namespace)
        command = getattr(parsed, "command", "")
        if unknown:
            self.error(
                f"unrecognized arguments: {' '.join(unknown)}",
                f"{PROG} {command}" if command else None,
            )
        if command is None:
            self.error("the following arguments are required: COMMAND")
        return parsed

    def _commands(self) -> dict[str, argparse.ArgumentParser]:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return dict(action.choices)
        return {}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Mistral's Voxtral-4B-TTS on Apple Silicon with MLX.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def model_args(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "-m",
            "--model",
            type=_given(
                f"the model (-m, or ${MODEL_ENV})", "give a directory or a Hugging Face repo id"
            ),
            default=_default_model(),
            help=f"local directory or Hugging Face repo (default: ${MODEL_ENV} or "
            "mistralai/Voxtral-4B-TTS-2603)",
        )
        p.add_argument(
            "--dtype", default=None, help="bfloat16 | float16 | float32 (default: the checkpoint's)"
        )
        p.add_argument(
            "--no-prefix-cache",
            action="store_true",
            help="do not keep prefilled voice prefixes on disk (in 'prefixes' of "
            "$VOXTRAL_MLX_CACHE, else of $XDG_CACHE_HOME/voxtral_mlx or ~/.cache/voxtral_mlx)",
        )

    speak = sub.add_parser("speak", help="speak text (plays it, or writes it with -o)")
    speak.add_argument("text", nargs="*", help="text to speak")
    speak.add_argument(
        "-f", "--file", type=_given("-f FILE"), help="read the text from FILE ('-' for stdin)"
    )
    speak.add_argument("-v", "--voice", help="voice name (default: casual_male; '?' lists them)")
    speak.add_argument(
        "-o",
        "--output",
        type=_given("-o FILE"),
        metavar="FILE",
        help="write audio to FILE (.wav .flac .aiff .caf .ogg .mp3 .opus; "
        "'-' writes WAV to stdout) instead of playing; an existing FILE is replaced once "
        "the new one is complete (or interrupted)",
    )
    speak.add_argument("--play", action="store_true", help="play even when writing a file")
    speak.add_argument(
        "--raw",
        action="store_true",
        help="write raw 16-bit little-endian mono PCM to stdout as it is generated",
    )
    speak.add_argument(
        "-a",
        "--device",
        type=_given("--device", "name a device (-a '?' lists them), or leave -a out"),
        help="output device index or name ('?' lists them)",
    )
    speak.add_argument("--seed", type=int, help="seed of the flow-matching noise")
    speak.add_argument(
        "--max-frames",
        type=int,
        default=2400,
        help="stop each text segment after this many 80 ms frames (default 2400 = 192 s)",
    )
    speak.add_argument("--verbose", action="store_true", help="print timings to stderr")
    speak.add_argument("-q", "--quiet", action="store_true", help="no progress line")
    speak.add_argument(
        "--no-split",
        action="store_true",
        help="speak the text as one utterance (default: split long text at natural pauses)",
    )
    speak.add_argument(
        "--no-period",
        action="store_true",
        help="do not end segments that lack final punctuation with a period",
    )
    speak.add_argument(
        "--pause", type=float, help="seconds of silence between segments (default: natural)"
    )
    speak.add_argument(
        "--follow",
        action="store_true",
        help="speak text from stdin (or -f FILE, e.g. a FIFO) as it arrives, a sentence or "
        "more at a time, until its end (for a program that writes it gradually, such as an "
        "LLM); without it the text is read to its end first",
    )
    model_args(speak)
    speak.set_defaults(func=cmd_speak)

    voices = sub.add_parser("voices", help="list the voices and their languages")
    model_args(voices)
    voices.set_defaults(func=cmd_voices)

    conv = sub.add_parser("convert-voices", help="convert voice .pt files to .safetensors")
    conv.add_argument(
        "sources", nargs="+", type=_given("SRC"), metavar="SRC", help=".pt files or directories"
    )
    conv.add_argument(
        "-o",
        "--output",
        "--out",
        dest="output",
        type=_given("-o OUT_DIR"),
        required=True,
        metavar="OUT_DIR",
        help="directory to write <name>.safetensors into (created if needed)",
    )
    conv.add_argument(
        "--force", action="store_true", help="overwrite voice files already in OUT_DIR"
    )
    conv.set_defaults(func=cmd_convert_voices)

    rnd = sub.add_parser(
        "random-checkpoint", help="build a random checkpoint in Mistral's layout (for tests)"
    )
    rnd.add_argument("output", type=_given("OUT_DIR"), metavar="OUT_DIR")
    rnd.add_argument(
        "--size",
        choices=["tiny", "wide", "full"],
        default="tiny",
        help="tiny: 64 wide, for tests; wide: the real layer widths with 2 backbone layers; "
        "full: the real 26 + 3 layers, 8 GB (default: tiny)",
    )
    rnd.add_argument("--layers", type=int, help="override the backbone's layer count")
    rnd.add_argument("--flow-layers", type=int, help="override the flow head's layer count")
    rnd.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: 0)")
    rnd.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    rnd.add_argument("--voice-format", choices=["pt", "safetensors"], default="pt")
    rnd.add_argument(
        "--suppress-end",
        action="store_true",
        help="zero the END row of the semantic head so generation runs to --max-frames",
    )
    rnd.add_argument(
        "--force", action="store_true", help="replace an existing OUT_DIR holding a model"
    )
    rnd.set_defaults(func=cmd_random_checkpoint)

    cvt = sub.add_parser(
        "convert", help="convert a checkpoint to an MLX directory (optionally quantized)"
    )
    cvt.add_argument(
        "model", type=_given("MODEL"), metavar="MODEL", help="local directory or Hugging Face repo"
    )
    cvt.add_argument(
        "-o",
        "--output",
        type=_given("-o OUT_DIR"),
        required=True,
        metavar="OUT_DIR",
        help="directory to write the converted model into (written aside, renamed in at the end)",
    )
    cvt.add_argument(
        "--q-bits", type=int, help="quantize the backbone's Linear layers to 4, 6 or 8 bits"
    )
    cvt.add_argument(
        "--q-group-size", type=int, help="quantization group size: 32, 64 or 128 (default 64)"
    )
    cvt.add_argument(
        "--q-flow-bits",
        type=int,
        help="bits of the flow head's Linear layers (default: max(8, --q-bits))",
    )
    cvt.add_argument(
        "--dtype",
        default="bfloat16",
        help="bfloat16 | float16 | float32: dtype of every unquantized tensor (default bfloat16)",
    )
    cvt.add_argument("--force", action="store_true", help="replace an existing OUT_DIR")
    cvt.add_argument("--verbose", action="store_true", help="print progress to stderr")
    cvt.set_defaults(func=cmd_convert)

    srv = sub.add_parser(
        "serve", help="serve speech over HTTP (OpenAI-compatible /v1/audio/speech)"
    )
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    srv.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free)")
    srv.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $VOXTRAL_MLX_API_KEY)",
    )
    srv.add_argument(
        "--max-batch",
        type=int,
        default=4,
        help="text segments generated as one batch (4; at most 64)",
    )
    srv.add_argument(
        "--max-queue",
        type=int,
        default=32,
        help="speech requests in progress at most, generating or waiting; more get 429 (32)",
    )
    srv.add_argument(
        "--max-input-chars", type=int, default=4096, help="longest input text (default 4096)"
    )
    srv.add_argument(
        "--max-frames",
        type=int,
        default=2400,
        help="stop a text segment after this many 80 ms frames (default 2400 = 192 s)",
    )
    srv.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        help="seconds a client has to send its whole request body; then 408 (default 30)",
    )
    srv.add_argument(
        "--send-timeout",
        type=float,
        default=60.0,
        help="seconds a client may stop reading the audio before it is cut off (default 60)",
    )
    srv.add_argument(
        "--no-warmup",
        action="store_true",
        help="start serving at once (default: first compile the frame for every batch size "
        "and prefill the default voice, so the first requests do not wait for it)",
    )
    srv.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="server log level (default info: one line per request)",
    )
    model_args(srv)
    srv.set_defaults(func=cmd_serve)
    return parser


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    _info(f"{PROG}: warning: {message}")


def main(argv: Sequence[str] | None = None, own_process: bool | None = None) -> int:
    """Run the command line; returns the exit status.

    ``argv=None`` (the ``voxtral-mlx`` script, ``python -m voxtral_mlx``), or
    ``own_process=True`` (the scripts in ``convert/``), means the process is the command's
    own: signals end it cleanly, and once an interrupted command has cleaned up, it exits
    at once (see :func:`_exit_now`).
    """
    own_process = argv is None if own_process is None else own_process
    if own_process:  # the process is ours: before the command starts, a signal just ends it
        exit_on_signals(f"{PROG}: error: interrupted")
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help or a usage error (already on stderr)
        error = _release_stdout()
        if error is None:
            raise e
        return _stdout_failed(error)
    except _HelpNotWritten as e:
        _release_stdout()
        return _stdout_failed(e.error)
    warnings.showwarning = _show_warning  # one line each, without Python's source echo
    if own_process:
        # huggingface_hub logs each retry of a download ("Trying to resume download..."),
        # a dozen lines before the one-line error that says what to do.
        os.environ.setdefault("HF_HUB_VERBOSITY", "error")
    try:
        code = _run(args, own_process=own_process)
    except VoxtralError as e:
        _release_stdout()
        _err(str(e))
        return 1
    except ImportError as e:
        if not is_mlx_import_error(e):
            raise
        _release_stdout()
        _err(str(mlx_import_error(e)))
        return 1
    except KeyboardInterrupt as e:
        _err(getattr(e, "detail", "interrupted"))
        code = 128 + e.signum if isinstance(e, Terminated) else 130
        if own_process:
            _exit_now(code)
        return code
    except BrokenPipeError:
        # The reader of stdout went away (e.g. `| head`): not an error of ours.
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        return 141
    except OSError as e:  # a path no check foresaw (a name too long, a link loop, ...)
        _release_stdout()
        where = f" {one_line(str(e.filename), 200)!r}" if e.filename else ""
        _err(f"cannot use{where}: {e.strerror or e}; check the path")
        return 1
    error = _release_stdout()
    return code if error is None else _stdout_failed(error)


def _stdout_failed(error: OSError) -> int:
    """The exit status for output that could not be written, said on stderr unless the
    reader went away (``| head``: not an error of ours)."""
    if isinstance(error, BrokenPipeError):
        return 141
    _err(f"writing to stdout failed: {error.strerror or error}; {_STDOUT_FIX}")
    return 1


def _run(args: argparse.Namespace, own_process: bool) -> int:
    try:
        return args.func(args)
    finally:
        if own_process:  # the command is over: its output kept or removed
            exit_on_signals(f"{PROG}: error: interrupted {FINISHED}")


def _exit_now(code: int) -> None:
    """End the process without the interpreter's teardown.

    After an interrupt the output is already kept or removed; a normal exit would then
    wait for the model's worker to finish the frame (or prefill) it is computing, up to a
    second or more, and free every array of the model before the shell prompt returns.
    """
    for f in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            if f is not None:
                f.flush()
    os._exit(code)


def _release_stdout() -> OSError | None:
    """Flush stdout now and return the error if that fails; stdout then points at
    /dev/null, so that Python's own flush at exit prints no traceback."""
    if sys.stdout is None:
        return None
    try:
        sys.stdout.flush()
        return None
    except OSError as e:
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        return e


if __name__ == "__main__":
    sys.exit(main())
