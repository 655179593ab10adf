"""Real models for the pass tests: HF ``transformers`` models from tiny random configs (nothing is
downloaded) and ``nn.TransformerEncoder``, their inputs, and the backend the tests compile with.

Each :class:`ModelCase` knows how to build its model for an attention implementation ("eager":
HF's hand-written ``eager_attention_forward``; "sdpa": HF's call of
``F.scaled_dot_product_attention``), how to make inputs, which module paths hold attention
and the pattern the pass should report for each.

No import of ``transformers`` or ``flash_inductor`` at module level: conftest imports the helpers
first, and ``transformers`` is optional (the test module skips without it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Callable, Iterator, Optional

import torch
import torch.nn as nn

from helpers import DEVICE

VOCAB, HIDDEN, HEADS, KV_HEADS, LAYERS, SEQ, BATCH = 64, 32, 4, 2, 2, 16, 2
# Ids inside the tiny vocabulary, so HF's config validation stays quiet.
_TOKEN_IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)


# ------------------------------------------------------------------------------------------
# Configs
# ------------------------------------------------------------------------------------------


def _gpt2(impl: str, **overrides) -> nn.Module:
    import transformers as T

    config = dict(n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=2 * SEQ, vocab_size=VOCAB,
                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2)
    return T.GPT2Model(T.GPT2Config(**{**config, **overrides}, attn_implementation=impl))


def _decoder(config_class: str, model_class: str, **variant) -> Callable[..., nn.Module]:
    """Llama, Mistral, Qwen2: GQA (num_key_value_heads < num_attention_heads), RoPE, RMSNorm;
    Mistral with a sliding window shorter than the sequence, so the window masks keys."""

    def build(impl: str, **overrides) -> nn.Module:
        import transformers as T

        config = dict(hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=VOCAB,
                      max_position_embeddings=2 * SEQ, attention_dropout=0.0, **_TOKEN_IDS, **variant)
        config.update(overrides)
        return getattr(T, model_class)(getattr(T, config_class)(**config, attn_implementation=impl))

    return build


def _bert(impl: str, **overrides) -> nn.Module:
    import transformers as T

    config = dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  intermediate_size=2 * HIDDEN, vocab_size=VOCAB, max_position_embeddings=2 * SEQ,
                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0)
    return T.BertModel(T.BertConfig(**{**config, **overrides}, attn_implementation=impl), add_pooling_layer=False)


def _t5(impl: str, **overrides) -> nn.Module:
    import transformers as T

    # One encoder and one decoder layer hold all three kinds of T5 attention: encoder self,
    # decoder causal self, decoder cross; the relative position bias is a float mask with a gradient.
    config = dict(d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=2 * HIDDEN, num_layers=1, num_decoder_layers=1,
                  num_heads=HEADS, vocab_size=VOCAB, dropout_rate=0.0, relative_attention_num_buckets=8,
                  relative_attention_max_distance=16, decoder_start_token_id=0, **_TOKEN_IDS)
    return T.T5Model(T.T5Config(**{**config, **overrides}, attn_implementation=impl))


def _vit(impl: str, **overrides) -> nn.Module:
    import transformers as T

    config = dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  intermediate_size=2 * HIDDEN, image_size=16, patch_size=4, num_channels=3,
                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return T.ViTModel(T.ViTConfig(**{**config, **overrides}, attn_implementation=impl), add_pooling_layer=False)


def _falcon(**variant) -> Callable[..., nn.Module]:
    """Falcon: ``multi_query=True`` is Falcon-7B's layout (one K/V head, passed to SDPA without
    enable_gqa); ``alibi=True`` is Falcon-RW's, whose eager path scales (QKᵀ + alibi) after the bias."""

    def build(impl: str, **overrides) -> nn.Module:
        import transformers as T

        config = dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, vocab_size=VOCAB,
                      hidden_dropout=0.0, attention_dropout=0.0, max_position_embeddings=2 * SEQ, **_TOKEN_IDS)
        return T.FalconModel(T.FalconConfig(**{**config, **variant, **overrides}, attn_implementation=impl))

    return build


