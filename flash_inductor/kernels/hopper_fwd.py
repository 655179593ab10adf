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

Constexpr switches that say what is computed:
  HEAD_DIM      E, the head dim of Q, K and V (64 or 128; one TMA box covers it).
  IS_CAUSAL     key j is visible to query i iff j <= i + causal_offset (0: top-left, SDPA's).
  WINDOW_LEFT   a sliding window's left side (launch/band.py): key j is visible to query i only
                if also j >= i + window_lower. The CTA's loop starts at the first key tile its top
                row can see, so tiles wholly left of the band are never loaded.
  HAS_KEY_BIAS  a key mask, one value per key (``launch.hopper.key_bias``): KEY_BIAS is (B, H, S)
                fp32 in base 2 (0 to attend, -inf to hide, an additive mask times log2 e), added
                to each tile's scaled scores; a mask that varies along the queries never gets here.
  SOFTCAP       FlashAttention-2's soft cap: the score is c·tanh(scale·q·k / c), in fp32, before the
                mask (``kernels/gluon_softcap.py``, the Triton kernels' tanh and its error bound). The
                score step takes t = tanh(s·tanh_scale), tanh_scale = scale / c, selects on t, and
                uses softcap_log2 = c·log2(e) where qk_scale stands otherwise (t·softcap_log2 are
                the scores in base 2): two MUFU ops more per score (ex2, rcp).
  HAS_BLOCK_SPARSITY a block-sparse layout (``launch/block_tiles.py``): each block walks the key tiles
                listed for it, TILE_LISTS[b, h, block] = (count, tile, tile, ...) in ascending order,
                rather than a contiguous range. The launcher takes only layouts whose blocks hold
                whole CTA blocks and key tiles, so a listed tile is computed everywhere and the
                select needs only the band and S, by position, as a dense tile does. A block with no
                listed tile runs one tile with S taken as 0 (all masked: output 0, LSE -inf).
  VARLEN        packed sequences (FlashAttention's varlen, ``launch/packed.py``): Q, K, V and O are
                (1, H, total, E) views and sequence b's rows and keys are [CU_Q[b], CU_Q[b + 1]) and
                [CU_K[b], CU_K[b + 1]); a CTA computes one query block of one sequence as if the
                sequence were the whole problem (``FwdProblem.for_sequence``: its L, S, causal_offset
                and window_lower, the band moved to its bottom-right diagonal under diag_shift). Its
                loads start at the sequence's first row (TMA coordinates cu + row): rows and keys
                past its end belong to the next sequence and are masked as keys past S are, and O
                (and its residual) are stored row by row with a mask rather than by TMA, whose box
                would write the next sequence's rows. The grid covers the packed rows
                (``PackedRows``), so only each sequence's own tiles run.

  HAS_SINKS     attention sinks (ops/sinks.py): SINKS[h], head h's logit in natural log, joins every
                row's denominator and nothing else. The epilogue puts exp2(sink·log2 e - m) beside
                l_i (and l_rnd) on a common max (``_sink_totals``), so O and the LSE come out with
                the sink in them: O' = acc / (l + sink term), LSE' = log(e^LSE + e^sink); a row
                with no visible key stores O = 0 and LSE' = sink. Under EXACT_DELTA the pivot c
                stays the keys' (m_i + floor(log2 l_rnd)) and g = exp2(c - m_i) / (l_rnd + sink
                term), so the backward's g · round(exp2(s·qk_scale - c)) is P' = exp(s - LSE').

Switches that change the numerics (the rounding; within the schedule's contract):
  EXACT_DELTA   the integer max, the rounded sum, and the residual and row constants above.
  BLOCK_N       keys per tile (the N of Q·Kᵀ and the K of P·V): the tile over which a row max is
                taken, so the sequence of rescalings of acc and l_i.

Speed only, tuned (tuning/hopper_configs.py; the results are bitwise the same whatever they are):
  BLOCK_M       query rows per consumer warpgroup (64: one m64 wgmma row block; not tuned).
  NUM_STAGES    depth of the K/V shared-memory ring the loader fills ahead of the consumers.
  NUM_CONSUMERS consumer warpgroups per CTA; the CTA owns NUM_CONSUMERS·BLOCK_M query rows and
                every consumer reads every K/V tile of the ring (so K/V are loaded once per CTA).
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
  swizzle_heads the grid order (``_block_coords``): CTAs walk the (batch, head)s in groups of
                this many, query block by query block within a group (longest first under causal
                masking). 1: each head's blocks together; B·H: every head's longest block first.
  CONSUMER_REGS, LOADER_REGS the registers setmaxnreg gives each consumer warpgroup and the loader.

Schedule (per consumer, FA3's intra-warpgroup overlap): the Q·Kᵀ of tile j is issued before
the P·V of tile j-1, so the softmax of tile j runs while the tensor cores finish P·V of j-1;
the consumers are independent partitions, so one warpgroup's softmax also overlaps the other's
MMAs. Tiles between the band's edges (below the causal diagonal, right of the window's left
side) and inside S skip the visibility select.

Code (Triton's Gluon attention example and FA3's CuTe port): ``FwdConfig`` holds the switches
and layouts, sizes taken from the descriptors; ``FwdProblem`` the call's scalars and pointers;
``FwdBuffers`` the shared memory and barriers, whose rings (``hopper_pipeline.Ring``) own the slot
and phase arithmetic (hopper_fwd_state.py). ``FwdScheduler`` is the one place PERSISTENT is read:
it runs the loader's and each consumer's blocks (``_load_block``, ``_consume_block``) and owns what
a persistent block does differently. ``_fwd_tile`` is one key tile's step (FA3's
``mma_one_n_block``). Every partition takes (scheduler, descriptors[, consumer]).
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
from triton.language.core import base_value

from .gluon_softcap import softcap_tanh
from .gluon_tma import tma_load, tma_store
from .grid_order import ordered_cell
from .hopper_fwd_state import FwdBuffers, FwdConfig, FwdDescs, FwdProblem, allocate
from .hopper_packed import PackedRows, forward_block, k_row, q_row, store_packed_rows
from .hopper_pipeline import Scalar, TileLists, field

LN2 = gl.constexpr(0.6931471805599453)


@aggregate
class FwdScheduler:
    """Which query blocks a CTA computes, and what that changes for a block: the one place
    PERSISTENT is read. Grid: the CTA's cell (``_block_coords``), one block. PERSISTENT: the
    CTA's own index first, then blocks claimed from WORK_COUNTER, in the grid's order; the loader
    claims them and hands each to the consumers through the two-deep item ring, O is staged in
    tiles of its own (so the next block's Q can land meanwhile), and Q's tile is released per block.
    The K/V ring's count (``base``) and the blocks' count (``it``) run on across blocks."""
    cfg: FwdConfig
    prob: FwdProblem
    bufs: FwdBuffers

    @gluon.constexpr_function
    def __init__(self, cfg, prob, bufs):
        self.cfg = field(cfg)
        self.prob = field(prob)
        self.bufs = field(bufs)

    @gluon.jit
    def run_loader(self, descs):
        cfg = self.cfg
        prob = self.prob
        if cfg.PERSISTENT:
            blocks = gl.cdiv(prob.L, cfg.ROWS)
            num_items = blocks * prob.BH
            item = gl.program_id(0)
            it = 0
            base = 0  # ring tiles loaded for earlier items
            while item < num_items:
                # The next item is claimed now, so the atomic's latency hides under this item's loads.
                next_item = gl.num_programs(0) + gl.atomic_add(prob.WORK_COUNTER, 1)
                self.hand_item(item, it)
                start_m, b, h = _item_coords(cfg, prob, item, blocks, prob.BH)
                n_tiles = _load_block(cfg, prob, descs, self.bufs, self, start_m, b, h, it, base)
                base += n_tiles
                it += 1
                item = next_item
            # The consumers stop at an item past the last.
            self.hand_item(item, it)
        elif cfg.VARLEN:
            start_m, seq, h = forward_block(cfg, prob, WARPS=1)
            if start_m < seq.L:
                _load_block(cfg, seq, descs, self.bufs, self, start_m, 0, h, 0, 0)
        else:
            start_m, b, h = _block_coords(cfg, prob)
            _load_block(cfg, prob, descs, self.bufs, self, start_m, b, h, 0, 0)

    @gluon.jit
    def run_consumer(self, descs, CONSUMER: gl.constexpr):
        cfg = self.cfg
        prob = self.prob
        if cfg.PERSISTENT:
            if cfg.EXACT_DELTA:
                _store_ones(cfg, self.bufs.ones_smem, CONSUMER=CONSUMER)
            blocks = gl.cdiv(prob.L, cfg.ROWS)
            it = 0
            base = 0  # ring tiles consumed for earlier items
            item = self.take_item(0)
            while item < blocks * prob.BH:
                start_m, b, h = _item_coords(cfg, prob, item, blocks, prob.BH)
                n_tiles = _consume_block(cfg, prob, descs, self.bufs, self, start_m, b, h, it, base, CONSUMER=CONSUMER)
                base += n_tiles
                it += 1
                item = self.take_item(it)
            tma.store_wait(pendings=0)  # the last block's stores
        elif cfg.VARLEN:
            start_m, seq, h = forward_block(cfg, prob, WARPS=4)
            if start_m < seq.L:
                _consume_block(cfg, seq, descs, self.bufs, self, start_m, 0, h, 0, 0, CONSUMER=CONSUMER)
        else:
            start_m, b, h = _block_coords(cfg, prob)
            _consume_block(cfg, prob, descs, self.bufs, self, start_m, b, h, 0, 0, CONSUMER=CONSUMER)

    @gluon.jit
    def hand_item(self, item, it):
        """Publish work item ``item`` (the loader's it-th) in its slot of the item ring."""
        items = self.bufs.items
        slot = items.slot(it)
        items.wait_free_at(slot, it)
        self.bufs.item_smem.index(slot).store(gl.full([1], item, gl.int32,
                                                      layout=gl.BlockedLayout([1], [32], [1], [0])))
        mbarrier.arrive(items.ready.index(slot), count=1)

    @gluon.jit
    def take_item(self, it):
        """The consumers' side of ``hand_item``: the it-th work item, its slot released."""
        items = self.bufs.items
        slot = items.slot(it)
        items.wait_ready_at(slot, it)
        item = gl.max(self.bufs.item_smem.index(slot).load(gl.BlockedLayout([1], [32], [4], [0])), 0)
        items.release(slot)
        return item

    @gluon.jit
    def store_ones_for_block(self, CONSUMER: gl.constexpr):
        """EXACT_DELTA's ones tile, where a block stores it: in the grid every block (once per CTA);
        under PERSISTENT ``run_consumer`` has stored it before the first block."""
        if not self.cfg.PERSISTENT:
            _store_ones(self.cfg, self.bufs.ones_smem, CONSUMER=CONSUMER)

    @gluon.jit
    def wait_q_free(self, it, c: gl.constexpr):
        if self.cfg.PERSISTENT:
            # Consumer c frees its Q tile once the item's last Q·Kᵀ has retired.
            mbarrier.wait(self.bufs.q_empty.index(c), (it & 1) ^ 1)

    @gluon.jit
    def release_q(self, CONSUMER: gl.constexpr):
        if self.cfg.PERSISTENT:
            # Every Q·Kᵀ of the block has retired: the loader may bring the next block's Q.
            mbarrier.arrive(self.bufs.q_empty.index(CONSUMER), count=1)

    @gluon.jit
    def heads(self):
        """B·H, the row constants' plane is heads · L rows."""
        if self.cfg.PERSISTENT:
            return self.prob.BH
        else:
            return gl.num_programs(1)

    @gluon.jit
    def store_o(self, descs, prob, out32, out, b, h, row0, CONSUMER: gl.constexpr):
        """O (and under EXACT_DELTA its residual) through a shared tile and TMA stores, which clip
        rows >= L. Grid: Q's tile (its last wgmma has retired), each store waited for. PERSISTENT:
        O's own tile; the previous block's stores must have read it first, and this block's are
        waited for by the next."""
        cfg = self.cfg
        if cfg.VARLEN:
            # Row by row: the sequence's last block would otherwise write the next one's rows.
            store_packed_rows(prob.OUT, out, prob.q_start, row0, prob.L, prob.H, h, ROWS=cfg.BLOCK_M,
                              HEAD_DIM=cfg.HEAD_DIM)
            if cfg.EXACT_DELTA:
                store_packed_rows(prob.RESID, (out32 - out.to(gl.float32)).to(cfg.dtype), prob.q_start, row0, prob.L,
                                  prob.H, h, ROWS=cfg.BLOCK_M, HEAD_DIM=cfg.HEAD_DIM)
        else:
            if cfg.PERSISTENT:
                stage = self.bufs.o_smem.index(CONSUMER)
                tma.store_wait(pendings=0)
            else:
                stage = self.bufs.q_smem.index(CONSUMER)
            o_tile = stage.reshape([cfg.BLOCK_M, cfg.HEAD_DIM])
            o_tile.store(out)
            fence_async_shared()
            tma_store(descs.o, [b, h, row0, 0], stage)
            if not cfg.PERSISTENT:
                tma.store_wait(pendings=0)
            if cfg.EXACT_DELTA:
                if cfg.PERSISTENT:
                    tma.store_wait(pendings=0)
                o_tile.store((out32 - out.to(gl.float32)).to(cfg.dtype))
                fence_async_shared()
                tma_store(descs.r, [b, h, row0, 0], stage)
                if not cfg.PERSISTENT:
                    tma.store_wait(pendings=0)


@aggregate
class RowTiles:
    """What one consumer's rows see of its block's ring tiles: ring tile t holds key tile lo + t
    (under HAS_BLOCK_SPARSITY the t-th listed, ``tiles``, else None); S as the block sees it (0
    where nothing is listed); tiles lo_full <= j < n_full are wholly visible to every one of
    these rows (no select). ``bias_row``: the key bias of the block's head (HAS_KEY_BIAS)."""
    lo: Scalar
    tiles: Scalar
    S: Scalar
    n_full: Scalar
    lo_full: Scalar
    row_ids: gl.tensor
    bias_row: gl.tensor
    key_offsets: gl.tensor

    @gluon.constexpr_function
    def __init__(self, lo, tiles, S, n_full, lo_full, row_ids, bias_row, key_offsets):
        self.lo = field(lo)
        self.tiles = field(tiles)
        self.S = field(S)
        self.n_full = field(n_full)
        self.lo_full = field(lo_full)
        self.row_ids = field(row_ids)
        self.bias_row = field(bias_row)
        self.key_offsets = field(key_offsets)


@gluon.jit
def _tile_range(cfg, prob, row0, S, ROWS: gl.constexpr):
    """The key tiles rows [row0, row0 + ROWS) visit: (first tile, tile count, n_full, lo_full).
    Tiles lo_full <= j < n_full are wholly visible to every one of those rows (no select).

    At least one tile is visited, so a block whose rows see no key still runs the loop once and
    leaves l_i = 0 (output 0, LSE -inf) instead of an unwritten output."""
    BLOCK_N: gl.constexpr = cfg.BLOCK_N
    if cfg.IS_CAUSAL:
        hi = gl.minimum(S, row0 + ROWS + prob.causal_offset)
        n_full = gl.minimum(row0 + prob.causal_offset + 1, S) // BLOCK_N
    else:
        hi = S
        n_full = S // BLOCK_N
    end = gl.cdiv(gl.maximum(hi, 1), BLOCK_N)
    lo = 0
    lo_full = 0
    if cfg.WINDOW_LEFT:
        # The top row's left side gives the first tile; the bottom row's, the first tile that
        # every row sees from its first key on.
        lo = gl.minimum(gl.maximum(row0 + prob.window_lower, 0) // BLOCK_N, end - 1)
        lo_full = gl.cdiv(gl.maximum(row0 + ROWS - 1 + prob.window_lower, 0), BLOCK_N)
    return lo, end - lo, gl.maximum(n_full, 0), lo_full


@gluon.jit
def _listed_range(cfg, prob, b, h, start_m, S):
    """(tile count, the list of tiles, S as the block sees it) of the block at (start_m, b, h) under
    HAS_BLOCK_SPARSITY: at least one tile, and S taken as 0 where none is listed, so that the one
    tile run (the list's first entry, a skipped one) is wholly masked."""
    row = prob.lists.row(b, h, start_m, BLOCK=cfg.ROWS)
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
def _block_coords(cfg, prob):
    """(first query row, batch, head) of this CTA: the grid is (query blocks, B·H), walked in the
    order ``swizzle_heads`` sets (``grid_order.py``). Causal blocks run in reverse row order, so
    each group's longest (bottom) blocks start first and short ones fill the tail."""
    blocks = gl.num_programs(0)
    return _item_coords(cfg, prob, gl.program_id(1) * blocks + gl.program_id(0), blocks, gl.num_programs(1))


@gluon.jit
def _item_coords(cfg, prob, item, blocks, BH):
    """``_block_coords`` of work item ``item`` (a CTA's linear index in the grid, or a persistent
    CTA's claimed block): the order ``swizzle_heads`` sets over (blocks, B·H)."""
    pid_m, bh = ordered_cell(item, blocks, BH, prob.swizzle_heads)
    if cfg.IS_CAUSAL:
        pid_m = blocks - 1 - pid_m
    return pid_m * cfg.ROWS, bh // prob.H, bh % prob.H


@gluon.jit
def _hopper_fwd_loader(sched, descs):
    """One warp: Q once per consumer, then K/V tiles into the ring as slots free up; under
    PERSISTENT, item after item, each handed to the consumers before its loads."""
    sched.run_loader(descs)


@gluon.jit
def _load_block(cfg, prob, descs, bufs, sched, start_m, b, h, it, base):
    """The loads of one block (the CTA's it-th; ``base`` ring tiles before it). Returns its tile count."""
    h_kv = h // prob.GROUP  # grouped-query attention: K/V heads are indexed, never repeated
    for c in gl.static_range(cfg.NUM_CONSUMERS):
        sched.wait_q_free(it, c=c)
        mbarrier.expect(bufs.q_ready.index(c), descs.q.block_type.nbytes)
        tma_load(descs.q, [b, h, q_row(cfg, prob, start_m + c * cfg.BLOCK_M), 0], bufs.q_ready.index(c),
                 bufs.q_smem.index(c))
    lo, n_tiles, _, _ = _tile_range(cfg, prob, start_m, prob.S, ROWS=cfg.ROWS)
    if cfg.HAS_BLOCK_SPARSITY:
        n_tiles, tiles, _ = _listed_range(cfg, prob, b, h, start_m, prob.S)
    else:
        tiles = None
    kv = bufs.kv
    vv = bufs.vv
    # t counts the item's ring tiles from 0; the key tile it holds is lo + t (or the t-th listed),
    # its ring index base + t.
    for t in range(n_tiles):
        slot = kv.slot(base + t)
        key0 = k_row(cfg, prob, _key_tile(lo, t, tiles, HAS_BLOCK_SPARSITY=cfg.HAS_BLOCK_SPARSITY) * cfg.BLOCK_N)
        empty_phase = kv.free_phase(base + t)
        kv.wait_free(slot, empty_phase)
        mbarrier.expect(kv.ready.index(slot), descs.k.block_type.nbytes)
        tma_load(descs.k, [b, h_kv, key0, 0], kv.ready.index(slot), bufs.k_smem.index(slot))
        # V has its own barriers so Q·Kᵀ can start before V lands.
        vv.wait_free(slot, empty_phase)
        mbarrier.expect(vv.ready.index(slot), descs.v.block_type.nbytes)
        tma_load(descs.v, [b, h_kv, key0, 0], vv.ready.index(slot), bufs.v_smem.index(slot))
    return n_tiles


@gluon.jit
def _softmax_step(cfg, prob, rows, s, m_i, l_i, bias, j):
    """Fold key tile j's unscaled scores into (m_i, l_i); returns (p, alpha, m_i, l_i), p in fp32.
    Under EXACT_DELTA p is already rounded to ``dtype`` (the rounded P's row sum is a wgmma
    against a ones tile beside P·V, ``_pv_issue``); l_i is the fp32 P's sum either way.
    ``bias``: the tile's key bias (base 2) under HAS_KEY_BIAS, else None. Under SOFTCAP the tile's
    values become t = tanh(s·scale / c) before the select (a hidden score must stay -inf, which tanh
    would bring back to -1), and c·log2(e) takes qk_scale's place: the scores in base 2 are t·c·log2 e."""
    if cfg.SOFTCAP:
        s = softcap_tanh(s * prob.tanh_scale)
        qk_scale = prob.softcap_log2
    else:
        qk_scale = prob.qk_scale
    needs_select = j >= rows.n_full
    if cfg.WINDOW_LEFT:
        needs_select = needs_select | (j < rows.lo_full)
    if needs_select:
        # Diagonal, window-edge or ragged-tail tile: keys past S (zero rows that TMA filled in;
        # the 4-D descriptor clips per head, so they are never another head's keys) and keys
        # outside the band go to -inf.
        cols = gl.expand_dims(j * cfg.BLOCK_N + gl.arange(0, cfg.BLOCK_N, layout=gl.SliceLayout(0, cfg.s_layout)), 0)
        visible = cols < rows.S
        if cfg.IS_CAUSAL:
            visible = visible & (cols <= gl.expand_dims(rows.row_ids, 1) + prob.causal_offset)
        if cfg.WINDOW_LEFT:
            visible = visible & (cols >= gl.expand_dims(rows.row_ids, 1) + prob.window_lower)
        s = gl.where(visible, s, float("-inf"))
    if cfg.HAS_KEY_BIAS:
        # Scaled scores plus the key bias, one FFMA per score. The one-pass backward forms its
        # scores in the same order (kernels/hopper_bwd.py), so its P rounds as this one does.
        s = s * qk_scale + gl.expand_dims(bias, 0)
        tile_max = gl.max(s, 1)
    else:
        # Max on the unscaled scores (under SOFTCAP on t), scaled once: exact for qk_scale > 0
        # (x -> fl(c·x) is monotonic), and exp2's argument below is then a single FFMA per score.
        tile_max = gl.max(s, 1) * qk_scale
    if cfg.EXACT_DELTA:
        tile_max = gl.ceil(tile_max)  # -inf stays -inf
    m_new = gl.maximum(m_i, tile_max)
    m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_ref)
    if cfg.HAS_KEY_BIAS:
        p = gl.exp2(s - gl.expand_dims(m_ref, 1))
    else:
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_ref, 1))
    l_i = l_i * alpha + gl.sum(p, 1)
    if cfg.EXACT_DELTA:
        p = p.to(cfg.dtype)
    return p, alpha, m_new, l_i


@gluon.jit
def _key_bias_tile(cfg, rows, j):
    """Key tile j's bias (base 2, fp32), -inf past S (HAS_KEY_BIAS)."""
    cols = j * cfg.BLOCK_N + rows.key_offsets
    return gl.load(rows.bias_row + cols, mask=cols < rows.S, other=float("-inf"))


@aggregate
class PVAcc:
    """O's accumulator ``acc`` and, under EXACT_DELTA, ``l_acc`` (else None): (BLOCK_M, 8) equal
    columns, each the row sum of P as rounded, summed by a wgmma of P against a tile of ones
    beside P·V at no ALU cost per score. Between ``issue`` and ``wait`` the members are the
    wgmmas' tokens."""
    acc: base_value  # a tensor, or a wgmma's token
    l_acc: base_value
    EXACT_DELTA: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, acc, l_acc, EXACT_DELTA):
        self.acc = field(acc)
        self.l_acc = field(l_acc)
        self.EXACT_DELTA = field(EXACT_DELTA)

    @gluon.jit
    def issue(self, p_op, v_tile, ones_t):
        """Issue P·V (and P·1 under EXACT_DELTA); returns the tokens for ``wait``."""
        acc_tok = warpgroup_mma(p_op, v_tile, self.acc, is_async=True)
        if self.EXACT_DELTA:
            l_tok = warpgroup_mma(p_op, ones_t, self.l_acc, is_async=True)
            return PVAcc(acc_tok, l_tok, EXACT_DELTA=self.EXACT_DELTA)
        else:
            return PVAcc(acc_tok, self.l_acc, EXACT_DELTA=self.EXACT_DELTA)

    @gluon.jit
    def wait(self, p_op):
        """Wait for ``issue``'s MMAs; p_op stays in deps so its registers are not reused while
        they read it. Returns (the accumulators, p_op)."""
        if self.EXACT_DELTA:
            acc, l_acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(self.acc, self.l_acc, p_op))
            return PVAcc(acc, l_acc, EXACT_DELTA=self.EXACT_DELTA), p_op
        else:
            acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(self.acc, p_op))
            return PVAcc(acc, self.l_acc, EXACT_DELTA=self.EXACT_DELTA), p_op

    @gluon.jit
    def rescale(self, alpha, cfg):
        """Both accumulators onto the new row max (alpha per row)."""
        acc = self.acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, cfg.o_layout)), 1)
        if self.EXACT_DELTA:
            l_acc = self.l_acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, cfg.l_layout)), 1)
            return PVAcc(acc, l_acc, EXACT_DELTA=self.EXACT_DELTA)
        else:
            return PVAcc(acc, self.l_acc, EXACT_DELTA=self.EXACT_DELTA)


