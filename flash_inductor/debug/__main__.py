"""``python -m flash_inductor.debug bisect-length MODULE:FACTORY --dtype fp16``: the critical length."""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from .bisect import DTYPES, print_progress, bisect_length


def _load(spec: str):
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise SystemExit(f"bisect-length: expected MODULE:FACTORY (e.g. benchmarks.overflow_demo:ramp_gpt), got {spec!r}")
    factory = importlib.import_module(module_name)
    for part in attr.split("."):
        factory = getattr(factory, part)
    return factory


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flash_inductor.debug", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    bisect = commands.add_parser("bisect-length", help="shortest sequence length that goes non-finite")
    bisect.add_argument("factory", help="MODULE:FACTORY; factory(length) -> (model, inputs)")
    bisect.add_argument("--dtype", default="fp16", choices=sorted(DTYPES))
    bisect.add_argument("--min-length", type=int, default=16)
    bisect.add_argument("--max-length", type=int, default=65536)
    bisect.add_argument("--step", type=int, default=1, help="resolution of the bisection")
    bisect.add_argument("--criterion", default="nonfinite", choices=("nonfinite", "tolerance"),
                        help="what counts as failing: non-finite loss/gradients (eager, cheap), or also a "
                             "shadow-check tolerance violation (a float64 twin at every length)")
    bisect.add_argument("--cast", action="store_true", help="convert the model to --dtype instead of autocast")
    bisect.add_argument("--forward-only", action="store_true")
    bisect.add_argument("--json", help="also write the result as JSON to this path")
    bisect.add_argument("--quiet", action="store_true", help="no per-length progress lines")
    args = parser.parse_args(argv)

    result = bisect_length(
        _load(args.factory), args.dtype, min_length=args.min_length, max_length=args.max_length, step=args.step,
        criterion=args.criterion, cast=args.cast, backward=not args.forward_only,
        progress=None if args.quiet else print_progress)
    print(result.format())
    if result.report is not None:
        print(result.report.format())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(critical_length=result.critical_length, last_passing=result.last_passing,
                           dtype=result.dtype, site=result.site, cause=result.cause,
                           probes=[vars(p) for p in result.probes]), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
