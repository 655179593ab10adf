"""Tile loads that drop the bounds masks a launch proves cannot bind (the backward's EVEN_* flags).

Kept apart from common.py so that the forward family's hash (tuning/cache.py) does not change
when only these helpers do: the forward kernels do not use them.
"""

import triton
import triton.language as tl


@triton.jit
def load_tile(ptrs, rows_ok, cols_ok, EVEN_ROWS: tl.constexpr, EVEN_COLS: tl.constexpr):
    """A 2-D tile, zero-filled past the tensor's rows (``rows_ok``) and columns (``cols_ok``).
    An EVEN_* flag says that dimension cannot run past the end (the length is a multiple of the
    block, or the head dim equals its padded width), and drops that mask: at E = 64 the masked
    loads cost the dK/dV pass up to 7 % (benchmarks/experiments/dkdv_features_probe.py)."""
    if EVEN_ROWS:
        if EVEN_COLS:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=cols_ok[None, :], other=0.0)
    else:
        if EVEN_COLS:
            tile = tl.load(ptrs, mask=rows_ok[:, None], other=0.0)
        else:
            tile = tl.load(ptrs, mask=rows_ok[:, None] & cols_ok[None, :], other=0.0)
    return tile


@triton.jit
def load_rows(ptrs, rows_ok, other, EVEN_ROWS: tl.constexpr):
    """A per-row vector, ``other`` past the tensor's rows unless EVEN_ROWS (see ``load_tile``)."""
    if EVEN_ROWS:
        vec = tl.load(ptrs)
    else:
        vec = tl.load(ptrs, mask=rows_ok, other=other)
    return vec
