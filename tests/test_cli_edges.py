"""The command line at its edges: odd stdin and stdout, signals while writing, bad outputs."""

from __future__ import annotations

import io
import os
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from voxtral_mlx.errors import InputError
from voxtral_mlx.torch_pickle import write_pt

REPO = Path(__file__).resolve().parents[1]


def env_with_repo(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.update(extra or {})
    return env


def run(
    *args: str, env: dict[str, str] | None = None, cwd_override: Path | None = None, **kwargs
) -> subprocess.CompletedProcess:
    if "stdout" not in kwargs and "stderr" not in kwargs:
        kwargs.setdefault("capture_output", True)
    return subprocess.run(
        [sys.executable, "-m", "voxtral_mlx", *args],
        env=env_with_repo(env),
        timeout=300,
        cwd=cwd_override or REPO,
        **kwargs,
    )


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    err = proc.stderr.decode()
    assert proc.returncode == 1, (proc.returncode, err)
    assert err.count("\n") == 1 and err.startswith("voxtral-mlx: error: "), err
    return err


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny checkpoint whose END never fires: every run makes --max-frames frames."""
    out = tmp_path_factory.mktemp("edges") / "tiny"
    proc = run("random-checkpoint", str(out), "--seed", "3", "--suppress-end")
    assert proc.returncode == 0, proc.stderr.decode()
    return out


def speak(model_dir: Path, *args: str, **kwargs) -> subprocess.CompletedProcess:
    return run("speak", "-m", str(model_dir), "--max-frames", "3", "--seed", "1", *args, **kwargs)


# --------------------------------------------------------------------------- stdin


@pytest.mark.parametrize("encoding", [None, "utf-8:strict"], ids=["locale", "strict"])
def test_stdin_that_is_not_utf8_is_one_line(model_dir, tmp_path, encoding):
    env = {"PYTHONIOENCODING": encoding} if encoding else None
    out = tmp_path / "s.wav"
    proc = speak(model_dir, "-o", str(out), input=b"caf\xe9.", env=env)
    assert "stdin is not UTF-8" in one_line_error(proc)
    assert list(tmp_path.iterdir()) == []


def test_utf16_without_a_byte_order_mark_is_one_line(model_dir, tmp_path):
    # Valid UTF-8 to a decoder, but every other character a NUL: it was spoken as such.
    raw = "Hello world.".encode("utf-16-le")
    (tmp_path / "u16.txt").write_bytes(raw)
    out = tmp_path / "s.wav"
    err = one_line_error(speak(model_dir, "-f", str(tmp_path / "u16.txt"), "-o", str(out)))
    assert "u16.txt holds NUL bytes" in err and "iconv" in err, err
    err = one_line_error(speak(model_dir, "-o", str(out), input=b"\x00" * 1000))
    assert "stdin holds NUL bytes" in err, err
    assert not out.exists()


def test_stdin_is_read_as_utf8_whatever_the_locale(model_dir, tmp_path):
    out = tmp_path / "s.wav"
    text = "\ufeffCafé.".encode()
    proc = speak(model_dir, "-o", str(out), "-f", "-", input=text, env={"LC_ALL": "C"})
    assert proc.returncode == 0, proc.stderr.decode()
    assert sf.info(out).frames > 0


@pytest.mark.parametrize("args", [[], ["-f", "-"]], ids=["implicit", "dash"])
def test_closed_stdin_is_one_line(model_dir, tmp_path, args):
    out = tmp_path / "s.wav"
    proc = speak(model_dir, "-o", str(out), *args, preexec_fn=lambda: os.close(0))
    assert "text" in one_line_error(proc) or "stdin" in one_line_error(proc)
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- stdout


def test_stdout_gets_nothing_before_the_arguments_are_checked(model_dir):
    proc = speak(model_dir, "Hi.", "-o", "-", "--pause", "100")
    assert "pause" in one_line_error(proc)
    assert proc.stdout == b""


def test_appending_stdout_keeps_the_wav_intact(model_dir, tmp_path):
    path = tmp_path / "app.wav"
    path.write_bytes(b"")
    with open(path, "ab") as f:  # `>> app.wav`
        proc = speak(model_dir, "Hi there.", "-o", "-", stdout=f, stderr=subprocess.PIPE)
    assert proc.returncode == 0, proc.stderr.decode()
    data = path.read_bytes()
    assert data[:4] == b"RIFF" and data[36:40] == b"data"
    assert struct.unpack("<I", data[40:44])[0] == 0xFFFFFFFF  # unknown: nothing patched
    assert len(data) == 44 + 2 * 3 * 1920  # three frames, and no size patch appended


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize(
    "args", [["-o", "-"], ["--raw"], ["voices"]], ids=["wav", "raw", "voices-list"]
)
def test_full_stdout_is_one_line(model_dir, args):
    with open("/dev/full", "wb") as full:
        if args == ["voices"]:
            proc = run("voices", "-m", str(model_dir), stdout=full, stderr=subprocess.PIPE)
        else:
            proc = speak(model_dir, "Hello.", *args, stdout=full, stderr=subprocess.PIPE)
    error = one_line_error(proc)
    assert "No space left on device" in error
    if args == ["voices"]:  # with a fix, as every error
        assert error.rstrip().endswith("check the file or pipe stdout goes to (a full disk?)")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize(
    "args", [["--help"], ["speak", "-h"], ["--version"]], ids=["top", "speak", "version"]
)
def test_help_that_cannot_be_written_is_an_error(args):
    # argparse drops the failed write and exits 0 (Python >= 3.12).
    with open("/dev/full", "wb") as full:
        proc = run(*args, stdout=full, stderr=subprocess.PIPE)
    assert proc.returncode == 1
    assert "writing to stdout failed: No space left on device" in one_line_error(proc)


def test_version_is_the_packages():
    from importlib.metadata import version

    proc = run("--version", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.returncode == 0 and proc.stderr == b""
    assert proc.stdout.decode() == f"voxtral-mlx {version('voxtral_mlx')}\n"


def test_help_with_stdout_closed_goes_to_stderr():
    proc = run("--help", stdout=None, stderr=subprocess.PIPE, preexec_fn=lambda: os.close(1))
    assert proc.returncode == 0
    assert b"usage: voxtral-mlx" in proc.stderr


@pytest.mark.parametrize("args", [["-o", "-"], ["--raw"]], ids=["wav", "raw"])
def test_closed_stdout_is_one_line(model_dir, args):
    proc = speak(
        model_dir,
        "Hello.",
        *args,
        stdout=None,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: os.close(1),
    )
    assert "stdout is closed" in one_line_error(proc)


def test_paths_in_result_and_note_lines_are_escaped(tmp_path):
    """Error lines were escaped, the lines saying what was written were not: a terminal
    escape in an output name cleared the screen, a newline split the line."""
    out = tmp_path / "e\x1b[2Jx\nb"
    proc = run("random-checkpoint", str(out), "--size", "tiny")
    assert proc.returncode == 0, proc.stderr
    assert (out / "params.json").is_file()
    for stream in (proc.stdout, proc.stderr):
        assert b"\x1b" not in stream and b"\\x1b[2Jx\\nb" in stream
    assert proc.stdout.count(b"\n") == 1 and proc.stderr.count(b"\n") == 1


def test_trailing_slash_names_a_directory(model_dir, tmp_path):
    proc = speak(model_dir, "Hi.", "-o", f"{tmp_path}/out.wav/")
    assert "slash" in one_line_error(proc)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("ending", ["/.", "/.."])
def test_a_final_dot_names_a_directory(model_dir, tmp_path, ending):
    """`-o new.wav/.` wrote new.wav: pathlib drops the "/."."""
    proc = speak(model_dir, "Hi.", "-o", f"{tmp_path}/new.wav{ending}")
    assert "so it names a directory" in one_line_error(proc)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(sys.platform == "win32", reason="a folder in use cannot be deleted there")
def test_a_deleted_working_folder_is_named_as_such(model_dir, tmp_path):
    """It read as "it takes no new files (a system folder?)"."""
    gone = tmp_path / "gone"
    gone.mkdir()
    # A script, not `python -c`: under `-c`, Python 3.13.0 fails to import numpy once the
    # working folder is gone (a SystemError inside numpy's import), which the voxtral-mlx
    # program (a script) and `python -m voxtral_mlx` never meet.
    script = tmp_path / "run_in_gone.py"
    script.write_text(
        "import os, runpy, sys\n"
        "os.chdir(sys.argv[1])\n"
        "os.rmdir(sys.argv[1])\n"
        "sys.argv = ['voxtral-mlx', *sys.argv[2:]]\n"
        "runpy.run_module('voxtral_mlx', run_name='__main__')\n"
    )
    args = ["speak", "-m", str(model_dir), "--max-frames", "1", "Hi.", "-o", "x.wav"]
    proc = subprocess.run(
        [sys.executable, str(script), str(gone), *args],
        env=env_with_repo(),
        capture_output=True,
        timeout=300,
    )
    assert "it has been deleted (cd to an existing folder)" in one_line_error(proc)


def _no_stderr() -> None:
    os.close(2)


def test_closed_or_full_stderr_changes_nothing_but_the_messages(model_dir, tmp_path):
    """With stderr closed (``2>&-``: Python's ``print`` would write to stdout) or full, the
    job's outcome stands: the same audio on stdout and nothing else, the same exit code."""
    text = "One sentence. And another one."  # two segments: a progress check, a cut warning
    want = speak(model_dir, "-o", "-", text)
    assert want.returncode == 0 and b"reached --max-frames" in want.stderr
    closed = speak(model_dir, "-o", "-", text, stdout=subprocess.PIPE, preexec_fn=_no_stderr)
    assert closed.returncode == 0 and closed.stdout == want.stdout
    bad = speak(
        model_dir, "-v", "nosuch", "--raw", text, stdout=subprocess.PIPE, preexec_fn=_no_stderr
    )
    assert bad.returncode == 1 and bad.stdout == b""
    out = tmp_path / "full.wav"
    with open("/dev/full", "wb") as full:
        proc = speak(model_dir, "-o", str(out), text, stderr=full)
    assert proc.returncode == 0
    assert sf.info(out).frames == len(sf.read(io.BytesIO(want.stdout))[0])


@pytest.mark.parametrize(
    ("option", "needle"),
    [
        (["--seed", "-1"], "--seed must be an integer from 0 to 2**64 - 1, got -1"),
        (["--pause", "-5"], "--pause must be a number of seconds from 0 to 60, got -5.0"),
        (["--pause", "nan"], "--pause must be a number of seconds from 0 to 60, got nan"),
        (["--dtype", "int8"], "--dtype int8 is not supported: use bfloat16"),
    ],
)
def test_bad_options_are_refused_before_the_model_is_looked_for(tmp_path, option, needle):
    # A model that is not there (offline): the option's error comes first, not after a
    # download or a load.
    proc = run(
        "speak",
        "-m",
        "nobody/no-such-model",
        *option,
        "Hello.",
        "-o",
        str(tmp_path / "a.wav"),
        env={"HF_HUB_OFFLINE": "1"},
    )
    assert needle in one_line_error(proc)


# --------------------------------------------------------------------------- serve


@pytest.mark.parametrize("port", ["70000", "-1"])
def test_serve_rejects_ports_out_of_range(model_dir, port):
    proc = run("serve", "-m", str(model_dir), "--no-warmup", "--port", port)
    assert f"--port {port}" in one_line_error(proc)


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--body-timeout", "0"),
        ("--send-timeout", "-5"),
        ("--body-timeout", "nan"),
        ("--send-timeout", "inf"),
    ],
)
def test_serve_rejects_timeouts_out_of_range(model_dir, flag, value):
    proc = run("serve", "-m", str(model_dir), "--no-warmup", "--port", "0", flag, value)
    assert f"{flag} must be a number of seconds" in one_line_error(proc)


