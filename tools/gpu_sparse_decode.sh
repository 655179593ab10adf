#!/usr/bin/env bash
# Windows, block sparsity and decode on the GPU in one bounded call: their tests, then the
# benchmarks of docs/sparse_attention.md and docs/decode.md. Each step is stopped with SIGINT at its
# budget, so pytest's junit XML and the benchmarks' partial records still name what finished.
#
#   bash tools/gpu_sparse_decode.sh                  # everything, about 9 minutes on an H200
#   STEPS="decode generate" bash tools/gpu_sparse_decode.sh
#
# STEPS (default: tests window block_sparse decode generate), WORKERS (pytest-xdist, 14).
# Results in $OUT (default /tmp/flash_inductor_out): gpu_tests_sparse.xml, sparse_*.json/png,
# decode*.json/png.
set -uo pipefail
cd "$(dirname "$0")/.."
source tools/device_env.sh
for step in ${STEPS:-tests window block_sparse decode generate}; do
  echo "=== $step"
  case $step in
    tests)
      timeout -s INT -k 20 200 python3 -m pytest tests/unit/test_window.py tests/unit/test_block_sparse.py \
        tests/unit/test_decode.py tests/models/test_hf_generation.py tests/passes/test_window_rewrite.py \
        tests/tuning/test_table_edges.py tests/tuning/test_autotune_decode.py -q -n "${WORKERS:-14}" \
        --dist worksteal -p no:cacheprovider --junitxml "$OUT/gpu_tests_sparse.xml" 2>&1 | tail -15 ;;
    window)
      timeout -s INT -k 10 120 python3 -m benchmarks.sparse_attention --part window --seqs 16384,4096,32768 \
        --windows 1024,256,4096 --time-budget 95 --out "$OUT" 2>&1 | tail -25 ;;
    block_sparse)
      timeout -s INT -k 10 75 python3 -m benchmarks.sparse_attention --part block_sparse --seqs 16384 \
        --sparsities 0.9,0.5 --time-budget 55 --out "$OUT" 2>&1 | tail -12 ;;
    decode)
      timeout -s INT -k 10 95 python3 -m benchmarks.decode --query-rows 1,4 --time-budget 75 --out "$OUT" 2>&1 | tail -30 ;;
    generate)
      timeout -s INT -k 10 150 python3 -m benchmarks.decode --part generate --out "$OUT" 2>&1 | tail -8 ;;
    *) echo "unknown step $step (tests, window, block_sparse, decode, generate)" >&2; exit 2 ;;
  esac
done
ls "$OUT"
