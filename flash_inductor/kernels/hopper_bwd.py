"""Hopper (sm_90) attention backward in Gluon, FA3's one-pass shape: one CTA per (key block,
batch, KV head) keeps its K and V in shared memory, streams every (query head of the GQA group,
query tile) through a TMA + mbarrier ring that a loader warp fills, and computes the five GEMMs
of the tile pair in consumer warpgroups; dQ is summed across key blocks in an fp32 buffer by TMA
reduce-adds (or scalar atomics).

Glossary
--------
Symbols (consumer warpgroup c owns keys [n0 + 64c, n0 + 64c + 64) of the CTA's BLOCK_N = 128;
everything is computed *transposed*, keys along the MMA's M, query rows along its N, so that P
and dS come out of their wgmma already in the A-operand fragment of the dV and dK GEMMs):
  st       Sᵀ = K_c·Qᵀ for one query tile, fp32 straight out of wgmma, *unscaled*.
  qk_scale softmax scale · log2(e) (fp32). Scores in base 2 are ``st * qk_scale``.
  lse2     the forward's LSE in base 2 (LSE · log2 e), one per query row (a column of Sᵀ).
           A row that saw no key has LSE -inf; it is replaced by +inf, so every P of that row is
           exp2(s - inf) = 0 and the row's gradients are exactly 0 (never exp2(-inf + inf)).
           Query rows past L (TMA zero fill) load +inf too.
  pt       Pᵀ = exp2(st·qk_scale - lse2) in fp32 (the forward's P, recomputed from the LSE).
  dpt      dPᵀ = V_c·dOᵀ, fp32.
  delta    Δ_i = rowsum(dO_i ∘ O_i) - dLSE_i (the `fast` schedule's Δ, from the preprocess).
  dst      dSᵀ = Pᵀ∘(dPᵀ - Δ) in fp32; rounded to the input dtype only where it meets the
           matrix unit (FA2's direct cast; no fp16 rescaling yet).
  dv, dk   fp32 wgmma accumulators (64 keys x E) held for the whole query sweep:
           dV += Pᵀ·dO, dK += dSᵀ·Q; dK is multiplied by the softmax scale once at the end.
  dq       dQ_partial = scale·dS·K for this tile pair, fp32, added into the (B, Hq, L, E) fp32
           zeros of the dQ accumulator; the launcher only casts it.

Constexpr switches that say what is computed:
  HEAD_DIM    E of Q, K, V (64 or 128).
  IS_CAUSAL   key j is visible to query i iff j <= i + causal_offset (0: top-left, SDPA's); the
              upper side of a sliding window's band arrives here too (launch/band.py).
  WINDOW_LEFT key j is visible to query i only if j >= i + window_lower, the band's lower side:
              each CTA's query sweep ends at the last row that sees its last key, and only tiles
              that edge crosses take the select.
  HAS_KEY_BIAS a key mask as one base-2 bias per key (``launch.hopper.key_bias``): KEY_BIAS is
              (B, Hq, S) fp32, added to the scaled scores in the forward's order,
              Pᵀ = exp2((st·qk_scale + bias) - lse2), so the one-pass P rounds as the forward's.
  HAS_BLOCK_SPARSITY a block-sparse layout (``launch/block_tiles.py``): a CTA walks, for each query head
              of its part of the group, the query tiles listed for its key block,
              TILE_LISTS[b, h, key block] = (count, tile, tile, ...) in ascending order, rather than a
              contiguous range. The launcher takes only layouts whose blocks hold whole key blocks
              and query tiles, so a listed pair is computed everywhere and the mask needs only the
              band and S, by position, as a dense pair does. A key block with nothing listed keeps
              dK = dV = 0.

  VARLEN      packed sequences (FlashAttention's varlen, ``launch/packed.py``): Q, K, V, dO and the
              gradients are (1, H, total, E) views, sequence b's rows and keys [CU_Q[b], CU_Q[b + 1])
              and [CU_K[b], CU_K[b + 1]); a CTA computes one key block of one sequence as if the
              sequence were the whole problem (``BwdProblem.for_sequence``: its L, S and band, moved
              to its bottom-right diagonal under diag_shift), its loads at the sequence's first row
              and key. Rows and keys past the sequence's end belong to the next one and are masked
              as rows past L and keys past S are, so dQ's reduce-adds add exact zeros to the rows
              of the next sequence a box covers; dK and dV are stored row by row with a mask (a TMA
              box would write the next sequence's keys). The grid covers the packed keys
              (``PackedRows``), so only each sequence's own tiles run.
  SOFTCAP     FlashAttention-2's soft cap, as the forward's SOFTCAP (kernels/gluon_softcap.py): the
              tile's Sᵀ becomes tᵀ = tanh(st·tanh_scale) before the mask, Pᵀ = exp2(tᵀ·softcap_log2
              - lse2) (the forward's very formula, so under EXACT_DELTA P̃ rounds as the forward's),
              and dSᵀ takes the slope gᵀ = 1 - tᵀ², kept from before the mask (finite everywhere), on
              its way to the dK and dQ GEMMs: dUᵀ = dSᵀ∘gᵀ, the gradient of u = scale·q·k. Δ, P and
              dV are unchanged (kernels/attn_bwd.py, "Soft cap"). Under EXACT_DELTA the row sums of
              dS are still dLSE, but those of dU are not, so the launcher does not centre the keys
              (CENTRE_KEYS off: its add-back is dLSE·k̂).

Switches that change the numerics (the rounding or the order of sums; within the schedule's contract):
  EXACT_DELTA the `stable` schedule's exact Δ in one pass (docs/hopper_backward.md), from a
              forward run with its own EXACT_DELTA:
                lse2   is the forward's integer pivot c (base 2, +inf for a row with no key),
                pt     round(exp2(st·qk_scale - c)): bitwise the P̃ the forward's P·V used, up to
                       a power of two, so dSᵀ = P̃ᵀ∘(dPᵀ - Δ) sums to zero over a row exactly
                       when Δ = dO'·(O + resid), which the preprocess forms;
                dO     is dO' = round(g·dO) (g the forward's row normaliser, P = g·P̃), so
                       dV += P̃ᵀ·dO' and dPᵀ = V·dO'ᵀ need no per-score scaling;
                ds_up  a power of two from the preprocess (1 for bf16, not loaded; for fp16 it keeps the
                       call's bound on |dS| at 2^14) taken into dS by one FFMA and out of dK
                       and dQ with the softmax scale.
  CENTRE_KEYS dQ's GEMM takes the centred keys K̃ = K − k̂ (k̂: MEAN_KEY, (B·H_KV, E) fp32, per
              head and dimension a value every key lies within a factor of two of, or 0;
              ops/one_pass.py), so dS's rounding for dS·K meets only the keys' spread, not their
              shared part; the launcher adds dLSE·k̂ back to dq. Each consumer writes its 64 rows of
              K̃ (exact: Sterbenz) into ``kt_smem`` once, from the CTA's K tile; Sᵀ keeps K, so P̃
              is the forward's bit for bit. Under DQ_SPLIT the first tile's dS handshake also
              publishes each consumer's K̃ rows to the other.
  BLOCK_M     query rows per streamed tile (the N of Sᵀ, the K of the dV/dK GEMMs).
  DQ_SPLIT    False: each consumer computes dS_c·K_c (BLOCK_M x E, over its own 64 keys) and
              adds it atomically, two partial dQ per tile pair. True (FA3's split): both
              consumers' dSᵀ go to one shared (128 x BLOCK_M) buffer and consumer c computes
              columns [c·E/2, (c+1)·E/2) of dS·K over all 128 keys: half the atomics and half
              the dQ accumulator registers, for one mbarrier handshake per tile between the two.
  group_split the GQA group's query heads are split over this many CTAs per (key block, batch,
              KV head), each walking GROUP / group_split of them (a divisor): a grid with few KV
              heads then still fills the GPU. With more than one part each CTA's dK and dV are
              partial sums: under DKDV_PARTIALS they go, scaled, as fp32 to DKDV_PART
              (2, group_split, B, H_KV, S, E), which the launcher sums in a fixed order (so dK and
              dV stay deterministic) and casts.
  DKDV_PARTIALS dK and dV as fp32 partial sums into DKDV_PART (group_split above) instead of TMA
              stores of the finished tiles.

Speed only (tuned in tuning/hopper_configs.py or set by the launcher; dK and dV bitwise the same, dQ up to
the order of its fp32 adds, which the reduce-adds and atomics leave unspecified anyway):
  BLOCK_N     keys per CTA, 64 per consumer warpgroup (two consumers: 128).
  NUM_STAGES  depth of the Q/dO ring.
  DQ_TMA      True: each consumer stores its dQ partial into its own fp32 shared tile and adds
              it to the accumulator with one TMA reduce-add (``dq_desc``, box BLOCK_M x its dQ
              columns), waited for only before the tile is written again, a tile pair later.
              False: one relaxed scalar atomic add per element (``DQ_ACCUM``'s pointer).
  ROW_STATS_TMA the loader brings each tile's LSE and Δ rows into shared memory with the tile's Q
              and dO (one (1, BLOCK_M) TMA box of fp32 each, ``lse_desc``/``delta_desc`` over the
              (B·Hq, L) planes, on the Q and dO ready barriers), as FA3 does; the consumers read
              them from shared memory after the barrier. False: the consumers load them from global
              memory at the top of each tile (L2 latency on the path to the first exp2).
              The planes' rows are ``stride_stats`` apart, a multiple of 4 (16 bytes, as TMA
              needs): the launcher pads them where L is not.
  PAIRED_TILES the consumers walk their tiles two an iteration (``_consumer_tile`` twice), the first
              call issuing the second tile's Sᵀ before its last wait, so that the tensor cores run it
              under the first tile's dQ epilogue; an odd walk's last tile goes alone. Only in
              straight-line code does ptxas keep that overlap asynchronous (a token carried over
              the loop's back edge serialises every wgmma, tools/wgmma_overlap_probe.py).
  EVEN_L      L is a multiple of BLOCK_M (the launcher's promise): no tile has rows past L, so the
              row statistics need no mask (32 selects and 16 compares a thread a tile under
              EXACT_DELTA).
  swizzle_heads the grid order (``_cta_coords``): CTAs walk the grid's rows (batch, KV head, group
              part) in groups of this many, key block by key block within a group, so under
              causal masking each group's longest CTAs start first while the CTAs in flight share
              few heads' Q and dO in L2. 1: each row's key blocks together; all rows: every row's
              first key block first.
  CONSUMER_REGS, LOADER_REGS the registers setmaxnreg gives each consumer warpgroup and the loader.

Code: ``BwdConfig`` holds the switches and layouts (sizes from the descriptors), ``BwdProblem`` the
call's scalars and pointers, ``BwdBuffers`` the shared memory and barriers, whose rings
(``hopper_pipeline.Ring``: the Q/dO ring and the DQ_SPLIT dS handshake) own the slot and phase
arithmetic; ``QueryWalk`` is the walk's state; ``ConsumerKeys`` what every tile of a consumer reads.
``_consumer_tile`` (hopper_bwd_tile.py) is one tile's step. Every partition takes
(config, problem, descriptors, buffers[, consumer]).

Precision contract as ``kernels/attn_bwd.py`` under the `fast` schedule: S, P, dP and dS stay
fp32 until dS meets the matrix unit; P rounded to the input dtype for dV, dS for dK and dQ.
Under EXACT_DELTA, `stable`'s: the exact Δ, and fp16 dS scaled into range.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.language.core import _aggregate as aggregate
from triton.language.core import base_value

from .gluon_tma import tma_load, tma_store
from .grid_order import swizzled_cta
from .hopper_bwd_tile import ConsumerKeys, _consumer_tile
from .hopper_packed import PackedRows, backward_block, k_row, q_row, store_packed_rows
from .hopper_pipeline import MaybeSmem, Ring, Scalar, TileLists, field

KEYS_PER_CONSUMER = gl.constexpr(64)
NUM_CONSUMERS = gl.constexpr(2)


@gluon.constexpr_function
def _wgmma_layout(n):
    """A wgmma accumulator over 64 rows (one warpgroup), N = n in one instruction."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@aggregate
