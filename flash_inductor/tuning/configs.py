"""Launch configurations (block sizes, warps, pipeline stages) for the attention kernels.

A launch reads its GPU model's tuning table (``tuning/cache.py``, written by
``python -m flash_inductor.autotune``) at its bucket (``tuning/buckets.py``: schedule, dtype,
padded head width, mask kind, sequence-length bucket, pass); where the table has no entry, a
heuristic on the head dimension and the device decides. Configs change speed, never results,
so a symbolic sequence length under ``torch.compile(dynamic=True)`` is bucketed by its hint
without a guard: the compiled graph does not specialise on it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Optional

import torch

from ..schedules import DEFAULT_SCHEDULE, SCHEDULES
from . import cache
from .buckets import bucket_for, length_hint
from .footprint import OPTIN_SMEM_BYTES, DeviceLimits, TileBytes, fits
from .hopper_configs import (HopperBackwardConfig, HopperForwardConfig, config_from_dict, default_backward_config,
                             default_forward_config, width_supported)
from .kernel_config import AttentionConfigs, KernelConfig, padded_head_dim


_log = logging.getLogger("flash_inductor")

# The Triton interpreter runs tiles through NumPy: small tiles keep CPU tests fast while still
# exercising multi-block loops, ragged tails and the diagonal split.
_INTERPRETER_CONFIGS = AttentionConfigs(
    forward=KernelConfig(16, 16, 1, 1),
    backward_dkdv=KernelConfig(16, 16, 1, 1),
    backward_dq=KernelConfig(16, 16, 1, 1),
    decode=KernelConfig(16, 16, 1, 1),
)
# The interpreter has no SMs; a small count makes the split heuristic cut short key sequences into
# several splits, so CPU tests exercise the merge.
_INTERPRETER_SM_COUNT = 4


@functools.lru_cache(maxsize=None)
def cuda_heuristic_configs(capability: tuple[int, int], itemsize: int, head_dim: int,
                           head_dim_v: int, schedule: Optional[str] = None, mask_kind: str = "none") -> AttentionConfigs:
    width = max(padded_head_dim(head_dim), padded_head_dim(head_dim_v))
    wide = itemsize >= 4  # fp32 tiles take twice the shared memory and registers
    hopper_fp32 = wide and capability >= (9, 0)
    if hopper_fp32:
        fwd, dkdv, dq, decode = _HOPPER_FP32_TILES[max(64, width)]
    elif width <= 64 and not wide:
        fwd = KernelConfig(128, 64, 4, 3)
        dkdv = KernelConfig(64, 128, 8, 2)
        dq = KernelConfig(128, 64, 8, 2)
    elif width <= 128 and not wide:
        fwd = KernelConfig(128, 64, 8, 3) if capability >= (8, 0) else KernelConfig(64, 64, 4, 2)
        dkdv = KernelConfig(32, 128, 8, 2)
        dq = KernelConfig(64, 64, 4, 2)
    elif width <= 128:
        fwd = KernelConfig(64, 32, 4, 2)
        dkdv = KernelConfig(32, 64, 4, 1)
        dq = KernelConfig(64, 32, 4, 1)
    else:
        # Head dims up to 256: smaller tiles keep Q/K/V tiles and the accumulators on-chip.
        fwd = KernelConfig(64, 32, 4, 2) if not wide else KernelConfig(32, 32, 4, 1)
        dkdv = KernelConfig(32, 32, 4, 1) if not wide else KernelConfig(16, 32, 4, 1)
        dq = KernelConfig(32, 32, 4, 1) if not wide else KernelConfig(16, 32, 4, 1)
        if not wide and capability >= (9, 0):
            dkdv, dq = _wide_head_hopper_backward(itemsize, width, schedule, mask_kind, dkdv, dq)
    p_in_fp32 = SCHEDULES[schedule or DEFAULT_SCHEDULE].p_in_fp32
    if p_in_fp32 and mask_kind in ("bool", "float") and fwd.num_stages > 2:
        # A schedule that keeps P in fp32 stages P and V's fp32 split for its P·V; a pipelined mask
        # tile on top of that (fp32 float masks: 32 KiB a stage at 128x64) took 240 KiB of shared
        # memory at three stages on an H200, past its 227 KiB. Two stages fit.
        fwd = dataclasses.replace(fwd, num_stages=2)
    return AttentionConfigs(fwd, dkdv, dq, decode=decode if hopper_fp32 else _decode_heuristic(wide, width))


def _decode_heuristic(wide: bool, width: int) -> KernelConfig:
    """The split-KV decode kernel streams K/V once and is bound by memory: a K/V tile of 64 keys
    in three stages keeps the loads in flight; block_m caps the packed rows (GROUP x L) at 64, so
    up to 8 heads x 8 rows share one K/V read (a 16-row decode at GROUP 8 takes two row blocks)."""
    if not wide:
        return KernelConfig(64, 64, 4, 3) if width <= 128 else KernelConfig(64, 32, 4, 2)
    return KernelConfig(32, 32, 4, 2) if width <= 128 else KernelConfig(16, 32, 4, 1)


# fp32 tiles on Hopper (fp32's IEEE products run on the CUDA cores), by padded width: (forward,
# dK/dV, dQ, decode). The tiles other GPUs keep compiled for sm_90 to loops that spill: at E 128
# (64x32/w4/s2, 32x64/w4/s1, 64x32/w4/s1) to 32 registers and 6-19 KB of stack a thread, 1.8 local
# loads and stores per FFMA and ptxas 30-41 s on the dK/dV pass; at E 256 up to 2 local accesses
# per FFMA (the forward with dropout, the decode split). These keep every loop free of local
# memory, or nearly (at most 73 accesses against 1540 FFMA an iteration), at 1.2-2.0 instructions
# per FMA, and each compiles in 7.1 s at most (tools/compile_survey.py;
# benchmarks/results/compile_survey_cpu_20261204.json). Not yet timed on a GPU:
# benchmarks/experiments/fp32_tiles.py at commit f7e9ac3 does that in one device call.
_HOPPER_FP32_TILES = {
    64: (KernelConfig(64, 32, 8, 2), KernelConfig(32, 64, 8, 1), KernelConfig(64, 32, 8, 1),
         KernelConfig(32, 32, 4, 2)),
    128: (KernelConfig(32, 64, 8, 2), KernelConfig(16, 32, 8, 1), KernelConfig(32, 32, 8, 1),
          KernelConfig(32, 32, 8, 2)),
    256: (KernelConfig(16, 32, 8, 2), KernelConfig(16, 32, 8, 1), KernelConfig(16, 32, 8, 1),
          KernelConfig(16, 32, 8, 2)),
}

# Backward tiles for 16-bit head widths 129-256 on Hopper, measured on an H200 (bf16, B=4, H=8,
# L=S=4096, E=256; benchmarks/results/backward_breakdown_nvidia-h200_20261201_e256.json) against
# 32x32/w4/s1 for both passes: dK/dV 64x32/w4/s2 1.73x faster; dQ 64x64/w8/s2 2.07x with exact Δ
# (its P·K accumulator doubles the registers per query row) and 128x32/w8/s2 2.9x without.
# Measured only for schedules that round P and dS to 16 bits; the tf32x3 ones keep the small tiles.
_HOPPER_WIDE_DKDV = KernelConfig(64, 32, 4, 2)
_HOPPER_WIDE_DQ = {True: KernelConfig(64, 64, 8, 2), False: KernelConfig(128, 32, 8, 2)}  # by exact Δ


def _wide_head_hopper_backward(itemsize: int, width: int, schedule: Optional[str], mask_kind: str,
                               dkdv: KernelConfig, dq: KernelConfig) -> tuple[KernelConfig, KernelConfig]:
    """The measured wide-head tiles where the schedule rounds P and dS to 16 bits and each tile fits
    Hopper's shared memory with the call's mask tile (a float mask counted at 4 bytes, the widest it
    can be); the given small tiles otherwise."""
    sched = SCHEDULES[schedule or DEFAULT_SCHEDULE]
    if sched.p_in_fp32 or sched.ds_in_fp32:
        return dkdv, dq
    mask_bytes = {"bool": 1, "float": 4}.get(mask_kind, 0)
    tiles = TileBytes(width, itemsize, itemsize, itemsize, mask_bytes, exact_delta=sched.exact_delta)
    limits = DeviceLimits(smem_bytes=OPTIN_SMEM_BYTES[(9, 0)])
    wide_dq = _HOPPER_WIDE_DQ[sched.exact_delta]
    return (_HOPPER_WIDE_DKDV if fits("backward_dkdv", _HOPPER_WIDE_DKDV, tiles, limits) else dkdv,
            wide_dq if fits("backward_dq", wide_dq, tiles, limits) else dq)


def heuristic_configs(query: torch.Tensor, head_dim: int, head_dim_v: int, interpreted: bool,
                      schedule: Optional[str] = None, mask_kind: str = "none") -> AttentionConfigs:
    """The built-in configs: what runs where no tuning table has an entry. A tensor that is not
    on a GPU can only reach a kernel through the interpreter, so it gets the interpreter's tiles."""
    return _heuristic_for(query.device, query.dtype, head_dim, head_dim_v, interpreted, schedule, mask_kind)


