#!/usr/bin/env bash
# Bounded GPU steps in one device call: a feature's GPU tests, the benchmarks the docs cite, the
# stability evidence. Each step is stopped with SIGINT at its budget, so pytest's junit XML and the
# benchmarks' partial records still name what finished. Results and steps.log land in $OUT
# (default /tmp/flash_inductor_out); carry .whl (bash tools/gpu/fetch_wheels.sh) for the tests.
#
#   bash tools/gpu/steps.sh sparse_tests window block_sparse decode generate   # ~9 min on an H200
#   bash tools/gpu/steps.sh variants_tests variants                             # ~9 min
#   STEPS="hopper_tests infer eager" bash tools/gpu/steps.sh                    # ~9 min
#
# Tests (WORKERS: pytest-xdist workers, 14):
#   hopper_tests    the Gluon forward and backward, the one-pass path, decode (gpu_tests_hopper.xml)
#   sparse_tests    windows, block sparsity, decode, HF generation, the table's edges (gpu_tests_sparse.xml)
#   variants_tests  soft-capping, sinks and packed sequences, with the dense kernel tests their
#                   switches share (SUITE_SECONDS, 330; variants_tests.xml)
#   varlen_trial    the Gluon packed-sequence tests that wait for a GPU pass (tests/unit/test_kernels_varlen.py,
#                   FLASH_INDUCTOR_GLUON_VARLEN_TRIAL=1), then, if one failed, compute-sanitizer on the first
#                   failure (varlen_trial.xml, varlen_sanitizer.log); VARLEN_SECONDS (200)
#   rev_tests       TESTS (pytest arguments) on the tree as at REV (a branch or commit: git archive), for a
#                   kernel change kept off main until its GPU tests pass; SUITE_SECONDS (300); rev_tests.xml
#   memcheck        the address tests (tests/bounds_check.py: every Triton and Gluon kernel load and store
#                   inside the launch's tensors) under compute-sanitizer, after a canary overrun that it
#                   must report (memcheck_canary.py); MEMCHECK_SECONDS (420); memcheck.log
#   switch_tests    TESTS (default: the Gluon forward, one-pass and window tests) with a module switch
#                   on, SWITCH=module.NAME=value (tools/pytest_switch.py), e.g.
#                   SWITCH=launch.hopper_bwd.GROUP_SPLIT_MIN_WAVES=2
# Benchmarks:
#   grid            the full speed grid: bf16/fp16 x E 64/128/256 x causal or not x seq 512..32k x fwd and
#                   fwd+bwd; ours, ours-fast, FA2, cuDNN and Flex, heated, 14 compile workers, on the shipped
#                   table. A cold H200 needs two calls (540 s + 354 s on 2026-12-02): the second with
#                   RESUME="<the first's bench_*.json or .partial.jsonl>" TAG=grid-2, then merge with
#                   `python -m benchmarks.plot_results A.json B.json --out benchmarks/results/bench_<gpu>_<date>_grid`.
#                   BUDGET (530), TAG (grid), PROVIDERS, DTYPES, DIMS, SEQS override it.
#   infer           the inference forward (mode infer), E 64/128, 4k and 16k, against cuDNN, FA2 and Flex
#   window, block_sparse, window_kernels   docs/sparse_attention.md (window_kernels: w 256 with kernel time)
#   decode, generate                       docs/decode.md: L 1 and 4 against every backend; HF generate
#   variants        benchmarks.variants, docs/variants.md (BENCH_SECONDS, 200; HEAT_MS, 200)
#   ab              the same bench_attention grid from the package as at REV (git archive) and from this tree,
#                   one after the other in this call, then after/before per provider and cell
#                   (plot_results --ab: ab_<REV>.json; cuDNN and Flex give the run's drift). BUDGET (400),
#                   AB_ARGS (default: bf16/fp16, E 64/128, causal both, 4k and 16k, fwd and fwd_bwd, ours,
#                   ours-fast, cudnn, flex)
#   eager           HF Llama trained eagerly against "sdpa" (benchmarks.debug_overhead)
#   llama_b1, llama_b1_graphs   HF Llama E 64/128 trained at B 1, 4k, against plain torch.compile
#                   (graphs: both under mode="reduce-overhead", the host's launch time out of the step)
#   cold            Llama E 64's cold first step with compile-ahead on, off, on, from empty caches (~3 min)
# Stability (README, Stability; $OUT/stability_results.tgz holds the files of both):
#   stability       the adversarial suite in five parts, merged into one report (~13 min: PARTS="logits
#                   scale" then PARTS="masks long variants" in two calls; variants: soft cap, sinks and
#                   packed sequences; PART_SECONDS, 200)
#   train           the fp16 training run through an overflow (TRAIN_SECONDS, 240)
set -uo pipefail
cd "$(dirname "$0")/../.."
source tools/gpu/env.sh
STEPS=${*:-${STEPS:-}}
[ -n "$STEPS" ] || { sed -n '2,/^set /p' "$0" | sed '$d' >&2; exit 2; }
W=${WORKERS:-14}
STABILITY=$OUT/stability_results
bounded() { local seconds=$1; shift; timeout -s INT -k 20 "$seconds" "$@"; }
pytest_gpu() { bounded "$1" python3 -m pytest "${@:2}" -q -n "$W" --dist worksteal -p no:cacheprovider; }
# tree_at REV DIR [PATH...]: a fresh DIR holding REV's files (or only PATHs of them), from git archive.
tree_at() { rm -rf "$2" && mkdir -p "$2" && git archive "$1" "${@:3}" | tar -x -C "$2"; }

