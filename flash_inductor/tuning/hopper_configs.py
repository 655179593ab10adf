"""The Gluon Hopper kernels' launch configs: their fields, the built-in rules measured on the
H200, and the tuning table's entries for them.

The Gluon kernels (``kernels/hopper_fwd.py``, ``kernels/hopper_bwd.py``) are shaped by other
knobs than the Triton kernels' tile, warps and stages: consumer warpgroups, the K/V ring's depth
and tile, ping-pong, the backward's dQ split and reduce. Their table entries have buckets of
passes of their own (``tuning/buckets.py``), one role each:

* ``gluon_forward``: the plain forward (inference, and `fast`'s training forward);
* ``gluon_forward_exact``: `stable`'s one-pass training forward (it also writes O's rounding
  residual and the backward's row constants, which take registers: at E 64 its best consumer
  count can differ);
* ``gluon_backward``: the backward (`fast`'s, or `stable`'s one-pass with the exact Δ and K̃).

A launch looks its config up in the table (``tuning/configs.py``: ``select_hopper_forward_config``,
``select_hopper_backward_config``); where the table has no entry the rules below decide, as the heuristic does for the Triton kernels.
Only the searched fields are stored (``*_TUNED_FIELDS``); the rest keep their defaults or are
chosen per call (the backward's grid order and GQA split, by the call's grid and the SM count).

Imports nothing from ``launch/``: the launchers import from here.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Optional

from ..schedules import get_schedule
from .buckets import GLUON_PASSES, Bucket


@dataclass(frozen=True)
class HopperForwardConfig:
    """Tile config. The CTA owns ``num_consumers * block_m`` query rows (one warpgroup each) and
    streams ``block_n``-key K/V tiles through a ``num_stages``-deep shared-memory ring.
    ``swizzle_heads``: the grid's order. CTAs walk the (batch, head)s in groups of this many,
    query block by query block within a group (``kernels/hopper_fwd.py``, ``_block_coords``): 1,
    the default until timed on the H200, runs each head's blocks together (longest first under
    causal masking); B·H runs every head's longest block first (the backward's ``swizzle_heads``).
    ``persistent``: one CTA per SM takes blocks in that order from a work counter (``PERSISTENT``
    in the kernel), staging O in tiles of its own so the next block's loads overlap the epilogue.
    ``skip_masked_tiles``: each consumer computes only the key tiles its own rows can see
    (``SKIP_MASKED_TILES`` in the kernel; bitwise the same results): under causal masking it stops at
    its own last visible tile (at E 64, 192 rows a CTA over 128-key tiles, the first two consumers
    skip 1.5 tiles a block on average, about 3 % of a causal 4k forward's MMAs), and under a window's
    left side it starts at its own first one. Not yet timed on a GPU; compiled for sm_90a, E 128
    windows spill nothing either way, E 64 spills 4-8 more bytes causal and 330-420 with a window
    (against 190). Block-sparse launches never take it (their tiles are listed, not a range)."""

    block_m: int = 64
    block_n: int = 128
    num_stages: int = 2
    num_consumers: int = 2
    pingpong: bool = False
    loader_regs: int = 24
    swizzle_heads: int = 1
    persistent: bool = False
    skip_masked_tiles: bool = False

    @property
    def maxnreg(self) -> int:
        """Registers per thread at entry: the whole file over 4 * (consumers + 1) warps (the
        loader's single warp still takes a warpgroup's allocation)."""
        return 65536 // (128 * (self.num_consumers + 1)) // 8 * 8

    @property
    def consumer_regs(self) -> int:
        """What setmaxnreg gives each consumer once the loader drops to ``loader_regs``; the
        default partition (consumer 0) gets what is left, which is at least as much."""
        spare = 65536 // 128 - self.loader_regs
        return min(240, spare // self.num_consumers // 8 * 8)

    def to_dict(self) -> dict:
        """The searched fields, as a table entry stores them."""
        return {name: getattr(self, name) for name in FORWARD_TUNED_FIELDS}

    def label(self) -> str:
        return (f"c{self.num_consumers}/n{self.block_n}/s{self.num_stages}"
                f"{'/pingpong' if self.pingpong else ''}{'/persistent' if self.persistent else ''}"
                f"{'/skip' if self.skip_masked_tiles else ''}")


@dataclass(frozen=True)
class HopperBackwardConfig:
    """``block_m`` query rows per streamed Q/dO tile, a ``num_stages``-deep ring of them; the CTA
    owns 128 keys (64 per consumer warpgroup). ``dq_split``: the two consumers share dS through
    shared memory and each computes half of dQ's columns (FA3's split), rather than each adding
    its own 64-key partial dQ. ``dq_tma``: dQ partials reach the fp32 accumulator through shared
    memory and one TMA reduce-add per tile rather than one scalar atomic add per element.
    ``row_stats_tma``: the loader brings each tile's LSE and Δ rows into shared memory with Q and
    dO, rather than the consumers loading them from global memory at the top of each tile.
    ``swizzle_heads``: the grid's order. The CTAs walk the (batch, KV head)s in groups of this
    many, key block by key block within a group (``kernels/hopper_bwd.py``, ``_cta_coords``): 1
    runs each head's key blocks together, B·H_KV every head's first key block first. None (the
    default) picks per call, ``swizzle_heads_for`` (docs/hopper_backward.md, "Grid order").
    ``group_split``: a GQA group's query heads are shared among this many CTAs per key block (a
    divisor of the group; their dK and dV partial sums are added afterwards in a fixed order).
    None (the default) picks per call, ``group_split_for``. ``paired_tiles``: the consumers walk
    their Q/dO tiles two an iteration, the second tile's Sᵀ issued under the first's dQ epilogue
    (``PAIRED_TILES`` in the kernel); E 64 only, since at E 128 the pair runs out of registers.
    On the H200 (2026-12-04) it wins some buckets and loses others: against the former table
    picks, E 64 4k training steps took it 1.09x faster (fp16, no mask), 1.02x (bf16 causal) and
    0.97x (fp16 causal); racing every config, the tuner picks it for E 64 causal (docs/
    hopper_backward.md, "Tuned configs"). Hence a tuned field rather than a rule."""

    block_m: int = 64
    num_stages: int = 2
    dq_split: bool = True
    dq_tma: bool = True
    row_stats_tma: bool = True
    swizzle_heads: int | None = None
    group_split: int | None = None
    paired_tiles: bool = False
    consumer_regs: int = 240
    loader_regs: int = 24

    block_n: int = 128  # two consumers x 64 keys, fixed by the kernel

    @property
    def maxnreg(self) -> int:
        # 12 warps (two consumer warpgroups and the loader's, counted as a warpgroup): 168.
        return 65536 // (128 * 3) // 8 * 8

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in BACKWARD_TUNED_FIELDS}

    def label(self) -> str:
        return (f"s{self.num_stages}/{'split' if self.dq_split else 'nosplit'}/"
                f"{'tma' if self.dq_tma else 'atomic'}{'' if self.row_stats_tma else '/rowglobal'}"
                f"{'/paired' if self.paired_tiles else ''}")


# What a table entry stores and the autotuner searches. The forward's block_m is one warpgroup's
# 64 rows (the wgmma's M); the backward's 128-row tiles spill at E 64 (1 KiB a thread).
FORWARD_TUNED_FIELDS = ("num_consumers", "block_n", "num_stages", "pingpong", "persistent", "skip_masked_tiles")
BACKWARD_TUNED_FIELDS = ("num_stages", "dq_split", "dq_tma", "row_stats_tma", "paired_tiles")
ROLE_TYPES = {"gluon_forward": HopperForwardConfig, "gluon_forward_exact": HopperForwardConfig,
              "gluon_backward": HopperBackwardConfig}
# The values the kernels take: more consumers than three leave under 128 registers a thread; key
# tiles are powers of two (Gluon's layouts) and 64 or 128 keys wide (the wgmma N); deeper rings
# than four do not fit next to Q at E 128.
FORWARD_CHOICES = {"num_consumers": (2, 3), "block_n": (64, 128), "num_stages": (2, 3, 4), "pingpong": (True, False),
                   "persistent": (False, True), "skip_masked_tiles": (False, True)}
BACKWARD_CHOICES = {"num_stages": (2, 3), "dq_split": (True, False), "dq_tma": (True, False),
                    "row_stats_tma": (True, False), "paired_tiles": (False, True)}
_CHOICES = {"gluon_forward": FORWARD_CHOICES, "gluon_forward_exact": FORWARD_CHOICES,
            "gluon_backward": BACKWARD_CHOICES}
HEAD_DIMS = (64, 128)
DTYPES = ("bf16", "fp16")
# Fields added to a role's search space after tables were written: an entry without one was tuned
# (and measured) with this value, so it reads as that.
_ADDED_FIELDS = {"gluon_forward": {"persistent": False, "skip_masked_tiles": False},
                 "gluon_forward_exact": {"persistent": False, "skip_masked_tiles": False},
                 "gluon_backward": {"paired_tiles": False}}


# ------------------------------------------------------------------------------------------
# The built-in rules
# ------------------------------------------------------------------------------------------


def default_forward_config(head_dim: int, is_causal: bool, key_mask: bool = False,
                           exact_delta: bool = False) -> HopperForwardConfig:
    """The measured best on the H200 (benchmarks/results/hopper_fwd_nvidia-h200_20261202.json).

    E=128: two consumers (64 rows each) with ping-pong. It beat the same kernel without ping-pong
    in 16 of 20 cells of the grid and, unlike it, held steady between runs (bf16 16k: 603 with,
    563 to 631 without across two runs). Shared memory: Q 2x64x128 plus 2 stages of 128x128 K
    and V, 164 KiB; a third stage would need 228 KiB, past Hopper's 227. BLOCK_N=64 with 3
    stages was 9-12 % slower.
    E=64: three consumers (192 rows per CTA, 160 registers each, as FA3 does for this head dim)
    with ping-pong, 3 stages (123 KiB): 1.03-1.12x cuDNN at every length for full attention and
    for causal from 8k; at causal 2k-4k it and the two-consumer kernel are both 0.89-0.96x.
    A key mask's bias holds 32 more fp32 registers per consumer thread (a tile's 128 keys in the
    accumulator's column layout): at E 64 three consumers' 160 registers then spill 0.5-0.7 KiB
    (compiled for sm_90a, tools/launch_sass.py --cases gluon_fwd/bf16/e64/key --verbose), two consumers' 240 none. With
    the exact Δ's extra state two consumers are 13-15 % faster there; without it three are 4-6 %
    faster despite the spills (bf16 2k/8k, benchmarks/experiments/key_mask_probe.py at commit f7e9ac3).
    Without a key mask the exact Δ's three consumers spill too (140-430 bytes), yet they beat two
    consumers (1.01x at causal 4k, 1.05x at 16k, a training step) and 64-key tiles in a 4-deep
    ring, which spill nothing (1.02-1.03x training, 1.11-1.18x inference; bf16, 2026-12-04,
    benchmarks/experiments/switch_ab.py at f7e9ac3, ``hopper_fwd_…_20261202.json`` key ``e64_configs_20261204``).
    """
    del is_causal  # the same tiles measured best for both
    if head_dim == 64 and key_mask and exact_delta:
        return HopperForwardConfig(num_stages=3, num_consumers=2, pingpong=True)
    if head_dim == 128:
        return HopperForwardConfig(num_stages=2, num_consumers=2, pingpong=True)
    return HopperForwardConfig(num_stages=3, num_consumers=3, pingpong=True)


def default_backward_config(head_dim: int, is_causal: bool) -> HopperBackwardConfig:
    """The measured best on the H200 for every head dim and mask (docs/hopper_backward.md): 64-row
    Q/dO tiles in a 2-deep ring, dQ split between the consumers and reduced by TMA. Against it, at
    bf16 E 64/128, 4k/16k: atomics instead of the TMA reduce 14-21 % slower; no split 4-20 %;
    a 3-deep ring 0-12 % (it also leaves E 128 without shared memory for anything else); 128-row
    tiles spill (E 64: 1 KiB a thread). Those runs predate K̃ in shared memory: the H200 table now
    holds E 64's `stable` backward without the split (docs/hopper_backward.md, "Tuned configs")."""
    del head_dim, is_causal
    return HopperBackwardConfig()


