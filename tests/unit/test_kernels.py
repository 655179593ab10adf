"""The Triton kernels through their launchers, against the float64 reference.

On a GPU the kernels are compiled and run on CUDA tensors; without one (conftest sets
TRITON_INTERPRET=1) the same kernels run on CPU tensors through Triton's interpreter, with
16 x 16 tiles (tuning/configs.py). CPU shapes are kept small for the interpreter but still span
several tiles, ragged tails and the causal diagonal; the GPU grid adds long and wide shapes.

Every case checks forward (out, lse) and backward (dq, dk, dv, and dmask when asked) with the
project's tolerance rule (tests/helpers.py), plus exact zeros for rows that see no key.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Optional

import pytest
import torch

from torch.nn.attention import SDPBackend, sdpa_kernel

from flash_inductor import launch
from flash_inductor.ops.reference import reference_backward, reference_forward
from helpers import (
    DEVICE,
    ON_CUDA,
    assert_close_to_ref,
    assert_dead_rows_exact,
    dropout_keep,
    launch_visibility,
    lse_baseline,
    make_mask,
    make_qkv,
    max_abs_error,
    near_tied_qkv,
    randn,
    ref_forward_backward,
    sdpa_baseline,
    spy_on_launches,
)

# Every test here launches the kernels (on CPU through Triton's interpreter).
pytestmark = pytest.mark.launches_kernels

SCHEDULES = ("fast", "stable", "accurate")


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int = 1
    heads_q: int = 2
    heads_kv: int = 2
    seq_q: int = 37
    seq_k: int = 45
    head_dim: int = 24
    head_dim_v: int = 24
    mask: str = "none"  # a helpers.make_mask kind
    mask_dtype: Optional[torch.dtype] = None  # a float mask's dtype; None: the inputs' dtype
    causal: str = "none"  # none | top_left (offset 0) | bottom_right (offset S - L)
    noncontig: bool = False
    dropout_p: float = 0.0
    mask_grad: bool = False  # ask the backward for the float mask's gradient
    grad_lse: bool = False  # feed an upstream gradient for the LSE output
    scale: Optional[float] = None
    q_mult: float = 1.0
    k_mult: float = 1.0
    v_mult: float = 1.0
    dout_mult: float = 1.0

    @property
    def causal_offset(self) -> Optional[int]:
        return {"none": None, "top_left": 0, "bottom_right": self.seq_k - self.seq_q}[self.causal]


def _params(cases: dict) -> list:
    return [pytest.param(case, id=name) for name, case in cases.items()]


def run_case(case: Case, dtype: torch.dtype, device: str, schedule: str = "stable", seed: int = 0, configs=None):
    """Launch forward and backward (at ``configs``, else the launcher's own choice); return
    (ours, inputs) as dicts."""
    q, k, v = make_qkv(case.batch, case.heads_q, case.heads_kv, case.seq_q, case.seq_k, case.head_dim,
                       case.head_dim_v, dtype, device, seed=seed, noncontig=case.noncontig,
                       q_mult=case.q_mult, k_mult=case.k_mult, v_mult=case.v_mult)
    mask = make_mask(case.mask, case.batch, case.heads_q, case.seq_q, case.seq_k, case.mask_dtype or dtype, device,
                     seed=seed + 1)
    dout = randn((case.batch, case.heads_q, case.seq_q, case.head_dim_v), dtype, device, seed + 2, case.dout_mult)
    dlse = randn((case.batch, case.heads_q, case.seq_q), torch.float32, device, seed + 3) if case.grad_lse else None
    scale = case.scale if case.scale is not None else case.head_dim**-0.5
    rng_seed = keep = None
    if case.dropout_p > 0:
        seed_value = 2**40 + 12345 + seed
        rng_seed = torch.tensor([seed_value], dtype=torch.int64, device=device)
        keep = dropout_keep(seed_value, case.batch, case.heads_q, case.seq_q, case.seq_k, case.dropout_p, device)
    offset = case.causal_offset
    common = (rng_seed, case.dropout_p, scale, schedule)
    visibility = launch_visibility(offset)
    out, lse = launch.attention_forward(q, k, v, mask, *common, visibility=visibility, configs=configs)
    dq, dk, dv, dmask = launch.attention_backward(dout, q, k, v, mask, out, lse, dlse, *common, case.mask_grad,
                                                  visibility=visibility, configs=configs)
    ours = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv, dmask=dmask)
    inputs = dict(q=q, k=k, v=v, mask=mask, dout=dout, dlse=dlse, scale=scale, offset=offset,
                  rng_seed=rng_seed, keep=keep)
    return ours, inputs


def check_case(case: Case, dtype: torch.dtype, device: str, schedule: str = "stable", seed: int = 0,
               where_representable: bool = False, lse_rows=None, configs=None):
    ours, x = run_case(case, dtype, device, schedule, seed, configs)
    q, k, v, mask = x["q"], x["k"], x["v"], x["mask"]
    kwargs = dict(causal_offset=x["offset"], scale=x["scale"], dropout_mask=x["keep"], dropout_p=case.dropout_p,
                  grad_out=x["dout"], grad_lse=x["dlse"], mask_grad=case.mask_grad)
    ref = ref_forward_backward(q, k, v, mask, **kwargs)
    base = sdpa_baseline(q, k, v, mask, **kwargs)

    # Contract: shapes and dtypes.
    assert ours["out"].shape == (case.batch, case.heads_q, case.seq_q, case.head_dim_v)
    assert ours["out"].dtype == dtype and ours["lse"].dtype == torch.float32
    assert ours["lse"].shape == (case.batch, case.heads_q, case.seq_q)
    for name, t in (("dq", q), ("dk", k), ("dv", v)):
        assert ours[name].shape == t.shape and ours[name].dtype == dtype, name
    if case.mask_grad:
        assert ours["dmask"].shape == (case.batch, case.heads_q, case.seq_q, case.seq_k)
        assert ours["dmask"].dtype == mask.dtype
    else:
        assert ours["dmask"].numel() == 0

    names = ["out", "dq", "dk", "dv"] + (["dmask"] if case.mask_grad else [])
    for name in names:
        where = None
        if where_representable:
            where = ref[name].abs() < torch.finfo(ours[name].dtype).max
        assert_close_to_ref(name, ours[name], ref[name], base[name], where=where, terms=ref["terms"].get(name))
    lse_base = lse_baseline(q, k, mask, causal_offset=x["offset"], scale=x["scale"])
    assert_close_to_ref("lse", ours["lse"], ref["lse"], lse_base, where=lse_rows)
    assert_dead_rows_exact(q, k, mask, x["offset"], ours["out"], ours["lse"], ours["dq"], ours["dk"], ours["dv"],
                           ours["dmask"] if case.mask_grad else None)
    return ours, x, ref, base


# ------------------------------------------------------------------------------------------
# Shapes
# ------------------------------------------------------------------------------------------

if ON_CUDA:
    SHAPES = {
        "L1_S1_E16": Case(1, 1, 1, 1, 1, 16, 16),
        "L7_S1_E64": Case(2, 2, 2, 7, 1, 64, 64),
        "L1_S1025_E96": Case(1, 3, 3, 1, 1025, 96, 96),
        "L129_S129_E64": Case(2, 4, 4, 129, 129, 64, 64),
        "L300_S1025_E40_Ev80": Case(1, 4, 4, 300, 1025, 40, 80),
        "L1025_S300_E80_Ev40": Case(2, 2, 2, 1025, 300, 80, 40),
        "L129_S300_E128": Case(1, 2, 2, 129, 300, 128, 128),
        "L300_S129_E256": Case(1, 2, 2, 300, 129, 256, 256),
        "L1025_S1025_E256_Ev128": Case(1, 2, 2, 1025, 1025, 256, 128),
        "L97_S97_E59_Ev8": Case(2, 2, 2, 97, 97, 59, 8),
        "L33_S50_E40_Ev24": Case(2, 2, 2, 33, 50, 40, 24),
    }
else:
    SHAPES = {
        "L1_S1_E16": Case(1, 1, 1, 1, 1, 16, 16),
        "L7_S1_E16": Case(1, 2, 2, 7, 1, 16, 16),
        "L1_S37_E24": Case(1, 2, 2, 1, 37, 24, 24),
        "L37_S37_E24_B2": Case(2, 2, 2, 37, 37, 24, 24),
        "L33_S50_E40_Ev24": Case(1, 2, 2, 33, 50, 40, 24),
        "L50_S20_E24_Ev40": Case(1, 2, 2, 50, 20, 24, 40),
        "L48_S32_E8": Case(1, 1, 1, 48, 32, 8, 8),
    }


@pytest.mark.parametrize("case", _params(SHAPES))
def test_shapes(case, kernel_dtype, device):
    check_case(case, kernel_dtype, device)


# Hopper's fp32 tiles (tuning/configs._HOPPER_FP32_TILES, chosen from their compiled code on a CPU)
# at each width they serve, with ragged lengths (whole tiles nowhere), causal masking, a float mask
# with its gradient and dropout: forced here, so that the interpreter runs their block shapes too
# (on an H200 they are the heuristic's; elsewhere forced as here).
HOPPER_FP32 = {
    "E40_Ev24_causal_dropout": Case(1, 2, 1, 45, 70, 40, 24, causal="bottom_right", dropout_p=0.2),
    "E80_float_mask_grad": Case(1, 2, 2, 37, 50, 80, 80, mask="float", mask_grad=True),
    "E128_bool_mask_dropout": Case(1, 2, 2, 33, 45, 128, 128, mask="bool", dropout_p=0.3),
    "E200_Ev136_causal": Case(1, 1, 1, 40, 40, 200, 136, causal="top_left"),
}


@pytest.mark.parametrize("case", _params(HOPPER_FP32))
def test_hopper_fp32_tiles(case, device):
    from flash_inductor.tuning.configs import cuda_heuristic_configs

    configs = cuda_heuristic_configs((9, 0), 4, case.head_dim, case.head_dim_v, "stable",
                                     "float" if case.mask == "float" else "none")
    assert configs.forward.num_warps == 8  # the Hopper fp32 tiles, not the ones other GPUs run
    check_case(case, torch.float32, device, configs=configs)


# ------------------------------------------------------------------------------------------
# Features
# ------------------------------------------------------------------------------------------

if ON_CUDA:
    _BASE = Case(batch=2, heads_q=4, heads_kv=4, seq_q=129, seq_k=300, head_dim=80, head_dim_v=64)
    _SQ = dict(seq_q=300, seq_k=300)
    _LONG_Q = dict(seq_q=300, seq_k=129)
else:
    _BASE = Case(batch=2, heads_q=2, heads_kv=2, seq_q=37, seq_k=45, head_dim=24, head_dim_v=40)
    _SQ = dict(seq_q=45, seq_k=45)
    _LONG_Q = dict(seq_q=50, seq_k=30)


def _f(**changes) -> Case:
    return dataclasses.replace(_BASE, **changes)


FEATURES = {
    "bool_mask": _f(mask="bool"),
    "float_mask": _f(mask="float"),
    "float_mask_grad": _f(mask="float", mask_grad=True),
    "bool_mask_broadcast": _f(mask="bool_bcast"),
    "float_mask_broadcast_grad": _f(mask="float_bcast", mask_grad=True),
    "finfo_min_mask_grad": _f(mask="finfo_min", mask_grad=True),
    "causal_top_left_square": _f(causal="top_left", **_SQ),
    "causal_top_left_L<S": _f(causal="top_left"),
    "causal_top_left_L>S": _f(causal="top_left", **_LONG_Q),
    "causal_bottom_right_L<S": _f(causal="bottom_right"),
    "causal_bottom_right_L>S_dead_rows": _f(causal="bottom_right", **_LONG_Q),
    "causal_bool_mask": _f(causal="bottom_right", mask="bool"),
    "causal_float_mask_grad": _f(causal="top_left", mask="float", mask_grad=True, **_SQ),
    "gqa": _f(heads_q=4, heads_kv=2),
    "mqa": _f(heads_q=3, heads_kv=1),
    "gqa_causal_float_mask_grad": _f(heads_q=4, heads_kv=2, causal="bottom_right", mask="float_bcast",
                                     mask_grad=True),
    "noncontig": _f(noncontig=True),
    "noncontig_causal_bool_broadcast_gqa": _f(noncontig=True, causal="top_left", mask="bool_bcast", heads_q=4,
                                              heads_kv=2),
    "dead_rows_bool": _f(mask="bool_dead_rows"),
    "dead_rows_float_grad": _f(mask="float_dead_rows", mask_grad=True),
    "no_keys_S0": _f(seq_k=0),
    "no_queries_L0": _f(seq_q=0, causal="top_left"),
    "grad_lse": _f(grad_lse=True),
    "grad_lse_dead_rows_causal": _f(grad_lse=True, causal="bottom_right", mask="float_dead_rows", mask_grad=True,
                                    **_LONG_Q),
    "scale_0.3": _f(scale=0.3),
    "E_ne_Ev_odd": _f(head_dim=40, head_dim_v=8) if not ON_CUDA else _f(head_dim=40, head_dim_v=200),
}
if ON_CUDA:  # head width 256 takes wider backward tiles on Hopper (tuning/configs.py); the fp32 mask keeps dQ's small one
    FEATURES.update({
        "E256_causal_bool_mask_gqa": _f(head_dim=256, head_dim_v=256, causal="bottom_right", mask="bool",
                                        heads_q=4, heads_kv=2, **_SQ),
        "E256_float_mask_grad_grad_lse": _f(head_dim=256, head_dim_v=256, mask="float", mask_grad=True,
                                            grad_lse=True),
    })


# Lengths that are a whole number of every tile the kernels may use (128 at most on the GPU,
# 16 in the interpreter) and head dims at their padded widths: the backward loops then leave
# out load masks that cannot bind, so these shapes run other code than the ragged ones above.
_WHOLE = dict(seq_q=256, seq_k=256, head_dim=64, head_dim_v=64) if ON_CUDA else \
    dict(seq_q=48, seq_k=48, head_dim=32, head_dim_v=32)
WHOLE_BLOCKS = {
    "whole_blocks": _f(**_WHOLE),
    "whole_blocks_causal_gqa_float_mask_grad": _f(**_WHOLE, causal="bottom_right", heads_q=4, heads_kv=2,
                                                  mask="float", mask_grad=True),
    "whole_blocks_finfo_min_mask_grad_grad_lse": _f(**_WHOLE, mask="finfo_min", mask_grad=True, grad_lse=True),
    "whole_blocks_dropout_dead_rows": _f(**_WHOLE, dropout_p=0.25, mask="bool_dead_rows"),
    # Whole query blocks against a ragged key length (and the converse): one loop masked, one not.
    "whole_queries_ragged_keys_causal": _f(**{**_WHOLE, "seq_k": _BASE.seq_k}, causal="top_left"),
    "ragged_queries_whole_keys_E_padded": _f(**{**_WHOLE, "seq_q": _BASE.seq_q}, causal="bottom_right"),
}
FEATURES.update(WHOLE_BLOCKS)


def test_whole_blocks_never_guards_a_symbolic_length():
    """The launchers drop load masks only for a concrete length that is a whole number of blocks;
    a symbolic one (torch.compile(dynamic=True)) keeps them, and adds no guard on divisibility."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    assert launch.common.whole_blocks(256, 64) and launch.common.whole_blocks(48, 16)
    assert not launch.common.whole_blocks(300, 64)
    env = ShapeEnv()
    length = env.create_symintnode(env.create_symbol(256, source=ConstantSource("L")), hint=256)
    assert not launch.common.whole_blocks(length, 64)
    assert not env.guards


@pytest.mark.parametrize("mask,scale,folds", [
    (None, 0.125, True), ("bool", 0.125, False), ("float", 0.125, False), (None, 0.0, False), (None, -0.5, False)])
def test_forward_folds_the_scale_only_without_a_mask(monkeypatch, mask, scale, folds):
    """FOLD_SCALE (exp2's argument as one FFMA on the unscaled score) only with a positive scale
    and no mask: folded under a padding mask, the fp16 GPT-2 overflow test's gradient error went
    past its bound on the H200 (launch.forward._fold_scale has the measurements)."""
    seen = []
    spy_on_launches(monkeypatch, lambda name, kwargs: seen.append(kwargs.get("FOLD_SCALE")))
    q, k, v = (randn((1, 1, 16, 16), torch.float16, DEVICE, seed) for seed in (1, 2, 3))
    attn_mask = None if mask is None else (
        torch.ones(1, 1, 16, 16, dtype=torch.bool, device=DEVICE).tril() if mask == "bool"
        else randn((1, 1, 16, 16), torch.float16, DEVICE, 4))
    launch.attention_forward(q, k, v, attn_mask, None, 0.0, scale, "stable")
    assert seen == [folds]


@pytest.mark.parametrize("case", _params(FEATURES))
def test_features(case, kernel_dtype, device):
    check_case(case, kernel_dtype, device)


# ------------------------------------------------------------------------------------------
# Dropout: the kernels and the reference path draw the same Philox stream
# ------------------------------------------------------------------------------------------

DROPOUT = {
    "p0.3": _f(dropout_p=0.3),
    "p0.17_causal_bottom_right_gqa": _f(dropout_p=0.17, causal="bottom_right", heads_q=4, heads_kv=2),
    "p0.5_float_mask_grad": _f(dropout_p=0.5, mask="float", mask_grad=True),
    "p0.3_bool_broadcast_noncontig_dead_rows": _f(dropout_p=0.3, mask="bool_dead_rows", noncontig=True),
}
if ON_CUDA:
    DROPOUT["p0.2_E256_causal"] = _f(dropout_p=0.2, head_dim=256, head_dim_v=256, causal="top_left", **_SQ)


@pytest.mark.parametrize("case", _params(DROPOUT))
def test_dropout_matches_reference_path(case, kernel_dtype, device):
    # Against the naive fp64 attention with the Philox keep mask (inside check_case) ...
    ours, x, ref, base = check_case(case, kernel_dtype, device)
    # ... and against the package's own reference path in fp64 with the same rng_seed.
    q, k, v, mask = (t.double() if t is not None and t.is_floating_point() else t
                     for t in (x["q"], x["k"], x["v"], x["mask"]))
    common = dict(rng_seed=x["rng_seed"], dropout_p=case.dropout_p, is_causal=x["offset"] is not None,
                  causal_offset=x["offset"] or 0, scale=x["scale"])
    out, lse = reference_forward(q, k, v, mask, **common)
    dq, dk, dv, dmask = reference_backward(x["dout"].double(), q, k, v, mask, out, lse,
                                           compute_mask_grad=case.mask_grad, **common)
    path = dict(out=out, dq=dq, dk=dk, dv=dv, dmask=dmask)
    for name in ["out", "dq", "dk", "dv"] + (["dmask"] if case.mask_grad else []):
        assert_close_to_ref(f"{name} vs reference path", ours[name], path[name], base[name],
                            terms=ref["terms"].get(name))
    # Dropout must actually drop: the kept fraction of visible scores is near 1 - p.
    assert 0.5 * (1 - case.dropout_p) < x["keep"].float().mean().item() < 1.0


# ------------------------------------------------------------------------------------------
# Precision schedules
# ------------------------------------------------------------------------------------------

SCHEDULE_CASES = {
    "plain": _BASE,
    "gqa_causal_float_mask_grad_noncontig": _f(heads_q=4, heads_kv=2, causal="bottom_right", mask="float",
                                              mask_grad=True, noncontig=True),
}
if ON_CUDA:  # each schedule's wide-head backward tiles (exact Δ or not, 16-bit or tf32x3 operands)
    SCHEDULE_CASES["E256_causal"] = _f(head_dim=256, head_dim_v=256, causal="top_left", **_SQ)


@pytest.mark.parametrize("case", _params(SCHEDULE_CASES))
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_schedules(case, schedule, kernel_dtype, device):
    check_case(case, kernel_dtype, device, schedule=schedule)


# ------------------------------------------------------------------------------------------
# Large magnitudes (fp16)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", ["none", "top_left"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_large_logits_fp16(schedule, causal, device):
    """Logits scaled x100 (|q| and |k| x10): the fp32 scores and base-2 online softmax must stay
    finite and as accurate as PyTorch's fp16 attention, forward and backward."""
    case = _f(q_mult=10.0, k_mult=10.0, causal=causal)
    ours, _, ref, _ = check_case(case, torch.float16, device, schedule=schedule)
    assert ref["lse"].abs().max() > 100  # the inputs really are in the large-logit regime


@pytest.mark.parametrize("schedule", ["stable", "accurate"])
def test_large_values_backward_fp16(schedule, device):
    """|V| ~ 1e4 in fp16: dS = P * (dP - delta) exceeds fp16's 65504 while most gradients do not.
    The "stable" (rescaled dS) and "accurate" (fp32 dS) schedules must give finite, accurate
    gradients wherever the fp64 gradient is representable in fp16."""
    case = _f(v_mult=1e4, q_mult=3.0, dout_mult=2.0, mask="float", mask_grad=True)
    ours, x, ref, _ = check_case(case, torch.float16, device, schedule=schedule, where_representable=True)
    # The inputs really are in the regime the schedules exist for: dS (= dmask) overflows fp16
    # somewhere, and most gradient entries are representable.
    assert ref["dmask"].abs().max() > torch.finfo(torch.float16).max
    for name in ("dq", "dk"):
        representable = ref[name].abs() < torch.finfo(torch.float16).max
        assert representable.float().mean() > 0.5, name


# ------------------------------------------------------------------------------------------
# Exact Δ (the schedules' exact_delta)
# ------------------------------------------------------------------------------------------


def test_near_tied_keys_need_exact_delta_fp16(device):
    """dq_i = scale Σ_j dS_ij k_j, and keys sharing a large component c turn whatever a row's dS
    has in common into an error along c. FA2's Δ = rowsum(dO∘O) from the fp16 O (``fast``) is such
    an error, u·|dO_i|·|O_i| on every P_ij of the row. With exact Δ, dq and dk meet the tolerance
    rule against SDPA's math backend (which keeps P in fp32 and has no Δ); ``fast`` misses it on dq
    by orders of magnitude, which is the case for paying the extra GEMM."""
    q, k, v, dout = near_tied_qkv((1, 2, 64, 16), torch.float16, device)
    scale = q.shape[-1] ** -0.5
    ref = ref_forward_backward(q, k, v, scale=scale, grad_out=dout)
    with sdpa_kernel(SDPBackend.MATH):
        base = sdpa_baseline(q, k, v, scale=scale, grad_out=dout)
    grads = {}
    for schedule in SCHEDULES:
        common = (None, 0.0, scale, schedule)
        out, lse = launch.attention_forward(q, k, v, None, *common)
        grads[schedule] = dict(zip(("dq", "dk", "dv"), launch.attention_backward(
            dout, q, k, v, None, out, lse, None, *common, False)))
    for schedule in ("stable", "accurate"):
        for name in ("dq", "dk", "dv"):
            assert_close_to_ref(f"{schedule} {name}", grads[schedule][name], ref[name], base[name],
                                terms=ref["terms"][name])
    for name in ("dk", "dv"):  # Δ's error reaches dk only through q, which shares no large component
        assert_close_to_ref(f"fast {name}", grads["fast"][name], ref[name], base[name], terms=ref["terms"][name])
    with pytest.raises(AssertionError, match="fast dq: max error"):
        assert_close_to_ref("fast dq", grads["fast"]["dq"], ref["dq"], base["dq"], terms=ref["terms"]["dq"])
    assert max_abs_error(grads["fast"]["dq"], ref["dq"]) > 10 * max_abs_error(grads["stable"]["dq"], ref["dq"])


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_mask_gradient_rows_sum_to_the_lse_gradient(schedule, kernel_dtype, device):
    """Σ_j ∂L/∂s_ij = dLSE_i: softmax's own gradient sums to zero over a row, and dropout enters only
    through dP. dmask is dS, so its row sums keep that identity up to fp32 rounding wherever the
    backward's Δ is exact: always with fp32 inputs (O is not rounded), and with 16-bit inputs under
    exact_delta, whose correction is the row sum of the very dS computed. FA2's Δ from a 16-bit O
    (``fast``) leaves each row off by about u·|dO_i·O_i|. GQA, causal masking, dropout and an LSE
    gradient all on; the mask is fp32 so that dmask is not rounded to 16 bits on the way out."""
    case = _f(heads_q=4, heads_kv=2, causal="bottom_right", mask="float", mask_dtype=torch.float32, mask_grad=True,
              dropout_p=0.3, grad_lse=True)
    ours, x = run_case(case, kernel_dtype, device, schedule)
    kwargs = dict(causal_offset=x["offset"], scale=x["scale"], dropout_mask=x["keep"], dropout_p=case.dropout_p)
    ref = ref_forward_backward(x["q"], x["k"], x["v"], x["mask"], grad_out=x["dout"], grad_lse=x["dlse"],
                               mask_grad=True, **kwargs)
    # Rounding of the fp32 arithmetic is relative to the terms: Σ_j P_ij |dP_ij| <= |dO_i| · (P̃ |V|)_i
    # (P̃ the dropped probabilities), Σ_j |dS_ij| and |dLSE_i|.
    weighted_abs_v = ref_forward_backward(x["q"], x["k"], x["v"].abs(), x["mask"], **kwargs)["out"]
    terms = ((x["dout"].double().abs() * weighted_abs_v).sum(-1) + ref["dmask"].abs().sum(-1)
             + x["dlse"].double().abs())
    error = (ours["dmask"].double().sum(-1) - ref["dmask"].sum(-1)).abs()
    within = error <= 16 * torch.finfo(torch.float32).eps * terms
    if schedule == "fast" and kernel_dtype != torch.float32:
        assert not within.all(), "FA2's Delta from a 16-bit O should break the identity"
    else:
        assert within.all(), f"row sums of dS off by up to {(error / terms).max().item():.2e} x their terms"


# ------------------------------------------------------------------------------------------
# Rows masked with finfo(dtype).min everywhere (HF-style padding of a query row)
# ------------------------------------------------------------------------------------------


def test_finfo_min_rows(kernel_dtype, device):
    """SDPA gives such a row uniform attention (for fp32/bf16, finfo.min swamps the scores), and
    so do we, gradients included: the LSE of such a row sits at the -1e38 mask clamp, where fp32
    cannot also hold log(S), so the backward recovers the row's max and log-sum separately."""
    case = _f(mask="finfo_min_rows", mask_grad=True)
    mask = make_mask(case.mask, case.batch, case.heads_q, case.seq_q, case.seq_k, kernel_dtype, device, seed=1)
    saturated = (mask.double() <= -1e38).all(dim=-1)
    # Contract: finite mask values below -1e38 are clamped there, so those rows' LSE is the clamp.
    ours, *_ = check_case(case, kernel_dtype, device, lse_rows=~saturated)
    if saturated.any():
        assert torch.allclose(ours["lse"][saturated].double(), torch.tensor(-1e38, dtype=torch.float64), rtol=1e-6)


def test_finfo_min_rows_forward(kernel_dtype, device):
    """The forward of the same rows is right for every dtype: compare out and lse only."""
    case = _f(mask="finfo_min_rows")
    ours, x = run_case(case, kernel_dtype, device)
    kwargs = dict(causal_offset=None, scale=x["scale"])
    ref = ref_forward_backward(x["q"], x["k"], x["v"], x["mask"], **kwargs)
    base = sdpa_baseline(x["q"], x["k"], x["v"], x["mask"], **kwargs)
    assert_close_to_ref("out", ours["out"], ref["out"], base["out"])


# ------------------------------------------------------------------------------------------
# fp16 dS rescaling decided per call (launch.backward.measure_ds_bound), and the unchecked off-diagonal tiles
# ------------------------------------------------------------------------------------------


def _fp16_bound_case(case: Case, device: str, seed: int = 0):
    """(bound the launcher computes, max |dS| in fp64) for a case, dS being dL/d(float mask)."""
    ours, x = run_case(case, torch.float16, device, "stable", seed)
    ref = ref_forward_backward(x["q"], x["k"], x["v"], x["mask"], causal_offset=x["offset"], scale=x["scale"],
                               dropout_mask=x["keep"], dropout_p=case.dropout_p, grad_out=x["dout"],
                               grad_lse=x["dlse"], mask_grad=True)
    bound = launch.backward.measure_ds_bound(x["dout"], x["v"], x["dlse"], case.dropout_p)
    return float(bound), float(ref["dmask"].abs().max())


@pytest.mark.parametrize("variant", ["plain", "large_v", "dropout_grad_lse", "peaked_large_do"])
def test_bound_is_an_upper_bound_on_ds(variant, device):
    """The bound that picks the loop must hold for the exact dS, or a tile could overflow unseen."""
    cases = {
        "plain": _f(mask="float"),
        "large_v": _f(mask="float", v_mult=1e4, q_mult=3.0),
        "dropout_grad_lse": _f(mask="float", dropout_p=0.3, grad_lse=True, dout_mult=30.0),
        "peaked_large_do": _f(mask="float", q_mult=6.0, k_mult=6.0, dout_mult=1e3),
    }
    bound, exact = _fp16_bound_case(cases[variant], device)
    assert exact > 0 and exact <= bound, (exact, bound)


@pytest.mark.parametrize("seq_q, seq_k, heads_q, heads_kv", [(29, 150, 4, 2), (150, 29, 4, 1), (64, 64, 2, 2)],
                         ids=["more_keys_gqa", "more_queries_mqa", "square"])
def test_preprocess_collects_the_bound_over_every_row(seq_q, seq_k, heads_q, heads_kv, device):
    """The preprocess collects the bound's maxima over all of dO, V and dLSE (launch.backward.measure_ds_bound runs
    it alone): its grid spans max(L, S) rows and only B * H_KV of its heads read V, so a maximum in
    V's last row of the last KV head, or in dO's last row, must still be seen. Checked against the
    same formula in float64, B = 2 k max‖dO_i‖ max‖v_j‖ + max|dLSE_i|, to fp32 rounding."""
    batch, width = 2, 24
    dout = randn((batch, heads_q, seq_q, width), torch.float16, device, 1)
    value = randn((batch, heads_kv, seq_k, width), torch.float16, device, 2)
    dlse = randn((batch, heads_q, seq_q), torch.float32, device, 3)
    dout[-1, -1, -1] = 40.0  # the largest rows sit where a grid that missed them would not look
    value[-1, -1, -1] = 30.0
    dlse[-1, -1, -1] = 500.0
    for grad_lse, dropout_p in ((None, 0.0), (dlse, 0.25)):
        bound = launch.backward.measure_ds_bound(dout, value, grad_lse, dropout_p)
        norms = [t.double().norm(dim=-1).max() for t in (dout, value)]
        expected = 2.0 / (1.0 - dropout_p) * norms[0] * norms[1]
        if grad_lse is not None:
            expected = expected + grad_lse.double().abs().max()
        assert bound.dtype == torch.float32 and bound.shape == (1,)
        torch.testing.assert_close(bound.double().cpu(), expected.reshape(1).cpu(), rtol=1e-5, atol=0.0)
    value[0, 0, 3, 5] = float("nan")  # a NaN anywhere must not look small
    assert not (float(launch.backward.measure_ds_bound(dout, value, None, 0.0)) <= 16384.0)


def test_large_values_take_the_rescaling_loops(device):
    """|V| ~ 1e4 puts the bound past the threshold (so the kernels rescale, and
    test_large_values_backward_fp16 checks the result), ordinary inputs stay far below it."""
    threshold = 16384.0  # kernels/attn_bwd.py DS_RESCALE_ABOVE
    large, _ = _fp16_bound_case(_f(mask="float", v_mult=1e4, q_mult=3.0, dout_mult=2.0), device)
    ordinary, _ = _fp16_bound_case(_f(mask="float"), device)
    assert large > threshold > 10 * ordinary
    nan_grad = torch.full((1, 1, 4, 8), float("nan"), dtype=torch.float16, device=device)
    value = torch.ones((1, 1, 5, 8), dtype=torch.float16, device=device)
    # A non-finite upstream gradient must not look small: NaN fails `bound <= threshold`.
    assert not (float(launch.backward.measure_ds_bound(nan_grad, value, None, 0.0)) <= threshold)


@pytest.mark.parametrize("case", [
    pytest.param(_f(causal="top_left", mask="float", mask_grad=True), id="causal_float_mask"),
    pytest.param(_f(causal="bottom_right", seq_q=29, seq_k=45, heads_kv=1, dropout_p=0.2), id="bottom_right_gqa_dropout"),
    pytest.param(_f(v_mult=30.0, dout_mult=30.0, grad_lse=True), id="large_no_mask"),
])
def test_rescaling_and_plain_loops_agree(case, device, monkeypatch):
    """Forcing either loop gives the same gradients, both within the tolerance rule: the plain
    loop only drops a rescale that is exactly 1 below the threshold. The plain loop is forced by
    the real bound capped at the threshold, which still bounds |dS| here (large_no_mask's dS
    fits fp16) and keeps its scale-up honest: a bound below the true |dS| would scale dS past
    65504. The two unit-valued cases run it scaled up by 2^6, large_no_mask by 1."""
    real_backward = launch.attention_backward
    threshold = 16384.0  # kernels/attn_bwd.py DS_RESCALE_ABOVE
    bounds = {
        "plain": lambda call: launch.backward.measure_ds_bound(call["grad_out"], call["value"], call["grad_lse"],
                                               call["dropout_p"]).clamp(max=threshold),
        "rescaling": lambda call: torch.full((1,), float("inf"), device=device),
    }
    results, forced_calls = {}, []
    for name, bound in bounds.items():
        def forced(*args, _bound=bound, **kwargs):
            call = inspect.signature(real_backward).bind(*args, **kwargs).arguments
            forced_calls.append(name)
            return real_backward(*args, ds_bound=_bound(call), **kwargs)
        monkeypatch.setattr(launch, "attention_backward", forced)
        results[name] = check_case(case, torch.float16, device)[0]
    assert set(forced_calls) == set(bounds), "the backward did not run through the forced bound"
    for grad in ("dq", "dk", "dv") + (("dmask",) if case.mask_grad else ()):
        plain, rescaled = results["plain"][grad].float(), results["rescaling"][grad].float()
        # Same products (but for the rounding of dS below fp16's normals, scaled up in the plain
        # loop), summed in another order: a few fp16 ulps of the gradient's magnitude.
        tolerance = 8 * torch.finfo(torch.float16).eps * max(plain.abs().max().item(), 1e-3)
        assert (plain - rescaled).abs().max().item() <= tolerance, grad


def _tiny_ds_problem(device, q_mult=1.0, k_mult=1.0, v_mult=1e-5, seed=0):
    """(q, k, v, dout) of shape (1, 2, 64, 16) in fp16 whose dS lies mostly in fp16's subnormals:
    |V| ~ 1e-5 makes dP, Δ, and so dS = P∘(dP − Δ), about 1e-6. dO stays of order 1."""
    q, k, v = make_qkv(1, 2, 2, 64, 64, 16, 16, torch.float16, device, seed=seed, q_mult=q_mult, k_mult=k_mult,
                       v_mult=v_mult)
    dout = randn((1, 2, 64, 16), torch.float16, device, seed + 2)
    return q, k, v, dout


@pytest.mark.parametrize("variant", ["unit_keys", "wide_keys"])
def test_tiny_ds_scaled_out_of_fp16_subnormals(variant, device):
    """fp16 `stable`, plain loop: dS of order 1e-6, cast directly to fp16, falls among the
    subnormals (< 2^-14 ~ 6.1e-5), where 1e-6 keeps about 4 significant bits. The plain loop scales
    the call's dS up by a power of two first (ds_scaling._ds_loop_choice: here 2^24), so dq and dk
    meet the tolerance rule against SDPA's math backend; cast unscaled they missed it by 1.6-1.9x
    (unit_keys: dq and dk, ~1e-5) and 4x (wide_keys: |k| x16, |q| /16, the same logits, so dq ~ 2e-4
    is an fp16 normal, and its error is dS's alone)."""
    mults = {"unit_keys": (1.0, 1.0), "wide_keys": (1.0 / 16, 16.0)}[variant]
    q, k, v, dout = _tiny_ds_problem(device, *mults)
    scale = q.shape[-1] ** -0.5
    # The regime: the call takes the plain loop, and most of dS (dL/d(a zero float mask)) is subnormal.
    assert float(launch.backward.measure_ds_bound(dout, v, None, 0.0)) < 2**-10
    zero_mask = torch.zeros((1, 2, 64, 64), dtype=torch.float64, device=device)
    ds = ref_forward_backward(q, k, v, zero_mask, scale=scale, grad_out=dout, mask_grad=True)["dmask"]
    assert (ds.abs() < 2**-14).double().mean() > 0.99
    ref = ref_forward_backward(q, k, v, scale=scale, grad_out=dout)
    with sdpa_kernel(SDPBackend.MATH):
        base = sdpa_baseline(q, k, v, scale=scale, grad_out=dout)
    common = (None, 0.0, scale, "stable")
    out, lse = launch.attention_forward(q, k, v, None, *common)
    grads = dict(zip(("dq", "dk", "dv"), launch.attention_backward(dout, q, k, v, None, out, lse, None, *common,
                                                                   False)))
    for name in ("dq", "dk", "dv"):
        assert_close_to_ref(name, grads[name], ref[name], base[name], terms=ref["terms"][name])


def test_plain_loop_scale_up_is_exact(device):
    """dO x 2^10 scales the bound by 2^10, so the plain loop's scale-up drops by 2^10 and the fp16
    dS tiles are the very same bits: dq and dk come out exactly x 2^10 wherever the smaller is an
    fp16 normal (a subnormal output is rounded more coarsely), dv (linear in dO) too. Cast
    unscaled, the subnormal dS of the smaller call broke this."""
    q, k, v, dout = _tiny_ds_problem(device, q_mult=1.0 / 16, k_mult=16.0, v_mult=1.0)
    dout = (dout.double() * 2**-12).to(torch.float16)  # dS ~ 1e-5, mostly subnormal
    scale = q.shape[-1] ** -0.5
    common = (None, 0.0, scale, "stable")
    out, lse = launch.attention_forward(q, k, v, None, *common)
    small = launch.attention_backward(dout, q, k, v, None, out, lse, None, *common, False)[:3]
    large = launch.attention_backward(dout * 2**10, q, k, v, None, out, lse, None, *common, False)[:3]
    assert float(launch.backward.measure_ds_bound(dout * 2**10, v, None, 0.0)) < 16384.0  # both take the plain loop
    for name, a, b in zip(("dq", "dk", "dv"), small, large):
        normal = a.abs() > 2**-14
        if name == "dq":
            assert normal.double().mean() > 0.5, "too few fp16-normal dq entries to compare"
        assert torch.equal(b[normal], a[normal] * 2**10), name


@pytest.mark.parametrize("causal", ["none", "top_left"])
def test_ragged_key_block_with_very_negative_logits(causal, device):
    """Every logit near -200 (a large negative additive mask): the LSE is too, so a zero-padded
    key past S would score 0 and give exp2(0 - log2(e) LSE) = exp2(288) = inf in fp32 in the
    backward's recomputed P. The
    ragged last key block keeps the visibility select that makes it 0; whole blocks may drop it.

    fp16 inputs: the leak is in the kernels' fp32 arithmetic, whatever the input dtype. (fp32
    inputs at these logits meet another limit: the forward's base-2 scores carry one ulp of
    |s|·log2(e), up to twice SDPA's fp32 error on the output; see docs/performance.md.)"""
    kernel_dtype = torch.float16
    case = _f(seq_q=37, seq_k=45, causal=causal)  # 45 keys: a ragged last block at every tile size
    q, k, v = make_qkv(1, 2, 2, case.seq_q, case.seq_k, 24, 24, kernel_dtype, device, seed=11)
    mask = (randn((1, 2, case.seq_q, case.seq_k), torch.float32, device, 12) - 200.0).to(kernel_dtype)
    dout = randn((1, 2, case.seq_q, 24), kernel_dtype, device, 13)
    scale = 24**-0.5
    offset = case.causal_offset
    common = (None, 0.0, scale, "stable")
    out, lse = launch.attention_forward(q, k, v, mask, *common, visibility=launch_visibility(offset))
    dq, dk, dv, _ = launch.attention_backward(dout, q, k, v, mask, out, lse, None, *common, False,
                                              visibility=launch_visibility(offset))
    assert lse.max() < -150  # past exp2's fp32 range once multiplied by log2(e)
    ref = ref_forward_backward(q, k, v, mask, causal_offset=offset, scale=scale, grad_out=dout)
    base = sdpa_baseline(q, k, v, mask, causal_offset=offset, scale=scale, grad_out=dout)
    for name, ours in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert ours.isfinite().all(), name
        assert_close_to_ref(name, ours, ref[name], base[name], terms=ref["terms"].get(name))
