#!/usr/bin/env bash
# Download what the GPU machine lacks for the test suite (it has pytest but not expecttest) into
# .whl/ (ignored by git), for the device tool's `carry: [".whl"]`; tools/gpu/env.sh installs
# it there. The device runs Python 3.12 on x86-64 Linux, so the wheel is fetched for that, not for
# this machine. A fresh checkout has no .whl/: run this once before the first device call.
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl expecttest==0.3.0
ls .whl
