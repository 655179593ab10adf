"""``flash_attention``: SDPA's signature and semantics on the stabilised attention op.

This module validates and normalises arguments (every error names the argument and the
fix), reshapes to the op's 4-D contract with views only, and draws the dropout seed. The
numerics live in the op (``flash_inductor.ops``) and its kernels.
"""

from __future__ import annotations

import math
import numbers
import operator

import torch
from torch import Tensor

from .monitoring import eager as _monitor_eager
from .monitoring import ops as _monitor_ops  # registers the recording ops
from .ops import attention as _attention_ops  # registers the ops
from .launch.band import NO_WINDOW
from .launch.fp8 import check_fp8_device, check_fp8_window
from .block_sparse import BlockSparseLayout, broadcast_per_head, resolve_block_mask
from .ops.sinks import keys_lse
from .variant_args import check_fp8_softcap, check_sinks, resolve_dropout, resolve_softcap
from .varlen import nested_attention
from .schedules import get_schedule

try:  # CausalBias exists in every supported torch, but keep the import failure local.
    from torch.nn.attention.bias import CausalBias, CausalVariant
except ImportError:  # pragma: no cover
    CausalBias = CausalVariant = None

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# The reference path is plain PyTorch, but we only promise (and test) these devices.
_SUPPORTED_DEVICES = ("cpu", "cuda", "meta")


