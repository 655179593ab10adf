"""``python -m flash_inductor.debug bisect-length MODULE:FACTORY --dtype fp16``: the critical length.

Every argument, the factory included, is checked before the first length runs: a mistake is one
line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from .. import cli_args
from ..cli_args import UsageError
from .bisect import DTYPES, print_progress, bisect_length

PROG = "python -m flash_inductor.debug"
EXAMPLE_FACTORY = "benchmarks.overflow_demo:ramp_gpt"


def _checked_bisect(args) -> None:
    """bisect-length's arguments, all before the first length runs."""
    if args.min_length > args.max_length:
        raise UsageError(f"--min-length {args.min_length} is above --max-length {args.max_length}; swap them")
    if args.out:
        cli_args.output_file("--out", args.out)
    args.factory = cli_args.load_callable("bisect-length FACTORY", args.factory, EXAMPLE_FACTORY,
                                          "factory(length) -> (model, inputs)")


def main(argv=None) -> int:
    parser = cli_args.Parser(prog=PROG, description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    bisect = commands.add_parser("bisect-length", help="shortest sequence length that goes non-finite")
    bisect.add_argument("factory", help="MODULE:FACTORY; factory(length) -> (model, inputs)")
    bisect.add_argument("--dtype", default="fp16", choices=sorted(DTYPES))
    bisect.add_argument("--min-length", type=cli_args.int_at_least(1), default=16)
    bisect.add_argument("--max-length", type=cli_args.int_at_least(1), default=65536)
    bisect.add_argument("--step", type=cli_args.int_at_least(1), default=1, help="resolution of the bisection")
    bisect.add_argument("--criterion", default="nonfinite", choices=("nonfinite", "tolerance"),
                        help="what counts as failing: non-finite loss/gradients (eager, cheap), or also a "
                             "shadow-check tolerance violation (a float64 twin at every length)")
    bisect.add_argument("--cast", action="store_true", help="convert the model to --dtype instead of autocast")
    bisect.add_argument("--forward-only", action="store_true")
    bisect.add_argument("--out", metavar="JSON", help="also write the result as JSON to this file")
    bisect.add_argument("--json", dest="out", action=cli_args.RenamedOption, new="--out", help=argparse.SUPPRESS)
    bisect.add_argument("--quiet", action="store_true", help="no per-length progress lines")
    args = parser.parse_args(argv)
    _checked_bisect(args)
    doublings = max(args.max_length // args.min_length, 1).bit_length() + 1
    halvings = max(args.max_length // args.step, 1).bit_length()
    print(f"bisect-length: {args.dtype}, lengths {args.min_length}..{args.max_length}: at most {doublings + halvings} "
          f"probes, each a {'forward' if args.forward_only else 'forward and backward'}"
          f"{' with a float64 shadow' if args.criterion == 'tolerance' else ''} of the model at that length; the "
          "longest dominate", file=sys.stderr, flush=True)

    result = bisect_length(
        args.factory, args.dtype, min_length=args.min_length, max_length=args.max_length, step=args.step,
        criterion=args.criterion, cast=args.cast, backward=not args.forward_only,
        progress=None if args.quiet else print_progress)
    print(result.format())
    if result.report is not None:
        print(result.report.format())
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(critical_length=result.critical_length, last_passing=result.last_passing,
                           dtype=result.dtype, site=result.site, cause=result.cause,
                           probes=[vars(p) for p in result.probes]), f, indent=1)
    return 0


def cli() -> int:
    """The ``flash-inductor-debug`` console script: :func:`main` on ``sys.argv``, a usage error
    as one line and exit code 2."""
    return cli_args.run(main, prog=PROG)


if __name__ == "__main__":
    sys.exit(cli())
