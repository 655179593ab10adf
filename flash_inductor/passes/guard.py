"""The pass never breaks a compile: every site is matched and rewritten under a guard.

A model that runs must keep running once compiled with the backend, whatever the pass makes of
its attention. Two guards give that:

* ``site.guarded`` runs one pattern on one node. An exception there (a pattern meeting a graph
  it was not written for) is logged with its traceback at DEBUG and becomes a :class:`KeptSite`
  whose reason names the error; the pass goes on with the next node.
* :func:`checked_insertion` wraps the insertion of a replacement, and :func:`check_replacement`
  runs the inserted nodes on the fake tensors dynamo recorded for the graph (its FakeTensorMode
  and shape environment), so the op's own argument checks -- shapes, head counts, dtypes,
  devices, mask broadcast -- and its fake kernel see exactly what they will see when the graph
  runs. If any node fails, or the replacement's shape, dtype or device differ from the attention
  it replaces, the inserted nodes are erased, the graph is as it was, and the site is kept with
  the reason.

A graph without fake values (``torch.fx.symbolic_trace``) cannot be checked this way: its
rewrites are inserted unchecked, as they always were.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

log = logging.getLogger("flash_inductor")


class Rejected(Exception):
    """A replacement that must not go in; the message is the report's reason."""


def describe_error(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


# ------------------------------------------------------------------------------------------
# Checked insertion
# ------------------------------------------------------------------------------------------


@contextlib.contextmanager
def checked_insertion(graph: fx.Graph) -> Iterator[Callable[[], list[fx.Node]]]:
    """Erase every node inserted in the block if the block raises (the caller then keeps the site).

    Yields a function listing the nodes inserted so far, in graph order. Until the caller
    replaces the site's output, which it does after the block, they have no users but each other.
    """
    before = set(graph.nodes)

    def inserted() -> list[fx.Node]:
        return [n for n in graph.nodes if n not in before]

    try:
        yield inserted
    except BaseException:
        for node in reversed(inserted()):
            graph.erase_node(node)
        raise


def check_replacement(new_nodes: list[fx.Node], original: fx.Node, replacement: fx.Node) -> None:
    """Run ``new_nodes`` on fake tensors; raise :class:`Rejected` if one fails or the replacement
    does not have the original's shape, dtype and device. Sets ``example_value`` on the new nodes
    (a later site of the same graph may read them)."""
    fake_mode = _fake_mode(new_nodes)
    if fake_mode is None:
        return  # no fake values to run on (a symbolically traced graph): inserted unchecked
    values: dict[fx.Node, Any] = {}
    try:
        with fake_mode:
            for node in new_nodes:
                values[node] = _run(node, values)
    except _Unknown:
        return
    except Exception as error:  # noqa: BLE001 -- the op's own checks speak for themselves
        log.debug("flash_inductor: the replacement of %s fails on fake tensors", original.name, exc_info=True)
        raise Rejected(f"the op would not take it: {describe_error(error)}") from error
    got, want = values.get(replacement), original.meta.get("example_value")
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            raise Rejected(f"the replacement gives {type(got).__name__}, not a tensor")
        same_shape = got.dim() == want.dim() and all(
            statically_known_true(a == b) for a, b in zip(got.shape, want.shape))
        if not same_shape or got.dtype != want.dtype or got.device != want.device:
            raise Rejected(f"the replacement would give {_meta(got)} where the attention gives {_meta(want)}")
    for node, value in values.items():
        if node is not replacement and "example_value" not in node.meta:
            node.meta["example_value"] = value


def _meta(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {t.dtype} on {t.device}"


class _Unknown(Exception):
    """An input of the replacement has no recorded value: nothing to check against."""


def _fake_mode(nodes: list[fx.Node]):
    for node in nodes:
        for arg in node.all_input_nodes:
            fake_mode = getattr(arg.meta.get("example_value"), "fake_mode", None)
            if fake_mode is not None:
                return fake_mode
    return None


def _value(node: fx.Node, values: dict) -> Any:
    if node in values:
        return values[node]
    if "example_value" in node.meta:
        return node.meta["example_value"]
    raise _Unknown(node.name)


def _run(node: fx.Node, values: dict) -> Any:
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: _value(n, values))
    if node.op == "call_function":
        return node.target(*args, **kwargs)
    if node.op == "call_method":
        self_arg, *rest = args
        return getattr(self_arg, node.target)(*rest, **kwargs)
    raise _Unknown(f"{node.op} {node.name}")


def keep_reason(error: BaseException) -> str:
    """The report's reason for a site whose rewrite raised ``error``."""
    if isinstance(error, Rejected):
        return str(error)
    return f"the rewrite failed ({describe_error(error)}); kept as written"


def log_rewrite_failure(site_name: str, error: BaseException) -> None:
    if not isinstance(error, Rejected):
        log.debug("flash_inductor: rewriting %s failed; the site is kept", site_name, exc_info=error)
