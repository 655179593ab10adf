#!/usr/bin/env bash
# The launch-config table on the GPU, one task a device call (see flash_inductor/autotune/cli.py).
#
#   bash tools/gpu/tune.sh autotune --quick    # bf16, E=128, none/causal, L=4096: a few minutes
#   bash tools/gpu/tune.sh autotune            # the default grid; stops cleanly after $BUDGET (450) s
#   SCHED=stable PASSES=forward,backward DIMS=64,128 SEQS=1024 TAG=s1024 bash tools/gpu/tune.sh retune
#   OLD_TABLE=tables_before/nvidia-h200_sm90_132sm.json bash tools/gpu/tune.sh table_ab
#   OLD_TABLE=heuristic MODES=fwd,fwd_bwd PROVIDERS=ours,ours-fast SEQS=4096 PRECOMPILE=12 BUDGET=60 \
#     TAG=table-vs-heuristic bash tools/gpu/tune.sh table_ab     # the shipped picks against the heuristic: ~3 min
#
# autotune: tunes this GPU's table into $OUT (<gpu key>.json, the summary autotune_<gpu key>_<date>.json,
#   autotune.log); $OUT is the user cache, so a benchmark later in the same call uses the table. Extra
#   arguments go to the tuner (e.g. --masks none,causal,bool,float, --schedules stable).
# retune: re-tunes chosen buckets of the shipped table, heated: drops them from a copy of it and runs the
#   tuner with --resume, so only those run; the whole table lands in $OUT/tables. A bucket is dropped when
#   it matches all six comma lists: SCHED (stable), PASSES (forward,backward), DIMS (64,128), SEQS
#   (1024,4096,16384), DTYPES (bf16,fp16), MASKS (none,causal). BUDGET: the tuner's --time-budget (480).
#   INCUMBENTS (1): the dropped buckets' shipped entries race in their searches, so a pick moves only
#   for a gain measured in the same run (without, a re-tune moved most picks, no faster on average).
#   CHAIN=1: start from the table an earlier retune left in $OUT/tables (same call). Ship the result
#   with `python tools/ship_table.py $OUT/tables/<gpu>.json`. Timing (H200): 16 s1024 buckets (162
#   candidates) in 256 s; 24 backward buckets at mixed lengths in 381 s.
# table_ab: forward+backward A/B of the table in the tree against OLD_TABLE (a table file of this GPU in
#   the working tree, or `heuristic`: the built-in heuristic's configs for every bucket of the shipped
#   table), both heated, Flex in each run as the yardstick of the run-to-run drift; prints new/old per
#   cell. The tuner times each pass alone, so this is the check of what a training step sees.
#   PROVIDERS (ours-fast,flex), SEQS (4096,16384), DTYPES (bf16,fp16), DIMS (64,128), MODES (fwd_bwd),
#   PRECOMPILE (0), BUDGET (200 a run), TAG (table-ab).
# A run stopped by its budget (autotune, retune) resumes in a later call: put the returned table in
# tuning_resume/ of the working tree (untracked files travel) and run the same command again.
set -uo pipefail
cd "$(dirname "$0")/../.."
source tools/gpu/env.sh
TASK=${1:-}; shift || true
# An empty user cache: a user table there would shadow the shipped table these tasks start from.
EMPTY_CACHE=$(mktemp -d)
trap 'rm -rf "$EMPTY_CACHE"' EXIT

