"""Band masks rewritten into the op's ``window`` (issue 33, item 3).

* Each band form (HF's ``arange`` comparisons, ``tril``/``triu(..., diagonal=±w)``,
  ``abs(i - j) <= w`` and its variants, NOT and OR spellings) is read with the right
  ``(left, right)``, applied as an SDPA bool mask, a ``masked_fill`` and an additive
  ``where(band, 0, -inf)``; the compiled result and gradients match eager by the project's rule
  (fp64 golden, twice PyTorch's own same-dtype error plus a floor).
* Masks that only look like bands keep their dense mask: a diagonal of the wrong sign, a window
  held in a tensor or in a symbolic size that does not cancel, a band on the head dim, a
  transposed band, a union, float indices; a band AND data keeps the data part.
* HF transformers families with ``sliding_window`` (Mistral, Qwen2, Gemma 2, Gemma 3, Cohere2,
  Phi-3), "eager" and "sdpa", padded or not: each sliding layer reports its window and the
  output matches eager; and the issue's acceptance test, a tiny Mistral whose window is shorter
  than the sequence, forward and backward.

On CPU the models run the pass with AOTAutograd eagerly (``model_zoo.compile_backend``), as
tests/models does; the acceptance test's inference compiles with ``flash_inductor.backend``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import flash_inductor
from flash_inductor.passes.report import REPORTS
from flash_inductor.passes.site import AttentionSite
from helpers import (DEVICE, assert_close_to_ref, assert_shadow_check_passes, found_attention_sites,
                     needs_transformers, randn)
from model_zoo import HEADS, HIDDEN, KV_HEADS, SEQ, VOCAB, compile_backend, token_inputs

B, H, L, E, W = 2, 2, 9, 8, 3

pytestmark = pytest.mark.usefixtures("fresh_compiler")



def _randn(*shape, dtype=torch.float32, seed=0):
    return randn(shape, dtype, DEVICE, seed)


def _qkv(seq_q=L, seq_k=L, dtype=torch.float32):
    return (_randn(B, H, seq_q, E, dtype=dtype, seed=1), _randn(B, H, seq_k, E, dtype=dtype, seed=2),
            _randn(B, H, seq_k, E, dtype=dtype, seed=3))


def _rows_cols(q, k):
    """Row (query) and column (key) indices as HF builds them: the query's positions end at the
    last key's (bottom-right aligned), so L < S reads as the last L of S positions."""
    seq_q, seq_k = q.shape[-2], k.shape[-2]
    i = (torch.arange(seq_q, device=q.device) + (seq_k - seq_q))[:, None]
    j = torch.arange(seq_k, device=q.device)[None, :]
    return i, j


# ------------------------------------------------------------------------------------------
# Band forms: each builds the visible-key condition in forward code
# ------------------------------------------------------------------------------------------


def hf_sliding(q, k):  # masking_utils.sliding_window_causal_mask_function(W)
    i, j = _rows_cols(q, k)
    return (j > i - W) & (j <= i)


def tril_triu(q, k):
    return torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril().triu(diagonal=-W)


def tril_plus_w(q, k):  # float ones, tril above the diagonal: keys up to W ahead
    return torch.tril(torch.ones(q.shape[-2], k.shape[-2], device=q.device), diagonal=W) != 0


def triu_minus_w(q, k):
    return torch.triu(torch.ones(q.shape[-2], k.shape[-2], device=q.device), diagonal=-W).bool()


def abs_le(q, k):  # Longformer-style symmetric local attention
    i, j = _rows_cols(q, k)
    return (i - j).abs() <= W


def abs_le_causal(q, k):  # a local band AND a causal mask
    i, j = _rows_cols(q, k)
    return ((j - i).abs() <= W) & (j <= i)


def abs_lt(q, k):
    i, j = _rows_cols(q, k)
    return torch.abs(j - i) < W


def not_abs_gt(q, k):
    i, j = _rows_cols(q, k)
    return ~((i - j).abs() > W)


def not_or(q, k):
    i, j = _rows_cols(q, k)
    return ~((j > i) | (j < i - W))