@gluon.jit
def _take_turn(cfg, turn, round, CONSUMER: gl.constexpr):
    """Wait for this warpgroup's turn to issue MMAs in round ``round``. Consumer c waits on
    turn[c], which consumer c-1 arrives on after issuing; consumer 0 goes first (a fresh mbarrier
    passes a wait on parity 1) and thereafter waits for the last consumer's previous round."""
    if cfg.PINGPONG:
        if CONSUMER == 0:
            mbarrier.wait(turn.index(CONSUMER), (round & 1) ^ 1)
        else:
            mbarrier.wait(turn.index(CONSUMER), round & 1)


@gluon.jit
def _pass_turn(cfg, turn, CONSUMER: gl.constexpr):
    if cfg.PINGPONG:
        mbarrier.arrive(turn.index((CONSUMER + 1) % cfg.NUM_CONSUMERS), count=1)


@gluon.jit
def _release_tile(cfg, bufs, round, i, CONSUMER: gl.constexpr):
    """Ring tile i (counted over the CTA's blocks), wholly masked for this warpgroup
    (SKIP_MASKED_TILES): take and pass its turn of ``round`` and release its K and V slots as if
    computed. A slot is released only once its tile has landed, so the release counts toward the
    round the loader filled (an early arrive could complete a later round's phase)."""
    slot = bufs.kv.slot(i)
    phase = bufs.kv.phase(i)
    _take_turn(cfg, bufs.turn, round, CONSUMER=CONSUMER)
    _pass_turn(cfg, bufs.turn, CONSUMER=CONSUMER)
    bufs.kv.wait_ready(slot, phase)
    bufs.kv.release(slot)
    bufs.vv.wait_ready(slot, phase)
    bufs.vv.release(slot)


