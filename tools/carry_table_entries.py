"""Re-key a tuning table's entries across a kernel edit that leaves the compiled code unchanged.

    python -m tools.carry_table_entries --since main            # kernels at `main` -> this checkout
    python -m tools.carry_table_entries --since HEAD~3 --head-dims 64,128 --dry-run
    python -m tools.carry_table_entries --since main --whole-package   # the launchers changed too

Each entry records its kernel family's source identity (``tuning/kernel_identity.py``), which
ignores comments, docstrings and line numbers but changes with any edit of the code, including
ones the compiler erases (a renamed local, a helper split in two). After such an edit the
launchers skip the family's entries until it is re-tuned, which costs GPU time for nothing.

This tool proves that nothing changed and re-keys the entries: for every family whose identity
differs between the kernels at ``--since`` and this checkout's, it compiles both versions for
sm_90 on this machine (``tools/launch_sass.py --grid``: the launchers' real constexprs, no GPU
needed) for each case (head dim x mask x dtype x schedule) and compares the PTX digests of every
kernel of the family. Entries that recorded the old identity get the new one only when every digest matches;
otherwise the tool names the kernels whose code changed, and those buckets need a re-tune.

``--family F --reason "..."`` re-keys family F's entries without compiling, and records the reason
in the table's notes (``meta["tuned"]``): for a change whose proof was made another way (a PTX
comparison of the affected cases, a GPU A/B) or that the full proof cannot compile (on a machine
too slow for it). Say in the reason what was checked; a GPU A/B must confirm it before release.

    python -m tools.carry_table_entries --since main --family backward --reason "window: ..."
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]

from flash_inductor.tuning import cache
from flash_inductor.tuning.kernel_identity import KERNEL_FAMILIES, family_identities

SHIPPED = cache.shipped_tables_dir() / "nvidia-h200_sm90_132sm.json"
_IDENTITIES = "import json; from flash_inductor.tuning.kernel_identity import family_identities as f; print(json.dumps(f()))"


def family_kernel_names(family: str) -> set[str]:
    return {spec.split(":")[1] for spec in KERNEL_FAMILIES[family]}


def tree_with_kernels_of(rev: str, into: pathlib.Path, whole_package: bool = False) -> pathlib.Path:
    """This checkout's package and digest tools, with ``flash_inductor/kernels`` as at ``rev``; with
    ``whole_package``, all of ``flash_inductor`` as at ``rev`` (its launchers too: for a change
    that also changes the arguments the launchers pass, which the old kernels would not take)."""
    shutil.copytree(ROOT / "flash_inductor", into / "flash_inductor",
                    ignore=shutil.ignore_patterns("__pycache__", "tables"))
    (into / "tools").mkdir()
    for name in ("__init__.py", "launch_sass.py"):
        shutil.copy(ROOT / "tools" / name, into / "tools" / name)
    replaced = "flash_inductor" if whole_package else "flash_inductor/kernels"
    shutil.rmtree(into / replaced)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, replaced],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def _python(tree: pathlib.Path, *args: str) -> str:
    # The tree first, then the caller's path (which may supply torch to an interpreter that keeps
    # another Triton, as a compile-only venv does).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))}
    env.pop("TRITON_INTERPRET", None)  # interpreted kernels are not compiled
    return subprocess.run([sys.executable, *args], cwd=tree, env=env, check=True, capture_output=True,
                          text=True).stdout


def identities_in(tree: pathlib.Path) -> dict[str, str]:
    return json.loads(_python(tree, "-c", _IDENTITIES).strip().splitlines()[-1])


def digests_in(tree: pathlib.Path, options: list[str]) -> dict[str, dict[str, str]]:
    """{case: {kernel: PTX digest}} of ``launch_sass --grid`` in ``tree``, at L = S = 512."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        _python(tree, "-m", "tools.launch_sass", "--grid", "--seq", "512", "--write", out.name, *options)
        results = json.loads(pathlib.Path(out.name).read_text())
    return {case: {key.split(":", 1)[1]: kernel["ptx"] for key, kernel in result["kernels"].items()}
            for case, result in results.items()}


def changed_kernels(before: dict, after: dict, kernels: set[str]) -> list[str]:
    """'case kernel' for each of ``kernels`` whose code differs (or was compiled on one side only)."""
    changed = []
    for case in sorted(set(before) | set(after)):
        old, new = before.get(case, {}), after.get(case, {})
        for name in sorted(kernels & (set(old) | set(new))):
            if old.get(name) is None or old.get(name) != new.get(name):
                changed.append(f"{case} {name}")
    if not any(kernels & set(compiled) for compiled in after.values()):
        changed.append(f"no case compiled any of {sorted(kernels)}")
    return changed