case $TASK in
autotune)
  export FLASH_INDUCTOR_CACHE_DIR="$OUT"
  if ls tuning_resume/*.json >/dev/null 2>&1; then cp tuning_resume/*.json "$OUT"/; fi
  gpu_info
  python3 -m flash_inductor.autotune --resume --time-budget "${BUDGET:-450}" "$@" 2>&1 | tee "$OUT/autotune.log" | tail -80
  ;;
retune)
  export FLASH_INDUCTOR_CACHE_DIR=$EMPTY_CACHE
  mkdir -p "$OUT/tables"
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
  gpu_info name,driver_version,power.limit
  RACE=(); [ "${INCUMBENTS:-1}" = 1 ] && RACE=(--incumbents "flash_inductor/tuning/tables/$GPU_KEY.json")
  timeout $((BUDGET + 90)) python3 -m flash_inductor.autotune --resume --time-budget "$BUDGET" --schedules "$SCHED" \
    ${RACE[@]+"${RACE[@]}"} --passes "$PASSES" --head-dims "$DIMS" --seqs "$SEQS" --dtypes "$DTYPES" --masks "$MASKS" \
    --heat-ms 500 --out "$TABLE" --summary "$OUT/autotune_summary_$TAG.json" > "$OUT/autotune_$TAG.log" 2>&1
  echo "tuner rc=$?"
  grep -v "cand/s\]" "$OUT/autotune_$TAG.log" | tail -45
  rm -f "$TABLE.lock"
  ;;
table_ab)
  OLD_DIR=$(mktemp -d)
  if [ "${OLD_TABLE:-}" = heuristic ]; then
    python3 - "$OLD_DIR" <<'PY' || exit 2
import pathlib, sys, torch
from flash_inductor.tuning import cache
from flash_inductor.tuning.buckets import Bucket
from flash_inductor.tuning.configs import cuda_heuristic_configs
from flash_inductor.tuning.search_space import ROLES
device = torch.device("cuda")
gpu, capability = cache.device_gpu_key(device), torch.cuda.get_device_capability(device)
shipped = cache.read_table(cache.shipped_tables_dir() / cache.table_filename(gpu))
entries = {}
for key in shipped.entries:
    b = Bucket.parse(key)
    configs = cuda_heuristic_configs(capability, 4 if b.dtype == "fp32" else 2, b.width, b.width, b.schedule, b.mask)
    entries[key] = {"configs": {role: getattr(configs, role).to_dict() for role in ROLES[b.pass_name]}}
table = cache.TuningTable.for_current_code(gpu, entries)
(pathlib.Path(sys.argv[1]) / cache.table_filename(gpu)).write_text(cache.table_text(table))
print(f"old = the heuristic's configs for the {len(entries)} buckets of the shipped table")
PY
  elif [ -f "${OLD_TABLE:-}" ]; then
    cp "$OLD_TABLE" "$OLD_DIR/"
  else
    echo "OLD_TABLE=${OLD_TABLE:-} is neither a table file nor 'heuristic'" >&2; exit 2
  fi
  # Which table the tree's run uses: the shipped one must load here, whatever the torch and Triton.
  FLASH_INDUCTOR_CACHE_DIR=$EMPTY_CACHE python3 - <<'PY' || exit 3
import warnings, torch, triton
from flash_inductor.tuning import cache
with warnings.catch_warnings():
    warnings.simplefilter("error")  # "ignoring the shipped tuning table ..." ends the check here
    view = cache.active_table(torch.device("cuda"), interpreted=False)
print(f"new = the shipped table: {len(view) if view else 0} entries used on {cache.device_gpu_key(torch.device('cuda'))} "
      f"(torch {torch.__version__}, Triton {triton.__version__}; tuned with Triton {sorted(view.other_triton) or 'this'})")
PY
  TAG=${TAG:-table-ab}; BUDGET=${BUDGET:-200}
  BENCH=(python3 -m benchmarks.bench_attention --seqs "${SEQS:-4096,16384}" --dtypes "${DTYPES:-bf16,fp16}"
         --head-dims "${DIMS:-64,128}" --causal both --modes "${MODES:-fwd_bwd}" --providers "${PROVIDERS:-ours-fast,flex}"
         --rep 40 --warmup 10 --heat-ms 500 --precompile "${PRECOMPILE:-0}" --time-budget "$BUDGET" --no-plot --out "$OUT")
  FLASH_INDUCTOR_CACHE_DIR=$EMPTY_CACHE timeout $((BUDGET + 60)) "${BENCH[@]}" --tag "$TAG-new" 2>&1 | grep -v "it/s\]" | tail -3
  FLASH_INDUCTOR_CACHE_DIR=$OLD_DIR timeout $((BUDGET + 60)) "${BENCH[@]}" --tag "$TAG-old" 2>&1 | grep -v "it/s\]" | tail -3
  python3 - "$OUT" "$TAG" <<'PY'
import csv, glob, statistics, sys
out, tag = sys.argv[1:]
def load(which):
    path = sorted(glob.glob(f"{out}/bench_*_{tag}-{which}.csv"))[-1]
    rows = csv.DictReader(line for line in open(path) if not line.startswith("#"))
    return {(r["provider"], r["mode"], r["dtype"], r["head_dim"], r["causal"], r["seq"]): float(r["tflops"])
            for r in rows if r["status"] == "ok"}
new, old = load("new"), load("old")
ratios = {}
for key in sorted(k for k in new if k in old):
    ratio = new[key] / old[key]
    print(f"{' '.join(key):48s} new {new[key]:6.1f}  old {old[key]:6.1f}  new/old {ratio:.3f}")
    if key[0] != "flex":
        ratios.setdefault(key[1], []).append(ratio)
for mode, values in sorted(ratios.items()):
    print(f"median new/old (ours) {mode}: {statistics.median(values):.3f} over {len(values)} cells, "
          f"worst {min(values):.3f}")
PY
  rm -rf "$OLD_DIR"
  ;;
*) sed -n '2,/^set /p' "$0" | sed '$d' >&2; exit 2 ;;
esac
