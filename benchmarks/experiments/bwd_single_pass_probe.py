"""EXPERIMENT: is a single-pass backward with fp32 atomics for dQ faster than our two passes?
(No: benchmarks/results/bwd_single_pass_probe_nvidia-h200_20261130.json; docs/performance.md.)

    python -m benchmarks.experiments.bwd_single_pass_probe                 # GPU
    TRITON_INTERPRET=1 python -m benchmarks.experiments.bwd_single_pass_probe --quick --device cpu

Our backward runs a dQ pass (3 GEMMs per tile pair under `fast`, 4 under `stable`) and a dK/dV
pass (4 GEMMs). A single pass folds dQ into the dK/dV pass: each (key block, query block) pair
adds dS·K, one more GEMM, into an fp32 dQ buffer with atomic adds, so `fast`'s 7 GEMMs become 5,
at the price of S/BLOCK_N atomic additions per dQ element (FlashAttention-2's choice).

The probe's kernel is a minimal dK/dV pass (no mask, dropout, GQA or fp16 dS rescale; `fast`'s
Δ = rowsum(dO∘O); L a multiple of the tiles) with the atomic dQ behind a constexpr. Per problem
it times, in one process (CUDA time per kernel, torch.profiler):
  * ours: our `fast` backward with the table's configs (dQ pass + dK/dV pass + small launches);
  * probe dkdv: the minimal kernel without dQ, which shows what the simplification alone buys;
  * probe single pass: the minimal kernel with atomic dQ, plus zeroing the fp32 buffer and the
    cast to the input dtype.
and checks the single pass's gradients against ours and a float64 reference. Writes
``bwd_single_pass_probe.json`` to ``--out`` (default ``$OUT`` or the current folder).
It measures the ``flash_inductor`` of the tree it is run from: for an A/B, run it from the root
of each tree in turn.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import triton
import triton.language as tl

from benchmarks.kernel_time import kernel_times_us
from flash_inductor import launch

LOG2E = 1.4426950408889634
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CONFIGS = ((32, 64, 4, 3), (64, 64, 4, 2), (32, 128, 8, 3), (64, 128, 8, 2), (64, 128, 8, 3))


@triton.jit
def _single_pass_dkdv(
    Q, K, V, DO, LSE2, DELTA, DK, DV, DQ_ACC,
    L, qk_scale_log2, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, ATOMIC_DQ: tl.constexpr, FP32_DOT: tl.constexpr,
):
    """One key block of one (batch, head): dK, dV in registers, and (ATOMIC_DQ) every query
    block's dS·K added to the fp32 DQ_ACC. Tensors are contiguous (B*H, L, E)."""
    qk_scale_log2 = tl.cast(qk_scale_log2, tl.float32)
    sm_scale = tl.cast(sm_scale, tl.float32)
    start_n = tl.program_id(0) * BLOCK_N
    head = tl.program_id(1).to(tl.int64) * L * HEAD_DIM
    rows = tl.program_id(1).to(tl.int64) * L
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_e = tl.arange(0, HEAD_DIM)
    k = tl.load(K + head + offs_n[:, None] * HEAD_DIM + offs_e[None, :])
    v = tl.load(V + head + offs_n[:, None] * HEAD_DIM + offs_e[None, :])
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    lo = 0
    if CAUSAL:
        lo = start_n // BLOCK_M * BLOCK_M  # query rows before the key block see none of it
    for start_m in range(lo, L, BLOCK_M):
        offs_m = start_m + offs_m0
        q = tl.load(Q + head + offs_m[:, None] * HEAD_DIM + offs_e[None, :])
        do = tl.load(DO + head + offs_m[:, None] * HEAD_DIM + offs_e[None, :])
        lse2 = tl.load(LSE2 + rows + offs_m)
        delta = tl.load(DELTA + rows + offs_m)
        s2_t = tl.dot(k, tl.trans(q), input_precision=FP32_DOT) * qk_scale_log2
        if CAUSAL:
            s2_t = tl.where(offs_n[:, None] <= offs_m[None, :], s2_t, float("-inf"))
        p_t = tl.math.exp2(s2_t - lse2[None, :])
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=FP32_DOT)
        dp_t = tl.dot(v, tl.trans(do), input_precision=FP32_DOT)
        ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
        dk = tl.dot(ds_t, q, dk, input_precision=FP32_DOT)
        if ATOMIC_DQ:
            dq_part = tl.dot(tl.trans(ds_t), k, input_precision=FP32_DOT) * sm_scale
            tl.atomic_add(DQ_ACC + head + offs_m[:, None] * HEAD_DIM + offs_e[None, :], dq_part, sem="relaxed")
    tl.store(DK + head + offs_n[:, None] * HEAD_DIM + offs_e[None, :], (dk * sm_scale).to(DK.dtype.element_ty))
    tl.store(DV + head + offs_n[:, None] * HEAD_DIM + offs_e[None, :], dv.to(DV.dtype.element_ty))


