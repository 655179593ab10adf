"""Is one attention call's time reproducible? Repeated timings of a single cell, four ways.

    python -m benchmarks.probe_timing                         # GPU: the bimodal cell (fp16, causal, E=64, L=S=1024)
    python -m benchmarks.probe_timing --dtype bf16 --seq 4096
    python -m benchmarks.probe_timing --mode bwd --dtype bf16 --causal no  # the backward alone
    python -m benchmarks.probe_timing --quick --device cpu    # smoke run

On 2026-11-30 the same launch config on the same problem took 0.24 ms in one process and
0.50-0.57 ms in others (fp16 causal forward, B=16, H=32, L=S=1024, E=64), while FA2 read
0.317-0.319 ms every time. This script separates the explanations. For
each provider it takes ``--samples`` measurements of each kind, in one process:

* ``do_bench``: ``triton.testing.do_bench`` medians (L2 flushed before each call), the harness's
  own method;
* ``cudagraph``: the calls replayed from a CUDA graph (no host work between them), captured on
  the side stream the step was built on;
* ``fresh_inputs``: ``do_bench`` again, on newly allocated q, k, v for every sample (new
  addresses: tests placement and allocation);
* ``plain_loop``: CUDA events around 50 back-to-back calls, no flush.

Reading it: samples bimodal inside one process point at the GPU or at placement (compare
``fresh_inputs``); steady inside a process but different between runs of this script point at
process state (allocator, compiled-kernel choice); ``cudagraph`` far below ``do_bench`` means
host time is in the measurement. Writes ``probe_timing_<gpu>_<date>[_<tag>].json``.

``--mode bwd`` (or ``fwd_bwd``) times the backward the way ``bench_attention.py`` does (autograd
on a kept graph). The autotuner's seq-1024 backward timings once disagreed between runs by up to
2x while longer buckets agreed; the backward's launcher does
several launches and small torch ops per call, a quarter of the GPU work of seq 4096 at the
tuner's fixed token count, so host time is the first suspect: ``cudagraph`` against ``do_bench``
there says how much of the measured time it is.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

import torch

from flash_inductor.text_table import text_table
from benchmarks.common import (DTYPES, add_cell_args, add_output_args, environment, make_attention, make_inputs,
                               make_step, module_command, write_record, graph_ms)

# cudagraph last: a capture that fails can leave the stream unusable for what follows.
KINDS = ("do_bench", "fresh_inputs", "plain_loop", "cudagraph")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cell_args(p, dtype="fp16", batch=16, heads=32, seq=1024, head_dim=64)
    p.add_argument("--causal", choices=("yes", "no"), default="yes")
    p.add_argument("--mode", choices=("fwd", "bwd", "fwd_bwd"), default="fwd",
                   help="what one call does (bwd: the backward alone, on a kept graph)")
    p.add_argument("--providers", default="ours,flash", help="comma list of bench_attention providers")
    p.add_argument("--samples", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="B=1, H=2, L=S=128, E=32, 3 samples (a CPU smoke run)")
    add_output_args(p)
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.heads, args.seq, args.head_dim, args.samples = 1, 2, 128, 32, 3
        if args.device == "cpu":
            args.dtype, args.providers = "fp32", "ours"
    return args


def _cpu_ms(fn, repeats: int = 5) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def _captured_step_ms(attend, inputs, mode: str, calls: int = 20, replays: int = 10) -> float:
    """Milliseconds per call, replayed from one CUDA graph of ``calls`` calls (``graph_ms``). The step
    is built and captured on one side stream: autograd runs each backward op on its forward's stream, so a
    kept graph (``bwd``) whose forward ran elsewhere cannot be captured. An H200 run failed that
    way under ``triton.testing.do_bench_cudagraph``, which captures on a stream of its
    own, after this script had built the step on the default one."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call = make_step(attend, mode, *inputs)
        call()  # compiles and allocates outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(calls):
                call()
        graph.replay()
    return graph_ms(graph, calls, replays)


def _sample(kind: str, attend, inputs, args, dtype) -> float:
    """One measurement in milliseconds. Off CUDA every kind is a plain wall-clock loop."""
    if kind == "fresh_inputs":
        inputs = make_inputs(args.batch, args.heads, args.seq, args.head_dim, dtype, args.device)
    on_cuda = args.device.startswith("cuda")
    with torch.no_grad() if args.mode == "fwd" else contextlib.nullcontext():
        if on_cuda and kind == "cudagraph":
            return _captured_step_ms(attend, inputs, args.mode)
        call = make_step(attend, args.mode, *inputs)  # make_inputs returns q, k, v and a dout
        if not on_cuda:
            return _cpu_ms(call)
        from triton.testing import do_bench

        if kind in ("do_bench", "fresh_inputs"):
            return float(do_bench(call, warmup=25, rep=100, return_mode="median"))
        calls = 50
        call()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            call()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / calls


def spread(samples: list[float]) -> dict:
    return dict(min=min(samples), median=statistics.median(samples), max=max(samples),
                max_over_min=max(samples) / min(samples) if min(samples) > 0 else float("inf"))


def measure(args) -> list[dict]:
    dtype = DTYPES[args.dtype]
    causal = args.causal == "yes"
    records = []
    for provider in args.providers.split(","):
        attend = make_attention(provider, causal, args.seq, args.seq, args.device)
        inputs = make_inputs(args.batch, args.heads, args.seq, args.head_dim, dtype, args.device)
        for kind in KINDS:
            record = dict(provider=provider, kind=kind, mode=args.mode, dtype=args.dtype, batch=args.batch,
                          heads=args.heads, seq=args.seq, head_dim=args.head_dim, causal=causal)
            try:
                samples = [_sample(kind, attend, inputs, args, dtype) for _ in range(args.samples)]
            except Exception as exc:  # e.g. a backward CUDA graphs cannot capture: keep the other kinds
                records.append(dict(record, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"))
                continue
            records.append(dict(record, samples_ms=samples, **spread(samples)))
    return records


def format_table(records) -> str:
    rows = [(r["provider"], r["kind"], "", "", "", "", f"failed: {r['error']}") if "error" in r else
            (r["provider"], r["kind"], f"{r['min']:.3f}", f"{r['median']:.3f}", f"{r['max']:.3f}",
             f"{r['max_over_min']:.2f}", " ".join(f"{s:.3f}" for s in r["samples_ms"]))
            for r in records]
    header = ("provider", "kind", "min ms", "median", "max", "max/min", "samples")
    return "\n".join(text_table(rows, header=header, align="<<>>>><", gap=" "))


def main(argv=None) -> int:
    args = parse_args(argv)
    records = measure(args)
    print(format_table(records))
    if not args.no_write:
        env = environment(module_command("benchmarks.probe_timing", argv))
        write_record(args.out, "probe_timing", env, {"results": records}, args.tag, args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
