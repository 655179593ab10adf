"""The one-pass ops' plumbing (ops/one_pass.py) on any machine: the two Gluon launchers
(``launch.hopper.hopper_attention_forward`` with ``exact_delta``, ``launch.hopper_bwd.
hopper_attention_backward``) are replaced by float64 emulations of their contract, so that what
wraps them runs for real: the keys' mean for the backward's centred dQ (Triton, the interpreter on
a CPU), the ops' autograd, fakes and schemas, the eager fast path, the copies of inputs TMA cannot
address, the empty-sequence and deterministic-mode fallbacks. The kernels themselves, and the
exact Δ's rounding, are tested on the GPU (test_one_pass.py) and emulated bit for bit in
benchmarks/experiments/matched_rounding.py at commit f7e9ac3."""

from __future__ import annotations

import pytest
import torch

import flash_inductor  # noqa: F401 -- registers the ops
from flash_inductor.launch.hopper_bwd import KeyMoments, finish_key_mean
from helpers import DEVICE, attention_ref, causal_visible, ref_forward_backward

DTYPE = torch.float32  # the emulation is exact; fp32 lets the wrapping's own error show


def _visible(seq_q, seq_k, is_causal, causal_offset, window):
    vis = torch.ones(seq_q, seq_k, dtype=torch.bool, device=DEVICE)
    if is_causal:
        vis &= causal_visible(seq_q, seq_k, causal_offset, DEVICE)
    if window is not None and window != (-1, -1):
        rel = torch.arange(seq_k, device=DEVICE)[None, :] - (torch.arange(seq_q, device=DEVICE)[:, None]
                                                             + seq_k - seq_q)
        left, right = window
        vis &= (rel >= -left) if left >= 0 else True
        vis &= (rel <= right) if right >= 0 else True
    return vis


def _loose(visibility):
    """(is_causal, causal_offset, window, block_layout) of a launcher's ``Visibility``."""
    return visibility.is_causal, visibility.causal_offset, visibility.window, visibility.block_layout()


def _with_layout(visible, block_layout, shape):
    """The visibility inside a block-sparse layout's computed blocks (B, Hq, L, S), or as it was."""
    if block_layout is None:
        return visible
    from flash_inductor.block_sparse import expand_block_map

    block_map, block_q, block_k = block_layout
    return visible & expand_block_map(block_map, block_q, block_k, 0, shape[2], 0, shape[3]).expand(shape)


def _with_key_mask(visible, attn_mask):
    """The band's visibility combined with the launchers' key mask (bool, or additive in float64):
    its first query row, as ``launch.hopper.key_bias`` reads it (the mask may arrive materialised,
    as opcheck's clones do; it was a key mask where the path was chosen)."""
    if attn_mask is None:
        return visible
    attn_mask = attn_mask[..., :1, :]
    if attn_mask.dtype == torch.bool:
        return visible & attn_mask
    return attn_mask.double().masked_fill(~visible, float("-inf"))


