"""The command line, run as a new user would: in a subprocess, on a random checkpoint."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

import voxtral_mlx
from voxtral_mlx.audio.io import float_to_int16
from voxtral_mlx.segment import split_text

REPO = Path(__file__).resolve().parents[1]
ALSA_TEMPLATE = Path(__file__).with_name("alsa") / "asoundrc.in"
TEXT = "Hello from the command line."


def cli_env(extra: dict | None = None) -> dict:
    """The environment the CLI runs in: this checkout first on the path, plus ``extra``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.update(extra or {})
    return env


def run(*args, input=None, env=None, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "voxtral_mlx", *args],
        input=input,
        capture_output=True,
        env=cli_env(env),
        timeout=timeout,
        cwd=REPO,
    )


def start(*args, **kwargs) -> subprocess.Popen:
    """The CLI running, with pipes to its stdin and from its stderr (and ``kwargs``)."""
    return subprocess.Popen(
        [sys.executable, "-m", "voxtral_mlx", *args],
        stdin=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=cli_env(),
        cwd=REPO,
        **kwargs,
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "tiny"
    proc = run("random-checkpoint", str(out), "--size", "tiny", "--seed", "3")
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.decode().strip() == str(out)
    for name in ("params.json", "tekken.json", "consolidated.safetensors"):
        assert (out / name).is_file()
    assert (out / "voice_embedding" / "casual_male.pt").is_file()
    # mistral-common is a test dependency: its real vocabulary is used, and said so.
    assert "the real text vocabulary, from mistral-common" in proc.stderr.decode()
    assert len(json.loads((out / "tekken.json").read_text())["vocab"]) > 100_000
    return out


@pytest.fixture(scope="module")
def reference(model_dir):
    tts = voxtral_mlx.load(model_dir)
    return tts.synthesize(TEXT, "neutral_female", seed=5, max_frames=40)


def one_line_error(proc) -> str:
    err = proc.stderr.decode()
    assert proc.returncode == 1, (proc.returncode, err)
    assert err.count("\n") == 1 and err.startswith("voxtral-mlx: error: "), err
    return err


@pytest.mark.parametrize("ext", ["wav", "flac", "ogg", "mp3"])
def test_speak_writes_each_format(model_dir, reference, tmp_path, ext):
    out = tmp_path / f"hello.{ext}"
    args = ["speak", "-m", str(model_dir), "-v", "neutral_female", "--seed", "5"]
    proc = run(*args, "--max-frames", "40", "-o", str(out), *TEXT.split())
    assert proc.returncode == 0, proc.stderr.decode()
    audio, sr = sf.read(out, dtype="float32")
    assert sr == 24000
    expected = reference.audio
    if ext in ("wav", "flac"):
        assert np.array_equal(float_to_int16(audio), float_to_int16(expected))
    else:
        # Lossy codecs: the length (within the codec's padding) and a clear correlation.
        assert abs(len(audio) - len(expected)) < 4096
        n = min(len(audio), len(expected))
        corr = np.corrcoef(audio[:n], expected[:n])[0, 1]
        assert corr > 0.5, corr
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # no temp files left


def test_speak_speed_plays_each_segment_faster_or_slower_in_files_too(model_dir, tmp_path):
    """--speed: the same speech, each segment (with the pause before it) time-stretched,
    in the file as it would be played."""
    from voxtral_mlx.audio.stretch import SegmentStretcher

    text = "A first short sentence.\n\nThen a second one follows it.\n\nAnd a third ends it."
    tts = voxtral_mlx.load(model_dir)
    assert len(split_text(text)) == 3
    for speed in ("1.5", "0.75"):
        out = tmp_path / f"s{speed}.wav"
        args = ["speak", "-m", str(model_dir), "--seed", "4", "--max-frames", "12"]
        proc = run(*args, "--speed", speed, "-o", str(out), "--verbose", text)
        assert proc.returncode == 0, proc.stderr.decode()
        assert f"at --speed {speed}" in proc.stderr.decode()
        stretch = SegmentStretcher(float(speed), 24000)
        chunks = tts.stream(text, seed=4, max_frames=12, split=True, chunk_frames=5)
        expected = np.concatenate([stretch(c) for c in chunks])
        unstretched = tts.synthesize(text, seed=4, max_frames=12, split=True).audio
        assert len(expected) == pytest.approx(len(unstretched) / float(speed), abs=3 * 480)
        audio, _ = sf.read(out, dtype="float32")
        assert np.array_equal(float_to_int16(audio), float_to_int16(expected))
    proc = run("speak", "-m", str(model_dir), "--speed", "5", "-o", str(tmp_path / "x.wav"), "Hi.")
    assert "--speed must be a number from 0.25 to 4.0" in one_line_error(proc)
    assert not (tmp_path / "x.wav").exists()


def test_speak_verbose_reports_timings(model_dir, tmp_path):
    out = tmp_path / "v.wav"
    proc = run("speak", "-m", str(model_dir), "--seed", "1", "-o", str(out), "--verbose", "Hi.")
    assert proc.returncode == 0, proc.stderr.decode()
    err = proc.stderr.decode()
    for needle in ("loaded", "prefill", "ms/frame", "real-time factor", "peak memory"):
        assert needle in err, err
    assert "mistral layout (consolidated.safetensors), bfloat16 compute" in err, err
    assert "\nprompt: " in err, err


def test_verbose_says_the_prompt_is_the_first_segments(model_dir, tmp_path):
    """Of a text split in segments, the prompt and prefill shown are its first segment's."""
    out = tmp_path / "v.wav"
    text = "A first sentence of the text. " + "And then a second sentence comes. " * 8
    proc = run("speak", "-m", str(model_dir), "--seed", "1", "-o", str(out), "--verbose", text)
    assert proc.returncode == 0, proc.stderr.decode()
    assert "\nfirst segment's prompt: " in proc.stderr.decode()


def test_verbose_names_the_weights_read():
    """Which of two layouts in one directory was loaded was not said anywhere."""
    from types import SimpleNamespace

    import mlx.core as mx

    from voxtral_mlx.checkpoint import QuantSpec
    from voxtral_mlx.cli.loading import weights_summary

    tts = SimpleNamespace(
        layout="mlx-community",
        weight_files=tuple(Path(f"model-0000{i}-of-00003.safetensors") for i in (1, 2, 3)),
        quantized={"a": QuantSpec(4, 64), "b": QuantSpec(4, 64), "c": QuantSpec(8, 64)}
        | {"d": QuantSpec(4, 32, "mxfp4")},
        dtype=mx.bfloat16,
    )
    assert weights_summary(tts) == (
        "mlx-community layout (model-00001-of-00003.safetensors, "
        "model-00002-of-00003.safetensors, ... 1 more), 2 layers 4-bit, 1 layer 8-bit, "
        "1 layer mxfp4, bfloat16 compute"
    )


def test_text_from_file_and_stdin(model_dir, reference, tmp_path):
    f = tmp_path / "t.txt"
    f.write_text(TEXT + "\n")
    base = ["speak", "-m", str(model_dir), "-v", "neutral_female", "--seed", "5"]
    base += ["--max-frames", "40"]
    for extra, stdin in ((["-f", str(f)], None), (["-f", "-"], TEXT.encode())):
        out = tmp_path / "from-file.wav"
        proc = run(*base, *extra, "-o", str(out), input=stdin)
        assert proc.returncode == 0, proc.stderr.decode()
        audio, _ = sf.read(out, dtype="float32")
        # "TEXT\n" from a file is spoken as is (raw text): compare with the same text.
        assert len(audio) > 0
    proc = run(*base, "-o", "-", input=TEXT.encode())  # text piped, WAV to stdout
    assert proc.returncode == 0, proc.stderr.decode()
    audio, sr = sf.read(io.BytesIO(proc.stdout), dtype="float32")
    assert sr == 24000
    assert np.array_equal(float_to_int16(audio), float_to_int16(reference.audio))


@pytest.mark.parametrize("dash", [["-"], ["--", "-"]], ids=["dash", "after-double-dash"])
def test_a_lone_dash_reads_stdin(model_dir, reference, dash):
    """As ``cat -`` does: it spoke a dash and dropped the piped text, with exit status 0."""
    base = ["speak", "-m", str(model_dir), "-v", "neutral_female", "--seed", "5"]
    proc = run(*base, "--max-frames", "40", "-o", "-", *dash, input=TEXT.encode())
    assert proc.returncode == 0, proc.stderr.decode()
    audio, _ = sf.read(io.BytesIO(proc.stdout), dtype="float32")
    assert np.array_equal(float_to_int16(audio), float_to_int16(reference.audio))


def test_follow_speaks_piped_text_as_it_arrives(model_dir):
    """``--follow``: a sentence is spoken while the program writing the text is still
    writing; the rest is cut as it comes, and the audio is each segment's with its pause."""
    import select

    args = ["speak", "-m", str(model_dir), "-v", "neutral_female", "--seed", "5", "--follow"]
    proc = start(*args, "--max-frames", "3", "--raw", stdout=subprocess.PIPE)
    try:
        proc.stdin.write(b"Hello there. How ")
        proc.stdin.flush()
        assert select.select([proc.stdout], [], [], 120)[0], "no audio while the text flows"
        first = os.read(proc.stdout.fileno(), 1 << 20)
        proc.stdin.write(b"are you?\r\n\r\nBye.")  # one write: one read, one piece
        proc.stdin.close()
        rest = proc.stdout.read()
        assert proc.wait(120) == 0, proc.stderr.read().decode()
    finally:
        proc.kill()
    tts = voxtral_mlx.load(model_dir)
    parts = []
    for i, (text, pause) in enumerate((("Hello there.", 0.4), ("How are you?", 0.75), ("Bye.", 0))):
        parts.append(tts.synthesize(text, "neutral_female", seed=5 + i, max_frames=3).audio)
        parts.append(np.zeros(round(pause * 24000), np.float32))
    expected = float_to_int16(np.concatenate(parts))
    assert len(first) >= 2 * 1920  # at least a frame came before the text was all there
    assert np.array_equal(np.frombuffer(first + rest, "<i2"), expected)


def test_follow_decodes_text_split_anywhere():
    """Pieces cut inside a UTF-8 character, a byte-order mark or a Windows line end read
    as the whole text does; UTF-16 by its mark; bad bytes are a one-line error."""
    from voxtral_mlx.textinput import decode_text, text_pieces

    def pieces(raw: bytes, size: int) -> str:
        chunks = iter([raw[i : i + size] for i in range(0, len(raw), size)] + [b""])
        return "".join(text_pieces(lambda: next(chunks), "stdin"))

    text = "\ufeffCafé — naïve 日本語.\r\nNext line\r\n\r\nEnd\r"
    for raw in (text.encode("utf-8"), text.encode("utf-16"), "Ünï\r\n".encode("utf-32")):
        for size in (1, 2, 3, 5, 64):
            assert pieces(raw, size) == decode_text(raw, "stdin")
    with pytest.raises(voxtral_mlx.errors.InputError, match="stdin is not UTF-8 text"):
        pieces(b"ok \xff\xfe then", 1)
    # The text before bad bytes in the same read is given first (it is spoken).
    for raw in (b"Good text. \xff more", "Gööd.".encode("utf-16") + b"\x00\xd8A\x00"):
        reads, got = iter([raw, b""]), []
        with pytest.raises(voxtral_mlx.errors.InputError, match=r"is not UTF-(8|16) text"):
            got.extend(text_pieces(lambda reads=reads: next(reads), "stdin"))
        assert "".join(got).strip() in ("Good text.", "Gööd.")
    # So is the text before a NUL in the same read (it was dropped with it).
    for raw in (b"Good text. Bad\x00 more", "Good text. Bad\x00".encode("utf-16")):
        reads, got = iter([raw, b""]), []
        with pytest.raises(voxtral_mlx.errors.InputError, match="holds NUL"):
            got.extend(text_pieces(lambda reads=reads: next(reads), "stdin"))
        assert "".join(got) == "Good text. Bad"
    # A first read that cannot start a UTF-16/32 byte-order mark is text at once.
    reads = iter([b"Yo\n"])
    assert next(text_pieces(lambda: next(reads), "stdin")) == "Yo\n"
    with pytest.raises(voxtral_mlx.errors.InputError, match="holds NUL bytes"):
        pieces(b"a\x00b c d", 2)
    # With a UTF-16 byte-order mark the NUL is a character: no "UTF-16 without a mark".
    for split in (1, 3):
        with pytest.raises(voxtral_mlx.errors.InputError, match="holds NUL characters") as e:
            pieces("Hi\x00 there.".encode("utf-16"), split)
        assert "UTF-16" not in str(e.value)
    with pytest.raises(voxtral_mlx.errors.InputError, match="holds NUL characters"):
        decode_text("Hi\x00 there.".encode("utf-32"), "text file t.txt")


def test_every_source_gets_one_kind_of_line_end_and_no_nul(monkeypatch):
    """Arguments kept "\r\n" (each "\r" a prompt token; the docstring said every source
    loses it), and a text-only stdin (embedded use) let NUL characters through."""
    from voxtral_mlx.textinput import read_text

    assert read_text(None, ["line one\r\nline two\rthree"]) == "line one\nline two\nthree"
    monkeypatch.setattr(sys, "stdin", io.StringIO("\ufeffa\r\nb"))
    assert read_text("-", []) == "a\nb"
    monkeypatch.setattr(sys, "stdin", io.StringIO("a\x00b"))
    with pytest.raises(voxtral_mlx.errors.InputError, match="stdin holds NUL characters"):
        read_text("-", [])


def test_an_empty_file_or_stdin_is_named_as_such(monkeypatch, tmp_path):
    """Nothing at all was read: "text is empty (nothing but spaces, invisible or control
    characters ...)" sent the user looking for invisible characters."""
    from voxtral_mlx.textinput import read_text

    (tmp_path / "t.txt").write_bytes(b"")
    with pytest.raises(voxtral_mlx.errors.InputError) as e:
        read_text(str(tmp_path / "t.txt"), [])
    assert (
        str(e.value)
        == f"text file {tmp_path / 't.txt'} is empty: give a file with some text to speak"
    )
    for stdin in (io.StringIO(""), io.TextIOWrapper(io.BytesIO(b""))):
        monkeypatch.setattr(sys, "stdin", stdin)
        with pytest.raises(voxtral_mlx.errors.InputError, match=r"^stdin is empty: pipe some"):
            read_text("-", [])
    (tmp_path / "t.txt").write_bytes(b" \n")  # not empty: judged later, as all text is
    assert read_text(str(tmp_path / "t.txt"), []) == " \n"


@pytest.mark.parametrize(
    ("raw", "spoken"),
    [
        ("\x1b[1;31mHello\x1b[0m world.", "Hello world."),  # colours
        ("a\x1b[2K\x1b[1Gb \x1b[?25lc\x1b[?25h", "a b c"),  # line erased, cursor moved
        ("x\x1b[10Cy", "x y"),  # a cursor move: the words stay apart
        ("Title\x1b]0;window title\x07 here", "Title here"),  # OSC ended by BEL
        ("a \x1b]8;;https://x.y/\x1b\\link\x1b]8;;\x1b\\ b", "a link b"),  # OSC 8, ST
        ("\x1b(Bcharset \x1b=keypad", "charset keypad"),  # two-character escapes
        ("\x9b1mC1 CSI\x9b0m", "C1 CSI"),
        ("B\bBo\bol\bld\bd and _\bu_\bn_\bd_\be_\br", "Bold and under"),  # man's overstrike
        ("bell\x07 del\x7f\ttab\npage\x0cbreak\x0bvt", "bell del\ttab\npage\nbreak\nvt"),
        ("lone \x1b escape", "lone  escape"),
        # A stray ESC before P, X, ^, _ or ] (as if a control string began): it ends at the
        # line's end, and never ended, only the escape goes (it took all the text after it).
        ("\x1bParis is nice.\nThen Rome.", "aris is nice.\nThen Rome."),
        ("Press \x1bPlay to start", "Press lay to start"),
        ("x\bx abc\b\b\bdef\nz", "x def\nz"),  # a run of backspaces, cut anywhere
        ("First line\x85second", "First line\nsecond"),  # NEL
        ("plain: café, 日本語, emoji 🙂.", "plain: café, 日本語, emoji 🙂."),
    ],
)
def test_terminal_codes_are_not_spoken(raw, spoken):
    """Escape sequences and control characters reached the model as text: colours from a
    program writing into the pipe were spoken as "[1;31m", a man page as doubled letters."""
    from voxtral_mlx.textinput import read_text, text_pieces, without_terminal_codes

    assert without_terminal_codes(raw) == spoken
    assert read_text(None, [raw]) == spoken
    data = raw.encode()
    # --follow: cut anywhere, inside a sequence too. (A backspace that begins a read cannot
    # erase what an earlier read gave: holding text back for it held a line still being
    # written, a prompt waiting for its answer unspoken.)
    for size in (64,) if b"\b" in data else (1, 2, 3, 7, 64):
        chunks = [data[i : i + size] for i in range(0, len(data), size)]
        reads = iter([*chunks, b""])
        assert "".join(text_pieces(lambda reads=reads: next(reads), "stdin")) == spoken


def test_follow_hands_on_text_after_backspaces_at_once():
    """Once a backspace had come (a spinner), --follow held each later line until its
    newline: a paragraph still being written, or a prompt waiting for an answer, went
    unspoken for as long as the writer waited."""
    from voxtral_mlx.textinput import text_pieces

    reads = iter([b"Working |\b/\b-\b\\\bdone.\n", b"Type yes to continue? "])
    pieces = text_pieces(lambda: next(reads), "stdin")
    assert next(pieces) == "Working done.\n"
    assert next(pieces) == "Type yes to continue? "  # before any more input comes


def test_piped_text_with_colours_speaks_as_plain_text(model_dir, reference):
    """A program colouring its output into the pipe: the audio is the plain text's."""
    base = ["speak", "-m", str(model_dir), "-v", "neutral_female", "--seed", "5"]
    coloured = f"\x1b]0;title\x07\x1b[1m{TEXT[:5]}\x1b[0m{TEXT[5:]}\x1b[K".encode()
    proc = run(*base, "--max-frames", "40", "-o", "-", input=coloured)
    assert proc.returncode == 0, proc.stderr.decode()
    audio, _ = sf.read(io.BytesIO(proc.stdout), dtype="float32")
    assert np.array_equal(float_to_int16(audio), float_to_int16(reference.audio))


def test_nul_bytes_in_followed_text_are_judged_from_the_streams_start():
    """A read beginning at an odd byte of UTF-16LE looked like UTF-16BE; text decoded
    already (a stdin of Python objects) is told of NUL characters, not UTF-16 bytes."""
    from voxtral_mlx.textinput import text_pieces

    reads = iter([b"H", "Hello world".encode("utf-16-le")[1:], b""])
    with pytest.raises(voxtral_mlx.errors.InputError) as e:
        list(text_pieces(lambda: next(reads), "stdin"))
    assert "UTF-16LE without a byte-order mark" in str(e.value)
    lines = iter(["Hello\x00 world.\n", ""])
    with pytest.raises(voxtral_mlx.errors.InputError) as e:
        list(text_pieces(lambda: next(lines), "stdin"))
    assert "stdin holds NUL characters" in str(e.value)


def test_follow_refuses_a_folder_before_the_model_loads(tmp_path):
    """os.open() takes a folder: --follow -f DIR failed at its first read, after the
    model had loaded (minutes for the real one), with no fix named."""
    from voxtral_mlx.textinput import text_source

    with pytest.raises(voxtral_mlx.errors.InputError) as e:
        text_source(str(tmp_path), [])
    assert str(e.value) == (
        f"cannot read text file {tmp_path}: Is a directory; pass a readable text file, or - "
        "for stdin"
    )


@pytest.mark.parametrize(
    "raw, words",
    [
        ("Hello world.".encode("utf-16-le"), "looks like UTF-16LE without a byte-order mark"),
        ("Hello world.".encode("utf-16-be"), "looks like UTF-16BE without a byte-order mark"),
        ("Good day, sir.".encode("utf-16-be"), "iconv -f UTF-16BE -t UTF-8"),
        (b"Hello\x00 there.", "which no text has (binary data in it"),
        (b"\x00" * 100, "remove them (e.g. tr -d '\\000')"),
        (b"Hi\x00", "which no text has (binary data in it"),  # too short to tell
        (b"ab\x00c", "which no text has (binary data in it"),
        (b"a\x00b\x00cd\x00\x00ef\x00\x00", "which no text has (binary data in it"),  # both sides
    ],
    ids=[
        "utf16le",
        "utf16be",
        "utf16be-iconv",
        "stray-nul",
        "all-nuls",
        "short",
        "short2",
        "mixed",
    ],
)
def test_nul_bytes_are_told_apart(raw, words):
    """Every NUL got the advice iconv -f UTF-16LE: wrong for UTF-16BE (garbage out) and
    for a stray NUL in UTF-8 text. Whole and followed text alike."""
    from voxtral_mlx.textinput import decode_text, text_pieces

    with pytest.raises(voxtral_mlx.errors.InputError) as e:
        decode_text(raw, "text file t.txt")
    assert words in str(e.value)
    reads = iter([raw, b""])
    with pytest.raises(voxtral_mlx.errors.InputError) as e:
        list(text_pieces(lambda: next(reads), "stdin"))
    assert words in str(e.value) and str(e.value).startswith("stdin holds NUL bytes")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_follow_from_a_fifo_does_not_wait_for_its_writer_before_the_model_loads(tmp_path):
    """Opening a FIFO waits for a writer: ``-f FIFO --follow`` checks it and opens it at
    its first read, so the model loads while the writer has yet to come."""
    from voxtral_mlx.textinput import text_source

    fifo = tmp_path / "say"
    os.mkfifo(fifo)
    got: list = []
    checked = threading.Thread(target=lambda: got.append(text_source(str(fifo), [])))
    checked.start()
    checked.join(10)
    try:
        assert not checked.is_alive(), "checking the FIFO waited for a writer"
    finally:
        if checked.is_alive():  # let it go: open the writing end once
            os.close(os.open(fifo, os.O_WRONLY))
    read, name = got[0]
    assert name == f"text file {fifo}"
    writer = threading.Thread(target=fifo.write_bytes, args=(b"Hello. ",), daemon=True)
    writer.start()  # its open waits for the first read, which opens the reading end
    assert read() == b"Hello. " and read() == b""
    writer.join(10)


def test_follow_keeps_the_audio_before_bad_text(model_dir, tmp_path):
    """Text that turns out not to be UTF-8 midway: the file keeps the speech before it, and
    the one-line error says so (as Ctrl-C does)."""
    out = tmp_path / "bad.wav"
    proc = start("speak", "-m", str(model_dir), "--follow", "--max-frames", "3", "-o", str(out))
    try:
        proc.stdin.write(b"Hello there. How are you today? ")
        proc.stdin.flush()
        time.sleep(1.0)
        proc.stdin.write(b"Bad \xff\xfe byte. More.")
        proc.stdin.close()
        assert proc.wait(120) == 1
    finally:
        proc.kill()
    err = proc.stderr.read().decode()
    assert err.count("\n") == 1 and "stdin is not UTF-8 text; convert it first" in err, err
    assert f"s of audio of the text before it in {out}" in err
    audio, _ = sf.read(out, dtype="float32")
    assert len(audio) > 0 and [p.name for p in tmp_path.iterdir()] == ["bad.wav"]


def test_raw_pcm_to_stdout(model_dir, reference):
    args = ["speak", "-m", str(model_dir), "-v", "neutral_female", "--seed", "5"]
    proc = run(*args, "--max-frames", "40", "--raw", TEXT)
    assert proc.returncode == 0, proc.stderr.decode()
    pcm = np.frombuffer(proc.stdout, dtype="<i2")
    assert np.array_equal(pcm, float_to_int16(reference.audio))


def test_voices_listing(model_dir):
    proc = run("voices", "-m", str(model_dir))
    assert proc.returncode == 0, proc.stderr.decode()
    lines = proc.stdout.decode().splitlines()
    assert len(lines) == 20
    assert any(line.split()[:2] == ["fr_female", "fr"] for line in lines)
    assert any(line.split()[:2] == ["casual_male", "en"] for line in lines)
    proc2 = run("speak", "-m", str(model_dir), "-v", "?")
    assert proc2.returncode == 0 and proc2.stdout == proc.stdout


def test_listing_voices_reads_the_voice_files_not_the_weights(model_dir, tmp_path, capsys):
    """Listing 20 voices read the whole model (8 GB on a Mac, and a download of it when not
    cached): the weights are not read now, so a model whose weight file is damaged still
    lists its voices (a damaged voice is still reported); options that only loading the
    model used are refused."""
    from voxtral_mlx import cli

    model = tmp_path / "m"
    shutil.copytree(model_dir, model, ignore=shutil.ignore_patterns("consolidated.safetensors"))
    (model / "consolidated.safetensors").write_bytes(b"\0" * 64)
    assert cli.main(["voices", "-m", str(model)]) == 0
    listed = capsys.readouterr()
    assert len(listed.out.splitlines()) == 20 and listed.err == ""
    (model / "voice_embedding" / "fr_male.pt").write_bytes(b"damaged")
    assert cli.main(["speak", "-m", str(model), "-v", "?"]) == 0
    listed = capsys.readouterr()
    assert len(listed.out.splitlines()) == 19 and "'fr_male'" in listed.err
    with pytest.raises(SystemExit) as exit_:
        cli.main(["voices", "-m", str(model), "--dtype", "float32"])
    assert exit_.value.code == 1
    assert "unrecognized arguments: --dtype" in capsys.readouterr().err


def test_voices_of_a_model_without_voices_is_an_error(model_dir, tmp_path):
    """Not an empty listing with exit 0: the same error speak gives."""
    bare = tmp_path / "bare"
    shutil.copytree(model_dir, bare, ignore=shutil.ignore_patterns("voice_embedding"))
    for args in (["voices"], ["speak", "-v", "?"]):
        proc = run(*args, "-m", str(bare))
        assert "has no voices in voice_embedding/" in one_line_error(proc)
        assert proc.stdout == b""
    # Voices kept under another folder's name: that folder is named.
    shutil.copytree(model_dir / "voice_embedding", bare / "voices")
    proc = run("speak", "-m", str(bare), "Hi.", "-o", str(tmp_path / "x.wav"))
    assert "its voices/ folder holds voice files: rename it voice_embedding" in (
        one_line_error(proc)
    )
    assert not (tmp_path / "x.wav").exists()


@pytest.mark.parametrize(
    "args, needle",
    [
        (["-v", "nobody", "Hi."], "unknown voice 'nobody'"),
        (["   "], "text is empty"),
        (["-v is cool"], "'-v is cool' was read as the option -v: text that starts with '-' goes"),
        (["-f", "/nonexistent/text.txt"], "not found: check the path"),
        (["-f", "/"], "cannot read text file /: Is a directory; pass a readable text file"),
        (["--follow", "-f", "/"], "cannot read text file /: Is a directory; pass a readable"),
        (["--follow", "-f", "/nonexistent/text.txt"], "not found: check the path"),
        (["--follow", "Hi."], "text given as arguments is all there already: drop --follow"),
        (["--follow", "--no-split", "-f", "-"], "--no-split makes one utterance"),
    ],
)
def test_bad_input_is_one_line_and_leaves_no_file(model_dir, tmp_path, args, needle):
    out = tmp_path / "out.wav"
    proc = run("speak", "-m", str(model_dir), "-o", str(out), *args)
    assert needle in one_line_error(proc)
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_missing_model_and_unwritable_output(model_dir, tmp_path):
    proc = run("speak", "-m", str(tmp_path / "no-model"), "-o", str(tmp_path / "a.wav"), "Hi.")
    assert "does not exist" in one_line_error(proc)
    proc = run("speak", "-m", str(model_dir), "-o", str(tmp_path / "no" / "a.wav"), "Hi.")
    assert "does not exist" in one_line_error(proc)
    proc = run("speak", "-m", str(model_dir), "-o", str(tmp_path / "a.xyz"), "Hi.")
    assert ".wav" in one_line_error(proc)
    assert list(tmp_path.iterdir()) == []


def test_convert_voices_cli(model_dir, tmp_path):
    proc = run("convert-voices", str(model_dir / "voice_embedding"), "-o", str(tmp_path / "v"))
    assert proc.returncode == 0, proc.stderr.decode()
    written = sorted((tmp_path / "v").glob("*.safetensors"))
    assert len(written) == 20
    written[0].write_bytes(b"mine")
    proc = run("convert-voices", str(model_dir / "voice_embedding"), "-o", str(tmp_path / "v"))
    error = one_line_error(proc)
    assert written[0].name in error and "--force" in error
    assert written[0].read_bytes() == b"mine"
    proc = run(
        "convert-voices", str(model_dir / "voice_embedding"), "-o", str(tmp_path / "v"), "--force"
    )
    assert proc.returncode == 0, proc.stderr.decode()
    assert written[0].read_bytes()[:8] != b"mine"


def _alsa_env(tmp_path: Path) -> tuple[dict, Path]:
    rec = tmp_path / "recorded.raw"
    conf = tmp_path / "asoundrc"
    conf.write_text(ALSA_TEMPLATE.read_text().replace("@RECORD_PATH@", str(rec)))
    return {"ALSA_CONFIG_PATH": str(conf), "JACK_NO_START_SERVER": "1"}, rec


def _portaudio_available() -> bool:
    try:
        import sounddevice  # noqa: F401
    except OSError:
        return False
    return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ALSA recording device")
def test_speak_plays_through_a_real_output_device(model_dir, reference, tmp_path):
    """`voxtral-mlx speak TEXT` with no -o plays through PortAudio, as `say` does. The ALSA
    device records what it was given; it must be the synthesized audio, in order."""
    if not _portaudio_available():
        if os.environ.get("CI"):
            pytest.fail("PortAudio (libportaudio2) must be installed in CI")
        pytest.skip("PortAudio is not installed")
    env, rec = _alsa_env(tmp_path)
    args = ["speak", "-m", str(model_dir), "-v", "neutral_female", "--seed", "5"]
    proc = run(*args, "--max-frames", "40", "--verbose", TEXT, env=env)
    assert proc.returncode == 0, proc.stderr.decode()
    err = proc.stderr.decode()
    for needle in ("first audio after", "first sound after", "underruns", "real-time factor"):
        assert needle in err, err
    assert re.search(r"\d+ device xruns, pre-roll \d+ ms", err), err
    recorded = np.fromfile(rec, dtype="<i2").astype(np.int32)
    rec.unlink()
    # The null device is not clocked: it drains instantly, so silence appears wherever the
    # generator was slower than the device. Drop long zero runs and compare the rest.
    nonzero = np.flatnonzero(recorded)
    span = recorded[nonzero[0] : nonzero[-1] + 1]
    is_zero = span == 0
    keep = np.ones(len(span), bool)
    start = None
    for i, z in enumerate(np.append(is_zero, False)):
        if z and start is None:
            start = i
        elif not z and start is not None:
            if i - start >= 64:
                keep[start:i] = False
            start = None
    played = span[keep]
    # The player clips to [-1, 1]; ALSA's plug converts float to int16 by truncation:
    # within one step of ours.
    expected = np.clip(reference.audio.astype(np.float64), -1.0, 1.0) * 32768
    assert abs(len(played) - len(expected)) <= 2, (len(played), len(expected))
    n = min(len(played), len(expected))
    offset = 0 if len(played) == len(expected) else None
    if offset is None:
        offset = int(
            np.argmin(
                [
                    np.abs(played[k : k + n - 2] - expected[: n - 2]).max()
                    for k in range(len(played) - n + 1)
                ]
            )
        )
    assert np.abs(played[offset : offset + n - 2] - expected[: n - 2]).max() <= 1.0


def test_device_listing_and_bad_device(model_dir, tmp_path):
    if not sys.platform.startswith("linux") or not _portaudio_available():
        pytest.skip("needs PortAudio with the test ALSA configuration")
    env, _rec = _alsa_env(tmp_path)
    proc = run("speak", "-a", "?", env=env)
    assert proc.returncode == 0, proc.stderr.decode()
    assert "voxtral_record" in proc.stdout.decode()
    proc = run("speak", "-m", str(model_dir), "-a", "no-such-device", "Hi.", env=env)
    assert "no-such-device" in one_line_error(proc)


def test_byte_order_mark_is_not_text(model_dir, reference, tmp_path):
    """Editors on Windows save UTF-8 with a BOM: it is neither spoken nor 'text'."""
    base = ["speak", "-m", str(model_dir), "-v", "neutral_female", "--seed", "5"]
    base += ["--max-frames", "40"]
    only = tmp_path / "only-bom.txt"
    only.write_bytes("\ufeff\n".encode())
    out = tmp_path / "out.wav"
    for extra, stdin in ((["-f", str(only)], None), (["-f", "-"], only.read_bytes())):
        proc = run(*base, *extra, "-o", str(out), input=stdin)
        assert "text is empty" in one_line_error(proc)
        assert not out.exists()
    with_bom = tmp_path / "bom.txt"
    with_bom.write_bytes(("\ufeff" + TEXT).encode())
    for extra, stdin in ((["-f", str(with_bom)], None), ([], with_bom.read_bytes())):
        proc = run(*base, *extra, "-o", str(out), input=stdin)
        assert proc.returncode == 0, proc.stderr.decode()
        audio, _ = sf.read(out, dtype="float32")
        assert np.array_equal(float_to_int16(audio), float_to_int16(reference.audio))


def test_a_windows_text_file_sounds_like_the_same_text_saved_on_a_mac(model_dir, tmp_path):
    """CRLF (Windows) and CR (classic Mac) line ends, and Notepad's UTF-16 with its
    byte-order mark: the same audio as the LF UTF-8 file (a \\r would be a prompt token)."""
    lines = ["The first line is here.", "A second one follows it.", "And a third."]
    base = ["speak", "-m", str(model_dir), "--seed", "5", "--max-frames", "4"]
    files = {
        "mac.txt": "\n".join(lines).encode(),
        "crlf.txt": "\r\n".join(lines).encode(),
        "cr.txt": "\r".join(lines).encode(),
        "notepad.txt": "\r\n".join(lines).encode("utf-16"),
        "utf16be.txt": b"\xfe\xff" + "\r\n".join(lines).encode("utf-16-be"),
        "utf32.txt": "\r\n".join(lines).encode("utf-32"),  # its mark begins as UTF-16's
    }
    audio = {}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        out = tmp_path / f"{name}.wav"
        proc = run(*base, "-f", str(tmp_path / name), "-o", str(out))
        assert proc.returncode == 0, (name, proc.stderr.decode())
        audio[name] = sf.read(out, dtype="float32")[0]
    proc = run(*base, "-o", str(tmp_path / "stdin.wav"), input=files["crlf.txt"])
    assert proc.returncode == 0, proc.stderr.decode()
    audio["stdin"] = sf.read(tmp_path / "stdin.wav", dtype="float32")[0]
    for name, got in audio.items():
        assert np.array_equal(got, audio["mac.txt"]), name
    (tmp_path / "odd.txt").write_bytes(files["notepad.txt"][:-1])  # cut inside a character
    proc = run(*base, "-f", str(tmp_path / "odd.txt"), "-o", str(tmp_path / "odd.wav"))
    assert "odd.txt is not UTF-16 text" in one_line_error(proc)


def _fake_sounddevice(tmp_path: Path, body: str) -> dict:
    """An environment whose `import sounddevice` runs ``body`` instead of the real one."""
    d = tmp_path / "fake_sd"
    d.mkdir()
    (d / "sounddevice.py").write_text(body)
    return {"PYTHONPATH": os.pathsep.join([str(d), str(REPO)])}


def test_missing_portaudio_is_a_one_line_error(model_dir, tmp_path):
    env = _fake_sounddevice(tmp_path, "raise OSError('PortAudio library not found')\n")
    out = tmp_path / "x.wav"
    for args in (["Hi."], ["--play", "-o", str(out), "Hi."], ["-a", "?"]):
        err = one_line_error(run("speak", "-m", str(model_dir), *args, env=env))
        assert "PortAudio" in err and "-o FILE" in err, err
        assert not out.exists()
    # Writing a file never needs PortAudio.
    proc = run("speak", "-m", str(model_dir), "-o", str(out), "Hi.", env=env)
    assert proc.returncode == 0, proc.stderr.decode()


def test_no_output_device_is_a_one_line_error(model_dir, tmp_path):
    env = _fake_sounddevice(
        tmp_path,
        "class PortAudioError(Exception):\n    pass\n\n\n"
        "def query_devices(device=None, kind=None):\n"
        "    if kind == 'output':\n"
        "        raise PortAudioError('Error querying device -1')\n"
        "    return [{'name': 'Mic', 'max_input_channels': 2, 'max_output_channels': 0}]\n",
    )
    for args in (["Hi."], ["-a", "?"], ["-a", "0", "Hi."]):
        err = one_line_error(run("speak", "-m", str(model_dir), *args, env=env))
        assert "no audio output device" in err and "-o FILE" in err, err
    # With -o given, "write a file instead (-o FILE)" told the user to do what they did.
    out = tmp_path / "both.wav"
    err = one_line_error(
        run("speak", "-m", str(model_dir), "--play", "-o", str(out), "Hi.", env=env)
    )
    assert f"no audio output device found; connect one, or drop --play to only write {out}" in err
    assert not out.exists()


# A device with one output. It plays ``BLOCKS`` callbacks' worth, then goes away (unplugged
# headphones), or with BLOCKS None whatever it is given until stopped; ``LOG``, when set,
# gets the rate each stream opens at.
_FAKE_OUTPUT_DEVICE = """
import itertools
import threading
import numpy as np

BLOCKS = {blocks}
LOG = {log!r}


class PortAudioError(Exception):
    pass


def query_devices(device=None, kind=None):
    dev = {{"name": "Speakers", "index": 0, "max_input_channels": 0, "max_output_channels": 2}}
    return dev if kind == "output" else [dev]


class OutputStream:
    latency = 0.01

    def __init__(self, callback, finished_callback, blocksize, samplerate, **kwargs):
        self.callback, self.finished, self.blocksize = callback, finished_callback, blocksize
        self.stopped = threading.Event()
        if LOG is not None:
            with open(LOG, "a") as f:
                f.write(f"{{samplerate}}\\n")

    def start(self):
        def run():
            for _ in itertools.count() if BLOCKS is None else range(BLOCKS):
                if self.stopped.wait(0.001):
                    break
                self.callback(np.zeros((self.blocksize, 1), np.float32), self.blocksize, None, 0)
            self.finished()

        threading.Thread(target=run, daemon=True).start()

    def abort(self):
        self.stopped.set()

    stop = abort

    def close(self):
        self.stopped.set()
"""


def test_speak_plays_at_the_models_sample_rate(model_dir, tmp_path):
    """The player was opened before the model loaded, at the release's 24 kHz: a model of
    another rate played too fast (say() opened it at the model's)."""
    model = Path(shutil.copytree(model_dir, tmp_path / "model16k"))
    params = json.loads((model / "params.json").read_text())
    encoding = params["multimodal"]["audio_model_args"]["audio_encoding_args"]
    encoding["sampling_rate"], encoding["frame_rate"] = 16000, 16000 / 1920
    params["multimodal"]["audio_tokenizer_args"]["sampling_rate"] = 16000
    (model / "params.json").write_text(json.dumps(params))
    log = tmp_path / "rates.log"
    env = _fake_sounddevice(tmp_path, _FAKE_OUTPUT_DEVICE.format(blocks=None, log=str(log)))
    proc = run("speak", "-m", str(model), "--max-frames", "3", "-q", "Hi.", env=env)
    assert proc.returncode == 0, proc.stderr.decode()
    rates = log.read_text().split()
    assert rates and rates[-1] == "16000", rates


def test_a_device_lost_while_playing_keeps_the_file_being_written(endless_model_dir, tmp_path):
    # The file beside the playback is the user's: a vanished device must not delete it.
    env = _fake_sounddevice(tmp_path, _FAKE_OUTPUT_DEVICE.format(blocks=2, log=None))
    out = tmp_path / "both.wav"
    proc = run(
        "speak", "-m", str(endless_model_dir), "--max-frames", "30", "--no-split",
        "--play", "-o", str(out), "A long sentence to read aloud.", env=env,
    )  # fmt: skip
    err = one_line_error(proc)
    assert "the audio stream ended unexpectedly" in err, err
    assert out.exists(), err
    audio, rate = sf.read(out, dtype="float32")
    assert rate == 24000 and len(audio) > 0
    seconds = re.search(r"(?:kept|all) ([0-9.]+) s of audio", err)
    assert seconds and float(seconds.group(1)) == pytest.approx(len(audio) / rate, abs=0.05)
    assert str(out) in err and not list(tmp_path.glob(".*both*"))


@pytest.fixture(scope="module")
def endless_model_dir(tmp_path_factory):
    """A tiny checkpoint whose END never fires: generation runs to --max-frames."""
    out = tmp_path_factory.mktemp("cli-endless") / "tiny"
    proc = run("random-checkpoint", str(out), "--size", "tiny", "--seed", "3", "--suppress-end")
    assert proc.returncode == 0, proc.stderr.decode()
    return out


def _interrupt(
    args: list[str], env: dict, ready, sig: int = signal.SIGINT, timeout: float = 120
) -> tuple[int, str, float]:
    """Start the CLI, send ``sig`` once ``ready()``; (exit code, stderr, seconds to exit)."""
    # SIGINT back to its default first: pytest run as a shell's background job inherits it
    # ignored, and Python then never turns it into KeyboardInterrupt.
    launcher = (
        "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
        "os.execv(sys.executable, [sys.executable, '-m', 'voxtral_mlx', *sys.argv[1:]])"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", launcher, *args],
        env=cli_env(env),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + timeout
        while not ready():
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "never got ready"
            time.sleep(0.02)
        t0 = time.monotonic()
        proc.send_signal(sig)
        code = proc.wait(timeout=30)
        return code, proc.stderr.read().decode(), time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _partial(tmp_path: Path, stem: str) -> list[Path]:
    return [p for p in tmp_path.iterdir() if p.name.startswith(f".{stem}.partial-")]


@pytest.mark.parametrize(
    "sig, code",
    [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGQUIT, 131)],
    ids=["ctrl-c", "sigterm", "ctrl-backslash"],
)
def test_ctrl_c_keeps_a_valid_file_of_what_was_finished(endless_model_dir, tmp_path, sig, code):
    """Ctrl-C (and SIGTERM, from `timeout` or `kill`, and Ctrl-\\) keep what was finished as a
    valid file and never leave the hidden temp file behind."""
    chapter = tmp_path / "chapter.txt"
    chapter.write_text("A sentence of a long chapter, read aloud. " * 40)
    out = tmp_path / "chapter.flac"
    args = ["speak", "-m", str(endless_model_dir), "-f", str(chapter), "-o", str(out)]
    args += ["--seed", "1", "--max-frames", "2000"]

    def ready() -> bool:
        return any(p.stat().st_size > 50_000 for p in _partial(tmp_path, "chapter"))

    returncode, err, _ = _interrupt(args, {}, ready, sig)
    assert returncode == code, err
    assert err.startswith("voxtral-mlx: error: interrupted: kept ") and err.count("\n") == 1
    audio, sr = sf.read(out, dtype="float32")
    assert sr == 24000 and len(audio) > 0
    assert not _partial(tmp_path, "chapter")


def test_ctrl_c_with_verbose_reports_what_ran(endless_model_dir, tmp_path):
    out = tmp_path / "long.wav"
    args = ["speak", "-m", str(endless_model_dir), "-o", str(out), "--verbose"]
    args += ["--seed", "1", "--max-frames", "2000", "Interrupted while verbose."]

    def ready() -> bool:
        return any(p.stat().st_size > 50_000 for p in _partial(tmp_path, "long"))

    returncode, err, _ = _interrupt(args, {}, ready)
    lines = err.splitlines()
    assert returncode == 130 and lines[-1].startswith("voxtral-mlx: error: interrupted: kept ")
    frames = [line for line in lines if line.startswith("frames: ")]
    assert len(frames) == 1, err
    reported = int(frames[0].split()[1].rstrip(","))
    kept = sf.info(out).frames  # a chunk taken but not yet written when Ctrl-C came is lost
    assert kept % 1920 == 0 and 0 < kept <= reported * 1920, (kept, reported)


def test_verbose_after_an_interrupt_before_any_audio_shows_no_made_up_figures(capsys):
    """Ctrl-C during the prefill: no "0 tokens", "0 ms/frame" nor infinite real-time
    factor, and the memory the process did use."""
    import mlx.core as mx

    from voxtral_mlx.cli.speak import _report
    from voxtral_mlx.engine import Timings

    held = mx.zeros(1 << 20)  # 4 MiB, so that the process's peak is not 0
    mx.eval(held)
    _report(Timings(), None, 0.0)
    err = capsys.readouterr().err
    assert err.splitlines()[0] == "no audio was generated", err
    assert "tokens" not in err and "ms/frame" not in err and "inf" not in err
    assert err.splitlines()[-1].startswith("peak memory ") and "peak memory 0 MiB" not in err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ALSA recording device")
def test_ctrl_c_during_playback_stops_promptly(endless_model_dir, tmp_path):
    if not _portaudio_available():
        pytest.skip("PortAudio is not installed")
    conf = tmp_path / "asoundrc"
    # /dev/null: the unclocked test device would record gigabytes of silence meanwhile.
    conf.write_text(ALSA_TEMPLATE.read_text().replace("@RECORD_PATH@", os.devnull))
    env = {"ALSA_CONFIG_PATH": str(conf), "JACK_NO_START_SERVER": "1"}
    out = tmp_path / "both.wav"
    args = ["speak", "-m", str(endless_model_dir), "--seed", "1", "--max-frames", "2000"]
    args += ["-a", "default", "--play", "-o", str(out), "Playing until interrupted."]

    def ready() -> bool:
        return any(p.stat().st_size > 100_000 for p in _partial(tmp_path, "both"))

    code, err, seconds = _interrupt(args, env, ready)
    assert code == 130, err
    assert err.startswith("voxtral-mlx: error: interrupted: kept ") and err.count("\n") == 1, err
    assert seconds < 5.0  # 0.1-0.2 s on an idle machine; loaded CI machines are slower
    assert sf.info(out).frames > 0


@pytest.mark.parametrize("frames", ["0", "-3"])
def test_max_frames_below_one_is_an_error(model_dir, tmp_path, frames):
    out = tmp_path / "y.wav"
    proc = run("speak", "-m", str(model_dir), "Hello.", "-o", str(out), "--max-frames", frames)
    assert "--max-frames" in one_line_error(proc)
    assert list(tmp_path.iterdir()) == []


def test_no_audio_at_all_leaves_no_file(model_dir, tmp_path, monkeypatch, capsys):
    """END on the first frame: a one-line error and no (empty) output file."""
    from voxtral_mlx import cli
    from voxtral_mlx.tts import VoxtralTTS

    original = VoxtralTTS.stream

    def end_at_once(self, *args, **kwargs):
        return original(self, *args, **{**kwargs, "max_frames": 0})

    monkeypatch.setattr(VoxtralTTS, "stream", end_at_once)
    out = tmp_path / "y.wav"
    assert cli.main(["speak", "-m", str(model_dir), "Hello.", "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no audio" in err, err
    assert list(tmp_path.iterdir()) == []


def test_a_full_wav_file_keeps_what_it_holds(endless_model_dir, tmp_path, monkeypatch, capsys):
    """Past WAV's 4 GiB (here shrunk to half a second) the file is kept, not deleted."""
    from voxtral_mlx import cli
    from voxtral_mlx.audio import io as aio

    monkeypatch.setitem(aio._MAX_SAMPLE_BYTES, "WAV", 2 * 12000)
    out = tmp_path / "book.wav"
    args = ["speak", "-m", str(endless_model_dir), "--max-frames", "30", "-o", str(out)]
    assert cli.main([*args, "A sentence that outgrows its file."]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is full" in err and ".flac or .caf" in err, err
    audio, rate = sf.read(out, dtype="float32")
    assert 0 < len(audio) <= 12000 and f"kept {len(audio) / rate:.1f} s" in err, err
    assert [p.name for p in tmp_path.iterdir()] == ["book.wav"]


def test_audio_cut_short_by_max_frames_is_a_warning(endless_model_dir, model_dir, tmp_path, capsys):
    """Segments that reach --max-frames before END are said to be cut short (the audio just
    stopped); a text the model ends says nothing."""
    from voxtral_mlx import cli
    from voxtral_mlx.segment import split_text

    sentence = "This sentence is long enough that three of them will not fit in one segment, "
    text = " ".join([sentence + "surely."] * 6)
    n = len(split_text(text))
    assert n > 2
    out = tmp_path / "cut.wav"
    args = ["speak", "-m", str(endless_model_dir), text, "-o", str(out), "--max-frames", "3"]
    assert cli.main(args) == 0
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"voxtral-mlx: warning: {n} of {n} segments reached --max-frames")
    assert "(3 frames, 0.24 s)" in err and "\n" not in err
    assert sf.info(str(out)).frames > 0
    args = ["speak", "-m", str(endless_model_dir), "Hi.", "-o", str(out), "--max-frames", "2"]
    assert cli.main([*args, "--no-split"]) == 0
    err = capsys.readouterr().err.strip()
    assert "warning: the text reached --max-frames" in err and "drop --no-split" in err
    assert cli.main(["speak", "-m", str(model_dir), TEXT, "-o", str(out)]) == 0
    assert capsys.readouterr().err == ""


def test_a_second_process_reuses_the_voice_prefix_from_disk(model_dir, reference, tmp_path):
    """Each `speak` is a new process: the second starts the voice from the stored prefix
    (same audio); --no-prefix-cache stores nothing; an unusable cache directory is a
    one-line warning, not a failure."""
    args = ["speak", "-m", str(model_dir), "-v", "neutral_female", "--seed", "5"]
    args += ["--max-frames", "40", "--raw", TEXT]
    cache = tmp_path / "cache"

    def prefixes() -> list[str]:
        folder = cache / "prefixes"
        return sorted(p.name for p in folder.glob("*.safetensors")) if folder.is_dir() else []

    pcm = float_to_int16(reference.audio)
    proc = run(*args, "--no-prefix-cache", env={"VOXTRAL_MLX_CACHE": str(cache)})
    assert proc.returncode == 0, proc.stderr.decode()
    assert prefixes() == []
    inodes = []
    for _ in range(2):
        proc = run(*args, env={"VOXTRAL_MLX_CACHE": str(cache)})
        assert proc.returncode == 0, proc.stderr.decode()
        assert np.array_equal(np.frombuffer(proc.stdout, dtype="<i2"), pcm)
        (name,) = prefixes()
        inodes.append((cache / "prefixes" / name).stat().st_ino)
    assert inodes[0] == inodes[1]  # read, not written again (a write replaces the file)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    proc = run(*args, env={"VOXTRAL_MLX_CACHE": str(blocker)})
    assert proc.returncode == 0, proc.stderr.decode()
    assert np.array_equal(np.frombuffer(proc.stdout, dtype="<i2"), pcm)
    warning = [line for line in proc.stderr.decode().splitlines() if "warning" in line]
    assert len(warning) == 1 and "voice-prefix cache" in warning[0], proc.stderr.decode()


@pytest.mark.parametrize(
    "argv, words",
    [
        (["speak", "Hi.", "-o", ""], "-o FILE is empty (an unset shell variable?)"),
        (["speak", "Hi.", "-m", " "], "the model (-m, or $VOXTRAL_MLX_MODEL) is empty"),
        (["convert-voices", "x.pt", "-o", ""], "-o OUT_DIR is empty"),
        (["convert-voices", "", "-o", "out"], "SRC is empty"),
        (["random-checkpoint", ""], "OUT_DIR is empty"),
        (["convert", "model", "-o", ""], "-o OUT_DIR is empty"),
        (["-m", "model", "speak", "Hi."], "-m goes after the command: voxtral-mlx speak -m"),
        (["speak", "-hello"], "text that starts with '-' goes last, after --"),
        (["speak", "-hi"], "text that starts with '-' goes last, after --"),
        (["speak", "Hi.", "-r", "200"], "unrecognized arguments: -r 200; see `voxtral-mlx speak"),
    ],
)
def test_argument_mistakes_are_named_in_one_line(argv, words, capsys):
    """An empty path (an unset shell variable) meant the current directory: convert-voices
    -o "" wrote there and exited 0. Options before the command, text starting with '-' and
    a speak option the parser does not know got misleading messages."""
    from voxtral_mlx.cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 1 and words in err and err.count("\n") == 1, err
    if argv[:2] == ["speak", "Hi."] and "-r" in argv:
        assert "goes last" not in err  # an unknown option is not taken for text


@pytest.mark.parametrize("argv", [["speak", "-h"], ["speak", "-hq"], ["-h"]])
def test_help_flags_still_print_the_help(argv, capsys):
    """Text such as "-hello" is an error on every Python (3.13's argparse printed the help
    for it), while -h, and -h combined with one flag, still show the help."""
    from voxtral_mlx.cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 0 and capsys.readouterr().out.startswith("usage: voxtral-mlx")


def test_no_split_speaks_the_text_with_its_period_unless_no_period(model_dir, tmp_path, capsys):
    """--no-split makes the text one utterance, still sent as a split text's segment is
    (stripped, a period added: END is unreliable without one), so a one-segment text
    sounds the same either way; --no-period sends it without (it was accepted and did
    nothing, the period never added). The Python API's add_period=False needs split=True."""
    from voxtral_mlx import cli

    def speak(name: str, *extra: str) -> tuple[np.ndarray, int]:
        out = tmp_path / name
        args = ["speak", "-m", str(model_dir), "Hello world \n", "-o", str(out), "--verbose"]
        assert cli.main([*args, "--seed", "1", "--max-frames", "2", *extra]) == 0
        err = capsys.readouterr().err
        tokens = int(err.split("prompt: ", 1)[1].split(" tokens", 1)[0])
        return sf.read(str(out), dtype="int16")[0], tokens

    split, split_tokens = speak("split.wav")
    whole, whole_tokens = speak("whole.wav", "--no-split")
    np.testing.assert_array_equal(whole, split)
    assert whole_tokens == split_tokens
    _, bare_tokens = speak("bare.wav", "--no-split", "--no-period")
    assert bare_tokens == split_tokens - 1
    tts = voxtral_mlx.load(model_dir)
    with pytest.raises(voxtral_mlx.InputError, match="add_period= applies to the segments"):
        tts.synthesize("Hello world", add_period=False)
    assert tts.synthesize("Hello world", add_period=False, split=True, max_frames=1).codes.size
