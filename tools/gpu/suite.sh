#!/usr/bin/env bash
# Everything one device run needs, in one command (see the device tool's README):
#   carry .whl (expecttest wheel: bash tools/gpu/fetch_wheels.sh), then:  bash tools/gpu/suite.sh
# Runs the pytest suite on every GPU of the machine, then the quick benchmark on the first one.
#
# One GPU (GPUS=1): writes the pytest log, junit XML and failure log ($OUT/pytest_gpu.log,
#   pytest_gpu.xml, failures.log), gpu.txt and the quick benchmark into $OUT.
# Several GPUs (GPUS=N > 1): splits the test files over the N GPUs, balanced by the expected cost
#   of each file (table below, greedy longest-first), and runs one pytest per GPU at once, each with
#   CUDA_VISIBLE_DEVICES=<its GPU> and its own Inductor cache (/tmp/inductor_cache_gpu<i>: runs
#   sharing one cache wait on its file lock). Prints one line per GPU (its files, pytest's result
#   line) and an overall line, and exits non-zero if any part failed or timed out. $OUT then holds
#   only gpu.txt, pytest_summary.txt (those lines and the FAILED/ERROR lines), pytest_gpus.tgz
#   (pytest_gpu<i>.log, pytest_gpu<i>.xml, failures_gpu<i>.log for each GPU) and the benchmark's
#   files: the device tool brings back at most 8 files.
#
# Environment (all optional):
#   OUT            where results go (default /tmp/flash_inductor_out)
#   GPUS           how many GPUs to split the tests over (default: the entries of
#                  CUDA_VISIBLE_DEVICES if it is set, else the GPUs `nvidia-smi -L` lists, else 1)
#   TESTS          test files / directories / node ids (default: tests with GPUS=1, every
#                  every test file under tests/ with GPUS > 1; a directory is split into its test_*.py files)
#   WORKERS        pytest-xdist workers per GPU (default 14 with GPUS=1, else max(2, (nproc-2)/GPUS))
#   SUITE_SECONDS  time limit of each GPU's pytest run (default 420)
#   MARKS          pytest -m expression (default: every test plus the GPU-relevant fuller suites,
#                  "not distributed_full or models_full or full_matrix"; CONTRIBUTING.md, Fuller suites)
#   SKIP_BENCH=1   skip the quick benchmark; BENCH_SECONDS bounds it (default 150)
#   SHARD=I/N      one GPU only: run the I-th of N round-robin shards of the tests
#                  (tools/pytest_shard.py), so that the suite fits device calls of 10 minutes:
#                  on one H200 it takes about 19 (2026-12-04: two shards of 540 s stopped at 96 %
#                  and 93 %), so SHARD=1/3, 2/3 and 3/3 in three calls. Outputs carry the shard in
#                  their names (pytest_gpu_shard1of3.log, ...).
# Example, four GPUs, tests only:  SKIP_BENCH=1 SUITE_SECONDS=500 bash tools/gpu/suite.sh
# Example, one GPU over three calls:  SHARD=1/3 SKIP_BENCH=1 SUITE_SECONDS=540 bash tools/gpu/suite.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tools/gpu/env.sh
MARKS=${MARKS:-not distributed_full or models_full or full_matrix}

# Which GPUs: CUDA_VISIBLE_DEVICES if the caller narrowed it (a part of a larger run), else all.
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
  IFS=, read -r -a DEVICES <<< "$CUDA_VISIBLE_DEVICES"
else
  n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
  [[ "$n" =~ ^[1-9][0-9]*$ ]] || n=1
  DEVICES=()
  for ((i = 0; i < n; i++)); do DEVICES+=("$i"); done
