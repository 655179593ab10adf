"""Compile what the launchers would launch on an sm_90a GPU, through their real calls, on a CPU machine.

    python -m tools.launch_sass --ci                       # the fast subset CI runs (~1 min on 2 cores)
    python -m tools.launch_sass                            # every hand-picked case: Gluon and Triton, fwd and bwd
    python -m tools.launch_sass --tables                   # ... and every entry of the shipped tuning tables
    python -m tools.launch_sass --tables --write before.json
    (edit a kernel)
    python -m tools.launch_sass --tables --compare before.json     # identical / DIFFERENT per case
    python -m tools.launch_sass --tables --cases table/gluon_,gluon,one_pass     # the Gluon kernels' cases only
    python -m tools.launch_sass --cases gluon_bwd --verbose        # name prefixes pick cases; registers, spills
    python -m tools.launch_sass --grid                     # Hopper's heuristic launches, E 64/128/256 x masks x ...: 15-25 min
    python -m tools.launch_sass --grid --head-dims 256 --masks bool,window_bool --schedules stable

Each case calls a launcher (``launch.attention_forward`` / ``attention_backward``, the decode launcher,
``launch.hopper.hopper_attention_forward``, ``launch.hopper_bwd.hopper_attention_backward``, the one-pass
ops) with CPU tensors. Every launch goes through ``launch.common.launcher``; inside
``launches_replaced`` that records (kernel, grid, args, keywords) instead of launching, and each record is
compiled for sm_90a as the launch would be (``JITFunction.warmup``: Triton's own argument binding and
specialisation, the Gluon kernels through GluonASTSource, Triton's bundled ptxas) under a stand-in
driver whose target is ``GPUTarget("cuda", 90, 32)``. A launcher whose arguments no longer match its
kernel fails its case here, as it would fail on the GPU. Per case: pass/fail and, per launch, a digest of
the SASS with addresses, encodings and comments stripped; ``--write`` stores them, ``--compare`` says
which changed (exit 1 on a failure or a difference). Table entries are compiled with the entry's own
config, passed explicitly (a lookup would skip an entry whose kernel hash an edit made stale).
Without TRITON_INTERPRET (interpreted kernels are not compiled).

A launch that needs more shared memory than Hopper's opt-in limit (``footprint.OPTIN_SMEM_BYTES``)
fails its case: shared memory is fixed when a kernel is lowered, before any GPU is involved. A
backward change was once re-tuned before the GPU tests found that one launch (E=256 dQ pass with a
bool mask, a heuristic config: mask kinds other than none/causal are not tuned) needed 336 KiB
against 227 KiB. ``--grid`` compiles such launches: a forward, a backward and the decode forward at
its widest tile, at Hopper's heuristic configs (``cuda_heuristic_configs`` for 9.0), over head dims x
mask kinds x dtypes x schedules; about 10 s a case on 2 cores. tools/compile_survey.py studies the
same launches.

Each launch also gets a digest of its PTX without comments, header lines and debug information
(source lines and paths), which moving a function in its file does not change: a tuning table entry
carries its kernel family's source hash, so any edit of a kernel file makes the family's entries
stale, even for variants whose compiled code it does not touch; where the PTX is unchanged the
entries may be re-stamped rather than re-tuned (tools/carry_table_entries.py compares ``--grid``
runs of two trees).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import hashlib
import itertools
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time
from typing import Callable

TABLES = pathlib.Path(__file__).resolve().parents[1] / "flash_inductor" / "tuning" / "tables"
# torch is imported where the cases need it: the SASS helpers serve torch-free tools too
# (tools/wgmma_overlap_probe.py, run in a compile-only Triton environment).
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
SEQ = 384  # a multiple of every tile (the even paths); the `ragged` cases take 333
GRID_SEQ = 300  # not a multiple of any tile, so every masked edge path is compiled
TABLE_SEQ_CAP = 1024  # past a tile multiple a table entry's length changes nothing compiled, only memory


@dataclasses.dataclass(frozen=True)
class Launch:
    kernel: object
    grid: tuple
    args: tuple
    kwargs: dict


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    run: Callable[[], None]


class _HopperStandIn:
    """Just enough of a Triton driver for JITFunction.warmup to compile for sm_90a without a GPU."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


@contextlib.contextmanager
def hopper_target():
    """Triton's active driver is the stand-in within the block (this process's Triton state, not ours)."""
    from triton.runtime import driver

    # The private attribute, not driver.active/reset_active: both build the default driver, which
    # fails on a machine without a GPU.
    saved = getattr(driver, "_active", None)
    driver.set_active(_HopperStandIn())
    try:
        yield
    finally:
        driver._active = saved


