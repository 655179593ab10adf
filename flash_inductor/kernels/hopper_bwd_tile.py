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
from triton.language.core import _aggregate as aggregate

from .gluon_softcap import softcap_slope, softcap_tanh
from .gluon_tma import async_reduce_add_shared_to_global
from .hopper_packed import q_row
from .hopper_pipeline import MaybeSmem, Scalar, field

LOG2E = gl.constexpr(1.4426950408889634)


@aggregate
class ConsumerKeys:
    """What every tile of one consumer warpgroup reads, the same for the whole walk: its 64 keys
    (``k0`` on, ``key_ids``) of batch ``b``, their K and V rows in shared memory (``k_tile``,
    ``v_tile``), dQ's keys (``kq_tile``: K̃ under CENTRE_KEYS, else K; ``k_all``: all 128 keys of
    this consumer's dQ columns under DQ_SPLIT, else None), zero accumulators, dQ's rows and
    columns, and the scales (``ds_up``: EXACT_DELTA's dS scale, else None)."""
    b: Scalar
    H_Q: Scalar
    k0: Scalar
    key_ids: gl.tensor
    k_tile: gl.shared_memory_descriptor
    v_tile: gl.shared_memory_descriptor
    kq_tile: gl.shared_memory_descriptor
    k_all: MaybeSmem
    s_zero: gl.tensor
    dq_zero: gl.tensor
    dq_rows0: gl.tensor
    dq_cols: gl.tensor
    dq_col0: Scalar
    ds_up: Scalar
    grad_scale: Scalar

    @gluon.constexpr_function
    def __init__(self, b, H_Q, k0, key_ids, k_tile, v_tile, kq_tile, k_all, s_zero, dq_zero, dq_rows0, dq_cols, dq_col0,
                 ds_up, grad_scale):
        self.b = field(b)
        self.H_Q = field(H_Q)
        self.k0 = field(k0)
        self.key_ids = field(key_ids)
        self.k_tile = field(k_tile)
        self.v_tile = field(v_tile)
        self.kq_tile = field(kq_tile)
        self.k_all = field(k_all)
        self.s_zero = field(s_zero)
        self.dq_zero = field(dq_zero)
        self.dq_rows0 = field(dq_rows0)
        self.dq_cols = field(dq_cols)
        self.dq_col0 = field(dq_col0)
        self.ds_up = field(ds_up)
        self.grad_scale = field(grad_scale)


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
def _consumer_tile(cfg, prob, descs, bufs, keys, t, h, m, dv, dk, st_tok, next_t, CONSUMER: gl.constexpr,
                   ST_ISSUED: gl.constexpr, ISSUE_NEXT: gl.constexpr):
    """Tile t of the consumer's walk: query head h, rows [m, m + BLOCK_M). Returns dV and dK with the
    tile added, and a token: of the next tile's Sᵀ under ISSUE_NEXT (tile ``next_t``, whose Q the
    call waits for), else ``st_tok`` as given. ST_ISSUED: this tile's Sᵀ is already running
    (``st_tok``, issued by the previous call); else the call issues it (``st_tok`` is None)."""
    slot = bufs.ring.slot(t)
    phase = bufs.ring.phase(t)
    if cfg.DQ_TMA:
        dq_tile = bufs.dq_smem.index(CONSUMER)
    else:
        dq_tile = None
    pt, pt_op, dpt_tok, delta, q_tile, do_tile, row_base, st_tok = _tile_p(
        cfg, prob, bufs, keys, slot, phase, h, m, st_tok, ST_ISSUED=ST_ISSUED)
    dv, dk, dq, st_tok = _tile_mmas(cfg, bufs, keys, t, slot, pt, pt_op, dpt_tok, delta, q_tile, do_tile, dv, dk,
                                    st_tok, next_t, CONSUMER=CONSUMER, ISSUE_NEXT=ISSUE_NEXT)
    # The softmax scale goes on in fp32 here, after the cast of dS, so dS's rounding is FA2's.
    dq = dq * keys.grad_scale
    if cfg.DQ_TMA:
        # The reduce issued a tile ago must have read the shared tile before it is rewritten.
        # Query rows past L are clipped by the descriptor, as a TMA store clips them.
        tma.store_wait(pendings=0)
        dq_tile.reshape([cfg.BLOCK_M, cfg.DQ_COLS]).store(dq)
        fence_async_shared()
        # Under VARLEN the box may cover the next sequence's first rows, whose P here is 0: it adds
        # exact zeros there.
        async_reduce_add_shared_to_global(descs.dq, [keys.b, h, q_row(cfg, prob, m), keys.dq_col0], dq_tile)
    else:
        dq_rows = m + keys.dq_rows0
        dq_ptrs = (prob.DQ_ACCUM + (row_base + gl.expand_dims(dq_rows, 1)) * cfg.HEAD_DIM
                   + gl.expand_dims(keys.dq_cols, 0))
        gl.atomic_add(dq_ptrs, dq, mask=gl.expand_dims(dq_rows < prob.L, 1), sem="relaxed")
    return dv, dk, st_tok


