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
