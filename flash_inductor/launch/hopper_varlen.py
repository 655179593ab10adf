"""Launchers for packed sequences (varlen) on the Gluon Hopper kernels: ``VARLEN`` launches of
kernels/hopper_fwd.py and kernels/hopper_bwd.py over the packed tensors, one CTA per (query block
or key block, sequence, head), each sequence its own attention problem (``launch/packed.py``;
``ops/varlen.py`` defines the semantics).

The tensors arrive as the Triton varlen launchers take them: (1, H, total, E) views of packed
(total, H, E) tensors, ``PackedSequences`` with the int32 offsets on the device. The grid covers
the packed rows (``kernels/hopper_pipeline.PackedRows``: total // block + n_seq blocks a head), so
only each sequence's own tiles are computed, and no mask is materialised. O, its residual, dK and
dV are stored row by row with a mask (a TMA box would write into the next sequence's rows); dQ's
reduce-adds may cover rows of the next sequence, to which they add exact zeros (those rows' P is 0).

What they take: whatever ``varlen_unsupported_reason`` leaves: the dense Hopper kernels' dtypes,
head dims and schedules, causal or not (per sequence, bottom-right or top-left aligned), sliding
windows, GQA; no dropout, soft cap, key mask or block-sparse layout. The tile configs are the
built-in ones (the tuning tables are keyed by dense lengths), launched on the grid, never
persistent, with the GQA group unsplit (the grid has a row per sequence and head already).
"""

from __future__ import annotations

import dataclasses

import torch

from ..tuning.configs import sm_count
from ..tuning.hopper_configs import HopperBackwardConfig, HopperForwardConfig, default_backward_config, width_supported
from ..tuning.hopper_configs import default_forward_config
from . import common
from .band import band_lower, causal_side
from .common import LOG2E, cdiv
from .hopper import hopper_forward_unsupported_reason, tma_descriptor
from .hopper_bwd import hopper_backward_unsupported_reason
from .packed import PackedSequences
from .visibility import Visibility


# The kernels compile for sm_90a, but their first GPU run (H100, 2026-12-07) faulted with an illegal
# instruction at E 64 and 128 and overran shared memory at E 128 (246872 of 232448 bytes; 230920
# since, kernels/hopper_packed.py), so no call is routed here until they pass
# tests/unit/test_kernels_varlen.py's Gluon tests on a GPU (remove their skip marker to run them).
NOT_YET_ON_A_GPU = ("the Gluon packed-sequence kernels have not passed their GPU tests (an illegal instruction "
                    "on the H100); the Triton kernels run packs")


def varlen_unsupported_reason(query, key, value, dropout_p: float, scale: float | None, schedule, *, softcap: float,
                              backward: bool) -> str | None:
    """None if the Gluon kernels take this packed call ((1, H, total, E) views), else why not (for
    the logs). ``backward``: the backward kernel's limits too. Static properties only: the caller
    copies tensors TMA cannot address (``tma_addressable``). Every call gets ``NOT_YET_ON_A_GPU``
    for now."""
    return NOT_YET_ON_A_GPU or _kernel_limits(query, key, value, dropout_p, scale, schedule, softcap=softcap,
                                              backward=backward)


def _kernel_limits(query, key, value, dropout_p: float, scale: float | None, schedule, *, softcap: float,
                   backward: bool) -> str | None:
    """The kernels' own limits (what ``varlen_unsupported_reason`` checks once they pass on a GPU)."""
    if softcap:
        return "a soft cap (the Hopper kernels do not take one yet)"
    if backward:
        reason = hopper_backward_unsupported_reason(query, key, value, None, dropout_p, scale, schedule)
    else:
        reason = hopper_forward_unsupported_reason(query, key, value, None, dropout_p, scale, schedule)
    return reason


