"""Split-KV decode forward (flash-decoding): few query rows against a long key sequence.

A decode step has L <= 16 query rows per head and S up to 10^5 keys. Parallelising over query
tiles, as ``attn_fwd.py`` does, starts B · Hq programs that each stream all of K/V: at B = 1 a
few dozen programs on a GPU of 132 SMs, and under GQA every K/V tile is read GROUP times.
Here a program instead takes one (batch, KV head), one block of packed query rows and one
*split* of the keys:

  * the rows of a tile are the GROUP query heads sharing the KV head times the L query rows
    (packed row r is head h_kv · GROUP + r // L, query row r % L), so each K/V tile is read
    once per group, and the tile's M dimension (>= 16 for tl.dot) is filled by heads, not
    wasted on padding;
  * the keys are cut into NUM_SPLITS contiguous splits, so B · Hkv · NUM_SPLITS programs fill
    the GPU at any batch size (``tuning/configs.decode_split_count``).

Each split writes its partial output already normalised, O_s = Σ_j P_ij v_j / l_s, and its LSE
in base 2, lse2_s = m_s + log2 l_s, in fp32. ``_attn_decode_merge`` combines them exactly:

    lse2 = log2 Σ_s 2^lse2_s,   O = Σ_s 2^(lse2_s - lse2) · O_s

which is the softmax over the union of the splits' keys (the weights are each split's share of
the total sum). Numerics as ``attn_fwd.py``: fp32 scores, max, sum, LSE and accumulator; the
scale folded with log2(e); bool masks place -inf and float masks are added in base 2 with the
``MASK_FLOOR`` clamp (``common.add_attn_mask``); P rounded to the input dtype for P·V unless
P_IN_FP32. A split whose keys are all invisible to a row stores O_s = 0 and lse2_s = -inf for
it; the merge shifts by max_s lse2_s read as 0 when it is -inf, so it never forms -inf - (-inf),
and a row with no visible key in any split gets output 0 and LSE -inf.

Symbols (r a packed row, j a key)

    symbol            code            meaning
    ----------------  --------------  ----------------------------------------------------------
    s2                s2              log2(e) · (scale · q_r·k_j + mask), the scores in base 2
    scale · log2(e)   qk_scale_log2   the softmax scale in base 2 (the launcher folds log2(e) in)
    m_s, l_s          m_i, l_i        a split's running row max (base 2) and sum of exp2(s2 - m)
    α                 alpha           exp2(m_old - m_new), the rescale of l_i and acc per block
    P_rj              p               exp2(s2 - m_ref), m_ref = m_i with -inf read as 0
    O_s               acc / l_i       the split's normalised partial output (fp32, O_PART)
    lse2_s            m_i + log2 l_i  the split's LSE in base 2 (fp32, LSE_PART; -inf if l_s = 0)
    lse2, LSE         lse2, lse       the merged LSE in base 2; stored in natural log (times ln 2)
    w_s               w               2^(lse2_s - lse2_max), a split's weight in the merge

Indices and sizes: b (batch), h_kv (KV head), h = h_kv · GROUP + r // L (query head), i = r % L
(query row), ROWS = GROUP · L (packed rows per KV head), split (this program's split; keys
key_start + [split · split_keys, (split + 1) · split_keys), where key_start is the first key
block any row sees), causal_offset (key j is visible from row i when j <= i + causal_offset: the
band's upper side, ``launch/band.py``), window_lower (under WINDOW_LEFT, key j is visible from
row i only when j >= i + window_lower: a sliding window's left bound). O_PART is (B, Hq, L,
NUM_SPLITS, Ev) and LSE_PART (B, Hq, L, NUM_SPLITS), both contiguous fp32; pointers are
UPPER_CASE, strides ``stride_<tensor><dim>``.

Constexpr switches

    HEAD_DIM, HEAD_DIM_V    E and Ev, the head dims of Q/K and of V
    BLOCK_E, BLOCK_EV       their padded tile widths (powers of two, equal: ``launch/common.py``)
    BLOCK_M, BLOCK_N        packed rows per program and keys per step (the launch config)
    HAS_MASK, MASK_IS_BOOL  a mask is given; bool (True = attend) or additive float
    IS_CAUSAL               keys past i + causal_offset are invisible
    WINDOW_LEFT             keys before i + window_lower are invisible (a window's left bound)
    FP32_DOT                input_precision of the dots ("ieee" for fp32 operands)
    P_IN_FP32               P meets V in fp32 rather than rounded to the input dtype
    SINGLE_SPLIT            one split (NUM_SPLITS = 1): the split kernel writes OUT and LSE itself,
                            and no merge runs (O_PART, LSE_PART unused)
    BLOCK_SPLITS            (merge) NUM_SPLITS padded to a power of two

Dropout is not implemented here: a call with dropout takes ``attn_fwd.py`` (``launch/decode.py``).
The signatures are flat, one scalar per stride (see ``attn_fwd.py``).
"""

