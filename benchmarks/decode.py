"""Decode attention: a few query rows against a long KV cache, ours against SDPA's backends and Flex.

    python -m benchmarks.decode                          # the grid below, heated, CUDA-graph timing
    python -m benchmarks.decode --part generate          # HF generate tokens/s: plain compile vs ours
    python -m benchmarks.decode --time-budget 500        # partial results when the budget runs out

``--part attention`` (the default) times one attention call per cell: B in {1, 8, 64}, S in
{1k, 8k, 32k, 128k}, L in {1, 4}, GQA 8:1 (Hq 32, Hkv 4), E 128, bf16, every query row seeing
every key (``--mask cache`` adds a (B, 1, 1, S) bool mask of per-sequence cache lengths, as a
static cache passes it). Contenders, all in one run and each heated before it is timed:

* ``ours``: ``flash_inductor.flash_attention(..., enable_gqa=True)`` (the split-KV decode kernels);
* ``flash``, ``cudnn``, ``efficient``: SDPA with that backend forced (``sdpa_kernel``), with
  ``enable_gqa=True`` where the backend takes it; a backend that refuses it gets K/V expanded to
  Hq heads before timing (the record says ``expanded_kv``), and a cell whose expanded K/V would not
  fit in memory is skipped for it;
* ``flex``: ``torch.compile(flex_attention)`` with ``enable_gqa=True`` (its decode kernel for
  short queries), a ``BlockMask`` for the cache mask.

Timing (``--timing graph``, the default): each contender's calls are captured in a CUDA graph and
replayed, as an inference server runs a decode step, so that host time (tens of µs a call in
Python, more than a 1k-key decode takes) does not decide the comparison; the calls rotate over
enough copies of the inputs to exceed the L2 cache. ``--timing eager`` uses ``do_bench``.
Prints each cell's time and the ratios best-SDPA / ours and Flex / ours (> 1: ours faster), and
writes JSON and a PNG under ``--out``.

``--part generate``: a small Llama (GQA) generating greedily with a static cache, its forward
compiled by plain ``torch.compile`` and by ``flash_inductor.backend`` (``--compile-mode``, default
"default": HF's own choice for static caches, reduce-overhead, failed for both contenders on the
H200, see the flag's help); tokens/s of the ``generate`` calls after the
first, which compiles (the median of ``--gen-reps``), and whether both produce the same tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
import torch.nn.functional as F

from flash_inductor.text_table import markdown_table
from benchmarks import common

SDPA_CONTENDERS = ("flash", "cudnn", "efficient")
CONTENDERS = ("ours", *SDPA_CONTENDERS, "flex")
L2_BYTES = 50 * 2**20  # the H200's L2; inputs rotate over copies totalling at least twice this


# ----------------------------------------------------------------------------- inputs, contenders


def make_cell_inputs(batch, heads_q, heads_kv, seq_q, seq_k, head_dim, dtype, device, mask_kind, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn((batch, heads_q, seq_q, head_dim), generator=g, device=device, dtype=dtype)
    k, v = (torch.randn((batch, heads_kv, seq_k, head_dim), generator=g, device=device, dtype=dtype) for _ in range(2))
    lengths = None
    mask = None
    if mask_kind == "cache":
        lengths = torch.randint(seq_k // 2, seq_k + 1, (batch,), generator=g, device=device)
        mask = (torch.arange(seq_k, device=device)[None, :] < lengths[:, None])[:, None, None, :]
    return q, k, v, mask, lengths


def _flex_call(q, k, v, lengths, device):
    from torch.nn.attention.flex_attention import create_block_mask

    flex = common.compiled_flex()
    block_mask = None
    if lengths is not None:
        def cache_mask(b, h, q_idx, kv_idx):
            return kv_idx < lengths[b]

        block_mask = create_block_mask(cache_mask, B=q.shape[0], H=None, Q_LEN=q.shape[2], KV_LEN=k.shape[2],
                                       device=device)
    return lambda q, k, v: flex(q, k, v, block_mask=block_mask, enable_gqa=True)


def make_contender(name, q, k, v, mask, lengths):
    """(call(q, k, v), expanded_kv): the attention one contender runs on these inputs."""
    if name == "ours":
        import flash_inductor

        return (lambda q, k, v: flash_inductor.flash_attention(q, k, v, attn_mask=mask, enable_gqa=True)), False
    if name == "flex":
        return _flex_call(q, k, v, lengths, q.device), False
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, common.SDPA_BACKENDS[name])

    def sdpa(q, k, v, gqa=True):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)

    try:
        common.call_recorded(lambda: sdpa(q, k, v))
        return sdpa, False
    except common.ProviderError:
        return (lambda q, k, v: sdpa(q, k, v, gqa=False)), True


def expand_kv(k, v, heads_q):
    group = heads_q // k.shape[1]
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


# ----------------------------------------------------------------------------- timing


def _wall_ms(fn, repeats):
    times = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def capture(call, input_sets):
    """A CUDA graph that calls ``call`` once on each input set, captured on a side stream (the first
    calls compile and allocate outside the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for inputs in input_sets[:2]:
            call(*inputs)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for inputs in input_sets:
                call(*inputs)
    torch.cuda.synchronize()
    return graph


def time_call(call, input_sets, args, device):
    if torch.device(device).type != "cuda":  # CPU runs test the harness
        return _wall_ms(lambda: call(*input_sets[0]), args.rep_steps)
    if args.timing == "graph":
        graph = capture(call, input_sets)
        common.heat(graph.replay, args.heat_ms)
        return common.graph_ms(graph, len(input_sets))
    step = lambda: call(*input_sets[0])  # noqa: E731
    common.heat(step, args.heat_ms)
    return common.bench_ms(step, args.warmup, args.rep)


def _free_bytes(device):
    if torch.device(device).type != "cuda":
        return math.inf
    free, _ = torch.cuda.mem_get_info()
    return free


# ----------------------------------------------------------------------------- the attention grid


def run_cell(batch, seq_k, seq_q, args):
    """Every contender on one cell, one record each (ms, or the error / the reason it was skipped)."""
    dtype, device = common.DTYPES[args.dtype], args.device
    base = dict(batch=batch, seq_k=seq_k, seq_q=seq_q, heads_q=args.heads_q, heads_kv=args.heads_kv,
                head_dim=args.head_dim, dtype=args.dtype, mask=args.mask)
    element = torch.empty((), dtype=dtype).element_size()
    kv_bytes = 2 * batch * args.heads_kv * seq_k * args.head_dim * element
    records = []
    if 3 * kv_bytes > _free_bytes(device):
        return [dict(base, contender=c, status="skipped", error="K/V do not fit in memory") for c in args.contenders]
    q, k, v, mask, lengths = make_cell_inputs(batch, args.heads_q, args.heads_kv, seq_q, seq_k, args.head_dim,
                                              dtype, device, args.mask)
    copies = 1 if args.timing != "graph" else max(1, min(args.max_copies, math.ceil(2 * L2_BYTES / kv_bytes)))
    reference = None
    for name in args.contenders:
        record = dict(base, contender=name)
        try:
            call, expanded = make_contender(name, q, k, v, mask, lengths)
            record["expanded_kv"] = expanded
            inputs = (q, k, v)
            if expanded:
                if 3 * kv_bytes * args.heads_q // args.heads_kv > _free_bytes(device):
                    raise common.ProviderError("needs K/V expanded to Hq heads, which do not fit in memory")
                inputs = (q, *expand_kv(k, v, args.heads_q))
            out = common.call_recorded(lambda: call(*inputs))
            if reference is None:
                reference = out.float()
            record["max_abs_diff_vs_first"] = float((out.float() - reference).abs().max())
            input_sets = [inputs] + [tuple(t.clone() for t in inputs) for _ in range(copies - 1)]
            record["ms"] = time_call(call, input_sets, args, device)
            record["input_copies"] = len(input_sets)
            record["status"] = "ok"
            del input_sets, inputs, out
        except Exception as exc:  # one failing contender must not end the run
            record.update(status="error", error=common.first_line(exc))
            if common.is_fatal(record):
                records.append(record)
                raise
        common.release_memory()
        records.append(record)
    return records


def summarise(records):
    """One row per cell: each contender's ms, best SDPA / ours and Flex / ours (> 1: ours faster)."""
    cells = {}
    for r in records:
        cells.setdefault((r["batch"], r["seq_k"], r["seq_q"]), {})[r["contender"]] = r
    rows = []
    for (batch, seq_k, seq_q), by in sorted(cells.items()):
        ms = {name: r.get("ms") for name, r in by.items() if r.get("status") == "ok"}
        row = dict(batch=batch, seq_k=seq_k, seq_q=seq_q, **{f"{n}_ms": t for n, t in ms.items()})
        sdpa = {n: t for n, t in ms.items() if n in SDPA_CONTENDERS}
        if sdpa:
            row["best_sdpa"] = min(sdpa, key=sdpa.get)
        if ms.get("ours") and sdpa:
            row["vs_best_sdpa"] = sdpa[row["best_sdpa"]] / ms["ours"]
        if ms.get("ours") and ms.get("flex"):
            row["vs_flex"] = ms["flex"] / ms["ours"]
        rows.append(row)
    return rows


def format_table(rows):
    def fmt(value, spec=".4f"):
        return "-" if value is None else format(value, spec)

    header = ("B", "S", "L", "ours ms", "flash ms", "cudnn ms", "efficient ms", "flex ms", "best SDPA / ours",
              "flex / ours")
    return "\n".join(markdown_table(header, [
        (r["batch"], r["seq_k"], r["seq_q"],
         *(fmt(r.get(f"{p}_ms")) for p in ("ours", "flash", "cudnn", "efficient", "flex")),
         fmt(r.get("vs_best_sdpa"), ".2f"), fmt(r.get("vs_flex"), ".2f")) for r in rows]))


def plot(rows, path, title):
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    seq_qs = sorted({r["seq_q"] for r in rows})
    fig = Figure(figsize=(6 * len(seq_qs), 4.5))
    axes = fig.subplots(1, len(seq_qs), sharey=True, squeeze=False)
    for ax, seq_q in zip(axes[0], seq_qs):
        cells = [r for r in rows if r["seq_q"] == seq_q]
        x = range(len(cells))
        ax.bar([i - 0.2 for i in x], [r.get("vs_best_sdpa") or 0 for r in cells], width=0.4, label="best SDPA / ours")
        ax.bar([i + 0.2 for i in x], [r.get("vs_flex") or 0 for r in cells], width=0.4, label="Flex / ours")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(list(x), [f"B{r['batch']}\nS{r['seq_k'] // 1024}k" for r in cells], fontsize=7)
        ax.set_title(f"L = {seq_q}", fontsize=9)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("speed ratio (> 1: ours faster)")
    fig.suptitle(title, fontsize=9, wrap=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


# ----------------------------------------------------------------------------- HF generation


GENERATE_CONTENDERS = ("compile", "flash_inductor")


def build_llama(args, device, dtype):
    import transformers as T

    torch.manual_seed(0)
    tiny = args.tiny
    heads, kv_heads, head_dim = (8, 1, 8) if tiny else (args.heads_q, args.heads_kv, args.head_dim)
    config = T.LlamaConfig(hidden_size=heads * head_dim, intermediate_size=2 * heads * head_dim,
                           num_hidden_layers=2 if tiny else args.layers, num_attention_heads=heads,
                           num_key_value_heads=kv_heads, vocab_size=64 if tiny else 32000,
                           max_position_embeddings=args.cache_len, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                           attn_implementation="sdpa")
    return T.LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()


def compile_forward(contender, model, mode):
    backend = common.flash_inductor_backend() if contender == "flash_inductor" else "inductor"
    model.forward = torch.compile(model.forward, backend=backend, mode=mode)
    return model


def run_generate(args, compile_fn=None):
    """Both contenders generate ``--new-tokens`` greedily for ``--gen-batch`` prompts; tokens/s of
    the calls after the first (which compiles)."""
    dtype, device = common.DTYPES[args.dtype], args.device
    compile_fn = compile_fn or (lambda contender, model: compile_forward(contender, model, args.compile_mode))
    vocab = 64 if args.tiny else 32000
    ids = torch.randint(3, vocab, (args.gen_batch, args.prompt), generator=torch.Generator().manual_seed(1)).to(device)
    kwargs = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                  cache_implementation="static", max_cache_len=args.cache_len, pad_token_id=0, disable_compile=True)
    records, tokens = [], {}
    for contender in GENERATE_CONTENDERS:
        record = dict(part="generate", contender=contender, batch=args.gen_batch, prompt=args.prompt,
                      new_tokens=args.new_tokens, cache_len=args.cache_len, dtype=args.dtype,
                      compile_mode=args.compile_mode)
        try:
            torch._dynamo.reset()
            model = compile_fn(contender, build_llama(args, device, dtype))
            with torch.no_grad():
                start = time.perf_counter()
                model.generate(ids, **kwargs)  # compiles
                record["first_call_s"] = time.perf_counter() - start
                if torch.device(device).type == "cuda":
                    torch.cuda.synchronize()
                times = []
                for _ in range(max(1, args.gen_reps)):  # the median of a few: one call is noisy
                    start = time.perf_counter()
                    out = model.generate(ids, **kwargs)
                    if torch.device(device).type == "cuda":
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - start)
                seconds = sorted(times)[len(times) // 2]
            tokens[contender] = out
            record.update(status="ok", seconds=seconds, tokens_per_s=args.gen_batch * args.new_tokens / seconds)
            del model
        except Exception as exc:
            record.update(status="error", error=common.first_line(exc))
        common.release_memory()
        records.append(record)
    if len(tokens) == 2:
        a, b = tokens.values()
        same = (a == b).float().mean().item() if a.shape == b.shape else 0.0
        for record in records:
            record["tokens_equal_fraction"] = same
    return records


# ----------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("attention", "generate"), default="attention")
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--seqs", default="1024,8192,32768,131072", help="key lengths S")
    p.add_argument("--query-rows", default="1,4", help="query rows L")
    p.add_argument("--heads-q", type=int, default=32)
    p.add_argument("--heads-kv", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=tuple(common.DTYPES), default="bf16")
    p.add_argument("--mask", choices=("none", "cache"), default="none")
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--timing", choices=("graph", "eager"), default="graph")
    p.add_argument("--max-copies", type=int, default=64, help="graph timing: input copies rotated over")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rep", type=int, default=50)
    p.add_argument("--rep-steps", type=int, default=3, help="CPU only: calls timed per contender")
    p.add_argument("--heat-ms", type=float, default=300.0)
    p.add_argument("--time-budget", type=float, default=None, help="seconds; cells past it are skipped")
    # --part generate
    p.add_argument("--tiny", action="store_true", help="generate: a two-layer E 8 model (tests of the harness)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--gen-batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--cache-len", type=int, default=4096)
    p.add_argument("--gen-reps", type=int, default=3, help="timed generate calls per contender (median)")
    p.add_argument("--compile-mode", default="default",
                   help="torch.compile mode of both contenders. reduce-overhead (CUDA graphs) failed for both on the "
                        "H200 with torch 2.11 and transformers 5.17: StaticCache.update mutates a cache buffer inside "
                        "the graph, and generate then reads an output a later replay overwrote")
    common.add_output_args(p)
    p.set_defaults(out=os.environ.get("OUT") or "/tmp/flash_inductor_out")
    args = p.parse_args(argv)
    args.contenders = tuple(args.contenders.split(","))
    unknown = set(args.contenders) - set(CONTENDERS)
    if unknown:
        p.error(f"--contenders: unknown {sorted(unknown)}; choose from {', '.join(CONTENDERS)}")
    if args.heads_q % args.heads_kv:
        p.error("--heads-q must be a multiple of --heads-kv")
    return args


def _write(args, env, payload, rows, title):
    if args.no_write:
        return None
    prefix = "decode" if args.part == "attention" else "decode_generate"
    path = common.write_record(args.out, prefix, env, payload, args.tag, args.device)
    if rows is not None:
        plot(rows, path[: -len(".json")] + ".png", title)
    return path


def main(argv=None, compile_fn=None) -> list[dict]:
    args = parse_args(argv)
    env = common.environment(common.module_command("benchmarks.decode", argv))
    if args.part == "generate":
        records = run_generate(args, compile_fn)
        for r in records:
            print(json.dumps(r))
        rates = {r["contender"]: r.get("tokens_per_s") for r in records}
        if rates.get("compile") and rates.get("flash_inductor"):
            print(f"tokens/s: ours {rates['flash_inductor']:.1f}, plain torch.compile {rates['compile']:.1f}, "
                  f"ours / plain {rates['flash_inductor'] / rates['compile']:.2f}x")
        _write(args, env, dict(results=records), None, "")
        return records
    cells = [(b, s, lq) for lq in map(int, args.query_rows.split(",")) for s in map(int, args.seqs.split(","))
             for b in map(int, args.batches.split(","))]
    deadline = time.monotonic() + args.time_budget if args.time_budget else None
    partial = None if args.no_write else common.output_stem(args.out, env, args.tag, "decode", args.device) \
        + ".partial.jsonl"
    records = []
    with common.dynamo_limits():
        for batch, seq_k, seq_q in common.progress(cells, "decode cells"):
            if deadline is not None and time.monotonic() > deadline:
                records.extend(dict(batch=batch, seq_k=seq_k, seq_q=seq_q, contender=c, status="skipped",
                                    error="past --time-budget") for c in args.contenders)
                continue
            cell = run_cell(batch, seq_k, seq_q, args)
            records.extend(cell)
            common.append_records(partial, cell)
    rows = summarise(records)
    print(format_table(rows))
    title = (f"{env.get('gpu') or args.device}, torch {env['torch']}, {args.dtype}, Hq {args.heads_q} Hkv "
             f"{args.heads_kv} E {args.head_dim}, mask {args.mask}, {args.timing} timing")
    _write(args, env, dict(results=records, summary=rows), rows, title)
    if partial is not None and os.path.exists(partial):  # the JSON holds every record now
        os.remove(partial)
    return records


if __name__ == "__main__":
    main()
