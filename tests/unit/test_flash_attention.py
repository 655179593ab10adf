"""The public ``flash_attention`` end to end, against the float64 reference.

Runs on the kernel device (CUDA: the Triton kernels) and always on the CPU too (the reference
path). Checks forward and backward with the tolerance rule of tests/helpers.py, SDPA's argument
semantics (ranks, is_causal, CausalBias, enable_gqa, scale, broadcast masks and their gradients),
the output contract, and fp64 gradcheck.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import pytest
import torch
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

from flash_inductor import flash_attention
from helpers import (
    DEVICE,
    assert_close_to_ref,
    assert_dead_rows_exact,
    dropout_keep,
    dtype_id,
    randn,
    ref_forward_backward,
    sdpa_baseline,
)

DEVICES = [pytest.param(d, id=d) for d in dict.fromkeys([DEVICE, "cpu"])]
pytestmark = pytest.mark.filterwarnings("ignore:Lower right causal bias will produce NaNs")
DTYPES = [pytest.param(d, id=dtype_id(d)) for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64)]


@dataclasses.dataclass(frozen=True)
class ApiCase:
    q_shape: tuple = (2, 2, 33, 40)  # (..., Hq, L, E)
    kv_heads: Optional[int] = None  # None: same as query
    seq_k: int = 50
    head_dim_v: int = 24
    mask: str = "none"  # none | bool | float | bool_dead_rows | float_dead_rows
    mask_shape: Optional[tuple] = None  # None: (..., Hq, L, S)
    mask_grad: bool = False
    is_causal: bool = False
    causal_bias: Optional[str] = None  # upper_left | lower_right
    enable_gqa: bool = False
    scale: Optional[float] = None
    dropout_p: float = 0.0
    noncontig: bool = False

    def with_(self, **changes) -> "ApiCase":
        return dataclasses.replace(self, **changes)


def _leaf(shape, dtype, device, seed, noncontig=False, mult=1.0):
    if noncontig and len(shape) == 4:
        b, h, n, e = shape
        t = randn((b, n, h, e), dtype, device, seed, mult).transpose(1, 2)
    else:
        t = randn(shape, dtype, device, seed, mult)
    return t.detach().requires_grad_()


def _make_mask(case: ApiCase, full_shape, dtype, device):
    if case.mask == "none":
        return None
    shape = case.mask_shape or full_shape
    g = torch.Generator().manual_seed(11)
    if case.mask.startswith("bool"):
        mask = torch.rand(shape, generator=g) < 0.75
    else:
        mask = torch.randn(shape, generator=g, dtype=torch.float64)
        mask = mask.masked_fill(torch.rand(shape, generator=g) < 0.15, float("-inf"))
    if case.mask.endswith("dead_rows"):
        rows = [0, shape[-2] // 2]
        if mask.dtype == torch.bool:
            mask[..., rows, :] = False
        else:
            mask[..., rows, :] = float("-inf")
    mask = mask.to(device)
    if mask.is_floating_point():
        mask = mask.to(dtype).requires_grad_(case.mask_grad)
    return mask


def run_api_case(case: ApiCase, dtype, device, seed=0):
    seq_q, head_dim = case.q_shape[-2:]
    kv_lead = case.q_shape[:-2]
    if len(case.q_shape) >= 4 and case.kv_heads is not None:
        kv_lead = (*case.q_shape[:-3], case.kv_heads)
    q = _leaf(case.q_shape, dtype, device, seed, case.noncontig)
    k = _leaf((*kv_lead, case.seq_k, head_dim), dtype, device, seed + 1, case.noncontig)
    v = _leaf((*kv_lead, case.seq_k, case.head_dim_v), dtype, device, seed + 2, case.noncontig)
    full_mask_shape = (*case.q_shape[:-1], case.seq_k)
    mask = _make_mask(case, full_mask_shape, dtype, device)
    dout = randn((*case.q_shape[:-1], case.head_dim_v), dtype, device, seed + 3)

    causal_offset = None
    attn_mask = mask
    if case.is_causal:
        causal_offset = 0  # SDPA's is_causal is top-left aligned, also when L != S
    if case.causal_bias == "upper_left":
        attn_mask, causal_offset = causal_upper_left(seq_q, case.seq_k), 0
    elif case.causal_bias == "lower_right":
        attn_mask, causal_offset = causal_lower_right(seq_q, case.seq_k), case.seq_k - seq_q

    keep = None
    rng_state = 1234 + seed
    if case.dropout_p > 0:
        # The seed the API draws: one int64 from the device's default generator (see api.py). The
        # test redraws it to build the same Philox keep mask for the fp64 reference.
        torch.manual_seed(rng_state)
        drawn = int(torch.randint(0, 2**62, (1,), dtype=torch.int64, device=device).item())
        assert len(case.q_shape) == 4
        keep = dropout_keep(drawn, *case.q_shape[:3], case.seq_k, case.dropout_p, device)
    torch.manual_seed(rng_state)
    out = flash_attention(q, k, v, attn_mask=attn_mask, dropout_p=case.dropout_p, is_causal=case.is_causal,
                          scale=case.scale, enable_gqa=case.enable_gqa)
    out.backward(dout)
    ours = dict(out=out.detach(), dq=q.grad, dk=k.grad, dv=v.grad)
    if case.mask_grad:
        ours["dmask"] = mask.grad
    kwargs = dict(causal_offset=causal_offset, scale=case.scale, dropout_mask=keep, dropout_p=case.dropout_p,
                  grad_out=dout, mask_grad=case.mask_grad)
    return ours, out, (q, k, v, mask, dout), kwargs


def check_api_case(case: ApiCase, dtype, device, seed=0):
    ours, out, (q, k, v, mask, dout), kwargs = run_api_case(case, dtype, device, seed)
    ref = ref_forward_backward(q, k, v, mask, **kwargs)
    base = sdpa_baseline(q, k, v, mask, **kwargs)

    assert out.dtype == dtype and out.device == q.device
    assert out.shape == (*case.q_shape[:-1], case.head_dim_v)
    assert out.is_contiguous()
    for name, t in (("dq", q), ("dk", k), ("dv", v)):
        assert ours[name].shape == t.shape and ours[name].dtype == dtype, name
    if case.mask_grad:
        assert ours["dmask"].shape == mask.shape and ours["dmask"].dtype == mask.dtype
    for name in ["out", "dq", "dk", "dv"] + (["dmask"] if case.mask_grad else []):
        assert_close_to_ref(name, ours[name], ref[name], base[name], terms=ref["terms"].get(name))
    full_mask = mask.detach().expand(*case.q_shape[:-1], case.seq_k) if mask is not None else None
    return assert_dead_rows_exact(q.detach(), k.detach(), full_mask, kwargs["causal_offset"], ours["out"],
                                  dq=ours["dq"], dk=ours["dk"], dv=ours["dv"])


_B = ApiCase()
FEATURES = {
    "plain": _B,
    "is_causal_top_left_L<S": _B.with_(is_causal=True),
    "is_causal_top_left_L>S": _B.with_(is_causal=True, seq_k=20),
    "causal_bias_upper_left": _B.with_(causal_bias="upper_left"),
    "causal_bias_lower_right_L<S": _B.with_(causal_bias="lower_right"),
    "causal_bias_lower_right_L>S_dead_rows": _B.with_(causal_bias="lower_right", seq_k=20),
    "bool_mask": _B.with_(mask="bool"),
    "bool_mask_2d_broadcast": _B.with_(mask="bool", mask_shape=(33, 50)),
    "float_mask_grad": _B.with_(mask="float", mask_grad=True),
    "float_mask_broadcast_grad_B11S": _B.with_(mask="float", mask_shape=(2, 1, 1, 50), mask_grad=True),
    "float_mask_broadcast_grad_HLS": _B.with_(mask="float", mask_shape=(2, 33, 50), mask_grad=True),
    "float_mask_no_grad": _B.with_(mask="float"),
    "bool_dead_rows": _B.with_(mask="bool_dead_rows"),
    "float_dead_rows_grad": _B.with_(mask="float_dead_rows", mask_grad=True),
    "gqa": _B.with_(q_shape=(2, 4, 33, 40), kv_heads=2, enable_gqa=True),
    "mqa_causal": _B.with_(q_shape=(2, 3, 33, 40), kv_heads=1, enable_gqa=True, is_causal=True),
    "enable_gqa_same_heads": _B.with_(enable_gqa=True),
    "scale_0.5": _B.with_(scale=0.5),
    "noncontig": _B.with_(noncontig=True),
    "no_keys_S0": _B.with_(seq_k=0, mask="float", mask_grad=True),
    "no_queries_L0": _B.with_(q_shape=(2, 2, 0, 40), is_causal=True),
    "dropout": _B.with_(dropout_p=0.3),
    "dropout_gqa_causal_float_mask_grad": _B.with_(q_shape=(2, 4, 33, 40), kv_heads=2, enable_gqa=True,
                                                   dropout_p=0.2, causal_bias="lower_right"),
}


@pytest.mark.parametrize("case", [pytest.param(c, id=n) for n, c in FEATURES.items()])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_matches_fp64(case, dtype, device):
    check_api_case(case, dtype, device)


RANKS = {
    "2d_L_E": ApiCase(q_shape=(33, 40)),
    "2d_causal_bias_lower_right": ApiCase(q_shape=(33, 40), seq_k=20, causal_bias="lower_right"),
    "3d_N_L_E_float_mask_grad": ApiCase(q_shape=(3, 33, 40), mask="float", mask_shape=(33, 50), mask_grad=True),
    "3d_is_causal": ApiCase(q_shape=(3, 33, 40), is_causal=True),
    "5d_bool_mask": ApiCase(q_shape=(2, 3, 2, 33, 40), mask="bool", mask_shape=(3, 1, 33, 50)),
    "5d_float_mask_broadcast_grad": ApiCase(q_shape=(2, 3, 2, 33, 40), mask="float", mask_shape=(3, 1, 1, 50),
                                            mask_grad=True),
    "5d_gqa_causal": ApiCase(q_shape=(2, 3, 4, 33, 40), kv_heads=2, enable_gqa=True, is_causal=True),
}


@pytest.mark.parametrize("case", [pytest.param(c, id=n) for n, c in RANKS.items()])
@pytest.mark.parametrize("dtype", [pytest.param(d, id=dtype_id(d)) for d in (torch.float16, torch.float32)])
@pytest.mark.parametrize("device", DEVICES)
def test_input_ranks(case, dtype, device):
    check_api_case(case, dtype, device)


@pytest.mark.parametrize("device", DEVICES)
def test_is_causal_is_top_left_like_sdpa(device):
    """L > S with is_causal: SDPA (top-left) and we agree, and no row is fully masked."""
    case = ApiCase(q_shape=(1, 2, 40, 16), seq_k=24, head_dim_v=16, is_causal=True)
    assert check_api_case(case, torch.float32, device) == 0


@pytest.mark.parametrize("device", DEVICES)
def test_fully_masked_rows_no_nan(device):
    """Every row fully masked in one head, some rows in the other: output and gradients are finite,
    exactly zero where nothing is visible, and correct elsewhere."""
    q = randn((1, 2, 20, 16), torch.float16, device, 0).requires_grad_()
    k = randn((1, 2, 30, 16), torch.float16, device, 1).requires_grad_()
    v = randn((1, 2, 30, 16), torch.float16, device, 2).requires_grad_()
    mask = torch.rand((1, 2, 20, 30), generator=torch.Generator().manual_seed(0)) < 0.5
    mask[:, 0] = False
    mask[:, 1, ::3] = False
    mask = mask.to(device)
    out = flash_attention(q, k, v, attn_mask=mask)
    out.sum().backward()
    for t in (out, q.grad, k.grad, v.grad):
        assert torch.isfinite(t).all()
    assert (out[:, 0] == 0).all() and (q.grad[:, 0] == 0).all()
    assert (k.grad[:, 0] == 0).all() and (v.grad[:, 0] == 0).all()
    assert (out[:, 1, ::3] == 0).all() and (q.grad[:, 1, ::3] == 0).all()
    dead = assert_dead_rows_exact(q.detach(), k.detach(), mask, None, out.detach(), dq=q.grad, dk=k.grad,
                                  dv=v.grad)
    assert dead == 20 + 7


@pytest.mark.parametrize("device", DEVICES)
def test_output_contract(device):
    q = randn((2, 3, 9, 8), torch.float16, device, 0)
    k = randn((2, 3, 11, 8), torch.float16, device, 1)
    v = randn((2, 3, 11, 5), torch.float16, device, 2)
    out = flash_attention(q, k, v)
    assert out.shape == (2, 3, 9, 5) and out.dtype == torch.float16 and out.device == q.device
    assert out.is_contiguous() and out.stride() == (135, 45, 5, 1)
    assert not out.requires_grad
    out = flash_attention(q.requires_grad_(), k, v)
    assert out.requires_grad and out.grad_fn is not None


# ------------------------------------------------------------------------------------------
# float64: gradcheck
# ------------------------------------------------------------------------------------------

GRADCHECK = {
    "plain": dict(),
    "gqa_causal_lower_right_dead_rows": dict(q_heads=4, kv_heads=2, seq_q=6, seq_k=4, causal_bias="lower_right"),
    "float_mask_broadcast": dict(mask="float", mask_shape=(1, 1, 5, 7)),
    "bool_mask_dead_row": dict(mask="bool_dead_rows"),
    "dropout": dict(dropout_p=0.3),
    "dropout_causal": dict(dropout_p=0.25, is_causal=True),
    "dropout_float_mask": dict(dropout_p=0.25, mask="float"),
}


@pytest.mark.parametrize("variant", [pytest.param(v, id=n) for n, v in GRADCHECK.items()])
@pytest.mark.parametrize("device", DEVICES)
def test_gradcheck_fp64(variant, device):
    q_heads, kv_heads = variant.get("q_heads", 2), variant.get("kv_heads", 2)
    seq_q, seq_k = variant.get("seq_q", 5), variant.get("seq_k", 7)
    q = randn((1, q_heads, seq_q, 4), torch.float64, device, 0).requires_grad_()
    k = randn((1, kv_heads, seq_k, 4), torch.float64, device, 1).requires_grad_()
    v = randn((1, kv_heads, seq_k, 3), torch.float64, device, 2).requires_grad_()
    inputs = [q, k, v]
    mask_kind = variant.get("mask")
    full = (1, q_heads, seq_q, seq_k)
    g = torch.Generator().manual_seed(5)
    bias = None
    if mask_kind == "float":
        shape = variant.get("mask_shape", full)
        m = torch.randn(shape, generator=g, dtype=torch.float64)
        m = m.masked_fill(torch.rand(shape, generator=g) < 0.2, float("-inf"))
        inputs.append(m.to(device).requires_grad_())
    elif mask_kind == "bool_dead_rows":
        m = torch.rand(full, generator=g) < 0.7
        m[:, :, 1] = False
        bias = m.to(device)
    if variant.get("causal_bias") == "lower_right":
        bias = causal_lower_right(seq_q, seq_k)
    p = variant.get("dropout_p", 0.0)
    is_causal = variant.get("is_causal", False)

    def fn(q, k, v, *mask):
        torch.manual_seed(0)  # same dropout mask on every evaluation
        attn_mask = mask[0] if mask else bias
        return flash_attention(q, k, v, attn_mask=attn_mask, dropout_p=p, is_causal=is_causal,
                               enable_gqa=q_heads != kv_heads)

    out = fn(*inputs)
    assert out.dtype == torch.float64 and torch.isfinite(out).all()
    assert torch.autograd.gradcheck(fn, tuple(inputs), eps=1e-6, atol=1e-8, rtol=1e-6)
    if p > 0:  # dropout really is on: the output differs from the p = 0 output
        reference = flash_attention(*inputs[:3], attn_mask=inputs[3] if len(inputs) > 3 else bias,
                                    is_causal=is_causal, enable_gqa=q_heads != kv_heads)
        assert not torch.allclose(out, reference)
