"""Goldens of the graph the pre-grad pass leaves, one per pattern family (issue 30, item 5).

Each family's pattern name (the report's ``pattern`` column) gets a tiny fp32 CPU module that
the pass rewrites; the test runs the pass on the module's pre-grad graph and compares the
rewritten graph, in a normalised form, with an inline golden. A change to what a pattern
matches or to the call it inserts shows as a diff here. Regenerate after an intended change with
``EXPECTTEST_ACCEPT=1 python -m pytest tests/passes/test_rewritten_graphs.py`` and review the diff.

The normalised form, one line per node, is ``gm.code`` without what varies between runs and
torch versions: placeholders are named after the input (or the module's parameter) they receive
and are not listed (dynamo's order and ``l_q_``-style names vary), other nodes are ``v0, v1, ...``
in graph order, torch functions print as ``torch.<name>`` whatever C module holds them, and
example values, stack traces and comments are left out. Correctness is tested elsewhere
(tests/test_pass_*.py); here only the shape of the rewrite.
"""

from __future__ import annotations

import math
import operator

import expecttest
import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import flash_inductor
from flash_inductor.passes.graph_pass import FlashAttentionPass

B, H, HKV, L, E = 1, 2, 1, 3, 4

# Fresh dynamo and no AOTAutograd cache per test (conftest.py says why).
pytestmark = pytest.mark.usefixtures("fresh_compiler")


def _randn(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _qkv(heads_kv=H):
    return _randn(B, H, L, E, seed=1), _randn(B, heads_kv, L, E, seed=2), _randn(B, heads_kv, L, E, seed=3)


# ------------------------------------------------------------------------------------------
# Normalising a graph
# ------------------------------------------------------------------------------------------


def _target_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"torch.ops.{target}"
    if isinstance(target, torch._ops.OpOverloadPacket):
        return f"torch.ops.{target._qualified_op_name.replace('::', '.')}"
    name = getattr(target, "__name__", None) or repr(target)
    # torch's C functions report varying modules across versions (torch, torch._C._nn,
    # torch._VariableFunctionsClass, ...): print them by where users reach them.
    for prefix, namespace in (("torch", torch), ("F", F), ("operator", operator)):
        if getattr(namespace, name, None) is target:
            return f"{prefix}.{name}"
    return f"{target.__module__}.{getattr(target, '__qualname__', name)}"


def _format(value, names) -> str:
    if isinstance(value, fx.Node):
        return names[value]
    if isinstance(value, tuple):
        inner = ", ".join(_format(v, names) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, list):
        return "[" + ", ".join(_format(v, names) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_format(v, names)}" for k, v in value.items()) + "}"
    if isinstance(value, float):
        return repr(round(value, 6))
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, slice):
        parts = ["" if x is None else _format(x, names) for x in (value.start, value.stop, value.step)]
        return ":".join(parts[:2] if value.step is None else parts)
    return repr(value)


def normalised(gm: fx.GraphModule, inputs: dict[fx.Node, str]) -> str:
    """The graph as code, one line per node, with stable names (see the module docstring);
    ``inputs`` names the placeholders, which are left out (dynamo's order varies)."""
    names: dict[fx.Node, str] = dict(inputs)
    counts = {"v": 0}
    lines = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            lines.append(f"return {_format(node.args[0], names)}")
            continue
        names[node] = f"v{counts['v']}"
        counts["v"] += 1
        if node.op == "get_attr":
            lines.append(f"{names[node]} = self.{node.target}")
            continue
        args = [_format(a, names) for a in node.args]
        if node.op == "call_method":  # x.method(...)
            target, args = f"{args[0]}.{node.target}", args[1:]
        elif node.target is operator.getitem:  # x[index]
            index = node.args[1]
            index = ", ".join(_format(i, names) for i in index) if isinstance(index, tuple) else args[1]
            lines.append(f"{names[node]} = {args[0]}[{index}]")
            continue
        elif node.op == "call_module":
            target = f"self.{node.target}"
        else:
            target = _target_name(node.target)
        args += [f"{k}={_format(v, names)}" for k, v in node.kwargs.items()]
        lines.append(f"{names[node]} = {target}({', '.join(args)})")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------
