"""EXPERIMENT: `stable` in one Gluon pass on Hopper. Accuracy and cost of an exact Δ taken from a
forward that splits P in two, with dS's rounding compensated per 64-key block in the backward.

    source tools/device_env.sh; python3 -m benchmarks.experiments.one_pass_stable_probe --out $OUT   # H200
    python -m benchmarks.experiments.one_pass_stable_probe --help

Why (docs/hopper_backward.md, "Exact Δ"): the one-pass Gluon backward cannot form `stable`'s Δ*
(a sum over every key of a row) before dK and dV need it. Σⱼ Pᵢⱼ dPᵢⱼ = dOᵢ·(Σⱼ Pᵢⱼ vⱼ), so a
forward whose P·V sees P exactly (SPLIT_P: round(P) and round(P - round(P)) in two wgmmas)
gives Δ* = dO·(O + O_lo) from its output and rounding residual; the backward then compensates
dS's rounding in dS·K by Σ_block (σ - σ̃)·k̄_block (DQ_RESIDUAL). The CPU emulation
(`delta_variants.py`, variant p32_res64) puts dk at `stable`'s error and dq at 0.7-1.6x it.

Contenders, bf16 (fp16's power-of-two dS scaling is not in the one-pass kernel yet):
  stable    today's default: the Gluon forward, the two-pass Triton backward with exact Δ.
  fast      the Gluon forward and the one-pass Gluon backward with FA2's Δ.
  one-pass  the Gluon forward with SPLIT_P (E 64 on two consumer warpgroups: three spill) and the
            one-pass backward with DQ_RESIDUAL and Δ = dO·O + dO·O_lo (two preprocess launches).
Accuracy: relative L2 error of dq, dk, dv against float64 autograd on the stability suite's
qk_x1, qk_x10 and near_tied cases (E 64/128, causal or not), as a ratio to `stable`'s.
Speed: 16k tokens, 2048/E heads, seq 4k/16k, causal or not: forward, backward and their sum
against cuDNN's, each timed alone after heating. A time budget stops the grid.

RESULT (H200, 2026-12-02, --skip-accuracy --seqs 16384; benchmarks/results/hopper_bwd_nvidia-h200_20261202.json,
`one_pass_stable`): forward+backward / cuDNN: one-pass 0.57-0.63, stable 0.71-0.78, fast 0.88-0.94.
The split forward takes 1.52-1.90x the forward's time, the DQ_RESIDUAL backward 1.45-1.54x fast's.
Accurate (tests/unit/test_hopper_bwd.py::test_one_pass_exact_delta_on_near_tied_keys passes on the
H200), too slow to replace `stable`'s two-pass backward.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

from benchmarks.experiments.hopper_bwd_probe import cell_inputs, heat
from flash_inductor.launch import attention_backward
from flash_inductor.launch.backward import launch_preprocess
from flash_inductor.launch.hopper import HopperForwardConfig, default_config, hopper_attention_forward
from flash_inductor.launch.hopper_bwd import HopperBackwardConfig, hopper_attention_backward
from flash_inductor.stability import cases as stability_cases

ACCURACY_CASES = ("qk_x1", "qk_x10", "near_tied")
ONE_PASS_BWD = HopperBackwardConfig(dq_residual=True)


def split_forward_config(head_dim: int, is_causal: bool) -> HopperForwardConfig:
    """The shipped forward config, but E 64 on two consumers: SPLIT_P's second P operand spills
    the three-consumer kernel's 160 registers (1.3 KiB a thread, tools/hopper_fwd_compile.py)."""
    cfg = default_config(head_dim, is_causal)
    return cfg if head_dim == 128 else HopperForwardConfig(num_stages=3, num_consumers=2, pingpong=True)


def exact_delta(out, out_lo, grad_out, value):
    """Δ* = rowsum(dO∘O) + rowsum(dO∘O_lo), each from the Triton preprocess (fp32)."""
    batch, heads, seq, dim = out.shape
    parts = []
    for o in (out, out_lo):
        d = torch.empty((batch, heads, seq), dtype=torch.float32, device=out.device)
        launch_preprocess(o, grad_out, None, value, d, d, dim, dim, 64, False)
        parts.append(d)
    return parts[0] + parts[1]


def run(name, q, k, v, do, causal):
    """(out, (dq, dk, dv)) of one contender."""
    scale = q.shape[-1] ** -0.5
    if name == "one-pass":
        out_lo = torch.empty_like(q)
        out, lse = hopper_attention_forward(q, k, v, scale=scale, is_causal=causal,
                                            config=split_forward_config(q.shape[-1], causal), out_residual=out_lo)
        delta = exact_delta(out, out_lo, do, v)
        return out, hopper_attention_backward(do, q, k, v, out, lse, scale=scale, is_causal=causal,
                                              config=ONE_PASS_BWD, delta=delta)
    out, lse = hopper_attention_forward(q, k, v, scale=scale, is_causal=causal)
    if name == "fast":
        return out, hopper_attention_backward(do, q, k, v, out, lse, scale=scale, is_causal=causal)
    return out, attention_backward(do, q, k, v, None, out, lse, None, None, 0.0, causal, 0, scale, "stable", False)[:3]


def fp64_grads(q, k, v, do, causal):
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal)
    return out.detach(), torch.autograd.grad(out, (qd, kd, vd), do.double())


