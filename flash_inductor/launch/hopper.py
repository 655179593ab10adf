"""Launcher for the Gluon Hopper forward (kernels/hopper_fwd.py): which calls it takes, its tile
config, and the TMA descriptors.

The choice is made in two steps, the first also used by ``explain()``, which sees only what a
traced graph holds (no data pointers, and under dynamic shapes no strides):

* ``hopper_forward_unsupported_reason`` decides from what is static (device, dtypes, head dims,
  mask, dropout, schedule);
* ``tma_unsupported_reason`` then checks the real tensors' strides and alignment, and the op
  falls back to the Triton forward when TMA cannot address them.

``hopper_attention_forward`` returns what ``launch.attention_forward`` returns: out (B, Hq, L, E)
in the input dtype and lse (B, Hq, L) fp32 in natural log (-inf for a row that sees no key), so
either backward (the Triton kernels, or ``launch/hopper_bwd.py`` under `fast`) takes them.

What it covers now: sm_90, bf16/fp16, E = Ev in {64, 128}, no mask or a key mask (one that is the
same for every query row, (…, 1, S) or broadcast along the queries, as padding masks are: the
kernel adds one bias per key, see ``key_bias``), no dropout, causal or not
(any ``causal_offset``), sliding windows (the band of ``launch/band.py``: the kernel starts each
block's key loop at the window's left edge), block-sparse layouts of 128 x 128 blocks or multiples
(each query block walks its listed key tiles, ``_sparse_launch``), grouped-query attention, the schedules whose forward
rounds P to the input dtype (`fast`, `stable`), and any strides TMA can address (last dim contiguous, the others
16-byte multiples, a 16-byte-aligned base), so (B, L, H, E) views transposed to (B, H, L, E)
need no copy. Everything else keeps the Triton kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import warnings

import torch

from ..schedules import PrecisionSchedule, get_schedule
from ..tuning.configs import select_hopper_forward_config, sm_count
from ..tuning.hopper_configs import HopperForwardConfig, default_forward_config
from . import common
from .band import band_lower, causal_side
from .block_tiles import checked_gluon_layout, gluon_layout_fits, gluon_tile_lists
from .common import LOG2E, cdiv
from .visibility import NO_MASKING, Visibility

log = logging.getLogger("flash_inductor")
# Reasons that say only that this is not a Hopper machine: not worth a log line.
NOT_HOPPER = ("not on a CUDA device", "not an sm_90 (Hopper) GPU", "this Triton has no Gluon Hopper support")
# Reasons about the inputs' layout, which the op normalises (3-D inputs, broadcast heads) before it
# decides: a report reading a call site's own shapes leaves these out.
NOT_4D = "inputs are not 4-D (B, H, L, E)"
HEADS_NOT_GROUPED = "query heads are not a multiple of key/value heads"
LENGTHS_DIFFER = "batch or key length mismatch"
LAYOUT_REASONS = (NOT_4D, HEADS_NOT_GROUPED, LENGTHS_DIFFER)
BLOCK_SPARSE = ("a block-sparse layout whose blocks are not multiples of 128 x 128 (block_mask; each of the Hopper "
                "kernels' tiles must lie inside one layout block)")
MASK_VARIES = ("an attention mask that varies along the queries (the Hopper kernels take a key mask, one "
               "that is the same for every query row: shape (..., 1, S) or broadcast along L)")
MASK_NEEDS_GRAD = "an attention mask that requires grad (its gradient comes from the Triton backward)"
# The base-2 kernels' floor for additive mask values, as the Triton kernels' (kernels/common.py):
# finfo(float32).min · log2 e would overflow to -inf, and a row masked entirely at the floor keeps
# uniform weights, as it has under SDPA.
MASK_FLOOR = -1e38

HEAD_DIMS = (64, 128)
DTYPES = (torch.bfloat16, torch.float16)
# The built-in configs (the tuning table's entries take precedence per bucket).
default_config = default_forward_config
# Block-sparse launches persistent, whatever the dense bucket's config says: a layout leaves each
# query block a few key tiles (90 % skipped at 4k: 4.4 of 32), so a grid CTA's fixed costs (Q's
# load, the first K/V tiles, the epilogue) weigh on every block, while a persistent CTA loads the
# next block during the epilogue and claims blocks in order, whatever their tile counts. On the
# H200 (bf16, E 128, 4k, B 8, 90 % skipped, benchmarks/experiments/step_kernels.py --block-sparse
# 0.9, 2026-12-04): the forward kernel 284 against 326 µs inference, 337 against 384 in a step.
BLOCK_SPARSE_PERSISTENT = True


def gluon_available() -> bool:
    """Whether this Triton has Gluon's Hopper support (wgmma, host TMA descriptors)."""
    return _gluon_available()


