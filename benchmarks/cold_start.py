"""Cold start: how long a user waits before a model's first step, with empty caches.

Each contender runs in a process of its own with fresh Triton and Inductor cache directories, so
nothing one compiled helps the other (``benchmarks.e2e_models --cold`` runs both in one process,
where the second reuses the first's worker pool and its identical kernels). Per contender:

- ``cold``: the first training step (or inference forward) of the model, compile included;
- ``warm``: the same in a second process that reuses the first one's caches, i.e. what the next
  run of the same script costs;
- ``attention``: our attention kernels alone, eagerly, at the model's shapes, with fresh caches:
  one forward (and, for ``train``, one backward), i.e. the compile of every attention kernel the
  model needs.

Each record keeps dynamo's phase times (``torch._dynamo.utils.compile_times``), every Triton
compile the process itself ran (name, seconds; Inductor's worker processes compile the rest, and
so does our compile-ahead worker, whose kernels the process then finds in the cache), and what the
backend logged about compiling ahead (``compile_ahead``).

Contenders: ``compile`` (plain torch.compile), ``flash_inductor`` (our backend), and
``flash_inductor_no_compile_ahead`` (ours with ``make_backend(compile_ahead=False)``: our kernels
compile at the first run, in the process, as before compile-ahead). A contender named twice runs
twice, each time from empty caches, which interleaves an A/B:

    python -m benchmarks.cold_start                                # llama-e64, 2k, train
    python -m benchmarks.cold_start --models llama-e64,llama-e128 --tasks train,infer
    python -m benchmarks.cold_start --profile 40                   # + the 40 costliest calls (cProfile)
    python -m benchmarks.cold_start --parts cold \
        --contenders flash_inductor,flash_inductor_no_compile_ahead,flash_inductor,flash_inductor_no_compile_ahead
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

from flash_inductor.text_table import markdown_table
from benchmarks import common, e2e_models

PARTS = ("cold", "warm", "attention")
# Our backend without its background compile of our kernels: against "flash_inductor", the A/B of
# compile-ahead (flash_inductor/passes/compile_ahead.py).
NO_COMPILE_AHEAD = "flash_inductor_no_compile_ahead"
CONTENDERS = (*e2e_models.CONTENDERS, NO_COMPILE_AHEAD)


def compile_contender(contender: str, model, schedule: str | None = None):
    """``e2e_models.compile_with`` for its contenders, and our backend with compile-ahead off."""
    if contender == NO_COMPILE_AHEAD:
        import flash_inductor

        return torch.compile(model, backend=flash_inductor.make_backend(schedule=schedule, compile_ahead=False))
    return e2e_models.compile_with(contender, model, schedule=schedule)


# ----------------------------------------------------------------------------- child process

def _triton_compile_log() -> list:
    """Install a Triton compilation listener; return the list it appends (name, seconds, cache hit) to."""
    events: list = []
    try:
        from triton import knobs
    except ImportError:  # Triton < 3.4 has no knobs: the record goes without the list
        return events

    def listener(*, src, metadata, metadata_group, times, cache_hit, **_):
        total = _total_us(times)
        name = metadata.get("name") if isinstance(metadata, dict) else getattr(metadata, "name", None)
        events.append(dict(name=name or str(getattr(src, "name", "?")),
                           s=None if total is None else total / 1e6, cache_hit=bool(cache_hit)))

    knobs.compilation.listener = listener
    return events


def _total_us(times):
    """The compile's total time in µs from Triton's timing record, whatever its shape in this version."""
    if times is None:
        return None
    for name in ("total_time_us", "total_us", "total"):
        value = getattr(times, name, None)
        if isinstance(value, (int, float)):
            return value
    if isinstance(times, dict):
        return times.get("total_time_us") or times.get("total")
    return None


def _dynamo_phases(min_seconds: float = 0.1) -> dict:
    """Dynamo's cumulative phase times, {phase: seconds}, the phases that take ``min_seconds`` or more."""
    try:
        rows = torch._dynamo.utils.compile_times(repr="csv", aggregate=True)
    except Exception:  # the format is internal; a missing breakdown must not lose the timing
        return {}
    names, values = rows if isinstance(rows, tuple) and len(rows) == 2 else ([], [])
    phases = {}
    for name, value in zip(names, values):
        try:
            seconds = float(value)
        except ValueError:
            continue
        if seconds >= min_seconds:
            phases[str(name)] = round(seconds, 2)
    return phases


def _cache_counters() -> dict:
    """Dynamo's counters of the AOT autograd and Inductor caches (hits, misses, bypasses)."""
    counters = torch._dynamo.utils.counters
    return {section: {k: v for k, v in counters[section].items() if "cache" in k}
            for section in ("aot_autograd", "inductor") if section in counters}


