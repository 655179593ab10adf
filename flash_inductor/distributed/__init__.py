"""Context parallelism: attention over a sequence sharded across a ``torch.distributed`` group.

* :func:`context_parallel_attention`: ring attention on the ``flash_inductor::`` ops, each
  rank passing its shard; exact LSE merging, differentiable, causal (zig-zag balanced) or not,
  GQA, key-padding masks, every precision schedule.
* :func:`shard_sequence` / :func:`unshard_sequence` (all-gather) / :func:`unshard_shards`:
  split a batch along the sequence in a layout and put it back in order.
* :class:`SequenceLayout`: the split itself; ``positions(rank)`` gives the position ids
  (rotary embeddings) of a rank's tokens.

See ``docs/context_parallel.md``. Importing this changes nothing and communicates nothing.
"""

from .attention import context_parallel_attention
from .ring import ring_benchmark_mode
from .sharding import LAYOUTS, SequenceLayout, shard_sequence, unshard_sequence, unshard_shards

__all__ = [
    "context_parallel_attention", "shard_sequence", "unshard_sequence", "unshard_shards", "SequenceLayout",
    "LAYOUTS", "ring_benchmark_mode",
]
