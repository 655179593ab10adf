"""Checks and small evaluators for the hand-written attention patterns (``handwritten.py``).

Everything here answers one question about a matched node and changes nothing: who reads a
tensor's values, whether a scalar is a compile-time constant, whether a mask is provably
causal, which dtypes a chain may compute in, how two batch layouts line up. The pattern
module raises :class:`Keep` with the reason these produce.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .site import example_value


class Keep(Exception):
    """A recognised attention site that must not be rewritten; the message is the report's reason."""


# ------------------------------------------------------------------------------------------
# Node kinds
# ------------------------------------------------------------------------------------------


def is_function(node: Any, *targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


# Dynamo on some torch versions (2.11) records ``mask == 0`` on a tensor as the method call
# ``mask.__eq__(0)`` where later versions record ``operator.eq``; the dunder forms below mean
# exactly their named methods (the reflected ``__r*__`` forms do not, and are not listed).
_DUNDER_METHODS = {
    "__eq__": "eq", "__ne__": "ne", "__mul__": "mul", "__truediv__": "div", "__add__": "add",
    "__sub__": "sub", "__matmul__": "matmul",
}


def method_name(node: Any) -> Optional[str]:
    """The method a call_method node calls, dunder operator forms normalised to their names."""
    if not (isinstance(node, fx.Node) and node.op == "call_method"):
        return None
    return _DUNDER_METHODS.get(node.target, node.target)


def is_method(node: Any, *names: str) -> bool:
    return method_name(node) in names


def bind(node: fx.Node, params: Sequence[str], defaults: dict) -> dict:
    """Arguments of a call by parameter name (``params`` in positional order, self included)."""
    bound = dict(defaults)
    bound.update(zip(params, node.args))
    bound.update(node.kwargs)
    return bound


def describe(node: fx.Node) -> str:
    """A node's target as the report prints it (``.masked_fill_()``, ``torch.tanh``, ``F.gelu``)."""
    if node.op == "call_method":
        return f".{node.target}()"
    target = getattr(node.target, "__name__", str(node.target))
    module = getattr(node.target, "__module__", "") or ""
    if module.startswith("torch") and module != "torch._C._nn":
        return f"{module.replace('torch.nn.functional', 'F')}.{target}"
    return target


def tensor_value(node: Any) -> Optional[torch.Tensor]:
    return example_value(node)


# ------------------------------------------------------------------------------------------
# Who reads a tensor's values
# ------------------------------------------------------------------------------------------

# Uses that read only shape, dtype or device: they do not pin the values of a pattern's
# intermediate (T5's `softmax(scores.float()).type_as(scores)` still lets the scores go).
_METADATA_METHODS = {"size", "dim", "stride", "numel", "nelement", "element_size", "get_device",
                     "is_contiguous", "new_zeros", "new_ones", "new_empty", "new_full"}
_LIKE_FACTORIES = {torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like}
_INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ipow,
                      operator.iand, operator.ior}


def _mentions(values: Iterable[Any], node: fx.Node) -> bool:
    found = []
    fx.node.map_arg(list(values), lambda n: found.append(n is node))
    return any(found)


def reads_only_metadata(user: fx.Node, node: fx.Node) -> bool:
    args, kwargs = user.args, user.kwargs
    if user.op == "call_method" and args and args[0] is node:
        return user.target in _METADATA_METHODS and not _mentions([*args[1:], *kwargs.values()], node)
    if user.op == "call_method" and user.target in ("type_as", "to") and len(args) > 1 and args[1] is node:
        return not _mentions([args[0], *args[2:], *kwargs.values()], node)
    if user.op == "call_function" and user.target in _LIKE_FACTORIES and args and args[0] is node:
        return not _mentions([*args[1:], *kwargs.values()], node)
    if user.op == "call_function" and user.target is getattr and args[0] is node:
        return args[1] in ("shape", "dtype", "device", "ndim", "is_cuda")
    return False


def value_users(node: fx.Node) -> list[fx.Node]:
    return [u for u in node.users if not reads_only_metadata(u, node)]


