"""The mask function of ``attn_implementation="inductor_stable"``: no ``L x L`` mask for a packed batch.

transformers builds the mask an attention function receives through the function registered
under the implementation's name in ``AttentionMaskInterface``. ``create_causal_mask`` (and its
sliding-window sibling) hand it a composed ``mask_function`` and, for a padding-free packed batch
(``position_ids`` restarting at 0 per sequence, no 2-D mask, no cache:
``masking_utils.find_packed_sequence_indices``), they compose a same-sequence term into it and
forbid ``sdpa_mask``'s ``is_causal`` skip, so ``"sdpa"``'s mask function materialises a
``(B, 1, L, L)`` block-diagonal mask and every layer reads it.

:func:`attention_mask_function` reads the composed function instead of evaluating it. Where it is
exactly causal AND same-sequence (AND HF's sliding band ``j > i - w``), built from transformers'
own pieces, it returns None and records what it left out (:class:`SkippedPacking`: the sequence
ids HF computed, the window) under the model's config. Every other mask (padding, chunked,
bidirectional, image-token overlays, block overlays, a cache, anything it does not recognise,
any call under ``torch.compile``) is ``sdpa_mask``'s, unchanged.

The attention function then recovers the packing from that record (:func:`recorded_packing`),
not from its keyword arguments: several models pass attention neither ``position_ids``
(Ministral 3, Persimmon, Chameleon, ...) nor ``sliding_window`` (Qwen2-MoE, PhiMoE, Doge), and
the record says both. Pieces are recognised by their code objects, taken from transformers'
own factories at first use, so a transformers whose masks are built differently is recognised
as nothing and keeps the dense mask: a feature test, not a version test.

Importing this module does not import transformers.
"""

from __future__ import annotations

import functools
import weakref
from typing import Optional

import torch
from torch import Tensor

__all__ = ["SkippedPacking", "attention_mask_function", "packing_recorded", "recorded_packing"]


class SkippedPacking:
    """What :func:`attention_mask_function` left out of the masks of one forward of one model:
    HF's per-row sequence ids ``ids (B, L)`` and the windows of the masks it skipped (None: the
    full causal one; an int: a sliding one). ``cache`` is the attention function's, for what it
    derives from ``ids`` once per forward."""

    def __init__(self, config, ids: Tensor):
        self.config_ref = weakref.ref(config)
        self.ids = ids
        self.windows: set[Optional[int]] = set()
        self.cache: dict = {}

    def window_for(self, module, sliding_window: Optional[int]) -> Optional[int]:
        """The window of the mask this layer would have got. One skipped mask: its window. A full and a
        sliding one (Gemma 2, gpt-oss, Qwen2 with ``layer_types``): the layer's type in the config
        decides, as it decides which mask the model hands the layer; else its ``sliding_window``
        (keyword, then module attribute). Raises where nothing says it."""
        if len(self.windows) == 1:
            return next(iter(self.windows))
        sliding = sorted(w for w in self.windows if w is not None)
        config, layer = self.config_ref(), getattr(module, "layer_idx", None)
        layer_types = getattr(config, "layer_types", None)
        if isinstance(layer, int) and isinstance(layer_types, (list, tuple)) and 0 <= layer < len(layer_types):
            kind = layer_types[layer]
            if kind == "full_attention" and None in self.windows:
                return None
            if kind == "sliding_attention" and len(sliding) == 1:
                return sliding[0]
        for candidate in (sliding_window, getattr(module, "sliding_window", None)):
            if candidate is not None and int(candidate) in self.windows:
                return int(candidate)
        raise ValueError(
            f"attn_implementation=\"inductor_stable\": this packed batch's masks were left unbuilt (windows "
            f"{sorted(self.windows, key=str)}), and nothing tells which one layer {type(module).__name__} "
            f"(layer_idx {layer}) gets. Pass an explicit 4-D attention_mask, or load the model with "
            "attn_implementation=\"sdpa\".")


# id(config) -> SkippedPacking, or None once that config's causal mask was built for a batch
# that is not packed (its attention then never falls back to another model's record).
_RECORDS: dict[int, Optional[SkippedPacking]] = {}
_CONFIGS: dict[int, weakref.ref] = {}
_LIVE = [False]  # whether any record holds a packing: one constant for compiled code to guard on


def packing_recorded() -> bool:
    """Whether any model's packed mask is currently left unbuilt (cheap; compiled code reads it)."""
    return _LIVE[0]


@functools.cache
def _pieces():
    """transformers' mask pieces: (code object -> kind, the causal function). Each factory that the
    installed transformers lacks is simply absent."""
    from transformers import masking_utils as mu

    probe = torch.zeros(1, 1, dtype=torch.long)
    makers = (("and", lambda: mu.and_masks(mu.causal_mask_function)),
              ("sliding", lambda: mu.sliding_window_overlay(1)),
              ("packed", lambda: mu.packed_sequence_mask_function(probe)),
              ("remap", lambda: mu.remap_positions_for_packed_sequence(mu.causal_mask_function, probe)))
    codes = {}
    for kind, make in makers:
        try:
            codes[make().__code__] = kind
        except (AttributeError, TypeError):
            pass
    return codes, getattr(mu, "causal_mask_function", None)


