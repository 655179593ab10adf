"""Triton kernels of ``flash_inductor.monitor()``: one call's statistics in a few launches.

Each kernel reads the watched tensors once. Eager calls only read them (``COPY`` off): the
output and the LSE in the forward, the gradients in the backward. Compiled graphs record through
identity ops that must return copies (``monitoring/ops.py`` says why); there the copy shares the
same pass (``COPY`` on). Every program handles one block and writes that block's non-finite
count (and, in the forward, the partial reduction of one block of LSE rows) with no atomics and
no zero-initialised buffer; one single-program kernel then combines the per-block results and
writes the whole float64 record: two launches forward, four backward. Done with PyTorch
reductions the same record took about twenty launches.

These kernels are not part of the tuned attention kernels: they launch with fixed block sizes,
and ``tuning/cache.py`` leaves this file out of the kernel-source hash, so changing it does not
invalidate tuning tables.

Constexpr switches: COPY (also write the watched tensor's copy, for the recording ops of
compiled graphs), BLOCK / COUNT_BLOCK (elements per program of a non-finite count) and
LSE_BLOCK (LSE rows per program). The record's float64 fields follow ``monitoring/stats.py``'s
FIELDS.
"""

import triton
import triton.language as tl

# Natural-log LSEs at or below this come from rows whose every visible key sits at the -1e38
# mask clamp (or from rows with no visible key, -inf): monitoring counts both as masked. The
# same threshold as monitoring/stats.py's LSE_MASKED_BELOW (checked by device_stats.py).
MASKED_BELOW = tl.constexpr(-1.0e37)


@triton.jit
def _count_block(src_ptr, dst_ptr, numel, counts_ptr, block, BLOCK: tl.constexpr, COPY: tl.constexpr):
    """counts[block] = NaN/inf entries of one contiguous block of src; with COPY, dst = src there
    too (the recording ops' copy shares the read). Without COPY, dst_ptr is never touched."""
    offsets = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_bounds = offsets < numel
    x = tl.load(src_ptr + offsets, mask=in_bounds, other=0.0)
    if COPY:
        tl.store(dst_ptr + offsets, x, mask=in_bounds)
    value = x.to(tl.float32)
    bad = in_bounds & ((value != value) | (tl.abs(value) == float("inf")))
    tl.store(counts_ptr + block, tl.sum(bad.to(tl.int32), axis=0))


@triton.jit
def _lse_block(lse_ptr, n_rows, partials_ptr, n_blocks, block, BLOCK: tl.constexpr):
    """Per block of LSE rows: masked, broken and live row counts, and the live rows' min and
    max, stored as the five rows of a (5, n_blocks) fp32 buffer (counts up to BLOCK are exact).
    A row is masked when its LSE is -inf or at the mask clamp, broken when it is NaN or +inf,
    live otherwise."""
    offsets = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_bounds = offsets < n_rows
    lse = tl.load(lse_ptr + offsets, mask=in_bounds, other=0.0).to(tl.float32)
    is_nan = lse != lse
    is_masked = in_bounds & (~is_nan) & (lse <= MASKED_BELOW)  # -inf is below the clamp too
    is_broken = in_bounds & (is_nan | (lse == float("inf")))
    is_live = in_bounds & (~is_nan) & (~is_masked) & (~is_broken)
    tl.store(partials_ptr + block, tl.sum(is_masked.to(tl.float32), axis=0))
    tl.store(partials_ptr + n_blocks + block, tl.sum(is_broken.to(tl.float32), axis=0))
    tl.store(partials_ptr + 2 * n_blocks + block, tl.sum(is_live.to(tl.float32), axis=0))
    tl.store(partials_ptr + 3 * n_blocks + block, tl.min(tl.where(is_live, lse, float("inf")), axis=0))
    tl.store(partials_ptr + 4 * n_blocks + block, tl.max(tl.where(is_live, lse, float("-inf")), axis=0))


@triton.jit
def _count_nonfinite(src_ptr, dst_ptr, numel, counts_ptr, BLOCK: tl.constexpr, COPY: tl.constexpr):
    """One program per block of src: its non-finite count (and, with COPY, its copy)."""
    _count_block(src_ptr, dst_ptr, numel, counts_ptr, tl.program_id(0), BLOCK=BLOCK, COPY=COPY)


