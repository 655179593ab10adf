"""The backward's tile loops: one query head's query tiles into a key tile's dK and dV
(``_dkdv_tiles``), and key tiles into a query tile's dQ (``_dq_tiles``). The passes that call
them, their numerics and the symbols are in ``attn_bwd.py``; the block-sparse switches in
``block_sparse.py``.

Constexpr switches besides attn_bwd.py's (SOFTCAP among them: dS meets Q and K times the cap's
slope): FROM_LIST (walk ``listed[0][lo:hi]``, a block-sparse
layout's tile list, instead of the tiles [lo, hi)), LAYOUT_CHECK (in checked tiles, also test the
layout per element: ``block_sparse.layout_visible``), LAYOUT_BQ / LAYOUT_BK (its block sizes).
"""

import triton
import triton.language as tl

from .block_sparse import layout_visible
from .common import base2_scores, dropout_keep, loop_tile, mask_scores, softcap_slope
from .ds_scaling import _accumulate_ds_dot, _ds_scores, _ds_tile, _ds_unscale
from .tile_loads import load_rows, load_tile_pair


@triton.jit
def _dkdv_tiles(
    dk, dv, key_block, q_base, do_base, mask_base, row_bases, row_pointers, DMASK, dropout, ds_up,
    offs_m_base, offs_e, offs_ev, lo, hi, q_strides, do_strides, mask_strides, listed,
    L, S, causal_offset, window_lower, score_scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    IS_CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr, P_IN_FP32: tl.constexpr, DS_IN_FP32: tl.constexpr,
    DS_RESCALE: tl.constexpr,
    RESCALE: tl.constexpr, CHECK: tl.constexpr, WRITE_DMASK: tl.constexpr, FP32_DOT: tl.constexpr,
    SHIFT: tl.constexpr, EVEN_M: tl.constexpr, EVEN_E: tl.constexpr, BLOCK_M: tl.constexpr,
    FROM_LIST: tl.constexpr = False, LAYOUT_CHECK: tl.constexpr = False,
    LAYOUT_BQ: tl.constexpr = 1, LAYOUT_BK: tl.constexpr = 1, SOFTCAP: tl.constexpr = False,
):
    """Fold query blocks [lo, hi) of one query head into this key block's (dk, dv); dk in units of
    1 / ds_up under DS_RESCALE's plain loop. Without SHIFT every row's shift is known to be 0;
    EVEN_M (L a multiple of BLOCK_M) and EVEN_E (head dims at their padded widths) drop the load
    masks that cannot bind."""
    k, v, offs_n, kv_rows_ok = key_block
    ROW_REF, ROW_SHIFT, DELTA = row_pointers
    seed, keep_scale, dropout_p = dropout
    _, _, stride_mm, stride_mn = mask_strides
    for it in range(lo, hi, 1 if FROM_LIST else BLOCK_M):
        offs_m, q_rows_ok = loop_tile(it, listed, offs_m_base, L, BLOCK=BLOCK_M, FROM_LIST=FROM_LIST)
        q, do = load_tile_pair(q_base, do_base, offs_m, q_rows_ok, offs_e, offs_ev, q_strides, do_strides,
                               HEAD_DIM=HEAD_DIM, HEAD_DIM_V=HEAD_DIM_V, EVEN_ROWS=EVEN_M, EVEN_COLS=EVEN_E)
        row_ids = row_bases[0] + offs_m  # the flat row vectors' rows
        rng_rows = row_bases[1] + offs_m  # the dropout counter's
        row_ref = load_rows(ROW_REF + row_ids, q_rows_ok, float("inf"), EVEN_ROWS=EVEN_M)
        delta = load_rows(DELTA + row_ids, q_rows_ok, 0.0, EVEN_ROWS=EVEN_M)

        # Transposed tiles (keys x queries) so dK and dV come out of the dots directly.
        s2_t = base2_scores(tl.dot(k, tl.trans(q), input_precision=FP32_DOT), score_scale, SOFTCAP=SOFTCAP)
        if SOFTCAP:
            slope_t = softcap_slope(s2_t, score_scale)  # before the mask: finite everywhere
        s2_t = mask_scores(s2_t, mask_base, offs_m[None, :], offs_n[:, None], kv_rows_ok[:, None] & q_rows_ok[None, :],
                           stride_mm, stride_mn, causal_offset, window_lower,
                           HAS_MASK=HAS_MASK, MASK_IS_BOOL=MASK_IS_BOOL, IS_CAUSAL=IS_CAUSAL,
                           WINDOW_LEFT=WINDOW_LEFT, CHECK=CHECK)
        if LAYOUT_CHECK:  # a tile that straddles computed and skipped layout blocks
            map_base, stride_bmm, stride_bmn = listed[1], listed[2], listed[3]
            s2_t = tl.where(layout_visible(map_base, stride_bmm, stride_bmn, offs_m[None, :], offs_n[:, None],
                                           kv_rows_ok[:, None] & q_rows_ok[None, :],
                                           LAYOUT_BQ=LAYOUT_BQ, LAYOUT_BK=LAYOUT_BK), s2_t, float("-inf"))
        if SHIFT:
            row_shift = load_rows(ROW_SHIFT + row_ids, q_rows_ok, 0.0, EVEN_ROWS=EVEN_M)
            p_t = tl.math.exp2((s2_t - row_ref[None, :]) - row_shift[None, :])
        else:
            p_t = tl.math.exp2(s2_t - row_ref[None, :])

        dp_t = tl.dot(v, tl.trans(do), input_precision=FP32_DOT)
        p_used_t = p_t
        if HAS_DROPOUT:
            keep = dropout_keep(seed, rng_rows[None, :], offs_n[:, None], S, dropout_p)
            p_used_t = tl.where(keep, p_t * keep_scale, 0.0)
            dp_t = tl.where(keep, dp_t * keep_scale, 0.0)
        if P_IN_FP32:
            dv = tl.dot(p_used_t, do.to(tl.float32), dv, input_precision=FP32_DOT)
        else:
            dv = tl.dot(p_used_t.to(do.dtype), do, dv, input_precision=FP32_DOT)
        ds_t = _ds_scores(p_t, dp_t, delta[None, :], ds_up, DS_RESCALE=DS_RESCALE, RESCALE=RESCALE)
        if WRITE_DMASK:
            # dL/d(additive mask) is dS itself; DMASK is a dense (B*Hq, L, S) fp32 buffer. Written
            # here under exact Δ: the dQ pass knows a row's correction only after its last tile.
            tl.store(DMASK + row_ids[None, :] * S + offs_n[:, None],
                     ds_t * _ds_unscale(ds_up, DS_RESCALE=DS_RESCALE, RESCALE=RESCALE),
                     mask=kv_rows_ok[:, None] & q_rows_ok[None, :])
        if SOFTCAP:
            ds_t = ds_t * slope_t  # the gradient of the scaled products (the mask's, above, is dS)
        ds_tile, ds_factor = _ds_tile(ds_t, q.dtype, ds_up, DS_IN_FP32=DS_IN_FP32, DS_RESCALE=DS_RESCALE,
                                      RESCALE=RESCALE)
        dk = _accumulate_ds_dot(dk, ds_tile, ds_factor, q, RESCALE=RESCALE, FP32_DOT=FP32_DOT)
    return dk, dv


