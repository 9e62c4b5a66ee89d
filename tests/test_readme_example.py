"""The README's "Use from a macOS app" example runs as written (on a random checkpoint, with
PortAudio playing into an ALSA file device instead of speakers)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from voxtral_mlx.synthetic.checkpoint import build_random_checkpoint

REPO = Path(__file__).resolve().parents[1]
ALSA_TEMPLATE = Path(__file__).with_name("alsa") / "asoundrc.in"


def app_example() -> str:
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Use from a macOS app", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, "the README's macOS-app section lost its example"
    return blocks[0]


def test_the_macos_app_example_runs(tmp_path):
    if not sys.platform.startswith("linux"):
        pytest.skip("the stand-in output device is an ALSA plugin: Linux only")
    checkpoint = build_random_checkpoint(tmp_path / "model", "tiny", seed=3)
    code = app_example()
    assert code.count("voxtral_mlx.load()") == 1
    code = code.replace("voxtral_mlx.load()", f"voxtral_mlx.load({str(checkpoint)!r})")
    code += "\ntts.close()\nprint('example finished')\n"

    conf = tmp_path / "asoundrc"
    conf.write_text(ALSA_TEMPLATE.read_text().replace("@RECORD_PATH@", str(tmp_path / "rec")))
    env = dict(os.environ)
    env["ALSA_CONFIG_PATH"] = str(conf)
    env["JACK_NO_START_SERVER"] = "1"
    env["VOXTRAL_MLX_CACHE"] = str(tmp_path / "cache")
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode and "PortAudio library not found" in proc.stderr:
        reason = "PortAudio is not installed (apt-get install libportaudio2)"
        if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
            pytest.fail(f"{reason}; CI must run this test (see ci/apt-packages.txt)")
        pytest.skip(reason)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("example finished")
