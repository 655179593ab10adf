"""The nn.MultiheadAttention family of the pass (flash_inductor/passes/mha.py, mha_replacement.py).

Three levels, cheapest first:

* the replacement functions called eagerly against the PyTorch functions they replace, over
  every mask / projection / need_weights combination (fp64, exact up to rounding);
* the pass alone on dynamo's graph, run eagerly (``_pass_only``: no Inductor), for the module
  variants (batch_first, self / cross / separate kdim-vdim projections, masks, need_weights,
  Transformer encoder and decoder layers in train and eval), their gradients, and what must
  NOT be rewritten;
* end to end through ``torch.compile(backend=flash_inductor.make_backend())``, kept to a few
  graphs because each Inductor compile costs seconds on the CPU: a torchvision-like ViT block
  (fp32), the decoder layer (fp64), the encoder layer in training with dropout and in eval
  without grad (its fused fast path), and dynamic shapes.

Compiled fp64 results must match eager tightly; compiled fp32 within twice eager fp32's own
error against fp64 plus the rounding floor (tests/helpers.py). Masks here never mask a whole
row: there the op returns 0 where MHA returns NaN (tested on its own below).
"""

from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import flash_inductor
from flash_inductor.passes import mha
from flash_inductor.passes.graph_pass import FlashAttentionPass
from flash_inductor.passes.mha_replacement import multi_head_attention_via_flash, transformer_encoder_layer_via_flash
from flash_inductor.passes.report import REPORTS
from flash_inductor.passes.site import rewritten_attention
from helpers import DEVICE, assert_close_to_ref, randn

E, H, L, S, B = 12, 3, 7, 9, 2  # head dim 4; L != S so that transposed shapes cannot pass by accident
DEVICES = [pytest.param(d, id=d) for d in dict.fromkeys(["cpu", DEVICE])]
pytestmark = [
    pytest.mark.filterwarnings(
        "ignore:Support for mismatched key_padding_mask and attn_mask is deprecated",
        "ignore:enable_nested_tensor is True",
        "ignore:Converting mask without torch.bool dtype to bool",
    ),
    # Fresh dynamo and no AOTAutograd cache per test (conftest.py says why).
    pytest.mark.usefixtures("fresh_compiler"),
]


# ------------------------------------------------------------------------------------------
# Inputs and checks
# ------------------------------------------------------------------------------------------


def _masks(dtype, seq_q=L, seed=3):
    """Key padding and attention masks in MHA's convention (bool True = NOT allowed), every row
    keeping at least one key (column 0 is never masked)."""
    g = torch.Generator().manual_seed(seed)
    kpm_bool = torch.zeros(B, S, dtype=torch.bool)
    kpm_bool[0, 6:] = True
    kpm_bool[1, 2:4] = True

    def bool_mask(shape):
        m = torch.rand(shape, generator=g) < 0.3
        m[..., 0] = False
        return m

    return dict(
        kpm=dict(none=None, bool=kpm_bool, float=torch.randn(B, S, generator=g, dtype=torch.float64).to(dtype)),
        attn=dict(none=None, bool2d=bool_mask((seq_q, S)),
                  float2d=torch.randn(seq_q, S, generator=g, dtype=torch.float64).to(dtype),
                  bool3d=bool_mask((B * H, seq_q, S)),
                  float3d=torch.randn(B * H, seq_q, S, generator=g, dtype=torch.float64).to(dtype)),
    )


def _mha_call_args(m: nn.MultiheadAttention, q, k, v):
    return (q, k, v, m.embed_dim, m.num_heads, m.in_proj_weight, m.in_proj_bias, m.bias_k, m.bias_v,
            m.add_zero_attn, m.dropout, m.out_proj.weight, m.out_proj.bias)


def _mha_call_kwargs(m: nn.MultiheadAttention, **kwargs):
    return dict(training=False, use_separate_proj_weight=not m._qkv_same_embed_dim, q_proj_weight=m.q_proj_weight,
                k_proj_weight=m.k_proj_weight, v_proj_weight=m.v_proj_weight, **kwargs)


def _records():
    return [(r.pattern, r.rewritten) for report in REPORTS for r in report.records]


def _details():
    return [r.detail for report in REPORTS for r in report.records]


