"""Sparse attention: work that grows with what the mask keeps, against FlexAttention and dense SDPA.

    python -m benchmarks.sparse_attention --part window                 # the full window grid
    python -m benchmarks.sparse_attention --part window --seqs 4096,8192 --time-budget 500
    python -m benchmarks.sparse_attention --part window --styles causal,symmetric --providers ours,flex
    python -m benchmarks.sparse_attention --part block_sparse             # 50 % and 90 % sparse, L 4k-16k

Each part is a family of sparsity patterns with its own grid of cells and the same contenders:

* ``ours``: ``flash_inductor.flash_attention`` with the pattern in its own form (``window=``), which
  skips the tiles the pattern hides;
* ``flex``: ``torch.compile``d FlexAttention with a ``BlockMask`` of the same pattern
  (``create_block_mask``, built once per cell, untimed);
* ``sdpa-mask``: dense SDPA with the same pattern as a bool ``attn_mask`` (every score computed);
* ``ours-mask`` (not in the default set): ours with the bool mask, the dense cost of our kernels;
* ``ours-fast`` (window part, not in the default set): ours under the `fast` schedule, whose Δ is
  Flex's (rowsum(dO∘O)) and whose backward is the Gluon one on Hopper.

Part ``window``: bf16, E 128, L = S from 4k to 32k (batch * L = ``--tokens``, heads = 2048 / E),
windows of w keys from 256 to 4k with w <= L, as ``window=(w - 1, 0)`` (a causal sliding window,
``causal`` style) or ``(w, w)`` (``symmetric``).

Part ``block_sparse``: random layouts of 128 x 128 blocks at ``--sparsities`` (0.5, 0.9), L = S
from 4k to 16k, ``block_mask=`` against Flex with the same layout as full blocks
(``benchmarks/block_sparse_attention.py``). A part is a :class:`Part` in ``PARTS``: its cells, its
providers and how each provider attends.

Every step runs back to back for ``--heat-ms`` before it is timed (the H200's clock falls under
load, ``benchmarks/README.md``), then ``do_bench``'s median. Each cell records ms, the effective
TFLOP/s (4·B·H·E per visible score, x3.5 for forward+backward), the fraction of dense tiles our
kernels visit (``flash_inductor.launch.band.visited_tiles`` at 128 x 64 tiles) and, for ``ours``,
the largest difference from ``sdpa-mask``'s output (``ours-fast`` too). The table prints ours' speed-up over each
contender. Records are appended to ``<stem>.partial.jsonl`` as they land; ``--time-budget`` stops
starting cells and records the rest as skipped. ``--kernel-time`` also profiles each step run back
to back (``benchmarks/kernel_time.gpu_busy``): ``kernel_ms``, its kernels' time per call, and
``gpu_busy``. A cell whose do_bench time is well above its kernel time with the GPU often idle was
timed on the host path (whose speed varies with the device's host CPU), not the kernels; the run
prints ours' speed-up by kernel time too. Writes ``sparse_<part>_<gpu>_<date>.json`` and a PNG
under ``--out`` (default ``$OUT``, else /tmp/flash_inductor_out).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

from flash_inductor.text_table import text_table
from benchmarks import block_sparse_attention as block_sparse
from benchmarks.kernel_time import gpu_busy
from benchmarks.common import (DTYPES, MODE_FLOP_FACTOR, append_records, bench_ms, call_recorded, compiled_flex,
                               dynamo_limits, environment, heat, is_fatal, module_command, no_donated_buffers,
                               output_stem, progress, release_memory, tflops)

MODES = ("fwd", "fwd_bwd")
HIDDEN = 2048  # heads * head_dim, as in shared/ANCHORS.md
MIRROR_TILES = (128, 64)  # the tile shape the visited-tile fraction is reported at
KERNEL_TIME_CALLS = 10  # back-to-back steps profiled per cell with --kernel-time


# ----------------------------------------------------------------------------- parts

@dataclasses.dataclass(frozen=True)
class Part:
    """A family of sparsity patterns: its grid, its contenders and how each one attends.

    ``cells(args)`` lists dicts with at least ``seq``, ``mode`` and ``batch``/``heads``;
    ``attention(provider, cell, device)`` returns ``attn(q, k, v) -> out`` with everything
    shape-specific (block masks, bool masks) built there, untimed; ``visible(cell, device)`` is the
    (L, S) bool pattern (``sdpa-mask`` and the check of ours' output); ``visible_count(cell)`` the
    number of scores it keeps (the FLOP count); ``tile_fraction(cell)`` the share of dense tiles
    ours visits."""

    name: str
    providers: tuple[str, ...]
    default_providers: tuple[str, ...]
    cells: Callable
    attention: Callable
    visible: Callable
    visible_count: Callable
    tile_fraction: Callable


def window_pair(cell) -> tuple[int, int]:
    w = cell["window"]
    return (w - 1, 0) if cell["style"] == "causal" else (w, w)


def window_mask_mod(left: int, right: int, seq_q: int, seq_k: int):
    """FlexAttention's mask_mod of ``window=(left, right)`` (FlashAttention's definition)."""
    diagonal = seq_k - seq_q

    def mask_mod(b, h, q_idx, kv_idx):
        rel = kv_idx - (q_idx + diagonal)
        keep = rel == rel  # all True, in the index tensors' shape
        if left >= 0:
            keep = keep & (rel >= -left)
        if right >= 0:
            keep = keep & (rel <= right)
        return keep
    return mask_mod


def _window_cells(args):
    cells = []
    for style in args.styles:
        for seq in args.seqs:
            for w in args.windows:
                if w > seq:
                    continue
                batch = max(1, args.tokens // seq)
                for mode in args.modes:
                    cells.append(dict(part="window", dtype=args.dtype, head_dim=args.head_dim, seq=seq, batch=batch,
                                      heads=max(1, HIDDEN // args.head_dim), window=w, style=style, mode=mode))
    return cells


def _window_visible(cell, device):
    from flash_inductor.launch.band import resolve_band

    return resolve_band(False, 0, window_pair(cell), cell["seq"], cell["seq"]).visible(cell["seq"], cell["seq"],
                                                                                        device)


def _window_visible_count(cell) -> int:
    """Scores the window keeps, row by row (no (L, S) matrix: 1 GiB at 32k)."""
    from flash_inductor.launch.band import resolve_band

    seq = cell["seq"]
    band = resolve_band(False, 0, window_pair(cell), seq, seq)
    rows = torch.arange(seq, dtype=torch.int64)
    first = (rows + band.lower).clamp(min=0) if band.lower is not None else torch.zeros_like(rows)
    last = (rows + band.upper).clamp(max=seq - 1) if band.upper is not None else torch.full_like(rows, seq - 1)
    return int((last - first + 1).clamp(min=0).sum())


def _window_tile_fraction(cell):
    from flash_inductor.launch.band import resolve_band, visited_tiles

    seq = cell["seq"]
    counts = visited_tiles(resolve_band(False, 0, window_pair(cell), seq, seq), seq, seq, *MIRROR_TILES)
    return counts["forward"] / counts["dense"]


def _window_attention(provider, cell, device):
    import flash_inductor

    window = window_pair(cell)
    seq = cell["seq"]
    if provider == "ours":
        return lambda q, k, v: flash_inductor.flash_attention(q, k, v, window=window)
    if provider == "ours-fast":
        # The `fast` schedule: Δ = rowsum(dO∘O), as Flex computes it, and the Gluon backward on Hopper.
        return lambda q, k, v: flash_inductor.flash_attention(q, k, v, window=window, schedule="fast")
    if provider == "flex":
        from torch.nn.attention.flex_attention import create_block_mask
        block_mask = create_block_mask(window_mask_mod(*window, seq, seq), B=None, H=None, Q_LEN=seq, KV_LEN=seq,
                                       device=device)
        flex = compiled_flex()
        return lambda q, k, v: flex(q, k, v, block_mask=block_mask)
    mask = _window_visible(cell, device)
    if provider == "ours-mask":
        return lambda q, k, v: flash_inductor.flash_attention(q, k, v, attn_mask=mask)
    if provider == "sdpa-mask":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    raise ValueError(f"unknown provider {provider!r}")


PARTS = {
    "window": Part("window", providers=("ours", "flex", "sdpa-mask", "ours-mask", "ours-fast"),
                   default_providers=("ours", "flex", "sdpa-mask"), cells=_window_cells,
                   attention=_window_attention, visible=_window_visible, visible_count=_window_visible_count,
                   tile_fraction=_window_tile_fraction),
    # Random block-sparse layouts at 50 % and 90 % sparsity (benchmarks/block_sparse_attention.py).
    "block_sparse": Part("block_sparse", providers=block_sparse.PROVIDERS,
                         default_providers=block_sparse.DEFAULT_PROVIDERS,
                         cells=lambda args: block_sparse.cells(args, HIDDEN),
                         attention=lambda provider, cell, device: block_sparse.attention(provider, cell, device,
                                                                                         compiled_flex),
                         visible=block_sparse.visible, visible_count=block_sparse.visible_count,
                         tile_fraction=block_sparse.tile_fraction),
}


# ----------------------------------------------------------------------------- CLI

def _ints(text):
    return [int(x) for x in text.split(",") if x]


def _names(text):
    return [x for x in text.split(",") if x]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=sorted(PARTS), default="window")
    p.add_argument("--providers", type=_names, default=None, help="default: the part's default set")
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seqs", type=_ints, default=None, help="default: 4k-32k (window), 4k-16k (block_sparse)")
    p.add_argument("--windows", type=_ints, default=[256, 1024, 4096])
    p.add_argument("--styles", type=_names, default=["causal"], help="causal: (w - 1, 0); symmetric: (w, w)")
    block_sparse.add_arguments(p)
    p.add_argument("--modes", type=_names, default=list(MODES))
    p.add_argument("--tokens", type=int, default=32768, help="batch * L")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rep", type=int, default=40)
    p.add_argument("--heat-ms", type=float, default=300.0)
    p.add_argument("--time-budget", type=float, default=None, help="seconds; later cells are recorded as skipped")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=os.environ.get("OUT") or "/tmp/flash_inductor_out")
    p.add_argument("--tag", default=None)
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--kernel-time", action="store_true",
                   help="also profile each step: kernel_ms per call and gpu_busy (the GPU's busy share of a loop)")
    args = p.parse_args(argv)
    args.seqs_given = args.seqs is not None
    args.seqs = args.seqs or [4096, 8192, 16384, 32768]
    part = PARTS[args.part]
    args.providers = args.providers or list(part.default_providers)
    unknown = [x for x in args.providers if x not in part.providers]
    if unknown:
        p.error(f"--part {args.part} has no provider {unknown}; choose from {', '.join(part.providers)}")
    bad = [m for m in args.modes if m not in MODES] + [s for s in args.styles if s not in ("causal", "symmetric")]
    if bad:
        p.error(f"unknown mode or style {bad}")
    return args


# ----------------------------------------------------------------------------- measuring

def run_cell(part, cell, provider, args, device):
    """One record: ms and effective TFLOP/s of ``provider`` on ``cell``, or its error."""
    record = dict(cell, provider=provider, status="ok")
    dtype = DTYPES[cell["dtype"]]
    shape = (cell["batch"], cell["heads"], cell["seq"], cell["head_dim"])
    try:
        q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=cell["mode"] != "fwd")
                   for _ in range(3))
        dout = torch.randn(shape, device=device, dtype=dtype)
        attn = call_recorded(lambda: part.attention(provider, cell, device))
        if cell["mode"] == "fwd":
            def step():
                with torch.no_grad():
                    return attn(q, k, v)
        else:
            def step():
                return torch.autograd.grad(attn(q, k, v), (q, k, v), dout)
        out = call_recorded(step)  # compiles, and fails here rather than inside the timing
        if provider in ("ours", "ours-fast"):
            expected = _reference_output(part, cell, q, k, v, device)
            first = out if cell["mode"] == "fwd" else attn(q, k, v)
            record["max_abs_diff"] = (first.float() - expected.float()).abs().max().item()
        if device == "cuda":
            heat(step, args.heat_ms, synchronize=torch.cuda.synchronize)
            record["ms"] = bench_ms(step, args.warmup, args.rep)
            if args.kernel_time:
                record.update(gpu_busy(step, KERNEL_TIME_CALLS, device))
        else:
            start = time.perf_counter()
            for _ in range(max(1, args.rep)):
                step()
            record["ms"] = (time.perf_counter() - start) * 1e3 / max(1, args.rep)
        flops = 4.0 * cell["batch"] * cell["heads"] * cell["head_dim"] * part.visible_count(cell)
        record["tflops"] = tflops(flops * MODE_FLOP_FACTOR[cell["mode"]], record["ms"])
        record["tile_fraction"] = part.tile_fraction(cell)
    except Exception as exc:  # one failure is one recorded line, never the end of the run
        from benchmarks.common import first_line
        record.update(status="error", error=first_line(exc))
    finally:
        release_memory()
    return record


@torch.no_grad()
def _reference_output(part, cell, q, k, v, device):
    """SDPA with the pattern as a bool mask: what ``ours`` must agree with (rows all see a key)."""
    return F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), attn_mask=part.visible(cell, device))


def run_all(args, partial_path=None, clock=time.monotonic, device=None):
    part = PARTS[args.part]
    device = device or args.device
    grid = [(cell, provider) for cell in part.cells(args) for provider in args.providers]
    deadline = None if args.time_budget is None else clock() + args.time_budget
    records = []
    with dynamo_limits(), no_donated_buffers():
        for cell, provider in progress(grid, args.part):
            if deadline is not None and clock() > deadline:
                records.append(dict(cell, provider=provider, status="skipped", error="--time-budget spent"))
                continue
            records.append(run_cell(part, cell, provider, args, device))
            append_records(partial_path, records[-1:])
            if is_fatal(records[-1]):
                print(f"\nstopping: {records[-1]['error']}; results so far are written", file=sys.stderr)
                break
    return records


# ----------------------------------------------------------------------------- reporting

def _key(record):
    return (record.get("style"), record["mode"], record["seq"], record.get("window"))


def speedups(records, ours="ours", field="ms"):
    """{cell key: {contender: t_contender / t_ours}} for the cells where both ran (``field``: "ms",
    do_bench's time, or "kernel_ms", the kernels' time of ``--kernel-time``)."""
    ok = {(_key(r), r["provider"]): r[field] for r in records if r["status"] == "ok" and r.get(field)}
    result = {}
    for (key, provider), ms in ok.items():
        if provider != ours and (key, ours) in ok:
            result.setdefault(key, {})[provider] = ms / ok[key, ours]
    return result


def format_table(records, providers, ours="ours"):
    ok = {(_key(r), r["provider"]): r for r in records if r["status"] == "ok"}
    keys = sorted({_key(r) for r in records}, key=lambda k: (str(k[0]), k[1], k[2], k[3] or 0))
    others = [p for p in providers if p != ours]
    header = ("style", "mode", "L", "w", "tiles", *(f"{p} ms" for p in providers), *(f"{ours}/{p}" for p in others),
              "diff")
    rows = []
    for key in keys:
        style, mode, seq, window = key
        ours_rec = ok.get((key, ours))
        cells = [f"{ok[key, p]['ms']:.3f}" if (key, p) in ok else "-" for p in providers]
        ratios = [f"{ok[key, p]['ms'] / ours_rec['ms']:.2f}x" if ours_rec and (key, p) in ok else "-" for p in others]
        fraction = next((r["tile_fraction"] for (k, _), r in ok.items() if k == key and "tile_fraction" in r), None)
        diff = ours_rec.get("max_abs_diff") if ours_rec else None
        rows.append((style, mode, seq, window or 0, "-" if fraction is None else f"{fraction:.3f}", *cells, *ratios,
                     "-" if diff is None else f"{diff:.1e}"))
    lines = text_table(rows, header=header, align="<<>", gap=" ")
    failed = [r for r in records if r["status"] == "error"]
    lines += [f"error: {r['provider']} {_key(r)}: {r['error']}" for r in failed]
    skipped = sum(r["status"] == "skipped" for r in records)
    if skipped:
        lines.append(f"{skipped} cells skipped (--time-budget spent)")
    lines.append("ours/X: X's time over ours (> 1: ours is faster); tiles: share of dense tiles ours visits "
                 f"at {MIRROR_TILES[0]}x{MIRROR_TILES[1]}; diff: max |ours - sdpa-mask| of the forward")
    return "\n".join(lines)


def plot(records, path, title=""):
    """Speed-up of ours over each contender against L: one subplot per (style, mode), one line per
    (window, contender); a second row with ``ours-fast`` as the reference where it ran."""
    import matplotlib
    from matplotlib.figure import Figure

    references = [ours for ours in ("ours", "ours-fast") if speedups(records, ours=ours)]
    if not references:
        return None
    panels = sorted({(k[0], k[1]) for k in speedups(records, ours=references[0])}, key=str)
    fig = Figure(figsize=(5.5 * len(panels), 4.2 * len(references)))
    axes = fig.subplots(len(references), len(panels), squeeze=False)
    styles = {"flex": "-", "sdpa-mask": "--", "ours-mask": ":"}
    colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    for row, ours in zip(axes, references):
        ratios = speedups(records, ours=ours)
        windows = sorted({k[3] for k in ratios}, key=lambda w: w or 0)
        for ax, (style, mode) in zip(row, panels):
            for color, window in zip(colors * 4, windows):
                for contender, linestyle in styles.items():
                    pts = sorted((k[2], r[contender]) for k, r in ratios.items()
                                 if (k[0], k[1], k[3]) == (style, mode, window) and contender in r)
                    if pts:
                        ax.plot(*zip(*pts), linestyle, marker="o", color=color, label=f"w={window} vs {contender}")
            ax.axhline(1.0, color="grey", linewidth=0.8)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log", base=2)
            ax.set_title(f"{ours}: {style} window, {mode}", fontsize=9)
            ax.set_xlabel("L = S")
            ax.set_ylabel(f"speed-up of {ours} (t_other / t_{ours})")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv=None):
    args = parse_args(argv)
    env = environment(module_command("benchmarks.sparse_attention", argv))
    stem = output_stem(args.out, env, args.tag, prefix=f"sparse_{args.part}", device=args.device)
    os.makedirs(args.out, exist_ok=True)
    partial = stem + ".partial.jsonl"
    if os.path.exists(partial):
        os.remove(partial)
    records = run_all(args, partial_path=partial)
    print(format_table(records, args.providers))
    by_kernels = speedups(records, field="kernel_ms")
    for key, ratios in sorted(by_kernels.items(), key=str):
        print(f"by kernel time {' '.join(map(str, key))}: " + ", ".join(f"ours/{p} {r:.2f}x" for p, r in ratios.items()))
    payload = dict(header=env, part=args.part, providers=args.providers, records=records,
                   speedups={" ".join(map(str, k)): v for k, v in speedups(records).items()},
                   speedups_by_kernel_time={" ".join(map(str, k)): v for k, v in by_kernels.items()})
    with open(stem + ".json", "w") as f:
        json.dump(payload, f, indent=1)
    files = [stem + ".json"]
    if not args.no_plot:
        try:
            png = plot(records, stem + ".png", f"{env['gpu'] or args.device}  torch {env['torch']}  "
                                               f"triton {env['triton']}  {env['date']}")
            files += [png] if png else []
        except ImportError as exc:
            print(f"no plot ({exc})", file=sys.stderr)
    os.remove(partial)
    print("wrote " + ", ".join(files))
    return records


if __name__ == "__main__":
    main()
