"""EXPERIMENT: why did the tuner's timing of a backward call read up to 2x slower than the same
call through the op?

    python -m benchmarks.experiments.tuner_vs_op_timing                      # GPU: bf16, E=64, causal, L=S=1024
    python -m benchmarks.experiments.tuner_vs_op_timing --head-dim 128 --dtype fp16
    TRITON_INTERPRET=1 python -m benchmarks.experiments.tuner_vs_op_timing --quick --device cpu

On the H200 on 2026-12-01 (results/s1024_timing_nvidia-h200_20261201_s22.txt), the autotuner's way
of timing the bf16 E=64 causal L=S=1024 backward (``autotune.measure.LaunchRunner.backward`` with the
configs forced, under ``triton.testing.do_bench``) read 2.28 ms in four of four samples, while the
same inputs and configs through ``flash_attention`` and autograd read 1.18 ms, and
``probe_timing.py`` (CUDA-graph replay included) read 1.16-1.18 ms every time. At E=128 the
tuner's way read 1.16 ms in two samples and 2.16 ms in two. So the tuner ranked s1024 causal
backward configs on noise.

The suspect, found on the CPU: called from outside our ops, each launch goes through
torch's wrap_triton HOP dispatch, which the ops skip (a ``triton_op`` run eagerly turns it off for
its body; torch's own docstring of that switch calls the HOP's eager cost "~1ms"). The tuner now
calls the launchers inside ``launch.direct_kernel_calls()``. This script tests that, alternating
three ways ``--rounds`` times in one process, on the tuner's own timing problem
(``measure.make_problem``, seed 7, drawn on the device) and the table's configs:

* ``launch_hop``: ``launch.attention_backward`` called bare against a saved forward, as
  ``Tuner.measure`` used to time it;
* ``launch``: ``LaunchRunner.backward``, as the tuner times it now;
* ``op``: the same tensors (cloned) through ``flash_attention``, ``torch.autograd.grad`` on a
  kept graph with the same dO.

Each sample is a ``do_bench`` median with the tuner's settings (``--warmup-ms``, ``--rep-ms``).
Then, for each way, ``torch.profiler`` gives the CUDA time per call of every kernel. Reading it:
if a kernel's own time doubles on the slow way, the slowness is on the GPU (placement, a
data-dependent branch such as the row shift); if the kernels' sum stays put while the sample
doubles, the GPU idles between launches (host time). All ways must also give the same gradients
(checked bit for bit on a GPU: same kernels and configs; on a CPU the op takes its reference
path, so there only the difference is recorded). Writes ``tuner_vs_op_timing.json`` to ``--out``.
It measures the ``flash_inductor`` of the tree it is run from: for an A/B, run it from the root
of each tree in turn.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from benchmarks.kernel_time import kernel_times_us
from flash_inductor import flash_attention, launch
from flash_inductor.autotune import measure
from flash_inductor.tuning.buckets import Bucket

WAYS = ("launch_hop", "launch", "op")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--mask", choices=("none", "causal"), default="causal")
    p.add_argument("--schedule", default="stable")
    p.add_argument("--tokens", type=int, default=16384, help="batch = tokens / seq, as the tuner's timing shape")
    p.add_argument("--hidden", type=int, default=2048, help="heads = hidden / head dim")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--warmup-ms", type=int, default=5)
    p.add_argument("--rep-ms", type=int, default=25)
    p.add_argument("--profile-calls", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="L=S=64, E=32, 2 rounds, fp16 off CUDA (a CPU smoke run)")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    if args.quick:
        args.seq, args.head_dim, args.tokens, args.hidden, args.rounds, args.profile_calls = 64, 32, 128, 64, 2, 2
        if not args.device.startswith("cuda"):
            args.dtype = "fp16"  # the interpreter's bf16 is unreliable
    return args


def build_calls(args):
    """The three ways (``WAYS``) of running one backward, on one problem with one set of configs."""
    bucket = Bucket(args.schedule, args.dtype, args.head_dim, args.mask, args.seq, "backward")
    shape = measure.Shape(max(1, args.tokens // args.seq), max(1, args.hidden // args.head_dim), args.seq, args.seq)
    problem = measure.make_problem(bucket, shape, args.device, seed=7, on_device=True, shared_mask=True)
    # The configs a launch on this problem looks up (the shipped table's, on a tuned GPU).
    configs = launch.common.launch_configs(problem.q, problem.k, problem.v, None, problem.is_causal, args.schedule, None)
    runner = measure.LaunchRunner()
    out, lse = runner.forward(problem, configs, args.schedule)

    def launch_hop_way():  # the tuner's old way: every launch through wrap_triton's HOP
        return launch.attention_backward(problem.dout, problem.q, problem.k, problem.v, problem.mask, out, lse,
                                         None, None, 0.0, problem.scale, args.schedule, False,
                                         visibility=problem.visibility(), configs=configs)[:3]

    def launch_way():  # the tuner now (launch.direct_kernel_calls)
        return runner.backward(problem, out, lse, configs, args.schedule)

    q, k, v = (t.detach().clone().requires_grad_() for t in (problem.q, problem.k, problem.v))
    kept = flash_attention(q, k, v, is_causal=problem.is_causal, scale=problem.scale, schedule=args.schedule)

    def op_way():
        return torch.autograd.grad(kept, (q, k, v), problem.dout, retain_graph=True)

    return bucket, shape, configs, {"launch_hop": launch_hop_way, "launch": launch_way, "op": op_way}


def time_ms(call, args) -> float:
    if not args.device.startswith("cuda"):
        start = time.perf_counter()
        call()
        return (time.perf_counter() - start) * 1e3
    from triton.testing import do_bench

    return float(do_bench(call, warmup=args.warmup_ms, rep=args.rep_ms, return_mode="median"))


def main(argv=None) -> int:
    args = parse_args(argv)
    bucket, shape, configs, ways = build_calls(args)
    grads = {name: call() for name, call in ways.items()}
    # On a GPU both ways run the same kernels with the same configs: bit-identical gradients. On a
    # CPU the op takes its reference path, so only closeness is recorded there.
    pairs = [(a, b) for way in ("launch_hop", "launch") for a, b in zip(grads[way], grads["op"])]
    same = all(torch.equal(a, b) for a, b in pairs)
    max_diff = max(float((a.float() - b.float()).abs().max()) for a, b in pairs)
    flops = measure.attention_flops(bucket, shape)
    samples = {name: [] for name in WAYS}
    for _ in range(args.rounds):
        for name in WAYS:
            samples[name].append(time_ms(ways[name], args))
    profiles = {name: kernel_times_us(ways[name], args.profile_calls, args.device) for name in WAYS}
    rows = []
    for name in WAYS:
        median, kernels_sum_us = statistics.median(samples[name]), sum(profiles[name].values())
        rows.append(dict(way=name, samples_ms=samples[name], median_ms=median, tflops=flops / median / 1e9,
                         kernels_us=profiles[name], kernels_sum_us=kernels_sum_us))
        print(f"{name:10s} median {median:.3f} ms ({flops / median / 1e9:.0f} TFLOP/s)  samples "
              + " ".join(f"{s:.3f}" for s in samples[name])
              + (f"  kernels {kernels_sum_us / 1e3:.3f} ms" if profiles[name] else ""))
    print(f"gradients identical: {same} (max |difference| {max_diff:.3g})")
    record = dict(bucket=bucket.key(), shape=list(shape.__dict__.values()), configs=str(configs),
                  gradients_identical=same, gradients_max_abs_diff=max_diff, device=args.device,
                  gpu=torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
                  torch=torch.__version__, rows=rows)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "tuner_vs_op_timing.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {path}")
    return 0 if same or not args.device.startswith("cuda") else 1


if __name__ == "__main__":
    sys.exit(main())
