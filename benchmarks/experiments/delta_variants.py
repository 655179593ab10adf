"""EXPERIMENT: can a GEMM-free Δ match `stable`'s exact Δ in the 16-bit backward? (No.)

    python benchmarks/experiments/delta_variants.py --out r.json     # 3 seeds, L 256/1024, E 64/128: ~35 s
    python benchmarks/experiments/delta_variants.py --quick          # CI size: 2 seeds, L 256, E 64: ~5 s

Pure PyTorch on the CPU: the kernels' rounding (attn_fwd.py, attn_bwd.py) is emulated in fp32 with
16-bit casts where the kernels cast; no Triton. The backward needs Δᵢ = rowsum(dOᵢ∘Oᵢ); candidates:
  fa2        Σₑ dO·O_stored, O rounded to the input dtype (FlashAttention-2, our `fast`);
  exact      Σⱼ Pᵢⱼ dPᵢⱼ / Σⱼ Pᵢⱼ from the backward's fp32 P and dP (`stable`; the division by
             Λ = Σⱼ Pᵢⱼ is the kernel's, see attn_bwd.py; it costs one more GEMM, P·K);
  residual   Σₑ dO·(O_stored + r), r = round16(O_fp32 − O_stored) stored by the forward;
  fp32_o     Σₑ dO·O_fp32, the forward's output before its final rounding;
  fp32_o_p32 fp32_o from a forward that keeps P in fp32 for P·V (diagnostic: why fp32_o falls short).
dq, dk come from dS = P∘(dP − Δ) in two modes: `fp32` (dS never rounded: only Δ differs) and `ds16`
(dS rounded to the input dtype before dS·K, dSᵀ·Q; fp16 first scaled up by the kernels' power of
two). `ds16` adds exact_kernel, what `stable` really computes: fa2's rounded dS, then
dq −= (σ̃/Λ)·round(P)·K, σ̃ the rounded dS's row sum. *_ctr rows: a GEMM-free idea found on the
way, dq −= σ̃·k̄ with k̄ the head's mean key (see `grads`). Errors: relative L2 against float64
attention of the same 16-bit inputs, beside PyTorch's same-dtype error (CPU SDPA + autograd) and
`round`, the error of rounding the fp64 gradient itself to the dtype (the floor of any 16-bit
output). Our dq, dk are compared unrounded so that floor does not hide Δ; JSON has both.

RESULT (CPU, torch 2.13, 3 seeds; benchmarks/results/delta_variants_cpu_20261201.json):
  * near_tied, dS fp32: dq error fa2 0.20-0.29, residual = fp32_o 0.14-0.17 (only 1.4-1.7x better),
    exact 2e-5 (bf16) / 2-4e-4 (fp16): residual is 430-7000x worse than exact (key_bias alike).
    The forward rounds P for P·V, so O_fp32 = Σⱼ round(Pⱼ)vⱼ / Σⱼ Pⱼ and its Δ misses Σⱼ Pⱼ dPⱼ by
    Σⱼ (round(Pⱼ) − Pⱼ) dPⱼ, a 16-bit-sized error that dq multiplies by the keys' shared part, as
    it does fa2's; fp32_o_p32 is within 1.5x of exact.
  * dS rounded (as the kernels do): near_tied dq error 0.15-0.36 for every Δ, exact included (dS's
    own rounding meets the shared part); exact_kernel reaches the `round` floor, 90-1000x below
    residual. residual_ctr matches exact_kernel within 1% there, fa2_ctr too.
  * one-hot (scale 1e2) and peaked: residual is 0.8-3.2x exact_kernel (stored dq: 0.9-1.8x), fa2
    and fa2_ctr 1-15x; dk likewise. PyTorch's CPU SDPA has fa2's error (0.25-0.39 on near_tied).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import pathlib
import sys
import time

import torch
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parents[2]
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
BLOCK_N = 64  # the forward's key block: where its online softmax rescales (and P is rounded)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
VARIANTS = ("fa2", "exact", "residual", "fp32_o", "fp32_o_p32", "exact_kernel", "fa2_ctr", "residual_ctr")


def _load_cases():
    """flash_inductor/stability/cases.py by path: it needs only torch, while importing the package
    imports Triton (seconds, and not needed for pure-PyTorch emulation)."""
    spec = importlib.util.spec_from_file_location("_fi_cases", ROOT / "flash_inductor" / "stability" / "cases.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up in sys.modules
    spec.loader.exec_module(module)
    return module


CASES = _load_cases()


def _peaked(dtype, device, sz, gen):
    """Peaked but not saturated: q, k x4 (logit std 16), the top P of a row 0.85-0.9 on average."""
    return CASES._standard(dtype, device, sz, gen, q_mult=4.0, k_mult=4.0)


def _key_bias(dtype, device, sz, gen):
    """Keys = a shared vector of norm ~8·sqrt(E) + unit noise (a milder near-tie: a key bias)."""
    p = CASES._standard(dtype, device, sz, gen)
    shared = torch.randn((sz.batch, sz.heads, 1, sz.head_dim), generator=gen) * 8.0
    p.key = (shared + p.key.float()).to(dtype)
    return p


def case_builders():
    """name -> build(dtype, device, sizes, generator) -> Problem: the repo's stability cases that
    stress Δ (random = qk_x1, near-tied keys, one-hot via scale 1e2) plus two of our own."""
    repo = {c.name: c.build for c in CASES.all_cases(CASES.QUICK)}
    return {"random": repo["qk_x1"], "near_tied": repo["near_tied"], "onehot_scale_1e2": repo["scale_1e2"],
            "peaked": _peaked, "key_bias": _key_bias}


# ------------------------------------------------------------------------------------------------
# Float64 truth and PyTorch's same-dtype baseline
# ------------------------------------------------------------------------------------------------


def truth_fp64(q, k, v, do, scale):
    """Exact softmax attention and its gradient, in float64 from the 16-bit inputs."""
    qd, kd, vd, dod = (t.double() for t in (q, k, v, do))
    p = torch.softmax((qd @ kd.transpose(-2, -1)) * scale, dim=-1)
    dp = dod @ vd.transpose(-2, -1)
    ds = p * (dp - (p * dp).sum(-1, keepdim=True))
    return dict(dq=scale * ds @ kd, dk=scale * ds.transpose(-2, -1) @ qd, dv=p.transpose(-2, -1) @ dod)


def torch_same_dtype(q, k, v, do, scale):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*leaves, scale=scale).backward(do)
    return dict(dq=leaves[0].grad, dk=leaves[1].grad, dv=leaves[2].grad)


# ------------------------------------------------------------------------------------------------
# The kernels' arithmetic, emulated
# ------------------------------------------------------------------------------------------------


def scores_log2(q, k, scale):
    """S·scale·log2(e) in fp32 from 16-bit operands (fp32 accumulate), as both kernels form it."""
    return (q.float() @ k.float().transpose(-2, -1)) * torch.tensor(scale * LOG2E, dtype=torch.float32)


def forward(q, k, v, scale, p_dtype=None):
    """attn_fwd.py: online softmax over key blocks, P rounded to the input dtype for P·V (to
    `p_dtype` if given), O summed in fp32 and divided by l, the fp32 sum of the unrounded P.
    Returns (O_fp32, lse)."""
    p_dtype = p_dtype or q.dtype
    s2 = scores_log2(q, k, scale)
    m = torch.full(s2.shape[:-1], float("-inf"))
    l = torch.zeros(s2.shape[:-1])
    acc = torch.zeros((*s2.shape[:-1], v.shape[-1]))
    for start in range(0, s2.shape[-1], BLOCK_N):
        block = s2[..., start:start + BLOCK_N]
        m_new = torch.maximum(m, block.amax(-1))
        alpha = torch.exp2(m - m_new)
        p = torch.exp2(block - m_new[..., None])
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + p.to(p_dtype).float() @ v[..., start:start + BLOCK_N, :].float()
        m = m_new
    return acc * (1.0 / l)[..., None], (m + torch.log2(l)) * LN2


def recompute(q, k, v, do, lse, scale):
    """The backward's fp32 P (from the LSE) and dP = dO·Vᵀ (16-bit operands, fp32 accumulate)."""
    p = torch.exp2(scores_log2(q, k, scale) - (lse * LOG2E)[..., None])
    return p, do.float() @ v.float().transpose(-2, -1)


