"""Soft-capping and attention sinks in hand-written attention (passes/softcap.py, passes/sinks.py).

Gemma 2 / Grok soft-capping (``cap * tanh(scores / cap)`` before the mask) becomes the op's
``softcap=``; gpt-oss's sinks (a per-head column concatenated to the scores, the softmax over
it, the column dropped) its ``sinks=``. Each rewritten module matches eager in fp32 within the
project's rule against an fp64 run of the same module (``err <= 2 * err(eager fp32) + floor``),
output and the gradients of q, k, v, the mask and the sinks. Every near miss (a pattern that is
not exactly the op's semantics) is kept, with its reason, and the graph left computes exactly
what eager does.

Compiled with the pass and AOTAutograd, the graphs run as traced (model_zoo.pass_then_aot_eager);
the HF families themselves are in tests/models/test_transformers_models.py.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from flash_inductor.passes.report import REPORTS
from flash_inductor.passes.site import rewritten_attention
from helpers import assert_close_to_ref, randn
from model_zoo import assert_kept_as_eager, pass_only, pass_then_aot_eager

B, H, HKV, L, S, E = 2, 4, 2, 7, 9, 8
CAP = 5.0  # small enough that the cap bends the scores of these random inputs
SCALE = E**-0.5

pytestmark = pytest.mark.usefixtures("fresh_compiler")


def _randn(shape, seed, mult=1.0):
    return randn(shape, torch.float32, "cpu", seed, mult)


def _repeat_kv(x, n_rep):
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def _inputs(seq_q=L, seq_k=S):
    """q, k, v (K/V with HKV heads) and an HF-style additive (B, 1, L, S) mask of finfo.min."""
    q, k, v = (_randn((b, heads, seq, E), seed, mult) for b, heads, seq, seed, mult in
               ((B, H, seq_q, 1, 3.0), (B, HKV, seq_k, 2, 3.0), (B, HKV, seq_k, 3, 1.0)))
    hidden = torch.rand(B, 1, seq_q, seq_k, generator=torch.Generator().manual_seed(4)) < 0.3
    hidden[..., 0] = False
    return q, k, v, torch.zeros(B, 1, seq_q, seq_k).masked_fill(hidden, torch.finfo(torch.float32).min)


# ------------------------------------------------------------------------------------------
# Written as the families write them
# ------------------------------------------------------------------------------------------


class Gemma2(nn.Module):  # HF Gemma 2 eager_attention_forward
    def forward(self, q, k, v, mask):
        k, v = _repeat_kv(k, H // HKV), _repeat_kv(v, H // HKV)
        w = torch.matmul(q, k.transpose(2, 3)) * SCALE
        w = w / CAP
        w = torch.tanh(w)
        w = w * CAP
        w = w + mask
        w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        w = F.dropout(w, p=0.0, training=self.training)
        return torch.matmul(w, v)


class Grok(nn.Module):  # Grok-1: 30 * tanh(scores / 30), the scale folded into q, a causal fill
    def forward(self, q, k, v, mask):
        k, v = _repeat_kv(k, H // HKV), _repeat_kv(v, H // HKV)
        w = (q * SCALE) @ k.transpose(-2, -1)
        w = CAP * (w * (1.0 / CAP)).tanh()
        causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        return w.masked_fill(~causal, float("-inf")).softmax(dim=-1) @ v


class GptOss(nn.Module):  # HF gpt-oss eager_attention_forward
    def __init__(self, shift=True, softcap=False):
        super().__init__()
        self.sinks = nn.Parameter(torch.linspace(-1.0, 2.0, H))
        self.shift, self.softcap = shift, softcap

    def forward(self, q, k, v, mask):
        k, v = _repeat_kv(k, H // HKV), _repeat_kv(v, H // HKV)
        w = torch.matmul(q, k.transpose(2, 3)) * SCALE
        if self.softcap:
            w = torch.tanh(w / CAP) * CAP
        w = w + mask
        sinks = self.sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)
        combined = torch.cat([w, sinks], dim=-1)
        if self.shift:
            combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = F.softmax(combined, dim=-1, dtype=combined.dtype)
        scores = probs[..., :-1]
        w = F.dropout(scores, p=0.0, training=self.training).to(v.dtype)
        return torch.matmul(w, v)


def _rewrite(module, inputs, **compile_kwargs):
    """Compiled, eager and fp64 runs (output and every gradient) compared; the report's records."""
    params = list(module.parameters())
    runs = []
    for fn, dtype in ((torch.compile(module, backend=pass_then_aot_eager(), **compile_kwargs), None),
                      (module, None), (module, torch.float64)):
        REPORTS.clear()
        leaves = [t.detach().to(dtype or t.dtype).requires_grad_() if t.is_floating_point() else t for t in inputs]
        for p in params:
            p.grad = None
        with torch.no_grad():
            for p in params:
                p.data = p.data.to(dtype or torch.float32)
        out = fn(*leaves)
        out.backward(_randn(out.shape, 9).to(out.dtype))
        runs.append((out, [t.grad if t.is_floating_point() else None for t in leaves] + [p.grad for p in params],
                     [r for report in REPORTS for r in report.records]))
    (ours, ours_g, records), (eager, eager_g, _), (golden, golden_g, _) = runs
    with torch.no_grad():
        for p in params:
            p.data = p.data.float()
    assert_close_to_ref("out", ours, golden, eager)
    # A parameter's gradient here is the sinks', a sum over every row of P_sink * dO . out: its
    # terms are bounded by sum |dO| . |out|, far above the sum itself.
    d_out = _randn(golden.shape, 9).double()
    terms = (d_out.abs() * golden.detach().abs()).sum(-1).sum((0, 2)).max().item()
    for i, (a, b, c) in enumerate(zip(ours_g, eager_g, golden_g)):
        if c is not None:  # an input the module does not read, or an integer one
            assert_close_to_ref(f"grad {i}", a, c, b, terms=terms if i >= len(inputs) else None)
    return records


