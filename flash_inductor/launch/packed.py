"""Packed sequences (varlen) as the Triton kernels take them: ``VARLEN`` launches over the packed
tensors, one program column per (sequence, head) (``kernels/attn_fwd.py``, ``attn_bwd.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .band import Band


@dataclass(frozen=True, eq=False)
class PackedSequences:
    """Sequences packed along the rows of (1, H, total, E) views.

    ``cu_seqlens_q`` / ``cu_seqlens_k``: int32 (n + 1,) offsets, sequence b's rows are
    ``[cu[b], cu[b + 1])``; ``max_seqlen_q`` / ``max_seqlen_k`` the longest lengths (they size the
    grid); ``lower_right``: the band's diagonal is each sequence's bottom-right one (FlashAttention's
    varlen, and every window) rather than its top-left one (SDPA's ``is_causal`` on nested tensors,
    which has no window).
    """

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    lower_right: bool = True

    @property
    def count(self) -> int:
        return self.cu_seqlens_q.shape[0] - 1

    def kernel_args(self) -> tuple:
        """CU_Q, CU_K and diag_shift of the kernels."""
        return self.cu_seqlens_q, self.cu_seqlens_k, int(self.lower_right)

    def band(self, visibility) -> Band:
        """The band relative to the diagonal j = i (a sequence with L = S as long as the longest);
        the kernels move it to each sequence's own diagonal."""
        longest = max(self.max_seqlen_q, self.max_seqlen_k, 1)
        return visibility.band(longest, longest)


def strides(t: torch.Tensor, packed) -> tuple:
    """``t``'s strides as a launch passes them: under packing, the batch stride 0 (the programs
    offset their own sequence's rows)."""
    return (0, *t.stride()[1:]) if packed is not None else tuple(t.stride())


NOT_PACKED = (None, None, 0)  # CU_Q, CU_K, diag_shift of a dense launch: constants, compiled away