def deltas(o32, o32_p32, do, p, dp):
    """Each candidate Δ, in fp32 (o32_p32: O_fp32 of a forward that keeps P in fp32)."""
    dtype, dof = do.dtype, do.float()
    o16 = o32.to(dtype)
    residual = (o32 - o16.float()).to(dtype)
    return dict(
        fa2=(dof * o16.float()).sum(-1),
        exact=(p * dp).sum(-1) / p.sum(-1),
        residual=(dof * (o16.float() + residual.float())).sum(-1),
        fp32_o=(dof * o32).sum(-1),
        fp32_o_p32=(dof * o32_p32).sum(-1),
    )


def ds_rounder(dtype, do, v):
    """dS as the matrix unit sees it under `ds16`. For fp16 the kernels first scale dS up by
    2^floor(log2(2^14 / B)), B = 2·max‖dO‖·max‖V‖ (launch._ds_bound), so small dS does not land in
    fp16's subnormals; the power of two is exact, so we scale back after rounding."""
    if dtype != torch.float16:
        return lambda ds: ds.to(dtype).float()
    bound = 2.0 * do.float().norm(dim=-1).max().item() * v.float().norm(dim=-1).max().item()
    up = 2.0 ** min(40, max(0, math.floor(math.log2(16384.0 / bound))))
    return lambda ds: (ds * up).to(dtype).float() / up


