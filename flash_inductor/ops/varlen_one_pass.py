"""The `stable` schedule on packed sequences with the Gluon Hopper kernels: ops/one_pass.py's exact Δ
in a one-pass backward, for a pack (``launch/hopper_varlen.py``).

The forward rounds P so that the backward can repeat it and stores O's rounding residual and the
row constants; the backward forms the exact Δ from them and runs the one-pass kernel with dQ over
the centred keys (k̂ per KV head over the whole pack), as the dense one-pass ops do. The packed ops
(``ops/varlen.py``) return only (out, lse), so the path has its own pair:

* ``flash_inductor::attention_varlen_forward_one_pass(q, k, v, cu_seqlens_q, cu_seqlens_k,
  max_seqlen_q, max_seqlen_k, is_causal, causal_lower_right, scale, window_left=-1,
  window_right=-1) -> (out, lse, residual, row_constants)``: out and residual (total_q, Hq, E),
  lse (Hq, total_q), row_constants (2, Hq, total_q);
* ``flash_inductor::attention_varlen_backward_one_pass(dout, q, k, v, out, lse, dlse?, residual,
  row_constants, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
  causal_lower_right, scale, window_left=-1, window_right=-1) -> (dq, dk, dv)``.

``flash_inductor.varlen.packed_attention`` takes them where :func:`varlen_one_pass_applies` says so,
from static properties alone, so a traced graph holds them exactly where they run. Under
``torch.use_deterministic_algorithms(True)`` the backward runs the Triton `stable` kernels, which
take the same out and lse.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import launch
from ..launch import hopper, hopper_bwd, hopper_varlen
from ..launch.packed import PackedSequences
from ..launch.visibility import Visibility


def varlen_one_pass_applies(query, key, value, dropout_p: float, scale: float, schedule: str, softcap: float) -> bool:
    """Whether a packed call ((total, H, E) tensors) takes this path: a `stable` call neither kernel
    finds anything against (``launch.hopper_bwd.one_pass_unsupported_reason``), without a soft cap
    (the packed launchers take none yet). Static properties only."""
    if softcap or not query.is_cuda:
        return False
    views = [packed_view(t) for t in (query, key, value)]
    return hopper_bwd.one_pass_unsupported_reason(*views, None, dropout_p, scale, schedule) is None


def packed_view(packed: Tensor) -> Tensor:
    """A packed (total, H, E) tensor as the (1, H, total, E) view the launchers take."""
    return packed.transpose(0, 1).unsqueeze(0)


def addressable(t: Tensor) -> Tensor:
    """A packed tensor as it is where TMA can address its view, else a contiguous copy (a clone: a
    contiguous tensor at an unaligned offset is its own ``.contiguous()``)."""
    return t if hopper.tma_addressable(packed_view(t)) else t.clone(memory_format=torch.contiguous_format)


def _packing(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal_lower_right) -> PackedSequences:
    return PackedSequences(cu_seqlens_q.to(torch.int32), cu_seqlens_k.to(torch.int32), max_seqlen_q, max_seqlen_k,
                           lower_right=causal_lower_right)


def _visibility(is_causal: bool, window_left: int, window_right: int) -> Visibility:
    return Visibility(is_causal=is_causal, causal_offset=0, window=(window_left, window_right))


@torch.library.custom_op("flash_inductor::attention_varlen_forward_one_pass", mutates_args=())
def attention_varlen_forward_one_pass(
    query: Tensor, key: Tensor, value: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
    max_seqlen_k: int, is_causal: bool, causal_lower_right: bool, scale: float, window_left: int = -1,
    window_right: int = -1,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    total_q, heads_q, _ = query.shape
    if total_q == 0 or key.shape[0] == 0:
        out = query.new_zeros((total_q, heads_q, value.shape[-1]))
        lse = query.new_full((heads_q, total_q), float("-inf"), dtype=torch.float32)
        return out, lse, torch.zeros_like(out), torch.stack([torch.full_like(lse, float("inf")), torch.zeros_like(lse)])
    query, key, value = (addressable(t) for t in (query, key, value))
    out, lse, resid, row_consts = hopper_varlen.hopper_varlen_forward(
        packed_view(query), packed_view(key), packed_view(value),
        _packing(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal_lower_right), scale=scale,
        visibility=_visibility(is_causal, window_left, window_right), exact_delta=True)
    # The launcher's outputs are views of contiguous (total, H, E) tensors.
    return out[0].transpose(0, 1), lse[0], resid[0].transpose(0, 1), row_consts[:, 0]


@torch.library.custom_op("flash_inductor::attention_varlen_backward_one_pass", mutates_args=())
def attention_varlen_backward_one_pass(
    grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor, grad_lse: Optional[Tensor],
    resid: Tensor, row_consts: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
    max_seqlen_k: int, is_causal: bool, causal_lower_right: bool, scale: float, window_left: int = -1,
    window_right: int = -1,
) -> tuple[Tensor, Tensor, Tensor]:
    packing = _packing(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal_lower_right)
    visibility = _visibility(is_causal, window_left, window_right)
    grad_lse_view = None if grad_lse is None else grad_lse.unsqueeze(0)
    if torch.are_deterministic_algorithms_enabled() or query.shape[0] == 0 or key.shape[0] == 0:
        # The Triton `stable` backward re-derives the exact Δ from out and lse in a fixed order.
        dq, dk, dv, _ = launch.attention_backward(
            packed_view(grad_out), packed_view(query), packed_view(key), packed_view(value), None, packed_view(out),
            lse.unsqueeze(0), grad_lse_view, None, 0.0, scale, "stable", False, visibility=visibility, packed=packing)
    else:
        grad_out, query, key, value = (addressable(t) for t in (grad_out, query, key, value))
        dq, dk, dv = hopper_varlen.hopper_varlen_backward(
            packed_view(grad_out), packed_view(query), packed_view(key), packed_view(value), packed_view(out),
            lse.unsqueeze(0), grad_lse_view, packing, scale=scale, visibility=visibility,
            exact_delta=(packed_view(resid), row_consts.unsqueeze(1)))
    return tuple(g[0].transpose(0, 1).contiguous() for g in (dq, dk, dv))


@attention_varlen_forward_one_pass.register_fake
def _forward_fake(query, key, value, *_options):
    total_q, heads_q, _ = query.shape
    out = query.new_empty((total_q, heads_q, value.shape[-1]))
    lse = query.new_empty((heads_q, total_q), dtype=torch.float32)
    return out, lse, torch.empty_like(out), query.new_empty((2, heads_q, total_q), dtype=torch.float32)


@attention_varlen_backward_one_pass.register_fake
def _backward_fake(grad_out, query, key, value, *_rest):
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


def _setup_context(ctx, inputs, output):
    query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *options = inputs
    out, lse, resid, row_consts = output
    ctx.save_for_backward(query, key, value, cu_seqlens_q, cu_seqlens_k, out, lse, resid, row_consts)
    ctx.max_seqlens = (max_seqlen_q, max_seqlen_k)
    ctx.options = options
    ctx.input_count = len(inputs)
    ctx.set_materialize_grads(False)  # an unused LSE reaches the backward as None, no fill


def _backward(ctx, grad_out, grad_lse, *_grad_backward_only):
    if grad_out is None and grad_lse is None:
        return (None,) * ctx.input_count
    query, key, value, cu_seqlens_q, cu_seqlens_k, out, lse, resid, row_consts = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    grads = attention_varlen_backward_one_pass(grad_out, query, key, value, out, lse, grad_lse, resid, row_consts,
                                               cu_seqlens_q, cu_seqlens_k, *ctx.max_seqlens, *ctx.options)
    return (*grads,) + (None,) * (ctx.input_count - 3)


attention_varlen_forward_one_pass.register_autograd(_backward, setup_context=_setup_context)


def _refuse_double_backward(ctx, *grads):
    raise RuntimeError("flash_inductor: double backward through varlen attention is not supported.")


attention_varlen_backward_one_pass.register_autograd(_refuse_double_backward,
                                                     setup_context=lambda ctx, inputs, output: None)


def attention_varlen_one_pass(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                              is_causal: bool, causal_lower_right: bool, scale: float, window_left: int = -1,
                              window_right: int = -1) -> tuple[Tensor, Tensor]:
    """(out, lse) of the path, through the registered op."""
    return torch.ops.flash_inductor.attention_varlen_forward_one_pass(
        query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, causal_lower_right,
        scale, window_left, window_right)[:2]


__all__ = ["attention_varlen_forward_one_pass", "attention_varlen_backward_one_pass", "attention_varlen_one_pass",
           "varlen_one_pass_applies"]