def single_pass(q, k, v, do, out, lse, causal, cfg, atomic_dq=True):
    """(dq, dk, dv) from the probe kernel; dq is None without atomic_dq."""
    b, h, n, e = q.shape
    block_m, block_n, warps, stages = cfg
    scale = e ** -0.5
    delta = (do.float() * out.float()).sum(-1).reshape(b * h, n)  # FA2's Δ, as `fast` forms it
    lse2 = (lse.float() * LOG2E).reshape(b * h, n)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    dq_acc = torch.zeros((b * h, n, e), dtype=torch.float32, device=q.device) if atomic_dq else dk
    fp32_dot = "ieee" if q.dtype == torch.float32 else "tf32"
    _single_pass_dkdv[(n // block_n, b * h)](
        q, k, v, do, lse2, delta, dk, dv, dq_acc, n, scale * LOG2E, scale,
        HEAD_DIM=e, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal, ATOMIC_DQ=atomic_dq, FP32_DOT=fp32_dot,
        num_warps=warps, num_stages=stages,
    )
    dq = dq_acc.reshape(q.shape).to(q.dtype) if atomic_dq else None
    return dq, dk, dv


def rel(a, ref):
    return float((a.double() - ref).norm() / ref.norm())


def reference(q, k, v, do, causal):
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=causal)
    return torch.autograd.grad(out, (qd, kd, vd), do.double())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="B=1 H=2 L=128 E=32, one config (a CPU check)")
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--budget-s", type=float, default=240.0)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    on_gpu = args.device.startswith("cuda")
    problems = [("bf16", 128, False, 4096, 4, 16), ("bf16", 128, True, 4096, 4, 16),
                ("fp16", 128, False, 4096, 4, 16), ("bf16", 64, False, 8192, 2, 16)]
    configs = CONFIGS
    if args.quick:
        problems = [("fp32" if not on_gpu else "fp16", 32, causal, 128, 1, 2) for causal in (False, True)]
        configs = ((16, 32, 1, 1),) if not on_gpu else ((32, 64, 4, 2),)
    start, rows = time.time(), []
    for dt, e, causal, n, b, h in problems:
        gen = torch.Generator(device=args.device).manual_seed(0)
        q, k, v, do = (torch.randn((b, h, n, e), generator=gen, device=args.device, dtype=DTYPES[dt]) for _ in range(4))
        scale = e ** -0.5
        visibility = launch.Visibility(is_causal=causal)
        out, lse = launch.attention_forward(q, k, v, None, None, 0.0, scale, "fast", visibility=visibility)
        ours = lambda: launch.attention_backward(do, q, k, v, None, out, lse, None, None, 0.0,  # noqa: E731
                                                 scale, "fast", False, visibility=visibility)
        ours_grads = ours()[:3]
        ours_times = kernel_times_us(ours, args.calls, args.device)
        small = n * n * b * h <= 2 ** 22
        ref = reference(q, k, v, do, causal) if small else None
        problem = f"{dt} E{e} {'causal' if causal else 'full'} L{n} B{b} H{h}"
        rows.append(dict(problem=problem, variant="ours-fast", config="table", us=sum(ours_times.values()),
                         kernels=ours_times))
        print(f"{problem}: ours fast backward {sum(ours_times.values()):9.1f} us  {ours_times}", flush=True)
        for cfg in configs:
            if time.time() - start > args.budget_s:
                print("budget spent: remaining configs skipped")
                break
            label = "{}x{}/w{}/s{}".format(*cfg)
            for atomic in (False, True):
                row = dict(problem=problem, variant="single-pass" if atomic else "probe-dkdv", config=label)
                try:
                    run = lambda: single_pass(q, k, v, do, out, lse, causal, cfg, atomic)  # noqa: E731
                    dq, dk, dv = run()
                    times = kernel_times_us(run, args.calls, args.device)
                    row.update(us=sum(times.values()), kernels=times)
                    row["diff_vs_ours"] = {name: rel(g, o.double()) for name, g, o in
                                           zip(("dq", "dk", "dv"), (dq, dk, dv), ours_grads) if g is not None}
                    if ref is not None:
                        row["err_vs_fp64"] = {name: rel(g, r) for name, g, r in zip(("dq", "dk", "dv"), (dq, dk, dv), ref)
                                              if g is not None}
                        row["ours_err_vs_fp64"] = {name: rel(o, r) for name, o, r in zip(("dq", "dk", "dv"), ours_grads, ref)}
                except Exception as exc:  # out of shared memory, say: recorded, not fatal
                    row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
                rows.append(row)
                shown = f"{row['us']:9.1f} us" if "us" in row else row["error"]
                print(f"  {row['variant']:12s} {label:14s} {shown}  {row.get('diff_vs_ours', '')}", flush=True)
    header = dict(torch=torch.__version__, triton=triton.__version__, device=args.device,
                  gpu=torch.cuda.get_device_name(0) if on_gpu else None,
                  date=time.strftime("%Y-%m-%dT%H:%M:%S"), interpreter=os.environ.get("TRITON_INTERPRET", "0"))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bwd_single_pass_probe.json")
    with open(path, "w") as f:
        json.dump(dict(header=header, rows=rows), f, indent=1, default=lambda x: None if isinstance(x, float) and
                  math.isnan(x) else str(x))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
