"""Tuning tables on CPU: keys, files, validity and lookup, and that a table reaches the launcher
and the compile cache key (split from test_autotune.py)."""

from __future__ import annotations

import json
import multiprocessing
import pathlib
import warnings

import pytest
import torch

from flash_inductor import launch
from flash_inductor.passes.graph_pass import FlashAttentionPass
from flash_inductor.tuning import cache
from flash_inductor.tuning.buckets import Bucket
from flash_inductor.tuning.configs import KernelConfig, select_configs
from helpers import DEVICE, make_qkv, randn, spy_on_launches
from tuning_helpers import (  # noqa: F401  (isolated_tables: an autouse fixture)
    ROOT, isolated_tables, cfg_dict, table_of, fwd_entry, bwd_entry, builtin_configs,
)


def test_gpu_key_normalisation():
    assert cache.gpu_key("NVIDIA H200", (9, 0), 132) == "nvidia-h200_sm90_132sm"
    assert cache.gpu_key("NVIDIA H100 80GB HBM3", (9, 0), 132) == "nvidia-h100-80gb-hbm3_sm90_132sm"
    assert cache.gpu_key("  Tesla V100-SXM2-16GB ", (7, 0), 80) == "tesla-v100-sxm2-16gb_sm70_80sm"
    assert cache.gpu_key("NVIDIA GeForce RTX 5090", (12, 0), 170) == "nvidia-geforce-rtx-5090_sm120_170sm"


def test_user_cache_dir_precedence(monkeypatch, tmp_path):
    assert cache.user_cache_dir() == tmp_path / "user"
    monkeypatch.delenv(cache.CACHE_DIR_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.user_cache_dir() == tmp_path / "xdg" / "flash_inductor"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache.user_cache_dir() == tmp_path / "home" / ".cache" / "flash_inductor"


def test_table_round_trip_and_validation(tmp_path):
    table = table_of(**{"stable__fp16__e64__none__s1024__forward": fwd_entry(64, 32)})
    path = tmp_path / "t.json"
    cache.update_table(path, table)
    data = json.loads(path.read_text())
    assert data["schema"] == cache.SCHEMA_VERSION
    assert [e["kernel_hash"] for e in data["entries"].values()] == [cache.family_hash("forward")]
    assert {"torch", "triton", "gpu", "entries"} <= set(data)
    assert cache.read_table(path).entries == table.entries
    bad = dict(data, entries={"stable/fp16/e64/none/s1024/forward": {"configs": {"forward": cfg_dict(48, 32)}}})
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="power of two"):
        cache.read_table(path)


def test_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "tables" / "gpu.json"
    cache.update_table(path, table_of(**{"stable__fp16__e64__none__s1024__forward": fwd_entry(64, 32)}))
    before = path.read_bytes()

    def crash(fd):
        raise OSError("disk full")

    monkeypatch.setattr(cache.os, "fsync", crash)
    with pytest.raises(OSError, match="disk full"):
        cache.update_table(path, table_of(**{"stable__fp16__e64__none__s2048__forward": fwd_entry(32, 32)}))
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["gpu.json", "gpu.json.lock"]


def _write_entries(path: str, worker: int, count: int) -> None:
    for i in range(count):
        key = f"stable/fp16/e{16 << worker}/none/s{128 << i}/forward"
        cache.update_table(path, cache.TuningTable.for_current_code("fake-gpu_sm90_132sm", {key: fwd_entry(64, 32)}))


def test_concurrent_writers_keep_every_entry(tmp_path):
    """Four processes each add five entries to one file at once: the lock and the merge under it
    keep all twenty (without them, read-modify-write loses updates)."""
    path = str(tmp_path / "gpu.json")
    ctx = multiprocessing.get_context("fork")
    workers = [ctx.Process(target=_write_entries, args=(path, w, 5)) for w in range(4)]
    for p in workers:
        p.start()
    for p in workers:
        p.join(60)
        assert p.exitcode == 0
    assert len(cache.read_table(path).entries) == 20


def _install(table: cache.TuningTable, where: pathlib.Path) -> None:
    where.mkdir(parents=True, exist_ok=True)
    (where / cache.table_filename(table.gpu)).write_text(json.dumps(table.to_json()))


