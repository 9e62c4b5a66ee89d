"""The ``voxtral-mlx`` program (and ``python -m voxtral_mlx``).

Signals are taken over before the command line's modules are imported: a Ctrl-C during
start-up ends the process with one line, not with a traceback from inside an import.
"""

import sys

from .interrupts import exit_on_signals

exit_on_signals("voxtral-mlx: error: interrupted")

from .cli import main  # noqa: E402  (after the handlers, on purpose)


def run() -> None:
    sys.exit(main())
