"""``attn_implementation="inductor_stable"``: flash_inductor as a Hugging Face transformers attention.

    import flash_inductor.transformers        # registers "inductor_stable" (or call register())
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="inductor_stable")

transformers selects a model's attention by name through ``AttentionInterface`` (the function
that computes attention) and ``AttentionMaskInterface`` (the function that builds the mask it
receives). :func:`register` adds :func:`attention_forward` under the name and
:func:`flash_inductor.transformers_masks.attention_mask_function` as its mask function: the mask
of ``"sdpa"`` (a boolean ``(B, 1, L, S)`` mask, True = attend, or None where ``is_causal=True``
alone says it), except on a packed batch, where it builds no mask at all and records the packing
for the attention function to run varlen from.

**The name has no "flash" in it.** transformers treats every implementation name containing
"flash" as a FlashAttention build (``is_flash_attention_requested``): it hands such a name
FlashAttention's arguments instead of a mask, replaces it by a Hub kernel on models that list
compatible kernels (gpt-oss, since 5.2x), and refuses it for Llama 4's chunked attention. It also
tests names for "sdpa", "flex_attention", "paged|" and the "org/repo" form of Hub kernels;
``"inductor_stable"`` matches none of them, so every model treats it as a plain attention function.
The former name ``"flash_inductor"`` raises a ``ValueError`` naming the new one when a model is
created or switched to it (before transformers could substitute a Hub kernel for it).

What each HF feature becomes (:data:`KWARG_ROLES` lists every keyword argument a model passes):

* padding, causal, chunked and sliding-window masks: the boolean mask HF builds, or
  ``is_causal=True`` without one; a causal sliding window also reaches the op as a slightly wider
  ``window`` (without a cache offset), so the kernels skip the tiles the mask hides;
* packed sequences: ``cu_seq_lens_q/k`` with ``max_length_q/k`` (``DataCollatorWithFlattening``'s
  ``return_flash_attn_kwargs``, vision towers), or ``position_ids`` that restart inside a row, run
  :func:`flash_inductor.flash_attention_varlen`, one problem per sequence (causal per sequence,
  the window as FlashAttention's). On a padding-free packed batch without a cache the mask
  function builds no ``L x L`` mask: the attention function takes the sequences and the window
  from its record (``transformers_masks.recorded_packing``), which holds for models that pass
  attention neither ``position_ids`` nor ``sliding_window``. Where HF did build a mask (padding,
  a cache, chunked or overlaid masks, ``torch.compile``), it must be exactly the packed causal
  (or sliding) pattern, else the op runs densely on the mask restricted to each sequence;
* GQA (fewer key/value heads): ``enable_gqa=True``, K and V are indexed per group, never repeated;
* ``dropout`` (HF passes it only in training) and ``scaling``: the op's ``dropout_p`` and ``scale``;
* logit soft-capping (``softcap``, Gemma 2's ``attn_logit_softcapping``): the op's ``softcap``;
* attention sinks (``s_aux``, gpt-oss's learned per-head logits): the op's ``sinks``, gradient included;
* T5's relative ``position_bias``: folded into an additive float mask, which receives its gradient;
* ``output_attentions=True``: the model's own eager attention, after one warning (attention
  weights are the one thing a flash kernel never forms);
* any other keyword argument: a ``ValueError`` naming it, never silently dropped.

The function works eagerly, under plain ``torch.compile`` and under ``flash_inductor.backend``
(its pass finds the op already in place and leaves it). Importing this module imports
transformers; ``import flash_inductor`` does not.
"""

from __future__ import annotations

import functools
import sys
import warnings
import weakref
from typing import Callable, Optional

import torch
from torch import Tensor

from .api import flash_attention
from .transformers_masks import SkippedPacking, attention_mask_function, packing_recorded, recorded_packing
from .varlen import flash_attention_varlen

NAME = "inductor_stable"
LEGACY_NAME = "flash_inductor"

