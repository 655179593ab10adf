"""Attention variants: soft-capping, sinks, packed sequences (flash_attention_varlen) and nested
jagged tensors, against float64 references written here from the definitions (not from the op).

Tolerance: the project's rule (helpers.assert_close_to_ref), with the same formula evaluated in the
input dtype as PyTorch's same-dtype baseline. Adversarial cases (large logits, rows that see no
key, near ties) run with each variant.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from helpers import DEVICE, assert_close_to_ref, dtype_id, randn
from variant_refs import term_magnitudes, variant_reference, varlen_reference, varlen_term_magnitudes

import flash_inductor
from flash_inductor import flash_attention, flash_attention_varlen

DTYPES = (torch.float16, torch.bfloat16, torch.float32) if DEVICE == "cuda" else (torch.float16, torch.float32)


def _grads(out, inputs, grad_out):
    return torch.autograd.grad(out, inputs, grad_out)


def _check_against_fp64(dtype, make_call, q, k, v, sinks=None, terms_of=None):
    """ours(dtype) vs reference(fp64), with reference(dtype) as the baseline: out and gradients.
    ``terms_of(q, k, v, grad_out)``: the magnitudes of the terms behind each result (the fp32
    floor of the tolerance rule scales with them, variant_refs.term_magnitudes)."""
    def leaves(target_dtype):
        tensors = [t.detach().to(target_dtype).requires_grad_() for t in (q, k, v)]
        if sinks is not None:
            tensors.append(sinks.detach().to(target_dtype).requires_grad_())
        return tensors

    grad_out = randn(q.shape[:-1] + (v.shape[-1],), torch.float64, q.device, seed=7)
    mine, truth, same = leaves(dtype), leaves(torch.float64), leaves(dtype)
    ours = make_call(flash_attention, *mine)
    ref = make_call(variant_reference, *truth)
    base = make_call(variant_reference, *same)
    terms = terms_of(*truth[:3], grad_out) if terms_of is not None else {}
    assert_close_to_ref("out", ours, ref, base, terms=terms.get("out"))
    for name, a, b, c in zip(("dq", "dk", "dv", "dsinks"), _grads(ours, mine, grad_out.to(dtype)),
                             _grads(ref, truth, grad_out), _grads(base, same, grad_out.to(dtype))):
        assert_close_to_ref(name, a, b, c, terms=terms.get(name))


def _causal_visible(seq_q, seq_k, device):
    return torch.ones(seq_q, seq_k, dtype=torch.bool, device=device).tril()


# ------------------------------------------------------------------------------------------
# Soft-capping and sinks on the dense op
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("variant", ["softcap", "sinks", "both"])
def test_variant_matches_fp64(dtype, causal, variant):
    q = randn((2, 4, 67, 32), torch.float64, DEVICE, seed=1, mult=2.0)  # logits up to ~±30: the cap binds
    k = randn((2, 2, 67, 32), torch.float64, DEVICE, seed=2, mult=2.0)
    v = randn((2, 2, 67, 32), torch.float64, DEVICE, seed=3)
    sinks = randn((4,), torch.float64, DEVICE, seed=4, mult=3.0) if variant != "softcap" else None
    cap = 20.0 if variant != "sinks" else 0.0
    visible = _causal_visible(67, 67, DEVICE) if causal else None

    def call(fn, q, k, v, *rest):
        extra = dict(softcap=cap or None, sinks=rest[0] if rest else None)
        if fn is flash_attention:
            return fn(q, k, v, is_causal=causal, enable_gqa=True, **extra)
        return fn(q, k, v, softcap=cap, sinks=extra["sinks"], visible=visible)

    _check_against_fp64(dtype, call, q, k, v, sinks, terms_of=lambda q, k, v, g: term_magnitudes(
        q, k, v, g, softcap=cap, sinks=sinks, visible=visible))


def test_softcap_is_applied_before_the_mask_and_bounds_the_logits():
    """With a float mask, the cap applies to the scaled scores only: the mask's -1000 still hides
    a key (a cap after the mask would lift it to -cap)."""
    q, k, v = (randn((1, 1, 8, 16), torch.float64, DEVICE, seed=s, mult=4.0) for s in (1, 2, 3))
    mask = torch.zeros(8, 8, dtype=torch.float64, device=DEVICE)
    mask[:, 0] = -1000.0
    out = flash_attention(q, k, v, attn_mask=mask, softcap=5.0)
    s = 5.0 * torch.tanh((q @ k.transpose(-1, -2)) / 4 / 5.0) + mask
    torch.testing.assert_close(out, torch.softmax(s, -1) @ v, rtol=1e-12, atol=1e-12)
    # Without the cap the same problem gives another answer: the cap is not a no-op here.
    assert (flash_attention(q, k, v, attn_mask=mask) - out).abs().max() > 1e-2


def test_float_mask_gradient_under_softcap():
    q, k, v = (randn((1, 2, 9, 8), torch.float64, DEVICE, seed=s, mult=3.0) for s in (1, 2, 3))
    mask = randn((1, 2, 9, 9), torch.float64, DEVICE, seed=4).requires_grad_()
    torch.autograd.gradcheck(lambda m: flash_attention(q, k, v, attn_mask=m, softcap=2.5), (mask,))


def test_sinks_gradcheck():
    q, k, v = (randn((1, 2, 6, 4), torch.float64, DEVICE, seed=s).requires_grad_() for s in (1, 2, 3))
    sinks = randn((2,), torch.float64, DEVICE, seed=4).requires_grad_()
    torch.autograd.gradcheck(lambda q, k, v, s: flash_attention(q, k, v, is_causal=True, sinks=s, softcap=3.0),
                             (q, k, v, sinks))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_dead_rows_with_sinks(dtype):
    """A row that sees no key: output exactly 0, zero gradients for q, k, v; the sink takes the
    whole weight, and its gradient there is -dO . out = 0."""
    q, k, v = (randn((1, 2, 8, 16), dtype, DEVICE, seed=s).requires_grad_() for s in (1, 2, 3))
    sinks = randn((2,), torch.float32, DEVICE, seed=4).requires_grad_()
    mask = torch.ones(8, 8, dtype=torch.bool, device=DEVICE)
    mask[3] = False
    out = flash_attention(q, k, v, attn_mask=mask, sinks=sinks, softcap=10.0)
    assert (out[:, :, 3] == 0).all()
    grad_out = torch.zeros_like(out)
    grad_out[:, :, 3] = 1.0  # only the dead row receives a gradient
    dq, dk, dv, dsinks = torch.autograd.grad(out, (q, k, v, sinks), grad_out)
    assert (dq == 0).all() and (dk == 0).all() and (dv == 0).all() and (dsinks == 0).all()


def test_sinks_lse_contract():
    """With sinks, the row's LSE is log(sum exp(s) + exp(sink)), and sink = -inf changes nothing."""
    from flash_inductor.ops.sinks import fold_sinks

    out = randn((1, 2, 3, 4), torch.float64, DEVICE, seed=1)
    lse = torch.tensor([[[0.5, -math.inf, 2.0], [1.0, 3.0, -1.0]]], dtype=torch.float64, device=DEVICE)
    sinks = torch.tensor([1.0, -math.inf], dtype=torch.float64, device=DEVICE)
    folded, folded_lse = fold_sinks(out, lse, sinks)
    expected = torch.logaddexp(lse, sinks[None, :, None])
    torch.testing.assert_close(folded_lse, expected)
    assert folded_lse[0, 0, 1] == 1.0  # a dead row's LSE is its sink
    torch.testing.assert_close(folded[0, 1], out[0, 1])  # sink -inf: unchanged
    torch.testing.assert_close(folded[0, 0, 0], out[0, 0, 0] * torch.sigmoid(torch.tensor(0.5 - 1.0,
                                                                                          dtype=torch.float64)))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_large_logits_and_near_ties_with_variants(dtype, request):
    """Logits of several thousand in fp16 (QK^T overflows fp16 there) with a cap and sinks:
    finite, and within the tolerance rule of the fp64 reference."""
    if dtype == torch.float32 and DEVICE == "cuda":
        # The fp32 kernels' base-2 scores: at the cap (|s| = 30, 43 in base 2) one fp32 ulp of
        # s·log2(e) is up to twice one of s, and dq lands 1.2x past the rule (H100, 2026-12-07);
        # docs/performance.md, "Smaller leads" (a per-row reference before the base-2 conversion).
        request.applymarker(pytest.mark.xfail(strict=True, reason="fp32 base-2 scores at large logits"))
    q = randn((1, 2, 40, 64), torch.float64, DEVICE, seed=1, mult=12.0)
    k = randn((1, 2, 40, 64), torch.float64, DEVICE, seed=2, mult=12.0)
    v = randn((1, 2, 40, 64), torch.float64, DEVICE, seed=3)
    k[:, :, 1] = k[:, :, 0]  # an exact tie
    sinks = torch.tensor([50.0, -3.0], dtype=torch.float64, device=DEVICE)

    def call(fn, q, k, v, *rest):
        if fn is flash_attention:
            return fn(q, k, v, softcap=30.0, sinks=rest[0])
        return fn(q, k, v, softcap=30.0, sinks=rest[0])

    _check_against_fp64(dtype, call, q, k, v, sinks, terms_of=lambda q, k, v, g: term_magnitudes(
        q, k, v, g, softcap=30.0, sinks=sinks))


