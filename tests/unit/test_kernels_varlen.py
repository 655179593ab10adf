"""Packed sequences in the Triton kernels (``VARLEN``), launched directly (the interpreter on CPU,
the GPU there): one launch a pass over every sequence, against each sequence alone in float64
(tests/variant_refs.py), with PyTorch's same-dtype formula as the baseline of the tolerance rule.
Causal masking at each sequence's bottom-right diagonal (and top-left), lengths that differ
between queries and keys, empty sequences, windows, GQA, soft-capping and dropout."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_close_to_ref, needs_hopper, randn

# The Gluon packed kernels faulted in their first GPU run (launch/hopper_varlen.NOT_YET_ON_A_GPU: no
# call is routed to them); a fault poisons the worker's CUDA context, so their tests wait for the fix
# rather than take the suite down. Not a pass: the closing notes list them until they run again.
# FLASH_INDUCTOR_GLUON_VARLEN_TRIAL=1 runs them, with the launches routed for each test
# (``tools/gpu/steps.sh varlen_trial``, a process of its own).
GLUON_VARLEN_TRIAL = os.environ.get("FLASH_INDUCTOR_GLUON_VARLEN_TRIAL") == "1"
gluon_varlen_on_hold = pytest.mark.skipif(
    not GLUON_VARLEN_TRIAL, reason="the Gluon packed kernels fault on the H100 (an illegal instruction, 2026-12-07): "
                                   "launch/hopper_varlen.NOT_YET_ON_A_GPU; tools/gpu/steps.sh varlen_trial runs them")
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


# ------------------------------------------------------------------------------------------
# The Gluon Hopper kernels (launch/hopper_varlen.py), through the op on an sm_90 GPU
# ------------------------------------------------------------------------------------------

# One token, lengths off the tiles (64/128/192 rows, 128 keys), one empty, queries longer and
# shorter than their keys (bottom-right rows that see nothing), and one past several blocks.
GLUON_LENGTHS_Q = [1, 200, 64, 333, 0, 129, 7, 260]
GLUON_LENGTHS_K = [1, 180, 64, 400, 3, 129, 12, 260]


def _gluon_calls(monkeypatch):
    """Count the Gluon varlen launchers' calls: {"forward": n, "backward": n}."""
    from flash_inductor.launch import hopper_varlen

    if GLUON_VARLEN_TRIAL:
        monkeypatch.setattr(hopper_varlen, "NOT_YET_ON_A_GPU", None)
    calls = {"forward": 0, "backward": 0}
    for kind, name in (("forward", "hopper_varlen_forward"), ("backward", "hopper_varlen_backward")):
        real = getattr(hopper_varlen, name)

        def counted(*args, _real=real, _kind=kind, **kwargs):
            calls[_kind] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(hopper_varlen, name, counted)
    return calls


def _run_op(q, k, v, lengths_q, lengths_k, *, causal, lower_right=True, window=(-1, -1), schedule="fast"):
    """The varlen op with autograd: (out, lse). `stable`: the one-pass ops (ops/varlen_one_pass.py),
    as flash_attention_varlen takes them on an sm_90 GPU."""
    import flash_inductor.ops.varlen  # noqa: F401 -- registers the op
    from flash_inductor.ops.varlen_one_pass import attention_varlen_one_pass

    cu_q, cu_k = _cu(lengths_q, q.device), _cu(lengths_k, q.device)
    if schedule == "stable":
        return attention_varlen_one_pass(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal, lower_right,
                                         q.shape[-1] ** -0.5, window[0], window[1])
    return torch.ops.flash_inductor.attention_varlen_forward(
        q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), None, 0.0, causal, lower_right, q.shape[-1] ** -0.5,
        schedule, window[0], window[1])


