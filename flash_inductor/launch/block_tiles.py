"""A block-sparse layout (``flash_inductor.block_sparse``) in the kernels' own tiles.

The layout's blocks (``block_q`` x ``block_k``, 128 x 128 by default) and a launch's tiles
(``BLOCK_M`` x ``BLOCK_N``, whatever the tuning table picked) are independent, so a tile may
straddle several layout blocks, some computed and some not (a 128-row tile over 64-row blocks), or
lie inside one (a 32-row tile in a 128-row block). Each tile of each (batch, head) of the layout
gets a class:

    SKIP     no element of it is visible: no layout block it touches is computed, or it lies wholly
             outside the causal band;
    FULL     every element is inside computed layout blocks, inside S and visible under causal
             masking: the kernels run it without the visibility select (an ``attn_mask`` still
             applies);
    PARTIAL  the rest: the kernels apply the select, which tests the layout per element only where
             tiles and layout blocks do not nest (``needs_element_check``), since a tile inside a
             single layout block is PARTIAL only for the causal diagonal or a ragged last key tile.

and the passes read the classes as FlexAttention's BlockMask holds its blocks (``kv_num_blocks`` /
``kv_indices`` and their ``full_`` twins): per query tile the counts of FULL and PARTIAL key tiles
and one list of their indices, for the forward and the dQ pass; per key tile the same over query
tiles (``q_num_blocks`` / ``q_indices``) for the dK/dV pass.

Everything here is torch ops on the map's device, with no host synchronisation: under
``torch.compile`` it traces into the graph, and a CUDA graph may capture it.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple, Optional

import torch
from torch import Tensor

SKIP, PARTIAL, FULL = 0, 1, 2


class TileLists(NamedTuple):
    """Per outer tile, the inner tiles to visit: ``counts`` (Bm, Hm, outer, 2) int32, the number of
    FULL and of PARTIAL tiles, and ``order`` (Bm, Hm, outer, inner) int32, the tile indices, one
    class after the other, each in ascending order, then the SKIP ones (never read)."""

    counts: Tensor
    order: Tensor


def check_block_layout(block_map: Tensor, block_q: int, block_k: int, query: Optional[Tensor] = None,
                       key: Optional[Tensor] = None) -> None:
    """Raise a ValueError unless ``block_map`` is the op's normalised layout: 4-D bool,
    (1 or B, 1 or Hq, ceil(L / block_q), ceil(S / block_k)), positive block sizes. The public
    function produces it (``block_sparse.resolve_block_mask``); direct op callers may not."""
    if block_map.dtype != torch.bool or block_map.dim() != 4:
        raise ValueError(f"block_map: the op takes a 4-D bool block map (Bm, Hm, query blocks, key blocks), got "
                         f"{block_map.dtype} of shape {tuple(block_map.shape)}; build it with "
                         "flash_inductor.BlockSparseLayout and pass it to flash_attention(block_mask=...).")
    if block_q <= 0 or block_k <= 0:
        raise ValueError(f"block_map: block_q and block_k must be positive with a block map, got {block_q}, {block_k}.")
    if query is None or key is None:
        return
    batch, heads_q, seq_q = query.shape[:3]
    seq_k = key.shape[2]
    expected = (-(-seq_q // block_q), -(-seq_k // block_k))
    if (tuple(block_map.shape[2:]) != expected or block_map.shape[0] not in (1, batch)
            or block_map.shape[1] not in (1, heads_q)):
        raise ValueError(
            f"block_map: shape {tuple(block_map.shape)} is not (1 or {batch}, 1 or {heads_q}, *{expected}) for "
            f"L = {seq_q}, S = {seq_k} and blocks of {block_q} x {block_k}."
        )


def fold_into_mask(attn_mask: Optional[Tensor], block_map: Tensor, block_q: int, block_k: int,
                   shape: tuple) -> Tensor:
    """The layout and ``attn_mask`` as one element mask of ``shape`` (B, Hq, L, S): bool when the
    mask is bool or None, else the float mask with -inf outside the layout. For launches that
    take no layout (the `fp8` forward); it costs a dense (L, S) mask per broadcast map."""
    from ..block_sparse import expand_block_map

    seq_q, seq_k = shape[2], shape[3]
    in_layout = expand_block_map(block_map, block_q, block_k, 0, seq_q, 0, seq_k).expand(shape)
    if attn_mask is None:
        return in_layout
    if attn_mask.dtype == torch.bool:
        return attn_mask & in_layout
    return attn_mask.masked_fill(~in_layout, float("-inf"))


def needs_element_check(block_q: int, block_k: int, seq_q: int, seq_k: int, block_m: int, block_n: int) -> bool:
    """Whether some tile may straddle a computed and a skipped layout block: unless every tile lies
    inside one layout block along both axes (the layout block a multiple of the tile, or one block
    spanning the whole axis), PARTIAL tiles must test the layout per element."""
    rows_nest = block_q % block_m == 0 or block_q >= seq_q
    cols_nest = block_k % block_n == 0 or block_k >= seq_k
    return not (rows_nest and cols_nest)


def _block_span(tiles: int, tile: int, length: int, block: int, device) -> tuple[Tensor, Tensor]:
    """First and last layout block (inclusive) each tile's in-range elements fall in."""
    start = torch.arange(tiles, device=device) * tile
    stop = torch.clamp(start + tile, max=length)  # exclusive; a tile here always holds an element
    return start // block, (stop - 1) // block


