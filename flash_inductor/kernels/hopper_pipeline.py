"""Pieces the Gluon Hopper kernels (hopper_fwd.py, hopper_bwd.py) share: a shared-memory ring that
owns its slot and phase arithmetic, a block-sparse layout's tile lists, and the types that let a
scalar argument sit in an aggregate whether Triton passed it as a tensor or specialised it to a
constant (an int argument equal to 1 arrives as a constexpr).

Ring protocol (Triton's ``Channel`` / FA3's ``PipelineState``, written for a linear count): the
i-th use of a ``NUM``-deep ring, counted from 0 over the kernel, is slot ``i % NUM`` in phase
``(i // NUM) & 1``. A producer waits for the slot to be free (its empty barrier), fills it and
arrives on its ready barrier (or lets TMA's transaction count do it); a consumer waits for ready
and releases with an arrive on empty. A fresh mbarrier counts as having completed the phase
before phase 0, so the producer's first pass over the ring waits on parity 1 and goes straight
through.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from triton.language.core import _aggregate as aggregate
from triton.language.core import base_value

# A scalar argument (a tensor, or a constexpr where Triton specialised it), and a buffer or
# barrier array that a configuration may not allocate (then constexpr None, never read).
Scalar = (gl.tensor, gl.constexpr)
MaybeSmem = (gl.shared_memory_descriptor, gl.constexpr)


@gluon.constexpr_function
def field(x):
    """An aggregate's member as given: a constexpr_function constructor receives constexprs
    unwrapped (an int, None), which the member keeps as a constexpr again."""
    return x if isinstance(x, base_value) else gl.constexpr(x)


@aggregate
class Ring:
    """The barriers of a ``NUM``-deep ring: ``ready`` and ``empty``, one mbarrier per slot (the
    module docstring's protocol). The buffers stay with their owners, indexed by ``slot``."""
    ready: gl.shared_memory_descriptor
    empty: MaybeSmem  # None for a ring whose consumers only meet (no producer waits)
    NUM: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, ready, empty, NUM):
        self.ready = field(ready)
        self.empty = field(empty)
        self.NUM = gl.constexpr(NUM)

    @gluon.jit
    def slot(self, i):
        return i % self.NUM

    @gluon.jit
    def phase(self, i):
        return (i // self.NUM) & 1

    @gluon.jit
    def free_phase(self, i):
        """The parity a producer waits on for use i's slot to be free: the previous pass's."""
        return ((i // self.NUM) & 1) ^ 1

    @gluon.jit
    def wait_free(self, slot, free_phase):
        """The producer's wait for a slot to be released (``free_phase``: of the use it is for)."""
        mbarrier.wait(self.empty.index(slot), free_phase)

    @gluon.jit
    def wait_ready(self, slot, phase):
        """The consumer's wait for the slot of a use in ``phase`` to be filled."""
        mbarrier.wait(self.ready.index(slot), phase)

    @gluon.jit
    def wait_free_at(self, slot, i):
        """``wait_free`` for use i, its phase taken at the wait."""
        mbarrier.wait(self.empty.index(slot), self.free_phase(i))

    @gluon.jit
    def wait_ready_at(self, slot, i):
        """``wait_ready`` for use i, its phase taken at the wait."""
        mbarrier.wait(self.ready.index(slot), self.phase(i))

    @gluon.jit
    def release(self, slot):
        mbarrier.arrive(self.empty.index(slot), count=1)


@aggregate
class TileLists:
    """A block-sparse layout's tile lists (``launch/block_tiles.py``): int32, one row a block,
    (count, tile, tile, ...), the batch and head dims ``stride_lb``/``stride_lh`` apart (0 where the
    layout broadcasts), rows ``list_stride`` apart."""
    base: gl.tensor
    stride_lb: Scalar
    stride_lh: Scalar
    list_stride: Scalar

    @gluon.constexpr_function
    def __init__(self, base, stride_lb, stride_lh, list_stride):
        self.base = field(base)
        self.stride_lb = field(stride_lb)
        self.stride_lh = field(stride_lh)
        self.list_stride = field(list_stride)

    @gluon.jit
    def row(self, b, h, start, BLOCK: gl.constexpr):
        """The list of the block that starts at row/key ``start`` (blocks of BLOCK), head h of batch b."""
        return self.base + b.to(gl.int64) * self.stride_lb + h * self.stride_lh + (start // BLOCK) * self.list_stride

