"""TMA copies for Gluon kernels on Hopper: the load and store under the running Triton's names, and
a reduce-add from shared memory.

Triton 3.8 renamed ``tma.async_copy_global_to_shared`` / ``async_copy_shared_to_global`` to
``tma.async_load`` / ``async_store`` and kept the old names as aliases of the new; Triton 3.9
(torch 2.15) replaced the old names with functions that raise, and Triton 3.6-3.7 have only the
old names. ``tma_load`` / ``tma_store`` are whichever this Triton has, picked by feature: where
both exist they are one builtin, so the kernels compile to the same code on every version.

Triton 3.6's Gluon ``tma`` module (``gluon.language.nvidia.hopper.tma``) exposes loads and
stores but no reduce copy. Its IR builder has the operation (``ttng.async_tma_reduce``, which
Triton's own ``tensor_descriptor.atomic_add`` lowers to ``cp.reduce.async.bulk.tensor``), so
this module wraps it the way ``tma_store`` wraps the store: one thread of the warpgroup
issues it, it joins the same bulk async-group, and ``tma.store_wait`` waits for it to have read
its shared-memory source.

Why: the backward adds its dQ partial tiles into an fp32 buffer. One bulk reduction per tile
replaces one scalar ``red.global.add.f32`` per element and thread (32 of them per thread and
tile pair at E 128), and the L2 performs the adds.
"""

from triton._C.libtriton import gluon_ir, ir
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import tma

tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
tma_store = tma.async_store if hasattr(tma, "async_store") else tma.async_copy_shared_to_global

HAS_TMA_REDUCE = hasattr(gluon_ir.GluonOpBuilder, "create_async_tma_reduce") and hasattr(ir, "DESCRIPTOR_REDUCE_KIND")


@builtin
def async_reduce_add_shared_to_global(tensor_desc, coord, src, _semantic=None):
    """global[tensor_desc at coord] += src (a shared-memory tile in the descriptor's layout).
    Elements of the box outside the tensor are skipped, as a TMA store clips them."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)
