"""What a launch config costs on the chip: shared memory and registers, by a simple estimate.

The autotuner prunes its candidates with it (``autotune/search_space.py``) and the table loader
rejects entries that cannot fit (``tuning/cache.py``). Each kernel role ("forward", "backward_dkdv", "backward_dq") draws from the same grid of tile
shapes (BLOCK_M x BLOCK_N), warp counts and pipeline depths. Compiling a config costs far more
than timing it, so configs that cannot fit are dropped before they are compiled, using a
deliberately simple estimate of each kernel's shared memory and registers:

* shared memory: the tiles a kernel keeps for its whole loop, plus ``num_stages`` copies of the
  tiles its loop streams in (Triton's software pipelining buffers one set per stage), plus the
  P or dS tile that feeds the second dot;
* registers: the fp32 accumulators and two fp32 score-sized tiles (S and P, or dP and dS) alive
  across an iteration, spread over ``num_warps * 32`` threads. A thread has at most 255
  registers; past that Triton spills to local memory, which is slow.

The estimates err on the generous side: a config that fits on paper but spills is merely slow,
and the timing rejects it; the heuristic's own configs are always candidates whatever the
estimate says.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ..schedules import get_schedule
from .buckets import Bucket
from .kernel_config import KernelConfig

MAX_FP32_REGS_PER_THREAD = 256
# Eight warps need a tile big enough to give each warp its own MMA rows and columns.
MIN_TILE_FOR_8_WARPS = 64 * 64

# Opt-in shared memory per block of the architectures we run on, by compute capability (what older
# torch does not report), and the default for any other.
OPTIN_SMEM_BYTES = {(9, 0): 232448, (8, 0): 166912, (8, 7): 166912}
DEFAULT_OPTIN_SMEM_BYTES = 101376


@dataclasses.dataclass(frozen=True)
class DeviceLimits:
    smem_bytes: Optional[int]  # per block (opt-in maximum); None = no limit (the interpreter)
    max_fp32_regs: Optional[int] = MAX_FP32_REGS_PER_THREAD

    @classmethod
    def for_device(cls, device: torch.device) -> "DeviceLimits":
        if device.type != "cuda":
            return cls(smem_bytes=None, max_fp32_regs=None)
        props = torch.cuda.get_device_properties(device)
        smem = getattr(props, "shared_memory_per_block_optin", 0)
        if not smem:  # older torch
            smem = OPTIN_SMEM_BYTES.get((props.major, props.minor), DEFAULT_OPTIN_SMEM_BYTES)
        return cls(smem_bytes=int(smem))


@dataclasses.dataclass(frozen=True)
class TileBytes:
    """Element sizes that decide a kernel's footprint (see PrecisionSchedule for p and ds)."""

    width: int  # padded head width (BLOCK_E == BLOCK_EV)
    itemsize: int  # Q, K, V, dO
    p_itemsize: int  # P as the second dot's operand
    ds_itemsize: int  # dS as the dQ/dK dot's operand
    mask_itemsize: int  # 0 without a mask
    exact_delta: bool = False  # the dQ pass also feeds P to a P·K dot and keeps its accumulator


_ITEMSIZE = {"bf16": 2, "fp16": 2, "fp32": 4}


def tile_bytes_for(bucket: Bucket) -> TileBytes:
    """The element sizes of a bucket's launches (the schedule's P and dS widths, the mask's bytes;
    the dQ pass's exact Δ is the schedule's except with fp32 inputs, as launch.schedule_switches)."""
    sched = get_schedule(bucket.schedule)
    size = _ITEMSIZE[bucket.dtype]
    mask = {"none": 0, "causal": 0, "bool": 1, "float": size}[bucket.mask]
    return TileBytes(bucket.width, size, 4 if sched.p_in_fp32 else size, 4 if sched.ds_in_fp32 else size, mask,
                     exact_delta=sched.exact_delta and bucket.dtype != "fp32")


def smem_bytes(role: str, cfg: KernelConfig, t: TileBytes) -> int:
    bm, bn, stages, w = cfg.block_m, cfg.block_n, cfg.num_stages, t.width
    mask_tile = bm * bn * t.mask_itemsize
    # The decode split kernel is the forward's loop over one split of the keys; block_m bounds its
    # packed rows, so the forward's estimate at block_m is an upper bound.
    if role in ("forward", "decode"):  # Q stays; K, V (and the mask tile) stream; P feeds P·V
        return bm * w * t.itemsize + stages * (2 * bn * w * t.itemsize + mask_tile) + bm * bn * t.p_itemsize
    if role == "backward_dkdv":  # K, V stay; Q, dO (and the mask) stream; Pᵀ and dSᵀ feed dots
        return 2 * bn * w * t.itemsize + stages * (2 * bm * w * t.itemsize + mask_tile) \
            + bm * bn * (t.p_itemsize + t.ds_itemsize)
    if role == "backward_dq":  # Q, dO stay; K, V (and the mask) stream; dS feeds dS·K (and P feeds P·K)
        operands = t.ds_itemsize + (t.p_itemsize if t.exact_delta else 0)
        return 2 * bm * w * t.itemsize + stages * (2 * bn * w * t.itemsize + mask_tile) + bm * bn * operands
    raise ValueError(f"unknown kernel role {role!r}")


def fp32_regs_per_thread(role: str, cfg: KernelConfig, width: int, exact_delta: bool = False) -> float:
    bm, bn, threads = cfg.block_m, cfg.block_n, cfg.num_warps * 32
    if role in ("forward", "decode"):  # O accumulator; S and P
        return (bm * width + 2 * bm * bn) / threads
    if role == "backward_dkdv":  # dK, dV accumulators; P and dS (S and dP die into them)
        return (2 * bn * width + 2 * bm * bn) / threads
    if role == "backward_dq":  # dQ accumulator (and P·K's under exact Δ); P and dS
        return ((2 if exact_delta else 1) * bm * width + 2 * bm * bn) / threads
    raise ValueError(f"unknown kernel role {role!r}")


def fits(role: str, cfg: KernelConfig, tiles: TileBytes, limits: DeviceLimits) -> bool:
    if cfg.num_warps == 8 and cfg.block_m * cfg.block_n < MIN_TILE_FOR_8_WARPS:
        return False
    if limits.smem_bytes is not None and smem_bytes(role, cfg, tiles) > limits.smem_bytes:
        return False
    if limits.max_fp32_regs is not None and \
            fp32_regs_per_thread(role, cfg, tiles.width, tiles.exact_delta) > limits.max_fp32_regs:
        return False
    return True
