"""One (query tile, key block) pair of the Gluon Hopper backward's consumer warpgroup
(kernels/hopper_bwd.py, whose glossary names the symbols and switches): the five GEMMs of the
pair, its P and dS, and dQ's reduce-add. The consumer runs it once a tile, or, under PAIRED_TILES,
twice an iteration, the first call issuing the second tile's Sᵀ before its own last wait.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .gluon_tma import async_reduce_add_shared_to_global

LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def _rounded(x, dtype: gl.constexpr):
    """x rounded to ``dtype`` (bf16/fp16) and kept in fp32, by one packed conversion per pair of
    elements: written as ``x.to(dtype).to(float32)`` the compiler converts each element on its
    own (F2F, the slow pipe) to reuse the 16-bit values."""
    if dtype == gl.bfloat16:
        return gl.inline_asm_elementwise(
            "{ .reg .b32 t; cvt.rn.bf16x2.f32 t, $3, $2; shl.b32 $0, t, 16; and.b32 $1, t, 0xffff0000; }",
            "=r,=r,r,r", [x.to(gl.int32, bitcast=True)], dtype=gl.int32, is_pure=True,
            pack=2).to(gl.float32, bitcast=True)
    else:
        return gl.inline_asm_elementwise(
            "{ .reg .b32 t; .reg .b16 lo, hi; cvt.rn.f16x2.f32 t, $3, $2; mov.b32 {lo, hi}, t; "
            "cvt.f32.f16 $0, lo; cvt.f32.f16 $1, hi; }",
            "=f,=f,f,f", [x], dtype=gl.float32, is_pure=True, pack=2)


@gluon.jit
def _row_stats(lse_raw, delta_raw, q_in, EXACT_DELTA: gl.constexpr, EVEN_L: gl.constexpr = False):
    """(lse2, Δ) of a tile's query rows from the stored planes: base 2, +inf for a row that sees no
    key (LSE -inf) and for rows past L, whose P is then exactly 0, and Δ 0 past L. Under
    EXACT_DELTA the plane already holds the base-2 pivot c (+inf for a row with no key). Under
    EVEN_L there are no rows past L."""
    if EXACT_DELTA:
        lse2 = lse_raw
    else:
        lse2 = lse_raw * LOG2E
        lse2 = gl.where(lse2 == float("-inf"), float("inf"), lse2)
    if EVEN_L:
        return lse2, delta_raw
    else:
        return gl.where(q_in, lse2, float("inf")), gl.where(q_in, delta_raw, 0.0)



@gluon.jit
def _consumer_tile(t, h, m, b, H_Q, L, S, k0, stride_stats, causal_offset, window_lower, qk_scale, ds_up, grad_scale,
                   dv, dk, st_tok, next_t, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem, q_ready, do_ready,
                   q_empty, ds_ready, k_tile, v_tile, kq_tile, k_all, s_zero, dq_zero, key_ids, dq_rows0, dq_cols,
                   dq_col0, LSE, DELTA, DQ_ACCUM, KEY_BIAS, dq_desc,
                   CONSUMER: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr,
                   IS_CAUSAL: gl.constexpr, WINDOW_LEFT: gl.constexpr, DQ_SPLIT: gl.constexpr, DQ_TMA: gl.constexpr,
                   EXACT_DELTA: gl.constexpr, HAS_KEY_BIAS: gl.constexpr, ROW_STATS_TMA: gl.constexpr,
                   EVEN_L: gl.constexpr, KC: gl.constexpr, DQ_COLS: gl.constexpr, col_layout: gl.constexpr,
                   a_layout: gl.constexpr, dtype: gl.constexpr, ST_ISSUED: gl.constexpr, ISSUE_NEXT: gl.constexpr):
    """Tile t of the consumer's walk: query head h, rows [m, m + BLOCK_M). Returns dV and dK with the
    tile added, and a token: of the next tile's Sᵀ under ISSUE_NEXT (tile ``next_t``, whose Q the
    call waits for), else ``st_tok`` as given. ST_ISSUED: this tile's Sᵀ is already running
    (``st_tok``, issued by the previous call); else the call issues it."""
    slot = t % NUM_STAGES
    phase = (t // NUM_STAGES) & 1
    if DQ_TMA:
        dq_tile = dq_smem.index(CONSUMER)
    row_base = (b * H_Q + h).to(gl.int64) * L
    stats_base = (b * H_Q + h).to(gl.int64) * stride_stats
    q_ids = m + gl.arange(0, BLOCK_M, layout=col_layout)
    q_in = q_ids < L
    if not ROW_STATS_TMA:
        # Row statistics go out before the GEMMs wait on them (L2-resident vectors).
        lse_raw = gl.load(LSE + stats_base + q_ids, mask=q_in, other=0.0)
        delta_raw = gl.load(DELTA + stats_base + q_ids, mask=q_in, other=0.0)
    if HAS_KEY_BIAS:
        # This query head's bias over the consumer's keys (-inf past S), a vector per tile.
        key_bias = gl.load(KEY_BIAS + (b * H_Q + h).to(gl.int64) * S + key_ids, mask=key_ids < S,
                           other=float("-inf"))

    q_tile = q_smem.index(slot).reshape([BLOCK_M, HEAD_DIM])
    do_tile = do_smem.index(slot).reshape([BLOCK_M, HEAD_DIM])
    if not ST_ISSUED:
        mbarrier.wait(q_ready.index(slot), phase)
        st_tok = warpgroup_mma(k_tile, q_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    if ROW_STATS_TMA:
        lse_raw = lse_smem.index(slot).reshape([BLOCK_M]).load(col_layout)  # landed with Q, read while Sᵀ runs
    mbarrier.wait(do_ready.index(slot), phase)
    dpt_tok = warpgroup_mma(v_tile, do_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    if ROW_STATS_TMA:
        delta_raw = delta_smem.index(slot).reshape([BLOCK_M]).load(col_layout)
    lse2, delta = _row_stats(lse_raw, delta_raw, q_in, EXACT_DELTA=EXACT_DELTA, EVEN_L=EVEN_L)
    st = warpgroup_mma_wait(num_outstanding=1, deps=(st_tok, ))
    # Masking binds where some key of this consumer lies past S (the zero keys TMA filled in
    # score 0, and exp2(0 - lse2) need not be small) or outside some row's band: above its
    # diagonal (IS_CAUSAL) or left of its window (WINDOW_LEFT).
    if IS_CAUSAL:
        needs_mask = (m + causal_offset < k0 + KC - 1) | (k0 + KC > S)
    else:
        needs_mask = k0 + KC > S
    if WINDOW_LEFT:
        needs_mask = needs_mask | (k0 < m + BLOCK_M - 1 + window_lower)
    if needs_mask:
        visible = gl.expand_dims(key_ids < S, 1)
        if IS_CAUSAL:
            visible = visible & (gl.expand_dims(key_ids, 1) <= gl.expand_dims(q_ids, 0) + causal_offset)
        if WINDOW_LEFT:
            visible = visible & (gl.expand_dims(key_ids, 1) >= gl.expand_dims(q_ids, 0) + window_lower)
        st = gl.where(visible, st, float("-inf"))
    if HAS_KEY_BIAS:
        pt = gl.exp2((st * qk_scale + gl.expand_dims(key_bias, 1)) - gl.expand_dims(lse2, 0))
    else:
        pt = gl.exp2(st * qk_scale - gl.expand_dims(lse2, 0))
    if EXACT_DELTA:
        pt = _rounded(pt, dtype)  # P̃, as the forward rounded it; dS takes the same values
    pt_op = gl.convert_layout(pt.to(dtype), a_layout)
    # dV += Pᵀ·dO runs while dSᵀ is formed (wgmma groups retire in issue order, so one
    # outstanding after dPᵀ's wait means dPᵀ is done, dV may not be).
    dv_tok = warpgroup_mma(pt_op, do_tile, dv, is_async=True)
    dpt = warpgroup_mma_wait(num_outstanding=1, deps=(dpt_tok, ))
    if EXACT_DELTA:
        # One FFMA per score, dP·ds_up - Δ·ds_up; a power of two commutes with the rounding.
        dst = pt * (dpt * ds_up - gl.expand_dims(delta * ds_up, 0))
    else:
        dst = pt * (dpt - gl.expand_dims(delta, 0))
    dst16 = dst.to(dtype)
    ds_op = gl.convert_layout(dst16, a_layout)
    dk_tok = warpgroup_mma(ds_op, q_tile, dk, is_async=True)
    if DQ_SPLIT:
        # Double-buffered by tile parity: a consumer reaches tile t + 2's store only after the
        # other has arrived for tile t + 1, i.e. after its dQ GEMM of tile t retired.
        buf = ds_smem.index(t % 2)
        buf.slice(CONSUMER * KC, KC, dim=0).store(dst16)
        fence_async_shared()
        mbarrier.arrive(ds_ready.index(t % 2), count=1)
        mbarrier.wait(ds_ready.index(t % 2), (t // 2) & 1)
        dq_tok = warpgroup_mma(buf.permute((1, 0)), k_all, dq_zero, use_acc=False, is_async=True)
    else:
        buf = ds_smem.index(CONSUMER)
        buf.store(dst16)
        fence_async_shared()
        dq_tok = warpgroup_mma(buf.permute((1, 0)), kq_tile, dq_zero, use_acc=False, is_async=True)
    if ISSUE_NEXT:
        # The next tile's Sᵀ goes to the tensor cores before this tile's GEMMs are waited for, so
        # that it runs under this tile's dQ epilogue. In straight-line code only: a token carried
        # over the loop's back edge makes ptxas serialise every wgmma (tools/wgmma_overlap_probe.py).
        next_slot = next_t % NUM_STAGES
        mbarrier.wait(q_ready.index(next_slot), (next_t // NUM_STAGES) & 1)
        st_tok = warpgroup_mma(k_tile, q_smem.index(next_slot).reshape([BLOCK_M, HEAD_DIM]).permute((1, 0)), s_zero,
                               use_acc=False, is_async=True)
        dv, dk, dq, pt_op, ds_op = warpgroup_mma_wait(num_outstanding=1, deps=(dv_tok, dk_tok, dq_tok, pt_op, ds_op))
    else:
        # pt_op/ds_op stay in deps so their registers are not reused under the running wgmma.
        dv, dk, dq, pt_op, ds_op = warpgroup_mma_wait(num_outstanding=0, deps=(dv_tok, dk_tok, dq_tok, pt_op, ds_op))
    mbarrier.arrive(q_empty.index(slot), count=1)
    # The softmax scale goes on in fp32 here, after the cast of dS, so dS's rounding is FA2's.
    dq = dq * grad_scale
    if DQ_TMA:
        # The reduce issued a tile ago must have read the shared tile before it is rewritten.
        # Query rows past L are clipped by the descriptor, as a TMA store clips them.
        tma.store_wait(pendings=0)
        dq_tile.reshape([BLOCK_M, DQ_COLS]).store(dq)
        fence_async_shared()
        async_reduce_add_shared_to_global(dq_desc, [b, h, m, dq_col0], dq_tile)
    else:
        dq_rows = m + dq_rows0
        dq_ptrs = (DQ_ACCUM + (row_base + gl.expand_dims(dq_rows, 1)) * HEAD_DIM + gl.expand_dims(dq_cols, 0))
        gl.atomic_add(dq_ptrs, dq, mask=gl.expand_dims(dq_rows < L, 1), sem="relaxed")
    return dv, dk, st_tok