# ------------------------------------------------------------------------------------------
# Packed sequences
# ------------------------------------------------------------------------------------------


def _cu(lengths):
    return F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("extra", ["plain", "window", "softcap_sinks"])
def test_varlen_matches_per_sequence_fp64(dtype, causal, extra):
    lengths_q, lengths_k = [33, 1, 70, 0, 17], [40, 5, 70, 3, 9]  # ragged, Lq < Lk, Lq > Lk, empty
    heads_q, heads_kv = 4, 2
    q = randn((sum(lengths_q), heads_q, 32), torch.float64, DEVICE, seed=1)
    k = randn((sum(lengths_k), heads_kv, 32), torch.float64, DEVICE, seed=2)
    v = randn((sum(lengths_k), heads_kv, 32), torch.float64, DEVICE, seed=3)
    options = dict(window=(-1, -1), softcap=0.0)
    if extra == "window":
        options["window"] = (7, 3)
    sinks = randn((heads_q,), torch.float64, DEVICE, seed=4) if extra == "softcap_sinks" else None
    if extra == "softcap_sinks":
        options["softcap"] = 4.0

    def call(fn, q, k, v, *rest):
        if fn is flash_attention:
            return flash_attention_varlen(q, k, v, _cu(lengths_q), _cu(lengths_k), 70, 70, causal=causal,
                                          window_size=options["window"], softcap=options["softcap"],
                                          sinks=rest[0] if rest else None)
        return varlen_reference(q, k, v, lengths_q, lengths_k, causal=causal, window=options["window"],
                                softcap=options["softcap"], sinks=rest[0] if rest else None)

    _check_against_fp64(dtype, call, q, k, v, sinks, terms_of=lambda q, k, v, g: varlen_term_magnitudes(
        q, k, v, g, lengths_q, lengths_k, causal=causal, window=options["window"], softcap=options["softcap"],
        sinks=sinks))


