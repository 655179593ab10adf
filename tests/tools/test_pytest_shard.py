"""tools/pytest_shard.py: the shards of one N are disjoint, cover every collected test, and agree
under pytest-xdist; a malformed --shard is a usage error that names the option."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
TESTS = {
    "test_a.py": "import pytest\n\n@pytest.mark.parametrize('i', range(7))\ndef test_x(i):\n    pass\n\n"
                 "def test_y():\n    pass\n",
    "test_b.py": "def test_z():\n    pass\n\ndef test_w():\n    pass\n",
}


def _pytest(folder, *args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tools.pytest_shard", "-p", "no:cacheprovider",
                           "-q", *args, str(folder)], cwd=folder, env=env, capture_output=True, text=True,
                          timeout=300)


def _collected(folder, *args):
    run = _pytest(folder, "--collect-only", *args)
    assert run.returncode == 0, run.stdout + run.stderr
    return [line for line in run.stdout.splitlines() if "::" in line]


@pytest.fixture
def suite(tmp_path):
    for name, text in TESTS.items():
        (tmp_path / name).write_text(text)
    return tmp_path


def test_shards_are_disjoint_and_cover_every_test(suite):
    everything = _collected(suite)
    assert len(everything) == 10
    for count in (1, 3, 4):
        shards = [_collected(suite, "--shard", f"{index}/{count}") for index in range(1, count + 1)]
        assert sorted(sum(shards, [])) == sorted(everything)
        assert all(abs(len(shard) - len(everything) / count) < 1 for shard in shards)
    # Round-robin in collection order: a parametrized test's cases spread over the shards.
    assert _collected(suite, "--shard", "2/3") == ["test_a.py::test_x[1]", "test_a.py::test_x[4]",
                                                   "test_a.py::test_y"]


def test_xdist_workers_run_the_controllers_shard(suite):
    pytest.importorskip("xdist")
    run = _pytest(suite, "--shard", "1/2", "-n", "2")
    assert run.returncode == 0 and "5 passed" in run.stdout, run.stdout + run.stderr


@pytest.mark.parametrize("spec", ["0/2", "3/2", "2", "a/b", "1/0"])
def test_a_malformed_shard_names_the_option(suite, spec):
    run = _pytest(suite, "--shard", spec)
    assert run.returncode != 0 and "--shard" in run.stderr and "I/N" in run.stderr, run.stderr
