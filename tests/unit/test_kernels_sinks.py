"""Attention sinks in the Triton kernels, launched directly: the forward's epilogue (HAS_SINKS), the
backward from the (out', lse') it returns (exact Δ's renormalisation counts the sink, HAS_SINKS of the
dQ pass) and the sinks' own gradient (``launch.sinks_backward``), against the float64 definition
(a sink column in the softmax, dropped before P·V), with the same formula in the input dtype as
PyTorch's baseline (helpers.assert_close_to_ref). Under the interpreter on CPU (fp16, fp32) and on the
GPU (bf16 too). Every schedule, causal GQA, rows with no visible key, the LSE's own gradient, dropout,
the soft cap, and sinks far above and far below the row maxima."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_close_to_ref, dropout_keep, launch_visibility, make_mask, make_qkv, randn
from variant_refs import term_magnitudes

from flash_inductor import launch
from flash_inductor.ops.sinks import sinks_backward_reference

pytestmark = pytest.mark.launches_kernels


def sink_attention(q, k, v, sinks, mask, *, scale, softcap=0.0, causal_offset=None, keep=None, dropout_p=0.0):
    """(out', lse') by the definition, in q's dtype: scores (soft-capped), the mask, a sink column per
    head, softmax, the sink's column dropped, dropout, times V."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    if causal_offset is not None:
        i = torch.arange(q.shape[2], device=q.device)[:, None]
        j = torch.arange(k.shape[2], device=q.device)[None, :]
        s = s.masked_fill(j > i + causal_offset, float("-inf"))
    s = torch.cat([s, sinks.to(s.dtype)[None, :, None, None].expand(*s.shape[:-1], 1)], dim=-1)
    lse = torch.logsumexp(s.float() if s.dtype != torch.float64 else s, dim=-1)
    p = torch.softmax(s, dim=-1)[..., :-1]
    if keep is not None:
        p = p * keep.to(p.dtype) / (1 - dropout_p)
    return p @ v, lse


CASES = {
    "plain": dict(),
    "causal_gqa": dict(heads_q=4, heads_kv=2, causal_offset=0),
    "dead_rows": dict(mask="bool_dead_rows"),
    "lse_grad": dict(grad_lse=True, causal_offset=0),
    "dropout": dict(dropout_p=0.2),
    "softcap": dict(softcap=5.0, causal_offset=3),
    "sink_dominates": dict(sink_shift=12.0),  # the sink holds ~99.99 % of every row
    "sink_negligible": dict(sink_shift=-30.0),
}


