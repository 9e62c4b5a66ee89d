"""Convert Mistral's ``voice_embedding/*.pt`` voices to ``<name>.safetensors`` (key ``embedding``).

Usage: python convert/convert_voices.py SRC... -o OUT_DIR [--force]
Each SRC is a .pt file or a directory of them. The same as ``voxtral-mlx convert-voices``
(one-line errors, Ctrl-C and SIGTERM leave nothing half-written). Needs no torch: the .pt
pickle is read by a restricted reader that refuses anything but tensors.
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    from voxtral_mlx.cli import main as cli_main
except ImportError:  # run from a source checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from voxtral_mlx.cli import main as cli_main


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # run as a script: the process is the command's own
        return cli_main(["convert-voices", *sys.argv[1:]], own_process=True)
    return cli_main(["convert-voices", *argv])


if __name__ == "__main__":
    sys.exit(main())