def _heuristic_for(device: torch.device, dtype: torch.dtype, head_dim: int, head_dim_v: int, interpreted: bool,
                   schedule: Optional[str], mask_kind: str) -> AttentionConfigs:
    if interpreted or device.type != "cuda":
        return _INTERPRETER_CONFIGS
    capability = torch.cuda.get_device_capability(device)
    return cuda_heuristic_configs(capability, dtype.itemsize, head_dim, head_dim_v, schedule, mask_kind)


def select_configs(
    query: torch.Tensor,
    head_dim: int,
    head_dim_v: int,
    interpreted: bool,
    *,
    seq_q=None,
    seq_k=None,
    mask_kind: str = "none",
    schedule: Optional[str] = None,
) -> AttentionConfigs:
    """The configs a launch uses: its tuned table entry where there is one, else the heuristic.

    ``seq_q``/``seq_k`` may be SymInts; they are bucketed by their hint, never guarded on
    (default: the query's own lengths). Forward and backward entries are looked up separately,
    so a table holding only one of them still improves that one.

    Every eager call asks this, twice per training step, so with plain-integer lengths the answer
    is memoised per problem and table view: on the H200's host the lookup (device capability,
    bucket, three table reads) was about a fifth of an eager forward's host time. A new table
    (``cache.clear_cache``, ``cache.override_table``) is a new view, so a new key.

    The tables never fail a launch: an error in finding or reading them gives one warning and
    the heuristic configs.
    """
    try:
        table = cache.active_table(query.device, interpreted)
    except Exception as error:
        cache.warn_lookup_failed(error)
        table = None
    seq_q = query.shape[-2] if seq_q is None else seq_q
    seq_k = seq_q if seq_k is None else seq_k
    args = (table, query.device, query.dtype, head_dim, head_dim_v, interpreted, seq_q, seq_k, mask_kind, schedule)
    if type(seq_q) is int and type(seq_k) is int:
        return _select_memoised(*args)
    return _select(*args)


