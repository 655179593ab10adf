"""The Gluon Hopper backward (launch/hopper_bwd.py, `fast` schedule) against fp64 gradients with
the project's tolerance rule (tests/helpers.assert_close_to_ref): dtype x head dim x causal x odd
lengths, grouped-query heads, strided (B, L, H, E) views, both dQ schemes, and rows that see no
key (dq exactly 0). GPU tests run only on an sm_90 GPU with a Triton that has Gluon; the support
check and the register plan are checked everywhere."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_close_to_ref, needs_hopper



DTYPES = (torch.bfloat16, torch.float16)


def _inputs(dtype, head_dim, batch, heads_q, heads_kv, seq_q, seq_k, transposed=False, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rand(h, n):
        if transposed:
            return torch.randn(batch, n, h, head_dim, device="cuda", dtype=dtype, generator=gen).transpose(1, 2)
        return torch.randn(batch, h, n, head_dim, device="cuda", dtype=dtype, generator=gen)
    return rand(heads_q, seq_q), rand(heads_kv, seq_k), rand(heads_kv, seq_k), rand(heads_q, seq_q)


def _visible(seq_q, seq_k, is_causal, causal_offset):
    i = torch.arange(seq_q, device="cuda")[:, None]
    j = torch.arange(seq_k, device="cuda")[None, :]
    return j <= i + causal_offset if is_causal else torch.ones(seq_q, seq_k, dtype=torch.bool, device="cuda")


def _fp64_grads(q, k, v, do, scale, visible):
    """fp64 autograd through a softmax that gives rows with no key P = 0 (no NaN)."""
    group = q.shape[1] // k.shape[1]
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    s = (q @ k.repeat_interleave(group, 1).transpose(-1, -2)) * scale
    s = s.masked_fill(~visible, float("-inf"))
    m = s.amax(-1, keepdim=True).detach()
    e = torch.exp(s - torch.where(torch.isinf(m), 0.0, m))
    l = e.sum(-1, keepdim=True)
    p = e / torch.where(l == 0, 1.0, l)
    grads = torch.autograd.grad(p @ v.repeat_interleave(group, 1), (q, k, v), do.double())
    # The most probability mass any key receives, summed over its GQA group's query heads.
    colsum = p.detach().sum(-2).unflatten(1, (k.shape[1], group)).sum(2).max().item()
    return grads, colsum


def _sdpa_grads(q, k, v, do, scale, visible, live_from):
    """SDPA (math) in the input dtype, rows that see a key only: the error budget."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = q.shape[1] // k.shape[1]
    q = q[:, :, live_from:].detach().requires_grad_()
    k, v = (t.detach().requires_grad_() for t in (k, v))
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                             attn_mask=visible[live_from:], scale=scale)
    return torch.autograd.grad(out, (q, k, v), do[:, :, live_from:])


def _check(q, k, v, do, is_causal, causal_offset=0, dq_split=True, dq_tma=True):
    from flash_inductor.launch.hopper import hopper_attention_forward
    from flash_inductor.launch.hopper_bwd import (
        HopperBackwardConfig,
        hopper_attention_backward,
        hopper_backward_supported,
    )

    scale = q.shape[-1] ** -0.5
    assert hopper_backward_supported(do, q, k, v, None, 0.0, scale, "fast")
    out, lse = hopper_attention_forward(q, k, v, scale=scale, is_causal=is_causal, causal_offset=causal_offset)
    dq, dk, dv = hopper_attention_backward(do, q, k, v, out, lse, scale=scale, is_causal=is_causal,
                                           causal_offset=causal_offset,
                                           config=HopperBackwardConfig(dq_split=dq_split, dq_tma=dq_tma))
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert dq.dtype == dk.dtype == dv.dtype == q.dtype
    visible = _visible(q.shape[2], k.shape[2], is_causal, causal_offset)
    live = visible.any(-1)
    live_from = int(live.long().argmax()) if live.any() else q.shape[2]
    # Rows with no visible key: exactly zero gradient.
    assert (dq[:, :, :live_from] == 0).all()
    refs, colsum = _fp64_grads(q, k, v, do, scale, visible)
    if live_from == q.shape[2]:
        assert (dk == 0).all() and (dv == 0).all()
        return
    bases = _sdpa_grads(q, k, v, do, scale, visible, live_from)
    # The magnitude of the terms each gradient sums (the fp32 arithmetic floor): |dS_ij| <=
    # 2 P_ij |dO_i| |v_j| and a row's P sums to 1, so Σ_j |dS_ij| |k_j| <= 2 |dO| |v| max|k|;
    # a key's column of P sums to at most `colsum`, which bounds dk's and dv's sums the same way.
    norm = lambda t: t.double().norm(dim=-1).max().item()  # noqa: E731
    ds_row = 2 * norm(do) * norm(v)
    terms = {"dq": scale * ds_row * k.double().abs().max().item(),
             "dk": scale * ds_row * colsum * q.double().abs().max().item(),
             "dv": colsum * do.double().abs().max().item()}
    for name, g, ref, base in zip(("dq", "dk", "dv"), (dq[:, :, live_from:], dk, dv),
                                  (refs[0][:, :, live_from:], refs[1], refs[2]), bases):
        assert_close_to_ref(name, g, ref, base, terms=terms[name])


