"""The `stable` schedule on the Gluon Hopper kernels: an exact Δ in a one-pass backward.

`stable`'s exact Δ needs, for each query row, Σ_j P_ij dP_ij with the very P the backward uses,
before dK and dV may use it. The Triton backward gets it from a second pass over the keys. Here the
forward makes it cheap instead (docs/hopper_backward.md, "Exact Δ in one pass"): it rounds P for
P·V in a way the backward can repeat bit for bit, and stores O's rounding residual, so that
Δ = dO'·(O + residual) is exact for that P; the one-pass kernel then does five GEMMs per tile
pair, as `fast` does. dS's own rounding for dS·K would still meet whatever the keys share
(near-tied keys), so the backward's dQ GEMM takes centred keys K̃ = K − k̂ (:func:`key_mean`),
exact in K's dtype, which the kernel forms in shared memory from its K tile; Sᵀ keeps K, so its P̃
is the forward's bit for bit, and dq gets scale·dLSE·k̂ back. The forward never sees k̂. The path
needs more tensors from the forward to the backward than ``attention_forward`` returns, so it has
its own pair of ops:

* ``flash_inductor::attention_forward_one_pass(q, k, v, is_causal, causal_offset, scale,
  window_left=-1, window_right=-1, attn_mask=None, block_map=None, block_q=0, block_k=0, softcap=0.0,
  sinks=None) -> (out, lse, residual, row_constants)``
* ``flash_inductor::attention_backward_one_pass(dout, q, k, v, out, lse, dlse?, residual,
  row_constants, is_causal, causal_offset, scale, window_left=-1, window_right=-1,
  attn_mask=None, block_map=None, block_q=0, block_k=0, softcap=0.0, sinks=None) -> (dq, dk, dv)``

``softcap`` > 0 is FlashAttention-2's soft cap, as ``flash_inductor::attention_forward`` takes it
(kernels/hopper_fwd.py, SOFTCAP). Under a cap the backward's dQ GEMM takes K itself, not K̃: a
capped row's dU = dS∘(1 − t²) does not sum to dLSE, which the centred dQ's add-back needs.

``sinks`` (Hq,) are attention sinks (ops/sinks.py): the forward's epilogue puts them in out, lse and
the row constants; the backward needs them for the centred dq's finish (a row of dS sums to
dLSE_i + p_i·Δ_i with them, ``launch.hopper_bwd``), and the sinks' own gradient is
``flash_inductor::attention_sinks_backward``, which autograd calls beside it.

``attn_mask`` is a key mask (``launch.hopper.key_mask_unsupported_reason``: one row for every
query, as padding masks are), bool or additive, which neither needs nor gets a gradient.
``block_map`` is a block-sparse layout of ``block_q`` x ``block_k`` blocks, as
``flash_inductor::attention_forward`` takes it, with blocks the Hopper kernels take
(``launch.block_tiles.gluon_layout_fits``).

``attention_forward_eager`` (ops/attention.py) routes a call here when :func:`one_pass_applies`
says so, from static properties alone (safe on fake tensors), so a traced graph holds these ops
exactly where they will run (measured faster than the Triton `stable` backward, and meeting the
stability requirement: docs/hopper_backward.md). Inputs TMA cannot address
are copied first. Under ``torch.use_deterministic_algorithms(True)`` the backward runs the Triton
`stable` kernels, which take the same out and lse.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import launch
from ..launch import hopper, hopper_bwd
from ..launch.visibility import Visibility
from .functorch import transform_function, under_transform
from .sinks import attention_sinks_backward, sinks_backward_reference


def one_pass_applies(query, key, value, attn_mask, dropout_p: float, scale: float, schedule: str,
                     window=None, block_sizes: tuple[int, int] | None = None) -> bool:
    """Whether a call takes this path: ``one_pass_unsupported_reason`` finds nothing against it."""
    return hopper_bwd.one_pass_unsupported_reason(query, key, value, attn_mask, dropout_p, scale, schedule,
                                                  window=window, block_sizes=block_sizes) is None


def key_mean_reference(key: Tensor) -> Tensor:
    """k̂ (B, Hkv, E) fp32: per head and dimension, the keys' mean rounded to their dtype where
    every key's component lies within a factor of two of it, else 0. Then K̃ = K − k̂ is exact in
    K's dtype (Sterbenz: the difference of two floats within a factor of two of each other is a
    float), so dS·K = dS·K̃ + rowsum(dS)·k̂ exactly. The torch spelling of
    ``launch.hopper_bwd.key_mean``, which the path runs (its mean may differ in the last bit:
    another summation order)."""
    mean = torch.mean(key, dim=2, dtype=torch.float32).to(key.dtype).float()
    low, high = (t.float() for t in torch.aminmax(key, dim=2))
    within = torch.where(mean > 0, (low >= mean / 2) & (high <= mean * 2), (high <= mean / 2) & (low >= mean * 2))
    return torch.where(within & (mean != 0) & mean.isfinite(), mean, 0.0)


def key_mean(key: Tensor) -> Tensor:
    """k̂ as :func:`key_mean_reference` defines it, in two Triton launches (one pass over K) where
    K's last stride is 1 (else on a contiguous copy)."""
    return hopper_bwd.key_mean(key if key.stride(-1) == 1 else key.contiguous())


