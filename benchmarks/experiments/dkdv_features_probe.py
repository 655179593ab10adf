"""EXPERIMENT: what makes our dK/dV pass slower than a minimal one?

    python -m benchmarks.experiments.dkdv_features_probe            # GPU, ~1 minute
    TRITON_INTERPRET=1 python -m benchmarks.experiments.dkdv_features_probe --quick --device cpu [--seq 64]

The single-pass probe (``bwd_single_pass_probe.py``) timed a minimal dK/dV kernel (no
mask, dropout, GQA or fp16 rescale) at 1954 us (64x64/w4/s2) against our pass's 2289 us (bf16,
E=128, L=4096), and 2234 against 2927 at E=64, L=8192: 15-30 %. This probe starts from that
minimal kernel and adds, one constexpr at a time, what ours does on every tile:
  * MASKED: q, dO and the row vectors loaded under a row-bound mask (``offs_m < L``) and a
    head-dim mask, as ours must when L is not a multiple of BLOCK_M;
  * SHIFT: the second per-row vector (``ROW_SHIFT``) loaded and subtracted before exp2;
  * STRIDES: addresses from runtime strides and int64 batch/head offsets, as ours takes any
    layout, instead of the contiguous (B*H, L, E) layout folded into constants.
Per problem it times each combination under a few configs (CUDA time of the kernel alone,
torch.profiler), beside our pass at the same configs, and checks dK/dV against ours.
It measures the ``flash_inductor`` of the tree it is run from: for an A/B, run it from the root
of each tree in turn.

RESULT (H200, torch 2.11, Triton 3.6, bf16, `fast`; us at 32x64/w4/s3, 64x64/w4/s2, 64x128/w8/s3;
benchmarks/results/dkdv_features_probe_nvidia-h200_20261201_e{128,64}.json):
                      E=128, L=4096, B=4, H=16     E=64, L=8192, B=2, H=16
  ours (main)         2347  2796  2515             3071  2967  3261
  minimal             2143  1962  2023             2246  2537  2607
  + MASKED            2012  2004  2118             2391  2629  2803
  + SHIFT             2337  2097  2087             2674  2763  2836
  + STRIDES           2199  1964  1984             2278  2550  2696
  all three           2254  2154  2226             2742  2815  3024
  ours, shift branch  2051  2032  2081             2759  2631  2722
The row shift (one more row vector and one more add per score) is the feature that costs: 3-19 %
alone. "ours, shift branch" is our pass with the shift made conditional (the plain loop drops
it unless a row of the call needs it): 11-27 % faster at the same configs (those records are in
git history at 79cc50f).
The first version of the change (commit 25a1537) also duplicated the dQ pass's loop behind a
runtime branch, and Triton gave each copy its own pipeline buffers: the E=256 dQ pass with a bool
mask needed 336 KiB of shared memory (227 available), found by the GPU tests after the re-tune.
The change landed with the dQ pass branching inside its one loop (208 KiB, ``tools/smem_check.py``),
at the first version's speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
import time

import torch
import triton
import triton.language as tl

from benchmarks.kernel_time import kernel_times_us
from flash_inductor import launch
from flash_inductor.tuning.configs import KernelConfig

LOG2E = 1.4426950408889634
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CONFIGS = ((32, 64, 4, 3), (64, 64, 4, 2), (64, 128, 8, 3))
FEATURES = ("MASKED", "SHIFT", "STRIDES")


@triton.jit
def _probe_dkdv(
    Q, K, V, DO, LSE2, SHIFT, DELTA, DK, DV,
    stride_b, stride_h, stride_m, H, L, qk_scale_log2, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, USE_SHIFT: tl.constexpr, STRIDES: tl.constexpr, FP32_DOT: tl.constexpr,
):
    """One key block of one (batch, head), non-causal, FA2's Δ given. Tensors (B, H, L, E)."""
    qk_scale_log2 = tl.cast(qk_scale_log2, tl.float32)
    sm_scale = tl.cast(sm_scale, tl.float32)
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1)
    if STRIDES:
        head = (bh // H).to(tl.int64) * stride_b + (bh % H).to(tl.int64) * stride_h
        row_stride = stride_m
    else:
        head = bh.to(tl.int64) * L * HEAD_DIM
        row_stride = HEAD_DIM
    rows = bh.to(tl.int64) * L
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_e = tl.arange(0, HEAD_DIM)
    k = tl.load(K + head + offs_n[:, None] * row_stride + offs_e[None, :])
    v = tl.load(V + head + offs_n[:, None] * row_stride + offs_e[None, :])
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    for start_m in range(0, L, BLOCK_M):
        offs_m = start_m + offs_m0
        q_ptrs = Q + head + offs_m[:, None] * row_stride + offs_e[None, :]
        do_ptrs = DO + head + offs_m[:, None] * row_stride + offs_e[None, :]
        if MASKED:
            ok = offs_m < L
            tile_ok = ok[:, None] & (offs_e[None, :] < HEAD_DIM)
            q = tl.load(q_ptrs, mask=tile_ok, other=0.0)
            do = tl.load(do_ptrs, mask=tile_ok, other=0.0)
            lse2 = tl.load(LSE2 + rows + offs_m, mask=ok, other=float("inf"))
            delta = tl.load(DELTA + rows + offs_m, mask=ok, other=0.0)
        else:
            q = tl.load(q_ptrs)
            do = tl.load(do_ptrs)
            lse2 = tl.load(LSE2 + rows + offs_m)
            delta = tl.load(DELTA + rows + offs_m)
        s2_t = tl.dot(k, tl.trans(q), input_precision=FP32_DOT) * qk_scale_log2
        if USE_SHIFT:
            if MASKED:
                shift = tl.load(SHIFT + rows + offs_m, mask=offs_m < L, other=0.0)
            else:
                shift = tl.load(SHIFT + rows + offs_m)
            p_t = tl.math.exp2((s2_t - lse2[None, :]) - shift[None, :])
        else:
            p_t = tl.math.exp2(s2_t - lse2[None, :])
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=FP32_DOT)
        dp_t = tl.dot(v, tl.trans(do), input_precision=FP32_DOT)
        ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
        dk = tl.dot(ds_t, q, dk, input_precision=FP32_DOT)
    tl.store(DK + head + offs_n[:, None] * row_stride + offs_e[None, :], (dk * sm_scale).to(DK.dtype.element_ty))
    tl.store(DV + head + offs_n[:, None] * row_stride + offs_e[None, :], dv.to(DV.dtype.element_ty))


