"""The torch.library ops: opcheck, torch.compile through the public function, and no global
config changes on import.

On CPU the public ops dispatch to the reference path; on CUDA to the Triton kernels. The reference
ops are checked directly as well.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.nn.attention.bias import causal_lower_right

import flash_inductor
from flash_inductor import flash_attention
from helpers import DEVICE, assert_close_to_ref, attention_ref, make_mask, make_qkv, randn

DEVICES = [pytest.param(d, id=d) for d in dict.fromkeys([DEVICE, "cpu"])]

pytestmark = pytest.mark.filterwarnings("ignore:Lower right causal bias will produce NaNs")

# (B, Hq, Hkv, L, S, E, Ev, mask kind, causal offset or None, dropout_p)
SAMPLES = {
    "plain": (1, 2, 2, 9, 13, 8, 8, "none", None, 0.0),
    "bool_mask": (2, 2, 2, 9, 13, 8, 4, "bool", None, 0.0),
    "float_mask_broadcast": (2, 2, 2, 9, 13, 8, 8, "float_bcast", None, 0.0),
    "causal_lower_right_dead_rows": (1, 2, 2, 13, 9, 8, 8, "none", -4, 0.0),
    "gqa_causal": (1, 4, 2, 9, 13, 8, 8, "none", 0, 0.0),
    "dropout_float_mask": (1, 2, 2, 9, 13, 8, 8, "float", None, 0.2),
}


def _forward_args(sample, dtype, device, requires_grad):
    batch, hq, hkv, seq_q, seq_k, e, ev, mask_kind, offset, p = sample
    q, k, v = make_qkv(batch, hq, hkv, seq_q, seq_k, e, ev, dtype, device, seed=3)
    mask = make_mask(mask_kind, batch, hq, seq_q, seq_k, dtype, device, seed=4)
    if requires_grad:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        if mask is not None and mask.is_floating_point():
            mask = mask.detach().clone().requires_grad_()
    seed = torch.tensor([987654321], dtype=torch.int64, device=device) if p > 0 else None
    return (q, k, v, mask, seed, p, offset is not None, offset or 0, e**-0.5)


def _dtype_for(device):
    return torch.float16 if device == "cuda" else torch.float32


@pytest.mark.parametrize("sample", [pytest.param(s, id=n) for n, s in SAMPLES.items()])
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_forward(sample, device):
    dtype = _dtype_for(device)
    for requires_grad in (False, True):
        args = _forward_args(sample, dtype, device, requires_grad)
        torch.library.opcheck(torch.ops.flash_inductor.attention_forward.default, (*args, "stable"))
    # The reference op is the public op's CPU implementation, called inside it: it has no autograd
    # formula of its own (the public op's is used), so it is checked without requires_grad.
    args = _forward_args(sample, dtype, device, False)
    torch.library.opcheck(torch.ops.flash_inductor.attention_forward_reference.default, args)


@pytest.mark.parametrize("sample", [pytest.param(s, id=n) for n, s in SAMPLES.items()])
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_backward(sample, device):
    dtype = _dtype_for(device)
    q, k, v, mask, seed, p, is_causal, offset, scale = _forward_args(sample, dtype, device, False)
    out, lse = torch.ops.flash_inductor.attention_forward(q, k, v, mask, seed, p, is_causal, offset, scale, "stable")
    dout = randn(out.shape, dtype, device, 5)
    mask_grad = mask is not None and mask.is_floating_point()
    for grad_lse in (None, randn(lse.shape, torch.float32, device, 6)):
        common = (dout, q, k, v, mask, out, lse, grad_lse, seed, p, is_causal, offset, scale)
        torch.library.opcheck(torch.ops.flash_inductor.attention_backward.default, (*common, "stable", mask_grad))
        torch.library.opcheck(torch.ops.flash_inductor.attention_backward_reference.default, (*common, mask_grad))


@pytest.mark.parametrize("sample", [pytest.param(SAMPLES[n], id=n) for n in
                                    ("plain", "bool_mask", "causal_lower_right_dead_rows", "gqa_causal")])
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_with_sinks(sample, device):
    """The ops' optional ``sinks`` (last, default None): forward, backward and the sinks' gradient op,
    with and without requires_grad (the forward's autograd returns d sinks)."""
    dtype = _dtype_for(device)
    heads_q = sample[1]
    defaults = (-1, -1, None, 0, 0, 0.0)  # window, block layout, soft cap: the arguments before sinks
    for requires_grad in (False, True):
        args = _forward_args(sample, dtype, device, requires_grad)
        sinks = randn((heads_q,), torch.float32, device, 9).requires_grad_(requires_grad)
        torch.library.opcheck(torch.ops.flash_inductor.attention_forward.default, (*args, "stable", *defaults, sinks))
    args = _forward_args(sample, dtype, device, False)
    sinks = randn((heads_q,), torch.float32, device, 9)
    torch.library.opcheck(torch.ops.flash_inductor.attention_forward_reference.default, (*args, *defaults, sinks))
    q, k, v, mask, seed, p, is_causal, offset, scale = args
    out, lse = torch.ops.flash_inductor.attention_forward(q, k, v, mask, seed, p, is_causal, offset, scale, "stable",
                                                          *defaults, sinks)
    dout = randn(out.shape, dtype, device, 5)
    for grad_lse in (None, randn(lse.shape, torch.float32, device, 6)):
        common = (dout, q, k, v, mask, out, lse, grad_lse, seed, p, is_causal, offset, scale)
        torch.library.opcheck(torch.ops.flash_inductor.attention_backward.default,
                              (*common, "stable", False, *defaults, sinks))
        torch.library.opcheck(torch.ops.flash_inductor.attention_sinks_backward.default,
                              (dout, out, lse, grad_lse, sinks))


def test_sinks_gradient_of_the_op_matches_autograd_through_the_definition():
    """d sinks from the forward op's autograd (attention_sinks_backward) equals autograd through
    the definition (a sink column in the softmax) in fp64, with a gradient on the LSE too and rows
    that see no key."""
    q, k, v = make_qkv(1, 2, 2, 11, 7, 8, 8, torch.float64, "cpu", seed=1)
    sinks = randn((2,), torch.float64, "cpu", 2).requires_grad_()
    weight = randn((1, 2, 11), torch.float64, "cpu", 3)
    dout = randn((1, 2, 11, 8), torch.float64, "cpu", 4)
    # Lower-right causal with L > S: the first 4 rows see no key.
    out, lse = torch.ops.flash_inductor.attention_forward(q, k, v, None, None, 0.0, True, -4, 0.5, "stable",
                                                          -1, -1, None, 0, 0, 0.0, sinks)
    (ours,) = torch.autograd.grad((out * dout).sum() + (lse * weight).sum(), sinks)
    s = (q @ k.transpose(-1, -2)) * 0.5
    s = s.masked_fill(torch.ones(11, 7, dtype=torch.bool).triu(-4 + 1), float("-inf"))
    s = torch.cat([s, sinks[None, :, None, None].expand(1, 2, 11, 1)], -1)
    ref_out = torch.softmax(s, -1)[..., :-1] @ v
    (ref,) = torch.autograd.grad((ref_out * dout).sum() + (torch.logsumexp(s, -1) * weight).sum(), sinks)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse[0, :, :4], sinks.detach()[:, None].expand(2, 4), rtol=0, atol=0)
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------------------------------
# torch.compile
# ------------------------------------------------------------------------------------------


