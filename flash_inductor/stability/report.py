"""Reporting the suite: a text table, a JSON record and a PNG heat-map.

Cell value everywhere: the worst norm-wise relative error over out, dq, dk, dv (each result's
own error is in the JSON), leaving out results whose reference is zero to working precision
(see runner.py). A cell is marked non-finite when any of the four has a NaN / inf entry where
the fp64 reference is finite; the heat-map draws it grey with red hatching.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import pathlib
import platform
import sys
from typing import Optional

import torch

from ..text_table import text_table
from .runner import Metric, Requirement, Result

NONFINITE = "NaN/inf"


def _cell(r: Optional[Result]) -> str:
    if r is None:
        return ""
    if r.status != "ok":
        return r.status
    if not r.finite:
        return NONFINITE
    worst = r.worst_rel()
    return f"{worst:.1e}" if math.isfinite(worst) else "~0 ref"


def _grid(results: list[Result]):
    rows = list(dict.fromkeys((r.case, r.dtype) for r in results))
    impls = list(dict.fromkeys(r.impl for r in results))
    index = {(r.case, r.dtype, r.impl): r for r in results}
    return rows, impls, index


def format_table(results: list[Result]) -> str:
    rows, impls, index = _grid(results)
    header = ["case", "dtype", *impls]
    body = [[case, dtype, *(_cell(index.get((case, dtype, i))) for i in impls)] for case, dtype in rows]
    lines = text_table(body, header=header, rule="columns")
    lines.append(f"cells: worst relative error over out/dq/dk/dv vs fp64; '{NONFINITE}': a non-finite "
                 "result where the reference is finite; n/a: the implementation cannot take the problem; "
                 "skipped: it would materialise too many scores")
    return "\n".join(lines)


def environment(argv: Optional[list[str]] = None, device: str = "cpu") -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        device=torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        processor=platform.processor(),
        torch=torch.__version__, triton=triton_version, python=sys.version.split()[0],
        argv=list(argv) if argv is not None else sys.argv[1:],
        triton_interpret=os.environ.get("TRITON_INTERPRET", "0"),
    )


def _finite_or_none(x):
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


def to_json(results: list[Result], requirement: Requirement, env: dict, cases: dict) -> dict:
    def result_dict(r: Result) -> dict:
        d = dataclasses.asdict(r)
        d["metrics"] = {k: {f: _finite_or_none(v) if f != "nonfinite" else v for f, v in dataclasses.asdict(m).items()}
                        for k, m in r.metrics.items()}
        return d

    return dict(
        environment=env,
        cases=cases,
        results=[result_dict(r) for r in results],
        requirement=dict(schedule=requirement.schedule, passed=requirement.passed, violations=requirement.violations,
                         checks=[{k: _finite_or_none(v) if isinstance(v, float) else v
                                  for k, v in dataclasses.asdict(c).items()} for c in requirement.checks]),
    )


def results_from_json(payload: dict) -> list[Result]:
    """The results of a JSON written by :func:`to_json` (None stands for a non-finite number)."""
    results = []
    for d in payload["results"]:
        metrics = {name: Metric(**{f: (math.inf if v is None else v) for f, v in m.items()})
                   for name, m in d["metrics"].items()}
        results.append(Result(**{**d, "metrics": metrics}))
    return results


def write_json(path: pathlib.Path, payload: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=1, allow_nan=False))
    tmp.replace(path)


def plot_heatmap(results: list[Result], path: pathlib.Path, title: str = "") -> Optional[pathlib.Path]:
    """case × implementation, colour = log10 of the worst relative error; hatched = non-finite,
    grey = n/a or skipped. Returns None when matplotlib is missing."""
    try:
        # A Figure of our own, not pyplot: pyplot's state and the user's backend (a notebook's) stay
        # untouched, and savefig picks the file's renderer.
        import matplotlib
        from matplotlib.figure import Figure
        from matplotlib.patches import Rectangle
    except ImportError:
        return None
    rows, impls, index = _grid(results)
    values = [[math.nan] * len(impls) for _ in rows]
    for i, (case, dtype) in enumerate(rows):
        for j, impl in enumerate(impls):
            r = index.get((case, dtype, impl))
            if r is not None and r.finite:
                worst = r.worst_rel()
                values[i][j] = math.log10(max(worst, 1e-12)) if math.isfinite(worst) else math.nan
    fig = Figure(figsize=(1.1 * len(impls) + 3, 0.32 * len(rows) + 1.8))
    ax = fig.subplots()
    finite = [v for row in values for v in row if not math.isnan(v)]
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#d9d9d9")  # grey: n/a, skipped, non-finite
    # Errors of 100% and more all mean "wrong": the scale stops there and keeps its resolution below.
    vmin = min(finite, default=-6)
    vmax = max(min(max(finite, default=0), 0.0), vmin + 1)
    image = ax.imshow(values, cmap=cmap, aspect="auto", vmin=vmin, vmax=vmax)
    for i, (case, dtype) in enumerate(rows):
        for j, impl in enumerate(impls):
            r = index.get((case, dtype, impl))
            if r is None:
                continue
            if r.status != "ok":
                label = r.status
            elif not r.finite:
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="xxx", edgecolor="red", linewidth=0))
                label = "NaN/inf"
            else:
                label = f"{r.worst_rel():.0e}"
            ax.text(j, i, label, ha="center", va="center", fontsize=6, color="white" if r.finite else "black")
    ax.set_xticks(range(len(impls)), impls, rotation=35, ha="right", fontsize=8)
    ax.set_yticks(range(len(rows)), [f"{c} {d}" for c, d in rows], fontsize=7)
    fig.colorbar(image, ax=ax, extend="max", label="log10 relative error vs fp64 (worst of out/dq/dk/dv)")
    ax.set_title(title or "flash_inductor stability suite", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    return path
