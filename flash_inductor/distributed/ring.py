"""Ring attention over a torch.distributed group on the ``flash_inductor::`` attention ops.

Each rank holds one shard of the sequence (``sharding.SequenceLayout``) of Q, K, V (and of a
key-padding mask). The forward makes ``W = world_size`` steps; at step s rank r holds the K/V
block of rank ``r - s`` and, before computing with it, posts the exchange that brings the next
one (``batch_isend_irecv``: send to r + 1, receive from r - 1), so the transfer runs under the
attention of the block in hand. Each step's calls (``plan.block_calls``) return (out_b, lse_b),
merged exactly by their natural-log LSE in fp32 (fp64 for fp64 inputs):

    lse = logaddexp(lse_acc, lse_b),  out = out_acc·exp(lse_acc − lse) + out_b·exp(lse_b − lse)

The backward runs the ring the other way (send to r − 1, receive from r + 1): at step s rank r
holds the K/V of rank r + s together with that block's dK/dV accumulator, adds its queries'
contribution, and passes both on; after the last step each accumulator makes one more hop, to
its owner. Each block's backward is the op's backward with the *merged* output and LSE: its
P = exp(s − lse) is then the block's slice of the global softmax, and Δ = rowsum(dO∘O) − dLSE is
the global row's. The output passed for Δ is the fp32 merge result, not the rounded output: a
16-bit O would call for the kernels' exact-Δ correction, which re-derives Δ from the P and dP of
the keys in one call, and one call sees only part of a row here (``launch.backward`` therefore
turns the correction off for an fp32 O).

Accumulators (out, dQ, the travelling dK/dV) are fp32 (fp64 for fp64 inputs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .. import launch
from ..ops import attention as attention_ops
from ..schedules import STABLE, get_schedule
from .plan import block_calls
from .sharding import SequenceLayout

# Benchmark switch (``ring_benchmark_mode``): "ring" (normal), "compute_only" (each step computes
# on this rank's own K/V in place of the received block, no communication), "comm_only" (the
# exchanges alone). Compute-only and comm-only times against the ring's measure its overlap.
_MODES = ("ring", "compute_only", "comm_only")
_mode = "ring"


@contextlib.contextmanager
def ring_benchmark_mode(mode: str):
    """Within the block, the ring runs as ``mode``: ``"compute_only"`` (no communication; each step
    attends to this rank's own K/V with the plan of the block it would have received: the same
    calls and FLOPs when the shards are even) or ``"comm_only"`` (the exchanges, no attention;
    outputs are then meaningless). For ``benchmarks/cp_scaling.py``; never for training."""
    global _mode
    if mode not in _MODES:
        raise ValueError(f"ring_benchmark_mode: mode={mode!r}; choose one of {_MODES}.")
    previous, _mode = _mode, mode
    try:
        yield
    finally:
        _mode = previous


@dataclasses.dataclass(frozen=True)
class RingConfig:
    """Everything but the tensors: the group, the layout and the op's arguments."""

    group: Optional[dist.ProcessGroup]
    rank: int
    layout: SequenceLayout
    is_causal: bool
    scale: float
    schedule: str

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def peer(self, group_rank: int) -> int:
        """The global rank P2POp wants."""
        group_rank %= self.world_size
        if self.group is None or self.group is dist.GroupMember.WORLD:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def calls(self, kv_rank: int):
        return block_calls(self.layout, self.rank, kv_rank % self.world_size, self.is_causal)


# --------------------------------------------------------------------------------------
# Communication: torch.distributed's batched P2P, nothing else
# --------------------------------------------------------------------------------------


class _Exchange:
    """Sends ``tensors`` to one peer and receives same-kind tensors of ``shapes`` from another."""

    def __init__(self, config: RingConfig, tensors, shapes, send_to: int, recv_from: int, tag: int):
        self.received = [torch.empty(shape, dtype=t.dtype, device=t.device) for t, shape in zip(tensors, shapes)]
        self.sent = list(tensors)  # alive until wait(), whatever the caller drops meanwhile
        # Distinct tags keep gloo from pairing the K/V and dK/dV messages of one step (NCCL keeps
        # them apart by issue order and ignores tags).
        ops = [dist.P2POp(dist.isend, t, config.peer(send_to), config.group, tag + i) for i, t in enumerate(tensors)]
        ops += [dist.P2POp(dist.irecv, t, config.peer(recv_from), config.group, tag + i)
                for i, t in enumerate(self.received)]
        self.requests = dist.batch_isend_irecv(ops)

    def wait(self) -> list[Tensor]:
        for request in self.requests:
            request.wait()
        return self.received


