"""Compile the Gluon Hopper forward (kernels/hopper_fwd.py) for sm_90a on a machine without a GPU
and report what the launch would cost: registers, shared memory, spills, and whether the SASS has
the wgmma (HGMMA) and TMA (UTMALDG/UTMASTG) instructions it is built on.

    python tools/hopper_fwd_compile.py --head-dim 128 --pingpong             # E=128 default
    python tools/hopper_fwd_compile.py --head-dim 64 --consumers 3 --pingpong  # E=64 default
    python tools/hopper_fwd_compile.py --head-dim 64 --causal --dump /tmp/hfwd

Needs a Triton with Gluon (3.6 on the H200) and its bundled ptxas/cuobjdump; no torch. The
tensor-descriptor signature strings are what Triton's launcher would mangle for a host
``gluon.nvidia.hopper.TensorDescriptor`` (tensordesc<dtype[box],layout>).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile


def kernel_module(name: str = "hopper_fwd"):
    """``flash_inductor.kernels.<name>`` without running ``flash_inductor/__init__.py`` (which
    imports torch, absent from a compile-only Triton environment): empty package modules stand in
    for the two packages, so the kernel's relative imports of its sibling modules resolve."""
    import importlib
    import types

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for package_name, folder in (("flash_inductor", ("flash_inductor",)),
                                 ("flash_inductor.kernels", ("flash_inductor", "kernels"))):
        if package_name not in sys.modules:
            package = types.ModuleType(package_name)
            package.__path__ = [os.path.join(root, *folder)]
            sys.modules[package_name] = package
    return importlib.import_module(f"flash_inductor.kernels.{name}")


def compile_config(head_dim: int, dtype: str, causal: bool, block_m: int, block_n: int, stages: int,
                   consumers: int = 2, pingpong: bool = False, loader_regs: int = 24, window: bool = False,
                   exact_delta: bool = False, key_bias: bool = False, skip_masked_tiles: bool = False,
                   persistent: bool = False, block_sparse: bool = False):
    # Same register plan as launch/hopper.py: the entry cap fills the file for 4*(consumers+1) warps.
    consumer_regs, maxnreg = (240, 168) if consumers == 2 else (160, 128)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    _attn_fwd_hopper = kernel_module()._attn_fwd_hopper

    gl_dtype = {"bf16": gl.bfloat16, "fp16": gl.float16}[dtype]
    q_box = [1, 1, block_m, head_dim]
    kv_box = [1, 1, block_n, head_dim]
    q_layout = gl.NVMMASharedLayout.get_default_for(q_box, gl_dtype)
    kv_layout = gl.NVMMASharedLayout.get_default_for(kv_box, gl_dtype)
    q_sig = f"tensordesc<{dtype}[{', '.join(map(str, q_box))}],{q_layout!r}>"
    kv_sig = f"tensordesc<{dtype}[{', '.join(map(str, kv_box))}],{kv_layout!r}>"
    signature = {
        "q_desc": q_sig, "k_desc": kv_sig, "v_desc": kv_sig, "o_desc": q_sig, "r_desc": q_sig, "LSE": "*fp32", "ROW_CONSTS": "*fp32",
        "KEY_BIAS": "*fp32", "L": "i32", "S": "i32", "H": "i32", "GROUP": "i32", "causal_offset": "i32", "window_lower": "i32",
        "qk_scale": "fp32", "swizzle_heads": "i32", "WORK_COUNTER": "*i32", "BH": "i32",
        "TILE_LISTS": "*i32", "stride_lb": "i32", "stride_lh": "i32", "list_stride": "i32",
        "HEAD_DIM": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "NUM_STAGES": "constexpr",
        "NUM_CONSUMERS": "constexpr", "IS_CAUSAL": "constexpr", "WINDOW_LEFT": "constexpr", "PINGPONG": "constexpr",
        "EXACT_DELTA": "constexpr", "HAS_KEY_BIAS": "constexpr",
        "CONSUMER_REGS": "constexpr", "LOADER_REGS": "constexpr", "SKIP_MASKED_TILES": "constexpr",
        "PERSISTENT": "constexpr", "HAS_BLOCK_SPARSITY": "constexpr",
    }
    constexprs = {
        "HEAD_DIM": head_dim, "BLOCK_M": block_m, "BLOCK_N": block_n, "NUM_STAGES": stages,
        "NUM_CONSUMERS": consumers, "IS_CAUSAL": causal, "WINDOW_LEFT": window, "PINGPONG": pingpong, "EXACT_DELTA": exact_delta,
        "HAS_KEY_BIAS": key_bias, "CONSUMER_REGS": consumer_regs,
        "LOADER_REGS": loader_regs, "SKIP_MASKED_TILES": skip_masked_tiles, "PERSISTENT": persistent,
        "HAS_BLOCK_SPARSITY": block_sparse,
    }
    src = GluonASTSource(fn=_attn_fwd_hopper, signature=signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, maxnreg=maxnreg))


