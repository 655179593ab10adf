"""Hopper (sm_90) attention forward in Gluon: TMA + mbarrier ring, a loader warp, and
warpgroup-MMA consumer warpgroups.

Glossary
--------
Symbols (per consumer warpgroup, which owns BLOCK_M query rows of one (batch, head)):
  s        S = Q·Kᵀ for one key tile, fp32 straight out of wgmma, *unscaled*.
  qk_scale softmax scale · log2(e), an fp32 scalar. Scores in base 2 are ``s * qk_scale``;
           the product is never rounded to 16 bits (exp2's argument is one FFMA per score).
  m_i      running row max of the base-2 scores (fp32), -inf until a visible key is seen.
  m_ref    m_i with -inf replaced by 0: what the exponentials subtract, so a row that has
           seen only invisible keys computes exp2(-inf - 0) = 0 and never -inf - (-inf).
  alpha    exp2(m_old - m_ref), the factor that moves acc and l_i onto the new max.
  l_i      running row sum of exp2(s·qk_scale - m_ref) (fp32), taken on the fp32 P before it
           is rounded, so the normaliser is the exact sum of what the softmax means.
  p        P = exp2(s·qk_scale - m_ref), rounded to the input dtype for P·V.
  acc      O accumulator (fp32, wgmma register accumulator), unnormalised.
  LSE      (m_i + log2 l_i) is the log-sum-exp in base 2; it is stored times ln 2, i.e. in
           natural log, the convention of ``launch.attention_forward`` (B, H, L) fp32.
           A row that saw no visible key has l_i = 0: output 0 and LSE -inf (guarded 1/l).
  Under EXACT_DELTA (the `stable` schedule's one-pass exact Δ, docs/hopper_backward.md):
  m_i      an integer: the ceiling of the row max, so alpha is a power of two and rescaling P
           commutes with its rounding; round(exp2(x - m)) then does not depend on which tile
           set m, and the backward can recompute the very values P·V used.
  l_rnd    the sum of P *as rounded*, so acc / l_rnd is the exact average of V under the weights
           P·V used; summed by a wgmma of P against a (keys, 8) ones tile beside P·V (l_acc),
           with no ALU work per score. O is acc / l_rnd; the LSE keeps l_i, the fp32 sum, so
           its accuracy is fp32's as under the other schedules.
  resid    O's rounding residual round(acc / l_rnd - O), stored beside O: O + resid is that
           average to about 16 bits more than O alone, which is what Δ = dO·(O + resid) needs.
  pivot    the backward's row constants, (B, H, L) planes of ROW_CONSTS: c = m_i + floor(log2 l_rnd)
           (an integer, +inf for a row with no key) and g = exp2(c - m_i) / l_rnd (0 there): the
           backward's P is g · round(exp2(s·qk_scale - c)), whatever the rounding of g.

Constexpr switches:
  HEAD_DIM      E, the head dim of Q, K and V (64 or 128; one TMA box covers it).
  BLOCK_M       query rows per consumer warpgroup (64: one m64 wgmma row block).
  BLOCK_N       keys per tile (the N of Q·Kᵀ and the K of P·V).
  NUM_STAGES    depth of the K/V shared-memory ring the loader fills ahead of the consumers.
  NUM_CONSUMERS consumer warpgroups per CTA; the CTA owns NUM_CONSUMERS·BLOCK_M query rows and
                every consumer reads every K/V tile of the ring (so K/V are loaded once per CTA).
  IS_CAUSAL     key j is visible to query i iff j <= i + causal_offset (0: top-left, SDPA's).
  WINDOW_LEFT   a sliding window's left side (launch/band.py): key j is visible to query i only
                if also j >= i + window_lower. The CTA's loop starts at the first key tile its top
                row can see, so tiles wholly left of the band are never loaded.
  EXACT_DELTA   the integer max, the rounded sum, and the residual and row constants above.
  HAS_KEY_BIAS  a key mask, one value per key (``launch.hopper.key_bias``): KEY_BIAS is (B, H, S)
                fp32 in base 2 (0 to attend, -inf to hide, an additive mask times log2 e), added
                to each tile's scaled scores; a mask that varies along the queries never gets here.
  PINGPONG      the consumers take turns issuing their MMAs (a token passed round-robin through
                mbarriers, FA3's warp scheduler barrier), so one warpgroup's softmax runs while
                the next one's GEMMs own the tensor cores, rather than all contending at once.
  SKIP_MASKED_TILES a consumer computes only the ring's tiles its own rows can see: under causal
                masking it stops at its own last visible key tile rather than the CTA's (the
                192-row E 64 CTA's first consumers otherwise compute one or two wholly masked
                tiles a block), and under a window's left side it starts at its own first one
                (the CTA's loop starts at its top row's). Masked tiles' p is exactly 0, so the
                results are bitwise the same; the skipped tiles' turns are still taken and their
                ring slots released, so the loader's and the other consumers' protocol is unchanged.
  PERSISTENT    one CTA per SM (a 1-D grid), each computing query blocks (work items, indexed as
                the grid's CTAs would be) one after another: its own index first, then the next
                unclaimed one from WORK_COUNTER, so the order is kept whichever CTA is free first.
                The loader hands each item to the consumers through a two-deep ring (item_smem,
                item_ready/item_empty); a consumer frees its Q tile (q_empty) once the item's last
                Q·Kᵀ has retired, and stages O in a tile of its own (o_smem), so the next item's Q
                and K/V tiles load during the epilogue. The K/V ring and the ping-pong rounds count
                on across items (``_consume_block``'s base and it).
  HAS_BLOCK_SPARSITY a block-sparse layout (``launch/block_tiles.py``): each block walks the key tiles
                listed for it, TILE_LISTS[b, h, block] = (count, tile, tile, ...) in ascending order,
                rather than a contiguous range. The launcher takes only layouts whose blocks hold
                whole CTA blocks and key tiles, so a listed tile is computed everywhere and the
                select needs only the band and S, by position, as a dense tile does. A block with no
                listed tile runs one tile with S taken as 0 (all masked: output 0, LSE -inf).
  swizzle_heads the grid order (``_block_coords``): CTAs walk the (batch, head)s in groups of
                this many, query block by query block within a group (longest first under causal
                masking). 1: each head's blocks together; B·H: every head's longest block first.

Schedule (per consumer, FA3's intra-warpgroup overlap): the Q·Kᵀ of tile j is issued before
the P·V of tile j-1, so the softmax of tile j runs while the tensor cores finish P·V of j-1;
the consumers are independent partitions, so one warpgroup's softmax also overlaps the other's
MMAs. Tiles between the band's edges (below the causal diagonal, right of the window's left
side) and inside S skip the visibility select.
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

from .grid_order import ordered_cell

LN2 = gl.constexpr(0.6931471805599453)


@gluon.jit
def _tile_range(row0, S, causal_offset, window_lower, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                IS_CAUSAL: gl.constexpr, WINDOW_LEFT: gl.constexpr):
    """The key tiles rows [row0, row0 + ROWS) visit: (first tile, tile count, n_full, lo_full).
    Tiles lo_full <= j < n_full are wholly visible to every one of those rows (no select).

    At least one tile is visited, so a block whose rows see no key still runs the loop once and
    leaves l_i = 0 (output 0, LSE -inf) instead of an unwritten output."""
    if IS_CAUSAL:
        hi = gl.minimum(S, row0 + ROWS + causal_offset)
        n_full = gl.minimum(row0 + causal_offset + 1, S) // BLOCK_N
    else:
        hi = S
        n_full = S // BLOCK_N
    end = gl.cdiv(gl.maximum(hi, 1), BLOCK_N)
    lo = 0
    lo_full = 0
    if WINDOW_LEFT:
        # The top row's left side gives the first tile; the bottom row's, the first tile that
        # every row sees from its first key on.
        lo = gl.minimum(gl.maximum(row0 + window_lower, 0) // BLOCK_N, end - 1)
        lo_full = gl.cdiv(gl.maximum(row0 + ROWS - 1 + window_lower, 0), BLOCK_N)
    return lo, end - lo, gl.maximum(n_full, 0), lo_full


@gluon.jit
def _listed_range(TILE_LISTS, b, h, start_m, S, stride_lb, stride_lh, list_stride, ROWS: gl.constexpr):
    """(tile count, the list of tiles, S as the block sees it) of the block at (start_m, b, h) under
    HAS_BLOCK_SPARSITY: at least one tile, and S taken as 0 where none is listed, so that the one
    tile run (the list's first entry, a skipped one) is wholly masked."""
    row = TILE_LISTS + b.to(gl.int64) * stride_lb + h * stride_lh + (start_m // ROWS) * list_stride
    count = gl.load(row)
    return gl.maximum(count, 1), row + 1, gl.where(count > 0, S, 0)


@gluon.jit
def _key_tile(lo, t, tiles, HAS_BLOCK_SPARSITY: gl.constexpr):
    """The key tile of a block's t-th ring tile: lo + t, or under HAS_BLOCK_SPARSITY the t-th listed."""
    if HAS_BLOCK_SPARSITY:
        return gl.load(tiles + t)
    else:
        return lo + t


@gluon.jit
def _hopper_fwd_loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem,
                       q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, item_smem, item_ready, item_empty,
                       WORK_COUNTER, BH, L, S, H, GROUP, causal_offset, window_lower,
                       TILE_LISTS, stride_lb, stride_lh, list_stride,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                       NUM_CONSUMERS: gl.constexpr, IS_CAUSAL: gl.constexpr, WINDOW_LEFT: gl.constexpr,
                       PERSISTENT: gl.constexpr, HAS_BLOCK_SPARSITY: gl.constexpr, swizzle_heads):
    """One warp: Q once per consumer, then K/V tiles into the ring as slots free up; under
    PERSISTENT, item after item, each handed to the consumers before its loads."""
    ROWS: gl.constexpr = BLOCK_M * NUM_CONSUMERS
    if PERSISTENT:
        blocks = gl.cdiv(L, ROWS)
        num_items = blocks * BH
        item = gl.program_id(0)
        it = 0
        base = 0  # ring tiles loaded for earlier items
        while item < num_items:
            # The next item is claimed now, so the atomic's latency hides under this item's loads.
            next_item = gl.num_programs(0) + gl.atomic_add(WORK_COUNTER, 1)
            _hand_item(item, it, item_smem, item_ready, item_empty)
            start_m, b, h = _item_coords(item, blocks, BH, H, swizzle_heads, ROWS, IS_CAUSAL)
            n_tiles = _load_block(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready,
                                 k_empty, v_empty, start_m, b, h, it, base, S, GROUP, causal_offset, window_lower,
                                 TILE_LISTS, stride_lb, stride_lh, list_stride, BLOCK_M, BLOCK_N, NUM_STAGES,
                                 NUM_CONSUMERS, IS_CAUSAL, WINDOW_LEFT, PERSISTENT, HAS_BLOCK_SPARSITY)
            base += n_tiles
            it += 1
            item = next_item
        # The consumers stop at an item past the last.
        _hand_item(item, it, item_smem, item_ready, item_empty)
    else:
        start_m, b, h = _block_coords(H, swizzle_heads, ROWS, IS_CAUSAL)
        _load_block(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready,
                   k_empty, v_empty, start_m, b, h, 0, 0, S, GROUP, causal_offset, window_lower,
                   TILE_LISTS, stride_lb, stride_lh, list_stride, BLOCK_M, BLOCK_N, NUM_STAGES, NUM_CONSUMERS,
                   IS_CAUSAL, WINDOW_LEFT, PERSISTENT, HAS_BLOCK_SPARSITY)


@gluon.jit
def _hand_item(item, it, item_smem, item_ready, item_empty):
    """Publish work item ``item`` (the loader's it-th) in its slot of the two-deep item ring."""
    slot = it % 2
    mbarrier.wait(item_empty.index(slot), ((it // 2) & 1) ^ 1)
    item_smem.index(slot).store(gl.full([1], item, gl.int32, layout=gl.BlockedLayout([1], [32], [1], [0])))
    mbarrier.arrive(item_ready.index(slot), count=1)


@gluon.jit
def _take_item(it, item_smem, item_ready, item_empty):
    """The consumers' side of ``_hand_item``: the it-th work item, its slot released."""
    slot = it % 2
    mbarrier.wait(item_ready.index(slot), (it // 2) & 1)
    item = gl.max(item_smem.index(slot).load(gl.BlockedLayout([1], [32], [4], [0])), 0)
    mbarrier.arrive(item_empty.index(slot), count=1)
    return item


@gluon.jit
def _load_block(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready,
               k_empty, v_empty, start_m, b, h, it, base, S, GROUP, causal_offset, window_lower,
               TILE_LISTS, stride_lb, stride_lh, list_stride, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr, IS_CAUSAL: gl.constexpr,
               WINDOW_LEFT: gl.constexpr, PERSISTENT: gl.constexpr, HAS_BLOCK_SPARSITY: gl.constexpr):
    """The loads of one block (the CTA's it-th; ``base`` ring tiles before it). Returns its tile count."""
    ROWS: gl.constexpr = BLOCK_M * NUM_CONSUMERS
    h_kv = h // GROUP  # grouped-query attention: K/V heads are indexed, never repeated
    for c in gl.static_range(NUM_CONSUMERS):
        if PERSISTENT:
            # Consumer c frees its Q tile once the item's last Q·Kᵀ has retired.
            mbarrier.wait(q_empty.index(c), (it & 1) ^ 1)
        mbarrier.expect(q_ready.index(c), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, h, start_m + c * BLOCK_M, 0], q_ready.index(c), q_smem.index(c))
    lo, n_tiles, _, _ = _tile_range(start_m, S, causal_offset, window_lower, ROWS, BLOCK_N, IS_CAUSAL, WINDOW_LEFT)
    if HAS_BLOCK_SPARSITY:
        n_tiles, tiles, _ = _listed_range(TILE_LISTS, b, h, start_m, S, stride_lb, stride_lh, list_stride, ROWS)
    else:
        tiles = TILE_LISTS  # not read
    # t counts the item's ring tiles from 0; the key tile it holds is lo + t (or the t-th listed),
    # its ring index base + t.
    for t in range(n_tiles):
        slot = (base + t) % NUM_STAGES
        key0 = _key_tile(lo, t, tiles, HAS_BLOCK_SPARSITY) * BLOCK_N
        # A fresh mbarrier counts as having completed the phase before phase 0, so the first
        # pass over the ring waits on parity 1 and goes straight through.
        empty_phase = (((base + t) // NUM_STAGES) & 1) ^ 1
        mbarrier.wait(k_empty.index(slot), empty_phase)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, h_kv, key0, 0], k_ready.index(slot), k_smem.index(slot))
        # V has its own barriers so Q·Kᵀ can start before V lands.
        mbarrier.wait(v_empty.index(slot), empty_phase)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [b, h_kv, key0, 0], v_ready.index(slot), v_smem.index(slot))
    return n_tiles


@gluon.jit
def _block_coords(H, swizzle_heads, ROWS: gl.constexpr, IS_CAUSAL: gl.constexpr):
    """(first query row, batch, head) of this CTA: the grid is (query blocks, B·H), walked in the
    order ``swizzle_heads`` sets (``grid_order.py``). Causal blocks run in reverse row order, so
    each group's longest (bottom) blocks start first and short ones fill the tail."""
    blocks = gl.num_programs(0)
    return _item_coords(gl.program_id(1) * blocks + gl.program_id(0), blocks, gl.num_programs(1), H, swizzle_heads,
                        ROWS, IS_CAUSAL)


@gluon.jit
def _item_coords(item, blocks, BH, H, swizzle_heads, ROWS: gl.constexpr, IS_CAUSAL: gl.constexpr):
    """``_block_coords`` of work item ``item`` (a CTA's linear index in the grid, or a persistent
    CTA's claimed block): the order ``swizzle_heads`` sets over (blocks, B·H)."""
    pid_m, bh = ordered_cell(item, blocks, BH, swizzle_heads)
    if IS_CAUSAL:
        pid_m = blocks - 1 - pid_m
    return pid_m * ROWS, bh // H, bh % H


@gluon.jit
def _softmax_step(s, m_i, l_i, qk_scale, bias, row_ids, j, n_full, lo_full, S, causal_offset, window_lower,
                  s_layout: gl.constexpr, BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr, WINDOW_LEFT: gl.constexpr,
                  dtype: gl.constexpr, EXACT_DELTA: gl.constexpr, HAS_KEY_BIAS: gl.constexpr):
    """Fold key tile j's unscaled scores into (m_i, l_i); returns (p, alpha, m_i, l_i), p in fp32.
    Under EXACT_DELTA p is already rounded to ``dtype`` (the rounded P's row sum is a wgmma
    against a ones tile beside P·V, ``_pv_issue``); l_i is the fp32 P's sum either way.
    ``bias``: the tile's key bias (base 2) under HAS_KEY_BIAS, else unused."""
    needs_select = j >= n_full
    if WINDOW_LEFT:
        needs_select = needs_select | (j < lo_full)
    if needs_select:
        # Diagonal, window-edge or ragged-tail tile: keys past S (zero rows that TMA filled in;
        # the 4-D descriptor clips per head, so they are never another head's keys) and keys
        # outside the band go to -inf.
        cols = gl.expand_dims(j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout)), 0)
        visible = cols < S
        if IS_CAUSAL:
            visible = visible & (cols <= gl.expand_dims(row_ids, 1) + causal_offset)
        if WINDOW_LEFT:
            visible = visible & (cols >= gl.expand_dims(row_ids, 1) + window_lower)
        s = gl.where(visible, s, float("-inf"))
    if HAS_KEY_BIAS:
        # Scaled scores plus the key bias, one FFMA per score. The one-pass backward forms its
        # scores in the same order (kernels/hopper_bwd.py), so its P rounds as this one does.
        s = s * qk_scale + gl.expand_dims(bias, 0)
        tile_max = gl.max(s, 1)
    else:
        # Max on the unscaled scores, scaled once: exact for qk_scale > 0 (x -> fl(c·x) is
        # monotonic), and exp2's argument below is then a single FFMA per score.
        tile_max = gl.max(s, 1) * qk_scale
    if EXACT_DELTA:
        tile_max = gl.ceil(tile_max)  # -inf stays -inf
    m_new = gl.maximum(m_i, tile_max)
    m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_ref)
    if HAS_KEY_BIAS:
        p = gl.exp2(s - gl.expand_dims(m_ref, 1))
    else:
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_ref, 1))
    l_i = l_i * alpha + gl.sum(p, 1)
    if EXACT_DELTA:
        p = p.to(dtype)
    return p, alpha, m_new, l_i