def test_serve_timeout_flags_default_to_the_servers_deadlines():
    from voxtral_mlx.cli import build_parser
    from voxtral_mlx.server.app import BODY_TIMEOUT_S, SEND_TIMEOUT_S

    args = build_parser().parse_args(["serve"])
    assert (args.body_timeout, args.send_timeout) == (BODY_TIMEOUT_S, SEND_TIMEOUT_S)
    args = build_parser().parse_args(["serve", "--body-timeout", "2.5", "--send-timeout", "9"])
    assert (args.body_timeout, args.send_timeout) == (2.5, 9.0)


# --------------------------------------------------------------------------- random-checkpoint


def test_random_checkpoint_bad_layers_leave_nothing(tmp_path):
    proc = run("random-checkpoint", str(tmp_path / "new" / "rc"), "--layers", "0")
    assert "--layers must be between 1 and 1024" in one_line_error(proc)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("seed", ["-1", "-99999999999999999999"])
def test_random_checkpoint_negative_seed_is_one_line(tmp_path, seed):
    err = one_line_error(run("random-checkpoint", str(tmp_path / "rc"), "--seed", seed))
    assert "seed must be a whole number >= 0" in err
    assert not (tmp_path / "rc").exists()


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("", "--api-key is empty"),
        (" key", "spaces"),
        ("ke\ty", "control characters"),
        ("café", "beyond ASCII"),
    ],
)
def test_serve_refuses_an_api_key_http_cannot_carry(tmp_path, value, words):
    """Checked before the model is loaded (the model path does not even exist)."""
    args = ("serve", "-m", str(tmp_path / "none"), "--port", "0", "--api-key", value)
    assert words in one_line_error(run(*args))


def test_serve_refuses_an_empty_api_key_variable(tmp_path):
    """As --api-key "": an unset shell variable must not serve without a key unawares."""
    args = ("serve", "-m", str(tmp_path / "none"), "--port", "0")
    error = one_line_error(run(*args, env={"VOXTRAL_MLX_API_KEY": ""}))
    assert "$VOXTRAL_MLX_API_KEY is empty" in error


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("::1", True),
        ("0:0:0:0:0:0:0:1", True),
        ("[::1]", True),
        ("LOCALHOST", True),
        ("0.0.0.0", False),
        ("::", False),
        ("192.168.1.20", False),
        ("my-mac.local", False),
    ],
)
def test_only_other_hosts_than_this_machine_warn_of_a_missing_api_key(host, loopback):
    """127.0.0.2, an expanded ::1 and LOCALHOST warned: a string match on three names."""
    from voxtral_mlx.cli.serve import _is_loopback

    assert _is_loopback(host) is loopback


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_a_folder_that_takes_no_files_is_named_as_such(model_dir):
    """/proc answers "No such file or directory" for a new file in it, which the errors
    repeated about a folder that plainly exists."""
    for args in (
        ("speak", "-m", str(model_dir), "Hi.", "--max-frames", "1", "-o", "/proc/x.wav"),
        ("random-checkpoint", "/proc/voxtral-test"),
    ):
        error = one_line_error(run(*args))
        assert "/proc" in error and "it takes no new files (a system folder?)" in error
        assert "No such file" not in error


