"""``flash_inductor.backend``: what torch.compile hands it, what it leaves behind, its cache key.

Covers: ``mode=`` / ``options=`` accepted; no leak of our pre-grad pass into Inductor's global
config or a later plain ``torch.compile``; a user's own pre-grad pass still runs, after ours;
``FlashAttentionPass.uuid()`` (options, instances, pickling, sources); ``devices=``; training,
``no_grad``, ``dynamic=True`` and activation checkpointing through the SDPA family; SDPA over
``repeat_kv``'d K/V folded into ``enable_gqa`` (and not when K is written after the repeat); the
report's format (an expecttest inline expectation).
"""

from __future__ import annotations

import copy
import pickle

import expecttest

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.utils.checkpoint import checkpoint

import flash_inductor
from flash_inductor.passes import graph_pass
from flash_inductor.passes.graph_pass import FlashAttentionPass, RewriteOptions
from flash_inductor.passes.report import REPORTS
from flash_inductor.passes.site import rewritten_attention
from helpers import assert_training_steps_match_fp64, randn

E, H, L = 16, 2, 11


# Fresh dynamo and no AOTAutograd cache per test (conftest.py says why).
pytestmark = pytest.mark.usefixtures("fresh_compiler")


def _records():
    return [(r.pattern, r.rewritten) for report in REPORTS for r in report.records]


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True) * 2.0


def _qkv(seq=L, dtype=torch.float64, requires_grad=False):
    return [randn((2, H, seq, 8), dtype, "cpu", seed).requires_grad_(requires_grad) for seed in (1, 2, 3)]


class _Block(nn.Module):
    """qkv projection -> causal SDPA -> out projection, the shape of nanoGPT's attention."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(E, 3 * E), nn.Linear(E, E)

    def forward(self, x):
        batch, seq, _ = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, H, E // H).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(y.transpose(1, 2).reshape(batch, seq, E))


class _Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = _Block()

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False).sum(-1, keepdim=True) * x


def _out_and_grads(module, x):
    out = module(x)
    grads = torch.autograd.grad(out, [x, *module.parameters()], randn(out.shape, out.dtype, "cpu", 9))
    return [out.detach(), *grads]


def _assert_all_close(ours, ref):
    for i, (o, r) in enumerate(zip(ours, ref)):
        torch.testing.assert_close(o, r, rtol=1e-10, atol=1e-12, msg=lambda m: f"result {i}: {m}")


# ------------------------------------------------------------------------------------------
# What torch.compile hands the backend, and what the backend leaves behind
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "compile_kwargs",
    [dict(mode="max-autotune-no-cudagraphs"), dict(options={"epilogue_fusion": False, "max_autotune": False})],
    ids=["mode", "options"],
)
def test_mode_and_options_are_accepted(compile_kwargs):
    q, k, v = _qkv()
    out = torch.compile(_sdpa, backend=flash_inductor.backend, **compile_kwargs)(q, k, v)
    torch.testing.assert_close(out, _sdpa(q, k, v))
    assert _records() == [("sdpa", True)]


def test_nothing_leaks_into_a_later_plain_compile():
    before = torch._inductor.config.pre_grad_custom_pass
    q, k, v = _qkv()
    torch.compile(_sdpa, backend=flash_inductor.backend)(q, k, v)
    assert _records() == [("sdpa", True)]
    assert torch._inductor.config.pre_grad_custom_pass is before

    torch._dynamo.reset()
    REPORTS.clear()
    rewrites = dict(counters["flash_inductor"])
    torch.testing.assert_close(torch.compile(_sdpa)(q, k, v), _sdpa(q, k, v))
    assert REPORTS == [] and dict(counters["flash_inductor"]) == rewrites


def test_user_pre_grad_pass_still_runs_after_ours():
    seen = []

    def user_pass(graph: torch.fx.Graph) -> None:
        seen.append([n.target for n in graph.nodes if n.op == "call_function"])

    q, k, v = _qkv()
    with torch._inductor.config.patch(pre_grad_custom_pass=user_pass):
        torch.compile(_sdpa, backend=flash_inductor.backend)(q, k, v)
        assert torch._inductor.config.pre_grad_custom_pass is user_pass
    assert len(seen) == 1, "the user's pass did not run"
    # It ran after ours: it saw the rewritten graph.
    assert rewritten_attention in seen[0] and F.scaled_dot_product_attention not in seen[0]


def test_a_rewritten_graph_is_cacheable_by_aot_autograd():
    """AOT autograd's cache refuses a graph that calls a function it does not know, and torch
    2.11 checks the graph after our pass: the backend marks the rewrite's call as cacheable,
    keyed by the pass's uuid, so a warm start loads the compiled graph instead of retracing."""
    autograd_cache = pytest.importorskip("torch._functorch._aot_autograd.autograd_cache")
    graph = torch.fx.Graph()
    q = graph.placeholder("q")
    call = graph.call_function(rewritten_attention, (q, q, q))
    graph.output(call)
    with pytest.raises(autograd_cache.BypassAOTAutogradCache):
        autograd_cache.check_node_safe(call)
    patches = flash_inductor.backend.config_patches()
    marked = patches["unsafe_marked_cacheable_functions"]
    # Every call the rewrite inserts (the dense one and the packed-sequence one), keyed by the pass.
    assert set(marked.values()) == {flash_inductor.backend.graph_pass.uuid()}
    assert {"flash_inductor.passes.site.rewritten_attention", "flash_inductor.passes.site.packed_sequence_attention"} \
        <= set(marked)
    with torch._inductor.config.patch(patches):
        autograd_cache.check_node_safe(call)  # no bypass


