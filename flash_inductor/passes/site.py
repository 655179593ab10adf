"""What a matched attention site is, and how one is rewritten in a pre-grad FX graph.

Every pattern family (``sdpa.py``, ``handwritten.py``, ``mha.py``) turns the nodes it matched
into an :class:`AttentionSite`, or into a :class:`KeptSite` saying why it left them alone.
:func:`rewrite_site` then inserts one call of :func:`rewritten_attention` (our op with SDPA
semantics) in place of the site's output and erases only the nodes the pattern consumed.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import re
from typing import Any, Callable, Iterable, Optional

import torch
import torch.fx as fx

from ..api import attention
from ..varlen import packed_attention
from ..launch import decode, hopper, hopper_bwd
from .guard import check_replacement, checked_insertion, describe_error

log = logging.getLogger("flash_inductor")


def rewritten_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
    schedule=None, monitor_site=None, window=None, softcap=None, sinks=None,
):
    """The call the pass inserts: flash_attention with SDPA's argument order.

    A separate module-level function (not a lambda) so rewritten graphs print readably and
    pickle; AOTAutograd traces through it into ``flash_inductor::attention_forward``.
    ``monitor_site`` (set only by ``make_backend(monitor=True)``) adds the recording ops of
    ``flash_inductor.monitoring``; whether a session is active while compiling plays no part.
    ``window`` is the op's ``(left, right)`` sliding window, ``softcap`` its logit cap and ``sinks``
    its per-head sink logits ``(Hq,)``, each passed only when a site has one.
    """
    extra = {} if window is None else {"window": tuple(window)}
    if softcap is not None:
        extra["softcap"] = softcap
    if sinks is not None:
        extra["sinks"] = sinks
    return attention(
        query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
        scale=scale, enable_gqa=enable_gqa, schedule=schedule, monitor_site=monitor_site, **extra,
    )


def packed_sequence_attention(query, key, value, sequence_ids, dropout_p=0.0, is_causal=False, scale=None,
                              schedule=None, softcap=None, sinks=None, monitor_site=None):
    """The call the pass inserts for packed sequences (``packed.py``): (B, H, L, E) attention in
    which token t of row b sees only the tokens of its run of equal ``sequence_ids[b]`` (B, L),
    non-decreasing along each row; causal within each run when ``is_causal``. The rows' tokens are
    packed to (B*L, H, E) and run on the varlen op, one sequence per run (the slots beyond the
    last run are empty sequences, so ``cu_seqlens`` has a fixed size B*L + 1: no data-dependent shape)."""
    batch, heads, seq, dim = query.shape
    packed = [t.transpose(1, 2).reshape(batch * seq, t.shape[1], t.shape[-1]) for t in (query, key, value)]
    rows = torch.arange(batch, device=sequence_ids.device)[:, None] * seq
    ids = (sequence_ids - sequence_ids[:, :1] + rows).reshape(-1)  # in [0, B*L), non-decreasing
    lengths = torch.zeros(batch * seq, dtype=torch.int64, device=ids.device).index_add_(0, ids, torch.ones_like(ids))
    cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
    # max_seqlen L: a bound on every run (it sizes the kernels' grid), no host read of the ids.
    out = packed_attention(*packed, cu_seqlens, cu_seqlens, seq, seq, dropout_p,
                           dim ** -0.5 if scale is None else scale, is_causal, causal_lower_right=True,
                           softcap=softcap or 0.0, sinks=sinks, schedule=schedule, monitor_site=monitor_site)
    return out.reshape(batch, seq, heads, out.shape[-1]).transpose(1, 2)


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
    # For the report when ``attn_mask`` is built by the prologue: "float mask", "bool mask", ...
    mask_description: Optional[str] = None
    # Nodes besides ``output`` that the site spans (its Q·Kᵀ product, its softmax): the report
    # names the innermost module containing all of them.
    anchors: list[fx.Node] = dataclasses.field(default_factory=list)
    # Called with the replacement once the rewrite is in the graph (a pattern that tracks what
    # earlier sites replaced records it here, never before the rewrite is known to go in).
    on_rewritten: Optional[Callable[[fx.Node], None]] = None
    # The op's sliding window (left, right) read from a band mask (``band.Window``), or None.
    window: Optional[tuple[int, int]] = None
    # Every query row of the op's mask is the same (``key_mask.py``): the op gets the first row
    # alone, ``mask[..., 0:1, :]``, which its Hopper kernels take as a per-key bias.
    key_mask: bool = False
    # Logit soft-capping ``c * tanh(s / c)`` before the mask (Gemma 2), or None.
    softcap: Optional[float] = None
    # A node holding one sink logit per query head, in any shape with Hq elements (gpt-oss's
    # ``module.sinks``): the call gets it reshaped to ``(Hq,)``. None without sinks.
    sinks: Optional[fx.Node] = None
    # Packed sequences (``packed.py``): the (B, L) sequence ids, or None. The call is then
    # :func:`packed_sequence_attention` (no mask, window or monitoring).
    sequence_ids: Optional[fx.Node] = None


@dataclasses.dataclass
class KeptSite:
    """A site a pattern recognised but must not rewrite, and why (shown in the report)."""

    pattern: str
    node: fx.Node
    reason: str
    # Other nodes of the site (e.g. the Q·Kᵀ product), so the report can name its module.
    related: list[fx.Node] = dataclasses.field(default_factory=list)


def guarded(pattern: str, node: fx.Node, match: Callable[[], Any]) -> Any:
    """``match()``, or a KeptSite when it raises: one pattern's failure on one node keeps that site."""
    try:
        return match()
    except Exception as error:  # noqa: BLE001 -- any failure of a pattern keeps its site, never the compile
        log.debug("flash_inductor: pattern %s failed at node %s; the site is kept", pattern, node.name,
                  exc_info=True)
        return KeptSite(pattern, node, f"the pass could not match this site ({describe_error(error)}); kept as written")


