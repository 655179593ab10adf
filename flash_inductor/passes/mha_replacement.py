"""What an ``nn.MultiheadAttention`` site becomes: projections in PyTorch, attention in our op.

Two entry points with the exact semantics of the PyTorch functions they replace, for the
argument sets the pass rewrites (see ``mha.py`` for what it keeps and why):

* :func:`multi_head_attention_via_flash` -- ``F.multi_head_attention_forward``.
* :func:`transformer_encoder_layer_via_flash` -- ``torch._transformer_encoder_layer_fwd``, the
  fused path ``nn.TransformerEncoderLayer`` takes in eval mode without grad.

Each is three pieces, and the pass inserts the pieces rather than the whole so that a
rewritten graph, like every other family's, has one :func:`~.site.rewritten_attention` call:

    *_attention_inputs (projection, heads, mask)  ->  rewritten_attention  ->  *_output

Masks are built in SDPA's convention (bool True = attend, float additive) as broadcast views;
nothing is materialised beyond what the replaced function itself allocates. The one
difference is the op's: a query row that sees no key returns 0 (MHA returns NaN there).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .site import rewritten_attention

# --------------------------------------------------------------------------------------
# F.multi_head_attention_forward
# --------------------------------------------------------------------------------------


def mha_effective_arguments(
    *, training: bool, dropout_p: float, is_causal: bool, need_weights: bool,
    has_key_padding_mask: bool, has_attn_mask: bool,
) -> tuple[float, bool, bool]:
    """(dropout_p, is_causal, keep attn_mask) as ``F.multi_head_attention_forward`` resolves them.

    There ``is_causal`` is only a hint and ``attn_mask`` must be given with it. The hint is
    used (and the mask dropped) only when no key padding mask has to be merged into the mask
    and no weights are returned; otherwise the (causal) mask itself is applied.
    """
    if is_causal and not has_attn_mask:
        raise RuntimeError(
            "multi_head_attention_via_flash: is_causal=True needs attn_mask (as in "
            "F.multi_head_attention_forward); build it with nn.Transformer.generate_square_subsequent_mask."
        )
    use_hint = bool(is_causal) and not has_key_padding_mask and not need_weights
    return (float(dropout_p) if training else 0.0), use_hint, has_attn_mask and not use_hint


def _as_additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """MHA's own conversion of a bool mask (True = masked) to a float one, in ``dtype``."""
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))


def _check_mask_dtype(mask: Tensor, name: str) -> None:
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(
            f"multi_head_attention_via_flash: {name} must be bool (True = masked out) or floating "
            f"(additive), got {mask.dtype}."
        )


