"""The instruction mix of the attention kernels' loops, compiled for sm_90 on any machine.

    python -m tools.sass_mix                                   # bf16, E=64, L=4096, `fast`, heuristic configs
    python -m tools.sass_mix --schedule stable --head-dim 128 --dkdv 64,64,4,2 --dq 64,64,4,2

At E = 64 the backward passes are bound by the work done per score (exp2 on the MUFU pipe, fp32
adds and multiplies, conversions), not by the tensor cores (docs/performance.md), so
the count of those instructions in a pass's inner loop predicts what a kernel change costs before
any GPU time is spent: it found that a branch inside the dQ loop made the compiler evaluate both
sides (two exp2 per score). Each launch our launchers would start (tools/launch_sass.py's
``heuristic``) is compiled, disassembled with Triton's bundled nvdisasm, and each loop (a branch back to an earlier
label) that issues matrix instructions is listed, longest first, with its most frequent opcodes;
each kernel's line says whether they are wgmma or mma.sync and how many local loads and stores
(register spills) it has.
Counts are per thread per iteration: a BLOCK_M x BLOCK_N tile over 32 * num_warps threads.
Without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import re
import sys

from tools.launch_sass import (DTYPE_NAMES, compiled_launches, cubin_tool, heuristic, heuristic_configs,
                               refuse_interpreter)

_INSTRUCTION = re.compile(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?);")
_LABEL = re.compile(r"\s*\.(L_x_\d+):")
_BRANCH_TARGET = re.compile(r"\bBRA\b.*?\.?(L_x_\d+)")


def disassemble(cubin: bytes) -> str:
    return cubin_tool("nvdisasm", ["-c"], cubin)


def loops(sass: str) -> tuple[list[str], list[tuple[int, int]]]:
    """(instructions, [(first, last) index of each loop body]) of a disassembly."""
    label_at, instructions = {}, []
    for line in sass.splitlines():
        label = _LABEL.match(line)
        if label:
            label_at[label.group(1)] = len(instructions)
            continue
        instruction = _INSTRUCTION.match(line)
        if instruction:
            instructions.append(instruction.group(1))
    bodies = []
    for i, instruction in enumerate(instructions):
        target = _BRANCH_TARGET.search(instruction)
        if target and label_at.get(target.group(1), i + 1) <= i:
            bodies.append((label_at[target.group(1)], i))
    return instructions, bodies


def mma_kind(instructions: list[str]) -> str:
    """Which matrix instructions a stretch of SASS issues: "wgmma" (HGMMA, Hopper's warpgroup MMA),
    "mma.sync" (HMMA: a dot whose M side is under wgmma's 64 rows, or a pre-Hopper target), both,
    or "" for none."""
    kinds = [name for name, op in (("wgmma", "HGMMA"), ("mma.sync", "HMMA")) if any(op in s for s in instructions)]
    return "+".join(kinds)


def opcode_counts(instructions: list[str]) -> collections.Counter:
    counts = collections.Counter()
    for instruction in instructions:
        instruction = re.sub(r"^@!?U?P\w+\s+", "", instruction)  # predicate guard
        counts[instruction.split()[0].split(".")[0]] += 1
    return counts


def _config(text):
    from flash_inductor.tuning.configs import KernelConfig

    return None if text is None else KernelConfig(*(int(x) for x in text.split(",")))


def main(argv=None) -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--seq", type=int, default=4096, help="a multiple of the tiles, or not (masked edges)")
    p.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default="bf16")
    p.add_argument("--schedule", default="fast")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--forward", help="BLOCK_M,BLOCK_N,warps,stages (default: Hopper's heuristic)")
    p.add_argument("--dkdv", help="the dK/dV pass's config, as --forward")
    p.add_argument("--dq", help="the dQ pass's config, as --forward")
    p.add_argument("--top", type=int, default=14, help="opcodes shown per loop")
    args = p.parse_args(argv)
    refuse_interpreter(p)
    dtype, mask_kind = getattr(torch, DTYPE_NAMES[args.dtype]), "causal" if args.causal else "none"
    configs = heuristic_configs(dtype, args.head_dim, mask_kind, args.schedule)
    configs = dataclasses.replace(configs, forward=_config(args.forward) or configs.forward,
                                  backward_dkdv=_config(args.dkdv) or configs.backward_dkdv,
                                  backward_dq=_config(args.dq) or configs.backward_dq)
    print(f"{args.dtype} E={args.head_dim} L={args.seq} {args.schedule}{' causal' if args.causal else ''}: "
          f"forward {configs.forward.label()}, dK/dV {configs.backward_dkdv.label()}, dQ {configs.backward_dq.label()}")
    compiled_by_name = {launch.kernel.fn.__name__: compiled for launch, compiled, _ in compiled_launches(
        lambda: heuristic(dtype, args.head_dim, mask_kind, args.schedule, seq=args.seq, configs=configs,
                          decode_too=False))}
    for name, compiled in compiled_by_name.items():
        instructions, bodies = loops(disassemble(compiled.asm["cubin"]))
        mma_bodies = [(a, b) for a, b in bodies if mma_kind(instructions[a:b + 1])]
        counts = opcode_counts(instructions)
        # mma.sync on sm_90 runs well below wgmma's rate; the E = 256 dK/dV pass (a 32-key block)
        # once compiled to it unnoticed while this line counted wgmma loops only.
        # LDL/STL are register spills.
        print(f"{name}: {len(instructions)} instructions, {compiled.metadata.shared} bytes shared, "
              f"{len(mma_bodies)} MMA loops ({mma_kind(instructions) or 'no MMA'}), "
              f"{counts['LDL']} LDL / {counts['STL']} STL")
        for a, b in sorted(mma_bodies, key=lambda body: body[0] - body[1]):
            counts = opcode_counts(instructions[a:b + 1])
            print(f"  loop of {b - a + 1}: " + ", ".join(f"{op} {n}" for op, n in counts.most_common(args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
