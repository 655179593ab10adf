"""The recording ops of compiled graphs: identities around one attention call that record its statistics.

* ``flash_inductor::monitor_inputs(q, k, v, site) -> (q, k, v)`` sits before the attention op;
  its backward passes dq, dk, dv through ``flash_inductor::monitor_grads``, which records their
  non-finite counts (the gradients of q/k/v are only visible upstream of the attention op).
* ``flash_inductor::monitor_output(out, lse, site, seq_k) -> out`` sits after it and records
  the forward statistics (``stats.forward_stats``).

They are opaque custom ops with a Python side effect (``session.record``). Why identities that
return copies rather than ops returning nothing: a graph compiler removes an op whose result
nobody reads, but every attention result flows through these, so they stay in the compiled
forward and backward graphs. A custom op may not return an alias of its input, hence the copy
(written in the pass that counts, see ``device_stats``); compiled, monitoring measured +1.6 % of
forward time on an H200.

Only graphs built by ``make_backend(monitor=True)`` use them. Eager calls have no compiler to
survive and record without any copy (``eager.py``): the copies made an eager forward at seq 4k
about 15 % slower.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import device_stats, session
from .stats import backward_stats, forward_stats


@torch.library.custom_op("flash_inductor::monitor_output", mutates_args=())
def monitor_output(out: Tensor, lse: Tensor, site: str, seq_k: int) -> Tensor:
    if device_stats.supports(out, lse):  # the copy and the statistics in one pass, two launches
        copy, record = device_stats.copy_and_forward_record(out, lse, seq_k)
        session.record(site, "forward", record)
        return copy
    session.record(site, "forward", forward_stats(out, lse, seq_k))
    return out.clone()


@monitor_output.register_fake
def _(out, lse, site, seq_k):
    return torch.empty_like(out)


def _output_backward(ctx, grad):
    return grad, None, None, None


monitor_output.register_autograd(_output_backward, setup_context=lambda ctx, inputs, output: None)


@torch.library.custom_op("flash_inductor::monitor_grads", mutates_args=())
def monitor_grads(dq: Tensor, dk: Tensor, dv: Tensor, site: str) -> tuple[Tensor, Tensor, Tensor]:
    if device_stats.supports(dq, dk, dv):
        copies, record = device_stats.copy_and_backward_record(dq, dk, dv)
        session.record(site, "backward", record)
        return copies
    session.record(site, "backward", backward_stats(dq, dk, dv))
    return dq.clone(), dk.clone(), dv.clone()


@monitor_grads.register_fake
def _(dq, dk, dv, site):
    return torch.empty_like(dq), torch.empty_like(dk), torch.empty_like(dv)


@torch.library.custom_op("flash_inductor::monitor_inputs", mutates_args=())
def monitor_inputs(query: Tensor, key: Tensor, value: Tensor, site: str) -> tuple[Tensor, Tensor, Tensor]:
    return query.clone(), key.clone(), value.clone()


@monitor_inputs.register_fake
def _(query, key, value, site):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _inputs_setup(ctx, inputs, output):
    query, key, value, site = inputs
    ctx.site = site
    ctx.shapes = [(t.shape, t.dtype, t.device) for t in (query, key, value)]


def _inputs_backward(ctx, dq, dk, dv):
    # An input that did not need a gradient may come back as None; count it as all-finite zeros.
    grads = [g if g is not None else torch.zeros(s, dtype=d, device=dev) for g, (s, d, dev) in zip((dq, dk, dv), ctx.shapes)]
    dq, dk, dv = torch.ops.flash_inductor.monitor_grads(*grads, ctx.site)
    return dq, dk, dv, None


monitor_inputs.register_autograd(_inputs_backward, setup_context=_inputs_setup)


def watch_inputs(query: Tensor, key: Tensor, value: Tensor, site: str) -> tuple[Tensor, Tensor, Tensor]:
    """Route q, k, v through ``monitor_inputs`` when a backward can follow; else leave them alone."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        return torch.ops.flash_inductor.monitor_inputs(query, key, value, site)
    return query, key, value


def watch_output(out: Tensor, lse: Tensor, site: str, seq_k: int) -> Tensor:
    # seq_k stays symbolic under dynamic shapes (the schema's int is a SymInt): no specialisation.
    return torch.ops.flash_inductor.monitor_output(out, lse, site, seq_k)
