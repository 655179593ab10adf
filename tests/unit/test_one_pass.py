"""`stable` on the Gluon Hopper kernels with an exact Δ in one pass (ops/one_pass.py): gradients
against fp64 under the project's tolerance rule (tests/helpers.assert_close_to_ref) across dtypes,
head dims, causal sides, GQA, odd lengths and a gradient on the LSE; the stability suite's
near-tied and x100 cases, where `fast`'s Δ fails and this one must not; which calls take the
path. The support check, the keys' centring and the Triton steps around the Gluon kernels run
everywhere (the interpreter on a CPU); the Gluon kernels on an sm_90 GPU only."""

from __future__ import annotations

import copy

import pytest
import torch

from flash_inductor.launch.visibility import Visibility
import flash_inductor  # noqa: F401 -- registers the ops (a worker may run a GPU test first)
from helpers import (
    DEVICE,
    assert_close_to_ref,
    attention_ref,
    dtype_id,
    mock_hopper,
    needs_hopper,
    lse_baseline,
    ref_forward_backward,
    sdpa_baseline,
)

DTYPES = (torch.bfloat16, torch.float16)


# ------------------------------------------------------------------------------ which calls

def test_stable_unmasked_calls_take_the_one_pass_path(monkeypatch):
    from flash_inductor.launch.hopper_bwd import NO_RESIDUAL, one_pass_unsupported_reason
    from flash_inductor.ops.one_pass import one_pass_applies

    t = mock_hopper(monkeypatch)
    q = t(2, 8, 256, 128)
    assert one_pass_applies(q, q, q, None, 0.0, 0.1, "stable")
    assert one_pass_unsupported_reason(q, q, q, None, 0.0, 0.1, "stable") is None
    assert not one_pass_applies(q, q, q, None, 0.0, 0.1, "fast")
    q, k = t(2, 8, 256, 128), t(2, 2, 256, 128)
    assert one_pass_unsupported_reason(q, k, k, None, 0.0, 0.1, "stable") is None
    assert one_pass_unsupported_reason(t(1, 4, 100, 64), t(1, 4, 300, 64), t(1, 4, 300, 64), None, 0.0, 0.1,
                                       "stable", window=(64, 0)) is None
    assert "no exact" in one_pass_unsupported_reason(q, k, k, None, 0.0, 0.1, "fast")
    assert one_pass_unsupported_reason(q, k, k, t(2, 8, 256, 256, dtype=torch.bool), 0.0, 0.1, "stable")
    # A key mask (the same for every query row, a padding mask) is taken, bool or additive.
    assert one_pass_unsupported_reason(q, k, k, t(2, 1, 1, 256, dtype=torch.bool), 0.0, 0.1, "stable") is None
    assert one_pass_unsupported_reason(q, k, k, t(2, 1, 1, 256), 0.0, 0.1, "stable") is None
    assert one_pass_unsupported_reason(q, k, k, None, 0.1, 0.1, "stable")
    assert "empty" in one_pass_unsupported_reason(t(2, 8, 0, 128), k, k, None, 0.0, 0.1, "stable")
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert one_pass_unsupported_reason(q, k, k, None, 0.0, 0.1, "stable")
    assert "residual" in NO_RESIDUAL


def _key_mean(keys, spelling):
    if spelling == "reference":
        from flash_inductor.ops.one_pass import key_mean_reference
        return key_mean_reference(keys)
    from flash_inductor.launch.hopper_bwd import key_mean
    return key_mean(keys, min_chunk=64)  # several chunks at these lengths


@pytest.mark.parametrize("spelling", ["reference", "triton"])
def test_key_mean_centres_exactly_and_only_what_it_can(spelling):
    """K − k̂ is exact in K's dtype (as the Hopper backward forms K̃ from it); near-tied keys (a
    large shared part) are centred on almost every dimension, keys of both signs on none; the
    Triton launches (under the interpreter on a CPU) agree with the torch spelling to the last bit
    of the mean, whose summation order differs."""
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float16, torch.float32):  # the interpreter's bf16 is unreliable
        shared = torch.randn(2, 2, 1, 64, generator=gen) * 50
        near_tied = (shared + torch.randn(2, 2, 300, 64, generator=gen) * 0.05).to(dtype)
        plain = torch.randn(2, 2, 300, 64, generator=gen).to(dtype)
        strided = near_tied.transpose(1, 2).contiguous().transpose(1, 2)  # (B, S, H, E) storage
        for keys, centred_share in ((near_tied, 0.9), (plain, 0.0), (strided, 0.9)):
            keys = keys.to(DEVICE)
            k_hat = _key_mean(keys, spelling)
            assert k_hat.shape == (2, 2, 64) and k_hat.dtype == torch.float32
            assert torch.equal(k_hat.to(dtype).float(), k_hat)  # a value of K's dtype
            k_tilde = keys - k_hat.to(dtype).unsqueeze(2)
            assert torch.equal(k_tilde.double(), keys.double() - k_hat.double().unsqueeze(2))  # exact
            share = (k_hat != 0).double().mean().item()
            assert share >= centred_share if centred_share else share == 0.0
            if centred_share:
                assert k_tilde.abs().max() < 0.05 * keys.abs().max()
            if spelling == "triton":
                reference = _key_mean(keys, "reference")
                ulp = 4 * torch.finfo(dtype).eps * reference.abs()  # fp32: another order of 300 terms
                assert torch.all((k_hat - reference).abs() <= ulp)
        # A NaN or an infinite key centres nothing in its dimension.
        broken = near_tied.to(DEVICE).clone()
        broken[0, 0, 5, 3], broken[1, 1, 7, 4] = float("nan"), float("inf")
        k_hat = _key_mean(broken, spelling)
        assert k_hat[0, 0, 3] == 0 and k_hat[1, 1, 4] == 0 and k_hat[0, 0, 5] != 0


