"""``context_parallel_attention``: the public function, its validation, and its errors."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from ..launch.fp8 import check_fp8_device
from ..schedules import get_schedule
from .ring import RingAttention, RingConfig, default_scale
from .sharding import SequenceLayout

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_NAME = "context_parallel_attention"


def context_parallel_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    group: Optional[dist.ProcessGroup] = None,
    is_causal: bool = False,
    layout: str = "zigzag",
    seq_len: Optional[int] = None,
    key_padding_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    schedule: Optional[str] = None,
    return_lse: bool = False,
):
    r"""Self-attention over a sequence sharded across the ranks of ``group`` (ring attention).

    Every rank calls it with its own shard; the result is this rank's shard of
    ``flash_attention(Q, K, V, is_causal=...)`` on the full sequence, and gradients reach each
    rank's own query, key and value shards. K/V blocks travel around the ring by
    ``torch.distributed.batch_isend_irecv`` (NCCL on GPU, gloo on CPU), each transfer overlapped
    with the attention of the block before it; partial results merge exactly by their LSE in fp32.

    Args:
        query: ``(B, Hq, L_r, E)``, this rank's shard (``L_r`` tokens of the sequence).
        key, value: ``(B, Hkv, L_r, E)`` / ``(B, Hkv, L_r, Ev)``, sharded as ``query``.
        group: the context-parallel process group (the default group if None).
        is_causal: causal self-attention on the *global* positions (top-left, as SDPA).
        layout: how the sequence was sharded (``shard_sequence``): ``"zigzag"`` (rank r holds
            chunks r and 2W−1−r of 2W: balanced under causal attention; the default) or
            ``"contiguous"`` (rank r holds chunk r)::

                W = 2, 8 tokens    zigzag           contiguous
                rank 0             [0 1 | 6 7]      [0 1 2 3]
                rank 1             [2 3 | 4 5]      [4 5 6 7]

        seq_len: the full sequence length. Default ``L_r · W``; pass it when the length does not
            divide evenly (chunk sizes then differ by one token, the first chunks the longer).
            Every rank must pass the same value: checking that would cost a blocking collective
            per call, so a mismatch surfaces in the backend (gloo: "Received data size doesn't
            match expected size"; NCCL: a hang until its timeout).
        key_padding_mask: ``(B, L_r)``, sharded as the keys: bool (True = attend) or additive
            float. It travels with its K/V block. Not differentiable.
        dropout_p: must be 0 (see below).
        scale: softmax scale; default ``1 / sqrt(E)``.
        enable_gqa: allow ``Hq`` to be a multiple of ``Hkv``; K/V travel with their ``Hkv`` heads.
        schedule: precision schedule, passed to every block's op call (``flash_attention``'s).
        return_lse: also return the ``(B, Hq, L_r)`` natural-log LSE (differentiable).

    Returns:
        ``(B, Hq, L_r, Ev)`` in the input dtype, or ``(out, lse)`` with ``return_lse``.

    Dropout is refused: the op draws its dropout mask from a Philox stream indexed by each
    call's *local* (row, key) position, so the dropped weights would change with the number of
    ranks and the layout. Apply dropout outside the attention or train this layer without it.
    """
    world_size = _check_group(group)
    rank = dist.get_rank(group)
    _check_tensors(query, key, value, enable_gqa)
    if not isinstance(dropout_p, (int, float)) or dropout_p != 0:
        raise ValueError(
            f"{_NAME}: dropout_p={dropout_p!r} is not supported under context parallelism: the op's dropout "
            "mask is indexed by local positions, so it would change with the number of ranks. Pass "
            "dropout_p=0.0 (apply dropout outside the attention)."
        )
    precision = get_schedule(schedule)
    if precision.fp8_forward:
        check_fp8_device(query.device)
    scale = default_scale(query.shape[-1]) if scale is None else _check_scale(scale)
    plan = _layout(layout, seq_len, query.shape[2], world_size, rank, is_causal)
    if key.shape[2] != query.shape[2]:
        raise ValueError(
            f"{_NAME}: key has {key.shape[2]} tokens on rank {rank} but query has {query.shape[2]}; context "
            "parallelism here is self-attention: shard query, key and value alike."
        )
    key_padding_mask = _check_key_padding_mask(key_padding_mask, query, key)
    config = RingConfig(group=group, rank=rank, layout=plan, is_causal=bool(is_causal), scale=scale,
                        schedule=precision.name)
    key, value = key.contiguous(), value.contiguous()  # sent as they are
    out, lse = RingAttention.apply(query, key, value, key_padding_mask, config)
    return (out, lse) if return_lse else out


def _check_group(group) -> int:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{_NAME}: torch.distributed is not initialised; call torch.distributed.init_process_group "
            "(torchrun sets its environment) before the first call."
        )
    return dist.get_world_size(group)


def _check_tensors(query, key, value, enable_gqa) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{_NAME}: {name} must be a torch.Tensor, got {type(t).__name__}.")
        if t.dim() != 4:
            raise ValueError(f"{_NAME}: {name} must be 4-D (B, H, L_r, E), got shape {tuple(t.shape)}.")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{_NAME}: {name} has dtype {t.dtype}; supported are float16, bfloat16, float32, float64.")
    if not (query.dtype == key.dtype == value.dtype) or not (query.device == key.device == value.device):
        raise ValueError(f"{_NAME}: query, key and value must share a dtype and a device.")
    if key.shape[-1] != query.shape[-1] or key.shape[:3] != value.shape[:3] or key.shape[0] != query.shape[0]:
        raise ValueError(
            f"{_NAME}: incompatible shapes query {tuple(query.shape)}, key {tuple(key.shape)}, value "
            f"{tuple(value.shape)}: key must match query's batch and head dim, value key's (B, H, L)."
        )
    heads_q, heads_kv = query.shape[1], key.shape[1]
    if heads_q != heads_kv:
        if not enable_gqa:
            raise ValueError(
                f"{_NAME}: query has {heads_q} heads but key/value have {heads_kv}; for grouped-query "
                "attention pass enable_gqa=True."
            )
        if heads_kv == 0 or heads_q % heads_kv:
            raise ValueError(f"{_NAME}: query heads ({heads_q}) must be a multiple of key/value heads ({heads_kv}).")


def _check_scale(scale) -> float:
    if isinstance(scale, Tensor) or not isinstance(scale, (int, float)) or scale != scale or abs(scale) == float("inf"):
        raise ValueError(f"{_NAME}: scale must be a finite Python float or None, got {scale!r}.")
    return float(scale)


def _layout(kind, seq_len, local_len, world_size, rank, is_causal) -> SequenceLayout:
    inferred = seq_len is None
    if inferred:
        seq_len = local_len * world_size
    plan = SequenceLayout(int(seq_len), world_size, kind)
    expected = [plan.local_len(r) for r in range(world_size)]
    if expected[rank] != local_len or (inferred and len(set(expected)) != 1):
        hint = (f"a {kind} split of {seq_len} tokens over {world_size} ranks gives shards of {expected} tokens, "
                f"but rank {rank} holds {local_len}")
        if inferred:
            hint += ("; when the length does not divide evenly, pass seq_len= (the full length, the same on "
                     "every rank) and shard with flash_inductor.distributed.shard_sequence")
        raise ValueError(f"{_NAME}: {hint}.")
    return plan


def _check_key_padding_mask(mask, query, key) -> Optional[Tensor]:
    if mask is None:
        return None
    if not isinstance(mask, Tensor) or (mask.dtype != torch.bool and not mask.is_floating_point()):
        raise TypeError(f"{_NAME}: key_padding_mask must be a bool (True = attend) or float tensor.")
    if tuple(mask.shape) != (key.shape[0], key.shape[2]):
        raise ValueError(
            f"{_NAME}: key_padding_mask must be (B, L_r) = {(key.shape[0], key.shape[2])}, this rank's shard "
            f"of a (B, L) key-padding mask, got {tuple(mask.shape)}; other masks do not shard with the sequence."
        )
    if mask.requires_grad:
        raise ValueError(f"{_NAME}: key_padding_mask is not differentiable here; pass mask.detach().")
    if mask.device != query.device:
        raise ValueError(f"{_NAME}: key_padding_mask is on {mask.device} but query is on {query.device}.")
    return mask.contiguous()
