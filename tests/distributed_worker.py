"""Multi-process runs of ``flash_inductor.distributed`` on CPU with gloo, for tests/unit/test_distributed.py.

One process group per world size runs every case of a list and saves each rank's shards of
out, lse, dq, dk, dv; the test process reassembles and checks them. A case is a dict:

    name, dtype, B, Hq, Hkv, L, E, Ev, causal, layout, mask ("none" | "bool" | "float"), seq_len_arg
    (pass seq_len=), grad_lse, schedule

Inputs come from one seed per case, drawn in full on every rank (so every rank and the test
process see the same tensors) and sharded with ``shard_sequence``.
"""

from __future__ import annotations

import datetime
import os
import time
import traceback

import torch

CASE_DEFAULTS = dict(dtype=torch.float32, B=2, Hq=2, Hkv=2, L=24, E=20, Ev=20, causal=True, layout="zigzag",
                     mask="none", seq_len_arg=False, grad_lse=False, schedule=None, seed=0)


def full_case(case: dict) -> dict:
    return {**CASE_DEFAULTS, **case}


def case_inputs(case: dict) -> dict:
    """Full-sequence q, k, v, dO (and dLSE, the key-padding mask) of a case, in its dtype."""
    c = full_case(case)
    g = torch.Generator().manual_seed(c["seed"])

    def rand(*shape):
        return torch.randn(shape, generator=g, dtype=torch.float64).to(c["dtype"])

    inputs = dict(q=rand(c["B"], c["Hq"], c["L"], c["E"]), k=rand(c["B"], c["Hkv"], c["L"], c["E"]),
                  v=rand(c["B"], c["Hkv"], c["L"], c["Ev"]), dout=rand(c["B"], c["Hq"], c["L"], c["Ev"]))
    inputs["dlse"] = torch.randn((c["B"], c["Hq"], c["L"]), generator=g, dtype=torch.float64).float() \
        if c["grad_lse"] else None
    if c["grad_lse"] and c["dtype"] == torch.float64:
        inputs["dlse"] = inputs["dlse"].double()
    if c["mask"] == "none":
        inputs["mask"] = None
    else:
        padded = torch.rand((c["B"], c["L"]), generator=g) < 0.25
        padded[:, 0] = False  # every row keeps a key (position 0 is visible to every query)
        if c["mask"] == "bool":
            inputs["mask"] = ~padded
        else:
            values = torch.randn((c["B"], c["L"]), generator=g, dtype=torch.float64)
            inputs["mask"] = values.masked_fill(padded, float("-inf")).to(c["dtype"])
    return inputs


def run_case(case: dict, group) -> dict:
    from flash_inductor.distributed import context_parallel_attention, shard_sequence

    c = full_case(case)
    x = case_inputs(c)

    def shard(t, dim=2):
        return shard_sequence(t, dim, layout=c["layout"], group=group)

    q, k, v = (shard(x[n]).requires_grad_() for n in ("q", "k", "v"))
    mask = shard(x["mask"], 1) if x["mask"] is not None else None
    out, lse = context_parallel_attention(
        q, k, v, group=group, is_causal=c["causal"], layout=c["layout"], key_padding_mask=mask,
        seq_len=c["L"] if c["seq_len_arg"] else None, enable_gqa=c["Hq"] != c["Hkv"], schedule=c["schedule"],
        return_lse=True,
    )
    outputs, grads = [out], [shard(x["dout"])]
    if x["dlse"] is not None:
        outputs.append(lse)
        grads.append(shard(x["dlse"]))
    torch.autograd.backward(outputs, grads)
    return dict(out=out.detach(), lse=lse.detach(), dq=q.grad, dk=k.grad, dv=v.grad)


def worker(rank: int, world_size: int, store_path: str, plan: dict, out_dir: str) -> None:
    """``plan`` maps a group (a tuple of global ranks) to its cases; every rank joins every group
    (torch.distributed's rule for new_group) and runs the cases of the groups it belongs to."""
    torch.set_num_threads(1)  # the ranks share the machine's cores
    import torch.distributed as dist

    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    results, errors, timings = {}, {}, {}
    try:
        groups = {ranks: (None if len(ranks) == world_size else dist.new_group(list(ranks))) for ranks in plan}
        for ranks, cases in plan.items():
            if rank not in ranks:
                continue
            group = groups[ranks]
            for case in cases:
                start = time.perf_counter()
                try:
                    results[case["name"]] = dict(run_case(case, group), group_rank=ranks.index(rank))
                except Exception:  # reported per case by the test; the group carries on
                    errors[case["name"]] = traceback.format_exc()
                timings[case["name"]] = time.perf_counter() - start
    finally:
        torch.save(dict(results=results, errors=errors, timings=timings), os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()


def run_world(world_size: int, plan: dict, tmp_dir: str, timeout_s: float = 300.0) -> list[dict]:
    """Spawn ``world_size`` processes running ``plan`` (see ``worker``); each rank's saved dict."""
    import torch.multiprocessing as mp

    store_path = os.path.join(tmp_dir, "store")
    context = mp.start_processes(worker, args=(world_size, store_path, plan, tmp_dir), nprocs=world_size,
                                 join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
            raise TimeoutError(f"world size {world_size}: the ranks did not finish within {timeout_s:.0f} s")
    return [torch.load(os.path.join(tmp_dir, f"rank{r}.pt")) for r in range(world_size)]


def shards_of(runs: list[dict], name: str) -> list[dict]:
    """The results of case ``name``, one dict per rank of its group, in group-rank order."""
    found = [run["results"][name] for run in runs if name in run["results"]]
    errors = [run["errors"][name] for run in runs if name in run["errors"]]
    if errors:
        raise AssertionError(f"case {name} failed on a rank:\n{errors[0]}")
    return sorted(found, key=lambda r: r["group_rank"])
