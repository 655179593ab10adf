"""Every way to break the user's tuning cache leaves the shipped table in use, with one warning
that names the path and the cause; writes replace a broken file atomically.

The launch path is read as on an H200 (``fake_h200``), with a shipped table whose entry is not
the heuristic's tile, so the test can tell the shipped table from the heuristic.
"""

from __future__ import annotations

import json
import os
import pathlib
import warnings

import pytest

from flash_inductor.tuning import cache
from flash_inductor.tuning.configs import KernelConfig, select_configs
from tuning_helpers import (  # noqa: F401  (isolated_tables: an autouse fixture)
    H200_KEY, isolated_tables, fake_h200, query_on, table_of, fwd_entry,
)

KEY = "stable/bf16/e128/none/s4096/forward"
SHIPPED = (64, 32)  # not the heuristic's forward tile at E 128 (128x64)


@pytest.fixture
def shipped_table(tmp_path) -> None:
    path = tmp_path / "shipped" / cache.table_filename(H200_KEY)
    path.parent.mkdir()
    path.write_text(json.dumps(table_of(H200_KEY, **{KEY.replace("/", "__"): fwd_entry(*SHIPPED)}).to_json()))


def _launch(device):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        first = select_configs(query_on(device), 128, 128, False, mask_kind="none", schedule="stable").forward
        again = select_configs(query_on(device, seq=3000), 128, 128, False, mask_kind="none", schedule="stable")
    assert again.forward == first
    return first, [str(w.message) for w in record]


def _user_file(tmp_path) -> pathlib.Path:
    return tmp_path / "user" / cache.table_filename(H200_KEY)


def _break(tmp_path, monkeypatch, how: str) -> tuple[str, str]:
    """Break the user cache ``how``; returns (a path the warning must name, its cause)."""
    path = _user_file(tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if how == "dangling symlink":
        path.symlink_to(tmp_path / "gone.json")
        return str(path), "does not exist"
    if how == "dangling symlink folder":
        (tmp_path / "linked").symlink_to(tmp_path / "gone")
        monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path / "linked"))
        return str(tmp_path / "linked"), "does not exist"
    if how == "unknown ~user":
        monkeypatch.setenv(cache.CACHE_DIR_ENV, "~no_such_user_flash_inductor/cache")
        return cache.CACHE_DIR_ENV, "~no_such_user_flash_inductor"
    if how == "deeply nested JSON":
        path.write_text("[" * 100_000 + "]" * 100_000)
        return str(path), "nested too deeply"
    if how == "a file as the folder":
        (tmp_path / "blocker").write_text("")
        monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path / "blocker"))
        return str(tmp_path / "blocker"), "Not a directory"
    if how == "malformed":
        path.write_text("{not json")
        return str(path), "unreadable tuning table"
    if how == "unreadable":
        if os.geteuid() == 0:
            pytest.skip("root reads files whatever their mode")
        path.write_text("{}")
        path.chmod(0)
        return str(path), "Permission denied"
    raise AssertionError(how)


BREAKS = ["dangling symlink", "dangling symlink folder", "unknown ~user", "deeply nested JSON",
          "a file as the folder", "malformed", "unreadable"]


@pytest.mark.parametrize("how", BREAKS)
def test_a_broken_user_cache_keeps_the_shipped_table_with_one_warning(tmp_path, monkeypatch, fake_h200,
                                                                      shipped_table, how):
    named, cause = _break(tmp_path, monkeypatch, how)
    got, messages = _launch(fake_h200)
    assert got == KernelConfig(*SHIPPED, 4, 1)
    assert len(messages) == 1, messages
    assert named in messages[0] and cause in messages[0] and "shipped table" in messages[0], messages[0]


@pytest.mark.parametrize("how", ["dangling symlink", "deeply nested JSON", "malformed"])
def test_a_write_replaces_a_broken_table_atomically(tmp_path, monkeypatch, how):
    _break(tmp_path, monkeypatch, how)
    path = _user_file(tmp_path)
    written = cache.update_table(path, table_of(H200_KEY, **{KEY.replace("/", "__"): fwd_entry(*SHIPPED)}))
    assert cache.read_table(path) == written
    assert not path.is_symlink()
    assert sorted(p.name for p in path.parent.iterdir() if not p.name.endswith(".lock")) == [path.name]


def test_the_user_cache_folder_names_the_variable_it_cannot_resolve(monkeypatch):
    monkeypatch.setenv(cache.CACHE_DIR_ENV, "~no_such_user_flash_inductor")
    with pytest.raises(ValueError, match=cache.CACHE_DIR_ENV):
        cache.user_cache_dir()
