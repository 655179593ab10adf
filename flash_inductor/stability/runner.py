"""Running the suite: every case × dtype × implementation against the fp64 reference, and the
requirement the default schedule must meet.

Errors, per result ``x`` in (out, dq, dk, dv), over the entries whose fp64 value the dtype can
hold (``|ref| <= finfo(dtype).max``; elsewhere no 16-bit result can be right):
  * ``nonfinite``: entries where ``x`` is NaN or inf;
  * ``rel``: norm-wise relative error ``||x - ref|| / ||ref||`` over the finite entries of ``x``;
  * ``max_abs``: ``max |x - ref|`` over the same entries.

The requirement (:func:`check_requirements`), for the default schedule on every case × dtype:
  1. no non-finite out / dq / dk / dv where the reference is finite (and representable);
  2. for each of out, dq, dk, dv: ``||ours - ref|| <= 2 * best + floor``, where ``best`` is the
     smallest ``||x - ref||`` among the anchors that ran and were finite everywhere for that
     result (a non-finite anchor is never "best"), and ``floor`` is tests/helpers.py's tolerance
     floor in norm form, ``2 eps(dtype) ||ref|| + 4 eps(fp32) ||terms||``: two ulps of the dtype
     at the result's size (its final rounding) plus four fp32 ulps at the size of the terms it
     is summed from (``truth._term_norms``). The floor keeps an anchor that happens to be
     (near-)exact, e.g. ``sdpa:math``, which upcasts to fp32, from shrinking the bound to
     nothing, and keeps results that cancel to ~0 (dq under one-hot attention) from demanding
     more than fp32 arithmetic can give. Where no anchor is finite only (1) applies; the report
     says so.

A result whose reference is zero to working precision (``||ref|| < 4 eps(fp32) ||terms||``) has no
meaningful relative error; it is left out of the table's cells (still checked by the bound).
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
import zlib
from typing import Iterable, Optional

import torch
from torch import Tensor

from ..schedules import DEFAULT_SCHEDULE
from .anchors import MAX_MATERIALISED, Implementation, NotApplicable, ours_name
from .cases import Case, Problem, Sizes
from .truth import reference

RESULTS = ("out", "dq", "dk", "dv")
DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
EPS = {"fp16": 2.0**-10, "bf16": 2.0**-7, "fp32": 2.0**-23}
# tests/helpers.py's floor: FLOOR_ULPS ulps of the result's dtype, ARITH_ULPS ulps of fp32 at the terms.
FLOOR_ULPS, ARITH_ULPS = 2, 4


@dataclasses.dataclass
class Metric:
    rel: float  # ||x - ref|| / ||ref||
    max_abs: float
    nonfinite: int
    err: float  # ||x - ref||
    ref_norm: float
    terms: float  # norm of the term magnitudes behind the result

    @property
    def negligible_reference(self) -> bool:
        """The exact result is zero to fp32 working precision: a relative error means nothing."""
        return self.ref_norm < ARITH_ULPS * EPS["fp32"] * self.terms


@dataclasses.dataclass
class Result:
    case: str
    dtype: str
    impl: str
    status: str  # "ok", "n/a" (cannot take the problem), "skipped" (too large to materialise), "error"
    reason: str = ""
    metrics: dict = dataclasses.field(default_factory=dict)  # result name -> Metric
    seconds: float = 0.0

    @property
    def finite(self) -> bool:
        return self.status == "ok" and all(m.nonfinite == 0 for m in self.metrics.values())

    def worst_rel(self) -> float:
        """The worst relative error over the results whose reference is not negligible."""
        return max((m.rel for m in self.metrics.values() if not m.negligible_reference), default=math.nan)


def measure(x: Tensor, ref: Tensor, dtype: torch.dtype, terms: float) -> Metric:
    x, ref = x.detach().to(torch.float64), ref.to(x.device)
    representable = ref.abs() <= torch.finfo(dtype).max
    finite = x.isfinite()
    nonfinite = int((representable & ~finite).sum())
    used = representable & finite
    diff = (x - ref)[used]
    ref_norm = ref[representable].norm().item()
    err = diff.norm().item()
    return Metric(rel=err / ref_norm if ref_norm > 0 else (0.0 if err == 0 else math.inf),
                  max_abs=diff.abs().max().item() if diff.numel() else 0.0, nonfinite=nonfinite,
                  err=err, ref_norm=ref_norm, terms=terms)


def error_floor(metric: Metric, dtype: str) -> float:
    """The absolute (norm-wise) floor of the requirement's bound (module docstring)."""
    return FLOOR_ULPS * EPS[dtype] * metric.ref_norm + ARITH_ULPS * EPS["fp32"] * metric.terms


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:200]


