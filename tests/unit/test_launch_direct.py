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
    """No torch wrapper (wrap_triton's higher-order op) between a launcher and its kernel."""
    from flash_inductor.kernels.attn_fwd import _attn_fwd

    assert common.launcher(_attn_fwd) is _attn_fwd


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
