"""The README's measured schedule table, from committed GPU results.

    python -m tools.schedule_results \
        --stability benchmarks/results/stability_nvidia-h200_20261130_all.json \
        --autotune benchmarks/results/autotune_nvidia-h200_sm90_132sm_20261130_full.json \
                   benchmarks/results/autotune_nvidia-h200_sm90_132sm_20261130_bwd-retune.json

Error rows: each stability case × dtype contributes its worst norm-wise relative error over
out/dq/dk/dv against fp64; the table gives the median and the worst of those per schedule.
Speed rows: the tuned winner's TFLOP/s of each schedule's bucket (forward and backward
separately; the tuner's FLOP model: 4·B·H·L·S·E, ×0.5 causal, ×2.5 backward). Several
``--autotune`` summaries merge in order, a later one's bucket replacing an earlier one's (a
re-tune after a kernel change covers only that kernel's buckets). A forward-only
schedule (fp8) has no backward bucket: its backward is `stable`'s after a 16-bit forward.
"""

from __future__ import annotations

import argparse
import json
import statistics

from flash_inductor.schedules import SCHEDULES as _SCHEDULES
from flash_inductor.text_table import markdown_table

SCHEDULES = tuple(_SCHEDULES)


def error_rows(stability: dict) -> list[list[str]]:
    worst: dict[tuple[str, str], list[float]] = {}
    nonfinite = {s: 0 for s in SCHEDULES}
    for r in stability["results"]:
        impl = r["impl"]
        if not impl.startswith("ours:") or r["status"] != "ok":
            continue
        schedule = impl.split(":", 1)[1]
        rels = [m["rel"] for m in r["metrics"].values()]
        nonfinite[schedule] += sum(m["nonfinite"] > 0 for m in r["metrics"].values())
        worst.setdefault((schedule, r["dtype"]), []).append(max(rels))
    rows = []
    for dtype in ("fp16", "bf16"):
        cases = len(worst.get(("stable", dtype), []))
        rows.append([f"rel. error vs fp64, {dtype}: median / worst of {cases} cases"] + [
            f"{statistics.median(worst[(s, dtype)]):.1e} / {max(worst[(s, dtype)]):.1e}" for s in SCHEDULES])
    rows.append(["non-finite out/dq/dk/dv where fp64 is finite"] + [str(nonfinite[s]) for s in SCHEDULES])
    return rows


def speed_rows(autotune: dict, dtype: str, width: int, seq: int) -> list[list[str]]:
    by_bucket = {row["bucket"]: row for row in autotune["rows"]}
    rows = []
    for mask in ("none", "causal"):
        for pass_name in ("forward", "backward"):
            cells = []
            for s in SCHEDULES:
                if pass_name == "backward" and _SCHEDULES[s].fp8_forward:
                    cells.append("`stable`'s, after a 16-bit forward")
                    continue
                row = by_bucket.get(f"{s}/{dtype}/e{width}/{mask}/s{seq}/{pass_name}")
                cells.append(f"{row['tflops']:.0f}" if row and row.get("tuned") else "not tuned")
            rows.append([f"TFLOP/s, {pass_name}, {dtype} E={width} L=S={seq}, {mask}"] + cells)
    return rows


def markdown(rows: list[list[str]]) -> str:
    return "\n".join(markdown_table(["measured", *(f"`{s}`" for s in SCHEDULES)], rows))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stability", required=True)
    p.add_argument("--autotune", required=True, nargs="+", help="tuner summaries, later ones win per bucket")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seq", type=int, default=4096)
    args = p.parse_args(argv)
    with open(args.stability) as f:
        stability = json.load(f)
    autotune = {"rows": []}
    for path in args.autotune:
        with open(path) as f:
            autotune["rows"] += json.load(f)["rows"]  # speed_rows keeps the last row of a bucket
    print(markdown(error_rows(stability) + speed_rows(autotune, args.dtype, args.head_dim, args.seq)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
