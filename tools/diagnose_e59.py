"""Discriminate the E=59/Ev=8 NaN seen on sm_90 (debug aid, run on the device)."""
import dataclasses
import math
import sys

import torch

sys.path.insert(0, "tests")
from helpers import make_qkv  # noqa: E402

from flash_inductor import launch  # noqa: E402
from flash_inductor.ops.reference import reference_forward  # noqa: E402
from flash_inductor.tuning import configs as cfgmod  # noqa: E402

orig = cfgmod.select_configs


def run(e, ev, dtype, stages=None, block=None, poison=False):
    def patched(q, hd, hdv, interp, **bucket):
        c = orig(q, hd, hdv, interp, **bucket)
        f = c.forward
        if stages is not None:
            f = dataclasses.replace(f, num_stages=stages)
        if block is not None:
            f = dataclasses.replace(f, block_m=block[0], block_n=block[1])
        return dataclasses.replace(c, forward=f)

    launch.select_configs = patched
    q, k, v = make_qkv(2, 2, 2, 97, 97, e, ev, dtype, "cuda", seed=0)
    if poison:
        buf = torch.full((v.numel() + 4096,), float("nan"), dtype=dtype, device="cuda")
        buf[: v.numel()] = v.reshape(-1)
        v = buf[: v.numel()].view(v.shape)
    out, lse = launch.attention_forward(q, k, v, None, None, 0.0, False, 0, 1 / math.sqrt(e), "stable")
    ref, _ = reference_forward(q.double(), k.double(), v.double(), None, None, 0.0, False, 0, 1 / math.sqrt(e))
    nan = out.isnan()
    err = (out.double() - ref).nan_to_num(0).abs().max().item()
    cols = sorted(set(nan.nonzero()[:, 3].tolist()))
    print(f"E{e} Ev{ev} {dtype} stages={stages} block={block} poison={poison}: nan={nan.sum().item()} cols={cols[:8]} err={err:.2e}")


for args in [(59, 8, torch.float16), (59, 8, torch.float16, 1), (59, 8, torch.float16, None, (64, 32)),
             (64, 8, torch.float16), (59, 16, torch.float16), (59, 8, torch.float32), (40, 24, torch.float16)]:
    run(*args)
    run(*args, poison=True)