def transposed_names(q, k):  # the causal sliding band built with rows and columns swapped: its mirror
    i, j = _rows_cols(q, k)
    return (i > j - W) & (i <= j)


# (condition, (left, right)) for L = S; hf_sliding also for L < S.
BANDS = {
    "hf_sliding": (hf_sliding, (W - 1, 0)),
    "tril_triu": (tril_triu, (W, 0)),
    "tril_plus_w": (tril_plus_w, (-1, W)),
    "triu_minus_w": (triu_minus_w, (W, -1)),
    "abs_le": (abs_le, (W, W)),
    "abs_le_causal": (abs_le_causal, (W, 0)),
    "abs_lt": (abs_lt, (W - 1, W - 1)),
    "not_abs_gt": (not_abs_gt, (W, W)),
    "not_or": (not_or, (W, 0)),
    "transposed_names": (transposed_names, (0, W - 1)),
}


class Sdpa(nn.Module):
    def __init__(self, condition):
        super().__init__()
        self.condition = condition

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.condition(q, k))


class Fill(nn.Module):  # scores.masked_fill(~band, -inf), as forward code writes a local mask
    def __init__(self, condition):
        super().__init__()
        self.condition = condition

    def forward(self, q, k, v):
        scores = q @ k.transpose(-2, -1) / E**0.5
        return scores.masked_fill(~self.condition(q, k), float("-inf")).softmax(dim=-1) @ v


class Additive(nn.Module):  # scores + where(band, 0, -inf): HF "eager"'s additive form
    def __init__(self, condition, fill=float("-inf")):
        super().__init__()
        self.condition, self.fill = condition, fill

    def forward(self, q, k, v):
        scores = q @ k.transpose(-2, -1) * E**-0.5
        mask = torch.where(self.condition(q, k), torch.tensor(0.0, device=q.device), self.fill)
        return torch.softmax(scores + mask, dim=-1) @ v


MODES = {"sdpa": Sdpa, "fill": Fill, "additive": Additive}


# ------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------


_found_sites = found_attention_sites


def _one_site(module, *inputs, dynamic=False) -> AttentionSite:
    found = _found_sites(module, *inputs, dynamic=dynamic)
    assert len(found) == 1 and isinstance(found[0], AttentionSite), found
    return found[0]


def _window(site: AttentionSite):
    return None if site.window is None else site.window.as_argument()


def _records():
    return [r for report in REPORTS for r in report.sites]


def _check_against_eager(module, inputs, *, grad=True, dynamic=False):
    """Compiled (pass + op) vs eager in the same dtype vs an fp64 golden: output and gradients."""
    compiled = torch.compile(module, backend=compile_backend(), dynamic=dynamic)
    runs = []
    for fn, dtype in ((compiled, None), (module, None), (module, torch.float64)):
        leaves = [t.detach().to(dtype or t.dtype).requires_grad_(grad) for t in inputs]
        out = fn(*leaves)
        grads = []
        if grad:
            out.backward(_randn(*out.shape, dtype=out.dtype, seed=9))
            grads = [t.grad for t in leaves]
        runs.append([out, *grads])
    for name, ours, eager, golden in zip(["out", "dq", "dk", "dv"], *runs):
        assert_close_to_ref(name, ours, golden, eager)


def _assert_rewritten_with(detail: str):
    records = _records()
    assert records and all(r.rewritten and detail in r.detail for r in records), \
        "\n".join(report.format() for report in REPORTS)


# ------------------------------------------------------------------------------------------
# Each band form: read, and computed as eager computes it
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("form", list(BANDS))
def test_band_form_is_read_as_its_window(form, mode):
    condition, want = BANDS[form]
    site = _one_site(MODES[mode](condition), *_qkv())
    assert _window(site) == want
    assert site.attn_mask is None and not site.is_causal
    if mode != "sdpa":
        assert site.pattern == "handwritten_window"


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("form", list(BANDS))
def test_band_form_matches_eager(form, mode):
    condition, want = BANDS[form]
    _check_against_eager(MODES[mode](condition), _qkv())
    kind = "sliding window" if -1 not in want else "window"
    _assert_rewritten_with(f"{kind} (left={want[0]}, right={want[1]})")


