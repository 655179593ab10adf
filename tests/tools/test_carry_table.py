"""tools/carry_table_entries.py and tools/ship_table.py: moving entries between kernel versions and
schemas without losing or mislabelling any.

The carry tool's compiles (sm_90 PTX of two kernel versions) take minutes, so the tests exercise
its decisions on given digests, and its one cheap real step: rebuilding the kernels of a git
revision and computing their identity."""

from __future__ import annotations

import json
import pathlib
import subprocess

import pytest

from flash_inductor.tuning import cache
from tuning_helpers import ROOT, cfg_dict, isolated_tables, fwd_entry, table_of  # noqa: F401

from tools import carry_table_entries as carry_tool
from tools import ship_table as ship_tool

BEFORE = {"stable/bf16/e64/none": {"_attn_fwd": "a1", "_attn_bwd_dq": "b1", "_attn_bwd_dkdv": "c1"},
          "stable/bf16/e64/causal": {"_attn_fwd": "a2", "_attn_bwd_dq": "b2", "_attn_bwd_dkdv": "c2"}}


def test_only_unchanged_code_is_carried():
    same = json.loads(json.dumps(BEFORE))
    assert carry_tool.changed_kernels(BEFORE, same, {"_attn_fwd"}) == []
    moved_dq = json.loads(json.dumps(BEFORE))
    moved_dq["stable/bf16/e64/causal"]["_attn_bwd_dq"] = "b3"
    assert carry_tool.changed_kernels(BEFORE, moved_dq, {"_attn_fwd"}) == []  # another family's kernel
    assert carry_tool.changed_kernels(BEFORE, moved_dq, {"_attn_bwd_dq", "_attn_bwd_dkdv"}) == \
        ["stable/bf16/e64/causal _attn_bwd_dq"]
    # A kernel compiled on one side only, or never, proves nothing.
    missing = {case: {k: v for k, v in kernels.items() if k != "_attn_bwd_dkdv"} for case, kernels in BEFORE.items()}
    assert len(carry_tool.changed_kernels(BEFORE, missing, {"_attn_bwd_dkdv"})) == 3  # both cases, and none at all
    assert carry_tool.changed_kernels(BEFORE, BEFORE, {"_attn_fwd_fp8"}) == ["no case compiled any of ['_attn_fwd_fp8']"]


def test_rekey_moves_only_the_old_identitys_entries():
    entries = {"a/forward": {"configs": {}, "kernel": "old", "triton": "3.6.0"},
               "b/forward": {"configs": {}, "kernel": "other", "triton": "3.6.0"},
               "c/backward": None}
    assert carry_tool.rekey(entries, "old", "new") == ["a/forward"]
    assert entries["a/forward"] == {"configs": {}, "kernel": "new", "triton": "3.6.0"}
    assert entries["b/forward"]["kernel"] == "other" and entries["c/backward"] is None


def test_the_kernels_of_a_revision_have_the_identity_recorded_for_them(tmp_path):
    """HEAD's kernels rebuilt in a scratch tree give the identity this checkout computes (the
    shipped table records it), so a later edit is compared against the right code."""
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "flash_inductor/kernels"],
                           capture_output=True, text=True, check=True).stdout
    if dirty:
        pytest.skip("the kernels have uncommitted edits")
    tree = carry_tool.tree_with_kernels_of("HEAD", tmp_path)
    assert (tree / "flash_inductor" / "kernels" / "attn_fwd.py").read_bytes() == \
        (ROOT / "flash_inductor" / "kernels" / "attn_fwd.py").read_bytes()
    assert carry_tool.identities_in(tree) == cache.family_identities()


def _schema2(tmp_path) -> pathlib.Path:
    stale = {"configs": {"forward": cfg_dict(32, 32)}, "kernel_hash": "0" * 64, "ms": 2.0}
    current = {"configs": {"forward": cfg_dict(64, 32)}, "kernel_hash": ship_tool.schema2_family_hash("forward"),
               "ms": 1.0, "heuristic": {"configs": {"forward": cfg_dict(128, 64)}, "ms": 1.5},
               "speedup_vs_heuristic": 1.5, "ranking": {"forward": []}, "carried_from": "a change"}
    data = {"schema": 2, "gpu": "fake-gpu_sm90_132sm", "torch": "2.11.0", "triton": "3.6.0",
            "meta": {"device_name": "Fake GPU", "notes": "history"},
            "entries": {"stable/fp16/e64/none/s1024/forward": current, "stable/fp16/e64/none/s4096/forward": stale}}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    return path