@pytest.mark.parametrize("schedule", ["fast", "stable", "accurate"])
@pytest.mark.parametrize("name", list(CASES))
def test_sink_kernels_match_fp64(name, schedule, kernel_dtype, device):
    case = CASES[name]
    if kernel_dtype == torch.float32 and schedule != "stable":
        pytest.skip("fp32 launches the same kernels under every schedule: run under stable")
    batch, heads_q, heads_kv, seq_q, seq_k, dim = 2, case.get("heads_q", 2), case.get("heads_kv", 2), 37, 45, 32
    q, k, v = make_qkv(batch, heads_q, heads_kv, seq_q, seq_k, dim, dim, kernel_dtype, device, seed=3,
                       q_mult=2.0, k_mult=1.0)
    sinks = randn((heads_q,), torch.float32, device, seed=8, mult=1.5) + case.get("sink_shift", 0.0)
    mask_kind = case.get("mask", "none")
    mask = make_mask(mask_kind, batch, heads_q, seq_q, seq_k, kernel_dtype, device, seed=4) \
        if mask_kind != "none" else None
    dout = randn((batch, heads_q, seq_q, dim), kernel_dtype, device, seed=5)
    dlse = randn((batch, heads_q, seq_q), torch.float32, device, seed=6) if case.get("grad_lse") else None
    scale, dropout_p, offset = dim ** -0.5, case.get("dropout_p", 0.0), case.get("causal_offset")
    softcap = case.get("softcap", 0.0)
    rng_seed = keep = None
    if dropout_p:
        rng_seed = torch.tensor([2**40 + 7], dtype=torch.int64, device=device)
        keep = dropout_keep(2**40 + 7, batch, heads_q, seq_q, seq_k, dropout_p, device)

    common = (rng_seed, dropout_p, scale, schedule)
    visibility = launch_visibility(offset)
    out, lse = launch.attention_forward(q, k, v, mask, *common, visibility=visibility, softcap=softcap, sinks=sinks)
    dq, dk, dv, _ = launch.attention_backward(dout, q, k, v, mask, out, lse, dlse, *common, False,
                                              visibility=visibility, softcap=softcap, sinks=sinks)
    dsinks = launch.sinks_backward(dout, out, lse, dlse, sinks)

    def run_definition(dtype):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v, sinks)]
        o, l = sink_attention(*leaves, mask, scale=scale, softcap=softcap, causal_offset=offset, keep=keep,
                              dropout_p=dropout_p)
        loss = (o * dout.to(dtype)).sum()
        if dlse is not None:
            loss = loss + (l * dlse.to(l.dtype)).sum()
        return o, l, torch.autograd.grad(loss, leaves)

    ref_out, ref_lse, ref_grads = run_definition(torch.float64)
    base_out, _, base_grads = run_definition(kernel_dtype)
    visible = None
    if offset is not None:
        visible = torch.ones(seq_q, seq_k, dtype=torch.bool, device=device).tril(offset)
    terms = term_magnitudes(q, k, v, dout, scale=scale, softcap=softcap, sinks=sinks, visible=visible, mask=mask,
                            dropped=None if keep is None else keep / (1 - dropout_p), grad_lse=dlse)
    assert_close_to_ref("out", out, ref_out, base_out, terms=terms["out"])
    assert_close_to_ref("lse", lse, ref_lse, None, terms=float(ref_lse.abs().max()))
    for label, ours, ref, base in zip(("dq", "dk", "dv", "dsinks"), (dq, dk, dv, dsinks), ref_grads, base_grads):
        assert_close_to_ref(label, ours, ref, base, terms=terms[label])
    if mask_kind == "bool_dead_rows":
        dead = ~mask.any(-1).expand(batch, heads_q, seq_q)
        assert dead.any() and (out[dead] == 0).all() and (dq[dead] == 0).all()
        # The dead row's LSE is its sink exactly: its whole mass.
        assert torch.equal(lse[dead], sinks[None, :, None].expand_as(lse)[dead])


def test_sinks_change_the_forward(device):
    """The switch is live: the same launch without the sinks differs by more than rounding, and the
    sinks' gradient kernel matches the torch formula on the same (out', lse')."""
    q, k, v = make_qkv(1, 2, 2, 33, 33, 16, 16, torch.float32, device, seed=1)
    sinks = torch.tensor([0.5, 2.0], device=device)
    with_sinks, lse = launch.attention_forward(q, k, v, None, None, 0.0, 0.25, "stable", sinks=sinks)
    plain, plain_lse = launch.attention_forward(q, k, v, None, None, 0.0, 0.25, "stable")
    assert (with_sinks - plain).abs().max() > 1e-2
    torch.testing.assert_close(lse, torch.logaddexp(plain_lse, sinks[None, :, None]))
    dout = randn(with_sinks.shape, torch.float32, device, seed=2)
    dlse = randn(lse.shape, torch.float32, device, seed=3)
    torch.testing.assert_close(launch.sinks_backward(dout, with_sinks, lse, dlse, sinks),
                               sinks_backward_reference(dout, with_sinks, lse, dlse, sinks))


def test_sink_extremes_stay_finite(device):
    """A sink far above every key (exp2 of the gap would overflow fp32) or at -inf: finite outputs,
    and -inf changes nothing, as the definition says."""
    q, k, v = make_qkv(1, 2, 2, 20, 20, 16, 16, torch.float32, device, seed=4)
    plain, plain_lse = launch.attention_forward(q, k, v, None, None, 0.0, 0.25, "stable")
    far = torch.tensor([500.0, float("-inf")], device=device)
    out, lse = launch.attention_forward(q, k, v, None, None, 0.0, 0.25, "stable", sinks=far)
    assert out.isfinite().all() and (out[:, 0].abs().max() < 1e-30)
    torch.testing.assert_close(lse[:, 0], torch.full_like(lse[:, 0], 500.0))
    torch.testing.assert_close(out[:, 1], plain[:, 1])
    torch.testing.assert_close(lse[:, 1], plain_lse[:, 1])
