"""``attn_implementation="flash_inductor"`` for Hugging Face transformers models.

    import flash_inductor.transformers        # registers "flash_inductor" (or call register())
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="flash_inductor")

transformers selects a model's attention by name through ``AttentionInterface`` (the function
that computes attention) and ``AttentionMaskInterface`` (the function that builds the mask it
receives). :func:`register` adds :func:`attention_forward` under the name and reuses the mask
function of ``"sdpa"``, whose contract is ours too: a boolean ``(B, 1, L, S)`` mask (True =
attend), or None where ``is_causal=True`` alone says it, so the common causal case never
materialises a mask.

What each HF feature becomes:

* padding, causal, chunked and sliding-window masks: the boolean mask HF builds, or
  ``is_causal=True`` without one; a causal sliding window also reaches the op as a slightly wider
  ``window`` (without a cache offset), so the kernels skip the tiles the mask hides;
* GQA (fewer key/value heads): ``enable_gqa=True``, K and V are indexed per group, never repeated;
* ``dropout`` (HF passes it only in training) and ``scaling``: the op's ``dropout_p`` and ``scale``;
* T5's relative ``position_bias``: folded into an additive float mask, which receives its gradient;
* logit soft-capping (Gemma 2's ``attn_logit_softcapping``): not supported, a ``ValueError`` at
  the first call that names the config option;
* ``output_attentions=True``: the model's own eager attention, after one warning (attention
  weights are the one thing a flash kernel never forms).

The function works eagerly, under plain ``torch.compile`` and under ``flash_inductor.backend``
(its pass finds the op already in place and leaves it). Importing this module imports
transformers; ``import flash_inductor`` does not.
"""

from __future__ import annotations

import sys
import warnings
from typing import Optional

import torch
from torch import Tensor

from .api import flash_attention

NAME = "flash_inductor"

_warned: set[str] = set()


def register(name: str = NAME) -> str:
    """Register :func:`attention_forward` as ``attn_implementation=name`` (default
    ``"flash_inductor"``) in transformers' ``AttentionInterface`` and ``AttentionMaskInterface``.

    Idempotent; importing ``flash_inductor.transformers`` already calls it once. Returns the name.
    Afterwards ``AutoModel.from_config(config, attn_implementation=name)``, ``from_pretrained(...,
    attn_implementation=name)`` and ``model.set_attn_implementation(name)`` select it.
    """
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    _REGISTERED.add(name)
    _skip_flash_attn_preload()
    return name


_REGISTERED: set[str] = set()


def _skip_flash_attn_preload() -> None:
    """transformers 5.17 takes every ``attn_implementation`` whose name contains "flash" for a
    FlashAttention build or a hub kernel, and at model creation preloads it with
    ``modeling_utils.lazy_import_flash_attention``, which fails for a registered function. That
    preload is meaningless for ours, so the one call site is wrapped to skip our names and pass
    every other name through unchanged. (Our name keeps "flash": it is the one users type.)"""
    from transformers import modeling_utils

    original = modeling_utils.lazy_import_flash_attention
    if getattr(original, "_flash_inductor_wrapper", False):
        return

    def lazy_import_flash_attention(implementation, *args, **kwargs):
        if implementation in _REGISTERED:
            return None
        return original(implementation, *args, **kwargs)

    lazy_import_flash_attention._flash_inductor_wrapper = True
    lazy_import_flash_attention.__wrapped__ = original
    modeling_utils.lazy_import_flash_attention = lazy_import_flash_attention


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, UserWarning, stacklevel=3)


def _attentions_requested(kwargs: dict) -> bool:
    """Whether the caller asked for the attention weights: the ``output_attentions`` kwarg, or
    transformers' output collector (set when the flag comes from the config)."""
    if kwargs.get("output_attentions"):
        return True
    if torch.compiler.is_compiling():  # the collector is a ContextVar, which dynamo cannot read
        return False
    try:
        from transformers.utils.output_capturing import _active_collector

        collected = _active_collector.get()
    except (ImportError, AttributeError, LookupError):
        return False
    return bool(collected) and any("attentions" in key for key in collected)


def _eager_fallback(module, query, key, value, attention_mask, dropout, scaling, kwargs):
    """The model's own ``eager_attention_forward`` (from its modeling module), which returns the
    attention weights. HF's ``"eager"`` mask is additive float; ours is boolean, so it is
    converted here the way HF's eager mask function does (``finfo.min`` where hidden)."""
    modeling = sys.modules.get(type(module).__module__)
    eager = getattr(modeling, "eager_attention_forward", None)
    if eager is None:
        return None
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        attention_mask = torch.where(attention_mask, 0.0, torch.finfo(query.dtype).min).to(query.dtype)
    elif attention_mask is None and _causal(module, kwargs) and query.shape[2] > 1:
        # None stood for is_causal=True (lower-right aligned when the cache holds earlier keys).
        q_len, kv_len = query.shape[2], key.shape[2]
        visible = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
        attention_mask = torch.where(visible, 0.0, torch.finfo(query.dtype).min).to(query.dtype)[None, None]
    kwargs = {k: v for k, v in kwargs.items() if k not in ("is_causal",)}
    return eager(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def _causal(module, kwargs) -> bool:
    is_causal = kwargs.get("is_causal")
    return bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))


def attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    position_bias: Optional[Tensor] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    **kwargs,
) -> tuple[Tensor, Optional[Tensor]]:
    """transformers' attention-function contract on :func:`flash_inductor.flash_attention`.

    Args:
        module: the calling attention module (read: ``is_causal``, ``num_key_value_groups``).
        query: ``(B, Hq, L, E)``. key, value: ``(B, Hkv, S, E)``, ``(B, Hkv, S, Ev)``.
        attention_mask: from the ``"sdpa"`` mask function: bool ``(B, 1, L, S)`` (True =
            attend), a float additive mask a caller built itself, or None (then causality comes
            from ``is_causal`` / ``module.is_causal``).
        dropout: attention dropout probability (HF passes 0 in eval mode).
        scaling: softmax scale (None = ``1/sqrt(E)``).
        is_causal: overrides ``module.is_causal`` (HF passes it for some models).
        position_bias: T5's relative bias ``(1 or B, H, L, S)``, added to the scores.
        sliding_window: already part of ``attention_mask`` (HF builds the band into it); also
            passed on as a slightly wider ``window`` so the kernels skip the tiles outside it.
        softcap: logit soft-capping, unsupported: raises ``ValueError``.

    Returns:
        ``(attn_output (B, L, Hq, Ev), None)``; with ``output_attentions=True``, what the
        model's eager attention returns, weights included.
    """
    if softcap is not None:
        raise ValueError(
            f'attn_implementation="{NAME}" does not support logit soft-capping (softcap={softcap}, the model '
            "config's `attn_logit_softcapping`). Load the model with attn_implementation=\"eager\" or "
            "\"flex_attention\", or set config.attn_logit_softcapping = None if the model tolerates it."
        )
    if _attentions_requested(kwargs):
        fallback = _eager_fallback(module, query, key, value, attention_mask, dropout, scaling,
                                   dict(kwargs, is_causal=is_causal, position_bias=position_bias))
        if fallback is not None:
            _warn_once("output_attentions",
                       f'attn_implementation="{NAME}" does not return attention weights; output_attentions=True '
                       "runs the model's eager attention instead.")
            return fallback
        _warn_once("output_attentions_none",
                   f'attn_implementation="{NAME}" does not return attention weights and '
                   f"{type(module).__module__} has no eager_attention_forward to fall back to: they are None.")

    q_len, kv_len = query.shape[2], key.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # As sdpa_attention_forward: a missing mask means causal only for a multi-token query; a
    # single query token (decoding) sees every cached key.
    causal = bool(q_len > 1 and attention_mask is None and causal)
    if causal and kv_len > q_len:
        # Only reachable with an empty static cache during prefill: the keys past the queries are
        # unwritten slots, and the op's is_causal is top-left aligned, so drop them as sdpa does.
        key, value = key[:, :, :q_len], value[:, :, :q_len]
        if position_bias is not None:
            position_bias = position_bias[..., :q_len]
    if position_bias is not None:
        attention_mask = _with_position_bias(position_bias, attention_mask, causal, q_len, key.shape[2])
        causal = False

    out = flash_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=float(dropout), is_causal=causal, scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
        window=_tile_skipping_window(module, sliding_window, attention_mask, is_causal, q_len, key.shape[2]),
    )
    return out.transpose(1, 2).contiguous(), None


def _tile_skipping_window(module, sliding_window: Optional[int], attention_mask: Optional[Tensor],
                          is_causal: Optional[bool], q_len: int, kv_len: int) -> Optional[tuple[int, int]]:
    """A window for the kernels to skip the tiles outside a causal sliding window, which HF has
    already folded into ``attention_mask``. It is (sliding_window, 0): one key wider on the left
    than HF's band (``j > i - sliding_window``), so whichever convention of the band's edge a model
    uses, the mask, not the window, decides every visible key and the result is unchanged. Only
    where queries and keys share positions (L == S: no cache offset; a sliding cache's ring buffer
    would not line up) and for a causal layer; anything else keeps the mask alone."""
    if sliding_window is None or attention_mask is None or q_len != kv_len or q_len <= 1:
        return None
    causal_layer = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if not causal_layer or int(sliding_window) < 1:
        return None
    return int(sliding_window), 0


def _with_position_bias(position_bias: Tensor, attention_mask: Optional[Tensor], causal: bool, q_len: int,
                        kv_len: int) -> Tensor:
    """T5's bias as an additive float mask; hidden entries are -inf (the op returns 0 for a row
    that sees nothing, where a ``finfo.min`` fill would give a uniform row)."""
    if attention_mask is None:
        if not causal:
            return position_bias
        attention_mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=position_bias.device).tril()
    if attention_mask.dtype == torch.bool:
        return torch.where(attention_mask, position_bias, float("-inf"))
    return position_bias + attention_mask


register()
