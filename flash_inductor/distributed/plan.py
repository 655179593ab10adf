"""Which attention calls one ring step makes: the local queries against one rank's keys.

Under causal attention a (query run, key run) pair of consecutive positions is one of

* hidden: every key comes after every query, no call;
* full: every key is at or before every query, a call without the causal mask;
* diagonal: a call with ``is_causal`` and ``causal_offset = q_position - k_position``, since
  key j (at k_position + j) is visible to query i (at q_position + i) iff
  ``j <= i + (q_position - k_position)``, which is the op's own rule.

Adjacent full pairs are merged into one call (zig-zag's off-diagonal steps then take one or two
calls: all queries against the first key chunk, or the second query chunk against all keys).
"""

from __future__ import annotations

import dataclasses

from .sharding import Segment, SequenceLayout


@dataclasses.dataclass(frozen=True)
class BlockCall:
    """One op call: local queries ``[q_lo, q_hi)`` against local keys ``[k_lo, k_hi)`` of the
    key/value block in hand."""

    q_lo: int
    q_hi: int
    k_lo: int
    k_hi: int
    is_causal: bool
    causal_offset: int = 0

    @property
    def q(self) -> slice:
        return slice(self.q_lo, self.q_hi)

    @property
    def k(self) -> slice:
        return slice(self.k_lo, self.k_hi)


def _pair(q: Segment, k: Segment) -> BlockCall | None:
    first_q, last_q = q.position, q.position + q.length - 1
    first_k, last_k = k.position, k.position + k.length - 1
    q_rows = (q.local_start, q.local_start + q.length)
    k_rows = (k.local_start, k.local_start + k.length)
    if first_k > last_q:
        return None
    if last_k <= first_q:
        return BlockCall(*q_rows, *k_rows, is_causal=False)
    return BlockCall(*q_rows, *k_rows, is_causal=True, causal_offset=q.position - k.position)


def _merge_keys(calls: list[BlockCall]) -> list[BlockCall]:
    merged: list[BlockCall] = []
    for call in calls:
        last = merged[-1] if merged else None
        if last is not None and not last.is_causal and not call.is_causal and last.k_hi == call.k_lo:
            merged[-1] = dataclasses.replace(last, k_hi=call.k_hi)
        else:
            merged.append(call)
    return merged


def block_calls(layout: SequenceLayout, q_rank: int, kv_rank: int, is_causal: bool) -> tuple[BlockCall, ...]:
    """The calls that fold rank ``kv_rank``'s keys into rank ``q_rank``'s queries."""
    q_len, k_len = layout.local_len(q_rank), layout.local_len(kv_rank)
    if q_len == 0 or k_len == 0:
        return ()
    if not is_causal:
        return (BlockCall(0, q_len, 0, k_len, is_causal=False),)
    rows = []
    for q in layout.segments(q_rank):
        pairs = [c for c in (_pair(q, k) for k in layout.segments(kv_rank)) if c is not None]
        rows.append(_merge_keys(pairs))
    # Query runs whose calls are all the same unmasked calls, and adjacent in the shard: one call.
    calls: list[BlockCall] = []
    previous: list[BlockCall] | None = None
    for row in rows:
        if (previous and row and all(not c.is_causal for c in row + previous)
                and [(c.k_lo, c.k_hi) for c in row] == [(c.k_lo, c.k_hi) for c in previous]
                and previous[0].q_hi == row[0].q_lo):
            widened = [dataclasses.replace(c, q_lo=p.q_lo) for p, c in zip(previous, row)]
            calls[len(calls) - len(previous):] = widened
            previous = widened
            continue
        calls.extend(row)
        previous = row
    return tuple(calls)