@pytest.mark.parametrize("change", ["triton", "torch", "schema", "gpu"])
def test_stale_tables_are_ignored_with_one_warning(tmp_path, change):
    gpu = "fake-gpu_sm90_132sm"
    table = table_of(gpu, **{"stable__fp16__e64__none__s1024__forward": fwd_entry(64, 32)})
    stale = {"triton": dict(triton="0.0.1"), "torch": dict(torch="1.0.0"), "schema": dict(schema=0),
             "gpu": dict(gpu="other_sm80_108sm")}[change]
    bad = cache.TuningTable(**{**vars(table), **stale})
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / cache.table_filename(gpu)).write_text(json.dumps(bad.to_json()))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert cache.load_tables(gpu) is None
    messages = [str(w.message) for w in record]
    assert len(messages) == 2 and "ignoring the user tuning table" in messages[0]  # then: no table at all
    assert all("python -m flash_inductor.autotune" in m for m in messages)
    _install(table, tmp_path / "user")  # the current table is used again after a reload
    cache.clear_cache()
    assert cache.load_tables(gpu).lookup(Bucket.parse("stable/fp16/e64/none/s1024/forward")) is not None


def test_entries_of_a_changed_kernel_family_are_ignored_with_one_warning(tmp_path):
    gpu = "fake-gpu_sm90_132sm"
    table = table_of(gpu, **{"stable__fp16__e64__none__s1024__forward": fwd_entry(64, 32),
                           "stable__fp16__e64__none__s1024__backward": bwd_entry((32, 64), (64, 32))})
    backward_key = "stable/fp16/e64/none/s1024/backward"
    entries = dict(table.entries)
    entries[backward_key] = {**entries[backward_key], "kernel_hash": "0" * 64}  # tuned for another backward
    _install(cache.TuningTable(**{**vars(table), "entries": entries}), tmp_path / "user")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        view = cache.load_tables(gpu)
        view = cache.load_tables(gpu)  # read once: one warning
    (message,) = [str(w.message) for w in record]
    assert "1 backward" in message and "--resume" in message
    assert view.lookup(Bucket.parse("stable/fp16/e64/none/s1024/forward")) == {"forward": cfg_dict(64, 32)}
    assert view.lookup(Bucket.parse(backward_key)) is None  # the heuristic, not a stale config
    # A later write (e.g. `--resume` re-tuning another bucket) keeps the current entries, drops the stale one.
    path = tmp_path / "user" / cache.table_filename(gpu)
    written = cache.update_table(path, table_of(gpu, **{"stable__fp16__e64__none__s4096__forward": fwd_entry(32, 32)}))
    assert set(written.entries) == {"stable/fp16/e64/none/s1024/forward", "stable/fp16/e64/none/s4096/forward"}


def _kernel_copy(tmp_path, monkeypatch) -> pathlib.Path:
    copy = tmp_path / "kernels"
    copy.mkdir()
    for path in (ROOT / "flash_inductor" / "kernels").glob("*.py"):
        (copy / path.name).write_bytes(path.read_bytes())
    monkeypatch.setattr(cache, "_KERNELS_DIR", copy)
    cache.family_hash.cache_clear()
    return copy


def test_a_kernel_file_changes_exactly_the_families_built_from_it(tmp_path, monkeypatch):
    copy = _kernel_copy(tmp_path, monkeypatch)
    try:
        before = cache.kernel_hashes()
        for name in sorted(set().union(*cache.KERNEL_FAMILIES.values())):
            source = copy / name
            original = source.read_text()
            source.write_text(original + "\n# a comment\n")
            cache.family_hash.cache_clear()
            changed = {f for f, h in cache.kernel_hashes().items() if h != before[f]}
            assert changed == {f for f, files in cache.KERNEL_FAMILIES.items() if name in files}, name
            source.write_text(original)
            cache.family_hash.cache_clear()
    finally:
        monkeypatch.undo()
        cache.family_hash.cache_clear()


def test_kernel_families_cover_every_tuned_kernel_and_its_imports():
    """Each kernel file but the monitoring one (fixed launch sizes) belongs to a family, and a
    family's files import kernel code only from files of the same family, so its hash covers
    everything its launches compile."""
    import re

    kernels = ROOT / "flash_inductor" / "kernels"
    untuned = {"__init__.py", "monitor_stats.py"}
    families = cache.KERNEL_FAMILIES
    assert {p.name for p in kernels.glob("*.py")} - untuned == set().union(*families.values())
    for family, files in families.items():
        for name in files:
            imported = {m + ".py" for m in re.findall(r"^from \.(\w+) import", (kernels / name).read_text(), re.M)}
            assert imported <= files, (family, name, imported - files)


