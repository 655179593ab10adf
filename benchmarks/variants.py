"""Attention variants on the GPU: packed sequences against FlexAttention and SDPA on nested tensors,
and what sinks and soft-capping cost over the plain causal kernel.

    python -m benchmarks.variants                        # every part, bf16, E 64 and 128
    python -m benchmarks.variants --part packed --packs 16384 --time-budget 300
    python -m benchmarks.variants --part overhead --seqs 4096

Part ``packed``: packs of ``--packs`` tokens (16k and 64k) filled with documents whose lengths are
drawn (seeded) log-uniformly from 128 to 8k, causal within each document, forward+backward. The
contenders see the same pack:

* ``ours``: ``flash_attention_varlen`` (cu_seqlens; each document its own problem, no mask), the
  default schedule (`stable`: on an H100/H200 the Gluon kernels' one-pass exact-Δ path,
  ``ops/varlen_one_pass.py``), and ``ours-fast`` the `fast` schedule (the Gluon kernels too);
* ``flex``: ``torch.compile``d FlexAttention with a document-causal ``mask_mod`` and its
  ``BlockMask`` (built once per cell, untimed), the usual way to run packed batches with it;
* ``sdpa-nested``: SDPA on a nested jagged tensor (FlashAttention-2/cuDNN varlen underneath).
  It has no ``is_causal`` for nested inputs, so it runs the same documents without the causal
  mask; ``ours-noncausal`` and ``ours-fast-noncausal`` run that too, and the ratio is theirs
  against it (the causal ones are compared with flex and the dense mask only);
* ``ours-dense-mask`` (16k only): ours with the pack's dense block-diagonal bool mask, what a
  padding-free batch costs when its structure is given as a mask.

Part ``overhead``: B·L = 32k tokens, heads·E = 2048, causal, forward and forward+backward, ours
plain against ours with ``sinks=``, with ``softcap=50``, and with both (ratio variant/plain), and, for
scale, Flex with that cap as a ``score_mod`` against Flex without it.

Part ``hf_step``: an HF Llama training step on a 16k pack (``use_cache=False``, as training runs):
packed ``position_ids`` (no mask built: varlen from the mask function's record), the same with
``"sdpa"``'s mask function (transformers' L x L packed mask, checked per layer), and the pack's
dense block-diagonal mask (``run_hf_step``). ``--smoke`` runs this part once on a tiny Llama on the
CPU (no timing worth reading): it checks the three steps run and agree, and that the packed one
hands attention no mask.

Every step runs for ``--heat-ms`` before it is timed (``benchmarks/common.heat``), then
``do_bench``'s median. The JSON and a plot go to ``--out``; a part run alone keeps the other parts'
records of the same day's file for the same GPU (parts run in separate device calls make one file).
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time

import torch

from benchmarks.common import (DTYPES, bench_ms, compiled_flex, environment, first_line, heat, module_command,
                               output_stem, progress, release_memory, write_record)

E_CHOICES = (64, 128)
# Ours on the pack, through flash_attention_varlen: the default schedule and `fast`, causal and not.
OURS_PACKED = ("ours", "ours-fast", "ours-noncausal", "ours-fast-noncausal")


def document_lengths(total: int, seed: int, low: int = 128, high: int = 8192) -> list[int]:
    """Lengths log-uniform in [low, high] whose sum is ``total`` (the last one takes the rest)."""
    gen = torch.Generator().manual_seed(seed)
    lengths, left = [], total
    while left > 0:
        draw = int(math.exp(math.log(low) + torch.rand((), generator=gen).item() * (math.log(high) - math.log(low))))
        draw = min(draw, left)
        if left - draw < low and left - draw > 0:
            draw = left
        lengths.append(draw)
        left -= draw
    return lengths


def _packed_inputs(lengths, heads, head_dim, dtype, device):
    total = sum(lengths)
    q, k, v = (torch.randn(total, heads, head_dim, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    cu = torch.nn.functional.pad(torch.tensor(lengths, device=device).cumsum(0), (1, 0)).to(torch.int32)
    return q, k, v, torch.randn(total, heads, head_dim, device=device, dtype=dtype), cu


def packed_step(provider, lengths, q, k, v, dout, cu):
    """The timed forward+backward of one contender on one pack."""
    import flash_inductor

    longest = max(lengths)
    if provider in OURS_PACKED:
        causal, schedule = "noncausal" not in provider, "fast" if "-fast" in provider else None

        def attend():
            return flash_inductor.flash_attention_varlen(q, k, v, cu, cu, longest, longest, causal=causal,
                                                         schedule=schedule)
    elif provider == "flex":
        from torch.nn.attention.flex_attention import create_block_mask
        doc = torch.repeat_interleave(torch.arange(len(lengths), device=q.device),
                                      torch.tensor(lengths, device=q.device))

        def document_causal(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

        total = q.shape[0]
        block_mask = create_block_mask(document_causal, None, None, total, total, device=q.device)
        flex = compiled_flex()

        def attend():
            out = flex(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                       block_mask=block_mask)
            return out[0].transpose(0, 1)
    elif provider == "sdpa-nested":
        offsets = cu.to(torch.int64)

        def attend():
            nested = [torch.nested.nested_tensor_from_jagged(t, offsets).transpose(1, 2) for t in (q, k, v)]
            out = torch.nn.functional.scaled_dot_product_attention(*nested)
            return out.transpose(1, 2).values()
    elif provider == "ours-dense-mask":
        doc = torch.repeat_interleave(torch.arange(len(lengths), device=q.device),
                                      torch.tensor(lengths, device=q.device))
        mask = (doc[:, None] == doc[None, :]).tril()

        def attend():
            out = flash_inductor.flash_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                 attn_mask=mask)
            return out.transpose(0, 1)
    else:
        raise ValueError(provider)
    return lambda: torch.autograd.grad(attend(), (q, k, v), dout)


def overhead_step(variant, q, k, v, dout, sinks, mode):
    import flash_inductor

    cap = 50.0 if "softcap" in variant else None
    if variant.startswith("flex"):  # FlexAttention's own cost of the cap (a score_mod), for scale
        from torch.nn.attention.flex_attention import create_block_mask
        causal = create_block_mask(lambda b, h, i, j: i >= j, None, None, q.shape[2], q.shape[2], device=q.device)
        score_mod = (lambda s, b, h, i, j: cap * torch.tanh(s / cap)) if cap else None
        attend = functools.partial(compiled_flex(), q, k, v, score_mod=score_mod, block_mask=causal)
    else:
        attend = functools.partial(flash_inductor.flash_attention, q, k, v, is_causal=True, softcap=cap,
                                   sinks=sinks if "sinks" in variant else None)
    if mode == "fwd":
        return attend
    return lambda: torch.autograd.grad(attend(), (q, k, v), dout)


def _time(step, args):
    step()
    torch.cuda.synchronize()
    heat(step, args.heat_ms, synchronize=torch.cuda.synchronize)
    return bench_ms(step, args.warmup, args.rep)


def _measure(records, cell, make_step, args, deadline, label):
    """Time one contender into ``records`` (one line either way): skipped past the deadline, and a
    failure recorded with its first line rather than ending the run."""
    if time.monotonic() > deadline:
        records.append(dict(cell, status="skipped", error="--time-budget spent"))
        return
    try:
        ms = _time(make_step(), args)
        records.append(dict(cell, status="ok", ms=ms))
        print(f"{label}: {ms:.3f} ms", flush=True)
    except Exception as exc:
        records.append(dict(cell, status="error", error=first_line(exc)))
        print(f"{label}: {first_line(exc)}", file=sys.stderr, flush=True)


def run_packed(args, dtype, records, deadline):
    cells = [(pack, e) for pack in args.packs for e in args.head_dims]
    for pack, head_dim in progress(cells, "packed"):
        lengths = document_lengths(pack, seed=pack)
        q, k, v, dout, cu = _packed_inputs(lengths, 2048 // head_dim, head_dim, dtype, args.device)
        providers = [*OURS_PACKED, "flex", "sdpa-nested"] + (["ours-dense-mask"] if pack <= 16384 else [])
        for provider in providers:
            cell = dict(part="packed", pack=pack, head_dim=head_dim, documents=len(lengths), provider=provider,
                        causal=provider != "sdpa-nested" and "noncausal" not in provider, dtype=args.dtype)
            _measure(records, cell, lambda: packed_step(provider, lengths, q, k, v, dout, cu), args, deadline,
                     f"packed {pack} E{head_dim} {provider}")
            release_memory()


def run_overhead(args, dtype, records, deadline):
    cells = [(seq, e, mode) for seq in args.seqs for e in args.head_dims for mode in ("fwd", "fwd_bwd")]
    for seq, head_dim, mode in progress(cells, "overhead"):
        heads, batch = 2048 // head_dim, max(1, 32768 // seq)
        q, k, v = (torch.randn(batch, heads, seq, head_dim, device=args.device, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        dout = torch.randn_like(q)
        sinks = torch.randn(heads, device=args.device, dtype=torch.float32, requires_grad=True)
        for variant in ("plain", "sinks", "softcap", "sinks+softcap", "flex", "flex+softcap"):
            cell = dict(part="overhead", seq=seq, batch=batch, head_dim=head_dim, mode=mode, variant=variant,
                        dtype=args.dtype)
            _measure(records, cell, lambda: overhead_step(variant, q, k, v, dout, sinks, mode), args, deadline,
                     f"overhead L{seq} E{head_dim} {mode} {variant}")
        release_memory()


def hf_steps(model, pack, lengths, device):
    """The HF step's contenders on one pack, each a closure doing forward+backward, and the mask
    function each needs registered under ``"inductor_stable"`` while it runs. ``use_cache=False``:
    a cache makes transformers skip its packing detection (and the packed mask) altogether."""
    from transformers.masking_utils import sdpa_mask

    from flash_inductor.transformers_masks import attention_mask_function

    ids = torch.randint(0, model.config.vocab_size, (1, pack), device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])[None]
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))
    block_diagonal = ((doc[:, None] == doc[None, :]).tril())[None, None]

    def step(**extra):
        return lambda: model(input_ids=ids, position_ids=positions, labels=ids, use_cache=False,
                             **extra).loss.backward()

    return {
        "packed-position-ids": (step(), attention_mask_function),
        "packed-hf-mask": (step(), sdpa_mask),
        "dense-block-diagonal": (step(attention_mask=block_diagonal), attention_mask_function),
    }


def _with_mask_function(mask_function, make_step):
    """``make_step``'s step, run with ``mask_function`` registered for ``"inductor_stable"``."""
    from transformers import AttentionMaskInterface

    from flash_inductor.transformers_masks import attention_mask_function

    def make():
        inner = make_step()

        def run():
            AttentionMaskInterface.register("inductor_stable", mask_function)
            try:
                return inner()
            finally:
                AttentionMaskInterface.register("inductor_stable", attention_mask_function)
        return run
    return make


