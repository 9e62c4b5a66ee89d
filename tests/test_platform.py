"""Where MLX cannot be imported (an Intel Mac, Windows, a broken install), the command and
the library say so in one line instead of a traceback from deep inside an import."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# MLX made unimportable for the child process, as on a platform without a build.
BLOCK_MLX = "import sys; sys.modules['mlx'] = None; sys.modules['mlx.core'] = None\n"


def _env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "sitecustomize.py").write_text(BLOCK_MLX)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(REPO), env.get("PYTHONPATH", "")])
    return env


def test_the_command_names_the_missing_mlx(tmp_path):
    for args in (["speak", "-m", str(tmp_path), "Hi.", "-o", str(tmp_path / "a.wav")],
                 ["random-checkpoint", str(tmp_path / "ckpt"), "--size", "tiny"]):  # fmt: skip
        proc = subprocess.run(
            [sys.executable, "-m", "voxtral_mlx", *args],
            env=_env(tmp_path),
            capture_output=True,
            text=True,
            timeout=120,
        )
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and len(lines) == 1, proc.stderr
        assert lines[0].startswith("voxtral-mlx: error: MLX cannot be imported")
        assert "pip install mlx" in lines[0] and "mlx[cpu]" in lines[0]
    assert not (tmp_path / "a.wav").exists() and not (tmp_path / "ckpt").exists()


def test_the_library_raises_a_platform_error(tmp_path):
    code = (
        "import voxtral_mlx\n"
        "from voxtral_mlx.errors import PlatformError\n"
        "try:\n"
        "    voxtral_mlx.load('/nonexistent')\n"
        "except PlatformError as e:\n"
        "    assert isinstance(e, ImportError)\n"
        "    print('PlatformError:', e)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=_env(tmp_path), capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("PlatformError: MLX cannot be imported")


@pytest.mark.parametrize(
    ("error", "is_mlx"),
    [
        (ModuleNotFoundError("No module named 'mlx'", name="mlx"), True),
        (ModuleNotFoundError("No module named 'mlx.core'", name="mlx.core"), True),
        (ImportError("libmlx.so: cannot open shared object file"), True),
        (ImportError("/site-packages/mlx/core.so: undefined symbol: x"), True),
        # A broken install of this package was told Intel Macs have no MLX build.
        (ModuleNotFoundError("No module named 'voxtral_mlx.x'", name="voxtral_mlx.x"), False),
        (ImportError("cannot import name 'y' from 'voxtral_mlx.x'"), False),
    ],
)
def test_only_mlx_itself_failing_is_called_missing_mlx(error, is_mlx):
    from voxtral_mlx.errors import is_mlx_import_error

    assert is_mlx_import_error(error) is is_mlx
