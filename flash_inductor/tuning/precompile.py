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
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import warnings
from typing import Optional

from .buckets import Bucket
from .configs import AttentionConfigs, KernelConfig
from .measure import LaunchRunner, Shape, check_problems, make_problem, run_pass
from .plan import kernel_signature

_ROLE_NAMES = ("forward", "backward_dkdv", "backward_dq")


def _encode(configs: AttentionConfigs) -> tuple:
    return tuple(getattr(configs, r).to_dict() for r in _ROLE_NAMES)


def _decode(encoded: tuple) -> AttentionConfigs:
    return AttentionConfigs(*(KernelConfig.from_dict(c) for c in encoded))


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
        else:
            runner.forward(timing, configs, bucket.schedule)
    except Exception as exc:  # reported by the main process's own run of this candidate
        return f"{type(exc).__name__}: {str(exc).strip()[:200]}"
    return None


class ParallelPrecompiler:
    """A pool of spawned workers (CUDA cannot be forked) that warms Triton's cache per round."""

    def __init__(self, workers: int, device: str, settings):
        self.workers = workers
        self.device = device
        self.settings = settings
        self._pool: Optional[concurrent.futures.ProcessPoolExecutor] = None
        self.broken = False

    def __call__(self, jobs: list[tuple[Bucket, AttentionConfigs, AttentionConfigs]]) -> list[Optional[str]]:
        """Warm the cache for (bucket, heuristic, candidate) jobs; returns each distinct job's
        error line (None: compiled and ran)."""
        if self.broken or not jobs:
            return []
        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(
                max_workers=self.workers, mp_context=multiprocessing.get_context("spawn"))
        check = dataclasses.astuple(self.settings.check_shape)
        unique = {}
        for bucket, heuristic, configs in jobs:
            # Lengths are powers of two and widths multiples of 16, so every timing problem of a
            # bucket family specialises the kernels alike: one job per family and candidate.
            key = (kernel_signature(bucket.replace(seq=0)), heuristic, configs)
            unique.setdefault(key, (bucket, heuristic, configs))
        futures = [
            self._pool.submit(warm, bucket.key(), _encode(heuristic), _encode(configs), check,
                              dataclasses.astuple(self.settings.timing_shape(bucket)), self.device)
            for bucket, heuristic, configs in unique.values()
        ]
        try:
            return [future.result() for future in futures]
        except Exception as exc:  # a dead worker (BrokenProcessPool) or a pickling problem
            warnings.warn(f"autotune: parallel compilation disabled ({type(exc).__name__}: {exc}); "
                          "compiling in the main process instead")
            self.broken = True
            self.close()
            return []

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
