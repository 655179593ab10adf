"""The eager fast path (``ops/attention.py``): plain eager CUDA calls skip the op dispatcher.

It must be the op in everything but host time: the same launches, so bitwise the same outputs
and gradients (mask gradient and LSE gradient included), the same refusal of double backward,
and never taken where the registered op is needed (compiling, fake tensors, functorch
transforms, tensor subclasses, inputs the kernels do not take). On CPU the kernels run under
the interpreter, so the comparison forces ``kernel_supports`` to accept CPU tensors.
"""

from __future__ import annotations

import pytest
import torch

from flash_inductor import launch
from flash_inductor.ops import attention as attention_ops
from helpers import DEVICE, ON_CUDA, make_mask, make_qkv, randn

pytestmark = pytest.mark.launches_kernels


@pytest.fixture
def kernels_take_cpu(monkeypatch):
    if not ON_CUDA:
        monkeypatch.setattr(launch, "kernel_supports", lambda q, k, v: True)


def _both_paths(q, k, v, mask, schedule="stable", dropout_p=0.0):
    seed = torch.tensor([77], dtype=torch.int64, device=DEVICE) if dropout_p > 0 else None
    args = (mask, seed, dropout_p, True, 3, q.shape[-1] ** -0.5, schedule)
    results = []
    for call in (attention_ops.attention_forward_eager, torch.ops.flash_inductor.attention_forward):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, mask)]
        out, lse = call(*leaves[:3], leaves[3], *args[1:])
        dout = randn(out.shape, out.dtype, DEVICE, seed=5)
        (out * dout).sum().add(lse.nan_to_num(neginf=0.0).sum()).backward()
        results.append([out, lse] + [t.grad for t in leaves])
    return results


def test_fast_path_is_bitwise_the_op(kernels_take_cpu):
    q, k, v = make_qkv(1, 4, 2, 21, 24, 16, 16, torch.float16, DEVICE, seed=1)
    mask = make_mask("float", 1, 4, 21, 24, torch.float16, DEVICE)
    assert attention_ops.eager_fast_path_applies(q, k, v, mask, None)
    fast, op = _both_paths(q, k, v, mask, dropout_p=0.2)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dmask"), fast, op):
        assert a is not None and torch.equal(a, b), name


def test_fast_path_refuses_double_backward(kernels_take_cpu):
    q, k, v = (t.requires_grad_(True) for t in make_qkv(1, 2, 2, 8, 8, 16, 16, torch.float32, DEVICE))
    out, _ = attention_ops.attention_forward_eager(q, k, v, None, None, 0.0, False, 0, 0.25, "stable")
    (dq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        dq.sum().backward()


def test_fast_path_only_for_plain_eager_kernel_calls(kernels_take_cpu):
    q, k, v = make_qkv(1, 2, 2, 8, 8, 16, 16, torch.float32, DEVICE)
    assert attention_ops.eager_fast_path_applies(q, k, v, None, None)

    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = mode.from_tensor(q)
        assert not attention_ops.eager_fast_path_applies(fake, fake, fake, None, None)

    seen = []

    def inside_vmap(x):
        seen.append(attention_ops.eager_fast_path_applies(x, x, x, None, None))
        return x

    torch.vmap(inside_vmap)(q)
    assert seen == [False]

    class Marked(torch.Tensor):
        pass

    assert not attention_ops.eager_fast_path_applies(q.as_subclass(Marked), k, v, None, None)
    seen.clear()

    def compiled(x):
        seen.append(attention_ops.eager_fast_path_applies(x, x, x, None, None))
        return x + 1

    torch.compile(compiled, backend="eager", fullgraph=True)(q)
    assert seen == [False]


def test_inputs_the_kernels_do_not_take_use_the_op():
    q, k, v = make_qkv(1, 2, 2, 8, 8, 16, 16, torch.float64, DEVICE)
    assert not attention_ops.eager_fast_path_applies(q, k, v, None, None)
    out, lse = attention_ops.attention_forward_eager(q, k, v, None, None, 0.0, False, 0, 0.25, "stable")
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.25)
    assert torch.allclose(out, ref, atol=1e-12, rtol=0)


def test_fast_path_launches_the_kernels_forward_and_backward(monkeypatch):
    """The fast path reaches the launchers for the forward and every backward pass (the launches
    themselves are recorded, not run)."""
    seen = []

    class Recorder:
        def __init__(self, kernel):
            self.name = kernel.fn.__name__

        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append(self.name)

    monkeypatch.setattr(launch, "kernel_supports", lambda q, k, v: True)
    monkeypatch.setattr(launch.common, "launcher", Recorder)
    q, k, v = (t.requires_grad_(True) for t in make_qkv(1, 2, 2, 8, 8, 16, 16, torch.float32, DEVICE))
    out, _ = attention_ops.attention_forward_eager(q, k, v, None, None, 0.0, False, 0, 0.25, "stable")
    out.sum().backward()
    assert "_attn_fwd" in seen and {"_attn_bwd_dq", "_attn_bwd_dkdv"} <= set(seen), seen