import triton
import triton.language as tl

from .common import LN2, accumulate_pv, add_attn_mask, online_softmax_start


@triton.jit
def _attn_decode_split(
    Q, K, V, MASK, O_PART, LSE_PART, OUT, LSE,
    stride_qb, stride_qh, stride_qm, stride_qe,
    stride_kb, stride_kh, stride_kn, stride_ke,
    stride_vb, stride_vh, stride_vn, stride_ve,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_ob, stride_oh, stride_om, stride_oe,
    H_KV, GROUP, L, S, NUM_SPLITS, key_start, split_keys, causal_offset, window_lower, qk_scale_log2,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, IS_CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr,
    P_IN_FP32: tl.constexpr, FP32_DOT: tl.constexpr, SINGLE_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Inductor passes Python floats to user kernels as fp64 scalars (torch 2.11); fix fp32 first.
    qk_scale_log2 = tl.cast(qk_scale_log2, tl.float32)
    split = tl.program_id(0)
    bh_kv = tl.program_id(1)
    b = (bh_kv // H_KV).to(tl.int64)
    h_kv = (bh_kv % H_KV).to(tl.int64)

    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP * L
    h = h_kv * GROUP + rows // L  # each packed row's query head
    i = rows % L  # and its query row
    offs_n_base = tl.arange(0, BLOCK_N)
    offs_e = tl.arange(0, BLOCK_E)
    offs_ev = tl.arange(0, BLOCK_EV)

    q = tl.load(
        Q + b * stride_qb + h[:, None] * stride_qh + i[:, None] * stride_qm + offs_e[None, :] * stride_qe,
        mask=row_ok[:, None] & (offs_e[None, :] < HEAD_DIM), other=0.0,
    )
    k_base = K + b * stride_kb + h_kv * stride_kh
    v_base = V + b * stride_vb + h_kv * stride_vh
    # Per-row mask pointers: the rows of one tile belong to GROUP different query heads.
    mask_rows = MASK + b * stride_mb + h * stride_mh + i * stride_mm

    lo = key_start + split * split_keys
    hi = tl.minimum(lo + split_keys, S)
    if IS_CAUSAL:
        # No row of the tile sees past key L - 1 + causal_offset: skip the blocks beyond it.
        hi = tl.minimum(hi, L + causal_offset)

    m_i, l_i, acc = online_softmax_start(BLOCK_M, BLOCK_EV)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n_base
        kv_ok = offs_n < hi
        k = tl.load(
            k_base + offs_n[None, :] * stride_kn + offs_e[:, None] * stride_ke,
            mask=kv_ok[None, :] & (offs_e[:, None] < HEAD_DIM), other=0.0,
        )
        s2 = tl.dot(q, k, input_precision=FP32_DOT) * qk_scale_log2
        if HAS_MASK:
            s2 = add_attn_mask(s2, mask_rows[:, None] + offs_n[None, :] * stride_mn,
                               row_ok[:, None] & kv_ok[None, :], MASK_IS_BOOL=MASK_IS_BOOL)
        visible = kv_ok[None, :]
        if IS_CAUSAL:
            visible = visible & (offs_n[None, :] <= i[:, None] + causal_offset)
        if WINDOW_LEFT:
            visible = visible & (offs_n[None, :] >= i[:, None] + window_lower)
        s2 = tl.where(visible, s2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s2, 1))
        # A row that has seen only invisible keys keeps m = -inf: shift by 0, never -inf - -inf.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_ref)
        p = tl.math.exp2(s2 - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = accumulate_pv(acc, alpha, p, v_base, offs_n, offs_ev, stride_vn, stride_ve, kv_ok,
                            HEAD_DIM_V=HEAD_DIM_V, P_IN_FP32=P_IN_FP32, FP32_DOT=FP32_DOT)
        m_i = m_new

    # l == 0 exactly when no key of this split was visible to the row (or the split is past the
    # causal limit and ran no step): O_s = 0, lse2_s = -inf, which the merge weighs by 0.
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc * (1.0 / l_safe)[:, None]
    lse2 = tl.where(empty, float("-inf"), m_i + tl.math.log2(l_safe))

    if SINGLE_SPLIT:
        # One split holds every key: its result is final, in the output's dtype and natural log.
        tl.store(OUT + b * stride_ob + h[:, None] * stride_oh + i[:, None] * stride_om + offs_ev[None, :] * stride_oe,
                 out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & (offs_ev[None, :] < HEAD_DIM_V))
        tl.store(LSE + (b * H_KV * GROUP + h) * L + i, lse2 * LN2, mask=row_ok)
    else:
        part_row = ((b * H_KV * GROUP + h) * L + i) * NUM_SPLITS + split  # (B, Hq, L, NUM_SPLITS) flat
        tl.store(O_PART + part_row[:, None] * HEAD_DIM_V + offs_ev[None, :], out,
                 mask=row_ok[:, None] & (offs_ev[None, :] < HEAD_DIM_V))
        tl.store(LSE_PART + part_row, lse2, mask=row_ok)


@triton.jit
def _attn_decode_merge(
    O_PART, LSE_PART, OUT, LSE,
    stride_ob, stride_oh, stride_om, stride_oe,
    H_Q, L, NUM_SPLITS,
    HEAD_DIM_V: tl.constexpr, BLOCK_EV: tl.constexpr, BLOCK_SPLITS: tl.constexpr,
):
    """One program per (b, h, i) row: the splits' outputs weighed by their share of the sum."""
    row = tl.program_id(0).to(tl.int64)  # (b · H_Q + h) · L + i
    b = row // (H_Q * L)
    h = (row // L) % H_Q
    i = row % L
    offs_s = tl.arange(0, BLOCK_SPLITS)
    offs_ev = tl.arange(0, BLOCK_EV)
    split_ok = offs_s < NUM_SPLITS

    lse2_s = tl.load(LSE_PART + row * NUM_SPLITS + offs_s, mask=split_ok, other=float("-inf"))
    lse2_max = tl.max(lse2_s, 0)
    # Every split empty: shift by 0 so the weights are exp2(-inf) = 0, never exp2(-inf - -inf).
    shift = tl.where(lse2_max == float("-inf"), 0.0, lse2_max)
    w = tl.math.exp2(lse2_s - shift)
    total = tl.sum(w, 0)
    empty = total == 0.0
    total_safe = tl.where(empty, 1.0, total)
    o_s = tl.load(O_PART + (row * NUM_SPLITS + offs_s)[:, None] * HEAD_DIM_V + offs_ev[None, :],
                  mask=split_ok[:, None] & (offs_ev[None, :] < HEAD_DIM_V), other=0.0)
    out = tl.sum(o_s * (w / total_safe)[:, None], 0)
    lse = tl.where(empty, float("-inf"), (shift + tl.math.log2(total_safe)) * LN2)

    tl.store(OUT + b * stride_ob + h * stride_oh + i * stride_om + offs_ev * stride_oe,
             out.to(OUT.dtype.element_ty), mask=offs_ev < HEAD_DIM_V)
    tl.store(LSE + row, lse)
