"""EXPERIMENT: launch configs of the one-pass step's linear passes over K and the rows, timed alone.

    python -m benchmarks.experiments.linear_passes --tokens 32768 --seq 4096 --head-dim 128

The `stable` one-pass backward reads K once for its mean (``_key_moments``; the record
``linear_passes_20261204`` also timed ``_centre_keys``, which wrote K̃ before the Hopper backward
formed it in shared memory) and streams dO, O and the residual once (``_exact_delta_preprocess``),
beside the dQ accumulator's zero fill. They are memory-bound, so their time against the bytes they move says how far each
is from the H200's bandwidth; this times each under several launch configs (triton.testing.do_bench,
median) and prints GB/s. The run recorded as ``linear_passes_20261204`` also timed
``_key_moments``' one-load loop and a preprocess that zeroed the dQ accumulator, both since
removed (git history at 0b912f7). Writes ``linear_passes.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from triton.testing import do_bench

from flash_inductor.kernels.exact_delta import _exact_delta_preprocess, _key_moments
from flash_inductor.launch.common import cdiv


def _moments(key, chunks, block_n, warps, kernel=_key_moments):
    batch, heads, seq, dim = key.shape
    chunk = cdiv(cdiv(seq, chunks), 2 * block_n) * 2 * block_n
    chunks = cdiv(seq, chunk)
    partial = torch.empty((3, batch * heads, chunks, dim), dtype=torch.float32, device=key.device)
    strides = (*key.stride()[:3], heads, seq, chunk)

    def run():
        kernel[(chunks, batch * heads)](key, partial, *strides, HEAD_DIM=dim, BLOCK_N=block_n, num_warps=warps)
    return run, partial, chunk, chunks


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    dim, seq = args.head_dim, args.seq
    batch, heads = max(1, args.tokens // seq), 2048 // dim
    shape = (batch, heads, seq, dim)
    key = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    records = []

    def timed(name, run, nbytes, **config):
        ms = do_bench(run, warmup=25, rep=100, return_mode="median")
        records.append(dict(kernel=name, us=ms * 1e3, gbps=nbytes / ms / 1e6, **config))
        print(f"{name:12s} {ms * 1e3:8.1f} us {nbytes / ms / 1e6:7.0f} GB/s  {config}", flush=True)

    k_bytes = key.numel() * key.element_size()
    for chunks in (8, 16):
        for block_n in (16, 32):
            for warps in (4, 8):
                run, *_ = _moments(key, chunks, block_n, warps)
                timed("moments", run, k_bytes, chunks=chunks, block_n=block_n, warps=warps)
    do, out, resid = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    norm = torch.rand(shape[:3], device="cuda")
    do_scaled, delta = torch.empty_like(do), torch.empty(shape[:3], device="cuda")
    dq_acc = torch.empty(shape, device="cuda", dtype=torch.float32)
    grid = (cdiv(seq, 64), batch * heads)
    timed("preprocess", lambda: _exact_delta_preprocess[grid](
        do, out, resid, norm, norm, do_scaled, delta, out, delta, delta, delta, *do.stride()[:3], *out.stride()[:3],
        *out.stride()[:3], heads, heads, seq, seq, grid[0], 0, HEAD_DIM=dim, BLOCK_M=64, HAS_DLSE=False,
        COLLECT_STATS=False, num_warps=4), 4 * k_bytes, block_m=64)
    timed("zero fill", lambda: dq_acc.zero_(), dq_acc.numel() * 4)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "linear_passes.json"), "w") as f:
        json.dump(dict(args=vars(args), shape=list(shape), records=records), f, indent=1)


if __name__ == "__main__":
    main()