def _checked(packed: PackedSequences, query, key) -> int:
    if query.shape[0] != 1 or key.shape[0] != 1:
        raise ValueError("hopper varlen launch: the packed tensors go in as (1, H, total, E) views")
    if packed.cu_seqlens_q.dtype != torch.int32 or packed.cu_seqlens_k.dtype != torch.int32:
        raise ValueError("hopper varlen launch: cu_seqlens_q/cu_seqlens_k must be int32 (PackedSequences)")
    return packed.count


def _packed_like(t: torch.Tensor, dtype=None) -> torch.Tensor:
    """A fresh contiguous (total, H, E) tensor seen as ``t``'s (1, H, total, E) view."""
    return torch.empty((t.shape[2], t.shape[1], t.shape[3]), dtype=dtype or t.dtype,
                       device=t.device).transpose(0, 1).unsqueeze(0)


def hopper_varlen_forward(query, key, value, packed: PackedSequences, *, scale: float | None = None,
                          visibility: Visibility, config: HopperForwardConfig | None = None,
                          exact_delta: bool = False) -> tuple:
    """Packed attention forward on the Gluon kernel (VARLEN). ``query`` (1, Hq, total_q, E),
    ``key``/``value`` (1, Hkv, total_k, E) views of packed tensors; ``visibility`` relative to each
    sequence's diagonal (``PackedSequences.band``). Returns (out (1, Hq, total_q, E), a view of a
    contiguous (total_q, Hq, E) tensor, lse (1, Hq, total_q) fp32 natural log), and with
    ``exact_delta`` the residual (as out) and the row constants (2, 1, Hq, total_q), as
    ``hopper_attention_forward`` returns them. Call only where ``varlen_unsupported_reason`` is None."""
    from ..kernels.hopper_args import FwdArgs, FwdSwitches, TileListArgs
    from ..kernels.hopper_fwd import _attn_fwd_hopper

    n_seq = _checked(packed, query, key)
    _, heads_q, total_q, head_dim = query.shape
    heads_kv, total_k = key.shape[1], key.shape[2]
    if scale is None:
        scale = head_dim ** -0.5
    band = packed.band(visibility)
    is_causal, causal_offset = causal_side(band)
    cfg = config or default_forward_config(head_dim, is_causal, exact_delta=exact_delta)
    # The grid's blocks each hold one sequence's rows: never persistent. Two consumers: the E 64
    # built-in three-consumer (192-row) config faulted on the H100 with an illegal instruction in
    # its first GPU run (2026-12-07; tests/unit/test_kernels_varlen.py, E 64 only), not yet found.
    cfg = dataclasses.replace(cfg, persistent=False, num_consumers=2)
    out = _packed_like(query)
    lse = torch.empty((1, heads_q, total_q), dtype=torch.float32, device=query.device)
    if exact_delta:
        resid = _packed_like(query)
        row_consts = torch.empty((2, 1, heads_q, total_q), dtype=torch.float32, device=query.device)
    else:
        resid, row_consts = out, lse  # not touched
    if total_q == 0 or n_seq == 0:
        return (out, lse, resid, row_consts) if exact_delta else (out, lse)
    rows = cfg.block_m * cfg.num_consumers
    grid = (total_q // rows + n_seq, heads_q)
    o_desc = tma_descriptor(out, cfg.block_m)  # the kernel's box sizes; O is stored row by row
    cu_q, cu_k, diag_shift = packed.kernel_args()
    args = FwdArgs(
        LSE=lse, ROW_CONSTS=row_consts, KEY_BIAS=lse, L=total_q, S=total_k, H=heads_q,  # lse as KEY_BIAS: not read
        GROUP=heads_q // heads_kv, causal_offset=causal_offset, window_lower=band_lower(band), qk_scale=scale * LOG2E,
        swizzle_heads=max(1, min(cfg.swizzle_heads, heads_q)), WORK_COUNTER=lse, BH=heads_q,  # not touched
        lists=TileListArgs(lse, 0, 0, 0), softcap_log2=1.0, tanh_scale=1.0,  # no tile lists, no cap: not read
        OUT=out, RESID=resid if exact_delta else None, CU_Q=cu_q, CU_K=cu_k, n_seq=n_seq, diag_shift=diag_shift)
    switches = FwdSwitches(
        HEAD_DIM=head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, NUM_STAGES=cfg.num_stages,
        NUM_CONSUMERS=cfg.num_consumers, IS_CAUSAL=is_causal, WINDOW_LEFT=band.lower is not None,
        PINGPONG=cfg.pingpong, EXACT_DELTA=exact_delta, HAS_KEY_BIAS=False, CONSUMER_REGS=cfg.consumer_regs,
        LOADER_REGS=cfg.loader_regs, SKIP_MASKED_TILES=cfg.skip_masked_tiles, PERSISTENT=False,
        HAS_BLOCK_SPARSITY=False, SOFTCAP=False, VARLEN=True)
    common.launcher(_attn_fwd_hopper)[grid](
        tma_descriptor(query, cfg.block_m), tma_descriptor(key, cfg.block_n), tma_descriptor(value, cfg.block_n),
        o_desc, o_desc, args, switches=switches, num_warps=4, maxnreg=cfg.maxnreg)
    if exact_delta:
        return out, lse, resid, row_consts
    return out, lse


def hopper_varlen_backward(grad_out, query, key, value, out, lse, grad_lse, packed: PackedSequences, *,
                           scale: float | None = None, visibility: Visibility,
                           config: HopperBackwardConfig | None = None,
                           exact_delta: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple:
    """Gradients (dq, dk, dv) of packed attention on the Gluon kernel (VARLEN): `fast`'s schedule
    (Δ = rowsum(dO∘O) - dLSE from the preprocess, dS cast to the input dtype), or with
    ``exact_delta`` (the residual and row constants ``hopper_varlen_forward(exact_delta=True)``
    returned) `stable`'s one-pass backward, with the exact Δ and dQ over the centred keys, as
    ``launch.hopper_bwd.hopper_attention_backward`` runs it (k̂ over the whole pack, per KV head).
    Tensors as ``hopper_varlen_forward`` takes and returns them: (1, H, total, E) views, ``lse``
    (1, Hq, total_q) fp32 natural log, ``grad_lse`` like it or None. Returns (1, H, total, E)
    views of contiguous (total, H, E) gradients, dq's a plain (1, Hq, total_q, E) tensor. Call only
    where ``varlen_unsupported_reason`` (backward) is None."""
    from ..kernels.gluon_tma import HAS_TMA_REDUCE
    from ..kernels.hopper_args import BwdArgs, BwdSwitches, TileListArgs
    from ..kernels.hopper_bwd import _attn_bwd_hopper
    from .backward import launch_preprocess
    from .hopper_bwd import exact_delta_inputs, key_moments, row_stats_descriptor, row_stats_planes

    n_seq = _checked(packed, query, key)
    _, heads_q, total_q, head_dim = query.shape
    heads_kv, total_k = key.shape[1], key.shape[2]
    if scale is None:
        scale = head_dim ** -0.5
    cfg = config or default_backward_config(head_dim, visibility.is_causal)
    if exact_delta is not None and not cfg.dq_split and head_dim > 64:
        cfg = dataclasses.replace(cfg, dq_split=True)  # K̃ beside K fits only with the split (launch/hopper_bwd.py)
    if not width_supported(cfg, head_dim):
        raise ValueError(f"hopper_varlen_backward: HopperBackwardConfig(paired_tiles=True) needs head dim 64; "
                         f"use paired_tiles=False at head dim {head_dim}")
    dk, dv = _packed_like(key), _packed_like(value)
    if total_q == 0 or total_k == 0 or n_seq == 0:
        return torch.zeros_like(query), dk.zero_(), dv.zero_()
    if exact_delta is not None:
        # dO', the pivots (read where the LSE is otherwise), Δ' and fp16's ds_up; the same launch
        # finishes k̂ from the moments.
        moments = key_moments(key)
        grad_out, lse, delta, ds_up = exact_delta_inputs(grad_out, value, out, grad_lse, *exact_delta, moments)
        mean_key = moments.mean_key
    else:
        delta = torch.empty((1, heads_q, total_q), dtype=torch.float32, device=query.device)
        if grad_lse is not None:
            grad_lse = grad_lse.to(torch.float32).contiguous()
        launch_preprocess(out, grad_out, grad_lse, value, delta, delta, head_dim, head_dim, 64, False)
        ds_up = mean_key = None
    lse = lse.to(torch.float32).contiguous()
    dq_accum = torch.zeros((1, heads_q, total_q, head_dim), dtype=torch.float32, device=query.device)
    dq_tma = cfg.dq_tma and HAS_TMA_REDUCE
    dq_cols = head_dim // 2 if cfg.dq_split else head_dim
    band = packed.band(visibility)
    is_causal, causal_offset = causal_side(band)
    lse_plane, delta_plane = row_stats_planes((lse, delta), heads_q, total_q)
    grid = (total_k // cfg.block_n + n_seq, heads_kv)
    swizzle = max(1, min(cfg.swizzle_heads or 1, heads_kv))
    cu_q, cu_k, diag_shift = packed.kernel_args()
    args = BwdArgs(
        LSE=lse_plane, DELTA=delta_plane, DQ_ACCUM=dq_accum, DS_UP=ds_up if ds_up is not None else lse, KEY_BIAS=lse,
        MEAN_KEY=mean_key if mean_key is not None else lse, DKDV_PART=lse,  # lse: not read
        L=total_q, S=total_k, H_KV=heads_kv, GROUP=heads_q // heads_kv, group_split=1,
        stride_stats=lse_plane.stride(0), causal_offset=causal_offset, window_lower=band_lower(band),
        qk_scale=scale * LOG2E, sm_scale=scale, swizzle_heads=swizzle, lists=TileListArgs(lse, 0, 0, 0),
        softcap_log2=1.0, tanh_scale=1.0,  # no tile lists, no cap: not read
        DK=dk, DV=dv, CU_Q=cu_q, CU_K=cu_k, n_seq=n_seq, diag_shift=diag_shift)
    switches = BwdSwitches(
        HEAD_DIM=head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, NUM_STAGES=cfg.num_stages,
        IS_CAUSAL=is_causal, WINDOW_LEFT=band.lower is not None, DQ_SPLIT=cfg.dq_split, DQ_TMA=dq_tma,
        EXACT_DELTA=exact_delta is not None, HAS_KEY_BIAS=False, ROW_STATS_TMA=cfg.row_stats_tma,
        DKDV_PARTIALS=False, CENTRE_KEYS=mean_key is not None, CONSUMER_REGS=cfg.consumer_regs,
        LOADER_REGS=cfg.loader_regs, HAS_BLOCK_SPARSITY=False, EVEN_L=False, PAIRED_TILES=cfg.paired_tiles,
        SOFTCAP=False, VARLEN=True)
    common.launcher(_attn_bwd_hopper)[grid](
        tma_descriptor(query, cfg.block_m), tma_descriptor(key, 64), tma_descriptor(value, 64),
        tma_descriptor(grad_out, cfg.block_m), tma_descriptor(dk, 64), tma_descriptor(dv, 64),
        tma_descriptor(dq_accum, cfg.block_m, dq_cols), row_stats_descriptor(lse_plane, cfg.block_m),
        row_stats_descriptor(delta_plane, cfg.block_m), args, switches=switches, num_warps=4, maxnreg=cfg.maxnreg)
    if mean_key is not None and grad_lse is not None:
        from .hopper_bwd import dq_with_mean_key

        # dS·K = dS·K̃ + rowsum(dS)·k̂: the second term back, from dLSE (0 for a row with no key).
        weight = torch.where(lse == float("inf"), 0.0, scale * grad_lse.to(torch.float32))
        return dq_with_mean_key(dq_accum, mean_key, weight, query.dtype), dk, dv
    return dq_accum.to(query.dtype), dk, dv
