"""The Gluon Hopper forward (launch/hopper.py) against the fp64 reference with the project's
tolerance rule (tests/helpers.py): dtype x head dim x causal x odd lengths, sliding windows,
grouped-query heads, strided (B, L, H, E) views, and rows that see no key. Runs only on an sm_90 GPU with a Triton
that has Gluon; elsewhere each test is skipped with the reason."""

from __future__ import annotations

import pytest
import torch

from flash_inductor.launch.visibility import Visibility
from helpers import CudaLooking, mock_hopper, needs_hopper, spy_on



DTYPES = (torch.bfloat16, torch.float16)


def _inputs(dtype, head_dim, batch, heads_q, heads_kv, seq_q, seq_k, transposed=False, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rand(h, n):
        if transposed:
            return torch.randn(batch, n, h, head_dim, device="cuda", dtype=dtype, generator=gen).transpose(1, 2)
        return torch.randn(batch, h, n, head_dim, device="cuda", dtype=dtype, generator=gen)
    return rand(heads_q, seq_q), rand(heads_kv, seq_k), rand(heads_kv, seq_k)


def _reference(q, k, v, scale, is_causal, causal_offset, window=None):
    from flash_inductor.launch.band import resolve_band

    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    s = (q.double() @ k.transpose(-1, -2)) * scale
    visible = resolve_band(is_causal, causal_offset, window, q.shape[2], k.shape[2]).visible(
        q.shape[2], k.shape[2], device=q.device)
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return p @ v, lse, visible


def _check(q, k, v, is_causal, causal_offset=0, window=None, config=None):
    import torch.nn.functional as F

    from flash_inductor.launch.hopper import hopper_attention_forward, hopper_forward_supported

    scale = q.shape[-1] ** -0.5
    assert hopper_forward_supported(q, k, v, None, 0.0, scale)
    visibility = Visibility(is_causal=is_causal, causal_offset=causal_offset, window=window)
    out, lse = hopper_attention_forward(q, k, v, scale=scale, visibility=visibility, config=config)
    ref, lse_ref, visible = _reference(q, k, v, scale, is_causal, causal_offset, window)
    group = q.shape[1] // k.shape[1]
    base = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                          attn_mask=visible, scale=scale)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    empty = torch.isinf(lse_ref)
    live = ~empty
    # Rows with no visible key: exactly 0 and -inf, not NaN (SDPA gives NaN there).
    assert (out[empty] == 0).all() and (lse[empty] == float("-inf")).all()
    assert torch.isfinite(out).all()
    if live.any():
        err = (out.double() - ref).abs()[live].max().item()
        base_err = (base.double() - ref).abs()[live & torch.isfinite(base).all(-1)].max().item()
        floor = 2 * torch.finfo(q.dtype).eps * ref.abs().max().item()
        assert err <= 2 * base_err + floor, (err, base_err, floor)
        assert (lse.double() - lse_ref).abs()[live].max().item() <= 1e-3


@needs_hopper
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("is_causal", (False, True))
@pytest.mark.parametrize("seq_q, seq_k", [(97, 97), (300, 300), (1025, 1025), (256, 700), (700, 256)])
def test_matches_fp64(dtype, head_dim, is_causal, seq_q, seq_k):
    _check(*_inputs(dtype, head_dim, 2, 3, 3, seq_q, seq_k), is_causal)


@needs_hopper
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("is_causal", (False, True))
# (left, right) as FlashAttention defines them: a causal sliding window, a left side alone, a band
# narrower than one key tile on both sides, the diagonal alone (rows that see no key when L > S),
# and a left side wider than S (no bound at all).
@pytest.mark.parametrize("window", [(200, 0), (300, -1), (40, 40), (0, 0), (5000, 0)])
@pytest.mark.parametrize("seq_q, seq_k", [(1025, 1025), (300, 700), (700, 300)])
def test_sliding_windows_match_fp64(dtype, head_dim, is_causal, window, seq_q, seq_k):
    _check(*_inputs(dtype, head_dim, 1, 2, 1, seq_q, seq_k), is_causal, window=window)


@needs_hopper
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", (64, 128))
def test_gqa_and_strided_views(dtype, head_dim):
    _check(*_inputs(dtype, head_dim, 2, 8, 2, 333, 513, transposed=True), True)


@needs_hopper
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("is_causal", (False, True))
@pytest.mark.parametrize("swizzle_heads", (3, 1 << 30))
def test_grid_orders(head_dim, is_causal, swizzle_heads):
    # The grid walked 3 heads at a time (B·H = 16: five groups of 3 and one of 1) or every head's
    # first block first: GQA 4:1, L != S, a partial last query block, rows that see no key under
    # causal masking.
    from dataclasses import replace

    from flash_inductor.launch.hopper import default_config

    config = replace(default_config(head_dim, is_causal), swizzle_heads=swizzle_heads)
    _check(*_inputs(torch.bfloat16, head_dim, 2, 8, 2, 700, 513), is_causal, config=config)


