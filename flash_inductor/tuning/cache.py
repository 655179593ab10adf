"""Per-GPU tuning tables: JSON files, where they live, when they are stale, and lookup.

A table maps bucket keys (``tuning/buckets.py``) to tuned launch configs for one GPU model.
Its file records the schema version, the GPU key and the torch and Triton versions, and each
entry records the hash of the kernel files its launch is built from (its kernel family: the
16-bit forward, the backward, the fp8 forward). A table whose record differs from the running
code is ignored, and so is an entry whose family changed (each with one warning), because a
config tuned for other kernels or another compiler may no longer be the fastest, or may no
longer fit in shared memory. Hashing per family keeps the other families' entries when one
kernel changes, so a re-tune covers only the buckets that need it.

Where tables live:

* shipped with the package: ``flash_inductor/tuning/tables/<gpu key>.json``;
* the user's own (what ``python -m flash_inductor.autotune`` writes by default):
  ``$FLASH_INDUCTOR_CACHE_DIR``, else ``$XDG_CACHE_HOME/flash_inductor``, else
  ``~/.cache/flash_inductor``; never the current directory.

A user entry shadows the shipped entry of the same bucket. Files are read once per process
(per GPU model) and served from memory afterwards: the launch path does no file I/O. Writes
take a file lock, merge with what is on disk, and replace the file atomically, so concurrent
tuning runs never lose each other's entries and a crash never leaves half a file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import pathlib
import re
import tempfile
import warnings
from typing import Iterator, Mapping, Optional

import torch

from .buckets import Bucket

SCHEMA_VERSION = 2  # 2: kernel hashes per entry (1: one hash per table)
CACHE_DIR_ENV = "FLASH_INDUCTOR_CACHE_DIR"
AUTOTUNE_COMMAND = "python -m flash_inductor.autotune"
_LOCK_TIMEOUT_S = 120


# ------------------------------------------------------------------------------------------
# GPU keys and locations
# ------------------------------------------------------------------------------------------


def normalise_device_name(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3': lower case, one dash between words."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def gpu_key(name: str, capability: tuple[int, int], sm_count: int) -> str:
    """The GPU model a table is tuned for, e.g. 'nvidia-h200_sm90_132sm'.

    The SM count is part of the key because the best grid-filling tile differs between parts
    sharing a name and capability (H100 PCIe vs SXM, MIG slices).
    """
    major, minor = capability
    return f"{normalise_device_name(name)}_sm{major}{minor}_{int(sm_count)}sm"


@functools.lru_cache(maxsize=None)
def _cuda_gpu_key(index: int) -> str:
    props = torch.cuda.get_device_properties(index)
    return gpu_key(props.name, (props.major, props.minor), props.multi_processor_count)


def device_gpu_key(device: torch.device) -> str:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_gpu_key(index)


def user_cache_dir() -> pathlib.Path:
    override = os.environ.get(CACHE_DIR_ENV)
    if override:
        return pathlib.Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = pathlib.Path(xdg).expanduser() if xdg else pathlib.Path.home() / ".cache"
    return base / "flash_inductor"


def shipped_tables_dir() -> pathlib.Path:
    return pathlib.Path(__file__).resolve().parent / "tables"


def table_filename(gpu: str) -> str:
    return f"{gpu}.json"


# ------------------------------------------------------------------------------------------
# What a table must match
# ------------------------------------------------------------------------------------------


# The kernel files each family of tuned launches is built from (``kernels/``); the monitoring
# kernels launch with fixed sizes and belong to none. tests/test_tuning_tables.py checks that every
# other kernel file is in a family and that a family's files import only from the family.
KERNEL_FAMILIES: dict[str, frozenset[str]] = {
    "forward": frozenset({"attn_fwd.py", "common.py"}),
    "backward": frozenset({"attn_bwd.py", "common.py", "tile_loads.py"}),
    "fp8_forward": frozenset({"attn_fwd_fp8.py", "common.py"}),
}
_KERNELS_DIR = pathlib.Path(__file__).resolve().parent.parent / "kernels"


def hash_files(paths) -> str:
    """sha256 over the given files, in name order, names included."""
    hasher = hashlib.sha256()
    for path in sorted(pathlib.Path(p) for p in paths):
        hasher.update(path.name.encode())
        hasher.update(path.read_bytes())
    return hasher.hexdigest()


def kernel_family(bucket: Bucket) -> str:
    """The family whose kernels a bucket's launch runs."""
    from .schedules import get_schedule

    if get_schedule(bucket.schedule).fp8_forward and bucket.pass_name == "forward":
        return "fp8_forward"
    return bucket.pass_name


