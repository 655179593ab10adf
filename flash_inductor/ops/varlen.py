"""The packed-sequence ops: ``flash_inductor::attention_varlen_forward`` / ``_backward``.

Inputs are packed as FlashAttention's varlen functions take them: query ``(total_q, Hq, E)``, key
``(total_k, Hkv, E)``, value ``(total_k, Hkv, Ev)``, and ``cu_seqlens_q`` / ``cu_seqlens_k``
``(n + 1,)`` int32/int64 with sequence b's rows at ``[cu[b], cu[b + 1])``. Outputs: out
``(total_q, Hq, Ev)`` and lse ``(Hq, total_q)`` (FlashAttention's varlen LSE layout), natural log.

Each sequence is its own attention problem: no key of another sequence is ever visited and no
mask exists. On an sm_90 GPU the Gluon Hopper kernels run every sequence in one launch per pass
where they take the call (``launch/hopper_varlen.py``: bf16/fp16, E 64/128, no dropout or soft
cap; the backward under `fast`, whose Δ needs no forward residual: `stable` packs reach the Gluon
backward through ``ops/varlen_one_pass.py``), else, with the reason logged, the Triton kernels do
(``VARLEN``: a program column per (sequence, head), ``launch/packed.py``), both reading
``cu_seqlens`` on the device; elsewhere (CPU, float64, what the kernels do not take) each sequence
runs the dense op's reference path on a strided view, its bounds read on the host. Causal masking is per sequence,
aligned at the bottom right (``causal_lower_right``, FlashAttention's) or the top left (SDPA's, for
nested tensors); the window, the soft cap, GQA, dropout and the schedule are the dense op's.
Sequence b draws its dropout from ``seed + b`` with the counters of a one-sequence call, so both
paths drop the same elements and equal-length sequences get independent masks.

The ops are opaque to ``torch.compile``. ``max_seqlen_q`` / ``max_seqlen_k`` size the kernels'
grid; the Python entry points check them and the offsets (``flash_inductor.varlen``).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import launch
from ..launch import hopper, hopper_bwd, hopper_varlen
from ..launch.packed import PackedSequences
from .varlen_one_pass import addressable
from ..launch.visibility import Visibility
from ..schedules import get_schedule


def sequence_bounds(cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, total_q: int, total_k: int) -> list[tuple]:
    """``[(q_start, q_stop, k_start, k_stop), ...]`` per sequence, checked: both start at 0, never
    decrease, and end at the packed length (every row and key belongs to a sequence, so every
    output and gradient row is written)."""
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for name, bounds, total in (("cu_seqlens_q", bounds_q, total_q), ("cu_seqlens_k", bounds_k, total_k)):
        if bounds[0] != 0 or any(b > a for a, b in zip(bounds[1:], bounds[:-1])) or bounds[-1] != total:
            raise ValueError(
                f"flash_attention_varlen: {name} must start at 0, never decrease and end at the packed length "
                f"{total}, got {bounds[:8]}{' ...' if len(bounds) > 8 else ''}; build it as "
                "torch.nn.functional.pad(seqlens.cumsum(0), (1, 0)).int() (slice the packed tensors to "
                "cu_seqlens[-1] rows if they are padded)."
            )
    return [(q0, q1, k0, k1) for q0, q1, k0, k1 in zip(bounds_q[:-1], bounds_q[1:], bounds_k[:-1], bounds_k[1:])]


def _as_batch_of_one(packed: Tensor, start: int, stop: int) -> Tensor:
    """Rows [start, stop) of a packed (total, H, E) tensor as a (1, H, rows, E) view."""
    return _packed_view(packed[start:stop])


def _causal_offset(is_causal: bool, causal_lower_right: bool, len_q: int, len_k: int) -> int:
    return len_k - len_q if is_causal and causal_lower_right else 0


def _sequence_seed(rng_seed: Optional[Tensor], index: int) -> Optional[Tensor]:
    return None if rng_seed is None else rng_seed + index


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _packed_view(packed: Tensor) -> Tensor:
    """A packed (total, H, E) tensor as the (1, H, total, E) view the launchers take."""
    return packed.transpose(0, 1).unsqueeze(0)


def _on_kernels(query: Tensor, key: Tensor, value: Tensor, schedule: str) -> bool:
    """Whether the Triton kernels take the whole pack (one launch a pass)."""
    return not get_schedule(schedule).fp8_forward and launch.kernel_supports(
        _packed_view(query), _packed_view(key), _packed_view(value))


def _gluon_reason(query, key, value, dropout_p: float, scale: float, schedule: str, softcap: float, *,
                  backward: bool) -> Optional[str]:
    """None if the Gluon Hopper kernels take the whole pack (``launch/hopper_varlen.py``; tensors
    TMA cannot address are copied), else why not. The backward here needs `fast`'s Δ: `stable`'s
    exact Δ needs the one-pass forward's residual, which only ``ops/varlen_one_pass.py`` carries."""
    views = (_packed_view(query), _packed_view(key), _packed_view(value))
    reason = hopper_varlen.varlen_unsupported_reason(*views, dropout_p, scale, schedule, softcap=softcap,
                                                     backward=backward)
    if reason is None and backward and get_schedule(schedule).exact_delta:
        reason = hopper_bwd.NO_RESIDUAL
    if reason is None and (query.shape[0] == 0 or key.shape[0] == 0):
        reason = "an empty pack"
    return reason


