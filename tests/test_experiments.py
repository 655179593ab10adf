"""benchmarks/experiments/: the forward TMA / warp-specialisation probe still runs and its variants
still compute attention (its kernels are the lead for the next forward change, see NOTES.md)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

from helpers import DEVICE

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "experiments" / "fwd_ws_probe.py"


def test_forward_probe_variants_match_the_reference(tmp_path):
    out = tmp_path / "probe.json"
    env = dict(os.environ)
    if DEVICE == "cpu":
        env["TRITON_INTERPRET"] = "1"
    run = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--device", DEVICE, "--out", str(out)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    variants = ("tma_ws", "tma", "ptr", "tma_ws_1loop", "host_ws", "host", "host_ws_1loop")
    probes = [r for r in rows if r["variant"] in variants]
    ours = {r["problem"]: r for r in rows if r["variant"] == "ours"}
    assert probes and ours
    for r in probes:
        assert r["status"] == "ok", r
        # Same numerics as our forward: the output error within 2x of our op's on the same inputs.
        assert r["o_err"] <= 2 * ours[r["problem"]]["o_err"] + 1e-6, r


def test_single_pass_backward_probe_matches_ours_and_fp64(tmp_path):
    """The atomic-dQ single-pass probe (NOTES.md plan step 3) computes our `fast` gradients."""
    env = dict(os.environ)
    if DEVICE == "cpu":
        env["TRITON_INTERPRET"] = "1"
    script = SCRIPT.parent / "bwd_single_pass_probe.py"
    run = subprocess.run([sys.executable, str(script), "--quick", "--device", DEVICE, "--out", str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = json.loads((tmp_path / "bwd_single_pass_probe.json").read_text())["rows"]
    single = [r for r in rows if r["variant"] == "single-pass"]
    assert len(single) == 2  # non-causal and causal
    for r in single:
        assert "error" not in r, r
        for name in ("dq", "dk", "dv"):
            # Same math as our `fast` backward, summed in another order: within 2x of our own error.
            assert r["err_vs_fp64"][name] <= 2 * r["ours_err_vs_fp64"][name] + 1e-6, (name, r)