def captured_launches(run: Callable[[], None]) -> list[Launch]:
    """The launches ``run`` makes through ``launch.common.launcher``, recorded instead of launched."""
    from flash_inductor.launch import common

    launches: list[Launch] = []

    def record(kernel):
        class Indexed:
            def __getitem__(self, grid):
                return lambda *args, **kwargs: launches.append(Launch(kernel, grid, args, kwargs))
        return Indexed()

    with common.launches_replaced(record):
        run()
    return launches


def compiled_launches(run: Callable[[], None]) -> list[tuple[Launch, object, float]]:
    """(launch, CompiledKernel, compile seconds) for each launch ``run`` makes, compiled for sm_90a as
    the launch would be."""
    launches, compiled = captured_launches(run), []
    with hopper_target():
        for launch in launches:
            start = time.perf_counter()
            kernel = launch.kernel.warmup(*launch.args, grid=launch.grid, **launch.kwargs)
            compiled.append((launch, kernel, time.perf_counter() - start))
    return compiled


def refuse_interpreter(p: argparse.ArgumentParser) -> None:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        p.error("unset TRITON_INTERPRET: interpreted kernels are not compiled")


def _nvidia_tool(name: str) -> str:
    import triton.backends.nvidia as nvidia_backend

    return os.path.join(os.path.dirname(nvidia_backend.__file__), "bin", name)