def _pass_only(gm: torch.fx.GraphModule, example_inputs):
    """A dynamo backend that runs only our pass and executes the rewritten graph eagerly."""
    FlashAttentionPass()(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return gm.forward


def _forward_backward(fn, inputs, params, seed=11):
    """out and the gradients of every input and parameter for a fixed random cotangent."""
    out = fn(*inputs)
    cotangent = randn(out.shape, out.dtype, out.device, seed)
    leaves = [t for t in (*inputs, *params) if t.requires_grad]
    grads = torch.autograd.grad(out, leaves, cotangent)
    return [out.detach(), *grads]


def _assert_matches(name, ours, ref64, eager=None):
    """fp64: tight against eager fp64. Otherwise the project's rule against the fp64 results, with
    eager in the same dtype as the baseline."""
    for i, (o, r) in enumerate(zip(ours, ref64)):
        if o.dtype == torch.float64:
            torch.testing.assert_close(o, r, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}[{i}]: {m}")
        else:
            assert_close_to_ref(f"{name}[{i}]", o, r, eager[i])


def _three_way(build, inputs64, dtype, device, backend, **fwd_kwargs):
    """(compiled, eager fp64, eager in dtype) forward+backward of ``build(module)`` for a module in
    ``dtype`` on ``device``; the module is built once in fp64 so all three share weights."""
    torch.manual_seed(0)
    module64 = build().double().to(device)
    module = copy.deepcopy(module64).to(dtype)

    def as_inputs(tensors, dt):
        return [t.detach().to(device, dt).requires_grad_(t.requires_grad) for t in tensors]

    compiled = torch.compile(module, backend=backend)
    ours = _forward_backward(lambda *a: compiled(*a, **fwd_kwargs), as_inputs(inputs64, dtype), list(module.parameters()))
    ref = _forward_backward(lambda *a: module64(*a, **fwd_kwargs), as_inputs(inputs64, torch.float64),
                            list(module64.parameters()))
    eager = None
    if dtype != torch.float64:
        eager = _forward_backward(lambda *a: module(*a, **fwd_kwargs), as_inputs(inputs64, dtype), list(module.parameters()))
    return ours, ref, eager


# ------------------------------------------------------------------------------------------
# The replacement functions, eagerly, against PyTorch's
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("attn", ["none", "bool2d", "float2d", "bool3d", "float3d"])
@pytest.mark.parametrize("kpm", ["none", "bool", "float"])
@pytest.mark.parametrize("projection", ["self", "cross", "separate"])
def test_function_matches_multi_head_attention_forward(projection, kpm, attn, need_weights):
    torch.manual_seed(0)
    kdim, vdim = (5, 7) if projection == "separate" else (None, None)
    m = nn.MultiheadAttention(E, H, kdim=kdim, vdim=vdim, dtype=torch.float64)
    seq_q = S if projection == "self" else L
    q = randn((seq_q, B, E), torch.float64, "cpu", 1)
    k = q if projection == "self" else randn((S, B, kdim or E), torch.float64, "cpu", 2)
    v = k if projection != "separate" else randn((S, B, vdim), torch.float64, "cpu", 3)
    masks = _masks(torch.float64, seq_q)
    kwargs = _mha_call_kwargs(m, key_padding_mask=masks["kpm"][kpm], attn_mask=masks["attn"][attn],
                              need_weights=need_weights)
    ref, _ = F.multi_head_attention_forward(*_mha_call_args(m, q, k, v), **kwargs)
    ours, weights = multi_head_attention_via_flash(*_mha_call_args(m, q, k, v), **kwargs)
    assert weights is None
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("with_kpm", [False, True])
def test_function_causal_hint_and_unbatched(with_kpm, need_weights):
    """is_causal is a hint that needs attn_mask; MHA uses it only without kpm and weights."""
    torch.manual_seed(0)
    m = nn.MultiheadAttention(E, H, dtype=torch.float64)
    x = randn((S, B, E), torch.float64, "cpu", 1)
    kpm = _masks(torch.float64)["kpm"]["bool"] if with_kpm else None
    causal = nn.Transformer.generate_square_subsequent_mask(S, dtype=torch.float64)
    kwargs = _mha_call_kwargs(m, key_padding_mask=kpm, attn_mask=causal, is_causal=True, need_weights=need_weights)
    ref, _ = F.multi_head_attention_forward(*_mha_call_args(m, x, x, x), **kwargs)
    ours, _ = multi_head_attention_via_flash(*_mha_call_args(m, x, x, x), **kwargs)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-13)
    # Unbatched (S, E) input, with a 3-D (H, L, S) mask.
    xu, mask3 = x[:, 0], torch.rand(H, S, S) < 0.3
    mask3[..., 0] = False
    kwargs = _mha_call_kwargs(m, attn_mask=mask3, key_padding_mask=kpm[0] if with_kpm else None)
    ref, _ = F.multi_head_attention_forward(*_mha_call_args(m, xu, xu, xu), **kwargs)
    ours, _ = multi_head_attention_via_flash(*_mha_call_args(m, xu, xu, xu), **kwargs)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("need_weights", [False, True])