@needs_hopper
@pytest.mark.parametrize("head_dim", (64, 128))
def test_rows_that_see_no_key(head_dim):
    # Lower-right causal with L > S: query i sees keys j <= i - (L - S); the first L - S rows none.
    _check(*_inputs(torch.bfloat16, head_dim, 1, 2, 1, 400, 150), True, causal_offset=150 - 400)


@needs_hopper
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("exact_delta", (False, True))
@pytest.mark.parametrize("window", (None, (255, 0), (100, 30)), ids=("causal", "w256", "w100_30"))
@pytest.mark.parametrize("seq_q, seq_k, causal_offset", [(4096, 4096, 0), (700, 513, 0), (333, 1000, 667),
                                                         (400, 150, -250), (1, 7, 6), (200, 1, 0)])
def test_skipping_masked_tiles_changes_no_bit(head_dim, exact_delta, window, seq_q, seq_k, causal_offset):
    """skip_masked_tiles (a consumer computes only the key tiles its own rows see: it stops at its
    own last causal tile and starts at its own first one inside a window) gives the very bits of
    the full walk: out, LSE, and under the exact Δ the residual and row constants. Top-left and
    bottom-right causal, windows narrower than a CTA's rows and one with a right side, ragged
    blocks, rows that see no key, lengths of 1, GQA."""
    from dataclasses import replace

    from flash_inductor.launch import hopper

    q, k, v = _inputs(torch.bfloat16, head_dim, 2, 8, 2, seq_q, seq_k)
    config = hopper.default_config(head_dim, True, exact_delta=exact_delta)
    results = []
    for skip in (False, True):
        visibility = Visibility(is_causal=True, causal_offset=causal_offset, window=window)
        results.append(hopper.hopper_attention_forward(q, k, v, visibility=visibility, exact_delta=exact_delta,
                                                       config=replace(config, skip_masked_tiles=skip)))
    for full, skipped in zip(*results):
        assert torch.equal(full, skipped)


@needs_hopper
@pytest.mark.parametrize("head_dim, consumers, stages", [(64, 3, 3), (64, 2, 4), (128, 2, 2)])
@pytest.mark.parametrize("exact_delta", (False, True))
@pytest.mark.parametrize("mask", ("none", "causal", "w100_30", "key_bias"))
@pytest.mark.parametrize("batch, seq_q, seq_k", [(4, 4096, 4096), (2, 700, 513), (1, 1, 7), (3, 200, 1)])
def test_persistent_grid_changes_no_bit(head_dim, consumers, stages, exact_delta, mask, batch, seq_q, seq_k):
    """A persistent launch (one CTA per SM claiming blocks from a work counter, O staged in tiles
    of its own) computes each block as the one-block-per-CTA grid does: the very bits of out, LSE
    and, under the exact Δ, the residual and row constants. Many waves of blocks (B 4, 4k: 22 to
    32 blocks a head, several blocks per CTA with their ring and ping-pong rounds carried over),
    ragged blocks, lengths of 1, GQA, causal, a window with a right side and a key mask."""
    from dataclasses import replace

    from flash_inductor.launch.hopper import HopperForwardConfig, hopper_attention_forward

    q, k, v = _inputs(torch.bfloat16, head_dim, batch, 8, 2, seq_q, seq_k)
    kwargs = dict(visibility=Visibility(is_causal=mask == "causal", window=(100, 30) if mask == "w100_30" else None),
                  exact_delta=exact_delta)
    if mask == "key_bias":
        keep = torch.rand(batch, 1, 1, seq_k, device="cuda") > 0.2
        keep[..., 0] = True
        kwargs["attn_mask"] = keep
    config = HopperForwardConfig(num_stages=stages, num_consumers=consumers, pingpong=True)
    grid = hopper_attention_forward(q, k, v, config=config, **kwargs)
    persistent = hopper_attention_forward(q, k, v, config=replace(config, persistent=True), **kwargs)
    for a, b in zip(grid, persistent):
        assert torch.equal(a, b)


@needs_hopper
def test_length_one():
    _check(*_inputs(torch.float16, 64, 3, 2, 2, 1, 1), True)


@needs_hopper
def test_declines_what_it_does_not_implement():
    from flash_inductor.launch.hopper import hopper_forward_unsupported_reason

    q, k, v = _inputs(torch.bfloat16, 64, 1, 2, 2, 64, 64)
    assert "mask" in hopper_forward_unsupported_reason(q, k, v, torch.ones(64, 64, dtype=torch.bool, device="cuda"))
    assert "dropout" in hopper_forward_unsupported_reason(q, k, v, None, 0.1)
    assert "dtype" in hopper_forward_unsupported_reason(q.float(), k.float(), v.float())
    q96, k96, v96 = _inputs(torch.bfloat16, 96, 1, 2, 2, 64, 64)
    assert "head dims" in hopper_forward_unsupported_reason(q96, k96, v96)


