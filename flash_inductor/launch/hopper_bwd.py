"""Launcher for the Gluon Hopper backward (kernels/hopper_bwd.py): which calls it takes, its tile
config, the TMA descriptors, and the dQ accumulator.

Not wired into the op yet: ``hopper_attention_backward`` takes what ``launch.attention_backward``
takes for the calls it covers and returns (dq, dk, dv), so the op can choose it at launch time
exactly as it chooses the Hopper forward (``launch/hopper.py``).

What it covers now: sm_90, bf16/fp16, E = Ev in {64, 128}, no mask, no dropout, causal or not
(any ``causal_offset``), grouped-query attention, the `fast` schedule (Δ = rowsum(dO∘O) - dLSE,
dS cast straight to the input dtype), TMA-addressable strides. `stable` needs the exact Δ and
fp16 dS rescaling, which this path does not do yet (docs/hopper_backward.md says what they would
cost here); it and everything else keep the Triton kernels.

Steps: the Triton preprocess writes Δ (B, Hq, L) fp32; the Gluon kernel runs one CTA per
(128-key block, batch, KV head), writes dK and dV directly (the GQA group's query heads are
summed in registers) and adds scale·dS·K into a zeroed fp32 (B, Hq, L, E) buffer, one TMA
reduce-add per tile (atomics where the Triton build lacks the reduce copy); that buffer is then
cast to dq.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..schedules import get_schedule
from .common import LOG2E, cdiv
from .hopper import tma_descriptor, hopper_forward_unsupported_reason, tma_unsupported_reason


@dataclass(frozen=True)
class HopperBackwardConfig:
    """``block_m`` query rows per streamed Q/dO tile, a ``num_stages``-deep ring of them; the CTA
    owns 128 keys (64 per consumer warpgroup). ``dq_split``: the two consumers share dS through
    shared memory and each computes half of dQ's columns (FA3's split), rather than each adding
    its own 64-key partial dQ. ``dq_tma``: dQ partials reach the fp32 accumulator through shared
    memory and one TMA reduce-add per tile rather than one scalar atomic add per element."""

    block_m: int = 64
    num_stages: int = 2
    dq_split: bool = True
    dq_tma: bool = True
    consumer_regs: int = 240
    loader_regs: int = 24

    block_n: int = 128  # two consumers x 64 keys, fixed by the kernel

    @property
    def maxnreg(self) -> int:
        # 12 warps (two consumer warpgroups and the loader's, counted as a warpgroup): 168.
        return 65536 // (128 * 3) // 8 * 8


def default_config(head_dim: int, is_causal: bool) -> HopperBackwardConfig:
    del head_dim, is_causal  # not yet measured apart
    return HopperBackwardConfig()


def hopper_backward_unsupported_reason(query, key, value, attn_mask=None, dropout_p: float = 0.0,
                                       scale: float | None = None, schedule: str | None = None) -> str | None:
    """None if the Hopper backward takes this call as far as its static properties go, else why
    not (for the logs). Safe on fake tensors."""
    reason = hopper_forward_unsupported_reason(query, key, value, attn_mask, dropout_p, scale, schedule)
    if reason is not None:
        return reason
    sched = get_schedule(schedule)
    if sched.exact_delta or sched.ds_rescale or sched.ds_in_fp32:
        return (f"schedule {sched.name!r} (the Hopper backward implements `fast`'s Δ and dS cast; "
                "exact Δ and fp16 dS rescaling are not implemented on this path yet)")
    return None


def hopper_attention_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              out: torch.Tensor, lse: torch.Tensor, grad_lse: torch.Tensor | None = None, *,
                              scale: float | None = None, is_causal: bool = False, causal_offset: int = 0,
                              config: HopperBackwardConfig | None = None,
                              delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of attention on the Gluon Hopper kernel, `fast` schedule.

    ``query``/``out``/``grad_out`` (B, Hq, L, E), ``key``/``value`` (B, Hkv, S, E) with Hq a
    multiple of Hkv; ``lse`` (B, Hq, L) fp32 in natural log as the forward returns it (-inf for a
    row that sees no key: its gradients are 0); ``grad_lse`` the LSE output's gradient, or None.
    ``delta`` (B, Hq, L) fp32 replaces the preprocess's Δ (experiments). Call only where
    ``hopper_backward_unsupported_reason`` and ``tma_unsupported_reason`` (on query, key, value,
    grad_out) say so."""
    from ..kernels.gluon_tma import HAS_TMA_REDUCE
    from ..kernels.hopper_bwd import _attn_bwd_hopper
    from .backward import launch_preprocess

    batch, heads_q, seq_q, head_dim = query.shape
    heads_kv, seq_k = key.shape[1], key.shape[2]
    if scale is None:
        scale = head_dim ** -0.5
    cfg = config or default_config(head_dim, is_causal)
    dk = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    dv = torch.empty(value.shape, dtype=value.dtype, device=value.device)
    if seq_q == 0 or seq_k == 0 or batch * heads_q == 0:
        return torch.zeros_like(query), dk.zero_(), dv.zero_()
    if delta is None:
        delta = torch.empty((batch, heads_q, seq_q), dtype=torch.float32, device=query.device)
        if grad_lse is not None:
            grad_lse = grad_lse.to(torch.float32).contiguous()
        launch_preprocess(out, grad_out, grad_lse, value, delta, delta, head_dim, head_dim, 64, False)
    lse = lse.to(torch.float32).contiguous()
    dq_accum = torch.zeros((batch, heads_q, seq_q, head_dim), dtype=torch.float32, device=query.device)
    dq_tma = cfg.dq_tma and HAS_TMA_REDUCE
    dq_cols = head_dim // 2 if cfg.dq_split else head_dim
    grid = (cdiv(seq_k, cfg.block_n), batch * heads_kv)
    _attn_bwd_hopper[grid](
        tma_descriptor(query, cfg.block_m), tma_descriptor(key, 64), tma_descriptor(value, 64),
        tma_descriptor(grad_out, cfg.block_m), tma_descriptor(dk, 64), tma_descriptor(dv, 64),
        tma_descriptor(dq_accum, cfg.block_m, dq_cols), lse, delta, dq_accum,
        seq_q, seq_k, heads_kv, heads_q // heads_kv, causal_offset if is_causal else 0, scale * LOG2E, scale,
        HEAD_DIM=head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, NUM_STAGES=cfg.num_stages,
        IS_CAUSAL=is_causal, DQ_SPLIT=cfg.dq_split, DQ_TMA=dq_tma, CONSUMER_REGS=cfg.consumer_regs, LOADER_REGS=cfg.loader_regs,
        num_warps=4, maxnreg=cfg.maxnreg,
    )
    # The kernel already added scale·dS·K: only the cast is left.
    return dq_accum.to(query.dtype), dk, dv


def hopper_backward_supported(grad_out, query, key, value, attn_mask=None, dropout_p: float = 0.0,
                              scale: float | None = None, schedule: str | None = None) -> bool:
    """Whether ``hopper_attention_backward`` implements this call (real tensors)."""
    return (hopper_backward_unsupported_reason(query, key, value, attn_mask, dropout_p, scale, schedule) is None
            and tma_unsupported_reason(query, key, value) is None
            and tma_unsupported_reason(grad_out, key, value) is None)
