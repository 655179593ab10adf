"""Pattern family: hand-written attention, ``softmax(q @ kᵀ * scale + mask) @ v``.

Models spell this a hundred ways. Each spelling of one piece is a small ``_pattern_*`` function
below, with the model family it comes from; a site is matched from its softmax outwards:

    Q·Kᵀ product  ->  score steps (scale, masks, casts, views)  ->  softmax
                  ->  probability steps (casts, dropout, views)  ->  P·V product

and becomes one :class:`AttentionSite` in SDPA terms, or a :class:`KeptSite` with the reason it
must stay as written. The checks (who reads an intermediate, constants, causal structure,
dtypes, layouts) live in ``fx_match.py``; turning a match into the op call (masks,
layouts, prologue/epilogue) in ``handwritten_site.py``.

What is folded into the op's arguments:
  * scales on the scores, on q or on k -> ``scale=`` (the op gets the unscaled q and k);
  * additive masks and a baddbmm bias -> a float ``attn_mask`` (it receives a gradient);
  * masked_fill / where with -inf or a large negative constant -> a bool ``attn_mask``, or
    ``is_causal=True`` when the condition is provably the top-left causal triangle;
  * repeat_kv / repeat_interleave / a broadcast K/V head -> ``enable_gqa=True`` with the
    un-repeated K/V;
  * dropout on the probabilities -> ``dropout_p``; fp32 upcasts around the softmax -> nothing
    (the op computes in fp32 anyway);
  * ``cap * tanh(scores / cap)`` before the masks -> ``softcap=cap`` (``softcap.py``);
  * a per-head sink column concatenated to the scores and dropped from the probabilities ->
    ``sinks=`` (``sinks.py``), and a row-max shift of the softmax input -> nothing;
  * HF's packed-batch mask, causal AND the same sequence id -> the varlen op (``packed.py``).
"""

from __future__ import annotations

import operator
from typing import Any, Iterator, Optional, Union

import torch
import torch.fx as fx
import torch.nn.functional as F

from .gqa import peel_repeats
from .fx_match import (
    Keep, Scale, bind, check_only_user, describe, fill_value, is_function, is_mask_fill, is_method, method_name,
    known_equal, scalar, tensor_value, triangle, value_users,
)
from .handwritten_site import Context, Match, Product, Step, assemble
from .site import AttentionSite, KeptSite, guarded
from .sinks import pattern_sink_shift, pattern_sinks, drops_sink_column, read_sinks
from .softcap import pattern_softcap, read_softcap

_MATMULS = (torch.matmul, operator.matmul, torch.bmm)
_EINSUMS = (torch.einsum, torch.functional.einsum)
_SOFTMAXES = (F.softmax, torch.softmax, torch.Tensor.softmax)
_CAST_METHODS = ("to", "type", "type_as", "float", "half", "double", "bfloat16", "contiguous", "clone")


# ------------------------------------------------------------------------------------------
# The Q·Kᵀ product
# ------------------------------------------------------------------------------------------


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
        name = method_name(node)
        return name in ("div", "div_", "true_divide"), name.endswith("_")
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
        return all(isinstance(d, int) for d in dims) and [d % n for d in dims] == [*range(n - 2), n - 1, n - 2]
    if is_function(node, getattr):
        return node.args[1] == "mT"
    return is_method(node, "t") and n == 2


def _peel_query(q: fx.Node, product: Product, head_dim: Any) -> fx.Node:
    while (found := _scaled_operand(q, head_dim)) is not None:
        product.consumed.append(q)
        q, factor = found
        product.scale = product.scale * factor
    return q


def _matmul_product(node: fx.Node, q: fx.Node, kt: fx.Node) -> Product:
    """q ``(..., L, E)`` times kᵀ ``(..., E, S)``, with constant scales and transposes peeled."""
    head_dim = _head_dim(q)
    product = Product(node, q, kt)
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


