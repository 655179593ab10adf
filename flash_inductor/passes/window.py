"""Sites whose mask is a sliding window: the op's ``window`` in place of a dense mask.

A band mask given to the op densely makes the kernel load and test every tile of the (L, S)
plane; as ``window=(left, right)`` the kernel skips the tiles outside the band. ``band.py``
reads a mask as band AND residual terms; here a site takes the band as its window when that is
exact:

* a bool mask (SDPA's, HF "sdpa"): window AND the residual terms is the mask, entry for entry,
  so fully hidden rows stay fully hidden. The residual (HF's padding lookup, (B, 1, 1, S)) is
  passed as the op's ``attn_mask``; when its terms cannot be AND-ed apart from the mask (a term
  under a slice), the whole mask is passed with the window.
* an additive mask ``where(band, 0, fill)`` (HF "eager", forward code) or a fill of scores where
  the band is false: with a -inf fill as for a bool mask (a row hidden entirely gives 0 either
  way, the op's masked-row rule). With a finite fill (HF's finfo.min) only a pure band that
  leaves every row a key: eager gives a row hidden entirely uniform weights, and an additive
  mask also gradients to q and k, where the op gives 0, so such a mask stays as written.

A bound that is not a compile-time constant (a window held in a tensor, a symbolic offset that
does not cancel against S - L) keeps the mask as written, and so does a mask whose reading fails:
the site is then rewritten exactly as without this module.
"""

from __future__ import annotations

import logging
import operator
from typing import Any, Optional

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from . import band
from .fx_match import call_ancestors, fill_value, is_function, is_mask_fill, is_method, known_equal, tensor_value
from .site import AttentionSite, example_value

log = logging.getLogger("flash_inductor")


def _peel_views(node: Any) -> Any:
    """A mask seen through casts, broadcasts and slices that keep its positions (HF's
    ``mask[:, :, :, :S]`` of a mask already S wide)."""
    while isinstance(node, fx.Node) and node.args and isinstance(node.args[0], fx.Node) and (
            is_method(node, "to", "contiguous", "expand", "float", "half", "bfloat16", "type_as")
            or is_function(node, operator.getitem)) and band.position_preserving_view(node):
        node = node.args[0]
    return node


def additive_band(mask: fx.Node, seq_q: Any, seq_k: Any, factor: float) -> Optional[tuple[band.Conjunction, float]]:
    """(band, fill) of an additive mask ``where(cond, 0, fill)`` (or ``where(cond, fill, 0)``),
    ``fill`` scaled by ``factor`` and hiding keys; else None."""
    mask = _peel_views(mask)
    if not (is_function(mask, torch.where) or is_method(mask, "where")) or len(mask.args) != 3:
        return None
    cond, a, b = mask.args if is_function(mask, torch.where) else (mask.args[1], mask.args[0], mask.args[2])
    values = [fill_value(a), fill_value(b)]
    if not isinstance(cond, fx.Node) or None in values or factor <= 0:
        return None
    if values[0] == 0 and is_mask_fill(values[1] * factor):
        attend_if, fill = True, values[1] * factor
    elif values[1] == 0 and is_mask_fill(values[0] * factor):
        attend_if, fill = False, values[0] * factor
    else:
        return None
    mask_value = tensor_value(mask)
    if mask_value is None or not mask_value.is_floating_point():
        return None
    found = band_of(cond, seq_q, seq_k, attend_if)
    return None if found is None else (found, fill)


def band_of(cond: Any, seq_q: Any, seq_k: Any, attend_if: bool) -> Optional[band.Conjunction]:
    value = tensor_value(cond)
    if value is None or value.dim() < 2 or not known_equal(value.shape[-2:], (seq_q, seq_k)):
        return None
    one_query = bool(statically_known_true(seq_q == 1))
    found = band.decompose(cond, one_query) if attend_if else band.complement(cond, one_query)
    return found if found.has_band else None


def handwritten_window(terms: list, fills: list, seq_q: Any, seq_k: Any) -> Optional[tuple[band.Window, list]]:
    """(window, residual) standing for all of a hand-written site's mask terms, or None (see
    :func:`_handwritten_window`); None too when reading them fails."""
    try:
        return _handwritten_window(terms, fills, seq_q, seq_k)
    except Exception:  # noqa: BLE001 -- an unreadable mask stays the mask as written
        log.debug("flash_inductor: reading a band mask failed; the masks stay as written", exc_info=True)
        return None


