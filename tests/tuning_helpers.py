"""Shared helpers of the tuning tests (test_autotune.py, test_tuning_tables.py,
test_tuning_cache_robustness.py): isolated table folders, an H200 as the CPU sees it, table and
entry builders, tiny search settings and a fake timer."""

from __future__ import annotations

import pathlib
import types

import pytest
import torch

from flash_inductor import launch
from flash_inductor.tuning import cache
from flash_inductor.tuning.buckets import Bucket
from flash_inductor.tuning.configs import AttentionConfigs, KernelConfig, heuristic_configs
from flash_inductor.autotune.measure import Shape
from flash_inductor.autotune.plan import PlannedBucket
from flash_inductor.autotune.search import BucketTask, Settings, Tuner
from flash_inductor.autotune.search_space import SearchSpace
from helpers import DEVICE

ROOT = pathlib.Path(__file__).resolve().parent.parent  # the repository
SHIPPED_DIR = ROOT / "flash_inductor" / "tuning" / "tables"
H200_KEY = "nvidia-h200_sm90_132sm"
H200 = types.SimpleNamespace(name="NVIDIA H200", major=9, minor=0, multi_processor_count=132,
                             shared_memory_per_block_optin=232448)
INTERPRETER_CONFIGS = AttentionConfigs(*(KernelConfig(16, 16, 1, 1),) * 3)


@pytest.fixture(autouse=True)
def isolated_tables(tmp_path, monkeypatch):
    """Every test gets empty user and shipped table folders and a cold in-memory cache."""
    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path / "user"))
    monkeypatch.setattr(cache, "shipped_tables_dir", lambda: tmp_path / "shipped")
    cache.clear_cache()
    yield
    cache.clear_cache()


@pytest.fixture
def fake_h200(monkeypatch) -> torch.device:
    """torch.cuda answers as on an H200 (no GPU needed): the device the launch-path lookup sees."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: H200)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (H200.major, H200.minor))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    cache._cuda_gpu_key.cache_clear()
    cache._cuda_smem_limit.cache_clear()
    yield torch.device("cuda", 0)
    cache._cuda_gpu_key.cache_clear()
    cache._cuda_smem_limit.cache_clear()


def query_on(device: torch.device, dtype: torch.dtype = torch.bfloat16, seq: int = 4096, head_dim: int = 128):
    """What select_configs reads of a query (device, dtype, shape), without allocating on the device."""
    return types.SimpleNamespace(device=device, dtype=dtype, shape=(1, 8, seq, head_dim))


def cfg_dict(bm, bn, warps=4, stages=1) -> dict:
    return KernelConfig(bm, bn, warps, stages).to_dict()


def table_of(gpu="fake-gpu_sm90_132sm", **entries) -> cache.TuningTable:
    """A current-code table; keyword names are bucket keys with '/' written as '__'."""
    return cache.TuningTable.for_current_code(gpu, {k.replace("__", "/"): v for k, v in entries.items()})


def fwd_entry(bm, bn):
    return {"configs": {"forward": cfg_dict(bm, bn)}}


def bwd_entry(dkdv, dq):
    return {"configs": {"backward_dkdv": cfg_dict(*dkdv), "backward_dq": cfg_dict(*dq)}}


def tiny_settings(timer, space=SearchSpace("tiny", (16, 32), (16, 32), (4,), (1,)), **changes) -> Settings:
    base = dict(space=space, tokens=32, hidden=16, check_shape=Shape(1, 2, 37, 37), max_timing_seq=32, top_k=2,
                timer=timer)
    return Settings(**{**base, **changes})


def builtin_configs(dtype: torch.dtype, width: int) -> AttentionConfigs:
    """The built-in configs the tuner starts from on the suite's device (the interpreter's fixed
    tiles on CPU, the capability-based ones on a GPU): the baseline every tuned entry must beat."""
    probe = torch.empty(1, 1, 1, width, dtype=dtype, device=DEVICE)
    return heuristic_configs(probe, width, width, launch.interpreter_enabled())


def cost_key(role: str, configs: AttentionConfigs) -> tuple:
    c = getattr(configs, role)
    return (role, c.block_m, c.block_n, c.num_warps)


def table_file(out: pathlib.Path) -> pathlib.Path:
    name = "triton-interpreter" if launch.interpreter_enabled() else cache.device_gpu_key(torch.device(DEVICE))
    return out / f"{name}.json"


def timer_from(costs: dict, default: float = 10.0, calls: list | None = None):
    """Fake milliseconds: costs maps (role, block_m, block_n, num_warps) -> ms, summed over the
    roles it names (default for configs it does not list). Runs the candidate once, so the
    timing path itself is exercised."""
    roles = sorted({role for role, *_ in costs})

    def timer(run, configs: AttentionConfigs) -> float:
        run()
        if calls is not None:
            calls.append(configs)
        return sum(costs.get((role, c.block_m, c.block_n, c.num_warps), default)
                   for role, c in ((r, getattr(configs, r)) for r in roles))

    return timer


def run_plan(planned: list[PlannedBucket], settings: Settings) -> dict[Bucket, BucketTask]:
    tuner = Tuner(DEVICE, settings)
    done: dict[Bucket, BucketTask] = {}
    assert tuner.run([tuner.task(p) for p in planned], done) == []
    return done
