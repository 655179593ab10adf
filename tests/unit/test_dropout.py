"""Dropout through the public API: unbiasedness, keep rate, determinism.

Runs on the kernel device (the Triton kernels on CUDA) and on the CPU (the reference path, which
draws the same Philox stream as the kernels; test_kernels.py checks kernel == reference path
under the interpreter).
"""

from __future__ import annotations

import math

import pytest
import torch

from flash_inductor import flash_attention
from helpers import DEVICE, dtype_id, randn

DEVICES = [pytest.param(d, id=d) for d in dict.fromkeys([DEVICE, "cpu"])]
P = 0.3
N_SEEDS = 200


def _probe(device, dtype=torch.float32):
    """V = identity (Ev = S), so out[i, j] = P_ij * keep_ij / (1 - p): the dropout mask is visible."""
    batch, heads, seq_q, seq_k = 1, 2, 8, 16
    q = randn((batch, heads, seq_q, 16), dtype, device, 0)
    k = randn((batch, heads, seq_k, 16), dtype, device, 1)
    v = torch.eye(seq_k, dtype=dtype, device=device).expand(batch, heads, seq_k, seq_k).contiguous()
    return q, k, v


@pytest.mark.parametrize("device", DEVICES)
def test_keep_rate_and_scaling(device):
    q, k, v = _probe(device)
    probs = flash_attention(q, k, v).double()
    assert (probs > 0).all()
    kept = 0
    total = 0
    for seed in range(N_SEEDS):
        torch.manual_seed(seed)
        out = flash_attention(q, k, v, dropout_p=P).double()
        keep = out != 0
        # Kept entries are P / (1 - p) (to fp32 rounding), dropped ones exactly 0.
        expected = probs / (1 - P)
        assert torch.allclose(out[keep], expected[keep], rtol=8 * torch.finfo(torch.float32).eps, atol=0)
        kept += keep.sum().item()
        total += keep.numel()
    rate = kept / total
    stderr = math.sqrt(P * (1 - P) / total)
    assert abs(rate - (1 - P)) < 4 * stderr, f"kept fraction {rate:.4f}, expected {1 - P} +- {stderr:.4f}"


@pytest.mark.parametrize("device", DEVICES)
def test_unbiased(device):
    """E[out] over seeds equals the no-dropout output: every element's mean is within 5 standard
    errors (estimated from the samples) of it."""
    q = randn((1, 2, 8, 16), torch.float32, device, 0)
    k = randn((1, 2, 16, 16), torch.float32, device, 1)
    v = randn((1, 2, 16, 8), torch.float32, device, 2)
    expected = flash_attention(q, k, v).double()
    samples = []
    for seed in range(N_SEEDS):
        torch.manual_seed(seed)
        samples.append(flash_attention(q, k, v, dropout_p=P).double())
    samples = torch.stack(samples)
    mean = samples.mean(0)
    stderr = samples.std(0) / math.sqrt(N_SEEDS)
    z = (mean - expected) / stderr
    assert z.abs().max() < 5, f"max |z| = {z.abs().max():.2f}"
    # And the outputs really vary across seeds.
    assert (samples.std(0) > 0).all()


@pytest.mark.parametrize("dtype", [pytest.param(d, id=dtype_id(d)) for d in (torch.float16, torch.float32)])
@pytest.mark.parametrize("device", DEVICES)
def test_deterministic_given_seed(device, dtype):
    q = randn((2, 2, 20, 16), dtype, device, 0)
    k = randn((2, 2, 24, 16), dtype, device, 1)
    v = randn((2, 2, 24, 16), dtype, device, 2)
    mask = randn((2, 1, 20, 24), dtype, device, 3)
    dout = randn((2, 2, 20, 16), dtype, device, 4)

    def run(seed):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, mask)]
        torch.manual_seed(seed)
        out = flash_attention(*leaves[:3], attn_mask=leaves[3], dropout_p=P)
        # The backward regenerates the mask from the saved seed, whatever the generator does now.
        torch.manual_seed(seed + 1000)
        out.backward(dout)
        return [out.detach()] + [t.grad for t in leaves]

    first, second, other = run(7), run(7), run(8)
    for name, a, b, c in zip(["out", "dq", "dk", "dv", "dmask"], first, second, other):
        assert torch.equal(a, b), f"{name} differs between two runs with the same seed"
        assert not torch.equal(a, c), f"{name} is the same for different seeds"


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_zero_is_no_dropout(device):
    q = randn((1, 2, 20, 16), torch.float16, device, 0)
    k = randn((1, 2, 24, 16), torch.float16, device, 1)
    v = randn((1, 2, 24, 16), torch.float16, device, 2)
    dout = randn((1, 2, 20, 16), torch.float16, device, 4)

    def run(**kwargs):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = flash_attention(*leaves, is_causal=True, **kwargs)
        out.backward(dout)
        return [out.detach()] + [t.grad for t in leaves]

    for a, b in zip(run(), run(dropout_p=0.0)):
        assert torch.equal(a, b)