@pytest.mark.parametrize("with_dlse", [False, True], ids=["no_dlse", "dlse"])
def test_the_backward_preprocess_matches_its_definition(with_dlse, monkeypatch):
    """The one-pass backward's Triton preprocess (kernels/exact_delta.py; the interpreter on a CPU)
    against its glossary, fp16 with GQA and L < S: dO' = round(g·dO) bit for bit, Δ' = dO'·(O + r)
    − g·dLSE, and ds_up the power of two that keeps the bound on |dS| under DS_RESCALE_ABOVE, from
    every program's partial maxima (V's rows past L included); a NaN in V gives the smallest."""
    from flash_inductor.kernels.ds_scaling import DS_RESCALE_ABOVE
    from flash_inductor.launch import hopper_bwd
    from flash_inductor.launch.hopper_bwd import _exact_delta_inputs

    # The partial maxima's buffer is not zeroed: poisoned here, a column no program wrote would give
    # an infinite bound and the smallest ds_up.
    monkeypatch.setattr(hopper_bwd, "_ds_stats_buffer",
                        lambda programs, device: torch.full((3, programs), float("inf"), device=device))
    gen = torch.Generator().manual_seed(3)
    b, hq, hkv, seq_q, seq_k, e = 2, 4, 2, 70, 150, 32
    dtype = torch.float16
    do, out, resid = (torch.randn(b, hq, seq_q, e, generator=gen).to(dtype) for _ in range(3))
    resid = (resid.float() * 1e-3).to(dtype)
    value = torch.randn(b, hkv, seq_k, e, generator=gen).to(dtype)
    value[1, 1, 140] *= 30  # the largest row of V sits past L
    pivot = torch.randn(b, hq, seq_q, generator=gen)
    norm = torch.rand(b, hq, seq_q, generator=gen) * 3
    dlse = torch.randn(b, hq, seq_q, generator=gen) if with_dlse else None
    row_consts = torch.stack([pivot, norm]).to(DEVICE)
    do, out, resid, value = (t.to(DEVICE) for t in (do, out, resid, value))
    dlse = dlse.to(DEVICE) if with_dlse else None
    do_scaled, pivots, delta, ds_up = _exact_delta_inputs(do, value, out, dlse, resid, row_consts)
    # The same launch finishing k̂ from the keys' moments (one more column of programs): k̂ as
    # key_mean's own launch gives it, bit for bit, and every other output unchanged.
    # Keys longer than a chunk (three of 256), near-tied so that k̂ is mostly live.
    long_k = 600
    shared = 30 * torch.randn(b, hkv, 1, e, generator=gen).sign()
    keys = (shared + torch.randn(b, hkv, long_k, e, generator=gen)).to(dtype)
    keys, long_v = keys.to(DEVICE), torch.randn(b, hkv, long_k, e, generator=gen).to(dtype).to(DEVICE)
    moments = hopper_bwd.key_moments(keys, min_chunk=128)
    assert moments.chunks == 3
    with_moments = _exact_delta_inputs(do, long_v, out, dlse, resid, row_consts, moments)
    k_hat = hopper_bwd.key_mean(keys, min_chunk=128)
    assert torch.equal(moments.mean_key, k_hat) and (k_hat != 0).float().mean() > 0.9
    for got, want in zip(with_moments, _exact_delta_inputs(do, long_v, out, dlse, resid, row_consts)):
        assert torch.equal(got, want)
    g = row_consts[1]
    want_do = (do.float() * g[..., None]).to(dtype)
    assert torch.equal(do_scaled, want_do) and torch.equal(pivots, row_consts[0])
    g_dlse = g * dlse if with_dlse else torch.zeros_like(g)
    want_delta = (want_do.double() * (out.double() + resid.double())).sum(-1) - g_dlse.double()
    torch.testing.assert_close(delta.double(), want_delta, rtol=1e-5, atol=1e-5)
    bound = (4 * want_do.float().square().sum(-1).max().sqrt() * value.float().square().sum(-1).max().sqrt()
             + 2 * g_dlse.abs().max())
    want_up = 2.0 ** torch.floor(torch.log2(DS_RESCALE_ABOVE.value / bound))
    assert ds_up.shape == (1,) and ds_up.item() == want_up.item()
    value[0, 0, 3, 5] = float("nan")
    assert _exact_delta_inputs(do, value, out, dlse, resid, row_consts)[3].item() == 2.0 ** -40


