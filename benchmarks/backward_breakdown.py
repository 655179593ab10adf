"""Where the backward's time goes: each launch timed on its own, with its registers and spills.

    python -m benchmarks.backward_breakdown                      # GPU: bf16, E=128, L=S=4096, B=4, H=16
    python -m benchmarks.backward_breakdown --causal --sweep     # also sweep each pass's launch config
    python -m benchmarks.backward_breakdown --profile-once       # one backward, nothing else (under ncu)
    python -m benchmarks.backward_breakdown --step --head-dim 64 --seq 1024 --batch 16  # host- or GPU-bound?
    python -m benchmarks.backward_breakdown --quick --device cpu # smoke run (interpreter)

The harness (``bench_attention.py``) times a whole backward; this script splits it. It runs
``launch.attention_backward`` under ``torch.profiler`` and sums the CUDA time of every kernel it
launched (the Δ preprocess, the dS bound's reductions, the row reference, the dQ pass, the
dK/dV pass), per call, next to each pass's TFLOP/s counted from the GEMMs it does. Then it
reads, from Triton's compiled-kernel cache, each kernel's registers per thread, spilled
registers and shared memory: a config that spills is slow for that reason, not its tiling.
``--sweep`` replaces one pass's config at a time (the other keeps the table's) over a list of
tile shapes, so each pass's best config and its resources can be read side by side.
``--step`` instead times whole training steps through autograd (forward and backward, ours and
SDPA's flash backend): the wall time per step in a loop of back-to-back steps against the sum
of its kernels' CUDA time. Wall time well above the kernel time means the step is host-bound
(launch and Python overhead), which a GPU-side change cannot fix. Writes
``backward_breakdown_<gpu>_<date>[_<tag>].json``.

It times the ``flash_inductor`` of the tree it is run from; for an A/B of two versions, run it
from the root of each tree in turn.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys

import torch

from benchmarks.common import DTYPES, add_cell_args, add_output_args, environment, module_command, write_record
from benchmarks.kernel_time import kernel_times_us
from flash_inductor import launch
from flash_inductor.tuning.configs import KernelConfig
from flash_inductor.schedules import get_schedule

# Tile shapes tried per pass by --sweep: block_m x block_n / warps / stages.
SWEEP = {
    "backward_dkdv": ("32x64/w4/s3", "64x64/w4/s2", "32x128/w4/s2", "32x128/w8/s3", "64x128/w8/s2",
                      "64x128/w8/s3", "128x128/w8/s2", "128x64/w8/s2"),
    "backward_dq": ("64x64/w4/s2", "64x64/w4/s3", "128x64/w8/s2", "128x32/w4/s3", "64x128/w4/s3",
                    "128x64/w4/s2", "128x128/w8/s2", "64x32/w4/s3"),
}


def parse_config(label: str) -> KernelConfig:
    return KernelConfig.from_label(label)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cell_args(p, dtype="bf16", batch=4, heads=16, seq=4096, head_dim=128)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--schedules", default="stable,fast", help="comma list of precision schedules")
    p.add_argument("--calls", type=int, default=10, help="backward calls profiled per measurement")
    p.add_argument("--sweep", action="store_true", help="also sweep each pass's config (see SWEEP)")
    p.add_argument("--profile-once", action="store_true",
                   help="warm up, then run exactly one backward per schedule and exit (for ncu -k/-c)")
    p.add_argument("--step", action="store_true",
                   help="time whole forward+backward steps (ours and SDPA flash): wall time vs kernel time")
    p.add_argument("--force-rescale", action="store_true",
                   help="fp16 `stable`: a dS bound of inf, so both passes run the per-tile rescaling loop "
                        "(products added outside the MMA accumulator), to price that loop")
    p.add_argument("--dkdv-configs", default=None, help="comma list replacing SWEEP's dK/dV labels")
    p.add_argument("--dq-configs", default=None, help="comma list replacing SWEEP's dQ labels")
    p.add_argument("--quick", action="store_true", help="B=1, H=2, L=S=64, E=32, 2 calls (a CPU smoke run)")
    add_output_args(p)
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.heads, args.seq, args.head_dim, args.calls = 1, 2, 64, 32, 2
        if args.device == "cpu":
            args.dtype = "fp32"
    return args


# The launches this breakdown times; the configs' other roles (the decode kernels) do not run here.
TIMED_ROLES = ("forward", "backward_dkdv", "backward_dq")

class Problem:
    """Random inputs and the forward's outputs for one backward shape."""

    def __init__(self, args, schedule: str):
        gen = torch.Generator(device=args.device).manual_seed(0)
        shape = (args.batch, args.heads, args.seq, args.head_dim)
        dtype = DTYPES[args.dtype]
        self.q, self.k, self.v, self.dout = (torch.randn(shape, generator=gen, device=args.device, dtype=dtype)
                                             for _ in range(4))
        self.causal, self.schedule = args.causal, schedule
        self.scale = args.head_dim ** -0.5
        self.visibility = launch.Visibility(is_causal=self.causal)
        self.out, self.lse = launch.attention_forward(self.q, self.k, self.v, None, None, 0.0, self.scale, schedule,
                                                      visibility=self.visibility)

    def backward(self, configs=None):
        return launch.attention_backward(self.dout, self.q, self.k, self.v, None, self.out, self.lse, None, None,
                                         0.0, self.scale, self.schedule, False, visibility=self.visibility,
                                         configs=configs)

    def table_configs(self):
        return launch.common.launch_configs(self.q, self.k, self.v, None, self.causal, self.schedule, None)