run_step() {
  case $1 in
    hopper_tests)
      pytest_gpu 220 tests/unit/test_hopper_bwd.py tests/unit/test_one_pass.py tests/unit/test_hopper_fwd.py \
        tests/unit/test_decode.py --junitxml "$OUT/gpu_tests_hopper.xml" 2>&1 | tail -15 ;;
    sparse_tests)
      pytest_gpu 200 tests/unit/test_window.py tests/unit/test_block_sparse.py tests/unit/test_decode.py \
        tests/models/test_hf_generation.py tests/passes/test_window_rewrite.py tests/tuning/test_table_edges.py \
        tests/tuning/test_autotune_decode.py --junitxml "$OUT/gpu_tests_sparse.xml" 2>&1 | tail -15 ;;
    variants_tests)
      pytest_gpu "${SUITE_SECONDS:-330}" tests/unit/test_variants.py tests/unit/test_kernels_softcap.py \
        tests/unit/test_kernels.py tests/unit/test_window.py \
        -k "test_variants or test_kernels_softcap or features or shapes or window_kernels" --durations=15 \
        --junitxml "$OUT/variants_tests.xml" 2>&1 | tail -30 ;;
    varlen_trial)
      FLASH_INDUCTOR_GLUON_VARLEN_TRIAL=1 pytest_gpu "${VARLEN_SECONDS:-200}" tests/unit/test_kernels_varlen.py -k gluon \
        -rf --junitxml "$OUT/varlen_trial.xml" > "$OUT/varlen_trial.log" 2>&1
      local status=$?
      tail -15 "$OUT/varlen_trial.log"
      local first
      first=$(grep -o '^FAILED [^ ]*' "$OUT/varlen_trial.log" | head -1 | cut -d' ' -f2)
      if [ -n "$first" ]; then
        # Where the kernel faults: the sanitizer names the kernel and the SASS offset.
        FLASH_INDUCTOR_GLUON_VARLEN_TRIAL=1 PYTORCH_NO_CUDA_MEMORY_CACHING=1 bounded 150 compute-sanitizer \
          --show-backtrace device --print-limit 4 python3 -m pytest "$first" -q -p no:cacheprovider \
          > "$OUT/varlen_sanitizer.log" 2>&1
        grep -m 8 -i "error\|illegal\|at 0x\|in _attn" "$OUT/varlen_sanitizer.log"
        # The sanitizer's offsets read against this Triton's SASS, not a CPU recompile's.
        find "${TRITON_CACHE_DIR:-$HOME/.triton/cache}" -name '_attn_*_hopper.cubin' -mmin -30 2>/dev/null |
          tar -czf "$OUT/varlen_cubins.tgz" -T - 2>/dev/null
      fi
      return $status ;;
    memcheck)
      local sanitizer=(compute-sanitizer --tool memcheck --error-exitcode 97 --print-limit 20)
      command -v compute-sanitizer >/dev/null || sanitizer[0]=/usr/local/cuda/bin/compute-sanitizer
      # One cudaMalloc a tensor, so an overrun leaves its allocation rather than landing in the
      # caching allocator's block.
      export PYTORCH_NO_CUDA_MEMORY_CACHING=1
      "${sanitizer[@]}" python3 tools/gpu/memcheck_canary.py > "$OUT/memcheck_canary.log" 2>&1
      local canary=$?
      if [ $canary -ne 97 ]; then
        echo "memcheck: the sanitizer did not report the canary's overrun (exit $canary): nothing would be checked"
        tail -5 "$OUT/memcheck_canary.log"; unset PYTORCH_NO_CUDA_MEMORY_CACHING; return 1
      fi
      echo "memcheck: the canary's overrun was reported ($(grep -c 'Invalid __global__' "$OUT/memcheck_canary.log") errors)"
      FLASH_INDUCTOR_MEMCHECK=1 bounded "${MEMCHECK_SECONDS:-420}" "${sanitizer[@]}" python3 -m pytest \
        tests/unit/test_kernel_bounds.py tests/unit/test_decode.py tests/unit/test_window.py -k touch_only \
        -q -p no:cacheprovider -p no:xdist --junitxml "$OUT/memcheck_tests.xml" > "$OUT/memcheck.log" 2>&1
      echo "memcheck: exit status $? (97: the sanitizer reported an access)"
      grep -m 20 "Invalid\|passed\|failed\|error" "$OUT/memcheck.log"
      unset PYTORCH_NO_CUDA_MEMORY_CACHING ;;
    rev_tests)
      [ -n "${REV:-}" ] && [ -n "${TESTS:-}" ] || { echo "rev_tests: set REV=<branch or commit> and TESTS" >&2; return 2; }
      local tree=/tmp/rev_tree
      tree_at "$REV" "$tree" || return 1
      # From that tree, so that `import flash_inductor` and the tests' helpers are REV's.
      (cd "$tree" && PYTHONPATH=$tree:/tmp/site pytest_gpu "${SUITE_SECONDS:-300}" $TESTS --junitxml "$OUT/rev_tests.xml" 2>&1 |
        tail -15) ;;
    switch_tests)
      [ -n "${SWITCH:-}" ] || { echo "switch_tests: set SWITCH=module.NAME=value" >&2; return 2; }
      FLASH_INDUCTOR_SWITCHES=$SWITCH pytest_gpu 220 -p tools.pytest_switch \
        ${TESTS:-tests/unit/test_hopper_fwd.py tests/unit/test_one_pass.py tests/unit/test_window.py} 2>&1 | tail -3 ;;
    grid)
      local budget=${BUDGET:-530} resume=()
      [ -n "${RESUME:-}" ] && { read -r -a resume <<< "$RESUME"; resume=(--resume "${resume[@]}"); }
      FLASH_INDUCTOR_CACHE_DIR=$(mktemp -d) bounded $((budget + 50)) python3 -m benchmarks.bench_attention \
        --dtypes "${DTYPES:-bf16,fp16}" --head-dims "${DIMS:-64,128,256}" \
        --seqs "${SEQS:-512,1024,2048,4096,8192,16384,32768}" --causal both --modes fwd,fwd_bwd \
        --providers "${PROVIDERS:-ours,ours-fast,flash,cudnn,flex}" --rep 40 --warmup 10 --heat-ms 500 \
        --precompile 14 --time-budget "$budget" --tag "${TAG:-grid}" --out "$OUT" ${resume[@]+"${resume[@]}"} \
        2>&1 | grep -v "it/s\]\|cell/s\]" | tail -60 ;;
    infer)
      bounded 170 python3 -m benchmarks.bench_attention --dtypes bf16,fp16 --head-dims 64,128 --causal both \
        --seqs 4096,16384 --modes infer --providers ours,cudnn,flash,flex --rep 30 --warmup 10 --heat-ms 300 \
        --precompile 14 --time-budget 150 --tag infer --out "$OUT" 2>&1 | tail -25 ;;
    window)
      bounded 120 python3 -m benchmarks.sparse_attention --part window --seqs 16384,4096,32768 \
        --windows 1024,256,4096 --time-budget 95 --out "$OUT" 2>&1 | tail -25 ;;
    window_kernels)
      bounded 240 python3 -m benchmarks.sparse_attention --part window --providers ours,flex \
        --seqs 4096,16384,32768 --windows 256 --kernel-time --time-budget 220 --out "$OUT" 2>&1 | tail -14 ;;
    block_sparse)
      bounded 75 python3 -m benchmarks.sparse_attention --part block_sparse --seqs 16384 \
        --sparsities 0.9,0.5 --time-budget 55 --out "$OUT" 2>&1 | tail -12 ;;
    decode)
      bounded 95 python3 -m benchmarks.decode --query-rows 1,4 --time-budget 75 --out "$OUT" 2>&1 | tail -30 ;;
    generate)
      bounded 150 python3 -m benchmarks.decode --part generate --out "$OUT" 2>&1 | tail -8 ;;
    variants)
      bounded "${BENCH_SECONDS:-200}" python3 -m benchmarks.variants --out "$OUT" \
        --time-budget "$(( ${BENCH_SECONDS:-200} - 30 ))" --heat-ms "${HEAT_MS:-200}" 2>&1 | tail -40 ;;
    ab)
      [ -n "${REV:-}" ] || { echo "ab: REV=<commit> names the tree to compare with" >&2; return 2; }
      local before=/tmp/ab_before half=$(( ${BUDGET:-400} / 2 ))
      # The old package beside this tree's benchmarks; each side runs from its own tree, since
      # `python -m` puts the working directory ahead of PYTHONPATH.
      tree_at "$REV" "$before" flash_inductor || return 1
      cp -r benchmarks "$before"/
      local args=(${AB_ARGS:---dtypes bf16,fp16 --head-dims 64,128 --causal both --seqs 4096,16384 --modes fwd,fwd_bwd
                  --providers ours,ours-fast,cudnn,flex --rep 30 --warmup 10 --heat-ms 300})
      for side in before after; do
        local tree=$PWD
        [ "$side" = before ] && tree=$before
        (cd "$tree" && PYTHONPATH=$tree:/tmp/site bounded "$half" python3 -m benchmarks.bench_attention "${args[@]}" \
          --no-plot --out "$OUT/ab_$side" --tag "ab-$side" --time-budget $((half - 30)) 2>&1 | tail -4)
      done
      python3 -m benchmarks.plot_results --ab "$OUT"/ab_before/bench_*.json "$OUT"/ab_after/bench_*.json \
        --out "$OUT/ab_$REV" ;;
    eager)
      bounded 150 python3 -m benchmarks.debug_overhead --no-debug --steps 10 --hf-heat 3 --hf-profile 24 \
        --out "$OUT" 2>&1 | grep -v '^ *"\(name\|calls\|ms\)"' | tail -12 ;;
    llama_b1|llama_b1_graphs)
      local seconds=200 graphs=()
      [ "$1" = llama_b1_graphs ] && { seconds=240; graphs=(--mode reduce-overhead --tag graphs); }
      bounded $seconds python3 -m benchmarks.e2e_models --models llama-e64,llama-e128 --seqs 4096 --tokens 4096 \
        --tasks train --attn sdpa --precompile 8 --time-budget $((seconds - 30)) ${graphs[@]+"${graphs[@]}"} \
        --out "$OUT" 2>&1 | tail -12 ;;
    cold)
      for contender in flash_inductor flash_inductor_no_compile_ahead flash_inductor; do
        bounded 100 python3 -m benchmarks.cold_start --models llama-e64 --tasks train --parts cold \
          --contenders "$contender" --child-timeout 90 --tag "cold-$contender-$(date +%s)" --out "$OUT" 2>&1 | tail -3
      done ;;
    stability)
      declare -A cases=([logits]="qk_,near_tied" [scale]="scale,large" [masks]="left,dead,finfo" [long]="long_"
                        [variants]="softcap_,sinks_,packed_")
      mkdir -p "$STABILITY"
      for part in ${PARTS:-logits scale masks long variants}; do
        echo "--- stability part $part"
        # The suite's own budget stops it starting new cases (and still writes what it measured); the
        # hard timeout, a minute later, only catches a case that hangs.
        timeout "$(( ${PART_SECONDS:-200} + 60 ))" python3 -m flash_inductor.stability --cases "${cases[$part]}" \
          --tag "$part" --out "$STABILITY" --no-progress --time-budget "${PART_SECONDS:-200}"
        echo "exit status $? (1 = requirement missed, 124 = time limit)"
      done
      if ls "$STABILITY"/stability_*.json >/dev/null 2>&1; then
        python3 -m flash_inductor.stability --merge "$STABILITY"/stability_*.json --tag all --out "$STABILITY"
      fi ;;
    train)
      mkdir -p "$STABILITY"
      timeout "${TRAIN_SECONDS:-240}" python3 benchmarks/train_stability.py --out "$STABILITY" --no-progress
      echo "exit status $?" ;;
    *) echo "unknown step $1 (bash $0 lists them)" >&2; return 2 ;;
  esac
}

{
  gpu_info
  for step in $STEPS; do
    echo "=== $step"
    run_step "$step"
  done
} 2>&1 | tee "$OUT/steps.log"
# The device brings back at most 8 files: the stability results travel as one archive.
if [ -d "$STABILITY" ]; then tar czf "$OUT/stability_results.tgz" -C "$STABILITY" . && rm -rf "$STABILITY"; fi
ls "$OUT"
