"""A CPU-only install has no Triton (torch's CPU wheels do not bring it, and it is not a base
dependency): the package, its backend and the demo must work without it, and CUDA tensors without
it must fail with an error that says what to install.

The test suite itself needs Triton (the kernels run under its interpreter), so its absence is
simulated in a subprocess: ``sys.modules["triton"] = None`` makes ``import triton`` raise
ModuleNotFoundError and ``importlib.util.find_spec("triton")`` return None, which is what torch
and we see on a machine without it. ``.ci/run`` also runs the demo in a real venv without Triton.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import textwrap
import types

import pytest
import torch

_ROOT = pathlib.Path(__file__).resolve().parents[2]

_WITHOUT_TRITON = textwrap.dedent(
    """
    import runpy, sys
    sys.modules["triton"] = None  # not installed, as far as any import or find_spec can tell
    sys.argv = ["flash_inductor.demo", "--device", "cpu", "--seq", "48"]
    runpy.run_module("flash_inductor.demo", run_name="__main__")

    import torch
    import flash_inductor
    q, k, v = (torch.randn(1, 2, 16, 8, requires_grad=True) for _ in range(3))
    with flash_inductor.monitor() as watch:
        flash_inductor.flash_attention(q, k, v, is_causal=True).sum().backward()
    print("monitored phases:", sorted(record["phase"] for record in watch.records()))
    print("triton stayed blocked:", sys.modules.get("triton") is None)
    """
)


def _run_without_triton() -> subprocess.CompletedProcess:
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", _WITHOUT_TRITON], capture_output=True, text=True,
                          env=env, timeout=300)


def test_demo_and_monitoring_run_without_triton():
    result = _run_without_triton()
    assert result.returncode == 0, result.stderr[-4000:]
    assert "rewrote 1 of 1 attention site" in result.stdout
    assert "gradients finite: True" in result.stdout
    assert "monitored phases: ['backward', 'forward']" in result.stdout
    assert "triton stayed blocked: True" in result.stdout
    # Registering the ops must not log torch's "Triton not available" notice on every import.
    assert "Triton not available" not in result.stderr


def test_cuda_tensors_without_triton_say_what_to_install(monkeypatch):
    from flash_inductor import launch

    monkeypatch.setattr(launch.common, "triton_available", lambda: False)
    query = types.SimpleNamespace(device=torch.device("cuda"), dtype=torch.float16, shape=(1, 2, 16, 64))
    with pytest.raises(RuntimeError, match="need Triton.*pip install triton"):
        launch.kernel_supports(query, query, query)


def test_inputs_the_kernels_never_take_need_no_triton(monkeypatch):
    """float64 goes to the reference path on CUDA too, so a missing Triton is no error there."""
    from flash_inductor import launch

    monkeypatch.setattr(launch.common, "triton_available", lambda: False)
    query = types.SimpleNamespace(device=torch.device("cuda"), dtype=torch.float64, shape=(1, 2, 16, 64))
    assert not launch.kernel_supports(query, query, query)


@pytest.mark.parametrize("variable", ["INSTALL_AND_DEMO", "INSTALL_AND_TEST"])
def test_ci_runs_the_readme_commands_verbatim(variable):
    """CI proves the README's Quick start only while it runs the same commands: a README edit
    must update .ci/run too."""
    ci_script = (_ROOT / ".ci" / "run").read_text()
    command = re.search(rf"^{variable}='(.+)'$", ci_script, re.MULTILINE).group(1)
    readme_lines = [line.strip() for line in (_ROOT / "README.md").read_text().splitlines()]
    assert command in readme_lines, f".ci/run's {variable} is not a line of README.md: {command}"
