"""What one monitored attention call records, computed on the device from tensors that already exist.

Every record is one row of :data:`FIELDS` (float64), so a whole session stacks into one
``(calls, len(FIELDS))`` tensor and reaches the host in a single copy at ``summary()`` time:
recording never synchronises with the GPU.

The largest logit comes from the log-sum-exp the forward already wrote, with no second pass
over the scores. For a row with visible scores ``s_1..s_n`` (``n <= S`` keys),

    max_j s_j <= LSE = max_j s_j + log(sum_j exp(s_j - max_j s_j)) <= max_j s_j + log(n),

so ``max_j s_j`` lies in ``[LSE - log S, LSE]``; over a call, the largest logit lies in
``[max LSE - log S, max LSE]``. The bound is tight for a peaked row and loose by ``log S``
for a flat one.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

FIELDS = (
    "rows",            # query rows in the call (B * H * L)
    "masked_rows",     # rows with no visible key (LSE -inf) or only keys at the mask clamp
    "lse_nonfinite",   # rows whose LSE is NaN or +inf: the forward itself broke
    "lse_min",         # over live rows (neither masked nor non-finite)
    "lse_max",
    "max_logit_low",   # lse_max - log S: lower bound of the call's largest logit
    "out_nonfinite",   # NaN / inf entries of the attention output
    "dq_nonfinite",    # backward only: NaN / inf entries of the gradients
    "dk_nonfinite",
    "dv_nonfinite",
)
INDEX = {name: i for i, name in enumerate(FIELDS)}

# A row whose every visible key sits at the -1e38 float-mask clamp (finfo(fp32/bf16).min masks)
# gets an LSE near -1e38 rather than -inf; ordinary rows are far above this (ops/reference.py
# uses the same threshold to recognise such rows in the backward).
LSE_MASKED_BELOW = -1e37


def _nonfinite(t: Optional[Tensor]) -> Tensor:
    if t is None:
        return torch.zeros((), dtype=torch.float64)
    return (~torch.isfinite(t)).sum().to(torch.float64)


def forward_stats(out: Tensor, lse: Tensor, seq_k: int) -> Tensor:
    """One record for the forward of a call: ``(len(FIELDS),)`` float64 on ``lse``'s device."""
    lse = lse.detach()
    out = out.detach()
    row = torch.full((len(FIELDS),), float("nan"), dtype=torch.float64, device=lse.device)
    row[INDEX["rows"]] = lse.numel()
    if lse.numel() == 0:
        row[INDEX["masked_rows"]] = row[INDEX["lse_nonfinite"]] = 0
        row[INDEX["out_nonfinite"]] = _nonfinite(out)
        return row
    lse64 = lse.to(torch.float64)
    masked = lse64.isneginf() | (lse64.isfinite() & (lse64 <= LSE_MASKED_BELOW))
    broken = lse64.isnan() | lse64.isposinf()
    live = ~(masked | broken)
    lse_max = torch.where(live, lse64, float("-inf")).amax()
    lse_min = torch.where(live, lse64, float("inf")).amin()
    # Calls where no row is live report NaN for the LSE range (amax/amin of all -inf / +inf).
    lse_max = torch.where(live.any(), lse_max, float("nan"))
    lse_min = torch.where(live.any(), lse_min, float("nan"))
    values = torch.stack([
        masked.sum().to(torch.float64),
        broken.sum().to(torch.float64),
        lse_min,
        lse_max,
        lse_max - math.log(max(int(seq_k), 1)),
        _nonfinite(out).to(lse.device),
    ])
    row[1:7] = values
    return row


def backward_stats(dq: Optional[Tensor], dk: Optional[Tensor], dv: Optional[Tensor]) -> Tensor:
    """One record for the backward of a call: only the gradient fields are set."""
    device = next((t.device for t in (dq, dk, dv) if t is not None), torch.device("cpu"))
    row = torch.full((len(FIELDS),), float("nan"), dtype=torch.float64, device=device)
    row[INDEX["dq_nonfinite"]:] = torch.stack([_nonfinite(t).to(device) for t in (dq, dk, dv)])
    return row