def grads(p, dp, delta, q, k, scale, rounder=None, centre=False):
    """dq, dk (fp32, unrounded) from dS = P∘(dP − Δ); dS rounded by `rounder` if given. With
    `centre`, dq −= σ̃ᵢ·k̄ (σ̃ the row sum of dS as used, k̄ the head's mean key): exact for any
    dS whose true row sum is 0, and it leaves Δ's and dS's rounding errors meeting kⱼ − k̄ instead
    of kⱼ; GEMM-free (a row sum and one vector per head)."""
    ds = p * (dp - delta[..., None])
    if rounder is not None:
        ds = rounder(ds)
    dq = ds @ k.float()
    if centre:
        dq = dq - ds.sum(-1, keepdim=True) * k.float().mean(-2, keepdim=True)
    return dict(dq=scale * dq, dk=scale * ds.transpose(-2, -1) @ q.float())


def stable_kernel_dq(p, dp, delta_fa2, k, scale, rounder):
    """`stable`'s dQ pass with rounded dS: Σⱼ dS̃ᵢⱼ kⱼ − (σ̃ᵢ/Λᵢ)·Σⱼ round(Pᵢⱼ) kⱼ, dS̃ the rounded
    fa2 dS and σ̃ its row sum, so the rounding's common part leaves dq along with Δ's error."""
    ds = rounder(p * (dp - delta_fa2[..., None]))
    p_k = p.to(k.dtype).float() @ k.float()
    return scale * (ds @ k.float() - (ds.sum(-1) / p.sum(-1))[..., None] * p_k)


# ------------------------------------------------------------------------------------------------
# One problem, every variant
# ------------------------------------------------------------------------------------------------


