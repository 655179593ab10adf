"""The `fp8` schedule's forward: QKᵀ and P·V on e4m3 operands, everything else as in ``attn_fwd``.

Two kernels: ``_quantize_fp8`` writes e4m3 copies of Q, K and V with power-of-two scales, and
``_attn_fwd_fp8`` runs the online softmax on them. The scales are chosen so they factor out of
both products and can be undone exactly in fp32:

* Q and K: one scale per token (row), from the row's max |x|. S_ij = (q8_i·k8_j)·dq_i·dk_j, so
  the per-row and per-column factors multiply the fp32 scores, with the softmax scale.
* V: one scale per channel (column of the head dim) over the whole sequence. O_ie =
  Σ_j P_ij V_je = dv_e Σ_j P_ij V8_je, so the factor multiplies the finished fp32 output.
* P: in [0, 1] after the running max; P·2⁸ is cast instead of P, so that probabilities down to
  2⁻¹⁴ stay in e4m3's normal range (P itself would lose every bit below 2⁻⁹). The 2⁻⁸ is undone
  with dv_e.

A scale is 2ᵏ with 2ᵏ·max|x| <= 448 (e4m3's largest finite value), so no element saturates and
dividing it back out is exact. The softmax statistics, the mask, the scale and O stay fp32.

V is stored transposed (sequence contiguous): the fp8 tensor-core product on sm_90 reads both
operands K-major, i.e. contiguous along the reduction axis, which for P·V is the key axis.

Symbols (beyond ``attn_fwd``'s, whose s2, m_i, l_i, alpha and LSE mean the same here; acc holds
Σ_j e4m3(P_ij·2⁸)·v8_je, which the end multiplies by dv_e / 2⁸ along with 1 / l_i)

    symbol             code                      meaning
    -----------------  ------------------------  ---------------------------------------------
    q8, k8, v8         q8, k8, v8 (Q8, K8, V8)   the e4m3 copies (v8 read through V's transposed storage)
    dq_i, dk_j         Q_DEQUANT, K_DEQUANT,     per-token dequantisation factors 2⁻ᵏ of Q and K
                       k_dequant
    dv_e               V_DEQUANT, v_dequant      per-channel dequantisation factor of V
    scale·log2(e)·dq_i row_factor                what multiplies row i of q8·k8ᵀ (then times dk_j)
    2⁸                 P_SHIFT                   P's scale before its e4m3 cast, undone with dv_e
    448                E4M3_MAX                  e4m3's largest finite value

Constexpr switches: HEAD_DIM(_V), BLOCK_E(_V), BLOCK_M, BLOCK_N, HAS_MASK, MASK_IS_BOOL,
IS_CAUSAL, HAS_DROPOUT and CHECK_BOUNDS as in ``attn_fwd``; and

    EMULATE_ROUNDING   round to e4m3's grid in fp32 before the cast (the interpreter only, whose
                       own cast drops the carry: ``_round_to_e4m3``)
    PER_ROW            ``_quantize_fp8``: one scale per row (Q, K), else per column (V)
    BLOCK_R            ``_quantize_fp8``: rows per program

The kernels' signatures are flat, as in ``attn_fwd``; the helper takes ``query_block`` (q8, row_factor, offs_m, rng_rows), ``dropout``
(seed, dropout_p) and ``*_strides`` (batch, head, row, column) tuples.
"""

import triton
import triton.language as tl

from .band import query_tile_key_ranges
from .common import (LN2, block_offsets, dropout_keep, dropout_seed, mask_scores, online_softmax_start, query_heads,
                     row_normaliser)

E4M3_MAX = tl.constexpr(448.0)
# P·2⁸ lies in [0, 256]: below e4m3's 448, and probabilities down to 2⁻¹⁴ become normal numbers.
P_SHIFT = tl.constexpr(256.0)


