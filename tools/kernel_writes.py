"""Which tensors torch.compile believes each of our kernels writes, checked on any machine.

    python -m tools.kernel_writes                      # E 64, every mask kind, bf16/fp16, stable/fast
    python -m tools.kernel_writes --head-dims 128 --masks float --schedules stable

Under ``torch.compile`` a user-defined Triton kernel (``wrap_triton``) is functionalised: torch reads
the kernel's TTIR to find which pointer arguments it stores through, and clones those tensors
before the call. When that analysis cannot follow the kernel, it assumes *every* tensor argument is
written. A kernel that then appears to write its inputs breaks training graphs: AOT autograd copies
the "mutated" query back into a leaf that requires grad, and the compile fails (this happened once:
a helper that returned both row offsets and the tiles it loaded made the offsets look derived from
the Q and dO pointers, so every store through them counted as a write to Q and dO).

This tool runs the launchers as tools/smem_check.py does (CPU tensors, an sm_90 stand-in driver, no
GPU) but hands each launch to torch's analysis instead of compiling it, and prints the tensors it
reports written. It exits 1 if a kernel appears to write a tensor outside its outputs
(``OUTPUTS``: an input, as in the failure above), or nothing at all.
Without TRITON_INTERPRET: interpreted kernels have no TTIR.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch

from tools.smem_check import HopperStandIn, add_case_arguments, cases, run_launches

# The parameters each kernel stores through; every other tensor argument is an input. (OUT is the
# forward's output but the preprocess's input.) A schedule may leave some unwritten (DELTA in the dQ
# pass is written only under exact Δ, DMASK only for a mask gradient).
OUTPUTS = {
    "_attn_fwd": {"OUT", "LSE"},
    "_attn_bwd_preprocess": {"DELTA", "DS_STATS"},
    "_attn_bwd_row_reference": {"ROW_REF", "ROW_SHIFT", "SHIFT_FLAG"},
    "_attn_bwd_dq": {"DQ", "DELTA", "DMASK"},
    "_attn_bwd_dkdv": {"DK", "DV", "DMASK"},
    "_attn_decode_split": {"O_PART", "LSE_PART", "OUT", "LSE"},
    "_attn_decode_merge": {"OUT", "LSE"},
    "_quantize_fp8": {"X8", "DEQUANT", "COLUMN_AMAX"},
    "_attn_fwd_fp8": {"OUT", "LSE"},
}


def written_tensors(kernel, named: dict) -> set[str]:
    """The tensor arguments torch's analysis of ``kernel``'s TTIR reports written, as AOT autograd
    sees them when the kernel runs under torch.compile. Newer torch calls it
    ``identify_accessed_tensors`` (reads and writes), torch 2.11 ``identify_mutated_tensors``
    (writes alone); both count every tensor as written when the analysis itself fails."""
    from torch._higher_order_ops import triton_kernel_wrap

    if hasattr(triton_kernel_wrap, "identify_accessed_tensors"):
        accessed = triton_kernel_wrap.identify_accessed_tensors(kernel, named, {})
        names = {dep.name for dep in accessed.read_writes.writes}
    else:
        names = set(triton_kernel_wrap.identify_mutated_tensors(kernel, named, {}))
    return {name for name in names if isinstance(named.get(name), torch.Tensor)}


@contextlib.contextmanager
def analysed_launches(writes: dict[str, set[str]]):
    """Within the block, every ``launch.common.launcher(kernel)[grid](...)`` runs torch's mutation
    analysis (:func:`written_tensors`) instead of launching, and records the tensors it reports
    written in ``writes[kernel name]`` (the union over the block's launches)."""
    from triton.runtime import driver

    from flash_inductor.launch import common

    class _Analyse:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def analyse(*args, **kwargs):
                named = dict(zip(self.kernel.arg_names, args), **kwargs)
                writes.setdefault(self.kernel.fn.__name__, set()).update(written_tensors(self.kernel, named))
            return analyse

    saved_launcher = common.launcher
    saved_driver = getattr(driver, "_active", None)  # see tools/smem_check.compiling_launches
    driver.set_active(HopperStandIn())
    common.launcher = _Analyse
    try:
        yield
    finally:
        common.launcher = saved_launcher
        driver._active = saved_driver


def kernel_writes(head_dim: int, mask_kind: str, dtype_name: str, schedule: str, seq: int = 256) -> dict[str, set[str]]:
    """{kernel name: tensors torch reports it writes} for the launches of tools/smem_check.run_launches."""
    writes: dict[str, set[str]] = {}
    with analysed_launches(writes):
        run_launches(head_dim, mask_kind, dtype_name, schedule, seq)
    return writes


def problems(writes: dict[str, set[str]]) -> list[str]:
    """What is wrong with a ``kernel_writes`` result: a kernel that writes past its outputs, or
    nothing, or that ``OUTPUTS`` does not know."""
    found = []
    for name, written in sorted(writes.items()):
        if name not in OUTPUTS:
            found.append(f"{name} is not in tools/kernel_writes.OUTPUTS; add its output parameters")
        elif written - OUTPUTS[name]:
            found.append(f"{name} appears to write its inputs {sorted(written - OUTPUTS[name])}")
        if not written:
            found.append(f"{name} appears to write nothing")
    return found


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_case_arguments(p, head_dims="64", masks="none,causal,bool,float,window", schedules="stable,fast")
    args = p.parse_args(argv)
    failed = []
    for head_dim, mask, dtype, schedule in cases(p, args, "interpreted kernels have no TTIR"):
        writes = kernel_writes(head_dim, mask, dtype, schedule)
        print(f"E{head_dim} {mask:<6} {dtype} {schedule:<6} "
              + "  ".join(f"{name}: {','.join(sorted(w))}" for name, w in sorted(writes.items())))
        failed += [f"E{head_dim} {mask} {dtype} {schedule}: {msg}" for msg in problems(writes)]
    for line in failed:
        print("PROBLEM", line)
    print(f"{len(failed)} problem(s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
