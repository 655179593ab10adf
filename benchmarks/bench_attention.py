#!/usr/bin/env python
"""Attention throughput: flash_inductor against SDPA's backends and FlexAttention, in one run.

Shapes follow shared/ANCHORS.md: batch * seq = --tokens, heads = 2048 / E, L = S = seq.
Each figure is the median of ``triton.testing.do_bench``; FLOPs are 4*B*H*L*S*E, x0.5 when
causal, and backward / forward+backward count 2.5x / 3.5x the forward.

    python -m benchmarks.bench_attention --quick          # first speed figure, < 2 min on an H200
    python -m benchmarks.bench_attention                  # full grid, all providers
    python -m benchmarks.bench_attention --memory --e2e   # plus peak memory and a GPT block
    python -m benchmarks.bench_attention --selftest       # no GPU: writer, table and plot on fake data

Run it from the repository root: it times the ``flash_inductor`` of the tree it is run from.

Long grids: --time-budget stops starting cases after that many seconds and writes what it has
(the rest are recorded as skipped); every finished record is also appended to <stem>.partial.jsonl
as it lands, so a run killed from outside still leaves its measurements. --resume FILE... skips
the cells those files measured; plot_results.py merges the files afterwards. --precompile N first
builds every kernel the grid needs in N worker processes (benchmarks.precompile), so the timed
run loads the kernels from the shared caches instead of compiling them cell by cell.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import importlib
import json
import math
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from benchmarks import precompile
from benchmarks.common import (DTYPES, GPTBlock, append_records, attention_flops, bench_ms, call_recorded,
                               dynamo_limits, environment, first_line, flash_inductor_backend, heat, is_fatal,
                               make_attention, make_inputs, make_step, module_command, no_donated_buffers,
                               output_stem, peak_bytes_above_live, progress, release_memory, tflops)
from benchmarks.gpu_telemetry import GpuTelemetry
from benchmarks.kernel_time import gpu_busy
from benchmarks.plot_results import (MODES, PROVIDERS as ALL_PROVIDERS, format_extras, format_table,
                                     plot_kernel_time, plot_results, target_report)

MATH_MAX_SEQ = 4096  # the math backend materialises B*H*L*S scores; beyond this it only measures memory traffic
HIDDEN = 2048  # heads * head_dim, as in ANCHORS.md
MEMORY_SEQS, MEMORY_HEADS, MEMORY_E = (16384, 32768), 16, 128
CSV_FIELDS = ("section", "provider", "dtype", "head_dim", "causal", "seq", "batch", "heads", "mode",
              "status", "ms", "tflops", "max_abs_diff", "peak_extra_mib", "workspace_mib", "sm_mhz", "power_w",
              "kernel_ms", "gpu_busy", "error")
KERNEL_TIME_CALLS = 10  # back-to-back steps profiled per cell with --kernel-time


# ----------------------------------------------------------------------------- CLI

def _csv_list(kind):
    return lambda s: [kind(x) for x in s.split(",") if x]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", type=_csv_list(str), default=["bf16", "fp16"], help="comma list of bf16,fp16,fp32")
    p.add_argument("--head-dims", type=_csv_list(int), default=[64, 128])
    p.add_argument("--seqs", type=_csv_list(int), default=[512, 1024, 2048, 4096, 8192, 16384, 32768])
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    p.add_argument("--modes", type=_csv_list(str), default=list(MODES), help="comma list of infer,fwd,bwd,fwd_bwd (infer: under torch.no_grad())")
    p.add_argument("--providers", type=_csv_list(str), default=list(ALL_PROVIDERS),
                   help="comma list of " + ",".join(ALL_PROVIDERS))
    p.add_argument("--tokens", type=int, default=16384, help="batch * seq (default 16384)")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warmup, ms")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms")
    p.add_argument("--heat-ms", type=int, default=1000,
                   help="run each step this long before timing it, so every provider is timed at the card's "
                        "sustained, power-limited clock rather than one set by what ran before (0: off)")
    p.add_argument("--kernel-time", action="store_true",
                   help="also profile each step's kernels: kernel_ms per call and gpu_busy, the share of a "
                        "back-to-back loop's GPU span kernels fill (well below 1: the GPU waited between launches)")
    p.add_argument("--out", default=os.path.join("benchmarks", "results"), help="output folder")
    p.add_argument("--tag", default=None, help="suffix of the output names (default 'quick' with --quick)")
    p.add_argument("--quick", action="store_true",
                   help="first speed figure: bf16, E=128, causal yes/no, seq 4096, fwd+fwd_bwd, ours/flash/cudnn/flex")
    p.add_argument("--memory", action="store_true", help="also peak extra memory of fwd+bwd at seq 16k and 32k")
    p.add_argument("--e2e", action="store_true", help="also a GPT-style block training step")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds: start no case after this; the rest are recorded as skipped")
    p.add_argument("--resume", nargs="+", default=[], metavar="RESULTS",
                   help="bench_*.json or .partial.jsonl files: skip the cells they measured")
    p.add_argument("--precompile", type=int, default=0, metavar="N",
                   help="first compile the grid's kernels (ours*, flex) in N worker processes, untimed, so the "
                        "timed run loads them from the on-disk caches; the time counts against --time-budget "
                        "(0: off; benchmarks.precompile)")
    p.add_argument("--dry-run", action="store_true", help="import everything, print the grid, run nothing")
    p.add_argument("--selftest", action="store_true", help="exercise table/CSV/JSON/plot on synthetic records")
    args = p.parse_args(argv)
    if args.quick:
        args.dtypes, args.head_dims, args.seqs, args.causal = ["bf16"], [128], [4096], "both"
        args.modes, args.providers = ["fwd", "fwd_bwd"], ["ours", "flash", "cudnn", "flex"]
        args.tag = args.tag or "quick"
    for name, values, allowed in (("--dtypes", args.dtypes, DTYPES), ("--modes", args.modes, MODES),
                                  ("--providers", args.providers, ALL_PROVIDERS)):
        bad = [v for v in values if v not in allowed]
        if bad:
            p.error(f"{name}: unknown {bad}; choose from {','.join(allowed)}")
    bad_e = [e for e in args.head_dims if HIDDEN % e]
    if bad_e:
        p.error(f"--head-dims: {bad_e} do not divide {HIDDEN} (heads = {HIDDEN} / E)")
    return args


def causal_flags(choice):
    return {"both": [False, True], "yes": [True], "no": [False]}[choice]


def build_grid(args):
    """One case per (dtype, E, causal, seq, mode); providers run inside a case."""
    return [dict(dtype=d, head_dim=e, causal=c, seq=s, mode=m)
            for d in args.dtypes for e in args.head_dims for c in causal_flags(args.causal)
            for s in args.seqs for m in args.modes]


# ----------------------------------------------------------------------------- measurements

def cell_shape(case, tokens):
    """(batch, heads) of a cell: batch * seq = tokens, heads * E = HIDDEN, as in ANCHORS.md."""
    return max(1, tokens // case["seq"]), HIDDEN // case["head_dim"]


def run_case(case, provider, args, device="cuda", telemetry=None):
    dtype, e, causal, seq, mode = (case[k] for k in ("dtype", "head_dim", "causal", "seq", "mode"))
    batch, heads = cell_shape(case, args.tokens)
    rec = dict(section="attention", provider=provider, batch=batch, heads=heads, **case)
    if provider == "math" and seq > MATH_MAX_SEQ:
        return dict(rec, status="skipped", error=f"math backend only up to seq {MATH_MAX_SEQ}")
    try:
        q, k, v, dout = make_inputs(batch, heads, seq, e, DTYPES[dtype], device)
        attn = make_attention(provider, causal, seq, seq, device)
        first_call = time.monotonic()
        out = call_recorded(lambda: attn(q, k, v))  # compiles, and surfaces unsupported shapes
        if mode in ("fwd", "infer"):
            ref = F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), is_causal=causal)
            rec["max_abs_diff"] = (out.detach().float() - ref.float()).abs().max().item()
        del out
        step = make_step(attn, mode, q, k, v, dout)
        step()
        rec["first_call_s"] = round(time.monotonic() - first_call, 3)  # compile time: did --precompile warm it?
        heat(step, args.heat_ms)
        started = time.monotonic()
        ms = bench_ms(step, args.warmup, args.rep)
        if telemetry is not None:
            rec.update(telemetry.window(started, time.monotonic()))
        if args.kernel_time:
            rec.update(gpu_busy(step, KERNEL_TIME_CALLS, device))
        flops = attention_flops(batch, heads, seq, seq, e, causal, mode)
        return dict(rec, status="ok", ms=ms, tflops=tflops(flops, ms))
    except Exception as exc:
        return dict(rec, status="unsupported", error=first_line(exc))
    finally:
        release_memory()


def run_memory(provider, dtype, causal, seq, device="cuda"):
    """Peak allocation of one fwd+bwd above the live inputs (q, k, v, dout), after a warm run."""
    rec = dict(section="memory", provider=provider, dtype=dtype, head_dim=MEMORY_E, causal=causal, seq=seq,
               batch=1, heads=MEMORY_HEADS, mode="fwd_bwd")
    if provider == "math" and seq > MATH_MAX_SEQ:
        return dict(rec, status="skipped", error=f"math backend only up to seq {MATH_MAX_SEQ}")
    try:
        q, k, v, dout = make_inputs(1, MEMORY_HEADS, seq, MEMORY_E, DTYPES[dtype], device)
        attn = make_attention(provider, causal, seq, seq, device)
        step = lambda: torch.autograd.grad(attn(q, k, v), (q, k, v), dout)  # noqa: E731
        call_recorded(step)  # warm: compile and autotune outside the measurement; result freed at once
        peak = peak_bytes_above_live(step)
        unavoidable = 4 * q.numel() * q.element_size()  # out, dq, dk, dv
        mib = 2.0 ** 20
        return dict(rec, status="ok", peak_extra_mib=peak / mib, workspace_mib=(peak - unavoidable) / mib)
    except Exception as exc:
        return dict(rec, status="unsupported", error=first_line(exc))
    finally:
        release_memory()


def run_e2e(args, device="cuda", batch=8, seq=2048, d_model=1024, n_head=16):
    torch.manual_seed(0)
    model = GPTBlock(d_model, n_head, seq).to(device=device, dtype=torch.bfloat16)
    x = torch.randn(batch, seq, d_model, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    params = [x, *model.parameters()]
    with torch.no_grad():
        ref = model(x).float()
    variants = {"eager": lambda: model, "compile": lambda: torch.compile(model)}
    fi_backend = flash_inductor_backend()
    variants["flash_inductor"] = (lambda: torch.compile(model, backend=fi_backend)) if fi_backend else None
    records = []
    for name, build in variants.items():
        rec = dict(section="e2e", provider=name, dtype="bf16", head_dim=d_model // n_head, causal=True, seq=seq,
                   batch=batch, heads=n_head, mode="fwd_bwd")
        if build is None:
            records.append(dict(rec, status="unavailable", error="flash_inductor.backend is not available"))
            continue
        try:
            torch._dynamo.reset()
            fn = build()
            step = lambda: fn(x).backward(dy)  # noqa: E731
            y = call_recorded(lambda: fn(x))  # compiles the training graph
            y.backward(dy)
            diff = float((y.detach().float() - ref).abs().max())
            del y
            for t in params:
                t.grad = None
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - before) / 2.0 ** 20
            heat(step, args.heat_ms)
            ms = bench_ms(step, args.warmup, args.rep, grad_to_none=params)
            records.append(dict(rec, status="ok", ms=ms, max_abs_diff=diff, peak_extra_mib=peak))
        except Exception as exc:
            records.append(dict(rec, status="unsupported", error=first_line(exc)))
    return records


# ----------------------------------------------------------------------------- output, driver

def write_results(stem, env, records):
    """<stem>.json: {"header": env, "results": [...]}; <stem>.csv: '# key: value' header lines, then rows."""
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    with open(stem + ".json", "w") as f:
        json.dump({"header": env, "results": records}, f, indent=1)
    with open(stem + ".csv", "w", newline="") as f:
        for key, value in env.items():
            f.write(f"# {key}: {value}\n")
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(records)
    return [stem + ".json", stem + ".csv"]


def load_records(path):
    """Records of a bench_*.json file or of a .partial.jsonl (one record per line)."""
    with open(path) as f:
        if path.endswith(".jsonl"):
            return [json.loads(line) for line in f if line.strip()]
        return json.load(f)["results"]


def measured_cells(paths):
    """(provider, dtype, E, causal, seq, mode) of every attention record measured in these files."""
    done = set()
    for path in paths:
        done |= {(r["provider"], r["dtype"], r["head_dim"], r["causal"], r["seq"], r["mode"])
                 for r in load_records(path) if r["section"] == "attention" and r["status"] == "ok"}
    return done


def run_all(args, partial_path=None, clock=time.monotonic, telemetry=None):
    """Measure the grid (then memory and e2e when asked). Each finished attention record is appended to
    ``partial_path`` as JSON lines; cases left when --time-budget runs out are recorded as skipped.
    With a ``GpuTelemetry``, each timing's record gets the SM clock and power sampled while it ran."""
    records = []
    done = measured_cells(args.resume)
    grid = [(c, p) for c in build_grid(args) for p in args.providers
            if (p, c["dtype"], c["head_dim"], c["causal"], c["seq"], c["mode"]) not in done]
    if done:
        print(f"--resume: {len(done)} cells already measured, {len(grid)} to run", file=sys.stderr)
    deadline = None if args.time_budget is None else clock() + args.time_budget
    if args.precompile > 0 and grid:
        items = precompile.plan(grid, lambda case: cell_shape(case, args.tokens))
        print(precompile.describe(precompile.warm(items, args.precompile, deadline=deadline, clock=clock)),
              file=sys.stderr, flush=True)
    with dynamo_limits():
        with no_donated_buffers():
            for case, provider in progress(grid, "attention"):
                if deadline is not None and clock() > deadline:
                    records.append(dict(section="attention", provider=provider, status="skipped",
                                        error="--time-budget spent", **case))
                    continue
                records.append(run_case(case, provider, args, telemetry=telemetry))
                append_records(partial_path, records[-1:])
                if is_fatal(records[-1]):
                    print(f"\nstopping: {records[-1]['error']}; results so far are written", file=sys.stderr)
                    return records
        if args.memory:
            torch._dynamo.reset()  # recompile FlexAttention with buffer donation, as a user would get it
            mem = [(p, c, s) for p in args.providers for c in causal_flags(args.causal) for s in MEMORY_SEQS]
            for provider, causal, seq in progress(mem, "memory"):
                records.append(run_memory(provider, args.dtypes[0], causal, seq))
        if args.e2e:
            records.extend(run_e2e(args))
    return records


