"""Which keys each query row sees: the one argument the launchers take for it.

A call's visibility rules are six values that only make sense together: the causal side
(``is_causal``, ``causal_offset``), a sliding window, and a block-sparse layout. The launchers turn
the first three into the band of ``launch/band.py`` and the last three into the kernels' tile lists
(``launch/block_tiles.py``); an attention mask, if any, applies on top of both and stays a separate
argument, since it is a tensor the kernels read rather than a rule they skip tiles by. Grouping them
keeps a call site from swapping ``causal_offset`` with the scale or the dropout probability, which a
run of positional numbers would let through silently.

The ops (``flash_inductor::attention_forward`` / ``attention_backward``) keep their flat schemas;
they build a :class:`Visibility` from their arguments before calling a launcher.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from .band import Band, resolve_band


# eq=False: a block map compares element by element, which has no single truth value; two
# visibilities are the same object or different ones.
@dataclass(frozen=True, eq=False)
class Visibility:
    """Which keys each query row sees, besides what an attention mask hides.

    Key j is visible to query row i iff every rule that is set allows it:

    * ``is_causal``: ``j <= i + causal_offset``. ``causal_offset`` 0 is the top-left diagonal
      (SDPA's ``is_causal``, ``CausalBias`` upper-left), ``S - L`` the bottom-right one
      (``CausalBias`` lower-right). Ignored without ``is_causal``.
    * ``window``: None, or ``(left, right)`` as FlashAttention defines it: row i sees key j iff
      ``-left <= j - (i + S - L) <= right`` (relative to the bottom-right diagonal); -1 leaves that
      side unbounded, so ``(-1, -1)`` is no window, ``(w - 1, 0)`` a causal sliding window of w keys.
      It combines with ``is_causal``: both apply.
    * ``block_map`` / ``block_q`` / ``block_k``: a block-sparse layout, the op's normalised form of
      ``flash_inductor.block_sparse``: a 4-D bool map (B or 1, Hq or 1, ceil(L / block_q),
      ceil(S / block_k)), True where the block is computed; without one, None and the sizes 0.
      The launchers check it (``block_tiles.check_block_layout``) where they use it.

    The default, :data:`NO_MASKING`, lets every row see every key.
    """

    is_causal: bool = False
    causal_offset: int = 0
    window: Optional[tuple[int, int]] = None
    block_map: Optional[torch.Tensor] = None
    block_q: int = 0
    block_k: int = 0

    def band(self, seq_q, seq_k) -> Band:
        """The band of keys the causal side and the window leave each row (``band.resolve_band``)."""
        return resolve_band(self.is_causal, self.causal_offset, self.window, seq_q, seq_k)

    def block_layout(self) -> Optional[tuple]:
        """(block_map, block_q, block_k) of the block-sparse layout, None without one."""
        return None if self.block_map is None else (self.block_map, self.block_q, self.block_k)

    def without_block_layout(self) -> "Visibility":
        """The same rules minus the block-sparse layout: for a path that receives the layout folded
        into its attention mask instead (the `fp8` forward)."""
        return replace(self, block_map=None, block_q=0, block_k=0)


NO_MASKING = Visibility()
