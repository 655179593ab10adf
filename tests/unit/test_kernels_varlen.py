"""Packed sequences in the Triton kernels (``VARLEN``), launched directly (the interpreter on CPU,
the GPU there): one launch a pass over every sequence, against each sequence alone in float64
(tests/variant_refs.py), with PyTorch's same-dtype formula as the baseline of the tolerance rule.
Causal masking at each sequence's bottom-right diagonal (and top-left), lengths that differ
between queries and keys, empty sequences, windows, GQA, soft-capping and dropout."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_close_to_ref, randn
from variant_refs import varlen_reference

from flash_inductor import launch
from flash_inductor.launch.packed import PackedSequences
from flash_inductor.launch.visibility import Visibility

pytestmark = pytest.mark.launches_kernels

LENGTHS_Q = [33, 1, 70, 0, 17, 64]
LENGTHS_K = [40, 5, 70, 3, 9, 64]


def _cu(lengths, device):
    return F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32).to(device)


def _view(t):
    return t.transpose(0, 1).unsqueeze(0)


def run_packed(q, k, v, dout, *, causal, window, softcap, lower_right=True, rng_seed=None, dropout_p=0.0,
               lengths_q=LENGTHS_Q, lengths_k=LENGTHS_K, schedule="stable"):
    packed = PackedSequences(_cu(lengths_q, q.device), _cu(lengths_k, q.device), max(lengths_q), max(lengths_k),
                             lower_right=lower_right)
    visibility = Visibility(is_causal=causal, causal_offset=0, window=window)
    common = (rng_seed, dropout_p, q.shape[-1] ** -0.5, schedule)
    out, lse = launch.attention_forward(_view(q), _view(k), _view(v), None, *common, visibility=visibility,
                                        softcap=softcap, packed=packed)
    dq, dk, dv, _ = launch.attention_backward(_view(dout), _view(q), _view(k), _view(v), None, out, lse, None, *common,
                                              False, visibility=visibility, softcap=softcap, packed=packed)
    return [t[0].transpose(0, 1) for t in (out, dq, dk, dv)] + [lse[0]]


CASES = {
    "full": dict(causal=False, window=(-1, -1), softcap=0.0),
    "causal": dict(causal=True, window=(-1, -1), softcap=0.0),
    "causal_window": dict(causal=True, window=(6, 0), softcap=0.0),
    "window_softcap": dict(causal=False, window=(5, 3), softcap=4.0),
}


@pytest.mark.parametrize("schedule", ["stable", "fast"])
@pytest.mark.parametrize("name", list(CASES))
def test_packed_kernels_match_each_sequence_in_fp64(name, schedule, kernel_dtype, device):
    if kernel_dtype == torch.float32 and schedule != "stable":
        pytest.skip("fp32 launches the same kernels under every schedule: run under stable")
    case = CASES[name]
    heads_q, heads_kv, dim = 4, 2, 32
    q = randn((sum(LENGTHS_Q), heads_q, dim), kernel_dtype, device, seed=1)
    k = randn((sum(LENGTHS_K), heads_kv, dim), kernel_dtype, device, seed=2)
    v = randn((sum(LENGTHS_K), heads_kv, dim), kernel_dtype, device, seed=3)
    dout = randn((sum(LENGTHS_Q), heads_q, dim), kernel_dtype, device, seed=4)
    out, dq, dk, dv, lse = run_packed(q, k, v, dout, schedule=schedule, **case)

    def definition(dtype):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        ref = varlen_reference(*leaves, LENGTHS_Q, LENGTHS_K, causal=case["causal"], window=case["window"],
                               softcap=case["softcap"])
        return ref, torch.autograd.grad(ref, leaves, dout.to(dtype))

    ref, ref_grads = definition(torch.float64)
    base, base_grads = definition(kernel_dtype)
    assert_close_to_ref("out", out, ref, base)
    for label, ours, truth, same in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads, base_grads):
        assert_close_to_ref(label, ours, truth, same)
    # The empty sequence's keys get zero gradients, and a row past its keys' end nothing but zeros.
    keys_of_empty = slice(sum(LENGTHS_K[:3]), sum(LENGTHS_K[:4]))
    assert (dk[keys_of_empty] == 0).all() and (dv[keys_of_empty] == 0).all()
    assert lse.shape == (heads_q, sum(LENGTHS_Q))


def test_top_left_alignment(device):
    """Top-left causal (SDPA's, nested tensors): row i sees keys j <= i of its own sequence."""
    q = randn((sum(LENGTHS_Q), 2, 16), torch.float32, device, seed=1)
    k = randn((sum(LENGTHS_K), 2, 16), torch.float32, device, seed=2)
    v = randn((sum(LENGTHS_K), 2, 16), torch.float32, device, seed=3)
    out = run_packed(q, k, v, torch.zeros_like(q), causal=True, window=(-1, -1), softcap=0.0, lower_right=False)[0]
    ref = varlen_reference(q.double(), k.double(), v.double(), LENGTHS_Q, LENGTHS_K, causal=True, lower_right=False)
    torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=2e-5)