def test_random_checkpoint_output_checks(model_dir, tmp_path):
    (tmp_path / "file").write_text("x")
    proc = run("random-checkpoint", str(tmp_path / "file"))
    assert "not a directory" in one_line_error(proc)
    proc = run("random-checkpoint", str(tmp_path / "file" / "sub"))
    assert "cannot write" in one_line_error(proc)

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("precious")
    for force in ([], ["--force"]):
        proc = run("random-checkpoint", str(mine), *force)
        one_line_error(proc)
        assert [p.name for p in mine.iterdir()] == ["notes.txt"]

    # A model file among a user's own files does not make them replaceable.
    (mine / "params.json").write_text("{}")
    (mine / "photos").mkdir()
    proc = run("random-checkpoint", str(mine), "--force")
    assert "(notes.txt, photos)" in one_line_error(proc)
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt", "params.json", "photos"]

    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    assert "symbolic link that loops" in one_line_error(run("random-checkpoint", str(loop)))
    loop.unlink()

    old = tmp_path / "old"
    proc = run("random-checkpoint", str(old), "--layers", "1", "--flow-layers", "1")
    assert proc.returncode == 0, proc.stderr.decode()
    assert "--force" in one_line_error(run("random-checkpoint", str(old)))
    proc = run("random-checkpoint", str(old), "--force", "--voice-format", "safetensors")
    assert proc.returncode == 0, proc.stderr.decode()
    assert not list((old / "voice_embedding").glob("*.pt"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "mine", "old"]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["speak", "--seed", "nan", "Hi"], "argument --seed: invalid int value: 'nan'"),
        (["speak", "--max-frames", "1e9", "Hi"], "argument --max-frames: invalid int value"),
        (["speak", "--bogus", "Hi"], "unrecognized arguments: --bogus"),
        (["random-checkpoint", "x", "--size", "huge"], "invalid choice: 'huge'"),
        (["serve", "--port", "abc"], "argument --port: invalid int value: 'abc'"),
        (["serve", "--max-batch", "65"], "--max-batch must be at most 64, got 65"),
        ([], "the following arguments are required: COMMAND"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--bogus", "voices"], "unrecognized arguments: --bogus"),
        (["bogus"], "invalid choice: 'bogus'"),
    ],
)
def test_a_mistyped_command_line_is_one_line_with_status_1(args, words):
    """Not argparse's usage block and status 2: the README promises one line and 1."""
    err = one_line_error(run(*args))
    assert words in err, err


@pytest.mark.parametrize(
    "make_args",
    [
        lambda m, t, long: ["speak", "-m", str(m), "Hi", "-o", str(t / f"{long}.wav")],
        lambda m, t, long: ["speak", "-m", str(m), "Hi", "-o", str(t / long / "x.wav")],
        lambda m, t, long: ["voices", "-m", str(t / long)],
        lambda m, t, long: ["convert-voices", str(m / "voice_embedding"), "-o", str(t / long)],
        lambda m, t, long: ["random-checkpoint", str(t / long)],
    ],
    ids=["output", "output-dir", "model", "convert-voices", "random-checkpoint"],
)
def test_a_file_name_too_long_is_one_line(model_dir, tmp_path, make_args):
    proc = run(*make_args(model_dir, tmp_path, "a" * 300))
    err = one_line_error(proc)
    assert "File name too long" in err or "too long" in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "make_args",
    [
        lambda m, deep: ["speak", "-m", str(m), "-f", str(deep / "x.txt"), "-o", "x.wav"],
        lambda m, deep: ["speak", "-m", str(m), "Hi", "-o", str(deep / "x.wav")],
        lambda m, deep: ["voices", "-m", str(deep)],
        lambda m, deep: ["convert-voices", str(m / "voice_embedding"), "-o", str(deep)],
    ],
    ids=["text-file", "output", "model", "convert-voices"],
)
def test_a_path_too_long_is_one_short_line(model_dir, tmp_path, make_args):
    """Each name fits but the path (6 kB) does not: the message says so without quoting it
    whole (a -f path was printed in full)."""
    deep = tmp_path.joinpath(*["d" * 200] * 30)
    err = one_line_error(run(*make_args(model_dir, deep)))
    assert "too long" in err and len(err) < 500, err
    assert list(tmp_path.iterdir()) == []