def flash_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    schedule: str | None = None,
    window: tuple[int, int] | None = None,
    block_mask: BlockSparseLayout | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    r"""Scaled dot-product attention, numerically stabilised, with flash-attention memory.

    A drop-in for :func:`torch.nn.functional.scaled_dot_product_attention`::

        out = softmax(query @ key.transpose(-2, -1) * scale + mask) @ value

    computed blockwise (O(L) extra memory) with fp32 accumulation, the scale applied in
    fp32, and a log-space online softmax. Differentiable in ``query``, ``key``, ``value`` and
    a float ``attn_mask``.

    Args:
        query: ``(N, ..., Hq, L, E)``; also ``(N, L, E)`` or ``(L, E)``. fp16, bf16, fp32 (Triton
            kernel on CUDA) or fp64 / CPU tensors (blocked PyTorch path, same semantics).
        key: ``(N, ..., Hkv, S, E)``, same dtype as ``query``.
        value: ``(N, ..., Hkv, S, Ev)``; ``Ev`` may differ from ``E``.

            The leading dims of query, key and value broadcast as SDPA's do (right-aligned, size 1
            against any size, a missing dim as size 1)::

                query (2, 8, L, E)   key/value (1, 8, S, E)   ->  out (2, 8, L, Ev)
                query (2, 8, L, E)   key/value (2, 1, S, E)   ->  out (2, 8, L, Ev)   (MQA)
                query (1, 1, L, E)   key/value (2, 8, S, E)   ->  out (2, 8, L, Ev)

            A size-1 K/V head dim is read as grouped-query attention with one K/V head, other
            broadcast dims as stride-0 views, so 3-D and 4-D inputs are never repeated in memory
            (inputs of 5 or more dims are flattened to 4, which copies a broadcast leading dim).
            Each gradient is summed over the dims its tensor was broadcast along: it has that
            tensor's shape.
        attn_mask: ``None``; a bool tensor (``True`` = attend); an additive float tensor; or
            a :class:`torch.nn.attention.bias.CausalBias`. Any shape broadcastable to
            ``(N, ..., Hq, L, S)``; broadcast dims are read with stride 0, never copied::

                bool mask, L=2, S=3      additive mask
                [[T, T, F],              [[0, 0, -inf],
                 [T, T, T]]               [0, 0,  0  ]]

        dropout_p: probability of dropping an attention weight, in ``[0, 1)``. Applied
            whenever > 0 (as SDPA does); the mask is regenerated in backward from a seed drawn
            from torch's generator, so ``torch.manual_seed`` reproduces forward and backward.
        is_causal: query ``i`` attends to keys ``j <= i`` (top-left aligned, as SDPA; when
            ``L != S`` use ``CausalBias`` for lower-right alignment). Excludes ``attn_mask``.
        scale: softmax scale, any finite real number (NumPy scalars and one-element tensors too,
            as SDPA); default ``1 / sqrt(E)``.
        enable_gqa: allow ``Hq`` to be a multiple of ``Hkv`` (grouped-query / multi-query
            attention). K/V are indexed per group, never repeated in memory. As in SDPA, dim -3
            holds the heads whatever the rank: 3-D inputs are ``(H, L, E)`` under it.
        window: ``None`` or ``(left, right)``, a sliding window as FlashAttention defines it: query
            ``i`` sees key ``j`` iff ``-left <= j - (i + S - L) <= right`` (the diagonal is the
            bottom-right one); ``-1`` leaves that side unbounded. ``(w - 1, 0)`` is a causal sliding
            window of ``w`` keys, ``(w, w)`` a symmetric one. It combines with ``is_causal`` (both
            apply), ``attn_mask``, GQA and dropout; tiles wholly outside the window are skipped,
            so the work grows with ``L * window`` rather than ``L * S``::

                window=(1, 0), L = S = 4       window=(1, 1), L = S = 4
                [[T, F, F, F],                 [[T, T, F, F],
                 [T, T, F, F],                  [T, T, T, F],
                 [F, T, T, F],                  [F, T, T, T],
                 [F, F, T, T]]                  [F, F, T, T]]

        schedule: precision schedule name (``"stable"`` default, ``"fast"``, ``"accurate"``, ``"fp8"``),
            see ``flash_inductor.schedules``. ``"fp8"`` needs a GPU with fp8 tensor cores
            (compute capability 8.9+) and raises a ValueError on an older one; on CPU, as
            every schedule, it runs the float32 reference.
        block_mask: ``None``, a :class:`flash_inductor.BlockSparseLayout` or a FlexAttention
            ``BlockMask``: the (query block, key block) pairs to compute; the kernels skip the
            rest. A layout is a bool block map ``(B or 1, H or 1, ceil(L / 128), ceil(S / 128))``
            (its block size is its own, 128 by default, independent of the kernels' tiles)::

                block map (block 2), L = S = 4      what each query row sees
                [[T, F],                            [[T, T, F, F],
                 [T, T]]                             [T, T, F, F],
                                                     [T, T, T, T],
                                                     [T, T, T, T]]

            ``attn_mask``, ``is_causal`` and ``window`` apply inside the computed blocks
            (``attn_mask`` is the element mask for blocks only partly visible). A ``BlockMask``'s full blocks
            need nothing more; its partial blocks need ``attn_mask`` (the same mask, element by
            element) unless its ``mask_mod`` is ``noop_mask``, since a ``mask_mod`` cannot run in
            the kernels. A row whose blocks are all skipped returns 0.
        softcap: ``None`` (or 0), or a cap ``c > 0``: logit soft-capping as FlashAttention-2 and
            Gemma 2 define it, each scaled score ``s = scale * q.k`` becomes ``c * tanh(s / c)``
            before the mask is added; computed in fp32, with its gradient. On CUDA the Triton
            kernels run it (the Gluon Hopper and decode kernels have no cap). Not with
            ``schedule="fp8"``.
        sinks: ``None``, or attention sinks: a float tensor ``(Hq,)`` of per-query-head logits that
            join each row's softmax denominator and nothing else (gpt-oss's ``s_aux``, streaming
            LLMs)::

                weights_ij = exp(s_ij) / (sum_j exp(s_ij) + exp(sinks[h]))

            Differentiable (its gradient is ``-sum_i P_sink,i * dO_i . out_i``). A row with no
            visible key returns 0 (the sink takes all its weight), with zero gradients for q, k, v.
            On CUDA the Triton and Gluon Hopper forward kernels add the sink to each row's sum in
            their epilogues; the decode and fp8 kernels' outputs are rescaled after them.

    Returns:
        ``(N, ..., Hq, L, Ev)`` in the input dtype.

    ``torch.func`` transforms apply as to SDPA: ``grad``, ``vjp``, ``jacrev`` and ``vmap`` over them
    (per-sample gradients); ``jvp`` (forward-mode AD) and double backward raise an error.

    A query row with no visible key (all-False mask row, all ``-inf`` row, causal or window row
    with no key, a row whose layout blocks are all skipped) returns 0 with zero gradients. SDPA's
    result there depends on the torch version and
    backend: cuDNN returns wrong, non-zero values; the math backend returns 0 on current torch
    (NaN before its safe softmax, pytorch/pytorch#131060).

    Inside ``with flash_inductor.monitor() as m:`` each call also records its statistics
    (largest logit, LSE range, fully-masked rows, non-finite outputs and gradients), reading
    the output, the LSE and the gradients without copying them; outside one, monitoring costs
    a single check.
    """
    if isinstance(query, Tensor) and query.is_nested:
        return nested_attention(query, key, value, attn_mask, dropout_p, _check_flag("is_causal", is_causal),
                                _resolve_scale(scale, query.shape[-1]), _check_flag("enable_gqa", enable_gqa),
                                schedule=schedule, window=window, block_mask=block_mask,
                                softcap=resolve_softcap(softcap), sinks=sinks,
                                eager_monitor_site=_monitor_eager.eager_site())
    return attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
        schedule=schedule, window=window, block_mask=block_mask, softcap=softcap, sinks=sinks,
        eager_monitor_site=_monitor_eager.eager_site(),
    )


