"""What every benchmark script shares: the dtype table and FLOP model, timing and heating, the
providers (one attention call per backend, its inputs and its timed step), how a failure becomes
one recorded line, the environment header, output names and writers, and progress bars.

The scripts run as modules from the repository root (``python -m benchmarks.bench_attention``),
so they import ``flash_inductor`` from the tree they sit in and each other as ``benchmarks.*``.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time
import warnings

import torch
import torch.nn.functional as F

_HERE = os.path.dirname(os.path.abspath(__file__))

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                 "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}
MODE_FLOP_FACTOR = {"infer": 1.0, "fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}


# ----------------------------------------------------------------------------- FLOPs, timing

def attention_flops(batch, heads, seq_q, seq_k, head_dim, causal, mode):
    fwd = 4.0 * batch * heads * seq_q * seq_k * head_dim * (0.5 if causal else 1.0)
    return fwd * MODE_FLOP_FACTOR[mode]


def tflops(flops, ms):
    return flops / (ms * 1e-3) / 1e12


def bench_ms(fn, warmup, rep, grad_to_none=None):
    from triton.testing import do_bench
    return float(do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, return_mode="median"))


def heat(fn, ms, clock=time.monotonic, synchronize=None):
    """Run fn back to back for about ``ms`` before it is timed, so every provider is timed at the card's
    sustained, power-limited clock; timed straight after an idle compile a step gets the boost clock,
    and which provider gets it depends on the grid's order (docs/performance.md)."""
    from flash_inductor.autotune.measure import run_for

    run_for(fn, ms, clock=clock, synchronize=synchronize)


# ----------------------------------------------------------------------------- failures

class ProviderError(RuntimeError):
    """A provider's failure, its message already the one line we record."""


def first_line(exc):
    if isinstance(exc, ProviderError):
        return str(exc)
    lines = [x.strip() for x in (str(exc).strip() or type(exc).__name__).splitlines() if x.strip()]
    text = lines[0][:300]
    if text.endswith(":") and len(lines) > 1:  # Triton's CompilationError: 'at 76:76:', source, then the error
        text += " ... " + lines[-1][:300]
    return f"{type(exc).__name__}: {text}"


def is_fatal(record):
    """A CUDA fault (illegal address, device assert) poisons the context: every later measurement would fail."""
    err = record.get("error") or ""
    return "CUDA error" in err and "out of memory" not in err


def call_recorded(fn):
    """Run fn; when it fails, append the warnings it raised (SDPA gives its reasons only as warnings)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return fn()
        except Exception as exc:
            reasons = [re.sub(r"\s*\(Triggered internally at [^)]*\)", "", " ".join(str(w.message).split()))
                       for w in caught]
            reasons = list(dict.fromkeys(r[:160] for r in reasons if r and not r.endswith(("because:", "runtime disabled."))))
            raise ProviderError(first_line(exc) + "".join(" | " + r for r in reasons[:3])) from exc


def peak_bytes_above_live(step) -> int:
    """Peak CUDA allocation of one ``step()`` above what is live before it, its result included
    until the peak is read. Warm ``step`` first, so that compiles and autotuning stay outside."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    result = step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del result
    return peak


def release_memory():
    with contextlib.suppress(Exception):  # after a CUDA fault this raises too; the record says why already
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- compile settings

@contextlib.contextmanager
def dynamo_limits(limit=4096):
    """Raise dynamo's recompile limits for our run only: past the default 8 recompiles of one
    code object, FlexAttention silently runs an eager ~10 TFLOP/s path."""
    cfg = torch._dynamo.config
    patch = {}
    for new, old in (("recompile_limit", "cache_size_limit"),
                     ("accumulated_recompile_limit", "accumulated_cache_size_limit")):
        name = new if hasattr(cfg, new) else old if hasattr(cfg, old) else None
        if name:
            patch[name] = limit
    with cfg.patch(patch):
        yield


@contextlib.contextmanager
def no_donated_buffers():
    """Compiled graphs that donate saved buffers refuse backward(retain_graph=True), which the 'bwd' mode
    needs; donation only lets backward reuse memory, so the grid turns it off (the memory section keeps it)."""
    cfg = torch._functorch.config
    with cfg.patch(donated_buffer=False) if hasattr(cfg, "donated_buffer") else contextlib.nullcontext():
        yield