def _sdpa_reason(caught: list) -> str:
    """SDPA says why a forced backend refused in warnings ("... not used because ...")."""
    for w in caught:
        message = str(w.message)
        if "because" in message or "not supported" in message.lower():
            return message.strip().splitlines()[0][:200]
    return ""


def run_implementation(impl: Implementation, problem: Problem, truth: dict, case: str, dtype: torch.dtype) -> Result:
    name = DTYPE_NAMES[dtype]
    if impl.materialises and problem.scores_numel > MAX_MATERIALISED:
        return Result(case, name, impl.name, "skipped",
                      f"would materialise {problem.scores_numel:.2e} scores (limit {MAX_MATERIALISED:.2e})")
    q, k, v = (t.detach().clone().requires_grad_() for t in (problem.query, problem.key, problem.value))
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = impl.run(problem, q, k, v)
            out.backward(problem.grad_out)
            if out.device.type == "cuda":
                torch.cuda.synchronize()
        except NotApplicable as error:
            return Result(case, name, impl.name, "n/a", str(error))
        except Exception as error:  # noqa: BLE001 -- an anchor that cannot run is data, not a crash
            if isinstance(error, torch.cuda.OutOfMemoryError):
                torch.cuda.empty_cache()
            reason = "; ".join(r for r in (_first_line(error), _sdpa_reason(caught)) if r)
            return Result(case, name, impl.name, "error" if impl.is_ours else "n/a", reason)
    seconds = time.perf_counter() - start
    rows = problem.rows or slice(None)
    got = dict(out=out[..., rows, :], dq=q.grad, dk=k.grad, dv=v.grad)
    if any(g is None for g in got.values()):
        return Result(case, name, impl.name, "error" if impl.is_ours else "n/a", "no gradient for q, k or v")
    metrics = {r: measure(got[r], truth[r], dtype, truth["terms"][r]) for r in RESULTS}
    return Result(case, name, impl.name, "ok", metrics=metrics, seconds=seconds)


def case_seed(case: Case, dtype: torch.dtype, seed: int) -> int:
    return seed * 1_000_003 + zlib.crc32(f"{case.name}/{DTYPE_NAMES[dtype]}".encode())


def run_case(case: Case, dtype: torch.dtype, impls: list[Implementation], device: str, sizes: Sizes,
             seed: int = 0) -> list[Result]:
    gen = torch.Generator(device=device).manual_seed(case_seed(case, dtype, seed))
    problem = case.build(dtype, device, sizes, gen)
    truth = reference(problem)
    results = [run_implementation(impl, problem, truth, case.name, dtype) for impl in impls]
    del problem, truth
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return results


def work_items(cases: list[Case], dtypes: Optional[list[torch.dtype]]) -> list[tuple[Case, torch.dtype]]:
    return [(c, d) for c in cases for d in c.dtypes if dtypes is None or d in dtypes]


def run_suite(cases: list[Case], impls: list[Implementation], device: str, sizes: Sizes,
              dtypes: Optional[list[torch.dtype]] = None, seed: int = 0, progress=None,
              time_budget: Optional[float] = None) -> list[Result]:
    """Every case × dtype (a case lists its dtypes; ``dtypes`` filters them) × implementation.

    ``progress`` wraps the iterable of (case, dtype) items (e.g. tqdm) when given. With
    ``time_budget`` (seconds), no new item starts once it is spent, so a bounded run still returns
    (and its caller writes) what it measured.
    """
    items = work_items(cases, dtypes)
    iterator: Iterable = progress(items) if progress is not None else items
    results: list[Result] = []
    start = time.monotonic()
    for case, dtype in iterator:
        if time_budget is not None and time.monotonic() - start > time_budget:
            break
        if hasattr(iterator, "set_postfix_str"):
            iterator.set_postfix_str(f"{case.name} {DTYPE_NAMES[dtype]}")
        results.extend(run_case(case, dtype, impls, device, sizes, seed))
    return results


