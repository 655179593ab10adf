"""Pattern family: ``nn.MultiheadAttention`` and the ``nn.Transformer*Layer`` modules built on it.

What dynamo records (seen on torch 2.13; the folding below dates from 2.5, so 2.11 is the same):

* ``nn.MultiheadAttention`` -- and so ``nn.TransformerEncoderLayer`` (training, or eval with
  grad) and ``nn.TransformerDecoderLayer`` (always) -- is ONE node,
  ``F.multi_head_attention_forward(query, key, value, ...)``, sequence-first, followed by
  ``getitem(node, 0)`` and, when the weights are returned, ``getitem(node, 1)``. The module's
  own fused fast path, ``torch._native_multi_head_attention``, never appears: dynamo folds
  ``_is_make_fx_tracing()`` to True, which sends the module down the functional path.
* ``nn.TransformerEncoderLayer`` in eval mode without grad (batch_first, even head count,
  relu/gelu) takes ``torch._transformer_encoder_layer_fwd``: the whole layer as one node.

Both are rewritten into projections in plain PyTorch (see ``mha_replacement.py``) around one
``rewritten_attention`` call. Kept, with the reason in the report: used attention weights
(the op never forms the L x S matrix), ``bias_k``/``bias_v``, ``add_zero_attn``,
``static_k``/``static_v``, and arguments that are traced values instead of constants -- notably
``dropout_p`` in training under ``dynamic=True``, where dynamo makes the module's float
attribute a graph input (out of training it is ignored, so those sites are rewritten).
"""

from __future__ import annotations

import inspect
import operator
from typing import Iterator, Optional, Union

import torch
import torch.fx as fx
import torch.nn.functional as F

from . import mha_replacement as R
from .site import AttentionSite, KeptSite, example_value, guarded

_MHA_SIGNATURE = inspect.signature(F.multi_head_attention_forward)
_MHA_CONSTANTS = ("embed_dim_to_check", "num_heads", "add_zero_attn", "dropout_p", "training", "need_weights",
                  "use_separate_proj_weight", "average_attn_weights", "is_causal")
_MHA_TENSORS = ("query", "key", "value", "in_proj_weight", "in_proj_bias", "out_proj_weight", "out_proj_bias",
                "key_padding_mask", "attn_mask", "q_proj_weight", "k_proj_weight", "v_proj_weight")
# Extensions of MHA that change the key/value set after the projection; the op has no counterpart.
_MHA_UNSUPPORTED = {
    "bias_k": "bias_k/bias_v (add_bias_kv=True) append a learned key/value row",
    "bias_v": "bias_k/bias_v (add_bias_kv=True) append a learned key/value row",
    "static_k": "static_k replaces the projected keys",
    "static_v": "static_v replaces the projected values",
}

_ENCODER_LAYER_OP = torch.ops.aten._transformer_encoder_layer_fwd.default
_ENCODER_LAYER_PARAMS = tuple(a.name for a in _ENCODER_LAYER_OP._schema.arguments)
_ENCODER_LAYER_CONSTANTS = ("embed_dim", "num_heads", "use_gelu", "norm_first", "eps", "mask_type")


# --------------------------------------------------------------------------------------
# Checks on a match
# --------------------------------------------------------------------------------------


def _bind_mha(node: fx.Node) -> Optional[dict]:
    try:
        bound = _MHA_SIGNATURE.bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return dict(bound.arguments)


def _bind_encoder_layer(node: fx.Node) -> Optional[dict]:
    if len(node.args) > len(_ENCODER_LAYER_PARAMS) or set(node.kwargs) - set(_ENCODER_LAYER_PARAMS):
        return None
    bound = {a.name: a.default_value for a in _ENCODER_LAYER_OP._schema.arguments if a.has_default_value()}
    bound.update(zip(_ENCODER_LAYER_PARAMS, node.args))
    bound.update(node.kwargs)
    return bound if set(bound) == set(_ENCODER_LAYER_PARAMS) else None


