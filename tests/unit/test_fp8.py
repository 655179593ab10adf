"""The `fp8` schedule: its quantisation, its forward kernel, its backward and its tuning entries.

On CPU the kernels run in Triton's interpreter, which rounds to e4m3 through an fp32 emulation
(``attn_fwd_fp8._round_to_e4m3``); on a GPU the hardware's cast runs. Accuracy is measured as
the output's SQNR against the float64 reference, the schedule's stated contract
(``schedules.FP8_SQNR_BUDGET_DB``), and against what the same roundings cost when done exactly
in float64 (``_emulated_sqnr``), so a kernel that merely clears the budget while losing accuracy
it should keep still fails.
"""

from __future__ import annotations

import math

import pytest
import torch

from flash_inductor import launch
from flash_inductor.launch import fp8 as launch_fp8
from flash_inductor.tuning import cache
from flash_inductor.tuning.buckets import Bucket
from flash_inductor.autotune.plan import Grid, make_plan
from flash_inductor.schedules import FP8_SQNR_BUDGET_DB, SCHEDULES
from helpers import (DEVICE, ON_CUDA, assert_close_to_ref, assert_dead_rows_exact, attention_ref, launch_visibility,
                     make_mask, make_qkv, randn, ref_forward_backward)

F8 = torch.float8_e4m3fn
DTYPES = (torch.float16, torch.bfloat16) if ON_CUDA else (torch.float16, torch.float32)
needs_fp8_gpu = pytest.mark.skipif(
    ON_CUDA and torch.cuda.get_device_capability() < launch_fp8.FP8_MIN_CAPABILITY,
    reason="fp8 tensor cores (compute capability 8.9+) needed",
)


def _pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    exponent = torch.floor(torch.log2(448.0 / amax)).clamp(-126, 126)
    return torch.exp2(torch.where(amax == 0, torch.zeros_like(exponent), exponent))