def test_shipped_tables_read_with_this_schema_and_these_kernels():
    """Every table shipped in the package parses under the current schema, and its entries were
    tuned for the kernel files in this checkout (a kernel change without a re-tune shows here as
    a list of stale families, and at run time as one warning)."""
    shipped = sorted((ROOT / "flash_inductor" / "tuning" / "tables").glob("*.json"))
    assert shipped
    for path in shipped:
        table = cache.read_table(path)
        assert table.stale_reason() is None or "tuned with" in table.stale_reason(), path  # torch/Triton may differ here
        assert table.schema == cache.SCHEMA_VERSION and table.entries, path
        assert table.stale_families() == {}, (
            f"{path.name}: entries tuned for other kernel sources {table.stale_families()}; re-tune them on that "
            "GPU (tools/gpu_autotune.sh with the shipped table in tuning_resume/) and ship the result")


def test_user_entries_shadow_shipped_ones(tmp_path):
    gpu = "fake-gpu_sm90_132sm"
    _install(table_of(gpu, **{"stable__fp16__e64__none__s1024__forward": fwd_entry(64, 64),
                            "stable__fp16__e64__none__s1024__backward": bwd_entry((32, 64), (64, 32))}),
             tmp_path / "shipped")
    _install(table_of(gpu, **{"stable__fp16__e64__none__s1024__forward": fwd_entry(128, 32)}), tmp_path / "user")
    view = cache.load_tables(gpu)
    fwd = Bucket.parse("stable/fp16/e64/none/s1024/forward")
    assert view.lookup(fwd) == {"forward": cfg_dict(128, 32)}
    assert view.lookup(fwd.replace(pass_name="backward"))["backward_dq"] == cfg_dict(64, 32)
    assert cache.load_tables(gpu) is view  # read once: later lookups do no file I/O


def test_lookup_uses_the_nearest_tuned_length():
    view = cache.TableView([table_of(**{"stable__fp16__e64__none__s1024__forward": fwd_entry(32, 32),
                                      "stable__fp16__e64__none__s16384__forward": fwd_entry(128, 64)})])
    fwd = Bucket.parse("stable/fp16/e64/none/s1024/forward")
    assert view.lookup(fwd.replace(seq=2048)) == {"forward": cfg_dict(32, 32)}
    assert view.lookup(fwd.replace(seq=4096)) == {"forward": cfg_dict(128, 64)}  # a tie goes to the longer
    assert view.lookup(fwd.replace(seq=65536)) == {"forward": cfg_dict(128, 64)}
    assert view.lookup(fwd.replace(mask="causal")) is None  # another family: the heuristic decides


def test_no_table_on_a_gpu_warns_once_naming_the_command(monkeypatch):
    monkeypatch.setattr(cache, "device_gpu_key", lambda device: "fake-gpu_sm90_132sm")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            assert cache.active_table(torch.device("cuda"), interpreted=False) is None
    assert len(record) == 1 and "python -m flash_inductor.autotune" in str(record[0].message)
    # The interpreter keeps its fixed tiles and reads nothing.
    assert cache.active_table(torch.device("cpu"), interpreted=True) is None


# ------------------------------------------------------------------------------------------
# Tables reach the launcher and the compile cache key
# ------------------------------------------------------------------------------------------


@pytest.fixture
def launch_spy(monkeypatch):
    """Records (kernel name, BLOCK_M, BLOCK_N) of every kernel launch."""
    calls = []
    spy_on_launches(monkeypatch, lambda name, kwargs: calls.append((name, kwargs.get("BLOCK_M"), kwargs.get("BLOCK_N"))))
    return calls


def _forward_backward(device=DEVICE):
    q, k, v = make_qkv(1, 2, 2, 37, 45, 24, 24, torch.float16, device, seed=0)
    dout = randn((1, 2, 37, 24), torch.float16, device, 2)
    out, lse = launch.attention_forward(q, k, v, None, None, 0.0, True, 8, 24**-0.5, "stable")
    dq, dk, dv, _ = launch.attention_backward(dout, q, k, v, None, out, lse, None, None, 0.0, True, 8, 24**-0.5,
                                              "stable", False)
    return out, dq, dk, dv


