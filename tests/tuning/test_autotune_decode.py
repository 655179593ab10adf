"""The autotuner's decode family on CPU: its buckets, its search space, and a search and a CLI run
that launch the split-KV decode kernels (interpreted, with an injected timer)."""

from __future__ import annotations

import pytest
import torch

from flash_inductor.autotune import cli
from flash_inductor.autotune.measure import Shape
from flash_inductor.autotune.plan import COPY, SWEEP, Grid, PlannedBucket, make_plan
from flash_inductor.autotune.search_space import SearchSpace, space_for
from flash_inductor.tuning import cache
from flash_inductor.tuning.buckets import Bucket
from helpers import DEVICE, spy_on_launches
from tuning_helpers import (  # noqa: F401  (isolated_tables: an autouse fixture)
    builtin_configs, cfg_dict, cost_key, isolated_tables, run_plan, table_file, timer_from, tiny_settings,
)

DECODE_SETTINGS = dict(decode_check_shape=Shape(1, 4, 3, 67, heads_kv=2), decode_batch=1, decode_rows=2,
                       decode_group=2)


def test_decode_buckets_in_the_plan():
    grid = Grid(("stable", "fast", "fp8"), ("bf16", "fp32"), (128,), ("none", "bool"), (1024, 65536), ("decode",))
    plan = make_plan(grid)
    keys = {p.bucket.key(): p for p in plan}
    # The fp8 schedule's decode-shaped calls run its own forward: no decode buckets for it.
    assert not [k for k in keys if k.startswith("fp8/")]
    assert keys["stable/bf16/e128/none/s1024/decode"].kind == SWEEP
    # fast == stable in the decode kernel (the same constexprs): copied, not measured.
    assert keys["fast/bf16/e128/bool/s65536/decode"].kind == COPY
    assert len(plan) == 2 * 2 * 2 * 2


def test_decode_search_space_caps_rows_from_16_and_tries_two_warps():
    space = SearchSpace("tiny", (64, 128), (32, 64), (4, 8), (2,))
    decode = space_for("decode", space)
    assert decode.blocks_m == (16, 32, 64, 128) and 2 in decode.warps and {3, 4} <= set(decode.stages)
    assert decode.name == space.name and decode.blocks_n == space.blocks_n
    assert space_for("forward", space) is space


@pytest.mark.launches_kernels
def test_a_decode_bucket_is_searched_with_the_decode_kernels(monkeypatch):
    bucket = Bucket("stable", "fp16", 16, "causal", 128, "decode")
    heuristic = builtin_configs(torch.float16, 16)
    timer = timer_from({("decode", 32, 16, 2): 1.0, cost_key("decode", heuristic): 8.0})
    seen = set()
    spy_on_launches(monkeypatch, lambda name, kwargs: seen.add(name))
    task = run_plan([PlannedBucket(bucket, SWEEP)], tiny_settings(timer, **DECODE_SETTINGS))[bucket]
    assert "_attn_decode_split" in seen and seen <= {"_attn_decode_split", "_attn_decode_merge"}
    # The timer prices (block_m, block_n, warps) alone, so every pipeline depth of the winner ties;
    # which depth the space lists first differs between a GPU and the interpreter.
    (picked,) = task.entry["configs"].values()
    assert set(task.entry["configs"]) == {"decode"}
    assert {**picked, "num_stages": 1} == cfg_dict(32, 16, warps=2)
    assert task.entry["speedup_vs_heuristic"] == pytest.approx(8.0)
    assert not task.entry["rejected"], task.entry["rejected"]  # every config is accurate and stable


@pytest.mark.launches_kernels
def test_cli_tunes_decode_buckets_into_the_table(tmp_path):
    timer = timer_from({("decode", 16, 32, 4): 1.0})
    settings = tiny_settings(timer, space=SearchSpace("tiny", (16,), (16, 32), (4,), (1,)), **DECODE_SETTINGS)
    out = tmp_path / "tables"
    argv = ["--dtypes", "fp16", "--head-dims", "16", "--masks", "bool", "--schedules", "stable",
            "--passes", "decode", "--seqs", "1024", "--out", str(out), "--summary", str(tmp_path / "s.json")]
    assert cli.main(argv, settings=settings, device=torch.device(DEVICE)) == 0
    table = cache.read_table(table_file(out))
    picked = table.entries["stable/fp16/e16/bool/s1024/decode"]["configs"]["decode"]
    # The timer prices tiles, not depths: on a GPU the decode space adds 3 and 4 stages (space_for),
    # which tie with the 1-stage config, so any depth of the fastest tile is a right pick.
    assert {k: v for k, v in picked.items() if k != "num_stages"} == {
        k: v for k, v in cfg_dict(16, 32).items() if k != "num_stages"}


@pytest.mark.launches_kernels
def test_precompile_workers_run_decode_candidates():
    """The worker side of a round (called in-process here): warming and the length-one probe
    launch the decode kernels for a decode bucket."""
    from flash_inductor.autotune.precompile import _encode, probe_lengths_of_one, warm

    configs = builtin_configs(torch.float16, 16)
    key = "stable/fp16/e16/causal/s128/decode"
    assert warm(key, _encode(configs), _encode(configs), (1, 4, 3, 67, 2), (1, 4, 2, 32, 2), DEVICE) is None
    assert probe_lengths_of_one(key, _encode(configs), DEVICE) is None
