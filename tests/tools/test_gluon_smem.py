"""The Gluon Hopper kernels, as the launchers configure them, fit Hopper's shared memory.

Shared memory is fixed when Gluon lowers a kernel, before any GPU is involved, so this compiles the
launches of the widest calls for sm_90a on a CPU machine (tools/launch_sass.py: the launchers' real
calls, the Triton wheel's ptxas) and reads what each needs. The one-pass backward's K̃ beside K took
the E 128 CTA to 225 of 227 KiB; with its dQ unsplit it would need more, which the launcher refuses;
the GPU run that found that cost a device call. The compiles run in a child process: under
TRITON_INTERPRET (the CPU suite's) the kernels' Triton helpers are interpreted functions, which Gluon
cannot compile."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from flash_inductor.launch import hopper_bwd
from flash_inductor.launch.visibility import Visibility
from flash_inductor.tuning.footprint import OPTIN_SMEM_BYTES
from test_launch_sass import run_tool

HOPPER_SMEM = OPTIN_SMEM_BYTES[(9, 0)]
# The widest launches of each head dim (case names of tools/launch_sass.py, which picks cases by
# prefix): a key mask's config (forward plain and exact-Δ), the one-pass backward (exact Δ, K̃ for
# dQ) with a key mask, unsplit, with its GQA group split, and at E 64 with its tiles paired
# (HopperBackwardConfig.paired_tiles, which the table picks per bucket).
WIDEST = [f"gluon_{kernel}/bf16/e{e}/key" for kernel in ("fwd", "fwd_exact", "bwd_exact") for e in (64, 128)]


def test_the_gluon_launches_fit_hopper_shared_memory(tmp_path):
    out = tmp_path / "widest.json"
    run = run_tool("--cases", ",".join(WIDEST), "--write", str(out), timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads(out.read_text())
    assert {"gluon_bwd_exact/bf16/e64/key/paired", "gluon_bwd_exact/bf16/e128/key/split2"} | set(WIDEST) <= set(results)
    shared = {f"{case} {kernel}": k["shared"] for case, r in results.items() for kernel, k in r["kernels"].items()
              if kernel.endswith("_hopper")}
    assert len(shared) == len(results), results
    assert all(0 < nbytes <= HOPPER_SMEM for nbytes in shared.values()), shared


def test_the_unsplit_centred_dq_at_e128_is_refused():
    """E 128's one-pass backward with dQ unsplit would not fit; the launcher says so before launching."""
    q, k, v, do, out = (torch.zeros(1, 2, 128, 128, dtype=torch.bfloat16) for _ in range(5))
    lse = torch.zeros(1, 2, 128)
    config = dataclasses.replace(hopper_bwd.default_config(128, True), dq_split=False)
    with pytest.raises(ValueError, match="dq_split=True"):
        hopper_bwd.hopper_attention_backward(do, q, k, v, out, lse, visibility=Visibility(is_causal=True),
                                             config=config, mean_key=torch.zeros(1, 2, 128))