# Running the pass on a pre-grad graph
# ------------------------------------------------------------------------------------------


def _rewritten(fn, module: nn.Module | None = None, **inputs) -> str:
    """Dynamo's graph of ``fn(*inputs.values())`` (the pre-grad graph Inductor would get) after
    our pass, normalised. Placeholders are named after the input or the parameter of ``module``
    (``fn`` itself, when a module) that they receive."""
    module = fn if module is None and isinstance(fn, nn.Module) else module
    known = {id(t): name for name, t in inputs.items()}
    if module is not None:
        known.update((id(t), f"self.{name}") for name, t in module.state_dict(keep_vars=True).items())
    captured = []

    def backend(gm, example_inputs):
        FlashAttentionPass()(gm.graph)
        gm.recompile()
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        captured.append(normalised(gm, {n: known.get(id(t), f"in{i}")
                                        for i, (n, t) in enumerate(zip(placeholders, example_inputs))}))
        return gm.forward

    torch.compile(fn, backend=backend, fullgraph=True)(*inputs.values())
    (code,) = captured
    return code


def _traced(module, *inputs) -> str:
    """A symbolically traced graph (buffers are get_attr constants), with fake values, after
    our pass, normalised."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    tracer = torch.fx.Tracer()
    tracer.proxy_buffer_attributes = True
    gm = torch.fx.GraphModule(module, tracer.trace(module))
    FakeTensorProp(gm, FakeTensorMode(allow_non_fake_inputs=True)).propagate(*inputs)
    FlashAttentionPass()(gm.graph)
    gm.recompile()
    return normalised(gm, {n: n.name for n in gm.graph.nodes if n.op == "placeholder"})


def _patterns():
    return [(r.pattern, r.rewritten) for r in flash_inductor.last_report().records]


# ------------------------------------------------------------------------------------------
# One tiny module per family
# ------------------------------------------------------------------------------------------


def _repeat_kv(x, n_rep):
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


class Plain(nn.Module):  # timm: q pre-scaled, method softmax
    def forward(self, q, k, v):
        return (q * E**-0.5 @ k.transpose(-2, -1)).softmax(dim=-1) @ v


class Einsum(nn.Module):  # lucidrains
    def forward(self, q, k, v):
        sim = torch.einsum("b h i d, b h j d -> b h i j", q, k) * (E**-0.5)
        return torch.einsum("b h i j, b h j d -> b h i d", sim.softmax(dim=-1), v)


class CausalTril(nn.Module):  # minGPT: tril(ones) built in forward
    def forward(self, q, k, v):
        T = q.size(-2)
        mask = torch.tril(torch.ones(T, T, device=q.device)).view(1, 1, T, T)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        return F.softmax(att.masked_fill(mask == 0, float("-inf")), dim=-1) @ v


class CausalBuffer(nn.Module):  # nanoGPT's registered buffer, as a get_attr constant
    def __init__(self):
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones(L, L)).view(1, 1, L, L))

    def forward(self, q, k, v):
        T = q.size(-2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(E))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        return F.softmax(att, dim=-1) @ v


class AdditiveMask(nn.Module):  # BERT
    def forward(self, q, k, v, mask):
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(E) + mask
        return torch.matmul(F.softmax(scores, dim=-1), v)


class BoolMask(nn.Module):  # GPT-2: where(causal bool input, w, finfo.min)
    def forward(self, q, k, v, keep):
        w = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(E)
        w = torch.where(keep, w, torch.finfo(w.dtype).min)
        return torch.matmul(F.softmax(w, dim=-1), v)


class Gqa(nn.Module):  # HF Llama eager: repeat_kv, * scaling, + mask, fp32 softmax
    def forward(self, q, k, v, mask):
        k, v = _repeat_kv(k, H // HKV), _repeat_kv(v, H // HKV)
        w = torch.matmul(q, k.transpose(2, 3)) * E**-0.5 + mask[:, :, :, : k.shape[-2]]
        w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(w, v)


class Alibi(nn.Module):  # HF Bloom: alibi.baddbmm on (B*H, L, E)
    def forward(self, q, k, v, alibi, mask):
        scores = alibi.baddbmm(batch1=q, batch2=k.transpose(-1, -2), beta=1.0, alpha=1.0 / math.sqrt(E))
        w = scores.view(B, H, L, -1) + mask
        w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.bmm(w.view(B * H, L, -1), v)


def _mask():
    return torch.zeros(B, 1, 1, L).masked_fill(torch.tensor([False, True, False]), torch.finfo(torch.float32).min)


class SoftCap(nn.Module):  # HF Gemma 2 eager: / softcap, tanh, * softcap, then the mask
    def forward(self, q, k, v, mask):
        w = torch.tanh(torch.matmul(q, k.transpose(2, 3)) * E**-0.5 / 50.0) * 50.0 + mask
        return torch.matmul(F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype), v)


class Packed(nn.Module):  # HF Llama eager on a padding-free batch: causal AND same-document mask
    def forward(self, q, k, v, position_ids):
        ids = (torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1) != 1).cumsum(-1)
        b = torch.arange(B)[:, None, None, None]
        i, j = (torch.arange(L) + 0)[None, None, :, None], (torch.arange(L) + 0)[None, None, None, :]
        mask = torch.where((j <= i) & (ids[b, i] == ids[b, j]), torch.tensor(0.0), torch.finfo(torch.float32).min)
        w = torch.matmul(q, k.transpose(2, 3)) * E**-0.5 + mask
        return torch.matmul(F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype), v)


class Sinks(nn.Module):  # HF gpt-oss eager: the sink column concatenated, shifted, softmax, dropped
    def __init__(self):
        super().__init__()
        self.sinks = nn.Parameter(torch.zeros(H))

    def forward(self, q, k, v, mask):
        w = torch.matmul(q, k.transpose(2, 3)) * E**-0.5 + mask
        combined = torch.cat([w, self.sinks.reshape(1, -1, 1, 1).expand(B, -1, L, -1)], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        return torch.matmul(F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1], v)


class LocalBand(nn.Module):  # Longformer-style local attention: keys within 1 of the query
    def forward(self, q, k, v):
        i = torch.arange(q.size(-2), device=q.device)[:, None]
        j = torch.arange(k.size(-2), device=q.device)[None, :]
        att = (q @ k.transpose(-2, -1)) * E**-0.5
        return att.masked_fill((i - j).abs() > 1, float("-inf")).softmax(dim=-1) @ v


class SlidingWindowPadded(nn.Module):  # HF masking_utils under compile: band AND padding, then SDPA
    def forward(self, q, k, v, keep):
        i = torch.arange(q.size(-2), device=q.device)[None, None, :, None]
        j = torch.arange(k.size(-2), device=q.device)[None, None, None, :]
        mask = (j > i - 2) & (j <= i) & keep[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class PaddingMask(nn.Module):  # HF masking_utils under compile (BERT "sdpa"): q_idx >= 0 AND padding, then SDPA
    def forward(self, q, k, v, keep):
        i = torch.arange(q.size(-2), device=q.device)[None, None, :, None]
        mask = (i >= 0) & keep[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


# ------------------------------------------------------------------------------------------
# The goldens
# ------------------------------------------------------------------------------------------


class TestRewrittenGraphs(expecttest.TestCase):
    def test_sdpa(self):
        q, k, v = _qkv()
        code = _rewritten(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), q=q, k=k, v=v)
        self.assertEqual(_patterns(), [("sdpa", True)])
        self.assertExpectedInline(code, """\