# ------------------------------------------------------------------------------------------
# The pass's cache key
# ------------------------------------------------------------------------------------------


def test_uuid_depends_on_options_not_on_the_instance():
    default = FlashAttentionPass(RewriteOptions()).uuid()
    assert FlashAttentionPass(RewriteOptions()).uuid() == default
    assert FlashAttentionPass(RewriteOptions(devices=("cpu", "cuda"))).uuid() == default  # order-free
    others = {FlashAttentionPass(o).uuid() for o in (RewriteOptions(schedule="accurate"), RewriteOptions(devices=("cuda",)))}
    assert default not in others and len(others) == 2


def test_pickled_pass_is_its_uuid():
    """torch 2.11 pickles the pass into the FX graph cache key: the pickle must carry the uuid,
    not the pass's identity."""
    p = FlashAttentionPass(RewriteOptions(schedule="fast"))
    assert p.__getstate__()["uuid"] == p.uuid()
    restored = pickle.loads(pickle.dumps(p))
    assert restored.uuid() == p.uuid() and restored.options == p.options
    assert pickle.dumps(FlashAttentionPass(RewriteOptions(schedule="fast"))) == pickle.dumps(p)


def test_uuid_changes_when_a_source_changes(tmp_path, monkeypatch):
    source = tmp_path / "kernel.py"
    monkeypatch.setattr(graph_pass, "_source_files", lambda: [source])
    source.write_text("BLOCK = 64\n")
    first = FlashAttentionPass().uuid()
    assert FlashAttentionPass().uuid() == first
    source.write_text("BLOCK = 128\n")
    assert FlashAttentionPass().uuid() != first


# ------------------------------------------------------------------------------------------
# Options and compile modes through the SDPA family
# ------------------------------------------------------------------------------------------


def test_devices_option_keeps_sites_on_other_devices():
    q, k, v = _qkv()
    out = torch.compile(_sdpa, backend=flash_inductor.make_backend(devices=("cuda",)))(q, k, v)
    torch.testing.assert_close(out, _sdpa(q, k, v))
    report = flash_inductor.last_report()
    assert [(r.pattern, r.rewritten) for r in report.records] == [("sdpa", False)]
    assert "device cpu is not in devices=('cuda',)" in report.records[0].detail


def test_training_gradients_match_eager():
    torch.manual_seed(0)
    block = _Block().double()
    x = randn((2, L, E), torch.float64, "cpu", 4).requires_grad_()
    ours = _out_and_grads(torch.compile(block, backend=flash_inductor.backend), x)
    assert _records() == [("sdpa", True)]
    _assert_all_close(ours, _out_and_grads(block, x))


