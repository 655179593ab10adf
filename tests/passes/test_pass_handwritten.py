"""The hand-written attention patterns of the pre-grad pass (flash_inductor/passes/handwritten.py).

Each model family's attention is written here the way that family writes it, compiled with
``flash_inductor.make_backend()`` and checked three ways:

* the report says the site was rewritten, under the expected pattern name;
* output (and gradients, training) match eager: fp64 within 1e-10 relative; fp32 within the
  project's rule, ``err(compiled, fp64) <= 2 * err(eager fp32, fp64) + floor``, where "fp64" is
  the same module run on float64 copies of the inputs;
* every must-not-rewrite rule has a case that is kept, with its reason; the graph the pass
  leaves is run as is and must compute exactly what eager does (one kept site also goes
  through Inductor, in the report printout).

CPU only; the compiled graphs call the op's reference path. Sizes are small and odd.
"""

from __future__ import annotations

import math

import expecttest
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import flash_inductor
from flash_inductor.passes.graph_pass import FlashAttentionPass
from flash_inductor.passes.site import rewritten_attention
from model_zoo import pass_only

B, H, HKV, L, S, E = 2, 4, 2, 7, 9, 8
FP32_FLOOR_ULPS = 16


# Fresh dynamo and no AOTAutograd cache per test (conftest.py says why).
pytestmark = pytest.mark.usefixtures("fresh_compiler")


def _randn(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _qkv(dtype, seq_q=L, seq_k=S, heads_kv=H, head_dim=E):
    return (_randn(B, H, seq_q, head_dim, dtype=dtype, seed=1),
            _randn(B, heads_kv, seq_k, head_dim, dtype=dtype, seed=2),
            _randn(B, heads_kv, seq_k, head_dim, dtype=dtype, seed=3))


def _padding_mask(dtype, seq_k=S):
    """HF-style additive (B, 1, 1, S) key-padding mask: 0 or finfo(dtype).min; key 0 always visible."""
    padded = torch.rand(B, 1, 1, seq_k, generator=torch.Generator().manual_seed(4)) < 0.3
    padded[..., 0] = False
    return torch.zeros(B, 1, 1, seq_k, dtype=dtype).masked_fill(padded, torch.finfo(dtype).min)


# ------------------------------------------------------------------------------------------
# Model families, written the way they write attention
# ------------------------------------------------------------------------------------------


class NanoGPT(nn.Module):
    """nanoGPT CausalSelfAttention (slow path): the registered `bias` buffer sliced to T."""

    def __init__(self, block_size=16, dropout=0.0):
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size))
                             .view(1, 1, block_size, block_size))
        self.attn_dropout = nn.Dropout(dropout)

    def forward(self, q, k, v):
        T = q.size(-2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        return att @ v


class MinGPT(nn.Module):
    """Tutorial / minGPT style: the causal mask built with tril(ones) in forward."""

    def forward(self, q, k, v):
        T = q.size(-2)
        mask = torch.tril(torch.ones(T, T, device=q.device)).view(1, 1, T, T)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        att = att.masked_fill(mask == 0, float("-inf"))
        return F.softmax(att, dim=-1) @ v


class Bert(nn.Module):
    """HF BertSelfAttention (eager): / sqrt(d), + extended attention mask, dropout."""

    def __init__(self, dropout=0.0):
        super().__init__()
        self.attention_head_size = E
        self.dropout = nn.Dropout(dropout)

    def forward(self, query_layer, key_layer, value_layer, attention_mask):
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        attention_scores = attention_scores + attention_mask
        attention_probs = nn.functional.softmax(attention_scores, dim=-1)
        attention_probs = self.dropout(attention_probs)
        return torch.matmul(attention_probs, value_layer)


class Timm(nn.Module):
    """timm / ViT Attention (non-fused path): q pre-scaled, method softmax, attn_drop."""

    def __init__(self, dropout=0.0):
        super().__init__()
        self.scale = E**-0.5
        self.attn_drop = nn.Dropout(dropout)

    def forward(self, q, k, v):
        q = q * self.scale
        attn = q @ k.transpose(-2, -1)
        attn = attn.softmax(dim=-1)
        attn = self.attn_drop(attn)
        return attn @ v


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class Llama(nn.Module):
    """HF Llama eager_attention_forward: repeat_kv (or Falcon/Gemma-style repeat_interleave),
    * scaling, + causal_mask slice, fp32 softmax cast back, F.dropout."""

    def __init__(self, repeat="repeat_kv", dropout=0.0):
        super().__init__()
        self.num_key_value_groups, self.scaling, self.attention_dropout = H // HKV, E**-0.5, dropout
        self.repeat = repeat

    def forward(self, query, key, value, attention_mask):
        if self.repeat == "repeat_kv":
            key_states = repeat_kv(key, self.num_key_value_groups)
            value_states = repeat_kv(value, self.num_key_value_groups)
        else:
            key_states = key.repeat_interleave(self.num_key_value_groups, dim=1)
            value_states = value.repeat_interleave(self.num_key_value_groups, dim=1)
        attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * self.scaling
        causal_mask = attention_mask[:, :, :, : key_states.shape[-2]]
        attn_weights = attn_weights + causal_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
        attn_weights = nn.functional.dropout(attn_weights, p=self.attention_dropout, training=self.training)
        return torch.matmul(attn_weights, value_states)


class Bloom(nn.Module):
    """HF Bloom: alibi.baddbmm on (B*H, L, E), view to (B, H, L, S) for the mask, bmm back."""

    def __init__(self, masked_fill=False):
        super().__init__()
        self.num_heads, self.beta, self.inv_norm_factor = H, 1.0, 1.0 / math.sqrt(E)
        self.masked_fill = masked_fill

    def forward(self, query_layer, key_layer, value_layer, alibi, attention_mask):
        batch_size, q_length = query_layer.shape[0] // self.num_heads, query_layer.shape[1]
        attention_scores = alibi.baddbmm(batch1=query_layer, batch2=key_layer.transpose(-1, -2),
                                         beta=self.beta, alpha=self.inv_norm_factor)
        attn_weights = attention_scores.view(batch_size, self.num_heads, q_length, -1)
        if self.masked_fill:  # transformers < 4.36: a bool mask filled with finfo.min
            attn_weights = torch.masked_fill(attn_weights, attention_mask, torch.finfo(attn_weights.dtype).min)
        else:
            attn_weights = attn_weights + attention_mask[:, :, :, : key_layer.shape[1]]
        attention_probs = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_layer.dtype)
        attention_probs_reshaped = attention_probs.view(batch_size * self.num_heads, q_length, -1)
        return torch.bmm(attention_probs_reshaped, value_layer)


