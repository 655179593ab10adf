#!/usr/bin/env bash
# Session 17, call 1 (one GPU, <= 560 s; a copy of .runs/s17_call1.sh): find the launch and the patch behind session 16's
# illegal memory access (test_shapes[fp16-L7_S1_E64] on the three backward patches).
#  1. the combined patch (experiments/backward_loops_s16.patch): the repro over shapes, kinds and
#     config pairs, each launch synchronised (CUDA_LAUNCH_BLOCKING=1);
#  2. compute-sanitizer memcheck on the failing case (kernel name and instruction);
#  3. stages a (main), b (+dq_row_scale), c (+even_tiles), d (+dq_seen_sum_mma) on the faulting case.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD FLASH_INDUCTOR_CACHE_DIR=/tmp/nocache TORCHINDUCTOR_CACHE_DIR=/tmp/ind
T0=$(date +%s)
R=benchmarks/experiments/backward_fault_repro.py
FAULT_CFG="64x64/w4/s3+64x64/w4/s4"   # dQ + dK/dV: the session-16 table's fp16 stable E64 s1024 pick
cp $R /tmp/repro.py   # the stages below rewrite the tree; keep one copy of the script
git apply benchmarks/experiments/backward_loops_s16.patch || exit 3
CUDA_LAUNCH_BLOCKING=1 timeout 200 python3 /tmp/repro.py --shapes 7x1x64,7x3x64,1x1x64,64x1x64,129x129x64 \
  --kinds fp16:stable,bf16:stable,fp16:accurate,fp16:fast \
  --configs "$FAULT_CFG,64x64/w4/s3+64x64/w4/s3,64x128/w4/s2+32x64/w4/s3,64x64/w4/s3+32x64/w4/s3,64x128/w4/s2+64x64/w4/s4" \
  --out $OUT --tag combined > $OUT/log_combined.txt 2>&1
echo "combined rc=$? t=$(( $(date +%s) - T0 ))"; grep -E "FAULT|cases" $OUT/log_combined.txt | cut -c1-220 | head -30
timeout 150 compute-sanitizer --tool memcheck --target-processes all --print-limit 5 python3 /tmp/repro.py --shapes 7x1x64 --kinds fp16:stable \
  --configs "$FAULT_CFG" > $OUT/log_sanitizer.txt 2>&1
echo "sanitizer rc=$? t=$(( $(date +%s) - T0 ))"; grep -E "Invalid|at 0x|by thread|Address|kernel|ERROR SUMMARY" $OUT/log_sanitizer.txt | head -20 | cut -c1-240
git apply -R benchmarks/experiments/backward_loops_s16.patch || exit 4
run_case() {  # $1: a label; the faulting case and the L = S = 129 control, fp16 stable and accurate
  CUDA_LAUNCH_BLOCKING=1 timeout 60 python3 /tmp/repro.py --shapes 7x1x64,129x129x64 --kinds fp16:stable,fp16:accurate \
    --configs "$FAULT_CFG" > $OUT/log_one.txt 2>&1
  echo "== $1 rc=$? t=$(( $(date +%s) - T0 ))" | tee -a $OUT/log_stages.txt; grep -E "FAULT|cases" $OUT/log_one.txt | cut -c1-220 | tee -a $OUT/log_stages.txt
}
for tag in a b c d; do
  if [ $tag = b ]; then git apply benchmarks/experiments/dq_row_scale.patch || exit 3; fi
  if [ $tag = c ]; then git apply benchmarks/experiments/even_tiles.patch || exit 3; fi
  if [ $tag = d ]; then git apply benchmarks/experiments/dq_seen_sum_mma.patch || exit 3; fi
  run_case "stage $tag"
done
git apply -R benchmarks/experiments/dq_seen_sum_mma.patch benchmarks/experiments/even_tiles.patch benchmarks/experiments/dq_row_scale.patch || exit 4
# Two variants of the combined patch for sigma-tilde (the only 64x16 wgmma): a 32-wide ones tile,
# and fp16's rescaling kernels back on the fp32 adds.
for v in seen_n32 seen_alu_fp16; do
  git apply benchmarks/experiments/backward_loops_s16_$v.patch || exit 5
  run_case "variant $v"
  git apply -R benchmarks/experiments/backward_loops_s16_$v.patch || exit 6
done
rm -f $OUT/log_one.txt