# ``x += y`` recorded as a method call (as dynamo may on some versions).
_INPLACE_DUNDERS = frozenset(f"__i{op}__" for op in (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor", "lshift", "rshift"))


def mutates(user: fx.Node, node: fx.Node) -> bool:
    """Whether ``user`` writes into ``node``'s memory (``x.masked_fill_``, ``x += y``, ``inplace=True``)."""
    first = user.args[0] if user.args else None
    if user.op == "call_method" and first is node:
        name = str(user.target)
        return (name.endswith("_") and not name.startswith("__")) or name in _INPLACE_DUNDERS
    if user.op == "call_function" and first is node:
        dropout_inplace = user.target is torch.nn.functional.dropout and user.args[3:4] == (True,)
        return user.target in _INPLACE_OPERATORS or user.kwargs.get("inplace") is True or dropout_inplace
    return user.kwargs.get("out") is node


def check_only_user(node: fx.Node, user: fx.Node, what: str, also: Sequence[fx.Node] = ()) -> None:
    """The pattern may delete ``node`` only if ``user`` (and the pattern's own nodes ``also``) are
    the only readers of its values."""
    others = [u for u in value_users(node) if u is not user and u not in also]
    if not others:
        return
    mutated = [u for u in others if mutates(u, node)]
    if mutated:
        first = mutated[0]
        raise Keep(f"the {what} ({node.name}) are modified in place by {describe(first)} at {first.name}")
    names = ", ".join(u.name for u in others[:3])
    raise Keep(f"the {what} ({node.name}) are also used by {names}")


# ------------------------------------------------------------------------------------------
# Compile-time constants
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scale:
    """A softmax scale ``coef * E ** head_dim_power``; E is the head dim when it is symbolic
    (dynamic=True turns ``1 / math.sqrt(k.size(-1))`` into ``1 / sym_sqrt(s0)``)."""

    coef: float = 1.0
    head_dim_power: float = 0.0

    def __mul__(self, other: "Scale") -> "Scale":
        return Scale(self.coef * other.coef, self.head_dim_power + other.head_dim_power)

    def inverse(self) -> "Scale":
        return Scale(1.0 / self.coef, -self.head_dim_power)

    def as_argument(self) -> Optional[float]:
        """The op's ``scale=``: a float, or None for exactly 1 / sqrt(E) with symbolic E."""
        if self.head_dim_power == 0:
            return self.coef
        if self.head_dim_power == -0.5 and self.coef == 1.0:
            return None
        raise Keep(f"the scale {self.coef} * E**{self.head_dim_power} depends on the dynamic head dim E")


_SCALAR_FACTORIES = (torch.full, torch.tensor, torch.scalar_tensor)


def _symbolic(value: Any):
    return value.node.expr if isinstance(value, (torch.SymInt, torch.SymFloat)) else None


def scalar(value: Any, head_dim: Any = None) -> Optional[Scale]:
    """``value`` as a constant (times a power of the symbolic head dim), or None.

    Follows Python numbers, SymInt/SymFloat arithmetic (``*``, ``/``, ``**``, ``sqrt``) and
    0-d tensors built from constants (HF GPT-2 divides by ``torch.full([], d ** 0.5)``).
    """
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return Scale(float(value)) if math.isfinite(value) else None
    if not isinstance(value, fx.Node):
        return None
    ev = value.meta.get("example_value", value.meta.get("val"))
    expr = _symbolic(ev)
    if expr is not None and head_dim is not None and expr == head_dim:
        return Scale(1.0, 1.0)
    if expr is not None and expr.is_number:
        return Scale(float(expr))
    args = value.args
    if value.op == "call_function":
        if value.target in (operator.mul, operator.truediv) and len(args) == 2:
            a, b = scalar(args[0], head_dim), scalar(args[1], head_dim)
            if a is None or b is None:
                return None
            return a * b if value.target is operator.mul else a * b.inverse()
        if value.target in (operator.pow,) and len(args) == 2 and isinstance(args[1], (int, float)):
            base = scalar(args[0], head_dim)
            if base is None or (base.coef < 0 and not float(args[1]).is_integer()):
                return None
            return Scale(base.coef ** args[1], base.head_dim_power * args[1])
        if value.target in (math.sqrt, torch._sym_sqrt) and len(args) == 1:
            base = scalar(args[0], head_dim)
            if base is None or base.coef < 0:
                return None
            return Scale(math.sqrt(base.coef), base.head_dim_power / 2)
        if value.target in _SCALAR_FACTORIES:
            return _tensor_scalar(value, head_dim)
    return None


def _tensor_scalar(node: fx.Node, head_dim: Any) -> Optional[Scale]:
    """``torch.full([], c)``, ``torch.tensor(c)``: c rounded to the tensor's dtype, as eager sees it."""
    ev = tensor_value(node)
    if ev is None or ev.numel() != 1:
        return None
    if node.target is torch.full:
        size, fill = (node.args + (None, None))[:2]
        if fill is None:
            fill = node.kwargs.get("fill_value")
        if size not in ([], ()):
            return None
    else:
        fill = node.args[0] if node.args else node.kwargs.get("data")
    found = scalar(fill, head_dim)
    if found is None or found.head_dim_power != 0:
        return found
    return Scale(torch.tensor(found.coef, dtype=ev.dtype).item())


def fill_value(value: Any) -> Optional[float]:
    """A masked_fill / where fill as a float (``-inf``, ``finfo.min``, ``torch.full([], ...)``),
    rounded to the fill tensor's dtype as eager sees it; None if not a constant."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if not is_function(value, *_SCALAR_FACTORIES):
        return None
    if value.target is torch.full:
        raw = value.args[1] if len(value.args) > 1 else value.kwargs.get("fill_value")
    else:
        raw = value.args[0] if value.args else value.kwargs.get("data")
    ev = tensor_value(value)
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or ev is None or ev.numel() != 1:
        return None
    return torch.tensor(float(raw), dtype=ev.dtype).item()


# A finite fill this low contributes exactly nothing next to any visible score above -9e3:
# exp(fill - max) underflows to 0 even in fp64 (exp(x) == 0 for x < -745). Above it, a fill is
# a real score (masked_fill(cond, 0.0) zeroes scores, it does not hide keys).
FINITE_FILL_MAX = -1.0e4


def is_mask_fill(value: float) -> bool:
    return value == float("-inf") or (math.isfinite(value) and value <= FINITE_FILL_MAX)


# ------------------------------------------------------------------------------------------
# Causal structure: is a mask tensor provably lower-triangular?
# ------------------------------------------------------------------------------------------

LOWER, UPPER = "lower", "upper"  # nonzero iff key j <= query i  /  iff j > i
_FLIP = {LOWER: UPPER, UPPER: LOWER}
_CASTS = {"to", "bool", "float", "half", "double", "int", "long", "type", "byte", "contiguous", "bfloat16"}
_VIEWS = {"view", "reshape", "expand", "unsqueeze", "contiguous"}


def _is_ones(node: Any) -> bool:
    if is_function(node, torch.ones, torch.ones_like):
        return True
    if is_function(node, torch.full):
        value = node.args[1] if len(node.args) > 1 else node.kwargs.get("fill_value")
        return value is True or (isinstance(value, (int, float)) and value == 1)
    return False


def _same_last_two(a: Any, b: Any) -> bool:
    ta, tb = tensor_value(a), tensor_value(b)
    return (ta is not None and tb is not None and ta.dim() >= 2 and tb.dim() >= 2
            and known_equal(ta.shape[-2:], tb.shape[-2:]))


def _top_left_slice(node: fx.Node) -> bool:
    """``x[:, :, :T, :S]``-style getitem: the last two dims are sliced from 0 with step 1."""
    base, index = node.args
    ev = tensor_value(base)
    if ev is None:
        return False
    index = index if isinstance(index, tuple) else (index,)
    if any(i is Ellipsis or isinstance(i, fx.Node) for i in index):
        return False
    dims = [i for i in index if i is not None]
    if len(dims) > ev.dim() or any(not isinstance(i, (slice, int)) for i in dims):
        return False
    for position in (ev.dim() - 2, ev.dim() - 1):
        if position < len(dims):
            entry = dims[position]
            if not isinstance(entry, slice) or entry.start not in (None, 0) or entry.step not in (None, 1):
                return False
    return True


def _buffer_triangle(node: fx.Node) -> Optional[str]:
    """A real constant (get_attr) whose last two dims are 0/1 lower (or strictly upper) triangular."""
    owner = node.graph.owning_module
    try:
        tensor = operator.attrgetter(node.target)(owner)
    except AttributeError:
        return None
    if not isinstance(tensor, torch.Tensor) or tensor.dim() < 2 or tensor.is_meta:
        return None
    ones = torch.ones_like(tensor)
    if torch.equal(tensor, torch.tril(ones)):
        return LOWER
    if torch.equal(tensor, torch.triu(ones, diagonal=1)):
        return UPPER
    return None


def triangle(node: Any) -> Optional[tuple[str, bool]]:
    """(LOWER | UPPER, from_buffer) when ``node`` provably is a causal 0/1 (or bool) mask on its
    last two dims, top-left aligned; None when unknown.

    A graph input's values are unknown at compile time (dynamo lifts module buffers to
    placeholders), so only masks built in the graph (``torch.tril(torch.ones(T, T))``, minGPT)
    or real constants (get_attr, e.g. nanoGPT's ``bias`` buffer in a symbolically traced graph)
    qualify.
    """
    if not isinstance(node, fx.Node):
        return None
    if node.op == "get_attr":
        found = _buffer_triangle(node)
        return (found, True) if found else None
    args = node.args
    if is_function(node, torch.tril) or is_method(node, "tril"):
        diagonal = (args[1] if len(args) > 1 else node.kwargs.get("diagonal", 0))
        return (LOWER, False) if diagonal == 0 and _is_ones(args[0]) else None
    if is_function(node, torch.triu) or is_method(node, "triu"):
        diagonal = (args[1] if len(args) > 1 else node.kwargs.get("diagonal", 0))
        return (UPPER, False) if diagonal == 1 and _is_ones(args[0]) else None
    inner = None
    if (is_function(node, operator.eq, torch.eq, operator.ne, torch.ne) or is_method(node, "eq", "ne")) \
            and len(args) == 2 and args[1] == 0 and not isinstance(args[1], bool):
        inner = triangle(args[0])
        flip = node.target in (operator.eq, torch.eq) or method_name(node) == "eq"
        return (_FLIP[inner[0]] if flip else inner[0], inner[1]) if inner else None
    if is_function(node, torch.logical_not, operator.invert) or is_method(node, "logical_not", "__invert__"):
        ev = tensor_value(node)
        inner = triangle(args[0]) if ev is not None and ev.dtype == torch.bool else None
        return (_FLIP[inner[0]], inner[1]) if inner else None
    if is_method(node, *_CASTS, *_VIEWS) or is_function(node, torch.reshape):
        return triangle(args[0]) if _same_last_two(node, args[0]) else None
    if is_function(node, operator.getitem) and _top_left_slice(node):
        return triangle(args[0])
    return None


def call_ancestors(node: fx.Node) -> list[fx.Node]:
    """``node`` and the call nodes it is computed from (a causal mask's tril/ones/slice, a scale's
    sqrt): erased with the pattern once nothing else uses them. In-place calls are never listed:
    erasing one would drop its write."""
    found, stack = [], [node]
    while stack:
        n = stack.pop()
        if isinstance(n, fx.Node) and n.op in ("call_function", "call_method") and n not in found \
                and not any(mutates(n, a) for a in n.all_input_nodes):
            found.append(n)
            stack.extend(n.all_input_nodes)
    return found


# ------------------------------------------------------------------------------------------
# Dtypes and shapes
# ------------------------------------------------------------------------------------------

_SUPPORTED = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def allowed_compute_dtypes(dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """Dtypes a pattern may compute its scores/probabilities in, for inputs of ``dtype``.

    The op computes in fp32 for 16-bit and fp32 inputs and fp64 for fp64 inputs: an upcast to
    fp32 is what it does anyway; anything else (fp64 inputs with an fp32 softmax, fp32 inputs
    with an fp64 softmax) would change the precision the model asked for.
    """
    return (dtype, torch.float32) if dtype in (torch.float16, torch.bfloat16) else (dtype,)


def check_dtypes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chain: Sequence[fx.Node]) -> None:
    if not (q.dtype == k.dtype == v.dtype):
        raise Keep(f"query, key and value dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")
    if q.dtype not in _SUPPORTED:
        raise Keep(f"dtype {q.dtype} is not supported")
    allowed = allowed_compute_dtypes(q.dtype)
    for node in chain:
        ev = tensor_value(node)
        if ev is not None and ev.dtype not in allowed:
            raise Keep(f"{node.name} computes in {ev.dtype} for {q.dtype} inputs; the op would use "
                       f"{torch.float64 if q.dtype == torch.float64 else torch.float32}")


def known_equal(a: Sequence, b: Sequence) -> bool:
    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))


def group_dims(fine: Sequence, coarse: Sequence) -> Optional[list[tuple[int, int]]]:
    """How ``coarse`` batch dims merge consecutive ``fine`` ones (``view`` keeps row-major order):
    for each coarse dim the [start, stop) range of fine dims; None if they do not line up."""
    groups, j = [], 0
    for size in coarse:
        start, product = j, 1
        while j < len(fine) and (j == start or not statically_known_true(product == size)):
            product = product * fine[j]
            j += 1
        if j == start or not statically_known_true(product == size):
            return None
        groups.append((start, j))
    while j < len(fine) and groups and statically_known_true(fine[j] == 1):
        groups[-1] = (groups[-1][0], j + 1)
        j += 1
    return groups if j == len(fine) and (groups or not fine) else None
