"""What the pass did: one line per attention site, rewritten or kept (with the reason)."""

from __future__ import annotations

import dataclasses
import logging

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

    @property
    def rewritten(self) -> int:
        return sum(r.rewritten for r in self.records)

    @property
    def kept(self) -> int:
        return len(self.records) - self.rewritten

    def format(self) -> str:
        lines = [f"flash_inductor: {self.rewritten} attention site(s) rewritten, {self.kept} kept"]
        for r in self.records:
            verb = "rewrote" if r.rewritten else "kept   "
            lines.append(f"  {verb} {r.pattern:<12} at {r.node}: {r.detail}")
        return "\n".join(lines)


# Reports of the compilations in this process, newest last, so tests and users can inspect them.
REPORTS: list[RewriteReport] = []


def last_report() -> RewriteReport:
    if not REPORTS:
        raise RuntimeError("flash_inductor: no graph has been compiled with flash_inductor.backend yet.")
    return REPORTS[-1]
