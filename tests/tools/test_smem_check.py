"""tools.smem_check: the launches with the largest tiles fit Hopper's shared memory.

Shared memory is fixed when Triton lowers a kernel, so this runs on a CPU machine: the tool compiles
each kernel our launchers would start on an sm_90 GPU (heuristic configs: every mask kind other than
none/causal runs on them) and reads what it needs. A kernel change once took the E=256 dQ pass
with a bool mask to 336 KiB (227 KiB available), found only after spending GPU time; the small
form compiles that launch, the full form (-m tools_full) every combination around it."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from helpers import small_and_full

ROOT = pathlib.Path(__file__).resolve().parents[2]

# (masks, dtypes, schedules) at E=256; each combination compiles a forward and four backward kernels.
FORMS = small_and_full(("bool", "bf16", "stable"), ("bool,float,window_bool", "bf16,fp16", "stable,fast"))
# A guard against a hung compile, not a speed check: the full form's 12 combinations took over
# 15 minutes on 2 cores shared with other work (2026-12-07), so it gets 40.
TIMEOUT_S = {"small": 900, "full": 2400}


@pytest.mark.parametrize("form", FORMS)
def test_widest_heuristic_launches_fit_hopper_shared_memory(form, request):
    masks, dtypes, schedules = form
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # interpreted kernels do not compile
    run = subprocess.run([sys.executable, "-m", "tools.smem_check", "--head-dims", "256", "--masks", masks,
                          "--dtypes", dtypes, "--schedules", schedules],
                         cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=TIMEOUT_S[request.node.callspec.id])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "every launch fits" in run.stdout
    combinations = len(masks.split(",")) * len(dtypes.split(",")) * len(schedules.split(","))
    assert run.stdout.count("most: ") == combinations, run.stdout
