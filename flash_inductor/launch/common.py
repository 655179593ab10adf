"""What every launch path shares: whether the kernels take a problem, the launch wrapper,
the schedule's constexpr switches, the mask and head-dim metadata, config lookup, outputs.

Kernels are launched as plain Triton launches (``launcher``): the ``flash_inductor::`` ops that
call the launchers are opaque to ``torch.compile`` (``ops/attention.py`` says why), so nothing
here is traced.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os

import torch

from ..tuning.buckets import mask_kind
from ..tuning.configs import padded_head_dim, select_configs
from ..schedules import get_schedule

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
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
    if query.device.type != "cuda" or query.dtype not in KERNEL_DTYPES:
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


def softcap_log2(softcap: float) -> float:
    """The kernels' soft cap in base 2, c·log2(e); 1.0 (never read) without a cap, so that no
    launch divides by zero even where the compiler keeps the unused argument."""
    return softcap * LOG2E if softcap > 0 else 1.0


# What ``launcher`` hands back instead of the kernel, inside ``launches_replaced``: context-local
# (a contextvar, not a module attribute), so a tool that compiles launches instead of running them
# changes nothing for other threads, or for anything after its block.
_LAUNCH_REPLACEMENT: contextvars.ContextVar = contextvars.ContextVar("flash_inductor_launch_replacement",
                                                                    default=None)


def launcher(kernel):
    """What a launcher indexes with its grid and calls: the Triton (or Gluon) kernel itself, or inside
    ``launches_replaced`` whatever its replacement makes of the kernel, launched with FMA contraction
    stated (``FusedLaunch``). Every launch path goes through here, so one seam sees every launch. The
    ops that call the launchers are opaque to ``torch.compile``, so every launch is a plain Triton
    launch, eager or compiled."""
    replacement = _LAUNCH_REPLACEMENT.get()
    return FusedLaunch(kernel if replacement is None else replacement(kernel))


class FusedLaunch:
    """``kernel[grid](...)`` with ``enable_fp_fusion=True`` among the launch options. The kernels were
    written, tested and tuned with multiply-adds contracted to FMAs (the one-pass backward's dS is one
    FFMA a score), which is Triton's default through 3.9; Triton 3.9 warns at the first launch without
    the option that 3.10 turns the default off. Stating it keeps contraction on whatever Triton's default;
    where the default is on, the code is the default's (Triton 3.7: SASS identical, ``tools/launch_sass.py
    --compare``)."""

    __slots__ = ("kernel",)

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        return functools.partial(self.kernel[grid], enable_fp_fusion=True)


@contextlib.contextmanager
def launches_replaced(replacement):
    """Within the block (this thread or task only), ``launcher(kernel)`` returns
    ``replacement(kernel)``, which is indexed with the grid and called with the launch's arguments
    as the kernel would be. For tools that compile or record launches instead of running them
    (``tools/launch_sass.py``) and tests that spy on launches."""
    token = _LAUNCH_REPLACEMENT.set(replacement)
    try:
        yield
    finally:
        _LAUNCH_REPLACEMENT.reset(token)


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
        # Not a kernel constexpr: selects the e4m3 forward kernel (launch/fp8.py).
        FP8_FORWARD=sched.fp8_forward,
    )


def _mask_args(attn_mask: torch.Tensor | None, query: torch.Tensor, seq_k):
    if attn_mask is None:
        return query, (0, 0, 0, 0), False, False
    # The kernels index the mask with its four strides, so it must already be broadcast to
    # (B, Hq, L, S) (the API expands it; broadcast dims get stride 0). A (B, 1, 1, S) mask passed
    # here directly would be read out of bounds.
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


def whole_blocks(length, block: int) -> bool:
    """Whether ``length`` is a whole number of blocks (a kernel may then drop that dimension's load
    masks). A symbolic length (torch.compile(dynamic=True)) answers False rather than guard on
    its divisibility: the masked loads are right for every length."""
    return isinstance(length, int) and length % block == 0


def head_dims(query: torch.Tensor, value: torch.Tensor) -> tuple[int, int]:
    # Head dims are kernel constexprs: under torch.compile(dynamic=True) they arrive as SymInts,
    # and int() specialises the graph on them (a guard), which is what a constexpr needs.
    return int(query.shape[-1]), int(value.shape[-1])


def common_meta(query, key, value, attn_mask, dropout_p, is_causal, schedule_name):
    switches = schedule_switches(query.dtype, schedule_name)
    head_dim, head_dim_v = head_dims(query, value)
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


def launch_configs(query, key, value, attn_mask, is_causal, schedule_name, configs):
    """Launch configs: the caller's (the autotuner times candidates this way), else the table's
    entry for this problem's bucket, else the heuristic."""
    if configs is not None:
        return configs
    return select_configs(
        query, *head_dims(query, value), interpreter_enabled(),
        seq_q=query.shape[2], seq_k=key.shape[2], mask_kind=mask_kind(attn_mask, is_causal),
        schedule=get_schedule(schedule_name).name,
    )


LOG2E = 1.4426950408889634


def forward_outputs(query: torch.Tensor, value: torch.Tensor, packed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised (out (B, Hq, L, Ev) in the input dtype, lse (B, Hq, L) fp32) for a forward;
    ``packed`` (B = 1 views of packed sequences): out laid out as the packed (L, Hq, Ev) tensor."""
    batch, heads_q, seq_q, _ = query.shape
    if packed:
        out = torch.empty((seq_q, heads_q, value.shape[-1]), dtype=query.dtype, device=query.device)
        out = out.transpose(0, 1).unsqueeze(0)
    else:
        out = torch.empty((batch, heads_q, seq_q, value.shape[-1]), dtype=query.dtype, device=query.device)
    lse = torch.empty((batch, heads_q, seq_q), dtype=torch.float32, device=query.device)
    return out, lse


def cdiv(a, b):
    # Plain integer arithmetic (not triton.cdiv) so symbolic sizes under torch.compile trace.
    return (a + b - 1) // b