def accuracy(head_dims, contenders):
    sizes = stability_cases.Sizes(batch=1, heads=4, seq=1024, head_dim=64, long_seqs=(), long_heads=1, slice_rows=1024)
    builders = {c.name: c.build for c in stability_cases.all_cases(sizes)}
    rows = []
    for name in ACCURACY_CASES:
        for e in head_dims:
            for causal in (False, True):
                p = builders[name](torch.bfloat16, "cuda", dataclasses.replace(sizes, head_dim=e),
                                   torch.Generator(device="cuda").manual_seed(0))
                q, k, v, do = p.query, p.key, p.value, p.grad_out
                ref_out, refs = fp64_grads(q, k, v, do, causal)
                row = dict(case=name, head_dim=e, causal=causal, err={})
                for c in contenders:
                    out, grads = run(c, q, k, v, do, causal)
                    torch.cuda.synchronize()
                    row["err"][c] = {g: ((x.double() - r).norm() / r.norm()).item()
                                     for g, x, r in zip(("dq", "dk", "dv"), grads, refs)}
                    row["err"][c]["out"] = ((out.double() - ref_out).norm() / ref_out.norm()).item()
                    row["err"][c]["finite"] = bool(all(torch.isfinite(x).all() for x in grads))
                base = row["err"].get("stable")
                if base:
                    row["vs_stable"] = {c: {g: row["err"][c][g] / base[g] for g in ("out", "dq", "dk", "dv")}
                                        for c in contenders}
                rows.append(row)
                print(f"[accuracy] {name:10} E{e:<3} {'causal' if causal else 'full  '} "
                      + "  ".join(f"{c}: dq {row['err'][c]['dq']:.2e} dk {row['err'][c]['dk']:.2e}"
                                  for c in contenders), flush=True)
    return rows


def speed(args, deadline):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    def timed(fn):
        fn()
        torch.cuda.synchronize()
        heat(fn, args.heat)
        return float(do_bench(fn, warmup=10, rep=args.rep, return_mode="median"))

    rows, skipped = [], []
    for e in args.head_dims:
        for causal in (False, True):
            for seq in args.seqs:
                if time.monotonic() > deadline:
                    skipped.append(dict(head_dim=e, causal=causal, seq=seq))
                    continue
                q, k, v, do = cell_inputs("bf16", e, seq)
                scale = e ** -0.5
                ms = {}
                out, lse = hopper_attention_forward(q, k, v, scale=scale, is_causal=causal)
                out_lo = torch.empty_like(q)
                split_cfg = split_forward_config(e, causal)
                ms["fwd"] = timed(lambda: hopper_attention_forward(q, k, v, scale=scale, is_causal=causal))
                ms["fwd_split"] = timed(lambda: hopper_attention_forward(q, k, v, scale=scale, is_causal=causal,
                                                                         config=split_cfg, out_residual=out_lo))
                o_s, lse_s = hopper_attention_forward(q, k, v, scale=scale, is_causal=causal, config=split_cfg,
                                                      out_residual=out_lo)
                ms["bwd_fast"] = timed(lambda: hopper_attention_backward(do, q, k, v, out, lse, scale=scale,
                                                                         is_causal=causal))
                ms["bwd_one_pass"] = timed(lambda: hopper_attention_backward(
                    do, q, k, v, o_s, lse_s, scale=scale, is_causal=causal, config=ONE_PASS_BWD,
                    delta=exact_delta(o_s, out_lo, do, v)))
                ms["bwd_stable"] = timed(lambda: attention_backward(do, q, k, v, None, out, lse, None, None, 0.0,
                                                                    causal, 0, scale, "stable", False))
                qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    ms["fwd_cudnn"] = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
                    o_c = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
                ms["bwd_cudnn"] = timed(lambda: torch.autograd.grad(o_c, (qg, kg, vg), do, retain_graph=True))
                total = dict(stable=ms["fwd"] + ms["bwd_stable"], fast=ms["fwd"] + ms["bwd_fast"],
                             one_pass=ms["fwd_split"] + ms["bwd_one_pass"], cudnn=ms["fwd_cudnn"] + ms["bwd_cudnn"])
                row = dict(head_dim=e, causal=causal, seq=seq, ms=ms,
                           fwd_bwd_vs_cudnn={n: total["cudnn"] / t for n, t in total.items()},
                           fwd_split_cost=ms["fwd_split"] / ms["fwd"], bwd_one_pass_vs_fast=ms["bwd_fast"] / ms["bwd_one_pass"])
                rows.append(row)
                print(f"[speed] E{e} {'causal' if causal else 'full  '} {seq:>5}: fwd+bwd / cuDNN "
                      + "  ".join(f"{n} {r:.3f}" for n, r in row["fwd_bwd_vs_cudnn"].items())
                      + f"  | split-P forward {row['fwd_split_cost']:.2f}x time, one-pass bwd "
                        f"{row['bwd_one_pass_vs_fast']:.2f}x fast's speed", flush=True)
                del q, k, v, do, qg, kg, vg, o_c
                torch.cuda.empty_cache()
    return rows, skipped


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for one_pass_stable.json")
    p.add_argument("--head-dims", nargs="*", type=int, default=[128, 64])
    p.add_argument("--seqs", nargs="*", type=int, default=[4096, 16384])
    p.add_argument("--heat", type=float, default=0.2, help="seconds of heating before each timing")
    p.add_argument("--rep", type=int, default=40, help="do_bench repetition time, ms")
    p.add_argument("--budget", type=float, default=240.0, help="seconds for the whole run")
    p.add_argument("--skip-accuracy", action="store_true")
    args = p.parse_args(argv)
    start = time.monotonic()
    import triton
    record = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  date=time.strftime("%Y-%m-%d"), command=" ".join(sys.argv))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "one_pass_stable.json")
    if not args.skip_accuracy:
        record["accuracy"] = accuracy(args.head_dims, ("stable", "fast", "one-pass"))
        with open(path, "w") as f:
            json.dump(record, f, indent=1)
    record["speed"], record["skipped"] = speed(args, start + args.budget)
    record["seconds"] = time.monotonic() - start
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
