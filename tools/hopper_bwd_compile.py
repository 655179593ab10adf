"""Compile the Gluon Hopper backward (kernels/hopper_bwd.py) for sm_90a on a machine without a GPU
and report registers, shared memory, spills, and whether the SASS has HGMMA, TMA and the dQ
atomics (RED) it is built on. Reuses tools/hopper_fwd_compile.py's ptxas/cuobjdump helpers.

    python tools/hopper_bwd_compile.py                        # E 64 and 128, both dQ schemes
    python tools/hopper_bwd_compile.py --head-dim 128 --dq-split 1 --causal --dump /tmp/hbwd
    python tools/hopper_bwd_compile.py --head-dim 128 --dq-split 1 --causal --window   # WINDOW_LEFT

Needs a Triton with Gluon (3.6 on the H200) and its bundled ptxas/cuobjdump; no torch.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name, *parts):
    spec = importlib.util.spec_from_file_location(name, os.path.join(_ROOT, *parts))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_fwd_tool = _load("hopper_fwd_compile", "tools", "hopper_fwd_compile.py")


def compile_config(head_dim: int, dtype: str, causal: bool, block_m: int = 64, stages: int = 2,
                   dq_split: bool = False, dq_tma: bool = True, consumer_regs: int = 240, loader_regs: int = 24,
                   maxnreg: int = 168, window: bool = False, exact_delta: bool = False,
                   key_bias: bool = False, row_stats_tma: bool = True, group_split: int = 1,
                   centre_keys: bool = False, block_sparse: bool = False, even_l: bool = True,
                   paired_tiles: bool = False):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    kernel = _fwd_tool.kernel_module("hopper_bwd")._attn_bwd_hopper
    gl_dtype = {"bf16": gl.bfloat16, "fp16": gl.float16}[dtype]

    def sig(rows, cols=head_dim, name=dtype, gl_type=gl_dtype):
        box = [1, 1, rows, cols]
        layout = gl.NVMMASharedLayout.get_default_for(box, gl_type)
        return f"tensordesc<{name}[{', '.join(map(str, box))}],{layout!r}>"

    q_sig, kv_sig = sig(block_m), sig(64)
    dq_sig = sig(block_m, head_dim // 2 if dq_split else head_dim, "fp32", gl.float32)
    signature = {
        "q_desc": q_sig, "k_desc": kv_sig, "v_desc": kv_sig, "do_desc": q_sig, "dk_desc": kv_sig, "dv_desc": kv_sig,
        "dq_desc": dq_sig,
        # LSE and Δ as (B·Hq, L) planes, box (1, BLOCK_M), unswizzled (launch.hopper_bwd.row_stats_descriptor).
        "lse_desc": f"tensordesc<fp32[1, {block_m}],{gl.NVMMASharedLayout(0, 32, rank=2)!r}>",
        "delta_desc": f"tensordesc<fp32[1, {block_m}],{gl.NVMMASharedLayout(0, 32, rank=2)!r}>",
        "LSE": "*fp32", "DELTA": "*fp32", "DQ_ACCUM": "*fp32", "DS_UP": "*fp32", "KEY_BIAS": "*fp32",
        "MEAN_KEY": "*fp32", "DKDV_PART": "*fp32",
        "L": "i32", "S": "i32", "H_KV": "i32", "GROUP": "i32", "group_split": "i32", "stride_stats": "i32", "causal_offset": "i32", "window_lower": "i32",
        "qk_scale": "fp32",
        "sm_scale": "fp32", "swizzle_heads": "i32",
        "TILE_LISTS": "*i32", "stride_lb": "i32", "stride_lh": "i32", "list_stride": "i32",
    }
    constexprs = dict(HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=128, NUM_STAGES=stages, IS_CAUSAL=causal,
                      WINDOW_LEFT=window, DQ_SPLIT=dq_split, DQ_TMA=dq_tma, EXACT_DELTA=exact_delta, HAS_KEY_BIAS=key_bias,
                      ROW_STATS_TMA=row_stats_tma, DKDV_PARTIALS=group_split > 1, CENTRE_KEYS=centre_keys,
                      CONSUMER_REGS=consumer_regs,
                      LOADER_REGS=loader_regs, HAS_BLOCK_SPARSITY=block_sparse,
                      EVEN_L=even_l, PAIRED_TILES=paired_tiles)
    if group_split == 1:
        # An unsplit launch passes group_split = 1, which Triton compiles in as a constant.
        constexprs["group_split"] = 1
    if not window:
        # A launch without a window passes window_lower = 1, which Triton compiles in as a constant.
        constexprs["window_lower"] = 1
    signature.update({k: "constexpr" for k in constexprs})
    src = GluonASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=maxnreg))


def report(kernel) -> dict:
    r = _fwd_tool.report(kernel)
    sass = _fwd_tool.sass_of(kernel)
    ptx = kernel.asm["ptx"]
    r.update(red=len(re.findall(r"\bRED\b|REDG", sass)), red_ptx=sorted(set(re.findall(r"red\.[\w.:]+", ptx))),
             tma_reduce=sorted(set(re.findall(r"cp\.reduce\.async\.bulk[\w.:]*", ptx))),
             atom_ptx=sorted(set(re.findall(r"atom\.[\w.:]+", ptx))),
             hgmma_shapes=sorted(set(re.findall(r"HGMMA\.\w+", sass))))
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head-dim", type=int, nargs="*", default=[64, 128])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--window", action="store_true", help="a sliding window's left side (WINDOW_LEFT)")
    ap.add_argument("--block-m", type=int, default=64)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--dq-split", type=int, nargs="*", default=[0, 1])
    ap.add_argument("--dq-tma", type=int, nargs="*", default=[1], help="1: TMA reduce-add of dQ tiles, 0: atomics")
    ap.add_argument("--exact-delta", action="store_true", help="`stable`'s one-pass exact Δ (EXACT_DELTA)")
    ap.add_argument("--centre-keys", action="store_true",
                    help="dQ over K̃ = K − k̂ formed in shared memory (CENTRE_KEYS, the one-pass path's)")
    ap.add_argument("--key-bias", action="store_true", help="a key mask's per-key bias (HAS_KEY_BIAS)")
    ap.add_argument("--row-stats-tma", type=int, default=1, help="1: LSE/Δ rows through the loader's TMA (default)")
    ap.add_argument("--group-split", type=int, default=1,
                    help="a GQA group's query heads over this many CTAs (above 1: fp32 dK/dV partials, DKDV_PARTIALS)")
    ap.add_argument("--block-sparse", action="store_true",
                    help="a block-sparse layout's tile lists (HAS_BLOCK_SPARSITY)")
    ap.add_argument("--ragged-l", action="store_true",
                    help="L not a multiple of the query tile: the row statistics' masks (EVEN_L off)")
    ap.add_argument("--paired-tiles", action="store_true",
                    help="two tiles an iteration, the second's Sᵀ issued under the first's dQ epilogue (PAIRED_TILES)")
    ap.add_argument("--dump", default=None, help="folder for the ttgir/ptx/sass of each config")
    args = ap.parse_args()
    for e in args.head_dim:
        for split, dq_tma in ((s, t) for s in args.dq_split for t in args.dq_tma):
            k = compile_config(e, args.dtype, args.causal, args.block_m, args.stages, bool(split), bool(dq_tma),
                               window=args.window, exact_delta=args.exact_delta, key_bias=args.key_bias,
                               row_stats_tma=bool(args.row_stats_tma), group_split=args.group_split,
                               centre_keys=args.centre_keys, block_sparse=args.block_sparse,
                               even_l=not args.ragged_l, paired_tiles=args.paired_tiles)
            print(f"E={e} {args.dtype} causal={args.causal} window={args.window} exact_delta={args.exact_delta} "
                  f"key_bias={args.key_bias} centre_keys={args.centre_keys} row_stats_tma={bool(args.row_stats_tma)} BM={args.block_m} "
                  f"stages={args.stages} group_split={args.group_split} block_sparse={args.block_sparse} "
                  f"dq_split={bool(split)} dq_tma={bool(dq_tma)}: {report(k)}", flush=True)
            if args.dump:
                os.makedirs(args.dump, exist_ok=True)
                band = ("c" if args.causal else "n") + ("w" if args.window else "")
                tag = f"e{e}_{args.dtype}_{band}_bm{args.block_m}_s{args.stages}_split{split}_tma{dq_tma}_g{args.group_split}{'_ck' if args.centre_keys else ''}{'_bs' if args.block_sparse else ''}{'_ragged' if args.ragged_l else ''}{'_paired' if args.paired_tiles else ''}"
                for ext in ("ttgir", "ptx"):
                    with open(os.path.join(args.dump, f"{tag}.{ext}"), "w") as f:
                        f.write(k.asm[ext])
                with open(os.path.join(args.dump, f"{tag}.sass"), "w") as f:
                    f.write(_fwd_tool.sass_of(k))
    return 0


if __name__ == "__main__":
    sys.exit(main())
