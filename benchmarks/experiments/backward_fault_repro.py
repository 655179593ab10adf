"""EXPERIMENT: which backward launch faults, and under which configs?

    CUDA_LAUNCH_BLOCKING=1 python -m benchmarks.experiments.backward_fault_repro --out DIR   # GPU
    TRITON_INTERPRET=1 python -m benchmarks.experiments.backward_fault_repro --device cpu --quick

Written when three backward patches (``dq_row_scale``, ``even_tiles``, ``dq_seen_sum_mma``),
re-tuned, and ran tests/unit/test_kernels.py on the H200: 214 passed, and
``test_shapes[fp16-L7_S1_E64]`` (B=2, H=2, L=7, S=1, E=64, no mask, `stable`) hit "an illegal
memory access" in one of the launches before the dK/dV pass, alone as well as under xdist; the
bf16 and fp32 versions of the case passed, and so did fp16 L=129, S=129, E=64, whose launches
compile to the same kernels (same table bucket, same constexprs). The new table gives that fp16
bucket dQ 64x64/w4/s3 and dK/dV 64x64/w4/s4 (bf16: the same dQ, dK/dV s3); main's had dQ
64x128/w4/s2 and dK/dV 32x64/w4/s3. The interpreter, with every active load and store address
checked against the launch's tensors, found no out-of-bounds access in these shapes and configs.

Outcome (2026-12-01, ``benchmarks/results/backward_fault_nvidia-h200_20261201_s17.md``): the
fault is in ``_attn_bwd_dq``, at σ̃'s row sum on the matrix unit, when S == 1 is specialised into
the kernel; main sums σ̃ by fp32 adds. The other two patches landed; all three are in git history
(813b459).

This script runs each case (shape x dtype x schedule x forced configs) forward and backward
with a synchronisation after every launch, so a fault is charged to the launch that made it; a
fault poisons the CUDA context, so each case runs in a child process, and cases go on in a new
one. It prints one line a case and writes them as JSON. Run it once per patch stage (main, and
after each patch, in order) to find the change and the config that fault; then
``compute-sanitizer`` on the first faulting case gives the kernel and the instruction.
Each stage is the tree the script is run from (``cd <tree> && python -m ...``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import traceback

# (L, S, E): the faulting shape, its neighbours (a zero-trip first key loop: S < BLOCK_N; a
# single partial query block: L < BLOCK_M), and the passing L=S=129 control.
SHAPES = [(7, 1, 64), (7, 3, 64), (1, 1, 64), (64, 1, 64), (7, 64, 64), (129, 129, 64), (7, 1, 128)]
QUICK_SHAPES = [(7, 1, 64), (129, 129, 64)]
# (dQ, dK/dV) as block_m, block_n, num_warps, num_stages: the new table's fp16 pick, the bf16
# pick, main's fp16 pick, and the new dQ pick with dK/dV at fewer stages.
CONFIG_PAIRS = [
    ((64, 64, 4, 3), (64, 64, 4, 4)),
    ((64, 64, 4, 3), (64, 64, 4, 3)),
    ((64, 128, 4, 2), (32, 64, 4, 3)),
    ((64, 64, 4, 3), (32, 64, 4, 3)),
    ((64, 128, 4, 2), (64, 64, 4, 4)),
]
QUICK_CONFIG_PAIRS = [((16, 16, 1, 1), (16, 16, 1, 1))]


def _parse_config(text: str) -> tuple[int, ...]:
    """'64x64/w4/s3' -> (64, 64, 4, 3)."""
    blocks, warps, stages = text.split("/")
    block_m, block_n = blocks.split("x")
    return int(block_m), int(block_n), int(warps.lstrip("w")), int(stages.lstrip("s"))


def _cases(args):
    shapes = QUICK_SHAPES if args.quick else SHAPES
    if args.shapes:
        shapes = [tuple(int(x) for x in shape.split("x")) for shape in args.shapes.split(",")]
    pairs = QUICK_CONFIG_PAIRS if args.quick else CONFIG_PAIRS
    if args.configs:
        pairs = [tuple(_parse_config(c) for c in pair.split("+")) for pair in args.configs.split(",")]
    kinds = [tuple(kind.split(":")) for kind in args.kinds.split(",")]
    cases = []
    for dq, dkdv in pairs:
        for seq_q, seq_k, head_dim in shapes:
            for dtype, schedule in kinds:
                cases.append(dict(seq_q=seq_q, seq_k=seq_k, head_dim=head_dim, dtype=dtype, schedule=schedule,
                                  dq=list(dq), dkdv=list(dkdv)))
    return cases


def _run_case(case: dict, device: str) -> dict:
    """One case; returns {"ok": bool, "where": the launch that raised, "error": text}."""
    import torch

    from flash_inductor import launch
    from flash_inductor.tuning.configs import AttentionConfigs, KernelConfig

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[case["dtype"]]
    gen = torch.Generator().manual_seed(0)
    batch = heads = 2

    def randn(*shape):
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).to(device)

    q = randn(batch, heads, case["seq_q"], case["head_dim"])
    k = randn(batch, heads, case["seq_k"], case["head_dim"])
    v = randn(batch, heads, case["seq_k"], case["head_dim"])
    dout = randn(batch, heads, case["seq_q"], case["head_dim"])
    forward_config = KernelConfig(16, 16, 1, 1) if device == "cpu" else None
    configs = AttentionConfigs(
        forward=forward_config or launch.common.launch_configs(q, k, v, None, False, case["schedule"], None).forward,
        backward_dkdv=KernelConfig(*case["dkdv"]), backward_dq=KernelConfig(*case["dq"]))
    common = (None, 0.0, case["head_dim"] ** -0.5, case["schedule"])
    try:
        out, lse = launch.attention_forward(q, k, v, None, *common, configs=configs)
        if device == "cuda":
            torch.cuda.synchronize()
        dq, dk, dv, _ = launch.attention_backward(dout, q, k, v, None, out, lse, None, *common, False,
                                                  configs=configs)
        if device == "cuda":
            torch.cuda.synchronize()
        finite = all(bool(torch.isfinite(t).all()) for t in (dq, dk, dv))
        return {"ok": finite, "where": None, "error": None if finite else "non-finite gradient"}
    except Exception as error:  # a fault surfaces as RuntimeError / torch.AcceleratorError
        frames = [f for f in traceback.extract_tb(error.__traceback__) if "flash_inductor" in f.filename]
        where = f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno} {frames[-1].line}" if frames else None
        return {"ok": False, "where": where, "error": str(error).splitlines()[0][:200]}


def _child(cases, start, device, queue):
    for index in range(start, len(cases)):
        result = _run_case(cases[index], device)
        queue.put((index, result))
        if not result["ok"] and result["where"] is not None:
            return  # the context may be poisoned: let the parent start a fresh process


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="two shapes, one small config (CPU check)")
    parser.add_argument("--shapes", default=None, help="LxSxE,... (default: the SHAPES list)")
    parser.add_argument("--configs", default=None,
                        help="dQ+dKdV pairs, e.g. 64x64/w4/s3+64x64/w4/s4,... (default: CONFIG_PAIRS)")
    parser.add_argument("--kinds", default="fp16:stable,bf16:stable,fp16:accurate,fp16:fast", help="dtype:schedule,...")
    parser.add_argument("--out", default=None, help="folder for the JSON record")
    parser.add_argument("--tag", default="")
    args = parser.parse_args(argv)

    cases = _cases(args)
    results: dict[int, dict] = {}
    context = mp.get_context("spawn")
    start = 0
    while start < len(cases):
        queue = context.Queue()
        child = context.Process(target=_child, args=(cases, start, args.device, queue))
        child.start()
        last = start - 1
        while child.is_alive() or not queue.empty():
            try:
                index, result = queue.get(timeout=1.0)
            except Exception:
                continue
            results[index] = result
            last = index
            case = cases[index]
            print(f"{'ok   ' if result['ok'] else 'FAULT'} L{case['seq_q']} S{case['seq_k']} E{case['head_dim']} "
                  f"{case['dtype']} {case['schedule']:8s} dq {case['dq']} dkdv {case['dkdv']}"
                  + ("" if result["ok"] else f"  at {result['where']}: {result['error']}"), flush=True)
        child.join()
        if last < start:  # the child died without a word (a crash outside Python)
            results[start] = {"ok": False, "where": "child process", "error": f"exit code {child.exitcode}"}
            print(f"FAULT case {start}: child exit code {child.exitcode}", flush=True)
            last = start
        start = last + 1

    faults = sum(not r["ok"] for r in results.values())
    print(f"{len(results)} cases, {faults} faults or non-finite")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"backward_fault_repro{('_' + args.tag) if args.tag else ''}.json")
        with open(path, "w") as handle:
            json.dump([{**cases[i], **results[i]} for i in sorted(results)], handle, indent=1)
    return 1 if faults else 0


if __name__ == "__main__":
    sys.exit(main())