def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    schedule: str | None = None,
    window: tuple[int, int] | None = None,
    block_mask: BlockSparseLayout | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    monitor_site: str | None = None,
    eager_monitor_site: str | None = None,
) -> Tensor:
    """:func:`flash_attention` with the monitoring decision made by the caller.

    Two ways to record a call, one per kind of caller (None for both records nothing):

    * ``monitor_site``: for a graph. The pass's rewritten calls come here with the name it
      chose (so what the backend was asked for, not whether a session was active while
      compiling, decides) and get the identity ops of ``flash_inductor.monitoring.ops``, which
      copy q, k, v and the output: a compiler would drop an op whose result nobody reads.
    * ``eager_monitor_site``: for eager code, where no compiler drops anything, so nothing is
      copied (``flash_inductor.monitoring.eager``): the statistics are read from the output,
      the LSE and, through a backward hook, the gradients.
    """
    if monitor_site is not None and eager_monitor_site is not None:
        raise ValueError("attention: pass monitor_site (a compiled graph) or eager_monitor_site (eager code), not both.")
    _check_qkv(query, key, value)
    precision = get_schedule(schedule)  # validates early, listing the choices
    window_left, window_right = _resolve_window(window)
    softcap = resolve_softcap(softcap)
    if precision.fp8_forward:
        check_fp8_device(query.device)
        check_fp8_window((window_left, window_right))
        check_fp8_softcap(softcap)
    dropout_p = resolve_dropout(dropout_p)

    seq_q, head_dim = query.shape[-2], query.shape[-1]
    seq_k = key.shape[-2]
    is_causal, causal_offset, attn_mask = _resolve_causal(attn_mask, _check_flag("is_causal", is_causal),
                                                          seq_q, seq_k)
    scale = _resolve_scale(scale, head_dim)

    out_rank = max(query.dim(), key.dim(), value.dim())
    query, key, value = _broadcast_qkv(query, key, value, _check_flag("enable_gqa", enable_gqa))
    heads_q = query.shape[-3] if query.dim() >= 4 else 1
    batch_shape = query.shape[:-3] if query.dim() >= 4 else query.shape[:-2]
    q4, k4, v4 = (_as_4d(t) for t in (query, key, value))
    check_sinks(sinks, query, heads_q)
    mask4 = _broadcast_mask(attn_mask, query, batch_shape, heads_q, seq_q, seq_k)
    layout = resolve_block_mask(block_mask, attn_mask is not None, query, batch_shape, heads_q, seq_q, seq_k)

    rng_seed = None
    if dropout_p > 0.0:
        # Drawn from the device's default generator: manual_seed makes runs reproducible.
        rng_seed = torch.randint(0, 2**62, (1,), dtype=torch.int64, device=query.device)

    if monitor_site is not None:
        q4, k4, v4 = _monitor_ops.watch_inputs(q4, k4, v4, monitor_site)
    elif eager_monitor_site is not None:
        q4, k4, v4 = _monitor_eager.watch_gradients(q4, k4, v4, eager_monitor_site)
    # Eager CUDA calls skip the op dispatcher (the same launches; ops/attention.py); graphs,
    # tracing and tensor subclasses get the registered op.
    # The resolved schedule: the layers below read it rather than look its name up again.
    # The sinks go into the op, whose forward kernels put them in each row's denominator.
    out, lse = _attention_ops.attention_forward_eager(
        q4, k4, v4, mask4, rng_seed, dropout_p, bool(is_causal), causal_offset, scale, precision,
        window_left, window_right, *layout, softcap, sinks,
    )
    if sinks is not None and (monitor_site is not None or eager_monitor_site is not None):
        # The monitor describes the keys' scores: their own LSE, -inf on a row that sees no key
        # (fully masked) though the sink holds its weight.
        lse = keys_lse(lse, sinks)
    if monitor_site is not None:
        out = _monitor_ops.watch_output(out, lse, monitor_site, seq_k)
    elif eager_monitor_site is not None:
        _monitor_eager.record_forward(out, lse, eager_monitor_site, seq_k)
    # 3-D inputs under enable_gqa ran as one batch of heads (``_broadcast_qkv``): back to 3-D.
    return out.reshape(*query.shape[query.dim() - out_rank:-1], value.shape[-1])