def example_value(node: Any) -> Optional[torch.Tensor]:
    """The fake tensor dynamo recorded for a node, if any."""
    if isinstance(node, fx.Node):
        value = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(value, torch.Tensor):
            return value
    return None


def describe_rewrite(site: AttentionSite, schedule: Optional[str] = None) -> str:
    """The op arguments of a rewritten site, as the report prints them, and on a Hopper GPU which
    forward kernel will run it."""
    parts = [describe_window(site.window)] if has_window(site.window) else []
    if site.sequence_ids is not None:
        parts.append("packed sequences on varlen")
    if site.mask_description:
        parts.append(site.mask_description)
    elif site.attn_mask is not None:
        mask = example_value(site.attn_mask)
        parts.append("bool mask" if mask is not None and mask.dtype == torch.bool else "float mask")
    parts.append("causal" if site.is_causal else "no mask" if not parts else None)
    if site.enable_gqa:
        parts.append("GQA")
    if site.softcap is not None:
        parts.append(f"softcap {site.softcap:g}")
    if site.sinks is not None:
        parts.append("sinks")
    if site.dropout_p:
        parts.append(f"dropout {site.dropout_p:g}")
    if site.scale is not None:
        parts.append(f"scale {site.scale:.4g}")
    parts.append(_forward_kernel(site, schedule))
    return ", ".join(p for p in parts if p)


def has_window(window: Optional[tuple[int, int]]) -> bool:
    return window is not None and tuple(window) != (-1, -1)


def describe_window(window: tuple[int, int]) -> str:
    """``sliding window (left=4095, right=0)``; ``window (left=-1, right=0)`` when a side is open."""
    left, right = window
    kind = "sliding window" if -1 not in (left, right) else "window"
    return f"{kind} (left={left}, right={right})"