class BwdConfig:
    """The backward's constexprs (the glossary's switches) and register layouts. HEAD_DIM and
    BLOCK_M are Q's box; BLOCK_N is the CTA's keys, KC = 64 per consumer (K's box)."""
    HEAD_DIM: gl.constexpr
    BLOCK_M: gl.constexpr
    BLOCK_N: gl.constexpr
    KC: gl.constexpr
    NUM_STAGES: gl.constexpr
    IS_CAUSAL: gl.constexpr
    WINDOW_LEFT: gl.constexpr
    DQ_SPLIT: gl.constexpr
    DQ_TMA: gl.constexpr
    EXACT_DELTA: gl.constexpr
    HAS_KEY_BIAS: gl.constexpr
    ROW_STATS_TMA: gl.constexpr
    DKDV_PARTIALS: gl.constexpr
    CENTRE_KEYS: gl.constexpr
    HAS_BLOCK_SPARSITY: gl.constexpr
    EVEN_L: gl.constexpr
    PAIRED_TILES: gl.constexpr
    SOFTCAP: gl.constexpr
    VARLEN: gl.constexpr
    dtype: gl.constexpr
    DQ_COLS: gl.constexpr     # dQ's columns per consumer: E / 2 under DQ_SPLIT, else E
    s_layout: gl.constexpr    # Sᵀ and dPᵀ: (64 keys) x (BLOCK_M query rows)
    kv_layout: gl.constexpr   # dK, dV: (64 keys) x E
    dq_layout: gl.constexpr   # (BLOCK_M, DQ_COLS)
    a_layout: gl.constexpr    # Pᵀ and dSᵀ as the dV/dK GEMMs' A operand: Sᵀ's fragment already is one
    col_layout: gl.constexpr  # one value per query row
    key_layout: gl.constexpr  # one value per key

    @gluon.constexpr_function
    def __init__(self, q_desc, k_desc, NUM_STAGES, IS_CAUSAL, WINDOW_LEFT, DQ_SPLIT, DQ_TMA, EXACT_DELTA, HAS_KEY_BIAS,
                 ROW_STATS_TMA, DKDV_PARTIALS, CENTRE_KEYS, HAS_BLOCK_SPARSITY, EVEN_L, PAIRED_TILES, SOFTCAP=False,
                 VARLEN=False):
        self.HEAD_DIM = gl.constexpr(q_desc.block_type.shape[3])
        self.BLOCK_M = gl.constexpr(q_desc.block_type.shape[2])
        self.KC = gl.constexpr(k_desc.block_type.shape[2])
        self.BLOCK_N = gl.constexpr(self.KC.value * NUM_CONSUMERS.value)
        self.NUM_STAGES = field(NUM_STAGES)
        self.IS_CAUSAL = field(IS_CAUSAL)
        self.WINDOW_LEFT = field(WINDOW_LEFT)
        self.DQ_SPLIT = field(DQ_SPLIT)
        self.DQ_TMA = field(DQ_TMA)
        self.EXACT_DELTA = field(EXACT_DELTA)
        self.HAS_KEY_BIAS = field(HAS_KEY_BIAS)
        self.ROW_STATS_TMA = field(ROW_STATS_TMA)
        self.DKDV_PARTIALS = field(DKDV_PARTIALS)
        self.CENTRE_KEYS = field(CENTRE_KEYS)
        self.HAS_BLOCK_SPARSITY = field(HAS_BLOCK_SPARSITY)
        self.EVEN_L = field(EVEN_L)
        self.PAIRED_TILES = field(PAIRED_TILES)
        self.SOFTCAP = field(SOFTCAP)
        self.VARLEN = field(VARLEN)
        self.dtype = gl.constexpr(q_desc.dtype)
        E = self.HEAD_DIM.value
        self.DQ_COLS = gl.constexpr(E // NUM_CONSUMERS.value if DQ_SPLIT else E)
        s_layout = _wgmma_layout(self.BLOCK_M.value)
        kv_layout = _wgmma_layout(E)
        self.s_layout = gl.constexpr(s_layout)
        self.kv_layout = gl.constexpr(kv_layout)
        self.dq_layout = gl.constexpr(_wgmma_layout(self.DQ_COLS.value))
        self.a_layout = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2))
        self.col_layout = gl.constexpr(gl.SliceLayout(0, s_layout))
        self.key_layout = gl.constexpr(gl.SliceLayout(1, s_layout))