@gluon.jit
def _key_bias_tile(bias_row, key_offsets, j, S, BLOCK_N: gl.constexpr, HAS_KEY_BIAS: gl.constexpr):
    """Key tile j's bias (base 2, fp32) under HAS_KEY_BIAS, -inf past S; else 0 (not read)."""
    if HAS_KEY_BIAS:
        cols = j * BLOCK_N + key_offsets
        return gl.load(bias_row + cols, mask=cols < S, other=float("-inf"))
    else:
        return 0.0


@gluon.jit
def _pv_issue(p_op, v_tile, acc, ones_t, l_acc, EXACT_DELTA: gl.constexpr):
    """Issue P·V into acc and, under EXACT_DELTA, P·1 into l_acc (every column the row sum of
    P as rounded, at no ALU cost per score). Returns the tokens for ``_pv_wait``."""
    acc_tok = warpgroup_mma(p_op, v_tile, acc, is_async=True)
    if EXACT_DELTA:
        l_tok = warpgroup_mma(p_op, ones_t, l_acc, is_async=True)
    else:
        l_tok = acc_tok
    return acc_tok, l_tok


@gluon.jit
def _pv_wait(acc_tok, l_tok, p_op, EXACT_DELTA: gl.constexpr):
    """Wait for ``_pv_issue``'s MMAs; p_op stays in deps so its registers are not reused while
    they read it. Returns (acc, l_acc, p_op); l_acc is acc when not EXACT_DELTA."""
    if EXACT_DELTA:
        acc, l_acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, l_tok, p_op))
    else:
        acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, p_op))
        l_acc = acc
    return acc, l_acc, p_op


