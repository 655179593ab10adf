"""Masks that are the same for every query go to the op as one row, ``(..., 1, S)``: a key mask.

* ``band.decompose`` reads a comparison on one index alone that every position meets (HF's
  bidirectional ``q_idx >= 0``, with or without ``q_offset``; ``kv_idx < S``) as no term at all,
  with static and symbolic sizes; one that some row fails (``q_idx >= 5``, ``q_idx < L - 1``)
  stays a term, and decoding still reads a bound on the key index as a band.
* SDPA and hand-written sites whose mask provably has equal rows (HF's padding mask built
  (B, 1, L, S)) give the op ``mask[..., 0:1, :]`` and report a key mask; masks that only look
  like it (a bound on the query index that a row fails, a lookup by query, query data) keep the
  whole mask. The compiled result and gradients match eager by the project's rule (fp64 golden,
  twice PyTorch's own same-dtype error plus a floor).
* HF BERT, "sdpa" and "eager", padded, compiled with ``flash_inductor.backend``: the op receives
  (2, 1, 1, S) masks and the output matches eager.
"""

from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import flash_inductor
from flash_inductor.passes import band
from flash_inductor.passes import site as site_module
from flash_inductor.passes.report import REPORTS
from flash_inductor.passes.site import AttentionSite
from helpers import DEVICE, assert_close_to_ref, found_attention_sites, needs_transformers, randn
from model_zoo import compile_backend, token_inputs

B, H, L, S, E = 2, 2, 9, 11, 8

pytestmark = pytest.mark.usefixtures("fresh_compiler")



def _randn(*shape, dtype=torch.float32, seed=0):
    return randn(shape, dtype, DEVICE, seed)


def _qkv(dtype=torch.float32):
    return (_randn(B, H, L, E, dtype=dtype, seed=1), _randn(B, H, S, E, dtype=dtype, seed=2),
            _randn(B, H, S, E, dtype=dtype, seed=3))


def _keep():
    """Padding: the last three keys of the second sequence are hidden; every query sees a key."""
    keep = torch.ones(B, S, dtype=torch.bool, device=DEVICE)
    keep[1, -3:] = False
    return keep


def _indices(q, k, q_offset=0):
    """HF ``sdpa_mask``'s broadcast indices: (1, 1, L, 1) queries from ``q_offset``, (1, 1, 1, S) keys."""
    i = (torch.arange(q.shape[-2], device=q.device) + q_offset)[None, None, :, None]
    j = torch.arange(k.shape[-2], device=q.device)[None, None, None, :]
    return i, j


# ------------------------------------------------------------------------------------------
# Conditions: (q, k, keep) -> the visible-key mask, (B, 1, L, S) or broadcast to it
# ------------------------------------------------------------------------------------------


def hf_bidirectional(q, k, keep):
    """masking_utils.sdpa_mask(mask_function=bidirectional_mask_function, attention_mask=keep),
    non-vmap: new_ones AND (q_idx >= 0) AND padding_mask[batch_idx, kv_idx], expanded."""
    i, j = _indices(q, k)
    b = torch.arange(keep.shape[0], device=q.device)[:, None, None, None]
    result = i.new_ones((), dtype=torch.bool)
    result = result & (i >= 0).to(q.device)
    result = result & keep[b, j].to(q.device)
    return result.expand(keep.shape[0], -1, q.shape[-2], k.shape[-2])


def with_q_offset(q, k, keep):  # the same with a KV cache's query offset
    i, _ = _indices(q, k, q_offset=5)
    return (i >= 0) & keep[:, None, None, :]


def offset_lower_bound(q, k, keep):  # arange(L) + 5 >= 5: every row
    i, _ = _indices(q, k, q_offset=5)
    return (i >= 5) & keep[:, None, None, :]


def below_length(q, k, keep):
    i, _ = _indices(q, k)
    return (i < q.shape[-2]) & (i <= q.shape[-2] - 1) & keep[:, None, None, :]


def flipped(q, k, keep):  # 0 <= i, L - i > 0, -i <= 0
    i, _ = _indices(q, k)
    return (0 <= i) & (q.shape[-2] - i > 0) & (-i <= 0) & keep[:, None, None, :]


def key_bounds(q, k, keep):  # bounds on the key index alone that every key meets
    i, j = _indices(q, k)
    return (j >= 0) & (j < k.shape[-2]) & (i >= 0) & keep[:, None, None, :]


