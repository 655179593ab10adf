"""What flash_inductor.debug and attn_implementation="inductor_stable" cost: training-step times.

    python -m benchmarks.debug_overhead                       # GPU: every measurement, a few minutes
    python -m benchmarks.debug_overhead --quick --device cpu  # smoke run

Debug tools, on train_stability's GPT (hand-written attention, no qk offset so every step is
finite; bf16 autocast on CUDA): the median step (forward + backward) of

* ``eager``: the model alone;
* ``off``: the model alone after a shadow session was entered and left (the tools install nothing
  outside their ``with``: this should equal ``eager``);
* ``record_baseline``, ``compare_to_baseline``, ``shadow``: inside each tool's ``with`` block, after
  its first step (the dynamo capture, reported separately as ``first_step_s``);
* ``bisect_length``: the whole search on the ramp model of ``overflow_demo.py`` in fp16.

HF (``--hf``, default on CUDA): a Llama-style ``LlamaForCausalLM`` trained eagerly in bf16 with
``attn_implementation="sdpa"`` and ``"inductor_stable"``, both built side by side, heated, then
timed in alternating rounds; the ratio sdpa / ours (>= 1 means ours is at least as fast).
``--hf-profile N`` adds each contender's N costliest kernels over one step.

Writes ``debug_overhead_<device>_<date>.json`` to ``--out`` (default $OUT or /tmp/flash_inductor_out).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import pathlib
import re
import statistics
import sys
import time

import torch

from benchmarks import overflow_demo
from benchmarks import train_stability as ts


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _median_step(step, steps: int, device: str) -> tuple[float, float]:
    """(first step seconds, median of the next ``steps``)."""
    _sync(device)
    start = time.perf_counter()
    step()
    _sync(device)
    first = time.perf_counter() - start
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
    return first, statistics.median(times)


def debug_tools(args) -> dict:
    from flash_inductor import debug

    device, dtype = args.device, (torch.bfloat16 if args.device.startswith("cuda") else torch.float32)
    task = ts.Task(seq=args.seq, pairs=16, context=args.seq // 4)
    torch.manual_seed(0)
    model = ts.GPT(task.vocab, args.width, args.heads, args.layers, args.seq, 0.0).to(device)
    tokens, targets = task.batch(args.batch, 0, 0, device)
    query_mask = task.query_mask().to(device=device, dtype=torch.float32)

    def step():
        model.zero_grad(set_to_none=True)
        with torch.autocast(device.split(":")[0], dtype=dtype, enabled=dtype != torch.float32):
            loss, _ = model(tokens, targets, query_mask)
        loss.backward()

    results = {}
    _, results["eager_s"] = _median_step(step, args.steps, device)
    with debug.record_baseline(model) as recorder:
        results["record_baseline_first_step_s"], results["record_baseline_s"] = _median_step(step, args.steps, device)
    baseline = recorder.baseline()
    with debug.compare_to_baseline(model, baseline) as comparison:
        results["compare_first_step_s"], results["compare_to_baseline_s"] = _median_step(step, args.steps, device)
    results["compare_flags"] = len(comparison.report().flags)
    with debug.shadow(model) as check:
        results["shadow_first_step_s"], results["shadow_s"] = _median_step(step, args.steps, device)
    results["shadow_failures"] = len(check.report().failures)
    _, results["off_s"] = _median_step(step, args.steps, device)
    for tool in ("record_baseline", "compare_to_baseline", "shadow", "off"):
        results[f"{tool}_overhead"] = results[f"{tool}_s"] / results["eager_s"] - 1

    def ramp(length):
        model, inputs = overflow_demo.ramp_gpt(length)
        return model.to(device), tuple(t.to(device) for t in inputs)

    start = time.perf_counter()
    found = debug.bisect_length(ramp, "fp16", min_length=16, max_length=4 * overflow_demo.RAMP_LENGTH)
    results["bisect_s"] = time.perf_counter() - start
    results["bisect_critical_length"] = found.critical_length
    results["bisect_probes"] = len(found.probes)
    return results


def hf_llama(args) -> dict:
    """Both contenders built side by side, each heated for ``--hf-heat`` seconds, then timed in
    alternating rounds (the order flips every round), so that neither runs on a cooler card
    than the other (the H200 is power-capped: docs/performance.md)."""
    import transformers

    import flash_inductor.transformers  # noqa: F401  (registers the name)

    device = args.device
    config = transformers.LlamaConfig(
        hidden_size=args.hf_hidden, intermediate_size=4 * args.hf_hidden, num_hidden_layers=args.hf_layers,
        num_attention_heads=args.hf_hidden // 128, num_key_value_heads=max(1, args.hf_hidden // 512),
        vocab_size=32000, max_position_embeddings=args.hf_seq, attention_dropout=0.0)
    tokens = torch.randint(0, 32000, (args.hf_batch, args.hf_seq), device=device)
    impls = ("sdpa", flash_inductor.transformers.NAME)
    steps = {}
    for impl in impls:
        torch.manual_seed(0)
        # A config of its own: HF records the implementation on the config object, and the models
        # read it at every forward, so a shared config would run the last one built in both.
        model = transformers.LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation=impl,
                                                           torch_dtype=torch.bfloat16).to(device).train()

        def step(model=model):
            model.zero_grad(set_to_none=True)
            model(input_ids=tokens, labels=tokens).loss.backward()

        steps[impl] = step
    for impl, step in steps.items():
        if step.__defaults__[0].config._attn_implementation != impl:
            raise RuntimeError(f"the {impl!r} model runs {step.__defaults__[0].config._attn_implementation!r}")
    results = {}
    for impl in impls:
        results[f"{impl}_first_s"], _ = _median_step(steps[impl], 1, device)
        end = time.perf_counter() + args.hf_heat
        while time.perf_counter() < end:
            steps[impl]()
        _sync(device)
    times = {impl: [] for impl in impls}
    for round_ in range(args.steps):
        for impl in (impls if round_ % 2 == 0 else impls[::-1]):
            start = time.perf_counter()
            steps[impl]()
            _sync(device)
            times[impl].append(time.perf_counter() - start)
    for impl in impls:
        results[f"{impl}_s"] = statistics.median(times[impl])
    results["sdpa_over_flash_inductor"] = results["sdpa_s"] / results[f"{flash_inductor.transformers.NAME}_s"]
    if args.hf_profile and device.startswith("cuda"):
        results["profile"] = {impl: _kernel_table(steps[impl], args.hf_profile) for impl in impls}
    results["config"] = dict(hidden=args.hf_hidden, layers=args.hf_layers, seq=args.hf_seq, batch=args.hf_batch,
                             heat_s=args.hf_heat, rounds=args.steps)
    return results


def _kernel_table(step, rows: int) -> list:
    """The ``rows`` CUDA kernels (and ops) of one step with the most device time: name, calls, ms."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0 and not e.cpu_children]
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    return [dict(name=e.key[:120], calls=e.count, ms=round(e.device_time_total / 1e3, 3)) for e in events[:rows]]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hf", action=argparse.BooleanOptionalAction, default=None, help="HF Llama sdpa vs ours")
    p.add_argument("--debug", action=argparse.BooleanOptionalAction, default=True,
                   help="the debug tools' overheads (--no-debug: the HF Llama comparison alone)")
    p.add_argument("--hf-hidden", type=int, default=2048)
    p.add_argument("--hf-layers", type=int, default=8)
    p.add_argument("--hf-seq", type=int, default=4096)
    p.add_argument("--hf-batch", type=int, default=2)
    p.add_argument("--hf-heat", type=float, default=3.0, help="seconds of steps before the HF contenders are timed")
    p.add_argument("--hf-profile", type=int, default=0, help="also list each HF contender's N costliest kernels")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/flash_inductor_out"))
    args = p.parse_args(argv)
    if args.quick:
        args.seq, args.batch, args.width, args.steps = 128, 2, 32, 2
        args.hf_hidden, args.hf_layers, args.hf_seq, args.hf_batch, args.hf_heat = 256, 2, 128, 1, 0.0
    if args.hf is None:
        args.hf = args.device.startswith("cuda")
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    payload = dict(device=name, torch=torch.__version__, date=datetime.datetime.now().astimezone().isoformat(
        timespec="seconds"), config={k: v for k, v in vars(args).items()})
    if args.debug:
        payload["debug"] = debug_tools(args)
        print(json.dumps(payload["debug"], indent=1))
    if args.hf:
        payload["hf_llama"] = hf_llama(args)
        print(json.dumps(payload["hf_llama"], indent=1))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    path = out / f"debug_overhead_{slug}_{datetime.date.today():%Y%m%d}.json"
    path.write_text(json.dumps(payload, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
