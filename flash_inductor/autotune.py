"""``python -m flash_inductor.autotune``: tune this GPU's launch configs (see tuning/cli.py)."""

import sys

from .tuning.cli import main

if __name__ == "__main__":
    sys.exit(main())
