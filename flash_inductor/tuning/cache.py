"""Per-GPU tuning tables: JSON files, where they live, what an entry is valid for, and lookup.

A table maps bucket keys (``tuning/buckets.py``) to tuned launch configs for one GPU model. Each
entry records what it is valid for:

* ``kernel``: the source identity of its kernel family (``kernel_identity.py``: the syntax trees
  of the kernels the family launches, their ``@triton.jit`` callees and the constexpr globals
  they read; comments, docstrings and line numbers do not count). An entry whose identity
  differs from the running kernels is skipped (one warning per file): it was tuned for other
  code, and may no longer be the fastest or even fit in shared memory.
* ``triton``: the Triton version it was tuned with. The rule: **an entry tuned under another
  Triton version is still used**, because a config only chooses tile sizes, warps and stages
  for the same kernel source; every config is checked against the GPU's limits when the table
  is loaded, so one that cannot launch is dropped rather than tried. Where entries of the same
  bucket exist for the running Triton and for another (e.g. a user's re-tune beside the shipped
  table), the exact-version entry wins. Using other-version entries is reported at INFO level
  (``logging``), not as a warning: it is the expected state after a Triton upgrade.

The torch version is not recorded: torch does not take part in compiling these kernels.

Where tables live:

* shipped with the package: ``flash_inductor/tuning/tables/<gpu key>.json`` (configs and
  validity only; the search records go to the autotuner's summary, see ``tables/README.md``);
* the user's own (what ``python -m flash_inductor.autotune`` writes by default):
  ``$FLASH_INDUCTOR_CACHE_DIR``, else ``$XDG_CACHE_HOME/flash_inductor``, else
  ``~/.cache/flash_inductor``; never the current directory.

Precedence per bucket: an exact-Triton entry over another version's, then the user's entry over
the shipped one. Files are read once per process (per GPU model) and served from memory
afterwards: the launch path does no file I/O.

Robustness: a table can never make an attention call fail. A file that cannot be read or is not
a table gives one warning naming it and is ignored; an entry that is malformed or exceeds the
GPU's limits (block sizes, warps, stages, an estimate of its shared memory) is dropped with one
warning per file naming it; the launch-path lookup turns any other error into one warning and
the heuristic configs (``configs.select_configs``). Writes take a file lock, merge with what is
on disk, and replace the file atomically, so concurrent tuning runs never lose each other's
entries and a crash never leaves half a file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import pathlib
import re
import tempfile
import warnings
from typing import Iterator, Mapping, Optional

import torch

from ..schedules import SCHEDULES, get_schedule
from . import hopper_configs
from .buckets import ROLES, Bucket
from .footprint import DEFAULT_OPTIN_SMEM_BYTES, OPTIN_SMEM_BYTES, smem_bytes, tile_bytes_for
from .kernel_config import KernelConfig
from .kernel_identity import KERNEL_FAMILIES, family_identities, family_identity

SCHEMA_VERSION = 3  # 3: kernel identity and Triton version per entry (2: file hashes, table-wide torch/Triton)
CACHE_DIR_ENV = "FLASH_INDUCTOR_CACHE_DIR"
AUTOTUNE_COMMAND = "python -m flash_inductor.autotune"
_LOCK_TIMEOUT_S = 120
_log = logging.getLogger(__name__)



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


@functools.lru_cache(maxsize=None)
def _cuda_smem_limit(index: int) -> int:
    """Shared memory a block may opt in to on this GPU (older torch: by capability)."""

    props = torch.cuda.get_device_properties(index)
    smem = getattr(props, "shared_memory_per_block_optin", 0)
    return int(smem) or OPTIN_SMEM_BYTES.get((props.major, props.minor), DEFAULT_OPTIN_SMEM_BYTES)


def _cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def device_gpu_key(device: torch.device) -> str:
    return _cuda_gpu_key(_cuda_index(device))


def user_cache_dir() -> pathlib.Path:
    """The user's table folder; ValueError naming the variable when it cannot be resolved (a
    ``~user`` that does not exist, no home directory)."""
    override = os.environ.get(CACHE_DIR_ENV)
    xdg = os.environ.get("XDG_CACHE_HOME")
    try:
        if override:
            return pathlib.Path(override).expanduser()
        base = pathlib.Path(xdg).expanduser() if xdg else pathlib.Path.home() / ".cache"
    except RuntimeError as error:  # pathlib's "Could not determine home directory"
        variable = CACHE_DIR_ENV if override else "XDG_CACHE_HOME" if xdg else "HOME"
        raise ValueError(f"cannot resolve the user cache folder from {variable}={os.environ.get(variable)!r} "
                         f"({error}); set {CACHE_DIR_ENV} to an absolute path") from None
    return base / "flash_inductor"


def shipped_tables_dir() -> pathlib.Path:
    return pathlib.Path(__file__).resolve().parent / "tables"


def table_filename(gpu: str) -> str:
    return f"{gpu}.json"


# ------------------------------------------------------------------------------------------
# What an entry is valid for
# ------------------------------------------------------------------------------------------


def kernel_family(bucket: Bucket) -> str:
    """The family whose kernels a bucket's launch runs."""

    if get_schedule(bucket.schedule).fp8_forward and bucket.pass_name == "forward":
        return "fp8_forward"
    if bucket.pass_name == "gluon_forward_exact":  # the same kernel as the plain forward
        return "gluon_forward"
    return bucket.pass_name


