"""The fp64 ground truth of a :class:`~.cases.Problem`: out (on its rows) and dq, dk, dv.

Materialised attention in float64 on the problem's device, differentiated by autograd. It
follows flash_inductor's convention where SDPA's math path would produce NaN: a query row
with no visible key has output 0 and zero gradients. Additive masks are added in fp64
unclamped (the op clamps finite mask values at -1e38, which softmax's shift invariance makes
invisible in out and the gradients).

The variants follow docs/variants.md: the soft-cap ``c * tanh(s / c)`` applies to the scaled scores
before the mask; a head's sink logit joins each row's denominator only (a row with no visible key
still returns 0); a packed problem's ``attn_mask`` already holds its documents' structure.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .cases import Problem


def _visible_scores(problem: Problem, q: Tensor, k: Tensor, rows: slice) -> Tensor:
    scale = problem.scale if problem.scale is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = (q @ k.transpose(-2, -1)) * scale
    if problem.softcap is not None:
        scores = problem.softcap * torch.tanh(scores / problem.softcap)
    mask = problem.attn_mask
    if mask is not None:
        mask = mask[..., rows, :] if mask.shape[-2] != 1 else mask
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask.to(torch.float64)
    if problem.is_causal:
        seq_k = k.shape[-2]
        i = torch.arange(rows.start, rows.stop, device=q.device)[:, None]
        j = torch.arange(seq_k, device=q.device)[None, :]
        scores = scores.masked_fill(j > i, float("-inf"))
    return scores


def _safe_softmax(scores: Tensor, sinks: Tensor | None = None) -> Tensor:
    # The max is a constant for autograd (shift invariance); rows with no visible key shift by 0
    # and divide by 1, giving probabilities 0 instead of -inf - -inf = NaN.
    row_max = scores.detach().amax(dim=-1, keepdim=True)
    row_max = row_max.masked_fill(row_max.isneginf(), 0.0)
    if sinks is not None:
        # The sink is one more term of the denominator, never a key; its row then has no key
        # weight and still returns 0 when every key is hidden (the op's contract).
        sink = sinks.detach().double().reshape(-1, 1, 1).expand_as(row_max)
        row_max = torch.maximum(row_max, sink)
    unnorm = torch.exp(scores - row_max)
    total = unnorm.sum(dim=-1, keepdim=True)
    if sinks is not None:
        total = total + torch.exp(sinks.double().reshape(-1, 1, 1) - row_max)
    return unnorm / torch.where(total > 0, total, torch.ones_like(total))


def reference(problem: Problem) -> dict[str, Tensor]:
    """fp64 ``out`` (rows of ``problem.rows`` only) and full-size ``dq``, ``dk``, ``dv``, plus
    ``terms``: for each of them the norm of its term magnitudes (see :func:`_term_norms`)."""
    seq_q = problem.query.shape[-2]
    rows = problem.rows or slice(0, seq_q)
    q = problem.query[..., rows, :].detach().double().requires_grad_()
    k = problem.key.detach().double().requires_grad_()
    v = problem.value.detach().double().requires_grad_()
    probs = _safe_softmax(_visible_scores(problem, q, k, rows), problem.sinks)
    out = probs @ v
    grad_out = problem.grad_out[..., rows, :].double()
    out.backward(grad_out)
    dq = torch.zeros(problem.query.shape, dtype=torch.float64, device=q.device)
    # Rows outside the slice have a zero upstream gradient, so their dq is exactly 0.
    dq[..., rows, :] = q.grad
    terms = _term_norms(problem, probs.detach(), q.detach(), k.detach(), v.detach(), grad_out, out.detach())
    return dict(out=out.detach(), dq=dq, dk=k.grad, dv=v.grad, terms=terms)


@torch.no_grad()
def _term_norms(problem: Problem, probs, q, k, v, grad_out, out) -> dict[str, float]:
    """Norm of the entrywise sum of |terms| behind each result, e.g. for dq_i:
    ``scale * sum_j P_ij (|dP_ij| + |Delta_i|) |k_j|``.

    Floating-point error in any implementation scales with these, not with the result: with
    one-hot attention dq is ~0 while dP and Delta are O(|dO| |V|). The suite's error floor uses
    them (tests/helpers.py's tolerance rule, norm-wise).
    """
    scale = problem.scale if problem.scale is not None else 1.0 / math.sqrt(q.shape[-1])
    grad_probs = grad_out @ v.transpose(-2, -1)
    delta = (grad_out * out).sum(-1, keepdim=True)
    ds_terms = probs * (grad_probs.abs() + delta.abs())
    return dict(
        out=(probs @ v.abs()).norm().item(),
        dv=(probs.transpose(-2, -1) @ grad_out.abs()).norm().item(),
        dq=scale * (ds_terms @ k.abs()).norm().item(),
        dk=scale * (ds_terms.transpose(-2, -1) @ q.abs()).norm().item(),
    )
