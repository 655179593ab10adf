"""EXPERIMENT: what forming K̃ in the Hopper backward's shared memory costs its kernel.

    python -m benchmarks.experiments.centred_dq_cost --out $OUT

The one-pass `stable` backward's dQ GEMM takes centred keys K̃ = K − k̂, which each CTA forms from
its K tile (``kernels/hopper_bwd.py``, CENTRE_KEYS): 16 KiB (E 64) or 32 KiB (E 128) more shared
memory, and one pass over the tile per CTA. This times the Gluon backward kernel alone
(torch.profiler, ``benchmarks.kernel_time``) with ``mean_key`` given and without it (the same
kernel, dQ over K itself), at the grid's causal cells (16k tokens, 2048 / E heads), from one
forward's outputs. Writes ``centred_dq_cost.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from benchmarks.common import heat
from benchmarks.kernel_time import kernel_times_us

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="bf16")
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--seqs", default="4096,16384")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    from flash_inductor.launch.hopper_bwd import hopper_attention_backward, key_mean
    from flash_inductor.ops.one_pass import _forward

    records = []
    for dname in args.dtypes.split(","):
        for e in map(int, args.head_dims.split(",")):
            for seq in map(int, args.seqs.split(",")):
                b, h = max(1, args.tokens // seq), 2048 // e
                q, k, v, do = (torch.randn(b, h, seq, e, device="cuda", dtype=DTYPES[dname]) for _ in range(4))
                scale = e ** -0.5
                out, lse, resid, rows = _forward(q, k, v, True, 0, scale, -1, -1)
                k_hat = key_mean(k)
                cell = dict(dtype=dname, head_dim=e, seq=seq, batch=b, heads=h)
                for name, mean_key in (("centred", k_hat), ("plain", None)):
                    def run(mean_key=mean_key):
                        hopper_attention_backward(do, q, k, v, out, lse, None, scale=scale, is_causal=True,
                                                  exact_delta=(resid, rows), mean_key=mean_key)
                    heat(run, 200, synchronize=torch.cuda.synchronize)
                    times = kernel_times_us(run, args.calls, "cuda")
                    cell[f"{name}_us"] = next(us for kname, us in times.items() if "_attn_bwd_hopper" in kname)
                cell["centred_over_plain"] = cell["centred_us"] / cell["plain_us"]
                records.append(cell)
                print(" ".join(f"{key} {val:.3f}" if isinstance(val, float) else f"{key} {val}"
                               for key, val in cell.items()), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "centred_dq_cost.json"), "w") as f:
        json.dump(dict(args=vars(args), torch=torch.__version__, records=records), f, indent=1)


if __name__ == "__main__":
    main()