def _bloom(impl: str, **overrides) -> nn.Module:
    import transformers as T

    # ALiBi through baddbmm on (B*H, L, S) scores, a (B, 1, L, S) mask on a (B, H, L, S) view.
    config = dict(hidden_size=HIDDEN, n_layer=LAYERS, n_head=HEADS, vocab_size=VOCAB, hidden_dropout=0.0,
                  attention_dropout=0.0, **_TOKEN_IDS)
    return T.BloomModel(T.BloomConfig(**{**config, **overrides}, attn_implementation=impl))


def _gpt_neox(impl: str, **overrides) -> nn.Module:
    import transformers as T

    # Parallel residual, rotary on a quarter of each head.
    config = dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  intermediate_size=2 * HIDDEN, vocab_size=VOCAB, max_position_embeddings=2 * SEQ,
                  attention_dropout=0.0, hidden_dropout=0.0, use_parallel_residual=True,
                  rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
                  **_TOKEN_IDS)
    return T.GPTNeoXModel(T.GPTNeoXConfig(**{**config, **overrides}, attn_implementation=impl))


def _phi(impl: str, **overrides) -> nn.Module:
    import transformers as T

    # Parallel attention and MLP, partial rotary, LayerNorm on q and k (qk-norm).
    config = dict(hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, vocab_size=VOCAB, max_position_embeddings=2 * SEQ,
                  resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0, qk_layernorm=True, **_TOKEN_IDS)
    return T.PhiModel(T.PhiConfig(**{**config, **overrides}, attn_implementation=impl))


def _opt(impl: str, **overrides) -> nn.Module:
    import transformers as T

    # The scale is applied to q by its projection's output (q_proj(x) * scaling).
    config = dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, ffn_dim=2 * HIDDEN,
                  vocab_size=VOCAB, max_position_embeddings=2 * SEQ, word_embed_proj_dim=HIDDEN, dropout=0.0,
                  attention_dropout=0.0, layerdrop=0.0, **_TOKEN_IDS)
    return T.OPTModel(T.OPTConfig(**{**config, **overrides}, attn_implementation=impl))


def _gemma2(impl: str, **overrides) -> nn.Module:
    import transformers as T

    # Logit soft-capping (tanh) in "eager"; sliding-window layers alternate with global ones.
    config = dict(hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HIDDEN // HEADS,
                  vocab_size=VOCAB, max_position_embeddings=2 * SEQ, attention_dropout=0.0, sliding_window=8,
                  query_pre_attn_scalar=HIDDEN // HEADS, attn_logit_softcapping=50.0, **_TOKEN_IDS)
    return T.Gemma2Model(T.Gemma2Config(**{**config, **overrides}, attn_implementation=impl))


def _gpt_oss(impl: str, **overrides) -> nn.Module:
    import transformers as T

    # Attention sinks (a learned logit per head) in "eager"; sliding-window layers alternate with
    # global ones. The experts run as plain PyTorch: the grouped-matmul fallback has no backward
    # through AOTAutograd on CPU.
    config = dict(hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HIDDEN // HEADS,
                  vocab_size=VOCAB, max_position_embeddings=2 * SEQ, attention_dropout=0.0, sliding_window=8,
                  num_local_experts=4, num_experts_per_tok=2, experts_implementation="eager", **_TOKEN_IDS)
    model = T.GptOssModel(T.GptOssConfig(**{**config, **overrides}, attn_implementation=impl))
    with torch.no_grad():  # HF initialises the sinks near 0 (std 0.02): unit-scale ones matter more
        for layer in model.layers:
            layer.self_attn.sinks.normal_()
    return model


def _roberta(impl: str, **overrides) -> nn.Module:
    import transformers as T

    config = dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  intermediate_size=2 * HIDDEN, vocab_size=VOCAB, max_position_embeddings=2 * SEQ + 2,
                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0)
    return T.RobertaModel(T.RobertaConfig(**{**config, **overrides}, attn_implementation=impl),
                          add_pooling_layer=False)


def _deberta_v2(impl: str, **overrides) -> nn.Module:
    import transformers as T

    # Disentangled relative attention: content->position and position->content biases.
    config = dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  intermediate_size=2 * HIDDEN, vocab_size=VOCAB, max_position_embeddings=2 * SEQ,
                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, relative_attention=True,
                  max_relative_positions=2 * SEQ, pos_att_type=["p2c", "c2p"], position_buckets=8, pad_token_id=0)
    return T.DebertaV2Model(T.DebertaV2Config(**{**config, **overrides}, attn_implementation=impl))