def cubin_tool(name: str, options: list[str], cubin: bytes) -> str:
    """What the Triton wheel's ``name`` (cuobjdump, nvdisasm) prints for ``cubin``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        return subprocess.run([_nvidia_tool(name), *options, f.name], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.unlink(f.name)


def sass_of(compiled) -> str:
    return cubin_tool("cuobjdump", ["-sass"], compiled.asm["cubin"])


# An instruction line of cuobjdump: /*0a30*/  @P0 BRA `(.L_x_12) ;  /* 0x000... */
_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")
# PTX header lines, and the debug anchors: line directives and the `$L__tmpN:` labels they point at.
_PTX_HEADER = re.compile(r"^\s*(//|\.version|\.target|\.address_size|\.loc\b|\.file\b|\$L__tmp\d+:)")


def normalised_sass(sass: str) -> str:
    """The instruction text alone: no addresses, encodings, headers or comments."""
    return "\n".join(m.group(1) for line in sass.splitlines() if (m := _INSTRUCTION.match(line)))


def sass_digest(compiled) -> str:
    return hashlib.sha256(normalised_sass(sass_of(compiled)).encode()).hexdigest()[:16]


def ptx_digest(ptx: str) -> str:
    """A hash of the code alone: the debug sections (DWARF, which encode source lines and paths),
    the line directives and their labels are dropped, so moving a function in the file changes
    nothing."""
    code = ptx.split("\t.section\t.debug", 1)[0]
    body = "\n".join(line.split("//")[0].rstrip() for line in code.splitlines()
                     if line.strip() and not _PTX_HEADER.match(line))
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def ptxas_usage(ptx: str) -> dict:
    """Registers, spill bytes and ptxas's notes (serialised wgmma among them) from ``ptxas -v``."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        pathlib.Path(src).write_text(ptx)
        log = subprocess.run([_nvidia_tool("ptxas"), "-arch=sm_90a", "-v", src, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True).stderr
    num = lambda pat: int(m.group(1)) if (m := re.search(pat, log)) else None  # noqa: E731
    return dict(regs=num(r"Used (\d+) registers"), spill_stores=num(r"(\d+) bytes spill stores"),
                spill_loads=num(r"(\d+) bytes spill loads"),
                ptxas_warnings=[line for line in log.splitlines()
                                if "warning" in line.lower() or "performance loss" in line.lower()])


def run_case(case: Case, verbose: bool = False, dump: str | None = None) -> dict:
    """{"status": "pass"|"fail", "kernels": {"<i>:<kernel>": {"sass": digest, "ptx": digest, "shared": bytes}},
    "error"?}; ``dump``: a folder for each launch's ttgir, ptx and sass."""
    from flash_inductor.tuning.footprint import OPTIN_SMEM_BYTES

    result: dict = {"status": "pass", "kernels": {}}
    try:
        for i, (launch, compiled, _) in enumerate(compiled_launches(case.run)):
            name, shared = f"{i}:{launch.kernel.fn.__name__}", compiled.metadata.shared
            entry = dict(sass=sass_digest(compiled), ptx=ptx_digest(compiled.asm["ptx"]), shared=shared)
            if verbose:
                entry.update(ptxas_usage(compiled.asm["ptx"]))
            result["kernels"][name] = entry
            if dump:
                _dump(compiled, pathlib.Path(dump) / f"{case.name.replace('/', '_')}.{name.replace(':', '_')}")
            if shared > OPTIN_SMEM_BYTES[(9, 0)]:
                raise RuntimeError(f"{name} needs {shared} bytes of shared memory, over sm_90's "
                                   f"{OPTIN_SMEM_BYTES[(9, 0)]}")
    except Exception as error:  # noqa: BLE001 -- every case reports, not just the first failure
        result.update(status="fail", error=f"{type(error).__name__}: {str(error).strip()[-800:]}")
    return result


def _dump(compiled, stem: pathlib.Path) -> None:
    stem.parent.mkdir(parents=True, exist_ok=True)
    for ext in ("ttgir", "ptx"):
        stem.with_name(f"{stem.name}.{ext}").write_text(compiled.asm[ext])
    stem.with_name(f"{stem.name}.sass").write_text(sass_of(compiled))


# ------------------------------------------------------------------------------------------
# The cases: launchers called as the ops call them, on CPU tensors
# ------------------------------------------------------------------------------------------


def _tensors(dtype, head_dim, seq, count, heads=2):
    import torch

    gen = torch.Generator().manual_seed(0)
    return [torch.randn((1, heads, seq, head_dim), generator=gen).to(dtype) for _ in range(count)]


def _visibility(kind: str, seq: int, block: int = 128):
    import torch

    from flash_inductor.launch.visibility import Visibility

    if kind == "sparse":
        blocks = -(-seq // block)
        block_map = torch.rand((1, 1, blocks, blocks), generator=torch.Generator().manual_seed(1)) > 0.5
        return Visibility(is_causal=True, block_map=block_map, block_q=block, block_k=block)
    window = {"window": (127, 0), "window2": (100, 30)}.get(kind)
    return Visibility(is_causal=kind in ("causal", "window"), window=window)


def _key_mask(kind: str, seq: int, dtype, heads: int = 2):
    import torch

    if kind == "key":  # a padding mask, (B, 1, 1, S) broadcast along the queries as the API passes it
        return (torch.arange(seq) < seq - 7).reshape(1, 1, 1, seq).expand(1, heads, seq, seq)
    if kind == "key_additive":
        return torch.zeros((1, 1, 1, seq), dtype=dtype).expand(1, heads, seq, seq)
    return None


def gluon_forward(dtype, head_dim, kind, *, exact=False, config=None, seq=SEQ, schedule=None, softcap=0.0,
                  sinks=False):
    """The Gluon forward; ``softcap``: the soft cap (SOFTCAP); ``sinks``: with a sink logit per head
    (HAS_SINKS)."""
    import torch

    from flash_inductor.launch import hopper

    q, k, v = _tensors(dtype, head_dim, seq, 3)
    extra = dict(softcap=softcap) if softcap else {}
    if sinks:
        extra["sinks"] = torch.linspace(-1.0, 2.0, q.shape[1])
    hopper.hopper_attention_forward(q, k, v, scale=head_dim**-0.5, visibility=_visibility(kind, seq),
                                    attn_mask=_key_mask(kind, seq, dtype), config=config, exact_delta=exact,
                                    schedule=schedule or ("stable" if exact else "fast"), **extra)


def gluon_backward(dtype, head_dim, kind, *, exact=False, config=None, seq=SEQ, grad_lse=False, group=1, softcap=0.0):
    """`fast`'s backward, or (``exact``) `stable`'s one-pass backward as ops/one_pass.py calls it;
    ``group`` query heads per KV head (2 KV heads); ``softcap`` > 0 a soft cap."""
    import torch

    from flash_inductor.launch import hopper_bwd

    q, do, out = _tensors(dtype, head_dim, seq, 3, heads=2 * group)
    k, v = _tensors(dtype, head_dim, seq, 2)
    lse = torch.zeros((1, 2 * group, seq))
    extra = {}
    if exact:  # as ops/one_pass.py calls it: centred keys, but for a soft cap
        extra = dict(exact_delta=(torch.zeros_like(out), torch.zeros((2, 1, 2 * group, seq))),
                     mean_key=None if softcap else hopper_bwd.key_moments(k))
    if softcap:
        extra["softcap"] = softcap
    hopper_bwd.hopper_attention_backward(do, q, k, v, out, lse, lse if grad_lse else None, scale=head_dim**-0.5,
                                         visibility=_visibility(kind, seq),
                                         attn_mask=_key_mask(kind, seq, dtype, 2 * group), config=config, schedule="stable" if exact else "fast", **extra)


def one_pass(dtype, head_dim, kind, seq=SEQ, softcap=0.0):
    """The one-pass ops themselves (``flash_inductor::attention_{forward,backward}_one_pass``);
    ``softcap`` > 0 passes a soft cap."""
    import torch

    import flash_inductor.ops.one_pass  # noqa: F401 -- registers the ops

    q, k, v, do = _tensors(dtype, head_dim, seq, 4)
    vis = _visibility(kind, seq)
    mask = _key_mask(kind, seq, dtype)
    window = vis.window or (-1, -1)
    ops = torch.ops.flash_inductor
    capped = dict(softcap=softcap) if softcap else {}
    out, lse, resid, rows = ops.attention_forward_one_pass(q, k, v, vis.is_causal, 0, head_dim**-0.5, *window, mask,
                                                           **capped)
    ops.attention_backward_one_pass(do, q, k, v, out, lse, lse, resid, rows, vis.is_causal, 0, head_dim**-0.5,
                                    *window, mask, **capped)


def _packing(seq):
    """Three sequences packed along ``seq`` rows: a tile multiple, a ragged one, one token."""
    import torch

    from flash_inductor.launch.packed import PackedSequences

    offsets = torch.tensor([0, 128, seq - 1, seq], dtype=torch.int32)
    return PackedSequences(offsets, offsets, seq - 129, seq - 129)


def gluon_varlen(dtype, head_dim, kind, *, passes=("forward", "backward"), exact=False, group=1, seq=SEQ):
    """The Gluon varlen launchers (``launch/hopper_varlen.py``) on a pack of three sequences;
    ``group`` query heads per KV head (2 KV heads)."""
    import torch

    from flash_inductor.launch import hopper_varlen

    q, do = _tensors(dtype, head_dim, seq, 2, heads=2 * group)
    k, v = _tensors(dtype, head_dim, seq, 2)
    packed = _packing(seq)
    vis = _visibility(kind, seq)
    if "forward" in passes:
        hopper_varlen.hopper_varlen_forward(q, k, v, packed, scale=head_dim**-0.5, visibility=vis, exact_delta=exact)
    if "backward" in passes:
        out, lse = q, torch.zeros((1, 2 * group, seq))
        extra = dict(exact_delta=(torch.zeros_like(out), torch.zeros((2, 1, 2 * group, seq)))) if exact else {}
        hopper_varlen.hopper_varlen_backward(do, q, k, v, out, lse, lse if exact else None, packed,
                                             scale=head_dim**-0.5, visibility=vis, **extra)


def heuristic_configs(dtype, head_dim, kind, schedule, mask=None, head_dim_v=None, capability=(9, 0)):
    """The configs ``capability``'s heuristic gives a launch of ``kind`` with ``mask``: a window takes
    the causal bucket's, a dense mask its own (compiled for sm_90 whatever ``capability``)."""
    from flash_inductor.tuning.configs import cuda_heuristic_configs

    mask_kind = mask or ("causal" if kind in ("causal", "window") else "none")
    return cuda_heuristic_configs(capability, dtype.itemsize, head_dim, head_dim_v or head_dim, schedule, mask_kind)


def triton_pass(dtype, head_dim, kind, schedule, passes=("forward", "backward"), *, configs=None, seq=SEQ,
                mask=None, mask_grad=None, softcap=0.0, dropout_p=0.0, head_dim_v=None, packed=False, sinks=False):
    """The Triton launchers at Hopper's heuristic configs, or ``configs``. ``mask``: None, "bool" or
    "float" (a dense (B, H, L, S) mask, whose gradient the backward then writes unless ``mask_grad``
    is False); ``packed``: two sequences packed along the rows (varlen); ``sinks``: a sink logit per
    head (HAS_SINKS), and the sinks' gradient launch."""
    import torch

    from flash_inductor import launch
    from flash_inductor.launch.packed import PackedSequences

    head_dim_v = head_dim_v or head_dim
    configs = configs or heuristic_configs(dtype, head_dim, kind, schedule, mask, head_dim_v)
    q, k, do = _tensors(dtype, head_dim, seq, 3)
    v, out = _tensors(dtype, head_dim_v, seq, 2)
    lse = torch.zeros((1, 2, seq))
    attn_mask = None
    if mask == "bool":
        attn_mask = torch.rand((1, 2, seq, seq), generator=torch.Generator().manual_seed(2)) > 0.3
    elif mask == "float":
        attn_mask = torch.zeros((1, 2, seq, seq), dtype=dtype)
    seed = torch.tensor([7], dtype=torch.int64) if dropout_p else None
    options = dict(visibility=_visibility(kind, seq, block=64), configs=configs, softcap=softcap)
    if sinks:
        options["sinks"] = torch.linspace(-1.0, 2.0, q.shape[1])
    if packed:
        offsets = torch.tensor([0, seq // 3, seq], dtype=torch.int32)
        options["packed"] = PackedSequences(offsets, offsets, seq - seq // 3, seq - seq // 3)
    if "forward" in passes:
        launch.attention_forward(q, k, v, attn_mask, seed, dropout_p, head_dim**-0.5, schedule, **options)
    if "backward" in passes:
        launch.attention_backward(do, q, k, v, attn_mask, out, lse, None, seed, dropout_p, head_dim**-0.5, schedule,
                                  mask == "float" if mask_grad is None else mask_grad, **options)
        if sinks:
            launch.sinks_backward(do, out, lse, None, options["sinks"])


def decode(dtype, head_dim, kind, schedule="stable", seq=1024, num_splits=2, *, rows=4, mask=None, config=None):
    """The split-KV decode forward: ``rows`` query rows of a group of 8 heads; ``kind`` "bool" or
    "float" a mask, else as ``_visibility`` (``mask``: a mask beside it)."""
    import torch

    from flash_inductor.launch.decode import decode_attention_forward

    q = _tensors(dtype, head_dim, rows, 1, heads=8)[0]
    k, v = _tensors(dtype, head_dim, seq, 2, heads=1)
    keys = torch.arange(seq) > 5
    # ``mask`` (heuristic's) is a key padding mask as a user passes it, (B, 1, 1, S): its batch stride is S.
    dense = {"bool": (keys.reshape(1, 1, 1, seq) if mask else keys).expand(1, 8, rows, seq),
             "float": torch.zeros((1, 8, rows, seq), dtype=dtype)}.get(mask or kind)
    vis = dataclasses.replace(_visibility(kind, seq), causal_offset=seq - rows)
    decode_attention_forward(q, k, v, dense, head_dim**-0.5, schedule, visibility=vis, num_splits=num_splits,
                             config=config)


# --grid's mask kinds: the launch kind and dense mask each stands for (a causal sliding window, and a
# two-sided one over a bool mask).
GRID_MASKS = {"none": ("none", None), "causal": ("causal", None), "bool": ("none", "bool"),
              "float": ("none", "float"), "window": ("window", None), "window_bool": ("window2", "bool")}


def heuristic(dtype, head_dim, mask_kind, schedule, *, seq=GRID_SEQ, configs=None, dropout_p=0.0, decode_too=True):
    """A forward and a backward (the mask without a gradient) at Hopper's heuristic configs, or
    ``configs``, and (``decode_too``) the decode forward at its widest tile: 16 query rows of a
    group of 8 heads, 128 packed rows, the config's row cap per program. ``mask_kind``: a GRID_MASKS key."""
    from flash_inductor.launch.decode import DECODE_MAX_QUERY_ROWS

    kind, mask = GRID_MASKS[mask_kind]
    configs = configs or heuristic_configs(dtype, head_dim, kind, schedule, mask)
    triton_pass(dtype, head_dim, kind, schedule, configs=configs, seq=seq, mask=mask, mask_grad=False,
                dropout_p=dropout_p)
    if decode_too:
        decode(dtype, head_dim, kind, schedule, seq, rows=DECODE_MAX_QUERY_ROWS, mask=mask, config=configs.decode)


def _case(name, fn, *args, **kwargs) -> Case:
    return Case(name, functools.partial(fn, *args, **kwargs))


def hand_picked_cases() -> list[Case]:
    import torch

    from flash_inductor.tuning.hopper_configs import HopperBackwardConfig, HopperForwardConfig

    cases = []
    for dt in ("bf16", "fp16"):
        dtype = getattr(torch, DTYPE_NAMES[dt])
        for e in (64, 128):
            for kind in ("none", "causal", "window", "window2", "key", "sparse"):
                cases.append(_case(f"gluon_fwd/{dt}/e{e}/{kind}", gluon_forward, dtype, e, kind))
                cases.append(_case(f"gluon_fwd_exact/{dt}/e{e}/{kind}", gluon_forward, dtype, e, kind, exact=True))
                cases.append(_case(f"gluon_bwd/{dt}/e{e}/{kind}", gluon_backward, dtype, e, kind))
                cases.append(_case(f"gluon_bwd_exact/{dt}/e{e}/{kind}", gluon_backward, dtype, e, kind, exact=True))
            persistent = HopperForwardConfig(num_consumers=2, persistent=True)
            cases.append(_case(f"gluon_fwd/{dt}/e{e}/causal/persistent", gluon_forward, dtype, e, "causal",
                               config=persistent))
            cases.append(_case(f"gluon_bwd/{dt}/e{e}/causal/ragged", gluon_backward, dtype, e, "causal", seq=333,
                               grad_lse=True))
            cases.append(_case(f"gluon_bwd_exact/{dt}/e{e}/key/split2", gluon_backward, dtype, e, "key", exact=True,
                               config=HopperBackwardConfig(group_split=2), group=2))
            cases.append(_case(f"one_pass/{dt}/e{e}/causal", one_pass, dtype, e, "causal"))
            for kind in ("none", "causal", "window"):
                cases.append(_case(f"gluon_varlen_fwd/{dt}/e{e}/{kind}", gluon_varlen, dtype, e, kind,
                                   passes=("forward",)))
                cases.append(_case(f"gluon_varlen_bwd/{dt}/e{e}/{kind}", gluon_varlen, dtype, e, kind,
                                   passes=("backward",)))
            cases.append(_case(f"gluon_varlen_fwd_exact/{dt}/e{e}/causal", gluon_varlen, dtype, e, "causal",
                               passes=("forward",), exact=True))
            cases.append(_case(f"gluon_varlen_bwd/{dt}/e{e}/causal/gqa", gluon_varlen, dtype, e, "causal",
                               passes=("backward",), group=4))
            cases.append(_case(f"gluon_varlen_bwd_exact/{dt}/e{e}/causal", gluon_varlen, dtype, e, "causal",
                               passes=("backward",), exact=True, group=2))
            for kind in ("none", "causal"):  # the soft cap (SOFTCAP) on every Gluon path
                for path, fn, exact in (("gluon_fwd", gluon_forward, False), ("gluon_fwd_exact", gluon_forward, True),
                                        ("gluon_bwd", gluon_backward, False), ("gluon_bwd_exact", gluon_backward, True)):
                    cases.append(_case(f"softcap/{path}/{dt}/e{e}/{kind}", fn, dtype, e, kind, exact=exact,
                                       softcap=30.0))
            cases.append(_case(f"softcap/one_pass/{dt}/e{e}/causal", one_pass, dtype, e, "causal", softcap=30.0))
            for kind in ("none", "causal", "key", "sparse"):
                cases.append(_case(f"gluon_fwd_sinks/{dt}/e{e}/{kind}", gluon_forward, dtype, e, kind, sinks=True))
                cases.append(_case(f"gluon_fwd_exact_sinks/{dt}/e{e}/{kind}", gluon_forward, dtype, e, kind,
                                   exact=True, sinks=True))
            cases.append(_case(f"gluon_fwd_sinks/{dt}/e{e}/causal/persistent", gluon_forward, dtype, e, "causal",
                               config=persistent, sinks=True))
        cases.append(_case(f"gluon_bwd_exact/{dt}/e64/key/paired", gluon_backward, dtype, 64, "key", exact=True,
                           config=HopperBackwardConfig(paired_tiles=True)))
        cases.append(_case(f"gluon_bwd_exact/{dt}/e64/key_additive", gluon_backward, dtype, 64, "key_additive",
                           exact=True))
        for e in (64, 128):
            for schedule in ("stable", "fast", "accurate"):
                for kind in ("none", "causal", "window", "sparse"):
                    cases.append(_case(f"triton/{schedule}/{dt}/e{e}/{kind}", triton_pass, dtype, e, kind, schedule))
                cases.append(_case(f"triton/{schedule}/{dt}/e{e}/bool", triton_pass, dtype, e, "none", schedule,
                                   mask="bool"))
            for schedule in ("stable", "fast"):  # the mask's gradient from the dK/dV pass, and from the dQ pass
                cases.append(_case(f"triton/{schedule}/{dt}/e{e}/float", triton_pass, dtype, e, "none", schedule,
                                   mask="float"))
            cases.append(_case(f"triton/stable/{dt}/e{e}/causal/softcap", triton_pass, dtype, e, "causal", "stable",
                               softcap=30.0))
            for schedule in ("stable", "fast"):
                cases.append(_case(f"triton/{schedule}/{dt}/e{e}/causal/sinks", triton_pass, dtype, e, "causal",
                                   schedule, sinks=True))
            cases.append(_case(f"triton/fp8/{dt}/e{e}/causal", triton_pass, dtype, e, "causal", "fp8",
                               passes=("forward",)))
            for kind in ("none", "causal", "bool", "float"):
                cases.append(_case(f"decode/{dt}/e{e}/{kind}", decode, dtype, e, kind))
            cases.append(_case(f"decode/{dt}/e{e}/none/accurate", decode, dtype, e, "none", "accurate"))
            cases.append(_case(f"decode/{dt}/e{e}/none/single", decode, dtype, e, "none", num_splits=1))
    return cases + triton_matrix()


def triton_matrix() -> list[Case]:
    """The Triton kernels' switches crossed (the default schedule): dtype (fp32 too) x mask x dropout x
    causal side x window, at E 80 with Ev 64 (the head dims' load masks kept), then block-sparse
    layouts, soft-capping and packed sequences over what they combine with."""
    import torch

    cases = []
    for dt, mask, dropout, kind in itertools.product(("fp16", "bf16", "fp32"), (None, "bool", "float"),
                                                     (0.0, 0.1), ("none", "causal", "window", "window2")):
        dtype = getattr(torch, DTYPE_NAMES[dt])
        name = f"triton_matrix/{dt}/{mask or 'nomask'}/{'dropout' if dropout else 'nodrop'}/{kind}"
        cases.append(_case(name, triton_pass, dtype, 80, kind, "stable", seq=300, mask=mask, dropout_p=dropout,
                           head_dim_v=64))
        if not dropout and mask != "float" and kind in ("none", "causal"):
            cases.append(_case(name.replace("nodrop", "sparse"), triton_pass, dtype, 80,
                               "sparse" if kind == "causal" else kind, "stable", seq=300, mask=mask, head_dim_v=64))
        if not dropout and mask is None:
            for extra, tag in ((dict(softcap=30.0), "softcap"), (dict(packed=True), "packed"),
                               (dict(softcap=30.0, packed=True), "softcap_packed")):
                cases.append(_case(name.replace("nodrop", tag), triton_pass, dtype, 80, kind, "stable", seq=300,
                                   head_dim_v=64, **extra))
    return cases


# A launcher/kernel mismatch anywhere shows here: each Gluon kernel (forward plain and exact-Δ, backward
# `fast` and one-pass) and each Triton launch path once, fp16 and bf16 both.
CI_CASES = ("gluon_fwd/bf16/e64/causal", "gluon_bwd_exact/fp16/e128/window", "triton/stable/fp16/e64/sparse",
            "decode/bf16/e64/causal", "gluon_fwd_exact_sinks/bf16/e128/key", "gluon_varlen_fwd_exact/bf16/e128/causal",
            "gluon_varlen_bwd_exact/fp16/e64/causal")


def table_cases() -> list[Case]:
    """One case per entry of the shipped tables (their own configs, the rest Hopper's heuristic)."""
    import torch

    from flash_inductor.tuning.buckets import Bucket
    from flash_inductor.tuning.configs import cuda_heuristic_configs
    from flash_inductor.tuning.kernel_config import role_config_from_dict

    cases = []
    for path in sorted(TABLES.glob("*.json")):
        for key, entry in sorted(json.loads(path.read_text())["entries"].items()):
            bucket = Bucket.parse(key)
            dtype = getattr(torch, DTYPE_NAMES[bucket.dtype])
            width, seq = bucket.width, min(bucket.seq, TABLE_SEQ_CAP)
            roles = {role: role_config_from_dict(role, data) for role, data in entry["configs"].items()}
            kind = "causal" if bucket.mask == "causal" else "none"
            name = f"table/{bucket.pass_name}/{path.stem}/{key}"  # table/gluon_ picks the Gluon kernels' entries
            if bucket.pass_name in ("gluon_forward", "gluon_forward_exact"):
                cases.append(_case(name, gluon_forward, dtype, width, kind, seq=seq, config=roles[bucket.pass_name],
                                   exact=bucket.pass_name == "gluon_forward_exact", schedule=bucket.schedule))
            elif bucket.pass_name == "gluon_backward":
                cases.append(_case(name, gluon_backward, dtype, width, kind, seq=seq, config=roles["gluon_backward"],
                                   exact=bucket.schedule == "stable"))
            else:
                heuristic = cuda_heuristic_configs((9, 0), dtype.itemsize, width, width, bucket.schedule,
                                                   bucket.mask)
                configs = dataclasses.replace(heuristic, **roles)
                cases.append(_case(name, triton_pass, dtype, width, kind, bucket.schedule, (bucket.pass_name,),
                                   configs=configs, seq=seq, mask=None if kind == bucket.mask else bucket.mask))
    return cases


def add_grid_arguments(p: argparse.ArgumentParser, *, head_dims: str = "64,128,256",
                       masks: str = "none,causal,bool,float", schedules: str = "stable,fast,accurate") -> None:
    """The options that pick ``heuristic``'s cases: comma lists of head dims, mask kinds, dtypes and schedules."""
    p.add_argument("--head-dims", default=head_dims)
    p.add_argument("--masks", default=masks, help=f"comma list of {','.join(GRID_MASKS)}")
    p.add_argument("--dtypes", default="bf16,fp16")
    p.add_argument("--schedules", default=schedules)


def grid_cells(p: argparse.ArgumentParser, args) -> list[tuple[int, str, str, str]]:
    """(head dim, mask kind, dtype, schedule) for every combination ``args`` names."""
    for option, names, known in (("--dtypes", args.dtypes, DTYPE_NAMES), ("--masks", args.masks, GRID_MASKS)):
        unknown = sorted(set(names.split(",")) - set(known))
        if unknown:
            p.error(f"{option}: {unknown} not among {sorted(known)}")
    return list(itertools.product([int(e) for e in args.head_dims.split(",")], args.masks.split(","),
                                  args.dtypes.split(","), args.schedules.split(",")))


def grid_cases(p: argparse.ArgumentParser, args) -> list[Case]:
    """--grid: ``heuristic`` per cell, named grid/<schedule>/<dtype>/e<E>/<mask>."""
    import torch

    return [_case(f"grid/{schedule}/{dt}/e{e}/{mask}", heuristic, getattr(torch, DTYPE_NAMES[dt]), e, mask, schedule,
                  seq=args.seq) for e, mask, dt, schedule in grid_cells(p, args)]


# ------------------------------------------------------------------------------------------
# Digest files
# ------------------------------------------------------------------------------------------


def compare(results: dict, before: dict) -> list[tuple[str, str]]:
    """(verdict, case) per case: identical, "same PTX" (the SASS differs, as it may where only the
    line information moved), DIFFERENT (a kernel's code, or the launches), FAIL, NEW."""
    digests = lambda r, key: {k: v.get(key) for k, v in r["kernels"].items()}  # noqa: E731
    verdicts = []
    for name, result in results.items():
        old = before.get(name)
        if result["status"] != "pass":
            verdict = "FAIL"
        elif old is None or old.get("status") != "pass":
            verdict = "NEW"
        elif digests(result, "sass") == digests(old, "sass"):
            verdict = "identical"
        else:  # a file written before the PTX digests has None for each
            same_ptx = digests(result, "ptx") == digests(old, "ptx") and None not in digests(old, "ptx").values()
            verdict = "same PTX" if same_ptx else "DIFFERENT"
        verdicts.append((verdict, name))
    return verdicts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ci", action="store_true", help="only the fast subset CI runs (CI_CASES)")
    p.add_argument("--tables", action="store_true", help="also every entry of the shipped tuning tables")
    p.add_argument("--cases", default="", help="comma list of prefixes: run the cases whose names start with one")
    p.add_argument("--write", help="store the results (per case: status, per launch SASS and PTX digests and "
                                   "shared bytes)")
    p.add_argument("--compare", help="an earlier --write file: identical / DIFFERENT per case")
    p.add_argument("--verbose", action="store_true", help="also registers, spills and ptxas's notes per launch")
    p.add_argument("--dump", help="a folder for each launch's ttgir, ptx and sass")
    p.add_argument("--grid", action="store_true", help="the heuristic launches over the options below (heuristic()) "
                                                       "in place of the hand-picked cases")
    add_grid_arguments(p)
    p.add_argument("--seq", type=int, default=GRID_SEQ, help="--grid's L = S")
    args = p.parse_args(argv)
    refuse_interpreter(p)
    cases = (grid_cases(p, args) if args.grid else hand_picked_cases()) + (table_cases() if args.tables else [])
    if args.ci:
        cases = [c for c in cases if c.name in CI_CASES]
    if args.cases:
        cases = [c for c in cases if c.name.startswith(tuple(args.cases.split(",")))]
    results, start = {}, time.time()
    for i, case in enumerate(cases, 1):
        t0 = time.time()
        results[case.name] = result = run_case(case, args.verbose, args.dump)
        detail = result.get("error") or " ".join(
            f"{k}={v['sass']}/{v['shared'] // 1024}KiB" + (f"(regs {v['regs']}, spills {v['spill_stores']})"
                                                            if args.verbose else "")
            for k, v in result["kernels"].items())
        print(f"[{i}/{len(cases)}] {result['status'].upper()} {case.name} ({time.time() - t0:.0f} s): {detail}",
              flush=True)
    failed = [n for n, r in results.items() if r["status"] != "pass"]
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed in {time.time() - start:.0f} s")
    if args.write:
        # One case a line: a digest file diffs as a list of cases.
        lines = (f"{json.dumps(name)}: {json.dumps(result, sort_keys=True)}" for name, result in sorted(results.items()))
        pathlib.Path(args.write).write_text("{\n" + ",\n".join(lines) + "\n}\n")
    if args.compare:
        verdicts = compare(results, json.loads(pathlib.Path(args.compare).read_text()))
        for verdict, name in verdicts:
            print(f"{verdict:9s} {name}")
        changed = sum(v not in ("identical", "NEW") for v, _ in verdicts)
        print(f"{sum(v == 'identical' for v, _ in verdicts)} identical, {changed} different or failed")
        return 1 if changed or failed else 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