def rel_l2(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


def run_problem(problem, dtype):
    q, k, v, do = problem.query, problem.key, problem.value, problem.grad_out
    scale = problem.scale if problem.scale is not None else 1.0 / math.sqrt(q.shape[-1])
    ref = truth_fp64(q, k, v, do, scale)
    base = torch_same_dtype(q, k, v, do, scale)
    o32, lse = forward(q, k, v, scale)
    p, dp = recompute(q, k, v, do, lse, scale)
    cand = deltas(o32, forward(q, k, v, scale, torch.float32)[0], do, p, dp)
    dv = p.to(dtype).float().transpose(-2, -1) @ do.float()  # Pᵀ·dO, P rounded; no Δ in it
    out = dict(
        torch={g: rel_l2(base[g], ref[g]) for g in ref},
        round_ref={g: rel_l2(ref[g].to(dtype), ref[g]) for g in ref},
        dv=rel_l2(dv, ref["dv"]),
        max_p=p.amax(-1).mean().item(),
        modes={},
    )
    rounder = ds_rounder(dtype, do, v)
    for mode, rnd in (("fp32", None), ("ds16", rounder)):
        results = {name: grads(p, dp, delta, q, k, scale, rnd) for name, delta in cand.items()}
        for name in ("fa2", "residual"):
            results[f"{name}_ctr"] = grads(p, dp, cand[name], q, k, scale, rnd, centre=True)
        if mode == "ds16":
            results["exact_kernel"] = dict(dq=stable_kernel_dq(p, dp, cand["fa2"], k, scale, rnd),
                                           dk=results["exact"]["dk"])
        # "dq": our fp32 result; "dq_stored": after the kernels' final cast to the input dtype.
        out["modes"][mode] = {name: {key: rel_l2(x if key == g else x.to(dtype), ref[g])
                                     for g, x in r.items() for key in (g, f"{g}_stored")}
                              for name, r in results.items()}
    return out


def run(cases, dtypes, seqs, head_dims, seeds, heads):
    rows = []
    for name, build in case_builders().items():
        if cases and name not in cases:
            continue
        for seq in seqs:
            for e in head_dims:
                sizes = CASES.Sizes(batch=1, heads=heads, seq=seq, head_dim=e, long_seqs=(), long_heads=1,
                                    slice_rows=seq)
                for dname in dtypes:
                    for seed in seeds:
                        problem = build(DTYPES[dname], "cpu", sizes, torch.Generator().manual_seed(seed))
                        rows.append(dict(case=name, seq=seq, head_dim=e, dtype=dname, seed=seed,
                                         **run_problem(problem, DTYPES[dname])))
    return rows


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else 0.5 * (xs[len(xs) // 2 - 1] + xs[len(xs) // 2])


def print_table(rows, grad):
    """One line per case × shape × dtype × dS mode: each variant's error (median over seeds) and,
    in brackets, its ratio to PyTorch's same-dtype error."""
    keys = sorted({(r["case"], r["seq"], r["head_dim"], r["dtype"]) for r in rows})
    print(f"\n{grad}: relative L2 error vs fp64 (median over seeds) [x PyTorch same-dtype error]")
    print(f"{'case':<17}{'L':>5}{'E':>4} {'dtype':<6}{'dS':<5}{'torch':>9}{'round':>9}"
          + "".join(f"{n:>17}" for n in VARIANTS))
    for key in keys:
        group = [r for r in rows if (r["case"], r["seq"], r["head_dim"], r["dtype"]) == key]
        torch_err = _median([r["torch"][grad] for r in group])
        for mode in ("fp32", "ds16"):
            cells = []
            for n in VARIANTS:
                if n not in group[0]["modes"][mode]:
                    cells.append(f"{'-':>17}")
                    continue
                err = _median([r["modes"][mode][n][grad] for r in group])
                cells.append(f"{err:>9.2e} [{err / torch_err:5.2f}]")
            print(f"{key[0]:<17}{key[1]:>5}{key[2]:>4} {key[3]:<6}{mode:<5}{torch_err:>9.2e}"
                  f"{_median([r['round_ref'][grad] for r in group]):>9.2e}" + "".join(cells))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="L=S=256, E=64, 2 seeds (CI size)")
    parser.add_argument("--out", help="write the JSON record here")
    parser.add_argument("--cases", help="comma-separated case names (default: all)")
    args = parser.parse_args(argv)
    cases = set(args.cases.split(",")) if args.cases else None
    if cases and not cases <= set(case_builders()):
        parser.error(f"--cases: unknown {sorted(cases - set(case_builders()))}; known: {sorted(case_builders())}")
    if args.quick:
        config = dict(seqs=(256,), head_dims=(64,), seeds=(0, 1), heads=2)
    else:
        config = dict(seqs=(256, 1024), head_dims=(64, 128), seeds=(0, 1, 2), heads=2)
    start = time.time()
    rows = run(cases, tuple(DTYPES), **config)
    for grad in ("dq", "dk"):
        print_table(rows, grad)
    print(f"\ndv (no Δ in it): median error / PyTorch's = "
          f"{_median([r['dv'] / r['torch']['dv'] for r in rows]):.2f}; {time.time() - start:.1f} s")
    if args.out:
        header = dict(experiment="delta_variants", torch=torch.__version__, quick=args.quick,
                      block_n=BLOCK_N, argv=sys.argv[1:], **{k: list(v) if isinstance(v, tuple) else v
                                                             for k, v in config.items()})
        pathlib.Path(args.out).write_text(json.dumps(dict(header=header, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
