"""Key masks: a mask that is the same for every query goes to the op as one row, ``(..., 1, S)``.

A padding mask hides keys, never queries: every row of the (L, S) plane is the same. The op's
Hopper kernels take such a mask as a per-key bias, loaded once per key tile, where a dense
(L, S) mask is loaded and tested tile by tile. The op tells the two apart by the mask's shape
(size 1 at dim -2, or a stride-0 broadcast), so a mask built dense must be cut to its first row:

* HF transformers ``masking_utils.sdpa_mask`` under torch.compile (BERT, RoBERTa and every
  encoder through ``create_bidirectional_mask``): ``q_idx >= 0`` (``bidirectional_mask_function``,
  always true) AND the padding lookup ``padding_mask[batch_idx, kv_idx]`` on broadcast
  ``arange`` indices, ``.expand(B, -1, L, S)``; the first term makes the AND (B, 1, L, S), dense.
  "eager" then adds ``where(mask, 0.0, finfo.min)`` to the scores.

:func:`same_for_every_query` proves that every row of a mask is the same from how the mask is
built (``band.decompose`` reads ``q_idx >= 0`` as no term at all); the site then gets
``key_mask``, and ``site.rewrite_site`` hands the op ``mask[..., 0:1, :]``: a slice of the mask
as written, so its dtype and its fill values stay exactly as they were, and Inductor computes
only that row. A mask whose rows cannot be proved alike (a bound on the query index that some
row fails, ``q_idx >= 5``; a lookup by query; anything unread) stays as written.
"""

from __future__ import annotations

import logging
import operator
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from . import band
from .fx_match import is_function, is_method, known_equal, tensor_value
from .site import AttentionSite, example_value

log = logging.getLogger("flash_inductor")

# Elementwise with broadcasting: rows alike in every operand give rows alike in the result.
_ELEMENTWISE_FUNCTIONS = (
    torch.where, torch.masked_fill, operator.and_, operator.or_, operator.xor, operator.invert, operator.neg,
    operator.add, operator.sub, operator.mul, operator.truediv, operator.lt, operator.le, operator.gt, operator.ge,
    operator.eq, operator.ne, torch.logical_and, torch.logical_or, torch.logical_xor, torch.logical_not,
    torch.bitwise_and, torch.bitwise_or, torch.bitwise_xor, torch.bitwise_not, torch.add, torch.sub, torch.mul,
    torch.div, torch.neg, torch.lt, torch.le, torch.gt, torch.ge, torch.eq, torch.ne,
)
_ELEMENTWISE_METHODS = (
    "where", "masked_fill", "logical_and", "logical_or", "logical_xor", "logical_not", "bitwise_and", "bitwise_or",
    "bitwise_xor", "bitwise_not", "add", "sub", "mul", "div", "neg", "lt", "le", "gt", "ge", "eq", "ne",
    "__and__", "__or__", "__xor__", "__invert__", "__neg__", "__radd__", "__rsub__", "__rmul__", "__lt__", "__le__",
    "__gt__", "__ge__",
)
_CASTS = ("to", "bool", "int", "long", "float", "half", "double", "bfloat16", "type", "type_as", "contiguous", "clone")
_BROADCASTS = ("expand", "expand_as")
_ROW_PRESERVING_VIEWS = ("view", "reshape", "unsqueeze")


# ------------------------------------------------------------------------------------------
# Reading a mask
# ------------------------------------------------------------------------------------------


def same_for_every_query(mask: Any) -> bool:
    """Every row of ``mask`` (dim -2, the queries) is provably the same; False when unsure or
    when reading the mask fails."""
    try:
        return _rows_alike(mask, {})
    except Exception:  # noqa: BLE001 -- an unreadable mask stays the mask as written
        log.debug("flash_inductor: reading whether a mask varies along the queries failed", exc_info=True)
        return False


def one_row(value: torch.Tensor) -> bool:
    """The mask already has one query row (or none to speak of): nothing to cut."""
    return value.dim() < 2 or bool(statically_known_true(value.shape[-2] == 1))


