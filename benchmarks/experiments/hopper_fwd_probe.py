"""Probe of the Gluon Hopper forward (kernels/hopper_fwd.py, launch/hopper.py) on an sm_90 GPU:
correctness against an fp64 reference, then forward TFLOP/s side by side with our Triton forward,
cuDNN and FlashAttention-2 (both through SDPA), in one process.

    python3 -m benchmarks.experiments.hopper_fwd_probe --out $OUT
    python3 -m benchmarks.experiments.hopper_fwd_probe --check-only
    python3 -m benchmarks.experiments.hopper_fwd_probe --skip-check --seqs 4096 --configs 128x2:128 128x3w3p:64

"gluon" is launch.hopper.default_config; each --configs entry is timed beside it (syntax in
parse_config). The committed results (benchmarks/results/hopper_fwd_nvidia-h200_20261202.json)
say which commands produced them.

Correctness: for every result, max|ours - fp64| <= 2 * max|SDPA same dtype - fp64| + 2 eps(dtype)
max|fp64| (the project's rule, tests/helpers.py); the LSE within 1e-3 of the fp64 one; a row
that sees no key (causal, lower-right alignment with L > S) gives exactly 0 and LSE -inf.
Speed cells: 16k tokens (B = 16384 / seq), 2048 / E heads, FLOPs 4·B·H·L·S·E (x0.5 causal),
do_bench medians after ~0.3 s of heating each step. A time budget stops the grid before a call
runs out; cells left out are listed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time

import torch
import torch.nn.functional as F

from flash_inductor.launch.hopper import (
    HopperForwardConfig,
    default_config,
    hopper_attention_forward,
    hopper_forward_unsupported_reason,
)
from flash_inductor.launch.visibility import Visibility

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TOKENS = 16384
HIDDEN = 2048


# ----------------------------------------------------------------------------- correctness

def reference(q, k, v, scale, is_causal, causal_offset):
    """fp64 (out, lse natural log) with the kernel's visibility rule; rows with no key: 0, -inf."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    s = (q.double() @ k.transpose(-1, -2)) * scale
    visible = torch.ones(s.shape[-2:], dtype=torch.bool, device=q.device)
    if is_causal:
        i = torch.arange(q.shape[2], device=q.device)[:, None]
        j = torch.arange(k.shape[2], device=q.device)[None, :]
        visible = j <= i + causal_offset
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return p @ v, lse, visible


