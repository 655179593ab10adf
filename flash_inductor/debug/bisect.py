"""The critical length: the shortest sequence length at which a model's forward or backward first
goes non-finite (or, with ``criterion="tolerance"``, breaks the shadow check's tolerance) in a given
dtype, and the attention site and statistic responsible there.

    result = flash_inductor.debug.bisect_length(factory, dtype="fp16")
    python -m flash_inductor.debug bisect-length MODULE:FACTORY --dtype fp16

``factory(length)`` returns ``(model, inputs)``: ``inputs`` a tuple of positional arguments, a dict
of keyword arguments or one tensor. The model runs in ``dtype`` under ``torch.autocast`` (mixed
precision, as training runs it) or, with ``cast=True``, with its parameters converted. The loss is
the model's first output tensor (summed in fp32 when it is not a scalar); the backward runs when
the model has parameters that require gradients.

The search doubles the length from ``min_length`` until a failure, then bisects between the last
passing and the first failing length down to ``step``; it assumes that a length fails whenever a
shorter one does (the usual case: logits and sums grow with the sequence). At the critical length
one shadow check names the site and statistic.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from typing import Any, Callable, Optional

import torch

from .shadow import ShadowReport, shadow

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclasses.dataclass
class Probe:
    length: int
    failed: bool
    what: str  # "ok", "non-finite loss", "non-finite gradients", "tolerance: <site> <result>"
    seconds: float


@dataclasses.dataclass
class BisectResult:
    critical_length: Optional[int]  # None: no failure up to max_length
    last_passing: Optional[int]
    probes: list[Probe]
    report: Optional[ShadowReport]  # the shadow check at the critical length
    dtype: str

    @property
    def site(self) -> Optional[str]:
        first = self.report.first_failure if self.report is not None else None
        return first.site if first is not None else None

    @property
    def cause(self) -> Optional[str]:
        return self.report.cause if self.report is not None else None

    def format(self) -> str:
        if self.critical_length is None:
            return (f"no failure in {self.dtype} up to length {self.probes[-1].length if self.probes else '-'} "
                    f"({len(self.probes)} probes)")
        failing = next(p for p in self.probes if p.length == self.critical_length)
        lines = [f"critical length in {self.dtype}: {self.critical_length} ({failing.what}); "
                 f"last passing length: {self.last_passing if self.last_passing is not None else 'none tried'}"]
        if self.report is not None:
            first = self.report.first_failure
            if first is None:
                lines.append("the shadow check finds every attention site within tolerance there: the failure "
                             "starts outside attention")
            else:
                lines.append(f"first failing site: {first.site} ({first.result}); why: {self.cause}")
        return "\n".join(lines)

    __str__ = format


def _device_of(model: torch.nn.Module) -> torch.device:
    for tensor in [*model.parameters(), *model.buffers()]:
        return tensor.device
    return torch.device("cpu")


def _call(model, inputs):
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def _first_tensor(output) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) or hasattr(output, "values"):
        output = list(output.values())
    for item in output:
        if isinstance(item, torch.Tensor):
            return item
    raise TypeError("bisect_length: the model returned no tensor to take a loss from.")


def run_step(model, inputs, dtype: torch.dtype, cast: bool, backward: bool) -> str:
    """One forward (and backward) in ``dtype``; "ok" or what went non-finite."""
    device = _device_of(model)
    if cast:
        model.to(dtype)
        context = contextlib.nullcontext()
    else:
        context = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    model.zero_grad(set_to_none=True)
    with context:
        out = _first_tensor(_call(model, inputs))
        loss = out.float() if out.numel() == 1 else out.float().sum()
    if not torch.isfinite(loss).all():
        return "non-finite loss"
    params = [p for p in model.parameters() if p.requires_grad]
    if backward and params and loss.requires_grad:
        loss.backward()
        if any(p.grad is not None and not torch.isfinite(p.grad).all() for p in params):
            return "non-finite gradients"
    return "ok"


def bisect_length(factory: Callable[[int], Any], dtype: str = "fp16", *, min_length: int = 16,
                  max_length: int = 65536, step: int = 1, criterion: str = "nonfinite", cast: bool = False,
                  backward: bool = True, progress: Optional[Callable[[str], None]] = None) -> BisectResult:
    """Find the critical length (module docstring).

    Args:
        factory: ``factory(length) -> (model, inputs)``.
        dtype: "fp16", "bf16" or "fp32".
        min_length, max_length: the range searched.
        step: the resolution of the bisection (lengths are multiples of ``step`` above ``min_length``).
        criterion: "nonfinite" (eager runs; cheap) or "tolerance" (a shadow check at every length,
            which also fails on finite results outside the tolerance).
        cast: convert the model to ``dtype`` instead of running it under autocast.
        backward: also run the backward.
        progress: called with one line per probed length (the CLI prints them).
    """
    if dtype not in DTYPES:
        raise ValueError(f"bisect_length: dtype must be one of {sorted(DTYPES)}, got {dtype!r}.")
    if criterion not in ("nonfinite", "tolerance"):
        raise ValueError(f"bisect_length: criterion must be 'nonfinite' or 'tolerance', got {criterion!r}.")
    if not 1 <= min_length <= max_length or step < 1:
        raise ValueError(f"bisect_length: need 1 <= min_length <= max_length and step >= 1, got "
                         f"{min_length}, {max_length}, {step}.")
    torch_dtype = DTYPES[dtype]
    probes: list[Probe] = []
    tested: dict[int, Probe] = {}

    def test(length: int) -> bool:
        if length in tested:
            return tested[length].failed
        start = time.perf_counter()
        model, inputs = factory(length)
        if criterion == "tolerance":
            with shadow(model) as check:
                what = run_step(model, inputs, torch_dtype, cast, backward)
            first = check.report().first_failure
            if what == "ok" and first is not None:
                what = f"tolerance: {first.site} {first.result}"
        else:
            what = run_step(model, inputs, torch_dtype, cast, backward)
        probe = Probe(length, what != "ok", what, time.perf_counter() - start)
        probes.append(probe)
        tested[length] = probe
        if progress is not None:
            progress(f"length {length:>7d}: {'FAIL' if probe.failed else 'ok  '} {'' if what == 'ok' else what} "
                     f"({probe.seconds:.1f} s)")
        return probe.failed

    passing, failing = None, None
    length = min_length
    while True:
        if test(length):
            failing = length
            break
        passing = length
        if length >= max_length:
            break
        length = min(2 * length, max_length)
    if failing is not None and passing is not None:
        while failing - passing > step:
            middle = passing + max(step, ((failing - passing) // 2) // step * step)
            if middle >= failing:
                break
            if test(middle):
                failing = middle
            else:
                passing = middle
    report = None
    if failing is not None:
        model, inputs = factory(failing)
        with shadow(model) as check:
            run_step(model, inputs, torch_dtype, cast, backward)
        report = check.report()
    return BisectResult(failing, passing, probes, report, dtype)


def print_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