def test_varlen_visits_no_other_sequence(monkeypatch):
    """Off the kernels (CPU, float64, ...) each sequence is one dense problem over its own rows and
    keys: the dense op is called once per non-empty sequence with exactly that sequence's lengths
    (no mask, no other keys). The kernels' one launch is test_kernels_varlen.py's."""
    from flash_inductor.ops import varlen as varlen_ops

    monkeypatch.setattr(varlen_ops, "_on_kernels", lambda *args: False)
    calls = []
    real = torch.ops.flash_inductor.attention_forward

    def spy(q, k, v, mask, *args):
        calls.append((q.shape[2], k.shape[2], mask))
        return real(q, k, v, mask, *args)

    monkeypatch.setattr(torch.ops.flash_inductor, "attention_forward", spy)
    lengths = [5, 0, 12, 7]
    q = randn((24, 2, 8), torch.float32, DEVICE, seed=1)
    flash_attention_varlen(q, q, q, _cu(lengths), _cu(lengths), 12, 12, causal=True)
    assert [(lq, lk) for lq, lk, _ in calls] == [(5, 5), (12, 12), (7, 7)]
    assert all(mask is None for _, _, mask in calls)


def test_varlen_gradients_are_contiguous_for_permuted_inputs():
    """Packed inputs that are views of a (B, H, L, E) tensor (what the pass's packed sites hand over)
    get gradients in the layout the ops' fake kernels promise (contiguous), so a compiled graph
    whose q/k/v come out of another opaque op does not trip on a stride assertion."""
    lengths = [5, 1, 9]
    total = sum(lengths)
    q, k, v = (randn((1, 2, total, 8), torch.float32, DEVICE, seed=30 + i).requires_grad_() for i in range(3))
    packed = [t[0].transpose(0, 1) for t in (q, k, v)]  # (total, H, E), strides (E, total * E, 1)
    assert not packed[0].is_contiguous()
    out = flash_attention_varlen(*packed, _cu(lengths), _cu(lengths), 9, 9, causal=True)
    grads = torch.ops.flash_inductor.attention_varlen_backward(
        torch.ones_like(out), *packed, out, torch.zeros(2, total, device=DEVICE), None, _cu(lengths), _cu(lengths),
        9, 9, None, 0.0, True, True, 8 ** -0.5, "stable")
    assert all(g.is_contiguous() and g.shape == t.shape for g, t in zip(grads, packed))
    out.sum().backward()
    assert q.grad.abs().amax() > 0


