"""The ``flash_inductor::`` attention ops: registration, fake kernels and autograd.

Two public ops, both opaque ``torch.library.custom_op``s: under ``torch.compile`` each call is one
extern node, and the kernels are chosen and launched when it runs, as in eager mode.
Not ``triton_op``s: Inductor would open those up to inline the Triton kernels, and torch then
analyses each kernel launch's TTIR to learn what it writes, several times per launch per call
site (functionalisation, lowering, scheduling); for the four backward kernels of an 8-layer model
that analysis is the largest part of the model's compile, cold or warm (benchmarks/cold_start.py,
docs/performance.md), for no gain at run time, since attention is never fused with its
neighbours. Opaque calls also pick their kernels from the real strides and lengths, which
``launch`` decides from and the Gluon kernels' TMA descriptors need.

* ``flash_inductor::attention_forward(q, k, v, mask?, seed?, dropout_p, is_causal,
  causal_offset, scale, schedule, window_left=-1, window_right=-1, block_map?, block_q=0, block_k=0,
  softcap=0.0, sinks?=None) -> (out, lse)``
* ``flash_inductor::attention_backward(dout, q, k, v, mask?, out, lse, dlse?, seed?, ...,
  compute_mask_grad, window_left=-1, window_right=-1, block_map?, block_q=0, block_k=0, softcap=0.0,
  sinks?=None) -> (dq, dk, dv, dmask)``

``softcap`` > 0 is FlashAttention-2's logit soft-capping (``softcap * tanh(s / softcap)`` on the
scaled scores, before the mask). The Triton and the Gluon Hopper kernels take it (on every schedule
those serve, the one-pass `stable` path included); the split-KV decode kernels do not, so a
soft-capped call with few query rows skips them.

``sinks`` (Hq,) are attention sinks (ops/sinks.py): a per-head logit in every row's denominator.
The forward returns (out', lse') with them: the Triton and Gluon Hopper forwards add the sink in
their epilogues, the reference, decode and `fp8` paths fold it in after (``ops.sinks.fold_sinks``).
``attention_backward(..., sinks?=None)`` takes them too: (out', lse') carry the sinks, so dq, dk
and dv need nothing more of them, except exact Δ's renormalisation (the Triton `stable` kernels and
the reference), whose keys' weights sum to 1 − exp(sink − lse'). The sinks' own gradient is
``flash_inductor::attention_sinks_backward``, which the forward's autograd calls beside it.

``window_left`` / ``window_right`` are the sliding window of ``flash_attention(window=...)``
(FlashAttention's definition, -1 an open side). The ops build one ``launch.Visibility`` from the
causal arguments, the window and the block-sparse layout, and with it one ``launch.call.AttentionCall``
(shapes, dtype, the schedule resolved once, the visibility, scale, dropout and soft cap) that the
routing checks and the launchers below read; the launchers turn the visibility into the band of keys
each row sees (``launch.band``) and the kernels' tile lists.

Inputs are the normalised 4-D tensors ``flash_inductor.api`` produces: query (B, Hq, L, E),
key (B, Hkv, S, E), value (B, Hkv, S, Ev), mask a (B, Hq, L, S) view (possibly stride-0
broadcast, bool or float). q, k and v may be stride-0 views too (batch dims SDPA broadcasts):
every path reads them through their strides, and the gradients come back at the views' shapes,
for autograd's ``expand`` to sum. ``block_map`` is a block-sparse layout, (Bm, Hm, ceil(L / block_q),
ceil(S / block_k)) bool with Bm in {1, B} and Hm in {1, Hq} (``flash_inductor.block_sparse``);
without one it is None and the block sizes 0. ``lse`` is natural log, -inf on rows with no visible key, fp32
(fp64 for float64 inputs).

What the kernels do not take (CPU tensors, float64, head dims over 256) goes to the blocked
PyTorch reference path, registered as ops of its own.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .. import launch
from ..launch import decode, hopper, hopper_bwd
from ..launch.call import AttentionCall

# What the eager fast path needs, looked up once (torch 2.11-2.14 all have it; where it is
# missing every call takes the registered op instead).
_functorch_transforms_active = getattr(torch._C, "_are_functorch_transforms_active", None)
from ..launch.block_tiles import check_block_layout
from ..launch.visibility import Visibility
from ..schedules import PrecisionSchedule, get_schedule
from .functorch import transform_function, under_transform
from .one_pass import attention_one_pass, mask_keyword, one_pass_applies, sinks_keyword, softcap_keyword
from .reference import reference_backward, reference_forward
from .sinks import attention_sinks_backward, fold_sinks, sinks_backward_reference

# --------------------------------------------------------------------------------------
# Reference path (CPU, float64, anything the kernels do not take)
# --------------------------------------------------------------------------------------


@torch.library.custom_op("flash_inductor::attention_forward_reference", mutates_args=())
def attention_forward_reference(
    query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor], rng_seed: Optional[Tensor],
    dropout_p: float, is_causal: bool, causal_offset: int, scale: float,
    window_left: int = -1, window_right: int = -1,
    block_map: Optional[Tensor] = None, block_q: int = 0, block_k: int = 0, softcap: float = 0.0,
    sinks: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    out, lse = reference_forward(query, key, value, attn_mask, rng_seed, dropout_p, is_causal, causal_offset, scale,
                                 window=(window_left, window_right),
                                 block_layout=_reference_layout(block_map, block_q, block_k), softcap=softcap)
    if sinks is not None:
        out, lse = fold_sinks(out, lse, sinks)
    return out.contiguous(), lse.contiguous()


@torch.library.custom_op("flash_inductor::attention_backward_reference", mutates_args=())
def attention_backward_reference(
    grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor],
    out: Tensor, lse: Tensor, grad_lse: Optional[Tensor], rng_seed: Optional[Tensor],
    dropout_p: float, is_causal: bool, causal_offset: int, scale: float, compute_mask_grad: bool,
    window_left: int = -1, window_right: int = -1,
    block_map: Optional[Tensor] = None, block_q: int = 0, block_k: int = 0, softcap: float = 0.0,
    sinks: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    grads = reference_backward(
        grad_out, query, key, value, attn_mask, out, lse, rng_seed, dropout_p, is_causal,
        causal_offset, scale, compute_mask_grad, grad_lse=grad_lse, window=(window_left, window_right),
        block_layout=_reference_layout(block_map, block_q, block_k), softcap=softcap, sinks=sinks,
    )
    return tuple(g.contiguous() for g in grads)


def _reference_layout(block_map: Optional[Tensor], block_q: int, block_k: int) -> Optional[tuple]:
    if block_map is None:
        return None
    check_block_layout(block_map, block_q, block_k)
    return block_map, block_q, block_k




# --------------------------------------------------------------------------------------
# The CUDA paths. The Gluon Hopper kernels are chosen from the shapes, dtypes and options (the
# check ``explain()`` also makes on a traced graph), then from the strides, which their TMA
# descriptors must be able to address; anything else runs the Triton kernels.
# --------------------------------------------------------------------------------------


def describe_call(query: Tensor, key: Tensor, value: Tensor, dropout_p: float, is_causal: bool, causal_offset: int,
                  scale: float, schedule, window_left: int = -1, window_right: int = -1,
                  block_map: Optional[Tensor] = None, block_q: int = 0, block_k: int = 0,
                  softcap: float = 0.0) -> AttentionCall:
    """The op's arguments as the one record the CUDA paths below read (``launch.call``): the schedule
    resolved and the visibility rules grouped, once per call."""
    visibility = Visibility(is_causal=is_causal, causal_offset=causal_offset, window=(window_left, window_right),
                            block_map=block_map, block_q=block_q, block_k=block_k)
    return AttentionCall.describe(query, key, value, schedule=schedule, visibility=visibility, scale=scale,
                                  dropout_p=dropout_p, softcap=softcap)


def _forward_on_hopper(query: Tensor, key: Tensor, value: Tensor, call: AttentionCall, *,
                       attn_mask: Optional[Tensor] = None, sinks: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    return hopper.hopper_attention_forward(query, key, value, scale=call.scale, visibility=call.visibility,
                                           attn_mask=attn_mask, schedule=call.schedule, sinks=sinks,
                                           **softcap_keyword(call.softcap))


def _folded(result, sinks: Optional[Tensor]):
    """(out, lse) of a path without sinks in its kernels, with the sinks folded in (ops/sinks.py)."""
    return result if sinks is None else fold_sinks(*result, sinks)


def _kernel_forward(query, key, value, attn_mask, rng_seed, call: AttentionCall, *, hopper_call=_forward_on_hopper,
                    sinks: Optional[Tensor] = None):
    """The CUDA forward: the split-KV decode kernels for a few query rows against long keys, else
    the Gluon Hopper kernel where it applies, else the Triton kernels. ``hopper_call`` runs the
    Hopper kernel (a test may stand in for it). Block-sparse calls skip the decode kernels, which
    read every key of the band, and so do soft-capped ones, which have no cap there. ``sinks``: the
    Triton and Hopper kernels take them, the decode and `fp8` ones get them folded in."""
    # The `fp8` kernel has no sinks: they are folded in after it, as after the decode kernels.
    fold_after = sinks if call.schedule.fp8_forward else None
    triton_options = dict(visibility=call.visibility, softcap=call.softcap,
                          **sinks_keyword(None if fold_after is not None else sinks))
    if call.visibility.block_map is None and not call.softcap:
        decoded = decode.decode_forward_or_none(query, key, value, attn_mask, call.dropout_p, call.scale,
                                                call.schedule, visibility=call.visibility)
        if decoded is not None:
            return _folded(decoded, sinks)
    reason = (hopper.hopper_forward_unsupported_reason(query, key, value, attn_mask, call.dropout_p, call.scale,
                                                       call.schedule, window=call.visibility.window,
                                                       block_sizes=call.block_sizes)
              or hopper.tma_unsupported_reason(query, key, value))
    if reason is None:
        return hopper_call(query, key, value, call, **mask_keyword(attn_mask), **sinks_keyword(sinks))
    hopper.log_triton_forward(reason)
    return _folded(launch.attention_forward(query, key, value, attn_mask, rng_seed, call.dropout_p, call.scale,
                                            call.schedule, **triton_options), fold_after)


def _backward_on_hopper(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor,
                        grad_lse: Optional[Tensor], call: AttentionCall, *,
                        attn_mask: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    return hopper_bwd.hopper_attention_backward(grad_out, query, key, value, out, lse, grad_lse, scale=call.scale,
                                                visibility=call.visibility, attn_mask=attn_mask,
                                                schedule=call.schedule, **softcap_keyword(call.softcap))


def _kernel_backward(grad_out, query, key, value, attn_mask, out, lse, grad_lse, rng_seed, call: AttentionCall,
                     compute_mask_grad: bool, *, hopper_call=_backward_on_hopper, sinks: Optional[Tensor] = None):
    """The CUDA backward: the Gluon Hopper kernel where it applies (the `fast` schedule;
    ``hopper_call`` as in ``_kernel_forward``), else the Triton kernels. Returns (dq, dk, dv, dmask).
    `stable` on the Hopper kernels needs the forward's residual, which only the one-pass ops
    (ops/one_pass.py) carry: a `stable` call that reaches this op runs the Triton backward.
    ``sinks``: what (out, lse) carry; the `fast` Hopper kernel needs nothing of them, the Triton
    kernels' exact Δ does."""
    reason = (hopper_bwd.hopper_backward_unsupported_reason(query, key, value, attn_mask, call.dropout_p, call.scale,
                                                            call.schedule, is_causal=call.visibility.is_causal,
                                                            window=call.visibility.window,
                                                            block_sizes=call.block_sizes)
              or hopper_bwd.backward_tma_unsupported_reason(grad_out, query, key, value)
              or (hopper.MASK_NEEDS_GRAD if compute_mask_grad else None)
              or (hopper_bwd.NO_RESIDUAL if call.schedule.exact_delta else None))
    if reason is None:
        dq, dk, dv = hopper_call(grad_out, query, key, value, out, lse, grad_lse, call, **mask_keyword(attn_mask))
        return dq, dk, dv, query.new_empty(0)
    hopper_bwd.log_triton_backward(reason)
    return launch.attention_backward(grad_out, query, key, value, attn_mask, out, lse, grad_lse, rng_seed,
                                     call.dropout_p, call.scale, call.schedule, compute_mask_grad,
                                     visibility=call.visibility, softcap=call.softcap, **sinks_keyword(sinks))


