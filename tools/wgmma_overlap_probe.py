"""Which shapes of intra-warpgroup wgmma overlap ptxas keeps asynchronous, on a CPU machine.

    /work/venv36/bin/python tools/wgmma_overlap_probe.py        # a Triton with Gluon, no torch needed

The Hopper backward's lead "issue the next tile's Sᵀ before waiting for this tile's dQ GEMM"
(docs/hopper_backward.md) depends on ptxas: when it cannot prove that non-wgmma instructions leave
an in-flight wgmma's accumulator registers alone, it serialises every wgmma of the kernel and says
so (notes C7514/C7515), which costs more than any overlap gains. This compiles three toy kernels
for sm_90a, each a loop over tiles with two GEMMs a tile ("S", then "dQ", whose result the ALU
reads), and prints ptxas's serialisation notes:

  straight   no overlap: each tile waits for its own GEMMs (the kernel's shape today);
  carried    the next tile's S issued at the end of a tile and waited for in the next iteration
             (the async accumulator crosses the loop's back edge);
  unrolled   two tiles an iteration: tile B's S issued before tile A's final wait, and A's dQ
             read while it runs; no wgmma crosses the back edge.

With Triton 3.6's ptxas (2026-12-04): straight and unrolled compile without a note, carried
serialises (C7515). So the overlap needs the tile loop unrolled by two (or more), not a token
carried across iterations.
"""

from __future__ import annotations


def _kernels():
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma,
                                                                   warpgroup_mma_wait)

    @gluon.jit
    def _setup(X):
        """A 64 x 64 bf16 operand in shared memory, and a zero and a running fp32 accumulator."""
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, 64, 16])
        blocked: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
        operand = gl.allocate_shared_memory(gl.bfloat16, [64, 64],
                                            gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16))
        rows = gl.arange(0, 64, layout=gl.SliceLayout(1, blocked))
        cols = gl.arange(0, 64, layout=gl.SliceLayout(0, blocked))
        operand.store(gl.load(X + rows[:, None] * 64 + cols[None, :]))
        fence_async_shared()
        zero = gl.zeros([64, 64], gl.float32, layout=acc_layout)
        return operand, zero, zero

    @gluon.jit
    def _store(Y, total):
        rows = gl.arange(0, 64, layout=gl.SliceLayout(1, total.type.layout))
        cols = gl.arange(0, 64, layout=gl.SliceLayout(0, total.type.layout))
        gl.store(Y + rows[:, None] * 64 + cols[None, :], total)

    @gluon.jit
    def straight(X, Y, N):
        a, zero, total = _setup(X)
        for _ in range(N):
            s = warpgroup_mma_wait(num_outstanding=0, deps=(warpgroup_mma(a, a, zero, use_acc=False, is_async=True), ))
            dq = warpgroup_mma_wait(num_outstanding=0,
                                    deps=(warpgroup_mma(a, a, zero, use_acc=False, is_async=True), ))
            total += dq * 0.5 + s
        _store(Y, total)

    @gluon.jit
    def carried(X, Y, N):
        a, zero, total = _setup(X)
        s_tok = warpgroup_mma(a, a, zero, use_acc=False, is_async=True)
        for _ in range(N):
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, ))
            dq = warpgroup_mma_wait(num_outstanding=0,
                                    deps=(warpgroup_mma(a, a, zero, use_acc=False, is_async=True), ))
            s_tok = warpgroup_mma(a, a, zero, use_acc=False, is_async=True)  # the next tile's S
            total += dq * 0.5 + s  # this tile's dQ read while it runs
        warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, ))
        _store(Y, total)

    @gluon.jit
    def unrolled(X, Y, N):
        a, zero, total = _setup(X)
        for _ in range(N):
            s_a = warpgroup_mma_wait(num_outstanding=0,
                                     deps=(warpgroup_mma(a, a, zero, use_acc=False, is_async=True), ))
            dq_a_tok = warpgroup_mma(a, a, zero, use_acc=False, is_async=True)
            s_b_tok = warpgroup_mma(a, a, zero, use_acc=False, is_async=True)  # tile B's S, before A's wait
            dq_a = warpgroup_mma_wait(num_outstanding=1, deps=(dq_a_tok, ))
            total += dq_a * 0.5 + s_a  # tile A's dQ read while B's S runs
            s_b = warpgroup_mma_wait(num_outstanding=0, deps=(s_b_tok, ))
            dq_b = warpgroup_mma_wait(num_outstanding=0,
                                      deps=(warpgroup_mma(a, a, zero, use_acc=False, is_async=True), ))
            total += dq_b * 0.5 + s_b
        _store(Y, total)

    return {"straight": straight, "carried": carried, "unrolled": unrolled}


def main() -> int:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from tools.launch_sass import ptxas_usage

    signature = {"X": "*bf16", "Y": "*fp32", "N": "i32"}
    for name, kernel in _kernels().items():
        compiled = triton.compile(GluonASTSource(fn=kernel, signature=signature, constexprs={}),
                                  target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
        notes = ptxas_usage(compiled.asm["ptx"])["ptxas_warnings"]
        print(f"{name:9s} {'serialised: ' + '; '.join(notes) if notes else 'no serialisation note'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
