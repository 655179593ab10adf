"""The Gluon Hopper backward (launch/hopper_bwd.py, `fast` schedule) against fp64 gradients with
the project's tolerance rule (tests/helpers.assert_close_to_ref): dtype x head dim x causal x odd
lengths, sliding windows, grouped-query heads, strided (B, L, H, E) views, both dQ schemes, and
rows that see no key (dq exactly 0). GPU tests run only on an sm_90 GPU with a Triton that has
Gluon; the support check and the register plan are checked everywhere."""

from __future__ import annotations

import pytest
import torch

from flash_inductor.launch.visibility import Visibility
from helpers import assert_close_to_ref, mock_hopper, needs_hopper, spy_on



DTYPES = (torch.bfloat16, torch.float16)


def _inputs(dtype, head_dim, batch, heads_q, heads_kv, seq_q, seq_k, transposed=False, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rand(h, n):
        if transposed:
            return torch.randn(batch, n, h, head_dim, device="cuda", dtype=dtype, generator=gen).transpose(1, 2)
        return torch.randn(batch, h, n, head_dim, device="cuda", dtype=dtype, generator=gen)
    return rand(heads_q, seq_q), rand(heads_kv, seq_k), rand(heads_kv, seq_k), rand(heads_q, seq_q)


def _visible(seq_q, seq_k, is_causal, causal_offset, window=None):
    from flash_inductor.launch.band import resolve_band

    return resolve_band(is_causal, causal_offset, window, seq_q, seq_k).visible(seq_q, seq_k, device="cuda")


def _fp64_grads(q, k, v, do, scale, visible):
    """fp64 autograd through a softmax that gives rows with no key P = 0 (no NaN)."""
    group = q.shape[1] // k.shape[1]
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    s = (q @ k.repeat_interleave(group, 1).transpose(-1, -2)) * scale
    s = s.masked_fill(~visible, float("-inf"))
    m = s.amax(-1, keepdim=True).detach()
    e = torch.exp(s - torch.where(torch.isinf(m), 0.0, m))
    l = e.sum(-1, keepdim=True)
    p = e / torch.where(l == 0, 1.0, l)
    grads = torch.autograd.grad(p @ v.repeat_interleave(group, 1), (q, k, v), do.double())
    # The most probability mass any key receives, summed over its GQA group's query heads.
    colsum = p.detach().sum(-2).unflatten(1, (k.shape[1], group)).sum(2).max().item()
    return grads, colsum


def _sdpa_grads(q, k, v, do, scale, visible, live_from):
    """SDPA (math) in the input dtype, rows that see a key only: the error budget."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = q.shape[1] // k.shape[1]
    q = q[:, :, live_from:].detach().requires_grad_()
    k, v = (t.detach().requires_grad_() for t in (k, v))
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                             attn_mask=visible[live_from:], scale=scale)
    return torch.autograd.grad(out, (q, k, v), do[:, :, live_from:])


def _check(q, k, v, do, is_causal, causal_offset=0, dq_split=True, dq_tma=True, window=None, row_stats_tma=True,
           swizzle_heads=None, group_split=None, paired_tiles=False, num_stages=2):
    from flash_inductor.launch.hopper import hopper_attention_forward
    from flash_inductor.launch.hopper_bwd import (
        HopperBackwardConfig,
        hopper_attention_backward,
        hopper_backward_supported,
    )

    scale = q.shape[-1] ** -0.5
    assert hopper_backward_supported(do, q, k, v, None, 0.0, scale, "fast", window=window)
    visibility = Visibility(is_causal=is_causal, causal_offset=causal_offset, window=window)
    out, lse = hopper_attention_forward(q, k, v, scale=scale, visibility=visibility)
    dq, dk, dv = hopper_attention_backward(do, q, k, v, out, lse, scale=scale, visibility=visibility,
                                           config=HopperBackwardConfig(dq_split=dq_split, dq_tma=dq_tma,
                                                                       row_stats_tma=row_stats_tma,
                                                                       swizzle_heads=swizzle_heads,
                                                                       group_split=group_split,
                                                                       paired_tiles=paired_tiles,
                                                                       num_stages=num_stages))
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert dq.dtype == dk.dtype == dv.dtype == q.dtype
    visible = _visible(q.shape[2], k.shape[2], is_causal, causal_offset, window)
    live = visible.any(-1)
    live_from = int(live.long().argmax()) if live.any() else q.shape[2]
    # In every band tested here the rows that see no key come first; the rest are compared as one block.
    assert bool(live[live_from:].all())
    # Rows with no visible key: exactly zero gradient.
    assert (dq[:, :, :live_from] == 0).all()
    refs, colsum = _fp64_grads(q, k, v, do, scale, visible)
    if live_from == q.shape[2]:
        assert (dk == 0).all() and (dv == 0).all()
        return
    bases = _sdpa_grads(q, k, v, do, scale, visible, live_from)
    # The magnitude of the terms each gradient sums (the fp32 arithmetic floor): |dS_ij| <=
    # 2 P_ij |dO_i| |v_j| and a row's P sums to 1, so Σ_j |dS_ij| |k_j| <= 2 |dO| |v| max|k|;
    # a key's column of P sums to at most `colsum`, which bounds dk's and dv's sums the same way.
    norm = lambda t: t.double().norm(dim=-1).max().item()  # noqa: E731
    ds_row = 2 * norm(do) * norm(v)
    terms = {"dq": scale * ds_row * k.double().abs().max().item(),
             "dk": scale * ds_row * colsum * q.double().abs().max().item(),
             "dv": colsum * do.double().abs().max().item()}
    for name, g, ref, base in zip(("dq", "dk", "dv"), (dq[:, :, live_from:], dk, dv),
                                  (refs[0][:, :, live_from:], refs[1], refs[2]), bases):
        assert_close_to_ref(name, g, ref, base, terms=terms[name])


@needs_hopper
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("is_causal", (False, True))
@pytest.mark.parametrize("seq_q, seq_k", [(97, 97), (300, 300), (256, 700), (700, 256)])
def test_matches_fp64(dtype, head_dim, is_causal, seq_q, seq_k):
    _check(*_inputs(dtype, head_dim, 2, 3, 3, seq_q, seq_k), is_causal)


@needs_hopper
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", (64, 128))
# (left, right) as FlashAttention defines them, as in test_hopper_fwd: a causal sliding window, a
# band narrower than one 64-row tile on both sides, the diagonal alone (rows that see no key when
# L > S), a left side wider than S (no bound), and a right side alone.
@pytest.mark.parametrize("window", [(200, 0), (40, 40), (0, 0), (5000, 0), (300, 2)])
@pytest.mark.parametrize("seq_q, seq_k", [(1025, 1025), (300, 700), (700, 300)])
def test_sliding_windows_match_fp64(dtype, head_dim, window, seq_q, seq_k):
    _check(*_inputs(dtype, head_dim, 1, 2, 1, seq_q, seq_k), True, causal_offset=seq_k - seq_q, window=window)


@needs_hopper
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("window", [(100, -1), (64, 64)])
def test_sliding_windows_without_causal_masking(head_dim, window):
    # A left side alone and a symmetric band, GQA, L != S.
    _check(*_inputs(torch.bfloat16, head_dim, 2, 4, 2, 333, 513), False, window=window)


@needs_hopper
@pytest.mark.parametrize("dq_split", (True, False))
@pytest.mark.parametrize("dq_tma", (True, False))
@pytest.mark.parametrize("row_stats_tma", (True, False))
@pytest.mark.parametrize("head_dim", (64, 128))
def test_gqa_strided_views_and_dq_schemes(head_dim, dq_split, dq_tma, row_stats_tma):
    # dQ tiles past L (333 rows in 64-row tiles) are clipped by the TMA reduce, masked for the atomics;
    # the last tile's LSE and Δ rows past L are the next head's (TMA of the flat planes), replaced.
    _check(*_inputs(torch.bfloat16, head_dim, 2, 8, 2, 333, 513, transposed=True), True, dq_split=dq_split,
           dq_tma=dq_tma, row_stats_tma=row_stats_tma)


@needs_hopper
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dq_split, dq_tma, row_stats_tma, num_stages",
                         [(True, True, True, 2), (False, True, True, 3), (True, False, False, 2), (False, False, True, 2)])
# An odd and an even count of query tiles a key block (the odd walk's last tile goes alone), L != S
# both ways, GQA, a partial last tile, a sliding window's short walks, and a group split.
@pytest.mark.parametrize("is_causal, window, seq_q, seq_k, group_split",
                         [(False, None, 333, 513, None), (True, None, 300, 700, None), (True, None, 512, 512, 2),
                          (True, (200, 0), 1025, 1025, None), (False, (64, 64), 700, 300, None)])
def test_paired_tiles_match_fp64(dtype, dq_split, dq_tma, row_stats_tma, num_stages, is_causal, window, seq_q, seq_k,
                                 group_split):
    """E 64's consumers walking their tiles two an iteration (HopperBackwardConfig.paired_tiles)."""
    offset = seq_k - seq_q if window is not None and is_causal else 0
    _check(*_inputs(dtype, 64, 2, 4, 2, seq_q, seq_k), is_causal, causal_offset=offset, window=window,
           dq_split=dq_split, dq_tma=dq_tma, row_stats_tma=row_stats_tma, num_stages=num_stages, paired_tiles=True,
           group_split=group_split)


def test_paired_tiles_need_head_dim_64():
    """At E 128 a pair of tiles runs out of registers: an explicit config asking for it is refused
    before anything launches, naming the field and the fix."""
    from flash_inductor.launch.hopper_bwd import HopperBackwardConfig, hopper_attention_backward

    q, k, v, do = (torch.zeros(1, 2, 128, 128, dtype=torch.bfloat16) for _ in range(4))
    lse = torch.zeros(1, 2, 128)
    with pytest.raises(ValueError, match=r"paired_tiles=True\) needs head dim 64.*use paired_tiles=False"):
        hopper_attention_backward(do, q, k, v, q, lse, visibility=Visibility(is_causal=True),
                                  config=HopperBackwardConfig(paired_tiles=True))


@needs_hopper
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("is_causal", (False, True))
@pytest.mark.parametrize("swizzle_heads, group_split", [(1, 1), (3, 1), (4, 1), (None, 2), (5, 2), (None, 4)])
def test_grid_orders_and_group_splits(head_dim, is_causal, swizzle_heads, group_split):
    # Grid orders and GQA group splits forced, whatever the defaults pick for the shape (so small a
    # grid would always split the whole group). B·H_KV = 6 (batch, KV head)s of a 4-head group,
    # walked by 1, 2 or 4 CTAs per key block, so 6, 12 or 24 grid rows: one row at a time, groups
    # of 3, of 4 and 2 (a short last group), of 5, 5 and 2. Split, dK and dV are fp32 partial sums
    # added afterwards. GQA 4:1, L != S, a partial last key block and query tile.
    _check(*_inputs(torch.bfloat16, head_dim, 3, 8, 2, 333, 513), is_causal, swizzle_heads=swizzle_heads,
           group_split=group_split)


@needs_hopper
def test_a_group_split_must_divide_the_group():
    from flash_inductor.launch.hopper import hopper_attention_forward
    from flash_inductor.launch.hopper_bwd import HopperBackwardConfig, hopper_attention_backward

    q, k, v, do = _inputs(torch.bfloat16, 64, 1, 6, 2, 128, 128)
    out, lse = hopper_attention_forward(q, k, v, visibility=Visibility(is_causal=True))
    with pytest.raises(ValueError, match="group_split=2 does not divide the GQA group"):
        hopper_attention_backward(do, q, k, v, out, lse, visibility=Visibility(is_causal=True),
                                  config=HopperBackwardConfig(group_split=2))


def test_the_parts_are_summed_in_order():
    """The split backward's dK and dV: its (2, parts, ...) fp32 partial sums added in part order
    and cast (kernels/partial_sums.py, the interpreter on a CPU), a length that is no multiple of
    the block."""
    from helpers import DEVICE

    from flash_inductor.launch.hopper_bwd import _sum_parts_into

    gen = torch.Generator().manual_seed(7)
    parts = torch.randn(2, 3, 1, 2, 333, 64, generator=gen).to(DEVICE)
    dv, dk = (torch.empty(1, 2, 333, 64, dtype=torch.float16, device=DEVICE) for _ in range(2))
    _sum_parts_into(parts, dv, dk)
    for plane, got in ((0, dv), (1, dk)):
        want = (parts[plane, 0] + parts[plane, 1] + parts[plane, 2]).to(torch.float16)
        assert torch.equal(got, want)


def test_group_split_fills_one_wave():
    """A GQA grid under one wave of CTAs shares each group's query heads among CTAs until it
    fills one (or the group is spent); a grid that already does, or no GQA, stays whole."""
    from flash_inductor.launch.hopper_bwd import group_split_for

    assert group_split_for(4, 32 * 4, 132) == 2    # HF Llama E 128, B 1, 4k: 128 CTAs, 1.3-1.7x
    assert group_split_for(4, 32 * 8, 132) == 1    # B 2: 256 CTAs, splitting gained nothing
    assert group_split_for(4, 16 * 16, 132) == 1   # E 64, B 4, 2k: splitting lost
    assert group_split_for(1, 8, 132) == 1         # no GQA
    assert group_split_for(6, 20, 132) == 6        # not even the whole group fills a wave
    assert group_split_for(6, 60, 132) == 3        # 2 does not fill it, 3 (a divisor) does


@needs_hopper
@pytest.mark.parametrize("head_dim", (64, 128))
def test_rows_that_see_no_key(head_dim):
    # Lower-right causal with L > S: the first L - S rows see no key; their dq is exactly 0.
    _check(*_inputs(torch.bfloat16, head_dim, 1, 2, 1, 400, 150), True, causal_offset=150 - 400)


@needs_hopper
def test_length_one():
    _check(*_inputs(torch.float16, 64, 3, 2, 2, 1, 1), True)


@needs_hopper
def test_declines_what_it_does_not_implement():
    from flash_inductor.launch.hopper_bwd import hopper_backward_unsupported_reason

    q, k, v, _ = _inputs(torch.bfloat16, 64, 1, 2, 2, 64, 64)
    assert hopper_backward_unsupported_reason(q, k, v, None, 0.0, None, "fast") is None
    assert hopper_backward_unsupported_reason(q, k, v, None, 0.0, None, "stable") is None  # the one-pass ops
    assert "schedule" in hopper_backward_unsupported_reason(q, k, v, None, 0.0, None, "accurate")
    assert "mask" in hopper_backward_unsupported_reason(q, k, v, torch.ones(64, 64, dtype=torch.bool, device="cuda"),
                                                        0.0, None, "fast")
    assert "dropout" in hopper_backward_unsupported_reason(q, k, v, None, 0.1, None, "fast")


def test_declines_off_hopper_without_touching_a_gpu():
    """Runs anywhere: CPU tensors are declined with a reason, before any CUDA or Gluon call."""
    from flash_inductor.launch.hopper_bwd import hopper_backward_supported, hopper_backward_unsupported_reason

    q = torch.randn(1, 2, 64, 64, dtype=torch.bfloat16)
    assert hopper_backward_unsupported_reason(q, q, q, None, 0.0, None, "fast") == "not on a CUDA device"
    assert not hopper_backward_supported(q, q, q, q, None, 0.0, None, "fast")


@pytest.mark.parametrize("seq_q", [1, 97, 256, 333])
def test_row_statistics_planes_start_rows_on_16_bytes(seq_q):
    """Runs anywhere: the LSE and Δ planes the loader's TMA reads are (B·Hq, L) matrices with one
    row stride, a multiple of 4 fp32 (a box starting at an unaligned element faulted on the
    H200), holding the plane's values; aligned planes are passed as views, not copied."""
    from flash_inductor.launch.hopper_bwd import row_stats_descriptor, row_stats_planes

    lse, delta = torch.randn(2, 3, seq_q), torch.randn(2, 3, seq_q)
    planes = row_stats_planes((lse, delta), 6, seq_q)
    assert planes[0].stride() == planes[1].stride()
    assert planes[0].stride(0) % 4 == 0 and planes[0].stride(1) == 1
    for plane, source in zip(planes, (lse, delta)):
        assert plane.shape == (6, seq_q) and plane.data_ptr() % 16 == 0
        assert torch.equal(plane, source.view(6, seq_q))
        assert (plane.data_ptr() == source.data_ptr()) == (seq_q % 4 == 0)
    desc = row_stats_descriptor(planes[0], 64)
    assert desc.shape == [6, seq_q] and desc.strides == [planes[0].stride(0), 1] and desc.block_shape == [1, 64]


def test_descriptors_use_the_default_layout_of_their_box():
    """Runs anywhere: the memoised layout is Gluon's default for the descriptor's box."""
    from triton.experimental.gluon import language as gl

    from flash_inductor.launch.hopper import tma_descriptor

    for dtype, gl_dtype in ((torch.bfloat16, gl.bfloat16), (torch.float32, gl.float32)):
        t = torch.zeros(2, 4, 128, 64, dtype=dtype)
        for rows, cols in ((64, None), (128, 32)):
            desc = tma_descriptor(t, rows, cols)
            box = [1, 1, rows, cols or 64]
            assert desc.block_shape == box
            assert desc.layout == gl.NVMMASharedLayout.get_default_for(box, gl_dtype)

def test_register_plan_fills_the_register_file():
    """Two consumer warpgroups and the loader's: the entry cap and the setmaxnreg split stay
    within 64K registers."""
    from flash_inductor.launch.hopper_bwd import HopperBackwardConfig, default_config

    for cfg in (default_config(64, False), default_config(128, True), HopperBackwardConfig(dq_split=False)):
        assert cfg.maxnreg * 128 * 3 <= 65536
        assert cfg.consumer_regs * 128 * 2 + cfg.loader_regs * 128 <= 65536
        assert cfg.maxnreg % 8 == 0 and cfg.consumer_regs % 8 == 0
        assert cfg.block_n == 128


def test_grid_order_follows_the_measured_winner():
    """The shapes timed on the H200 (132 SMs) get the order that won there: every head's first
    key block first for causal grids of 256-1024 CTAs (HF Llama's GQA backward), one head at a
    time for bench_attention's grid (2048 CTAs and more) and for every grid without causal masking."""
    from flash_inductor.launch.hopper_bwd import swizzle_heads_for

    def order(batch, heads_kv, seq, causal=True):
        return swizzle_heads_for(batch * heads_kv, -(-seq // 128), 132, pure_causal=causal)

    assert order(2, 4, 4096) == 8     # Llama E 128, 1.34x
    assert order(4, 4, 2048) == 16    # Llama E 64, 1.46x
    assert order(8, 4, 4096) == 32    # 1.03x
    assert order(4, 16, 4096) == 1    # grid E 128: 0.93x
    assert order(1, 32, 16384) == 1   # grid E 64: 0.97x
    assert order(2, 4, 4096, causal=False) == 1  # 0.98x


# ----------------------------------------------------------------------------- the op's choice

def _count_hopper_backwards(monkeypatch):
    from flash_inductor.launch import hopper_bwd

    return spy_on(monkeypatch, hopper_bwd, "hopper_attention_backward")


@needs_hopper
@pytest.mark.parametrize("compiled", (False, True), ids=("eager", "compiled"))
@pytest.mark.parametrize("head_dim", (64, 128))
def test_the_op_runs_the_fast_backward_on_hopper(monkeypatch, compiled, head_dim):
    """flash_attention(schedule="fast") takes the Gluon backward on an sm_90 GPU, eagerly and under
    torch.compile (through its opaque op), with gradients inside the tolerance rule; the default
    schedule reaches it through the one-pass ops (tests/unit/test_one_pass.py covers their values)."""
    from flash_inductor import flash_attention

    calls = _count_hopper_backwards(monkeypatch)
    q, k, v, do = _inputs(torch.bfloat16, head_dim, 2, 4, 2, 300, 300)
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    fn = (lambda *a, schedule: flash_attention(*a, is_causal=True, enable_gqa=True, schedule=schedule))
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(fn, fullgraph=True)
    grads = torch.autograd.grad(fn(q, k, v, schedule="fast"), (q, k, v), do)
    assert calls == [True]
    scale = head_dim ** -0.5
    visible = _visible(300, 300, True, 0)
    refs, colsum = _fp64_grads(q, k, v, do, scale, visible)
    bases = _sdpa_grads(q, k, v, do, scale, visible, 0)
    norm = lambda t: t.double().norm(dim=-1).max().item()  # noqa: E731
    ds_row = 2 * norm(do) * norm(v)
    terms = (scale * ds_row * k.double().abs().max().item(), scale * ds_row * colsum * q.double().abs().max().item(),
             colsum * do.double().abs().max().item())
    for name, g, ref, base, term in zip(("dq", "dk", "dv"), grads, refs, bases, terms):
        assert_close_to_ref(name, g, ref, base, terms=term)
    # The default schedule reaches the Gluon backward too, through the one-pass ops.
    torch.autograd.grad(fn(q, k, v, schedule="stable"), (q, k, v), do)
    assert calls == [True, True]


@needs_hopper
def test_unaligned_grad_out_falls_back_to_triton(monkeypatch):
    """A dO whose base is not 16-byte aligned passes the static check but not TMA's: the Hopper
    branch then runs the Triton backward, with gradients inside the tolerance rule."""
    from flash_inductor import flash_attention

    calls = _count_hopper_backwards(monkeypatch)
    q, k, v, _ = _inputs(torch.float16, 128, 1, 2, 2, 256, 256)
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    storage = torch.randn(2 * 256 * 128 + 1, device="cuda", dtype=torch.float16)
    do = storage[1:].view(1, 2, 256, 128)  # 2-byte offset
    grads = torch.autograd.grad(flash_attention(q, k, v, schedule="fast"), (q, k, v), do)
    assert calls == []
    scale = 128 ** -0.5
    visible = _visible(256, 256, False, 0)
    refs, _ = _fp64_grads(q, k, v, do, scale, visible)
    bases = _sdpa_grads(q, k, v, do, scale, visible, 0)
    for name, g, ref, base in zip(("dq", "dk", "dv"), grads, refs, bases):
        assert_close_to_ref(name, g, ref, base)


def test_the_static_choice_on_a_mocked_hopper(monkeypatch):
    """Runs anywhere: with the capability and Gluon mocked, the backward's static check takes the
    `fast` calls the kernel implements (E 64 and 128, causal or not) and names the reason
    for each one it declines."""
    from flash_inductor.launch import hopper, hopper_bwd

    t = mock_hopper(monkeypatch)
    reason = hopper_bwd.hopper_backward_unsupported_reason
    q, kv = t(2, 8, 64, 128), t(2, 2, 64, 128)
    q64, kv64 = t(2, 8, 64, 64), t(2, 2, 64, 64)
    assert reason(q, kv, kv, None, 0.0, None, "fast", is_causal=False) is None
    assert reason(q64, kv64, kv64, None, 0.0, None, "fast", is_causal=True) is None
    # E 64 without causal masking too, since the LSE and Δ rows come through the loader (the Triton
    # `fast` backward was 1-6 % faster there before, now 7-13 % slower; docs/hopper_backward.md).
    assert reason(q64, kv64, kv64, None, 0.0, None, "fast", is_causal=False) is None
    # `stable` takes it only through the one-pass ops (ops/one_pass.py), at every head dim once
    # they are routed; `accurate` keeps Triton.
    assert reason(q64, kv64, kv64, None, 0.0, None, "stable", is_causal=False) is None
    assert reason(q, kv, kv, None, 0.0, None, "stable") is None
    assert "schedule 'accurate'" in reason(q, kv, kv, None, 0.0, None, "accurate")
    assert "mask" in reason(q, kv, kv, t(2, 8, 64, 64, dtype=torch.bool), 0.0, None, "fast")
    assert "dropout" in reason(q, kv, kv, None, 0.1, None, "fast")
    assert reason(q, kv, kv, None, 0.0, None, "fast", window=(16, 0)) is None
    assert reason(q64, kv64, kv64, None, 0.0, None, "fast", is_causal=True, window=(16, 16)) is None
    assert reason(q, kv, kv, None, 0.0, None, "fast", block_sizes=(64, 128)) == hopper.BLOCK_SPARSE
    assert reason(q, kv, kv, None, 0.0, None, "fast", block_sizes=(128, 256)) is None
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert reason(q, kv, kv, None, 0.0, None, "fast") == hopper_bwd.DETERMINISTIC


def test_the_op_dispatches_to_the_hopper_call_it_is_given(monkeypatch):
    """Runs anywhere: where the static check passes, the op's backward hands the call to the Hopper
    entry with its arguments and returns no mask gradient; where it does not, the Triton launcher
    gets the call unchanged."""
    from flash_inductor.launch import hopper_bwd
    from flash_inductor.ops import attention as ops_attention

    q, k, v, do = (torch.randn(1, 2, 8, 64) for _ in range(4))
    lse = torch.zeros(1, 2, 8)
    seen = []

    def hopper_call(*args):
        call = args[7]
        seen.append(("hopper", (call.visibility.is_causal, call.visibility.causal_offset, call.scale,
                                call.schedule.name, *call.visibility.window)))
        return q * 2, k * 3, v * 4

    def triton_call(*args, **kwargs):
        visibility, scale = kwargs["visibility"], args[10]
        seen.append(("triton", (visibility.is_causal, visibility.causal_offset, scale), visibility.window))
        return q, k, v, q.new_empty(0)
    monkeypatch.setattr(ops_attention.launch, "attention_backward", triton_call)
    monkeypatch.setattr(hopper_bwd, "hopper_backward_unsupported_reason", lambda *a, **kw: None)
    describe = ops_attention.describe_call
    dq, dk, dv, dmask = ops_attention._kernel_backward(do, q, k, v, None, q, lse, None, None,
                                                       describe(q, k, v, 0.0, True, 3, 0.125, "fast"), False,
                                                       hopper_call=hopper_call)
    assert seen == [("hopper", (True, 3, 0.125, "fast", -1, -1))]
    assert torch.equal(dq, q * 2) and torch.equal(dk, k * 3) and torch.equal(dv, v * 4) and dmask.numel() == 0
    monkeypatch.setattr(hopper_bwd, "hopper_backward_unsupported_reason", lambda *a, **kw: "a reason")
    ops_attention._kernel_backward(do, q, k, v, None, q, lse, None, None,
                                   describe(q, k, v, 0.0, False, 0, 0.125, "stable", 4, 0), False,
                                   hopper_call=hopper_call)
    assert seen[1] == ("triton", (False, 0, 0.125), (4, 0))
    # The window reaches the Hopper call as the op's two ints.
    monkeypatch.setattr(hopper_bwd, "hopper_backward_unsupported_reason", lambda *a, **kw: None)
    ops_attention._kernel_backward(do, q, k, v, None, q, lse, None, None,
                                   describe(q, k, v, 0.0, True, 0, 0.125, "fast", 4, 0), False, hopper_call=hopper_call)
    assert seen[2] == ("hopper", (True, 0, 0.125, "fast", 4, 0))


def test_soft_capped_calls_take_the_hopper_calls(monkeypatch):
    """Runs anywhere: a soft-capped call whose static checks pass goes to the Hopper forward and
    backward entries (not the Triton launchers), with its cap in the call record they get."""
    from flash_inductor.launch import hopper, hopper_bwd
    from flash_inductor.ops import attention as ops_attention

    q, k, v, do = (torch.randn(1, 2, 8, 64) for _ in range(4))
    lse = torch.zeros(1, 2, 8)
    seen = []

    def refuse(*args, **kwargs):
        raise AssertionError("a soft-capped call reached the Triton launcher")
    monkeypatch.setattr(ops_attention.launch, "attention_forward", refuse)
    monkeypatch.setattr(ops_attention.launch, "attention_backward", refuse)
    monkeypatch.setattr(hopper, "hopper_forward_unsupported_reason", lambda *a, **kw: None)
    monkeypatch.setattr(hopper, "tma_unsupported_reason", lambda *a, **kw: None)
    monkeypatch.setattr(hopper_bwd, "hopper_backward_unsupported_reason", lambda *a, **kw: None)
    monkeypatch.setattr(hopper_bwd, "backward_tma_unsupported_reason", lambda *a, **kw: None)
    call = ops_attention.describe_call(q, k, v, 0.0, True, 0, 0.125, "fast", softcap=2.5)
    out, _ = ops_attention._kernel_forward(q, k, v, None, None, call,
                                           hopper_call=lambda *a, **kw: seen.append(("fwd", a[3].softcap)) or (q, lse))
    ops_attention._kernel_backward(do, q, k, v, None, out, lse, None, None, call, False,
                                   hopper_call=lambda *a, **kw: seen.append(("bwd", a[7].softcap)) or (q, k, v))
    assert seen == [("fwd", 2.5), ("bwd", 2.5)]


@needs_hopper
@pytest.mark.parametrize("schedule", ("fast", "stable"))
@pytest.mark.parametrize("is_causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=("bf16", "fp16"))
def test_soft_capped_forward_and_backward_on_hopper(monkeypatch, dtype, head_dim, is_causal, schedule):
    """flash_attention(softcap=c) runs the Gluon forward and backward (`stable` through the one-pass
    ops), with out and the gradients inside the tolerance rule against the fp64 definition
    (tests/variant_refs.py), the baseline being that formula in the input dtype. Logits reach about
    three times the cap, so most tanh saturate and the slope matters; odd lengths exercise the masks."""
    from flash_inductor import flash_attention
    from flash_inductor.launch import hopper
    from variant_refs import variant_reference

    forwards = spy_on(monkeypatch, hopper, "hopper_attention_forward")
    backwards = _count_hopper_backwards(monkeypatch)
    cap, seq = 8.0, 333
    q, k, v, do = _inputs(dtype, head_dim, 2, 4, 2, seq, seq, seed=3)
    q = (q * 3).detach().requires_grad_(True)
    k, v = (t.detach().requires_grad_(True) for t in (k, v))
    out = flash_attention(q, k, v, is_causal=is_causal, enable_gqa=True, softcap=cap, schedule=schedule)
    grads = torch.autograd.grad(out, (q, k, v), do)
    assert forwards == [is_causal] and backwards == [is_causal]
    visible = _visible(seq, seq, is_causal, 0)

    def reference(precision):
        leaves = [t.detach().to(precision).requires_grad_(True) for t in (q, k, v)]
        o = variant_reference(*leaves, softcap=cap, visible=visible)
        return (o, *torch.autograd.grad(o, leaves, do.to(precision)))
    refs, bases = reference(torch.float64), reference(dtype)
    for name, ours, ref, base in zip(("out", "dq", "dk", "dv"), (out, *grads), refs, bases):
        assert_close_to_ref(name, ours, ref, base)