# Every keyword argument transformers' models pass to an attention function, and what
# attention_forward does with it. "used": it changes the result and reaches the op (or the
# eager fallback). "ignored": it cannot change the result of this function, for the reason
# given. Any other name raises (tests/models/test_hf_kwargs.py reads the installed
# transformers' model files and fails on a name missing here).
KWARG_ROLES: dict[str, tuple[str, str]] = {
    "attention_mask": ("used", "the op's attn_mask (bool from the sdpa mask function, or additive float)"),
    "dropout": ("used", "the op's dropout_p (HF passes 0 in eval mode)"),
    "scaling": ("used", "the op's scale"),
    "is_causal": ("used", "causality where no mask is given (overrides module.is_causal)"),
    "sliding_window": ("used", "the varlen window; on the dense path already in the mask, and a tile-skipping window"),
    "softcap": ("used", "the op's softcap (Gemma 2 / Grok logit soft-capping)"),
    "s_aux": ("used", "the op's sinks (gpt-oss's per-head sink logits)"),
    "sinks": ("used", "the op's sinks when per head (Hq,); other shapes raise"),
    "position_bias": ("used", "T5's relative bias, an additive float mask"),
    "cu_seq_lens_q": ("used", "flash_attention_varlen's cu_seqlens_q (packed sequences)"),
    "cu_seq_lens_k": ("used", "flash_attention_varlen's cu_seqlens_k"),
    "max_length_q": ("used", "flash_attention_varlen's max_seqlen_q (derived from cu_seq_lens_q when None)"),
    "max_length_k": ("used", "flash_attention_varlen's max_seqlen_k"),
    "position_ids": ("used", "positions restarting inside a row mark packed sequences (varlen); "
                             "otherwise unused, RoPE is applied before attention"),
    "output_attentions": ("used", "True runs the model's eager attention, which returns the weights"),
    "query": ("used", "the query, passed by keyword"),
    "key": ("used", "the keys, passed by keyword"),
    "value": ("used", "the values, passed by keyword"),
    "indices": ("ignored", "FlashMLA's sparse top-k indices (DeepSeek-V3.2 family); for any other "
                           "implementation the model folds the selection into attention_mask"),
    "block_indices": ("ignored", "a block-sparse kernel's selection (MiniMax-M3); the model folds it into "
                                 "attention_mask for any other implementation"),
    "deterministic": ("ignored", "FlashAttention's deterministic-backward switch (ModernBERT); "
                                 "torch.use_deterministic_algorithms governs ours"),
    "seq_idx": ("ignored", "the Mamba kernels' sequence index; attention takes packing from "
                           "cu_seq_lens_q/k or position_ids"),
    "num_items_in_batch": ("ignored", "the loss's normaliser"),
    "output_hidden_states": ("ignored", "an output switch of the model"),
    "output_router_logits": ("ignored", "an output switch of MoE models"),
    "return_dict": ("ignored", "an output switch of the model"),
    "use_cache": ("ignored", "the cache is updated before attention"),
    "cache_position": ("ignored", "the cache is updated before attention; the mask carries the offsets"),
    "past_key_values": ("ignored", "the cache is updated before attention"),
    "past_key_value": ("ignored", "the cache is updated before attention (older name)"),
    "layer_idx": ("ignored", "the layer's index, for caches"),
    "position_embeddings": ("ignored", "RoPE's cos/sin, applied before attention"),
    "target_dtype": ("ignored", "FlashAttention's cast for fp32 inputs; the op runs every dtype"),
}

_warned: set[str] = set()
_REGISTERED: set[str] = set()


def register(name: str = NAME) -> str:
    """Register :func:`attention_forward` as ``attn_implementation=name`` (default
    ``"inductor_stable"``) in transformers' ``AttentionInterface`` and ``AttentionMaskInterface``.

    Idempotent; importing ``flash_inductor.transformers`` already calls it once. Returns the name.
    Afterwards ``AutoModel.from_config(config, attn_implementation=name)``, ``from_pretrained(...,
    attn_implementation=name)`` and ``model.set_attn_implementation(name)`` select it. A name that
    transformers treats as FlashAttention or as a Hub kernel raises ``ValueError``.
    """
    from transformers import AttentionInterface, AttentionMaskInterface

    _check_name(name)
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, attention_mask_function)
    _REGISTERED.add(name)
    _refuse_legacy_name()
    return name


