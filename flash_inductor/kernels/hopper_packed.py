"""Packed sequences (VARLEN) in the Gluon Hopper kernels (hopper_fwd.py, hopper_bwd.py, whose
glossaries define the switch): the offsets and the grid's blocks (``PackedRows``), where a
sequence's CTA sits, its rows in the packed tensors' descriptors, and the masked row stores that
replace TMA stores at a sequence's end. Every helper takes the kernel's config and problem
(``FwdProblem`` / ``BwdProblem``, one sequence's under VARLEN) and reads nothing else.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.language.core import _aggregate as aggregate

from .grid_order import ordered_cell, swizzled_cta
from .hopper_pipeline import Scalar, field


@aggregate
class PackedRows:
    """Packed sequences (VARLEN; ``launch/packed.py``): ``CU_Q``/``CU_K`` int32 (n_seq + 1,) offsets,
    sequence b's rows ``[CU_Q[b], CU_Q[b + 1])`` of the packed (1, H, total, E) tensors and its keys
    ``[CU_K[b], CU_K[b + 1])``; ``diag_shift`` 1 moves the band to each sequence's bottom-right
    diagonal (FlashAttention's), 0 keeps the top-left one. None in a dense launch (never read).

    Blocks (FA3's varlen scheduler, without its prefix sums): sequence b owns the virtual blocks
    [v_b, v_{b+1}) of grid axis 0, v_b = CU[b] // BLOCK + b. Since v_{b+1} - v_b >= cdiv(len_b, BLOCK),
    each of its blocks has a slot, and at most one slot a sequence is idle: the grid is
    total // BLOCK + n_seq blocks, rather than n_seq · cdiv(longest, BLOCK) with most of them empty
    where lengths vary. v_b needs only CU[b], so a CTA finds its sequence by counting the v_b <= v,
    a vector compare over the offsets, no search and no table."""
    CU_Q: Scalar
    CU_K: Scalar
    n_seq: Scalar
    diag_shift: Scalar

    @gluon.constexpr_function
    def __init__(self, CU_Q, CU_K, n_seq, diag_shift):
        self.CU_Q = field(CU_Q)
        self.CU_K = field(CU_K)
        self.n_seq = field(n_seq)
        self.diag_shift = field(diag_shift)

    @gluon.jit
    def block(self, v, CU, BLOCK: gl.constexpr, WARPS: gl.constexpr):
        """(sequence, block index within it) of virtual block v over offsets CU (``CU_Q`` in the
        forward, ``CU_K`` in the backward; class docstring). A slot past its sequence's blocks (or
        past the last sequence) gets a block index whose start lies at or past the length. The
        offsets go 32 at a time, each warp holding all 32 (the layout spans WARPS · 32 lanes, so
        the chunk is replicated per warp): the count is a warp shuffle reduction, with no shared
        memory or barrier, which a warp-specialised partition must not need."""
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
        CHUNK: gl.constexpr = 32
        count = gl.to_tensor(0)
        for c0 in range(1, self.n_seq + 1, CHUNK):
            idx = c0 + gl.arange(0, CHUNK, layout=layout)
            inside = idx <= self.n_seq
            starts = gl.load(CU + idx, mask=inside, other=0)
            count += gl.sum(gl.where(inside & (starts // BLOCK + idx <= v), 1, 0), 0)
        seq = gl.minimum(count, self.n_seq - 1)
        return seq, v - (gl.load(CU + seq) // BLOCK + seq)

    @gluon.jit
    def sequence(self, b, total_q, total_k, causal_offset, window_lower):
        """Sequence b: (q_start, k_start, L, S, causal_offset, window_lower), the band's offsets
        moved from the diagonal j = i to this sequence's (``diag_shift``). Offsets are clamped to
        the packed lengths, so malformed ones (which the Python entry points refuse) cannot address
        outside the tensors."""
        q_start = gl.minimum(gl.maximum(gl.load(self.CU_Q + b), 0), total_q)
        k_start = gl.minimum(gl.maximum(gl.load(self.CU_K + b), 0), total_k)
        q_stop = gl.minimum(gl.maximum(gl.load(self.CU_Q + b + 1), q_start), total_q)
        k_stop = gl.minimum(gl.maximum(gl.load(self.CU_K + b + 1), k_start), total_k)
        seq_q = q_stop - q_start
        seq_k = k_stop - k_start
        shift = (seq_k - seq_q) * self.diag_shift
        return q_start, k_start, seq_q, seq_k, causal_offset + shift, window_lower + shift


@gluon.jit
def q_row(cfg, prob, row):
    """The descriptors' row of query row ``row`` (of the sequence, under VARLEN)."""
    if cfg.VARLEN:
        return prob.q_start + row
    else:
        return row


@gluon.jit
def k_row(cfg, prob, key):
    """The descriptors' row of key ``key`` (of the sequence, under VARLEN)."""
    if cfg.VARLEN:
        return prob.k_start + key
    else:
        return key


@gluon.jit
def store_packed_rows(BASE, x, first, row0, n_rows, heads, h, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Rows [row0, row0 + ROWS) of ``x`` (ROWS, E), of a sequence whose rows start at packed row
    ``first``, into head h of the packed (total, heads, E) tensor at BASE in its dtype, rows at or
    past ``n_rows`` left alone (they are the next sequence's). Stored from ``x``'s own (wgmma
    accumulator) layout: a convert_layout to a coalescing one would take a shared-memory scratch
    tile (16 KiB, which put the E 128 exact-Δ backward over Hopper's 227 KiB) and a barrier across
    the warpgroup."""
    rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, x.type.layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, x.type.layout))
    offs = ((first + gl.expand_dims(rows, 1)).to(gl.int64) * heads + h) * HEAD_DIM + gl.expand_dims(cols, 0)
    gl.store(BASE + offs, x, mask=gl.expand_dims(rows < n_rows, 1))


@gluon.jit
def forward_block(cfg, prob, WARPS: gl.constexpr):
    """The forward's CTA under VARLEN: (first query row within its sequence, the sequence's
    ``FwdProblem``, head). Axis 0 holds the packed rows' virtual blocks (``PackedRows``), walked with
    the heads in the order ``swizzle_heads`` sets; under causal masking from the last, so that each
    sequence's longest blocks start first. A slot past its sequence's blocks gets a first row >= its
    L, and the caller skips it. WARPS: the calling partition's warps."""
    blocks = gl.num_programs(0)
    v, h = ordered_cell(gl.program_id(1) * blocks + gl.program_id(0), blocks, gl.num_programs(1), prob.swizzle_heads)
    if cfg.IS_CAUSAL:
        v = blocks - 1 - v
    b, pid_m = prob.packed.block(v, prob.packed.CU_Q, BLOCK=cfg.ROWS, WARPS=WARPS)
    return pid_m * cfg.ROWS, prob.for_sequence(b), h


@gluon.jit
def backward_block(cfg, prob, WARPS: gl.constexpr):
    """The backward's CTA under VARLEN: (first key within its sequence, the sequence's
    ``BwdProblem``, KV head). Axis 0 holds the packed keys' virtual blocks (``PackedRows``), axis 1
    the KV heads, walked in the order ``swizzle_heads`` sets. A slot past its sequence's blocks gets
    a first key >= its S, and the caller skips it. WARPS: the calling partition's warps."""
    pid_n, h_kv, _blocks = swizzled_cta(prob.swizzle_heads)
    b, blk = prob.packed.block(pid_n, prob.packed.CU_K, BLOCK=cfg.BLOCK_N, WARPS=WARPS)
    return blk * cfg.BLOCK_N, prob.for_sequence(b), h_kv
