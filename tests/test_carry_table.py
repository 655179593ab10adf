"""tools.carry_table_entries: a family's stale entries are re-stamped and marked; nothing else moves."""

from __future__ import annotations

import json
import pathlib

from flash_inductor.tuning.cache import entry_is_current, entry_kernel_hash
from tools import carry_table_entries as carry_tool

BWD_STALE = "stable/bf16/e64/none/s4096/backward"
BWD_CURRENT = "stable/bf16/e128/none/s4096/backward"
FWD_STALE = "stable/bf16/e64/none/s4096/forward"
FP8_STALE = "fp8/bf16/e64/none/s4096/forward"


def _table(tmp_path) -> pathlib.Path:
    entries = {
        BWD_STALE: {"configs": {"backward_dq": {"block_m": 64}}, "kernel_hash": "old"},
        BWD_CURRENT: {"configs": {}, "kernel_hash": entry_kernel_hash(BWD_CURRENT)},
        FWD_STALE: {"configs": {}, "kernel_hash": "old"},
        FP8_STALE: {"configs": {}, "kernel_hash": "old"},
        "stable/bf16/e64/causal/s4096/backward": None,  # a bucket whose every candidate was rejected
    }
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"schema": 2, "meta": {}, "entries": entries}))
    return path


def test_only_the_named_familys_stale_entries_are_carried(tmp_path, capsys):
    path = _table(tmp_path)
    before = json.loads(path.read_text())["entries"]
    assert carry_tool.main(["--table", str(path), "--family", "backward", "--reason", "the fold", "--meta-key", "s21"]) == 0
    after = json.loads(path.read_text())
    entries = after["entries"]
    assert entry_is_current(BWD_STALE, entries[BWD_STALE]) and entries[BWD_STALE]["carried_from"] == "the fold"
    assert entries[BWD_STALE]["configs"] == before[BWD_STALE]["configs"]
    for key in (BWD_CURRENT, FWD_STALE, FP8_STALE, "stable/bf16/e64/causal/s4096/backward"):
        assert entries[key] == before[key], key
    assert after["meta"]["s21"] == "1 backward entries carried: the fold"
    assert "carried 1 backward entries" in capsys.readouterr().out


def test_the_fp8_forward_is_its_own_family(tmp_path):
    path = _table(tmp_path)
    carry_tool.main(["--table", str(path), "--family", "fp8_forward", "--reason", "fp8 change"])
    entries = json.loads(path.read_text())["entries"]
    assert entries[FP8_STALE]["carried_from"] == "fp8 change" and entry_is_current(FP8_STALE, entries[FP8_STALE])
    assert entries[FWD_STALE]["kernel_hash"] == "old" and "carried_from" not in entries[FWD_STALE]