def test_varlen_dropout_reproducible_and_independent_per_sequence():
    lengths = [16, 16]
    q, k, v = (randn((32, 2, 8), torch.float32, DEVICE, seed=1) for _ in range(3))
    k = k + 0  # the same two sequences twice: equal inputs, the dropout alone can tell them apart
    q = torch.cat([q[:16], q[:16]])
    k = torch.cat([k[:16], k[:16]])
    v = torch.cat([v[:16], v[:16]])
    torch.manual_seed(3)
    first = flash_attention_varlen(q, k, v, _cu(lengths), _cu(lengths), 16, 16, dropout_p=0.3)
    torch.manual_seed(3)
    again = flash_attention_varlen(q, k, v, _cu(lengths), _cu(lengths), 16, 16, dropout_p=0.3)
    assert torch.equal(first, again)
    assert not torch.equal(first[:16], first[16:])


@pytest.mark.parametrize("bad, message", [
    (dict(cu_seqlens_q=torch.tensor([1, 5], dtype=torch.int32)), "cu_seqlens_q must start at 0"),
    (dict(cu_seqlens_q=torch.tensor([0, 9, 5], dtype=torch.int32),
          cu_seqlens_k=torch.tensor([0, 4, 8], dtype=torch.int32)), "never decrease"),
    (dict(cu_seqlens_q=torch.tensor([0, 20], dtype=torch.int32)), "end at the packed length"),
    (dict(cu_seqlens_q=torch.tensor([0, 5], dtype=torch.int32)), "end at the packed length"),
    (dict(cu_seqlens_q=torch.tensor([0.0, 8.0])), "int32 or int64"),
    (dict(cu_seqlens_k=torch.tensor([0, 4, 8], dtype=torch.int32)), "same number of sequences"),
    (dict(max_seqlen_q=3), "max_seqlen_q=3 is below the longest sequence"),
    (dict(window_size=(2,)), "window_size must be a"),
    (dict(softcap=-1.0), "softcap must be None or a finite real"),
    (dict(sinks=torch.zeros(3)), "sinks must have shape (2,)"),
    (dict(causal="yes"), "causal must be a bool"),
])
def test_varlen_errors_name_the_argument(bad, message):
    q = randn((8, 2, 4), torch.float32, DEVICE, seed=1)
    args = dict(cu_seqlens_q=torch.tensor([0, 8], dtype=torch.int32, device=DEVICE),
                cu_seqlens_k=torch.tensor([0, 8], dtype=torch.int32, device=DEVICE), max_seqlen_q=8, max_seqlen_k=8)
    args.update({key: (value.to(DEVICE) if isinstance(value, torch.Tensor) else value) for key, value in bad.items()})
    with pytest.raises((ValueError, TypeError), match=message.replace("(", r"\(").replace(")", r"\)")):
        flash_attention_varlen(q, q, q, **args)


