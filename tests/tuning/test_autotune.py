"""Tuning tables and the autotuner, on CPU.

The search runs the real kernels under the Triton interpreter on tiny problems, with an injected
timer (the interpreter's speed says nothing about a GPU's): what is tested is the logic — the
fastest accurate candidate wins, a wrong or unstable candidate never does, the heuristic stays
unless beaten — and the command line. The tables themselves (keys, files, validity, lookup, and
that a table changes the configs the launcher passes) are tested in test_tuning_tables.py.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time
import types

import pytest
import torch

from flash_inductor import launch
from flash_inductor.autotune import cli
from flash_inductor.tuning import cache
from flash_inductor.tuning.buckets import Bucket, bucket_for, length_hint, mask_kind, seq_bucket
from flash_inductor.tuning.configs import KernelConfig
from flash_inductor.autotune.measure import LaunchRunner, Shape, Verdict
from flash_inductor.autotune.plan import COPY, SHORTLIST, SWEEP, Grid, PlannedBucket, make_plan
from flash_inductor.autotune import precompile, search
from flash_inductor.autotune.precompile import ParallelPrecompiler, RoundReport, _encode, probe_lengths_of_one, warm
from flash_inductor.schedules import SCHEDULES, schedules_markdown_table
from flash_inductor.autotune.search import BucketTask, Measurement, Tuner, incumbent_configs
from flash_inductor.tuning.footprint import DeviceLimits, TileBytes, fits, smem_bytes
from flash_inductor.autotune.search_space import SearchSpace, shape_candidates
from helpers import DEVICE
from tuning_helpers import (  # noqa: F401  (isolated_tables: an autouse fixture)
    ROOT, INTERPRETER_CONFIGS, isolated_tables, cfg_dict, tiny_settings, builtin_configs, cost_key, table_file,
    timer_from, run_plan,
)


# ------------------------------------------------------------------------------------------
# The search
# ------------------------------------------------------------------------------------------


@pytest.mark.launches_kernels
def test_search_picks_the_fastest_candidate():
    bucket = Bucket("stable", "fp16", 16, "none", 128, "forward")
    heuristic = builtin_configs(torch.float16, 16)
    timer = timer_from({("forward", 32, 16, 4): 2.0, ("forward", 16, 32, 4): 3.0,
                         cost_key("forward", heuristic): 8.0})
    task = run_plan([PlannedBucket(bucket, SWEEP)], tiny_settings(timer))[bucket]
    entry = task.entry
    assert entry["configs"] == {"forward": cfg_dict(32, 16)}
    assert entry["runner_up"]["configs"] == {"forward": cfg_dict(16, 32)}
    assert entry["heuristic"]["configs"] == {"forward": heuristic.forward.to_dict()}
    assert entry["speedup_vs_heuristic"] == pytest.approx(8.0 / 2.0)
    assert 0 <= entry["error_ratio"] <= 1 and entry["candidates"] == 5  # 4 shapes + the heuristic
    # FLOP model: 4·B·H·L·S·E at the (capped) timing shape, per second.
    shape = tiny_settings(timer).timing_shape(bucket)
    assert entry["tflops"] == pytest.approx(4 * shape.batch * shape.heads * 32 * 32 * 16 / 2e-3 / 1e12)
    assert [c["block_m"] for c in entry["ranking"]["forward"]] == [32, 16]


def test_heuristic_kept_unless_beaten_by_min_gain():
    bucket = Bucket("stable", "fp16", 16, "none", 128, "forward")
    task = BucketTask(PlannedBucket(bucket, SWEEP), INTERPRETER_CONFIGS)
    faster = dataclasses.replace(INTERPRETER_CONFIGS, forward=KernelConfig(32, 16, 4, 1))
    task.measured[task.key(INTERPRETER_CONFIGS)] = Measurement(INTERPRETER_CONFIGS, Verdict(True), 1.000)
    task.measured[task.key(faster)] = Measurement(faster, Verdict(True), 0.995)  # 0.5%: noise
    assert task.best(min_gain=0.01).configs == INTERPRETER_CONFIGS
    task.measured[task.key(faster)].ms = 0.95  # 5%: a real gain
    assert task.best(min_gain=0.01).configs == faster


def test_an_incumbent_is_kept_unless_beaten_by_min_gain_and_a_rejected_one_is_not():
    """A re-tune's incumbent (the entry it would replace) is the baseline in place of the heuristic."""
    bucket = Bucket("stable", "fp16", 16, "none", 128, "forward")
    incumbent = dataclasses.replace(INTERPRETER_CONFIGS, forward=KernelConfig(16, 32, 2, 1))
    faster = dataclasses.replace(INTERPRETER_CONFIGS, forward=KernelConfig(32, 16, 4, 1))
    task = BucketTask(PlannedBucket(bucket, SWEEP), INTERPRETER_CONFIGS, incumbent)
    task.measured[task.key(INTERPRETER_CONFIGS)] = Measurement(INTERPRETER_CONFIGS, Verdict(True), 1.003)
    task.measured[task.key(incumbent)] = Measurement(incumbent, Verdict(True), 1.000)
    task.measured[task.key(faster)] = Measurement(faster, Verdict(True), 0.995)  # 0.5 %: noise
    assert task.baseline().configs == incumbent and task.best(min_gain=0.01).configs == incumbent
    task.measured[task.key(faster)].ms = 0.95  # 5 %: a real gain
    assert task.best(min_gain=0.01).configs == faster
    # Rejected (the checks, or the length-one probe): the heuristic is the baseline again.
    task.measured[task.key(faster)].ms = 1.000
    task.measured[task.key(incumbent)] = Measurement(incumbent, Verdict(False, reason="probe"), None)
    assert task.baseline().configs == INTERPRETER_CONFIGS
    assert task.best(min_gain=0.01).configs == INTERPRETER_CONFIGS  # 0.3 % ahead of it: noise