def test_function_fully_masked_rows_give_zero_attention(need_weights):
    """The one documented difference: a query row that sees no key gets a zero attention output
    (so the row becomes the out-projection's bias). MHA gives NaN there when it forms the weights
    (need_weights=True: softmax of all -inf) and, through SDPA, NaN or 0 by backend."""
    m = nn.MultiheadAttention(E, H, dtype=torch.float64)
    with torch.no_grad():
        m.out_proj.bias.normal_()
    x = randn((S, B, E), torch.float64, "cpu", 1)
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[1] = True
    args, kwargs = _mha_call_args(m, x, x, x), _mha_call_kwargs(m, key_padding_mask=kpm, need_weights=need_weights)
    ref, _ = F.multi_head_attention_forward(*args, **kwargs)
    ours, _ = multi_head_attention_via_flash(*args, **kwargs)
    torch.testing.assert_close(ours[:, 1], m.out_proj.bias.detach().expand(S, E))
    assert ref[:, 1].isnan().all() if need_weights else (ref[:, 1].isnan().all() or torch.equal(ref[:, 1], ours[:, 1]))
    torch.testing.assert_close(ours[:, 0], ref[:, 0], rtol=1e-12, atol=1e-13)


def test_function_errors_name_the_argument():
    m = nn.MultiheadAttention(E, H, add_bias_kv=True, dtype=torch.float64)
    x = randn((S, B, E), torch.float64, "cpu", 1)
    with pytest.raises(NotImplementedError, match="bias_k"):
        multi_head_attention_via_flash(*_mha_call_args(m, x, x, x), **_mha_call_kwargs(m))
    m = nn.MultiheadAttention(E, H, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"2-D attn_mask should have shape \(9, 9\)"):
        multi_head_attention_via_flash(*_mha_call_args(m, x, x, x), **_mha_call_kwargs(m, attn_mask=torch.zeros(1, S)))
    with pytest.raises(ValueError, match="key_padding_mask should have shape"):
        multi_head_attention_via_flash(*_mha_call_args(m, x, x, x),
                                       **_mha_call_kwargs(m, key_padding_mask=torch.zeros(B, 1, dtype=torch.bool)))
    with pytest.raises(RuntimeError, match="is_causal=True needs attn_mask"):
        multi_head_attention_via_flash(*_mha_call_args(m, x, x, x), **_mha_call_kwargs(m, is_causal=True))


