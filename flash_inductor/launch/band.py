"""The band of keys each query row sees, and the tiles the kernels visit for it.

Every visibility rule the kernels know is a band around a diagonal: key j is visible to query
row i iff

    i + lower <= j <= i + upper

with either side open. ``is_causal`` closes the upper side at ``causal_offset``; a sliding
window ``(left, right)``, FlashAttention's definition relative to the bottom-right diagonal
``i + S - L``, closes the lower side at ``S - L - left`` and the upper side at ``S - L + right``
(-1 leaves that side open); with both, the upper side is the stricter of the two. A mask, if any,
applies on top of the band.

The kernels skip every tile that lies wholly outside the band and apply the visibility select
only to the tiles the band's edges cross. :func:`forward_key_ranges`, :func:`dq_key_ranges` and
:func:`dkdv_query_ranges` are the Python mirror of the ranges the kernels loop over
(``kernels/attn_fwd.py``, ``kernels/attn_bwd.py``), and :func:`visited_tiles` counts them: the
tests check the mirror against the band, and the benchmark reports the fraction of dense work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

NO_WINDOW = (-1, -1)


@dataclass(frozen=True)
class Band:
    """Key j is visible to row i iff ``i + lower <= j <= i + upper``; None leaves a side open."""

    lower: Optional[int] = None
    upper: Optional[int] = None

    def visible(self, seq_q: int, seq_k: int, device=None) -> torch.Tensor:
        """The (L, S) bool matrix of the band (True = visible), for references and debugging."""
        i = torch.arange(seq_q, device=device)[:, None]
        j = torch.arange(seq_k, device=device)[None, :]
        vis = torch.ones((seq_q, seq_k), dtype=torch.bool, device=device)
        if self.upper is not None:
            vis = vis & (j <= i + self.upper)
        if self.lower is not None:
            vis = vis & (j >= i + self.lower)
        return vis


def window_pair(window) -> tuple[int, int]:
    """``window`` (None or a validated (left, right)) as the op's two ints, -1 for an open side."""
    if window is None:
        return NO_WINDOW
    return int(window[0]), int(window[1])


def has_window(window) -> bool:
    """Whether ``window`` bounds either side (None and (-1, -1) do not)."""
    return window is not None and tuple(window_pair(window)) != NO_WINDOW


def resolve_band(is_causal: bool, causal_offset, window, seq_q, seq_k) -> Band:
    """The band of a call: ``is_causal``/``causal_offset`` as the ops take them, ``window`` None
    or (left, right). Lengths may be symbolic (torch.compile(dynamic=True)): the offsets then are
    too, and the stricter upper side is a ``sym_min``, which guards on nothing."""
    upper = causal_offset if is_causal else None
    lower = None
    left, right = window_pair(window)
    if isinstance(seq_q, int) and isinstance(seq_k, int):
        # A side wider than the sequence binds no row: left >= S puts row L - 1's first key below 0,
        # right >= L puts row 0's last key past S - 1. Open, it runs the kernels without a window
        # and keeps huge offsets out of their 32-bit index arithmetic.
        left = -1 if left >= seq_k else left
        right = -1 if right >= seq_q else right
    if right >= 0:
        window_upper = seq_k - seq_q + right
        upper = window_upper if upper is None else torch.sym_min(upper, window_upper)
    if left >= 0:
        lower = seq_k - seq_q - left
    return Band(lower=lower, upper=upper)


def causal_side(band: Band) -> tuple[bool, int]:
    """The kernels' ``IS_CAUSAL`` and ``causal_offset`` arguments: the band's upper side, which
    carries the causal diagonal and a window's right side alike; (False, 0) when it is open."""
    return band.upper is not None, (band.upper if band.upper is not None else 0)


def band_lower(band: Band):
    """The kernels' ``window_lower`` argument: the band's lower side; 1 when that side is open.

    The kernels do not read it then (WINDOW_LEFT is False), and Triton compiles an integer
    argument equal to 1 into the kernel as a constant: the argument vanishes from the compiled
    signature, and the kernels without a window keep the very code they had before it existed
    (so their tuned table entries still describe them: ``tools/carry_table_entries.py``)."""
    return band.lower if band.lower is not None else 1


