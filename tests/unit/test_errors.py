"""Bad input to ``flash_attention`` gives a clear error that names the argument (and the fix)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn.attention.bias import causal_lower_right

from flash_inductor import flash_attention


def _qkv(q_shape=(2, 4, 8, 16), kv_shape=(2, 4, 10, 16), v_dim=None, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(q_shape, generator=g).to(dtype).to(device)
    k = torch.randn(kv_shape, generator=g).to(dtype).to(device)
    v_shape = (*kv_shape[:-1], v_dim or kv_shape[-1])
    v = torch.randn(v_shape, generator=g).to(dtype).to(device)
    return q, k, v


def test_valid_call_works():
    # The baseline for the cases below: the same inputs, unbroken, are accepted.
    q, k, v = _qkv()
    assert flash_attention(q, k, v).shape == (2, 4, 8, 16)


@pytest.mark.parametrize("name", ["query", "key", "value"])
def test_rank_below_two(name):
    q, k, v = _qkv()
    args = dict(query=q, key=k, value=v)
    args[name] = torch.randn(16)
    with pytest.raises(ValueError, match=rf"{name} must have at least 2 dims"):
        flash_attention(**args)


def test_batch_dims_do_not_broadcast():
    # Size 1 broadcasts (tests/unit/test_broadcast.py); 3 against 2 does not, in any of the three.
    q, k, v = _qkv(kv_shape=(3, 4, 10, 16))
    with pytest.raises(ValueError, match=r"batch dims of query, key and value do not broadcast .*query \(2,\), "
                                         r"key \(3,\), value \(3,\)"):
        flash_attention(q, k, v)
    q, k, _ = _qkv()
    with pytest.raises(ValueError, match=r"do not broadcast.*each dim must be equal or 1"):
        flash_attention(q, k, torch.randn(3, 4, 10, 16))


def test_key_value_sequence_mismatch():
    q, k, _ = _qkv()
    v = torch.randn(2, 4, 11, 16)
    with pytest.raises(ValueError, match=r"key and value must have the same sequence length"):
        flash_attention(q, k, v)


def test_key_value_heads_mismatch():
    q, k, _ = _qkv()
    with pytest.raises(ValueError, match=r"key has 4 heads and value 2; give them the same number of heads"):
        flash_attention(q, k, torch.randn(2, 2, 10, 16))


def test_head_dim_mismatch():
    q, k, v = _qkv(kv_shape=(2, 4, 10, 8))
    with pytest.raises(ValueError, match=r"key's head dim \(8\) must equal query's \(16\)"):
        flash_attention(q, k, v)


def test_empty_head_dim():
    q, k, v = _qkv(q_shape=(2, 4, 8, 0), kv_shape=(2, 4, 10, 0), v_dim=4)
    with pytest.raises(ValueError, match=r"query has an empty last \(head\) dim"):
        flash_attention(q, k, v)


def test_heads_differ_without_enable_gqa():
    q, k, v = _qkv(kv_shape=(2, 2, 10, 16))
    with pytest.raises(ValueError, match=r"query has 4 heads but key/value have 2.*enable_gqa=True"):
        flash_attention(q, k, v)


def test_heads_not_a_multiple():
    q, k, v = _qkv(kv_shape=(2, 3, 10, 16))
    with pytest.raises(ValueError, match=r"query heads \(4\) must be a multiple of the key/value heads \(3\)"):
        flash_attention(q, k, v, enable_gqa=True)


@pytest.mark.parametrize("shape", [(2, 4, 8, 9), (3, 1, 1, 10), (8, 11)], ids=str)
def test_mask_not_broadcastable(shape):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"attn_mask of shape .* is not broadcastable"):
        flash_attention(q, k, v, attn_mask=torch.zeros(shape))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8], ids=str)
def test_mask_wrong_dtype(dtype):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"attn_mask must be bool .* or floating"):
        flash_attention(q, k, v, attn_mask=torch.ones(8, 10, dtype=dtype))


def test_mask_not_a_tensor():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"attn_mask must be a Tensor, CausalBias or None"):
        flash_attention(q, k, v, attn_mask=[[True] * 10] * 8)


def test_mask_on_other_device():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"attn_mask is on meta but query is on cpu"):
        flash_attention(q, k, v, attn_mask=torch.ones(8, 10, dtype=torch.bool, device="meta"))


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5, float("nan"), "0.1", True, np.float32(1.0), torch.tensor([0.1, 0.2]),
                               torch.tensor(True)], ids=str)
def test_dropout_p_out_of_range(p):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"dropout_p must be a real number in \[0, 1\) \(a float, a NumPy scalar or "
                                         r"a one-element tensor\)"):
        flash_attention(q, k, v, dropout_p=p)


@pytest.mark.parametrize("p", [np.float32(0.25), np.float64(0.25), torch.tensor(0.25), torch.tensor([0.25]), 0],
                         ids=repr)
def test_dropout_p_as_sdpa_takes_it(p):
    """SDPA takes a NumPy scalar or a one-element tensor as dropout_p: so does flash_attention, with
    the same dropout as the float (the mask depends on the seed and p only)."""
    q, k, v = _qkv()
    torch.manual_seed(0)
    want = flash_attention(q, k, v, dropout_p=float(p))
    torch.manual_seed(0)
    torch.testing.assert_close(flash_attention(q, k, v, dropout_p=p), want, rtol=0, atol=0)


@pytest.mark.parametrize("schedule", ["fastest", "", "STABLE", 1], ids=str)
def test_unknown_schedule(schedule):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"schedule=.* is not a known precision schedule; choose one of "
                                         r"\['accurate', 'fast', 'fp8', 'stable'\]"):
        flash_attention(q, k, v, schedule=schedule)


def test_attn_mask_with_is_causal():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"attn_mask and is_causal=True are exclusive"):
        flash_attention(q, k, v, attn_mask=torch.ones(8, 10, dtype=torch.bool), is_causal=True)


def test_causal_bias_with_is_causal():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"either attn_mask=CausalBias\(...\) or is_causal=True, not both"):
        flash_attention(q, k, v, attn_mask=causal_lower_right(8, 10), is_causal=True)


def test_causal_bias_wrong_lengths():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"CausalBias is for \(L, S\) = \(8, 12\) but query/key have \(8, 10\)"):
        flash_attention(q, k, v, attn_mask=causal_lower_right(8, 12))


@pytest.mark.parametrize("scale", [float("inf"), float("nan"), "0.5", torch.tensor([0.5, 0.5]), torch.tensor(True),
                                   True, 1j], ids=str)
def test_bad_scale(scale):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"scale must be a finite real number or None"):
        flash_attention(q, k, v, scale=scale)


@pytest.mark.parametrize("scale", [np.float32(0.25), np.int64(2), torch.tensor(0.25), torch.tensor([0.25]), 2],
                         ids=lambda s: f"{type(s).__name__}({s})")
def test_scale_as_sdpa_takes_it(scale):
    """SDPA reads any real scalar as its scale (NumPy's, a one-element tensor): so does flash_attention."""
    q, k, v = _qkv(dtype=torch.float64)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=float(scale))
    torch.testing.assert_close(flash_attention(q, k, v, scale=scale), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["is_causal", "enable_gqa"])
