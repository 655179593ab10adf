"""fp32 launch tiles on the GPU: the Hopper heuristic's against the alternatives, the tiles it replaced included.

    python -m benchmarks.experiments.fp32_tiles --workers 14             # GPU: one device call
    TRITON_INTERPRET=1 python -m benchmarks.experiments.fp32_tiles --quick --device cpu   # smoke run

Compiled for sm_90 on a CPU (``python -m tools.compile_survey --dtypes fp32 --loops``), the fp32 tiles
the heuristic gave Hopper until 2026-12-04 (64x32/w4/s2, 32x64/w4/s1, 64x32/w4/s1, which other GPUs
keep) spilled: at E 128 the forward, dK/dV and dQ kernels kept 32 registers a thread and 6-19 KB of
stack, and the dK/dV pass took 30-41 s to compile. ``cuda_heuristic_configs`` now gives Hopper tiles
whose loops keep no local memory, chosen by their compiled instruction counts
(``benchmarks/results/compile_survey_cpu_20261204.json``). This times both on the GPU.

For each head dim and mask (fp32, B x H x L = 2 x 8 x 2048 by default) and each pass, every
candidate tile replaces that pass's heuristic one (the other passes keep theirs). Per candidate:

* ``compile_s``: the first call's wall time in a worker whose Triton cache is fresh for that tile
  (the heuristic kernels compiled before it), i.e. what a user waits for on a first fp32 call;
* ``kernels``: the registers, spills and shared memory of the kernel variants that call compiled;
* ``us``: that pass's kernel time from the profiler, the mean of ``--calls`` calls, compiled
  (loaded from the cache the workers filled), and ``total_us`` for the whole call;
* ``err``: the relative L2 error against a float64 run of the same inputs (the output for the
  forward, the worst of dq/dk/dv for a backward pass), and ``err_vs_heuristic``, its ratio to the
  heuristic tile's: a tile only reorders fp32 sums, so a ratio far from 1 flags a miscompile.

The workers compile in parallel (ptxas is single-threaded); the timings run afterwards in this
process alone. Writes ``fp32_tiles_<gpu>_<date>[_<tag>].json``.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import multiprocessing
import os
import sys
import tempfile
import time

import torch

from benchmarks.backward_breakdown import parse_config  # labels as 64x32/w4/s2
from benchmarks.common import add_output_args, environment, module_command, progress, write_record
from benchmarks.kernel_time import kernel_times_us

from flash_inductor import launch
from flash_inductor.tuning.configs import AttentionConfigs, cuda_heuristic_configs

# Candidates per pass beside the heuristic (block_m x block_n / warps / stages): first the tile the
# heuristic gave Hopper before 2026-12-04 (still other GPUs'), then tiles the CPU compile found
# without spills, or almost none, at E 64 or 128 (compile_survey_cpu_20261204.json).
CANDIDATES = {
    "forward": ("64x32/w4/s2", "32x64/w8/s2", "64x32/w8/s2", "16x64/w4/s2", "32x32/w4/s2"),
    "backward_dkdv": ("32x64/w4/s1", "16x32/w8/s1", "32x64/w8/s1", "16x64/w8/s1", "16x32/w4/s1"),
    "backward_dq": ("64x32/w4/s1", "32x32/w8/s1", "64x32/w8/s1", "16x64/w4/s1", "32x32/w4/s1"),
}
ROLE_KERNEL = {"forward": "_attn_fwd", "backward_dkdv": "_attn_bwd_dkdv", "backward_dq": "_attn_bwd_dq"}
SCHEDULE = "stable"


def heuristic(head_dim: int) -> AttentionConfigs:
    """The Hopper fp32 heuristic, as a CUDA call on an H200 gets it without a table entry."""
    return cuda_heuristic_configs((9, 0), 4, head_dim, head_dim, SCHEDULE, "none")


def former(head_dim: int) -> AttentionConfigs:
    """The tiles Hopper ran for fp32 before 2026-12-04, which other GPUs still get."""
    return cuda_heuristic_configs((8, 0), 4, head_dim, head_dim, SCHEDULE, "none")


def plan(head_dims, causal_flags) -> list[dict]:
    """One item per (shape, pass, tile): the heuristic's tile first in each pass, then the former one
    (``former``: True), then the other candidates."""
    items = []
    for head_dim in head_dims:
        base, before = heuristic(head_dim), former(head_dim)
        for causal in causal_flags:
            for role, labels in CANDIDATES.items():
                default, replaced = getattr(base, role).label(), getattr(before, role).label()
                for label in dict.fromkeys((default, replaced, *labels)):
                    items.append(dict(head_dim=head_dim, causal=causal, role=role, config=label,
                                      heuristic=label == default, former=label == replaced))
    return items


class Case:
    """Seeded fp32 inputs of one shape, the launches with a chosen tile, and a float64 reference."""

    def __init__(self, head_dim: int, causal: bool, args):
        gen = torch.Generator(device=args.device).manual_seed(1000 + head_dim + int(causal))
        shape = (args.batch, args.heads, args.seq, head_dim)
        self.q, self.k, self.v, self.dout = (torch.randn(shape, generator=gen, device=args.device)
                                             for _ in range(4))
        self.head_dim, self.causal, self.scale = head_dim, causal, head_dim ** -0.5
        self.visibility = launch.Visibility(is_causal=causal)
        self._reference = None

    def configs(self, role=None, label=None) -> AttentionConfigs:
        base = heuristic(self.head_dim)
        return dataclasses.replace(base, **{role: parse_config(label)}) if role else base

    def forward(self, configs):
        return launch.attention_forward(self.q, self.k, self.v, None, None, 0.0, self.scale, SCHEDULE,
                                        visibility=self.visibility, configs=configs)

    def backward(self, configs, out, lse):
        return launch.attention_backward(self.dout, self.q, self.k, self.v, None, out, lse, None, None, 0.0,
                                         self.scale, SCHEDULE, False, visibility=self.visibility,
                                         configs=configs)[:3]

    def run(self, role, configs):
        """The call an item times: the forward for the forward's tile, else a backward after a
        heuristic forward. Returns the tensors its error is measured on."""
        if role == "forward":
            return [self.forward(configs)[0]]
        out, lse = self.forward(self.configs())
        return list(self.backward(configs, out, lse))

    def reference(self):
        """(out, dq, dk, dv) of the same inputs in float64."""
        if self._reference is None:
            q, k, v = (t.double().requires_grad_() for t in (self.q, self.k, self.v))
            scores = (q @ k.transpose(-1, -2)) * self.scale
            if self.causal:
                keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
                scores = scores.masked_fill(~keep, float("-inf"))
            out = scores.softmax(-1) @ v
            grads = torch.autograd.grad(out, (q, k, v), self.dout.double())
            self._reference = [out.detach(), *grads]
        return self._reference

    def error(self, role, results) -> float:
        ref = self.reference()
        ref = ref[:1] if role == "forward" else ref[1:]
        return max(float(torch.linalg.vector_norm(r.double() - t) / torch.linalg.vector_norm(t).clamp_min(1e-300))
                   for r, t in zip(results, ref))


def _variants(role) -> dict:
    """id -> (kernel name, compiled kernel) of every compiled variant of the kernels a role launches."""
    from flash_inductor.kernels import attn_bwd, attn_fwd

    kernels = [attn_fwd._attn_fwd] if role == "forward" else [
        getattr(attn_bwd, name) for name in ("_attn_bwd_dkdv", "_attn_bwd_dq", "_attn_bwd_preprocess",
                                             "_attn_bwd_row_reference") if hasattr(attn_bwd, name)]
    found = {}
    for kernel in kernels:
        for caches in getattr(kernel, "device_caches", {}).values():
            cache = caches[0] if isinstance(caches, tuple) else caches
            for compiled in getattr(cache, "values", lambda: [])():
                found[id(compiled)] = (kernel.fn.__name__ if hasattr(kernel, "fn") else str(kernel), compiled)
    return found


def _synchronize(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def compile_item(item: dict, args) -> dict:
    """Worker: compile the heuristic kernels of the item's shape (untimed), then time the item's
    first call, which compiles its tile, and report what that compiled."""
    case = Case(item["head_dim"], item["causal"], args)
    row = dict(item)
    try:
        case.run(item["role"], case.configs())
        _synchronize(args.device)
        before = _variants(item["role"])
        started = time.perf_counter()
        case.run(item["role"], case.configs(item["role"], item["config"]))
        _synchronize(args.device)
        row["compile_s"] = round(time.perf_counter() - started, 2)
        row["kernels"] = [dict(kernel=name, n_regs=getattr(c, "n_regs", None), n_spills=getattr(c, "n_spills", None),
                               shared=getattr(getattr(c, "metadata", None), "shared", None))
                          for key, (name, c) in _variants(item["role"]).items() if key not in before]
    except Exception as exc:  # out of shared memory, say: recorded, not fatal
        row["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"
    return row


def compile_all(items, args) -> list[dict]:
    """compile_item over ``items`` in ``args.workers`` spawned processes (in this one with 0)."""
    if args.workers <= 0:
        return [compile_item(item, args) for item in progress(items, "compile")]
    context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
    with concurrent.futures.ProcessPoolExecutor(args.workers, mp_context=context) as pool:
        futures = [pool.submit(compile_item, item, args) for item in items]
        for _ in progress(concurrent.futures.as_completed(futures), "compile", total=len(futures)):
            pass
        return [f.result() for f in futures]


def time_item(row: dict, cases: dict, args) -> dict:
    """This process: the item's kernel time (from the cache the workers filled) and its error."""
    if "error" in row:
        return row
    case = cases[(row["head_dim"], row["causal"])]
    configs = case.configs(row["role"], row["config"])
    try:
        row["err"] = case.error(row["role"], case.run(row["role"], configs))
        times = kernel_times_us(lambda: case.run(row["role"], configs), args.calls, args.device)
        if row["role"] != "forward":  # the heuristic forward ran too: leave it out of the total
            times = {k: v for k, v in times.items() if "_attn_fwd" not in k}
        row["total_us"] = sum(times.values()) or None
        row["us"] = sum(v for k, v in times.items() if ROLE_KERNEL[row["role"]] in k) or None
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return row


