"""Float64-able references for the attention variants, written from their definitions (not from
the op): soft-capping and sinks on dense inputs, and packed sequences one at a time."""

from __future__ import annotations

import math

import torch


def variant_reference(q, k, v, *, scale=None, softcap=0.0, sinks=None, visible=None):
    """softmax over [capped scores, sink] without the sink's column, times V, in q's dtype;
    q (B, Hq, L, E), k/v (B, Hkv, S, E); visible (L, S) bool or None. A row whose keys are all
    hidden gets 0 (its weights are 0 or the sink's alone)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink_column = sinks.to(s.dtype)[None, :, None, None].expand(*s.shape[:-1], 1)
        s = torch.cat([s, sink_column], dim=-1)
    p = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)
    if sinks is not None:
        p = p[..., :-1]
    return p @ v


def varlen_reference(q, k, v, lengths_q, lengths_k, *, causal, window=(-1, -1), softcap=0.0, sinks=None,
                     lower_right=True):
    """Each sequence alone through variant_reference, bottom-right (or top-left) aligned."""
    outs, q0, k0 = [], 0, 0
    for len_q, len_k in zip(lengths_q, lengths_k):
        qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (q[q0:q0 + len_q], k[k0:k0 + len_k], v[k0:k0 + len_k]))
        i = torch.arange(len_q, device=q.device)[:, None]
        j = torch.arange(len_k, device=q.device)[None, :]
        offset = (len_k - len_q) if lower_right else 0
        visible = torch.ones(len_q, len_k, dtype=torch.bool, device=q.device)
        if causal:
            visible &= j <= i + offset
        if window[0] >= 0:
            visible &= j - (i + len_k - len_q) >= -window[0]
        if window[1] >= 0:
            visible &= j - (i + len_k - len_q) <= window[1]
        outs.append(variant_reference(qs, ks, vs, softcap=softcap, sinks=sinks, visible=visible)[0].transpose(0, 1))
        q0, k0 = q0 + len_q, k0 + len_k
    return torch.cat(outs)


def term_magnitudes(q, k, v, grad_out, *, scale=None, softcap=0.0, sinks=None, visible=None, mask=None,
                    dropped=None, grad_lse=None) -> dict:
    """The largest sum of |terms| behind each result of one dense problem (helpers._term_magnitudes'
    rule, which the tolerance's fp32 floor scales with): q (B, Hq, L, E), k/v (B, Hkv, S, E),
    ``visible`` bool and ``mask`` (bool or additive float) broadcastable to the scores, ``dropped``
    the dropout's keep mask times 1/(1-p) or None, ``grad_lse`` the LSE's gradient. dS reaches dq and dk through the soft cap's
    slope; the sinks' gradient sums a row term per (batch, row)."""
    q, k, v, grad_out = (t.detach().double() for t in (q, k, v, grad_out))
    group = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ kr.transpose(-1, -2)) * scale
    slope = torch.ones_like(s)
    if softcap:
        slope = 1 - torch.tanh(s / softcap) ** 2
        s = softcap * torch.tanh(s / softcap)
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.detach().double()
    if sinks is not None:
        s = torch.cat([s, sinks.detach().double()[None, :, None, None].expand(*s.shape[:-1], 1)], dim=-1)
    probs = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)
    sink_probs = probs[..., -1] if sinks is not None else None
    probs = probs[..., :-1] if sinks is not None else probs
    used = probs if dropped is None else probs * dropped.double()
    out = used @ vr
    grad_probs = grad_out @ vr.transpose(-1, -2)
    if dropped is not None:
        grad_probs = grad_probs * dropped.double()
    row_dot = (grad_out * out).sum(-1)
    delta = row_dot if grad_lse is None else row_dot - grad_lse.double()
    ds_terms = probs * (grad_probs.abs() + delta.abs()[..., None]) * slope

    def group_sum(t):
        return t.unflatten(1, (k.shape[1], group)).sum(2)

    terms = dict(out=(used @ vr.abs()).max().item(), dv=group_sum(used.transpose(-1, -2) @ grad_out.abs()).max().item(),
                 dq=scale * (ds_terms @ kr.abs()).max().item(),
                 dk=scale * group_sum(ds_terms.transpose(-1, -2) @ q.abs()).max().item(),
                 dmask=(probs * (grad_probs.abs() + delta.abs()[..., None])).max().item())
    if sink_probs is not None:
        terms["dsinks_per_head"] = (sink_probs * row_dot.abs()).sum(dim=(0, 2))
        terms["dsinks"] = terms["dsinks_per_head"].max().item()
    return terms


def varlen_term_magnitudes(q, k, v, grad_out, lengths_q, lengths_k, *, causal, window=(-1, -1), softcap=0.0,
                           sinks=None, lower_right=True) -> dict:
    """:func:`term_magnitudes` of packed sequences: each sequence's, the largest of each; the sinks'
    gradient sums over the sequences."""
    merged, sink_sums, q0, k0 = {}, None, 0, 0
    for len_q, len_k in zip(lengths_q, lengths_k):
        if len_q and len_k:
            views = [t.transpose(0, 1).unsqueeze(0) for t in (q[q0:q0 + len_q], k[k0:k0 + len_k], v[k0:k0 + len_k],
                                                                grad_out[q0:q0 + len_q])]
            i = torch.arange(len_q, device=q.device)[:, None]
            j = torch.arange(len_k, device=q.device)[None, :]
            visible = torch.ones(len_q, len_k, dtype=torch.bool, device=q.device)
            if causal:
                visible &= j <= i + ((len_k - len_q) if lower_right else 0)
            if window[0] >= 0:
                visible &= j - (i + len_k - len_q) >= -window[0]
            if window[1] >= 0:
                visible &= j - (i + len_k - len_q) <= window[1]
            terms = term_magnitudes(*views, softcap=softcap, sinks=sinks, visible=visible)
            for name, value in terms.items():
                if name == "dsinks_per_head":
                    sink_sums = value if sink_sums is None else sink_sums + value
                elif name != "dsinks":
                    merged[name] = max(merged.get(name, 0.0), value)
        q0, k0 = q0 + len_q, k0 + len_k
    if sink_sums is not None:
        merged["dsinks"] = sink_sums.max().item()
    return merged