@pytest.mark.parametrize("flag", ["False", None, 2, 0.0, torch.tensor(True)], ids=repr)
def test_flags_must_be_bools(name, flag):
    """A flag read by its truth would turn "False" on: anything but a bool (or 0 / 1) is refused."""
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=rf"{name} must be a bool"):
        flash_attention(q, k, v, **{name: flag})


@pytest.mark.parametrize("window", [(2**63, 0), (0, -2), (1.5, 0), (0,)], ids=str)
def test_bad_window(window):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"window"):
        flash_attention(q, k, v, window=window)


@pytest.mark.parametrize("name", ["query", "key", "value"])
@pytest.mark.parametrize("bad", [None, [[1.0]], 3.0], ids=["None", "list", "float"])
def test_non_tensor_inputs(name, bad):
    q, k, v = _qkv()
    args = dict(query=q, key=k, value=v)
    args[name] = bad
    with pytest.raises(TypeError, match=rf"{name} must be a torch.Tensor, got {type(bad).__name__}"):
        flash_attention(**args)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.complex64], ids=str)
def test_unsupported_dtype(dtype):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=rf"query has dtype {dtype}; supported are float16, bfloat16"):
        flash_attention(q.to(dtype), k.to(dtype), v.to(dtype))


def test_mismatched_dtypes():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"query, key and value must share a dtype, got torch.float32, "
                                        r"torch.float16, torch.float32"):
        flash_attention(q, k.half(), v)


def test_mismatched_devices():
    # "meta" is a supported device, so this needs no second accelerator.
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"query, key and value must be on one device, got cpu, meta, cpu"):
        flash_attention(q, k.to("meta"), v)


def test_double_backward_is_refused_with_a_clear_error():
    q, k, v = (torch.randn(1, 2, 5, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = flash_attention(q, k, v)
    (dq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        dq.sum().backward()
