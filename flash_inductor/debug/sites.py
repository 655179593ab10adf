"""Finding attention sites in a model and instrumenting them without changing what they compute.

The rewrite pass's site finders (``passes/sdpa.py``, ``mha.py``, ``handwritten.py``) run on the
FX graph dynamo captures, plus one finder here for calls of our own op. Nothing is rewritten:
each site gets side nodes after its output that

* rebuild its q, k, v and mask in SDPA layout with the site's own prologue (``AttentionSite``),
* in shadow mode, also build float64 copies of q, k, v (detached leaves), push them through a copy
  of that prologue, a float64 attention and the site's epilogue, so the reference lands in the
  model's layout and its autograd graph maps gradients back to the model's q, k, v; and the same
  with same-dtype leaves and SDPA (the tolerance rule's PyTorch baseline),
* call :func:`_probe`, which hands everything to the active debug session.

The graph is then run as captured, op by op (the backend returns ``gm.forward``; no Inductor): the
model computes exactly what it computes eagerly, with the side nodes reading along. Instrumentation
exists only inside a debug session's ``with`` block (:class:`Instrumented`); outside, the model
is untouched, so the tools cost nothing when off.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from ..launch.band import NO_WINDOW, has_window, resolve_band
from ..passes import handwritten, mha, sdpa
from ..passes.report import SiteRecord
from ..passes.site import AttentionSite, KeptSite, example_value, module_path

_FAMILIES: tuple[Callable[[fx.Graph], Any], ...] = (sdpa.find_sites, mha.find_sites, handwritten.find_sites)

# Sessions currently entered, innermost last; probes report to the innermost.
_ACTIVE: list[Any] = []


@dataclasses.dataclass
class SiteInfo:
    """A site's static facts, fixed when its graph is instrumented."""

    name: str  # "blocks.0.attn", unique within the session (a suffix "#n" for repeats)
    pattern: str  # the pass's pattern name, or "flash_inductor" for our op
    module: Optional[str]
    is_causal: bool
    causal_offset: int
    scale: Optional[float]
    enable_gqa: bool
    dropout_p: float
    shadow: bool  # whether float64 and SDPA side computations were inserted
    window: tuple = NO_WINDOW  # flash_attention's (left, right); (-1, -1) for none
    softcap: float = 0.0  # the soft cap c (0: none)


def active_session():
    return _ACTIVE[-1] if _ACTIVE else None


# ------------------------------------------------------------------------------------------
# Our op as a site
# ------------------------------------------------------------------------------------------


def _our_op_sites(graph: fx.Graph) -> list[AttentionSite]:
    """Calls of ``flash_inductor::attention_forward`` (eager ``flash_attention`` under dynamo,
    the HF integration, a graph the pass already rewrote): already in SDPA layout."""
    target = torch.ops.flash_inductor.attention_forward
    found = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in (target, target.default):
            continue
        outs = [u for u in node.users if u.target is operator.getitem and u.args[1] == 0]
        if not outs:
            continue
        q, k, v, mask, _seed, dropout_p, is_causal, causal_offset, scale = node.args[:9]
        # The window is the schema's last two arguments (-1, -1 when left at their defaults).
        window = tuple(int(a) for a in node.args[10:12]) if len(node.args) >= 12 else (
            int(node.kwargs.get("window_left", -1)), int(node.kwargs.get("window_right", -1)))
        softcap = float(node.args[15]) if len(node.args) >= 16 else float(node.kwargs.get("softcap", 0.0))
        q_val, k_val = example_value(q), example_value(k)
        gqa = q_val is not None and k_val is not None and q_val.shape[1] != k_val.shape[1]
        site = AttentionSite("flash_inductor", outs[0], q, k, v, attn_mask=mask, dropout_p=float(dropout_p),
                             is_causal=bool(is_causal), scale=float(scale), enable_gqa=gqa, anchors=[node])
        site.causal_offset = int(causal_offset)  # type: ignore[attr-defined]
        site.window = window  # type: ignore[attr-defined]
        site.softcap = softcap  # type: ignore[attr-defined]
        found.append(site)
    return found


# ------------------------------------------------------------------------------------------
# Side computations (run inside the instrumented graph)
# ------------------------------------------------------------------------------------------


