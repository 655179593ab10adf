"""Which buckets a tuning run covers, in which order, and how deeply each is searched.

Compiling a config costs far more than timing it, and every bucket kind (dtype, width, mask,
schedule) compiles its own kernels, so a full sweep everywhere would take hours. The plan
therefore sweeps the whole search space only where it matters most and lets the other buckets
race a shortlist:

* ``sweep``: one bucket per (head width, pass, dtype class: 16-bit or fp32), at the default
  schedule (and at each schedule whose tiles hold operands of other widths: fp8, and
  `accurate`'s fp32 P and dS), without a mask, at the length closest to 4096. Tile shapes and
  warp counts first, then the pipeline depths of the best (and near-tied) shapes (``search.py``).
* ``shortlist``: every other bucket races the heuristic against the sweep's best few configs.
  Within a width, the ranking of tiles moves little with the mask, the schedule, the 16-bit
  dtype or the length; what does move, the race settles. ``--exhaustive`` sweeps everywhere.
* ``copy``: a bucket whose kernels are identical to an earlier one's (the same constexprs, e.g.
  the fast and stable schedules in the forward, or with fp32 inputs) reuses its entry unmeasured.

The Gluon Hopper passes (``gluon_*``, tuning/hopper_configs.py) sweep every bucket: their whole
space is one list of at most 24 configs.

Order: sweeps first (they seed the rest), then the default schedule before the others, no mask
and causal before explicit masks, and lengths nearest the representative first, so that a run
stopped by its time budget has tuned what most users run.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from ..tuning import hopper_configs
from ..tuning.buckets import GLUON_PASSES, MAX_SEQ_BUCKET, MIN_SEQ_BUCKET, Bucket
from ..schedules import DEFAULT_SCHEDULE, get_schedule

SWEEP, SHORTLIST, COPY = "sweep", "shortlist", "copy"
REPRESENTATIVE_SEQ = 4096
_MASK_PRIORITY = ("none", "causal", "bool", "float")


@dataclasses.dataclass(frozen=True)
class Grid:
    schedules: tuple[str, ...]
    dtypes: tuple[str, ...]
    widths: tuple[int, ...]
    masks: tuple[str, ...]
    seqs: tuple[int, ...]
    passes: tuple[str, ...] = ("forward", "backward")

    def buckets(self) -> list[Bucket]:
        # A forward-only schedule (fp8) runs `stable`'s backward, which launches look up as `stable`,
        # and the normal fp8 forward for decode shapes (launch/decode.py): no buckets of its own.
        # The Gluon passes only where those kernels run (hopper_configs.bucket_supported).
        buckets = [Bucket(s, d, w, m, n, p) for s in self.schedules for d in self.dtypes for w in self.widths
                   for m in self.masks for n in self.seqs for p in self.passes
                   if not (p in ("backward", "decode") and get_schedule(s).fp8_forward)]
        return [b for b in buckets if b.pass_name not in GLUON_PASSES or hopper_configs.bucket_supported(b)]


@dataclasses.dataclass(frozen=True)
class PlannedBucket:
    bucket: Bucket
    kind: str  # SWEEP, SHORTLIST or COPY
    source: Optional[Bucket] = None  # shortlist: the sweep seeding it; copy: the bucket it reuses


def seq_buckets(max_seq: int, step: int = 4) -> tuple[int, ...]:
    """Lengths to tune up to ``max_seq``: every ``step``-th power of two from 1024 (the table's
    lookup serves the lengths between from the nearest tuned one), plus ``max_seq`` itself."""
    top = min(max(1 << (max(max_seq, 1) - 1).bit_length(), MIN_SEQ_BUCKET), MAX_SEQ_BUCKET)
    seqs, n = [], min(1024, top)
    while n < top:
        seqs.append(n)
        n *= step
    return tuple(seqs + [top])


def representative_seq(seqs) -> int:
    return min(seqs, key=lambda n: (abs(math.log2(n) - math.log2(REPRESENTATIVE_SEQ)), -n))


def _dtype_class(dtype: str) -> str:
    return "fp32" if dtype == "fp32" else "16-bit"


def _operand_widths(schedule: str) -> tuple[bool, bool, bool]:
    """What sets a schedule's bytes per tile beyond the dtype: fp8 operands, fp32 P, fp32 dS."""
    sched = get_schedule(schedule)
    return sched.fp8_forward, sched.p_in_fp32, sched.ds_in_fp32