def _legacy_name_error(name: str) -> ValueError:
    return ValueError(
        f'attn_implementation="{name}" is no longer registered: transformers treats every name containing '
        f'"flash" as a FlashAttention build (it passes packed-sequence arguments instead of a mask and may '
        f'replace the name by a Hub kernel). Use attn_implementation="{NAME}" (import flash_inductor.transformers).'
    )


def _check_name(name: str) -> None:
    """Refuse a name transformers would not hand to a plain attention function. The tests are
    transformers' own (whichever of them the installed version has)."""
    from transformers.utils import generic

    flash = getattr(generic, "is_flash_attention_requested", None)
    if "flash" in name or (flash is not None and flash(requested_attention_implementation=name)):
        raise _legacy_name_error(name) if name == LEGACY_NAME else ValueError(
            f'register({name!r}): transformers treats names containing "flash" as FlashAttention; '
            f'choose another name, e.g. the default "{NAME}".')
    try:
        from transformers.integrations.hub_kernels import is_kernel
    except ImportError:
        is_kernel = None
    if "|" in name or (is_kernel is not None and is_kernel(name)) or "sdpa" in name or "flex_attention" in name:
        raise ValueError(f'register({name!r}): transformers gives names containing "|", "sdpa", "flex_attention" '
                         f'or of the form "org/repo" a meaning of their own; choose another name, e.g. "{NAME}".')


def _refuse_legacy_name() -> None:
    """``attn_implementation="flash_inductor"`` raises, naming the new name, where a model is
    created or switched (``PreTrainedModel._check_and_adjust_attn_implementation``, the one
    place every selection passes, before transformers may swap a "flash" name for a Hub kernel).
    Every other name passes through unchanged. Without that method the old name is simply not
    registered, and transformers refuses it itself."""
    from transformers import PreTrainedModel

    original = getattr(PreTrainedModel, "_check_and_adjust_attn_implementation", None)
    if original is None or getattr(original, "_flash_inductor_guard", False):
        return

    @functools.wraps(original)
    def _check_and_adjust_attn_implementation(self, attn_implementation, *args, **kwargs):
        names = attn_implementation.values() if isinstance(attn_implementation, dict) else [attn_implementation]
        for name in names:
            if isinstance(name, str) and name.removeprefix("paged|") == LEGACY_NAME:
                raise _legacy_name_error(LEGACY_NAME)
        return original(self, attn_implementation, *args, **kwargs)

    _check_and_adjust_attn_implementation._flash_inductor_guard = True
    PreTrainedModel._check_and_adjust_attn_implementation = _check_and_adjust_attn_implementation


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, UserWarning, stacklevel=3)


def _check_kwargs(kwargs: dict) -> None:
    # None is every HF keyword's "absent": an unknown one that is None cannot change the result.
    unknown = sorted(k for k, v in kwargs.items() if k not in KWARG_ROLES and v is not None)
    if unknown:
        raise ValueError(
            f'attn_implementation="{NAME}" got keyword argument(s) {unknown} that it does not know; they may change '
            "the result, so they are not dropped. Load the model with attn_implementation=\"sdpa\" or \"eager\", or, "
            "if an argument cannot change attention's result, declare it: "
            f"flash_inductor.transformers.KWARG_ROLES[{unknown[0]!r}] = ('ignored', 'why')."
        )


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