def not_negative(q, k, keep):  # NOT of a bound no row meets
    i, _ = _indices(q, k)
    return ~(i < 0) & keep[:, None, None, :]


def broadcast(q, k, keep):  # the padding mask broadcast to every query by expand
    return keep[:, None, None, :].expand(-1, 1, q.shape[-2], -1)


def key_bound_broadcast(q, k, keep):  # a bound some keys fail, broadcast along the queries
    i, j = _indices(q, k)
    return (j.expand(-1, -1, q.shape[-2], -1) < k.shape[-2] - 2) & (i >= 0) & keep[:, None, None, :]


KEY_MASKS = {f.__name__: f for f in (hf_bidirectional, with_q_offset, offset_lower_bound, below_length, flipped,
                                     key_bounds, not_negative, broadcast, key_bound_broadcast)}


def row_five_on(q, k, keep):  # rows 0..4 see nothing: varies along the queries
    i, _ = _indices(q, k)
    return (i >= 5) & keep[:, None, None, :]


def all_but_last_row(q, k, keep):
    i, _ = _indices(q, k)
    return (i < q.shape[-2] - 1) & keep[:, None, None, :]


def offset_one_short(q, k, keep):  # arange(L) + 5 >= 6: row 0 fails
    i, _ = _indices(q, k, q_offset=5)
    return (i >= 6) & keep[:, None, None, :]


def query_data(q, k, keep):  # true for these inputs, but through the queries' values
    return (q.sum(-1, keepdim=True) > -1e4) & keep[:, None, None, :]


def query_padding(q, k, keep):  # a lookup by query index: padded queries too
    i, _ = _indices(q, k)
    return keep[:, None, :q.shape[-2], None] & keep[:, None, None, :] & (i >= 0)


def causal(q, k, keep):  # a band: the window's, not a key mask
    i, j = _indices(q, k)
    return (j <= i + (k.shape[-2] - q.shape[-2])) & (i >= 0)


LOOKALIKES = {f.__name__: f for f in (row_five_on, all_but_last_row, offset_one_short, query_data,
                                      query_padding, causal)}


class Sdpa(nn.Module):
    def __init__(self, condition, additive=False):
        super().__init__()
        self.condition, self.additive = condition, additive

    def forward(self, q, k, v, keep):
        mask = self.condition(q, k, keep)
        if self.additive:  # HF "eager"'s mask, given to SDPA
            mask = torch.where(mask, torch.tensor(0.0, device=q.device, dtype=q.dtype), torch.finfo(q.dtype).min)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class Fill(nn.Module):  # scores.masked_fill(~mask, -inf)
    def __init__(self, condition):
        super().__init__()
        self.condition = condition

    def forward(self, q, k, v, keep):
        scores = q @ k.transpose(-2, -1) * E**-0.5
        return scores.masked_fill(~self.condition(q, k, keep), float("-inf")).softmax(dim=-1) @ v


class Additive(nn.Module):  # BERT "eager": scores + where(mask, 0, finfo.min)
    def __init__(self, condition):
        super().__init__()
        self.condition = condition

    def forward(self, q, k, v, keep):
        scores = q @ k.transpose(-2, -1) / E**0.5
        zero = torch.tensor(0.0, device=q.device, dtype=q.dtype)
        mask = torch.where(self.condition(q, k, keep), zero, torch.finfo(q.dtype).min)
        return F.softmax(scores + mask, dim=-1) @ v


MODES = {"sdpa": Sdpa, "sdpa_additive": lambda c: Sdpa(c, additive=True), "fill": Fill, "additive": Additive}
KINDS = {"sdpa": "bool", "sdpa_additive": "float", "fill": "bool", "additive": "float"}


# ------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------


def _one_site(module, *inputs, dynamic=False) -> AttentionSite:
    found = found_attention_sites(module, *inputs, dynamic=dynamic)
    assert len(found) == 1 and isinstance(found[0], AttentionSite), found
    return found[0]


def _conjunction(condition, *inputs, dynamic=False, one_query=False) -> band.Conjunction:
    """``band.decompose`` of the tensor ``condition(*inputs)`` returns, on its dynamo graph."""
    found = []

    def backend(gm, example_inputs):
        (out,) = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        found.append(band.decompose(out, one_query))
        return gm.forward

    torch.compile(condition, backend=backend, dynamic=dynamic, fullgraph=True)(*inputs)
    return found[0]


def _records():
    return [r for report in REPORTS for r in report.sites]


