"""EXPERIMENT: how much host time does one eager attention call cost?

    python -m benchmarks.experiments.host_overhead --out DIR            # GPU
    TRITON_INTERPRET=1 python -m benchmarks.experiments.host_overhead --quick --device cpu

Why: on the H200, ``bench_attention.py --kernel-time`` found our 1k causal cells with the GPU
busy only 65-80 % of a back-to-back loop (FA2: 100 %), so there the GPU waits for Python. This
script measures the host side alone. It first queues a long ``torch.cuda._sleep`` so the GPU is
busy for the whole timed loop; every launch then returns at once and the wall time of the loop
is pure host time (Python, argument checks, allocations, launch calls). The launch queue is
finite (~1000 entries): once it is full a launch waits for the GPU, and the loop then measures
the sleep. A first version hit that (60 fp16 `stable` training steps, ~18 launches each,
read 3.75 ms a step: the 200 ms sleep over 60 calls), so the training-step loop is shorter, and
a sample whose sleep had ended before the loop did is reported as invalid rather than timed.
Then ``cProfile`` lists where ours spends it.

Providers: ours = ``flash_attention`` eager (what ``bench_attention.py`` times), ours_compiled =
an SDPA call compiled with ``flash_inductor.backend`` (the product's path: Inductor's wrapper
launches our kernels), flash = SDPA's flash backend. Ways, per provider:
* ``fwd``: inference (no tensor requires grad);
* ``fwd_grad``: forward on tensors that require grad (what a training step's forward pays);
* ``fwd_bwd``: forward and ``backward`` (one training step's attention).
Writes ``host_overhead.json`` and ``host_overhead_profile.txt`` to ``--out``. ``--breakdown`` times
instead, the same way, the pieces of ours' `stable` training step one by one (a backward alone,
its launcher, the forward's launcher, the centring, one TMA descriptor, one allocation, and the
steps of Triton's launch of the Gluon backward and the preprocess: binder, cache key, launch
metadata, descriptor encoding, C launcher), into ``host_breakdown.json``.
It measures the ``flash_inductor`` of the tree it is run from: for an A/B, run it from the root
of each tree in turn.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import time

import torch
import torch.nn.functional as F

import flash_inductor
from flash_inductor import flash_attention

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _providers(device):
    def ours(q, k, v, causal):
        return flash_attention(q, k, v, is_causal=causal)

    def flash(q, k, v, causal):
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def sdpa(q, k, v, causal):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    # Static shapes, as a model compiled for one shape; `causal` is a Python bool, so each value
    # gets its own graph.
    ours_compiled = torch.compile(sdpa, backend=flash_inductor.backend, dynamic=False)
    if not device.startswith("cuda"):
        return {"ours": ours, "ours_compiled": ours_compiled}
    return {"ours": ours, "ours_compiled": ours_compiled, "flash": flash}


def _keep_gpu_busy(device, ms):
    """Queue ``ms`` of GPU sleep so the host never waits on the GPU while timed."""
    if device.startswith("cuda"):
        torch.cuda._sleep(int(ms * 2e6))  # ~2 GHz: cycles per ms


def _sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _step(fn, way, q, k, v, dout, causal):
    if way == "fwd":
        with torch.no_grad():
            fn(q, k, v, causal)
    elif way == "fwd_grad":
        fn(q, k, v, causal)
    else:
        fn(q, k, v, causal).backward(dout)


def host_us_per_call(fn, way, tensors, causal, calls, device):
    """Host microseconds per call, or None when the GPU caught up with the host during the loop
    (the launch queue filled, or the loop outlasted the sleep): then it timed the GPU."""
    q, k, v, dout = tensors
    _sync(device)
    _keep_gpu_busy(device, 200)
    slept = torch.cuda.Event() if device.startswith("cuda") else None
    if slept is not None:
        slept.record()
    start = time.perf_counter()
    for _ in range(calls):
        _step(fn, way, q, k, v, dout, causal)
    elapsed = time.perf_counter() - start
    caught_up = slept is not None and slept.query()
    _sync(device)
    return None if caught_up else elapsed / calls * 1e6


def _host_us(fn, calls, device):
    """Host microseconds per call of ``fn`` with the GPU kept busy (None: the GPU caught up)."""
    _sync(device)
    _keep_gpu_busy(device, 100)
    slept = torch.cuda.Event()
    slept.record()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    caught_up = slept.query()
    _sync(device)
    return None if caught_up else elapsed / calls * 1e6


def _backward_alone_us(forward, dout, calls, device, inputs=(), how="backward"):
    """Host time of a backward alone: the ``forward()``s run first, untimed. ``how``: "backward"
    (``out.backward``, gradients accumulated into ``.grad``), "backward-fresh" (``.grad`` set to
    None first, as do_bench's grad_to_none does) or "grad" (``torch.autograd.grad``)."""
    outs = [forward() for _ in range(calls)]
    _sync(device)
    _keep_gpu_busy(device, 100)
    slept = torch.cuda.Event()
    slept.record()
    start = time.perf_counter()
    for out in outs:
        if how == "grad":
            torch.autograd.grad(out, inputs, dout)
            continue
        if how == "backward-fresh":
            for t in inputs:
                t.grad = None
        out.backward(dout)
    elapsed = time.perf_counter() - start
    caught_up = slept.query()
    _sync(device)
    return None if caught_up else elapsed / calls * 1e6


class _SameShapeFunction(torch.autograd.Function):
    """An autograd node shaped like the one-pass op's (9 saved tensors, 6 outputs, 3 gradients)
    that launches nothing: the autograd engine's own cost."""

    @staticmethod
    def forward(ctx, q, k, v):
        outputs = tuple(torch.empty_like(q) for _ in range(6))
        ctx.save_for_backward(q, k, v, *outputs)
        ctx.mark_non_differentiable(*outputs[2:])
        ctx.set_materialize_grads(False)
        return outputs

    @staticmethod
    def backward(ctx, grad_out, *_rest):
        q, k, v, *_ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _autograd_pieces(q, k, v, dout, causal, calls, device):
    """Backward alone, several ways, ours and an empty node of the same shape and FA2's."""
    import torch.nn.functional as F

    def ours():
        return flash_attention(q, k, v, is_causal=causal)

    def flash():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def empty_node():
        return _SameShapeFunction.apply(q, k, v)[0]
    return {f"backward alone: {name}, {how}": (forward, how)
            for name, forward in (("ours", ours), ("FA2", flash), ("empty node", empty_node))
            for how in ("backward", "backward-fresh", "grad")}


def _captured_launch(kernel, call):
    """(grid, args, kwargs) of ``kernel``'s launch inside ``call()``."""
    captured = {}
    original = kernel.run

    def capture(*args, grid, warmup, **kwargs):
        captured.update(grid=grid, args=args, kwargs=kwargs)
        return original(*args, grid=grid, warmup=warmup, **kwargs)
    kernel.run = capture
    try:
        call()
    finally:
        del kernel.run  # the class's method again
    return captured["grid"], captured["args"], captured["kwargs"]


def _launch_pieces(q, k, v, causal, scale, out, lse, resid, row_consts, k_hat, dout):
    """The launch alone (its arguments and descriptors built once) of the backward's Gluon kernel
    and of the preprocess, and the api's layers above the one-pass forward."""
    from flash_inductor.kernels.exact_delta import _exact_delta_preprocess
    from flash_inductor.kernels.hopper_bwd import _attn_bwd_hopper
    from flash_inductor.launch import Visibility, hopper_bwd
    from flash_inductor.ops.attention import attention_forward_eager
    from flash_inductor.ops.one_pass import _EagerOnePass

    def backward():
        hopper_bwd.hopper_attention_backward(dout, q.detach(), k.detach(), v.detach(), out, lse, None, scale=scale,
                                             visibility=Visibility(is_causal=causal), exact_delta=(resid, row_consts),
                                             mean_key=k_hat)
    pieces = {}
    for name, kernel in (("Gluon backward", _attn_bwd_hopper), ("exact-delta preprocess", _exact_delta_preprocess)):
        grid, args, kwargs = _captured_launch(kernel, backward)
        pieces[f"{name}: launch alone (JITFunction.run)"] = (
            lambda kernel=kernel, grid=grid, args=args, kwargs=kwargs: kernel[grid](*args, **kwargs))
        pieces.update({f"{name}: {piece}": fn for piece, fn in _jit_run_pieces(kernel, grid, args, kwargs).items()})
    pieces["_EagerOnePass.apply"] = lambda: _EagerOnePass.apply(q, k, v, causal, 0, scale, -1, -1, None)
    pieces["attention_forward_eager"] = lambda: attention_forward_eager(q, k, v, None, None, 0.0, causal, 0, scale,
                                                                        "stable")
    return pieces


def _jit_run_pieces(kernel, grid, args, kwargs) -> dict:
    """The steps of one ``JITFunction.run`` of a compiled kernel, each callable alone, as Triton 3.6
    takes them: the binder (each argument's specialisation), the compiled-kernel cache key, the
    launch metadata, the host descriptors' encoding (``make_tensordesc_arg``, each TMA descriptor
    into a CUtensorMap) and the C launcher, which encodes them again and launches. Empty where this
    Triton's internals differ: they are not an API, and only this experiment reads them."""
    try:
        from triton import knobs
        from triton.backends.nvidia.driver import make_tensordesc_arg
        from triton.runtime.driver import driver
        from triton.runtime.jit import compute_cache_key

        device = driver.active.get_current_device()
        stream = driver.active.get_current_stream(device)
        kernel_cache, key_cache, _target, _backend, binder = kernel.device_caches[device]
        kwargs = dict(kwargs, debug=kwargs.get("debug", kernel.debug) or knobs.runtime.debug,
                      instrumentation_mode=knobs.compilation.instrumentation_mode)
        bound, specialization, options = binder(*args, **kwargs)
        key = compute_cache_key(key_cache, specialization, options)
        compiled = kernel_cache[key]
        values = list(bound.values())
        grid = tuple(grid) + (1,) * (3 - len(grid))
        metadata = compiled.launch_metadata(grid, stream, *values)
        descriptors = [value for value in values if type(value).__name__ == "TensorDescriptor"]
        descriptor_meta = getattr(compiled.metadata, "tensordesc_meta", None) or [None] * len(descriptors)
    except Exception as exc:  # another Triton's internals
        print(f"      --    JITFunction.run's pieces: {type(exc).__name__}: {exc}")
        return {}

    def encode():
        for descriptor, meta in zip(descriptors, descriptor_meta):
            make_tensordesc_arg(descriptor, meta)

    def launch():
        compiled.run(*grid, stream, compiled.function, compiled.packed_metadata, metadata,
                     knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *values)
    pieces = {
        "binder (JITFunction.run)": lambda: binder(*args, **kwargs),
        "cache key (JITFunction.run)": lambda: compute_cache_key(key_cache, specialization, options),
        "launch metadata (JITFunction.run)": lambda: compiled.launch_metadata(grid, stream, *values),
        f"{len(descriptors)} descriptors encoded (make_tensordesc_arg)": encode,
        "C launcher with its descriptors (CompiledKernel.run)": launch,
    }
    try:
        for piece in pieces.values():
            piece()  # each once here, so that a mismatch drops the rows rather than the breakdown
    except Exception as exc:
        print(f"      --    JITFunction.run's pieces: {type(exc).__name__}: {exc}")
        return {}
    return pieces


def _inside_the_node_us(q, k, v, dout, causal, calls, args):
    """Of a backward alone (``torch.autograd.grad``), the share spent inside the one-pass node's
    backward (on the engine's device thread) and the rest (the engine)."""
    from flash_inductor.ops import one_pass

    spent = []
    original = one_pass._EagerOnePass.backward

    def timed(ctx, *grads):
        start = time.perf_counter()
        try:
            return original(ctx, *grads)
        finally:
            spent.append(time.perf_counter() - start)
    one_pass._EagerOnePass.backward = staticmethod(timed)
    try:
        totals, insides = [], []
        for _ in range(args.rounds):
            spent.clear()
            total = _backward_alone_us(lambda: flash_attention(q, k, v, is_causal=causal), dout, calls, args.device,
                                       (q, k, v), "grad")
            if total is not None and len(spent) == calls:
                totals.append(total)
                insides.append(sum(spent) / calls * 1e6)
    finally:
        one_pass._EagerOnePass.backward = staticmethod(original)
    record = {}
    _record(record, "backward alone: ours, grad (timed node)", totals)
    _record(record, "inside the node's backward", insides)
    return record


def _record(record, name, samples):
    """The median of the valid ``samples`` (None: the GPU caught up) as ``record[name]``, printed."""
    valid = [sample for sample in samples if sample is not None]
    record[name] = statistics.median(valid) if valid else None
    print(f"{record[name] or float('nan'):9.1f} us  {name}", flush=True)


def breakdown(args, q, k, v, dout, causal):
    """Host time of the pieces of a `stable` training step on the Hopper kernels (median of rounds)."""
    from flash_inductor.launch import Visibility, hopper, hopper_bwd
    from flash_inductor.ops.one_pass import _backward, _forward

    scale = q.shape[-1] ** -0.5
    out, lse, resid, row_consts = _forward(q.detach(), k.detach(), v.detach(), causal, 0, scale, -1, -1)
    k_hat = hopper_bwd.key_mean(k.detach())
    calls = max(4, args.calls // 4)
    pieces = {
        "fwd_grad (flash_attention, inputs require grad)": lambda: flash_attention(q, k, v, is_causal=causal),
        "one-pass _forward": lambda: _forward(q.detach(), k.detach(), v.detach(), causal, 0,
                                                                           scale, -1, -1),
        "key_mean": lambda: hopper_bwd.key_mean(k.detach()),
        "hopper_attention_forward (exact delta)": lambda: hopper.hopper_attention_forward(
            q.detach(), k.detach(), v.detach(), scale=scale, visibility=Visibility(is_causal=causal), exact_delta=True),
        "hopper_attention_backward (exact delta)": lambda: hopper_bwd.hopper_attention_backward(
            dout, q.detach(), k.detach(), v.detach(), out, lse, None, scale=scale,
            visibility=Visibility(is_causal=causal), exact_delta=(resid, row_consts), mean_key=k_hat),
        "_exact_delta_inputs": lambda: hopper_bwd._exact_delta_inputs(dout, v.detach(), out, None, resid, row_consts),
        "tma_descriptor": lambda: hopper.tma_descriptor(q.detach(), 64),
        "torch.empty": lambda: torch.empty(q.shape, dtype=q.dtype, device=q.device),
        "torch.zeros fp32": lambda: torch.zeros(q.shape, dtype=torch.float32, device=q.device),
        "lse.to(float32).contiguous()": lambda: lse.to(torch.float32).contiguous(),
    }
    pieces["one-pass _backward (main thread)"] = lambda: _backward(
        dout, q.detach(), k.detach(), v.detach(), out, lse, None, resid, row_consts, causal, 0, scale, -1, -1)
    pieces.update(_launch_pieces(q, k, v, causal, scale, out, lse, resid, row_consts, k_hat, dout))
    record = {}
    for name, fn in pieces.items():
        try:
            fn()
        except TypeError as exc:  # an older tree's signature (an A/B from two trees)
            print(f"      --    {name}: {exc}")
            continue
        _record(record, name, [_host_us(fn, calls, args.device) for _ in range(args.rounds)])
    for name, (forward, how) in _autograd_pieces(q, k, v, dout, causal, calls, args.device).items():
        for threads in (True, False):
            # Off, the engine runs every node on the calling thread (set_multithreading_enabled).
            with torch.autograd.set_multithreading_enabled(threads):
                samples = [_backward_alone_us(forward, dout, calls, args.device, (q, k, v), how)
                           for _ in range(args.rounds)]
            _record(record, name if threads else f"{name}, engine threads off", samples)
    record.update(_inside_the_node_us(q, k, v, dout, causal, calls, args))
    outs = [flash_attention(q, k, v, is_causal=causal) for _ in range(calls)]
    _sync(args.device)
    _keep_gpu_busy(args.device, 100)
    profiler = cProfile.Profile()
    profiler.enable()
    for out in outs:
        torch.autograd.grad(out, (q, k, v), dout)
    profiler.disable()
    _sync(args.device)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    record["backward_profile"] = text.getvalue()
    return record


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--causal", choices=("yes", "no"), default="yes")
    p.add_argument("--calls", type=int, default=40,
                   help="calls per timed loop; a training step's loop runs a third as many (the launch queue is finite)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--breakdown", action="store_true", help="time the pieces of ours' training step instead")
    p.add_argument("--quick", action="store_true", help="B=1, H=2, L=64, E=32, fp32 off CUDA (a CPU smoke run)")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.heads, args.seq, args.head_dim, args.calls, args.rounds = 1, 2, 64, 32, 3, 2
    dtype = DTYPES[args.dtype] if args.device.startswith("cuda") else torch.float32
    causal = args.causal == "yes"
    gen = torch.Generator(device=args.device).manual_seed(3)

    def randn(requires_grad):
        shape = (args.batch, args.heads, args.seq, args.head_dim)
        return torch.randn(shape, device=args.device, dtype=dtype, generator=gen).requires_grad_(requires_grad)

    plain = [randn(False) for _ in range(3)] + [None]
    grads = [randn(True) for _ in range(3)] + [randn(False)]
    if args.breakdown:
        if not args.device.startswith("cuda"):
            raise SystemExit("host_overhead --breakdown times the Hopper path: it needs a CUDA device")
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "host_breakdown.json"), "w") as f:
            json.dump({"args": vars(args), "us_per_call": breakdown(args, *grads, causal)}, f, indent=1)
        return
    record = {"args": vars(args), "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu", "us_per_call": {}}
    for name, fn in _providers(args.device).items():
        for way in ("fwd", "fwd_grad", "fwd_bwd"):
            tensors = plain if way == "fwd" else grads
            for _ in range(2):  # compile and warm every path first
                _step(fn, way, *tensors[:3], tensors[3], causal)
            _sync(args.device)
            calls = max(1, args.calls // 3) if way == "fwd_bwd" else args.calls
            samples = [host_us_per_call(fn, way, tensors, causal, calls, args.device) for _ in range(args.rounds)]
            valid = [s for s in samples if s is not None]
            median = statistics.median(valid) if valid else None
            record["us_per_call"][f"{name}/{way}"] = {"median": median, "samples": samples, "calls": calls}
            shown = " ".join("invalid" if s is None else f"{s:.0f}" for s in samples)
            print(f"{name:13s} {way:9s} host {median if median is not None else float('nan'):8.1f} us/call  "
                  f"samples {shown}", flush=True)

    profile_text = io.StringIO()
    providers = _providers(args.device)
    for name, way in (("ours", "fwd"), ("ours", "fwd_bwd"), ("ours_compiled", "fwd_bwd")):
        tensors = plain if way == "fwd" else grads
        calls = max(1, args.calls // 3) if way == "fwd_bwd" else args.calls
        profiler = cProfile.Profile()
        _sync(args.device)
        _keep_gpu_busy(args.device, 200)
        profiler.enable()
        for _ in range(calls):
            _step(providers[name], way, *tensors[:3], tensors[3], causal)
        profiler.disable()
        _sync(args.device)
        for order in ("tottime", "cumulative"):
            profile_text.write(f"==== {name} {way}: {calls} calls, sorted by {order}\n")
            pstats.Stats(profiler, stream=profile_text).sort_stats(order).print_stats(40)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "host_overhead.json"), "w") as f:
        json.dump(record, f, indent=1)
    with open(os.path.join(args.out, "host_overhead_profile.txt"), "w") as f:
        f.write(profile_text.getvalue())
    print(f"wrote {args.out}/host_overhead.json and host_overhead_profile.txt")


if __name__ == "__main__":
    main()