v0 = flash_inductor.passes.site.rewritten_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True, scale=None, enable_gqa=False, schedule=None)
return (v0,)""")

    def test_sdpa_repeat_kv(self):
        def fn(q, k, v):
            k, v = _repeat_kv(k, H // HKV), _repeat_kv(v, H // HKV)
            return F.scaled_dot_product_attention(q, k, v)

        q, k, v = _qkv(HKV)
        code = _rewritten(fn, q=q, k=k, v=v)
        self.assertEqual(_patterns(), [("sdpa_repeat_kv", True)])
        self.assertExpectedInline(code, """\
v0 = flash_inductor.passes.site.rewritten_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=True, schedule=None)
return (v0,)""")

    def test_mha(self):
        torch.manual_seed(0)
        m = nn.MultiheadAttention(E, H, batch_first=True)
        code = _rewritten(lambda x: m(x, x, x, need_weights=False)[0], m, x=_randn(B, L, E, seed=1))
        self.assertEqual(_patterns(), [("mha", True)])
        self.assertExpectedInline(code, """\
v0 = x.transpose(1, 0)
v1 = flash_inductor.passes.mha_replacement.mha_attention_inputs(v0, v0, v0, 4, 2, self.in_proj_weight, self.in_proj_bias, key_padding_mask=None, attn_mask=None, use_separate_proj_weight=False, q_proj_weight=None, k_proj_weight=None, v_proj_weight=None)
v2 = v1[0]
v3 = v1[1]
v4 = v1[2]
v5 = flash_inductor.passes.site.rewritten_attention(v2, v3, v4, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, schedule=None)
v6 = flash_inductor.passes.mha_replacement.mha_output(v5, self.out_proj.weight, self.out_proj.bias, True)
v7 = v6.transpose(1, 0)
return (v7,)""")

    def test_mha_encoder(self):
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(E, H, 8, batch_first=True, norm_first=True).eval()
        with torch.no_grad():
            code = _rewritten(layer, src=_randn(B, L, E, seed=1))
        self.assertEqual(_patterns(), [("mha_encoder", True)])
        self.assertExpectedInline(code, """\
