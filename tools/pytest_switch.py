"""A pytest plugin that sets module switches of the launch path before any test runs, so the GPU
tests can check a switch's other setting before it becomes the default (xdist passes ``-p``
plugins on to its workers):

    FLASH_INDUCTOR_SWITCHES=launch.hopper.E64_BLOCK_N_64=1 python3 -m pytest -p tools.pytest_switch tests/unit/test_hopper_fwd.py

FLASH_INDUCTOR_SWITCHES: comma-separated ``module.path.NAME=0|1`` under ``flash_inductor``.
"""

from __future__ import annotations

import importlib
import os


def pytest_configure(config):
    for item in filter(None, os.environ.get("FLASH_INDUCTOR_SWITCHES", "").split(",")):
        path, _, value = item.partition("=")
        module_path, _, name = path.rpartition(".")
        module = importlib.import_module(f"flash_inductor.{module_path}")
        if not hasattr(module, name):
            raise ValueError(f"FLASH_INDUCTOR_SWITCHES: flash_inductor.{module_path} has no switch {name!r}")
        setattr(module, name, value not in ("0", "false", "False", ""))
        print(f"pytest_switch: flash_inductor.{path} = {getattr(module, name)}")
