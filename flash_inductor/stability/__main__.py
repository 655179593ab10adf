"""``python -m flash_inductor.stability``: the adversarial precision suite.

    python -m flash_inductor.stability                      # full sizes on CUDA
    python -m flash_inductor.stability --cases qk_x,left_padding --dtypes fp16
    python -m flash_inductor.stability --quick --device cpu --seq 48 --long-seqs 256   # CI size
    python -m flash_inductor.stability --merge a.json b.json --tag all   # one table/heat-map from several runs

Prints the table and the requirement verdict, writes ``stability_<device>_<date>[_tag].json`` and
``.png`` to ``--out`` (default: ``results/`` in the user cache folder, never the current directory;
the last lines say where); exits 1 when the default schedule misses the requirement. Every argument is
checked before anything runs: a mistake is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import pathlib
import re
import sys
from typing import Optional

import torch

from .. import cli_args
from ..cli_args import UsageError
from . import anchors, cases as case_module, estimate, report, runner

PROG = "python -m flash_inductor.stability"
# The dtypes a case can ask for; runner.DTYPE_NAMES also names fp32, which no case runs.
CASE_DTYPES = ("fp16", "bf16")


def _csv(text: Optional[str]) -> Optional[list[str]]:
    return [t.strip() for t in text.split(",") if t.strip()] if text else None


def parse_args(argv=None) -> argparse.Namespace:
    p = cli_args.Parser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="small sizes (B=1, H=2, L=256, E=64, long 2k/4k)")
    p.add_argument("--cases", help="comma-separated case names or prefixes (default: all; see --list)")
    p.add_argument("--dtypes", help="comma-separated, from fp16,bf16 (default: each case's own)")
    p.add_argument("--impls", help="comma-separated implementations (default: all; see --list)")
    p.add_argument("--seq", type=cli_args.int_at_least(1), help="override L = S of the ordinary cases")
    p.add_argument("--head-dim", type=cli_args.int_at_least(1), help="override E")
    p.add_argument("--long-seqs", help="override the long-sequence lengths, e.g. 32768,65536")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-budget", type=cli_args.seconds, metavar="SECONDS",
                   help="start no new case after this many seconds; what ran is still reported and written")
    p.add_argument("--out", default=None, help=f"folder for the JSON and PNG ({cli_args.USER_RESULTS_HELP})")
    p.add_argument("--tag", help="suffix of the output file names")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--list", action="store_true", help="list cases and implementations, then exit")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="combine the results of earlier runs; runs nothing")
    return p.parse_args(argv)


def sizes_from(args) -> case_module.Sizes:
    sizes = case_module.QUICK if args.quick else case_module.FULL
    overrides = {}
    if args.seq:
        overrides["seq"] = args.seq
    if args.head_dim:
        overrides["head_dim"] = args.head_dim
    if args.long_seqs:
        overrides["long_seqs"] = cli_args.int_list(args.long_seqs, "--long-seqs")
    return dataclasses.replace(sizes, **overrides)


def _progress(disabled: bool):
    if disabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return lambda items: tqdm(items, desc="stability", unit="case", dynamic_ncols=True)


def output_stem(out_dir: pathlib.Path, device_name: str, tag: Optional[str]) -> pathlib.Path:
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")
    stem = f"stability_{slug}_{datetime.date.today():%Y%m%d}" + (f"_{tag}" if tag else "")
    return out_dir / stem


def _device(name: str) -> str:
    """``--device`` when this machine has it; UsageError otherwise."""
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise UsageError(f"--device: {name!r} is not a device; use cpu or cuda (cuda:N for one GPU)") from None
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device: {name!r}: the suite runs on cpu or cuda")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("--device: CUDA is not available; use --device cpu (our op then runs its PyTorch "
                             "reference path)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"--device: {name!r}: this machine has {torch.cuda.device_count()} GPU(s), "
                             f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return name


def _tag(tag: Optional[str]) -> Optional[str]:
    if tag is not None and not re.fullmatch(r"[A-Za-z0-9._-]+", tag):
        raise UsageError(f"--tag: {tag!r}: use letters, digits, '.', '_' and '-' only (it ends a file name)")
    return tag


def _out(args) -> None:
    """``--out`` checked, or the user's results folder when it is not given."""
    args.out = cli_args.output_dir("--out", args.out if args.out is not None else cli_args.user_results_dir("--out"))


def _merge_payloads(paths: list[str]) -> list[tuple[str, dict]]:
    """Each ``--merge`` file's payload, read and checked before anything is written."""
    payloads = []
    for path in paths:
        text = cli_args.input_file("--merge", path).read_text()
        try:
            payload = json.loads(text)
            report.results_from_json(payload)
            if not isinstance(payload["environment"]["device"], str) or not isinstance(payload["cases"], dict):
                raise TypeError("no 'environment.device' string or no 'cases' object")
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as error:
            raise UsageError(f"--merge: {path} is not a stability result ({type(error).__name__}: {error}); "
                             "give the JSON files earlier runs wrote") from None
        payloads.append((path, payload))
    return payloads


