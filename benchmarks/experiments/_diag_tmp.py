import torch, sys
from benchmarks.common import bench_ms, heat
from flash_inductor.launch.hopper import hopper_attention_forward, HopperForwardConfig
from flash_inductor.launch.hopper_bwd import hopper_attention_backward, _exact_delta_inputs
for dname, E, causal, L in (("bf16",128,True,16384),("bf16",64,False,4096),("fp16",64,False,4096),("bf16",128,False,4096),("fp16",64,True,4096)):
    dt = dict(bf16=torch.bfloat16, fp16=torch.float16)[dname]
    B, H = 16384 // L, 2048 // E
    q,k,v,do = (torch.randn(B,H,L,E,device="cuda",dtype=dt) for _ in range(4))
    out, lse = hopper_attention_forward(q,k,v,is_causal=causal)
    out2, lse2, r, rc = hopper_attention_forward(q,k,v,is_causal=causal, exact_delta=True)
    c2 = HopperForwardConfig(num_stages=3, num_consumers=2, pingpong=True)
    o3, l3, r3, rc3 = hopper_attention_forward(q,k,v,is_causal=causal, exact_delta=True, config=c2)
    print("2c==3c", torch.equal(o3, out2), torch.equal(rc3, rc), "out diff vs normal", (out2.float()-out.float()).abs().max().item(), flush=True)
    fns = {
      "fwd": lambda: hopper_attention_forward(q,k,v,is_causal=causal),
      "fwd_exact": lambda: hopper_attention_forward(q,k,v,is_causal=causal, exact_delta=True),
      "fwd_exact_2c": lambda: hopper_attention_forward(q,k,v,is_causal=causal, exact_delta=True, config=c2),
      "bwd_fast": lambda: hopper_attention_backward(do,q,k,v,out,lse,None,is_causal=causal),
      "bwd_exact": lambda: hopper_attention_backward(do,q,k,v,out2,lse2,None,is_causal=causal, exact_delta=(r,rc)),
      "bwd_exact_nosums": lambda: hopper_attention_backward(do,q,k,v,out2,lse2,None,is_causal=causal, exact_delta=(r,rc), row_sums=False),
      "prep": lambda: _exact_delta_inputs(do, v, out2, None, r, rc),
    }
    res = {}
    for n, f in fns.items():
        f(); heat(f, 150, synchronize=torch.cuda.synchronize)
        res[n] = bench_ms(f, 10, 40)
    print(dname, E, causal, L, " ".join(f"{n} {t:.3f}" for n, t in res.items()), flush=True)