def _quantized(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x rounded to e4m3 with one power-of-two scale per slice along ``dim``, back in float64."""
    scale = _pow2_scale(x.double().abs().amax(dim, keepdim=True))
    return (x.double() * scale).to(F8).double() / scale


def _sqnr(actual: torch.Tensor, truth: torch.Tensor) -> float:
    noise = (actual.double().cpu() - truth.double().cpu()).square().sum().item()
    return math.inf if noise == 0 else 10 * math.log10(truth.double().square().sum().item() / noise)


def _emulated_sqnr(q, k, v, mask, causal_offset, scale) -> float:
    """SQNR of attention on Q, K (per token) and V (per channel) rounded as the kernel rounds them,
    everything else exact: what the operand roundings alone cost."""
    truth, _ = attention_ref(q.cpu(), k.cpu(), v.cpu(), None if mask is None else mask.cpu(),
                             causal_offset=causal_offset, scale=scale)
    rounded, _ = attention_ref(_quantized(q.cpu(), -1), _quantized(k.cpu(), -1), _quantized(v.cpu(), -2),
                               None if mask is None else mask.cpu(), causal_offset=causal_offset, scale=scale)
    return _sqnr(rounded, truth)


def _forward(q, k, v, mask=None, causal_offset=None, scale=None, schedule="fp8", dropout=(None, 0.0)):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return launch.attention_forward(q, k, v, mask, dropout[0], dropout[1], scale, schedule,
                                    visibility=launch_visibility(causal_offset))


CASES = {
    "plain": dict(shape=(1, 2, 2, 70, 90, 64, 64)),
    "gqa_causal": dict(shape=(1, 4, 2, 50, 50, 32, 32), causal_offset=0),
    "bottom_right_ragged_head": dict(shape=(2, 2, 1, 33, 47, 40, 24), causal_offset=14),
    "bool_mask": dict(shape=(1, 2, 2, 40, 64, 64, 64), mask="bool"),
    "float_mask_finfo_min": dict(shape=(1, 2, 2, 40, 64, 64, 64), mask="finfo_min"),
}


@needs_fp8_gpu
@pytest.mark.launches_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_fp8_forward_meets_its_budget_and_the_roundings_cost(name, dtype):
    case = CASES[name]
    batch, hq, hkv, lq, lk, e, ev = case["shape"]
    q, k, v = make_qkv(batch, hq, hkv, lq, lk, e, ev, dtype, DEVICE, seed=3)
    mask = make_mask(case.get("mask", "none"), batch, hq, lq, lk, dtype, DEVICE)
    offset = case.get("causal_offset")
    out, lse = _forward(q, k, v, mask, offset)
    truth, truth_lse = attention_ref(q.cpu(), k.cpu(), v.cpu(), None if mask is None else mask.cpu(),
                                     causal_offset=offset)
    assert out.dtype == dtype and out.shape == (batch, hq, lq, ev) and lse.dtype == torch.float32
    measured = _sqnr(out, truth)
    assert measured >= FP8_SQNR_BUDGET_DB, f"SQNR {measured:.1f} dB"
    # P's rounding (relative to the running max, in blocks) comes on top of the operands'; 1.5 dB
    # is its share on these shapes (the emulation alone gives 25-27 dB here).
    expected = _emulated_sqnr(q, k, v, mask, offset, e ** -0.5)
    assert measured >= expected - 1.5, f"SQNR {measured:.1f} dB, operand roundings alone {expected:.1f} dB"
    visible = truth_lse.isfinite()
    lse_error = (lse.double().cpu() - truth_lse)[visible].abs().max().item()
    assert lse_error < 0.1, lse_error  # the LSE of e4m3-rounded scores: |Δs| ~ 2⁻⁴·|s|
    assert_dead_rows_exact(q.cpu(), k.cpu(), None if mask is None else mask.cpu(), offset, out.cpu(), lse.cpu())


@needs_fp8_gpu
@pytest.mark.launches_kernels
def test_fp8_rows_with_no_visible_key_are_exactly_zero():
    q, k, v = make_qkv(1, 2, 2, 24, 40, 32, 32, torch.float16, DEVICE, seed=5)
    mask = make_mask("bool_dead_rows", 1, 2, 24, 40, torch.float16, DEVICE)
    out, lse = _forward(q, k, v, mask)
    assert out.isfinite().all()
    assert assert_dead_rows_exact(q.cpu(), k.cpu(), mask.cpu(), None, out.cpu(), lse.cpu()) > 0


@needs_fp8_gpu
@pytest.mark.launches_kernels
@pytest.mark.parametrize("seq_q,seq_k", [(12, 0), (0, 12)])
def test_fp8_empty_sequences(seq_q, seq_k):
    """No key: every row is empty (output 0, LSE -inf); no query: empty outputs. Nothing to quantise."""
    q, k, v = make_qkv(1, 2, 2, seq_q, seq_k, 32, 32, torch.float16, DEVICE, seed=17)
    out, lse = _forward(q, k, v)
    assert out.shape == (1, 2, seq_q, 32) and lse.shape == (1, 2, seq_q)
    assert (out == 0).all() and lse.isneginf().all()


@needs_fp8_gpu
@pytest.mark.launches_kernels
@pytest.mark.parametrize("mults", [(30.0, 30.0, 1.0), (1.0, 1.0, 1e4), (1e-3, 1e-3, 1e-3)], ids=str)
def test_fp8_extreme_magnitudes_stay_finite_and_scaled(mults):
    """Logits of order 1e3, |V| = 1e4 in fp16 and tiny inputs: the per-token and per-channel scales
    absorb the magnitude, so the output is finite and as accurate as at unit scale (except huge
    logits, where attention is one-hot and only finiteness and the argmax matter)."""
    q, k, v = make_qkv(1, 2, 2, 48, 48, 64, 64, torch.float16, DEVICE, seed=7,
                       q_mult=mults[0], k_mult=mults[1], v_mult=mults[2])
    out, _ = _forward(q, k, v)
    truth, _ = attention_ref(q.cpu(), k.cpu(), v.cpu())
    assert out.isfinite().all()
    if mults[0] < 10:
        assert _sqnr(out, truth) >= FP8_SQNR_BUDGET_DB
    else:
        # One-hot attention: each row takes the value of its largest logit. The logits of Q and K as
        # the kernel rounds them decide which key that is; rows whose two largest are within 20 of
        # each other (the runner-up's weight above e^-20, and fp32's rounding of logits near 1e3
        # could swap a closer pair) are left out. The key a row took is the one whose value is
        # nearest its output.
        logits = _quantized(q.cpu(), -1) @ _quantized(k.cpu(), -1).transpose(-2, -1) * q.shape[-1] ** -0.5
        top = logits.topk(2, dim=-1)
        clear = top.values[..., 0] - top.values[..., 1] > 20
        assert clear.float().mean() > 0.75  # most rows are one-hot: the check is not vacuous
        taken = torch.cdist(out.double().cpu(), v.double().cpu()).argmin(-1)
        assert torch.equal(taken[clear], top.indices[..., 0][clear]), (taken != top.indices[..., 0])[clear].sum()


@needs_fp8_gpu
@pytest.mark.launches_kernels
def test_fp8_dropout_keeps_the_16_bit_draw():
    q, k, v = make_qkv(1, 2, 2, 40, 56, 32, 32, torch.float16, DEVICE, seed=9)
    seed = torch.tensor([1234], dtype=torch.int64, device=DEVICE)
    ours, _ = _forward(q, k, v, dropout=(seed, 0.3))
    stable, _ = _forward(q, k, v, schedule="stable", dropout=(seed, 0.3))
    # The same keep mask: the fp8 output differs from the 16-bit one by rounding only.
    assert _sqnr(ours, stable.double()) >= FP8_SQNR_BUDGET_DB


@needs_fp8_gpu
@pytest.mark.launches_kernels
def test_fp8_backward_is_the_stable_backward_of_the_16_bit_forward():
    q, k, v = make_qkv(1, 2, 1, 37, 45, 32, 32, torch.float16, DEVICE, seed=11)
    dout = randn((1, 2, 37, 32), torch.float16, DEVICE, seed=12)
    out8, lse8 = _forward(q, k, v, causal_offset=8)
    out16, lse16 = _forward(q, k, v, causal_offset=8, schedule="stable")
    args = (None, 0.0, 32 ** -0.5)  # seed, dropout_p, scale
    visibility = launch_visibility(8)
    ours = launch.attention_backward(dout, q, k, v, None, out8, lse8, None, *args, "fp8", False, visibility=visibility)
    stable = launch.attention_backward(dout, q, k, v, None, out16, lse16, None, *args, "stable", False,
                                       visibility=visibility)
    for name, a, b in zip(("dq", "dk", "dv"), ours, stable):
        assert torch.equal(a, b), name


@pytest.mark.launches_kernels
@pytest.mark.parametrize("per_row", [True, False], ids=["rows", "columns"])
def test_quantize_matches_torch_e4m3_and_uses_powers_of_two(per_row):
    x = randn((2, 3, 37, 40), torch.float16, DEVICE, seed=13)
    x[0, 0, 5] *= 300.0  # one loud token / the columns it reaches
    x[1, 2, :, 7] = 0.0  # an all-zero column (and zeros in every row)
    x8, dequant = launch_fp8._quantize(x, per_row=per_row)
    dim = -1 if per_row else -2
    scale = _pow2_scale(x.double().abs().amax(dim, keepdim=True))
    expected = (x.double() * scale).to(F8)
    assert torch.equal(x8.cpu().view(torch.uint8), expected.cpu().view(torch.uint8))
    expected_dequant = (1.0 / scale).reshape(6, -1).float()
    assert torch.equal(dequant.cpu(), expected_dequant.cpu())
    assert (torch.log2(dequant) == torch.round(torch.log2(dequant))).all()
    assert x8.float().abs().max() <= 448.0


def test_fp8_needs_fp8_tensor_cores(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"schedule='fp8' needs fp8 tensor cores.*A100 is 8\.0.*'stable'"):
        launch_fp8.check_fp8_device(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    launch_fp8.check_fp8_device(torch.device("cuda"))
    launch_fp8.check_fp8_device(torch.device("cpu"))  # the reference path runs anywhere


def test_fp8_on_cpu_runs_the_reference():
    """CPU tensors take the float32 reference whatever the schedule: a model using `fp8` still
    runs on a laptop."""
    import flash_inductor

    q, k, v = make_qkv(1, 2, 2, 16, 16, 32, 32, torch.float32, "cpu", seed=15)
    out = flash_inductor.flash_attention(q, k, v, schedule="fp8")
    assert torch.allclose(out, torch.nn.functional.scaled_dot_product_attention(q, k, v), atol=1e-6)


# ------------------------------------------------------------------------------------------
# Tuning: the fp8 forward is a kernel family of its own
# ------------------------------------------------------------------------------------------


def test_fp8_forward_entries_belong_to_their_own_kernel_family():
    fwd = {"configs": {"forward": {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 2}}}
    assert cache.kernel_family(Bucket.parse("fp8/fp16/e64/none/s1024/forward")) == "fp8_forward"
    assert cache.kernel_family(Bucket.parse("stable/fp16/e64/none/s1024/forward")) == "forward"
    assert "attn_fwd_fp8:_attn_fwd_fp8" in cache.KERNEL_FAMILIES["fp8_forward"]
    assert all(not spec.startswith("attn_fwd_fp8:") for f in ("forward", "backward") for spec in cache.KERNEL_FAMILIES[f])
    table = cache.TuningTable.for_current_code("fake-gpu_sm90_132sm", {
        "fp8/bf16/e64/none/s1024/forward": fwd, "stable/fp16/e64/none/s1024/forward": fwd})
    entries = dict(table.entries)
    assert entries["fp8/bf16/e64/none/s1024/forward"]["kernel"] == cache.family_identity("fp8_forward")
    entries["fp8/bf16/e64/none/s1024/forward"] = {**entries["fp8/bf16/e64/none/s1024/forward"],
                                                  "kernel": "0" * 16}  # an older fp8 kernel
    view = cache.TableView([cache.TuningTable(**{**vars(table), "entries": entries})])
    assert view.lookup(Bucket.parse("fp8/bf16/e64/none/s1024/forward")) is None
    assert view.lookup(Bucket.parse("stable/fp16/e64/none/s1024/forward")) is not None


def test_fp8_tunes_forward_buckets_only_with_their_own_kernels():
    grid = Grid(tuple(SCHEDULES), ("bf16",), (64,), ("none",), (4096,))
    plan = {p.bucket.key(): p for p in make_plan(grid)}
    assert "fp8/bf16/e64/none/s4096/backward" not in plan  # launches look up `stable`'s backward
    assert plan["fp8/bf16/e64/none/s4096/forward"].kind == "sweep"  # its own kernel sweeps for itself
    assert plan["fast/bf16/e64/none/s4096/forward"].kind == "copy"


@needs_fp8_gpu
def test_fp8_under_torch_compile_matches_eager():
    """The fp8 launcher's quantisation (allocations, a transposed view, V's column maxima) traced
    into a graph by Inductor: the output keeps eager's SQNR (the same kernels; Inductor may
    reduce V's maxima in another order, which cannot change a power-of-two scale) and the
    gradients, `stable`'s, meet the project's rule with eager as the baseline. On CPU both take
    the reference path."""
    import flash_inductor

    q, k, v = make_qkv(1, 2, 2, 64, 64, 64, 64, torch.float16, DEVICE, seed=21)
    dout = randn((1, 2, 64, 64), torch.float16, DEVICE, seed=22)
    golden = ref_forward_backward(q, k, v, causal_offset=0, grad_out=dout)

    def attend(q, k, v):
        return flash_inductor.flash_attention(q, k, v, is_causal=True, schedule="fp8")

    runs = []
    for fn in (attend, torch.compile(attend, fullgraph=True)):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        out = fn(*leaves)
        out.backward(dout)
        runs.append(dict(out=out, dq=leaves[0].grad, dk=leaves[1].grad, dv=leaves[2].grad))
    eager, compiled = runs
    assert _sqnr(compiled["out"], golden["out"]) >= min(FP8_SQNR_BUDGET_DB, _sqnr(eager["out"], golden["out"]) - 0.5)
    for name in ("dq", "dk", "dv"):
        assert_close_to_ref(f"{name} compiled", compiled[name], golden[name], eager[name], terms=golden["terms"][name])