def _pattern_qk_1(node: fx.Node) -> Optional[Product]:
    # GPT-2, nanoGPT, BERT, ViT/timm, HF Llama, T5: q @ k.transpose(-2, -1), torch.matmul;
    # fairseq / BART: torch.bmm(q, k.transpose(1, 2)) on 3-D (B*H, L, E).
    if not (is_function(node, *_MATMULS) or is_method(node, "matmul", "bmm")) or len(node.args) != 2:
        return None
    return _matmul_product(node, *node.args)


def _pattern_qk_2(node: fx.Node) -> Optional[Product]:
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


def _pattern_qk_3(node: fx.Node) -> Optional[Product]:
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
    product = Product(node, q, k)
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


def _same_shape(a: Any, b: Any) -> bool:
    ta, tb = tensor_value(a), tensor_value(b)
    return ta is not None and tb is not None and known_equal(ta.shape, tb.shape)


def _pattern_scale_1(node: fx.Node, head_dim: Any) -> Optional[Step]:
    # Every family: scores * (1.0 / math.sqrt(d)) (nanoGPT), scores / math.sqrt(d) (BERT),
    # HF GPT-2's scores / torch.full([], d ** 0.5), in-place scores *= scale.
    if (found := _scaled_operand(node, head_dim, in_chain=True)) is None:
        return None
    x, factor = found
    return Step("scale", node, x, scale=factor, extra=tuple(a for a in node.args if a is not x))


def _reaches_product(node: Any, depth: int = 8) -> bool:
    frontier = [node]
    for _ in range(depth):
        frontier = [a for n in frontier if isinstance(n, fx.Node) for a in n.all_input_nodes]
        if any(_is_product(n) for n in frontier):
            return True
    return False


def _two_tensor_op(node: fx.Node, inplace_function, functions: tuple, method: str) -> Optional[bool]:
    """For ``node`` an add or a sub (``method``) of two graph tensors with alpha 1: whether it is the
    in-place form (``inplace_function``, ``method_``). None for any other node."""
    inplace = is_function(node, inplace_function) or is_method(node, method + "_")
    if not (inplace or is_function(node, *functions) or is_method(node, method)):
        return None
    args = bind(node, ("input", "other"), dict(alpha=1))
    if args["alpha"] != 1 or len(node.args) != 2 or not all(isinstance(a, fx.Node) for a in node.args):
        return None
    return inplace


def _pattern_mask_1(node: fx.Node, head_dim: Any) -> Optional[Step]:
    # BERT / HF Llama: scores + attention_mask (additive, finfo.min or -inf); T5: scores +=
    # position_bias, which must receive its gradient (a float attn_mask does); Falcon (ALiBi):
    # scores + alibi.view(...), before its scale.
    inplace = _two_tensor_op(node, operator.iadd, (operator.add, torch.add), "add")
    if inplace is None:
        return None
    candidates = (0,) if inplace else (0, 1)  # in place, the mutated operand must be the scores
    for i in candidates:
        scores, mask = node.args[i], node.args[1 - i]
        if _is_product(scores) or _reaches_product(scores) or len(candidates) == 1:
            if not _same_shape(scores, node):
                raise Keep(f"the mask {mask.name} broadcasts the scores to a larger shape")
            return Step("add", node, scores, mask=mask)
    return None


def _pattern_mask_4(node: fx.Node, head_dim: Any) -> Optional[Step]:
    # Older BERT ports, GPT-J style: scores - 10000.0 * (1 - mask), a bias subtracted from the
    # scores: an additive mask with factor -1 (exact: negation rounds nothing).
    if _two_tensor_op(node, operator.isub, (operator.sub, torch.sub), "sub") is None:
        return None
    scores, mask = node.args
    if not (_is_product(scores) or _reaches_product(scores)):
        return None  # bias - scores negates the scores: not a supported step
    if not _same_shape(scores, node):
        raise Keep(f"the mask {mask.name} broadcasts the scores to a larger shape")
    return Step("add", node, scores, mask=mask, factor=-1.0)