@aggregate
class BwdProblem:
    """The call's sizes, scalars and pointers (the entry point's docstring); ``softcap_log2`` and
    ``tanh_scale``, the soft cap's fp32 factors (SOFTCAP), as the forward's ``FwdProblem`` has them."""
    L: Scalar
    S: Scalar
    H_KV: Scalar
    GROUP: Scalar
    group_split: Scalar
    stride_stats: Scalar
    causal_offset: Scalar
    window_lower: Scalar
    qk_scale: Scalar
    sm_scale: Scalar
    swizzle_heads: Scalar
    LSE: gl.tensor
    DELTA: gl.tensor
    DQ_ACCUM: gl.tensor
    DS_UP: gl.tensor
    KEY_BIAS: gl.tensor
    MEAN_KEY: gl.tensor
    DKDV_PART: gl.tensor
    lists: TileLists
    softcap_log2: Scalar
    tanh_scale: Scalar
    packed: PackedRows
    DK: Scalar
    DV: Scalar
    q_start: Scalar
    k_start: Scalar
    total_q: Scalar

    @gluon.constexpr_function
    def __init__(self, L, S, H_KV, GROUP, group_split, stride_stats, causal_offset, window_lower, qk_scale, sm_scale,
                 swizzle_heads, LSE, DELTA, DQ_ACCUM, DS_UP, KEY_BIAS, MEAN_KEY, DKDV_PART, lists, softcap_log2,
                 tanh_scale, packed, DK=None, DV=None, q_start=0, k_start=0, total_q=0):
        self.L = field(L)
        self.S = field(S)
        self.H_KV = field(H_KV)
        self.GROUP = field(GROUP)
        self.group_split = field(group_split)
        self.stride_stats = field(stride_stats)
        self.causal_offset = field(causal_offset)
        self.window_lower = field(window_lower)
        self.qk_scale = field(qk_scale)
        self.sm_scale = field(sm_scale)
        self.swizzle_heads = field(swizzle_heads)
        self.LSE = field(LSE)
        self.DELTA = field(DELTA)
        self.DQ_ACCUM = field(DQ_ACCUM)
        self.DS_UP = field(DS_UP)
        self.KEY_BIAS = field(KEY_BIAS)
        self.MEAN_KEY = field(MEAN_KEY)
        self.DKDV_PART = field(DKDV_PART)
        self.lists = field(lists)
        self.softcap_log2 = field(softcap_log2)
        self.tanh_scale = field(tanh_scale)
        self.packed = field(packed)
        self.DK = field(DK)
        self.DV = field(DV)
        self.q_start = field(q_start)
        self.k_start = field(k_start)
        self.total_q = field(total_q)

    @gluon.jit
    def for_sequence(self, b):
        """Sequence b's problem (VARLEN): this one's, with its lengths, band and first rows."""
        q_start, k_start, seq_q, seq_k, causal_offset, window_lower = self.packed.sequence(
            b, self.L, self.S, self.causal_offset, self.window_lower)
        return BwdProblem(seq_q, seq_k, self.H_KV, self.GROUP, self.group_split, self.stride_stats, causal_offset,
                          window_lower, self.qk_scale, self.sm_scale, self.swizzle_heads, self.LSE, self.DELTA,
                          self.DQ_ACCUM, self.DS_UP, self.KEY_BIAS, self.MEAN_KEY, self.DKDV_PART, self.lists,
                          self.softcap_log2, self.tanh_scale, self.packed, self.DK, self.DV, q_start, k_start, self.L)


