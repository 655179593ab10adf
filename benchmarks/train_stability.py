"""Training through an fp16 overflow: eager mixed precision fails, flash_inductor's compile does not.

    python benchmarks/train_stability.py                  # GPU: five runs, seq 2048
    python benchmarks/train_stability.py --seq 8192 --batch 4
    python benchmarks/train_stability.py --quick --device cpu   # a few minutes on a CPU

A small GPT whose attention is written the way nanoGPT's slow path writes it,

    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
    att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
    y = F.softmax(att, dim=-1) @ v

is trained, with the same seed and the same data, five ways: fp32 eager; fp16 eager under
``torch.autocast`` with a ``GradScaler``; fp16 compiled with ``torch.compile(model,
backend=flash_inductor.backend)`` (same autocast and scaler); bf16 eager and bf16 compiled.

The setting: a large component shared by every query and key. Trained transformers grow
such components -- "massive activations" (Sun et al., 2024) act as fixed biases that every
token's query and key pick up, and attention logits grow without QK normalisation (Dehghani
et al., 2023; Wortsman et al., 2023); GPT-2 fp16 training overflowed in QKᵀ, which is why
Hugging Face's GPT-2 has ``reorder_and_upcast_attn``. Here it is made explicit and
controllable: the last coordinate of every query and key head is a constant ``a``
(``--qk-offset``, default 256), so every logit gains ``a² · scale`` (65536 / sqrt(d) at the
default). Softmax is shift-invariant, so in exact arithmetic, and in fp32, this changes
nothing: the fp32 run is the same model as without it. But ``q @ kᵀ`` now holds values
around a² = 65536, past fp16's largest finite value, 65504:

* fp16 eager: every forward gives inf - inf = NaN, the GradScaler skips every step and halves
  its scale each time until it is 0 -- the run never trains;
* bf16 eager: no overflow, but QKᵀ rounded to bf16 at 65536 has a spacing of 512, which wipes
  out the logit differences (~10), so attention can no longer select anything;
* flash_inductor (fp16 and bf16): QKᵀ is accumulated in fp32 from the 16-bit q and k, where
  65536 + x keeps x to 0.008, and the runs track fp32.

``--qk-offset 0`` is the control: without the shared component all five runs train alike.

The task (generated here, no download): associative recall across a long gap. Each sequence
binds ``--pairs`` random keys to random values, then

    [context: key value key value ...][filler ... ~seq tokens ...][queries: every key once, with its value]

The context (``--context`` tokens) repeats the bindings, so the recall mechanism is learned
from many nearby examples; the queries come after ``seq - context - 2 * pairs`` filler tokens,
so answering them means attending thousands of tokens back. The loss is the cross-entropy of
every value (context and queries); the query part alone is logged as the long-range recall
loss. A key's first appearance is unpredictable, so the best achievable loss is a known,
non-zero number (printed), and "within 2% of fp32" compares runs near it. Each token's
embedding also receives the previous token's (a token shift, as in RWKV), so one attention
layer can bind a value to its key without positional embeddings.

The 2% verdict is only given when fp32 learned: its final loss must be a quarter of the way
from chance (ln of the number of values) down to the best achievable loss, since near chance a
run that learned nothing is within 2% too. Otherwise (too few ``--steps``, say) the flash runs
are checked for finiteness only, and the output says so. Exit status: 0 when compared and every
flash run is within 2%; 1 when one is not, or is not finite; 3 when nothing could be compared.

Writes ``train_stability_<device>_<date>[_tag].json`` (per-step loss, scaler scale, non-finite
events, final losses and the verdict) and ``.png`` (loss curves) to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import json
import math
import pathlib
import re
import sys
import time
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from flash_inductor.text_table import text_table

RUNS = ("fp32_eager", "fp16_eager", "fp16_flash", "bf16_eager", "bf16_flash")
TOLERANCE = 0.02  # the flash_inductor runs' final loss must be within 2% of fp32's
# fp32 must have gone this fraction of the way from chance loss to the best achievable one before
# any run is compared with it: near chance, "within 2%" holds for runs that learned nothing.
LEARNED_FRACTION = 0.25
NOT_COMPARED = 3  # exit status when fp32 learned too little, and only finiteness was checked


# ------------------------------------------------------------------------------------------
# The task
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Task:
    """Associative recall with a long gap (layout in the module docstring)."""

    seq: int
    pairs: int  # (key, value) bindings per sequence; every key token is bound in every sequence
    context: int  # tokens of (key, value) pairs at the start
    values: int = 64
    fillers: int = 64

    @property
    def keys(self) -> int:
        return self.pairs

    @property
    def vocab(self) -> int:
        return self.keys + self.values + self.fillers

    @property
    def gap(self) -> int:
        """Filler tokens between the context and the queries: the distance recall has to span."""
        return self.seq - self.context - 2 * self.pairs

    def floor(self) -> float:
        """Expected loss of the best predictor: ln(values) on a key's first appearance (its value is
        still unknown), 0 afterwards; averaged over the answered positions."""
        n, draws = self.pairs, self.context // 2
        unseen = (1 - 1 / n) ** draws  # chance that a key never appears in the context
        first_appearances = n * (1 - unseen) + n * unseen  # in the context, or else at its query
        return math.log(self.values) * first_appearances / (draws + n)

    def batch(self, size: int, step: int, seed: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens (B, T), targets (B, T)): targets are the value due after each key, -100 elsewhere."""
        gen = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + step)
        keys = torch.rand(size, self.keys, generator=gen).argsort(dim=1)[:, : self.pairs]  # distinct keys
        values = torch.randint(self.keys, self.keys + self.values, (size, self.pairs), generator=gen)
        drawn = torch.randint(0, self.pairs, (size, self.context // 2), generator=gen)
        asked = torch.rand(size, self.pairs, generator=gen).argsort(dim=1)  # every key once, in random order
        filler = torch.randint(self.keys + self.values, self.vocab, (size, self.gap), generator=gen)

        def pairs_of(which):
            return torch.stack([keys.gather(1, which), values.gather(1, which)], dim=2).flatten(1)

        tokens = torch.cat([pairs_of(drawn), filler, pairs_of(asked)], dim=1)
        targets = torch.full_like(tokens, -100)
        key_positions = torch.cat([torch.arange(0, self.context, 2),
                                   torch.arange(self.seq - 2 * self.pairs, self.seq, 2)])
        # The logits at a key's position predict the next token: its value.
        targets[:, key_positions] = tokens[:, key_positions + 1]
        return tokens.to(device), targets.to(device)

    def query_mask(self) -> torch.Tensor:
        """Target positions of the queries, which sit ``gap`` tokens after the context."""
        mask = torch.zeros(self.seq, dtype=torch.bool)
        mask[self.seq - 2 * self.pairs::2] = True
        return mask


# ------------------------------------------------------------------------------------------
# The model
# ------------------------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention (slow path), plus the shared query/key component of the setting."""

    def __init__(self, width: int, heads: int, max_seq: int, qk_offset: float):
        super().__init__()
        self.heads, self.qk_offset = heads, qk_offset
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)
        self.register_buffer("bias", torch.tril(torch.ones(max_seq, max_seq)).view(1, 1, max_seq, max_seq),
                             persistent=False)

    def _with_offset(self, t: torch.Tensor) -> torch.Tensor:
        # The last head coordinate is the constant a: q . k gains a^2 in every entry.
        if not self.qk_offset:
            return t
        return torch.cat([t[..., :-1], torch.full_like(t[..., -1:], self.qk_offset)], dim=-1)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        q, k = self._with_offset(q), self._with_offset(k)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = att @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, width, heads, max_seq, qk_offset):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads, max_seq, qk_offset)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab, width, heads, layers, max_seq, qk_offset):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.embed_previous = nn.Embedding(vocab, width)  # token shift: binds a value to its key
        self.blocks = nn.ModuleList([Block(width, heads, max_seq, qk_offset) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, tokens, targets, query_mask):
        """(loss over every answered position, loss over the queries only)."""
        previous = F.pad(tokens[:, :-1], (1, 0))
        x = self.embed(tokens) + self.embed_previous(previous)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x)).float()
        losses = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-100, reduction="none")
        answered = targets != -100
        loss = losses.sum() / answered.sum()
        # A multiply, not losses[:, query_mask]: boolean indexing would break the compiled graph.
        query_loss = (losses * query_mask).sum() / (query_mask.sum() * losses.shape[0])
        return loss, query_loss