def test_incumbent_configs_come_from_an_entry_of_the_same_roles_only():
    heuristic = INTERPRETER_CONFIGS
    entry = {"configs": {"backward_dkdv": cfg_dict(32, 16), "backward_dq": cfg_dict(16, 32, 8, 2)}}
    got = incumbent_configs(heuristic, ("backward_dkdv", "backward_dq"), entry)
    assert got == dataclasses.replace(heuristic, backward_dkdv=KernelConfig(32, 16, 4, 1),
                                      backward_dq=KernelConfig(16, 32, 8, 2))
    assert incumbent_configs(heuristic, ("forward",), entry) is None  # another pass's entry
    assert incumbent_configs(heuristic, ("forward",), None) is None
    assert incumbent_configs(heuristic, ("forward",), {"configs": {"forward": {"block_m": 16}}}) is None


@pytest.mark.launches_kernels
@pytest.mark.parametrize("challenger_ms,winner", [(1.99, "incumbent"), (1.5, "challenger")])
def test_the_search_races_the_incumbent_and_records_it(challenger_ms, winner):
    bucket = Bucket("stable", "fp16", 16, "none", 128, "forward")
    heuristic = builtin_configs(torch.float16, 16)
    # The incumbent (2 warps) is outside the sweep's space (4 warps): only the incumbent rule times it.
    timer = timer_from({("forward", 16, 32, 2): 2.0, ("forward", 32, 16, 4): challenger_ms,
                         cost_key("forward", heuristic): 8.0})
    tuner = Tuner(DEVICE, tiny_settings(timer))
    task = tuner.task(PlannedBucket(bucket, SWEEP), {"configs": {"forward": cfg_dict(16, 32, 2)}})
    done = {}
    assert tuner.run([task], done) == []
    entry = done[bucket].entry
    expected = cfg_dict(16, 32, 2) if winner == "incumbent" else cfg_dict(32, 16)
    assert entry["configs"] == {"forward": expected}
    assert entry["incumbent"] == {"configs": {"forward": cfg_dict(16, 32, 2)}, "ms": 2.0, "rejected": None}
    assert entry["speedup_vs_incumbent"] == pytest.approx(2.0 / (2.0 if winner == "incumbent" else challenger_ms))
    assert entry["speedup_vs_heuristic"] == pytest.approx(8.0 / entry["ms"])


def test_sweep_tries_the_depths_of_every_near_tied_shape():
    """The depth round covers the best shape and each shape within depth_margin of it: at a near
    tie, a deeper pipeline of the runner-up may be the real winner."""
    bucket = Bucket("stable", "fp16", 16, "none", 128, "forward")
    space = SearchSpace("tiny", (16, 32), (16, 32), (4,), (1, 2))
    tuner = Tuner(DEVICE, tiny_settings(None, space=space, depth_margin=0.05))
    task = tuner.task(PlannedBucket(bucket, SWEEP))
    assert tuner.start(task, {})
    shapes = [c.forward for c in tuner.next_candidates(task)]
    ms = {shape: 2.0 + i for i, shape in enumerate(shapes)}  # all far behind ...
    best, tied, behind = sorted({s for s in shapes if s != task.heuristic.forward}, key=shapes.index)[:3]
    ms.update({best: 1.00, tied: 1.03, behind: 1.06})  # ... but these: 3 % and 6 % off the best
    for shape in shapes:
        configs = dataclasses.replace(task.heuristic, forward=shape)
        task.measured[task.key(configs)] = Measurement(configs, Verdict(True), ms[shape])
    deeper = {c.forward for c in tuner.next_candidates(task)}
    other_depths = {dataclasses.replace(s, num_stages=n) for s in (best, tied) for n in space.stages if n != s.num_stages}
    assert deeper == other_depths and len(deeper) == 2