@pytest.mark.parametrize("seq_q", [4, 1], ids=["L4", "decode"])
@pytest.mark.parametrize("mode", list(MODES))
def test_fewer_queries_than_keys_align_bottom_right(mode, seq_q):
    """HF with a KV cache: the last L of S positions query; (W - 1, 0) is bottom-right aligned.
    One query (decoding): its row index is constant, so the bounds are on the key index alone."""
    site = _one_site(MODES[mode](hf_sliding), *_qkv(seq_q=seq_q, seq_k=L))
    assert _window(site) == (W - 1, 0)
    _check_against_eager(MODES[mode](hf_sliding), _qkv(seq_q=seq_q, seq_k=L))


def test_causal_band_with_equal_lengths_is_is_causal():
    def causal(q, k):
        i, j = _rows_cols(q, k)
        return j <= i

    for mode in MODES:
        site = _one_site(MODES[mode](causal), *_qkv())
        assert site.is_causal and site.window is None and site.attn_mask is None, mode


def test_symbolic_lengths_that_cancel_keep_the_window():
    """dynamic=True: q and k share the symbolic length, so S - L cancels and the window is constant."""
    site = _one_site(Sdpa(hf_sliding), *_qkv(), dynamic=True)
    assert _window(site) == (W - 1, 0)
    _check_against_eager(Sdpa(hf_sliding), _qkv(), dynamic=True)


# ------------------------------------------------------------------------------------------
# Masks that only look like bands
# ------------------------------------------------------------------------------------------


def wrong_sign(q, k):  # tril(diagonal=-W) hides the diagonal: right = -W is no window
    return torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril(diagonal=-W)


def head_dim_band(q, k):  # the "query" index runs over heads: a band on the wrong dims
    h = torch.arange(q.shape[-3], device=q.device)[:, None, None]
    j = torch.arange(k.shape[-2], device=q.device)[None, None, :]
    return (j >= h) & (j <= h + W)


def transposed(q, k):  # a transpose moves the rows and columns the band was read on
    return hf_sliding(q, k).transpose(-2, -1)


def union(q, k):  # keys far from the diagonal: two half-planes OR-ed, not a band
    i, j = _rows_cols(q, k)
    return (i - j).abs() >= W


def float_indices(q, k):
    i = torch.arange(q.shape[-2], device=q.device, dtype=torch.float32)[:, None]
    j = torch.arange(k.shape[-2], device=q.device, dtype=torch.float32)[None, :]
    return (j > i - W) & (j <= i)


def key_only(q, k):  # a bound on the key index alone is a band only when there is one query
    i, j = _rows_cols(q, k)
    return (j.expand(q.shape[-2], -1) < k.shape[-2] - 2) & (i >= 0)


LOOKALIKES = {"wrong_sign": wrong_sign, "head_dim_band": head_dim_band, "transposed": transposed,
              "union": union, "float_indices": float_indices, "key_only": key_only}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("form", list(LOOKALIKES))
def test_lookalike_keeps_its_mask(form, mode):
    site = _one_site(MODES[mode](LOOKALIKES[form]), *_qkv())
    assert site.window is None and not site.is_causal
    assert site.attn_mask is not None or site.mask_description, site


@pytest.mark.parametrize("form", list(LOOKALIKES))
def test_lookalike_matches_eager(form):
    # SDPA: a row that a mask hides entirely gives 0 there as in the op (wrong_sign hides rows).
    _check_against_eager(Sdpa(LOOKALIKES[form]), _qkv())
    assert all("window" not in r.detail for r in _records())


class TensorWindow(nn.Module):
    """The window size is a tensor input: not a compile-time constant."""

    def forward(self, q, k, v, w):
        i, j = _rows_cols(q, k)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(j > i - w) & (j <= i))