def test_ds_up_in_one_launch_matches_the_torch_ops():
    """fp16's ds_up from the preprocess's partial maxima: the one-program Triton reduction
    (``_ds_up_from_stats``, the interpreter on a CPU) against the torch ops it replaces, over bounds
    from 2^-40 to 2^110, with zeros, +inf, and partial maxima spread over more columns than one
    block: the same exact power of two, the largest with bound·ds_up <= DS_RESCALE_ABOVE inside
    the clamps."""
    from flash_inductor.kernels.ds_scaling import DS_RESCALE_ABOVE
    from flash_inductor.launch.hopper_bwd import ds_up_from_stats, ds_up_in_one_launch

    limit = DS_RESCALE_ABOVE.value
    gen = torch.Generator().manual_seed(5)

    cases = []
    for exp in range(-40, 111, 3):
        stats = torch.rand(3, 2500, generator=gen) * 2.0**exp
        stats[:, :2000] *= 0.25  # every maximum sits past the first 1024-column block
        cases.append(stats)
    zeros = torch.zeros(3, 7)
    with_inf = torch.rand(3, 300, generator=gen)
    with_inf[1, 123] = float("inf")
    inf_times_zero = torch.zeros(3, 5)
    inf_times_zero[0, 2] = float("inf")  # an infinite dO row beside an all-zero V: inf·0
    cases += [zeros, with_inf, inf_times_zero]
    for stats in cases:
        stats = stats.to(DEVICE).contiguous()
        got, want = ds_up_in_one_launch(stats), ds_up_from_stats(stats)
        assert got.item() == want.item(), (stats.amax(dim=1), got.item(), want.item())
        s = stats.amax(dim=1)
        bound = (4.0 * s[0].sqrt() * s[1].sqrt() + 2.0 * s[2]).nan_to_num(nan=float("inf")).clamp(2.0**-26, 2.0**100)
        up = got.item()
        assert up == 2.0 ** round(torch.log2(torch.tensor(up, dtype=torch.float64)).item())
        clamped = up in (2.0**-40, 2.0**40)
        assert clamped or bound.item() * up <= limit < 2 * bound.item() * up


