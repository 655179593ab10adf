"""Building the rewrite of a recognised hand-written attention site (see ``handwritten.py``).

Recognition decides *what* the site computes, as a :class:`Plan`; this module turns the plan
into an :class:`AttentionSite` whose prologue lays q, k, v and the masks out for the op and
whose epilogue lays the result out as the model expects. All layout changes are views
(permute, unflatten, flatten, new size-1 dims), never copies of q/k/v.

Layouts: the scores may be viewed between the Q·Kᵀ product, the masks and the P·V product
(Bloom and fairseq compute on (B*H, L, S) and add a (B, 1, L, S) mask on a (B, H, L, S) view).
The op runs on the finest of these batch layouts, so a broadcast mask stays broadcast: every
coarser tensor is unflattened into it and the result flattened back.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable, Optional

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .site import AttentionSite

Groups = list  # for each batch dim of a tensor: the [start, stop) range of op-layout dims it spans


@dataclasses.dataclass
class Operand:
    """q, k or v: ``node`` permuted by ``perm`` has ``shape`` (*batch, seq, dim), whose batch dims
    span ``groups`` of the op layout."""

    node: fx.Node
    perm: Optional[tuple[int, ...]]
    shape: tuple
    groups: Groups


@dataclasses.dataclass
class MaskTerm:
    """One mask of the site: an additive float tensor (times ``factor``), or a bool condition
    whose keys are visible where it equals ``attend_if``. ``shape`` is its (broadcastable) shape
    and ``groups`` the layout of the scores it applied to."""

    node: fx.Node
    is_bool: bool
    shape: tuple
    groups: Groups
    attend_if: bool = True
    factor: float = 1.0


@dataclasses.dataclass
class Plan:
    pattern: str
    output: fx.Node
    query: Operand
    key: Operand
    value: Operand
    masks: list[MaskTerm]
    is_causal: bool
    scale: Optional[float]
    dropout_p: float
    enable_gqa: bool
    gqa_repeats: int
    sizes: list  # the op layout's batch sizes: int, a node, or None (-1: inferred by unflatten)
    out_groups: Groups
    out_perm: Optional[tuple[int, ...]]
    # A finite fill (finfo.min) on a condition that may hide a whole row: eager gives that row
    # uniform weights over all keys (mean of v), where the op's bool mask gives 0.
    row_fixup: bool
    consumed: list
    resolve: Callable[[Any], Any]
    replaced: dict


def _to_layout(graph: fx.Graph, node: fx.Node, shape: tuple, groups: Groups, sizes: list) -> fx.Node:
    """A tensor broadcastable to (*coarse, X, Y) as one broadcastable to (*fine, X, Y)."""
    missing = len(groups) + 2 - len(shape)
    if missing > 0:  # right-align a mask with fewer dims, as broadcasting does
        node = graph.call_function(operator.getitem, (node, (None,) * missing + (Ellipsis,)))
        shape = (1,) * missing + tuple(shape)
    for dim in reversed(range(len(groups))):
        start, stop = groups[dim]
        if stop - start == 1:
            continue
        if _is_one(shape[dim]):
            index = (slice(None),) * dim + (None,) * (stop - start - 1) + (Ellipsis,)
            node = graph.call_function(operator.getitem, (node, index))
        else:
            split = tuple(-1 if s is None else s for s in sizes[start:stop])
            node = graph.call_method("unflatten", (node, dim, split))
    return node


def _from_layout(graph: fx.Graph, node: fx.Node, groups: Groups) -> fx.Node:
    for dim in reversed(range(len(groups))):
        start, stop = groups[dim]
        if stop - start > 1:
            node = graph.call_method("flatten", (node, start, stop - 1))
    return node


def _is_one(size: Any) -> bool:
    return statically_known_true(size == 1)


def _operand(graph: fx.Graph, operand: Operand, plan: Plan) -> fx.Node:
    node = plan.resolve(operand.node)
    if operand.perm is not None:
        node = graph.call_method("permute", (node, *operand.perm))
    return _to_layout(graph, node, operand.shape, operand.groups, plan.sizes)


def _mask(graph: fx.Graph, plan: Plan) -> tuple[Optional[fx.Node], Optional[fx.Node]]:
    """(attn_mask, visible) where visible is the combined bool condition (None without one)."""
    floats, visible = None, None
    for term in plan.masks:
        node = _to_layout(graph, plan.resolve(term.node), term.shape, term.groups, plan.sizes)
        if term.is_bool:
            if not term.attend_if:
                node = graph.call_function(torch.logical_not, (node,))
            visible = node if visible is None else graph.call_function(torch.logical_and, (visible, node))
        else:
            if term.factor != 1.0:
                node = graph.call_function(torch.mul, (node, term.factor))
            floats = node if floats is None else graph.call_function(torch.add, (floats, node))
    if floats is not None and visible is not None:
        return graph.call_function(torch.where, (visible, floats, float("-inf"))), visible
    return (floats if floats is not None else visible), visible


def make_site(plan: Plan) -> AttentionSite:
    state: dict[str, Any] = {}

    def prologue(graph, q, k, v, mask):
        q, k, v = (_operand(graph, o, plan) for o in (plan.query, plan.key, plan.value))
        mask, state["visible"] = _mask(graph, plan)
        state["value"] = v
        return q, k, v, mask

    def epilogue(graph, call):
        out = call
        if plan.row_fixup:
            # Rows with no visible key: eager's softmax over equal fills is uniform, i.e. the mean
            # of v (with its gradient); the op returns 0 there, so select the mean instead.
            mean = graph.call_method("mean", (state["value"], -2), {"keepdim": True})
            if plan.gqa_repeats > 1:
                mean = graph.call_method("repeat_interleave", (mean, plan.gqa_repeats), {"dim": -3})
            any_visible = graph.call_method("any", (state["visible"], -1), {"keepdim": True})
            out = graph.call_function(torch.where, (any_visible, out, mean))
        out = _from_layout(graph, out, plan.out_groups)
        if plan.out_perm is not None:
            out = graph.call_method("permute", (out, *plan.out_perm))
        plan.replaced[plan.output] = out
        return out

    return AttentionSite(
        pattern=plan.pattern, output=plan.output, query=plan.query.node, key=plan.key.node,
        value=plan.value.node, attn_mask=None, dropout_p=plan.dropout_p, is_causal=plan.is_causal,
        scale=plan.scale, enable_gqa=plan.enable_gqa, consumed=plan.consumed, prologue=prologue,
        epilogue=epilogue,
    )