def _eager_fallback(module, query, key, value, attention_mask, dropout, scaling, causal, kwargs):
    """The model's own ``eager_attention_forward`` (from its modeling module), which returns the
    attention weights. HF's ``"eager"`` mask is additive float; ours is boolean, so it is
    converted here the way HF's eager mask function does (``finfo.min`` where hidden)."""
    modeling = sys.modules.get(type(module).__module__)
    eager = getattr(modeling, "eager_attention_forward", None)
    if eager is None:
        return None
    if attention_mask is None and causal and query.shape[2] > 1:
        # None stood for is_causal=True (lower-right aligned when the cache holds earlier keys).
        q_len, kv_len = query.shape[2], key.shape[2]
        attention_mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        attention_mask = torch.where(attention_mask, 0.0, torch.finfo(query.dtype).min).to(query.dtype)
    kwargs = {k: v for k, v in kwargs.items() if v is not None and k not in ("is_causal",)}
    return eager(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def _causal(module, is_causal: Optional[bool]) -> bool:
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
    s_aux: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
    **kwargs,
) -> tuple[Tensor, Optional[Tensor]]:
    """transformers' attention-function contract on :func:`flash_inductor.flash_attention` and
    :func:`flash_inductor.flash_attention_varlen`.

    Args:
        module: the calling attention module (read: ``is_causal``).
        query: ``(B, Hq, L, E)``. key, value: ``(B, Hkv, S, E)``, ``(B, Hkv, S, Ev)``.
        attention_mask: from the ``"sdpa"`` mask function: bool ``(B, 1, L, S)`` (True =
            attend), a float additive mask a caller built itself, or None (then causality comes
            from ``is_causal`` / ``module.is_causal``).
        dropout: attention dropout probability (HF passes 0 in eval mode).
        scaling: softmax scale (None = ``1/sqrt(E)``).
        is_causal: overrides ``module.is_causal`` (HF passes it for some models).
        position_bias: T5's relative bias ``(1 or B, H, L, S)``, added to the scores.
        sliding_window: part of ``attention_mask`` (HF builds the band into it); also passed on
            as a slightly wider ``window`` so the kernels skip the tiles outside it; on packed
            sequences FlashAttention's window ``(sliding_window - 1, 0)``.
        softcap: logit soft-capping ``c * tanh(s / c)`` (None or 0: none).
        s_aux, sinks: per-head sink logits ``(Hq,)`` that join the softmax denominator.
        **kwargs: ``cu_seq_lens_q/k``, ``max_length_q/k`` and packed ``position_ids`` select the
            varlen op; the rest are listed in :data:`KWARG_ROLES`; any other name raises.

    Returns:
        ``(attn_output (B, L, Hq, Ev), None)``; with ``output_attentions=True``, what the
        model's eager attention returns, weights included.
    """
    _check_kwargs(kwargs)
    query = kwargs.pop("query", query)
    key, value = kwargs.pop("key", key), kwargs.pop("value", value)
    sinks = _sinks(s_aux, sinks, query)
    q_len, kv_len = query.shape[2], key.shape[2]
    layer_causal = _causal(module, is_causal)
    attentions = _attentions_requested(kwargs)
    skipped = None
    if attention_mask is None and layer_causal and q_len == kv_len > 1:
        skipped = _skipped_packing(module, query, sliding_window)
    if skipped is None:
        documents = _documents(query, key, kwargs)
    else:
        # The mask function left this layer's packed mask unbuilt: its record, not the keywords
        # (which may lack position_ids or sliding_window), says the sequences and the window.
        documents, sliding_window = skipped
        given = _documents(query, key, kwargs) if kwargs.get("cu_seq_lens_q") is not None else None
        if given is not None and not (torch.equal(given.cu_q, documents.cu_q)
                                      and torch.equal(given.cu_k, documents.cu_k)):
            attention_mask = _packed_mask(documents, True, sliding_window)  # both hold: the mask, within each
            documents = given
    # Packed sequences run varlen when the mask (if any), restricted to each sequence, is exactly
    # their causal (or sliding) pattern; the restricted mask itself is built only where it is read.
    on_varlen = documents is not None and (attention_mask is None or documents.is_packed_pattern(
        attention_mask, layer_causal, sliding_window))
    if documents is not None and attention_mask is not None and (attentions or not on_varlen):
        attention_mask = _restrict_to_documents(attention_mask, documents)

    if attentions:
        dense_mask = attention_mask
        if documents is not None and dense_mask is None:
            if documents.ids is None:
                raise ValueError(f'attn_implementation="{NAME}": output_attentions=True with cu_seq_lens_q != '
                                 "cu_seq_lens_k is not supported.")
            dense_mask = _packed_mask(documents, layer_causal, sliding_window)
        fallback = _eager_fallback(
            module, query, key, value, dense_mask, dropout, scaling, layer_causal and documents is None,
            dict(kwargs, position_bias=position_bias, sliding_window=sliding_window, softcap=softcap, s_aux=s_aux,
                 sinks=sinks if s_aux is None else None))
        if fallback is not None:
            _warn_once("output_attentions",
                       f'attn_implementation="{NAME}" does not return attention weights; output_attentions=True '
                       "runs the model's eager attention instead.")
            return fallback
        _warn_once("output_attentions_none",
                   f'attn_implementation="{NAME}" does not return attention weights and '
                   f"{type(module).__module__} has no eager_attention_forward to fall back to: they are None.")

    if on_varlen:
        if position_bias is not None:
            raise ValueError(f'attn_implementation="{NAME}": position_bias with packed sequences (cu_seq_lens_q/k or '
                             "packed position_ids) is not supported; pass an attention_mask per row instead.")
        return _varlen(query, key, value, documents, dropout, scaling, layer_causal, sliding_window, softcap,
                       sinks), None
    if documents is not None:
        layer_causal = False  # the mask, restricted to each sequence, says it all

    # As sdpa_attention_forward: a missing mask means causal only for a multi-token query; a
    # single query token (decoding) sees every cached key.
    causal = bool(q_len > 1 and attention_mask is None and layer_causal)
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
        window=_tile_skipping_window(layer_causal, sliding_window, attention_mask, q_len, key.shape[2]),
        softcap=softcap, sinks=sinks,
    )
    return out.transpose(1, 2).contiguous(), None


