"""Debug aid for the device: show why a compiled (Inductor) graph fails where eager works.

python tools/diagnose_compile.py

1. Prints the pre-grad graph the pass receives for the minGPT tril model on CUDA, and the
   pass's report (the causal-tril recognition differed between CPU and CUDA).
2. Compiles the test_ops attention block on CUDA (fp32 and fp16) and prints every exception in
   the chain in full: Inductor wraps Triton's CompilationError and hides the innermost cause.
"""
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import flash_inductor  # noqa: E402
from flash_inductor.passes import graph_pass  # noqa: E402


def show_chain(error: BaseException) -> None:
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        print(f"--- {type(error).__module__}.{type(error).__name__}:\n{str(error)[-6000:]}")
        error = error.__cause__ or error.__context__


def pregraph_of_mingpt() -> None:
    from test_pass_handwritten import MinGPT, _qkv, L  # noqa: E402

    original = graph_pass.FlashAttentionPass.__call__

    def printing(self, graph):
        print(graph.owning_module.code if graph.owning_module is not None else graph)
        return original(self, graph)

    graph_pass.FlashAttentionPass.__call__ = printing
    try:
        torch._dynamo.reset()
        q, k, v = (t.cuda() for t in _qkv(torch.float32, L, L))
        torch.compile(MinGPT(), backend=flash_inductor.make_backend())(q, k, v)
        print(flash_inductor.last_report().format())
    finally:
        graph_pass.FlashAttentionPass.__call__ = original


def compile_block(dtype) -> None:
    import test_ops

    torch._dynamo.reset()
    test_ops._dtype_for = lambda device: dtype
    try:
        test_ops._check_compiled(torch.compile(test_ops._attention_block, fullgraph=True), "cuda", 9, 13)
        print(f"compiled block {dtype}: ok")
    except BaseException as error:  # noqa: BLE001 - a debug aid prints everything
        print(f"compiled block {dtype}: FAILED")
        traceback.print_exc()
        show_chain(error)


def compile_bool_mask() -> None:
    """A broadcast bool mask through the compiled op (the dtype-view Inductor 2.11 rejected)."""
    torch._dynamo.reset()
    q, k, v = (torch.randn(2, 4, 33, 16, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
    mask = torch.rand(2, 1, 1, 33, device="cuda") > 0.3
    fn = torch.compile(lambda q, k, v: flash_inductor.flash_attention(q, k, v, attn_mask=mask), fullgraph=True)
    out = fn(q, k, v)
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
    out.sum().backward()
    print("compiled bool mask: max err", (out.double() - ref).abs().max().item())


if __name__ == "__main__":
    for part in (pregraph_of_mingpt, compile_bool_mask, lambda: compile_block(torch.float32),
                 lambda: compile_block(torch.float16)):
        try:
            part()
        except BaseException as error:  # noqa: BLE001 - a debug aid prints everything
            print(f"{getattr(part, '__name__', 'part')}: FAILED")
            show_chain(error)