class T5(nn.Module):
    """HF T5Attention: no scaling, scores += position_bias, softmax(scores.float()).type_as."""

    def __init__(self, dropout=0.0):
        super().__init__()
        self.dropout = dropout

    def forward(self, query_states, key_states, value_states, position_bias):
        scores = torch.matmul(query_states, key_states.transpose(3, 2))
        scores += position_bias
        attn_weights = nn.functional.softmax(scores.float(), dim=-1).type_as(scores)
        attn_weights = nn.functional.dropout(attn_weights, p=self.dropout, training=self.training)
        return torch.matmul(attn_weights, value_states)


class Perceiver(nn.Module):
    """lucidrains (Perceiver, ...): einsum with spaced letters, * scale, einsum back."""

    def forward(self, q, k, v):
        sim = torch.einsum("b h i d, b h j d -> b h i j", q, k) * (E**-0.5)
        attn = sim.softmax(dim=-1)
        return torch.einsum("b h i j, b h j d -> b h i d", attn, v)


class QKVAttention(nn.Module):
    """guided-diffusion QKVAttention: (B*H, C, T) layout, the scale split over q and k."""

    def forward(self, q, k, v):
        scale = 1 / math.sqrt(math.sqrt(q.shape[1]))
        weight = torch.einsum("bct,bcs->bts", q * scale, k * scale)
        weight = torch.softmax(weight.float(), dim=-1).type(weight.dtype)
        return torch.einsum("bts,bcs->bct", weight, v)


class GPT2(nn.Module):
    """HF GPT2Attention._attn: / torch.full([], d ** 0.5), where(causal, w, finfo.min)."""

    def __init__(self, dropout=0.0):
        super().__init__()
        self.attn_dropout = nn.Dropout(dropout)

    def forward(self, query, key, value, bias):
        attn_weights = torch.matmul(query, key.transpose(-1, -2))
        attn_weights = attn_weights / torch.full([], value.size(-1) ** 0.5, dtype=attn_weights.dtype,
                                                 device=attn_weights.device)
        query_length, key_length = query.size(-2), key.size(-2)
        causal_mask = bias[:, :, key_length - query_length : key_length, :key_length]
        mask_value = torch.finfo(attn_weights.dtype).min
        mask_value = torch.full([], mask_value, dtype=attn_weights.dtype, device=attn_weights.device)
        attn_weights = torch.where(causal_mask, attn_weights.to(attn_weights.dtype), mask_value)
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_weights = attn_weights.type(value.dtype)
        attn_weights = self.attn_dropout(attn_weights)
        return torch.matmul(attn_weights, value)


