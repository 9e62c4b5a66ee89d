"""The command line, run as a new user would: in a subprocess, on a random checkpoint."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

import voxtral_mlx
from voxtral_mlx.audio.io import float_to_int16

REPO = Path(__file__).resolve().parents[1]
ALSA_TEMPLATE = Path(__file__).with_name("alsa") / "asoundrc.in"
TEXT = "Hello from the command line."


def run(*args, input=None, env=None, timeout=300):
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join([str(REPO), full_env.get("PYTHONPATH", "")])
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "voxtral_mlx", *args],
        input=input,
        capture_output=True,
        env=full_env,
        timeout=timeout,
        cwd=REPO,
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


def test_speak_verbose_reports_timings(model_dir, tmp_path):
    out = tmp_path / "v.wav"
    proc = run("speak", "-m", str(model_dir), "--seed", "1", "-o", str(out), "--verbose", "Hi.")
    assert proc.returncode == 0, proc.stderr.decode()
    err = proc.stderr.decode()
    for needle in ("loaded", "prefill", "ms/frame", "real-time factor", "peak memory"):
        assert needle in err, err


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


@pytest.mark.parametrize(
    "args, needle",
    [
        (["-v", "nobody", "Hi."], "unknown voice 'nobody'"),
        (["   "], "text is empty"),
        (["-f", "/nonexistent/text.txt"], "not found"),
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
    assert len(list((tmp_path / "v").glob("*.safetensors"))) == 20


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
    assert "underruns" in proc.stderr.decode()
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