def _kv_shapes(config: RingConfig, kv_rank: int, key: Tensor, value: Tensor, key_padding_mask: Optional[Tensor]):
    length = config.layout.local_len(kv_rank % config.world_size)
    shapes = [(*key.shape[:2], length, key.shape[3]), (*value.shape[:2], length, value.shape[3])]
    if key_padding_mask is not None:
        shapes.append((key_padding_mask.shape[0], length))
    return shapes


_KV_TAG, _DKV_TAG = 0, 8


# --------------------------------------------------------------------------------------
# One block: the ops, through the eager fast path where it applies
# --------------------------------------------------------------------------------------


def _block_mask(key_padding_mask: Optional[Tensor], query: Tensor, call) -> Optional[Tensor]:
    if key_padding_mask is None:
        return None
    # (B, S) -> (B, Hq, Lq, S) with stride-0 heads and rows: the layout the op reads, never copied.
    rows = call.q_hi - call.q_lo
    return key_padding_mask[:, None, None, call.k].expand(query.shape[0], query.shape[1], rows, call.k_hi - call.k_lo)


def _block_forward(config: RingConfig, schedule: str, query, key, value, key_padding_mask, call):
    q = query[:, :, call.q]
    mask = _block_mask(key_padding_mask, query, call)
    return attention_ops.attention_forward_eager(
        q, key[:, :, call.k], value[:, :, call.k], mask, None, 0.0, call.is_causal, call.causal_offset,
        config.scale, schedule,
    )


def _block_backward(config: RingConfig, schedule: str, grad_out, query, key, value, key_padding_mask, out, lse,
                    grad_lse, call):
    q, k, v = query[:, :, call.q], key[:, :, call.k], value[:, :, call.k]
    mask = _block_mask(key_padding_mask, query, call)
    # The kernels read the LSE and its gradient as flat (B·Hq·L) vectors: a row slice must be copied.
    lse_rows = lse[:, :, call.q].contiguous()
    grad_lse_rows = None if grad_lse is None else grad_lse[:, :, call.q].contiguous()
    tensors = (grad_out[:, :, call.q], q, k, v, mask, out[:, :, call.q], lse_rows, grad_lse_rows)
    if attention_ops.eager_fast_path_applies(q, k, v, mask):
        # The launcher takes the causal side as one keyword argument, the op as two flat ones.
        return launch.attention_backward(
            *tensors, None, 0.0, config.scale, schedule, False,
            visibility=launch.Visibility(is_causal=call.is_causal, causal_offset=call.causal_offset))
    return torch.ops.flash_inductor.attention_backward(
        *tensors, None, 0.0, call.is_causal, call.causal_offset, config.scale, schedule, False)


def _merge(out_acc: Tensor, lse_acc: Tensor, out: Tensor, lse: Tensor) -> None:
    """Fold (out, lse) into the accumulators in place, exactly in their dtype."""
    lse = lse.to(lse_acc.dtype)
    merged = torch.logaddexp(lse_acc, lse)
    # Rows no key has reached yet stay (0, -inf): shifting by a -inf max would give NaN.
    shift = torch.where(merged.isneginf(), torch.zeros_like(merged), merged)
    out_acc.mul_(torch.exp(lse_acc - shift)[..., None])
    out_acc.add_(out.to(out_acc.dtype) * torch.exp(lse - shift)[..., None])
    lse_acc.copy_(merged)


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _single_call(config: RingConfig, query: Tensor, key: Tensor):
    """At world size 1 a layout's shard is one run of positions, hence one call covering every
    query and key: the ring is then the plain op (its rounded O is then a whole row's, fit for Δ)."""
    if config.world_size != 1 or _mode != "ring":
        return None
    calls = config.calls(config.rank)
    if len(calls) == 1 and (calls[0].q_lo, calls[0].q_hi, calls[0].k_lo, calls[0].k_hi) == (
            0, query.shape[2], 0, key.shape[2]):
        return calls[0]
    return None


# --------------------------------------------------------------------------------------
# The ring, forward and backward
# --------------------------------------------------------------------------------------