def key_moments(key: Tensor) -> hopper_bwd.KeyMoments:
    """The pass over K that k̂ needs (``launch.hopper_bwd.key_moments``), as :func:`key_mean` takes
    it; the backward's exact-Δ preprocess finishes k̂ in its own launch."""
    return hopper_bwd.key_moments(key if key.stride(-1) == 1 else key.contiguous())


def _addressable(*tensors: Tensor) -> list[Tensor]:
    """The tensors as they are where TMA can address them, else contiguous copies (a clone: a
    contiguous view at an unaligned offset is its own ``.contiguous()``)."""
    return [t if hopper.tma_addressable(t) else t.clone(memory_format=torch.contiguous_format) for t in tensors]


def _forward(query, key, value, is_causal, causal_offset, scale, window_left, window_right, attn_mask=None,
             block_map=None, block_q=0, block_k=0, softcap=0.0, sinks=None):
    batch, heads, seq_q, head_dim = query.shape
    if seq_q == 0 or key.shape[2] == 0 or batch * heads == 0:
        out = query.new_zeros(query.shape)
        lse = query.new_full((batch, heads, seq_q), float("-inf"), dtype=torch.float32)
        if sinks is not None:  # no key anywhere: each row's mass is its sink's
            lse = lse.copy_(sinks.to(torch.float32)[None, :, None].expand_as(lse))
        row_consts = torch.stack([torch.full_like(lse, float("inf")), torch.zeros_like(lse)])
        return out, lse, torch.zeros_like(out), row_consts
    query, key, value = _addressable(query, key, value)
    visibility = Visibility(is_causal=is_causal, causal_offset=causal_offset, window=(window_left, window_right),
                            block_map=block_map, block_q=block_q, block_k=block_k)
    return hopper.hopper_attention_forward(query, key, value, scale=scale, visibility=visibility, exact_delta=True,
                                           schedule="stable", **softcap_keyword(softcap), **mask_keyword(attn_mask),
                                           **sinks_keyword(sinks))


def mask_keyword(attn_mask: Optional[Tensor]) -> dict:
    """A Hopper launcher call's key mask as a keyword, left out when there is none (so a stand-in
    launcher without masks keeps its signature). ops/attention.py's Hopper calls use it too."""
    return {} if attn_mask is None else {"attn_mask": attn_mask}


def softcap_keyword(softcap: float) -> dict:
    """A Hopper launcher call's soft cap as a keyword, left out when there is none (as
    ``mask_keyword``: a stand-in launcher without caps keeps its signature)."""
    return {"softcap": softcap} if softcap else {}


def sinks_keyword(sinks: Optional[Tensor]) -> dict:
    """A launcher call's sinks as a keyword, left out when there are none (as ``mask_keyword``).
    ops/attention.py's calls use it too."""
    return {} if sinks is None else {"sinks": sinks}


