#!/usr/bin/env bash
# The full speed grid in one device call, resumable over several: bf16/fp16 × E 64/128/256 ×
# causal or not × seq 512…32k × forward and forward+backward, ours (stable), ours-fast, FA2, cuDNN
# and Flex, heated, with every kernel compiled first by 14 worker processes (--precompile). On a cold
# H200 it takes two calls (540 s + 354 s on 2026-12-02).
#
#   bash tools/gpu_grid.sh                                   # first call
#   RESUME=prev/bench_..._grid.json TAG=grid-2 bash tools/gpu_grid.sh   # next call: skips measured cells
#   python -m benchmarks.plot_results A.json B.json --out benchmarks/results/bench_<gpu>_<date>_grid
#
# RESUME: bench_*.json / .partial.jsonl files of earlier calls (in the working tree: carry them if
# git ignores them). BUDGET: seconds before no new cell starts (530, inside a 600 s call). TAG
# (grid). PROVIDERS, DTYPES, DIMS, SEQS override the grid. The shipped table is used: the user
# tuning cache is pointed at an empty folder. Results in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/flash_inductor_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=10 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export FLASH_INDUCTOR_CACHE_DIR=$(mktemp -d)
BUDGET=${BUDGET:-530}
RESUME_ARGS=()
if [ -n "${RESUME:-}" ]; then
  read -r -a RESUME_FILES <<< "$RESUME"
  RESUME_ARGS=(--resume "${RESUME_FILES[@]}")
fi
T0=$(date +%s)
timeout -s INT -k 20 $((BUDGET + 50)) python3 -m benchmarks.bench_attention --dtypes "${DTYPES:-bf16,fp16}" \
  --head-dims "${DIMS:-64,128,256}" --seqs "${SEQS:-512,1024,2048,4096,8192,16384,32768}" --causal both \
  --modes fwd,fwd_bwd --providers "${PROVIDERS:-ours,ours-fast,flash,cudnn,flex}" --rep 40 --warmup 10 \
  --heat-ms 500 --precompile 14 --time-budget "$BUDGET" --tag "${TAG:-grid}" --out "$OUT" \
  ${RESUME_ARGS[@]+"${RESUME_ARGS[@]}"} 2>&1 | grep -v "it/s\]\|cell/s\]" | tail -"${TAIL:-60}"
echo "== gpu_grid.sh done in $(( $(date +%s) - T0 )) s"