@triton.jit
def _sum_counts(counts_ptr, n_counts, BLOCK: tl.constexpr):
    total = tl.zeros([BLOCK], dtype=tl.int64)
    for start in range(0, n_counts, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        total += tl.load(counts_ptr + offsets, mask=offsets < n_counts, other=0).to(tl.int64)
    return tl.sum(total, axis=0)


@triton.jit
def _forward_partials(out_ptr, copy_ptr, numel, counts_ptr, n_count_blocks, lse_ptr, n_rows, partials_ptr,
                      n_lse_blocks, COUNT_BLOCK: tl.constexpr, LSE_BLOCK: tl.constexpr, COPY: tl.constexpr):
    """The per-block half of a forward record in one launch: program i counts block i of the
    output (when there is one) and reduces block i of the LSE (when there is one). The output
    has far more blocks than the LSE, so the LSE rides along instead of costing a launch."""
    pid = tl.program_id(0)
    if pid < n_count_blocks:
        # Last block first: the attention kernel has just written the output, and its last
        # blocks are the likeliest to still sit in L2 when the first programs here read them.
        _count_block(out_ptr, copy_ptr, numel, counts_ptr, n_count_blocks - 1 - pid, BLOCK=COUNT_BLOCK, COPY=COPY)
    if pid < n_lse_blocks:
        _lse_block(lse_ptr, n_rows, partials_ptr, n_lse_blocks, pid, BLOCK=LSE_BLOCK)


# Sizes equal to 1 would otherwise be specialised into constants, which have no ``.to``.
@triton.jit(do_not_specialize=["n_rows", "n_blocks", "n_counts"])
def _forward_record(partials_ptr, n_blocks, n_rows, counts_ptr, n_counts, record_ptr, log_seq_k,
                    BLOCK: tl.constexpr):
    """One program: reduces ``_forward_partials``' LSE partials and output counts into the record,
    which follows ``monitoring/stats.py``'s FIELDS: rows, masked_rows, lse_nonfinite, lse_min,
    lse_max, max_logit_low, out_nonfinite, then three backward-only fields left NaN. The LSE
    range covers live rows and is NaN without any."""
    masked = tl.zeros([BLOCK], dtype=tl.int64)
    broken = tl.zeros([BLOCK], dtype=tl.int64)
    live_rows = tl.zeros([BLOCK], dtype=tl.int64)
    lowest = tl.full([BLOCK], float("inf"), tl.float32)
    highest = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, n_blocks, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        in_bounds = offsets < n_blocks
        masked += tl.load(partials_ptr + offsets, mask=in_bounds, other=0.0).to(tl.int64)
        broken += tl.load(partials_ptr + n_blocks + offsets, mask=in_bounds, other=0.0).to(tl.int64)
        live_rows += tl.load(partials_ptr + 2 * n_blocks + offsets, mask=in_bounds, other=0.0).to(tl.int64)
        lowest = tl.minimum(lowest, tl.load(partials_ptr + 3 * n_blocks + offsets, mask=in_bounds, other=float("inf")))
        highest = tl.maximum(highest, tl.load(partials_ptr + 4 * n_blocks + offsets, mask=in_bounds,
                                              other=float("-inf")))
    any_live = tl.sum(live_rows, axis=0) > 0
    lse_min = tl.where(any_live, tl.min(lowest, axis=0).to(tl.float64), float("nan"))
    lse_max = tl.where(any_live, tl.max(highest, axis=0).to(tl.float64), float("nan"))
    tl.store(record_ptr + 0, tl.cast(n_rows, tl.float64))
    tl.store(record_ptr + 1, tl.sum(masked, axis=0).to(tl.float64))
    tl.store(record_ptr + 2, tl.sum(broken, axis=0).to(tl.float64))
    tl.store(record_ptr + 3, lse_min)
    tl.store(record_ptr + 4, lse_max)
    tl.store(record_ptr + 5, lse_max - tl.cast(log_seq_k, tl.float64))
    tl.store(record_ptr + 6, _sum_counts(counts_ptr, n_counts, BLOCK=BLOCK).to(tl.float64))
    nan = tl.full([], float("nan"), tl.float64)
    tl.store(record_ptr + 7, nan)
    tl.store(record_ptr + 8, nan)
    tl.store(record_ptr + 9, nan)


@triton.jit
def _backward_record(dq_counts_ptr, n_dq, dk_counts_ptr, n_dk, dv_counts_ptr, n_dv, record_ptr, n_fields,
                     BLOCK: tl.constexpr):
    """One program: NaN in every forward field, then the non-finite counts of dq, dk, dv."""
    fields = tl.arange(0, 16)
    tl.store(record_ptr + fields, tl.full([16], float("nan"), tl.float64), mask=fields < n_fields - 3)
    tl.store(record_ptr + n_fields - 3, _sum_counts(dq_counts_ptr, n_dq, BLOCK=BLOCK).to(tl.float64))
    tl.store(record_ptr + n_fields - 2, _sum_counts(dk_counts_ptr, n_dk, BLOCK=BLOCK).to(tl.float64))
    tl.store(record_ptr + n_fields - 1, _sum_counts(dv_counts_ptr, n_dv, BLOCK=BLOCK).to(tl.float64))