def test_the_dq_finish_matches_its_definition():
    """The one-pass path's dq finish (the interpreter on a CPU), GQA, odd lengths:
    dq = dq_accum + w·k̂."""
    from flash_inductor.launch.hopper_bwd import _dq_with_mean_key

    gen = torch.Generator().manual_seed(4)
    b, hq, hkv, seq_q, e = 2, 6, 3, 97, 64
    k_hat = (torch.randn(b, hkv, e, generator=gen) * 10).to(DEVICE)
    k_rep = k_hat.repeat_interleave(hq // hkv, 1)  # (B, Hq, E)
    dq_accum = torch.randn(b, hq, seq_q, e, generator=gen).to(DEVICE)
    weight = torch.randn(b, hq, seq_q, generator=gen).to(DEVICE)
    dq = _dq_with_mean_key(dq_accum, k_hat, weight, torch.float16)
    assert dq.dtype == torch.float16
    torch.testing.assert_close(dq, (dq_accum + weight[..., None] * k_rep[:, :, None]).to(torch.float16),
                               rtol=1e-3, atol=1e-3)


def test_cpu_calls_never_take_it():
    from flash_inductor.ops.one_pass import one_pass_applies

    q = torch.randn(1, 2, 16, 64, dtype=torch.bfloat16)
    assert not one_pass_applies(q, q, q, None, 0.0, 0.125, "stable")


# ------------------------------------------------------------------------------ on the GPU

def _grads(q, k, v, do, dlse, is_causal, causal_offset, attn_mask=None):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    scale = q.shape[-1] ** -0.5
    out, lse, resid, rows = torch.ops.flash_inductor.attention_forward_one_pass(
        *leaves, is_causal, causal_offset, scale, -1, -1, attn_mask)
    assert resid.shape == out.shape and rows.shape == (2, *lse.shape)
    outputs, grads = [out], [do]
    if dlse is not None:
        outputs.append(lse)
        grads.append(dlse)
    torch.autograd.backward(outputs, grads)
    return out, lse, [t.grad for t in leaves]


@needs_hopper
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("case", ["full", "causal", "lower_right", "gqa_dlse", "ragged", "rows_see_nothing",
                                  "shared_key_offset"])
def test_one_pass_matches_fp64(dtype, head_dim, case):
    """Random keys centre nothing (k̂ = 0); "shared_key_offset" gives every key the same positive
    offset per dimension, so k̂ is nonzero and the backward's K̃ for dQ and dq's k̂ term are live."""
    # (B, Hq, Hkv, L, S, is_causal, causal_offset, with dLSE)
    b, hq, hkv, seq_q, seq_k, causal, offset, with_dlse = {
        "full": (2, 4, 4, 512, 512, False, 0, False),
        "causal": (2, 4, 4, 512, 512, True, 0, False),
        "lower_right": (1, 4, 4, 200, 700, True, 500, False),
        "gqa_dlse": (2, 8, 2, 384, 384, True, 0, True),
        "ragged": (1, 3, 1, 333, 517, False, 0, True),
        "rows_see_nothing": (1, 2, 2, 600, 200, True, -300, True),
        "shared_key_offset": (2, 8, 2, 384, 384, True, -100, True),
    }[case]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, hq, seq_q, head_dim, device="cuda", generator=gen).to(dtype)
    k, v = (torch.randn(b, hkv, seq_k, head_dim, device="cuda", generator=gen).to(dtype) for _ in range(2))
    if case == "shared_key_offset":
        offset_per_dim = 2.0 + torch.rand(b, hkv, 1, head_dim, device="cuda", generator=gen)
        k = (offset_per_dim + 0.25 * k.float()).to(dtype)
    do = torch.randn(b, hq, seq_q, head_dim, device="cuda", generator=gen).to(dtype)
    dlse = torch.randn(b, hq, seq_q, device="cuda", generator=gen) if with_dlse else None
    offset_arg = offset if causal else None
    out, lse, (dq, dk, dv) = _grads(q, k, v, do, dlse, causal, offset)
    if case == "shared_key_offset":
        from flash_inductor.ops.one_pass import key_mean
        assert bool((key_mean(k) != 0).float().mean() > 0.9)  # k̂ is live
    group = hq // hkv
    k_full, v_full = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    ref = ref_forward_backward(q, k_full, v_full, causal_offset=offset_arg, grad_out=do, grad_lse=dlse)
    base = sdpa_baseline(q, k_full, v_full, causal_offset=offset_arg, grad_out=do, grad_lse=dlse)
    terms = ref["terms"]
    assert_close_to_ref("out", out, ref["out"], base["out"], terms=terms.get("out"))
    # The LSE keeps the fp32 sum of P (O is normalised by the rounded one): fp32's accuracy.
    assert_close_to_ref("lse", lse, ref["lse"], lse_baseline(q, k_full, causal_offset=offset_arg))
    assert_close_to_ref("dq", dq, ref["dq"], base["dq"], terms=terms.get("dq"))
    sum_heads = lambda t: t.unflatten(1, (hkv, group)).sum(2)  # noqa: E731
    assert_close_to_ref("dk", dk, sum_heads(ref["dk"]), sum_heads(base["dk"]), terms=terms.get("dk"))
    assert_close_to_ref("dv", dv, sum_heads(ref["dv"]), sum_heads(base["dv"]), terms=terms.get("dv"))
    dead = torch.isinf(ref["lse"])
    if dead.any():  # rows that see no key: out, dq exactly 0, lse -inf
        assert torch.equal(lse[dead], ref["lse"][dead].float())
        assert (dq[dead] == 0).all() and (out[dead] == 0).all()