@gluon.jit
def _take_turn(turn, round, CONSUMER: gl.constexpr, PINGPONG: gl.constexpr):
    """Wait for this warpgroup's turn to issue MMAs in round ``round``. Consumer c waits on
    turn[c], which consumer c-1 arrives on after issuing; consumer 0 goes first (a fresh mbarrier
    passes a wait on parity 1) and thereafter waits for the last consumer's previous round."""
    if PINGPONG:
        if CONSUMER == 0:
            mbarrier.wait(turn.index(CONSUMER), (round & 1) ^ 1)
        else:
            mbarrier.wait(turn.index(CONSUMER), round & 1)


@gluon.jit
def _pass_turn(turn, CONSUMER: gl.constexpr, NUM_CONSUMERS: gl.constexpr, PINGPONG: gl.constexpr):
    if PINGPONG:
        mbarrier.arrive(turn.index((CONSUMER + 1) % NUM_CONSUMERS), count=1)


@gluon.jit
def _release_tile(turn, round, t, k_ready, v_ready, k_empty, v_empty, CONSUMER: gl.constexpr,
                  NUM_CONSUMERS: gl.constexpr, NUM_STAGES: gl.constexpr, PINGPONG: gl.constexpr):
    """Ring tile t (counted over the CTA's blocks), wholly masked for this warpgroup
    (SKIP_MASKED_TILES): take and pass its turn of ``round`` and release its K and V slots as if
    computed. A slot is released only once its tile has landed, so the release counts toward the
    round the loader filled (an early arrive could complete a later round's phase)."""
    slot = t % NUM_STAGES
    phase = (t // NUM_STAGES) & 1
    _take_turn(turn, round, CONSUMER, PINGPONG)
    _pass_turn(turn, CONSUMER, NUM_CONSUMERS, PINGPONG)
    mbarrier.wait(k_ready.index(slot), phase)
    mbarrier.arrive(k_empty.index(slot), count=1)
    mbarrier.wait(v_ready.index(slot), phase)
    mbarrier.arrive(v_empty.index(slot), count=1)


@gluon.jit
def _store_ones(ones_smem, CONSUMER: gl.constexpr, BLOCK_N: gl.constexpr, dtype: gl.constexpr):
    """This consumer's (8, keys) tile of ones, keys contiguous: the B operand (read transposed, K-major)
    of the rounded P's row sums under EXACT_DELTA. Written once per CTA."""
    ones_smem.index(CONSUMER).store(gl.full([8, BLOCK_N], 1.0, dtype,
                                            layout=gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])))
    fence_async_shared()


