# Sourced by the device scripts from the repository root: $OUT made, unbuffered output, and the
# wheels the GPU machine lacks (.whl/, from tools/gpu/fetch_wheels.sh) installed beside this tree
# on PYTHONPATH, so `python3 -m benchmarks...` and pytest import this checkout.
OUT=${OUT:-/tmp/flash_inductor_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # absolute: steps that run from another tree (ab, rev_tests) write here too
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=${TQDM_MININTERVAL:-10}  # a log, not a terminal: fewer bar updates
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=$PWD:/tmp/site
else
  export PYTHONPATH=$PWD
fi

# gpu_info [nvidia-smi fields]: the GPU, its driver, torch and Triton, printed and kept in $OUT/gpu.txt.
gpu_info() {
  nvidia-smi --query-gpu="${1:-name,driver_version}" --format=csv,noheader | tee "$OUT/gpu.txt"
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
}
