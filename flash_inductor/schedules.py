"""Precision schedules: which dtype each stage of the attention kernels computes in.

A schedule is a contract, not a hint: the kernels read four fields (``p_in_fp32``,
``ds_in_fp32``, ``ds_rescale``, ``exact_delta``) as ``tl.constexpr`` switches, so every cast
in the kernels is traceable to one named field here, and :meth:`PrecisionSchedule.stages`
states the dtype of every stage, forward and backward, in the order the kernels run them. The README's schedule
table is rendered from it (:func:`schedules_markdown_table`), so the prose cannot drift from
the switches.

"Input dtype" below means fp16 or bf16. With fp32 inputs the 16-bit schedules are the same: no
stage rounds to 16 bits, and every fp32 dot runs as true fp32 ("ieee"), never tf32. The `fp8`
schedule rounds the forward's operands to e4m3 whatever the input dtype.
"""

from __future__ import annotations

import dataclasses

from .text_table import markdown_table


@dataclasses.dataclass(frozen=True)
class Stage:
    """One row of a schedule's contract: a stage of the computation, its dtype, and why."""

    name: str
    dtype: str
    why: str = ""


# Stages that no schedule changes, forward then backward.
_QK = Stage("S = QKᵀ", "operands: input dtype, accumulator: fp32",
            "|q·k| overflows fp16 long before the scaled score does")
_SCALE = Stage("softmax scale", "fp32, on S",
               "folded with log2 e into one multiply for exp2; pre-scaling Q in 16 bits would round Q twice")
_MASK = Stage("mask", "fp32, on S", "finite values are clamped at -1e38 so finfo.min masks survive base 2")
_STATS = Stage("running max, running sum, LSE", "fp32", "the online softmax's rescaling needs fp32 range")
_O_ACC = Stage("O accumulator", "fp32", "rounded to the input dtype once, after the 1/l normalisation")
_P_RECOMPUTE = Stage("bwd: P recomputed", "fp32, from the LSE", "no (L, S) matrix is stored")
_DP = Stage("bwd: dP = dO·Vᵀ", "operands: input dtype, accumulator: fp32")
_DS = Stage("bwd: dS = P∘(dP − Δ)", "fp32", "dS can exceed fp16's range before the gradient does")
_DQ_ACC = Stage("bwd: dQ accumulator", "fp32, first pass", "a pass over key blocks per query block: no atomics")
_DKDV_ACC = Stage("bwd: dK, dV accumulators", "fp32, second pass", "summed over the GQA group in registers")
_QK_FP8 = Stage(_QK.name, "operands: e4m3, a power-of-two scale per token; accumulator: fp32",
                "per-token scales factor out of every score and are undone exactly in fp32")
_P_FP8 = Stage("P for P·V", "e4m3 (P·2⁸); V e4m3 with a power-of-two scale per channel",
               "the 2⁸ keeps probabilities down to 2⁻¹⁴ in e4m3's normal range")
_P_RECOMPUTE_FP8 = Stage(_P_RECOMPUTE.name, "fp32, from a 16-bit forward recomputed in the backward",
                         "the gradient is the 16-bit attention's: fp8 is a forward schedule")

# The fp8 schedule's accuracy contract: the output's signal-to-quantisation-noise ratio against
# the float64 reference, 10·log10(Σ ref² / Σ (out − ref)²), at least 20 dB (a relative RMS error
# of at most 10 %). e4m3 keeps 3 mantissa bits: one rounded element is near 31 dB, and Q, K, P
# and V are each rounded once. Measured on CPU (the same rounding emulated in float64): 25-26 dB
# on unit-normal inputs at any length, falling as the logits spread, because a score's error
# grows with |q|·|k| (22.8 dB at logit std 2, 20.9 dB at std 4). Peaked attention past that
# is what the 16-bit schedules are for.
FP8_SQNR_BUDGET_DB = 20.0


