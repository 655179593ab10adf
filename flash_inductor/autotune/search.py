"""The autotuner's search: candidates per bucket, measured in rounds, winners as table entries.

Each planned bucket (``plan.py``) is a small state machine that proposes candidate lists:

* a sweep, per kernel role (the backward tunes dK/dV with dQ at its heuristic config, then dQ
  with the best dK/dV: the two kernels run back to back, so their times add): first every tile
  shape and warp count at the heuristic's pipeline depth, then the other depths of the best
  shape and of the shapes within ``depth_margin`` of it;
* a shortlist: the heuristic and the sweep's best few configs per role, in one race;
* a copy: the entry of a bucket with identical kernels.

With precompile workers, a finished search's pick must also pass a run at lengths of 1 in a
worker (``precompile.py``); a pick that fails is rejected and the next best is tried.

Every candidate list contains the heuristic's configs, and a candidate replaces the heuristic
only when it is faster by more than ``min_gain``: timing noise never makes the table slower
than the default. A re-tune can also give each bucket an incumbent, the pick it would replace
(``--incumbents``): the incumbent races with the first candidates, and a candidate replaces it
only when faster by more than ``min_gain`` in the same run. A re-tune of 32 buckets without it
moved 29 picks, and the new picks were no faster than the old in a forward+backward A/B (median
0.998x). A candidate is timed only after it passes the accuracy check and the stability
probes (``measure.py``).

Rounds: each round takes the next candidate list of several buckets, optionally compiles all of
them in parallel worker processes (``precompile.py``; compiling dominates the run time), then
checks and times them one at a time in this process, with the GPU otherwise idle.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Iterator, Optional

import torch

from ..tuning import hopper_configs
from ..tuning.buckets import GLUON_PASSES, Bucket
from ..tuning.configs import AttentionConfigs, KernelConfig, cuda_heuristic_configs, heuristic_configs
from ..tuning.kernel_config import role_config_from_dict
from .measure import (
    AccuracyCheck,
    KernelRunner,
    LaunchRunner,
    Problem,
    Shape,
    Timer,
    Verdict,
    attention_flops,
    do_bench_timer,
    make_problem,
    torch_dtype,
)
from .plan import COPY, SHORTLIST, SWEEP, PlannedBucket
from .precompile import RoundReport
from ..tuning.footprint import DeviceLimits, TileBytes, tile_bytes_for
from .search_space import (FULL_SPACE, ROLES, SearchSpace, depth_candidates, gluon_candidates, shape_candidates,
                           space_for)


@dataclasses.dataclass
class Settings:
    """How a run measures. The defaults are the GPU run's; tests shrink every shape."""

    space: SearchSpace = FULL_SPACE
    tokens: int = 16384  # timing problem: batch * seq
    hidden: int = 2048  # timing problem: heads * head width
    check_shape: Shape = Shape(batch=2, heads=4, seq_q=509, seq_k=509)  # ragged on purpose
    # Decode buckets: a few rows of grouped heads against ragged keys, and a timing problem of
    # decode_batch sequences with decode_rows rows each, decode_group query heads per K/V head.
    decode_check_shape: Shape = Shape(batch=2, heads=8, seq_q=5, seq_k=1021, heads_kv=2)
    decode_batch: int = 8
    decode_rows: int = 4
    decode_group: int = 8
    top_k: int = 3  # configs per role a shortlist takes from its sweep
    # A sweep then tries the other pipeline depths of its best shape and of every shape within
    # depth_margin of it, up to depth_shapes shapes: at a near tie the first shape's reference depth
    # can hide a faster depth of the second (on the H200, E = 64's 128x64/w8/s4 lost its place to
    # 64x64/w4/s3, 1 % ahead at s3, when s4 was never timed).
    depth_shapes: int = 3
    depth_margin: float = 0.05
    min_gain: float = 0.01  # a candidate must beat the heuristic by this fraction to replace it
    tasks_per_round: int = 8
    max_timing_seq: Optional[int] = None  # tests: cap the timing problem's length
    timer: Optional[Timer] = None
    runner: Optional[KernelRunner] = None

    def timing_shape(self, bucket: Bucket) -> Shape:
        seq = bucket.seq if self.max_timing_seq is None else min(bucket.seq, self.max_timing_seq)
        if bucket.pass_name == "decode":
            heads = max(self.decode_group, self.hidden // bucket.width)
            return Shape(self.decode_batch, heads, self.decode_rows, seq, heads_kv=max(1, heads // self.decode_group))
        return Shape(max(1, self.tokens // seq), max(1, self.hidden // bucket.width), seq, seq)


@dataclasses.dataclass
class Measurement:
    configs: AttentionConfigs
    verdict: Verdict
    ms: Optional[float] = None  # None when rejected


def _roles_key(configs: AttentionConfigs, roles) -> tuple:
    return tuple(getattr(configs, r) for r in roles)


class BucketTask:
    """One planned bucket's search state."""

    def __init__(self, planned: PlannedBucket, heuristic: AttentionConfigs,
                 incumbent: Optional[AttentionConfigs] = None):
        self.bucket = planned.bucket
        self.kind = planned.kind
        self.source = planned.source
        self.heuristic = heuristic
        self.incumbent = incumbent  # the pick a re-tune would replace, raced and kept unless beaten
        self.roles = ROLES[self.bucket.pass_name]
        self.measured: dict[tuple, Measurement] = {}
        self.saved_ranking: Optional[dict] = None  # a resumed run's finished bucket
        self.probed: set[tuple] = set()  # configs that passed the length-one probe
        self.entry: Optional[dict] = None
        self.done = False
        self._steps: Optional[Iterator[list[AttentionConfigs]]] = None

    def key(self, configs: AttentionConfigs) -> tuple:
        return _roles_key(configs, self.roles)

    def ok(self) -> list[Measurement]:
        return sorted((m for m in self.measured.values() if m.ms is not None), key=lambda m: m.ms)

    def heuristic_measurement(self) -> Optional[Measurement]:
        return self.measured.get(self.key(self.heuristic))

    def incumbent_measurement(self) -> Optional[Measurement]:
        return None if self.incumbent is None else self.measured.get(self.key(self.incumbent))

    def baseline(self) -> Optional[Measurement]:
        """What a candidate must beat by ``min_gain``: the incumbent when it was timed (not
        rejected by the checks or the length-one probe), else the heuristic."""
        incumbent = self.incumbent_measurement()
        if incumbent is not None and incumbent.ms is not None:
            return incumbent
        return self.heuristic_measurement()

    def best(self, min_gain: float) -> Optional[Measurement]:
        ranked = self.ok()
        if not ranked:
            return None
        base = self.baseline()
        if base is not None and base.ms is not None and ranked[0].ms > base.ms * (1.0 - min_gain):
            return base
        return ranked[0]

    def ranking(self, role: str, limit: int) -> list[KernelConfig]:
        """This role's configs, fastest first (each at its best time with the other roles)."""
        if self.saved_ranking is not None:
            return [role_config_from_dict(role, c) for c in self.saved_ranking.get(role, [])][:limit]
        best: dict[KernelConfig, float] = {}
        for m in self.ok():
            cfg = getattr(m.configs, role)
            best[cfg] = min(best.get(cfg, math.inf), m.ms)
        return sorted(best, key=best.get)[:limit]


class Tuner:
    """Runs planned buckets to table entries on one device."""

    def __init__(self, device, settings: Settings, precompile: Optional[Callable[[list], Optional[RoundReport]]] = None,
                 simulate: Optional[tuple[tuple[int, int], DeviceLimits]] = None):
        """``simulate`` = (capability, limits) plans for a GPU this machine lacks (--dry-run)."""
        self.device = torch.device(device)
        self.settings = settings
        self.timer = settings.timer or do_bench_timer()
        self.runner = settings.runner or LaunchRunner()
        self.simulated_capability = simulate[0] if simulate else None
        self.limits = simulate[1] if simulate else DeviceLimits.for_device(self.device)
        self.precompile = precompile
        self._checks: dict[tuple, AccuracyCheck] = {}
        self._timing: dict[Bucket, tuple] = {}
        self.stats = {"candidates": 0, "rejected": 0, "timed": 0, "seconds_measuring": 0.0,
                      "seconds_precompiling": 0.0, "precompile_errors": 0}

    # --- per bucket ----------------------------------------------------------------------

    def heuristic(self, bucket: Bucket) -> AttentionConfigs:
        from ..launch import interpreter_enabled

        dtype = torch_dtype(bucket.dtype)
        if self.simulated_capability is not None:
            configs = cuda_heuristic_configs(self.simulated_capability, dtype.itemsize, bucket.width, bucket.width,
                                             bucket.schedule, bucket.mask)
        else:
            probe = torch.empty(0, dtype=dtype, device=self.device)
            configs = heuristic_configs(probe, bucket.width, bucket.width, interpreter_enabled(), bucket.schedule,
                                        bucket.mask)
        if bucket.pass_name not in GLUON_PASSES:
            return configs
        # A Gluon bucket's heuristic is the built-in config of its kernel (the backward's timing
        # forward runs the built-in forward as well).
        gluon = {role: hopper_configs.default_for_bucket(role, bucket.replace(pass_name=role))
                 for role in GLUON_PASSES}
        return dataclasses.replace(configs, **gluon)

    def task(self, planned: PlannedBucket, incumbent_entry: Optional[dict] = None) -> BucketTask:
        """``incumbent_entry``: a table entry for this bucket (an older table's) whose configs
        join the search as its incumbent."""
        heuristic = self.heuristic(planned.bucket)
        return BucketTask(planned, heuristic, incumbent_configs(heuristic, ROLES[planned.bucket.pass_name],
                                                                 incumbent_entry))

    def estimate_candidates(self, planned: PlannedBucket) -> int:
        """About how many candidates a planned bucket measures (for progress and --dry-run)."""
        roles = ROLES[planned.bucket.pass_name]
        if planned.kind == COPY:
            return 0
        if planned.kind == SHORTLIST:  # the heuristic, the best, and the runners-up of each role
            return 2 + len(roles) * (self.settings.top_k - 1)
        if planned.bucket.pass_name in GLUON_PASSES:
            return len(gluon_candidates(roles[0], planned.bucket, self.limits))
        heuristic, tiles = self.heuristic(planned.bucket), self._tiles(planned.bucket)
        space = space_for(planned.bucket.pass_name, self.settings.space)
        return 1 + sum(len(shape_candidates(r, space, getattr(heuristic, r).num_stages, tiles,
                                            self.limits)) + len(space.stages) - 1 for r in roles)

    def _tiles(self, bucket: Bucket) -> TileBytes:
        return tile_bytes_for(bucket)

    def _sweep(self, task: BucketTask) -> Iterator[list[AttentionConfigs]]:
        if task.bucket.pass_name in GLUON_PASSES:  # one role, a small space: all of it in one list
            (role,) = task.roles
            incumbent = [task.incumbent] if task.incumbent is not None else []
            yield [task.heuristic] + incumbent + [dataclasses.replace(task.heuristic, **{role: c})
                                                  for c in gluon_candidates(role, task.bucket, self.limits)]
            return
        tiles, space = self._tiles(task.bucket), space_for(task.bucket.pass_name, self.settings.space)
        for role in task.roles:
            current = task.best(self.settings.min_gain)
            base = current.configs if current is not None else task.heuristic
            ref_stages = getattr(task.heuristic, role).num_stages
            shapes = shape_candidates(role, space, ref_stages, tiles, self.limits)
            # The incumbent goes with the first list (next_candidates drops it once timed).
            incumbent = [task.incumbent] if task.incumbent is not None else []
            yield [base] + incumbent + [dataclasses.replace(base, **{role: c}) for c in shapes]
            others = {r: getattr(base, r) for r in task.roles if r != role}
            ranked = [m for m in task.ok() if all(getattr(m.configs, r) == c for r, c in others.items())]
            near = [m for m in ranked if m.ms <= ranked[0].ms * (1.0 + self.settings.depth_margin)]
            top = [getattr(m.configs, role) for m in near][: self.settings.depth_shapes]
            deeper = depth_candidates(role, top, space, tiles, self.limits)
            if deeper:
                yield [dataclasses.replace(base, **{role: c}) for c in deeper]

    def _shortlist(self, task: BucketTask, source: BucketTask) -> Iterator[list[AttentionConfigs]]:
        k = self.settings.top_k
        ranked = {role: source.ranking(role, k) for role in task.roles}
        candidates = [task.heuristic] + ([task.incumbent] if task.incumbent is not None else [])
        best = {role: (ranked[role][0] if ranked[role] else getattr(task.heuristic, role)) for role in task.roles}
        candidates.append(dataclasses.replace(task.heuristic, **best))
        for role in task.roles:
            for cfg in ranked[role]:
                candidates.append(dataclasses.replace(task.heuristic, **{**best, role: cfg}))
        yield candidates

    def start(self, task: BucketTask, done: dict[Bucket, BucketTask]) -> bool:
        """Prepare ``task``'s steps; False while the bucket it depends on is not finished."""
        if task.kind == SWEEP:
            task._steps = self._sweep(task)
        elif task.source not in done:
            return False
        elif task.kind == SHORTLIST:
            task._steps = self._shortlist(task, done[task.source])
        else:
            assert task.kind == COPY
            task._steps = iter(())
        return True

    def next_candidates(self, task: BucketTask) -> Optional[list[AttentionConfigs]]:
        """The next list of unmeasured candidates, or None when the search is over."""
        for candidates in task._steps:
            fresh, seen = [], set()
            for c in candidates:
                if task.key(c) not in task.measured and task.key(c) not in seen:
                    seen.add(task.key(c))
                    fresh.append(c)
            if fresh:
                return fresh
        return None

    # --- measuring -----------------------------------------------------------------------

    def check_for(self, bucket: Bucket) -> AccuracyCheck:
        kind = (bucket.dtype, bucket.width, bucket.mask, bucket.pass_name)
        if kind not in self._checks:
            shape = self.settings.decode_check_shape if bucket.pass_name == "decode" else self.settings.check_shape
            self._checks[kind] = AccuracyCheck(bucket, shape, self.device)
        return self._checks[kind]

    def _timing_problem(self, task: BucketTask) -> tuple[Problem, Optional[tuple]]:
        if task.bucket not in self._timing:
            problem = make_problem(task.bucket, self.settings.timing_shape(task.bucket), self.device, seed=7,
                                   on_device=True, shared_mask=True)
            saved = None
            if task.bucket.pass_name == "backward":  # the backward times against the heuristic's forward
                saved = self.runner.forward(problem, task.heuristic, task.bucket.schedule)
            elif task.bucket.pass_name == "gluon_backward":
                saved = self.runner.gluon_saved(problem, task.heuristic, task.bucket.schedule)
            self._timing[task.bucket] = (problem, saved)
        return self._timing[task.bucket]

    def measure(self, task: BucketTask, configs: AttentionConfigs) -> Measurement:
        started = time.perf_counter()
        schedule = task.bucket.schedule
        verdict = self.check_for(task.bucket).verify(self.runner, configs, schedule)
        ms = None
        if verdict.ok:
            try:
                problem, saved = self._timing_problem(task)
                pass_name = task.bucket.pass_name
                if pass_name == "decode":
                    def run():
                        return self.runner.decode(problem, configs, schedule)
                elif pass_name in ("gluon_forward", "gluon_forward_exact"):
                    def run():
                        return self.runner.gluon_forward(problem, configs, schedule, pass_name == "gluon_forward_exact")
                elif pass_name == "gluon_backward":
                    def run():
                        return self.runner.gluon_backward(problem, saved, configs, schedule)
                elif saved is None:
                    def run():
                        return self.runner.forward(problem, configs, schedule)
                else:
                    def run():
                        return self.runner.backward(problem, *saved, configs, schedule)
                ms = float(self.timer(run, configs))
                if not math.isfinite(ms) or ms <= 0:
                    raise ValueError(f"timer returned {ms}")
            except Exception as exc:
                reason = f"timing failed: {type(exc).__name__}: {exc}"[:200]
                verdict = Verdict(False, verdict.error, verdict.error_ratio, reason)
                ms = None
        measurement = Measurement(configs, verdict, ms)
        task.measured[task.key(configs)] = measurement
        self.stats["candidates"] += 1
        self.stats["rejected" if ms is None else "timed"] += 1
        self.stats["seconds_measuring"] += time.perf_counter() - started
        return measurement

    def reject_pick(self, task: BucketTask, configs: AttentionConfigs, reason: str) -> None:
        """Turn a measured pick into a rejected candidate (it failed the length-one probe)."""
        verdict = task.measured[task.key(configs)].verdict
        task.measured[task.key(configs)] = Measurement(
            configs, Verdict(False, verdict.error, verdict.error_ratio, reason), None)
        self.stats["timed"] -= 1
        self.stats["rejected"] += 1

    # --- the run -------------------------------------------------------------------------

    def run(self, tasks: list[BucketTask], done: dict[Bucket, BucketTask], *,
            on_done: Callable[[BucketTask], None] = lambda task: None,
            on_candidate: Callable[[BucketTask, Measurement], None] = lambda task, m: None,
            deadline: Optional[float] = None) -> list[BucketTask]:
        """Search ``tasks`` in rounds until all are done or ``deadline`` (time.monotonic) would
        be passed by the next round; ``done`` holds finished tasks (a resumed run's too) and is
        updated. Returns the tasks left unfinished.

        With a deadline the first round, which has no per-candidate time to plan with, searches
        one bucket only, and no round measures another candidate once the deadline has passed:
        under the interpreter a full first round takes tens of minutes."""
        waiting = [t for t in tasks if not t.done]
        active: list[BucketTask] = []
        per_candidate_s = None
        while waiting or active:
            for task in [t for t in waiting if t.kind == COPY and t.source in done]:  # no measuring: now
                waiting.remove(task)
                self._finish(task, done, on_done)
            round_size = 1 if deadline is not None and per_candidate_s is None else self.settings.tasks_per_round
            for task in list(waiting):
                if len(active) >= round_size:
                    break
                if self.start(task, done):
                    waiting.remove(task)
                    active.append(task)
            round_jobs = []
            finishing = []  # searches whose winner must first pass the length-one probe
            for task in list(active):
                candidates = self.next_candidates(task)
                if candidates is not None:
                    round_jobs.extend((task, c) for c in candidates)
                elif (winner := self._unprobed_winner(task)) is not None:
                    finishing.append((task, winner))
                else:
                    self._finish(task, done, on_done)
                    active.remove(task)
            if not round_jobs and not finishing:
                if waiting and not any(t.kind == SWEEP or t.source in done for t in waiting):
                    raise RuntimeError(f"autotune plan: {waiting[0].bucket.key()} waits on a bucket not in the plan")
                continue
            out_of_time = deadline is not None and per_candidate_s is not None \
                and time.monotonic() + per_candidate_s * len(round_jobs) > deadline
            if out_of_time:
                if not finishing:
                    return active + waiting
                # Past the budget, the searches already measured still get their probe: it costs a
                # compile, where dropping it would throw the whole measured search away.
                round_jobs = []
            started = time.monotonic()
            report = None
            if self.precompile is not None:
                report = self.precompile([(task.bucket, task.heuristic, c) for task, c in round_jobs],
                                         [(task.bucket, winner) for task, winner in finishing])
                if report is not None:
                    self.stats["precompile_errors"] += report.warm_errors
                self.stats["seconds_precompiling"] += time.monotonic() - started
            failures = report.probe_failures if report is not None else [None] * len(finishing)
            for (task, winner), failure in zip(finishing, failures):
                if failure is not None:  # never run here at a length of 1; the next best goes next round
                    self.reject_pick(task, winner, failure)
                    continue
                task.probed.add(task.key(winner))
                self._finish(task, done, on_done)
                active.remove(task)
            for task, configs in round_jobs:
                if deadline is not None and time.monotonic() > deadline:
                    self._timing.clear()
                    return active + waiting  # a bucket measured in part is searched again on --resume
                on_candidate(task, self.measure(task, configs))
            self._timing.clear()  # large problems live for one round only
            if round_jobs:
                elapsed = (time.monotonic() - started) / len(round_jobs)
                per_candidate_s = elapsed if per_candidate_s is None else max(elapsed, 0.5 * (per_candidate_s + elapsed))
            elif out_of_time:
                return active + waiting
        return []

    def _unprobed_winner(self, task: BucketTask) -> Optional[AttentionConfigs]:
        """The finished search's pick, when it has yet to pass the length-one probe (only with
        precompile workers: the probe must not run in this process)."""
        if self.precompile is None:
            return None
        best = task.best(self.settings.min_gain)
        if best is None or task.key(best.configs) in task.probed:
            return None
        return best.configs

    def _finish(self, task: BucketTask, done: dict, on_done) -> None:
        if task.kind == COPY:
            source = done[task.source]
            task.entry = None if source.entry is None else {**source.entry, "mode": COPY, "source": task.source.key()}
        else:
            task.entry = make_entry(task, self.settings)
        task.done = True
        done[task.bucket] = task
        on_done(task)


def _configs_json(configs: AttentionConfigs, roles) -> dict:
    return {role: getattr(configs, role).to_dict() for role in roles}


def make_entry(task: BucketTask, settings: Settings) -> Optional[dict]:
    """The table entry of a finished search (None when every candidate was rejected). Writing it
    through ``cache.TuningTable.for_current_code`` stamps its kernel family's hash."""
    best = task.best(settings.min_gain)
    if best is None:
        return None
    flops = attention_flops(task.bucket, settings.timing_shape(task.bucket))
    ranked = task.ok()
    runner_up = next((m for m in ranked if m is not best), None)
    rejected = [m for m in task.measured.values() if m.ms is None]
    heuristic, speedup_vs_heuristic = _reference_json(task.heuristic, task.heuristic_measurement(), task.roles, best)
    incumbent = {}
    if task.incumbent is not None:
        record, speedup = _reference_json(task.incumbent, task.incumbent_measurement(), task.roles, best)
        incumbent = {"incumbent": record, "speedup_vs_incumbent": speedup}
    return {
        "configs": _configs_json(best.configs, task.roles),
        "ms": best.ms,
        "tflops": flops / (best.ms * 1e-3) / 1e12,
        "error": best.verdict.error,
        "error_ratio": best.verdict.error_ratio,
        "runner_up": None if runner_up is None else {"configs": _configs_json(runner_up.configs, task.roles),
                                                      "ms": runner_up.ms},
        "heuristic": heuristic,
        "speedup_vs_heuristic": speedup_vs_heuristic,
        **incumbent,
        "ranking": {role: [c.to_dict() for c in task.ranking(role, settings.top_k)] for role in task.roles},
        "candidates": len(task.measured),
        "rejected": [{"configs": _configs_json(m.configs, task.roles), "reason": m.verdict.reason}
                     for m in rejected][:8],
        "mode": task.kind,
        "source": None if task.source is None else task.source.key(),
        "space": settings.space.name,
    }


def _reference_json(configs: AttentionConfigs, timed: Optional[Measurement], roles,
                    best: Measurement) -> tuple[dict, Optional[float]]:
    """An entry's record of a config set the pick is compared with (the heuristic, an incumbent):
    its configs, time or rejection reason, and the pick's speed-up over it (None when untimed)."""
    record = {"configs": _configs_json(configs, roles), "ms": None if timed is None else timed.ms,
              "rejected": None if timed is None or timed.ms is not None else timed.verdict.reason}
    return record, None if timed is None or timed.ms is None else timed.ms / best.ms


def incumbent_configs(heuristic: AttentionConfigs, roles, entry: Optional[dict]) -> Optional[AttentionConfigs]:
    """The configs of a table entry for ``roles`` (the heuristic's for the other roles), or None
    when the entry lacks one of them or is malformed. Its kernel hash is not checked: an entry
    timed on older kernels is still a set of launch configs to race."""
    configs = (entry or {}).get("configs")
    if not isinstance(configs, dict) or any(not isinstance(configs.get(role), dict) for role in roles):
        return None
    try:
        return dataclasses.replace(heuristic, **{role: role_config_from_dict(role, configs[role]) for role in roles})
    except (KeyError, TypeError, ValueError):
        return None


def task_from_entry(planned: PlannedBucket, heuristic: AttentionConfigs, entry: Optional[dict]) -> BucketTask:
    """A finished task rebuilt from a saved entry (``--resume``): enough for the shortlists it seeds."""
    task = BucketTask(planned, heuristic)
    # A shipped entry keeps no ranking: its own configs are then the best the shortlists know.
    configs = (entry or {}).get("configs") or {}
    task.saved_ranking = (entry or {}).get("ranking") or {role: [config] for role, config in configs.items()}
    task.entry, task.done = entry, True
    return task
