"""Tuning tables on CPU: keys, files, validity and lookup, that the shipped H200 table applies
under every supported torch and Triton, and that a table reaches the launcher and the compile
cache key. Malformed tables: test_tuning_cache_robustness.py."""

from __future__ import annotations

import importlib
import json
import logging
import multiprocessing
import pathlib
import re
import warnings

import pytest
import torch
import triton

from flash_inductor import launch
from flash_inductor.passes.graph_pass import FlashAttentionPass
from flash_inductor.tuning import cache
from flash_inductor.tuning.buckets import GLUON_PASSES, Bucket
from flash_inductor.tuning.kernel_config import role_config_from_dict
from flash_inductor.tuning.configs import (KernelConfig, cuda_heuristic_configs, select_configs,
                                           select_hopper_backward_config, select_hopper_forward_config)
from flash_inductor.tuning.kernel_identity import KERNEL_FAMILIES, UNTUNED_KERNELS, identity_of
from helpers import DEVICE, make_qkv, randn, spy_on_launches
from tuning_helpers import (  # noqa: F401  (isolated_tables: an autouse fixture)
    H200_KEY, ROOT, SHIPPED_DIR, isolated_tables, fake_h200, query_on, cfg_dict, table_of, fwd_entry, bwd_entry,
    builtin_configs,
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
    assert data["schema"] == cache.SCHEMA_VERSION and set(data) == {"schema", "gpu", "meta", "entries"}
    (entry,) = data["entries"].values()
    assert entry["kernel"] == cache.family_identity("forward") and entry["triton"] == triton.__version__
    assert cache.read_table(path).entries == table.entries
    bad = dict(data, entries={**data["entries"],
                              "stable/fp16/e64/none/s2048/forward": {**entry, "configs": {"forward": cfg_dict(48, 32)}}})
    path.write_text(json.dumps(bad))
    read = cache.read_table(path)
    assert read.entries == table.entries and "power of two" in read.dropped["stable/fp16/e64/none/s2048/forward"]


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


@pytest.mark.parametrize("change", ["schema", "gpu"])
def test_tables_of_another_schema_or_gpu_are_ignored_with_one_warning(tmp_path, change):
    gpu = "fake-gpu_sm90_132sm"
    table = table_of(gpu, **{"stable__fp16__e64__none__s1024__forward": fwd_entry(64, 32)})
    stale = {"schema": dict(schema=2), "gpu": dict(gpu="other_sm80_108sm")}[change]
    bad = cache.TuningTable(**{**vars(table), **stale})
    (tmp_path / "user").mkdir()
    path = tmp_path / "user" / cache.table_filename(gpu)
    path.write_text(json.dumps(bad.to_json()))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert cache.load_tables(gpu) is None
    (message,) = [str(w.message) for w in record]
    assert "ignoring the user tuning table" in message and str(path) in message
    assert "python -m flash_inductor.autotune" in message
    _install(table, tmp_path / "user")  # the current table is used again after a reload
    cache.clear_cache()
    assert cache.load_tables(gpu).lookup(Bucket.parse("stable/fp16/e64/none/s1024/forward")) is not None


def test_entries_of_a_changed_kernel_family_are_ignored_with_one_warning(tmp_path):
    gpu = "fake-gpu_sm90_132sm"
    table = table_of(gpu, **{"stable__fp16__e64__none__s1024__forward": fwd_entry(64, 32),
                           "stable__fp16__e64__none__s1024__backward": bwd_entry((32, 64), (64, 32))})
    backward_key = "stable/fp16/e64/none/s1024/backward"
    entries = dict(table.entries)
    entries[backward_key] = {**entries[backward_key], "kernel": "0" * 16}  # tuned for another backward
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


# ------------------------------------------------------------------------------------------
# The kernels' identity: code, not text
# ------------------------------------------------------------------------------------------


_KERNEL_SOURCE = '''
import triton
import triton.language as tl

SCALE = tl.constexpr(2.0)


@triton.jit
def _helper(x):
    return x * SCALE


@triton.jit
def _kernel(X, N, BLOCK: tl.constexpr):
    """A docstring."""
    offs = tl.arange(0, BLOCK)
    values = tl.load(X + offs, mask=offs < N)  # a comment
    tl.store(X + offs, _helper(values), mask=offs < N)
'''


def _identity_of_source(tmp_path, source: str, name: str) -> str:
    import importlib.util

    path = tmp_path / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return identity_of([module._kernel])


@pytest.mark.parametrize("edit, same", [
    (lambda s: "# a glossary\n# of symbols\n\n" + s, True),
    (lambda s: s.replace("# a comment", "# another comment"), True),
    (lambda s: s.replace('"""A docstring."""', '"""Another docstring,\n    on two lines."""'), True),
    (lambda s: s.replace("    return x * SCALE", "    # why\n    return x * SCALE"), True),
    (lambda s: s.replace("x * SCALE", "SCALE * x"), False),  # code
    (lambda s: s.replace("tl.constexpr(2.0)", "tl.constexpr(4.0)"), False),  # a constexpr global the callee reads
    (lambda s: s.replace("values", "vals"), False),  # a renamed local: tools/carry_table_entries.py proves it
])
def test_kernel_identity_follows_code_and_callees_not_comments(tmp_path, edit, same):
    base = _identity_of_source(tmp_path, _KERNEL_SOURCE, "kernel_base")
    edited = _identity_of_source(tmp_path, edit(_KERNEL_SOURCE), "kernel_edited")
    assert (edited == base) is same


def test_kernel_families_cover_every_kernel_the_launchers_start():
    """Every kernel the launchers start belongs to a family (so its identity covers everything
    those launches compile) or is listed as taking no tuned config, and every listed kernel exists."""
    launched = set()
    for path in (ROOT / "flash_inductor" / "launch").glob("*.py"):
        launched |= set(re.findall(r"common\.launcher\((\w+)\)\[", path.read_text()))
    listed = {spec.split(":")[1] for specs in (*KERNEL_FAMILIES.values(), UNTUNED_KERNELS) for spec in specs}
    assert launched and launched <= listed, launched - listed
    for spec in UNTUNED_KERNELS:
        module, name = spec.split(":")
        assert hasattr(importlib.import_module(f"flash_inductor.kernels.{module}"), name), spec
    identities = cache.family_identities()
    assert len(set(identities.values())) == len(KERNEL_FAMILIES)
    assert all(re.fullmatch(r"[0-9a-f]{16}", identity) for identity in identities.values())


# ------------------------------------------------------------------------------------------
# The shipped tables
# ------------------------------------------------------------------------------------------


def test_shipped_tables_read_with_this_schema_and_these_kernels():
    """Every table shipped in the package parses under the current schema, every entry is well
    formed and was tuned for the kernels in this checkout (a kernel change without a re-tune
    shows here as a list of stale families, and at run time as one warning), and together they
    stay small: they hold configs and validity only."""
    shipped = sorted(SHIPPED_DIR.glob("*.json"))
    assert shipped and sum(path.stat().st_size for path in shipped) <= 100_000
    for path in shipped:
        table = cache.read_table(path)
        assert table.schema == cache.SCHEMA_VERSION and table.entries and not table.dropped, path
        assert all(set(entry) == set(cache.LOOKUP_FIELDS) for entry in table.entries.values()), path
        assert table.stale_families() == {}, (
            f"{path.name}: entries tuned for other kernel sources {table.stale_families()}: if only the source "
            "changed, tools/carry_table_entries.py --since <rev> re-keys them; else re-tune them on that GPU")


# The torch releases we support and the Triton each brings.
TORCH_TRITON = [("2.11.0", "3.6.0"), ("2.13.0", "3.7.1"), ("2.14.0", "3.8.0"), ("2.15.0", "3.9.0")]


@pytest.mark.parametrize("torch_version, triton_version", TORCH_TRITON, ids=[t for t, _ in TORCH_TRITON])
def test_the_shipped_h200_table_is_used_under_every_supported_torch(torch_version, triton_version, fake_h200,
                                                                    monkeypatch, caplog):
    """On an H200 (its device properties, as the launch path reads them), each bucket of the
    shipped table gets the table's configs, not the heuristic's, with no warning: an entry tuned
    under another Triton is used, and said so at INFO level."""
    monkeypatch.setattr(cache, "shipped_tables_dir", lambda: SHIPPED_DIR)
    monkeypatch.setattr(torch, "__version__", torch_version)
    monkeypatch.setattr(triton, "__version__", triton_version)
    shipped = json.loads((SHIPPED_DIR / cache.table_filename(H200_KEY)).read_text())["entries"]
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    differs = 0
    with warnings.catch_warnings(), caplog.at_level(logging.INFO, logger=cache.__name__):
        warnings.simplefilter("error")
        for key, entry in shipped.items():
            bucket = Bucket.parse(key)
            query = query_on(fake_h200, dtypes[bucket.dtype], bucket.seq, bucket.width)
            if bucket.pass_name in GLUON_PASSES:  # the Gluon kernels' own lookups
                (role, config), = entry["configs"].items()
                assert _gluon_lookup(query, bucket) == (role_config_from_dict(role, config), True), key
                continue
            got = select_configs(query, bucket.width, bucket.width, False, mask_kind=bucket.mask,
                                 schedule=bucket.schedule)
            heuristic = cuda_heuristic_configs((9, 0), 2, bucket.width, bucket.width, bucket.schedule, bucket.mask)
            for role, config in entry["configs"].items():
                assert getattr(got, role) == KernelConfig.from_dict(config), (key, role)
                differs += getattr(heuristic, role) != getattr(got, role)
    assert differs > len(shipped) // 4  # the table is not the heuristic written down
    other_version = [r.getMessage() for r in caplog.records if "another Triton version" in r.getMessage()]
    assert len(other_version) == (0 if triton_version == "3.6.0" else 1)
    assert all(r.levelno == logging.INFO for r in caplog.records)


def _gluon_lookup(query, bucket: Bucket):
    causal = bucket.mask == "causal"
    if bucket.pass_name == "gluon_backward":
        return select_hopper_backward_config(query, bucket.seq, is_causal=causal, key_mask=False,
                                             schedule=bucket.schedule)
    return select_hopper_forward_config(query, bucket.seq, is_causal=causal, key_mask=False,
                                        exact_delta=bucket.pass_name == "gluon_forward_exact", schedule=bucket.schedule)


def test_an_exact_triton_entry_wins_over_another_versions(monkeypatch):
    key = "stable/fp16/e64/none/s1024/forward"
    monkeypatch.setattr(triton, "__version__", "3.7.1")
    shipped_new = table_of(**{key.replace("/", "__"): fwd_entry(64, 64)})  # stamped 3.7.1
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    user_old = table_of(**{key.replace("/", "__"): fwd_entry(32, 32)})  # stamped 3.6.0
    bucket = Bucket.parse(key)
    assert cache.TableView([shipped_new, user_old], "3.7.1").lookup(bucket) == {"forward": cfg_dict(64, 64)}
    assert cache.TableView([shipped_new, user_old], "3.6.0").lookup(bucket) == {"forward": cfg_dict(32, 32)}
    # Neither exact: the user's entry, as always.
    assert cache.TableView([shipped_new, user_old], "3.8.0").lookup(bucket) == {"forward": cfg_dict(32, 32)}


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


def test_no_table_on_a_gpu_warns_once_naming_the_command(fake_h200):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            assert cache.active_table(fake_h200, interpreted=False) is None
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
    visibility = launch.Visibility(is_causal=True, causal_offset=8)
    out, lse = launch.attention_forward(q, k, v, None, None, 0.0, 24**-0.5, "stable", visibility=visibility)
    dq, dk, dv, _ = launch.attention_backward(dout, q, k, v, None, out, lse, None, None, 0.0, 24**-0.5, "stable",
                                              False, visibility=visibility)
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