@dataclasses.dataclass(frozen=True)
class PrecisionSchedule:
    """Dtype choices for the stages that trade accuracy or range against speed.

    Attributes:
        name: the name users pass as ``schedule=``.
        p_in_fp32: forward P·V and backward Pᵀ·dO use P in fp32 (tf32x3 dot) instead of
            rounding P to the input dtype. P is in [0, 1], so rounding costs precision only.
        ds_in_fp32: backward dS·K and dSᵀ·Q use dS in fp32 (tf32x3 dot) instead of the input dtype.
        ds_rescale: before dS is rounded to fp16, divide each tile by a power of two so its
            largest element fits; the fp32 product is multiplied back. This is what keeps
            the fp16 backward finite when |V| or |dO| is large (dS can exceed 65504 long
            before the true gradient does). Power-of-two factors are exact. bf16 has fp32's
            range, so bf16 dS is cast directly.
        exact_delta: the backward's Δᵢ = rowsum(dOᵢ∘Oᵢ) is formed from O as stored, rounded to
            the input dtype, so it is off by δᵢ ≈ u·|dOᵢ|·|Oᵢ|, and every dSᵢⱼ = Pᵢⱼ(dPᵢⱼ − Δᵢ) of
            the row carries −Pᵢⱼ·δᵢ. Summed into dqᵢ through Σⱼ Pᵢⱼ kⱼ, that error dominates dq
            when the keys share a large component (near-tied logits) or attention is nearly
            one-hot (dq → 0). With this switch the dQ pass, which runs first, also sums each
            row's dS (σᵢ, which is −δᵢ as computed) and Σⱼ Pᵢⱼ kⱼ (one more GEMM per tile: about
            1/7 more backward FLOPs), removes σᵢ·Σⱼ Pᵢⱼ kⱼ from dq, and stores the corrected Δ
            for the dK/dV pass. Off: FlashAttention-2's Δ and no extra GEMM. fp32 inputs never
            use it: their O is not rounded, so their Δ is already as good as the fp32 sum.
        description: one line for documentation and reports.
        fp8_forward: the forward runs QKᵀ and P·V on e4m3 operands (``kernels/attn_fwd_fp8.py``;
            needs fp8 tensor cores, compute capability 8.9+). The backward recomputes the forward in
            16 bits and runs `stable`'s backward (the switches above equal its), so training gets
            the 16-bit attention's gradient at the cost of one more forward.
        sqnr_budget_db: where set, the accuracy contract is an SQNR floor (dB) on the forward
            output instead of PyTorch's same-dtype error.
    """

    name: str
    p_in_fp32: bool
    ds_in_fp32: bool
    ds_rescale: bool
    exact_delta: bool
    description: str
    fp8_forward: bool = False
    sqnr_budget_db: float | None = None

    @property
    def fp16_backward_finite(self) -> bool:
        """Whether the fp16 backward stays finite wherever the exact gradient is representable
        (the autotuner's |V| = 1e4 probe applies to exactly these schedules)."""
        return self.ds_rescale or self.ds_in_fp32

    def _p_stage(self, label: str) -> Stage:
        if self.p_in_fp32:
            return Stage(label, "fp32 (tf32x3)", "tf32x3 splits fp32 into tf32 parts: near-fp32 on the tensor cores")
        return Stage(label, "input dtype", "P is in [0, 1]: rounding costs precision, never range")

    def _ds_stage(self) -> Stage:
        label = "bwd: dS for dS·K, dSᵀ·Q"
        if self.ds_in_fp32:
            return Stage(label, "fp32 (tf32x3)", "never rounded to 16 bits")
        if self.ds_rescale:
            return Stage(label, "fp16: scaled by 2⁻ᵏ, then cast; bf16: cast",
                         "power-of-two factors are exact; the fp32 product is scaled back")
        return Stage(label, "input dtype, cast directly", "fp16 dS overflows when |V| or |dO| is large")

    def _delta_stage(self) -> Stage:
        label = "bwd: Δ = rowsum(dO∘O)"
        if self.exact_delta:
            return Stage(label, "fp32; corrected in the dQ pass to Σⱼ Pᵢⱼ dPᵢⱼ (one more GEMM, P·K)",
                         "O rounded to 16 bits puts u·|dO|·|O| into every dS of the row")
        return Stage(label, "fp32, from O in the input dtype", "FlashAttention-2's Δ")

    def stages(self) -> tuple[Stage, ...]:
        """The whole contract, in the order the kernels run: forward, then backward."""
        return (
            _QK_FP8 if self.fp8_forward else _QK, _SCALE, _MASK, _STATS,
            _P_FP8 if self.fp8_forward else self._p_stage("P for P·V"),
            _O_ACC,
            self._delta_stage(),
            _P_RECOMPUTE_FP8 if self.fp8_forward else _P_RECOMPUTE, _DP, _DS,
            self._p_stage("bwd: P for Pᵀ·dO"),
            self._ds_stage(),
            _DQ_ACC, _DKDV_ACC,
        )