def test_no_grad_matches_eager():
    torch.manual_seed(0)
    block = _Block().double()
    x = randn((2, L, E), torch.float64, "cpu", 4)
    with torch.no_grad():
        ours, ref = torch.compile(block, backend=flash_inductor.backend)(x), block(x)
    assert _records() == [("sdpa", True)]
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12)


def test_dynamic_shapes_one_graph_for_every_length():
    torch.manual_seed(0)
    block = _Block().double()
    compiled = torch.compile(block, backend=flash_inductor.backend, dynamic=True)
    for seq in (7, 13, 20):
        x = randn((2, seq, E), torch.float64, "cpu", seq).requires_grad_()
        _assert_all_close(_out_and_grads(compiled, x), _out_and_grads(block, x))
    assert _records() == [("sdpa", True)], "expected one compilation, rewritten"


def test_activation_checkpointing_inside_the_compiled_module():
    """The checkpointed block is a subgraph (tag_activation_checkpoint): Inductor runs pre-grad
    passes on it too, so the attention inside is rewritten (reported for the subgraph)."""
    torch.manual_seed(0)
    model = _Checkpointed().double()
    x = randn((2, L, E), torch.float64, "cpu", 4).requires_grad_()
    ours = _out_and_grads(torch.compile(model, backend=flash_inductor.backend), x)
    assert ("sdpa", True) in _records()
    _assert_all_close(ours, _out_and_grads(model, x))


# ------------------------------------------------------------------------------------------
# The report
# ------------------------------------------------------------------------------------------


class _Mixed(nn.Module):
    """One site of each kind: SDPA rewritten, MHA rewritten, MHA kept (its weights are used)."""

    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(E, H, batch_first=True)

    def forward(self, x):
        q = x.view(2, L, H, E // H).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, q, q).transpose(1, 2).reshape(2, L, E)
        y = self.mha(y, y, y, need_weights=False)[0]
        out, weights = self.mha(y, y, y)
        return out * weights.mean()


class TestReport(expecttest.TestCase):
    def test_report_format(self):
        model = _Mixed().double()
        x = randn((2, L, E), torch.float64, "cpu", 4)
        with torch.no_grad():
            torch.testing.assert_close(torch.compile(model, backend=flash_inductor.backend)(x), model(x))
        self.assertExpectedInline(flash_inductor.last_report().format(), """\
flash_inductor: rewrote 2 of 3 attention sites
  module  node                            pattern  status     reason
  -       scaled_dot_product_attention    sdpa     rewritten  no mask
  mha     attn_output                     mha      rewritten  no mask
  mha     multi_head_attention_forward_1  mha      kept       attention weights are used (need_weights=True and getitem 1 has users); the op never forms the L x S weights""")


def test_attention_over_attention_rewrites_both_sites():
    """A site whose input is an earlier site's output must read the replacement, not the erased node."""
    import torch.nn.functional as F

    q = torch.randn(2, 2, 8, 4, dtype=torch.float64)

    def nested(q):
        return F.scaled_dot_product_attention(F.scaled_dot_product_attention(q, q, q), q, q)

    out = torch.compile(nested, backend=flash_inductor.backend)(q)
    torch.testing.assert_close(out, nested(q), rtol=1e-10, atol=1e-12)
    assert flash_inductor.last_report().rewritten == 2


def test_one_report_per_compile_even_on_a_cache_hit():
    import torch.nn.functional as F

    from flash_inductor.passes.report import one_report_per_compile

    with one_report_per_compile() as report:
        pass  # no pass ran: what a cache hit looks like to the backend
    assert flash_inductor.last_report() is report
    assert "cache" in report.note

    q = torch.randn(1, 2, 8, 4)
    torch.compile(lambda q: F.scaled_dot_product_attention(q, q, q), backend=flash_inductor.backend)(q)
    assert flash_inductor.last_report().note is None and flash_inductor.last_report().rewritten == 1


# ------------------------------------------------------------------------------------------
# The SDPA family over repeated K/V (HF Llama / Mistral / Qwen2 "sdpa" with a mask)
# ------------------------------------------------------------------------------------------


def _repeat_kv(x, n_rep):  # transformers' repeat_kv, verbatim
    batch, heads, seq, dim = x.shape
    return x[:, :, None, :, :].expand(batch, heads, n_rep, seq, dim).reshape(batch, heads * n_rep, seq, dim)


def _hf_sdpa_gqa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, _repeat_kv(k, 2), _repeat_kv(v, 2), attn_mask=mask, scale=0.3)


