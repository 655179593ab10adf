"""Real models, end to end: plain ``torch.compile`` against ``torch.compile(backend=flash_inductor.backend)``.

HF transformers models are built from configs (no downloads): Llama-style GQA at head dim 64 and
128, GPT-2, BERT (with padding) and ViT. Each is measured on a training step (forward, loss,
backward, fused AdamW) and on an inference forward, with ``attn_implementation`` "sdpa" (the
transformers default; on Hopper SDPA dispatches to cuDNN) and "eager" (hand-written attention).
Both contenders of a cell run in this one process, each compiled, heated, then timed with
``triton.testing.do_bench``; the record keeps each contender's first call (its compile: the cold
start a user waits for), and ours' first output (the inference logits, the training step's loss)
is compared element-wise with the plain contender's, at a tolerance per dtype
(``OUTPUT_TOLERANCE``), so a speed-up that changed the result shows.

    python -m benchmarks.e2e_models                                 # every model, seq 1k-8k
    python -m benchmarks.e2e_models --models llama-e64 --seqs 2048 --tasks train
    python -m benchmarks.e2e_models --cold ...                      # fresh Triton/Inductor caches
    python -m benchmarks.e2e_models --mode reduce-overhead ...      # both contenders on CUDA graphs

``--mode`` is torch.compile's mode for both contenders. A small layer's step can be bound by the
host's launch time rather than the GPU (docs/performance.md, "Host time at small sequences");
"reduce-overhead" replays CUDA graphs, so what is left between the contenders is their kernels.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import tempfile
import time

import torch

from flash_inductor import text_table
from benchmarks import common

TASKS = ("train", "infer")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")
CONTENDERS = ("compile", "flash_inductor")
TOKENS = 16384  # batch x seq of every cell
# Ours' first output against the plain contender's: every element within this fraction of the
# plain output's largest magnitude. Scaled by the largest magnitude rather than each element's:
# logits near zero make an element-wise relative difference meaningless, as a mean near zero did.
# The two differ by the attention's accumulation order (and ours' fp32 softmax in 16-bit), carried
# through every layer: fp32 keeps that near its own rounding; a 16-bit output is rounded to its
# 8 (bf16, eps 3.9e-3) or 11 (fp16, eps 4.9e-4) significant bits at every layer, so a few units
# of its eps.
OUTPUT_TOLERANCE = {"fp32": 1e-4, "fp16": 1e-2, "bf16": 5e-2}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    family: str  # llama, gpt2, bert, vit
    hidden: int
    layers: int
    heads: int
    kv_heads: int | None = None  # GQA (llama)
    vocab: int = 32000

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


MODELS = {
    # The configuration behind the README's end-to-end claim: hidden 1024, 16/4 heads (E 64).
    "llama-e64": ModelSpec("llama", hidden=1024, layers=8, heads=16, kv_heads=4),
    "llama-e128": ModelSpec("llama", hidden=2048, layers=4, heads=16, kv_heads=4),
    "gpt2": ModelSpec("gpt2", hidden=1024, layers=8, heads=16, vocab=50257),
    "bert": ModelSpec("bert", hidden=1024, layers=8, heads=16, vocab=30522),
    "vit": ModelSpec("vit", hidden=768, layers=8, heads=12),
}
# Small enough for a CPU test of the harness: every family, two layers, E 16.
TINY_MODELS = {name: dataclasses.replace(spec, hidden=64, layers=2, heads=4, kv_heads=spec.kv_heads and 2, vocab=256)
               for name, spec in MODELS.items()}
VIT_PATCH = 16


def vit_image_size(seq: int) -> int:
    """The square image whose 16-pixel patches give about ``seq`` tokens (plus the class token)."""
    return VIT_PATCH * max(1, round(math.sqrt(seq)))


def build_model(spec: ModelSpec, seq: int, attn_implementation: str, device, dtype) -> torch.nn.Module:
    import transformers as tf

    attn_kwargs = dict(attn_implementation=attn_implementation)
    if spec.family == "llama":
        cfg = tf.LlamaConfig(hidden_size=spec.hidden, intermediate_size=int(spec.hidden * 8 / 3) // 64 * 64 or 64,
                             num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
                             num_key_value_heads=spec.kv_heads, vocab_size=spec.vocab, max_position_embeddings=seq)
        model = tf.AutoModelForCausalLM.from_config(cfg, **attn_kwargs)
    elif spec.family == "gpt2":
        cfg = tf.GPT2Config(n_embd=spec.hidden, n_layer=spec.layers, n_head=spec.heads, vocab_size=spec.vocab,
                            n_positions=seq)
        model = tf.AutoModelForCausalLM.from_config(cfg, **attn_kwargs)
    elif spec.family == "bert":
        cfg = tf.BertConfig(hidden_size=spec.hidden, num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
                            intermediate_size=4 * spec.hidden, vocab_size=spec.vocab, max_position_embeddings=seq)
        model = tf.AutoModelForMaskedLM.from_config(cfg, **attn_kwargs)
    elif spec.family == "vit":
        cfg = tf.ViTConfig(hidden_size=spec.hidden, num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
                           intermediate_size=4 * spec.hidden, image_size=vit_image_size(seq), patch_size=VIT_PATCH,
                           num_labels=1000)
        model = tf.AutoModelForImageClassification.from_config(cfg, **attn_kwargs)
    else:
        raise ValueError(f"unknown model family {spec.family!r}")
    # Dropout off: both contenders then compute the same function, and their losses compare.
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model.to(device=device, dtype=dtype)


def make_batch(spec: ModelSpec, seq: int, batch: int, device, dtype) -> dict:
    """Model inputs with labels. BERT gets padding: every other sequence loses its last eighth,
    so its attention carries a real mask."""
    generator = torch.Generator().manual_seed(0)
    if spec.family == "vit":
        size = vit_image_size(seq)
        pixels = torch.randn(batch, 3, size, size, generator=generator)
        return dict(pixel_values=pixels.to(device=device, dtype=dtype),
                    labels=torch.randint(0, 1000, (batch,), generator=generator).to(device))
    ids = torch.randint(0, spec.vocab, (batch, seq), generator=generator).to(device)
    inputs = dict(input_ids=ids, labels=ids)
    if spec.family == "bert":
        mask = torch.ones(batch, seq, dtype=torch.long, device=device)
        mask[::2, seq - seq // 8:] = 0
        inputs["attention_mask"] = mask
    return inputs


def batch_for(spec: ModelSpec, seq: int, tokens: int) -> int:
    if spec.family == "vit":
        return max(1, tokens // (vit_image_size(seq) // VIT_PATCH) ** 2)
    return max(1, tokens // seq)


def make_task(model, compiled, inputs: dict, task: str):
    """A step callable for one task, and the tensors do_bench should clear between calls."""
    if task == "infer":
        def infer():
            with torch.no_grad():
                return compiled(**inputs).logits
        return infer
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, **({"fused": True} if _on_cuda(model) else {}))

    def train():
        optimizer.zero_grad(set_to_none=True)
        loss = compiled(**inputs).loss
        loss.backward()
        optimizer.step()
        return loss
    return train


def _on_cuda(model) -> bool:
    return next(model.parameters()).device.type == "cuda"


def compile_with(contender: str, model, schedule: str | None = None, mode: str | None = None):
    """``schedule``: the precision schedule our backend gives the rewritten attention (None: the
    default, `stable`); ``mode``: torch.compile's mode, the same for both contenders (None: the
    default)."""
    if contender == "compile":
        return torch.compile(model, mode=mode)
    import flash_inductor

    backend = flash_inductor.backend if schedule is None else flash_inductor.make_backend(schedule=schedule)
    return torch.compile(model, backend=backend, mode=mode)


def _compile_fn(schedule: str | None, mode: str | None):
    """``compile_with`` with the run's schedule and mode bound (only those that are set)."""
    bound = {key: value for key, value in (("schedule", schedule), ("mode", mode)) if value is not None}
    return functools.partial(compile_with, **bound) if bound else compile_with