# --------------------------------------------------------------------------------------
# Public ops
# --------------------------------------------------------------------------------------


@torch.library.custom_op("flash_inductor::attention_forward", mutates_args=())
def attention_forward(
    query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor], rng_seed: Optional[Tensor],
    dropout_p: float, is_causal: bool, causal_offset: int, scale: float, schedule: str,
    window_left: int = -1, window_right: int = -1,
    block_map: Optional[Tensor] = None, block_q: int = 0, block_k: int = 0, softcap: float = 0.0,
    sinks: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    if launch.kernel_supports(query, key, value):
        return _kernel_forward(query, key, value, attn_mask, rng_seed,
                               describe_call(query, key, value, dropout_p, is_causal, causal_offset, scale, schedule,
                                             window_left, window_right, block_map, block_q, block_k, softcap),
                               sinks=sinks)
    # The reference computes in fp32/fp64 throughout, Delta included (the `accurate` schedule's
    # stages): the schedule has nothing to select there.
    return attention_forward_reference(query, key, value, attn_mask, rng_seed, dropout_p, is_causal, causal_offset,
                                       scale, window_left, window_right, block_map, block_q, block_k, softcap, sinks)



@torch.library.custom_op("flash_inductor::attention_backward", mutates_args=())
def attention_backward(
    grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor],
    out: Tensor, lse: Tensor, grad_lse: Optional[Tensor], rng_seed: Optional[Tensor],
    dropout_p: float, is_causal: bool, causal_offset: int, scale: float, schedule: str,
    compute_mask_grad: bool, window_left: int = -1, window_right: int = -1,
    block_map: Optional[Tensor] = None, block_q: int = 0, block_k: int = 0, softcap: float = 0.0,
    sinks: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    if launch.kernel_supports(query, key, value):
        call = describe_call(query, key, value, dropout_p, is_causal, causal_offset, scale, schedule, window_left,
                             window_right, block_map, block_q, block_k, softcap)
        return _kernel_backward(grad_out, query, key, value, attn_mask, out, lse, grad_lse, rng_seed, call,
                                compute_mask_grad, sinks=sinks)
    return attention_backward_reference(
        grad_out, query, key, value, attn_mask, out, lse, grad_lse, rng_seed, dropout_p,
        is_causal, causal_offset, scale, compute_mask_grad, window_left, window_right, block_map, block_q, block_k,
        softcap, sinks,
    )