def _bart(impl: str, **overrides) -> nn.Module:
    import transformers as T

    # Encoder self, decoder causal self and decoder cross-attention; the scale is applied to q.
    config = dict(d_model=HIDDEN, encoder_layers=1, decoder_layers=1, encoder_attention_heads=HEADS,
                  decoder_attention_heads=HEADS, encoder_ffn_dim=2 * HIDDEN, decoder_ffn_dim=2 * HIDDEN,
                  vocab_size=VOCAB, max_position_embeddings=2 * SEQ, dropout=0.0, attention_dropout=0.0,
                  activation_dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0,
                  decoder_start_token_id=2, **_TOKEN_IDS)
    return T.BartModel(T.BartConfig(**{**config, **overrides}, attn_implementation=impl))


def _swin(impl: str, **overrides) -> nn.Module:
    import transformers as T

    # Windowed attention with a learned relative position bias; the second block of each stage
    # shifts its windows and adds the shift mask, on (B * windows, H, N, N) scores.
    config = dict(image_size=16, patch_size=2, num_channels=3, embed_dim=16, depths=[2, 1], num_heads=[2, 4],
                  window_size=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0)
    return T.SwinModel(T.SwinConfig(**{**config, **overrides}, attn_implementation=impl), add_pooling_layer=False)


def _whisper(impl: str, **overrides) -> nn.Module:
    import transformers as T

    config = dict(d_model=HIDDEN, encoder_layers=1, decoder_layers=1, encoder_attention_heads=HEADS,
                  decoder_attention_heads=HEADS, encoder_ffn_dim=2 * HIDDEN, decoder_ffn_dim=2 * HIDDEN,
                  vocab_size=VOCAB, num_mel_bins=8, max_source_positions=SEQ // 2, max_target_positions=2 * SEQ,
                  dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, encoder_layerdrop=0.0,
                  decoder_layerdrop=0.0, decoder_start_token_id=2, apply_spec_augment=False,
                  suppress_tokens=None, begin_suppress_tokens=None, **_TOKEN_IDS)
    return T.WhisperModel(T.WhisperConfig(**{**config, **overrides}, attn_implementation=impl))


def _wav2vec2(impl: str, **overrides) -> nn.Module:
    import transformers as T

    # feat_extract_norm="layer" takes an attention_mask for padded audio; SpecAugment and LayerDrop
    # are off, so training draws no random numbers outside dropout.
    config = dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  intermediate_size=2 * HIDDEN, conv_dim=(16, 16), conv_stride=(4, 2), conv_kernel=(8, 4),
                  num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4, feat_extract_norm="layer",
                  do_stable_layer_norm=True, hidden_dropout=0.0, activation_dropout=0.0, attention_dropout=0.0,
                  feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0, apply_spec_augment=False,
                  mask_time_prob=0.0, vocab_size=VOCAB)
    return T.Wav2Vec2Model(T.Wav2Vec2Config(**{**config, **overrides}, attn_implementation=impl))


class TorchEncoder(nn.Module):
    """``nn.TransformerEncoder`` (batch_first): one ``F.multi_head_attention_forward`` per layer in
    training, the fused ``_transformer_encoder_layer_fwd`` in eval without grad."""

    def __init__(self, impl: str = "torch", **overrides):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        layer = nn.TransformerEncoderLayer(HIDDEN, HEADS, dim_feedforward=2 * HIDDEN, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)

    def forward(self, input_ids):
        return self.encoder(self.embed(input_ids))


# ------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------


def token_inputs(padded: bool, seed: int = 0, device: str = DEVICE) -> dict:
    """``input_ids`` and, when ``padded``, an ``attention_mask`` that right-pads the second
    sequence by 5 tokens (every query still sees key 0, so no row is fully masked)."""
    g = torch.Generator().manual_seed(seed)
    inputs = dict(input_ids=torch.randint(3, VOCAB, (BATCH, SEQ), generator=g).to(device))
    if padded:
        mask = torch.ones(BATCH, SEQ, dtype=torch.long)
        mask[1, -5:] = 0
        inputs["attention_mask"] = mask.to(device)
    return inputs


