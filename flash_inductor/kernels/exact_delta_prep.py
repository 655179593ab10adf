"""The preprocess of the one-pass exact-Δ backward (``hopper_bwd.py`` under EXACT_DELTA).

Glossary (per query row i of one (batch, query head); docs/hopper_backward.md derives it):
  g_i     the forward's row normaliser (ROW_CONSTS' second plane): the backward's P is
          g_i · P̃, P̃ = round(exp2(s·qk_scale − c_i)) as the forward's P·V used it.
  dO'_i   round(g_i · dO_i) in the input dtype: the dO the backward kernel reads, so that
          dV = P̃ᵀ·dO' and dP' = dO'·Vᵀ need no per-score factor.
  O + r   the forward's output plus its 16-bit rounding residual: the average of V under P̃
          to about 16 bits more than O.
  Δ'_i    dO'_i·(O_i + r_i) − g_i·dLSE_i in fp32: then Σ_j P̃_ij (dP'_ij − Δ'_i) = −g_i dLSE_i Σ_j P̃_ij
          exactly as the true dS rows sum, whatever the rounding of g.

Constexpr switches: HEAD_DIM (E, a power of two), BLOCK_M (rows per program), HAS_DLSE (the
LSE output has a gradient).
"""

import triton
import triton.language as tl


@triton.jit
def _exact_delta_preprocess(DO, O, RESID, NORM, DLSE, DO_SCALED, DELTA,
                            stride_dob, stride_doh, stride_dom,
                            stride_ob, stride_oh, stride_om,
                            H, L,
                            HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, HAS_DLSE: tl.constexpr):
    """Grid (cdiv(L, BLOCK_M), B * H). DO and O (and RESID, as O) are (B, H, L, E) with a unit last
    stride; NORM, DLSE and DELTA are flat (B·H·L) fp32 rows; DO_SCALED is (B, H, L, E) contiguous."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, HEAD_DIM)
    in_rows = rows < L
    mask = in_rows[:, None]
    do = tl.load(DO + b.to(tl.int64) * stride_dob + h * stride_doh + rows[:, None] * stride_dom + cols[None, :],
                 mask=mask, other=0.0)
    o_off = b.to(tl.int64) * stride_ob + h * stride_oh + rows[:, None] * stride_om + cols[None, :]
    o = tl.load(O + o_off, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(RESID + o_off, mask=mask, other=0.0).to(tl.float32)
    row_ids = bh.to(tl.int64) * L + rows
    g = tl.load(NORM + row_ids, mask=in_rows, other=0.0)
    do_scaled = (do.to(tl.float32) * g[:, None]).to(do.dtype)
    tl.store(DO_SCALED + row_ids[:, None] * HEAD_DIM + cols[None, :], do_scaled, mask=mask)
    delta = tl.sum(do_scaled.to(tl.float32) * (o + r), axis=1)
    if HAS_DLSE:
        delta -= g * tl.load(DLSE + row_ids, mask=in_rows, other=0.0)
    tl.store(DELTA + row_ids, delta, mask=in_rows)
