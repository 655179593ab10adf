"""EXPERIMENT: can a GEMM-free Δ match `stable`'s exact Δ in the 16-bit backward? (Not everywhere.)

    python -m benchmarks.experiments.delta_variants --out r.json   # 3 seeds, L 256/1024, E 64/128, all features: ~9 min
    python -m benchmarks.experiments.delta_variants --quick        # CI: 2 seeds, L 256, E 64 (features: 4 cases): ~15 s
    python -m benchmarks.experiments.delta_variants --quick --seeds 8 --cases onehot_scale_1e2 --features base,dropout

Pure PyTorch on the CPU: the kernels' rounding (attn_fwd.py, attn_bwd.py) is emulated in fp32 with
16-bit casts where the kernels cast; no Triton. The backward needs Δᵢ = rowsum(dOᵢ∘Oᵢ) − dLSEᵢ:
  fa2        Σₑ dO·O_stored, O rounded to the input dtype (FlashAttention-2, our `fast`);
  exact      Σⱼ Pᵢⱼ dPᵢⱼ / Λᵢ, Λ = Σⱼ Pᵢⱼ, from the backward's fp32 P and dP (`stable`: one more GEMM, P·K);
  residual   Σₑ dO·(O_stored + r), r = round16(O_fp32 − O_stored) stored by the forward;
  fp32_o     Σₑ dO·O_fp32; fp32_o_p32 the same from a forward that keeps P in fp32 for P·V.
dq, dk come from dS = P∘(dP − Δ), `fp32` (dS never rounded) or `ds16` (rounded before dS·K, dSᵀ·Q,
fp16 first scaled by the kernels' power of two). exact_kernel is what `stable` computes: fa2's
rounded dS, then dq −= (σ̃/Λ − dLSE)·round(P)·K, σ̃ the rounded dS's row sum. *_ctr: the GEMM-free
dq −= (σ̃ᵢ − dLSEᵢΛᵢ)·k̄, exact for any fixed k̄ since Σⱼ dSᵢⱼ = dLSEᵢΛᵢ; k̄ = the K/V head's mean
key, _row = the mean of the keys row i sees, _blk0 = of the first 64 keys; _sum0 drops dLSEᵢΛᵢ.
Errors: relative L2 vs float64 autograd of (out, lse) from the same 16-bit inputs, beside PyTorch
(CPU SDPA + autograd; with dropout CPU SDPA's math backend, fp32 inside, with our keep mask; with
dLSE plus logsumexp of the 16-bit scores) and `round`, the error of rounding the fp64 gradient to
the dtype (the floor of any 16-bit output). Ours are compared unrounded; JSON has both.
--features (each alike for truth, PyTorch, every variant): causal (top-left, L = S); bool_dead
(90 % random bool mask, every 16th row fully masked); additive (N(0, 4) in the dtype, 20 % -inf);
gqa (4 query heads on 2 K/V heads); dropout (p 0.1, a fixed keep mask on P for P·V and on dP,
scale 1/(1-p)); dlse (dLSE ~ N(0, 1)); all (causal + bool_dead + gqa + dropout + dlse).

RESULT (CPU, torch 2.13; benchmarks/results/delta_variants_cpu_20261201.json, its 'base' and
'features' runs; 3 seeds x L 256/1024 x E 64/128; residual_ctr / exact_kernel, median (max)):
  * Base: on near_tied residual = fp32_o is 430-7000x above exact (dS fp32): the forward rounds P
    for P·V, so O_fp32's Δ misses Σⱼ (round(Pⱼ) − Pⱼ) dPⱼ (fp32_o_p32 is exact's). With dS rounded,
    exact_kernel reaches `round`, residual_ctr too (1 %); PyTorch's CPU SDPA has fa2's 0.25-0.39.
  * Every feature is handled: fully masked rows give exact zeros in every variant, the forward,
    truth and PyTorch (336 problems); nothing is non-finite; fp64 autograd gives Σⱼ dSᵢⱼ =
    +dLSEᵢ·Σⱼ Pᵢⱼ (to 3e-14), and dropping that term (_sum0) costs 5-6e5x in dq.
  * dq: near_tied 1.00-1.14 (1.17) under every feature (PyTorch >= 150x above; under dropout its fp32
    math sits at `round`, as do both); random, key_bias <= 1.28; peaked 1.44-1.58 (1.81); one-hot
    0.92-1.71 (5.2). dk <= 1.21 but on one-hot (2.4).
  * One-hot tail (--quick --seeds 8, base, bf16 seed 6): stored dq 1.2e-2, dk 1.3e-2 against
    `stable`'s 1.7e-3, 2.2e-3 (`round` 1.6e-3, PyTorch 7e-2); with dropout 8.5x (dk 5.3x), 7x
    PyTorch's fp32 math. It is residual's Δ error (fp32_o's): no k̄ removes it, and dk has no k̄.
  * k̄: the head mean is within 7 % of the row mean while the keys' shared part is fixed, and within
    12 % on the causal rows that see few keys (dq64: the first 64 rows). A shared part that moves with
    position defeats any fixed k̄: near_tied_drift 2.1-3.1 (3.7), causal 4.7-6.9 (8.6), its first
    64 rows 7-32x (60) where the row mean gives 1.0; near_tied_rope 2.5-3.5 (3.9), row mean 2.7-3.1.
    blk0 is worse than head but on causal drift. Causal one-hot dq64 (up to 1e4x) is an fp32 residue
    on rows whose true dq is 1e-7 of the tensor's, which exact_kernel cancels; PyTorch has it too.
  * Verdict: residual_ctr is safe under every feature (correct, finite, exact zeros) but is not
    `stable`'s equal: 3-9x on RoPE'd or drifting keys and in bf16 one-hot tails.
  * blk64_kernel / blk16_kernel (`stable` with K̄ replaced by key-block means, no GEMM;
    ..._20261201_block-centres.json in git history at 79cc50f, --quick --seeds 4, base/causal/dlse/gqa): as good as `stable`
    on near_tied and drifting keys (1.00-1.12; blk16 1.01), but 4.5-6x on peaked, 5-8x on RoPE'd
    keys and 3-18x on one-hot: with FA2's Δ the Δ error meets each attended key's distance from its
    block's mean, which only K̄ itself cancels. Closed.
  * One pass ('one_pass' in the results file, 2026-12-02, --quick; base 3 seeds, features 2).
    p32_res64 takes fp32_o_p32's Δ (a forward whose P·V sees P exactly: the Gluon forward's
    SPLIT_P, tried on the H200 and retired, docs/hopper_backward.md) and compensates dS's rounding per 64-key block, dq += Σ_b (σ_b − σ̃_b)·k̄_b
    (rounding_residual_dq; p32_res128 per 128). Against exact_kernel, median (max): dk 1.00 in
    every case and feature (0.87-1.00); dq random 1.03-1.19, near_tied 1.00-1.11 in bf16 and
    1.41-1.64 in fp16, drift 0.52-0.69 (128: 1.05-1.12), RoPE 1.8-2.0 (2.0), peaked 1.3-1.6,
    one-hot 0.7-2.7 (4.2 with dLSE, where PyTorch is 717x); fully masked rows exact zeros,
    nothing non-finite. Below PyTorch's same-dtype error everywhere but fp16 near_tied under
    dropout (1.16x PyTorch's fp32-inside math backend). The exact Δ alone (fp32_o_p32, no
    compensation) is 100-900x `stable` on near-tied dq: the dS rounding meets the keys' shared
    component unless something takes it out.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import itertools
import json
import math
import pathlib
import sys
import time
import types

import torch
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parents[2]
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
BLOCK_N = 64  # the forward's key block: where its online softmax rescales (and P is rounded)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
VARIANTS = ("fa2", "exact", "residual", "fp32_o", "fp32_o_p32", "exact_kernel", "fa2_ctr", "residual_ctr",
            "blk64_kernel", "blk16_kernel", "p32_ctr", "p32_res64", "p32_res128")
# Under the features, ds16 only: `stable` today, the GEMM-free candidates, and residual_ctr's k̄ options.
FEATURE_VARIANTS = ("fa2", "exact_kernel", "residual", "fa2_ctr", "residual_ctr", "residual_ctr_row",
                    "residual_ctr_blk0", "residual_ctr_sum0", "blk64_kernel", "blk16_kernel", "fp32_o_p32",
                    "p32_res64", "p32_res128")
BLOCK_CENTRES = (64, 16)  # blkN_kernel: key-block widths whose mean keys stand in for K̄ (see block_centred_dq)
# Options of the emulated attention, applied alike to the fp64 truth, PyTorch and every variant.
# "all" folds causal into the bool mask (SDPA takes one or the other).
FEATURES = {"base": {}, "causal": dict(causal=True), "bool_dead": dict(mask="bool"),
            "additive": dict(mask="additive"), "gqa": dict(group=2), "dropout": dict(dropout=0.1),
            "dlse": dict(dlse=True), "all": dict(causal=True, mask="bool", group=2, dropout=0.1, dlse=True)}
DEAD_EVERY = 16  # bool masks hide every 16th query row from every key
QUICK_FEATURE_CASES = ("random", "near_tied", "onehot_scale_1e2", "peaked")  # --quick: features on these only


def _load_cases():
    """flash_inductor/stability/cases.py by path: the package would import Triton (seconds, unneeded)."""
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


def _near_tied_drift(dtype, device, sz, gen):
    """near_tied whose shared key drifts along the sequence by t·d (t = j/S, |d_e| ~ 5, a tenth of
    the shared part): under causal masking early rows see keys far from the head's mean key."""
    p = CASES._near_tied(dtype, device, sz, gen)
    t = torch.arange(sz.seq, dtype=torch.float32)[:, None] / sz.seq
    p.key = (p.key.float() + t * torch.randn((sz.batch, sz.heads, 1, sz.head_dim), generator=gen) * 5.0).to(dtype)
    return p


