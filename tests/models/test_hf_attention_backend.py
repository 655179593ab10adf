"""``attn_implementation="inductor_stable"`` (flash_inductor/transformers.py) on HF transformers models
built from tiny random configs: each family against ``attn_implementation="eager"``, outputs and
gradients, and what each HF attention feature turns into at the op's boundary.

fp32: ours must match eager to fp32 rounding. bf16: the project's tolerance rule at model level,
with the fp32 eager model as the truth: ``err(ours) <= 2 * err(eager bf16) + floor``.

The fuller matrix (every family in bf16, plain ``torch.compile`` with Inductor) carries the
``full_matrix`` marker and runs only when ``-m`` names it (``-m full_matrix``; tests/conftest.py).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import model_zoo
from helpers import DEVICE
from model_zoo import CASES, output_tensor

transformers = pytest.importorskip("transformers")
NAME = "inductor_stable"

# fp32 against eager: rounding only. The CPU path matches eager to a few ulps; the CUDA kernels sum
# in another order (blocked, online softmax), a few ulps of the larger terms.
OUT_TOL = dict(rtol=1e-5, atol=2e-5) if DEVICE == "cpu" else dict(rtol=1e-4, atol=1e-4)
GRAD_TOL = dict(rtol=1e-4, atol=2e-5) if DEVICE == "cpu" else dict(rtol=1e-3, atol=1e-4)

FAMILIES = ("llama", "mistral", "qwen2", "gpt2", "bert", "t5", "vit")
# Mistral's window (4) is shorter than the sequence (16), so the band is part of every mask.
_OVERRIDES = {"mistral": dict(sliding_window=4)}


@pytest.fixture(scope="module", autouse=True)
def registered():
    import flash_inductor.transformers as fit

    return fit.register()


@pytest.fixture
def calls(monkeypatch):
    """Every flash_attention call the integration makes: (args, kwargs) with tensors' shapes."""
    import flash_inductor.transformers as fit

    seen = []
    real = fit.flash_attention

    def spy(*args, **kwargs):
        seen.append(dict(kwargs, query=args[0].shape, key=args[1].shape,
                         mask=None if kwargs.get("attn_mask") is None else kwargs["attn_mask"].dtype))
        return real(*args, **kwargs)

    monkeypatch.setattr(fit, "flash_attention", spy)
    return seen


def _pair(family: str, dtype=torch.float32, **overrides):
    """(ours, eager) with the same weights, in training mode (the zoo's dropouts are 0)."""
    case = CASES[family]
    overrides = {**_OVERRIDES.get(family, {}), **overrides}
    torch.manual_seed(0)
    eager = case.build("eager", **overrides)
    ours = case.build(NAME, **overrides)
    ours.load_state_dict(eager.state_dict())
    return ours.to(DEVICE, dtype).train(), eager.to(DEVICE, dtype).train()


def _run(model, inputs):
    """(hidden states, {parameter: grad}) for a fixed random upstream gradient.

    Padded positions are left out of both: a padded query that sees no key at all (Mistral's
    window over the padding) is 0 in ours and a uniform average in eager, and neither is used."""
    model.zero_grad(set_to_none=True)
    out = output_tensor(model(**inputs))
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.device, out.dtype)
    mask = inputs.get("attention_mask")
    if mask is not None and "decoder_input_ids" not in inputs:
        grad_out = grad_out * mask[..., None].to(out.dtype)
        out = out * mask[..., None].to(out.dtype)
    out.backward(grad_out)
    return out.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _inputs(family: str, padded: bool = True):
    inputs = CASES[family].inputs(padded, 0, DEVICE)
    return inputs


@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_eager_fp32(family, calls):
    ours, eager = _pair(family)
    inputs = _inputs(family)
    out, grads = _run(ours, inputs)
    ref, ref_grads = _run(eager, inputs)
    assert calls, "the model never called flash_inductor"
    torch.testing.assert_close(out, ref, **OUT_TOL)
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], **GRAD_TOL, msg=lambda m: f"{name}: {m}")


def _assert_within_rule(name, ours, eager, truth):
    """Model-level tolerance: |ours - truth| <= 2 |eager - truth| + 2 eps(bf16) |truth|."""
    truth = truth.double()
    err = (ours.double() - truth).abs().max().item()
    base = (eager.double() - truth).abs().max().item()
    floor = 2 * torch.finfo(torch.bfloat16).eps * truth.abs().max().item()
    assert err <= 2 * base + floor, f"{name}: error {err:.3e} > 2 x eager bf16 {base:.3e} + floor {floor:.3e}"