def rekey(entries: dict[str, dict], old_identity: str, new_identity: str) -> list[str]:
    """Give the entries recorded for ``old_identity`` the new one, in place; their keys."""
    moved = [key for key, entry in entries.items() if isinstance(entry, dict) and entry.get("kernel") == old_identity]
    for key in moved:
        entries[key]["kernel"] = new_identity
    return moved


def digest_options(args, family: str) -> list[str]:
    schedules = "fp8" if family == "fp8_forward" else args.schedules
    return ["--head-dims", args.head_dims, "--masks", args.masks, "--dtypes", args.dtypes, "--schedules", schedules]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--since", required=True, help="git revision whose kernels the entries were tuned on")
    p.add_argument("--table", type=pathlib.Path, default=SHIPPED)
    p.add_argument("--head-dims", default="64,128,256")
    p.add_argument("--masks", default="none,causal")
    p.add_argument("--dtypes", default="bf16,fp16")
    p.add_argument("--schedules", default="stable,fast,accurate", help="for the 16-bit families (fp8: its own)")
    p.add_argument("--dry-run", action="store_true", help="report, write nothing")
    p.add_argument("--whole-package", action="store_true",
                   help="compile the old kernels through the launchers at --since too (a change to both)")
    p.add_argument("--family", action="append", choices=sorted(KERNEL_FAMILIES),
                   help="re-key this family without compiling (repeatable); needs --reason")
    p.add_argument("--reason", default=None, help="why the --family entries still hold (recorded in the table)")
    args = p.parse_args(argv)
    if bool(args.family) != bool(args.reason):
        p.error("--family and --reason go together: name the families and say why their entries still hold")
    data = json.loads(args.table.read_text())
    new = family_identities()
    if args.family:
        return _carry_by_reason(args, data, new)
    with tempfile.TemporaryDirectory() as tmp:
        old_tree = tree_with_kernels_of(args.since, pathlib.Path(tmp), whole_package=args.whole_package)
        old = identities_in(old_tree)
        recorded = {entry.get("kernel") for entry in data["entries"].values() if isinstance(entry, dict)}
        todo = [f for f in KERNEL_FAMILIES if old[f] != new[f] and old[f] in recorded]
        if not todo:
            print("nothing to carry: no family with entries changed its identity since", args.since)
            return 0
        moved_in_all = 0
        compiled: dict = {}  # families with the same options (forward, backward) share one compile per tree
        for family in todo:
            options = digest_options(args, family)
            if tuple(options) not in compiled:
                compiled[tuple(options)] = (digests_in(old_tree, options), digests_in(ROOT, options))
            changed = changed_kernels(*compiled[tuple(options)], family_kernel_names(family))
            if changed:
                print(f"{family}: compiled code changed, its entries need a re-tune:\n  " + "\n  ".join(changed))
                continue
            moved = rekey(data["entries"], old[family], new[family])
            moved_in_all += len(moved)
            print(f"{family}: same PTX in every case; {len(moved)} entries {old[family]} -> {new[family]}")
    if moved_in_all and not args.dry_run:
        _write_table(args.table, data, data.get("meta", {}))
    return 0


def _write_table(path: pathlib.Path, data: dict, meta: dict) -> None:
    table = cache.TuningTable(gpu=data["gpu"], entries=data["entries"], schema=data["schema"], meta=meta)
    cache.atomic_write_text(path, cache.table_text(table))
    print(f"wrote {path}")


def _carry_by_reason(args, data: dict, new: dict) -> int:
    """--family/--reason: re-key the named families' entries recorded for their identity at --since."""
    with tempfile.TemporaryDirectory() as tmp:
        old = identities_in(tree_with_kernels_of(args.since, pathlib.Path(tmp)))
    moved_in_all = 0
    for family in args.family:
        if old[family] == new[family]:
            print(f"{family}: identity unchanged since {args.since}; nothing to carry")
            continue
        moved = rekey(data["entries"], old[family], new[family])
        moved_in_all += len(moved)
        print(f"{family}: {len(moved)} entries {old[family]} -> {new[family]} (not compiled: {args.reason})")
    if moved_in_all and not args.dry_run:
        meta = dict(data.get("meta", {}))
        note = f"carried without a compile ({', '.join(args.family)}): {args.reason}"
        meta["tuned"] = f"{meta['tuned']} {note}" if meta.get("tuned") else note
        _write_table(args.table, data, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
