"""The pass never fails a compile: what it cannot rewrite it keeps, with the reason.

* A pattern that raises while matching keeps its site: reported as kept with the error, logged
  with its traceback at DEBUG, and the compile goes on (the other sites are still rewritten).
* A rewrite that raises, or that the op would reject, or whose result would not have the
  attention's shape, leaves the graph exactly as it was (no half-inserted nodes) and keeps the
  site; every replacement is first run on the graph's fake tensors, through the op's own checks.
* What SDPA broadcasts, the rewrite takes: a K/V head dim of 1 without ``enable_gqa`` (HF Falcon
  with ``multi_query=True`` under "sdpa": the compile used to fail with "query has 4 heads but
  key/value have 1") and size-1 batch dims, with gradients of K/V's own shape.

Compiled with the pass and AOTAutograd (``model_zoo.pass_then_aot_eager``).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from flash_inductor.passes import handwritten_site, sdpa
from flash_inductor.passes.graph_pass import FlashAttentionPass
from flash_inductor.passes.report import REPORTS
from flash_inductor.passes.site import rewritten_attention
from model_zoo import pass_then_aot_eager

B, H, L, S, E = 2, 4, 5, 7, 8

pytestmark = pytest.mark.usefixtures("fresh_compiler")


def _randn(*shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


class TwoSites(nn.Module):
    """An SDPA call, then hand-written attention over its output."""

    def forward(self, q, k, v):
        x = F.scaled_dot_product_attention(q, k, v)
        return torch.softmax(x @ k.transpose(-2, -1) * 0.3, dim=-1) @ v


class Sdpa(nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.kwargs = kwargs

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, **self.kwargs)


def _qkv(kv_batch=B, kv_heads=H, q_batch=B, q_heads=H):
    return (_randn(q_batch, q_heads, L, E, seed=1), _randn(kv_batch, kv_heads, S, E, seed=2),
            _randn(kv_batch, kv_heads, S, E, seed=3))


def _sites():
    return [(r.pattern, r.status, r.reason) for report in REPORTS for r in report.sites]


def _compile_and_compare(module, inputs, grad=True):
    """Compiled and eager outputs and input gradients, compared (fp64: 1e-10 relative)."""
    runs = []
    for fn in (torch.compile(module, backend=pass_then_aot_eager()), module):
        leaves = [t.detach().clone().requires_grad_(grad) for t in inputs]
        out = fn(*leaves)
        if grad:
            out.backward(_randn(*out.shape, seed=9))
        runs.append([out.detach(), *(t.grad for t in leaves if grad)])
    for i, (a, b) in enumerate(zip(*runs)):
        assert a.shape == b.shape, f"tensor {i}: {tuple(a.shape)} vs {tuple(b.shape)}"
        assert (a - b).abs().max() <= 1e-10 * b.abs().max(), f"tensor {i} (0: output, then gradients)"


def _pass_only(module, *inputs):
    captured = {}

    def backend(gm, example_inputs):
        FlashAttentionPass()(gm.graph)
        gm.graph.lint()
        gm.recompile()
        captured["gm"] = gm
        return gm.forward

    torch.compile(module, backend=backend)(*inputs)
    return captured["gm"]


# ------------------------------------------------------------------------------------------
# Failures are kept, never raised
# ------------------------------------------------------------------------------------------


def test_a_pattern_that_raises_keeps_its_site_and_logs_the_traceback(monkeypatch, caplog):
    def broken(node):
        raise RuntimeError("a graph this pattern was not written for")

    monkeypatch.setattr(sdpa, "_pattern_sdpa_1", broken)
    with caplog.at_level(logging.DEBUG, logger="flash_inductor"):
        _compile_and_compare(TwoSites(), _qkv())
    assert [s[:2] for s in _sites()] == [("sdpa", "kept"), ("handwritten_plain", "rewritten")], _sites()
    assert "RuntimeError: a graph this pattern was not written for" in _sites()[0][2]
    logged = [r for r in caplog.records if r.levelno == logging.DEBUG and r.exc_info]
    assert any("pattern sdpa failed" in r.getMessage() for r in logged), [r.getMessage() for r in caplog.records]


def test_a_rewrite_that_raises_leaves_the_graph_as_it_was(monkeypatch, caplog):
    def broken(graph, plan):
        graph.call_function(torch.neg, (plan.query.node,))  # a node is inserted before the failure
        raise RuntimeError("layout trouble")

    monkeypatch.setattr(handwritten_site, "_mask", broken)
    module, inputs = TwoSites(), _qkv()
    before = [n.format_node() for n in _pass_only(module, *inputs).graph.nodes]
    assert not any("neg" in line for line in before)
    with caplog.at_level(logging.DEBUG, logger="flash_inductor"):
        _compile_and_compare(module, inputs)
    assert [s[:2] for s in _sites()][-1] == ("handwritten_plain", "kept"), _sites()
    assert "the rewrite failed (RuntimeError: layout trouble)" in _sites()[-1][2]
    assert any(r.exc_info for r in caplog.records if "rewriting" in r.getMessage())


def test_a_call_the_op_rejects_is_kept_with_the_ops_message():
    """SDPA takes dropout_p=1.0 (every weight dropped); the op takes [0, 1)."""
    module, inputs = Sdpa(dropout_p=1.0), _qkv()
    gm = _pass_only(module, *inputs)
    assert [s[:2] for s in _sites()] == [("sdpa", "kept")]
    reason = _sites()[0][2]
    assert "the op would not take it: ValueError: flash_attention: dropout_p must be a real number in [0, 1)" in reason
    assert not [n for n in gm.graph.nodes if n.target is rewritten_attention]
    torch.manual_seed(0)
    out = torch.compile(module, backend=pass_then_aot_eager())(*inputs)
    torch.manual_seed(0)
    torch.testing.assert_close(out, module(*inputs), rtol=0, atol=0)


def test_a_replacement_of_the_wrong_shape_is_kept(monkeypatch):
    real = handwritten_site._from_layout
    def transposed(graph, node, groups):  # (..., L, Ev) -> (..., Ev, L): a wrong layout
        return graph.call_method("transpose", (real(graph, node, groups), -2, -1))

    monkeypatch.setattr(handwritten_site, "_from_layout", transposed)
    _compile_and_compare(TwoSites(), _qkv(), grad=False)
    assert _sites()[-1][:2] == ("handwritten_plain", "kept"), _sites()
    assert "the replacement would give (2, 4, 8, 5) torch.float64 on cpu where the attention gives " \
           "(2, 4, 5, 8) torch.float64 on cpu" in _sites()[-1][2]


# ------------------------------------------------------------------------------------------
# What SDPA broadcasts is rewritten
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shapes", [
    dict(kv_heads=1),  # Falcon-7B: multi-query K/V straight into SDPA, no enable_gqa
    dict(kv_batch=1),  # K/V shared by the batch
    dict(kv_batch=1, kv_heads=1),
    dict(q_batch=1),  # one query against a batch of K/V
], ids=["kv_heads_1", "kv_batch_1", "kv_batch_and_heads_1", "q_batch_1"])
@pytest.mark.parametrize("mask", [None, "padding"])
def test_sdpa_broadcast_is_rewritten_and_matches_eager(shapes, mask):
    inputs = list(_qkv(**shapes))
    module = Sdpa()
    if mask == "padding":
        attn_mask = torch.ones(B, 1, 1, S, dtype=torch.bool)
        attn_mask[1, ..., -2:] = False
        module = Sdpa(attn_mask=attn_mask)
    _compile_and_compare(module, inputs)
    assert [s[:2] for s in _sites()] == [("sdpa", "rewritten")], _sites()
