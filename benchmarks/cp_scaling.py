"""Context-parallel scaling: per-rank memory, step time and the ring's comm/compute overlap
against world size, through ``flash_inductor.distributed.context_parallel_attention``.

One process per GPU, launched by torchrun::

    torchrun --nproc-per-node 8 -m benchmarks.cp_scaling --seq 32768 131072 524288 1048576

Without torchrun's environment it runs at world size 1 (the same code path: one ring step, no
communication) and, with ``--baseline``, also times the plain op on the same tokens: the
distributed path's overhead. Each sequence length is timed three ways, with
``ring_benchmark_mode``: the ring, its compute alone (each step attends to the rank's own K/V
with the plan of the block it would have received: the same calls and FLOPs) and its
communication alone. Then ``exposed comm = t_ring - t_compute`` and
``hidden = 1 - exposed / t_comm``. Times are medians over ``--rep`` steps, the slowest rank's.
Rank 0 writes ``benchmarks/results/cp_scaling_<gpu>_<date>_w<W>.json``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from benchmarks.common import DTYPES, attention_flops, environment, module_command, write_record

MODES = ("ring", "compute_only", "comm_only")


def _init(backend: str | None, device: str) -> tuple[bool, int, int]:
    """(whether this call created the group, rank, world size)."""
    if dist.is_initialized():
        return False, dist.get_rank(), dist.get_world_size()
    backend = backend or ("nccl" if device == "cuda" else "gloo")
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return True, dist.get_rank(), dist.get_world_size()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(step, device: str, warmup: int, rep: int) -> float:
    """Median ms of ``step`` on this rank, ranks aligned by a barrier before each step."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(rep):
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        step()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _slowest(value: float, device: str) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _make_step(fn, inputs, dout, backward: bool):
    def step():
        out = fn(*inputs)
        if backward:
            out.backward(dout)
    return step


def measure(args, seq: int, rank: int, world: int) -> dict:
    from flash_inductor import flash_attention
    from flash_inductor.distributed import SequenceLayout, context_parallel_attention, ring_benchmark_mode

    device, dtype = args.device, DTYPES[args.dtype]
    layout = SequenceLayout(seq, world, args.layout)
    local = layout.local_len(rank)
    g = torch.Generator(device="cpu").manual_seed(1234 + rank)

    def rand(heads, dim):
        return torch.randn((args.batch, heads, local, dim), generator=g, dtype=torch.float32).to(device, dtype)

    backward = args.mode == "fwd_bwd"
    kv_heads = args.kv_heads or args.heads
    q = rand(args.heads, args.head_dim).requires_grad_(backward)
    k = rand(kv_heads, args.head_dim).requires_grad_(backward)
    v = rand(kv_heads, args.head_dim).requires_grad_(backward)
    dout = rand(args.heads, args.head_dim)

    def cp(q, k, v):
        return context_parallel_attention(q, k, v, is_causal=args.causal, layout=args.layout, seq_len=seq,
                                          enable_gqa=kv_heads != args.heads, schedule=args.schedule)

    record = dict(seq=seq, world_size=world, local_tokens=local)
    for mode in MODES:
        if world == 1 and mode == "comm_only":
            continue
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        with ring_benchmark_mode(mode):
            ms = _timed(_make_step(cp, (q, k, v), dout, backward), device, args.warmup, args.rep)
        record[f"{mode}_ms"] = _slowest(ms, device)
        if device == "cuda":
            peak = torch.cuda.max_memory_allocated() / 2**30
            record[f"{mode}_peak_gib"] = _slowest(peak, device)
    if world > 1:
        exposed = max(record["ring_ms"] - record["compute_only_ms"], 0.0)
        record["exposed_comm_ms"] = exposed
        record["hidden_comm_fraction"] = max(0.0, 1.0 - exposed / record["comm_only_ms"]) if record["comm_only_ms"] else None
    if args.baseline and world == 1:
        plain = _make_step(lambda q, k, v: flash_attention(q, k, v, is_causal=args.causal, enable_gqa=kv_heads != args.heads,
                                                           schedule=args.schedule), (q, k, v), dout, backward)
        record["plain_op_ms"] = _timed(plain, device, args.warmup, args.rep)
        record["overhead_vs_plain"] = record["ring_ms"] / record["plain_op_ms"] - 1.0
    flops = attention_flops(args.batch, args.heads, seq, seq, args.head_dim, args.causal, args.mode) / world
    record["tflops_per_rank"] = flops / (record["ring_ms"] * 1e-3) / 1e12
    # Bytes one rank sends per ring step: its K/V block (the forward), plus dK/dV in fp32 (backward).
    kv_bytes = 2 * args.batch * kv_heads * local * args.head_dim * torch.finfo(dtype).bits // 8
    record["kv_bytes_per_step"] = kv_bytes
    record["dkv_bytes_per_step"] = 2 * args.batch * kv_heads * local * args.head_dim * 4 if backward else 0
    return record


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, nargs="+", default=[32768, 131072, 524288, 1048576],
                   help="global sequence lengths (tokens across all ranks)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None, help="GQA: key/value heads (default: --heads)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--layout", choices=("zigzag", "contiguous"), default="zigzag")
    p.add_argument("--mode", choices=("fwd", "fwd_bwd"), default="fwd_bwd")
    p.add_argument("--schedule", default=None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backend", default=None, help="nccl on cuda, gloo on cpu by default")
    p.add_argument("--baseline", action="store_true", help="at world size 1, also time the plain op")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rep", type=int, default=10)
    p.add_argument("--tag", default=None)
    p.add_argument("--out", default=os.path.join("benchmarks", "results"))
    p.add_argument("--no-write", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    created, rank, world = _init(args.backend, args.device)
    records = []
    try:
        for seq in args.seq:
            record = measure(args, seq, rank, world)
            records.append(record)
            if rank == 0:
                print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items()),
                      flush=True)
        if rank == 0 and not args.no_write:
            env = dict(environment(module_command("benchmarks.cp_scaling", argv)), world_size=world,
                       backend=dist.get_backend())
            config = {k: getattr(args, k) for k in ("batch", "heads", "kv_heads", "head_dim", "dtype", "causal",
                                                    "layout", "mode", "schedule", "rep")}
            write_record(args.out, "cp_scaling", env, dict(config=config, records=records),
                         tag=f"w{world}" + (f"_{args.tag}" if args.tag else ""), device=args.device)
    finally:
        if created:
            dist.destroy_process_group()
    return records


if __name__ == "__main__":
    main()
