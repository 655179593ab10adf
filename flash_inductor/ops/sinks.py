"""Attention sinks: a per-head logit that joins each row's softmax denominator and nothing else.

gpt-oss (``s_aux``) and streaming LLMs give every query head h a learned logit ``sink_h``. Row i's
weights become ``exp(s_ij) / (Σ_j exp(s_ij) + exp(sink_h))``: the sink takes a share of the
probability mass and contributes no value. With the op's outputs for the same row without the sink,
``out_i = Σ_j exp(s_ij - lse_i) v_j`` and ``lse_i``, that is exactly

    out'_i = out_i · σ(lse_i - sink_h)        lse'_i = log(exp(lse_i) + exp(sink_h))

so the sink is folded in after the op, on every path (kernels, reference, decode, varlen), and
autograd takes the gradient through the op's ``(out, lse)``: the backward op already accepts a
gradient for the LSE. ``d sink_h = -Σ_i σ(sink_h - lse'_i) · dO'_i · out'_i``.

Rows with no visible key (lse = -inf) keep out = 0 and get lse' = sink_h, with zero gradients for
q, k and v: the sink then holds the row's whole mass, which is the FlashAttention / gpt-oss
contract. The product runs in the LSE's dtype (fp32, fp64 for fp64 inputs) and rounds once.
"""

from __future__ import annotations

import torch
from torch import Tensor


def fold_sinks(out: Tensor, lse: Tensor, sinks: Tensor, heads_dim: int = 1,
               with_lse: bool = True) -> tuple[Tensor, Tensor | None]:
    """``(out', lse')``: ``out`` (..., H, L, Ev) and ``lse`` (..., H, L) with the per-head sink
    logits ``sinks`` (H,) in the denominator. ``heads_dim`` is the heads' dim of ``lse``; without
    ``with_lse`` lse' is not formed (None), saving its pass where nobody reads it."""
    shape = [1] * lse.dim()
    shape[heads_dim] = sinks.shape[0]
    sink = sinks.to(lse.dtype).reshape(shape)
    kept = torch.sigmoid(lse - sink)  # the share of row i's mass on its keys
    # 16-bit out times the fp32 share promotes element by element (exact), rounds once, and needs
    # no fp32 copy of out.
    folded = (out * kept.unsqueeze(-1)).to(out.dtype)
    return folded, (torch.logaddexp(lse, sink) if with_lse else None)