v0 = flash_inductor.passes.mha_replacement.encoder_layer_attention_inputs(src, 2, self.self_attn.in_proj_weight, self.self_attn.in_proj_bias, True, 1e-05, self.norm1.weight, self.norm1.bias, None, None)
v1 = v0[0]
v2 = v0[1]
v3 = v0[2]
v4 = flash_inductor.passes.site.rewritten_attention(v1, v2, v3, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, schedule=None)
v5 = flash_inductor.passes.mha_replacement.encoder_layer_output(v4, src, self.self_attn.out_proj.weight, self.self_attn.out_proj.bias, False, True, 1e-05, self.norm1.weight, self.norm1.bias, self.norm2.weight, self.norm2.bias, self.linear1.weight, self.linear1.bias, self.linear2.weight, self.linear2.bias)
return (v5,)""")

    def test_handwritten_plain(self):
        q, k, v = _qkv()
        code = _rewritten(Plain(), q=q, k=k, v=v)
        self.assertEqual(_patterns(), [("handwritten_plain", True)])
        self.assertExpectedInline(code, """\
v0 = flash_inductor.passes.site.rewritten_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=0.5, enable_gqa=False, schedule=None)
return (v0,)""")

    def test_handwritten_einsum(self):
        q, k, v = _qkv()
        code = _rewritten(Einsum(), q=q, k=k, v=v)
        self.assertEqual(_patterns(), [("handwritten_einsum", True)])
        self.assertExpectedInline(code, """\
