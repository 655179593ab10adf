"""Launchers of the monitoring kernels (``kernels/monitor_stats.py``): validate, allocate, launch.

``copy_and_forward_record`` and ``copy_and_backward_record`` return what the recording ops
return (copies of the watched tensors) together with the call's float64 record, in three and
four launches and without synchronising. They take CUDA tensors (or CPU tensors under the
Triton interpreter) that are contiguous; ``supports`` says when, and the recording ops fall
back to the PyTorch statistics of ``stats.py`` otherwise.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..launch import interpreter_enabled
from ..kernels.monitor_stats import MASKED_BELOW, _backward_record, _copy_count_nonfinite, _forward_record, _lse_partials
from .stats import FIELDS, LSE_MASKED_BELOW

# The kernels write the record by position.
_KERNEL_FIELDS = ("rows", "masked_rows", "lse_nonfinite", "lse_min", "lse_max", "max_logit_low",
                  "out_nonfinite", "dq_nonfinite", "dk_nonfinite", "dv_nonfinite")
assert FIELDS == _KERNEL_FIELDS, "monitoring/stats.py's FIELDS and the monitoring kernels disagree"
assert MASKED_BELOW.value == LSE_MASKED_BELOW, "the kernels and stats.py disagree on masked rows"

COPY_BLOCK = 4096       # elements per program of the copy-and-count pass
LSE_BLOCK = 1024        # LSE rows per program of the per-block LSE reduction
REDUCE_BLOCK = 1024     # lanes of the single-program reductions
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def supports(*tensors: Tensor) -> bool:
    """Whether the kernels can take these tensors (else use the PyTorch statistics). On CPU only
    under the Triton interpreter, and not in bf16 there: its NumPy emulation of bf16 is unreliable."""
    if all(t.is_cuda for t in tensors):
        dtypes = _DTYPES
    elif interpreter_enabled() and all(t.device.type == "cpu" for t in tensors):
        dtypes = tuple(d for d in _DTYPES if d != torch.bfloat16)
    else:
        return False
    return all(t.is_contiguous() and t.dtype in dtypes for t in tensors)


def _copy_counting(t: Tensor) -> tuple[Tensor, Tensor]:
    """A copy of ``t`` and one int32 non-finite count per block of it."""
    copy = torch.empty_like(t)
    blocks = max(1, math.ceil(t.numel() / COPY_BLOCK))
    counts = torch.empty(blocks, dtype=torch.int32, device=t.device)
    if t.numel() == 0:
        counts.zero_()
        return copy, counts
    _copy_count_nonfinite[(blocks,)](t, copy, t.numel(), counts, BLOCK=COPY_BLOCK, num_warps=4)
    return copy, counts


def copy_and_forward_record(out: Tensor, lse: Tensor, seq_k: int) -> tuple[Tensor, Tensor]:
    """(copy of ``out``, forward record): see ``stats.forward_stats`` for the fields."""
    lse = lse.detach()
    copy, counts = _copy_counting(out.detach())
    n_rows = lse.numel()
    n_blocks = max(1, math.ceil(n_rows / LSE_BLOCK))
    partials = torch.empty((5, n_blocks), dtype=torch.float32, device=lse.device)
    if n_rows == 0:
        partials[:3].zero_()
        partials[3].fill_(float("inf"))
        partials[4].fill_(float("-inf"))
    else:
        _lse_partials[(n_blocks,)](lse, n_rows, partials, n_blocks, BLOCK=LSE_BLOCK, num_warps=4)
    record = torch.empty(len(FIELDS), dtype=torch.float64, device=lse.device)
    _forward_record[(1,)](partials, n_blocks, n_rows, counts, counts.numel(), record, math.log(max(int(seq_k), 1)),
                          BLOCK=REDUCE_BLOCK, num_warps=4)
    return copy, record


def copy_and_backward_record(dq: Tensor, dk: Tensor, dv: Tensor) -> tuple[tuple[Tensor, Tensor, Tensor], Tensor]:
    """((copies of dq, dk, dv), backward record): NaN forward fields, then non-finite counts."""
    (dq_copy, dq_counts), (dk_copy, dk_counts), (dv_copy, dv_counts) = (
        _copy_counting(g.detach()) for g in (dq, dk, dv))
    record = torch.empty(len(FIELDS), dtype=torch.float64, device=dq.device)
    _backward_record[(1,)](dq_counts, dq_counts.numel(), dk_counts, dk_counts.numel(), dv_counts, dv_counts.numel(),
                           record, len(FIELDS), BLOCK=REDUCE_BLOCK, num_warps=4)
    return (dq_copy, dk_copy, dv_copy), record
