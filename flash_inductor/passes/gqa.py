"""Grouped-query K/V: the ways models repeat K/V heads to match the query heads.

Shared by the SDPA and hand-written families. Both fold a recognised repeat into the op's
``enable_gqa=True`` with the un-repeated K/V: head h of the repeated tensor is head h // n_rep of
the original, which is exactly how ``enable_gqa`` pairs query heads with K/V heads, and the op
then reads each K/V head once instead of materialising n_rep copies.
"""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.fx as fx

from .fx_match import bind, is_function, is_method, known_equal, tensor_value


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


def peel_repeats(node: fx.Node) -> tuple[fx.Node, int, list]:
    """(x, n_rep, the repeat's nodes) when ``node`` is ``x`` with each head repeated n_rep times
    in place (head h of ``node`` is head h // n_rep of ``x``), else (node, 1, [])."""
    for pattern in (_pattern_gqa_1, _pattern_gqa_2):
        if (found := pattern(node)) is not None:
            return found
    return node, 1, []