def mha_mask(
    attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor], *, batch: int, num_heads: int,
    tgt_len: int, src_len: int, batched: bool, dtype: torch.dtype,
) -> Optional[Tensor]:
    """MHA's two masks merged into one SDPA-convention mask broadcastable to (B, H, L, S).

    MHA's convention is the opposite of SDPA's for bools: True means *not allowed*. Broadcast
    dims stay views; only a merge of both masks allocates, at (B, 1 or H, L, S), which is no
    more than MHA's own (B*H, L, S) float sum.
    """
    if key_padding_mask is not None:
        _check_mask_dtype(key_padding_mask, "key_padding_mask")
        if not batched:
            key_padding_mask = key_padding_mask.unsqueeze(0)
        if tuple(key_padding_mask.shape) != (batch, src_len):
            raise ValueError(
                f"multi_head_attention_via_flash: key_padding_mask should have shape {(batch, src_len)} "
                f"(batch, source length), got {tuple(key_padding_mask.shape)}."
            )
        key_padding_mask = key_padding_mask.view(batch, 1, 1, src_len)
    if attn_mask is not None:
        _check_mask_dtype(attn_mask, "attn_mask")
        if attn_mask.dim() == 2:
            if tuple(attn_mask.shape) != (tgt_len, src_len):
                raise ValueError(
                    f"multi_head_attention_via_flash: the 2-D attn_mask should have shape {(tgt_len, src_len)}, "
                    f"got {tuple(attn_mask.shape)}."
                )
        elif attn_mask.dim() == 3:
            if tuple(attn_mask.shape) != (batch * num_heads, tgt_len, src_len):
                raise ValueError(
                    "multi_head_attention_via_flash: the 3-D attn_mask should have shape "
                    f"{(batch * num_heads, tgt_len, src_len)} (batch * num_heads, L, S), got {tuple(attn_mask.shape)}."
                )
            attn_mask = attn_mask.view(batch, num_heads, tgt_len, src_len)
        else:
            raise ValueError(
                f"multi_head_attention_via_flash: attn_mask must be 2-D or 3-D, got {attn_mask.dim()}-D."
            )

    masks = [m for m in (attn_mask, key_padding_mask) if m is not None]
    if not masks:
        return None
    if all(m.dtype == torch.bool for m in masks):
        merged = masks[0] if len(masks) == 1 else masks[0] | masks[1]
        return ~merged
    # A float mask involved: MHA turns bool masks into -inf additive ones and adds them.
    masks = [_as_additive(m, dtype) if m.dtype == torch.bool else m for m in masks]
    return masks[0] if len(masks) == 1 else masks[0] + masks[1]


def _split_heads(x: Tensor, batch: int, num_heads: int) -> Tensor:
    """(T, B, H*D) -> (B, H, T, D), a view."""
    return x.view(x.shape[0], batch, num_heads, -1).permute(1, 2, 0, 3)


def _in_projection(query, key, value, num_heads, in_proj_weight, in_proj_bias, use_separate_proj_weight,
                   q_proj_weight, k_proj_weight, v_proj_weight):
    """q, k, v projected and split into heads, (B, H, T, D) views of the projections."""
    embed_dim, batch = query.shape[-1], query.shape[1]
    if use_separate_proj_weight:
        for name, w in (("q_proj_weight", q_proj_weight), ("k_proj_weight", k_proj_weight),
                        ("v_proj_weight", v_proj_weight)):
            if w is None:
                raise ValueError(f"multi_head_attention_via_flash: use_separate_proj_weight=True needs {name}.")
        b_q = b_k = b_v = None
        if in_proj_bias is not None:
            b_q, b_k, b_v = in_proj_bias.chunk(3)
        q, k, v = F.linear(query, q_proj_weight, b_q), F.linear(key, k_proj_weight, b_k), F.linear(value, v_proj_weight, b_v)
        return tuple(_split_heads(t, batch, num_heads) for t in (q, k, v))
    if in_proj_weight is None:
        raise ValueError("multi_head_attention_via_flash: use_separate_proj_weight=False needs in_proj_weight.")
    if query is key and key is value:
        # Self-attention: one GEMM against the packed weight, as MHA does; q, k, v stay views
        # of it (MHA copies them apart with .contiguous(); the op reads strided inputs).
        proj = F.linear(query, in_proj_weight, in_proj_bias)
        proj = proj.view(proj.shape[0], batch, 3, num_heads, -1).permute(2, 1, 3, 0, 4)
        return proj[0], proj[1], proj[2]
    if key is value:
        w_q, w_kv = in_proj_weight.split([embed_dim, 2 * embed_dim])
        b_q = b_kv = None
        if in_proj_bias is not None:
            b_q, b_kv = in_proj_bias.split([embed_dim, 2 * embed_dim])
        kv = F.linear(key, w_kv, b_kv)
        kv = kv.view(kv.shape[0], batch, 2, num_heads, -1).permute(2, 1, 3, 0, 4)
        return _split_heads(F.linear(query, w_q, b_q), batch, num_heads), kv[0], kv[1]
    w_q, w_k, w_v = in_proj_weight.chunk(3)
    b_q = b_k = b_v = None
    if in_proj_bias is not None:
        b_q, b_k, b_v = in_proj_bias.chunk(3)
    q, k, v = F.linear(query, w_q, b_q), F.linear(key, w_k, b_k), F.linear(value, w_v, b_v)
    return tuple(_split_heads(t, batch, num_heads) for t in (q, k, v))