@pytest.mark.parametrize("bad, message", [
    (dict(softcap=float("nan")), "softcap must be None or a finite real"),
    (dict(sinks=torch.zeros(2, dtype=torch.int64)), "sinks must be a floating tensor"),
    (dict(sinks=torch.zeros(4, 1)), r"sinks must have shape \(2,\)"),
    (dict(softcap=5.0, schedule="fp8"), "not supported with schedule='fp8'"),
])
def test_variant_errors_name_the_argument(bad, message):
    q = randn((1, 2, 8, 16), torch.float32, DEVICE, seed=1)
    if bad.get("schedule") == "fp8" and DEVICE == "cpu":
        pytest.skip("fp8 is refused on CPU before the soft cap is looked at")
    with pytest.raises((ValueError, TypeError), match=message):
        flash_attention(q, q, q, **{key: (value.to(DEVICE) if isinstance(value, torch.Tensor) else value)
                                    for key, value in bad.items()})


# ------------------------------------------------------------------------------------------
# Nested jagged tensors (SDPA's varlen spelling)
# ------------------------------------------------------------------------------------------


def _jagged(lengths, heads, dim, seed, dtype=torch.float64):
    parts = [randn((n, heads, dim), dtype, DEVICE, seed=seed + i) for i, n in enumerate(lengths)]
    return torch.nested.nested_tensor(parts, layout=torch.jagged).transpose(1, 2)


def test_nested_jagged_matches_sdpa_and_per_sequence():
    q, k, v = (_jagged([5, 13, 2], 4, 16, seed).requires_grad_() for seed in (10, 20, 30))
    ours = flash_attention(q, k, v)
    assert ours.is_nested and ours.shape[0] == 3 and ours.shape[2] is q.shape[2] or ours.shape[2] == q.shape[2]
    # SDPA's own nested path, where this torch has one for these inputs; always the definition.
    packed = [t.transpose(1, 2).values() for t in (q, k, v)]
    ref = varlen_reference(*packed, [5, 13, 2], [5, 13, 2], causal=False)
    torch.testing.assert_close(ours.transpose(1, 2).values(), ref, rtol=1e-10, atol=1e-10)
    grad_out = randn(ref.shape, torch.float64, DEVICE, seed=5)
    mine = torch.autograd.grad(ours.transpose(1, 2).values(), (q, k, v), grad_out)
    theirs = torch.autograd.grad(ref, packed, grad_out)
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a.transpose(1, 2).values(), b, rtol=1e-10, atol=1e-10)
    try:
        sdpa = F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach())
    except RuntimeError:
        return
    torch.testing.assert_close(ours.detach().transpose(1, 2).values(), sdpa.transpose(1, 2).values())


def test_nested_jagged_causal_is_top_left_per_sequence():
    q = _jagged([6, 3], 2, 8, 40)
    k, v = _jagged([6, 3], 2, 8, 50), _jagged([6, 3], 2, 8, 60)
    ours = flash_attention(q, k, v, is_causal=True, sinks=torch.tensor([0.5, -1.0], dtype=torch.float64, device=DEVICE))
    packed = [t.transpose(1, 2).values() for t in (q, k, v)]
    ref = varlen_reference(*packed, [6, 3], [6, 3], causal=True, lower_right=False,
                           sinks=torch.tensor([0.5, -1.0], dtype=torch.float64, device=DEVICE))
    torch.testing.assert_close(ours.transpose(1, 2).values(), ref, rtol=1e-10, atol=1e-10)


def test_nested_refuses_a_mask_with_a_clear_error():
    q = _jagged([4, 2], 2, 8, 1)
    with pytest.raises(ValueError, match="attn_mask is not supported with nested jagged inputs"):
        flash_attention(q, q, q, attn_mask=torch.ones(1, dtype=torch.bool, device=DEVICE))
    dense = randn((2, 2, 4, 8), torch.float64, DEVICE, seed=1)
    with pytest.raises(ValueError, match="key must be a nested jagged tensor"):
        flash_attention(q, dense, dense)


# ------------------------------------------------------------------------------------------
# Under torch.compile
# ------------------------------------------------------------------------------------------


