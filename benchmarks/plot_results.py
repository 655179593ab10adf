#!/usr/bin/env python
"""Tables and plots for bench_attention.py results; also redraws the PNG of an earlier run.

    python -m benchmarks.plot_results benchmarks/results/bench_nvidia-h200_20261202_grid.json
    python -m benchmarks.plot_results A.json B.json --out benchmarks/results/bench_..._grid   # merge runs
    python -m benchmarks.plot_results --ab BEFORE.json AFTER.json --out ab   # two trees' runs, after/before

Several files (a grid split over GPUs or calls) are merged into one record set: for the same cell
and provider a measured record beats a skipped or failed one, and a later file beats an earlier.
The printout ends with issue 6's targets, cell by cell (``target_report``).

Records are dicts with section ("attention" | "memory" | "e2e"), provider, dtype, head_dim, causal, seq,
mode, status ("ok" | "unsupported" | "skipped" | "unavailable") and, when ok, ms and tflops.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import textwrap

from flash_inductor.text_table import markdown_table, text_table

# "ours" runs the default schedule; "ours-fast" the fast one (FA2's Δ: no exact-Δ GEMM), whose
# difference to "ours" is the cost of exact Δ; "ours-fp8" the fp8 forward (its backward is the
# stable one after a 16-bit forward recompute). "ours" is the eager call; "ours-compiled" is an
# SDPA call compiled with flash_inductor.backend, the product's path: the same kernels and configs,
# launched from Inductor's wrapper, so the two differ by host time only (short problems).
PROVIDERS = ("ours", "ours-compiled", "ours-fast", "ours-fp8", "flash", "cudnn", "efficient", "flex", "math")  # display order
RATIO_ANCHORS = ("flash", "cudnn", "flex")
# "infer": the forward under torch.no_grad() (what inference runs); "fwd": with inputs that
# require grad, the forward a training step runs (under `stable` ours then also saves the exact
# Δ's residual).
MODES = ("infer", "fwd", "bwd", "fwd_bwd")
PLOT_COLORS = ("black", "tab:blue", "dimgray", "tab:olive", "tab:orange", "tab:green", "tab:red", "tab:purple",
               "tab:brown")  # PROVIDERS order
STATUS_CELL = {"unsupported": "n/a", "skipped": "skip", "unavailable": "n/a"}


def _fmt(value, spec=".1f"):
    return "-" if value is None else format(value, spec)


def format_table(records):
    """One row per (dtype, E, causal, seq, mode): TFLOP/s per provider, then ours / anchor."""
    attn = [r for r in records if r["section"] == "attention"]
    providers = [p for p in PROVIDERS if any(r["provider"] == p for r in attn)]
    anchors = [a for a in RATIO_ANCHORS if a in providers and "ours" in providers]
    rows, cells = {}, {}
    for r in attn:
        key = (r["dtype"], r["head_dim"], r["causal"], r["seq"], r["mode"])
        rows.setdefault(key, None)
        cells[key + (r["provider"],)] = r.get("tflops") if r["status"] == "ok" else STATUS_CELL.get(r["status"], "?")
    head = ["dtype", "E", "causal", "seq", "mode", *providers, *[f"ours/{a}" for a in anchors]]
    lines = []
    for key in rows:
        vals = [cells.get(key + (p,)) for p in providers]
        ours = cells.get(key + ("ours",))
        ratios = [cells.get(key + (a,)) for a in anchors]
        ratios = [ours / a if isinstance(ours, float) and isinstance(a, float) and a > 0 else None for a in ratios]
        lines.append([key[0], str(key[1]), "yes" if key[2] else "no", str(key[3]), key[4],
                      *[_fmt(v) if not isinstance(v, str) else v for v in vals], *[_fmt(x, ".2f") for x in ratios]])
    return "\n".join(text_table(lines, header=head, align=">", gap=" ", rule="line"))


def format_extras(records):
    lines = []
    for r in records:
        if r["section"] == "memory" and r["status"] == "ok":
            lines.append(f"memory  {r['provider']:>10} {r['dtype']} causal={r['causal']!s:5} seq={r['seq']:>6}: "
                         f"peak extra {r['peak_extra_mib']:8.1f} MiB, beyond out+grads {r['workspace_mib']:8.1f} MiB")
        elif r["section"] == "e2e" and r["status"] == "ok":
            eager = next((x["ms"] for x in records if x["section"] == "e2e" and x["provider"] == "eager"
                          and x["status"] == "ok"), None)
            speed = f", {eager / r['ms']:.2f}x eager" if eager else ""
            lines.append(f"e2e     {r['provider']:>14}: {r['ms']:8.3f} ms/step{speed}, peak extra "
                         f"{r['peak_extra_mib']:.0f} MiB, max|out-eager| {r['max_abs_diff']:.3g}")
    seen = set()
    for r in records:
        if r["status"] not in ("ok", "skipped") and (r["provider"], r.get("error")) not in seen:
            seen.add((r["provider"], r.get("error")))
            lines.append(f"{r['status']:>11} {r['provider']}: {r.get('error')}")
    return "\n".join(lines)


def plot_results(records, path, title=""):
    """TFLOP/s vs seq; one subplot per (dtype, E, causal) row and mode column, one line per provider."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter
    attn = [r for r in records if r["section"] == "attention" and r["status"] == "ok"]
    if not attn:
        return None
    groups = sorted({(r["dtype"], r["head_dim"], r["causal"]) for r in attn})
    modes = [m for m in MODES if any(r["mode"] == m for r in attn)]
    height = 3.4 * len(groups)
    fig = Figure(figsize=(4.5 * len(modes), height))
    axes = fig.subplots(len(groups), len(modes), squeeze=False, sharex=True)
    for i, (dtype, e, causal) in enumerate(groups):
        for j, mode in enumerate(modes):
            ax = axes[i][j]
            for color, provider in zip(PLOT_COLORS, PROVIDERS):
                pts = sorted((r["seq"], r["tflops"]) for r in attn if (r["dtype"], r["head_dim"], r["causal"],
                             r["mode"], r["provider"]) == (dtype, e, causal, mode, provider))
                if pts:
                    ax.plot(*zip(*pts), marker="o", color=color, label=provider,
                            linewidth=2.5 if provider == "ours" else 1.2)
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x / 1024:g}k" if x >= 1024 else f"{x:g}"))
            ax.set_title(f"{dtype} E={e} {'causal' if causal else 'full'} {mode}", fontsize=9)
            ax.set_xlabel("seq (L = S)")
            ax.set_ylabel("TFLOP/s")
            ax.grid(alpha=0.3)
            ax.set_ylim(bottom=0)
    handles = {label: h for ax in axes.flat for h, label in zip(*ax.get_legend_handles_labels())}
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=len(handles), fontsize=8)
    # Wrapped to the figure's width: a one-column figure (a single mode) is too narrow for the
    # run's title (GPU, versions, date) on one line, and tight_layout leaves room only for the
    # lines it is told of. 0.17 in is a 10-point line, and the legend's row below.
    title = textwrap.fill(title, width=55 * len(modes))
    title_lines = title.count("\n") + 1
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.17 / height, 1, 1 - 0.17 * title_lines / height))
    fig.savefig(path, dpi=110)
    return path