v0 = flash_inductor.passes.site.rewritten_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=0.5, enable_gqa=False, schedule=None)
return (v0,)""")

    def test_handwritten_causal_tril(self):
        q, k, v = _qkv()
        code = _rewritten(CausalTril(), q=q, k=k, v=v)
        self.assertEqual(_patterns(), [("handwritten_causal_tril", True)])
        self.assertExpectedInline(code, """\
v0 = flash_inductor.passes.site.rewritten_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True, scale=0.5, enable_gqa=False, schedule=None)
return (v0,)""")

    def test_handwritten_causal_buffer(self):
        # Dynamo lifts buffers to inputs; a symbolic trace keeps this one a constant (get_attr).
        code = _traced(CausalBuffer(), *_qkv())
        self.assertEqual(_patterns(), [("handwritten_causal_buffer", True)])
        self.assertExpectedInline(code, """\
v0 = self.bias
v1 = flash_inductor.passes.site.rewritten_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True, scale=0.5, enable_gqa=False, schedule=None)
return v1""")

    def test_handwritten_additive_mask(self):
        q, k, v = _qkv()
        code = _rewritten(AdditiveMask(), q=q, k=k, v=v, mask=_mask())
        self.assertEqual(_patterns(), [("handwritten_additive_mask", True)])
        self.assertExpectedInline(code, """\
v0 = flash_inductor.passes.site.rewritten_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False, scale=0.5, enable_gqa=False, schedule=None)
return (v0,)""")

    def test_handwritten_bool_mask(self):
        q, k, v = _qkv()
        keep = torch.tril(torch.ones(L, L, dtype=torch.bool)).view(1, 1, L, L)
        code = _rewritten(BoolMask(), q=q, k=k, v=v, keep=keep)
        self.assertEqual(_patterns(), [("handwritten_bool_mask", True)])
        self.assertExpectedInline(code, """\
v0 = flash_inductor.passes.site.rewritten_attention(q, k, v, attn_mask=keep, dropout_p=0.0, is_causal=False, scale=0.5, enable_gqa=False, schedule=None)
v1 = v.mean(-2, keepdim=True)
v2 = keep.any(-1, keepdim=True)
v3 = torch.where(v2, v0, v1)
return (v3,)""")

    def test_handwritten_gqa(self):
        q, k, v = _qkv(HKV)
        code = _rewritten(Gqa(), q=q, k=k, v=v, mask=_mask())
        self.assertEqual(_patterns(), [("handwritten_gqa", True)])
        self.assertExpectedInline(code, """\
v0 = mask[:, :, :, :3]
v1 = flash_inductor.passes.site.rewritten_attention(q, k, v, attn_mask=v0, dropout_p=0.0, is_causal=False, scale=0.5, enable_gqa=True, schedule=None)
return (v1,)""")

    def test_handwritten_alibi(self):
        q, k, v = (_randn(B * H, L, E, seed=s) for s in (1, 2, 3))
        code = _rewritten(Alibi(), q=q, k=k, v=v, alibi=_randn(B * H, 1, L, seed=5), mask=_mask())
        self.assertEqual(_patterns(), [("handwritten_alibi", True)])
        self.assertExpectedInline(code, """\
v0 = q.unflatten(0, (1, 2))
v1 = k.unflatten(0, (1, 2))
v2 = v.unflatten(0, (1, 2))
v3 = alibi.unflatten(0, (1, 2))
v4 = torch.add(v3, mask)
v5 = flash_inductor.passes.site.rewritten_attention(v0, v1, v2, attn_mask=v4, dropout_p=0.0, is_causal=False, scale=0.5, enable_gqa=False, schedule=None)
v6 = v5.flatten(0, 1)
return (v6,)""")

    def test_handwritten_softcap(self):
        q, k, v = _qkv()
        code = _rewritten(SoftCap(), q=q, k=k, v=v, mask=_mask())
        self.assertEqual(_patterns(), [("handwritten_softcap", True)])
        self.assertExpectedInline(code, """\
