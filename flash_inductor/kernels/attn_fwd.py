"""Forward flash-attention kernel with a stabilised online softmax.

Numerics (see ``schedules.py`` for the switchable parts):
  * S = Q K^T accumulates in fp32; the softmax scale multiplies S in fp32, folded with
    log2(e) so one multiply feeds ``exp2``.
  * The running max, running sum and LSE are fp32. A row that has seen only masked keys
    keeps m = -inf and is exponentiated against 0, so it never forms -inf - (-inf).
  * A row with no visible key at all ends with l = 0: its output is 0 and its LSE is -inf.
  * O accumulates in fp32; P is rounded to the input dtype for P·V unless P_IN_FP32.

Symbols (i a query row, j a key; vectors are per row of the program's query block)

    symbol            code            meaning
    ----------------  --------------  ----------------------------------------------------------
    s_ij              --              scale · q_i·k_j (+ the additive mask), natural units
    s2                s2              log2(e) · s_ij, the scores in base 2; under FOLD_SCALE the
                                      unscaled q_i·k_j (+ a bool mask's -inf) until exp2
    scale · log2(e)   qk_scale_log2   the softmax scale in base 2 (the launcher folds log2(e) in)
    c · log2(e)       softcap_log2    the soft cap in base 2 (SOFTCAP); score_scale is the pair
    m_i               m_i             running row max of s2 (base 2); m_ref is m_i with -inf read as 0
    l_i               l_i             running row sum of exp2(s2 - m_i), before dropout
    α                 alpha           exp2(m_old - m_new), the rescale of l_i and acc per block
    P_ij              p               exp2(s2 - m_ref), unnormalised; zeroed where dropout drops
    O_i               acc, then out   Σ_j P_ij v_j in fp32; out = acc / l_i (/ (1 - dropout_p))
    lse_i (base 2)    m_i + log2 l_i  the LSE in base 2; stored in natural log, times ln 2 (LSE)
    keep_ij           keep            the dropout keep mask (``common.dropout_keep``)

Indices and sizes: b (batch), h (query head), h_kv = h // GROUP (its K/V head: GROUP query
heads share one, so K/V are indexed, never repeated), bh = b · H_Q + h, L / S (query / key
lengths), causal_offset (key j is visible from row i when j <= i + causal_offset), window_lower
(under WINDOW_LEFT, key j is visible from row i only when j >= i + window_lower), rng_rows =
bh · L + row (the dropout counter's row), offs_m / offs_n / offs_e / offs_ev (a block's rows,
keys, head-dim and value-dim columns), [lo, mid) / [mid, split) / [split, hi) (the key blocks
with, without and with the visibility select; lo = mid = 0 without WINDOW_LEFT). The band of
``launch/band.py`` mirrors these ranges in Python. Pointers are UPPER_CASE, strides ``stride_<tensor><dim>``.

Constexpr switches

    HEAD_DIM, HEAD_DIM_V    E and Ev, the head dims of Q/K and of V
    BLOCK_E, BLOCK_EV       their padded tile widths (powers of two, equal: ``launch/common.py``)
    BLOCK_M, BLOCK_N        query rows per program and keys per step (the launch config)
    HAS_MASK, MASK_IS_BOOL  a mask is given; bool (True = attend) or additive float
    IS_CAUSAL               keys past i + causal_offset are invisible (causal masking, or a window's
                            right bound: the launcher passes the band's upper side)
    WINDOW_LEFT             keys before i + window_lower are invisible (a window's left bound)
    HAS_DROPOUT             dropout on P, from SEED (``common.dropout_keep``)
    FP32_DOT                input_precision of the dots ("ieee", "tf32" or "tf32x3" for fp32 operands)
    P_IN_FP32               P meets V in fp32 rather than rounded to the input dtype
    FOLD_SCALE              fold the scale into exp2's argument (a positive scale and no mask:
                            ``launch/forward.py``; why it is exact: ``_attn_fwd``)
    CHECK_BOUNDS            (``_attn_fwd_inner`` only) apply the bounds / band select to the block
    HAS_BLOCK_SPARSITY      a block-sparse layout: the key ranges are positions in the query tile's
                            list of key tiles (COUNTS, IDX: ``block_sparse.py``), FULL then PARTIAL;
                            FROM_LIST in ``_attn_fwd_inner``. Without it the layout arguments are None
    LAYOUT_CHECK            checked tiles also test the layout per element (tiles that straddle
                            layout blocks of LAYOUT_BQ x LAYOUT_BK: ``launch/block_tiles.py``)
    HAS_SINKS               attention sinks (ops/sinks.py): SINKS[h], head h's logit (natural log,
                            fp32), joins each row's denominator in the epilogue
                            (``common.sink_normaliser``): out and LSE come out with it, a row with no
                            visible key stores out 0 and LSE = the sink. Else SINKS is None
    SOFTCAP                 s_ij = c·tanh(scale·q_i·k_j / c) before the mask (``common.base2_scores``;
                            never with FOLD_SCALE, whose max is taken on the unscaled products)
    VARLEN                  packed sequences: axis 1 runs over (sequence b, query head); b's rows
                            and keys are ``[CU_Q[b], CU_Q[b + 1])`` and ``[CU_K[b], CU_K[b + 1])`` of
                            tensors launched with zero batch strides, L and S on entry are the packed
                            lengths (the LSE's (Hq, total_q) row stride), and each program works as if
                            its sequence were the whole problem: no key of another is visited, and
                            dropout draws from seed + b as a one-sequence call would
                            (``common.packed_sequence``; ``ops/varlen.py`` defines the semantics)

The kernel's signature is flat, one scalar per stride, as the launchers pass them.
Its helper takes tuples, which Triton inlines away: ``*_strides`` (batch, head, row, column) of
one tensor, ``query_block`` (q, offs_m, rng_rows), ``dropout`` (seed, dropout_p), ``listed``
(tile list, block map at this batch and head, its row and column strides; a placeholder when
dense: ``block_sparse.query_tile_key_tiles``).
"""