def _near_tied_rope(dtype, device, sz, gen):
    """near_tied with rotary embeddings (base 1e4) on q and k, as LLMs apply them: the keys' shared
    part now turns with position, fast in some dimensions, so no fixed k̄ holds it all."""
    p = CASES._near_tied(dtype, device, sz, gen)
    half = sz.head_dim // 2
    angle = torch.arange(sz.seq, dtype=torch.float64)[:, None] * 1e4 ** (-torch.arange(half) / half)
    cos, sin = angle.cos(), angle.sin()
    for name in ("query", "key"):
        a, b = getattr(p, name).double().split(half, -1)
        setattr(p, name, torch.cat([a * cos - b * sin, a * sin + b * cos], -1).to(dtype))
    return p


def case_builders():
    """name -> build(dtype, device, sizes, generator) -> Problem: the repo's cases that stress Δ, and ours."""
    repo = {c.name: c.build for c in CASES.all_cases(CASES.QUICK)}
    return {"random": repo["qk_x1"], "near_tied": repo["near_tied"], "onehot_scale_1e2": repo["scale_1e2"],
            "peaked": _peaked, "key_bias": _key_bias, "near_tied_drift": _near_tied_drift,
            "near_tied_rope": _near_tied_rope}


# ---- One problem with its features
class Attn(types.SimpleNamespace):
    """16-bit q, do (B, Hq, L, E), k, v (B, Hkv, S, E) (query head h reads K/V head h // group), scale;
    bias: the fp32 additive mask (-inf = invisible; bool and causal masks too) that the emulation and
    the truth add to the scaled scores, sdpa_mask/causal: SDPA's form of it; keep: dropout's fixed
    keep mask; dlse: the LSE's gradient, 16-bit representable (PyTorch's LSE is 16-bit)."""
    group, bias, sdpa_mask, causal, keep, dropout, dlse = 1, None, None, False, None, 0.0, None
    keep_scale = property(lambda self: 1.0 / (1.0 - self.dropout))

    def visible(self):
        full = torch.ones((*self.q.shape[:-1], self.k.shape[-2]), dtype=torch.bool)
        return full if self.bias is None else full & torch.isfinite(self.bias)