# ------------------------------------------------------------------------------------------
# Table entries
# ------------------------------------------------------------------------------------------


def is_gluon_role(role: str) -> bool:
    return role in ROLE_TYPES


def config_problem(role: str, data) -> Optional[str]:
    """Why ``data`` is not a usable stored config of Gluon ``role``, or None."""
    choices = _CHOICES[role]
    data = _with_added_fields(role, data)
    if not isinstance(data, dict) or set(data) != set(choices):
        return f"needs exactly {', '.join(choices)}"
    for name, allowed in choices.items():
        value = data[name]
        if type(value) is not type(allowed[0]) or value not in allowed:
            return f"{name}={value!r} is not one of {allowed}"
    return None


def config_from_dict(role: str, data: dict, base=None):
    """A stored config of ``role`` over ``base`` (the role's dataclass defaults when None)."""
    problem = config_problem(role, data)
    if problem is not None:
        raise ValueError(f"{role}: {problem}")
    return dataclasses.replace(base if base is not None else ROLE_TYPES[role](), **_with_added_fields(role, data))


def _with_added_fields(role: str, data):
    """A stored config with the fields it predates (``_ADDED_FIELDS``) at the values it was tuned under."""
    return {**_ADDED_FIELDS.get(role, {}), **data} if isinstance(data, dict) else data