def _check_bf16(family):
    ours, eager = _pair(family, torch.bfloat16)
    _, truth_model = _pair(family, torch.float32)
    inputs = _inputs(family)
    if family == "vit":
        inputs = dict(pixel_values=inputs["pixel_values"].to(torch.bfloat16))
    out, grads = _run(ours, inputs)
    ref, ref_grads = _run(eager, inputs)
    truth, truth_grads = _run(truth_model, _inputs(family))
    _assert_within_rule("out", out, ref, truth)
    # Gradients of the attention parameters: the model-wide ones (an FFN's below a ReLU) carry every
    # other bf16 rounding of the model too, which one seed's comparison cannot separate from ours.
    attention = ("attn", "attention", "Attention", "self_attn")
    checked = [k for k in truth_grads if any(a in k for a in attention)]
    assert checked
    for key in checked:
        _assert_within_rule(key, grads[key], ref_grads[key], truth_grads[key])


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_family_within_tolerance_bf16(family):
    _check_bf16(family)


@pytest.mark.full_matrix
@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in ("llama", "bert")])
def test_family_within_tolerance_bf16_full(family):
    _check_bf16(family)


def test_causal_without_mask_uses_is_causal_and_gqa(calls):
    """Unpadded causal LM: no mask is built, the op gets is_causal=True; K/V keep their 2 heads."""
    ours, _ = _pair("llama")
    ours(**_inputs("llama", padded=False))
    assert all(c["mask"] is None and c["is_causal"] and c["window"] is None for c in calls), calls
    assert all(c["enable_gqa"] and c["key"][1] == model_zoo.KV_HEADS and c["query"][1] == model_zoo.HEADS
               for c in calls)
    module = ours.layers[0].self_attn
    assert all(c["scale"] == module.scaling for c in calls)


def test_padding_and_sliding_window_reach_the_op_as_a_bool_mask(calls):
    ours, eager = _pair("mistral")
    inputs = _inputs("mistral")
    out, _ = _run(ours, inputs)
    assert all(c["mask"] == torch.bool and not c["is_causal"] for c in calls)
    # The window (4) also reaches the op, one key wider than HF's band, so the kernels skip the
    # tiles outside it while the mask decides every visible key (the outputs below match eager).
    assert calls and all(c["window"] == (4, 0) for c in calls), calls
    # The window matters at this length: without it the outputs differ.
    wide, _ = _pair("mistral", sliding_window=None)
    assert not torch.allclose(_run(wide, inputs)[0], out, atol=1e-4)
    torch.testing.assert_close(out, _run(eager, inputs)[0], **OUT_TOL)


def test_cross_attention_and_position_bias(calls):
    """T5: encoder self-attention with the relative bias as a float mask, decoder causal
    self-attention, and cross-attention over the encoder's keys (S != L)."""
    ours, _ = _pair("t5")
    ours(**_inputs("t5"))
    shapes = {(c["query"][2], c["key"][2]) for c in calls}
    assert (model_zoo.SEQ - 3, model_zoo.SEQ) in shapes, shapes  # decoder queries over encoder keys
    assert any(c["mask"] == torch.float32 for c in calls)


def test_dropout_in_training_only(calls):
    ours, eager = _pair("llama", attention_dropout=0.5)
    inputs = _inputs("llama")
    torch.manual_seed(1)
    first = output_tensor(ours(**inputs))
    torch.manual_seed(1)
    again = output_tensor(ours(**inputs))
    torch.manual_seed(2)
    other = output_tensor(ours(**inputs))
    assert all(c["dropout_p"] == 0.5 for c in calls)
    torch.testing.assert_close(first, again)
    assert not torch.allclose(first, other)
    calls.clear()
    ours.eval(), eager.eval()
    with torch.no_grad():
        torch.testing.assert_close(output_tensor(ours(**inputs)), output_tensor(eager(**inputs)), **OUT_TOL)
    assert all(c["dropout_p"] == 0.0 for c in calls)