def tile_classes(block_map: Tensor, block_q: int, block_k: int, seq_q: int, seq_k: int, block_m: int, block_n: int,
                 band_lower: Optional[int] = None, band_upper: Optional[int] = None) -> Tensor:
    """(Bm, Hm, ceil(L / block_m), ceil(S / block_n)) int8 tile classes (SKIP, PARTIAL, FULL).

    ``band_lower`` / ``band_upper``: key j is visible to row i only if ``i + lower <= j <= i +
    upper`` (None leaves a side open): ``is_causal`` gives ``upper = causal_offset``. Rows past L
    count as in the tile for the band (the kernels do not select them out of an unchecked tile),
    which only makes a tile PARTIAL or computed where it might have been FULL or skipped.
    """
    device = block_map.device
    tiles_m, tiles_n = -(-seq_q // block_m), -(-seq_k // block_n)
    # Computed layout blocks over each tile's rectangle of blocks, by a 2-D prefix sum.
    counts = block_map.to(torch.int32).cumsum(-2).cumsum(-1)
    counts = torch.nn.functional.pad(counts, (1, 0, 1, 0))
    r0, r1 = _block_span(tiles_m, block_m, seq_q, block_q, device)
    c0, c1 = _block_span(tiles_n, block_n, seq_k, block_k, device)
    r0, r1, c0, c1 = r0[:, None], (r1 + 1)[:, None], c0[None, :], (c1 + 1)[None, :]
    computed = counts[..., r1, c1] - counts[..., r0, c1] - counts[..., r1, c0] + counts[..., r0, c0]
    area = (r1 - r0) * (c1 - c0)

    row_first = (torch.arange(tiles_m, device=device) * block_m)[:, None]
    key_first = (torch.arange(tiles_n, device=device) * block_n)[None, :]
    min_diag = key_first - (row_first + block_m - 1)  # smallest j - i in the tile
    max_diag = key_first + block_n - 1 - row_first  # largest j - i
    band_full = torch.ones_like(min_diag, dtype=torch.bool)
    band_empty = torch.zeros_like(min_diag, dtype=torch.bool)
    if band_upper is not None:
        band_full = band_full & (max_diag <= band_upper)
        band_empty = band_empty | (min_diag > band_upper)
    if band_lower is not None:
        band_full = band_full & (min_diag >= band_lower)
        band_empty = band_empty | (max_diag < band_lower)
    # A ragged last key tile's padding keys score 0 and must be selected out (attn_bwd.py, "Loop split").
    whole = key_first + block_n <= seq_k

    classes = torch.full(computed.shape, PARTIAL, dtype=torch.int8, device=device)
    classes = torch.where((computed == area) & band_full & whole, FULL, classes)
    classes = torch.where((computed == 0) | band_empty, SKIP, classes)
    return classes.to(torch.int8)


def _lists(classes: Tensor, first: int) -> TileLists:
    counts = torch.stack([(classes == kind).sum(-1, dtype=torch.int32) for kind in (FULL, PARTIAL)], dim=-1)
    rank = torch.where(classes == first, 2, torch.where(classes == SKIP, 0, 1)).to(torch.int8)
    # Stable, so each class is in ascending tile order (the kernels then read K/V in order).
    order = torch.argsort(rank, dim=-1, descending=True, stable=True)
    return TileLists(counts.contiguous(), order.to(torch.int32).contiguous())


def row_tile_lists(classes: Tensor) -> TileLists:
    """Per query tile, its key tiles, FULL first (the forward and the dQ pass, whose loops run
    their unchecked range before the checked one)."""
    return _lists(classes, FULL)


def column_tile_lists(classes: Tensor) -> TileLists:
    """Per key tile, its query tiles, PARTIAL first (the dK/dV pass, whose loop runs its checked
    range first)."""
    return _lists(classes.transpose(-2, -1), PARTIAL)


# The layout arguments of a kernel launch, in the kernels' order (``kernels/block_sparse.py``): COUNTS,
# IDX, BLOCK_MAP, stride_cb, stride_ch, stride_ib, stride_ih, list_len, and BLOCK_MAP's 4 strides.
LAYOUT_ARGS = 12
# The layout switches of a dense launch, passed explicitly (the kernels' defaults) rather than left to
# the signature's defaults, which not every caller of a kernel applies.
DENSE_LAYOUT = dict(HAS_BLOCK_SPARSITY=False, LAYOUT_CHECK=False, LAYOUT_BQ=1, LAYOUT_BK=1)


def kernel_layout(block_map: Optional[Tensor], block_q: int, block_k: int, batch: int, heads_q: int, seq_q, seq_k,
                  band_lower, band_upper, block_m: int, block_n: int, *, columns: bool = False) -> tuple[tuple, dict]:
    """(the LAYOUT_ARGS positional arguments, the constexpr keywords) of one launch at tiles of
    ``block_m`` query rows by ``block_n`` keys: per query tile its key tiles, or under ``columns``
    (the dK/dV pass) per key tile its query tiles. Without a layout every argument is None, which
    Triton takes as a constant: the dense kernels compile exactly as with no such arguments."""
    if block_map is None:
        return (None,) * LAYOUT_ARGS, dict(DENSE_LAYOUT)

    def lists():
        classes = tile_classes(block_map, block_q, block_k, seq_q, seq_k, block_m, block_n, band_lower, band_upper)
        return column_tile_lists(classes) if columns else row_tile_lists(classes)

    key = (block_q, block_k, seq_q, seq_k, block_m, block_n, band_lower, band_upper, columns)
    counts, indices = _cached_lists(block_map, key, lists)
    # Broadcast batch / head dims read with a stride of 0.
    counts = counts.expand(batch, heads_q, *counts.shape[2:])
    indices = indices.expand(batch, heads_q, *indices.shape[2:])
    check = needs_element_check(block_q, block_k, seq_q, seq_k, block_m, block_n)
    # Without the element test the map is never read: the counts stand in for its pointer.
    layout_map = block_map.expand(batch, heads_q, *block_map.shape[2:]) if check else counts
    map_strides = layout_map.stride() if check else (0,) * 4
    args = (counts, indices, layout_map, counts.stride(0), counts.stride(1), indices.stride(0), indices.stride(1),
            indices.shape[-1], *map_strides)
    meta = dict(DENSE_LAYOUT, HAS_BLOCK_SPARSITY=True, LAYOUT_CHECK=check)
    if check:
        meta.update(LAYOUT_BQ=block_q, LAYOUT_BK=block_k)
    return args, meta


# The layout block sizes the Gluon Hopper kernels take: multiples of their query blocks (64 rows a
# consumer warpgroup, two of them in a forward block) and of their key tiles (128 keys a backward
# CTA; 64 or 128 in the forward), so that no tile straddles a computed and a skipped layout block
# and the kernels need no per-element test of the layout.
GLUON_LAYOUT_MULTIPLE = 128


def gluon_layout_fits(block_q: int, block_k: int) -> bool:
    """Whether the Gluon Hopper kernels take a layout of ``block_q`` x ``block_k`` blocks."""
    return block_q % GLUON_LAYOUT_MULTIPLE == 0 and block_k % GLUON_LAYOUT_MULTIPLE == 0


class GluonTileLists(NamedTuple):
    """A layout as the Gluon Hopper kernels walk it (HAS_BLOCK_SPARSITY in kernels/hopper_fwd.py and
    kernels/hopper_bwd.py): ``lists`` int32 (Bm, Hm, outer tiles, 1 + inner tiles), per outer tile
    the number of inner tiles to compute, then their indices in ascending order (then the skipped
    ones, never read); ``stride_b``/``stride_h`` its batch and head strides, 0 where the layout
    broadcasts; ``row`` its last dim."""

    lists: Tensor
    stride_b: int
    stride_h: int
    row: int


def checked_gluon_layout(block_layout: tuple, query: Tensor, key: Tensor, kernel: str) -> tuple:
    """``block_layout`` (block_map, block_q, block_k) once it is checked against the call and found to
    fit the Gluon Hopper ``kernel`` ("forward" or "backward"), whose launchers callers reach only
    where the kernels' static choice took the layout."""
    block_map, block_q, block_k = block_layout
    check_block_layout(block_map, block_q, block_k, query, key)
    if not gluon_layout_fits(block_q, block_k):
        raise ValueError(f"block_map: the Hopper {kernel} takes layout blocks that are multiples of "
                         f"{GLUON_LAYOUT_MULTIPLE} x {GLUON_LAYOUT_MULTIPLE}, got {block_q} x {block_k}; call it only "
                         f"where hopper_{kernel}_unsupported_reason says None")
    return block_layout


def gluon_tile_lists(block_map: Tensor, block_q: int, block_k: int, seq_q, seq_k, band_lower, band_upper,
                     block_m: int, block_n: int, *, columns: bool = False) -> GluonTileLists:
    """Per query tile of ``block_m`` rows its key tiles of ``block_n`` (under ``columns``, per key tile
    its query tiles) that hold a visible element, for a layout that ``gluon_layout_fits``: a tile is
    computed in full or skipped, and the kernels' own band and length checks do the rest."""
    def lists():
        classes = tile_classes(block_map, block_q, block_k, seq_q, seq_k, block_m, block_n, band_lower, band_upper)
        computed = (classes.transpose(-2, -1) if columns else classes) != SKIP
        counts = computed.sum(-1, dtype=torch.int32, keepdim=True)
        # Stable: the computed tiles keep ascending order (the kernels then read K/V or Q/dO in order).
        order = torch.argsort(computed.to(torch.int8), dim=-1, descending=True, stable=True)
        return torch.cat([counts, order.to(torch.int32)], dim=-1).contiguous()

    key = ("gluon", block_q, block_k, seq_q, seq_k, block_m, block_n, band_lower, band_upper, columns)
    table = _cached_lists(block_map, key, lists)
    return GluonTileLists(table, table.stride(0) if table.shape[0] > 1 else 0,
                          table.stride(1) if table.shape[1] > 1 else 0, table.shape[-1])


# Eager calls with one layout (a training loop's, a benchmark's) convert it once per tile shape rather
# than at every launch: about 15 small torch ops per pass, whose launch time can rival a sparse
# kernel's. Keyed by the map's base tensor (the API hands the launchers a fresh view of the caller's
# map each call) and its version, so an in-place change of the map is seen; dropped with the tensor.
_LIST_CACHE: dict = {}


def _cached_lists(block_map: Tensor, key: tuple, compute):
    base = block_map._base if block_map._base is not None else block_map
    if type(base) is not torch.Tensor or torch.compiler.is_compiling():
        return compute()  # traced (fake or functional tensors): the ops go into the graph
    ident = id(base)
    entry = _LIST_CACHE.get(ident)
    if entry is None or entry[0]() is not base or entry[1] != base._version:
        entry = (weakref.ref(base, lambda _, ident=ident: _LIST_CACHE.pop(ident, None)), base._version, {})
        _LIST_CACHE[ident] = entry
    view_key = (tuple(block_map.shape), tuple(block_map.stride()), block_map.storage_offset(), key)
    if view_key not in entry[2]:
        entry[2][view_key] = compute()
    return entry[2][view_key]
