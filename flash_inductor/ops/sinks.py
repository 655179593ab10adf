"""Attention sinks: a per-head logit that joins each row's softmax denominator and nothing else.

gpt-oss (``s_aux``) and streaming LLMs give every query head h a learned logit ``sink_h``. Row i's
weights become ``exp(s_ij) / (Σ_j exp(s_ij) + exp(sink_h))``: the sink takes a share of the
probability mass and contributes no value. With the outputs for the same row without the sink,
``out_i = Σ_j exp(s_ij - lse_i) v_j`` and ``lse_i``, that is exactly

    out'_i = out_i · σ(lse_i - sink_h)        lse'_i = log(exp(lse_i) + exp(sink_h))

``flash_inductor::attention_forward`` takes the sinks (its ``sinks`` argument) and returns
(out', lse'). The Triton forward and the Gluon Hopper forward add ``exp(sink_h - m_i)`` to the row sum
in their epilogues (HAS_SINKS), so out' is normalised once and rounded once; the paths without it
(the reference, the split-KV decode kernels, the `fp8` kernel, the packed-sequence op) run without
the sinks and :func:`fold_sinks` rescales out and lse after them.

The backward kernels need nothing more: from (out', lse'), P'_ij = exp(s_ij - lse'_i) and
Δ_i = rowsum(dO'_i ∘ out'_i) - dlse'_i give dq, dk and dv of the softmax with the sink. The sinks'
own gradient is ``d sink_h = -Σ_i exp(sink_h - lse'_i) · Δ_i``, an O(L) reduction per head:
``flash_inductor::attention_sinks_backward`` (one Triton pass over dO' and out' on the kernel path,
``launch.sinks_backward``; :func:`sinks_backward_reference` elsewhere).

Rows with no visible key (lse = -inf) keep out = 0 and get lse' = sink_h, with zero gradients for
q, k and v: the sink then holds the row's whole mass, which is the FlashAttention / gpt-oss
contract. The fold's product runs in the LSE's dtype (fp32, fp64 for fp64 inputs) and rounds once.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import launch


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


def keys_lse(lse: Tensor, sinks: Tensor) -> Tensor:
    """The keys' own LSE from lse' (B, H, L) and the sinks (H,): log(exp(lse') - exp(sink)), -inf
    where the sink holds the whole row (a row with no visible key, lse' = sink). What the monitor
    describes; it loses the digits the sink's share cancels, so it is for statistics only."""
    sink = sinks.to(lse.dtype)[None, :, None]
    # lse' >= sink on every row; the clamp keeps a last-bit excess from making log1p's argument < -1.
    share = torch.exp(torch.clamp(sink - lse, max=0.0))
    return torch.where(share >= 1.0, float("-inf"), lse + torch.log1p(-share))


def sinks_backward_reference(grad_out: Tensor, out: Tensor, lse: Tensor, grad_lse: Optional[Tensor],
                             sinks: Tensor) -> Tensor:
    """``d sink_h = -Σ_i exp(sink_h - lse'_i) · Δ_i`` in torch ops (module docstring), in the LSE's
    dtype (fp32, fp64 for fp64 inputs), returned in the sinks' dtype."""
    dtype = lse.dtype
    delta = (grad_out.to(dtype) * out.to(dtype)).sum(-1)
    if grad_lse is not None:
        delta = delta - grad_lse.to(dtype)
    sink = sinks.to(dtype)[None, :, None]
    share = torch.where(lse == float("-inf"), 0.0, torch.exp(sink - lse))
    return (-(share * delta).sum(dim=(0, 2))).to(sinks.dtype)


@torch.library.custom_op("flash_inductor::attention_sinks_backward", mutates_args=())
def attention_sinks_backward(grad_out: Tensor, out: Tensor, lse: Tensor, grad_lse: Optional[Tensor],
                             sinks: Tensor) -> Tensor:
    """d sinks (H,) from the attention op's (out', lse') (B, H, L, Ev) / (B, H, L), their gradients
    and the sinks: the Triton reduction where the kernels run, the torch formula elsewhere."""
    if launch.kernel_supports(grad_out, out, out) and lse.dtype == torch.float32:
        return launch.sinks_backward(grad_out, out, lse, grad_lse, sinks)
    return sinks_backward_reference(grad_out, out, lse, grad_lse, sinks).contiguous()


@attention_sinks_backward.register_fake
def _sinks_backward_fake(grad_out, out, lse, grad_lse, sinks):
    return torch.empty_like(sinks)


def _refuse_double_backward(ctx, *grads):
    raise RuntimeError("flash_inductor: double backward through attention (create_graph=True) is not supported; "
                       "use torch.nn.functional.scaled_dot_product_attention's math backend for that computation.")


attention_sinks_backward.register_autograd(_refuse_double_backward, setup_context=lambda ctx, inputs, output: None)