@functools.lru_cache(maxsize=None)
def family_hash(family: str) -> str:
    return hash_files(_KERNELS_DIR / name for name in KERNEL_FAMILIES[family])


def kernel_hashes() -> dict[str, str]:
    """Every family's current hash (for reports)."""
    return {family: family_hash(family) for family in KERNEL_FAMILIES}


def entry_kernel_hash(key: str) -> str:
    """The hash an entry for bucket ``key`` must record to describe the running kernels."""
    return family_hash(kernel_family(Bucket.parse(key)))


def entry_is_current(key: str, entry: dict) -> bool:
    return entry.get("kernel_hash") == entry_kernel_hash(key)


def runtime_versions() -> dict[str, str]:
    """torch's release (a local tag like '+cu128' does not change Triton's code) and Triton's version."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    return {"torch": torch.__version__.split("+")[0], "triton": triton_version}


# ------------------------------------------------------------------------------------------
# The table
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TuningTable:
    """One GPU model's tuned entries plus the record that says which code they were tuned for.

    ``entries`` maps a bucket key to a dict whose ``"configs"`` maps a kernel role ("forward",
    or "backward_dkdv" and "backward_dq") to ``{"block_m", "block_n", "num_warps",
    "num_stages"}``; the other fields (times, errors, runner-up) are the autotuner's record.
    """

    gpu: str
    entries: Mapping[str, dict]
    torch: str
    triton: str
    schema: int = SCHEMA_VERSION
    meta: Mapping[str, object] = dataclasses.field(default_factory=dict)

    @classmethod
    def for_current_code(cls, gpu: str, entries: Optional[Mapping[str, dict]] = None, **meta) -> "TuningTable":
        """A table of entries measured with the running code: each is stamped with its family's hash."""
        stamped = {key: {**entry, "kernel_hash": entry_kernel_hash(key)} for key, entry in (entries or {}).items()}
        return cls(gpu=gpu, entries=stamped, meta=meta, **runtime_versions())

    def to_json(self) -> dict:
        return {
            "schema": self.schema, "gpu": self.gpu, "torch": self.torch, "triton": self.triton,
            "meta": dict(self.meta),
            "entries": {key: self.entries[key] for key in sorted(self.entries)},
        }

    @classmethod
    def from_json(cls, data: dict) -> "TuningTable":
        if not isinstance(data, dict) or "entries" not in data:
            raise ValueError("not a flash_inductor tuning table (no 'entries')")
        entries = data["entries"]
        for key, entry in entries.items():
            Bucket.parse(key)
            _check_entry(key, entry)
        return cls(gpu=str(data["gpu"]), entries=dict(entries), torch=str(data["torch"]), triton=str(data["triton"]),
                   schema=int(data["schema"]), meta=dict(data.get("meta", {})))

    def stale_reason(self) -> Optional[str]:
        """Why this table no longer describes the running code, or None when it does."""
        if self.schema != SCHEMA_VERSION:
            return f"schema {self.schema} (this flash_inductor reads schema {SCHEMA_VERSION})"
        versions = runtime_versions()
        for name in ("torch", "triton"):
            if getattr(self, name) != versions[name]:
                return f"tuned with {name} {getattr(self, name)}, running {name} {versions[name]}"
        return None

    def stale_families(self) -> dict[str, int]:
        """How many entries, per kernel family, were tuned for other kernel sources."""
        stale: dict[str, int] = {}
        for key, entry in self.entries.items():
            if not entry_is_current(key, entry):
                family = kernel_family(Bucket.parse(key))
                stale[family] = stale.get(family, 0) + 1
        return stale

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()


_CONFIG_FIELDS = ("block_m", "block_n", "num_warps", "num_stages")
_ROLES = {"forward": ("forward",), "backward": ("backward_dkdv", "backward_dq")}


