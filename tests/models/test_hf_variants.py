"""``attn_implementation="inductor_stable"`` on the model families whose transformers code
branches on FlashAttention or passes it packed sequences, sinks or soft-capping: each against
``"eager"``, forward and every parameter's gradient, fp32, tiny random configs, on the installed
transformers (CI runs this file on the pinned and on the newest release).

* Qwen2-VL / Qwen2.5-VL vision towers, two images of different sizes in one call (their
  FlashAttention branch packs the images with ``cu_seq_lens``; ours must keep them apart);
* gpt-oss: learned sinks (``s_aux``) and a sliding window;
* Gemma 2: logit soft-capping (``softcap``) with a sliding window;
* Llama 4: chunked attention (HF refuses every "flash" name for it);
* a packed Llama batch (``DataCollatorWithFlattening``'s restarting ``position_ids``, with and
  without its ``cu_seq_lens``/``max_length`` keywords), against eager on each sequence alone.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

NAME = "inductor_stable"
OUT_TOL = dict(rtol=1e-5, atol=2e-5)
GRAD_TOL = dict(rtol=1e-4, atol=3e-5)


@pytest.fixture(scope="module", autouse=True)
def registered():
    import flash_inductor.transformers as fit

    return fit.register()


@pytest.fixture
def ops(monkeypatch):
    """The op each attention call of ours ran: "dense" or "varlen", with its keywords."""
    import flash_inductor.transformers as fit

    seen = []
    for attr, kind in (("flash_attention", "dense"), ("flash_attention_varlen", "varlen")):
        def spy(*args, _real=getattr(fit, attr), _kind=kind, **kwargs):
            seen.append((_kind, kwargs))
            return _real(*args, **kwargs)

        monkeypatch.setattr(fit, attr, spy)
    return seen


def _pair(model_class, config):
    """(ours, eager), same weights, training mode; parameters HF initialises to zero (sinks)
    are made random so that they matter."""
    torch.manual_seed(0)
    config._attn_implementation = "eager"
    eager = model_class(config)
    with torch.no_grad():
        for name, p in eager.named_parameters():
            if "sinks" in name:
                p.normal_()
    ours = model_class(config.__class__.from_dict(config.to_dict()))
    ours.set_attn_implementation(NAME)
    ours.load_state_dict(eager.state_dict())
    return ours.train(), eager.train()


def _out(result):
    if isinstance(result, torch.Tensor):
        return result
    for key in ("last_hidden_state", "pooler_output", "logits"):
        value = getattr(result, key, None)
        if isinstance(value, torch.Tensor):
            return value
    return result[0]


def _run(model, call, keep=None):
    """Output and gradients; ``keep`` (B, L) leaves padded queries out of both (a query that sees
    no key is 0 in ours and a uniform average in eager, and neither is used)."""
    model.zero_grad(set_to_none=True)
    out = _out(call(model))
    if keep is not None:
        out = out * keep[..., None].to(out.dtype)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(7)))
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_match(ours, eager, call, keep=None):
    out, grads = _run(ours, call, keep)
    ref, ref_grads = _run(eager, call, keep)
    torch.testing.assert_close(out, ref, **OUT_TOL)
    assert grads.keys() == ref_grads.keys() and grads
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], **GRAD_TOL, msg=lambda m: f"{name}: {m}")


def _vision_inputs(config, grids):
    grid_thw = torch.tensor(grids)
    patches = int(grid_thw.prod(-1).sum())
    width = config.in_channels * config.temporal_patch_size * config.patch_size ** 2
    return torch.randn(patches, width, generator=torch.Generator().manual_seed(1)), grid_thw


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_vision_tower_two_images(family, ops):
    if family == "qwen2_vl":
        from transformers.models.qwen2_vl import modeling_qwen2_vl as m

        config = m.Qwen2VLVisionConfig(depth=2, embed_dim=32, hidden_size=32, num_heads=2, patch_size=2,
                                       spatial_merge_size=2, temporal_patch_size=1, in_channels=2)
        model_class = m.Qwen2VisionTransformerPretrainedModel
    else:
        from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as m

        # window_size 8 with patch 2 and merge 2: windows of 2x2 merged patches, one full block.
        config = m.Qwen2_5_VLVisionConfig(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                                          out_hidden_size=32, patch_size=2, spatial_merge_size=2,
                                          temporal_patch_size=1, in_channels=2, window_size=8,
                                          fullatt_block_indexes=[1])
        model_class = m.Qwen2_5_VisionTransformerPretrainedModel
    ours, eager = _pair(model_class, config)
    pixels, grid_thw = _vision_inputs(config, [[1, 4, 6], [1, 6, 4]])
    _assert_match(ours, eager, lambda model: model(pixels, grid_thw=grid_thw))
    assert ops


def _text_config(cls, **extra):
    return cls(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, vocab_size=64, pad_token_id=0, bos_token_id=1,
               eos_token_id=2, **extra)


def _tokens(length=12, batch=2):
    return torch.randint(3, 64, (batch, length), generator=torch.Generator().manual_seed(3))


def test_gpt_oss_sinks(ops):
    config = _text_config(transformers.GptOssConfig, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                          layer_types=["sliding_attention", "full_attention"])
    ours, eager = _pair(transformers.GptOssModel, config)
    ids = _tokens()
    _assert_match(ours, eager, lambda model: model(input_ids=ids))
    assert ops and all(kw["sinks"] is not None for _, kw in ops)
    sinks = [n for n, _ in ours.named_parameters() if n.endswith("sinks")]
    assert sinks and all(ours.get_parameter(n).grad.abs().sum() > 0 for n in sinks)


def test_gemma2_softcap(ops):
    # A cap of 1 on logits of spread ~1: the tanh is far from linear, so the cap matters.
    config = _text_config(transformers.Gemma2Config, attn_logit_softcapping=1.0, final_logit_softcapping=None,
                          query_pre_attn_scalar=1, sliding_window=4,
                          layer_types=["sliding_attention", "full_attention"])
    ours, eager = _pair(transformers.Gemma2Model, config)
    ids = _tokens()
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    _assert_match(ours, eager, lambda model: model(input_ids=ids, attention_mask=mask), keep=mask)
    assert ops and all(kw["softcap"] == 1.0 for _, kw in ops)


def test_llama4_chunked_attention(ops):
    config = _text_config(transformers.Llama4TextConfig, intermediate_size_mlp=64, num_local_experts=2,
                          attention_chunk_size=4, layer_types=["chunked_attention", "full_attention"],
                          no_rope_layers=[1, 0], moe_layers=[], interleave_moe_layer_step=0)
    ours, eager = _pair(transformers.Llama4TextModel, config)
    ids = _tokens()
    _assert_match(ours, eager, lambda model: model(input_ids=ids))
    assert ops


LENGTHS = (5, 7, 4)


def _llama():
    config = _text_config(transformers.LlamaConfig)
    return _pair(transformers.LlamaModel, config)


@pytest.mark.parametrize("keywords", ["position_ids", "position_ids+cu_seq_lens", "cu_seq_lens", "with_cache"])
def test_packed_llama_batch(keywords, ops):
    """One row packing three sequences, as DataCollatorWithFlattening builds it, against eager on
    each sequence alone: outputs, and the gradients of both runs' summed losses."""
    ours, eager = _llama()
    ids = _tokens(sum(LENGTHS), 1)
    position_ids = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    packed = dict(input_ids=ids)
    if "position_ids" in keywords or keywords == "with_cache":
        packed["position_ids"] = position_ids
    if "cu_seq_lens" in keywords:
        packed.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(LENGTHS), max_length_k=max(LENGTHS))
    if keywords == "with_cache":  # HF skips its packed mask when a cache is present; the positions still say it
        packed["past_key_values"] = transformers.DynamicCache(config=ours.config)
    grad = torch.randn(1, sum(LENGTHS), 64, generator=torch.Generator().manual_seed(7))

    ours.zero_grad(set_to_none=True)
    out = ours(**packed).last_hidden_state
    out.backward(grad)
    grads = {n: p.grad.clone() for n, p in ours.named_parameters() if p.grad is not None}
    assert ops and all(kind == "varlen" for kind, _ in ops), [kind for kind, _ in ops]

    eager.zero_grad(set_to_none=True)
    refs = []
    for piece, piece_grad in zip(ids.split(LENGTHS, dim=1), grad.split(LENGTHS, dim=1)):
        ref = eager(input_ids=piece).last_hidden_state
        ref.backward(piece_grad)
        refs.append(ref.detach())
    torch.testing.assert_close(out.detach(), torch.cat(refs, dim=1), **OUT_TOL)
    for name, p in eager.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name], p.grad, **GRAD_TOL, msg=lambda m: f"{name}: {m}")