def _op_masks(monkeypatch) -> list:
    """The shapes of the masks the op is called with (recorded as the compiled graph is traced)."""
    shapes, real = [], site_module.attention

    def spy(*args, attn_mask=None, **kwargs):
        shapes.append(None if attn_mask is None else tuple(attn_mask.shape))
        return real(*args, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(site_module, "attention", spy)
    return shapes


def _check_against_eager(module, inputs, *, grad=True, dynamic=False):
    """Compiled (pass + op) vs eager in the same dtype vs an fp64 golden: output and gradients."""
    compiled = torch.compile(module, backend=compile_backend(), dynamic=dynamic)
    runs = []
    for fn, dtype in ((compiled, None), (module, None), (module, torch.float64)):
        leaves = [t.detach().to(dtype or t.dtype).requires_grad_(grad) if t.is_floating_point() else t
                  for t in inputs]
        out = fn(*leaves)
        grads = []
        if grad:
            out.backward(_randn(*out.shape, dtype=out.dtype, seed=9))
            grads = [t.grad for t in leaves if t.is_floating_point()]
        runs.append([out, *grads])
    for name, ours, eager, golden in zip(["out", "dq", "dk", "dv"], *runs):
        assert_close_to_ref(name, ours, golden, eager)


# ------------------------------------------------------------------------------------------
# band.decompose: a bound every position meets is no term
# ------------------------------------------------------------------------------------------


def _q():
    return torch.zeros(L, E, device=DEVICE)


def _rows(q):
    return torch.arange(q.shape[-2], device=q.device)[:, None]


ALWAYS = {
    "ge_0": lambda q: _rows(q) >= 0,
    "gt_minus_1": lambda q: _rows(q) > -1,
    "lt_length": lambda q: _rows(q) < q.shape[-2],
    "le_last": lambda q: _rows(q) <= q.shape[-2] - 1,
    "offset": lambda q: _rows(q) + 3 >= 3,
    "rsub": lambda q: q.shape[-2] - _rows(q) >= 1,
    "negated": lambda q: -_rows(q) <= 0,
    "not_lt_0": lambda q: ~(_rows(q) < 0),
    "keys": lambda q: torch.arange(q.shape[-1], device=q.device) < q.shape[-1],
    "no_index": lambda q: _rows(q) - _rows(q) == 0,
}
# Not proved: some position fails, or (ne, two indices) the reading does not go that far.
NOT_PROVED = {
    "ge_5": lambda q: _rows(q) >= 5,
    "ge_1": lambda q: _rows(q) >= 1,
    "lt_last": lambda q: _rows(q) < q.shape[-2] - 1,
    "offset_short": lambda q: _rows(q) + 3 >= 4,
    "eq_0": lambda q: _rows(q) == 0,
    "ne_minus_1": lambda q: _rows(q) != -1,  # true, but only a constant's ne is proved
    "keys_short": lambda q: torch.arange(q.shape[-1], device=q.device) < q.shape[-1] - 1,
    "two_indices": lambda q: _rows(q) + torch.arange(q.shape[-1], device=q.device) >= 0,
}


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "symbolic"])
@pytest.mark.parametrize("form", list(ALWAYS))
def test_a_bound_every_position_meets_is_no_term(form, dynamic):
    found = _conjunction(ALWAYS[form], _q(), dynamic=dynamic)
    assert not found.has_band and not found.residual, found


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "symbolic"])
@pytest.mark.parametrize("form", list(NOT_PROVED))
def test_a_bound_not_proved_stays_a_term(form, dynamic):
    found = _conjunction(NOT_PROVED[form], _q(), dynamic=dynamic)
    assert not found.has_band and len(found.residual) == 1, found


def test_a_symbolic_offset_is_proved_never_assumed():
    """dynamic=True: ``i + S >= S`` holds for every size; ``i + (S - L) >= 0`` needs S >= L, which
    nothing says, so it stays a term."""

    def offset_by_keys(q, k):
        return _rows(q) + k.shape[-2] >= k.shape[-2]

    def hf_cache_offset(q, k):
        return _rows(q) + (k.shape[-2] - q.shape[-2]) >= 0

    q, k = torch.zeros(L, E, device=DEVICE), torch.zeros(S, E, device=DEVICE)
    assert not _conjunction(offset_by_keys, q, k, dynamic=True).residual
    assert len(_conjunction(hf_cache_offset, q, k, dynamic=True).residual) == 1