@pytest.mark.parametrize("masks", ["none", "kpm", "src_mask", "both"])
@pytest.mark.parametrize("norm_first,activation", [(False, "relu"), (True, "gelu")])
def test_function_matches_fused_encoder_layer(masks, norm_first, activation, monkeypatch):
    """Against torch._transformer_encoder_layer_fwd with the very arguments the module passes it."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H + 1, 20, batch_first=True, norm_first=norm_first, activation=activation,
                                       dtype=torch.float64).eval()  # the fast path wants an even head count
    x = randn((B, S, E), torch.float64, "cpu", 1)
    kpm, src_mask = _masks(torch.float64, S)["kpm"]["bool"], _masks(torch.float64, S)["attn"]["bool2d"]
    mask_kwargs = {"none": {}, "kpm": dict(src_key_padding_mask=kpm), "src_mask": dict(src_mask=src_mask),
                   "both": dict(src_key_padding_mask=kpm, src_mask=src_mask)}[masks]
    fused, calls = torch._transformer_encoder_layer_fwd, []
    monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", lambda *a: calls.append(a) or fused(*a))
    with torch.no_grad():
        ref = layer(x, **mask_kwargs)
        assert len(calls) == 1, "the module did not take its fast path"
        ours = transformer_encoder_layer_via_flash(*calls[0])
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------------
# The pass alone on dynamo's graph (no Inductor)
# ------------------------------------------------------------------------------------------


class _MHABlock(nn.Module):
    """Calls one nn.MultiheadAttention the way the test parameters say; returns the output only."""

    def __init__(self, batch_first, projection, need_weights):
        super().__init__()
        kdim, vdim = (5, 7) if projection == "separate" else (None, None)
        self.mha = nn.MultiheadAttention(E, H, batch_first=batch_first, kdim=kdim, vdim=vdim)
        self.projection, self.need_weights = projection, need_weights

    def forward(self, q, k, v, key_padding_mask=None, attn_mask=None):
        k = q if self.projection == "self" else k
        v = k if self.projection != "separate" else v
        return self.mha(q, k, v, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                        need_weights=self.need_weights)[0]


def _block_inputs(batch_first, projection):
    """q, k, v for _MHABlock, each requiring grad when the block reads it."""
    shape = lambda seq, dim: (B, seq, dim) if batch_first else (seq, B, dim)
    kdim, vdim = (5, 7) if projection == "separate" else (E, E)
    q = randn(shape(S if projection == "self" else L, E), torch.float64, "cpu", 1)
    k, v = randn(shape(S, kdim), torch.float64, "cpu", 2), randn(shape(S, vdim), torch.float64, "cpu", 3)
    return [q.requires_grad_(), k.requires_grad_(projection != "self"), v.requires_grad_(projection == "separate")]


@pytest.mark.parametrize(
    "batch_first,projection,need_weights,kpm,attn",
    [
        # Masks of one type each: a bool/float mix makes MHA warn, and dynamo breaks the graph there.
        (True, "cross", False, "bool", "bool2d"),
        (False, "cross", True, "float", "float3d"),  # weights requested but unused
        (True, "separate", False, "none", "bool3d"),
        (False, "separate", True, "bool", "bool3d"),  # both masks merged; weights unused
        (True, "self", False, "none", "none"),
    ],
)
def test_pass_rewrites_mha_and_gradients_match(batch_first, projection, need_weights, kpm, attn):
    torch.manual_seed(0)
    block = _MHABlock(batch_first, projection, need_weights).double()
    inputs = _block_inputs(batch_first, projection)
    masks = _masks(torch.float64, S if projection == "self" else L)
    kwargs = dict(key_padding_mask=masks["kpm"][kpm], attn_mask=masks["attn"][attn])
    compiled = torch.compile(block, backend=_pass_only)
    ours = _forward_backward(lambda *a: compiled(*a, **kwargs), inputs, list(block.parameters()))
    ref = _forward_backward(lambda *a: block(*a, **kwargs), inputs, list(block.parameters()))
    assert _records() == [("mha", True)]
    _assert_matches("mha", ours, ref)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_pass_transformer_layers_gradients_match(kind, training):
    """nn.TransformerEncoderLayer / DecoderLayer (dropout 0) with grad enabled: every attention goes
    through F.multi_head_attention_forward, in training and in eval."""
    torch.manual_seed(0)
    kpm = _masks(torch.float64, S)["kpm"]["bool"]
    if kind == "encoder":
        layer = nn.TransformerEncoderLayer(E, H, 20, dropout=0.0, norm_first=True, dtype=torch.float64)
        inputs = [randn((S, B, E), torch.float64, "cpu", 1).requires_grad_()]
        kwargs, sites = dict(src_key_padding_mask=kpm), 1
    else:
        layer = nn.TransformerDecoderLayer(E, H, 20, dropout=0.0, batch_first=True, dtype=torch.float64)
        inputs = [randn((B, L, E), torch.float64, "cpu", 1).requires_grad_(),
                  randn((B, S, E), torch.float64, "cpu", 2).requires_grad_()]
        causal = nn.Transformer.generate_square_subsequent_mask(L, dtype=torch.float64)
        kwargs, sites = dict(tgt_mask=causal, tgt_is_causal=True, memory_key_padding_mask=kpm), 2
    layer.train(training)
    compiled = torch.compile(layer, backend=_pass_only)
    ours = _forward_backward(lambda *a: compiled(*a, **kwargs), inputs, list(layer.parameters()))
    ref = _forward_backward(lambda *a: layer(*a, **kwargs), inputs, list(layer.parameters()))
    assert _records() == [("mha", True)] * sites
    _assert_matches(kind, ours, ref)


def test_pass_rewritten_graph_is_one_attention_call_between_projections():
    """The rewritten MHA, as Inductor's later passes see it; the causal hint reaches the op."""
    torch.manual_seed(0)
    m = nn.MultiheadAttention(E, H).double()
    causal = nn.Transformer.generate_square_subsequent_mask(S, dtype=torch.float64)
    graphs = []

    def capture(gm, example_inputs):
        _pass_only(gm, example_inputs)
        graphs.append(gm.graph)
        return gm.forward

    x = randn((S, B, E), torch.float64, "cpu", 1)
    fn = lambda x: m(x, x, x, attn_mask=causal, is_causal=True, need_weights=False)[0]
    torch.testing.assert_close(torch.compile(fn, backend=capture)(x), fn(x), rtol=1e-12, atol=1e-13)
    calls = [n for n in graphs[0].nodes if n.op == "call_function" and n.target is not operator.getitem]
    assert [n.target.__name__ for n in calls] == ["mha_attention_inputs", "rewritten_attention", "mha_output"]
    attention = calls[1]
    assert attention.target is rewritten_attention
    assert attention.kwargs["is_causal"] is True and attention.kwargs["attn_mask"] is None
    assert not any(n.target is F.multi_head_attention_forward for n in graphs[0].nodes)


