"""Ship a tuning table: keep what a lookup needs in the package, move the search records to a result file.

    python -m tools.ship_table $OUT/nvidia-h200_sm90_132sm.json      # a re-tune's table (schema 3)
    python -m tools.ship_table flash_inductor/tuning/tables/nvidia-h200_sm90_132sm.json  # convert schema 2

The entries of SOURCE that describe this checkout's kernels are reduced to their configs, kernel
identity and Triton version (``cache.shipped_entry``) and merged into the shipped table of their
GPU (``--out``; replacing that file when it holds an older schema). What the search measured
(times, runner-up, the heuristic's time, candidates) goes to ``--records``, one row per bucket,
for benchmarks/results/.

A schema-2 SOURCE (per-family hashes of whole kernel files, one Triton version for the table) is
converted: an entry whose hash equals the hash of this checkout's kernel files, computed with the
schema-2 code below, was tuned for today's kernels and gets their identity and the table's Triton
version; any other entry was tuned for other kernels and is left out (and listed).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

from flash_inductor.tuning import cache
from flash_inductor.tuning.buckets import Bucket
from flash_inductor.tuning.kernel_config import role_config_from_dict

# Schema 2's kernel families: the files each family's hash covered.
SCHEMA2_FAMILY_FILES = {
    "forward": ("attn_fwd.py", "common.py"),
    "backward": ("attn_bwd.py", "common.py", "tile_loads.py"),
    "fp8_forward": ("attn_fwd_fp8.py", "common.py"),
}


def schema2_family_hash(family: str, kernels_dir: pathlib.Path = ROOT / "flash_inductor" / "kernels") -> str:
    """Schema 2's hash: sha256 over the family's files in name order, names included."""
    hasher = hashlib.sha256()
    for path in sorted(kernels_dir / name for name in SCHEMA2_FAMILY_FILES[family]):
        hasher.update(path.name.encode())
        hasher.update(path.read_bytes())
    return hasher.hexdigest()


def convert_schema2(data: dict) -> tuple[dict[str, dict], list[str]]:
    """(entries stamped with today's identity, keys left out) of a schema-2 table."""
    converted, left_out = {}, []
    for key, entry in data["entries"].items():
        family = cache.kernel_family(Bucket.parse(key))
        if entry is None or entry.get("kernel_hash") != schema2_family_hash(family):
            left_out.append(key)
            continue
        converted[key] = {**entry, "kernel": cache.family_identity(family), "triton": data["triton"]}
    return converted, left_out


def current_entries(data: dict) -> tuple[dict[str, dict], list[str]]:
    """(entries of a schema-3 table that describe today's kernels, keys left out)."""
    table = cache.TuningTable.from_json(data)
    kept = {key: entry for key, entry in table.entries.items() if cache.entry_is_current(key, entry)}
    return kept, sorted(set(data["entries"]) - set(kept))


def _label(configs) -> str:
    return "-" if not configs else " + ".join(role_config_from_dict(role, c).label() for role, c in configs.items())


def _round(value, digits):
    return None if value is None else round(value, digits)


def record_row(key: str, entry: dict) -> dict:
    """One bucket's search record, in the autotuner summary's terms (times to 0.1 us)."""
    runner_up = entry.get("runner_up") or {}
    heuristic = entry.get("heuristic") or {}
    return {"bucket": key, "winner": _label(entry["configs"]), "triton": entry["triton"],
            "ms": _round(entry.get("ms"), 4), "tflops": _round(entry.get("tflops"), 1),
            "error_ratio": _round(entry.get("error_ratio"), 3),
            "runner_up": _label(runner_up.get("configs")), "runner_up_ms": _round(runner_up.get("ms"), 4),
            "heuristic": _label(heuristic.get("configs")), "heuristic_ms": _round(heuristic.get("ms"), 4),
            "speedup_vs_heuristic": _round(entry.get("speedup_vs_heuristic"), 3),
            "candidates": entry.get("candidates"), "mode": entry.get("mode"), "source": entry.get("source"),
            "carried": "carried_from" in entry}


def family_counts(entries: dict[str, dict]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for key in entries:
        family = cache.kernel_family(Bucket.parse(key))
        counts[family] = counts.get(family, 0) + 1
    return counts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", type=pathlib.Path, help="a table written by the autotuner (schema 2 or 3)")
    p.add_argument("--out", type=pathlib.Path, default=None, help="default: the package's table for its GPU")
    p.add_argument("--records", type=pathlib.Path, default=None,
                   help="default: benchmarks/results/autotune_<gpu>_shipped.json (rows merged by bucket)")
    p.add_argument("--meta", action="append", default=[], metavar="KEY=TEXT", help="set a meta field of the table")
    args = p.parse_args(argv)
    data = json.loads(args.source.read_text())
    schema = data.get("schema")
    if schema == 2:
        entries, left_out = convert_schema2(data)
    elif schema == cache.SCHEMA_VERSION:
        entries, left_out = current_entries(data)
    else:
        p.error(f"{args.source}: schema {schema!r}; this tool reads 2 and {cache.SCHEMA_VERSION}")
    gpu = data["gpu"]
    out = args.out or cache.shipped_tables_dir() / cache.table_filename(gpu)
    device_name = (data.get("meta") or {}).get("device_name")
    meta = {**({"device_name": device_name} if device_name else {}), **dict(kv.split("=", 1) for kv in args.meta)}
    shipped = {key: cache.shipped_entry(entry) for key, entry in entries.items()}
    written = cache.update_table(out, cache.TuningTable(gpu=gpu, entries=shipped, meta=meta))

    rows = {key: record_row(key, entry) for key, entry in entries.items() if "ms" in entry}
    if rows:
        records = args.records or ROOT / "benchmarks" / "results" / f"autotune_{gpu}_shipped.json"
        old = json.loads(records.read_text()) if records.exists() else {"rows": []}
        merged = {row["bucket"]: row for row in old["rows"]}
        merged.update(rows)
        lines = ",\n".join(f"  {json.dumps(merged[key])}" for key in sorted(merged))
        records.write_text(f'{{\n "gpu": {json.dumps(gpu)},\n "rows": [\n{lines}\n ]\n}}\n')
        print(f"{len(rows)} search records -> {records}")
    print(f"shipped {len(shipped)} entries {family_counts(shipped)} -> {out} "
          f"({len(written.entries)} in the table, {out.stat().st_size} bytes)")
    if left_out:
        print(f"left out {len(left_out)} entries tuned for other kernels: {', '.join(left_out[:10])}"
              f"{' ...' if len(left_out) > 10 else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