def test_a_band_and_a_bound_every_row_meets_is_the_band():
    def causal_bidirectional(q):
        i, j = _rows(q), torch.arange(q.shape[-2], device=q.device)[None, :]
        return (j <= i) & (i >= 0)

    found = _conjunction(causal_bidirectional, _q())
    assert band.to_window(found, L, L) == (-1, 0) and not found.residual


def test_decoding_still_reads_a_key_bound_as_a_band():
    """One query (L = 1): ``kv_idx >= 2`` is a bound on j - i, as before."""

    def keys_from_two(q):
        return torch.arange(S, device=q.device)[None, :] >= 2

    found = _conjunction(keys_from_two, torch.zeros(1, E, device=DEVICE), one_query=True)
    assert found.los == [2] and not found.his and not found.residual


# ------------------------------------------------------------------------------------------
# Sites: a key mask is cut to one row; a lookalike keeps its mask
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("form", list(KEY_MASKS))
def test_key_mask_is_read(form, mode):
    site = _one_site(MODES[mode](KEY_MASKS[form]), *_qkv(), _keep())
    assert site.key_mask and site.window is None and not site.is_causal
    assert site.mask_description.startswith(f"{KINDS[mode]} key mask (2, 1, 1, {S})"), site.mask_description


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("form", list(KEY_MASKS))
def test_key_mask_matches_eager(form, mode, monkeypatch):
    shapes = _op_masks(monkeypatch)
    _check_against_eager(MODES[mode](KEY_MASKS[form]), [*_qkv(), _keep()])
    assert shapes and all(shape[-2] == 1 for shape in shapes), shapes
    records = _records()
    assert records and all(r.rewritten and "key mask" in r.detail for r in records)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("form", list(LOOKALIKES))
def test_lookalike_keeps_the_whole_mask(form, mode):
    site = _one_site(MODES[mode](LOOKALIKES[form]), *_qkv(), _keep())
    assert not site.key_mask
    assert "key mask" not in (site.mask_description or "")


@pytest.mark.parametrize("form", list(LOOKALIKES))
def test_lookalike_matches_eager(form, monkeypatch):
    # SDPA gives a row its mask hides entirely 0, as the op does (row_five_on, query_padding).
    shapes = _op_masks(monkeypatch)
    _check_against_eager(Sdpa(LOOKALIKES[form]), [*_qkv(), _keep()])
    # The causal band goes as a window, with no mask; every other mask goes whole.
    assert shapes and all(shape is None if form == "causal" else shape[-2] == L for shape in shapes), shapes
    assert all(r.rewritten and "key mask" not in r.detail for r in _records())


def test_a_mask_with_one_row_already_is_left_alone():
    site = _one_site(Sdpa(lambda q, k, keep: keep[:, None, None, :]), *_qkv(), _keep())
    assert not site.key_mask and site.mask_description is None


def test_band_and_padding_stays_on_the_window_path():
    """A band AND the padding: the window takes the band and the padding goes alone (window.py)."""

    def causal_padded(q, k, keep):
        i, j = _indices(q, k)
        return (j <= i + (k.shape[-2] - q.shape[-2])) & keep[:, None, None, :]

    site = _one_site(Sdpa(causal_padded), *_qkv(), _keep())
    assert not site.key_mask and site.window is not None and site.mask_description == "bool mask"


@pytest.mark.parametrize("form", ["hf_bidirectional", "below_length"])
def test_symbolic_sizes(form):
    """dynamic=True: L and S are symbols; ``i < L`` is proved from L's own symbol."""
    site = _one_site(Sdpa(KEY_MASKS[form]), *_qkv(), _keep(), dynamic=True)
    assert site.key_mask
    _check_against_eager(Sdpa(KEY_MASKS[form]), [*_qkv(), _keep()], dynamic=True)


def test_symbolic_lookalike_keeps_the_whole_mask():
    site = _one_site(Sdpa(all_but_last_row), *_qkv(), _keep(), dynamic=True)
    assert not site.key_mask


def test_a_mask_whose_reading_fails_is_rewritten_as_before(monkeypatch):
    from flash_inductor.passes import key_mask

    def broken(*args, **kwargs):
        raise RuntimeError("unexpected graph")

    monkeypatch.setattr(key_mask.band, "decompose", broken)
    for mode in MODES:
        site = _one_site(MODES[mode](hf_bidirectional), *_qkv(), _keep())
        assert not site.key_mask, mode
    _check_against_eager(Sdpa(hf_bidirectional), [*_qkv(), _keep()])
    assert all(r.rewritten and "key mask" not in r.detail for r in _records())


