"""What the GPU itself spends on a step, from torch.profiler's kernel records.

* ``kernel_times_us``: CUDA time per call of every kernel a step launches, by kernel name
  (``backward_breakdown.py``'s per-kernel tables).
* ``gpu_busy``: for a step run back to back, kernel time per call and the fraction of the
  loop's GPU span that kernels fill. A wall-clock timing well above the kernel time with a busy
  fraction well below 1 means the GPU waited between launches (host time, launch gaps), not
  slow kernels. A small cell that reads bimodal at full clock and low power is the case this
  tells apart (``docs/performance.md``).
"""

from __future__ import annotations

import collections
from typing import Callable, Optional

import torch


def _profile_kernels(run: Callable[[], object], calls: int) -> list:
    """The CUDA kernel events of ``calls`` back-to-back runs (after one unprofiled warm-up run)."""
    run()  # compile and warm up outside the profile
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            run()
        torch.cuda.synchronize()
    return [event for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA]


def _device_us(event) -> float:
    return event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total


def kernel_times_us(run: Callable[[], object], calls: int, device: str) -> dict:
    """CUDA time per call of every kernel ``run`` launches, by kernel name (microseconds); empty
    off CUDA."""
    if not device.startswith("cuda"):
        run()
        return {}
    totals = collections.defaultdict(float)
    for event in _profile_kernels(run, calls):
        totals[event.name] += _device_us(event)
    return {name: total / calls for name, total in sorted(totals.items(), key=lambda kv: -kv[1])}


def busy_fraction(intervals: list[tuple[float, float]]) -> Optional[float]:
    """The share of [first start, last end] that the union of the (start, end) intervals covers.
    Kernels on concurrent streams overlap, so the union, not the sum, is the busy time."""
    if not intervals:
        return None
    ordered = sorted(intervals)
    span = max(end for _, end in ordered) - ordered[0][0]
    if span <= 0:
        return None
    covered, current_start, current_end = 0.0, *ordered[0]
    for start, end in ordered[1:]:
        if start > current_end:
            covered += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    covered += current_end - current_start
    return covered / span


def gpu_busy(run: Callable[[], object], calls: int, device: str) -> dict:
    """``kernel_ms`` (kernel time per call, summed over the step's kernels) and ``gpu_busy`` (the
    busy share of the GPU span of ``calls`` back-to-back runs); empty off CUDA. No L2 flush
    between runs, unlike do_bench: the kernel time is a warm-cache figure."""
    if not device.startswith("cuda"):
        return {}
    events = _profile_kernels(run, calls)
    if not events:
        return {}
    intervals = [(e.time_range.start, e.time_range.end) for e in events]
    return dict(kernel_ms=sum(_device_us(e) for e in events) / calls / 1e3, gpu_busy=busy_fraction(intervals))
