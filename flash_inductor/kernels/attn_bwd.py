"""Backward flash-attention kernels: a row-sum preprocess, a row reference, a dQ pass, then a dK/dV pass.

P is recomputed from the saved LSE (through a per-row reference and shift, see
``_attn_bwd_row_reference``); no (L, S) matrix is stored (except dS itself when the
caller asks for the gradient of a float mask). dS = P∘(dP − Δ) stays fp32 until it meets
the matrix unit, where ``_ds_tile`` rounds it as the precision schedule says.

Launch order (``launch/backward.py``): ``_attn_bwd_preprocess`` (Δ, and the |dS| bound's
statistics), ``_attn_bwd_row_reference``, ``_attn_bwd_dq`` (which under exact Δ rewrites Δ into
Δ*), ``_attn_bwd_dkdv`` (which reads Δ*).

Symbols (i a query row, j a key; vectors are per row of a query block)

    symbol            code                      meaning
    ----------------  ------------------------  ---------------------------------------------------
    s_ij              --                        scale · q_i·k_j (+ the additive mask), natural units
    s2                s2 (dQ), s2_t (dK/dV)     log2(e) · s_ij: scores in base 2; s2_t is (keys, queries)
    scale             sm_scale                  the softmax scale; qk_scale_log2 = scale · log2(e)
    c                 softcap_log2 = c · log2(e)  the soft cap (SOFTCAP); score_scale = (qk_scale_log2,
                                                softcap_log2), what ``common.base2_scores`` maps q·k with
    g_ij              slope, slope_t            1 − tanh²(scale·q_i·k_j / c), dS's factor on its way to
                                                dQ and dK under SOFTCAP (the mask's gradient is dS)
    σ'_i, Λ'_i        ds_slope_sum, p_slope_sum Σ_j dS_ij g_ij and Σ_j P_ij g_ij (exact Δ under SOFTCAP)
    lse_i             LSE, lse                  the forward's log-sum-exp, natural log (as stored)
    lse_i · log2(e)   row_ref (ROW_REF)         the LSE in base 2: the row reference P is taken against
    shift_i           row_shift (ROW_SHIFT)     log2 of the row sum, non-zero only for rows at the mask
                                                clamp; P = exp2((s2 - row_ref) - row_shift)
    2^-shift_i        row_scale                 the dQ pass's row factor: its loop works with P / row_scale
    P_ij              p (dQ), p_t (dK/dV)       softmax probability, fp32 (p is P / row_scale)
    P_ij with dropout p_used_t                  P · keep / (1 - dropout_p), the P that multiplied V
    keep_ij           keep                      the dropout keep mask (``common.dropout_keep``)
    1/(1-dropout_p)   keep_scale                the dropout keep scale, 1 without dropout
    dP_ij             dp, dp_t                  dO_i·v_j (times keep · keep_scale under dropout)
    dLSE_i            DLSE, dlse                the gradient of the LSE output (HAS_DLSE)
    Δ_i               delta (DELTA)             rowsum(dO_i ∘ O_i) − dLSE_i, from ``_attn_bwd_preprocess``
    Δ*_i              delta + correction        exact Δ: stored over Δ in DELTA by the dQ pass
    c_i, c̃_i          correction,               σ_i / Λ_i − dLSE_i and σ̃_i / Λ_i − dLSE_i
                      seen_correction
    dS_ij             ds, ds_t                  P_ij (dP_ij − Δ_i) in fp32; times ds_up in DS_RESCALE's
                                                plain loop; ds_t is (keys, queries)
    dS as rounded     (ds_tile, ds_factor)      the matrix unit's operand: ds_tile · ds_factor is dS
    σ_i               ds_sum                    Σ_j dS_ij, fp32 (exact Δ)
    σ̃_i               ds_seen_sum               Σ_j dS_ij as the dQ dot saw it, rounded (exact Δ)
    Λ_i               p_sum                     Σ_j P_ij (exact Δ)
    K̄_i               p_k                       Σ_j P_ij k_j, a (rows, BLOCK_E) tile (exact Δ)
    B                 bound                     the call's bound on |dS| (``_ds_loop_choice``, from DS_STATS)
    ds_up             ds_up                     the plain loop's power-of-two scale-up of dS (1 unless
                                                DS_RESCALE)

Indices and sizes: b (batch), h (query head), h_kv = h // GROUP (its K/V head; GROUP = H_Q /
H_KV query heads share one), bh = b · H_Q + h, L / S (query / key lengths), row_ids = bh · L +
row (a row of the flattened (B·H_Q, L) vectors DELTA, ROW_REF, ROW_SHIFT, DLSE and of DMASK),
causal_offset (key j is visible from row i when j <= i + causal_offset), window_lower (under
WINDOW_LEFT, only when j >= i + window_lower too), offs_m / offs_n / offs_e / offs_ev (a block's
rows, keys, head-dim and value-dim columns), lo / mid / split / mid_hi / hi (block ranges of the
loops, see the passes; ``launch/band.py`` mirrors them in Python). Pointers are UPPER_CASE,
strides ``stride_<tensor><dim>``.

Constexpr switches

    HEAD_DIM, HEAD_DIM_V    E and Ev, the head dims of Q/K and of V
    BLOCK_E, BLOCK_EV       their padded tile widths (powers of two, equal: ``launch/common.py``)
    BLOCK_M, BLOCK_N        query rows and keys per tile (the launch config)
    HAS_MASK, MASK_IS_BOOL  a mask is given; bool (True = attend) or additive float
    IS_CAUSAL               keys past i + causal_offset are invisible (causal masking, or a window's
                            right bound: the launcher passes the band's upper side)
    WINDOW_LEFT             keys before i + window_lower are invisible (a window's left bound)
    HAS_DROPOUT             dropout on P, regenerated from SEED (``common.dropout_keep``)
    FP32_DOT                input_precision of every dot ("ieee", "tf32" or "tf32x3" for fp32 operands)
    P_IN_FP32               P meets dO (dV) and K (K̄) in fp32 rather than rounded to the input dtype
    DS_IN_FP32              dS meets Q (dK) and K (dQ) in fp32 rather than rounded
    DS_RESCALE              fp16 dS may overflow: each program picks the plain loop (dS · ds_up) or,
                            past DS_RESCALE_ABOVE, the per-tile rescaling loop (``_ds_loop_choice``)
    EXACT_DELTA             the dQ pass corrects dq and Δ with σ, σ̃, Λ and K̄ (below)
    HAS_SINKS               (dQ pass, under EXACT_DELTA) attention sinks: SINKS[h], head h's logit in
                            natural log, fp32 (ops/sinks.py). (O, LSE) carry the sink already, so P and
                            Δ need nothing; but the row's keys' weights sum to Λ = 1 − p_s, p_s =
                            exp(sink − lse), so exact Δ's sums take the sink as a column (below).
                            Else SINKS is None
    HAS_DLSE                the LSE output has a gradient (DLSE), which shifts Δ
    WRITE_DMASK             write dS into DMASK, the float mask's gradient (the dQ pass without exact
                            Δ, the dK/dV pass with it: only there is dS final)
    COLLECT_DS_STATS        the preprocess also collects the |dS| bound's maxima into DS_STATS
    EVEN_N, EVEN_M          S (dQ pass) / L (dK/dV pass) is a whole number of blocks: no row masks on
                            the looped-over loads (``tile_loads``)
    EVEN_E                  both head dims equal their padded width: no column masks on those loads
    HAS_BLOCK_SPARSITY      a block-sparse layout: the dQ pass's key ranges are positions in its query
                            tile's list (FULL, then PARTIAL tiles), the dK/dV pass's query ranges
                            positions in each head's list for its key tile (PARTIAL, then FULL):
                            COUNTS, IDX (``block_sparse.py``); None when dense
    LAYOUT_CHECK            checked tiles also test the layout per element (LAYOUT_BQ, LAYOUT_BK)
    SOFTCAP                 scores are soft-capped before the mask (``common.base2_scores``); dS meets
                            Q and K times the slope g (below, "Soft cap")
    VARLEN                  packed sequences, as the forward's (``attn_fwd.py``): the dQ pass's axis 1
                            runs over (sequence, query head), the dK/dV pass's over (sequence, K/V
                            head); the row vectors (DELTA, ROW_REF, ...) are the packed (Hq, total_q)
                            ones, which the preprocess and the row reference fill as one dense call
    inner helpers only:
    RESCALE                 this loop is the rescaling one (per-tile scale of dS, ``_ds_tile``)
    CHECK                   the tile may hold invisible keys: apply the bounds / causal select
    SHIFT                   some row may have a non-zero row_shift (dK/dV pass; SHIFT_FLAG)

Argument groups. The kernels' own signatures are flat, one scalar per stride, as launched (see
``attn_fwd.py``).
Inside, the kernels hand their helpers tuples, which Triton inlines away (the compiled code is
the same as with the values passed one by one):

    *_strides       (batch, head, row, column) strides of one tensor
    key_block       (k, v, offs_n, kv_rows_ok): the dK/dV program's keys and values
    query_block     (q, do, offs_m, q_rows_ok, row_ids, rng_rows): the dQ program's rows, their rows of
                    the flat row vectors and of the dropout counter (the same but under VARLEN)
    row_bases       (first row of the row vectors, first dropout row) of one query head, dK/dV pass
    row_pointers    (ROW_REF, ROW_SHIFT, DELTA); row_values (row_ref, row_scale, delta)
    exact_sums      (σ, σ̃, Λ, K̄) = (ds_sum, ds_seen_sum, p_sum, p_k)
    listed          (tile list, block map at this batch and head, its two strides); dense, None or
                    a placeholder (``block_sparse.query_tile_key_tiles``); sparse (the kernels'
                    layout arguments, for ``block_sparse.listed_tiles``)
    ranges          (lo, mid, split, hi) of the dQ pass, (lo, mid, mid_hi, hi) of the dK/dV pass
    dropout         (seed, keep_scale, dropout_p)

Δ and the LSE's gradient. Δ_i = rowsum(dO_i ∘ O_i) − dLSE_i: the LSE output's own gradient
enters dS exactly as a shift of Δ, because ∂lse_i/∂s_ij = P_ij.

Exact Δ (``EXACT_DELTA``, the schedule's ``exact_delta``). rowsum(dO_i ∘ O_i) stands for
Σ_j P_ij dP_ij, but O is stored rounded to the input dtype, so it is off by
δ_i ≈ u·|dO_i|·|O_i|, and each dS_ij carries −P_ij·δ_i; dq_i = scale·Σ_j dS_ij k_j multiplies
that by Σ_j P_ij k_j, which is large when the keys share a large component. The dQ pass, which
runs first, therefore also sums per row σ_i = Σ_j dS_ij, Λ_i = Σ_j P_ij and
K̄_i = Σ_j P_ij k_j (one more dot per tile). As Σ_j P_ij dP_ij = σ_i + Λ_i·Δ_i, the Δ this row's
P and dP imply is Δ*_i = Δ_i + c_i with c_i = σ_i / Λ_i − dLSE_i, and
Σ_j P_ij (dP_ij − Δ*_i) k_j = Σ_j dS_ij k_j − c_i·K̄_i. Dividing by Λ_i (1 up to the LSE's own
rounding) keeps Δ* consistent with the P the backward recomputes, which matters once |s| is
large enough for an fp32 LSE to be off by more than a 16-bit ulp. Rows that see no key have
Λ_i = 0 and keep their Δ (their P, hence dS, is 0 anyway). With sinks (HAS_SINKS) the sink is one
more column, with weight p_s,i = exp(sink_h − lse_i), no key and no value (dP = 0): Λ_i, σ_i and σ̃_i
start at p_s,i, −p_s,i·Δ_i and −p_s,i·Δ_i, so Λ_i is again 1 up to the LSE's rounding.

dq is corrected with σ̃_i, the sum of dS as the dQ dot saw it (rounded to the input dtype
unless the schedule keeps dS in fp32), rather than with σ_i. With e_ij the rounding error of
dS_ij, the computed dq then misses the exact one by scale·Σ_j e_ij (k_j − K̄_i/Λ_i): the
rounding meets only the keys' spread around their P-weighted mean. With σ_i it would meet k_j
itself, shared component included, which on near-tied keys costs as much as the Δ error did.
Δ* itself comes from σ_i, unrounded; the dQ pass stores it in place of Δ, and the dK/dV pass,
launched after it, reads it.

Soft cap (SOFTCAP). With s_ij = c·tanh(u_ij / c), u_ij = scale·q_i·k_j, the gradient of u is
dS_ij·g_ij, g_ij = 1 − tanh²: dq_i = scale·Σ_j dS_ij g_ij k_j, dk_j = scale·Σ_i dS_ij g_ij q_i,
while Δ and everything P and dP make (dV, the mask's dS) are unchanged. Under exact Δ the dQ pass's
correction then subtracts c_i·Σ_j P_ij g_ij k_j, so K̄ sums P·g; its rounding compensation, which
replaces σ by σ̃ in the plain case, becomes (σ̃'_i − σ'_i) / Λ'_i with σ̃' the sum of dS·g as the
dot saw it, σ' = Σ_j dS_ij g_ij and Λ' = Σ_j P_ij g_ij (both 1-for-1 the plain sums when g = 1).

GQA. The dK/dV pass owns one key block of one KV head and walks every query head of its GQA
group, so grouped K/V gradients are summed in registers, without atomics or repeated K/V.

Loop split. Both passes split their loop as the forward does: tiles whose keys all lie inside S
and are all visible to every row under the band skip the visibility select
(``mask_scores``'s CHECK=False); the causal diagonal, a window's left edge and a ragged last key
block keep it, and tiles wholly outside the band are not visited. The
last key block must: its zero-padded keys score 0, and against a row whose LSE is very negative
exp2(0 - LSE) is inf, which the select is what turns into 0.

fp16 dS rescaling (the ``stable`` schedule's ``ds_rescale``) is decided once per program: the
preprocess bounds |dS| over the whole call on the device (``_ds_loop_choice``), and only a call
whose bound passes ``DS_RESCALE_ABOVE`` runs the per-tile rescaling loop; every other call runs
the plain loop, with no per-tile max reduction and the products accumulated inside the dots.
The plain loop still scales dS, up, by one power of two per call before the fp16 cast:
ds_up = 2^floor(log2(DS_RESCALE_ABOVE / B)) for the bound B, at most 2^40 (``_ds_loop_choice``).
Where dS is tiny (small |dO| or |V|, or the many small P of peaked attention), cast directly it
would fall in fp16's subnormals (< 2^-14), which keep fewer significant bits the smaller the
value; scaled, every |dS| is still <= 2^14, far from 65504. dq and dk then accumulate ds_up times
their sums, and their final scale is sm_scale / ds_up, exact for a power of two, as is every step
between (fp32 sums of scaled terms are the scaled sums): only the cast's rounding changes. Under
exact Δ, σ stays in dS's own units, and so does σ̃ (the factor 1 / ds_up that ``_ds_tile``
returns); the correction σ̃·K̄ is scaled by ds_up before it meets the scaled dq. The rescaling
loop takes ds_up = 1, and kernels without ``DS_RESCALE`` never see it.
"""