def test_the_op_gets_a_slice_of_the_mask_as_written():
    """``mask[..., 0:1, :]`` of the mask node itself: its dtype and fill values unchanged."""
    from flash_inductor.passes.graph_pass import FlashAttentionPass

    calls = []

    def backend(gm, example_inputs):
        FlashAttentionPass()(gm.graph)
        calls.extend(n for n in gm.graph.nodes if n.target is site_module.rewritten_attention)
        return gm.forward

    torch.compile(Sdpa(hf_bidirectional, additive=True), backend=backend, fullgraph=True)(*_qkv(), _keep())
    (call,) = calls
    cut = call.kwargs["attn_mask"]
    assert cut.target is operator.getitem and cut.args[1] == (Ellipsis, slice(0, 1), slice(None))
    assert isinstance(cut.args[0], fx.Node) and cut.args[0].target is torch.where


def test_the_report_names_the_kernel_for_the_row_the_op_gets(monkeypatch):
    """On a (mocked) Hopper GPU the report judges the mask the op gets: one row of a dense
    (B, 1, L, S) mask is a key mask the Hopper kernels take."""
    from helpers import CudaLooking, mock_hopper

    mock_hopper(monkeypatch)
    graph = fx.Graph()

    def node(name, *shape, dtype=torch.bfloat16):
        n = graph.placeholder(name)
        n.meta["example_value"] = torch.empty(shape, dtype=dtype).as_subclass(CudaLooking)
        return n

    q, k, v = node("q", 2, 8, 64, 128), node("k", 2, 8, 64, 128), node("v", 2, 8, 64, 128)
    mask = node("mask", 2, 1, 64, 64, dtype=torch.bool)
    dense = AttentionSite("sdpa", q, q, k, v, attn_mask=mask)
    keys = AttentionSite("sdpa", q, q, k, v, attn_mask=mask, key_mask=True)
    assert "forward on Triton: an attention mask that varies" in site_module.describe_rewrite(dense, "fast")
    assert "forward on Triton" not in site_module.describe_rewrite(keys, "fast")
    assert "on the Hopper (Gluon) kernel" in site_module.describe_rewrite(keys, "fast")


# ------------------------------------------------------------------------------------------
# HF BERT
# ------------------------------------------------------------------------------------------


@needs_transformers
@pytest.mark.parametrize("q_offset", [0, 3])
def test_hf_sdpa_mask_itself(q_offset):
    """transformers' own ``sdpa_mask`` (bidirectional, padded), with a query offset as a cache gives."""
    from transformers.masking_utils import bidirectional_mask_function, sdpa_mask

    def hf_mask(q, k, keep):
        return sdpa_mask(batch_size=keep.shape[0], q_length=q.shape[-2], kv_length=k.shape[-2], q_offset=q_offset,
                         mask_function=bidirectional_mask_function, attention_mask=keep, device=q.device)

    site = _one_site(Sdpa(hf_mask), *_qkv(), _keep())
    assert site.key_mask and site.mask_description == f"bool key mask (2, 1, 1, {S})"
    _check_against_eager(Sdpa(hf_mask), [*_qkv(), _keep()])


@needs_transformers
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_hf_bert_padding_is_a_key_mask(impl, monkeypatch):
    """HF's padding mask, built (B, 1, L, S) by masking_utils under torch.compile, reaches the op
    as (B, 1, 1, S), compiled with flash_inductor.backend; the output matches eager (fp64 golden)."""
    from model_zoo import CASES, SEQ

    torch.manual_seed(0)
    model = CASES["bert"].build(impl).to(DEVICE).eval()
    inputs = token_inputs(padded=True)
    shapes = _op_masks(monkeypatch)
    compiled = torch.compile(copy.deepcopy(model), backend=flash_inductor.backend)
    with torch.no_grad():
        got = compiled(**inputs).last_hidden_state
        want = model(**inputs).last_hidden_state
        golden = copy.deepcopy(model).double()(**inputs).last_hidden_state
    kind = "bool" if impl == "sdpa" else "float"
    details = [r.detail for r in _records()]
    assert len(details) == 2 and all(d.startswith(f"{kind} key mask (2, 1, 1, {SEQ})") for d in details), details
    assert shapes and all(shape == (2, 1, 1, SEQ) for shape in shapes), shapes
    assert_close_to_ref("output", got, golden, want)
