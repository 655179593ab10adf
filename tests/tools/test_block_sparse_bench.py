"""benchmarks.sparse_attention --part block_sparse in a tiny CPU form (the reference path stands in
for the kernels): every contender runs, ours agrees with SDPA under the layout's mask and with
Flex, the layouts keep every row, and the FLOP and tile counts follow the layout."""

from __future__ import annotations

import importlib
import json

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TINY = ["--part", "block_sparse", "--seqs", "160,192", "--block", "64", "--sparsities", "0.5,0.9",
        "--dtype", "fp32", "--head-dim", "16", "--tokens", "192", "--rep", "1", "--warmup", "0", "--heat-ms", "0",
        "--device", "cpu", "--no-plot"]


@pytest.fixture(scope="module")
def sparse():
    return importlib.import_module("benchmarks.sparse_attention")


@pytest.fixture(scope="module")
def part():
    return importlib.import_module("benchmarks.block_sparse_attention")


def test_block_sparse_part_end_to_end(sparse, tmp_path, capsys):
    records = sparse.main([*TINY, "--providers", "ours,flex,sdpa-mask,ours-mask", "--out", str(tmp_path)])
    assert len(records) == 2 * 2 * 2 * 4  # sparsities x seqs x modes x providers
    ok = {(r["provider"], r["mode"]) for r in records if r["status"] == "ok"}
    # Flex has no CPU backward; everything else runs both modes.
    assert ok == {(p, m) for p in ("ours", "sdpa-mask", "ours-mask") for m in ("fwd", "fwd_bwd")} | {("flex", "fwd")}
    ours = [r for r in records if r["provider"] == "ours"]
    assert all(r["max_abs_diff"] < 1e-5 for r in ours)
    assert {r["style"] for r in records} == {"bs50", "bs90"}
    assert all(0 < r["tile_fraction"] <= 1 and r["tflops"] > 0 for r in records if r["status"] == "ok")
    payload = json.loads(next(tmp_path.glob("sparse_block_sparse_*.json")).read_text())
    assert len(payload["records"]) == len(records)
    assert "ours/flex" in capsys.readouterr().out


def test_ours_matches_flex_on_the_same_layout(sparse, part):
    args = sparse.parse_args([*TINY, "--modes", "fwd"])
    cell = part.cells(args, sparse.HIDDEN)[-1]
    q, k, v = (torch.randn(1, 2, cell["seq"], 16) for _ in range(3))
    ours = part.attention("ours", cell, "cpu", sparse.compiled_flex)(q, k, v)
    flex = part.attention("flex", cell, "cpu", sparse.compiled_flex)(q, k, v)
    torch.testing.assert_close(ours, flex, atol=1e-5, rtol=1e-5)


def test_layouts_keep_every_row_and_count_their_scores(sparse, part):
    args = sparse.parse_args([*TINY, "--seqs", "1000", "--sparsities", "0.9"])
    cell = part.cells(args, sparse.HIDDEN)[0]
    dense = part.visible(cell, "cpu")
    assert dense.any(-1).all()  # the diagonal block keeps every row
    assert part.visible_count(cell) == int(dense.sum())
    layout = part.block_map(cell, "cpu")
    assert 0.05 < layout.float().mean() < 0.3  # about 10 % of blocks, plus the diagonal
    assert part.tile_fraction(cell) <= 1.0


def test_default_seqs_per_part(sparse):
    assert sparse.parse_args(["--part", "block_sparse"]).seqs == [4096, 8192, 16384, 32768]
    args = sparse.parse_args(["--part", "block_sparse"])
    assert {c["seq"] for c in sparse.PARTS["block_sparse"].cells(args)} == {4096, 8192, 16384}