def smem_bytes(role: str, config, width: int, itemsize: int) -> int:
    """Shared memory the Gluon forward needs, about: Q for every consumer (O goes out through
    it), the K and V ring, and 4 KiB for barriers and the row statistics. Compiled for sm_90a
    (tools/launch_sass.py) E 128 at 2 consumers, 2 stages of 128 keys takes 164 KiB, E 64 at
    3 consumers, 3 stages 123 KiB: within 1 KiB of this. The backward's buffers depend on more
    switches (dS, dQ staging, K̃); its configs are checked by compiling (the autotuner rejects
    a candidate that does not launch, and a table pick that does not launch falls back to the
    built-in config at its first call)."""
    if role == "gluon_backward":
        return 0
    q = config.num_consumers * config.block_m * width * itemsize
    kv = 2 * config.num_stages * config.block_n * width * itemsize
    o = q if config.persistent else 0  # a persistent CTA stages O in tiles of its own
    return q + kv + o + 4096


def width_supported(config, head_dim: int) -> bool:
    """Whether ``config`` compiles at ``head_dim``: paired backward tiles need E 64 (at E 128 a
    pair's accumulators run out of registers, ptxas C7512)."""
    return not (getattr(config, "paired_tiles", False) and head_dim != 64)


def candidates(role: str, bucket: Bucket, smem_limit: Optional[int]) -> list:
    """Every config of ``role`` in the search space that fits ``smem_limit`` by ``smem_bytes``
    (None: no limit), the built-in config first."""
    base = default_for_bucket(role, bucket)
    choices = _CHOICES[role]
    found = []
    for values in itertools.product(*choices.values()):
        config = dataclasses.replace(base, **dict(zip(choices, values)))
        if not width_supported(config, bucket.width):
            continue
        if getattr(config, "skip_masked_tiles", False) and bucket.mask != "causal":
            continue  # no tile is wholly masked for a consumer but under causal masking (or a window)
        if smem_limit is None or smem_bytes(role, config, bucket.width, 2) <= smem_limit:
            found.append(config)
    return sorted(found, key=lambda config: config != base)