@gluon.jit
def _row_bases(cfg, prob, b, H_Q, h):
    """(first element row of query head h in the (B, Hq, L, E) dQ accumulator, its first entry in
    the row-statistic planes): under VARLEN the sequence's first row in the packed (1, Hq, total_q)
    ones."""
    if cfg.VARLEN:
        return (h.to(gl.int64) * prob.total_q + prob.q_start,
                h.to(gl.int64) * prob.stride_stats + prob.q_start)
    else:
        return (b * H_Q + h).to(gl.int64) * prob.L, (b * H_Q + h).to(gl.int64) * prob.stride_stats


@gluon.jit
def _tile_p(cfg, prob, bufs, keys, slot, phase, h, m, st_tok, ST_ISSUED: gl.constexpr):
    """Sᵀ and dPᵀ of the tile issued, and Pᵀ (fp32 and as the dV GEMM's A operand) while dPᵀ
    runs. Returns (pt, pt_op, dPᵀ's token, Δ, the Q and dO tiles, the dQ rows' base, Sᵀ's token).
    Under SOFTCAP the fp32 pt is Pᵀ∘gᵀ, the slope taken in, so that dSᵀ comes out as dUᵀ = dSᵀ∘gᵀ
    with no second fp32 tile live across the dV GEMM."""
    BLOCK_M: gl.constexpr = cfg.BLOCK_M
    b = keys.b
    key_ids = keys.key_ids
    row_base, stats_base = _row_bases(cfg, prob, b, keys.H_Q, h)
    q_ids = m + gl.arange(0, BLOCK_M, layout=cfg.col_layout)
    q_in = q_ids < prob.L
    if not cfg.ROW_STATS_TMA:
        # Row statistics go out before the GEMMs wait on them (L2-resident vectors).
        lse_raw = gl.load(prob.LSE + stats_base + q_ids, mask=q_in, other=0.0)
        delta_raw = gl.load(prob.DELTA + stats_base + q_ids, mask=q_in, other=0.0)
    if cfg.HAS_KEY_BIAS:
        # This query head's bias over the consumer's keys (-inf past S), a vector per tile.
        key_bias = gl.load(prob.KEY_BIAS + (b * keys.H_Q + h).to(gl.int64) * prob.S + key_ids, mask=key_ids < prob.S,
                           other=float("-inf"))

    q_tile = bufs.q_smem.index(slot).reshape([BLOCK_M, cfg.HEAD_DIM])
    do_tile = bufs.do_smem.index(slot).reshape([BLOCK_M, cfg.HEAD_DIM])
    if not ST_ISSUED:
        bufs.ring.wait_ready(slot, phase)
        st_tok = warpgroup_mma(keys.k_tile, q_tile.permute((1, 0)), keys.s_zero, use_acc=False, is_async=True)
    if cfg.ROW_STATS_TMA:
        lse_raw = bufs.lse_smem.index(slot).reshape([BLOCK_M]).load(cfg.col_layout)  # landed with Q, read while Sᵀ runs
    mbarrier.wait(bufs.do_ready.index(slot), phase)
    dpt_tok = warpgroup_mma(keys.v_tile, do_tile.permute((1, 0)), keys.s_zero, use_acc=False, is_async=True)
    if cfg.ROW_STATS_TMA:
        delta_raw = bufs.delta_smem.index(slot).reshape([BLOCK_M]).load(cfg.col_layout)
    lse2, delta = _row_stats(lse_raw, delta_raw, q_in, EXACT_DELTA=cfg.EXACT_DELTA, EVEN_L=cfg.EVEN_L)
    st = warpgroup_mma_wait(num_outstanding=1, deps=(st_tok, ))
    if cfg.SOFTCAP:
        # tᵀ before the mask, as the forward takes it, and its slope while every score is finite.
        st = softcap_tanh(st * prob.tanh_scale)
        slope = softcap_slope(st)
        qk_scale = prob.softcap_log2
    else:
        qk_scale = prob.qk_scale
    st = _mask_scores(cfg, prob, st, key_ids, q_ids, keys.k0, m)
    if cfg.HAS_KEY_BIAS:
        pt = gl.exp2((st * qk_scale + gl.expand_dims(key_bias, 1)) - gl.expand_dims(lse2, 0))
    else:
        pt = gl.exp2(st * qk_scale - gl.expand_dims(lse2, 0))
    if cfg.EXACT_DELTA:
        pt = _rounded(pt, dtype=cfg.dtype)  # P̃, as the forward rounded it; dS takes the same values
    pt_op = gl.convert_layout(pt.to(cfg.dtype), cfg.a_layout)
    if cfg.SOFTCAP:
        # dUᵀ = Pᵀ∘gᵀ∘(dPᵀ - Δ): g <= 1, so fp16's bound on |dS| (EXACT_DELTA's ds_up) holds for it.
        pt = pt * slope
    return pt, pt_op, dpt_tok, delta, q_tile, do_tile, row_base, st_tok