def _chosen_work(args, all_cases):
    """(cases, dtypes, work items) the arguments select; UsageError when they name something
    unknown or select nothing."""
    try:
        chosen = case_module.select(all_cases, args.cases)
    except ValueError as error:
        raise UsageError(str(error)) from None
    dtype_names = _csv(args.dtypes)
    if dtype_names is not None:
        cli_args.known_names("--dtypes", dtype_names, CASE_DTYPES)
    by_name = {v: k for k, v in runner.DTYPE_NAMES.items()}
    dtypes = [by_name[n] for n in dtype_names] if dtype_names else None
    items = runner.work_items(chosen, dtypes)
    if not items:
        raise UsageError(f"--dtypes {args.dtypes}: none of the chosen cases runs in it (see --list for each "
                         "case's dtypes)")
    return chosen, dtypes, items


def main(argv=None) -> int:
    args = parse_args(argv)
    sizes = sizes_from(args)
    all_cases = case_module.all_cases(sizes)
    impl_names = _csv(args.impls)
    if impl_names is not None:
        cli_args.known_names("--impls", impl_names, [i.name for i in anchors.implementations()])
    impls = anchors.implementations(impl_names)
    if args.list:
        for c in all_cases:
            print(f"{c.name:18s} {','.join(runner.DTYPE_NAMES[d] for d in c.dtypes):10s} {c.description}")
        print("implementations:", ", ".join(i.name for i in impls))
        return 0
    _tag(args.tag)
    if args.merge:
        payloads = _merge_payloads(args.merge)
        _out(args)
        return merge(args, payloads)
    _device(args.device)
    chosen, dtypes, items = _chosen_work(args, all_cases)
    _out(args)

    seconds = estimate.estimate_seconds(items, impls, sizes, args.device)
    print(f"stability: {len(items)} case/dtype pairs x {len(impls)} implementations on {args.device} (L {sizes.seq}, "
          f"E {sizes.head_dim}, long {','.join(map(str, sizes.long_seqs)) or '-'}): about "
          f"{estimate.format_duration(seconds)} here" + ("" if args.quick or seconds < 600 else
                                                          "; --quick, --cases or --time-budget shorten it"), flush=True)
    results = runner.run_suite(chosen, impls, args.device, sizes, dtypes, args.seed, _progress(args.no_progress),
                               time_budget=args.time_budget)
    env = report.environment(argv, args.device)
    env["sizes"] = dataclasses.asdict(sizes)
    ran = {(r.case, r.dtype) for r in results}
    not_run = [f"{c.name} {runner.DTYPE_NAMES[d]}" for c, d in items if (c.name, runner.DTYPE_NAMES[d]) not in ran]
    if not_run:
        env["not_run"] = not_run
        print(f"time budget of {args.time_budget:g} s spent; not run: {', '.join(not_run)}")
    return finish(args, results, env, {c.name: c.description for c in chosen})


def merge(args, payloads: list[tuple[str, dict]]) -> int:
    """One table, verdict, JSON and heat-map from several runs' JSON files (later files win)."""
    results: dict[tuple, runner.Result] = {}
    envs, case_info = [], {}
    for _, payload in payloads:
        envs.append(payload["environment"])
        case_info.update(payload["cases"])
        for r in report.results_from_json(payload):
            results[(r.case, r.dtype, r.impl)] = r
    env = dict(envs[-1], merged_from=[str(p) for p, _ in payloads])
    return finish(args, list(results.values()), env, case_info)


def finish(args, results, env, case_info) -> int:
    requirement = runner.check_requirements(results)
    print(report.format_table(results))
    print(requirement.format())

    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = output_stem(out_dir, env["device"], args.tag)
    report.write_json(stem.with_suffix(".json"), report.to_json(results, requirement, env, case_info))
    print(f"wrote {stem.with_suffix('.json')}")
    if not args.no_plot:
        png = report.plot_heatmap(results, stem.with_suffix(".png"),
                                  f"flash_inductor stability: {env['device']}, torch {env['torch']}")
        print(f"wrote {png}" if png else "matplotlib is not installed: no heat-map")
    return 0 if requirement.passed else 1


def cli() -> int:
    """The ``flash-inductor-stability`` console script: :func:`main` on ``sys.argv``, a usage
    error as one line and exit code 2."""
    return cli_args.run(main, prog=PROG)


if __name__ == "__main__":
    sys.exit(cli())
