"""The grid order both Gluon Hopper kernels share (``hopper_fwd.py``, ``hopper_bwd.py``).

Glossary:
  block          a CTA's tile along the sequence (the forward's query block, the backward's key
                 block): grid axis 0, ``blocks`` of them per row.
  row            one (batch, head) of the grid (the forward's B·H, the backward's B·H_KV): axis 1.
  swizzle_heads  runtime int: CTAs start in grid order, x fastest, and the linear index is read
                 as groups of this many rows, block by block within a group (the last group may
                 be smaller). 1 runs each row's blocks together; the row count runs every row's
                 first block before any row's second. Under causal masking the blocks' work
                 differs, so the order sets which CTAs start last (the tail), and the rows in
                 flight set what shares L2 (docs/hopper_backward.md, "Grid order").
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def ordered_cell(lin, blocks, rows, swizzle_heads):
    """(block, row) of linear index ``lin`` in the order ``swizzle_heads`` sets (glossary), over
    ``rows`` rows of ``blocks`` blocks: a CTA's own cell, or a persistent CTA's next work item."""
    group = lin // (swizzle_heads * blocks)
    first_row = group * swizzle_heads
    rows_here = gl.minimum(swizzle_heads, rows - first_row)
    within = lin - group * swizzle_heads * blocks
    return within // rows_here, first_row + within % rows_here


@gluon.jit
def swizzled_cta(swizzle_heads):
    """(block, row, blocks) of this CTA under the order ``swizzle_heads`` sets (glossary)."""
    blocks = gl.num_programs(0)
    lin = gl.program_id(1) * blocks + gl.program_id(0)
    block, row = ordered_cell(lin, blocks, gl.num_programs(1), swizzle_heads)
    return block, row, blocks
