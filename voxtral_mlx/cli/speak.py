"""``voxtral-mlx speak``: text to the speakers, a file or stdout."""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
import time
from collections.abc import Iterator
from typing import Any

from .. import DEFAULT_REPO
from ..audio.chunking import PlayerPace
from ..audio.horizon import PlaybackHorizon, plays
from ..errors import AudioDeviceError, AudioOutputError, AudioStoppedError, InputError, VoxtralError
from ..fileio import one_line
from ..interrupts import held_after, hold_from_now, signals_held, terminable
from ..textinput import EmptyTextError, read_text, reads_stdin, text_pieces, text_source
from .listing import print_devices, print_voices
from .loading import check_dtype, load_model
from .output import PROG, info, to_stderr
from .progress import Progress
from .waiting import Chunks

SPLIT_NOTICE_CHARS = 500_000  # splitting takes about a second a million characters: say so first


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


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return False


def _stdin_is(path: str) -> bool:
    """Whether stdin is redirected from the file ``path`` (``< notes.wav``)."""
    try:
        return os.path.samestat(os.fstat(sys.stdin.fileno()), os.stat(path))
    except (OSError, ValueError, AttributeError):  # no stdin, no such file yet
        return False


@terminable
def cmd_speak(args: argparse.Namespace) -> int:
    if args.device == "?":
        print_devices()
        return 0
    if args.max_frames < 1:
        raise InputError(f"--max-frames must be at least 1, got {args.max_frames}")
    if args.file is None and args.text == ["-"]:  # as cat reads it, -- - too
        args.file, args.text = "-", []
    # Before the model is loaded (or downloaded): a typo costs nothing.
    from ..audio.stretch import check_speed
    from ..generate import check_seed
    from ..textstream import check_pause

    try:
        check_seed(args.seed)
        check_pause(args.pause)
        check_speed(args.speed)
    except InputError as e:  # the library's words, with the option's name
        raise InputError(f"--{e}") from None
    check_dtype(args)
    raw_out = args.raw
    to_stdout = args.output == "-"
    if raw_out and args.output is not None:
        raise InputError("--raw writes PCM to stdout; do not combine it with -o")
    if (raw_out or to_stdout) and sys.stdout is None:
        raise AudioOutputError(
            "stdout is closed: redirect it to a file or a pipe, or write a file with -o FILE"
        )
    if args.output is not None and not to_stdout:
        from ..audio.io import check_output_path

        check_output_path(args.output)
        if args.file not in (None, "-") and _same_file(args.file, args.output):
            raise InputError(
                f"-o {args.output} is the text file given with -f: write the audio to another file"
            )
        if reads_stdin(args.file, args.text) and _stdin_is(args.output):
            raise InputError(
                f"-o {args.output} is the file the text is read from on stdin: write the audio "
                "to another file"
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
        print_voices(args)
        return 0
    if args.follow:
        source, source_name = text_source(args.file, args.text)
        text: Any = text_pieces(source, source_name)
    else:
        try:
            text = read_text(args.file, args.text)
        except EmptyTextError as e:  # stdin read as "-v is cool" went to the option -v
            raise InputError(f"{e}{_text_as_option_hint(args)}") from None
        from ..segment import EMPTY_TEXT, is_blank

        if is_blank(text):
            raise InputError(EMPTY_TEXT + _text_as_option_hint(args))

    player = None
    if play:
        from ..audio.player import AudioPlayer, no_output_device_error

        try:
            player = AudioPlayer(device=args.device)  # fails early without PortAudio/devices
        except AudioOutputError as e:
            if args.output is None or raw_out or str(e) != str(no_output_device_error()):
                raise
            # "write a file instead (-o FILE)" would tell someone who gave -o to give it.
            raise AudioOutputError(
                f"no audio output device found; connect one, or drop --play to only write "
                f"{args.output}"
            ) from e
    try:
        tts = load_model(args)
        if player is not None and player.sample_rate != tts.sample_rate:
            # Opened before the model's rate was known (at the release's 24 kHz): a model
            # of another rate would play too fast or too slow.
            player.stop()
            player = AudioPlayer(tts.sample_rate, device=args.device)
        if args.voice is not None:
            tts.voices.get_voice(args.voice)
        if args.no_split:
            from ..segment import with_period
            from ..tts import utterance_ids

            # One utterance, as split text's segments are sent: stripped, and with a
            # period unless --no-period (END is unreliable without final punctuation).
            text = text.strip()
            if text and not args.no_period:
                text = with_period(text)
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
                **({} if args.no_split else {"add_period": not args.no_period}),
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
            from ..audio.io import AudioFileWriter

            with signals_held():  # the temp file must not exist unreferenced
                file_writer = AudioFileWriter(args.output, tts.sample_rate)
        if to_stdout:
            from ..audio.io import WavStreamWriter

            wav = WavStreamWriter(sys.stdout.buffer, tts.sample_rate)
            sinks.append(wav.write)
        if raw_out:
            from ..audio.io import float_to_pcm16, write_stream

            sinks.append(lambda chunk: write_stream(sys.stdout.buffer, float_to_pcm16(chunk)))
    except BaseException:
        stream.cancel()
        if file_writer is not None:
            file_writer.abort()
        if player is not None:
            player.stop()
        raise
    from ..audio.stretch import SegmentStretcher

    stretch = SegmentStretcher(args.speed, tts.sample_rate)
    if player is not None:
        horizon = PlaybackHorizon(tts, stream, args.max_frames, args.pause, started)
        # The player's seconds are the stretched ones: a frame plays 1 / speed as long.
        pace = PlayerPace(stream, player, tts.samples_per_frame / tts.sample_rate / args.speed)
    progress = chunks = None
    paced = (0, 0.0)  # frames of the segments played, and the seconds they took
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
        chunks = Chunks(stream)
        for chunk in chunks:
            if chunk.ends_segment and chunk.timings.frames:  # the segment's own figures
                paced = (
                    paced[0] + chunk.timings.frames,
                    paced[1] + chunk.timings.ms_per_frame * chunk.timings.frames / 1000.0,
                )
            audio = stretch(chunk)
            if len(audio):
                if file_writer is not None:
                    with signals_held():
                        file_writer.write(audio)
                for sink in sinks:
                    sink(audio)
            if player is not None and plays(chunk):
                total = horizon(chunk) / args.speed
                player.feed(audio, expected_total_s=total, more_coming=horizon.more_coming)
                pace.fed(chunk)
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
                        if interrupted is not None:  # "interrupted" alone: was it written?
                            there = os.path.lexists(args.output)
                            interrupted.detail = (
                                "interrupted before any audio was written: "
                                f"{one_line(str(args.output))} "
                                + ("left as it was" if there else "not written")
                            )
                if wav is not None:
                    wav.close()
                if interrupted is not None and args.verbose:  # what ran until Ctrl-C
                    _report(
                        stream.timings,
                        player,
                        started,
                        args.follow,
                        len(stream.segments),
                        args.speed,
                    )
        except KeyboardInterrupt as e:  # held while the finished file was flushed
            if written and getattr(e, "detail", None) is None:
                from ..output_dir import written_detail

                e.detail = written_detail(args.output)
            raise
    hold_from_now()
    timings = stream.timings
    if timings.cut_short:
        n, of = timings.cut_short, len(stream.segments)
        what = "the text" if of == 1 else f"{n} of {of} segments"
        seconds = args.max_frames * tts.samples_per_frame / tts.sample_rate
        frames = f"{args.max_frames} frame{'s' * (args.max_frames != 1)}"
        info(
            f"{PROG}: warning: {what} reached --max-frames ({frames}, "
            f"{seconds:g} s) before the model ended {'it' if of == 1 else 'them'}: the audio "
            f"is cut short; raise --max-frames{' or drop --no-split' if args.no_split else ''}"
        )
    # The device is asked on the model's worker, as all MLX work is, and only when there is
    # something to say (on a CPU, quantized products are slower, not faster).
    note = slow_generation_note(tts, paced, args) if player is not None else None
    if note is not None and tts.call(_on_gpu):
        info(note)
    if args.verbose:
        _report(timings, player, started, args.follow, len(stream.segments), args.speed)
    return 0


# Frames a run must have for its speed to say something about the machine (not the first
# frame's compiling and warming up).
SLOW_NOTE_MIN_FRAMES = 25


def _on_gpu() -> bool:
    import mlx.core as mx

    return mx.default_device() == mx.gpu


def slow_generation_note(tts, paced: tuple[int, float], args: argparse.Namespace) -> str | None:
    """When speech played was generated slower than it plays (playback had to wait for it,
    as on a base M1 or M2 with the bf16 release): a line on what makes it faster.

    ``paced``: the frames of the segments played and the wall seconds their frames took,
    each segment's own (from joining the batch to its last frame): what playback waits
    for. The whole text's wall time would count the waits for a full player too."""
    frames, seconds = paced
    if frames < SLOW_NOTE_MIN_FRAMES:
        return None
    frame_s = tts.samples_per_frame / tts.sample_rate
    rtf = seconds / (frames * frame_s) * args.speed  # wall s per s of audio as it plays
    if not rtf > 1.05:
        return None
    bits = [spec.bits for spec in tts.quantized.values() if spec.mode == "affine"]
    if bits and min(bits) <= 4:
        return None  # already as small as convert makes it
    model = args.model or os.environ.get("VOXTRAL_MLX_MODEL") or DEFAULT_REPO
    out = f"{str(model).rstrip('/').rsplit('/', 1)[-1]}-4bit"
    return (
        f"{PROG}: note: speech was generated at {1 / rtf:.2f}x the speed it plays at on this "
        f"machine, so playback had to wait for it; a 4-bit conversion reads less than half "
        f"the bytes per frame and is faster: voxtral-mlx convert {shlex.quote(str(model))} "
        f"-o {shlex.quote(out)} --q-bits 4, then speak -m {shlex.quote(out)}"
    )


@contextlib.contextmanager
def _splitting_notice(args: argparse.Namespace, text: str) -> Iterator[None]:
    """A line saying why a long text is silent for a while (tens of seconds for tens of
    megabytes) on a terminal, erased once the text is split."""
    show = (
        isinstance(text, str)
        and len(text) > SPLIT_NOTICE_CHARS
        and not args.no_split
        and not args.quiet
        and _stderr_redraws()
    )
    if show:
        to_stderr(f"\r{PROG}: splitting {len(text):,} characters into segments\x1b[K")
    try:
        yield
    finally:
        if show:
            to_stderr("\r\x1b[K")


def _show_progress(args: argparse.Namespace, stream) -> bool:
    if args.quiet or not _stderr_redraws():
        return False
    if stream.live:  # not over text being typed on the terminal: the line would hide it
        typed = args.file in (None, "-") and sys.stdin is not None and sys.stdin.isatty()
        return not typed
    return len(stream.segments) > 1


def _stderr_redraws() -> bool:
    """A line on stderr can be redrawn in place (``\r``, ``ESC [K``): a terminal, but not
    a dumb one (Emacs' shell, some IDE consoles show the escape as text)."""
    if os.environ.get("TERM") == "dumb":
        return False
    return sys.stderr is not None and sys.stderr.isatty()


def _report(
    t, player, started: float, live: bool = False, segments: int = 1, speed: float = 1.0
) -> None:
    import mlx.core as mx

    whose = "first segment's prompt" if segments > 1 or live else "prompt"
    if t.prompt_tokens:  # 0: interrupted before its prefill was done
        queued = f" after {t.queued_s * 1000:.0f} ms in the queue" if t.queued_s >= 0.0005 else ""
        info(f"{whose}: {t.prompt_tokens} tokens, prefill {t.prefill_s * 1000:.0f} ms{queued}")
    if not t.frames:
        info("no audio was generated")
    else:
        info(f"first audio after {t.first_audio_s * 1000:.0f} ms")
        pauses = f" ({t.pause_s:.2f} s of it pauses between segments)" if t.pause_s else ""
        if speed != 1.0:
            pauses += f", {t.audio_s / speed:.2f} s at --speed {speed:g}"
        info(f"frames: {t.frames}, {t.ms_per_frame:.1f} ms/frame, audio {t.audio_s:.2f} s{pauses}")
        waiting = " (leaving out the waits for text)" if live else ""
        of_speech = " of the speech" if t.pause_s else ""
        info(
            f"wall {t.total_s:.2f} s{waiting}, real-time factor{of_speech} {t.rtf:.3f} "
            f"({1 / t.rtf if t.rtf else 0:.2f}x real time)"
        )
    # The process's peak (a request interrupted before its first chunk recorded none).
    peak = max(t.peak_memory_bytes, mx.get_peak_memory())
    shown = f"{peak / 2**30:.2f} GiB" if peak >= 2**30 else f"{peak / 2**20:.0f} MiB"
    info(f"peak memory {shown}")
    if player is not None:
        s = player.stats
        heard = ""
        if s.first_audio_at is not None:  # time to first audio at the speakers
            heard = f"first sound after {(s.first_audio_at - started) * 1000:.0f} ms, "
        info(
            f"playback: {heard}{s.underruns} underruns ({s.underrun_s:.2f} s of silence), "
            f"{s.device_xruns} device xruns, pre-roll {s.preroll_s * 1000:.0f} ms"
        )
