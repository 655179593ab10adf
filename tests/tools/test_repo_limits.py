"""The release's size rules, held by CI: a README a newcomer reads in one sitting, current results
only (each one cited by the README or a doc), and shipped tables that hold configs, not history."""

import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def _tracked(*paths: str) -> list[str]:
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "--", *paths], capture_output=True, text=True)
    return [line for line in out.stdout.splitlines() if line]


def test_readme_and_performance_notes_stay_short():
    assert (ROOT / "README.md").stat().st_size <= 20_000, "README.md is over 20 KB: move detail to docs/"
    assert (ROOT / "docs" / "performance.md").stat().st_size <= 30_000, "docs/performance.md is over 30 KB"


def test_the_lab_stays_small():
    """benchmarks/ and tools/ hold what users run and what produces the results the docs cite
    (CONTRIBUTING.md): one-off probes leave the tree, and git keeps them."""
    lines = sum(len((ROOT / path).read_bytes().splitlines()) for path in _tracked("benchmarks", "tools")
                if not path.startswith("benchmarks/results/") and (ROOT / path).exists())
    assert lines <= 8_000, f"benchmarks/ + tools/ hold {lines} lines (at most 8,000): retire probes, share helpers"


def test_results_are_few_and_each_is_cited():
    files = sorted(p.name for p in RESULTS.iterdir() if p.is_file() and p.name != "README.md")
    assert len(files) <= 40, f"benchmarks/results holds {len(files)} files (at most 40): replace superseded runs"
    cited_text = "\n".join(
        (ROOT / path).read_text(errors="replace")
        for path in _tracked("*.md", "*.py", "*.sh")
        # A copy of the tree whose index is older than its files (the device machine's) lists deleted files.
        if not path.startswith("benchmarks/results/") and (ROOT / path).exists()
    )
    # A citation may abbreviate the common prefix ("…_20261202_grid.json"), so match the name's tail
    # after the GPU and date, or the whole stem.
    uncited = [f for f in files if f not in cited_text and pathlib.Path(f).stem not in cited_text
               and not any(tail in cited_text for tail in _abbreviations(f))]
    assert not uncited, f"results no README/doc/script cites (remove them or cite them): {uncited}"


def _abbreviations(name: str) -> list[str]:
    parts = name.split("_")
    return ["…_" + "_".join(parts[i:]) for i in range(1, len(parts))]


def test_shipped_tables_are_small():
    tables = (ROOT / "flash_inductor" / "tuning" / "tables").glob("*.json")
    total = sum(p.stat().st_size for p in tables)
    assert total <= 100_000, f"shipped tables total {total} bytes (at most 100 KB): keep configs, not search history"


def test_readme_layout_names_every_package_and_top_level_module():
    """The README's Layout block names each subpackage and top-level module of flash_inductor, and
    each name it gives (``name/`` or ``name.py``) exists, so the map and the tree cannot drift apart."""
    import re

    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index("## Layout"):]
    block = block[block.index("```") + 3:]
    block = block[:block.index("```")]
    package = ROOT / "flash_inductor"
    present = {p.name + "/" for p in package.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    present |= {p.name for p in package.glob("*.py") if p.name != "__init__.py"}
    named = set(re.findall(r"\b([a-z_]+(?:\.py|/))", block.split("\ntests/")[0]))
    named.discard("flash_inductor/")
    assert present - named == set(), f"README's Layout leaves out {sorted(present - named)}"
    assert named - present == set(), f"README's Layout names what the package lacks: {sorted(named - present)}"


def test_docs_cite_only_scripts_that_exist():
    """Every benchmark or tool a doc names (`benchmarks/x.py`, `python -m tools.y`, `tools/gpu/z.sh`)
    exists in the tree, unless its paragraph names the commit that holds it (a retired probe:
    "benchmarks/experiments/x.py at commit f7e9ac3")."""
    import re

    docs = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "benchmarks" / "README.md",
            ROOT / "flash_inductor" / "tuning" / "tables" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    cite = re.compile(r"(?:python3? -m |`)((?:benchmarks|tools)[./][\w./-]*\w)")
    commit = re.compile(r"(?:commit|at|show) [0-9a-f]{7}\b")
    missing = []
    for doc in docs:
        for paragraph in re.split(r"\n\s*\n|\n(?=\s*- )", doc.read_text()):
            if commit.search(paragraph):
                continue
            for name in cite.findall(paragraph):
                path = ROOT / name if "/" in name else ROOT.joinpath(*name.split("."))
                # A results file may be cited by its name's start (`…/bench_nvidia-h200_2026…`).
                if not (path.exists() or path.with_suffix(".py").exists() or any(path.parent.glob(path.name + "*"))):
                    missing.append(f"{doc.relative_to(ROOT)}: {name}")
    assert not missing, "docs cite scripts the tree does not hold (name the commit that does):\n" + "\n".join(missing)
