"""Padding (key) masks on the H200: ours with the mask as one bias per key on the Gluon kernels,
against the same mask given densely (the Triton kernels' path), against no mask, and against
SDPA's default backend with the same mask. Forward and forward+backward, heated, do_bench medians,
in one process; every provider is checked against fp64 on the first cell's output.

    python3 -m benchmarks.experiments.key_mask_probe --out $OUT
    python3 -m benchmarks.experiments.key_mask_probe --head-dims 64 --seqs 2048 --schedules stable

A padding mask is (B, 1, 1, S): batch element b keeps its first S - S·b/(8B) keys, as BERT's
padded batches do. SDPA gets it as a bool (B, 1, 1, S) tensor and picks its backend itself.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

from benchmarks import common

TOKENS = 16384


def padding_mask(batch: int, seq: int, device) -> torch.Tensor:
    kept = seq - (seq * torch.arange(batch, device=device)) // (8 * batch)
    return (torch.arange(seq, device=device)[None, :] < kept[:, None])[:, None, None, :]


def providers(mask: torch.Tensor, schedule: str):
    import flash_inductor

    dense = mask.expand(mask.shape[0], 1, mask.shape[-1], mask.shape[-1]).contiguous()
    return {
        "ours_key_mask": lambda q, k, v: flash_inductor.flash_attention(q, k, v, attn_mask=mask, schedule=schedule),
        "ours_dense_mask": lambda q, k, v: flash_inductor.flash_attention(q, k, v, attn_mask=dense, schedule=schedule),
        "ours_no_mask": lambda q, k, v: flash_inductor.flash_attention(q, k, v, schedule=schedule),
        "sdpa_key_mask": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
    }


def run(args) -> list[dict]:
    device = torch.device("cuda")
    rows = []
    cells = [(dtype, e, seq, schedule) for dtype in args.dtypes for e in args.head_dims for seq in args.seqs
             for schedule in args.schedules]
    for dtype_name, head_dim, seq, schedule in common.progress(cells, "key-mask cells"):
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
        batch, heads = max(1, TOKENS // seq), 2048 // head_dim
        q, k, v, dout = common.make_inputs(batch, heads, seq, head_dim, dtype, device)
        mask = padding_mask(batch, seq, device)
        reference = None
        for name, attn in providers(mask, schedule).items():
            row = dict(dtype=dtype_name, head_dim=head_dim, seq=seq, batch=batch, heads=heads, schedule=schedule,
                       provider=name)
            try:
                with torch.no_grad():
                    out = attn(q, k, v)
                if name != "ours_no_mask":
                    if reference is None:
                        reference = F.scaled_dot_product_attention(
                            q.detach()[:1].double(), k.detach()[:1].double(), v.detach()[:1].double(),
                            attn_mask=mask[:1])
                    row["max_abs_err_b0"] = float((out[:1].double() - reference).abs().max())
                for mode in ("fwd", "fwd_bwd"):
                    step = common.make_step(attn, mode, q, k, v, dout)
                    common.heat(step, args.heat_ms)
                    row[f"{mode}_ms"] = common.bench_ms(step, 25, 100, grad_to_none=[q, k, v])
            except Exception as exc:  # noqa: BLE001 -- a provider's failure is a result
                row["error"] = common.first_line(exc)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def e64_consumers(args) -> list[dict]:
    """The E 64 key-mask forward with two consumers (its default: three spill with the bias) and
    three (the unmasked default), both schedules' forwards, launched directly."""
    from flash_inductor.launch import hopper

    rows = []
    device = torch.device("cuda")
    for seq in args.seqs:
        batch, heads = max(1, TOKENS // seq), 2048 // 64
        q, k, v, _ = common.make_inputs(batch, heads, seq, 64, torch.bfloat16, device)
        q, k, v = (t.detach() for t in (q, k, v))
        mask = padding_mask(batch, seq, device)
        for consumers in (2, 3):
            cfg = hopper.HopperForwardConfig(num_stages=3, num_consumers=consumers, pingpong=True)
            for exact_delta in (False, True):
                step = (lambda c, x: lambda: hopper.hopper_attention_forward(
                    q, k, v, attn_mask=mask, config=c, exact_delta=x))(cfg, exact_delta)
                common.heat(step, args.heat_ms)
                row = dict(seq=seq, consumers=consumers, exact_delta=exact_delta, fwd_ms=common.bench_ms(step, 25, 100))
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def ratios(rows: list[dict]) -> list[dict]:
    """Per cell and mode: ours with the key mask over each other provider (above 1: ours faster)."""
    out = []
    cells = {}
    for r in rows:
        cells.setdefault((r["dtype"], r["head_dim"], r["seq"], r["schedule"]), {})[r["provider"]] = r
    for key, by_name in cells.items():
        ours = by_name.get("ours_key_mask", {})
        for mode in ("fwd", "fwd_bwd"):
            if f"{mode}_ms" not in ours:
                continue
            entry = dict(zip(("dtype", "head_dim", "seq", "schedule"), key), mode=mode)
            for name, r in by_name.items():
                if name != "ours_key_mask" and f"{mode}_ms" in r:
                    entry[f"vs_{name}"] = r[f"{mode}_ms"] / ours[f"{mode}_ms"]
            out.append(entry)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", nargs="*", default=["bf16"], choices=["bf16", "fp16"])
    ap.add_argument("--head-dims", nargs="*", type=int, default=[64, 128])
    ap.add_argument("--seqs", nargs="*", type=int, default=[2048, 8192])
    ap.add_argument("--schedules", nargs="*", default=["stable", "fast"])
    ap.add_argument("--heat-ms", type=float, default=300.0)
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    env = common.environment(common.module_command("benchmarks.experiments.key_mask_probe", argv))
    rows = run(args)
    payload = dict(header=env, results=rows, ratios=ratios(rows), e64_consumers=e64_consumers(args))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "key_mask_probe.json")
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    for r in payload["ratios"]:
        print(json.dumps(r))
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
