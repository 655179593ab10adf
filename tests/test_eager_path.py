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


def test_fast_path_launches_directly_not_through_the_tracing_op(monkeypatch):
    """Outside a triton_op, ``wrap_triton`` defaults to the tracing higher-order op; the fast path
    switches that off around its launches, as the op's own body does."""
    from torch._library.triton import is_wrap_triton_enabled

    seen = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append(is_wrap_triton_enabled())

    monkeypatch.setattr(launch, "kernel_supports", lambda q, k, v: True)
    monkeypatch.setattr(launch, "_launcher", lambda kernel: Recorder())
    q, k, v = (t.requires_grad_(True) for t in make_qkv(1, 2, 2, 8, 8, 16, 16, torch.float32, DEVICE))
    out, _ = attention_ops.attention_forward_eager(q, k, v, None, None, 0.0, False, 0, 0.25, "stable")
    out.sum().backward()
    assert len(seen) >= 4 and not any(seen)  # the forward and the backward passes


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