@triton.jit
def _round_to_e4m3(x, EMULATE: tl.constexpr):
    """x cast to e4m3. ``EMULATE`` (the Triton interpreter only) rounds to e4m3's grid in fp32
    first: the interpreter's own fp32→fp8 cast drops the carry when rounding up crosses a power
    of two (1.96 became 1.0), while values already on the grid cast exactly. On the GPU the cast
    is the hardware's round-to-nearest-even."""
    if EMULATE:
        magnitude = tl.abs(x)
        # The spacing of e4m3 numbers: 2^(e - 3) for normal numbers, 2^-9 for subnormal ones.
        exponent = tl.maximum(tl.floor(tl.math.log2(tl.maximum(magnitude, 1e-30))), -6.0)
        quantum = tl.math.exp2(exponent - 3.0)
        # (y + 1.5·2²³) − 1.5·2²³ rounds y (|y| < 2²²) to the nearest integer, ties to even.
        steps = (x / quantum + 12582912.0) - 12582912.0
        x = tl.minimum(tl.maximum(steps * quantum, -448.0), 448.0)  # ±E4M3_MAX
    return x.to(tl.float8e4nv)


@triton.jit
def _power_of_two_scale(amax):
    """2ᵏ with 2ᵏ·amax <= 448, k in [-126, 126] (so 2ᵏ and 2⁻ᵏ are finite); 1 for amax = 0.
    A non-finite amax gives a non-finite or zero scale, so the output is NaN like SDPA's."""
    all_zero = amax == 0.0
    k = tl.floor(tl.math.log2(448.0 / tl.where(all_zero, 1.0, amax)))  # 448: E4M3_MAX
    k = tl.where(all_zero, 0.0, tl.minimum(tl.maximum(k, -126.0), 126.0))
    return tl.math.exp2(k)


