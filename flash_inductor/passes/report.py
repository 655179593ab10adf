"""What the pass did: one record per attention site, rewritten or kept (with the reason).

A :class:`RewriteReport` is what ``flash_inductor.explain()`` and ``flash_inductor.last_report()``
return. ``str(report)`` is a table::

    flash_inductor: rewrote 2 of 3 attention sites
      module    pattern                    status     reason
      h.0.attn  handwritten_additive_mask  rewritten  float mask, scale 0.3536
      ...

Every backend compile also logs its one-line summary (``report.summary()``) at INFO on the
"flash_inductor" logger (Python's default level, WARNING, hides it:
``logging.basicConfig(level=logging.INFO)`` shows it), and the table at DEBUG. With
``make_backend(report=True)`` the user asked to see the table, so it is shown whatever the logging
setup: logged at INFO where a handler takes that record, else written to stderr.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
from typing import Iterator, Optional

from ..text_table import text_table

log = logging.getLogger("flash_inductor")

REWRITTEN, KEPT = "rewritten", "kept"


@dataclasses.dataclass
class SiteRecord:
    """One attention site.

    Attributes:
        pattern: the pattern (family) that recognised it, e.g. ``sdpa``, ``handwritten_gqa``.
        node: the FX node the site is reported at (the output when rewritten; for a kept site the
            node the reason is about), as in ``TORCH_LOGS=pre_grad_graphs`` printouts.
        rewritten: whether it now runs on ``flash_inductor::attention_forward``.
        detail: for a rewritten site the op's arguments (mask, causal, GQA, dropout, scale); for a
            kept site why it was left as written.
        module: the path of the innermost module containing the whole site, relative to the
            module whose forward the graph was traced from (``transformer.h.3.attn``; after a
            graph break that is the module of the resumed frame, and ``explain`` turns it into
            the path from the model it was given); None when the graph carries no module stack
            (a compiled function, a symbolically traced graph) or the site sits in that module's
            own forward.
        module_type: the class of that module, if known.
    """

    pattern: str
    node: str
    rewritten: bool
    detail: str
    module: Optional[str] = None
    module_type: Optional[type] = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def status(self) -> str:
        return REWRITTEN if self.rewritten else KEPT

    @property
    def reason(self) -> str:
        return self.detail


@dataclasses.dataclass
class RewriteReport:
    records: list[SiteRecord] = dataclasses.field(default_factory=list)
    # Set when Inductor served the compiled graph from its cache, so no pass ran this time.
    note: Optional[str] = None

    @property
    def sites(self) -> list[SiteRecord]:
        return self.records

    @property
    def rewritten(self) -> int:
        return sum(r.rewritten for r in self.records)

    @property
    def kept(self) -> int:
        return len(self.records) - self.rewritten

    def summary(self) -> str:
        """One line: ``flash_inductor: rewrote 12 of 12 attention sites``."""
        if self.note:
            return f"flash_inductor: {self.note}"
        noun = "site" if len(self.records) == 1 else "sites"
        return f"flash_inductor: rewrote {self.rewritten} of {len(self.records)} attention {noun}"

    def format(self) -> str:
        """The summary and a table with one row per site."""
        lines = [self.summary()]
        if not self.records:
            return lines[0]
        header = ("module", "node", "pattern", "status", "reason")
        rows = [(r.module or "-", r.node, r.pattern, r.status, r.detail) for r in self.records]
        lines += text_table(rows, header=header, indent="  ")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()

    def extend(self, other: "RewriteReport") -> None:
        self.records.extend(other.records)
        if other.note and not self.note:
            self.note = other.note


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


CACHE_NOTE = ("compiled graph served from Inductor's cache: the pass did not run "
              "(flash_inductor.explain() recompiles and reports every site)")


@contextlib.contextmanager
def one_report_per_compile(verbose: bool = False) -> Iterator[RewriteReport]:
    """Merge what the pass reports during one backend call into one report, and log it: the
    summary at INFO, the table at DEBUG (at INFO when ``verbose``)."""
    merged = RewriteReport()
    _collecting.append(merged)
    ran_before = _PASS_RUNS[0]
    try:
        yield merged
    finally:
        _collecting.pop()
        if _PASS_RUNS[0] == ran_before:
            merged.note = CACHE_NOTE
        _append(merged)
        if verbose and merged.records:
            _show(merged.format())
        else:
            log.info("%s", merged.summary())
            if merged.records:
                log.debug("%s", merged.format())


def _info_is_handled(logger: logging.Logger) -> bool:
    """Whether an INFO record of ``logger`` reaches a handler, as ``Logger.callHandlers`` walks
    them (logging's last-resort handler takes WARNING and above only)."""
    if not logger.isEnabledFor(logging.INFO):
        return False
    current: Optional[logging.Logger] = logger
    while current is not None:
        if any(handler.level <= logging.INFO for handler in current.handlers):
            return True
        current = current.parent if current.propagate else None
    return False


def _show(text: str) -> None:
    """What the user asked to see (``report=True``): logged at INFO where logging is set up to
    show it, else on stderr, where a default setup would have dropped it silently."""
    if _info_is_handled(log):
        log.info("%s", text)
    else:
        print(text, file=sys.stderr, flush=True)


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