def summarise(rows) -> list[str]:
    """One line per item, with its time against its pass's heuristic tile at the same shape."""
    base = {(r["head_dim"], r["causal"], r["role"]): r for r in rows if r["heuristic"]}
    lines = []
    for r in rows:
        b = base.get((r["head_dim"], r["causal"], r["role"]), {})
        if "error" in r:
            lines.append(f"E{r['head_dim']:<3} causal={r['causal']!s:5} {r['role']:13s} {r['config']:12s} {r['error']}")
            continue
        if r.get("err") is not None and b.get("err"):
            r["err_vs_heuristic"] = r["err"] / b["err"]
        speed = f"{b['us'] / r['us']:5.2f}x" if r.get("us") and b.get("us") else "    -"
        spills = max((k["n_spills"] or 0 for k in r.get("kernels", [])), default=None)
        regs = max((k["n_regs"] or 0 for k in r.get("kernels", [])), default=None)
        lines.append(f"E{r['head_dim']:<3} causal={r['causal']!s:5} {r['role']:13s} {r['config']:12s} "
                     f"{'*' if r['heuristic'] else '^' if r.get('former') else ' '} us {r.get('us') or 0:9.1f}  speed vs heuristic {speed}  "
                     f"compile {r.get('compile_s', 0):6.1f} s  regs {regs} spills {spills}  "
                     f"err {r.get('err', float('nan')):.1e} ({r.get('err_vs_heuristic', float('nan')):.2f}x)")
    return lines


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--head-dims", default="64,128,256")
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--calls", type=int, default=10, help="calls profiled per timing")
    p.add_argument("--workers", type=int, default=14, help="compiling processes (0: compile in this one)")
    p.add_argument("--keep-cache", action="store_true",
                   help="use the Triton cache as it is, rather than a fresh one (compile_s is then not cold)")
    p.add_argument("--quick", action="store_true", help="B=1, H=2, L=S=64, E=32, non-causal: a smoke run")
    add_output_args(p)
    args = p.parse_args(argv)
    args.head_dims = [int(x) for x in args.head_dims.split(",") if x]
    if args.quick:
        args.batch, args.heads, args.seq, args.head_dims, args.causal, args.calls = 1, 2, 64, [32], "no", 2
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.keep_cache:  # the workers inherit it, so each compile is cold and the timing run hits
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="fp32_tiles_triton_")
    causal_flags = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    items = plan(args.head_dims, causal_flags)
    print(f"{len(items)} tiles over E {args.head_dims} x causal {causal_flags}, fp32, "
          f"B={args.batch} H={args.heads} L=S={args.seq}, {args.workers} workers", flush=True)
    started = time.perf_counter()
    rows = compile_all(items, args)
    compile_wall = time.perf_counter() - started
    cases = {(e, c): Case(e, c, args) for e in args.head_dims for c in causal_flags}
    rows = [time_item(row, cases, args) for row in progress(rows, "time")]
    lines = summarise(rows)
    print("\n".join(lines))
    print(f"compile phase {compile_wall:.0f} s wall; * = the heuristic's tile, ^ = the tile it replaced")
    if not args.no_write:
        env = environment(module_command("benchmarks.experiments.fp32_tiles", argv))
        payload = dict(batch=args.batch, heads=args.heads, seq=args.seq, calls=args.calls, workers=args.workers,
                       compile_wall_s=round(compile_wall, 1), rows=rows)
        write_record(args.out, "fp32_tiles", env, payload, args.tag, args.device)
    failed = [r for r in rows if "error" in r and r["heuristic"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