def same_dtype_baseline(q, k, v, scale, visible):
    """SDPA in the input dtype with the same visibility (a bool mask): the error budget."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale)


def check_case(dtype, head_dim, is_causal, batch, heads_q, heads_kv, seq_q, seq_k, causal_offset=0,
               transposed=False, config=None, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rand(b, h, n):
        if transposed:  # (B, L, H, E) storage seen as (B, H, L, E): strided, no copy
            return torch.randn(b, n, h, head_dim, device="cuda", dtype=dtype, generator=gen).transpose(1, 2)
        return torch.randn(b, h, n, head_dim, device="cuda", dtype=dtype, generator=gen)

    q, k, v = rand(batch, heads_q, seq_q), rand(batch, heads_kv, seq_k), rand(batch, heads_kv, seq_k)
    scale = head_dim ** -0.5
    reason = hopper_forward_unsupported_reason(q, k, v, None, 0.0, scale)
    if reason is not None:
        return dict(ok=False, error=f"unsupported: {reason}")
    out, lse = hopper_attention_forward(q, k, v, scale=scale, config=config,
                                        visibility=Visibility(is_causal=is_causal, causal_offset=causal_offset))
    torch.cuda.synchronize()
    ref, lse_ref, visible = reference(q, k, v, scale, is_causal, causal_offset)
    base = same_dtype_baseline(q, k, v, scale, visible)
    empty = torch.isinf(lse_ref)  # (B, H, L) rows with no visible key
    live = ~empty
    err = (out.double() - ref).abs()[live].max().item() if live.any() else 0.0
    base_err = (base.double() - ref).abs()[live & torch.isfinite(base).all(-1)].max().item() if live.any() else 0.0
    floor = 2 * torch.finfo(dtype).eps * ref.abs().max().item()
    lse_err = (lse.double() - lse_ref).abs()[live].max().item() if live.any() else 0.0
    empty_ok = bool((out[empty] == 0).all().item() and (lse[empty] == float("-inf")).all().item())
    finite = bool(torch.isfinite(out).all().item())
    ok = finite and err <= 2 * base_err + floor and lse_err <= 1e-3 and empty_ok
    return dict(ok=ok, err=err, base_err=base_err, floor=floor, lse_err=lse_err, empty_rows=int(empty.sum()),
                empty_ok=empty_ok, finite=finite)


def correctness(args, configs):
    cases = []
    for dname in args.dtypes:
        for e in args.head_dims:
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
                              seq_q=2048, seq_k=4096))
    rows = []
    for case in cases:
        for name, cfg in configs.items():
            if cfg is not None and case["head_dim"] not in cfg[1]:
                continue
            kw = dict(case)
            kw["dtype"] = DTYPES[kw["dtype"]]
            try:
                res = check_case(**kw, config=cfg[0] if cfg else None)
            except Exception as exc:  # a compile or launch failure is a result here
                res = dict(ok=False, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}")
            rows.append(dict(case, config=name, **res))
            mark = "ok " if res["ok"] else "BAD"
            print(f"[check {mark}] {name:>10} {case} -> " + ", ".join(
                f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items() if k != "ok"),
                flush=True)
    return rows


# ----------------------------------------------------------------------------- speed

def providers(configs, causal, baselines=("ours-triton", "cudnn", "fa2")):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flash_inductor

    out = {}
    for name, cfg in configs.items():
        c = cfg[0] if cfg else None
        out[name] = (lambda c: lambda q, k, v: hopper_attention_forward(q, k, v, visibility=Visibility(is_causal=causal),
                                                                          config=c))(c)
    if "ours-triton" in baselines:
        out["ours-triton"] = lambda q, k, v: flash_inductor.flash_attention(q, k, v, is_causal=causal,
                                                                            enable_gqa=q.shape[1] != k.shape[1])
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("fa2", SDPBackend.FLASH_ATTENTION)):
        if name not in baselines:
            continue
        def sdpa(q, k, v, backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
        out[name] = sdpa
    return out


def heat(fn, seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()


def speed(args, configs, deadline):
    from triton.testing import do_bench

    rows, skipped = [], []
    cells = [(d, e, c, s) for d in args.dtypes for e in args.head_dims for c in args.causal for s in args.seqs]
    for dname, e, causal, seq in cells:
        if time.monotonic() > deadline:
            skipped.append(dict(dtype=dname, head_dim=e, causal=causal, seq=seq))
            continue
        batch = args.batch or max(1, TOKENS // seq)
        heads = args.heads or HIDDEN // e
        gen = torch.Generator(device="cuda").manual_seed(seq + e)
        q, k, v = (torch.randn(batch, heads // (args.gqa if i else 1), seq, e, device="cuda", dtype=DTYPES[dname],
                               generator=gen) for i in range(3))
        flops = 4 * batch * heads * seq * seq * e * (0.5 if causal else 1.0)
        cell = dict(dtype=dname, head_dim=e, causal=causal, seq=seq, batch=batch, heads=heads,
                    kv_heads=heads // args.gqa, tflops={}, ms={})
        with torch.no_grad():
            for name, fn in providers({n: c for n, c in configs.items() if c is None or e in c[1]}, causal,
                                      args.baselines).items():
                step = (lambda fn: lambda: fn(q, k, v))(fn)
                try:
                    step()
                    torch.cuda.synchronize()
                    heat(step, args.heat)
                    ms = float(do_bench(step, warmup=25, rep=args.rep, return_mode="median"))
                except Exception as exc:
                    cell.setdefault("errors", {})[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                    continue
                cell["ms"][name] = ms
                cell["tflops"][name] = flops / ms / 1e9
        t = cell["tflops"]
        if "cudnn" in t:
            cell["vs_cudnn"] = {n: t[n] / t["cudnn"] for n in t}
        rows.append(cell)
        print(f"[speed] {dname} E={e} causal={causal!s:5} seq={seq:5}: " +
              "  ".join(f"{n}={v:6.1f}" for n, v in t.items()) +
              (f"  | vs cudnn: " + " ".join(f"{n}={r:.3f}" for n, r in cell.get("vs_cudnn", {}).items()
                                           if n not in ("cudnn",)) if "vs_cudnn" in cell else "") +
              (f"  errors={cell['errors']}" if "errors" in cell else ""), flush=True)
        del q, k, v
    return rows, skipped


def parse_config(text):
    """'128x2' -> BLOCK_N 128, 2 stages; 'w3' appended: 3 consumer warpgroups; 'p': ping-pong;
    'gN': the grid walks N heads at a time, block by block (swizzle_heads; 'g0': all heads); 'P': persistent;
    an optional ':64' limits it to that head dim. E.g. '128x3w3p:64', '128x2pg8:128', '128x2pP:128'."""
    spec, _, dims = text.partition(":")
    m = re.fullmatch(r"(\d+)x(\d+)(?:w(\d))?(p?)(?:g(\d+))?(P?)", spec)
    if m is None:
        raise ValueError(f"--configs {text!r}: expected BLOCK_NxSTAGES[wCONSUMERS][p][gN][P][:E,...]")
    heads = tuple(int(d) for d in dims.split(",")) if dims else (64, 128)
    cfg = HopperForwardConfig(block_n=int(m[1]), num_stages=int(m[2]), num_consumers=int(m[3] or 2),
                              pingpong=bool(m[4]), swizzle_heads=int(m[5] or 1) or 1 << 30, persistent=bool(m[6]))
    return cfg, heads


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for hopper_fwd.json")
    p.add_argument("--dtypes", nargs="*", default=["bf16", "fp16"], choices=list(DTYPES))
    p.add_argument("--head-dims", nargs="*", type=int, default=[64, 128])
    p.add_argument("--causal", nargs="*", type=int, default=[0, 1])
    p.add_argument("--seqs", nargs="*", type=int, default=[2048, 4096, 8192, 16384, 32768])
    p.add_argument("--batch", type=int, default=None, help="batch (default: 16k tokens / seq)")
    p.add_argument("--heads", type=int, default=None, help="query heads (default: 2048 / E)")
    p.add_argument("--gqa", type=int, default=1, help="query heads per K/V head (HF Llama: 4)")
    p.add_argument("--configs", nargs="*", default=[],
                   help="extra Gluon configs BLOCK_NxSTAGES[:E,...] timed beside the default")
    p.add_argument("--baselines", nargs="*", default=["ours-triton", "cudnn", "fa2"],
                   choices=["ours-triton", "cudnn", "fa2"])
    p.add_argument("--heat", type=float, default=0.3, help="seconds of heating before each timing")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms")
    p.add_argument("--budget", type=float, default=240.0, help="seconds for the whole run")
    p.add_argument("--check-only", action="store_true")
    p.add_argument("--skip-check", action="store_true")
    args = p.parse_args(argv)
    args.causal = [bool(c) for c in args.causal]
    start = time.monotonic()
    deadline = start + args.budget

    configs = {"gluon": None}
    for text in args.configs:
        cfg, heads = parse_config(text)
        configs[f"gluon-{text.split(':')[0]}"] = (cfg, heads)

    import triton
    record = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  date=time.strftime("%Y-%m-%d"), tokens=TOKENS, hidden=HIDDEN,
                  default_configs={e: vars(default_config(e, False)) for e in (64, 128)},
                  command=" ".join(sys.argv))
    if not args.skip_check:
        record["check"] = correctness(args, configs)
        bad = [r for r in record["check"] if not r["ok"]]
        print(f"correctness: {len(record['check']) - len(bad)} passed, {len(bad)} failed", flush=True)
    if not args.check_only:
        record["speed"], record["skipped"] = speed(args, configs, deadline)
        if record["skipped"]:
            print(f"time budget reached; {len(record['skipped'])} cells left out: {record['skipped']}")
    record["seconds"] = time.monotonic() - start
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "hopper_fwd.json"), "w") as f:
        json.dump(record, f, indent=1)
    if "speed" in record:
        print("\nTFLOP/s (ratio vs cuDNN)")
        for c in record["speed"]:
            t, r = c["tflops"], c.get("vs_cudnn", {})
            print(f"{c['dtype']} E{c['head_dim']:<3} {'causal' if c['causal'] else 'full  '} {c['seq']:>5}  " +
                  "  ".join(f"{n} {t[n]:5.0f} ({r.get(n, math.nan):.2f})" for n in t))
    return 0


if __name__ == "__main__":
    sys.exit(main())
