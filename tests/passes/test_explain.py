"""``flash_inductor.explain`` and the report it returns.

Covers: the report's fields (``sites``, ``status``, ``reason``, ``module``, ``rewritten``) and its
table (expecttest goldens, one of them HF GPT-2); a fresh compile every time, even when the model
was compiled before and Inductor's caches are on; graph breaks; a call that compiles nothing; a
configured backend's ``explain``; the one-line INFO summary every compile logs; module paths that
name modules of the model given (decorated forwards, attention processors, wrappers).
"""

from __future__ import annotations

import functools
import importlib.util
import logging

import expecttest
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import flash_inductor
from flash_inductor.passes.report import REPORTS
from helpers import randn
from model_zoo import inductor_codegen_skipped

E, H, L = 16, 2, 7

pytestmark = pytest.mark.usefixtures("fresh_compiler")


class _Attention(nn.Module):
    """q/k/v projections around one site: SDPA, or hand-written that returns its probabilities
    (HF output_attentions=True), which must be kept."""

    def __init__(self, returns_probs: bool):
        super().__init__()
        self.qkv, self.returns_probs = nn.Linear(E, 3 * E), returns_probs

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], L, 3, H, E // H).permute(2, 0, 3, 1, 4)
        if not self.returns_probs:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2), None
        probs = (q @ k.transpose(-2, -1) * 0.5).softmax(dim=-1)
        return (probs @ v).transpose(1, 2).flatten(2), probs


class _Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_Attention(returns_probs=False), _Attention(returns_probs=True)])

    def forward(self, x):
        x, _ = self.blocks[0](x)
        x, probs = self.blocks[1](x)
        return x, probs


def _x(seed=0):
    return randn((2, L, E), torch.float32, "cpu", seed)


class TestReportTable(expecttest.TestCase):
    def test_sites_with_module_paths(self):
        model = _Stack()
        with torch.no_grad():
            report = flash_inductor.explain(model, _x())
        self.assertExpectedInline(str(report), """\
flash_inductor: rewrote 1 of 2 attention sites
  module    node                          pattern      status     reason
  blocks.0  scaled_dot_product_attention  sdpa         rewritten  causal
  blocks.1  probs                         handwritten  kept       the attention probabilities (probs) are also used by output (e.g. returned as attention weights)""")
        self.assertEqual([(s.module, s.status) for s in report.sites], [("blocks.0", "rewritten"), ("blocks.1", "kept")])
        self.assertEqual(report.rewritten, 1)
        self.assertIs(report.sites, report.records)

    @pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
    def test_gpt2(self):
        from model_zoo import CASES

        torch.manual_seed(0)
        model = CASES["gpt2"].build("eager").eval()
        with torch.no_grad():
            report = flash_inductor.explain(model, **CASES["gpt2"].inputs(padded=True, device="cpu"))
        self.assertExpectedInline(str(report), """\
flash_inductor: rewrote 2 of 2 attention sites
  module    node           pattern                    status     reason
  h.0.attn  attn_output    handwritten_additive_mask  rewritten  float mask, scale 0.3536
  h.1.attn  attn_output_4  handwritten_additive_mask  rewritten  float mask, scale 0.3536""")


def test_explain_recompiles_even_when_caches_could_serve_it():
    """The model was compiled before with the same backend, and dynamo's, AOTAutograd's and the
    FX graph caches are on: explain still runs the pass and reports every site, every time, given
    the model or its compiled wrapper."""
    model = _Stack()
    x = _x()
    with torch._functorch.config.patch(enable_autograd_cache=True), torch._inductor.config.patch(fx_graph_cache=True):
        with torch.no_grad():
            compiled = torch.compile(model, backend=flash_inductor.backend)
            compiled(x)
            compiled(x)  # dynamo's cache: no second compile
            # One compile. Its pass may not have run: the on-disk caches outlive the process, so an
            # earlier run (or test) can serve this graph. Either way the caches now hold it.
            assert len(REPORTS) == 1
            first = flash_inductor.explain(model, x)
            second = flash_inductor.explain(compiled, x)  # the compiled module itself: its original
    for report in (first, second):
        assert report.note is None and [s.status for s in report.sites] == ["rewritten", "kept"], report


def test_graph_break_lists_the_sites_of_every_graph():
    def two_graphs(q):
        a = F.scaled_dot_product_attention(q, q, q)
        torch._dynamo.graph_break()
        return F.scaled_dot_product_attention(a, q, q, is_causal=True)

    q = randn((1, H, L, 4), torch.float32, "cpu", 1)
    report = flash_inductor.explain(two_graphs, q)
    assert [(s.pattern, s.status, s.reason) for s in report.sites] == [
        ("sdpa", "rewritten", "no mask"), ("sdpa", "rewritten", "causal")], report
    assert report.rewritten == 2 and report.summary() == "flash_inductor: rewrote 2 of 2 attention sites"


def test_nothing_compiled_is_an_error():
    with pytest.raises(RuntimeError, match="no graph to the backend"):
        flash_inductor.explain(lambda x: x, torch.ones(2))


