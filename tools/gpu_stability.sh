#!/usr/bin/env bash
# The stability evidence in one device call: the adversarial suite in four parts (each bounded),
# merged into one report, then the training demonstration.
#
#   bash tools/gpu_stability.sh            # everything (~10 min: may need two calls, see PARTS)
#   PARTS="logits masks" bash tools/gpu_stability.sh
#   TRAIN=0 bash tools/gpu_stability.sh    # the suite only
#
# The device returns at most 8 files, so every result lands in one archive,
# $OUT/stability_results.tgz, plus the log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/flash_inductor_out}
RESULTS=$(mktemp -d)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  declare -A CASES=([logits]="qk_,near_tied" [scale]="scale,large" [masks]="left,dead,finfo" [long]="long_")
  for part in ${PARTS:-logits scale masks long}; do
    echo "=== stability part $part"
    # The suite's own budget stops it starting new cases (and still writes what it measured); the
    # hard timeout, a minute later, only catches a case that hangs.
    timeout "$(( ${PART_SECONDS:-200} + 60 ))" python3 -m flash_inductor.stability --cases "${CASES[$part]}" \
      --tag "$part" --out "$RESULTS" --no-progress --time-budget "${PART_SECONDS:-200}"
    echo "exit status $? (1 = requirement missed, 124 = time limit)"
  done
  if ls "$RESULTS"/stability_*.json >/dev/null 2>&1; then
    python3 -m flash_inductor.stability --merge "$RESULTS"/stability_*.json --tag all --out "$RESULTS"
  fi
  if [ "${TRAIN:-1}" = 1 ]; then
    echo "=== training demonstration"
    timeout "${TRAIN_SECONDS:-240}" python3 benchmarks/train_stability.py --out "$RESULTS" --no-progress
    echo "exit status $?"
  fi
} 2>&1 | tee "$OUT/stability.log"
tar czf "$OUT/stability_results.tgz" -C "$RESULTS" .
