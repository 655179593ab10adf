#!/usr/bin/env python
"""Same as `python -m flash_inductor.autotune` (run from a checkout without installing).

    python tools/autotune.py --quick --output $OUT --summary $OUT/autotune_quick.json
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from flash_inductor.autotune.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