def test_dropout_matches_one_launch_per_sequence(device):
    """Sequence b drops exactly what a one-sequence call with seed + b drops: the packed launch and
    a loop of dense launches agree to rounding, forward and backward."""
    lengths = [20, 33, 20]
    q, k, v, dout = (randn((73, 2, 16), torch.float32, device, seed=s) for s in (1, 2, 3, 4))
    seed = torch.tensor([2**40 + 3], dtype=torch.int64, device=device)
    packed = run_packed(q, k, v, dout, causal=True, window=(-1, -1), softcap=0.0, rng_seed=seed, dropout_p=0.3,
                        lengths_q=lengths, lengths_k=lengths)
    start = 0
    for b, n in enumerate(lengths):
        rows = slice(start, start + n)
        common = (seed + b, 0.3, 0.25, "stable")
        vis = Visibility(is_causal=True, causal_offset=0)
        out, lse = launch.attention_forward(_view(q[rows]), _view(k[rows]), _view(v[rows]), None, *common,
                                            visibility=vis)
        grads = launch.attention_backward(_view(dout[rows]), _view(q[rows]), _view(k[rows]), _view(v[rows]), None,
                                          out, lse, None, *common, False, visibility=vis)
        for ours, alone in zip(packed[:4], (out, *grads[:3])):
            torch.testing.assert_close(ours[rows], alone[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
        start += n
    assert not torch.equal(packed[0][:20], packed[0][53:])  # equal inputs? no; independent streams anyway


def test_the_op_takes_the_kernels_when_they_apply(monkeypatch, device):
    """flash_attention_varlen on the kernels (forced on CPU, where the interpreter runs them) gives
    what its per-sequence path gives."""
    import flash_inductor
    from flash_inductor.ops import varlen as varlen_ops

    lengths = [7, 12, 1]
    q, k, v = (randn((20, 2, 16), torch.float32, device, seed=s).requires_grad_() for s in (1, 2, 3))
    cu = _cu(lengths, device)
    per_sequence = flash_inductor.flash_attention_varlen(q, k, v, cu, cu, 12, 12, causal=True, softcap=3.0)
    grads = torch.autograd.grad(per_sequence.sum(), (q, k, v))
    launched = []
    real = launch.attention_forward
    monkeypatch.setattr(varlen_ops, "_on_kernels", lambda *args: True)
    monkeypatch.setattr(launch, "attention_forward", lambda *a, **kw: launched.append(kw["packed"]) or real(*a, **kw))
    kernels = flash_inductor.flash_attention_varlen(q, k, v, cu, cu, 12, 12, causal=True, softcap=3.0)
    assert len(launched) == 1 and launched[0].count == 3
    torch.testing.assert_close(kernels, per_sequence, rtol=2e-5, atol=2e-5)
    for a, b in zip(torch.autograd.grad(kernels.sum(), (q, k, v)), grads):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5)