def t5_inputs(padded: bool, seed: int = 0, device: str = DEVICE) -> dict:
    inputs = token_inputs(padded, seed, device)
    g = torch.Generator().manual_seed(seed + 1)
    inputs["decoder_input_ids"] = torch.randint(3, VOCAB, (BATCH, SEQ - 3), generator=g).to(device)
    return inputs


def image_inputs(padded: bool, seed: int = 0, device: str = DEVICE) -> dict:
    g = torch.Generator().manual_seed(seed)
    return dict(pixel_values=torch.randn(BATCH, 3, 16, 16, generator=g).to(device))


def seq2seq_inputs(padded: bool, seed: int = 0, device: str = DEVICE) -> dict:
    """BART: encoder tokens (right-padded) and decoder tokens, the decoder padded as well."""
    inputs = t5_inputs(padded, seed, device)
    if padded:
        mask = torch.ones(BATCH, SEQ - 3, dtype=torch.long)
        mask[1, -3:] = 0
        inputs["decoder_attention_mask"] = mask.to(device)
    return inputs


def speech_inputs(padded: bool, seed: int = 0, device: str = DEVICE) -> dict:
    """Whisper: log-mel features (B, 8 bins, SEQ frames; the encoder takes no mask) and decoder
    tokens, right-padded when ``padded``."""
    g = torch.Generator().manual_seed(seed)
    inputs = dict(input_features=torch.randn(BATCH, 8, SEQ, generator=g).to(device),
                  decoder_input_ids=torch.randint(3, VOCAB, (BATCH, SEQ - 3), generator=g).to(device))
    if padded:
        mask = torch.ones(BATCH, SEQ - 3, dtype=torch.long)
        mask[1, -3:] = 0
        inputs["decoder_attention_mask"] = mask.to(device)
    return inputs


AUDIO_SAMPLES = 200


