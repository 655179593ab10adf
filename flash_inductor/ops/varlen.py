"""The packed-sequence ops: ``flash_inductor::attention_varlen_forward`` / ``_backward``.

Inputs are packed as FlashAttention's varlen functions take them: query ``(total_q, Hq, E)``, key
``(total_k, Hkv, E)``, value ``(total_k, Hkv, Ev)``, and ``cu_seqlens_q`` / ``cu_seqlens_k``
``(n + 1,)`` int32/int64 with sequence b's rows at ``[cu[b], cu[b + 1])``. Outputs: out
``(total_q, Hq, Ev)`` and lse ``(Hq, total_q)`` (FlashAttention's varlen LSE layout), natural log.

Each sequence runs as its own attention problem on a strided view of the packed tensors: the dense
op (``ops/attention.py``) with batch 1, its kernels or its reference path, so no key of another
sequence is ever visited and no mask exists. Causal masking is per sequence, aligned at the
bottom right (``causal_lower_right``, FlashAttention's) or the top left (SDPA's, for nested
tensors); the window, the soft cap, GQA, dropout and the schedule are the dense op's. Sequence b
draws its dropout from ``seed + b``, so equal-length sequences get independent masks.

The ops are opaque to ``torch.compile``: the sequence bounds are read on the host inside them
(one device-to-host copy of ``cu_seqlens`` a call), never in a traced graph. One launch set per
sequence: a pack of many short sequences is bound by host time (docs/performance.md, varlen).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

_CU_DTYPES = (torch.int32, torch.int64)


def sequence_bounds(cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, total_q: int, total_k: int) -> list[tuple]:
    """``[(q_start, q_stop, k_start, k_stop), ...]`` per sequence, checked: both start at 0, never
    decrease, and stay within the packed tensors."""
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for name, bounds, total in (("cu_seqlens_q", bounds_q, total_q), ("cu_seqlens_k", bounds_k, total_k)):
        if bounds[0] != 0 or any(b > a for a, b in zip(bounds[1:], bounds[:-1])) or bounds[-1] > total:
            raise ValueError(
                f"flash_attention_varlen: {name} must start at 0, never decrease and end at most at the packed "
                f"length {total}, got {bounds[:8]}{' ...' if len(bounds) > 8 else ''}; build it as "
                "torch.nn.functional.pad(seqlens.cumsum(0), (1, 0)).int()."
            )
    return [(q0, q1, k0, k1) for q0, q1, k0, k1 in zip(bounds_q[:-1], bounds_q[1:], bounds_k[:-1], bounds_k[1:])]


def _as_batch_of_one(packed: Tensor, start: int, stop: int) -> Tensor:
    """Rows [start, stop) of a packed (total, H, E) tensor as a (1, H, rows, E) view."""
    return packed[start:stop].transpose(0, 1).unsqueeze(0)


def _causal_offset(is_causal: bool, causal_lower_right: bool, len_q: int, len_k: int) -> int:
    return len_k - len_q if is_causal and causal_lower_right else 0


def _sequence_seed(rng_seed: Optional[Tensor], index: int) -> Optional[Tensor]:
    return None if rng_seed is None else rng_seed + index


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.library.custom_op("flash_inductor::attention_varlen_forward", mutates_args=())
def attention_varlen_forward(
    query: Tensor, key: Tensor, value: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
    rng_seed: Optional[Tensor], dropout_p: float, is_causal: bool, causal_lower_right: bool, scale: float,
    schedule: str, window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
) -> tuple[Tensor, Tensor]:
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
    grad_lse: Optional[Tensor], cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, rng_seed: Optional[Tensor],
    dropout_p: float, is_causal: bool, causal_lower_right: bool, scale: float, schedule: str,
    window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    # Zero-filled: rows of empty sequences, and keys past cu_seqlens_k[-1], get no gradient.
    grad_query, grad_key, grad_value = (torch.zeros_like(t) for t in (query, key, value))
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
    query, key, value, cu_seqlens_q, cu_seqlens_k, rng_seed, *options = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, cu_seqlens_q, cu_seqlens_k, rng_seed, out, lse)
    ctx.options = options
    ctx.set_materialize_grads(False)  # an unused LSE reaches the backward as None, no fill


def _backward(ctx, grad_out, grad_lse):
    if grad_out is None and grad_lse is None:
        return (None,) * (6 + len(ctx.options))
    query, key, value, cu_seqlens_q, cu_seqlens_k, rng_seed, out, lse = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    grads = attention_varlen_backward(grad_out, query, key, value, out, lse, grad_lse, cu_seqlens_q, cu_seqlens_k,
                                      rng_seed, *ctx.options)
    return (*grads,) + (None,) * (3 + len(ctx.options))


attention_varlen_forward.register_autograd(_backward, setup_context=_setup_context)


def _refuse_double_backward(ctx, *grads):
    raise RuntimeError("flash_inductor: double backward through varlen attention is not supported.")


attention_varlen_backward.register_autograd(_refuse_double_backward, setup_context=lambda ctx, inputs, output: None)
