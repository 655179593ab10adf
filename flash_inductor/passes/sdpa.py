"""Pattern family: explicit ``F.scaled_dot_product_attention`` calls.

Covers every model that already calls SDPA (HF transformers' "sdpa" attention, nanoGPT's
flash path, torch.nn.MultiheadAttention with need_weights=False in recent torch, diffusers).
In a dynamo graph the call is a single node, so every argument maps one to one.
"""

from __future__ import annotations

from typing import Iterator, Union

import torch
import torch.fx as fx
import torch.nn.functional as F

from .site import AttentionSite, KeptSite

_SDPA_TARGETS = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}
_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_DEFAULTS = dict(attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False)


def _bound_arguments(node: fx.Node) -> dict:
    bound = dict(_DEFAULTS)
    bound.update(zip(_PARAMS, node.args))
    bound.update(node.kwargs)
    return bound


def _pattern_sdpa_1(node: fx.Node) -> Union[AttentionSite, KeptSite]:
    """F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)."""
    args = _bound_arguments(node)
    unknown = set(args) - set(_PARAMS)
    if unknown:
        return KeptSite("sdpa", node, f"unexpected SDPA arguments {sorted(unknown)}")
    for name in ("dropout_p", "is_causal", "scale", "enable_gqa"):
        if isinstance(args[name], fx.Node):
            return KeptSite("sdpa", node, f"{name} is a traced value, not a constant")
    mask = args["attn_mask"]
    if mask is not None and not isinstance(mask, fx.Node):
        return KeptSite("sdpa", node, f"attn_mask of type {type(mask).__name__} is not a graph tensor")
    return AttentionSite(
        pattern="sdpa", output=node, query=args["query"], key=args["key"], value=args["value"],
        attn_mask=mask, dropout_p=args["dropout_p"], is_causal=args["is_causal"], scale=args["scale"],
        enable_gqa=args["enable_gqa"],
    )


def find_sites(graph: fx.Graph) -> Iterator[Union[AttentionSite, KeptSite]]:
    for node in graph.nodes:
        if node.op == "call_function" and node.target in _SDPA_TARGETS:
            yield _pattern_sdpa_1(node)
