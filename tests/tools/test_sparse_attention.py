"""benchmarks.sparse_attention in a small form on CPU: the window part end to end (the reference
path stands in for the kernels), the time budget's partial records, and Flex's mask_mod against the
window's definition."""

from __future__ import annotations

import importlib
import json

import pytest
import torch

from flash_inductor.launch.band import resolve_band


@pytest.fixture(scope="module")
def sparse():
    return importlib.import_module("benchmarks.sparse_attention")


_TINY = ["--part", "window", "--seqs", "64,96", "--windows", "16,200", "--styles", "causal,symmetric",
         "--providers", "ours,sdpa-mask,ours-mask", "--dtype", "fp32", "--head-dim", "16", "--tokens", "96",
         "--rep", "1", "--warmup", "0", "--heat-ms", "0", "--device", "cpu"]


def test_window_part_end_to_end(sparse, tmp_path, capsys):
    records = sparse.main([*_TINY, "--out", str(tmp_path), "--no-plot"])
    # windows wider than L are left out: 2 styles x 2 seqs x 1 window x 2 modes x 3 providers
    assert len(records) == 24 and all(r["status"] == "ok" for r in records), [r.get("error") for r in records]
    ours = [r for r in records if r["provider"] == "ours"]
    assert all(r["max_abs_diff"] < 1e-5 for r in ours)
    assert all(0 < r["tile_fraction"] <= 1 and r["tflops"] > 0 for r in records)
    written = list(tmp_path.glob("sparse_window_*.json"))
    assert len(written) == 1 and not list(tmp_path.glob("*.partial.jsonl"))
    payload = json.loads(written[0].read_text())
    assert payload["header"]["command"] and len(payload["records"]) == 24
    assert len(payload["speedups"]) == 8 and all(set(v) == {"sdpa-mask", "ours-mask"}
                                                 for v in payload["speedups"].values())
    table = capsys.readouterr().out
    assert "ours/sdpa-mask" in table and "symmetric" in table


def test_time_budget_records_the_rest_as_skipped(sparse, tmp_path, monkeypatch):
    monkeypatch.setattr(sparse, "run_cell", lambda part, cell, provider, args, device:
                        dict(cell, provider=provider, status="ok", ms=1.0))
    ticks = iter(range(0, 1000, 10))
    args = sparse.parse_args([*_TINY, "--time-budget", "25"])
    partial = tmp_path / "x.partial.jsonl"
    records = sparse.run_all(args, partial_path=str(partial), clock=lambda: next(ticks))
    measured = [r for r in records if r["status"] == "ok"]
    skipped = [r for r in records if r["status"] == "skipped"]
    assert measured and skipped and len(records) == 24
    assert len(partial.read_text().splitlines()) == len(measured)


@pytest.mark.parametrize("window", [(15, 0), (16, 16), (-1, 3), (5, -1)])
@pytest.mark.parametrize("seq_q,seq_k", [(40, 40), (24, 40)])
def test_flex_mask_mod_is_the_window(sparse, window, seq_q, seq_k):
    mask_mod = sparse.window_mask_mod(*window, seq_q, seq_k)
    keep = mask_mod(None, None, torch.arange(seq_q)[:, None], torch.arange(seq_k)[None, :])
    assert torch.equal(keep, resolve_band(False, 0, window, seq_q, seq_k).visible(seq_q, seq_k))


def test_visible_count_matches_the_pattern(sparse):
    for style in ("causal", "symmetric"):
        cell = dict(seq=100, window=16, style=style)
        assert sparse.PARTS["window"].visible_count(cell) == int(sparse.PARTS["window"].visible(cell, "cpu").sum())


def test_unknown_provider_is_refused(sparse):
    with pytest.raises(SystemExit):
        sparse.parse_args(["--part", "window", "--providers", "ours,nope"])


def test_plot(sparse, tmp_path):
    pytest.importorskip("matplotlib")
    records = [dict(style="causal", mode=m, seq=s, window=256, provider=p, status="ok", ms=ms)
               for m in ("fwd", "fwd_bwd") for s in (4096, 8192) for p, ms in (("ours", 1.0), ("flex", 1.5),
                                                                              ("sdpa-mask", 4.0))]
    path = sparse.plot(records, str(tmp_path / "p.png"), "title")
    assert path and (tmp_path / "p.png").stat().st_size > 0


def test_speedups_by_kernel_time(sparse):
    """``--kernel-time``'s ratio: the contender's kernel time over ours, per cell, from the records
    that have it (CPU runs profile nothing, so their records have none and give no ratio)."""
    cell = dict(style="causal", mode="fwd_bwd", seq=4096, window=256)
    records = [dict(cell, provider="ours", status="ok", ms=2.5, kernel_ms=1.40),
               dict(cell, provider="flex", status="ok", ms=1.4, kernel_ms=1.47),
               dict(cell, provider="sdpa-mask", status="ok", ms=12.0)]
    key = ("causal", "fwd_bwd", 4096, 256)
    by_kernels = sparse.speedups(records, field="kernel_ms")
    assert set(by_kernels[key]) == {"flex"} and by_kernels[key]["flex"] == pytest.approx(1.05)
    assert sparse.speedups(records)[key] == {"flex": pytest.approx(0.56), "sdpa-mask": pytest.approx(4.8)}
    assert sparse.parse_args(["--kernel-time"]).kernel_time and not sparse.parse_args([]).kernel_time
