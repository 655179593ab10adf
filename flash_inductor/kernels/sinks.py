"""The attention sinks' gradient (ops/sinks.py): one pass over dO' and O' that reduces each head's rows.

Glossary (row i of one (batch, query head h); natural log throughout):
  O'_i, LSE'_i   the forward's outputs with the sink in the denominator (out, lse).
  Δ_i            rowsum(dO'_i ∘ O'_i) − dLSE'_i in fp32: the backward's Δ.
  p_i            exp(sink_h − LSE'_i), the sink's share of row i's mass (1 on a row with no visible
                 key, where LSE' = sink; 0 where LSE' = -inf, a sink of -inf with no key).
  d sink_h       −Σ_i p_i · Δ_i over the batch and the rows.

Constexpr switches: HEAD_DIM (Ev), BLOCK_E (its padded width), BLOCK_M (rows per program), HAS_DLSE
(the LSE output has a gradient).
"""

import triton
import triton.language as tl


@triton.jit
def _sinks_grad_partials(DO, O, LSE, DLSE, SINKS, PARTIAL,
                         stride_dob, stride_doh, stride_dom, stride_doe,
                         stride_ob, stride_oh, stride_om, stride_oe,
                         H, L,
                         HEAD_DIM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr,
                         HAS_DLSE: tl.constexpr):
    """Grid (cdiv(L, BLOCK_M), B · H). LSE and DLSE are flat (B·H·L) fp32 rows, SINKS (H,) fp32;
    PARTIAL (cdiv(L, BLOCK_M), B·H) fp32 gets each program's Σ_i p_i·Δ_i, which the launcher sums
    in a fixed order (no atomics: the gradient is deterministic)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_E)
    in_rows = rows < L
    mask = in_rows[:, None] & (cols < HEAD_DIM)[None, :]
    do = tl.load(DO + b.to(tl.int64) * stride_dob + h * stride_doh + rows[:, None] * stride_dom
                 + cols[None, :] * stride_doe, mask=mask, other=0.0).to(tl.float32)
    o = tl.load(O + b.to(tl.int64) * stride_ob + h * stride_oh + rows[:, None] * stride_om
                + cols[None, :] * stride_oe, mask=mask, other=0.0).to(tl.float32)
    delta = tl.sum(do * o, axis=1)
    row_ids = bh.to(tl.int64) * L + rows
    if HAS_DLSE:
        delta -= tl.load(DLSE + row_ids, mask=in_rows, other=0.0)
    lse = tl.load(LSE + row_ids, mask=in_rows, other=float("-inf"))
    sink = tl.load(SINKS + h)
    # LSE' >= sink wherever the sink is finite; -inf only with a sink of -inf and no key (share 0).
    share = tl.where(lse == float("-inf"), 0.0, tl.exp(sink - lse))
    tl.store(PARTIAL + pid_m * tl.num_programs(1) + bh, tl.sum(tl.where(in_rows, share * delta, 0.0), axis=0))