def _leaf(t: Optional[torch.Tensor], dtype: Optional[torch.dtype]) -> Optional[torch.Tensor]:
    """A detached copy (in ``dtype``, else the same dtype) that is its own autograd leaf."""
    if t is None or not isinstance(t, torch.Tensor):
        return t
    copy = t.detach().to(dtype) if dtype is not None else t.detach().clone()
    return copy.requires_grad_(t.requires_grad and torch.is_grad_enabled() and copy.is_floating_point())


def _leaf64(t):
    return _leaf(t, torch.float64)


def _leaf_same(t):
    return _leaf(t, None)


def _expand_kv(query: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    if t.dim() >= 3 and t.shape[-3] != query.shape[-3]:
        return t.repeat_interleave(query.shape[-3] // t.shape[-3], dim=-3)
    return t


def visibility(query, key, mask, is_causal: bool, causal_offset: int, window=None) -> Optional[torch.Tensor]:
    """(..., L, S) bool of visible scores, or None when everything is visible: the mask and the
    band of ``is_causal`` / ``window`` (``launch.band``)."""
    seq_q, seq_k = query.shape[-2], key.shape[-2]
    vis = None
    if mask is not None:
        vis = mask if mask.dtype == torch.bool else ~mask.isneginf()
    band = resolve_band(is_causal, causal_offset, window, seq_q, seq_k)
    if band.lower is not None or band.upper is not None:
        in_band = band.visible(seq_q, seq_k, query.device)
        vis = in_band if vis is None else vis & in_band
    return vis


def scores(query, key, mask, scale, is_causal, causal_offset, dtype, window=None, softcap=0.0) -> torch.Tensor:
    """Scaled (soft-capped where ``softcap`` > 0), masked scores in ``dtype`` (-inf where hidden)."""
    q, k = query.to(dtype), _expand_kv(query, key).to(dtype)
    s = (q @ k.transpose(-2, -1)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if mask is not None and mask.dtype != torch.bool:
        s = s + mask.to(dtype)
    vis = visibility(query, key, mask, is_causal, causal_offset, window)
    if vis is not None:
        s = s.masked_fill(~vis, float("-inf"))
    return s


def _with_sink_column(s: torch.Tensor, sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """Scores (..., H, L, S) with each head's sink logit as one more column (none: as they are)."""
    if sinks is None:
        return s
    column = sinks.detach().to(s.dtype).reshape(-1, 1, 1).expand(*s.shape[:-1], 1)
    return torch.cat([s, column], dim=-1)


def _reference64(q, k, v, mask, *, scale, is_causal, causal_offset, window=None, softcap=0.0, sinks=None,
                 round_to_input=False):
    """Float64 attention with the package's semantics (a row with no visible key gives 0; sinks join
    the denominator only); with ``round_to_input``, rounded to the inputs' dtype (for an epilogue
    that multiplies by weights)."""
    with torch.autocast(q.device.type, enabled=False):
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        s = _with_sink_column(scores(q, k, mask, scale, is_causal, causal_offset, torch.float64, window, softcap),
                              sinks)
        row_max = s.detach().amax(-1, keepdim=True)
        row_max = row_max.masked_fill(~row_max.isfinite(), 0.0)
        unnorm = torch.exp(s - row_max)
        total = unnorm.sum(-1, keepdim=True)
        probs = unnorm / torch.where(total > 0, total, torch.ones_like(total))
        if sinks is not None:
            probs = probs[..., :-1]
        out = probs @ _expand_kv(q, v).to(torch.float64)
        return out.to(q.dtype) if round_to_input else out


def _baseline_same_dtype(q, k, v, mask, *, scale, is_causal, causal_offset, window=None, softcap=0.0, sinks=None):
    """PyTorch's own attention in the site's dtype: SDPA (the tolerance rule's baseline); under a
    soft cap or sinks, which SDPA lacks, the eager formula in that dtype (what a model's own code
    computes)."""
    with torch.autocast(q.device.type, enabled=False):
        k, v = k.to(q.dtype), v.to(q.dtype)
        if softcap or sinks is not None:
            scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
            s = _with_sink_column(scores(q, k, mask, scale, is_causal, causal_offset, q.dtype, window, softcap),
                                  sinks)
            probs = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)
            return (probs[..., :-1] if sinks is not None else probs) @ _expand_kv(q, v)
        attn_mask = mask
        if attn_mask is not None and attn_mask.dtype != torch.bool:
            attn_mask = attn_mask.to(q.dtype)
        causal = is_causal and causal_offset == 0 and attn_mask is None and not has_window(window)
        if (is_causal or has_window(window)) and not causal:
            vis = visibility(q, k, None, is_causal, causal_offset, window)
            attn_mask = vis if attn_mask is None else (
                attn_mask & vis if attn_mask.dtype == torch.bool else attn_mask.masked_fill(~vis, float("-inf")))
        return torch.nn.functional.scaled_dot_product_attention(
            q, _expand_kv(q, k), _expand_kv(q, v), attn_mask=attn_mask, is_causal=causal, scale=scale)


def document_visibility(sequence_ids: torch.Tensor) -> torch.Tensor:
    """(B, 1, L, L) bool: token i sees token j of its own document (equal ``sequence_ids``, the
    packed-sequence pass's (B, L) ids). The site is causal besides, which the band adds."""
    return (sequence_ids[:, :, None] == sequence_ids[:, None, :])[:, None]


def _probe(out, q, k, v, q1, k1, mask, ref, base, leaves64, leaves_same, *, site: int):
    """Runs after the site's output: hands this call to the active session (if any)."""
    session = active_session()
    if session is not None:
        session.on_forward(site, out, (q, k, v), q1, k1, mask, ref, base, leaves64, leaves_same)


# ------------------------------------------------------------------------------------------
# Graph instrumentation
# ------------------------------------------------------------------------------------------


def _copy_nodes(graph: fx.Graph, nodes: list[fx.Node], env: dict) -> None:
    for node in nodes:
        env[node] = graph.node_copy(node, lambda n: env.get(n, n))


def _forget_epilogue_replacement(site: AttentionSite) -> None:
    """The hand-written family's epilogue records "output -> replacement" in its plan so later
    sites resolve through it; ours is a side computation, not a replacement: undo that."""
    for cell in getattr(site.epilogue, "__closure__", None) or ():
        plan = cell.cell_contents
        replaced = getattr(plan, "replaced", None)
        if isinstance(replaced, dict) and getattr(plan, "output", None) in replaced:
            replaced.pop(plan.output)


def _instrument_site(graph: fx.Graph, site: AttentionSite, index: int, shadow: bool) -> None:
    anchor = site.output
    # Insert after the output, so nothing the site computes moves.
    with graph.inserting_after(anchor):
        marker = graph.call_function(torch._assert, (True, "flash_inductor.debug"))
    with graph.inserting_before(marker):
        existing = set(graph.nodes)
        q, k, v, mask = site.query, site.key, site.value, site.attn_mask
        if site.prologue is not None:
            q1, k1, v1, m1 = site.prologue(graph, q, k, v, mask)
        else:
            q1, k1, v1, m1 = q, k, v, mask
        prologue_nodes = [n for n in graph.nodes if n not in existing and n is not marker]
        if getattr(site, "sequence_ids", None) is not None:
            # A packed site (passes/packed.py) runs varlen and has no mask; its twins and the
            # statistics see the same documents as a dense mask (debug sizes are small).
            m1 = graph.call_function(document_visibility, (site.sequence_ids,))
        kwargs = dict(scale=site.scale, is_causal=site.is_causal, causal_offset=getattr(site, "causal_offset", 0),
                      window=getattr(site, "window", None), softcap=getattr(site, "softcap", None) or 0.0,
                      sinks=getattr(site, "sinks", None))
        ref = base = leaves64 = leaves_same = None
        if shadow:
            sides = []
            # nn.MultiheadAttention's prologue and epilogue hold its projections, whose weights are in
            # the model's dtype: its float64 twin starts after the in-projection and is rounded back
            # before the out-projection.
            projected = site.pattern.startswith("mha")
            twin = (_leaf_same, _reference64, dict(round_to_input=True)) if projected else (_leaf64, _reference64, {})
            for make_leaf, attention, extra in (twin, (_leaf_same, _baseline_same_dtype, {})):
                leaves = [graph.call_function(make_leaf, (t,)) for t in (q, k, v)]
                env = dict(zip((q, k, v), leaves))
                _copy_nodes(graph, prologue_nodes, env)
                call = graph.call_function(attention, (env.get(q1, q1), env.get(k1, k1), env.get(v1, v1),
                                                       env.get(m1, m1)), {**kwargs, **extra})
                result = site.epilogue(graph, call) if site.epilogue is not None else call
                if site.epilogue is not None:
                    _forget_epilogue_replacement(site)
                sides.append((result, leaves))
            (ref, leaves64), (base, leaves_same) = sides
        graph.call_function(_probe, (anchor, q, k, v, q1, k1, m1, ref, base, leaves64, leaves_same),
                            {"site": index})
    graph.erase_node(marker)


def find_sites(graph: fx.Graph) -> tuple[list[AttentionSite], list[KeptSite]]:
    sites, kept = [], []
    for family in (*_FAMILIES, _our_op_sites):
        for found in list(family(graph)):
            (kept if isinstance(found, KeptSite) else sites).append(found)
    return sites, kept


class InstrumentingBackend:
    """A torch.compile backend that instruments every attention site and runs the graph as
    captured. ``session`` receives :class:`SiteInfo` registrations and the probes' calls."""

    def __init__(self, session, shadow: bool, root: Optional[torch.nn.Module] = None):
        self.session = session
        self.shadow = shadow
        self.root = root

    def __call__(self, gm: fx.GraphModule, example_inputs):
        sites, kept = find_sites(gm.graph)
        records = []
        for site in sites:
            path, cls = module_path([site.output, *site.anchors])
            records.append(SiteRecord(site.pattern, site.output.name, True, "", path, cls))
        for site in kept:
            path, cls = module_path([site.node, *site.related])
            self.session.on_kept(path, site.pattern, site.reason)
        if self.root is not None:
            records = [dataclasses.replace(r, module=_path_from_root(self.root, r.module, r.module_type))
                       for r in records]
        for site, record in zip(sites, records):
            dropout = float(site.dropout_p or 0.0)
            info = SiteInfo(
                name="", pattern=site.pattern, module=record.module, is_causal=bool(site.is_causal),
                causal_offset=getattr(site, "causal_offset", 0), scale=site.scale, enable_gqa=bool(site.enable_gqa),
                dropout_p=dropout, shadow=self.shadow and dropout == 0.0,
                window=tuple(getattr(site, "window", None) or NO_WINDOW),
                softcap=float(getattr(site, "softcap", None) or 0.0))
            index = self.session.register_site(info)
            _instrument_site(gm.graph, site, index, info.shadow)
        gm.graph.lint()
        gm.recompile()
        return gm.forward


def _path_from_root(root: torch.nn.Module, path: Optional[str], cls: Optional[type]) -> Optional[str]:
    """After a graph break dynamo traces an inner module's frame and records paths relative to it
    (as ``explain`` corrects too): complete a path that names a module of ``cls`` under exactly one
    submodule of ``root``."""
    modules = dict(root.named_modules())

    def fits(candidate: str) -> bool:
        return candidate in modules and (cls is None or type(modules[candidate]) is cls)

    if path is None or fits(path):
        return path
    owners = [prefix for prefix in modules if prefix and fits(f"{prefix}.{path}")]
    return f"{owners[0]}.{path}" if len(owners) == 1 else path


class Instrumented:
    """Context manager: ``model`` runs instrumented (compiled in place with
    :class:`InstrumentingBackend`) inside, and exactly as before outside."""

    def __init__(self, model: torch.nn.Module, session, shadow: bool):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"flash_inductor.debug: model must be an nn.Module, got {type(model).__name__}.")
        self.model = getattr(model, "_orig_mod", model)
        self.session = session
        self.shadow = shadow
        self._saved = None
        self._config = None

    def __enter__(self):
        self._saved = self.model.__dict__.get("_compiled_call_impl")
        backend = InstrumentingBackend(self.session, self.shadow, self.model)
        # Each length or step shape is a new graph; a long bisection must not hit the limit.
        self._config = torch._dynamo.config.patch(recompile_limit=1024, accumulated_recompile_limit=4096)
        self._config.__enter__()
        self.model._compiled_call_impl = torch.compile(self.model._call_impl, backend=backend, dynamic=False)
        _ACTIVE.append(self.session)
        return self.session

    def __exit__(self, *exc):
        _ACTIVE.remove(self.session)
        self.model._compiled_call_impl = self._saved
        self._config.__exit__(*exc)