class Fairseq(nn.Module):
    """fairseq MultiheadAttention: q * scaling, 3-D bmm, key padding through a (B, H, L, S) view."""

    def __init__(self):
        super().__init__()
        self.num_heads, self.scaling = H, E**-0.5

    def forward(self, q, k, v, key_padding_mask):
        bsz, tgt_len, src_len = key_padding_mask.size(0), q.size(1), k.size(1)
        q = q * self.scaling
        attn_weights = torch.bmm(q, k.transpose(1, 2))
        attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len)
        attn_weights = attn_weights.masked_fill(
            key_padding_mask.unsqueeze(1).unsqueeze(2).to(torch.bool), float("-inf"))
        attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        attn_weights_float = F.softmax(attn_weights, dim=-1, dtype=torch.float32)
        attn_probs = F.dropout(attn_weights_float.type_as(attn_weights), p=0.0, training=self.training)
        return torch.bmm(attn_probs, v)


def _gpt2_bias(dtype, dead_row=None):
    """GPT-2's bool causal buffer (a graph input); ``dead_row`` hides every key of one query."""
    bias = torch.tril(torch.ones(L, L, dtype=torch.bool)).view(1, 1, L, L)
    if dead_row is not None:
        bias = bias.clone()
        bias[..., dead_row, :] = False
    return bias


def _bloom_inputs(dtype, bool_mask=False):
    q, k, v = (_randn(B * H, n, E, dtype=dtype, seed=s) for s, n in ((1, L), (2, S), (3, S)))
    alibi = _randn(B * H, 1, S, dtype=dtype, seed=5)
    if bool_mask:
        mask = torch.rand(B, 1, L, S, generator=torch.Generator().manual_seed(6)) < 0.3
        mask[..., 0] = False
        return q, k, v, alibi, mask
    return q, k, v, alibi, _padding_mask(dtype)


def _fairseq_inputs(dtype):
    q, k, v = (_randn(B * H, n, E, dtype=dtype, seed=s) for s, n in ((1, L), (2, S), (3, S)))
    kpm = torch.rand(B, S, generator=torch.Generator().manual_seed(7)) < 0.3
    kpm[:, 0] = False
    return q, k, v, kpm


def _gqa_inputs(dtype):
    return (*_qkv(dtype, heads_kv=HKV), _padding_mask(dtype))


def _qkv_diffusion(dtype):
    return tuple(_randn(B * H, E, n, dtype=dtype, seed=s) for s, n in ((1, L), (2, S), (3, S)))


# (module factory, inputs(dtype), pattern, dtypes that are rewritten)
BOTH, FP32 = (torch.float32, torch.float64), (torch.float32,)
CASES = {
    "nanogpt": (NanoGPT, lambda dt: _qkv(dt, L, L), "handwritten_bool_mask", BOTH),
    "mingpt_tril": (MinGPT, lambda dt: _qkv(dt, L, L), "handwritten_causal_tril", BOTH),
    "bert": (Bert, lambda dt: (*_qkv(dt), _padding_mask(dt)), "handwritten_additive_mask", BOTH),
    "timm": (Timm, _qkv, "handwritten_plain", BOTH),
    "llama_repeat_kv": (Llama, lambda dt: _gqa_inputs(dt), "handwritten_gqa", FP32),
    "gemma_repeat_interleave": (lambda: Llama("repeat_interleave"), lambda dt: _gqa_inputs(dt), "handwritten_gqa", FP32),
    "bloom_alibi": (Bloom, _bloom_inputs, "handwritten_alibi", FP32),
    "t5": (T5, lambda dt: (*_qkv(dt), _randn(1, H, L, S, dtype=dt, seed=8)), "handwritten_additive_mask", FP32),
    "perceiver_einsum": (Perceiver, _qkv, "handwritten_einsum", BOTH),
    "diffusion_einsum": (QKVAttention, _qkv_diffusion, "handwritten_einsum", FP32),
    "gpt2_where": (GPT2, lambda dt: (*_qkv(dt, L, L), _gpt2_bias(dt)), "handwritten_bool_mask", FP32),
    "fairseq_bmm": (Fairseq, _fairseq_inputs, "handwritten_bool_mask", FP32),
}


# ------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------


def _compile(module, dynamic=False):
    return torch.compile(module, backend=flash_inductor.make_backend(), dynamic=dynamic)


def _records():
    return flash_inductor.last_report().records


def _assert_rewritten(pattern, count=1):
    found = [(r.pattern, r.rewritten) for r in _records()]
    assert found == [(pattern, True)] * count, flash_inductor.last_report().format()