def audio_inputs(padded: bool, seed: int = 0, device: str = DEVICE) -> dict:
    """Wav2Vec2: raw audio (B, 200 samples -> 23 frames); when ``padded`` the second clip is 60
    samples shorter, zeroed, and masked."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(BATCH, AUDIO_SAMPLES, generator=g)
    inputs = dict(input_values=values)
    if padded:
        mask = torch.ones(BATCH, AUDIO_SAMPLES, dtype=torch.long)
        mask[1, -60:] = 0
        values[1, -60:] = 0.0
        inputs["attention_mask"] = mask
    return {k: v.to(device) for k, v in inputs.items()}


def encoder_inputs(padded: bool, seed: int = 0, device: str = DEVICE) -> dict:
    return {"input_ids": token_inputs(False, seed, device)["input_ids"]}


# ------------------------------------------------------------------------------------------
# The cases
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelCase:
    """A model family: ``build(impl, **config_overrides)``, ``inputs(padded, seed, device)``, the
    attention modules (in report order) and the pattern each implementation is reported under.

    ``patterns[impl]`` is a pattern name; a (training pattern, inference pattern) tuple; a list
    with one pattern per module; or ``KEPT`` followed by the words the reason of every kept site
    must contain (why rewriting would change the result). ``training_modules`` /
    ``inference_modules`` where a training step or inference (eval, no_grad) reports other
    modules. ``default``: in the default test run; the others run with ``-m models_full``.
    """

    build: Callable[..., nn.Module]
    inputs: Callable[..., dict]
    modules: tuple[str, ...]
    patterns: dict
    impls: tuple[str, ...] = ("eager", "sdpa")
    inference_modules: Optional[tuple[str, ...]] = None
    training_modules: Optional[tuple[str, ...]] = None
    default: bool = False

    def kept_reason(self, impl: str) -> Optional[str]:
        """What the reason of every kept site says, or None when every site is rewritten."""
        found = self.patterns[impl]
        return found[len(KEPT):] if isinstance(found, str) and found.startswith(KEPT) else None

    def sites(self, impl: str, training: bool) -> list[tuple[str, str, str]]:
        """(module, pattern, status) of every site, in report order."""
        modules = self.training_modules if training else self.inference_modules
        modules = modules or self.modules
        found = self.patterns[impl]
        if self.kept_reason(impl) is not None:
            return [(module, "handwritten", "kept") for module in modules]
        if isinstance(found, list):
            return list(zip(modules, found, ["rewritten"] * len(modules)))
        pattern = found if isinstance(found, str) else found[0 if training else 1]
        return [(module, pattern, "rewritten") for module in modules]


KEPT = "kept: "


def _layers(template: str, n: int = LAYERS) -> tuple[str, ...]:
    return tuple(template.format(i) for i in range(n))


# HF's GQA models call SDPA with enable_gqa=True only without a mask; under torch.compile they
# always build one (even unpadded), so K/V are repeated first: "sdpa_repeat_kv".
_HF_DECODER = dict(eager="handwritten_gqa", sdpa="sdpa_repeat_kv")
_ADDITIVE = dict(eager="handwritten_additive_mask", sdpa="sdpa")
_SEQ2SEQ_MODULES = ("encoder.layers.0.self_attn", "decoder.layers.0.self_attn", "decoder.layers.0.encoder_attn")
CASES = {
    # Decoder-only
    "gpt2": ModelCase(_gpt2, token_inputs, _layers("h.{}.attn"), _ADDITIVE),
    "llama": ModelCase(_decoder("LlamaConfig", "LlamaModel"), token_inputs, _layers("layers.{}.self_attn"),
                       _HF_DECODER, default=True),
    "mistral": ModelCase(_decoder("MistralConfig", "MistralModel", sliding_window=8), token_inputs,
                         _layers("layers.{}.self_attn"), _HF_DECODER),
    "qwen2": ModelCase(_decoder("Qwen2Config", "Qwen2Model"), token_inputs, _layers("layers.{}.self_attn"),
                       _HF_DECODER),
    "falcon_mqa": ModelCase(_falcon(multi_query=True, new_decoder_architecture=False, alibi=False), token_inputs,
                            _layers("h.{}.self_attention"), dict(eager="handwritten_gqa", sdpa="sdpa"), default=True),
    "falcon_alibi": ModelCase(_falcon(alibi=True, multi_query=False, new_decoder_architecture=False), token_inputs,
                              _layers("h.{}.self_attention"), _ADDITIVE, default=True),
    "bloom": ModelCase(_bloom, token_inputs, _layers("h.{}.self_attention"), dict(eager="handwritten_alibi"),
                       impls=("eager",)),
    "gpt_neox": ModelCase(_gpt_neox, token_inputs, _layers("layers.{}.attention"), _ADDITIVE),
    "phi": ModelCase(_phi, token_inputs, _layers("layers.{}.self_attn"), _ADDITIVE),
    "opt": ModelCase(_opt, token_inputs, _layers("decoder.layers.{}.self_attn"), _ADDITIVE),
    # HF's SDPA path drops the soft-capping (it cannot express it), so only "eager" applies it.
    "gemma2": ModelCase(_gemma2, token_inputs, _layers("layers.{}.self_attn"),
                        dict(eager="handwritten_softcap", sdpa="sdpa_repeat_kv")),
    "gpt_oss": ModelCase(_gpt_oss, token_inputs, _layers("layers.{}.self_attn"), dict(eager="handwritten_sinks"),
                         impls=("eager",)),
    # Encoders
    "bert": ModelCase(_bert, token_inputs, _layers("encoder.layer.{}.attention.self"), _ADDITIVE, default=True),
    "roberta": ModelCase(_roberta, token_inputs, _layers("encoder.layer.{}.attention.self"), _ADDITIVE),
    # finfo.min filled over the relative-position biases: rows hidden entirely get uniform weights.
    "deberta_v2": ModelCase(_deberta_v2, token_inputs, _layers("encoder.layer.{}.attention.self"),
                            dict(eager=KEPT + "op's masked-row rule"), impls=("eager",)),
    # Encoder-decoder, with cross-attention
    "t5": ModelCase(_t5, t5_inputs, ("encoder.block.0.layer.0.SelfAttention", "decoder.block.0.layer.0.SelfAttention",
                                     "decoder.block.0.layer.1.EncDecAttention"), _ADDITIVE, default=True),
    "bart": ModelCase(_bart, seq2seq_inputs, _SEQ2SEQ_MODULES, _ADDITIVE),
    # Vision
    "vit": ModelCase(_vit, image_inputs, _layers("layers.{}.attention"), _ADDITIVE),
    "swin": ModelCase(_swin, image_inputs, ("encoder.layers.0.blocks.0.attention",
                                            "encoder.layers.0.blocks.1.attention",
                                            "encoder.layers.1.blocks.0.attention"), _ADDITIVE),
    # Speech
    # The encoder and the cross-attention take no mask (input features are never padded).
    "whisper": ModelCase(_whisper, speech_inputs, _SEQ2SEQ_MODULES,
                         dict(eager=["handwritten_plain", "handwritten_additive_mask", "handwritten_plain"],
                              sdpa="sdpa")),
    # A training step breaks the graph at each layer's LayerDrop draw, and the two layers run the
    # same resumed graph: one compiled site serves both.
    "wav2vec2": ModelCase(_wav2vec2, audio_inputs, _layers("encoder.layers.{}.attention"), _ADDITIVE,
                          training_modules=("encoder.layers.0.attention",)),
    # torch.nn: inference takes the fused layer, one node per encoder layer.
    "torch_encoder": ModelCase(TorchEncoder, encoder_inputs, _layers("encoder.layers.{}.self_attn"),
                               dict(torch=("mha", "mha_encoder")), impls=("torch",),
                               inference_modules=_layers("encoder.layers.{}"), default=True),
}


def output_tensor(out) -> torch.Tensor:
    """The hidden states a model returns (HF output object or a plain tensor)."""
    return out if isinstance(out, torch.Tensor) else out.last_hidden_state


# ------------------------------------------------------------------------------------------
# The backend the tests compile with
# ------------------------------------------------------------------------------------------


def full_inductor_everywhere() -> bool:
    """Full Inductor code generation for every model test: on CUDA by default; on CPU only when
    FLASH_INDUCTOR_TEST_FULL_INDUCTOR=1 (generating and compiling C++ for a training graph takes
    ~30 s on a small CPU machine, so CPU runs compile one representative model fully)."""
    setting = os.environ.get("FLASH_INDUCTOR_TEST_FULL_INDUCTOR")
    if setting is not None:
        return setting not in ("", "0")
    return torch.cuda.is_available()


def pass_then_aot_eager():
    """Inductor's pre-grad passes with ours, then AOTAutograd with the graphs run as traced: what
    ``flash_inductor.backend`` does up to Inductor's code generation. The rewrite, the report and the
    op's autograd are the backend's own; only Inductor's lowering of the surrounding model is left
    out (the full-Inductor tests cover it)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._inductor import compile_fx

    from flash_inductor.passes.graph_pass import FlashAttentionPass
    from flash_inductor.passes.report import one_report_per_compile

    our_pass = FlashAttentionPass()

    def backend(gm: torch.fx.GraphModule, example_inputs):
        with torch._inductor.config.patch(pre_grad_custom_pass=our_pass), one_report_per_compile():
            gm = compile_fx._recursive_pre_grad_passes(gm, example_inputs)
        return aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop)(gm, example_inputs)

    return backend


