#!/usr/bin/env bash
# Everything one device run needs, in one command (see the device tool's README):
#   carry .whl (expecttest wheel), then:  bash tools/gpu_suite.sh
# Writes the pytest log, junit XML and the quick benchmark into $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/flash_inductor_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=$PWD:/tmp/site
else
  export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
# Bounded so the benchmark still runs inside one 10-minute device call.
export FLASH_INDUCTOR_FAILURE_LOG="$OUT/failures.log"
# Work stealing (pytest-xdist >= 3.2) keeps a few long compile tests from forming the run's tail.
DIST=$(python3 -c "import xdist; v = tuple(int(p) for p in xdist.__version__.split('.')[:2]); print('worksteal' if v >= (3, 2) else 'load')" 2>/dev/null || echo load)
# Compilation (Inductor, Triton) is CPU-bound: one worker per core.
timeout "${SUITE_SECONDS:-420}" python3 -m pytest ${TESTS:-tests} -q -p no:cacheprovider -p no:benchmark \
  -n "${WORKERS:-14}" --dist "$DIST" --timeout 300 --durations=25 --junitxml="$OUT/pytest_gpu.xml" 2>&1 | tee "$OUT/pytest_gpu.log" | tail -40
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  timeout "${BENCH_SECONDS:-150}" python3 benchmarks/bench_attention.py --quick --out "$OUT" 2>&1 | tail -12
fi