def _assert_kept(reason):
    records = _records()
    assert len(records) == 1 and not records[0].rewritten, flash_inductor.last_report().format()
    assert records[0].pattern == "handwritten" and reason in records[0].detail, records[0].detail


def _leaves(inputs, dtype=None, grad=False):
    out = []
    for t in inputs:
        t = t.detach().clone() if dtype is None or not t.is_floating_point() else t.detach().to(dtype)
        out.append(t.requires_grad_(grad and t.is_floating_point()))
    return out


def _assert_close(name, ours, eager, golden):
    """fp64: 1e-10 relative to eager. fp32: 2 x eager's own error against fp64, plus a floor."""
    ours, eager, golden = ours.detach(), eager.detach(), golden.detach().double()
    magnitude = max(golden.abs().max().item(), 1e-30)
    err = (ours.double() - golden).abs().max().item()
    if ours.dtype == torch.float64:
        assert err <= 1e-10 * magnitude, f"{name}: fp64 error {err:.3e} (|ref| {magnitude:.3e})"
        return
    base = (eager.double() - golden).abs().max().item()
    bound = 2 * base + FP32_FLOOR_ULPS * torch.finfo(ours.dtype).eps * magnitude
    assert err <= bound, f"{name}: error {err:.3e} > 2 x eager's {base:.3e} + floor (|ref| {magnitude:.3e})"


def _check_against_eager(module, inputs, *, grad, dynamic=False, compiled=None):
    """Run compiled, eager and the fp64 golden on the same inputs; compare outputs and grads."""
    dtype = inputs[0].dtype
    compiled = _compile(module, dynamic) if compiled is None else compiled
    runs = []
    for fn, cast in ((compiled, None), (module, None), (module, torch.float64)):
        leaves = _leaves(inputs, cast, grad)
        out = fn(*leaves)
        grads = []
        if grad:
            out.backward(_randn(*out.shape, dtype=out.dtype, seed=9))
            grads = [t.grad for t in leaves if t.requires_grad]
        runs.append((out, grads))
    (ours, ours_g), (eager, eager_g), (golden, golden_g) = runs
    assert ours.dtype == dtype
    _assert_close("out", ours, eager, golden)
    for i, (a, b, c) in enumerate(zip(ours_g, eager_g, golden_g)):
        _assert_close(f"grad of input {i}", a, b, c)
    return ours


def _pass_only(module, *inputs, **compile_kwargs):
    """(compiled module, its dynamo graph) with our pass applied and the graph run as is,
    without the rest of Inductor."""
    gm = pass_only(module, *inputs, **compile_kwargs)
    return gm.meta["compiled"], gm


def _rewritten_graph(module, *inputs, **compile_kwargs):
    return _pass_only(module, *inputs, **compile_kwargs)[1]


def _op_calls(gm):
    return [n for n in gm.graph.nodes if n.target is rewritten_attention]


# ------------------------------------------------------------------------------------------
# Rewritten: each family, fp32 (and fp64 where the family computes in the input dtype)
# ------------------------------------------------------------------------------------------


# Families that compute their softmax in fp32 are kept for fp64 inputs (see
# test_fp32_softmax_on_fp64_is_kept), so they run in fp32 only; GPT-2 in fp64 is
# test_gpt2_row_with_no_visible_key_matches_eager.
FAMILY_PARAMS = [pytest.param(case, dtype, id=f"{case}-{str(dtype)[6:]}")
                 for case, (*_, dtypes) in CASES.items() for dtype in dtypes]


@pytest.mark.parametrize("case, dtype", FAMILY_PARAMS)
def test_family_is_rewritten_and_matches_eager(case, dtype):
    factory, make_inputs, pattern, _ = CASES[case]
    module = factory()
    # Gradients as in training, of every float input (the T5 position bias and BERT's mask too).
    _check_against_eager(module, make_inputs(dtype), grad=True)
    _assert_rewritten(pattern)


def test_llama_passes_unrepeated_kv_with_enable_gqa():
    q, k, v = _qkv(torch.float32, heads_kv=HKV)
    gm = _rewritten_graph(Llama(), q, k, v, _padding_mask(torch.float32))
    (call,) = _op_calls(gm)
    assert call.kwargs["enable_gqa"] and call.kwargs["scale"] == E**-0.5
    assert (call.args[1].name, call.args[2].name) == ("l_key_", "l_value_")
    assert not [n for n in gm.graph.nodes if n.target in ("expand", "reshape", "transpose", "softmax")]


