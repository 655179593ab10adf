"""Soft-capping in the Triton kernels (``SOFTCAP``), launched directly: forward and backward
against the float64 definition, ``c * tanh(scale * q.k / c)`` then the mask, with the same formula
in the input dtype as PyTorch's baseline (helpers.assert_close_to_ref). Under the interpreter on
CPU (fp16, fp32) and on the GPU (bf16 too). Every schedule, masks (bool, float with its gradient),
causal, GQA, dropout, the LSE's own gradient, and logits large enough for the cap to saturate."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import assert_close_to_ref, dropout_keep, launch_visibility, make_mask, make_qkv, randn
from variant_refs import term_magnitudes

from flash_inductor import launch

pytestmark = pytest.mark.launches_kernels


def capped_attention(q, k, v, mask, *, scale, softcap, causal_offset=None, keep=None, dropout_p=0.0):
    """(out, lse) by the definition, in q's dtype: scores soft-capped, then the mask, softmax,
    dropout, times V. A row that sees no key gives 0 and lse -inf."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = softcap * torch.tanh((q @ k.transpose(-1, -2)) * scale / softcap)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.to(s.dtype)
    if causal_offset is not None:
        i = torch.arange(q.shape[2], device=q.device)[:, None]
        j = torch.arange(k.shape[2], device=q.device)[None, :]
        s = s.masked_fill(j > i + causal_offset, float("-inf"))
    lse = torch.logsumexp(s.float() if s.dtype != torch.float64 else s, dim=-1)
    p = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)
    if keep is not None:
        p = p * keep.to(p.dtype) / (1 - dropout_p)
    return p @ v, lse


CASES = {
    "plain": dict(),
    "causal_gqa": dict(heads_q=4, heads_kv=2, causal_offset=0),
    "bool_mask_dead_rows": dict(mask="bool_dead_rows"),
    "float_mask_grad": dict(mask="float", mask_grad=True),
    "dropout": dict(dropout_p=0.2),
    "lse_grad": dict(grad_lse=True),
    "saturated": dict(mult=6.0, softcap=5.0),  # |scale q.k| up to ~100 against a cap of 5
}