REWRITTEN = {
    "gemma2": (Gemma2, "handwritten_softcap", f"softcap {CAP:g}"),
    "grok": (Grok, "handwritten_softcap", f"causal, GQA, softcap {CAP:g}"),
    "gpt_oss": (GptOss, "handwritten_sinks", "sinks"),
    "gpt_oss_without_shift": (lambda: GptOss(shift=False), "handwritten_sinks", "sinks"),
    "sinks_and_softcap": (lambda: GptOss(softcap=True), "handwritten_sinks", f"softcap {CAP:g}, sinks"),
}


@pytest.mark.parametrize("case", list(REWRITTEN))
def test_rewritten_and_matches_eager(case):
    factory, pattern, words = REWRITTEN[case]
    records = _rewrite(factory().train(), _inputs())
    assert [(r.pattern, r.rewritten) for r in records] == [(pattern, True)], records
    assert words in records[0].detail, records[0].detail


def test_softcap_scale_absorbs_the_split():
    """``c * tanh(a * s)`` is the op's softcap c with scale a * c, however a is split."""
    gm = pass_only(Gemma2(), *_inputs())
    (call,) = [n for n in gm.graph.nodes if n.target is rewritten_attention]
    assert call.kwargs["softcap"] == CAP and math.isclose(call.kwargs["scale"], SCALE)


def test_sinks_reach_the_op_per_head():
    module = GptOss()
    gm = pass_only(module, *_inputs())
    (call,) = [n for n in gm.graph.nodes if n.target is rewritten_attention]
    assert tuple(call.kwargs["sinks"].meta["example_value"].shape) == (H,)
    assert not [n for n in gm.graph.nodes if n.target is torch.cat]


# ------------------------------------------------------------------------------------------
# Near misses: kept, with the reason, computing exactly what eager does
# ------------------------------------------------------------------------------------------