def _atoms(fn, depth: int = 0) -> Optional[list[tuple[str, object]]]:
    """The conjunction a composed mask function computes, as (kind, value) atoms: ("causal", None),
    ("sliding", w), ("packed", ids), ("remap", positions); None where any part is not one of them."""
    codes, causal = _pieces()
    if causal is not None and fn is causal:
        return [("causal", None)]
    kind = codes.get(getattr(fn, "__code__", None))
    if kind is None or depth > 8:
        return None
    cells = dict(zip(fn.__code__.co_freevars, (cell.cell_contents for cell in fn.__closure__ or ())))
    if kind == "and":
        parts = [_atoms(part, depth + 1) for part in cells.get("mask_functions", ())]
        return None if not parts or any(p is None for p in parts) else [a for p in parts for a in p]
    if kind == "sliding":
        return [("sliding", cells.get("sliding_window"))]
    if kind == "packed":
        return [("packed", cells.get("packed_sequence_mask"))]
    inner = _atoms(cells.get("mask_function"), depth + 1)
    return None if inner is None else inner + [("remap", cells.get("position_ids"))]


def _skippable(kwargs: dict) -> tuple[Optional[list], Optional[tuple[Tensor, Optional[int]]]]:
    """(the atoms of the call's mask function or None, (ids, window) where the mask is exactly
    causal AND same-sequence (AND a sliding band) over the whole batch, else None)."""
    atoms = _atoms(kwargs.get("mask_function"))
    if atoms is None:
        return None, None
    kinds = [kind for kind, _ in atoms]
    packed = [value for kind, value in atoms if kind == "packed"]
    windows = {value for kind, value in atoms if kind == "sliding"}
    batch, q_len, kv_len = kwargs.get("batch_size"), kwargs.get("q_length"), kwargs.get("kv_length")
    if (not packed or "causal" not in kinds or len(windows) > 1 or len({id(p) for p in packed}) != 1
            or not isinstance(packed[0], Tensor) or kwargs.get("attention_mask") is not None):
        return atoms, None
    ids, window = packed[0], next(iter(windows), None)
    if window is not None and (not isinstance(window, int) or window < 1):
        return atoms, None
    # Positions remapped per sequence (transformers >= 5.2x) change nothing for translation-invariant
    # causal and band terms within a sequence of consecutive positions, which is what ids delimits.
    if any(kind == "remap" and (not isinstance(value, Tensor) or value.shape != ids.shape)
           for kind, value in atoms):
        return atoms, None
    if (ids.dim() != 2 or tuple(ids.shape) != (batch, q_len) or q_len != kv_len
            or kwargs.get("q_offset", 0) != 0 or kwargs.get("kv_offset", 0) != 0):
        return atoms, None
    return atoms, (ids, window)


def attention_mask_function(*args, **kwargs):
    """``AttentionMaskInterface``'s function for ``"inductor_stable"``: None for a packed causal (or
    causal sliding-window) mask, recorded for :func:`recorded_packing`; ``sdpa_mask``'s result for
    everything else, with its own ``is_causal`` skip (None for a plain causal mask without padding)."""
    from transformers.masking_utils import sdpa_mask

    config = kwargs.get("config")
    if args or config is None or torch.compiler.is_compiling():
        return sdpa_mask(*args, **kwargs)
    atoms, skip = _skippable(kwargs)
    key = id(config)
    record = _RECORDS.get(key)
    if _CONFIGS.get(key, lambda: None)() is not config:
        record = None
    if skip is not None:
        ids, window = skip
        if record is None or not _same_ids(record.ids, ids):
            record = SkippedPacking(config, ids)
        record.windows.add(window)
        _remember(config, record)
        return None
    if atoms is not None:
        packed = [value for kind, value in atoms if kind == "packed"]
        if not packed:
            _remember(config, None)  # this config's batch is not packed: no earlier record holds
        elif record is not None and not _same_ids(record.ids, packed[0]):
            _remember(config, None)
    return sdpa_mask(**kwargs)


def _same_ids(a: Tensor, b: Tensor) -> bool:
    return a is b or (a.shape == b.shape and a.device == b.device and bool(torch.equal(a, b)))


def _remember(config, record: Optional[SkippedPacking]) -> None:
    for key in [k for k, ref in _CONFIGS.items() if ref() is None]:
        _CONFIGS.pop(key, None)
        _RECORDS.pop(key, None)
    _CONFIGS[id(config)] = weakref.ref(config)
    _RECORDS[id(config)] = record
    _LIVE[0] = any(r is not None for r in _RECORDS.values())


def recorded_packing(module, batch: int, length: int, device: torch.device) -> Optional[SkippedPacking]:
    """The packing :func:`attention_mask_function` left out of this layer's mask: the record of the
    layer's config (``module.config``, the object the model built its masks from). A module whose
    config built no mask (none, or another object) takes the one live record of this batch's
    shape (several: an error). None where nothing was left out."""
    config = getattr(module, "config", None)
    key = id(config)
    if config is not None and key in _RECORDS and _CONFIGS[key]() is config:
        candidates = [_RECORDS[key]]
    else:
        candidates = [r for k, r in _RECORDS.items() if r is not None and _CONFIGS[k]() is not None]
    found = [r for r in candidates
             if r is not None and tuple(r.ids.shape) == (batch, length) and r.ids.device == device]
    if len(found) > 1:
        raise ValueError(
            f'attn_implementation="inductor_stable": {type(module).__name__} has no config that built its mask, and '
            f"{len(found)} models left a packed mask of this shape unbuilt; pass an explicit 4-D attention_mask.")
    return found[0] if found else None
