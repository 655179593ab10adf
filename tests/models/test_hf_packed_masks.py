"""``attn_implementation="inductor_stable"`` on padding-free packed batches (``position_ids``
restarting at 0 per sequence, ``use_cache=False``: the training path, where transformers composes
its packed block-diagonal mask): no ``L x L`` mask is built or read, and every result equals
``"eager"`` (which builds that mask), forward and every parameter's gradient, fp32.

* Families: Llama, Qwen2 and Qwen3 (full and sliding layers), Mistral (sliding everywhere),
  Gemma 2 (soft-capping, sliding), gpt-oss (sinks, sliding), Qwen2-MoE (sliding layers that pass
  attention no ``sliding_window``), Ministral 3 (passes attention no ``position_ids``); windows
  (4) are shorter than the sequences (up to 7), so a dropped window or packing fails.
* Batches: packed (two rows, each several sequences), padded (a 2-D mask: HF's mask, unchanged),
  plain (one sequence a row).
* The mask function alone: None only for causal (and sliding) AND packed, ``sdpa_mask``'s exact
  result for every other composition (overlays, chunks, bidirectional, padding).
* A mixed forward (Llama 4: chunked layers keep their mask, full layers none), a record never
  outliving its batch, and layers compiled one by one under an eager model.

CI runs this file on the pinned and on the newest transformers.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import DEVICE, assert_close_to_ref

transformers = pytest.importorskip("transformers")
from transformers import masking_utils  # noqa: E402

NAME = "inductor_stable"
# Two rows of 19 tokens; 19 is no other size of these models (hidden 64, heads 4, head_dim 16),
# so a tensor ending in (19, 19) can only be a mask or a score matrix over the whole row.
ROWS = ((5, 7, 4, 3), (6, 6, 7))
LENGTH = 19
# Padded batches against fp32 eager (see _assert_match): as tests/models/test_hf_attention_backend.py.
OUT_TOL = dict(rtol=1e-5, atol=2e-5) if DEVICE == "cpu" else dict(rtol=1e-4, atol=1e-4)
GRAD_TOL = dict(rtol=1e-4, atol=3e-5) if DEVICE == "cpu" else dict(rtol=1e-3, atol=1e-4)


@pytest.fixture(scope="module", autouse=True)
def registered():
    import flash_inductor.transformers as fit

    return fit.register()


@pytest.fixture
def attention_calls(monkeypatch):
    """Every call of our attention function (the mask it got, and the op it ran with its keywords)."""
    import flash_inductor.transformers as fit

    seen = dict(masks=[], ops=[])
    for attr, kind in (("flash_attention", "dense"), ("flash_attention_varlen", "varlen")):
        def spy(*args, _real=getattr(fit, attr), _kind=kind, **kwargs):
            seen["ops"].append((_kind, kwargs))
            return _real(*args, **kwargs)

        monkeypatch.setattr(fit, attr, spy)
    real_forward = fit.attention_forward

    def forward(module, query, key, value, attention_mask, **kwargs):
        seen["masks"].append(attention_mask)
        return real_forward(module, query, key, value, attention_mask, **kwargs)

    transformers.AttentionInterface.register(NAME, forward)
    yield seen
    transformers.AttentionInterface.register(NAME, real_forward)


class _SquareTensors(TorchDispatchMode):
    """Records every op whose output ends in (L, L): a mask or scores over a whole packed row."""

    def __init__(self, length):
        super().__init__()
        self.length, self.found = length, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and tuple(t.shape[-2:]) == (self.length, self.length):
                self.found.append(str(func))
        return out


def _config(family):
    common = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    hybrid = dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"])
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "mistral":
        return transformers.MistralConfig(**common, sliding_window=4)
    if family == "qwen2":
        return transformers.Qwen2Config(**common, use_sliding_window=True, **hybrid)
    if family == "qwen3":
        return transformers.Qwen3Config(**common, use_sliding_window=True, **hybrid)
    if family == "gemma2":
        return transformers.Gemma2Config(**common, attn_logit_softcapping=1.0, final_logit_softcapping=None,
                                         query_pre_attn_scalar=1, **hybrid)
    if family == "gpt_oss":
        return transformers.GptOssConfig(**common, num_local_experts=4, num_experts_per_tok=2, **hybrid)
    if family == "qwen2_moe":
        return transformers.Qwen2MoeConfig(**common, use_sliding_window=True, num_experts=2, num_experts_per_tok=1,
                                           moe_intermediate_size=32, shared_expert_intermediate_size=32, **hybrid)
    if family == "ministral3":
        if not hasattr(transformers, "Ministral3Config"):
            pytest.skip("this transformers has no Ministral 3")
        return transformers.Ministral3Config(**common)
    raise ValueError(family)


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gpt_oss", "qwen2_moe", "ministral3")
# gpt-oss hands its mask creation no position_ids: transformers composes no packing into its masks
# (its sliding band spans the row, and eager attends across sequences), so it is checked
# against each sequence alone, apart.
PACKED_MASK_FAMILIES = tuple(f for f in FAMILIES if f != "gpt_oss")
SLIDING = {"mistral", "qwen2", "qwen3", "gemma2", "qwen2_moe"}


def _pair(config):
    """(ours, eager): same weights, training mode; sinks (zero at init) made random so they matter."""
    torch.manual_seed(0)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # MoE experts as a loop: grouped_mm has no fp64 for the truth
    eager = transformers.AutoModel.from_config(config)
    with torch.no_grad():
        for name, p in eager.named_parameters():
            if "sinks" in name:
                p.normal_()
    ours = transformers.AutoModel.from_config(config.__class__.from_dict(config.to_dict()))
    ours.set_attn_implementation(NAME)
    ours.load_state_dict(eager.state_dict())
    return ours.to(DEVICE).train(), eager.to(DEVICE).train()


def _batch(kind):
    ids = torch.randint(3, 64, (2, LENGTH), generator=torch.Generator().manual_seed(3))
    batch = dict(input_ids=ids.to(DEVICE), use_cache=False)
    if kind == "packed":
        batch["position_ids"] = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in ROWS]).to(DEVICE)
    elif kind == "padded":
        mask = torch.ones_like(ids)
        mask[1, :5] = 0  # left padding
        batch["attention_mask"] = mask.to(DEVICE)
    return batch


def _packed_forward(model, **batch):
    return model(**batch).last_hidden_state


def _per_sequence_forward(model, input_ids, position_ids, **batch):
    """Each packed sequence alone, the outputs put back in place: what packing means."""
    rows = []
    for row, positions in zip(input_ids, position_ids):
        starts = [0, *(i for i in range(1, len(positions)) if positions[i] != positions[i - 1] + 1), len(positions)]
        rows.append(torch.cat([model(input_ids=row[None, a:b], **batch).last_hidden_state
                               for a, b in zip(starts[:-1], starts[1:])], dim=1))
    return torch.cat(rows)


def _run(model, batch, keep=None, forward=_packed_forward):
    model.zero_grad(set_to_none=True)
    out = forward(model, **batch)
    if keep is not None:  # padded queries see nothing: 0 in ours, a uniform average in eager; unused
        out = out * keep[..., None].to(out.dtype)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.device, out.dtype))
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_match(ours, eager, batch, reference=_packed_forward):
    """Ours against eager in fp64 (the truth), within the project's rule: at most twice fp32
    eager's own error plus a rounding floor (tests/helpers.assert_close_to_ref). ``reference``:
    how eager runs the batch (as given, or each packed sequence alone)."""
    keep = batch.get("attention_mask")
    out, grads = _run(ours, batch, keep)
    base, base_grads = _run(eager, batch, keep, reference)
    if keep is not None:
        # fp64 eager cannot run a padded batch: finfo.min plus a score is -inf there, a padded query's
        # row is NaN, and NaN keys reach every row in the next layer. fp32 eager is the reference.
        torch.testing.assert_close(out, base, **OUT_TOL)
        for name in base_grads:
            torch.testing.assert_close(grads[name], base_grads[name], **GRAD_TOL, msg=lambda m: f"{name}: {m}")
        return
    truth, truth_grads = _run(copy.deepcopy(eager).double(), batch, keep, reference)
    assert_close_to_ref("output", out, truth, base)
    assert grads.keys() == truth_grads.keys() and grads
    for name in truth_grads:
        assert_close_to_ref(name, grads[name], truth_grads[name], base_grads[name])


@pytest.mark.parametrize("family", PACKED_MASK_FAMILIES)
def test_packed_batch_builds_no_mask_and_matches_eager(family, attention_calls):
    ours, eager = _pair(_config(family))
    batch = _batch("packed")
    with _SquareTensors(LENGTH) as square:
        out, _ = _run(ours, batch)
    assert not square.found, f"(L, L) tensors on a packed batch: {sorted(set(square.found))}"
    assert attention_calls["masks"] and all(m is None for m in attention_calls["masks"])
    assert all(kind == "varlen" for kind, _ in attention_calls["ops"])
    windows = {kw["window_size"] for _, kw in attention_calls["ops"]}
    assert windows == ({(3, 0), (-1, -1)} if family in SLIDING - {"mistral"} else
                       {(3, 0)} if family == "mistral" else {(-1, -1)}), windows
    _assert_match(ours, eager, batch)
    # Eager on the packed row equals eager on each sequence alone here: the comparison is one of packing.
    _assert_match(ours, eager, batch, reference=_per_sequence_forward)


def test_gpt_oss_packed_batch_matches_each_sequence_alone(attention_calls):
    """gpt-oss (sinks, sliding): its full layers get no mask and run varlen from position_ids; its
    sliding band, which transformers builds over the whole row, is the packed pattern within each
    sequence, so those layers run varlen too."""
    ours, eager = _pair(_config("gpt_oss"))
    _assert_match(ours, eager, _batch("packed"), reference=_per_sequence_forward)
    assert attention_calls["ops"] and all(kind == "varlen" for kind, _ in attention_calls["ops"])
    assert {kw["window_size"] for _, kw in attention_calls["ops"]} == {(3, 0), (-1, -1)}


@pytest.mark.parametrize("kind", ["padded", "plain"])
@pytest.mark.parametrize("family", FAMILIES)
def test_padded_and_plain_batches_match_eager(family, kind, attention_calls):
    if (family, kind) == ("gemma2", "padded"):
        # Against fp32 eager alone, one gradient entry in 2048 lands 2x past GRAD_TOL (a cap of 1 on these
        # logits); test_hf_variants.test_gemma2_softcap checks Gemma 2 with padding at a size where it holds.
        pytest.skip("fp32 eager's own rounding; covered by test_hf_variants.test_gemma2_softcap")
    ours, eager = _pair(_config(family))
    _assert_match(ours, eager, _batch(kind))
    assert all(kind == "dense" for kind, _ in attention_calls["ops"])
    if kind == "padded":  # padding is HF's mask, as sdpa's mask function builds it
        assert all(m is not None and m.dtype == torch.bool for m in attention_calls["masks"])


@pytest.mark.parametrize("offsets", ["same", "coarser"])
def test_packed_batch_with_cu_seq_lens(offsets, attention_calls):
    """DataCollatorWithFlattening's cu_seq_lens beside the positions: the same sequences run varlen;
    other offsets (here one sequence per row) hold together with the positions, as a dense mask."""
    ours, eager = _pair(_config("qwen2"))
    batch = _batch("packed")
    lengths = [n for row in ROWS for n in row] if offsets == "same" else [LENGTH, LENGTH]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    batch.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths))
    _assert_match(ours, eager, batch)
    kinds = {kind for kind, _ in attention_calls["ops"]}
    assert kinds == ({"varlen"} if offsets == "same" else {"dense"}), kinds


def test_mixed_forward_keeps_chunked_masks(attention_calls):
    """Llama 4 on a packed batch: its chunked layers get HF's mask (the chunk overlay is not
    recognised), its full layers none, and the record of the full mask outlives the chunked one's
    creation within the forward."""
    config = transformers.Llama4TextConfig(
        hidden_size=64, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        num_local_experts=2, attention_chunk_size=4, layer_types=["chunked_attention", "full_attention"],
        no_rope_layers=[1, 0], moe_layers=[], interleave_moe_layer_step=0)
    ours, eager = _pair(config)
    batch = _batch("packed")
    _assert_match(ours, eager, batch)
    masks = attention_calls["masks"]
    assert any(m is None for m in masks) and any(m is not None for m in masks)


def test_record_never_outlives_its_batch(attention_calls):
    """Ministral 3 passes attention no position_ids: after a packed forward, a plain forward of the
    same shape must not reuse the packing, nor a packed forward of another packing the old one."""
    ours, eager = _pair(_config("ministral3"))
    packed = _batch("packed")
    _assert_match(ours, eager, packed)
    _assert_match(ours, eager, _batch("plain"))
    other = dict(packed, position_ids=torch.stack([torch.cat([torch.arange(n) for n in row])
                                                   for row in ((10, 9), (19,))]).to(DEVICE))
    _assert_match(ours, eager, other)


def test_two_models_keep_their_own_records():
    """A packed forward of one model, then a plain forward of another of the same shape: each
    attention reads its own config's record (DPO's policy and reference model)."""
    first, _ = _pair(_config("ministral3"))
    second, eager = _pair(_config("ministral3"))
    with torch.no_grad():
        first(**_batch("packed"))
        out = second(**_batch("plain")).last_hidden_state
        ref = eager(**_batch("plain")).last_hidden_state
    truth = copy.deepcopy(eager).double()(**_batch("plain")).last_hidden_state
    assert_close_to_ref("output", out, truth, ref)


def test_layers_compiled_one_by_one():
    """Each decoder layer compiled under an eager model (as FSDP2 training does): the mask is left
    out eagerly, and the compiled attention reads the record (a graph break) rather than drop it."""
    ours, eager = _pair(_config("qwen2_moe"))
    for layer in ours.layers:
        layer.compile(backend="aot_eager")
    torch._dynamo.reset()
    _assert_match(ours, eager, _batch("packed"))


# The mask function alone, against sdpa_mask on each composition transformers makes.

def _ids():
    return torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2]])


def _mask_kwargs(mask_function, **extra):
    config = transformers.LlamaConfig(hidden_size=16, num_attention_heads=1, num_hidden_layers=1,
                                      intermediate_size=16, vocab_size=8)
    return dict(dict(batch_size=1, q_length=8, kv_length=8, q_offset=0, kv_offset=0, mask_function=mask_function,
                     attention_mask=None, allow_is_causal_skip=False, dtype=torch.float32, config=config,
                     use_vmap=False, device="cpu"), **extra)


def _packed(fn):
    return masking_utils.and_masks(fn, masking_utils.packed_sequence_mask_function(_ids()))


SKIPPED = {
    "causal+packed": lambda: _packed(masking_utils.causal_mask_function),
    "sliding+packed": lambda: _packed(masking_utils.sliding_window_causal_mask_function(3)),
}
KEPT = {
    "causal": lambda: (masking_utils.causal_mask_function, {}),
    "chunked+packed": lambda: (
        _packed(masking_utils.chunked_causal_mask_function(3, torch.zeros(1, dtype=torch.long))), {}),
    "or-overlay+packed": lambda: (_packed(masking_utils.or_masks(masking_utils.causal_mask_function,
                                                                 lambda b, h, q, k: k == 0)), {}),
    "and-overlay+packed": lambda: (_packed(masking_utils.and_masks(masking_utils.causal_mask_function,
                                                                   lambda b, h, q, k: k != 2)), dict(use_vmap=True)),
    "bidirectional+packed": lambda: (_packed(masking_utils.bidirectional_mask_function), {}),
    "blockwise+packed": lambda: (masking_utils.or_masks(_packed(masking_utils.causal_mask_function),
                                                        masking_utils.blockwise_overlay(_ids() * 0 - 1)), {}),
    "causal+packed, padding": lambda: (_packed(masking_utils.causal_mask_function),
                                       dict(attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool))),
}


@pytest.mark.parametrize("case", sorted(SKIPPED))
def test_mask_function_skips_packed_causal(case):
    from flash_inductor.transformers_masks import attention_mask_function, recorded_packing

    kwargs = _mask_kwargs(SKIPPED[case]())
    assert masking_utils.sdpa_mask(**kwargs) is not None  # what "sdpa" builds here
    assert attention_mask_function(**kwargs) is None

    class Attention(torch.nn.Module):
        config = kwargs["config"]

    record = recorded_packing(Attention(), 1, 8, torch.device("cpu"))
    assert record is not None and torch.equal(record.ids, _ids())
    assert record.windows == ({3} if case.startswith("sliding") else {None})


@pytest.mark.parametrize("case", sorted(KEPT))
def test_mask_function_keeps_every_other_mask(case):
    from flash_inductor.transformers_masks import attention_mask_function

    fn, extra = KEPT[case]()
    kwargs = _mask_kwargs(fn, **extra)
    expected = masking_utils.sdpa_mask(**kwargs)
    got = attention_mask_function(**kwargs)
    assert got is not None and torch.equal(got, expected)
