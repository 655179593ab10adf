"""Validation of the arguments ``flash_attention`` and ``flash_attention_varlen`` share (dropout,
soft-capping, sinks): each error names the argument and the fix."""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor


def resolve_dropout(dropout_p, caller: str = "flash_attention") -> float:
    """``dropout_p`` as a Python float in [0, 1): any real number SDPA takes (NumPy scalars and
    one-element tensors too, as ``scale``)."""
    value = math.nan
    if isinstance(dropout_p, Tensor):
        one_real = dropout_p.numel() == 1 and not dropout_p.is_complex() and dropout_p.dtype != torch.bool
        if one_real and not torch.compiler.is_compiling():
            value = float(dropout_p)
    elif isinstance(dropout_p, numbers.Real) and not isinstance(dropout_p, bool):
        value = float(dropout_p)
    if not 0.0 <= value < 1.0:  # NaN, and anything unreadable, fails here too
        raise ValueError(f"{caller}: dropout_p must be a real number in [0, 1) (a float, a NumPy scalar or a "
                         f"one-element tensor), got {dropout_p!r}.")
    return value


def resolve_softcap(softcap, caller: str = "flash_attention") -> float:
    """``softcap`` as a float: 0.0 for None or 0 (no cap, FlashAttention's convention), else a
    finite positive real (NumPy scalars and one-element tensors too, as ``scale``)."""
    if softcap is None:
        return 0.0
    value = None
    if isinstance(softcap, Tensor):
        if softcap.numel() == 1 and softcap.is_floating_point() and not torch.compiler.is_compiling():
            value = float(softcap)
    elif isinstance(softcap, numbers.Real) and not isinstance(softcap, bool):
        value = float(softcap)
    if value is None or not math.isfinite(value) or value < 0:
        raise ValueError(
            f"{caller}: softcap must be None or a finite real number >= 0 (0 = no cap), got {softcap!r}; "
            "Gemma 2 uses config.attn_logit_softcapping = 50.0."
        )
    return value


def check_fp8_softcap(softcap: float) -> None:
    """The fp8 schedule runs only the fp8 kernels, which have no soft cap: refuse rather than drop it."""
    if softcap:
        raise ValueError(
            f"flash_attention: softcap={softcap} is not supported with schedule='fp8' (the fp8 kernels have no "
            "soft cap); use schedule='stable' (the default) or another 16-bit schedule."
        )


def check_sinks(sinks, query: Tensor, heads_q: int, caller: str = "flash_attention") -> None:
    """``sinks`` is None or a floating tensor of shape ``(heads_q,)`` on the query's device."""
    if sinks is None:
        return
    if not isinstance(sinks, Tensor):
        raise TypeError(f"{caller}: sinks must be a tensor of shape (query heads,) or None, got {type(sinks).__name__}.")
    if not sinks.is_floating_point():
        raise TypeError(f"{caller}: sinks must be a floating tensor (one logit per query head), got {sinks.dtype}.")
    if tuple(sinks.shape) != (heads_q,):
        raise ValueError(
            f"{caller}: sinks must have shape ({heads_q},), one logit per query head, got {tuple(sinks.shape)}; "
            "gpt-oss passes module.sinks (num_attention_heads,)."
        )
    if sinks.device != query.device:
        raise ValueError(f"{caller}: sinks is on {sinks.device} but query is on {query.device}; move it there.")
