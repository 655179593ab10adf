"""tools.launch_sass: what the launchers' real calls would launch compiles for sm_90a.

The tool runs the launchers on CPU tensors, records each launch at ``launch.common.launcher`` and
compiles it as the GPU launch would be (Triton's own argument binding, Gluon's AST source, the
wheel's ptxas), so a launcher whose arguments no longer match its kernel fails here rather than on
a GPU. The small form compiles one case per kernel family (Gluon forward, one-pass backward, a
block-sparse Triton forward and backward, decode, the Gluon packed forward and backward), fp16 and bf16; the full form (--tools-full) every
hand-picked case and every entry of the shipped tuning tables. The compiles run in a child process:
under TRITON_INTERPRET (the CPU suite's) the kernels are interpreted functions, which do not compile.

--grid: the launches with the largest tiles fit Hopper's shared memory. Every mask kind other than
none/causal runs on the heuristic's configs; a kernel change once took the E=256 dQ pass with a bool
mask to 336 KiB (227 KiB available), found only after spending GPU time. The small form compiles
that launch, the full form (-m tools_full) every combination around it.

The PTX digest sees code, not where the code sits in its source file: its use is deciding whether a
kernel edit left a variant's compiled code alone (then its tuned table entries may be re-stamped
instead of re-tuned), so an edit that only moves lines must give the same digest, and any change of
an instruction a different one."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from helpers import small_and_full

from flash_inductor.tuning.footprint import OPTIN_SMEM_BYTES

ROOT = pathlib.Path(__file__).resolve().parents[2]
FORMS = small_and_full(("--ci",), ("--tables",))
# --grid's (masks, dtypes, schedules) at E=256; each combination compiles a forward, four backward
# kernels and the decode split and merge.
GRID_FORMS = small_and_full(("bool", "bf16", "stable"), ("bool,float,window_bool", "bf16,fp16", "stable,fast"))
# A guard against a hung compile, not a speed check: the full grid's 12 combinations took over
# 15 minutes on 2 cores shared with other work (2026-12-07), so it gets 40.
GRID_TIMEOUT_S = {"small": 900, "full": 2400}


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

    kernels = {"0:_attn_fwd_hopper": {"sass": "a" * 16, "ptx": "p" * 16, "shared": 1}}
    before = {"same": {"status": "pass", "kernels": kernels}, "changed": {"status": "pass", "kernels": kernels},
              "moved": {"status": "pass", "kernels": kernels}, "broken": {"status": "pass", "kernels": kernels},
              "unknown_ptx": {"status": "pass", "kernels": {"0:_attn_fwd_hopper": {"sass": "a" * 16, "shared": 1}}}}
    other_sass = {"0:_attn_fwd_hopper": {"sass": "b" * 16, "ptx": "p" * 16, "shared": 1}}
    after = {"same": {"status": "pass", "kernels": kernels},
             "changed": {"status": "pass", "kernels": {"0:_attn_fwd_hopper": {"sass": "b" * 16, "ptx": "q" * 16,
                                                                              "shared": 1}}},
             "moved": {"status": "pass", "kernels": other_sass},
             "broken": {"status": "fail", "kernels": {}, "error": "TypeError: missing an argument"},
             "unknown_ptx": {"status": "pass", "kernels": other_sass},
             "added": {"status": "pass", "kernels": kernels}}
    assert compare(after, before) == [("identical", "same"), ("DIFFERENT", "changed"), ("same PTX", "moved"),
                                      ("FAIL", "broken"), ("DIFFERENT", "unknown_ptx"), ("NEW", "added")]


@pytest.mark.parametrize("form", GRID_FORMS)
def test_widest_heuristic_launches_fit_hopper_shared_memory(form, tmp_path, request):
    masks, dtypes, schedules = form
    out = tmp_path / "grid.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # interpreted kernels do not compile
    run = subprocess.run([sys.executable, "-m", "tools.launch_sass", "--grid", "--head-dims", "256", "--masks", masks,
                          "--dtypes", dtypes, "--schedules", schedules, "--write", str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=GRID_TIMEOUT_S[request.node.callspec.id])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads(out.read_text())
    combinations = len(masks.split(",")) * len(dtypes.split(",")) * len(schedules.split(","))
    assert len(results) == combinations, results
    for name, result in results.items():
        assert result["status"] == "pass" and len(result["kernels"]) >= 6, (name, result)
        assert all(k["shared"] <= OPTIN_SMEM_BYTES[(9, 0)] for k in result["kernels"].values()), (name, result)


PTX = """//
// Generated by LLVM NVPTX Back-End
//
.version 8.7
.target sm_90a
.address_size 64
.visible .entry _attn_bwd_dq(
\t.param .u64 _attn_bwd_dq_param_0
)
{
\t.loc\t1 LINE 0
$L__tmpLABEL:
\tmul.f32 \t%f1, %f2, %f3;   // a comment
\tadd.f32 \t%f4, %f1, %f5;
\tret;
}
\t.file\t1 "PATH"
\t.section\t.debug_info
\t{ .b32 LINE }
"""


def _ptx(line, label, path):
    return PTX.replace("LINE", str(line)).replace("LABEL", str(label)).replace("PATH", path)


def test_ptx_digest_ignores_line_numbers_paths_and_debug_labels():
    from tools.launch_sass import ptx_digest

    base = ptx_digest(_ptx(120, 3, "/a/attn_bwd.py"))
    assert ptx_digest(_ptx(161, 9, "/b/attn_bwd.py")) == base
    changed = _ptx(120, 3, "/a/attn_bwd.py").replace("mul.f32", "fma.rn.f32")
    assert ptx_digest(changed) != base
