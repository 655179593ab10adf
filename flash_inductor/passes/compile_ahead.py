"""Compile-ahead from the pass: every rewritten site's op call, sent to a background worker.

After the pass has rewritten a graph, Inductor spends ~15 s compiling the rest of it while none of
our kernels compile; they compile at the graph's first run, serially, in this process (~12 s for
an 8-layer Llama, docs/performance.md). :class:`CompileAhead` closes that gap: for each call of
:func:`~flash_inductor.passes.site.rewritten_attention` in the graph it records the op call the
call makes (``flash_inductor::attention_forward`` or its one-pass twin, with the normalised
tensors' shapes, strides, dtypes and device, whether they require grad, and every other
argument) by running it on fake tensors, and starts one worker process
(``ops.compile_ahead.start_worker``) that replays the new calls, forward and backward, into
Triton's on-disk cache.

What the fake run sees is the site's example values (``node.meta["example_value"]``) made concrete:
a symbolic size takes its hint, which adds no guard; a site whose sizes have none is skipped. The
run itself happens on fresh tensors of the graph's own fake mode, so the graph and its shape
environment are untouched.

Gates for the whole graph: the interpreter (``TRITON_INTERPRET``: nothing to compile) and a
distributed rank other than its node's first (``LOCAL_RANK``: the ranks of a node share
``~/.triton/cache``, so one worker serves them all; the others compile what it has not finished,
as without compile-ahead). Then per site and call: a device outside ``devices`` (CUDA), a call
already sent by this process (the layers of a model repeat one call; a recompile repeats them
all), one the worker cannot reproduce (an integer tensor argument), and one whose replay would
take more device memory than :func:`device_memory_budget` allows.

On an H200 (torch 2.11, Triton 3.6) the worker replayed a two-layer GQA training step's call in
17.5 s, start-up included, and that step's first run then found all six of our kernels (the
one-pass `stable` forward and backward) in Triton's cache.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode

from ..launch.common import interpreter_enabled
from ..ops.compile_ahead import KERNEL_OPS, NotReplayable, OpCallSpec, spec_from_call, start_worker, storage_elements
from .site import example_value, rewritten_attention

log = logging.getLogger("flash_inductor")

# The calls this process has sent to a worker, by ``OpCallSpec.key()``.
_SENT_BY_THIS_PROCESS: set[str] = set()

# The replay runs while the training process is about to allocate for its first step, so it may
# take at most a quarter of the device memory free when the pass runs, and never more than 4 GiB
# (HF Llama E 64 at B 8, L 2048 needs 0.2 GiB: a call past 4 GiB is a rare, very long one whose
# kernels the training process may as well compile itself).
MAX_REPLAY_BYTES = 4 << 30
_FREE_MEMORY_SHARE = 4


def device_memory_budget(device: str) -> int:
    """The most bytes one replayed call may take on ``device`` (module docstring says why)."""
    if torch.device(device).type != "cuda":
        return MAX_REPLAY_BYTES
    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return min(MAX_REPLAY_BYTES, free // _FREE_MEMORY_SHARE)


def first_rank_of_node() -> bool:
    """False in a distributed run's processes other than each node's first (``LOCAL_RANK``, set by
    torchrun, accelerate and DeepSpeed's launcher); True outside distributed runs."""
    local_rank = os.environ.get("LOCAL_RANK")
    return local_rank is None or local_rank.strip() in ("", "0")


@dataclasses.dataclass
class CompileAhead:
    """Starts the compile-ahead worker for a rewritten graph (the pass calls it when
    ``RewriteOptions.compile_ahead`` is on).

    Attributes:
        devices: device types whose sites are compiled ahead (the kernels run on CUDA only).
        allow_interpreter: also under ``TRITON_INTERPRET`` (tests: the worker then runs the
            reference path on CPU).
        start: starts the worker on the new specs (``ops.compile_ahead.start_worker``); a test
            records them instead.
        memory_budget: the most bytes a replayed call may take on a device.
        sent: keys of the specs already sent; by default this process's set.
    """

    devices: tuple[str, ...] = ("cuda",)
    allow_interpreter: bool = False
    start: Callable[[Sequence[OpCallSpec]], Any] = start_worker
    memory_budget: Callable[[str], int] = device_memory_budget
    sent: set[str] = dataclasses.field(default_factory=lambda: _SENT_BY_THIS_PROCESS)
    # Workers started and not yet seen to finish: kept so that each is reaped once it has
    # exited (an unreferenced Popen that is still running warns when it is collected).
    running: list = dataclasses.field(default_factory=list, init=False, repr=False)

    def __call__(self, graph: fx.Graph) -> int:
        """Start one worker on the graph's new calls; the number of calls sent (0: none started).
        Never raises: a failure here only means the kernels compile at the first run, as without."""
        try:
            return self._start_for(graph)
        except Exception:  # noqa: BLE001 -- compile-ahead must never fail a compile
            log.debug("flash_inductor: compile-ahead failed; the kernels compile on the first run", exc_info=True)
            return 0

    def _start_for(self, graph: fx.Graph) -> int:
        if interpreter_enabled() and not self.allow_interpreter:
            return 0
        if not first_rank_of_node():
            return 0
        specs = self._new_specs(graph)
        if not specs:
            return 0
        started = self.start(specs)
        self.sent.update(spec.key() for spec in specs)
        self.running = [w for w in self.running if w.poll() is None]
        if hasattr(started, "poll"):
            self.running.append(started)
        log.info("flash_inductor: compiling the kernels of %d attention variant%s ahead in a background process "
                 "(%smake_backend(compile_ahead=False) turns this off)", len(specs), "" if len(specs) == 1 else "s",
                 _describe(started))
        return len(specs)

    def _new_specs(self, graph: fx.Graph) -> list[OpCallSpec]:
        new: dict[str, OpCallSpec] = {}
        budgets: dict[str, int] = {}
        for node in graph.nodes:
            if node.op != "call_function" or node.target is not rewritten_attention:
                continue
            query = example_value(node.args[0] if node.args else node.kwargs.get("query"))
            if query is None or query.device.type not in self.devices:
                continue
            try:
                specs = recorded_op_calls(node)
            except NotReplayable as reason:
                log.debug("flash_inductor: compile-ahead skips %s: %s", node.name, reason)
                continue
            for spec in specs:
                key = spec.key()
                if key in self.sent or key in new:
                    continue
                device = spec.device or str(query.device)
                if device not in budgets:
                    budgets[device] = self.memory_budget(device)
                if spec.estimated_bytes() > budgets[device]:
                    log.debug("flash_inductor: compile-ahead skips %s: its replay needs %.2f GiB, over the %.2f GiB "
                              "budget", node.name, spec.estimated_bytes() / 2**30, budgets[device] / 2**30)
                    continue
                new[key] = spec
        return list(new.values())


def _describe(started: Any) -> str:
    """``pid 591, log /tmp/.../worker.log; `` for a started worker; nothing for a test's stand-in."""
    pid, log_path = getattr(started, "pid", None), getattr(started, "log_path", None)
    if pid is None:
        return ""
    return f"pid {pid}, log {log_path}; " if log_path else f"pid {pid}; "


# ------------------------------------------------------------------------------------------
# The op call of one rewritten site
# ------------------------------------------------------------------------------------------


class _KernelOpRecorder(TorchDispatchMode):
    """Records each call of a ``KERNEL_OPS`` op as a spec, and lets every call through."""

    def __init__(self):
        super().__init__()
        self.specs: list[OpCallSpec] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.OpOverload) and func.name() in KERNEL_OPS:
            self.specs.append(spec_from_call(func, args, kwargs))
        return func(*args, **kwargs)