def _backward(grad_out, query, key, value, out, lse, grad_lse, resid, row_consts, is_causal, causal_offset,
              scale, window_left, window_right, attn_mask=None, block_map=None, block_q=0, block_k=0, softcap=0.0, sinks=None):
    visibility = Visibility(is_causal=is_causal, causal_offset=causal_offset, window=(window_left, window_right),
                            block_map=block_map, block_q=block_q, block_k=block_k)
    if torch.are_deterministic_algorithms_enabled() or query.shape[2] == 0 or key.shape[2] == 0:
        # The Triton `stable` backward re-derives the exact Δ from out and lse in a fixed order.
        dq, dk, dv, _ = launch.attention_backward(grad_out, query, key, value, attn_mask, out, lse, grad_lse, None,
                                                  0.0, scale, "stable", False, visibility=visibility,
                                                  softcap=softcap, **sinks_keyword(sinks))
        return dq, dk, dv
    grad_out, query, key, value = _addressable(grad_out, query, key, value)
    return hopper_bwd.hopper_attention_backward(grad_out, query, key, value, out, lse, grad_lse, scale=scale,
                                                visibility=visibility, exact_delta=(resid, row_consts),
                                                mean_key=None if softcap else key_moments(key), schedule="stable",
                                                **softcap_keyword(softcap), **mask_keyword(attn_mask),
                                                **sinks_keyword(sinks))


