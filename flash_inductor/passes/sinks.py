"""Attention sinks in hand-written attention: gpt-oss's eager pattern.

    w = torch.cat([scores, module.sinks.reshape(1, -1, 1, 1).expand(B, -1, L, -1)], dim=-1)
    w = w - w.max(dim=-1, keepdim=True).values       # optional
    p = F.softmax(w, dim=-1)[..., :-1]               # the sink column dropped
    dropout(p) @ v

is the op with ``sinks=`` one logit per query head: the sink joins each row's softmax denominator
and nothing else. Checked: the sink column is the last one, one column wide, one value per head
broadcast over the batch and the queries, concatenated after every scale and mask (which would
otherwise reach the sink too), over the same batch layout as the scores; the probabilities drop
exactly that column before dropout or anything else reads them.

The row-max shift is softmax's own invariance (``softmax(x - m) = softmax(x)`` for a per-row m;
exact up to rounding, the op subtracts its own running max). It is taken only as the last step
before the softmax, where it shifts the whole row, sink column included, with or without sinks.
"""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.fx as fx

from .fx_match import Keep, bind, is_function, is_method, known_equal, tensor_value
from .handwritten_site import Product, Step

_CATS = (torch.cat, torch.concat, torch.concatenate)
_EXPANDS = ("expand", "expand_as", "broadcast_to")


def _is_last_dim(dim: Any, node: fx.Node) -> bool:
    ev = tensor_value(node)
    return isinstance(dim, int) and not isinstance(dim, bool) and ev is not None and dim % ev.dim() == ev.dim() - 1


def pattern_sinks(node: fx.Node, head_dim: Any = None) -> Optional[Step]:
    # gpt-oss (HF eager_attention_forward): torch.cat([attn_weights, sinks], dim=-1), the sinks
    # module.sinks.reshape(1, -1, 1, 1).expand(batch, -1, q_len, -1).
    if not is_function(node, *_CATS):
        return None
    args = bind(node, ("tensors", "dim"), dict(dim=0))
    tensors = args["tensors"]
    if not isinstance(tensors, (list, tuple)) or len(tensors) != 2 or not _is_last_dim(args["dim"], node):
        raise Keep(f"the scores are concatenated at {node.name} other than with one sink column on the key dim")
    scores, column = tensors
    col = tensor_value(column)
    if col is None or col.dim() < 3 or not known_equal([col.shape[-1]], [1]):
        raise Keep(f"{column.name}, concatenated after the scores at {node.name}, is not one sink column "
                   "(..., heads, L, 1)")
    source, internal = column, []
    while is_method(source, *_EXPANDS) or is_function(source, torch.broadcast_to):
        internal.append(source)
        source = source.args[0]
    src = tensor_value(source)
    n = col.dim()
    shape = None if src is None or src.dim() > n else (1,) * (n - src.dim()) + tuple(src.shape)
    if shape is None or not known_equal([shape[n - 3]], [col.shape[-3]]) \
            or not all(known_equal([d], [1]) for i, d in enumerate(shape) if i != n - 3):
        raise Keep(f"the sink column {column.name} is not one logit per head broadcast over the batch and "
                   f"the queries ({source.name} has shape {tuple(src.shape) if src is not None else '?'})")
    return Step("sinks", node, scores, sinks=source, internal=tuple(internal))


def _row_max(node: Any, x: fx.Node) -> Optional[tuple[fx.Node, ...]]:
    """The nodes of ``x.max(dim=-1, keepdim=True).values`` / ``x.amax(-1, keepdim=True)``."""
    reduce, nodes = node, (node,)
    if is_function(node, operator.getitem) and node.args[1] == 0:
        reduce, nodes = node.args[0], (node, node.args[0])
    elif is_function(node, getattr) and node.args[1] == "values":
        reduce, nodes = node.args[0], (node, node.args[0])
    elif not (is_method(node, "amax") or is_function(node, torch.amax)):
        return None
    if not (is_method(reduce, "max", "amax") or is_function(reduce, torch.max, torch.amax)) \
            or (reduce is node) != (is_method(reduce, "amax") or is_function(reduce, torch.amax)):
        return None
    args = bind(reduce, ("input", "dim", "keepdim"), dict(dim=None, keepdim=False))
    if args["input"] is not x or args["keepdim"] is not True:
        return None
    dim = args["dim"]
    dim = dim[0] if isinstance(dim, (list, tuple)) and len(dim) == 1 else dim
    return nodes if _is_last_dim(dim, x) else None


def pattern_sink_shift(node: fx.Node, head_dim: Any = None) -> Optional[Step]:
    # gpt-oss: combined_logits - combined_logits.max(dim=-1, keepdim=True).values, against bf16
    # overflow; a row-constant shift that the softmax undoes.
    if not (is_function(node, operator.sub, torch.sub) or is_method(node, "sub")) or len(node.args) != 2 \
            or node.kwargs:
        return None
    x, m = node.args
    nodes = _row_max(m, x) if isinstance(x, fx.Node) else None
    if nodes is None:
        return None
    return Step("shift", node, x, internal=nodes)


def read_sinks(product: Product, steps: list[Step]) -> Optional[fx.Node]:
    """The per-head sink logits of a site (any shape with one value per head), None without a
    sink column; the shift and sink steps leave ``steps``. Raises Keep where the order differs."""
    for i, step in enumerate(steps):
        after = [s for s in steps[i + 1:] if s.kind != "cast"]
        if step.kind == "shift" and after:
            raise Keep(f"the row max subtracted at {step.node.name} is followed by {after[0].node.name}: "
                       "only a shift of the whole softmax input leaves it unchanged")
        if step.kind == "sinks" and any(s.kind != "shift" for s in after):
            later = next(s for s in after if s.kind != "shift")
            raise Keep(f"{later.node.name} acts on the scores after the sink column was concatenated at "
                       f"{step.node.name}: it would reach the sinks too, which the op's sinks never are")
    found = [s for s in steps if s.kind == "sinks"]
    steps[:] = [s for s in steps if s.kind not in ("sinks", "shift")]
    if not found:
        return None
    (sink,) = found
    cat = tensor_value(sink.node).shape[:-2]
    if any(s.kind == "view" for s in steps) or len(cat) < 2 \
            or not known_equal(cat, tensor_value(product.node).shape[:-2]):
        raise Keep(f"the sink column at {sink.node.name} is concatenated on scores of another layout than "
                   "(..., heads, L, S): its heads would not be the op's")
    return sink.sinks


def drops_sink_column(node: fx.Node, probs: fx.Node) -> bool:
    """``probs[..., :-1]`` (or ``[:, :, :, :-1]``, ``[..., :S]``): the probabilities without the
    last column, the sink's."""
    if not is_function(node, operator.getitem) or node.args[0] is not probs:
        return False
    ev, index = tensor_value(probs), node.args[1]
    index = index if isinstance(index, tuple) else (index,)
    if ev is None or not index or not isinstance(index[-1], slice):
        return False
    head = index[:-1]
    if head != (Ellipsis,) and head != (slice(None),) * (ev.dim() - 1):
        return False
    last = index[-1]
    stop_ok = last.stop == -1 or (isinstance(last.stop, int) and known_equal([last.stop], [ev.shape[-1] - 1]))
    return last.start in (None, 0) and last.step in (None, 1) and stop_ok
