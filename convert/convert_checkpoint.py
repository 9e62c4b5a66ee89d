"""Convert a Voxtral TTS checkpoint to a self-contained MLX directory, optionally quantized.

Usage: python convert/convert_checkpoint.py MODEL -o OUT_DIR [--q-bits {4,6,8}]
       [--q-group-size 64] [--q-flow-bits N] [--dtype bfloat16] [--force] [--verbose]
The same as ``voxtral-mlx convert``; see voxtral_mlx/convert.py for the layout and the
precision of each component.
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
        return cli_main(["convert", *sys.argv[1:]], own_process=True)
    return cli_main(["convert", *argv])


if __name__ == "__main__":
    sys.exit(main())
