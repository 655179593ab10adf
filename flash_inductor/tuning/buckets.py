"""The bucket of an attention problem: which tuned entry a launch reads.

A bucket is (schedule, dtype, padded head width, mask kind, sequence-length bucket, pass). Its
string form, e.g. ``stable/bf16/e128/causal/s4096/forward``, is the key of a tuning table.

Launch configs never change results, only speed, so the bucket of a launch may be approximate:
under ``torch.compile(dynamic=True)`` the sequence lengths are symbolic, and we read their hint
(the size seen when the graph was traced) rather than guard on them. A guard would recompile
the graph whenever a length crossed a power of two, for no change in meaning.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
MASK_KINDS = ("none", "causal", "bool", "float")
# The backward's dK/dV and dQ kernels are tuned together, as one "backward" bucket whose entry
# holds both configs: they run back to back on the same problem, so only their sum matters.
# "decode" is the split-KV forward for a few query rows against long keys (launch/decode.py); its
# length bucket is S's, and its entry's config caps the packed rows per program (block_m).
# The Gluon Hopper kernels (tuning/hopper_configs.py) have passes of their own: the plain forward,
# `stable`'s one-pass training forward (exact Δ), and their backward.
GLUON_PASSES = ("gluon_forward", "gluon_forward_exact", "gluon_backward")
PASSES = ("forward", "backward", "decode") + GLUON_PASSES
# The kernel roles an entry of each pass holds a config for.
ROLES = {"forward": ("forward",), "backward": ("backward_dkdv", "backward_dq"), "decode": ("decode",),
         **{name: (name,) for name in GLUON_PASSES}}
BACKWARD_PASSES = ("backward", "gluon_backward")
MIN_SEQ_BUCKET = 128
MAX_SEQ_BUCKET = 65536
# The bucket of a symbolic length that has no hint (an unbacked size): a mid-size problem.
DEFAULT_SEQ_BUCKET = 4096
# Padded head widths: tl.dot needs K >= 16, and the kernels support head dims up to 256.
MIN_WIDTH, MAX_WIDTH = 16, 256


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True, order=True)
class Bucket:
    schedule: str
    dtype: str  # a DTYPE_NAMES value
    width: int  # the kernels' padded head width, max(padded E, padded Ev)
    mask: str  # a MASK_KINDS value
    seq: int  # a power of two in [MIN_SEQ_BUCKET, MAX_SEQ_BUCKET]
    pass_name: str  # a PASSES value

    def key(self) -> str:
        return f"{self.schedule}/{self.dtype}/e{self.width}/{self.mask}/s{self.seq}/{self.pass_name}"

    @classmethod
    def parse(cls, key: str) -> "Bucket":
        try:
            schedule, dtype, width, mask, seq, pass_name = key.split("/")
            if not (width.startswith("e") and seq.startswith("s")):
                raise ValueError
            bucket = cls(schedule, dtype, int(width[1:]), mask, int(seq[1:]), pass_name)
        except ValueError:
            raise ValueError(f"tuning table: {key!r} is not a bucket key "
                             "(schedule/dtype/e<width>/mask/s<seq>/pass)") from None
        if dtype not in DTYPE_NAMES.values() or mask not in MASK_KINDS or pass_name not in PASSES:
            raise ValueError(f"tuning table: {key!r} names an unknown dtype, mask kind or pass")
        # A lookup takes log2 of the length and the launchers pad widths to powers of two: other
        # values could never be launched, and s0 would fail in the lookup, not here.
        if not (_is_power_of_two(bucket.seq) and bucket.seq <= MAX_SEQ_BUCKET):
            raise ValueError(f"tuning table: {key!r}: the length bucket must be a power of two <= {MAX_SEQ_BUCKET}")
        if not (_is_power_of_two(bucket.width) and MIN_WIDTH <= bucket.width <= MAX_WIDTH):
            raise ValueError(f"tuning table: {key!r}: the width must be a power of two in [{MIN_WIDTH}, {MAX_WIDTH}]")
        return bucket

    @property
    def family(self) -> tuple:
        """Everything but the sequence bucket: entries of one family differ only in length."""
        return (self.schedule, self.dtype, self.width, self.mask, self.pass_name)

    def replace(self, **changes) -> "Bucket":
        return dataclasses.replace(self, **changes)


def mask_kind(attn_mask: Optional[torch.Tensor], is_causal: bool) -> str:
    """An explicit mask decides the kind (its loads dominate); else causal or none."""
    if attn_mask is not None:
        return "bool" if attn_mask.dtype == torch.bool else "float"
    return "causal" if is_causal else "none"


def length_hint(length, default: int = DEFAULT_SEQ_BUCKET) -> int:
    """A concrete value for a possibly symbolic length, never installing a guard.

    Plain ints pass through. For a ``torch.SymInt`` we use the shape environment's optimization
    hint (the traced size); objects that only carry a ``node`` with ``has_hint()``/``hint``
    (older torch, or test stubs) are read through that; with no hint at all, ``default``.
    """
    if isinstance(length, int) and not isinstance(length, bool):
        return length
    if isinstance(length, torch.SymInt):
        try:
            from torch.fx.experimental.symbolic_shapes import optimization_hint
        except ImportError:  # torch < 2.13: read the node's hint below
            pass
        else:
            try:
                return int(optimization_hint(length, fallback=default))
            except Exception:  # an expression the hint machinery cannot evaluate: no guess is wrong
                return default
    node = getattr(length, "node", None)
    if node is not None and getattr(node, "has_hint", lambda: False)():
        hint = node.hint
        if isinstance(hint, int):
            return hint
    return default


def seq_bucket(seq_q, seq_k) -> int:
    """The power of two at or above max(L, S), clamped to [MIN_SEQ_BUCKET, MAX_SEQ_BUCKET]."""
    longest = max(length_hint(seq_q), length_hint(seq_k), 1)
    bucket = 1 << (longest - 1).bit_length()
    return min(max(bucket, MIN_SEQ_BUCKET), MAX_SEQ_BUCKET)


def bucket_for(schedule: str, dtype: torch.dtype, width: int, kind: str, seq_q, seq_k,
               pass_name: str) -> Optional[Bucket]:
    """The bucket of a launch, or None for a dtype the tables never hold."""
    name = DTYPE_NAMES.get(dtype)
    if name is None:
        return None
    return Bucket(schedule, name, width, kind, seq_bucket(seq_q, seq_k), pass_name)
