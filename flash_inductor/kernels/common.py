"""Triton helpers shared by the forward (16-bit and fp8) and backward attention kernels.

Everything here is ``@triton.jit`` code. Scores travel in base 2: ``s2 = log2(e) * s``,
so ``exp(s - m) == exp2(s2 - m2)`` and the exponentials use the fast ``exp2`` unit.

Symbols: s2 (scores in base 2, a tile), q_idx / k_idx (query-row and key indices broadcast to
the tile's orientation), mask_base (the mask's pointer at this batch and head; strides
stride_mm / stride_mn), in_bounds (the tile's elements inside L x S), causal_offset (key j is
visible from row i when j <= i + causal_offset), window_lower (and, under WINDOW_LEFT, when
j >= i + window_lower: ``launch/band.py``).

The kernels' shared prologue (the program's batch and heads, its offsets, the dropout seed, the
online softmax's starting state) and loop steps (a loop tile's indices, the P·V product) live here
too, so that each kernel states only what is its own. Triton inlines every helper: the compiled code
is the same as with the lines written out in each kernel.

More symbols: bh (the program's (batch, query head) index, axis 1), b, h, h_kv (its batch, query
head and K/V head; GROUP query heads share one K/V head), offs (a tile's rows or keys), offs_base
(arange(0, BLOCK) of the looped-over tiles), offs_e / offs_ev (head-dim and value-dim columns),
listed (a block-sparse tile list and its layout: ``block_sparse.py``), alpha (the online softmax's
rescale of acc), p (P, unnormalised).

Constexpr switches: HAS_MASK (a mask is given), MASK_IS_BOOL (bool, True = attend, or an
additive float mask), IS_CAUSAL (keys past i + causal_offset are invisible), WINDOW_LEFT (keys
before i + window_lower are invisible), CHECK (apply the bounds / band select: ``mask_scores``),
HAS_DROPOUT (dropout on P, from SEED), FROM_LIST (walk a block-sparse list), P_IN_FP32 and FP32_DOT
(P meets V in fp32; the dots' input_precision), HEAD_DIM_V (Ev, the value head dim).
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
# finfo(float32).min * log2(e) overflows to -inf, which would turn a row built from
# `finfo.min` masks into a "fully masked" row. Clamping finite mask values here keeps them
# finite in base 2; softmax is shift-invariant, so rows made only of such values keep
# their exact result. -inf stays -inf (a real "do not attend").
MASK_FLOOR = tl.constexpr(-1.0e38)


@triton.jit
def base2_scores(products, score_scale, SOFTCAP: tl.constexpr):
    """s2 = log2(e)·s from the products q·k; ``score_scale`` = (scale·log2(e), c·log2(e)).
    s = scale·q·k, or under SOFTCAP its soft cap c·tanh(scale·q·k / c), FlashAttention-2's, which in
    base 2 is the same map with c·log2(e) for c."""
    qk_scale_log2, softcap_log2 = score_scale
    if SOFTCAP:
        # scale / c as one factor: one rounding per score before tanh, not two.
        return softcap_log2 * _tanh(products * (qk_scale_log2 / softcap_log2))
    return products * qk_scale_log2


@triton.jit
def _tanh(y):
    """tanh in fp32 to a few ulps (Triton has no tanh that every backend and the interpreter share).
    Past |y| = 1/4, (1 − e) / (1 + e) with e = exp(−2|y|) ≤ 1, which saturates to ±1 without
    overflow; below, the odd Taylor series to y⁹ (the next term is under fp32's ulp there), where
    1 − e would cancel: an absolute error of fp32's ulp near 0 would reach the logits times c."""
    magnitude = tl.abs(y)
    e = tl.math.exp2(magnitude * (-2.0 * LOG2E))
    far = (1.0 - e) / (1.0 + e)
    y2 = y * y
    near = magnitude * (1.0 + y2 * (-1.0 / 3.0 + y2 * (2.0 / 15.0 + y2 * (-17.0 / 315.0 + y2 * (62.0 / 2835.0)))))
    t = tl.where(magnitude < 0.25, near, far)
    return tl.where(y < 0, -t, t)


@triton.jit
def softcap_slope(s2, score_scale):
    """d(capped score) / d(scaled score) = 1 − tanh² at capped base-2 scores s2 (taken before the
    mask, so that an invisible key's -inf never meets it): in [0, 1], dS's factor on its way to dQ
    and dK."""
    ratio = s2 / score_scale[1]
    return 1.0 - ratio * ratio


@triton.jit
def add_attn_mask(s2, mask_ptrs, in_bounds, MASK_IS_BOOL: tl.constexpr):
    """Apply a bool (True = attend) or additive float mask tile to base-2 scores, in fp32."""
    if MASK_IS_BOOL:
        keep = tl.load(mask_ptrs, mask=in_bounds, other=0)
        s2 = tl.where(keep != 0, s2, float("-inf"))
    else:
        bias = tl.load(mask_ptrs, mask=in_bounds, other=0.0).to(tl.float32)
        bias = tl.where(bias > float("-inf"), tl.maximum(bias, MASK_FLOOR), bias)
        s2 = s2 + bias * LOG2E
    return s2


@triton.jit
def mask_scores(s2, mask_base, q_idx, k_idx, in_bounds, stride_mm, stride_mn, causal_offset, window_lower,
                HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, IS_CAUSAL: tl.constexpr,
                WINDOW_LEFT: tl.constexpr = False, CHECK: tl.constexpr = True):
    """Scores with the attention mask applied and every invisible key at -inf.

    ``q_idx``/``k_idx`` are the query-row and key index tiles, already broadcast to the scores'
    orientation ((rows, 1)/(1, keys), or transposed in the dK/dV pass), so one helper states the
    visibility rule for every pass that recomputes P: in bounds, allowed by the mask,
    j <= i + causal_offset under IS_CAUSAL and j >= i + window_lower under WINDOW_LEFT.

    ``CHECK=False`` is for tiles the caller knows are whole (every key inside S) and fully
    visible under the band: only the mask is applied (its load still bounded, since query
    rows past L are zero-padded, not visible). Such rows need no select: the backward recomputes
    their P against a reference of +inf, which makes it 0.
    """
    if HAS_MASK:
        s2 = add_attn_mask(s2, mask_base + q_idx * stride_mm + k_idx * stride_mn, in_bounds,
                           MASK_IS_BOOL=MASK_IS_BOOL)
    if CHECK:
        visible = in_bounds
        if IS_CAUSAL:
            visible = visible & (k_idx <= q_idx + causal_offset)
        if WINDOW_LEFT:
            visible = visible & (k_idx >= q_idx + window_lower)
        s2 = tl.where(visible, s2, float("-inf"))
    return s2


@triton.jit
def dropout_keep(seed, rows, cols, S, dropout_p):
    """Counter-based keep mask: element (row, col) of the (B*Hq*L, S) score matrix.

    ``rows`` is the flattened (batch, query head, query row) index as int64, so the mask
    depends only on the seed and the element's position: the backward regenerates it
    exactly, with no stored bits, whatever tiling either pass uses.
    """
    return tl.rand(seed, rows * S + cols) >= dropout_p


@triton.jit
def query_heads(H_Q, GROUP):
    """(bh, b, h, h_kv) of a program whose second grid axis runs over batch x query heads."""
    bh = tl.program_id(1)
    b = (bh // H_Q).to(tl.int64)
    h = (bh % H_Q).to(tl.int64)
    h_kv = h // GROUP  # grouped-query attention: K/V are indexed, never repeated
    return bh, b, h, h_kv


@triton.jit
def packed_sequence(CU_Q, CU_K, b, diag_shift, total_q, total_k, causal_offset, window_lower):
    """Sequence ``b`` of a packed (VARLEN) launch: (q_start, k_start, L, S, causal_offset,
    window_lower). Its rows are ``[CU_Q[b], CU_Q[b + 1])`` of the packed query, its keys
    ``[CU_K[b], CU_K[b + 1])``; the band's offsets, given relative to the diagonal j = i, move to
    this sequence's bottom-right diagonal (``diag_shift`` 1, FlashAttention's alignment) or stay
    (0, top-left). Offsets are clamped to the packed lengths, so malformed ones (which the Python
    entry points refuse eagerly) cannot address outside the tensors."""
    q_start = tl.minimum(tl.maximum(tl.load(CU_Q + b), 0), total_q)
    k_start = tl.minimum(tl.maximum(tl.load(CU_K + b), 0), total_k)
    q_stop = tl.minimum(tl.maximum(tl.load(CU_Q + b + 1), q_start), total_q)
    k_stop = tl.minimum(tl.maximum(tl.load(CU_K + b + 1), k_start), total_k)
    seq_q = (q_stop - q_start).to(tl.int32)
    seq_k = (k_stop - k_start).to(tl.int32)
    shift = (seq_k - seq_q) * diag_shift
    return q_start.to(tl.int64), k_start.to(tl.int64), seq_q, seq_k, causal_offset + shift, window_lower + shift


@triton.jit
def block_offsets(start, BLOCK_OWN: tl.constexpr, BLOCK_LOOP: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_EV: tl.constexpr):
    """(offs, offs_base, offs_e, offs_ev): the program's own rows or keys from ``start``, the
    looped-over tiles' base offsets, and the head-dim and value-dim columns."""
    offs = start + tl.arange(0, BLOCK_OWN)
    offs_base = tl.arange(0, BLOCK_LOOP)
    offs_e = tl.arange(0, BLOCK_E)
    offs_ev = tl.arange(0, BLOCK_EV)
    return offs, offs_base, offs_e, offs_ev


@triton.jit
def dropout_seed(SEED, HAS_DROPOUT: tl.constexpr):
    """The dropout seed (a device scalar, so that a new seed needs no recompile); 0, unused, without."""
    seed = 0
    if HAS_DROPOUT:
        seed = tl.load(SEED)
    return seed


@triton.jit
def dropout_scales(SEED, dropout_p, HAS_DROPOUT: tl.constexpr):
    """(seed, keep_scale) of the backward passes: the dropout seed and 1 / (1 - dropout_p), the
    scale of the kept elements; 0 and 1 without dropout."""
    seed = dropout_seed(SEED, HAS_DROPOUT=HAS_DROPOUT)
    keep_scale = 1.0
    if HAS_DROPOUT:
        keep_scale = 1.0 / (1.0 - dropout_p)
    return seed, keep_scale


@triton.jit
def online_softmax_start(BLOCK_M: tl.constexpr, BLOCK_EV: tl.constexpr):
    """(m_i, l_i, acc) before the first key: max -inf, sum 0, output 0, all fp32."""
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_EV], dtype=tl.float32)
    return m_i, l_i, acc


