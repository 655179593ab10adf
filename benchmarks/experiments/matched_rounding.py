"""EXPERIMENT: an exact Δ for a one-pass backward from a forward whose rounding the backward repeats.

    python -m benchmarks.experiments.matched_rounding            # CPU, the suite's QUICK sizes: ~10 s
    python -m benchmarks.experiments.matched_rounding --seq 2048 --head-dim 128   # its full sizes: ~3 min

Why: dK and dV need Δ*ᵢ = Σⱼ Pᵢⱼ dPᵢⱼ / Σⱼ Pᵢⱼ before one pass over key blocks has seen a row's
keys. dO·O misses it because the forward rounds P for P·V while the backward's dS uses fp32 P.
Here the backward uses the forward's rounded P instead, which it can reproduce exactly:
  * the forward's running max m is an integer in the base-2 domain, so every rescale is a power
    of two and round16(2^t)·2^k = round16(2^(t+k)): the rounded P does not depend on which
    tile set the max;
  * l̃ = Σⱼ round16(pⱼ), so O_fp32 = Σⱼ round16(pⱼ) vⱼ / l̃ exactly (to fp32 sums), stored as
    O plus a 16-bit residual r = round16(O_fp32 − O);
  * the backward takes any integer c per row (floor of the base-2 LSE), P̃ = round16(2^(y − c)),
    dO' = round16(g·dO) with g = 2^(c − LSE₂) (the normalisation; P = g·P̃), and
    Δ' = dO'·(O + r). Then Σⱼ P̃ᵢⱼ (dO'ᵢ·vⱼ − Δ'ᵢ) = 0 to fp32, whatever g's rounding.
  dS = P̃∘(dO'Vᵀ − Δ'), dV = P̃ᵀdO', dK = dSᵀQ, dQ = dS·K: the `fast` kernel's five GEMMs.
dS's own rounding before dS·K meets the keys' shared component (near-tied keys). Two remedies:
  *_ctr       σ̃ᵢ = Σⱼ round16(dSᵢⱼ) and the head's mean key k̂: dq −= σ̃ᵢ·k̂ (exact for any fixed
              k̂, since the exact dS rows sum to 0);
  *_centred   dQ's GEMM takes K̃ = K − k̂ with k̂ chosen so that the subtraction is exact
              (ops/one_pass.key_mean_reference: per dimension, the rounded mean where every key is
              within a factor of two of it, else 0); S and P stay over K, and dS·K̃ meets only the
              keys' spread. What ops/one_pass.py ships (the Hopper backward forms K̃ in shared
              memory). The first RESULT below is of the earlier spelling, K̃ in both passes.
Variants: fa2 (`fast`: fp32 P from the LSE, Δ = dO·O), matched, matched_ctr, matched_centred.

RESULT (CPU, torch 2.13, the suite's requirement, sdpa:math and eager as anchors, seed 0):
  * L 2048, E 128 (the suite's full sizes), every case but the long ones: matched_ctr and
    matched_centred PASS (worst err/bound 0.26, qk_x100 fp16 dq); matched alone fails near_tied dq
    (8-10x the bound); fa2 fails near_tied dq (15-17x) and qk_x100 bf16 dq/dk.
  * With K̃ for dQ alone (what ships since 2026-12-04), L 512, E 64 (`--seq 512 --head-dim 64
    --variants matched,matched_centred`): matched_centred PASS (worst err/bound 0.25, qk_x100 bf16
    dq); matched fails near_tied dq (8.6-18x).
  * On the H200 the kernels agree (benchmarks/results/hopper_bwd_nvidia-h200_20261202.json,
    'one_pass_exact'; docs/hopper_backward.md).

Pure PyTorch: the kernels' rounding is emulated with fp32 arithmetic and 16-bit casts; exp2 is
evaluated in float64 and rounded to fp32 (an exp2 that commutes with integer shifts, as MUFU's
does for an argument that keeps its fraction bits). ``--perturb`` adds one fp32 ulp of noise to
the backward's scores, for a backward whose Sᵀ GEMM sums in another order than the forward's S.
Prints the stability suite's requirement for each variant against the anchors that run on the CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import torch
from torch import Tensor

from flash_inductor.ops.one_pass import key_mean_reference
from flash_inductor.stability import cases as suite_cases
from flash_inductor.stability import runner
from flash_inductor.stability.anchors import Implementation, implementations

LOG2E = 1.4426950408889634
TILE = 128


def _exp2(t: Tensor) -> Tensor:
    return torch.exp2(t.double()).float()


def _scores(q: Tensor, k: Tensor, scale: float, mask: Tensor | None) -> Tensor:
    """Base-2 scores y = s·scale·log2 e in fp32 (16-bit products are exact; sums in fp32)."""
    y = (q.float() @ k.float().transpose(-1, -2)) * (scale * LOG2E)
    if mask is not None:
        if mask.dtype == torch.bool:
            y = y.masked_fill(~mask, float("-inf"))
        else:
            y = y + mask.float().clamp_min(-1e30) * LOG2E  # the kernels' mask clamp: finfo.min stays finite
    return y


def _forward(q, k, v, scale, mask, dtype):
    """Tiled forward with an integer running max; returns O, r, LSE₂ (rows with no key: 0, 0, -inf)."""
    y = _scores(q, k, scale, mask)
    rows = y.shape[:-1]
    m = torch.full(rows, float("-inf"))
    l = torch.zeros(rows)
    acc = torch.zeros(*rows, v.shape[-1])
    for start in range(0, y.shape[-1], TILE):
        yt = y[..., start:start + TILE]
        m_new = torch.maximum(m, torch.ceil(yt.amax(-1)))
        safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.where(torch.isinf(m), torch.zeros_like(m), torch.exp2(m - safe))
        p16 = _exp2(yt - safe[..., None]).to(dtype)
        pr = p16.float()
        l = l * alpha + pr.sum(-1)
        acc = acc * alpha[..., None] + pr @ v[..., start:start + TILE, :].float()
        m = m_new
    dead = l == 0
    o32 = torch.where(dead[..., None], 0.0, acc / torch.where(dead, 1.0, l)[..., None])
    o = o32.to(dtype)
    r = (o32 - o.float()).to(dtype)
    # The backward's row constants: an integer c = fl(m + floor(log2 l̃)) and g = 2^(c − m)/l̃, with
    # c − m as fp32 gives it (0 where m is so large that m + k rounds back to m: rows at the mask clamp).
    m_safe = torch.where(dead, 0.0, m)
    l_safe = torch.where(dead, 1.0, l)
    c = m_safe + torch.floor(torch.log2(l_safe))
    g = torch.exp2(c - m_safe) / l_safe
    return o, r, torch.where(dead, float("-inf"), c), g


def _round_ds(ds: Tensor, dtype) -> tuple[Tensor, float]:
    """dS in the dtype; fp16 first scaled by a power of two that keeps max |dS| below 2^14."""
    if dtype != torch.float16:
        return ds.to(dtype).float(), 1.0
    top = ds.abs().max().item()
    shift = 2.0 ** (14 - math.ceil(math.log2(top))) if top > 0 else 1.0
    return (ds * shift).to(dtype).float() / shift, shift


def _backward(q, k, v, do, o, r, c, g, scale, mask, dtype, variant, perturb):
    y = _scores(q, k, scale, mask)
    if perturb:
        ulp = torch.finfo(torch.float32).eps * y.abs().clamp_min(1e-30)
        noise = torch.randint(-1, 2, y.shape, generator=torch.Generator().manual_seed(7)).float()
        y = torch.where(torch.isinf(y), y, y + ulp * noise)
    dead = torch.isinf(c)
    c = torch.where(dead, 0.0, c)
    if variant == "fa2":  # `fast`: P from the LSE in fp32, Δ = dO·O
        lse2 = c - torch.log2(g)
        p = torch.where(dead[..., None], 0.0, _exp2(y - lse2[..., None]))
        dop, delta = do.float(), (do.float() * o.float()).sum(-1)
        p_ds, p_dv = p, p.to(dtype).float()
        dop16 = do
    else:  # matched rounding
        dop16 = (g[..., None] * do.float()).to(dtype)
        dop = dop16.float()
        delta = (dop * (o.float() + r.float())).sum(-1)
        p16 = torch.where(dead[..., None], 0.0, _exp2(y - c[..., None])).to(dtype)
        p_ds = p_dv = p16.float()
    dp = dop @ v.float().transpose(-1, -2)
    ds = p_ds * (dp - delta[..., None])
    ds_r, _ = _round_ds(ds, dtype)
    dv = p_dv.transpose(-1, -2) @ dop
    dk = (ds_r.transpose(-1, -2) @ q.float()) * scale
    if variant.endswith("centred"):  # the exact dS rows sum to 0: dS·K = dS·K̃
        dq = (ds_r @ (k.float() - key_mean_reference(k).unsqueeze(2))) * scale
    else:
        dq = (ds_r @ k.float()) * scale
    if variant.endswith("ctr"):
        k_hat = k.float().mean(-2, keepdim=True)  # (B, H, 1, E)
        dq = dq - ds_r.sum(-1, keepdim=True) * k_hat * scale
    return dq, dk, dv


class _Emulated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, mask, variant, perturb):
        o, r, c, g = _forward(q, k, v, scale, mask, q.dtype)
        ctx.save_for_backward(q, k, v, o, r, c, g)
        ctx.rest = (scale, mask, variant, perturb)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, r, c, g = ctx.saved_tensors
        scale, mask, variant, perturb = ctx.rest
        dq, dk, dv = _backward(q, k, v, do, o, r, c, g, scale, mask, q.dtype, variant, perturb)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def emulated(variant: str, perturb: bool) -> Implementation:
    def run(p, q, k, v):
        mask = p.attn_mask
        if p.is_causal:
            mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        scale = p.scale if p.scale is not None else q.shape[-1] ** -0.5
        return _Emulated.apply(q, k, v, scale, mask, variant, perturb)
    name = f"ours:{variant}{'+perturb' if perturb else ''}"
    return Implementation(name, run, is_ours=True, schedule=name.split(":", 1)[1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=None, help="comma-separated case names (default: all but long)")
    parser.add_argument("--variants", default="fa2,matched,matched_ctr,matched_centred")
    parser.add_argument("--perturb", action="store_true")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--seeds", type=int, default=1)
    args = parser.parse_args(argv)
    sizes = dataclasses.replace(suite_cases.QUICK, seq=args.seq, head_dim=args.head_dim)
    wanted = set(args.cases.split(",")) if args.cases else None
    cases = [c for c in suite_cases.all_cases(sizes) if (wanted is None and not c.name.startswith("long"))
             or (wanted and c.name in wanted)]
    anchors = implementations(["sdpa:math", "eager"])
    ours = [emulated(v, args.perturb) for v in args.variants.split(",")]
    for seed in range(args.seeds):
        results = runner.run_suite(cases, anchors + ours, "cpu", sizes, seed=seed)
        for impl in ours:
            req = runner.check_requirements(results, impl.schedule)
            worst = sorted(req.checks, key=lambda c: -(c.ours_err / c.bound if c.bound else 0))[:4]
            verdict = "PASS" if req.passed else f"FAIL {len(req.violations)}"
            print(f"seed {seed} {impl.name}: {verdict}; worst err/bound: "
                  + ", ".join(f"{c.case}/{c.dtype}/{c.result} {c.ours_err / c.bound:.2f}" for c in worst if c.bound))
            for v in req.violations[:6]:
                print("   ", v)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
