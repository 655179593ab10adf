"""The device scripts (tools/gpu/) run where nothing can be fixed mid-call: each must at least parse,
and the benchmark flags the steps pass must be flags the benchmarks take."""

import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "tools").rglob("*.sh"))


def test_the_device_scripts_sit_together():
    assert {p.relative_to(ROOT / "tools").as_posix() for p in SCRIPTS} == {
        "gpu/all.sh", "gpu/env.sh", "gpu/fetch_wheels.sh", "gpu/steps.sh", "gpu/suite.sh", "gpu/tune.sh"}


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_device_script_parses(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_steps_lists_its_steps_and_refuses_an_unknown_one(tmp_path):
    usage = subprocess.run(["bash", "tools/gpu/steps.sh"], cwd=ROOT, capture_output=True, text=True,
                           env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path)})
    assert usage.returncode == 2 and "hopper_tests" in usage.stderr and "grid" in usage.stderr
    header = usage.stderr
    script = (ROOT / "tools" / "gpu" / "steps.sh").read_text()
    cases = re.findall(r"^    ([a-z_0-9|]+)\)$", script, flags=re.M)
    steps = {name for case in cases for name in case.split("|")}
    assert len(steps) >= 15
    assert not [step for step in steps if step not in header], "a step the header does not describe"


@pytest.mark.parametrize("script", ["steps.sh", "tune.sh"])
def test_device_script_passes_flags_the_benchmarks_take(script):
    text = (ROOT / "tools" / "gpu" / script).read_text().replace("\\\n", " ")  # join continued lines
    calls = re.findall(r"python3 -m (benchmarks[.\w]+)([^\n]*)", text)
    if script == "tune.sh":  # its bench call is an array spread over lines
        calls = [("benchmarks.bench_attention", text[text.index("BENCH=("):text.index("--out \"$OUT\")")])]
    assert calls
    # One --help a module (each starts a Python that imports torch): the flags of all its calls.
    flags = {}
    for module, rest in calls:
        flags.setdefault(module, set()).update(re.findall(r"(--[a-z][a-z-]*)", rest))
    for module, used in flags.items():
        helptext = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True,
                                  text=True, check=True).stdout
        for flag in sorted(used):
            assert flag in helptext, f"{module} takes no {flag}"
