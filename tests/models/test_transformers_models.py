"""Real models through the pass: HF ``transformers`` families from tiny random configs, each with
``attn_implementation="eager"`` and ``"sdpa"`` where it has both, and ``nn.TransformerEncoder``.

The families (``model_zoo.CASES``) span decoder-only models (GPT-2; Llama, Mistral with a sliding
window, Qwen2: GQA; Falcon-7B's multi-query layout; Falcon and Bloom with ALiBi; GPT-NeoX and Phi:
parallel residual, partial rotary, Phi's qk-norm; OPT; Gemma 2's soft-capping; gpt-oss's attention
sinks), encoders (BERT, RoBERTa, DeBERTa-v2's disentangled attention), encoder-decoders with
cross-attention (T5, BART), vision (ViT; Swin: windows, shift mask, relative position bias) and
speech (Whisper, Wav2Vec2). Tiny random configs (``model_zoo.py``), nothing downloaded. For every model and implementation:

* training (``model.train()``, a right-padded batch, so the masks are real): every attention
  site is reported under the expected pattern and module path, rewritten, or kept with a reason
  that says why rewriting would change the result; the compiled output and every parameter's
  gradient match eager fp32 within 1e-4 relative (to the tensor's largest entry, or its layer's);
* inference (``eval()`` under ``no_grad``, the same padded batch): the same, on the output;
* ``explain`` names every site by a path of ``model.named_modules()``.

A representative subset runs by default (``ModelCase.default``: Llama, Falcon MQA, Falcon ALiBi,
BERT, T5 and nn.TransformerEncoder). The other families are marked ``models_full`` and run
only when ``-m`` names it (tests/conftest.py): ``-m models_full`` runs only them; the GPU suite
(tools/gpu/suite.sh) runs them with the rest of the file.

Then fp16 where eager overflows (GPT-2, Llama: QKᵀ > 65504, see ``model_zoo.Q_BIG``): the compiled
model is finite, and its output and parameter gradients are as close to an fp64 run of the same
weights as PyTorch's own non-overflowing fp16 attention (SDPA) gets: the project's rule
``err(ours) <= 2 * err(baseline) + floor``. And kept sites: ``output_attentions=True``.

Backend (``model_zoo.compile_backend``): ``flash_inductor.backend`` on CUDA; on CPU the same pass
and AOTAutograd with the graphs run as traced, because generating and compiling Inductor's C++
takes 30-45 s per graph on a small machine with a cold cache. Llama (eager) inference runs the
full backend on CPU too (Inductor's lowering of the op's backward is covered by test_backend.py
and test_pass_handwritten.py), and FLASH_INDUCTOR_TEST_FULL_INDUCTOR=1 makes every test use it.
The op itself runs its PyTorch reference path on CPU.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

import flash_inductor
from flash_inductor.passes.report import REPORTS
from helpers import DEVICE, FLOOR_ULPS, needs_transformers, randn
from model_zoo import (
    BATCH, CASES, OVERFLOW_CONFIG, SEQ, VOCAB, compile_backend, full_inductor_everywhere, inductor_codegen_skipped,
    make_qk_overflow, output_tensor,
)

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None

RTOL = 1e-4
# The one model compiled with full Inductor code generation on CPU as well (see the docstring).
FULL_INDUCTOR_ON_CPU = {("llama", "eager", "inference")}

pytestmark = pytest.mark.usefixtures("fresh_compiler")


def _params(names=None):
    out = []
    for name, case in CASES.items():
        if names is not None and name not in names:
            continue
        marks = [] if name == "torch_encoder" else [needs_transformers]
        if not case.default:
            marks.append(pytest.mark.models_full)
        out += [pytest.param(name, impl, id=f"{name}-{impl}", marks=marks) for impl in case.impls]
    return out


def _backend(name, impl, mode):
    return compile_backend(full_inductor_everywhere() or (name, impl, mode) in FULL_INDUCTOR_ON_CPU)


def _build(name, impl, **overrides):
    torch.manual_seed(0)
    return CASES[name].build(impl, **overrides).to(DEVICE)


def _sites():
    """Every site the pass reported since the test began (all graphs, in order)."""
    return [(r.module, r.pattern, r.status) for report in REPORTS for r in report.sites]


def _expected_sites(name, impl, training):
    """The expected sites, spelled as the per-compile reports record them. A compile's module paths
    are relative to the frame dynamo traced: after a graph break that can be an inner module
    (torch 2.11 resumes T5's decoder in its own frame: ``block.0...`` for ``decoder.block.0...``;
    a training step of OPT, BART or Whisper resumes inside each layer: ``self_attn``). So a
    recorded path that is a dotted suffix of the expected one stands for it here; ``explain``
    (which knows the model) gives the full paths, tested below."""
    recorded = iter(_sites())
    expected = []
    for module, pattern, status in CASES[name].sites(impl, training):
        seen = next(recorded, (None,))[0]
        relative = seen if seen and module.endswith("." + seen) else module
        expected.append((relative, pattern, status))
    return expected


def _assert_kept_reasons(name, impl):
    """A kept site says why rewriting would change the result (``ModelCase.patterns``)."""
    reason = CASES[name].kept_reason(impl)
    for report in REPORTS:
        for site in report.sites:
            if not site.rewritten:
                assert reason is not None and reason in site.reason, _report_text()


def _report_text():
    return "\n".join(report.format() for report in REPORTS)


def _forward_backward(model, inputs, params, grad_seed=7):
    out = output_tensor(model(**inputs))
    grad_out = randn(out.shape, out.dtype, out.device, grad_seed)
    out.backward(grad_out)
    return [out.detach()] + [p.grad for p in params]


def _assert_rel_close(name, ours, eager, scale=None):
    """max|ours - eager| <= RTOL * scale, scale = max|eager| unless given."""
    if eager is None or ours is None:
        assert ours is None and eager is None, f"{name}: gradient is None on one side only"
        return
    assert ours.shape == eager.shape, f"{name}: shape {tuple(ours.shape)} != {tuple(eager.shape)}"
    err = (ours.double() - eager.double()).abs().max().item()
    scale = eager.double().abs().max().item() if scale is None else scale
    assert err <= RTOL * scale, f"{name}: max error {err:.3e} > {RTOL} x {scale:.3e}"


def _layer_scales(names, grads):
    """Per parameter, the largest eager gradient entry of its layer (the parameters of one module).

    A tensor's own largest entry is no scale for a gradient that is exactly zero in exact
    arithmetic: a key projection's bias (BERT's ``key.bias``) adds the same q·b to every key of a
    row, which the softmax ignores, so both sides hold only rounding noise (~1e-9). Measured
    against its layer, it is compared with the weight gradient built from the same dK terms."""
    layer_max = {}
    for name, grad in zip(names, grads):
        if grad is not None:
            layer = name.rpartition(".")[0]
            layer_max[layer] = max(layer_max.get(layer, 0.0), grad.double().abs().max().item())
    return [layer_max.get(name.rpartition(".")[0]) for name in names]


# ------------------------------------------------------------------------------------------
# fp32: training and inference, every model and implementation
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, impl", _params())
def test_training_sites_and_gradients_match_eager(name, impl):
    eager = _build(name, impl).train()
    ours = copy.deepcopy(eager)
    compiled = torch.compile(ours, backend=_backend(name, impl, "training"))
    inputs = CASES[name].inputs(padded=True)
    got = _forward_backward(compiled, inputs, list(ours.parameters()))
    want = _forward_backward(eager, inputs, list(eager.parameters()))
    assert _sites() == _expected_sites(name, impl, training=True), _report_text()
    _assert_kept_reasons(name, impl)
    _assert_rel_close("output", got[0], want[0])
    names = [n for n, _ in eager.named_parameters()]
    for param_name, a, b, scale in zip(names, got[1:], want[1:], _layer_scales(names, want[1:])):
        _assert_rel_close(param_name, a, b, scale)


@pytest.mark.parametrize("name, impl", _params())
def test_inference_sites_and_output_match_eager(name, impl):
    eager = _build(name, impl).eval()
    compiled = torch.compile(copy.deepcopy(eager), backend=_backend(name, impl, "inference"))
    inputs = CASES[name].inputs(padded=True)
    with torch.no_grad():
        got, want = (output_tensor(m(**inputs)) for m in (compiled, eager))
    assert _sites() == _expected_sites(name, impl, training=False), _report_text()
    _assert_kept_reasons(name, impl)
    _assert_rel_close("output", got, want)


@pytest.mark.parametrize("name, impl", _params())
def test_explain_names_modules_of_the_model(name, impl):
    """Every site's module is a path of ``model.named_modules()`` (the paths of the inference
    sites, which ``explain`` reports from the model it was given, whatever frame dynamo traced)."""
    model = _build(name, impl).eval()
    with torch.no_grad(), inductor_codegen_skipped():
        report = flash_inductor.explain(model, **CASES[name].inputs(padded=True))
    modules = dict(model.named_modules())
    assert all(site.module in modules for site in report.sites), str(report)
    assert [(s.module, s.pattern, s.status) for s in report.sites] == CASES[name].sites(impl, False), str(report)


@needs_transformers
@pytest.mark.parametrize("name, impl", [("llama", "eager")])
def test_attention_dropout_in_training_becomes_dropout_p(name, impl):
    """With attention dropout the sites are still rewritten, the op drawing the dropout (its RNG
    differs from eager's, so only the report and finiteness are checked here; test_dropout.py
    checks the op's dropout itself)."""
    model = _build(name, impl, attention_dropout=0.1).train()
    out = output_tensor(torch.compile(model, backend=_backend(name, impl, "training"))(**CASES[name].inputs(True)))
    assert out.isfinite().all()
    assert _sites() == _expected_sites(name, impl, training=True), _report_text()
    assert all("dropout 0.1" in r.reason for report in REPORTS for r in report.sites), _report_text()


@needs_transformers
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_packed_batch_runs_on_varlen(impl):
    """A padding-free batch (HF's ``DataCollatorWithFlattening``: position_ids restart at each
    document, no attention_mask): HF's causal AND same-document mask becomes the varlen op, output
    and every parameter gradient matching eager."""
    eager = _build("llama", impl).train()
    ours = copy.deepcopy(eager)
    compiled = torch.compile(ours, backend=_backend("llama", impl, "training"))
    starts = [[0, 5, 8], [0, 10]]  # two rows of 16 tokens: documents of 5, 3, 8 and 10, 6 tokens
    positions = torch.stack([torch.cat([torch.arange(b - a) for a, b in zip(row, row[1:] + [SEQ])]) for row in starts])
    inputs = dict(input_ids=torch.randint(3, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0)),
                  position_ids=positions, use_cache=False)
    inputs = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    got = _forward_backward(compiled, inputs, list(ours.parameters()))
    want = _forward_backward(eager, inputs, list(eager.parameters()))
    assert all(r.rewritten and "packed sequences on varlen, causal" in r.reason
               for report in REPORTS for r in report.sites) and _sites(), _report_text()
    _assert_rel_close("output", got[0], want[0])
    names = [n for n, _ in eager.named_parameters()]
    for param_name, a, b, scale in zip(names, got[1:], want[1:], _layer_scales(names, want[1:])):
        _assert_rel_close(param_name, a, b, scale)