def entry_kernel_identity(key: str) -> str:
    """The identity an entry for bucket ``key`` must record to describe the running kernels."""
    return family_identity(kernel_family(Bucket.parse(key)))


def entry_is_current(key: str, entry: dict) -> bool:
    return entry.get("kernel") == entry_kernel_identity(key)


def running_triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "none"
    return str(triton.__version__)


# What a lookup needs; everything else an entry may carry (times, runner-up, ranking) is the
# autotuner's record, kept in user tables for --resume and stripped from shipped ones.
LOOKUP_FIELDS = ("configs", "kernel", "triton")


def shipped_entry(entry: dict) -> dict:
    """``entry`` reduced to what a lookup needs."""
    return {field: entry[field] for field in LOOKUP_FIELDS if field in entry}


# ------------------------------------------------------------------------------------------
# Validation: structure, then the GPU's limits
# ------------------------------------------------------------------------------------------


_CONFIG_FIELDS = ("block_m", "block_n", "num_warps", "num_stages")
# Bounds wider than anything the autotuner searches (tiles 32 to 128, 4 or 8 warps, 1 to 4 stages;
# the interpreter's 16x16, 1 warp, 1 stage) and within what a launch can take (tl.dot needs 16 rows
# or columns; 16 warps are 512 threads, a block may have 1024): a value outside them comes from a
# damaged or hand-edited file, and could fail the launch instead of merely running slowly.
BLOCK_RANGE = (16, 256)
ALLOWED_WARPS = (1, 2, 4, 8, 16)
STAGE_RANGE = (1, 8)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _config_problem(config) -> Optional[str]:
    if not isinstance(config, dict) or any(not _is_int(config.get(field)) for field in _CONFIG_FIELDS):
        return f"needs integer {', '.join(_CONFIG_FIELDS)}"
    low, high = BLOCK_RANGE
    for block in ("block_m", "block_n"):
        size = config[block]
        if not (low <= size <= high and size & (size - 1) == 0):
            return f"{block}={size} is not a power of two in [{low}, {high}]"
    if config["num_warps"] not in ALLOWED_WARPS:
        return f"num_warps={config['num_warps']} is not one of {ALLOWED_WARPS}"
    if not STAGE_RANGE[0] <= config["num_stages"] <= STAGE_RANGE[1]:
        return f"num_stages={config['num_stages']} is outside {list(STAGE_RANGE)}"
    return None


