"""A tuning table can never fail an attention call: one warning naming the file, then the heuristic.

Each malformed case below is read the way a launch on an H200 reads it (``select_configs`` with
the H200's device properties, on CPU), and must give exactly one warning and the configs the
launch would have had without the file (or without the bad entry). The autotuner, which does
write tables, must fail before measuring anything when it cannot write them.
"""

from __future__ import annotations

import json
import os
import pathlib
import warnings

import pytest
import torch

from flash_inductor import launch
from flash_inductor.autotune import cli
from flash_inductor.tuning import cache
from flash_inductor.tuning.configs import KernelConfig, cuda_heuristic_configs, select_configs
from helpers import make_qkv
from tuning_helpers import (  # noqa: F401  (isolated_tables: an autouse fixture)
    H200_KEY, isolated_tables, fake_h200, query_on, cfg_dict, table_of, fwd_entry, tiny_settings,
)

GOOD_KEY = "stable/bf16/e128/none/s4096/forward"
GOOD = (64, 32)  # not the heuristic's forward tile at E 128 (128x64)
HEURISTIC = cuda_heuristic_configs((9, 0), 2, 128, 128, "stable", "none")


def _user_table(tmp_path) -> pathlib.Path:
    path = tmp_path / "user" / cache.table_filename(H200_KEY)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _good_json() -> dict:
    return table_of(H200_KEY, **{GOOD_KEY.replace("/", "__"): fwd_entry(*GOOD)}).to_json()