# ----------------------------------------------------------------------------- providers

def _causal_mask_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


_COMPILED_FLEX = None


def compiled_flex():
    """``torch.compile(flex_attention)``, compiled once per process for every benchmark that times
    Flex. Static shapes: every benchmark shape gets its own specialised kernel, as a user's (or a
    serving engine's) would."""
    global _COMPILED_FLEX
    if _COMPILED_FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention
        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
    return _COMPILED_FLEX


def make_attention(provider, causal, seq_q, seq_k, device):
    """Return attn(q, k, v) -> out for a provider; anything shape-specific is built here, untimed."""
    if provider in ("ours", "ours-fast", "ours-fp8"):
        import flash_inductor
        schedule = {"ours": None, "ours-fast": "fast", "ours-fp8": "fp8"}[provider]
        return lambda q, k, v: flash_inductor.flash_attention(q, k, v, is_causal=causal, schedule=schedule)
    if provider == "ours-compiled":
        return _compiled_ours(causal)
    if provider == "flex":
        from torch.nn.attention.flex_attention import create_block_mask
        flex = compiled_flex()
        mask = (create_block_mask(_causal_mask_mod, B=None, H=None, Q_LEN=seq_q, KV_LEN=seq_k, device=device)
                if causal else None)
        return lambda q, k, v: flex(q, k, v, block_mask=mask)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = getattr(SDPBackend, SDPA_BACKENDS[provider])

    def attn(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return attn


def _compiled_ours(causal):
    """SDPA compiled with flash_inductor.backend, static shapes, as a model compiled for one shape
    would run it: the pass replaces the call with our op and Inductor's wrapper launches it. One
    code object serves every cell (dynamo_limits keeps its recompiles from falling back)."""
    backend = flash_inductor_backend()
    if backend is None:
        raise RuntimeError("flash_inductor.backend is not available")

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return torch.compile(sdpa, backend=backend, dynamic=False)


def flash_inductor_backend():
    """``flash_inductor.backend``, the torch.compile backend function, or None where it is missing."""
    import flash_inductor

    backend = getattr(flash_inductor, "backend", None)
    if backend is not None and not callable(backend):  # the submodule, not the backend function
        backend = getattr(backend, "backend", None)
    return backend if callable(backend) else None


def make_inputs(batch, heads, seq, head_dim, dtype, device):
    shape = (batch, heads, seq, head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    return q, k, v, torch.randn(shape, device=device, dtype=dtype)


def make_step(attn, mode, q, k, v, dout):
    """The callable that do_bench times for a mode (backward-only keeps one graph alive)."""
    if mode == "fwd":
        return lambda: attn(q, k, v)
    if mode == "infer":
        return torch.no_grad()(lambda: attn(q, k, v))
    if mode == "fwd_bwd":
        return lambda: torch.autograd.grad(attn(q, k, v), (q, k, v), dout)
    out = attn(q, k, v)
    return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)


class GPTBlock(torch.nn.Module):
    """nanoGPT's Block with its hand-written CausalSelfAttention (the tril-buffer pattern)."""

    def __init__(self, d_model=1024, n_head=16, max_seq=2048):
        super().__init__()
        self.n_head = n_head
        self.ln_1, self.ln_2 = torch.nn.LayerNorm(d_model), torch.nn.LayerNorm(d_model)
        self.c_attn = torch.nn.Linear(d_model, 3 * d_model)
        self.c_proj = torch.nn.Linear(d_model, d_model)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d_model, 4 * d_model), torch.nn.GELU(),
                                       torch.nn.Linear(4 * d_model, d_model))
        self.register_buffer("bias", torch.tril(torch.ones(max_seq, max_seq)).view(1, 1, max_seq, max_seq))

    def attention(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))

    def forward(self, x):
        x = x + self.attention(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


# ----------------------------------------------------------------------------- environment, output

def environment(argv):
    """The header every result file carries: GPU, versions, date, git commit and the command run.
    ``argv`` is the command after the interpreter, e.g. ``["-m", "benchmarks.probe_timing", "--seq", "64"]``."""
    env = dict(gpu=None, compute_capability=None, sm_count=None, torch=torch.__version__, triton=None,
               cuda=torch.version.cuda, python=sys.version.split()[0],
               date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
               command=" ".join(shlex.quote(a) for a in [sys.executable, *argv]))
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=torch.cuda.get_device_name(0), compute_capability=list(torch.cuda.get_device_capability(0)),
                   sm_count=props.multi_processor_count)
    try:
        commit = subprocess.run(["git", "-C", _HERE, "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip()
        env["git_commit"] = commit if re.fullmatch(r"[0-9a-f]{40}", commit) else None
        env["git_dirty"] = bool(subprocess.run(["git", "-C", _HERE, "status", "--porcelain", "--untracked-files=no"],
                                               capture_output=True, text=True, timeout=10).stdout.strip())
    except Exception:
        env["git_commit"] = None
    return env


def module_command(module, argv=None):
    """``["-m", module, *args]``: the command line of a run of ``python -m module``, for ``environment``
    (``argv``: the arguments main() was given, or None for this process's own)."""
    return ["-m", module, *(sys.argv[1:] if argv is None else argv)]


def slug(text):
    return re.sub(r"[^a-z0-9]+", "-", (text or "unknown-gpu").lower()).strip("-")


def output_stem(out_dir, env, tag=None, prefix="bench", device=None):
    """<out_dir>/<prefix>_<gpu>_<yyyymmdd>[_<tag>]. Off CUDA the device stands in for the GPU: a run
    with ``device="cpu"`` on a machine that has a GPU is named after the CPU, not the GPU it did not use."""
    date = env["date"][:10].replace("-", "")
    on_gpu = device is None or str(device).startswith("cuda")
    name = env["gpu"] if on_gpu and env["gpu"] else device
    return os.path.join(out_dir, f"{prefix}_{slug(name)}_{date}" + (f"_{slug(tag)}" if tag else ""))


def add_cell_args(p, *, dtype, batch, heads, seq, head_dim):
    """The one-shape flags of the single-cell scripts (probe_timing, bench_monitor, backward_breakdown)."""
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=DTYPES, default=dtype)
    p.add_argument("--batch", type=int, default=batch)
    p.add_argument("--heads", type=int, default=heads)
    p.add_argument("--seq", type=int, default=seq)
    p.add_argument("--head-dim", type=int, default=head_dim)


def add_output_args(p):
    """--tag, --out and --no-write of the single-cell scripts (their records go through write_record)."""
    p.add_argument("--tag", default=None, help="appended to the output file's name")
    p.add_argument("--out", default=os.path.join("benchmarks", "results"))
    p.add_argument("--no-write", action="store_true")


def write_record(out_dir, prefix, env, payload, tag=None, device=None) -> str:
    """One JSON file {"header": env, **payload} named by ``output_stem``; returns its path."""
    os.makedirs(out_dir, exist_ok=True)
    path = output_stem(out_dir, env, tag, prefix, device) + ".json"
    with open(path, "w") as f:
        json.dump({"header": env, **payload}, f, indent=1)
    print(f"wrote {path}")
    return path


def append_records(path, records):
    """Append ``records`` to ``path`` (a <stem>.partial.jsonl) as JSON lines, as they are measured: a
    run killed from outside (a device call's time limit) still leaves what it measured. No path: nothing."""
    if path:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)


# ----------------------------------------------------------------------------- progress

def progress(items, desc, total=None):
    try:
        from tqdm import tqdm
        return tqdm(items, desc=desc, total=total, dynamic_ncols=True,
                    mininterval=0.1 if sys.stderr.isatty() else 10.0)
    except ImportError:
        return _plain_progress(items, desc)


def _plain_progress(items, desc):
    items = list(items)
    for i, item in enumerate(items, 1):
        print(f"[{desc} {i}/{len(items)}] {item}", file=sys.stderr, flush=True)
        yield item


def graph_ms(graph, calls, replays=20):
    """Milliseconds per call of a captured graph of ``calls`` calls (median of five timings)."""
    samples = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / (replays * calls))
    return sorted(samples)[len(samples) // 2]
