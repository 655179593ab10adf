"""A pytest plugin that runs one shard of the collected tests, so that a suite longer than one
device call (the whole GPU suite takes about 19 minutes on one H200; a call allows 10) runs over
several calls of one GPU:

    python3 -m pytest -p tools.pytest_shard --shard 1/2 tests      # the first of two shards
    SHARD=2/3 bash tools/gpu/suite.sh                              # the second of three, through the script

Tests are dealt round-robin in collection order, so every shard gets its share of each file's
tests, the long ones (test_kernels.py alone runs longer than a call) and the short ones alike. The
shards of one N are disjoint and together hold every test. Under pytest-xdist the controller and
each worker collect in the same order and deal the same way (xdist hands ``-p`` plugins on), so
they agree on the shard.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="I/N",
                     help="run only the I-th of N round-robin shards of the collected tests (1 <= I <= N)")


def parse_shard(text: str) -> tuple[int, int]:
    """(I, N) from "I/N", or a UsageError that names the option and the form it takes."""
    index, sep, count = text.partition("/")
    try:
        index, count = int(index), int(count)
    except ValueError:
        index = count = 0
    if not sep or not 1 <= index <= count:
        raise pytest.UsageError(f"--shard {text!r}: expected I/N with 1 <= I <= N, e.g. --shard 1/2")
    return index, count


def pytest_collection_modifyitems(config, items):
    spec = config.getoption("--shard")
    if spec is None:
        return
    index, count = parse_shard(spec)
    kept = [item for position, item in enumerate(items) if position % count == index - 1]
    dropped = [item for position, item in enumerate(items) if position % count != index - 1]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = kept
