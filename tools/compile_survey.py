"""First-call compile time of the Triton kernels our launchers start on Hopper, with each kernel's
registers, spills and shared memory, measured on any machine (no GPU).

    python -m tools.compile_survey --dtypes fp32 --head-dims 64,128 --masks none,causal
    python -m tools.compile_survey --dtypes bf16,fp16 --head-dims 40,80,96,160 --dropout 0,0.1 --workers 2
    python -m tools.compile_survey ... --backward-dkdv 16x64/w8/s1 --loops   # a candidate tile
    python -m tools.compile_survey ... --tiles-of 9.0,8.0 --out benchmarks/results   # against other GPUs' tiles
    python -m tools.compile_survey --dtypes bf16 --head-dims 64 --schedules fast --seq 4096 --mix   # loops' opcodes

A user's first call of a new variant waits for ptxas, which is single-threaded and slow on kernels
whose working set does not fit the registers: compiled for sm_90, the fp32 tiles other GPUs run
keep 32 registers a thread at E 128 and spill 6-19 KB, and their dK/dV pass takes 30-41 s to
compile (docs/performance.md, "fp32 tiles"). As ``tools/launch_sass.py --grid`` does, this runs the
launchers (``launch.attention_forward`` / ``attention_backward``, and the decode launcher) on CPU
tensors with the configs a Hopper launch would use, and compiles each launch for sm_90 (the real
argument specialisation and constexprs). Per distinct kernel it
reports the compile's wall time, and from the cubin (Triton's bundled ``cuobjdump
--dump-resource-usage``) the registers and stack bytes a thread (stack > 0 is spilling), plus
Triton's shared memory. A kernel two cases share is compiled, and counted, once.

``--mix``: at E = 64 the backward passes are bound by the work done per score (exp2 on the MUFU
pipe, fp32 adds and multiplies, conversions), not by the tensor cores (docs/performance.md), so the
count of those instructions in a pass's inner loop predicts what a kernel change costs before any
GPU time is spent: it found that a branch inside the dQ loop made the compiler evaluate both sides
(two exp2 per score). Each kernel is disassembled with Triton's bundled nvdisasm, and each loop (a
branch back to an earlier label) that issues matrix instructions is listed, longest first, with its
most frequent opcodes; each kernel's line says whether they are wgmma or mma.sync and how many
local loads and stores (register spills) it has. Counts are per thread per iteration: a BLOCK_M x
BLOCK_N tile over 32 * num_warps threads.

The Gluon Hopper kernels (bf16/fp16 at E 64/128) are not launched here: ``tools/launch_sass.py``
compiles those (and these). Times are this machine's (ptxas of the installed
Triton, one process a case); compare within a run. Without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import os
import re
import sys
import tempfile
import time

from tools.launch_sass import (DTYPE_NAMES, GRID_MASKS, add_grid_arguments, compiled_launches, cubin_tool, grid_cells,
                               heuristic, heuristic_configs, refuse_interpreter)

_RESOURCES = re.compile(r"Function\s+(\S+):\s*REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)")
_INSTRUCTION = re.compile(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?);")
_LABEL = re.compile(r"\s*\.(L_x_\d+):")
_BRANCH_TARGET = re.compile(r"\bBRA\b.*?\.?(L_x_\d+)")
ROLES = ("forward", "backward_dkdv", "backward_dq", "decode")
# The role of each main kernel, for the work its loop does an iteration (``hot_loop``).
KERNEL_ROLE = {"_attn_fwd": "forward", "_attn_bwd_dkdv": "backward_dkdv", "_attn_bwd_dq": "backward_dq",
               "_attn_decode_split": "decode"}


# Dots a main-loop iteration issues, per role: the forward (and the decode split) S = QKᵀ and P·V;
# the dK/dV pass Sᵀ, dPᵀ, dV += Pᵀ·dO and dK += dSᵀ·Q; the dQ pass S, dP and dQ += dS·K.
_DOTS_PER_ITERATION = {"forward": 2, "backward_dkdv": 4, "backward_dq": 3, "decode": 2}


@dataclasses.dataclass
class Compiled:
    """One kernel compiled for sm_90: its case, tile, wall time and resources a thread; with --loops,
    its hottest loop (the one with the most FFMA, or matrix instructions) per thread and iteration:
    its instructions, FFMA, shared loads, local loads and stores (spills), and ``ideal_ffma``, the
    FMAs its dots need a thread an iteration (dots x BLOCK_M x BLOCK_N x E / threads) when they run
    on the CUDA cores (fp32's IEEE products). ``instructions / ideal_ffma`` is then the issue cost
    a unit of work: the kernels are issue-bound there, so it ranks tiles before any GPU time."""

    case: str
    kernel: str
    tile: str
    seconds: float
    registers: int
    stack_bytes: int
    shared_bytes: int
    loop: dict | None = None
    mix: dict | None = None  # --mix: ``matrix_loops``

    def row(self, top: int = 14) -> str:
        spill = f"{self.stack_bytes} B stack" if self.stack_bytes else "no spill"
        text = (f"{self.case:34s} {self.kernel:24s} {self.tile:13s} {self.seconds:6.1f} s  "
                f"{self.registers:3d} regs  {spill:14s} {self.shared_bytes / 1024:5.0f} KiB")
        if self.loop:
            loop = self.loop
            per_fma = f", {loop['instructions'] / loop['ideal_ffma']:.2f} instr/FMA" if loop.get("ideal_ffma") else ""
            text += (f"  loop {loop['instructions']}: FFMA {loop['FFMA']}, LDS {loop['LDS']}, "
                     f"LDL+STL {loop['LDL'] + loop['STL']}{per_fma}")
        if self.mix:
            # mma.sync on sm_90 runs well below wgmma's rate; the E = 256 dK/dV pass (a 32-key block)
            # once compiled to it unnoticed while the count covered wgmma loops only.
            mix = self.mix
            text += (f"\n  {mix['instructions']} instructions, {len(mix['loops'])} MMA loops "
                     f"({mix['mma'] or 'no MMA'}), {mix['LDL']} LDL / {mix['STL']} STL")
            for loop in mix["loops"]:
                text += f"\n  loop of {loop['length']}: " + ", ".join(
                    f"{op} {n}" for op, n in list(loop["opcodes"].items())[:top])
        return text


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


def matrix_loops(cubin: bytes) -> dict:
    """--mix: the kernel's instruction count, ``mma_kind``, local loads and stores (register spills),
    and each loop that issues matrix instructions, longest first, with its opcode counts."""
    instructions, bodies = loops(disassemble(cubin))
    counts = opcode_counts(instructions)
    mma_bodies = sorted(((a, b) for a, b in bodies if mma_kind(instructions[a:b + 1])), key=lambda ab: ab[0] - ab[1])
    return dict(instructions=len(instructions), mma=mma_kind(instructions), LDL=counts["LDL"], STL=counts["STL"],
                loops=[dict(length=b - a + 1, opcodes=dict(opcode_counts(instructions[a:b + 1]).most_common()))
                       for a, b in mma_bodies])


def hot_loop(cubin: bytes, role: str | None, kwargs: dict, num_warps: int) -> dict | None:
    """The loop of the cubin with the most FFMA (else matrix instructions), counted as --mix counts;
    None if the kernel has no loop."""
    instructions, bodies = loops(disassemble(cubin))
    if not bodies:
        return None
    counted = [opcode_counts(instructions[a:b + 1]) for a, b in bodies]
    best = max(range(len(bodies)), key=lambda i: (counted[i]["FFMA"], counted[i]["HGMMA"] + counted[i]["HMMA"]))
    counts = counted[best]
    a, b = bodies[best]
    loop = dict(instructions=b - a + 1, **{op: counts[op] for op in ("FFMA", "LDS", "LDL", "STL", "HGMMA", "HMMA")})
    if role in _DOTS_PER_ITERATION and "BLOCK_M" in kwargs and "BLOCK_E" in kwargs:
        work = _DOTS_PER_ITERATION[role] * kwargs["BLOCK_M"] * kwargs["BLOCK_N"] * kwargs["BLOCK_E"]
        loop["ideal_ffma"] = work // (32 * num_warps)
    return loop


def resource_usage(cubin: bytes) -> tuple[int, int]:
    """(registers, stack bytes) a thread of the cubin's kernel, from the bundled cuobjdump."""
    text = cubin_tool("cuobjdump", ["--dump-resource-usage"], cubin)
    match = _RESOURCES.search(text)
    if match is None:
        raise RuntimeError(f"cuobjdump printed no resource line:\n{text}")
    return int(match.group(2)), int(match.group(3))


def tile_label(kwargs: dict, compiled) -> str:
    """BLOCK_M x BLOCK_N / warps / stages, as the tuning table's configs print (64x32/w4/s2)."""
    options = compiled.metadata
    return (f"{kwargs.get('BLOCK_M', '?')}x{kwargs.get('BLOCK_N', '?')}/w{options.num_warps}"
            f"/s{options.num_stages}")


def parse_tile(text: str):
    """``KernelConfig.from_label`` for argparse, whose usage error then carries its message."""
    from flash_inductor.tuning.kernel_config import KernelConfig

    try:
        return KernelConfig.from_label(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


@dataclasses.dataclass(frozen=True)
class Case:
    head_dim: int
    mask_kind: str
    dtype: str
    schedule: str
    dropout_p: float
    overrides: tuple = ()  # (role, KernelConfig) pairs replacing the heuristic's tiles
    tiles_of: tuple = (9, 0)  # the capability whose heuristic tiles are compiled (for sm_90 always)

    def label(self) -> str:
        drop = f" p{self.dropout_p:g}" if self.dropout_p else ""
        tiles = "" if self.tiles_of == (9, 0) else f" sm{self.tiles_of[0]}{self.tiles_of[1]}-tiles"
        return f"{self.dtype} E{self.head_dim} {self.mask_kind} {self.schedule}{drop}{tiles}"


def survey_case(case: Case, cache_dir: str, decode: bool, seq: int, with_loops: bool = False,
                with_mix: bool = False) -> list[Compiled]:
    """Compile every kernel one case's launches start; kernels already in ``cache_dir`` (compiled by an
    earlier case) are left out."""
    os.environ["TRITON_CACHE_DIR"] = cache_dir
    import torch

    dtype = getattr(torch, DTYPE_NAMES[case.dtype])
    kind, mask = GRID_MASKS[case.mask_kind]
    configs = heuristic_configs(dtype, case.head_dim, kind, case.schedule, mask, capability=case.tiles_of)
    if case.overrides:
        configs = dataclasses.replace(configs, **dict(case.overrides))
    rows: list[Compiled] = []
    for launch, compiled, seconds in compiled_launches(
            lambda: heuristic(dtype, case.head_dim, case.mask_kind, case.schedule, seq=seq, configs=configs,
                              dropout_p=case.dropout_p, decode_too=decode)):
        # A kernel found in the cache took well under a second and counts in the case that built it.
        try:  # created atomically: of two workers that compiled one kernel, one reports it
            os.close(os.open(os.path.join(cache_dir, f".surveyed_{compiled.hash}"), os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            continue
        name, kwargs = launch.kernel.fn.__name__, launch.kwargs
        registers, stack = resource_usage(compiled.asm["cubin"])
        loop = (hot_loop(compiled.asm["cubin"], KERNEL_ROLE.get(name), kwargs, compiled.metadata.num_warps)
                if with_loops else None)
        mix = matrix_loops(compiled.asm["cubin"]) if with_mix else None
        rows.append(Compiled(case.label(), name, tile_label(kwargs, compiled), round(seconds, 2), registers, stack,
                             compiled.metadata.shared, loop, mix))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_grid_arguments(p, head_dims="64,128", masks="none,causal", schedules="stable")
    p.add_argument("--dropout", default="0", help="comma list of dropout probabilities (0: none)")
    for role in ROLES:
        p.add_argument(f"--{role.replace('_', '-')}", type=parse_tile, default=None, metavar="TILE",
                       help=f"replace the heuristic's {role} tile, e.g. 64x32/w4/s2")
    p.add_argument("--tiles-of", default="9.0",
                   help="comma list of compute capabilities whose heuristic tiles are compiled (still for sm_90): "
                        "8.0 gives the tiles other GPUs run, e.g. those Hopper's replaced")
    p.add_argument("--no-decode", action="store_true", help="leave out the decode launcher's kernels")
    p.add_argument("--seq", type=int, default=300, help="L = S of the launches (not a multiple of any tile)")
    p.add_argument("--workers", type=int, default=1, help="cases compiled at once (ptxas is single-threaded)")
    p.add_argument("--loops", action="store_true", help="count each kernel's hottest loop (Compiled's docstring)")
    p.add_argument("--mix", action="store_true", help="list each kernel's matrix loops with their opcodes")
    p.add_argument("--top", type=int, default=14, help="opcodes shown per loop with --mix")
    p.add_argument("--out", default=None, help="a folder for compile_survey_cpu_<date>[_<tag>].json")
    p.add_argument("--tag", default=None)
    args = p.parse_args(argv)
    overrides = tuple((role, getattr(args, role)) for role in ROLES if getattr(args, role) is not None)
    try:
        dropouts = [float(x) for x in args.dropout.split(",")]
    except ValueError:
        p.error(f"--dropout: a comma list of probabilities, got {args.dropout!r}")
    if any(not 0 <= x < 1 for x in dropouts):
        p.error(f"--dropout: probabilities in [0, 1), got {args.dropout!r}")
    try:
        tiles_of = [tuple(int(part) for part in cap.split(".")) for cap in args.tiles_of.split(",")]
    except ValueError:
        tiles_of = []
    if not tiles_of or any(len(cap) != 2 for cap in tiles_of):
        p.error(f"--tiles-of: a comma list of capabilities like 9.0,8.0, got {args.tiles_of!r}")
    refuse_interpreter(p)
    todo = [Case(e, mask, dtype, schedule, drop, overrides, cap)
            for cap in tiles_of for e, mask, dtype, schedule in grid_cells(p, args) for drop in dropouts]

    from benchmarks.common import environment, module_command, progress, write_record

    rows: list[Compiled] = []
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="compile_survey_") as cache_dir:
        with concurrent.futures.ProcessPoolExecutor(max_workers=max(1, args.workers)) as pool:
            futures = [pool.submit(survey_case, case, cache_dir, not args.no_decode, args.seq, args.loops, args.mix)
                       for case in todo]
            for future in progress(concurrent.futures.as_completed(futures), "cases", total=len(futures)):
                for row in future.result():
                    rows.append(row)
                    print(row.row(args.top), flush=True)
    rows.sort(key=lambda r: -r.seconds)
    total = sum(r.seconds for r in rows)
    spilling = [r for r in rows if r.stack_bytes]
    print(f"{len(rows)} kernels over {len(todo)} cases in {time.time() - start:.0f} s wall: {total:.0f} s of "
          f"compiles, slowest {rows[0].seconds if rows else 0:.1f} s; {len(spilling)} spill")
    if args.out:
        env = environment(module_command("tools.compile_survey", argv))
        write_record(args.out, "compile_survey", env, dict(
            what="sm_90 compiles of the Triton kernels our launchers start (tools/compile_survey.py): wall "
                 "seconds, registers and stack bytes a thread (cuobjdump), shared bytes, slowest first",
            columns=[f.name for f in dataclasses.fields(Compiled)],
            rows=[dataclasses.astuple(r) for r in rows]), tag=args.tag, device="cpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