def _select(table: Optional[cache.TableView], device: torch.device, dtype: torch.dtype, head_dim: int,
            head_dim_v: int, interpreted: bool, seq_q, seq_k, mask_kind: str,
            schedule: Optional[str]) -> AttentionConfigs:
    heuristic = _heuristic_for(device, dtype, head_dim, head_dim_v, interpreted, schedule, mask_kind)
    if table is None:
        return heuristic
    width = max(padded_head_dim(head_dim), padded_head_dim(head_dim_v))
    bucket = bucket_for(schedule or DEFAULT_SCHEDULE, dtype, width, mask_kind, seq_q, seq_k, "forward")
    if bucket is None:
        return heuristic
    try:
        forward = table.lookup(bucket)
        backward = table.lookup(bucket.replace(pass_name="backward"))
        return AttentionConfigs(
            forward=KernelConfig.from_dict(forward["forward"]) if forward else heuristic.forward,
            backward_dkdv=KernelConfig.from_dict(backward["backward_dkdv"]) if backward else heuristic.backward_dkdv,
            backward_dq=KernelConfig.from_dict(backward["backward_dq"]) if backward else heuristic.backward_dq,
        )
    except Exception as error:  # a table must never fail an attention call
        cache.warn_lookup_failed(error)
        return heuristic


