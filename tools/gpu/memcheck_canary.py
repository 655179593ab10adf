"""A load one element past a tensor's end, for ``steps.sh memcheck`` to run under compute-sanitizer
before the address tests: the step fails unless the sanitizer reports it, so the tests it runs next
cannot pass with nothing watching (a sanitizer that does not follow the process, or PyTorch's
caching allocator hiding the overrun inside one of its own blocks: the step disables it)."""

import torch
import triton
import triton.language as tl


@triton.jit
def _read_past_end(src, dst, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs + 1))  # lane BLOCK - 1 reads src[BLOCK]


if __name__ == "__main__":
    src = torch.arange(1024, dtype=torch.float32, device="cuda")
    dst = torch.empty(1024, dtype=torch.float32, device="cuda")
    _read_past_end[(1,)](src, dst, BLOCK=1024)
    torch.cuda.synchronize()
    print("canary ran: a run without a sanitizer ends here")