def make_problem(build, dtype, sizes, seed, feat):
    group = feat.get("group", 1)
    p = build(dtype, "cpu", dataclasses.replace(sizes, heads=sizes.heads * group), torch.Generator().manual_seed(seed))
    # GQA: the case's K/V heads 0, group, 2·group, ... (each case draws its keys per head).
    x = Attn(q=p.query, k=p.key[:, ::group], v=p.value[:, ::group], do=p.grad_out, group=group,
             scale=p.scale if p.scale is not None else 1.0 / math.sqrt(p.query.shape[-1]))
    gen = torch.Generator().manual_seed(1000 + seed)  # the features' own draws leave the case's alone
    (b, h, n, _), inf = p.query.shape, float("inf")
    shape = (b, h, n, n)
    tril = torch.ones(n, n, dtype=torch.bool).tril()  # top-left causal, L = S
    if feat.get("mask") == "bool":
        m = torch.rand(shape, generator=gen) < 0.9
        m[..., ::DEAD_EVERY, :] = False  # fully masked rows: their gradients must be exactly 0
        if feat.get("causal"):
            m &= tril
        x.sdpa_mask, x.bias = m, torch.zeros(shape).masked_fill(~m, -inf)
    elif feat.get("mask") == "additive":
        am = (torch.randn(shape, generator=gen) * 2.0).to(dtype)
        am[torch.rand(shape, generator=gen) < 0.2] = -inf
        x.sdpa_mask, x.bias = am, am.float()
    elif feat.get("causal"):
        x.causal, x.bias = True, torch.zeros(n, n).masked_fill(~tril, -inf).expand(shape)
    if feat.get("dropout"):
        x.dropout, x.keep = feat["dropout"], torch.rand(shape, generator=gen) >= feat["dropout"]
    if feat.get("dlse"):
        # Rows that see no key have LSE -inf, a constant: no caller differentiates it, so dLSE = 0 there.
        x.dlse = torch.randn((b, h, n), generator=gen).to(dtype).float() * x.visible().any(-1)
    return x


def expand(t, group):
    """K/V head per query head (GQA)."""
    return t.repeat_interleave(group, dim=1) if group > 1 else t


def fold(t, group):
    """dK, dV per query head summed over each K/V head's group (as the dK/dV pass does, in fp32)."""
    return t.unflatten(1, (-1, group)).sum(2) if group > 1 else t