def test_configured_backend_explains_with_its_options():
    q = randn((1, H, L, 4), torch.float32, "cpu", 1)
    report = flash_inductor.make_backend(devices=("cuda",)).explain(F.scaled_dot_product_attention, q, q, q)
    (site,) = report.sites
    assert site.status == "kept" and site.reason == "device cpu is not in devices=('cuda',)"
    assert report.rewritten == 0


def test_every_compile_logs_a_one_line_summary(caplog):
    model = _Stack()
    with caplog.at_level(logging.INFO, logger="flash_inductor"), torch.no_grad():
        torch.compile(model, backend=flash_inductor.backend)(_x())
    summaries = [r.getMessage() for r in caplog.records if r.name == "flash_inductor" and r.levelno == logging.INFO]
    assert summaries == ["flash_inductor: rewrote 1 of 2 attention sites"]


def test_report_true_logs_the_table(caplog):
    model = _Stack()
    with caplog.at_level(logging.INFO, logger="flash_inductor"), torch.no_grad():
        torch.compile(model, backend=flash_inductor.make_backend(report=True))(_x())
    (message,) = [r.getMessage() for r in caplog.records if r.name == "flash_inductor" and r.levelno == logging.INFO]
    assert message == flash_inductor.last_report().format() and "blocks.1" in message


def test_report_true_shows_the_table_where_logging_would_hide_it(caplog, capsys):
    """Python's default setup drops INFO records: the table the user asked for goes to stderr."""
    caplog.set_level(logging.WARNING, logger="flash_inductor")
    with torch.no_grad():
        torch.compile(_Stack(), backend=flash_inductor.make_backend(report=True))(_x())
    assert flash_inductor.last_report().format() in capsys.readouterr().err
    assert not [r for r in caplog.records if r.name == "flash_inductor" and r.levelno == logging.INFO]


class _Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = _Attention(returns_probs=False)

    def forward(self, x):
        torch._dynamo.graph_break()  # dynamo traces the rest from this module's own frame
        return self.attn(x)[0]


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj, self.inner = nn.Linear(E, E), _Inner()

    def forward(self, x):
        return self.inner(self.proj(x))


def test_module_paths_after_a_graph_break_are_from_the_model_given():
    model = _Outer()
    with torch.no_grad():
        report = flash_inductor.explain(model, _x())
        plain = [s.module for r in REPORTS[-2:] for s in r.sites]  # what the frames themselves recorded
    assert [(s.module, s.status) for s in report.sites] == [("inner.attn", "rewritten")], report
    assert plain == ["attn"]


# ------------------------------------------------------------------------------------------
# Module paths as the model names them, whatever frame and containers dynamo traced through
# ------------------------------------------------------------------------------------------


def _passes_args_through(forward):
    """A decorator that hides ``self`` in ``*args`` (transformers' output-capturing decorators on
    Falcon and Bloom): dynamo then names the model ``L['args'][0]``."""

    @functools.wraps(forward)
    def wrapper(*args, **kwargs):
        return forward(*args, **kwargs)

    return wrapper


class _Processor:
    """A diffusers-style attention processor: a plain object that gets the module as an argument."""

    def __call__(self, attn, x):
        q, k, v = attn.qkv(x).view(x.shape[0], L, 3, H, E // H).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)


class _ProcessedAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.processor = nn.Linear(E, 3 * E), _Processor()

    def forward(self, x):
        return self.processor(self, x)


class _DecoratedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.h = nn.ModuleList([_ProcessedAttention(), _ProcessedAttention()])

    @_passes_args_through
    def forward(self, x):
        for block in self.h:
            x = block(x)
        return x


class _Wrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = _DecoratedModel()

    def forward(self, x):
        return self.transformer(x)


@pytest.mark.parametrize("root, prefix", [(_DecoratedModel, ""), (_Wrapper, "transformer.")], ids=["model", "wrapped"])
def test_module_paths_name_modules_of_the_model(root, prefix):
    """A decorated forward (``L['args'][0]``, reported as ``0.h.0`` before) and a processor
    object: every path is one of ``model.named_modules()``."""
    model = root()
    with torch.no_grad(), inductor_codegen_skipped():
        report = flash_inductor.explain(model, _x())
    assert [s.module for s in report.sites] == [f"{prefix}h.0", f"{prefix}h.1"], str(report)
    assert all(s.module in dict(model.named_modules()) for s in report.sites)


@pytest.mark.parametrize("dynamo_path, path", [
    ("L['self'].transformer.h[3].attn", "transformer.h.3.attn"),
    ("getattr(L['self'].h, '3').attn", "h.3.attn"),
    ("L['self']._modules['h']._modules['3'].attn", "h.3.attn"),
    ("L['args'][0].h.0.self_attention", "h.0.self_attention"),
    ("L['kwargs']['model'].h[0]", "h.0"),
    ("L['self'].__dict__['transformer_blocks'][0].attn1", "transformer_blocks.0.attn1"),
    ("L['self']", None),
])
def test_relative_module_path(dynamo_path, path):
    from flash_inductor.passes.site import relative_module_path

    assert relative_module_path(dynamo_path) == path