# --------------------------------------------------------------------------------------
# Fake kernels: from the contract above only, never from tile sizes or configs.
# --------------------------------------------------------------------------------------


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    # fp32 for every kernel dtype; float64 inputs keep a float64 LSE so fp64 gradients
    # (gradcheck) are not limited by an fp32 round trip.
    return torch.float64 if dtype == torch.float64 else torch.float32


def _forward_fake(query, key, value, *_options):
    batch, heads_q, seq_q, _ = query.shape
    out = query.new_empty((batch, heads_q, seq_q, value.shape[-1]))
    lse = query.new_empty((batch, heads_q, seq_q), dtype=_lse_dtype(query.dtype))
    return out, lse


def _backward_shapes(query, key, value, attn_mask, compute_mask_grad):
    if compute_mask_grad:
        batch, heads_q, seq_q, _ = query.shape
        dmask = attn_mask.new_empty((batch, heads_q, seq_q, key.shape[2]))
    else:
        dmask = query.new_empty(0)
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape), dmask


def _backward_fake(grad_out, query, key, value, attn_mask, out, lse, grad_lse, rng_seed, dropout_p,
                   is_causal, causal_offset, scale, schedule, compute_mask_grad, *_window_and_layout):
    return _backward_shapes(query, key, value, attn_mask, compute_mask_grad)


