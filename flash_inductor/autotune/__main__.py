"""``python -m flash_inductor.autotune``: tune this GPU's launch configs (see cli.py)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