class _BrokenRunner(LaunchRunner):
    """Kernels that go wrong for one tile shape: off by a little, or non-finite on large logits."""

    def __init__(self, mode: str):
        self.mode = mode

    def forward(self, p, configs, schedule):
        out, lse = super().forward(p, configs, schedule)
        if configs.forward.block_m == 32 and configs.forward.block_n == 16:
            if self.mode == "inaccurate":
                out = out + 0.01 * out.abs().max()  # a few fp16 ulps at |out| ~ 1: past the budget
            elif self.mode == "unstable" and p.q.abs().max() > 20:  # only the x50-logit probe
                out = out.masked_fill(torch.ones_like(out, dtype=torch.bool), float("nan"))
        return out, lse


@pytest.mark.launches_kernels
@pytest.mark.parametrize("mode,reason", [("inaccurate", "out error"), ("unstable", "probe large_logits")])
def test_accuracy_filter_rejects_a_broken_fast_candidate(mode, reason):
    bucket = Bucket("stable", "fp16", 16, "none", 128, "forward")
    timer = timer_from({("forward", 32, 16, 4): 1.0, ("forward", 16, 32, 4): 3.0})
    settings = tiny_settings(timer, runner=_BrokenRunner(mode))
    task = run_plan([PlannedBucket(bucket, SWEEP)], settings)[bucket]
    assert task.entry["configs"] == {"forward": cfg_dict(16, 32)}  # the broken, "fastest" one lost
    rejected = [r for r in task.entry["rejected"] if r["configs"] == {"forward": cfg_dict(32, 16)}]
    assert len(rejected) == 1 and reason in rejected[0]["reason"], task.entry["rejected"]


@pytest.mark.launches_kernels
def test_backward_tunes_dkdv_then_dq_and_shortlists_follow_the_sweep():
    """Backward coordinate search (fp32 keeps the probes few), then a causal shortlist seeded by it."""
    sweep = Bucket("stable", "fp32", 16, "none", 128, "backward")
    causal = sweep.replace(mask="causal")
    heuristic = builtin_configs(torch.float32, 16)
    timer = timer_from({("backward_dkdv", 16, 32, 4): 1.0, ("backward_dq", 16, 32, 4): 1.0,
                         cost_key("backward_dkdv", heuristic): 5.0, cost_key("backward_dq", heuristic): 5.0})
    settings = tiny_settings(timer, space=SearchSpace("tiny", (16,), (16, 32), (4,), (1,)),
                              check_shape=Shape(1, 1, 33, 33), max_timing_seq=16)
    done = run_plan([PlannedBucket(sweep, SWEEP), PlannedBucket(causal, SHORTLIST, sweep)], settings)
    want = {"backward_dkdv": cfg_dict(16, 32), "backward_dq": cfg_dict(16, 32)}
    assert done[sweep].entry["configs"] == want
    assert done[causal].entry["configs"] == want and done[causal].entry["mode"] == SHORTLIST
    assert done[sweep].entry["speedup_vs_heuristic"] == pytest.approx(10.0 / 2.0)


@pytest.mark.launches_kernels
def test_precompile_worker_runs_every_problem_shape():
    bucket = Bucket("stable", "fp16", 16, "causal", 128, "forward")
    settings = tiny_settings(None)
    configs = dataclasses.replace(INTERPRETER_CONFIGS, forward=KernelConfig(32, 16, 4, 1))
    assert warm(bucket.key(), _encode(INTERPRETER_CONFIGS), _encode(configs), (1, 2, 37, 37),
                dataclasses.astuple(settings.timing_shape(bucket)), DEVICE) is None
    assert probe_lengths_of_one(bucket.key(), _encode(configs), DEVICE) is None
    # Through the pool (spawned processes, as on the GPU): the same job, deduplicated across lengths.
    pool = ParallelPrecompiler(1, DEVICE, settings)
    try:
        report = pool([(bucket, INTERPRETER_CONFIGS, configs), (bucket.replace(seq=256), INTERPRETER_CONFIGS, configs)],
                      [(bucket, configs)])
        assert report == RoundReport(warm_errors=0, probe_failures=[None]) and not pool.broken
    finally:
        pool.close()


@pytest.mark.launches_kernels
def test_length_one_probe_names_the_lengths_that_fail(monkeypatch):
    """A candidate that raises, or returns non-finite values, only when a length is 1 (the
    kernels Triton specialises on it) fails the probe, which names the lengths."""
    bucket = Bucket("stable", "fp16", 16, "none", 128, "backward")

    class FailsAtLengthOne(LaunchRunner):
        def backward(self, p, out, lse, configs, schedule):
            grads = super().backward(p, out, lse, configs, schedule)
            if p.k.shape[-2] == 1:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            if p.q.shape[-2] == 1:
                grads = (grads[0] * float("nan"), *grads[1:])
            return grads

    monkeypatch.setattr(precompile, "LaunchRunner", FailsAtLengthOne)
    failure = probe_lengths_of_one(bucket.key(), _encode(INTERPRETER_CONFIGS), DEVICE)
    assert failure.startswith("RuntimeError at L=7, S=1: CUDA error: an illegal memory access")

    monkeypatch.setattr(precompile, "LENGTHS_OF_ONE", ((1, 7),))
    assert probe_lengths_of_one(bucket.key(), _encode(INTERPRETER_CONFIGS), DEVICE) == "non-finite dq at L=1, S=7"


