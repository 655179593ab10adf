"""Packed sequences: ``flash_attention_varlen`` (FlashAttention's varlen interface) and nested
jagged tensors in ``flash_attention`` (SDPA's), both on ``flash_inductor::attention_varlen_*``.

A padding-free batch (HF's ``DataCollatorWithFlattening``, TRL packing, a vision tower's images of
different sizes) concatenates its sequences along the rows. Each sequence attends only within
itself; here no key of another sequence is visited and no (total, total) mask is ever built
(``ops/varlen.py``).
"""

from __future__ import annotations

import math
import operator
import weakref

import torch
from torch import Tensor

from .monitoring import eager as _monitor_eager
from .monitoring import ops as _monitor_ops  # registers the recording ops
from .ops import attention as _attention_ops  # noqa: F401  (registers the dense ops the varlen ops call)
from .ops import varlen as _varlen_ops
from .ops.sinks import fold_sinks
from .ops.varlen_one_pass import attention_varlen_one_pass, varlen_one_pass_applies
from .launch.band import NO_WINDOW
from .schedules import get_schedule
from .variant_args import check_sinks, resolve_dropout, resolve_softcap

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def flash_attention_varlen(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    *,
    sinks: Tensor | None = None,
    schedule: str | None = None,
) -> Tensor:
    r"""Attention over packed sequences, with ``flash_attn_varlen_func``'s arguments and semantics.

    Args:
        query: ``(total_q, Hq, E)``, the sequences' query rows one after another.
        key: ``(total_k, Hkv, E)``; value: ``(total_k, Hkv, Ev)``. ``Hq`` a multiple of ``Hkv``
            (grouped-query attention: K/V indexed per group, never repeated).
        cu_seqlens_q: ``(n + 1,)`` int32 or int64, sequence b's query rows are
            ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]``; starts at 0, never decreases. For a pack of
            lengths ``seqlens``: ``F.pad(seqlens.cumsum(0), (1, 0)).int()``::

                seqlens (3, 2)  ->  cu_seqlens [0, 3, 5]     row i sees (causal):
                                                             [[T, F, F, F, F],
                                                              [T, T, F, F, F],
                                                              [T, T, T, F, F],
                                                              [F, F, F, T, F],
                                                              [F, F, F, T, T]]

        cu_seqlens_k: the same for the keys (equal to ``cu_seqlens_q`` for self-attention).
        max_seqlen_q, max_seqlen_k: the longest sequence's length, at least the true maximum (an
            error otherwise, where FlashAttention would compute a wrong result).
        dropout_p: as ``flash_attention``'s; sequence b's mask is drawn from its own stream.
        softmax_scale: default ``1 / sqrt(E)``.
        causal: per sequence, aligned at the bottom right as FlashAttention aligns it: with
            ``Lq != Lk``, query i sees keys ``j <= i + Lk - Lq``; a row that sees no key returns 0.
        window_size: ``(left, right)`` sliding window per sequence, FlashAttention's (``-1`` an
            open side; bottom-right diagonal).
        softcap: 0 (none) or the cap c: scores become ``c * tanh(s / c)`` (``flash_attention``'s).
        sinks: ``(Hq,)`` per-head sink logits, as ``flash_attention``'s.
        schedule: the precision schedule, as ``flash_attention``'s.

    Returns:
        ``(total_q, Hq, Ev)`` in the input dtype. Differentiable in query, key, value and sinks.
    """
    _check_packed(query, key, value)
    _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, query)
    _check_max_seqlens(max_seqlen_q, max_seqlen_k, cu_seqlens_q, cu_seqlens_k, query.shape[0], key.shape[0])
    window_left, window_right = _check_window(window_size)
    causal = _check_bool("causal", causal)
    scale = 1.0 / math.sqrt(query.shape[-1]) if softmax_scale is None else float(softmax_scale)
    if not math.isfinite(scale):
        raise ValueError(f"flash_attention_varlen: softmax_scale must be finite or None, got {softmax_scale!r}.")
    return packed_attention(query, key, value, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                            dropout_p, scale, causal,
                            causal_lower_right=True, window=(window_left, window_right),
                            softcap=resolve_softcap(softcap, "flash_attention_varlen"), sinks=sinks,
                            schedule=schedule, eager_monitor_site=_monitor_eager.eager_site())


