"""The split-KV decode forward (``kernels/attn_decode.py``): which calls take it, its grid, its split.

A forward with at most ``DECODE_MAX_QUERY_ROWS`` query rows and at least ``DECODE_MIN_KEYS`` keys
(a generation step against a KV cache) runs one program per (batch, KV head, block of packed
rows, key split) and a merge of the splits by their LSE. ``decode_forward_or_none`` is what the
op calls: the decode result, or None (with the reason logged) for the normal forward to run.
A sliding window (``window=``, ``launch/band.py``) narrows the keys the splits share to the band's
(a Mistral-style decode step reads its window, not the cache). Everything it leaves out goes to the
normal forward: dropout, the `fp8` schedule, longer query blocks, short key sequences, empty problems.

Returns what ``launch.attention_forward`` returns: out (B, Hq, L, Ev) in the input dtype, lse
(B, Hq, L) fp32 in natural log (-inf on rows with no visible key), so the normal backward runs
from them unchanged.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from ..schedules import get_schedule
from ..tuning.buckets import length_hint, mask_kind
from ..tuning.configs import decode_program_slots, decode_split_count, select_decode_config
from ..tuning.kernel_config import KernelConfig, padded_head_dim
from . import common
from .band import band_lower, causal_side
from .common import LOG2E, cdiv, common_meta, forward_outputs
from .visibility import NO_MASKING, Visibility

log = logging.getLogger("flash_inductor")

# Up to 16 query rows (speculative decoding's draft tokens, a short prefill chunk) count as decode.
DECODE_MAX_QUERY_ROWS = 16
# Below this many keys one query tile's program per head finishes quickly anyway and the normal
# forward's single launch wins over two launches; the benchmark (benchmarks/decode.py) measures it.
DECODE_MIN_KEYS = 512

# Reasons that say only that a call is not a decode step: every training forward has one of them,
# so they are not logged.
NOT_DECODE_SHAPE = "more query rows than a decode step"
TOO_FEW_KEYS = "too few keys for a split-KV decode"
QUIET_REASONS = (NOT_DECODE_SHAPE, TOO_FEW_KEYS)


def decode_unsupported_reason(query: torch.Tensor, key: torch.Tensor, attn_mask: Optional[torch.Tensor],
                              dropout_p: float, schedule: str, window=None) -> Optional[str]:
    """None when the decode forward takes this call, else why not. Reads shapes only (hints of
    symbolic lengths: the decode kernel is right at any length, so no guard is needed)."""
    seq_q, seq_k = length_hint(query.shape[2]), length_hint(key.shape[2])
    if seq_q > DECODE_MAX_QUERY_ROWS:
        return NOT_DECODE_SHAPE
    if seq_k < DECODE_MIN_KEYS:
        return TOO_FEW_KEYS
    if seq_q == 0 or length_hint(query.shape[0]) == 0 or length_hint(query.shape[1]) == 0:
        return "an empty problem"
    if dropout_p > 0.0:
        return "dropout (the decode kernel has none)"
    if get_schedule(schedule).fp8_forward:
        return "the fp8 schedule (its own forward kernel)"
    if attn_mask is not None and attn_mask.dtype != torch.bool and attn_mask.dtype not in common.KERNEL_DTYPES:
        return f"a {attn_mask.dtype} mask"
    return None


def log_normal_forward(reason: str) -> None:
    """Say at DEBUG why a forward runs the normal kernel rather than the decode one (shape reasons,
    which every training call has, are not logged)."""
    if reason not in QUIET_REASONS:
        log.debug("flash_inductor: forward on the normal kernel, not the split-KV decode one: %s", reason)


def decode_forward_or_none(query, key, value, attn_mask, dropout_p: float, scale: float, schedule: str, *,
                           visibility: Visibility = NO_MASKING) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """The decode forward's (out, lse) where it applies; None (reason logged) where it does not."""
    reason = decode_unsupported_reason(query, key, attn_mask, dropout_p, schedule, visibility.window)
    if reason is not None:
        log_normal_forward(reason)
        return None
    return decode_attention_forward(query, key, value, attn_mask, scale, schedule, visibility=visibility)


def rows_per_program(group_rows: int, config: KernelConfig) -> int:
    """BLOCK_M: the packed rows (GROUP x L) padded to a power of two, at least 16 (tl.dot's
    minimum) and at most the config's cap."""
    return min(padded_head_dim(max(group_rows, 1)), max(config.block_m, 16))


