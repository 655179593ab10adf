"""tools.launch_sass: what the launchers' real calls would launch compiles for sm_90a.

The tool runs the launchers on CPU tensors, records each launch at ``launch.common.launcher`` and
compiles it as the GPU launch would be (Triton's own argument binding, Gluon's AST source, the
wheel's ptxas), so a launcher whose arguments no longer match its kernel fails here rather than on
a GPU. The small form compiles one case per kernel family (Gluon forward, one-pass backward, a
block-sparse Triton forward and backward, decode, the Gluon packed forward and backward), fp16 and bf16; the full form (--tools-full) every
hand-picked case and every entry of the shipped tuning tables. The compiles run in a child process:
under TRITON_INTERPRET (the CPU suite's) the kernels are interpreted functions, which do not compile."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from helpers import small_and_full

ROOT = pathlib.Path(__file__).resolve().parents[2]
FORMS = small_and_full(("--ci",), ("--tables",))


def run_tool(*args, timeout):
    pytest.importorskip("triton.experimental.gluon", reason="a Triton without Gluon has no Hopper kernels")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-m", "tools.launch_sass", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(14400)
@pytest.mark.parametrize("form", FORMS)
def test_every_launch_compiles_for_sm90a(form, tmp_path):
    from tools.launch_sass import CI_CASES

    out = tmp_path / "digests.json"
    run = run_tool(*form, "--write", str(out), timeout=14000)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-3000:]
    results = json.loads(out.read_text())
    if form == ("--ci",):
        assert set(results) == set(CI_CASES)
    else:
        assert any(name.startswith("table/") for name in results)
    for name, result in results.items():
        assert result["status"] == "pass" and result["kernels"], (name, result)
        assert all(len(k["sass"]) == 16 and k["shared"] >= 0 for k in result["kernels"].values()), name


def test_compare_says_identical_or_different_per_case():
    from tools.launch_sass import compare

    kernels = {"0:_attn_fwd_hopper": {"sass": "a" * 16, "shared": 1}}
    before = {"same": {"status": "pass", "kernels": kernels}, "changed": {"status": "pass", "kernels": kernels},
              "broken": {"status": "pass", "kernels": kernels}}
    after = {"same": {"status": "pass", "kernels": kernels},
             "changed": {"status": "pass", "kernels": {"0:_attn_fwd_hopper": {"sass": "b" * 16, "shared": 1}}},
             "broken": {"status": "fail", "kernels": {}, "error": "TypeError: missing an argument"},
             "added": {"status": "pass", "kernels": kernels}}
    assert compare(after, before) == [("identical", "same"), ("DIFFERENT", "changed"), ("FAIL", "broken"),
                                      ("NEW", "added")]