def _compile_inputs(device, dtype, seq_q, seq_k, seed=0):
    q, k, v = make_qkv(2, 4, 2, seq_q, seq_k, 16, 8, dtype, device, seed=seed)
    mask = randn((2, 1, 1, seq_k), dtype, device, seed + 7)
    dout = randn((2, 4, seq_q, 8), dtype, device, seed + 8)
    return [t.detach().requires_grad_() for t in (q, k, v, mask)], dout


def _attention_block(q, k, v, mask, bias):
    # A little model code around the op, so the graph is more than the op alone. (The CausalBias is
    # built outside: Dynamo cannot construct that tensor subclass inside the compiled region.)
    out = flash_attention(q * 0.5, k, v, attn_mask=mask, enable_gqa=True)
    causal = flash_attention(q, k, v, attn_mask=bias, enable_gqa=True)
    return out + causal


def _run_block(fn, device, dtype, seq_q, seq_k):
    leaves, dout = _compile_inputs(device, dtype, seq_q, seq_k)
    out = fn(*leaves, causal_lower_right(seq_q, seq_k))
    out.backward(dout)
    return dict(out=out.detach(), dq=leaves[0].grad, dk=leaves[1].grad, dv=leaves[2].grad, dmask=leaves[3].grad)


def _block_fp64(device, dtype, seq_q, seq_k):
    leaves, dout = _compile_inputs(device, dtype, seq_q, seq_k)
    q, k, v, mask = (t.detach().double().requires_grad_() for t in leaves)
    out = (attention_ref(q * 0.5, k, v, mask)[0]
           + attention_ref(q, k, v, causal_offset=seq_k - seq_q)[0])
    out.backward(dout.double())
    return dict(out=out.detach(), dq=q.grad, dk=k.grad, dv=v.grad, dmask=mask.grad)


def _check_compiled(compiled, device, seq_q, seq_k):
    """Three-way check: fp64 golden, eager in the dtype, compiled. Compiled must be within 2x the
    eager error of the golden (plus the rounding floor); Inductor may reorder the surrounding
    arithmetic (e.g. the broadcast mask's gradient sum), so bitwise equality is not expected."""
    dtype = _dtype_for(device)
    eager = _run_block(_attention_block, device, dtype, seq_q, seq_k)
    comp = _run_block(compiled, device, dtype, seq_q, seq_k)
    golden = _block_fp64(device, dtype, seq_q, seq_k)
    for name in eager:
        assert comp[name].dtype == eager[name].dtype and comp[name].shape == eager[name].shape, name
        assert_close_to_ref(f"{name} (L={seq_q}, S={seq_k}) compiled", comp[name], golden[name], eager[name])


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_matches_eager(device):
    torch._dynamo.reset()
    compiled = torch.compile(_attention_block, fullgraph=True)
    _check_compiled(compiled, device, 9, 13)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_dynamic(device):
    torch._dynamo.reset()
    compiled = torch.compile(_attention_block, fullgraph=True, dynamic=True)
    for seq_q, seq_k in ((9, 13), (17, 11), (5, 30)):
        _check_compiled(compiled, device, seq_q, seq_k)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (runs in the GPU suite)")