@needs_hopper
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("is_causal", (False, True))
@pytest.mark.parametrize("seq_q, seq_k", [(97, 97), (300, 300), (256, 700), (700, 256)])
def test_matches_fp64(dtype, head_dim, is_causal, seq_q, seq_k):
    _check(*_inputs(dtype, head_dim, 2, 3, 3, seq_q, seq_k), is_causal)


@needs_hopper
@pytest.mark.parametrize("dq_split", (True, False))
@pytest.mark.parametrize("dq_tma", (True, False))
@pytest.mark.parametrize("head_dim", (64, 128))
def test_gqa_strided_views_and_dq_schemes(head_dim, dq_split, dq_tma):
    # dQ tiles past L (333 rows in 64-row tiles) are clipped by the TMA reduce, masked for the atomics.
    _check(*_inputs(torch.bfloat16, head_dim, 2, 8, 2, 333, 513, transposed=True), True, dq_split=dq_split,
           dq_tma=dq_tma)


@needs_hopper
@pytest.mark.parametrize("head_dim", (64, 128))
def test_rows_that_see_no_key(head_dim):
    # Lower-right causal with L > S: the first L - S rows see no key; their dq is exactly 0.
    _check(*_inputs(torch.bfloat16, head_dim, 1, 2, 1, 400, 150), True, causal_offset=150 - 400)


@needs_hopper
def test_length_one():
    _check(*_inputs(torch.float16, 64, 3, 2, 2, 1, 1), True)


@needs_hopper
def test_declines_what_it_does_not_implement():
    from flash_inductor.launch.hopper_bwd import hopper_backward_unsupported_reason

    q, k, v, _ = _inputs(torch.bfloat16, 64, 1, 2, 2, 64, 64)
    assert hopper_backward_unsupported_reason(q, k, v, None, 0.0, None, "fast") is None
    assert "schedule" in hopper_backward_unsupported_reason(q, k, v, None, 0.0, None, "stable")
    assert "mask" in hopper_backward_unsupported_reason(q, k, v, torch.ones(64, 64, dtype=torch.bool, device="cuda"),
                                                        0.0, None, "fast")
    assert "dropout" in hopper_backward_unsupported_reason(q, k, v, None, 0.1, None, "fast")


def test_declines_off_hopper_without_touching_a_gpu():
    """Runs anywhere: CPU tensors are declined with a reason, before any CUDA or Gluon call."""
    from flash_inductor.launch.hopper_bwd import hopper_backward_supported, hopper_backward_unsupported_reason

    q = torch.randn(1, 2, 64, 64, dtype=torch.bfloat16)
    assert hopper_backward_unsupported_reason(q, q, q, None, 0.0, None, "fast") == "not on a CUDA device"
    assert not hopper_backward_supported(q, q, q, q, None, 0.0, None, "fast")


def test_register_plan_fills_the_register_file():
    """Two consumer warpgroups and the loader's: the entry cap and the setmaxnreg split stay
    within 64K registers."""
    from flash_inductor.launch.hopper_bwd import HopperBackwardConfig, default_config

    for cfg in (default_config(64, False), default_config(128, True), HopperBackwardConfig(dq_split=False)):
        assert cfg.maxnreg * 128 * 3 <= 65536
        assert cfg.consumer_regs * 128 * 2 + cfg.loader_regs * 128 <= 65536
        assert cfg.maxnreg % 8 == 0 and cfg.consumer_regs % 8 == 0
        assert cfg.block_n == 128