def run_hf_step(args, dtype, records, deadline):
    """An HF Llama training step (forward+backward, 4 layers, E 128, GQA 4:1) on a packed batch under
    ``attn_implementation="inductor_stable"``: the sequences given as packed ``position_ids`` (what
    ``DataCollatorWithFlattening`` gives; no mask built, varlen underneath), the same with the mask
    transformers builds for ``"sdpa"`` (the L x L packed mask, checked per layer), and the pack's dense
    block-diagonal 4-D mask (every score computed, the mask read)."""
    import transformers

    import flash_inductor.transformers  # noqa: F401  (registers inductor_stable)

    config = transformers.LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
                                      num_attention_heads=16, num_key_value_heads=4, vocab_size=32000,
                                      max_position_embeddings=max(args.packs), attn_implementation="inductor_stable")
    model = transformers.LlamaForCausalLM(config).to(args.device, dtype)
    for pack in progress([p for p in args.packs if p <= 16384], "hf_step"):
        lengths = document_lengths(pack, seed=pack)
        for name, (step, mask_function) in hf_steps(model, pack, lengths, args.device).items():
            cell = dict(part="hf_step", pack=pack, documents=len(lengths), provider=name, dtype=args.dtype)
            _measure(records, cell, _with_mask_function(mask_function, lambda: step), args, deadline,
                     f"hf_step {pack} {name}")
            model.zero_grad(set_to_none=True)
            release_memory()


