"""The backward: the Δ preprocess, the row reference, then the dQ pass and the dK/dV pass
(``kernels/attn_bwd.py``)."""

from __future__ import annotations

import torch

from ..tuning.kernel_config import AttentionConfigs, padded_head_dim
from ..schedules import STABLE, get_schedule
# The launch wrapper and the config lookup are read off the module at every launch, so that tools
# and tests can swap them (tools/launch_sass.py compiles for sm_90 instead of launching; the
# bounds tests force wide tiles; tests spy on launches).
from . import common
from .band import band_lower, causal_side
from .common import LOG2E, cdiv, common_meta, head_dims, softcap_log2, whole_blocks
from .block_tiles import check_block_layout, fold_into_mask, kernel_layout
from .forward import attention_forward
from .packed import NOT_PACKED, PackedSequences, strides
from .visibility import NO_MASKING, Visibility


def attention_backward(
    grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attn_mask: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor, grad_lse: torch.Tensor | None,
    rng_seed: torch.Tensor | None, dropout_p: float, scale: float, schedule: str, compute_mask_grad: bool, *,
    visibility: Visibility = NO_MASKING, configs: AttentionConfigs | None = None,
    ds_bound: torch.Tensor | None = None, softcap: float = 0.0, packed: PackedSequences | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the backward kernels. Returns (dq, dk, dv, dmask); dmask is empty unless asked for.

    ``visibility``: the causal side, the sliding window and the block-sparse layout
    (``launch.visibility``), as the forward's. ``configs`` forces the launch configs (the
    autotuner's candidates); None looks them up. ``ds_bound`` (a one-element fp32 tensor) replaces
    the bound on |dS| that the preprocess measures, under the schedules that rescale dS (fp16
    `stable`): tests and experiments force either loop with it (a bound past
    ``ds_scaling.DS_RESCALE_ABOVE``, or inf, takes the rescaling loop). Elsewhere it is ignored.
    ``softcap``: the forward's soft cap (0: none); ``packed``: the forward's packed sequences.
    ``sinks`` (Hq,): the attention sinks that ``out`` and ``lse`` carry (ops/sinks.py); only exact Δ
    reads them (its renormalisation counts the sink's share), and the `fp8` schedule's 16-bit forward."""
    from ..kernels.attn_bwd import _attn_bwd_dkdv, _attn_bwd_dq, _attn_bwd_row_reference

    block_map, block_q, block_k = visibility.block_map, visibility.block_q, visibility.block_k
    if block_map is not None:
        check_block_layout(block_map, block_q, block_k, query, key)
    if get_schedule(schedule).fp8_forward:
        # fp8 is a forward schedule: the gradient is the 16-bit attention's, from a 16-bit forward
        # (its O and LSE; the fp8 ones would not match the recomputed P) and `stable`'s backward.
        schedule = STABLE.name
        out, lse = attention_forward(query, key, value, attn_mask, rng_seed, dropout_p, scale, schedule,
                                     visibility=visibility, softcap=softcap, packed=packed,
                                     **({} if sinks is None else {"sinks": sinks}))
    batch, heads_q, seq_q, _ = query.shape
    heads_kv, seq_k = key.shape[1], key.shape[2]
    head_dim, head_dim_v = head_dims(query, value)
    if packed is None:
        dq = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        dk = torch.empty(key.shape, dtype=key.dtype, device=key.device)
        dv = torch.empty(value.shape, dtype=value.dtype, device=value.device)
    else:  # in the packed (total, H, E) layout of the inputs, which the (1, H, total, E) views permute
        dq, dk, dv = (torch.empty_like(t) for t in (query, key, value))
    if compute_mask_grad:
        # Positions no pass visits (outside the band) have dS = 0.
        dmask = torch.zeros((batch, heads_q, seq_q, seq_k), dtype=torch.float32, device=query.device)
    else:
        dmask = query.new_empty(0)

    if seq_q == 0 or seq_k == 0 or batch * heads_q == 0:
        # No query row attends to anything: every gradient is zero.
        for grad in (dq, dk, dv):
            grad.zero_()
        return dq, dk, dv, dmask.to(attn_mask.dtype) if compute_mask_grad else dmask

    # The kernels see the band: its upper side as the causal arguments, its lower side as
    # WINDOW_LEFT and window_lower (as the forward's).
    band = visibility.band(seq_q, seq_k) if packed is None else packed.band(visibility)
    is_causal, causal_offset = causal_side(band)
    window_lower = band_lower(band)
    # Under packing the dQ and dK/dV passes run one program column per (sequence, head); the
    # preprocess and the row reference see the packed rows as one dense call (no mask: no row is
    # ever at a mask's clamp, so the row reference never walks keys).
    packed_args = NOT_PACKED if packed is None else packed.kernel_args()
    programs_q = batch if packed is None else packed.count
    rows_q, rows_k = (seq_q, seq_k) if packed is None else (packed.max_seqlen_q, packed.max_seqlen_k)
    meta_window = dict(WINDOW_LEFT=band.lower is not None)
    switches, mask_arg, mask_strides, meta = common_meta(query, key, value, attn_mask, dropout_p, is_causal, schedule)
    configs = common.launch_configs(query, key, value, attn_mask, is_causal, schedule, configs)
    p_in_fp32, ds_in_fp32, ds_rescale = switches["P_IN_FP32"], switches["DS_IN_FP32"], switches["DS_RESCALE"]
    # An fp32 O already gives rowsum(dO∘O) to fp32, and the correction re-derives Δ from the P and
    # dP of this call's keys alone: wrong where a call sees part of each row, as ring attention's
    # calls do (flash_inductor.distributed passes its fp32 merged O for exactly that reason).
    exact_delta = switches["EXACT_DELTA"] and out.dtype != torch.float32
    seed_arg = rng_seed if rng_seed is not None else query

    delta = torch.empty((batch, heads_q, seq_q), dtype=torch.float32, device=query.device)
    if grad_lse is not None:
        grad_lse = grad_lse.to(torch.float32).contiguous()  # read as a flat (B*Hq*L) row vector
    # Under a rescaling schedule (fp16 `stable`) the preprocess also collects the maxima the
    # kernels bound |dS| with (``ds_scaling._ds_loop_choice``), so its grid spans V's rows too.
    collect_ds_stats = ds_rescale and ds_bound is None
    if ds_rescale:
        ds_stats = torch.zeros(3, dtype=torch.float32, device=query.device)
        if ds_bound is not None:
            ds_stats[2:] = ds_bound.reshape(1)  # (0, 0, B): the kernels' bound is B itself
    else:
        ds_stats = delta  # never read
    launch_preprocess(out, grad_out, grad_lse, value, delta, ds_stats, head_dim_v, meta["BLOCK_EV"],
                       configs.backward_dq.block_m, collect_ds_stats)

    scale_log2, cap_log2, has_cap = scale * LOG2E, softcap_log2(softcap), softcap > 0
    cfg = configs.backward_dq
    row_ref = torch.empty_like(delta)
    row_shift = torch.empty_like(delta)
    # Set by the row-reference kernel when some row needs its shift; the dK/dV pass reads it to
    # skip the shift everywhere else.
    shift_flag = torch.zeros(1, dtype=torch.int32, device=query.device)
    row_mask_arg, row_mask_strides = mask_arg, mask_strides
    if block_map is not None and attn_mask is not None and attn_mask.is_floating_point():
        # Rows at a float mask's clamp take one pass over every key here (_attn_bwd_row_reference),
        # which knows no layout: it reads the layout as part of the mask instead.
        folded = fold_into_mask(attn_mask, block_map, block_q, block_k, (batch, heads_q, seq_q, seq_k))
        _, row_mask_arg, row_mask_strides, _ = common_meta(query, key, value, folded, dropout_p, is_causal, schedule)
    common.launcher(_attn_bwd_row_reference)[(cdiv(seq_q, cfg.block_m), batch * heads_q)](
        query, key, row_mask_arg, lse, row_ref, row_shift, shift_flag,
        *query.stride(), *key.stride(), *row_mask_strides,
        heads_q, heads_q // heads_kv, seq_q, seq_k, causal_offset, window_lower, scale_log2, cap_log2,
        SOFTCAP=has_cap, HEAD_DIM=head_dim, BLOCK_E=meta["BLOCK_E"], HAS_MASK=meta["HAS_MASK"],
        MASK_IS_BOOL=meta["MASK_IS_BOOL"], IS_CAUSAL=is_causal, **meta_window, FP32_DOT=meta["FP32_DOT"], BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    # The dQ pass runs first: under exact Δ it replaces each row's Δ in `delta` with the corrected
    # one, which the dK/dV pass then reads; dS is final only in that second pass, so it writes
    # dmask. Without exact Δ the two passes are independent and the dQ pass writes dmask.
    dmask_arg = dmask if compute_mask_grad else query
    # Load masks that cannot bind are left out of the loops (``load_tile``): the head dims at
    # their padded widths, and the looped-over length a whole number of blocks.
    even_e = meta["BLOCK_E"] == head_dim and meta["BLOCK_EV"] == head_dim_v
    cfg = configs.backward_dq
    layout_args, layout_meta = kernel_layout(block_map, block_q, block_k, batch, heads_q, seq_q, seq_k, band.lower,
                                             band.upper, cfg.block_m, cfg.block_n)
    common.launcher(_attn_bwd_dq)[(cdiv(rows_q, cfg.block_m), programs_q * heads_q)](
        query, key, value, mask_arg, seed_arg, grad_out, row_ref, row_shift,
        grad_lse if grad_lse is not None else lse, delta, ds_stats, dq, dmask_arg,
        *strides(query, packed), *strides(key, packed), *strides(value, packed), *mask_strides,
        *strides(grad_out, packed), *strides(dq, packed),
        heads_q, heads_q // heads_kv, seq_q, seq_k, causal_offset, window_lower, scale_log2, cap_log2, scale,
        dropout_p, *layout_args, *packed_args, **layout_meta, SOFTCAP=has_cap, VARLEN=packed is not None,
        P_IN_FP32=p_in_fp32, DS_IN_FP32=ds_in_fp32, DS_RESCALE=ds_rescale,
        EXACT_DELTA=exact_delta, HAS_DLSE=grad_lse is not None, WRITE_DMASK=compute_mask_grad and not exact_delta,
        EVEN_N=packed is None and whole_blocks(seq_k, cfg.block_n), EVEN_E=even_e,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        # None without sinks (or without exact Δ, which alone reads them): a constexpr, no parameter.
        SINKS=sinks.to(torch.float32).contiguous() if sinks is not None and exact_delta else None,
        HAS_SINKS=sinks is not None and exact_delta,
        **meta, **meta_window,
    )
    cfg = configs.backward_dkdv
    layout_args, layout_meta = kernel_layout(block_map, block_q, block_k, batch, heads_q, seq_q, seq_k, band.lower,
                                             band.upper, cfg.block_m, cfg.block_n, columns=True)
    common.launcher(_attn_bwd_dkdv)[(cdiv(rows_k, cfg.block_n), programs_q * heads_kv)](
        query, key, value, mask_arg, seed_arg, grad_out, row_ref, row_shift, shift_flag, delta, ds_stats, dk, dv,
        dmask_arg,
        *strides(query, packed), *strides(key, packed), *strides(value, packed), *mask_strides,
        *strides(grad_out, packed), *strides(dk, packed), *strides(dv, packed),
        heads_q, heads_kv, heads_q // heads_kv, seq_q, seq_k, causal_offset, window_lower, scale_log2, cap_log2,
        scale, dropout_p, *layout_args, *packed_args, **layout_meta, SOFTCAP=has_cap, VARLEN=packed is not None,
        P_IN_FP32=p_in_fp32, DS_IN_FP32=ds_in_fp32, DS_RESCALE=ds_rescale,
        WRITE_DMASK=compute_mask_grad and exact_delta,
        EVEN_M=packed is None and whole_blocks(seq_q, cfg.block_m), EVEN_E=even_e,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **meta, **meta_window,
    )
    if compute_mask_grad:
        dmask = dmask.to(attn_mask.dtype)
    return dq, dk, dv, dmask


def launch_preprocess(out, grad_out, grad_lse, value, delta, ds_stats, head_dim_v: int, block_ev: int,
                       block_m: int, collect_ds_stats: bool) -> None:
    """Δ into ``delta``, and under ``collect_ds_stats`` the dS bound's maxima into ``ds_stats``
    (``attn_bwd._attn_bwd_preprocess``); its grid then spans max(L, S) rows, to cover V's."""
    from ..kernels.attn_bwd import _attn_bwd_preprocess

    batch, heads_q, seq_q = grad_out.shape[:3]
    heads_kv, seq_k = value.shape[1], value.shape[2]
    rows = torch.sym_max(seq_q, seq_k) if collect_ds_stats else seq_q  # sym_max: no guard on symbolic lengths
    common.launcher(_attn_bwd_preprocess)[(cdiv(rows, block_m), batch * heads_q)](
        out, grad_out, grad_lse if grad_lse is not None else delta, delta, value, ds_stats,
        *out.stride(), *grad_out.stride(), *value.stride(), heads_q, heads_kv, batch * heads_kv, seq_q, seq_k,
        HEAD_DIM_V=head_dim_v, BLOCK_EV=block_ev, HAS_DLSE=grad_lse is not None,
        COLLECT_DS_STATS=collect_ds_stats, BLOCK_M=block_m,
    )


def measure_ds_bound(grad_out: torch.Tensor, value: torch.Tensor, grad_lse: torch.Tensor | None,
              dropout_p: float) -> torch.Tensor:
    """The bound on |dS| the backward kernels decide their loop with, measured as the backward
    measures it: the preprocess alone collects the maxima (its Δ, from grad_out standing in for O,
    is discarded), and this combines them as ``ds_scaling._ds_loop_choice`` does. A one-element
    fp32 tensor. For tests and experiments; the backward itself never calls it."""
    head_dim_v = grad_out.shape[-1]
    stats = torch.zeros(3, dtype=torch.float32, device=grad_out.device)
    delta = torch.empty(grad_out.shape[:3], dtype=torch.float32, device=grad_out.device)
    if grad_lse is not None:
        grad_lse = grad_lse.to(torch.float32).contiguous()
    launch_preprocess(grad_out, grad_out, grad_lse, value, delta, stats, head_dim_v, padded_head_dim(head_dim_v),
                       64, collect_ds_stats=True)
    keep_scale = 1.0 / (1.0 - dropout_p)
    return ((2.0 * keep_scale) * stats[0].sqrt() * stats[1].sqrt() + stats[2]).reshape(1)
