"""``flash_inductor.explain``: which attention sites a model has, and what the backend does with each.

    report = flash_inductor.explain(model, input_ids)
    print(report)                 # one row per site: module, pattern, rewritten or kept, why
    report.rewritten              # how many now run on flash_inductor's op

A report from ``flash_inductor.last_report()`` can be incomplete: when Inductor serves a graph
from its caches the pass does not run. ``explain`` therefore always compiles afresh.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from .passes.report import RewriteReport


def explain_with(backend, fn_or_module: Callable, args: tuple, kwargs: dict) -> RewriteReport:
    """Compile ``fn_or_module`` with ``backend`` (a fresh ``FlashInductorBackend`` built with
    ``without_caches=True``, which collects ``reports`` and ``frame_anchors``), call it once and
    return the report with module paths filled in. The backend is passed in, never imported:
    the backend module calls this one."""
    # An already compiled module is explained from its original: compiling the wrapper would nest
    # its own dynamo context inside ours.
    root = getattr(fn_or_module, "_orig_mod", fn_or_module)
    compiled = torch.compile(root, backend=backend)
    # The AOTAutograd cache is looked up before the pre-grad passes run: a hit would skip ours.
    with torch._functorch.config.patch(enable_autograd_cache=False):
        compiled(*args, **kwargs)
    if not backend.reports:
        raise RuntimeError(
            "flash_inductor.explain: torch.compile handed no graph to the backend, so there is nothing "
            "to report. Either the call ran no tensor operations, or dynamo fell back to eager for "
            "this code (e.g. torch._dynamo.config.recompile_limit was reached by earlier compiles: "
            "call torch._dynamo.reset() first)."
        )
    merged = RewriteReport()
    for report, anchors in zip(backend.reports, backend.frame_anchors):
        if isinstance(root, torch.nn.Module):
            report = _paths_from_frame(report, root, anchors)
        merged.extend(report)
    if isinstance(root, torch.nn.Module):
        _paths_from_root(merged, root)
    return merged


def _frame_prefix(root: torch.nn.Module, anchors: list[tuple[str, torch.Tensor]]) -> str | None:
    """Where in ``root`` the compiled frame's module sits: the prefix P with
    ``root.get_parameter(P + "." + path) is tensor`` for every anchor; None when unknown."""
    by_identity: dict[int, list[str]] = {}
    for name, parameter in root.named_parameters(remove_duplicate=False):
        by_identity.setdefault(id(parameter), []).append(name)
    prefixes = None
    for path, tensor in anchors:
        found = {name[: -len(path)].rstrip(".") for name in by_identity.get(id(tensor), [])
                 if name == path or name.endswith("." + path)}
        prefixes = found if prefixes is None else prefixes & found
    return next(iter(prefixes)) if prefixes is not None and len(prefixes) == 1 else None


def _paths_from_frame(report: RewriteReport, root: torch.nn.Module,
                      anchors: list[tuple[str, torch.Tensor]]) -> RewriteReport:
    """After a graph break, dynamo (torch 2.11) traces the rest of the call from an inner module's
    frame (T5's ``decoder``) and records module paths relative to it. The frame's own parameters,
    passed in as graph inputs, say which module that is, also when its class appears in several
    places of the model. Returns a copy: the per-compile reports in REPORTS keep what was recorded."""
    prefix = _frame_prefix(root, anchors)
    if not prefix:
        return report
    modules = dict(root.named_modules())
    copy = RewriteReport(note=report.note)
    for site in report.sites:
        full = f"{prefix}.{site.module}" if site.module else None
        if full in modules and site.module not in modules:
            site = dataclasses.replace(site, module=full)
        copy.records.append(site)
    return copy


def _paths_from_root(report: RewriteReport, root: torch.nn.Module) -> None:
    """Make module paths relative to ``root``, so that each names a module of
    ``root.named_modules()``. After a graph break, dynamo traces the rest of the call from an inner
    module's frame (HF's ``LlamaForCausalLM`` resuming in ``self.model``) and records paths
    relative to that module; a path that names a module of that class under exactly one submodule
    of ``root`` is completed with that submodule's path. A path that still names no module (a
    frame root we do not know how to strip) is matched by its trailing components."""
    modules = dict(root.named_modules())

    def fits(path: str, cls) -> bool:
        return path in modules and (cls is None or type(modules[path]) is cls)

    for i, site in enumerate(report.sites):
        if site.module is None or fits(site.module, site.module_type):
            continue
        owners = [prefix for prefix in modules if prefix and fits(f"{prefix}.{site.module}", site.module_type)]
        found = f"{owners[0]}.{site.module}" if len(owners) == 1 else None
        if found is None and not owners:
            found = _by_trailing_components(site.module, site.module_type, modules)
        if found is not None:
            # A copy: the per-compile reports in REPORTS keep what their frame recorded.
            report.records[i] = dataclasses.replace(site, module=found)


def _by_trailing_components(path: str, cls, modules: dict) -> str | None:
    """The one module of class ``cls`` whose path ends with the longest run of ``path``'s trailing
    components (at least two, e.g. ``h.0.self_attention`` for ``0.h.0.self_attention``); None
    when no module or several share that run."""
    parts = path.split(".")
    best, best_len = [], 1
    for name, module in modules.items():
        if not name or (cls is not None and type(module) is not cls):
            continue
        theirs = name.split(".")
        common = 0
        while common < min(len(parts), len(theirs)) and parts[-1 - common] == theirs[-1 - common]:
            common += 1
        if common > best_len:
            best, best_len = [name], common
        elif common == best_len and common > 1:
            best.append(name)
    return best[0] if len(best) == 1 else None