def entry_problem(key: str, entry) -> Optional[str]:
    """Why the entry at ``key`` cannot be used on any GPU, or None when it is well formed."""

    try:
        bucket = Bucket.parse(key)
    except ValueError as error:
        return str(error)
    if bucket.schedule not in SCHEDULES:
        return f"unknown schedule {bucket.schedule!r}"
    if not isinstance(entry, dict):
        return "not an object"
    configs = entry.get("configs")
    roles = ROLES[bucket.pass_name]
    if not isinstance(configs, dict) or set(configs) != set(roles):
        return f"'configs' must hold exactly {roles}"
    for role in roles:
        if hopper_configs.is_gluon_role(role):
            problem = hopper_configs.config_problem(role, configs[role])
        else:
            problem = _config_problem(configs[role])
        if problem is not None:
            return f"{role}: {problem}"
    for field in ("kernel", "triton"):
        if not isinstance(entry.get(field), str):
            return f"no {field!r} string"
    return None


def smem_problem(key: str, entry: dict, smem_limit: Optional[int]) -> Optional[str]:
    """Why a well-formed entry cannot launch on a GPU with ``smem_limit`` bytes of shared memory
    per block, by the autotuner's estimate (``search_space.smem_bytes``, the same estimate that
    pruned its candidates); None when it fits or the limit is unknown."""
    if smem_limit is None:
        return None

    bucket = Bucket.parse(key)
    tiles = tile_bytes_for(bucket)
    for role, config in entry["configs"].items():
        if hopper_configs.is_gluon_role(role):
            needed = hopper_configs.smem_bytes(role, hopper_configs.config_from_dict(role, config), bucket.width,
                                               tiles.itemsize)
        else:
            needed = smem_bytes(role, KernelConfig.from_dict(config), tiles)
        if needed > smem_limit:
            return f"{role} needs about {needed} bytes of shared memory, this GPU has {smem_limit}"
    return None


# ------------------------------------------------------------------------------------------
# The table
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TuningTable:
    """One GPU model's tuned entries.

    ``entries`` maps a bucket key to a dict whose ``"configs"`` maps a kernel role ("forward",
    or "backward_dkdv" and "backward_dq") to ``{"block_m", "block_n", "num_warps",
    "num_stages"}``, plus ``"kernel"`` and ``"triton"`` (what it is valid for; see the module
    docstring). ``dropped`` names the entries of the file that failed validation, and why.
    """

    gpu: str
    entries: Mapping[str, dict]
    schema: int = SCHEMA_VERSION
    meta: Mapping[str, object] = dataclasses.field(default_factory=dict)
    dropped: Mapping[str, str] = dataclasses.field(default_factory=dict, compare=False)

    @classmethod
    def for_current_code(cls, gpu: str, entries: Optional[Mapping[str, dict]] = None, **meta) -> "TuningTable":
        """A table of entries measured with the running code: each is stamped with its kernel
        family's identity and the running Triton version."""
        triton = running_triton_version()
        stamped = {key: {**entry, "kernel": entry_kernel_identity(key), "triton": triton}
                   for key, entry in (entries or {}).items()}
        return cls(gpu=gpu, entries=stamped, meta=meta)

    def to_json(self) -> dict:
        return {"schema": self.schema, "gpu": self.gpu, "meta": dict(self.meta),
                "entries": {key: self.entries[key] for key in sorted(self.entries)}}

    @classmethod
    def from_json(cls, data) -> "TuningTable":
        """The table in ``data``; ValueError when it is not a table of this schema. Malformed
        entries are left out and listed in ``dropped``."""
        if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
            raise ValueError("not a flash_inductor tuning table ('entries' must be an object)")
        schema = data.get("schema")
        if schema != SCHEMA_VERSION:
            raise ValueError(f"schema {schema!r}, this flash_inductor reads schema {SCHEMA_VERSION}")
        if not isinstance(data.get("gpu"), str):
            raise ValueError("no 'gpu' string")
        meta = data.get("meta", {})
        entries, dropped = {}, {}
        for key, entry in data["entries"].items():
            problem = entry_problem(key, entry)
            if problem is None:
                entries[key] = entry
            else:
                dropped[key] = problem
        return cls(gpu=data["gpu"], entries=entries, schema=schema, meta=meta if isinstance(meta, dict) else {},
                   dropped=dropped)

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