# Bounded: a process that sees many distinct lengths (a dynamic-shape eager loop) evicts old ones.
_select_memoised = functools.lru_cache(maxsize=4096)(_select)


# ------------------------------------------------------------------------------------------
# The Gluon Hopper kernels (launch/hopper.py, launch/hopper_bwd.py; configs: hopper_configs.py)
# ------------------------------------------------------------------------------------------


def select_hopper_forward_config(query: torch.Tensor, seq_k, *, is_causal: bool, key_mask: bool,
                                 exact_delta: bool, schedule: Optional[str]) -> tuple[HopperForwardConfig, bool]:
    """(config, whether the table chose it) for a Gluon forward: the tuned entry of its bucket
    (pass ``gluon_forward``, or ``gluon_forward_exact`` for `stable`'s one-pass training
    forward), else ``default_forward_config``. Never fails: a table error gives one warning and
    the built-in config."""
    role = "gluon_forward_exact" if exact_delta else "gluon_forward"
    default = default_forward_config(query.shape[-1], is_causal, key_mask=key_mask, exact_delta=exact_delta)
    return _select_hopper(role, default, query, seq_k, is_causal, key_mask, schedule)


def select_hopper_backward_config(query: torch.Tensor, seq_k, *, is_causal: bool, key_mask: bool,
                                  schedule: Optional[str]) -> tuple[HopperBackwardConfig, bool]:
    """As ``select_hopper_forward_config``, for the Gluon backward (pass ``gluon_backward``)."""
    default = default_backward_config(query.shape[-1], is_causal)
    return _select_hopper("gluon_backward", default, query, seq_k, is_causal, key_mask, schedule)


def _select_hopper(role: str, default, query: torch.Tensor, seq_k, is_causal: bool, key_mask: bool,
                   schedule: Optional[str]):
    try:
        table = cache.active_table(query.device, False)
        if table is None:
            return default, False
        return _lookup_hopper(table, role, default, query.dtype, query.shape[-1], length_hint(query.shape[-2]),
                              length_hint(seq_k), _hopper_mask_kind(is_causal, key_mask),
                              schedule or DEFAULT_SCHEDULE)
    except Exception as error:  # a table must never fail an attention call
        cache.warn_lookup_failed(error)
        return default, False


def _hopper_mask_kind(is_causal: bool, key_mask: bool) -> str:
    """A key mask's launch is a bucket kind of its own whatever its causal side (at E 64 its
    built-in config differs); the autotuner tunes none (hopper_configs.bucket_supported), so it
    runs the built-in config."""
    if key_mask:
        return "bool"
    return "causal" if is_causal else "none"


# Memoised per table view and problem: an eager training step asks twice a layer.
@functools.lru_cache(maxsize=4096)
def _lookup_hopper(table: cache.TableView, role: str, default, dtype: torch.dtype, width: int, seq_q: int,
                   seq_k: int, mask: str, schedule: str):
    bucket = bucket_for(schedule, dtype, width, mask, seq_q, seq_k, role)
    entry = table.lookup(bucket) if bucket is not None else None
    if not entry or role not in entry:
        return default, False
    config = config_from_dict(role, entry[role], default)
    if not width_supported(config, width):  # a hand-edited entry: the built-in config compiles
        return default, False
    _log_tuned(role, bucket.replace(seq=0).key(), config.label(), default.label())
    return config, True


@functools.lru_cache(maxsize=256)
def _log_tuned(role: str, family: str, label: str, built_in: str) -> None:
    """Say once per bucket family and config, at INFO, that a Gluon launch runs a tuned config."""
    _log.info("flash_inductor: %s runs the tuning table's %s (built-in: %s) for %s", role, label, built_in,
              family.replace("/s0/", "/"))


# ------------------------------------------------------------------------------------------
# Split-KV decode (launch/decode.py)
# ------------------------------------------------------------------------------------------

# Keys per unit of the split search: a split shorter than this spends more on its prologue,
# epilogue and merge traffic than it saves.
DECODE_SPLIT_GRANULE = 256
DECODE_MAX_SPLITS = 128