def kernel_signature(bucket: Bucket) -> tuple:
    """Buckets with equal signatures launch the very same compiled kernels on the same problem."""
    from ..launch import schedule_switches
    from .measure import torch_dtype

    switches = schedule_switches(torch_dtype(bucket.dtype), bucket.schedule)
    if bucket.pass_name in GLUON_PASSES:
        # The Gluon forward rounds alike under every schedule it takes; its backward is `fast`'s
        # or the exact Δ's.
        exact = bucket.pass_name == "gluon_backward" and switches.get("EXACT_DELTA", False)
        return (bucket.dtype, bucket.width, bucket.mask, bucket.seq, bucket.pass_name, exact)
    names = {"forward": ("P_IN_FP32", "FP32_DOT", "FP8_FORWARD"), "decode": ("P_IN_FP32", "FP32_DOT")}.get(
        bucket.pass_name, tuple(sorted(switches)))
    return (bucket.dtype, bucket.width, bucket.mask, bucket.seq, bucket.pass_name,
            tuple(switches[n] for n in names))


def make_plan(grid: Grid, exhaustive: bool = False) -> list[PlannedBucket]:
    buckets = grid.buckets()
    rep = representative_seq(grid.seqs)
    default_schedule = DEFAULT_SCHEDULE if DEFAULT_SCHEDULE in grid.schedules else grid.schedules[0]
    sweep_mask = "none" if "none" in grid.masks else grid.masks[0]
    schedule_rank = {s: (s != default_schedule, i) for i, s in enumerate(grid.schedules)}
    mask_rank = {m: (_MASK_PRIORITY.index(m), i) for i, m in enumerate(grid.masks)}

    def sweep_of(b: Bucket) -> Bucket:
        dtype = next(d for d in grid.dtypes if _dtype_class(d) == _dtype_class(b.dtype))
        # A schedule whose tiles hold operands of other widths than the default's (fp8 Q/K/V;
        # fp32 P and dS under `accurate`) fits and ranks other tiles, so it sweeps for itself:
        # raced on the default's best few, `accurate` at E = 256 kept only the heuristic on the H200.
        same_tiles = _operand_widths(b.schedule) == _operand_widths(default_schedule)
        schedule = default_schedule if same_tiles else b.schedule
        return Bucket(schedule, dtype, b.width, sweep_mask, rep, b.pass_name)

    def priority(b: Bucket) -> tuple:
        return (schedule_rank[b.schedule], mask_rank[b.mask], grid.dtypes.index(b.dtype),
                grid.widths.index(b.width), abs(math.log2(b.seq) - math.log2(rep)), -b.seq,
                grid.passes.index(b.pass_name))

    # A Gluon kernel's search space is small enough to sweep in every bucket (hopper_configs).
    sweeps = sorted({sweep_of(b) for b in buckets if b.pass_name not in GLUON_PASSES}
                    | {b for b in buckets if b.pass_name in GLUON_PASSES}, key=priority)
    ordered = sweeps + sorted((b for b in buckets if b not in set(sweeps)), key=priority)
    primary: dict[tuple, Bucket] = {}
    plan = []
    for b in ordered:
        signature = kernel_signature(b)
        if signature in primary:
            plan.append(PlannedBucket(b, COPY, primary[signature]))
            continue
        primary[signature] = b
        if exhaustive or b in sweeps:
            plan.append(PlannedBucket(b, SWEEP))
        else:
            plan.append(PlannedBucket(b, SHORTLIST, sweep_of(b)))
    return plan