def _backward_reference_fake(grad_out, query, key, value, attn_mask, out, lse, grad_lse, rng_seed, dropout_p,
                             is_causal, causal_offset, scale, compute_mask_grad, *_window_and_layout):
    return _backward_shapes(query, key, value, attn_mask, compute_mask_grad)


for _op in (attention_forward_reference, attention_forward):
    _op.register_fake(_forward_fake)
attention_backward_reference.register_fake(_backward_reference_fake)
attention_backward.register_fake(_backward_fake)


# --------------------------------------------------------------------------------------
# Autograd: the forward op's backward is the backward op (which itself has no autograd;
# double backward through attention is not supported).
# --------------------------------------------------------------------------------------

_MASK_INPUT = 3
# window_left, window_right, block_map, block_q, block_k, softcap, sinks: the forward op's arguments
# with defaults.
_OPTIONAL_DEFAULTS = (-1, -1, None, 0, 0, 0.0, None)
_SINKS_INPUT = 16


def _setup_context(ctx, inputs, output):
    query, key, value, attn_mask, rng_seed, dropout_p, is_causal, causal_offset, scale, schedule, *optional = inputs
    # The trailing arguments have defaults, which a caller may leave out.
    window_left, window_right, block_map, block_q, block_k, softcap, sinks = (*optional,
                                                                              *_OPTIONAL_DEFAULTS[len(optional):])
    out, lse = output
    ctx.save_for_backward(query, key, value, attn_mask, rng_seed, out, lse, block_map, sinks)
    # The name: the backward may be the registered op, whose schema takes one.
    ctx.options = (dropout_p, is_causal, causal_offset, scale,
                   schedule.name if isinstance(schedule, PrecisionSchedule) else schedule)
    ctx.window = (window_left, window_right)
    ctx.layout = (block_q, block_k)
    ctx.softcap = softcap
    ctx.input_count = len(inputs)
    # An output the caller never used (almost always lse) reaches the backward as None, not as
    # zeros: autograd's default would launch a fill for it, and a zero dLSE still sends the
    # kernels down their dLSE path (an extra load per row in three kernels), which is also not
    # the specialisation the autotuner timed.
    ctx.set_materialize_grads(False)


