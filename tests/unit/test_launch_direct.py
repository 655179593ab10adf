"""``launch.direct_kernel_calls``: callers outside the ops (the autotuner's timing runner) launch the
kernels straight through Triton, as the ops do, instead of through wrap_triton's HOP dispatch,
whose per-launch host work the tuner would otherwise time (docs/performance.md, host time)."""

from __future__ import annotations

import pytest
import torch

from flash_inductor import launch
from flash_inductor.tuning.buckets import Bucket
from flash_inductor.tuning.configs import heuristic_configs
from flash_inductor.autotune.measure import LaunchRunner, Shape, make_problem
from helpers import DEVICE

triton_lib = pytest.importorskip("torch._library.triton")


def test_direct_kernel_calls_turns_the_hop_off_and_restores_it():
    assert triton_lib.is_wrap_triton_enabled()
    with launch.direct_kernel_calls():
        assert not triton_lib.is_wrap_triton_enabled()
    assert triton_lib.is_wrap_triton_enabled()
    with pytest.raises(KeyError):  # restored when the body raises too
        with launch.direct_kernel_calls():
            raise KeyError("body")
    assert triton_lib.is_wrap_triton_enabled()


def test_without_torchs_switch_calls_go_through_as_before_and_eager_takes_the_op(monkeypatch):
    """The eager fast path relies on direct launches: without torch's switch it hands every call to
    the registered op (whose triton_op body launches directly on its own)."""
    from flash_inductor.ops import attention as ops

    monkeypatch.setattr(launch, "kernel_supports", lambda *tensors: True)  # as on a GPU
    q = torch.randn(1, 2, 8, 16, device=DEVICE)
    assert ops.eager_fast_path_applies(q, q, q, None, None)
    monkeypatch.setattr(launch.common, "_set_wrap_triton_enabled", None)
    assert not launch.can_launch_directly()
    with launch.direct_kernel_calls():
        assert triton_lib.is_wrap_triton_enabled()
    assert not ops.eager_fast_path_applies(q, q, q, None, None)


@pytest.mark.parametrize("pass_name", ["forward", "backward"])
def test_the_tuners_runner_launches_directly(monkeypatch, pass_name):
    """Every launcher call of the tuner's runner happens with the HOP off (and the results are the
    launchers' own)."""
    seen = []
    for name in ("attention_forward", "attention_backward"):
        real = getattr(launch, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            seen.append((_name, triton_lib.is_wrap_triton_enabled()))
            return _real(*args, **kwargs)

        monkeypatch.setattr(launch, name, spy)
    bucket = Bucket("stable", "fp32", 16, "causal", 32, pass_name)
    problem = make_problem(bucket, Shape(1, 2, 32, 32), DEVICE, seed=0)
    configs = heuristic_configs(problem.q, 16, 16, launch.interpreter_enabled(), "stable", "causal")
    runner = LaunchRunner()
    out, lse = runner.forward(problem, configs, "stable")
    if pass_name == "backward":
        grads = runner.backward(problem, out, lse, configs, "stable")
        assert all(g.shape == t.shape for g, t in zip(grads, (problem.q, problem.k, problem.v)))
    assert seen and all(not enabled for _, enabled in seen), seen
    assert torch.isfinite(out).all()