def ring_forward(config: RingConfig, schedule: str, query, key, value, key_padding_mask):
    """Returns (out in the input dtype, lse, the output to form Δ from)."""
    single = _single_call(config, query, key)
    if single is not None:
        out, lse = _block_forward(config, schedule, query, key, value, key_padding_mask, single)
        return out, lse, out
    world, rank = config.world_size, config.rank
    acc_dtype = _accumulate_dtype(query.dtype)
    out_acc = torch.zeros((*query.shape[:3], value.shape[-1]), dtype=acc_dtype, device=query.device)
    lse_acc = torch.full(query.shape[:3], float("-inf"), dtype=acc_dtype, device=query.device)
    block = [key, value] + ([key_padding_mask] if key_padding_mask is not None else [])
    for step in range(world):
        source = rank - step
        pending = None
        if step < world - 1 and _mode != "compute_only":
            pending = _Exchange(config, block, _kv_shapes(config, source - 1, key, value, key_padding_mask),
                                send_to=rank + 1, recv_from=rank - 1, tag=_KV_TAG)
        if _mode != "comm_only":
            k, v, mask = block[0], block[1], block[2] if len(block) > 2 else None
            for call in config.calls(source):
                out_b, lse_b = _block_forward(config, schedule, query, k, v, mask, call)
                _merge(out_acc[:, :, call.q], lse_acc[:, :, call.q], out_b, lse_b)
        if pending is not None:
            block = pending.wait()
    return out_acc.to(query.dtype), lse_acc.to(torch.float64 if query.dtype == torch.float64 else torch.float32), out_acc


def ring_backward(config: RingConfig, schedule: str, grad_out, grad_lse, query, key, value, key_padding_mask,
                  out, lse):
    """(dq, dk, dv) of this rank's shard. ``out`` is the output Δ is formed from (fp32 merge)."""
    single = _single_call(config, query, key)
    if single is not None:
        dq, dk, dv, _ = _block_backward(config, schedule, grad_out, query, key, value, key_padding_mask, out, lse,
                                        grad_lse, single)
        return dq, dk, dv
    world, rank = config.world_size, config.rank
    acc_dtype = _accumulate_dtype(query.dtype)
    dq_acc = torch.zeros(query.shape, dtype=acc_dtype, device=query.device)
    dkv = [torch.zeros(key.shape, dtype=acc_dtype, device=key.device),
           torch.zeros(value.shape, dtype=acc_dtype, device=value.device)]
    block = [key, value] + ([key_padding_mask] if key_padding_mask is not None else [])
    communicate = world > 1 and _mode != "compute_only"
    dkv_pending = None
    for step in range(world):
        source = rank + step
        kv_pending = None
        if step < world - 1 and communicate:
            kv_pending = _Exchange(config, block, _kv_shapes(config, source + 1, key, value, key_padding_mask),
                                   send_to=rank - 1, recv_from=rank + 1, tag=_KV_TAG)
        if dkv_pending is not None:
            dkv = dkv_pending.wait()
        if _mode != "comm_only":
            k, v, mask = block[0], block[1], block[2] if len(block) > 2 else None
            for call in config.calls(source):
                dq_b, dk_b, dv_b, _ = _block_backward(config, schedule, grad_out, query, k, v, mask, out, lse,
                                                      grad_lse, call)
                dq_acc[:, :, call.q] += dq_b
                dkv[0][:, :, call.k] += dk_b
                dkv[1][:, :, call.k] += dv_b
        if communicate:
            # The accumulator goes on with its block; after the last step, to its owner (r - 1).
            shapes = _kv_shapes(config, source + 1, key, value, None)
            dkv_pending = _Exchange(config, dkv, shapes, send_to=rank - 1, recv_from=rank + 1, tag=_DKV_TAG)
        if kv_pending is not None:
            block = kv_pending.wait()
    if dkv_pending is not None:
        dkv = dkv_pending.wait()
    return dq_acc.to(query.dtype), dkv[0].to(key.dtype), dkv[1].to(value.dtype)


class RingAttention(torch.autograd.Function):
    """Differentiable in query, key and value; returns (out, lse) like the op."""

    @staticmethod
    def forward(ctx, query, key, value, key_padding_mask, config: RingConfig):
        out, lse, out_for_delta = ring_forward(config, config.schedule, query, key, value, key_padding_mask)
        ctx.config = config
        ctx.save_for_backward(query, key, value, key_padding_mask, out_for_delta, lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        if grad_out is None and grad_lse is None:
            return None, None, None, None, None
        config = ctx.config
        query, key, value, key_padding_mask, out, lse = ctx.saved_tensors
        schedule = config.schedule
        if get_schedule(schedule).fp8_forward:
            # fp8 is a forward schedule: the gradient is the 16-bit attention's, formed from a 16-bit
            # forward's O and LSE (the op's own rule), so the ring's forward runs again in `stable`.
            schedule = STABLE.name
            _, lse, out = ring_forward(config, schedule, query, key, value, key_padding_mask)
        if grad_out is None:
            grad_out = torch.zeros((*query.shape[:3], value.shape[-1]), dtype=query.dtype, device=query.device)
        dq, dk, dv = ring_backward(config, schedule, grad_out, grad_lse, query, key, value, key_padding_mask, out,
                                   lse)
        return dq, dk, dv, None, None


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
