"""Aggregating a session's records per site, and the table ``print(m.summary())`` shows."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from ..text_table import text_table
from .stats import INDEX

_COUNT_FIELDS = ("out_nonfinite", "lse_nonfinite", "dq_nonfinite", "dk_nonfinite", "dv_nonfinite")


@dataclasses.dataclass
class SiteStats:
    """Aggregates of one site over the session.

    ``max_logit`` is the interval ``[low, high]`` that contains the largest logit seen in any call
    (``high`` = max LSE, ``low`` = max over calls of LSE - log S). Counts of non-finite entries are
    totals over calls; ``masked_rows_max`` is the largest number of fully-masked rows in one call.
    """

    site: str
    calls: int = 0
    backward_calls: int = 0
    max_logit_low: float = -math.inf
    max_logit_high: float = -math.inf
    lse_min: float = math.inf
    lse_max: float = -math.inf
    masked_rows_max: int = 0
    out_nonfinite: int = 0
    lse_nonfinite: int = 0
    dq_nonfinite: int = 0
    dk_nonfinite: int = 0
    dv_nonfinite: int = 0

    @property
    def nonfinite(self) -> int:
        return sum(getattr(self, f) for f in _COUNT_FIELDS)


@dataclasses.dataclass
class NonFiniteEvent:
    """The first record (in call order) with a non-finite output, LSE or gradient."""

    site: str
    phase: str  # "forward" or "backward"
    call: int  # index of the record in the session
    counts: dict

    def __str__(self) -> str:
        what = ", ".join(f"{n} {k.replace('_nonfinite', '')}" for k, n in self.counts.items() if n)
        return f"{self.site} ({self.phase}, record {self.call}): non-finite {what}"


@dataclasses.dataclass
class MonitorSummary:
    sites: dict[str, SiteStats]
    first_nonfinite: Optional[NonFiniteEvent]
    records: int

    def to_dict(self) -> dict:
        return dict(
            records=self.records,
            sites={name: dataclasses.asdict(s) for name, s in self.sites.items()},
            first_nonfinite=None if self.first_nonfinite is None else dataclasses.asdict(self.first_nonfinite),
        )

    def format(self) -> str:
        header = ("site", "calls", "bwd", "max logit in", "LSE min..max", "masked rows", "NaN/inf out", "dq", "dk", "dv")
        rows = []
        for s in self.sites.values():
            rows.append((
                s.site, str(s.calls), str(s.backward_calls),
                f"[{_num(s.max_logit_low)}, {_num(s.max_logit_high)}]",
                f"{_num(s.lse_min)}..{_num(s.lse_max)}",
                str(s.masked_rows_max), str(s.out_nonfinite + s.lse_nonfinite),
                str(s.dq_nonfinite), str(s.dk_nonfinite), str(s.dv_nonfinite),
            ))
        lines = [f"flash_inductor monitor: {self.records} record(s), {len(self.sites)} site(s)"]
        lines += text_table(rows, header=header, align="<>", indent="  ", rule="columns")
        lines.append(f"first non-finite: {self.first_nonfinite}" if self.first_nonfinite else "first non-finite: none")
        return "\n".join(lines)

    __str__ = format


def _num(x: float) -> str:
    return "-" if x is None or (isinstance(x, float) and (math.isnan(x) or math.isinf(x))) else f"{x:.4g}"


def _max(a: float, b: float) -> float:
    return a if math.isnan(b) else max(a, b)


def _min(a: float, b: float) -> float:
    return a if math.isnan(b) else min(a, b)


def summarise(events: list[tuple[str, str]], rows: list[list[float]]) -> MonitorSummary:
    sites: dict[str, SiteStats] = {}
    first: Optional[NonFiniteEvent] = None
    for call, ((site, phase), row) in enumerate(zip(events, rows)):
        s = sites.setdefault(site, SiteStats(site))
        counts = {f: int(row[INDEX[f]]) for f in _COUNT_FIELDS if not math.isnan(row[INDEX[f]])}
        for f, n in counts.items():
            setattr(s, f, getattr(s, f) + n)
        if phase == "forward":
            s.calls += 1
            s.max_logit_low = _max(s.max_logit_low, row[INDEX["max_logit_low"]])
            s.max_logit_high = _max(s.max_logit_high, row[INDEX["lse_max"]])
            s.lse_min = _min(s.lse_min, row[INDEX["lse_min"]])
            s.lse_max = _max(s.lse_max, row[INDEX["lse_max"]])
            s.masked_rows_max = max(s.masked_rows_max, int(row[INDEX["masked_rows"]]))
        else:
            s.backward_calls += 1
        if first is None and any(counts.values()):
            first = NonFiniteEvent(site, phase, call, {f: n for f, n in counts.items() if n})
    return MonitorSummary(sites, first, len(rows))