def _run_backward(ctx, grad_out, grad_lse, backward_call, sinks_call=None):
    """The autograd backward of both paths around ``backward_call``: the registered backward op
    (the op path) or ``launch.attention_backward`` (the eager fast path), and ``sinks_call`` (the
    sinks' gradient: ``attention_sinks_backward``'s signature; None: the registered op). No gradient
    reaches the inputs when neither output got one; when only lse did, dO is zero (the kernels
    always read it)."""
    n_inputs = ctx.input_count
    if grad_out is None and grad_lse is None:
        return (None,) * n_inputs
    query, key, value, attn_mask, rng_seed, out, lse, block_map, sinks = ctx.saved_tensors
    dropout_p, is_causal, causal_offset, scale, schedule = ctx.options
    block_q, block_k = ctx.layout
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    compute_mask_grad = bool(
        attn_mask is not None and attn_mask.is_floating_point() and ctx.needs_input_grad[_MASK_INPUT]
    )
    dq, dk, dv, dmask = backward_call(
        grad_out, query, key, value, attn_mask, out, lse, grad_lse, rng_seed,
        dropout_p, is_causal, causal_offset, scale, schedule, compute_mask_grad, *ctx.window,
        block_map=block_map, block_q=block_q, block_k=block_k, softcap=ctx.softcap, **sinks_keyword(sinks),
    )
    grads = [dq, dk, dv, (dmask if compute_mask_grad else None)] + [None] * (n_inputs - 4)
    if sinks is not None and ctx.needs_input_grad[_SINKS_INPUT]:
        grads[_SINKS_INPUT] = (sinks_call or attention_sinks_backward)(grad_out, out, lse, grad_lse, sinks)
    return tuple(grads)