def pass_only(module, *inputs, **compile_kwargs) -> torch.fx.GraphModule:
    """The dynamo graph of ``module(*inputs)`` after our pass alone; the compiled module runs that
    graph as is (no AOTAutograd, no Inductor) and is ``gm.meta["compiled"]``: a kept site must
    compute exactly what eager does."""
    from flash_inductor.passes.graph_pass import FlashAttentionPass

    captured = {}

    def backend(gm, example_inputs):
        FlashAttentionPass()(gm.graph)
        gm.recompile()
        captured["gm"] = gm
        return gm.forward

    compiled = torch.compile(module, backend=backend, **compile_kwargs)
    compiled(*inputs)
    captured["gm"].meta["compiled"] = compiled
    return captured["gm"]


def assert_kept_as_eager(module, inputs, reason: str) -> None:
    """The pass keeps the one attention site of ``module(*inputs)`` with ``reason`` in its reason,
    inserts no op call, and the graph it leaves computes exactly what eager does."""
    from flash_inductor.passes.report import REPORTS
    from flash_inductor.passes.site import rewritten_attention

    REPORTS.clear()
    gm = pass_only(module, *inputs)
    records = [r for report in REPORTS for r in report.sites]
    assert [r.status for r in records] == ["kept"], "\n".join(map(str, REPORTS))
    assert reason in records[0].reason, records[0].reason
    assert not [n for n in gm.graph.nodes if n.target is rewritten_attention]
    torch.testing.assert_close(gm.meta["compiled"](*inputs), module(*inputs), rtol=0, atol=0, equal_nan=True)


