"""The attention sinks' gradient (``kernels/sinks.py``). The sinks themselves go into the forward
kernels' epilogues (``launch.attention_forward`` / ``launch.hopper.hopper_attention_forward``'s
``sinks``); the backward kernels need nothing more, since (out', lse') already carry them."""

from __future__ import annotations

import torch

from ..tuning.kernel_config import padded_head_dim
from . import common
from .common import cdiv


def sinks_backward(grad_out: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, grad_lse: torch.Tensor | None,
                   sinks: torch.Tensor) -> torch.Tensor:
    """d sinks (Hq,) in the sinks' dtype from the forward's (out, lse) with the sinks in them and their
    gradients: one pass over dO and out (a program per 64 rows of a head), the partial sums added in a
    fixed order. ``grad_out``/``out`` (B, Hq, L, Ev), ``lse``/``grad_lse`` (B, Hq, L)."""
    from ..kernels.sinks import _sinks_grad_partials

    batch, heads_q, seq_q, head_dim_v = out.shape
    if batch * heads_q * seq_q == 0:
        return torch.zeros_like(sinks)
    block_m = 64
    row_programs = cdiv(seq_q, block_m)
    partial = torch.empty((row_programs, batch, heads_q), dtype=torch.float32, device=out.device)
    lse = lse.to(torch.float32).contiguous()
    dlse = grad_lse.to(torch.float32).contiguous() if grad_lse is not None else lse  # lse: not read
    common.launcher(_sinks_grad_partials)[(row_programs, batch * heads_q)](
        grad_out, out, lse, dlse, sinks.to(torch.float32).contiguous(), partial,
        *grad_out.stride(), *out.stride(), heads_q, seq_q,
        HEAD_DIM=head_dim_v, BLOCK_E=padded_head_dim(head_dim_v), BLOCK_M=block_m, HAS_DLSE=grad_lse is not None,
        num_warps=4,
    )
    return (-partial.sum(dim=(0, 1))).to(sinks.dtype)