# --------------------------------------------------------------------------------------
# The kernels' tile ranges, mirrored. Each returns block-aligned boundaries; a range [a, b) with
# a >= b is empty. "checked" ranges apply the visibility select, "unchecked" ones do not.
# --------------------------------------------------------------------------------------


def _floor(x: int, block: int) -> int:
    return x // block * block


def _ceil(x: int, block: int) -> int:
    return (x + block - 1) // block * block


def forward_key_ranges(band: Band, start_m: int, block_m: int, block_n: int, seq_k: int):
    """Key ranges of the query tile at ``start_m`` (the forward and the dQ pass loop alike):
    ``(lo, mid, split, hi)``: [lo, mid) checked (the band's left edge), [mid, split) unchecked
    (whole tiles every row sees), [split, hi) checked (the right edge and a ragged last tile)."""
    if band.upper is not None:
        hi = min(seq_k, start_m + block_m + band.upper)
        split = min(seq_k, start_m + band.upper + 1)
    else:
        hi = split = seq_k
    split = max(_floor(split, block_n), 0)
    lo = mid = 0
    if band.lower is not None:
        lo = _floor(max(start_m + band.lower, 0), block_n)
        no_key = max(start_m + band.lower, 0) >= hi or (band.upper is not None and band.upper < band.lower)
        hi = lo if no_key else hi
        mid = _ceil(max(start_m + block_m - 1 + band.lower, 0), block_n)
        mid = min(max(mid, lo), hi)
        split = max(split, mid)
    return lo, mid, split, hi


dq_key_ranges = forward_key_ranges


def dkdv_query_ranges(band: Band, start_n: int, block_m: int, block_n: int, seq_q: int, seq_k: int):
    """Query-row ranges of the key tile at ``start_n`` (the dK/dV pass): ``(lo, mid, mid_hi, hi)``:
    [lo, mid) checked (the causal edge), [mid, mid_hi) unchecked, [mid_hi, hi) checked (the
    window's left edge). A ragged last key tile is checked throughout."""
    if band.upper is not None:
        lo = _floor(max(start_n - band.upper, 0), block_m)
        mid = _ceil(max(start_n + block_n - 1 - band.upper, 0), block_m)
    else:
        lo = mid = 0
    hi = mid_hi = seq_q
    if band.lower is not None:
        hi = min(seq_q, max(start_n + block_n - band.lower, 0))
        if band.upper is not None and (max(start_n - band.upper, 0) >= hi or band.upper < band.lower):
            hi = 0
        mid_hi = _floor(max(start_n - band.lower + 1, 0), block_m)
    if start_n + block_n > seq_k:
        mid = hi
    mid = min(max(mid, lo), hi)
    mid_hi = min(max(mid_hi, mid), hi)
    return lo, mid, mid_hi, hi


def _tiles(a: int, b: int, block: int) -> int:
    return max(0, (b - a + block - 1) // block)


def visited_tiles(band: Band, seq_q: int, seq_k: int, block_m: int, block_n: int) -> dict:
    """Tiles each pass visits for one (batch, head), and the dense count: ``{"forward", "dq",
    "dkdv", "dense", "checked_forward"}``. The forward and dQ pass visit the same tiles."""
    forward = checked = 0
    for start_m in range(0, seq_q, block_m):
        lo, mid, split, hi = forward_key_ranges(band, start_m, block_m, block_n, seq_k)
        n_left, n_mid, n_right = _tiles(lo, mid, block_n), _tiles(mid, split, block_n), _tiles(split, hi, block_n)
        forward += n_left + n_mid + n_right
        checked += n_left + n_right
    dkdv = 0
    for start_n in range(0, seq_k, block_n):
        lo, mid, mid_hi, hi = dkdv_query_ranges(band, start_n, block_m, block_n, seq_q, seq_k)
        dkdv += _tiles(lo, mid, block_m) + _tiles(mid, mid_hi, block_m) + _tiles(mid_hi, hi, block_m)
    dense = _tiles(0, seq_q, block_m) * _tiles(0, seq_k, block_n)
    return dict(forward=forward, dq=forward, dkdv=dkdv, dense=dense, checked_forward=checked)
