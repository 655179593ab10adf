"""The pre-grad Inductor pass that moves attention onto flash_inductor's op.

Pre-grad is the natural hook: an SDPA call is still one node there, hand-written attention
is still in torch-function form, and the inserted op brings its own registered autograd, so
AOTAutograd derives training graphs from it with no backward pattern to maintain.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import logging
import pathlib
from typing import Callable, Iterable, Optional, Sequence

import torch
import torch.fx as fx
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass

from ..tuning import cache as tuning_cache
from ..monitoring.naming import graph_site_name
from ..schedules import get_schedule
from . import handwritten, mha, sdpa
from .compile_ahead import CompileAhead
from .guard import keep_reason, log_rewrite_failure
from .report import RewriteReport, SiteRecord, count_pass_run, publish
from .site import AttentionSite, KeptSite, describe_rewrite, example_value, module_path, rewrite_site

log = logging.getLogger("flash_inductor")

# Order matters only where families could see the same nodes: MHA nodes contain no SDPA call
# in the pre-grad graph, and hand-written attention never contains either.
_FAMILIES: tuple[Callable[[fx.Graph], Iterable], ...] = (sdpa.find_sites, mha.find_sites, handwritten.find_sites)


@dataclasses.dataclass(frozen=True)
class RewriteOptions:
    """What the pass rewrites and how.

    Attributes:
        schedule: precision schedule for rewritten sites (None = default).
        devices: device types whose attention is rewritten ("cuda", "cpu").
        report: log the per-site table at INFO level, not only the one-line summary (the report
            is always kept in ``REPORTS``).
        monitor: insert ``flash_inductor.monitoring``'s recording ops at every rewritten site.
        compile_ahead: compile the rewritten sites' kernels in a background process while
            Inductor compiles the rest of the graph (``passes/compile_ahead.py``; CUDA only).
    """

    schedule: Optional[str] = None
    devices: tuple[str, ...] = ("cuda", "cpu")
    report: bool = False
    monitor: bool = False
    compile_ahead: bool = True

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

    def __init__(self, options: RewriteOptions = RewriteOptions(), compile_ahead: Optional[CompileAhead] = None):
        self.options = options
        # Starts the background compile of the rewritten sites' kernels (when the option is on);
        # a test may give its own, with the CUDA gate open and the process start recorded.
        self.compile_ahead = compile_ahead if compile_ahead is not None else CompileAhead()
        self._source_uuid: Optional[str] = None
        self._pickled_uuid: Optional[str] = None  # set on an unpickled pass: a snapshot of the key

    def __call__(self, graph: fx.Graph) -> None:
        count_pass_run()
        report = RewriteReport()
        # A site found before an earlier rewrite may take that rewrite's (now erased) output
        # as an input, e.g. attention over attention: map old outputs to their replacements.
        replaced: dict[fx.Node, fx.Node] = {}
        for find_sites in _FAMILIES:
            for found in _found_sites(find_sites, graph):
                self._handle(graph, found, report, replaced)
        if self.options.compile_ahead and report.rewritten:
            self.compile_ahead(graph)
        publish(report)

    def _handle(self, graph: fx.Graph, found, report: RewriteReport, replaced: dict) -> None:
        if isinstance(found, KeptSite):
            module = module_path([found.node, *found.related])
            report.records.append(SiteRecord(found.pattern, found.node.name, False, found.reason, *module))
            counters["flash_inductor"][f"kept_{found.pattern}"] += 1
            return
        site: AttentionSite = found
        # Read before the rewrite erases the site's nodes.
        name, module = site.output.name, module_path([site.output, *site.anchors])
        query = example_value(site.query)
        device = query.device.type if query is not None else None
        if device not in self.options.devices:
            report.records.append(SiteRecord(site.pattern, name, False,
                                             f"device {device} is not in devices={self.options.devices}", *module))
            return
        try:
            detail = describe_rewrite(site, self.options.schedule)
            for field in ("query", "key", "value", "attn_mask"):
                setattr(site, field, replaced.get(getattr(site, field), getattr(site, field)))
            monitor_site = graph_site_name(module[0], site.pattern, name) if self.options.monitor else None
            replacement = rewrite_site(graph, site, self.options.schedule, monitor_site)
        except Exception as error:  # noqa: BLE001 -- a failed rewrite keeps its site, never fails the compile
            log_rewrite_failure(name, error)
            report.records.append(SiteRecord(site.pattern, name, False, keep_reason(error), *module))
            counters["flash_inductor"][f"kept_{site.pattern}"] += 1
            return
        replaced[site.output] = replacement
        report.records.append(SiteRecord(site.pattern, name, True, detail, *module))
        counters["flash_inductor"][site.pattern] += 1

    def uuid(self) -> str:
        """Hash of our sources, torch/triton versions, options and the active tuning tables: a
        cache key that never serves stale code, nor graphs with an old table's configs baked in
        (configs are chosen while the graph compiles)."""
        if self._pickled_uuid is not None:
            return self._pickled_uuid
        if self._source_uuid is None:
            hasher = hashlib.sha256()
            hasher.update(_versions().encode())
            hasher.update(repr(self.options).encode())
            for path in _source_files():
                hasher.update(path.name.encode())
                hasher.update(path.read_bytes())
            self._source_uuid = hasher.hexdigest()
        # Not cached: a table written later in this process (the autotuner) must change the key.
        return hashlib.sha256(f"{self._source_uuid}|{tuning_cache.tables_digest()}".encode()).hexdigest()

    # torch 2.11 pickles the pass object into the FX graph cache key: make that pickle be the uuid.
    def __getstate__(self):
        return {"uuid": self.uuid(), "options": self.options}

    def __setstate__(self, state):
        self.options = state["options"]
        self.compile_ahead = CompileAhead()
        self._source_uuid = None
        self._pickled_uuid = state["uuid"]


def _found_sites(find_sites: Callable[[fx.Graph], Iterable], graph: fx.Graph) -> list:
    """Every site one family finds, matched before any is rewritten. Each family guards its
    patterns node by node (``site.guarded``); should the family's own walk fail, the sites found
    until then are still handled and the compile goes on."""
    found = []
    try:
        for site in find_sites(graph):
            found.append(site)
    except Exception:  # noqa: BLE001
        log.debug("flash_inductor: %s stopped early; the sites after it are left as written",
                  getattr(find_sites, "__module__", find_sites), exc_info=True)
    return found


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