def plot_kernel_time(records, path, title="", ours="ours", anchor="flash"):
    """For runs with --kernel-time: per cell, ours' time over the anchor's, timed (do_bench, what
    the tables report) and by kernel time alone (the profiler's sum per call). A cell above 1 on
    the first bar and below it on the second lost on host time, not on its kernels. None when no
    cell has both providers' kernel times."""
    cells = {}
    for r in records:
        if r.get("section") == "attention" and r.get("status") == "ok" and r.get("kernel_ms") and r["provider"] in (ours, anchor):
            cells.setdefault(_cell(r), {})[r["provider"]] = r
    pairs = sorted(((c, v) for c, v in cells.items() if ours in v and anchor in v), key=lambda pair: pair[0])
    if not pairs:
        return None
    from matplotlib.figure import Figure
    labels = [f"{d} E{e} {'causal' if c else 'full'} {s // 1024 if s >= 1024 else s}{'k' if s >= 1024 else ''} {m}"
              for (d, e, c, s, m), _ in pairs]
    timed = [v[ours]["ms"] / v[anchor]["ms"] for _, v in pairs]
    kernels = [v[ours]["kernel_ms"] / v[anchor]["kernel_ms"] for _, v in pairs]
    fig = Figure(figsize=(max(6.0, 0.55 * len(pairs) + 2), 4.2))
    ax = fig.subplots()
    x = range(len(pairs))
    ax.bar([i - 0.2 for i in x], timed, width=0.4, color="tab:gray", label=f"timed (do_bench): {ours} ms / {anchor} ms")
    ax.bar([i + 0.2 for i in x], kernels, width=0.4, color="black",
           label=f"kernels alone (profiler): {ours} / {anchor}")
    ax.axhline(1.0, color="tab:red", linewidth=1)
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel(f"time, {ours} / {anchor} (below 1: {ours} faster)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


# The targets: (anchor, minimum ours/anchor, which cells), for the forward (inference and training)
# and forward+backward of the 16-bit grid. cuDNN, what SDPA runs on Hopper, is the bar at seq >= 2k
# (issue 31: at least 1.0x in every cell).
TARGET_MODES = ("infer", "fwd", "fwd_bwd")
TARGET_DTYPES = ("bf16", "fp16")
TARGETS = (
    ("flash", {"infer": 1.0, "fwd": 1.0, "fwd_bwd": 1.0}, lambda r: True),
    ("flex", {"infer": 1.0, "fwd": 1.0, "fwd_bwd": 1.0}, lambda r: True),
    ("cudnn", {"infer": 1.0, "fwd": 1.0, "fwd_bwd": 1.0}, lambda r: r["seq"] >= 2048),
)


def _cell(r):
    return (r["dtype"], r["head_dim"], r["causal"], r["seq"], r["mode"])


def target_report(records, ours="ours"):
    """Every (cell, anchor) a target applies to, with ours/anchor, the threshold and whether it holds.

    Returns (rows, lines): rows are dicts (cell fields, anchor, ratio, threshold, met); lines a
    printable summary, per anchor and mode: cells met / measured, the median ratio, and every miss.
    Cells where ours or the anchor has no measurement are counted as unmeasured, never as met."""
    ok = {_cell(r) + (r["provider"],): r["tflops"] for r in records
          if r["section"] == "attention" and r["status"] == "ok" and r.get("tflops")}
    cells = sorted({_cell(r) for r in records if r["section"] == "attention" and r["mode"] in TARGET_MODES
                    and r["dtype"] in TARGET_DTYPES},
                   key=lambda c: (c[0], c[1], c[2], c[4], c[3]))
    rows, lines = [], []
    for anchor, thresholds, applies in TARGETS:
        for mode in TARGET_MODES:
            scope = [c for c in cells if c[4] == mode
                     and applies(dict(zip(("dtype", "head_dim", "causal", "seq", "mode"), c)))]
            if not scope:
                continue
            measured, missing = [], 0
            for c in scope:
                mine, theirs = ok.get(c + (ours,)), ok.get(c + (anchor,))
                if mine is None or theirs is None:
                    missing += 1
                    continue
                row = dict(zip(("dtype", "head_dim", "causal", "seq", "mode"), c), anchor=anchor,
                           ratio=mine / theirs, threshold=thresholds[mode])
                row["met"] = row["ratio"] >= row["threshold"]
                rows.append(row)
                measured.append(row)
            if not measured:
                lines.append(f"{ours}/{anchor} {mode}: no cell measured for both ({missing} cells)")
                continue
            met = sum(r["met"] for r in measured)
            median = statistics.median(r["ratio"] for r in measured)
            lines.append(f"{ours}/{anchor} {mode} >= {thresholds[mode]}: {met}/{len(measured)} cells met, "
                         f"median {median:.3f}" + (f", {missing} not measured for both" if missing else ""))
            for r in measured:
                if not r["met"]:
                    lines.append(f"    miss {r['dtype']} E={r['head_dim']} {'causal' if r['causal'] else 'full':6} "
                                 f"seq={r['seq']:>5}: {r['ratio']:.3f}")
    return rows, lines


def target_table(records, ours="ours", min_seq=0):
    """Markdown: one row per target (anchor, mode, threshold), one column per head dim, each cell
    "met/measured, median (min–max)" of ours/anchor over the cells with seq >= min_seq. This is
    the README's target table, computed rather than typed."""
    rows = [r for r in target_report(records, ours)[0] if r["seq"] >= min_seq]
    head_dims = sorted({r["head_dim"] for r in rows})
    names = {"flash": "FA2", "flex": "Flex", "cudnn": "cuDNN"}
    modes = {"infer": "inference forward", "fwd": "forward", "fwd_bwd": "forward+backward"}
    table = []
    for anchor, thresholds, _ in TARGETS:
        for mode in TARGET_MODES:
            scoped = [r for r in rows if r["anchor"] == anchor and r["mode"] == mode]
            if not scoped:
                continue
            cells = []
            for e in head_dims:
                ratios = [r["ratio"] for r in scoped if r["head_dim"] == e]
                met = sum(x >= thresholds[mode] for x in ratios)
                cells.append(f"{met}/{len(ratios)}, {statistics.median(ratios):.2f}× "
                             f"({min(ratios):.2f}–{max(ratios):.2f})" if ratios else "")
            table.append([f"{modes[mode]} ≥ {thresholds[mode]}× {names.get(anchor, anchor)}", *cells])
    header = [f"{ours}" + (f", seq ≥ {min_seq}" if min_seq else ""), *(f"E = {e}" for e in head_dims)]
    return "\n".join(markdown_table(header, table))


def _record_key(r):
    return (r["section"], r["provider"], r.get("dtype"), r.get("head_dim"), r.get("causal"), r.get("seq"),
            r.get("mode"))


def merge_records(record_lists):
    """One record per (section, provider, cell): a measured record beats any other status, and among
    equals the later list wins (a re-run of some cells replaces them)."""
    merged = {}
    for records in record_lists:
        for r in records:
            key = _record_key(r)
            if key not in merged or r["status"] == "ok" or merged[key]["status"] != "ok":
                merged[key] = r
    return list(merged.values())


def merge_headers(headers):
    """The runs' shared header; fields that differ between runs become a list of the distinct values."""
    out = {}
    for key in dict.fromkeys(k for h in headers for k in h):
        values = list(dict.fromkeys(json.dumps(h.get(key), sort_keys=True) for h in headers))
        out[key] = json.loads(values[0]) if len(values) == 1 else [json.loads(v) for v in values]
    return out


def ab_ratios(before, after):
    """after/before time per (provider, cell) for two runs of the same grid (two trees, one device
    call: ``tools/gpu/steps.sh ab``): {provider: {"median", "min", "max", "cells", "by_cell"}}. The
    anchors' ratios (cuDNN, Flex: the same code on both sides) are the run's drift, against which
    ours' is read."""
    times = [{_record_key(r): r["ms"] for r in run if r["section"] == "attention" and r["status"] == "ok"}
             for run in (before, after)]
    out = {}
    for key in sorted(times[0].keys() & times[1].keys(), key=str):
        entry = out.setdefault(key[1], {"by_cell": {}})
        entry["by_cell"]["/".join(map(str, key[2:]))] = times[1][key] / times[0][key]
    for entry in out.values():
        ratios = list(entry["by_cell"].values())
        entry.update(median=statistics.median(ratios), min=min(ratios), max=max(ratios), cells=len(ratios))
    return out


def _write_ab(paths, stem):
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    if runs[0]["header"].get("gpu") != runs[1]["header"].get("gpu"):
        raise SystemExit("--ab: the two runs come from different GPUs; an A/B needs one device call")
    ratios = ab_ratios(runs[0]["results"], runs[1]["results"])
    if not ratios:
        raise SystemExit("--ab: the two runs share no measured cell")
    rows = [[provider, f"{r['median']:.3f}", f"{r['min']:.3f}", f"{r['max']:.3f}", r["cells"]]
            for provider, r in ratios.items()]
    print("\n".join(text_table(rows, header=["provider", "after/before median", "min", "max", "cells"], align="<>",
                               rule="columns")))
    with open(stem + ".json", "w") as f:
        json.dump({"before": runs[0]["header"], "after": runs[1]["header"], "after_over_before": ratios}, f,
                  indent=1)
    print("wrote", stem + ".json")


def main(argv=None):
    p = argparse.ArgumentParser(description="Print (and plot) bench_attention.py results; merge several runs.")
    p.add_argument("results", nargs="+", help="bench_*.json files; several are merged")
    p.add_argument("--ab", action="store_true",
                   help="two files, BEFORE AFTER (the same grid from two trees): after/before time per provider "
                        "and cell, into --out STEM.json")
    p.add_argument("--out", default=None,
                   help="stem for the merged .json and .png (default: the single input's own stem)")
    p.add_argument("--summary", default=None, metavar="PROVIDERS",
                   help="print only the targets as markdown tables by head dim, for these providers (e.g. "
                        "ours,ours-fast), and write nothing")
    p.add_argument("--min-seq", type=int, default=0, help="with --summary: only cells with seq >= this")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.ab:
        if len(args.results) != 2 or not args.out:
            p.error("--ab takes two files, BEFORE AFTER, and --out STEM")
        return _write_ab(args.results, args.out)
    if len(args.results) > 1 and not args.out and not args.summary:
        p.error("merging several files needs --out STEM")
    loaded = []
    for path in args.results:
        with open(path) as f:
            loaded.append(json.load(f))
    gpus = {d["header"].get("gpu") for d in loaded}
    if len(gpus) > 1:
        p.error(f"these files come from different GPUs ({sorted(map(str, gpus))}); ratios across them mean nothing")
    header = merge_headers([d["header"] for d in loaded])
    records = merge_records(d["results"] for d in loaded)
    if args.summary:
        print("\n\n".join(target_table(records, ours, args.min_seq) for ours in args.summary.split(",") if ours))
        return
    stem = args.out or os.path.splitext(args.results[0])[0]
    print(format_table(records))
    print(format_extras(records))
    print("\n".join(target_report(records)[1]))
    if len(loaded) > 1:
        header["merged_from"] = [os.path.basename(x) for x in args.results]
        with open(stem + ".json", "w") as f:
            json.dump({"header": header, "results": records}, f, indent=1)
        print("wrote", stem + ".json")
    title = f"{header.get('gpu')}  torch {header.get('torch')}  triton {header.get('triton')}  {header.get('date')}"
    print("wrote", plot_results(records, stem + ".png", title))
    kernel_plot = plot_kernel_time(records, stem + "_kernel-time.png", title)
    if kernel_plot:
        print("wrote", kernel_plot)


if __name__ == "__main__":
    main()