def test_variants_compile_and_match_eager():
    q, k, v = (randn((1, 2, 24, 16), torch.float32, DEVICE, seed=s).requires_grad_() for s in (1, 2, 3))
    sinks = randn((2,), torch.float32, DEVICE, seed=4).requires_grad_()
    lengths = [10, 14]
    packed = [t.detach()[0].transpose(0, 1).contiguous().requires_grad_() for t in (q, k, v)]

    def dense(q, k, v, sinks):
        return flash_attention(q, k, v, is_causal=True, softcap=8.0, sinks=sinks)

    def packed_call(q, k, v, sinks):
        return flash_attention_varlen(q, k, v, _cu(lengths), _cu(lengths), 14, 14, causal=True, sinks=sinks)

    for fn, inputs in ((dense, (q, k, v, sinks)), (packed_call, (*packed, sinks))):
        eager = fn(*inputs)
        compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)(*inputs)
        torch.testing.assert_close(compiled, eager)
        grads_eager = torch.autograd.grad(eager.sum(), inputs)
        grads_compiled = torch.autograd.grad(compiled.sum(), inputs)
        for a, b in zip(grads_compiled, grads_eager):
            torch.testing.assert_close(a, b)


def test_public_api_exports_varlen():
    assert "flash_attention_varlen" in flash_inductor.__all__


# ------------------------------------------------------------------------------------------
# The debug tools and the monitor
# ------------------------------------------------------------------------------------------


def test_shadow_check_knows_the_soft_cap():
    """debug.shadow's float64 twin and its same-dtype baseline apply the cap: a soft-capped site
    passes the rule (without the cap in the twin its error would be the cap's whole effect)."""
    from helpers import assert_shadow_check_passes

    assert_shadow_check_passes(13, is_causal=True, softcap=0.5)


def test_shadow_twin_without_the_cap_would_fail():
    """The check above can fail: the same site judged against an uncapped twin breaks the rule."""
    from flash_inductor.debug import sites

    q, k, v = (randn((1, 2, 9, 8), torch.float32, "cpu", seed=s, mult=3.0) for s in (1, 2, 3))
    ours = flash_attention(q, k, v, softcap=0.5)
    capped = sites._reference64(q, k, v, None, scale=None, is_causal=False, causal_offset=0, softcap=0.5)
    uncapped = sites._reference64(q, k, v, None, scale=None, is_causal=False, causal_offset=0)
    assert (ours.double() - capped).abs().max() < 1e-5 < (ours.double() - uncapped).abs().max()


def test_monitor_counts_rows_without_keys_under_sinks():
    """The monitor describes the keys' scores: a row that sees no key counts as fully masked even
    though its sink holds the row's weight."""
    q = randn((1, 2, 6, 8), torch.float32, "cpu", seed=1)
    mask = torch.ones(6, 6, dtype=torch.bool)
    mask[2] = False
    with flash_inductor.monitor() as m:
        flash_attention(q, q, q, attn_mask=mask, sinks=torch.zeros(2))
    (forward,) = [r for r in m.records() if r["phase"] == "forward"]
    assert forward["masked_rows"] == 2  # two heads x one dead row


def test_shadow_twin_models_the_sinks():
    """debug.shadow's float64 twin and same-dtype baseline include the sink column: they match the
    op with sinks, and without the sinks the twin would be off by the sinks' whole effect."""
    from flash_inductor.debug import sites

    q, k, v = (randn((1, 2, 9, 8), torch.float64, "cpu", seed=s) for s in (1, 2, 3))
    sinks = torch.tensor([1.5, -0.5], dtype=torch.float64)
    ours = flash_attention(q, k, v, is_causal=True, sinks=sinks)
    common = dict(scale=None, is_causal=True, causal_offset=0)
    twin = sites._reference64(q, k, v, None, sinks=sinks, **common)
    baseline = sites._baseline_same_dtype(q, k, v, None, sinks=sinks, **common)
    without = sites._reference64(q, k, v, None, **common)
    assert (ours - twin).abs().max() < 1e-12 and (ours - baseline).abs().max() < 1e-12
    assert (ours - without).abs().max() > 1e-2
