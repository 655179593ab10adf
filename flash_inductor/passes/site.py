"""What a matched attention site is, and how one is rewritten in a pre-grad FX graph.

Every pattern family (``sdpa.py``, ``handwritten.py``, ``mha.py``) turns the nodes it matched
into an :class:`AttentionSite`, or into a :class:`KeptSite` saying why it left them alone.
:func:`rewrite_site` then inserts one call of :func:`rewritten_attention` (our op with SDPA
semantics) in place of the site's output and erases only the nodes the pattern consumed.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
import torch.fx as fx

from ..api import attention


def rewritten_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
    schedule=None, monitor_site=None,
):
    """The call the pass inserts: flash_attention with SDPA's argument order.

    A separate module-level function (not a lambda) so rewritten graphs print readably and
    pickle; AOTAutograd traces through it into ``flash_inductor::attention_forward``.
    ``monitor_site`` (set only by ``make_backend(monitor=True)``) adds the recording ops of
    ``flash_inductor.monitoring``; whether a session is active while compiling plays no part.
    """
    return attention(
        query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
        scale=scale, enable_gqa=enable_gqa, schedule=schedule, monitor_site=monitor_site,
    )


@dataclasses.dataclass
class AttentionSite:
    """A matched attention computation, in SDPA terms.

    ``query``/``key``/``value`` and ``attn_mask`` are graph nodes (or None for the mask);
    the rest are Python constants. ``output`` is the node whose value the rewrite replaces;
    ``consumed`` are the intermediate nodes of the pattern, erased once unused.
    ``prologue`` optionally builds extra nodes (e.g. a reshape of a 3-D (B*H, L, E) layout)
    right before the call: it gets the graph and returns (query, key, value, attn_mask)
    nodes, and ``epilogue`` maps the call's node to the node that replaces ``output``.
    """

    pattern: str
    output: fx.Node
    query: fx.Node
    key: fx.Node
    value: fx.Node
    attn_mask: Optional[fx.Node] = None
    dropout_p: float = 0.0
    is_causal: bool = False
    scale: Optional[float] = None
    enable_gqa: bool = False
    consumed: list[fx.Node] = dataclasses.field(default_factory=list)
    prologue: Optional[Any] = None
    epilogue: Optional[Any] = None


@dataclasses.dataclass
class KeptSite:
    """A site a pattern recognised but must not rewrite, and why (shown in the report)."""

    pattern: str
    node: fx.Node
    reason: str


def example_value(node: Any) -> Optional[torch.Tensor]:
    """The fake tensor dynamo recorded for a node, if any."""
    if isinstance(node, fx.Node):
        value = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(value, torch.Tensor):
            return value
    return None


def rewrite_site(graph: fx.Graph, site: AttentionSite, schedule: Optional[str],
                 monitor_site: Optional[str] = None) -> fx.Node:
    """Replace ``site.output`` with a call of :func:`rewritten_attention`; erase dead pattern nodes.

    ``monitor_site``: name under which the call records monitoring statistics; None (the
    default) leaves the call exactly as without monitoring.
    """
    with graph.inserting_before(site.output):
        q, k, v, mask = site.query, site.key, site.value, site.attn_mask
        if site.prologue is not None:
            q, k, v, mask = site.prologue(graph, q, k, v, mask)
        kwargs = dict(
            attn_mask=mask, dropout_p=float(site.dropout_p), is_causal=bool(site.is_causal),
            scale=None if site.scale is None else float(site.scale), enable_gqa=bool(site.enable_gqa),
            schedule=schedule,
        )
        if monitor_site is not None:
            kwargs["monitor_site"] = monitor_site
        call = graph.call_function(rewritten_attention, (q, k, v), kwargs)
        replacement = site.epilogue(graph, call) if site.epilogue is not None else call
    if "example_value" in site.output.meta:
        replacement.meta["example_value"] = site.output.meta["example_value"]
    site.output.replace_all_uses_with(replacement)
    # Erase the output and then the pattern's own nodes, in reverse order, only when nothing
    # else uses them: a blanket dead-code pass would also delete in-place ops like masked_fill_.
    erased: set[fx.Node] = set()
    for node in [site.output, *reversed(site.consumed)]:
        if node in erased or node.users or node.op not in ("call_function", "call_method", "call_module"):
            continue
        graph.erase_node(node)
        erased.add(node)
    return replacement
