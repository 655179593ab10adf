"""Launchers for the Triton attention kernels: allocate outputs, pick configs, launch.

Inputs arrive normalised by ``flash_inductor.api`` (4-D, validated); this module checks
only what the kernels themselves need. Kernels are launched through
``torch.library.wrap_triton`` so that, inside our ``triton_op``, Inductor sees and inlines
them; under the Triton interpreter (CPU tests) they are called directly. Code that calls these
launchers outside the ops (the autotuner, probes) wraps the calls in ``direct_kernel_calls()``.

The contract of ``attention_forward`` / ``attention_backward`` is the same as that of the
reference path in ``flash_inductor.ops.reference``; tests compare the two.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

from .tuning.buckets import mask_kind
from .tuning.configs import AttentionConfigs, padded_head_dim, select_configs
from .tuning.schedules import STABLE, get_schedule

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HEAD_DIM = 256
# CUDA limits grid axis 1 (where batch x heads goes) to 65535 programs.
_MAX_GRID_Y = 65535


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """Whether Triton can be imported. It is optional: CPU-only installs run the PyTorch
    reference path and need none; the kernels (and only they) import it, on first launch."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _require_triton_for(device: torch.device) -> None:
    """CUDA tensors without Triton: an error that says how to fix it, rather than a silent switch
    to the reference path, which is many times slower and materialises blocks of scores."""
    if not triton_available():
        raise RuntimeError(
            f"flash_inductor's kernels for {device.type} tensors need Triton, which is not installed. "
            "CUDA builds of torch bring it; otherwise install the Triton release your torch was built "
            "against (`pip install triton`), or move the tensors to the CPU for the PyTorch reference path."
        )


def interpreter_enabled() -> bool:
    """True when Triton runs kernels through its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def kernel_supports(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether the Triton kernels take these (normalised, 4-D) inputs; else the reference path runs.
    Raises when they would take them but Triton is not installed."""
    if query.device.type != "cuda" or query.dtype not in _KERNEL_DTYPES:
        return False
    batch, heads_q = query.shape[0], query.shape[1]
    fits = (
        query.shape[-1] <= _MAX_HEAD_DIM
        and value.shape[-1] <= _MAX_HEAD_DIM
        and batch * max(heads_q, key.shape[1]) <= _MAX_GRID_Y
    )
    if fits:
        _require_triton_for(query.device)
    return fits


def _launcher(kernel):
    if interpreter_enabled():
        return kernel
    from torch.library import wrap_triton

    return wrap_triton(kernel)


# torch keeps the switch between wrap_triton's HOP and direct launches private: looked up once
# (torch 2.11-2.14 all have it; where it is missing, calls go through the HOP as before).
try:
    from torch._library.triton import set_wrap_triton_enabled as _set_wrap_triton_enabled
except ImportError:
    _set_wrap_triton_enabled = None


def can_launch_directly() -> bool:
    """Whether :func:`direct_kernel_calls` can take the launches off wrap_triton's HOP here."""
    return _set_wrap_triton_enabled is not None


def direct_kernel_calls() -> contextlib.AbstractContextManager:
    """Launch the kernels straight through Triton, not through torch's wrap_triton HOP, for
    callers outside the registered ops: the eager fast path, the autotuner's timing runner,
    probes. The inputs there are plain tensors, so there is nothing to trace.

    Inside the ops torch already does this: a ``triton_op`` run eagerly turns wrap_triton off for
    its body. Called from outside, every launch instead goes through the HOP's Python dispatch
    (kernel side table, dispatch keys, grid function), host work paid per launch, which torch's
    docstring of the switch puts at "~1ms". The backward makes four launches, so on short
    problems that host time can outrun the GPU. It is the suspect for a measured gap: the
    tuner, which called the launchers bare, read the bf16 E=64 causal L=S=1024 backward at
    2.28 ms where the op, same kernels and configs, took 1.18 ms
    (benchmarks/results/s1024_timing_nvidia-h200_20261201_s22.txt;
    benchmarks/experiments/tuner_vs_op_timing.py measures it)."""
    # torch's own context manager, returned as is: the eager fast path enters this twice per
    # training step, and a generator wrapped around it doubled its ~3 µs.
    if _set_wrap_triton_enabled is None:
        return contextlib.nullcontext()
    return _set_wrap_triton_enabled(False)


