"""About how long a suite run takes on this device, said in one line before it starts.

The cost of a case is taken as proportional to its attention volume B·H·L·S·E, times the
implementations that run it (the materialising anchors skip the long cases, the fp64
reference costs about two more). The rate is timed here on a CPU, with a small forward and
backward of our op (the PyTorch reference path the suite's CPU run spends its time in); on a GPU,
where the first calls compile kernels, it comes from the H200's full run
(``benchmarks/results/stability_nvidia-h200_20261130_all.json``: 253 s measured for the full
suite, about 300 s with compiles). Either is a rough figure: good to tell minutes from hours.
"""

from __future__ import annotations

import time

import torch

from .anchors import MAX_MATERIALISED, Implementation
from .cases import FULL, Case, Sizes, long_case_name

_REFERENCE_COST = 2.0  # the fp64 reference, in units of one implementation's forward+backward
_GPU_FULL_SUITE_S = 300.0  # the H200's full default run, compiles included
_GPU_FULL_SUITE_IMPLS = 10


def case_volume(case: Case, sizes: Sizes) -> tuple[int, int]:
    """(B·H·L·S·E, the scores B·H·L·S an unfused implementation materialises) of ``case``."""
    long_seqs = {long_case_name(seq): seq for seq in sizes.long_seqs}
    if case.name in long_seqs:
        seq = long_seqs[case.name]
        scores = sizes.long_heads * seq * seq
    else:
        scores = sizes.batch * sizes.heads * sizes.seq * sizes.seq
    return scores * sizes.head_dim, scores


def suite_volume(items: list[tuple[Case, torch.dtype]], impls: list[Implementation], sizes: Sizes) -> float:
    """Σ over case × dtype of the volume times the implementations that run it (and the reference)."""
    total = 0.0
    for case, _ in items:
        volume, scores = case_volume(case, sizes)
        running = sum(1 for i in impls if not (i.materialises and scores > MAX_MATERIALISED))
        total += volume * (running + _REFERENCE_COST)
    return total


def _cpu_rate() -> float:
    """Volume units per second of our op's forward+backward on this CPU (a small fp32 problem)."""
    from ..api import flash_attention

    shape = (1, 2, 512, 64)
    q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
    best = float("inf")
    for _ in range(2):  # the first call pays for imports and allocator warm-up
        start = time.perf_counter()
        flash_attention(q, k, v).sum().backward()
        best = min(best, time.perf_counter() - start)
    return shape[0] * shape[1] * shape[2] * shape[2] * shape[3] / best


def estimate_seconds(items, impls: list[Implementation], sizes: Sizes, device: str) -> float:
    volume = suite_volume(items, impls, sizes)
    if device.startswith("cuda"):
        from .cases import all_cases
        from .runner import work_items

        full = suite_volume(work_items(all_cases(FULL), None), [_full_impl()] * _GPU_FULL_SUITE_IMPLS, FULL)
        return _GPU_FULL_SUITE_S * volume / full
    return volume / _cpu_rate()


def _full_impl() -> Implementation:
    return Implementation("full-run", lambda *args: None)


def format_duration(seconds: float) -> str:
    if seconds < 90:
        return f"{max(seconds, 1):.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