@pytest.mark.parametrize("schedule", ["fast", "stable", "accurate"])
@pytest.mark.parametrize("name", list(CASES))
def test_softcap_kernels_match_fp64(name, schedule, kernel_dtype, device):
    case = CASES[name]
    if kernel_dtype == torch.float32 and schedule != "stable":
        pytest.skip("fp32 launches the same kernels under every schedule (ieee dots, nothing rounded to 16 bits, no exact-delta pass): run under stable")
    batch, heads_q, heads_kv, seq_q, seq_k, dim = 2, case.get("heads_q", 2), case.get("heads_kv", 2), 37, 45, 32
    softcap, mult = case.get("softcap", 5.0), case.get("mult", 1.0)  # |s| up to ~4 against 5: tanh bends
    # Drawn in the kernels' dtype: the fp64 truth is of the very inputs the kernels read.
    q, k, v = make_qkv(batch, heads_q, heads_kv, seq_q, seq_k, dim, dim, kernel_dtype, device, seed=3,
                       q_mult=mult, k_mult=mult)
    mask_kind = case.get("mask", "none")
    mask = make_mask(mask_kind, batch, heads_q, seq_q, seq_k, kernel_dtype, device, seed=4) \
        if mask_kind != "none" else None
    dout = randn((batch, heads_q, seq_q, dim), kernel_dtype, device, seed=5)
    dlse = randn((batch, heads_q, seq_q), torch.float32, device, seed=6) if case.get("grad_lse") else None
    scale, dropout_p, offset = dim ** -0.5, case.get("dropout_p", 0.0), case.get("causal_offset")
    rng_seed = keep = None
    if dropout_p:
        rng_seed = torch.tensor([2**40 + 7], dtype=torch.int64, device=device)
        keep = dropout_keep(2**40 + 7, batch, heads_q, seq_q, seq_k, dropout_p, device)

    def run_ours():
        qd, kd, vd, maskd = q, k, v, mask
        common = (rng_seed, dropout_p, scale, schedule)
        visibility = launch_visibility(offset)
        out, lse = launch.attention_forward(qd, kd, vd, maskd, *common, visibility=visibility, softcap=softcap)
        grads = launch.attention_backward(dout.to(kernel_dtype), qd, kd, vd, maskd, out, lse, dlse, *common,
                                          bool(case.get("mask_grad")), visibility=visibility, softcap=softcap)
        return out, lse, grads

    def run_definition(dtype):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        m = mask.to(dtype).requires_grad_() if mask is not None and mask.is_floating_point() else mask
        out, lse = capped_attention(*leaves, m, scale=scale, softcap=softcap, causal_offset=offset, keep=keep,
                                    dropout_p=dropout_p)
        loss = (out * dout.to(dtype)).sum()
        if dlse is not None:
            loss = loss + (torch.nan_to_num(lse, neginf=0.0) * dlse.to(lse.dtype)).sum()
        inputs = leaves + ([m] if case.get("mask_grad") else [])
        return out, lse, torch.autograd.grad(loss, inputs)

    out, lse, (dq, dk, dv, dmask) = run_ours()
    ref_out, ref_lse, ref_grads = run_definition(torch.float64)
    base_out, _, base_grads = run_definition(kernel_dtype)
    visible = None
    if offset is not None:
        visible = torch.ones(seq_q, seq_k, dtype=torch.bool, device=device).tril(offset)
    terms = term_magnitudes(q, k, v, dout, scale=scale, softcap=softcap, visible=visible, mask=mask,
                            dropped=None if keep is None else keep / (1 - dropout_p), grad_lse=dlse)
    assert_close_to_ref("out", out, ref_out, base_out, terms=terms["out"])
    assert_close_to_ref("lse", lse, ref_lse, None, terms=float(softcap) * 4)
    for name_, ours, ref, base in zip(("dq", "dk", "dv", "dmask"), (dq, dk, dv, dmask), ref_grads, base_grads):
        assert_close_to_ref(name_, ours, ref, base, terms=terms[name_])
    if mask_kind == "bool_dead_rows":
        dead = ~mask.any(-1).expand(batch, heads_q, seq_q)
        assert dead.any() and (out[dead] == 0).all() and lse[dead].isneginf().all() and (dq[dead] == 0).all()


def test_softcap_changes_the_result(device):
    """The switch is live: the same launch without the cap differs by more than rounding."""
    q, k, v = make_qkv(1, 2, 2, 33, 33, 16, 16, torch.float32, device, seed=1, q_mult=3.0, k_mult=3.0)
    capped, _ = launch.attention_forward(q, k, v, None, None, 0.0, 0.25, "stable", softcap=2.0)
    plain, _ = launch.attention_forward(q, k, v, None, None, 0.0, 0.25, "stable")
    assert (capped - plain).abs().max() > 1e-2


def test_softcap_tanh_is_finite_at_extremes(device):
    """Products far past the cap saturate to ±cap (exp2 overflow to inf, or 0), never NaN."""
    q = torch.full((1, 1, 16, 16), 300.0, device=device)
    k = torch.cat([torch.full((1, 1, 8, 16), 300.0), torch.full((1, 1, 8, 16), -300.0)], 2).to(device)
    v = randn((1, 1, 16, 16), torch.float32, device, seed=2)
    out, lse = launch.attention_forward(q, k, v, None, None, 0.0, 1.0, "stable", softcap=3.0)
    assert out.isfinite().all()
    # Half the keys at +cap, half at -cap: lse = log(8 e^3 + 8 e^-3).
    torch.testing.assert_close(lse, torch.full_like(lse, math.log(8 * math.exp(3) + 8 * math.exp(-3))))