@needs_hopper
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dq_split", [True, False], ids=["dq_split", "no_split"])
def test_the_backward_centres_the_keys_for_dq(dtype, head_dim, dq_split):
    """Near-tied keys (a shared part 32x their spread): dq from the kernel's K̃ (CENTRE_KEYS, k̂
    from ``key_mean``) meets the tolerance rule, and dq with the same kernel on K itself (no k̂)
    is several times further from fp64: dS's rounding then meets the shared part. dK and dV do
    not depend on the centring: bitwise the same both ways."""
    from flash_inductor.launch.hopper_bwd import HopperBackwardConfig, hopper_attention_backward
    from flash_inductor.ops.one_pass import _forward, key_mean

    gen = torch.Generator(device="cuda").manual_seed(5)
    b, h, seq = 2, 4, 384
    q = torch.randn(b, h, seq, head_dim, device="cuda", generator=gen).to(dtype)
    shared = 8.0 + 4.0 * torch.rand(b, h, 1, head_dim, device="cuda", generator=gen)
    k = (shared + 0.25 * torch.randn(b, h, seq, head_dim, device="cuda", generator=gen)).to(dtype)
    v, do = (torch.randn(b, h, seq, head_dim, device="cuda", generator=gen).to(dtype) for _ in range(2))
    # No dLSE: its dq term, scale·dLSE·k̂, would dwarf the part the centring is for.
    dlse = None
    scale = 0.25 * head_dim ** -0.5  # keeps the near-tied scores' softmax spread over many keys
    out, lse, resid, rows = _forward(q, k, v, True, 0, scale, -1, -1)
    k_hat = key_mean(k)
    assert bool((k_hat != 0).all())
    cfg = HopperBackwardConfig(dq_split=dq_split)
    common = dict(scale=scale, visibility=Visibility(is_causal=True), exact_delta=(resid, rows), config=cfg)
    if head_dim == 128 and not dq_split:  # K̃ beside K would not fit in shared memory
        with pytest.raises(ValueError, match="dq_split=True"):
            hopper_attention_backward(do, q, k, v, out, lse, dlse, mean_key=key_mean(k), **common)
        return
    dq, dk, dv = hopper_attention_backward(do, q, k, v, out, lse, dlse, mean_key=k_hat, **common)
    dq_plain, dk_plain, dv_plain = hopper_attention_backward(do, q, k, v, out, lse, dlse, **common)
    assert torch.equal(dk, dk_plain) and torch.equal(dv, dv_plain)
    ref = ref_forward_backward(q, k, v, causal_offset=0, grad_out=do, grad_lse=dlse, scale=scale)
    base = sdpa_baseline(q, k, v, causal_offset=0, grad_out=do, grad_lse=dlse, scale=scale)
    assert_close_to_ref("dq", dq, ref["dq"], base["dq"], terms=ref["terms"].get("dq"))
    err = lambda t: (t.double() - ref["dq"]).norm().item()  # noqa: E731
    assert err(dq_plain) > 4 * err(dq), (err(dq_plain), err(dq))


def _padding_mask(batch, seq_k, kind, dtype, device="cuda"):
    """(B, 1, 1, S): batch element b keeps its first S - 37·b keys; the last element keeps none
    (its rows: 0 under a bool mask, uniform weights under finfo.min, as SDPA gives)."""
    keep = torch.arange(seq_k, device=device)[None, :] < (seq_k - 37 * torch.arange(batch, device=device))[:, None]
    keep[-1] = False
    keep = keep[:, None, None, :]
    return keep if kind == "bool" else torch.where(keep, 0.0, torch.finfo(dtype).min).to(dtype)


@needs_hopper
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("case", ["full", "causal_gqa_dlse", "ragged"])
def test_one_pass_with_a_key_mask_matches_fp64(dtype, head_dim, kind, case):
    """A padding mask on the Gluon kernels (their per-key bias), through the one-pass ops."""
    b, hq, hkv, seq_q, seq_k, causal, with_dlse = {
        "full": (3, 4, 4, 512, 512, False, False),
        "causal_gqa_dlse": (3, 8, 2, 384, 384, True, True),
        "ragged": (3, 3, 1, 333, 517, False, True),
    }[case]
    gen = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(b, hq, seq_q, head_dim, device="cuda", generator=gen).to(dtype)
    k, v = (torch.randn(b, hkv, seq_k, head_dim, device="cuda", generator=gen).to(dtype) for _ in range(2))
    do = torch.randn(b, hq, seq_q, head_dim, device="cuda", generator=gen).to(dtype)
    dlse = torch.randn(b, hq, seq_q, device="cuda", generator=gen) if with_dlse else None
    mask = _padding_mask(b, seq_k, kind, dtype)
    if kind == "bool":  # the reference's rows with no key give lse -inf: no dLSE can reach them
        dlse = None if dlse is None else dlse.masked_fill(~mask[:, :, 0, :1], 0.0)
    offset = 0 if causal else None
    out, lse, (dq, dk, dv) = _grads(q, k, v, do, dlse, causal, 0, mask.expand(b, hq, seq_q, seq_k))
    group = hq // hkv
    k_full, v_full = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    ref = ref_forward_backward(q, k_full, v_full, mask, causal_offset=offset, grad_out=do, grad_lse=dlse)
    base = sdpa_baseline(q, k_full, v_full, mask, causal_offset=offset, grad_out=do, grad_lse=dlse)
    terms = ref["terms"]
    assert_close_to_ref("out", out, ref["out"], base["out"], terms=terms.get("out"))
    # Rows whose keys are all at finfo.min: the kernels clamp additive mask values at -1e38
    # (launch.hopper.MASK_FLOOR), so their LSE is the clamp's; their weights are uniform either way.
    live = ref["lse"] > -1e30
    assert_close_to_ref("lse", lse[live], ref["lse"][live], lse_baseline(q, k_full, mask, causal_offset=offset)[live])
    assert_close_to_ref("dq", dq, ref["dq"], base["dq"], terms=terms.get("dq"))
    sum_heads = lambda t: t.unflatten(1, (hkv, group)).sum(2)  # noqa: E731
    assert_close_to_ref("dk", dk, sum_heads(ref["dk"]), sum_heads(base["dk"]), terms=terms.get("dk"))
    assert_close_to_ref("dv", dv, sum_heads(ref["dv"]), sum_heads(base["dv"]), terms=terms.get("dv"))
    if kind == "bool":  # the last batch element sees no key
        assert (out[-1] == 0).all() and (dq[-1] == 0).all() and bool(lse[-1].isneginf().all())


