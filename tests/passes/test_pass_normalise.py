"""The score expression reduced to the op's (scale, bias, mask), in whatever order a model writes it.

Models scale, add biases, fill masks and cast in many orders. Where the reduction is exact the
site is rewritten and must match eager (fp64, 1e-10 relative, gradients of q, k, v and of every
float bias included):

    (QKᵀ + b)·c + m      = c·QKᵀ + (c·b + m)        Falcon with ALiBi, eager
    QKᵀ·c + b·c          = c·QKᵀ + (c·b)            a scale written on the bias
    (QKᵀ + m) / d        = (1/d)·QKᵀ + m/d          division after the mask
    fill(QKᵀ, -inf)·c    = fill(c·QKᵀ, -inf)        -inf·c = -inf for c > 0
    QKᵀ·c - b            = c·QKᵀ + (-1)·b           a subtracted bias
    q @ k[:1]ᵀ, k with one head                     K/V broadcast over batch or heads (the op broadcasts)

Where it is not exact, the site is kept with the reason and the graph computes exactly what
eager does: a negative or traced scale after a mask, a per-head tensor scale, a bias computed
from the scores, a finite fill scaled until it no longer hides keys, a mask inside the soft-cap's
tanh (soft-capping itself: test_pass_variants.py).

Compiled with the pass and AOTAutograd, the graphs run as traced (model_zoo.pass_then_aot_eager):
the decisions and the op are the backend's; Inductor's code generation is covered elsewhere.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from flash_inductor.passes.report import REPORTS
from flash_inductor.passes.site import rewritten_attention
from model_zoo import assert_kept_as_eager, pass_only, pass_then_aot_eager

B, H, L, S, E = 2, 3, 5, 7, 8
C = 1.0 / math.sqrt(E)

pytestmark = pytest.mark.usefixtures("fresh_compiler")


def _randn(*shape, seed, dtype=torch.float64):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _qkv(heads_kv=H, batch_kv=B):
    kv_shape = (batch_kv, heads_kv, S, E)
    return _randn(B, H, L, E, seed=1), _randn(*kv_shape, seed=2), _randn(*kv_shape, seed=3)


def _bias():  # an ALiBi-like per-head, per-key bias, with a gradient
    return _randn(1, H, 1, S, seed=4)


def _padding(dtype=torch.float64):  # additive key padding: finfo.min on the last two keys of batch 1
    mask = torch.zeros(B, 1, 1, S, dtype=dtype)
    mask[1, ..., -2:] = torch.finfo(dtype).min
    return mask


def _hidden():  # bool, True = hidden; key 0 always visible
    hidden = torch.rand(B, 1, L, S, generator=torch.Generator().manual_seed(5)) < 0.3
    hidden[..., 0] = False
    return hidden


def _scores(q, k):
    return q @ k.transpose(-2, -1)


# ------------------------------------------------------------------------------------------
# Exact reductions: rewritten
# ------------------------------------------------------------------------------------------


class FalconAlibi(nn.Module):  # HF Falcon (alibi=True, eager): (QKᵀ + alibi) *= inv_norm, + mask
    def forward(self, q, k, v, alibi, mask):
        logits = _scores(q, k) + alibi
        logits *= C
        return torch.softmax(logits + mask, dim=-1) @ v


class ScaleOnBias(nn.Module):
    def forward(self, q, k, v, bias, mask):
        return torch.softmax(_scores(q, k) * C + bias * C + mask, dim=-1) @ v


class DivideAfterMask(nn.Module):
    def forward(self, q, k, v, bias, mask):
        return torch.softmax((_scores(q, k) + bias + mask) / math.sqrt(E), dim=-1) @ v


class ScaleBetweenMasks(nn.Module):  # two scales, a bias before and a mask between them
    def forward(self, q, k, v, bias, mask):
        return torch.softmax(((_scores(q, k) + bias) * 0.5 + mask) * (2.0 * C), dim=-1) @ v


class FillThenScale(nn.Module):
    def forward(self, q, k, v, hidden):
        return torch.softmax(_scores(q, k).masked_fill(hidden, float("-inf")) * C, dim=-1) @ v


class FiniteFillThenScale(nn.Module):  # finfo.min * 0.35 still hides keys, and stays finite
    def forward(self, q, k, v, hidden):
        fill = torch.finfo(q.dtype).min
        return torch.softmax(_scores(q, k).masked_fill(hidden, fill) * C, dim=-1) @ v


class SubtractedBias(nn.Module):  # older BERT ports: scores - 10000 * (1 - mask)
    def forward(self, q, k, v, bias, mask):
        return torch.softmax(_scores(q, k) * C - bias - mask, dim=-1) @ v


class SharedKeys(nn.Module):  # (1, H, S, E) keys and values broadcast over the batch by matmul
    def forward(self, q, k, v):
        return torch.softmax(_scores(q, k) * C, dim=-1) @ v


REWRITTEN = {
    "falcon_alibi_scale_after_bias": (FalconAlibi, lambda: (*_qkv(), _bias(), _padding())),
    "scale_on_bias": (ScaleOnBias, lambda: (*_qkv(), _bias(), _padding())),
    "divide_after_mask": (DivideAfterMask, lambda: (*_qkv(), _bias(), _padding())),
    "scale_between_masks": (ScaleBetweenMasks, lambda: (*_qkv(), _bias(), _padding())),
    "fill_then_scale": (FillThenScale, lambda: (*_qkv(), _hidden())),
    "finite_fill_then_scale": (FiniteFillThenScale, lambda: (*_qkv(), _hidden())),
    "subtracted_bias": (SubtractedBias, lambda: (*_qkv(), _bias(), -_padding())),
    "kv_batch_broadcast": (SharedKeys, lambda: _qkv(batch_kv=1)),
    "kv_single_head": (SharedKeys, lambda: _qkv(heads_kv=1)),
}


def _run(fn, inputs, grad):
    leaves = [t.detach().clone().requires_grad_(grad and t.is_floating_point()) for t in inputs]
    out = fn(*leaves)
    if not grad:
        return [out.detach()]
    out.backward(_randn(*out.shape, seed=9))
    return [out.detach()] + [t.grad for t in leaves if t.requires_grad]


@pytest.mark.parametrize("grad", [True, False], ids=["training", "inference"])
@pytest.mark.parametrize("case", list(REWRITTEN))
def test_exact_reduction_is_rewritten_and_matches_eager(case, grad):
    factory, make_inputs = REWRITTEN[case]
    module, inputs = factory(), make_inputs()
    got = _run(torch.compile(module, backend=pass_then_aot_eager()), inputs, grad)
    records = [r for report in REPORTS for r in report.sites]
    assert [r.status for r in records] == ["rewritten"], "\n".join(map(str, REPORTS))
    want = _run(module, inputs, grad)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape
        err, scale = (a - b).abs().max().item(), b.abs().max().item()
        assert err <= 1e-10 * scale, f"tensor {i} (0: output, then input gradients): {err:.3e} (|eager| {scale:.3e})"


def test_falcon_alibi_bias_gets_the_scale_as_a_mask_factor():
    """(QKᵀ + alibi)·c + m goes to the op as scale c and float mask c·alibi + m."""
    gm = pass_only(FalconAlibi(), *_qkv(), _bias(), _padding())
    (call,) = [n for n in gm.graph.nodes if n.target is rewritten_attention]
    assert call.kwargs["scale"] == pytest.approx(C)
    factors = [n.args[1] for n in gm.graph.nodes if n.target is torch.mul and isinstance(n.args[1], float)]
    assert factors == [pytest.approx(C)], gm.code


# ------------------------------------------------------------------------------------------
# Not exact: kept, and the graph is left computing what eager does
# ------------------------------------------------------------------------------------------


class NegativeScaleAfterFill(nn.Module):  # -inf * -1 = +inf: the hidden keys would take every weight
    def forward(self, q, k, v, hidden):
        return torch.softmax(_scores(q, k).masked_fill(hidden, float("-inf")) * -1.0, dim=-1) @ v


class LearnedTemperatureAfterMask(nn.Module):  # a traced scale: no constant to fold into the mask
    def __init__(self):
        super().__init__()
        self.temperature = nn.Parameter(torch.tensor(0.7, dtype=torch.float64))

    def forward(self, q, k, v, mask):
        return torch.softmax((_scores(q, k) + mask) * self.temperature, dim=-1) @ v


class PerHeadScaleAfterMask(nn.Module):  # Swin-V2-like per-head scale: a tensor, not a constant
    def forward(self, q, k, v, mask):
        per_head = torch.arange(1, H + 1, dtype=q.dtype).view(H, 1, 1)
        return torch.softmax((_scores(q, k) + mask) * per_head, dim=-1) @ v


class BiasFromScores(nn.Module):  # the "bias" is computed from the scores themselves
    def forward(self, q, k, v):
        scores = _scores(q, k) * C
        return torch.softmax(scores + scores.amax(dim=-1, keepdim=True) * 0.5, dim=-1) @ v


class FillScaledAway(nn.Module):  # -1e5 * 1e-3 = -100: no longer hides the keys
    def forward(self, q, k, v, hidden):
        return torch.softmax(_scores(q, k).masked_fill(hidden, -1e5) * 1e-3, dim=-1) @ v


class NegatedScores(nn.Module):  # bias - scores: the scores enter with a negative sign
    def forward(self, q, k, v, mask):
        return torch.softmax(mask - _scores(q, k) * C, dim=-1) @ v


class MaskInsideSoftCap(nn.Module):  # Gemma 2's cap * tanh(scores / cap), but the mask added first
    def forward(self, q, k, v, mask):
        capped = torch.tanh((_scores(q, k) * C + mask) / 50.0) * 50.0
        return torch.softmax(capped, dim=-1) @ v


KEPT = {
    "negative_scale_after_fill": (NegativeScaleAfterFill, lambda: (*_qkv(), _hidden()), "scaled by -1"),
    "traced_scale_after_mask": (LearnedTemperatureAfterMask, lambda: (*_qkv(), _padding()),
                                "not a compile-time constant"),
    "per_head_tensor_scale": (PerHeadScaleAfterMask, lambda: (*_qkv(), _padding()), "not a supported step"),
    "bias_from_the_scores": (BiasFromScores, lambda: _qkv(), "also used by"),
    "finite_fill_scaled_away": (FillScaledAway, lambda: (*_qkv(), _hidden()), "no longer acts as a mask"),
    "negated_scores": (NegatedScores, lambda: (*_qkv(), _padding()), "not a supported step"),
    "mask_inside_soft_cap": (MaskInsideSoftCap, lambda: (*_qkv(), _padding()), "before the tanh"),
}


@pytest.mark.parametrize("case", list(KEPT))
def test_inexact_reduction_is_kept_with_its_reason(case):
    factory, make_inputs, reason = KEPT[case]
    assert_kept_as_eager(factory(), make_inputs(), reason)


def test_scale_of_the_dynamic_head_dim_after_a_mask_is_kept():
    """With dynamic shapes 1/sqrt(E) is symbolic: there is no number to multiply the mask by."""

    class DynamicHeadDim(nn.Module):
        def forward(self, q, k, v, mask):
            return torch.softmax((_scores(q, k) + mask) / math.sqrt(q.size(-1)), dim=-1) @ v

    REPORTS.clear()
    pass_only(DynamicHeadDim(), *_qkv(), _padding(), dynamic=True)
    records = [r for report in REPORTS for r in report.sites]
    assert [r.status for r in records] == ["kept"] and "dynamic head dim" in records[0].reason, records
