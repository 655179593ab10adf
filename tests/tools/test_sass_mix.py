"""tools.sass_mix: the backward's inner loops spend one exp2 per score.

At E = 64 the backward passes are bound by per-score ALU work, and exp2 runs on the slowest pipe
(MUFU, 16 per cycle per SM against 128 fp32 adds). The tool compiles the launches for sm_90 on a
CPU machine and counts each loop's instructions; a 64x64 tile over 4 warps is 32 scores per
thread, so every loop that issues the pass's MMAs must hold exactly 32 MUFU. (A branch inside the
loop once made the compiler evaluate both sides: 64.)"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
ONE_EXP2_PER_SCORE = ["_attn_bwd_dkdv", "_attn_bwd_dq"]


@pytest.fixture(scope="module")
def sass_mix_output():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # interpreted kernels do not compile
    run = subprocess.run([sys.executable, "-m", "tools.sass_mix", "--head-dim", "64", "--seq", "4096",
                          "--schedule", "fast", "--dkdv", "64,64,4,2", "--dq", "64,64,4,2"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout


def _loops(output: str, kernel: str) -> list[str]:
    block = output.split(f"\n{kernel}:", 1)[1].split("\n_", 1)[0]
    return [line for line in block.splitlines() if line.startswith("  loop of ")]


@pytest.mark.parametrize("kernel", ONE_EXP2_PER_SCORE)
def test_backward_loops_take_one_exp2_per_score(sass_mix_output, kernel):
    loops = _loops(sass_mix_output, kernel)
    assert loops, sass_mix_output
    for loop in loops:
        mufu = re.search(r"\bMUFU (\d+)", loop)
        assert mufu and int(mufu.group(1)) == 32, loop


def test_mma_kind_tells_wgmma_from_mma_sync():
    """The kernel line names the matrix instructions: a dot whose M side is under wgmma's 64 rows
    compiles to mma.sync (HMMA) on sm_90, as the E = 256 dK/dV pass's 32-key block does."""
    from tools import sass_mix

    wgmma = "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24, gsb0"
    sync = "HMMA.16816.F32.BF16 R4, R8, R12, R4"
    assert sass_mix.mma_kind([wgmma, "FADD R1, R2, R3"]) == "wgmma"
    assert sass_mix.mma_kind([sync]) == "mma.sync"
    assert sass_mix.mma_kind([wgmma, sync]) == "wgmma+mma.sync"
    assert sass_mix.mma_kind(["MUFU.EX2 R1, R2"]) == ""
