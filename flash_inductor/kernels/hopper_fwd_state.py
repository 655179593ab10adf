"""The Gluon Hopper forward's state (kernels/hopper_fwd.py, whose glossary names the switches):
its constexprs and register layouts (``FwdConfig``), the call's scalars and pointers
(``FwdProblem``), its descriptors (``FwdDescs``), and its shared memory and barriers
(``FwdBuffers``, allocated and initialised by ``allocate``).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.language.core import _aggregate as aggregate

from .hopper_packed import PackedRows
from .hopper_pipeline import MaybeSmem, Ring, Scalar, TileLists, field


@gluon.constexpr_function
def _wgmma_layout(n):
    """A wgmma accumulator: one m64 row block per warpgroup, N = the whole tile in one instruction."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@aggregate
class FwdConfig:
    """The forward's constexprs (the glossary's switches) and register layouts. HEAD_DIM, BLOCK_M
    and BLOCK_N are the descriptors' boxes; ROWS = BLOCK_M · NUM_CONSUMERS, the CTA's block."""
    HEAD_DIM: gl.constexpr
    BLOCK_M: gl.constexpr
    BLOCK_N: gl.constexpr
    NUM_STAGES: gl.constexpr
    NUM_CONSUMERS: gl.constexpr
    ROWS: gl.constexpr
    IS_CAUSAL: gl.constexpr
    WINDOW_LEFT: gl.constexpr
    PINGPONG: gl.constexpr
    EXACT_DELTA: gl.constexpr
    HAS_KEY_BIAS: gl.constexpr
    SKIP_MASKED_TILES: gl.constexpr
    PERSISTENT: gl.constexpr
    HAS_BLOCK_SPARSITY: gl.constexpr
    SOFTCAP: gl.constexpr
    HAS_SINKS: gl.constexpr
    VARLEN: gl.constexpr
    dtype: gl.constexpr
    s_layout: gl.constexpr    # S = Q·Kᵀ, (BLOCK_M, BLOCK_N)
    o_layout: gl.constexpr    # acc, (BLOCK_M, HEAD_DIM)
    p_layout: gl.constexpr    # P as P·V's A operand from registers: S's fragment already is one
    l_layout: gl.constexpr    # l_acc, (BLOCK_M, 8): the rounded P's row sums (EXACT_DELTA)
    row_layout: gl.constexpr  # one value per query row
    PV_GROUPS: gl.constexpr   # wgmma groups of one P·V (P·1 beside it under EXACT_DELTA)

    @gluon.constexpr_function
    def __init__(self, q_desc, k_desc, NUM_STAGES, NUM_CONSUMERS, IS_CAUSAL, WINDOW_LEFT, PINGPONG, EXACT_DELTA,
                 HAS_KEY_BIAS, SKIP_MASKED_TILES, PERSISTENT, HAS_BLOCK_SPARSITY, SOFTCAP=False, HAS_SINKS=False,
                 VARLEN=False):
        self.HEAD_DIM = gl.constexpr(q_desc.block_type.shape[3])
        self.BLOCK_M = gl.constexpr(q_desc.block_type.shape[2])
        self.BLOCK_N = gl.constexpr(k_desc.block_type.shape[2])
        self.NUM_STAGES = gl.constexpr(NUM_STAGES)
        self.NUM_CONSUMERS = gl.constexpr(NUM_CONSUMERS)
        self.ROWS = gl.constexpr(self.BLOCK_M * self.NUM_CONSUMERS)
        self.IS_CAUSAL = gl.constexpr(IS_CAUSAL)
        self.WINDOW_LEFT = gl.constexpr(WINDOW_LEFT)
        self.PINGPONG = gl.constexpr(PINGPONG)
        self.EXACT_DELTA = gl.constexpr(EXACT_DELTA)
        self.HAS_KEY_BIAS = gl.constexpr(HAS_KEY_BIAS)
        self.SKIP_MASKED_TILES = gl.constexpr(SKIP_MASKED_TILES)
        self.PERSISTENT = gl.constexpr(PERSISTENT)
        self.HAS_BLOCK_SPARSITY = gl.constexpr(HAS_BLOCK_SPARSITY)
        self.SOFTCAP = gl.constexpr(SOFTCAP)
        self.HAS_SINKS = gl.constexpr(HAS_SINKS)
        self.VARLEN = gl.constexpr(VARLEN)
        self.dtype = gl.constexpr(q_desc.dtype)
        s_layout = _wgmma_layout(self.BLOCK_N.value)
        o_layout = _wgmma_layout(self.HEAD_DIM.value)
        self.s_layout = gl.constexpr(s_layout)
        self.o_layout = gl.constexpr(o_layout)
        self.p_layout = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))
        self.l_layout = gl.constexpr(_wgmma_layout(8))
        self.row_layout = gl.constexpr(gl.SliceLayout(1, s_layout))
        self.PV_GROUPS = gl.constexpr(2 if self.EXACT_DELTA.value else 1)


