#!/usr/bin/env python
"""Compile a benchmark grid's kernels in parallel processes before the grid is timed.

A cold grid spends much of its time compiling: ptxas for every tile config of our kernels, and
Inductor for every FlexAttention shape (compiled with dynamic=False, so once per shape). The timed
run is a single process and compiles each cell in turn while the GPU waits. Here N worker processes
run each compiling cell's step once, sharing the on-disk caches (Triton's and Inductor's), so the
timed run then loads kernels instead of building them. Nothing is timed here. A cell that fails here
fails again in the timed run, which records why.

    python -m benchmarks.bench_attention ... --precompile 14      # the usual way in
    python -m benchmarks.precompile --items I.json --shard 0 --shards 2 --log L.jsonl   # one worker

The workers inherit this process's environment, so they share TRITON_CACHE_DIR and
TORCHINDUCTOR_CACHE_DIR with the timed run that follows. They run from the repository root that
holds this package, so they import the same ``flash_inductor`` as a run started there.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks import common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the tree holding the benchmarks package

# Providers whose first call compiles something; SDPA's backends ship compiled kernels.
COMPILING_PROVIDERS = ("ours", "ours-fast", "ours-fp8", "ours-compiled", "flex")
POLL_SECONDS = 1.0
STOP_GRACE_SECONDS = 10.0  # after SIGTERM, before SIGKILL


def plan(grid, shape_of):
    """The work for a grid of (case, provider) pairs: one item per compiling (provider, shape).

    An item runs forward+backward when any of its cell's modes has a backward: that call compiles the
    forward too, so a separate forward item would compile nothing new. ``shape_of(case)`` gives the
    cell's (batch, heads), as the timed run computes them: the compiled kernels are specialised on
    the shapes, so the warm-up must use the very same ones. Longest sequences come first, so the
    slowest items start early and the workers finish together."""
    needs_backward = {}
    for case, provider in grid:
        if provider not in COMPILING_PROVIDERS:
            continue
        key = (provider, case["dtype"], case["head_dim"], case["causal"], case["seq"])
        needs_backward[key] = needs_backward.get(key, False) or case["mode"] != "fwd"
    items = []
    for (provider, dtype, head_dim, causal, seq), backward in needs_backward.items():
        case = dict(dtype=dtype, head_dim=head_dim, causal=causal, seq=seq)
        batch, heads = shape_of(case)
        items.append(dict(provider=provider, mode="fwd_bwd" if backward else "fwd", batch=batch, heads=heads,
                          **case))
    items.sort(key=lambda it: (-it["seq"], -it["head_dim"], it["provider"], it["dtype"], it["causal"]))
    return items


def shard(items, index, count):
    """Worker ``index``'s share of ``items``: round robin, so each gets long and short items alike."""
    return items[index::count]


# ----------------------------------------------------------------------------- one worker

def compile_item(item, device):
    """Run the item's step once, exactly as bench_attention.run_case's first call does. An item
    that names a ``builder`` module (``e2e_models.precompile_items``) is run by that module's
    ``compile_item``, as its benchmark's first step: the planner names itself, so this worker
    pool imports no benchmark that imports it."""
    import torch

    if item.get("builder"):
        importlib.import_module(item["builder"]).compile_item(item, device)
        return

    q, k, v, dout = common.make_inputs(item["batch"], item["heads"], item["seq"], item["head_dim"],
                                       common.DTYPES[item["dtype"]], device)
    attn = common.make_attention(item["provider"], item["causal"], item["seq"], item["seq"], device)
    step = common.make_step(attn, item["mode"], q, k, v, dout)
    common.call_recorded(step)
    if device == "cuda":
        torch.cuda.synchronize()  # a fault surfaces here, in this item's record, not the next one's


def run_worker(items, log_path, device):
    """Compile each item; append one JSON line per item to ``log_path`` as it finishes."""
    with common.dynamo_limits(), common.no_donated_buffers():
        for item in items:
            started = time.monotonic()
            line = dict(item)
            try:
                compile_item(item, device)
                line["status"] = "ok"
            except Exception as exc:
                line.update(status="error", error=common.first_line(exc))
            finally:
                common.release_memory()
            line["seconds"] = round(time.monotonic() - started, 2)
            with open(log_path, "a") as f:
                f.write(json.dumps(line) + "\n")
            if line["status"] == "error" and common.is_fatal(line):
                return 1  # a CUDA fault poisons this process; the other workers go on
    return 0


# ----------------------------------------------------------------------------- the parent

def _read_lines(path):
    """The complete lines a worker has written so far (a line still being written is left for the
    next poll)."""
    with contextlib.suppress(FileNotFoundError), open(path) as f:
        return [json.loads(x) for x in f if x.endswith("\n") and x.strip()]
    return []