# Memoised: an eager decode step asks it once per layer, and its loop costs tens of µs of host time.
@functools.lru_cache(maxsize=4096)
def decode_split_count(slots: int, programs: int, seq_k: int, max_splits: int = DECODE_MAX_SPLITS) -> int:
    """How many key splits a decode launch of ``programs`` (batch x KV heads x row blocks) programs
    per split uses on a GPU with room for ``slots`` programs at once: FlashAttention-2's
    ``num_splits_heuristic`` (flash_api.cpp, which also counts two programs per SM). A launch that
    already fills 80 % of the slots takes one split; otherwise the smallest count whose last wave
    is at least 85 % as full as the best count's, among counts that change the keys per split
    (units of ``DECODE_SPLIT_GRANULE`` keys), at most ``slots`` and ``max_splits``."""
    programs, slots = max(int(programs), 1), max(int(slots), 1)
    if programs >= 0.8 * slots:
        return 1
    granules = max(-(-int(seq_k) // DECODE_SPLIT_GRANULE), 1)
    limit = max(min(max_splits, slots, granules), 1)

    def eligible(n: int) -> bool:  # n splits that hold as many granules each as n - 1 do are no gain
        return n == 1 or -(-granules // n) != -(-granules // (n - 1))

    efficiency = {}
    for n in range(1, limit + 1):
        if eligible(n):
            waves = programs * n / slots
            efficiency[n] = waves / -(-waves // 1)
    best = max(efficiency.values())
    return next(n for n in sorted(efficiency) if efficiency[n] >= 0.85 * best)


# The decode kernel's heuristic tiles take 72 KiB (16 packed rows) to 112 KiB (64) of shared memory at
# E 128, 16-bit (Triton 3.6, sm_90: tools/launch_sass.py --grid), so two programs or more share an SM of
# Hopper's 227 KiB: a decode launch has room for twice the SMs.
DECODE_PROGRAMS_PER_SM = 2


def decode_program_slots(device: torch.device, interpreted: bool) -> int:
    """How many decode programs ``device`` runs at once (a small count under the interpreter)."""
    if interpreted or device.type != "cuda":
        return _INTERPRETER_SM_COUNT
    index = device.index if device.index is not None else torch.cuda.current_device()
    return DECODE_PROGRAMS_PER_SM * _cuda_sm_count(index)


def sm_count(device: torch.device) -> int:
    """The streaming multiprocessors of CUDA ``device`` (cached per device). Any other device gets
    the interpreter's small count: the compile check (tools/launch_sass.py) runs the Hopper
    launchers on CPU tensors, and a fixed count keeps what they compile the same on every machine."""
    if device.type != "cuda":
        return _INTERPRETER_SM_COUNT
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def select_decode_config(query: torch.Tensor, head_dim: int, head_dim_v: int, interpreted: bool, *, seq_k,
                         mask_kind: str = "none", schedule: Optional[str] = None) -> KernelConfig:
    """The decode kernel's config: the table's "decode" entry at S's length bucket, else the
    heuristic (as :func:`select_configs`, never failing a launch)."""
    try:
        table = cache.active_table(query.device, interpreted)
    except Exception as error:
        cache.warn_lookup_failed(error)
        table = None
    return _select_decode(table, query.device, query.dtype, head_dim, head_dim_v, interpreted,
                          length_hint(seq_k), mask_kind, schedule)


@functools.lru_cache(maxsize=4096)
def _select_decode(table: Optional[cache.TableView], device: torch.device, dtype: torch.dtype, head_dim: int,
                   head_dim_v: int, interpreted: bool, seq_k: int, mask_kind: str,
                   schedule: Optional[str]) -> KernelConfig:
    heuristic = _heuristic_for(device, dtype, head_dim, head_dim_v, interpreted, schedule, mask_kind).decode
    if table is None:
        return heuristic
    width = max(padded_head_dim(head_dim), padded_head_dim(head_dim_v))
    # The bucket is S's alone: L <= 16 never decides the length bucket.
    bucket = bucket_for(schedule or DEFAULT_SCHEDULE, dtype, width, mask_kind, 1, seq_k, "decode")
    if bucket is None:
        return heuristic
    try:
        entry = table.lookup(bucket)
        return KernelConfig.from_dict(entry["decode"]) if entry else heuristic
    except Exception as error:  # a table must never fail an attention call
        cache.warn_lookup_failed(error)
        return heuristic
