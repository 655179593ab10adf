"""``python -m flash_inductor.autotune`` (or ``flash-inductor-autotune``): tune this GPU's launch
configs (see cli.py)."""

import sys

from ..cli_args import run
from .cli import PROG, main


def cli() -> int:
    """The ``flash-inductor-autotune`` console script: :func:`main` on ``sys.argv``, a usage error
    as one line and exit code 2."""
    return run(main, prog=PROG)


if __name__ == "__main__":
    sys.exit(cli())