def test_pass_chained_mha_sites_rewrite_in_order():
    """A site whose input is the output of a site rewritten before it (seq-first, no transpose in
    between) must read the replacement, not the erased node."""
    torch.manual_seed(0)
    m = nn.MultiheadAttention(E, H).double()
    x = randn((S, B, E), torch.float64, "cpu", 1)

    def fn(x):
        y = m(x, x, x, need_weights=False)[0]
        return m(y, y, y, need_weights=False)[0]

    torch.testing.assert_close(torch.compile(fn, backend=_pass_only)(x), fn(x), rtol=1e-12, atol=1e-13)
    assert _records() == [("mha", True), ("mha", True)]


@pytest.mark.parametrize(
    "case,reason",
    [
        ("weights_used", "attention weights are used"),
        ("bias_kv", "bias_k/bias_v (add_bias_kv=True)"),
        ("zero_attn", "add_zero_attn=True"),
    ],
)
def test_pass_keeps_what_it_must_not_rewrite(case, reason):
    torch.manual_seed(0)
    m = nn.MultiheadAttention(E, H, add_bias_kv=case == "bias_kv", add_zero_attn=case == "zero_attn").double()
    x = randn((S, B, E), torch.float64, "cpu", 1)

    def fn(x):
        result = m(x, x, x, need_weights=case == "weights_used")
        return result[0] + result[1].sum() if case == "weights_used" else result[0]

    compiled = torch.compile(fn, backend=_pass_only)
    with torch.no_grad():
        ours, ref = compiled(x), fn(x)
    torch.testing.assert_close(ours, ref)
    assert _records() == [("mha", False)]
    assert reason in _details()[0]


def _hand_built_mha_graph(use, dropout_p=0.0):
    """x -> F.multi_head_attention_forward, its result used as ``use`` says (graphs dynamo does
    not produce, for the matcher's remaining branches)."""
    graph = torch.fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    p = graph.placeholder("p") if dropout_p == "traced" else dropout_p
    node = graph.call_function(F.multi_head_attention_forward, (x, x, x, E, H, w, None, None, None, False, p, w, None))
    if use == "output":
        graph.output((graph.call_function(operator.getitem, (node, 0)),))
    else:
        graph.output(node if use == "whole" else None)
    return graph


@pytest.mark.parametrize(
    "use,dropout_p,expected",
    [
        ("unused", 0.0, None),
        ("whole", 0.0, "its (output, weights) tuple is used whole by output"),
        ("output", "traced", "dropout_p is a traced value, not a constant"),
    ],
)
def test_matcher_on_graphs_dynamo_does_not_make(use, dropout_p, expected):
    sites = list(mha.find_sites(_hand_built_mha_graph(use, dropout_p)))
    if expected is None:
        assert sites == []  # nothing reads the attention output: nothing to rewrite
    else:
        assert [type(s).__name__ for s in sites] == ["KeptSite"] and sites[0].reason == expected


# ------------------------------------------------------------------------------------------
# End to end through Inductor
# ------------------------------------------------------------------------------------------