def _traced_constant(args: dict, names) -> Optional[str]:
    for name in names:
        if isinstance(args[name], fx.Node):
            return f"{name} is a traced value, not a constant"
    return None


def _not_a_graph_tensor(args: dict, names) -> Optional[str]:
    for name in names:
        value = args[name]
        if value is not None and not isinstance(value, fx.Node):
            return f"{name} of type {type(value).__name__} is not a graph tensor"
    return None


def _unsupported_mha_feature(args: dict) -> Optional[str]:
    for name, why in _MHA_UNSUPPORTED.items():
        if args[name] is not None:
            return f"{why}; not supported"
    if args["add_zero_attn"]:
        return "add_zero_attn=True appends a zero key/value; not supported"
    if args["is_causal"] and args["attn_mask"] is None:
        return "is_causal=True without attn_mask: F.multi_head_attention_forward raises, kept so it does"
    return None


def _mha_outputs(node: fx.Node) -> tuple[Optional[fx.Node], list[fx.Node], Optional[str]]:
    """The getitem(node, 0) to replace, the unused getitem(node, 1)s to erase, or why neither."""
    outputs, weights = [], []
    for user in node.users:
        if user.op == "call_function" and user.target is operator.getitem and user.args[1] in (0, 1):
            (outputs if user.args[1] == 0 else weights).append(user)
        else:
            return None, [], f"its (output, weights) tuple is used whole by {user.name}"
    if any(w.users for w in weights):
        return None, [], ("attention weights are used (need_weights=True and getitem 1 has users); the op "
                          "never forms the L x S weights")
    if len(outputs) > 1:
        return None, [], f"its output is read by {len(outputs)} getitem nodes"
    return (outputs[0] if outputs else None), weights, None


# --------------------------------------------------------------------------------------
# Patterns
# --------------------------------------------------------------------------------------


def _pattern_mha_1(node: fx.Node) -> Union[AttentionSite, KeptSite, None]:
    """F.multi_head_attention_forward: nn.MultiheadAttention (torch.nn.activation), nn.Transformer*Layer."""
    args = _bind_mha(node)
    if args is None:
        return KeptSite("mha", node, "arguments do not bind to F.multi_head_attention_forward's signature")
    # Out of training the dropout probability is ignored, so it may be traced (dynamic=True turns
    # the module's float attribute into a graph input).
    constants = [n for n in _MHA_CONSTANTS if not (n == "dropout_p" and args["training"] is False)]
    reason = (_traced_constant(args, constants) or _not_a_graph_tensor(args, _MHA_TENSORS)
              or _unsupported_mha_feature(args))
    if reason is None:
        output, unused_weights, reason = _mha_outputs(node)
        if reason is None and output is None:
            return None  # the attention output is unused: nothing to rewrite
    query = example_value(args["query"])
    if reason is None and (query is None or query.dim() not in (2, 3)):
        reason = "query has no 2-D or 3-D example value"
    if reason is not None:
        return KeptSite("mha", node, reason)

    dropout_p, is_causal, keep_attn_mask = R.mha_effective_arguments(
        training=args["training"], dropout_p=args["dropout_p"], is_causal=args["is_causal"],
        need_weights=args["need_weights"], has_key_padding_mask=args["key_padding_mask"] is not None,
        has_attn_mask=args["attn_mask"] is not None,
    )
    has_mask = keep_attn_mask or args["key_padding_mask"] is not None

    def prologue(graph, q, k, v, mask):
        # Re-read the node's arguments: a site rewritten before this one may have replaced one of them.
        args.update(_bind_mha(node))
        q, k, v = args["query"], args["key"], args["value"]
        inputs = graph.call_function(
            R.mha_attention_inputs,
            (q, k, v, args["embed_dim_to_check"], args["num_heads"], args["in_proj_weight"], args["in_proj_bias"]),
            dict(key_padding_mask=args["key_padding_mask"], attn_mask=args["attn_mask"] if keep_attn_mask else None,
                 use_separate_proj_weight=bool(args["use_separate_proj_weight"]),
                 q_proj_weight=args["q_proj_weight"], k_proj_weight=args["k_proj_weight"],
                 v_proj_weight=args["v_proj_weight"]),
        )
        return _unpack(graph, inputs, has_mask)

    def epilogue(graph, attention):
        return graph.call_function(
            R.mha_output, (attention, args["out_proj_weight"], args["out_proj_bias"], query.dim() == 3)
        )

    return AttentionSite(
        pattern="mha", output=output, query=args["query"], key=args["key"], value=args["value"],
        dropout_p=dropout_p, is_causal=is_causal, consumed=[node, *unused_weights],
        prologue=prologue, epilogue=epilogue,
    )


