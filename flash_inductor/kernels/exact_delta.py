"""The Triton steps around the one-pass exact-Δ path (``hopper_fwd.py``/``hopper_bwd.py`` under
EXACT_DELTA): the backward's preprocess, the keys' mean for its centred dQ, and the dq finish.

Glossary (per query row i of one (batch, query head); docs/hopper_backward.md derives it):
  g_i     the forward's row normaliser (ROW_CONSTS' second plane): the backward's P is
          g_i · P̃, P̃ = round(exp2(s·qk_scale − c_i)) as the forward's P·V used it.
  dO'_i   round(g_i · dO_i) in the input dtype: the dO the backward kernel reads, so that
          dV = P̃ᵀ·dO' and dP' = dO'·Vᵀ need no per-score factor.
  O + r   the forward's output plus its 16-bit rounding residual: the average of V under P̃
          to about 16 bits more than O.
  Δ'_i    dO'_i·(O_i + r_i) − g_i·dLSE_i in fp32: then Σ_j P̃_ij (dP'_ij − Δ'_i) = −g_i dLSE_i Σ_j P̃_ij
          exactly as the true dS rows sum, whatever the rounding of g.

  stats   under fp16, the bound on |dS| the kernel scales dS by (``launch.hopper_bwd``):
          max ‖dO'_i‖², max ‖v_j‖², max |g_i dLSE_i|, each program's into its column of
          DS_STATS (3, programs) fp32 (0 where it has none, so the buffer needs no fill), which
          the launcher reduces (one scalar atomic per program on three shared addresses took
          0.41 ms at fp16 E 128 4k against 0.11 for bf16).
          A NaN counts as +inf so that a non-finite input never looks small.
  k̂       the keys' shared part (ops/one_pass.py): the Hopper backward's dQ GEMM takes
          K̃ = K − k̂ (formed in its shared memory, CENTRE_KEYS). dq = scale·dS·K̃ + scale·(Σ_j dS_ij)·k̂,
          and a row of dS sums to dLSE_i, so the dq finish adds scale·dLSE_i·k̂. ``_key_moments``
          (a pass over K) and ``_mean_key_of_head`` (a program a head; in the preprocess's launch on the
          one-pass path, else ``_mean_key_from_moments``) find k̂.
  chunk   a run of CHUNK keys of one (batch, KV head): the unit of ``_key_moments``' partial sums,
          so that a long sequence of few heads still fills the GPU; the chunks' partials are
          reduced in a fixed order, so k̂ is deterministic.

Constexpr switches: HEAD_DIM (E, a power of two), BLOCK_M (rows per program), HAS_DLSE (the
LSE output has a gradient), COLLECT_STATS (fp16: the bound's maxima).
"""

import triton
import triton.language as tl

from .ds_scaling import _max_as_stat