def _fp32_dot_precision(dtype: torch.dtype, accurate: bool) -> str:
    """Precision of the dots whose operands are fp32 (16-bit operands ignore it).

    fp32 inputs must not silently drop to tf32's 10-bit mantissa (PyTorch's fp32 attention
    does not), so they get true fp32 products. The accurate schedule's fp32 P and dS with
    16-bit inputs use "tf32x3", which splits each fp32 operand into tf32 parts: close to
    fp32 accuracy, still on the tensor cores.
    """
    if dtype == torch.float32:
        return "ieee"
    return "tf32x3" if accurate else "tf32"


def schedule_switches(dtype: torch.dtype, schedule_name: str | None) -> dict:
    """The kernels' constexpr precision switches for a dtype under a schedule. Two problems with
    equal switches (e.g. fast and stable with fp32 inputs) run the very same compiled kernels."""
    sched = get_schedule(schedule_name)
    return dict(
        P_IN_FP32=sched.p_in_fp32,
        DS_IN_FP32=sched.ds_in_fp32,
        # Only fp16 can overflow dS; bf16 and fp32 have fp32's range.
        DS_RESCALE=sched.ds_rescale and dtype == torch.float16,
        # Only a 16-bit O makes rowsum(dO * O) inexact; an fp32 O is as good as the fp32 sum.
        EXACT_DELTA=sched.exact_delta and dtype != torch.float32,
        FP32_DOT=_fp32_dot_precision(dtype, accurate=sched.p_in_fp32 or sched.ds_in_fp32),
        # Not a kernel constexpr: selects the e4m3 forward kernel (launch_fp8.py).
        FP8_FORWARD=sched.fp8_forward,
    )


def _mask_args(attn_mask: torch.Tensor | None, query: torch.Tensor, seq_k):
    if attn_mask is None:
        return query, (0, 0, 0, 0), False, False
    # The kernels index the mask with its four strides, so it must already be broadcast to
    # (B, Hq, L, S) (the API expands it; broadcast dims get stride 0). A (B, 1, 1, S) mask passed
    # here directly would be read out of bounds (a script once did exactly that).
    expected = (*query.shape[:3], seq_k)
    if tuple(attn_mask.shape) != expected:
        raise ValueError(f"attn_mask: the launchers take a mask broadcast to (B, Hq, L, S) = {expected}, "
                         f"got shape {tuple(attn_mask.shape)}; expand it first (as flash_attention does)")
    if attn_mask.dtype == torch.bool:
        # Passed as is (Triton loads bool pointers as bytes): a .view(torch.uint8) here would be
        # traced into the graph under torch.compile, and Inductor 2.11 cannot lower a bool
        # dtype-view. True = attend.
        return attn_mask, attn_mask.stride(), True, True
    return attn_mask, attn_mask.stride(), True, False


def _whole_blocks(length, block: int) -> bool:
    """Whether ``length`` is a whole number of blocks (a kernel may then drop that dimension's load
    masks). A symbolic length (torch.compile(dynamic=True)) answers False rather than guard on
    its divisibility: the masked loads are right for every length."""
    return isinstance(length, int) and length % block == 0


def _head_dims(query: torch.Tensor, value: torch.Tensor) -> tuple[int, int]:
    # Head dims are kernel constexprs: under torch.compile(dynamic=True) they arrive as SymInts,
    # and int() specialises the graph on them (a guard), which is what a constexpr needs.
    return int(query.shape[-1]), int(value.shape[-1])


def _common_meta(query, key, value, attn_mask, dropout_p, is_causal, schedule_name):
    switches = schedule_switches(query.dtype, schedule_name)
    head_dim, head_dim_v = _head_dims(query, value)
    # One padded width for both head dims. On sm_90 with Triton 3.6, fp16/bf16 kernels whose
    # value tile was narrower than a padded query/key tile (E=40 with Ev=24, E=59 with Ev=8)
    # computed wrong results or faulted, while equal widths were correct; the extra columns
    # cost only when E != Ev, which is rare.
    block_width = max(padded_head_dim(head_dim), padded_head_dim(head_dim_v))
    mask_arg, mask_strides, has_mask, mask_is_bool = _mask_args(attn_mask, query, key.shape[2])
    meta = dict(
        HEAD_DIM=head_dim,
        HEAD_DIM_V=head_dim_v,
        BLOCK_E=block_width,
        BLOCK_EV=block_width,
        HAS_MASK=has_mask,
        MASK_IS_BOOL=mask_is_bool,
        HAS_DROPOUT=dropout_p > 0.0,
        IS_CAUSAL=is_causal,
        FP32_DOT=switches["FP32_DOT"],
    )
    return switches, mask_arg, mask_strides, meta