def _pattern_mha_2(node: fx.Node) -> Union[AttentionSite, KeptSite]:
    """torch._transformer_encoder_layer_fwd: nn.TransformerEncoderLayer's fast path (eval, no grad)."""
    args = _bind_encoder_layer(node)
    if args is None:
        return KeptSite("mha_encoder", node, "arguments do not bind to _transformer_encoder_layer_fwd's schema")
    reason = _traced_constant(args, _ENCODER_LAYER_CONSTANTS) or _not_a_graph_tensor(
        args, [n for n in _ENCODER_LAYER_PARAMS if n not in _ENCODER_LAYER_CONSTANTS])
    src = example_value(args["src"])
    if reason is None:
        if src is None or src.is_nested or src.dim() != 3:
            reason = "src is not a dense 3-D (B, L, E) tensor"
        elif args["mask_type"] not in (None, 0, 1, 2):
            reason = f"mask_type {args['mask_type']} is none of 0, 1, 2"
        elif (args["mask"] is None and args["mask_type"] is not None) or src.shape[-1] != args["embed_dim"]:
            reason = "arguments the fused op would reject (mask_type without mask, or src's last dim != embed_dim)"
        elif src.numel() == 0:
            reason = "src is empty; the fused op returns a copy"
    if reason is not None:
        return KeptSite("mha_encoder", node, reason)

    def prologue(graph, q, k, v, mask):
        # Re-read the node's arguments: a site rewritten before this one may have replaced one of them.
        args.update(_bind_encoder_layer(node))
        inputs = graph.call_function(
            R.encoder_layer_attention_inputs,
            tuple(args[n] for n in ("src", "num_heads", "qkv_weight", "qkv_bias", "norm_first", "eps",
                                    "norm_weight_1", "norm_bias_1", "mask", "mask_type")),
        )
        return _unpack(graph, inputs, args["mask"] is not None)

    def epilogue(graph, attention):
        return graph.call_function(
            R.encoder_layer_output,
            (attention, *(args[n] for n in ("src", "proj_weight", "proj_bias", "use_gelu", "norm_first", "eps",
                                            "norm_weight_1", "norm_bias_1", "norm_weight_2", "norm_bias_2",
                                            "ffn_weight_1", "ffn_bias_1", "ffn_weight_2", "ffn_bias_2"))),
        )

    return AttentionSite(
        pattern="mha_encoder", output=node, query=args["src"], key=args["src"], value=args["src"],
        prologue=prologue, epilogue=epilogue,
    )


def _unpack(graph: fx.Graph, inputs: fx.Node, has_mask: bool):
    q, k, v = (graph.call_function(operator.getitem, (inputs, i)) for i in range(3))
    return q, k, v, graph.call_function(operator.getitem, (inputs, 3)) if has_mask else None


_PATTERNS = {
    F.multi_head_attention_forward: _pattern_mha_1,
    torch._transformer_encoder_layer_fwd: _pattern_mha_2,
    _ENCODER_LAYER_OP: _pattern_mha_2,
}


def find_sites(graph: fx.Graph) -> Iterator[Union[AttentionSite, KeptSite]]:
    for node in graph.nodes:
        if node.op == "call_function":
            pattern = _PATTERNS.get(node.target)
            name = "mha" if pattern is _pattern_mha_1 else "mha_encoder"
            found = guarded(name, node, lambda: pattern(node)) if pattern is not None else None
            if found is not None:
                yield found
