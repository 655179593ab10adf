"""EXPERIMENT: every kernel of one attention step, ours against cuDNN, at the grid's cells.

    python -m benchmarks.experiments.step_kernels --dtypes bf16,fp16 --head-dims 64,128 --seq 4096 --causal \
        --out $OUT

bench_attention's ``--kernel-time`` gives a step's summed kernel time; this lists the kernels
behind it (torch.profiler, per call, after heating), so a gap to cuDNN can be put on the launch
that makes it: the inference forward (``infer``, under no_grad), the training forward (``fwd``:
inputs that require grad, which takes `stable`'s one-pass forward with its residual and centred
keys) and a whole training step (``fwd_bwd``). Shapes as bench_attention's: ``--tokens`` /
seq sequences, 2048 / E heads. ``--window W`` times a causal sliding window ``(W - 1, 0)``
instead, against FlexAttention with the same window as a ``BlockMask`` (``--providers ours,flex``);
``--block-sparse P`` a random layout of 128 x 128 blocks with a share P of them skipped, the
``sparse_attention --part block_sparse`` cell's, against Flex with that layout as full blocks.
The provider ``ours-grid`` is ours with block-sparse forward launches on the grid
(``launch.hopper.BLOCK_SPARSE_PERSISTENT`` off), set only while its step runs: an A/B in one
process.
Each record also has the step's GPU busy share run back to back (``benchmarks/kernel_time.gpu_busy``):
well under 1 means the GPU waited for the host. Writes ``step_kernels.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_inductor
from benchmarks.common import compiled_flex, heat
from benchmarks.kernel_time import gpu_busy, kernel_times_us

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
MODES = ("infer", "fwd", "fwd_bwd")


def _attention(provider: str, causal: bool, window: int | None, seq: int, sparsity: float | None = None):
    if sparsity is not None:
        return _block_sparse_attention(provider, seq, sparsity)
    if window is not None:
        return _window_attention(provider, window, seq)
    if provider == "ours":
        return lambda q, k, v: flash_inductor.flash_attention(q, k, v, is_causal=causal)

    def cudnn(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return cudnn


def _window_attention(provider: str, window: int, seq: int):
    """A causal sliding window of ``window`` keys, ``(window - 1, 0)``: ours or Flex."""
    if provider == "ours":
        return lambda q, k, v: flash_inductor.flash_attention(q, k, v, window=(window - 1, 0))
    if provider != "flex":
        raise SystemExit(f"--window takes the providers ours and flex, not {provider!r}")
    from torch.nn.attention.flex_attention import create_block_mask

    from benchmarks.sparse_attention import window_mask_mod

    block_mask = create_block_mask(window_mask_mod(window - 1, 0, seq, seq), B=None, H=None, Q_LEN=seq, KV_LEN=seq,
                                   device="cuda")
    flex = compiled_flex()
    return lambda q, k, v: flex(q, k, v, block_mask=block_mask)


def _block_sparse_attention(provider: str, seq: int, sparsity: float):
    """``benchmarks.block_sparse_attention``'s cell (layout seed 0, blocks of 128): ours or Flex."""
    from benchmarks import block_sparse_attention

    if provider not in ("ours", "flex"):
        raise SystemExit(f"--block-sparse takes the providers ours and flex, not {provider!r}")
    cell = dict(seq=seq, block=128, sparsity=sparsity, layout_seed=0)
    return block_sparse_attention.attention(provider, cell, "cuda", compiled_flex)


# Provider suffixes: the launch.hopper switch each sets while its step runs.
SWITCHED = {"-grid": ("BLOCK_SPARSE_PERSISTENT", False)}


def _switched(attn, switch: str, value: bool):
    """``attn`` with ``launch.hopper.<switch>`` set to ``value`` while it runs."""
    from flash_inductor.launch import hopper

    def run(q, k, v):
        saved = getattr(hopper, switch)
        setattr(hopper, switch, value)
        try:
            return attn(q, k, v)
        finally:
            setattr(hopper, switch, saved)
    return run


def _step(attn, mode: str, q, k, v, dout):
    if mode == "infer":
        def run():
            with torch.no_grad():
                return attn(q, k, v)
    elif mode == "fwd":
        def run():
            return attn(q, k, v)
    else:
        def run():
            return torch.autograd.grad(attn(q, k, v), (q, k, v), dout)
    return run


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="bf16,fp16")
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--window", type=int, default=None, help="a causal sliding window of W keys (providers ours,flex)")
    p.add_argument("--block-sparse", type=float, default=None, metavar="P",
                   help="a random block-sparse layout with a share P of its blocks skipped (providers ours,flex)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--providers", default="ours,cudnn")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--heat", type=float, default=0.3, help="seconds each step runs before it is profiled")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    records = []
    for dtype_name in args.dtypes.split(","):
        for head_dim in (int(e) for e in args.head_dims.split(",")):
            gen = torch.Generator(device="cuda").manual_seed(0)
            shape = (max(1, args.tokens // args.seq), 2048 // head_dim, args.seq, head_dim)
            q, k, v = (torch.randn(shape, generator=gen, device="cuda", dtype=DTYPES[dtype_name]).requires_grad_()
                       for _ in range(3))
            dout = torch.randn(shape, generator=gen, device="cuda", dtype=DTYPES[dtype_name])
            for mode in args.modes.split(","):
                for provider in args.providers.split(","):
                    suffix = next((s for s in SWITCHED if provider.endswith(s)), "")
                    attn = _attention(provider.removesuffix(suffix) if suffix else provider, args.causal,
                                      args.window, args.seq, args.block_sparse)
                    if suffix:
                        attn = _switched(attn, *SWITCHED[suffix])
                    run = _step(attn, mode, q, k, v, dout)
                    heat(run, args.heat * 1e3)
                    kernels = kernel_times_us(run, args.calls, "cuda")
                    total = sum(kernels.values())
                    busy = gpu_busy(run, args.calls, "cuda").get("gpu_busy")
                    records.append(dict(dtype=dtype_name, head_dim=head_dim, shape=list(shape), causal=args.causal,
                                        window=args.window, block_sparse=args.block_sparse, mode=mode, provider=provider, total_us=total,
                                        gpu_busy=busy, kernels=kernels))
                    print(f"{dtype_name} E{head_dim} {mode:8s} {provider:6s} total {total:8.1f} us  "
                          f"GPU busy {busy if busy is not None else float('nan'):.2f}", flush=True)
                    for name, us in kernels.items():
                        print(f"      {us:8.1f} us  {name[:90]}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "step_kernels.json"), "w") as f:
        json.dump(dict(args=vars(args), torch=torch.__version__, records=records), f, indent=1)


if __name__ == "__main__":
    main()