def table_text(table: TuningTable) -> str:
    """The file's text: the header indented, then one entry per line (a diff shows which buckets
    moved, and the shipped table stays small)."""
    data = table.to_json()
    entries = data.pop("entries")
    head = json.dumps(data, indent=1, allow_nan=False)
    lines = [f" {json.dumps(key)}: {json.dumps(entry, separators=(',', ':'), allow_nan=False)}"
             for key, entry in entries.items()]
    body = "{\n" + ",\n".join(lines) + "\n}" if lines else "{}"
    return head[:-2] + ',\n "entries": ' + body + "\n}\n"


# ------------------------------------------------------------------------------------------
# Files: read, and write atomically under a lock
# ------------------------------------------------------------------------------------------


def read_table(path: os.PathLike) -> Optional[TuningTable]:
    """The table at ``path``; None when there is no file. A file that cannot be read (a folder
    in its place, no permission, not JSON, not a table of this schema) raises ValueError."""
    path = pathlib.Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        broken = _dangling_link(path)
        if broken is not None:
            raise ValueError(f"{path}: {broken} is a symbolic link to {os.readlink(broken)}, which does not "
                             "exist") from None
        return None
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: cannot read it: {error}") from error
    try:
        return TuningTable.from_json(json.loads(text))
    except RecursionError:  # JSON nested deeper than the parser's stack: no table is
        raise ValueError(f"{path}: unreadable tuning table: JSON nested too deeply") from None
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path}: unreadable tuning table: {error}") from error


def _dangling_link(path: pathlib.Path) -> Optional[pathlib.Path]:
    """The symbolic link at ``path`` or one of its folders whose target is missing, if any: a file
    that is not there is no table, a link to nothing is a broken cache the user should hear of."""
    for candidate in (path, *path.parents):
        if candidate.is_symlink() and not candidate.exists():
            return candidate
    return None


def prove_writable(directory: os.PathLike) -> None:
    """Create and remove a file in the existing ``directory``; OSError when that fails. Mode bits
    (``os.access``) miss read-only mounts, ACLs and quotas; a real file does not."""
    fd, probe = tempfile.mkstemp(dir=directory, prefix=".flash_inductor_write_check.")
    os.close(fd)
    os.unlink(probe)


def check_writable_dir(directory: os.PathLike) -> None:
    """Create ``directory`` if needed and prove a file can be created there; raise OSError with
    what to do otherwise (the autotuner calls this before measuring anything)."""
    directory = pathlib.Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        prove_writable(directory)
    except OSError as error:
        raise OSError(f"cannot write to {directory} ({error.strerror or error}); set {CACHE_DIR_ENV} to a "
                      "writable folder, or pass --out") from error


