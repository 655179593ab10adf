#!/usr/bin/env bash
# Tune this GPU's launch-config table in one device call (see flash_inductor/autotune/cli.py).
#
#   bash tools/gpu_autotune.sh --quick     # bf16, E=128, none/causal, L=4096: a few minutes
#   bash tools/gpu_autotune.sh             # the default grid; stops cleanly after $BUDGET seconds
#
# The table (<gpu key>.json), the summary (autotune_<gpu key>_<date>.json) and the log land in
# $OUT. A run stopped by the budget resumes in a later call: put the returned table in
# tuning_resume/ of the working tree (untracked files travel) and run the same command again.
# Extra arguments go to the tuner (e.g. --masks none,causal,bool,float, --schedules stable).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/flash_inductor_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export TQDM_MININTERVAL=${TQDM_MININTERVAL:-10}  # a log file, not a terminal: fewer bar updates
# The user cache is $OUT, so the tuner writes its table there and a benchmark run afterwards in
# the same call (with the same variable) uses it.
export FLASH_INDUCTOR_CACHE_DIR="$OUT"
if ls tuning_resume/*.json >/dev/null 2>&1; then
  cp tuning_resume/*.json "$OUT"/
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
python3 -m flash_inductor.autotune --resume --time-budget "${BUDGET:-450}" "$@" 2>&1 | tee "$OUT/autotune.log" | tail -80
