"""The monitoring session: ``with flash_inductor.monitor() as m: ...`` and where records go.

Off (no active session) is the default and costs nothing: eager ``flash_attention`` checks
one module-level list, and compiled graphs are unchanged unless they were compiled with
``make_backend(monitor=True)``. Records are device tensors (``stats.FIELDS``) collected in
call order; ``summary()`` copies them to the host once.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from .stats import FIELDS
from .summary import MonitorSummary, summarise

# Sessions currently entered, innermost last; records go to the innermost.
_ACTIVE: list["Monitor"] = []

# Rows are stacked into one tensor every this many calls, so a long run keeps a few large
# tensors instead of one small allocation per call (still no host synchronisation).
_COMPACT_EVERY = 512


def active_monitor() -> Optional["Monitor"]:
    return _ACTIVE[-1] if _ACTIVE else None


def record(site: str, phase: str, row: Tensor) -> None:
    """Called by the recording ops at run time; a no-op when no session is active."""
    if _ACTIVE:
        _ACTIVE[-1]._add(site, phase, row)


class Monitor:
    """Per-call attention statistics; create it with :func:`flash_inductor.monitor`."""

    def __init__(self, model: Optional[torch.nn.Module] = None):
        # Module paths for naming eager call sites ("blocks.3.attn"); without a model, modules
        # are named by class and first-seen order ("CausalSelfAttention#3").
        self._names: dict[int, str] = {}
        if model is not None:
            for name, module in model.named_modules():
                self._names[id(module)] = name or type(module).__name__
        self._anonymous: dict[int, str] = {}
        self._events: list[tuple[str, str]] = []  # (site, phase) per record, in call order
        self._pending: list[Tensor] = []
        self._blocks: list[Tensor] = []

    # -- context manager ------------------------------------------------------------------

    def __enter__(self) -> "Monitor":
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.remove(self)

    # -- recording --------------------------------------------------------------------------

    def module_name(self, module: torch.nn.Module) -> str:
        key = id(module)
        if key in self._names:
            return self._names[key]
        if key not in self._anonymous:
            self._anonymous[key] = f"{type(module).__name__}#{len(self._anonymous)}"
        return self._anonymous[key]

    def _add(self, site: str, phase: str, row: Tensor) -> None:
        self._events.append((site, phase))
        self._pending.append(row)
        if len(self._pending) >= _COMPACT_EVERY and len({r.device for r in self._pending}) == 1:
            self._blocks.append(torch.stack(self._pending))
            self._pending = []

    def __len__(self) -> int:
        return len(self._events)

    def clear(self) -> None:
        self._events, self._pending, self._blocks = [], [], []

    # -- reading ----------------------------------------------------------------------------

    def rows(self) -> list[list[float]]:
        """Every record as a list of floats (``stats.FIELDS``), in call order. Synchronises once."""
        host = [block.cpu() for block in self._blocks] + [row.cpu()[None] for row in self._pending]
        if not host:
            return []
        return torch.cat([h.to(torch.float64) for h in host]).tolist()

    def records(self) -> list[dict]:
        """One dict per recorded call, in call order: site, phase and the ``stats.FIELDS`` that
        apply to the phase (forward: output and LSE statistics; backward: gradient counts)."""
        out = []
        for (site, phase), row in zip(self._events, self.rows()):
            fields = {f: v for f, v in zip(FIELDS, row) if not math.isnan(v)}
            out.append(dict(site=site, phase=phase, **fields))
        return out

    def summary(self) -> MonitorSummary:
        """Per-site aggregates and the first site that produced a non-finite value.

        ``print(m.summary())`` prints the table; the returned object also has ``.sites`` (name ->
        :class:`SiteStats`), ``.first_nonfinite`` and ``to_dict()``.
        """
        return summarise(self._events, self.rows())


def monitor(model: Optional[torch.nn.Module] = None) -> Monitor:
    """Record statistics of every attention call inside ``with flash_inductor.monitor() as m:``.

    Per call: the range of the largest logit (derived from the LSE: ``[max LSE - log S, max LSE]``),
    min / max LSE, fully-masked rows, non-finite entries of the output and, in the backward, of
    dq / dk / dv; ``print(m.summary())`` shows them per site and names the first site that went
    non-finite.

    What is recorded:
      * eager calls of :func:`flash_inductor.flash_attention`, named by the calling module
        (its path in ``model`` when given, e.g. ``blocks.3.attn``) and ``file:line``;
      * sites rewritten by a backend made with ``make_backend(monitor=True)``, named by the
        module path dynamo recorded for the site. The default backend inserts nothing: a graph
        compiled without ``monitor=True`` is never monitored, and compiling inside a session
        does not change that. ``flash_attention`` called directly inside code compiled by
        ``torch.compile`` is not recorded either.

    Cost when on: eager calls copy nothing; the statistics read the output and the LSE once
    after the forward and, through a backward hook, dq / dk / dv once (two kernel launches
    forward, four backward). Compiled graphs record through identity ops that the compiler
    cannot drop, which return copies of q, k, v, the output and the gradients (made in the same
    pass that counts). No host synchronisation until ``summary()``. Off, nothing runs. Not meant for CUDA graphs (``mode="reduce-overhead"``),
    which would replay the device work but not the Python-side recording.
    """
    return Monitor(model)