def _skipped_packing(module, query: Tensor, sliding_window) -> Optional[tuple["_Documents", Optional[int]]]:
    """The sequences and the window of a packed mask the mask function left unbuilt, or None."""
    if torch.compiler.is_compiling():
        # A compiled model builds its masks (the mask function records nothing while compiling). Layers
        # compiled one by one under an eager model may see a record: reading it breaks the graph.
        return _skipped_packing_eagerly(module, query, sliding_window) if packing_recorded() else None
    return _skipped_packing_eagerly(module, query, sliding_window)


@torch.compiler.disable
def _skipped_packing_eagerly(module, query: Tensor, sliding_window):
    skipped = recorded_packing(module, query.shape[0], query.shape[2], query.device)
    if skipped is None:
        return None
    return _recorded_documents(skipped), skipped.window_for(module, sliding_window)


def _recorded_documents(skipped: SkippedPacking) -> "_Documents":
    """The sequences of HF's per-row ids, built once per record (every layer shares it)."""
    documents = skipped.cache.get("documents")
    if documents is None:
        ids = skipped.ids
        starts = torch.ones_like(ids, dtype=torch.bool)
        starts[:, 1:] = ids.diff(dim=-1) != 0
        flat = starts.reshape(-1)
        cu = torch.cat([flat.nonzero().view(-1), flat.new_tensor([flat.numel()], dtype=torch.int64)]).to(torch.int32)
        documents = _Documents(cu, cu, None, None, ids=flat.cumsum(0).view(ids.shape))
        skipped.cache["documents"] = documents
    return documents


def _sinks(s_aux: Optional[Tensor], sinks: Optional[Tensor], query: Tensor) -> Optional[Tensor]:
    """gpt-oss's ``s_aux`` or a ``sinks`` argument: one logit per query head, as the op takes it."""
    if s_aux is not None and sinks is not None:
        raise ValueError(f'attn_implementation="{NAME}": got both s_aux and sinks; pass one.')
    given = s_aux if s_aux is not None else sinks
    if given is None:
        return None
    if given.dim() != 1 or given.shape[0] != query.shape[1]:
        name = "s_aux" if s_aux is not None else "sinks"
        raise ValueError(
            f'attn_implementation="{NAME}" takes one sink logit per query head, {name} of shape ({query.shape[1]},); '
            f"got {tuple(given.shape)} (per-query sinks). Load the model with attn_implementation=\"eager\".")
    return given