def atomic_write_text(path: pathlib.Path, text: str) -> None:
    """Write to a temporary file beside ``path``, then rename: readers see the old file or the
    new one, never a prefix, and a failure leaves no temporary file behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        with contextlib.suppress(FileNotFoundError):  # mkstemp's 0600 would hide a shared table from others
            os.chmod(tmp, os.stat(path).st_mode & 0o777)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def _file_lock(path: pathlib.Path) -> Iterator[None]:
    from filelock import FileLock

    check_writable_dir(path.parent)  # a clear message instead of the lock file's bare OSError
    with FileLock(str(path) + ".lock", timeout=_LOCK_TIMEOUT_S):
        yield


def update_table(path: os.PathLike, table: TuningTable) -> TuningTable:
    """Merge ``table``'s entries into the file at ``path`` (its entries win) and write it back.

    Under the lock the file is re-read, so two processes tuning different buckets both keep
    theirs. Entries on disk are dropped when that file is for another GPU or schema, or (entry
    by entry) was tuned for other kernel sources; entries of other Triton versions stay (see the
    module docstring). Returns the table as written. Raises OSError when ``path`` cannot be written.
    """
    path = pathlib.Path(path)
    with _file_lock(path):
        try:
            existing = read_table(path)
        except ValueError:
            existing = None  # a corrupt file is replaced, not merged
        if existing is not None and existing.gpu == table.gpu:
            kept = {key: entry for key, entry in existing.entries.items() if entry_is_current(key, entry)}
            table = dataclasses.replace(table, entries={**kept, **table.entries}, meta={**existing.meta, **table.meta})
        atomic_write_text(path, table_text(table))
    clear_cache()  # this process reads its own write on the next launch
    return table


# ------------------------------------------------------------------------------------------
# In-memory lookup
# ------------------------------------------------------------------------------------------


class TableView:
    """The entries a launch may use for one GPU model, indexed by bucket family so that a lookup
    is a dict access plus a scan of a few lengths.

    ``tables`` are given lowest precedence first (shipped, then user). Per bucket key the entry
    tuned with the running Triton wins over other versions', then the later table's over the
    earlier's; entries tuned for other kernel sources are left out.
    """

    def __init__(self, tables: list[TuningTable], triton_version: Optional[str] = None):
        self.tables = tuple(tables)
        self.triton_version = running_triton_version() if triton_version is None else triton_version
        chosen: dict[str, tuple[tuple[bool, int], dict]] = {}
        for precedence, table in enumerate(self.tables):
            for key, entry in table.entries.items():
                if not entry_is_current(key, entry):
                    continue
                rank = (entry.get("triton") == self.triton_version, precedence)
                if key not in chosen or rank > chosen[key][0]:
                    chosen[key] = (rank, entry)
        self.other_triton: dict[str, int] = {}  # version -> entries used from it
        self._families: dict[tuple, list[tuple[int, dict]]] = {}
        for key, ((exact, _), entry) in chosen.items():
            if not exact:
                version = str(entry.get("triton"))
                self.other_triton[version] = self.other_triton.get(version, 0) + 1
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


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, stacklevel=3)


def warn_lookup_failed(error: BaseException) -> None:
    """The launch path's last resort: a table error it did not expect becomes one warning."""
    _warn_once("lookup-failed",  # once per process: every later launch would fail the same way
               f"flash_inductor: the tuning-table lookup failed ({type(error).__name__}: {error}); using the "
               f"built-in heuristic launch configs. Please report this; `{AUTOTUNE_COMMAND}` rewrites the user table.")


_HEURISTIC = "the built-in heuristic configs"
_SHIPPED = "the shipped table (the built-in heuristic configs elsewhere)"


def _usable_table(path: pathlib.Path, gpu: str, origin: str, smem_limit: Optional[int],
                  fallback: str = _HEURISTIC) -> Optional[TuningTable]:
    """The table at ``path`` without the entries this GPU cannot use, or None (one warning
    naming the file, the cause and ``fallback``, what launches use instead, when it exists but
    cannot be used)."""
    try:
        table = read_table(path)
    except ValueError as error:
        _warn_once(f"{gpu}:{origin}", f"flash_inductor: ignoring the {origin} tuning table: {error}; using "
                   f"{fallback}. Re-run `{AUTOTUNE_COMMAND}` to write a new one.")
        return None
    if table is None:
        return None
    if table.gpu != gpu:
        _warn_once(f"{gpu}:{origin}", f"flash_inductor: ignoring the {origin} tuning table {path}: it is for "
                   f"{table.gpu}; using {fallback}. Re-run `{AUTOTUNE_COMMAND}`.")
        return None
    dropped = dict(table.dropped)
    for key, entry in table.entries.items():
        problem = smem_problem(key, entry, smem_limit)
        if problem is not None:
            dropped[key] = problem
    if dropped:
        listed = "; ".join(f"{key}: {why}" for key, why in sorted(dropped.items())[:5])
        more = f" (and {len(dropped) - 5} more)" if len(dropped) > 5 else ""
        _warn_once(f"{gpu}:{origin}:dropped", f"flash_inductor: the {origin} tuning table {path} has "
                   f"{len(dropped)} unusable entries, left out (those buckets use the heuristic configs): "
                   f"{listed}{more}")
        table = dataclasses.replace(table, entries={k: e for k, e in table.entries.items() if k not in dropped})
    stale = table.stale_families()
    if stale:
        counts = ", ".join(f"{count} {family}" for family, count in sorted(stale.items()))
        _warn_once(f"{gpu}:{origin}:entries", f"flash_inductor: the {origin} tuning table {path} has entries tuned "
                   f"for other kernel sources ({counts}); those buckets use the built-in heuristic configs. "
                   f"Re-run `{AUTOTUNE_COMMAND}` (with --resume it tunes only them).")
    return table