@gluon.jit
def _hopper_fwd_consumer(o_desc, r_desc, q_smem, o_smem, k_smem, v_smem, ones_smem,
                         q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, item_smem, item_ready, item_empty,
                         LSE, ROW_CONSTS, KEY_BIAS, BH, L, S, H, causal_offset, window_lower,
                         TILE_LISTS, stride_lb, stride_lh, list_stride,
                         qk_scale, turn, CONSUMER: gl.constexpr, HEAD_DIM: gl.constexpr,
                         BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                         NUM_CONSUMERS: gl.constexpr, IS_CAUSAL: gl.constexpr, WINDOW_LEFT: gl.constexpr,
                         PINGPONG: gl.constexpr, EXACT_DELTA: gl.constexpr, HAS_KEY_BIAS: gl.constexpr,
                         SKIP_MASKED_TILES: gl.constexpr, PERSISTENT: gl.constexpr,
                         HAS_BLOCK_SPARSITY: gl.constexpr, swizzle_heads):
    """One warpgroup: BLOCK_M query rows of the CTA's block (under PERSISTENT, of each block the
    loader hands over) against every key tile the loader brings."""
    ROWS: gl.constexpr = BLOCK_M * NUM_CONSUMERS
    dtype: gl.constexpr = o_desc.dtype
    if PERSISTENT:
        if EXACT_DELTA:
            _store_ones(ones_smem, CONSUMER, BLOCK_N, dtype)
        blocks = gl.cdiv(L, ROWS)
        it = 0
        base = 0  # ring tiles consumed for earlier items
        item = _take_item(0, item_smem, item_ready, item_empty)
        while item < blocks * BH:
            start_m, b, h = _item_coords(item, blocks, BH, H, swizzle_heads, ROWS, IS_CAUSAL)
            n_tiles = _consume_block(o_desc, r_desc, q_smem, o_smem, k_smem, v_smem, ones_smem, q_ready, q_empty,
                                     k_ready, v_ready, k_empty, v_empty, LSE, ROW_CONSTS, KEY_BIAS, BH, L, S, H,
                                     causal_offset, window_lower, TILE_LISTS, stride_lb, stride_lh, list_stride,
                                     qk_scale, turn, start_m, b, h, it, base, CONSUMER, HEAD_DIM, BLOCK_M, BLOCK_N,
                                     NUM_STAGES, NUM_CONSUMERS, IS_CAUSAL, WINDOW_LEFT, PINGPONG, EXACT_DELTA,
                                     HAS_KEY_BIAS, SKIP_MASKED_TILES, PERSISTENT, HAS_BLOCK_SPARSITY)
            base += n_tiles
            it += 1
            item = _take_item(it, item_smem, item_ready, item_empty)
    else:
        start_m, b, h = _block_coords(H, swizzle_heads, ROWS, IS_CAUSAL)
        _consume_block(o_desc, r_desc, q_smem, o_smem, k_smem, v_smem, ones_smem, q_ready, q_empty,
                       k_ready, v_ready, k_empty, v_empty, LSE, ROW_CONSTS, KEY_BIAS, BH, L, S, H,
                       causal_offset, window_lower, TILE_LISTS, stride_lb, stride_lh, list_stride, qk_scale, turn,
                       start_m, b, h, 0, 0, CONSUMER, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES, NUM_CONSUMERS,
                       IS_CAUSAL, WINDOW_LEFT, PINGPONG, EXACT_DELTA, HAS_KEY_BIAS, SKIP_MASKED_TILES, PERSISTENT,
                       HAS_BLOCK_SPARSITY)
    if PERSISTENT:
        tma.store_wait(pendings=0)  # the last block's stores