@triton.jit
def row_normaliser(l_i, dropout_p, HAS_DROPOUT: tl.constexpr):
    """(empty_row, l_safe, inv_l) at the end of the online softmax: l == 0 exactly when no key was
    visible, and such a row divides by 1 (output 0, LSE -inf) instead of 0/0; inv_l also undoes
    dropout's 1 - dropout_p."""
    empty_row = l_i == 0.0
    l_safe = tl.where(empty_row, 1.0, l_i)
    inv_l = 1.0 / l_safe
    if HAS_DROPOUT:
        inv_l = inv_l / (1.0 - dropout_p)
    return empty_row, l_safe, inv_l


@triton.jit
def sink_normaliser(SINKS, h, m_i, l_i, dropout_p, HAS_DROPOUT: tl.constexpr):
    """(inv_l, lse) with head h's sink logit SINKS[h] (natural log) in the row's denominator: on the
    common max m_tot = max(m_i, sink·log2 e), O' = acc·exp2(m_i - m_tot) / (l_i·exp2(m_i - m_tot) +
    exp2(sink₂ - m_tot)) and LSE' = m_tot + log2 of that sum (stored in natural log). One of the two
    exponentials is 1, so nothing overflows however far the sink is from the keys; a row with no
    visible key gets O' = 0 and LSE' = the sink itself, and only a sink of -inf there leaves the sum 0
    (1 stands in: O' 0, LSE' -inf)."""
    sink = tl.load(SINKS + h).to(tl.float32)
    sink2 = sink * 1.4426950408889634
    m_tot = tl.maximum(m_i, sink2)
    m_tot = tl.where(m_tot == float("-inf"), 0.0, m_tot)
    keys_share = tl.math.exp2(m_i - m_tot)
    l_tot = l_i * keys_share + tl.math.exp2(sink2 - m_tot)
    none = l_tot == 0.0
    l_tot = tl.where(none, 1.0, l_tot)
    inv_l = keys_share / l_tot
    if HAS_DROPOUT:
        inv_l = inv_l / (1.0 - dropout_p)
    lse = tl.where(l_i == 0.0, sink, (m_tot + tl.math.log2(l_tot)) * 0.6931471805599453)
    return inv_l, tl.where(none, float("-inf"), lse)