def test_text_that_is_not_utf8_and_an_empty_model_are_one_line(model_dir, tmp_path):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("Café crème.".encode("latin-1"))
    err = one_line_error(run("speak", "-m", str(model_dir), "-f", str(bad), "-o", "x.wav"))
    assert "is not UTF-8 text; convert it first" in err
    env = {"LC_ALL": "C.UTF-8", "PYTHONUTF8": "1"}
    latin1 = os.fsdecode(b"Caf\xe9")  # a byte UTF-8 cannot decode, as a shell passes it
    proc = subprocess.run(
        [sys.executable, "-m", "voxtral_mlx", "speak", "-m", str(model_dir), "-o", "x.wav", latin1],
        env=env_with_repo(env),
        capture_output=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert "arguments is not UTF-8" in one_line_error(proc)
    blank_model = one_line_error(run("voices", "-m", ""))
    assert "the model (-m, or $VOXTRAL_MLX_MODEL) is empty" in blank_model
    blank_variable = subprocess.run(
        [sys.executable, "-m", "voxtral_mlx", "voices"],
        env=env_with_repo({"VOXTRAL_MLX_MODEL": "", "HF_HUB_OFFLINE": "1"}),
        capture_output=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert "the model (-m, or $VOXTRAL_MLX_MODEL) is empty" in one_line_error(blank_variable)
    assert list(tmp_path.iterdir()) == [bad]


def test_a_damaged_voice_file_is_not_listed_as_usable(model_dir, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(model_dir, model)
    voice = model / "voice_embedding" / "casual_male.pt"
    voice.write_bytes(voice.read_bytes()[:1000])  # truncated
    (model / "voice_embedding" / "weird.pt").write_bytes(b"not a voice")
    write_pt(model / "voice_embedding" / "de_male.pt", np.zeros((5, 7), np.float32))
    proc = run("voices", "-m", str(model))
    assert proc.returncode == 0
    listed = proc.stdout.decode()
    assert "casual_female" in listed and "casual_male" not in listed and "weird" not in listed
    assert "de_female" in listed and "de_male" not in listed
    notes = proc.stderr.decode().splitlines()
    assert len(notes) == 3 and all(line.startswith("voxtral-mlx: note: voice '") for line in notes)
    by_name = {line.split("'")[1]: line for line in notes}
    assert "'casual_male' is unusable" in by_name["casual_male"]
    assert "'weird' is unusable" in by_name["weird"]
    narrow = by_name["de_male"]
    assert narrow.startswith("voxtral-mlx: note: voice 'de_male' (") and "is 7 wide" in narrow
    assert narrow.count("de_male'") == 1  # named once, not "voice X is unusable: voice X"


def test_a_voice_file_that_is_a_broken_link_is_named(model_dir, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(model_dir, model)
    voice = model / "voice_embedding" / "ar_male.pt"
    voice.unlink()
    voice.symlink_to(voice.name)  # a loop
    proc = run("voices", "-m", str(model))
    assert proc.returncode == 0 and "ar_male" not in proc.stdout.decode()
    assert "voxtral-mlx: note: voice 'ar_male' is unusable" in proc.stderr.decode()
    proc = run("speak", "-m", str(model), "-v", "ar_male", "Hi", "-o", str(tmp_path / "x.wav"))
    assert "is not a readable file" in one_line_error(proc) and "restore it" in proc.stderr.decode()
    proc = run("convert-voices", str(model / "voice_embedding"), "-o", str(tmp_path / "out"))
    assert "ar_male.pt is not a readable file" in one_line_error(proc)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


# --------------------------------------------------------------------------- termination

# Runs the CLI with one step made slow, saying "ready" on stderr once it has started writing.
_SLOW = """
import sys, time, importlib
module, name = sys.argv[1], sys.argv[2]
mod = importlib.import_module(module)
real = getattr(mod, name)
def slow(*args, **kwargs):
    real(*args, **kwargs)
    sys.stderr.write("ready\\n")
    sys.stderr.flush()
    time.sleep(120)
setattr(mod, name, slow)
from voxtral_mlx.cli import main
sys.exit(main(sys.argv[3:]))
"""


def run_until_ready_then(sig: int, slow: str, args: list[str]) -> tuple[int, str]:
    module, name = slow.rsplit(".", 1)
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW, module, name, *args],
        env=env_with_repo(),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert line == b"ready\n", line + proc.stderr.read()
        proc.send_signal(sig)
        code = proc.wait(timeout=60)
        return code, proc.stderr.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


COMMANDS: dict[str, Callable[[Path, Path], tuple[str, list[str]]]] = {
    "convert": lambda model, out: (
        "voxtral_mlx.convert._write_shard",
        ["convert", str(model), "-o", str(out), "--q-bits", "4"],
    ),
    "convert-voices": lambda model, out: (
        "voxtral_mlx.voices._write_safetensors",
        ["convert-voices", str(model / "voice_embedding"), "-o", str(out)],
    ),
    "random-checkpoint": lambda model, out: (
        "voxtral_mlx.synthetic.checkpoint.write_safetensors",
        ["random-checkpoint", str(out)],
    ),
}


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP", "SIGQUIT"])
@pytest.mark.parametrize("command", list(COMMANDS))
def test_termination_while_writing_leaves_nothing(model_dir, tmp_path, command, sig):
    signum = getattr(signal, sig, None)
    if signum is None:
        pytest.skip(f"no {sig} here")
    slow, args = COMMANDS[command](model_dir, tmp_path / "new" / "out")
    code, err = run_until_ready_then(signum, slow, args)
    assert code == 128 + signum, err
    assert err.endswith("voxtral-mlx: error: interrupted\n"), err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", list(COMMANDS))
def test_what_a_killed_run_left_is_removed_by_the_next(model_dir, tmp_path, command):
    """SIGKILL leaves no chance to clean up: the hidden staging (a conversion's can hold
    gigabytes) names its process, and the next run for the same output removes it."""
    slow, args = COMMANDS[command](model_dir, tmp_path / "new" / "out")
    if command == "convert-voices":
        (tmp_path / "new" / "out").mkdir(parents=True)  # its staging is inside OUT_DIR
    code, _ = run_until_ready_then(signal.SIGKILL, slow, args)
    assert code == -signal.SIGKILL

    def hidden() -> list[str]:
        return sorted(p.name for p in tmp_path.rglob(".*"))

    left = hidden()
    assert left and all(".partial-" in name for name in left), left
    proc = run(*args, "--force")
    assert proc.returncode == 0, proc.stderr.decode()
    assert hidden() == []


def test_stdout_redirected_to_a_file_gets_real_sizes(model_dir, tmp_path):
    path = tmp_path / "s.wav"
    with open(path, "wb") as f:
        proc = speak(model_dir, "Hello.", "-o", "-", stdout=f, stderr=subprocess.PIPE)
    assert proc.returncode == 0, proc.stderr.decode()
    data = path.read_bytes()
    assert struct.unpack("<I", data[40:44])[0] == len(data) - 44
    audio, _ = sf.read(path, dtype="float32")
    assert len(audio) == 3 * 1920 and np.isfinite(audio).all()


def test_random_checkpoint_checks_params_before_writing(tmp_path):
    from voxtral_mlx.errors import ConfigError
    from voxtral_mlx.synthetic.checkpoint import build_random_checkpoint, make_params

    with pytest.raises(ConfigError):
        build_random_checkpoint(tmp_path / "new" / "rc", make_params("tiny", n_layers=0))
    assert list(tmp_path.iterdir()) == []


def test_the_command_line_parses_its_arguments_before_loading_mlx():
    """MLX and the model code load on first use: `--help` is quick, and Ctrl-C right after
    starting a command meets main()'s one-line handler instead of an import traceback."""
    code = (
        "import sys, voxtral_mlx, voxtral_mlx.cli\n"
        "voxtral_mlx.cli.build_parser().parse_args(['speak', 'hi'])\n"
        "print('mlx.core' in sys.modules, 'voxtral_mlx.tts' in sys.modules)\n"
        "from voxtral_mlx import VoxtralTTS\n"
        "print(VoxtralTTS.__module__, 'mlx.core' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split("\n")
    assert out[:2] == ["False False", "voxtral_mlx.tts True"]


def test_speak_will_not_write_over_its_own_text_file(tmp_path):
    text = tmp_path / "notes.wav"  # a text file with an audio extension
    text.write_text("Some words to say.")
    link = tmp_path / "link.wav"
    link.symlink_to(text)
    for out in (text, link):
        err = one_line_error(
            run("speak", "-m", str(tmp_path / "none"), "-f", str(text), "-o", str(out))
        )
        assert "is the text file given with -f" in err
    assert text.read_text() == "Some words to say."


def test_speak_will_not_write_over_the_file_its_stdin_reads(tmp_path):
    """`speak -o notes.wav < notes.wav`: the text would be lost to its own audio."""
    text = tmp_path / "notes.wav"
    text.write_text("Some words to say.")
    link = tmp_path / "link.wav"
    link.symlink_to(text)
    for out, extra in ((text, []), (link, []), (text, ["-f", "-"])):
        with open(text, "rb") as stdin:
            proc = run("speak", "-m", str(tmp_path / "none"), *extra, "-o", str(out), stdin=stdin)
        assert "is the file the text is read from on stdin" in one_line_error(proc)
    assert text.read_text() == "Some words to say."


def test_progress_line_clears_what_a_longer_line_left(capsys):
    from types import SimpleNamespace

    from voxtral_mlx.cli.progress import Progress

    progress = Progress(total=3)
    timings = SimpleNamespace(audio_s=1.5)
    for segment in range(3):  # each segment's end: a pause chunk (or the final chunk)
        chunk = SimpleNamespace(is_final=segment == 2, frames=0, audio=[0.0], segment=segment)
        progress.update(chunk, timings)
    progress.close()
    lines = capsys.readouterr().err.split("\r")[1:]
    assert len(lines) == 3 and all(line.rstrip("\n").endswith("\x1b[K") for line in lines)
    assert "ETA" in lines[0] and "ETA" not in lines[2]


def test_progress_of_text_still_arriving_counts_what_is_done(capsys, monkeypatch):
    """``--follow`` has no total: the line counts the segments done (no ETA), and is left
    out while the text is typed on the terminal it would be drawn over."""
    import argparse
    from types import SimpleNamespace

    from voxtral_mlx.cli import progress as progress_line
    from voxtral_mlx.cli import speak as speak_cmd

    progress = progress_line.Progress(None)
    timings = SimpleNamespace(audio_s=0.0)
    for segment, frames in [(0, 1), (0, 0), (1, 1), (1, 0)]:  # the pauses end segments
        timings.audio_s += 0.5
        chunk = SimpleNamespace(is_final=False, frames=frames, audio=[0.0], segment=segment)
        progress.update(chunk, timings)
    progress.close()
    lines = [line.split("\x1b")[0] for line in capsys.readouterr().err.split("\r")[1:]]
    assert lines == [
        "voxtral-mlx: 0 segments done, 0.5 s of audio",
        "voxtral-mlx: 1 segment done, 1.0 s of audio",
        "voxtral-mlx: 2 segments done, 2.0 s of audio",  # 1.5 s: within 0.1 s, held back
    ]
    monkeypatch.setattr(speak_cmd, "_stderr_redraws", lambda: True)
    live = SimpleNamespace(live=True, segments=[])
    for file, tty, shown in [(None, False, True), ("-", True, False), ("t.fifo", True, True)]:
        monkeypatch.setattr(sys, "stdin", SimpleNamespace(isatty=lambda tty=tty: tty))
        args = argparse.Namespace(quiet=False, file=file)
        assert speak_cmd._show_progress(args, live) is shown
    assert not speak_cmd._show_progress(argparse.Namespace(quiet=True, file=None), live)


@pytest.mark.parametrize(("term", "shown"), [("xterm-256color", True), ("dumb", False)])
def test_no_line_is_redrawn_on_a_dumb_terminal(monkeypatch, term, shown):
    """Emacs' shell is a terminal with TERM=dumb: ``ESC [K`` would show as ``^[[K``."""
    from types import SimpleNamespace

    import voxtral_mlx.cli.speak as speak_cmd

    monkeypatch.setenv("TERM", term)
    monkeypatch.setattr(sys, "stderr", SimpleNamespace(isatty=lambda: True))
    assert speak_cmd._stderr_redraws() is shown


def test_progress_counts_segments_joined_without_a_pause(capsys):
    """With --pause 0 (or a hard cut) no pause chunk marks a segment's end: the next
    segment's first chunk does (the line stayed at "segment 1/N" to the end)."""
    from types import SimpleNamespace

    from voxtral_mlx.cli.progress import Progress

    progress = Progress(total=3)
    timings = SimpleNamespace(audio_s=1.0)
    for segment, frames, samples in [(0, 1, 1920), (0, 0, 0), (1, 1, 1920), (2, 1, 1920)]:
        chunk = SimpleNamespace(is_final=False, frames=frames, audio=[0.0] * samples)
        chunk.segment = segment
        progress.update(chunk, timings)
    lines = capsys.readouterr().err.split("\r")[1:]
    # The second chunk changes nothing on the line: it is not redrawn.
    assert [line.split(",")[0].rsplit(" ", 1)[1] for line in lines] == ["1/3", "2/3", "3/3"]
    assert "ETA" in lines[1] and "ETA" in lines[2]


def test_progress_redraws_at_most_ten_times_a_second(capsys, monkeypatch):
    """A chunk comes every frame (590 redraws in 6 s, most the same line): within a segment
    the line is redrawn at most every 0.1 s, and close() draws the last one held back."""
    from types import SimpleNamespace

    from voxtral_mlx.cli import progress as progress_line

    clock = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    progress = progress_line.Progress(total=2)
    for i in range(1, 31):  # 30 frames of segment 0, 10 ms apart
        clock[0] += 0.01
        chunk = SimpleNamespace(is_final=False, frames=1, audio=[0.0], segment=0)
        progress.update(chunk, SimpleNamespace(audio_s=0.08 * i))
    drawn = capsys.readouterr().err.split("\r")[1:]
    assert 3 <= len(drawn) <= 4
    progress.close()
    last = capsys.readouterr().err
    assert last.startswith("\r") and "2.4 s of audio" in last and last.endswith("\n")


def test_progress_never_steps_back_after_an_interrupt_while_drawing(monkeypatch):
    """Ctrl-C landing inside a redraw, once the new line is written: close() redrew the
    line held back before it ("segment 9/266" then "segment 8/266")."""
    import io
    from types import SimpleNamespace

    from voxtral_mlx.cli import progress as progress_line

    class Stderr(io.StringIO):
        interrupt = False

        def flush(self) -> None:
            if self.interrupt:
                self.interrupt = False
                raise KeyboardInterrupt

    clock = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    err = Stderr()
    monkeypatch.setattr(sys, "stderr", err)
    progress = progress_line.Progress(total=3)
    for seconds in (0.08, 0.48):  # the second within 0.1 s: held back
        chunk = SimpleNamespace(is_final=False, frames=1, audio=[0.0], segment=0)
        progress.update(chunk, SimpleNamespace(audio_s=seconds))
    assert "0.5 s of audio" not in err.getvalue()
    clock[0] += 0.01
    err.interrupt = True  # after the write, inside _draw
    with pytest.raises(KeyboardInterrupt):
        chunk = SimpleNamespace(is_final=True, frames=0, audio=[0.0], segment=0)
        progress.update(chunk, SimpleNamespace(audio_s=0.96))
    progress.close()
    drawn = [line for line in err.getvalue().split("\r") if line.strip()]
    assert "segment 2/3, 1.0 s of audio" in drawn[-1], drawn


@pytest.mark.parametrize("columns", [20, 45, 200])
def test_progress_line_fits_the_terminal(capsys, monkeypatch, columns):
    """A line wider than the terminal wraps, and each update then scrolls a new line
    (330 lines for one run on a 20-column terminal)."""
    from types import SimpleNamespace

    from voxtral_mlx.cli import progress as progress_line

    monkeypatch.setattr(progress_line, "_columns", lambda: columns)
    progress = progress_line.Progress(total=15)
    for segment in range(3):
        chunk = SimpleNamespace(is_final=False, frames=0, audio=[0.0], segment=segment)
        progress.update(chunk, SimpleNamespace(audio_s=17.6))
    lines = [line.removesuffix("\x1b[K") for line in capsys.readouterr().err.split("\r")[1:]]
    assert len(lines) == 3 and all(0 < len(line) < columns for line in lines)
    if columns == 200:
        assert lines[0].startswith("voxtral-mlx: segment 2/15, 17.6 s of audio, ETA ")


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="needs /dev/zero")
def test_endless_text_is_refused_in_one_line(model_dir, tmp_path):
    """-f /dev/zero (or stdin from it) was read until memory ran out."""
    out = tmp_path / "x.wav"
    err = one_line_error(run("speak", "-m", str(model_dir), "-f", "/dev/zero", "-o", str(out)))
    assert "holds more than 64 MiB of text" in err and "speak it in parts" in err
    with open("/dev/zero", "rb") as zero:
        proc = run("speak", "-m", str(model_dir), "-f", "-", "-o", str(out), stdin=zero)
    assert "stdin holds more than 64 MiB of text" in one_line_error(proc)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_files_that_are_no_regular_files_are_named_as_such(model_dir, tmp_path):
    """A FIFO as the weights read as an incomplete download, a FIFO voice source as missing,
    and a file in the way of an output directory as "File exists"."""
    import shutil

    broken = tmp_path / "m"
    shutil.copytree(model_dir, broken)
    (broken / "consolidated.safetensors").unlink()
    os.mkfifo(broken / "consolidated.safetensors")
    err = one_line_error(run("speak", "-m", str(broken), "Hi.", "-o", str(tmp_path / "x.wav")))
    assert "consolidated.safetensors is not a readable file" in err and "incomplete" not in err
    os.mkfifo(tmp_path / "voice.pt")
    err = one_line_error(run("convert-voices", str(tmp_path / "voice.pt"), "-o", str(tmp_path)))
    assert "voice.pt is not a readable file (a pipe, socket or device)" in err
    (tmp_path / "afile").write_text("")
    err = one_line_error(run("convert", str(model_dir), "-o", str(tmp_path / "afile" / "out")))
    assert "afile is a file, not a directory" in err


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["-a", "nosuch", "-o", "x.wav"], "-a nosuch picks the device to play on, but nothing"),
        (["-a", "nosuch", "--raw"], "nothing is played with -o or --raw alone: add --play"),
        (["-a", " ", "--play", "-o", "x.wav"], "--device is empty (an unset shell variable?)"),
        (["--no-split", "--pause", "2", "-o", "x.wav"], "--no-split makes one: drop one"),
    ],
)
def test_options_that_cannot_apply_are_refused(model_dir, tmp_path, extra, words):
    """They were accepted and silently ignored (a misspelt device with -o went unnoticed)."""
    proc = run("speak", "-m", str(model_dir), "Hi. There.", *extra, cwd_override=tmp_path)
    assert words in one_line_error(proc)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