def _collected_log(loggers: tuple[str, ...], level: int, keep) -> list:
    """The messages (first 300 characters) that ``loggers`` log at ``level`` or above for which
    ``keep(message)`` holds, collected from now on."""
    messages: list = []

    class _Collect(logging.Handler):
        def emit(self, record):
            message = record.getMessage()
            if keep(message):
                messages.append(message[:300])

    for name in loggers:
        logger = logging.getLogger(name)
        logger.setLevel(level)
        logger.addHandler(_Collect())
    return messages


def _attention_shapes(spec: e2e_models.ModelSpec, seq: int, batch: int, device, dtype):
    kv_heads = spec.kv_heads or spec.heads
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(batch, spec.heads, seq, spec.head_dim, device=device, dtype=dtype, generator=gen)
    k, v = (torch.randn(batch, kv_heads, seq, spec.head_dim, device=device, dtype=dtype, generator=gen)
            for _ in range(2))
    return [t.requires_grad_() for t in (q, k, v)]


def run_child(args) -> dict:
    """One measurement in this (fresh) process; the caches are the environment's."""
    events = _triton_compile_log()
    # Why the compile caches were bypassed: torch logs the reason at INFO/DEBUG.
    bypass_log = _collected_log(("torch._functorch._aot_autograd.autograd_cache", "torch._inductor.codecache"),
                                logging.DEBUG, lambda message: message.startswith("Bypass"))
    # What our backend logs about compiling ahead (how many kernel variants, the worker's pid), so a
    # record says whether a worker ran.
    compile_ahead_log = _collected_log(("flash_inductor",), logging.INFO, lambda message: "ahead" in message)
    spec = (e2e_models.TINY_MODELS if args.tiny else e2e_models.MODELS)[args.model]
    dtype = common.DTYPES[args.dtype]
    batch = e2e_models.batch_for(spec, args.seq, args.tokens)
    record = dict(model=args.model, seq=args.seq, batch=batch, task=args.task, contender=args.contender,
                  part=args.part, schedule=args.schedule)
    start = time.perf_counter()
    if args.part == "attention":
        import flash_inductor

        q, k, v = _attention_shapes(spec, args.seq, batch, args.device, dtype)
        causal = spec.family == "llama"
        out = flash_inductor.flash_attention(q, k, v, is_causal=causal, enable_gqa=spec.kv_heads is not None,
                                             **({"schedule": args.schedule} if args.schedule else {}))
        if args.device == "cuda":
            torch.cuda.synchronize()
        record["forward_s"] = time.perf_counter() - start
        if args.task == "train":
            out.sum().backward()
    else:
        torch.manual_seed(0)
        model = e2e_models.build_model(spec, args.seq, args.attn, args.device, dtype)
        model.train(args.task == "train")
        inputs = e2e_models.make_batch(spec, args.seq, batch, args.device, dtype)
        compiled = compile_contender(args.contender, model, schedule=args.schedule)
        step = e2e_models.make_task(model, compiled, inputs, args.task)
        record["build_s"] = time.perf_counter() - start
        start = time.perf_counter()
        step()
    if args.device == "cuda":
        torch.cuda.synchronize()
    record["first_s"] = time.perf_counter() - start
    record["dynamo_phases"] = _dynamo_phases()
    record["cache_counters"] = _cache_counters()
    record["cache_bypass_reasons"] = sorted(set(bypass_log))
    record["compile_ahead"] = compile_ahead_log
    record["in_process_compiles"] = [e for e in events if not e["cache_hit"]]
    record["in_process_compile_s"] = round(sum(e["s"] or 0.0 for e in record["in_process_compiles"]), 2)
    return record


# ----------------------------------------------------------------------------- parent

def _child(args, contender: str, part: str, cache_dir: str, model: str, task: str) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(cache_dir, "triton"),
               TORCHINDUCTOR_CACHE_DIR=os.path.join(cache_dir, "inductor"))
    cmd = [sys.executable]
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result_path = f.name
    profile_path = result_path + ".prof"
    if args.profile:
        cmd += ["-m", "cProfile", "-o", profile_path]
    cmd += ["-m", "benchmarks.cold_start", "--child", result_path, "--part", part, "--contender", contender,
            "--models", model, "--seqs", str(args.seqs_list[0]), "--tasks", task, "--attn", args.attn,
            "--dtype", args.dtype, "--tokens", str(args.tokens), "--device", args.device]
    if args.tiny:
        cmd.append("--tiny")
    if args.schedule:
        cmd += ["--schedule", args.schedule]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.child_timeout)
    wall = time.perf_counter() - start
    try:
        with open(result_path) as f:
            record = json.load(f)
    except (OSError, json.JSONDecodeError):
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-3:]
        record = dict(model=model, task=task, contender=contender, part=part, status="error",
                      error=" | ".join(tail)[:600])
    record["process_wall_s"] = round(wall, 2)
    if args.profile and os.path.exists(profile_path):
        record["profile"] = _profile_top(profile_path, args.profile)
        if args.keep_profiles and not args.no_write:
            os.makedirs(args.out, exist_ok=True)
            kept = os.path.join(args.out, f"cold_start_{model}_{task}_{contender}_{part}.prof")
            os.replace(profile_path, kept)
            record["profile_file"] = os.path.basename(kept)
    for path in (result_path, profile_path):
        if os.path.exists(path):
            os.remove(path)
    return record


