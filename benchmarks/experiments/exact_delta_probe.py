"""Probe of `stable`'s exact Δ in one pass on the Gluon Hopper kernels (EXACT_DELTA in
kernels/hopper_fwd.py and kernels/hopper_bwd.py; docs/hopper_backward.md), on an sm_90 GPU:

    PYTHONPATH=$PWD python3 -m benchmarks.experiments.exact_delta_probe --out $OUT
    python3 -m benchmarks.experiments.exact_delta_probe --parts suite --cases near_tied,qk_x100

Parts, one process:
  * suite: the stability suite's unmasked cases at its full sizes (B 2, H 4, L 2048, E 128; long
    cases at their lengths) with the one-pass ops as ``ours:one-pass`` beside `stable` (the Triton
    backward where ``launch.hopper_bwd.ONE_PASS_STABLE`` is off, else the same one-pass ops),
    `fast` and SDPA's backends; the suite's requirement checked for both.
  * features: causal (top-left and L ≠ S lower-right), GQA and a gradient on the LSE against
    float64: the one-pass ops (``exact1p``) beside the two-pass Triton backward on the same inputs.
  * speed: forward+backward, 16k tokens (B = 16384 / L), 2048 / E heads, bf16/fp16, E 64/128,
    causal or not, L 4k/16k; the one-pass ops, `stable` on the Triton backward, `fast` and cuDNN,
    each heated, do_bench medians, ratios to cuDNN.
  * memory: the peak allocation of one forward+backward above its inputs (bf16, E 128, 16 heads,
    causal, 16k and 32k; as ``bench_attention.py --memory``), with the outputs (out, dq, dk, dv)
    taken off as ``workspace_mib``: the one-pass ops, `stable` on the Triton backward, `fast`, cuDNN.
  * breakdown: three of those cells part by part: the `fast` and one-pass forwards, the keys' mean
    k̂ in torch (``key_mean_reference``) and in Triton (``key_mean``), and the `fast` and one-pass
    backwards alone (each from its own forward's outputs; the one-pass backward finds k̂ itself).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F

from benchmarks.common import attention_flops, bench_ms, heat, tflops
import flash_inductor  # noqa: F401 -- registers the ops

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def exact1p(q, k, v, is_causal=False, causal_offset=0, scale=None):
    """(out, lse) of the one-pass ops, the path `stable` takes on the H200."""
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    out, lse, *_ = torch.ops.flash_inductor.attention_forward_one_pass(q, k, v, is_causal, causal_offset, scale)
    return out, lse


def stable_triton(q, k, v, is_causal=False, causal_offset=0, scale=None):
    """(out, lse) of the plain op under `stable`: the Hopper forward and the two-pass Triton backward."""
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    return torch.ops.flash_inductor.attention_forward(q, k, v, None, None, 0.0, is_causal, causal_offset, scale,
                                                      "stable")


# ----------------------------------------------------------------------------- suite

def run_suite(args, record):
    from flash_inductor.stability import cases as suite_cases
    from flash_inductor.stability import runner
    from flash_inductor.stability.anchors import Implementation, NotApplicable, implementations

    def run(p, q, k, v):
        if p.attn_mask is not None:
            raise NotApplicable("masks are not on the one-pass path")
        out, _ = exact1p(q, k, v, is_causal=p.is_causal, scale=p.scale)
        return out

    ours = Implementation("ours:one-pass", run, is_ours=True, schedule="one-pass")
    impls = implementations(["ours:stable", "ours:fast", "sdpa:flash", "sdpa:cudnn", "sdpa:efficient", "sdpa:math"])
    wanted = set(args.cases.split(",")) if args.cases else None
    cases = [c for c in suite_cases.all_cases(suite_cases.FULL)
             if (wanted is None and c.name not in ("long_64k", "long_128k")) or (wanted and c.name in wanted)]
    results = runner.run_suite(cases, impls + [ours], "cuda", suite_cases.FULL)
    rows = []
    for r in results:
        if r.status == "ok":
            rows.append(dict(case=r.case, dtype=r.dtype, impl=r.impl, **{k: m.rel for k, m in r.metrics.items()}))
        else:
            rows.append(dict(case=r.case, dtype=r.dtype, impl=r.impl, status=r.status, reason=r.reason))
    record["suite"] = rows
    for schedule in ("one-pass", "stable"):
        req = runner.check_requirements(results, schedule)
        worst = sorted((c for c in req.checks if c.bound), key=lambda c: -c.ours_err / c.bound)[:6]
        record[f"requirement_{schedule}"] = dict(
            passed=req.passed, violations=req.violations,
            worst=[dict(case=c.case, dtype=c.dtype, result=c.result, err_over_bound=c.ours_err / c.bound,
                        rel=c.ours_rel, best=c.best_anchor) for c in worst])
        print(f"requirement {schedule}: {'PASS' if req.passed else 'FAIL'}; worst err/bound "
              + ", ".join(f"{c.case}/{c.dtype}/{c.result} {c.ours_err / c.bound:.2f}" for c in worst), flush=True)
        for v in req.violations[:10]:
            print("   ", v, flush=True)
    for r in rows:
        if r["impl"] in ("ours:one-pass", "ours:stable", "ours:fast") and "dq" in r:
            print(f"  {r['case']:16s} {r['dtype']} {r['impl']:14s} out {r['out']:.2e} dq {r['dq']:.2e} "
                  f"dk {r['dk']:.2e} dv {r['dv']:.2e}", flush=True)


# ----------------------------------------------------------------------------- features

def _fp64_grads(q, k, v, dout, dlse, is_causal, causal_offset, scale):
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    kk, vv = k64.repeat_interleave(group, 1), v64.repeat_interleave(group, 1)
    s = (q64 @ kk.transpose(-1, -2)) * scale
    if is_causal:
        i = torch.arange(q.shape[2], device=q.device)[:, None]
        j = torch.arange(k.shape[2], device=q.device)[None, :]
        s = s.masked_fill(j > i + causal_offset, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    out = p @ vv
    loss = (out * dout.double()).sum()
    if dlse is not None:
        loss = loss + (lse.nan_to_num(0.0, neginf=0.0) * dlse.double()).sum()
    loss.backward()
    return q64.grad, k64.grad, v64.grad


def run_features(args, record):
    cells = [  # (name, B, Hq, Hkv, L, S, causal, offset, dlse)
        ("causal_gqa", 2, 8, 2, 2048, 2048, True, 0, False),
        ("causal_gqa_dlse", 2, 8, 2, 2048, 2048, True, 0, True),
        ("full_dlse", 2, 8, 8, 1500, 2300, False, 0, True),
        ("lower_right_causal", 1, 4, 4, 1000, 3000, True, 2000, False),
        ("rows_see_nothing", 1, 4, 4, 3000, 1000, True, -2000, False),
    ]
    out_rows = []
    for dname in args.dtypes.split(","):
        dtype = DTYPES[dname]
        for e in (64, 128):
            for name, b, hq, hkv, L, S, causal, off, with_dlse in cells:
                g = torch.Generator(device="cuda").manual_seed(1)
                q = torch.randn(b, hq, L, e, device="cuda", generator=g).to(dtype)
                k = torch.randn(b, hkv, S, e, device="cuda", generator=g).to(dtype)
                v = torch.randn(b, hkv, S, e, device="cuda", generator=g).to(dtype)
                dout = torch.randn(b, hq, L, e, device="cuda", generator=g).to(dtype)
                dlse = torch.randn(b, hq, L, device="cuda", generator=g) if with_dlse else None
                scale = e ** -0.5
                ref = _fp64_grads(q, k, v, dout, dlse, causal, off, scale)
                errs = {}
                for impl in ("exact1p", "stable"):
                    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
                    if impl == "exact1p":
                        o, lse = exact1p(qq, kk, vv, causal, off, scale)
                    else:
                        o, lse = stable_triton(qq, kk, vv, causal, off, scale)
                    loss = (o.float() * dout.float()).sum()
                    if dlse is not None:
                        loss = loss + (lse.nan_to_num(0.0, neginf=0.0) * dlse).sum()
                    loss.backward()
                    errs[impl] = {n: float((x.grad.double() - r).norm() / r.norm().clamp_min(1e-300))
                                  for n, x, r in (("dq", qq, ref[0]), ("dk", kk, ref[1]), ("dv", vv, ref[2]))}
                    errs[impl]["finite"] = bool(all(torch.isfinite(x.grad).all() for x in (qq, kk, vv)))
                row = dict(dtype=dname, head_dim=e, case=name,
                           **{f"{i}_{n}": v for i, d in errs.items() for n, v in d.items()})
                out_rows.append(row)
                print(f"  {dname} E{e} {name:20s} " + " ".join(
                    f"{n} {errs['exact1p'][n]:.2e}/{errs['stable'][n]:.2e}" for n in ("dq", "dk", "dv"))
                    + f" finite {errs['exact1p']['finite']}", flush=True)
    record["features"] = out_rows


# ----------------------------------------------------------------------------- speed

def run_speed(args, record):
    rows = []
    start = time.monotonic()
    for dname in args.dtypes.split(","):
        for e in (64, 128):
            for causal in (False, True):
                for L in (4096, 16384):
                    if time.monotonic() - start > args.budget:
                        print("speed: budget spent", flush=True)
                        record["speed"] = rows
                        return
                    b, h = 16384 // L, 2048 // e
                    shape = (b, h, L, e)
                    q, k, v = (torch.randn(shape, device="cuda", dtype=DTYPES[dname], requires_grad=True)
                               for _ in range(3))
                    dout = torch.randn(shape, device="cuda", dtype=DTYPES[dname])
                    flops = attention_flops(b, h, L, L, e, causal, "fwd_bwd")
                    cell = dict(dtype=dname, head_dim=e, causal=causal, seq=L)
                    for name in ("cudnn", "one-pass", "stable", "fast"):
                        attn = _provider(name, causal)

                        def step():
                            attn(q, k, v).backward(dout)
                        step()
                        heat(step, 300, synchronize=torch.cuda.synchronize)
                        ms = bench_ms(step, warmup=10, rep=50, grad_to_none=[q, k, v])
                        cell[name] = ms
                        cell[f"{name}_tflops"] = tflops(flops, ms)
                    for name in ("one-pass", "stable", "fast"):
                        cell[f"{name}_vs_cudnn"] = cell["cudnn"] / cell[name]
                    rows.append(cell)
                    print(f"  {dname} E{e} causal={causal} L={L}: " + " ".join(
                        f"{n} {cell[n]:.3f} ms" for n in ("cudnn", "one-pass", "stable", "fast"))
                        + " | vs cuDNN " + " ".join(f"{n} {cell[n + '_vs_cudnn']:.3f}"
                                                    for n in ("one-pass", "stable", "fast")),
                        flush=True)
                    del q, k, v, dout
    record["speed"] = rows


def _provider(name, causal):
    """A forward of (q, k, v) that autograd can differentiate, by the names of the speed grid."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if name == "one-pass":
        return lambda q, k, v: exact1p(q, k, v, causal)[0]
    if name == "stable":  # the Triton backward, whatever ONE_PASS_STABLE says
        return lambda q, k, v: stable_triton(q, k, v, causal)[0]
    if name == "fast":
        return lambda q, k, v: flash_inductor.flash_attention(q, k, v, is_causal=causal, schedule=name)

    def cudnn(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return cudnn


def run_memory(args, record):
    from benchmarks.common import peak_bytes_above_live, release_memory

    rows = []
    for seq in (16384, 32768):
        q, k, v, dout = (torch.randn(1, 16, seq, 128, device="cuda", dtype=torch.bfloat16, requires_grad=i < 3)
                         for i in range(4))
        cell = dict(dtype="bf16", head_dim=128, heads=16, causal=True, seq=seq)
        for name in ("one-pass", "stable", "fast", "cudnn"):
            attn = _provider(name, True)

            def step():
                return torch.autograd.grad(attn(q, k, v), (q, k, v), dout)
            step()  # compile outside the measurement
            peak = peak_bytes_above_live(step)
            cell[f"{name}_workspace_mib"] = (peak - 4 * q.numel() * q.element_size()) / 2**20
            release_memory()
        rows.append(cell)
        print("  " + " ".join(f"{key} {val:.0f}" if isinstance(val, float) else f"{key} {val}"
                              for key, val in cell.items()), flush=True)
    record["memory"] = rows


def run_breakdown(args, record):
    from flash_inductor.ops import one_pass

    ops = torch.ops.flash_inductor
    rows = []
    for dname, e, causal, L in (("bf16", 128, True, 16384), ("bf16", 64, False, 4096), ("fp16", 128, False, 4096)):
        b, h = 16384 // L, 2048 // e
        q, k, v, dout = (torch.randn((b, h, L, e), device="cuda", dtype=DTYPES[dname]) for _ in range(4))
        scale = e ** -0.5
        fast_out, fast_lse = ops.attention_forward(q, k, v, None, None, 0.0, causal, 0, scale, "fast")
        out, lse, resid, row_consts = ops.attention_forward_one_pass(q, k, v, causal, 0, scale)
        parts = {
            "fwd_fast": lambda: ops.attention_forward(q, k, v, None, None, 0.0, causal, 0, scale, "fast"),
            "fwd_one_pass": lambda: ops.attention_forward_one_pass(q, k, v, causal, 0, scale),
            "key_mean_torch": lambda: one_pass.key_mean_reference(k),
            "key_mean_triton": lambda: one_pass.key_mean(k),
            "bwd_fast": lambda: ops.attention_backward(dout, q, k, v, None, fast_out, fast_lse, None, None, 0.0,
                                                       causal, 0, scale, "fast", False),
            "bwd_one_pass": lambda: ops.attention_backward_one_pass(dout, q, k, v, out, lse, None, resid, row_consts,
                                                                    causal, 0, scale),
        }
        cell = dict(dtype=dname, head_dim=e, causal=causal, seq=L)
        for name, fn in parts.items():
            fn()
            heat(fn, 200, synchronize=torch.cuda.synchronize)
            cell[name] = bench_ms(fn, warmup=10, rep=50)
        rows.append(cell)
        print("  " + " ".join(f"{key} {val:.3f}" if isinstance(val, float) else f"{key} {val}"
                              for key, val in cell.items()), flush=True)
    record["breakdown"] = rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--parts", default="features,breakdown,memory,suite,speed")
    p.add_argument("--cases", default=None)
    p.add_argument("--dtypes", default="bf16,fp16")
    p.add_argument("--budget", type=float, default=240.0, help="seconds for the speed grid")
    args = p.parse_args(argv)
    record = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"))
    parts = args.parts.split(",")
    for part, fn in (("features", run_features), ("breakdown", run_breakdown), ("memory", run_memory),
                     ("suite", run_suite), ("speed", run_speed)):
        if part in parts:
            t0 = time.monotonic()
            print(f"== {part}", flush=True)
            try:
                fn(args, record)
            except Exception as exc:  # noqa: BLE001 -- keep the other parts' results
                import traceback
                traceback.print_exc()
                record[f"{part}_error"] = repr(exc)
            print(f"== {part}: {time.monotonic() - t0:.0f} s", flush=True)
            if args.out:
                os.makedirs(args.out, exist_ok=True)
                with open(os.path.join(args.out, "exact_delta_probe.json"), "w") as f:
                    json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