def packed_attention(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, scale,
                     is_causal, *,
                     causal_lower_right, window=NO_WINDOW, softcap=0.0, sinks=None, schedule=None,
                     caller="flash_attention_varlen", monitor_site=None, eager_monitor_site=None) -> Tensor:
    """The varlen op on checked, packed ``(total, H, E)`` inputs, with the sinks folded in.

    ``monitor_site`` (a graph's call) / ``eager_monitor_site`` (an eager call) record the call in
    ``flash_inductor.monitor()`` as ``api.attention`` does; the largest-logit bound uses the
    longest key sequence (``max_seqlen_k``)."""
    dropout_p = resolve_dropout(dropout_p, caller)
    check_sinks(sinks, query, query.shape[1], caller)
    precision = get_schedule(schedule)
    if precision.fp8_forward:
        raise ValueError(f"{caller}: schedule='fp8' does not take packed sequences yet; use a 16-bit schedule.")
    if monitor_site is not None and eager_monitor_site is not None:
        raise ValueError(f"{caller}: pass monitor_site (a compiled graph) or eager_monitor_site (eager code), not both.")
    rng_seed = None
    if dropout_p > 0.0:
        rng_seed = torch.randint(0, 2**62, (1,), dtype=torch.int64, device=query.device)
    if monitor_site is not None:
        query, key, value = _monitor_ops.watch_inputs(query, key, value, monitor_site)
    elif eager_monitor_site is not None:
        query, key, value = _monitor_eager.watch_gradients(query, key, value, eager_monitor_site)
    if varlen_one_pass_applies(query, key, value, dropout_p, scale, precision.name, softcap):
        # `stable` on the Gluon Hopper kernels: the exact Δ in a one-pass backward (ops/varlen_one_pass.py).
        out, lse = attention_varlen_one_pass(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                             max_seqlen_k, is_causal, causal_lower_right, scale, window[0], window[1])
    else:
        out, lse = torch.ops.flash_inductor.attention_varlen_forward(
            query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, rng_seed, float(dropout_p),
            is_causal, causal_lower_right, scale, precision.name, window[0], window[1], softcap)
    if sinks is not None:
        # As api.attention: the monitor keeps the keys' LSE (a row that sees no key stays fully masked).
        out, _ = fold_sinks(out, lse.transpose(0, 1), sinks, with_lse=False)
    if monitor_site is not None:
        out = _monitor_ops.watch_output(out, lse, monitor_site, max_seqlen_k)
    elif eager_monitor_site is not None:
        _monitor_eager.record_forward(out, lse, eager_monitor_site, max_seqlen_k)
    return out