# ------------------------------------------------------------------------------------------
# fp16 where eager overflows
# ------------------------------------------------------------------------------------------


def _overflow_model(name, impl, dtype, state):
    model = CASES[name].build(impl, **OVERFLOW_CONFIG[name])
    model.load_state_dict(state)
    return model.to(DEVICE, dtype).train()


@needs_transformers
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_fp16_where_eager_overflows(name, impl):
    torch.manual_seed(0)
    source = CASES[name].build("eager", **OVERFLOW_CONFIG[name])
    make_qk_overflow(name, source)
    state = source.state_dict()
    inputs = CASES[name].inputs(padded=True)

    def run(impl_, dtype, compile_=False):
        model = _overflow_model(name, impl_, dtype, state)
        fn = torch.compile(model, backend=_backend(name, impl_, "fp16")) if compile_ else model
        return _forward_backward(fn, inputs, list(model.parameters()))

    golden = run("eager", torch.float64)
    # PyTorch's own fp16 attention that does not overflow: SDPA computes QKᵀ and the scale in fp32.
    baseline = run("sdpa", torch.float16)
    assert all(t is None or t.isfinite().all() for t in baseline), "the fp16 SDPA baseline is not finite"
    if impl == "eager":
        assert not run("eager", torch.float16)[0].isfinite().all(), "eager fp16 did not overflow: the test lost its point"
    ours = run(impl, torch.float16, compile_=True)
    assert _sites() == _expected_sites(name, impl, training=True), _report_text()

    names = ["output"] + [n for n, _ in source.named_parameters()]
    for param_name, o, b, g in zip(names, ours, baseline, golden):
        if g is None:
            assert o is None, param_name
            continue
        assert o.dtype == torch.float16 and o.isfinite().all(), f"{param_name}: not finite"
        err = (o.double() - g).abs().max().item()
        base = (b.double() - g).abs().max().item()
        floor = FLOOR_ULPS * torch.finfo(torch.float16).eps * g.abs().max().item()
        assert err <= 2 * base + floor, (
            f"{param_name}: error {err:.3e} > 2 x fp16 SDPA's {base:.3e} + floor {floor:.3e}")


