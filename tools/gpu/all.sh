#!/usr/bin/env bash
# Every check that needs a GPU, in order of value, as far as BUDGET seconds (default 540) go; resumes
# from gpu_queue_state.json in the working tree (the previous call's, from $OUT). tools/gpu_queue.py
# lists the items; extra arguments go to it (e.g. --only grid,e2e, --retry-failed, --list).
#   carry .whl (bash tools/gpu/fetch_wheels.sh), then:  bash tools/gpu/all.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tools/gpu/env.sh
gpu_info
python3 -m tools.gpu_queue --budget "${BUDGET:-540}" --out "$OUT" "$@"