@pytest.mark.launches_kernels
def test_a_table_changes_the_launched_configs(launch_spy):
    baseline = _forward_backward()
    heuristic_launches = set(launch_spy)
    blocks = {name: (bm, bn) for name, bm, bn in launch_spy}
    heuristic = builtin_configs(torch.float16, 32)
    assert blocks["_attn_fwd"] == (heuristic.forward.block_m, heuristic.forward.block_n)
    assert blocks["_attn_bwd_dkdv"] == (heuristic.backward_dkdv.block_m, heuristic.backward_dkdv.block_n)

    # E=24 pads to width 32; L=37, S=45 -> length bucket 128; causal.
    table = table_of(**{"stable__fp16__e32__causal__s128__forward": fwd_entry(32, 16),
                      "stable__fp16__e32__causal__s128__backward": bwd_entry((16, 32), (32, 16))})
    launch_spy.clear()
    with cache.override_table(table):
        tuned = _forward_backward()
    launched = {name: (bm, bn) for name, bm, bn in launch_spy}
    assert launched["_attn_fwd"] == (32, 16)
    assert launched["_attn_bwd_dkdv"] == (16, 32) and launched["_attn_bwd_dq"] == (32, 16)
    # Configs change the order of fp32 sums only: results agree to fp16 rounding.
    for a, b in zip(baseline, tuned):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)

    # A table for another schedule or mask kind leaves this launch on the heuristic.
    launch_spy.clear()
    with cache.override_table(table_of(**{"accurate__fp16__e32__causal__s128__forward": fwd_entry(32, 32)})):
        _forward_backward()
    assert set(launch_spy) == heuristic_launches


def test_select_configs_reads_the_table_per_pass():
    q = torch.empty(1, 2, 5000, 64, dtype=torch.float16)
    table = table_of(**{"stable__fp16__e64__none__s8192__backward": bwd_entry((32, 64), (64, 32))})
    with cache.override_table(table):
        got = select_configs(q, 64, 64, True)  # the query's own lengths: bucket 8192
    assert got.forward == KernelConfig(16, 16, 1, 1)  # no forward entry: heuristic
    assert got.backward_dkdv == KernelConfig(32, 64, 4, 1) and got.backward_dq == KernelConfig(64, 32, 4, 1)


def test_select_configs_memoises_per_problem_and_table(monkeypatch):
    """An eager call asks for its configs every time: with integer lengths the answer is computed
    once per problem and table view, and a different table (a new view) is never answered from
    the old one's memo."""
    reads = []
    real_lookup = cache.TableView.lookup
    monkeypatch.setattr(cache.TableView, "lookup", lambda self, bucket: reads.append(bucket) or real_lookup(self, bucket))
    q = torch.empty(1, 2, 3000, 64, dtype=torch.float16)
    first = table_of(**{"stable__fp16__e64__causal__s4096__forward": fwd_entry(64, 32)})
    second = table_of(**{"stable__fp16__e64__causal__s4096__forward": fwd_entry(32, 32)})
    with cache.override_table(first):
        answers = [select_configs(q, 64, 64, True, seq_q=3000, seq_k=3000, mask_kind="causal", schedule="stable")
                   for _ in range(3)]
    assert answers[0] is answers[1] is answers[2] and answers[0].forward == KernelConfig(64, 32, 4, 1)
    assert len(reads) == 2  # forward and backward entries, read once
    with cache.override_table(second):
        assert select_configs(q, 64, 64, True, seq_q=3000, seq_k=3000, mask_kind="causal",
                              schedule="stable").forward == KernelConfig(32, 32, 4, 1)
    with cache.override_table(first):  # a new view of the first table: read again, same answer
        assert select_configs(q, 64, 64, True, seq_q=3000, seq_k=3000, mask_kind="causal",
                              schedule="stable").forward == KernelConfig(64, 32, 4, 1)
    assert len(reads) == 6
    # Another length in the same bucket is its own key but the same entry.
    with cache.override_table(first):
        assert select_configs(q, 64, 64, True, seq_q=3001, seq_k=3001, mask_kind="causal",
                              schedule="stable").forward == KernelConfig(64, 32, 4, 1)


def test_pass_uuid_follows_the_active_table():
    base = FlashAttentionPass().uuid()
    first = table_of(**{"stable__fp16__e64__none__s1024__forward": fwd_entry(64, 32)})
    second = table_of(**{"stable__fp16__e64__none__s1024__forward": fwd_entry(32, 32)})
    with cache.override_table(first):
        with_first = FlashAttentionPass().uuid()
        p = FlashAttentionPass()
    with cache.override_table(second):
        with_second = p.uuid()  # the same pass object sees the new table
    assert len({base, with_first, with_second}) == 3
    with cache.override_table(first):
        assert FlashAttentionPass().uuid() == with_first