class EmulatedGluon:
    """The launchers' contract in float64. The forward's row constants are the pivot (here the
    LSE in base 2; +inf for a row that sees no key) and 1; the backward checks that it gets them
    with the residual, and that ``mean_key`` is a k̂ its kernel can centre K by exactly (K − k̂ a
    value of K's dtype); its gradients are exact, as the real one's centred dQ plus its
    scale·dLSE·k̂ term are in exact arithmetic."""

    def __init__(self):
        self.forwards, self.backwards = [], []

    def forward(self, query, key, value, *, scale, visibility, exact_delta, config=None, attn_mask=None,
                schedule=None):
        assert exact_delta and config is None and schedule == "stable"  # the table's `stable` entries
        is_causal, causal_offset, window, block_layout = _loose(visibility)
        for t in (query, key, value):
            assert t.data_ptr() % 16 == 0 and t.stride(-1) == 1, "the launcher got a tensor TMA cannot address"
        self.forwards.append(dict(key=key, window=window, is_causal=is_causal, causal_offset=causal_offset,
                                  attn_mask=attn_mask, block_layout=block_layout))
        shape = (*query.shape[:3], key.shape[2])
        mask = _with_key_mask(_with_layout(_visible(*shape[2:], is_causal, causal_offset, window), block_layout,
                                           shape), attn_mask)
        out, lse = attention_ref(query, key, value, mask, scale=scale)
        out16 = out.to(query.dtype)
        pivot = torch.where(lse.isneginf(), float("inf"), lse / torch.log(torch.tensor(2.0, dtype=lse.dtype)))
        row_consts = torch.stack([pivot, torch.ones_like(pivot)]).float()
        return out16, lse.float(), (out - out16.double()).to(query.dtype), row_consts

    def backward(self, grad_out, query, key, value, out, lse, grad_lse=None, *, scale, visibility, exact_delta,
                 mean_key, config=None, delta=None, attn_mask=None, schedule=None):
        assert schedule == "stable"
        is_causal, causal_offset, window, block_layout = _loose(visibility)
        resid, row_consts = exact_delta
        assert resid.shape == out.shape and row_consts.shape == (2, *lse.shape) and delta is None
        # The one-pass path hands over K's moments, which the real launcher's exact-Δ preprocess
        # finishes into k̂ (kernels/exact_delta.py); here a launch of its own does.
        assert isinstance(mean_key, KeyMoments)
        mean_key = finish_key_mean(mean_key, key)
        self.backwards.append(dict(key=key, mean_key=mean_key, attn_mask=attn_mask, block_layout=block_layout))
        assert mean_key.shape == (key.shape[0], key.shape[1], key.shape[3]) and mean_key.dtype == torch.float32
        k_tilde = key - mean_key.to(key.dtype)[:, :, None]
        assert torch.equal(k_tilde.double(), key.double() - mean_key.double()[:, :, None]), "K - k̂ is not exact"
        # In closed form: a backward runs below autograd, where torch.autograd cannot record.
        shape = (*query.shape[:3], key.shape[2])
        mask = _with_key_mask(_with_layout(_visible(*shape[2:], is_causal, causal_offset, window), block_layout,
                                           shape), attn_mask)
        group = query.shape[1] // key.shape[1]
        q, k, v, do = (t.double() for t in (query, key, value, grad_out))
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = q @ k.transpose(-1, -2) * scale
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        p = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with no key: 0
        row_term = (do * (p @ v)).sum(-1)
        if grad_lse is not None:
            row_term = row_term - grad_lse.double()
        ds = p * (do @ v.transpose(-1, -2) - row_term[..., None])
        dq = scale * ds @ k
        dk = (scale * ds.transpose(-1, -2) @ q).unflatten(1, (-1, group)).sum(2)
        dv = (p.transpose(-1, -2) @ do).unflatten(1, (-1, group)).sum(2)
        return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)


@pytest.fixture
def emulated(monkeypatch):
    from flash_inductor.launch import hopper, hopper_bwd

    from flash_inductor.ops import one_pass

    gluon = EmulatedGluon()
    monkeypatch.setattr(hopper, "hopper_attention_forward", gluon.forward)
    monkeypatch.setattr(hopper_bwd, "hopper_attention_backward", gluon.backward)
    key_moments = one_pass.key_moments
    gluon.key_means = 0

    def counted_key_moments(key):
        gluon.key_means += 1
        return key_moments(key)

    monkeypatch.setattr(one_pass, "key_moments", counted_key_moments)
    return gluon


