"""What a debug session records per attention call: the site's ranges, forward and backward.

One :class:`CallRecord` per call of a site. The forward fields are computed from the site's own
q, k (in SDPA layout, as its prologue lays them out), mask and output; the LSE-derived fields are
``flash_inductor.monitor()``'s (``monitoring.stats.forward_stats``), fed with the fp32 log-sum-exp
of the site's scores, so a hand-written site reports the same numbers our op would. The backward
fields come from hooks on the site's q, k, v (the gradients as the model computed them).

Events are numbered in the order they happen (forwards, then the backward in its own order), so
reports can say what went wrong first.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from ..monitoring.stats import INDEX as _MONITOR_INDEX
from ..monitoring.stats import forward_stats
from .sites import SiteInfo, scores

# The statistics a record carries, in report order; "range" ones are compared against a
# baseline's [min, max], "count" ones against its largest value.
RANGE_STATS = ("qk_absmax", "logit_max", "logit_min", "lse_min", "lse_max", "out_absmax", "dq_absmax",
               "dk_absmax", "dv_absmax")
COUNT_STATS = ("masked_rows", "input_nonfinite", "out_nonfinite", "dq_nonfinite", "dk_nonfinite", "dv_nonfinite")
STATS = RANGE_STATS + COUNT_STATS
BACKWARD_STATS = ("dq_absmax", "dk_absmax", "dv_absmax", "dq_nonfinite", "dk_nonfinite", "dv_nonfinite")

DESCRIPTION = {
    "qk_absmax": "max |q·kᵀ| (before the scale)",
    "logit_max": "largest logit",
    "logit_min": "smallest visible logit",
    "lse_min": "smallest LSE",
    "lse_max": "largest LSE",
    "out_absmax": "max |out|",
    "dq_absmax": "max |dq|", "dk_absmax": "max |dk|", "dv_absmax": "max |dv|",
    "masked_rows": "fully-masked rows",
    "input_nonfinite": "non-finite q/k/v entries",
    "out_nonfinite": "non-finite out entries",
    "dq_nonfinite": "non-finite dq entries", "dk_nonfinite": "non-finite dk entries",
    "dv_nonfinite": "non-finite dv entries",
}


@dataclasses.dataclass
class CallRecord:
    site: str
    call: int  # the session's call number of this forward
    event: int  # when the forward happened
    dtype: str
    stats: dict = dataclasses.field(default_factory=dict)
    backward_event: Optional[int] = None


def _absmax(t: Optional[torch.Tensor]) -> float:
    if t is None or t.numel() == 0:
        return 0.0
    finite = t.detach()[t.detach().isfinite()]
    return finite.abs().max().item() if finite.numel() else math.nan


def _nonfinite(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else int((~t.detach().isfinite()).sum())


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
            torch.float64: "fp64"}.get(dtype, str(dtype).replace("torch.", ""))


def dtype_max(name: str) -> float:
    return torch.finfo({"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32,
                        "fp64": torch.float64}.get(name, torch.float32)).max


@torch.no_grad()
def forward_record(info: SiteInfo, out, inputs, q1, k1, mask) -> dict:
    """The forward statistics of one call (host floats; the debug tools synchronise freely)."""
    q, k, v = inputs
    with torch.autocast(q1.device.type, enabled=False):
        scale = info.scale if info.scale is not None else 1.0 / math.sqrt(q1.shape[-1])
        raw = q1.float() @ _repeat(q1, k1).float().transpose(-2, -1)
        s = scores(q1, k1, mask, scale, info.is_causal, info.causal_offset, torch.float32, info.window, info.softcap)
        lse = torch.logsumexp(s, dim=-1)
        visible = s[s.isfinite()]
        monitor = forward_stats(out, lse, k1.shape[-2]).tolist()
    return dict(
        qk_absmax=_absmax(raw),
        logit_max=visible.max().item() if visible.numel() else math.nan,
        logit_min=visible.min().item() if visible.numel() else math.nan,
        lse_min=monitor[_MONITOR_INDEX["lse_min"]],
        lse_max=monitor[_MONITOR_INDEX["lse_max"]],
        out_absmax=_absmax(out),
        masked_rows=int(monitor[_MONITOR_INDEX["masked_rows"]]),
        input_nonfinite=sum(_nonfinite(t) for t in (q, k, v)),
        out_nonfinite=int(monitor[_MONITOR_INDEX["out_nonfinite"]]),
    )


def _repeat(query, key):
    if key.dim() >= 3 and key.shape[-3] != query.shape[-3]:
        return key.repeat_interleave(query.shape[-3] // key.shape[-3], dim=-3)
    return key


class DebugSession:
    """Base of the debug tools' sessions: site registry, call records and gradient hooks."""

    def __init__(self):
        self.sites: list[SiteInfo] = []
        self.kept: list[tuple[Optional[str], str, str]] = []
        self.records: list[CallRecord] = []
        self._event = 0
        self._names: dict[str, int] = {}

    # -- registration (at compile time) ------------------------------------------------------

    def register_site(self, info: SiteInfo) -> int:
        base = info.module or "<model>"
        seen = self._names.get(base, 0)
        self._names[base] = seen + 1
        info.name = base if seen == 0 else f"{base}#{seen}"
        self.sites.append(info)
        return len(self.sites) - 1

    def on_kept(self, module: Optional[str], pattern: str, reason: str) -> None:
        entry = (module, pattern, reason)
        if entry not in self.kept:
            self.kept.append(entry)

    # -- recording (at run time) -------------------------------------------------------------

    def next_event(self) -> int:
        self._event += 1
        return self._event

    def on_forward(self, index, out, inputs, q1, k1, mask, ref, base, leaves64, leaves_same) -> CallRecord:
        info = self.sites[index]
        record = CallRecord(info.name, len(self.records), self.next_event(), dtype_name(q1.dtype))
        record.stats.update(forward_record(info, out, inputs, q1, k1, mask))
        self.records.append(record)
        self._watch_gradients(record, inputs)
        return record

    def _watch_gradients(self, record: CallRecord, inputs) -> None:
        if not torch.is_grad_enabled():
            return
        for name, t in zip(("dq", "dk", "dv"), inputs):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._gradient_hook(record, name))

    def _gradient_hook(self, record: CallRecord, name: str):
        def hook(grad):
            if record.backward_event is None:
                record.backward_event = self.next_event()
            record.stats[f"{name}_absmax"] = _absmax(grad)
            record.stats[f"{name}_nonfinite"] = _nonfinite(grad)
            self.on_gradient(record, name, grad)
        return hook

    def on_gradient(self, record: CallRecord, name: str, grad: torch.Tensor) -> None:
        """Subclasses compare the gradient; the base only records its range."""
