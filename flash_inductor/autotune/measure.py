"""What the autotuner measures for one candidate: is it accurate, is it stable, how fast is it.

Accuracy: on a small random problem with ragged lengths (several tiles and a partial one), the
candidate's error against a float64 reference must stay within the budget PyTorch itself sets:

    max|ours - fp64| <= 2 * max|SDPA math backend, same dtype - fp64| + floor

(FlashAttention's test rule, as tests/helpers.py applies it; the floor is a few ulps of the
result's dtype at the result's magnitude and of fp32 at the magnitude of the terms summed to form
it, so a gradient that cancels to exactly 0, dK with one key a row, is held to fp32's rounding of
what cancelled rather than to 0). Stability: the candidate must stay finite on the probes its precision
schedule promises to survive:

* ``large_logits``: Q and K scaled so the logits are x50, forward (and backward);
* ``large_values``: |V| = 1e4 in fp16, backward, for schedules that keep the fp16 backward
  finite (dS rescaled or fp32); finite wherever the fp64 gradient fits in fp16;
* ``dead_rows``: rows that see no key (only bucket kinds where that can happen: a mask, or a
  causal problem with more queries than keys): output and dQ exactly 0 there, finite elsewhere.

Launch configs change no arithmetic a schedule promises, so a candidate failing these is a
miscompile or a kernel bug at that tile shape: exactly what the tuner must never ship.

Speed: the median of ``triton.testing.do_bench`` on a larger random problem (the timer is
injectable so the search can be tested on CPU).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Optional, Protocol

import torch
import torch.nn.functional as F

from ..tuning.buckets import BACKWARD_PASSES, Bucket
from ..tuning.configs import AttentionConfigs
from ..schedules import get_schedule

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
FLOOR_ULPS = 2  # of the result's dtype, for its final rounding
ARITH_ULPS = 16  # of fp32, for the accumulations a different tiling reorders
LOGIT_GAIN = 50.0
LARGE_VALUE = 1.0e4


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


# ------------------------------------------------------------------------------------------
# Problems
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    heads: int
    seq_q: int
    seq_k: int
    heads_kv: Optional[int] = None  # K/V heads (grouped-query attention); None: ``heads``


@dataclasses.dataclass
class Problem:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: Optional[torch.Tensor]
    is_causal: bool
    causal_offset: int
    scale: float
    dout: torch.Tensor

    def visibility(self):
        """The causal side as the launchers take it (a tuning problem has no window or block-sparse
        layout)."""
        from ..launch.visibility import Visibility

        return Visibility(is_causal=self.is_causal, causal_offset=self.causal_offset)


def make_problem(bucket: Bucket, shape: Shape, device, seed: int, *, qk_mult: float = 1.0, v_mult: float = 1.0,
                 dead_rows: bool = False, on_device: bool = False, shared_mask: bool = False) -> Problem:
    """Random inputs of ``bucket``'s dtype, width and mask kind.

    Drawn in fp64 on the CPU by default, so runs on different devices see the same values;
    ``on_device`` draws there instead (timing problems: large, and their values do not matter).
    ``shared_mask`` draws one (L, S) mask read by every batch and head through stride 0, as
    padding and causal-style masks are in practice; a per-head mask of a long timing problem
    would need gigabytes.
    A causal problem is bottom-right aligned (offset S - L): with L > S its first L - S rows see
    no key. Bool/float masks keep key 0 visible to every row, except the ``dead_rows``
    (0, L // 2, L - 1), which see nothing.
    """
    dtype = torch_dtype(bucket.dtype)
    draw_on = torch.device(device) if on_device else torch.device("cpu")
    g = torch.Generator(device=draw_on).manual_seed(seed)
    b, h, lq, lk, e = shape.batch, shape.heads, shape.seq_q, shape.seq_k, bucket.width
    h_kv = shape.heads_kv or h

    def randn(*size, mult=1.0):
        draw_dtype = dtype if on_device else torch.float64
        return (torch.randn(size, generator=g, dtype=draw_dtype, device=draw_on) * mult).to(dtype).to(device)

    q, k, v = randn(b, h, lq, e, mult=qk_mult), randn(b, h_kv, lk, e, mult=qk_mult), randn(b, h_kv, lk, e, mult=v_mult)
    dout = randn(b, h, lq, e)
    mask = None
    if bucket.mask in ("bool", "float"):
        mb, mh = (1, 1) if shared_mask else (b, h)
        hidden = torch.rand((mb, mh, lq, lk), generator=g, device=draw_on) < (0.25 if bucket.mask == "bool" else 0.15)
        hidden[..., 0] = False
        if dead_rows:
            hidden[:, :, sorted({0, lq // 2, lq - 1}), :] = True
        if bucket.mask == "bool":
            mask = (~hidden).to(device)
        else:
            mask = randn(mb, mh, lq, lk).masked_fill(hidden.to(device), float("-inf"))
        mask = mask.expand(b, h, lq, lk)
    return Problem(q, k, v, mask, bucket.mask == "causal", lk - lq, 1.0 / math.sqrt(e), dout)


def attention_flops(bucket: Bucket, shape: Shape) -> float:
    """The standard model: 4·B·H·L·S·E, x0.5 causal (not for decode, whose few rows see nearly
    every key), x2.5 backward."""
    flops = 4.0 * shape.batch * shape.heads * shape.seq_q * shape.seq_k * bucket.width
    if bucket.mask == "causal" and bucket.pass_name != "decode":
        flops *= 0.5
    return flops * (2.5 if bucket.pass_name in BACKWARD_PASSES else 1.0)


# ------------------------------------------------------------------------------------------
# Running a candidate
# ------------------------------------------------------------------------------------------


class KernelRunner(Protocol):
    """How the tuner runs the kernels with forced configs (tests inject broken ones)."""

    def forward(self, p: Problem, configs: AttentionConfigs, schedule: str) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward(self, p: Problem, out: torch.Tensor, lse: torch.Tensor, configs: AttentionConfigs,
                 schedule: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def decode(self, p: Problem, configs: AttentionConfigs, schedule: str) -> tuple[torch.Tensor, torch.Tensor]: ...

    def gluon_forward(self, p: Problem, configs: AttentionConfigs, schedule: str, exact: bool) -> tuple: ...

    def gluon_saved(self, p: Problem, configs: AttentionConfigs, schedule: str) -> tuple: ...

    def gluon_backward(self, p: Problem, saved: tuple, configs: AttentionConfigs,
                       schedule: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


class LaunchRunner:
    """The package's launchers, exactly as the op calls them, with the configs forced."""

    def forward(self, p, configs, schedule):
        from .. import launch

        return launch.attention_forward(p.q, p.k, p.v, p.mask, None, 0.0, p.scale, schedule,
                                        visibility=p.visibility(), configs=configs)

    def backward(self, p, out, lse, configs, schedule):
        from .. import launch

        dq, dk, dv, _ = launch.attention_backward(p.dout, p.q, p.k, p.v, p.mask, out, lse, None, None, 0.0,
                                                  p.scale, schedule, False, visibility=p.visibility(),
                                                  configs=configs)
        return dq, dk, dv

    def decode(self, p, configs, schedule):
        from ..launch.decode import decode_attention_forward

        return decode_attention_forward(p.q, p.k, p.v, p.mask, p.scale, schedule, visibility=p.visibility(),
                                        config=configs.decode)

    # The Gluon Hopper kernels (passes gluon_*): called as the ops call them, with the config forced.

    def gluon_forward(self, p, configs, schedule, exact):
        """(out, lse, ...) of the Gluon forward; ``exact``: `stable`'s one-pass training forward."""
        from ..launch import hopper

        config = configs.gluon_forward_exact if exact else configs.gluon_forward
        return hopper.hopper_attention_forward(p.q, p.k, p.v, scale=p.scale, visibility=p.visibility(), config=config,
                                               exact_delta=exact, schedule=schedule)

    def gluon_saved(self, p, configs, schedule):
        """What the backward takes from its forward (and, for the exact Δ, k̂): out, lse, then the
        exact-Δ keywords. Config-independent work, done once per timing problem."""
        from ..launch import hopper_bwd

        exact = _one_pass(schedule)
        out, lse, *rest = self.gluon_forward(p, configs, schedule, exact)
        extra = dict(exact_delta=tuple(rest), mean_key=hopper_bwd.key_mean(p.k)) if exact else {}
        return out, lse, extra

    def gluon_backward(self, p, saved, configs, schedule):
        from ..launch import hopper_bwd

        out, lse, extra = saved
        return hopper_bwd.hopper_attention_backward(p.dout, p.q, p.k, p.v, out, lse, None, scale=p.scale,
                                                    visibility=p.visibility(), config=configs.gluon_backward,
                                                    schedule=schedule, **extra)


def _one_pass(schedule: str) -> bool:
    """Whether the schedule's Gluon backward is the one-pass exact Δ (`stable`) rather than `fast`'s."""
    return get_schedule(schedule).exact_delta


def run_pass(runner: KernelRunner, p: Problem, configs: AttentionConfigs, schedule: str, pass_name: str) -> dict:
    if pass_name == "decode":
        return {"out": runner.decode(p, configs, schedule)[0]}
    if pass_name in ("gluon_forward", "gluon_forward_exact"):
        return {"out": runner.gluon_forward(p, configs, schedule, pass_name == "gluon_forward_exact")[0]}
    if pass_name == "gluon_backward":
        saved = runner.gluon_saved(p, configs, schedule)
        return {"out": saved[0], **dict(zip(("dq", "dk", "dv"), runner.gluon_backward(p, saved, configs, schedule)))}
    out, lse = runner.forward(p, configs, schedule)
    result = {"out": out}
    if pass_name == "backward":
        result.update(zip(("dq", "dk", "dv"), runner.backward(p, out, lse, configs, schedule)))
    return result


# ------------------------------------------------------------------------------------------
# Ground truth and PyTorch's same-dtype error
# ------------------------------------------------------------------------------------------


def _visible(p: Problem) -> torch.Tensor:
    lq, lk = p.q.shape[-2], p.k.shape[-2]
    vis = torch.ones((*p.q.shape[:-1], lk), dtype=torch.bool, device=p.q.device)
    if p.mask is not None:
        vis = vis & (p.mask if p.mask.dtype == torch.bool else ~p.mask.isneginf())
    if p.is_causal:
        i = torch.arange(lq, device=p.q.device)[:, None]
        j = torch.arange(lk, device=p.q.device)[None, :]
        vis = vis & (j <= i + p.causal_offset)
    return vis


def reference_fp64(p: Problem, pass_name: str) -> dict:
    """Naive materialised attention in float64 (rows with no visible key give 0), by autograd."""
    backward = pass_name in BACKWARD_PASSES
    q, k, v = (t.detach().double().requires_grad_(backward) for t in (p.q, p.k, p.v))
    group = q.shape[1] // k.shape[1]  # grouped-query attention: each K/V head serves `group` query heads
    scores = (q @ k.repeat_interleave(group, dim=1).transpose(-2, -1)) * p.scale
    if p.mask is not None and p.mask.dtype != torch.bool:
        scores = scores + p.mask.double()
    vis = _visible(p)
    scores = scores.masked_fill(~vis, float("-inf"))
    # A row with no visible key shifts by 0 instead of forming -inf - -inf.
    row_max = scores.detach().amax(-1, keepdim=True).nan_to_num(neginf=0.0)
    unnorm = torch.exp(scores - row_max)
    total = unnorm.sum(-1, keepdim=True)
    probs = unnorm / total.clamp_min(torch.finfo(torch.float64).tiny)
    v_rows = v.repeat_interleave(group, dim=1)
    out = probs @ v_rows
    result = {"out": out.detach(), "dead": ~vis.any(-1)}
    if backward:
        out.backward(p.dout.double())
        result.update(dq=q.grad, dk=k.grad, dv=v.grad)
    result["terms"] = _term_magnitudes(p, probs.detach(), v_rows.detach(), out.detach(), group, backward)
    return result


def _term_magnitudes(p: Problem, probs, v_rows, out, group: int, backward: bool) -> dict:
    """The largest sum of |terms| behind each result (tests/helpers.py has the same rule): fp32
    arithmetic errs in proportion to these, not to the result. With one key per row, dS = P (dP - Δ)
    cancels to 0 exactly, so dK and dQ are 0 while the dP and Δ they cancel are O(1)."""
    q, k, dout = p.q.double(), p.k.double().repeat_interleave(group, dim=1), p.dout.double()

    def per_kv_head(t):  # (B, Hq, S, D) -> (B, Hkv, S, D): a K/V head's gradient sums its group
        return t.unflatten(1, (-1, group)).sum(2)

    terms = {"out": (probs @ v_rows.abs()).max().item()}
    if backward:
        ds_terms = probs * ((dout @ v_rows.transpose(-2, -1)).abs() + (dout * out).sum(-1, keepdim=True).abs())
        terms.update(dq=p.scale * (ds_terms @ k.abs()).max().item(),
                     dk=p.scale * per_kv_head(ds_terms.transpose(-2, -1) @ q.abs()).max().item(),
                     dv=per_kv_head(probs.transpose(-2, -1) @ dout.abs()).max().item())
    return terms


def sdpa_same_dtype(p: Problem, pass_name: str) -> dict:
    """PyTorch's math backend in the input dtype: the error budget's yardstick."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backward = pass_name in BACKWARD_PASSES
    q, k, v = (t.detach().clone().requires_grad_(backward) for t in (p.q, p.k, p.v))
    mask = p.mask
    if p.is_causal:
        vis = _visible(p)
        if mask is None:
            mask = vis
        else:
            mask = mask & vis if mask.dtype == torch.bool else mask.masked_fill(~vis, float("-inf"))
    with sdpa_kernel(SDPBackend.MATH):
        gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=p.scale, **gqa)
    result = {"out": out.detach()}
    if backward:
        out.backward(p.dout)
        result.update(dq=q.grad, dk=k.grad, dv=v.grad)
    return result


def sqnr_db(actual: torch.Tensor, truth: torch.Tensor) -> float:
    """Signal-to-quantisation-noise ratio of ``actual`` against ``truth``, in dB (inf if equal)."""
    truth = truth.double().to(actual.device)
    noise = (actual.double() - truth).square().sum().item()
    signal = truth.square().sum().item()
    if noise == 0:
        return math.inf
    return 10.0 * math.log10(signal / noise) if signal > 0 else -math.inf


def max_error(actual: torch.Tensor, truth: torch.Tensor) -> float:
    diff = (actual.double() - truth.double().to(actual.device)).abs()
    return diff.max().item() if diff.numel() else 0.0


# ------------------------------------------------------------------------------------------
# The accuracy check and the probes
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Verdict:
    ok: bool
    error: float = float("nan")  # max abs error vs fp64 over the checked outputs
    error_ratio: float = float("nan")  # max over outputs of error / budget (<= 1 passes)
    reason: str = ""


@dataclasses.dataclass
class _Probe:
    name: str
    problem: Problem
    reference: dict


def check_problems(bucket: Bucket, shape: Shape, device, seed: int = 0) -> list[tuple[str, Problem]]:
    """The random check problem, then the stability probes that apply to this bucket kind."""
    problems = [("check", make_problem(bucket, shape, device, seed)),
                ("large_logits", make_problem(bucket, shape, device, seed + 1, qk_mult=math.sqrt(LOGIT_GAIN)))]
    if bucket.pass_name in BACKWARD_PASSES and bucket.dtype == "fp16":
        problems.append(("large_values", make_problem(bucket, shape, device, seed + 2, v_mult=LARGE_VALUE)))
    if bucket.mask != "none":  # no row can lose every key otherwise
        dead_shape = shape
        if bucket.mask == "causal":  # L > S, bottom-right: the first L - S rows see nothing
            dead_shape = dataclasses.replace(shape, seq_k=max(shape.seq_q - 16, 1))
        problems.append(("dead_rows", make_problem(bucket, dead_shape, device, seed + 3, dead_rows=True)))
    return problems


class AccuracyCheck:
    """A bucket kind's check problem, its fp64 reference, PyTorch's budget and the probes.

    Built once per (dtype, width, mask kind, pass) and shared by every schedule and length:
    the check runs at a fixed small ragged shape.
    """

    def __init__(self, bucket: Bucket, shape: Shape, device, seed: int = 0):
        self.pass_name = bucket.pass_name
        self.dtype = torch_dtype(bucket.dtype)
        (_, self.problem), *probes = check_problems(bucket, shape, device, seed)
        self.reference = reference_fp64(self.problem, self.pass_name)
        baseline = sdpa_same_dtype(self.problem, self.pass_name)
        self.budgets = {}
        for name in self.outputs:
            magnitude = self.reference[name].abs().max().item()
            terms = max(self.reference["terms"][name], magnitude)
            floor = (FLOOR_ULPS * torch.finfo(self.dtype).eps * magnitude
                     + ARITH_ULPS * torch.finfo(torch.float32).eps * terms)
            self.budgets[name] = 2.0 * max_error(baseline[name], self.reference[name]) + floor
        self.probes = [_Probe(name, p, reference_fp64(p, self.pass_name)) for name, p in probes]

    @property
    def outputs(self) -> tuple[str, ...]:
        return ("dq", "dk", "dv") if self.pass_name in BACKWARD_PASSES else ("out",)  # forward, decode

    def verify(self, runner: KernelRunner, configs: AttentionConfigs, schedule: str) -> Verdict:
        try:
            ours = run_pass(runner, self.problem, configs, schedule, self.pass_name)
            errors = {name: max_error(ours[name], self.reference[name]) for name in self.outputs}
            error = max(errors.values())
            ratio = max(_ratio(errors[n], self.budgets[n]) for n in self.outputs)
            if not math.isfinite(error) or any(not ours[n].isfinite().all() for n in self.outputs):
                return Verdict(False, error, ratio, "non-finite on the random check problem")
            sqnr_budget = get_schedule(schedule).sqnr_budget_db
            if sqnr_budget is not None and self.pass_name == "forward":
                # An SQNR floor instead of PyTorch's error: ratio 1 at the floor, 10x per 20 dB below it.
                measured = sqnr_db(ours["out"], self.reference["out"])
                ratio = 10.0 ** ((sqnr_budget - measured) / 20.0)
                if ratio > 1.0:
                    return Verdict(False, error, ratio, f"out SQNR {measured:.1f} dB < budget {sqnr_budget:g} dB")
            elif ratio > 1.0:
                worst = max(self.outputs, key=lambda n: _ratio(errors[n], self.budgets[n]))
                return Verdict(False, error, ratio,
                               f"{worst} error {errors[worst]:.3e} > budget {self.budgets[worst]:.3e}")
            for probe in self.probes:
                if probe.name == "large_values" and not get_schedule(schedule).fp16_backward_finite:
                    continue  # the schedule promises nothing there (fp16 dS may overflow by design)
                failure = _probe_failure(probe, run_pass(runner, probe.problem, configs, schedule, self.pass_name))
                if failure:
                    return Verdict(False, error, ratio, f"probe {probe.name}: {failure}")
        except Exception as exc:  # a config that fails to compile or launch is simply not a candidate
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            return Verdict(False, reason=f"{type(exc).__name__}: {first}")
        return Verdict(True, error, ratio)


def _ratio(error: float, budget: float) -> float:
    if budget > 0:
        return error / budget
    return 0.0 if error == 0 else math.inf


def _probe_failure(probe: _Probe, ours: dict) -> str:
    ref = probe.reference
    for name, value in ours.items():
        representable = ref[name].abs() <= torch.finfo(value.dtype).max
        if not value[representable.to(value.device)].isfinite().all():
            return f"{name} non-finite where the fp64 value is representable"
    dead = ref["dead"].to(ours["out"].device)
    if dead.any():
        if not (ours["out"][dead] == 0).all():
            return "rows with no visible key: output is not exactly 0"
        if "dq" in ours and not (ours["dq"][dead] == 0).all():
            return "rows with no visible key: dq is not exactly 0"
    return ""


# ------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------

Timer = Callable[[Callable[[], object], object], float]  # (run, candidate) -> milliseconds


def run_for(fn: Callable[[], object], ms: float, clock: Callable[[], float] = time.monotonic,
            synchronize: Callable[[], None] | None = None) -> None:
    """Call ``fn`` back to back for about ``ms`` of device time, syncing once per batch; batches
    double until one takes ~20 ms so the syncs stay rare.

    Why: an H200 under attention draws its 700 W limit within ~0.2 s and then lowers its SM clock
    to ~1750 MHz from 1980. A candidate timed straight after its compile (the card idle) runs at the
    boost clock, and the configs that win there are not the ones that win at the limited clock a
    training job runs at: on an H200 the E 128 forward config 64x64 with 4 warps timed at 504
    TFLOP/s cold and 448 sustained, and 128x64 with 8 warps at 471 cold and 462 sustained
    (benchmarks/results/clock_nvidia-h200_20261201.json, sustained_sweep)."""
    if synchronize is None:
        if not torch.cuda.is_available():  # the interpreter: no clock to settle, and a call takes seconds
            return
        synchronize = torch.cuda.synchronize
    if ms <= 0:
        return
    end, batch = clock() + ms / 1000, 1
    while clock() < end:
        start = clock()
        for _ in range(batch):
            fn()
        synchronize()
        if clock() - start < 0.02:
            batch *= 2


def do_bench_timer(warmup_ms: int = 5, rep_ms: int = 25, heat_ms: int = 0) -> Timer:
    """Median of ``triton.testing.do_bench`` (which flushes L2 between runs), after ``heat_ms`` of
    back-to-back calls (``run_for``) so every candidate is timed at the card's sustained clock."""

    def timer(run, candidate) -> float:
        from triton.testing import do_bench

        run_for(run, heat_ms)
        return float(do_bench(run, warmup=warmup_ms, rep=rep_ms, return_mode="median"))

    return timer