class _VitBlock(nn.Module):
    """torchvision's vision_transformer.EncoderBlock: pre-norm MHA (batch_first, need_weights=False)
    and an MLP, each with a residual."""

    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(E), nn.LayerNorm(E)
        self.self_attention = nn.MultiheadAttention(E, H, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(E, 2 * E), nn.GELU(), nn.Linear(2 * E, E))

    def forward(self, x, key_padding_mask=None):
        y = self.ln_1(x)
        y, _ = self.self_attention(y, y, y, key_padding_mask=key_padding_mask, need_weights=False)
        x = x + y
        return x + self.mlp(self.ln_2(x))


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_vit_block_matches_eager_fp32(device):
    """fp32 against fp64 eager, within twice eager fp32's own error (fp64 end to end is the
    decoder-layer and separate-projection tests below)."""
    x = randn((B, S, E), torch.float64, "cpu", 1).requires_grad_()
    kpm = _masks(torch.float64)["kpm"]["bool"].to(device)
    ours, ref, eager = _three_way(_VitBlock, [x], torch.float32, device, flash_inductor.make_backend(),
                                  key_padding_mask=kpm)
    assert _records() == [("mha", True)]
    _assert_matches("vit block", ours, ref, eager)


def test_compiled_encoder_layer_training_with_dropout():
    """Dropout inside the op: a different random stream than eager, so shape and finiteness only."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, 20, dropout=0.2, batch_first=True).train()
    x = randn((B, S, E), torch.float32, "cpu", 1).requires_grad_()
    out = torch.compile(layer, backend=flash_inductor.make_backend())(x)
    out.sum().backward()
    assert out.shape == x.shape and out.isfinite().all() and x.grad.isfinite().all()
    assert _records() == [("mha", True)]


def test_compiled_encoder_layer_eval_no_grad_fast_path():
    """Eval without grad: the layer's fused fast path, torch._transformer_encoder_layer_fwd, is one
    node in dynamo's graph and is rewritten as a whole."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H + 1, 20, batch_first=True, norm_first=True, dtype=torch.float64).eval()
    x = randn((B, S, E), torch.float64, "cpu", 1)
    kpm = _masks(torch.float64)["kpm"]["bool"]
    with torch.no_grad():
        ours = torch.compile(layer, backend=flash_inductor.make_backend())(x, src_key_padding_mask=kpm)
        ref = layer(x, src_key_padding_mask=kpm)
    assert _records() == [("mha_encoder", True)]
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12)


def test_compiled_decoder_layer_matches_eager():
    """Causal self-attention (mask + is_causal hint) and cross-attention with a memory padding
    mask: two sites, gradients included."""
    tgt = randn((S, B, E), torch.float64, "cpu", 1).requires_grad_()
    memory = randn((L, B, E), torch.float64, "cpu", 2).requires_grad_()
    memory_kpm = torch.zeros(B, L, dtype=torch.bool)
    memory_kpm[0, 4:] = True
    causal = nn.Transformer.generate_square_subsequent_mask(S, dtype=torch.float64)
    build = lambda: nn.TransformerDecoderLayer(E, H, 20, dropout=0.0)
    ours, ref, _ = _three_way(build, [tgt, memory], torch.float64, "cpu", flash_inductor.make_backend(),
                              tgt_mask=causal, tgt_is_causal=True, memory_key_padding_mask=memory_kpm)
    assert _records() == [("mha", True), ("mha", True)]
    _assert_matches("decoder layer", ours, ref)


def test_compiled_mha_dynamic_shapes():
    """dynamic=True: the replacement's shape checks run on symbolic sizes, and the module's float
    dropout, which dynamo then turns into a graph input, is ignored out of training."""
    torch.manual_seed(0)
    m = nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.float64).eval()
    fn = lambda x, kpm: m(x, x, x, key_padding_mask=kpm, need_weights=False)[0]
    compiled = torch.compile(fn, backend=flash_inductor.make_backend(), dynamic=True)
    for seq in (S, 2 * S):
        x = randn((B, seq, E), torch.float64, "cpu", seq).requires_grad_()
        kpm = torch.zeros(B, seq, dtype=torch.bool)
        kpm[0, seq // 2:] = True
        ours = _forward_backward(lambda x: compiled(x, kpm), [x], list(m.parameters()))
        _assert_matches(f"mha dynamic L={seq}", ours, _forward_backward(lambda x: fn(x, kpm), [x], list(m.parameters())))
    assert set(_records()) == {("mha", True)}
