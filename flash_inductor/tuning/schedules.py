"""Precision schedules: which dtype each stage of the attention kernels computes in.

A schedule is a contract, not a hint: the kernels read these fields as ``tl.constexpr``
switches, so every cast in the kernels is traceable to one named field here.

Stages that never change across schedules (and therefore have no field):
  * S = QK^T is accumulated in fp32 from input-dtype operands.
  * The softmax scale is applied to S in fp32 (folded with log2(e) for exp2), never by
    pre-scaling Q in fp16/bf16, which would round Q a second time.
  * Running max, running sum and the LSE are fp32; masks are applied in fp32 on S.
  * O, dQ, dK, dV are accumulated in fp32.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class PrecisionSchedule:
    """Dtype choices for the stages that trade accuracy or range against speed.

    Attributes:
        name: the name users pass as ``schedule=``.
        p_in_fp32: forward P·V and backward Pᵀ·dO use P in fp32 (tf32/ieee dot) instead of
            rounding P to the input dtype. P is in [0, 1], so rounding costs precision only.
        ds_in_fp32: backward dS·K and dSᵀ·Q use dS in fp32 instead of the input dtype.
        ds_rescale: before dS is rounded to fp16, divide each tile by a power of two so its
            largest element fits; the fp32 product is multiplied back. This is what keeps
            the fp16 backward finite when |V| or |dO| is large (dS can exceed 65504 long
            before the true gradient does). Power-of-two factors are exact.
        description: one line for documentation and reports.
    """

    name: str
    p_in_fp32: bool
    ds_in_fp32: bool
    ds_rescale: bool
    description: str


FAST = PrecisionSchedule(
    name="fast",
    p_in_fp32=False,
    ds_in_fp32=False,
    ds_rescale=False,
    description="FA2's choices: P and dS rounded to the input dtype; fp16 dS may overflow.",
)

STABLE = PrecisionSchedule(
    name="stable",
    p_in_fp32=False,
    ds_in_fp32=False,
    ds_rescale=True,
    description="P rounded to the input dtype; dS rescaled by a power of two before rounding "
    "so the fp16 backward stays finite wherever the exact gradient is.",
)

ACCURATE = PrecisionSchedule(
    name="accurate",
    p_in_fp32=True,
    ds_in_fp32=True,
    ds_rescale=False,
    description="P and dS never rounded to 16 bits: their products run in fp32.",
)

SCHEDULES: dict[str, PrecisionSchedule] = {s.name: s for s in (FAST, STABLE, ACCURATE)}
DEFAULT_SCHEDULE = STABLE.name


def get_schedule(name: str | None) -> PrecisionSchedule:
    """Resolve a user-facing schedule name (None means the default)."""
    if name is None:
        return SCHEDULES[DEFAULT_SCHEDULE]
    if not isinstance(name, str) or name not in SCHEDULES:
        raise ValueError(
            f"flash_attention: schedule={name!r} is not a known precision schedule; "
            f"choose one of {sorted(SCHEDULES)} (or None for {DEFAULT_SCHEDULE!r})."
        )
    return SCHEDULES[name]