def test_a_failed_probe_is_confirmed_alone_before_it_rejects(monkeypatch):
    """After a fault, the worker's later probes fail too: only a probe that fails again alone,
    in a fresh process, rejects its configs; the pool is replaced either way. A verdict holds for
    later rounds and other lengths of the same kernels, which are not probed again (each probe
    costs compiles; a re-tune of 21 buckets on the H200 spent 327 of 373 s compiling)."""
    bucket = Bucket("stable", "fp16", 16, "none", 128, "forward")
    faulty, poisoned, fine = (dataclasses.replace(INTERPRETER_CONFIGS, forward=KernelConfig(bm, 16, 4, 1))
                              for bm in (16, 32, 64))
    pool = ParallelPrecompiler(2, DEVICE, tiny_settings(None))
    in_workers = {faulty: "RuntimeError at L=7, S=1: CUDA error", poisoned: "RuntimeError at L=7, S=1: CUDA error"}

    class Done:
        def __init__(self, result):
            self._result = result

        def result(self):
            return self._result

    class FakeExecutor:
        def submit(self, fn, bucket_key, *args):
            submitted.append(fn)
            if fn is warm:
                return Done("RuntimeError: CUDA error")  # a job after the fault, in the poisoned worker
            return Done(in_workers.get(precompile._decode(args[0])))

        def shutdown(self, **kwargs):
            closed.append(True)

    closed, alone, submitted = [], [], []

    def probe_alone(b, configs):
        alone.append(configs)
        return "RuntimeError at L=7, S=1: CUDA error" if configs == faulty else None

    pool._pool = FakeExecutor()
    monkeypatch.setattr(pool, "_probe_alone", probe_alone)
    report = pool([(bucket, INTERPRETER_CONFIGS, fine)],
                  [(bucket, faulty), (bucket, poisoned), (bucket, fine), (bucket.replace(seq=1024), faulty)])
    assert report.warm_errors == 1
    assert report.probe_failures == ["length one: RuntimeError at L=7, S=1: CUDA error", None, None,
                                     "length one: RuntimeError at L=7, S=1: CUDA error"]
    assert alone == [faulty, poisoned] and closed and pool._pool is None and not pool.broken

    pool._pool = FakeExecutor()
    submitted.clear()
    report = pool([], [(bucket.replace(seq=4096), faulty), (bucket.replace(seq=4096), fine)])
    assert report.probe_failures == ["length one: RuntimeError at L=7, S=1: CUDA error", None]
    assert probe_lengths_of_one not in submitted and alone == [faulty, poisoned]


@pytest.mark.launches_kernels
def test_a_pick_that_fails_at_length_one_gives_way_to_the_next_best():
    """The search's pick is probed at lengths of 1 before it becomes the entry; when it fails,
    it is rejected with the reason and the next best is probed and picked."""
    bucket = Bucket("stable", "fp16", 16, "none", 128, "forward")
    timer = timer_from({("forward", 32, 16, 4): 1.0, ("forward", 16, 32, 4): 3.0})
    heuristic = builtin_configs(torch.float16, 16)
    faulty = dataclasses.replace(heuristic, forward=KernelConfig(32, 16, 4, 1)).forward
    probed = []

    def precompile_round(jobs, probes):
        probed.extend(configs.forward for _, configs in probes)
        return RoundReport(warm_errors=0, probe_failures=[
            "length one: RuntimeError at L=7, S=1: CUDA error" if configs.forward == faulty else None
            for _, configs in probes])

    tuner = Tuner(DEVICE, tiny_settings(timer), precompile=precompile_round)
    done: dict[Bucket, BucketTask] = {}
    assert tuner.run([tuner.task(PlannedBucket(bucket, SWEEP))], done) == []
    entry = done[bucket].entry
    assert probed == [faulty, KernelConfig(16, 32, 4, 1)]
    assert entry["configs"] == {"forward": cfg_dict(16, 32)}
    assert {"configs": {"forward": cfg_dict(32, 16)}, "reason": "length one: RuntimeError at L=7, S=1: CUDA error"} \
        in entry["rejected"]
    assert tuner.stats["rejected"] >= 1


