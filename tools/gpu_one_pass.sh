#!/usr/bin/env bash
# Validates `stable`'s one-pass exact Δ (ops/one_pass.py, routed by launch.hopper_bwd.ONE_PASS_STABLE)
# in one device call: its GPU tests, then the probe's parts' times, peak memory,
# the stability suite's unmasked cases (long_32k included) and the forward+backward grid against
# cuDNN, `stable` on the Triton backward and `fast` (docs/hopper_backward.md, "Exact Δ in one pass").
# The probe's fp64 features (PARTS=features; ~200 s) repeat what the tests check.
#
#   source tools/device_env.sh; bash tools/gpu_one_pass.sh          # ~8 min after the machine starts
#   SPEED_SECONDS=120 PARTS=suite,speed bash tools/gpu_one_pass.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/flash_inductor_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  echo "=== tests"
  # Workers compile the kernel variants side by side (one at a time, 240 s ran 14 of ~30 tests).
  timeout "${TEST_SECONDS:-240}" python3 -m pytest -q -p no:cacheprovider tests/unit/test_one_pass.py \
    -n "${WORKERS:-12}" --timeout 200 --durations=10 --junitxml "$OUT/one_pass_tests.xml"
  echo "exit status $?"
  echo "=== probe"
  timeout "$(( ${SPEED_SECONDS:-200} + 200 ))" python3 -m benchmarks.experiments.exact_delta_probe --out "$OUT" \
    --parts "${PARTS:-breakdown,memory,suite,speed}" --budget "${SPEED_SECONDS:-200}"
  echo "exit status $?"
} 2>&1 | tee "$OUT/one_pass.log"