def _configs(query, key, value, attn_mask, is_causal, schedule_name, configs):
    """Launch configs: the caller's (the autotuner times candidates this way), else the table's
    entry for this problem's bucket, else the heuristic."""
    if configs is not None:
        return configs
    return select_configs(
        query, *_head_dims(query, value), interpreter_enabled(),
        seq_q=query.shape[2], seq_k=key.shape[2], mask_kind=mask_kind(attn_mask, is_causal),
        schedule=get_schedule(schedule_name).name,
    )


_LOG2E = 1.4426950408889634


def _fold_scale(scale: float, has_mask: bool) -> bool:
    """Whether the forward takes the scale into exp2's argument (one FFMA per score, the product
    never rounded; kernels/attn_fwd.py). Only without a mask, as measured rather than derived: with
    it on under a padding mask, the fp16 GPT-2 overflow test's ln_1.bias gradient error (seed 7) was
    3.0x SDPA fp16's against 1.9x with it off, past the test's 2x bound, and still 2.8x when the
    backward folded the scale too (benchmarks/experiments/bwd_fold_scale.patch), so the
    cause is not a mismatch between the passes' P; another seed favoured folding. Folding is worth
    1-2 % of the forward, not a test's margin, so masked calls keep the rounded scaled score."""
    return scale > 0 and not has_mask


