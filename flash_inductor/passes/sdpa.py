"""Pattern family: explicit ``F.scaled_dot_product_attention`` calls.

Covers every model that already calls SDPA (HF transformers' "sdpa" attention, nanoGPT's
flash path, torch.nn.MultiheadAttention with need_weights=False in recent torch, diffusers).
In a dynamo graph the call is a single node, so every argument maps one to one. HF's GQA models
repeat K/V heads before the call whenever they pass a mask (``repeat_kv``, see ``gqa.py``); that
repeat is folded into ``enable_gqa=True``. A sliding-window mask becomes the op's ``window``
(``window.py``); a mask that is the same for every query, the op's key mask (``key_mask.py``).
"""

from __future__ import annotations

from typing import Iterator, Union

import torch
import torch.fx as fx
import torch.nn.functional as F

from .gqa import peel_repeats
from .fx_match import known_equal, mutates
from .key_mask import sdpa_key_mask
from .packed import sdpa_packed
from .site import AttentionSite, KeptSite, example_value, guarded
from .window import sdpa_window

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


def _pattern_sdpa_2(site: AttentionSite) -> AttentionSite:
    """HF Llama / Mistral / Qwen2 "sdpa" with a mask: SDPA(q, repeat_kv(k), repeat_kv(v)).

    The op gets the un-repeated K/V with ``enable_gqa=True``. Left as matched when K and V are not
    repeated alike, or when an un-repeated tensor is written in place between the repeat and the
    call (the repeat copied its values before the write; the op would read them after it). A
    write before the repeat is seen by both: a static KV cache is written by ``index_copy_`` just
    before the step repeats and attends over it (HF's ``StaticCache.update``).
    """
    if site.enable_gqa:
        return site
    key, k_rep, k_nodes = peel_repeats(site.key)
    value, v_rep, v_nodes = peel_repeats(site.value)
    if k_rep == 1 or k_rep != v_rep:
        return site
    if _written_between((key, value), [*k_nodes, *v_nodes], site.output):
        return site
    query, repeated = example_value(site.query), example_value(site.key)
    if query is None or repeated is None or query.dim() != 4 or not known_equal(query.shape[:2], repeated.shape[:2]):
        return site  # SDPA would broadcast q over the repeated heads: not GQA's pairing
    site.pattern, site.key, site.value, site.enable_gqa = "sdpa_repeat_kv", key, value, True
    site.consumed = [*k_nodes, *v_nodes]
    return site


def _written_between(sources, repeats: list, call: fx.Node) -> bool:
    """Whether a source of the repeats is written in place after the first repeat node and before
    ``call``."""
    order = {node: i for i, node in enumerate(call.graph.nodes)}
    start = min(order[node] for node in repeats)
    return any(mutates(user, source) and start < order[user] < order[call]
               for source in sources for user in source.users)


def _match(node: fx.Node) -> Union[AttentionSite, KeptSite]:
    found = _pattern_sdpa_1(node)
    if not isinstance(found, AttentionSite):
        return found
    # Mistral / Qwen2 / Gemma / Phi-3 with sliding_window: the band mask becomes the op's window;
    # BERT and HF's other encoders: the padding mask, the same for every query, one row of it;
    # HF's packed batches: causal AND same-sequence on the varlen op.
    return sdpa_key_mask(sdpa_window(sdpa_packed(_pattern_sdpa_2(found))))


def find_sites(graph: fx.Graph) -> Iterator[Union[AttentionSite, KeptSite]]:
    for node in graph.nodes:
        if node.op == "call_function" and node.target in _SDPA_TARGETS:
            yield guarded("sdpa", node, lambda: _match(node))
