"""Launchers of the monitoring kernels (``kernels/monitor_stats.py``): validate, allocate, launch.

Two pairs, one per caller, sharing every launch:

* ``forward_record`` / ``backward_record`` (eager monitoring, ``eager.py``) only read the
  tensors and return the call's float64 record;
* ``copy_and_forward_record`` / ``copy_and_backward_record`` (the identity ops of ``ops.py``,
  which compiled graphs keep) also return copies, written in the same pass as the counts.

Forward: two launches; backward: four. None synchronises. They take CUDA tensors (or CPU tensors
under the Triton interpreter) that are contiguous; ``supports`` says when, and callers fall back
to the PyTorch statistics of ``stats.py`` otherwise.
"""

from __future__ import annotations

import functools
import math
from types import ModuleType
from typing import Optional

import torch
from torch import Tensor

from ..launch import interpreter_enabled, triton_available
from ..launch.common import launcher
from .stats import FIELDS, LSE_MASKED_BELOW

# The kernels write the record by position.
_KERNEL_FIELDS = ("rows", "masked_rows", "lse_nonfinite", "lse_min", "lse_max", "max_logit_low",
                  "out_nonfinite", "dq_nonfinite", "dk_nonfinite", "dv_nonfinite")
assert FIELDS == _KERNEL_FIELDS, "monitoring/stats.py's FIELDS and the monitoring kernels disagree"

COUNT_BLOCK = 4096      # elements per program of the count (and copy) pass
LSE_BLOCK = 1024        # LSE rows per program of the per-block LSE reduction
REDUCE_BLOCK = 1024     # lanes of the single-program reductions
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@functools.cache
def _kernels() -> ModuleType:
    """The monitoring kernels, imported on first launch: Triton is optional (a CPU-only install
    has none), and ``supports`` keeps callers off this path without it."""
    from ..kernels import monitor_stats

    assert monitor_stats.MASKED_BELOW.value == LSE_MASKED_BELOW, "the kernels and stats.py disagree on masked rows"
    return monitor_stats


def supports(*tensors: Tensor) -> bool:
    """Whether the kernels can take these tensors (else use the PyTorch statistics). Only with
    Triton installed; on CPU only under the Triton interpreter, and not in bf16 there: its NumPy
    emulation of bf16 is unreliable."""
    if not triton_available():
        return False
    if all(t.is_cuda for t in tensors):
        dtypes = _DTYPES
    elif interpreter_enabled() and all(t.device.type == "cpu" for t in tensors):
        dtypes = tuple(d for d in _DTYPES if d != torch.bfloat16)
    else:
        return False
    return all(t.is_contiguous() and t.dtype in dtypes for t in tensors)


def _block_counts(t: Tensor, copy: Optional[Tensor] = None) -> Tensor:
    """One int32 non-finite count per block of ``t``; with ``copy``, the same pass fills it with ``t``."""
    blocks = max(1, math.ceil(t.numel() / COUNT_BLOCK))
    counts = torch.empty(blocks, dtype=torch.int32, device=t.device)
    if t.numel() == 0:
        return counts.zero_()
    # Without a copy nothing is stored through dst, so any valid pointer does.
    launcher(_kernels()._count_nonfinite)[(blocks,)](t, t if copy is None else copy, t.numel(), counts,
                                                     BLOCK=COUNT_BLOCK, COPY=copy is not None, num_warps=4)
    return counts


def _forward(out: Tensor, lse: Tensor, seq_k: int, copy: Optional[Tensor]) -> Tensor:
    """The forward record (see ``stats.forward_stats`` for the fields); fills ``copy`` with
    ``out`` on the way when given."""
    out, lse = out.detach(), lse.detach()
    n_rows = lse.numel()
    n_count_blocks = max(1, math.ceil(out.numel() / COUNT_BLOCK))
    n_lse_blocks = max(1, math.ceil(n_rows / LSE_BLOCK))
    counts = torch.empty(n_count_blocks, dtype=torch.int32, device=out.device)
    partials = torch.empty((5, n_lse_blocks), dtype=torch.float32, device=lse.device)
    if n_rows == 0 or out.numel() == 0:
        counts.zero_()
        partials[:3].zero_()
        partials[3].fill_(float("inf"))
        partials[4].fill_(float("-inf"))
    else:
        launcher(_kernels()._forward_partials)[(max(n_count_blocks, n_lse_blocks),)](
            out, out if copy is None else copy, out.numel(), counts, n_count_blocks,
            lse, n_rows, partials, n_lse_blocks,
            COUNT_BLOCK=COUNT_BLOCK, LSE_BLOCK=LSE_BLOCK, COPY=copy is not None, num_warps=4)
    record = torch.empty(len(FIELDS), dtype=torch.float64, device=lse.device)
    launcher(_kernels()._forward_record)[(1,)](partials, n_lse_blocks, n_rows, counts, n_count_blocks, record,
                                               math.log(max(int(seq_k), 1)), BLOCK=REDUCE_BLOCK, num_warps=4)
    return record


def forward_record(out: Tensor, lse: Tensor, seq_k: int) -> Tensor:
    """The forward record, reading ``out`` and ``lse`` once and writing nothing else."""
    return _forward(out, lse, seq_k, copy=None)


def copy_and_forward_record(out: Tensor, lse: Tensor, seq_k: int) -> tuple[Tensor, Tensor]:
    """(copy of ``out``, forward record), the copy written in the pass that counts."""
    copy = torch.empty_like(out)
    return copy, _forward(out, lse, seq_k, copy)


def _backward(counts: list[Tensor], device: torch.device) -> Tensor:
    """The backward record from the per-block counts of dq, dk, dv: NaN forward fields, then
    their non-finite counts."""
    record = torch.empty(len(FIELDS), dtype=torch.float64, device=device)
    dq_counts, dk_counts, dv_counts = counts
    launcher(_kernels()._backward_record)[(1,)](dq_counts, dq_counts.numel(), dk_counts, dk_counts.numel(),
                                                dv_counts, dv_counts.numel(),
                                                record, len(FIELDS), BLOCK=REDUCE_BLOCK, num_warps=4)
    return record


def backward_record(dq: Optional[Tensor], dk: Optional[Tensor], dv: Optional[Tensor]) -> Tensor:
    """The backward record, reading the gradients once. A None gradient (its input needed none,
    or this backward did not ask for it) counts as no non-finite entry."""
    present = [g for g in (dq, dk, dv) if g is not None]
    if not present:
        raise ValueError("backward_record: at least one of dq, dk, dv must be a tensor.")
    device = present[0].device
    # A missing gradient reads as one block with no non-finite entry; allocated only when needed.
    counts = [torch.zeros(1, dtype=torch.int32, device=device) if g is None else _block_counts(g.detach())
              for g in (dq, dk, dv)]
    return _backward(counts, device)


def copy_and_backward_record(dq: Tensor, dk: Tensor, dv: Tensor) -> tuple[tuple[Tensor, Tensor, Tensor], Tensor]:
    """((copies of dq, dk, dv), backward record), each copy written in the pass that counts."""
    copies = tuple(torch.empty_like(g) for g in (dq, dk, dv))
    counts = [_block_counts(g.detach(), copy) for g, copy in zip((dq, dk, dv), copies)]
    return copies, _backward(counts, dq.device)
