"""Triton's Philox4x32-10 generator, re-implemented with torch integer ops.

The attention kernels draw their dropout mask with ``tl.rand(seed, offset)``. The reference
path must drop exactly the same elements, so :func:`philox_uniform` reproduces
``triton.language.rand`` bit for bit (see ``triton/language/random.py``):

* the int64 offset is split into two uint32 counters ``c0`` (low) and ``c1`` (high);
  ``c2 = c3 = 0``;
* the int64 seed is split into the uint32 key ``k0`` (low) and ``k1`` (high);
* ten Philox rounds; the result is the final ``c0``;
* ``uint_to_uniform_float``: bitcast to int32, map negatives ``x -> -x - 1``, multiply by
  ``4.6566127342e-10`` in float32.

torch has no uint32 type with wrapping multiply or a multiply-high, so every uint32 value is
held in an int64 tensor in ``[0, 2**32)`` and products are formed from 16-bit halves of the
constant multiplier, which keeps every intermediate below ``2**49`` (no int64 overflow).
"""

import torch

__all__ = ["philox_uniform"]

_N_ROUNDS = 10
_UINT32_MASK = 0xFFFFFFFF

# Philox4x32 constants, as in triton.language.random.philox_impl.
_ROUND_MULTIPLIER_A = 0xD2511F53
_ROUND_MULTIPLIER_B = 0xCD9E8D57
_KEY_INCREMENT_A = 0x9E3779B9
_KEY_INCREMENT_B = 0xBB67AE85

# The largest scale with (2**31 - 1) * scale < 1.0 after float32 rounding, so the result is in [0, 1).
_INT31_TO_UNIT_INTERVAL = 4.6566127342e-10


def _mul_hi_lo(counter: torch.Tensor, multiplier: int) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of ``counter * multiplier`` for uint32 values held in int64."""
    # A full 32x32-bit product needs 64 unsigned bits; split the multiplier so that each
    # partial product stays below 2**48 and fits a signed int64.
    low_partial = counter * (multiplier & 0xFFFF)
    high_partial = counter * (multiplier >> 16)
    # counter * multiplier == high_partial * 2**16 + low_partial
    high_word = (high_partial + (low_partial >> 16)) >> 16
    low_word = (((high_partial & 0xFFFF) << 16) + low_partial) & _UINT32_MASK
    return high_word, low_word


def _philox_first_word(seed: int, offsets: torch.Tensor) -> torch.Tensor:
    """First output word of Philox4x32-10 for counters (offset_lo, offset_hi, 0, 0)."""
    c0 = offsets & _UINT32_MASK
    # Arithmetic shift then mask gives the same bits as Triton's `(offset >> 32).to(uint32)`.
    c1 = (offsets >> 32) & _UINT32_MASK
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    k0 = seed & _UINT32_MASK
    k1 = (seed >> 32) & _UINT32_MASK
    for _ in range(_N_ROUNDS):
        hi_b, lo_b = _mul_hi_lo(c2, _ROUND_MULTIPLIER_B)
        hi_a, lo_a = _mul_hi_lo(c0, _ROUND_MULTIPLIER_A)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + _KEY_INCREMENT_A) & _UINT32_MASK
        k1 = (k1 + _KEY_INCREMENT_B) & _UINT32_MASK
    return c0


def philox_uniform(seed: int, offsets: torch.Tensor) -> torch.Tensor:
    """Bit-exact ``triton.language.rand(seed, offsets)`` for an int64 seed and int64 offsets.

    Args:
        seed: integer in ``[0, 2**63)`` (the value Triton loads from an int64 seed tensor).
        offsets: int64 tensor of any shape and device; each element is an independent counter.

    Returns:
        float32 tensor shaped like ``offsets`` with values in ``[0, 1)``.
    """
    if offsets.dtype != torch.int64:
        raise TypeError(f"philox_uniform: offsets must be int64, got {offsets.dtype}; cast with .long()")
    seed = int(seed)
    if not 0 <= seed < 2**63:
        raise ValueError(f"philox_uniform: seed must be in [0, 2**63), got {seed}")
    word = _philox_first_word(seed, offsets)
    # Triton bitcasts the uint32 word to int32 and folds negatives onto [0, 2**31 - 1].
    as_int32 = torch.where(word >= 2**31, word - 2**32, word)
    folded = torch.where(as_int32 < 0, -as_int32 - 1, as_int32)
    # Multiply by a float32 constant (not a Python float) so the product is rounded in float32.
    scale = torch.tensor(_INT31_TO_UNIT_INTERVAL, dtype=torch.float32, device=offsets.device)
    return folded.to(torch.float32) * scale
