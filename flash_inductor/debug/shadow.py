"""The shadow check: every attention site also runs in float64 on the side, and each result is held
to the project's tolerance rule (tests/helpers.py):

    max|site - fp64| <= 2 * max|SDPA in the site's dtype - fp64| + floor,
    floor = 2 eps(dtype) max|fp64| + 4 eps(fp32) max|fp64|

for the output and, when a backward runs, dq, dk, dv (the fp64 gradients come from the same
upstream gradient the site received). The report names the first result, in the order the model
computed them, that breaks the rule, and the statistic that explains it (``explain_cause``).

    with flash_inductor.debug.shadow(model) as check:
        model(x).loss.backward()
    print(check.report())
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from ..text_table import text_table
from .session import CallRecord, DebugSession, dtype_max
from .sites import Instrumented

FLOOR_ULPS, ARITH_ULPS = 2, 4  # as tests/helpers.py


@dataclasses.dataclass
class Check:
    """One result of one call held to the rule."""

    site: str
    call: int
    event: int
    result: str  # "out", "dq", "dk", "dv"
    error: float  # max |site - fp64| (inf where the site is non-finite and fp64 is not)
    baseline_error: float  # max |SDPA same dtype - fp64|
    floor: float
    magnitude: float
    compared: int = 0  # entries where the fp64 reference is finite (0: nothing to judge)

    @property
    def bound(self) -> float:
        return 2 * self.baseline_error + self.floor

    @property
    def ok(self) -> bool:
        return self.error <= self.bound

    @property
    def ratio(self) -> float:
        return self.error / self.bound if self.bound > 0 else (0.0 if self.error == 0 else math.inf)


def tolerance_check(site, call, event, result, actual, reference, baseline) -> Check:
    ref = reference.detach().double()
    actual = actual.detach().to(ref.device)
    finite = ref.isfinite()
    diff = (actual.double() - ref).abs()
    error = diff[finite].max().item() if finite.any() else 0.0
    if not actual[finite].isfinite().all():
        error = math.inf
    base_error = 0.0
    if baseline is not None:
        baseline = baseline.detach().double()
        usable = finite & baseline.isfinite()
        base_error = (baseline - ref).abs()[usable].max().item() if usable.any() else 0.0
    magnitude = ref[finite].abs().max().item() if finite.any() else 0.0
    eps = torch.finfo(actual.dtype).eps if actual.is_floating_point() else 0.0
    floor = FLOOR_ULPS * eps * magnitude + ARITH_ULPS * torch.finfo(torch.float32).eps * magnitude
    return Check(site, call, event, result, error, base_error, floor, magnitude, int(finite.sum()))


def explain_cause(stats: dict, dtype: str) -> str:
    """The statistic that explains a failure at a site, most upstream cause first."""
    top = dtype_max(dtype)
    if stats.get("input_nonfinite"):
        return (f"non-finite input: {stats['input_nonfinite']} NaN/inf entries in q/k/v "
                "(the problem starts upstream of this site)")
    qk = stats.get("qk_absmax", 0.0)
    if qk is not None and qk > top:
        return (f"max |q·kᵀ| = {qk:.6g} > {dtype} max {top:.6g}: the product overflows in {dtype} before "
                "the scale is applied")
    lo, hi = stats.get("logit_min", math.nan), stats.get("logit_max", math.nan)
    if max(abs(lo), abs(hi)) > top:
        return f"logits reach {max(abs(lo), abs(hi)):.6g} > {dtype} max {top:.6g}"
    if stats.get("masked_rows"):
        return (f"{stats['masked_rows']} fully-masked rows (no visible key): softmax over an all -inf row is NaN, "
                "over an all finfo.min row uniform")
    return f"logits in [{lo:.4g}, {hi:.4g}], LSE in [{stats.get('lse_min', math.nan):.4g}, " \
           f"{stats.get('lse_max', math.nan):.4g}]"


class ShadowCheck(DebugSession):
    """The session of :func:`shadow`; ``report()`` gives the :class:`ShadowReport`."""

    def __init__(self):
        super().__init__()
        self.checks: list[Check] = []
        self._pending: dict[int, dict] = {}  # record call -> fp64 / baseline gradients

    def on_forward(self, index, out, inputs, q1, k1, mask, ref, base, leaves64, leaves_same) -> CallRecord:
        record = super().on_forward(index, out, inputs, q1, k1, mask, ref, base, leaves64, leaves_same)
        if ref is None:
            return record
        self.checks.append(tolerance_check(record.site, record.call, record.event, "out", out, ref, base))
        # Self-attention on one tensor (q is k is v, as nn.MultiheadAttention sees it): the model's
        # gradient there is the sum of dq, dk and dv, which cannot be held to each one: out only.
        distinct = len({id(t) for t in inputs}) == len(inputs)
        if distinct and torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(self._upstream_hook(record, ref, base, leaves64, leaves_same))
        return record

    def _upstream_hook(self, record, ref, base, leaves64, leaves_same):
        def hook(grad_out):
            pending = {}
            for tag, result, leaves, dtype in (("ref", ref, leaves64, torch.float64),
                                               ("base", base, leaves_same, None)):
                named = [(n, leaf) for n, leaf in zip(("dq", "dk", "dv"), leaves)
                         if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
                if not named or not result.requires_grad:
                    continue
                with torch.enable_grad():
                    grads = torch.autograd.grad(result, [leaf for _, leaf in named],
                                                grad_out.detach().to(dtype or result.dtype), allow_unused=True)
                pending[tag] = {n: g for (n, _), g in zip(named, grads) if g is not None}
            self._pending[record.call] = pending
        return hook

    def on_gradient(self, record, name, grad) -> None:
        pending = self._pending.get(record.call, {})
        ref = pending.get("ref", {}).get(name)
        if ref is None:
            return
        base = pending.get("base", {}).get(name)
        self.checks.append(tolerance_check(record.site, record.call, record.backward_event, name, grad, ref, base))

    def report(self) -> "ShadowReport":
        by_call = {r.call: r for r in self.records}
        return ShadowReport(sorted(self.checks, key=lambda c: (c.event, c.call, "out dq dk dv".index(c.result))),
                            by_call, [s.name for s in self.sites], self.kept,
                            [s.name for s in self.sites if not s.shadow])


@dataclasses.dataclass
class ShadowReport:
    checks: list[Check]
    records: dict  # call -> CallRecord
    sites: list[str]
    kept: list
    unchecked: list[str]  # sites with dropout: no fp64 twin

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    @property
    def first_failure(self) -> Optional[Check]:
        """The first result, in the order the model computed them, that breaks the rule."""
        failures = self.failures
        return failures[0] if failures else None

    @property
    def cause(self) -> Optional[str]:
        first = self.first_failure
        if first is None:
            return None
        record = self.records[first.call]
        return explain_cause(record.stats, record.dtype)

    def site_summary(self) -> dict:
        """site -> {result: worst error / bound}."""
        out: dict = {name: {} for name in self.sites}
        for c in self.checks:
            if not c.compared:
                continue
            worst = out.setdefault(c.site, {})
            worst[c.result] = max(worst.get(c.result, 0.0), c.ratio)
        return out

    def format(self) -> str:
        summary = self.site_summary()
        rows = [("site", "dtype", "calls", "out", "dq", "dk", "dv", "verdict")]
        calls: dict = {}
        dtypes: dict = {}
        bad_input: set = set()
        for r in self.records.values():
            calls[r.site] = calls.get(r.site, 0) + 1
            dtypes[r.site] = r.dtype
            if r.stats.get("input_nonfinite"):
                bad_input.add(r.site)
        for site in self.sites:
            ratios = summary.get(site, {})
            ok = all(v <= 1.0 for v in ratios.values())
            verdict = ("unchecked (dropout)" if site in self.unchecked else "ok" if ok else "FAILS")
            if site in bad_input:
                verdict += ", non-finite input"
            rows.append((site, dtypes.get(site, "-"), str(calls.get(site, 0)),
                         *(_ratio(ratios.get(k)) for k in ("out", "dq", "dk", "dv")), verdict))
        lines = [f"flash_inductor shadow check: {len(self.sites)} attention site(s), {len(self.checks)} result(s) "
                 "held to |err vs fp64| <= 2 x SDPA same-dtype err + floor (columns: worst err / bound)"]
        lines += text_table(rows, align="<>", indent="  ")
        for module, pattern, reason in self.kept:
            lines.append(f"  not checked: {module or '<model>'} ({pattern}): {reason}")
        first = self.first_failure
        if first is None:
            lines.append("first failure: none")
        else:
            lines.append(f"first failure: {first.site} {first.result} (call {first.call}): error {first.error:.3g} > "
                         f"bound {first.bound:.3g} (|fp64| <= {first.magnitude:.3g})")
            lines.append(f"  why: {self.cause}")
        return "\n".join(lines)

    __str__ = format


def _ratio(x: Optional[float]) -> str:
    if x is None:
        return "-"
    return "inf" if math.isinf(x) else f"{x:.2g}"


def shadow(model: torch.nn.Module) -> Instrumented:
    """``with shadow(model) as check: ...; print(check.report())``: inside the block every attention
    site of ``model`` (hand-written, SDPA, ``nn.MultiheadAttention``, our op) also runs in float64
    and SDPA on the side, and is held to the tolerance rule; the model's own computation is
    unchanged. Outside the block the model is untouched.

    The model is captured by dynamo (``torch.compile`` with a backend that runs the captured graph
    op by op, as eager would); sites are found by the rewrite pass's pattern finders. Sites with
    dropout are listed but not compared (their random mask has no float64 twin); sites the pass
    keeps (e.g. attention weights that are also returned) are listed with the reason.
    Costs: a dynamo capture per input shape, and per call an fp64 attention, an SDPA call and,
    in the backward, their gradients, with their L x S score matrices. Meant for small repro sizes.
    """
    return Instrumented(model, ShadowCheck(), shadow=True)