@pytest.mark.parametrize("flag", [["--raw"], ["-o", "-"]])
def test_binary_audio_is_not_written_to_a_terminal(model_dir, flag):
    import pty

    main, child = pty.openpty()
    try:
        proc = run(
            "speak", "-m", str(model_dir), "Hi.", *flag, stdout=child, stderr=subprocess.PIPE
        )
    finally:
        os.close(child)
        os.close(main)
    err = proc.stderr.decode()
    assert proc.returncode == 1 and err.count("\n") == 1, err
    assert "writes binary audio to stdout, which is a terminal" in err


@pytest.mark.parametrize("command", ["random-checkpoint", "convert"])
def test_an_interrupt_right_after_the_output_is_in_place_says_it_is_complete(
    model_dir, tmp_path, command
):
    """A signal between the final rename and the command's return was reported as a plain
    'interrupted' with a failure status, although the new directory was complete (with
    --force the old one already gone)."""
    out = tmp_path / "out"
    args = ["random-checkpoint", str(out), "--size", "tiny"]
    if command == "convert":
        args = ["convert", str(model_dir), "-o", str(out), "--q-bits", "8"]
    script = textwrap.dedent(
        f"""
        import contextlib, os, signal, sys
        import voxtral_mlx.convert, voxtral_mlx.synthetic.checkpoint as synthetic
        for module in (voxtral_mlx.convert, synthetic):
            original = module.staged_dir

            @contextlib.contextmanager
            def staged(*a, _original=original, **k):
                with _original(*a, **k) as tmp:
                    yield tmp
                os.kill(os.getpid(), signal.SIGINT)  # right after the rename

            module.staged_dir = staged
        from voxtral_mlx.cli import main
        sys.exit(main({args!r}))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip().endswith(f"interrupted after {out} was written (it is complete)")
    assert (out / "params.json").is_file()


@pytest.mark.parametrize("command", ["random-checkpoint", "convert", "convert-voices"])
def test_an_interrupt_as_the_written_output_is_handed_back_says_it_is_complete(
    model_dir, tmp_path, monkeypatch, capsys, command
):
    """A signal landing after the write has returned, before signals are held (the exit of
    a context manager, here the call that starts holding them), said "interrupted" alone
    for a complete conversion (seen about once in ten Ctrl-Cs sent as it finished)."""
    from voxtral_mlx import cli
    from voxtral_mlx.cli import conversions

    def interrupted_here():
        raise KeyboardInterrupt

    monkeypatch.setattr(conversions, "hold_from_now", interrupted_here)
    out = tmp_path / "out"
    args = {
        "random-checkpoint": ["random-checkpoint", str(out), "--size", "tiny"],
        "convert": ["convert", str(model_dir), "-o", str(out), "--q-bits", "8"],
        "convert-voices": ["convert-voices", str(model_dir / "voice_embedding"), "-o", str(out)],
    }[command]
    assert cli.main(args) == 130
    err = capsys.readouterr().err
    said = (
        "interrupted after the command had finished (its output is complete)"
        if command == "convert-voices"
        else f"interrupted after {out} was written (it is complete)"
    )
    assert err == f"voxtral-mlx: error: {said}\n"
    assert (out / "params.json").is_file() or len(list(out.glob("*.safetensors"))) == 20


def test_an_interrupt_while_the_finished_audio_file_is_flushed_says_it_is_complete(
    model_dir, tmp_path
):
    """Ctrl-C while the complete file is being made durable (macOS's F_FULLFSYNC of a long
    file takes a while): it is kept whole, and the one error line says so."""
    out = tmp_path / "a.flac"
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        import voxtral_mlx.audio.io as audio_io
        real = audio_io.full_fsync
        def fsync(fd):
            os.kill(os.getpid(), signal.SIGINT)
            real(fd)
        audio_io.full_fsync = fsync
        from voxtral_mlx.cli import main
        sys.exit(main(["speak", "-m", {str(model_dir)!r}, "--max-frames", "3", "--seed", "1",
                       "-o", {str(out)!r}, "One sentence. And another one."]))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip().endswith(f"interrupted after {out} was written (it is complete)")
    want = speak(model_dir, "-o", str(tmp_path / "b.flac"), "One sentence. And another one.")
    assert want.returncode == 0
    assert np.array_equal(sf.read(out)[0], sf.read(tmp_path / "b.flac")[0])


def _as_user(args: list[str]) -> list[str]:
    """``args`` run so that file permissions apply (root's bypass dropped)."""
    if os.geteuid() != 0:
        return args
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("as root, permissions apply only through setpriv (util-linux)")
    return [setpriv, "--bounding-set=-dac_override,-dac_read_search", *args]


def _run_as_user(*args: str) -> subprocess.CompletedProcess:
    cmd = _as_user([sys.executable, "-m", "voxtral_mlx", *args])
    return subprocess.run(cmd, env=env_with_repo(), capture_output=True, timeout=300, cwd=REPO)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX permissions")
def test_folders_that_cannot_be_read_are_named_as_such(model_dir, tmp_path):
    """A model or voice folder without read permission looked empty: 'has no params.json',
    'holds no .pt voice files', a voice file 'a broken or looping symbolic link'."""
    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    voices = model / "voice_embedding"
    out = tmp_path / "out.wav"
    try:
        model.chmod(0o000)
        err = one_line_error(_run_as_user("speak", "-m", str(model), "Hi.", "-o", str(out)))
        assert f"cannot read model directory {model}: Permission denied" in err
        model.chmod(0o755)
        voices.chmod(0o000)
        err = one_line_error(_run_as_user("convert-voices", str(voices), "-o", str(tmp_path / "v")))
        assert f"cannot list voice directory {voices}: Permission denied" in err
        assert err.rstrip().endswith("let this user read it (chmod or chown), or run as its owner")
        voices.chmod(0o644)  # names listed, files unreachable
        err = one_line_error(_run_as_user("convert-voices", str(voices), "-o", str(tmp_path / "v")))
        assert "Permission denied: check the permissions of its folder" in err
    finally:
        voices.chmod(0o755)
        model.chmod(0o755)
    assert not out.exists() and not (tmp_path / "v").exists()


def test_a_voice_folder_that_is_a_looping_link_is_named_as_such(model_dir, tmp_path):
    """It read as 'no voices' (speak), 'does not exist' (convert-voices), and convert wrote
    a model without voices."""
    model = tmp_path / "model"
    shutil.copytree(model_dir, model, ignore=shutil.ignore_patterns("voice_embedding"))
    (model / "voice_embedding").symlink_to("voice_embedding")
    err = one_line_error(speak(model, "Hi.", "-o", str(tmp_path / "x.wav")))
    assert "voice_embedding is a symbolic link to nothing" in err
    err = one_line_error(run("convert", str(model), "-o", str(tmp_path / "conv")))
    assert "voice_embedding is a symbolic link to nothing" in err
    err = one_line_error(
        run("convert-voices", str(model / "voice_embedding"), "-o", str(tmp_path / "v"))
    )
    assert "a broken or looping symbolic link" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_newline_in_a_path_keeps_the_error_on_one_line(tmp_path):
    model = tmp_path / "a\nb"
    model.mkdir()
    err = one_line_error(run("speak", "-m", str(model), "Hi.", "-o", str(tmp_path / "x.wav")))
    assert "a\\nb has no params.json" in err


def test_a_damaged_voice_file_fails_before_the_streamed_header(model_dir, tmp_path):
    """Voices are read when a request starts: -o - had written the WAV header already."""
    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    (model / "voice_embedding" / "fr_male.pt").write_bytes(b"not a voice")
    proc = speak(model, "-v", "fr_male", "-o", "-", "Hello there.")
    assert "fr_male.pt" in one_line_error(proc)
    assert proc.stdout == b""


@pytest.mark.parametrize(
    ("bad", "opens"),
    [(["-v", "nosuchvoice"], 1), (["--pause", "100"], 0), (["-m", "/nonexistent/model"], 1)],
)
def test_speak_closes_the_audio_output_it_opened_early_on_bad_input(
    model_dir, monkeypatch, capsys, bad, opens
):
    """The output is opened before the model loads (to fail early without a device); a
    bad voice or argument found after that left it open for in-process callers of main()."""
    import voxtral_mlx.audio.player as player_mod
    from voxtral_mlx import cli

    opened = []

    class Player:
        sample_rate = 24000

        def __init__(self, *args, **kwargs):
            self.stopped = False
            opened.append(self)

        def stop(self):
            self.stopped = True

    monkeypatch.setattr(player_mod, "AudioPlayer", Player)
    code = cli.main(["speak", "-m", str(model_dir), "Hello there.", *bad])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and err[0].startswith("voxtral-mlx: error:")
    assert len(opened) == opens and all(p.stopped for p in opened)  # --pause: refused first


@pytest.mark.parametrize("args", [("voices",), ("speak", "-v", "?")])
def test_a_listing_with_stdout_closed_is_an_error(model_dir, args):
    """print() to a closed stdout (sys.stdout is None) drops the line: exit 0, no output."""
    proc = run(
        *args,
        "-m",
        str(model_dir),
        stdout=None,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: os.close(1),
    )
    assert "stdout is closed" in one_line_error(proc)


def test_control_characters_in_a_path_stay_escaped_on_one_line(tmp_path):
    """A terminal escape in -m reached the terminal raw (only newlines were escaped)."""
    err = one_line_error(run("speak", "-m", str(tmp_path / "no\x1b[2Jpe\nx"), "Hi.", "-o", "x.wav"))
    assert "\x1b" not in err and "\\x1b[2Jpe\\nx" in err


def test_no_split_on_a_huge_word_is_refused_by_its_length(model_dir, tmp_path):
    """12 million letters made the tokenizer's regex give up: Rust's panic text on stderr
    and an error blaming tekken.json."""
    text = tmp_path / "word.txt"
    text.write_text("A" * 12_000_000)
    out = tmp_path / "x.wav"
    err = one_line_error(speak(model_dir, "-f", str(text), "--no-split", "-o", str(out)))
    assert "at least" in err and "drop --no-split" in err and "tekken" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["word.txt"]


@pytest.mark.parametrize(
    ("chars", "tty", "flags", "shown"),
    [
        (600_000, True, {}, True),
        (400_000, True, {}, False),  # split in well under a second
        (600_000, False, {}, False),  # a log file gets no line to erase
        (600_000, True, {"quiet": True}, False),
        (600_000, True, {"no_split": True}, False),
    ],
)
def test_a_long_text_says_it_is_being_split(monkeypatch, chars, tty, flags, shown):
    """Splitting 29 MB took 33 s with nothing on the terminal; the line goes once the text
    is split (or the split failed), before the progress line or an error line."""
    import io
    from types import SimpleNamespace

    from voxtral_mlx.cli import speak as speak_cmd

    class Stderr(io.StringIO):
        def isatty(self) -> bool:
            return tty

    err = Stderr()
    monkeypatch.setattr(sys, "stderr", err)
    args = SimpleNamespace(**{"no_split": False, "quiet": False, **flags})
    with pytest.raises(InputError), speak_cmd._splitting_notice(args, "x" * chars):
        raise InputError("a failed split")
    expected = f"\rvoxtral-mlx: splitting {chars:,} characters into segments\x1b[K\r\x1b[K"
    assert err.getvalue() == (expected if shown else "")


def test_progress_eta_counts_down_between_segment_ends(capsys, monkeypatch):
    """Segments end in bursts (a batch's later ones are done when its first is): the ETA,
    re-estimated at every chunk, climbed from 2:18 to 3:25 between two bursts. It is now
    measured when a segment ends, weighted by the text left, and counted down meanwhile."""
    from types import SimpleNamespace

    from voxtral_mlx.cli import progress as progress_line

    clock = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    progress = progress_line.Progress(total=3, sizes=[10, 10, 40])

    def chunk(segment: int, end: bool) -> None:
        c = SimpleNamespace(is_final=False, frames=0 if end else 1, audio=[0.0], segment=segment)
        progress.update(c, SimpleNamespace(audio_s=1.0))

    def eta() -> int:
        line = capsys.readouterr().err.split("\r")[-1]
        minutes, seconds = line.split("ETA ")[1].split("\x1b")[0].split(":")
        return int(minutes) * 60 + int(seconds)

    clock[0] += 10.0
    chunk(0, end=True)  # 10 characters in 10 s: 50 left, 50 s
    assert eta() == 50
    etas = []
    for _ in range(5):
        clock[0] += 4.0
        chunk(1, end=False)
        etas.append(eta())
    assert etas == [46, 42, 38, 34, 30]
    clock[0] += 100.0
    chunk(1, end=False)
    assert eta() == 0  # late: never below zero
    chunk(1, end=True)  # 20 characters in 130 s: 40 left
    assert eta() == 260


@pytest.mark.skipif(sys.platform == "darwin", reason="Metal compiles in-process, never g++")
def test_mlx_looks_for_g_plus_plus_before_any_output_exists(model_dir, tmp_path):
    """MLX's CPU backend asks once per process whether g++ exists, the first time it
    compiles, by running `g++ --version` through C's system(), which ignores SIGINT while
    it runs: asked as the first frame started, a Ctrl-C sent as the output file appeared
    was dropped and the command went on generating. The question is asked while the model
    loads, before anything is written. (A g++ that fails: MLX runs its kernels
    uncompiled.)"""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "g++.log"
    fake = bin_dir / "g++"
    fake.write_text(
        "#!/bin/sh\n"
        f"if ls '{tmp_path}'/.speech.partial-* >/dev/null 2>&1; then w=late; else w=early; fi\n"
        f"echo \"$w $*\" >> '{log}'\n"
        "exit 1\n"
    )
    fake.chmod(0o755)
    env = env_with_repo({"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"})
    out = tmp_path / "speech.wav"
    proc = run("speak", "-m", str(model_dir), "--max-frames", "3", "-o", str(out), "Hi.", env=env)
    assert proc.returncode == 0, proc.stderr.decode()
    assert log.read_text().split("\n")[:-1] == ["early --version"]


@pytest.mark.parametrize("earlier", [False, True])
def test_an_interrupt_before_any_audio_says_the_file_was_not_written(model_dir, tmp_path, earlier):
    """It said "interrupted" alone, which left open whether FILE held anything.

    On MLX's CPU backend a kernel not yet in its folder is compiled through C's
    ``system()``, which drops a SIGINT arriving meanwhile (macOS's Metal compiles
    in-process): the same text spoken once first puts the first frame's kernels there, so
    the signal meets the command, not a compile that happened to start before it."""
    warm = speak(model_dir, "-o", str(tmp_path / "warm.wav"), "Hi.")
    assert warm.returncode == 0, warm.stderr.decode()
    (tmp_path / "warm.wav").unlink()
    out = tmp_path / "speech.wav"
    if earlier:
        out.write_bytes(b"an earlier file")
    args = ["speak", "-m", str(model_dir), "-o", str(out), "Hi."]
    code, err = run_until_ready_then(signal.SIGINT, "voxtral_mlx.cli.speak.Chunks", args)
    assert code == 130, err
    left = "left as it was" if earlier else "not written"
    assert err.endswith(f"error: interrupted before any audio was written: {out} {left}\n"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == (["speech.wav"] if earlier else [])
    if earlier:
        assert out.read_bytes() == b"an earlier file"


# -- a machine slower than real time ----------------------------------------------------


def _slow_note(paced, speed=1.0, model=None, bits=()):
    from types import SimpleNamespace

    from voxtral_mlx.checkpoint import QuantSpec
    from voxtral_mlx.cli.speak import slow_generation_note

    tts = SimpleNamespace(
        samples_per_frame=1920,
        sample_rate=24000,
        quantized={f"layers.{i}.w": QuantSpec(b, 64) for i, b in enumerate(bits)},
    )
    return slow_generation_note(tts, paced, SimpleNamespace(speed=speed, model=model))


def test_speech_generated_slower_than_it_plays_names_the_faster_model(monkeypatch):
    """On a base M1 the bf16 release makes ~0.5 s of speech per second: playback waits.
    speak says so once, with the command that makes a model reading fewer bytes."""
    monkeypatch.delenv("VOXTRAL_MLX_MODEL", raising=False)
    note = _slow_note((100, 100 * 0.13))  # 130 ms per 80 ms frame
    assert note is not None and "\n" not in note
    assert "generated at 0.62x the speed it plays at" in note
    assert note.endswith(
        "voxtral-mlx convert mistralai/Voxtral-4B-TTS-2603 -o Voxtral-4B-TTS-2603-4bit "
        "--q-bits 4, then speak -m Voxtral-4B-TTS-2603-4bit"
    )
    note = _slow_note((100, 100 * 0.13), model="/Users/me/My Models/voxtral/", bits=(8, 8))
    assert "convert '/Users/me/My Models/voxtral/' -o voxtral-4bit" in note
    monkeypatch.setenv("VOXTRAL_MLX_MODEL", "me/voxtral-6bit")
    assert "convert me/voxtral-6bit -o voxtral-6bit-4bit" in _slow_note((100, 13.0), bits=(6,))
    # Faster played speech needs faster generation: 60 ms frames at --speed 1.5.
    assert "at 0.89x" in _slow_note((100, 6.0), speed=1.5)


@pytest.mark.parametrize(
    "paced, speed, bits",
    [
        ((100, 7.9), 1.0, ()),  # keeps up
        ((100, 8.3), 1.0, ()),  # within 5 %: a hiccup, not a slow machine
        ((24, 24 * 0.2), 1.0, ()),  # too few frames to judge (the first one compiles)
        ((0, 0.0), 1.0, ()),  # nothing played
        ((100, 13.0), 1.0, (4, 8)),  # already 4-bit: nothing smaller to offer
        ((100, 10.0), 0.5, ()),  # slowed down to half speed: it keeps up
    ],
)
def test_no_slow_note_when_generation_keeps_up_or_nothing_is_smaller(paced, speed, bits):
    assert _slow_note(paced, speed=speed, bits=bits) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ALSA recording device")
def test_speak_measures_each_played_segment_for_the_slow_note(model_dir, tmp_path):
    """What the note is given: every played segment's frames and the seconds they took, on
    a GPU only (faked here: on a CPU quantized products are slower), when playing only."""
    from test_cli import _alsa_env, _portaudio_available

    if not _portaudio_available():
        pytest.skip("PortAudio is not installed (apt-get install libportaudio2)")
    alsa, _ = _alsa_env(tmp_path)
    code = textwrap.dedent(
        """
        import sys
        import voxtral_mlx.cli.speak as speak
        speak._on_gpu = lambda: True
        def note(tts, paced, args):
            print(f"paced {paced[0]} {paced[1]:.6f}", file=sys.stderr)
            return "voxtral-mlx: note: slow"
        speak.slow_generation_note = note
        from voxtral_mlx.cli import main
        sys.exit(main(sys.argv[1:]))
        """
    )
    text = "One.\n\nTwo more words.\n\nAnd three."
    args = ["speak", "-m", str(model_dir), "--max-frames", "10", "--seed", "1", "--verbose", text]
    for extra, plays in (([], True), (["-o", str(tmp_path / "x.wav")], False)):
        proc = subprocess.run(
            [sys.executable, "-c", code, *args, *extra],
            env=env_with_repo(alsa),
            capture_output=True,
            timeout=300,
            cwd=REPO,
        )
        err = proc.stderr.decode()
        assert proc.returncode == 0, err
        lines = [line for line in err.splitlines() if line.startswith("paced ")]
        if not plays:
            assert lines == [] and "note: slow" not in err
            continue
        assert len(lines) == 1 and err.count("voxtral-mlx: note: slow\n") == 1, err
        frames, seconds = lines[0].split()[1:]
        assert int(frames) == 30  # 3 segments of --max-frames (END never fires)
        per_frame = float(seconds) / 30
        assert 0 < per_frame < 1.0