@gluon.jit
def _consume_block(o_desc, r_desc, q_smem, o_smem, k_smem, v_smem, ones_smem, q_ready, q_empty,
                   k_ready, v_ready, k_empty, v_empty, LSE, ROW_CONSTS, KEY_BIAS, BH, L, S, H,
                   causal_offset, window_lower, TILE_LISTS, stride_lb, stride_lh, list_stride, qk_scale, turn,
                   start_m, b, h, it, base, CONSUMER: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
                   IS_CAUSAL: gl.constexpr, WINDOW_LEFT: gl.constexpr, PINGPONG: gl.constexpr,
                   EXACT_DELTA: gl.constexpr, HAS_KEY_BIAS: gl.constexpr, SKIP_MASKED_TILES: gl.constexpr,
                   PERSISTENT: gl.constexpr, HAS_BLOCK_SPARSITY: gl.constexpr):
    """This warpgroup's rows of the block at (start_m, b, h), the CTA's it-th, whose first ring
    tile is the CTA's base-th: ring tile t sits at ring index base + t and issues in ping-pong
    round base + it + t (each block takes its tile count plus one rounds). Returns the tile count."""
    ROWS: gl.constexpr = BLOCK_M * NUM_CONSUMERS
    dtype: gl.constexpr = o_desc.dtype
    # wgmma accumulators: one m64 row block per warpgroup, N = the whole tile in one instruction.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    # P feeds P·V from registers: the QKᵀ accumulator's fragment is already the A-operand's.
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    rb = base + it  # the ping-pong round of ring tile t is rb + t

    row0 = start_m + CONSUMER * BLOCK_M
    row_ids = row0 + gl.arange(0, BLOCK_M, layout=row_layout)
    bias_row = KEY_BIAS + (b * H + h).to(gl.int64) * S  # read only under HAS_KEY_BIAS
    key_offsets = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    # Every consumer walks the CTA's tiles (the loader's): each ring slot then gets one release
    # from every consumer, and under PINGPONG every consumer takes the same number of turns.
    # Under causal masking the last tiles can lie wholly above this warpgroup's diagonal (and
    # under a window the first ones wholly left of its band); they are fully masked (p = 0),
    # which costs their MMAs but no special case. [lo_full, n_full) is this warpgroup's own
    # unmasked range.
    lo, n_tiles, _, _ = _tile_range(start_m, S, causal_offset, window_lower, ROWS, BLOCK_N, IS_CAUSAL, WINDOW_LEFT)
    if HAS_BLOCK_SPARSITY:
        # The listed tiles, in the loader's order; S as this block sees it (0 where none is listed).
        gl.static_assert(not SKIP_MASKED_TILES, "SKIP_MASKED_TILES walks contiguous key ranges")
        n_tiles, tiles, S = _listed_range(TILE_LISTS, b, h, start_m, S, stride_lb, stride_lh, list_stride, ROWS)
    else:
        tiles = TILE_LISTS  # not read
    own_lo, own_count, n_full, lo_full = _tile_range(row0, S, causal_offset, window_lower, BLOCK_M, BLOCK_N,
                                                     IS_CAUSAL, WINDOW_LEFT)
    if SKIP_MASKED_TILES and IS_CAUSAL:
        # The ring's tiles past this warpgroup's last visible one are only released (below).
        n_run = gl.maximum(gl.minimum(n_tiles, own_lo + own_count - lo), 1)
    else:
        n_run = n_tiles
    if SKIP_MASKED_TILES and WINDOW_LEFT:
        # The ring's tiles wholly left of this warpgroup's band: released, not computed.
        t0 = gl.minimum(gl.maximum(own_lo - lo, 0), n_run - 1)
    else:
        t0 = 0

    q_tile = q_smem.index(CONSUMER).reshape([BLOCK_M, HEAD_DIM])
    mbarrier.wait(q_ready.index(CONSUMER), it & 1)

    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_layout)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    if EXACT_DELTA:
        # l_acc: the rounded P's row sums, (BLOCK_M, 8) equal columns, rescaled with acc. The ones
        # (stored once per CTA) are read transposed: a K-major B operand.
        l_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, 8, 16])
        l_acc = gl.zeros([BLOCK_M, 8], gl.float32, layout=l_layout)
        if not PERSISTENT:
            _store_ones(ones_smem, CONSUMER, BLOCK_N, dtype)
        ones_t = ones_smem.index(CONSUMER).permute((1, 0))
        # P·V and P·1 are two groups: S_t's wait leaves both of them outstanding.
        PV_GROUPS: gl.constexpr = 2
    else:
        l_acc = acc  # unused
        ones_t = q_tile  # unused
        PV_GROUPS: gl.constexpr = 1

    if SKIP_MASKED_TILES and WINDOW_LEFT:
        for t in range(0, t0):
            _release_tile(turn, rb + t, base + t, k_ready, v_ready, k_empty, v_empty, CONSUMER, NUM_CONSUMERS,
                          NUM_STAGES, PINGPONG)

    # Prologue: S_t0 (t0 = 0 but for skipped tiles) and its softmax; no P·V is in flight yet.
    first = (base + t0) % NUM_STAGES
    _take_turn(turn, rb + t0, CONSUMER, PINGPONG)
    mbarrier.wait(k_ready.index(first), ((base + t0) // NUM_STAGES) & 1)
    k_tile = k_smem.index(first).reshape([BLOCK_N, HEAD_DIM])
    s_tok = warpgroup_mma(q_tile, k_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    _pass_turn(turn, CONSUMER, NUM_CONSUMERS, PINGPONG)
    j = _key_tile(lo, t0, tiles, HAS_BLOCK_SPARSITY)
    bias = _key_bias_tile(bias_row, key_offsets, j, S, BLOCK_N, HAS_KEY_BIAS)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, ))
    mbarrier.arrive(k_empty.index(first), count=1)
    p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale, bias, row_ids, j, n_full, lo_full, S,
                                       causal_offset, window_lower, s_layout, BLOCK_N, IS_CAUSAL, WINDOW_LEFT, dtype,
                                       EXACT_DELTA, HAS_KEY_BIAS)
    p_op = gl.convert_layout(p.to(dtype), p_layout)

    # t counts the block's ring tiles, as the loader does; the key tile is j.
    for t in range(t0 + 1, n_run):
        slot = (base + t) % NUM_STAGES
        phase = ((base + t) // NUM_STAGES) & 1
        prev = (base + t - 1) % NUM_STAGES
        prev_phase = ((base + t - 1) // NUM_STAGES) & 1
        # Issue S_t = Q·K_tᵀ first, then P_{t-1}·V_{t-1}: the softmax of S_t below overlaps P·V.
        _take_turn(turn, rb + t, CONSUMER, PINGPONG)
        mbarrier.wait(k_ready.index(slot), phase)
        k_tile = k_smem.index(slot).reshape([BLOCK_N, HEAD_DIM])
        s_tok = warpgroup_mma(q_tile, k_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(prev), prev_phase)
        v_tile = v_smem.index(prev).reshape([BLOCK_N, HEAD_DIM])
        acc_tok, l_tok = _pv_issue(p_op, v_tile, acc, ones_t, l_acc, EXACT_DELTA)
        _pass_turn(turn, CONSUMER, NUM_CONSUMERS, PINGPONG)
        # The bias load's latency hides under the MMAs just issued.
        j = _key_tile(lo, t, tiles, HAS_BLOCK_SPARSITY)
        bias = _key_bias_tile(bias_row, key_offsets, j, S, BLOCK_N, HAS_KEY_BIAS)
        # wgmma groups retire in issue order: with P·V's groups outstanding, S_t is done.
        s = warpgroup_mma_wait(num_outstanding=PV_GROUPS, deps=(s_tok, ))
        mbarrier.arrive(k_empty.index(slot), count=1)
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale, bias, row_ids, j, n_full, lo_full, S,
                                           causal_offset, window_lower, s_layout, BLOCK_N, IS_CAUSAL, WINDOW_LEFT,
                                           dtype, EXACT_DELTA, HAS_KEY_BIAS)
        acc, l_acc, p_op = _pv_wait(acc_tok, l_tok, p_op, EXACT_DELTA)
        mbarrier.arrive(v_empty.index(prev), count=1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        if EXACT_DELTA:
            l_acc = l_acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, l_layout)), 1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)

    if PERSISTENT:
        # Every Q·Kᵀ of the block has retired: the loader may bring the next block's Q.
        mbarrier.arrive(q_empty.index(CONSUMER), count=1)
    last = (base + n_run - 1) % NUM_STAGES
    last_phase = ((base + n_run - 1) // NUM_STAGES) & 1
    _take_turn(turn, rb + n_run, CONSUMER, PINGPONG)
    mbarrier.wait(v_ready.index(last), last_phase)
    v_tile = v_smem.index(last).reshape([BLOCK_N, HEAD_DIM])
    acc_tok, l_tok = _pv_issue(p_op, v_tile, acc, ones_t, l_acc, EXACT_DELTA)
    _pass_turn(turn, CONSUMER, NUM_CONSUMERS, PINGPONG)
    acc, l_acc, p_op = _pv_wait(acc_tok, l_tok, p_op, EXACT_DELTA)
    mbarrier.arrive(v_empty.index(last), count=1)
    if SKIP_MASKED_TILES and IS_CAUSAL:
        # Wholly masked tiles: their turns are taken and their slots released as if computed
        # (the epilogue above took round n_run).
        for t in range(n_run, n_tiles):
            _release_tile(turn, rb + t + 1, base + t, k_ready, v_ready, k_empty, v_empty, CONSUMER, NUM_CONSUMERS,
                          NUM_STAGES, PINGPONG)
    if EXACT_DELTA:
        # Every column holds the rounded P's row sum; max picks one exactly.
        l_rnd = gl.convert_layout(gl.max(l_acc, 1), row_layout)
    else:
        l_rnd = l_i

    # l_i == 0 exactly when no key was visible (and then l_rnd too): output 0 and LSE -inf
    # instead of 0/0.
    empty_row = l_i == 0.0
    l_safe = gl.where(empty_row, 1.0, l_i)
    l_rnd_safe = gl.where(empty_row, 1.0, l_rnd)
    inv_l = gl.convert_layout(1.0 / l_rnd_safe, gl.SliceLayout(1, o_layout))
    out32 = acc * gl.expand_dims(inv_l, 1)
    out = out32.to(dtype)
    log2_l = gl.log2(l_safe)
    lse2 = m_i + log2_l
    lse = gl.where(empty_row, float("-inf"), lse2 * LN2)
    row_off = (b * H + h).to(gl.int64) * L + row_ids
    gl.store(LSE + row_off, lse, mask=row_ids < L)
    if EXACT_DELTA:
        # Any integer c serves the backward (module docstring); c - m_i is taken as fp32 gives
        # it, so g stays right where m_i is so large that m_i + floor(log2 l) rounds back to m_i.
        m_safe = gl.where(empty_row, 0.0, m_i)
        pivot = m_safe + gl.floor(gl.log2(l_rnd_safe))
        norm = gl.exp2(pivot - m_safe) / l_rnd_safe
        if PERSISTENT:
            plane = BH.to(gl.int64) * L
        else:
            plane = gl.num_programs(1).to(gl.int64) * L
        gl.store(ROW_CONSTS + row_off, gl.where(empty_row, float("inf"), pivot), mask=row_ids < L)
        gl.store(ROW_CONSTS + plane + row_off, gl.where(empty_row, 0.0, norm), mask=row_ids < L)

    if PERSISTENT:
        # O is staged in its own tile, so the next block's Q can land meanwhile; the previous
        # block's stores must have read the tile first, and this block's are waited for by the next.
        stage = o_smem.index(CONSUMER)
        tma.store_wait(pendings=0)
    else:
        # Q's tile is free (its last wgmma has retired): stage O there.
        stage = q_smem.index(CONSUMER)
    o_tile = stage.reshape([BLOCK_M, HEAD_DIM])
    # TMA clips rows >= L.
    o_tile.store(out)
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [b, h, row0, 0], stage)
    if not PERSISTENT:
        tma.store_wait(pendings=0)
    if EXACT_DELTA:
        if PERSISTENT:
            tma.store_wait(pendings=0)
        o_tile.store((out32 - out.to(gl.float32)).to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(r_desc, [b, h, row0, 0], stage)
        if not PERSISTENT:
            tma.store_wait(pendings=0)
    return n_tiles


@gluon.jit
def _attn_fwd_hopper(q_desc, k_desc, v_desc, o_desc, r_desc, LSE, ROW_CONSTS, KEY_BIAS,
                     L, S, H, GROUP, causal_offset, window_lower, qk_scale, swizzle_heads, WORK_COUNTER, BH,
                     TILE_LISTS, stride_lb, stride_lh, list_stride,
                     HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr, IS_CAUSAL: gl.constexpr,
                     WINDOW_LEFT: gl.constexpr, PINGPONG: gl.constexpr, EXACT_DELTA: gl.constexpr,
                     HAS_KEY_BIAS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                     LOADER_REGS: gl.constexpr, SKIP_MASKED_TILES: gl.constexpr = False,
                     PERSISTENT: gl.constexpr = False, HAS_BLOCK_SPARSITY: gl.constexpr = False):
    """Grid (cdiv(L, BLOCK_M * NUM_CONSUMERS), B * H), walked in the order ``swizzle_heads`` sets;
    under PERSISTENT (at most one CTA per SM, 1-D) each CTA takes the block of its own index, then
    claims the next ones from WORK_COUNTER (int32, zero at launch) in that order, so the longest
    blocks start first wherever they land, and a block's loads overlap the previous one's epilogue.
    Q/K/V/O descriptors are 4-D over (B, H, L or S, E) with boxes (1, 1, rows, E), so TMA clips
    and zero-fills per head. Under EXACT_DELTA ``r_desc`` describes O's residual (as O) and
    ROW_CONSTS is (2, B, H, L) fp32 (pivot, g); otherwise neither is touched. Under HAS_KEY_BIAS,
    KEY_BIAS is (B, H, S) fp32, contiguous (glossary); otherwise it is not read. BH = B·H. Under
    HAS_BLOCK_SPARSITY, TILE_LISTS is int32 (B or 1, H or 1, blocks, list_stride), one row a query
    block: its tile count, then its key tiles (``launch.block_tiles.gluon_tile_lists``), the first two
    dims ``stride_lb`` and ``stride_lh`` apart (0 where the layout broadcasts); else not read."""
    gl.static_assert(NUM_CONSUMERS == 2 or NUM_CONSUMERS == 3, "two or three consumer warpgroups")
    dtype: gl.constexpr = q_desc.dtype
    qk_scale = qk_scale.to(gl.float32)
    q_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    if PERSISTENT:
        # O's own staging tiles, Q's release, and a two-deep ring of work items (loader to consumers).
        o_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS] + o_desc.block_type.shape, o_desc.layout)
        q_empty = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
        item_smem = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        item_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        item_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for c in gl.static_range(NUM_CONSUMERS):
            mbarrier.init(q_empty.index(c), count=1)
        for i in gl.static_range(2):
            mbarrier.init(item_ready.index(i), count=1)
            mbarrier.init(item_empty.index(i), count=NUM_CONSUMERS)
    else:
        o_smem = q_smem  # O is staged in Q's tile
        q_empty = q_ready  # unused
        item_smem = q_ready  # unused
        item_ready = q_ready  # unused
        item_empty = q_ready  # unused
    if EXACT_DELTA:
        # A (8, BLOCK_N) tile of ones per consumer, the B operand of the rounded P's row sums.
        ones_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([8, BLOCK_N], dtype)
        ones_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, 8, BLOCK_N], ones_layout)
    else:
        ones_smem = q_smem  # unused
    for c in gl.static_range(NUM_CONSUMERS):
        mbarrier.init(q_ready.index(c), count=1)
        mbarrier.init(turn.index(c), count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        # A slot is free once every consumer has released it.
        mbarrier.init(k_empty.index(i), count=NUM_CONSUMERS)
        mbarrier.init(v_empty.index(i), count=NUM_CONSUMERS)

    # Worker partitions take no tensors, only descriptors, shared memory and scalars, so every
    # partition gets its arguments spelled out (Gluon 3.6 cannot build a partition's argument
    # tuple from shared pieces: `+` on tuples fails there); the default partition is consumer 0.
    if NUM_CONSUMERS == 2:
        gl.warp_specialize([
            (_hopper_fwd_consumer, (o_desc, r_desc, q_smem, o_smem, k_smem, v_smem, ones_smem, q_ready, q_empty,
                                    k_ready, v_ready, k_empty, v_empty, item_smem, item_ready, item_empty,
                                    LSE, ROW_CONSTS, KEY_BIAS, BH, L, S, H, causal_offset, window_lower,
                                    TILE_LISTS, stride_lb, stride_lh, list_stride, qk_scale,
                                    turn, 0, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, IS_CAUSAL,
                                    WINDOW_LEFT, PINGPONG, EXACT_DELTA, HAS_KEY_BIAS, SKIP_MASKED_TILES, PERSISTENT,
                                    HAS_BLOCK_SPARSITY, swizzle_heads)),
            (_hopper_fwd_consumer, (o_desc, r_desc, q_smem, o_smem, k_smem, v_smem, ones_smem, q_ready, q_empty,
                                    k_ready, v_ready, k_empty, v_empty, item_smem, item_ready, item_empty,
                                    LSE, ROW_CONSTS, KEY_BIAS, BH, L, S, H, causal_offset, window_lower,
                                    TILE_LISTS, stride_lb, stride_lh, list_stride, qk_scale,
                                    turn, 1, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, IS_CAUSAL,
                                    WINDOW_LEFT, PINGPONG, EXACT_DELTA, HAS_KEY_BIAS, SKIP_MASKED_TILES, PERSISTENT,
                                    HAS_BLOCK_SPARSITY, swizzle_heads)),
            (_hopper_fwd_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready,
                                  v_ready, k_empty, v_empty, item_smem, item_ready, item_empty, WORK_COUNTER, BH,
                                  L, S, H, GROUP, causal_offset, window_lower, TILE_LISTS, stride_lb, stride_lh,
                                  list_stride, BLOCK_M, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, IS_CAUSAL, WINDOW_LEFT,
                                  PERSISTENT, HAS_BLOCK_SPARSITY, swizzle_heads)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
    else:
        gl.warp_specialize([
            (_hopper_fwd_consumer, (o_desc, r_desc, q_smem, o_smem, k_smem, v_smem, ones_smem, q_ready, q_empty,
                                    k_ready, v_ready, k_empty, v_empty, item_smem, item_ready, item_empty,
                                    LSE, ROW_CONSTS, KEY_BIAS, BH, L, S, H, causal_offset, window_lower,
                                    TILE_LISTS, stride_lb, stride_lh, list_stride, qk_scale,
                                    turn, 0, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, IS_CAUSAL,
                                    WINDOW_LEFT, PINGPONG, EXACT_DELTA, HAS_KEY_BIAS, SKIP_MASKED_TILES, PERSISTENT,
                                    HAS_BLOCK_SPARSITY, swizzle_heads)),
            (_hopper_fwd_consumer, (o_desc, r_desc, q_smem, o_smem, k_smem, v_smem, ones_smem, q_ready, q_empty,
                                    k_ready, v_ready, k_empty, v_empty, item_smem, item_ready, item_empty,
                                    LSE, ROW_CONSTS, KEY_BIAS, BH, L, S, H, causal_offset, window_lower,
                                    TILE_LISTS, stride_lb, stride_lh, list_stride, qk_scale,
                                    turn, 1, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, IS_CAUSAL,
                                    WINDOW_LEFT, PINGPONG, EXACT_DELTA, HAS_KEY_BIAS, SKIP_MASKED_TILES, PERSISTENT,
                                    HAS_BLOCK_SPARSITY, swizzle_heads)),
            (_hopper_fwd_consumer, (o_desc, r_desc, q_smem, o_smem, k_smem, v_smem, ones_smem, q_ready, q_empty,
                                    k_ready, v_ready, k_empty, v_empty, item_smem, item_ready, item_empty,
                                    LSE, ROW_CONSTS, KEY_BIAS, BH, L, S, H, causal_offset, window_lower,
                                    TILE_LISTS, stride_lb, stride_lh, list_stride, qk_scale,
                                    turn, 2, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, IS_CAUSAL,
                                    WINDOW_LEFT, PINGPONG, EXACT_DELTA, HAS_KEY_BIAS, SKIP_MASKED_TILES, PERSISTENT,
                                    HAS_BLOCK_SPARSITY, swizzle_heads)),
            (_hopper_fwd_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready,
                                  v_ready, k_empty, v_empty, item_smem, item_ready, item_empty, WORK_COUNTER, BH,
                                  L, S, H, GROUP, causal_offset, window_lower, TILE_LISTS, stride_lb, stride_lh,
                                  list_stride, BLOCK_M, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, IS_CAUSAL, WINDOW_LEFT,
                                  PERSISTENT, HAS_BLOCK_SPARSITY, swizzle_heads)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, LOADER_REGS])