# --------------------------------------------------------------------------------------
# Validation and normalisation
# --------------------------------------------------------------------------------------


def _check_qkv(query, key, value) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            raise TypeError(f"flash_attention: {name} must be a torch.Tensor, got {type(t).__name__}.")
        if t.dim() < 2:
            raise ValueError(
                f"flash_attention: {name} must have at least 2 dims (..., seq, head_dim), got shape {tuple(t.shape)}."
            )
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(
                f"flash_attention: {name} has dtype {t.dtype}; supported are float16, bfloat16, float32, float64."
            )
        if t.device.type not in _SUPPORTED_DEVICES:
            raise ValueError(
                f"flash_attention: {name} is on unsupported device {t.device}; use one of {_SUPPORTED_DEVICES}."
            )
        if t.shape[-1] == 0:
            raise ValueError(f"flash_attention: {name} has an empty last (head) dim, shape {tuple(t.shape)}.")
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(
            f"flash_attention: query, key and value must share a dtype, got {query.dtype}, {key.dtype}, {value.dtype}."
        )
    if not (query.device == key.device == value.device):
        raise ValueError(
            f"flash_attention: query, key and value must be on one device, got {query.device}, {key.device}, {value.device}."
        )
    if key.shape[-1] != query.shape[-1]:
        raise ValueError(
            f"flash_attention: key's head dim ({key.shape[-1]}) must equal query's ({query.shape[-1]})."
        )
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(
            "flash_attention: key and value must have the same sequence length (dim -2), got "
            f"key {tuple(key.shape)} and value {tuple(value.shape)}."
        )