def _scores(q, k):
    return torch.matmul(q, _repeat_kv(k, H // HKV).transpose(-2, -1)) * SCALE


def _sinks(q):
    return torch.linspace(-1.0, 2.0, H).reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)


class TanhWithoutCap(nn.Module):  # tanh(s / c) + mask: squashed to (-1, 1), not capped at c
    def forward(self, q, k, v, mask):
        return torch.softmax(torch.tanh(_scores(q, k) / CAP) + mask, dim=-1) @ _repeat_kv(v, H // HKV)


class CapAfterMask(nn.Module):  # the mask inside the tanh: eager caps it with the scores
    def forward(self, q, k, v, mask):
        return torch.softmax(torch.tanh((_scores(q, k) + mask) / CAP) * CAP, dim=-1) @ _repeat_kv(v, H // HKV)


class ScaledAfterCap(nn.Module):  # c * tanh(s / c) * 0.5: the capped scores scaled again
    def forward(self, q, k, v, mask):
        w = torch.tanh(_scores(q, k) / CAP) * CAP * 0.5
        return torch.softmax(w + mask, dim=-1) @ _repeat_kv(v, H // HKV)


class NegativeCap(nn.Module):
    def forward(self, q, k, v, mask):
        w = torch.tanh(_scores(q, k) / CAP) * -CAP
        return torch.softmax(w + mask, dim=-1) @ _repeat_kv(v, H // HKV)


class TanhTwice(nn.Module):
    def forward(self, q, k, v, mask):
        w = torch.tanh(torch.tanh(_scores(q, k) / CAP) * CAP / CAP) * CAP
        return torch.softmax(w + mask, dim=-1) @ _repeat_kv(v, H // HKV)


class SinkFirst(nn.Module):  # the sink column first, the first column dropped
    def forward(self, q, k, v, mask):
        probs = torch.softmax(torch.cat([_sinks(q), _scores(q, k) + mask], dim=-1), dim=-1)
        return probs[..., 1:] @ _repeat_kv(v, H // HKV)


class SinkColumnKept(nn.Module):  # nn.MultiheadAttention's add_zero_attn: the column is attended
    def forward(self, q, k, v, mask):
        probs = torch.softmax(torch.cat([_scores(q, k) + mask, _sinks(q)], dim=-1), dim=-1)
        v = torch.cat([_repeat_kv(v, H // HKV), torch.zeros(B, H, 1, E)], dim=-2)
        return probs @ v


class MaskAfterSinks(nn.Module):  # the mask added after the concatenation: it would reach the sinks
    def forward(self, q, k, v, mask):
        w = torch.cat([_scores(q, k), _sinks(q)], dim=-1) + F.pad(mask, (0, 1))
        return torch.softmax(w, dim=-1)[..., :-1] @ _repeat_kv(v, H // HKV)


class SinkPerQuery(nn.Module):  # a sink that varies with the query: not one logit per head
    def forward(self, q, k, v, mask):
        column = q.sum(-1, keepdim=True)
        probs = torch.softmax(torch.cat([_scores(q, k) + mask, column], dim=-1), dim=-1)
        return probs[..., :-1] @ _repeat_kv(v, H // HKV)


class ShiftBeforeSinks(nn.Module):  # the row max subtracted before the sinks join: not a softmax shift
    def forward(self, q, k, v, mask):
        w = _scores(q, k) + mask
        w = w - w.max(dim=-1, keepdim=True).values
        probs = torch.softmax(torch.cat([w, _sinks(q)], dim=-1), dim=-1)
        return probs[..., :-1] @ _repeat_kv(v, H // HKV)


class DropoutBeforeDrop(nn.Module):  # dropout on the combined probabilities, then the column dropped
    def forward(self, q, k, v, mask):
        probs = torch.softmax(torch.cat([_scores(q, k) + mask, _sinks(q)], dim=-1), dim=-1)
        return F.dropout(probs, 0.0, True)[..., :-1] @ _repeat_kv(v, H // HKV)


KEPT = {
    "tanh_without_cap": (TanhWithoutCap, "not followed by a multiplication by the cap"),
    "cap_after_mask": (CapAfterMask, "before the tanh"),
    "scaled_after_cap": (ScaledAfterCap, "scaled again"),
    "negative_cap": (NegativeCap, "a soft cap is a positive constant"),
    "tanh_twice": (TanhTwice, "tanh twice"),
    "sink_first": (SinkFirst, "not one sink column"),
    "sink_column_kept": (SinkColumnKept, "before the sink column is dropped"),
    "mask_after_sinks": (MaskAfterSinks, "after the sink column was concatenated"),
    "sink_per_query": (SinkPerQuery, "not one logit per head"),
    "shift_before_sinks": (ShiftBeforeSinks, "only a shift of the whole softmax input"),
    "dropout_before_drop": (DropoutBeforeDrop, "before the sink column is dropped"),
}


@pytest.mark.parametrize("case", list(KEPT))
def test_near_miss_is_kept_with_its_reason(case):
    factory, reason = KEPT[case]
    assert_kept_as_eager(factory(), _inputs(), reason)


# ------------------------------------------------------------------------------------------
# Packed sequences: HF's causal AND same-sequence mask on the varlen op
# ------------------------------------------------------------------------------------------

POSITIONS = torch.tensor([[0, 1, 2, 3, 0, 1, 0, 1, 2], [0, 1, 2, 3, 4, 5, 6, 0, 1]])  # (B, S): documents restart at 0


class Packed(nn.Module):
    """HF Llama "eager" on a padding-free batch: masking_utils' sequence ids from position_ids and
    its dense mask (kv_idx <= q_idx) & (ids[b, q] == ids[b, kv]), as an additive finfo.min mask."""

    def __init__(self, causal=True, ids_from_cumsum=True):
        super().__init__()
        self.causal, self.ids_from_cumsum = causal, ids_from_cumsum

    def forward(self, q, k, v, position_ids):
        if self.ids_from_cumsum:
            diff = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
            ids = (diff != 1).cumsum(-1)
        else:  # ids taken as given: nothing says a document is one contiguous run
            ids = position_ids
        b, i, j = torch.arange(q.shape[0])[:, None, None, None], torch.arange(S) + 0, torch.arange(S) + 0
        i, j = i[None, None, :, None], j[None, None, None, :]
        keep = ids[b, i] == ids[b, j]
        if self.causal:
            keep = (j <= i) & keep
        mask = torch.where(keep.expand(q.shape[0], 1, S, S), torch.tensor(0.0), torch.finfo(torch.float32).min)
        k, v = _repeat_kv(k, H // HKV), _repeat_kv(v, H // HKV)
        w = torch.matmul(q, k.transpose(2, 3)) * SCALE + mask
        return torch.matmul(F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype), v)


def _packed_inputs():
    return _randn((B, H, S, E), 1), _randn((B, HKV, S, E), 2), _randn((B, HKV, S, E), 3)


def test_packed_sequences_run_on_varlen_and_match_eager():
    q, k, v = _packed_inputs()
    records = _rewrite(Packed().train(), (q, k, v, POSITIONS))
    assert [(r.pattern, r.rewritten) for r in records] == [("handwritten_packed", True)], records
    assert "packed sequences on varlen, causal" in records[0].detail
    gm = pass_only(Packed(), q, k, v, POSITIONS)
    assert not [n for n in gm.graph.nodes if n.target is rewritten_attention]  # the varlen call instead


@pytest.mark.parametrize("variant", [dict(causal=False), dict(ids_from_cumsum=False)], ids=["not_causal", "ids_given"])
def test_packed_mask_it_cannot_prove_stays_dense(variant):
    """Without the causal band, or with ids that need not be contiguous runs, the mask stays a
    dense mask, as before: rewritten, matching eager."""
    q, k, v = _packed_inputs()
    records = _rewrite(Packed(**variant).train(), (q, k, v, POSITIONS))
    assert [r.rewritten for r in records] == [True] and records[0].pattern != "handwritten_packed", records


_SHADOWED = {"softcap": (Gemma2, lambda: _inputs()), "sinks": (GptOss, lambda: _inputs()),
             "packed": (Packed, lambda: (*_packed_inputs(), POSITIONS))}


def _shadow_report(variant):
    from flash_inductor import debug

    factory, inputs = _SHADOWED[variant]
    model = factory()
    args = [t.requires_grad_() if t.is_floating_point() else t for t in inputs()]
    with debug.shadow(model) as check:
        model(*args).sum().backward()
    return check.report()


@pytest.mark.parametrize("variant", list(_SHADOWED))
def test_debug_shadow_on_the_new_sites(variant):
    """debug.shadow's float64 twin applies the soft cap, the sinks and the packed documents (the
    pass's sequence ids, as a dense mask on the side): out, dq, dk and dv are compared, and pass."""
    report = _shadow_report(variant)
    assert len(report.sites) == 1 and report.first_failure is None, str(report)
    assert {c.result for c in report.checks if c.compared} == {"out", "dq", "dk", "dv"}, str(report)


def test_debug_shadow_of_a_packed_site_sees_its_documents(monkeypatch):
    """Negative control: a twin that lets every token see every earlier token of its row (the
    documents forgotten) is flagged at the packed site."""
    from flash_inductor.debug import sites

    monkeypatch.setattr(sites, "document_visibility", lambda ids: torch.ones_like(ids, dtype=torch.bool)[:, None, :, None]
                        .expand(ids.shape[0], 1, ids.shape[1], ids.shape[1]))
    report = _shadow_report("packed")
    assert report.first_failure is not None and report.first_failure.result == "out", str(report)
