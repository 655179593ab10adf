"""One attention call as the CUDA paths see it, described once by the op and handed down.

``flash_inductor::attention_forward`` / ``attention_backward`` keep their flat schemas (a
``torch.library`` op takes tensors and scalars). Below them, the routing checks (the decode kernels,
the Gluon Hopper kernels) and the launchers used to receive the same nine to fifteen scalars at every
layer and resolve the schedule's name again at each; the op now builds one :class:`AttentionCall`
from its arguments, with the schedule resolved and the visibility rules grouped, and every layer
below reads that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..schedules import PrecisionSchedule, get_schedule
from .visibility import Visibility


# eq=False: the visibility may hold a block map (a tensor), which has no single truth value.
@dataclass(frozen=True, eq=False)
class AttentionCall:
    """Shapes, dtype, the resolved schedule, the visibility rules and the scalar options of one call.

    ``query`` (batch, heads_q, seq_q, head_dim), ``key`` (batch, heads_kv, seq_k, head_dim), ``value``
    (batch, heads_kv, seq_k, head_dim_v) of ``dtype``; ``schedule`` the resolved
    :class:`~flash_inductor.schedules.PrecisionSchedule`; ``visibility`` the causal side, sliding
    window and block-sparse layout (``launch.visibility``); ``scale`` the softmax scale,
    ``dropout_p`` the dropout probability, ``softcap`` the logit soft cap (0: none). The tensors
    themselves (and an attention mask, which the kernels read rather than skip tiles by) travel
    beside it.
    """

    batch: int
    heads_q: int
    heads_kv: int
    seq_q: int
    seq_k: int
    head_dim: int
    head_dim_v: int
    dtype: torch.dtype
    schedule: PrecisionSchedule
    visibility: Visibility
    scale: float
    dropout_p: float = 0.0
    softcap: float = 0.0

    @classmethod
    def describe(cls, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, schedule,
                 visibility: Visibility, scale: float, dropout_p: float = 0.0,
                 softcap: float = 0.0) -> "AttentionCall":
        """The call of these (normalised, 4-D) inputs; ``schedule`` a name (None: the default) or an
        already resolved schedule. An unknown name raises here, once, with the known ones listed."""
        batch, heads_q, seq_q, head_dim = query.shape
        return cls(batch=batch, heads_q=heads_q, heads_kv=key.shape[1], seq_q=seq_q, seq_k=key.shape[2],
                   head_dim=head_dim, head_dim_v=value.shape[-1], dtype=query.dtype,
                   schedule=get_schedule(schedule), visibility=visibility, scale=scale, dropout_p=dropout_p,
                   softcap=softcap)

    @property
    def block_sizes(self) -> Optional[tuple[int, int]]:
        """What the Hopper kernels' choice reads of a block-sparse layout: its (block_q, block_k),
        None without one."""
        if self.visibility.block_map is None:
            return None
        return self.visibility.block_q, self.visibility.block_k
