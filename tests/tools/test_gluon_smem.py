"""The Gluon Hopper kernels, as the launchers configure them, fit Hopper's shared memory.

Shared memory is fixed when Gluon lowers a kernel, before any GPU is involved, so this compiles
each launcher's own config for sm_90a on a CPU machine (tools/hopper_fwd_compile.py and
hopper_bwd_compile.py, with the Triton wheel's ptxas) and reads what it needs. The one-pass
backward's K̃ beside K took the E 128 CTA to 225 of 227 KiB; with its dQ unsplit it would need
more, which the launcher refuses; the GPU run that found that cost a device call. The compiles
run in a child process: under TRITON_INTERPRET (the CPU suite's) the kernels' Triton helpers
are interpreted functions, which Gluon cannot compile."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import pytest

from flash_inductor.launch import hopper, hopper_bwd
from flash_inductor.tuning.footprint import OPTIN_SMEM_BYTES

ROOT = pathlib.Path(__file__).resolve().parents[2]
HOPPER_SMEM = OPTIN_SMEM_BYTES[(9, 0)]

# Reads (tool, kwargs) pairs as JSON on stdin, prints each kernel's shared memory in bytes.
_COMPILE = """
import importlib.util, json, sys
def tool(name):
    spec = importlib.util.spec_from_file_location(name, f"tools/{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
tools = {name: tool(name) for name in ("hopper_fwd_compile", "hopper_bwd_compile")}
print(json.dumps([tools[name].compile_config(**kwargs).metadata.shared for name, kwargs in json.load(sys.stdin)]))
"""


def _shared_bytes(jobs):
    pytest.importorskip("triton.experimental.gluon", reason="a Triton without Gluon has no Hopper kernels")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _COMPILE], input=json.dumps(jobs), cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _forward_job(head_dim, exact_delta):
    """The widest forward of a head dim: causal with a window's left side and a key mask."""
    cfg = hopper.default_config(head_dim, True, key_mask=True, exact_delta=exact_delta)
    return ("hopper_fwd_compile", dict(head_dim=head_dim, dtype="bf16", causal=True, block_m=cfg.block_m,
                                       block_n=cfg.block_n, stages=cfg.num_stages, consumers=cfg.num_consumers,
                                       pingpong=cfg.pingpong, loader_regs=cfg.loader_regs, window=True,
                                       exact_delta=exact_delta, key_bias=True))


def _backward_job(head_dim, cfg, group_split=1, paired_tiles=False):
    """The one-pass backward (exact Δ, K̃ for dQ) with a window and a key mask."""
    return ("hopper_bwd_compile", dict(head_dim=head_dim, dtype="bf16", causal=True, block_m=cfg.block_m,
                                       stages=cfg.num_stages, dq_split=cfg.dq_split, dq_tma=cfg.dq_tma,
                                       consumer_regs=cfg.consumer_regs, loader_regs=cfg.loader_regs,
                                       maxnreg=cfg.maxnreg, window=True, exact_delta=True, key_bias=True,
                                       row_stats_tma=cfg.row_stats_tma, group_split=group_split, centre_keys=True,
                                       paired_tiles=paired_tiles))


def test_the_gluon_launches_fit_hopper_shared_memory():
    """Every head dim's widest forward (plain and exact-Δ) and one-pass backward (unsplit and
    with its group split) in the launchers' default configs fit, E 64's also with its tiles paired
    (HopperBackwardConfig.paired_tiles, which the tuning table picks per bucket); E 128's backward
    with dQ unsplit would not, as ``hopper_attention_backward``'s refusal says."""
    fits = [_forward_job(e, exact_delta) for e in (64, 128) for exact_delta in (False, True)]
    fits += [_backward_job(e, hopper_bwd.default_config(e, True), split) for e in (64, 128) for split in (1, 2)]
    fits.append(_backward_job(64, hopper_bwd.default_config(64, True), paired_tiles=True))
    unsplit = _backward_job(128, dataclasses.replace(hopper_bwd.default_config(128, True), dq_split=False))
    *shared, too_big = _shared_bytes(fits + [unsplit])
    for job, nbytes in zip(fits, shared):
        assert 0 < nbytes <= HOPPER_SMEM, (job, nbytes)
    assert too_big > HOPPER_SMEM, too_big
