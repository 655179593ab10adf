"""How a sequence is split across the ranks of a context-parallel group.

A sequence of ``seq_len`` tokens is cut into chunks whose sizes differ by at most one (the
first ``seq_len % n`` chunks get the extra token, as :func:`torch.tensor_split`):

* ``"contiguous"``: ``n = world_size`` chunks, rank r holds chunk r. Under causal attention
  the last rank does ``world_size`` times the work of the first.
* ``"zigzag"``: ``n = 2 * world_size`` chunks, rank r holds chunks r and ``2W - 1 - r`` (in
  that order, concatenated). Every rank then sees nearly the same number of (query, key) pairs
  below the causal diagonal: the load balance of zig-zag ring attention, and the same order as
  torch's ``_HeadTailLoadBalancer`` (``torch.distributed.tensor.experimental``).

Nothing here communicates except :func:`unshard_sequence`, which all-gathers.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

LAYOUTS = ("zigzag", "contiguous")


@dataclasses.dataclass(frozen=True)
class Segment:
    """Tokens ``[position, position + length)`` of the global sequence, stored at
    ``[local_start, local_start + length)`` of a rank's shard."""

    position: int
    local_start: int
    length: int


@dataclasses.dataclass(frozen=True)
class SequenceLayout:
    """The split of one sequence of ``seq_len`` tokens over ``world_size`` ranks."""

    seq_len: int
    world_size: int
    kind: str = "zigzag"

    def __post_init__(self):
        if self.kind not in LAYOUTS:
            raise ValueError(f"layout={self.kind!r} is not a sequence layout; choose one of {LAYOUTS}.")
        if self.world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {self.world_size}.")
        if self.seq_len < 0:
            raise ValueError(f"seq_len must be non-negative, got {self.seq_len}.")

    @property
    def num_chunks(self) -> int:
        return 2 * self.world_size if self.kind == "zigzag" else self.world_size

    def chunk_bounds(self, chunk: int) -> tuple[int, int]:
        base, extra = divmod(self.seq_len, self.num_chunks)
        start = chunk * base + min(chunk, extra)
        return start, start + base + (1 if chunk < extra else 0)

    def chunks(self, rank: int) -> tuple[int, ...]:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the group of {self.world_size} ranks.")
        if self.kind == "zigzag":
            return (rank, 2 * self.world_size - 1 - rank)
        return (rank,)

    def segments(self, rank: int) -> tuple[Segment, ...]:
        """The rank's shard as runs of consecutive positions (adjacent chunks merged: at world
        size 1 a zig-zag shard is one run, so the ring makes one causal call, as the plain op)."""
        runs: list[Segment] = []
        local = 0
        for chunk in self.chunks(rank):
            start, stop = self.chunk_bounds(chunk)
            if stop == start:
                continue
            if runs and runs[-1].position + runs[-1].length == start:
                last = runs[-1]
                runs[-1] = Segment(last.position, last.local_start, last.length + stop - start)
            else:
                runs.append(Segment(start, local, stop - start))
            local += stop - start
        return tuple(runs)

    def local_len(self, rank: int) -> int:
        return sum(stop - start for start, stop in (self.chunk_bounds(c) for c in self.chunks(rank)))

    def positions(self, rank: int, device=None) -> torch.Tensor:
        """Global positions of the rank's tokens, in shard order (int64): the position ids a
        rotary embedding needs under this layout."""
        parts = [torch.arange(*self.chunk_bounds(c), device=device) for c in self.chunks(rank)]
        return torch.cat(parts)

    def permutation(self, device=None) -> torch.Tensor:
        """Global positions of every shard, rank 0's first: ``full.index_select(dim, perm)`` is
        the concatenation of the shards."""
        return torch.cat([self.positions(r, device) for r in range(self.world_size)])


def _group_geometry(group, rank: Optional[int], world_size: Optional[int]) -> tuple[int, int]:
    if rank is not None and world_size is not None:
        return rank, world_size
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "no process group: call torch.distributed.init_process_group first, or pass rank= and world_size=."
        )
    return dist.get_rank(group), dist.get_world_size(group)


def shard_sequence(tensor: torch.Tensor, dim: int = 2, *, layout: str = "zigzag", group=None,
                   rank: Optional[int] = None, world_size: Optional[int] = None) -> torch.Tensor:
    """This rank's shard of ``tensor`` along ``dim`` (the sequence dim: 2 for (B, H, L, E),
    1 for (B, L) token ids or (B, L, D) activations), under ``layout``. A copy, contiguous.

    ``rank`` / ``world_size`` default to those of ``group`` (the default group if None)."""
    rank, world_size = _group_geometry(group, rank, world_size)
    plan = SequenceLayout(tensor.shape[dim], world_size, layout)
    parts = [tensor.narrow(dim, start, stop - start) for start, stop in
             (plan.chunk_bounds(c) for c in plan.chunks(rank))]
    return torch.cat(parts, dim=dim).contiguous()


def unshard_shards(shards: list[torch.Tensor], dim: int = 2, *, layout: str = "zigzag") -> torch.Tensor:
    """The full tensor from every rank's shard (rank order), back in sequence order."""
    full_len = sum(s.shape[dim] for s in shards)
    plan = SequenceLayout(full_len, len(shards), layout)
    for r, shard in enumerate(shards):
        if shard.shape[dim] != plan.local_len(r):
            raise ValueError(
                f"unshard: rank {r}'s shard has {shard.shape[dim]} tokens along dim {dim}, but a {layout} split of "
                f"{full_len} tokens over {len(shards)} ranks gives it {plan.local_len(r)}."
            )
    inverse = torch.argsort(plan.permutation(shards[0].device))
    return torch.cat(shards, dim=dim).index_select(dim, inverse)


def unshard_sequence(local: torch.Tensor, dim: int = 2, *, seq_len: Optional[int] = None, layout: str = "zigzag",
                     group=None) -> torch.Tensor:
    """All-gather every rank's shard of a sequence and put it back in order (on every rank).

    ``seq_len``: the full length; needed only when the shards are uneven (it defaults to
    ``local.shape[dim] * world_size``). Not differentiable: for inspection, checkpoints, metrics."""
    world_size = dist.get_world_size(group)
    seq_len = local.shape[dim] * world_size if seq_len is None else seq_len
    plan = SequenceLayout(seq_len, world_size, layout)
    longest = max(plan.local_len(r) for r in range(world_size))
    # all_gather needs equal shapes: pad every shard to the longest, then cut.
    padded_shape = list(local.shape)
    padded_shape[dim] = longest
    padded = local.new_zeros(padded_shape)
    padded.narrow(dim, 0, local.shape[dim]).copy_(local)
    gathered = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(gathered, padded.contiguous(), group=group)
    shards = [g.narrow(dim, 0, plan.local_len(r)) for r, g in enumerate(gathered)]
    return unshard_shards(shards, dim, layout=layout)