@triton.jit
def _dq_tiles(
    dq, exact_sums, query_block, row_values, k_base, v_base, mask_base, dropout, ds_up, DMASK,
    offs_n_base, offs_e, offs_ev, lo, hi, k_strides, v_strides, mask_strides, listed,
    S, causal_offset, window_lower, score_scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    IS_CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr, P_IN_FP32: tl.constexpr, DS_IN_FP32: tl.constexpr,
    DS_RESCALE: tl.constexpr,
    RESCALE: tl.constexpr, CHECK: tl.constexpr, EXACT_DELTA: tl.constexpr,
    WRITE_DMASK: tl.constexpr, FP32_DOT: tl.constexpr, EVEN_N: tl.constexpr, EVEN_E: tl.constexpr,
    BLOCK_N: tl.constexpr, FROM_LIST: tl.constexpr = False, LAYOUT_CHECK: tl.constexpr = False,
    LAYOUT_BQ: tl.constexpr = 1, LAYOUT_BK: tl.constexpr = 1, SOFTCAP: tl.constexpr = False,
):
    """Fold key blocks [lo, hi) into this query block's dq (and, under exact Δ, σ, σ̃, Λ, K̄); dq in
    units of 1 / ds_up under DS_RESCALE's plain loop, the rest in dS's own, and all of them in units
    of 1 / row_scale: the loop leaves out each row's shift (see _attn_bwd_dq)."""
    ds_sum, ds_seen_sum, p_sum, p_k, ds_slope_sum, p_slope_sum = exact_sums
    q, do, offs_m, q_rows_ok, row_ids, rng_rows = query_block
    row_ref, row_scale, delta = row_values
    seed, keep_scale, dropout_p = dropout
    _, _, stride_mm, stride_mn = mask_strides
    for it in range(lo, hi, 1 if FROM_LIST else BLOCK_N):
        offs_n, kv_rows_ok = loop_tile(it, listed, offs_n_base, S, BLOCK=BLOCK_N, FROM_LIST=FROM_LIST)
        k, v = load_tile_pair(k_base, v_base, offs_n, kv_rows_ok, offs_e, offs_ev, k_strides, v_strides,
                              HEAD_DIM=HEAD_DIM, HEAD_DIM_V=HEAD_DIM_V, EVEN_ROWS=EVEN_N, EVEN_COLS=EVEN_E)
        s2 = base2_scores(tl.dot(q, tl.trans(k), input_precision=FP32_DOT), score_scale, SOFTCAP=SOFTCAP)
        if SOFTCAP:
            slope = softcap_slope(s2, score_scale)  # before the mask: finite everywhere
        tile_ok = q_rows_ok[:, None] & kv_rows_ok[None, :]
        s2 = mask_scores(s2, mask_base, offs_m[:, None], offs_n[None, :], tile_ok, stride_mm, stride_mn, causal_offset,
                         window_lower,
                         HAS_MASK=HAS_MASK, MASK_IS_BOOL=MASK_IS_BOOL, IS_CAUSAL=IS_CAUSAL, WINDOW_LEFT=WINDOW_LEFT,
                         CHECK=CHECK)
        if LAYOUT_CHECK:  # a tile that straddles computed and skipped layout blocks
            map_base, stride_bmm, stride_bmn = listed[1], listed[2], listed[3]
            s2 = tl.where(layout_visible(map_base, stride_bmm, stride_bmn, offs_m[:, None], offs_n[None, :], tile_ok,
                                         LAYOUT_BQ=LAYOUT_BQ, LAYOUT_BK=LAYOUT_BK), s2, float("-inf"))
        p = tl.math.exp2(s2 - row_ref[:, None])  # P / row_scale
        dp = tl.dot(do, tl.trans(v), input_precision=FP32_DOT)
        if HAS_DROPOUT:
            keep = dropout_keep(seed, rng_rows[:, None], offs_n[None, :], S, dropout_p)
            dp = tl.where(keep, dp * keep_scale, 0.0)
        ds = _ds_scores(p, dp, delta[:, None], ds_up, DS_RESCALE=DS_RESCALE, RESCALE=RESCALE)
        if WRITE_DMASK:
            # dL/d(additive mask) is dS itself; DMASK is a dense (B*Hq, L, S) fp32 buffer. Only
            # without exact Δ: with it, this dS still lacks the row's correction (see the dK/dV pass).
            tl.store(DMASK + row_ids[:, None] * S + offs_n[None, :],
                     ds * (row_scale * _ds_unscale(ds_up, DS_RESCALE=DS_RESCALE, RESCALE=RESCALE))[:, None],
                     mask=tile_ok)
        ds_products = ds  # the gradient of the scaled products: dS, times the slope under SOFTCAP
        if SOFTCAP:
            ds_products = ds * slope
        ds_tile, ds_factor = _ds_tile(ds_products, k.dtype, ds_up, DS_IN_FP32=DS_IN_FP32, DS_RESCALE=DS_RESCALE,
                                      RESCALE=RESCALE)
        dq = _accumulate_ds_dot(dq, ds_tile, ds_factor, k, RESCALE=RESCALE, FP32_DOT=FP32_DOT)
        if EXACT_DELTA:
            # σ from the fp32 dS gives the dK/dV pass its Δ; σ̃ from dS as the dot above saw it
            # (rounded; ds_factor brings a scaled-up tile back to dS's units) corrects dq, so that
            # the rounding's common part goes too (see the module docstring). P is rounded for P·K
            # as for Pᵀ·dO: K̄ only multiplies corrections of order u, so its own rounding enters
            # at second order.
            ds_sum += tl.sum(ds, 1) * _ds_unscale(ds_up, DS_RESCALE=DS_RESCALE, RESCALE=RESCALE)
            # σ̃ by fp32 adds. Summing the 16-bit tile on the matrix unit instead (its product with
            # a ones column) saved ~100 instructions per tile, but on Triton 3.6 / sm_90 that extra
            # small wgmma made the compiled kernel fault (out-of-range shared address) when
            # S == 1 is specialised into it, at 64x64 tiles with 4 warps (H200, 2026-12-01:
            # benchmarks/experiments/backward_fault_repro.py).
            ds_seen_sum += tl.sum(ds_tile.to(tl.float32), 1) * ds_factor
            p_sum += tl.sum(p, 1)
            p_weights = p  # K̄'s weights: P, times the slope under SOFTCAP (attn_bwd.py, "Soft cap")
            if SOFTCAP:
                p_weights = p * slope
                ds_slope_sum += tl.sum(ds_products, 1) * _ds_unscale(ds_up, DS_RESCALE=DS_RESCALE, RESCALE=RESCALE)
                p_slope_sum += tl.sum(p_weights, 1)
            if P_IN_FP32:
                p_k = tl.dot(p_weights, k.to(tl.float32), p_k, input_precision=FP32_DOT)
            else:
                p_k = tl.dot(p_weights.to(k.dtype), k, p_k, input_precision=FP32_DOT)
    return dq, (ds_sum, ds_seen_sum, p_sum, p_k, ds_slope_sum, p_slope_sum)
