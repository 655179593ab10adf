"""Forward flash-attention kernel with a stabilised online softmax.

Numerics (see ``schedules.py`` for the switchable parts):
  * S = Q K^T accumulates in fp32; the softmax scale multiplies S in fp32, folded with
    log2(e) so one multiply feeds ``exp2``.
  * The running max, running sum and LSE are fp32. A row that has seen only masked keys
    keeps m = -inf and is exponentiated against 0, so it never forms -inf - (-inf).
  * A row with no visible key at all ends with l = 0: its output is 0 and its LSE is -inf.
  * O accumulates in fp32; P is rounded to the input dtype for P·V unless P_IN_FP32.
"""

import triton
import triton.language as tl

from .common import LN2, add_attn_mask, dropout_keep


@triton.jit
def _attn_fwd_inner(
    acc, l_i, m_i, q,
    k_base, v_base, mask_base, seed, rng_rows,
    offs_m, offs_n_base, offs_e, offs_ev,
    lo, hi,
    stride_kn, stride_ke, stride_vn, stride_ve, stride_mm, stride_mn,
    L, S, causal_offset, qk_scale_log2, dropout_p,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    IS_CAUSAL: tl.constexpr, CHECK_BOUNDS: tl.constexpr,
    P_IN_FP32: tl.constexpr, FP32_DOT: tl.constexpr, FOLD_SCALE: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Fold key blocks [lo, hi) into the running (acc, l, m).

    CHECK_BOUNDS=False is the fast path for blocks known to be fully inside S and fully
    visible under causal masking; the diagonal and ragged-end blocks take CHECK_BOUNDS=True.
    """
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n_base
        kv_rows_ok = offs_n < S
        k = tl.load(
            k_base + offs_n[None, :] * stride_kn + offs_e[:, None] * stride_ke,
            mask=kv_rows_ok[None, :] & (offs_e[:, None] < HEAD_DIM), other=0.0,
        )
        # Under FOLD_SCALE the scores stay unscaled until exp2 (see _attn_fwd); else base 2.
        s2 = tl.dot(q, k, input_precision=FP32_DOT)
        if not FOLD_SCALE:
            s2 = s2 * qk_scale_log2
        if HAS_MASK:
            in_bounds = (offs_m[:, None] < L) & kv_rows_ok[None, :]
            s2 = add_attn_mask(
                s2, mask_base + offs_m[:, None] * stride_mm + offs_n[None, :] * stride_mn,
                in_bounds, MASK_IS_BOOL,
            )
        if CHECK_BOUNDS:
            visible = kv_rows_ok[None, :]
            if IS_CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None] + causal_offset)
            s2 = tl.where(visible, s2, float("-inf"))
        if FOLD_SCALE:
            m_new = tl.maximum(m_i, tl.max(s2, 1) * qk_scale_log2)
        else:
            m_new = tl.maximum(m_i, tl.max(s2, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_ref)
        if FOLD_SCALE:
            p = tl.math.exp2(s2 * qk_scale_log2 - m_ref[:, None])  # one FFMA per score
        else:
            p = tl.math.exp2(s2 - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if HAS_DROPOUT:
            # l_i sums the undropped P: dropout acts on normalised probabilities.
            keep = dropout_keep(seed, rng_rows[:, None], offs_n[None, :], S, dropout_p)
            p = tl.where(keep, p, 0.0)
        v = tl.load(
            v_base + offs_n[:, None] * stride_vn + offs_ev[None, :] * stride_ve,
            mask=kv_rows_ok[:, None] & (offs_ev[None, :] < HEAD_DIM_V), other=0.0,
        )
        if P_IN_FP32:
            pv = tl.dot(p, v.to(tl.float32), input_precision=FP32_DOT)
        else:
            pv = tl.dot(p.to(v.dtype), v, input_precision=FP32_DOT)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(
    Q, K, V, MASK, SEED, OUT, LSE,
    stride_qb, stride_qh, stride_qm, stride_qe,
    stride_kb, stride_kh, stride_kn, stride_ke,
    stride_vb, stride_vh, stride_vn, stride_ve,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_ob, stride_oh, stride_om, stride_oe,
    H_Q, GROUP, L, S, causal_offset, qk_scale_log2, dropout_p,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    IS_CAUSAL: tl.constexpr, P_IN_FP32: tl.constexpr, FP32_DOT: tl.constexpr,
    FOLD_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # FOLD_SCALE (a positive scale, no additive mask): each row's max is taken on the unscaled
    # products and scaled once, which is exact, since x -> fl(c * x) is monotonic for c > 0 and
    # so fl(c * max x) = max fl(c * x); exp2's argument is then one FFMA per score, where the max
    # otherwise needs every scaled score (a multiply) and exp2 a subtraction. A bool mask and the
    # bounds select only place -inf, which scales to -inf. An additive mask is in base-2 units
    # and needs the scaled scores.
    # Inductor passes Python floats to user kernels as fp64 scalars (torch 2.11); arithmetic
    # with them would promote the fp32 accumulators, so fix them at fp32 first.
    qk_scale_log2 = tl.cast(qk_scale_log2, tl.float32)
    dropout_p = tl.cast(dropout_p, tl.float32)
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = (bh // H_Q).to(tl.int64)
    h = (bh % H_Q).to(tl.int64)
    h_kv = h // GROUP  # grouped-query attention: K/V are indexed, never repeated

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n_base = tl.arange(0, BLOCK_N)
    offs_e = tl.arange(0, BLOCK_E)
    offs_ev = tl.arange(0, BLOCK_EV)

    q = tl.load(
        Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_e[None, :] * stride_qe,
        mask=(offs_m[:, None] < L) & (offs_e[None, :] < HEAD_DIM), other=0.0,
    )
    k_base = K + b * stride_kb + h_kv * stride_kh
    v_base = V + b * stride_vb + h_kv * stride_vh
    mask_base = MASK + b * stride_mb + h * stride_mh
    seed = 0
    if HAS_DROPOUT:
        seed = tl.load(SEED)
    rng_rows = bh.to(tl.int64) * L + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_EV], dtype=tl.float32)

    # Key blocks [0, split) are whole and visible to every row of this query block, so they
    # skip the bounds/causal select; [split, hi) holds the diagonal and the ragged tail.
    if IS_CAUSAL:
        hi = tl.minimum(S, start_m + BLOCK_M + causal_offset)
        split = tl.minimum(S, start_m + causal_offset + 1)
    else:
        hi = S
        split = S
    split = tl.maximum(split // BLOCK_N * BLOCK_N, 0)

    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, mask_base, seed, rng_rows,
        offs_m, offs_n_base, offs_e, offs_ev, 0, split,
        stride_kn, stride_ke, stride_vn, stride_ve, stride_mm, stride_mn,
        L, S, causal_offset, qk_scale_log2, dropout_p,
        HEAD_DIM, HEAD_DIM_V, HAS_MASK, MASK_IS_BOOL, HAS_DROPOUT, IS_CAUSAL, False,
        P_IN_FP32, FP32_DOT, FOLD_SCALE, BLOCK_N,
    )
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, mask_base, seed, rng_rows,
        offs_m, offs_n_base, offs_e, offs_ev, split, hi,
        stride_kn, stride_ke, stride_vn, stride_ve, stride_mm, stride_mn,
        L, S, causal_offset, qk_scale_log2, dropout_p,
        HEAD_DIM, HEAD_DIM_V, HAS_MASK, MASK_IS_BOOL, HAS_DROPOUT, IS_CAUSAL, True,
        P_IN_FP32, FP32_DOT, FOLD_SCALE, BLOCK_N,
    )

    # l == 0 exactly when no key was visible: output 0 and LSE -inf instead of 0/0.
    empty_row = l_i == 0.0
    l_safe = tl.where(empty_row, 1.0, l_i)
    inv_l = 1.0 / l_safe
    if HAS_DROPOUT:
        inv_l = inv_l / (1.0 - dropout_p)
    out = acc * inv_l[:, None]
    lse = tl.where(empty_row, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN2)

    row_ok = offs_m < L
    tl.store(
        OUT + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_ev[None, :] * stride_oe,
        out.to(OUT.dtype.element_ty),
        mask=row_ok[:, None] & (offs_ev[None, :] < HEAD_DIM_V),
    )
    tl.store(LSE + bh.to(tl.int64) * L + offs_m, lse, mask=row_ok)