def smoke_hf_step(pack: int = 192) -> list[str]:
    """``--smoke``: the HF step's contenders once each on a tiny fp32 Llama on the CPU. Checks that each
    runs, that the three losses and gradients agree, and that the packed step hands attention no mask;
    returns one line per contender (wall time of that one run, not a measurement)."""
    import transformers

    import flash_inductor.transformers as fit

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=128, attn_implementation="inductor_stable")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    lengths = document_lengths(pack, seed=pack, low=16, high=96)
    masks, real = [], fit.attention_forward

    def spy(module, query, key, value, attention_mask, **kwargs):
        masks.append(attention_mask is None)
        return real(module, query, key, value, attention_mask, **kwargs)

    transformers.AttentionInterface.register("inductor_stable", spy)
    lines, grads = [], {}
    try:
        for name, (step, mask_function) in hf_steps(model, pack, lengths, "cpu").items():
            masks.clear()
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            _with_mask_function(mask_function, lambda: step)()()
            grads[name] = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
            lines.append(f"hf_step smoke {pack} ({len(lengths)} documents) {name}: ran in "
                         f"{1e3 * (time.perf_counter() - start):.0f} ms, attention masks None: {masks}")
            if name == "packed-position-ids" and not all(masks):
                raise AssertionError(f"the packed step handed attention a mask: {masks}")
    finally:
        transformers.AttentionInterface.register("inductor_stable", real)
    for name, g in grads.items():
        torch.testing.assert_close(g, grads["packed-position-ids"], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    return lines


def with_earlier_parts(path: str, records: list, env: dict) -> tuple[list, dict]:
    """This run's records, and the records of the parts it did not run from the same day's file of
    the same GPU (``path``), so that parts run in separate device calls make one file; and
    {"kept_parts": {part: the earlier run's command and commit}} when any were kept."""
    if not os.path.exists(path):
        return records, {}
    try:
        with open(path) as f:
            earlier = json.load(f)
        if earlier["header"].get("gpu") != env.get("gpu"):
            return records, {}
        ran = {r["part"] for r in records}
        kept = [r for r in earlier["records"] if r["part"] not in ran]
    except (OSError, ValueError, KeyError, TypeError) as error:
        print(f"not merging {path} ({first_line(error)})", file=sys.stderr)
        return records, {}
    if kept:
        print(f"kept {len(kept)} records of parts this run did not measure from {path}")
    source = {key: earlier["header"].get(key) for key in ("command", "git_commit", "date")}
    return records + kept, ({"kept_parts": {part: source for part in sorted({r["part"] for r in kept})}}
                            if kept else {})


def ratios(records) -> list[str]:
    """One line per cell: ours against each contender of the same masking (contender ms / ours ms,
    > 1 = ours faster: causal against flex and the dense mask, not causal against SDPA on nested
    tensors), and each variant's time over plain."""
    ok = [r for r in records if r["status"] == "ok"]
    lines = []
    for r in ok:
        if r["part"] == "packed" and r["provider"] in OURS_PACKED:
            for other in ok:
                if other["part"] == "packed" and other["provider"] not in OURS_PACKED and \
                        (other["pack"], other["head_dim"], other["causal"]) == (r["pack"], r["head_dim"], r["causal"]):
                    lines.append(f"packed {r['pack']:>6} E{r['head_dim']:<3} {r['provider']:<19} vs "
                                 f"{other['provider']:<16} ours {other['ms'] / r['ms']:.2f}x  "
                                 f"({r['ms']:.2f} vs {other['ms']:.2f} ms)")
        if r["part"] == "hf_step" and r["provider"] == "packed-position-ids":
            for other in ok:
                if other["part"] == "hf_step" and other["provider"] != r["provider"] and other["pack"] == r["pack"]:
                    lines.append(f"hf_step {r['pack']:>6} packed {other['ms'] / r['ms']:.2f}x the {other['provider']} "
                                 f"step ({r['ms']:.1f} vs {other['ms']:.1f} ms)")
        if r["part"] == "overhead" and r["variant"] not in ("plain", "flex") and _plain_ms(ok, r):
            lines.append(f"overhead L{r['seq']:<6} E{r['head_dim']:<3} {r['mode']:<7} {r['variant']:<14}"
                         f" {r['ms'] / _plain_ms(ok, r):.3f}x {'flex' if r['variant'].startswith('flex') else 'plain'}")
    return lines


def _plain_ms(ok, r):
    """The baseline's time beside an overhead record, or None: ours' plain causal kernel, or, for
    Flex's soft cap, Flex without it."""
    base = "flex" if r["variant"].startswith("flex") else "plain"
    return next((o["ms"] for o in ok if o["part"] == "overhead" and o["variant"] == base and
                 (o["seq"], o["head_dim"], o["mode"]) == (r["seq"], r["head_dim"], r["mode"])), None)


def plot(records, path, title=""):
    """Left: ours' speed-up over each packed contender per (pack, E); middle: each variant's time
    over plain causal per (L, E, mode), the 5 % line dotted; right: the HF step, packed against the
    dense block-diagonal mask."""
    from matplotlib.figure import Figure

    ok = [r for r in records if r["status"] == "ok"]
    overhead = [r for r in ok if r["part"] == "overhead" and r["variant"] not in ("plain", "flex") and _plain_ms(ok, r)]
    fig = Figure(figsize=(17, max(5.0, 0.26 * len(overhead) + 1.5)))
    left, middle, right = fig.subplots(1, 3, gridspec_kw=dict(width_ratios=(1.2, 1.6, 0.6)))
    for mine, provider, color in (("ours", "flex", "tab:blue"), ("ours-fast", "flex", "tab:cyan"),
                                  ("ours", "ours-dense-mask", "tab:green"),
                                  ("ours-noncausal", "sdpa-nested", "tab:red"),
                                  ("ours-fast-noncausal", "sdpa-nested", "tab:pink")):
        ours = {(r["pack"], r["head_dim"]): r["ms"] for r in ok if r["part"] == "packed" and r["provider"] == mine}
        pts = [(f"{r['pack'] // 1024}k E{r['head_dim']}\n{mine}/{provider}", r["ms"] / ours[(r["pack"], r["head_dim"])])
               for r in ok if r["part"] == "packed" and r["provider"] == provider and (r["pack"], r["head_dim"]) in ours]
        if pts:
            left.bar([x for x, _ in pts], [y for _, y in pts], color=color, label=f"{mine} / {provider}")
    left.axhline(1.0, color="gray", linestyle="--")
    left.set_ylabel("contender ms / ours ms (> 1: ours faster)")
    left.legend(fontsize=6)
    left.set_title("packed, fwd+bwd (flex: causal; SDPA-NJT: not)")
    left.tick_params(axis="x", labelsize=7, rotation=60)
    labels = [f"{r['seq'] // 1024}k E{r['head_dim']} {r['mode']} {r['variant']}" for r in overhead]
    values = [r["ms"] / _plain_ms(ok, r) for r in overhead]
    middle.barh(labels, values, color="tab:orange")
    middle.axvline(1.0, color="gray", linestyle="--")
    middle.axvline(1.05, color="red", linestyle=":")
    middle.tick_params(axis="y", labelsize=7)
    middle.set_xlabel("variant ms / plain causal ms (dotted: +5 %)")
    middle.set_title("sinks and soft-capping, causal")
    steps = {r["provider"]: r["ms"] for r in ok if r["part"] == "hf_step"}
    if steps:
        right.bar(list(steps), list(steps.values()), color=["tab:purple", "tab:olive", "tab:gray"][:len(steps)])
        right.set_ylabel("ms per step")
        right.tick_params(axis="x", labelsize=7, rotation=30)
    right.set_title("HF Llama step, 16k pack")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("packed", "overhead", "hf_step", "all"), default="all")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--packs", default="16384,65536")
    p.add_argument("--seqs", default="4096,16384")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rep", type=int, default=40)
    p.add_argument("--heat-ms", type=float, default=300.0)
    p.add_argument("--time-budget", type=float, default=None, help="seconds; later cells are recorded as skipped")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=os.path.join("benchmarks", "results"))
    p.add_argument("--tag", default="variants")
    p.add_argument("--smoke", action="store_true",
                   help="run the hf_step part once on a tiny Llama on the CPU (a check that it runs, not a timing)")
    args = p.parse_args(argv)
    if args.smoke:
        if args.part not in ("hf_step", "all"):
            p.error("--smoke covers the hf_step part only")
        print("\n".join(smoke_hf_step()))
        return 0
    try:
        args.head_dims = [int(x) for x in args.head_dims.split(",")]
        args.packs = [int(x) for x in args.packs.split(",")]
        args.seqs = [int(x) for x in args.seqs.split(",")]
    except ValueError:
        p.error("--head-dims, --packs and --seqs take comma-separated integers")
    if any(e not in E_CHOICES for e in args.head_dims) or min(args.packs + args.seqs) < 128:
        p.error(f"--head-dims takes {E_CHOICES}; --packs and --seqs at least 128")
    if not args.device.startswith("cuda") or not torch.cuda.is_available():
        p.error("the variants benchmark times GPU kernels: it needs --device cuda on a machine with a GPU")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        p.error(f"--out {args.out} exists and is not a directory")
    dtype = DTYPES[args.dtype]
    deadline = time.monotonic() + (args.time_budget or math.inf)
    print(f"variants: part {args.part}, {args.dtype}, E {args.head_dims}; about 3-6 min on an H100", flush=True)
    records = []
    for part, run in (("packed", run_packed), ("overhead", run_overhead), ("hf_step", run_hf_step)):
        if args.part in (part, "all"):
            run(args, dtype, records, deadline)
    env = environment(module_command("benchmarks.variants", argv))
    records, kept = with_earlier_parts(output_stem(args.out, env, None, "variants") + ".json", records, env)
    path = write_record(args.out, "variants", env, dict(records=records, ratios=ratios(records), **kept), tag=None)
    print("\n".join(ratios(records)))
    try:
        plot(records, path[:-5] + ".png", f"{env['gpu']}  torch {env['torch']}")
    except Exception as exc:  # a missing matplotlib costs the plot, not the numbers
        print(f"no plot ({first_line(exc)})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