def mha_attention_inputs(
    query: Tensor, key: Tensor, value: Tensor, embed_dim_to_check: int, num_heads: int,
    in_proj_weight: Optional[Tensor], in_proj_bias: Optional[Tensor], *,
    key_padding_mask: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None,
    use_separate_proj_weight: bool = False, q_proj_weight: Optional[Tensor] = None,
    k_proj_weight: Optional[Tensor] = None, v_proj_weight: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
    """MHA's in-projection and masks: (q, k, v) as (B, H, T, D) and the merged mask.

    ``attn_mask`` is the mask after :func:`mha_effective_arguments` (None when the causal
    hint replaced it). Inputs are MHA's sequence-first (T, B, E), or unbatched (T, E).
    """
    if query.dim() not in (2, 3) or key.dim() != query.dim() or value.dim() != query.dim():
        raise ValueError(
            "multi_head_attention_via_flash: query, key and value must all be 3-D (T, B, E) or all 2-D "
            f"(T, E), got {query.dim()}-D, {key.dim()}-D, {value.dim()}-D."
        )
    batched = query.dim() == 3
    if not batched:
        # The projection is chosen by identity (one packed GEMM for self-attention): keep it.
        q1 = query.unsqueeze(1)
        k1 = q1 if key is query else key.unsqueeze(1)
        value = k1 if value is key else (q1 if value is query else value.unsqueeze(1))
        query, key = q1, k1
    tgt_len, batch, embed_dim = query.shape
    src_len = key.shape[0]
    if embed_dim != embed_dim_to_check:
        raise ValueError(
            f"multi_head_attention_via_flash: query's embedding dim is {embed_dim} but embed_dim_to_check "
            f"is {embed_dim_to_check}."
        )
    if embed_dim % num_heads != 0:
        raise ValueError(
            f"multi_head_attention_via_flash: embed_dim {embed_dim} is not divisible by num_heads {num_heads}."
        )
    q, k, v = _in_projection(query, key, value, num_heads, in_proj_weight, in_proj_bias,
                             use_separate_proj_weight, q_proj_weight, k_proj_weight, v_proj_weight)
    mask = mha_mask(attn_mask, key_padding_mask, batch=batch, num_heads=num_heads, tgt_len=tgt_len,
                    src_len=src_len, batched=batched, dtype=query.dtype)
    return q, k, v, mask


def mha_output(attn: Tensor, out_proj_weight: Tensor, out_proj_bias: Optional[Tensor], batched: bool) -> Tensor:
    """(B, H, L, D) attention -> MHA's out-projection, (L, B, E) or unbatched (L, E)."""
    batch, num_heads, tgt_len, head_dim = attn.shape
    out = attn.permute(2, 0, 1, 3).reshape(tgt_len, batch, num_heads * head_dim)
    out = F.linear(out, out_proj_weight, out_proj_bias)
    return out if batched else out.squeeze(1)


def multi_head_attention_via_flash(
    query: Tensor, key: Tensor, value: Tensor, embed_dim_to_check: int, num_heads: int,
    in_proj_weight: Optional[Tensor], in_proj_bias: Optional[Tensor], bias_k: Optional[Tensor],
    bias_v: Optional[Tensor], add_zero_attn: bool, dropout_p: float, out_proj_weight: Tensor,
    out_proj_bias: Optional[Tensor], training: bool = True, key_padding_mask: Optional[Tensor] = None,
    need_weights: bool = True, attn_mask: Optional[Tensor] = None, use_separate_proj_weight: bool = False,
    q_proj_weight: Optional[Tensor] = None, k_proj_weight: Optional[Tensor] = None,
    v_proj_weight: Optional[Tensor] = None, static_k: Optional[Tensor] = None,
    static_v: Optional[Tensor] = None, average_attn_weights: bool = True, is_causal: bool = False,
    *, schedule: Optional[str] = None,
) -> tuple[Tensor, None]:
    """``F.multi_head_attention_forward`` with the attention on flash_inductor's op.

    Same arguments and conventions (sequence-first (L, B, E) inputs; a bool ``key_padding_mask``
    or ``attn_mask`` is True where attention is *not* allowed; float masks are additive;
    ``attn_mask`` is (L, S) or (B*num_heads, L, S); ``is_causal`` is a hint that needs
    ``attn_mask``), plus ``schedule``, the precision schedule of the op.

    Returns ``(attn_output, None)``: the attention weights are never formed, whatever
    ``need_weights`` says (it still decides, as in MHA, whether the causal hint is used).
    ``bias_k``/``bias_v``, ``add_zero_attn`` and ``static_k``/``static_v`` are not supported.
    """
    for name, unsupported in (("bias_k", bias_k is not None), ("bias_v", bias_v is not None),
                              ("add_zero_attn", bool(add_zero_attn)), ("static_k", static_k is not None),
                              ("static_v", static_v is not None)):
        if unsupported:
            raise NotImplementedError(
                f"multi_head_attention_via_flash: {name} is not supported; call F.multi_head_attention_forward."
            )
    dropout_p, causal, keep_mask = mha_effective_arguments(
        training=training, dropout_p=dropout_p, is_causal=is_causal, need_weights=need_weights,
        has_key_padding_mask=key_padding_mask is not None, has_attn_mask=attn_mask is not None,
    )
    q, k, v, mask = mha_attention_inputs(
        query, key, value, embed_dim_to_check, num_heads, in_proj_weight, in_proj_bias,
        key_padding_mask=key_padding_mask, attn_mask=attn_mask if keep_mask else None,
        use_separate_proj_weight=use_separate_proj_weight, q_proj_weight=q_proj_weight,
        k_proj_weight=k_proj_weight, v_proj_weight=v_proj_weight,
    )
    attn = rewritten_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal, schedule=schedule)
    return mha_output(attn, out_proj_weight, out_proj_bias, batched=query.dim() == 3), None


