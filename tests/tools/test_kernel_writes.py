"""tools.kernel_writes: torch.compile's analysis of our Triton kernels finds that each writes only
its outputs.

Under torch.compile, a kernel that torch's TTIR analysis cannot follow counts as writing every
tensor argument; AOT autograd then copies the "written" query back into a leaf that requires grad
and the training compile fails, on the GPU only (CPU calls never reach a kernel). This runs the
analysis on a CPU machine: a kernel change once made the dQ pass look like it wrote Q and dO."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from helpers import small_and_full

ROOT = pathlib.Path(__file__).resolve().parents[2]

# (head dims, masks, dtypes, schedules): every backward variant the masks and schedules select.
FORMS = small_and_full(("64", "none,float,window", "fp16", "stable,fast"),
                       ("64,128", "none,causal,bool,float,window", "bf16,fp16", "stable,fast,accurate"))


@pytest.mark.parametrize("form", FORMS)
def test_every_kernel_writes_only_its_outputs(form):
    head_dims, masks, dtypes, schedules = form
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # interpreted kernels have no TTIR
    run = subprocess.run([sys.executable, "-m", "tools.kernel_writes", "--head-dims", head_dims, "--masks", masks,
                          "--dtypes", dtypes, "--schedules", schedules],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "0 problem(s)" in run.stdout
    cases = len(head_dims.split(",")) * len(masks.split(",")) * len(dtypes.split(",")) * len(schedules.split(","))
    assert run.stdout.count("_attn_bwd_dq: ") == cases, run.stdout


def test_a_kernel_that_seems_to_write_its_inputs_is_a_problem():
    from tools.kernel_writes import problems

    assert problems({"_attn_bwd_dq": {"DQ", "DELTA"}, "_attn_fwd": {"OUT", "LSE"}}) == []
    found = problems({"_attn_bwd_dq": {"DQ", "Q", "DO"}, "_attn_new": {"X"}, "_attn_fwd": set()})
    assert found == ["_attn_bwd_dq appears to write its inputs ['DO', 'Q']",
                     "_attn_fwd appears to write nothing",
                     "_attn_new is not in tools/kernel_writes.OUTPUTS; add its output parameters"]
