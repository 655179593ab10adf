"""Bounded tile loads that drop the masks a launch proves cannot bind (the backward's EVEN_* flags).

The loops of the backward passes load Q/dO (dK/dV pass) or K/V (dQ pass) tiles and per-row
vectors through these helpers; the launcher tells them which bounds cannot bind.

Symbols: ptrs (a tile's or a row vector's pointers), rows_ok / cols_ok (which rows and columns
lie inside the tensor), other (the fill value past the rows), offs (the rows a loop step visits),
offs_e / offs_ev (head-dim and value-dim columns), *_strides ((batch, head, row, column) strides).

Constexpr switches: EVEN_ROWS (the looped-over length is a whole number of blocks: the
launcher's EVEN_M / EVEN_N) and EVEN_COLS (the head dim equals its padded width: EVEN_E) drop
the row and column masks; HEAD_DIM / HEAD_DIM_V (E and Ev, the first and second tile's widths).
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


@triton.jit
def load_tile_pair(a_base, b_base, offs, rows_ok, offs_e, offs_ev, a_strides, b_strides,
                   HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                   EVEN_ROWS: tl.constexpr, EVEN_COLS: tl.constexpr):
    """The rows ``offs`` of the two tensors a backward loop walks together, (Q, dO) in the dK/dV
    pass and (K, V) in the dQ pass: E columns of the first, Ev of the second (see ``load_tile``)."""
    _, _, stride_an, stride_ae = a_strides
    _, _, stride_bn, stride_be = b_strides
    a = load_tile(a_base + offs[:, None] * stride_an + offs_e[None, :] * stride_ae,
                  rows_ok, offs_e < HEAD_DIM, EVEN_ROWS=EVEN_ROWS, EVEN_COLS=EVEN_COLS)
    b = load_tile(b_base + offs[:, None] * stride_bn + offs_ev[None, :] * stride_be,
                  rows_ok, offs_ev < HEAD_DIM_V, EVEN_ROWS=EVEN_ROWS, EVEN_COLS=EVEN_COLS)
    return a, b
