"""Carry a tuned table's entries over a kernel change that moves no tile's footprint.

    python -m tools.carry_table_entries --family backward \
        --reason "attn_bwd.py: a loop-invariant multiply hoisted; same tiles and PTX elsewhere"

Every entry records the hash of its kernel family's files (``tuning/cache.py``); after any edit
to those files the launchers ignore the entry and fall back to the heuristic until the family is
re-tuned. A full re-tune costs about half an hour of H200 time,
while some changes (an instruction removed from a loop, a comment) leave every config's shared
memory, registers and ranking where they were. This re-stamps the named family's stale entries
with the current hash and marks each with ``carried_from`` (the reason), so the table says which
picks were measured on other code; the next re-tune replaces them. Entries already current, and
other families', are left alone. Run it only after the GPU has shown the change keeps the picks'
speed (an A/B at the shipped configs) and the table-edge test passes on the carried picks.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from flash_inductor.tuning.buckets import Bucket
from flash_inductor.tuning.cache import KERNEL_FAMILIES, entry_is_current, entry_kernel_hash, kernel_family

SHIPPED = pathlib.Path(__file__).resolve().parents[1] / "flash_inductor" / "tuning" / "tables" / "nvidia-h200_sm90_132sm.json"


def carry(table: dict, family: str, reason: str) -> list[str]:
    """Re-stamp ``family``'s stale entries of ``table`` in place; returns their keys."""
    carried = []
    for key, entry in table["entries"].items():
        if entry is None or kernel_family(Bucket.parse(key)) != family or entry_is_current(key, entry):
            continue
        entry["kernel_hash"] = entry_kernel_hash(key)
        entry["carried_from"] = reason
        carried.append(key)
    return carried


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", type=pathlib.Path, default=SHIPPED)
    parser.add_argument("--family", required=True, choices=sorted(KERNEL_FAMILIES))
    parser.add_argument("--reason", required=True, help="what changed, and where it was measured")
    parser.add_argument("--meta-key", help="also record the reason under the table's meta[KEY]")
    args = parser.parse_args(argv)
    if not args.reason.strip():
        parser.error("--reason: say what changed")
    table = json.loads(args.table.read_text())
    carried = carry(table, args.family, args.reason)
    if args.meta_key:
        table.setdefault("meta", {})[args.meta_key] = f"{len(carried)} {args.family} entries carried: {args.reason}"
    args.table.write_text(json.dumps(table, indent=1) + "\n")
    print(f"carried {len(carried)} {args.family} entries in {args.table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