# --------------------------------------------------------------------------------------
# torch._transformer_encoder_layer_fwd (nn.TransformerEncoderLayer's eval fast path)
# --------------------------------------------------------------------------------------


def encoder_layer_mask(mask: Optional[Tensor], mask_type: Optional[int], batch: int, seq_len: int) -> Optional[Tensor]:
    """The fast path's mask in SDPA's convention (True = attend).

    The fused op casts any mask to bool, so a float mask masks out every *nonzero* entry
    (nn.TransformerEncoderLayer hands it -inf/0 masks, for which that is the additive
    meaning). mask_type 0: (L, L); 1: key padding (B, L); 2: (B, H, L, L).
    """
    if mask is None:
        return None
    attend = ~mask.to(torch.bool)
    if mask_type == 1:
        return attend.view(batch, 1, 1, seq_len)
    if mask_type == 0 and attend.dim() == 2:
        return attend
    if mask_type == 2 and attend.dim() == 4:
        return attend
    raise ValueError(
        f"transformer_encoder_layer_via_flash: mask of shape {tuple(mask.shape)} does not fit mask_type "
        f"{mask_type} (0: (L, L), 1: (B, L), 2: (B, H, L, L))."
    )


def encoder_layer_attention_inputs(
    src: Tensor, num_heads: int, qkv_weight: Tensor, qkv_bias: Tensor, norm_first: bool, eps: float,
    norm_weight_1: Tensor, norm_bias_1: Tensor, mask: Optional[Tensor], mask_type: Optional[int],
) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
    """(B, L, E) batch-first input -> q, k, v (B, H, L, D) of the packed self-attention, and the mask."""
    batch, seq_len, embed_dim = src.shape
    x = F.layer_norm(src, (embed_dim,), norm_weight_1, norm_bias_1, eps) if norm_first else src
    proj = F.linear(x, qkv_weight, qkv_bias)
    proj = proj.view(batch, seq_len, 3, num_heads, -1).permute(2, 0, 3, 1, 4)
    return proj[0], proj[1], proj[2], encoder_layer_mask(mask, mask_type, batch, seq_len)


