"""The Gluon Hopper kernels' launch arguments, grouped as the kernels read them.

A launch passes each kernel its TMA descriptors, one ``*Args`` tuple (the call's sizes, scalars and
pointers) and one ``*Switches`` tuple of constexprs (the glossary's switches: what is computed, and
the tuned tiling). Triton flattens a tuple argument into the kernel's parameters and specialises each
element as it would a loose one, so the grouping generates the same code as loose arguments in this
order (``python -m tools.launch_sass --compare`` checks it); the kernels then hold them in their
config and problem aggregates (``hopper_fwd_state.FwdConfig``/``FwdProblem``, ``hopper_bwd.BwdConfig``/
``BwdProblem``). Field names are the kernels' own, so a launch reads as the kernel's docstring.
"""

from collections import namedtuple

# A block-sparse layout's tile lists (``launch/block_tiles.py``; ``hopper_pipeline.TileLists``): the
# int32 lists, their batch and head strides (0 where the layout broadcasts) and the row stride.
TileListArgs = namedtuple("TileListArgs", ["base", "stride_lb", "stride_lh", "list_stride"])

FwdArgs = namedtuple("FwdArgs", [
    "LSE", "ROW_CONSTS", "KEY_BIAS", "L", "S", "H", "GROUP", "causal_offset", "window_lower", "qk_scale",
    "swizzle_heads", "WORK_COUNTER", "BH", "lists", "softcap_log2", "tanh_scale",
    # HAS_SINKS only (None otherwise): the sinks, (H,) fp32.
    "SINKS",
    # VARLEN only (None otherwise): O and its residual as packed tensors, and ``PackedRows``' fields.
    "OUT", "RESID", "CU_Q", "CU_K", "n_seq", "diag_shift"], defaults=(None,) * 7)

FwdSwitches = namedtuple("FwdSwitches", [
    "HEAD_DIM", "BLOCK_M", "BLOCK_N", "NUM_STAGES", "NUM_CONSUMERS", "IS_CAUSAL", "WINDOW_LEFT", "PINGPONG",
    "EXACT_DELTA", "HAS_KEY_BIAS", "CONSUMER_REGS", "LOADER_REGS", "SKIP_MASKED_TILES", "PERSISTENT",
    "HAS_BLOCK_SPARSITY", "SOFTCAP", "HAS_SINKS", "VARLEN"], defaults=(False, False))

BwdArgs = namedtuple("BwdArgs", [
    "LSE", "DELTA", "DQ_ACCUM", "DS_UP", "KEY_BIAS", "MEAN_KEY", "DKDV_PART", "L", "S", "H_KV", "GROUP",
    "group_split", "stride_stats", "causal_offset", "window_lower", "qk_scale", "sm_scale", "swizzle_heads",
    "lists", "softcap_log2", "tanh_scale",
    # VARLEN only (None otherwise): dK and dV as packed tensors, and ``PackedRows``' fields.
    "DK", "DV", "CU_Q", "CU_K", "n_seq", "diag_shift"], defaults=(None,) * 6)

BwdSwitches = namedtuple("BwdSwitches", [
    "HEAD_DIM", "BLOCK_M", "BLOCK_N", "NUM_STAGES", "IS_CAUSAL", "WINDOW_LEFT", "DQ_SPLIT", "DQ_TMA",
    "EXACT_DELTA", "HAS_KEY_BIAS", "ROW_STATS_TMA", "DKDV_PARTIALS", "CENTRE_KEYS", "CONSUMER_REGS",
    "LOADER_REGS", "HAS_BLOCK_SPARSITY", "EVEN_L", "PAIRED_TILES", "SOFTCAP", "VARLEN"], defaults=(False,))