def _rows_alike(node: Any, memo: dict) -> bool:
    if not isinstance(node, fx.Node):
        return not isinstance(node, (list, tuple, dict))  # a Python scalar, a dtype, a device
    if node not in memo:
        memo[node] = False  # while reading it (an FX graph has no cycles; a malformed one stops here)
        memo[node] = _read(node, memo)
    return memo[node]


def _read(node: fx.Node, memo: dict) -> bool:
    value = tensor_value(node)
    if value is None:  # a SymInt, a traced Python number: the same everywhere
        scalar = node.meta.get("example_value", node.meta.get("val"))
        return isinstance(scalar, (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool))
    if one_row(value):
        return True
    if _keeps_rows(node):
        return _rows_alike(node.args[0], memo)
    if _is_elementwise(node) and all(_rows_alike(a, memo) for a in (*node.args, *node.kwargs.values())):
        return True
    if value.dtype != torch.bool:
        return False
    # A comparison of indices that no row fails (``q_idx >= 0``) is no term; the rest must be alike.
    found = band.decompose(node)
    return not found.has_band and all(term is not node and _rows_alike(term, memo) for term, _ in found.residual)


def _is_elementwise(node: fx.Node) -> bool:
    if is_function(node, torch.where) or is_method(node, "where"):
        return len(node.args) + len(node.kwargs) == 3  # where(cond) alone returns indices
    return is_function(node, *_ELEMENTWISE_FUNCTIONS) or is_method(node, *_ELEMENTWISE_METHODS)


def _keeps_rows(node: fx.Node) -> bool:
    """A cast or view whose output row i, key j is its input's row i (or row 0, broadcast), key j."""
    if not node.args or not isinstance(node.args[0], fx.Node):
        return False
    before, after = tensor_value(node.args[0]), tensor_value(node)
    if before is None or after is None:
        return False
    if is_method(node, *_CASTS):
        return known_equal(before.shape, after.shape)
    if is_method(node, *_BROADCASTS) or is_function(node, torch.broadcast_to):
        return True  # dims from the right keep their places
    if is_function(node, operator.getitem):
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        mapping = band.dim_map(index, before.dim()) if before.dim() >= 2 else None
        return mapping is not None and mapping[-2][0] == -2 and mapping[-1][0] == -1
    if is_method(node, *_ROW_PRESERVING_VIEWS):
        return band.position_preserving_view(node)
    return False


# ------------------------------------------------------------------------------------------
# Sites
# ------------------------------------------------------------------------------------------


def describe_key_mask(kind: str, shapes: Sequence[Sequence]) -> str:
    """``bool key mask (2, 1, 1, 16)``: the shape the op gets, the masks' shapes broadcast with
    one query row."""
    width = max(len(s) for s in shapes)
    broadcast = []
    for dim in range(-width, 0):
        sizes = [s[dim] for s in shapes if len(s) >= -dim]
        broadcast.append(next((size for size in sizes if not statically_known_true(size == 1)), 1))
    broadcast[-2] = 1
    return f"{kind} key mask ({', '.join(str(size) for size in broadcast)})"


def sdpa_key_mask(site: AttentionSite) -> AttentionSite:
    """An SDPA site whose mask is the same for every query, marked to give the op its first row
    (module docstring); any other site as it was. A site with a window already passes its key
    terms alone (``window.py``)."""
    mask = site.attn_mask
    if mask is None or site.window is not None or site.prologue is not None or site.is_causal:
        return site
    value = example_value(mask)
    if value is None or one_row(value) or not same_for_every_query(mask):
        return site
    try:
        description = describe_key_mask("bool" if value.dtype == torch.bool else "float", [value.shape])
    except Exception:  # noqa: BLE001 -- a report line must never cost a site its rewrite
        log.debug("flash_inductor: describing %s's key mask failed", site.output.name, exc_info=True)
        description = None
    site.key_mask, site.mask_description = True, description
    return site


def handwritten_key_mask(terms: list) -> bool:
    """A hand-written site's mask terms (``handwritten_site.MaskTerm``) are together a key mask
    the op does not get as one yet: every term the same for every query, one of them dense."""
    values = [tensor_value(term.node) for term in terms]
    if not terms or any(value is None for value in values) or all(one_row(value) for value in values):
        return False
    return all(same_for_every_query(term.node) for term in terms)