def test_ship_converts_schema_2_keeping_entries_tuned_for_these_kernels(tmp_path, capsys):
    out, records = tmp_path / "shipped.json", tmp_path / "records.json"
    assert ship_tool.main([str(_schema2(tmp_path)), "--out", str(out), "--records", str(records)]) == 0
    table = cache.read_table(out)
    assert table.meta == {"device_name": "Fake GPU"}  # the old notes stay in git, not in the package
    assert table.entries == {"stable/fp16/e64/none/s1024/forward": {
        "configs": {"forward": cfg_dict(64, 32)}, "kernel": cache.family_identity("forward"), "triton": "3.6.0"}}
    (row,) = json.loads(records.read_text())["rows"]
    assert row["winner"] == "64x32/w4/s1" and row["heuristic_ms"] == 1.5 and row["carried"] is True
    printed = capsys.readouterr().out
    assert "left out 1 entries" in printed and "stable/fp16/e64/none/s4096/forward" in printed


def test_ship_strips_a_retunes_table_and_merges_it(tmp_path):
    out, records = tmp_path / "shipped.json", tmp_path / "records.json"
    cache.update_table(out, table_of(**{"stable__fp16__e64__none__s1024__forward": fwd_entry(64, 32)}))
    retune = table_of(**{"stable__fp16__e64__none__s4096__forward": {**fwd_entry(32, 32), "ms": 1.0, "space": "full"}})
    source = tmp_path / "retune.json"
    source.write_text(json.dumps(retune.to_json()))
    assert ship_tool.main([str(source), "--out", str(out), "--records", str(records)]) == 0
    entries = cache.read_table(out).entries
    assert set(entries) == {"stable/fp16/e64/none/s1024/forward", "stable/fp16/e64/none/s4096/forward"}
    assert all(set(entry) == set(cache.LOOKUP_FIELDS) for entry in entries.values())


def test_family_and_reason_rekey_without_compiling_and_record_why(tmp_path, monkeypatch):
    table = tmp_path / "table.json"
    data = {"schema": 3, "gpu": "fake-gpu_sm90_132sm",
            "meta": {"tuned": "on a fake GPU."},
            "entries": {"a/forward": {"configs": {}, "kernel": "old-f", "triton": "3.6.0"},
                        "a/backward": {"configs": {}, "kernel": "old-b", "triton": "3.6.0"}}}
    table.write_text(json.dumps(data))
    monkeypatch.setattr(carry_tool, "family_identities", lambda: {"forward": "new-f", "backward": "new-b",
                                                                   "fp8_forward": "same"})
    monkeypatch.setattr(carry_tool, "identities_in", lambda tree: {"forward": "old-f", "backward": "old-b",
                                                                    "fp8_forward": "same"})
    monkeypatch.setattr(carry_tool, "tree_with_kernels_of", lambda rev, into, whole_package=False: into)
    monkeypatch.setattr(carry_tool.cache, "atomic_write_text", lambda path, text: path.write_text(text))
    monkeypatch.setattr(carry_tool.cache, "table_text", lambda t: json.dumps(
        {"schema": t.schema, "gpu": t.gpu, "meta": t.meta, "entries": t.entries}))
    with pytest.raises(SystemExit):
        carry_tool.main(["--since", "x", "--table", str(table), "--family", "backward"])  # no reason
    assert carry_tool.main(["--since", "x", "--table", str(table), "--family", "backward",
                            "--reason", "same tiles; PTX compared"]) == 0
    written = json.loads(table.read_text())
    assert written["entries"]["a/backward"]["kernel"] == "new-b"
    assert written["entries"]["a/forward"]["kernel"] == "old-f"  # a family not named stays
    assert written["meta"]["tuned"] == "on a fake GPU. carried without a compile (backward): same tiles; PTX compared"
