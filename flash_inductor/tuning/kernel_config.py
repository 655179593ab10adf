"""A kernel launch's config (tile shape, warps, pipeline depth) and the three a problem needs."""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

from . import hopper_configs


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "KernelConfig":
        return cls(int(data["block_m"]), int(data["block_n"]), int(data["num_warps"]), int(data["num_stages"]))

    def label(self) -> str:
        return f"{self.block_m}x{self.block_n}/w{self.num_warps}/s{self.num_stages}"

    @classmethod
    def from_label(cls, text: str) -> "KernelConfig":
        """The config ``label()`` printed as ``text`` ('64x32/w4/s2'); a ValueError names the form otherwise."""
        match = re.fullmatch(r"(\d+)x(\d+)/w(\d+)/s(\d+)", text.strip())
        if match is None:
            raise ValueError(f"a tile is BLOCK_MxBLOCK_N/wWARPS/sSTAGES, e.g. 64x32/w4/s2; got {text!r}")
        return cls(*(int(group) for group in match.groups()))


@dataclasses.dataclass(frozen=True)
class AttentionConfigs:
    forward: KernelConfig
    backward_dkdv: KernelConfig
    backward_dq: KernelConfig
    # The split-KV decode forward (kernels/attn_decode.py): block_m caps the packed rows (query
    # heads of a group x query rows) per program, block_n is the keys per step. None: the
    # launcher looks it up (tuning.configs.select_decode_config).
    decode: Optional[KernelConfig] = None
    # The Gluon Hopper kernels' configs (tuning/hopper_configs.py), set only where the autotuner
    # times them; a launch looks them up itself (tuning.configs.select_hopper_forward_config).
    gluon_forward: Optional[object] = None
    gluon_forward_exact: Optional[object] = None
    gluon_backward: Optional[object] = None


def padded_head_dim(head_dim: int) -> int:
    """tl.arange needs a power of two and tl.dot needs K >= 16."""
    return max(16, 1 << (head_dim - 1).bit_length())


def role_config_from_dict(role: str, data: dict):
    """A stored config of kernel ``role``: a KernelConfig, or a Gluon kernel's config."""
    if hopper_configs.is_gluon_role(role):
        return hopper_configs.config_from_dict(role, data)
    return KernelConfig.from_dict(data)
