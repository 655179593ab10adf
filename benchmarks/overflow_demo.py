"""The fp16 overflow model of ``train_stability.py``, diagnosed with ``flash_inductor.debug``.

    python benchmarks/overflow_demo.py               # CPU, seconds: the three reports
    python -m flash_inductor.debug bisect-length benchmarks.overflow_demo:ramp_gpt --dtype fp16

``gpt(length)`` is train_stability's GPT at its overflow setting: every query and key head carries
the constant component a = 256, so every entry of the hand-written ``q @ kᵀ`` is about
a² = 65536 > 65504 and fp16 overflows at any length. ``ramp_gpt(length)`` lets that component
grow with the position, a_t = a sqrt((t + 1) / RAMP_LENGTH), so the largest entry of ``q @ kᵀ`` is
a² L / RAMP_LENGTH: fp16 overflows from length RAMP_LENGTH on, a critical length known in advance.
Both are factories for ``bisect-length``: ``factory(length) -> (model, inputs)``.
"""

from __future__ import annotations

import sys


import torch

from benchmarks import train_stability as ts

WIDTH, HEADS, LAYERS, QK_OFFSET = 32, 2, 2, 256.0
RAMP_LENGTH = 128


class RampAttention(ts.CausalSelfAttention):
    """train_stability's attention, its shared query/key component growing with the position."""

    def _with_offset(self, t):
        positions = torch.arange(t.shape[-2], device=t.device, dtype=torch.float32)
        ramp = self.qk_offset * torch.sqrt((positions + 1) / RAMP_LENGTH)
        return torch.cat([t[..., :-1], ramp[:, None].to(t.dtype).expand(*t.shape[:-1], 1)], dim=-1)


def _task(length: int) -> "ts.Task":
    pairs = max(1, min(8, length // 8))
    context = max(2, length // 2 - (length // 2) % 2)
    return ts.Task(seq=length, pairs=pairs, context=context)


def _model_and_inputs(length: int, attention=None, seed: int = 0):
    task = _task(length)
    torch.manual_seed(seed)
    model = ts.GPT(task.vocab, WIDTH, HEADS, LAYERS, length, QK_OFFSET)
    if attention is not None:
        for block in model.blocks:
            ramp = attention(WIDTH, HEADS, length, QK_OFFSET)
            ramp.load_state_dict(block.attn.state_dict())
            block.attn = ramp
    tokens, targets = task.batch(2, 0, seed, "cpu")
    return model, (tokens, targets, task.query_mask().float())


def gpt(length: int):
    """train_stability's GPT (hand-written attention, fp16 overflow at every length)."""
    return _model_and_inputs(length)


def ramp_gpt(length: int):
    """The same GPT whose fp16 ``q @ kᵀ`` overflows from length RAMP_LENGTH on."""
    return _model_and_inputs(length, RampAttention)


def _step(model, inputs, dtype):
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        loss, _ = model(*inputs)
    loss.backward()
    return loss


def main() -> None:
    from flash_inductor import debug

    model, inputs = gpt(64)
    with debug.shadow(model) as check:
        _step(model, inputs, torch.float16)
    print(check.report(), "\n")

    with debug.record_baseline(model) as rec:
        for _ in range(2):
            _step(model, inputs, torch.float32)
    with debug.compare_to_baseline(model, rec.baseline(), factor=4) as cmp:
        _step(model, inputs, torch.float16)
    print(cmp.report().format(limit=6), "\n")

    print(debug.bisect_length(ramp_gpt, "fp16", min_length=16, max_length=1024,
                              progress=lambda line: print(line, file=sys.stderr)))
    print(f"(expected: {RAMP_LENGTH}; max |q·kᵀ| = {QK_OFFSET ** 2:g} L / {RAMP_LENGTH}, fp16 max 65504)")


if __name__ == "__main__":
    main()