# ------------------------------------------------------------------------------------------
# Training
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class RunLog:
    name: str
    loss: list = dataclasses.field(default_factory=list)  # None where non-finite
    query_loss: list = dataclasses.field(default_factory=list)  # the long-range queries alone
    scale: list = dataclasses.field(default_factory=list)  # GradScaler scale after the step (fp16 runs)
    nonfinite_steps: list = dataclasses.field(default_factory=list)  # steps whose loss or grads were not finite
    skipped_steps: int = 0
    seconds: float = 0.0
    first_step_seconds: float = 0.0  # includes compilation for the flash runs
    final_loss: Optional[float] = None  # mean loss of the last 10% of steps (None if any was non-finite)
    final_query_loss: Optional[float] = None
    rewritten_sites: Optional[int] = None  # flash runs: attention sites flash_inductor's pass rewrote
    error: Optional[str] = None


def _dtype_of(run: str) -> Optional[torch.dtype]:
    return {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}[run.split("_")[0]]


def _lr(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _grads_finite(model) -> bool:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return bool(torch.stack([g.isfinite().all() for g in grads]).all()) if grads else True


def _fresh_rewrite(enabled: bool):
    """The first compile without AOTAutograd's cache: on a hit (the same model compiled by an
    earlier run) Inductor skips the pre-grad passes, so the report would count 0 rewritten sites
    although the cached graph has them. Inductor's own graph cache still applies."""
    if not enabled:
        return contextlib.nullcontext()
    return torch._functorch.config.patch(enable_autograd_cache=False)


def train(run: str, initial: nn.Module, task: Task, args, progress) -> RunLog:
    import flash_inductor

    log = RunLog(run)
    device = args.device
    model = copy.deepcopy(initial).to(device)
    torch.manual_seed(args.seed)
    step_model = torch.compile(model, backend=flash_inductor.backend) if run.endswith("flash") else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    amp_dtype = _dtype_of(run)
    scaler = torch.amp.GradScaler(device.split(":")[0], enabled=amp_dtype == torch.float16)
    query_mask = task.query_mask().to(device=device, dtype=torch.float32)
    start = time.perf_counter()
    for step in progress(range(args.steps), run):
        for group in optimizer.param_groups:
            group["lr"] = _lr(step, args.steps, args.lr, args.warmup)
        tokens, targets = task.batch(args.batch, step, args.seed, device)
        with torch.autocast(device.split(":")[0], dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None), \
                _fresh_rewrite(step == 0 and run.endswith("flash")):
            loss, query_loss = step_model(tokens, targets, query_mask)
        if step == 0 and run.endswith("flash"):
            log.rewritten_sites = flash_inductor.last_report().rewritten
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        finite = bool(loss.isfinite()) and _grads_finite(model)
        if finite:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if amp_dtype == torch.float16:
            scaler.step(optimizer)  # skips the update itself when the unscaled grads are not finite
            scaler.update()
        elif finite:
            optimizer.step()
        # Without a scaler (fp32, bf16) a non-finite step is skipped the same way the scaler skips one.
        log.skipped_steps += not finite
        optimizer.zero_grad(set_to_none=True)
        value, query_value = loss.item(), query_loss.item()
        log.loss.append(value if math.isfinite(value) else None)
        log.query_loss.append(query_value if math.isfinite(query_value) else None)
        log.scale.append(scaler.get_scale() if scaler.is_enabled() else None)
        if not finite:
            log.nonfinite_steps.append(step)
        if step == 0:
            log.first_step_seconds = time.perf_counter() - start
    log.seconds = time.perf_counter() - start
    log.final_loss, log.final_query_loss = (_final(values, args.steps) for values in (log.loss, log.query_loss))
    return log


def _final(values: list, steps: int) -> Optional[float]:
    window = values[-max(1, steps // 10):]
    return None if not window or any(v is None for v in window) else sum(window) / len(window)


# ------------------------------------------------------------------------------------------
# Output
# ------------------------------------------------------------------------------------------


def learned_below(task: Task) -> float:
    """The final loss fp32 must reach before other runs are compared with it: LEARNED_FRACTION of
    the way from chance (a uniform guess among the values) down to the best achievable loss."""
    chance = math.log(task.values)
    return chance - LEARNED_FRACTION * (chance - task.floor())


def baseline_record(ref: Optional[RunLog], task: Task) -> dict:
    """Whether the fp32 run learned, with the numbers that say so."""
    final = None if ref is None else ref.final_loss
    threshold = learned_below(task)
    return dict(run="fp32_eager", present=ref is not None, final_loss=final, chance_loss=math.log(task.values),
                learned_below=threshold, learned=final is not None and final <= threshold)


def _finite(log: RunLog) -> bool:
    """Every step's loss finite. A gradient overflow that the GradScaler skipped (fp16) is not a
    failure: it is the scaler's job, and the table counts those steps."""
    return log.error is None and bool(log.loss) and all(value is not None for value in log.loss)


def verdict(logs: dict[str, RunLog], task: Task) -> dict:
    """Each run's final loss against fp32's, within TOLERANCE (relative), but only when fp32
    learned: near chance loss a run that learned nothing is within 2% too. Every run is also
    checked for finiteness (no non-finite loss or gradient, no error), which needs no baseline."""
    baseline = baseline_record(logs.get("fp32_eager"), task)
    runs = {}
    for name, log in logs.items():
        if name == "fp32_eager":
            continue
        record = dict(final_loss=log.final_loss, finite=_finite(log))
        if baseline["learned"]:
            ref_loss = baseline["final_loss"]
            gap = None if log.final_loss is None else abs(log.final_loss - ref_loss) / ref_loss
            record.update(relative_gap=gap, within_2pct=gap is not None and gap <= TOLERANCE)
        runs[name] = record
    return dict(compared=baseline["learned"], baseline=baseline, runs=runs)


def verdict_lines(result: dict) -> list[str]:
    """The flash runs' verdict, saying what was compared and what was only checked."""
    flash = {name: record for name, record in result["runs"].items() if name.endswith("flash")}
    baseline = result["baseline"]
    if result["compared"]:
        return ["flash_inductor within 2% of fp32: " + ", ".join(
            f"{name} {'yes' if record['within_2pct'] else 'NO'}" for name, record in flash.items())]
    if not baseline["present"]:
        why = "no fp32_eager run"
    elif baseline["final_loss"] is None:
        why = "the fp32_eager run did not finish with a finite loss"
    else:
        why = (f"fp32_eager ended at {baseline['final_loss']:.4f}, not below {baseline['learned_below']:.4f} "
               f"(chance {baseline['chance_loss']:.4f}): it learned too little to compare against")
    return [f"not compared with fp32: {why}; more --steps, or the default --quick config, learn",
            "checked finiteness only: " + ", ".join(
                f"{name} {'finite' if record['finite'] else 'NOT finite'}" for name, record in flash.items())]


def exit_code(result: dict) -> int:
    """0: compared with a baseline that learned, and every flash run is within 2% of it; 1: a flash
    run is not (or is not finite, or there is none); 3: no comparison could be made, and the flash
    runs were only checked for finiteness (which they passed)."""
    flash = [record for name, record in result["runs"].items() if name.endswith("flash")]
    if not flash or not all(record["finite"] for record in flash):
        return 1
    if not result["compared"]:
        return NOT_COMPARED
    return 0 if all(record["within_2pct"] for record in flash) else 1


def summary_lines(logs: dict[str, RunLog], task: Task) -> list[str]:
    ref = logs.get("fp32_eager")
    rows = []
    for name, log in logs.items():
        final = "NaN" if log.final_loss is None else f"{log.final_loss:.4f}"
        query = "NaN" if log.final_query_loss is None else f"{log.final_query_loss:.4f}"
        gap = ("" if ref is None or ref.final_loss is None or log.final_loss is None
               else f"{100 * (log.final_loss - ref.final_loss) / ref.final_loss:+.1f}%")
        scale = "" if log.scale[-1:] in ([], [None]) else f"{log.scale[-1]:.3g}"
        sites = "" if log.rewritten_sites is None else str(log.rewritten_sites)
        rows.append((name, final, gap, query, len(log.nonfinite_steps), scale, sites, f"{log.seconds:.1f}",
                     f"ERROR {log.error}" if log.error else ""))
    header = ("run", "final loss", "vs fp32", "query loss", "non-finite steps", "last scale", "sites", "seconds", "")
    lines = text_table(rows, header=header, align="<>>>>>>><")
    lines.append(f"best achievable loss: {task.floor():.4f} (queries: 0); chance: {math.log(task.values):.4f}; "
                 f"recall gap: {task.gap} tokens; sites = attention sites rewritten by flash_inductor")
    return lines


def plot(logs: dict[str, RunLog], path: pathlib.Path, title: str) -> Optional[pathlib.Path]:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    fig = Figure(figsize=(8, 8))
    ax_loss, ax_query, ax_scale = fig.subplots(3, 1, sharex=True, height_ratios=(3, 2, 1))
    styles = {"fp32_eager": ("black", "-"), "fp16_eager": ("tab:red", "--"), "fp16_flash": ("tab:red", "-"),
              "bf16_eager": ("tab:blue", "--"), "bf16_flash": ("tab:blue", "-")}
    for name, log in logs.items():
        color, style = styles.get(name, ("grey", ":"))
        steps = range(len(log.loss))
        # fp32 is drawn wide and underneath: the runs that track it leave it showing on both sides.
        width, order = (2.8, 1) if name == "fp32_eager" else (1.2, 2)
        for ax, values in ((ax_loss, log.loss), (ax_query, log.query_loss)):
            ax.plot(steps, [math.nan if v is None else v for v in values], style, color=color, label=name, lw=width,
                    zorder=order)
        if log.nonfinite_steps:
            ax_loss.plot(log.nonfinite_steps, [0] * len(log.nonfinite_steps), "|", color=color, ms=6)
        if any(s is not None for s in log.scale):
            ax_scale.semilogy(steps, [math.nan if s in (None, 0) else s for s in log.scale], style, color=color, label=name)
    ax_loss.set_ylabel("training loss")
    ax_loss.legend(fontsize=8)
    ax_loss.set_title(title, fontsize=9)
    ax_loss.text(0.01, 0.02, "ticks at 0: steps with a non-finite loss or gradient", transform=ax_loss.transAxes, fontsize=7)
    ax_query.set_ylabel("long-range queries")
    ax_scale.set_ylabel("GradScaler scale")
    ax_scale.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    return path


# ------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true",
                   help="small model, sequence and task that fp32 still learns: a CPU run of a few minutes")
    p.add_argument("--steps", type=int, help="training steps (default 400; 200 with --quick)")
    p.add_argument("--seq", type=int, help="sequence length (default 2048; 128 with --quick)")
    p.add_argument("--batch", type=int, help="sequences per step (default 16)")
    p.add_argument("--width", type=int, help="model width (default 256; 64 with --quick)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--pairs", type=int, help="key-value bindings per sequence (default 16; 4 with --quick)")
    p.add_argument("--context", type=int, help="tokens of repeated bindings at the start (default seq / 4; "
                                               "seq / 2 with --quick)")
    p.add_argument("--qk-offset", type=float, default=256.0,
                   help="shared query/key component a (logits + a^2 * scale); 0 = control run")
    p.add_argument("--lr", type=float, help="peak learning rate (default 2e-3; 1e-2 with --quick)")
    p.add_argument("--warmup", type=int, help="warm-up steps (default 30; 10 with --quick)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {','.join(RUNS)}")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tag")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    quick = args.quick
    # --quick: fp32 learns the recall (loss ~4.9 -> below 1, against chance 4.16) in ~100 steps
    # with four bindings and a short warm-up, and reaches the floor by 200, where runs can be
    # compared (mid-descent a run a few steps behind is far from 2%); eight bindings at seq 256
    # had not left chance after 40.
    defaults = dict(steps=(200, 400), seq=(128, 2048), batch=(16, 16), width=(64, 256), pairs=(4, 16),
                    lr=(1e-2, 2e-3), warmup=(10, 30))
    for name, (small, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, small if quick else full)
    if quick and args.heads == 4:
        args.heads = 2
    args.runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    unknown = [r for r in args.runs if r not in RUNS]
    if unknown:
        p.error(f"--runs: unknown {unknown}; choose from {','.join(RUNS)}")
    if args.context is None:
        args.context = args.seq // 2 if quick else args.seq // 4
    args.context -= args.context % 2
    if args.context + 2 * args.pairs > args.seq or args.context < 2:
        p.error(f"--seq {args.seq} is too short for a context of {args.context} tokens and {args.pairs} queries")
    return args


def _progress(disabled: bool):
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if disabled or tqdm is None:
        return lambda items, name: items
    return lambda items, name: tqdm(items, desc=name, unit="step", dynamic_ncols=True, leave=False)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("CUDA is not available; use --device cpu.")
        return 2
    task = Task(seq=args.seq, pairs=args.pairs, context=args.context)
    torch.manual_seed(args.seed)
    initial = GPT(task.vocab, args.width, args.heads, args.layers, args.seq, args.qk_offset)
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"train_stability on {device_name}: seq {args.seq}, batch {args.batch}, width {args.width}, "
          f"{args.heads} heads, {args.layers} layers, {args.steps} steps, qk offset {args.qk_offset:g} "
          f"(|q.k| ~ {args.qk_offset ** 2:.0f}; fp16 max 65504)")
    progress = _progress(args.no_progress)
    logs: dict[str, RunLog] = {}
    for run in args.runs:
        torch._dynamo.reset()
        try:
            logs[run] = train(run, initial, task, args, progress)
        except Exception as error:  # noqa: BLE001 -- a failed run is a result, keep the others
            logs[run] = RunLog(run, error=f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    result = verdict(logs, task)
    lines = summary_lines(logs, task) + verdict_lines(result)
    print("\n".join(lines))

    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")
    stem = out_dir / (f"train_stability_{slug}_{datetime.date.today():%Y%m%d}" + (f"_{args.tag}" if args.tag else ""))
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    payload = dict(
        environment=dict(device=device_name, torch=torch.__version__, triton=triton_version,
                         date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                         argv=sys.argv[1:] if argv is None else list(argv)),
        config={k: v for k, v in vars(args).items()},
        task=dict(dataclasses.asdict(task), gap=task.gap, best_possible_loss=task.floor(),
                  chance_loss=math.log(task.values)),
        runs={name: dataclasses.asdict(log) for name, log in logs.items()},
        verdict=result,
        summary=lines,
    )
    stem.with_suffix(".json").write_text(json.dumps(payload, indent=1))
    print(f"wrote {stem.with_suffix('.json')}")
    png = plot(logs, stem.with_suffix(".png"), f"{device_name}, torch {torch.__version__}: seq {args.seq}, "
                                               f"qk offset {args.qk_offset:g}")
    print(f"wrote {png}" if png else "matplotlib is not installed: no plot")
    return exit_code(result)


if __name__ == "__main__":
    sys.exit(main())
