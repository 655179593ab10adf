"""Shared memory of the kernels our launchers would start on a Hopper GPU, measured on any machine.

    python -m tools.smem_check                  # E 64/128/256 x masks x bf16/fp16 x schedules: 15-25 min
    python -m tools.smem_check --head-dims 256 --masks bool --schedules stable
    python -m tools.smem_check --masks window,window_bool     # a sliding window (WINDOW_LEFT kernels)

A backward change was once re-tuned before the GPU tests found that one launch (E=256
dQ pass with a bool mask, a heuristic config: mask kinds other than none/causal are not tuned)
needed 336 KiB of shared memory against Hopper's 227 KiB. Shared memory is fixed when Triton
lowers a kernel, before any GPU is involved, so this tool finds such launches on a CPU machine:
it runs ``launch.attention_forward`` / ``attention_backward`` on CPU tensors with the configs a
Hopper launch would use (``cuda_heuristic_configs`` for capability 9.0), and in place of each
launch compiles the kernel for sm_90 (``JITFunction.warmup`` under a stand-in driver, so the real
argument specialisation and constexprs are used) and reads its ``metadata.shared``. Exit status 1
if any kernel needs more than the opt-in limit (``search_space.OPTIN_SMEM_BYTES``).

Needs the Triton wheel's ptxas, and must run without TRITON_INTERPRET (interpreted kernels do not
compile). About 10 s a combination on 2 cores. Numbers are Triton's of this machine (3.7 in CI);
the 3.6 on the H200 reported the same 344064 bytes for the launch above.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import sys
import time

import torch

ARCH = (9, 0)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# A length that is not a multiple of any tile, so every masked edge path is compiled.
SEQ = 300


@contextlib.contextmanager
def compiling_launches(record: list, compiled_by_name: dict | None = None, observe=None):
    """Within the block, every ``launch.common.launcher(kernel)[grid](...)`` compiles the kernel for
    sm_90 and appends (kernel name, shared bytes) to ``record`` instead of launching it (and keeps
    the compiled kernel in ``compiled_by_name``, when given, for tools/sass_mix.py). ``observe``,
    when given, is called as observe(kernel name, compiled kernel, compile seconds, grid, keyword
    arguments) after each (tools/compile_survey.py)."""
    from flash_inductor.launch import common
    from tools.launch_sass import hopper_target

    def compile_only(kernel):
        class Indexed:
            def __getitem__(self, grid):
                def call(*args, **kwargs):
                    start = time.perf_counter()
                    compiled = kernel.warmup(*args, grid=grid, **kwargs)
                    if observe is not None:
                        observe(kernel.fn.__name__, compiled, time.perf_counter() - start, grid, kwargs)
                    record.append((kernel.fn.__name__, compiled.metadata.shared))
                    if compiled_by_name is not None:
                        compiled_by_name[kernel.fn.__name__] = compiled
                return call
        return Indexed()

    with hopper_target(), _launches_replaced(common, compile_only):
        yield


@contextlib.contextmanager
def _launches_replaced(common, replacement):
    """``common.launches_replaced``; a package older than it (tools/carry_table_entries.py
    --whole-package) has only the module attribute, which is swapped for the block."""
    if hasattr(common, "launches_replaced"):
        with common.launches_replaced(replacement):
            yield
        return
    saved, common.launcher = common.launcher, replacement
    try:
        yield
    finally:
        common.launcher = saved


def check(head_dim: int, mask_kind: str, dtype_name: str, schedule: str, seq: int = SEQ, configs=None,
          compiled_by_name: dict | None = None) -> list[tuple[str, int]]:
    """(kernel, shared bytes) for one forward, one backward and one decode forward of length ``seq``, with ``configs``
    (default: Hopper's heuristic ones); the compiled kernels go to ``compiled_by_name`` if given."""
    record: list[tuple[str, int]] = []
    with compiling_launches(record, compiled_by_name):
        run_launches(head_dim, mask_kind, dtype_name, schedule, seq, configs)
    return record


def run_launches(head_dim: int, mask_kind: str, dtype_name: str, schedule: str, seq: int = SEQ, configs=None, *,
                 dropout_p: float = 0.0, decode: bool = True) -> None:
    """Call the launchers for one forward, one backward and (``decode``) one decode forward of length
    ``seq`` (``configs`` default: Hopper's heuristic ones), with dropout where ``dropout_p`` > 0 (the
    decode kernels take none). Run it where ``launch.common.launcher`` is replaced
    (``compiling_launches``): the tensors are CPU tensors."""
    from flash_inductor import launch
    from flash_inductor.tuning.configs import cuda_heuristic_configs

    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout, out = (torch.randn((1, 2, seq, head_dim), generator=gen, dtype=dtype) for _ in range(5))
    lse = torch.randn((1, 2, seq), generator=gen)
    mask = None
    if mask_kind in ("bool", "window_bool"):
        mask = torch.rand((1, 2, seq, seq), generator=gen) > 0.3
    elif mask_kind == "float":
        mask = torch.randn((1, 2, seq, seq), generator=gen, dtype=dtype)
    causal = mask_kind == "causal"
    # Windows: a causal sliding one (its right side is the causal bucket's), and a symmetric one over
    # a bool mask; the configs are those of the bucket the launcher picks for them.
    window = {"window": (63, 0), "window_bool": (63, 63)}.get(mask_kind)
    config_kind = {"window": "causal", "window_bool": "bool"}.get(mask_kind, mask_kind)
    if configs is None:
        configs = cuda_heuristic_configs(ARCH, dtype.itemsize, head_dim, head_dim, schedule, config_kind)
    scale = head_dim ** -0.5
    # Any int64 seed will do: only the kernels' specialisation matters here.
    seed = torch.tensor([12345], dtype=torch.int64) if dropout_p > 0 else None
    if hasattr(launch, "Visibility"):
        visibility = launch.Visibility(is_causal=causal, window=window)
        launch.attention_forward(q, k, v, mask, seed, dropout_p, scale, schedule, visibility=visibility,
                                 configs=configs)
        launch.attention_backward(dout, q, k, v, mask, out, lse, None, seed, dropout_p, scale, schedule, False,
                                  visibility=visibility, configs=configs)
    else:
        # tools/carry_table_entries.py --whole-package runs this against older launchers, which
        # take the causal side positionally and the window (if at all) as a keyword.
        extra = {"window": window} if window is not None else {}
        launch.attention_forward(q, k, v, mask, None, 0.0, causal, 0, scale, schedule, configs=configs, **extra)
        launch.attention_backward(dout, q, k, v, mask, out, lse, None, None, 0.0, causal, 0, scale, schedule,
                                  False, configs=configs, **extra)
    # Older launchers' configs (tools/carry_table_entries.py) have no decode role.
    if decode and getattr(configs, "decode", None) is not None:
        _decode_launch(head_dim, mask_kind, dtype, schedule, seq, configs.decode, gen, window)


def _decode_launch(head_dim, mask_kind, dtype, schedule, seq, config, gen, window=None) -> None:
    """The split-KV decode kernels at their widest tile: 16 query rows of a group of 8 heads
    (128 packed rows, the config's row cap per program)."""
    from flash_inductor import launch
    from flash_inductor.launch.decode import DECODE_MAX_QUERY_ROWS, decode_attention_forward

    rows, group = DECODE_MAX_QUERY_ROWS, 8
    q = torch.randn((1, group, rows, head_dim), generator=gen, dtype=dtype)
    k, v = (torch.randn((1, 1, seq, head_dim), generator=gen, dtype=dtype) for _ in range(2))
    mask = None
    if mask_kind in ("bool", "window_bool"):
        mask = (torch.rand((1, 1, 1, seq), generator=gen) > 0.3).expand(1, group, rows, seq)
    elif mask_kind == "float":
        mask = torch.randn((1, group, rows, seq), generator=gen, dtype=dtype)
    causal, offset, scale = mask_kind == "causal", seq - rows, head_dim ** -0.5
    if hasattr(launch, "Visibility"):
        visibility = launch.Visibility(is_causal=causal, causal_offset=offset, window=window)
        decode_attention_forward(q, k, v, mask, scale, schedule, visibility=visibility, config=config, num_splits=2)
    else:  # older launchers (tools/carry_table_entries.py --whole-package), as in check()
        decode_attention_forward(q, k, v, mask, causal, offset, scale, schedule, config=config, num_splits=2,
                                 window=window)


def add_case_arguments(p: argparse.ArgumentParser, *, head_dims: str = "64,128,256",
                       masks: str = "none,causal,bool,float", schedules: str = "stable,fast,accurate") -> None:
    """The options that pick ``run_launches``'s cases: comma lists of head dims, mask kinds,
    dtypes and schedules."""
    p.add_argument("--head-dims", default=head_dims)
    p.add_argument("--masks", default=masks)
    p.add_argument("--dtypes", default="bf16,fp16")
    p.add_argument("--schedules", default=schedules)


def cases(p: argparse.ArgumentParser, args, why: str) -> list[tuple[int, str, str, str]]:
    """(head dim, mask kind, dtype, schedule) for every combination ``args`` names. The kernels must
    be real Triton functions, so TRITON_INTERPRET must be unset (``why`` says what needs them)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        p.error(f"unset TRITON_INTERPRET: {why}")
    unknown = sorted(set(args.dtypes.split(",")) - set(DTYPES))
    if unknown:
        p.error(f"--dtypes: {unknown} not among {sorted(DTYPES)}")
    return list(itertools.product([int(e) for e in args.head_dims.split(",")], args.masks.split(","),
                                  args.dtypes.split(","), args.schedules.split(",")))


def main(argv=None) -> int:
    from flash_inductor.tuning.footprint import OPTIN_SMEM_BYTES

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_case_arguments(p)
    args = p.parse_args(argv)
    combos = cases(p, args, "interpreted kernels are not compiled")
    limit = OPTIN_SMEM_BYTES[ARCH]
    over = []
    for i, (e, mask_kind, dtype_name, schedule) in enumerate(combos, 1):
        start = time.time()
        record = check(e, mask_kind, dtype_name, schedule)
        worst = max(record, key=lambda r: r[1])
        bad = [(name, shared) for name, shared in record if shared > limit]
        over += [(e, mask_kind, dtype_name, schedule, name, shared) for name, shared in bad]
        print(f"[{i}/{len(combos)}] E{e} {mask_kind:6s} {dtype_name} {schedule:9s} most: {worst[0]} "
              f"{worst[1] / 1024:.0f} KiB{'  OVER: ' + ', '.join(n for n, _ in bad) if bad else ''} "
              f"({time.time() - start:.0f} s)", flush=True)
    print(f"limit {limit / 1024:.0f} KiB (sm_{ARCH[0]}{ARCH[1]}): "
          + ("every launch fits" if not over else f"{len(over)} kernel launches do not fit: {over}"))
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