@aggregate
class BwdDescs:
    q: base_value
    k: base_value
    v: base_value
    do: base_value
    dk: base_value
    dv: base_value
    dq: base_value
    lse: base_value
    delta: base_value

    @gluon.constexpr_function
    def __init__(self, q, k, v, do, dk, dv, dq, lse, delta):
        self.q = field(q)
        self.k = field(k)
        self.v = field(v)
        self.do = field(do)
        self.dk = field(dk)
        self.dv = field(dv)
        self.dq = field(dq)
        self.lse = field(lse)
        self.delta = field(delta)


@aggregate
class BwdBuffers:
    """Shared memory and barriers. The Q/dO ring (``ring``: q_ready, q_empty; do_ready beside it)
    with the tiles' LSE and Δ rows (ROW_STATS_TMA, else None); K and V whole, each consumer's 64
    rows a slice (kv_ready per consumer); K̃ (CENTRE_KEYS, else None); dSᵀ (``ds_ring``: the
    two-deep DQ_SPLIT handshake); each consumer's fp32 dQ tile (DQ_TMA, else None)."""
    q_smem: gl.shared_memory_descriptor
    do_smem: gl.shared_memory_descriptor
    k_smem: gl.shared_memory_descriptor
    v_smem: gl.shared_memory_descriptor
    kt_smem: MaybeSmem
    ds_smem: gl.shared_memory_descriptor
    dq_smem: MaybeSmem
    lse_smem: MaybeSmem
    delta_smem: MaybeSmem
    kv_ready: gl.shared_memory_descriptor
    do_ready: gl.shared_memory_descriptor
    ring: Ring
    ds_ring: Ring

    @gluon.constexpr_function
    def __init__(self, q_smem, do_smem, k_smem, v_smem, kt_smem, ds_smem, dq_smem, lse_smem, delta_smem, kv_ready,
                 do_ready, ring, ds_ring):
        self.q_smem = field(q_smem)
        self.do_smem = field(do_smem)
        self.k_smem = field(k_smem)
        self.v_smem = field(v_smem)
        self.kt_smem = field(kt_smem)
        self.ds_smem = field(ds_smem)
        self.dq_smem = field(dq_smem)
        self.lse_smem = field(lse_smem)
        self.delta_smem = field(delta_smem)
        self.kv_ready = field(kv_ready)
        self.do_ready = field(do_ready)
        self.ring = field(ring)
        self.ds_ring = field(ds_ring)


@aggregate
class QueryWalk:
    """The state of a CTA's walk over its (query head, query tile) pairs: tile i of head hh, of
    ``count`` tiles (dense: n_m; HAS_BLOCK_SPARSITY: the listed ones, ``tiles``, else None)."""
    hh: Scalar
    i: Scalar
    count: Scalar
    tiles: Scalar

    @gluon.constexpr_function
    def __init__(self, hh, i, count, tiles):
        self.hh = field(hh)
        self.i = field(i)
        self.count = field(count)
        self.tiles = field(tiles)


@gluon.jit
def _q_tiles(cfg, prob, n0):
    """(first query tile, number of query tiles) that can see a key of [n0, n0 + BLOCK_N).
    Query i sees key j iff j <= i + causal_offset (IS_CAUSAL) and j >= i + window_lower
    (WINDOW_LEFT): the first row to see key n0 is n0 - causal_offset, the last row to see key
    n0 + BLOCK_N - 1 is n0 + BLOCK_N - 1 - window_lower. The count is 0 when no row does (the
    block's dK and dV are then 0)."""
    BLOCK_M: gl.constexpr = cfg.BLOCK_M
    n_all = gl.cdiv(prob.L, BLOCK_M)
    if cfg.IS_CAUSAL:
        first = gl.maximum(n0 - prob.causal_offset, 0) // BLOCK_M
        first = gl.minimum(first, n_all)
    else:
        first = n0 * 0
    end = n_all
    if cfg.WINDOW_LEFT:
        end = gl.minimum(gl.cdiv(gl.maximum(n0 + cfg.BLOCK_N - prob.window_lower, 0), BLOCK_M), n_all)
        end = gl.maximum(end, first)
    return first, end - first


@gluon.jit
def _listed_q_tiles(cfg, prob, b, h, n0):
    """(count, list) of the query tiles listed for the key block at n0, query head h (HAS_BLOCK_SPARSITY)."""
    row = prob.lists.row(b, h, n0, BLOCK=cfg.BLOCK_N)
    return gl.load(row), row + 1


@gluon.jit
def _walk_start(cfg, prob, b, h0, heads, n0, n_m):
    """(the number of (query head, query tile) pairs the CTA walks, the walk's start): dense,
    ``heads`` times its ``n_m`` tiles; under HAS_BLOCK_SPARSITY, the listed ones. The loader and
    the consumers walk it alike (``_walk_step``), so ring slot t holds the same pair for both.
    The dense walk's state, carried from tile to tile, spares each tile an integer division of t
    by n_m (about 25 instructions a thread; 8-10 % of the consumers' tile loop, and 0.5-3 % of a
    causal 4k training step measured on the H200)."""
    if cfg.HAS_BLOCK_SPARSITY:
        # Head 0's count and list start the walk; the total is over every head's.
        count, tiles = _listed_q_tiles(cfg, prob, b, h0, n0)
        n_pairs = count
        for hh in range(1, heads):
            more, _ = _listed_q_tiles(cfg, prob, b, h0 + hh, n0)
            n_pairs += more
    else:
        n_pairs = heads * n_m
        count = n_m
        tiles = None
    return n_pairs, QueryWalk(gl.to_tensor(0), gl.to_tensor(0), count, tiles)