def _check_entry(key: str, entry: dict) -> None:
    roles = _ROLES[Bucket.parse(key).pass_name]
    configs = entry.get("configs") if isinstance(entry, dict) else None
    if not isinstance(configs, dict) or set(configs) != set(roles):
        raise ValueError(f"tuning table entry {key!r}: 'configs' must hold exactly {roles}")
    for role, config in configs.items():
        if not isinstance(config, dict) or any(
            not isinstance(config.get(f), int) or config[f] <= 0 for f in _CONFIG_FIELDS
        ):
            raise ValueError(f"tuning table entry {key!r}: {role} needs positive ints {_CONFIG_FIELDS}")
        for block in ("block_m", "block_n"):
            if config[block] < 16 or config[block] & (config[block] - 1):
                raise ValueError(f"tuning table entry {key!r}: {role}.{block} must be a power of two >= 16")


# ------------------------------------------------------------------------------------------
# Files: read, and write atomically under a lock
# ------------------------------------------------------------------------------------------


def read_table(path: os.PathLike) -> Optional[TuningTable]:
    """The table at ``path``; None when there is no file. A malformed file raises ValueError."""
    path = pathlib.Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        return TuningTable.from_json(json.loads(text))
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path}: unreadable tuning table: {error}") from error


def _atomic_write_text(path: pathlib.Path, text: str) -> None:
    """Write to a temporary file beside ``path``, then rename: readers see the old file or the
    new one, never a prefix, and a failure leaves no temporary file behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def _file_lock(path: pathlib.Path) -> Iterator[None]:
    from filelock import FileLock

    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock", timeout=_LOCK_TIMEOUT_S):
        yield


def update_table(path: os.PathLike, table: TuningTable) -> TuningTable:
    """Merge ``table``'s entries into the file at ``path`` (its entries win) and write it back.

    Under the lock the file is re-read, so two processes tuning different buckets both keep
    theirs. Entries on disk are dropped when that file was tuned for another GPU, another torch
    or Triton, or (entry by entry) other kernel sources. Returns the table as written.
    """
    path = pathlib.Path(path)
    with _file_lock(path):
        try:
            existing = read_table(path)
        except ValueError:
            existing = None  # a corrupt file is replaced, not merged
        if existing is not None and existing.gpu == table.gpu and existing.stale_reason() is None \
                and (existing.torch, existing.triton) == (table.torch, table.triton):
            kept = {key: entry for key, entry in existing.entries.items() if entry_is_current(key, entry)}
            table = dataclasses.replace(table, entries={**kept, **table.entries}, meta={**existing.meta, **table.meta})
        _atomic_write_text(path, json.dumps(table.to_json(), indent=1, sort_keys=False, allow_nan=False) + "\n")
    clear_cache()  # this process reads its own write on the next launch
    return table


# ------------------------------------------------------------------------------------------
# In-memory lookup
# ------------------------------------------------------------------------------------------


class TableView:
    """The entries a launch may use for one GPU model: user entries over shipped ones, indexed
    by bucket family so that a lookup is a dict access plus a scan of a few lengths."""

    def __init__(self, tables: list[TuningTable]):
        self.tables = tuple(tables)  # lowest precedence first
        merged: dict[str, dict] = {}
        for table in self.tables:
            merged.update(table.entries)
        self._families: dict[tuple, list[tuple[int, dict]]] = {}
        for key, entry in merged.items():
            if not entry_is_current(key, entry):
                continue
            bucket = Bucket.parse(key)
            self._families.setdefault(bucket.family, []).append((bucket.seq, entry))
        self._memo: dict[Bucket, Optional[dict]] = {}
        self.digest = hashlib.sha256("|".join(t.digest() for t in self.tables).encode()).hexdigest()

    def __len__(self) -> int:
        return sum(len(v) for v in self._families.values())

    def lookup(self, bucket: Bucket) -> Optional[dict]:
        """The entry's ``configs`` for ``bucket``: its own length bucket, else the nearest tuned
        length of the same family (in log2 distance, the longer on a tie); None if the family
        has no entry."""
        if bucket not in self._memo:
            found = self._families.get(bucket.family)
            entry = None
            if found:
                target = math.log2(bucket.seq)
                _, entry = min(found, key=lambda item: (abs(math.log2(item[0]) - target), -item[0]))
            self._memo[bucket] = entry["configs"] if entry is not None else None
        return self._memo[bucket]


_OVERRIDES: list[TableView] = []
_WARNED: set[str] = set()


def _warn_once(gpu: str, message: str) -> None:
    if gpu not in _WARNED:
        _WARNED.add(gpu)
        warnings.warn(message, stacklevel=3)


def _valid_table(path: pathlib.Path, gpu: str, origin: str) -> Optional[TuningTable]:
    try:
        table = read_table(path)
    except ValueError as error:
        _warn_once(f"{gpu}:{origin}", f"flash_inductor: ignoring the {origin} tuning table: {error}. "
                   f"Re-run `{AUTOTUNE_COMMAND}`.")
        return None
    if table is None:
        return None
    reason = table.stale_reason() or (None if table.gpu == gpu else f"it is for {table.gpu}")
    if reason is not None:
        _warn_once(f"{gpu}:{origin}", f"flash_inductor: ignoring the {origin} tuning table {path} ({reason}); "
                   f"using the built-in heuristic configs where it had entries. Re-run `{AUTOTUNE_COMMAND}`.")
        return None
    stale = table.stale_families()
    if stale:
        counts = ", ".join(f"{count} {family}" for family, count in sorted(stale.items()))
        _warn_once(f"{gpu}:{origin}:entries", f"flash_inductor: the {origin} tuning table {path} has entries tuned "
                   f"for other kernel sources ({counts}); those buckets use the built-in heuristic configs. "
                   f"Re-run `{AUTOTUNE_COMMAND}` (with --resume it tunes only them).")
    return table


@functools.lru_cache(maxsize=None)
def load_tables(gpu: str) -> Optional[TableView]:
    """The valid tables for ``gpu`` (shipped, then the user's), read once per process."""
    tables = []
    for directory, origin in ((shipped_tables_dir(), "shipped"), (user_cache_dir(), "user")):
        table = _valid_table(directory / table_filename(gpu), gpu, origin)
        if table is not None:
            tables.append(table)
    if not tables:
        _warn_once(gpu, f"flash_inductor: no tuning table for this GPU ({gpu}); using the built-in heuristic "
                   f"launch configs, which may be slower. Run `{AUTOTUNE_COMMAND}` once to tune them "
                   f"(writes {user_cache_dir() / table_filename(gpu)}).")
        return None
    return TableView(tables)


def active_table(device: torch.device, interpreted: bool) -> Optional[TableView]:
    """The view a launch on ``device`` consults: an override (tests, tools) if one is set, else
    the GPU's tables. The Triton interpreter keeps its fixed small tiles and reads no file."""
    if _OVERRIDES:
        return _OVERRIDES[-1]
    if interpreted or device.type != "cuda":
        return None
    return load_tables(device_gpu_key(device))


@contextlib.contextmanager
def override_table(table: Optional[TuningTable]) -> Iterator[TableView]:
    """Use ``table`` for every launch in this block (whatever the device, the interpreter
    included); ``None`` means an empty table, i.e. the heuristic everywhere."""
    view = TableView([table] if table is not None else [])
    _OVERRIDES.append(view)
    try:
        yield view
    finally:
        _OVERRIDES.remove(view)


def clear_cache() -> None:
    """Forget loaded tables and warnings (after writing a table, or in tests)."""
    load_tables.cache_clear()
    _WARNED.clear()


def tables_digest() -> str:
    """A digest of the tables compiled code may have read: part of the pass's cache key, so a
    new table recompiles instead of serving graphs with the old configs baked in.

    Only GPUs this process has already initialised are consulted (a model compiled for CUDA
    has its tensors there by then); this never initialises CUDA itself.
    """
    if _OVERRIDES:
        return "override:" + _OVERRIDES[-1].digest
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return "no-cuda"
    parts = []
    for index in range(torch.cuda.device_count()):
        gpu = _cuda_gpu_key(index)
        view = load_tables(gpu)
        parts.append(f"{gpu}={view.digest if view is not None else 'none'}")
    return ";".join(parts)
