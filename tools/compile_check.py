"""Compile the attention kernels for sm_90 without a GPU (catches Triton frontend and codegen
errors before spending device time), from hand-written signatures and constexprs, fp32 included.
``tools/smem_check.py`` compiles what the launchers really start (bf16/fp16, their shared memory);
the monitoring kernels are compiled by their own tests.

`python -m tools.compile_check` compiles a representative subset (a few minutes);
`--full` compiles every dtype x mask x dropout x causal x window variant (about eighteen minutes on
2 cores). Both also compile the block-sparse variants (HAS_BLOCK_SPARSITY, with and without the
per-element layout test) of the variants without dropout or a float mask, and soft-capping
(SOFTCAP) and packed sequences (VARLEN) of those without dropout or a mask.
"""

import inspect
import itertools
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from flash_inductor.kernels.attn_decode import _attn_decode_merge, _attn_decode_split
from flash_inductor.kernels.attn_bwd import _attn_bwd_dkdv, _attn_bwd_dq, _attn_bwd_preprocess, _attn_bwd_row_reference
from flash_inductor.kernels.attn_fwd import _attn_fwd
from flash_inductor.launch.block_tiles import DENSE_LAYOUT

_POINTERS = {"Q", "K", "V", "OUT", "DO", "DQ", "DK", "DV"}


def signature(fn, dtype, constexprs):
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in _POINTERS:
            sig[name] = f"*{dtype}"
        elif name in ("LSE", "DELTA", "DLSE", "DMASK", "ROW_REF", "ROW_SHIFT", "DS_STATS", "O_PART", "LSE_PART"):
            sig[name] = "*fp32"
        elif name == "MASK":
            sig[name] = "*i1" if constexprs.get("MASK_IS_BOOL") else f"*{dtype}"
        elif name == "SEED":
            sig[name] = "*i64"
        elif name in ("SHIFT_FLAG", "COUNTS", "IDX", "CU_Q", "CU_K"):
            sig[name] = "*i32"
        elif name == "BLOCK_MAP":
            sig[name] = "*i1"
        elif name in ("qk_scale_log2", "softcap_log2", "sm_scale", "dropout_p"):
            # Inductor (torch 2.11) passes Python floats as fp64 scalars; plain launches as fp32.
            sig[name] = "fp64" if constexprs.get("FP32_DOT") == "tf32" else "fp32"
        else:
            sig[name] = "i32"
    return sig


# A block-sparse layout's arguments (kernels/block_sparse.py): None, a constant, in dense launches.
_LAYOUT_ARGS = ("COUNTS", "IDX", "BLOCK_MAP", "stride_cb", "stride_ch", "stride_ib", "stride_ih", "list_len",
                "stride_bmb", "stride_bmh", "stride_bmm", "stride_bmn")


def compile_one(fn, dtype, constexprs, num_warps=4, num_stages=2):
    if not constexprs.get("HAS_BLOCK_SPARSITY") and _LAYOUT_ARGS[0] in fn.arg_names:
        constexprs = {**constexprs, **dict.fromkeys(_LAYOUT_ARGS), **DENSE_LAYOUT}
    if not constexprs.get("VARLEN") and "CU_Q" in fn.arg_names:  # dense: the packing arguments are None
        constexprs = {**constexprs, "CU_Q": None, "CU_K": None}
    # Switches left out take their defaults, as a launch that does not pass them does.
    constexprs = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.name not in constexprs
                     and p.default is not inspect.Parameter.empty}, **constexprs}
    src = ASTSource(fn, signature(fn, dtype, constexprs), constexprs)
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages})


def _variants(full: bool):
    grid = itertools.product(("fp16", "bf16", "fp32"), ("none", "bool", "float"), (False, True), (False, True),
                             (False, True))
    if full:
        return list(grid)
    # Every feature switched on once per dtype, plus the plain kernel (which also covers the
    # preprocess kernel and the fp32-P/dS schedule variants below); a window's left bound
    # (WINDOW_LEFT) alone and with causal masking and a bool mask.
    subset = {("none", False, False, False), ("float", True, True, False), ("bool", False, True, False),
              ("none", False, False, True), ("bool", False, True, True)}
    return [(d, m, drop, c, w) for d, m, drop, c, w in grid if (m, drop, c, w) in subset]