@functools.cache
def _gluon_available() -> bool:
    try:
        from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma  # noqa: F401
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401
    except Exception:  # an older Triton, or no Triton at all
        return False
    return True


def tma_addressable(t: torch.Tensor) -> bool:
    """A 4-D tensor a TMA descriptor can describe: last dim contiguous, other strides and the
    base 16-byte aligned."""
    elem = t.element_size()
    return (t.dim() == 4 and t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all((s * elem) % 16 == 0 for s in t.stride()[:-1]))


def _capability(device: torch.device) -> tuple[int, int]:
    return _capability_of(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _capability_of(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.lru_cache(maxsize=None)
def log_triton_forward(reason: str) -> None:
    """Say once per reason, at INFO, why a forward on a Hopper GPU runs the Triton kernel."""
    if reason not in NOT_HOPPER:
        log.info("flash_inductor: forward on the Triton kernel, not the Hopper (Gluon) one: %s", reason)


def hopper_forward_unsupported_reason(query, key, value, attn_mask=None, dropout_p: float = 0.0,
                                      scale: float | None = None, schedule: str | None = None, *,
                                      window=None, block_sizes: tuple[int, int] | None = None) -> str | None:
    """None if the Hopper forward takes this call as far as its static properties go, else why
    not (for the logs). Safe on fake tensors: it reads no data pointer and no stride.
    ``block_sizes``: the (block_q, block_k) of the call's block-sparse layout
    (``flash_inductor.block_sparse``), None without one."""
    if not (query.is_cuda and key.is_cuda and value.is_cuda):
        return "not on a CUDA device"
    if _capability(query.device) != (9, 0):
        return "not an sm_90 (Hopper) GPU"
    if not _gluon_available():
        return "this Triton has no Gluon Hopper support"
    sched = get_schedule(schedule)
    if sched.p_in_fp32 or sched.fp8_forward:
        return f"schedule {sched.name!r} (its forward rounds P as the Triton kernels do; fast and stable only)"
    if query.dtype not in DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        return f"dtype {query.dtype} (bf16/fp16 only, all three alike)"
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return NOT_4D
    head_dim = query.shape[-1]
    if head_dim not in HEAD_DIMS or key.shape[-1] != head_dim or value.shape[-1] != head_dim:
        return f"head dims q/k/v {query.shape[-1]}/{key.shape[-1]}/{value.shape[-1]} (64 or 128, all equal)"
    reason = key_mask_unsupported_reason(attn_mask)
    if reason is not None:
        return reason
    if dropout_p > 0.0:
        return "dropout (not implemented on this path yet)"
    del window  # any band (launch/band.py): the kernel skips the tiles outside it
    if block_sizes is not None and not gluon_layout_fits(*block_sizes):
        return BLOCK_SPARSE
    if scale is not None and not scale > 0:
        return "a non-positive scale (the kernel takes the row max on unscaled scores)"
    if query.shape[1] % key.shape[1] != 0 or key.shape[1] != value.shape[1]:
        return HEADS_NOT_GROUPED
    if query.shape[0] != key.shape[0] or key.shape[2] != value.shape[2]:
        return LENGTHS_DIFFER
    return None


def _is_one_row(mask) -> bool:
    """The mask's query dim has one row, or is broadcast (stride 0): it is the same for every query.
    Symbolic sizes and strides (dynamic shapes) that are not known to be so count as not."""
    try:
        return bool(mask.shape[-2] == 1 or mask.stride(-2) == 0)
    except Exception:  # noqa: BLE001 -- a stride a traced graph does not pin down
        return False


def key_mask_unsupported_reason(attn_mask) -> str | None:
    """None when ``attn_mask`` is absent or a key mask the Hopper kernels take (see ``key_bias``);
    else why not. Safe on fake tensors with static shapes."""
    if attn_mask is None:
        return None
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        return f"an attention mask of dtype {attn_mask.dtype}"
    if attn_mask.dim() < 2 or not _is_one_row(attn_mask):
        return MASK_VARIES
    if attn_mask.requires_grad:
        return MASK_NEEDS_GRAD
    return None


def key_bias(attn_mask: torch.Tensor, batch: int, heads: int, seq_k: int) -> torch.Tensor:
    """A key mask (``key_mask_unsupported_reason`` None) as the kernels' per-key bias: (B, H, S)
    fp32, contiguous, in base 2. Bool: 0 where True, -inf where False. Additive: the value times
    log2 e, -inf kept, finite values clamped at ``MASK_FLOOR`` first (as the Triton kernels do)."""
    row = attn_mask.expand(batch, heads, attn_mask.shape[-2], seq_k)[:, :, 0, :]
    if row.dtype == torch.bool:
        bias = torch.where(row, 0.0, float("-inf"))
    else:
        row = row.to(torch.float32)
        bias = torch.where(row.isneginf(), row, row.clamp(min=MASK_FLOOR)) * LOG2E
    return bias.to(torch.float32).contiguous()


def tma_unsupported_reason(query, key, value) -> str | None:
    """None if TMA descriptors can address these (real) tensors, else why not."""
    if min(query.shape[2], key.shape[2]) == 0 or max(query.shape[2], key.shape[2]) >= 2**31:
        return "an empty or over-long sequence"
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not tma_addressable(t):
            return f"{name} strides {tuple(t.stride())} are not TMA-addressable (need a contiguous last dim and 16-byte strides)"
    return None


def hopper_forward_supported(query, key, value, attn_mask=None, dropout_p: float = 0.0,
                             scale: float | None = None, schedule: str | None = None) -> bool:
    """Whether ``hopper_attention_forward`` implements this call (real tensors; see the module docstring)."""
    return (hopper_forward_unsupported_reason(query, key, value, attn_mask, dropout_p, scale, schedule) is None
            and tma_unsupported_reason(query, key, value) is None)


def tma_descriptor(t: torch.Tensor, rows: int, cols: int | None = None):
    """A host TMA descriptor over a 4-D (B, H, N, E) tensor with box (1, 1, rows, cols or E), in the
    default swizzled shared layout for that box (boxes wider than the swizzle are split into
    several copies by the compiler). ``t`` must be TMA-addressable (``tma_unsupported_reason``)."""
    box = (1, 1, rows, t.shape[-1] if cols is None else cols)
    return gluon_descriptor(t, list(box), _default_layout(box, t.dtype))


def gluon_descriptor(t: torch.Tensor, box: list, layout):
    """Gluon's host ``TensorDescriptor`` over all of ``t``, built without its dataclass checks
    (alignment, positive sizes, block shape), which the launchers make once per call before they
    get here (``tma_unsupported_reason``, the empty-input returns). A `stable` training step builds
    about fifteen descriptors, at 4-17 µs each with the checks on the H200's host
    (benchmarks/experiments/host_overhead.py --breakdown). Where this Triton's descriptor has other
    required fields, the checked constructor runs."""
    fields = _descriptor_defaults()
    if fields is None:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        return TensorDescriptor(t, list(t.shape), list(t.stride()), box, layout)
    cls, defaults = fields
    desc = object.__new__(cls)
    desc.__dict__.update(defaults, base=t, shape=list(t.shape), strides=list(t.stride()), block_shape=box,
                         layout=layout)
    return desc


_DESCRIPTOR_FIELDS = {"base", "shape", "strides", "block_shape", "layout"}


@functools.cache
def _descriptor_defaults():
    """(TensorDescriptor, its optional fields' defaults) when it is a plain dataclass whose required
    fields are exactly base, shape, strides, block_shape and layout (Triton 3.6 and 3.7), else None."""
    import dataclasses

    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    if not dataclasses.is_dataclass(TensorDescriptor) or hasattr(TensorDescriptor, "__slots__"):
        return None
    fields = dataclasses.fields(TensorDescriptor)
    required = {f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    if required != _DESCRIPTOR_FIELDS or any(f.default is dataclasses.MISSING for f in fields if f.name not in required):
        return None
    return TensorDescriptor, {f.name: f.default for f in fields if f.name not in required}


@functools.lru_cache(maxsize=None)
def _default_layout(box: tuple, dtype: torch.dtype):
    """The default NVMMA shared layout of a box, memoised: Gluon's lookup takes 12 of the 21 µs a
    descriptor costs to build, and a `stable` forward+backward builds about fifteen."""
    from triton.experimental.gluon import language as gl

    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(box), gl_dtype)


def hopper_attention_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                             scale: float | None = None, visibility: Visibility = NO_MASKING,
                             attn_mask: torch.Tensor | None = None, config: HopperForwardConfig | None = None,
                             exact_delta: bool = False, schedule: str | PrecisionSchedule | None = None,
                             softcap: float = 0.0) -> tuple:
    """Attention forward on the Gluon Hopper kernel. ``query`` (B, Hq, L, E), ``key``/``value``
    (B, Hkv, S, E) with Hq a multiple of Hkv. Key j is visible to query i where ``visibility``
    (``launch.visibility``: the causal side, a sliding window, a block-sparse layout whose blocks
    ``gluon_layout_fits``) lets it be and ``attn_mask``, a key mask (``key_mask_unsupported_reason``)
    broadcastable to (B, Hq, 1, S), allows it.

    Returns (out (B, Hq, L, E) in the input dtype, lse (B, Hq, L) fp32, natural log). With
    ``exact_delta`` (the `stable` schedule's one-pass backward, docs/hopper_backward.md) also
    O's rounding residual (as out) and the backward's row constants (2, B, Hq, L) fp32 (pivot,
    normaliser), which ``launch.hopper_bwd`` takes as its ``exact_delta`` pair. ``softcap`` > 0:
    FlashAttention-2's soft cap, each scaled score s becoming ``softcap * tanh(s / softcap)`` before
    the mask (the kernel's SOFTCAP). Call only where ``hopper_forward_supported`` says so.

    ``config`` None: the tuning table's entry for the call's bucket (``schedule``'s), else the
    built-in config. A table's config that fails to launch (a table written for another part, or
    by hand) warns once and runs the built-in config: a table never fails a call."""
    def launch(cfg):
        return _forward(query, key, value, scale, visibility, attn_mask, cfg, exact_delta, softcap)

    if config is not None:
        return launch(config)
    return run_selected("forward", launch, select_hopper_forward_config(
        query, key.shape[2], is_causal=visibility.is_causal, key_mask=attn_mask is not None,
        exact_delta=exact_delta, schedule=None if schedule is None else get_schedule(schedule).name))


def run_selected(kernel: str, launch, selected: tuple):
    """``launch(config)`` with the (config, from the table) a lookup selected. A table's config
    that fails to launch warns once and the built-in one runs (``launch(None)``): a table never
    fails a call, and the built-in config raises the call's real errors."""
    config, tuned = selected
    if not tuned:
        return launch(config)
    try:
        return launch(config)
    except Exception as error:  # noqa: BLE001 -- see the docstring
        warn_tuned_config_failed(kernel, config, error)
    return launch(None)


def warn_tuned_config_failed(kernel: str, config, error: BaseException) -> None:
    """One warning per (kernel, config): a tuned config did not launch, the built-in one runs."""
    _warn_tuned_once(kernel, config, f"{type(error).__name__}: {str(error).strip()[:200]}")


@functools.lru_cache(maxsize=None)
def _warn_tuned_once(kernel: str, config, reason: str) -> None:
    warnings.warn(f"flash_inductor: the tuning table's Hopper {kernel} config {config.label()} failed to launch "
                  f"({reason}); running the built-in config. Re-run `python -m flash_inductor.autotune` on this "
                  "GPU to replace the entry.", stacklevel=4)


def softcap_arguments(softcap: float, scale: float, caller: str) -> tuple[bool, float, float]:
    """The Gluon kernels' soft cap: (SOFTCAP, softcap_log2 = c·log2 e, tanh_scale = scale / c), the
    factors rounded once from fp64 (kernels/gluon_softcap.py); 1.0 where there is no cap (not read)."""
    if not (softcap >= 0.0 and softcap < float("inf")):
        raise ValueError(f"{caller}: softcap={softcap!r}; pass 0 (no cap) or a finite cap c > 0")
    if not softcap:
        return False, 1.0, 1.0
    return True, softcap * LOG2E, scale / softcap


def _forward(query, key, value, scale, visibility: Visibility, attn_mask, config, exact_delta, softcap=0.0):
    from ..kernels.hopper_args import FwdArgs, FwdSwitches, TileListArgs
    from ..kernels.hopper_fwd import _attn_fwd_hopper

    batch, heads_q, seq_q, head_dim = query.shape
    heads_kv, seq_k = key.shape[1], key.shape[2]
    if scale is None:
        scale = head_dim ** -0.5
    has_cap, softcap_log2, tanh_scale = softcap_arguments(softcap, scale, "hopper_attention_forward")
    # The kernel sees the band: its upper side as the causal arguments, its lower side as
    # WINDOW_LEFT and window_lower (as the Triton forward does).
    band = visibility.band(seq_q, seq_k)
    is_causal, causal_offset = causal_side(band)
    cfg = config or default_config(head_dim, is_causal, key_mask=attn_mask is not None, exact_delta=exact_delta)
    block_layout = visibility.block_layout()
    if block_layout is not None:
        cfg, lists = _sparse_launch(cfg, block_layout, query, key, band)
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    lse = torch.empty((batch, heads_q, seq_q), dtype=torch.float32, device=query.device)
    if exact_delta:
        resid = torch.empty_like(out)
        row_consts = torch.empty((2, batch, heads_q, seq_q), dtype=torch.float32, device=query.device)
    else:
        resid, row_consts = out, lse  # not touched
    bias = key_bias(attn_mask, batch, heads_q, seq_k) if attn_mask is not None else lse  # lse: not read
    o_desc = tma_descriptor(out, cfg.block_m)
    rows = cfg.block_m * cfg.num_consumers
    grid = (cdiv(seq_q, rows), batch * heads_q)
    persistent = cfg.persistent
    if persistent:
        # The CTAs past the first wave claim blocks from the counter, in the grid's order.
        work_counter = torch.zeros(1, dtype=torch.int32, device=query.device)
        grid = (min(grid[0] * grid[1], sm_count(query.device)), )
    else:
        work_counter = lse  # not touched
    if block_layout is None:
        lists = (lse, 0, 0, 0)  # not read
    args = FwdArgs(
        LSE=lse, ROW_CONSTS=row_consts, KEY_BIAS=bias, L=seq_q, S=seq_k, H=heads_q, GROUP=heads_q // heads_kv,
        causal_offset=causal_offset, window_lower=band_lower(band), qk_scale=scale * LOG2E,
        swizzle_heads=max(1, min(cfg.swizzle_heads, batch * heads_q)), WORK_COUNTER=work_counter,
        BH=batch * heads_q, lists=TileListArgs(*lists), softcap_log2=softcap_log2, tanh_scale=tanh_scale)
    switches = FwdSwitches(
        HEAD_DIM=head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, NUM_STAGES=cfg.num_stages,
        NUM_CONSUMERS=cfg.num_consumers, IS_CAUSAL=is_causal, WINDOW_LEFT=band.lower is not None,
        PINGPONG=cfg.pingpong, EXACT_DELTA=exact_delta, HAS_KEY_BIAS=attn_mask is not None,
        CONSUMER_REGS=cfg.consumer_regs, LOADER_REGS=cfg.loader_regs,
        SKIP_MASKED_TILES=cfg.skip_masked_tiles and block_layout is None, PERSISTENT=persistent,
        HAS_BLOCK_SPARSITY=block_layout is not None, SOFTCAP=has_cap)
    common.launcher(_attn_fwd_hopper)[grid](
        tma_descriptor(query, cfg.block_m), tma_descriptor(key, cfg.block_n), tma_descriptor(value, cfg.block_n),
        o_desc, tma_descriptor(resid, cfg.block_m) if exact_delta else o_desc, args, switches=switches,
        # The entry cap fills the register file; setmaxnreg then moves the loader's registers to
        # the consumers (2 consumers: 168 -> 240/240/24; 3: 128 -> 160/160/160/24).
        num_warps=4, maxnreg=cfg.maxnreg,
    )
    if exact_delta:
        return out, lse, resid, row_consts
    return out, lse


def _sparse_launch(cfg: HopperForwardConfig, block_layout: tuple, query, key, band):
    """(the config, the kernel's tile lists) of a block-sparse launch. The CTA's query block must lie
    in one layout block: three consumers' 192 rows do not in a 128-row layout, so such a config runs
    with two (as every E 128 config and the E 64 key-mask one do); persistent under
    ``BLOCK_SPARSE_PERSISTENT``."""
    block_map, block_q, block_k = checked_gluon_layout(block_layout, query, key, "forward")
    if block_q % (cfg.block_m * cfg.num_consumers):
        cfg = dataclasses.replace(cfg, num_consumers=2)
    if BLOCK_SPARSE_PERSISTENT:
        cfg = dataclasses.replace(cfg, persistent=True)
    if block_k % cfg.block_n:
        cfg = dataclasses.replace(cfg, block_n=64)
    lists = gluon_tile_lists(block_map, block_q, block_k, query.shape[2], key.shape[2], band.lower, band.upper,
                             cfg.block_m * cfg.num_consumers, cfg.block_n)
    return cfg, tuple(lists)