@gluon.jit
def _mask_scores(cfg, prob, st, key_ids, q_ids, k0, m):
    """Sᵀ with the invisible scores at -inf. Masking binds where some key of this consumer lies past
    S (the zero keys TMA filled in score 0, and exp2(0 - lse2) need not be small) or outside some
    row's band: above its diagonal (IS_CAUSAL) or left of its window (WINDOW_LEFT)."""
    KC: gl.constexpr = cfg.KC
    if cfg.IS_CAUSAL:
        needs_mask = (m + prob.causal_offset < k0 + KC - 1) | (k0 + KC > prob.S)
    else:
        needs_mask = k0 + KC > prob.S
    if cfg.WINDOW_LEFT:
        needs_mask = needs_mask | (k0 < m + cfg.BLOCK_M - 1 + prob.window_lower)
    if needs_mask:
        visible = gl.expand_dims(key_ids < prob.S, 1)
        if cfg.IS_CAUSAL:
            visible = visible & (gl.expand_dims(key_ids, 1) <= gl.expand_dims(q_ids, 0) + prob.causal_offset)
        if cfg.WINDOW_LEFT:
            visible = visible & (gl.expand_dims(key_ids, 1) >= gl.expand_dims(q_ids, 0) + prob.window_lower)
        st = gl.where(visible, st, float("-inf"))
    return st


@gluon.jit
def _tile_mmas(cfg, bufs, keys, t, slot, pt, pt_op, dpt_tok, delta, q_tile, do_tile, dv, dk, st_tok, next_t,
               CONSUMER: gl.constexpr, ISSUE_NEXT: gl.constexpr):
    """dV += Pᵀ·dO, dSᵀ, dK += dSᵀ·Q and the tile's dQ = dS·K, waited for (under ISSUE_NEXT with the
    next tile's Sᵀ issued first); the tile's ring slot released. Returns (dv, dk, dq, st_tok)."""
    KC: gl.constexpr = cfg.KC
    # dV += Pᵀ·dO runs while dSᵀ is formed (wgmma groups retire in issue order, so one
    # outstanding after dPᵀ's wait means dPᵀ is done, dV may not be).
    dv_tok = warpgroup_mma(pt_op, do_tile, dv, is_async=True)
    dpt = warpgroup_mma_wait(num_outstanding=1, deps=(dpt_tok, ))
    if cfg.EXACT_DELTA:
        # One FFMA per score, dP·ds_up - Δ·ds_up; a power of two commutes with the rounding.
        dst = pt * (dpt * keys.ds_up - gl.expand_dims(delta * keys.ds_up, 0))
    else:
        dst = pt * (dpt - gl.expand_dims(delta, 0))
    dst16 = dst.to(cfg.dtype)
    ds_op = gl.convert_layout(dst16, cfg.a_layout)
    dk_tok = warpgroup_mma(ds_op, q_tile, dk, is_async=True)
    if cfg.DQ_SPLIT:
        # Double-buffered by tile parity: a consumer reaches tile t + 2's store only after the
        # other has arrived for tile t + 1, i.e. after its dQ GEMM of tile t retired.
        ds = bufs.ds_ring
        buf = bufs.ds_smem.index(ds.slot(t))
        buf.slice(CONSUMER * KC, KC, dim=0).store(dst16)
        fence_async_shared()
        mbarrier.arrive(ds.ready.index(ds.slot(t)), count=1)
        ds.wait_ready_at(ds.slot(t), t)
        dq_tok = warpgroup_mma(buf.permute((1, 0)), keys.k_all, keys.dq_zero, use_acc=False, is_async=True)
    else:
        buf = bufs.ds_smem.index(CONSUMER)
        buf.store(dst16)
        fence_async_shared()
        dq_tok = warpgroup_mma(buf.permute((1, 0)), keys.kq_tile, keys.dq_zero, use_acc=False, is_async=True)
    if ISSUE_NEXT:
        # The next tile's Sᵀ goes to the tensor cores before this tile's GEMMs are waited for, so
        # that it runs under this tile's dQ epilogue. In straight-line code only: a token carried
        # over the loop's back edge makes ptxas serialise every wgmma (tools/wgmma_overlap_probe.py).
        next_slot = bufs.ring.slot(next_t)
        bufs.ring.wait_ready_at(next_slot, next_t)
        st_tok = warpgroup_mma(keys.k_tile,
                               bufs.q_smem.index(next_slot).reshape([cfg.BLOCK_M, cfg.HEAD_DIM]).permute((1, 0)),
                               keys.s_zero, use_acc=False, is_async=True)
        dv, dk, dq, pt_op, ds_op = warpgroup_mma_wait(num_outstanding=1, deps=(dv_tok, dk_tok, dq_tok, pt_op, ds_op))
    else:
        # pt_op/ds_op stay in deps so their registers are not reused under the running wgmma.
        dv, dk, dq, pt_op, ds_op = warpgroup_mma_wait(num_outstanding=0, deps=(dv_tok, dk_tok, dq_tok, pt_op, ds_op))
    bufs.ring.release(slot)
    return dv, dk, dq, st_tok