def pass_gemms(schedule: str) -> dict:
    """GEMMs of size L·S·E per (batch, head) each pass does (2 FLOPs per multiply-add)."""
    exact = get_schedule(schedule).exact_delta
    return {"_attn_bwd_dq": 4 if exact else 3, "_attn_bwd_dkdv": 4, "_attn_bwd_row_reference": 0}


def compiled_resources() -> list[dict]:
    """Registers, spills and shared memory of every compiled variant of the backward kernels."""
    from flash_inductor.kernels import attn_bwd

    found = []
    for name in ("_attn_bwd_dq", "_attn_bwd_dkdv", "_attn_bwd_row_reference", "_attn_bwd_preprocess"):
        kernel = getattr(attn_bwd, name)
        for caches in getattr(kernel, "device_caches", {}).values():
            cache = caches[0] if isinstance(caches, tuple) else caches
            for compiled in getattr(cache, "values", lambda: [])():
                meta = getattr(compiled, "metadata", None)
                consts = getattr(getattr(compiled, "src", None), "constants", {}) or {}
                blocks = {str(k): v for k, v in consts.items() if "BLOCK" in str(k) or "EXACT" in str(k)}
                found.append(dict(kernel=name, n_regs=getattr(compiled, "n_regs", None),
                                  n_spills=getattr(compiled, "n_spills", None),
                                  shared=getattr(meta, "shared", None), num_warps=getattr(meta, "num_warps", None),
                                  num_stages=getattr(meta, "num_stages", None), constants=repr(blocks)[:200]))
    return found


def grad_rel_diff(grads, baseline) -> float:
    """Largest relative L2 difference of (dq, dk, dv) from the table config's: another tiling only
    reorders fp32 sums (~1e-3 at 16 bits); NaN, inf or a large value flags a config that miscompiles."""
    worst = 0.0
    for g, b in zip(grads, baseline):
        diff = float(torch.linalg.vector_norm(g.float() - b.float())
                     / torch.linalg.vector_norm(b.float()).clamp_min(1e-30))
        if diff != diff:  # NaN: max() would drop it
            return diff
        worst = max(worst, diff)
    return worst


def tflops(args, gemms: int, us: float) -> float | None:
    if not gemms or not us:
        return None
    flops = 2.0 * gemms * args.batch * args.heads * args.seq * args.seq * args.head_dim
    return flops * (0.5 if args.causal else 1.0) / (us * 1e-6) / 1e12


def breakdown(args, problem: Problem, configs=None) -> dict:
    times = kernel_times_us(lambda: problem.backward(configs), args.calls, args.device)
    gemms = pass_gemms(problem.schedule)
    rows = {name: dict(us=us, tflops=tflops(args, gemms.get(name, 0), us)) for name, us in times.items()}
    return dict(total_us=sum(times.values()), kernels=rows)


def step_times(args) -> list[dict]:
    """Per training step (forward + backward through autograd): wall ms in a back-to-back loop and
    the summed CUDA time of its kernels, for our op under each schedule and SDPA's flash backend."""
    import time

    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flash_inductor

    gen = torch.Generator(device=args.device).manual_seed(0)
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    dtype = DTYPES[args.dtype]
    q, k, v = (torch.randn(shape, generator=gen, device=args.device, dtype=dtype).requires_grad_() for _ in range(3))
    dout = torch.randn(shape, generator=gen, device=args.device, dtype=dtype)

    def ours(schedule):
        return lambda: torch.autograd.grad(
            flash_inductor.flash_attention(q, k, v, is_causal=args.causal, schedule=schedule), (q, k, v), dout)

    def flash():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=args.causal)
        return torch.autograd.grad(out, (q, k, v), dout)

    steps = [(f"ours:{s}", ours(s)) for s in args.schedules.split(",")]
    if args.device.startswith("cuda") and dtype != torch.float32:
        steps.append(("sdpa:flash", flash))
    records = []
    for name, step in steps:
        step()
        sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
        sync()
        start = time.perf_counter()
        for _ in range(args.calls):
            step()
        sync()
        wall_ms = (time.perf_counter() - start) / args.calls * 1e3
        kernels = kernel_times_us(step, args.calls, args.device)
        kernel_ms = sum(kernels.values()) / 1e3
        records.append(dict(name=name, wall_ms=wall_ms, kernel_ms=kernel_ms, launches=len(kernels),
                            kernels={n: us for n, us in list(kernels.items())[:12]}))
        print(f"  {name:16s} wall {wall_ms:8.3f} ms/step  kernels {kernel_ms:8.3f} ms  "
              f"({len(kernels)} kernel names)")
    return records