def sass_of(kernel) -> str:
    import triton.backends.nvidia as nvidia_backend

    cuobjdump = os.path.join(os.path.dirname(nvidia_backend.__file__), "bin", "cuobjdump")

    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
        path = f.name
    try:
        return subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True).stdout
    finally:
        os.unlink(path)


def ptxas_usage(ptx: str) -> dict:
    """Registers at entry (the cap setmaxnreg starts from), spill bytes and stack frame, from
    ``ptxas -v`` on the kernel's PTX (Triton reads these only when it loads the kernel on a GPU)."""
    import triton.backends.nvidia as nvidia_backend

    ptxas = os.path.join(os.path.dirname(nvidia_backend.__file__), "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        log = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True).stderr
    num = lambda pat: int(m.group(1)) if (m := re.search(pat, log)) else None  # noqa: E731
    return dict(regs=num(r"Used (\d+) registers"), spill_stores=num(r"(\d+) bytes spill stores"),
                spill_loads=num(r"(\d+) bytes spill loads"), stack=num(r"(\d+) bytes stack frame"),
                # ptxas reports serialised wgmma (C7514 and kin) as "info", not as a warning.
                ptxas_warnings=[l for l in log.splitlines()
                                if "warning" in l.lower() or "performance loss" in l.lower()])


def report(kernel) -> dict:
    md = kernel.metadata
    sass = sass_of(kernel)
    ptx = kernel.asm["ptx"]
    return dict(
        **ptxas_usage(ptx),
        setmaxnreg_values=sorted(set(int(v) for v in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx))),
        shared=md.shared, num_warps=md.num_warps,
        hgmma=len(re.findall(r"\bHGMMA\b", sass)), utmaldg=len(re.findall(r"UTMALDG", sass)),
        utmastg=len(re.findall(r"UTMASTG", sass)),
        local_mem=len(re.findall(r"\b(LDL|STL)\b", sass)),
        wgmma_wait=len(re.findall(r"WARPGROUP.DEPBAR|wgmma.wait_group", sass + ptx)),
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head-dim", type=int, nargs="*", default=[64, 128])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--window", action="store_true", help="a sliding window's left side (WINDOW_LEFT)")
    ap.add_argument("--block-m", type=int, default=64)
    ap.add_argument("--block-n", type=int, default=128)
    ap.add_argument("--stages", type=int, default=0, help="0: 2 for E=128, 3 for E=64")
    ap.add_argument("--consumers", type=int, default=2, choices=[2, 3])
    ap.add_argument("--pingpong", action="store_true")
    ap.add_argument("--exact-delta", action="store_true", help="`stable`'s one-pass exact Δ (EXACT_DELTA)")
    ap.add_argument("--key-bias", action="store_true", help="a key mask's per-key bias (HAS_KEY_BIAS)")
    ap.add_argument("--skip-masked-tiles", action="store_true",
                    help="a consumer's wholly masked causal tail tiles are only released (SKIP_MASKED_TILES)")
    ap.add_argument("--persistent", action="store_true",
                    help="one CTA per SM claiming blocks from a work counter (PERSISTENT)")
    ap.add_argument("--block-sparse", action="store_true",
                    help="a block-sparse layout's tile lists (HAS_BLOCK_SPARSITY)")
    ap.add_argument("--dump", default=None, help="folder for the ttgir/ptx/sass of each config")
    args = ap.parse_args()
    for e in args.head_dim:
        stages = args.stages or (2 if e == 128 else 3)
        k = compile_config(e, args.dtype, args.causal, args.block_m, args.block_n, stages, args.consumers,
                           args.pingpong, window=args.window, exact_delta=args.exact_delta,
                           key_bias=args.key_bias, skip_masked_tiles=args.skip_masked_tiles,
                           persistent=args.persistent, block_sparse=args.block_sparse)
        r = report(k)
        print(f"E={e} {args.dtype} causal={args.causal} window={args.window} exact_delta={args.exact_delta} key_bias={args.key_bias} pingpong={args.pingpong} skip_masked_tiles={args.skip_masked_tiles} persistent={args.persistent} block_sparse={args.block_sparse} BM={args.block_m}x{args.consumers} BN={args.block_n} stages={stages}: {r}")
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            tag = f"e{e}_{args.dtype}_{'c' if args.causal else 'n'}{'w' if args.window else ''}_bn{args.block_n}_s{stages}_w{args.consumers}{'_pp' if args.pingpong else ''}{'_skip' if args.skip_masked_tiles else ''}{'_persistent' if args.persistent else ''}{'_bs' if args.block_sparse else ''}"
            for ext in ("ttgir", "ptx"):
                with open(os.path.join(args.dump, f"{tag}.{ext}"), "w") as f:
                    f.write(k.asm[ext])
            with open(os.path.join(args.dump, f"{tag}.sass"), "w") as f:
                f.write(sass_of(k))
    return 0


if __name__ == "__main__":
    sys.exit(main())
