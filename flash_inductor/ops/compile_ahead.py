"""Compile-ahead: a plain-data record of one op call, and the process that replays such records.

Our ops are opaque to Inductor: each call is an extern node whose Triton and Gluon kernels compile
on the compiled graph's first run, one after the other, in the training process, after Inductor
has spent its own ~15 s on the rest of the graph (docs/performance.md, "Compile time"). The pass
(``passes/compile_ahead.py``) records each rewritten site's op call as an :class:`OpCallSpec` and
hands them to :func:`start_worker`, which starts ``python -m flash_inductor.ops.compile_ahead_worker``
in the background: it runs every call once on random tensors of the same shapes, strides, dtypes
and device (forward, and backward where the site is trained), so Triton's on-disk cache holds the
kernel binaries by the time the graph first runs. Nobody waits for it: a kernel it has not
finished compiles in the training process as before (Triton writes its cache atomically, so two
processes compiling one kernel only waste work), and whatever it does cannot change a result.

A spec is JSON: ``{"op": "flash_inductor::attention_forward", "overload": "default", "args":
[...], "kwargs": {...}}``, each tensor argument ``{"tensor": {"shape", "stride", "storage_offset",
"dtype", "device", "requires_grad", "fill"}}``, anything else ``{"value": ...}``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import tempfile
from typing import Any, Optional, Sequence

import torch

# The ops whose calls are replayed: the forward ops a rewritten site calls, whose autograd
# reaches the backward ops. The monitoring ops launch no kernel of ours.
KERNEL_OPS = ("flash_inductor::attention_forward", "flash_inductor::attention_forward_one_pass")

WORKER_MODULE = "flash_inductor.ops.compile_ahead_worker"
SPEC_FILE = "specs.json"
LOG_FILE = "worker.log"

# How each tensor argument is filled so that the replayed call is valid: any float q/k/v will
# do; an all-True bool mask and an all-zero float mask keep every key visible (no row is empty,
# the diagonal included), which is a legal input whatever the real mask was; a dropout seed is any
# 62-bit integer (ops/philox.py). An integer table (a block layout, positions) could make the
# kernels read out of bounds if invented, so a call with one is not replayed.
RANDOM, ALL_TRUE, ZEROS, SEED = "randn", "true", "zeros", "seed"
_MASK_ARGUMENTS = ("attn_mask",)
_SEED_ARGUMENTS = ("rng_seed",)

# What a call allocates besides its inputs, as a multiple of their bytes: the output and LSE
# (about the query again) and, trained, the gradients of every input and the incoming grad_out.
_FORWARD_FOOTPRINT, _TRAINED_FOOTPRINT = 2, 4


def storage_elements(shape: Sequence[int], stride: Sequence[int], storage_offset: int = 0) -> int:
    """Elements a strided view reaches, counted from the storage's start: the storage a copy of
    its layout needs (a stride-0 broadcast dim adds nothing)."""
    if any(size == 0 for size in shape):
        return storage_offset
    return storage_offset + 1 + sum((size - 1) * step for size, step in zip(shape, stride))


class NotReplayable(ValueError):
    """An op call whose arguments the worker cannot reproduce safely; the message says which."""


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A tensor argument: its layout and how the worker fills it (``RANDOM``, ``ALL_TRUE``, ...)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    dtype: str  # torch.bfloat16 -> "bfloat16"
    device: str  # "cuda:0"
    requires_grad: bool
    fill: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def storage_elements(self) -> int:
        return storage_elements(self.shape, self.stride, self.storage_offset)

    @property
    def nbytes(self) -> int:
        return self.storage_elements * self.torch_dtype.itemsize

    def to_json(self) -> dict:
        return {"tensor": dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, data: dict) -> "TensorSpec":
        fields = dict(data)
        fields["shape"], fields["stride"] = tuple(fields["shape"]), tuple(fields["stride"])
        return cls(**fields)


@dataclasses.dataclass(frozen=True)
class OpCallSpec:
    """One call of a ``flash_inductor::`` op: ``torch.ops.<namespace>.<name>.<overload>(*args, **kwargs)``."""

    op: str
    overload: str
    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...] = ()

    @property
    def tensors(self) -> list[TensorSpec]:
        return [a for a in (*self.args, *(v for _, v in self.kwargs)) if isinstance(a, TensorSpec)]

    @property
    def trained(self) -> bool:
        """Whether a backward follows in the compiled graph: an input requires grad."""
        return any(t.requires_grad for t in self.tensors)

    @property
    def device(self) -> Optional[str]:
        tensors = self.tensors
        return tensors[0].device if tensors else None

    def estimated_bytes(self) -> int:
        """Device memory the replay needs at its peak (inputs times ``_FORWARD_FOOTPRINT`` or
        ``_TRAINED_FOOTPRINT``), not counting the worker's CUDA context."""
        inputs = sum(t.nbytes for t in self.tensors)
        return inputs * (_TRAINED_FOOTPRINT if self.trained else _FORWARD_FOOTPRINT)

    def to_json(self) -> dict:
        return {"op": self.op, "overload": self.overload, "args": [_argument_json(a) for a in self.args],
                "kwargs": {name: _argument_json(v) for name, v in self.kwargs}}

    @classmethod
    def from_json(cls, data: dict) -> "OpCallSpec":
        return cls(op=data["op"], overload=data["overload"], args=tuple(_argument(a) for a in data["args"]),
                   kwargs=tuple((name, _argument(v)) for name, v in sorted(data.get("kwargs", {}).items())))

    def key(self) -> str:
        """A canonical text of the call: equal for two sites that compile the same kernels (the
        layers of a model), so each is sent once."""
        return json.dumps(self.to_json(), sort_keys=True)