import triton
import triton.language as tl

from .block_sparse import layout_visible, query_tile_key_tiles
from .common import (LN2, accumulate_pv, add_attn_mask, base2_scores, block_offsets, dropout_keep, dropout_seed,
                     loop_tile, online_softmax_start, packed_sequence, query_heads, row_normaliser,
                     sink_normaliser)


@triton.jit
def _attn_fwd_inner(
    acc, l_i, m_i, query_block, k_base, v_base, mask_base, dropout,
    offs_n_base, offs_e, offs_ev, lo, hi, k_strides, v_strides, mask_strides, listed,
    L, S, causal_offset, window_lower, score_scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    IS_CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr, CHECK_BOUNDS: tl.constexpr,
    P_IN_FP32: tl.constexpr, FP32_DOT: tl.constexpr, FOLD_SCALE: tl.constexpr, BLOCK_N: tl.constexpr,
    FROM_LIST: tl.constexpr = False, LAYOUT_CHECK: tl.constexpr = False,
    LAYOUT_BQ: tl.constexpr = 1, LAYOUT_BK: tl.constexpr = 1, SOFTCAP: tl.constexpr = False,
):
    """Fold key blocks [lo, hi) into the running (acc, l, m); under FROM_LIST the key tiles at
    positions [lo, hi) of ``listed[0]``, a block-sparse layout's list (``block_sparse.tile_lists``).

    CHECK_BOUNDS=False is the fast path for blocks known to be fully inside S and fully
    visible to every row of the block under the band; the blocks the band's edges cross and
    the ragged-end block take CHECK_BOUNDS=True.
    """
    q, offs_m, rng_rows = query_block
    seed, dropout_p = dropout
    qk_scale_log2 = score_scale[0]
    _, _, stride_kn, stride_ke = k_strides
    _, _, stride_vn, stride_ve = v_strides
    _, _, stride_mm, stride_mn = mask_strides
    for it in range(lo, hi, 1 if FROM_LIST else BLOCK_N):
        offs_n, kv_rows_ok = loop_tile(it, listed, offs_n_base, S, BLOCK=BLOCK_N, FROM_LIST=FROM_LIST)
        k = tl.load(
            k_base + offs_n[None, :] * stride_kn + offs_e[:, None] * stride_ke,
            mask=kv_rows_ok[None, :] & (offs_e[:, None] < HEAD_DIM), other=0.0,
        )
        # Under FOLD_SCALE the scores stay unscaled until exp2 (see _attn_fwd); else base 2.
        s2 = tl.dot(q, k, input_precision=FP32_DOT)
        if not FOLD_SCALE:
            s2 = base2_scores(s2, score_scale, SOFTCAP=SOFTCAP)
        if HAS_MASK:
            in_bounds = (offs_m[:, None] < L) & kv_rows_ok[None, :]
            s2 = add_attn_mask(
                s2, mask_base + offs_m[:, None] * stride_mm + offs_n[None, :] * stride_mn,
                in_bounds, MASK_IS_BOOL=MASK_IS_BOOL,
            )
        if CHECK_BOUNDS:
            visible = kv_rows_ok[None, :]
            if IS_CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None] + causal_offset)
            if WINDOW_LEFT:
                visible = visible & (offs_n[None, :] >= offs_m[:, None] + window_lower)
            if LAYOUT_CHECK:  # a tile that straddles computed and skipped layout blocks
                map_base, stride_bmm, stride_bmn = listed[1], listed[2], listed[3]
                visible = visible & layout_visible(map_base, stride_bmm, stride_bmn, offs_m[:, None], offs_n[None, :],
                                                   (offs_m[:, None] < L) & kv_rows_ok[None, :],
                                                   LAYOUT_BQ=LAYOUT_BQ, LAYOUT_BK=LAYOUT_BK)
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
        acc = accumulate_pv(acc, alpha, p, v_base, offs_n, offs_ev, stride_vn, stride_ve, kv_rows_ok,
                            HEAD_DIM_V=HEAD_DIM_V, P_IN_FP32=P_IN_FP32, FP32_DOT=FP32_DOT)
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
    H_Q, GROUP, L, S, causal_offset, window_lower, qk_scale_log2, softcap_log2, dropout_p,
    COUNTS, IDX, BLOCK_MAP, stride_cb, stride_ch, stride_ib, stride_ih, list_len,
    stride_bmb, stride_bmh, stride_bmm, stride_bmn, CU_Q, CU_K, diag_shift,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    IS_CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr, P_IN_FP32: tl.constexpr, FP32_DOT: tl.constexpr,
    FOLD_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_BLOCK_SPARSITY: tl.constexpr = False, LAYOUT_CHECK: tl.constexpr = False,
    LAYOUT_BQ: tl.constexpr = 1, LAYOUT_BK: tl.constexpr = 1, SOFTCAP: tl.constexpr = False,
    VARLEN: tl.constexpr = False, SINKS=None, HAS_SINKS: tl.constexpr = False,
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
    score_scale = (qk_scale_log2, tl.cast(softcap_log2, tl.float32))
    dropout_p = tl.cast(dropout_p, tl.float32)
    start_m = tl.program_id(0) * BLOCK_M
    bh, b, h, h_kv = query_heads(H_Q, GROUP)
    seed = dropout_seed(SEED, HAS_DROPOUT=HAS_DROPOUT)
    row_base = bh.to(tl.int64) * L  # this program's first row of the flat LSE rows
    if VARLEN:
        q_start, k_start, L_seq, S_seq, causal_offset, window_lower = packed_sequence(
            CU_Q, CU_K, b, diag_shift, L, S, causal_offset, window_lower)
        row_base = h * L + q_start  # LSE is (Hq, total_q)
        Q += q_start * stride_qm
        OUT += q_start * stride_om
        K += k_start * stride_kn
        V += k_start * stride_vn
        L = L_seq
        S = tl.where(start_m < L_seq, S_seq, 0)  # a program past its sequence's rows visits no key
        seed = seed + b
    offs_m, offs_n_base, offs_e, offs_ev = block_offsets(start_m, BLOCK_OWN=BLOCK_M, BLOCK_LOOP=BLOCK_N,
                                                         BLOCK_E=BLOCK_E, BLOCK_EV=BLOCK_EV)
    q = tl.load(
        Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_e[None, :] * stride_qe,
        mask=(offs_m[:, None] < L) & (offs_e[None, :] < HEAD_DIM), other=0.0,
    )
    k_base = K + b * stride_kb + h_kv * stride_kh
    v_base = V + b * stride_vb + h_kv * stride_vh
    mask_base = MASK + b * stride_mb + h * stride_mh
    # The dropout counter's rows: those of a dense call, or of sequence b's own one-sequence call.
    rng_rows = bh.to(tl.int64) * L + offs_m
    if VARLEN:
        rng_rows = h * L + offs_m
    m_i, l_i, acc = online_softmax_start(BLOCK_M, BLOCK_EV)

    # Key blocks [mid, split) are whole and visible to every row of this query block, so they
    # skip the bounds/band select; [split, hi) holds the diagonal and the ragged tail, and under
    # WINDOW_LEFT [lo, mid) the window's left edge. Blocks outside [lo, hi) are never visited.
    # Under HAS_BLOCK_SPARSITY the same ranges are positions in this query tile's list of key tiles,
    # its FULL ones first ([mid, split)), then its PARTIAL ones ([split, hi)): ``launch/block_tiles.py``
    # folds the band into those classes.
    sparse = (COUNTS, IDX, BLOCK_MAP, stride_cb, stride_ch, stride_ib, stride_ih, list_len,
              stride_bmb, stride_bmh, stride_bmm, stride_bmn)
    listed, ranges = query_tile_key_tiles(start_m, b, h, S, causal_offset, window_lower, sparse,
                                          HAS_BLOCK_SPARSITY=HAS_BLOCK_SPARSITY, IS_CAUSAL=IS_CAUSAL,
                                          WINDOW_LEFT=WINDOW_LEFT, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)

    query_block = (q, offs_m, rng_rows)
    dropout = (seed, dropout_p)
    k_strides = (stride_kb, stride_kh, stride_kn, stride_ke)
    v_strides = (stride_vb, stride_vh, stride_vn, stride_ve)
    mask_strides = (stride_mb, stride_mh, stride_mm, stride_mn)
    # One call per range of ``ranges`` = (lo, mid, split, hi), unrolled at compile time: [lo, mid)
    # (under WINDOW_LEFT only) and [split, hi) with the select, [mid, split) without (LAYOUT_CHECK acts
    # only under CHECK_BOUNDS).
    for part in tl.static_range(0 if WINDOW_LEFT else 1, 3):
        acc, l_i, m_i = _attn_fwd_inner(
            acc, l_i, m_i, query_block, k_base, v_base, mask_base, dropout,
            offs_n_base, offs_e, offs_ev, ranges[part], ranges[part + 1], k_strides, v_strides, mask_strides, listed,
            L, S, causal_offset, window_lower, score_scale,
            CHECK_BOUNDS=part != 1, SOFTCAP=SOFTCAP,
            HEAD_DIM=HEAD_DIM, HEAD_DIM_V=HEAD_DIM_V, HAS_MASK=HAS_MASK, MASK_IS_BOOL=MASK_IS_BOOL,
            HAS_DROPOUT=HAS_DROPOUT, IS_CAUSAL=IS_CAUSAL, WINDOW_LEFT=WINDOW_LEFT, P_IN_FP32=P_IN_FP32,
            FP32_DOT=FP32_DOT, FOLD_SCALE=FOLD_SCALE, BLOCK_N=BLOCK_N,
            FROM_LIST=HAS_BLOCK_SPARSITY, LAYOUT_CHECK=LAYOUT_CHECK, LAYOUT_BQ=LAYOUT_BQ, LAYOUT_BK=LAYOUT_BK,
        )

    if HAS_SINKS:
        inv_l, lse = sink_normaliser(SINKS, h, m_i, l_i, dropout_p, HAS_DROPOUT=HAS_DROPOUT)
        out = acc * inv_l[:, None]
    else:
        empty_row, l_safe, inv_l = row_normaliser(l_i, dropout_p, HAS_DROPOUT=HAS_DROPOUT)
        out = acc * inv_l[:, None]
        lse = tl.where(empty_row, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN2)

    row_ok = offs_m < L
    tl.store(
        OUT + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_ev[None, :] * stride_oe,
        out.to(OUT.dtype.element_ty),
        mask=row_ok[:, None] & (offs_ev[None, :] < HEAD_DIM_V),
    )
    tl.store(LSE + row_base + offs_m, lse, mask=row_ok)
