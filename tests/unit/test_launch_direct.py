"""Kernels launch as plain Triton launches, and under ``torch.compile`` the attention ops stay
opaque: one node each, whose kernels are chosen and launched when it runs. When the ops were
``triton_op``s, torch analysed every kernel launch's TTIR several times per call site, which made
the backward's four kernels the largest part of a model's compile (benchmarks/cold_start.py)."""

from __future__ import annotations

import torch

import flash_inductor
from flash_inductor.launch import common
from helpers import DEVICE


def test_the_launcher_is_the_kernel_itself():
    """No torch wrapper (wrap_triton's higher-order op) between a launcher and its kernel: it indexes
    the kernel itself, and calls what that gives with FMA contraction stated."""
    from flash_inductor.kernels.attn_fwd import _attn_fwd

    assert common.launcher(_attn_fwd).kernel is _attn_fwd
    calls = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **options: calls.append((grid, args, options))

    common.launcher(Kernel())[(3, 1)]("x", num_warps=4)
    assert calls == [((3, 1), ("x",), {"num_warps": 4, "enable_fp_fusion": True})]


def _compiled_graph_targets(fn, *args):
    """The call targets of the forward and backward graphs AOT autograd hands the compiler."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    targets = []

    def capture(gm, _inputs):
        targets.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    out = torch.compile(fn, backend=aot_autograd(fw_compiler=capture, bw_compiler=capture))(*args)
    out.sum().backward()
    return targets


def test_compiled_attention_is_one_opaque_node_each_way():
    q, k, v = (torch.randn(1, 2, 16, 8, device=DEVICE, requires_grad=True) for _ in range(3))
    targets = _compiled_graph_targets(lambda q, k, v: flash_inductor.flash_attention(q, k, v, is_causal=True),
                                      q, k, v)
    ours = [t for t in targets if t.startswith("flash_inductor.")]
    assert ours == ["flash_inductor.attention_forward.default", "flash_inductor.attention_backward.default"], targets
    assert not any("triton_kernel_wrapper" in t for t in targets), targets


def test_a_replaced_launcher_sees_every_launch_in_its_block_only():
    """``common.launches_replaced`` is context-local: inside the block the replacement gets each
    kernel (the compile check records launches this way), and afterwards the kernel itself again."""
    from flash_inductor.kernels.attn_fwd import _attn_fwd

    with common.launches_replaced(lambda kernel: ("replaced", kernel)):
        assert common.launcher(_attn_fwd).kernel == ("replaced", _attn_fwd)
    assert common.launcher(_attn_fwd).kernel is _attn_fwd


class _CountingSchedules(dict):
    """``schedules.SCHEDULES`` counting its lookups: each is one resolution of a schedule's name."""

    lookups = 0

    def __contains__(self, name):
        type(self).lookups += 1
        return super().__contains__(name)


def test_the_op_resolves_the_schedule_once_and_hands_one_record_down(monkeypatch):
    """The kernel path's layers (decode and Hopper routing, the Triton launchers, their configs and
    switches) read the call's resolved schedule: describing the call is the only name lookup."""
    from flash_inductor import schedules
    from flash_inductor.launch import hopper
    from flash_inductor.ops.attention import _kernel_forward, describe_call

    monkeypatch.setattr(schedules, "SCHEDULES", _CountingSchedules(schedules.SCHEDULES))
    monkeypatch.setattr(_CountingSchedules, "lookups", 0)
    seen = []
    monkeypatch.setattr(hopper, "hopper_forward_unsupported_reason",
                        lambda *args, **kwargs: seen.append(args[6]) or "not on a CUDA device")
    # The kernels' own tensors: on CPU the conftest runs them interpreted, on a GPU they launch.
    q, k, v = (torch.randn(1, 2, 16, 8, device=DEVICE) for _ in range(3))
    call = describe_call(q, k, v, 0.0, True, 0, 0.5, "fast", 4, 0)
    assert _CountingSchedules.lookups == 1 and call.schedule is schedules.FAST
    assert (call.batch, call.heads_q, call.seq_q, call.seq_k, call.head_dim) == (1, 2, 16, 16, 8)
    out, _ = _kernel_forward(q, k, v, None, None, call)
    assert _CountingSchedules.lookups == 1 and seen == [schedules.FAST]
    torch.testing.assert_close(out, flash_inductor.flash_attention(q, k, v, is_causal=True, scale=0.5,
                                                                   window=(4, 0), schedule="fast"),
                               rtol=1e-4, atol=1e-5)


def test_an_eager_call_resolves_its_schedule_once(monkeypatch):
    """The eager entry resolves a name once for its routing checks and launches (flash_attention
    resolves it and hands the schedule down); the registered op (here: CPU tensors, the op's
    reference path) gets the name again."""
    from flash_inductor import schedules
    from flash_inductor.ops.attention import attention_forward_eager

    monkeypatch.setattr(schedules, "SCHEDULES", _CountingSchedules(schedules.SCHEDULES))
    monkeypatch.setattr(_CountingSchedules, "lookups", 0)
    q, k, v = (torch.randn(1, 2, 16, 8, requires_grad=True) for _ in range(3))
    out, _ = attention_forward_eager(q, k, v, None, None, 0.0, True, 0, 0.5, "fast")
    assert _CountingSchedules.lookups == 1
    flash_inductor.flash_attention(q, k, v, is_causal=True, schedule="fast")  # the API resolves, then hands down
    assert _CountingSchedules.lookups == 2
    out.sum().backward()
    assert q.grad is not None
