"""``python -m flash_inductor.autotune``: tune the launch configs of this GPU, write its table.

    python -m flash_inductor.autotune --quick            # a few minutes: bf16, E=128, L=4096
    python -m flash_inductor.autotune                    # the default grid (see --help)
    python -m flash_inductor.autotune --resume --time-budget 450   # continue a partial run

The table goes to the user cache (``$FLASH_INDUCTOR_CACHE_DIR``, else
``$XDG_CACHE_HOME/flash_inductor``, else ``~/.cache/flash_inductor``), or to ``--out``, or
into the package with ``--ship``; it is rewritten atomically after every finished bucket, so an
interrupted run loses at most the buckets in flight and ``--resume`` skips the rest. Before
anything is measured, the run checks its arguments and that it can write there: a mistake is one
line on stderr and exit code 2. A summary (winner, TFLOP/s, error,
runner-up, gain over the heuristic per bucket) is printed and written as JSON beside the table
(or to ``--summary``) for committing under benchmarks/results/.

A user table keeps each entry's search record (``--resume`` seeds shortlists from it); a
shipped table (``--ship``) keeps only what a lookup needs, the record going to the summary
(whose default folder is then benchmarks/results/ of the checkout).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import sys
import time
from typing import Optional

import torch

from .. import cli_args
from ..cli_args import UsageError
from ..tuning import cache
from ..tuning.buckets import GLUON_PASSES, MASK_KINDS, Bucket
from ..tuning.configs import padded_head_dim
from ..tuning.kernel_config import role_config_from_dict
from .measure import do_bench_timer
from .plan import COPY, SWEEP, Grid, PlannedBucket, make_plan, seq_buckets
from ..schedules import SCHEDULES
from ..text_table import text_table
from .search import BucketTask, Settings, Tuner, task_from_entry
from ..tuning.footprint import OPTIN_SMEM_BYTES, DeviceLimits
from .search_space import FULL_SPACE, QUICK_SPACE, ROLES

PROG = "python -m flash_inductor.autotune"
INTERPRETER_GPU_KEY = "triton-interpreter"
_DTYPES = ("bf16", "fp16", "fp32")


def _csv(kind, allowed=None):
    def parse(text):
        values = [kind(x) for x in text.split(",") if x]
        bad = [v for v in values if allowed is not None and v not in allowed]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {','.join(map(str, allowed or ()))}")
        return tuple(values)
    return parse


def parse_args(argv=None) -> argparse.Namespace:
    p = cli_args.Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", type=_csv(str, _DTYPES), default=("bf16", "fp16"))
    p.add_argument("--head-dims", type=_csv(int), default=(64, 128, 256),
                   help="head dims to tune; each tunes its padded width (e.g. 96 -> 128)")
    p.add_argument("--masks", type=_csv(str, MASK_KINDS), default=("none", "causal"),
                   help="mask kinds (none,causal,bool,float); untuned kinds use the heuristic")
    p.add_argument("--schedules", type=_csv(str, tuple(SCHEDULES)), default=tuple(SCHEDULES),
                   help="precision schedules (default: all; fp8 only on GPUs with fp8 tensor cores)")
    p.add_argument("--passes", type=_csv(str, tuple(ROLES)), default=None,
                   help="default: forward,backward, and on a Hopper GPU with Gluon the Gluon kernels' "
                        f"{','.join(GLUON_PASSES)} (bf16/fp16, E 64/128, no mask or causal)")
    p.add_argument("--max-seq", type=cli_args.int_at_least(1), default=16384,
                   help="tune lengths 1024, 4096, ... up to this; lookups use the nearest tuned length")
    p.add_argument("--seqs", type=_csv(int), default=None, help="explicit length buckets (powers of two)")
    p.add_argument("--quick", action="store_true",
                   help="a tiny grid (bf16, E=128, none/causal, L=4096, stable, small search space)")
    p.add_argument("--exhaustive", action="store_true", help="sweep the whole search space in every bucket")
    p.add_argument("--out", default=None, help="table file or folder (default: the user cache)")
    p.add_argument("--output", dest="out", action=cli_args.RenamedOption, new="--out", help=argparse.SUPPRESS)
    p.add_argument("--ship", action="store_true",
                   help="write into flash_inductor/tuning/tables/, configs only (the search record goes to the summary)")
    p.add_argument("--summary", default=None, help="summary JSON path (default: beside the table)")
    p.add_argument("--resume", action="store_true", help="skip buckets already in the output table")
    p.add_argument("--incumbents", default=None, metavar="TABLE",
                   help="a table of this GPU (e.g. the shipped one) whose entries for the tuned buckets race in "
                        "their searches: a new pick replaces an entry only when faster by more than 1%% in the "
                        "same run, so a re-tune moves picks for measured gains, not timing noise")
    p.add_argument("--time-budget", type=cli_args.seconds, default=0.0,
                   help="seconds; stop before a round that would overrun, the first round included (0: no "
                        "limit). Resume later")
    p.add_argument("--compile-workers", type=cli_args.int_at_least(0), default=None,
                   help="processes compiling candidates in parallel (default: min(12, CPUs - 2) on CUDA)")
    p.add_argument("--warmup-ms", type=cli_args.int_at_least(0), default=5)
    p.add_argument("--rep-ms", type=cli_args.int_at_least(1), default=25)
    p.add_argument("--heat-ms", type=cli_args.int_at_least(0), default=500,
                   help="run each candidate this long before timing it, so it is timed at the card's sustained "
                        "(power-limited) clock, not the boost clock an idle compile leaves (0: off)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    args = p.parse_args(argv)
    if args.quick:
        args.dtypes, args.head_dims, args.masks, args.schedules = ("bf16",), (128,), ("none", "causal"), ("stable",)
        args.seqs = args.seqs or (4096,)
    bad = [e for e in args.head_dims if not 1 <= e <= 256]
    if bad:
        p.error(f"--head-dims: {bad} outside the kernels' 1..256")
    if args.seqs is not None and any(n < 1 or n & (n - 1) for n in args.seqs):
        p.error("--seqs: powers of two only (a length bucket is the power of two at or above max(L, S))")
    if args.ship and args.out:
        p.error("--ship and --out both say where the table goes; give one")
    return args


def make_grid(args, device: Optional[torch.device] = None) -> Grid:
    widths = tuple(dict.fromkeys(padded_head_dim(e) for e in args.head_dims))
    seqs = tuple(args.seqs) if args.seqs else seq_buckets(args.max_seq)
    schedules = tuple(args.schedules)
    if device is not None and not fp8_capable(device):
        skipped = [s for s in schedules if SCHEDULES[s].fp8_forward]
        if skipped:
            print(f"autotune: skipping {','.join(skipped)}: this GPU has no fp8 tensor cores")
        schedules = tuple(s for s in schedules if s not in skipped) or ("stable",)
    passes = args.passes if args.passes is not None else ("forward", "backward") + (
        GLUON_PASSES if device is not None and gluon_capable(device) else ())
    grid = Grid(schedules, tuple(args.dtypes), widths, tuple(args.masks), seqs, tuple(passes))
    asked = [p for p in passes if p in GLUON_PASSES]
    if asked and not any(b.pass_name in GLUON_PASSES for b in grid.buckets()):
        print(f"autotune: no bucket for {','.join(asked)}: the Gluon kernels are tuned at bf16/fp16, head dims "
              "64/128, no mask or causal, schedules fast/stable (the exact-Δ forward: stable)")
    return grid


def gluon_capable(device: torch.device) -> bool:
    """Whether the Gluon Hopper kernels run here: an sm_90 GPU and a Triton with Gluon's Hopper
    support (they have no interpreter)."""
    from ..launch.hopper import gluon_available

    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0) and gluon_available()


def fp8_capable(device: torch.device) -> bool:
    """Whether the fp8 schedule's kernels run here (the interpreter emulates e4m3; a dry run
    without a GPU plans for an H200)."""
    from ..launch.fp8 import FP8_MIN_CAPABILITY

    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= FP8_MIN_CAPABILITY


def output_path(args, gpu: str) -> pathlib.Path:
    if args.ship:
        return cache.shipped_tables_dir() / cache.table_filename(gpu)
    if args.out:
        path = pathlib.Path(args.out).expanduser()
        return path if path.suffix == ".json" and not path.is_dir() else path / cache.table_filename(gpu)
    try:
        folder = cache.user_cache_dir()
    except ValueError as error:
        raise UsageError(f"{error}, or pass --out") from None
    return folder / cache.table_filename(gpu)


def current_gpu(device: torch.device) -> tuple[str, str]:
    from ..launch import interpreter_enabled

    if device.type == "cuda":
        return cache.device_gpu_key(device), torch.cuda.get_device_name(device)
    if interpreter_enabled():
        return INTERPRETER_GPU_KEY, "Triton interpreter (CPU)"
    return "no-gpu", "no GPU (dry run)"


# ------------------------------------------------------------------------------------------
# Progress and summary
# ------------------------------------------------------------------------------------------


class _Progress:
    """tqdm when installed (with its ETA), plain lines otherwise."""

    def __init__(self, total: int, buckets: int):
        self.buckets, self.finished = buckets, 0
        self.started = time.monotonic()
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="cand", desc="autotune", dynamic_ncols=True)
        except ImportError:
            self.bar = None

    def candidate(self, task, measurement) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def bucket(self, task: BucketTask) -> None:
        self.finished += 1
        label = _winner_label(task.entry)
        if self.bar is not None:
            self.bar.set_postfix_str(f"{self.finished}/{self.buckets} buckets; {task.bucket.key()} -> {label}")
        else:
            elapsed = time.monotonic() - self.started
            print(f"[{self.finished}/{self.buckets} {elapsed:6.0f}s] {task.bucket.key()} -> {label}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _label(configs: Optional[dict]) -> str:
    if not configs:
        return "-"
    return " + ".join(role_config_from_dict(role, c).label() for role, c in configs.items())


def _winner_label(entry: Optional[dict]) -> str:
    return "no candidate passed" if entry is None else _label(entry["configs"])


def _summary_dir(args, table_path: pathlib.Path) -> pathlib.Path:
    """Beside the table; for --ship the checkout's benchmarks/results/ (the package holds tables
    only), else the user cache."""
    if not args.ship:
        return table_path.parent
    results = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    return results if results.is_dir() else cache.user_cache_dir()


def summary_path_for(args, table_path: pathlib.Path, gpu: str) -> pathlib.Path:
    """``--summary`` as given; else ``autotune_<gpu>_<date>[_quick].json`` beside the table,
    numbered ``-2``, ``-3``, ... when an earlier run that day left one. A second run (another
    head dim, a resume) must not overwrite what the first measured (the table keeps every
    entry, the summary each run's timing settings)."""
    if args.summary:
        return pathlib.Path(args.summary)
    folder = _summary_dir(args, table_path)
    stem = f"autotune_{gpu}_{datetime.date.today():%Y%m%d}{'_quick' if args.quick else ''}"
    candidate, number = folder / f"{stem}.json", 1
    while candidate.exists():
        number += 1
        candidate = folder / f"{stem}-{number}.json"
    return candidate


def check_outputs_writable(args, table_path: pathlib.Path, summary_path: pathlib.Path) -> None:
    """Fail now, not after the tuning, when the table or the summary cannot be written."""
    table_arg = "--out" if args.out else "--ship" if args.ship else f"the user cache ({cache.CACHE_DIR_ENV})"
    cli_args.output_file(table_arg, table_path)
    cli_args.output_file("--summary" if args.summary else table_arg, summary_path)
    if args.dry_run:  # writes nothing: the checks above, without creating the folders
        return
    for folder in dict.fromkeys((table_path.parent, summary_path.parent)):
        try:
            cache.check_writable_dir(folder)
        except OSError as error:
            raise UsageError(str(error)) from None


def summary_rows(plan: list[PlannedBucket], entries: dict) -> list[dict]:
    rows = []
    for planned in plan:
        entry = entries.get(planned.bucket.key())
        row = {"bucket": planned.bucket.key(), "mode": planned.kind, "tuned": entry is not None}
        if entry is not None and "ms" not in entry:  # a shipped entry kept by --resume: configs only
            row.update(winner=_label(entry["configs"]), record=False)
        elif entry is not None:
            runner_up = entry.get("runner_up") or {}
            row.update(
                winner=_label(entry["configs"]), ms=entry["ms"], tflops=entry["tflops"], error=entry["error"],
                error_ratio=entry["error_ratio"], runner_up=_label(runner_up.get("configs")),
                runner_up_ms=runner_up.get("ms"), heuristic=_label(entry["heuristic"]["configs"]),
                heuristic_ms=entry["heuristic"]["ms"], speedup_vs_heuristic=entry["speedup_vs_heuristic"],
                candidates=entry.get("candidates"), source=entry.get("source"),
            )
            if entry.get("incumbent") is not None:
                row.update(incumbent=_label(entry["incumbent"]["configs"]), incumbent_ms=entry["incumbent"]["ms"],
                           speedup_vs_incumbent=entry.get("speedup_vs_incumbent"))
        rows.append(row)
    return rows


def format_summary(rows: list[dict]) -> str:
    header = ("bucket", "winner", "TFLOP/s", "error", "err/budget", "runner-up", "vs heuristic")
    # A run with --incumbents also says how each pick compares with the entry it may replace.
    raced = any("incumbent" in r for r in rows)
    header += ("vs incumbent",) if raced else ()
    lines = [header]
    for r in rows:
        if not r["tuned"]:
            lines.append((r["bucket"], "not tuned") + ("-",) * (len(header) - 2))
            continue
        if r.get("record") is False:
            lines.append((r["bucket"], r["winner"]) + ("(kept, no record)",) + ("-",) * (len(header) - 3))
            continue
        ratio = r["speedup_vs_heuristic"]
        line = (r["bucket"], r["winner"], f"{r['tflops']:.1f}", f"{r['error']:.1e}", f"{r['error_ratio']:.2f}",
                r["runner_up"], "heuristic rejected" if ratio is None else f"{ratio:.3f}x")
        if raced:
            line += (_versus_incumbent(r),)
        lines.append(line)
    return "\n".join(text_table(lines))


def _versus_incumbent(row: dict) -> str:
    if "incumbent" not in row:
        return "-"
    if row["speedup_vs_incumbent"] is None:
        return "incumbent rejected"
    return "kept" if row["incumbent"] == row["winner"] else f"{row['speedup_vs_incumbent']:.3f}x"


def _versions() -> dict[str, str]:
    """What the summary records of the run's software (the table records Triton per entry)."""
    return {"torch": torch.__version__, "triton": cache.running_triton_version()}


def _write_json(path: pathlib.Path, data: dict) -> None:
    cache.atomic_write_text(path, json.dumps(data, indent=1, allow_nan=False, default=str) + "\n")


# ------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------


def _incumbent_entries(path: Optional[str], gpu: str) -> dict[str, dict]:
    """``--incumbents``: that table's entries by bucket key ({} without the option). A missing or
    unreadable file, or a table of another GPU, stops the run before anything is measured."""
    if path is None:
        return {}
    try:
        table = cache.read_table(path)
    except ValueError as error:
        raise UsageError(f"--incumbents: {error}") from None
    if table is None:
        raise UsageError(f"--incumbents: no table at {path}; give a table file of this GPU (e.g. the shipped one)")
    if table.gpu != gpu:
        raise UsageError(f"--incumbents: {path} is for {table.gpu}, this GPU is {gpu}; give a table of this GPU")
    return dict(table.entries)


def _default_settings(args, device: torch.device) -> Settings:
    return Settings(space=QUICK_SPACE if args.quick else FULL_SPACE,
                    timer=do_bench_timer(args.warmup_ms, args.rep_ms, args.heat_ms))


def _resumable_entries(path: pathlib.Path, gpu: str) -> dict[str, dict]:
    """The entries of the table at ``path`` a resumed run keeps: this GPU's, tuned for the
    running kernels (under any Triton version, as lookups use them)."""
    try:
        existing = cache.read_table(path)
    except ValueError as error:
        print(f"autotune: not resuming from {path}: {error}")
        return {}
    if existing is None:
        return {}
    if existing.gpu != gpu:
        print(f"autotune: not resuming from {path}: it is for {existing.gpu}")
        return {}
    return {key: entry for key, entry in existing.entries.items() if cache.entry_is_current(key, entry)}


def _already_tuned(entry: Optional[dict], space: str) -> bool:
    """Whether a resumed run may keep ``entry``: tuned in this search space, or a shipped entry
    (which records no space: its configs stand, and the shortlists it seeds race them)."""
    return entry is not None and entry.get("space", space) == space


# Seconds per candidate: on the H200 with 14 compile workers, 251 candidates took 236 s
# (benchmarks/results/autotune_nvidia-h200_sm90_132sm_20261130_full.json); the interpreter runs
# each candidate's accuracy check and timing on NumPy, which takes a minute or more at full sizes.
_GPU_CANDIDATE_S = 1.0
_INTERPRETER_CANDIDATE_S = 60.0


def _duration_estimate(candidates: int, device: torch.device) -> str:
    if device.type == "cuda":
        return f"about {max(1, round(candidates * _GPU_CANDIDATE_S / 60))} min on this GPU (--time-budget bounds it)"
    hours = candidates * _INTERPRETER_CANDIDATE_S / 3600
    return (f"about {hours:.1f} h or more under the Triton interpreter, which is for exercising the tuner, not "
            "for tuning (--time-budget bounds it)")


def _device(dry_run: bool) -> torch.device:
    from ..launch import interpreter_enabled

    if torch.cuda.is_available():
        return torch.device("cuda")
    if interpreter_enabled() or dry_run:
        return torch.device("cpu")
    raise UsageError("no CUDA GPU here: run on a GPU machine (or set TRITON_INTERPRET=1 to exercise the tuner "
                     "on CPU, or pass --dry-run to see the plan)")


def main(argv=None, *, settings: Optional[Settings] = None, device: Optional[torch.device] = None) -> int:
    args = parse_args(argv)
    device = device or _device(args.dry_run)
    settings = settings or _default_settings(args, device)
    gpu, device_name = current_gpu(device)
    grid = make_grid(args, device)
    plan = make_plan(grid, exhaustive=args.exhaustive)
    path = output_path(args, gpu)
    summary_path = summary_path_for(args, path, gpu)
    check_outputs_writable(args, path, summary_path)
    incumbents = _incumbent_entries(args.incumbents, gpu)
    print(f"autotune: {gpu} ({device_name}); {len(plan)} buckets "
          f"({sum(p.kind == SWEEP for p in plan)} sweeps, {sum(p.kind == COPY for p in plan)} copies) -> {path}")
    if args.dry_run:
        from ..launch import interpreter_enabled

        simulate = None
        if device.type != "cuda" and not interpreter_enabled():
            print("autotune: no GPU here: candidates estimated as on an H200 (sm_90, 227 KiB shared memory)")
            simulate = ((9, 0), DeviceLimits(smem_bytes=OPTIN_SMEM_BYTES[(9, 0)]))
        estimator = Tuner(device, settings, simulate=simulate)
        for planned in plan:
            print(f"  {planned.kind:9s} ~{estimator.estimate_candidates(planned):3d} candidates  "
                  f"{planned.bucket.key()}  {planned.source.key() if planned.source else ''}")
        print(f"  ~{sum(estimator.estimate_candidates(p) for p in plan)} candidates in all")
        return 0

    workers = args.compile_workers
    if workers is None:
        workers = min(12, max((os.cpu_count() or 1) - 2, 0)) if device.type == "cuda" else 0
    precompiler = None
    if workers > 0:
        from .precompile import ParallelPrecompiler

        precompiler = ParallelPrecompiler(workers, str(device), settings)
    tuner = Tuner(device, settings, precompile=precompiler)

    entries: dict[str, dict] = {}
    done: dict[Bucket, BucketTask] = {}
    if args.resume:
        entries.update(_resumable_entries(path, gpu))
    tasks = []
    for planned in plan:
        entry = entries.get(planned.bucket.key())
        if _already_tuned(entry, settings.space.name):
            done[planned.bucket] = task_from_entry(planned, tuner.heuristic(planned.bucket), entry)
        else:
            tasks.append(tuner.task(planned, incumbents.get(planned.bucket.key())))
    if incumbents:
        raced = sum(t.incumbent is not None for t in tasks)
        print(f"autotune: {raced} of {len(tasks)} buckets to tune race an incumbent from {args.incumbents}")
    if args.resume:
        print(f"autotune: resuming: {len(done)} of {len(plan)} buckets already tuned")

    started = time.monotonic()
    meta = dict(device_name=device_name, date=datetime.datetime.now().isoformat(timespec="seconds"),
                command=" ".join(sys.argv if argv is None else ["python -m flash_inductor.autotune", *argv]))

    def write_summary(remaining: list) -> None:
        _write_json(summary_path, {
            "gpu": gpu, **meta, **_versions(), "kernel_identities": cache.family_identities(),
            "table": str(path), "complete": not remaining, "remaining": [t.bucket.key() for t in remaining],
            "wall_s": time.monotonic() - started, "stats": tuner.stats,
            "timing_shape": {"tokens": settings.tokens, "hidden": settings.hidden},
            "timing": {"warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms, "heat_ms": args.heat_ms},
            "rows": summary_rows(plan, entries),
        })

    def on_done(task: BucketTask) -> None:
        progress.bucket(task)
        if task.entry is not None:
            entries[task.bucket.key()] = task.entry
            written = cache.shipped_entry(task.entry) if args.ship else task.entry
            cache.update_table(path, cache.TuningTable.for_current_code(gpu, {task.bucket.key(): written}, **meta))
        write_summary([t for t in tasks if not t.done])  # a run killed mid-way still leaves its summary

    candidates = sum(tuner.estimate_candidates(t) for t in plan if t.bucket not in done)
    print(f"autotune: ~{candidates} candidates to measure: {_duration_estimate(candidates, device)}", flush=True)
    progress = _Progress(candidates, len(tasks))
    deadline = started + args.time_budget if args.time_budget > 0 else None
    try:
        remaining = tuner.run(tasks, done, on_done=on_done, on_candidate=progress.candidate, deadline=deadline)
    finally:
        progress.close()
        if precompiler is not None:
            precompiler.close()
    write_summary(remaining)
    print(format_summary(summary_rows(plan, entries)))
    print(f"autotune: table {path}\nautotune: summary {summary_path}")
    if remaining:
        print(f"autotune: stopped by --time-budget with {len(remaining)} buckets left; "
              "run the same command with --resume to continue")
    return 0

