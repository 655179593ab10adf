"""Run one kernel case on CUDA and report where it breaks (debug aid for the device).

python tools/diagnose_case.py B HQ HKV L S E EV DTYPE [causal] [mask] [contig]
"""
import math
import sys

import torch

from flash_inductor import launch


def main():
    b, hq, hkv, l, s, e, ev = map(int, sys.argv[1:8])
    dtype = getattr(torch, sys.argv[8])
    flags = set(sys.argv[9:])
    torch.manual_seed(0)
    if "noncontig" in flags:
        q = torch.randn(b, l, hq, e, device="cuda", dtype=dtype).transpose(1, 2)
        k = torch.randn(b, s, hkv, e, device="cuda", dtype=dtype).transpose(1, 2)
        v = torch.randn(b, s, hkv, ev, device="cuda", dtype=dtype).transpose(1, 2)
    else:
        q = torch.randn(b, hq, l, e, device="cuda", dtype=dtype)
        k = torch.randn(b, hkv, s, e, device="cuda", dtype=dtype)
        v = torch.randn(b, hkv, s, ev, device="cuda", dtype=dtype)
    causal = "causal" in flags
    out, lse = launch.attention_forward(q, k, v, None, None, 0.0, causal, 0, 1 / math.sqrt(e), "stable")
    torch.cuda.synchronize()
    nan = out.isnan()
    print("fwd ok; nan out:", nan.sum().item(), "nan positions (b,h,row,col) sample:", nan.nonzero()[:5].tolist(),
          "nan lse:", lse.isnan().sum().item())
    dq, dk, dv, _ = launch.attention_backward(torch.randn_like(out), q, k, v, None, out, lse, None, None, 0.0,
                                              causal, 0, 1 / math.sqrt(e), "stable", False)
    torch.cuda.synchronize()
    print("bwd ok; nan dq/dk/dv:", [t.isnan().sum().item() for t in (dq, dk, dv)])


if __name__ == "__main__":
    main()
