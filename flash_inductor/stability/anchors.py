"""The implementations the suite compares: our op under every precision schedule, and the anchors.

Anchors (shared/ANCHORS.md), all in the problem's dtype:
  * ``sdpa:flash``, ``sdpa:cudnn``, ``sdpa:efficient``, ``sdpa:math`` -- SDPA with the backend
    forced through ``torch.nn.attention.sdpa_kernel``; a backend that cannot take the problem
    raises, and the suite records it as n/a;
  * ``flex`` -- compiled FlexAttention (CUDA only): causal and bool masks as a block mask,
    additive masks as a score_mod;
  * ``eager`` -- attention as research code writes it, ``softmax(q @ k.T * scale + mask) @ v``.

``sdpa:math`` and ``eager`` materialise the (B, H, L, S) scores; beyond :data:`MAX_MATERIALISED`
elements they are skipped rather than allowed to run out of memory.

The variant cases (cases.Problem.variants): SDPA has no soft-cap or sinks (n/a there); ``eager``
writes them as Gemma 2 and gpt-oss do (``tanh`` on the scores; the sinks concatenated as one more
column, the softmax taken, the column dropped), and ``flex`` takes the soft-cap as a score_mod. A
packed problem runs ``flash_attention_varlen`` as ours and its dense document mask for the anchors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..api import flash_attention
from ..varlen import flash_attention_varlen
from ..schedules import DEFAULT_SCHEDULE, SCHEDULES
from .cases import Problem

# 2^31 scores: 4 GiB in fp16 per intermediate. The 32k case (1 x 2 heads x 32k x 32k) is at the
# limit; 64k and 128k would need tens of GiB per intermediate.
MAX_MATERIALISED = 2**31


class NotApplicable(Exception):
    """The implementation does not exist for this problem or device (recorded as n/a)."""


@dataclasses.dataclass(frozen=True)
class Implementation:
    name: str
    run: Callable[[Problem, Tensor, Tensor, Tensor], Tensor]
    is_ours: bool = False
    schedule: Optional[str] = None
    materialises: bool = False

    @property
    def is_default(self) -> bool:
        return self.is_ours and self.schedule == DEFAULT_SCHEDULE


def ours_name(schedule: str) -> str:
    return f"ours:{schedule}"


def _ours(schedule: str) -> Callable:
    def run(p: Problem, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if SCHEDULES[schedule].fp8_forward and (p.softcap is not None or p.cu_seqlens is not None):
            # The op refuses these (the fp8 kernels have neither); a documented refusal is n/a, not an error.
            raise NotApplicable(f"schedule {schedule!r} takes no soft-cap or packed sequences")
        if p.cu_seqlens is not None:
            return _ours_packed(p, q, k, v, schedule)
        return flash_attention(q, k, v, attn_mask=p.attn_mask, is_causal=p.is_causal, scale=p.scale, schedule=schedule,
                               softcap=p.softcap, sinks=p.sinks)
    return run


def _ours_packed(p: Problem, q: Tensor, k: Tensor, v: Tensor, schedule: str) -> Tensor:
    """A packed problem (B = 1) as a padding-free batch hands it over: (total, H, E) rows and the
    documents' offsets; the dense ``attn_mask`` is the anchors' and is not passed."""
    rows = lambda t: t[0].transpose(0, 1)  # (1, H, L, E) -> (L, H, E)
    longest = int((p.cu_seqlens[1:] - p.cu_seqlens[:-1]).max())
    out = flash_attention_varlen(rows(q), rows(k), rows(v), p.cu_seqlens, p.cu_seqlens, longest, longest,
                                 softmax_scale=p.scale, causal=True, softcap=p.softcap or 0.0, sinks=p.sinks,
                                 schedule=schedule)
    return out.transpose(0, 1)[None]


def _sdpa(backend: str) -> Callable:
    def run(p: Problem, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if p.softcap is not None or p.sinks is not None:
            raise NotApplicable("SDPA has no soft-cap or sinks")
        if not hasattr(SDPBackend, backend):
            raise NotApplicable(f"this torch has no SDPBackend.{backend}")
        # The backward kernel is tied to the forward's op, so only the forward needs the context.
        with sdpa_kernel(getattr(SDPBackend, backend)):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=p.attn_mask, is_causal=p.is_causal, scale=p.scale)
    return run


def _eager(p: Problem, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    scale = p.scale if p.scale is not None else 1.0 / math.sqrt(q.shape[-1])
    att = (q @ k.transpose(-2, -1)) * scale
    if p.softcap is not None:
        att = torch.tanh(att / p.softcap) * p.softcap  # Gemma 2's eager order: before the mask
    if p.attn_mask is not None:
        att = att.masked_fill(~p.attn_mask, float("-inf")) if p.attn_mask.dtype == torch.bool else att + p.attn_mask
    if p.is_causal:
        seq_q, seq_k = q.shape[-2], k.shape[-2]
        causal = torch.ones(seq_q, seq_k, dtype=torch.bool, device=q.device).tril()
        att = att.masked_fill(~causal, float("-inf"))
    if p.sinks is None:
        return att.softmax(dim=-1) @ v
    # gpt-oss's eager attention: the sink as one more column, the row max over it subtracted, softmax in the dtype.
    sink = p.sinks.to(att.dtype).reshape(1, -1, 1, 1).expand(*att.shape[:-1], 1)
    combined = torch.cat([att, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return combined.softmax(dim=-1)[..., :-1] @ v


_COMPILED_FLEX: list = []


def _compiled_flex():
    if not _COMPILED_FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        _COMPILED_FLEX.append(torch.compile(flex_attention, dynamic=False))
    return _COMPILED_FLEX[0]


def _causal_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@contextlib.contextmanager
def flex_recompile_room(limit: int = 1024):
    """Every case x dtype is a new shape or mod for FlexAttention; at dynamo's default limit
    of 8 recompiles it would silently fall back to a slow path (ANCHORS.md)."""
    patches = {name: limit for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                                        "accumulated_recompile_limit") if hasattr(torch._dynamo.config, name)}
    with torch._dynamo.config.patch(**patches):
        yield


def _flex(p: Problem, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    if q.device.type != "cuda":
        raise NotApplicable("FlexAttention runs compiled on CUDA only")
    if p.sinks is not None:
        raise NotApplicable("FlexAttention has no sinks")
    from torch.nn.attention.flex_attention import create_block_mask

    batch, heads, seq_q, _ = q.shape
    seq_k = k.shape[-2]
    score_mod = block_mask = None
    if p.is_causal:
        block_mask = create_block_mask(_causal_mod, None, None, seq_q, seq_k, device=q.device)
    elif p.attn_mask is not None:
        full = p.attn_mask.expand(batch, heads, seq_q, seq_k).contiguous()
        if full.dtype == torch.bool:
            def mask_mod(b, h, q_idx, kv_idx):
                return full[b, h, q_idx, kv_idx]
            block_mask = create_block_mask(mask_mod, batch, heads, seq_q, seq_k, device=q.device)
        else:
            def score_mod(score, b, h, q_idx, kv_idx):
                return score + full[b, h, q_idx, kv_idx]
    if p.softcap is not None:
        score_mod = _capped(score_mod, p.softcap)
    with flex_recompile_room():
        return _compiled_flex()(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=p.scale)


def _capped(score_mod: Optional[Callable], cap: float) -> Callable:
    """The soft-cap as Flex sees scores (already scaled), before any additive mask."""
    def capped(score, b, h, q_idx, kv_idx):
        score = torch.tanh(score / cap) * cap
        return score if score_mod is None else score_mod(score, b, h, q_idx, kv_idx)
    return capped


def implementations(names: Optional[list[str]] = None) -> list[Implementation]:
    """Ours under each schedule, then the anchors; ``names`` filters (None = all)."""
    impls = [Implementation(ours_name(s), _ours(s), is_ours=True, schedule=s) for s in SCHEDULES]
    impls += [
        Implementation("sdpa:flash", _sdpa("FLASH_ATTENTION")),
        Implementation("sdpa:cudnn", _sdpa("CUDNN_ATTENTION")),
        Implementation("sdpa:efficient", _sdpa("EFFICIENT_ATTENTION")),
        Implementation("sdpa:math", _sdpa("MATH"), materialises=True),
        Implementation("flex", _flex),
        Implementation("eager", _eager, materialises=True),
    ]
    if names:
        known = {i.name for i in impls}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ValueError(f"--impls: unknown {unknown}; choose from {sorted(known)}")
        impls = [i for i in impls if i.name in names]
    return impls
