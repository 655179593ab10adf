"""Launcher for the Gluon Hopper backward (kernels/hopper_bwd.py): which calls it takes, its tile
config, the TMA descriptors, and the dQ accumulator.

The op (``ops/attention.py``) chooses it at launch time, as it chooses the Hopper forward
(``launch/hopper.py``), wherever ``hopper_backward_unsupported_reason`` says None; the reason
otherwise goes to the ``flash_inductor`` logger at INFO, once per reason.

What it covers: sm_90, bf16/fp16, E = Ev = 64 or 128, no mask or a key mask
(``launch.hopper.key_bias``; an additive one under `stable` only), no dropout,
block-sparse layouts of 128 x 128 blocks or multiples (each key block's CTA walks its listed query
tiles), causal or not (any ``causal_offset``), sliding windows (the band of
``launch/band.py``: each key block's query sweep ends at the window's left edge), grouped-query
attention, the `fast` schedule (Δ = rowsum(dO∘O) - dLSE, dS cast straight to the input dtype), and
`stable`, the default, through the one-pass ops (ops/one_pass.py: the forward's residual makes
the exact Δ a preprocess, and fp16's dS is rescaled by a bound), TMA-addressable strides.
Everything else keeps the Triton kernels.

Steps: the Triton preprocess writes Δ (B, Hq, L) fp32; the Gluon kernel runs one CTA per
(128-key block, batch, KV head), writes dK and dV directly (the GQA group's query heads are
summed in registers) and adds scale·dS·K into a zeroed fp32 (B, Hq, L, E) buffer, one TMA
reduce-add per tile (atomics where the Triton build lacks the reduce copy); that buffer is then
cast to dq. A GQA grid under one wave of CTAs shares each group's query heads among several CTAs
per key block (``group_split_for``), whose fp32 dK/dV partial sums one more launch adds in order.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import torch

from ..schedules import PrecisionSchedule, get_schedule
from ..tuning.buckets import length_hint
from ..tuning.configs import select_hopper_backward_config, sm_count
from ..tuning.hopper_configs import HopperBackwardConfig, default_backward_config, width_supported
from . import common
from .band import band_lower, causal_side
from .block_tiles import checked_gluon_layout, gluon_tile_lists
from .common import LOG2E, cdiv
from .visibility import NO_MASKING, Visibility
from .hopper import (NOT_HOPPER, gluon_descriptor, hopper_forward_unsupported_reason, key_bias, softcap_arguments,
                     tma_descriptor, tma_unsupported_reason, run_selected)

log = logging.getLogger("flash_inductor")
# The built-in config (the tuning table's entries take precedence per bucket).
default_config = default_backward_config
# `stable` runs this kernel only from the one-pass forward, whose residual it needs (ops/one_pass.py).
NO_RESIDUAL = "the exact Δ needs the one-pass forward's residual (ops/one_pass.py)"
# dQ is summed across key blocks by TMA reduce-adds, whose order varies from run to run; the
# Triton backward sums each dq row in one program, in a fixed order.
# `fast`'s backward recomputes P from the LSE in natural log; a row masked entirely at the additive
# floor has an LSE near -1e38, whose round trip to base 2 is off by far more than one (the Triton
# backward recomputes such rows' reference). `stable`'s pivot is kept in base 2, exactly.
ADDITIVE_KEY_MASK_FAST = ("an additive key mask under schedule 'fast' (rows masked entirely at the floor need the "
                          "Triton backward's row reference)")
DETERMINISTIC = ("torch.use_deterministic_algorithms(True) (the Hopper backward adds dQ across key blocks "
                 "in an order that varies run to run)")


# Up to this many waves of CTAs, a causal backward runs every head's first key block first.
KEY_BLOCK_MAJOR_MAX_WAVES = 8


def swizzle_heads_for(heads: int, key_blocks: int, sms: int, pure_causal: bool) -> int:
    """The grid order the H200 measured faster (bf16, E 64/128, docs/hopper_backward.md), as a
    group size over ``heads`` (B·H_KV) grid rows of ``key_blocks`` CTAs. Under causal masking a
    key block's work falls with its index, so with few waves of CTAs the order that starts every
    head's longest CTA first wins: 1.03-1.46x at 256-1024 CTAs (HF Llama's GQA shapes, where a
    CTA walks its group's four query heads, gain the most). From 2048 CTAs one head at a time
    won by 2-10 %: the CTAs in flight then share their heads' Q and dO in L2, and the tail is a
    small part of the run. Without causal masking (or with a window's lower side) every key
    block does about the same work and one head at a time is 2-13 % faster."""
    if pure_causal and heads * key_blocks <= KEY_BLOCK_MAJOR_MAX_WAVES * sms:
        return heads
    return 1


# A GQA grid under this many waves of CTAs is split until it has them (or the group is spent).
GROUP_SPLIT_MIN_WAVES = 1


def group_split_for(group: int, ctas: int, sms: int) -> int:
    """How many CTAs share a GQA group's query heads per key block: the smallest divisor of
    ``group`` that gives ``ctas`` (the unsplit grid) at least GROUP_SPLIT_MIN_WAVES waves on
    ``sms`` SMs, else the whole group. Unsplit, a grid of few KV heads runs in under a wave of
    long CTAs, each walking every query head of its group. Measured on the H200 (bf16, causal,
    16 query heads over 4, docs/hopper_backward.md, "GQA group split"): at 128 CTAs (B 1, 4k)
    two parts run the backward 1.3-1.9x faster than the whole group (0.61-0.67x cuDNN before);
    at 256 CTAs (E 128 B 2 4k, E 64 B 4 2k) splitting gained nothing or lost up to 40 %, the
    parts' fp32 dK/dV stores and their sum then outweighing the better fill."""
    for parts in range(1, group + 1):
        if group % parts == 0 and ctas * parts >= GROUP_SPLIT_MIN_WAVES * sms:
            return parts
    return group


def hopper_backward_unsupported_reason(query, key, value, attn_mask=None, dropout_p: float = 0.0,
                                       scale: float | None = None, schedule: str | None = None, *,
                                       is_causal: bool = True, window=None,
                                       block_sizes: tuple[int, int] | None = None) -> str | None:
    """None if the Hopper backward takes this call as far as its static properties go, else why
    not (for the logs). Safe on fake tensors. `stable` calls take it through the one-pass ops
    (ops/one_pass.py), which form its exact Δ."""
    reason = hopper_forward_unsupported_reason(query, key, value, attn_mask, dropout_p, scale, schedule,
                                               window=window, block_sizes=block_sizes)
    if reason is not None:
        return reason
    sched = get_schedule(schedule)
    if sched.ds_in_fp32:
        return f"schedule {sched.name!r} (dS in fp32 for the matrix unit)"
    if attn_mask is not None and attn_mask.is_floating_point() and not sched.exact_delta:
        return ADDITIVE_KEY_MASK_FAST
    if torch.are_deterministic_algorithms_enabled():
        return DETERMINISTIC
    return None


def one_pass_unsupported_reason(query, key, value, attn_mask=None, dropout_p: float = 0.0,
                                scale: float | None = None, schedule: str | None = None, *,
                                window=None, block_sizes: tuple[int, int] | None = None) -> str | None:
    """None if a call could run `stable`'s exact Δ on the Hopper kernels in one pass
    (ops/one_pass.py): the schedule forms the exact Δ and both Hopper kernels take the call.
    Static properties only (safe on fake tensors); lengths by their hints."""
    if not get_schedule(schedule).exact_delta:
        return f"schedule {get_schedule(schedule).name!r} (no exact Δ to form)"
    reason = hopper_backward_unsupported_reason(query, key, value, attn_mask, dropout_p, scale, schedule,
                                                window=window, block_sizes=block_sizes)
    if reason is not None:
        return reason
    if 0 in (length_hint(query.shape[2]), length_hint(key.shape[2])):
        return "an empty sequence"
    return None


def backward_tma_unsupported_reason(grad_out, query, key, value) -> str | None:
    """None if TMA descriptors can address the backward's (real) inputs, else why not."""
    return tma_unsupported_reason(query, key, value) or tma_unsupported_reason(grad_out, key, value)


@functools.lru_cache(maxsize=None)
def log_triton_backward(reason: str) -> None:
    """Say once per reason, at INFO, why a backward on a Hopper GPU runs the Triton kernels."""
    if reason not in NOT_HOPPER:
        log.info("flash_inductor: backward on the Triton kernels, not the Hopper (Gluon) one: %s", reason)


def hopper_attention_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              out: torch.Tensor, lse: torch.Tensor, grad_lse: torch.Tensor | None = None, *,
                              scale: float | None = None, visibility: Visibility = NO_MASKING,
                              attn_mask: torch.Tensor | None = None, config: HopperBackwardConfig | None = None,
                              delta: torch.Tensor | None = None,
                              exact_delta: tuple[torch.Tensor, torch.Tensor] | None = None,
                              mean_key: torch.Tensor | KeyMoments | None = None,
                              schedule: str | PrecisionSchedule | None = None, softcap: float = 0.0,
                              sinks: torch.Tensor | None = None,
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of attention on the Gluon Hopper kernel: `fast`'s, or with
    ``exact_delta`` `stable`'s.

    ``query``/``out``/``grad_out`` (B, Hq, L, E), ``key``/``value`` (B, Hkv, S, E) with Hq a
    multiple of Hkv; ``lse`` (B, Hq, L) fp32 in natural log as the forward returns it (-inf for a
    row that sees no key: its gradients are 0); ``grad_lse`` the LSE output's gradient, or None;
    ``visibility`` the causal side, window and block-sparse layout (blocks that
    ``launch.block_tiles.gluon_layout_fits``) and ``attn_mask`` a key mask, as the forward took them.
    ``delta`` (B, Hq, L) fp32 replaces the preprocess's Δ (experiments). ``exact_delta``: the
    (residual, row constants) the forward returned under ``exact_delta=True``; the backward is
    then `stable`'s, with the exact Δ. ``mean_key`` (B, Hkv, E) fp32, k̂ of ops/one_pass.py
    (``key_mean``): dQ's GEMM takes the centred keys K̃ = K − k̂, which the kernel forms in shared
    memory (CENTRE_KEYS), and dq gets scale·dLSE·k̂ back. With ``exact_delta``, ``mean_key`` may be
    ``key_moments(key)`` instead, which the exact-Δ preprocess's launch finishes. ``softcap`` > 0:
    the forward's soft cap (kernels/hopper_bwd.py, SOFTCAP); it takes no ``mean_key`` (a capped
    row's dU does not sum to dLSE, the centred dQ's add-back). ``sinks`` (Hq,): the attention sinks
    (ops/sinks.py) that (out, lse) carry; the kernels need nothing of them, but a row of dS then sums
    to dLSE_i + p_i·Δ_i (p_i = exp(sink_h − lse_i), the sink's share) rather than dLSE_i, and the
    centred dq's finish adds that instead (only read with ``mean_key``). Call only where
    ``hopper_backward_unsupported_reason`` and ``tma_unsupported_reason`` (on query, key, value,
    grad_out) say so.

    ``config`` None: the tuning table's entry for the call's bucket (``schedule``'s; None: `stable`
    with ``exact_delta``, else `fast`), else the built-in config; a table's config that fails to
    launch warns once and runs the built-in one, as the forward does."""
    launch = functools.partial(_backward, grad_out, query, key, value, out, lse, grad_lse, scale=scale,
                               visibility=visibility, attn_mask=attn_mask, delta=delta, exact_delta=exact_delta,
                               mean_key=mean_key, softcap=softcap, sinks=sinks)
    if config is not None:
        return launch(config=config)
    if schedule is None:
        schedule = "stable" if exact_delta is not None else "fast"
    schedule = get_schedule(schedule).name
    return run_selected("backward", lambda cfg: launch(config=cfg), select_hopper_backward_config(
        query, key.shape[2], is_causal=visibility.is_causal, key_mask=attn_mask is not None, schedule=schedule))


def _backward(grad_out, query, key, value, out, lse, grad_lse, *, scale, visibility: Visibility, attn_mask, config,
              delta, exact_delta, mean_key, softcap=0.0, sinks=None):
    from ..kernels.gluon_tma import HAS_TMA_REDUCE
    from ..kernels.hopper_args import BwdArgs, BwdSwitches, TileListArgs
    from ..kernels.hopper_bwd import _attn_bwd_hopper
    from .backward import launch_preprocess

    batch, heads_q, seq_q, head_dim = query.shape
    heads_kv, seq_k = key.shape[1], key.shape[2]
    if scale is None:
        scale = head_dim ** -0.5
    cfg = config or default_config(head_dim, visibility.is_causal)
    has_cap, softcap_log2, tanh_scale = softcap_arguments(softcap, scale, "hopper_attention_backward")
    if softcap and mean_key is not None:
        raise ValueError("hopper_attention_backward: mean_key (the centred dQ) with a softcap: a capped row's dU does "
                         "not sum to dLSE, the centred dQ's add-back; pass mean_key=None")
    if mean_key is not None and not cfg.dq_split and head_dim > 64:
        raise ValueError("hopper_attention_backward: mean_key (the centred dQ) with HopperBackwardConfig(dq_split=False) "
                         f"needs more than Hopper's 227 KiB of shared memory a CTA at head dim {head_dim}; use "
                         "dq_split=True (the default)")
    if not width_supported(cfg, head_dim):
        raise ValueError(f"hopper_attention_backward: HopperBackwardConfig(paired_tiles=True) needs head dim 64 "
                         f"(a pair of tiles runs out of registers at {head_dim}); use paired_tiles=False")
    dk = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    dv = torch.empty(value.shape, dtype=value.dtype, device=value.device)
    if seq_q == 0 or seq_k == 0 or batch * heads_q == 0:
        return torch.zeros_like(query), dk.zero_(), dv.zero_()
    moments = mean_key if isinstance(mean_key, KeyMoments) else None
    if moments is not None:
        if exact_delta is None:
            raise ValueError("hopper_attention_backward: mean_key as KeyMoments needs exact_delta (the exact-Δ "
                             "preprocess finishes k̂); pass key_mean(key) otherwise")
        mean_key = moments.mean_key
    lse_out = lse  # the forward's LSE: the pivots replace it below under exact_delta
    if exact_delta is not None:
        # The kernel reads the pivots where it reads the LSE otherwise (+inf: a row with no key).
        grad_out, lse, delta, ds_up = _exact_delta_inputs(grad_out, value, out, grad_lse, *exact_delta, moments)
    else:
        ds_up = lse  # not read
    if delta is None:
        delta = torch.empty((batch, heads_q, seq_q), dtype=torch.float32, device=query.device)
        if grad_lse is not None:
            grad_lse = grad_lse.to(torch.float32).contiguous()
        launch_preprocess(out, grad_out, grad_lse, value, delta, delta, head_dim, head_dim, 64, False)
    lse = lse.to(torch.float32).contiguous()
    # Zeroing this inside the exact-Δ preprocess lost (docs/hopper_backward.md, lead 6).
    dq_accum = torch.zeros((batch, heads_q, seq_q, head_dim), dtype=torch.float32, device=query.device)
    dq_tma = cfg.dq_tma and HAS_TMA_REDUCE
    dq_cols = head_dim // 2 if cfg.dq_split else head_dim
    # The kernel sees the band as the Hopper forward does: its upper side as the causal
    # arguments, its lower side as WINDOW_LEFT and window_lower.
    band = visibility.band(seq_q, seq_k)
    band_is_causal, band_upper = causal_side(band)
    bias = key_bias(attn_mask, batch, heads_q, seq_k) if attn_mask is not None else lse  # lse: not read
    lse_plane, delta_plane = row_stats_planes((lse, delta), batch * heads_q, seq_q)
    group = heads_q // heads_kv
    key_blocks = cdiv(seq_k, cfg.block_n)
    sms = sm_count(query.device)
    parts = cfg.group_split or group_split_for(group, key_blocks * batch * heads_kv, sms)
    if group % parts:
        raise ValueError(f"HopperBackwardConfig.group_split={parts} does not divide the GQA group ({group} query "
                         f"heads per KV head); use a divisor of {group}")
    grid = (key_blocks, batch * heads_kv * parts)
    swizzle = cfg.swizzle_heads
    if swizzle is None:
        swizzle = swizzle_heads_for(grid[1], grid[0], sms, band_is_causal and band.lower is None)
    swizzle = max(1, min(swizzle, grid[1]))
    # Split, each part's dK and dV go to fp32 planes that ``_sum_parts`` adds below.
    dkdv_part = (torch.empty((2, parts, *key.shape), dtype=torch.float32, device=query.device)
                 if parts > 1 else lse)  # lse: not read
    block_layout = visibility.block_layout()
    lists = _key_block_lists(block_layout, query, key, band, cfg) if block_layout is not None else (lse, 0, 0, 0)
    args = BwdArgs(
        LSE=lse_plane, DELTA=delta_plane, DQ_ACCUM=dq_accum, DS_UP=ds_up, KEY_BIAS=bias,
        MEAN_KEY=mean_key.contiguous() if mean_key is not None else lse, DKDV_PART=dkdv_part,  # lse: not read
        L=seq_q, S=seq_k, H_KV=heads_kv, GROUP=group, group_split=parts, stride_stats=lse_plane.stride(0),
        causal_offset=band_upper, window_lower=band_lower(band), qk_scale=scale * LOG2E, sm_scale=scale,
        swizzle_heads=swizzle, lists=TileListArgs(*lists), softcap_log2=softcap_log2, tanh_scale=tanh_scale)
    switches = BwdSwitches(
        HEAD_DIM=head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, NUM_STAGES=cfg.num_stages,
        IS_CAUSAL=band_is_causal, WINDOW_LEFT=band.lower is not None, DQ_SPLIT=cfg.dq_split, DQ_TMA=dq_tma,
        EXACT_DELTA=exact_delta is not None, HAS_KEY_BIAS=attn_mask is not None, ROW_STATS_TMA=cfg.row_stats_tma,
        DKDV_PARTIALS=parts > 1, CENTRE_KEYS=mean_key is not None, CONSUMER_REGS=cfg.consumer_regs,
        LOADER_REGS=cfg.loader_regs, HAS_BLOCK_SPARSITY=block_layout is not None,
        EVEN_L=seq_q % cfg.block_m == 0, PAIRED_TILES=cfg.paired_tiles, SOFTCAP=has_cap)
    common.launcher(_attn_bwd_hopper)[grid](
        tma_descriptor(query, cfg.block_m), tma_descriptor(key, 64), tma_descriptor(value, 64),
        tma_descriptor(grad_out, cfg.block_m), tma_descriptor(dk, 64), tma_descriptor(dv, 64),
        tma_descriptor(dq_accum, cfg.block_m, dq_cols), row_stats_descriptor(lse_plane, cfg.block_m),
        row_stats_descriptor(delta_plane, cfg.block_m), args, switches=switches,
        num_warps=4, maxnreg=cfg.maxnreg,
    )
    if parts > 1:
        _sum_parts_into(dkdv_part, dv, dk)
    if mean_key is not None and sinks is not None:
        # A row with no key has LSE -inf whatever q·k̂ is: its dq stays 0.
        ds_rows = _ds_row_sums_with_sinks(lse_out, grad_lse, delta, sinks,
                                          exact_delta[1][1] if exact_delta is not None else None)
        weight = torch.where(lse == float("inf"), 0.0, scale * ds_rows)
        return _dq_with_mean_key(dq_accum, mean_key, weight, query.dtype), dk, dv
    if mean_key is not None and grad_lse is not None:
        # A row with no key has LSE -inf whatever q·k̂ is: its dq stays 0.
        weight = torch.where(lse == float("inf"), 0.0, scale * grad_lse.to(torch.float32))
        return _dq_with_mean_key(dq_accum, mean_key, weight, query.dtype), dk, dv
    # The kernel already added scale·dS·K: only the cast is left.
    return dq_accum.to(query.dtype), dk, dv


def _key_block_lists(block_layout: tuple, query, key, band, cfg: HopperBackwardConfig) -> tuple:
    """The kernel's per-key-block lists of query tiles (HAS_BLOCK_SPARSITY) for a block-sparse layout."""
    block_map, block_q, block_k = checked_gluon_layout(block_layout, query, key, "backward")
    return tuple(gluon_tile_lists(block_map, block_q, block_k, query.shape[2], key.shape[2], band.lower, band.upper,
                                  cfg.block_m, cfg.block_n, columns=True))


def _ds_row_sums_with_sinks(lse, grad_lse, delta, sinks, norm):
    """Σ_j dS_ij with sinks: dLSE_i + p_i·Δ_i, p_i = exp(sink_h − lse_i) (the keys' weights sum to
    1 − p_i), from the backward's Δ plane; under exact Δ it holds g_i·Δ_i, ``norm`` being the g plane,
    and a row whose g is 0 (no key, or keys whose weights underflowed beside the sink) puts no weight
    on its keys, so its dS row is 0. (B, Hq, L) fp32."""
    share = torch.exp(sinks.to(torch.float32)[None, :, None] - lse.to(torch.float32))
    if norm is not None:
        delta = delta / torch.where(norm > 0, norm, 1.0)
    rows = torch.where(torch.isfinite(lse), share * delta, 0.0)
    if grad_lse is not None:
        rows = rows + grad_lse.to(torch.float32)
    return rows if norm is None else torch.where(norm > 0, rows, 0.0)


def _sum_parts_into(dkdv_part: torch.Tensor, dv: torch.Tensor, dk: torch.Tensor) -> None:
    """dV and dK from the split backward's (2, parts, B, H_KV, S, E) fp32 partial sums, in part
    order (kernels/partial_sums.py)."""
    from ..kernels.partial_sums import _sum_parts

    values, block = dv.numel(), 1024
    common.launcher(_sum_parts)[(cdiv(values, block), 2)](dkdv_part, dv, dk, dkdv_part.shape[1], values, BLOCK=block, num_warps=4)


def row_stats_planes(planes, rows: int, seq_q: int) -> list[torch.Tensor]:
    """(B, Hq, L) fp32 row-statistic planes (LSE, Δ) as (B·Hq, L) matrices with one row stride, a
    multiple of 4 elements, and rows that start on 16 bytes, as TMA descriptors need: views where
    L is a multiple of 4 and the planes are aligned, else copies into padded rows (a box that
    starts at an unaligned innermost coordinate faults: the H200 raised illegal-instruction
    errors at L = 97 or 333 before the padding)."""
    flats = [plane.contiguous().view(rows, seq_q) for plane in planes]
    if seq_q % 4 == 0 and all(flat.data_ptr() % 16 == 0 for flat in flats):
        return flats
    padded = []
    for flat in flats:
        wide = torch.empty((rows, cdiv(seq_q, 4) * 4), dtype=torch.float32, device=flat.device)
        wide[:, :seq_q].copy_(flat)
        padded.append(wide[:, :seq_q])
    return padded


def row_stats_descriptor(plane: torch.Tensor, block_m: int):
    """A 2-D TMA descriptor over a plane of ``row_stats_planes``, box (1, ``block_m``), unswizzled: the
    loader brings a tile's rows with its Q or dO (kernels/hopper_bwd.py, ROW_STATS_TMA). Columns
    past L read as zeros."""
    return gluon_descriptor(plane, [1, block_m], _unswizzled_fp32_layout())


@functools.lru_cache(maxsize=None)
def _unswizzled_fp32_layout():
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout(0, 32, rank=2)


def _exact_delta_inputs(grad_out, value, out, grad_lse, resid, row_consts, moments: KeyMoments | None = None):
    """(dO', pivots, Δ', ds_up) for the exact-Δ backward (kernels/exact_delta.py); with
    ``moments``, the same launch also fills ``moments.mean_key`` (k̂)."""
    from ..kernels.exact_delta import _exact_delta_preprocess

    batch, heads_q, seq_q, head_dim = grad_out.shape
    heads_kv, seq_k = value.shape[1], value.shape[2]
    pivot, norm = row_consts[0], row_consts[1]
    do_scaled = torch.empty(grad_out.shape, dtype=grad_out.dtype, device=grad_out.device)
    delta = torch.empty((batch, heads_q, seq_q), dtype=torch.float32, device=grad_out.device)
    if grad_lse is not None:
        grad_lse = grad_lse.to(torch.float32).contiguous()
    if resid.stride() != out.stride() or grad_out.stride(-1) != 1 or out.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("exact-Δ backward: out and its residual must share strides, and grad_out, out and value "
                         "need a contiguous last dim")
    collect_stats = grad_out.dtype == torch.float16
    block_m = 64
    rows = torch.sym_max(seq_q, seq_k) if collect_stats else seq_q
    row_programs = cdiv(rows, block_m)
    # One column of partial maxima per program (no contended atomics), reduced below; bf16 keeps none
    # (delta stands in, not touched).
    stats = _ds_stats_buffer(row_programs * batch * heads_q, grad_out.device) if collect_stats else delta
    # With the moments, one more column of programs finishes k̂ (its first B·H_KV programs).
    if moments is not None:
        partial, chunks, k_hat = moments.partial, moments.chunks, moments.mean_key
    else:
        partial, chunks, k_hat = delta, 0, delta  # no such column: not touched
    common.launcher(_exact_delta_preprocess)[(row_programs + (moments is not None), batch * heads_q)](
        grad_out, out, resid, norm, grad_lse if grad_lse is not None else norm, do_scaled, delta, value, stats,
        partial, k_hat, *grad_out.stride()[:3], *out.stride()[:3], *value.stride()[:3], heads_q, heads_kv, seq_q,
        seq_k, row_programs, chunks,
        HEAD_DIM=head_dim, BLOCK_M=block_m, HAS_DLSE=grad_lse is not None, COLLECT_STATS=collect_stats,
        num_warps=4,
    )
    if collect_stats:
        # fp16's ds_up from the preprocess's partial maxima in one Triton launch rather than about 13
        # one-element torch ops (``ds_up_from_stats``, its definition): host time in the fp16 4k causal
        # cells, where forward+backward launches 30 kernels against bf16's 14. On the H200 (fp16, E 128,
        # causal 4k, benchmarks/experiments/switch_ab.py, 2026-12-04): 2.49 ms a forward+backward step
        # against 2.54 with the torch ops (1.02x), dK and dV bitwise the same.
        ds_up = ds_up_in_one_launch(stats)
    else:
        # bf16: the kernel takes ds_up = 1 without reading it. A constant kept for it would be
        # allocated on the first call, which under torch.compile's CUDA graphs is a warm-up run
        # inside the graph's memory pool, and the pool's owner then fails on a live tensor it
        # does not track ("Detected 1 tensor(s) in the cudagraph pool not tracked as outputs").
        ds_up = delta  # not read
    return do_scaled, pivot, delta, ds_up


def exact_delta_inputs(grad_out, value, out, grad_lse, resid, row_consts, moments: KeyMoments | None = None):
    """``_exact_delta_inputs`` for the other Hopper launchers (launch/hopper_varlen.py)."""
    return _exact_delta_inputs(grad_out, value, out, grad_lse, resid, row_consts, moments)


def dq_with_mean_key(dq_accum, mean_key, weight, dtype):
    """``_dq_with_mean_key`` for the other Hopper launchers (launch/hopper_varlen.py)."""
    return _dq_with_mean_key(dq_accum, mean_key, weight, dtype)


def _ds_stats_buffer(programs: int, device) -> torch.Tensor:
    """The preprocess's (3, programs) fp32 partial maxima, uninitialised: every program writes its
    column (zeros where it has no maximum), so no fill launch runs."""
    return torch.empty((3, programs), dtype=torch.float32, device=device)


# The one-pass backward's clamps: the bound on |dS| within [DS_UP_MIN_BOUND, 2^100], so ds_up, a
# power of two that may be below 1 here, stays within 2^±40.
_DS_BOUND_MAX = 2.0**100
_DS_UP_MAX_EXPONENT = 40


def ds_up_from_stats(stats: torch.Tensor) -> torch.Tensor:
    """fp16's ds_up (1,) from the preprocess's (3, programs) partial maxima, as one-element torch
    ops on the device (no synchronisation). |dS| <= P̃ (|dO'·v| + |Δ'|) with P̃ <= 2 and
    |Δ'| <= ‖dO'‖ max‖v‖ + |g dLSE|, kept at the Triton plain loop's limit (a 4x margin to fp16's
    65504) by the largest power of two ds_up with bound·ds_up <= DS_RESCALE_ABOVE."""
    from ..kernels.ds_scaling import DS_RESCALE_ABOVE, DS_UP_MIN_BOUND

    stats = stats.amax(dim=1)
    bound = 4.0 * stats[0].sqrt() * stats[1].sqrt() + 2.0 * stats[2]
    bound = torch.nan_to_num(bound, nan=float("inf")).clamp(DS_UP_MIN_BOUND.value, _DS_BOUND_MAX)
    limit = 2.0**_DS_UP_MAX_EXPONENT
    return torch.exp2(torch.floor(torch.log2(DS_RESCALE_ABOVE.value / bound))).clamp(1 / limit, limit).reshape(1)


def ds_up_in_one_launch(stats: torch.Tensor) -> torch.Tensor:
    """``ds_up_from_stats`` as one Triton launch (``kernels/exact_delta._ds_up_from_stats``)."""
    from ..kernels.ds_scaling import DS_RESCALE_ABOVE, DS_UP_MIN_BOUND
    from ..kernels.exact_delta import _ds_up_from_stats

    ds_up = torch.empty(1, dtype=torch.float32, device=stats.device)
    common.launcher(_ds_up_from_stats)[(1,)](stats, ds_up, stats.shape[1], LIMIT=DS_RESCALE_ABOVE.value,
                            MIN_BOUND=DS_UP_MIN_BOUND.value, MAX_BOUND=_DS_BOUND_MAX,
                            MAX_EXPONENT=_DS_UP_MAX_EXPONENT, BLOCK=1024)
    return ds_up


@dataclasses.dataclass(frozen=True)
class KeyMoments:
    """k̂'s makings: ``_key_moments``' partial sums, minima and maxima (3, B·H_KV, chunks, E) fp32,
    and the (B, H_KV, E) fp32 buffer k̂ goes to, which the exact-Δ preprocess's launch fills
    (kernels/exact_delta.py) on the one-pass path: one launch fewer than ``key_mean``."""

    partial: torch.Tensor
    chunks: int
    mean_key: torch.Tensor


def key_moments(key: torch.Tensor, max_chunks: int = 16, min_chunk: int = 512) -> KeyMoments:
    """The pass over K (B, H_KV, S ≥ 1, E, unit last stride) that k̂ needs, in one Triton launch;
    ``KeyMoments.mean_key`` is filled by whichever launch finishes it (``key_mean``, or the
    exact-Δ preprocess when ``hopper_attention_backward`` gets the moments as its ``mean_key``).
    Deterministic: the chunks are fixed by the shape and reduced in order."""
    from ..kernels.exact_delta import _key_moments

    batch, heads_kv, seq_k, head_dim = key.shape
    block_n = max(16, 8192 // head_dim)
    chunks = max(1, min(max_chunks, seq_k // min_chunk))
    chunk = cdiv(cdiv(seq_k, chunks), block_n) * block_n
    chunks = cdiv(seq_k, chunk)
    partial = torch.empty((3, batch * heads_kv, chunks, head_dim), dtype=torch.float32, device=key.device)
    k_hat = torch.empty((batch, heads_kv, head_dim), dtype=torch.float32, device=key.device)
    # The moments keep three (rows, E) fp32 accumulators live, so each of their two loads an
    # iteration takes half the rows (the pair, a divisor of the chunk), over eight warps, four at
    # E 128: timed alone on the H200 (bf16, 4k, benchmarks/experiments/linear_passes.py at commit
    # f7e9ac3, 2026-12-04) 40 against 51 µs at 16k tokens, 60 against 76 at 32k; a whole bf16 causal
    # 4k step 2.326 ms either way, within its noise.
    moment_warps = 4 if head_dim >= 128 else 8
    common.launcher(_key_moments)[(chunks, batch * heads_kv)](key, partial, *key.stride()[:3], heads_kv, seq_k, chunk,
                                             HEAD_DIM=head_dim, BLOCK_N=max(1, block_n // 2), num_warps=moment_warps)
    return KeyMoments(partial, chunks, k_hat)


def key_mean(key: torch.Tensor, max_chunks: int = 16, min_chunk: int = 512) -> torch.Tensor:
    """k̂ (B, H_KV, E) fp32 of ``ops/one_pass.key_mean_reference``, in two Triton launches
    (kernels/exact_delta.py): ``key_moments``, then ``finish_key_mean``."""
    return finish_key_mean(key_moments(key, max_chunks, min_chunk), key)


def finish_key_mean(moments: KeyMoments, key: torch.Tensor) -> torch.Tensor:
    """``moments.mean_key`` filled in a launch of its own (one small program a head), as the
    exact-Δ preprocess's extra column fills it on the one-pass path; ``key`` gives the dtype and S."""
    from ..kernels.exact_delta import _mean_key_from_moments

    batch, heads_kv, seq_k, head_dim = key.shape
    common.launcher(_mean_key_from_moments)[(batch * heads_kv,)](moments.partial, moments.mean_key, key, moments.chunks, seq_k,
                                                HEAD_DIM=head_dim, num_warps=1)
    return moments.mean_key


def _dq_with_mean_key(dq_accum, mean_key, weight, dtype):
    """dq = dq_accum + weight_i·k̂ in the input dtype, one pass (kernels/exact_delta.py)."""
    from ..kernels.exact_delta import _finish_dq_with_mean_key

    batch, heads_q, seq_q, head_dim = dq_accum.shape
    heads_kv = mean_key.shape[1]
    dq = torch.empty(dq_accum.shape, dtype=dtype, device=dq_accum.device)
    block_m = 64
    common.launcher(_finish_dq_with_mean_key)[(cdiv(seq_q, block_m), batch * heads_q)](
        dq_accum, weight.contiguous(), mean_key.contiguous(), dq, heads_q, heads_q // heads_kv, seq_q,
        HEAD_DIM=head_dim, BLOCK_M=block_m, num_warps=4,
    )
    return dq


def hopper_backward_supported(grad_out, query, key, value, attn_mask=None, dropout_p: float = 0.0,
                              scale: float | None = None, schedule: str | None = None, *,
                              is_causal: bool = True, window=None) -> bool:
    """Whether ``hopper_attention_backward`` implements this call (real tensors)."""
    return (hopper_backward_unsupported_reason(query, key, value, attn_mask, dropout_p, scale, schedule,
                                               is_causal=is_causal, window=window) is None
            and backward_tma_unsupported_reason(grad_out, query, key, value) is None)