def test_declines_off_hopper_without_touching_a_gpu():
    """Runs anywhere: CPU tensors are declined with a reason, before any CUDA or Gluon call."""
    from flash_inductor.launch.hopper import hopper_forward_supported, hopper_forward_unsupported_reason

    q = torch.randn(1, 2, 64, 64, dtype=torch.bfloat16)
    assert hopper_forward_unsupported_reason(q, q, q) == "not on a CUDA device"
    assert not hopper_forward_supported(q, q, q)


def test_register_plan_fills_the_register_file():
    """The entry cap times all warps, and the setmaxnreg split, stay within 64K registers."""
    from flash_inductor.launch.hopper import HopperForwardConfig, default_config

    for cfg in (default_config(64, False), default_config(128, True), HopperForwardConfig()):
        warpgroups = cfg.num_consumers + 1
        assert cfg.maxnreg * 128 * warpgroups <= 65536
        assert cfg.consumer_regs * 128 * cfg.num_consumers + cfg.loader_regs * 128 <= 65536
        assert cfg.maxnreg % 8 == 0 and cfg.consumer_regs % 8 == 0


def _count_hopper_launches(monkeypatch):
    from flash_inductor.launch import hopper

    return spy_on(monkeypatch, hopper, "hopper_attention_forward")


@needs_hopper
@pytest.mark.parametrize("compiled", (False, True), ids=("eager", "compiled"))
def test_the_op_runs_its_forward_on_hopper_and_trains(monkeypatch, compiled):
    """flash_attention takes the Gluon forward on an sm_90 GPU, eagerly and under torch.compile
    (through its opaque op), and the backward on the Triton kernels consumes its out and LSE."""
    from flash_inductor import flash_attention

    calls = _count_hopper_launches(monkeypatch)
    q, k, v = (t.detach().requires_grad_(True) for t in _inputs(torch.bfloat16, 128, 2, 4, 2, 300, 300))
    fn = (lambda *a: flash_attention(*a, is_causal=True, enable_gqa=True))
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(fn, fullgraph=True)
    out = fn(q, k, v)
    out.float().square().sum().backward()
    assert calls == [True]
    ref, _, _ = _reference(q.detach(), k.detach(), v.detach(), 128 ** -0.5, True, 0)
    assert (out.double() - ref).abs().max().item() < 2e-2
    qd, kd, vd = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    torch.nn.functional.scaled_dot_product_attention(qd, kd.repeat_interleave(2, 1), vd.repeat_interleave(2, 1),
                                                     is_causal=True).square().sum().backward()
    for got, want in ((q.grad, qd.grad), (k.grad, kd.grad), (v.grad, vd.grad)):
        rel = ((got.double() - want).norm() / want.norm()).item()
        assert rel < 2e-2, rel


@needs_hopper
def test_strides_tma_cannot_address_fall_back_to_triton(monkeypatch):
    """A query whose base is not 16-byte aligned passes the static check (fake tensors know no
    pointers) but not TMA's: the plain op's Hopper branch then runs the Triton forward (`fast`),
    and the one-pass ops (`stable`, in training: a key that requires grad) run the Hopper kernel
    on an aligned copy; both correctly."""
    from flash_inductor import flash_attention

    calls = _count_hopper_launches(monkeypatch)
    storage = torch.randn(2 * 4 * 256 * 64 + 1, device="cuda", dtype=torch.float16)
    q = storage[1:].view(2, 4, 256, 64)  # 2-byte offset, yet contiguous: .contiguous() would not copy it
    _, k, v = _inputs(torch.float16, 64, 2, 4, 4, 256, 256)
    ref, _, _ = _reference(q, k, v, 64 ** -0.5, False, 0)
    out = flash_attention(q, k, v, schedule="fast")
    assert calls == []
    assert (out.double() - ref).abs().max().item() < 1e-2
    out = flash_attention(q, k.requires_grad_(), v)
    assert calls == [False]
    assert (out.double() - ref).abs().max().item() < 1e-2


@needs_hopper
def test_the_accurate_schedule_keeps_the_triton_forward(monkeypatch):
    from flash_inductor import flash_attention

    calls = _count_hopper_launches(monkeypatch)
    flash_attention(*_inputs(torch.bfloat16, 64, 1, 2, 2, 128, 128), schedule="accurate")
    assert calls == []


