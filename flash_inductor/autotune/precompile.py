"""Compile a round's candidates in parallel worker processes before they are measured.

Triton compiles each (kernel, config, specialisation) once and keeps the binary in its on-disk
cache (``TRITON_CACHE_DIR``, default ``~/.triton/cache``). A worker that runs a candidate on
problems of exactly the shapes the tuner will use (the check problem, the probes, the timing
problem) therefore leaves every binary the tuner needs on disk, and the tuner's own launches
load them instead of compiling. Compilation is CPU-bound and dominates a tuning run, so a few
workers cut the run time several-fold, while the measurements themselves stay in the main
process, one at a time, with the GPU otherwise idle.

Workers only warm the cache: whatever they do, including failing, cannot change a result. A
worker error is reported by the main process's own run of that candidate; if the pool itself
breaks, the run continues without it.

The one exception: workers also run each search's winner at lengths of 1 (L = 7, S = 1 and
L = 1, S = 7) before it becomes a table entry. Triton compiles an integer argument equal to 1
into the kernel as a constant, and Inductor does the same for a size statically 1, so those
lengths run other kernels than every other length; on Triton 3.6 / sm_90 one such kernel read
shared memory out of range. The tuner must never run such a config itself, since a
fault poisons the process's CUDA context, so this probe's verdict comes from here. Only winners
are probed: a probe compiles the kernels twice more, for lengths no timing uses. A fault in a
worker poisons that worker too, and the worker's later jobs then fail for nothing of their own:
after a round with a failed probe, the pool is replaced and each failed probe runs again alone,
in a fresh process; only a failure there rejects the winner (and the search's next best is
probed in the next round).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import warnings
from typing import Optional

import torch

from ..tuning.buckets import Bucket
from ..tuning.buckets import GLUON_PASSES
from ..tuning.configs import AttentionConfigs
from ..tuning.kernel_config import role_config_from_dict
from .measure import LaunchRunner, Shape, check_problems, make_problem, run_pass
from .plan import kernel_signature

_ROLE_NAMES = ("forward", "backward_dkdv", "backward_dq", "decode") + GLUON_PASSES
# The lengths tests/tuning/test_table_edges.py checks every shipped pick at, as (L, S).
LENGTHS_OF_ONE = ((7, 1), (1, 7))


@dataclasses.dataclass
class RoundReport:
    """What a round's workers found: how many jobs failed to warm (the main process's own run
    reports why), and, per probe, why those configs failed at a length of 1 (None: they passed)."""

    warm_errors: int
    probe_failures: list[Optional[str]]


def _encode(configs: AttentionConfigs) -> tuple:
    return tuple(None if getattr(configs, r) is None else getattr(configs, r).to_dict() for r in _ROLE_NAMES)


def _decode(encoded: tuple) -> AttentionConfigs:
    return AttentionConfigs(**{role: None if c is None else role_config_from_dict(role, c)
                               for role, c in zip(_ROLE_NAMES, encoded)})


def warm(bucket_key: str, heuristic: tuple, candidate: tuple, check_shape: tuple, timing_shape: tuple,
         device: str) -> Optional[str]:
    """Run one candidate on every problem shape the tuner will use (worker side). Returns an
    error line, or None."""
    bucket = Bucket.parse(bucket_key)
    configs = _decode(candidate)
    runner = LaunchRunner()
    try:
        problems = check_problems(bucket, Shape(*check_shape), device, seed=0)
        timing = make_problem(bucket, Shape(*timing_shape), device, seed=7, on_device=True, shared_mask=True)
        for _, problem in problems:
            run_pass(runner, problem, configs, bucket.schedule, bucket.pass_name)
        if bucket.pass_name == "backward":
            out, lse = runner.forward(timing, _decode(heuristic), bucket.schedule)
            runner.backward(timing, out, lse, configs, bucket.schedule)
        elif bucket.pass_name == "gluon_backward":
            saved = runner.gluon_saved(timing, _decode(heuristic), bucket.schedule)
            runner.gluon_backward(timing, saved, configs, bucket.schedule)
        else:
            run_pass(runner, timing, configs, bucket.schedule, bucket.pass_name)
    except Exception as exc:  # reported by the main process's own run of this candidate
        return f"{type(exc).__name__}: {str(exc).strip()[:200]}"
    return None


def probe_lengths_of_one(bucket_key: str, candidate: tuple, device: str) -> Optional[str]:
    """Run one candidate at each of LENGTHS_OF_ONE (worker side; never in the tuner's process).
    Returns why it failed (an error, or a non-finite output), or None."""
    bucket = Bucket.parse(bucket_key)
    configs = _decode(candidate)
    runner = LaunchRunner()
    for seq_q, seq_k in LENGTHS_OF_ONE:
        try:
            problem = make_problem(bucket, Shape(2, 2, seq_q, seq_k), device, seed=11)
            outputs = run_pass(runner, problem, configs, bucket.schedule, bucket.pass_name)
            if torch.device(device).type == "cuda":
                torch.cuda.synchronize()  # a fault in an asynchronous launch surfaces here
            bad = [name for name, t in outputs.items() if not torch.isfinite(t).all()]
            if bad:
                return f"non-finite {', '.join(bad)} at L={seq_q}, S={seq_k}"
        except Exception as exc:
            return f"{type(exc).__name__} at L={seq_q}, S={seq_k}: {str(exc).strip()[:200]}"
    return None


class ParallelPrecompiler:
    """A pool of spawned workers (CUDA cannot be forked) that warms Triton's cache per round."""

    def __init__(self, workers: int, device: str, settings):
        self.workers = workers
        self.device = device
        self.settings = settings
        self._pool: Optional[concurrent.futures.ProcessPoolExecutor] = None
        self.broken = False
        # Each probed (kernel family, configs)'s verdict, kept across rounds: the probe's lengths
        # are fixed, so it holds for every length bucket of those kernels (None: passed).
        self._verdicts: dict[tuple, Optional[str]] = {}

    def __call__(self, jobs: list[tuple[Bucket, AttentionConfigs, AttentionConfigs]],
                 probes: list[tuple[Bucket, AttentionConfigs]] = ()) -> Optional[RoundReport]:
        """Warm the cache for (bucket, heuristic, candidate) jobs, and probe each (bucket, configs)
        of ``probes`` (the searches' winners) at lengths of 1. None when the pool is broken: the
        run goes on without it, its winners unprobed."""
        if self.broken or not (jobs or probes):
            return None
        unique: dict[tuple, tuple] = {}
        for bucket, heuristic, configs in jobs:
            # Lengths are powers of two and widths multiples of 16, so every timing problem of a
            # bucket family specialises the kernels alike: one job per family and candidate.
            unique.setdefault((kernel_signature(bucket.replace(seq=0)), heuristic, configs), (bucket, heuristic, configs))
        # A probe runs only lengths of 1 and 7: one per bucket family and configs, ever.
        probe_keys = [(kernel_signature(bucket.replace(seq=0)), configs) for bucket, configs in probes]
        unique_probes = {key: probe for key, probe in zip(probe_keys, probes) if key not in self._verdicts}
        try:
            if self._pool is None:
                self._pool = concurrent.futures.ProcessPoolExecutor(
                    max_workers=self.workers, mp_context=multiprocessing.get_context("spawn"))
            warming = [
                self._pool.submit(warm, bucket.key(), _encode(heuristic), _encode(configs), self._check_shape(bucket),
                                  dataclasses.astuple(self.settings.timing_shape(bucket)), self.device)
                for bucket, heuristic, configs in unique.values()
            ]
            probing = [self._pool.submit(probe_lengths_of_one, bucket.key(), _encode(configs), self.device)
                       for bucket, configs in unique_probes.values()]
            warm_errors = sum(future.result() is not None for future in warming)
            failed = {key: future.result() for key, future in zip(unique_probes, probing)}
        except Exception as exc:  # a dead worker (BrokenProcessPool) or a pickling problem
            warnings.warn(f"autotune: parallel compilation disabled ({type(exc).__name__}: {exc}); "
                          "compiling in the main process instead, and without the length-one probes")
            self.broken = True
            self.close()
            return None
        failed = {key: failure for key, failure in failed.items() if failure is not None}
        confirmed = self._confirm_alone(failed, unique_probes) if failed else {}
        for key in unique_probes:
            self._verdicts[key] = None if confirmed.get(key) is None else f"length one: {confirmed[key]}"[:240]
        return RoundReport(warm_errors=warm_errors, probe_failures=[self._verdicts[key] for key in probe_keys])

    def _check_shape(self, bucket: Bucket) -> tuple:
        shape = self.settings.decode_check_shape if bucket.pass_name == "decode" else self.settings.check_shape
        return dataclasses.astuple(shape)

    def _confirm_alone(self, failed: dict[tuple, str], probes: dict[tuple, tuple]) -> dict[tuple, Optional[str]]:
        """Re-run each failed probe alone in a fresh process, after replacing the pool: a fault
        poisons its worker's CUDA context, and that worker's later probes fail for nothing of
        their own. Returns each one's failure there (None: it passed alone)."""
        self.close()
        return {key: self._probe_alone(*probes[key]) for key in failed}

    def _probe_alone(self, bucket: Bucket, configs: AttentionConfigs) -> Optional[str]:
        with concurrent.futures.ProcessPoolExecutor(max_workers=1,
                                                    mp_context=multiprocessing.get_context("spawn")) as alone:
            try:
                return alone.submit(probe_lengths_of_one, bucket.key(), _encode(configs), self.device).result()
            except Exception as exc:  # the process died (a hard crash counts as a failure)
                return f"the probe's process died ({type(exc).__name__}: {exc})"

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