def _stop(procs):
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    end = time.monotonic() + STOP_GRACE_SECONDS
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.0, end - time.monotonic()))
        if proc.poll() is None:
            proc.kill()
            proc.wait()


class _Progress:
    """A tqdm bar over the items when tqdm is installed, a line per 10 % otherwise."""

    def __init__(self, total):
        self.total, self.shown = total, 0
        try:
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc="precompile", unit="cell", dynamic_ncols=True,
                            mininterval=0.1 if sys.stderr.isatty() else 10.0)
        except ImportError:
            self.bar = None

    def update(self, done):
        if self.bar is not None:
            self.bar.update(done - self.shown)
        elif done * 10 // max(1, self.total) > self.shown * 10 // max(1, self.total) or done == self.total:
            print(f"[precompile {done}/{self.total}]", file=sys.stderr, flush=True)
        self.shown = done

    def close(self):
        if self.bar is not None:
            self.bar.close()


def warm(items, workers, *, deadline=None, clock=time.monotonic, device="cuda", python=sys.executable):
    """Compile ``items`` in ``workers`` processes; return a summary dict.

    Stops the workers when ``clock()`` passes ``deadline`` (the timed run then compiles what is left
    itself). The summary has the item count, how many compiled, how many failed with the first few
    errors, whether the deadline stopped it, and the wall time."""
    started = clock()
    summary = dict(items=len(items), workers=0, compiled=0, failed=0, errors=[], stopped=False, seconds=0.0)
    if not items or workers < 1:
        return summary
    count = min(workers, len(items))
    summary["workers"] = count
    with tempfile.TemporaryDirectory(prefix="precompile_") as tmp:
        items_path = os.path.join(tmp, "items.json")
        with open(items_path, "w") as f:
            json.dump(items, f)
        logs = [os.path.join(tmp, f"shard{i}.jsonl") for i in range(count)]
        stderr_paths = [os.path.join(tmp, f"shard{i}.stderr") for i in range(count)]
        procs = []
        for i in range(count):
            with open(stderr_paths[i], "w") as err:
                procs.append(subprocess.Popen(
                    [python, "-m", "benchmarks.precompile", "--items", items_path, "--shard", str(i),
                     "--shards", str(count), "--log", logs[i], "--device", device],
                    cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err))
        bar = _Progress(len(items))
        try:
            while True:
                done = sum(len(_read_lines(p)) for p in logs)
                bar.update(done)
                if all(proc.poll() is not None for proc in procs):
                    break
                if deadline is not None and clock() > deadline:
                    summary["stopped"] = True
                    break
                time.sleep(POLL_SECONDS)
        finally:
            _stop(procs)
            bar.close()
        lines = [x for p in logs for x in _read_lines(p)]
        summary["compiled"] = sum(x["status"] == "ok" for x in lines)
        failed = [x for x in lines if x["status"] != "ok"]
        summary["failed"] = len(failed)
        summary["errors"] = [f"{label(x)}: {x['error']}" for x in failed[:5]]
        for i, proc in enumerate(procs):
            if proc.returncode not in (0, None) and not summary["stopped"]:
                with open(stderr_paths[i]) as f:
                    tail = [x for x in f.read().splitlines() if x.strip()][-1:]
                summary["errors"].append(f"worker {i} exited {proc.returncode}: {' '.join(tail)[:300]}")
    summary["seconds"] = round(clock() - started, 1)
    return summary


def label(item):
    """An item in a line of the log."""
    if item.get("builder"):
        return f"{item['model']} {item['attn']} {item['task']} seq={item['seq']} {item['contender']}"
    return f"{item['provider']} {item['dtype']} E{item['head_dim']} causal={item['causal']} seq={item['seq']}"


def describe(summary):
    """One line for the log."""
    text = (f"precompile: {summary['compiled']} of {summary['items']} cells compiled by {summary['workers']} "
            f"workers in {summary['seconds']} s")
    if summary["failed"]:
        text += f", {summary['failed']} failed (the timed run records why)"
    if summary["stopped"]:
        text += "; stopped at the time budget, the timed run compiles the rest"
    return "\n  ".join([text, *summary["errors"]])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--items", required=True, help="JSON list of items written by warm()")
    p.add_argument("--shard", type=int, required=True, help="this worker's index")
    p.add_argument("--shards", type=int, required=True, help="how many workers share the items")
    p.add_argument("--log", required=True, help="JSON-lines file this worker appends a line per item to")
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    if not 0 <= args.shard < args.shards:
        p.error(f"--shard {args.shard} must be in [0, --shards {args.shards})")
    with open(args.items) as f:
        items = json.load(f)
    return run_worker(shard(items, args.shard, args.shards), args.log, args.device)


if __name__ == "__main__":
    sys.exit(main())
