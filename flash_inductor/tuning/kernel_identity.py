"""The source identity of a tuned kernel family: what a tuning table entry is valid for.

A table entry stays right for as long as the kernels it was tuned on compile to the same code.
The identity approximates "compiles the same" from the source alone, cheaply enough to compute
once per process on the first launch:

* each ``@triton.jit`` (or ``@gluon.jit``) kernel a family launches, and every such function it calls,
  transitively (found the way Triton's ``DependenciesFinder`` in ``triton/runtime/jit.py`` finds
  them: names and ``module.attr`` references resolved in the function's globals);
* each function as its parsed syntax tree with the docstring dropped (comments never reach the
  tree), written out without line numbers, positions or file names;
* the values of the constexpr globals those functions read (``LOG2E = tl.constexpr(...)``).

Why not what Triton or the old tables used:

* ``JITFunction.cache_key`` hashes the raw source and the starting line number, so a glossary
  added above a kernel, or a reworded comment inside it, would invalidate every entry;
* a hash of whole kernel files has the same flaw, and ties helpers to the files they sit in
  (helpers were once placed in particular files only to keep a hash stable);
* the torch version does not enter Triton's code generation for these kernels at all, and the
  Triton version is recorded per entry instead (see ``cache.py``: an entry tuned under another
  Triton is still a valid config, used after the exact-version entries).

Functions are named by ``__name__`` only, so moving a helper to another module keeps the
identity. The tree is written with a serialiser of our own rather than ``ast.dump``, which
changed its output between Python versions (3.13 omits empty fields); ours omits empty and
None fields on every version, so fields a newer Python adds (``type_params``) change nothing.

Not covered: what the launchers pass (``launch/`` choosing a constexpr's value). A launcher
change that makes the kernels compile differently for a bucket calls for a re-tune of it, as a
kernel change would; the PTX digests of tools/launch_sass.py show which variants it touched.

An edit that changes the tree but not the compiled code (a renamed local) does change the
identity; ``tools/carry_table_entries.py`` re-keys entries across such an edit after proving,
by compiling both versions for sm_90, that the code is the same.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import inspect
import textwrap
import types
from typing import Iterable

# The kernels each family of tuned launches starts ("module:function" under flash_inductor.kernels).
# The monitoring kernels launch with fixed sizes and belong to none. tests/tuning/test_tuning_tables.py
# checks that every kernel the launchers start is listed here.
KERNEL_FAMILIES: dict[str, tuple[str, ...]] = {
    "forward": ("attn_fwd:_attn_fwd",),
    "backward": ("attn_bwd:_attn_bwd_preprocess", "attn_bwd:_attn_bwd_row_reference",
                 "attn_bwd:_attn_bwd_dkdv", "attn_bwd:_attn_bwd_dq"),
    "fp8_forward": ("attn_fwd_fp8:_quantize_fp8", "attn_fwd_fp8:_attn_fwd_fp8"),
    "decode": ("attn_decode:_attn_decode_split", "attn_decode:_attn_decode_merge"),
    # The Gluon Hopper kernels whose speed their configs decide (tuning/hopper_configs.py); the
    # Triton passes around the backward (preprocess, key moments, dQ cast) take no tuned config.
    "gluon_forward": ("hopper_fwd:_attn_fwd_hopper",),
    "gluon_backward": ("hopper_bwd:_attn_bwd_hopper",),
}
# Kernels the launchers start with no tuned config, so no table entry depends on them: the Triton
# passes around the Gluon backward (the exact-Δ preprocess and its ds_up, K's moments and k̂, the
# centred dQ's finish, a split group's partial sums), and the sinks' gradient.
UNTUNED_KERNELS: tuple[str, ...] = (
    "exact_delta:_exact_delta_preprocess", "exact_delta:_ds_up_from_stats", "exact_delta:_key_moments",
    "exact_delta:_mean_key_from_moments", "exact_delta:_finish_dq_with_mean_key", "partial_sums:_sum_parts",
    "sinks:_sinks_grad_partials",
)
_KERNELS_PACKAGE = "flash_inductor.kernels"
IDENTITY_HEX_DIGITS = 16  # 64 bits: tells kernel versions apart, keeps the shipped table small


@functools.lru_cache(maxsize=None)
def _jit_types() -> tuple[type, ...]:
    """What ``@triton.jit`` returns: a JITFunction, or under TRITON_INTERPRET=1 an
    InterpretedFunction (the identity must not depend on how the kernels run)."""
    from triton.runtime.jit import JITFunction

    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return (JITFunction,)
    return (JITFunction, InterpretedFunction)


def _is_jit_function(value) -> bool:
    return isinstance(value, _jit_types()) and inspect.isfunction(getattr(value, "fn", None))


def _is_constexpr_function(value) -> bool:
    """``@constexpr_function`` (an aggregate's constructor, a layout helper): Python run at compile time."""
    from triton.runtime.jit import ConstexprFunction
    return isinstance(value, ConstexprFunction) and inspect.isfunction(getattr(value, "fn", None))


def _is_constant(value) -> bool:
    import triton.language as tl

    return isinstance(value, (tl.constexpr, bool, int, float, str))


def _canonical(node) -> str:
    """A syntax tree as text: node types and fields, no positions, no empty or None fields."""
    if isinstance(node, ast.AST):
        fields = [f"{name}={_canonical(value)}" for name, value in ast.iter_fields(node)
                  if value is not None and value != []]
        return f"{type(node).__name__}({','.join(fields)})"
    if isinstance(node, list):
        return "[" + ",".join(_canonical(item) for item in node) + "]"
    return repr(node)


def _function_tree(fn) -> ast.FunctionDef:
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    function = next(node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)))
    body = function.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        function.body = body[1:] or [ast.Pass()]
    return function