def _report_other_triton(gpu: str, view: TableView) -> None:
    if view.other_triton:
        versions = ", ".join(f"{count} with Triton {version}" for version, count in sorted(view.other_triton.items()))
        _log.info("flash_inductor: using tuning-table entries for %s tuned under another Triton version (%s; "
                  "running %s). Their configs were checked against this GPU's limits; a re-tune under this "
                  "Triton would take precedence.", gpu, versions, view.triton_version)


@functools.lru_cache(maxsize=None)
def load_tables(gpu: str, smem_limit: Optional[int] = None) -> Optional[TableView]:
    """The usable tables for ``gpu`` (shipped, then the user's), read once per process. Configs
    needing more than ``smem_limit`` bytes of shared memory per block are left out."""
    tables, found, user_path = [], False, "the user cache folder"
    for origin in ("shipped", "user"):
        path = f"the {origin} table folder"
        fallback = _SHIPPED if tables else _HEURISTIC
        try:  # the folder itself may not resolve (an unknown ~user in FLASH_INDUCTOR_CACHE_DIR)
            path = (shipped_tables_dir() if origin == "shipped" else user_cache_dir()) / table_filename(gpu)
            if origin == "user":
                user_path = str(path)
            found = found or os.path.lexists(path)
            table = _usable_table(path, gpu, origin, smem_limit, fallback)
        except Exception as error:  # a table must never fail an attention call
            found = True
            _warn_once(f"{gpu}:{origin}", f"flash_inductor: ignoring the {origin} tuning table {path}: "
                       f"{type(error).__name__}: {error}; using {fallback}.")
            table = None
        if table is not None:
            tables.append(table)
    if not tables and not found:  # a file that was found but not used had its own warning
        _warn_once(gpu, f"flash_inductor: no tuning table for this GPU ({gpu}); using the built-in heuristic "
                   f"launch configs, which may be slower. Run `{AUTOTUNE_COMMAND}` once to tune them "
                   f"(writes {user_path}).")
    if not tables:
        return None
    view = TableView(tables)
    _report_other_triton(gpu, view)
    return view


def active_table(device: torch.device, interpreted: bool) -> Optional[TableView]:
    """The view a launch on ``device`` consults: an override (tests, tools) if one is set, else
    the GPU's tables. The Triton interpreter keeps its fixed small tiles and reads no file."""
    if _OVERRIDES:
        return _OVERRIDES[-1]
    if interpreted or device.type != "cuda":
        return None
    index = _cuda_index(device)
    return load_tables(_cuda_gpu_key(index), _cuda_smem_limit(index))


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
        try:
            gpu = _cuda_gpu_key(index)
            view = load_tables(gpu, _cuda_smem_limit(index))
        except Exception as error:  # the launches fall back to the heuristic too (warn_lookup_failed)
            parts.append(f"{index}=error:{type(error).__name__}")
            continue
        parts.append(f"{gpu}={view.digest if view is not None else 'none'}")
    return ";".join(parts)