def default_for_bucket(role: str, bucket: Bucket):
    """The built-in config a launch of ``bucket`` runs where the table has none."""
    is_causal = bucket.mask == "causal"
    if role == "gluon_backward":
        return default_backward_config(bucket.width, is_causal)
    return default_forward_config(bucket.width, is_causal, key_mask=bucket.mask in ("bool", "float"),
                                  exact_delta=role == "gluon_forward_exact")


def bucket_supported(bucket: Bucket) -> bool:
    """Whether the Gluon kernels run launches of ``bucket`` and the autotuner can time them: bf16
    or fp16, E 64 or 128, no mask or causal (a key mask is a launch's own bias; the tuner's mask
    problems vary along the queries, which these kernels do not take), a schedule whose forward
    rounds P to the input dtype (the one-pass passes: `stable`'s exact Δ; the backward: `fast`
    or the exact Δ without fp32 dS)."""
    if bucket.pass_name not in GLUON_PASSES:
        return False
    sched = get_schedule(bucket.schedule)
    if bucket.dtype not in DTYPES or bucket.width not in HEAD_DIMS or bucket.mask not in ("none", "causal"):
        return False
    if sched.p_in_fp32 or sched.fp8_forward:
        return False
    if bucket.pass_name == "gluon_forward_exact":
        return sched.exact_delta and not sched.ds_in_fp32
    if bucket.pass_name == "gluon_backward":
        return not sched.ds_in_fp32
    return True
