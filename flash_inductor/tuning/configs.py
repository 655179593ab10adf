"""Launch configurations (block sizes, warps, pipeline stages) for the attention kernels.

Today these come from a heuristic on the head dimension and the device; the per-GPU
autotuning cache will replace the heuristic, behind the same functions. Configs depend only
on static facts (dtype, head dims, device), never on sequence lengths, so a compiled graph
with dynamic sequence lengths does not specialise on them.
"""

from __future__ import annotations

import dataclasses
import functools

import torch


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@dataclasses.dataclass(frozen=True)
class AttentionConfigs:
    forward: KernelConfig
    backward_dkdv: KernelConfig
    backward_dq: KernelConfig


def padded_head_dim(head_dim: int) -> int:
    """tl.arange needs a power of two and tl.dot needs K >= 16."""
    return max(16, 1 << (head_dim - 1).bit_length())


# The Triton interpreter runs tiles through NumPy: small tiles keep CPU tests fast while still
# exercising multi-block loops, ragged tails and the diagonal split.
_INTERPRETER_CONFIGS = AttentionConfigs(
    forward=KernelConfig(16, 16, 1, 1),
    backward_dkdv=KernelConfig(16, 16, 1, 1),
    backward_dq=KernelConfig(16, 16, 1, 1),
)


@functools.lru_cache(maxsize=None)
def _cuda_configs(capability: tuple[int, int], itemsize: int, head_dim: int, head_dim_v: int) -> AttentionConfigs:
    width = max(padded_head_dim(head_dim), padded_head_dim(head_dim_v))
    wide = itemsize >= 4  # fp32 tiles take twice the shared memory and registers
    if width <= 64 and not wide:
        fwd = KernelConfig(128, 64, 4, 3)
        dkdv = KernelConfig(64, 128, 8, 2)
        dq = KernelConfig(128, 64, 8, 2)
    elif width <= 128 and not wide:
        fwd = KernelConfig(128, 64, 8, 3) if capability >= (8, 0) else KernelConfig(64, 64, 4, 2)
        dkdv = KernelConfig(32, 128, 8, 2)
        dq = KernelConfig(64, 64, 4, 2)
    elif width <= 128:
        fwd = KernelConfig(64, 32, 4, 2)
        dkdv = KernelConfig(32, 64, 4, 1)
        dq = KernelConfig(64, 32, 4, 1)
    else:
        # Head dims up to 256: smaller tiles keep Q/K/V tiles and the accumulators on-chip.
        fwd = KernelConfig(64, 32, 4, 2) if not wide else KernelConfig(32, 32, 4, 1)
        dkdv = KernelConfig(32, 32, 4, 1) if not wide else KernelConfig(16, 32, 4, 1)
        dq = KernelConfig(32, 32, 4, 1) if not wide else KernelConfig(16, 32, 4, 1)
    return AttentionConfigs(fwd, dkdv, dq)


def select_configs(query: torch.Tensor, head_dim: int, head_dim_v: int, interpreted: bool) -> AttentionConfigs:
    if interpreted:
        return _INTERPRETER_CONFIGS
    capability = torch.cuda.get_device_capability(query.device)
    return _cuda_configs(capability, query.element_size(), head_dim, head_dim_v)
