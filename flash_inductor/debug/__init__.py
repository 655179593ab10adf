"""``flash_inductor.debug``: the debug flow for a training run that goes NaN, as tools.

* :func:`shadow` -- ``with shadow(model) as check: ...``: every attention site also runs in
  float64; ``check.report()`` holds each to the tolerance rule and names the first site that breaks
  it, with the statistic that explains why.
* :func:`record_baseline` / :func:`compare_to_baseline` -- record each site's ranges over fp32
  steps (JSON), then flag every site and statistic of a low-precision run that leaves them.
* :func:`bisect_length` (and ``python -m flash_inductor.debug bisect-length MODULE:FACTORY``) --
  the shortest sequence length at which forward or backward goes non-finite (or breaks the
  tolerance), with the site and statistic there.

All work on unmodified models: the rewrite pass's finders locate the attention sites (hand-written,
SDPA, ``nn.MultiheadAttention``, our op) and the model computes exactly what it computes eagerly.
Outside a ``with`` block nothing is installed: off, the tools cost nothing.
"""

from .baseline import Baseline, BaselineComparison, compare_to_baseline, record_baseline
from .bisect import BisectResult, bisect_length
from .shadow import ShadowCheck, ShadowReport, shadow

__all__ = ["shadow", "ShadowCheck", "ShadowReport", "record_baseline", "compare_to_baseline", "Baseline",
           "BaselineComparison", "bisect_length", "BisectResult"]