def test_inference_skips_autograd_and_matches_the_op(kernels_take_cpu, monkeypatch):
    """With nothing to differentiate (no_grad, or no input needing a gradient) the fast path is the
    launch alone: bitwise the op's outputs, no autograd node. With a gradient to record it goes
    through the autograd.Function."""
    q, k, v = make_qkv(1, 2, 2, 9, 12, 16, 16, torch.float16, DEVICE, seed=4)
    args = (None, None, 0.0, True, 3, 0.25, "stable")
    applied = []
    real_apply = attention_ops._EagerKernelAttention.apply
    monkeypatch.setattr(attention_ops._EagerKernelAttention, "apply",
                        lambda *a: applied.append(True) or real_apply(*a))
    reference = torch.ops.flash_inductor.attention_forward(q, k, v, *args)
    for context, inputs in ((torch.no_grad(), (q, k, v)), (torch.enable_grad(), (q, k, v))):
        with context:
            out, lse = attention_ops.attention_forward_eager(*inputs, *args)
        assert out.grad_fn is None and torch.equal(out, reference[0]) and torch.equal(lse, reference[1])
    assert not applied
    with torch.no_grad():  # inputs that want gradients, in no_grad: still nothing to record
        attention_ops.attention_forward_eager(q.clone().requires_grad_(), k, v, *args)
    assert not applied
    out, _ = attention_ops.attention_forward_eager(q.clone().requires_grad_(), k, v, *args)
    assert applied and out.grad_fn is not None


def _spy_backward_grad_lse(monkeypatch):
    """Record the grad_lse every backward launch receives."""
    seen = []
    real = launch.attention_backward

    def spy(grad_out, query, key, value, attn_mask, out, lse, grad_lse, *args, **kwargs):
        seen.append(grad_lse)
        return real(grad_out, query, key, value, attn_mask, out, lse, grad_lse, *args, **kwargs)

    monkeypatch.setattr(launch, "attention_backward", spy)
    return seen


def test_an_unused_lse_reaches_the_backward_as_none(kernels_take_cpu, monkeypatch):
    """Autograd's default would hand the backward zeros for the lse the caller never used: a fill
    launch, and the kernels' dLSE path (the autotuner times the path without it). Both eager paths
    leave it undefined, and so does the compiled graph's backward (no zeros node feeding it)."""
    seen = _spy_backward_grad_lse(monkeypatch)
    args = (None, None, 0.0, True, 0, 0.25, "stable")
    for call in (attention_ops.attention_forward_eager, torch.ops.flash_inductor.attention_forward):
        q, k, v = (t.requires_grad_(True) for t in make_qkv(1, 2, 2, 9, 12, 16, 16, torch.float16, DEVICE, seed=2))
        out, _ = call(q, k, v, *args)
        out.sum().backward()
    assert seen == [None, None]


def test_an_unused_lse_gets_no_zeros_in_the_compiled_backward(monkeypatch):
    """The same under AOT autograd's tracing: the backward graph passes None for dLSE and holds no
    zeros node. The reference ops stand in for the kernels (traced, the kernel path becomes wrapper
    nodes; whether dLSE is materialised is decided by autograd, above either path)."""
    monkeypatch.setattr(launch, "kernel_supports", lambda q, k, v: False)
    args = (None, None, 0.0, True, 0, 0.25, "stable")
    from functorch.compile import aot_function

    backward_graphs = []

    def keep_backward(gm, example_inputs):
        backward_graphs.append(gm)
        return gm

    compiled = aot_function(lambda q, k, v: torch.ops.flash_inductor.attention_forward(q, k, v, *args)[0],
                            fw_compiler=lambda gm, example_inputs: gm, bw_compiler=keep_backward)
    q, k, v = (t.requires_grad_(True) for t in make_qkv(1, 2, 2, 9, 12, 16, 16, torch.float32, DEVICE, seed=2))
    compiled(q, k, v).sum().backward()
    (graph,) = backward_graphs
    calls = [n for n in graph.graph.nodes if n.op == "call_function" and "attention_backward" in str(n.target)]
    assert calls and all(n.args[7] is None for n in calls), [n.args for n in calls]
    assert not any("zeros" in str(n.target) for n in graph.graph.nodes)


@pytest.mark.parametrize("is_causal", [False, True])
def test_a_gradient_through_lse_alone_is_right(kernels_take_cpu, is_causal):
    """With only lse used, out's gradient is undefined and the backward feeds the kernels a zero dO:
    the gradient of sum(lse) must match a float64 logsumexp within twice PyTorch's own fp32 error."""
    scale = 16 ** -0.5
    q, k, v = make_qkv(1, 2, 2, 9, 12, 16, 16, torch.float32, DEVICE, seed=8)
    weights = randn((1, 2, 9), torch.float32, DEVICE, seed=9)

    def logsumexp_grads(dtype):
        leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k)]
        scores = leaves[0] @ leaves[1].transpose(-2, -1) * scale
        if is_causal:
            keep = torch.ones(9, 12, dtype=torch.bool, device=DEVICE).tril()
            scores = scores.masked_fill(~keep, float("-inf"))
        (torch.logsumexp(scores, dim=-1) * weights.to(dtype)).sum().backward()
        return [t.grad for t in leaves]

    exact, torch_fp32 = logsumexp_grads(torch.float64), logsumexp_grads(torch.float32)
    for call in (attention_ops.attention_forward_eager, torch.ops.flash_inductor.attention_forward):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        _, lse = call(*leaves, None, None, 0.0, is_causal, 0, scale, "stable")
        (lse * weights).sum().backward()
        assert torch.count_nonzero(leaves[2].grad) == 0  # v does not enter lse
        for ours, ref, theirs in zip(leaves[:2], exact, torch_fp32):
            torch_error = (theirs.double() - ref).abs().max().item()
            ours_error = (ours.grad.double() - ref).abs().max().item()
            assert ours_error <= 2 * torch_error + 4 * torch.finfo(torch.float32).eps * ref.abs().max().item()