class _Documents:
    """Packed sequences over the flattened batch: ``cu_q`` / ``cu_k`` (int32 offsets into the
    ``B * L`` query and ``B * S`` key rows), their longest lengths, and, for self-attention
    packing, each token's sequence number ``ids`` ``(B, L)`` to compare a mask against (from
    ``make_ids`` on first use: a call without a mask never needs them).

    One object serves every layer of a forward where the positions are the packing (``_documents``
    keeps it), so what it derives from the sequences (the same-sequence mask, whether a given mask
    tensor is their packed pattern) is derived once, not per layer."""

    def __init__(self, cu_q: Tensor, cu_k: Tensor, max_q, max_k, ids: Optional[Tensor] = None,
                 make_ids: Optional[Callable[[], Optional[Tensor]]] = None):
        self.cu_q, self.cu_k = cu_q, cu_k
        self._ids, self._make_ids = ids, make_ids
        self.max_q = int(cu_q.diff().max()) if max_q is None else int(max_q)
        self.max_k = int(cu_k.diff().max()) if max_k is None else int(max_k)
        self._same_sequence: Optional[Tensor] = None
        self._patterns: dict[tuple, tuple] = {}  # (id(mask), version, causal, window) -> (weakref, answer)

    @property
    def ids(self) -> Optional[Tensor]:
        if self._make_ids is not None:
            self._ids, self._make_ids = self._make_ids(), None
        return self._ids

    def same_sequence(self) -> Tensor:
        """``(B, 1, L, L)`` bool: query and key in the same sequence."""
        if self._same_sequence is None:
            self._same_sequence = (self.ids[:, :, None] == self.ids[:, None, :])[:, None]
        return self._same_sequence

    def is_packed_pattern(self, attention_mask: Tensor, causal: bool, sliding_window: Optional[int]) -> bool:
        """Whether a boolean mask, restricted to each sequence, says exactly what the varlen op
        computes from the sequences alone: causal (and HF's band ``j > i - sliding_window``) within
        each sequence. Decided once per mask tensor: HF hands every layer of a kind the same one."""
        if attention_mask.dtype != torch.bool or self.ids is None or (sliding_window is not None and not causal):
            return False
        key = (id(attention_mask), attention_mask._version, causal, sliding_window)
        known = self._patterns.get(key)
        if known is not None and known[0]() is attention_mask:
            return known[1]
        expected = _packed_mask(self, causal, sliding_window)
        restricted = attention_mask & self.same_sequence()
        answer = restricted.shape[-2:] == expected.shape[-2:] and bool((restricted == expected).all())
        self._patterns[key] = (weakref.ref(attention_mask), answer)
        return answer


def _documents(query: Tensor, key: Tensor, kwargs: dict) -> Optional[_Documents]:
    """The packed sequences the call describes: ``cu_seq_lens_q/k`` (FlashAttention's
    arguments), or ``position_ids`` that restart inside a row (HF's test: a step other than +1
    starts a sequence, as ``masking_utils.find_packed_sequence_indices``), else None."""
    batch, q_len, kv_len = query.shape[0], query.shape[2], key.shape[2]
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
        if cu_q is None or cu_k is None:
            raise ValueError(f'attn_implementation="{NAME}": cu_seq_lens_q and cu_seq_lens_k come together; got one.')
        if int(cu_q[-1]) != batch * q_len or int(cu_k[-1]) != batch * kv_len:
            raise ValueError(
                f'attn_implementation="{NAME}": cu_seq_lens_q/k must end at the packed token counts B*L = '
                f"{batch * q_len} and B*S = {batch * kv_len}; got {int(cu_q[-1])} and {int(cu_k[-1])}.")
        def make_ids():
            if q_len != kv_len or not torch.equal(cu_q, cu_k):
                return None
            return _ids_from_offsets(cu_q.to(torch.int64), batch * q_len).view(batch, q_len)

        return _Documents(cu_q.to(torch.int32), cu_k.to(torch.int32), kwargs.get("max_length_q"),
                          kwargs.get("max_length_k"), make_ids=make_ids)
    position_ids = kwargs.get("position_ids")
    if (not isinstance(position_ids, Tensor) or position_ids.dim() != 2 or q_len != kv_len or q_len < 2
            or position_ids.shape[-1] != q_len or position_ids.shape[0] not in (1, batch)):
        return None
    if torch.compiler.is_compiling():
        # Reading the positions is data-dependent (a graph break per layer). Compiled, packing
        # comes from cu_seq_lens_q/k or from the mask HF builds out of packed positions (it does
        # without a cache: pass use_cache=False when training on packed rows).
        return None
    # Every layer gets the same position_ids: read them (a device sync) once per forward.
    last = _LAST_POSITIONS
    if last and last[0] is position_ids and last[1] == (position_ids._version, batch):
        return last[2]
    documents = _documents_from_positions(position_ids, batch, q_len)
    _LAST_POSITIONS[:] = [position_ids, (position_ids._version, batch), documents]
    return documents


