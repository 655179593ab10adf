#!/usr/bin/env python
"""Block-sparse attention: flash_inductor's ``block_mask=`` against FlexAttention with the same layout.

Each cell draws one random layout of 128 x 128 blocks (``--block``) at a given sparsity (the
fraction of blocks skipped), shared by every batch element and head, and times:

    ours        flash_attention(q, k, v, block_mask=BlockSparseLayout(block_map))
    flex        torch.compile(flex_attention) with BlockMask.from_kv_blocks of the same map, every
                computed block a full block (no mask_mod runs), Flex's best case (on CUDA; eager
                elsewhere)
    ours-dense  flash_attention without a layout: the dense work the layout skips
    sdpa-mask   SDPA (its default backend choice) with the layout's dense element mask

Figures are ``triton.testing.do_bench`` medians after ``--heat-ms`` of back-to-back steps; the
table prints time and each provider's speed relative to ours (flex / ours > 1: ours is faster).
Every cell also records ours' largest difference from Flex's output (same layout, same inputs).

    python -m benchmarks.block_sparse_attention                        # bf16, E 128, L 4k-16k, 50/90 %
    python -m benchmarks.block_sparse_attention --seqs 4096 --modes fwd --time-budget 120

Writes <out>/block_sparse_<gpu>_<date>[_<tag>].json (+ .png with matplotlib); with
--time-budget it stops starting cells after that many seconds, records the rest as skipped, and
every finished record is also appended to <stem>.partial.jsonl as it lands.

``run_block_sparse(args)`` is the whole run for callers that parse their own arguments
(``add_block_sparse_args`` adds the flags to their parser).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from benchmarks.common import (DTYPES, attention_flops, bench_ms, call_recorded, dynamo_limits, environment,
                               first_line, heat, is_fatal, module_command, no_donated_buffers, output_stem,
                               release_memory, tflops)

PROVIDERS = ("ours", "flex", "ours-dense", "sdpa-mask")
MODES = ("fwd", "fwd_bwd")


def _csv(kind):
    return lambda text: [kind(x) for x in text.split(",") if x]


def add_block_sparse_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    default_out = os.environ.get("OUT", "/tmp/flash_inductor_out")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seqs", type=_csv(int), default=[4096, 8192, 16384], help="L = S, comma-separated")
    p.add_argument("--sparsities", type=_csv(float), default=[0.5, 0.9],
                   help="fractions of blocks skipped, comma-separated")
    p.add_argument("--block", type=int, default=128, help="the layout's block size (both axes)")
    p.add_argument("--modes", type=_csv(str), default=list(MODES))
    p.add_argument("--providers", type=_csv(str), default=["ours", "flex", "ours-dense"])
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rep", type=int, default=40)
    p.add_argument("--heat-ms", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-budget", type=float, default=None, help="seconds; cells left then are recorded as skipped")
    p.add_argument("--out", default=default_out)
    p.add_argument("--tag", default=None)
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--no-plot", action="store_true")
    return p


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    args = add_block_sparse_args(p).parse_args(argv)
    unknown = sorted(set(args.providers) - set(PROVIDERS)) + sorted(set(args.modes) - set(MODES))
    if unknown:
        p.error(f"unknown providers/modes {unknown}; choose from {PROVIDERS} and {MODES}")
    return args


# ----------------------------------------------------------------------------- layouts and providers

def random_block_map(seq, block, sparsity, seed, device):
    """(1, 1, NB, NB) bool, each block computed with probability 1 - sparsity."""
    blocks = -(-seq // block)
    g = torch.Generator().manual_seed(seed)
    return (torch.rand((1, 1, blocks, blocks), generator=g) >= sparsity).to(device)


def flex_block_mask(block_map, block, seq):
    """The same layout as a Flex BlockMask whose computed blocks are all full blocks, so the compiled
    kernel never runs its mask_mod. The mask_mod states the layout all the same: Flex's eager path
    (CPU) ignores the block lists and applies only the mask_mod."""
    from torch.nn.attention.flex_attention import BlockMask

    dense = block_map.to(torch.int32)
    num = dense.sum(-1, dtype=torch.int32)
    idx = torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)
    table = block_map[0, 0]

    def in_layout(b, h, q_idx, kv_idx):
        return table[q_idx // block, kv_idx // block]

    return BlockMask.from_kv_blocks(torch.zeros_like(num), idx, num, idx, BLOCK_SIZE=block, mask_mod=in_layout,
                                    seq_lengths=(seq, seq))


_FLEX = {}


def _flex(compiled: bool):
    if compiled not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention
        _FLEX[compiled] = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention
    return _FLEX[compiled]


def make_provider(provider, block_map, block, seq, device):
    import flash_inductor

    if provider == "ours":
        layout = flash_inductor.BlockSparseLayout(block_map, block)
        return lambda q, k, v: flash_inductor.flash_attention(q, k, v, block_mask=layout)
    if provider == "ours-dense":
        return lambda q, k, v: flash_inductor.flash_attention(q, k, v)
    if provider == "flex":
        mask = flex_block_mask(block_map, block, seq)
        flex = _flex(torch.device(device).type == "cuda")
        return lambda q, k, v: flex(q, k, v, block_mask=mask)
    if provider == "sdpa-mask":
        dense = flash_inductor.BlockSparseLayout(block_map, block).to_dense(seq, seq)
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    raise ValueError(f"unknown provider {provider!r}")


def _time_ms(fn, args, device):
    if torch.device(device).type == "cuda":
        heat(fn, args.heat_ms, synchronize=torch.cuda.synchronize)
        return bench_ms(fn, args.warmup, args.rep)
    times = []  # CPU (the smoke test): a plain median
    for _ in range(max(args.rep, 1)):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _step(attn, mode, q, k, v, dout):
    if mode == "fwd":
        return lambda: attn(q, k, v)
    return lambda: torch.autograd.grad(attn(q, k, v), (q, k, v), dout)


def run_cell(cell, args):
    """Every provider on one (seq, sparsity, mode): a list of records."""
    seq, sparsity, mode = cell["seq"], cell["sparsity"], cell["mode"]
    device, dtype = args.device, DTYPES[args.dtype]
    block_map = random_block_map(seq, args.block, sparsity, args.seed + seq, device)
    density = float(block_map.float().mean())
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    shape = (args.batch, args.heads, seq, args.head_dim)
    q, k, v, dout = (torch.randn(shape, generator=g).to(device=device, dtype=dtype) for _ in range(4))
    q, k, v = (t.requires_grad_(mode != "fwd") for t in (q, k, v))
    # The work actually done: the computed blocks' share of the dense FLOPs.
    flops = attention_flops(args.batch, args.heads, seq, seq, args.head_dim, False, mode) * density
    records, outputs = [], {}
    for provider in args.providers:
        rec = dict(section="block_sparse", provider=provider, dtype=args.dtype, head_dim=args.head_dim, seq=seq,
                   batch=args.batch, heads=args.heads, block=args.block, sparsity=sparsity, density=density,
                   mode=mode, status="ok", ms=None, tflops=None, error=None)
        try:
            attn = make_provider(provider, block_map, args.block, seq, device)
            with torch.no_grad():
                outputs[provider] = call_recorded(lambda: attn(q, k, v)).float()
            fn = _step(attn, mode, q, k, v, dout)
            rec["ms"] = call_recorded(lambda: _time_ms(fn, args, device))
            rec["tflops"] = tflops(flops, rec["ms"]) if provider != "ours-dense" else tflops(flops / density, rec["ms"])
        except Exception as exc:
            rec.update(status="error", error=first_line(exc))
        records.append(rec)
        release_memory()
        if is_fatal(rec):
            break
    if "ours" in outputs and "flex" in outputs:
        diff = float((outputs["ours"] - outputs["flex"]).abs().max())
        for rec in records:
            if rec["provider"] == "ours":
                rec["max_abs_diff_vs_flex"] = diff
    return records


def cells(args):
    return [dict(seq=s, sparsity=p, mode=m) for s in args.seqs for p in args.sparsities for m in args.modes]


def run_block_sparse(args, clock=time.monotonic, partial_path=None):
    """Run every cell (within --time-budget), print the table, write JSON (+ PNG); returns the records."""
    env = environment(module_command("benchmarks.block_sparse_attention"))
    stem = output_stem(args.out, env, args.tag, prefix="block_sparse", device=args.device)
    if partial_path is None and not args.no_write:
        partial_path = stem + ".partial.jsonl"
    deadline = None if args.time_budget is None else clock() + args.time_budget
    records = []
    with dynamo_limits(), no_donated_buffers():
        for cell in cells(args):
            if deadline is not None and clock() > deadline:
                records += [dict(section="block_sparse", provider=p, **cell, status="skipped",
                                 error="--time-budget spent") for p in args.providers]
                continue
            new = run_cell(cell, args)
            records += new
            if partial_path:
                os.makedirs(os.path.dirname(partial_path) or ".", exist_ok=True)
                with open(partial_path, "a") as f:
                    f.writelines(json.dumps(r) + "\n" for r in new)
            if any(is_fatal(r) for r in new):
                break
    print(format_table(records))
    if not args.no_write:
        os.makedirs(args.out, exist_ok=True)
        with open(stem + ".json", "w") as f:
            json.dump({"header": env, "records": records}, f, indent=1)
        print(f"wrote {stem}.json")
        if partial_path and os.path.exists(partial_path):
            os.remove(partial_path)
        if not args.no_plot:
            try:
                print(f"wrote {plot(records, stem + '.png', env.get('gpu') or args.device)}")
            except Exception as exc:  # matplotlib missing or headless trouble: the JSON has it all
                print(f"no plot ({first_line(exc)})", file=sys.stderr)
    return records


# ----------------------------------------------------------------------------- table and plot

def ratios(records):
    """{(seq, sparsity, mode): {provider: provider_ms / ours_ms}} over the cells ours measured."""
    ours = {(r["seq"], r["sparsity"], r["mode"]): r["ms"] for r in records
            if r["provider"] == "ours" and r["status"] == "ok"}
    out = {}
    for r in records:
        key = (r["seq"], r["sparsity"], r["mode"])
        if r["status"] == "ok" and key in ours:
            out.setdefault(key, {})[r["provider"]] = r["ms"] / ours[key]
    return out


def format_table(records):
    providers = list(dict.fromkeys(r["provider"] for r in records))
    by_cell = {}
    for r in records:
        by_cell.setdefault((r["seq"], r["sparsity"], r["mode"]), {})[r["provider"]] = r
    rel = ratios(records)
    head = f"{'seq':>6} {'sparsity':>8} {'mode':>8} " + " ".join(f"{p + ' ms':>14}" for p in providers)
    head += " " + " ".join(f"{p + '/ours':>16}" for p in providers if p != "ours")
    lines = [head]
    for key, row in by_cell.items():
        seq, sparsity, mode = key
        cols = []
        for p in providers:
            r = row.get(p)
            cols.append(f"{r['ms']:>14.3f}" if r and r["status"] == "ok" else f"{(r or {}).get('status', '-'):>14}")
        for p in providers:
            if p != "ours":
                value = rel.get(key, {}).get(p)
                cols.append(f"{value:>16.2f}" if value is not None else f"{'-':>16}")
        lines.append(f"{seq:>6} {sparsity:>8.2f} {mode:>8} " + " ".join(cols))
    return "\n".join(lines)


def plot(records, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = sorted({r["mode"] for r in records})
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4), squeeze=False)
    rel = ratios(records)
    for ax, mode in zip(axes[0], modes):
        for provider in sorted({p for cell in rel.values() for p in cell} - {"ours"}):
            for sparsity in sorted({k[1] for k in rel}):
                keys = sorted(k for k in rel if k[2] == mode and k[1] == sparsity and provider in rel[k])
                if keys:
                    ax.plot([k[0] for k in keys], [rel[k][provider] for k in keys], marker="o",
                            label=f"{provider}, {sparsity:.0%} sparse")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("L = S")
        ax.set_ylabel("time / ours (> 1: ours faster)")
        ax.set_title(f"{mode}")
        ax.legend(fontsize=7)
    fig.suptitle(f"block-sparse attention, {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None):
    return run_block_sparse(parse_args(argv))


if __name__ == "__main__":
    main()