v0 = flash_inductor.passes.site.rewritten_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False, scale=0.5, enable_gqa=False, schedule=None, softcap=50.0)
return (v0,)""")

    def test_handwritten_sinks(self):
        q, k, v = _qkv()
        code = _rewritten(Sinks(), q=q, k=k, v=v, mask=_mask())
        self.assertEqual(_patterns(), [("handwritten_sinks", True)])
        self.assertExpectedInline(code, """\
v0 = self.sinks.reshape(1, -1, 1, 1)
v1 = v0.reshape(-1)
v2 = flash_inductor.passes.site.rewritten_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False, scale=0.5, enable_gqa=False, schedule=None, sinks=v1)
return (v2,)""")

    def test_handwritten_packed(self):
        q, k, v = _qkv()
        code = _rewritten(Packed(), q=q, k=k, v=v, position_ids=torch.tensor([[0, 1, 0]]))
        self.assertEqual(_patterns(), [("handwritten_packed", True)])
        self.assertExpectedInline(code, """\
v0 = position_ids[:, :1]
v1 = operator.sub(v0, 1)
v2 = torch.diff(position_ids, prepend=v1, dim=-1)
v3 = operator.ne(v2, 1)
v4 = v3.cumsum(-1)
v5 = flash_inductor.passes.site.packed_sequence_attention(q, k, v, v4, dropout_p=0.0, is_causal=True, scale=0.5, schedule=None)
return (v5,)""")

    def test_handwritten_window(self):
        q, k, v = _qkv()
        code = _rewritten(LocalBand(), q=q, k=k, v=v)
        self.assertEqual(_patterns(), [("handwritten_window", True)])
        self.assertExpectedInline(code, """\
v0 = flash_inductor.passes.site.rewritten_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=0.5, enable_gqa=False, schedule=None, window=(1, 1))
return (v0,)""")

    def test_sdpa_window(self):
        # Not a pattern of its own: an SDPA site whose mask is a band AND padding keeps the padding.
        q, k, v = _qkv()
        keep = torch.ones(B, L, dtype=torch.bool)
        code = _rewritten(SlidingWindowPadded(), q=q, k=k, v=v, keep=keep)
        self.assertEqual(_patterns(), [("sdpa", True)])
        self.assertExpectedInline(code, """\
v0 = keep[:, None, None, :]
v1 = flash_inductor.passes.site.rewritten_attention(q, k, v, attn_mask=v0, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, schedule=None, window=(1, 0))
return (v1,)""")

    def test_sdpa_key_mask(self):
        # Not a pattern of its own: an SDPA site whose mask is the same for every query gives the
        # op its first row.
        q, k, v = _qkv()
        keep = torch.ones(B, L, dtype=torch.bool)
        code = _rewritten(PaddingMask(), q=q, k=k, v=v, keep=keep)
        self.assertEqual(_patterns(), [("sdpa", True)])
        self.assertExpectedInline(code, """\
v0 = torch.arange(3, device=cpu)
v1 = v0[None, None, :, None]
v2 = operator.ge(v1, 0)
v3 = keep[:, None, None, :]
v4 = operator.and_(v2, v3)
v5 = v4[Ellipsis, 0:1, :]
v6 = flash_inductor.passes.site.rewritten_attention(q, k, v, attn_mask=v5, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, schedule=None)
return (v6,)""")


def test_every_family_has_a_golden():
    """A new pattern name in flash_inductor/passes/ needs a golden above."""
    import pathlib
    import re

    passes = pathlib.Path(flash_inductor.__file__).parent / "passes"
    names = set()
    for path in passes.glob("*.py"):
        names.update(re.findall(r'"((?:sdpa|mha|handwritten)(?:_[a-z_]+)?)"', path.read_text()))
    names -= {"handwritten"}  # the name of kept hand-written sites, which are not rewritten
    tested = {name[len("test_"):] for name in dir(TestRewrittenGraphs) if name.startswith("test_")}
    assert names <= tested, sorted(names - tested)