@triton.jit
def _exact_delta_preprocess(DO, O, RESID, NORM, DLSE, DO_SCALED, DELTA, V, DS_STATS, PARTIAL, MEAN_KEY,
                            stride_dob, stride_doh, stride_dom,
                            stride_ob, stride_oh, stride_om,
                            stride_vb, stride_vh, stride_vn,
                            H, H_KV, L, S, ROW_PROGRAMS, CHUNKS,
                            HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, HAS_DLSE: tl.constexpr,
                            COLLECT_STATS: tl.constexpr):
    """Grid (ROW_PROGRAMS [+ 1], B * H), ROW_PROGRAMS = cdiv(max(L, S) if COLLECT_STATS else L,
    BLOCK_M); rows past L load nothing and store nothing. DO and O (and RESID, as O) are
    (B, H, L, E) with a unit last stride, V (B, H_KV, S, E) likewise; NORM, DLSE and DELTA are
    flat (B·H·L) fp32 rows; DO_SCALED is (B, H, L, E) contiguous.

    A column of programs past ROW_PROGRAMS, where the launcher adds one, finishes k̂ instead: its
    first B·H_KV programs reduce ``_key_moments``' PARTIAL (CHUNKS chunks a head) into MEAN_KEY,
    as ``_mean_key_from_moments`` does. The one-pass backward needs both before its main kernel,
    and one launch for the two saves a launch's host time (a Triton launch costs tens of µs of
    Python; this program's work is a few hundred loads)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    if pid_m == ROW_PROGRAMS:
        heads_kv = tl.num_programs(1) // H * H_KV
        if bh < heads_kv:
            _mean_key_of_head(PARTIAL, MEAN_KEY, V, bh, heads_kv, CHUNKS, S, HEAD_DIM=HEAD_DIM)  # V: K's dtype
    else:
        _preprocess_rows(DO, O, RESID, NORM, DLSE, DO_SCALED, DELTA, V, DS_STATS, pid_m, bh,
                         stride_dob, stride_doh, stride_dom, stride_ob, stride_oh, stride_om,
                         stride_vb, stride_vh, stride_vn, H, H_KV, L, S, ROW_PROGRAMS,
                         HEAD_DIM=HEAD_DIM, BLOCK_M=BLOCK_M, HAS_DLSE=HAS_DLSE, COLLECT_STATS=COLLECT_STATS)


@triton.jit
def _preprocess_rows(DO, O, RESID, NORM, DLSE, DO_SCALED, DELTA, V, DS_STATS, pid_m, bh,
                     stride_dob, stride_doh, stride_dom, stride_ob, stride_oh, stride_om,
                     stride_vb, stride_vh, stride_vn, H, H_KV, L, S, ROW_PROGRAMS,
                     HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, HAS_DLSE: tl.constexpr,
                     COLLECT_STATS: tl.constexpr):
    """``_exact_delta_preprocess``' rows: dO', Δ' and (fp16) the bound's maxima of one program."""
    b = bh // H
    h = bh % H
    cols = tl.arange(0, HEAD_DIM)
    stat = DS_STATS + pid_m * tl.num_programs(1) + bh  # this program's column
    stat_row = ROW_PROGRAMS * tl.num_programs(1)
    if COLLECT_STATS:
        # V's rows: the programs of the first H_KV query heads cover its heads.
        v_rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        if h < H_KV:
            v = tl.load(V + b.to(tl.int64) * stride_vb + h * stride_vh + v_rows[:, None] * stride_vn + cols[None, :],
                        mask=(v_rows < S)[:, None], other=0.0).to(tl.float32)
            tl.store(stat + stat_row, _max_as_stat(tl.sum(v * v, axis=1)))
        else:
            tl.store(stat + stat_row, 0.0)  # every column is written: the launcher does not zero them
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    in_rows = rows < L
    mask = in_rows[:, None]
    do = tl.load(DO + b.to(tl.int64) * stride_dob + h * stride_doh + rows[:, None] * stride_dom + cols[None, :],
                 mask=mask, other=0.0)
    o_off = b.to(tl.int64) * stride_ob + h * stride_oh + rows[:, None] * stride_om + cols[None, :]
    o = tl.load(O + o_off, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(RESID + o_off, mask=mask, other=0.0).to(tl.float32)
    row_ids = bh.to(tl.int64) * L + rows
    g = tl.load(NORM + row_ids, mask=in_rows, other=0.0)
    do_scaled = (do.to(tl.float32) * g[:, None]).to(do.dtype)
    tl.store(DO_SCALED + row_ids[:, None] * HEAD_DIM + cols[None, :], do_scaled, mask=mask)
    do_f = do_scaled.to(tl.float32)
    delta = tl.sum(do_f * (o + r), axis=1)
    if HAS_DLSE:
        g_dlse = g * tl.load(DLSE + row_ids, mask=in_rows, other=0.0)
        delta -= g_dlse
        if COLLECT_STATS:
            tl.store(stat + 2 * stat_row, _max_as_stat(tl.abs(g_dlse)))
    if COLLECT_STATS:
        tl.store(stat, _max_as_stat(tl.sum(do_f * do_f, axis=1)))
        if not HAS_DLSE:
            tl.store(stat + 2 * stat_row, 0.0)
    tl.store(DELTA + row_ids, delta, mask=in_rows)


@triton.jit
def _ds_up_from_stats(DS_STATS, DS_UP, n, LIMIT: tl.constexpr, MIN_BOUND: tl.constexpr,
                      MAX_BOUND: tl.constexpr, MAX_EXPONENT: tl.constexpr, BLOCK: tl.constexpr):
    """DS_UP[0] = ds_up from the preprocess's partial maxima, in one program (grid (1,)): DS_STATS
    is (3, n) fp32, row-major (glossary, stats). The bound B = 4·√max‖dO'‖²·√max‖v‖² + 2·max|g dLSE|
    (NaN read as +inf) is clamped to [MIN_BOUND, MAX_BOUND], and ds_up = 2^e with
    e = floor(log2(LIMIT / B)) clamped to ±MAX_EXPONENT: the largest power of two with
    B·ds_up <= LIMIT. Every step is exact or correctly rounded (sqrt_rn, div_rn), and e is read from
    the quotient's exponent bits rather than a log2, so ds_up is an exact power of two."""
    offs = tl.arange(0, BLOCK)
    m_do = tl.zeros([BLOCK], dtype=tl.float32)
    m_v = tl.zeros([BLOCK], dtype=tl.float32)
    m_dlse = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n, BLOCK):
        cols = start + offs
        live = cols < n
        m_do = tl.maximum(m_do, tl.load(DS_STATS + cols, mask=live, other=0.0))
        m_v = tl.maximum(m_v, tl.load(DS_STATS + n + cols, mask=live, other=0.0))
        m_dlse = tl.maximum(m_dlse, tl.load(DS_STATS + 2 * n + cols, mask=live, other=0.0))
    bound = 4.0 * tl.sqrt_rn(tl.max(m_do, axis=0)) * tl.sqrt_rn(tl.max(m_v, axis=0)) + 2.0 * tl.max(m_dlse, axis=0)
    bound = tl.where(bound == bound, bound, float("inf"))  # inf·0 (an infinite row beside a zero one)
    bound = tl.minimum(tl.maximum(bound, MIN_BOUND), MAX_BOUND)
    quotient = tl.div_rn(tl.full([], LIMIT, tl.float32), bound)  # a normal number for these bounds
    exponent = ((quotient.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.minimum(tl.maximum(exponent, -MAX_EXPONENT), MAX_EXPONENT)
    tl.store(DS_UP, ((exponent + 127) << 23).to(tl.float32, bitcast=True))


@triton.jit
def _finish_dq_with_mean_key(DQ_ACC, WEIGHT, MEAN_KEY, DQ, H, GROUP, L,
                             HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """dq = dq_acc + weight_i·k̂ in dq's dtype. Grid (cdiv(L, BLOCK_M), B * H). DQ_ACC (B, H, L, E)
    fp32 and DQ (same, input dtype) contiguous; WEIGHT flat (B·H·L) fp32; MEAN_KEY (B, H_KV, E)
    fp32 contiguous."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h_kv = (bh % H) // GROUP
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, HEAD_DIM)
    row_ids = bh.to(tl.int64) * L + rows
    mask = (rows < L)[:, None]
    acc = tl.load(DQ_ACC + row_ids[:, None] * HEAD_DIM + cols[None, :], mask=mask, other=0.0)
    weight = tl.load(WEIGHT + row_ids, mask=rows < L, other=0.0)
    k_hat = tl.load(MEAN_KEY + (b * (H // GROUP) + h_kv).to(tl.int64) * HEAD_DIM + cols)
    dq = acc + weight[:, None] * k_hat[None, :]
    tl.store(DQ + row_ids[:, None] * HEAD_DIM + cols[None, :], dq.to(DQ.dtype.element_ty), mask=mask)


@triton.jit
def _key_moments(K, PARTIAL, stride_kb, stride_kh, stride_kn, H_KV, S, CHUNK,
                 HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    """Per dimension, the sum, min and max of one chunk's keys. Grid (chunks, B * H_KV); K
    (B, H_KV, S, E) with a unit last stride; PARTIAL (3, B·H_KV, chunks, E) fp32. CHUNK is a
    multiple of 2 * BLOCK_N. A NaN reaches the sum (min/max may drop it), and a NaN mean centres
    nothing."""
    chunk = tl.program_id(0)
    bh = tl.program_id(1)
    cols = tl.arange(0, HEAD_DIM)
    base = K + (bh // H_KV).to(tl.int64) * stride_kb + (bh % H_KV) * stride_kh
    # Elementwise accumulators, reduced over the rows once after the loop: a reduction per
    # iteration crosses warps through shared memory with a barrier each time, which kept the
    # loads from overlapping (65 us for 64 MiB of keys on the H200, against 33 us for
    # _centre_keys' read and write of the same keys). Two loads an iteration, both issued before
    # either is added, so that each warp has two in flight: as fast or faster than one load in
    # each of eight launch configs timed on the H200, by up to 20 % (bf16 E 128, 32k tokens,
    # benchmarks/experiments/linear_passes.py).
    total = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    low = tl.full([BLOCK_N, HEAD_DIM], float("inf"), dtype=tl.float32)
    high = tl.full([BLOCK_N, HEAD_DIM], float("-inf"), dtype=tl.float32)
    for start in range(chunk * CHUNK, tl.minimum(chunk * CHUNK + CHUNK, S), 2 * BLOCK_N):
        rows_a = start + tl.arange(0, BLOCK_N)
        rows_b = rows_a + BLOCK_N
        in_a = (rows_a < S)[:, None]
        in_b = (rows_b < S)[:, None]
        k_a = tl.load(base + rows_a[:, None].to(tl.int64) * stride_kn + cols[None, :], mask=in_a, other=0.0)
        k_b = tl.load(base + rows_b[:, None].to(tl.int64) * stride_kn + cols[None, :], mask=in_b, other=0.0)
        k_a = k_a.to(tl.float32)
        k_b = k_b.to(tl.float32)
        total += k_a + k_b
        low = tl.minimum(low, tl.minimum(tl.where(in_a, k_a, float("inf")), tl.where(in_b, k_b, float("inf"))))
        high = tl.maximum(high, tl.maximum(tl.where(in_a, k_a, float("-inf")), tl.where(in_b, k_b, float("-inf"))))
    plane = tl.num_programs(1) * tl.num_programs(0) * HEAD_DIM
    at = PARTIAL + (bh * tl.num_programs(0) + chunk).to(tl.int64) * HEAD_DIM + cols
    tl.store(at, tl.sum(total, axis=0))
    tl.store(at + plane, tl.min(low, axis=0))
    tl.store(at + 2 * plane, tl.max(high, axis=0))


@triton.jit
def _mean_key_from_moments(PARTIAL, MEAN_KEY, K, chunks, S, HEAD_DIM: tl.constexpr):
    """k̂ of one head from its chunks' partials (``_mean_key_of_head``). Grid (B * H_KV,); PARTIAL
    as ``_key_moments`` writes it; MEAN_KEY (B·H_KV, E) fp32; K only gives the keys' dtype (not
    read). The one-pass backward finishes k̂ in its exact-Δ preprocess's launch instead."""
    _mean_key_of_head(PARTIAL, MEAN_KEY, K, tl.program_id(0), tl.num_programs(0), chunks, S, HEAD_DIM=HEAD_DIM)


@triton.jit
def _mean_key_of_head(PARTIAL, MEAN_KEY, K, bh, heads, chunks, S, HEAD_DIM: tl.constexpr):
    """k̂ of head ``bh`` (of ``heads`` = B·H_KV) from its chunks' partials, reduced in chunk order.
    K gives the keys' dtype only (any tensor of that dtype: it is not read).

    k̂_e is the keys' mean rounded to K's dtype where every key's e-th component lies within a
    factor of two of it, else 0: then k − k̂ is a float of K's dtype (Sterbenz), so the centred
    keys the Hopper backward forms from it are exact."""
    cols = tl.arange(0, HEAD_DIM)
    plane = heads * chunks * HEAD_DIM
    total = tl.zeros([HEAD_DIM], dtype=tl.float32)
    low = tl.full([HEAD_DIM], float("inf"), dtype=tl.float32)
    high = tl.full([HEAD_DIM], float("-inf"), dtype=tl.float32)
    for c in range(0, chunks):
        at = PARTIAL + (bh * chunks + c).to(tl.int64) * HEAD_DIM + cols
        total += tl.load(at)
        low = tl.minimum(low, tl.load(at + plane))
        high = tl.maximum(high, tl.load(at + 2 * plane))
    mean = (total / S).to(K.dtype.element_ty).to(tl.float32)
    within = tl.where(mean > 0, (low >= mean * 0.5) & (high <= mean * 2.0),
                      (high <= mean * 0.5) & (low >= mean * 2.0))
    k_hat = tl.where(within & (mean != 0.0) & (tl.abs(mean) < float("inf")), mean, 0.0)
    tl.store(MEAN_KEY + bh.to(tl.int64) * HEAD_DIM + cols, k_hat)
