"""``torch.func`` transforms over ``flash_attention``, as over SDPA (ops/functorch.py).

torch's Function for a ``torch.library`` op's registered autograd has no ``setup_context``, which
functorch requires: ``torch.func.grad`` over our attention raised where SDPA's works. Under a
transform the ops now run through Functions of the form functorch takes. Each test holds the
transform's answer to plain autograd on the same call (same kernels: on CUDA the eager fast path
against the registered op; fp64 on the CPU reference), and double backward is still refused.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flash_inductor import flash_attention
from helpers import DEVICE, ON_CUDA, randn

# fp64 where the reference path runs; on CUDA fp32 (the Triton kernels) and bf16 (the Hopper
# one-pass ops on an H200, the Triton kernels elsewhere).
DTYPES = [torch.float32, torch.bfloat16] if ON_CUDA else [torch.float64]


def _qkv(dtype, batch=2, heads=2, seq_q=40, seq_k=56, head_dim=32):
    return [randn((batch, heads, n, head_dim), dtype, DEVICE, seed) for seed, n in enumerate((seq_q, seq_k, seq_k))]


def _close(got, want):
    # The same kernels on both sides; dq may be summed in another order (the Hopper backward's reduce-adds).
    torch.testing.assert_close(got, want, rtol=2e-2 if got.dtype == torch.bfloat16 else 1e-5, atol=1e-5)


def _sdpa64(q, k, v, **kwargs):
    """The definition, independent of the op: PyTorch's SDPA in float64."""
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), **kwargs)


def _matches_definition(got, want64):
    """A transform's gradient against the float64 definition's: to the rounding of the tests'
    fp32 losses with fp64 inputs (the reference path), to the kernels' rounding in fp32 and bf16."""
    tol = {torch.float64: 1e-6, torch.float32: 2e-4, torch.bfloat16: 5e-2}[got.dtype]
    torch.testing.assert_close(got.double(), want64, rtol=tol, atol=tol * max(1.0, want64.abs().max().item()))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_grad_matches_autograd(dtype, causal):
    q, k, v = _qkv(dtype)
    weights = randn((2, 2, 40, 32), dtype, DEVICE, 7)

    def loss(q, k, v):
        return (flash_attention(q, k, v, is_causal=causal).float() * weights.float()).sum()

    got = torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(loss(*leaves), leaves)
    for g, w in zip(got, want):
        _close(g, w)
    leaves64 = [t.double().requires_grad_() for t in (q, k, v)]
    definition = torch.autograd.grad((_sdpa64(*leaves64, is_causal=causal) * weights.float().double()).sum(),
                                     leaves64)
    for g, w in zip(got, definition):
        _matches_definition(g, w)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_per_sample_gradients_with_vmap(dtype):
    """vmap(grad(f)): each sample's gradient as its own backward gives it."""
    q, k, v = _qkv(dtype)

    def loss(q1, k1):
        return flash_attention(q1[None], k1[None], v[:1], is_causal=True).float().square().sum()

    got = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1)))(q, k)
    for i in range(q.shape[0]):
        leaves = [q[i].clone().requires_grad_(), k[i].clone().requires_grad_()]
        for g, w in zip(got, torch.autograd.grad(loss(*leaves), leaves)):
            _close(g[i], w)
        leaves64 = [q[i].double().requires_grad_(), k[i].double().requires_grad_()]
        out64 = _sdpa64(leaves64[0][None], leaves64[1][None], v[:1], is_causal=True)
        for g, w in zip(got, torch.autograd.grad(out64.square().sum(), leaves64)):
            _matches_definition(g[i], w)


def test_grad_of_a_float_mask():
    dtype = torch.float32 if ON_CUDA else torch.float64
    q, k, v = _qkv(dtype)
    mask = randn((40, 56), dtype, DEVICE, 9)

    def loss(mask):
        return flash_attention(q, k, v, attn_mask=mask).square().sum()

    got = torch.func.grad(loss)(mask)
    leaf = mask.clone().requires_grad_()
    (want,) = torch.autograd.grad(loss(leaf), leaf)
    _close(got, want)
    leaf64 = mask.double().requires_grad_()
    (definition,) = torch.autograd.grad(_sdpa64(q, k, v, attn_mask=leaf64).square().sum(), leaf64)
    _matches_definition(got, definition)


def test_double_backward_is_refused_under_transforms():
    q, k, v = _qkv(torch.float32 if ON_CUDA else torch.float64)

    def inner(q):
        return torch.func.grad(lambda q: flash_attention(q, k, v).sum())(q).sum()

    with pytest.raises(RuntimeError, match="double backward through attention"):
        torch.func.grad(inner)(q)


@pytest.mark.parametrize("dtype", DTYPES)
def test_grad_and_vmap_over_sinks(dtype):
    """torch.func.grad in q and the sinks (the transform's backward takes the sinks' gradient in torch
    ops) matches plain autograd, and per-sample sink gradients under vmap sum to the batch's."""
    q, k, v = _qkv(dtype)
    sinks = randn((2,), torch.float32, DEVICE, 9)

    def loss(q, s):
        return flash_attention(q, k, v, is_causal=True, sinks=s).float().square().sum()

    gq, gs = torch.func.grad(loss, argnums=(0, 1))(q, sinks)
    q_leaf, s_leaf = q.clone().requires_grad_(), sinks.clone().requires_grad_()
    loss(q_leaf, s_leaf).backward()
    _close(gq, q_leaf.grad)
    _close(gs, s_leaf.grad)
    per_sample = torch.func.vmap(torch.func.grad(lambda qq, kk, vv, s: flash_attention(
        qq[None], kk[None], vv[None], is_causal=True, sinks=s).float().square().sum(), argnums=3),
        in_dims=(0, 0, 0, None))(q, k, v, sinks)
    _close(per_sample.sum(0), gs)