@pytest.mark.launches_kernels
def test_a_spent_budget_still_probes_the_measured_pick(monkeypatch):
    """When the budget runs out after a search's last round, its pick is still probed and
    written: dropping the probe would throw the measured search away (a GPU run once
    lost every sweep of its last round that way). Nothing new is measured after the budget."""
    buckets = [Bucket("stable", "fp16", 16, mask, 128, "forward") for mask in ("none", "causal")]
    # A clock that stands still until the first round's last candidate is measured, then passes
    # the deadline: the budget runs out exactly between the search's last round and its probe.
    clock, first_round = [0.0], []
    monkeypatch.setattr(search, "time", types.SimpleNamespace(monotonic=lambda: clock[0],
                                                              perf_counter=time.perf_counter))
    measured = timer_from({("forward", 32, 16, 4): 1.0})

    def timer(run, configs):
        ms = measured(run, configs)
        first_round[1] -= 1
        if first_round[1] == 0:
            clock[0] = 100.0
        return ms

    probed = []

    def precompile_round(jobs, probes):
        if not first_round:
            first_round.extend([len(jobs), len(jobs)])
        probed.extend(b.key() for b, _ in probes)
        return RoundReport(warm_errors=0, probe_failures=[None] * len(probes))

    tuner = Tuner(DEVICE, tiny_settings(timer, tasks_per_round=1), precompile=precompile_round)
    done: dict[Bucket, BucketTask] = {}
    left = tuner.run([tuner.task(PlannedBucket(b, SWEEP)) for b in buckets], done, deadline=50.0)
    assert probed == [buckets[0].key()]
    assert done[buckets[0]].entry["configs"] == {"forward": cfg_dict(32, 16)}
    assert [t.bucket for t in left] == [buckets[1]] and buckets[1] not in done


# ------------------------------------------------------------------------------------------
# Plan and search space
# ------------------------------------------------------------------------------------------


def test_plan_sweeps_once_per_width_pass_and_operand_widths_and_copies_identical_kernels():
    grid = Grid(("stable", "fast", "accurate"), ("bf16", "fp16"), (64, 128), ("none", "causal"), (1024, 4096))
    plan = make_plan(grid)
    by_key = {p.bucket.key(): p for p in plan}
    sweeps = [p.bucket.key() for p in plan if p.kind == SWEEP]
    # `accurate` holds P and dS in fp32: its tiles are wider than the default's, so it sweeps for
    # itself (after the default schedule's sweeps); `fast` has the default's tiles and races them.
    assert sweeps == ["stable/bf16/e64/none/s4096/forward", "stable/bf16/e64/none/s4096/backward",
                      "stable/bf16/e128/none/s4096/forward", "stable/bf16/e128/none/s4096/backward",
                      "accurate/bf16/e64/none/s4096/forward", "accurate/bf16/e64/none/s4096/backward",
                      "accurate/bf16/e128/none/s4096/forward", "accurate/bf16/e128/none/s4096/backward"]
    assert plan[: len(sweeps)] == [by_key[k] for k in sweeps]  # sweeps first: they seed the rest
    # fast == stable in the forward; their 16-bit backwards differ (exact Δ, and the fp16 dS rescale).
    assert by_key["fast/fp16/e64/causal/s1024/forward"].kind == COPY
    assert by_key["fast/bf16/e64/none/s4096/backward"].kind == SHORTLIST
    assert by_key["fast/fp16/e64/none/s4096/backward"].kind == SHORTLIST
    assert by_key["fast/bf16/e64/none/s4096/backward"].source == Bucket.parse(sweeps[1])
    assert by_key["accurate/fp16/e64/causal/s1024/forward"].source == Bucket.parse(sweeps[4])
    assert by_key["accurate/fp16/e128/none/s4096/backward"].source == Bucket.parse(sweeps[7])
    assert len(plan) == len(grid.buckets())
    order = [p.bucket for p in plan]
    for p in plan:
        if p.source is not None:
            assert order.index(p.source) < order.index(p.bucket)


def test_search_space_prunes_what_cannot_fit():
    h200 = DeviceLimits(smem_bytes=232448)
    bf16 = TileBytes(width=128, itemsize=2, p_itemsize=2, ds_itemsize=2, mask_itemsize=0)
    assert fits("forward", KernelConfig(128, 64, 8, 3), bf16, h200)  # the heuristic's own config
    assert not fits("forward", KernelConfig(128, 128, 8, 4), bf16, h200)  # 4 stages of 128-key K/V tiles
    assert not fits("forward", KernelConfig(128, 128, 4, 1), bf16, h200)  # 384 fp32 registers a thread
    assert not fits("forward", KernelConfig(32, 32, 8, 1), bf16, h200)  # 8 warps on a 32 x 32 tile
    exact_delta = dataclasses.replace(bf16, exact_delta=True)
    assert fits("backward_dq", KernelConfig(128, 64, 4, 1), bf16, h200)
    assert not fits("backward_dq", KernelConfig(128, 64, 4, 1), exact_delta, h200)  # + P·K's accumulator: 384
    space = SearchSpace()
    unlimited = shape_candidates("forward", space, 3, bf16, DeviceLimits(None, None))
    assert len(unlimited) == 3 * 3 * 2 - 3  # every shape but the 8-warp ones on tiles < 64 x 64
    pruned = shape_candidates("backward_dkdv", space, 2, bf16, h200)
    assert 0 < len(pruned) < len(unlimited)
    assert all(fits("backward_dkdv", c, bf16, h200) for c in pruned)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("mask", ["none", "causal", "bool", "float"])
