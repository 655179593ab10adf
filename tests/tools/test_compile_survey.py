"""tools.compile_survey: Hopper's fp32 tiles compile to loops that keep their working set in registers.

The survey compiles, on a CPU machine, each kernel our launchers would start on an sm_90 GPU and
reads the cubin: registers, stack, and the hottest loop's instructions. fp32's IEEE products run on
the CUDA cores, one FFMA per multiply-add, so a loop's local loads and stores (spilled registers)
against its FFMA say how far it is from issue-bound. The tiles the heuristic gave Hopper until
2026-12-04 made 1.8 local accesses per FFMA at E 128 (and ptxas took 30-41 s on the dK/dV pass);
the small form checks one launch, the full form (-m tools_full) widths 64/128/256, every mask kind
and dropout, and the decode split at each width and mask.

--mix: the backward's inner loops spend one exp2 per score. At E = 64 the backward passes are bound
by per-score ALU work, and exp2 runs on the slowest pipe (MUFU, 16 per cycle per SM against 128 fp32
adds). A 64x64 tile over 4 warps is 32 scores per thread, so every loop that issues the pass's MMAs
must hold exactly 32 MUFU. (A branch inside the loop once made the compiler evaluate both sides: 64.)"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from helpers import small_and_full

ROOT = pathlib.Path(__file__).resolve().parents[2]

# (head dims, masks, dropout probabilities)
FORMS = small_and_full(("128", "causal", "0"), ("64,128,256", "none,causal,bool,float", "0,0.1"))
# The roles' kernels and the share of local memory accesses against FFMA a loop may keep: the
# chosen tiles stay under 5 % (the dQ pass at E 128 without dropout), the former ones were at 180 %.
MAIN_KERNELS = ("_attn_fwd", "_attn_bwd_dkdv", "_attn_bwd_dq")
DECODE_KERNEL = "_attn_decode_split"  # no dropout: one per width and mask
LOCAL_PER_FFMA = 0.1
ONE_EXP2_PER_SCORE = ["_attn_bwd_dkdv", "_attn_bwd_dq"]
# A guard against a hung compile, not a speed check: the full form took over 15 minutes on 2 cores
# shared with other work (2026-12-07), so it gets 40.
TIMEOUT_S = {"small": 900, "full": 2400}


def survey(tmp_path, *args, timeout_s: int = 900) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # interpreted kernels do not compile
    run = subprocess.run([sys.executable, "-m", "tools.compile_survey", "--loops", "--workers", "2",
                          "--out", str(tmp_path), *args],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (path,) = tmp_path.glob("compile_survey_*.json")
    record = json.loads(path.read_text())
    return [dict(zip(record["columns"], row)) for row in record["rows"]]


@pytest.mark.parametrize("form", FORMS)
def test_hopper_fp32_tiles_keep_their_loops_out_of_local_memory(form, tmp_path, request):
    head_dims, masks, dropout = form
    rows = survey(tmp_path, "--dtypes", "fp32", "--head-dims", head_dims, "--masks", masks, "--dropout", dropout,
                  timeout_s=TIMEOUT_S[request.node.callspec.id])
    main = [r for r in rows if r["kernel"] in MAIN_KERNELS]
    decode = [r for r in rows if r["kernel"] == DECODE_KERNEL]
    widths_and_masks = len(head_dims.split(",")) * len(masks.split(","))
    # Each case compiles its own forward (dropout and masks are constexprs) and its two backward passes.
    assert len(main) == 3 * widths_and_masks * len(dropout.split(",")), [(r["case"], r["kernel"]) for r in rows]
    assert len(decode) == widths_and_masks, [(r["case"], r["kernel"]) for r in rows]
    for r in main + decode:
        loop = r["loop"]
        assert loop["FFMA"] >= loop["ideal_ffma"], r  # the dots run on the CUDA cores, all of them in this loop
        assert loop["LDL"] + loop["STL"] <= LOCAL_PER_FFMA * loop["FFMA"], r
        assert r["shared_bytes"] <= 227 * 1024, r


def test_tile_overrides_are_what_compiles(tmp_path):
    """--backward-dq replaces that pass's tile and nothing else; a malformed tile is a usage error."""
    rows = survey(tmp_path, "--dtypes", "fp32", "--head-dims", "64", "--masks", "none", "--no-decode",
                  "--backward-dq", "16x32/w4/s1")
    tiles = {r["kernel"]: r["tile"] for r in rows}
    assert tiles["_attn_bwd_dq"] == "16x32/w4/s1" and tiles["_attn_bwd_dkdv"] != "16x32/w4/s1", tiles
    bad = subprocess.run([sys.executable, "-m", "tools.compile_survey", "--backward-dq", "16x32"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "BLOCK_MxBLOCK_N" in bad.stderr


@pytest.fixture(scope="module")
def mix_rows(tmp_path_factory) -> list[dict]:
    return survey(tmp_path_factory.mktemp("mix"), "--mix", "--dtypes", "bf16", "--head-dims", "64", "--masks", "none",
                  "--schedules", "fast", "--seq", "4096", "--no-decode", "--backward-dkdv", "64x64/w4/s2",
                  "--backward-dq", "64x64/w4/s2")


@pytest.mark.parametrize("kernel", ONE_EXP2_PER_SCORE)
def test_backward_loops_take_one_exp2_per_score(mix_rows, kernel):
    (row,) = [r for r in mix_rows if r["kernel"] == kernel]
    assert row["mix"]["loops"], row
    for loop in row["mix"]["loops"]:
        assert loop["opcodes"].get("MUFU") == 32, loop


def test_mma_kind_tells_wgmma_from_mma_sync():
    """The kernel line names the matrix instructions: a dot whose M side is under wgmma's 64 rows
    compiles to mma.sync (HMMA) on sm_90, as the E = 256 dK/dV pass's 32-key block does."""
    from tools.compile_survey import mma_kind

    wgmma = "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24, gsb0"
    sync = "HMMA.16816.F32.BF16 R4, R8, R12, R4"
    assert mma_kind([wgmma, "FADD R1, R2, R3"]) == "wgmma"
    assert mma_kind([sync]) == "mma.sync"
    assert mma_kind([wgmma, sync]) == "wgmma+mma.sync"
    assert mma_kind(["MUFU.EX2 R1, R2"]) == ""
