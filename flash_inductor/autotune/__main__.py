"""``python -m flash_inductor.autotune``: tune this GPU's launch configs (see cli.py)."""

import sys

from ..cli_args import run
from .cli import PROG, main

if __name__ == "__main__":
    sys.exit(run(main, prog=PROG))