def test_wide_head_backward_tiles_on_hopper_fit_and_stay_small_elsewhere(schedule, mask):
    from flash_inductor.tuning.configs import cuda_heuristic_configs

    sched = SCHEDULES[schedule]
    hopper = cuda_heuristic_configs((9, 0), 2, 256, 256, schedule, mask)
    small = KernelConfig(32, 32, 4, 1)
    # Ampere keeps the small tiles whatever the schedule, and so do fp32 inputs there; fp32 on Hopper
    # has tiles of its own (configs._HOPPER_FP32_TILES: small tiles over eight warps, against the
    # tuner's rule for MMA tiles, since its products run on the CUDA cores), which fit in shared
    # memory beside the widest mask tile.
    h200 = DeviceLimits(smem_bytes=232448)
    assert cuda_heuristic_configs((8, 0), 2, 256, 256, schedule, mask).backward_dq == small
    assert cuda_heuristic_configs((8, 0), 4, 256, 256, schedule, mask).backward_dkdv == KernelConfig(16, 32, 4, 1)
    fp32 = cuda_heuristic_configs((9, 0), 4, 256, 256, schedule, mask)
    fp32_tiles = TileBytes(256, 4, 4, 4, 4, exact_delta=False)
    assert all(smem_bytes(role, getattr(fp32, role), fp32_tiles) <= h200.smem_bytes
               for role in ("forward", "backward_dkdv", "backward_dq"))
    if sched.p_in_fp32 or sched.ds_in_fp32:  # tf32x3 operands were not measured with larger tiles
        assert (hopper.backward_dkdv, hopper.backward_dq) == (small, small)
        return
    tiles = TileBytes(256, 2, 2, 2, {"bool": 1, "float": 4}.get(mask, 0), exact_delta=sched.exact_delta)
    assert hopper.backward_dkdv == KernelConfig(64, 32, 4, 2)
    assert fits("backward_dkdv", hopper.backward_dkdv, tiles, h200)
    wide_dq = KernelConfig(64, 64, 8, 2) if sched.exact_delta else KernelConfig(128, 32, 8, 2)
    if mask == "float":  # an fp32 mask tile does not fit beside the wide dQ tiles: the small one stays
        assert not fits("backward_dq", wide_dq, tiles, h200) and hopper.backward_dq == small
    else:
        assert hopper.backward_dq == wide_dq and fits("backward_dq", wide_dq, tiles, h200)


# ------------------------------------------------------------------------------------------
# Buckets
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seq_q,seq_k,bucket", [(1, 1, 128), (128, 64, 128), (129, 1, 256), (4096, 4096, 4096),
                                                (100, 5000, 8192), (10**6, 1, 65536)])
def test_seq_bucket(seq_q, seq_k, bucket):
    assert seq_bucket(seq_q, seq_k) == bucket


def test_bucket_mapping():
    q = torch.empty(0, dtype=torch.float16)
    assert mask_kind(None, False) == "none" and mask_kind(None, True) == "causal"
    assert mask_kind(torch.ones(2, dtype=torch.bool), False) == "bool"
    assert mask_kind(torch.zeros(2, dtype=q.dtype), True) == "float"  # an explicit mask decides
    b = bucket_for("accurate", torch.bfloat16, 128, "causal", 3000, 17, "backward")
    assert b.key() == "accurate/bf16/e128/causal/s4096/backward" and Bucket.parse(b.key()) == b
    assert bucket_for("stable", torch.float64, 64, "none", 8, 8, "forward") is None  # never tuned
    for bad in ("stable/fp16/128/none/s128/forward", "stable/fp8/e128/none/s128/forward", "x"):
        with pytest.raises(ValueError, match="bucket key|unknown"):
            Bucket.parse(bad)


class _Node:
    def __init__(self, hint):
        self._hint = hint

    def has_hint(self):
        return self._hint is not None

    @property
    def hint(self):
        return self._hint


class _SymIntLike:
    def __init__(self, hint):
        self.node = _Node(hint)


def test_symbolic_lengths_use_their_hint_without_a_guard():
    assert length_hint(_SymIntLike(3000)) == 3000
    assert length_hint(_SymIntLike(None), default=4096) == 4096  # unbacked: the default bucket
    assert seq_bucket(_SymIntLike(3000), _SymIntLike(None)) == 4096

    from torch.fx.experimental.proxy_tensor import make_fx

    seen = []

    def bucketed(x, y):
        seen.append(seq_bucket(x.shape[0], y.shape[0]))
        return x.sum() + y.sum()

    def guarded(x, y):
        seen.append(int(x.shape[0]))  # control: int() on a SymInt does install a guard
        return x.sum()

    def guards(fn):
        gm = make_fx(fn, tracing_mode="symbolic")(torch.randn(3000), torch.randn(100))
        size = next(n for n in gm.graph.nodes if n.op == "placeholder").meta["val"].shape[0]
        assert isinstance(size, torch.SymInt)
        return size.node.shape_env.guards

    assert guards(bucketed) == [] and seen[0] == 4096
    assert guards(guarded) != []


