"""The device scripts run where nothing can be fixed mid-call: each must at least parse, and the
benchmark flags the sparse/decode script passes must be flags the benchmarks take."""

import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "tools").glob("*.sh"))


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_device_script_parses(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("script", ["gpu_sparse_decode.sh", "gpu_hopper_ab.sh"])
def test_device_script_passes_flags_the_benchmarks_take(script):
    text = (ROOT / "tools" / script).read_text().replace("\\\n", " ")  # join continued lines
    calls = re.findall(r"python3 -m (benchmarks[.\w]+)([^\n]*)", text)
    assert len(calls) >= 4
    # One --help a module (each starts a Python that imports torch): the flags of all its calls.
    flags = {}
    for module, rest in calls:
        flags.setdefault(module, set()).update(re.findall(r"(--[a-z][a-z-]*)", rest))
    for module, used in flags.items():
        helptext = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True,
                                  text=True, check=True).stdout
        for flag in sorted(used):
            assert flag in helptext, f"{module} takes no {flag}"
