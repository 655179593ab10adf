#!/usr/bin/env bash
# The Hopper kernels' pending GPU checks in one bounded call (docs/hopper_backward.md, docs/decode.md):
# their GPU tests, the backward's grid-order A/B on HF Llama's GQA shapes, the inference-forward grid
# (bench_attention's mode infer) and HF Llama trained eagerly against "sdpa". Each step is stopped
# with SIGINT at its budget, so what finished is still written.
#
#   bash tools/gpu_hopper_ab.sh                    # about 9 minutes on an H200
#   STEPS="tests ab" bash tools/gpu_hopper_ab.sh
#
# STEPS (default: tests ab infer eager; also decode: the split-KV decode against cuDNN and Flex at
# 1 and 4 query rows, docs/decode.md; cold: Llama E 64's cold first step with compile-ahead on, off,
# on, each from empty caches, about 3 minutes; host: one eager call's host time and cProfile, bf16
# and fp16 at E 128 causal 4k; llama_b1: HF Llama E 64/128 trained at B 1, 4k, against plain
# torch.compile; llama_b1_graphs: the same with both contenders under mode="reduce-overhead"
# (CUDA graphs: the host's launch time out of the step); window: the narrow-window cells, ours against Flex, with kernel
# time; persistent: the persistent forward's bitwise tests
# and its speed beside the grid's and cuDNN's; tree_ab: a change without a
# switch against the tree before it, which travels as .ab_base (git-ignored; make it with
# `rm -rf .ab_base && mkdir .ab_base && git archive <rev> | tar -x -C .ab_base` and carry .ab_base):
# the one-pass GPU tests on this tree, then the host breakdown (B 1, E 64, causal 4k, bf16 and
# fp16) and a bf16 causal 4k training step's kernels from each tree in turn (about 8 minutes at
# most), archived into $OUT/tree_ab.tgz),
# WORKERS (pytest-xdist, 14). Results in $OUT
# (default /tmp/flash_inductor_out): gpu_tests_hopper.xml, hopper_bwd.json, bench_*_infer.*,
# debug_overhead_*.json.
set -uo pipefail
cd "$(dirname "$0")/.."
source tools/device_env.sh
for step in ${STEPS:-tests ab infer eager}; do
  echo "=== $step"
  case $step in
    tests)
      timeout -s INT -k 20 220 python3 -m pytest tests/unit/test_hopper_bwd.py tests/unit/test_one_pass.py \
        tests/unit/test_hopper_fwd.py tests/unit/test_decode.py -q -n "${WORKERS:-14}" --dist worksteal \
        -p no:cacheprovider --junitxml "$OUT/gpu_tests_hopper.xml" 2>&1 | tail -15 ;;
    ab)
      # HF Llama E 128 (B 2, 16 query heads over 4, 4k) and E 64 (B 4, 16 over 4, 2k), causal.
      timeout -s INT -k 10 60 python3 -m benchmarks.experiments.hopper_bwd_probe --skip-check --precompile 0 \
        --providers gluon gluon-headmajor cudnn --dtypes bf16 --head-dims 128 --causal 1 --seqs 4096 \
        --batch 2 --heads 16 --gqa 4 --budget 40 --out "$OUT" 2>&1 | tail -6
      mv "$OUT/hopper_bwd.json" "$OUT/hopper_bwd_gqa_e128.json" 2>/dev/null
      timeout -s INT -k 10 60 python3 -m benchmarks.experiments.hopper_bwd_probe --skip-check --precompile 0 \
        --providers gluon gluon-headmajor cudnn --dtypes bf16 --head-dims 64 --causal 1 --seqs 2048 \
        --batch 4 --heads 16 --gqa 4 --budget 40 --out "$OUT" 2>&1 | tail -6 ;;
    infer)
      timeout -s INT -k 10 170 python3 -m benchmarks.bench_attention --dtypes bf16,fp16 --head-dims 64,128 \
        --causal both --seqs 4096,16384 --modes infer --providers ours,cudnn,flash,flex --rep 30 --warmup 10 \
        --heat-ms 300 --precompile 14 --time-budget 150 --tag infer --out "$OUT" 2>&1 | tail -25 ;;
    eager)
      timeout -s INT -k 10 150 python3 -m benchmarks.debug_overhead --no-debug --steps 10 --hf-heat 3 \
        --hf-profile 24 --out "$OUT" 2>&1 | grep -v '^ *"\(name\|calls\|ms\)"' | tail -12 ;;
    decode)
      timeout -s INT -k 10 100 python3 -m benchmarks.decode --query-rows 1,4 --contenders ours,cudnn,flex \
        --time-budget 80 --out "$OUT" 2>&1 | tail -30 ;;
    host)
      # Host time of one eager call and its cProfile, at the grid's 4k causal E 128 cell (B 4, H 16).
      for dtype in bf16 fp16; do
        timeout -s INT -k 10 80 python3 -m benchmarks.experiments.host_overhead --dtype $dtype --batch 4 --heads 16 \
          --seq 4096 --head-dim 128 --causal yes --out "$OUT/host_$dtype" 2>&1 | tail -10
      done ;;
    llama_b1)
      # HF Llama trained at B 1, 4k (the GQA group split's one-wave grids) against plain torch.compile.
      timeout -s INT -k 10 200 python3 -m benchmarks.e2e_models --models llama-e64,llama-e128 --seqs 4096 \
        --tokens 4096 --tasks train --attn sdpa --precompile 8 --time-budget 170 --out "$OUT" 2>&1 | tail -12 ;;
    llama_b1_graphs)
      timeout -s INT -k 10 240 python3 -m benchmarks.e2e_models --models llama-e64,llama-e128 --seqs 4096 \
        --tokens 4096 --tasks train --attn sdpa --mode reduce-overhead --precompile 8 --time-budget 210 \
        --tag graphs --out "$OUT" 2>&1 | tail -12 ;;
    cold)
      for contender in flash_inductor flash_inductor_no_compile_ahead flash_inductor; do
        timeout -s INT -k 10 100 python3 -m benchmarks.cold_start --models llama-e64 --tasks train --parts cold \
          --contenders "$contender" --child-timeout 90 --tag "cold-$contender-$(date +%s)" --out "$OUT" 2>&1 | tail -3
      done ;;
    persistent)
      # The persistent forward (HopperForwardConfig.persistent, a tuned field): bitwise against the
      # grid, and the inference forward's speed beside the grid's and cuDNN's (E 64 also with two
      # consumers).
      timeout -s INT -k 20 170 python3 -m pytest tests/unit/test_hopper_fwd.py -k persistent -q -n "${WORKERS:-14}" \
        -p no:cacheprovider --timeout 100 2>&1 | tail -4
      timeout -s INT -k 10 130 python3 -m benchmarks.experiments.hopper_fwd_probe --skip-check --dtypes bf16 \
        --seqs 2048 4096 16384 --configs 128x3w3pP:64 128x4w2pP:64 128x4w2p:64 128x2pP:128 --baselines cudnn \
        --rep 30 --heat 0.2 --budget 110 --out "$OUT" 2>&1 | grep -v '^\[' | tail -14
      ;;
    tree_ab)
      [ -d .ab_base/flash_inductor ] || { echo "tree_ab: no .ab_base tree (see the header)" >&2; exit 2; }
      timeout -s INT -k 20 170 python3 -m pytest tests/unit/test_one_pass.py -q -n "${WORKERS:-14}" \
        -p no:cacheprovider --timeout 120 2>&1 | tail -3
      mkdir -p "$OUT/tree_ab"
      for tree in base new; do
        root=$PWD; [ $tree = base ] && root=$PWD/.ab_base
        for dtype in bf16 fp16; do
          (cd "$root" && PYTHONPATH=$root:/tmp/site timeout -s INT -k 10 60 python3 -m benchmarks.experiments.host_overhead \
            --breakdown --dtype $dtype --batch 1 --heads 16 --seq 4096 --head-dim 64 --causal yes \
            --out "$OUT/tree_ab/host_${tree}_$dtype") 2>&1 | tail -2
        done
        (cd "$root" && PYTHONPATH=$root:/tmp/site timeout -s INT -k 10 60 python3 -m benchmarks.experiments.step_kernels \
          --dtypes bf16 --head-dims 64,128 --seq 4096 --causal --modes fwd_bwd --providers ours \
          --out "$OUT/tree_ab/steps_$tree") 2>&1 | tail -3
      done
      tar -czf "$OUT/tree_ab.tgz" -C "$OUT" tree_ab && rm -rf "$OUT/tree_ab" ;;
    window)
      timeout -s INT -k 10 240 python3 -m benchmarks.sparse_attention --part window --providers ours,flex \
        --seqs 4096,16384,32768 --windows 256 --kernel-time --time-budget 220 --out "$OUT" 2>&1 | tail -14 ;;
    *) echo "unknown step $step (tests ab infer eager decode host llama_b1 llama_b1_graphs cold window persistent tree_ab)" >&2
       exit 2 ;;
  esac
done
ls "$OUT"
