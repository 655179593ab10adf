"""Band masks: reading a mask built in the graph as ``lo <= j - i <= hi`` and what is left of it.

A sliding-window mask is a band around the diagonal of the (query i, key j) plane. Models build
it from index arithmetic, never as data:

* HF transformers (``masking_utils.sdpa_mask`` under torch.compile, Mistral, Qwen2, Gemma 2/3,
  Cohere2, Phi-3 with ``sliding_window``): ``kv_idx > q_idx - w`` AND ``kv_idx <= q_idx`` on
  ``arange`` indices broadcast to (B, 1, L, S), AND a padding lookup ``mask[b, kv_idx]``; "eager"
  then turns it into ``where(mask, 0.0, finfo.min)``.
* forward code: ``torch.tril(torch.ones(L, S), diagonal=w)``, ``triu(..., diagonal=-w)``,
  ``(i - j).abs() <= w``, ``abs(i - j) < w``, ``masked_fill(~band, -inf)``.

:func:`decompose` reads a bool condition as a conjunction: the band part (bounds on
``d = j - i``, in the mask's own row and column positions) and the residual terms it could not
read (a padding lookup, anything data-dependent), each kept as written. It only follows what it
can prove: integer ``arange`` indices with constant (or symbolic size) offsets, comparisons,
``abs``, AND, NOT (of one half-plane), OR under NOT (De Morgan), ``tril``/``triu`` of ones,
casts, broadcasts and top-left slices. A comparison on one index alone that every position
meets (HF's bidirectional ``q_idx >= 0``, on ``arange(L) + q_offset``) hides nothing and reads
as no term at all. Anything else is a residual term, so reading a mask never changes what it
hides: visible = band AND residual, exactly.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, NamedTuple, Optional

import sympy
import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .fx_match import is_function, is_method, method_name, tensor_value

# Dynamo may record ``a < b`` on tensors as the method ``a.__lt__(b)`` (see fx_match.method_name).
_COMPARE = {
    operator.lt: "lt", operator.le: "le", operator.gt: "gt", operator.ge: "ge", operator.eq: "eq", operator.ne: "ne",
    torch.lt: "lt", torch.le: "le", torch.gt: "gt", torch.ge: "ge", torch.eq: "eq", torch.ne: "ne",
    torch.less: "lt", torch.less_equal: "le", torch.greater: "gt", torch.greater_equal: "ge",
}
_COMPARE_METHODS = {"lt": "lt", "le": "le", "gt": "gt", "ge": "ge", "eq": "eq", "ne": "ne",
                    "__lt__": "lt", "__le__": "le", "__gt__": "gt", "__ge__": "ge", "__eq__": "eq", "__ne__": "ne"}
_NEGATED = {"lt": "ge", "le": "gt", "gt": "le", "ge": "lt", "eq": "ne", "ne": "eq"}
_SWAPPED = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq", "ne": "ne"}
_AND = (operator.and_, torch.logical_and, torch.bitwise_and)
_OR = (operator.or_, torch.logical_or, torch.bitwise_or)
_NOT = (operator.invert, torch.logical_not, torch.bitwise_not)
_AND_METHODS = ("__and__", "logical_and", "bitwise_and")
_OR_METHODS = ("__or__", "logical_or", "bitwise_or")
_NOT_METHODS = ("__invert__", "logical_not", "bitwise_not")
_CASTS = ("to", "bool", "int", "long", "float", "half", "double", "bfloat16", "type", "contiguous", "clone")
_INDEX_CASTS = ("to", "int", "long", "contiguous", "clone")


# ------------------------------------------------------------------------------------------
# Integer index tensors: sum over dims of coef * position + const
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Affine:
    """An integer tensor whose entry at a position is ``sum(coefs[d] * position[d]) + const``.

    Dims are counted from the right (-1 is the last), so broadcasting keeps them; ``const`` is an
    int or a sympy expression of symbolic sizes (a KV cache's offset under dynamic shapes)."""

    coefs: tuple[tuple[int, int], ...]
    const: Any
    abs_of: bool = False  # the entry is |affine| (only compared, never added to)

    def coef(self, dim: int) -> int:
        return dict(self.coefs).get(dim, 0)


def _constant(value: Any) -> Any:
    """An int, or a symbolic integer size, as a sympy-compatible constant; None otherwise."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, fx.Node):
        ev = value.meta.get("example_value", value.meta.get("val"))
        if isinstance(ev, bool):
            return None
        if isinstance(ev, int):
            return ev
        if isinstance(ev, torch.SymInt):
            expr = ev.node.expr
            return int(expr) if expr.is_number else expr
    return None


def _integer_tensor(node: fx.Node) -> Optional[torch.Tensor]:
    """int32/int64 only: exact for any position, where int8/int16 would wrap."""
    ev = tensor_value(node)
    return ev if ev is not None and ev.dtype in (torch.int32, torch.int64) else None


def _normalised(coefs: dict, ev: torch.Tensor, const: Any) -> Affine:
    """Coefs on dims of size 1 read position 0 only: they contribute nothing to any entry."""
    n = ev.dim()
    kept = {d: c for d, c in coefs.items() if c != 0 and -d <= n and not statically_known_true(ev.shape[d] == 1)}
    return Affine(tuple(sorted(kept.items())), const)


def _combine(a: Affine, b: Affine, sign: int, ev: torch.Tensor) -> Optional[Affine]:
    if a.abs_of or b.abs_of:
        return None
    coefs = dict(a.coefs)
    for d, c in b.coefs:
        coefs[d] = coefs.get(d, 0) + sign * c
    return _normalised(coefs, ev, a.const + sign * b.const)


def dim_map(index: tuple, ndim: int) -> Optional[dict[int, tuple[int, Any]]]:
    """For ``x[index]`` with basic indexing (None, full or offset slices, Ellipsis): for each
    input dim (from the right) its output dim (from the right) and the slice start; None when
    the index does something else (an integer, a tensor, a step)."""
    if any(i is Ellipsis for i in index) and sum(i is Ellipsis for i in index) > 1:
        return None
    consumed = sum(1 for i in index if i is not None and i is not Ellipsis)
    if consumed > ndim:
        return None
    expanded: list = []
    for i in index:
        if i is Ellipsis:
            expanded += [slice(None)] * (ndim - consumed)
        else:
            expanded.append(i)
    if not any(i is Ellipsis for i in index):
        expanded += [slice(None)] * (ndim - consumed)
    out_ndim = len(expanded)
    mapping, in_dim = {}, 0
    for out_dim, entry in enumerate(expanded):
        if entry is None:
            continue
        if not isinstance(entry, slice) or entry.step not in (None, 1):
            return None
        start = 0 if entry.start is None else _constant(entry.start)
        if start is None or (isinstance(start, int) and start < 0):
            return None
        mapping[in_dim - ndim] = (out_dim - out_ndim, start)
        in_dim += 1
    return mapping


def _affine(node: Any) -> Optional[Affine]:
    """``node`` as an :class:`Affine` integer tensor or constant, or None."""
    const = _constant(node)
    if const is not None:
        return Affine((), const)
    if not isinstance(node, fx.Node):
        return None
    ev = _integer_tensor(node)
    if ev is None:
        return None
    args = node.args
    if is_function(node, torch.arange):
        bounds = [a for a in args if not isinstance(a, torch.dtype)]
        step = bounds[2] if len(bounds) > 2 else node.kwargs.get("step", 1)
        start = _constant(bounds[0] if len(bounds) > 1 else node.kwargs.get("start", 0))
        if step != 1 or start is None or ev.dim() != 1:
            return None
        return _normalised({-1: 1}, ev, start)
    if is_function(node, operator.add, torch.add, operator.sub, torch.sub) or is_method(node, "add", "sub"):
        if len(args) != 2 or node.kwargs:
            return None
        a, b = _affine(args[0]), _affine(args[1])
        sign = -1 if node.target in (operator.sub, torch.sub) or method_name(node) == "sub" else 1
        return _combine(a, b, sign, ev) if a is not None and b is not None else None
    if is_method(node, "__radd__", "__rsub__") and len(args) == 2:  # c + x, c - x on some torch versions
        a, b = _affine(args[0]), _affine(args[1])
        if a is None or b is None:
            return None
        return _combine(b, a, -1, ev) if node.target == "__rsub__" else _combine(a, b, 1, ev)
    if is_function(node, operator.neg, torch.neg) or is_method(node, "neg", "__neg__"):
        inner = _affine(args[0])
        return None if inner is None or inner.abs_of else Affine(tuple((d, -c) for d, c in inner.coefs), -inner.const)
    if is_function(node, torch.abs, operator.abs) or is_method(node, "abs", "__abs__"):
        inner = _affine(args[0])
        return None if inner is None or inner.abs_of else dataclasses.replace(inner, abs_of=True)
    if is_method(node, *_INDEX_CASTS):
        return _affine(args[0]) if all(not isinstance(a, fx.Node) for a in args[1:]) else None
    if is_function(node, operator.getitem) or is_method(node, "unsqueeze") or is_method(node, "view", "reshape", "expand"):
        return _moved(node, ev)
    return None


def _moved(node: fx.Node, ev: torch.Tensor) -> Optional[Affine]:
    """An affine tensor through a view that keeps each entry's value: new size-1 dims, offset
    slices, broadcasts, and views that only add or remove size-1 dims."""
    source = node.args[0]
    inner = _affine(source)
    before = tensor_value(source)
    if inner is None or inner.abs_of or before is None:
        return None
    if not inner.coefs:
        return inner
    if is_function(node, operator.getitem):
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        mapping = dim_map(index, before.dim())
        if mapping is None:
            return None
        coefs, const = {}, inner.const
        for d, c in inner.coefs:
            out_dim, start = mapping[d]
            coefs[out_dim] = c
            const = const + c * start
        return _normalised(coefs, ev, const)
    if is_method(node, "expand"):
        return _normalised(dict(inner.coefs), ev, inner.const)  # dims from the right are unchanged
    # unsqueeze / view / reshape: the non-1 dims of input and output must pair up in order.
    big_in = [d - before.dim() for d in range(before.dim()) if not statically_known_true(before.shape[d] == 1)]
    big_out = [d - ev.dim() for d in range(ev.dim()) if not statically_known_true(ev.shape[d] == 1)]
    if len(big_in) != len(big_out) or not all(
            statically_known_true(before.shape[a] == ev.shape[b]) for a, b in zip(big_in, big_out)):
        return None
    pairs = dict(zip(big_in, big_out))
    return _normalised({pairs[d]: c for d, c in inner.coefs}, ev, inner.const)


# ------------------------------------------------------------------------------------------
# Bool conditions: band AND residual terms
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Conjunction:
    """``j - i >= lo`` for every lo in ``los`` and ``j - i <= hi`` for every hi in ``his``, AND
    every residual term.

    ``residual`` holds (node, negated) pairs, each a tensor that broadcasts to the condition
    (negated: the term is its complement). ``rebuildable`` is False when a residual term sits
    under a view that moves positions (a slice): then the terms cannot simply be AND-ed again
    and only the whole condition stands for them."""

    los: list = dataclasses.field(default_factory=list)
    his: list = dataclasses.field(default_factory=list)
    residual: list = dataclasses.field(default_factory=list)
    rebuildable: bool = True

    @property
    def has_band(self) -> bool:
        return bool(self.los or self.his)


def conjunction_and(a: Conjunction, b: Conjunction) -> Conjunction:
    return Conjunction(a.los + b.los, a.his + b.his, a.residual + b.residual, a.rebuildable and b.rebuildable)



def _bounds(lo: Any = None, hi: Any = None) -> Conjunction:
    return Conjunction([] if lo is None else [lo], [] if hi is None else [hi])


def _leaf(node: fx.Node, negated: bool = False) -> Conjunction:
    return Conjunction(residual=[(node, negated)])


def _is_ones(node: Any) -> bool:
    if is_function(node, torch.ones, torch.ones_like) or is_method(node, "new_ones"):
        return True
    if is_function(node, torch.full) or is_method(node, "new_full"):
        args = node.args[1:] if node.op == "call_function" else node.args[2:]
        value = args[0] if args else node.kwargs.get("fill_value")
        return value is True or (isinstance(value, (int, float)) and not isinstance(value, bool) and value == 1)
    return False


def _is_indicator(node: Any) -> bool:
    """Holds only 0 and 1 (or False and True): a bool tensor, ones, tril/triu/casts of one."""
    ev = tensor_value(node)
    if ev is None:
        return False
    if ev.dtype == torch.bool or _is_ones(node):
        return True
    if is_function(node, torch.tril, torch.triu) or is_method(node, "tril", "triu", *_CASTS, "view", "reshape",
                                                                 "expand", "unsqueeze"):
        return _is_indicator(node.args[0])
    if is_function(node, operator.getitem):
        return _is_indicator(node.args[0])
    return False


def position_preserving_view(node: fx.Node) -> bool:
    """A view whose last two dims keep their sizes and positions (a broadcast over leading dims,
    new leading dims, a cast): the band of its input is its band."""
    before, after = tensor_value(node.args[0]), tensor_value(node)
    if before is None or after is None or before.dim() < 2 or after.dim() < 2:
        return False
    if is_method(node, *_CASTS):
        return True  # dtype and device only
    if not all(statically_known_true(a == b) for a, b in zip(before.shape[-2:], after.shape[-2:])):
        return False
    if is_method(node, "expand"):
        return True
    if is_function(node, operator.getitem):
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        mapping = dim_map(index, before.dim())
        return mapping is not None and all(mapping.get(d) == (d, 0) for d in (-2, -1))
    if is_method(node, "view", "reshape", "unsqueeze"):
        return before.dim() <= after.dim() and all(
            statically_known_true(a == b) for a, b in zip(reversed(before.shape), reversed(after.shape)))
    return False


def decompose(node: Any, one_query: bool = False) -> Conjunction:
    """Where the bool (or 0/1) tensor ``node`` is true, as band AND residual terms (exact).

    ``one_query``: the mask has one row (decoding, L = 1), whose position i is 0, so a bound on
    the key index alone is a bound on j - i."""
    if not isinstance(node, fx.Node):
        return Conjunction(residual=[(node, False)], rebuildable=False)
    args = node.args
    if _is_ones(node):
        return Conjunction()
    if _is_logical(node, _AND, _AND_METHODS):
        return conjunction_and(decompose(args[0], one_query), decompose(args[1], one_query))
    if (is_function(node, operator.mul, torch.mul) or is_method(node, "mul", "__mul__")) and len(args) == 2 \
            and all(_is_indicator(a) for a in args):
        return conjunction_and(decompose(args[0], one_query), decompose(args[1], one_query))
    if (is_function(node, *_NOT) or is_method(node, *_NOT_METHODS)) and _bool(args[0]):
        return complement(args[0], one_query)
    compare = _comparison(node)
    if compare is not None:
        name, lhs, rhs = compare
        if name in ("eq", "ne") and _is_zero(rhs) and _is_indicator(lhs):
            return complement(lhs, one_query) if name == "eq" else _sub_decompose(node, lhs, one_query)
        if name in ("eq", "ne") and _is_zero(lhs) and _is_indicator(rhs):
            return complement(rhs, one_query) if name == "eq" else _sub_decompose(node, rhs, one_query)
        found = _half_planes(name, lhs, rhs, node, one_query)
        return found if found is not None else _leaf(node)
    if (is_function(node, torch.tril, torch.triu) or is_method(node, "tril", "triu")) and _is_indicator(args[0]):
        diagonal = args[1] if len(args) > 1 else node.kwargs.get("diagonal", 0)
        if not isinstance(diagonal, int) or isinstance(diagonal, bool):
            return _leaf(node)
        lower = node.target in (torch.tril, "tril")
        inner = _sub_decompose(node, args[0], one_query)
        return conjunction_and(inner, _bounds(hi=diagonal) if lower else _bounds(lo=diagonal))
    if (is_method(node, *_CASTS, "view", "reshape", "expand", "unsqueeze") or is_function(node, operator.getitem)) \
            and _is_indicator(args[0]) and position_preserving_view(node):
        return _sub_decompose(node, args[0], one_query)
    return _leaf(node)


def _is_logical(node: fx.Node, functions: tuple, methods: tuple) -> bool:
    """A logical AND / OR of two tensors: torch.logical_* on anything (nonzero is true), the
    bitwise forms only on bools (on integers they combine bits)."""
    if not ((is_function(node, *functions) or is_method(node, *methods)) and len(node.args) == 2):
        return False
    return node.target in (torch.logical_and, torch.logical_or, "logical_and", "logical_or") or _bool(node)


def _sub_decompose(node: fx.Node, inner: fx.Node, one_query: bool) -> Conjunction:
    """``inner``'s conjunction seen through ``node`` (same positions): a bare residual term is
    replaced by ``node`` itself, so the term keeps the cast or broadcast written on it."""
    found = decompose(inner, one_query)
    if not found.has_band:
        return _leaf(node) if found.residual else found
    if found.residual and not _keeps_leaves(node):
        found.rebuildable = False
    return found


def _keeps_leaves(node: fx.Node) -> bool:
    """Residual terms under ``node`` can be AND-ed without it: it only casts, broadcasts, adds
    leading dims or applies tril/triu (whose band part is already read)."""
    if is_method(node, "expand", "to", "bool", "contiguous", "clone") or is_function(node, torch.tril, torch.triu) \
            or is_method(node, "tril", "triu"):
        return True
    before, after = tensor_value(node.args[0]), tensor_value(node)
    return before is not None and after is not None and tuple(before.shape) == tuple(after.shape)


def complement(node: fx.Node, one_query: bool = False) -> Conjunction:
    """Where ``node`` is false: NOT of one half-plane is a half-plane, NOT of an OR is an AND of
    NOTs; anything else is the residual term NOT node."""
    args = node.args
    if _is_logical(node, _OR, _OR_METHODS):
        return conjunction_and(complement(args[0], one_query), complement(args[1], one_query))
    if (is_function(node, *_NOT) or is_method(node, *_NOT_METHODS)) and _bool(args[0]):
        return decompose(args[0], one_query)
    compare = _comparison(node)
    if compare is not None and _NEGATED.get(compare[0]) is not None:
        # NOT (a < b) is a >= b on integers: |i - j| > w negated is the band |i - j| <= w.
        found = _half_planes(_NEGATED[compare[0]], compare[1], compare[2], node, one_query)
        if found is not None:
            return found
    found = decompose(node, one_query)
    if found.residual or len(found.los) + len(found.his) != 1:
        return _leaf(node, negated=True)
    return _bounds(hi=found.los[0] - 1) if found.los else _bounds(lo=found.his[0] + 1)


def _bool(node: Any) -> bool:
    ev = tensor_value(node)
    return ev is not None and ev.dtype == torch.bool


def _is_zero(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0) or value is False


def _comparison(node: fx.Node) -> Optional[tuple[str, Any, Any]]:
    if node.op == "call_function" and node.target in _COMPARE and len(node.args) == 2:
        return _COMPARE[node.target], node.args[0], node.args[1]
    if node.op == "call_method" and node.target in _COMPARE_METHODS and len(node.args) == 2:
        return _COMPARE_METHODS[node.target], node.args[0], node.args[1]
    return None


def _half_planes(name: str, lhs: Any, rhs: Any, node: fx.Node, one_query: bool) -> Optional[Conjunction]:
    """``lhs <op> rhs`` on integer index tensors as bounds on d = j - i (j: the column, dim -1;
    i: the row, dim -2), as no bound at all when it holds everywhere (:func:`_always_true`), or
    None when it is neither."""
    a, b = _affine(lhs), _affine(rhs)
    if a is None or b is None:
        return None
    if b.abs_of and not a.abs_of:
        a, b, name = b, a, _SWAPPED[name]
    if a.abs_of:
        # |s·d + c| <op> w, w a constant: -w <= s·d + c <= w for le (strict for lt).
        if b.coefs or b.abs_of or name not in ("le", "lt"):
            return None
        sign = _band_sign(a, one_query)
        if sign is None:
            return None
        w = b.const - (1 if name == "lt" else 0)
        c = sign * a.const  # |s·d + c| == |d + s·c|
        return _bounds(lo=-w - c, hi=w - c)
    result = tensor_value(node)
    diff = _combine(a, b, -1, result) if result is not None else None
    if diff is None:
        return None
    sign = _band_sign(diff, one_query)
    if sign is None:
        # HF's bidirectional mask, ``q_idx >= 0``: a bound on one index (or none) that every
        # position meets hides nothing.
        return Conjunction() if _always_true(name, diff, result) else None
    # s·d + c <op> 0  ->  d <op'> -s·c
    k = -sign * diff.const
    if sign < 0:
        name = _SWAPPED[name]
    bounds = {"lt": (None, k - 1), "le": (None, k), "gt": (k + 1, None), "ge": (k, None), "eq": (k, k)}
    if name not in bounds:
        return None
    return _bounds(*bounds[name])


_RELATIONS = {"lt": sympy.Lt, "le": sympy.Le, "gt": sympy.Gt, "ge": sympy.Ge, "eq": sympy.Eq, "ne": sympy.Ne}


def _always_true(name: str, diff: Affine, result: torch.Tensor) -> bool:
    """``diff <op> 0`` provably holds at every position of ``result``, ``diff`` varying along one
    dim at most (the row index, or the key index, ...).

    Along that dim the positions run over 0..n-1 (n: ``result``'s size there), and a linear form
    takes its extremes at the two ends: proving the comparison at both proves it everywhere
    (``ne`` only for a constant, whose one root could lie between the ends). Symbolic sizes and
    offsets are proved from what sympy knows of them (sizes are positive integers), never
    assumed."""
    coefs = dict(diff.coefs)
    if diff.abs_of or len(coefs) > 1 or (coefs and name == "ne"):
        return False
    ends = [diff.const]
    for dim, coef in coefs.items():
        ends.append(coef * (_sym(result.shape[dim]) - 1) + diff.const)
    return all(_proven(name, end) for end in ends)


def _proven(name: str, value: Any) -> bool:
    """``value <op> 0`` is true for every value of the size symbols in ``value``."""
    return _RELATIONS[name](sympy.sympify(value), 0) is sympy.true


def _band_sign(form: Affine, one_query: bool) -> Optional[int]:
    """s when ``form`` is s·(j - i) + c with s = ±1 (the column index minus the row index); with
    ``one_query`` (i is 0) also s·j + c."""
    coefs = dict(form.coefs)
    if one_query and set(coefs) == {-1} and coefs[-1] in (1, -1):
        return coefs[-1]
    if set(coefs) != {-2, -1} or coefs[-1] not in (1, -1) or coefs[-2] != -coefs[-1]:
        return None
    return coefs[-1]


# ------------------------------------------------------------------------------------------
# The op's window
# ------------------------------------------------------------------------------------------


class Window(NamedTuple):
    """FlashAttention's ``window_size``: query i sees key j iff
    ``-left <= j - (i + S - L) <= right``; -1 is unbounded on that side. A (left, right) pair,
    as the op's ``window=`` takes it."""

    left: int
    right: int

    def as_argument(self) -> tuple[int, int]:
        return (self.left, self.right)


def _as_int(expr: Any) -> Optional[int]:
    if isinstance(expr, int):
        return expr
    expr = sympy.simplify(expr)
    return int(expr) if expr.is_Integer else None


def to_window(found: Conjunction, seq_q: Any, seq_k: Any) -> Optional[Window]:
    """The band of ``found`` as a :class:`Window` for L = ``seq_q`` queries and S = ``seq_k`` keys,
    or None when a bound is not a compile-time constant or lies beyond what a window expresses
    (a band that excludes the aligned diagonal on one side: -1 means unbounded there)."""
    if not found.has_band:
        return None
    offset = _sym(seq_k) - _sym(seq_q)  # the diagonal j = i + S - L the window is aligned to
    lefts = [_as_int(offset - lo) for lo in found.los]
    rights = [_as_int(hi - offset) for hi in found.his]
    if any(x is None or x < 0 for x in lefts + rights):
        return None
    return Window(min(lefts, default=-1), min(rights, default=-1))


def _sym(size: Any) -> Any:
    return size.node.expr if isinstance(size, torch.SymInt) else int(size)


def rows_never_empty(window: Window, seq_q: Any, seq_k: Any) -> bool:
    """Every query sees at least one key: with left, right >= 0 (or unbounded) a row is empty
    only at the top, when the window's right edge i + S - L + right is below key 0 for i = 0."""
    if window.right == -1:
        return True
    return bool(statically_known_true(seq_k - seq_q + window.right >= 0))