def main() -> int:
    failures = 0
    common = dict(HEAD_DIM=80, HEAD_DIM_V=64, BLOCK_E=128, BLOCK_EV=128)
    for dtype, mask, dropout, causal, window in _variants("--full" in sys.argv[1:]):
        flags = dict(HAS_MASK=mask != "none", MASK_IS_BOOL=mask == "bool", HAS_DROPOUT=dropout, IS_CAUSAL=causal,
                     WINDOW_LEFT=window, FP32_DOT="ieee" if dtype == "fp32" else "tf32")
        # The default (stable) schedule: exact Δ for 16-bit inputs, so the float mask's gradient is
        # written by the dK/dV pass; fp32 inputs keep Δ from O and write it in the dQ pass.
        exact = dtype != "fp32"
        dmask = mask == "float"
        stable = dict(P_IN_FP32=False, DS_IN_FP32=False, DS_RESCALE=dtype == "fp16")
        # Both ways of the backward loops' row masks, alternating with causal; HEAD_DIM 80 < BLOCK_E
        # keeps the head-dim masks.
        even_m = dict(EVEN_M=causal, EVEN_E=False)
        even_n = dict(EVEN_N=causal, EVEN_E=False)
        jobs = [
            (_attn_fwd, dict(**common, **flags, P_IN_FP32=False, FOLD_SCALE=mask != "float", BLOCK_M=64, BLOCK_N=32)),
            (_attn_bwd_dkdv, dict(**common, **flags, **stable, **even_m, WRITE_DMASK=dmask and exact, BLOCK_M=32, BLOCK_N=64)),
            (_attn_bwd_dq, dict(**common, **flags, **stable, **even_n, EXACT_DELTA=exact, HAS_DLSE=dropout,
                                WRITE_DMASK=dmask and not exact, BLOCK_M=64, BLOCK_N=32)),
            (_attn_bwd_row_reference, dict(HEAD_DIM=80, BLOCK_E=128, HAS_MASK=flags["HAS_MASK"], MASK_IS_BOOL=flags["MASK_IS_BOOL"],
                                           IS_CAUSAL=causal, WINDOW_LEFT=window, FP32_DOT=flags["FP32_DOT"],
                                           BLOCK_M=64, BLOCK_N=32)),
        ]
        if dmask and exact:  # the fast schedule: FA2's Δ, dmask from the dQ pass
            fast = dict(P_IN_FP32=False, DS_IN_FP32=False, DS_RESCALE=False)
            jobs.append((_attn_bwd_dkdv, dict(**common, **flags, **fast, **even_m, WRITE_DMASK=False, BLOCK_M=32, BLOCK_N=64)))
            jobs.append((_attn_bwd_dq, dict(**common, **flags, **fast, **even_n, EXACT_DELTA=False, HAS_DLSE=dropout,
                                            WRITE_DMASK=True, BLOCK_M=64, BLOCK_N=32)))
        if not dropout and mask == "none" and not causal and not window:
            accurate = dict(P_IN_FP32=True, DS_IN_FP32=True, DS_RESCALE=False)
            for collect in (False, True):
                jobs.append((_attn_bwd_preprocess, dict(HEAD_DIM_V=64, BLOCK_EV=64, HAS_DLSE=True,
                                                        COLLECT_DS_STATS=collect, BLOCK_M=64)))
            jobs.append((_attn_fwd, dict(**common, **flags, P_IN_FP32=True, FOLD_SCALE=False, BLOCK_M=64, BLOCK_N=32)))
            jobs.append((_attn_bwd_dkdv, dict(**common, **flags, **accurate, **even_m, WRITE_DMASK=False, BLOCK_M=32, BLOCK_N=64)))
            jobs.append((_attn_bwd_dq, dict(**common, **flags, **accurate, **even_n, EXACT_DELTA=exact, HAS_DLSE=True,
                                            WRITE_DMASK=False, BLOCK_M=64, BLOCK_N=32)))
        if not dropout:
            # The split-KV decode kernels (launch/decode.py): 16 packed rows (L = 1 at GROUP 8) with a
            # merge to follow, and 64 (the heuristic's cap) writing the output itself; the merge once
            # per dtype.
            decode = {k: v for k, v in flags.items() if k != "HAS_DROPOUT"}
            for block_m, single in ((16, False), (64, True)):
                jobs.append((_attn_decode_split, dict(**common, **decode, P_IN_FP32=False, SINGLE_SPLIT=single,
                                                      BLOCK_M=block_m, BLOCK_N=64), dict(num_stages=3)))
            if mask == "none" and not causal and not window:
                jobs.append((_attn_decode_split, dict(**common, **decode, P_IN_FP32=True, SINGLE_SPLIT=False,
                                                      BLOCK_M=16, BLOCK_N=32)))
                jobs.append((_attn_decode_merge, dict(HEAD_DIM_V=64, BLOCK_EV=128, BLOCK_SPLITS=64)))
        if mask != "float" and not dropout:
            # Block-sparse launches: tiles nested in the layout's blocks, and straddling them (the
            # per-element layout test); with causal masking and windows as they come.
            for check in (False, True):
                sparse = dict(HAS_BLOCK_SPARSITY=True, LAYOUT_CHECK=check, LAYOUT_BQ=128 if check else 1,
                              LAYOUT_BK=48 if check else 1)
                jobs.append((_attn_fwd, dict(**common, **flags, **sparse, P_IN_FP32=False, FOLD_SCALE=mask == "none",
                                             BLOCK_M=64, BLOCK_N=32)))
                jobs.append((_attn_bwd_dkdv, dict(**common, **flags, **stable, **even_m, **sparse, WRITE_DMASK=False,
                                                  BLOCK_M=32, BLOCK_N=64)))
                jobs.append((_attn_bwd_dq, dict(**common, **flags, **stable, **even_n, **sparse, EXACT_DELTA=exact,
                                                HAS_DLSE=False, WRITE_DMASK=False, BLOCK_M=64, BLOCK_N=32)))
        if not dropout and mask == "none":
            # Soft-capping and packed sequences (no mask: varlen takes none), each alone and together,
            # with causal masking and windows as they come.
            for extra in (dict(SOFTCAP=True), dict(VARLEN=True), dict(SOFTCAP=True, VARLEN=True)):
                packed = bool(extra.get("VARLEN"))  # packed launches never drop the row masks
                jobs.append((_attn_fwd, dict(**common, **flags, **extra, P_IN_FP32=False, FOLD_SCALE=False,
                                             BLOCK_M=64, BLOCK_N=32)))
                jobs.append((_attn_bwd_dkdv, dict(**common, **flags, **stable, **extra,
                                                  **{**even_m, **(dict(EVEN_M=False) if packed else {})},
                                                  WRITE_DMASK=False, BLOCK_M=32, BLOCK_N=64)))
                jobs.append((_attn_bwd_dq, dict(**common, **flags, **stable, **extra,
                                                **{**even_n, **(dict(EVEN_N=False) if packed else {})},
                                                EXACT_DELTA=exact, HAS_DLSE=False, WRITE_DMASK=False, BLOCK_M=64,
                                                BLOCK_N=32)))
            jobs.append((_attn_bwd_row_reference, dict(HEAD_DIM=80, BLOCK_E=128, HAS_MASK=False, MASK_IS_BOOL=False,
                                                       IS_CAUSAL=causal, WINDOW_LEFT=window, FP32_DOT=flags["FP32_DOT"],
                                                       SOFTCAP=True, BLOCK_M=64, BLOCK_N=32)))
        for fn, constexprs, *options in jobs:
            try:
                compile_one(fn, dtype, constexprs, **(options[0] if options else {}))
            except Exception as exc:  # report every failing variant, not just the first
                failures += 1
                print(f"FAIL {fn.__name__} {dtype} mask={mask} dropout={dropout} causal={causal} window={window}: "
                      f"{str(exc)[-600:]}")
    print(f"compile check: {failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