@aggregate
class FwdProblem:
    """The call's sizes, scalars and pointers (the entry point's docstring): every partition's view.
    ``softcap_log2`` (c·log2 e) and ``tanh_scale`` (scale / c): the soft cap's fp32 factors (SOFTCAP).
    Under VARLEN, one sequence's (``for_sequence``): L, S and the band's offsets are its own,
    ``q_start``/``k_start`` its first packed row and key, ``total_q`` the packed rows (the LSE's
    row stride); ``OUT``/``RESID`` O and its residual as (total_q, H, E) pointers, which the
    epilogue stores to row by row (a TMA box would write into the next sequence's rows).
    A dense launch holds None and 0 there, never read."""
    L: Scalar
    S: Scalar
    H: Scalar
    BH: Scalar
    GROUP: Scalar
    causal_offset: Scalar
    window_lower: Scalar
    qk_scale: Scalar
    swizzle_heads: Scalar
    LSE: gl.tensor
    ROW_CONSTS: gl.tensor
    KEY_BIAS: gl.tensor
    WORK_COUNTER: gl.tensor
    lists: TileLists
    softcap_log2: Scalar
    tanh_scale: Scalar
    SINKS: Scalar  # (H,) fp32 under HAS_SINKS, else None
    packed: PackedRows
    OUT: Scalar
    RESID: Scalar
    q_start: Scalar
    k_start: Scalar
    total_q: Scalar

    @gluon.constexpr_function
    def __init__(self, L, S, H, BH, GROUP, causal_offset, window_lower, qk_scale, swizzle_heads, LSE, ROW_CONSTS,
                 KEY_BIAS, WORK_COUNTER, lists, softcap_log2, tanh_scale, SINKS, packed, OUT=None, RESID=None,
                 q_start=0, k_start=0, total_q=0):
        self.L = field(L)
        self.S = field(S)
        self.H = field(H)
        self.BH = field(BH)
        self.GROUP = field(GROUP)
        self.causal_offset = field(causal_offset)
        self.window_lower = field(window_lower)
        self.qk_scale = field(qk_scale)
        self.swizzle_heads = field(swizzle_heads)
        self.LSE = field(LSE)
        self.ROW_CONSTS = field(ROW_CONSTS)
        self.KEY_BIAS = field(KEY_BIAS)
        self.WORK_COUNTER = field(WORK_COUNTER)
        self.lists = field(lists)
        self.softcap_log2 = field(softcap_log2)
        self.tanh_scale = field(tanh_scale)
        self.SINKS = field(SINKS)
        self.packed = field(packed)
        self.OUT = field(OUT)
        self.RESID = field(RESID)
        self.q_start = field(q_start)
        self.k_start = field(k_start)
        self.total_q = field(total_q)

    @gluon.jit
    def for_sequence(self, b):
        """Sequence b's problem (VARLEN): this one's, with its lengths, band and first rows."""
        q_start, k_start, seq_q, seq_k, causal_offset, window_lower = self.packed.sequence(
            b, self.L, self.S, self.causal_offset, self.window_lower)
        return FwdProblem(seq_q, seq_k, self.H, self.BH, self.GROUP, causal_offset, window_lower, self.qk_scale,
                          self.swizzle_heads, self.LSE, self.ROW_CONSTS, self.KEY_BIAS, self.WORK_COUNTER, self.lists,
                          self.softcap_log2, self.tanh_scale, self.SINKS, self.packed, self.OUT, self.RESID, q_start,
                          k_start, self.L)