def _profile_top(path: str, count: int) -> list:
    import pstats

    stats = pstats.Stats(path)
    rows = sorted(stats.stats.items(), key=lambda item: -item[1][3])[:count]  # by cumulative time
    return [dict(function=f"{file.rsplit('/', 2)[-1] if '/' in file else file}:{line}({name})",
                 cumulative_s=round(cum, 2), own_s=round(own, 2), calls=calls)
            for (file, line, name), (_, calls, own, cum, _) in rows]


def measure(args) -> list[dict]:
    records = []
    contenders = [c for c in args.contenders.split(",")]
    unknown = sorted(set(contenders) - set(CONTENDERS))
    if unknown:
        raise SystemExit(f"--contenders: unknown {unknown}; choose from {', '.join(CONTENDERS)}")
    cells = [(m, t) for m in args.models.split(",") for t in args.tasks.split(",")]
    jobs = [(m, t, c, p) for m, t in cells for c in contenders for p in args.parts.split(",")
            if not (p == "attention" and c != "flash_inductor")]
    caches, scratch = {}, []
    for model, task, contender, part in common.progress(jobs, "cold-start processes"):
        key = (model, task, contender)
        if part != "warm" or key not in caches:  # warm reuses the cold run's caches
            caches[key] = tempfile.mkdtemp(prefix="cold_start_")
            scratch.append(caches[key])  # a contender named twice gets a second directory
        if part == "attention":
            scratch.append(tempfile.mkdtemp(prefix="cold_start_"))
        record = _child(args, contender, part, scratch[-1] if part == "attention" else caches[key], model, task)
        quiet = ("profile", "in_process_compiles", "dynamo_phases")
        print(json.dumps({k: v for k, v in record.items() if k not in quiet}))
        records.append(record)
    for cache_dir in set(scratch):  # compiled kernels: hundreds of MB each
        shutil.rmtree(cache_dir, ignore_errors=True)
    return records


def table(records: list[dict]) -> str:
    header = ("model", "task", "contender", "part", "first step s", "process s", "in-process Triton compiles s")
    return "\n".join(markdown_table(header, [
        (r["model"], r["task"], r["contender"], r["part"],
         f"{r['first_s']:.1f}" if "first_s" in r else r.get("error", "-")[:60],
         f"{r.get('process_wall_s', 0):.1f}", r.get("in_process_compile_s", "-")) for r in records]))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="llama-e64", help=f"comma list of {', '.join(e2e_models.MODELS)}")
    p.add_argument("--seqs", default="2048", help="one sequence length")
    p.add_argument("--tasks", default="train", help="comma list of train, infer")
    p.add_argument("--attn", default="sdpa", choices=e2e_models.ATTN_IMPLEMENTATIONS)
    p.add_argument("--contenders", default=",".join(e2e_models.CONTENDERS),
                   help=f"comma list of {', '.join(CONTENDERS)} (one named twice runs twice)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--tokens", type=int, default=e2e_models.TOKENS, help="batch x seq")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--schedule", default=None, help="our backend's schedule (default: stable)")
    p.add_argument("--tiny", action="store_true", help="two-layer E 16 models (tests of the harness)")
    p.add_argument("--profile", type=int, default=0, help="keep the N costliest calls of each process (cProfile)")
    p.add_argument("--keep-profiles", action="store_true", help="also write each process's cProfile file to --out")
    p.add_argument("--child-timeout", type=float, default=600.0, help="seconds per process")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: run one part, write here
    p.add_argument("--part", default="cold", help=argparse.SUPPRESS)
    p.add_argument("--contender", default="flash_inductor", help=argparse.SUPPRESS)
    common.add_output_args(p)
    args = p.parse_args(argv)
    args.seqs_list = [int(s) for s in args.seqs.split(",")]
    if len(args.seqs_list) != 1:
        p.error("--seqs: one length (each process compiles afresh; run the script again for another)")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.child:
        args.model, args.seq, args.task = args.models, args.seqs_list[0], args.tasks
        record = run_child(args)
        with open(args.child, "w") as f:
            json.dump(record, f)
        return [record]
    env = common.environment(common.module_command("benchmarks.cold_start", argv))
    records = measure(args)
    print(table(records))
    if not args.no_write:
        path = common.write_record(args.out, "cold_start", env, dict(results=records), args.tag, args.device)
        print(f"wrote {path}")
    return records


if __name__ == "__main__":
    main()
