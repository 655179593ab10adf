#!/usr/bin/env bash
# Forward+backward A/B of two tuning tables in one device call: the bench runs once on the table in
# the tree, then once more with OLD_TABLE shadowing it (a user table shadows the shipped one), both
# heated, with Flex in each run as the yardstick of the run-to-run drift. Use it to keep a
# re-tune's picks per cell (docs/performance.md); the tuner times each pass alone at its own
# shape, so this is the check of what a training step sees.
#
#   OLD_TABLE=tables_before/nvidia-h200_sm90_132sm.json bash tools/gpu_table_ab.sh
#
# OLD_TABLE (required): a table file of this GPU, in a folder of the working tree that travels with
# the run (carry it if git ignores it). PROVIDERS (ours-fast,flex), SEQS (4096,16384), DTYPES
# (bf16,fp16), DIMS (64,128), BUDGET (seconds per run, 200). Results in $OUT: the two bench files
# (tags TAG-new and TAG-old, TAG default table-ab) and the per-cell ratios new/old on stdout.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/flash_inductor_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
[ -f "${OLD_TABLE:-}" ] || { echo "OLD_TABLE=${OLD_TABLE:-} is not a table file" >&2; exit 2; }
OLD_DIR=$(mktemp -d)
cp "$OLD_TABLE" "$OLD_DIR/"
EMPTY_CACHE=$(mktemp -d)
TAG=${TAG:-table-ab}; BUDGET=${BUDGET:-200}
BENCH=(python3 -m benchmarks.bench_attention --seqs "${SEQS:-4096,16384}" --dtypes "${DTYPES:-bf16,fp16}"
       --head-dims "${DIMS:-64,128}" --causal both --modes fwd_bwd --providers "${PROVIDERS:-ours-fast,flex}"
       --rep 40 --warmup 10 --heat-ms 500 --time-budget "$BUDGET" --out "$OUT")
FLASH_INDUCTOR_CACHE_DIR=$EMPTY_CACHE timeout $((BUDGET + 60)) "${BENCH[@]}" --tag "$TAG-new" 2>&1 | grep -v "it/s\]" | tail -3
FLASH_INDUCTOR_CACHE_DIR=$OLD_DIR timeout $((BUDGET + 60)) "${BENCH[@]}" --tag "$TAG-old" 2>&1 | grep -v "it/s\]" | tail -3
python3 - "$OUT" "$TAG" <<'PY'
import csv, glob, statistics, sys
out, tag = sys.argv[1:]
def load(which):
    path = sorted(glob.glob(f"{out}/bench_*_{tag}-{which}.csv"))[-1]
    rows = csv.DictReader(line for line in open(path) if not line.startswith("#"))
    return {(r["provider"], r["dtype"], r["head_dim"], r["causal"], r["seq"]): float(r["tflops"])
            for r in rows if r["status"] == "ok"}
new, old = load("new"), load("old")
ratios = []
for key in sorted(k for k in new if k in old):
    ratio = new[key] / old[key]
    print(f"{' '.join(key):40s} new {new[key]:6.1f}  old {old[key]:6.1f}  new/old {ratio:.3f}")
    if key[0] != "flex":
        ratios.append(ratio)
if ratios:
    print(f"median new/old (ours) {statistics.median(ratios):.3f} over {len(ratios)} cells")
PY
rm -rf "$OLD_DIR" "$EMPTY_CACHE"
