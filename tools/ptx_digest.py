"""Digests of the PTX our launchers compile for sm_90, so two versions of a kernel file can be
compared without a GPU.

    python -m tools.ptx_digest --out before.json        # on main
    (apply the kernel change)
    python -m tools.ptx_digest --out after.json --compare before.json

Why: a tuning table entry carries its kernel family's source hash, so any edit of attn_bwd.py
makes every backward entry stale, even for variants whose compiled code the edit does not touch
(a change behind a constexpr only one schedule sets). Where the PTX of a variant is unchanged, its
tuned configs still describe the running kernels and the entry may be re-stamped with the new
hash rather than re-tuned (``tools/carry_table_entries.py``). Each case (head dim x mask x dtype x schedule)
compiles one forward and one backward at the Hopper heuristic's configs (tools/smem_check.py's
stand-in driver, so no GPU is needed), and the PTX of each kernel is hashed after dropping
comments, the header lines and the debug information (source lines and paths). ``--compare`` prints, per case and kernel,
whether the digest matches, and exits 1 if any differ. Without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import re
import sys

from tools.smem_check import check

# Header lines, and the debug anchors: line directives and the `$L__tmpN:` labels they point at.
_HEADER = re.compile(r"^\s*(//|\.version|\.target|\.address_size|\.loc\b|\.file\b|\$L__tmp\d+:)")


def ptx_digest(ptx: str) -> str:
    """A hash of the code alone: the debug sections (DWARF, which encode source lines and paths),
    the line directives and their labels are dropped, so moving a function in the file changes
    nothing."""
    code = ptx.split("\t.section\t.debug", 1)[0]
    body = "\n".join(line.split("//")[0].rstrip() for line in code.splitlines()
                     if line.strip() and not _HEADER.match(line))
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def digests(head_dims, masks, dtypes, schedules, seq) -> dict[str, dict[str, str]]:
    result = {}
    for head_dim, mask, dtype, schedule in itertools.product(head_dims, masks, dtypes, schedules):
        compiled: dict = {}
        check(head_dim, mask, dtype, schedule, seq=seq, compiled_by_name=compiled)
        case = f"{schedule}/{dtype}/e{head_dim}/{mask}"
        result[case] = {name: ptx_digest(kernel.asm["ptx"]) for name, kernel in sorted(compiled.items())}
        print(case, " ".join(f"{name}={digest}" for name, digest in result[case].items()), flush=True)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--masks", default="none,causal")
    p.add_argument("--dtypes", default="bf16,fp16")
    p.add_argument("--schedules", default="stable,fast,accurate")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--out", required=True, help="JSON file for the digests")
    p.add_argument("--compare", default=None, help="an earlier --out file: report which kernels changed")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        p.error("unset TRITON_INTERPRET: interpreted kernels are not compiled")
    result = digests([int(e) for e in args.head_dims.split(",")], args.masks.split(","), args.dtypes.split(","),
                     args.schedules.split(","), args.seq)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    if args.compare is None:
        return 0
    with open(args.compare) as f:
        before = json.load(f)
    changed = 0
    for case, kernels in result.items():
        for name, digest in kernels.items():
            old = before.get(case, {}).get(name)
            same = old == digest
            changed += not same
            print(f"{'same   ' if same else 'CHANGED'} {case} {name}")
    print(f"{changed} kernel(s) changed")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