# ---- Float64 truth and PyTorch's same-dtype baseline
def truth_fp64(x):
    """Float64 autograd of (out, lse), every feature included; rows that see no key: P = 0, out = 0,
    lse = -inf, no gradient. Also max|Σⱼ dSᵢⱼ − dLSEᵢ·Σⱼ Pᵢⱼ| / max|dS| (dS = ∂loss/∂sᵢⱼ, P undropped):
    the identity behind *_ctr."""
    q, k, v = (t.double().requires_grad_() for t in (x.q, x.k, x.v))
    s = (q @ expand(k, x.group).transpose(-2, -1)) * x.scale
    s = s if x.bias is None else s + x.bias.double()
    s.retain_grad()
    m = s.detach().amax(-1, keepdim=True).nan_to_num(0.0, neginf=0.0)  # rows that see no key: 0
    l = torch.exp(s - m).sum(-1, keepdim=True)
    live = l > 0
    p = torch.exp(s - m) / torch.where(live, l, 1.0)
    out = (p if x.keep is None else p * x.keep * x.keep_scale) @ expand(v, x.group).double()
    outs, grads = [out], [x.do.double()]
    if x.dlse is not None:
        outs.append(torch.where(live, m + torch.log(torch.where(live, l, 1.0)), -math.inf).squeeze(-1))
        grads.append(x.dlse.double())
    torch.autograd.backward(outs, grads)
    want = 0.0 if x.dlse is None else x.dlse.double() * p.detach().sum(-1)
    rowsum_err = ((s.grad.sum(-1) - want).abs().max() / s.grad.abs().max()).item()
    return dict(dq=q.grad, dk=k.grad, dv=v.grad), rowsum_err