def _handwritten_window(terms: list, fills: list, seq_q: Any, seq_k: Any) -> Optional[tuple[band.Window, list]]:
    """The window of a hand-written site's mask terms (``handwritten_site.MaskTerm``: bool fills,
    whose fill values ``fills`` lists in order, and additive masks) when together they are a band,
    and the residual terms as (term, node, negated) to keep as bool masks.

    A finite fill gives a row it hides entirely uniform weights in eager, where the op gives 0
    (and -inf gives 0 in both, the op's masked-row rule): with one, the terms must be a pure band
    leaving every row a key, or they stay as written."""
    fill_values = iter(fills)
    combined, residual, finite = band.Conjunction(), [], False
    for term in terms:
        if term.is_bool:
            found, fill = band_of(term.node, seq_q, seq_k, term.attend_if), next(fill_values)
        else:
            found, fill = additive_band(term.node, seq_q, seq_k, term.factor) or (None, None)
        if found is None:
            return None
        finite = finite or fill != float("-inf")
        if found.residual and not (found.rebuildable and all(_is_bool(node) for node, _ in found.residual)):
            return None
        residual += [(term, node, negated) for node, negated in found.residual]
        combined = band.conjunction_and(combined, found)
    window = band.to_window(combined, seq_q, seq_k)
    if window is None or (finite and (residual or not band.rows_never_empty(window, seq_q, seq_k))):
        return None
    return window, residual


def _is_bool(node: Any) -> bool:
    value = tensor_value(node)
    return value is not None and value.dtype == torch.bool


def causal_or_window(window: band.Window, seq_q: Any, seq_k: Any) -> tuple[bool, Optional[band.Window]]:
    """(is_causal, window) for the op: a band that is exactly the causal triangle with L == S is
    ``is_causal=True`` (the plain causal path), anything else the window."""
    if window.as_argument() == (-1, 0) and statically_known_true(seq_q == seq_k):
        return True, None
    return False, window


def residual_mask(graph: fx.Graph, terms: list[tuple[fx.Node, bool]]) -> fx.Node:
    """The AND of the residual terms as one bool tensor (inserted at the graph's insert point)."""
    combined = None
    for node, negated in terms:
        value = tensor_value(node)
        if value is not None and value.dtype == torch.bool:
            term = graph.call_function(torch.logical_not, (node,)) if negated else node
        else:
            term = graph.call_function(torch.eq if negated else torch.ne, (node, 0))
        combined = term if combined is None else graph.call_function(torch.logical_and, (combined, term))
    return combined


def in_graph_order(nodes: list[fx.Node]) -> list[fx.Node]:
    if not nodes:
        return []
    order = {n: i for i, n in enumerate(nodes[0].graph.nodes)}
    return sorted(set(nodes), key=lambda n: order.get(n, -1))


def sdpa_window(site: AttentionSite) -> AttentionSite:
    """An SDPA site with its band mask as the op's window (module docstring), or the site as it was."""
    snapshot = (site.window, site.attn_mask, site.is_causal, site.prologue, site.mask_description, list(site.consumed))
    try:
        return _sdpa_window(site)
    except Exception:  # noqa: BLE001 -- an unreadable mask stays the mask as written
        log.debug("flash_inductor: reading %s's mask failed; it stays as written", site.output.name, exc_info=True)
        (site.window, site.attn_mask, site.is_causal, site.prologue, site.mask_description,
         site.consumed) = snapshot
        return site


def _sdpa_window(site: AttentionSite) -> AttentionSite:
    mask = site.attn_mask
    query, key = example_value(site.query), example_value(site.key)
    if mask is None or site.window is not None or site.prologue is not None or query is None or key is None:
        return site
    mask_value = example_value(mask)
    if mask_value is None or query.dim() < 2:
        return site
    seq_q, seq_k = query.shape[-2], key.shape[-2]
    if mask_value.dtype == torch.bool:
        found, finite = band_of(mask, seq_q, seq_k, True), False
    else:
        read = additive_band(mask, seq_q, seq_k, 1.0)
        found, finite = (read[0], read[1] != float("-inf")) if read is not None else (None, False)
    window = None if found is None else band.to_window(found, seq_q, seq_k)
    if window is None or (finite and (found.residual or not band.rows_never_empty(window, seq_q, seq_k))):
        return site
    site.window = window
    if not found.residual:
        site.is_causal, site.window = causal_or_window(window, seq_q, seq_k)
        site.attn_mask = None
        site.consumed = in_graph_order([*site.consumed, *call_ancestors(mask)])
    elif found.rebuildable:
        terms = found.residual
        site.attn_mask = None
        site.mask_description = "bool mask"
        site.prologue = lambda graph, q, k, v, _mask: (q, k, v, residual_mask(graph, terms))
        site.consumed = in_graph_order([*site.consumed, *call_ancestors(mask)])
    # else: the whole mask stays beside the window, which hides only keys it hides already
    return site
