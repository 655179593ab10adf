"""The tile ranges of a band: which tiles a program visits, and which of them need the visibility select.

Every visibility rule the kernels know is a band (``launch/band.py``): key j is visible to row i
iff ``i + window_lower <= j <= i + causal_offset``, the lower side under WINDOW_LEFT only, the
upper side under IS_CAUSAL only. ``launch/band.py`` mirrors these helpers in Python, and the tests
check the mirror against the band.

Symbols: start_m / start_n (the program's first query row / key), L / S (query / key lengths),
lo, mid, split, hi (key ranges of a query tile) and lo, mid, mid_hi, hi (query-row ranges of a key
tile); every boundary but a clipped hi is a multiple of the looped-over block.

Constexpr switches: IS_CAUSAL (the band's upper side), WINDOW_LEFT (its lower side), BLOCK_M /
BLOCK_N (query rows and keys per tile).
"""

import triton
import triton.language as tl


@triton.jit
def query_tile_key_ranges(start_m, S, causal_offset, window_lower,
                          IS_CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(lo, mid, split, hi): the key tiles of the query tile at ``start_m`` (the forward and the dQ
    pass). [lo, mid) crosses the window's left edge, [mid, split) is whole and visible to every row
    of the tile (no select), [split, hi) holds the causal diagonal and a ragged last tile. Tiles
    outside [lo, hi) hold no visible key; without WINDOW_LEFT, lo = mid = 0."""
    if IS_CAUSAL:
        hi = tl.minimum(S, start_m + BLOCK_M + causal_offset)
        split = tl.minimum(S, start_m + causal_offset + 1)
    else:
        hi = S
        split = S
    split = tl.maximum(split // BLOCK_N * BLOCK_N, 0)
    lo = 0
    mid = 0
    if WINDOW_LEFT:
        lo = tl.maximum(start_m + window_lower, 0) // BLOCK_N * BLOCK_N
        # No key for any row of the tile (the band starts at or past hi, or its two sides cross):
        # every range empty, none of them negative.
        no_key = tl.maximum(start_m + window_lower, 0) >= hi
        if IS_CAUSAL:
            no_key = no_key | (causal_offset < window_lower)
        hi = tl.where(no_key, lo, hi)
        # From `mid` on, keys lie right of every row's left edge.
        mid = tl.maximum(start_m + BLOCK_M - 1 + window_lower, 0)
        mid = tl.minimum(tl.maximum((mid + BLOCK_N - 1) // BLOCK_N * BLOCK_N, lo), hi)
        split = tl.maximum(split, mid)
    return lo, mid, split, hi


@triton.jit
def key_tile_query_ranges(start_n, L, S, causal_offset, window_lower,
                          IS_CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(lo, mid, mid_hi, hi): the query tiles of the key tile at ``start_n`` (the dK/dV pass).
    Rows before lo see none of these keys under causal masking, and tiles from mid on see all of
    them; under WINDOW_LEFT rows from hi on see none (the window has left them behind) and tiles
    before mid_hi all of them. [lo, mid) and [mid_hi, hi) take the select, [mid, mid_hi) does not;
    a ragged last key tile takes it throughout. Without WINDOW_LEFT, mid_hi = hi = L."""
    if IS_CAUSAL:
        lo = tl.maximum(start_n - causal_offset, 0) // BLOCK_M * BLOCK_M
        mid = tl.maximum(start_n + BLOCK_N - 1 - causal_offset, 0)
        mid = (mid + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    else:
        lo = 0
        mid = 0
    hi = L
    mid_hi = L
    if WINDOW_LEFT:
        hi = tl.minimum(L, tl.maximum(start_n + BLOCK_N - window_lower, 0))
        if IS_CAUSAL:  # no row sees these keys: the band starts at or past hi, or its sides cross
            no_row = (tl.maximum(start_n - causal_offset, 0) >= hi) | (causal_offset < window_lower)
            hi = tl.where(no_row, 0, hi)
        mid_hi = tl.maximum(start_n - window_lower + 1, 0) // BLOCK_M * BLOCK_M
    mid = tl.where(start_n + BLOCK_N > S, hi, mid)
    mid = tl.minimum(tl.maximum(mid, lo), hi)
    if WINDOW_LEFT:
        mid_hi = tl.minimum(tl.maximum(mid_hi, mid), hi)
    return lo, mid, mid_hi, hi