def torch_same_dtype(x):
    """PyTorch, 16-bit in and out: CPU SDPA + autograd. With dropout, the math backend CPU SDPA then
    runs (fp32 inside), given our keep mask and an additive mask. SDPA cannot differentiate its LSE:
    dLSE goes through torch.logsumexp of the 16-bit scores, as a PyTorch user would write it."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (x.q, x.k, x.v))
    kw = dict(attn_mask=x.sdpa_mask, is_causal=x.causal, scale=x.scale, enable_gqa=x.group > 1)
    if x.keep is None:
        out = F.scaled_dot_product_attention(q, k, v, **kw)
    else:
        kw["attn_mask"] = None if x.bias is None or x.causal else x.bias.to(q.dtype)
        out = torch.ops.aten._scaled_dot_product_attention_math(q, k, v, dropout_p=x.dropout, dropout_mask=x.keep,
                                                                **kw)[0]
    outs, grads = [out], [x.do]
    if x.dlse is not None:
        s = (q @ expand(k, x.group).transpose(-2, -1)) * x.scale
        s = s if x.bias is None else s + x.bias.to(q.dtype)
        outs.append(torch.logsumexp(s.masked_fill(~x.visible().any(-1, keepdim=True), 0.0), -1))
        grads.append(x.dlse.to(q.dtype))
    torch.autograd.backward(outs, grads)
    return dict(dq=q.grad, dk=k.grad, dv=v.grad)


# ---- The kernels' arithmetic, emulated (k, v below are per query head: expand()ed)
def scores_log2(x, k):
    """S·scale·log2(e) in fp32 from 16-bit operands (fp32 accumulate), plus the mask·log2(e), as
    both kernels form it (an invisible key's -inf survives both)."""
    s2 = (x.q.float() @ k.float().transpose(-2, -1)) * torch.tensor(x.scale * LOG2E, dtype=torch.float32)
    return s2 if x.bias is None else s2 + x.bias * LOG2E


def forward(x, p_dtype=None):
    """attn_fwd.py: online softmax over key blocks, P rounded to the input dtype (or `p_dtype`) for
    P·V, dropped there only; O summed in fp32, divided by l (the unrounded, undropped P's fp32 sum),
    times 1/(1-p). A row with no key yet uses a max of 0; with none at all, O = 0, LSE = -inf."""
    k, v = expand(x.k, x.group).float(), expand(x.v, x.group)
    p_dtype = p_dtype or x.q.dtype
    s2 = scores_log2(x, k)
    m = torch.full(s2.shape[:-1], float("-inf"))
    l = torch.zeros(s2.shape[:-1])
    acc = torch.zeros((*s2.shape[:-1], v.shape[-1]))
    for start in range(0, s2.shape[-1], BLOCK_N):
        block = s2[..., start:start + BLOCK_N]
        m_new = torch.maximum(m, block.amax(-1))
        m_ref = torch.where(m_new == float("-inf"), 0.0, m_new)
        alpha = torch.exp2(m - m_ref)
        p = torch.exp2(block - m_ref[..., None])
        l = l * alpha + p.sum(-1)
        if x.keep is not None:
            p = p * x.keep[..., start:start + BLOCK_N]
        acc = acc * alpha[..., None] + p.to(p_dtype).float() @ v[..., start:start + BLOCK_N, :].float()
        m = m_new
    empty = l == 0
    l_safe = torch.where(empty, 1.0, l)
    lse = torch.where(empty, float("-inf"), (m + torch.log2(l_safe)) * LN2)
    return acc * (x.keep_scale / l_safe)[..., None], lse


def recompute(x, lse):
    """The backward's fp32 P from the LSE (0 where LSE = -inf) and dP = dO·Vᵀ (fp32 accumulate),
    dropped and scaled by 1/(1-p) as attn_bwd.py does: dS = P∘(dP − Δ) needs no other dropout term."""
    k, v = expand(x.k, x.group), expand(x.v, x.group)
    ref = torch.where(torch.isfinite(lse), lse * LOG2E, float("inf"))
    p = torch.exp2(scores_log2(x, k) - ref[..., None])
    dp = x.do.float() @ v.float().transpose(-2, -1)
    if x.keep is not None:
        dp = torch.where(x.keep, dp * x.keep_scale, 0.0)
    return p, dp


def deltas(o32, o32_p32, do, p, dp, dlse):
    """Each candidate Δ, in fp32 (o32_p32: O_fp32 of a forward that keeps P in fp32; None skips
    it). Δ = rowsum(dO∘O) − dLSE for all of them (attn_bwd.py: ∂lseᵢ/∂sᵢⱼ = Pᵢⱼ)."""
    dtype, dof = do.dtype, do.float()
    o16 = o32.to(dtype)
    residual = (o32 - o16.float()).to(dtype)
    lam = p.sum(-1)  # Λ; 0 on rows that see no key, whose Δ is then irrelevant (P = 0)
    out = dict(fa2=(dof * o16.float()).sum(-1), exact=(p * dp).sum(-1) / torch.where(lam > 0, lam, 1.0),
               residual=(dof * (o16.float() + residual.float())).sum(-1), fp32_o=(dof * o32).sum(-1))
    if o32_p32 is not None:
        out["fp32_o_p32"] = (dof * o32_p32).sum(-1)
    return out if dlse is None else {name: d - dlse for name, d in out.items()}


def ds_rounder(x):
    """dS as the matrix unit sees it under `ds16`. For fp16 the kernels first scale dS up by
    2^floor(log2(2^14 / B)), B = 2·keep_scale·max‖dO‖·max‖V‖ + max|dLSE| (launch.backward.measure_ds_bound), so
    small dS does not land in fp16's subnormals; the power of two is exact, so we scale back."""
    if x.q.dtype != torch.float16:
        return lambda ds: ds.to(x.q.dtype).float()
    bound = 2.0 * x.keep_scale * x.do.float().norm(dim=-1).max().item() * x.v.float().norm(dim=-1).max().item()
    bound += 0.0 if x.dlse is None else x.dlse.abs().max().item()
    up = 2.0 ** min(40, max(0, math.floor(math.log2(16384.0 / bound))))
    return lambda ds: (ds * up).to(torch.float16).float() / up


def kbars(x, k):
    """Reference keys for *_ctr, per query head (so per K/V head under GQA): `head`, the head's mean
    key (one vector per head); `row`, the mean of the keys row i sees (a prefix mean under causal
    masking, but a mask·K GEMM for a general mask); `blk0`, the mean of the first key block."""
    vis = x.visible().float()
    return dict(head=k.float().mean(-2, keepdim=True),
                row=(vis @ k.float()) / vis.sum(-1, keepdim=True).clamp(min=1.0),
                blk0=k[..., :BLOCK_N, :].float().mean(-2, keepdim=True))


def grads(p, dp, delta, q, k, scale, rounder=None, kbar=None, true_sum=0.0):
    """dq, dk (fp32, unrounded; dk per query head) from dS = P∘(dP − Δ); dS rounded by `rounder` if
    given. With `kbar`, dq −= (σ̃ᵢ − tᵢ)·k̄: σ̃ the row sum of dS as used, tᵢ = dLSEᵢ·Λᵢ its true
    value (0 without dLSE). Exact for any fixed k̄, since Σⱼ dSᵢⱼ = tᵢ; it leaves Δ's and dS's
    rounding errors meeting kⱼ − k̄ instead of kⱼ; GEMM-free (a row sum and one vector per head)."""
    ds = p * (dp - delta[..., None])
    if rounder is not None:
        ds = rounder(ds)
    dq = ds @ k.float()
    if kbar is not None:
        dq = dq - (ds.sum(-1) - true_sum)[..., None] * kbar
    return dict(dq=scale * dq, dk=scale * ds.transpose(-2, -1) @ q.float())


def stable_kernel_dq(p, dp, delta_fa2, k, scale, rounder, dlse, k_weighted=None):
    """`stable`'s dQ pass with rounded dS: Σⱼ dS̃ᵢⱼ kⱼ − (σ̃ᵢ/Λᵢ − dLSEᵢ)·K̄ᵢ, K̄ᵢ = Σⱼ round(Pᵢⱼ) kⱼ
    unless `k_weighted` stands in for it, dS̃ the rounded fa2 dS and σ̃ its row sum (0 correction
    where Λ = 0), so the rounding's common part leaves dq along with Δ's error."""
    ds = rounder(p * (dp - delta_fa2[..., None]))
    lam = p.sum(-1)
    c = ds.sum(-1) / torch.where(lam > 0, lam, 1.0) - (0.0 if dlse is None else dlse)
    c = torch.where(lam > 0, c, 0.0)
    if k_weighted is None:
        k_weighted = p.to(k.dtype).float() @ k.float()
    return scale * (ds @ k.float() - c[..., None] * k_weighted)


def rounding_residual_dq(p, dp, delta, k, scale, rounder, width):
    """A one-pass kernel's dq with an exact Δ (``delta``, e.g. fp32_o_p32's) and dS rounded: each
    key block of `width` keys (a CTA's keys) adds Σⱼ dS̃ᵢⱼ kⱼ from the matrix unit plus
    (σᵢ_b − σ̃ᵢ_b)·k̄_b, the fp32 row sums of dS and of dS as rounded over the block times the
    block's mean key. The sum is Σⱼ dSᵢⱼ kⱼ + Σⱼ eᵢⱼ (kⱼ − k̄_b(j)): dS's rounding error meets only
    the keys' spread inside their block. No GEMM, no assumption on Σⱼ dSᵢⱼ (masks, dropout and
    dLSE need nothing more), and every term is local to the block, so it fits one pass."""
    seq_k = k.shape[-2]
    assert seq_k % width == 0, "rounding_residual_dq: S must be a multiple of the block width"
    ds = p * (dp - delta[..., None])
    ds_r = rounder(ds)
    blocks = (seq_k // width, width)
    missed = ds.unflatten(-1, blocks).sum(-1) - ds_r.unflatten(-1, blocks).sum(-1)
    k_means = k.float().unflatten(-2, blocks).mean(-2)
    return scale * (ds_r @ k.float() + missed @ k_means)


def block_centred_dq(p, dp, delta_fa2, k, scale, rounder, dlse, width):
    """`stable`'s dQ pass with its P·K GEMM replaced by block means: K̄ᵢ = Σⱼ Pᵢⱼ kⱼ becomes
    Gᵢ = Σ_b Λᵢ_b k̄_b, Λᵢ_b the row's P summed over key block b (`width` keys) and k̄_b that block's
    mean key (fp32). The correction stays exact for the shared component, since Σⱼ dSᵢⱼ = dLSEᵢΛᵢ:
    what is left is Δ's error times Σⱼ Pᵢⱼ (kⱼ − k̄_b(j)), the keys' spread inside their block, and
    dS's rounding times kⱼ − Gᵢ/Λᵢ. In a kernel: one row sum of P per sub-block and a rank-1
    (or rank-BLOCK_N/width) update per tile, no GEMM."""
    seq_k = k.shape[-2]
    assert seq_k % width == 0, "block_centred_dq: S must be a multiple of the block width"
    k_means = k.float().unflatten(-2, (seq_k // width, width)).mean(-2)
    lam_blocks = p.unflatten(-1, (seq_k // width, width)).sum(-1)
    return stable_kernel_dq(p, dp, delta_fa2, k, scale, rounder, dlse, k_weighted=lam_blocks @ k_means)


# ---- One problem, every variant
def rel_l2(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


def metrics(result, ref, dtype):
    """g: error of our fp32 result; g_stored: after the kernels' final cast to the input dtype;
    dq_first64: dq's rows < 64 only (under causal masking those see at most 64 keys)."""
    out = {}
    for g, x in result.items():
        out[g], out[f"{g}_stored"] = rel_l2(x, ref[g]), rel_l2(x.to(dtype), ref[g])
    err64 = (result["dq"][..., :BLOCK_N, :].double() - ref["dq"][..., :BLOCK_N, :]).norm()
    out["dq_first64"] = (err64 / ref["dq"][..., :BLOCK_N, :].norm()).item()
    out["dq_first64_of_all"] = (err64 / ref["dq"].norm()).item()  # those rows' share of the whole error
    return out


def variant_grads(x, p, dp, cand, k, rounder, centres, true_sum):
    """Every variant's dq, dk (dk summed per K/V head), dS rounded by `rounder` (None: kept fp32)."""
    ctr = dict(fa2_ctr=("fa2", "head", true_sum), residual_ctr=("residual", "head", true_sum),
               residual_ctr_row=("residual", "row", true_sum), residual_ctr_blk0=("residual", "blk0", true_sum))
    if x.dlse is not None:  # diagnostic: the correction as if Σⱼ dSᵢⱼ were still 0
        ctr["residual_ctr_sum0"] = ("residual", "head", 0.0)
    res = {name: grads(p, dp, delta, x.q, k, x.scale, rounder) for name, delta in cand.items()}
    res.update({name: grads(p, dp, cand[d], x.q, k, x.scale, rounder, centres[c], t)
                for name, (d, c, t) in ctr.items()})
    if rounder is not None:  # `stable` as it runs, dS rounded
        res["exact_kernel"] = dict(dq=stable_kernel_dq(p, dp, cand["fa2"], k, x.scale, rounder, x.dlse),
                                   dk=res["exact"]["dk"])
        for width in BLOCK_CENTRES:  # dK/dV get `stable`'s Δ* (from σ, unchanged)
            res[f"blk{width}_kernel"] = dict(
                dq=block_centred_dq(p, dp, cand["fa2"], k, x.scale, rounder, x.dlse, width), dk=res["exact"]["dk"])
        if "fp32_o_p32" in cand:  # one pass: Δ* from a forward that keeps P exact for P·V
            res["p32_ctr"] = grads(p, dp, cand["fp32_o_p32"], x.q, k, x.scale, rounder, centres["head"], true_sum)
            for width in (64, 128):
                res[f"p32_res{width}"] = dict(dq=rounding_residual_dq(p, dp, cand["fp32_o_p32"], k, x.scale, rounder,
                                                                      width), dk=res["fp32_o_p32"]["dk"])
    return {name: dict(dq=r["dq"], dk=fold(r["dk"], x.group)) for name, r in res.items()}


def run_problem(x, full=True):
    """`full` (the base feature): also the fp32-dS mode, a diagnostic of the Δ study."""
    dtype, g = x.q.dtype, x.group
    ref, rowsum_err = truth_fp64(x)
    base = torch_same_dtype(x)
    k = expand(x.k, g)
    o32, lse = forward(x)
    p, dp = recompute(x, lse)
    cand = deltas(o32, forward(x, torch.float32)[0], x.do, p, dp, x.dlse)
    p_used = p if x.keep is None else p * x.keep * x.keep_scale
    dv = fold(p_used.to(dtype).float().transpose(-2, -1) @ x.do.float(), g)  # Pᵀ·dO, P rounded; no Δ in it
    true_sum = 0.0 if x.dlse is None else x.dlse * p.sum(-1)
    dead = ~x.visible().any(-1)
    out = dict(torch=metrics(base, ref, dtype), round_ref=metrics({n: t.to(dtype) for n, t in ref.items()}, ref, dtype),
               dv=rel_l2(dv, ref["dv"]), max_p=p.amax(-1).mean().item(), truth_rowsum_err=rowsum_err,
               dead_rows=int(dead.sum()), modes={}, nonfinite=[])
    if dead.any():  # exact zeros: forward, truth, PyTorch and (below) every variant's dq
        out["dead_rows_zero"] = dict(forward=bool((o32[dead] == 0).all()), truth=bool((ref["dq"][dead] == 0).all()),
                                     torch=bool((base["dq"][dead] == 0).all()))
    centres, rounder = kbars(x, k), ds_rounder(x)
    for mode, rnd in (("fp32", None), ("ds16", rounder)) if full else (("ds16", rounder),):
        res = variant_grads(x, p, dp, cand, k, rnd, centres, true_sum)
        out["modes"][mode] = {name: metrics(r, ref, dtype) for name, r in res.items()}
        out["nonfinite"] += [f"{mode}:{n}" for n, r in res.items() if not all(t.isfinite().all() for t in r.values())]
        if dead.any():
            out["dead_rows_zero"].update({f"{mode}:{n}": bool((r["dq"][dead] == 0).all()) for n, r in res.items()})
    return out


def run(cases, features, dtypes, seqs, head_dims, seeds, heads, quick=False):
    rows = []
    for fname, (name, build), seq, e, dname, seed in itertools.product(
            features, case_builders().items(), seqs, head_dims, dtypes, seeds):
        if name in (cases or (QUICK_FEATURE_CASES if quick and fname != "base" else [name])):
            sizes = CASES.Sizes(batch=1, heads=heads, seq=seq, head_dim=e, long_seqs=(), long_heads=1, slice_rows=seq)
            x = make_problem(build, DTYPES[dname], sizes, seed, FEATURES[fname])
            rows.append(dict(feature=fname, case=name, seq=seq, head_dim=e, dtype=dname, seed=seed,
                             **run_problem(x, full=fname == "base")))
    return rows


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else 0.5 * (xs[len(xs) // 2 - 1] + xs[len(xs) // 2])


def _groups(rows, fields):
    keys = sorted({tuple(r[f] for f in fields) for r in rows}, key=lambda k: tuple(map(str, k)))
    return [(key, [r for r in rows if tuple(r[f] for f in fields) == key]) for key in keys]


def print_table(rows, grad, variants, fields):
    """One line per group × dS mode: each variant's error (median over the group's rows: seeds, and
    shapes unless `fields` names them) and, in brackets, its ratio to PyTorch's same-dtype error."""
    if not rows:
        return
    print(f"\n{grad}: relative L2 error vs fp64 (median) [x PyTorch same-dtype error]")
    print("".join(f"{f:<17}" for f in fields) + f"{'dS':<5}{'torch':>9}{'round':>9}"
          + "".join(f"{n:>19}" for n in variants))
    for key, group in _groups(rows, fields):
        torch_err = _median([r["torch"][grad] for r in group])
        for mode in group[0]["modes"]:
            cells = []
            for n in variants:
                err = _median([r["modes"][mode][n][grad] for r in group]) if n in group[0]["modes"][mode] else None
                cells.append(f"{'-':>19}" if err is None else f"{err:>11.2e} [{err / torch_err:5.2f}]")
            print("".join(f"{str(k):<17}" for k in key) + f"{mode:<5}{torch_err:>9.2e}"
                  f"{_median([r['round_ref'][grad] for r in group]):>9.2e}" + "".join(cells))


def print_verdict(rows):
    """The decision: residual_ctr (k̄ = head mean unless named) / exact_kernel, ds16, unrounded,
    median (max) over seeds and shapes; dq64 = dq's first 64 rows, shown under causal masking only
    (elsewhere they are not special); sum0 = residual_ctr ignoring dLSE. Then the exact checks."""
    ratios = (("dq", "residual_ctr", "dq"), ("dk", "residual_ctr", "dk"), ("dq row", "residual_ctr_row", "dq"),
              ("dq blk0", "residual_ctr_blk0", "dq"), ("dq64", "residual_ctr", "dq_first64"),
              ("dq64 row", "residual_ctr_row", "dq_first64"), ("dq64/torch", "residual_ctr", "dq_first64"),
              ("sum0 dq", "residual_ctr_sum0", "dq"), ("blk64 dq", "blk64_kernel", "dq"),
              ("blk16 dq", "blk16_kernel", "dq"), ("blk64 dq64", "blk64_kernel", "dq_first64"))
    print("\nresidual_ctr / exact_kernel error, ds16: median (max) over seeds and shapes")
    print(f"{'feature':<10}{'case':<17}{'dtype':<6}" + "".join(f"{label:>16}" for label, _, _ in ratios))
    for key, group in _groups(rows, ("feature", "case", "dtype")):
        cells = []
        for label, n, g in ratios:
            if n not in group[0]["modes"]["ds16"] or (g == "dq_first64" and not FEATURES[key[0]].get("causal")):
                cells.append(f"{'-':>16}")
                continue
            x = [r["modes"]["ds16"][n][g] / (r["torch"] if "torch" in label else r["modes"]["ds16"]["exact_kernel"])[g]
                 for r in group]
            cells.append(f"{_median(x):>8.2f} ({max(x):5.2f})")
        print(f"{key[0]:<10}{key[1]:<17}{key[2]:<6}" + "".join(cells))
    dead = [r for r in rows if "dead_rows_zero" in r]
    nonfinite = sorted({n for r in rows for n in r["nonfinite"]}) or "none"
    # Only the bool_dead and all features hide rows: without them there is nothing to check.
    zeros = (f"{all(all(r['dead_rows_zero'].values()) for r in dead)} ({len(dead)} problems)" if dead
             else "not checked (no feature with fully masked rows ran)")
    print(f"\nfully masked rows exactly 0 everywhere: {zeros}; non-finite gradients: {nonfinite}; "
          f"fp64 Σⱼ dSᵢⱼ = dLSEᵢ·Σⱼ Pᵢⱼ to {max(r['truth_rowsum_err'] for r in rows):.1e} (x max|dS|)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="L=S=256, E=64, 2 seeds (CI size)")
    parser.add_argument("--out", help="write the JSON record here")
    parser.add_argument("--cases", help="comma-separated case names (default: all)")
    parser.add_argument("--features", help=f"comma-separated feature sets (default: all of {', '.join(FEATURES)})")
    parser.add_argument("--seeds", type=int, help="seeds 0..N-1 (default: 2 with --quick, else 3)")
    args = parser.parse_args(argv)
    cases = set(args.cases.split(",")) if args.cases else None
    features = args.features.split(",") if args.features else list(FEATURES)
    for flag, asked, known in (("--cases", cases or set(), case_builders()), ("--features", features, FEATURES)):
        if not set(asked) <= set(known):
            parser.error(f"{flag}: unknown {sorted(set(asked) - set(known))}; known: {list(known)}")
    config = dict(seqs=(256,), head_dims=(64,), seeds=(0, 1), heads=2) if args.quick else \
        dict(seqs=(256, 1024), head_dims=(64, 128), seeds=(0, 1, 2), heads=2)
    config["seeds"] = tuple(range(args.seeds)) if args.seeds else config["seeds"]
    start = time.time()
    rows = run(cases, features, tuple(DTYPES), **config, quick=args.quick)
    for grad in ("dq", "dk"):
        print_table([r for r in rows if r["feature"] == "base"], grad, VARIANTS, ("case", "seq", "head_dim", "dtype"))
        print_table([r for r in rows if r["feature"] != "base"], grad, FEATURE_VARIANTS, ("feature", "case", "dtype"))
    print_verdict(rows)
    print(f"\ndv (no Δ in it): median error / PyTorch's = "
          f"{_median([r['dv'] / r['torch']['dv'] for r in rows]):.2f}; {time.time() - start:.1f} s")
    if args.out:
        header = dict(experiment="delta_variants", torch=torch.__version__, quick=args.quick, features=features,
                      block_n=BLOCK_N, argv=sys.argv[1:], **{k: list(v) if isinstance(v, tuple) else v
                                                             for k, v in config.items()})
        pathlib.Path(args.out).write_text(json.dumps(dict(header=header, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
