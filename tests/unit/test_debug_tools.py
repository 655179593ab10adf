"""flash_inductor.debug on CPU at small sizes: the shadow check, baselines and the critical-length
bisection on train_stability's fp16 overflow model (hand-written attention, diagnosed as written,
benchmarks/overflow_demo.py), and the shadow check on our own op."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import assert_shadow_check_passes


@pytest.fixture(scope="module")
def demo():
    from benchmarks import overflow_demo

    return overflow_demo


@pytest.fixture
def debug():
    from flash_inductor import debug

    yield debug
    from flash_inductor.debug import sites

    assert not sites._ACTIVE, "a debug session was left active"


def _step(model, inputs, dtype):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        loss, _ = model(*inputs)
    loss.backward()
    return loss.detach()


def test_shadow_names_the_overflowing_site_and_why(demo, debug):
    model, inputs = demo.gpt(32)
    with debug.shadow(model) as check:
        loss = _step(model, inputs, torch.float16)
    report = check.report()
    assert not torch.isfinite(loss)
    assert [s for s in report.sites] == ["blocks.0.attn", "blocks.1.attn"]
    first = report.first_failure
    assert (first.site, first.result) == ("blocks.0.attn", "out")
    assert "q·kᵀ" in report.cause and "65504" in report.cause
    text = str(report)
    assert "first failure: blocks.0.attn out" in text and "non-finite input" in text  # layer 1 gets NaN


def test_shadow_in_fp32_holds_every_result(demo, debug):
    model, inputs = demo.gpt(32)
    with debug.shadow(model) as check:
        _step(model, inputs, torch.float32)
    report = check.report()
    assert report.first_failure is None, str(report)
    results = {(c.site, c.result) for c in report.checks if c.compared}
    assert results == {(s, r) for s in ("blocks.0.attn", "blocks.1.attn") for r in ("out", "dq", "dk", "dv")}


def test_shadow_changes_nothing_and_is_gone_after_the_block(demo, debug):
    model, inputs = demo.gpt(32)
    reference = _step(model, inputs, torch.float32)
    grads = [p.grad.clone() for p in model.parameters()]
    with debug.shadow(model):
        inside = _step(model, inputs, torch.float32)
    assert torch.equal(inside, reference)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    assert model.__dict__.get("_compiled_call_impl") is None


def test_shadow_checks_our_op(debug):
    assert_shadow_check_passes(11, is_causal=True)


def test_baseline_flags_the_overflowing_site_first(demo, debug, tmp_path):
    model, inputs = demo.gpt(32)
    with debug.record_baseline(model) as recorder:
        for _ in range(2):
            _step(model, inputs, torch.float32)
    path = recorder.save(tmp_path / "baseline.json")
    saved = json.loads(path.read_text())
    assert saved["calls"] == {"blocks.0.attn": 2, "blocks.1.attn": 2}
    assert {"qk_absmax", "lse_max", "out_absmax", "dq_absmax", "masked_rows"} <= set(saved["sites"]["blocks.0.attn"])

    with debug.compare_to_baseline(model, path, factor=4) as comparison:
        _step(model, inputs, torch.float16)
    report = comparison.report()
    assert report.sites[0] == "blocks.0.attn"
    assert report.first.stat in ("out_absmax", "out_nonfinite") and report.first.phase == "forward"
    assert "q·kᵀ" in report.cause
    assert [f.event for f in report.flags] == sorted(f.event for f in report.flags)

    with debug.compare_to_baseline(model, path, factor=4) as comparison:
        _step(model, inputs, torch.float32)
    assert comparison.report().flags == [], str(comparison.report())


def test_bisect_finds_the_critical_length(demo, debug):
    lines = []
    result = debug.bisect_length(demo.ramp_gpt, "fp16", min_length=16, max_length=1024, progress=lines.append)
    assert demo.RAMP_LENGTH / 2 <= result.critical_length <= 2 * demo.RAMP_LENGTH
    assert result.critical_length == demo.RAMP_LENGTH  # exact here: the overflow starts at that length
    assert result.site == "blocks.0.attn" and "q·kᵀ" in result.cause
    assert len(lines) == len(result.probes) and lines[0].startswith("length      16: ok")


def test_bisect_cli(demo, capsys, tmp_path):
    from flash_inductor.debug.__main__ import main

    out = tmp_path / "bisect.json"
    assert main(["bisect-length", "benchmarks.overflow_demo:ramp_gpt", "--dtype", "fp16", "--min-length", "64",
                 "--max-length", "256", "--step", "8", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "critical length in fp16: 128" in captured.out and "blocks.0.attn" in captured.out
    assert "length      64: ok" in captured.err
    assert json.loads(out.read_text())["critical_length"] == 128


def test_errors_name_the_argument(debug):
    with pytest.raises(ValueError, match="dtype must be one of"):
        debug.bisect_length(lambda n: None, "fp8")
    with pytest.raises(TypeError, match="nn.Module"):
        debug.shadow(lambda x: x)


@pytest.mark.parametrize("impl", ["eager", "inductor_stable"])
def test_shadow_on_hf_llama_in_fp16(impl, debug):
    """HF Llama in fp16 whose q·kᵀ overflows (model_zoo.make_qk_overflow): its eager attention is
    diagnosed as written; the same weights on attn_implementation="inductor_stable" hold."""
    pytest.importorskip("transformers")
    import model_zoo
    import flash_inductor.transformers  # noqa: F401  (registers the name)

    torch.manual_seed(0)
    model = model_zoo.CASES["llama"].build(impl, **model_zoo.OVERFLOW_CONFIG["llama"])
    model_zoo.make_qk_overflow("llama", model)
    model = model.half()
    with debug.shadow(model) as check:
        model(**model_zoo.token_inputs(False, 0, "cpu")).last_hidden_state.float().sum().backward()
    report = check.report()
    assert report.sites == ["layers.0.self_attn", "layers.1.self_attn"]
    if impl == "eager":
        assert report.first_failure.site == "layers.0.self_attn" and "q·kᵀ" in report.cause, str(report)
    else:
        assert report.first_failure is None, str(report)


def test_bisect_with_the_tolerance_criterion(demo, debug):
    """A shadow check at every length: the first length that overflows also breaks the tolerance."""
    result = debug.bisect_length(demo.ramp_gpt, "fp16", min_length=64, max_length=256, step=64,
                                 criterion="tolerance")
    assert [p.length for p in result.probes] == [64, 128]
    assert result.critical_length == 128 and result.site == "blocks.0.attn"


def test_shadow_on_nn_multihead_attention(debug):
    """nn.TransformerEncoder: the pass's MHA sites (projections in the prologue/epilogue)."""
    import model_zoo

    torch.manual_seed(0)
    model = model_zoo.TorchEncoder().train()
    with debug.shadow(model) as check:
        model(**model_zoo.encoder_inputs(False, 0, "cpu")).sum().backward()
    report = check.report()
    assert report.sites == ["encoder.layers.0.self_attn", "encoder.layers.1.self_attn"]
    assert report.first_failure is None and {c.result for c in report.checks} == {"out"}, str(report)
