"""Sums of fp32 partial results written by parts of a split kernel, in a fixed order.

Glossary:
  part    one of PARTS programs' worth of a quantity (for the Gluon backward, ``hopper_bwd.py``,
          the dK and dV of one share of a GQA group's query heads), an fp32 plane of N values.
  plane   which quantity: PART holds (2, PARTS, N), plane 0 summed into OUT0, plane 1 into OUT1.

The parts are added in part order, so the result does not depend on which program finished
first (unlike atomics): dK and dV stay deterministic.

Constexpr switches: BLOCK, values per program.
"""

import triton
import triton.language as tl


@triton.jit
def _sum_parts(PART, OUT0, OUT1, PARTS, N, BLOCK: tl.constexpr):
    """OUT{plane}[i] = Σ_p PART[plane, p, i] in fp32, cast to OUT's dtype. Grid (cdiv(N, BLOCK), 2);
    PART (2, PARTS, N) fp32 contiguous, OUT0 and OUT1 N values each, contiguous."""
    plane = tl.program_id(1)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < N
    base = PART + plane.to(tl.int64) * PARTS * N
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for p in range(PARTS):
        total += tl.load(base + p * N + offs, mask=in_range, other=0.0)
    if plane == 0:
        tl.store(OUT0 + offs, total.to(OUT0.dtype.element_ty), mask=in_range)
    else:
        tl.store(OUT1 + offs, total.to(OUT1.dtype.element_ty), mask=in_range)
