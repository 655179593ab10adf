"""Recording eager ``flash_attention`` calls without copying anything.

The identity ops of ``ops.py`` exist for graph compilers, which would drop an op whose result
nobody reads; they must return copies, and those copies cost an eager forward about 15 % at
seq 4k. Eager code has no compiler to hide from, so here the statistics are computed straight
from the tensors the call already has:

* forward: ``record_forward`` reads ``out`` and ``lse`` once, right after the attention op;
* backward: ``watch_gradients`` puts a view (``t.view_as(t)``) of each input that needs a
  gradient in front of the attention op and one ``register_multi_grad_hook`` over those views,
  which reads dq, dk, dv once when the backward has computed them and leaves them unchanged.
  The hook sits on a fresh view, not on the caller's tensor, so it is freed with the call's
  autograd graph: a leaf passed to many calls collects no hooks. (A multi-grad hook on a leaf
  would also break ``torch.autograd.grad``, which cannot tell whether a leaf's node will run.)

Records go to the session active when the data is recorded (``session.record``), as with the
identity ops.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch
from torch import Tensor

from . import device_stats, naming, session
from .stats import backward_stats, forward_stats


def eager_site() -> Optional[str]:
    """The site name an eager call records under, or None (the common case) when nothing is monitored.

    Code that dynamo traces sees None without reading the session list (is_compiling() is a
    constant there), so compiled graphs carry no guard on monitoring and never change with it.
    """
    if torch.compiler.is_compiling():
        return None
    active = session.active_monitor()
    return None if active is None else naming.eager_site_name(active)


def record_forward(out: Tensor, lse: Tensor, site: str, seq_k: int) -> None:
    """Record the forward statistics of one call from its output and LSE (read, not copied)."""
    with torch.no_grad():
        if device_stats.supports(out, lse):
            record = device_stats.forward_record(out, lse, seq_k)
        else:
            record = forward_stats(out, lse, seq_k)
    session.record(site, "forward", record)


def watch_gradients(query: Tensor, key: Tensor, value: Tensor, site: str) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v for the attention op: views carrying the backward's recording hook for those
    that need a gradient, the tensors themselves for the others (and all of them when no
    backward can follow)."""
    inputs = (query, key, value)
    wants_grad = tuple(t.requires_grad for t in inputs)
    if not torch.is_grad_enabled() or not any(wants_grad):
        return inputs
    # A view is a new autograd node: the hook lives and dies with this call's graph.
    watched = tuple(t.view_as(t) if wants else t for t, wants in zip(inputs, wants_grad))
    torch.autograd.graph.register_multi_grad_hook(
        [t for t, wants in zip(watched, wants_grad) if wants],
        functools.partial(_record_backward, site, wants_grad),
    )
    return watched


def _record_backward(site: str, wants_grad: tuple[bool, bool, bool], grads: Sequence[Optional[Tensor]]) -> None:
    """The multi-grad hook: ``grads`` has one entry per hooked view, None where this backward
    did not compute it (``torch.autograd.grad`` asked for other inputs). Returns None, so the
    gradients pass on unchanged."""
    hooked = iter(grads)
    dq, dk, dv = (next(hooked) if wants else None for wants in wants_grad)
    present = [g for g in (dq, dk, dv) if g is not None]
    # Under create_graph the backward runs with grad mode on; the statistics are not part of it.
    with torch.no_grad():
        if present and device_stats.supports(*present):
            record = device_stats.backward_record(dq, dk, dv)
        else:  # non-contiguous gradients, or a device the kernels do not take
            record = backward_stats(dq, dk, dv)
    session.record(site, "backward", record)
