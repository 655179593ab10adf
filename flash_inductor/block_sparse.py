"""Block-sparse attention layouts: which (query block, key block) pairs a call computes.

:class:`BlockSparseLayout` is the public type ``flash_attention(..., block_mask=)`` takes: a bool
block map of shape ``(B or 1, H or 1, ceil(L / block_q), ceil(S / block_k))``, True where the
block is computed. Its block size is a property of the layout, not of the kernels: the launchers
convert it to their own tile sizes (``launch/block_tiles.py``), so any tuned config runs it.
An element mask for blocks that are only partly visible is the call's ``attn_mask``, which
applies inside every computed block.

FlexAttention's ``BlockMask`` is accepted too, when its mask can be stated this way: its full
blocks need no element mask; its partial blocks need its ``mask_mod``, which cannot run inside
our kernels, so a BlockMask with partial blocks needs ``attn_mask`` (the same mask, element by
element) unless its ``mask_mod`` is FlexAttention's ``noop_mask``.

Semantics, for query row i and key j (``block_q``, ``block_k`` the layout's block sizes)::

    visible(i, j) = block_map[b, h, i // block_q, j // block_k]  and  attn_mask(i, j)  and  band(i, j)

(the band: ``is_causal`` and ``window``).

A row whose blocks are all skipped sees no key: output 0, LSE -inf, zero gradients, as a fully
masked row.

The op (``flash_inductor::attention_forward``) takes the normalised layout as three arguments
after the window's: ``block_map`` (a 4-D bool tensor whose first two dims are 1 or the batch and
query heads), ``block_q`` and ``block_k`` (0 when there is no layout). The kernels skip tiles
as ``launch/block_tiles.py`` describes; ``docs/sparse_attention.md`` has the whole story.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional, Union

import torch
from torch import Tensor

__all__ = ["BlockSparseLayout", "DEFAULT_BLOCK_SIZE", "OpLayout", "resolve_block_mask", "expand_block_map"]

DEFAULT_BLOCK_SIZE = 128

try:  # FlexAttention exists in every supported torch; keep an import failure local all the same.
    from torch.nn.attention.flex_attention import BlockMask as _FlexBlockMask
    from torch.nn.attention.flex_attention import noop_mask as _flex_noop_mask
except ImportError:  # pragma: no cover
    _FlexBlockMask = _flex_noop_mask = None


def _block_pair(block_size) -> tuple[int, int]:
    pair = (block_size, block_size) if isinstance(block_size, int) else block_size
    if (not isinstance(pair, (tuple, list)) or len(pair) != 2
            or any(isinstance(b, bool) or not isinstance(b, int) or b <= 0 for b in pair)):
        raise ValueError(
            f"BlockSparseLayout: block_size must be a positive int or a (block_q, block_k) pair of them, "
            f"got {block_size!r}."
        )
    return int(pair[0]), int(pair[1])


@dataclass(frozen=True, eq=False)
class BlockSparseLayout:
    """A block-level attention layout: ``block_map[..., r, c]`` is True when query block ``r``
    (rows ``r * block_q`` to ``(r + 1) * block_q - 1``) attends to key block ``c``.

    Args:
        block_map: bool tensor ``(..., ceil(L / block_q), ceil(S / block_k))``; its leading dims
            broadcast against the query's batch and head dims as ``attn_mask``'s do, so
            ``(1, 1, NQ, NK)`` or ``(NQ, NK)`` is one layout for every batch and head, ``(B, 1, NQ,
            NK)`` one per batch element, ``(B, H, NQ, NK)`` one per head. The last block of each
            axis may be ragged (L, S need not be multiples of the block size).
        block_size: ``block_q`` or ``(block_q, block_k)``; 128 by default. Independent of the
            kernels' tile sizes.

    Example: a random layout with 90 % of its 128 x 128 blocks skipped::

        nq, nk = -(-L // 128), -(-S // 128)
        layout = BlockSparseLayout(torch.rand(1, 1, nq, nk, device="cuda") < 0.1)
        out = flash_attention(q, k, v, block_mask=layout)
    """

    block_map: Tensor
    block_size: Union[int, tuple[int, int]] = DEFAULT_BLOCK_SIZE

    def __post_init__(self):
        if not isinstance(self.block_map, Tensor):
            raise TypeError(f"BlockSparseLayout: block_map must be a bool torch.Tensor, got "
                            f"{type(self.block_map).__name__}.")
        if self.block_map.dtype != torch.bool:
            raise TypeError(
                f"BlockSparseLayout: block_map must be a bool tensor (True = compute the block), got "
                f"{self.block_map.dtype}; convert it with `block_map != 0`."
            )
        if self.block_map.dim() < 2:
            raise ValueError(
                f"BlockSparseLayout: block_map needs at least 2 dims (..., query blocks, key blocks), got "
                f"shape {tuple(self.block_map.shape)}."
            )
        object.__setattr__(self, "block_size", _block_pair(self.block_size))

    @property
    def block_q(self) -> int:
        return self.block_size[0]

    @property
    def block_k(self) -> int:
        return self.block_size[1]

    @classmethod
    def from_block_mask(cls, block_mask, *, has_element_mask: bool = False) -> "BlockSparseLayout":
        """The layout of a FlexAttention ``BlockMask``: its partial and its full blocks computed.

        Its partial blocks' elements are decided by its ``mask_mod``, which this layout does not
        carry: unless the mask_mod is ``noop_mask`` (or there are no partial blocks), pass
        ``has_element_mask=True`` to promise that the call also gets that mask as ``attn_mask``.
        Raises ValueError otherwise, naming the fix.
        """
        if _FlexBlockMask is None or not isinstance(block_mask, _FlexBlockMask):
            raise TypeError(f"BlockSparseLayout.from_block_mask takes a torch.nn.attention.flex_attention.BlockMask, "
                            f"got {type(block_mask).__name__}.")
        if block_mask.mask_mod is not _flex_noop_mask and not has_element_mask:
            partial = int(block_mask.kv_num_blocks.sum())
            if partial:
                name = getattr(block_mask.mask_mod, "__name__", repr(block_mask.mask_mod))
                raise ValueError(
                    f"block_mask: this BlockMask has {partial} partial block(s), whose elements its mask_mod "
                    f"({name}) decides, and a mask_mod cannot run inside flash_inductor's kernels. Pass the same "
                    "mask element by element as attn_mask (e.g. torch.nn.attention.flex_attention.create_mask("
                    "mask_mod, B, H, L, S)), or build the BlockMask from whole blocks (BlockMask.from_kv_blocks "
                    "with mask_mod=None)."
                )
        dense = _ordered_to_dense(block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.kv_indices.shape[-1])
        if block_mask.full_kv_num_blocks is not None:
            dense = dense | _ordered_to_dense(block_mask.full_kv_num_blocks, block_mask.full_kv_indices,
                                              block_mask.kv_indices.shape[-1])
        return cls(dense, tuple(block_mask.BLOCK_SIZE))

    def to_dense(self, seq_q: int, seq_k: int) -> Tensor:
        """The element-level (..., L, S) bool mask of the layout (True = computed)."""
        self.check_lengths(seq_q, seq_k)
        return expand_block_map(self.block_map, self.block_q, self.block_k, 0, seq_q, 0, seq_k)

    def check_lengths(self, seq_q: int, seq_k: int, what: str = "block_mask") -> None:
        """Raise a ValueError naming the expected block counts unless the map covers (L, S)."""
        expected = (_cdiv(seq_q, self.block_q), _cdiv(seq_k, self.block_k))
        if tuple(self.block_map.shape[-2:]) != expected:
            raise ValueError(
                f"{what}: a block map of {tuple(self.block_map.shape[-2:])} (query blocks, key blocks) does not "
                f"cover L = {seq_q}, S = {seq_k} with block size {self.block_size}; it needs "
                f"(ceil(L / {self.block_q}), ceil(S / {self.block_k})) = {expected}."
            )

    def density(self) -> float:
        """The fraction of blocks computed (1 - sparsity), over the map as stored."""
        return float(self.block_map.float().mean()) if self.block_map.numel() else 0.0


class OpLayout(NamedTuple):
    """The layout as the op takes it: ``block_map`` (Bm, Hm, NQ, NK) bool with Bm in {1, B} and
    Hm in {1, Hq}, or None; ``block_q``/``block_k`` its block sizes (0 without a layout)."""

    block_map: Optional[Tensor]
    block_q: int
    block_k: int


NO_LAYOUT = OpLayout(None, 0, 0)


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _ordered_to_dense(num_blocks: Tensor, indices: Tensor, num_cols: int) -> Tensor:
    """FlexAttention's (num_blocks (..., NQ), indices (..., NQ, K)) as a dense (..., NQ, num_cols)
    bool map. Entries past num_blocks are ignored; they go to a sink column that is cut off."""
    valid = torch.arange(indices.shape[-1], device=indices.device) < num_blocks[..., None]
    cols = torch.where(valid, indices.long(), num_cols)
    dense = torch.zeros((*indices.shape[:-1], num_cols + 1), dtype=torch.bool, device=indices.device)
    dense.scatter_(-1, cols, True)
    return dense[..., :num_cols]


def expand_block_map(block_map: Tensor, block_q: int, block_k: int, row_start: int, row_stop: int,
                     col_start: int, col_stop: int) -> Tensor:
    """The element mask of rows [row_start, row_stop) and keys [col_start, col_stop) of a layout:
    ``block_map[..., i // block_q, j // block_k]``, shape (..., rows, keys). A gather, not a
    repeat, so a chunk of it costs only its own size (the reference path builds it per key chunk)."""
    rows = torch.arange(row_start, row_stop, device=block_map.device) // block_q
    cols = torch.arange(col_start, col_stop, device=block_map.device) // block_k
    return block_map[..., rows, :][..., cols]


def broadcast_per_head(t: Tensor, inner: tuple, query_dim: int, batch_shape, heads_q: int, error) -> Tensor:
    """``t``, a map over a query's (batch..., heads, *inner), or (batch..., *inner) for a query
    without a head dim, broadcast to it (a view: broadcast dims get stride 0) and shaped
    (B', heads, *inner) as the launchers take it: batch dims flattened, a missing head dim of 1.
    ``inner`` is (L, S) for the element mask (``api.flash_attention``'s attn_mask), the block
    counts for a block map. A ``t`` that does not broadcast raises ValueError(``error(full shape)``)."""
    full_shape = (*batch_shape, heads_q, *inner) if query_dim >= 4 else (*batch_shape, *inner)
    try:
        expanded = t.expand(full_shape)
    except RuntimeError:
        raise ValueError(error(tuple(full_shape))) from None
    if query_dim == 3:
        return expanded.unsqueeze(1)
    if query_dim == 2:
        return expanded[None, None]
    if query_dim == 4:
        return expanded
    # The batch dims' product, not -1: reshape cannot infer a dim of an empty tensor.
    return expanded.reshape(math.prod(batch_shape), heads_q, *inner)


def resolve_block_mask(block_mask, attn_mask_given: bool, query: Tensor, batch_shape, heads_q: int,
                       seq_q: int, seq_k: int) -> OpLayout:
    """``flash_attention``'s ``block_mask`` argument as the op's (block_map, block_q, block_k).

    ``query`` is the broadcast query (its rank decides whether the map has a head dim, as for
    ``attn_mask``). Broadcast batch / head dims stay size 1, so one layout for every head is
    stored (and converted to tiles) once.
    """
    if block_mask is None:
        return NO_LAYOUT
    if _FlexBlockMask is not None and isinstance(block_mask, _FlexBlockMask):
        if tuple(block_mask.seq_lengths) != (seq_q, seq_k):
            raise ValueError(
                f"block_mask: the BlockMask is for (Q_LEN, KV_LEN) = {tuple(block_mask.seq_lengths)} but query/key "
                f"have (L, S) = ({seq_q}, {seq_k}); create it with create_block_mask(..., Q_LEN={seq_q}, "
                f"KV_LEN={seq_k})."
            )
        layout = BlockSparseLayout.from_block_mask(block_mask, has_element_mask=attn_mask_given)
    elif isinstance(block_mask, BlockSparseLayout):
        layout = block_mask
    else:
        raise TypeError(
            f"flash_attention: block_mask must be a flash_inductor.BlockSparseLayout, a FlexAttention BlockMask "
            f"or None, got {type(block_mask).__name__}; wrap a bool block map as BlockSparseLayout(block_map, "
            "block_size)."
        )
    layout.check_lengths(seq_q, seq_k)
    block_map = layout.block_map
    if block_map.device != query.device:
        raise ValueError(f"block_mask: the block map is on {block_map.device} but query is on {query.device}; "
                         "move it with BlockSparseLayout(block_map.to(query.device), block_size).")
    expanded = broadcast_per_head(
        block_map, tuple(block_map.shape[-2:]), query.dim(), batch_shape, heads_q,
        lambda full_shape: f"block_mask: a block map of shape {tuple(block_map.shape)} does not broadcast to "
                           f"(batch..., heads, query blocks, key blocks) = {full_shape}; give it batch and head "
                           "dims of 1 or of the query's sizes.")
    # Broadcast batch / head dims back to size 1: the launchers index the map with a stride of 0
    # there, and convert it to tiles once rather than once per batch element or head.
    for dim in (0, 1):
        if expanded.shape[dim] > 1 and expanded.stride(dim) == 0:
            expanded = expanded.narrow(dim, 0, 1)
    return OpLayout(expanded, layout.block_q, layout.block_k)
