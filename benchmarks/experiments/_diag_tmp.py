import torch, sys
from benchmarks.common import bench_ms, heat
from flash_inductor.launch.hopper import hopper_attention_forward
from flash_inductor.launch.hopper_bwd import hopper_attention_backward, _exact_delta_inputs
for dname, E, causal, L in (("bf16",128,True,16384),("bf16",64,False,4096),("fp16",64,False,4096),("bf16",128,False,4096)):
    dt = dict(bf16=torch.bfloat16, fp16=torch.float16)[dname]
    B, H = 16384 // L, 2048 // E
    q,k,v,do = (torch.randn(B,H,L,E,device="cuda",dtype=dt) for _ in range(4))
    out, lse = hopper_attention_forward(q,k,v,is_causal=causal)
    out2, lse2, r, rc = hopper_attention_forward(q,k,v,is_causal=causal, exact_delta=True)
    fns = {
      "fwd": lambda: hopper_attention_forward(q,k,v,is_causal=causal),
      "fwd_exact": lambda: hopper_attention_forward(q,k,v,is_causal=causal, exact_delta=True),
      "bwd_fast": lambda: hopper_attention_backward(do,q,k,v,out,lse,None,is_causal=causal),
      "bwd_exact": lambda: hopper_attention_backward(do,q,k,v,out2,lse2,None,is_causal=causal, exact_delta=(r,rc)),
      "bwd_exact_nosums": lambda: hopper_attention_backward(do,q,k,v,out2,lse2,None,is_causal=causal, exact_delta=(r,rc), row_sums=False),
      "prep": lambda: _exact_delta_inputs(do, v, out2, None, r, rc),
    }
    res = {}
    for n, f in fns.items():
        f(); heat(f, 200, synchronize=torch.cuda.synchronize)
        res[n] = bench_ms(f, 10, 50)
    print(dname, E, causal, L, " ".join(f"{n} {t:.3f}" for n, t in res.items()), flush=True)