def _hf_sdpa_gqa_mutated(q, k, v, mask):
    k = k * 1.0
    repeated = _repeat_kv(k, 2)
    k.add_(1.0)  # after the repeat copied k: the op must not read k instead
    return F.scaled_dot_product_attention(q, repeated, _repeat_kv(v, 2), attn_mask=mask, scale=0.3), k


def _hf_sdpa_gqa_static_cache(q, k, v, mask, new_k, new_v, position):
    k.index_copy_(2, position, new_k)  # StaticCache.update: the write comes before the repeat
    v.index_copy_(2, position, new_v)
    return _hf_sdpa_gqa(q, k, v, mask)


def _gqa_inputs(requires_grad=False):
    q = randn((2, 4, L, 8), torch.float64, "cpu", 1).requires_grad_(requires_grad)
    k, v = (randn((2, 2, L, 8), torch.float64, "cpu", s).requires_grad_(requires_grad) for s in (2, 3))
    mask = randn((2, 1, L, L), torch.float64, "cpu", 4) > -1.0
    mask[..., 0] = True
    return q, k, v, mask


def test_sdpa_over_repeat_kv_reads_unrepeated_kv_with_enable_gqa():
    seen = []

    def after_ours(graph):
        seen.extend(n for n in graph.nodes if n.target is rewritten_attention)

    inputs = _gqa_inputs(requires_grad=True)
    with torch._inductor.config.patch(pre_grad_custom_pass=after_ours):
        out = torch.compile(_hf_sdpa_gqa, backend=flash_inductor.backend)(*inputs)
    assert _records() == [("sdpa_repeat_kv", True)]
    (call,) = seen
    assert call.kwargs["enable_gqa"] and [a.op for a in call.args] == ["placeholder"] * 3  # no repeat left
    ref_inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    ref = _hf_sdpa_gqa(*ref_inputs)
    _assert_all_close([out, *torch.autograd.grad(out.sum(), inputs[:3])],
                      [ref, *torch.autograd.grad(ref.sum(), ref_inputs[:3])])


def test_sdpa_over_repeat_kv_of_a_tensor_written_afterwards_keeps_the_repeat():
    inputs = _gqa_inputs()
    out, k = torch.compile(_hf_sdpa_gqa_mutated, backend=flash_inductor.backend)(*inputs)
    assert _records() == [("sdpa", True)]
    ref, ref_k = _hf_sdpa_gqa_mutated(*inputs)
    _assert_all_close([out, k], [ref, ref_k])


def test_sdpa_over_repeat_kv_of_a_cache_written_before_the_repeat_reads_the_cache():
    q, k, v, mask = _gqa_inputs()
    step = (randn((2, 2, 1, 8), torch.float64, "cpu", 5), randn((2, 2, 1, 8), torch.float64, "cpu", 6),
            torch.tensor([3]))
    ours_cache, ref_cache = (k.clone(), v.clone()), (k.clone(), v.clone())
    out = torch.compile(_hf_sdpa_gqa_static_cache, backend=flash_inductor.backend)(q, *ours_cache, mask, *step)
    assert _records() == [("sdpa_repeat_kv", True)]
    ref = _hf_sdpa_gqa_static_cache(q, *ref_cache, mask, *step)
    _assert_all_close([out, *ours_cache], [ref, *ref_cache])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (runs in the GPU suite)")
def test_reduce_overhead_training_on_cuda():
    """mode="reduce-overhead" records CUDA graphs around the compiled forward and backward: our op
    (Triton kernels launched from inside Inductor's graph) must replay correctly step after step,
    as close to an fp64 run as eager fp32 is."""
    torch.manual_seed(0)
    block = _Block().cuda()
    eager, golden = copy.deepcopy(block), copy.deepcopy(block).double()
    compiled = torch.compile(block, backend=flash_inductor.backend, mode="reduce-overhead")
    assert_training_steps_match_fp64(compiled, eager, golden,
                                     lambda step: randn((2, 64, E), torch.float32, "cuda", 10 + step))
    assert ("sdpa", True) in _records()