def _forward_kernel(site: AttentionSite, schedule: Optional[str]) -> Optional[str]:
    """'forward on the split-KV decode kernels' for a decode-shaped site on a GPU; else 'forward on
    the Hopper kernel' (and the backward too where the Hopper backward takes the site), or why the
    Triton one runs instead, for a site on an sm_90 GPU (from the fake inputs, as the op decides
    when it is traced); None elsewhere."""
    query, key, value = (example_value(node) for node in (site.query, site.key, site.value))
    if query is None or key is None or value is None or not query.is_cuda:
        return None
    mask = example_value(site.attn_mask) if site.attn_mask is not None else None
    try:
        if mask is not None and site.key_mask:
            mask = mask[_FIRST_QUERY_ROW]  # as rewrite_site cuts it
        # The decode kernels have no soft cap: a capped site skips them, as the op does.
        if site.softcap is None and query.dim() == 4 and key.dim() == 4 and \
                decode.decode_unsupported_reason(query, key, mask, site.dropout_p or 0.0, schedule) is None:
            return "forward on the split-KV decode kernels"
        window = tuple(site.window) if has_window(site.window) else None
        reason = hopper.hopper_forward_unsupported_reason(query, key, value, mask, site.dropout_p or 0.0,
                                                          site.scale, schedule, window=window)
        backward_reason = hopper_bwd.hopper_backward_unsupported_reason(
            query, key, value, mask, site.dropout_p or 0.0, site.scale, schedule, is_causal=bool(site.is_causal),
            window=window)
    except Exception:  # a report line must never fail a compile
        return None
    if reason is None and backward_reason is None:
        return "forward and backward on the Hopper (Gluon) kernels"
    if reason is None:
        return "forward on the Hopper (Gluon) kernel"
    # Layout reasons are left out: the op normalises 3-D inputs and broadcast heads before it
    # decides, so the site's own shapes would mislead there.
    if reason in hopper.NOT_HOPPER or reason in hopper.LAYOUT_REASONS:
        return None
    return f"forward on Triton: {reason}"



def _module_entries(node: fx.Node) -> list[tuple[str, Any]]:
    stack = node.meta.get("nn_module_stack") or {}
    return [tuple(entry) for entry in stack.values()]


_GETATTR = re.compile(r"getattr\((.+?), ['\"]([^'\"]+)['\"]\)")


# The traced frame's local holding the root module: ``L['self']``, or ``L['args'][0]`` when the
# forward is wrapped by a ``def wrapper(*args, **kwargs)`` decorator (transformers' output-capturing
# decorators on Falcon and Bloom: their paths came out as ``0.h.0.self_attention``).
_FRAME_ROOT = re.compile(r"^L\[['\"](?:args|kwargs)['\"]\]\[[^\]]+\]|^L\[['\"][^'\"]+['\"]\]")
# Attribute containers dynamo may spell out: ``._modules['h']``, ``.__dict__['transformer_blocks']``
# (diffusers' blocks reached through an attention processor).
_CONTAINERS = ("_modules", "_parameters", "_buffers", "__dict__")


def relative_module_path(dynamo_path: str) -> Optional[str]:
    """``L['self'].transformer.h[3].attn``, ``...h.3.attn``, ``getattr(L['self'].h, '3').attn``,
    ``..._modules['h']._modules['3']...``, ``L['args'][0].transformer.h[3].attn`` or
    ``L['self'].__dict__['transformer']...`` -> ``transformer.h.3.attn``: the path relative to the
    traced module; None for that module itself."""
    previous = None
    while previous != dynamo_path:  # nested getattr(getattr(...), '0')
        previous, dynamo_path = dynamo_path, _GETATTR.sub(r"\1.\2", dynamo_path)
    path = _FRAME_ROOT.sub("", dynamo_path)
    path = re.sub(r"\[['\"]?([^'\"\]]+)['\"]?\]", r".\1", path)
    parts = [p for p in path.split(".") if p and p not in _CONTAINERS]
    return ".".join(parts) or None