def _backward(ctx, grad_out, grad_lse):
    return _run_backward(ctx, grad_out, grad_lse, attention_backward)


attention_forward.register_autograd(_backward, setup_context=_setup_context)


def _refuse_double_backward(ctx, *grads):
    raise RuntimeError(
        "flash_inductor: double backward through attention (create_graph=True, e.g. gradient "
        "penalties) is not supported; use torch.nn.functional.scaled_dot_product_attention's math "
        "backend for that computation."
    )


# Registered so that a second differentiation fails with the message above instead of
# torch's generic "no autograd formula" error.
attention_backward.register_autograd(_refuse_double_backward, setup_context=lambda ctx, inputs, output: None)

# torch.func transforms refuse the Functions torch builds for the two registrations above: under a
# transform the ops go through these (ops/functorch.py), the backward op too, since a transform's
# backward still records what it calls.
_TransformAttentionBackward = transform_function("_TransformAttentionBackward", attention_backward,
                                                 lambda ctx, inputs, output: None, _refuse_double_backward,
                                                 differentiable_outputs=4)


def _backward_under_transform(*args, block_map=None, block_q=0, block_k=0, softcap=0.0, sinks=None):
    return _TransformAttentionBackward.apply(*args, block_map, block_q, block_k, softcap,
                                             *(() if sinks is None else (sinks,)))


# The sinks' gradient in torch ops, which every transform takes.
_TransformAttention = transform_function(
    "_TransformAttention", attention_forward, _setup_context,
    lambda ctx, grad_out, grad_lse: _run_backward(ctx, grad_out, grad_lse, _backward_under_transform,
                                                  sinks_backward_reference))


# --------------------------------------------------------------------------------------
# Eager fast path: the same launches and autograd without the op dispatcher
# --------------------------------------------------------------------------------------


class _EagerKernelAttention(torch.autograd.Function):
    """``attention_forward``'s kernel path and autograd, called directly.

    An eager call through ``torch.ops.flash_inductor.attention_forward`` also pays for the
    custom-op machinery (autograd wrapper, redispatch): on a
    2-core CPU with the launches stubbed, 75 µs a forward against 47 µs here, and its backward
    goes through a second op. Plain eager CUDA calls (see :func:`eager_fast_path_applies`) take
    this path instead; it runs the very same launchers, so results are bitwise those of the op.
    """

    @staticmethod
    def forward(ctx, query, key, value, attn_mask, rng_seed, dropout_p, is_causal, causal_offset, scale, schedule,
                window_left, window_right, block_map, block_q, block_k, softcap, sinks=None):
        out, lse = _kernel_forward(query, key, value, attn_mask, rng_seed,
                                   describe_call(query, key, value, dropout_p, is_causal, causal_offset, scale,
                                                 schedule, window_left, window_right, block_map, block_q, block_k,
                                                 softcap), sinks=sinks)
        _setup_context(ctx, (query, key, value, attn_mask, rng_seed, dropout_p, is_causal, causal_offset, scale,
                             schedule, window_left, window_right, block_map, block_q, block_k, softcap, sinks),
                       (out, lse))
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        if torch.is_grad_enabled():
            # create_graph=True: the registered backward op records the refusal of a second
            # differentiation, exactly as on the op path.
            return _backward(ctx, grad_out, grad_lse)
        return _run_backward(ctx, grad_out, grad_lse, _launch_backward, launch.sinks_backward)


def _launch_backward(grad_out, query, key, value, attn_mask, out, lse, grad_lse, rng_seed, dropout_p, is_causal,
                     causal_offset, scale, schedule, compute_mask_grad, window_left, window_right, sinks=None,
                     **layout):
    """``_kernel_backward`` with the backward op's positional arguments (the window last) and its
    keywords (``block_map``, ``block_q``, ``block_k``, ``softcap``, ``sinks``)."""
    call = describe_call(query, key, value, dropout_p, is_causal, causal_offset, scale, schedule, window_left,
                         window_right, **layout)
    return _kernel_backward(grad_out, query, key, value, attn_mask, out, lse, grad_lse, rng_seed, call,
                            compute_mask_grad, sinks=sinks)