# ------------------------------------------------------------------------------------------
# The requirement
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Check:
    """One case × dtype × result of the default schedule against the best finite anchor (norm-wise
    absolute errors; ``rel`` values divide them by the reference's norm)."""

    case: str
    dtype: str
    result: str
    ours_err: float
    ours_rel: float
    ours_nonfinite: int
    best_anchor: Optional[str]
    best_err: Optional[float]
    floor: float
    bound: Optional[float]
    ok: bool
    note: str = ""


@dataclasses.dataclass
class Requirement:
    schedule: str
    checks: list[Check]
    violations: list[str]

    @property
    def passed(self) -> bool:
        return not self.violations

    def format(self) -> str:
        pairs = {(c.case, c.dtype) for c in self.checks}
        no_anchor = sorted({f"{c.case}/{c.dtype}" for c in self.checks if c.best_anchor is None})
        lines = [f"Requirement (schedule '{self.schedule}'), on {len(pairs)} case x dtype: out/dq/dk/dv finite wherever "
                 "the fp64 reference is, and ||ours - ref|| <= 2 x best finite anchor + floor "
                 "(floor = 2 eps(dtype) ||ref|| + 4 eps(fp32) ||terms||)"]
        if no_anchor:
            lines.append(f"  no finite anchor (finiteness only): {', '.join(no_anchor)}")
        lines += [f"  VIOLATION {v}" for v in self.violations]
        lines.append("  PASS" if self.passed else f"  FAIL: {len(self.violations)} violation(s)")
        return "\n".join(lines)


def check_requirements(results: list[Result], schedule: str = DEFAULT_SCHEDULE) -> Requirement:
    """The suite's required outcome for ``schedule`` (module docstring); ``passed`` says if it holds."""
    ours = ours_name(schedule)
    checks: list[Check] = []
    violations: list[str] = []
    groups: dict[tuple[str, str], list[Result]] = {}
    for r in results:
        groups.setdefault((r.case, r.dtype), []).append(r)
    for (case, dtype), group in groups.items():
        mine = next((r for r in group if r.impl == ours), None)
        if mine is None:
            continue
        if mine.status != "ok":
            violations.append(f"{case}/{dtype}: {ours} did not run ({mine.status}: {mine.reason})")
            continue
        anchors = [r for r in group if r.status == "ok" and not r.impl.startswith("ours:")]
        for result in RESULTS:
            m = mine.metrics[result]
            finite_anchors = [(r.metrics[result].err, r.impl) for r in anchors if r.metrics[result].nonfinite == 0]
            best_err, best = min(finite_anchors) if finite_anchors else (None, None)
            floor = error_floor(m, dtype)
            bound = 2 * best_err + floor if best is not None else None
            ok = m.nonfinite == 0 and (bound is None or m.err <= bound)
            checks.append(Check(case, dtype, result, m.err, m.rel, m.nonfinite, best, best_err, floor, bound, ok,
                                "" if best else "no finite anchor"))
            if m.nonfinite:
                violations.append(f"{case}/{dtype} {result}: {m.nonfinite} non-finite entries where the reference is finite")
            elif not ok:
                ref = m.ref_norm or 1.0
                violations.append(
                    f"{case}/{dtype} {result}: rel {m.rel:.2e} > 2 x {best} {best_err / ref:.2e} + floor "
                    f"{floor / ref:.2e} = {bound / ref:.2e}"
                )
    if not checks and not violations:
        # --impls without ours, or a time budget spent before any case: a PASS would check nothing.
        violations.append(f"{ours} ran on no case: nothing was checked")
    return Requirement(schedule, checks, violations)