def finish(records, env, args):
    print(format_table(records))
    extras = format_extras(records)
    if extras:
        print(extras)
    print("\n".join(target_report(records)[1]))
    for line in (clock_summary(records), busy_summary(records), *kernel_time_summary(records)):
        if line:
            print(line)
    stem = output_stem(args.out, env, args.tag)
    files = write_results(stem, env, records)
    if not args.no_plot:
        title = f"{env['gpu']}  torch {env['torch']}  triton {env['triton']}  {env['date']}"
        try:
            png = plot_results(records, files[0][:-len(".json")] + ".png", title)
            files += [png] if png else []
            kernel_png = plot_kernel_time(records, files[0][:-len(".json")] + "_kernel-time.png", title)
            files += [kernel_png] if kernel_png else []
        except ImportError as exc:
            print(f"no plot ({exc}); redraw later with python -m benchmarks.plot_results", file=sys.stderr)
    print("wrote " + ", ".join(files))
    return files


def clock_summary(records):
    """One line: each provider's median SM clock and power over its timed attention cells (empty
    without telemetry). Providers timed at different clocks are not compared like for like."""
    parts = []
    for provider in ALL_PROVIDERS:
        rows = [r for r in records if r.get("section") == "attention" and r.get("provider") == provider
                and r.get("sm_mhz") is not None]
        if rows:
            mhz = sorted(r["sm_mhz"] for r in rows)[len(rows) // 2]
            watts = sorted(r["power_w"] for r in rows)[len(rows) // 2]
            parts.append(f"{provider} {mhz:.0f} MHz / {watts:.0f} W")
    return "SM clock / power while timed (median of cells): " + ", ".join(parts) if parts else ""


BUSY_FLOOR = 0.9  # below this share of the GPU span in kernels, a cell's time includes idle GPU


def busy_summary(records):
    """One line (empty without --kernel-time): per provider, the cells whose GPU sat idle between
    launches for more than a tenth of a back-to-back loop, with their busy share. Their ``ms`` is
    then partly host time, not the kernels'."""
    parts = []
    for provider in ALL_PROVIDERS:
        rows = [r for r in records if r.get("section") == "attention" and r.get("provider") == provider
                and r.get("gpu_busy") is not None]
        idle = [r for r in rows if r["gpu_busy"] < BUSY_FLOOR]
        if rows:
            cells = ", ".join(f"{r['dtype']} E{r['head_dim']} {'causal' if r['causal'] else 'full'} {r['seq']} "
                              f"{r['mode']} {r['gpu_busy']:.2f}" for r in idle[:6])
            parts.append(f"{provider} {len(idle)}/{len(rows)}" + (f" ({cells}{', ...' if len(idle) > 6 else ''})"
                                                                  if idle else ""))
    return f"cells with the GPU busy < {BUSY_FLOOR:.0%} of a back-to-back loop: " + "; ".join(parts) if parts else ""


def kernel_time_summary(records, ours="ours"):
    """Lines (none without --kernel-time): per anchor and mode, the cells where ours' kernels alone
    (``kernel_ms``) take no longer than the anchor's, with the median ratio of the anchor's kernel
    time to ours. Read beside the timed ratios: a cell lost on ``ms`` but won here lost on host
    time (the GPU waited for Python), not on the kernels."""
    times = {(r["provider"], r["dtype"], r["head_dim"], r["causal"], r["seq"], r["mode"]): r["kernel_ms"]
             for r in records if r.get("section") == "attention" and r.get("kernel_ms")}
    lines = []
    for anchor in ALL_PROVIDERS:
        if anchor == ours:
            continue
        for mode in MODES:
            ratios = [times[(anchor, *cell)] / mine for (provider, *cell), mine in times.items()
                      if provider == ours and cell[-1] == mode and (anchor, *cell) in times]
            if ratios:
                won = sum(ratio >= 1.0 for ratio in ratios)
                lines.append(f"{ours}/{anchor} {mode} by kernel time alone: {won}/{len(ratios)} cells >= 1.0, "
                             f"median {statistics.median(ratios):.3f}")
    return lines


def dry_run(args):
    checks = {"triton": lambda: __import__("triton").__version__,
              "triton.testing.do_bench": lambda: __import__("triton.testing").testing.do_bench,
              "matplotlib": lambda: __import__("matplotlib").__version__,
              "tqdm (optional)": lambda: __import__("tqdm").__version__,
              "flex_attention": lambda: importlib.import_module("torch.nn.attention.flex_attention").flex_attention,
              "sdpa_kernel": lambda: __import__("torch.nn.attention").nn.attention.sdpa_kernel,
              "flash_inductor.flash_attention": lambda: importlib.import_module("flash_inductor").flash_attention,
              "flash_inductor.backend (optional)": lambda: flash_inductor_backend() or "absent"}
    failed = 0
    for name, check in checks.items():
        try:
            print(f"  ok      {name}: {check()!r:.80}")
        except Exception as exc:
            failed += "optional" not in name
            print(f"  FAILED  {name}: {first_line(exc)}")
    grid = build_grid(args)
    print(f"{len(grid)} cases x {len(args.providers)} providers ({','.join(args.providers)}); "
          f"batch = {args.tokens} // seq, heads = {HIDDEN} // E")
    for case in grid:
        print("  ", case)
    return 1 if failed else 0


def synthetic_records(args):
    """Plausible fake results (and every failure status) for --selftest."""
    records, speed = [], {"ours": 1.1, "ours-compiled": 1.12, "ours-fast": 1.2, "ours-fp8": 1.6, "flash": 0.55, "cudnn": 0.95,
                          "efficient": 0.3, "flex": 0.8, "math": 0.1}
    for case in build_grid(args):
        for p in args.providers:
            rec = dict(section="attention", provider=p, batch=args.tokens // case["seq"],
                       heads=HIDDEN // case["head_dim"], **case)
            if p == "math" and case["seq"] > MATH_MAX_SEQ:
                records.append(dict(rec, status="skipped", error="math backend only up to seq 4096"))
            elif p == "flash" and case["dtype"] == "fp32":
                records.append(dict(rec, status="unsupported", error="RuntimeError: No available kernel."))
            else:
                tf = 500 * speed[p] * (1 - 0.5 / math.log2(case["seq"]))
                ms = attention_flops(rec["batch"], rec["heads"], case["seq"], case["seq"], case["head_dim"],
                                     case["causal"], case["mode"]) / (tf * 1e12) * 1e3
                records.append(dict(rec, status="ok", ms=ms, tflops=tf, max_abs_diff=0.0039))
    records.append(dict(section="memory", provider="ours", dtype="bf16", head_dim=128, causal=False, seq=32768,
                        batch=1, heads=16, mode="fwd_bwd", status="ok", peak_extra_mib=514.0, workspace_mib=2.0))
    records += [dict(section="e2e", provider="eager", status="ok", ms=9.0, max_abs_diff=0.0, peak_extra_mib=6000.0),
                dict(section="e2e", provider="flash_inductor", status="unavailable",
                     error="flash_inductor.backend is not available")]
    return records


def selftest(args):
    args.dtypes, args.head_dims, args.seqs, args.modes = ["bf16", "fp32"], [128], [1024, 8192], ["fwd", "fwd_bwd"]
    records = synthetic_records(args)
    env = dict(environment(module_command("benchmarks.bench_attention")), gpu="NVIDIA H200 (synthetic)", compute_capability=[9, 0], sm_count=132)
    with tempfile.TemporaryDirectory() as tmp:
        args.out, args.tag = tmp, "selftest"
        files = finish(records, env, args)
        loaded = json.load(open(files[0]))
        assert loaded["header"]["gpu"] == env["gpu"] and len(loaded["results"]) == len(records)
        with open(files[1]) as f:
            rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
        assert len(rows) == len(records) and set(rows[0]) == set(CSV_FIELDS)
        assert os.path.basename(files[0]).startswith("bench_nvidia-h200-synthetic_")
        assert len(files) == 2 or os.path.getsize(files[2]) > 10_000
    assert abs(attention_flops(1, 1, 2, 2, 1, True, "fwd_bwd") - 4 * 4 * 0.5 * 3.5) < 1e-12
    print("selftest ok")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.selftest:
        return selftest(args)
    if args.dry_run:
        sys.exit(dry_run(args))
    if not torch.cuda.is_available():
        sys.exit("benchmarks.bench_attention needs a CUDA GPU (torch.cuda.is_available() is False); "
                 "use --dry-run or --selftest on a machine without one.")
    env = environment(module_command("benchmarks.bench_attention", argv))
    partial = fresh_partial_path(output_stem(args.out, env, args.tag))
    env["heat_ms"] = args.heat_ms
    with GpuTelemetry() as telemetry:
        env["telemetry"] = "nvidia-smi" if telemetry.available else None
        records = run_all(args, partial_path=partial, telemetry=telemetry)
    finish(records, env, args)
    with contextlib.suppress(FileNotFoundError):  # every record it holds is in the written files now
        os.remove(partial)
    return None


def fresh_partial_path(stem):
    """<stem>.partial.jsonl, or .partial-2.jsonl, ... when an earlier (killed) run left one: that file
    may be what --resume reads, and holds records this run will not rewrite."""
    path, n = stem + ".partial.jsonl", 1
    while os.path.exists(path):
        n += 1
        path = f"{stem}.partial-{n}.jsonl"
    return path


if __name__ == "__main__":
    main()