def _referenced_values(function: ast.FunctionDef, globals_: dict) -> Iterable[tuple[str, object]]:
    """(name, value) of each global the function reads, and of ``module.attr`` where the module is
    one of ours (``tl.*`` and ``triton.*`` are the compiler's own, versioned by the entry)."""
    for node in ast.walk(function):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in globals_:
            yield node.id, globals_[node.id]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            module = globals_.get(node.value.id)
            if isinstance(module, types.ModuleType) and module.__name__.startswith("flash_inductor"):
                if hasattr(module, node.attr):
                    yield node.attr, getattr(module, node.attr)


def _collect(jit_fn, functions: set[str], constants: dict[str, str]) -> None:
    fn = jit_fn.fn
    tree = _function_tree(fn)
    text = _canonical(tree)
    if text in functions:
        return
    functions.add(text)
    for name, value in _referenced_values(tree, fn.__globals__):
        if _is_jit_function(value):
            _collect(value, functions, constants)
        elif getattr(value, "__triton_aggregate__", False):
            # A Gluon/Triton aggregate: its constructor and methods, as Triton's own hash takes them.
            for member in value.hash_attrs:
                if _is_jit_function(member) or _is_constexpr_function(member):
                    _collect(member, functions, constants)
        elif _is_constexpr_function(value):
            _collect(value, functions, constants)
        elif _is_constant(value):
            constants[name] = repr(getattr(value, "value", value))


def _kernel(spec: str):
    module_name, name = spec.split(":")
    return getattr(importlib.import_module(f"{_KERNELS_PACKAGE}.{module_name}"), name)


def identity_of(kernels: Iterable) -> str:
    """The identity of kernels launched together: their trees, their callees' and the constexpr
    globals they read, hashed."""
    functions: set[str] = set()
    constants: dict[str, str] = {}
    for kernel in kernels:
        _collect(kernel, functions, constants)
    hasher = hashlib.sha256()
    for text in sorted(functions):
        hasher.update(b"fn " + text.encode() + b"\n")
    for name in sorted(constants):
        hasher.update(f"const {name}={constants[name]}\n".encode())
    return hasher.hexdigest()[:IDENTITY_HEX_DIGITS]


@functools.lru_cache(maxsize=None)
def family_identity(family: str) -> str:
    """The current kernels' identity for ``family`` (a KERNEL_FAMILIES key), computed once."""
    return identity_of(_kernel(spec) for spec in KERNEL_FAMILIES[family])


def family_identities() -> dict[str, str]:
    return {family: family_identity(family) for family in KERNEL_FAMILIES}
