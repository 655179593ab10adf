"""benchmarks.block_sparse_attention in a tiny CPU form: every provider runs, ours agrees with Flex,
the JSON and the table come out, and --time-budget records the cells it did not start."""

from __future__ import annotations

import importlib
import json

import pytest

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TINY = ["--device", "cpu", "--dtype", "fp32", "--batch", "1", "--heads", "2", "--head-dim", "16", "--seqs", "192",
        "--block", "64", "--rep", "1", "--no-plot"]


@pytest.fixture(scope="module")
def bench():
    return importlib.import_module("benchmarks.block_sparse_attention")


def test_every_provider_runs_and_ours_matches_flex(bench, tmp_path, capsys):
    records = bench.main([*TINY, "--modes", "fwd,fwd_bwd", "--sparsities", "0.5,0.9",
                          "--providers", "ours,flex,ours-dense,sdpa-mask", "--out", str(tmp_path)])
    assert len(records) == 2 * 2 * 4
    ok = {(r["provider"], r["mode"]) for r in records if r["status"] == "ok"}
    # Flex has no CPU backward; everything else runs both modes.
    assert ok == {(p, m) for p in ("ours", "ours-dense", "sdpa-mask") for m in ("fwd", "fwd_bwd")} | {("flex", "fwd")}
    diffs = [r["max_abs_diff_vs_flex"] for r in records if r["provider"] == "ours" and r["mode"] == "fwd"]
    assert len(diffs) == 2 and max(diffs) < 1e-5
    assert all(0.0 < r["density"] < 1.0 for r in records if r["status"] == "ok")
    written = json.loads(next(tmp_path.glob("block_sparse_cpu_*.json")).read_text())
    assert written["records"] == records and "torch" in written["header"]
    assert not list(tmp_path.glob("*.partial.jsonl"))
    table = capsys.readouterr().out
    assert "flex/ours" in table and "sdpa-mask/ours" in table


def test_time_budget_skips_the_cells_left(bench, tmp_path):
    ticks = iter(range(0, 1000, 10))
    args = bench.parse_args([*TINY, "--modes", "fwd", "--sparsities", "0.5,0.9", "--providers", "ours",
                             "--time-budget", "15", "--out", str(tmp_path)])
    records = bench.run_block_sparse(args, clock=lambda: next(ticks))
    assert [r["status"] for r in records] == ["ok", "skipped"]
    assert records[1]["error"] == "--time-budget spent"


def test_unknown_provider_is_refused(bench):
    with pytest.raises(SystemExit):
        bench.parse_args(["--providers", "ours,nope"])
