"""Pattern family: hand-written attention, ``softmax(q @ kᵀ * scale + mask) @ v``.

Models spell this a hundred ways. Each spelling of one piece is a small ``_pattern_*`` function
below, with the model family it comes from; a site is matched from its softmax outwards:

    Q·Kᵀ product  ->  score steps (scale, masks, casts, views)  ->  softmax
                  ->  probability steps (casts, dropout, views)  ->  P·V product

and becomes one :class:`AttentionSite` in SDPA terms, or a :class:`KeptSite` with the reason it
must stay as written. The checks (who reads an intermediate, constants, causal structure,
dtypes, layouts) live in ``handwritten_checks.py``.

What is folded into the op's arguments:
  * scales on the scores, on q or on k -> ``scale=`` (the op gets the unscaled q and k);
  * additive masks and a baddbmm bias -> a float ``attn_mask`` (it receives a gradient);
  * masked_fill / where with -inf or a large negative constant -> a bool ``attn_mask``, or
    ``is_causal=True`` when the condition is provably the top-left causal triangle;
  * repeat_kv / repeat_interleave / a broadcast K/V head -> ``enable_gqa=True`` with the
    un-repeated K/V;
  * dropout on the probabilities -> ``dropout_p``; fp32 upcasts around the softmax -> nothing
    (the op computes in fp32 anyway).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable, Iterator, Optional, Union

import torch
import torch.fx as fx
import torch.nn.functional as F

from .handwritten_checks import (
    Keep, Scale, allowed_compute_dtypes, bind, check_dtypes, check_only_user, describe, fill_value,
    group_dims, is_function, is_mask_fill, is_method, known_equal, mutates, scalar, tensor_value,
    triangle, triangle_nodes, value_users,
)
from .handwritten_site import MaskTerm, Operand, Plan, make_site
from .site import AttentionSite, KeptSite

_MATMULS = (torch.matmul, operator.matmul, torch.bmm)
_EINSUMS = (torch.einsum, torch.functional.einsum)
_SOFTMAXES = (F.softmax, torch.softmax, torch.Tensor.softmax)
_DROPOUTS = (F.dropout, torch.dropout)
_CAST_METHODS = ("to", "type", "type_as", "float", "half", "double", "bfloat16", "contiguous", "clone")


class _NotAttention(Exception):
    """The softmax is not part of an attention computation: report nothing."""


# ------------------------------------------------------------------------------------------
# The Q·Kᵀ product
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Product:
    """The Q·Kᵀ product, canonicalised: q ``(..., L, E)`` and k ``(..., S, E)`` after the permutes."""

    node: fx.Node
    query: fx.Node
    key: fx.Node
    query_perm: Optional[tuple[int, ...]] = None
    key_perm: Optional[tuple[int, ...]] = None  # for matmul: (..., -1, -2) when k must be transposed
    scale: Scale = Scale()
    bias: Optional[fx.Node] = None
    beta: float = 1.0
    consumed: list = dataclasses.field(default_factory=list)


def _head_dim(node: fx.Node) -> Any:
    ev = tensor_value(node)
    size = ev.shape[-1] if ev is not None and ev.dim() else None
    return size.node.expr if isinstance(size, torch.SymInt) else None


_MULS = (operator.mul, torch.mul, operator.imul)
_DIVS = (operator.truediv, torch.div, torch.true_divide, operator.itruediv)


def _scale_kind(node: Any) -> Optional[tuple[bool, bool]]:
    """(divides, in place) for a mul / div node, else None."""
    if is_function(node, *_MULS, *_DIVS):
        return node.target in _DIVS, node.target in (operator.imul, operator.itruediv)
    if is_method(node, "mul", "mul_", "div", "div_", "true_divide"):
        return node.target in ("div", "div_", "true_divide"), node.target.endswith("_")
    return None


def _scalar_like(value: Any) -> bool:
    ev = value.meta.get("example_value", value.meta.get("val")) if isinstance(value, fx.Node) else None
    return isinstance(ev, (torch.SymInt, torch.SymFloat)) or (isinstance(ev, torch.Tensor) and ev.numel() == 1)


def _scaled_operand(node: Any, head_dim: Any, in_chain: bool = False) -> Optional[tuple[fx.Node, Scale]]:
    """``x * c``, ``c * x``, ``x / c`` with c a compile-time constant: (x, c or 1/c).

    On q and k (``in_chain=False``) an in-place ``q.mul_(c)`` is never peeled: other readers of q
    see the scaled values. In the score chain (``in_chain``) a traced scalar is a reason to keep.
    """
    kind = _scale_kind(node)
    if kind is None or len(node.args) != 2 or node.kwargs or (kind[1] and not in_chain):
        return None
    divide, inplace = kind
    for tensor_at in ((0,) if divide or inplace else (0, 1)):
        x, c = node.args[tensor_at], node.args[1 - tensor_at]
        if not isinstance(x, fx.Node) or not _same_shape(x, node):
            continue
        found = scalar(c, head_dim)
        if found is not None and found.coef != 0:
            return x, (found.inverse() if divide else found)
        if in_chain and _scalar_like(c):
            raise Keep(f"the scale {c.name} at {node.name} is not a compile-time constant")
    return None


def _swaps_last_two(node: Any) -> bool:
    """``k.transpose(-2, -1)``, ``k.transpose(2, 3)``, ``k.mT``, ``k.permute(0, 1, 3, 2)``, ``k.t()``."""
    ev = tensor_value(node.args[0]) if isinstance(node, fx.Node) and node.args else None
    if ev is None or ev.dim() < 2:
        return False
    n = ev.dim()
    if is_method(node, "transpose") or is_function(node, torch.transpose):
        dims = node.args[1:3]
        return len(dims) == 2 and all(isinstance(d, int) for d in dims) and {d % n for d in dims} == {n - 2, n - 1}
    if is_method(node, "permute") or is_function(node, torch.permute):
        dims = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)) else node.args[1:]
        return [d % n for d in dims] == [*range(n - 2), n - 1, n - 2] if all(isinstance(d, int) for d in dims) else False
    if is_function(node, getattr):
        return node.args[1] == "mT"
    return is_method(node, "t") and n == 2


def _peel_query(q: fx.Node, product: _Product, head_dim: Any) -> fx.Node:
    while (found := _scaled_operand(q, head_dim)) is not None:
        product.consumed.append(q)
        q, factor = found
        product.scale = product.scale * factor
    return q


def _matmul_product(node: fx.Node, q: fx.Node, kt: fx.Node) -> _Product:
    """q ``(..., L, E)`` times kᵀ ``(..., E, S)``, with constant scales and transposes peeled."""
    head_dim = _head_dim(q)
    product = _Product(node, q, kt)
    product.query = _peel_query(q, product, head_dim)
    k, swapped = kt, False
    while True:
        if (found := _scaled_operand(k, head_dim)) is not None:
            product.consumed.append(k)
            k, factor = found
            product.scale = product.scale * factor
        elif _swaps_last_two(k):
            product.consumed.append(k)
            k, swapped = k.args[0], not swapped
        else:
            break
    product.key = k
    if not swapped:  # k itself is laid out (..., E, S): the op gets a transposed view
        n = tensor_value(k).dim()
        product.key_perm = (*range(n - 2), n - 1, n - 2)
    return product


def _pattern_qk_1(node: fx.Node) -> Optional[_Product]:
    # GPT-2, nanoGPT, BERT, ViT/timm, HF Llama, T5: q @ k.transpose(-2, -1), torch.matmul;
    # fairseq / BART: torch.bmm(q, k.transpose(1, 2)) on 3-D (B*H, L, E).
    if not (is_function(node, *_MATMULS) or is_method(node, "matmul", "bmm")) or len(node.args) != 2:
        return None
    return _matmul_product(node, *node.args)


def _pattern_qk_2(node: fx.Node) -> Optional[_Product]:
    # Bloom: alibi.baddbmm(batch1=q, batch2=kᵀ, beta=1.0, alpha=1/sqrt(d)), the ALiBi bias added by
    # the matmul itself; GPT-NeoX: baddbmm(zeros, q, kᵀ, beta=1.0, alpha=norm_factor).
    if not (is_function(node, torch.baddbmm) or is_method(node, "baddbmm")):
        return None
    args = bind(node, ("input", "batch1", "batch2"), dict(beta=1, alpha=1))
    if not all(isinstance(args[a], (int, float)) for a in ("beta", "alpha")):
        raise Keep("baddbmm's beta/alpha are traced values, not constants")
    product = _matmul_product(node, args["batch1"], args["batch2"])
    product.scale = product.scale * Scale(float(args["alpha"]))
    bias = args["input"]
    zeros = is_function(bias, torch.zeros, torch.zeros_like) or is_method(bias, "new_zeros")
    # beta == 0 ignores the input entirely (even its NaNs), as baddbmm documents.
    if args["beta"] != 0 and not zeros:
        product.bias, product.beta = bias, float(args["beta"])
    elif isinstance(bias, fx.Node):
        product.consumed.append(bias)
    return product


def _einsum_terms(node: fx.Node) -> Optional[tuple[str, str, str, fx.Node, fx.Node]]:
    args = node.args
    operands = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
    if not isinstance(args[0], str) or len(operands) != 2 or "->" not in args[0] or "." in args[0]:
        return None
    inputs, out = args[0].replace(" ", "").split("->")
    a, b = inputs.split(",") if inputs.count(",") == 1 else ("", "")
    if not (a and b) or any(len(set(t)) != len(t) for t in (a, b, out)):
        return None
    return a, b, out, operands[0], operands[1]


def _pattern_qk_3(node: fx.Node) -> Optional[_Product]:
    # Perceiver / lucidrains: einsum('b h i d, b h j d -> b h i j', q, k); guided-diffusion
    # QKVAttention: einsum('bct,bcs->bts', q * scale, k * scale) with the scale split over q and k.
    if not is_function(node, *_EINSUMS) or (terms := _einsum_terms(node)) is None:
        return None
    a, b, out, q, k = terms
    contracted = set(a) & set(b) - set(out)
    if len(out) < 2 or len(contracted) != 1:
        raise Keep(f"einsum '{node.args[0]}' is not a Q·Kᵀ product over one head dim")
    (e,), length, keys, batch = contracted, out[-2], out[-1], out[:-2]
    if sorted(a) != sorted(batch + length + e) or sorted(b) != sorted(batch + keys + e):
        raise Keep(f"einsum '{node.args[0]}': query and key do not share the batch letters of the scores")
    product = _Product(node, q, k)
    head_dim = _head_dim(q) if a[-1] == e else None
    product.query = _peel_query(q, product, head_dim)
    product.key = _peel_query(k, product, head_dim)
    query_perm = tuple(a.index(c) for c in batch + length + e)
    key_perm = tuple(b.index(c) for c in batch + keys + e)
    product.query_perm = None if query_perm == tuple(range(len(a))) else query_perm
    product.key_perm = None if key_perm == tuple(range(len(b))) else key_perm
    return product


_QK_PATTERNS = (_pattern_qk_1, _pattern_qk_2, _pattern_qk_3)


def _is_product(node: Any) -> bool:
    return (is_function(node, *_MATMULS, torch.baddbmm, *_EINSUMS)
            or is_method(node, "matmul", "bmm", "baddbmm"))


# ------------------------------------------------------------------------------------------
# Score steps, between the product and the softmax
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Step:
    kind: str  # "scale" | "add" | "fill" | "cast" | "view"
    node: fx.Node
    input: fx.Node
    scale: Scale = Scale()
    mask: Optional[fx.Node] = None  # add: the additive tensor; fill: the condition
    attend_if: bool = False  # fill: keys are visible where cond == attend_if
    value: float = 0.0  # fill: the fill value
    extra: tuple = ()  # constant-building nodes erased with the pattern once unused


def _same_shape(a: Any, b: Any) -> bool:
    ta, tb = tensor_value(a), tensor_value(b)
    return ta is not None and tb is not None and known_equal(ta.shape, tb.shape)


def _pattern_scale_1(node: fx.Node, head_dim: Any) -> Optional[_Step]:
    # Every family: scores * (1.0 / math.sqrt(d)) (nanoGPT), scores / math.sqrt(d) (BERT),
    # HF GPT-2's scores / torch.full([], d ** 0.5), in-place scores *= scale.
    if (found := _scaled_operand(node, head_dim, in_chain=True)) is None:
        return None
    x, factor = found
    return _Step("scale", node, x, scale=factor, extra=tuple(a for a in node.args if a is not x))


def _reaches_product(node: Any, depth: int = 8) -> bool:
    frontier = [node]
    for _ in range(depth):
        frontier = [a for n in frontier if isinstance(n, fx.Node) for a in n.all_input_nodes]
        if any(_is_product(n) for n in frontier):
            return True
    return False


def _pattern_mask_1(node: fx.Node, head_dim: Any) -> Optional[_Step]:
    # BERT / HF Llama: scores + attention_mask (additive, finfo.min or -inf); T5: scores +=
    # position_bias, which must receive its gradient (a float attn_mask does).
    inplace = is_function(node, operator.iadd) or is_method(node, "add_")
    if not (inplace or is_function(node, operator.add, torch.add) or is_method(node, "add")):
        return None
    args = bind(node, ("input", "other"), dict(alpha=1))
    if args["alpha"] != 1 or len(node.args) != 2 or not all(isinstance(a, fx.Node) for a in node.args):
        return None
    candidates = (0,) if inplace else (0, 1)  # in place, the mutated operand must be the scores
    for i in candidates:
        scores, mask = node.args[i], node.args[1 - i]
        if _is_product(scores) or _reaches_product(scores) or len(candidates) == 1:
            if not _same_shape(scores, node):
                raise Keep(f"the mask {mask.name} broadcasts the scores to a larger shape")
            return _Step("add", node, scores, mask=mask)
    return None


def _fill_step(node: fx.Node, scores: fx.Node, cond: Any, fill: Any, attend_if: bool) -> _Step:
    value = fill_value(fill)
    if value is None:
        raise Keep(f"the fill value of {node.name} is not a compile-time constant")
    if not is_mask_fill(value):
        raise Keep(f"{node.name} fills with {value}, which does not hide keys")
    ev = tensor_value(cond)
    if ev is None or ev.dtype != torch.bool:
        raise Keep(f"the condition of {node.name} is not a bool tensor")
    if not _same_shape(scores, node):
        raise Keep(f"the condition of {node.name} broadcasts the scores to a larger shape")
    return _Step("fill", node, scores, mask=cond, attend_if=attend_if, value=value,
                 extra=(fill,) if isinstance(fill, fx.Node) else ())


def _pattern_mask_2(node: fx.Node, head_dim: Any) -> Optional[_Step]:
    # nanoGPT: scores.masked_fill(self.bias[:, :, :T, :T] == 0, float('-inf')); Bloom:
    # masked_fill(mask, finfo.min); the annotated transformer: masked_fill(mask == 0, -1e9).
    if not (is_method(node, "masked_fill", "masked_fill_") or is_function(node, torch.masked_fill)):
        return None
    args = bind(node, ("input", "mask", "value"), {})
    return _fill_step(node, args["input"], args["mask"], args.get("value"), attend_if=False)


def _pattern_mask_3(node: fx.Node, head_dim: Any) -> Optional[_Step]:
    # HF GPT-2: torch.where(causal_mask, attn_weights, torch.full([], finfo.min)).
    if is_method(node, "where") and len(node.args) == 3:
        cond, kept, other = node.args[1], node.args[0], node.args[2]
    elif is_function(node, torch.where) and len(node.args) == 3:
        cond, kept, other = node.args
    else:
        return None
    if fill_value(other) is not None or not isinstance(other, fx.Node):
        return _fill_step(node, kept, cond, other, attend_if=True)
    if fill_value(kept) is not None or not isinstance(kept, fx.Node):
        return _fill_step(node, other, cond, kept, attend_if=False)
    raise Keep(f"{node.name} selects between two tensors, not between scores and a fill value")


def _pattern_view_1(node: fx.Node, head_dim: Any = None) -> Optional[_Step]:
    # Bloom, fairseq: (B*H, L, S) scores viewed as (B, H, L, S) to add a per-batch mask, and back.
    if not (is_method(node, "view", "reshape") or is_function(node, torch.reshape)):
        return None
    before, after = tensor_value(node.args[0]), tensor_value(node)
    if before is None or after is None or before.dim() < 2 or after.dim() < 2 \
            or not known_equal(before.shape[-2:], after.shape[-2:]):
        return None
    return _Step("view", node, node.args[0])


def _pattern_cast_1(node: fx.Node, head_dim: Any = None) -> Optional[_Step]:
    # T5: softmax(scores.float()).type_as(scores); HF Llama / Bloom: softmax(..., dtype=float32)
    # .to(query.dtype); guided-diffusion: .type(weight.dtype). The op computes in fp32 anyway.
    if not is_method(node, *_CAST_METHODS) or not node.args:
        return None
    before, after = tensor_value(node.args[0]), tensor_value(node)
    if before is None or after is None or before.shape != after.shape or before.device != after.device:
        return None
    return _Step("cast", node, node.args[0])


_SCORE_PATTERNS = (_pattern_scale_1, _pattern_mask_1, _pattern_mask_2, _pattern_mask_3,
                   _pattern_view_1, _pattern_cast_1)


# ------------------------------------------------------------------------------------------
# Softmax, probability steps, the P·V product
# ------------------------------------------------------------------------------------------


def _pattern_softmax_1(node: Any) -> Optional[tuple[fx.Node, Any]]:
    # F.softmax(x, dim=-1) (BERT, nanoGPT), nn.Softmax(dim=-1) (many), x.softmax(dim=-1) (timm),
    # torch.softmax(x, -1, dtype=torch.float32) (HF Llama, Bloom). Returns (input, dim).
    if is_function(node, *_SOFTMAXES) or is_method(node, "softmax"):
        args = bind(node, ("input", "dim"), dict(dim=None))
        return args["input"], args["dim"]
    return None


def _pattern_dropout_1(node: fx.Node) -> Optional[float]:
    # Every family: nn.Dropout on the probabilities (inlined to F.dropout(x, p, self.training)),
    # HF Llama's F.dropout(w, p=dropout, training=module.training). Returns the effective p.
    if is_function(node, F.dropout):
        args = bind(node, ("input", "p", "training", "inplace"), dict(p=0.5, training=True))
    elif is_function(node, torch.dropout):
        args = bind(node, ("input", "p", "training"), {})
    else:
        return None
    training, p = args.get("training"), args.get("p")
    if training is False:
        return 0.0
    if training is not True:
        raise Keep(f"dropout's training flag at {node.name} is a traced value")
    if not isinstance(p, (int, float)) or isinstance(p, bool):
        raise Keep(f"the dropout probability at {node.name} is not a compile-time constant")
    if not 0.0 <= p < 1.0:
        raise Keep(f"dropout probability {p} at {node.name} is outside [0, 1)")
    return float(p)


def _pattern_pv_1(node: fx.Node, probs: fx.Node) -> Optional[tuple[fx.Node, Optional[tuple], Optional[tuple]]]:
    # Every family: probs @ v, torch.matmul(probs, v); fairseq / Bloom: torch.bmm(probs, v).
    if (is_function(node, *_MATMULS) or is_method(node, "matmul", "bmm")) and len(node.args) == 2 \
            and node.args[0] is probs and node.args[1] is not probs:
        return node.args[1], None, None
    return None


def _pattern_pv_2(node: fx.Node, probs: fx.Node) -> Optional[tuple[fx.Node, Optional[tuple], Optional[tuple]]]:
    # Perceiver / lucidrains: einsum('b h i j, b h j d -> b h i d'); guided-diffusion:
    # einsum('bts,bcs->bct', weight, v). Returns (v, v permute to (..., S, Ev), output permute).
    if not is_function(node, *_EINSUMS) or (terms := _einsum_terms(node)) is None or terms[3] is not probs:
        return None
    p, v_letters, out, _, v = terms
    batch, length, keys = p[:-2], p[-2], p[-1]
    features = set(v_letters) - set(p)
    if len(features) != 1 or sorted(v_letters) != sorted(batch + keys + "".join(features)) \
            or sorted(out) != sorted(batch + length + "".join(features)):
        raise Keep(f"einsum '{node.args[0]}' is not a P·V product over the keys of the probabilities")
    (d,) = features
    v_perm = tuple(v_letters.index(c) for c in batch + keys + d)
    out_perm = tuple((batch + length + d).index(c) for c in out)
    identity = tuple(range(len(out)))
    return v, (None if v_perm == identity else v_perm), (None if out_perm == identity else out_perm)


# ------------------------------------------------------------------------------------------
# Grouped-query K/V
# ------------------------------------------------------------------------------------------


def _pattern_gqa_1(node: Any) -> Optional[tuple[fx.Node, int, list]]:
    # HF Llama / Mistral / Qwen repeat_kv: x[:, :, None, :, :].expand(b, h, n_rep, s, d)
    # .reshape(b, h * n_rep, s, d). Head h of the result is head h // n_rep of x, as enable_gqa.
    if not (is_method(node, "reshape", "view") or is_function(node, torch.reshape)):
        return None
    expand = node.args[0]
    if not is_method(expand, "expand") or not is_function(expand.args[0], operator.getitem):
        return None
    index = expand.args[0].args[1]
    x = expand.args[0].args[0]
    full = slice(None)
    if not isinstance(index, tuple) or list(index[:3]) != [full, full, None] \
            or any(i != full for i in index[3:]) and index[3:] != (Ellipsis,):
        return None
    xs, es, rs = (tensor_value(n) for n in (x, expand, node))
    if any(t is None for t in (xs, es, rs)) or xs.dim() != 4 or es.dim() != 5:
        return None
    n_rep = es.shape[2]
    if not (known_equal(es.shape[:2], xs.shape[:2]) and known_equal(es.shape[3:], xs.shape[2:])
            and known_equal(rs.shape, (xs.shape[0], xs.shape[1] * n_rep, *xs.shape[2:]))):
        return None
    return x, n_rep, [expand.args[0], expand, node]


def _pattern_gqa_2(node: Any) -> Optional[tuple[fx.Node, int, list]]:
    # Falcon, Gemma, many GQA ports: k.repeat_interleave(n_rep, dim=1).
    if not (is_method(node, "repeat_interleave") or is_function(node, torch.repeat_interleave)):
        return None
    args = bind(node, ("input", "repeats", "dim"), dict(dim=None))
    ev = tensor_value(args["input"])
    if ev is None or ev.dim() != 4 or not isinstance(args["repeats"], int) or args["dim"] not in (1, -3):
        return None
    return args["input"], args["repeats"], [node]


def _peel_repeats(node: fx.Node) -> tuple[fx.Node, int, list]:
    for pattern in (_pattern_gqa_1, _pattern_gqa_2):
        if (found := pattern(node)) is not None:
            return found
    return node, 1, []


# ------------------------------------------------------------------------------------------
# Causal masks
# ------------------------------------------------------------------------------------------


def _pattern_causal_1(step: _Step, scores: torch.Tensor) -> Optional[bool]:
    # minGPT: torch.tril(torch.ones(T, T)).view(1, 1, T, T) built in forward; nanoGPT / HF GPT-2:
    # the `bias` buffer sliced to [:, :, :T, :T] (a get_attr constant, e.g. in a symbolically
    # traced graph; dynamo lifts buffers to inputs, whose values are unknown: a plain bool mask).
    # Returns from_buffer when the fill hides exactly the keys j > i (top-left causal).
    found = triangle(step.mask)
    cond = tensor_value(step.mask)
    if found is None or cond is None or not known_equal(cond.shape[-2:], scores.shape[-2:]):
        return None
    hides_upper = (found[0] == "upper") != step.attend_if
    return found[1] if hides_upper else None


# ------------------------------------------------------------------------------------------
# Matching a site
# ------------------------------------------------------------------------------------------


def _leads_to_pv(node: fx.Node, depth: int = 4) -> bool:
    frontier = [node]
    for _ in range(depth):
        nxt = []
        for n in frontier:
            for user in n.users:
                if _pattern_pv_1(user, n) or (is_function(user, *_EINSUMS) and n in user.args[1:]):
                    return True
                nxt.append(user)
        frontier = nxt
    return False


def _walk_scores(start: fx.Node, softmax: fx.Node, head_dim: Any) -> tuple[_Product, list[_Step]]:
    steps, node, user = [], start, softmax
    while True:
        check_only_user(node, user, "attention scores")
        for pattern in _QK_PATTERNS:
            if (product := pattern(node)) is not None:
                return product, steps[::-1]
        step = next((s for p in _SCORE_PATTERNS if (s := p(node, head_dim)) is not None), None)
        if step is None:
            raise Keep(f"{describe(node)} at {node.name} between the Q·Kᵀ product and the softmax "
                       "is not a supported step")
        steps.append(step)
        node, user = step.input, node


def _walk_probs(softmax: fx.Node) -> tuple[list[fx.Node], float, fx.Node, tuple]:
    nodes, dropout_p, node = [], 0.0, softmax
    while True:
        users = value_users(node)
        if len(users) != 1:
            raise Keep(f"the attention probabilities ({node.name}) are also used by "
                       f"{', '.join(u.name for u in users[:3])} (e.g. returned as attention weights)")
        (user,) = users
        for pattern in (_pattern_pv_1, _pattern_pv_2):
            if (found := pattern(user, node)) is not None:
                return nodes, dropout_p, user, found
        p = _pattern_dropout_1(user) if user.args and user.args[0] is node else None
        if p is not None:
            dropout_p = 1 - (1 - dropout_p) * (1 - p) if dropout_p else p
        elif not (_pattern_cast_1(user) or _pattern_view_1(user)) or user.args[0] is not node:
            raise Keep(f"the probabilities go through {describe(user)} at {user.name} before the P·V product")
        nodes.append(user)
        node = user


def _first_product(node: fx.Node, depth: int = 8) -> Optional[fx.Node]:
    frontier = [node]
    for _ in range(depth + 1):
        if (found := next((n for n in frontier if _is_product(n)), None)) is not None:
            return found
        frontier = [a for n in frontier for a in n.all_input_nodes]
    return None


def _product_head_dim(product: fx.Node) -> Any:
    """The symbolic head dim E of a Q·Kᵀ product (for scales like 1 / sym_sqrt(E)), else None."""
    if is_function(product, *_EINSUMS):
        terms = _einsum_terms(product)
        if terms is None or len(set(terms[0]) & set(terms[1]) - set(terms[2])) != 1:
            return None
        (e,) = set(terms[0]) & set(terms[1]) - set(terms[2])
        size = tensor_value(terms[3]).shape[terms[0].index(e)]
        return size.node.expr if isinstance(size, torch.SymInt) else None
    if is_function(product, torch.baddbmm) or is_method(product, "baddbmm"):
        return _head_dim(bind(product, ("input", "batch1", "batch2"), {})["batch1"])
    return _head_dim(product.args[0])


def _match_site(softmax: fx.Node, context: "_Context") -> Union[AttentionSite, KeptSite, None]:
    scores_input, dim = _pattern_softmax_1(softmax)
    # Only a softmax between a product and a product is attention; any other softmax (a
    # classifier's, gumbel-softmax) is not ours to report.
    product = _first_product(scores_input) if isinstance(scores_input, fx.Node) else None
    if product is None or not _leads_to_pv(softmax):
        return None
    try:
        ev = tensor_value(scores_input)
        if not isinstance(dim, int) or ev is None or dim % max(ev.dim(), 1) != ev.dim() - 1:
            raise Keep(f"the softmax at {softmax.name} is over dim {dim}, not the last (key) dim")
        head_dim = _product_head_dim(product)
        qk, steps = _walk_scores(scores_input, softmax, head_dim)
        probs, dropout_p, pv, pv_found = _walk_probs(softmax)
        return _assemble(qk, steps, softmax, probs, dropout_p, pv, pv_found, context)
    except Keep as keep:
        return KeptSite("handwritten", softmax, str(keep))


def _permuted(shape: tuple, perm: Optional[tuple]) -> tuple:
    return tuple(shape) if perm is None else tuple(shape[i] for i in perm)


def _keeps_heads(perm: Optional[tuple]) -> bool:
    return perm is None or tuple(perm[:2]) == (0, 1)


def _operands(qk: _Product, value: fx.Node, v_perm: Optional[tuple]):
    """q, k, v as (node, canonical shape) with repeat_kv / repeat_interleave peeled off K and V
    when both repeat the same heads; returns the repeat factor and the repeat nodes."""
    key, value_src = qk.key, value
    k_src, k_rep, k_nodes = _peel_repeats(key) if _keeps_heads(qk.key_perm) else (key, 1, [])
    v_src, v_rep, v_nodes = _peel_repeats(value) if _keeps_heads(v_perm) else (value, 1, [])
    if (k_rep, v_rep) != (1, 1):
        k_heads, v_heads = tensor_value(k_src).shape[1], tensor_value(v_src).shape[1]
        if k_rep == v_rep and known_equal([k_heads], [v_heads]):
            key, value_src = k_src, v_src
        else:
            k_rep, k_nodes, v_nodes = 1, [], []
    shapes = [_permuted(tensor_value(n).shape, p) for n, p in
              ((qk.query, qk.query_perm), (key, qk.key_perm), (value_src, v_perm))]
    return key, value_src, shapes, k_rep, k_nodes + v_nodes


def _heads_line_up(kv: tuple, batch: tuple, repeats: int) -> Optional[bool]:
    """None if ``kv`` batch dims do not line up with ``batch``; else whether they are grouped
    (GQA: fewer heads in dim -3, repeated by ``repeats`` or broadcast from 1)."""
    if known_equal(kv, batch):
        return False
    if len(batch) >= 2 and known_equal(kv[:-1], batch[:-1]) and (
            known_equal([kv[-1]], [1]) or (repeats > 1 and known_equal([kv[-1] * repeats], [batch[-1]]))):
        return True
    return None


def _dynamic_sizes(fine: tuple, groups: list, views: list) -> list:
    """The op layout's sizes for unflatten: ints, one None (-1) per group, or the size arguments
    of a view in the pattern that produced that layout (Bloom's view(batch_size, num_heads, ...))."""
    sizes = [s if isinstance(s, int) else None for s in fine]
    for view in views:
        ev = tensor_value(view)
        if ev is not None and known_equal(ev.shape[:-2], fine):
            given = view.args[1] if len(view.args) == 2 and isinstance(view.args[1], (tuple, list)) else view.args[1:]
            sizes = [s if s is not None else (g if isinstance(g, (fx.Node, int)) and g != -1 else None)
                     for s, g in zip(sizes, given)]
            break
    for start, stop in groups:
        if stop - start > 1 and sum(s is None for s in sizes[start:stop]) > 1:
            raise Keep("the batch dims of the reshaped scores are dynamic and cannot be rebuilt")
    return sizes


def _check_not_mutated(node: fx.Node, read: fx.Node, pv: fx.Node, order: dict) -> None:
    for user in node.users:
        if mutates(user, node) and order.get(read, -1) < order.get(user, -1) < order[pv]:
            raise Keep(f"{node.name} is modified in place by {user.name} before the P·V product reads it")


def _assemble(qk: _Product, steps: list, softmax: fx.Node, probs: list, dropout_p: float, pv: fx.Node,
              pv_found: tuple, context: "_Context") -> AttentionSite:
    value, v_perm, out_perm = pv_found
    key, value, (q_shape, k_shape, v_shape), repeats, repeat_nodes = _operands(qk, value, v_perm)
    scores = tensor_value(qk.node).shape
    p_in = probs[-1] if probs else softmax
    prob_shape = tensor_value(p_in).shape
    q_ev, k_ev, v_ev = (tensor_value(n) for n in (qk.query, key, value))
    check_dtypes(q_ev, k_ev, v_ev, [qk.node, *(s.node for s in steps), softmax, *probs])
    if tensor_value(pv).dtype != q_ev.dtype:
        raise Keep(f"the P·V product returns {tensor_value(pv).dtype} for {q_ev.dtype} inputs")
    if not known_equal(q_shape[:-2], scores[:-2]):
        raise Keep(f"query batch dims {tuple(q_shape[:-2])} do not line up with the scores {tuple(scores[:-2])}")
    k_grouped = _heads_line_up(k_shape[:-2], tuple(scores[:-2]), repeats)
    v_grouped = _heads_line_up(v_shape[:-2], tuple(prob_shape[:-2]), repeats)
    if k_grouped is None or v_grouped is None or k_grouped != v_grouped \
            or (k_grouped and not known_equal(k_shape[:-2], v_shape[:-2])):
        raise Keep(f"key/value batch dims {tuple(k_shape[:-2])}, {tuple(v_shape[:-2])} do not line up with "
                   f"the query's {tuple(q_shape[:-2])} (e.g. k transposed on the wrong dims)")

    # The op layout: the finest batch layout the scores take between the two products.
    levels = [(qk.node, scores[:-2]), (p_in, prob_shape[:-2])]
    levels += [(s.node, tensor_value(s.node).shape[:-2]) for s in steps if s.kind in ("add", "fill")]
    fine = max((level for _, level in levels), key=len)
    if k_grouped and any(not known_equal(level, fine) for _, level in levels):
        raise Keep("grouped K/V heads with reshaped scores are not supported")

    def groups_of(level):
        found = group_dims(fine, level)
        if found is None:
            raise Keep(f"the views of the scores {tuple(level)} and {tuple(fine)} do not line up")
        return found

    q_groups, out_groups = groups_of(scores[:-2]), groups_of(prob_shape[:-2])
    masks, causal, finite, fills, scale, masked = [], [], [], 0, qk.scale, False
    if qk.bias is not None:
        masks.append(MaskTerm(qk.bias, False, tuple(tensor_value(qk.bias).shape), q_groups, factor=qk.beta))
        masked = True
    for step in steps:
        if step.kind == "scale":
            if masked:
                raise Keep(f"the scores are scaled at {step.node.name} after a mask was applied")
            scale = scale * step.scale
        elif step.kind in ("add", "fill"):
            masked = True
            at = tensor_value(step.node)
            mask_ev = tensor_value(step.mask)
            if step.kind == "add" and (mask_ev is None or not mask_ev.is_floating_point()):
                raise Keep(f"the additive mask {step.mask.name} has dtype "
                           f"{mask_ev.dtype if mask_ev is not None else 'unknown'}, not a float dtype")
            term = MaskTerm(step.mask, step.kind == "fill", tuple(mask_ev.shape), groups_of(at.shape[:-2]),
                            attend_if=step.attend_if)
            masks.append(term)
            if step.kind == "fill":
                fills += 1
                finite.append(step.value != float("-inf"))
                found = _pattern_causal_1(step, at)
                causal.append((term, found))
    for term in masks:
        _check_not_mutated(term.node, qk.node, pv, context.order)
    for node in (qk.query, key):
        _check_not_mutated(node, qk.node, pv, context.order)

    is_causal = bool(causal) and len(causal) == len(masks) and all(f is not None for _, f in causal)
    if any(finite) and len(masks) > 1:
        raise Keep("a finite fill (finfo.min) combined with other masks would change rows that all of them hide")
    row_fixup = any(finite) and not is_causal
    if row_fixup and dropout_p > 0:
        raise Keep("a finite fill (finfo.min) with dropout: rows it hides entirely are dropped in eager")
    extra = [a for s in steps for a in s.extra if isinstance(a, fx.Node)]
    if is_causal:
        extra += [term.node for term, _ in causal]
        masks = []
    views = [s.node for s in steps if s.kind == "view"] + [n for n in probs if _pattern_view_1(n)]
    sizes = _dynamic_sizes(fine, [g for m in masks for g in m.groups] + q_groups + out_groups, views)

    consumed = {*qk.consumed, qk.node, *repeat_nodes, *(s.node for s in steps), softmax, *probs}
    for node in extra:
        consumed.update(triangle_nodes(node))
    plan = Plan(
        pattern=_pattern_name(qk, steps, is_causal, causal, k_grouped, masks),
        output=pv, query=Operand(qk.query, qk.query_perm, q_shape, q_groups),
        key=Operand(key, qk.key_perm, k_shape, q_groups), value=Operand(value, v_perm, v_shape, out_groups),
        masks=masks, is_causal=is_causal, scale=scale.as_argument(), dropout_p=dropout_p,
        enable_gqa=bool(k_grouped), gqa_repeats=repeats, sizes=sizes, out_groups=out_groups,
        out_perm=out_perm, row_fixup=row_fixup,
        consumed=sorted(consumed, key=lambda n: context.order.get(n, -1)),
        resolve=context.resolve, replaced=context.replaced,
    )
    return make_site(plan)


def _pattern_name(qk: _Product, steps: list, is_causal: bool, causal: list, grouped: bool, masks: list) -> str:
    """The counter / report name: the site's most distinctive feature."""
    if is_causal:
        return "handwritten_causal_buffer" if any(f for _, f in causal) else "handwritten_causal_tril"
    if qk.bias is not None:
        return "handwritten_alibi"
    if grouped:
        return "handwritten_gqa"
    if any(m.is_bool for m in masks):
        return "handwritten_bool_mask"
    if masks:
        return "handwritten_additive_mask"
    if is_function(qk.node, *_EINSUMS):
        return "handwritten_einsum"
    return "handwritten_plain"


@dataclasses.dataclass
class _Context:
    """Per-graph state: node order (to sort erasures) and what earlier sites replaced."""

    order: dict
    replaced: dict = dataclasses.field(default_factory=dict)

    def resolve(self, node: Any) -> Any:
        while isinstance(node, fx.Node) and node in self.replaced:
            node = self.replaced[node]
        return node


def find_sites(graph: fx.Graph) -> Iterator[Union[AttentionSite, KeptSite]]:
    context = _Context({n: i for i, n in enumerate(graph.nodes)})
    for node in list(graph.nodes):
        if _pattern_softmax_1(node) is not None:
            found = _match_site(node, context)
            if found is not None:
                yield found