@gluon.jit
def _store_ones(cfg, ones_smem, CONSUMER: gl.constexpr):
    """This consumer's (8, keys) tile of ones, keys contiguous: the B operand (read transposed, K-major)
    of the rounded P's row sums under EXACT_DELTA. Written once per CTA."""
    ones_smem.index(CONSUMER).store(gl.full([8, cfg.BLOCK_N], 1.0, cfg.dtype,
                                            layout=gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])))
    fence_async_shared()


@gluon.jit
def _hopper_fwd_consumer(sched, descs, CONSUMER: gl.constexpr):
    """One warpgroup: BLOCK_M query rows of the CTA's block (under PERSISTENT, of each block the
    loader hands over) against every key tile the loader brings."""
    sched.run_consumer(descs, CONSUMER=CONSUMER)


@gluon.jit
def _row_tiles(cfg, prob, start_m, b, h, row0):
    """This warpgroup's ``RowTiles`` of the block at (start_m, b, h), and (n_tiles, n_run, t0): it
    walks the CTA's n_tiles ring tiles (the loader's), so that each ring slot gets one release from
    every consumer and under PINGPONG every consumer takes the same number of turns, and computes
    tiles t0 <= t < n_run of them. Under causal masking the last tiles can lie wholly above this
    warpgroup's diagonal (and under a window the first ones wholly left of its band); they are fully
    masked (p = 0), which costs their MMAs but no special case, unless SKIP_MASKED_TILES only
    releases them."""
    row_ids = row0 + gl.arange(0, cfg.BLOCK_M, layout=cfg.row_layout)
    bias_row = prob.KEY_BIAS + (b * prob.H + h).to(gl.int64) * prob.S  # read only under HAS_KEY_BIAS
    key_offsets = gl.arange(0, cfg.BLOCK_N, layout=gl.SliceLayout(0, cfg.s_layout))
    S = prob.S
    lo, n_tiles, _, _ = _tile_range(cfg, prob, start_m, S, ROWS=cfg.ROWS)
    if cfg.HAS_BLOCK_SPARSITY:
        # The listed tiles, in the loader's order; S as this block sees it (0 where none is listed).
        gl.static_assert(not cfg.SKIP_MASKED_TILES, "SKIP_MASKED_TILES walks contiguous key ranges")
        n_tiles, tiles, S = _listed_range(cfg, prob, b, h, start_m, S)
    else:
        tiles = None
    own_lo, own_count, n_full, lo_full = _tile_range(cfg, prob, row0, S, ROWS=cfg.BLOCK_M)
    if cfg.SKIP_MASKED_TILES and cfg.IS_CAUSAL:
        # The ring's tiles past this warpgroup's last visible one are only released.
        n_run = gl.maximum(gl.minimum(n_tiles, own_lo + own_count - lo), 1)
    else:
        n_run = n_tiles
    if cfg.SKIP_MASKED_TILES and cfg.WINDOW_LEFT:
        # The ring's tiles wholly left of this warpgroup's band: released, not computed.
        t0 = gl.minimum(gl.maximum(own_lo - lo, 0), n_run - 1)
    else:
        t0 = 0
    return RowTiles(lo, tiles, S, n_full, lo_full, row_ids, bias_row, key_offsets), n_tiles, n_run, t0