def test_window_held_in_a_tensor_keeps_that_bound_as_a_mask():
    """Only the constant side becomes the window (j <= i: bottom-right causal); the bound on w
    stays a bool mask, AND-ed exactly as written."""
    w = torch.tensor(W, device=DEVICE)
    site = _one_site(TensorWindow(), *_qkv(), w)
    assert _window(site) == (-1, 0) and site.mask_description == "bool mask"
    compiled = torch.compile(TensorWindow(), backend=compile_backend())
    q, k, v = _qkv()
    golden = TensorWindow()(q.double(), k.double(), v.double(), w)
    assert_close_to_ref("out", compiled(q, k, v, w), golden, TensorWindow()(q, k, v, w))


def test_symbolic_offset_that_does_not_cancel_keeps_the_mask():
    """dynamic=True with L != S: S - L is symbolic and the top-left band's bound on the
    bottom-right diagonal is not a constant."""

    def top_left(q, k):
        i = torch.arange(q.shape[-2], device=q.device)[:, None]
        j = torch.arange(k.shape[-2], device=q.device)[None, :]
        return (j > i - W) & (j <= i)

    site = _one_site(Sdpa(top_left), *_qkv(seq_q=5, seq_k=L), dynamic=True)
    assert site.window is None and site.attn_mask is not None


class BandAndPadding(nn.Module):
    """HF's mask with padding: band AND a (B, 1, 1, S) key lookup, as an SDPA bool mask or as a
    fill of the scores or an additive ``where`` (``fill``: -inf, or a finite value such as finfo.min)."""

    def __init__(self, mode, fill=float("-inf")):
        super().__init__()
        self.mode, self.fill = mode, fill

    def forward(self, q, k, v, keep):
        band = hf_sliding(q, k)[None, None] & keep[:, None, None, :]
        if self.mode == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=band)
        if self.mode == "sdpa_float":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.where(band, 0.0, self.fill))
        scores = q @ k.transpose(-2, -1) * E**-0.5
        if self.mode == "additive":
            return (scores + torch.where(band, 0.0, self.fill)).softmax(dim=-1) @ v
        return scores.masked_fill(~band, self.fill).softmax(dim=-1) @ v


def _keep():
    """Two padded keys at the end of the second sequence; every query still sees a key."""
    keep = torch.ones(B, L, dtype=torch.bool, device=DEVICE)
    keep[1, -2:] = False
    return keep


@pytest.mark.parametrize("mode", ["sdpa", "sdpa_float", "fill", "additive"])
def test_band_and_data_keeps_the_data_part(mode):
    """The band becomes the window and the padding lookup stays the op's bool mask: exact, the
    visible keys are the same and a row hidden entirely is hidden in both (-inf: the op's
    masked-row rule, as for the dense mask)."""
    site = _one_site(BandAndPadding(mode), *_qkv(), _keep())
    assert _window(site) == (W - 1, 0) and site.mask_description == "bool mask"
    module = BandAndPadding(mode)
    compiled = torch.compile(module, backend=compile_backend())
    q, k, v = _qkv()
    out = compiled(q, k, v, _keep())
    golden = module(q.double(), k.double(), v.double(), _keep())
    assert_close_to_ref("out", out, golden, module(q, k, v, _keep()))
    _assert_rewritten_with(f"sliding window (left={W - 1}, right=0), bool mask")


@pytest.mark.parametrize("mode", ["sdpa_float", "fill", "additive"])
def test_band_and_data_with_a_finite_fill_keeps_the_dense_mask(mode):
    """A finite fill gives a row hidden entirely uniform weights in eager (the pass's row fix-up
    needs the whole condition): with data in the mask it stays as written, no window."""
    site = _one_site(BandAndPadding(mode, torch.finfo(torch.float32).min), *_qkv(), _keep())
    assert site.window is None and (site.attn_mask is not None or site.mask_description)


def test_additive_band_that_can_hide_a_row_keeps_its_mask():
    """where(band, 0, finfo.min) with a band that leaves the top rows no key (L > S): eager gives
    those rows uniform weights, the op 0, so the mask stays."""
    module = Additive(hf_sliding, fill=torch.finfo(torch.float32).min)
    site = _one_site(module, *_qkv(seq_q=L, seq_k=4))
    assert site.window is None