@gluon.jit
def _walk_step(cfg, prob, walk, first, h0, b, n0):
    """(query head, first query row) of the walk's current pair, and the walk's next state."""
    if cfg.HAS_BLOCK_SPARSITY:
        # From the i-th listed tile of query head h0 + hh, past heads with none left (the caller
        # takes exactly the listed total of steps).
        hh = walk.hh
        i = walk.i
        count = walk.count
        tiles = walk.tiles
        while i >= count:
            hh += 1
            i = 0
            count, tiles = _listed_q_tiles(cfg, prob, b, h0 + hh, n0)
        m = gl.load(tiles + i) * cfg.BLOCK_M
        return h0 + hh, m, QueryWalk(hh, i + 1, count, tiles)
    else:
        # Pair t is tile i of head hh; the next is tile i + 1, or tile 0 of the next head.
        wrap = walk.i + 1 == walk.count
        return (h0 + walk.hh, (first + walk.i) * cfg.BLOCK_M,
                QueryWalk(gl.where(wrap, walk.hh + 1, walk.hh), gl.where(wrap, 0, walk.i + 1), walk.count, walk.tiles))


@gluon.jit
def _rows4d(kv_smem, c):
    """Consumer c's 64 rows of a (BLOCK_N, E) K/V tile, seen with the descriptor's 4-D box."""
    return kv_smem.slice(c * KEYS_PER_CONSUMER, KEYS_PER_CONSUMER, dim=2)


@gluon.jit
def _cta_coords(cfg, prob):
    """(first key, batch, KV head, part, query heads per part) of this CTA: the grid is
    (key blocks, B·H_KV·group_split), walked in the order ``swizzle_heads`` sets
    (``grid_order.py``); a row is (batch, KV head, part of the group's query heads). Under causal
    masking the first key blocks see the most query tiles, so each group's longest CTAs start
    first. Unsplit (not DKDV_PARTIALS) the row is (batch, KV head), spelled without the part's
    arithmetic so that the kernel compiles as it did before the split existed."""
    pid_n, row, _blocks = swizzled_cta(prob.swizzle_heads)
    if cfg.DKDV_PARTIALS:
        part = row % prob.group_split
        bh = row // prob.group_split
        h_kv = bh % prob.H_KV
        heads = prob.GROUP // prob.group_split
        return pid_n * cfg.BLOCK_N, bh // prob.H_KV, h_kv, part, heads
    else:
        return pid_n * cfg.BLOCK_N, row // prob.H_KV, row % prob.H_KV, 0, prob.GROUP


@gluon.jit
def _hopper_bwd_loader(cfg, prob, descs, bufs):
    """One warp: each consumer's K and V once, then Q and dO tiles (with their LSE and Δ rows
    under ROW_STATS_TMA) into the ring."""
    if cfg.VARLEN:
        n0, seq, h_kv = backward_block(cfg, prob, WARPS=1)
        if n0 < seq.S:
            _load_walk(cfg, seq, descs, bufs, n0, 0, h_kv, 0, prob.GROUP)
    else:
        n0, b, h_kv, part, heads = _cta_coords(cfg, prob)
        _load_walk(cfg, prob, descs, bufs, n0, b, h_kv, part, heads)


@gluon.jit
def _load_walk(cfg, prob, descs, bufs, n0, b, h_kv, part, heads):
    """The loader's work for key block n0 of (batch b, KV head h_kv), part ``part`` of its group."""
    for c in gl.static_range(NUM_CONSUMERS):
        mbarrier.expect(bufs.kv_ready.index(c), descs.k.block_type.nbytes + descs.v.block_type.nbytes)
        key0 = k_row(cfg, prob, n0 + c * KEYS_PER_CONSUMER)
        tma_load(descs.k, [b, h_kv, key0, 0], bufs.kv_ready.index(c), _rows4d(bufs.k_smem, c))
        tma_load(descs.v, [b, h_kv, key0, 0], bufs.kv_ready.index(c), _rows4d(bufs.v_smem, c))
    first, n_m = _q_tiles(cfg, prob, n0)
    h0 = h_kv * prob.GROUP + part * heads
    n_pairs, walk = _walk_start(cfg, prob, b, h0, heads, n0, n_m)
    ring = bufs.ring
    for t in range(n_pairs):
        slot = ring.slot(t)
        ring.wait_free_at(slot, t)
        h, m, walk = _walk_step(cfg, prob, walk, first, h0, b, n0)
        m = q_row(cfg, prob, m)  # the descriptors' row
        if cfg.ROW_STATS_TMA:
            # Rows past L come back as TMA's zeros; the consumers replace them anyway.
            bh = b * prob.H_KV * prob.GROUP + h
            q_ready = ring.ready.index(slot)
            mbarrier.expect(q_ready, descs.q.block_type.nbytes + descs.lse.block_type.nbytes)
            tma_load(descs.q, [b, h, m, 0], q_ready, bufs.q_smem.index(slot))
            tma_load(descs.lse, [bh, m], q_ready, bufs.lse_smem.index(slot))
            do_ready = bufs.do_ready.index(slot)
            mbarrier.expect(do_ready, descs.do.block_type.nbytes + descs.delta.block_type.nbytes)
            tma_load(descs.do, [b, h, m, 0], do_ready, bufs.do_smem.index(slot))
            tma_load(descs.delta, [bh, m], do_ready, bufs.delta_smem.index(slot))
        else:
            q_ready = ring.ready.index(slot)
            mbarrier.expect(q_ready, descs.q.block_type.nbytes)
            tma_load(descs.q, [b, h, m, 0], q_ready, bufs.q_smem.index(slot))
            do_ready = bufs.do_ready.index(slot)
            mbarrier.expect(do_ready, descs.do.block_type.nbytes)
            tma_load(descs.do, [b, h, m, 0], do_ready, bufs.do_smem.index(slot))


@gluon.jit
def _hopper_bwd_consumer(cfg, prob, descs, bufs, CONSUMER: gl.constexpr):
    """One warpgroup: its 64 keys of the CTA's block against every (query head, query tile) pair of
    the walk; dK and dV accumulated in registers and stored at the end."""
    if cfg.VARLEN:
        n0, seq, h_kv = backward_block(cfg, prob, WARPS=4)
        if n0 < seq.S:
            _consume_walk(cfg, seq, descs, bufs, n0, 0, h_kv, 0, prob.GROUP, CONSUMER=CONSUMER)
    else:
        n0, b, h_kv, part, heads = _cta_coords(cfg, prob)
        _consume_walk(cfg, prob, descs, bufs, n0, b, h_kv, part, heads, CONSUMER=CONSUMER)


