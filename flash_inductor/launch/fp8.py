"""Launcher of the `fp8` schedule's forward (``kernels/attn_fwd_fp8.py``): quantise, then attend.

Three quantisation launches write e4m3 copies of Q and K (a power-of-two scale per token) and
of V (one per channel, stored sequence-contiguous), then the attention kernel runs on them.
The copies cost one read of Q, K, V and a write of half their bytes, plus one extra read of V
for its per-channel maxima; the attention kernel then reads half the bytes per tile.
"""

from __future__ import annotations

import torch

# The launch wrapper and the config lookup are read off the module at every launch, so that tools
# and tests can swap them (tools/launch_sass.py compiles for sm_90 instead of launching; the
# bounds tests force wide tiles; tests spy on launches).
from . import common
from .band import has_window
from .common import LOG2E, cdiv, common_meta, forward_outputs, interpreter_enabled
from .visibility import NO_MASKING, Visibility

# fp8 tensor cores: Ada (sm_89) and Hopper (sm_90) onwards.
FP8_MIN_CAPABILITY = (8, 9)
# e4m3 products take a reduction axis of at least 32 (the head dim for QKᵀ, BLOCK_N for P·V).
_FP8_MIN_K = 32
_ROWS_PER_QUANTIZE_PROGRAM = 64


def check_fp8_device(device: torch.device) -> None:
    """Raise a clear error where the `fp8` schedule cannot run: a CUDA GPU without fp8 tensor
    cores. CPU tensors take the reference path (which ignores schedules) and run anywhere."""
    if device.type != "cuda" or interpreter_enabled():
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        raise ValueError(
            f"flash_attention: schedule='fp8' needs fp8 tensor cores (compute capability "
            f"{FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} or newer: L4, H100, H200, ...); "
            f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}. "
            "Use schedule='stable' (the default) on this GPU."
        )


def check_fp8_window(window) -> None:
    """The `fp8` forward has no sliding window: say so, on every device (the CPU reference would
    take it, but a call that works only off the GPU is a trap)."""
    if has_window(window):
        raise ValueError(
            f"flash_attention: schedule='fp8' does not support window={tuple(window)!r}; use "
            "schedule='stable' (the default) or 'fast' with a window."
        )


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def _quantize(x: torch.Tensor, per_row: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 copy of x (B, H, N, E) and its fp32 dequantisation factors.

    per_row: (B, H, N, E) copy, factors (B*H, N). Otherwise (V): the copy is stored (B, H, E, N)
    with N contiguous (padded to 16 elements so every row starts 16-byte aligned) and returned
    as a (B, H, N, E) view; factors (B*H, E)."""
    from ..kernels.attn_fwd_fp8 import _quantize_fp8

    batch, heads, length, width = x.shape
    if per_row:
        padded_width = max(_round_up(width, 16), _FP8_MIN_K)
        storage = torch.empty((batch, heads, length, padded_width), dtype=torch.float8_e4m3fn, device=x.device)
        x8 = storage[..., :width]
    else:
        padded_length = _round_up(max(length, 1), 16)
        storage = torch.empty((batch, heads, width, padded_length), dtype=torch.float8_e4m3fn, device=x.device)
        x8 = storage[..., :length].transpose(-2, -1)
    factors = length if per_row else width
    if length == 0:
        return x8, torch.ones((batch * heads, factors), dtype=torch.float32, device=x.device)
    dequant = torch.empty((batch * heads, factors), dtype=torch.float32, device=x.device)
    # V's per-channel maxima over the whole sequence come first (one reduction); rows find theirs in the kernel.
    column_amax = dequant if per_row else x.abs().amax(dim=2).to(torch.float32).reshape(batch * heads, width)
    grid = (cdiv(length, _ROWS_PER_QUANTIZE_PROGRAM), batch * heads)
    # The kernel writes through `storage` itself with the view's strides (offset 0): a fresh
    # base tensor, never a view, is what Inductor's analysis of a mutated argument handles best.
    common.launcher(_quantize_fp8)[grid](
        x, storage, dequant, column_amax, *x.stride(), *x8.stride(), heads, length,
        HEAD_DIM=width, BLOCK_E=max(_FP8_MIN_K, 1 << (width - 1).bit_length()), PER_ROW=per_row,
        EMULATE_ROUNDING=interpreter_enabled(), BLOCK_R=_ROWS_PER_QUANTIZE_PROGRAM,
    )
    return x8, dequant


def attention_forward_fp8(query, key, value, attn_mask, rng_seed, dropout_p, scale, schedule, *,
                          visibility: Visibility = NO_MASKING, configs=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``attention_forward``'s contract under the `fp8` schedule: its arguments (typed there; a
    block-sparse layout arrives folded into ``attn_mask``, never in ``visibility``) and its results,
    (out in the input dtype, lse fp32 natural log). The LSE is the fp8 forward's own (from
    e4m3-rounded scores)."""
    from ..kernels.attn_fwd_fp8 import _attn_fwd_fp8

    check_fp8_device(query.device)
    check_fp8_window(visibility.window)
    if visibility.block_map is not None:
        raise ValueError("attention_forward_fp8: the fp8 kernel takes no block-sparse layout; fold it into "
                         "attn_mask (block_tiles.fold_into_mask), as launch.attention_forward does.")
    is_causal, causal_offset = visibility.is_causal, visibility.causal_offset
    batch, heads_q, seq_q, _ = query.shape
    heads_kv, seq_k = key.shape[1], key.shape[2]
    out, lse = forward_outputs(query, value)
    if out.numel() == 0 and lse.numel() == 0:
        return out, lse

    _, mask_arg, mask_strides, meta = common_meta(query, key, value, attn_mask, dropout_p, is_causal, schedule)
    meta.pop("FP32_DOT")  # every product here is e4m3 x e4m3 -> fp32
    meta["BLOCK_E"] = meta["BLOCK_EV"] = max(meta["BLOCK_E"], _FP8_MIN_K)
    cfg = common.launch_configs(query, key, value, attn_mask, is_causal, schedule, configs).forward
    if cfg.block_n < _FP8_MIN_K and not interpreter_enabled():
        raise ValueError(f"fp8 forward: block_n={cfg.block_n} is below the e4m3 product's minimum of {_FP8_MIN_K}.")

    q8, q_dequant = _quantize(query, per_row=True)
    k8, k_dequant = _quantize(key, per_row=True)
    v8, v_dequant = _quantize(value, per_row=False)
    grid = (cdiv(seq_q, cfg.block_m), batch * heads_q)
    common.launcher(_attn_fwd_fp8)[grid](
        q8, k8, v8, q_dequant, k_dequant, v_dequant, mask_arg, rng_seed if rng_seed is not None else query, out, lse,
        *q8.stride(), *k8.stride(), *v8.stride(), *mask_strides, *out.stride(),
        heads_q, heads_q // heads_kv, seq_q, seq_k, causal_offset, scale * LOG2E, dropout_p,
        EMULATE_ROUNDING=interpreter_enabled(),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **meta,
    )
    return out, lse
