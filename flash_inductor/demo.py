"""A two-minute tour: `python -m flash_inductor.demo` (CPU or GPU).

Shows flash_attention matching SDPA on ordinary input, and staying finite where
hand-written half-precision attention does not: large logits and fully-masked rows.
On CUDA it uses the Triton kernel; on a CPU-only machine, the blocked PyTorch path.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from . import flash_attention, last_report, make_backend


def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> str:
    if not torch.isfinite(x).all():
        return "non-finite"
    return f"{((x.double() - ref).norm() / ref.norm()).item():.1e}"


def _handwritten(q, k, v, mask=None):
    """Attention the way most research code writes it, in the input dtype."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    return scores.softmax(dim=-1) @ v


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args(argv)
    device = args.device
    dtype = torch.float16
    torch.manual_seed(0)
    print(f"flash_inductor demo on {device} ({torch.cuda.get_device_name() if device == 'cuda' else 'CPU path'}), fp16")

    shape = (2, 4, args.seq, 64)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype) for _ in range(3))
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    out = flash_attention(q, k, v, is_causal=True)
    print(f"  ordinary causal input     rel. error vs fp64: ours {_rel_err(out, ref)}")

    # Inputs x60: q @ k^T in fp16 overflows (|QK^T| > 65504) before the scale is applied.
    big_q, big_k = q * 60, k * 60
    ref = F.scaled_dot_product_attention(big_q.double(), big_k.double(), v.double())
    print(
        f"  |QK^T| > 65504 in fp16     rel. error: ours {_rel_err(flash_attention(big_q, big_k, v), ref)}, "
        f"hand-written {_rel_err(_handwritten(big_q, big_k, v), ref)}"
    )

    # Left padding: the first rows of the mask attend to nothing.
    mask = torch.ones(args.seq, args.seq, dtype=torch.bool, device=device)
    mask[: args.seq // 8] = False
    ours = flash_attention(q, k, v, attn_mask=mask)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    print(
        f"  fully-masked rows          ours: {'zeros' if ours[..., : args.seq // 8, :].abs().max() == 0 else 'non-zero'}, "
        f"finite={bool(torch.isfinite(ours).all())}; SDPA finite={bool(torch.isfinite(sdpa).all())}"
    )

    # Backward with |V| ~ 1e4, the size GradScaler produces: dS overflows fp16 unless kept in range.
    q.requires_grad_(), k.requires_grad_()
    big_v = (v * 1e4).requires_grad_()
    out = flash_attention(q, k, big_v)
    grads = torch.autograd.grad(out, (q, k, big_v), torch.randn_like(out))
    print(f"  backward with |V|~1e4      gradients finite: {all(bool(torch.isfinite(g).all()) for g in grads)}")

    _compile_a_model(device, args.seq)


class _CausalSelfAttention(torch.nn.Module):
    """Attention as nanoGPT writes it: no flash_inductor in the model code."""

    def __init__(self, width: int = 128, heads: int = 4, max_len: int = 1024):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)
        self.register_buffer("bias", torch.tril(torch.ones(max_len, max_len)).view(1, 1, max_len, max_len))

    def forward(self, x):
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, seq, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :seq, :seq] == 0, float("-inf"))
        y = att.softmax(dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(batch, seq, width))


def _compile_a_model(device: str, seq: int) -> None:
    """torch.compile with flash_inductor's backend: the hand-written attention moves onto the op."""
    model = _CausalSelfAttention().to(device)
    x = torch.randn(2, seq, 128, device=device)
    compiled = torch.compile(model, backend=make_backend())
    out = compiled(x)
    err = ((out - model(x)).norm() / model(x).norm()).item()
    print(f"  torch.compile(model, backend=flash_inductor.backend): rel. difference from eager {err:.1e}")
    print("  " + last_report().format().replace("\n", "\n  "))


if __name__ == "__main__":
    main()
