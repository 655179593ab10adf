"""The CPU reference path's causal forward against its non-causal forward, timed side by side
(alternating, best of N, wall and CPU time): causal must skip the work its mask hides.

    python -m benchmarks.experiments.reference_causal --seq 32768 --heads 2 --reps 2
"""
import argparse
import time

import torch

from flash_inductor.ops import reference


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    if min(args.seq, args.heads, args.head_dim, args.reps, args.threads) < 1:
        p.error("--seq, --heads, --head-dim, --reps and --threads take positive integers")
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, args.heads, args.seq, args.head_dim, generator=gen) for _ in range(3))
    print(f"reference forward, L {args.seq}, H {args.heads}, E {args.head_dim}, fp32, {args.threads} thread(s), "
          f"best of {args.reps}: about {2 * args.reps * args.seq ** 2 * args.heads * args.head_dim * 4 / 3e10:.0f} s",
          flush=True)
    wall, cpu = {}, {}
    for _ in range(args.reps):
        for causal in (False, True):
            w, c = time.perf_counter(), time.process_time()
            reference.reference_forward(q, k, v, None, None, 0.0, causal, 0, args.head_dim ** -0.5)
            wall[causal] = min(wall.get(causal, float("inf")), time.perf_counter() - w)
            cpu[causal] = min(cpu.get(causal, float("inf")), time.process_time() - c)
    print(f"non-causal {wall[False]:.3f} s wall / {cpu[False]:.3f} s CPU; causal {wall[True]:.3f} s / "
          f"{cpu[True]:.3f} s; causal / non-causal {wall[True] / wall[False]:.2f} wall, {cpu[True] / cpu[False]:.2f} CPU")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
