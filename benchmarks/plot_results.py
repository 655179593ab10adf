#!/usr/bin/env python
"""Tables and plots for bench_attention.py results; also redraws the PNG of an earlier run.

    python benchmarks/plot_results.py benchmarks/results/bench_nvidia-h200_20261129.json

Records are dicts with section ("attention" | "memory" | "e2e"), provider, dtype, head_dim, causal, seq,
mode, status ("ok" | "unsupported" | "skipped" | "unavailable") and, when ok, ms and tflops.
"""
from __future__ import annotations

import json
import os
import sys

# "ours" runs the default schedule; "ours-fast" the fast one (FA2's Δ: no exact-Δ GEMM), whose
# difference to "ours" is the cost of exact Δ; "ours-fp8" the fp8 forward (its backward is the
# stable one after a 16-bit forward recompute).
PROVIDERS = ("ours", "ours-fast", "ours-fp8", "flash", "cudnn", "efficient", "flex", "math")  # display order
RATIO_ANCHORS = ("flash", "cudnn", "flex")
MODES = ("fwd", "bwd", "fwd_bwd")
PLOT_COLORS = ("black", "dimgray", "tab:olive", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")  # PROVIDERS order
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
    widths = [max(len(str(c)) for c in col) for col in zip(head, *lines)]
    out = [" ".join(str(c).rjust(w) for c, w in zip(row, widths)) for row in [head, *lines]]
    out.insert(1, "-" * len(out[0]))
    return "\n".join(out)


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
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter
    attn = [r for r in records if r["section"] == "attention" and r["status"] == "ok"]
    if not attn:
        return None
    groups = sorted({(r["dtype"], r["head_dim"], r["causal"]) for r in attn})
    modes = [m for m in MODES if any(r["mode"] == m for r in attn)]
    fig, axes = plt.subplots(len(groups), len(modes), figsize=(4.5 * len(modes), 3.4 * len(groups)),
                             squeeze=False, sharex=True)
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
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.05 / len(groups), 1, 1 - 0.05 / len(groups)))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0].startswith("-"):
        sys.exit("usage: python benchmarks/plot_results.py RESULTS.json  (writes RESULTS.png beside it)")
    with open(argv[0]) as f:
        data = json.load(f)
    h = data["header"]
    print(format_table(data["results"]))
    print(format_extras(data["results"]))
    title = f"{h.get('gpu')}  torch {h.get('torch')}  triton {h.get('triton')}  {h.get('date')}"
    print("wrote", plot_results(data["results"], os.path.splitext(argv[0])[0] + ".png", title))


if __name__ == "__main__":
    main()
