"""flash_inductor: numerically stabilised flash attention for PyTorch.

Public API:
  * :func:`flash_attention` -- SDPA's signature and semantics on the stabilised Triton op.
  * :data:`SCHEDULES` -- the precision schedules ``flash_attention(..., schedule=)`` accepts.

Importing registers the ``flash_inductor::`` torch.library ops; it changes no global config.
"""

from .api import flash_attention
from .tuning.schedules import DEFAULT_SCHEDULE, SCHEDULES, PrecisionSchedule

__version__ = "0.1.0"

__all__ = ["flash_attention", "SCHEDULES", "DEFAULT_SCHEDULE", "PrecisionSchedule", "__version__"]