FAST = PrecisionSchedule(
    name="fast",
    p_in_fp32=False,
    ds_in_fp32=False,
    ds_rescale=False,
    exact_delta=False,
    description="FA2's choices: P and dS rounded to the input dtype, Δ from the rounded O; fp16 dS may overflow.",
)

STABLE = PrecisionSchedule(
    name="stable",
    p_in_fp32=False,
    ds_in_fp32=False,
    ds_rescale=True,
    exact_delta=True,
    description="P rounded to the input dtype; dS rescaled by a power of two before rounding "
    "so the fp16 backward stays finite wherever the exact gradient is; Δ corrected in the dQ pass.",
)

ACCURATE = PrecisionSchedule(
    name="accurate",
    p_in_fp32=True,
    ds_in_fp32=True,
    ds_rescale=False,
    exact_delta=True,
    description="P and dS never rounded to 16 bits: their products run in fp32; Δ corrected in the dQ pass.",
)

FP8 = PrecisionSchedule(
    name="fp8",
    p_in_fp32=False,
    ds_in_fp32=False,
    ds_rescale=True,
    exact_delta=True,
    fp8_forward=True,
    sqnr_budget_db=FP8_SQNR_BUDGET_DB,
    description=f"Forward on e4m3 operands with power-of-two scales (output SQNR >= {FP8_SQNR_BUDGET_DB:g} dB "
    "against float64); backward as `stable`, from a 16-bit recomputed forward. Needs compute capability 8.9+.",
)

SCHEDULES: dict[str, PrecisionSchedule] = {s.name: s for s in (FAST, STABLE, ACCURATE, FP8)}
DEFAULT_SCHEDULE = STABLE.name


def get_schedule(name: str | PrecisionSchedule | None) -> PrecisionSchedule:
    """Resolve a user-facing schedule name (None means the default). A schedule already resolved
    (``launch.call.AttentionCall.schedule``, which the layers below the op pass on) is returned as is."""
    if isinstance(name, PrecisionSchedule):
        return name
    if name is None:
        return SCHEDULES[DEFAULT_SCHEDULE]
    if not isinstance(name, str) or name not in SCHEDULES:
        raise ValueError(
            f"flash_attention: schedule={name!r} is not a known precision schedule; "
            f"choose one of {sorted(SCHEDULES)} (or None for {DEFAULT_SCHEDULE!r})."
        )
    return SCHEDULES[name]


def schedules_markdown_table() -> str:
    """The README's schedule table: one row per stage, one column per schedule.

    Stages every schedule shares are listed too, so the table is the whole contract. Measured
    errors and speeds are not quoted here: the README's next table holds them, made by
    ``tools/schedule_results.py`` from committed GPU results.
    """
    schedules = list(SCHEDULES.values())
    header = ["stage"] + [f"`{s.name}`" + (" (default)" if s.name == DEFAULT_SCHEDULE else "") for s in schedules]
    rows = [[row[0].name] + [stage.dtype for stage in row] for row in zip(*(s.stages() for s in schedules))]
    rows.append(["fp16 backward, \\|V\\| or \\|dO\\| ≈ 1e4"] + [
        "finite wherever the exact gradient is" if s.fp16_backward_finite else "may overflow" for s in schedules])
    rows.append(["accuracy budget"] + [
        f"output SQNR ≥ {s.sqnr_budget_db:g} dB vs fp64" if s.sqnr_budget_db is not None
        else "2× PyTorch's same-dtype error vs fp64" for s in schedules])
    return "\n".join(markdown_table(header, rows))