@gluon.jit
def _consume_block(cfg, prob, descs, bufs, sched, start_m, b, h, it, base, CONSUMER: gl.constexpr):
    """This warpgroup's rows of the block at (start_m, b, h), the CTA's it-th, whose first ring
    tile is the CTA's base-th: ring tile t sits at ring index base + t and issues in ping-pong
    round base + it + t (each block takes its tile count plus one rounds). Returns the tile count."""
    rb = base + it  # the ping-pong round of ring tile t is rb + t
    row0 = start_m + CONSUMER * cfg.BLOCK_M
    rows, n_tiles, n_run, t0 = _row_tiles(cfg, prob, start_m, b, h, row0)

    q_tile = bufs.q_smem.index(CONSUMER).reshape([cfg.BLOCK_M, cfg.HEAD_DIM])
    mbarrier.wait(bufs.q_ready.index(CONSUMER), it & 1)

    m_i = gl.full([cfg.BLOCK_M], float("-inf"), gl.float32, layout=cfg.row_layout)
    l_i = gl.zeros([cfg.BLOCK_M], gl.float32, layout=cfg.row_layout)
    acc = gl.zeros([cfg.BLOCK_M, cfg.HEAD_DIM], gl.float32, layout=cfg.o_layout)
    s_zero = gl.zeros([cfg.BLOCK_M, cfg.BLOCK_N], gl.float32, layout=cfg.s_layout)
    if cfg.EXACT_DELTA:
        # The ones (stored once per CTA) are read transposed: a K-major B operand.
        accs = PVAcc(acc, gl.zeros([cfg.BLOCK_M, 8], gl.float32, layout=cfg.l_layout), EXACT_DELTA=cfg.EXACT_DELTA)
        sched.store_ones_for_block(CONSUMER=CONSUMER)
        ones_t = bufs.ones_smem.index(CONSUMER).permute((1, 0))
    else:
        accs = PVAcc(acc, None, EXACT_DELTA=cfg.EXACT_DELTA)
        ones_t = None

    if cfg.SKIP_MASKED_TILES and cfg.WINDOW_LEFT:
        for t in range(0, t0):
            _release_tile(cfg, bufs, rb + t, base + t, CONSUMER=CONSUMER)

    # Prologue: S_t0 (t0 = 0 but for skipped tiles) and its softmax; no P·V is in flight yet.
    first = bufs.kv.slot(base + t0)
    _take_turn(cfg, bufs.turn, rb + t0, CONSUMER=CONSUMER)
    bufs.kv.wait_ready_at(first, base + t0)
    k_tile = bufs.k_smem.index(first).reshape([cfg.BLOCK_N, cfg.HEAD_DIM])
    s_tok = warpgroup_mma(q_tile, k_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    _pass_turn(cfg, bufs.turn, CONSUMER=CONSUMER)
    j = _key_tile(rows.lo, t0, rows.tiles, HAS_BLOCK_SPARSITY=cfg.HAS_BLOCK_SPARSITY)
    if cfg.HAS_KEY_BIAS:
        bias = _key_bias_tile(cfg, rows, j)
    else:
        bias = None
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, ))
    bufs.kv.release(first)
    p, alpha, m_i, l_i = _softmax_step(cfg, prob, rows, s, m_i, l_i, bias, j)
    p_op = gl.convert_layout(p.to(cfg.dtype), cfg.p_layout)

    # t counts the block's ring tiles, as the loader does.
    for t in range(t0 + 1, n_run):
        m_i, l_i, accs, p_op = _fwd_tile(cfg, prob, bufs, rows, q_tile, s_zero, ones_t, base, rb, t, m_i, l_i, accs,
                                         p_op, CONSUMER=CONSUMER)

    sched.release_q(CONSUMER=CONSUMER)
    # The last tile's P·V.
    last = bufs.vv.slot(base + n_run - 1)
    last_phase = bufs.vv.phase(base + n_run - 1)
    _take_turn(cfg, bufs.turn, rb + n_run, CONSUMER=CONSUMER)
    bufs.vv.wait_ready(last, last_phase)
    v_tile = bufs.v_smem.index(last).reshape([cfg.BLOCK_N, cfg.HEAD_DIM])
    toks = accs.issue(p_op, v_tile, ones_t)
    _pass_turn(cfg, bufs.turn, CONSUMER=CONSUMER)
    accs, p_op = toks.wait(p_op)
    bufs.vv.release(last)
    if cfg.SKIP_MASKED_TILES and cfg.IS_CAUSAL:
        # Wholly masked tiles: their turns are taken and their slots released as if computed
        # (the epilogue above took round n_run).
        for t in range(n_run, n_tiles):
            _release_tile(cfg, bufs, rb + t + 1, base + t, CONSUMER=CONSUMER)
    _epilogue(cfg, prob, descs, sched, rows, accs, m_i, l_i, b, h, row0, CONSUMER=CONSUMER)
    return n_tiles


