"""Address checks for kernels run under the Triton interpreter.

On a GPU an unmasked load past a tensor's end is an illegal memory access (or, worse, a silent
read of a neighbour); under the interpreter it reads whatever host memory lies there, and when
the kernel masks that value out later (a score outside the sequence, say) every result is still
right. So the interpreter tests cannot see a wrong "this load cannot run past the end" promise.
``checked_addresses`` closes that gap: while it is active, every load and store a kernel issues
must touch, in every lane its mask enables, bytes inside one of the tensors passed to that launch.

It wraps two private parts of ``triton.runtime.interpreter`` (how a launch copies its tensor
arguments to the host, and the builder's masked load/store); if a Triton release renames them,
``checked_addresses`` raises rather than check nothing.

On a GPU the same tests run under NVIDIA's compute-sanitizer instead (``bash tools/gpu/steps.sh
memcheck``), which watches every address of every kernel, Gluon ones included. That step sets
``FLASH_INDUCTOR_MEMCHECK=1``; without it ``watched_addresses`` has nothing watching on a GPU, so
the tests skip there (``ADDRESS_WATCH``) rather than pass unchecked. The step first runs a canary
load past a tensor's end and fails unless the sanitizer reports it, so a sanitizer that watches
nothing cannot pass the tests either.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

MEMCHECK_ENV = "FLASH_INDUCTOR_MEMCHECK"


def under_memcheck() -> bool:
    """Whether tools/gpu/steps.sh's memcheck step runs this process under compute-sanitizer."""
    return os.environ.get(MEMCHECK_ENV) == "1"


def _gpu_tests() -> bool:
    from helpers import ON_CUDA

    return ON_CUDA


# The address tests' marker: they run on CPU (the interpreter's check) and on a GPU under the
# sanitizer, and skip on a GPU without one, naming the step that runs them.
ADDRESS_WATCH = pytest.mark.skipif(_gpu_tests() and not under_memcheck(),
                                   reason="on a GPU the address checks run under compute-sanitizer: "
                                          "bash tools/gpu/steps.sh memcheck")


class OutOfBoundsAccess(AssertionError):
    pass


@dataclass
class _LaunchState:
    kernel: str = "?"
    ranges: list[tuple[int, int]] = field(default_factory=list)
    accesses: int = 0
    # The interpreter re-raises a kernel's exception as its own InterpreterError(repr(error)), so
    # the violations are also kept here, for a test to read whatever the raised type.
    violations: list[str] = field(default_factory=list)


def _storages(arg, out: list[tuple[int, int]]) -> None:
    if isinstance(arg, (tuple, list)):
        for item in arg:
            _storages(item, out)
    elif hasattr(arg, "untyped_storage"):
        storage = arg.untyped_storage()
        if storage.nbytes():
            out.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))


@contextlib.contextmanager
def checked_addresses():
    """Check every interpreted load/store of the kernels launched inside the block; yields the
    state, whose ``accesses`` counts the checked operations (a test can assert it is not 0) and
    ``violations`` lists what failed. A violation raises inside the kernel, which the interpreter
    passes on as ``triton.runtime.errors.InterpreterError`` naming ``OutOfBoundsAccess``."""
    from triton.runtime import interpreter

    needed = {"GridExecutor": ("_init_args_hst",), "InterpreterBuilder": ("create_masked_load", "create_masked_store")}
    missing = [f"{cls}.{name}" for cls, names in needed.items() for name in names
               if not hasattr(getattr(interpreter, cls, None), name)]
    if missing:
        raise RuntimeError(f"this Triton's interpreter has no {', '.join(missing)}: update tests/bounds_check.py")
    executor, builder = interpreter.GridExecutor, interpreter.InterpreterBuilder

    state = _LaunchState()
    original_init = executor._init_args_hst
    original_load, original_store = builder.create_masked_load, builder.create_masked_store

    def init_args(self, args_dev, kwargs):
        args_hst, kwargs_hst = original_init(self, args_dev, kwargs)
        # The host copies are what the interpreted kernel addresses.
        state.kernel = getattr(self.fn, "__name__", repr(self.fn))
        state.ranges = []
        _storages(list(args_hst) + list(kwargs_hst.values()), state.ranges)
        return args_hst, kwargs_hst

    def check(ptrs, mask, itemsize: int, what: str) -> None:
        state.accesses += 1
        addresses = np.asarray(ptrs.data).astype(np.uint64)
        if mask is not None:
            addresses = addresses[np.broadcast_to(np.asarray(mask.data, dtype=bool), addresses.shape)]
        addresses = addresses.ravel()
        if addresses.size == 0:
            return
        inside = np.zeros(addresses.shape, dtype=bool)
        for lo, hi in state.ranges:
            inside |= (addresses >= lo) & (addresses + itemsize <= hi)
        if not inside.all():
            state.violations.append(f"{state.kernel}: {what} of {int((~inside).sum())} of {addresses.size} "
                                    "enabled lanes outside every tensor of the launch")
            raise OutOfBoundsAccess(state.violations[-1])

    def masked_load(self, ptrs, mask, other, *rest):
        itemsize = np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize
        check(ptrs, mask, itemsize, "load")
        return original_load(self, ptrs, mask, other, *rest)

    def masked_store(self, ptrs, value, mask, *rest):
        check(ptrs, mask, np.asarray(value.data).dtype.itemsize, "store")
        return original_store(self, ptrs, value, mask, *rest)

    executor._init_args_hst = init_args
    builder.create_masked_load, builder.create_masked_store = masked_load, masked_store
    try:
        yield state
    finally:
        executor._init_args_hst = original_init
        builder.create_masked_load, builder.create_masked_store = original_load, original_store


@contextlib.contextmanager
def watched_addresses(device):
    """``checked_addresses`` on CPU. On a GPU (under the memcheck step) compute-sanitizer checks the
    addresses; the block counts the kernel launches it ran (``accesses``: a test can assert kernels
    ran, not a fallback) and synchronises at its end, so a fault surfaces in the test that made it."""
    if torch.device(device).type != "cuda":
        with checked_addresses() as state:
            yield state
        return
    from flash_inductor.launch import common

    state = _LaunchState(kernel="(compute-sanitizer)")

    def counted(kernel):
        state.accesses += 1
        return kernel

    with common.launches_replaced(counted):
        yield state
    torch.cuda.synchronize()
