#!/usr/bin/env bash
# Forward+backward A/B of two tuning tables in one device call: the bench runs once on the table in
# the tree, then once more with OLD_TABLE shadowing it (a user table shadows the shipped one), both
# heated, with Flex in each run as the yardstick of the run-to-run drift. It decides which of a
# re-tune's picks to keep per cell; the tuner times each pass alone at its own
# shape, so this is the check of what a training step sees.
#
#   OLD_TABLE=tables_before/nvidia-h200_sm90_132sm.json bash tools/gpu_table_ab.sh
#   OLD_TABLE=heuristic MODES=fwd,fwd_bwd PROVIDERS=ours,ours-fast SEQS=4096 PRECOMPILE=12 BUDGET=60 \
#     TAG=table-vs-heuristic bash tools/gpu_table_ab.sh      # the shipped picks against the heuristic: ~3 min
#
# OLD_TABLE (required): a table file of this GPU, in a folder of the working tree that travels with
# the run (carry it if git ignores it), or `heuristic`: a table holding the built-in heuristic's
# configs for every bucket of the shipped table (stamped with this Triton, so it takes precedence).
# PROVIDERS (ours-fast,flex), SEQS (4096,16384), DTYPES (bf16,fp16), DIMS (64,128), MODES (fwd_bwd),
# PRECOMPILE (compile workers, 0), BUDGET (seconds per run, 200). Results in $OUT: the two bench
# files (tags TAG-new and TAG-old, TAG default table-ab) and the per-cell ratios new/old on stdout.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/flash_inductor_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
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
EMPTY_CACHE=$(mktemp -d)
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
rm -rf "$OLD_DIR" "$EMPTY_CACHE"
