"""Launchers: validate what the kernels need, allocate outputs, pick configs, launch.

One module per path: ``forward`` (16-bit and fp32), ``fp8`` (the `fp8` schedule's forward),
``backward``, ``hopper`` / ``hopper_bwd`` (the Gluon Hopper kernels), ``decode``, ``sinks`` (the sinks'
gradient); ``common`` holds what
they share (``launcher``, through which every launch goes), ``visibility`` the one argument that says
which keys each query row sees (causal side, window, block-sparse layout), and ``call`` the record the
op describes a call with once (shapes, dtype, the resolved schedule, the visibility, scalar options).
Inputs arrive normalised by ``flash_inductor.api`` (4-D, validated). The contract of
``attention_forward`` / ``attention_backward`` is that of the reference path in
``flash_inductor.ops.reference``; tests compare the two.
"""

from .backward import attention_backward
from .common import (
    forward_outputs,
    interpreter_enabled,
    kernel_supports,
    schedule_switches,
    triton_available,
)
from .forward import attention_forward
from .sinks import sinks_backward
from .visibility import NO_MASKING, Visibility

__all__ = [
    "NO_MASKING",
    "Visibility",
    "attention_backward",
    "attention_forward",
    "forward_outputs",
    "interpreter_enabled",
    "kernel_supports",
    "schedule_switches",
    "sinks_backward",
    "triton_available",
]