def _synchronize(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_step(step, args, device) -> float:
    if torch.device(device).type != "cuda":  # CPU runs test the harness; a wall-clock median is enough
        times = []
        for _ in range(max(1, args.rep_steps)):
            start = time.perf_counter()
            step()
            times.append((time.perf_counter() - start) * 1e3)
        return sorted(times)[len(times) // 2]
    common.heat(step, args.heat_ms)
    return common.bench_ms(step, args.warmup, args.rep)


def _built_step(name: str, spec: ModelSpec, seq: int, attn: str, task: str, contender: str, args, compile_fn):
    """One contender's model, compiled, and its step for the cell."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model(spec, seq, attn, args.device, common.DTYPES[args.dtype])
    model.train(task == "train")
    inputs = make_batch(spec, seq, batch_for(spec, seq, args.tokens), args.device, common.DTYPES[args.dtype])
    return make_task(model, compile_fn(contender, model), inputs, task)


def run_cell(name: str, spec: ModelSpec, seq: int, attn: str, task: str, args, compile_fn=compile_with) -> list[dict]:
    """Both contenders on one (model, seq, attention implementation, task), one record each."""
    batch = batch_for(spec, seq, args.tokens)
    base = dict(model=name, family=spec.family, head_dim=spec.head_dim, heads=spec.heads, kv_heads=spec.kv_heads,
                layers=spec.layers, hidden=spec.hidden, seq=seq, batch=batch, attn=attn, task=task, dtype=args.dtype,
                mode=getattr(args, "mode", None))
    records = []
    plain_output = None
    for contender in CONTENDERS:
        record = dict(base, contender=contender)
        try:
            step = _built_step(name, spec, seq, attn, task, contender, args, compile_fn)
            start = time.perf_counter()
            first = step()
            _synchronize(args.device)
            record["first_call_s"] = time.perf_counter() - start
            record["first_output"] = float(first.detach().float().mean())  # a summary; compare_outputs checks
            # Kept on the host: the logits of a 16k-token cell take a GiB the next compile may need.
            output = first.detach().to("cpu", copy=True)
            if contender == "compile":
                plain_output = output
            elif plain_output is not None:
                record.update(compare_outputs(plain_output, output, args.dtype))
            del output
            record["ms"] = time_step(step, args, args.device)
            record["status"] = "ok"
            del step, first
        except Exception as exc:  # one failing cell must not end a long run
            record.update(status="error", error=common.first_line(exc))
        common.release_memory()
        records.append(record)
    return records


def compare_outputs(plain: torch.Tensor, ours: torch.Tensor, dtype: str) -> dict:
    """Ours' output against the plain contender's, element by element: the largest absolute
    difference, that difference relative to the plain output's largest magnitude, and whether it
    is within ``OUTPUT_TOLERANCE[dtype]`` (a shape mismatch, or a non-finite value where the plain
    output has a finite one, is not)."""
    tolerance = OUTPUT_TOLERANCE[dtype]
    result = dict(output_tolerance=tolerance, output_max_abs_diff=math.inf, output_max_rel_diff=math.inf,
                  output_within_tolerance=False)
    if plain.shape != ours.shape:
        return result
    max_abs, scale, broken = 0.0, 0.0, False
    # In chunks: a float copy of a large cell's whole logits would take several GiB of host memory.
    for a, b in zip(plain.reshape(-1).split(1 << 24), ours.reshape(-1).split(1 << 24)):
        a, b = a.double(), b.double()
        finite = torch.isfinite(a)
        same_non_finite = (a[~finite] == b[~finite]) | (a[~finite].isnan() & b[~finite].isnan())
        broken |= bool((finite & ~torch.isfinite(b)).any()) or not bool(same_non_finite.all())
        if finite.any():
            max_abs = max(max_abs, float((a[finite] - b[finite]).abs().max()))
            scale = max(scale, float(a[finite].abs().max()))
    if broken:
        return result
    relative = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    return dict(result, output_max_abs_diff=max_abs, output_max_rel_diff=relative,
                output_within_tolerance=relative <= tolerance)


def precompile_items(cells, args) -> list[dict]:
    """One item per (cell, contender) for ``benchmarks.precompile``: its workers build and run each
    step once, filling the Inductor and Triton caches this run then reads, so that the timed pass
    compiles from warm caches (about 5 s a contender where a cold compile takes 20-30 s)."""
    items = [dict(builder="benchmarks.e2e_models", model=name, seq=seq, attn=attn, task=task, contender=contender,
                  dtype=args.dtype, tokens=args.tokens, tiny=args.tiny, schedule=args.schedule, mode=args.mode)
             for name, _spec, seq, attn, task in cells for contender in CONTENDERS]
    items.sort(key=lambda it: -it["seq"])  # the slowest first, so the workers finish together
    return items


def compile_item(item, device) -> None:
    """Run one precompile item's first step (``benchmarks.precompile`` worker side)."""
    spec = (TINY_MODELS if item["tiny"] else MODELS)[item["model"]]
    args = argparse.Namespace(device=device, dtype=item["dtype"], tokens=item["tokens"])
    compile_fn = _compile_fn(item["schedule"], item.get("mode"))
    with common.dynamo_limits():
        step = _built_step(item["model"], spec, item["seq"], item["attn"], item["task"], item["contender"], args,
                           compile_fn)
        step()
        _synchronize(device)


def summarise(records: list[dict]) -> list[dict]:
    """One row per cell: each contender's time and ours / plain compile as a speed ratio (> 1: ours faster)."""
    cells = {}
    for r in records:
        key = tuple(r[k] for k in ("model", "seq", "attn", "task"))
        cells.setdefault(key, {})[r["contender"]] = r
    rows = []
    for (model, seq, attn, task), by in cells.items():
        plain, ours = by.get("compile", {}), by.get("flash_inductor", {})
        row = dict(model=model, seq=seq, attn=attn, task=task, compile_ms=plain.get("ms"), ours_ms=ours.get("ms"),
                   ours_first_call_s=ours.get("first_call_s"), compile_first_call_s=plain.get("first_call_s"))
        if plain.get("ms") and ours.get("ms"):
            row["speedup"] = plain["ms"] / ours["ms"]
            for key in ("output_max_abs_diff", "output_max_rel_diff", "output_within_tolerance", "output_tolerance"):
                row[key] = ours.get(key)
        rows.append(row)
    return rows


def markdown_table(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        ratio = f"{r['speedup']:.2f}x" if r.get("speedup") else "failed"
        fmt = lambda v: f"{v:.2f}" if v is not None else "-"  # noqa: E731
        diff = "-" if r.get("output_max_rel_diff") is None else (
            f"{r['output_max_rel_diff']:.1e}" + ("" if r["output_within_tolerance"] else f" > {r['output_tolerance']:g}"))
        lines.append((r["model"], r["seq"], r["attn"], r["task"], fmt(r["compile_ms"]), fmt(r["ours_ms"]), ratio, diff))
    header = ("model", "seq", "attn", "task", "plain compile ms", "ours ms", "ours / plain", "output max rel diff")
    return "\n".join(text_table.markdown_table(header, lines))


def plot(rows: list[dict], path: str, title: str) -> str | None:
    """Speed-up of ours over plain compile per cell, one panel per task; the 1.0 line is the bar."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    fig = Figure(figsize=(12, 4.5))
    axes = fig.subplots(1, len(TASKS), sharey=True, squeeze=False)
    for ax, task in zip(axes[0], TASKS):
        cells = [r for r in rows if r["task"] == task and r.get("speedup")]
        labels = [f"{r['model']}\n{r['attn']} {r['seq'] // 1024}k" for r in cells]
        colours = ["tab:blue" if r["attn"] == "sdpa" else "tab:orange" for r in cells]
        ax.bar(range(len(cells)), [r["speedup"] for r in cells], color=colours)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(cells)), labels, rotation=90, fontsize=7)
        ax.set_title(f"{task}: ours / plain torch.compile (blue sdpa, orange eager)", fontsize=9)
    axes[0][0].set_ylabel("speed ratio (> 1: flash_inductor faster)")
    fig.suptitle(title, fontsize=9, wrap=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help=f"comma list of {', '.join(MODELS)}")
    p.add_argument("--seqs", default="1024,2048,4096,8192")
    p.add_argument("--attn", default=",".join(ATTN_IMPLEMENTATIONS))
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--tokens", type=int, default=TOKENS, help="batch x seq of every cell")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="two-layer E 16 models (tests of the harness)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rep", type=int, default=50)
    p.add_argument("--rep-steps", type=int, default=3, help="CPU only: steps timed per contender")
    p.add_argument("--heat-ms", type=float, default=500.0)
    p.add_argument("--time-budget", type=float, default=None, help="seconds; cells past it are skipped")
    p.add_argument("--schedule", default=None,
                   help="precision schedule of our backend's attention (default: the backend's, stable)")
    p.add_argument("--mode", default=None, choices=("default", "reduce-overhead", "max-autotune",
                                                    "max-autotune-no-cudagraphs"),
                   help="torch.compile's mode for both contenders (default: none given)")
    p.add_argument("--cold", action="store_true",
                   help="fresh Triton and Inductor caches, so first_call_s is a cold start")
    p.add_argument("--precompile", type=int, default=0,
                   help="worker processes that compile every cell first (0: none); first_call_s then "
                        "measures a warm start")
    common.add_output_args(p)
    return p.parse_args(argv)


def plan(args) -> list[tuple[str, ModelSpec, int, str, str]]:
    models = TINY_MODELS if args.tiny else MODELS
    unknown = [m for m in args.models.split(",") if m not in models]
    if unknown:
        raise SystemExit(f"--models: unknown {unknown}; choose from {', '.join(models)}")
    seqs = [int(s) for s in args.seqs.split(",")]
    return [(m, models[m], seq, attn, task) for m in args.models.split(",") for seq in seqs
            for attn in args.attn.split(",") for task in args.tasks.split(",")]


def main(argv=None, compile_fn=compile_with) -> list[dict]:
    args = parse_args(argv)
    if args.cold and args.precompile:
        raise SystemExit("--cold times a start from empty caches and --precompile fills them first: choose one")
    if compile_fn is compile_with:
        compile_fn = _compile_fn(args.schedule, args.mode)
    if args.cold:  # read when the caches are first used, so setting them here, before any compile, suffices
        fresh = tempfile.mkdtemp(prefix="e2e_cold_")
        os.environ["TRITON_CACHE_DIR"] = os.path.join(fresh, "triton")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(fresh, "inductor")
    env = common.environment(common.module_command("benchmarks.e2e_models", argv))
    cells = plan(args)
    deadline = time.monotonic() + args.time_budget if args.time_budget else None
    if args.precompile:
        from benchmarks import precompile

        # The workers stop at half the budget: the timed pass compiles whatever they left.
        half = time.monotonic() + args.time_budget / 2 if args.time_budget else None
        summary = precompile.warm(precompile_items(cells, args), args.precompile, deadline=half,
                                  device=args.device)
        env["precompile"] = summary
        print(precompile.describe(summary), flush=True)
    records = []
    partial = None if args.no_write else common.output_stem(args.out, env, args.tag, "e2e_models", args.device) \
        + ".partial.jsonl"
    with common.dynamo_limits():
        for name, spec, seq, attn, task in common.progress(cells, "e2e cells"):
            if deadline is not None and time.monotonic() > deadline:
                records.append(dict(model=name, seq=seq, attn=attn, task=task, status="skipped",
                                    error="past --time-budget"))
                continue
            cell_records = run_cell(name, spec, seq, attn, task, args, compile_fn)
            records.extend(cell_records)
            common.append_records(partial, cell_records)
    rows = summarise([r for r in records if "contender" in r])
    print(markdown_table(rows))
    if not args.no_write:
        path = common.write_record(args.out, "e2e_models", env, dict(results=records, summary=rows), args.tag,
                                  args.device)
        plot(rows, path[: -len(".json")] + ".png", f"{env.get('gpu') or args.device}, torch {env['torch']}, "
             f"{args.dtype}, {args.tokens} tokens per step")
        if os.path.exists(partial):  # the JSON holds every record now
            os.remove(partial)
    return records


if __name__ == "__main__":
    main()
