#!/usr/bin/env bash
# Attention variants (soft-capping, sinks, packed sequences) on one GPU, in one bounded call:
#   carry .whl (bash tools/fetch_device_wheels.sh), then:  bash tools/gpu_variants.sh
# 1. their GPU tests, with the dense kernel tests their kernel switches share (SUITE_SECONDS,
#    default 330; stopped with SIGINT so the junit XML names what finished);
# 2. benchmarks/variants.py: packed sequences against Flex and nested SDPA, and the cost of sinks
#    and soft-capping over the plain causal kernel (BENCH_SECONDS, default 200).
# Writes $OUT/variants_tests.{log,xml}, gpu.txt and the benchmark's JSON and PNG.
# STEPS=tests or STEPS=bench runs one of the two.
set -uo pipefail
cd "$(dirname "$0")/.."
source tools/device_env.sh
STEPS=${STEPS:-tests,bench}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
if [[ ",$STEPS," == *,tests,* ]]; then
  timeout -s INT -k 30 "${SUITE_SECONDS:-330}" python3 -m pytest tests/unit/test_variants.py \
    tests/unit/test_kernels_softcap.py tests/unit/test_kernels.py tests/unit/test_window.py \
    -k "test_variants or test_kernels_softcap or features or shapes or window_kernels" -q -p no:cacheprovider -n "${WORKERS:-14}" \
    --durations=15 --junitxml="$OUT/variants_tests.xml" 2>&1 | tee "$OUT/variants_tests.log" | tail -30
fi
if [[ ",$STEPS," == *,bench,* ]]; then
  timeout "${BENCH_SECONDS:-200}" python3 -m benchmarks.variants --out "$OUT" \
    --time-budget "$(( ${BENCH_SECONDS:-200} - 30 ))" --heat-ms "${HEAT_MS:-200}" 2>&1 | tail -40
fi