def test_packed_rows_with_padding_keep_the_mask(ops):
    """A padded batch whose rows also restart their positions: the mask HF built is not the
    packed pattern alone, so the op runs densely on it, restricted to each sequence."""
    ours, eager = _llama()
    ids = _tokens(8, 2)
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 0, 1, 2, 3]])
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    with torch.no_grad():
        out = ours(input_ids=ids, attention_mask=mask, position_ids=position_ids).last_hidden_state
        for row, starts in ((0, (0, 3, 8)), (1, (0, 4, 6))):
            for a, b in zip(starts[:-1], starts[1:]):
                ref = eager(input_ids=ids[row:row + 1, a:b]).last_hidden_state
                torch.testing.assert_close(out[row:row + 1, a:b], ref, **OUT_TOL)
    assert ops and all(kind == "dense" for kind, _ in ops)


def test_gpt_oss_keeps_the_name():
    """transformers replaces a "flash" name by a Hub kernel on models that list compatible kernels
    (gpt-oss on recent releases); ours is kept, and the former name raises before any swap."""
    config = _text_config(transformers.GptOssConfig, num_local_experts=4, num_experts_per_tok=2)
    model = transformers.AutoModel.from_config(config, attn_implementation=NAME)
    assert model.config._attn_implementation == NAME
    with pytest.raises(ValueError, match=f'attn_implementation="{NAME}"'):
        transformers.AutoModel.from_config(config, attn_implementation="flash_inductor")