fi
if [ -z "${GPUS:-}" ]; then
  GPUS=${#DEVICES[@]}
elif ! [[ "$GPUS" =~ ^[1-9][0-9]*$ ]]; then
  echo "GPUS=$GPUS: expected a positive integer" >&2; exit 2
elif [ "$GPUS" -gt "${#DEVICES[@]}" ]; then
  if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    echo "GPUS=$GPUS but CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES names ${#DEVICES[@]}" >&2; exit 2
  fi
  DEVICES=()
  for ((i = 0; i < GPUS; i++)); do DEVICES+=("$i"); done
fi

if [ -n "${SHARD:-}" ] && [ "$GPUS" -gt 1 ]; then
  echo "SHARD=$SHARD splits a one-GPU run; with GPUS=$GPUS the files are already split over the GPUs" >&2; exit 2
fi

if [ "$GPUS" -le 1 ]; then
SHARD_ARGS=()
SUFFIX=""
if [ -n "${SHARD:-}" ]; then
  SHARD_ARGS=(-p tools.pytest_shard --shard "$SHARD")
  SUFFIX="_shard${SHARD/\//of}"
fi
gpu_info
# Bounded so the benchmark still runs inside one 10-minute device call. SIGINT, not SIGTERM, at the
# limit: pytest then stops as on Ctrl-C, prints its result line and --durations, and writes the junit
# XML of the tests that finished, so a cut run still says which tests ran (-k 30: killed if it hangs).
export FLASH_INDUCTOR_FAILURE_LOG="$OUT/failures$SUFFIX.log"
# Work stealing (pytest-xdist >= 3.2) keeps a few long compile tests from forming the run's tail.
DIST=$(python3 -c "import xdist; v = tuple(int(p) for p in xdist.__version__.split('.')[:2]); print('worksteal' if v >= (3, 2) else 'load')" 2>/dev/null || echo load)
# Compilation (Inductor, Triton) is CPU-bound: one worker per core.
timeout -s INT -k 30 "${SUITE_SECONDS:-420}" python3 -m pytest ${TESTS:-tests} -m "$MARKS" -q -p no:cacheprovider -p no:benchmark \
  ${SHARD_ARGS[@]+"${SHARD_ARGS[@]}"} -n "${WORKERS:-14}" --dist "$DIST" --timeout 300 --durations=25 \
  --junitxml="$OUT/pytest_gpu$SUFFIX.xml" 2>&1 | tee "$OUT/pytest_gpu$SUFFIX.log" | tail -40
STATUS=${PIPESTATUS[0]}  # pytest's (or timeout's 124), not tail's: a failed or cut run is not a success
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  timeout "${BENCH_SECONDS:-150}" python3 -m benchmarks.bench_attention --quick --out "$OUT" 2>&1 | tail -12
fi
exit "$STATUS"
fi

# ---- Several GPUs: one pytest per GPU, files balanced by expected cost. ----
DEVICES=("${DEVICES[@]:0:$GPUS}")
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())" | tee -a "$OUT/gpu.txt"
DIST=$(python3 -c "import xdist; v = tuple(int(p) for p in xdist.__version__.split('.')[:2]); print('worksteal' if v >= (3, 2) else 'load')" 2>/dev/null || echo load)
CORES=$(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 16)
WORKERS=${WORKERS:-$(( (CORES - 2) / GPUS > 2 ? (CORES - 2) / GPUS : 2 ))}
SUITE_SECONDS=${SUITE_SECONDS:-420}
PARTS="$OUT/pytest_gpus"   # inside $OUT so a run cut off from outside still brings its logs back
rm -rf "$PARTS"; mkdir -p "$PARTS"

# Greedy longest-first split. Costs: seconds of pytest on the H200 with ~18 workers (test_kernels
# and test_table_edges with 15 workers, cold: ~650 s and 87 s); test_monitor holds one ~290 s test, so it and test_kernels land on different GPUs when GPUS >= 2.
mapfile -t GROUPS_ < <(python3 - "$GPUS" ${TESTS:-tests} <<'EOF'
import glob, os, sys
# test_autotune.py's and test_tuning_tables.py's 40/20 s are estimates.
COST = {"test_kernels.py": 650, "test_monitor.py": 290, "test_flash_attention.py": 220,
        "test_ops.py": 80, "test_pass_handwritten.py": 60, "test_transformers_models.py": 60,
        "test_autotune.py": 40, "test_tuning_tables.py": 20, "test_stability.py": 60, "test_fp8.py": 40,
        "test_dropout.py": 40, "test_table_edges.py": 90}
gpus, items = int(sys.argv[1]), []
for arg in sys.argv[2:]:
    items += sorted(glob.glob(os.path.join(arg, "**", "test_*.py"), recursive=True)) if os.path.isdir(arg) else [arg]
items = list(dict.fromkeys(items))
cost = lambda item: COST.get(os.path.basename(item.split("::")[0]), 20)
loads, groups = [0] * gpus, [[] for _ in range(gpus)]
for item in sorted(items, key=lambda item: (-cost(item), item)):
    i = loads.index(min(loads))
    loads[i] += cost(item)
    groups[i].append(item)
for load, group in zip(loads, groups):
    print(load, *group)
EOF
)
if [ "${#GROUPS_[@]}" -ne "$GPUS" ]; then echo "splitting the tests failed" >&2; exit 2; fi

