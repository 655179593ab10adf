#!/usr/bin/env bash
# EXPERIMENT (plan items 0 and 5 in benchmarks/NOTES.md): the exact Δ's row sums on the matrix unit,
# guarded, against main, in one device call (~8 minutes on an H200; ~5 with two cells).
#
#   bash benchmarks/experiments/seen_sum_ab.sh        # results in $OUT: seen_sum_ab.tgz and the log
#   CELLS="bf16 64 32;fp16 64 32" bash benchmarks/experiments/seen_sum_ab.sh   # fewer cells (dtype, E, heads)
#   PATCH=benchmarks/experiments/dq_seen_sum_mma_guarded.patch bash ...       # σ̃ alone (session 19's patch)
#   PATCH=benchmarks/experiments/bwd_preprocess_row_reference.patch SEQ=1024 HOST=1 bash ...
#       # session 26's one launch fewer per backward: per-launch times at 1k, then host time per step
#
# SEQ (4096): the length of the per-launch timing. HOST=1 adds host_overhead.py (eager, GPU kept
# busy: host time alone) on both trees at the first cell, non-causal and causal, training steps.
#
# PATCH (default dq_row_sums_mma_guarded.patch, session 25): σ̃ and, without dLSE, Λ accumulate on
# the matrix unit. The patched copy's backward table entries are carried (carry_table_entries.py),
# so both trees run the same shipped picks: without that the patched kernels' changed file hash
# would send it to the heuristic configs.
# 1. A patched copy of the checkout (/tmp/seen_sum_patched) runs backward_fault_repro.py on the
#    lengths-of-1 shapes that faulted in session 17 with the unguarded patch, over its 4-warp
#    configs: with the guard, S = 1 takes the adds, so nothing may fault.
# 2. backward_breakdown.py times each backward launch on main and on the patch, alternating, at
#    bf16/fp16 x E 64/128, L = 4096, non-causal and causal, table configs: the dQ pass's time is
#    the figure (session 16 measured 6-14 % of it at E 64 with the unguarded σ̃ patch; session 25's
#    SASS count predicts -20 to -29 % of the dQ loop's instructions at the E 64 picks).
# Session 26 ran it (bf16/fp16 E 64, bf16 E 128): no fault, but the dQ pass 2-3 % faster only at bf16 E 64
# and 4-8 % slower elsewhere (benchmarks/results/row_sums_mma_ab_nvidia-h200_20261202_s26.json), so it
# is not landed; the script stays as the A/B harness for any dQ patch (PATCH=...).
# Landing a patch that wins means applying the patch and either re-tuning the `stable` backward buckets
# (only their dQ kernels change: tools/ptx_digest.py) or carrying them after this A/B, then the GPU suite.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/flash_inductor_out}
RESULTS=$OUT/seen_sum_ab
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache_seen_sum
EMPTY_CACHE=$(mktemp -d)
export FLASH_INDUCTOR_CACHE_DIR=$EMPTY_CACHE   # the shipped table, not a user's
PATCHED=/tmp/seen_sum_patched
rm -rf "$PATCHED" && mkdir -p "$PATCHED"
cp -r flash_inductor benchmarks tests tools pyproject.toml "$PATCHED"/
PATCH=${PATCH:-benchmarks/experiments/dq_row_sums_mma_guarded.patch}
(cd "$PATCHED" && git apply "$OLDPWD/$PATCH") || { echo "$PATCH no longer applies to this checkout"; exit 2; }
(cd "$PATCHED" && PYTHONPATH=$PATCHED python3 tools/carry_table_entries.py --family backward \
  --reason "A/B only (seen_sum_ab.sh): $(basename "$PATCH")") || { echo "carrying the table failed"; exit 2; }
T0=$(date +%s)
echo "== fault repro on the patch"
(cd "$PATCHED" && CUDA_LAUNCH_BLOCKING=1 PYTHONPATH=$PATCHED timeout 240 python3 benchmarks/experiments/backward_fault_repro.py \
  --shapes 7x1x64,1x1x128,64x1x64,7x1x128,129x129x64 --kinds fp16:stable,bf16:stable \
  --out "$RESULTS" --tag seen-guarded 2>&1 | tail -12)
echo "== per-launch times, main vs patch ($(( $(date +%s) - T0 ))s)"
SEQ=${SEQ:-4096}
BATCH=$(( 16384 / SEQ > 1 ? 16384 / SEQ : 1 ))  # 16k tokens a call, as the tuner times
IFS=';' read -r -a CELL_LIST <<< "${CELLS:-bf16 64 32;fp16 64 32;bf16 128 16;fp16 128 16}"
for cell in "${CELL_LIST[@]}"; do
  set -- $cell
  for causal in "" "--causal"; do
    for tree in main patched; do
      root=$PWD; [ "$tree" = patched ] && root=$PATCHED
      (cd "$root" && PYTHONPATH=$root timeout 90 python3 benchmarks/backward_breakdown.py --dtype "$1" --head-dim "$2" \
        --heads "$3" --batch "$BATCH" --seq "$SEQ" $causal \
        --schedules stable --out "$RESULTS" \
        --tag "$tree-$1-e$2${causal:+-causal}" 2>&1 | sed -n '/table configs/,/compiled backward kernels/p' | head -9)
      echo "   ^ $tree $1 E$2 ${causal:-non-causal}"
    done
  done
done
if [ "${HOST:-0}" = 1 ]; then
  set -- ${CELL_LIST[0]}
  echo "== host time per training step, main vs patch ($(( $(date +%s) - T0 ))s)"
  for causal in no yes; do
    for tree in main patched; do
      root=$PWD; [ "$tree" = patched ] && root=$PATCHED
      mkdir -p "$RESULTS/host-$tree-$causal"
      (cd "$root" && PYTHONPATH=$root timeout 120 python3 benchmarks/experiments/host_overhead.py --dtype "$1" \
        --head-dim "$2" --heads "$3" --seq "$SEQ" --batch "$BATCH" \
        --causal "$causal" --out "$RESULTS/host-$tree-$causal" 2>&1 | grep " host " | head -9)
      echo "   ^ $tree $1 E$2 causal=$causal"
    done
  done
fi
tar czf "$OUT/seen_sum_ab.tgz" -C "$OUT" seen_sum_ab && rm -rf "$RESULTS" "$EMPTY_CACHE"
echo "== done ($(( $(date +%s) - T0 ))s)"