def probe(q, k, v, do, out, lse, cfg, flags):
    b, h, n, e = q.shape
    block_m, block_n, warps, stages = cfg
    scale = e ** -0.5
    delta = (do.float() * out.float()).sum(-1).reshape(b * h, n).contiguous()
    lse2 = (lse.float() * LOG2E).reshape(b * h, n).contiguous()
    shift = torch.zeros_like(lse2)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    fp32_dot = "ieee" if q.dtype == torch.float32 else "tf32"
    compiled = _probe_dkdv[(n // block_n, b * h)](
        q, k, v, do, lse2, shift, delta, dk, dv, q.stride(0), q.stride(1), q.stride(2), h, n, scale * LOG2E, scale,
        HEAD_DIM=e, BLOCK_M=block_m, BLOCK_N=block_n, MASKED=flags["MASKED"], USE_SHIFT=flags["SHIFT"],
        STRIDES=flags["STRIDES"], FP32_DOT=fp32_dot, num_warps=warps, num_stages=stages,
    )
    return dk, dv, getattr(compiled, "n_spills", None)  # the launch returns the compiled kernel on GPUs


def rel(a, ref):
    return float((a.double() - ref.double()).norm() / ref.double().norm())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="B=1 H=2 L=128 E=32, one config (a CPU check)")
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--budget-s", type=float, default=150.0)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--head-dim", type=int, help="only the problem with this head dim")
    p.add_argument("--seq", type=int, default=128, help="with --quick: its sequence length (tests use 64)")
    args = p.parse_args(argv)
    on_gpu = args.device.startswith("cuda")
    problems = [("bf16", 128, 4096, 4, 16), ("bf16", 64, 8192, 2, 16)]
    configs = CONFIGS
    if args.quick:
        problems, configs = [("fp32" if not on_gpu else "fp16", 32, args.seq, 1, 2)], ((16, 32, 1, 1),)
    # The minimal kernel, each feature alone, and all of them (ours has all three).
    combos = [dict.fromkeys(FEATURES, False)] + [{f: f == g for f in FEATURES} for g in FEATURES] \
        + [dict.fromkeys(FEATURES, True)]
    problems = [pr for pr in problems if args.head_dim is None or pr[1] == args.head_dim]
    start, rows = time.time(), []
    for dt, e, n, b, h in problems:
        gen = torch.Generator(device=args.device).manual_seed(0)
        q, k, v, do = (torch.randn((b, h, n, e), generator=gen, device=args.device, dtype=DTYPES[dt]) for _ in range(4))
        scale = e ** -0.5
        out, lse = launch.attention_forward(q, k, v, None, None, 0.0, scale, "fast")
        ours = lambda: launch.attention_backward(do, q, k, v, None, out, lse, None, None, 0.0,  # noqa: E731
                                                 scale, "fast", False)
        ours_grads = ours()[1:3]
        ours_times = kernel_times_us(ours, args.calls, args.device)
        problem = f"{dt} E{e} L{n} B{b} H{h}"
        rows.append(dict(problem=problem, variant="ours-fast dkdv", config="table",
                         us=ours_times.get("_attn_bwd_dkdv")))
        print(f"{problem}: ours dkdv {ours_times.get('_attn_bwd_dkdv')} us", flush=True)
        table = launch.common.launch_configs(q, k, v, None, False, "fast", None)
        for cfg in configs:  # our pass at the probe's configs
            forced = dataclasses.replace(table, backward_dkdv=KernelConfig(*cfg))
            label = "{}x{}/w{}/s{}".format(*cfg)
            try:
                times = kernel_times_us(lambda: launch.attention_backward(  # noqa: B023
                    do, q, k, v, None, out, lse, None, None, 0.0, scale, "fast", False, configs=forced),
                    args.calls, args.device)
                rows.append(dict(problem=problem, variant="ours-fast dkdv", config=label, us=times.get("_attn_bwd_dkdv")))
            except Exception as exc:  # out of shared memory, say
                rows.append(dict(problem=problem, variant="ours-fast dkdv", config=label, error=str(exc)[:160]))
            print(f"  {'ours':22s} {label:14s} {rows[-1].get('us', rows[-1].get('error'))}", flush=True)
        for cfg, flags in itertools.product(configs, combos):
            if time.time() - start > args.budget_s:
                print("budget spent: the rest skipped")
                break
            label = "{}x{}/w{}/s{}".format(*cfg)
            name = "+".join(f for f in FEATURES if flags[f]) or "minimal"
            row = dict(problem=problem, variant=name, config=label)
            try:
                run = lambda: probe(q, k, v, do, out, lse, cfg, flags)  # noqa: E731
                dk, dv, spills = run()
                times = kernel_times_us(run, args.calls, args.device)
                row.update(us=times.get("_probe_dkdv"), n_spills=spills,
                           diff_vs_ours=dict(dk=rel(dk, ours_grads[0]), dv=rel(dv, ours_grads[1])))
            except Exception as exc:  # out of shared memory, say: recorded, not fatal
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
            rows.append(row)
            shown = f"{row['us']:9.1f} us" if row.get("us") else row.get("error")
            print(f"  {name:22s} {label:14s} {shown}  spills {row.get('n_spills')}  {row.get('diff_vs_ours', '')}",
                  flush=True)
    header = dict(torch=torch.__version__, triton=triton.__version__, device=args.device,
                  gpu=torch.cuda.get_device_name(0) if on_gpu else None,
                  date=time.strftime("%Y-%m-%dT%H:%M:%S"), interpreter=os.environ.get("TRITON_INTERPRET", "0"))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"dkdv_features_probe{'' if args.head_dim is None else f'_e{args.head_dim}'}.json")
    with open(path, "w") as f:
        json.dump(dict(header=header, rows=rows), f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