def recorded_op_calls(node: fx.Node) -> list[OpCallSpec]:
    """The kernel op calls the ``rewritten_attention`` call ``node`` makes, as specs: the call run
    under the graph's fake mode, with grad enabled (a backward then follows where the site's
    inputs require grad, and the op path is the one a training graph takes), on concrete copies
    of its inputs' example values. Raises :class:`NotReplayable` when they cannot be had."""
    values = {n: example_value(n) for n in node.all_input_nodes}
    missing = [n.name for n, v in values.items() if v is None]
    if missing:
        raise NotReplayable(f"no example value for {', '.join(missing)}")
    fake_mode = next((getattr(v, "fake_mode", None) for v in values.values() if getattr(v, "fake_mode", None)), None)
    if fake_mode is None:
        raise NotReplayable("the graph carries no fake tensors")
    recorder = _KernelOpRecorder()
    with torch.enable_grad(), fake_mode:
        concrete = {n: _concrete_like(v) for n, v in values.items()}
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: concrete[n])
        with recorder:
            node.target(*args, **kwargs)
    return recorder.specs


def _concrete_like(value: torch.Tensor) -> torch.Tensor:
    """A fake tensor laid out as ``value``, with every symbolic size, stride and offset replaced
    by its hint (run inside the fake mode)."""
    shape = [_hint(s) for s in value.shape]
    stride = [_hint(s) for s in value.stride()]
    offset = _hint(value.storage_offset())
    if None in shape or None in stride or offset is None:
        raise NotReplayable("a size has no hint")
    storage = torch.empty(storage_elements(shape, stride, offset), dtype=value.dtype, device=value.device)
    return storage.as_strided(shape, stride, offset).requires_grad_(bool(value.requires_grad))


def _hint(size: Any) -> Optional[int]:
    """A size's value: the int itself, or a symbolic size's hint (reading it adds no guard)."""
    if isinstance(size, int):
        return size
    node = getattr(size, "node", None)
    hint = getattr(node, "hint", None)
    if hint is None and getattr(node, "shape_env", None) is not None:
        hint = node.shape_env.size_hint(node.expr, allow_none=True)
    try:
        return None if hint is None else int(hint)
    except (TypeError, ValueError):  # a hint that is itself still symbolic
        return None