import triton
import triton.language as tl

from .attn_bwd_tiles import _dkdv_tiles, _dq_tiles
from .band import key_tile_query_ranges
from .block_sparse import listed_tiles, query_tile_key_tiles
from .common import LOG2E, base2_scores, block_offsets, dropout_scales, mask_scores, packed_sequence, query_heads
from .ds_scaling import _ds_loop_choice, _max_as_stat

# LSEs below this (natural log) only come from rows whose every visible key sits at the
# -1e38 mask clamp; see _attn_bwd_row_reference.
LSE_SATURATED = tl.constexpr(-1.0e37)
@triton.jit
def _attn_bwd_preprocess(
    OUT, DO, DLSE, DELTA, V, DS_STATS,
    stride_ob, stride_oh, stride_om, stride_oe,
    stride_db, stride_dh, stride_dm, stride_de,
    stride_vb, stride_vh, stride_vn, stride_ve,
    H_Q, H_KV, BH_KV, L, S,
    HEAD_DIM_V: tl.constexpr, BLOCK_EV: tl.constexpr, HAS_DLSE: tl.constexpr, COLLECT_DS_STATS: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Δ_i = rowsum(dO_i ∘ O_i) - dLSE_i per query row; under COLLECT_DS_STATS (the schedules that
    rescale dS) also the call's maxima ``_ds_loop_choice`` bounds |dS| with, atomically into
    DS_STATS (three fp32 zeros from the launcher): max ‖dO_i‖² and max |dLSE_i| from these rows,
    and max ‖v_j‖² from V's rows, which the grid then covers too (its first axis spans
    max(L, S) rows; programs past B * H_KV on the second axis have no V rows). Collected here,
    beside the reads of dO the preprocess makes anyway, the bound needs no launches of its own.
    Computed by torch reductions instead (two norms, two maxima and the products: about eight
    launches), it cost an eager fp16 training step 0.1-0.3 ms of kernel time at 16k tokens on an
    H200, where Inductor fused it in compiled graphs (2026-12-01, docs/performance.md)."""
    start_m = tl.program_id(0) * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    bh = tl.program_id(1)
    offs_ev = tl.arange(0, BLOCK_EV)
    if start_m < L:
        b = (bh // H_Q).to(tl.int64)
        h = (bh % H_Q).to(tl.int64)
        tile_ok = (offs_m[:, None] < L) & (offs_ev[None, :] < HEAD_DIM_V)
        o = tl.load(OUT + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_ev[None, :] * stride_oe,
                    mask=tile_ok, other=0.0).to(tl.float32)
        do = tl.load(DO + b * stride_db + h * stride_dh + offs_m[:, None] * stride_dm + offs_ev[None, :] * stride_de,
                     mask=tile_ok, other=0.0).to(tl.float32)
        delta = tl.sum(o * do, axis=1)
        row_ids = bh.to(tl.int64) * L + offs_m
        if HAS_DLSE:
            dlse = tl.load(DLSE + row_ids, mask=offs_m < L, other=0.0)
            delta -= dlse
            if COLLECT_DS_STATS:
                tl.atomic_max(DS_STATS + 2, _max_as_stat(tl.abs(dlse)))
        tl.store(DELTA + row_ids, delta, mask=offs_m < L)
        if COLLECT_DS_STATS:
            tl.atomic_max(DS_STATS, _max_as_stat(tl.sum(do * do, axis=1)))
    if COLLECT_DS_STATS:
        if (bh < BH_KV) & (start_m < S):
            b_kv = (bh // H_KV).to(tl.int64)
            h_kv = (bh % H_KV).to(tl.int64)
            v = tl.load(V + b_kv * stride_vb + h_kv * stride_vh + offs_m[:, None] * stride_vn
                        + offs_ev[None, :] * stride_ve,
                        mask=(offs_m[:, None] < S) & (offs_ev[None, :] < HEAD_DIM_V), other=0.0).to(tl.float32)
            tl.atomic_max(DS_STATS + 1, _max_as_stat(tl.sum(v * v, axis=1)))


@triton.jit
def _attn_bwd_row_reference(
    Q, K, MASK, LSE, ROW_REF, ROW_SHIFT, SHIFT_FLAG,
    stride_qb, stride_qh, stride_qm, stride_qe,
    stride_kb, stride_kh, stride_kn, stride_ke,
    stride_mb, stride_mh, stride_mm, stride_mn,
    H_Q, GROUP, L, S, causal_offset, window_lower, qk_scale_log2, softcap_log2,
    HEAD_DIM: tl.constexpr, BLOCK_E: tl.constexpr,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, IS_CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr,
    FP32_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr = False,
):
    """Per query row, the base-2 (reference, shift) the backward recomputes P with:
    P = exp2((s2 - reference) - shift).

    Normally reference = lse * log2(e) and shift = 0. Rows with no visible key get
    reference = +inf, so P is 0 rather than NaN. Rows whose every visible key sits at the mask
    clamp (finfo(fp32/bf16).min masks) have lse ~ -1e38, where fp32 cannot also hold log(l):
    for those alone, one more pass over the keys recovers the row max (reference) and the
    log-sum (shift) separately. Other blocks skip that pass. A block with such rows also sets
    SHIFT_FLAG (one int32, zeroed by the launcher), which tells the dK/dV pass that some shift
    may be non-zero: without it, that pass runs the loop that neither loads nor subtracts the
    shift (an extra row vector and one more add per score cost it 9-19 %,
    benchmarks/results/dkdv_features_probe_*).
    """
    # Inductor passes Python floats to user kernels as fp64 scalars (torch 2.11); arithmetic
    # with them would promote the fp32 accumulators, so fix them at fp32 first.
    score_scale = (tl.cast(qk_scale_log2, tl.float32), tl.cast(softcap_log2, tl.float32))
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    row_ok = offs_m < L
    row_ids = bh.to(tl.int64) * L + offs_m
    lse = tl.load(LSE + row_ids, mask=row_ok, other=0.0)
    reference = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    shift = tl.zeros([BLOCK_M], dtype=tl.float32)
    saturated = (lse < LSE_SATURATED) & (lse > float("-inf"))
    if tl.max(saturated.to(tl.int32)) > 0:
        b = (bh // H_Q).to(tl.int64)
        h = (bh % H_Q).to(tl.int64)
        offs_e = tl.arange(0, BLOCK_E)
        q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_e[None, :] * stride_qe,
                    mask=row_ok[:, None] & (offs_e[None, :] < HEAD_DIM), other=0.0)
        k_base = K + b * stride_kb + (h // GROUP) * stride_kh
        mask_base = MASK + b * stride_mb + h * stride_mh
        row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        hi = S
        if IS_CAUSAL:
            hi = tl.minimum(S, start_m + BLOCK_M + causal_offset)
        lo = 0
        if WINDOW_LEFT:
            lo = tl.maximum(start_m + window_lower, 0) // BLOCK_N * BLOCK_N
        for start_n in range(lo, hi, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            kv_rows_ok = offs_n < S
            k = tl.load(k_base + offs_n[None, :] * stride_kn + offs_e[:, None] * stride_ke,
                        mask=kv_rows_ok[None, :] & (offs_e[:, None] < HEAD_DIM), other=0.0)
            s2 = base2_scores(tl.dot(q, k, input_precision=FP32_DOT), score_scale, SOFTCAP=SOFTCAP)
            s2 = mask_scores(s2, mask_base, offs_m[:, None], offs_n[None, :], row_ok[:, None] & kv_rows_ok[None, :],
                             stride_mm, stride_mn, causal_offset, window_lower,
                             HAS_MASK=HAS_MASK, MASK_IS_BOOL=MASK_IS_BOOL, IS_CAUSAL=IS_CAUSAL, WINDOW_LEFT=WINDOW_LEFT)
            new_max = tl.maximum(row_max, tl.max(s2, 1))
            safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
            row_sum = row_sum * tl.math.exp2(row_max - safe_max) + tl.sum(tl.math.exp2(s2 - safe_max[:, None]), 1)
            row_max = new_max
        reference = tl.where(saturated, row_max, reference)
        shift = tl.where(saturated, tl.math.log2(tl.where(saturated, row_sum, 1.0)), 0.0)
        tl.store(SHIFT_FLAG, 1)  # every writer writes 1, so the race is harmless
    tl.store(ROW_REF + row_ids, reference, mask=row_ok)
    tl.store(ROW_SHIFT + row_ids, shift, mask=row_ok)



@triton.jit
def _dkdv_heads(
    dk, dv, key_block, Q, DO, MASK, b, h_kv, row_pointers, DMASK, dropout, ds_up,
    offs_m_base, offs_e, offs_ev, ranges, q_strides, do_strides, mask_strides, sparse, packed_rows,
    H_Q, GROUP, L, S, causal_offset, window_lower, score_scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    IS_CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr, P_IN_FP32: tl.constexpr, DS_IN_FP32: tl.constexpr,
    DS_RESCALE: tl.constexpr,
    RESCALE: tl.constexpr, WRITE_DMASK: tl.constexpr, FP32_DOT: tl.constexpr,
    SHIFT: tl.constexpr, EVEN_M: tl.constexpr, EVEN_E: tl.constexpr, BLOCK_M: tl.constexpr,
    HAS_BLOCK_SPARSITY: tl.constexpr = False, LAYOUT_CHECK: tl.constexpr = False,
    LAYOUT_BQ: tl.constexpr = 1, LAYOUT_BK: tl.constexpr = 1, SOFTCAP: tl.constexpr = False,
    VARLEN: tl.constexpr = False,
):
    """Every query head of the GQA group: of ``ranges`` = (lo, mid, mid_hi, hi), blocks [lo, mid) with
    the visibility select, [mid, mid_hi) without, and under WINDOW_LEFT [mid_hi, hi) with it (the
    window's left edge). Under HAS_BLOCK_SPARSITY the ranges are positions in each head's own list of
    query tiles (``sparse``: the kernel's layout arguments; the list is this key tile's), its PARTIAL
    tiles first ([lo, mid), with the select), then its FULL ones ([mid, mid_hi), without)."""
    stride_qb, stride_qh, _, _ = q_strides
    stride_dob, stride_doh, _, _ = do_strides
    stride_mb, stride_mh, _, _ = mask_strides
    for g in range(GROUP):
        h = h_kv * GROUP + g
        bh = b * H_Q + h
        # (first row of the flat row vectors, first dropout counter row) of this head: a dense
        # call's, or under VARLEN the packed rows' (packed_rows = (q_start, total_q)) and a
        # one-sequence call's.
        row_bases = (bh * L, bh * L)
        if VARLEN:
            row_bases = (h * packed_rows[1] + packed_rows[0], h * L)
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_dob + h * stride_doh
        mask_base = MASK + b * stride_mb + h * stride_mh
        if HAS_BLOCK_SPARSITY:
            n_full, n_partial, listed = listed_tiles(sparse, b, h, tl.program_id(0))  # this key tile's list
            tiles = (0, n_partial, n_partial + n_full, n_partial + n_full)
        else:
            listed = None
            tiles = ranges
        # One call per range of ``tiles``, unrolled at compile time; the layout's element test
        # (LAYOUT_CHECK) is for the checked ranges only.
        for part in tl.static_range(0, 3 if WINDOW_LEFT else 2):
            dk, dv = _dkdv_tiles(
                dk, dv, key_block, q_base, do_base, mask_base, row_bases, row_pointers, DMASK, dropout, ds_up,
                offs_m_base, offs_e, offs_ev, tiles[part], tiles[part + 1], q_strides, do_strides, mask_strides,
                listed, L, S, causal_offset, window_lower, score_scale,
                CHECK=part != 1, SOFTCAP=SOFTCAP,
                RESCALE=RESCALE, SHIFT=SHIFT, HEAD_DIM=HEAD_DIM, HEAD_DIM_V=HEAD_DIM_V, HAS_MASK=HAS_MASK,
                MASK_IS_BOOL=MASK_IS_BOOL, HAS_DROPOUT=HAS_DROPOUT, IS_CAUSAL=IS_CAUSAL, WINDOW_LEFT=WINDOW_LEFT,
                P_IN_FP32=P_IN_FP32,
                DS_IN_FP32=DS_IN_FP32, DS_RESCALE=DS_RESCALE, WRITE_DMASK=WRITE_DMASK, FP32_DOT=FP32_DOT,
                EVEN_M=EVEN_M, EVEN_E=EVEN_E, BLOCK_M=BLOCK_M,
                FROM_LIST=HAS_BLOCK_SPARSITY, LAYOUT_CHECK=LAYOUT_CHECK and part != 1, LAYOUT_BQ=LAYOUT_BQ,
                LAYOUT_BK=LAYOUT_BK,
            )
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(
    Q, K, V, MASK, SEED, DO, ROW_REF, ROW_SHIFT, SHIFT_FLAG, DELTA, DS_STATS, DK, DV, DMASK,
    stride_qb, stride_qh, stride_qm, stride_qe,
    stride_kb, stride_kh, stride_kn, stride_ke,
    stride_vb, stride_vh, stride_vn, stride_ve,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_dob, stride_doh, stride_dom, stride_doe,
    stride_dkb, stride_dkh, stride_dkn, stride_dke,
    stride_dvb, stride_dvh, stride_dvn, stride_dve,
    H_Q, H_KV, GROUP, L, S, causal_offset, window_lower, qk_scale_log2, softcap_log2, sm_scale, dropout_p,
    COUNTS, IDX, BLOCK_MAP, stride_cb, stride_ch, stride_ib, stride_ih, list_len,
    stride_bmb, stride_bmh, stride_bmm, stride_bmn, CU_Q, CU_K, diag_shift,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    IS_CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr, P_IN_FP32: tl.constexpr, DS_IN_FP32: tl.constexpr,
    DS_RESCALE: tl.constexpr, WRITE_DMASK: tl.constexpr, FP32_DOT: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_BLOCK_SPARSITY: tl.constexpr = False, LAYOUT_CHECK: tl.constexpr = False,
    LAYOUT_BQ: tl.constexpr = 1, LAYOUT_BK: tl.constexpr = 1, SOFTCAP: tl.constexpr = False,
    VARLEN: tl.constexpr = False,
):
    # Inductor passes Python floats to user kernels as fp64 scalars (torch 2.11); arithmetic
    # with them would promote the fp32 accumulators, so fix them at fp32 first.
    score_scale = (tl.cast(qk_scale_log2, tl.float32), tl.cast(softcap_log2, tl.float32))
    sm_scale = tl.cast(sm_scale, tl.float32)
    dropout_p = tl.cast(dropout_p, tl.float32)
    start_n = tl.program_id(0) * BLOCK_N
    bh_kv = tl.program_id(1)
    b = (bh_kv // H_KV).to(tl.int64)
    h_kv = (bh_kv % H_KV).to(tl.int64)
    packed_rows = (0, 0)  # (q_start, total_q) under VARLEN
    if VARLEN:
        q_start, k_start, L_seq, S_seq, causal_offset, window_lower = packed_sequence(
            CU_Q, CU_K, b, diag_shift, L, S, causal_offset, window_lower)
        packed_rows = (q_start, L)
        Q += q_start * stride_qm
        DO += q_start * stride_dom
        K += k_start * stride_kn
        V += k_start * stride_vn
        DK += k_start * stride_dkn
        DV += k_start * stride_dvn
        S = S_seq
        L = tl.where(start_n < S_seq, L_seq, 0)  # a program past its sequence's keys visits no query
    offs_n, offs_m_base, offs_e, offs_ev = block_offsets(start_n, BLOCK_OWN=BLOCK_N, BLOCK_LOOP=BLOCK_M,
                                                         BLOCK_E=BLOCK_E, BLOCK_EV=BLOCK_EV)
    kv_rows_ok = offs_n < S

    k = tl.load(K + b * stride_kb + h_kv * stride_kh + offs_n[:, None] * stride_kn + offs_e[None, :] * stride_ke,
                mask=kv_rows_ok[:, None] & (offs_e[None, :] < HEAD_DIM), other=0.0)
    v = tl.load(V + b * stride_vb + h_kv * stride_vh + offs_n[:, None] * stride_vn + offs_ev[None, :] * stride_ve,
                mask=kv_rows_ok[:, None] & (offs_ev[None, :] < HEAD_DIM_V), other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_E], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_EV], dtype=tl.float32)

    seed, keep_scale = dropout_scales(SEED, dropout_p, HAS_DROPOUT=HAS_DROPOUT)
    if VARLEN:
        seed = seed + b  # sequence b's own stream, as its one-sequence call would draw
    # The query tiles that see these keys, and which of them need the visibility select.
    ranges = key_tile_query_ranges(start_n, L, S, causal_offset, window_lower, IS_CAUSAL=IS_CAUSAL,
                                   WINDOW_LEFT=WINDOW_LEFT, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    # A block-sparse layout's arguments, read per query head by _dkdv_heads.
    sparse = (COUNTS, IDX, BLOCK_MAP, stride_cb, stride_ch, stride_ib, stride_ih, list_len,
              stride_bmb, stride_bmh, stride_bmm, stride_bmn)

    # Decided once for the whole program; a compile-time False (and ds_up a compile-time 1) unless
    # the schedule rescales, so the other kernels hold the plain, unscaled loop alone. The rare
    # rescaling loop always applies the row shift; the plain loop skips it unless some row of the
    # call needs it (SHIFT_FLAG, set by the row-reference kernel).
    needs_rescale = False
    ds_up = 1.0
    if DS_RESCALE:
        needs_rescale, ds_up = _ds_loop_choice(DS_STATS, keep_scale)
    key_block = (k, v, offs_n, kv_rows_ok)
    row_pointers = (ROW_REF, ROW_SHIFT, DELTA)
    dropout = (seed, keep_scale, dropout_p)
    q_strides = (stride_qb, stride_qh, stride_qm, stride_qe)
    do_strides = (stride_dob, stride_doh, stride_dom, stride_doe)
    mask_strides = (stride_mb, stride_mh, stride_mm, stride_mn)
    # The three calls differ only in RESCALE and SHIFT.
    if needs_rescale:
        dk, dv = _dkdv_heads(
            dk, dv, key_block, Q, DO, MASK, b, h_kv, row_pointers, DMASK, dropout, ds_up,
            offs_m_base, offs_e, offs_ev, ranges, q_strides, do_strides, mask_strides, sparse, packed_rows,
            H_Q, GROUP, L, S, causal_offset, window_lower, score_scale,
            RESCALE=True, SHIFT=True, SOFTCAP=SOFTCAP, VARLEN=VARLEN,
            HEAD_DIM=HEAD_DIM, HEAD_DIM_V=HEAD_DIM_V, HAS_MASK=HAS_MASK, MASK_IS_BOOL=MASK_IS_BOOL,
            HAS_DROPOUT=HAS_DROPOUT, IS_CAUSAL=IS_CAUSAL, WINDOW_LEFT=WINDOW_LEFT, P_IN_FP32=P_IN_FP32,
            DS_IN_FP32=DS_IN_FP32,
            DS_RESCALE=DS_RESCALE, WRITE_DMASK=WRITE_DMASK, FP32_DOT=FP32_DOT, EVEN_M=EVEN_M, EVEN_E=EVEN_E,
            BLOCK_M=BLOCK_M,
            HAS_BLOCK_SPARSITY=HAS_BLOCK_SPARSITY, LAYOUT_CHECK=LAYOUT_CHECK, LAYOUT_BQ=LAYOUT_BQ, LAYOUT_BK=LAYOUT_BK,
        )
    elif tl.load(SHIFT_FLAG) != 0:
        dk, dv = _dkdv_heads(
            dk, dv, key_block, Q, DO, MASK, b, h_kv, row_pointers, DMASK, dropout, ds_up,
            offs_m_base, offs_e, offs_ev, ranges, q_strides, do_strides, mask_strides, sparse, packed_rows,
            H_Q, GROUP, L, S, causal_offset, window_lower, score_scale,
            RESCALE=False, SHIFT=True, SOFTCAP=SOFTCAP, VARLEN=VARLEN,
            HEAD_DIM=HEAD_DIM, HEAD_DIM_V=HEAD_DIM_V, HAS_MASK=HAS_MASK, MASK_IS_BOOL=MASK_IS_BOOL,
            HAS_DROPOUT=HAS_DROPOUT, IS_CAUSAL=IS_CAUSAL, WINDOW_LEFT=WINDOW_LEFT, P_IN_FP32=P_IN_FP32,
            DS_IN_FP32=DS_IN_FP32,
            DS_RESCALE=DS_RESCALE, WRITE_DMASK=WRITE_DMASK, FP32_DOT=FP32_DOT, EVEN_M=EVEN_M, EVEN_E=EVEN_E,
            BLOCK_M=BLOCK_M,
            HAS_BLOCK_SPARSITY=HAS_BLOCK_SPARSITY, LAYOUT_CHECK=LAYOUT_CHECK, LAYOUT_BQ=LAYOUT_BQ, LAYOUT_BK=LAYOUT_BK,
        )
    else:
        dk, dv = _dkdv_heads(
            dk, dv, key_block, Q, DO, MASK, b, h_kv, row_pointers, DMASK, dropout, ds_up,
            offs_m_base, offs_e, offs_ev, ranges, q_strides, do_strides, mask_strides, sparse, packed_rows,
            H_Q, GROUP, L, S, causal_offset, window_lower, score_scale,
            RESCALE=False, SHIFT=False, SOFTCAP=SOFTCAP, VARLEN=VARLEN,
            HEAD_DIM=HEAD_DIM, HEAD_DIM_V=HEAD_DIM_V, HAS_MASK=HAS_MASK, MASK_IS_BOOL=MASK_IS_BOOL,
            HAS_DROPOUT=HAS_DROPOUT, IS_CAUSAL=IS_CAUSAL, WINDOW_LEFT=WINDOW_LEFT, P_IN_FP32=P_IN_FP32,
            DS_IN_FP32=DS_IN_FP32,
            DS_RESCALE=DS_RESCALE, WRITE_DMASK=WRITE_DMASK, FP32_DOT=FP32_DOT, EVEN_M=EVEN_M, EVEN_E=EVEN_E,
            BLOCK_M=BLOCK_M,
            HAS_BLOCK_SPARSITY=HAS_BLOCK_SPARSITY, LAYOUT_CHECK=LAYOUT_CHECK, LAYOUT_BQ=LAYOUT_BQ, LAYOUT_BK=LAYOUT_BK,
        )

    if DS_RESCALE:
        dk = dk * (sm_scale / ds_up)  # dk holds ds_up * Σ dS·q; exact, ds_up being a power of two
    else:
        dk = dk * sm_scale
    tl.store(DK + b * stride_dkb + h_kv * stride_dkh + offs_n[:, None] * stride_dkn + offs_e[None, :] * stride_dke,
             dk.to(DK.dtype.element_ty), mask=kv_rows_ok[:, None] & (offs_e[None, :] < HEAD_DIM))
    tl.store(DV + b * stride_dvb + h_kv * stride_dvh + offs_n[:, None] * stride_dvn + offs_ev[None, :] * stride_dve,
             dv.to(DV.dtype.element_ty), mask=kv_rows_ok[:, None] & (offs_ev[None, :] < HEAD_DIM_V))

@triton.jit
def _dq_blocks(
    dq, exact_sums, query_block, row_values, k_base, v_base, mask_base, dropout, ds_up, DMASK,
    offs_n_base, offs_e, offs_ev, ranges, k_strides, v_strides, mask_strides, listed,
    S, causal_offset, window_lower, score_scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    IS_CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr, P_IN_FP32: tl.constexpr, DS_IN_FP32: tl.constexpr,
    DS_RESCALE: tl.constexpr,
    RESCALE: tl.constexpr, EXACT_DELTA: tl.constexpr,
    WRITE_DMASK: tl.constexpr, FP32_DOT: tl.constexpr, EVEN_N: tl.constexpr, EVEN_E: tl.constexpr,
    BLOCK_N: tl.constexpr, FROM_LIST: tl.constexpr = False, LAYOUT_CHECK: tl.constexpr = False,
    LAYOUT_BQ: tl.constexpr = 1, LAYOUT_BK: tl.constexpr = 1, SOFTCAP: tl.constexpr = False,
):
    """The key tiles of ``ranges`` = (lo, mid, split, hi): [mid, split) without the visibility select,
    [split, hi) and under WINDOW_LEFT [lo, mid) with it, one call per range, unrolled at compile time.
    Under FROM_LIST the ranges are positions in ``listed[0]``, a block-sparse layout's list of this
    query tile's key tiles. The layout's element test (LAYOUT_CHECK) is for the checked ranges only."""
    for part in tl.static_range(0 if WINDOW_LEFT else 1, 3):
        dq, exact_sums = _dq_tiles(
            dq, exact_sums, query_block, row_values, k_base, v_base, mask_base, dropout, ds_up, DMASK,
            offs_n_base, offs_e, offs_ev, ranges[part], ranges[part + 1], k_strides, v_strides, mask_strides, listed,
            S, causal_offset, window_lower, score_scale,
            CHECK=part != 1, SOFTCAP=SOFTCAP,
            RESCALE=RESCALE, HEAD_DIM=HEAD_DIM, HEAD_DIM_V=HEAD_DIM_V, HAS_MASK=HAS_MASK, MASK_IS_BOOL=MASK_IS_BOOL,
            HAS_DROPOUT=HAS_DROPOUT, IS_CAUSAL=IS_CAUSAL, WINDOW_LEFT=WINDOW_LEFT, P_IN_FP32=P_IN_FP32,
            DS_IN_FP32=DS_IN_FP32, DS_RESCALE=DS_RESCALE, EXACT_DELTA=EXACT_DELTA, WRITE_DMASK=WRITE_DMASK,
            FP32_DOT=FP32_DOT, EVEN_N=EVEN_N, EVEN_E=EVEN_E, BLOCK_N=BLOCK_N,
            FROM_LIST=FROM_LIST, LAYOUT_CHECK=LAYOUT_CHECK and part != 1, LAYOUT_BQ=LAYOUT_BQ, LAYOUT_BK=LAYOUT_BK,
        )
    return dq, exact_sums


@triton.jit
def _attn_bwd_dq(
    Q, K, V, MASK, SEED, DO, ROW_REF, ROW_SHIFT, DLSE, DELTA, DS_STATS, DQ, DMASK,
    stride_qb, stride_qh, stride_qm, stride_qe,
    stride_kb, stride_kh, stride_kn, stride_ke,
    stride_vb, stride_vh, stride_vn, stride_ve,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_dob, stride_doh, stride_dom, stride_doe,
    stride_dqb, stride_dqh, stride_dqm, stride_dqe,
    H_Q, GROUP, L, S, causal_offset, window_lower, qk_scale_log2, softcap_log2, sm_scale, dropout_p,
    COUNTS, IDX, BLOCK_MAP, stride_cb, stride_ch, stride_ib, stride_ih, list_len,
    stride_bmb, stride_bmh, stride_bmm, stride_bmn, CU_Q, CU_K, diag_shift,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    IS_CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr, P_IN_FP32: tl.constexpr, DS_IN_FP32: tl.constexpr,
    DS_RESCALE: tl.constexpr,
    EXACT_DELTA: tl.constexpr, HAS_DLSE: tl.constexpr, WRITE_DMASK: tl.constexpr, FP32_DOT: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_BLOCK_SPARSITY: tl.constexpr = False, LAYOUT_CHECK: tl.constexpr = False,
    LAYOUT_BQ: tl.constexpr = 1, LAYOUT_BK: tl.constexpr = 1, SOFTCAP: tl.constexpr = False,
    VARLEN: tl.constexpr = False, SINKS=None, HAS_SINKS: tl.constexpr = False,
):
    # Inductor passes Python floats to user kernels as fp64 scalars (torch 2.11); arithmetic
    # with them would promote the fp32 accumulators, so fix them at fp32 first.
    score_scale = (tl.cast(qk_scale_log2, tl.float32), tl.cast(softcap_log2, tl.float32))
    sm_scale = tl.cast(sm_scale, tl.float32)
    dropout_p = tl.cast(dropout_p, tl.float32)
    start_m = tl.program_id(0) * BLOCK_M
    bh, b, h, h_kv = query_heads(H_Q, GROUP)
    row_base = bh.to(tl.int64) * L  # this program's first row of the flat row vectors
    if VARLEN:
        q_start, k_start, L_seq, S_seq, causal_offset, window_lower = packed_sequence(
            CU_Q, CU_K, b, diag_shift, L, S, causal_offset, window_lower)
        row_base = h * L + q_start  # the row vectors are (Hq, total_q)
        Q += q_start * stride_qm
        DO += q_start * stride_dom
        DQ += q_start * stride_dqm
        K += k_start * stride_kn
        V += k_start * stride_vn
        L = L_seq
        S = tl.where(start_m < L_seq, S_seq, 0)  # a program past its sequence's rows visits no key
    offs_m, offs_n_base, offs_e, offs_ev = block_offsets(start_m, BLOCK_OWN=BLOCK_M, BLOCK_LOOP=BLOCK_N,
                                                         BLOCK_E=BLOCK_E, BLOCK_EV=BLOCK_EV)
    q_rows_ok = offs_m < L

    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_e[None, :] * stride_qe,
                mask=q_rows_ok[:, None] & (offs_e[None, :] < HEAD_DIM), other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dom + offs_ev[None, :] * stride_doe,
                 mask=q_rows_ok[:, None] & (offs_ev[None, :] < HEAD_DIM_V), other=0.0)
    row_ids = row_base + offs_m
    rng_rows = row_ids  # the dropout counter's rows: a dense call's, or sequence b's own call's
    if VARLEN:
        rng_rows = h * L + offs_m
    row_ref = tl.load(ROW_REF + row_ids, mask=q_rows_ok, other=float("inf"))
    row_shift = tl.load(ROW_SHIFT + row_ids, mask=q_rows_ok, other=0.0)
    delta = tl.load(DELTA + row_ids, mask=q_rows_ok, other=0.0)
    k_base = K + b * stride_kb + h_kv * stride_kh
    v_base = V + b * stride_vb + h_kv * stride_vh
    mask_base = MASK + b * stride_mb + h * stride_mh
    seed, keep_scale = dropout_scales(SEED, dropout_p, HAS_DROPOUT=HAS_DROPOUT)
    if VARLEN:
        seed = seed + b

    dq = tl.zeros([BLOCK_M, BLOCK_E], dtype=tl.float32)
    # Exact Δ's sums (unused, and compiled away, without it).
    ds_sum = tl.zeros([BLOCK_M], dtype=tl.float32)  # σ
    ds_seen_sum = tl.zeros([BLOCK_M], dtype=tl.float32)  # σ̃
    p_sum = tl.zeros([BLOCK_M], dtype=tl.float32)  # Λ
    p_k = tl.zeros([BLOCK_M, BLOCK_E], dtype=tl.float32)  # K̄ (Σ P·g·k under SOFTCAP)
    ds_slope_sum = tl.zeros([BLOCK_M], dtype=tl.float32)  # σ' (SOFTCAP)
    p_slope_sum = tl.zeros([BLOCK_M], dtype=tl.float32)  # Λ' (SOFTCAP)
    if HAS_SINKS:
        # The sink is one more column with no key and no value (dP = 0), so Λ, σ and σ̃ (not the
        # soft cap's slope sums, which see keys only) start with its terms p_s and -p_s·Δ.
        sink_share = tl.math.exp2(tl.load(SINKS + h) * LOG2E - row_ref - row_shift)
        sink_share = tl.where(q_rows_ok, sink_share, 0.0)
        p_sum = sink_share
        ds_sum = -sink_share * delta
        if not SOFTCAP:
            ds_seen_sum = ds_sum
    exact_sums = (ds_sum, ds_seen_sum, p_sum, p_k, ds_slope_sum, p_slope_sum)
    # Key blocks [mid, split) are whole and visible to every row of this query block; [split, hi)
    # holds the causal diagonal and the ragged last key block, [lo, mid) the window's left edge.
    # Under HAS_BLOCK_SPARSITY the same ranges are positions in this query tile's list of key tiles,
    # its FULL ones first ([mid, split)), then its PARTIAL ones ([split, hi)), as in the forward.
    sparse = (COUNTS, IDX, BLOCK_MAP, stride_cb, stride_ch, stride_ib, stride_ih, list_len,
              stride_bmb, stride_bmh, stride_bmm, stride_bmn)
    listed, ranges = query_tile_key_tiles(start_m, b, h, S, causal_offset, window_lower, sparse,
                                          HAS_BLOCK_SPARSITY=HAS_BLOCK_SPARSITY, IS_CAUSAL=IS_CAUSAL,
                                          WINDOW_LEFT=WINDOW_LEFT, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)

    # P = exp2(s2 - reference - shift). Only rows at the mask clamp have a shift (see
    # _attn_bwd_row_reference), and it cannot join the reference there (~1e38 would absorb it).
    # Everything this pass sums is linear in P, so the loop works with P / row_scale
    # (row_scale = exp2(-shift), 1 on every other row) and the row factor is applied once at the
    # end; Δ's correction, a ratio of two such sums, needs none. A per-score subtraction cost one
    # add per score, a branch on the shift two exp2 (the compiler evaluated both sides).
    row_scale = tl.math.exp2(-row_shift)
    # Decided once for the whole program; a compile-time False (and ds_up a compile-time 1) unless
    # the schedule rescales, so the other kernels hold the plain, unscaled loop alone.
    needs_rescale = False
    ds_up = 1.0
    if DS_RESCALE:
        needs_rescale, ds_up = _ds_loop_choice(DS_STATS, keep_scale)
    query_block = (q, do, offs_m, q_rows_ok, row_ids, rng_rows)
    row_values = (row_ref, row_scale, delta)
    dropout = (seed, keep_scale, dropout_p)
    k_strides = (stride_kb, stride_kh, stride_kn, stride_ke)
    v_strides = (stride_vb, stride_vh, stride_vn, stride_ve)
    mask_strides = (stride_mb, stride_mh, stride_mm, stride_mn)
    # The two calls differ only in RESCALE.
    if needs_rescale:
        dq, exact_sums = _dq_blocks(
            dq, exact_sums, query_block, row_values, k_base, v_base, mask_base, dropout, ds_up, DMASK,
            offs_n_base, offs_e, offs_ev, ranges, k_strides, v_strides, mask_strides, listed,
            S, causal_offset, window_lower, score_scale,
            RESCALE=True, SOFTCAP=SOFTCAP,
            HEAD_DIM=HEAD_DIM, HEAD_DIM_V=HEAD_DIM_V, HAS_MASK=HAS_MASK, MASK_IS_BOOL=MASK_IS_BOOL,
            HAS_DROPOUT=HAS_DROPOUT, IS_CAUSAL=IS_CAUSAL, WINDOW_LEFT=WINDOW_LEFT, P_IN_FP32=P_IN_FP32,
            DS_IN_FP32=DS_IN_FP32,
            DS_RESCALE=DS_RESCALE, EXACT_DELTA=EXACT_DELTA, WRITE_DMASK=WRITE_DMASK, FP32_DOT=FP32_DOT,
            EVEN_N=EVEN_N, EVEN_E=EVEN_E, BLOCK_N=BLOCK_N,
            FROM_LIST=HAS_BLOCK_SPARSITY, LAYOUT_CHECK=LAYOUT_CHECK, LAYOUT_BQ=LAYOUT_BQ, LAYOUT_BK=LAYOUT_BK,
        )
    else:
        dq, exact_sums = _dq_blocks(
            dq, exact_sums, query_block, row_values, k_base, v_base, mask_base, dropout, ds_up, DMASK,
            offs_n_base, offs_e, offs_ev, ranges, k_strides, v_strides, mask_strides, listed,
            S, causal_offset, window_lower, score_scale,
            RESCALE=False, SOFTCAP=SOFTCAP,
            HEAD_DIM=HEAD_DIM, HEAD_DIM_V=HEAD_DIM_V, HAS_MASK=HAS_MASK, MASK_IS_BOOL=MASK_IS_BOOL,
            HAS_DROPOUT=HAS_DROPOUT, IS_CAUSAL=IS_CAUSAL, WINDOW_LEFT=WINDOW_LEFT, P_IN_FP32=P_IN_FP32,
            DS_IN_FP32=DS_IN_FP32,
            DS_RESCALE=DS_RESCALE, EXACT_DELTA=EXACT_DELTA, WRITE_DMASK=WRITE_DMASK, FP32_DOT=FP32_DOT,
            EVEN_N=EVEN_N, EVEN_E=EVEN_E, BLOCK_N=BLOCK_N,
            FROM_LIST=HAS_BLOCK_SPARSITY, LAYOUT_CHECK=LAYOUT_CHECK, LAYOUT_BQ=LAYOUT_BQ, LAYOUT_BK=LAYOUT_BK,
        )
    ds_sum, ds_seen_sum, p_sum, p_k, ds_slope_sum, p_slope_sum = exact_sums

    if EXACT_DELTA:
        # The corrections c = σ/Λ − dLSE and c̃ = σ̃/Λ − dLSE of the module docstring; 0 on rows
        # that see no key.
        has_key = p_sum > 0.0
        inv_p_sum = 1.0 / tl.where(has_key, p_sum, 1.0)
        dlse = tl.zeros([BLOCK_M], dtype=tl.float32)
        if HAS_DLSE:
            dlse = tl.load(DLSE + row_ids, mask=q_rows_ok, other=0.0)
        correction = tl.where(has_key, ds_sum * inv_p_sum - dlse, 0.0)
        if SOFTCAP:
            # c + (σ̃' − σ') / Λ' (module docstring, "Soft cap"); Λ' is 0 only where every g is.
            slope_ok = has_key & (p_slope_sum > 0.0)
            seen_correction = correction + tl.where(
                slope_ok, (ds_seen_sum - ds_slope_sum) / tl.where(slope_ok, p_slope_sum, 1.0), 0.0)
        else:
            seen_correction = tl.where(has_key, ds_seen_sum * inv_p_sum - dlse, 0.0)
        if DS_RESCALE:
            # dq holds ds_up times its sum (the plain loop's scale-up), and so must what it loses.
            seen_correction = seen_correction * ds_up
        dq -= seen_correction[:, None] * p_k
        tl.store(DELTA + row_ids, delta + correction, mask=q_rows_ok)
    dq = dq * row_scale[:, None]
    if DS_RESCALE:
        dq = dq * (sm_scale / ds_up)  # exact, ds_up being a power of two
    else:
        dq = dq * sm_scale
    tl.store(DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqm + offs_e[None, :] * stride_dqe,
             dq.to(DQ.dtype.element_ty), mask=q_rows_ok[:, None] & (offs_e[None, :] < HEAD_DIM))