def _inputs(b, hq, hkv, seq_q, seq_k, e, seed=0, shared=0.0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, seq_q, e, generator=gen)
    k = torch.randn(b, hkv, seq_k, e, generator=gen) * 0.3 + shared * torch.randn(b, hkv, 1, e, generator=gen)
    v = torch.randn(b, hkv, seq_k, e, generator=gen)
    do = torch.randn(b, hq, seq_q, e, generator=gen)
    dlse = torch.randn(b, hq, seq_q, generator=gen)
    return [t.to(DEVICE, DTYPE) for t in (q, k, v, do, dlse)]


CASES = {  # (B, Hq, Hkv, L, S, is_causal, causal_offset, window)
    "full": (1, 2, 2, 40, 40, False, 0, (-1, -1)),
    "gqa_lower_right": (2, 4, 2, 24, 56, True, 32, (-1, -1)),
    "rows_see_nothing": (1, 2, 1, 48, 20, True, -24, (-1, -1)),
    "window": (1, 2, 2, 64, 64, True, 0, (9, 0)),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("path", ["op", "eager"])
def test_gradients_through_the_wrapping_match_fp64(emulated, case, path):
    """Near-tied keys (a large shared part), so the backward's k̂ is live; both launchers get K
    itself, k̂ is found once, in the backward; out, LSE and the gradients with a dLSE, through the
    registered ops or the eager fast path."""
    from flash_inductor.ops.one_pass import attention_one_pass

    b, hq, hkv, seq_q, seq_k, causal, offset, window = CASES[case]
    q, k, v, do, dlse = _inputs(b, hq, hkv, seq_q, seq_k, 16, shared=20.0)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    scale = 0.25
    out, lse = attention_one_pass(*leaves, causal, offset, scale, *window, fast_path=path == "eager",
                                  needs_autograd=True)
    torch.autograd.backward([out, lse], [do, dlse])
    assert len(emulated.forwards) == len(emulated.backwards) == 1
    k_hat = emulated.backwards[0]["mean_key"]
    assert (k_hat != 0).float().mean() > 0.5, "near-tied keys should be centred"
    assert torch.equal(emulated.forwards[0]["key"], k) and torch.equal(emulated.backwards[0]["key"], k)
    assert emulated.key_means == 1
    vis = _visible(seq_q, seq_k, causal, offset, window)
    ref = ref_forward_backward(q, k, v, vis, scale=scale, grad_out=do, grad_lse=dlse)
    live = ~ref["lse"].isneginf()
    torch.testing.assert_close(out.double(), ref["out"], rtol=1e-5, atol=1e-5)
    assert torch.equal(lse.isneginf(), ~live)
    # The LSE is ~ scale·q·k̂ ~ 100 here: fp32's relative error on it.
    torch.testing.assert_close(lse.double()[live], ref["lse"][live], rtol=1e-6, atol=1e-4)
    for name, leaf in zip(("dq", "dk", "dv"), leaves):
        torch.testing.assert_close(leaf.grad.double(), ref[name], rtol=1e-4, atol=1e-4, msg=name)


def test_inputs_tma_cannot_address_are_copied(emulated):
    """A contiguous query at a 4-byte offset and a value with a non-unit last stride reach the
    launchers as aligned copies, with the same results."""
    from flash_inductor.ops.one_pass import attention_one_pass

    q, k, v, do, _ = _inputs(1, 2, 2, 32, 32, 16)
    storage = torch.empty(q.numel() + 1, device=DEVICE, dtype=DTYPE)
    q_odd = storage[1:].view(q.shape).copy_(q)
    v_odd = v.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert q_odd.data_ptr() % 16 != 0 and v_odd.stride(-1) != 1
    out, lse = attention_one_pass(q_odd, k, v_odd, False, 0, 0.25, -1, -1, fast_path=False, needs_autograd=False)
    want, want_lse = attention_one_pass(q, k, v, False, 0, 0.25, -1, -1, fast_path=False, needs_autograd=False)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


def test_the_ops_pass_opcheck(emulated):
    """Schemas, fakes and autograd registration agree with the real outputs (torch.library)."""
    q, k, v, do, dlse = _inputs(1, 4, 2, 24, 40, 16)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ops = torch.ops.flash_inductor
    torch.library.opcheck(ops.attention_forward_one_pass.default, (*leaves, True, 16, 0.25, -1, -1))
    out, lse, resid, row_consts = ops.attention_forward_one_pass(q, k, v, True, 16, 0.25)
    torch.library.opcheck(ops.attention_backward_one_pass.default,
                          (do, q, k, v, out, lse, dlse, resid, row_consts, True, 16, 0.25, -1, -1))
    key_mask = (torch.arange(40, device=DEVICE) < 33).reshape(1, 1, 1, 40).expand(1, 4, 24, 40)
    torch.library.opcheck(ops.attention_forward_one_pass.default, (*leaves, False, 0, 0.25, -1, -1, key_mask))
    out, lse, resid, row_consts = ops.attention_forward_one_pass(q, k, v, False, 0, 0.25, -1, -1, key_mask)
    torch.library.opcheck(ops.attention_backward_one_pass.default,
                          (do, q, k, v, out, lse, dlse, resid, row_consts, False, 0, 0.25, -1, -1, key_mask))


def test_empty_sequences_give_zeros_without_a_launch(emulated):
    from flash_inductor.ops.one_pass import attention_one_pass

    q, k, v, _, _ = _inputs(1, 2, 2, 8, 8, 16)
    leaves = [t.clone().requires_grad_() for t in (q, k[:, :, :0], v[:, :, :0])]
    out, lse = attention_one_pass(*leaves, False, 0, 0.25, -1, -1, fast_path=False, needs_autograd=True)
    assert torch.equal(out, torch.zeros_like(q)) and bool(lse.isneginf().all())
    out.sum().backward()
    assert emulated.forwards == [] and emulated.backwards == []
    assert torch.equal(leaves[0].grad, torch.zeros_like(q))


def test_deterministic_mode_runs_the_triton_backward(emulated):
    """Under deterministic algorithms the backward is the Triton `stable` one (the interpreter on
    a CPU), given K itself and the same out and LSE: gradients as fp64's, no emulated backward."""
    from flash_inductor.ops.one_pass import attention_one_pass

    q, k, v, do, dlse = _inputs(1, 2, 1, 24, 24, 16, shared=5.0)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = attention_one_pass(*leaves, True, 0, 0.25, -1, -1, fast_path=False, needs_autograd=True)
    torch.use_deterministic_algorithms(True)
    try:
        torch.autograd.backward([out, lse], [do, dlse])
    finally:
        torch.use_deterministic_algorithms(False)
    assert emulated.backwards == []
    ref = ref_forward_backward(q, k, v, causal_offset=0, scale=0.25, grad_out=do, grad_lse=dlse)
    for name, leaf in zip(("dq", "dk", "dv"), leaves):
        torch.testing.assert_close(leaf.grad.double(), ref[name], rtol=1e-3, atol=1e-3, msg=name)


@pytest.mark.parametrize("grad", ["no_grad", "inputs_without_grad", "training"])
def test_only_a_call_that_may_be_differentiated_takes_the_one_pass_ops(monkeypatch, grad):
    """The residual serves the backward alone: a call that autograd will not
    differentiate runs the plain forward (here the Triton one, in the interpreter on a CPU), with
    the same results."""
    from flash_inductor.ops import attention as ops_attention

    taken = []
    monkeypatch.setattr(ops_attention, "one_pass_applies", lambda *args, **kwargs: True)
    monkeypatch.setattr(ops_attention, "attention_one_pass",
                        lambda *args, **kwargs: taken.append(kwargs) or _plain(args))
    q, k, v, _, _ = _inputs(1, 2, 2, 32, 32, 16)
    if grad == "training":
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    with torch.no_grad() if grad == "no_grad" else torch.enable_grad():
        if grad == "no_grad":
            q.requires_grad_()
        out = flash_inductor.flash_attention(q, k, v, is_causal=True, scale=0.25)
    assert len(taken) == (grad == "training")
    if taken:
        assert taken[0]["needs_autograd"]
    ref = attention_ref(q.detach(), k.detach(), v.detach(), causal_offset=0, scale=0.25)[0]
    torch.testing.assert_close(out.detach().double(), ref, rtol=1e-5, atol=1e-5)


def _plain(args):
    """What the spy hands back for the one-pass ops: the plain forward's (out, lse) (the routing
    is under test here, not the ops)."""
    from flash_inductor.ops.attention import _kernel_forward, describe_call

    q, k, v, is_causal, causal_offset, scale, left, right = args
    with torch.no_grad():
        out, lse = _kernel_forward(q, k, v, None, None,
                                   describe_call(q, k, v, 0.0, is_causal, causal_offset, scale, "stable", left, right))
    return out.requires_grad_(), lse


@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("path", ["op", "eager"])
def test_a_key_mask_reaches_both_launchers_and_the_gradients_match_fp64(emulated, monkeypatch, kind, path):
    """A padding mask (B, 1, 1, S), broadcast along the queries as the API passes it: the forward
    and the backward launchers get it, and out, LSE and the gradients are fp64's. The second batch
    element hides all its keys: its rows give 0 (bool) or uniform weights (additive finfo.min).
    On a CPU the API's routing is decided by the mask alone (the device checks would refuse)."""
    import flash_inductor
    from flash_inductor.launch import hopper
    from flash_inductor.ops import attention as ops_attention

    monkeypatch.setattr(ops_attention, "one_pass_applies",
                        lambda q, k, v, attn_mask, *args, **kwargs: hopper.key_mask_unsupported_reason(attn_mask) is None)

    q, k, v, do, _ = _inputs(2, 4, 2, 24, 40, 16, shared=20.0)
    keep = torch.ones(2, 1, 1, 40, dtype=torch.bool, device=DEVICE)
    keep[0, ..., 30:] = False
    keep[1] = False
    mask = keep if kind == "bool" else torch.where(keep, 0.0, torch.finfo(DTYPE).min).to(DTYPE)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    if path == "op":
        out = torch.ops.flash_inductor.attention_forward_one_pass(
            *leaves, False, 0, 0.25, -1, -1, mask.expand(2, 4, 24, 40))[0]
    else:
        out = flash_inductor.flash_attention(*leaves, attn_mask=mask, scale=0.25, enable_gqa=True)
    out.backward(do)
    assert len(emulated.forwards) == len(emulated.backwards) == 1
    for call in (emulated.forwards[0], emulated.backwards[0]):
        assert call["attn_mask"] is not None and call["attn_mask"].stride(-2) == 0
    ref = ref_forward_backward(q, k, v, mask, scale=0.25, grad_out=do)
    torch.testing.assert_close(out.double(), ref["out"], rtol=1e-5, atol=1e-5)
    if kind == "bool":
        assert torch.equal(out[1], torch.zeros_like(out[1]))
    for name, leaf in zip(("dq", "dk", "dv"), leaves):
        torch.testing.assert_close(leaf.grad.double(), ref[name], rtol=1e-4, atol=1e-4, msg=name)


@pytest.mark.parametrize("path", ["op", "eager"])
def test_a_block_layout_reaches_both_launchers_and_the_gradients_match_fp64(emulated, monkeypatch, path):
    """A block-sparse layout (per-head maps, one query block with nothing computed, causal): both
    launchers get it, and out and the gradients are fp64's under the layout's element mask; the empty
    block's rows give 0. On a CPU the API's routing is forced (the device checks would refuse)."""
    import flash_inductor
    from flash_inductor import BlockSparseLayout
    from flash_inductor.block_sparse import expand_block_map
    from flash_inductor.ops import attention as ops_attention

    monkeypatch.setattr(ops_attention, "one_pass_applies", lambda *args, **kwargs: True)
    q, k, v, do, _ = _inputs(1, 4, 2, 48, 48, 16, shared=20.0)
    block_map = torch.rand(1, 4, 3, 3, generator=torch.Generator().manual_seed(2)).to(DEVICE) < 0.6
    block_map[..., 1, :] = False
    block_map[..., 0, 0] = True
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    if path == "op":
        out = torch.ops.flash_inductor.attention_forward_one_pass(*leaves, True, 0, 0.25, -1, -1, None, block_map,
                                                                  16, 16)[0]
    else:
        out = flash_inductor.flash_attention(*leaves, is_causal=True, scale=0.25, enable_gqa=True,
                                             block_mask=BlockSparseLayout(block_map, 16))
    out.backward(do)
    assert len(emulated.forwards) == len(emulated.backwards) == 1
    for call in (emulated.forwards[0], emulated.backwards[0]):
        layout_map, block_q, block_k = call["block_layout"]
        assert (block_q, block_k) == (16, 16) and torch.equal(layout_map, block_map)
    visible = expand_block_map(block_map, 16, 16, 0, 48, 0, 48) & _visible(48, 48, True, 0, None)
    ref = ref_forward_backward(q, k, v, visible, scale=0.25, grad_out=do)
    torch.testing.assert_close(out.double(), ref["out"], rtol=1e-5, atol=1e-5)
    assert torch.equal(out[:, :, 16:32], torch.zeros_like(out[:, :, 16:32]))
    for name, leaf in zip(("dq", "dk", "dv"), leaves):
        torch.testing.assert_close(leaf.grad.double(), ref[name], rtol=1e-4, atol=1e-4, msg=name)
    block_map[...] = True  # opcheck with the layout: schemas, fakes and autograd
    ops = torch.ops.flash_inductor
    torch.library.opcheck(ops.attention_forward_one_pass.default,
                          (*leaves, True, 0, 0.25, -1, -1, None, block_map, 16, 16))
    out, lse, resid, row_consts = ops.attention_forward_one_pass(q, k, v, True, 0, 0.25, -1, -1, None, block_map,
                                                                 16, 16)
    torch.library.opcheck(ops.attention_backward_one_pass.default,
                          (do, q, k, v, out, lse, None, resid, row_consts, True, 0, 0.25, -1, -1, None, block_map,
                           16, 16))


def test_a_mask_that_varies_along_the_queries_keeps_the_triton_kernels():
    from flash_inductor.launch import hopper

    q = torch.empty(1, 2, 8, 64)
    dense = torch.ones(1, 1, 8, 8, dtype=torch.bool)
    assert hopper.key_mask_unsupported_reason(dense) == hopper.MASK_VARIES
    assert hopper.key_mask_unsupported_reason(dense[..., :1, :]) is None
    assert hopper.key_mask_unsupported_reason(dense[..., :1, :].expand(1, 2, 8, 8)) is None
    grad_mask = torch.zeros(1, 1, 1, 8, requires_grad=True)
    assert hopper.key_mask_unsupported_reason(grad_mask) == hopper.MASK_NEEDS_GRAD
    assert hopper.key_mask_unsupported_reason(torch.ones(1, 1, 1, 8, dtype=torch.int32)) is not None
    bias = hopper.key_bias(torch.tensor([True, False]).reshape(1, 1, 1, 2), 1, 2, 2)
    assert bias.shape == (1, 2, 2) and bias.is_contiguous() and bias[0, 0, 0] == 0 and bias[0, 1, 1] == float("-inf")
    floor = hopper.key_bias(torch.tensor([torch.finfo(torch.float32).min, -2.0]).reshape(1, 1, 1, 2), 1, 1, 2)
    assert bool(floor.isfinite().all()) and floor[0, 0, 1].item() == pytest.approx(-2.0 * 1.4426950408889634)
    del q
