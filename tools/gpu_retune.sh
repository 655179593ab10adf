#!/usr/bin/env bash
# Re-tune a chosen set of the shipped table's buckets in one device call, heated: drop them from a
# copy of the shipped table, run the tuner with --resume (so only the dropped ones run), and leave
# the whole table and the run's summary in $OUT. Ship it with
# `python tools/ship_table.py $OUT/tables/<gpu>.json` (configs into the package, records to results).
#
#   SCHED=stable PASSES=forward,backward DIMS=64,128 SEQS=1024 TAG=s1024 bash tools/gpu_retune.sh
#   SCHED=fast PASSES=backward DIMS=256 BUDGET=500 TAG=fast-e256 bash tools/gpu_retune.sh
#
# Selection (comma lists; a bucket is dropped when it matches all six): SCHED (stable), PASSES
# (forward,backward), DIMS (64,128), SEQS (1024,4096,16384), DTYPES (bf16,fp16), MASKS
# (none,causal). BUDGET: the tuner's --time-budget in seconds (480); a run stopped by it resumes when the
# returned table goes into tuning_resume/ of the working tree. INCUMBENTS (1): the shipped entries of
# the dropped buckets race in their searches (--incumbents), so a pick moves only for a gain over it
# measured in the same run (a re-tune without it moved most picks, no faster on average);
# INCUMBENTS=0 tunes from scratch. CHAIN=1: start from the table an earlier run of this script
# left in $OUT/tables (same call), so that several selections re-tuned one after another end in one
# table (each run's summary keeps its own TAG; the device returns at most 8 files).
# Timing (H200): 16 s1024 buckets (162 candidates) in 256 s; 24 backward buckets at mixed lengths
# in 381 s.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/flash_inductor_out}
mkdir -p "$OUT/tables"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export TQDM_MININTERVAL=${TQDM_MININTERVAL:-10}
# An empty user cache: a user table there would shadow the shipped entries this run starts from.
EMPTY_CACHE=$(mktemp -d)
export FLASH_INDUCTOR_CACHE_DIR=$EMPTY_CACHE
SCHED=${SCHED:-stable}; PASSES=${PASSES:-forward,backward}; DIMS=${DIMS:-64,128}
SEQS=${SEQS:-1024,4096,16384}; DTYPES=${DTYPES:-bf16,fp16}; MASKS=${MASKS:-none,causal}
TAG=${TAG:-retune}; BUDGET=${BUDGET:-480}
GPU_KEY=$(python3 -c "import torch; from flash_inductor.tuning.cache import device_gpu_key; print(device_gpu_key(torch.device('cuda')))")
TABLE=$OUT/tables/$GPU_KEY.json
if ls tuning_resume/"$GPU_KEY".json >/dev/null 2>&1; then
  cp tuning_resume/"$GPU_KEY".json "$TABLE"   # a stopped run's table: its dropped buckets are gone already
else
  BASE=flash_inductor/tuning/tables/$GPU_KEY.json
  [ "${CHAIN:-0}" = 1 ] && [ -f "$TABLE" ] && BASE=$TABLE
  python3 - "$TABLE" "$BASE" "$SCHED" "$PASSES" "$DIMS" "$SEQS" "$DTYPES" "$MASKS" <<'PY' || exit 2
import json, sys
path, base, scheds, passes, dims, seqs, dtypes, masks = sys.argv[1:]
table = json.load(open(base))
def chosen(key):
    schedule, dtype, width, mask, seq, pass_name = key.split("/")
    return (schedule in scheds.split(",") and pass_name in passes.split(",") and width[1:] in dims.split(",")
            and seq[1:] in seqs.split(",") and dtype in dtypes.split(",") and mask in masks.split(","))
dropped = [key for key in table["entries"] if chosen(key)]
for key in dropped:
    del table["entries"][key]
json.dump(table, open(path, "w"), indent=1)
print(f"dropped {len(dropped)} buckets of {base}; {len(table['entries'])} kept")
PY
fi
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
RACE=(); [ "${INCUMBENTS:-1}" = 1 ] && RACE=(--incumbents "flash_inductor/tuning/tables/$GPU_KEY.json")
timeout $((BUDGET + 90)) python3 -m flash_inductor.autotune --resume --time-budget "$BUDGET" --schedules "$SCHED" ${RACE[@]+"${RACE[@]}"} \
  --passes "$PASSES" --head-dims "$DIMS" --seqs "$SEQS" --dtypes "$DTYPES" --masks "$MASKS" --heat-ms 500 \
  --out "$TABLE" --summary "$OUT/autotune_summary_$TAG.json" > "$OUT/autotune_$TAG.log" 2>&1
echo "tuner rc=$?"
grep -v "cand/s\]" "$OUT/autotune_$TAG.log" | tail -45
rm -rf "$EMPTY_CACHE" "$TABLE.lock"