def test_output_attentions_falls_back_to_eager_with_one_warning():
    import flash_inductor.transformers as fit

    fit._warned.clear()
    ours, eager = _pair("llama")
    inputs = _inputs("llama")
    with pytest.warns(UserWarning, match="output_attentions=True runs the model's eager attention"):
        got = ours(**inputs, output_attentions=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours(**inputs, output_attentions=True)  # once only
    ref = eager(**inputs, output_attentions=True)
    assert len(got.attentions) == len(ref.attentions)
    for a, b in zip(got.attentions, ref.attentions):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(got.last_hidden_state, ref.last_hidden_state)


def test_from_pretrained_and_auto_classes(tmp_path):
    ours, eager = _pair("llama")
    eager.save_pretrained(tmp_path)
    loaded = transformers.AutoModel.from_pretrained(tmp_path, attn_implementation=NAME).to(DEVICE)
    assert loaded.config._attn_implementation == NAME
    fresh = transformers.AutoModel.from_config(eager.config, attn_implementation=NAME)
    assert fresh.config._attn_implementation == NAME
    inputs = _inputs("llama")
    with torch.no_grad():
        torch.testing.assert_close(output_tensor(loaded.eval()(**inputs)), output_tensor(eager.eval()(**inputs)),
                                   **OUT_TOL)


def test_register_is_idempotent_and_refuses_flash_names():
    import flash_inductor.transformers as fit
    from transformers import PreTrainedModel

    assert fit.register() == fit.register() == NAME == fit.NAME
    assert NAME in transformers.AttentionInterface._global_mapping
    assert "flash_inductor" not in transformers.AttentionInterface._global_mapping
    guard = PreTrainedModel._check_and_adjust_attn_implementation
    assert guard._flash_inductor_guard and not getattr(guard.__wrapped__, "_flash_inductor_guard", False)
    for name in ("flash_inductor", "my_flash", "org/kernel", "x_sdpa"):
        with pytest.raises(ValueError, match=NAME):
            fit.register(name)


@pytest.mark.parametrize("how", ["from_config", "set_attn_implementation"])
def test_the_former_name_raises_with_the_new_one(how):
    """``"flash_inductor"`` contains "flash": transformers would hand it FlashAttention's arguments
    or swap it for a Hub kernel, so selecting it names the new name instead."""
    ours, _ = _pair("llama")
    with pytest.raises(ValueError, match=f'attn_implementation="{NAME}"'):
        if how == "from_config":
            transformers.AutoModel.from_config(ours.config, attn_implementation="flash_inductor")
        else:
            ours.set_attn_implementation("flash_inductor")


def test_no_name_transformers_treats_specially():
    """Each substring test transformers makes on implementation names misses ours."""
    from transformers.utils.generic import is_flash_attention_requested

    assert not is_flash_attention_requested(requested_attention_implementation=NAME)
    assert not any(part in NAME for part in ("flash", "sdpa", "flex_attention", "paged", "|", "/", ":"))


def test_import_flash_inductor_does_not_import_transformers():
    import subprocess
    import sys

    code = "import sys, flash_inductor; print('transformers' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_compiled_with_aot_eager_and_with_our_backend():
    """Plain torch.compile (AOTAutograd, our op's fake kernel and autograd) and our backend's pass,
    which finds the op already in place and rewrites nothing."""
    ours, eager = _pair("llama", num_hidden_layers=1)
    inputs = _inputs("llama")
    ref, ref_grads = _run(eager, inputs)
    torch._dynamo.reset()
    compiled = torch.compile(copy.deepcopy(ours), backend="aot_eager")
    out, grads = _run(compiled, inputs)
    torch.testing.assert_close(out, ref, **OUT_TOL)
    name = "layers.0.self_attn.q_proj.weight"
    torch.testing.assert_close(grads["_orig_mod." + name] if "_orig_mod." + name in grads else grads[name],
                               ref_grads[name], **GRAD_TOL)

    import flash_inductor

    torch._dynamo.reset()
    # The pass (as flash_inductor.backend runs it) sees our op and has nothing to rewrite.
    compiled = torch.compile(copy.deepcopy(ours), backend=model_zoo.compile_backend(full=False))
    out, _ = _run(compiled, inputs)
    torch.testing.assert_close(out, ref, **OUT_TOL)
    report = flash_inductor.last_report()
    assert report is not None and report.rewritten == 0 and not report.sites, str(report)


@pytest.mark.full_matrix
@pytest.mark.parametrize("backend", ["inductor", "flash_inductor"])
@pytest.mark.parametrize("family", ["llama", "t5"])
def test_inductor_compile_full(family, backend):
    """Full Inductor code generation, plain and with our backend (whose pass leaves our op alone)."""
    import flash_inductor

    ours, eager = _pair(family)
    inputs = _inputs(family)
    ref, ref_grads = _run(eager, inputs)
    torch._dynamo.reset()
    compiled = torch.compile(ours, backend=flash_inductor.backend if backend == "flash_inductor" else "inductor")
    out, grads = _run(compiled, inputs)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads.get(name, grads.get("_orig_mod." + name)), grad, rtol=1e-3, atol=1e-4)