@torch.library.custom_op("flash_inductor::attention_forward_one_pass", mutates_args=())
def attention_forward_one_pass(query: Tensor, key: Tensor, value: Tensor, is_causal: bool, causal_offset: int,
                               scale: float, window_left: int = -1, window_right: int = -1,
                               attn_mask: Optional[Tensor] = None, block_map: Optional[Tensor] = None,
                               block_q: int = 0, block_k: int = 0,
                               softcap: float = 0.0, sinks: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _forward(query, key, value, is_causal, causal_offset, scale, window_left, window_right, attn_mask,
                    block_map, block_q, block_k, softcap, sinks)


@torch.library.custom_op("flash_inductor::attention_backward_one_pass", mutates_args=())
def attention_backward_one_pass(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor,
                                grad_lse: Optional[Tensor], resid: Tensor, row_consts: Tensor, is_causal: bool,
                                causal_offset: int, scale: float, window_left: int = -1, window_right: int = -1,
                                attn_mask: Optional[Tensor] = None, block_map: Optional[Tensor] = None,
                                block_q: int = 0, block_k: int = 0,
                                softcap: float = 0.0, sinks: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = _backward(grad_out, query, key, value, out, lse, grad_lse, resid, row_consts, is_causal,
                           causal_offset, scale, window_left, window_right, attn_mask, block_map, block_q, block_k,
                           softcap, sinks)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@attention_forward_one_pass.register_fake
def _forward_fake(query, key, value, *_options):
    batch, heads, seq_q, _ = query.shape
    out = query.new_empty((batch, heads, seq_q, value.shape[-1]))
    lse = query.new_empty((batch, heads, seq_q), dtype=torch.float32)
    return out, lse, torch.empty_like(out), query.new_empty((2, batch, heads, seq_q), dtype=torch.float32)


@attention_backward_one_pass.register_fake
def _backward_fake(grad_out, query, key, value, *_rest):
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


# window_left, window_right, attn_mask, block_map, block_q, block_k, softcap, sinks: a caller may leave them out
_OPTIONAL_DEFAULTS = (-1, -1, None, None, 0, 0, 0.0, None)
_SINKS_INPUT = 13


def _setup_context(ctx, inputs, output):
    query, key, value, is_causal, causal_offset, scale, *optional = inputs
    window_left, window_right, attn_mask, block_map, block_q, block_k, softcap, sinks = (
        *optional, *_OPTIONAL_DEFAULTS[len(optional):])
    out, lse, resid, row_consts = output
    ctx.save_for_backward(query, key, value, out, lse, resid, row_consts, attn_mask, block_map, sinks)
    ctx.options = (is_causal, causal_offset, scale, window_left, window_right)
    ctx.block_sizes = (block_q, block_k)
    ctx.softcap = softcap
    ctx.input_count = len(inputs)
    ctx.set_materialize_grads(False)  # as ops/attention.py: an unused lse gets no zeros launched


def _run_backward(ctx, grad_out, grad_lse, backward_call, sinks_call=None):
    """``backward_call`` (the backward op, or ``_backward`` on the eager fast path) and, with sinks,
    ``sinks_call`` (``attention_sinks_backward``'s signature; None: the registered op)."""
    if grad_out is None and grad_lse is None:
        return (None,) * ctx.input_count
    query, key, value, out, lse, resid, row_consts, attn_mask, block_map, sinks = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    # Without sinks the backward op is called as it was (its schema-default argument left out).
    dq, dk, dv = backward_call(grad_out, query, key, value, out, lse, grad_lse, resid, row_consts, *ctx.options,
                               attn_mask, block_map, *ctx.block_sizes, ctx.softcap, *(() if sinks is None else (sinks,)))
    grads = [dq, dk, dv] + [None] * (ctx.input_count - 3)
    if sinks is not None and ctx.needs_input_grad[_SINKS_INPUT]:
        grads[_SINKS_INPUT] = (sinks_call or attention_sinks_backward)(grad_out, out, lse, grad_lse, sinks)
    return tuple(grads)


def _autograd_backward(ctx, grad_out, grad_lse, *_grad_backward_only):
    return _run_backward(ctx, grad_out, grad_lse, attention_backward_one_pass)


attention_forward_one_pass.register_autograd(_autograd_backward, setup_context=_setup_context)


def _refuse_double_backward(ctx, *grads):
    raise RuntimeError("flash_inductor: double backward through attention (create_graph=True) is not supported; "
                       "use torch.nn.functional.scaled_dot_product_attention's math backend for that computation.")


attention_backward_one_pass.register_autograd(_refuse_double_backward, setup_context=lambda ctx, inputs, output: None)

# torch.func transforms refuse the Functions torch builds for the two registrations above
# (ops/attention.py's twins say more).
_TransformOnePassBackward = transform_function("_TransformOnePassBackward", attention_backward_one_pass,
                                               lambda ctx, inputs, output: None, _refuse_double_backward,
                                               differentiable_outputs=3)
_TransformOnePass = transform_function(
    "_TransformOnePass", attention_forward_one_pass, _setup_context,
    lambda ctx, grad_out, grad_lse, *_: _run_backward(ctx, grad_out, grad_lse, _TransformOnePassBackward.apply,
                                                      sinks_backward_reference))


class _EagerOnePass(torch.autograd.Function):
    """The ops' launches and autograd without the dispatcher (ops/attention.py's eager fast path)."""

    @staticmethod
    def forward(ctx, query, key, value, is_causal, causal_offset, scale, window_left, window_right, attn_mask,
                block_map, block_q, block_k, softcap, sinks=None):
        args = (query, key, value, is_causal, causal_offset, scale, window_left, window_right, attn_mask, block_map,
                block_q, block_k, softcap, sinks)
        output = _forward(*args)
        _setup_context(ctx, args, output)
        ctx.mark_non_differentiable(*output[2:])
        return output

    @staticmethod
    def backward(ctx, grad_out, grad_lse, *_grad_backward_only):
        if torch.is_grad_enabled():
            return _autograd_backward(ctx, grad_out, grad_lse)
        return _run_backward(ctx, grad_out, grad_lse, _backward, launch.sinks_backward)


def attention_one_pass(query, key, value, is_causal: bool, causal_offset: int, scale: float, window_left: int,
                       window_right: int, *, fast_path: bool, needs_autograd: bool,
                       attn_mask: Optional[Tensor] = None, block_map: Optional[Tensor] = None, block_q: int = 0,
                       block_k: int = 0, softcap: float = 0.0, sinks: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(out, lse) of the one-pass path: the launches directly where ``fast_path`` (a plain eager
    call), else the registered op. ``attn_mask``: a key mask (module docstring), or None;
    ``block_map``: a block-sparse layout of ``block_q`` x ``block_k`` blocks, or None; ``softcap``: 0 or
    the soft cap c > 0; ``sinks``: the attention sinks (Hq,), or None."""
    args = (query, key, value, is_causal, causal_offset, scale, window_left, window_right, attn_mask, block_map,
            block_q, block_k, softcap)
    if fast_path:
        if not needs_autograd:
            return _forward(*args, sinks)[:2]
        return _EagerOnePass.apply(*args, sinks)[:2]
    # Without sinks the ops are called as they were (their schema-default argument left out).
    args += () if sinks is None else (sinks,)
    if under_transform():
        return _TransformOnePass.apply(*args)[:2]
    return torch.ops.flash_inductor.attention_forward_one_pass(*args)[:2]


__all__ = ["attention_forward_one_pass", "attention_backward_one_pass", "attention_one_pass", "one_pass_applies",
           "sinks_keyword", "softcap_keyword"]
