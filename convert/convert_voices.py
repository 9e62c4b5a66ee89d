"""Convert Mistral's ``voice_embedding/*.pt`` voices to ``<name>.safetensors`` (key ``embedding``).

Usage: python convert/convert_voices.py SRC... -o OUT_DIR [--force]
Each SRC is a .pt file or a directory of them. Needs no torch: the .pt pickle is read by a
restricted reader that refuses anything but tensors.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    from voxtral_mlx.errors import VoxtralError
    from voxtral_mlx.voices import convert_voice_files
except ImportError:  # run from a source checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from voxtral_mlx.errors import VoxtralError
    from voxtral_mlx.voices import convert_voice_files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Convert torch.save'd voice embeddings (.pt) to safetensors, without torch."
    )
    parser.add_argument(
        "sources", nargs="+", type=Path, metavar="SRC", help=".pt voice file or directory of them"
    )
    parser.add_argument(
        "-o",
        "--output",
        "--out",
        dest="out",
        required=True,
        type=Path,
        metavar="OUT_DIR",
        help="directory to write <name>.safetensors into (created if needed)",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace .safetensors files already in OUT_DIR (as `voxtral-mlx convert-voices`)",
    )
    args = parser.parse_args(argv)
    try:
        written = convert_voice_files(args.sources, args.out, overwrite=args.force)
    except VoxtralError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
