"""tests/conftest.py's CUDA fault isolation keeps the faulting test's traceback.

A kernel fault poisons the CUDA context; the conftest then stops the session (or the xdist
worker), which drops pytest's failure section. Its exit message must still carry the test's own
traceback, since that names the launch where the fault surfaced. Checked without a GPU: a
child pytest runs the real conftest on a test module that fakes a poisoned context.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

TESTS = pathlib.Path(__file__).resolve().parents[1]

_FAKE_FAULT = '''
import torch

torch.cuda.is_available = lambda: True
torch.cuda.is_initialized = lambda: True


def _poisoned():
    raise RuntimeError("an illegal memory access was encountered (simulated)")


torch.cuda.synchronize = _poisoned


def launch_the_dkdv_pass():
    raise RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered (simulated)")


def test_a_kernel_faults():
    launch_the_dkdv_pass()


def test_never_runs():
    pass
'''


def test_a_poisoned_context_stops_the_run_with_the_tests_traceback(tmp_path):
    for name in ("conftest.py", "helpers.py"):
        shutil.copy(TESTS / name, tmp_path / name)
    (tmp_path / "test_fake_fault.py").write_text(_FAKE_FAULT)
    # Neither the xdist worker id nor the GPU suite's failure log: the child's deliberate failure is
    # this test's evidence, not a failure of the suite running it.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_XDIST_WORKER", "FLASH_INDUCTOR_FAILURE_LOG")}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                             "-p", "no:randomly", str(tmp_path)],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 3, output
    assert "CUDA context poisoned during test_fake_fault.py::test_a_kernel_faults" in output, output
    assert "the test's own failure:" in output and "launch_the_dkdv_pass()" in output, output
    assert "test_never_runs" not in output.split("the test's own failure:")[0], output