def _fill_step(node: fx.Node, scores: fx.Node, cond: Any, fill: Any, attend_if: bool) -> Step:
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
    step = Step("fill", node, scores, mask=cond, attend_if=attend_if, value=value,
                extra=(fill,) if isinstance(fill, fx.Node) else ())
    step.causal = _pattern_causal_1(step, tensor_value(node))
    return step


def _pattern_mask_2(node: fx.Node, head_dim: Any) -> Optional[Step]:
    # nanoGPT: scores.masked_fill(self.bias[:, :, :T, :T] == 0, float('-inf')); Bloom:
    # masked_fill(mask, finfo.min); the annotated transformer: masked_fill(mask == 0, -1e9).
    if not (is_method(node, "masked_fill", "masked_fill_") or is_function(node, torch.masked_fill)):
        return None
    args = bind(node, ("input", "mask", "value"), {})
    return _fill_step(node, args["input"], args["mask"], args.get("value"), attend_if=False)


def _pattern_mask_3(node: fx.Node, head_dim: Any) -> Optional[Step]:
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


def _pattern_view_1(node: fx.Node, head_dim: Any = None) -> Optional[Step]:
    # Bloom, fairseq: (B*H, L, S) scores viewed as (B, H, L, S) to add a per-batch mask, and back.
    if not (is_method(node, "view", "reshape") or is_function(node, torch.reshape)):
        return None
    before, after = tensor_value(node.args[0]), tensor_value(node)
    if before is None or after is None or before.dim() < 2 or after.dim() < 2 \
            or not known_equal(before.shape[-2:], after.shape[-2:]):
        return None
    return Step("view", node, node.args[0])


def _pattern_cast_1(node: fx.Node, head_dim: Any = None) -> Optional[Step]:
    # T5: softmax(scores.float()).type_as(scores); HF Llama / Bloom: softmax(..., dtype=float32)
    # .to(query.dtype); guided-diffusion: .type(weight.dtype). The op computes in fp32 anyway.
    if not is_method(node, *_CAST_METHODS) or not node.args:
        return None
    before, after = tensor_value(node.args[0]), tensor_value(node)
    if before is None or after is None or before.shape != after.shape or before.device != after.device:
        return None
    return Step("cast", node, node.args[0])


# Soft-capping (softcap.py) and sinks (sinks.py) are steps too, checked once the walk is done;
# the row-max shift comes before _pattern_mask_4, which would read it as a subtracted bias.
_SCORE_PATTERNS = (pattern_softcap, pattern_sinks, pattern_sink_shift, _pattern_scale_1, _pattern_mask_1,
                   _pattern_mask_2, _pattern_mask_3, _pattern_mask_4, _pattern_view_1, _pattern_cast_1)


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
# Causal masks
# ------------------------------------------------------------------------------------------


def _pattern_causal_1(step: Step, scores: Optional[torch.Tensor]) -> Optional[bool]:
    # minGPT: torch.tril(torch.ones(T, T)).view(1, 1, T, T) built in forward; nanoGPT / HF GPT-2:
    # the `bias` buffer sliced to [:, :, :T, :T] (a get_attr constant, e.g. in a symbolically
    # traced graph; dynamo lifts buffers to inputs, whose values are unknown: a plain bool mask).
    # Returns from_buffer when the fill hides exactly the keys j > i (top-left causal).
    found = triangle(step.mask)
    cond = tensor_value(step.mask)
    if found is None or cond is None or scores is None or not known_equal(cond.shape[-2:], scores.shape[-2:]):
        return None
    hides_upper = (found[0] == "upper") != step.attend_if
    return found[1] if hides_upper else None


# ------------------------------------------------------------------------------------------
# Matching a site
# ------------------------------------------------------------------------------------------