@gluon.jit
def _fwd_tile(cfg, prob, bufs, rows, q_tile, s_zero, ones_t, base, rb, t, m_i, l_i, accs, p_op,
              CONSUMER: gl.constexpr):
    """Ring tile t of the block after the first (FA3's ``mma_one_n_block``): issue S_t = Q·K_tᵀ,
    then P_{t-1}·V_{t-1}, so the softmax of S_t overlaps P·V. Returns (m_i, l_i, accs, p_op)."""
    kv = bufs.kv
    vv = bufs.vv
    slot = kv.slot(base + t)
    phase = kv.phase(base + t)
    prev = vv.slot(base + t - 1)
    prev_phase = vv.phase(base + t - 1)
    _take_turn(cfg, bufs.turn, rb + t, CONSUMER=CONSUMER)
    kv.wait_ready(slot, phase)
    k_tile = bufs.k_smem.index(slot).reshape([cfg.BLOCK_N, cfg.HEAD_DIM])
    s_tok = warpgroup_mma(q_tile, k_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    vv.wait_ready(prev, prev_phase)
    v_tile = bufs.v_smem.index(prev).reshape([cfg.BLOCK_N, cfg.HEAD_DIM])
    toks = accs.issue(p_op, v_tile, ones_t)
    _pass_turn(cfg, bufs.turn, CONSUMER=CONSUMER)
    # The bias load's latency hides under the MMAs just issued.
    j = _key_tile(rows.lo, t, rows.tiles, HAS_BLOCK_SPARSITY=cfg.HAS_BLOCK_SPARSITY)
    if cfg.HAS_KEY_BIAS:
        bias = _key_bias_tile(cfg, rows, j)
    else:
        bias = None
    # wgmma groups retire in issue order: with P·V's groups outstanding, S_t is done.
    s = warpgroup_mma_wait(num_outstanding=cfg.PV_GROUPS, deps=(s_tok, ))
    kv.release(slot)
    p, alpha, m_i, l_i = _softmax_step(cfg, prob, rows, s, m_i, l_i, bias, j)
    accs, p_op = toks.wait(p_op)
    vv.release(prev)
    accs = accs.rescale(alpha, cfg)
    p_op = gl.convert_layout(p.to(cfg.dtype), cfg.p_layout)
    return m_i, l_i, accs, p_op


@gluon.jit
def _epilogue(cfg, prob, descs, sched, rows, accs, m_i, l_i, b, h, row0, CONSUMER: gl.constexpr):
    """O = acc / l, the LSE and (EXACT_DELTA) the row constants and O's residual, stored; under
    HAS_SINKS with the sink's term in every denominator (``_sink_totals``)."""
    acc = accs.acc
    if cfg.EXACT_DELTA:
        # Every column holds the rounded P's row sum; max picks one exactly.
        l_rnd = gl.convert_layout(gl.max(accs.l_acc, 1), cfg.row_layout)
    else:
        l_rnd = l_i
    # l_i == 0 exactly when no key was visible (and then l_rnd too): output 0 and LSE -inf
    # instead of 0/0.
    empty_row = l_i == 0.0
    l_safe = gl.where(empty_row, 1.0, l_i)
    l_rnd_safe = gl.where(empty_row, 1.0, l_rnd)
    if cfg.HAS_SINKS:
        sink, keys_share, l_tot, l_rnd_tot, m_tot = _sink_totals(prob, h, m_i, l_i, l_rnd)
        inv_l = gl.convert_layout(keys_share / l_rnd_tot, gl.SliceLayout(1, cfg.o_layout))
    else:
        inv_l = gl.convert_layout(1.0 / l_rnd_safe, gl.SliceLayout(1, cfg.o_layout))
    out32 = acc * gl.expand_dims(inv_l, 1)
    out = out32.to(cfg.dtype)
    if cfg.HAS_SINKS:
        # A row with no visible key stores the sink itself (its whole mass), not its base-2 round trip.
        lse = gl.where(empty_row, sink, (m_tot + gl.log2(l_tot)) * LN2)
    else:
        log2_l = gl.log2(l_safe)
        lse2 = m_i + log2_l
        lse = gl.where(empty_row, float("-inf"), lse2 * LN2)
    row_ids = rows.row_ids
    if cfg.VARLEN:
        row_off = h.to(gl.int64) * prob.total_q + prob.q_start + row_ids  # the packed rows' (H, total_q) planes
    else:
        row_off = (b * prob.H + h).to(gl.int64) * prob.L + row_ids
    gl.store(prob.LSE + row_off, lse, mask=row_ids < prob.L)
    if cfg.EXACT_DELTA:
        # Any integer c serves the backward (module docstring); c - m_i is taken as fp32 gives
        # it, so g stays right where m_i is so large that m_i + floor(log2 l) rounds back to m_i.
        m_safe = gl.where(empty_row, 0.0, m_i)
        pivot = m_safe + gl.floor(gl.log2(l_rnd_safe))
        if cfg.HAS_SINKS:
            # c from the keys' sum alone keeps round(exp2(s - c)) where it is without a sink (a large
            # sink would push it towards 16-bit underflow); g carries the sink's share of the mass.
            norm = gl.exp2(pivot - m_safe) * (keys_share / l_rnd_tot)
        else:
            norm = gl.exp2(pivot - m_safe) / l_rnd_safe
        if cfg.VARLEN:
            plane = gl.to_tensor(prob.H).to(gl.int64) * prob.total_q
        else:
            plane = sched.heads().to(gl.int64) * prob.L
        gl.store(prob.ROW_CONSTS + row_off, gl.where(empty_row, float("inf"), pivot), mask=row_ids < prob.L)
        gl.store(prob.ROW_CONSTS + plane + row_off, gl.where(empty_row, 0.0, norm), mask=row_ids < prob.L)
    sched.store_o(descs, prob, out32, out, b, h, row0, CONSUMER=CONSUMER)


@gluon.jit
def _sink_totals(prob, h, m_i, l_i, l_rnd):
    """HAS_SINKS: head h's sink (natural log) and the row's totals on the common max
    m_tot = max(m_i, sink·log2 e): keys_share = exp2(m_i - m_tot), l_tot = l_i·keys_share +
    exp2(sink₂ - m_tot) (the LSE's fp32 sum) and l_rnd_tot likewise from l_rnd (O's and g's
    denominator), so O = acc·keys_share / l_rnd_tot and LSE₂ = m_tot + log2 l_tot. One of the two
    exponentials is 1, so nothing overflows however far the sink is from the keys, and a row with
    no visible key (m_i = -inf, l = 0) gets O = 0 and LSE₂ = sink₂ without a special case; the
    totals are 0 only where the sink is -inf too (then 1 stands in, and the LSE is -inf)."""
    sink = gl.load(prob.SINKS + h)
    sink2 = sink * 1.4426950408889634
    m_tot = gl.maximum(m_i, sink2)
    m_tot = gl.where(m_tot == float("-inf"), 0.0, m_tot)
    keys_share = gl.exp2(m_i - m_tot)
    sink_term = gl.exp2(sink2 - m_tot)
    l_tot = l_i * keys_share + sink_term
    l_rnd_tot = l_rnd * keys_share + sink_term
    none = l_tot == 0.0
    l_tot = gl.where(none, 1.0, l_tot)
    l_rnd_tot = gl.where(none, 1.0, l_rnd_tot)
    m_tot = gl.where(none, float("-inf"), m_tot)
    return sink, keys_share, l_tot, l_rnd_tot, m_tot


@gluon.jit
def _attn_fwd_hopper(q_desc, k_desc, v_desc, o_desc, r_desc, args, switches: gl.constexpr):
    """Grid (cdiv(L, BLOCK_M * NUM_CONSUMERS), B * H), walked in the order ``swizzle_heads`` sets;
    under PERSISTENT (at most one CTA per SM, 1-D) each CTA takes the block of its own index, then
    claims the next ones from WORK_COUNTER (int32, zero at launch) in that order, so the longest
    blocks start first wherever they land, and a block's loads overlap the previous one's epilogue.
    Q/K/V/O descriptors are 4-D over (B, H, L or S, E) with boxes (1, 1, rows, E), so TMA clips
    and zero-fills per head. Under EXACT_DELTA ``r_desc`` describes O's residual (as O) and
    ROW_CONSTS is (2, B, H, L) fp32 (pivot, g); otherwise neither is touched.
    ``args`` (``hopper_args.FwdArgs``): LSE (B, H, L) fp32; under HAS_KEY_BIAS, KEY_BIAS is (B, H, S)
    fp32, contiguous (glossary), otherwise it is not read; BH = B·H; under HAS_BLOCK_SPARSITY,
    ``lists`` (``hopper_args.TileListArgs``) is int32 (B or 1, H or 1, blocks, list_stride), one row a
    query block: its tile count, then its key tiles (``launch.block_tiles.gluon_tile_lists``), else not
    read; under SOFTCAP, ``softcap_log2`` = c·log2 e and ``tanh_scale`` = scale / c (fp32; qk_scale is
    then not read), otherwise neither is; under HAS_SINKS, SINKS is (H,) fp32, each query head's sink
    logit in natural log, else None (a constexpr then, so the launch's parameters are those of a
    kernel without it). Under VARLEN the tensors are packed (glossary): descriptors
    over (1, H, total, E) views, L and S the packed totals, grid (total_q // ROWS + n_seq, H)
    (``PackedRows``), OUT and RESID (the latter under EXACT_DELTA) O and its residual as contiguous
    (total_q, H, E) tensors, which ``o_desc``/``r_desc`` describe too but are not stored through; LSE
    (H, total_q), ROW_CONSTS (2, H, total_q); CU_Q, CU_K, n_seq and diag_shift as ``PackedRows`` takes
    them. Otherwise those six are None and not read. ``switches`` (``hopper_args.FwdSwitches``): the
    glossary's constexprs."""
    gl.static_assert(switches.NUM_CONSUMERS == 2 or switches.NUM_CONSUMERS == 3, "two or three consumer warpgroups")
    gl.static_assert(not (switches.VARLEN and (switches.PERSISTENT or switches.HAS_BLOCK_SPARSITY
                                               or switches.HAS_KEY_BIAS)),
                     "VARLEN launches on the grid, without a block-sparse layout or a key mask")
    cfg = FwdConfig(q_desc, k_desc, NUM_STAGES=switches.NUM_STAGES, NUM_CONSUMERS=switches.NUM_CONSUMERS,
                    IS_CAUSAL=switches.IS_CAUSAL, WINDOW_LEFT=switches.WINDOW_LEFT, PINGPONG=switches.PINGPONG,
                    EXACT_DELTA=switches.EXACT_DELTA, HAS_KEY_BIAS=switches.HAS_KEY_BIAS,
                    SKIP_MASKED_TILES=switches.SKIP_MASKED_TILES, PERSISTENT=switches.PERSISTENT,
                    HAS_BLOCK_SPARSITY=switches.HAS_BLOCK_SPARSITY, SOFTCAP=switches.SOFTCAP,
                    HAS_SINKS=switches.HAS_SINKS, VARLEN=switches.VARLEN)
    gl.static_assert((cfg.HEAD_DIM == switches.HEAD_DIM) & (cfg.BLOCK_M == switches.BLOCK_M)
                     & (cfg.BLOCK_N == switches.BLOCK_N), "HEAD_DIM, BLOCK_M and BLOCK_N are the descriptors' boxes")
    qk_scale = args.qk_scale.to(gl.float32)
    lists = args.lists
    prob = FwdProblem(args.L, args.S, args.H, args.BH, args.GROUP, args.causal_offset, args.window_lower, qk_scale,
                      args.swizzle_heads, args.LSE, args.ROW_CONSTS, args.KEY_BIAS, args.WORK_COUNTER,
                      TileLists(lists.base, lists.stride_lb, lists.stride_lh, lists.list_stride),
                      args.softcap_log2, args.tanh_scale, args.SINKS,
                      PackedRows(args.CU_Q, args.CU_K, args.n_seq, args.diag_shift), args.OUT, args.RESID)
    bufs = allocate(cfg, q_desc, k_desc, v_desc, o_desc)
    sched = FwdScheduler(cfg, prob, bufs)
    descs = FwdDescs(q_desc, k_desc, v_desc, o_desc, r_desc)
    # The default partition is consumer 0; every partition takes the scheduler (config, problem,
    # buffers) and the descriptors.
    CONSUMER_REGS: gl.constexpr = switches.CONSUMER_REGS
    LOADER_REGS: gl.constexpr = switches.LOADER_REGS
    if switches.NUM_CONSUMERS == 2:
        gl.warp_specialize([
            (_hopper_fwd_consumer, (sched, descs, 0)),
            (_hopper_fwd_consumer, (sched, descs, 1)),
            (_hopper_fwd_loader, (sched, descs)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
    else:
        gl.warp_specialize([
            (_hopper_fwd_consumer, (sched, descs, 0)),
            (_hopper_fwd_consumer, (sched, descs, 1)),
            (_hopper_fwd_consumer, (sched, descs, 2)),
            (_hopper_fwd_loader, (sched, descs)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, LOADER_REGS])