T0=$(date +%s)
echo "== $GPUS GPUs, $WORKERS workers each, ${SUITE_SECONDS}s limit each, --dist $DIST"
for ((i = 0; i < GPUS; i++)); do
  dev=${DEVICES[i]}
  read -r cost files <<< "${GROUPS_[i]}"
  echo "gpu$dev (cost ~${cost}s): ${files:-(no files)}"
  [ -n "$files" ] || continue
  (
    export CUDA_VISIBLE_DEVICES=$dev TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache_gpu$dev
    export FLASH_INDUCTOR_FAILURE_LOG="$PARTS/failures_gpu$dev.log"
    timeout -s INT -k 30 "$SUITE_SECONDS" python3 -m pytest $files -m "$MARKS" -q -p no:cacheprovider -p no:benchmark \
      -n "$WORKERS" --dist "$DIST" --timeout 300 --durations=25 --junitxml="$PARTS/pytest_gpu$dev.xml" \
      > "$PARTS/pytest_gpu$dev.log" 2>&1
    rc=$?
    echo "$rc $(( $(date +%s) - T0 ))" > "$PARTS/.rc_gpu$dev"
    echo "gpu$dev finished: rc $rc, t=$(( $(date +%s) - T0 ))s"
  ) &
done
wait

# One line per GPU, an overall line, then the FAILED / ERROR lines of pytest's short summary.
STATUS=0
RESULTS=""
: > "$OUT/pytest_summary.txt"
for ((i = 0; i < GPUS; i++)); do
  dev=${DEVICES[i]}
  read -r cost files <<< "${GROUPS_[i]}"
  names=$(for f in $files; do echo "${f#tests/}"; done | paste -sd' ' -)
  if [ -z "$files" ]; then
    echo "gpu$dev [no files]: idle" >> "$OUT/pytest_summary.txt"; continue
  fi
  read -r rc secs < "$PARTS/.rc_gpu$dev" 2>/dev/null || { rc=255; secs=?; }
  result=$(grep -E ' in [0-9.]+s( \([0-9:]+\))?( =+)?$' "$PARTS/pytest_gpu$dev.log" 2>/dev/null | tail -1 | sed -E 's/^=+ //; s/ =+$//')
  RESULTS+="$result"$'\n'
  logged=$(grep -c '^=== FAILED ' "$PARTS/failures_gpu$dev.log" 2>/dev/null)
  case $rc in
    0) state=ok ;;
    124|137) if [ -n "$result" ]; then state="TIMED OUT after ${SUITE_SECONDS}s: its result line counts the tests that finished"
             else state="TIMED OUT after ${SUITE_SECONDS}s (${logged:-0} failures logged by then)"; fi; STATUS=1 ;;
    *) state="FAILED (rc $rc)"; STATUS=1 ;;
  esac
  echo "gpu$dev [$names]: ${result:-no pytest result line} -- $state, ${secs}s" >> "$OUT/pytest_summary.txt"
done
overall=$(printf '%s' "$RESULTS" | grep -oE '[0-9]+ (passed|failed|errors?|skipped|xfailed|xpassed|deselected)' | awk '
  { sub(/^error$/, "errors", $2); n[$2] += $1 }
  END { split("passed failed errors skipped xfailed xpassed deselected", keys, " ")
        for (k = 1; k <= 7; k++) if (keys[k] in n) printf "%s%d %s", (s++ ? ", " : ""), n[keys[k]], keys[k] }')
echo "overall: ${overall:-no results} on $GPUS GPUs in $(( $(date +%s) - T0 ))s -- $([ "$STATUS" = 0 ] && echo OK || echo FAILED)" >> "$OUT/pytest_summary.txt"
grep -hE '^(FAILED|ERROR) ' "$PARTS"/pytest_gpu*.log 2>/dev/null | head -40 >> "$OUT/pytest_summary.txt"
echo "== summary"
cat "$OUT/pytest_summary.txt"
rm -f "$PARTS"/.rc_gpu*
tar czf "$OUT/pytest_gpus.tgz" -C "$OUT" pytest_gpus && rm -rf "$PARTS"

if [ "${SKIP_BENCH:-0}" != 1 ]; then
  CUDA_VISIBLE_DEVICES=${DEVICES[0]} timeout "${BENCH_SECONDS:-150}" python3 -m benchmarks.bench_attention --quick --out "$OUT" 2>&1 | tail -12
fi
exit "$STATUS"
