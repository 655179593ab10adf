"""The Gluon Hopper kernels' configs in the tuning tables and the autotuner, on CPU.

The Gluon kernels have no interpreter, so the search runs against a stand-in runner whose results
are the fp64 reference rounded to the dtype (one candidate deliberately wrong), with an injected
timer: what is tested is the logic (entries validate, lookups and the launchers' fallback, the plan,
the fastest accurate config wins). tests/unit/test_hopper_fwd.py and test_hopper_bwd.py run the
kernels themselves on the GPU at every config the launchers use.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings

import pytest
import torch

from flash_inductor.autotune.measure import ARITH_ULPS, AccuracyCheck, Shape, reference_fp64
from flash_inductor.autotune.plan import COPY, SWEEP, Grid, PlannedBucket, make_plan
from flash_inductor.autotune.precompile import _decode, _encode
from flash_inductor.launch import hopper, hopper_bwd
from flash_inductor.tuning import cache, hopper_configs
from flash_inductor.tuning.buckets import Bucket
from flash_inductor.tuning.configs import select_hopper_backward_config, select_hopper_forward_config
from flash_inductor.tuning.hopper_configs import HopperBackwardConfig, HopperForwardConfig
from tuning_helpers import isolated_tables, run_plan, tiny_settings  # noqa: F401  (an autouse fixture)

FWD = {"num_consumers": 2, "block_n": 64, "num_stages": 4, "pingpong": False}
BWD = {"num_stages": 3, "dq_split": True, "dq_tma": False, "row_stats_tma": True}
H200_SMEM = 232448


def _table(**entries) -> cache.TuningTable:
    return cache.TuningTable.for_current_code("fake-gpu_sm90_132sm",
                                              {key.replace("__", "/"): entry for key, entry in entries.items()})


def test_gluon_entries_validate_field_by_field():
    good = {"configs": {"gluon_forward": FWD}, "kernel": "x", "triton": "3.6.0"}
    bad = {
        "stable/bf16/e64/causal/s4096/gluon_forward": {**good, "configs": {"gluon_forward": {**FWD, "num_consumers": 5}}},
        "stable/bf16/e64/causal/s8192/gluon_forward": {**good, "configs": {"gluon_forward": {**FWD, "pingpong": 1}}},
        "stable/bf16/e64/causal/s1024/gluon_forward": {**good, "configs": {"gluon_forward": {"num_stages": 2}}},
        "stable/bf16/e64/causal/s2048/gluon_forward": {**good, "configs": {"forward": FWD}},
        "stable/bf16/e64/causal/s4096/gluon_backward": {**good, "configs": {"gluon_backward": {**BWD, "dq_tma": "no"}}},
    }
    table = cache.TuningTable.from_json({"schema": cache.SCHEMA_VERSION, "gpu": "g", "entries": {
        "stable/bf16/e64/causal/s16384/gluon_forward": good,
        "stable/bf16/e64/none/s4096/gluon_backward": {**good, "configs": {"gluon_backward": BWD}},
        **bad}})
    assert set(table.entries) == {"stable/bf16/e64/causal/s16384/gluon_forward", "stable/bf16/e64/none/s4096/gluon_backward"}
    assert set(table.dropped) == set(bad)
    assert "num_consumers=5" in table.dropped["stable/bf16/e64/causal/s4096/gluon_forward"]
    assert "pingpong=1" in table.dropped["stable/bf16/e64/causal/s8192/gluon_forward"]
    assert "dq_tma='no'" in table.dropped["stable/bf16/e64/causal/s4096/gluon_backward"]


def test_forward_entries_from_before_the_persistent_field_read_as_not_persistent():
    """Tables written before ``persistent`` joined the search space hold entries without it: they
    were tuned on the grid schedule and read as such; a stored ``persistent`` must be a bool."""
    legacy = {k: v for k, v in FWD.items() if k != "persistent"}
    assert hopper_configs.config_problem("gluon_forward", legacy) is None
    assert hopper_configs.config_from_dict("gluon_forward", legacy).persistent is False
    assert hopper_configs.config_from_dict("gluon_forward_exact", {**legacy, "persistent": True}).persistent is True
    assert "persistent=1" in hopper_configs.config_problem("gluon_forward", {**legacy, "persistent": 1})
    assert hopper_configs.config_problem("gluon_backward", {**BWD, "persistent": False}) is not None


def test_backward_entries_from_before_paired_tiles_read_as_unpaired_and_e128_pairs_fall_back():
    """Backward entries written before ``paired_tiles`` joined the search space were tuned one
    tile an iteration and read as such. An entry pairing tiles at E 128 (which cannot compile
    there) is not taken: the built-in config runs."""
    assert hopper_configs.config_from_dict("gluon_backward", BWD).paired_tiles is False
    assert "paired_tiles=1" in hopper_configs.config_problem("gluon_backward", {**BWD, "paired_tiles": 1})
    paired = {**BWD, "paired_tiles": True}
    table = _table(stable__bf16__e64__causal__s4096__gluon_backward={"configs": {"gluon_backward": paired}},
                   stable__bf16__e128__causal__s4096__gluon_backward={"configs": {"gluon_backward": paired}})
    with cache.override_table(table):
        for width, tuned in ((64, True), (128, False)):
            query = torch.empty(2, 16, 4096, width, dtype=torch.bfloat16)
            config, was_tuned = select_hopper_backward_config(query, 4096, is_causal=True, key_mask=False,
                                                              schedule="stable")
            assert was_tuned is tuned and config.paired_tiles is tuned
            assert config.label().endswith("/paired") is tuned


def test_the_forward_smem_estimate_matches_the_compiled_kernels():
    """Within 1 KiB of what ptxas reported for sm_90a (docs/hopper_forward.md, Compile): 164 KiB at
    E 128 (2 consumers, 2 stages of 128 keys), 123 KiB at E 64 (3 consumers, 3 stages); and E 128's
    third stage does not fit, which is why it ships two."""
    e128 = HopperForwardConfig(num_consumers=2, num_stages=2, block_n=128)
    e64 = HopperForwardConfig(num_consumers=3, num_stages=3, block_n=128)
    assert abs(hopper_configs.smem_bytes("gluon_forward", e128, 128, 2) - 164 * 1024) <= 1024
    assert abs(hopper_configs.smem_bytes("gluon_forward", e64, 64, 2) - 123 * 1024) <= 1024
    deeper = dataclasses.replace(e128, num_stages=3)
    assert hopper_configs.smem_bytes("gluon_forward", deeper, 128, 2) > H200_SMEM
    bucket = Bucket("stable", "bf16", 128, "causal", 4096, "gluon_forward")
    found = hopper_configs.candidates("gluon_forward", bucket, H200_SMEM)
    assert found[0] == hopper_configs.default_for_bucket("gluon_forward", bucket)  # the built-in first
    assert deeper not in found and dataclasses.replace(deeper, block_n=64) in found
    # The backward: paired tiles only at E 64 (at E 128 a pair runs out of registers).
    backward = bucket.replace(pass_name="gluon_backward")
    assert len(hopper_configs.candidates("gluon_backward", backward, None)) == 16
    assert not any(config.paired_tiles for config in hopper_configs.candidates("gluon_backward", backward, None))
    at_e64 = hopper_configs.candidates("gluon_backward", backward.replace(width=64), None)
    assert len(at_e64) == 32 and sum(config.paired_tiles for config in at_e64) == 16
    # Persistent CTAs stage O apart: compiled, 197,120 bytes at E 128 and 148,088 at E 64 (above);
    # the estimate stays above them, by less than 4 KiB.
    for config, width, compiled in ((e128, 128, 197_120), (e64, 64, 148_088)):
        estimate = hopper_configs.smem_bytes("gluon_forward", dataclasses.replace(config, persistent=True), width, 2)
        assert 0 <= estimate - compiled < 4096


def test_lookups_take_the_bucket_entry_and_otherwise_the_built_in_config(caplog):
    from flash_inductor.tuning import configs as tuning_configs

    tuning_configs._log_tuned.cache_clear()
    caplog.set_level(logging.INFO, logger="flash_inductor")
    query = torch.empty(2, 16, 4096, 64, dtype=torch.bfloat16)
    table = _table(stable__bf16__e64__causal__s4096__gluon_forward={"configs": {"gluon_forward": FWD}},
                   fast__bf16__e64__none__s16384__gluon_backward={"configs": {"gluon_backward": BWD}})
    with cache.override_table(table):
        config, tuned = select_hopper_forward_config(query, 4096, is_causal=True, key_mask=False, exact_delta=False,
                                                     schedule="stable")
        assert tuned and config == HopperForwardConfig(**FWD)
        said = [r.getMessage() for r in caplog.records if "tuning table's" in r.getMessage()]
        assert said == ["flash_inductor: gluon_forward runs the tuning table's c2/n64/s4 (built-in: c3/n128/s3/pingpong) "
                        "for stable/bf16/e64/causal/gluon_forward"]
        # Another length of the same family takes the nearest tuned one; another family none.
        assert select_hopper_forward_config(query[:, :, :1000], 1000, is_causal=True, key_mask=False,
                                            exact_delta=False, schedule=None)[1]
        for kwargs in (dict(is_causal=False, key_mask=False, exact_delta=False),   # no entry without a mask
                       dict(is_causal=True, key_mask=True, exact_delta=False),     # a key mask: its own kind
                       dict(is_causal=True, key_mask=False, exact_delta=True)):    # the one-pass forward
            config, tuned = select_hopper_forward_config(query, 4096, schedule="stable", **kwargs)
            assert not tuned and config == hopper.default_config(64, True, key_mask=kwargs["key_mask"],
                                                                 exact_delta=kwargs["exact_delta"])
        config, tuned = select_hopper_backward_config(query, 4096, is_causal=False, key_mask=False, schedule="fast")
        assert tuned and config == dataclasses.replace(HopperBackwardConfig(), **BWD)
        assert select_hopper_backward_config(query, 4096, is_causal=False, key_mask=False,
                                             schedule="stable") == (hopper_bwd.default_config(64, False), False)
    assert select_hopper_forward_config(query, 4096, is_causal=True, key_mask=False, exact_delta=False,
                                        schedule="stable") == (hopper.default_config(64, True), False)  # no table


@pytest.mark.parametrize("kernel", ["forward", "backward"])
def test_a_tuned_config_that_fails_to_launch_runs_the_built_in_one(monkeypatch, kernel):
    """A table entry written for another part (or by hand) that does not launch costs one warning,
    never the call."""
    query = torch.empty(1, 2, 256, 64, dtype=torch.float16)
    tuned = {"forward": HopperForwardConfig(**FWD), "backward": dataclasses.replace(HopperBackwardConfig(), **BWD)}
    calls = []

    def fake_launch(*args, config, **kwargs):
        calls.append(config)
        if config == tuned[kernel]:
            raise RuntimeError("out of resource: shared memory, Required: 262144, Hardware limit: 232448")
        return "built-in ran"

    table = _table(**{f"fast__fp16__e64__none__s256__gluon_{kernel}": {"configs": {f"gluon_{kernel}": (
        FWD if kernel == "forward" else BWD)}}})
    with cache.override_table(table), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if kernel == "forward":
            monkeypatch.setattr(hopper, "_forward", lambda *args: fake_launch(*args[:6], config=args[6]))
            got = hopper.hopper_attention_forward(query, query, query, schedule="fast")
        else:
            monkeypatch.setattr(hopper_bwd, "_backward", fake_launch)
            got = hopper_bwd.hopper_attention_backward(query, query, query, query, query, query[..., 0])
    assert got == "built-in ran" and calls == [tuned[kernel], None]
    assert [str(w.message) for w in caught if "tuning table's Hopper" in str(w.message)], caught


def test_the_plan_holds_the_gluon_buckets_the_kernels_run():
    grid = Grid(("stable", "fast", "accurate"), ("bf16", "fp32"), (64, 256), ("none", "causal", "bool"), (4096,),
                ("gluon_forward", "gluon_forward_exact", "gluon_backward"))
    plan = {p.bucket.key(): p for p in make_plan(grid)}
    assert set(plan) == {f"{s}/bf16/e64/{m}/s4096/{p}" for m in ("none", "causal")
                         for s, p in (("stable", "gluon_forward"), ("fast", "gluon_forward"),
                                      ("stable", "gluon_forward_exact"), ("stable", "gluon_backward"),
                                      ("fast", "gluon_backward"))}
    # The forward's kernel is the same under both schedules; the backwards differ (the exact Δ).
    assert plan["fast/bf16/e64/causal/s4096/gluon_forward"].kind == COPY
    assert plan["fast/bf16/e64/causal/s4096/gluon_forward"].source.schedule == "stable"
    assert {p.kind for key, p in plan.items() if "fast" not in key or "backward" in key} == {SWEEP}


def test_precompile_jobs_carry_gluon_configs():
    from flash_inductor.autotune.search import Tuner

    bucket = Bucket("stable", "bf16", 64, "causal", 4096, "gluon_backward")
    heuristic = Tuner("cpu", tiny_settings(lambda run, c: 1.0)).heuristic(bucket)
    assert heuristic.gluon_backward == hopper_configs.default_for_bucket("gluon_backward", bucket)
    assert heuristic.gluon_forward_exact.num_consumers == 3  # E 64's built-in
    candidate = dataclasses.replace(heuristic, gluon_backward=dataclasses.replace(HopperBackwardConfig(), **BWD))
    assert _decode(_encode(candidate)) == candidate


class _ReferenceRunner:
    """Stands in for the Gluon launchers: the fp64 reference rounded to the dtype, except for one
    candidate whose output is wrong (a broken config the accuracy check must reject)."""

    def __init__(self, role: str, broken_stages: int):
        self.role, self.broken_stages = role, broken_stages

    def gluon_forward(self, p, configs, schedule, exact):
        role = "gluon_forward_exact" if exact else "gluon_forward"
        out = reference_fp64(p, "forward")["out"].to(p.q.dtype)
        if role == self.role and getattr(configs, role).num_stages == self.broken_stages:
            out = out + 0.25
        return out, None

    def gluon_saved(self, p, configs, schedule):
        return self.gluon_forward(p, configs, schedule, schedule == "stable")[0], None, {}

    def gluon_backward(self, p, saved, configs, schedule):
        grads = reference_fp64(p, "backward")
        dq = grads["dq"].to(p.q.dtype)
        if self.role == "gluon_backward" and configs.gluon_backward.num_stages == self.broken_stages:
            dq = dq * 1.5
        return dq, grads["dk"].to(p.k.dtype), grads["dv"].to(p.v.dtype)


def _timer(role, costs):
    def timer(run, configs):
        run()
        return costs(getattr(configs, role))
    return timer


@pytest.mark.parametrize("pass_name", ["gluon_forward_exact", "gluon_backward"])
def test_the_search_picks_the_fastest_accurate_gluon_config(pass_name):
    bucket = Bucket("stable", "fp16", 64, "causal", 128, pass_name)
    role = pass_name
    if pass_name == "gluon_backward":
        fastest, broken = dataclasses.replace(HopperBackwardConfig(), num_stages=2, dq_tma=False), 3
    else:
        fastest, broken = HopperForwardConfig(num_consumers=2, block_n=64, num_stages=3, pingpong=False), 4

    def cost(config):  # the broken configs (wrong results) are timed fastest: the check must reject them
        return 0.5 if config.num_stages == broken else (1.0 if config == fastest else 2.0)
    settings = tiny_settings(_timer(role, cost), runner=_ReferenceRunner(role, broken))
    task = run_plan([PlannedBucket(bucket, SWEEP)], settings)[bucket]
    entry = task.entry
    assert entry["configs"] == {role: fastest.to_dict()}
    assert entry["speedup_vs_heuristic"] == pytest.approx(2.0)
    assert entry["rejected"] and all("budget" in r["reason"] for r in entry["rejected"])
    total = len(hopper_configs.candidates(role, bucket, None))
    assert entry["candidates"] == total
    # The entry is a table entry every lookup accepts.
    table = cache.TuningTable.from_json(_table(**{bucket.key().replace("/", "__"): entry}).to_json())
    assert not table.dropped and cache.entry_is_current(bucket.key(), table.entries[bucket.key()])


@pytest.mark.parametrize("width", (64, 128))
def test_a_gradient_that_cancels_to_zero_is_held_to_fp32_rounding_not_to_zero(width):
    """With one key a row (L 7, S 1) P = 1, dS = P (dP - Δ) cancels and dK, dQ are exactly 0: any
    flash kernel's fp32 dP and Δ leave residues ~1e-6 there (the Gluon backward's picks gave
    1.3e-7 to 1.7e-6 on the H200). The budget is then fp32's rounding of the terms that cancelled:
    above those residues, and still far below one bf16 ulp of the gradients' scale."""
    bucket = Bucket("stable", "bf16", width, "none", 4096, "gluon_backward")
    check = AccuracyCheck(bucket, Shape(2, 2, 7, 1), "cpu")
    for name in ("dq", "dk"):
        assert check.reference[name].abs().max().item() == 0.0
        assert 2e-6 < check.budgets[name] < 1e-3
    # Where the gradients do not cancel, the fp32 part stays a sliver of the budget (PyTorch's error).
    ragged = AccuracyCheck(bucket.replace(mask="causal"), Shape(2, 2, 37, 45), "cpu")
    for name in ("dq", "dk", "dv"):
        fp32_part = ARITH_ULPS * torch.finfo(torch.float32).eps * ragged.reference["terms"][name]
        assert fp32_part < 0.01 * ragged.budgets[name]


def test_the_cli_says_when_the_gluon_passes_asked_for_have_no_bucket(capsys):
    from flash_inductor.autotune import cli

    grid = cli.make_grid(cli.parse_args(["--passes", "gluon_backward", "--head-dims", "256"]))
    assert grid.buckets() == []
    assert "no bucket for gluon_backward" in capsys.readouterr().out
    grid = cli.make_grid(cli.parse_args(["--passes", "gluon_backward,forward", "--head-dims", "64", "--seqs", "4096"]))
    assert any(b.pass_name == "gluon_backward" for b in grid.buckets())
    assert "no bucket" not in capsys.readouterr().out