def _leads_to_pv(node: fx.Node, depth: int = 6) -> bool:
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


def _walk_scores(start: fx.Node, softmax: fx.Node, head_dim: Any) -> tuple[Product, list[Step]]:
    steps, node, user, readers = [], start, softmax, ()
    while True:
        check_only_user(node, user, "attention scores", also=readers)
        for pattern in _QK_PATTERNS:
            if (product := pattern(node)) is not None:
                return product, steps[::-1]
        step = next((s for p in _SCORE_PATTERNS if (s := p(node, head_dim)) is not None), None)
        if step is None:
            raise Keep(f"{describe(node)} at {node.name} between the Q·Kᵀ product and the softmax "
                       "is not a supported step")
        steps.append(step)
        node, user, readers = step.input, node, step.internal


def _walk_probs(softmax: fx.Node, sinks: bool) -> tuple[list[fx.Node], float, fx.Node, tuple]:
    """The probability steps up to the P·V product; with ``sinks``, casts and then the drop of
    the sink column come first."""
    nodes, dropout_p, node, dropped = [], 0.0, softmax, not sinks
    while True:
        users = value_users(node)
        if len(users) != 1:
            others = [u.name for u in users if not (_pattern_pv_1(u, node) or _pattern_pv_2(u, node))]
            raise Keep(f"the attention probabilities ({node.name}) are also used by "
                       f"{', '.join(others[:3])} (e.g. returned as attention weights)")
        (user,) = users
        if not dropped and drops_sink_column(user, node):
            dropped = True
            nodes.append(user)
            node = user
            continue
        if not dropped and not _pattern_cast_1(user):
            raise Keep(f"the probabilities go through {describe(user)} at {user.name} before the sink column "
                       "is dropped from them")
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


def _match_site(softmax: fx.Node, context: Context) -> Union[AttentionSite, KeptSite, None]:
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
        step_nodes = [n for s in steps for n in (s.node, *s.internal)]  # before read_* drop steps
        sinks, softcap = read_sinks(qk, steps), read_softcap(qk, steps)
        probs, dropout_p, pv, (value, value_perm, out_perm) = _walk_probs(softmax, sinks is not None)
        match = Match(qk, steps, softmax, probs, [n for n in probs if _pattern_view_1(n)], dropout_p, pv,
                      qk.key, value, value_perm, out_perm, is_einsum=is_function(qk.node, *_EINSUMS),
                      softcap=softcap, sinks=sinks, step_nodes=step_nodes)
        _peel_gqa(match)
        return assemble(match, context)
    except Keep as keep:
        return KeptSite("handwritten", softmax, str(keep), related=[product])


def _keeps_heads(perm: Optional[tuple]) -> bool:
    return perm is None or tuple(perm[:2]) == (0, 1)


def _peel_gqa(match: Match) -> None:
    """K/V with repeat_kv / repeat_interleave peeled off, when both repeat the same heads."""
    k_src, k_rep, k_nodes = (peel_repeats(match.key) if _keeps_heads(match.product.key_perm)
                             else (match.key, 1, []))
    v_src, v_rep, v_nodes = (peel_repeats(match.value) if _keeps_heads(match.value_perm)
                             else (match.value, 1, []))
    if (k_rep, v_rep) == (1, 1) or k_rep != v_rep:
        return
    if known_equal([tensor_value(k_src).shape[1]], [tensor_value(v_src).shape[1]]):
        match.key, match.value, match.repeats, match.repeat_nodes = k_src, v_src, k_rep, k_nodes + v_nodes


def find_sites(graph: fx.Graph) -> Iterator[Union[AttentionSite, KeptSite]]:
    context = Context({n: i for i, n in enumerate(graph.nodes)})
    for node in list(graph.nodes):
        if _pattern_softmax_1(node) is not None:
            found = guarded("handwritten", node, lambda: _match_site(node, context))
            if found is not None:
                yield found