@pytest.mark.parametrize("mask_kind,is_causal", [("none", False), ("none", True), ("bool", False)])
def test_eager_cuda_graph_replays_forward_and_backward(mask_kind, is_causal):
    """An eager training step captured with torch.cuda.graph (what make_graphed_callables and
    hand-written graph loops do): every launch of the op and its backward must be capturable
    (no host synchronisation, no pageable copies), and a replay on new data in the static inputs
    must give exactly what an uncaptured call gives (no atomics: the kernels are deterministic)."""
    batch, hq, hkv, seq, e = 2, 4, 2, 80, 64
    q, k, v = (t.requires_grad_() for t in make_qkv(batch, hq, hkv, seq, seq, e, e, torch.float16, "cuda", seed=5))
    mask = make_mask(mask_kind, batch, hq, seq, seq, torch.float16, "cuda") if mask_kind != "none" else None
    dout = randn((batch, hq, seq, e), torch.float16, "cuda", 6)

    def step():
        out = flash_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=True)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    side = torch.cuda.Stream()  # warm-up (compiles, table lookups) off the capture, as PyTorch's docs do
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    with torch.no_grad():
        for seed, static in enumerate((q, k, v, dout), start=20):
            static.copy_(randn(static.shape, torch.float16, "cuda", seed))
    graph.replay()
    expected = step()
    torch.cuda.synchronize()
    for name, got, want in zip(("out", "dq", "dk", "dv"), captured, expected):
        assert torch.isfinite(want).all(), name
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{name}: replay differs from an uncaptured call")


# ------------------------------------------------------------------------------------------
# No import-time side effects
# ------------------------------------------------------------------------------------------

_CONFIG_SNAPSHOT = textwrap.dedent(
    """
    import json, sys
    import torch
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    def snapshot():
        return {name: repr(value) for module in (dynamo_config, inductor_config)
                for name, value in sorted(module.get_config_copy().items())
                for name in [module.__name__ + "." + name]}

    before = snapshot()
    import flash_inductor
    flash_inductor.flash_attention(torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8))
    after = snapshot()
    changed = {k: (before[k], after.get(k)) for k in before if before[k] != after.get(k)}
    print(json.dumps({"changed": changed, "n": len(before)}))
    """
)


def test_import_does_not_change_global_configs():
    completed = subprocess.run([sys.executable, "-c", _CONFIG_SNAPSHOT], capture_output=True, text=True,
                               timeout=300)
    assert completed.returncode == 0, completed.stderr
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    assert result["n"] > 100  # the snapshot really covers both configs
    assert result["changed"] == {}, f"importing flash_inductor changed: {result['changed']}"


def test_public_api():
    assert flash_inductor.__all__ == ["flash_attention", "flash_attention_varlen", "BlockSparseLayout", "backend", "make_backend", "explain", "last_report", "monitor",
                                      "SCHEDULES", "DEFAULT_SCHEDULE", "PrecisionSchedule", "__version__"]
    assert sorted(flash_inductor.SCHEDULES) == ["accurate", "fast", "fp8", "stable"]
    assert flash_inductor.DEFAULT_SCHEDULE == "stable"


@pytest.mark.parametrize("shape", [(2, 1, 1, 48), (48,), (2, 3, 32, 40)])
def test_launcher_refuses_a_mask_not_broadcast_to_the_problem(shape):
    """The kernels index the mask by its four strides: the launchers take it only broadcast to
    (B, Hq, L, S), as the API passes it, and name the argument otherwise (a raw (B, 1, 1, S) mask
    would be read out of bounds)."""
    from flash_inductor import launch

    q = randn((2, 3, 32, 16), torch.float32, DEVICE, seed=0)
    k, v = (randn((2, 3, 48, 16), torch.float32, DEVICE, seed=s) for s in (1, 2))
    mask = (torch.rand(shape, generator=torch.Generator().manual_seed(3)) > 0.3).to(DEVICE)
    with pytest.raises(ValueError, match="attn_mask"):
        launch.attention_forward(q, k, v, mask, None, 0.0, 0.25, "stable")
    if shape == (2, 1, 1, 48):  # broadcast first, the launcher takes it and computes the masked attention
        out, _ = launch.attention_forward(q, k, v, mask.expand(2, 3, 32, 48), None, 0.0, 0.25, "stable")
        ref, _ = attention_ref(q, k, v, mask, scale=0.25)
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25)
        assert_close_to_ref("out", out, ref, sdpa)
