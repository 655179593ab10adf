"""The configs the autotuner may try: a grid of tile shapes, warp counts and pipeline depths per
kernel role, pruned by what fits on the chip (``tuning/footprint.py``) before anything is compiled,
since compiling a config costs far more than timing it. The heuristic's own configs are always
candidates, whatever the estimate says."""

from __future__ import annotations

import dataclasses
from typing import Iterable

from ..tuning import hopper_configs
from ..tuning.buckets import ROLES, Bucket
from ..tuning.footprint import DeviceLimits, TileBytes, fits
from ..tuning.kernel_config import KernelConfig

__all__ = ["ROLES", "SearchSpace", "FULL_SPACE", "QUICK_SPACE", "space_for", "shape_candidates",
           "depth_candidates", "gluon_candidates"]


@dataclasses.dataclass(frozen=True)
class SearchSpace:
    name: str = "full"  # recorded in each entry: --resume re-tunes entries from another space
    blocks_m: tuple[int, ...] = (32, 64, 128)
    blocks_n: tuple[int, ...] = (32, 64, 128)
    warps: tuple[int, ...] = (4, 8)
    stages: tuple[int, ...] = (1, 2, 3, 4)


FULL_SPACE = SearchSpace()
# --quick: the tiles and depths that win most often on Hopper-class parts, to finish in minutes.
QUICK_SPACE = SearchSpace(name="quick", blocks_m=(64, 128), blocks_n=(64, 128), warps=(4, 8), stages=(2, 3))


def space_for(pass_name: str, space: SearchSpace) -> SearchSpace:
    """The space a pass searches. The decode kernel's block_m caps its packed rows (GROUP x L, 8 to
    128 in practice), so its candidates start at 16 rows; it streams K/V once and is bound by
    memory, so 2 warps and deep pipelines join. Other passes search ``space`` as given."""
    if pass_name != "decode":
        return space
    return dataclasses.replace(space, blocks_m=(16, 32, 64, 128), warps=tuple(sorted({2, *space.warps})),
                               stages=tuple(sorted({*space.stages, 3, 4})))


def shape_candidates(role: str, space: SearchSpace, reference_stages: int, tiles: TileBytes,
                     limits: DeviceLimits) -> list[KernelConfig]:
    """First round of a sweep: every tile shape and warp count, at the reference depth (or the
    deepest shallower one that fits)."""
    found = []
    for bm in space.blocks_m:
        for bn in space.blocks_n:
            for warps in space.warps:
                for stages in sorted((s for s in space.stages if s <= reference_stages), reverse=True) or [1]:
                    cfg = KernelConfig(bm, bn, warps, stages)
                    if fits(role, cfg, tiles, limits):
                        found.append(cfg)
                        break
    return found


def depth_candidates(role: str, shapes: Iterable[KernelConfig], space: SearchSpace, tiles: TileBytes,
                     limits: DeviceLimits) -> list[KernelConfig]:
    """Second round: the other pipeline depths of the best shapes."""
    found = []
    for shape in shapes:
        for stages in space.stages:
            cfg = dataclasses.replace(shape, num_stages=stages)
            if cfg != shape and fits(role, cfg, tiles, limits):
                found.append(cfg)
    return found


def gluon_candidates(role: str, bucket: Bucket, limits: DeviceLimits) -> list:
    """A Gluon kernel's whole search space (tuning/hopper_configs.py: at most 24 configs, so one
    round times them all), less what does not fit the chip's shared memory by its estimate."""
    return hopper_configs.candidates(role, bucket, limits.smem_bytes)