def nested_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, *, schedule, window,
                     block_mask, softcap, sinks, eager_monitor_site=None) -> Tensor:
    """``flash_attention`` on nested jagged tensors, as SDPA takes them: ``(B, H, j, E)`` with the
    ragged sequence dim at 2 (``nt.transpose(1, 2)`` of a ``(B, j, H, E)`` jagged tensor). Causal
    masking is top-left per sequence (SDPA's ``is_causal``). Returns a jagged ``(B, Hq, j, Ev)``
    with the query's offsets."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not (isinstance(t, Tensor) and t.is_nested and t.layout == torch.jagged and t.dim() == 4
                and t._ragged_idx == 2):
            raise ValueError(
                f"flash_attention: with a nested query, {name} must be a nested jagged tensor (B, H, j, E) with the "
                "ragged dim at 2, as scaled_dot_product_attention takes them: build (B, j, H, E) with "
                "torch.nested.nested_tensor(..., layout=torch.jagged) and pass .transpose(1, 2)."
            )
    for name, unsupported in (("attn_mask", attn_mask), ("block_mask", block_mask)):
        if unsupported is not None:
            raise ValueError(f"flash_attention: {name} is not supported with nested jagged inputs; pass the mask's "
                             "structure as lengths (the nested tensor's offsets) or use padded dense inputs.")
    if window is not None:
        raise ValueError("flash_attention: window is not supported with nested inputs yet; use "
                         "flash_attention_varlen(..., window_size=) on the packed values.")
    packed = [t.transpose(1, 2) for t in (query, key, value)]  # (B, j, H, E): values() is (total, H, E)
    q, k, v = (t.values() for t in packed)
    offsets_q, offsets_k = packed[0].offsets(), packed[1].offsets()
    if k.shape[1] != q.shape[1] and not enable_gqa:
        raise ValueError(f"flash_attention: query has {q.shape[1]} heads but key/value have {k.shape[1]}; for "
                         "grouped-query attention pass enable_gqa=True.")
    _check_packed(q, k, v, caller="flash_attention")
    longest_q, longest_k = (_longest(t) for t in packed[:2])
    out = packed_attention(q, k, v, offsets_q, offsets_k, longest_q, longest_k, dropout_p, scale, is_causal,
                           causal_lower_right=False,
                           softcap=softcap, sinks=sinks, schedule=schedule, caller="flash_attention",
                           eager_monitor_site=eager_monitor_site)
    return torch.nested.nested_tensor_from_jagged(out, offsets_q).transpose(1, 2)


def _longest(nested: Tensor) -> int:
    """The longest sequence of a (B, j, H, E) jagged tensor: its cached maximum where it has one,
    else read off its offsets (one small host read)."""
    cached = getattr(nested, "_maybe_max_seqlen", None)
    if isinstance(cached, int):
        return cached
    offsets = nested.offsets()
    return int((offsets[1:] - offsets[:-1]).max()) if offsets.numel() > 1 else 0


def _check_packed(query, key, value, caller: str = "flash_attention_varlen") -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor) or t.dim() != 3:
            raise ValueError(f"{caller}: {name} must be a packed (total, heads, head_dim) tensor, got "
                             f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}.")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{caller}: {name} has dtype {t.dtype}; supported are float16, bfloat16, float32, float64.")
    if not (query.dtype == key.dtype == value.dtype) or not (query.device == key.device == value.device):
        raise ValueError(f"{caller}: query, key and value must share a dtype and a device, got "
                         f"{query.dtype}/{query.device}, {key.dtype}/{key.device}, {value.dtype}/{value.device}.")
    if key.shape[-1] != query.shape[-1] or key.shape[:2] != value.shape[:2]:
        raise ValueError(f"{caller}: key {tuple(key.shape)} must match query's head dim and value's rows and heads "
                         f"(query {tuple(query.shape)}, value {tuple(value.shape)}).")
    heads_q, heads_kv = query.shape[1], key.shape[1]
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(f"{caller}: the query heads ({heads_q}) must be a multiple of the key/value heads ({heads_kv}).")


def _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, query) -> None:
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, Tensor) or cu.dim() != 1 or cu.dtype not in (torch.int32, torch.int64) or len(cu) < 1:
            raise ValueError(f"flash_attention_varlen: {name} must be a 1-D int32 or int64 tensor of n + 1 offsets, got "
                             f"{cu.dtype if isinstance(cu, Tensor) else type(cu).__name__}"
                             f"{tuple(cu.shape) if isinstance(cu, Tensor) else ''}.")
        if cu.device != query.device:
            raise ValueError(f"flash_attention_varlen: {name} is on {cu.device} but query is on {query.device}.")
    if len(cu_seqlens_q) != len(cu_seqlens_k):
        raise ValueError(f"flash_attention_varlen: cu_seqlens_q ({len(cu_seqlens_q)}) and cu_seqlens_k "
                         f"({len(cu_seqlens_k)}) must describe the same number of sequences.")


def _check_max_seqlens(max_seqlen_q, max_seqlen_k, cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int) -> None:
    """Ints at least the longest sequence's length. Eagerly the offsets are checked here, before any
    work, with one small host read per pair of offset tensors (a model passes the same ones to
    every layer: ``_CHECKED``); under torch.compile they are trusted, as FlashAttention trusts
    them, and the kernels clamp them to the packed tensors."""
    for name, bound in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        try:
            operator.index(bound)
        except TypeError:
            raise ValueError(f"flash_attention_varlen: {name} must be an int, got {bound!r}.") from None
    if torch.compiler.is_compiling():
        return
    longest_q, longest_k = _checked_lengths(cu_seqlens_q, cu_seqlens_k, total_q, total_k)
    for name, bound, longest in (("max_seqlen_q", max_seqlen_q, longest_q), ("max_seqlen_k", max_seqlen_k, longest_k)):
        if bound < longest:
            raise ValueError(f"flash_attention_varlen: {name}={bound} is below the longest sequence ({longest}); "
                             "pass the true maximum, e.g. int(seqlens.max()).")


# Offsets already checked, by id(cu_seqlens_q): (a weak reference to it, (its version, cu_seqlens_k's
# id and version, the packed lengths), (longest query, longest key sequence)). Weak, so a model's
# offsets die with its batch; bounded, so a long run of fresh ones cannot grow it.
_CHECKED: dict[int, tuple] = {}
_CHECKED_MAX = 64


def _checked_lengths(cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int) -> tuple[int, int]:
    stamp = (cu_seqlens_q._version, id(cu_seqlens_k), cu_seqlens_k._version, total_q, total_k)
    cached = _CHECKED.get(id(cu_seqlens_q))
    if cached is not None and cached[0]() is cu_seqlens_q and cached[1] == stamp:
        return cached[2]
    bounds = _varlen_ops.sequence_bounds(cu_seqlens_q, cu_seqlens_k, total_q, total_k)
    longest = (max((q1 - q0 for q0, q1, _, _ in bounds), default=0),
               max((k1 - k0 for _, _, k0, k1 in bounds), default=0))
    if len(_CHECKED) >= _CHECKED_MAX:
        _CHECKED.clear()
    _CHECKED[id(cu_seqlens_q)] = (weakref.ref(cu_seqlens_q), stamp, longest)
    return longest


def _check_window(window_size) -> tuple[int, int]:
    if window_size is None:
        return NO_WINDOW
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2 or \
            not all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window_size):
        raise ValueError(f"flash_attention_varlen: window_size must be a (left, right) pair of ints >= -1 "
                         f"(-1 = unbounded), got {window_size!r}.")
    return int(window_size[0]), int(window_size[1])


def _check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"flash_attention_varlen: {name} must be a bool, got {value!r}.")
    return value