def test_t5_has_unit_scale_and_float_mask():
    gm = _rewritten_graph(T5().eval(), *_qkv(torch.float32), _randn(1, H, L, S, seed=8))
    (call,) = _op_calls(gm)
    assert call.kwargs["scale"] == 1.0 and call.kwargs["attn_mask"].name == "l_position_bias_"


def test_gpt2_row_with_no_visible_key_matches_eager():
    """where(causal, w, finfo.min) on a row the mask hides entirely: eager attends uniformly
    (the mean of v, which receives the gradient); the rewrite reproduces that exactly."""
    q, k, v = _qkv(torch.float64, L, L)
    _check_against_eager(GPT2(), (q, k, v, _gpt2_bias(torch.float64, dead_row=3)), grad=True)
    _assert_rewritten("handwritten_bool_mask")


def _traced(module, *inputs):
    """A symbolically traced graph, where buffers are get_attr constants, with fake values."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    tracer = torch.fx.Tracer()
    tracer.proxy_buffer_attributes = True
    gm = torch.fx.GraphModule(module, tracer.trace(module))
    FakeTensorProp(gm, FakeTensorMode(allow_non_fake_inputs=True)).propagate(*inputs)
    return gm


def test_causal_buffer_constant_becomes_is_causal():
    """A real constant buffer (get_attr, here from symbolic tracing) is checked for
    lower-triangularity and becomes is_causal=True: no mask tensor is read."""

    class TracedGPT(NanoGPT):  # fx tracing cannot take math.sqrt of a traced size
        def forward(self, q, k, v):
            T = q.size(-2)
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(E))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            return F.softmax(att, dim=-1) @ v

    module = TracedGPT()
    q, k, v = _qkv(torch.float64, L, L)
    gm = _traced(module, q, k, v)
    FlashAttentionPass()(gm.graph)
    gm.recompile()
    _assert_rewritten("handwritten_causal_buffer")
    (call,) = _op_calls(gm)
    assert call.kwargs["is_causal"] and call.kwargs["attn_mask"] is None
    assert not [n for n in gm.graph.nodes if n.op == "get_attr" and n.users]  # the buffer is not read
    torch.testing.assert_close(gm(q, k, v), module(q, k, v), rtol=1e-12, atol=1e-12)


def test_buffer_that_is_not_causal_stays_a_mask():
    class Banded(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("bias", torch.tril(torch.ones(L, L)).triu(-2).view(1, 1, L, L))

        def forward(self, q, k, v):
            att = (q @ k.transpose(-2, -1)).masked_fill(self.bias == 0, float("-inf"))
            return F.softmax(att, dim=-1) @ v

    q, k, v = _qkv(torch.float64, L, L)
    gm = _traced(Banded(), q, k, v)
    FlashAttentionPass()(gm.graph)
    gm.recompile()
    _assert_rewritten("handwritten_bool_mask")
    torch.testing.assert_close(gm(q, k, v), Banded()(q, k, v), rtol=1e-12, atol=1e-12)


def test_key_laid_out_otherwise_is_passed_as_matmul_sees_it():
    """A kᵀ that is not a transpose of k's last two dims (k stored (B, S, E, H), kᵀ =
    k.transpose(1, 3)) reaches the op as matmul sees it: no head layout is assumed."""

    class KeyLastHeads(nn.Module):
        def forward(self, q, k, v):
            return torch.softmax(q @ k.transpose(1, 3) * 0.3, dim=-1) @ v

    q, _, v = _qkv(torch.float64)
    k = _randn(B, S, E, H, dtype=torch.float64, seed=2)
    _check_against_eager(KeyLastHeads(), (q, k, v), grad=False)
    _assert_rewritten("handwritten_plain")


# ------------------------------------------------------------------------------------------
# Modes: no_grad, dynamic shapes, dropout
# ------------------------------------------------------------------------------------------


def test_no_grad():
    module = Timm()
    inputs = _qkv(torch.float32)
    with torch.no_grad():
        _check_against_eager(module, inputs, grad=False)
    _assert_rewritten("handwritten_plain")


@pytest.mark.parametrize("case", ["nanogpt", "bloom_alibi"])
def test_dynamic_shapes(case):
    factory, make_inputs, pattern, _ = CASES[case]
    module = factory().eval()
    compiled = _compile(module, dynamic=True)
    # Gradients under dynamic shapes once (nanoGPT); Bloom's reshaped layout forward only.
    _check_against_eager(module, make_inputs(torch.float32), grad=case == "nanogpt", compiled=compiled)
    _assert_rewritten(pattern)


def test_dynamic_head_dim_scale_is_default_scale():
    """Under dynamic=True, nanoGPT's 1 / math.sqrt(k.size(-1)) is 1 / sym_sqrt(E): scale=None."""
    gm = _rewritten_graph(NanoGPT().eval(), *_qkv(torch.float32, L, L), dynamic=True)
    (call,) = _op_calls(gm)
    assert call.kwargs["scale"] is None