@needs_hopper
@pytest.mark.parametrize("schedule", ["stable", "fast"])
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_flash_attention_runs_key_masks_on_the_hopper_kernels(monkeypatch, schedule, kind):
    """Through the API, a (B, 1, 1, S) mask reaches the Gluon forward (and, except `fast` with an
    additive mask, the Gluon backward) with its gradients as fp64's; a dense mask does not."""
    from flash_inductor.launch import hopper, hopper_bwd

    forwards, backwards = [], []
    real_fwd, real_bwd = hopper.hopper_attention_forward, hopper_bwd.hopper_attention_backward
    monkeypatch.setattr(hopper, "hopper_attention_forward",
                        lambda *a, **kw: forwards.append(kw.get("attn_mask")) or real_fwd(*a, **kw))
    monkeypatch.setattr(hopper_bwd, "hopper_attention_backward",
                        lambda *a, **kw: backwards.append(kw.get("attn_mask")) or real_bwd(*a, **kw))
    gen = torch.Generator(device="cuda").manual_seed(2)
    b, h, seq, e = 2, 4, 640, 128
    q, k, v, do = (torch.randn(b, h, seq, e, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(4))
    mask = _padding_mask(b, seq, kind, torch.bfloat16)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flash_inductor.flash_attention(*leaves, attn_mask=mask, schedule=schedule)
    out.backward(do)
    assert len(forwards) == 1 and forwards[0] is not None
    gluon_backward = not (schedule == "fast" and kind == "additive")
    assert len(backwards) == int(gluon_backward) and all(m is not None for m in backwards)
    ref = ref_forward_backward(q, k, v, mask, grad_out=do)
    base = sdpa_baseline(q, k, v, mask, grad_out=do)
    for name, got in (("out", out), ("dq", leaves[0].grad), ("dk", leaves[1].grad), ("dv", leaves[2].grad)):
        assert_close_to_ref(name, got, ref[name], base[name], terms=ref["terms"].get(name))
    forwards.clear()
    dense = mask.expand(b, 1, seq, seq).contiguous()
    flash_inductor.flash_attention(q, k, v, attn_mask=dense, schedule=schedule)
    assert forwards == []


@needs_hopper
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", ["near_tied", "qk_x100"])
def test_stability_cases_meet_the_requirement(monkeypatch, dtype, case):
    """The suite's requirement (||ours - ref|| <= 2 best anchor + floor) on the two cases that
    `fast`'s Δ fails, with this path as the default schedule."""
    from flash_inductor.stability import cases as suite_cases
    from flash_inductor.stability import runner
    from flash_inductor.stability.anchors import implementations

    sizes = suite_cases.QUICK
    chosen = [c for c in suite_cases.all_cases(sizes) if c.name == case]
    impls = implementations(["ours:stable", "ours:fast", "sdpa:math", "sdpa:flash", "sdpa:efficient"])
    results = runner.run_suite(chosen, impls, "cuda", sizes, dtypes=[dtype])
    requirement = runner.check_requirements(results, "stable")
    assert requirement.passed, requirement.format()


@needs_hopper
def test_flash_attention_routes_stable_through_the_one_pass_ops(monkeypatch):
    """With the switch on, eager and compiled calls with the default schedule run the one-pass
    kernels and give the same values."""
    import flash_inductor
    from flash_inductor.launch import hopper_bwd

    calls = []
    real = hopper_bwd.hopper_attention_backward

    def spy(*args, **kwargs):
        calls.append(kwargs.get("exact_delta") is not None)
        return real(*args, **kwargs)
    monkeypatch.setattr(hopper_bwd, "hopper_attention_backward", spy)
    q, k, v = (torch.randn(1, 4, 256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = flash_inductor.flash_attention(q, k, v, is_causal=True)
    out.sum().backward()
    eager = (out.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone())
    assert calls == [True]
    q.grad = k.grad = v.grad = None
    targets = []

    def capture(gm, _inputs):
        from functorch.compile import make_boxed_func

        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm.forward)

    from torch._dynamo.backends.common import aot_autograd

    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v: flash_inductor.flash_attention(q, k, v, is_causal=True),
                       backend=aot_autograd(fw_compiler=capture, bw_compiler=capture))
    compiled = fn(q, k, v)
    compiled.sum().backward()
    assert "flash_inductor.attention_forward_one_pass.default" in targets, targets
    assert "flash_inductor.attention_backward_one_pass.default" in targets, targets
    # The forward, dK and dV are deterministic, so bitwise the same. dQ is summed across key
    # blocks by atomic adds in whatever order the CTAs finish: more than two fp32 addends may
    # round differently, and the cast may move by one bf16 ulp (2^-7 relative at most).
    assert torch.equal(compiled.detach(), eager[0])
    assert torch.equal(k.grad, eager[2]) and torch.equal(v.grad, eager[3])
    torch.testing.assert_close(q.grad, eager[1], rtol=2**-7, atol=1e-6 * float(eager[1].abs().max()))


class _AttentionBlock(torch.nn.Module):
    """qkv projection -> causal SDPA -> out projection (what the rewrite replaces in a model)."""

    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = torch.nn.Linear(hidden, 3 * hidden), torch.nn.Linear(hidden, hidden)

    def forward(self, x):
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, hidden // self.heads).permute(2, 0, 3, 1, 4)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(y.transpose(1, 2).reshape(batch, seq, hidden))


@needs_hopper
@pytest.mark.parametrize("head_dim", [64, 128])
def test_cuda_graphs_replay_the_one_pass_ops(monkeypatch, head_dim):
    """torch.compile(backend=flash_inductor.backend, mode="reduce-overhead") on a bf16 block: the
    rewritten attention runs the one-pass ops (the Gluon kernels with the residual, and k̂ for the
    backward's K̃) inside Inductor's CUDA graphs, and step after step, on new inputs, out and the
    gradients stay as close to fp64 as eager bf16 (SDPA) is. The backward must keep no tensor of
    its own across calls: its first call is a warm-up inside the graph's memory pool, and a
    constant it kept from there (bf16's ds_up once was) fails the graph's check of live
    allocations."""
    from helpers import assert_training_steps_match_fp64, randn

    from flash_inductor.launch import hopper_bwd

    calls = []
    real = hopper_bwd.hopper_attention_backward

    def spy(*args, **kwargs):
        calls.append(kwargs.get("exact_delta") is not None and kwargs.get("mean_key") is not None)
        return real(*args, **kwargs)
    monkeypatch.setattr(hopper_bwd, "hopper_attention_backward", spy)
    torch._dynamo.reset()
    torch.manual_seed(0)
    hidden, heads = 2 * head_dim, 2
    block = _AttentionBlock(hidden, heads).cuda()
    eager = block.to(torch.bfloat16)
    ours = copy.deepcopy(eager)
    golden = copy.deepcopy(eager).double()  # the same (bf16) weights, in fp64
    compiled = torch.compile(ours, backend=flash_inductor.backend, mode="reduce-overhead")
    assert_training_steps_match_fp64(compiled, eager, golden,
                                     lambda step: randn((2, 384, hidden), torch.bfloat16, "cuda", 20 + step))
    assert calls and all(calls), calls


@needs_hopper
@pytest.mark.parametrize("compiled", (False, True), ids=("eager", "compiled"))
def test_inference_runs_the_plain_hopper_forward(monkeypatch, compiled):
    """Without autograd no backward follows, so `stable` skips the one-pass forward's residual and
    centring: the Gluon forward runs without EXACT_DELTA, eagerly and compiled, and its output
    matches fp64 as the one-pass forward's does."""
    import flash_inductor
    from flash_inductor.launch import hopper

    exact = []
    real = hopper.hopper_attention_forward

    def spy(*args, **kwargs):
        exact.append(bool(kwargs.get("exact_delta")))
        return real(*args, **kwargs)
    monkeypatch.setattr(hopper, "hopper_attention_forward", spy)
    q, k, v = (torch.randn(2, 4, 300, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    fn = lambda q, k, v: flash_inductor.flash_attention(q, k, v, is_causal=True)  # noqa: E731
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(fn, backend="aot_eager")
    with torch.no_grad():
        out = fn(q, k, v)
    assert exact == [False], exact
    with_grad = fn(q, k, v)
    assert exact == [False, True], exact
    ref = attention_ref(q.detach(), k.detach(), v.detach(), causal_offset=0)[0]
    plain_err = (out.double() - ref).abs().max().item()
    one_pass_err = (with_grad.detach().double() - ref).abs().max().item()
    assert plain_err <= 2 * one_pass_err + 2 * torch.finfo(torch.bfloat16).eps, (plain_err, one_pass_err)


@needs_hopper
def test_deterministic_mode_keeps_the_triton_backward(monkeypatch):
    import flash_inductor

    q, k, v = (torch.randn(1, 2, 256, 128, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
    torch.use_deterministic_algorithms(True)
    try:
        out = flash_inductor.flash_attention(q, k, v)
        out.sum().backward()
        first = q.grad.clone()
        q.grad = None
        flash_inductor.flash_attention(q, k, v).sum().backward()
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.equal(first, q.grad)


# ------------------------------------------------------------------------------ attention sinks

@needs_hopper
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("schedule", ["stable", "fast"])
@pytest.mark.parametrize("case", ["causal_gqa", "key_mask_dead_rows", "dlse", "sinks_dominate"])
@pytest.mark.parametrize("compiled", (False, True), ids=("eager", "compiled"))
def test_sinks_on_the_hopper_kernels_match_fp64(monkeypatch, dtype, head_dim, schedule, case, compiled):
    """flash_attention(sinks=...) runs the Gluon forward with the sinks in its epilogue and the Gluon
    backward (`stable`: the one-pass ops, whose centred dq counts the sink's share of each row; `fast`:
    the plain kernels) on (out', lse'); out, the LSE's effect and every gradient, d sinks included,
    against the fp64 definition, with the definition in the dtype as the baseline."""
    from flash_inductor.launch import hopper, hopper_bwd
    from flash_inductor.ops.one_pass import attention_one_pass  # noqa: F401 -- the path under test
    from variant_refs import term_magnitudes

    forwards, backwards = [], []
    real_fwd, real_bwd = hopper.hopper_attention_forward, hopper_bwd.hopper_attention_backward
    monkeypatch.setattr(hopper, "hopper_attention_forward",
                        lambda *a, **kw: forwards.append(kw.get("sinks") is not None) or real_fwd(*a, **kw))
    monkeypatch.setattr(hopper_bwd, "hopper_attention_backward",
                        lambda *a, **kw: backwards.append(kw.get("exact_delta") is not None) or real_bwd(*a, **kw))
    gen = torch.Generator(device="cuda").manual_seed(7)
    batch, heads_q, heads_kv, seq = 2, 4, 2 if case == "causal_gqa" else 4, 385
    q = torch.randn(batch, heads_q, seq, head_dim, device="cuda", generator=gen).to(dtype)
    k, v = (torch.randn(batch, heads_kv, seq, head_dim, device="cuda", generator=gen).to(dtype) for _ in range(2))
    do = torch.randn(batch, heads_q, seq, head_dim, device="cuda", generator=gen).to(dtype)
    sinks = torch.randn(heads_q, device="cuda", generator=gen) * 2 + (12.0 if case == "sinks_dominate" else 0.0)
    mask, causal = None, case != "key_mask_dead_rows"
    if case == "key_mask_dead_rows":
        mask = torch.rand(batch, 1, 1, seq, device="cuda", generator=gen) > 0.3
        mask[-1] = False  # the last batch's rows see no key: the sink holds them whole
    lse_weight = torch.randn(batch, heads_q, seq, device="cuda", generator=gen) if case == "dlse" else None

    def loss_of(out, lse):
        loss = (out * do.to(out.dtype)).sum()
        return loss if lse_weight is None else loss + (lse * lse_weight.to(lse.dtype)).sum()

    def ours(q, k, v, s):
        # The LSE's gradient reaches the op through flash_attention's monitor-free path only as a
        # function of out; the dlse case uses the registered op itself.
        if lse_weight is None:
            return flash_inductor.flash_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True,
                                                  schedule=schedule, sinks=s), None
        return flash_inductor.ops.attention.attention_forward_eager(
            q, k, v, None, None, 0.0, causal, 0, head_dim ** -0.5, schedule, sinks=s)

    def definition(q, k, v, s):
        group = heads_q // heads_kv
        kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = (q @ kr.transpose(-1, -2)) * head_dim ** -0.5
        if causal:
            scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool, device="cuda").triu(1),
                                        float("-inf"))
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        scores = torch.cat([scores, s.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:-1], 1)], -1)
        return torch.softmax(scores, -1)[..., :-1] @ vr, torch.logsumexp(scores.double(), -1)

    fn = torch.compile(ours, fullgraph=True) if compiled else ours
    if compiled:
        torch._dynamo.reset()
    results = {}
    for label, f, cast in (("ours", fn, dtype), ("ref", definition, torch.float64), ("base", definition, dtype)):
        leaves = [t.detach().to(cast).requires_grad_() for t in (q, k, v)] + [sinks.detach().to(
            torch.float64 if cast == torch.float64 else torch.float32).requires_grad_()]
        out, lse = f(*leaves)
        grads = torch.autograd.grad(loss_of(out, lse if lse_weight is not None else None), leaves)
        results[label] = dict(out=out, dq=grads[0], dk=grads[1], dv=grads[2], dsinks=grads[3])
    assert forwards and all(forwards), forwards
    assert backwards == [schedule == "stable"], backwards
    visible = None if not causal else torch.ones(seq, seq, dtype=torch.bool, device="cuda").tril()
    terms = term_magnitudes(q, k, v, do, sinks=sinks, visible=visible, mask=mask, grad_lse=lse_weight)
    for name in ("out", "dq", "dk", "dv", "dsinks"):
        assert_close_to_ref(name, results["ours"][name], results["ref"][name], results["base"][name],
                            terms=terms.get(name))
    if mask is not None:
        assert (results["ours"]["out"][-1] == 0).all() and (results["ours"]["dq"][-1] == 0).all()
