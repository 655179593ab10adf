"""tools.smem_check: the launches with the largest tiles fit Hopper's shared memory.

Shared memory is fixed when Triton lowers a kernel, so this runs on a CPU machine: the tool compiles
each kernel our launchers would start on an sm_90 GPU (heuristic configs: every mask kind other than
none/causal runs on them) and reads what it needs. Session 14 found a kernel change that took the
E=256 dQ pass with a bool mask to 336 KiB (227 KiB available) only after spending its GPU time."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_widest_heuristic_launches_fit_hopper_shared_memory():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # interpreted kernels do not compile
    run = subprocess.run([sys.executable, "-m", "tools.smem_check", "--head-dims", "256", "--masks", "bool,float",
                          "--dtypes", "bf16,fp16", "--schedules", "stable,fast"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "every launch fits" in run.stdout
    # Each of the 8 combinations compiled a forward and the four backward kernels.
    assert run.stdout.count("most: ") == 8, run.stdout