def test_dropout_eval_is_zero_and_exact():
    module = Bert(dropout=0.3).eval()
    inputs = (*_qkv(torch.float64), _padding_mask(torch.float64))
    _check_against_eager(module, inputs, grad=False)
    _assert_rewritten("handwritten_additive_mask")
    (call,) = _op_calls(_rewritten_graph(module, *inputs))
    assert call.kwargs["dropout_p"] == 0.0


def test_dropout_training_uses_op_dropout():
    module = Timm(dropout=0.25).train()
    q, k, v = _leaves(_qkv(torch.float32), grad=True)
    out = _compile(module)(q, k, v)
    _assert_rewritten("handwritten_plain")
    out.sum().backward()
    assert out.shape == (B, H, L, E) and out.isfinite().all() and q.grad.isfinite().all()
    (call,) = _op_calls(_rewritten_graph(module, q, k, v))
    assert call.kwargs["dropout_p"] == 0.25


# ------------------------------------------------------------------------------------------
# Kept: every must-not-rewrite rule
# ------------------------------------------------------------------------------------------


def _scores(q, k):
    return (q @ k.transpose(-2, -1)) * (E**-0.5)


class OutputAttentions(nn.Module):  # HF output_attentions=True: the weights are returned
    def forward(self, q, k, v):
        probs = _scores(q, k).softmax(dim=-1)
        return probs @ v, probs


class ScoresReused(nn.Module):  # the raw scores are also an output
    def forward(self, q, k, v):
        scores = _scores(q, k)
        return scores.softmax(dim=-1) @ v, scores


class InPlaceMaskedFill(nn.Module):  # scores.masked_fill_(...) as a statement
    def forward(self, q, k, v, mask):
        scores = _scores(q, k)
        scores.masked_fill_(mask, float("-inf"))
        return torch.softmax(scores, dim=-1) @ v


class IntegerMask(nn.Module):
    def forward(self, q, k, v, mask):
        return torch.softmax(_scores(q, k) + mask.long(), dim=-1) @ v


class WiderMask(nn.Module):  # an fp64 mask on fp32 scores: type promotion makes the softmax fp64
    def forward(self, q, k, v, mask):
        return torch.softmax(_scores(q, k) + mask, dim=-1).to(q.dtype) @ v


class ZeroFill(nn.Module):  # masked_fill with 0.0 zeroes scores, it does not hide keys
    def forward(self, q, k, v, mask):
        return torch.softmax(_scores(q, k).masked_fill(mask, 0.0), dim=-1) @ v


class SoftmaxOverQueries(nn.Module):
    def forward(self, q, k, v):
        return torch.softmax(_scores(q, k), dim=-2) @ v


class LearnedScale(nn.Module):  # Swin-V2 style learned temperature: not a constant
    def __init__(self):
        super().__init__()
        self.logit_scale = nn.Parameter(torch.tensor(0.3))

    def forward(self, q, k, v):
        return ((q @ k.transpose(-2, -1)) * self.logit_scale.exp()).softmax(dim=-1) @ v


class NegativeScaleAfterMask(nn.Module):  # -inf * -0.5 = +inf (a positive scale: test_pass_normalise.py)
    def forward(self, q, k, v, mask):
        return (((q @ k.transpose(-2, -1)) + mask) * -0.5).softmax(dim=-1) @ v


class HeadMask(nn.Module):  # BERT with head_mask: the probabilities are multiplied first
    def forward(self, q, k, v, head_mask):
        return (_scores(q, k).softmax(dim=-1) * head_mask) @ v


class MutatedKey(nn.Module):  # k changes between the two products
    def forward(self, q, k, v):
        k = k * 1.0
        probs = _scores(q, k).softmax(dim=-1)
        k.mul_(2.0)
        return probs @ v, k


def _bool_mask(seq_q=L, seq_k=S):
    mask = torch.rand(B, 1, seq_q, seq_k, generator=torch.Generator().manual_seed(11)) < 0.3
    mask[..., 0] = False
    return mask