# ------------------------------------------------------------------------------------------
# HF transformers families with sliding_window
# ------------------------------------------------------------------------------------------

HF_WINDOW = 5  # shorter than SEQ (16): the window hides keys


def _hf_config(**variant):
    return dict(hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2, num_attention_heads=HEADS,
                num_key_value_heads=KV_HEADS, vocab_size=VOCAB, max_position_embeddings=2 * SEQ,
                attention_dropout=0.0, bos_token_id=1, eos_token_id=2, pad_token_id=0, **variant)


_HEAD = dict(head_dim=HIDDEN // HEADS, query_pre_attn_scalar=HIDDEN // HEADS)
HF_FAMILIES = {
    "mistral": ("MistralConfig", "MistralModel", dict(sliding_window=HF_WINDOW)),
    "qwen2": ("Qwen2Config", "Qwen2Model", dict(use_sliding_window=True, sliding_window=HF_WINDOW, max_window_layers=0)),
    # Soft-capping off: with it, "eager" applies tanh to the scores and its sites are kept.
    "gemma2": ("Gemma2Config", "Gemma2Model", dict(sliding_window=HF_WINDOW, attn_logit_softcapping=None, **_HEAD)),
    "gemma3": ("Gemma3TextConfig", "Gemma3TextModel", dict(sliding_window=HF_WINDOW, **_HEAD)),
    "cohere2": ("Cohere2Config", "Cohere2Model",
                dict(sliding_window=HF_WINDOW, layer_types=["sliding_attention", "full_attention"])),
    "phi3": ("Phi3Config", "Phi3Model", dict(sliding_window=HF_WINDOW)),
}


def _hf_model(family, impl, **overrides):
    import transformers as T

    config_class, model_class, variant = HF_FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(T, config_class)(**_hf_config(**{**variant, **overrides}), attn_implementation=impl)
    return getattr(T, model_class)(config).to(DEVICE), config


def _expected_details(config, impl, padded):
    """Per layer, what the report says: sliding layers their window (with the padding as a bool
    mask for "sdpa"; "eager"'s finite-fill float mask stays dense when padded, as a row it hides
    entirely gets uniform weights there); full layers causal (a bottom-right causal window with
    padding)."""
    types = getattr(config, "layer_types", None) or ["sliding_attention"] * config.num_hidden_layers
    found = []
    for kind in types:
        if padded and impl == "eager":
            found.append("float mask")
        elif kind == "sliding_attention":
            found.append(f"sliding window (left={HF_WINDOW - 1}, right=0)" + (", bool mask" if padded else ""))
        else:
            found.append("window (left=-1, right=0), bool mask" if padded else "causal")
    return found


def _assert_rel_close(name, ours, eager, rtol=1e-4):
    err = (ours.double() - eager.double()).abs().max().item()
    scale = eager.double().abs().max().item()
    assert err <= rtol * scale, f"{name}: max error {err:.3e} > {rtol} x {scale:.3e}"


@needs_transformers
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("family", list(HF_FAMILIES))
def test_hf_sliding_window_family(family, impl, padded):
    model, config = _hf_model(family, impl)
    model.eval()
    compiled = torch.compile(copy.deepcopy(model), backend=compile_backend())
    inputs = token_inputs(padded)
    with torch.no_grad():
        got, want = (m(**inputs).last_hidden_state for m in (compiled, model))
    records = _records()
    assert all(r.rewritten for r in records), "\n".join(report.format() for report in REPORTS)
    details = [r.detail for r in records]
    expected = _expected_details(config, impl, padded)
    assert len(details) == len(expected) and all(e in d for e, d in zip(expected, details)), details
    _assert_rel_close("output", got, want)


@needs_transformers
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_tiny_mistral_acceptance(impl):
    """Issue 33's acceptance: a tiny Mistral with sliding_window below the sequence length,
    compiled with our backend, reports every site rewritten with a window (no dense mask) and
    matches eager, forward (flash_inductor.backend) and backward (parameter gradients)."""
    model, _ = _hf_model("mistral", impl)
    inputs = token_inputs(padded=False)
    assert HF_WINDOW < inputs["input_ids"].shape[1]

    model.eval()
    compiled = torch.compile(copy.deepcopy(model), backend=flash_inductor.backend)
    with torch.no_grad():
        got, want = (m(**inputs).last_hidden_state for m in (compiled, model))
    for record in _records():
        assert record.rewritten and f"sliding window (left={HF_WINDOW - 1}, right=0)" in record.detail, record
        assert "mask" not in record.detail, record.detail
    assert len(_records()) == 2
    _assert_rel_close("output", got, want)

    REPORTS.clear()
    torch._dynamo.reset()
    model.train()
    ours = copy.deepcopy(model)
    compiled = torch.compile(ours, backend=compile_backend())
    grad_out = _randn(*want.shape, seed=7)
    for m in (compiled, model):
        m(**inputs).last_hidden_state.backward(grad_out)
    assert _records() and all("sliding window" in r.detail for r in _records())
    for (name, a), b in zip(ours.named_parameters(), model.parameters()):
        _assert_rel_close(name, a.grad, b.grad)


# ------------------------------------------------------------------------------------------
# The debug tools reconstruct the window
# ------------------------------------------------------------------------------------------


@needs_transformers
def test_debug_shadow_checks_a_sliding_window_site():
    """debug.shadow's float64 reference of a site read as a window applies that window: a
    reference that saw the whole (L, S) plane would flag the model's own eager result."""
    from flash_inductor import debug

    model, _ = _hf_model("mistral", "sdpa")
    with debug.shadow(model) as check:
        model(**token_inputs(padded=True)).last_hidden_state.sum().backward()
    report = check.report()
    assert report.sites == ["layers.0.self_attn", "layers.1.self_attn"]
    assert report.first_failure is None, str(report)


def test_debug_shadow_checks_our_op_with_a_window():
    assert_shadow_check_passes(11, window=(W, 1))


@pytest.mark.parametrize("mode", list(MODES))
def test_a_mask_whose_reading_fails_is_rewritten_as_before(mode, monkeypatch):
    """The pass's guarantee: reading the band never costs a site its rewrite (nor a compile)."""
    from flash_inductor.passes import band

    def broken(*args, **kwargs):
        raise RuntimeError("unexpected graph")

    monkeypatch.setattr(band, "decompose", broken)
    monkeypatch.setattr(band, "complement", broken)
    site = _one_site(MODES[mode](hf_sliding), *_qkv())
    assert site.window is None and (site.attn_mask is not None or site.mask_description)
    _check_against_eager(MODES[mode](hf_sliding), _qkv())
    assert all(r.rewritten and "window" not in r.detail for r in _records())


def test_dunder_method_spellings_are_read():
    """Dynamo on some torch versions records tensor operators as methods (``i.__rsub__(3)``,
    ``a.__ge__(b)``, ``a.__and__(b)``): the same band, read the same way."""
    import operator

    import torch.fx as fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    from flash_inductor.passes import band

    graph = fx.Graph()
    graph.placeholder("unused")
    i = graph.call_function(operator.getitem, (graph.call_function(torch.arange, (L,)), (slice(None), None)))
    j = graph.call_function(operator.getitem, (graph.call_function(torch.arange, (L,)), (None, slice(None))))
    shifted = graph.call_method("__add__", (j, graph.call_method("__rsub__", (i, W))))  # j + (W - i)
    mask = graph.call_method("__and__", (graph.call_method("__ge__", (shifted, 0)), graph.call_method("__le__", (j, i))))
    graph.output(mask)
    gm = fx.GraphModule(nn.Module(), graph)
    FakeTensorProp(gm, FakeTensorMode(allow_non_fake_inputs=True)).propagate(torch.zeros(1))
    for node in gm.graph.nodes:
        node.meta["example_value"] = node.meta.get("val")
    assert band.to_window(band.decompose(mask), L, L) == (W, 0)
