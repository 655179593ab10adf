"""flash_inductor: numerically stabilised flash attention for PyTorch.

Public API:
  * :func:`flash_attention` -- SDPA's signature and semantics on the stabilised Triton op.
  * :func:`flash_attention_varlen` -- packed sequences (``cu_seqlens``), FlashAttention's varlen interface.
  * :class:`BlockSparseLayout` -- a block-level layout for ``flash_attention(..., block_mask=)``.
  * :data:`backend` / :func:`make_backend` -- ``torch.compile(model, backend=flash_inductor.backend)``
    rewrites the model's attention onto the op; :func:`last_report` says which sites it rewrote.
  * :func:`explain` -- ``print(flash_inductor.explain(model, *inputs))``: a fresh compile's table of
    every attention site, rewritten or kept (and why), with its module path.
  * :data:`SCHEDULES` -- the precision schedules ``flash_attention(..., schedule=)`` accepts.
  * :func:`monitor` -- ``with flash_inductor.monitor() as m:`` records per-call attention statistics.

Importing registers the ``flash_inductor::`` torch.library ops; it changes no global config.
"""

from .api import flash_attention
from .varlen import flash_attention_varlen
from .block_sparse import BlockSparseLayout
from .compile_backend import backend, explain, make_backend
from .monitoring import monitor
from .passes.report import last_report
from .schedules import DEFAULT_SCHEDULE, SCHEDULES, PrecisionSchedule

__version__ = "0.1.0"

__all__ = [
    "flash_attention", "flash_attention_varlen", "BlockSparseLayout", "backend", "make_backend", "explain", "last_report", "monitor", "SCHEDULES",
    "DEFAULT_SCHEDULE", "PrecisionSchedule", "__version__",
]