@triton.jit
def _quantize_fp8(
    X, X8, DEQUANT, COLUMN_AMAX,
    stride_xb, stride_xh, stride_xn, stride_xe,
    stride_yb, stride_yh, stride_yn, stride_ye,
    H, N,
    HEAD_DIM: tl.constexpr, BLOCK_E: tl.constexpr, PER_ROW: tl.constexpr,
    EMULATE_ROUNDING: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """e4m3 copy of one (B, H, N, E) tensor, written through X8's strides (V's are transposed).

    PER_ROW: scale each row by its own max and store the row's dequantisation factor in
    DEQUANT (B*H, N). Otherwise scale each column by COLUMN_AMAX (B*H, E, fp32, the column's max
    over the whole sequence) and store the column's factor in DEQUANT (B*H, E): one program of
    each (b, h) writes it, the others compute the same values."""
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_e = tl.arange(0, BLOCK_E)
    ok = (offs_r[:, None] < N) & (offs_e[None, :] < HEAD_DIM)
    x = tl.load(X + b * stride_xb + h * stride_xh + offs_r[:, None] * stride_xn + offs_e[None, :] * stride_xe,
                mask=ok, other=0.0).to(tl.float32)
    if PER_ROW:
        scale = _power_of_two_scale(tl.max(tl.abs(x), 1))
        x8 = _round_to_e4m3(x * scale[:, None], EMULATE=EMULATE_ROUNDING)
        tl.store(DEQUANT + bh.to(tl.int64) * N + offs_r, 1.0 / scale, mask=offs_r < N)
    else:
        amax = tl.load(COLUMN_AMAX + bh.to(tl.int64) * HEAD_DIM + offs_e, mask=offs_e < HEAD_DIM, other=0.0)
        scale = _power_of_two_scale(amax)
        x8 = _round_to_e4m3(x * scale[None, :], EMULATE=EMULATE_ROUNDING)
        if tl.program_id(0) == 0:
            tl.store(DEQUANT + bh.to(tl.int64) * HEAD_DIM + offs_e, 1.0 / scale, mask=offs_e < HEAD_DIM)
    tl.store(X8 + b * stride_yb + h * stride_yh + offs_r[:, None] * stride_yn + offs_e[None, :] * stride_ye,
             x8, mask=ok)


@triton.jit
def _attn_fwd_fp8_inner(
    acc, l_i, m_i, query_block, k_base, k_dequant_base, v_base, mask_base, dropout,
    offs_n_base, offs_e, offs_ev, lo, hi, k_strides, v_strides, mask_strides,
    L, S, causal_offset,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    IS_CAUSAL: tl.constexpr, CHECK_BOUNDS: tl.constexpr, EMULATE_ROUNDING: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Fold key blocks [lo, hi) into the running (acc, l, m); ``attn_fwd._attn_fwd_inner`` with
    e4m3 products. ``row_factor`` is the softmax scale (base 2) times each query row's factor."""
    q8, row_factor, offs_m, rng_rows = query_block
    seed, dropout_p = dropout
    _, _, stride_kn, stride_ke = k_strides
    _, _, stride_vn, stride_ve = v_strides
    _, _, stride_mm, stride_mn = mask_strides
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n_base
        kv_rows_ok = offs_n < S
        k8 = tl.load(k_base + offs_n[None, :] * stride_kn + offs_e[:, None] * stride_ke,
                     mask=kv_rows_ok[None, :] & (offs_e[:, None] < HEAD_DIM), other=0.0)
        k_dequant = tl.load(k_dequant_base + offs_n, mask=kv_rows_ok, other=0.0)
        s2 = tl.dot(q8, k8) * row_factor[:, None] * k_dequant[None, :]
        in_bounds = (offs_m[:, None] < L) & kv_rows_ok[None, :]
        s2 = mask_scores(s2, mask_base, offs_m[:, None], offs_n[None, :], in_bounds, stride_mm, stride_mn,
                         causal_offset, 0, HAS_MASK=HAS_MASK, MASK_IS_BOOL=MASK_IS_BOOL, IS_CAUSAL=IS_CAUSAL,
                         CHECK=CHECK_BOUNDS)
        m_new = tl.maximum(m_i, tl.max(s2, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_ref)
        p = tl.math.exp2(s2 - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if HAS_DROPOUT:
            keep = dropout_keep(seed, rng_rows[:, None], offs_n[None, :], S, dropout_p)
            p = tl.where(keep, p, 0.0)
        v8 = tl.load(v_base + offs_n[:, None] * stride_vn + offs_ev[None, :] * stride_ve,
                     mask=kv_rows_ok[:, None] & (offs_ev[None, :] < HEAD_DIM_V), other=0.0)
        acc = acc * alpha[:, None] + tl.dot(_round_to_e4m3(p * P_SHIFT, EMULATE=EMULATE_ROUNDING), v8)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_fp8(
    Q8, K8, V8, Q_DEQUANT, K_DEQUANT, V_DEQUANT, MASK, SEED, OUT, LSE,
    stride_qb, stride_qh, stride_qm, stride_qe,
    stride_kb, stride_kh, stride_kn, stride_ke,
    stride_vb, stride_vh, stride_vn, stride_ve,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_ob, stride_oh, stride_om, stride_oe,
    H_Q, GROUP, L, S, causal_offset, qk_scale_log2, dropout_p,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    IS_CAUSAL: tl.constexpr, EMULATE_ROUNDING: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Python floats may arrive as fp64 scalars under Inductor (see attn_fwd): fix them at fp32.
    qk_scale_log2 = tl.cast(qk_scale_log2, tl.float32)
    dropout_p = tl.cast(dropout_p, tl.float32)
    start_m = tl.program_id(0) * BLOCK_M
    bh, b, h, h_kv = query_heads(H_Q, GROUP)
    bh_kv = b * (H_Q // GROUP) + h_kv
    offs_m, offs_n_base, offs_e, offs_ev = block_offsets(start_m, BLOCK_OWN=BLOCK_M, BLOCK_LOOP=BLOCK_N,
                                                         BLOCK_E=BLOCK_E, BLOCK_EV=BLOCK_EV)
    row_ok = offs_m < L

    q8 = tl.load(Q8 + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_e[None, :] * stride_qe,
                 mask=row_ok[:, None] & (offs_e[None, :] < HEAD_DIM), other=0.0)
    row_factor = qk_scale_log2 * tl.load(Q_DEQUANT + bh.to(tl.int64) * L + offs_m, mask=row_ok, other=0.0)
    k_base = K8 + b * stride_kb + h_kv * stride_kh
    v_base = V8 + b * stride_vb + h_kv * stride_vh
    k_dequant_base = K_DEQUANT + bh_kv * S
    mask_base = MASK + b * stride_mb + h * stride_mh
    seed = dropout_seed(SEED, HAS_DROPOUT=HAS_DROPOUT)
    rng_rows = bh.to(tl.int64) * L + offs_m
    m_i, l_i, acc = online_softmax_start(BLOCK_M, BLOCK_EV)

    # The same split as the 16-bit forward (no window here: lo = mid = 0): whole, fully visible key
    # blocks [0, split) skip the select, [split, hi) take it.
    _, _, split, hi = query_tile_key_ranges(start_m, S, causal_offset, 0, IS_CAUSAL=IS_CAUSAL, WINDOW_LEFT=False,
                                            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    query_block = (q8, row_factor, offs_m, rng_rows)
    dropout = (seed, dropout_p)
    k_strides = (stride_kb, stride_kh, stride_kn, stride_ke)
    v_strides = (stride_vb, stride_vh, stride_vn, stride_ve)
    mask_strides = (stride_mb, stride_mh, stride_mm, stride_mn)
    # The two calls differ only in their range and CHECK_BOUNDS.
    acc, l_i, m_i = _attn_fwd_fp8_inner(
        acc, l_i, m_i, query_block, k_base, k_dequant_base, v_base, mask_base, dropout,
        offs_n_base, offs_e, offs_ev, 0, split, k_strides, v_strides, mask_strides, L, S, causal_offset,
        CHECK_BOUNDS=False,
        HEAD_DIM=HEAD_DIM, HEAD_DIM_V=HEAD_DIM_V, HAS_MASK=HAS_MASK, MASK_IS_BOOL=MASK_IS_BOOL,
        HAS_DROPOUT=HAS_DROPOUT, IS_CAUSAL=IS_CAUSAL, EMULATE_ROUNDING=EMULATE_ROUNDING, BLOCK_N=BLOCK_N,
    )
    acc, l_i, m_i = _attn_fwd_fp8_inner(
        acc, l_i, m_i, query_block, k_base, k_dequant_base, v_base, mask_base, dropout,
        offs_n_base, offs_e, offs_ev, split, hi, k_strides, v_strides, mask_strides, L, S, causal_offset,
        CHECK_BOUNDS=True,
        HEAD_DIM=HEAD_DIM, HEAD_DIM_V=HEAD_DIM_V, HAS_MASK=HAS_MASK, MASK_IS_BOOL=MASK_IS_BOOL,
        HAS_DROPOUT=HAS_DROPOUT, IS_CAUSAL=IS_CAUSAL, EMULATE_ROUNDING=EMULATE_ROUNDING, BLOCK_N=BLOCK_N,
    )

    empty_row, l_safe, inv_l = row_normaliser(l_i, dropout_p, HAS_DROPOUT=HAS_DROPOUT)
    v_dequant = tl.load(V_DEQUANT + bh_kv * HEAD_DIM_V + offs_ev, mask=offs_ev < HEAD_DIM_V, other=0.0)
    out = acc * inv_l[:, None] * (v_dequant / P_SHIFT)[None, :]
    lse = tl.where(empty_row, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN2)
    tl.store(
        OUT + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_ev[None, :] * stride_oe,
        out.to(OUT.dtype.element_ty),
        mask=row_ok[:, None] & (offs_ev[None, :] < HEAD_DIM_V),
    )
    tl.store(LSE + bh.to(tl.int64) * L + offs_m, lse, mask=row_ok)