def _argument_json(value: Any) -> dict:
    return value.to_json() if isinstance(value, TensorSpec) else {"value": value}


def _argument(data: dict) -> Any:
    return TensorSpec.from_json(data["tensor"]) if "tensor" in data else data["value"]


# ------------------------------------------------------------------------------------------
# From a recorded call (the pass records it on fake tensors of concrete sizes)
# ------------------------------------------------------------------------------------------


def spec_from_call(op: torch._ops.OpOverload, args: Sequence[Any], kwargs: dict) -> OpCallSpec:
    """The spec of ``op(*args, **kwargs)``, tensors (real or fake, of concrete sizes) described by
    their layout. Raises :class:`NotReplayable` for an op outside ``KERNEL_OPS`` or an argument
    the worker could not reproduce."""
    name = op.name()
    if name not in KERNEL_OPS:
        raise NotReplayable(f"{name} is not one of the ops compiled ahead {KERNEL_OPS}")
    names = [argument.name for argument in op._schema.arguments]
    spec_args = tuple(_spec_argument(names[i] if i < len(names) else str(i), a) for i, a in enumerate(args))
    spec_kwargs = tuple((k, _spec_argument(k, v)) for k, v in sorted(kwargs.items()))
    return OpCallSpec(op=name, overload=getattr(op, "_overloadname", "default"), args=spec_args, kwargs=spec_kwargs)


def _spec_argument(name: str, value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _tensor_spec(name, value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise NotReplayable(f"argument {name} is a {type(value).__name__}, which a spec cannot hold")


def _tensor_spec(name: str, tensor: torch.Tensor) -> TensorSpec:
    dtype = tensor.dtype
    if name in _SEED_ARGUMENTS and dtype == torch.int64:
        fill = SEED
    elif name in _MASK_ARGUMENTS and dtype == torch.bool:
        fill = ALL_TRUE
    elif name in _MASK_ARGUMENTS and dtype.is_floating_point:
        fill = ZEROS
    elif dtype.is_floating_point and name not in _MASK_ARGUMENTS:
        fill = RANDOM
    else:
        raise NotReplayable(f"argument {name} is a {dtype} tensor, whose values cannot be made up safely")
    if not all(isinstance(n, int) for n in (*tensor.shape, *tensor.stride(), tensor.storage_offset())):
        raise NotReplayable(f"argument {name} has symbolic sizes; record the call on concrete sizes")
    return TensorSpec(shape=tuple(tensor.shape), stride=tuple(tensor.stride()),
                      storage_offset=int(tensor.storage_offset()), dtype=str(dtype).removeprefix("torch."),
                      device=str(tensor.device), requires_grad=bool(tensor.requires_grad), fill=fill)


# ------------------------------------------------------------------------------------------
# Starting the worker
# ------------------------------------------------------------------------------------------


def write_specs(specs: Sequence[OpCallSpec], path: os.PathLike) -> None:
    pathlib.Path(path).write_text(json.dumps({"specs": [s.to_json() for s in specs]}, indent=1))


def read_specs(path: os.PathLike) -> list[OpCallSpec]:
    return [OpCallSpec.from_json(s) for s in json.loads(pathlib.Path(path).read_text())["specs"]]


@dataclasses.dataclass
class StartedWorker:
    """A worker started by :func:`start_worker`: its process and the directory of its specs and log."""

    process: subprocess.Popen
    directory: pathlib.Path

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def log_path(self) -> pathlib.Path:
        return self.directory / LOG_FILE

    def poll(self) -> Optional[int]:
        """The exit code once it has exited (which also reaps it), else None."""
        return self.process.poll()


def start_worker(specs: Sequence[OpCallSpec]) -> StartedWorker:
    """Start the worker on ``specs`` in the background and return at once.

    The specs and the worker's log go to a fresh temporary directory (``worker.log`` holds its
    stderr; the worker deletes the directory when every call ran, and leaves it when one failed).
    The worker is this interpreter with this process's environment, so it shares Triton's cache
    directory (``TRITON_CACHE_DIR`` or ``~/.triton/cache``), our tuning tables and
    ``CUDA_VISIBLE_DEVICES``; the package's own root goes first on its ``PYTHONPATH`` so that it
    imports the very flash_inductor that recorded the specs. A session of its own keeps a Ctrl-C
    in the terminal from reaching it (it stops by itself: when this process exits, or after
    ``compile_ahead_worker.TIME_LIMIT_S``).
    """
    directory = pathlib.Path(tempfile.mkdtemp(prefix="flash_inductor_compile_ahead_"))
    spec_path = directory / SPEC_FILE
    write_specs(specs, spec_path)
    env = dict(os.environ)
    package_root = str(pathlib.Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    with open(directory / LOG_FILE, "wb") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", WORKER_MODULE, str(spec_path), "--parent-pid", str(os.getpid()),
             "--clean-up"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log_file, env=env,
            start_new_session=True, close_fds=True,
        )
    return StartedWorker(process, directory)