def main(argv=None) -> int:
    args = parse_args(argv)
    schedules = args.schedules.split(",")
    if args.force_rescale:
        # An infinite bound on |dS| sends fp16 `stable` to its rescaling loop (launch.attention_backward's ds_bound).
        launch.attention_backward = functools.partial(launch.attention_backward,
                                                      ds_bound=torch.full((1,), float("inf"), device=args.device))
    if args.dkdv_configs:
        SWEEP["backward_dkdv"] = tuple(args.dkdv_configs.split(","))
    if args.dq_configs:
        SWEEP["backward_dq"] = tuple(args.dq_configs.split(","))
    if args.step:
        print(f"steps: {args.dtype} B={args.batch} H={args.heads} L=S={args.seq} E={args.head_dim} "
              f"causal={args.causal}")
        records = step_times(args)
        _write(args, argv, dict(steps=records))
        return 0
    if args.profile_once:
        problems = [Problem(args, s) for s in schedules]
        for problem in problems:
            problem.backward()  # compile outside the profiled launch
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        for problem in problems:
            problem.backward()
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        return 0

    records = []
    for schedule in schedules:
        problem = Problem(args, schedule)
        tuned = problem.table_configs()
        record = dict(schedule=schedule, dtype=args.dtype, batch=args.batch, heads=args.heads, seq=args.seq,
                      head_dim=args.head_dim, causal=args.causal,
                      table_configs={role: getattr(tuned, role).label() for role in TIMED_ROLES},
                      table=breakdown(args, problem), sweep=[])
        print(f"\n{schedule}: table configs {record['table_configs']}  total {record['table']['total_us']:.0f} us")
        for name, row in record["table"]["kernels"].items():
            rate = f"{row['tflops']:.0f} TFLOP/s" if row["tflops"] else ""
            print(f"  {name[:60]:60s} {row['us']:9.1f} us  {rate}")
        if args.sweep:
            baseline = problem.backward()[:3]
            for role, labels in SWEEP.items():
                kernel = "_attn_bwd_dq" if role == "backward_dq" else "_attn_bwd_dkdv"
                for label in labels:
                    configs = dataclasses.replace(tuned, **{role: parse_config(label)})
                    try:
                        result = breakdown(args, problem, configs)
                        row = result["kernels"].get(kernel, {})
                        entry = dict(role=role, config=label, us=row.get("us"), tflops=row.get("tflops"),
                                     total_us=result["total_us"],
                                     rel_diff=grad_rel_diff(problem.backward(configs)[:3], baseline))
                    except Exception as exc:  # out of shared memory, say: recorded, not fatal
                        entry = dict(role=role, config=label, error=f"{type(exc).__name__}: {str(exc)[:160]}")
                    record["sweep"].append(entry)
                    shown = (f"{entry['us']:9.1f} us {entry['tflops'] or 0:6.0f} TFLOP/s  "
                             f"grads vs table config {entry['rel_diff']:.1e}") if entry.get("us") \
                        else entry.get("error", f"no time, grads vs table config {entry.get('rel_diff', 0):.1e}")
                    print(f"  sweep {role:14s} {label:14s} {shown}")
        records.append(record)
    resources = compiled_resources()
    print("\ncompiled backward kernels: name, regs/thread, spills, shared bytes, warps, stages, constants")
    for r in resources:
        print(f"  {r['kernel']:24s} {r['n_regs']!s:>5s} {r['n_spills']!s:>6s} {r['shared']!s:>7s} "
              f"w{r['num_warps']} s{r['num_stages']} {r['constants']}")
    _write(args, argv, dict(results=records, compiled=resources))
    return 0


def _write(args, argv, payload: dict) -> None:
    if not args.no_write:
        env = environment(module_command("benchmarks.backward_breakdown", argv))
        write_record(args.out, "backward_breakdown", env, payload, args.tag, args.device)


if __name__ == "__main__":
    sys.exit(main())
