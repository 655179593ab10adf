"""What the pass did: one line per attention site, rewritten or kept (with the reason)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Iterator, Optional

log = logging.getLogger("flash_inductor")


@dataclasses.dataclass
class SiteRecord:
    pattern: str
    node: str
    rewritten: bool
    detail: str


@dataclasses.dataclass
class RewriteReport:
    records: list[SiteRecord] = dataclasses.field(default_factory=list)
    # Set when Inductor served the compiled graph from its cache, so no pass ran this time.
    note: Optional[str] = None

    @property
    def rewritten(self) -> int:
        return sum(r.rewritten for r in self.records)

    @property
    def kept(self) -> int:
        return len(self.records) - self.rewritten

    def format(self) -> str:
        lines = [f"flash_inductor: {self.rewritten} attention site(s) rewritten, {self.kept} kept"]
        if self.note:
            lines.append(f"  ({self.note})")
        for r in self.records:
            verb = "rewrote" if r.rewritten else "kept   "
            lines.append(f"  {verb} {r.pattern:<12} at {r.node}: {r.detail}")
        return "\n".join(lines)


# Reports of the compilations in this process, newest last, so tests and users can inspect them.
REPORTS: list[RewriteReport] = []
_MAX_REPORTS = 64
# While a backend call is compiling, the pass adds its records here: Inductor may run the
# pass once per subgraph (e.g. activation checkpointing), and one compile is one report.
_collecting: list[RewriteReport] = []


def publish(report: RewriteReport) -> None:
    """Called by the pass once per graph it ran on."""
    if _collecting:
        _collecting[-1].records.extend(report.records)
    else:
        _append(report)


def _append(report: RewriteReport) -> None:
    REPORTS.append(report)
    del REPORTS[:-_MAX_REPORTS]


@contextlib.contextmanager
def one_report_per_compile() -> Iterator[RewriteReport]:
    """Merge what the pass reports during one backend call into one report."""
    merged = RewriteReport()
    _collecting.append(merged)
    ran_before = _PASS_RUNS[0]
    try:
        yield merged
    finally:
        _collecting.pop()
        if _PASS_RUNS[0] == ran_before:
            merged.note = "served from Inductor's cache: the pass did not run for this compile"
        _append(merged)


# Incremented by the pass on every run, so a backend call can tell a cache hit from a graph
# with no attention.
_PASS_RUNS = [0]


def count_pass_run() -> None:
    _PASS_RUNS[0] += 1


def last_report() -> RewriteReport:
    """The report of the most recent compilation through flash_inductor's backend."""
    if not REPORTS:
        raise RuntimeError("flash_inductor: no graph has been compiled with flash_inductor.backend yet.")
    return REPORTS[-1]