@gluon.jit
def _consume_walk(cfg, prob, descs, bufs, n0, b, h_kv, part, heads, CONSUMER: gl.constexpr):
    """The consumer's work for key block n0 of (batch b, KV head h_kv), part ``part`` of its group."""
    k0 = n0 + CONSUMER * cfg.KC
    key_ids = k0 + gl.arange(0, cfg.KC, layout=cfg.key_layout)
    first, n_m = _q_tiles(cfg, prob, n0)
    H_Q = prob.H_KV * prob.GROUP
    keys, dk, dv = _consumer_keys(cfg, prob, bufs, b, h_kv, k0, key_ids, H_Q, CONSUMER=CONSUMER)
    h0 = h_kv * prob.GROUP + part * heads
    # The loader's walk, step for step.
    n_pairs, walk = _walk_start(cfg, prob, b, h0, heads, n0, n_m)
    if cfg.PAIRED_TILES:
        for pair in range(n_pairs // 2):
            t = 2 * pair
            h, m, walk = _walk_step(cfg, prob, walk, first, h0, b, n0)
            h_b, m_b, walk = _walk_step(cfg, prob, walk, first, h0, b, n0)
            dv, dk, st_b = _consumer_tile(cfg, prob, descs, bufs, keys, t, h, m, dv, dk, None, t + 1,
                                          CONSUMER=CONSUMER, ST_ISSUED=False, ISSUE_NEXT=True)
            dv, dk, st_b = _consumer_tile(cfg, prob, descs, bufs, keys, t + 1, h_b, m_b, dv, dk, st_b, t + 1,
                                          CONSUMER=CONSUMER, ST_ISSUED=True, ISSUE_NEXT=False)
        first_single = n_pairs - n_pairs % 2  # an odd walk's last tile, alone
    else:
        first_single = 0
    for t in range(first_single, n_pairs):
        h, m, walk = _walk_step(cfg, prob, walk, first, h0, b, n0)
        dv, dk, _ = _consumer_tile(cfg, prob, descs, bufs, keys, t, h, m, dv, dk, None, t, CONSUMER=CONSUMER,
                                   ST_ISSUED=False, ISSUE_NEXT=False)
    _store_dkdv(cfg, prob, descs, bufs, keys, dk, dv, part, b, h_kv, CONSUMER=CONSUMER)


@gluon.jit
def _consumer_keys(cfg, prob, bufs, b, h_kv, k0, key_ids, H_Q, CONSUMER: gl.constexpr):
    """This consumer's ``ConsumerKeys`` and zero dK, dV, once K and V (and K̃ under CENTRE_KEYS)
    are in shared memory."""
    KC: gl.constexpr = cfg.KC
    HEAD_DIM: gl.constexpr = cfg.HEAD_DIM
    k_2d = bufs.k_smem.reshape([cfg.BLOCK_N, HEAD_DIM])
    v_2d = bufs.v_smem.reshape([cfg.BLOCK_N, HEAD_DIM])
    k_tile = k_2d.slice(CONSUMER * KC, KC, dim=0)
    v_tile = v_2d.slice(CONSUMER * KC, KC, dim=0)
    # dQ's keys: K̃ under CENTRE_KEYS (written below, once K has landed), else K itself.
    if cfg.CENTRE_KEYS:
        kq_2d = bufs.kt_smem.reshape([cfg.BLOCK_N, HEAD_DIM])
    else:
        kq_2d = k_2d
    kq_tile = kq_2d.slice(CONSUMER * KC, KC, dim=0)
    if cfg.DQ_SPLIT:
        # All 128 keys, columns of this consumer's half of E: the B operand of dS·K.
        k_all = kq_2d.slice(CONSUMER * cfg.DQ_COLS, cfg.DQ_COLS, dim=1)
    else:
        k_all = None
    dk = gl.zeros([KC, HEAD_DIM], gl.float32, layout=cfg.kv_layout)
    dv = gl.zeros([KC, HEAD_DIM], gl.float32, layout=cfg.kv_layout)
    s_zero = gl.zeros([KC, cfg.BLOCK_M], gl.float32, layout=cfg.s_layout)
    dq_zero = gl.zeros([cfg.BLOCK_M, cfg.DQ_COLS], gl.float32, layout=cfg.dq_layout)
    dq_rows0 = gl.arange(0, cfg.BLOCK_M, layout=gl.SliceLayout(1, cfg.dq_layout))
    dq_cols = gl.arange(0, cfg.DQ_COLS, layout=gl.SliceLayout(0, cfg.dq_layout))
    if cfg.DQ_SPLIT:
        dq_col0 = CONSUMER * cfg.DQ_COLS
    else:
        dq_col0 = 0
    dq_cols = dq_cols + dq_col0
    if cfg.EXACT_DELTA:
        if cfg.dtype == gl.float16:
            ds_up = gl.load(prob.DS_UP)
        else:
            # bf16 has fp32's range: dS is never rescaled, so DS_UP is not read (no constant
            # buffer for the launcher to keep, which a CUDA graph's memory pool would own).
            ds_up = 1.0
        grad_scale = prob.sm_scale / ds_up  # exact: ds_up is a power of two
    else:
        ds_up = None
        grad_scale = prob.sm_scale
    if cfg.CENTRE_KEYS:
        # The consumer's (64, E) K rows over its 128 threads, 16 bytes of a row per thread. k̂ is
        # requested before the wait so that its global load's latency hides behind K's TMA (on the
        # H200, bf16 E 64 causal 4k: the backward 1891 µs with the load after the wait, 1870 before).
        centring_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // HEAD_DIM, HEAD_DIM // 8], [4, 1], [1, 0])
        k_hat = _load_mean_key(prob.MEAN_KEY, b * prob.H_KV + h_kv, HEAD_DIM=HEAD_DIM, layout=centring_layout)
    mbarrier.wait(bufs.kv_ready.index(CONSUMER), 0)
    if cfg.CENTRE_KEYS:
        _write_centred_keys(k_tile, kq_tile, k_hat, layout=centring_layout)
    keys = ConsumerKeys(b, H_Q, k0, key_ids, k_tile, v_tile, kq_tile, k_all, s_zero, dq_zero,
                        dq_rows0, dq_cols, dq_col0, ds_up, grad_scale)
    return keys, dk, dv


@gluon.jit
def _store_dkdv(cfg, prob, descs, bufs, keys, dk, dv, part, b, h_kv, CONSUMER: gl.constexpr):
    """This consumer's dK (times the softmax scale) and dV."""
    grad_scale = keys.grad_scale
    k0 = keys.k0
    if cfg.VARLEN:
        # Row by row: the sequence's last block would otherwise write the next one's keys.
        store_packed_rows(prob.DV, dv.to(cfg.dtype), prob.k_start, k0, prob.S, prob.H_KV, h_kv, ROWS=cfg.KC,
                          HEAD_DIM=cfg.HEAD_DIM)
        store_packed_rows(prob.DK, (dk * grad_scale).to(cfg.dtype), prob.k_start, k0, prob.S, prob.H_KV, h_kv,
                          ROWS=cfg.KC, HEAD_DIM=cfg.HEAD_DIM)
        # The last dQ reduce-add still reads this consumer's shared tile: let it finish before exit.
        tma.store_wait(pendings=0)
    elif cfg.DKDV_PARTIALS:
        # This part's sums, fp32, straight from the accumulators: the launcher adds the parts.
        # The last dQ reduce-add still reads this consumer's shared tile: let it finish before the
        # CTA exits (the TMA-store branch below waits the same way).
        tma.store_wait(pendings=0)
        _store_partial(cfg, prob, dv, 0, part, b, h_kv, k0)
        _store_partial(cfg, prob, dk * grad_scale, 1, part, b, h_kv, k0)
    else:
        # dK and dV through this consumer's K/V tiles (their last wgmma has retired) and TMA
        # stores, which clip keys >= S. Under DQ_SPLIT the other consumer may still read this K
        # half, so dK goes through the V tile after dV has left.
        keys.v_tile.store(dv.to(cfg.dtype))
        fence_async_shared()
        tma_store(descs.dv, [b, h_kv, k0, 0], _rows4d(bufs.v_smem, CONSUMER))
        tma.store_wait(pendings=0)
        keys.v_tile.store((dk * grad_scale).to(cfg.dtype))
        fence_async_shared()
        tma_store(descs.dk, [b, h_kv, k0, 0], _rows4d(bufs.v_smem, CONSUMER))
        tma.store_wait(pendings=0)


@gluon.jit
def _load_mean_key(MEAN_KEY, bh_kv, HEAD_DIM: gl.constexpr, layout: gl.constexpr):
    """This head's k̂ (CENTRE_KEYS), fp32, in the columns' slice of ``layout``."""
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    return gl.load(MEAN_KEY + bh_kv.to(gl.int64) * HEAD_DIM + dims)


@gluon.jit
def _write_centred_keys(k_tile, kt_tile, k_hat, layout: gl.constexpr):
    """K̃ = K − k̂ for this consumer's 64 keys, from its K rows into its rows of ``kt_smem``
    (CENTRE_KEYS), made visible to the wgmmas that read it. Exact in K's dtype: k̂_e is 0 or within
    a factor of two of every key's e-th component. Once per CTA."""
    k = k_tile.load(layout)
    kt_tile.store((k.to(gl.float32) - gl.expand_dims(k_hat, 0)).to(k.dtype))
    fence_async_shared()


@gluon.jit
def _store_partial(cfg, prob, acc, which, part, b, h_kv, k0):
    """Rows [k0, k0 + KC) of plane ``which`` (0: dV, 1: dK) of this part in DKDV_PART
    (2, group_split, B, H_KV, S, E) fp32; keys >= S are not written."""
    HEAD_DIM: gl.constexpr = cfg.HEAD_DIM
    rows = k0 + gl.arange(0, cfg.KC, layout=gl.SliceLayout(1, cfg.kv_layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, cfg.kv_layout))
    head = ((which * prob.group_split + part) * (gl.num_programs(1) // prob.group_split) + b * prob.H_KV
            + h_kv).to(gl.int64)
    ptrs = prob.DKDV_PART + (head * prob.S + gl.expand_dims(rows, 1)) * HEAD_DIM + gl.expand_dims(cols, 0)
    gl.store(ptrs, acc, mask=gl.expand_dims(rows < prob.S, 1))


@gluon.jit
def _attn_bwd_hopper(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, lse_desc, delta_desc, args,
                     switches: gl.constexpr):
    """Grid (cdiv(S, BLOCK_N), B * H_KV * group_split), walked in the order ``swizzle_heads`` sets.
    Descriptors are 4-D over (B, H, L or S, E): Q and dO boxes (1, 1, BLOCK_M, E); K, V, dK, dV
    boxes (1, 1, 64, E); ``dq_desc`` describes DQ_ACCUM with box (1, 1, BLOCK_M, E or E / 2 under
    DQ_SPLIT) (used only under DQ_TMA); ``lse_desc``/``delta_desc`` are 2-D descriptors over the LSE and
    DELTA planes, box (1, BLOCK_M), read only under ROW_STATS_TMA (which then does not read the
    LSE/DELTA pointers).
    ``args`` (``hopper_args.BwdArgs``): DQ_ACCUM is (B, Hq, L, E) fp32 zeros, contiguous; LSE (natural
    log) and DELTA are (B·Hq, L) fp32 planes whose rows are ``stride_stats`` apart. Under EXACT_DELTA,
    LSE is the forward's pivot plane and DS_UP one fp32 power of two (glossary); otherwise DS_UP is not
    read. Under HAS_KEY_BIAS, KEY_BIAS is (B, Hq, S) fp32, contiguous. Under DKDV_PARTIALS, DKDV_PART is
    (2, group_split, B, H_KV, S, E) fp32 and the dK/dV descriptors are not used; otherwise group_split
    is 1 and DKDV_PART is not touched. Under CENTRE_KEYS, MEAN_KEY is (B·H_KV, E) fp32, contiguous
    (k̂); otherwise it is not read. Under HAS_BLOCK_SPARSITY, ``lists`` (``hopper_args.TileListArgs``)
    is int32 (B or 1, Hq or 1, key blocks, list_stride), one row a key block: its query tile count,
    then its query tiles (``launch.block_tiles.gluon_tile_lists``); else not read. Under SOFTCAP,
    ``softcap_log2`` = c·log2 e and ``tanh_scale`` = scale / c (fp32; qk_scale is then not read), as
    the forward takes them; otherwise neither is read. Under VARLEN the tensors are packed
    (glossary): descriptors over (1, H, total, E) views, L and S the packed totals, grid
    (total_k // BLOCK_N + n_seq, H_KV) (``PackedRows``), DQ_ACCUM and the planes over the packed rows
    (B = 1), DK and DV the gradients as contiguous (total_k, H_KV, E) tensors (the dK/dV descriptors
    are not stored through); CU_Q, CU_K, n_seq and diag_shift as ``PackedRows`` takes them. Otherwise
    those six are None and not read.
    ``switches`` (``hopper_args.BwdSwitches``): the glossary's constexprs."""
    gl.static_assert(not (switches.VARLEN and (switches.DKDV_PARTIALS or switches.HAS_BLOCK_SPARSITY
                                               or switches.HAS_KEY_BIAS or switches.EVEN_L)),
                     "VARLEN launches unsplit, without a block-sparse layout, a key mask or EVEN_L")
    cfg = BwdConfig(q_desc, k_desc, NUM_STAGES=switches.NUM_STAGES, IS_CAUSAL=switches.IS_CAUSAL,
                    WINDOW_LEFT=switches.WINDOW_LEFT, DQ_SPLIT=switches.DQ_SPLIT, DQ_TMA=switches.DQ_TMA,
                    EXACT_DELTA=switches.EXACT_DELTA, HAS_KEY_BIAS=switches.HAS_KEY_BIAS,
                    ROW_STATS_TMA=switches.ROW_STATS_TMA, DKDV_PARTIALS=switches.DKDV_PARTIALS,
                    CENTRE_KEYS=switches.CENTRE_KEYS, HAS_BLOCK_SPARSITY=switches.HAS_BLOCK_SPARSITY,
                    EVEN_L=switches.EVEN_L, PAIRED_TILES=switches.PAIRED_TILES, SOFTCAP=switches.SOFTCAP,
                    VARLEN=switches.VARLEN)
    gl.static_assert(switches.BLOCK_N == NUM_CONSUMERS * KEYS_PER_CONSUMER, "BLOCK_N is 64 keys per consumer")
    gl.static_assert((cfg.HEAD_DIM == switches.HEAD_DIM) & (cfg.BLOCK_M == switches.BLOCK_M)
                     & (cfg.BLOCK_N == switches.BLOCK_N), "HEAD_DIM and BLOCK_M are Q's box, BLOCK_N two of K's")
    qk_scale = args.qk_scale.to(gl.float32)
    sm_scale = args.sm_scale.to(gl.float32)
    lists = args.lists
    prob = BwdProblem(args.L, args.S, args.H_KV, args.GROUP, args.group_split, args.stride_stats, args.causal_offset,
                      args.window_lower, qk_scale, sm_scale, args.swizzle_heads, args.LSE, args.DELTA, args.DQ_ACCUM,
                      args.DS_UP, args.KEY_BIAS, args.MEAN_KEY, args.DKDV_PART,
                      TileLists(lists.base, lists.stride_lb, lists.stride_lh, lists.list_stride),
                      args.softcap_log2, args.tanh_scale, PackedRows(args.CU_Q, args.CU_K, args.n_seq, args.diag_shift),
                      args.DK, args.DV)
    descs = BwdDescs(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, lse_desc, delta_desc)
    bufs = _allocate(cfg, descs)
    gl.warp_specialize([
        (_hopper_bwd_consumer, (cfg, prob, descs, bufs, 0)),
        (_hopper_bwd_consumer, (cfg, prob, descs, bufs, 1)),
        (_hopper_bwd_loader, (cfg, prob, descs, bufs)),
    ], [4, 1], [switches.CONSUMER_REGS, switches.LOADER_REGS])


@gluon.jit
def _allocate(cfg, descs):
    """The CTA's shared memory and barriers (``BwdBuffers``), initialised."""
    dtype: gl.constexpr = cfg.dtype
    NUM_STAGES: gl.constexpr = cfg.NUM_STAGES
    BLOCK_M: gl.constexpr = cfg.BLOCK_M
    BLOCK_N: gl.constexpr = cfg.BLOCK_N
    q_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + descs.q.block_type.shape, descs.q.layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + descs.do.block_type.shape, descs.do.layout)
    # K and V as one (BLOCK_N, E) tile each, so that dS·K can take all 128 keys (DQ_SPLIT); each
    # consumer's 64 rows are a row slice, which TMA fills and drains through a 4-D view.
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, 1, BLOCK_N, cfg.HEAD_DIM], dtype)
    k_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, cfg.HEAD_DIM], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, cfg.HEAD_DIM], kv_layout)
    if cfg.CENTRE_KEYS:
        # K̃ for dQ beside K for Sᵀ, laid out as K (32 KiB at E 128: the CTA then holds about 225
        # of its 227 KiB).
        kt_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, cfg.HEAD_DIM], kv_layout)
    else:
        kt_smem = None
    if cfg.DQ_SPLIT:
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
        ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
    else:
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([cfg.KC, BLOCK_M], dtype)
        ds_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, cfg.KC, BLOCK_M], ds_layout)
    if cfg.DQ_TMA:
        # One fp32 dQ tile per consumer (64 x 64 x 4 B = 16 KiB at E 128 under DQ_SPLIT).
        dq_smem = gl.allocate_shared_memory(gl.float32, [NUM_CONSUMERS] + descs.dq.block_type.shape, descs.dq.layout)
    else:
        dq_smem = None
    if cfg.ROW_STATS_TMA:
        lse_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES] + descs.lse.block_type.shape, descs.lse.layout)
        delta_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES] + descs.delta.block_type.shape,
                                               descs.delta.layout)
    else:
        lse_smem = None
        delta_smem = None
    kv_ready = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(NUM_CONSUMERS):
        mbarrier.init(kv_ready.index(c), count=1)
    for i in gl.static_range(2):
        mbarrier.init(ds_ready.index(i), count=NUM_CONSUMERS)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        # A slot is free once both consumers have released it.
        mbarrier.init(q_empty.index(i), count=NUM_CONSUMERS)
    # The dS handshake's ring has no empty barriers: each consumer arrives on ds_ready and waits
    # for both arrivals (``_tile_mmas``).
    return BwdBuffers(q_smem, do_smem, k_smem, v_smem, kt_smem, ds_smem, dq_smem, lse_smem, delta_smem, kv_ready,
                      do_ready, Ring(q_ready, q_empty, NUM=NUM_STAGES), Ring(ds_ready, None, NUM=2))