_LAST_POSITIONS: list = []


def _documents_from_positions(position_ids: Tensor, batch: int, q_len: int) -> Optional[_Documents]:
    position_ids = position_ids.expand(batch, q_len)
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids.diff(dim=-1) != 1
    if int(starts.sum()) == batch:  # one sequence per row: not packed
        return None
    flat = starts.reshape(-1)
    cu = torch.cat([flat.nonzero().view(-1), flat.new_tensor([flat.numel()], dtype=torch.int64)]).to(torch.int32)
    return _Documents(cu, cu, None, None, ids=flat.cumsum(0).view(batch, q_len))


def _ids_from_offsets(cu: Tensor, total: int) -> Tensor:
    marks = torch.zeros(total + 1, dtype=torch.int64, device=cu.device)
    marks.index_add_(0, cu, torch.ones_like(cu))
    return marks[:total].cumsum(0)


def _restrict_to_documents(attention_mask: Tensor, documents: _Documents) -> Tensor:
    """The mask HF built, with every key outside the query's own sequence hidden too (a mask HF
    built from the same packed positions already hides them)."""
    if documents.ids is None:
        raise ValueError(f'attn_implementation="{NAME}": an attention_mask together with cu_seq_lens_q != cu_seq_lens_k '
                         "is not supported; pass one or the other.")
    same = documents.same_sequence()
    if attention_mask.dtype == torch.bool:
        return attention_mask & same
    return attention_mask.masked_fill(~same, float("-inf"))


def _packed_mask(documents: _Documents, causal: bool, sliding_window: Optional[int]) -> Tensor:
    """The boolean ``(B, 1, L, L)`` mask of the packed sequences: within a sequence, causal (and
    HF's band ``j > i - sliding_window``) if asked; nothing across."""
    mask = documents.same_sequence()
    if causal:
        pos = torch.arange(mask.shape[-1], device=mask.device)
        mask = mask & (pos[None, :] <= pos[:, None])
        if sliding_window is not None:
            mask = mask & (pos[None, :] > pos[:, None] - int(sliding_window))
    return mask


def _varlen(query, key, value, documents: _Documents, dropout, scaling, causal, sliding_window, softcap, sinks):
    """(B, H, L, E) -> the varlen op on (B*L, H, E) -> (B, L, H, Ev)."""
    batch, heads, q_len = query.shape[0], query.shape[1], query.shape[2]
    window = (-1, -1)
    if sliding_window is not None:
        window = (int(sliding_window) - 1, 0 if causal else int(sliding_window) - 1)
    out = flash_attention_varlen(
        query.transpose(1, 2).reshape(-1, heads, query.shape[-1]),
        key.transpose(1, 2).reshape(-1, key.shape[1], key.shape[-1]),
        value.transpose(1, 2).reshape(-1, value.shape[1], value.shape[-1]),
        documents.cu_q, documents.cu_k, documents.max_q, documents.max_k,
        dropout_p=float(dropout), softmax_scale=scaling, causal=causal, window_size=window,
        softcap=0.0 if softcap is None else softcap, sinks=sinks)
    return out.view(batch, q_len, heads, out.shape[-1])


def _tile_skipping_window(causal_layer: bool, sliding_window: Optional[int], attention_mask: Optional[Tensor],
                          q_len: int, kv_len: int) -> Optional[tuple[int, int]]:
    """A window for the kernels to skip the tiles outside a causal sliding window, which HF has
    already folded into ``attention_mask``. It is (sliding_window, 0): one key wider on the left
    than HF's band (``j > i - sliding_window``), so whichever convention of the band's edge a model
    uses, the mask, not the window, decides every visible key and the result is unchanged. Only
    where queries and keys share positions (L == S: no cache offset; a sliding cache's ring buffer
    would not line up) and for a causal layer; anything else keeps the mask alone."""
    if sliding_window is None or attention_mask is None or q_len != kv_len or q_len <= 1:
        return None
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