KEPT = {
    "probs_returned": (OutputAttentions, lambda dt: _qkv(dt), "are also used by output"),
    "scores_returned": (ScoresReused, lambda dt: _qkv(dt), "attention scores"),
    "inplace_masked_fill": (InPlaceMaskedFill, lambda dt: (*_qkv(dt), _bool_mask()),
                            "modified in place by .masked_fill_()"),
    "integer_mask": (IntegerMask, lambda dt: (*_qkv(dt), _bool_mask()), "not a float dtype"),
    "mask_dtype_promotes_scores": (WiderMask, lambda dt: (*_qkv(dt), _padding_mask(torch.float64)),
                                   "computes in torch.float64 for torch.float32 inputs"),
    "zero_fill": (ZeroFill, lambda dt: (*_qkv(dt), _bool_mask()), "does not hide keys"),
    "softmax_dim": (SoftmaxOverQueries, lambda dt: _qkv(dt), "not the last (key) dim"),
    "learned_scale": (LearnedScale, lambda dt: _qkv(dt), "not a compile-time constant"),
    "negative_scale_after_mask": (NegativeScaleAfterMask, lambda dt: (*_qkv(dt), _padding_mask(dt)),
                                  "scaled by -0.5"),
    "head_mask": (HeadMask, lambda dt: (*_qkv(dt), _randn(1, H, 1, 1, dtype=dt, seed=12)),
                  "probabilities go through"),
    "mutated_key": (MutatedKey, lambda dt: _qkv(dt), "modified in place by .mul_()"),
    "finfo_min_fill_plus_alibi": (lambda: Bloom(masked_fill=True), lambda dt: _bloom_inputs(dt, bool_mask=True),
                                  "combined with other masks"),
    "finfo_min_fill_with_dropout": (lambda: GPT2(dropout=0.1).train(),
                                    lambda dt: (*_qkv(dt, L, L), _gpt2_bias(dt)), "with dropout"),
}


@pytest.mark.parametrize("case", list(KEPT))
def test_kept_and_still_matches_eager(case):
    """The decision is the pass's alone, so the graph it leaves is run as is (no Inductor
    codegen): a kept site computes exactly what eager does, dropout's RNG draws included."""
    factory, make_inputs, reason = KEPT[case]
    module, inputs = factory(), make_inputs(torch.float32)
    compiled, gm = _pass_only(module, *inputs)
    _assert_kept(reason)
    assert not _op_calls(gm)
    torch.manual_seed(0)
    ours = compiled(*inputs)
    torch.manual_seed(0)
    eager = module(*inputs)
    for a, b in zip(*(x if isinstance(x, tuple) else (x,) for x in (ours, eager))):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


