"""The 16-bit and fp32 forward (``kernels/attn_fwd.py``); the `fp8` schedule goes to ``fp8.py``."""

from __future__ import annotations

import torch

from ..tuning.kernel_config import AttentionConfigs
from ..schedules import get_schedule
# The launch wrapper and the config lookup are read off the module at every launch, so that tools
# and tests can swap them (tools/launch_sass.py compiles for sm_90 instead of launching; the
# bounds tests force wide tiles; tests spy on launches).
from . import common
from .band import band_lower, causal_side
from .common import LOG2E, cdiv, common_meta, forward_outputs, softcap_log2
from .block_tiles import check_block_layout, fold_into_mask, kernel_layout
from .fp8 import attention_forward_fp8
from .packed import NOT_PACKED, PackedSequences, strides
from .visibility import NO_MASKING, Visibility


def _fold_scale(scale: float, has_mask: bool) -> bool:
    """Whether the forward takes the scale into exp2's argument (one FFMA per score, the product
    never rounded; kernels/attn_fwd.py). Only without a mask, as measured rather than derived: with
    it on under a padding mask, the fp16 GPT-2 overflow test's ln_1.bias gradient error (seed 7) was
    3.0x SDPA fp16's against 1.9x with it off, past the test's 2x bound, and still 2.8x when the
    backward folded the scale too, so the cause is not a mismatch between the passes' P; another
    seed favoured folding. Folding is worth 1-2 % of the forward, not a test's margin, so masked
    calls keep the rounded scaled score."""
    return scale > 0 and not has_mask


def attention_forward(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
    rng_seed: torch.Tensor | None, dropout_p: float, scale: float, schedule: str, *,
    visibility: Visibility = NO_MASKING, configs: AttentionConfigs | None = None, softcap: float = 0.0,
    packed: PackedSequences | None = None, sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the forward kernel. Returns (out (B, Hq, L, Ev) in the input dtype, lse (B, Hq, L) fp32).

    ``visibility``: the causal side, the sliding window and the block-sparse layout
    (``launch.visibility``). ``configs`` forces the launch configs (the autotuner's candidates);
    None looks them up. ``softcap`` > 0 soft-caps the scaled scores before the mask (not with the
    `fp8` schedule, whose kernel has no cap: refused). ``packed``: the inputs are (1, H, total, E)
    views of packed sequences (``launch.packed``); the LSE is then (1, Hq, total_q). ``sinks`` (Hq,):
    each query head's sink logit in every row's denominator (ops/sinks.py): out and lse come back with
    it (16-bit and fp32 kernels; the `fp8` kernel has none: refused)."""
    from ..kernels.attn_fwd import _attn_fwd

    block_map, block_q, block_k = visibility.block_map, visibility.block_q, visibility.block_k
    if block_map is not None:
        check_block_layout(block_map, block_q, block_k, query, key)
    if get_schedule(schedule).fp8_forward:
        if softcap:
            raise ValueError("attention_forward: the fp8 kernel has no soft cap; use a 16-bit schedule with softcap.")
        if sinks is not None:
            raise ValueError("attention_forward: the fp8 kernel has no sinks; fold them in after it "
                             "(flash_inductor.ops.sinks.fold_sinks) or use a 16-bit schedule.")
        if block_map is not None:  # the fp8 kernel walks every tile: the layout becomes an element mask
            attn_mask = fold_into_mask(attn_mask, block_map, block_q, block_k, (*query.shape[:3], key.shape[2]))
        if packed is not None:
            raise ValueError("attention_forward: the fp8 kernel takes no packed sequences; use a 16-bit schedule.")
        return attention_forward_fp8(query, key, value, attn_mask, rng_seed, dropout_p, scale, schedule,
                                     visibility=visibility.without_block_layout(), configs=configs)
    batch, heads_q, seq_q, _ = query.shape
    heads_kv, seq_k = key.shape[1], key.shape[2]
    out, lse = forward_outputs(query, value, packed=packed is not None)
    if out.numel() == 0 and lse.numel() == 0:
        return out, lse
    # The kernel sees the band: its upper side as the causal arguments, its lower side (a
    # window's left bound) as WINDOW_LEFT and window_lower.
    band = visibility.band(seq_q, seq_k) if packed is None else packed.band(visibility)
    is_causal, causal_offset = causal_side(band)

    switches, mask_arg, mask_strides, meta = common_meta(query, key, value, attn_mask, dropout_p, is_causal, schedule)
    cfg = common.launch_configs(query, key, value, attn_mask, is_causal, schedule, configs).forward
    grid = (cdiv(seq_q, cfg.block_m), batch * heads_q) if packed is None else \
        (cdiv(packed.max_seqlen_q, cfg.block_m), packed.count * heads_q)
    layout_args, layout_meta = kernel_layout(block_map, block_q, block_k, batch, heads_q, seq_q, seq_k, band.lower,
                                             band.upper, cfg.block_m, cfg.block_n)
    common.launcher(_attn_fwd)[grid](
        query, key, value, mask_arg, rng_seed if rng_seed is not None else query, out, lse,
        *strides(query, packed), *strides(key, packed), *strides(value, packed), *mask_strides, *strides(out, packed),
        heads_q, heads_q // heads_kv, seq_q, seq_k, causal_offset, band_lower(band), scale * LOG2E,
        softcap_log2(softcap), dropout_p, *layout_args,
        *(NOT_PACKED if packed is None else packed.kernel_args()), VARLEN=packed is not None, **layout_meta,
        WINDOW_LEFT=band.lower is not None, P_IN_FP32=switches["P_IN_FP32"],
        FOLD_SCALE=_fold_scale(scale, meta["HAS_MASK"]) and not softcap, SOFTCAP=softcap > 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        # None without sinks: a constexpr, so the kernel's parameters are those it has without them.
        SINKS=None if sinks is None else sinks.to(torch.float32).contiguous(), HAS_SINKS=sinks is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **meta,
    )
    return out, lse