@aggregate
class FwdDescs:
    q: tma.tensor_descriptor
    k: tma.tensor_descriptor
    v: tma.tensor_descriptor
    o: tma.tensor_descriptor
    r: tma.tensor_descriptor  # O's residual (EXACT_DELTA)

    @gluon.constexpr_function
    def __init__(self, q, k, v, o, r):
        self.q = field(q)
        self.k = field(k)
        self.v = field(v)
        self.o = field(o)
        self.r = field(r)


@aggregate
class FwdBuffers:
    """Shared memory and barriers. Q: one tile per consumer (q_ready; under PERSISTENT q_empty,
    which the consumer arrives on once the block's last Q·Kᵀ has retired). K and V: a NUM_STAGES
    ring each (``kv`` and ``vv``, one release per consumer). ``turn``: the ping-pong tokens.
    PERSISTENT only: ``o_smem`` (O's own staging tiles), the work items' two-deep ring. EXACT_DELTA
    only: ``ones_smem``. What a configuration does not use is None."""
    q_smem: gl.shared_memory_descriptor
    k_smem: gl.shared_memory_descriptor
    v_smem: gl.shared_memory_descriptor
    o_smem: MaybeSmem
    ones_smem: MaybeSmem
    item_smem: MaybeSmem
    q_ready: gl.shared_memory_descriptor
    q_empty: MaybeSmem
    turn: gl.shared_memory_descriptor
    kv: Ring
    vv: Ring
    items: (Ring, gl.constexpr)

    @gluon.constexpr_function
    def __init__(self, q_smem, k_smem, v_smem, o_smem, ones_smem, item_smem, q_ready, q_empty, turn, kv, vv, items):
        self.q_smem = field(q_smem)
        self.k_smem = field(k_smem)
        self.v_smem = field(v_smem)
        self.o_smem = field(o_smem)
        self.ones_smem = field(ones_smem)
        self.item_smem = field(item_smem)
        self.q_ready = field(q_ready)
        self.q_empty = field(q_empty)
        self.turn = field(turn)
        self.kv = field(kv)
        self.vv = field(vv)
        self.items = field(items)



@gluon.jit
def allocate(cfg, q_desc, k_desc, v_desc, o_desc):
    """The CTA's shared memory and barriers (``FwdBuffers``), initialised."""
    NUM_CONSUMERS: gl.constexpr = cfg.NUM_CONSUMERS
    NUM_STAGES: gl.constexpr = cfg.NUM_STAGES
    dtype: gl.constexpr = cfg.dtype
    q_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    if cfg.PERSISTENT:
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
        items = Ring(item_ready, item_empty, NUM=2)
    else:
        o_smem = None  # O is staged in Q's tile
        q_empty = None
        item_smem = None
        items = None
    if cfg.EXACT_DELTA:
        # A (8, BLOCK_N) tile of ones per consumer, the B operand of the rounded P's row sums.
        ones_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([8, cfg.BLOCK_N], dtype)
        ones_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, 8, cfg.BLOCK_N], ones_layout)
    else:
        ones_smem = None
    for c in gl.static_range(NUM_CONSUMERS):
        mbarrier.init(q_ready.index(c), count=1)
        mbarrier.init(turn.index(c), count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        # A slot is free once every consumer has released it.
        mbarrier.init(k_empty.index(i), count=NUM_CONSUMERS)
        mbarrier.init(v_empty.index(i), count=NUM_CONSUMERS)
    return FwdBuffers(q_smem, k_smem, v_smem, o_smem, ones_smem, item_smem, q_ready, q_empty, turn,
                      Ring(k_ready, k_empty, NUM=NUM_STAGES), Ring(v_ready, v_empty, NUM=NUM_STAGES), items)