def module_path(nodes: Iterable[Any]) -> tuple[Optional[str], Optional[type]]:
    """(path, class) of the innermost module whose forward contains all ``nodes``, from dynamo's
    ``meta["nn_module_stack"]`` (outermost first); nodes without one (placeholders) are skipped."""
    common: Optional[list] = None
    for node in nodes:
        if not isinstance(node, fx.Node) or not node.meta.get("nn_module_stack"):
            continue
        entries = _module_entries(node)
        if common is None:
            common = entries
            continue
        keep = 0
        while keep < min(len(common), len(entries)) and common[keep][0] == entries[keep][0]:
            keep += 1
        common = common[:keep]
    if not common:
        return None, None
    path, cls = common[-1][0], common[-1][1] if len(common[-1]) > 1 else None
    return relative_module_path(str(path)), cls if isinstance(cls, type) else None


# ``mask[..., 0:1, :]``: a slice keeps the mask's dtype and values exactly, and Inductor computes
# only the row it selects.
_FIRST_QUERY_ROW = (Ellipsis, slice(0, 1), slice(None))


def first_query_row(graph: fx.Graph, mask: fx.Node) -> fx.Node:
    return graph.call_function(operator.getitem, (mask, _FIRST_QUERY_ROW))


def rewrite_site(graph: fx.Graph, site: AttentionSite, schedule: Optional[str],
                 monitor_site: Optional[str] = None) -> fx.Node:
    """Replace ``site.output`` with a call of :func:`rewritten_attention`; erase dead pattern nodes.

    The replacement is first run on the graph's fake tensors (``guard.check_replacement``): if
    the op would reject it, or it would not give the output's shape, dtype and device, the
    inserted nodes are erased and :class:`guard.Rejected` (or the error) propagates, leaving the
    graph as it was. ``monitor_site``: name under which the call records monitoring statistics;
    None (the default) leaves the call exactly as without monitoring.
    """
    with checked_insertion(graph) as inserted:
        with graph.inserting_before(site.output):
            q, k, v, mask = site.query, site.key, site.value, site.attn_mask
            if site.prologue is not None:
                q, k, v, mask = site.prologue(graph, q, k, v, mask)
            if site.key_mask and mask is not None:
                mask = first_query_row(graph, mask)
            kwargs = dict(
                attn_mask=mask, dropout_p=float(site.dropout_p), is_causal=bool(site.is_causal),
                scale=None if site.scale is None else float(site.scale), enable_gqa=bool(site.enable_gqa),
                schedule=schedule,
            )
            if monitor_site is not None:
                kwargs["monitor_site"] = monitor_site
            if has_window(site.window):
                kwargs["window"] = tuple(site.window)
            if site.softcap is not None:
                kwargs["softcap"] = float(site.softcap)
            if site.sinks is not None:
                kwargs["sinks"] = graph.call_method("reshape", (site.sinks, -1))
            if site.sequence_ids is not None:
                for name in ("attn_mask", "enable_gqa"):
                    kwargs.pop(name, None)
                call = graph.call_function(packed_sequence_attention, (q, k, v, site.sequence_ids), kwargs)
            else:
                call = graph.call_function(rewritten_attention, (q, k, v), kwargs)
            replacement = site.epilogue(graph, call) if site.epilogue is not None else call
        check_replacement(inserted(), site.output, replacement)
    if "example_value" in site.output.meta:
        replacement.meta["example_value"] = site.output.meta["example_value"]
    site.output.replace_all_uses_with(replacement)
    if site.on_rewritten is not None:
        site.on_rewritten(replacement)
    # Erase the output and then the pattern's own nodes, in reverse order, only when nothing
    # else uses them: a blanket dead-code pass would also delete in-place ops like masked_fill_.
    erased: set[fx.Node] = set()
    for node in [site.output, *reversed(site.consumed)]:
        if node in erased or node.users or node.op not in ("call_function", "call_method", "call_module"):
            continue
        graph.erase_node(node)
        erased.add(node)
    return replacement
