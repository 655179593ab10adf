"""EXPERIMENT: how much host time does one eager attention call cost?

    python -m benchmarks.experiments.host_overhead --out DIR            # GPU
    TRITON_INTERPRET=1 python -m benchmarks.experiments.host_overhead --quick --device cpu

Why: on the H200, ``bench_attention.py --kernel-time`` found our 1k causal cells with the GPU
busy only 65-80 % of a back-to-back loop (FA2: 100 %), so there the GPU waits for Python. This
script measures the host side alone. It first queues a long ``torch.cuda._sleep`` so the GPU is
busy for the whole timed loop; every launch then returns at once and the wall time of the loop
is pure host time (Python, argument checks, allocations, launch calls). The launch queue is
finite (~1000 entries): once it is full a launch waits for the GPU, and the loop then measures
the sleep. A first version hit that (60 fp16 `stable` training steps, ~18 launches each,
read 3.75 ms a step: the 200 ms sleep over 60 calls), so the training-step loop is shorter, and
a sample whose sleep had ended before the loop did is reported as invalid rather than timed.
Then ``cProfile`` lists where ours spends it.

Providers: ours = ``flash_attention`` eager (what ``bench_attention.py`` times), ours_compiled =
an SDPA call compiled with ``flash_inductor.backend`` (the product's path: Inductor's wrapper
launches our kernels), flash = SDPA's flash backend. Ways, per provider:
* ``fwd``: inference (no tensor requires grad);
* ``fwd_grad``: forward on tensors that require grad (what a training step's forward pays);
* ``fwd_bwd``: forward and ``backward`` (one training step's attention).
Writes ``host_overhead.json`` and ``host_overhead_profile.txt`` to ``--out``.
It measures the ``flash_inductor`` of the tree it is run from: for an A/B, run it from the root
of each tree in turn.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import time

import torch
import torch.nn.functional as F

import flash_inductor
from flash_inductor import flash_attention

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _providers(device):
    def ours(q, k, v, causal):
        return flash_attention(q, k, v, is_causal=causal)

    def flash(q, k, v, causal):
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def sdpa(q, k, v, causal):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    # Static shapes, as a model compiled for one shape; `causal` is a Python bool, so each value
    # gets its own graph.
    ours_compiled = torch.compile(sdpa, backend=flash_inductor.backend, dynamic=False)
    if not device.startswith("cuda"):
        return {"ours": ours, "ours_compiled": ours_compiled}
    return {"ours": ours, "ours_compiled": ours_compiled, "flash": flash}


def _keep_gpu_busy(device, ms):
    """Queue ``ms`` of GPU sleep so the host never waits on the GPU while timed."""
    if device.startswith("cuda"):
        torch.cuda._sleep(int(ms * 2e6))  # ~2 GHz: cycles per ms


def _sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _step(fn, way, q, k, v, dout, causal):
    if way == "fwd":
        with torch.no_grad():
            fn(q, k, v, causal)
    elif way == "fwd_grad":
        fn(q, k, v, causal)
    else:
        fn(q, k, v, causal).backward(dout)


def host_us_per_call(fn, way, tensors, causal, calls, device):
    """Host microseconds per call, or None when the GPU caught up with the host during the loop
    (the launch queue filled, or the loop outlasted the sleep): then it timed the GPU."""
    q, k, v, dout = tensors
    _sync(device)
    _keep_gpu_busy(device, 200)
    slept = torch.cuda.Event() if device.startswith("cuda") else None
    if slept is not None:
        slept.record()
    start = time.perf_counter()
    for _ in range(calls):
        _step(fn, way, q, k, v, dout, causal)
    elapsed = time.perf_counter() - start
    caught_up = slept is not None and slept.query()
    _sync(device)
    return None if caught_up else elapsed / calls * 1e6


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--causal", choices=("yes", "no"), default="yes")
    p.add_argument("--calls", type=int, default=40,
                   help="calls per timed loop; a training step's loop runs a third as many (the launch queue is finite)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="B=1, H=2, L=64, E=32, fp32 off CUDA (a CPU smoke run)")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.heads, args.seq, args.head_dim, args.calls, args.rounds = 1, 2, 64, 32, 3, 2
    dtype = DTYPES[args.dtype] if args.device.startswith("cuda") else torch.float32
    causal = args.causal == "yes"
    gen = torch.Generator(device=args.device).manual_seed(3)

    def randn(requires_grad):
        shape = (args.batch, args.heads, args.seq, args.head_dim)
        return torch.randn(shape, device=args.device, dtype=dtype, generator=gen).requires_grad_(requires_grad)

    plain = [randn(False) for _ in range(3)] + [None]
    grads = [randn(True) for _ in range(3)] + [randn(False)]
    record = {"args": vars(args), "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu", "us_per_call": {}}
    for name, fn in _providers(args.device).items():
        for way in ("fwd", "fwd_grad", "fwd_bwd"):
            tensors = plain if way == "fwd" else grads
            for _ in range(2):  # compile and warm every path first
                _step(fn, way, *tensors[:3], tensors[3], causal)
            _sync(args.device)
            calls = max(1, args.calls // 3) if way == "fwd_bwd" else args.calls
            samples = [host_us_per_call(fn, way, tensors, causal, calls, args.device) for _ in range(args.rounds)]
            valid = [s for s in samples if s is not None]
            median = statistics.median(valid) if valid else None
            record["us_per_call"][f"{name}/{way}"] = {"median": median, "samples": samples, "calls": calls}
            shown = " ".join("invalid" if s is None else f"{s:.0f}" for s in samples)
            print(f"{name:13s} {way:9s} host {median if median is not None else float('nan'):8.1f} us/call  "
                  f"samples {shown}", flush=True)

    profile_text = io.StringIO()
    providers = _providers(args.device)
    for name, way in (("ours", "fwd"), ("ours", "fwd_bwd"), ("ours_compiled", "fwd_bwd")):
        tensors = plain if way == "fwd" else grads
        calls = max(1, args.calls // 3) if way == "fwd_bwd" else args.calls
        profiler = cProfile.Profile()
        _sync(args.device)
        _keep_gpu_busy(args.device, 200)
        profiler.enable()
        for _ in range(calls):
            _step(providers[name], way, *tensors[:3], tensors[3], causal)
        profiler.disable()
        _sync(args.device)
        for order in ("tottime", "cumulative"):
            profile_text.write(f"==== {name} {way}: {calls} calls, sorted by {order}\n")
            pstats.Stats(profiler, stream=profile_text).sort_stats(order).print_stats(40)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "host_overhead.json"), "w") as f:
        json.dump(record, f, indent=1)
    with open(os.path.join(args.out, "host_overhead_profile.txt"), "w") as f:
        f.write(profile_text.getvalue())
    print(f"wrote {args.out}/host_overhead.json and host_overhead_profile.txt")


if __name__ == "__main__":
    main()
