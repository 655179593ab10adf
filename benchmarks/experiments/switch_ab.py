"""EXPERIMENT: one module switch of the launch path, off against on, in one process.

    python -m benchmarks.experiments.switch_ab --switch launch.hopper_bwd.ONE_PASS_STABLE \
        --dtype bf16 --head-dim 128 --causal --seq 4096 --out $OUT

Times ``flash_attention``'s forward and backward (``--mode infer``: its forward under no_grad)
back to back (the wall time of a loop, so host time counts, as in bench_attention's cells) with the switch at False and at True, in
interleaved rounds after heating, and compares the two settings' gradients (dK and dV bit for
bit; dQ, whose TMA reduce-adds run in a varying order, by its largest difference). The
switch is a module attribute under ``flash_inductor`` (e.g. ``launch.hopper_bwd.ONE_PASS_STABLE``);
it is set for the duration of each round only. Writes ``switch_ab.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import time

import torch

import flash_inductor
from benchmarks.common import heat

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _owner(path: str):
    module_path, _, attr = path.rpartition(".")
    return importlib.import_module(f"flash_inductor.{module_path}"), attr


def _step(q, k, v, do, causal, mode="fwd_bwd"):
    if mode == "infer":
        with torch.no_grad():
            return (flash_inductor.flash_attention(q, k, v, is_causal=causal), )
    out = flash_inductor.flash_attention(q, k, v, is_causal=causal)
    return torch.autograd.grad(out, (q, k, v), do)


def _round_ms(fn, calls: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / calls


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--switch", required=True, help="module attribute under flash_inductor, e.g. launch.hopper_bwd.X")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp16")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=16384, help="batch x seq")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--mode", choices=("fwd_bwd", "infer"), default="fwd_bwd",
                   help="what a step is: forward and backward, or a forward under no_grad (inference)")
    p.add_argument("--calls", type=int, default=30, help="steps per timed round")
    p.add_argument("--rounds", type=int, default=8, help="timed rounds per setting, interleaved")
    p.add_argument("--heat", type=float, default=1.0, help="seconds of heating first")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    owner, attr = _owner(args.switch)
    original = getattr(owner, attr)
    batch, heads = max(1, args.tokens // args.seq), 2048 // args.head_dim
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(batch, heads, args.seq, args.head_dim, device="cuda", dtype=DTYPES[args.dtype],
                               generator=gen) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    step = lambda: _step(q, k, v, do, args.causal, args.mode)  # noqa: E731
    grads, times = {}, {False: [], True: []}
    try:
        for setting in (False, True):
            setattr(owner, attr, setting)
            grads[setting] = [g.clone() for g in step()]
        # fwd_bwd: (dq, dk, dv); infer: (out,), compared as dk and dv are
        first, rest = (0, 1) if args.mode == "fwd_bwd" else (None, 0)
        same_dkdv = all(torch.equal(a, b) for a, b in zip(grads[False][rest:], grads[True][rest:]))
        dq_diff = 0.0 if first is None else (grads[False][0].float() - grads[True][0].float()).abs().max().item()
        heat(step, args.heat * 1e3)
        for _ in range(args.rounds):
            for setting in (False, True):
                setattr(owner, attr, setting)
                times[setting].append(_round_ms(step, args.calls))
    finally:
        setattr(owner, attr, original)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    record = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
                  switch=args.switch, mode=args.mode, cell=dict(dtype=args.dtype, head_dim=args.head_dim, seq=args.seq, batch=batch,
                                                heads=heads, causal=args.causal),
                  ms_off=off, ms_on=on, off_over_on=off / on, rounds_ms=times, same_dk_dv=same_dkdv, dq_max_abs_diff=dq_diff)
    what = "dK, dV" if args.mode == "fwd_bwd" else "out"
    print(f"{args.switch}: off {off:.3f} ms, on {on:.3f} ms a {args.mode} step, off/on {off / on:.3f}; "
          f"{what} {'bitwise the same' if same_dkdv else 'DIFFER'}, dQ max |diff| {dq_diff:.3g}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "switch_ab.json"), "w") as f:
        json.dump({**record, "rounds_ms": {str(k): v for k, v in times.items()}}, f, indent=1)
    return record


if __name__ == "__main__":
    main()