@gluon_varlen_on_hold
@needs_hopper
@pytest.mark.parametrize("schedule", ("fast", "stable"))
@pytest.mark.parametrize("lower_right", (True, False), ids=("bottom_right", "top_left"))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=("bf16", "fp16"))
def test_gluon_packed_matches_each_sequence_in_fp64(monkeypatch, dtype, head_dim, causal, lower_right, schedule):
    """Forward, LSE and every gradient of a pack on the Gluon kernels (both passes taken there;
    `stable` through the one-pass ops, with the exact Δ and the centred keys) against each sequence
    alone in fp64, within the tolerance rule against PyTorch's same-dtype error; the empty
    sequence's keys get zero gradients."""
    if not causal and not lower_right:
        pytest.skip("the alignment matters only under causal masking")
    calls = _gluon_calls(monkeypatch)
    heads_q, heads_kv = 4, 2
    total_q, total_k = sum(GLUON_LENGTHS_Q), sum(GLUON_LENGTHS_K)
    q = randn((total_q, heads_q, head_dim), dtype, "cuda", seed=1).requires_grad_()
    k = randn((total_k, heads_kv, head_dim), dtype, "cuda", seed=2).requires_grad_()
    v = randn((total_k, heads_kv, head_dim), dtype, "cuda", seed=3).requires_grad_()
    dout = randn((total_q, heads_q, head_dim), dtype, "cuda", seed=4)
    out, lse = _run_op(q, k, v, GLUON_LENGTHS_Q, GLUON_LENGTHS_K, causal=causal, lower_right=lower_right,
                       schedule=schedule)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert calls == {"forward": 1, "backward": 1}

    def definition(ref_dtype):
        leaves = [t.detach().to(ref_dtype).requires_grad_() for t in (q, k, v)]
        ref = varlen_reference(*leaves, GLUON_LENGTHS_Q, GLUON_LENGTHS_K, causal=causal, lower_right=lower_right)
        return ref, torch.autograd.grad(ref, leaves, dout.to(ref_dtype))

    ref, ref_grads = definition(torch.float64)
    base, base_grads = definition(dtype)
    assert_close_to_ref("out", out, ref, base)
    for label, ours, truth, same in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads, base_grads):
        assert_close_to_ref(label, ours, truth, same)
    # The LSE against each sequence's fp64 log-sum-exp (-inf where a row sees no key), PyTorch's fp32
    # one the baseline.
    lse_ref, lse_base = (torch.cat([_sequence_lse(q.detach(), k.detach(), *bounds, causal, lower_right, lse_dtype)
                                    for bounds in _bounds(GLUON_LENGTHS_Q, GLUON_LENGTHS_K)], dim=1)
                         for lse_dtype in (torch.float64, torch.float32))
    assert_close_to_ref("lse", lse, lse_ref, lse_base)
    empty = slice(sum(GLUON_LENGTHS_K[:4]), sum(GLUON_LENGTHS_K[:5]))
    assert (dk[empty] == 0).all() and (dv[empty] == 0).all()


def _bounds(lengths_q, lengths_k):
    cq, ck = _cu(lengths_q, "cpu").tolist(), _cu(lengths_k, "cpu").tolist()
    return list(zip(cq[:-1], cq[1:], ck[:-1], ck[1:]))


def _sequence_lse(q, k, q0, q1, k0, k1, causal, lower_right, dtype):
    """(Hq, rows) log-sum-exp in ``dtype`` of one sequence's scaled scores, -inf for a row with no key."""
    group = q.shape[1] // k.shape[1]
    qs = q[q0:q1].to(dtype).transpose(0, 1)
    ks = k[k0:k1].to(dtype).transpose(0, 1).repeat_interleave(group, 0)
    scores = qs @ ks.transpose(1, 2) * q.shape[-1] ** -0.5
    if causal:
        i = torch.arange(q1 - q0, device=q.device)[:, None]
        j = torch.arange(k1 - k0, device=q.device)[None, :]
        scores = scores.masked_fill(j > i + ((k1 - k0) - (q1 - q0) if lower_right else 0), float("-inf"))
    return torch.logsumexp(scores, dim=-1)


@gluon_varlen_on_hold
@needs_hopper
@pytest.mark.parametrize("head_dim", (64, 128))
def test_gluon_packed_gqa_and_windows(monkeypatch, head_dim):
    """Eight query heads over two KV heads and a sliding window (left 100, right 30) on the Gluon
    kernels, bf16, against fp64."""
    calls = _gluon_calls(monkeypatch)
    lengths = [300, 1, 77, 512, 129]
    total = sum(lengths)
    q = randn((total, 8, head_dim), torch.bfloat16, "cuda", seed=5).requires_grad_()
    k = randn((total, 2, head_dim), torch.bfloat16, "cuda", seed=6).requires_grad_()
    v = randn((total, 2, head_dim), torch.bfloat16, "cuda", seed=7).requires_grad_()
    dout = randn((total, 8, head_dim), torch.bfloat16, "cuda", seed=8)
    out, _ = _run_op(q, k, v, lengths, lengths, causal=False, window=(100, 30))
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert calls == {"forward": 1, "backward": 1}

    def definition(ref_dtype):
        leaves = [t.detach().to(ref_dtype).requires_grad_() for t in (q, k, v)]
        ref = varlen_reference(*leaves, lengths, lengths, causal=False, window=(100, 30))
        return ref, torch.autograd.grad(ref, leaves, dout.to(ref_dtype))

    ref, ref_grads = definition(torch.float64)
    base, base_grads = definition(torch.bfloat16)
    assert_close_to_ref("out", out, ref, base)
    for label, ours, truth, same in zip(("dq", "dk", "dv"), grads, ref_grads, base_grads):
        assert_close_to_ref(label, ours, truth, same)