def eager_fast_path_applies(*tensors: Optional[Tensor]) -> bool:
    """Whether an eager call may skip the dispatcher: not being compiled or traced, no dispatch
    or torch-function mode and no functorch transform active, plain tensors only, and inputs the
    Triton kernels take. Anything else (FakeTensor, vmap, DTensor, torch.compile, export) needs
    the registered op, which every one of those understands."""
    if _functorch_transforms_active is None:
        return False
    if torch.compiler.is_compiling() or _functorch_transforms_active():
        return False
    if any(t is not None and type(t) is not Tensor for t in tensors):
        return False
    if torch._C._is_torch_function_mode_enabled() or _get_current_dispatch_mode() is not None:
        return False
    return launch.kernel_supports(*tensors[:3])


def _needs_autograd(*tensors: Optional[Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def attention_forward_eager(query, key, value, attn_mask, rng_seed, dropout_p, is_causal, causal_offset, scale,
                            schedule, window_left=-1, window_right=-1, block_map=None, block_q=0,
                            block_k=0, softcap=0.0, sinks=None) -> tuple[Tensor, Tensor]:
    """``torch.ops.flash_inductor.attention_forward`` with the same arguments, without the
    dispatcher where :func:`eager_fast_path_applies`. `stable` calls that the Hopper kernels take go
    to the one-pass ops instead
    (ops/one_pass.py), which return the same (out, lse) up to rounding, when a backward may follow:
    without one, the residual and the centred keys they save would buy nothing, and the plain
    forward is 12-17 % faster (docs/hopper_backward.md)."""
    needs_autograd = _needs_autograd(query, key, value)
    # A name is resolved once here for the checks and launches below (flash_inductor.api passes the
    # schedule it resolved; the registered op takes the name).
    schedule = get_schedule(schedule)
    if needs_autograd and one_pass_applies(query, key, value, attn_mask, dropout_p, scale, schedule,
                                           window=(window_left, window_right),
                                           block_sizes=None if block_map is None else (block_q, block_k)):
        return attention_one_pass(query, key, value, is_causal, causal_offset, scale, window_left, window_right,
                                  fast_path=eager_fast_path_applies(query, key, value, attn_mask, block_map, sinks),
                                  needs_autograd=True, attn_mask=attn_mask, block_map=block_map, block_q=block_q,
                                  block_k=block_k, softcap=softcap, sinks=sinks)
    if eager_fast_path_applies(query, key, value, attn_mask, rng_seed, block_map, sinks):
        if not _needs_autograd(query, key, value, attn_mask, sinks):
            # Inference: the launch alone. autograd.Function.apply would record nothing here and
            # cost ~20-35 µs of host time a call (2-core CPU, launches stubbed), which
            # a short problem's GPU time may not hide.
            return _kernel_forward(query, key, value, attn_mask, rng_seed,
                                   describe_call(query, key, value, dropout_p, is_causal, causal_offset, scale,
                                                 schedule, window_left, window_right, block_map, block_q, block_k,
                                                 softcap), sinks=sinks)
        return _EagerKernelAttention.apply(
            query, key, value, attn_mask, rng_seed, dropout_p, is_causal, causal_offset, scale, schedule,
            window_left, window_right, block_map, block_q, block_k, softcap, sinks,
        )
    # Without sinks the op's schema-default argument is left out, so the traced call is the one it was.
    sinks_arg = () if sinks is None else (sinks,)
    args = (query, key, value, attn_mask, rng_seed, dropout_p, is_causal, causal_offset, scale, schedule.name,
            window_left, window_right, block_map, block_q, block_k, softcap, *sinks_arg)
    if under_transform():
        return _TransformAttention.apply(*args)
    return torch.ops.flash_inductor.attention_forward(*args)