def _broadcast_qkv(query: Tensor, key: Tensor, value: Tensor, enable_gqa: bool) -> tuple[Tensor, Tensor, Tensor]:
    """query, key and value with their leading dims broadcast as SDPA broadcasts them, as views.

    Right-aligned to the largest rank; every dim but the last two broadcasts (size 1 against
    any size). The head dim (dim -3 of 4-D and higher inputs) has one exception, grouped-query
    attention: K/V heads that divide the query heads under ``enable_gqa``, and a single K/V head
    (with or without it, as SDPA), stay as they are: the op pairs query head h with K/V head
    h // (Hq // Hkv) and never repeats K/V. Other broadcast dims become stride-0 ``expand``
    views, whose backward sums each gradient back to its input's shape. Under ``enable_gqa``,
    SDPA reads dim -3 as the heads whatever the rank, so 3-D inputs come back 4-D, one batch of
    heads.
    """
    rank = max(query.dim(), key.dim(), value.dim())
    if rank == 3 and enable_gqa:
        rank = 4
    query, key, value = (t.reshape((1,) * (rank - t.dim()) + tuple(t.shape)) if t.dim() < rank else t
                         for t in (query, key, value))
    if rank < 4:  # (N, L, E) and (L, E): no head dim, only the batch dim broadcasts
        lead = _broadcast_lead({"query": query.shape[:-2], "key": key.shape[:-2], "value": value.shape[:-2]})
        return (_expand_lead(query, lead), _expand_lead(key, lead), _expand_lead(value, lead))
    batch = _broadcast_lead({"query": query.shape[:-3], "key": key.shape[:-3], "value": value.shape[:-3]})
    heads_q, heads_k, heads_v = query.shape[-3], key.shape[-3], value.shape[-3]
    if heads_k != heads_v and 1 not in (heads_k, heads_v):
        raise ValueError(
            f"flash_attention: key has {heads_k} heads and value {heads_v}; give them the same number "
            "of heads (or one of them a single head, which broadcasts)."
        )
    heads_kv = max(heads_k, heads_v)
    if heads_q == 1 and heads_kv > 1 and not enable_gqa:
        heads_q = heads_kv  # one query head against several K/V heads: SDPA broadcasts the query
    elif heads_kv not in (heads_q, 1):
        if not enable_gqa:
            raise ValueError(
                f"flash_attention: query has {heads_q} heads but key/value have {heads_kv}; for grouped-query "
                "attention pass enable_gqa=True."
            )
        if heads_kv == 0 or heads_q % heads_kv != 0:
            raise ValueError(
                f"flash_attention: with enable_gqa=True the query heads ({heads_q}) must be a multiple of the "
                f"key/value heads ({heads_kv})."
            )
    return (_expand_lead(query, (*batch, heads_q)), _expand_lead(key, (*batch, heads_kv)),
            _expand_lead(value, (*batch, heads_kv)))


def _broadcast_lead(shapes: dict) -> tuple:
    first, *rest = shapes.values()
    # Equal concrete shapes, the common case, skip torch.broadcast_shapes: its Python
    # implementation costs more host time than the rest of the argument checks together
    # (~15 µs of ~37 on a 2-core CPU). Symbolic sizes take the general path, guards and all.
    if all(type(d) is int for shape in shapes.values() for d in shape) and all(shape == first for shape in rest):
        return tuple(first)
    try:
        return tuple(torch.broadcast_shapes(*shapes.values()))
    except RuntimeError:
        described = ", ".join(f"{name} {tuple(shape)}" for name, shape in shapes.items())
        raise ValueError(
            f"flash_attention: the batch dims of query, key and value do not broadcast ({described}); each "
            "dim must be equal or 1, as in scaled_dot_product_attention."
        ) from None


def _expand_lead(t: Tensor, lead: tuple) -> Tensor:
    """``t`` with its leading dims expanded to ``lead`` (a stride-0 view; ``t`` itself if equal)."""
    if tuple(t.shape[:-2]) == tuple(lead):
        return t
    return t.expand(*lead, *t.shape[-2:])


def _resolve_causal(attn_mask, is_causal, seq_q, seq_k):
    """Turn is_causal / CausalBias into (is_causal, causal_offset, remaining mask).

    Key j is visible to query i iff j <= i + causal_offset: 0 is top-left (SDPA's is_causal,
    CausalBias upper-left), seq_k - seq_q is lower-right.
    """
    if CausalBias is not None and isinstance(attn_mask, CausalBias):
        if is_causal:
            raise ValueError("flash_attention: pass either attn_mask=CausalBias(...) or is_causal=True, not both.")
        if (attn_mask.seq_len_q, attn_mask.seq_len_kv) != (seq_q, seq_k):
            raise ValueError(
                f"flash_attention: attn_mask CausalBias is for (L, S) = ({attn_mask.seq_len_q}, "
                f"{attn_mask.seq_len_kv}) but query/key have ({seq_q}, {seq_k})."
            )
        lower_right = attn_mask.variant == CausalVariant.LOWER_RIGHT
        return True, (seq_k - seq_q if lower_right else 0), None
    if attn_mask is not None and is_causal:
        raise ValueError(
            "flash_attention: attn_mask and is_causal=True are exclusive (as in SDPA); fold the causal "
            "condition into the mask or drop one of them."
        )
    return bool(is_causal), 0, attn_mask


