"""First-look speed check: ours vs SDPA's flash backend, bf16, E=128, L=S=4096.

`python tools/quick_speed.py` on a GPU machine; the full harness is benchmarks/bench_attention.py.
"""

import torch
import torch.nn.functional as F
import triton

import flash_inductor


def main() -> None:
    batch, heads, seq, e = 4, 16, 4096, 128
    q, k, v = (torch.randn(batch, heads, seq, e, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for causal in (False, True):
        flops = 4 * batch * heads * seq * seq * e * (0.5 if causal else 1.0)
        for name, fn in (
            ("ours", lambda: flash_inductor.flash_attention(q, k, v, is_causal=causal)),
            ("sdpa-flash", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)),
        ):
            ctx = sdpa_kernel(SDPBackend.FLASH_ATTENTION)
            with ctx:
                fwd = triton.testing.do_bench(fn, return_mode="median")
                fb = triton.testing.do_bench(lambda: torch.autograd.grad(fn(), (q, k, v), dout), return_mode="median")
            print(f"causal={causal} {name:11s} fwd {flops / fwd / 1e9:6.1f} TFLOP/s  fwd+bwd {3.5 * flops / fb / 1e9:6.1f} TFLOP/s")


if __name__ == "__main__":
    main()