def active_keys(band, seq_q, seq_k, block_n: int):
    """[start, end): the keys some query row of the band can see, the start a whole key block.
    Keys before row 0's lower side or past row L - 1's upper side are read by no row, so the
    splits share only the rest: a decode step with a sliding window reads its window."""
    start = 0
    if band.lower is not None:
        start = torch.sym_max(band.lower, 0) // block_n * block_n
    end = seq_k
    if band.upper is not None:
        end = torch.sym_min(seq_k, torch.sym_max(seq_q + band.upper, 0))
    return start, end


def decode_attention_forward(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Optional[torch.Tensor],
    scale: float, schedule: str, *, visibility: Visibility = NO_MASKING,
    config: Optional[KernelConfig] = None, num_splits: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the split and merge kernels. ``visibility``: the causal side and the sliding window
    (``launch.visibility``; the decode kernels take no block-sparse layout). ``config`` and
    ``num_splits`` force the launch config and the split count (the autotuner, tests); None looks
    them up."""
    from ..kernels.attn_decode import _attn_decode_merge, _attn_decode_split

    if visibility.block_map is not None:
        raise ValueError("decode_attention_forward: the split-KV decode kernels take no block-sparse layout "
                         "(visibility.block_map); run launch.attention_forward for a block-sparse call.")
    batch, heads_q, seq_q, _ = query.shape
    heads_kv, seq_k = key.shape[1], key.shape[2]
    group = heads_q // heads_kv
    out, lse = forward_outputs(query, value)
    # The kernels see the band (launch/band.py): its upper side as the causal arguments, its lower
    # side (a window's left bound) as WINDOW_LEFT and window_lower.
    band = visibility.band(seq_q, seq_k)
    is_causal, causal_offset = causal_side(band)
    switches, mask_arg, mask_strides, meta = common_meta(query, key, value, attn_mask, 0.0, is_causal, schedule)
    meta.pop("HAS_DROPOUT")
    interpreted = common.interpreter_enabled()
    if config is None:
        config = select_decode_config(query, meta["HEAD_DIM"], meta["HEAD_DIM_V"], interpreted, seq_k=seq_k,
                                      mask_kind=mask_kind(attn_mask, is_causal), schedule=get_schedule(schedule).name)
    block_m = rows_per_program(length_hint(group * seq_q), config)
    row_blocks = cdiv(group * seq_q, block_m)
    key_start, key_end = active_keys(band, seq_q, seq_k, config.block_n)
    active = torch.sym_max(key_end - key_start, 0)
    if num_splits is None:
        programs = length_hint(batch * heads_kv * row_blocks)
        num_splits = decode_split_count(decode_program_slots(query.device, interpreted), programs,
                                        length_hint(active))
    # Keys per split, a whole number of key blocks: computed from the (possibly symbolic) lengths
    # themselves, so the splits cover every visible key whatever length the hints stood for.
    split_keys = cdiv(cdiv(active, num_splits), config.block_n) * config.block_n

    head_dim_v = meta["HEAD_DIM_V"]
    single = num_splits == 1
    if single:  # the split kernel writes the result itself; nothing to merge
        # The unused partial pointers get ``query``, as an absent mask does: passing ``out`` twice
        # would alias two arguments of one kernel, which Inductor's analysis of a user kernel's
        # mutated arguments need not expect.
        o_part = lse_part = query
    else:
        o_part = torch.empty((batch, heads_q, seq_q, num_splits, head_dim_v), dtype=torch.float32,
                             device=query.device)
        lse_part = torch.empty((batch, heads_q, seq_q, num_splits), dtype=torch.float32, device=query.device)
    common.launcher(_attn_decode_split)[(num_splits, batch * heads_kv, row_blocks)](
        query, key, value, mask_arg, o_part, lse_part, out, lse,
        *query.stride(), *key.stride(), *value.stride(), *mask_strides, *out.stride(),
        heads_kv, group, seq_q, seq_k, num_splits, key_start, split_keys, causal_offset, band_lower(band),
        scale * LOG2E,
        WINDOW_LEFT=band.lower is not None, P_IN_FP32=switches["P_IN_FP32"], SINGLE_SPLIT=single,
        BLOCK_M=block_m, BLOCK_N=config.block_n,
        num_warps=config.num_warps, num_stages=config.num_stages,
        **meta,
    )
    if not single:
        common.launcher(_attn_decode_merge)[(batch * heads_q * seq_q,)](
            o_part, lse_part, out, lse, *out.stride(), heads_q, seq_q, num_splits,
            HEAD_DIM_V=head_dim_v, BLOCK_EV=meta["BLOCK_EV"], BLOCK_SPLITS=1 << (num_splits - 1).bit_length(),
            num_warps=4 if meta["BLOCK_EV"] >= 128 else 2,
        )
    return out, lse