def encoder_layer_output(
    attn: Tensor, src: Tensor, proj_weight: Tensor, proj_bias: Tensor, use_gelu: bool, norm_first: bool,
    eps: float, norm_weight_1: Tensor, norm_bias_1: Tensor, norm_weight_2: Tensor, norm_bias_2: Tensor,
    ffn_weight_1: Tensor, ffn_bias_1: Tensor, ffn_weight_2: Tensor, ffn_bias_2: Tensor,
) -> Tensor:
    """Out-projection, residuals, layer norms and feed-forward, in the fused op's order."""
    batch, num_heads, seq_len, head_dim = attn.shape
    embed_dim = num_heads * head_dim
    x = F.linear(attn.transpose(1, 2).reshape(batch, seq_len, embed_dim), proj_weight, proj_bias) + src
    if not norm_first:
        x = F.layer_norm(x, (embed_dim,), norm_weight_1, norm_bias_1, eps)
    residual = x
    if norm_first:
        x = F.layer_norm(x, (embed_dim,), norm_weight_2, norm_bias_2, eps)
    x = F.linear(x, ffn_weight_1, ffn_bias_1)
    # The fused op's activation is exact GELU or ReLU (it maps nn.GELU(approximate="tanh") to exact GELU too).
    x = F.gelu(x) if use_gelu else F.relu(x)
    x = F.linear(x, ffn_weight_2, ffn_bias_2) + residual
    if not norm_first:
        x = F.layer_norm(x, (embed_dim,), norm_weight_2, norm_bias_2, eps)
    return x


def transformer_encoder_layer_via_flash(
    src: Tensor, embed_dim: int, num_heads: int, qkv_weight: Tensor, qkv_bias: Tensor, proj_weight: Tensor,
    proj_bias: Tensor, use_gelu: bool, norm_first: bool, eps: float, norm_weight_1: Tensor,
    norm_bias_1: Tensor, norm_weight_2: Tensor, norm_bias_2: Tensor, ffn_weight_1: Tensor,
    ffn_bias_1: Tensor, ffn_weight_2: Tensor, ffn_bias_2: Tensor, mask: Optional[Tensor] = None,
    mask_type: Optional[int] = None, *, schedule: Optional[str] = None,
) -> Tensor:
    """``torch._transformer_encoder_layer_fwd`` (dense batch-first input) with the attention on our op.

    The semantics of the fused op, not of the module's slow path: masks are cast to bool
    (nonzero = masked out). A query row with every key masked gets a zero attention output
    where the fused op gives NaN.
    """
    if src.dim() != 3 or src.shape[-1] != embed_dim:
        raise ValueError(
            f"transformer_encoder_layer_via_flash: src must be (B, L, {embed_dim}), got {tuple(src.shape)}."
        )
    if src.numel() == 0:
        return src.clone()
    q, k, v, attn_mask = encoder_layer_attention_inputs(
        src, num_heads, qkv_weight, qkv_bias, norm_first, eps, norm_weight_1, norm_bias_1, mask, mask_type
    )
    attn = rewritten_attention(q, k, v, attn_mask=attn_mask, schedule=schedule)
    return encoder_layer_output(
        attn, src, proj_weight, proj_bias, use_gelu, norm_first, eps, norm_weight_1, norm_bias_1,
        norm_weight_2, norm_bias_2, ffn_weight_1, ffn_bias_1, ffn_weight_2, ffn_bias_2,
    )
