"""``torch.func`` transforms (grad, vjp, jacrev, and vmap over them) on the registered ops.

A ``torch.library`` op's autograd (``register_autograd``) runs through an ``autograd.Function``
that torch builds without a ``setup_context``, and functorch refuses such a Function: under
``torch.func.grad`` every call raised "it must override the setup_context staticmethod", where
SDPA works. :func:`transform_function` wraps an op and its registered autograd pieces in a Function
of the form functorch takes, with a generated vmap rule (the op's own batching applies inside), so
per-sample gradients, ``vmap(grad(f))``, work too. The numbers are the op's: the same forward, the
same backward op. Forward-mode AD (``jvp``) stays unsupported, as it is on the op.
"""

from __future__ import annotations

from typing import Callable

import torch

try:  # the interpreter stack is private: without it, calls keep the op (and its refusal)
    from torch._C._functorch import TransformType, peek_interpreter_stack
except ImportError:  # pragma: no cover
    TransformType = peek_interpreter_stack = None


def under_transform() -> bool:
    """Whether a torch.func transform other than functionalisation is tracing this eager call.
    Under torch.compile the registered op is what dynamo and AOTAutograd trace, as before."""
    if peek_interpreter_stack is None or torch.compiler.is_compiling():
        return False
    interpreter = peek_interpreter_stack()
    return interpreter is not None and interpreter.key() != TransformType.Functionalize


def transform_function(name: str, op: Callable, setup_context: Callable, backward: Callable,
                       differentiable_outputs: int = 2) -> type:
    """A ``torch.autograd.Function`` named ``name`` whose forward is ``op`` and whose autograd is
    the op's registered ``setup_context`` / ``backward`` (``backward(ctx, *grads)`` returns one
    gradient per input); outputs past ``differentiable_outputs`` get no gradient."""

    def forward(*args):
        return op(*args)

    def setup(ctx, inputs, output):
        setup_context(ctx, inputs, output)
        if len(output) > differentiable_outputs:
            ctx.mark_non_differentiable(*output[differentiable_outputs:])

    return type(name, (torch.autograd.Function,), dict(
        __doc__=f"{name}: the op under torch.func transforms (ops/functorch.py).",
        generate_vmap_rule=True, forward=staticmethod(forward), setup_context=staticmethod(setup),
        backward=staticmethod(backward)))