def _check_flag(name: str, value) -> bool:
    """``is_causal`` / ``enable_gqa`` as a bool: a bool (NumPy's too) or the ints 0 and 1. Anything
    else is refused rather than read by its truth, where "False" would switch the flag on."""
    if isinstance(value, (bool, torch.SymBool)) or (type(value).__module__ == "numpy"
                                                    and type(value).__name__ in ("bool", "bool_")):
        return bool(value)
    if isinstance(value, numbers.Integral) and value in (0, 1):
        return bool(value)
    raise TypeError(f"flash_attention: {name} must be a bool, got {value!r}.")


def _resolve_window(window) -> tuple[int, int]:
    """``window`` as the op's ``(window_left, window_right)``; ``None`` is ``(-1, -1)``."""
    if window is None:
        return NO_WINDOW
    if isinstance(window, Tensor) or not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(
            f"flash_attention: window must be None or a (left, right) pair of ints, got {window!r}; "
            "for a causal sliding window of w keys pass window=(w - 1, 0)."
        )
    bounds = []
    for side, value in zip(("left", "right"), window):
        try:
            bound = None if isinstance(value, (bool, Tensor)) else operator.index(value)
        except TypeError:
            bound = None
        if bound is None or not -1 <= bound < 2**63:
            raise ValueError(
                f"flash_attention: window's {side} bound must be an int from -1 (unbounded) to 2**63 - 1, got "
                f"{value!r} in window={tuple(window)!r}."
            )
        bounds.append(int(bound))
    return bounds[0], bounds[1]


def _resolve_scale(scale, head_dim) -> float:
    """``scale`` as a Python float: any real number SDPA takes (NumPy scalars, a one-element tensor
    outside tracing), finite."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    value = None
    if isinstance(scale, Tensor):
        if scale.numel() == 1 and not scale.is_complex() and scale.dtype != torch.bool \
                and not torch.compiler.is_compiling():
            value = float(scale)
    elif isinstance(scale, numbers.Real) and not isinstance(scale, bool):
        value = float(scale)
    if value is None or not math.isfinite(value):
        raise ValueError(f"flash_attention: scale must be a finite real number or None, got {scale!r}.")
    return value


def _as_4d(t: Tensor) -> Tensor:
    """(..., H, L, E) -> (B, H, L, E) with views: 3-D inputs get one head, 2-D one batch too."""
    if t.dim() == 2:
        return t[None, None]
    if t.dim() == 3:
        return t.unsqueeze(1)
    if t.dim() == 4:
        return t
    # The leading dims' product, not -1: reshape cannot infer a dim of an empty tensor.
    return t.reshape(math.prod(t.shape[:-3]), *t.shape[-3:])


def _broadcast_mask(attn_mask, query, batch_shape, heads_q, seq_q, seq_k):
    if attn_mask is None:
        return None
    if not isinstance(attn_mask, Tensor):
        raise TypeError(f"flash_attention: attn_mask must be a Tensor, CausalBias or None, got {type(attn_mask).__name__}.")
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise TypeError(
            f"flash_attention: attn_mask must be bool (True = attend) or floating (additive), got {attn_mask.dtype}."
        )
    if attn_mask.device != query.device:
        raise ValueError(f"flash_attention: attn_mask is on {attn_mask.device} but query is on {query.device}.")
    return broadcast_per_head(
        attn_mask, (seq_q, seq_k), query.dim(), batch_shape, heads_q,
        lambda full_shape: f"flash_attention: attn_mask of shape {tuple(attn_mask.shape)} is not broadcastable "
                           f"to (batch..., heads, L, S) = {full_shape}.")