def _launch_configs(device):
    """The forward config a bf16 E 128 L 4096 launch gets, and the warnings it raised."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = select_configs(query_on(device), 128, 128, False, mask_kind="none", schedule="stable").forward
        again = select_configs(query_on(device, seq=3000), 128, 128, False, mask_kind="none", schedule="stable")
    assert again.forward == got  # a second launch: same answer, no second warning
    return got, [str(w.message) for w in record]


# ------------------------------------------------------------------------------------------
# A bad file: one warning naming it, then the heuristic
# ------------------------------------------------------------------------------------------


def _write(path: pathlib.Path, case: str) -> None:
    good = _good_json()
    if case == "a folder":
        path.mkdir()
        return
    content = {
        "entries a list": json.dumps({**good, "entries": []}),
        "entries null": json.dumps({**good, "entries": None}),
        "no entries": json.dumps({k: v for k, v in good.items() if k != "entries"}),
        "a list": json.dumps([good]),
        "truncated": json.dumps(good)[:40],
        "empty": "",
        "gpu not a string": json.dumps({**good, "gpu": 7}),
        "schema 2": json.dumps({**good, "schema": 2, "torch": "2.11.0", "triton": "3.6.0"}),
        "another gpu": json.dumps({**good, "gpu": "nvidia-a100_sm80_108sm"}),
    }
    if case == "not text":
        path.write_bytes(b"\xff\xfe\x00garbage")
    else:
        path.write_text(content[case])


FILE_CASES = ["a folder", "entries a list", "entries null", "no entries", "a list", "truncated", "empty",
              "gpu not a string", "schema 2", "another gpu", "not text"]


@pytest.mark.parametrize("case", FILE_CASES)
def test_a_bad_table_file_gives_one_warning_and_the_heuristic(tmp_path, fake_h200, case):
    path = _user_table(tmp_path)
    _write(path, case)
    got, messages = _launch_configs(fake_h200)
    assert got == HEURISTIC.forward
    assert len(messages) == 1 and str(path) in messages[0], messages


def test_a_bad_user_file_leaves_the_shipped_table_in_use(tmp_path, fake_h200):
    shipped = tmp_path / "shipped" / cache.table_filename(H200_KEY)
    shipped.parent.mkdir()
    shipped.write_text(json.dumps(_good_json()))
    _write(_user_table(tmp_path), "entries null")
    got, messages = _launch_configs(fake_h200)
    assert got == KernelConfig(*GOOD, 4, 1) and len(messages) == 1


# ------------------------------------------------------------------------------------------
# A bad entry: dropped with one warning naming the file and the entry; the others stay
# ------------------------------------------------------------------------------------------


def _config(**changes) -> dict:
    return {**cfg_dict(64, 64), **changes}


ENTRY_CASES = {
    "length bucket s0": ("stable/bf16/e128/none/s0/forward", None),
    "length bucket not a power of two": ("stable/bf16/e128/none/s3000/forward", None),
    "width e0": ("stable/bf16/e0/none/s4096/forward", None),
    "width 512": ("stable/bf16/e512/none/s4096/forward", None),
    "unknown schedule": ("turbo/bf16/e128/none/s4096/forward", None),
    "not a bucket key": ("stable/bf16/e128/none/forward", None),
    "block_m 4096": (None, {"forward": _config(block_m=4096)}),
    "block_n 48": (None, {"forward": _config(block_n=48)}),
    "block_m 8": (None, {"forward": _config(block_m=8)}),
    "num_warps 3": (None, {"forward": _config(num_warps=3)}),
    "num_warps 64": (None, {"forward": _config(num_warps=64)}),
    "num_stages 0": (None, {"forward": _config(num_stages=0)}),
    "num_stages 40": (None, {"forward": _config(num_stages=40)}),
    "a boolean block": (None, {"forward": _config(block_m=True)}),
    "a float block": (None, {"forward": _config(block_m=64.0)}),
    "a missing field": (None, {"forward": {"block_m": 64, "block_n": 64, "num_warps": 4}}),
    "the backward's roles": (None, {"backward_dkdv": _config(), "backward_dq": _config()}),
    "configs null": (None, "null"),
    "more shared memory than an H200 has": (None, {"forward": _config(block_m=256, block_n=256, num_stages=8)}),
}


@pytest.mark.parametrize("case", list(ENTRY_CASES))
def test_a_bad_entry_is_dropped_with_one_warning_naming_it(tmp_path, fake_h200, case):
    key, configs = ENTRY_CASES[case]
    key = key or "stable/bf16/e128/none/s1024/forward"
    data = _good_json()
    good = data["entries"][GOOD_KEY]
    bad = dict(good, configs=None if configs == "null" else configs or good["configs"])
    data["entries"][key] = bad
    path = _user_table(tmp_path)
    path.write_text(json.dumps(data))
    got, messages = _launch_configs(fake_h200)
    assert got == KernelConfig(*GOOD, 4, 1)  # the good entry is used (also for L 1024: the bad one is gone)
    assert len(messages) == 1 and str(path) in messages[0] and key in messages[0], messages


@pytest.mark.parametrize("entry", [None, 7, "text", {"configs": {"forward": cfg_dict(64, 32)}}],
                         ids=["null", "a number", "a string", "no kernel or triton"])
def test_an_entry_that_is_not_a_stamped_object_is_dropped(tmp_path, fake_h200, entry):
    data = _good_json()
    data["entries"]["stable/bf16/e128/none/s1024/forward"] = entry
    _user_table(tmp_path).write_text(json.dumps(data))
    got, messages = _launch_configs(fake_h200)
    assert got == KernelConfig(*GOOD, 4, 1) and len(messages) == 1


# ------------------------------------------------------------------------------------------
# Anything else the cache raises on the launch path: one warning, the heuristic
# ------------------------------------------------------------------------------------------


def test_an_error_in_the_lookup_becomes_one_warning(tmp_path, fake_h200, monkeypatch):
    _user_table(tmp_path).write_text(json.dumps(_good_json()))

    def broken(self, bucket):
        raise RuntimeError("an unforeseen bug")

    monkeypatch.setattr(cache.TableView, "lookup", broken)
    got, messages = _launch_configs(fake_h200)
    assert got == HEURISTIC.forward
    assert len(messages) == 1 and "an unforeseen bug" in messages[0]


@pytest.mark.parametrize("where", ["device properties", "the table view", "a kernel identity"])
def test_an_error_in_finding_the_tables_becomes_one_warning(tmp_path, fake_h200, monkeypatch, where):
    _user_table(tmp_path).write_text(json.dumps(_good_json()))

    def fail(*args, **kwargs):
        raise RuntimeError(f"{where} failed")

    if where == "device properties":  # e.g. a driver error; the heuristic reads only the capability
        monkeypatch.setattr(torch.cuda, "get_device_properties", fail)
    elif where == "the table view":
        monkeypatch.setattr(cache.TableView, "__init__", fail)
    else:
        monkeypatch.setattr(cache, "family_identity", fail)
    got, messages = _launch_configs(fake_h200)
    assert got == HEURISTIC.forward
    assert len(messages) == 1 and f"{where} failed" in messages[0], messages


@pytest.mark.launches_kernels
def test_the_op_runs_through_a_broken_table(monkeypatch, device):
    """The whole launch path: a forward with a table whose lookup fails computes the same output
    as without a table, and warns once."""
    q, k, v = make_qkv(1, 2, 2, 37, 37, 16, 16, torch.float32, device, seed=3)
    expected, _ = launch.attention_forward(q, k, v, None, None, 0.0, 0.25, "stable")

    def broken(self, bucket):
        raise KeyError("forward")

    monkeypatch.setattr(cache.TableView, "lookup", broken)
    with cache.override_table(table_of(**{"stable__fp32__e16__none__s128__forward": fwd_entry(16, 16)})):
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            out, _ = launch.attention_forward(q, k, v, None, None, 0.0, 0.25, "stable")
    torch.testing.assert_close(out, expected)
    assert len(record) == 1 and "lookup failed" in str(record[0].message)


# ------------------------------------------------------------------------------------------
# Writing: an unwritable cache folder fails the autotuner before it measures anything
# ------------------------------------------------------------------------------------------


def _unwritable(tmp_path, kind: str) -> pathlib.Path:
    if kind == "a file in the way":
        (tmp_path / "blocker").write_text("")
        return tmp_path / "blocker" / "cache"
    if os.geteuid() == 0:
        pytest.skip("root writes to read-only folders")
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o500)
    return folder


@pytest.mark.parametrize("kind", ["a file in the way", "a read-only folder"])
def test_update_table_names_the_folder_and_the_variable(tmp_path, kind):
    folder = _unwritable(tmp_path, kind)
    with pytest.raises(OSError, match=cache.CACHE_DIR_ENV) as raised:
        cache.update_table(folder / "gpu.json", table_of())
    assert str(folder) in str(raised.value)


@pytest.mark.parametrize("kind", ["a file in the way", "a read-only folder"])
def test_the_autotuner_fails_before_tuning_when_it_cannot_write(tmp_path, monkeypatch, kind):
    folder = _unwritable(tmp_path, kind)
    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(folder))

    def timer(run, configs):
        raise AssertionError("measured before checking that the table can be written")

    argv = ["--dtypes", "fp16", "--head-dims", "16", "--masks", "none", "--schedules", "stable",
            "--passes", "forward", "--seqs", "4096"]
    with pytest.raises(SystemExit) as raised:
        cli.main(argv, settings=tiny_settings(timer), device=torch.device("cpu"))
    message = str(raised.value)
    assert str(folder) in message and cache.CACHE_DIR_ENV in message
