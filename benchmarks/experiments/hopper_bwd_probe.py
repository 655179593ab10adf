"""Probe of the Gluon Hopper backward (kernels/hopper_bwd.py, launch/hopper_bwd.py) on an sm_90 GPU:
gradients against an fp64 reference, then backward TFLOP/s beside our Triton backward
(`launch.attention_backward`, `fast` and `stable`) and cuDNN (through SDPA), in one process.

    PYTHONPATH=$PWD python3 -m benchmarks.experiments.hopper_bwd_probe --out $OUT
    python3 -m benchmarks.experiments.hopper_bwd_probe --check-only --dtypes bf16
    python3 -m benchmarks.experiments.hopper_bwd_probe --skip-check --seqs 4096 --head-dims 128

Compiles first: a pool of processes runs every correctness case and one small launch per speed
cell once, so the Triton cache on disk holds every kernel variant before the timed process needs
it (``--precompile 0`` skips this).

Correctness, per gradient g in (dq, dk, dv): max|g - g_fp64| <= 2 * max|g_sdpa - g_fp64| + 2 eps(dtype)
max|g_fp64| (the project's rule), with g_sdpa SDPA's math backend in the input dtype (for rows that
see a key); rows that see no key (lower-right causal, L > S) must give dq exactly 0.
Speed cells: 16k tokens (B = 16384 / seq), 2048 / E heads, FLOPs 2.5·4·B·H·L·S·E (x0.5 causal);
each provider's backward alone (ours: preprocess + kernel + dq cast; cuDNN: autograd.grad with
retain_graph on a saved forward), do_bench medians after heating. A time budget stops the grid
before the call runs out; cells left out are listed.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
import multiprocessing as mp
import os
import sys
import time

import torch
import torch.nn.functional as F


from flash_inductor.launch.hopper import hopper_attention_forward
from flash_inductor.launch.visibility import Visibility
from flash_inductor.launch.hopper_bwd import (
    HopperBackwardConfig,
    hopper_attention_backward,
    hopper_backward_unsupported_reason,
)
from flash_inductor.tuning.hopper_configs import width_supported

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TOKENS = 16384
HIDDEN = 2048
CONFIGS = {"gluon": HopperBackwardConfig(dq_split=True, dq_tma=True),
           "gluon-atomic": HopperBackwardConfig(dq_split=True, dq_tma=False),
           "gluon-rowglobal": HopperBackwardConfig(row_stats_tma=False),
           "gluon-headmajor": HopperBackwardConfig(swizzle_heads=1),
           "gluon-kbmajor": HopperBackwardConfig(swizzle_heads=1 << 30),
           **{f"gluon-swz{n}": HopperBackwardConfig(swizzle_heads=n) for n in (2, 4, 8, 16)},
           "gluon-whole-group": HopperBackwardConfig(group_split=1),
           **{f"gluon-group{n}": HopperBackwardConfig(group_split=n) for n in (2, 4)},
           "gluon-nosplit": HopperBackwardConfig(dq_split=False, dq_tma=True),
           "gluon-s3": HopperBackwardConfig(dq_split=True, dq_tma=True, num_stages=3),
           "gluon-nosplit-s3": HopperBackwardConfig(dq_split=False, dq_tma=True, num_stages=3),
           # Two tiles an iteration (E 64 only).
           "gluon-paired": HopperBackwardConfig(paired_tiles=True),
           "gluon-nosplit-paired": HopperBackwardConfig(dq_split=False, paired_tiles=True)}


# ----------------------------------------------------------------------------- correctness

def _visible(seq_q, seq_k, is_causal, causal_offset, device):
    if not is_causal:
        return torch.ones(seq_q, seq_k, dtype=torch.bool, device=device)
    i = torch.arange(seq_q, device=device)[:, None]
    j = torch.arange(seq_k, device=device)[None, :]
    return j <= i + causal_offset


def reference_grads(q, k, v, do, scale, visible):
    """fp64 autograd through a softmax that gives rows with no key P = 0 (no NaN anywhere)."""
    group = q.shape[1] // k.shape[1]
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    s = (q @ k.repeat_interleave(group, 1).transpose(-1, -2)) * scale
    s = s.masked_fill(~visible, float("-inf"))
    m = s.amax(-1, keepdim=True).detach()
    e = torch.exp(s - torch.where(torch.isinf(m), 0.0, m))
    l = e.sum(-1, keepdim=True)
    out = (e / torch.where(l == 0, 1.0, l)) @ v.repeat_interleave(group, 1)
    return torch.autograd.grad(out, (q, k, v), do.double())


def sdpa_grads(q, k, v, do, scale, visible, live_from):
    """SDPA (math) in the input dtype on the rows that see a key: the error budget."""
    group = q.shape[1] // k.shape[1]
    q = q[:, :, live_from:].detach().requires_grad_()
    k, v = (t.detach().requires_grad_() for t in (k, v))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                             attn_mask=visible[live_from:], scale=scale)
    return torch.autograd.grad(out, (q, k, v), do[:, :, live_from:])


def check_case(dtype, head_dim, is_causal, batch, heads_q, heads_kv, seq_q, seq_k, causal_offset=0,
               transposed=False, config="gluon", seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rand(h, n):
        if transposed:  # (B, L, H, E) storage seen as (B, H, L, E): strided, no copy
            return torch.randn(batch, n, h, head_dim, device="cuda", dtype=dtype, generator=gen).transpose(1, 2)
        return torch.randn(batch, h, n, head_dim, device="cuda", dtype=dtype, generator=gen)

    q, k, v = rand(heads_q, seq_q), rand(heads_kv, seq_k), rand(heads_kv, seq_k)
    do = rand(heads_q, seq_q)
    scale = head_dim ** -0.5
    reason = hopper_backward_unsupported_reason(q, k, v, None, 0.0, scale, "fast")
    if reason is None and not width_supported(CONFIGS[config], head_dim):
        reason = f"{config} pairs tiles, which needs head dim 64"
    if reason is not None:
        return dict(ok=False, error=f"unsupported: {reason}")
    visibility = Visibility(is_causal=is_causal, causal_offset=causal_offset)
    out, lse = hopper_attention_forward(q, k, v, scale=scale, visibility=visibility)
    grads = hopper_attention_backward(do, q, k, v, out, lse, scale=scale, visibility=visibility, config=CONFIGS[config])
    torch.cuda.synchronize()
    visible = _visible(seq_q, seq_k, is_causal, causal_offset, q.device)
    live_rows = visible.any(-1)
    live_from = int(live_rows.long().argmax()) if live_rows.any() else seq_q
    refs = reference_grads(q, k, v, do, scale, visible)
    res = dict(empty_rows=seq_q - int(live_rows.sum()))
    ok = True
    if live_from < seq_q:
        bases = sdpa_grads(q, k, v, do, scale, visible, live_from)
    for name, g, ref, i in zip(("dq", "dk", "dv"), grads, refs, range(3)):
        finite = bool(torch.isfinite(g).all())
        if i == 0:
            empty_ok = bool((g[:, :, :live_from] == 0).all())
            g, ref = g[:, :, live_from:], ref[:, :, live_from:]
            res["dq_empty_rows_zero"] = empty_ok
            ok &= empty_ok
        err = (g.double() - ref).abs().max().item() if g.numel() else 0.0
        base = (bases[i].double() - ref).abs().max().item() if live_from < seq_q and g.numel() else 0.0
        floor = 2 * torch.finfo(dtype).eps * (ref.abs().max().item() if ref.numel() else 0.0)
        res[f"{name}_err"], res[f"{name}_base"], res[f"{name}_floor"] = err, base, floor
        ok &= finite and err <= 2 * base + floor
    res["ok"] = ok
    return res


def correctness_cases(dtypes, head_dims):
    cases = []
    for dname in dtypes:
        for e in head_dims:
            for causal in (False, True):
                cases.append(dict(dtype=dname, head_dim=e, is_causal=causal, batch=2, heads_q=3, heads_kv=3,
                                  seq_q=300, seq_k=300))
                cases.append(dict(dtype=dname, head_dim=e, is_causal=causal, batch=1, heads_q=4, heads_kv=2,
                                  seq_q=1000, seq_k=777, transposed=True))
            # Lower-right causal with L > S: the first L - S rows see no key.
            cases.append(dict(dtype=dname, head_dim=e, is_causal=True, batch=1, heads_q=2, heads_kv=1,
                              seq_q=400, seq_k=150, causal_offset=150 - 400))
            cases.append(dict(dtype=dname, head_dim=e, is_causal=True, batch=1, heads_q=2, heads_kv=2,
                              seq_q=1, seq_k=1))
            cases.append(dict(dtype=dname, head_dim=e, is_causal=False, batch=1, heads_q=1, heads_kv=1,
                              seq_q=513, seq_k=2049))
    return cases


def run_case(case, config):
    kw = dict(case)
    kw["dtype"] = DTYPES[kw["dtype"]]
    try:
        return check_case(**kw, config=config)
    except Exception as exc:  # a compile or launch failure is a result here
        return dict(ok=False, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}")


# ----------------------------------------------------------------------------- speed

def cell_inputs(dname, e, seq, batch=None, heads=None, group=1):
    """Q and dO (batch, heads, seq, e); K and V with heads // group heads (GQA)."""
    batch = batch or max(1, TOKENS // seq)
    heads = heads or HIDDEN // e
    gen = torch.Generator(device="cuda").manual_seed(seq + e)
    q, do = (torch.randn(batch, heads, seq, e, device="cuda", dtype=DTYPES[dname], generator=gen) for _ in range(2))
    k, v = (torch.randn(batch, heads // group, seq, e, device="cuda", dtype=DTYPES[dname], generator=gen)
            for _ in range(2))
    return q, k, v, do


def backward_steps(q, k, v, do, causal, providers):
    """name -> a closure running that provider's backward alone."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flash_inductor.launch import attention_backward

    scale = q.shape[-1] ** -0.5
    out, lse = hopper_attention_forward(q, k, v, scale=scale, visibility=Visibility(is_causal=causal))
    steps = {}
    for name in providers:
        if name in CONFIGS and not width_supported(CONFIGS[name], q.shape[-1]):
            print(f"{name}: skipped at head dim {q.shape[-1]} (paired tiles need 64)", flush=True)
        elif name in CONFIGS:
            steps[name] = (lambda c: lambda: hopper_attention_backward(do, q, k, v, out, lse, scale=scale,
                                                                       visibility=Visibility(is_causal=causal),
                                                                       config=c))(CONFIGS[name])
        elif name.startswith("triton-"):
            steps[name] = (lambda sched: lambda: attention_backward(do, q, k, v, None, out, lse, None, None, 0.0,
                                                                    scale, sched, False,
                                                                    visibility=Visibility(is_causal=causal)))(name[7:])
        elif name == "cudnn":
            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                try:
                    o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal,
                                                       enable_gqa=k.shape[1] != q.shape[1])
                except RuntimeError:  # no GQA in this cuDNN path: K/V repeated, as HF's repeat_kv does
                    group = q.shape[1] // k.shape[1]
                    kg, vg = (t.detach().repeat_interleave(group, 1).requires_grad_() for t in (k, v))
                    o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
            steps[name] = (lambda o, qg, kg, vg: lambda: torch.autograd.grad(o, (qg, kg, vg), do,
                                                                            retain_graph=True))(o, qg, kg, vg)
    return steps


def heat(fn, seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()


def speed_cells(args):
    cells = [(d, e, c, s) for d in args.dtypes for e in args.head_dims for s in args.seqs for c in args.causal]
    return cells


def speed(args, deadline):
    from triton.testing import do_bench

    rows, skipped = [], []
    for dname, e, causal, seq in speed_cells(args):
        if time.monotonic() > deadline:
            skipped.append(dict(dtype=dname, head_dim=e, causal=causal, seq=seq))
            continue
        q, k, v, do = cell_inputs(dname, e, seq, args.batch, args.heads, args.gqa)
        batch, heads = q.shape[:2]
        flops = 2.5 * 4 * batch * heads * seq * seq * e * (0.5 if causal else 1.0)
        cell = dict(dtype=dname, head_dim=e, causal=causal, seq=seq, batch=batch, heads=heads, kv_heads=k.shape[1],
                    tflops={}, ms={})
        try:
            steps = backward_steps(q, k, v, do, causal, args.providers)
        except Exception as exc:
            cell["errors"] = {"setup": f"{type(exc).__name__}: {str(exc)[:200]}"}
            steps = {}
        for name, step in steps.items():
            try:
                step()
                torch.cuda.synchronize()
                heat(step, args.heat)
                ms = float(do_bench(step, warmup=10, rep=args.rep, return_mode="median"))
            except Exception as exc:
                cell.setdefault("errors", {})[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                continue
            cell["ms"][name] = ms
            cell["tflops"][name] = flops / ms / 1e9
        t = cell["tflops"]
        if "cudnn" in t:
            cell["vs_cudnn"] = {n: t[n] / t["cudnn"] for n in t}
        rows.append(cell)
        print(f"[speed] {dname} E={e} causal={causal!s:5} seq={seq:5}: "
              + "  ".join(f"{n}={x:6.1f}" for n, x in t.items())
              + (f"  errors={cell['errors']}" if "errors" in cell else ""), flush=True)
        del q, k, v, do, steps
        torch.cuda.empty_cache()
    return rows, skipped


# ----------------------------------------------------------------------------- precompile

def _warm_job(job):
    """Run one case or one small speed launch so its kernels land in the on-disk Triton cache."""
    kind, payload = job
    try:
        if kind == "case":
            run_case(*payload)
        else:
            dname, e, causal, seq, providers = payload
            q, k, v, do = cell_inputs(dname, e, seq, batch=1)  # the same kernel specialisations, less work
            for name, step in backward_steps(q, k, v, do, causal, providers).items():
                try:
                    step()
                except Exception:
                    pass
            torch.cuda.synchronize()
        return None
    except Exception as exc:
        return f"{job}: {type(exc).__name__}: {exc}"


def precompile(jobs, workers, timeout):
    """(errors, jobs still running after ``timeout`` s). A job still running then is most likely a
    kernel that never finishes (a barrier protocol bug): the workers are killed, not waited for."""
    ctx = mp.get_context("spawn")
    pool = cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx)
    futures = {pool.submit(_warm_job, j): j for j in jobs}
    done, pending = cf.wait(futures, timeout=timeout)
    errors = [f.result() for f in done if f.result()]
    if pending:
        for proc in list(pool._processes.values()):
            proc.kill()
    pool.shutdown(wait=not pending, cancel_futures=True)
    return errors, [repr(futures[f]) for f in pending]


def _dump(out, record):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "hopper_bwd.json"), "w") as f:
        json.dump(record, f, indent=1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for hopper_bwd.json")
    p.add_argument("--dtypes", nargs="*", default=["bf16", "fp16"], choices=list(DTYPES))
    p.add_argument("--check-dtypes", nargs="*", default=None, help="dtypes for the check (default: --dtypes)")
    p.add_argument("--head-dims", nargs="*", type=int, default=[128, 64])
    p.add_argument("--causal", nargs="*", type=int, default=[0, 1])
    p.add_argument("--seqs", nargs="*", type=int, default=[4096, 16384])
    p.add_argument("--batch", type=int, default=None, help="batch (default: 16k tokens / seq)")
    p.add_argument("--heads", type=int, default=None, help="query heads (default: 2048 / E)")
    p.add_argument("--gqa", type=int, default=1, help="query heads per K/V head (HF Llama: 4)")
    p.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS), help="checked configs")
    p.add_argument("--providers", nargs="*", default=["gluon", "gluon-atomic", "triton-fast", "triton-stable", "cudnn"])
    p.add_argument("--heat", type=float, default=0.2, help="seconds of heating before each timing")
    p.add_argument("--rep", type=int, default=60, help="do_bench repetition time, ms")
    p.add_argument("--budget", type=float, default=200.0, help="seconds for the whole run")
    p.add_argument("--precompile", type=int, default=12, help="worker processes for the compile pass (0: none)")
    p.add_argument("--precompile-timeout", type=float, default=110.0, help="seconds before the compile pass is abandoned")
    p.add_argument("--check-only", action="store_true")
    p.add_argument("--skip-check", action="store_true")
    args = p.parse_args(argv)
    args.causal = [bool(c) for c in args.causal]
    start = time.monotonic()
    deadline = start + args.budget

    cases = [] if args.skip_check else [(c, cfg) for c in correctness_cases(args.check_dtypes or args.dtypes,
                                                                             args.head_dims)
                                        for cfg in args.configs]
    import triton
    record = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  date=time.strftime("%Y-%m-%d"), tokens=TOKENS, hidden=HIDDEN,
                  configs={n: vars(c) for n, c in CONFIGS.items()}, command=" ".join(sys.argv))
    if args.precompile:
        jobs = [("case", c) for c in cases]
        if not args.check_only:
            jobs += [("cell", (d, e, c, s, args.providers)) for d, e, c, s in speed_cells(args)]
        record["precompile_errors"], record["precompile_hung"] = precompile(jobs, args.precompile,
                                                                            args.precompile_timeout)
        record["precompile_seconds"] = time.monotonic() - start
        print(f"precompile: {len(jobs)} jobs in {record['precompile_seconds']:.0f} s, "
              f"{len(record['precompile_errors'])} errors {record['precompile_errors'][:3]}", flush=True)
        if record["precompile_hung"]:
            print(f"precompile: {len(record['precompile_hung'])} jobs did not finish (a hang?): "
                  f"{record['precompile_hung'][:6]}", flush=True)
            _dump(args.out, record)
            return 1
        _dump(args.out, record)
    if cases:
        record["check"] = []
        for case, cfg in cases:
            res = run_case(case, cfg)
            record["check"].append(dict(case, config=cfg, **res))
            _dump(args.out, record)
            print(f"[check {'ok ' if res['ok'] else 'BAD'}] {cfg:>13} {case} -> " + ", ".join(
                f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items() if k != "ok"),
                flush=True)
        bad = [r for r in record["check"] if not r["ok"]]
        print(f"correctness: {len(record['check']) - len(bad)} passed, {len(bad)} failed", flush=True)
    if not args.check_only:
        record["speed"], record["skipped"] = speed(args, deadline)
        if record["skipped"]:
            print(f"time budget reached; {len(record['skipped'])} cells left out: {record['skipped']}")
    record["seconds"] = time.monotonic() - start
    _dump(args.out, record)
    if record.get("speed"):
        print("\nbackward TFLOP/s (ratio vs cuDNN)")
        for c in record["speed"]:
            t, r = c["tflops"], c.get("vs_cudnn", {})
            print(f"{c['dtype']} E{c['head_dim']:<3} {'causal' if c['causal'] else 'full  '} {c['seq']:>5}  "
                  + "  ".join(f"{n} {t[n]:5.0f} ({r.get(n, math.nan):.2f})" for n in t))
    return 0


if __name__ == "__main__":
    sys.exit(main())