@triton.jit
def loop_tile(it, listed, offs_base, length, BLOCK: tl.constexpr, FROM_LIST: tl.constexpr):
    """(offs, in_range) of the tile a loop step visits: the tile starting at ``it``, or under
    FROM_LIST the one at position ``it`` of a block-sparse list (``listed[0]``)."""
    if FROM_LIST:
        start = tl.load(listed[0] + it) * BLOCK
    else:
        start = it
    offs = start + offs_base
    return offs, offs < length


@triton.jit
def accumulate_pv(acc, alpha, p, v_base, offs_n, offs_ev, stride_vn, stride_ve, kv_ok,
                  HEAD_DIM_V: tl.constexpr, P_IN_FP32: tl.constexpr, FP32_DOT: tl.constexpr):
    """acc rescaled by alpha plus P·V for the key tile ``offs_n`` (keys past ``kv_ok`` load as 0).
    P is rounded to V's dtype for the dot unless P_IN_FP32."""
    v = tl.load(
        v_base + offs_n[:, None] * stride_vn + offs_ev[None, :] * stride_ve,
        mask=kv_ok[:, None] & (offs_ev[None, :] < HEAD_DIM_V), other=0.0,
    )
    if P_IN_FP32:
        pv = tl.dot(p, v.to(tl.float32), input_precision=FP32_DOT)
    else:
        pv = tl.dot(p.to(v.dtype), v, input_precision=FP32_DOT)
    return acc * alpha[:, None] + pv
