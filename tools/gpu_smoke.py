"""Quick CUDA smoke check of the Triton kernels against a float64 reference.

Run on a GPU machine: `python tools/gpu_smoke.py`. Prints one line per case with the max
error of out/dq/dk/dv and whether anything went non-finite; exits non-zero on a failure.
"""

import math
import sys

import torch

from flash_inductor import launch


def naive(q, k, v, mask, causal, off, scale):
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) * scale
    seq_q, seq_k = s.shape[-2:]
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.double()
    if causal:
        i = torch.arange(seq_q, device=q.device)[:, None]
        j = torch.arange(seq_k, device=q.device)[None, :]
        s = s.masked_fill(j > i + off, float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m)
    l = p.sum(-1, keepdim=True)
    return (p / torch.where(l == 0, torch.ones_like(l), l)) @ v


def main() -> int:
    torch.manual_seed(0)
    failures = 0
    cases = [
        (2, 4, 2, 129, 300, 40, 24, False, None),
        (1, 2, 2, 257, 129, 64, 64, True, "bool"),
        (1, 4, 1, 300, 513, 128, 128, True, None),
        (2, 2, 2, 200, 200, 96, 80, False, "float"),
        (1, 2, 2, 130, 130, 256, 256, True, None),
        (1, 2, 2, 64, 64, 1, 3, False, None),
    ]
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for batch, hq, hkv, seq_q, seq_k, e, ev, causal, mask_kind in cases:
            dev = "cuda"
            q = torch.randn(batch, hq, seq_q, e, device=dev, dtype=dtype)
            k = torch.randn(batch, hkv, seq_k, e, device=dev, dtype=dtype)
            v = torch.randn(batch, hkv, seq_k, ev, device=dev, dtype=dtype)
            mask = None
            if mask_kind == "bool":
                mask = (torch.rand(batch, 1, seq_q, seq_k, device=dev) > 0.3).expand(batch, hq, seq_q, seq_k)
            elif mask_kind == "float":
                mask = torch.randn(batch, hq, seq_q, seq_k, device=dev, dtype=dtype)
            off = seq_k - seq_q if causal else 0
            scale = 1 / math.sqrt(e)
            out, lse = launch.attention_forward(q, k, v, mask, None, 0.0, causal, off, scale, "stable")
            dout = torch.randn_like(out)
            dq, dk, dv, dm = launch.attention_backward(
                dout, q, k, v, mask, out, lse, None, None, 0.0, causal, off, scale, "stable", mask_kind == "float"
            )
            qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
            ref = naive(qd, kd, vd, mask, causal, off, scale)
            (ref * dout.double()).sum().backward()
            errs = [(a.double() - b).abs().max().item() for a, b in ((out, ref), (dq, qd.grad), (dk, kd.grad), (dv, vd.grad))]
            finite = all(torch.isfinite(t).all().item() for t in (out, dq, dk, dv))
            tol = {torch.float16: 5e-2, torch.bfloat16: 2e-1, torch.float32: 1e-3}[dtype]
            ok = finite and max(errs) < tol
            failures += not ok
            print(f"{'ok ' if ok else 'BAD'} {str(dtype):15s} B{batch} H{hq}/{hkv} L{seq_q} S{seq_k} E{e}/{ev} "
                  f"causal={causal} mask={mask_kind}: " + " ".join(f"{x:.2e}" for x in errs))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
