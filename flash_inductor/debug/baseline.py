"""Baselines: each attention site's ranges over N fp32 steps, and a low-precision run held to them.

    with flash_inductor.debug.record_baseline(model) as rec:      # fp32 steps
        for batch in first_batches: train_step(model, batch)
    rec.baseline().save("attention_baseline.json")

    with flash_inductor.debug.compare_to_baseline(model, "attention_baseline.json", factor=4) as cmp:
        for batch in batches: train_step(model, batch)              # fp16 / bf16 steps
    print(cmp.report())

Per site the baseline keeps ``[min, max]`` of every statistic of ``session.STATS`` (the ranges of
``flash_inductor.monitor()``: LSE, largest logit, fully-masked rows, non-finite counts; plus
max |q·kᵀ|, the smallest visible logit, max |out|, |dq|, |dk|, |dv|). A value leaves the range by
``factor`` when it lies outside ``[min - (factor-1) w, max + (factor-1) w]`` with
``w = max(|min|, |max|)`` (for a magnitude: above ``factor x max``), when a count exceeds
``factor x`` its baseline maximum (any non-finite entry, where the baseline had none), or when it
is NaN or infinite. Flags are listed in the order the run produced them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import tempfile
from typing import Optional, Union

import torch

from .session import BACKWARD_STATS, COUNT_STATS, DESCRIPTION, STATS, DebugSession
from .shadow import explain_cause
from .sites import Instrumented

SCHEMA = 1


@dataclasses.dataclass
class Baseline:
    """Per site and statistic, the ``[min, max]`` seen over the recorded steps."""

    sites: dict  # site -> {stat: [min, max]}
    calls: dict  # site -> forward calls recorded
    dtype: str = "fp32"

    def save(self, path: Union[str, os.PathLike]) -> pathlib.Path:
        """Write the baseline as JSON (atomically: a crash never leaves half a file)."""
        path = pathlib.Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = dict(schema=SCHEMA, dtype=self.dtype, calls=self.calls, sites=self.sites)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump(payload, f, indent=1, allow_nan=True)
        os.replace(f.name, path)
        return path

    @classmethod
    def load(cls, path: Union[str, os.PathLike]) -> "Baseline":
        payload = json.loads(pathlib.Path(path).read_text())
        if payload.get("schema") != SCHEMA:
            raise ValueError(f"{path}: baseline schema {payload.get('schema')!r}, expected {SCHEMA}; record it again "
                             "with flash_inductor.debug.record_baseline.")
        return cls(payload["sites"], payload["calls"], payload.get("dtype", "fp32"))


class BaselineRecorder(DebugSession):
    """The session of :func:`record_baseline`."""

    def baseline(self) -> Baseline:
        sites: dict = {}
        calls: dict = {}
        dtypes = {r.dtype for r in self.records}
        for record in self.records:
            calls[record.site] = calls.get(record.site, 0) + 1
            ranges = sites.setdefault(record.site, {})
            for stat, value in record.stats.items():
                if value is None or (isinstance(value, float) and math.isnan(value)):
                    continue
                lo, hi = ranges.get(stat, (math.inf, -math.inf))
                ranges[stat] = [min(lo, value), max(hi, value)]
        return Baseline(sites, calls, dtypes.pop() if len(dtypes) == 1 else ",".join(sorted(dtypes)))

    def save(self, path) -> pathlib.Path:
        return self.baseline().save(path)


@dataclasses.dataclass
class Flag:
    site: str
    stat: str
    value: float
    baseline: tuple[float, float]
    call: int
    event: int
    phase: str  # "forward" or "backward"
    dtype: str

    def __str__(self) -> str:
        lo, hi = self.baseline
        return (f"{self.site} ({self.phase}, call {self.call}): {DESCRIPTION.get(self.stat, self.stat)} = "
                f"{_num(self.value)}, baseline [{_num(lo)}, {_num(hi)}]")


def _num(x: float) -> str:
    return str(x) if isinstance(x, float) and not math.isfinite(x) else f"{x:.4g}"


def leaves_range(stat: str, value: float, lo: float, hi: float, factor: float) -> bool:
    if value is None:
        return False
    if isinstance(value, float) and not math.isfinite(value):
        return True
    if stat in COUNT_STATS:
        return value > factor * hi
    width = max(abs(lo), abs(hi))
    return value > hi + (factor - 1) * width or value < lo - (factor - 1) * width


class BaselineComparison(DebugSession):
    """The session of :func:`compare_to_baseline`; ``report()`` lists the flags."""

    def __init__(self, baseline: Baseline, factor: float):
        super().__init__()
        if factor < 1:
            raise ValueError(f"compare_to_baseline: factor must be >= 1 (how far past the baseline's range a value "
                             f"may go), got {factor}.")
        self.baseline = baseline
        self.factor = float(factor)

    def flags(self) -> list[Flag]:
        flags = []
        for record in self.records:
            ranges = self.baseline.sites.get(record.site)
            if ranges is None:
                continue
            for stat in STATS:
                value = record.stats.get(stat)
                if stat not in ranges or value is None:
                    continue
                lo, hi = ranges[stat]
                if leaves_range(stat, value, lo, hi, self.factor):
                    backward = stat in BACKWARD_STATS
                    event = record.backward_event if backward else record.event
                    flags.append(Flag(record.site, stat, value, (lo, hi), record.call, event or 0,
                                      "backward" if backward else "forward", record.dtype))
        return sorted(flags, key=lambda f: (f.event, STATS.index(f.stat)))

    def report(self) -> "ComparisonReport":
        unknown = sorted({r.site for r in self.records} - set(self.baseline.sites))
        return ComparisonReport(self.flags(), self.factor, {r.call: r for r in self.records}, unknown,
                                len(self.records))


@dataclasses.dataclass
class ComparisonReport:
    flags: list[Flag]
    factor: float
    records: dict
    unknown_sites: list[str]
    calls: int

    @property
    def first(self) -> Optional[Flag]:
        return self.flags[0] if self.flags else None

    @property
    def sites(self) -> list[str]:
        """Flagged sites, in the order they first went wrong."""
        return list(dict.fromkeys(f.site for f in self.flags))

    @property
    def cause(self) -> Optional[str]:
        if self.first is None:
            return None
        record = self.records[self.first.call]
        return explain_cause(record.stats, record.dtype)

    def format(self, limit: int = 20) -> str:
        lines = [f"flash_inductor baseline comparison: {self.calls} call(s), {len(self.flags)} value(s) outside the "
                 f"baseline's range by more than x{self.factor:g}, at {len(self.sites)} site(s)"]
        for flag in self.flags[:limit]:
            lines.append(f"  {flag}")
        if len(self.flags) > limit:
            lines.append(f"  ... {len(self.flags) - limit} more")
        if self.unknown_sites:
            lines.append(f"  sites not in the baseline: {', '.join(self.unknown_sites)}")
        if self.first is not None:
            lines.append(f"first: {self.first.site}; why: {self.cause}")
        return "\n".join(lines)

    __str__ = format


def record_baseline(model: torch.nn.Module) -> Instrumented:
    """``with record_baseline(model) as rec: <N fp32 steps>; rec.save(path)``: each attention site's
    ranges over the steps (see the module docstring); ``rec.baseline()`` returns them."""
    return Instrumented(model, BaselineRecorder(), shadow=False)


def compare_to_baseline(model: torch.nn.Module, baseline: Union[Baseline, str, os.PathLike],
                        factor: float = 4.0) -> Instrumented:
    """``with compare_to_baseline(model, "baseline.json", factor=4) as cmp: <steps>; print(cmp.report())``:
    flags every site and statistic that leaves the baseline's range by more than ``factor``."""
    if not isinstance(baseline, Baseline):
        baseline = Baseline.load(baseline)
    return Instrumented(model, BaselineComparison(baseline, factor), shadow=False)