def test_the_static_choice_on_a_mocked_hopper(monkeypatch):
    """Runs anywhere: with the capability and Gluon mocked, the static check takes exactly the
    calls the kernel implements and names the reason for each one it declines."""
    from flash_inductor.launch import hopper

    t = mock_hopper(monkeypatch)
    q, kv = t(2, 8, 64, 128), t(2, 2, 64, 128)
    assert hopper.hopper_forward_unsupported_reason(q, kv, kv, None, 0.0, None, "stable") is None
    assert hopper.hopper_forward_unsupported_reason(q, kv, kv, None, 0.0, None, "fast") is None
    assert hopper.hopper_forward_unsupported_reason(q, kv, kv, None, 0.0, None, "stable", window=(16, 0)) is None
    assert "accurate" in hopper.hopper_forward_unsupported_reason(q, kv, kv, None, 0.0, None, "accurate")
    assert "fp8" in hopper.hopper_forward_unsupported_reason(q, kv, kv, None, 0.0, None, "fp8")
    assert "mask" in hopper.hopper_forward_unsupported_reason(q, kv, kv, t(2, 8, 64, 64, dtype=torch.bool))
    assert "dropout" in hopper.hopper_forward_unsupported_reason(q, kv, kv, None, 0.1)
    assert "head dims" in hopper.hopper_forward_unsupported_reason(t(2, 8, 64, 96), t(2, 2, 64, 96), t(2, 2, 64, 96))
    assert "dtype" in hopper.hopper_forward_unsupported_reason(t(2, 8, 64, 64, dtype=torch.float32),
                                                                 t(2, 2, 64, 64, dtype=torch.float32),
                                                                 t(2, 2, 64, 64, dtype=torch.float32))
    assert "multiple" in hopper.hopper_forward_unsupported_reason(t(2, 6, 64, 64), t(2, 4, 64, 64), t(2, 4, 64, 64))


def test_explain_names_the_forward_kernel_on_a_mocked_hopper(monkeypatch):
    """A rewritten site's report line says which forward kernel runs it on an sm_90 GPU: the
    Hopper one, or the Triton one and why (here a mask); elsewhere it says nothing of kernels."""
    import torch.fx as fx

    from flash_inductor.passes.site import AttentionSite, describe_rewrite

    mock_hopper(monkeypatch)
    graph = fx.Graph()

    def node(name, *shape, dtype=torch.bfloat16, cuda=True):
        n = graph.placeholder(name)
        value = torch.empty(shape, dtype=dtype)
        n.meta["example_value"] = value.as_subclass(CudaLooking) if cuda else value
        return n

    q, k, v = node("q", 2, 8, 64, 128), node("k", 2, 8, 64, 128), node("v", 2, 8, 64, 128)
    site = AttentionSite("sdpa", q, q, k, v, is_causal=True)
    both = "forward and backward on the Hopper (Gluon) kernels"
    assert describe_rewrite(site, "stable").endswith(both)  # `stable` through the one-pass ops
    assert describe_rewrite(site, "fast").endswith(both)
    # A sliding window runs on both Gluon kernels too.
    windowed = AttentionSite("sdpa", q, q, k, v, is_causal=True, window=(15, 0))
    assert describe_rewrite(windowed, "fast").endswith(both)
    assert describe_rewrite(windowed, "stable").endswith(both)
    masked = AttentionSite("sdpa", q, q, k, v, attn_mask=node("m", 2, 8, 64, 64, dtype=torch.bool))
    assert "forward on Triton: an attention mask" in describe_rewrite(masked, "stable")
    on_cpu = AttentionSite("sdpa", q, node("qc", 2, 8, 64, 128, cuda=False), k, v)
    assert "forward" not in describe_rewrite(on_cpu, "stable")


@pytest.mark.parametrize("box", [(1, 1, 64, 128), (1, 1, 128, 64), (1, 64)])
def test_descriptors_skip_only_the_checks(box):
    """The launchers' unchecked descriptors hold what Gluon's checked constructor holds, field for
    field, and the launcher's argument packing reads the same values from both (CPU tensors: no
    GPU is touched)."""
    gluon = pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    import dataclasses

    from flash_inductor.launch.hopper import _descriptor_defaults, _default_layout, gluon_descriptor

    t = torch.empty((2, 3, 256, 128), dtype=torch.bfloat16)[..., : box[-1]] if len(box) == 4 else \
        torch.empty((6, 96), dtype=torch.float32)
    layout = _default_layout(tuple(box), t.dtype)
    fast = gluon_descriptor(t, list(box), layout)
    checked = gluon.TensorDescriptor(t, list(t.shape), list(t.stride()), list(box), layout)
    assert _descriptor_defaults() is not None, "this Triton's TensorDescriptor lost the fast path"
    assert type(fast) is type(checked)
    assert fast.base is t and checked.base is t
    for field in dataclasses.fields(checked):
        if field.name != "base":
            assert getattr(fast, field.name) == getattr(checked, field.name), field.name
    assert fast.strides == list(t.stride()) and fast.shape == list(t.shape)