@gluon_varlen_on_hold
@needs_hopper
def test_gluon_packed_routing(monkeypatch):
    """flash_attention_varlen on an sm_90 GPU: `fast` and the default `stable` (through the one-pass
    ops) run both passes on the Gluon kernels, also where the gradient is a broadcast (stride 0,
    copied for TMA); fp32 and dropout stay on the Triton kernels; `stable` under deterministic
    algorithms runs the Gluon forward and the Triton backward (dQ's reduce-adds have no fixed order)."""

    import flash_inductor

    calls = _gluon_calls(monkeypatch)
    lengths = [5, 130]
    cu = _cu(lengths, "cuda")
    q, k, v = (randn((135, 2, 64), torch.bfloat16, "cuda", seed=s).requires_grad_() for s in (1, 2, 3))
    out = flash_inductor.flash_attention_varlen(q, k, v, cu, cu, 130, 130, causal=True, schedule="fast")
    torch.autograd.grad(out.sum(), (q, k, v))
    assert calls == {"forward": 1, "backward": 1}
    out = flash_inductor.flash_attention_varlen(q, k, v, cu, cu, 130, 130, causal=True)
    torch.autograd.grad(out.sum(), (q, k, v))
    assert calls == {"forward": 2, "backward": 2}
    flash_inductor.flash_attention_varlen(q.float(), k.float(), v.float(), cu, cu, 130, 130, causal=True)
    flash_inductor.flash_attention_varlen(q, k, v, cu, cu, 130, 130, causal=True, dropout_p=0.1)
    assert calls == {"forward": 2, "backward": 2}
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        out = flash_inductor.flash_attention_varlen(q, k, v, cu, cu, 130, 130, causal=True)
        torch.autograd.grad(out.sum(), (q, k, v))
    finally:
        torch.use_deterministic_algorithms(False)
    assert calls == {"forward": 3, "backward": 2}


@gluon_varlen_on_hold
@needs_hopper
def test_gluon_packed_ops_opcheck():
    """torch.library.opcheck over the one-pass varlen ops (schema, fake kernels, autograd registration)."""
    import flash_inductor.ops.varlen_one_pass  # noqa: F401 -- registers the ops

    lengths = [3, 70]
    cu = _cu(lengths, "cuda")
    q, k, v = (randn((73, 2, 64), torch.bfloat16, "cuda", seed=s).requires_grad_() for s in (1, 2, 3))
    torch.library.opcheck(torch.ops.flash_inductor.attention_varlen_forward_one_pass,
                          (q, k, v, cu, cu, 70, 70, True, True, 0.125))


@gluon_varlen_on_hold
@needs_hopper
def test_gluon_packed_writes_nothing_past_a_sequence(monkeypatch):
    """Each sequence's last block stores only its own rows: the second sequence of a pack of two gets
    the output, dK and dV it gets alone, bit for bit (a store past the first one's end would
    overwrite its first rows), and dQ to its summation order (the reduce-adds' order varies)."""
    calls = _gluon_calls(monkeypatch)
    lengths = [70, 300]
    q, k, v = (randn((370, 2, 128), torch.bfloat16, "cuda", seed=s).requires_grad_() for s in (1, 2, 3))
    dout = randn((370, 2, 128), torch.bfloat16, "cuda", seed=4)
    out, _ = _run_op(q, k, v, lengths, lengths, causal=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    alone, _ = _run_op(q[70:], k[70:], v[70:], [300], [300], causal=True)
    alone_grads = torch.autograd.grad(alone, (q, k, v), dout[70:])
    torch.testing.assert_close(out[70:], alone, rtol=0, atol=0)
    torch.testing.assert_close(grads[0][70:], alone_grads[0][70:], rtol=2e-2, atol=2e-2)
    for g, a in zip(grads[1:], alone_grads[1:]):
        torch.testing.assert_close(g[70:], a[70:], rtol=0, atol=0)
    assert calls == {"forward": 2, "backward": 2}, calls  # both packs on the Gluon kernels


@gluon_varlen_on_hold
@needs_hopper
@pytest.mark.parametrize("schedule", ("fast", "stable"))
def test_gluon_packed_under_torch_compile(monkeypatch, schedule):
    """flash_attention_varlen compiled (fullgraph, Inductor) runs the same Gluon launches as eagerly,
    with the same output and gradients: the ops' fake kernels promise the layouts the launches give."""
    import flash_inductor

    calls = _gluon_calls(monkeypatch)
    lengths = [100, 1, 190]
    cu = _cu(lengths, "cuda")
    q, k, v = (randn((291, 4, 128), torch.bfloat16, "cuda", seed=s).requires_grad_() for s in (1, 2, 3))
    dout = randn((291, 4, 128), torch.bfloat16, "cuda", seed=4)

    def fn(q, k, v):
        return flash_inductor.flash_attention_varlen(q, k, v, cu, cu, 190, 190, causal=True, schedule=schedule)

    eager = fn(q, k, v)
    grads = torch.autograd.grad(eager, (q, k, v), dout)
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True)(q, k, v)
    compiled_grads = torch.autograd.grad(compiled, (q, k, v), dout)
    assert calls == {"forward": 2, "backward": 2}
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    # dQ's reduce-adds sum in a varying order; dK and dV are summed in registers, in a fixed order.
    torch.testing.assert_close(compiled_grads[0], grads[0], rtol=2e-2, atol=2e-2)
    for a, b in zip(compiled_grads[1:], grads[1:]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