def _packing(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal_lower_right) -> PackedSequences:
    return PackedSequences(cu_seqlens_q.to(torch.int32), cu_seqlens_k.to(torch.int32), max_seqlen_q, max_seqlen_k,
                           lower_right=causal_lower_right)


def _visibility(is_causal: bool, window_left: int, window_right: int) -> Visibility:
    """The rules relative to each sequence's diagonal (``PackedSequences.band`` places them)."""
    return Visibility(is_causal=is_causal, causal_offset=0, window=(window_left, window_right))


@torch.library.custom_op("flash_inductor::attention_varlen_forward", mutates_args=())
def attention_varlen_forward(
    query: Tensor, key: Tensor, value: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
    max_seqlen_q: int, max_seqlen_k: int,
    rng_seed: Optional[Tensor], dropout_p: float, is_causal: bool, causal_lower_right: bool, scale: float,
    schedule: str, window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
) -> tuple[Tensor, Tensor]:
    on_cuda = query.is_cuda
    reason = _gluon_reason(query, key, value, dropout_p, scale, schedule, softcap, backward=False) if on_cuda else None
    if on_cuda and reason is None:
        query, key, value = (addressable(t) for t in (query, key, value))
        out, lse = hopper_varlen.hopper_varlen_forward(
            _packed_view(query), _packed_view(key), _packed_view(value),
            _packing(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal_lower_right), scale=scale,
            visibility=_visibility(is_causal, window_left, window_right))
        return out[0].transpose(0, 1), lse[0]  # (total_q, Hq, Ev) contiguous, (Hq, total_q)
    if on_cuda:
        hopper.log_triton_forward(reason)
    if _on_kernels(query, key, value, schedule):
        out, lse = launch.attention_forward(
            _packed_view(query), _packed_view(key), _packed_view(value), None, rng_seed, dropout_p, scale, schedule,
            visibility=_visibility(is_causal, window_left, window_right), softcap=softcap,
            packed=_packing(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal_lower_right))
        return out[0].transpose(0, 1), lse[0]  # (total_q, Hq, Ev) contiguous, (Hq, total_q)
    out = query.new_zeros((query.shape[0], query.shape[1], value.shape[-1]))
    lse = torch.full((query.shape[1], query.shape[0]), float("-inf"), dtype=_lse_dtype(query.dtype),
                     device=query.device)
    for index, (q0, q1, k0, k1) in enumerate(sequence_bounds(cu_seqlens_q, cu_seqlens_k, query.shape[0],
                                                             key.shape[0])):
        if q1 == q0 or k1 == k0:
            continue  # no rows, or rows that see no key: 0 and -inf, as the dense op gives them
        seq_out, seq_lse = torch.ops.flash_inductor.attention_forward(
            _as_batch_of_one(query, q0, q1), _as_batch_of_one(key, k0, k1), _as_batch_of_one(value, k0, k1), None,
            _sequence_seed(rng_seed, index), dropout_p, is_causal,
            _causal_offset(is_causal, causal_lower_right, q1 - q0, k1 - k0), scale, schedule, window_left,
            window_right, None, 0, 0, softcap)
        out[q0:q1] = seq_out[0].transpose(0, 1)
        lse[:, q0:q1] = seq_lse[0]
    return out, lse


