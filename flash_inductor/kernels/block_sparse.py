"""Triton helpers of the block-sparse loops: where a tile's list of tiles lives, and the per-element
test of the layout in tiles that straddle computed and skipped layout blocks.

A block-sparse launch (``launch/block_tiles.py``) passes, per (batch, head) and per outer tile
(a query tile in the forward and the dQ pass, a key tile in the dK/dV pass), the inner tiles to
visit in two classes: FULL tiles (every element visible: no select) and PARTIAL ones (the select,
with the layout tested per element where tiles and layout blocks do not nest).

Symbols

    COUNTS      int32 (B, H, tiles, 2): per outer tile, the number of FULL and of PARTIAL tiles
    IDX         int32 (B, H, tiles, list_len): their indices, one class after the other (FULL first
                in the forward and the dQ pass, PARTIAL first in the dK/dV pass, each matching the
                order of the pass's unchecked and checked loops)
    stride_cb, stride_ch / stride_ib, stride_ih   their batch and head strides (0 where the layout
                broadcasts); the last dims are contiguous
    listed      (list_ptr, map_base, stride_bmm, stride_bmn): what a tile loop needs: the list it
                walks and the layout block map at this batch and head (rows: query blocks)
    LAYOUT_BQ, LAYOUT_BK   the layout's block sizes (constexpr: the element test divides by them)
"""

import triton
import triton.language as tl

from .band import query_tile_key_ranges


@triton.jit
def tile_lists(COUNTS, IDX, b, h, tile, stride_cb, stride_ch, stride_ib, stride_ih, list_len):
    """(n_full, n_partial, list) of one outer tile at batch b, head h."""
    counts = COUNTS + b * stride_cb + h * stride_ch + tile * 2
    return tl.load(counts), tl.load(counts + 1), IDX + b * stride_ib + h * stride_ih + tile * list_len


@triton.jit
def layout_visible(map_base, stride_bmm, stride_bmn, q_idx, k_idx, in_bounds,
                   LAYOUT_BQ: tl.constexpr, LAYOUT_BK: tl.constexpr):
    """Whether each (row, key) of a tile lies in a computed layout block; ``q_idx``/``k_idx`` are
    broadcast to the tile's orientation, and the load is bounded by ``in_bounds`` (False outside)."""
    computed = tl.load(map_base + (q_idx // LAYOUT_BQ) * stride_bmm + (k_idx // LAYOUT_BK) * stride_bmn,
                       mask=in_bounds, other=0)
    return computed != 0


@triton.jit
def listed_tiles(sparse, b, h, tile):
    """(n_full, n_partial, listed) of one outer tile at batch b, head h; ``sparse`` is the kernel's
    layout arguments (COUNTS, IDX, BLOCK_MAP, stride_cb, stride_ch, stride_ib, stride_ih, list_len,
    stride_bmb, stride_bmh, stride_bmm, stride_bmn)."""
    COUNTS, IDX, BLOCK_MAP, stride_cb, stride_ch, stride_ib, stride_ih, list_len, \
        stride_bmb, stride_bmh, stride_bmm, stride_bmn = sparse
    n_full, n_partial, tile_list = tile_lists(COUNTS, IDX, b, h, tile, stride_cb, stride_ch, stride_ib, stride_ih,
                                              list_len)
    return n_full, n_partial, (tile_list, BLOCK_MAP + b * stride_bmb + h * stride_bmh, stride_bmm, stride_bmn)


@triton.jit
def query_tile_key_tiles(start_m, b, h, S, causal_offset, window_lower, sparse,
                         HAS_BLOCK_SPARSITY: tl.constexpr, IS_CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(listed, (lo, mid, split, hi)): the key tiles of the program's query tile at ``start_m`` (the
    forward and the dQ pass), [lo, mid) and [split, hi) with the visibility select, [mid, split)
    without (``band.query_tile_key_ranges``). Under HAS_BLOCK_SPARSITY they are positions in the
    tile's list, its FULL tiles first ([mid, split)), then its PARTIAL ones ([split, hi)). Dense,
    ``listed`` is a placeholder of the same shape that the loops never read (FROM_LIST and
    LAYOUT_CHECK are False), since a Triton function cannot return None."""
    if HAS_BLOCK_SPARSITY:
        n_full, n_partial, listed = listed_tiles(sparse, b, h, tl.program_id(0))
        ranges = (0, 0, n_full, n_full + n_partial)
    else:
        listed = (0, 0, 0, 0)
        ranges = query_tile_key_ranges(start_m, S, causal_offset, window_lower, IS_CAUSAL=IS_CAUSAL,
                                       WINDOW_LEFT=WINDOW_LEFT, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    return listed, ranges
