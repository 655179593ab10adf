# Sourced by the device scripts from the repository root: $OUT made, unbuffered output, and the
# wheels the GPU machine lacks (.whl/, from tools/fetch_device_wheels.sh) installed beside this
# tree on PYTHONPATH, so `python3 -m benchmarks...` and pytest import this checkout.
OUT=${OUT:-/tmp/flash_inductor_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=$PWD:/tmp/site
else
  export PYTHONPATH=$PWD
fi