class StaticCacheStep(nn.Module):
    """One decode step of HF Llama (eager attention) on a ``StaticCache``: ``update`` writes the new
    keys and values into the cache in place (``index_copy_``), then the attention reads the cache.
    ``repeat_first``: the grouped keys are repeated (a copy) before the write, so the scores see the
    old cache while the op, reading where the P·V product was, would see the new one."""

    def __init__(self, repeat_first=False):
        super().__init__()
        self.repeat_first = repeat_first

    def forward(self, query, new_key, new_value, cache_k, cache_v, position, mask):
        if self.repeat_first:
            key_states = repeat_kv(cache_k, H // HKV)
        cache_k.index_copy_(2, position, new_key)
        cache_v.index_copy_(2, position, new_value)
        if not self.repeat_first:
            key_states = repeat_kv(cache_k, H // HKV)
        scores = torch.matmul(query, key_states.transpose(2, 3)) * E**-0.5 + mask
        return scores.softmax(dim=-1) @ repeat_kv(cache_v, H // HKV)


def _static_cache_inputs(dtype, filled=4):
    """A decode step's query and new K/V, a cache of S slots holding ``filled`` tokens, the slot
    to write and HF's additive mask hiding the empty slots."""
    query, new_key, new_value = _qkv(dtype, seq_q=1, seq_k=1, heads_kv=HKV)
    cache_k, cache_v = (_randn(B, HKV, S, E, dtype=dtype, seed=s) for s in (5, 6))
    mask = torch.zeros(B, 1, 1, S, dtype=dtype)
    mask[..., filled + 1:] = torch.finfo(dtype).min
    return query, new_key, new_value, cache_k, cache_v, torch.tensor([filled]), mask


def test_static_cache_written_before_the_attention_is_rewritten():
    """The write precedes the whole pattern, so the site is rewritten; the output and the cache
    it leaves match eager."""
    inputs = _static_cache_inputs(torch.float32)
    _check_against_eager(StaticCacheStep(), inputs, grad=False)
    _assert_rewritten("handwritten_gqa")
    compiled_inputs, eager_inputs = _leaves(inputs), _leaves(inputs)
    _compile(StaticCacheStep())(*compiled_inputs)
    StaticCacheStep()(*eager_inputs)
    for ours, eager in zip(compiled_inputs[3:5], eager_inputs[3:5]):
        torch.testing.assert_close(ours, eager, rtol=0, atol=0)


def test_static_cache_written_inside_the_pattern_is_kept():
    module, inputs = StaticCacheStep(repeat_first=True), _static_cache_inputs(torch.float32)
    compiled, gm = _pass_only(module, *_leaves(inputs))
    _assert_kept("modified in place by .index_copy_()")
    assert not _op_calls(gm)
    torch.testing.assert_close(compiled(*_leaves(inputs)), module(*_leaves(inputs)), rtol=0, atol=0)


@pytest.mark.parametrize("case", ["llama_repeat_kv", "t5"])
def test_fp32_softmax_on_fp64_is_kept(case):
    """HF Llama / T5 compute the softmax in fp32; for fp64 inputs the op would compute it in
    fp64, a precision change the model did not ask for."""
    factory, make_inputs, _, _ = CASES[case]
    module, inputs = factory(), make_inputs(torch.float64)
    compiled, _ = _pass_only(module, *inputs)
    _assert_kept("computes in torch.float32 for torch.float64 inputs")
    torch.testing.assert_close(compiled(*inputs), module(*inputs), rtol=0, atol=0)


def test_softmax_outside_attention_is_not_reported():
    class Classifier(nn.Module):
        def forward(self, x, w):
            return torch.softmax(x @ w, dim=-1).argmax(-1)

    _pass_only(Classifier(), _randn(3, E), _randn(E, 5))
    assert _records() == []


# ------------------------------------------------------------------------------------------
# Printouts
# ------------------------------------------------------------------------------------------


class TestPrintouts(expecttest.TestCase):
    def test_report(self):
        class TwoLayers(nn.Module):
            def forward(self, q, k, v):
                x = Timm()(q, k, v)
                return OutputAttentions()(x, k, v)

        inputs = _qkv(torch.float32, S, S)
        out, probs = _compile(TwoLayers())(*inputs)  # the kept site goes through Inductor as written
        for a, b in zip((out, probs), TwoLayers()(*inputs)):
            torch.testing.assert_close(a, b)
        self.assertExpectedInline(flash_inductor.last_report().format(), """\
flash_inductor: rewrote 1 of 2 attention sites
  module  node   pattern            status     reason
  -       x      handwritten_plain  rewritten  no mask, scale 0.3536
  -       probs  handwritten        kept       the attention probabilities (probs) are also used by output (e.g. returned as attention weights)""")

    def test_rewritten_llama_graph(self):
        gm = _rewritten_graph(Llama(), *_qkv(torch.float32, heads_kv=HKV), _padding_mask(torch.float32))
        self.assertExpectedInline(gm.code.strip(), """\
def forward(self, L_key_ : torch.Tensor, L_value_ : torch.Tensor, L_query_ : torch.Tensor, L_attention_mask_ : torch.Tensor):
    l_key_ = L_key_
    l_value_ = L_value_
    l_query_ = L_query_
    l_attention_mask_ = L_attention_mask_
    causal_mask = l_attention_mask_[(slice(None, None, None), slice(None, None, None), slice(None, None, None), slice(None, 9, None))];  l_attention_mask_ = None
    rewritten_attention = flash_inductor_passes_site_rewritten_attention(l_query_, l_key_, l_value_, attn_mask = causal_mask, dropout_p = 0.0, is_causal = False, scale = 0.3535533905932738, enable_gqa = True, schedule = None);  l_query_ = l_key_ = l_value_ = causal_mask = None
    return (rewritten_attention,)""")


@pytest.mark.parametrize("spelling", ["operator", "dunder_method"])
def test_causal_tril_recognised_in_either_comparison_spelling(spelling):
    """Dynamo 2.11 records ``mask == 0`` as ``mask.__eq__(0)``, later versions as ``operator.eq``:
    both must read as the same causal mask (the GPU machine's torch 2.11 found this)."""
    import operator

    import torch.fx as fx

    from flash_inductor.passes.fx_match import LOWER, UPPER, triangle

    graph = fx.Graph()
    tril = graph.call_function(torch.tril, (graph.call_function(torch.ones, (5, 5)),))
    if spelling == "operator":
        hidden, visible = graph.call_function(operator.eq, (tril, 0)), graph.call_function(operator.ne, (tril, 0))
    else:
        hidden, visible = graph.call_method("__eq__", (tril, 0)), graph.call_method("__ne__", (tril, 0))
    assert triangle(hidden) == (UPPER, False)
    assert triangle(visible) == (LOWER, False)