# ------------------------------------------------------------------------------------------
# The command line: table, summary, time budget and resume
# ------------------------------------------------------------------------------------------


@pytest.mark.launches_kernels
def test_cli_writes_table_and_summary_and_resumes(tmp_path, capsys):
    calls = []
    timer = timer_from({("forward", 32, 16, 4): 2.0}, calls=calls)
    settings = tiny_settings(timer, space=SearchSpace("tiny", (16, 32), (16,), (4,), (1,)), tasks_per_round=1)
    out = tmp_path / "tables"
    argv = ["--dtypes", "fp16", "--head-dims", "16", "--masks", "none,causal", "--schedules", "stable",
            "--passes", "forward", "--seqs", "4096", "--out", str(out), "--summary", str(tmp_path / "s.json")]
    # A budget this small bounds the first round too: at most one candidate, and nothing is saved.
    assert cli.main(argv + ["--time-budget", "1e-6"], settings=settings, device=torch.device(DEVICE)) == 0
    assert len(calls) <= 1 and cache.read_table(table_file(out)) is None
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["complete"] is False and len(summary["remaining"]) == 2
    # The sweep alone is saved; the resumed run then has the shortlist left.
    assert cli.main(argv + ["--masks", "none"], settings=settings, device=torch.device(DEVICE)) == 0
    table = cache.read_table(table_file(out))
    assert list(table.entries) == ["stable/fp16/e16/none/s4096/forward"]

    measured_before = len(calls)
    assert cli.main(argv + ["--resume"], settings=settings, device=torch.device(DEVICE)) == 0
    # Only the causal shortlist ran: the heuristic and the sweep's two best, not the sweep again.
    assert 1 <= len(calls) - measured_before <= 1 + 2
    table = cache.read_table(table_file(out))
    assert set(table.entries) == {"stable/fp16/e16/none/s4096/forward", "stable/fp16/e16/causal/s4096/forward"}
    assert table.entries["stable/fp16/e16/causal/s4096/forward"]["configs"] == {"forward": cfg_dict(32, 16)}
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["complete"] is True and all(r["tuned"] for r in summary["rows"])
    printed = capsys.readouterr().out
    assert "stable/fp16/e16/causal/s4096/forward" in printed and "TFLOP/s" in printed
    # Entries tuned in another search space (e.g. a --quick run) are tuned again, not resumed.
    measured_before = len(calls)
    other = dataclasses.replace(settings, space=dataclasses.replace(settings.space, name="other"))
    assert cli.main(argv + ["--resume"], settings=other, device=torch.device(DEVICE)) == 0
    assert len(calls) - measured_before >= 3
    assert {e["space"] for e in cache.read_table(table_file(out)).entries.values()} == {"other"}
    assert not list(pathlib.Path.cwd().glob("triton-interpreter*.json"))  # never the working directory


@pytest.mark.launches_kernels
def test_cli_ship_writes_configs_only_and_resumes_from_them(tmp_path):
    """--ship keeps what a lookup needs in the package's table and the search record in the
    summary; a resumed --ship run keeps the shipped picks instead of tuning them again."""
    calls = []
    timer = timer_from({("forward", 32, 16, 4): 2.0}, calls=calls)
    settings = tiny_settings(timer, space=SearchSpace("tiny", (16, 32), (16,), (4,), (1,)))
    argv = ["--dtypes", "fp16", "--head-dims", "16", "--masks", "none", "--schedules", "stable", "--passes",
            "forward", "--seqs", "4096", "--ship", "--summary", str(tmp_path / "s.json")]
    assert cli.main(argv, settings=settings, device=torch.device(DEVICE)) == 0
    table = cache.read_table(table_file(cache.shipped_tables_dir()))
    (entry,) = table.entries.values()
    assert set(entry) == set(cache.LOOKUP_FIELDS) and entry["configs"] == {"forward": cfg_dict(32, 16)}
    (row,) = json.loads((tmp_path / "s.json").read_text())["rows"]
    assert row["winner"] == "32x16/w4/s1" and row["ms"] == 2.0 and row["heuristic_ms"] is not None
    measured = len(calls)
    assert cli.main(argv + ["--resume"], settings=settings, device=torch.device(DEVICE)) == 0
    assert len(calls) == measured
    # Without --summary, a shipped run's summary goes to the checkout's results, not the package.
    ship = cli.parse_args(["--ship"])
    assert cli.summary_path_for(ship, cli.output_path(ship, "g"), "g").parent == ROOT / "benchmarks" / "results"


def test_cli_summary_never_overwrites_an_earlier_run_of_the_day(tmp_path):
    table = tmp_path / "g.json"
    args = cli.parse_args(["--out", str(table)])
    first = cli.summary_path_for(args, table, "g")
    assert first.parent == tmp_path and first.name.startswith("autotune_g_") and first.suffix == ".json"
    first.write_text("{}")
    second = cli.summary_path_for(args, table, "g")
    assert second.name == first.stem + "-2.json"
    second.write_text("{}")
    assert cli.summary_path_for(args, table, "g").name == first.stem + "-3.json"
    # A path given with --summary is the caller's choice: used as is.
    assert cli.summary_path_for(cli.parse_args(["--summary", str(first)]), table, "g") == first


