import torch, sys
from benchmarks.common import bench_ms, heat
from flash_inductor.launch.hopper import hopper_attention_forward
from flash_inductor.launch.hopper_bwd import hopper_attention_backward, _exact_delta_inputs
from flash_inductor.ops.one_pass import _forward, _backward
for dname, E, causal, L in (("bf16",128,True,16384),("bf16",64,False,4096),("fp16",128,False,4096)):
    dt = dict(bf16=torch.bfloat16, fp16=torch.float16)[dname]
    B, H = 16384 // L, 2048 // E
    q,k,v,do = (torch.randn(B,H,L,E,device="cuda",dtype=dt) for _ in range(4))
    out, lse = hopper_attention_forward(q,k,v,is_causal=causal)
    o2, l2, r, rc = _forward(q,k,v,causal,0,E**-0.5,-1,-1)
    fns = {
      "fwd": lambda: hopper_attention_forward(q,k,v,is_causal=causal),
      "fwd_1p": lambda: _forward(q,k,v,causal,0,E**-0.5,-1,-1),
      "bwd_fast": lambda: hopper_attention_backward(do,q,k,v,out,lse,None,is_causal=causal),
      "bwd_1p": lambda: _backward(do,q,k,v,o2,l2,None,r,rc,causal,0,E**-0.5,-1,-1),
      "prep": lambda: _exact_delta_inputs(do, v, o2, None, r, rc),
    }
    res = {}
    for n, f in fns.items():
        f(); heat(f, 150, synchronize=torch.cuda.synchronize)
        res[n] = bench_ms(f, 10, 40)
    print(dname, E, causal, L, " ".join(f"{n} {t:.3f}" for n, t in res.items()), flush=True)