def forward_outputs(query: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised (out (B, Hq, L, Ev) in the input dtype, lse (B, Hq, L) fp32) for a forward."""
    batch, heads_q, seq_q, _ = query.shape
    out = torch.empty((batch, heads_q, seq_q, value.shape[-1]), dtype=query.dtype, device=query.device)
    lse = torch.empty((batch, heads_q, seq_q), dtype=torch.float32, device=query.device)
    return out, lse


def attention_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    rng_seed: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    causal_offset: int,
    scale: float,
    schedule: str,
    *,
    configs: AttentionConfigs | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the forward kernel. Returns (out (B, Hq, L, Ev) in the input dtype, lse (B, Hq, L) fp32).

    ``configs`` forces the launch configs (the autotuner's candidates); None looks them up."""
    from .kernels.attn_fwd import _attn_fwd

    if get_schedule(schedule).fp8_forward:
        from .launch_fp8 import attention_forward_fp8

        return attention_forward_fp8(query, key, value, attn_mask, rng_seed, dropout_p, is_causal, causal_offset,
                                     scale, schedule, configs=configs)
    batch, heads_q, seq_q, _ = query.shape
    heads_kv, seq_k = key.shape[1], key.shape[2]
    out, lse = forward_outputs(query, value)
    if out.numel() == 0 and lse.numel() == 0:
        return out, lse

    switches, mask_arg, mask_strides, meta = _common_meta(query, key, value, attn_mask, dropout_p, is_causal, schedule)
    cfg = _configs(query, key, value, attn_mask, is_causal, schedule, configs).forward
    grid = (_cdiv(seq_q, cfg.block_m), batch * heads_q)
    _launcher(_attn_fwd)[grid](
        query, key, value, mask_arg, rng_seed if rng_seed is not None else query, out, lse,
        *query.stride(), *key.stride(), *value.stride(), *mask_strides, *out.stride(),
        heads_q, heads_q // heads_kv, seq_q, seq_k, causal_offset, scale * _LOG2E, dropout_p,
        P_IN_FP32=switches["P_IN_FP32"],
        FOLD_SCALE=_fold_scale(scale, meta["HAS_MASK"]),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **meta,
    )
    return out, lse


def attention_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_lse: torch.Tensor | None,
    rng_seed: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    causal_offset: int,
    scale: float,
    schedule: str,
    compute_mask_grad: bool,
    *,
    configs: AttentionConfigs | None = None,
    ds_bound: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the backward kernels. Returns (dq, dk, dv, dmask); dmask is empty unless asked for.

    ``configs`` forces the launch configs (the autotuner's candidates); None looks them up.
    ``ds_bound`` (a one-element fp32 tensor) replaces the bound on |dS| that the preprocess
    measures, under the schedules that rescale dS (fp16 `stable`): tests and experiments force
    either loop with it (a bound past ``attn_bwd.DS_RESCALE_ABOVE``, or inf, takes the rescaling
    loop). Elsewhere it is ignored."""
    from .kernels.attn_bwd import _attn_bwd_dkdv, _attn_bwd_dq, _attn_bwd_row_reference

    if get_schedule(schedule).fp8_forward:
        # fp8 is a forward schedule: the gradient is the 16-bit attention's, from a 16-bit forward
        # (its O and LSE; the fp8 ones would not match the recomputed P) and `stable`'s backward.
        schedule = STABLE.name
        out, lse = attention_forward(query, key, value, attn_mask, rng_seed, dropout_p, is_causal, causal_offset,
                                     scale, schedule)
    batch, heads_q, seq_q, _ = query.shape
    heads_kv, seq_k = key.shape[1], key.shape[2]
    head_dim, head_dim_v = _head_dims(query, value)
    dq = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    dk = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    dv = torch.empty(value.shape, dtype=value.dtype, device=value.device)
    if compute_mask_grad:
        # Positions no pass visits (beyond the causal diagonal) have dS = 0.
        dmask = torch.zeros((batch, heads_q, seq_q, seq_k), dtype=torch.float32, device=query.device)
    else:
        dmask = query.new_empty(0)

    if seq_q == 0 or seq_k == 0 or batch * heads_q == 0:
        # No query row attends to anything: every gradient is zero.
        for grad in (dq, dk, dv):
            grad.zero_()
        return dq, dk, dv, dmask.to(attn_mask.dtype) if compute_mask_grad else dmask

    switches, mask_arg, mask_strides, meta = _common_meta(query, key, value, attn_mask, dropout_p, is_causal, schedule)
    configs = _configs(query, key, value, attn_mask, is_causal, schedule, configs)
    p_in_fp32, ds_in_fp32, ds_rescale = switches["P_IN_FP32"], switches["DS_IN_FP32"], switches["DS_RESCALE"]
    exact_delta = switches["EXACT_DELTA"]
    seed_arg = rng_seed if rng_seed is not None else query

    delta = torch.empty((batch, heads_q, seq_q), dtype=torch.float32, device=query.device)
    if grad_lse is not None:
        grad_lse = grad_lse.to(torch.float32).contiguous()  # read as a flat (B*Hq*L) row vector
    # Under a rescaling schedule (fp16 `stable`) the preprocess also collects the maxima the
    # kernels bound |dS| with (``attn_bwd._ds_loop_choice``), so its grid spans V's rows too.
    collect_ds_stats = ds_rescale and ds_bound is None
    if ds_rescale:
        ds_stats = torch.zeros(3, dtype=torch.float32, device=query.device)
        if ds_bound is not None:
            ds_stats[2:] = ds_bound.reshape(1)  # (0, 0, B): the kernels' bound is B itself
    else:
        ds_stats = delta  # never read
    _launch_preprocess(out, grad_out, grad_lse, value, delta, ds_stats, head_dim_v, meta["BLOCK_EV"],
                       configs.backward_dq.block_m, collect_ds_stats)

    scale_log2 = scale * _LOG2E
    cfg = configs.backward_dq
    row_ref = torch.empty_like(delta)
    row_shift = torch.empty_like(delta)
    # Set by the row-reference kernel when some row needs its shift; the dK/dV pass reads it to
    # skip the shift everywhere else.
    shift_flag = torch.zeros(1, dtype=torch.int32, device=query.device)
    _launcher(_attn_bwd_row_reference)[(_cdiv(seq_q, cfg.block_m), batch * heads_q)](
        query, key, mask_arg, lse, row_ref, row_shift, shift_flag,
        *query.stride(), *key.stride(), *mask_strides,
        heads_q, heads_q // heads_kv, seq_q, seq_k, causal_offset, scale_log2,
        HEAD_DIM=head_dim, BLOCK_E=meta["BLOCK_E"], HAS_MASK=meta["HAS_MASK"], MASK_IS_BOOL=meta["MASK_IS_BOOL"],
        IS_CAUSAL=is_causal, FP32_DOT=meta["FP32_DOT"], BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
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
    _launcher(_attn_bwd_dq)[(_cdiv(seq_q, cfg.block_m), batch * heads_q)](
        query, key, value, mask_arg, seed_arg, grad_out, row_ref, row_shift,
        grad_lse if grad_lse is not None else lse, delta, ds_stats, dq, dmask_arg,
        *query.stride(), *key.stride(), *value.stride(), *mask_strides, *grad_out.stride(), *dq.stride(),
        heads_q, heads_q // heads_kv, seq_q, seq_k, causal_offset, scale_log2, scale, dropout_p,
        P_IN_FP32=p_in_fp32, DS_IN_FP32=ds_in_fp32, DS_RESCALE=ds_rescale,
        EXACT_DELTA=exact_delta, HAS_DLSE=grad_lse is not None, WRITE_DMASK=compute_mask_grad and not exact_delta,
        EVEN_N=_whole_blocks(seq_k, cfg.block_n), EVEN_E=even_e,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **meta,
    )
    cfg = configs.backward_dkdv
    _launcher(_attn_bwd_dkdv)[(_cdiv(seq_k, cfg.block_n), batch * heads_kv)](
        query, key, value, mask_arg, seed_arg, grad_out, row_ref, row_shift, shift_flag, delta, ds_stats, dk, dv,
        dmask_arg,
        *query.stride(), *key.stride(), *value.stride(), *mask_strides, *grad_out.stride(),
        *dk.stride(), *dv.stride(),
        heads_q, heads_kv, heads_q // heads_kv, seq_q, seq_k, causal_offset, scale_log2, scale, dropout_p,
        P_IN_FP32=p_in_fp32, DS_IN_FP32=ds_in_fp32, DS_RESCALE=ds_rescale,
        WRITE_DMASK=compute_mask_grad and exact_delta,
        EVEN_M=_whole_blocks(seq_q, cfg.block_m), EVEN_E=even_e,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **meta,
    )
    if compute_mask_grad:
        dmask = dmask.to(attn_mask.dtype)
    return dq, dk, dv, dmask


def _launch_preprocess(out, grad_out, grad_lse, value, delta, ds_stats, head_dim_v: int, block_ev: int,
                       block_m: int, collect_ds_stats: bool) -> None:
    """Δ into ``delta``, and under ``collect_ds_stats`` the dS bound's maxima into ``ds_stats``
    (``attn_bwd._attn_bwd_preprocess``); its grid then spans max(L, S) rows, to cover V's."""
    from .kernels.attn_bwd import _attn_bwd_preprocess

    batch, heads_q, seq_q = grad_out.shape[:3]
    heads_kv, seq_k = value.shape[1], value.shape[2]
    rows = torch.sym_max(seq_q, seq_k) if collect_ds_stats else seq_q  # sym_max: no guard on symbolic lengths
    _launcher(_attn_bwd_preprocess)[(_cdiv(rows, block_m), batch * heads_q)](
        out, grad_out, grad_lse if grad_lse is not None else delta, delta, value, ds_stats,
        *out.stride(), *grad_out.stride(), *value.stride(), heads_q, heads_kv, batch * heads_kv, seq_q, seq_k,
        HEAD_DIM_V=head_dim_v, BLOCK_EV=block_ev, HAS_DLSE=grad_lse is not None,
        COLLECT_DS_STATS=collect_ds_stats, BLOCK_M=block_m,
    )


def _ds_bound(grad_out: torch.Tensor, value: torch.Tensor, grad_lse: torch.Tensor | None,
              dropout_p: float) -> torch.Tensor:
    """The bound on |dS| the backward kernels decide their loop with, measured as the backward
    measures it: the preprocess alone collects the maxima (its Δ, from grad_out standing in for O,
    is discarded), and this combines them as ``attn_bwd._ds_loop_choice`` does. A one-element
    fp32 tensor. For tests and experiments; the backward itself never calls it."""
    head_dim_v = grad_out.shape[-1]
    stats = torch.zeros(3, dtype=torch.float32, device=grad_out.device)
    delta = torch.empty(grad_out.shape[:3], dtype=torch.float32, device=grad_out.device)
    if grad_lse is not None:
        grad_lse = grad_lse.to(torch.float32).contiguous()
    _launch_preprocess(grad_out, grad_out, grad_lse, value, delta, stats, head_dim_v, padded_head_dim(head_dim_v),
                       64, collect_ds_stats=True)
    keep_scale = 1.0 / (1.0 - dropout_p)
    return ((2.0 * keep_scale) * stats[0].sqrt() * stats[1].sqrt() + stats[2]).reshape(1)


def _cdiv(a, b):
    # Plain integer arithmetic (not triton.cdiv) so symbolic sizes under torch.compile trace.
    return (a + b - 1) // b
