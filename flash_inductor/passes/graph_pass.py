"""The pre-grad Inductor pass that moves attention onto flash_inductor's op.

Pre-grad is the natural hook: an SDPA call is still one node there, hand-written attention
is still in torch-function form, and the inserted op brings its own registered autograd, so
AOTAutograd derives training graphs from it with no backward pattern to maintain.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import pathlib
from typing import Callable, Iterable, Optional, Sequence

import torch
import torch.fx as fx
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass

from ..monitoring.naming import graph_site_name
from ..tuning.schedules import get_schedule
from . import handwritten, mha, sdpa
from .report import RewriteReport, SiteRecord, count_pass_run, log, publish
from .site import AttentionSite, KeptSite, example_value, rewrite_site

# Order matters only where families could see the same nodes: MHA nodes contain no SDPA call
# in the pre-grad graph, and hand-written attention never contains either.
_FAMILIES: tuple[Callable[[fx.Graph], Iterable], ...] = (sdpa.find_sites, mha.find_sites, handwritten.find_sites)


@dataclasses.dataclass(frozen=True)
class RewriteOptions:
    """What the pass rewrites and how.

    Attributes:
        schedule: precision schedule for rewritten sites (None = default).
        devices: device types whose attention is rewritten ("cuda", "cpu").
        report: log the per-site report at INFO level (it is always kept in ``REPORTS``).
        monitor: insert ``flash_inductor.monitoring``'s recording ops at every rewritten site.
    """

    schedule: Optional[str] = None
    devices: tuple[str, ...] = ("cuda", "cpu")
    report: bool = False
    monitor: bool = False

    def __post_init__(self):
        get_schedule(self.schedule)  # fail early on a bad name
        object.__setattr__(self, "devices", tuple(sorted(set(self.devices))))


def _source_files() -> list[pathlib.Path]:
    """Everything whose change must invalidate cached compiled graphs: pass, op, kernels, tuning."""
    package = pathlib.Path(importlib.import_module("flash_inductor").__file__).parent
    return sorted(p for p in package.rglob("*.py"))


def _versions() -> str:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    return f"torch={torch.__version__};triton={triton_version}"


class FlashAttentionPass(CustomGraphPass):
    """Rewrites attention sites in a pre-grad FX graph; see the pattern families for what matches."""

    def __init__(self, options: RewriteOptions = RewriteOptions()):
        self.options = options
        self._uuid: Optional[str] = None

    def __call__(self, graph: fx.Graph) -> None:
        count_pass_run()
        report = RewriteReport()
        # A site found before an earlier rewrite may take that rewrite's (now erased) output
        # as an input, e.g. attention over attention: map old outputs to their replacements.
        replaced: dict[fx.Node, fx.Node] = {}
        for find_sites in _FAMILIES:
            for found in list(find_sites(graph)):
                self._handle(graph, found, report, replaced)
        publish(report)
        if self.options.report or report.kept:
            (log.info if self.options.report else log.debug)("%s", report.format())

    def _handle(self, graph: fx.Graph, found, report: RewriteReport, replaced: dict) -> None:
        if isinstance(found, KeptSite):
            report.records.append(SiteRecord(found.pattern, found.node.name, False, found.reason))
            counters["flash_inductor"][f"kept_{found.pattern}"] += 1
            return
        site: AttentionSite = found
        query = example_value(site.query)
        device = query.device.type if query is not None else None
        if device not in self.options.devices:
            report.records.append(SiteRecord(site.pattern, site.output.name, False,
                                             f"device {device} is not in devices={self.options.devices}"))
            return
        name = site.output.name
        for field in ("query", "key", "value", "attn_mask"):
            setattr(site, field, replaced.get(getattr(site, field), getattr(site, field)))
        monitor_site = graph_site_name(site.output, site.pattern) if self.options.monitor else None
        replaced[site.output] = rewrite_site(graph, site, self.options.schedule, monitor_site)
        report.records.append(SiteRecord(site.pattern, name, True, "-> flash_inductor::attention_forward"))
        counters["flash_inductor"][site.pattern] += 1

    def uuid(self) -> str:
        """Hash of our sources, torch/triton versions and options: a cache key that never serves stale code."""
        if self._uuid is None:
            hasher = hashlib.sha256()
            hasher.update(_versions().encode())
            hasher.update(repr(self.options).encode())
            for path in _source_files():
                hasher.update(path.name.encode())
                hasher.update(path.read_bytes())
            self._uuid = hasher.hexdigest()
        return self._uuid

    # torch 2.11 pickles the pass object into the FX graph cache key: make that pickle be the uuid.
    def __getstate__(self):
        return {"uuid": self.uuid(), "options": self.options}

    def __setstate__(self, state):
        self.options = state["options"]
        self._uuid = state["uuid"]


class ChainedPass(CustomGraphPass):
    """Our pass followed by a user's own pre-grad pass, so setting ours never drops theirs."""

    def __init__(self, passes: Sequence[Callable[[fx.Graph], None]]):
        self.passes = tuple(passes)

    def __call__(self, graph: fx.Graph) -> None:
        for p in self.passes:
            p(graph)

    def uuid(self) -> Optional[str]:
        parts = []
        for p in self.passes:
            part = p.uuid() if hasattr(p, "uuid") else None
            if part is None:
                return None  # an opaque user pass: Inductor then bypasses its caches, as it would anyway
            parts.append(part if isinstance(part, str) else repr(part))
        return hashlib.sha256("|".join(parts).encode()).hexdigest()

    def __getstate__(self):
        return {"uuid": self.uuid()}
