"""Names of monitored attention sites: the module that called attention, in eager or compiled code."""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

import torch

# Frames inside these files are plumbing between the model and the recording: skip them when
# looking for the caller. Our own code that merely calls flash_attention (tests, the stability
# suite) is not plumbing and is named like any user code.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PLUMBING = {os.path.join(_PACKAGE_DIR, "api.py"), os.path.join(_PACKAGE_DIR, "varlen.py"),
             os.path.join(_PACKAGE_DIR, "passes", "site.py")}
_MONITORING_DIR = os.path.dirname(os.path.abspath(__file__))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_MAX_FRAMES = 64


def _is_plumbing(filename: str) -> bool:
    return filename in _PLUMBING or filename.startswith(_MONITORING_DIR) or filename.startswith(_TORCH_DIR)


def _bound_object(frame) -> Any:
    """The first argument of the frame's function (``self`` of a method, whatever it is called)."""
    code = frame.f_code
    if code.co_argcount == 0:
        return None
    return frame.f_locals.get(code.co_varnames[0])


def eager_site_name(monitor: Any) -> str:
    """``"blocks.3.attn (model.py:57)"``: the nearest calling nn.Module and the line that called attention.

    Walks the Python stack, which costs microseconds; it only runs while a session is active.
    """
    frame = sys._getframe(1)
    location = None
    for _ in range(_MAX_FRAMES):
        if frame is None:
            break
        filename = os.path.abspath(frame.f_code.co_filename)
        if not _is_plumbing(filename):
            if location is None:
                location = f"{os.path.basename(filename)}:{frame.f_lineno}"
            owner = _bound_object(frame)
            if isinstance(owner, torch.nn.Module):
                return f"{monitor.module_name(owner)} ({location})"
        frame = frame.f_back
    return location or "<unknown>"


def graph_site_name(module_path: Optional[str], pattern: str, node_name: str) -> str:
    """``"blocks.3.attn (compiled handwritten_causal at matmul_1)"`` for a site the pass rewrote
    (``module_path`` as ``passes.site.module_path`` reads it from dynamo's module stack)."""
    return f"{module_path or '<model>'} (compiled {pattern} at {node_name})"
