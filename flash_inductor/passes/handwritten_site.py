"""Turning a recognised hand-written attention site into the op call (see ``handwritten.py``).

Recognition produces a :class:`Match` (what each piece of the site is); :func:`assemble` checks
that the pieces line up (dtypes, batch dims, masks) and decides the op's arguments as a
:class:`Plan`; :func:`make_site` turns the plan into an :class:`AttentionSite` whose prologue
lays q, k, v and the masks out for the op and whose epilogue lays the result out as the model
expects. All layout changes are views (permute, unflatten, flatten, new size-1 dims), never
copies of q/k/v.

Layouts: the scores may be viewed between the Q·Kᵀ product, the masks and the P·V product
(Bloom and fairseq compute on (B*H, L, S) and add a (B, 1, L, S) mask on a (B, H, L, S) view).
The op runs on the finest of these batch layouts, so a broadcast mask stays broadcast: every
coarser tensor is unflattened into it and the result flattened back.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any, Callable, Optional

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .fx_match import (
    Keep, Scale, check_dtypes, describe, group_dims, is_mask_fill, known_equal, mutates, tensor_value,
    call_ancestors,
)
from .key_mask import describe_key_mask, handwritten_key_mask
from .packed import read_packed
from .site import AttentionSite
from .window import causal_or_window, handwritten_window

# ------------------------------------------------------------------------------------------
# What recognition found
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Product:
    """The Q·Kᵀ product, canonicalised: q ``(..., L, E)`` and k ``(..., S, E)`` after the permutes."""

    node: fx.Node
    query: fx.Node
    key: fx.Node
    query_perm: Optional[tuple[int, ...]] = None
    key_perm: Optional[tuple[int, ...]] = None  # for matmul: (..., -1, -2) when k must be transposed
    scale: Scale = Scale()
    bias: Optional[fx.Node] = None  # baddbmm's input, an additive mask times beta
    beta: float = 1.0
    consumed: list = dataclasses.field(default_factory=list)  # peeled scales and transposes


@dataclasses.dataclass
class Step:
    """One node between the product and the softmax."""

    kind: str  # "scale" | "add" | "fill" | "cast" | "view" | "tanh" | "sinks" | "shift"
    node: fx.Node
    input: fx.Node
    scale: Scale = Scale()
    mask: Optional[fx.Node] = None  # add: the additive tensor; fill: the condition
    factor: float = 1.0  # add: the additive tensor's coefficient (-1 for a subtraction)
    attend_if: bool = False  # fill: keys are visible where cond == attend_if
    value: float = 0.0  # fill: the fill value
    causal: Optional[bool] = None  # fill: provably top-left causal (True: from a constant buffer)
    extra: tuple = ()  # constant-building nodes, erased with the pattern once unused
    sinks: Optional[fx.Node] = None  # sinks: the concatenated sink column
    # Nodes of the step that read its input besides ``node`` (a shift's row max) or build an
    # operand (the sink column's expand), erased with the pattern once unused.
    internal: tuple = ()


@dataclasses.dataclass
class Match:
    """A whole site: product -> steps -> softmax -> probability nodes -> P·V product."""

    product: Product
    steps: list[Step]
    softmax: fx.Node
    probs: list[fx.Node]  # casts, dropout and views after the softmax
    prob_views: list[fx.Node]
    dropout_p: float
    output: fx.Node  # the P·V product
    key: fx.Node  # after repeat_kv / repeat_interleave were peeled off
    value: fx.Node
    value_perm: Optional[tuple[int, ...]]  # value permuted to (..., S, Ev)
    out_perm: Optional[tuple[int, ...]]  # (..., L, Ev) permuted to the P·V product's layout
    is_einsum: bool = False
    repeats: int = 1
    repeat_nodes: list = dataclasses.field(default_factory=list)
    softcap: Optional[float] = None  # softcap.py: the cap of ``c * tanh(s / c)``
    sinks: Optional[fx.Node] = None  # sinks.py: one sink logit per head (before the broadcast)
    step_nodes: list = dataclasses.field(default_factory=list)  # every score step's nodes, sinks' included


@dataclasses.dataclass
class Context:
    """Per-graph state: node order (to sort erasures) and what earlier sites replaced (a later
    site may read an earlier one's output, which the earlier rewrite erased)."""

    order: dict
    replaced: dict = dataclasses.field(default_factory=dict)

    def resolve(self, node: Any) -> Any:
        while isinstance(node, fx.Node) and node in self.replaced:
            node = self.replaced[node]
        return node


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
    """The decided rewrite: the op's arguments and how to lay tensors out for it."""

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
    anchors: list  # the product and the softmax, for the report's module path
    window: Any = None  # the op's sliding window (``band.Window``) read from band masks, or None
    key_mask: bool = False  # every query row of the masks is the same: the op gets one (key_mask.py)
    softcap: Optional[float] = None
    sinks: Optional[fx.Node] = None
    sequence_ids: Optional[fx.Node] = None  # packed sequences (packed.py)


# ------------------------------------------------------------------------------------------
# Deciding the op's arguments
# ------------------------------------------------------------------------------------------


def _permuted(shape, perm: Optional[tuple]) -> tuple:
    return tuple(shape) if perm is None else tuple(shape[i] for i in perm)


def _broadcasts_to(shape: tuple, target: tuple) -> bool:
    """Provably broadcastable to ``target``: right-aligned, every dim equal to it or 1."""
    return len(shape) <= len(target) and all(
        statically_known_true(a == b) or _is_one(a) for a, b in zip(reversed(shape), reversed(target)))


def _heads_line_up(kv: tuple, batch: tuple, repeats: int) -> Optional[bool]:
    """None if ``kv`` batch dims do not line up with ``batch``; else whether they are grouped
    (GQA: fewer heads in dim -3, repeated by ``repeats`` or broadcast from 1 by matmul). Other
    size-1 dims broadcast, as in matmul; the op broadcasts them the same way (stride-0 views)."""
    if known_equal(kv, batch):
        return False
    if not batch or not kv or not _broadcasts_to(kv[:-1], batch[:-1]):
        return None
    if statically_known_true(kv[-1] == batch[-1]):
        return False
    if _is_one(kv[-1]) or (repeats > 1 and statically_known_true(kv[-1] * repeats == batch[-1])):
        return True
    return None


def _dynamic_sizes(fine: tuple, groups: list, views: list) -> list:
    """The op layout's sizes for unflatten: ints, one None (-1) per group, or the size arguments
    of a view in the pattern that produced that layout (Bloom's view(batch_size, num_heads, ...))."""
    sizes = [s if isinstance(s, int) else None for s in fine]
    for view in views:
        ev = tensor_value(view)
        if ev is not None and known_equal(ev.shape[:-2], fine):
            given = view.args[1:]
            if len(given) == 1 and isinstance(given[0], (tuple, list)):  # view((b, h, l, s))
                given = given[0]
            sizes = [s if s is not None else (g if isinstance(g, (fx.Node, int)) and g != -1 else None)
                     for s, g in zip(sizes, given)]
            break
    for start, stop in groups:
        if stop - start > 1 and sum(s is None for s in sizes[start:stop]) > 1:
            raise Keep("the batch dims of the reshaped scores are dynamic and cannot be rebuilt")
    return sizes


def _check_not_mutated(nodes: list, pattern: list, output: fx.Node, order: dict) -> None:
    """The op reads q, k, v and the masks where the P·V product was: none of them (nor the nodes
    peeled off them) may be written in place in between. Conservative: any in-place write after
    the pattern's first node (``pattern``: the nodes it replaces) and before the P·V product keeps
    the site. A write before the pattern starts is seen by the pattern and the op alike: a static
    KV cache is written by ``index_copy_`` just before the step's attention reads it (HF's
    ``StaticCache.update``)."""
    start = min(order.get(node, -1) for node in pattern)
    for node in nodes:
        for user in node.users:
            if mutates(user, node) and max(order.get(node, -1), start) < order.get(user, -1) < order[output]:
                raise Keep(f"{node.name} is modified in place by {describe(user)} at {user.name} "
                           "before the P·V product")


def _masks(match: Match, groups_of: Callable) -> tuple[list["MaskTerm"], Scale, list[Step]]:
    """The score expression reduced to (scale, masks): the mask terms in order, the scale of
    Q·Kᵀ, and the fill steps.

    Models scale, add and fill in any order; a constant scale c > 0 after masks is distributed
    over them, which is exact: ``(QKᵀ + b)·c + m = c·QKᵀ + (c·b + m)`` (Falcon with ALiBi), and a
    fill stays a fill (``-inf·c = -inf``; a finite fill is checked to still hide keys).
    """
    product, masks, fills, scale = match.product, [], [], match.product.scale
    if product.bias is not None:
        masks.append(MaskTerm(product.bias, False, tuple(tensor_value(product.bias).shape),
                              groups_of(tensor_value(product.node).shape[:-2]), factor=product.beta))
    for step in match.steps:
        if step.kind == "scale":
            if masks:
                _distribute_scale(step, masks, fills)
            scale = scale * step.scale
        elif step.kind in ("add", "fill"):
            mask_ev = tensor_value(step.mask)
            if step.kind == "add" and (mask_ev is None or not mask_ev.is_floating_point()):
                raise Keep(f"the additive mask {step.mask.name} has dtype "
                           f"{mask_ev.dtype if mask_ev is not None else 'unknown'}, not a float dtype")
            masks.append(MaskTerm(step.mask, step.kind == "fill", tuple(mask_ev.shape),
                                  groups_of(tensor_value(step.node).shape[:-2]), attend_if=step.attend_if,
                                  factor=step.factor))
            if step.kind == "fill":
                fills.append(step)
    return masks, scale, fills


def _distribute_scale(step: Step, masks: list["MaskTerm"], fills: list[Step]) -> None:
    """Multiply the masks applied so far by the constant of a scale step that follows them, or
    keep the site where that would not be exact."""
    if step.scale.head_dim_power != 0:
        raise Keep(f"the scale at {step.node.name} depends on the dynamic head dim and follows a mask")
    c = step.scale.coef
    if not c > 0:
        # -inf * c = +inf: hidden keys would become the largest scores.
        raise Keep(f"the scores are scaled by {c:g} at {step.node.name} after a mask was applied; only a "
                   "positive constant distributes over the mask")
    dtype = tensor_value(step.node).dtype
    for fill in fills:
        scaled = fill.value * c
        if math.isfinite(fill.value) and not (is_mask_fill(scaled) and abs(scaled) <= torch.finfo(dtype).max):
            # A finite fill must stay finite (eager's fully hidden rows are uniform, not NaN) and
            # low enough to hide keys.
            raise Keep(f"the fill {fill.value:g} of {fill.node.name} scaled by {c:g} at {step.node.name} "
                       "no longer acts as a mask")
        fill.value = scaled
    for term in masks:
        if not term.is_bool:
            term.factor *= c


def assemble(match: Match, context: Context) -> AttentionSite:
    product, output = match.product, match.output
    q_shape = _permuted(tensor_value(product.query).shape, product.query_perm)
    k_shape = _permuted(tensor_value(match.key).shape, product.key_perm)
    v_shape = _permuted(tensor_value(match.value).shape, match.value_perm)
    scores = tensor_value(product.node).shape
    probs = tensor_value(match.probs[-1] if match.probs else match.softmax).shape
    q_ev = tensor_value(product.query)
    check_dtypes(q_ev, tensor_value(match.key), tensor_value(match.value),
                 [product.node, *(s.node for s in match.steps), match.softmax, *match.probs])
    if tensor_value(output).dtype != q_ev.dtype:
        raise Keep(f"the P·V product returns {tensor_value(output).dtype} for {q_ev.dtype} inputs")
    if not _broadcasts_to(tuple(q_shape[:-2]), tuple(scores[:-2])):
        raise Keep(f"query batch dims {tuple(q_shape[:-2])} do not line up with the scores {tuple(scores[:-2])}")
    k_grouped = _heads_line_up(k_shape[:-2], tuple(scores[:-2]), match.repeats)
    v_grouped = _heads_line_up(v_shape[:-2], tuple(probs[:-2]), match.repeats)
    if k_grouped is None or v_grouped is None or k_grouped != v_grouped:
        raise Keep(f"key/value batch dims {tuple(k_shape[:-2])}, {tuple(v_shape[:-2])} do not line up with "
                   f"the query's {tuple(q_shape[:-2])}")

    # The op layout: the finest batch layout the scores take between the two products.
    levels = [scores[:-2], probs[:-2], *(tensor_value(s.node).shape[:-2] for s in match.steps
                                          if s.kind in ("add", "fill"))]
    fine = max(levels, key=len)
    if k_grouped and any(not known_equal(level, fine) for level in levels):
        raise Keep("grouped K/V heads with reshaped scores are not supported")

    def groups_of(level):
        found = group_dims(fine, level)
        if found is None:
            raise Keep(f"the views of the scores {tuple(level)} and {tuple(fine)} do not line up")
        return found

    masks, scale, fills = _masks(match, groups_of)
    pattern = [*product.consumed, product.node, *match.repeat_nodes, *(s.node for s in match.steps), match.softmax,
               *match.probs, output]
    _check_not_mutated([product.query, match.key, match.value, *product.consumed, *match.repeat_nodes,
                        *(t.node for t in masks), *([match.sinks] if match.sinks is not None else [])],
                       pattern, output, context.order)
    is_causal = bool(fills) and len(fills) == len(masks) and all(f.causal is not None for f in fills)
    # Mistral / Qwen2 / Gemma / Phi-3 "eager" with sliding_window, Longformer-style local masks:
    # masks that together are a band become the op's window (window.py says when that is exact).
    # HF's packed batches (packed.py): causal AND same-sequence runs on the varlen op.
    ids = None if is_causal or not masks or len(fine) != 2 or not _packs(q_shape, k_shape, v_shape, fine) \
        else read_packed(masks, fine[0], *scores[-2:])
    read = None if is_causal or not masks or ids is not None \
        else handwritten_window(masks, [f.value for f in fills], *scores[-2:])
    window, banded = None, []
    if ids is not None:
        is_causal, banded, fills, masks = True, [t.node for t in masks], [], []
    if read is not None:
        window, residual = read
        if not residual:  # the op's is_causal excludes a mask
            is_causal, window = causal_or_window(window, *scores[-2:])
        banded, fills = [t.node for t in masks], []
        masks = [MaskTerm(node, True, tuple(tensor_value(node).shape), term.groups, attend_if=not negated)
                 for term, node, negated in residual]
    finite = [f for f in fills if f.value != float("-inf")]
    if finite and len(masks) > 1:
        # Eager replaces hidden scores by the fill and then adds or fills more: a row that the
        # masks hide together can mix fill values in ways one op mask cannot express.
        raise Keep(f"a finite fill ({finite[0].value:g}) combined with other masks: eager gives the rows "
                   "they hide together weights from the fill values (uniform over the filled keys), which "
                   "the op's masked-row rule (output 0) would change")
    # With sinks a row the fills hide entirely gives the sink all its weight in eager too (the
    # fill is below any sink by far more than exp's range), so the op's 0 is eager's result.
    row_fixup = bool(finite) and not is_causal and match.sinks is None
    if row_fixup and match.dropout_p > 0:
        raise Keep(f"a finite fill ({finite[0].value:g}) with dropout: rows it hides entirely are "
                   "dropped in eager")
    # BERT / RoBERTa "eager": HF's padding mask, built (B, 1, L, S), is the same for every query.
    key_mask = window is None and not is_causal and handwritten_key_mask(masks)
    extra = [a for s in match.steps for a in s.extra if isinstance(a, fx.Node)] + banded
    if is_causal and not banded:
        extra += [f.mask for f in fills]
        masks = []
    q_groups, out_groups = groups_of(scores[:-2]), groups_of(probs[:-2])
    views = [s.node for s in match.steps if s.kind == "view"] + match.prob_views
    sizes = _dynamic_sizes(fine, [g for m in masks for g in m.groups] + q_groups + out_groups, views)

    consumed = {*product.consumed, product.node, *match.repeat_nodes, *(s.node for s in match.steps),
                *match.step_nodes, match.softmax, *match.probs}
    for node in extra:
        consumed.update(call_ancestors(node))
    plan = Plan(
        pattern=_pattern_name(match, is_causal, fills, bool(k_grouped), masks, bool(banded), window, ids),
        output=output, query=Operand(product.query, product.query_perm, q_shape, q_groups),
        key=Operand(match.key, product.key_perm, k_shape, q_groups),
        value=Operand(match.value, match.value_perm, v_shape, out_groups),
        masks=masks, is_causal=is_causal, scale=scale.as_argument(), dropout_p=match.dropout_p,
        enable_gqa=bool(k_grouped), gqa_repeats=match.repeats, sizes=sizes, out_groups=out_groups,
        out_perm=match.out_perm, row_fixup=row_fixup,
        consumed=sorted(consumed, key=lambda n: context.order.get(n, -1)),
        resolve=context.resolve, replaced=context.replaced, anchors=[product.node, match.softmax],
        window=window, key_mask=key_mask, softcap=match.softcap,
        sinks=match.sinks, sequence_ids=ids,
    )
    return make_site(plan)


def _packs(q_shape: tuple, k_shape: tuple, v_shape: tuple, fine: tuple) -> bool:
    """q, k and v each (B, heads, L, E) with the op layout's batch: the varlen call packs their
    rows without broadcasting."""
    return all(len(shape) == 4 and known_equal(shape[:1], fine[:1]) for shape in (q_shape, k_shape, v_shape))


def _pattern_name(match: Match, is_causal: bool, fills: list, grouped: bool, masks: list, banded: bool,
                  window: Any, plan_ids: Any = None) -> str:
    """The counter / report name: the site's most distinctive feature (sinks and soft-capping
    first; GQA before a causal band read from index arithmetic, which is HF's causal mask in
    every GQA decoder)."""
    if plan_ids is not None:
        return "handwritten_packed"
    if match.sinks is not None:
        return "handwritten_sinks"
    if match.softcap is not None:
        return "handwritten_softcap"
    if is_causal and not banded:
        return "handwritten_causal_buffer" if any(f.causal for f in fills) else "handwritten_causal_tril"
    if match.product.bias is not None:
        return "handwritten_alibi"
    if grouped:
        return "handwritten_gqa"
    if banded:
        return "handwritten_window" if window is not None else "handwritten_causal_tril"
    if any(m.is_bool for m in masks):
        return "handwritten_bool_mask"
    if masks:
        return "handwritten_additive_mask"
    return "handwritten_einsum" if match.is_einsum else "handwritten_plain"


# ------------------------------------------------------------------------------------------
# Building the rewrite
# ------------------------------------------------------------------------------------------


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
    """The site for ``rewrite_site``: its prologue and epilogue build the layouts and masks."""
    state: dict[str, Any] = {}

    def prologue(graph, q, k, v, mask):
        # Built from the plan, whose nodes (masks and conditions too) resolve through earlier
        # rewrites of this graph; the site's own query/key/value fields are only its summary.
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
        return out

    def on_rewritten(replacement):
        plan.replaced[plan.output] = replacement

    return AttentionSite(
        pattern=plan.pattern, output=plan.output, query=plan.query.node, key=plan.key.node,
        value=plan.value.node, attn_mask=None, dropout_p=plan.dropout_p, is_causal=plan.is_causal,
        scale=plan.scale, enable_gqa=plan.enable_gqa, consumed=plan.consumed, prologue=prologue,
        epilogue=epilogue, mask_description=_describe_masks(plan), anchors=plan.anchors,
        on_rewritten=on_rewritten, window=plan.window, key_mask=plan.key_mask, softcap=plan.softcap,
        sinks=plan.sinks, sequence_ids=plan.sequence_ids,
    )


def _describe_masks(plan: Plan) -> Optional[str]:
    kinds = [kind for kind, present in (("float", any(not m.is_bool for m in plan.masks)),
                                        ("bool", any(m.is_bool for m in plan.masks))) if present]
    if not kinds:
        return None
    fixup = " (rows it hides entirely: mean of v, as eager)" if plan.row_fixup else ""
    if plan.key_mask:
        return describe_key_mask(" + ".join(kinds), [m.shape for m in plan.masks]) + fixup
    return " + ".join(kinds) + " mask" + fixup