# ------------------------------------------------------------------------------------------
# Kept: the attention probabilities are returned
# ------------------------------------------------------------------------------------------


@needs_transformers
@pytest.mark.parametrize("name, impl", [("llama", "eager")])
def test_output_attentions_keeps_every_site(name, impl):
    """output_attentions=True returns each layer's probabilities: the op never forms them, so
    every site stays as written, and the model computes exactly what eager does."""
    eager = _build(name, impl).eval()
    compiled = torch.compile(copy.deepcopy(eager), backend=_backend(name, impl, "inference"))
    inputs = CASES[name].inputs(padded=True)
    with torch.no_grad():
        got, want = (m(**inputs, output_attentions=True) for m in (compiled, eager))
    sites = [(r.module, r.status) for report in REPORTS for r in report.sites]
    assert sites == [(module, "kept") for module in CASES[name].modules], _report_text()
    assert all("also used by" in r.reason for report in REPORTS for r in report.sites), _report_text()
    _assert_rel_close("output", got.last_hidden_state, want.last_hidden_state)
    assert len(got.attentions) == len(want.attentions) == len(CASES[name].modules)
    for i, (a, b) in enumerate(zip(got.attentions, want.attentions)):
        _assert_rel_close(f"attentions[{i}]", a, b)



@needs_transformers
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_explain_gives_full_module_paths_across_graph_breaks(impl):
    """T5 has two stacks with the same classes (encoder, decoder): when dynamo resumes in the
    decoder's own frame, explain() places its sites by the decoder's own parameters."""
    model = _build("t5", impl).eval()
    with torch.no_grad(), inductor_codegen_skipped():
        report = flash_inductor.explain(model, **CASES["t5"].inputs(padded=False))
    assert [(s.module, s.status) for s in report.sites] == [
        (module, status) for module, _, status in CASES["t5"].sites(impl, False)], str(report)