@torch.library.custom_op("flash_inductor::attention_varlen_backward", mutates_args=())
def attention_varlen_backward(
    grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor,
    grad_lse: Optional[Tensor], cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
    rng_seed: Optional[Tensor], dropout_p: float, is_causal: bool, causal_lower_right: bool, scale: float,
    schedule: str, window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    on_cuda = query.is_cuda
    reason = _gluon_reason(query, key, value, dropout_p, scale, schedule, softcap, backward=True) if on_cuda else None
    if on_cuda and reason is None:
        grad_out, query, key, value = (addressable(t) for t in (grad_out, query, key, value))
        dq, dk, dv = hopper_varlen.hopper_varlen_backward(
            _packed_view(grad_out), _packed_view(query), _packed_view(key), _packed_view(value), _packed_view(out),
            lse.unsqueeze(0), None if grad_lse is None else grad_lse.unsqueeze(0),
            _packing(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal_lower_right), scale=scale,
            visibility=_visibility(is_causal, window_left, window_right))
        # dk and dv are views of contiguous packed tensors already; dq is cast from the fp32 sum.
        return tuple(g[0].transpose(0, 1).contiguous() for g in (dq, dk, dv))
    if on_cuda:
        hopper_bwd.log_triton_backward(reason)
    if _on_kernels(query, key, value, schedule):
        dq, dk, dv, _ = launch.attention_backward(
            _packed_view(grad_out), _packed_view(query), _packed_view(key), _packed_view(value), None,
            _packed_view(out), lse.unsqueeze(0), None if grad_lse is None else grad_lse.unsqueeze(0), rng_seed,
            dropout_p, scale, schedule, False, visibility=_visibility(is_causal, window_left, window_right),
            softcap=softcap,
            packed=_packing(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal_lower_right))
        # The launcher lays the gradients out as the inputs are; the schema promises contiguous ones
        # (the fake's), so an input that arrived permuted costs one copy here rather than a layout
        # a compiled graph did not plan for.
        return tuple(g[0].transpose(0, 1).contiguous() for g in (dq, dk, dv))
    # Zero-filled (rows of empty sequences get no gradient) and contiguous whatever the inputs' strides.
    grad_query, grad_key, grad_value = (t.new_zeros(t.shape) for t in (query, key, value))
    for index, (q0, q1, k0, k1) in enumerate(sequence_bounds(cu_seqlens_q, cu_seqlens_k, query.shape[0],
                                                             key.shape[0])):
        if q1 == q0 or k1 == k0:
            continue
        seq_grad_lse = None if grad_lse is None else grad_lse[:, q0:q1].unsqueeze(0)
        dq, dk, dv, _ = torch.ops.flash_inductor.attention_backward(
            _as_batch_of_one(grad_out, q0, q1), _as_batch_of_one(query, q0, q1), _as_batch_of_one(key, k0, k1),
            _as_batch_of_one(value, k0, k1), None, _as_batch_of_one(out, q0, q1), lse[:, q0:q1].unsqueeze(0),
            seq_grad_lse, _sequence_seed(rng_seed, index), dropout_p, is_causal,
            _causal_offset(is_causal, causal_lower_right, q1 - q0, k1 - k0), scale, schedule, False, window_left,
            window_right, None, 0, 0, softcap)
        grad_query[q0:q1] = dq[0].transpose(0, 1)
        grad_key[k0:k1] = dk[0].transpose(0, 1)
        grad_value[k0:k1] = dv[0].transpose(0, 1)
    return grad_query, grad_key, grad_value


@attention_varlen_forward.register_fake
def _forward_fake(query, key, value, *_options):
    out = query.new_empty((query.shape[0], query.shape[1], value.shape[-1]))
    return out, query.new_empty((query.shape[1], query.shape[0]), dtype=_lse_dtype(query.dtype))


@attention_varlen_backward.register_fake
def _backward_fake(grad_out, query, key, value, *_options):
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


def _setup_context(ctx, inputs, output):
    query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, rng_seed, *options = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, cu_seqlens_q, cu_seqlens_k, rng_seed, out, lse)
    ctx.max_seqlens = (max_seqlen_q, max_seqlen_k)
    ctx.options = options
    ctx.set_materialize_grads(False)  # an unused LSE reaches the backward as None, no fill


def _backward(ctx, grad_out, grad_lse):
    if grad_out is None and grad_lse is None:
        return (None,) * (8 + len(ctx.options))
    query, key, value, cu_seqlens_q, cu_seqlens_k, rng_seed, out, lse = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    grads = attention_varlen_backward(grad_out, query, key, value, out, lse, grad_lse, cu_seqlens_q, cu_seqlens_k,
                                      *ctx.max_seqlens, rng_seed, *ctx.options)
    return (*grads,) + (None,) * (5 + len(ctx.options))


attention_varlen_forward.register_autograd(_backward, setup_context=_setup_context)


def _refuse_double_backward(ctx, *grads):
    raise RuntimeError("flash_inductor: double backward through varlen attention is not supported.")


attention_varlen_backward.register_autograd(_refuse_double_backward, setup_context=lambda ctx, inputs, output: None)