def compile_backend(full: Optional[bool] = None):
    """``flash_inductor.backend`` when full Inductor is wanted (see above), else the pass with
    AOTAutograd run eagerly."""
    import flash_inductor

    full = full_inductor_everywhere() if full is None else full
    return flash_inductor.backend if full else pass_then_aot_eager()


@contextlib.contextmanager
def inductor_codegen_skipped() -> Iterator[None]:
    """Inside: the backend's compiles (``flash_inductor.backend``, ``flash_inductor.explain``) stop
    after Inductor's pre-grad passes and run AOTAutograd's graphs as traced, as
    :func:`pass_then_aot_eager` does, on CPU without full Inductor (see
    :func:`full_inductor_everywhere`). The backend's own reporting and explain's path resolution
    run unchanged; only the C++ code generation (~15 s a model) is skipped."""
    if full_inductor_everywhere():
        yield
        return
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._inductor import compile_fx as compile_fx_module

    def compile_fx(gm, example_inputs, config_patches=None, **kwargs):
        with torch._inductor.config.patch(config_patches or {}):
            gm = compile_fx_module._recursive_pre_grad_passes(gm, example_inputs)
        return aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop)(gm, example_inputs)

    real = compile_fx_module.compile_fx
    compile_fx_module.compile_fx = compile_fx
    try:
        yield
    finally:
        compile_fx_module.compile_fx = real


# ------------------------------------------------------------------------------------------
# fp16 overflow of QKᵀ
# ------------------------------------------------------------------------------------------

# Every query gets a component Q_BIG and every key K_BIG on the last dim of each head, from the
# projection biases (the weights of that dim are zeroed). Their product, 2**18, is the same for
# every key of a row, so the softmax does not see it (it is shift-invariant) and the attention
# stays as well-conditioned as without it; but QKᵀ in fp16 overflows (> 65504), so eager fp16
# attention turns into inf - inf = NaN. Powers of two keep q and k exact in fp16.
Q_BIG, K_BIG = 512.0, 512.0
OVERFLOW_CONFIG = {
    # attention_bias gives q_proj/k_proj biases; rope_theta = 1e12 makes the rotation of the last
    # dim of each head (RoPE's lowest frequency, 1e12**-0.75 per position) negligible, so K_BIG
    # stays the same for every key instead of turning into a position-dependent score.
    "llama": dict(attention_bias=True, rope_parameters=dict(rope_type="default", rope_theta=1e12)),
    "gpt2": {},
}


def _set_overflow_rows(weight_rows: torch.Tensor, bias: torch.Tensor, rows, value: float) -> None:
    weight_rows[rows] = 0.0
    bias[rows] = value


@torch.no_grad()
def make_qk_overflow(name: str, model: nn.Module) -> None:
    """Set the q/k projections of every layer as described at ``Q_BIG``."""
    head_dim = HIDDEN // HEADS
    if name == "gpt2":
        for block in model.h:
            # Conv1D: weight (in, 3 * hidden) with output columns [q | k | v].
            weight, bias = block.attn.c_attn.weight, block.attn.c_attn.bias
            last = [h * head_dim + head_dim - 1 for h in range(HEADS)]
            _set_overflow_rows(weight.T, bias, last, Q_BIG)
            _set_overflow_rows(weight.T, bias, [HIDDEN + j for j in last], K_BIG)
    elif name == "llama":
        for layer in model.layers:
            attn = layer.self_attn
            _set_overflow_rows(attn.q_proj.weight, attn.q_proj.bias,
                               [h * head_dim + head_dim - 1 for h in range(HEADS)], Q_BIG)
            _set_overflow_rows(attn.k_proj.weight, attn.k_proj.bias,
                               [h * head_dim + head_dim - 1 for h in range(KV_HEADS)], K_BIG)
    else:
        raise ValueError(f"no fp16 overflow construction for {name!r}")
