"""The compile-ahead worker: ``python -m flash_inductor.ops.compile_ahead_worker specs.json``.

Started in the background by ``ops.compile_ahead.start_worker`` while Inductor compiles a graph
whose attention the pass rewrote. It runs each recorded op call once on random tensors laid out
as the spec says (forward, and backward for a trained call), so that every Triton and Gluon kernel
the graph's first run needs is compiled into Triton's on-disk cache, then exits. Nothing it
computes is kept. A call that fails is logged to stderr (the log file ``start_worker`` opened) and
the next one runs; the training process compiles whatever is missing itself.

Not imported by the package: it runs as ``__main__`` (``python -m``), and tests import it.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import threading
import time
import traceback
from typing import Optional, Sequence

import torch

from . import attention, one_pass
from .compile_ahead import ALL_TRUE, LOG_FILE, RANDOM, SEED, ZEROS, OpCallSpec, TensorSpec, read_specs

# Importing these registers the ops the specs name (torch.ops finds them only once registered).
OP_MODULES = (attention, one_pass)

# The worker stops by itself after this long whatever it is doing: a compile that hangs (a
# driver or compiler fault) must not leave a process behind for the rest of a training run.
TIME_LIMIT_S = 600.0
# How often it checks that the process that started it still runs: once that one has exited,
# nobody is waiting for the kernels, and a benchmark's next process must not share the machine.
_PARENT_POLL_S = 1.0
_SEED = 0


def build_tensor(spec: TensorSpec, generators: "SeededGenerators") -> torch.Tensor:
    """A tensor with the spec's shape, strides, storage offset, dtype and device, filled per
    ``spec.fill``. The storage is filled before the view is taken: a broadcast (stride-0) view
    has elements that share memory, which an in-place fill refuses."""
    device = torch.device(spec.device)
    storage = torch.empty(spec.storage_elements, dtype=spec.torch_dtype, device=device)
    if spec.fill == RANDOM:
        storage.normal_(generator=generators.on(device))
    elif spec.fill == ALL_TRUE:
        storage.fill_(True)
    elif spec.fill == ZEROS:
        storage.zero_()
    elif spec.fill == SEED:
        storage.random_(0, 2**62, generator=generators.on(device))
    else:
        raise ValueError(f"compile-ahead spec: unknown fill {spec.fill!r}")
    tensor = storage.as_strided(spec.shape, spec.stride, spec.storage_offset)
    return tensor.requires_grad_(spec.requires_grad)


class SeededGenerators:
    """One seeded generator per device, so a replay draws the same values every time."""

    def __init__(self, seed: int):
        self.seed = seed
        self._by_device: dict[torch.device, torch.Generator] = {}

    def on(self, device: torch.device) -> torch.Generator:
        if device not in self._by_device:
            self._by_device[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._by_device[device]


def _op(spec: OpCallSpec):
    namespace, name = spec.op.split("::")
    return getattr(getattr(getattr(torch.ops, namespace), name), spec.overload)


def run_call(spec: OpCallSpec, seed: int = _SEED) -> list[str]:
    """Run one recorded call: its forward, and for a trained call the backward through the op's
    autograd with a random grad_out on the first output. Returns what ran ("forward",
    "backward"); raises what the op raises."""
    generators = SeededGenerators(seed)

    def materialise(value):
        return build_tensor(value, generators) if isinstance(value, TensorSpec) else value

    args = [materialise(a) for a in spec.args]
    kwargs = {name: materialise(v) for name, v in spec.kwargs}
    inputs = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.requires_grad]
    with torch.enable_grad():
        outputs = _op(spec)(*args, **kwargs)
        out = outputs[0] if isinstance(outputs, (tuple, list)) else outputs
        ran = ["forward"]
        if inputs:
            # The compiled backward graph calls the backward op on a grad_out alone (the LSE is
            # not used downstream): the same specialisation as here.
            grad_out = torch.empty(out.shape, dtype=out.dtype, device=out.device)
            grad_out.normal_(generator=generators.on(out.device))
            torch.autograd.grad(out, inputs, grad_out)
            ran.append("backward")
    _synchronize(out.device)
    return ran


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_all(specs: Sequence[OpCallSpec]) -> list[Optional[list[str]]]:
    """Each spec's ``run_call`` result, None where it failed (the failure goes to stderr)."""
    results: list[Optional[list[str]]] = []
    for i, spec in enumerate(specs):
        start = time.perf_counter()
        try:
            results.append(run_call(spec))
        except Exception:  # noqa: BLE001 -- the next call may still compile kernels the graph needs
            print(f"compile-ahead: call {i} ({spec.op}) failed:\n{traceback.format_exc()}", file=sys.stderr)
            results.append(None)
            continue
        print(f"compile-ahead: call {i} ({spec.op}) ran {'+'.join(results[-1])} in "
              f"{time.perf_counter() - start:.1f} s", file=sys.stderr)
    return results


def _exit_now(reason: str, code: int) -> None:
    print(f"compile-ahead: stopping: {reason}", file=sys.stderr, flush=True)
    os._exit(code)  # from a watchdog thread: the main thread may be inside a compile


class _Watchdogs:
    """Stop the process after ``time_limit_s``, or once ``parent_pid`` is no longer its parent."""

    def __init__(self, parent_pid: Optional[int], time_limit_s: float):
        self._done = threading.Event()
        self._timer = threading.Timer(time_limit_s, _exit_now, (f"past the {time_limit_s:.0f} s limit", 124))
        self._timer.daemon = True
        self._timer.start()
        if parent_pid is not None:
            threading.Thread(target=self._watch_parent, args=(parent_pid,), daemon=True,
                             name="compile-ahead-parent").start()

    def _watch_parent(self, parent_pid: int) -> None:
        while not self._done.wait(_PARENT_POLL_S):
            if os.getppid() != parent_pid:
                _exit_now(f"the process that started it ({parent_pid}) has exited", 0)

    def stop(self) -> None:
        self._done.set()
        self._timer.cancel()


def _remove_own_files(spec_path: pathlib.Path) -> None:
    """Delete the specs and the log ``start_worker`` put beside them, then their directory if
    nothing else is in it."""
    for path in (spec_path, spec_path.parent / LOG_FILE):
        path.unlink(missing_ok=True)
    try:
        spec_path.parent.rmdir()
    except OSError:
        pass


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("specs", help="the JSON file ops.compile_ahead.write_specs wrote")
    parser.add_argument("--parent-pid", type=int, default=None, help="stop when this process is gone")
    parser.add_argument("--time-limit", type=float, default=TIME_LIMIT_S, help="seconds before it stops")
    parser.add_argument("--clean-up", action="store_true",
                        help="on success, delete the specs, the log beside them and their (then empty) directory")
    args = parser.parse_args(argv)
    watchdogs = _Watchdogs(args.parent_pid, args.time_limit)
    try:
        results = run_all(read_specs(args.specs))
    finally:
        watchdogs.stop()
    if any(r is None for r in results):
        return 1  # the log stays, for whoever wonders why the first step compiled kernels itself
    if args.clean_up:
        _remove_own_files(pathlib.Path(args.specs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
