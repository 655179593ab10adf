"""HF's packed-sequence masks: a site whose mask is causal AND "same sequence" runs on the varlen op.

A padding-free batch (HF's ``DataCollatorWithFlattening``, TRL packing) passes ``position_ids``
that restart at each document; HF's masking_utils turns them into sequence ids and, in "eager",
a dense (B, 1, L, L) mask::

    ids = (torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1) != 1).cumsum(-1)
    mask = (kv_idx <= q_idx) & (ids[batch_idx, q_idx] == ids[batch_idx, kv_idx])

``cumsum`` of a bool is non-decreasing along the row, so the tokens of one id are one contiguous
run: the mask is block-diagonal, each block causal. That is the varlen op's problem, with each
run one sequence, and it computes no tile across documents. :func:`read_packed` proves the
structure from the graph (the band is exactly causal, the one other term is that lookup of a
cumsum of bools, indexed by aranges over the batch, the queries and the keys, L == S); every row
then sees itself, so HF's finite fill hides what -inf would. Anything else leaves the mask to
the dense path, as before.
"""

from __future__ import annotations

import logging
import operator
from typing import Any, Optional

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from . import band
from .fx_match import bind, call_ancestors, is_function, is_method, known_equal, tensor_value
from .site import AttentionSite, example_value
from .window import additive_band, band_of, in_graph_order

log = logging.getLogger("flash_inductor")

_CASTS = ("to", "bool", "contiguous")


def _peel(node: Any) -> Any:
    while is_method(node, *_CASTS) and isinstance(node.args[0], fx.Node) and None not in (
            tensor_value(node), tensor_value(node.args[0])) and \
            known_equal(tensor_value(node).shape, tensor_value(node.args[0]).shape):
        node = node.args[0]
    return node


def _arange_at(node: Any, size: Any, position: int) -> bool:
    """``arange(size)`` (plus 0) indexed to lie along dim ``position`` of a 4-D index."""
    if not is_function(node, operator.getitem) or not isinstance(node.args[1], tuple) or len(node.args[1]) != 4:
        return False
    index = node.args[1]
    if any((entry != slice(None)) if i == position else (entry is not None) for i, entry in enumerate(index)):
        return False
    base = node.args[0]
    if is_function(base, operator.add) and base.args[1] == 0:  # HF's q_arange = arange(L) + q_offset
        base = base.args[0]
    if not is_function(base, torch.arange) or len(base.args) != 1:
        return False
    return bool(statically_known_true(base.args[0] == size)) if not isinstance(base.args[0], fx.Node) \
        else known_equal([tensor_value(base).shape[0]], [size])


def _monotone_ids(node: Any) -> bool:
    """``x.cumsum(-1)`` of a bool ``x`` over (B, L): non-decreasing along each row."""
    if not (is_method(node, "cumsum") or is_function(node, torch.cumsum)):
        return False
    args = bind(node, ("input", "dim"), {})
    source, ids = tensor_value(args["input"]), tensor_value(node)
    return (source is not None and source.dtype == torch.bool and ids is not None and ids.dim() == 2
            and isinstance(args.get("dim"), int) and args["dim"] % 2 == 1 and "dtype" not in node.kwargs)


def _sequence_lookup(node: Any, batch: Any, seq: Any) -> Optional[fx.Node]:
    """The ids of ``ids[b, q] == ids[b, kv]`` (HF's ``packed_sequence_mask_function``), else None."""
    node = _peel(node)
    if not ((is_function(node, operator.eq, torch.eq) or is_method(node, "eq")) and len(node.args) == 2):
        return None
    lookups = [n if is_function(n, operator.getitem) else None for n in node.args]
    if None in lookups or lookups[0].args[0] is not lookups[1].args[0]:
        return None
    ids = lookups[0].args[0]
    indices = [n.args[1] for n in lookups]
    if not _monotone_ids(ids) or not all(isinstance(i, tuple) and len(i) == 2 for i in indices) \
            or not known_equal(tensor_value(ids).shape, (batch, seq)):
        return None
    (b_q, q), (b_k, k) = indices
    if not (_arange_at(b_q, batch, 0) and _arange_at(b_k, batch, 0) and _arange_at(q, seq, 2)
            and _arange_at(k, seq, 3)):
        return None
    return ids


def _packed_ids(mask: fx.Node, is_bool: bool, attend_if: bool, factor: float, batch: Any, seq_q: Any,
                seq_k: Any) -> Optional[fx.Node]:
    """The sequence ids when ``mask`` (a bool condition, visible where it equals ``attend_if``, or
    an additive mask times ``factor``) is exactly causal AND same-sequence, else None."""
    if not statically_known_true(seq_q == seq_k):
        return None
    if is_bool:
        found = band_of(mask, seq_q, seq_k, attend_if)
    else:
        found = (additive_band(mask, seq_q, seq_k, factor) or (None,))[0]
    if found is None or len(found.residual) != 1 or found.residual[0][1]:
        return None
    window = band.to_window(found, seq_q, seq_k)
    if window is None or window.as_argument() != (-1, 0):
        return None
    return _sequence_lookup(found.residual[0][0], batch, seq_q)


def read_packed(terms: list, batch: Any, seq_q: Any, seq_k: Any) -> Optional[fx.Node]:
    """A hand-written site's sequence ids when its one mask term (``handwritten_site.MaskTerm``)
    is causal AND same-sequence, else None. Never raises: a mask it cannot read stays as written."""
    try:
        if len(terms) != 1:
            return None
        (term,) = terms
        return _packed_ids(term.node, term.is_bool, term.attend_if, term.factor, batch, seq_q, seq_k)
    except Exception:  # noqa: BLE001 -- an unreadable mask stays the mask as written
        log.debug("flash_inductor: reading a packed-sequence mask failed; it stays as written", exc_info=True)
        return None


def sdpa_packed(site: AttentionSite) -> AttentionSite:
    """An SDPA site (HF "sdpa" on a packed batch) whose bool or additive mask is causal AND
    same-sequence, on the varlen op; any other site as it was."""
    query, key, value = (example_value(n) for n in (site.query, site.key, site.value))
    mask = example_value(site.attn_mask)
    if mask is None or site.is_causal or site.window is not None or site.prologue is not None \
            or any(t is None or t.dim() != 4 for t in (query, key, value)) \
            or not all(known_equal(t.shape[:1], query.shape[:1]) for t in (key, value)):
        return site
    try:
        ids = _packed_ids(site.attn_mask, mask.dtype == torch.bool, True, 1.0, query.shape[0], query.shape[-2],
                          key.shape[-2])
    except Exception:  # noqa: BLE001 -- an unreadable mask stays the mask as written
        log.debug("flash_inductor: reading %s's mask failed; it stays as written", site.output.name, exc_info=True)
        return site
    if ids is not None:
        site.consumed = in_graph_order([*site.consumed, *call_ancestors(site.attn_mask)])
        site.attn_mask, site.is_causal, site.sequence_ids = None, True, ids
    return site