@pytest.mark.launches_kernels
def test_cli_races_the_incumbents_of_a_table_of_this_gpu(tmp_path, capsys):
    timer = timer_from({("forward", 32, 16, 4): 2.0, ("forward", 16, 32, 2): 2.01})
    settings = tiny_settings(timer, space=SearchSpace("tiny", (16, 32), (16,), (4,), (1,)))
    key = "stable/fp16/e16/none/s4096/forward"
    gpu = cli.INTERPRETER_GPU_KEY if launch.interpreter_enabled() else cache.device_gpu_key(torch.device(DEVICE))
    old = tmp_path / "old.json"
    cache.update_table(old, cache.TuningTable.for_current_code(gpu, {key: {"configs": {"forward": cfg_dict(16, 32, 2)}}}))
    out = tmp_path / "tables"
    argv = ["--dtypes", "fp16", "--head-dims", "16", "--masks", "none", "--schedules", "stable", "--passes",
            "forward", "--seqs", "4096", "--out", str(out), "--summary", str(tmp_path / "s.json")]
    assert cli.main(argv + ["--incumbents", str(old)], settings=settings, device=torch.device(DEVICE)) == 0
    entry = cache.read_table(table_file(out)).entries[key]
    assert entry["configs"] == {"forward": cfg_dict(16, 32, 2)}  # 0.5 % behind the fastest: kept
    assert entry["incumbent"]["ms"] == pytest.approx(2.01)
    row = json.loads((tmp_path / "s.json").read_text())["rows"][0]
    assert row["incumbent"] == row["winner"] == "16x32/w2/s1"
    printed = capsys.readouterr().out
    assert "race an incumbent" in printed and "vs incumbent" in printed and "kept" in printed
    # A table of another GPU, or no table, stops the run before anything is measured.
    other = tmp_path / "other.json"
    cache.update_table(other, cache.TuningTable.for_current_code("other-gpu_sm80_108sm", {}))
    for path, message in ((other, "is for other-gpu"), (tmp_path / "missing.json", "no table at")):
        with pytest.raises(SystemExit, match=message):
            cli.main(argv + ["--incumbents", str(path)], settings=settings, device=torch.device(DEVICE))


def test_cli_quick_grid_and_default_output():
    args = cli.parse_args(["--quick"])
    grid = cli.make_grid(args)
    assert grid.dtypes == ("bf16",) and grid.widths == (128,) and grid.seqs == (4096,)
    assert cli.output_path(args, "g") == cache.user_cache_dir() / "g.json"
    assert cli.output_path(cli.parse_args(["--ship"]), "g") == cache.shipped_tables_dir() / "g.json"
    assert cli.make_grid(cli.parse_args(["--head-dims", "96,128,80"])).widths == (128,)
    with pytest.raises(SystemExit):
        cli.parse_args(["--seqs", "1000"])


# ------------------------------------------------------------------------------------------
# Precision schedules: the documented contract
# ------------------------------------------------------------------------------------------


def test_schedule_stages_follow_the_kernel_switches():
    tables = {name: s.stages() for name, s in SCHEDULES.items()}
    names = {tuple(stage.name for stage in stages) for stages in tables.values()}
    assert len(names) == 1  # the same stages, in the same order, for every schedule
    for name, schedule in SCHEDULES.items():
        rows = {stage.name: stage.dtype for stage in tables[name]}
        assert rows["P for P·V"].startswith("fp32") == schedule.p_in_fp32
        assert rows["bwd: dS for dS·K, dSᵀ·Q"].startswith("fp32") == schedule.ds_in_fp32
        assert ("scaled by 2⁻ᵏ" in rows["bwd: dS for dS·K, dSᵀ·Q"]) == schedule.ds_rescale
        assert ("corrected in the dQ pass" in rows["bwd: Δ = rowsum(dO∘O)"]) == schedule.exact_delta
        # Exact Δ corrects a 16-bit O; an fp32 O needs nothing, so fp32 kernels never pay for it.
        for dtype in (torch.float16, torch.bfloat16):
            assert launch.schedule_switches(dtype, name)["EXACT_DELTA"] == schedule.exact_delta
        assert not launch.schedule_switches(torch.float32, name)["EXACT_DELTA"]
        assert rows["S = QKᵀ"].endswith("accumulator: fp32") and rows["softmax scale"] == "fp32, on S"
    assert not SCHEDULES["fast"].exact_delta and SCHEDULES["stable"].exact_delta


def test_schedule_table_doc_is_generated_from_schedules_py():
    assert schedules_markdown_table() in (ROOT / "docs" / "precision_schedules.md").read_text()
