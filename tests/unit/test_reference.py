"""Tests of the blocked PyTorch reference attention and of the Philox re-implementation.

Ground truth is a naive float64 attention written below (materialised scores, GQA by
repeat_interleave, the same Philox keep mask), differentiated by autograd. Low-precision
results must be within 2x the error of the same naive code run eagerly in that dtype, plus
a small floor (FlashAttention's tolerance model).
"""

import os
import subprocess
import sys
import textwrap
import zlib
from dataclasses import dataclass, replace
from typing import Optional

import pytest
import torch

from torch.nn.attention import SDPBackend, sdpa_kernel

from flash_inductor.ops import reference
from flash_inductor.ops.philox import philox_uniform
from flash_inductor.ops.reference import reference_backward, reference_forward
from helpers import assert_close_to_ref, near_tied_qkv, ref_forward_backward, sdpa_baseline

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# ----------------------------------------------------------------------------------------------
# Philox
# ----------------------------------------------------------------------------------------------

_TRITON_RAND_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def _store_rand(seed_ptr, offsets_ptr, out_ptr, N: tl.constexpr):
        idx = tl.arange(0, N)
        seed = tl.load(seed_ptr)
        tl.store(out_ptr + idx, tl.rand(seed, tl.load(offsets_ptr + idx)))

    seeds, offsets = torch.load(sys.argv[1])
    results = []
    for seed in seeds.tolist():
        out = torch.empty(offsets.shape[0], dtype=torch.float32)
        _store_rand[(1,)](torch.tensor([seed], dtype=torch.int64), offsets, out, N=offsets.shape[0])
        results.append(out)
    torch.save(torch.stack(results), sys.argv[2])
    """
)


def test_philox_uniform_is_bit_exact_with_triton_rand(tmp_path):
    pytest.importorskip("triton")
    generator = torch.Generator().manual_seed(1234)
    seeds = torch.cat(
        [
            torch.tensor([0, 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1]),
            torch.randint(2**32, 2**63 - 1, (3,), generator=generator),
            torch.randint(0, 2**32, (3,), generator=generator),
        ]
    )
    offsets = torch.cat(
        [
            torch.arange(256),
            torch.tensor([2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 1, 2**62, 2**63 - 1]),
            torch.randint(2**32, 2**63 - 1, (1024 - 263,), generator=generator),
        ]
    )
    inputs, outputs = tmp_path / "inputs.pt", tmp_path / "outputs.pt"
    torch.save((seeds, offsets), inputs)
    # The interpreter must be on before @triton.jit runs, so the kernel lives in a fresh process.
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    completed = subprocess.run(
        [sys.executable, "-c", _TRITON_RAND_SCRIPT, str(inputs), str(outputs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr
    expected = torch.load(outputs)
    for seed, triton_values in zip(seeds.tolist(), expected):
        ours = philox_uniform(seed, offsets)
        assert ours.dtype == torch.float32
        mismatches = (ours.view(torch.int32) != triton_values.view(torch.int32)).sum().item()
        assert mismatches == 0, f"seed {seed}: {mismatches} values differ from tl.rand"


def test_philox_uniform_range_and_shape():
    offsets = torch.arange(100_000, dtype=torch.int64).reshape(100, 1000)
    values = philox_uniform(2**40 + 17, offsets)
    assert values.shape == offsets.shape
    assert values.min() >= 0 and values.max() < 1
    assert abs(values.mean().item() - 0.5) < 0.01


# ----------------------------------------------------------------------------------------------
# Attention cases
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    batch: int = 2
    query_heads: int = 2
    kv_heads: int = 2
    query_len: int = 7
    key_len: int = 129
    head_dim: int = 40
    value_dim: int = 24
    # none | bool | float | bool_broadcast | float_broadcast | finfo_min | dead_rows_bool | dead_rows_float
    mask: str = "none"
    mask_dtype: Optional[torch.dtype] = None  # float masks: None means the query dtype
    # None | "top_left" (causal_offset 0) | "bottom_right" (causal_offset S - L)
    causal: Optional[str] = None
    dropout_p: float = 0.0
    non_contiguous: bool = False


CASES = {
    "plain_L7_S129_E40_Ev24": Case(),
    "L1_S300_E80_gqa_float_mask": Case(query_heads=4, kv_heads=2, query_len=1, key_len=300, head_dim=80, value_dim=80, mask="float"),
    "L300_S7_mqa_bool_mask_causal_top_left": Case(query_heads=4, kv_heads=1, query_len=300, key_len=7, head_dim=16, value_dim=8, mask="bool", causal="top_left"),
    "L129_S300_causal_bottom_right_float_broadcast_noncontig": Case(query_len=129, key_len=300, mask="float_broadcast", causal="bottom_right", non_contiguous=True),
    "L300_S129_causal_bottom_right_dead_rows": Case(batch=1, query_heads=4, kv_heads=2, query_len=300, key_len=129, head_dim=8, value_dim=8, causal="bottom_right"),
    "L7_S7_bool_broadcast_gqa_noncontig": Case(query_heads=6, kv_heads=2, key_len=7, mask="bool_broadcast", non_contiguous=True),
    "dropout_gqa_bool_broadcast": Case(query_heads=4, kv_heads=2, query_len=129, key_len=300, head_dim=40, value_dim=16, mask="bool_broadcast", dropout_p=0.3),
    "dropout_causal_float_mask": Case(query_len=129, key_len=129, head_dim=80, value_dim=40, mask="float", causal="bottom_right", dropout_p=0.17),
    "finfo_min_mask": Case(query_len=129, key_len=300, mask="finfo_min"),
    "finfo_min_fp32_mask": Case(query_len=7, key_len=129, mask="finfo_min", mask_dtype=torch.float32),
    "dead_rows_bool": Case(query_len=7, key_len=129, mask="dead_rows_bool"),
    "dead_rows_float_causal": Case(query_len=7, key_len=300, mask="dead_rows_float", causal="top_left"),
    "key_len_0": Case(query_len=7, key_len=0, mask="float"),
    "query_len_0": Case(query_len=0, key_len=129, mask="float", causal="top_left"),
}

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]


def _randn(shape, generator, non_contiguous, dtype):
    """Random data; non-contiguous as a transposed, strided view of a larger tensor."""
    if not non_contiguous:
        return torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)
    batch, heads, seq, dim = shape
    storage = torch.randn((batch, seq, heads, 2 * dim), generator=generator, dtype=torch.float64)
    return storage.to(dtype).transpose(1, 2)[..., ::2]


def _make_mask(case: Case, generator) -> Optional[torch.Tensor]:
    """float64 (or bool) mask of shape (B, Hq, L, S), possibly an expanded stride-0 view."""
    full = (case.batch, case.query_heads, case.query_len, case.key_len)
    neg_inf = float("-inf")
    if case.mask == "none":
        return None
    if case.mask == "bool":
        return torch.rand(full, generator=generator) < 0.7
    if case.mask == "float":
        return torch.randn(full, generator=generator, dtype=torch.float64)
    if case.mask == "bool_broadcast":
        return (torch.rand((case.batch, 1, case.query_len, case.key_len), generator=generator) < 0.6).expand(full)
    if case.mask == "float_broadcast":
        return torch.randn((1, case.query_heads, 1, case.key_len), generator=generator, dtype=torch.float64).expand(full)
    if case.mask == "finfo_min":
        # Placeholder -inf marks where the test later writes finfo(mask dtype).min; row 0 fully so.
        mask = torch.where(torch.rand(full, generator=generator) < 0.5, neg_inf, 0.0).double()
        mask[:, :, 0, :] = neg_inf
        return mask
    if case.mask == "dead_rows_bool":
        mask = torch.rand(full, generator=generator) < 0.7
        mask[:, :, ::3, :] = False
        return mask
    if case.mask == "dead_rows_float":
        mask = torch.randn(full, generator=generator, dtype=torch.float64)
        mask[0, :, 1, :] = neg_inf
        mask[1, 1, 2, :] = neg_inf
        return mask
    raise AssertionError(case.mask)


def _causal_offset(case: Case) -> int:
    return case.key_len - case.query_len if case.causal == "bottom_right" else 0


def _dropout_keep_scale(case: Case, seed: int) -> Optional[torch.Tensor]:
    """keep / (1 - p), with offset ((b*Hq + h)*L + i)*S + j: the row-major index of (b, h, i, j)."""
    if case.dropout_p == 0:
        return None
    shape = (case.batch, case.query_heads, case.query_len, case.key_len)
    offsets = torch.arange(torch.Size(shape).numel(), dtype=torch.int64).reshape(shape)
    keep = philox_uniform(seed, offsets) >= case.dropout_p
    return keep.double() / (1 - case.dropout_p)


def naive_attention(query, key, value, mask, keep_scale, is_causal, causal_offset, scale):
    """Materialised attention in the dtype of its inputs; rows without a visible key give 0."""
    group = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(group, dim=1)
    value = value.repeat_interleave(group, dim=1)
    scores = scale * (query @ key.transpose(-2, -1))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    if is_causal:
        rows = torch.arange(query.shape[2])[:, None]
        cols = torch.arange(key.shape[2])[None, :]
        scores = scores.masked_fill(cols > rows + causal_offset, float("-inf"))
    dead = (scores == float("-inf")).all(dim=-1, keepdim=True)
    scores = scores.masked_fill(dead, 0.0)
    lse = torch.logsumexp(scores, dim=-1).masked_fill(dead.squeeze(-1), float("-inf"))
    probs = torch.softmax(scores, dim=-1).masked_fill(dead, 0.0)
    if keep_scale is not None:
        probs = probs * keep_scale.to(probs.dtype)
    # A float32 mask promotes fp16 scores; eager code would cast back before the matmul.
    return probs.to(value.dtype) @ value, lse


@dataclass
class Problem:
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    mask: Optional[torch.Tensor]
    grad_out: torch.Tensor
    seed: int
    scale: float


def _make_problem(case: Case, dtype: torch.dtype, zero_grad_on_floor_rows: bool = True) -> Problem:
    generator = torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))
    strided = case.non_contiguous
    q = _randn((case.batch, case.query_heads, case.query_len, case.head_dim), generator, strided, dtype)
    k = _randn((case.batch, case.kv_heads, case.key_len, case.head_dim), generator, strided, dtype)
    v = _randn((case.batch, case.kv_heads, case.key_len, case.value_dim), generator, strided, dtype)
    grad_out = _randn((case.batch, case.query_heads, case.query_len, case.value_dim), generator, False, dtype)
    mask = _make_mask(case, generator)
    if mask is not None and mask.is_floating_point():
        mask_dtype = case.mask_dtype or dtype
        if case.mask == "finfo_min":
            mask = mask.masked_fill(mask.isneginf(), torch.finfo(mask_dtype).min)
        mask = _cast_keeping_broadcast(mask, mask_dtype)
        if zero_grad_on_floor_rows:
            grad_out[_floor_rows(mask)] = 0
    seed = int(torch.randint(2**32, 2**62, (1,), generator=generator))
    return Problem(q, k, v, mask, grad_out, seed, scale=case.head_dim**-0.5)


def _floor_rows(mask: Optional[torch.Tensor]) -> torch.Tensor:
    """(B, Hq, L) rows whose every key is masked at or below the -1e38 clamp (finfo.min rows).

    Their output is exact (uniform over the keys), but their lse is about -1e38, where a float
    has no room left for log(number of keys), so P = exp(s - lse) would be 1 per key instead of
    1 / S; the backward recovers each such row's max and log-sum in an extra pass. The main tests
    give such rows a zero grad_out, as padded query rows get in practice;
    test_floor_row_gradient_is_exact checks them with a real one.
    """
    if mask is None or not mask.is_floating_point():
        return torch.zeros(mask.shape[:3] if mask is not None else (0,), dtype=torch.bool)
    return (mask <= -1e38).all(dim=-1) & mask.isfinite().any(dim=-1)


def _cast_keeping_broadcast(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast a possibly expanded mask without materialising it: cast the base, re-expand."""
    base_index = tuple(slice(0, 1) if stride == 0 else slice(None) for stride in mask.stride())
    return mask[base_index].to(dtype).expand(mask.shape)


def _run_reference(problem: Problem, case: Case, grad_lse: Optional[torch.Tensor] = None):
    seed_tensor = torch.tensor([problem.seed], dtype=torch.int64) if case.dropout_p > 0 else None
    common = dict(
        rng_seed=seed_tensor,
        dropout_p=case.dropout_p,
        is_causal=case.causal is not None,
        causal_offset=_causal_offset(case),
        scale=problem.scale,
    )
    out, lse = reference_forward(problem.query, problem.key, problem.value, problem.mask, **common)
    wants_mask_grad = problem.mask is not None and problem.mask.is_floating_point()
    grads = reference_backward(
        problem.grad_out, problem.query, problem.key, problem.value, problem.mask, out, lse,
        compute_mask_grad=wants_mask_grad, grad_lse=grad_lse, **common,
    )
    return out, lse, grads


def _run_naive(problem: Problem, case: Case, dtype: torch.dtype, grad_lse: Optional[torch.Tensor] = None):
    """Naive attention and its autograd gradients, with all tensors cast to `dtype`."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (problem.query, problem.key, problem.value)]
    mask = problem.mask
    mask_leaf = None
    if mask is not None and mask.is_floating_point():
        # A dense leaf, so its gradient is the (B, Hq, L, S) dmask the reference returns.
        mask_dtype = dtype if dtype == torch.float64 else mask.dtype
        mask = mask_leaf = mask.detach().to(mask_dtype).contiguous().requires_grad_()
    out, lse = naive_attention(
        *leaves, mask, _dropout_keep_scale(case, problem.seed),
        case.causal is not None, _causal_offset(case), problem.scale,
    )
    if grad_lse is None:
        out.backward(problem.grad_out.to(dtype))
    else:
        torch.autograd.backward([out, lse], [problem.grad_out.to(dtype), grad_lse.to(lse.dtype)])
    grads = [leaf.grad for leaf in leaves] + ([mask_leaf.grad] if mask_leaf is not None else [])
    return out.detach(), lse.detach(), grads


def _max_error(actual: torch.Tensor, truth: torch.Tensor) -> float:
    """Max abs difference in float64; -inf must appear in exactly the same places."""
    actual, truth = actual.double(), truth.double()
    assert not actual.isnan().any(), "NaN in result"
    assert torch.equal(actual.isneginf(), truth.isneginf()), "-inf in different places"
    finite = truth.isfinite()
    if not finite.any():
        return 0.0
    return (actual[finite] - truth[finite]).abs().max().item()


def _assert_close(name, actual, truth, same_dtype_naive, dtype):
    error = _max_error(actual, truth)
    magnitude = truth[truth.isfinite()].abs().max().item() if truth.isfinite().any() else 0.0
    if dtype == torch.float64:
        # A result stored in a narrower dtype (a float32 mask's gradient) also carries its rounding.
        rounding = 0.0 if actual.dtype == torch.float64 else torch.finfo(actual.dtype).eps * magnitude
        bound = 1e-10 * magnitude + rounding
    else:
        # Floor: the flash backward recomputes P = exp(s - lse), which turns a few float32 ulps of
        # |s| and |lse| into relative error of P; the naive autograd keeps P and never sees it.
        bound = 2 * _max_error(same_dtype_naive, truth) + 16 * torch.finfo(torch.float32).eps * magnitude
    assert error <= bound, f"{name}: error {error:.3e} > bound {bound:.3e}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_reference_matches_naive_fp64(case: Case, dtype: torch.dtype):
    problem = _make_problem(case, dtype)
    out, lse, (dq, dk, dv, dmask) = _run_reference(problem, case)

    assert out.dtype == dtype and out.is_contiguous()
    assert out.shape == (case.batch, case.query_heads, case.query_len, case.value_dim)
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert lse.shape == (case.batch, case.query_heads, case.query_len)
    assert (dq.dtype, dk.dtype, dv.dtype) == (dtype, dtype, dtype)
    assert (dq.shape, dk.shape, dv.shape) == (problem.query.shape, problem.key.shape, problem.value.shape)

    truth_out, truth_lse, truth_grads = _run_naive(problem, case, torch.float64)
    naive_out, naive_lse, naive_grads = (
        (truth_out, truth_lse, truth_grads) if dtype == torch.float64 else _run_naive(problem, case, dtype)
    )
    _assert_close("out", out, truth_out, naive_out, dtype)
    floor = _floor_rows(problem.mask)
    if floor.any():
        # The contract clamps the mask to -1e38, so these rows' lse is that, not finfo.min + log S.
        assert torch.allclose(lse[floor].double(), torch.tensor(-1e38, dtype=torch.float64), rtol=1e-6)
        lse, truth_lse, naive_lse = lse[~floor], truth_lse[~floor], naive_lse[~floor]
    _assert_close("lse", lse, truth_lse, naive_lse, dtype)
    ours = [dq, dk, dv]
    if problem.mask is not None and problem.mask.is_floating_point():
        assert dmask.dtype == problem.mask.dtype and dmask.shape == problem.mask.shape
        ours.append(dmask)
    else:
        assert dmask.numel() == 0
    for name, grad, truth, naive in zip(["dq", "dk", "dv", "dmask"], ours, truth_grads, naive_grads):
        _assert_close(name, grad, truth, naive, dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16], ids=str)
@pytest.mark.parametrize("case_name", ["L300_S129_causal_bottom_right_dead_rows", "dead_rows_bool", "dead_rows_float_causal", "key_len_0"])
def test_fully_masked_rows_are_exact_zeros(case_name: str, dtype: torch.dtype):
    case = CASES[case_name]
    problem = _make_problem(case, dtype)
    out, lse, (dq, _, _, dmask) = _run_reference(problem, case)
    dead = lse.isneginf()
    assert dead.any()
    assert (out[dead] == 0).all() and (dq[dead] == 0).all()
    if dmask.numel():
        assert (dmask[dead] == 0).all()
    for tensor in (out, lse, dq, dmask):
        assert not tensor.isnan().any()


def _assert_independent_of(monkeypatch, case: Case, setting: str, values) -> None:
    """The float64 forward and backward of ``case`` agree to 1e-12 whatever ``reference.<setting>``."""
    problem = _make_problem(case, torch.float64)
    results = []
    for value in values:
        monkeypatch.setattr(reference, setting, value)
        out, lse, grads = _run_reference(problem, case)
        results.append([out, lse, *grads])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_result_does_not_depend_on_key_chunk(monkeypatch):
    _assert_independent_of(monkeypatch, replace(CASES["dropout_causal_float_mask"], key_len=300), "KEY_CHUNK",
                           (5, 128, 1000))


@pytest.mark.parametrize("case_name", ["dropout_causal_float_mask", "L300_S7_mqa_bool_mask_causal_top_left",
                                       "L129_S300_causal_bottom_right_float_broadcast_noncontig",
                                       "L300_S129_causal_bottom_right_dead_rows"])
def test_result_does_not_depend_on_row_block(monkeypatch, case_name):
    """The causal forward takes the query rows in blocks; the block size changes only rounding."""
    _assert_independent_of(monkeypatch, CASES[case_name], "ROW_BLOCK", (7, 64, 10**6))


@pytest.mark.parametrize("window, causal", [(None, True), ((40, 30), False), ((-1, 0), True)], ids=str)
def test_row_blocks_with_a_window_and_a_block_layout(monkeypatch, window, causal):
    generator = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 4, 300, 16, generator=generator, dtype=torch.float64) for _ in range(3))
    layout = (torch.rand(1, 4, 5, 5, generator=generator) < 0.7, 64, 64)
    seed = torch.tensor([11], dtype=torch.int64)
    results = []
    for rows in (32, 10**6):
        monkeypatch.setattr(reference, "ROW_BLOCK", rows)
        results.append(reference_forward(q, k, v, None, seed, 0.2, causal, 0, 0.25, window=window,
                                         block_layout=layout))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_causal_forward_visits_only_the_key_chunks_each_row_block_reaches(monkeypatch):
    """L = S = 1024, 128-key chunks, 256-row blocks: 2 + 4 + 6 + 8 = 20 chunk visits, not 32."""
    monkeypatch.setattr(reference, "ROW_BLOCK", 256)
    monkeypatch.setattr(reference, "KEY_CHUNK", 128)
    visits = []
    scores = reference._chunk_scores
    monkeypatch.setattr(reference, "_chunk_scores", lambda *args: visits.append(args[-2:]) or scores(*args))
    q = k = v = torch.randn(1, 1, 1024, 8)
    reference_forward(q, k, v, None, None, 0.0, True, 0, 1.0)
    assert len(visits) == 20
    visits.clear()
    reference_forward(q, k, v, None, None, 0.0, False, 0, 1.0)
    assert len(visits) == 8


def test_dropout_p_without_seed_names_the_argument():
    case = CASES["plain_L7_S129_E40_Ev24"]
    problem = _make_problem(case, torch.float32)
    with pytest.raises(ValueError, match="rng_seed"):
        reference_forward(problem.query, problem.key, problem.value, None, None, 0.5, False, 0, 1.0)


@pytest.mark.parametrize("case_name", ["L1_S300_E80_gqa_float_mask", "dropout_causal_float_mask", "L300_S129_causal_bottom_right_dead_rows"])
def test_lse_gradient(case_name: str):
    case = CASES[case_name]
    problem = _make_problem(case, torch.float64)
    generator = torch.Generator().manual_seed(7)
    grad_lse = torch.randn((case.batch, case.query_heads, case.query_len), generator=generator, dtype=torch.float64)
    _, _, ours = _run_reference(problem, case, grad_lse)
    _, _, truth = _run_naive(problem, case, torch.float64, grad_lse)
    for name, grad, expected in zip(["dq", "dk", "dv", "dmask"], ours, truth):
        _assert_close(name, grad, expected, expected, torch.float64)


def test_floor_row_gradient_is_exact():
    """Rows at the mask clamp: lse alone cannot give P (see _floor_rows); the backward's extra
    pass over those rows' keys must recover the uniform P = 1 / S and so the exact gradient."""
    case = CASES["finfo_min_fp32_mask"]
    problem = _make_problem(case, torch.float32, zero_grad_on_floor_rows=False)
    _, _, (dq, _, _, _) = _run_reference(problem, case)
    _, _, (truth_dq, *_) = _run_naive(problem, case, torch.float64)
    floor = _floor_rows(problem.mask)
    torch.testing.assert_close(dq[floor].double(), truth_dq[floor], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_exact_delta_on_near_tied_keys(dtype):
    """With 16-bit inputs the stored O is rounded, so rowsum(dO * O) is off by u |dO| |O| per row,
    and keys sharing a large component (near-tied logits) carry that into dq. The reference path
    forms Delta from P and dP instead: dq, dk and dv meet the tolerance rule against SDPA's math
    backend (fp32 P, no Delta), while exact_delta=False (FlashAttention-2's Delta) misses it on dq."""
    q, k, v, dout = near_tied_qkv((1, 2, 48, 16), dtype, "cpu")
    scale = q.shape[-1] ** -0.5
    truth = ref_forward_backward(q, k, v, scale=scale, grad_out=dout)
    with sdpa_kernel(SDPBackend.MATH):
        base = sdpa_baseline(q, k, v, scale=scale, grad_out=dout)
    out, lse = reference_forward(q, k, v, None, None, 0.0, False, 0, scale)
    grads = {}
    for exact in (True, False):
        dq, dk, dv, _ = reference_backward(dout, q, k, v, None, out, lse, None, 0.0, False, 0, scale, False,
                                           exact_delta=exact)
        grads[exact] = dict(dq=dq, dk=dk, dv=dv)
    for name in ("dq", "dk", "dv"):
        assert_close_to_ref(name, grads[True][name], truth[name], base[name], terms=truth["terms"][name])
    with pytest.raises(AssertionError, match="dq: max error"):
        assert_close_to_ref("dq", grads[False]["dq"], truth["dq"], base["dq"], terms=truth["terms"]["dq"])


def test_nan_input_propagates_instead_of_passing_for_a_masked_row():
    """A NaN score makes the row's running sum NaN; the row must come out NaN (as in the kernel and
    in SDPA), not be mistaken for a row with no visible key and silently return 0."""
    generator = torch.Generator().manual_seed(3)
    query, key, value = (torch.randn((1, 1, 5, 4), generator=generator) for _ in range(3))
    query[0, 0, 2, 1] = float("nan")
    out, lse = reference_forward(query, key, value, None, None, 0.0, False, 0, 0.5)
    assert out[0, 0, 2].isnan().all() and lse[0, 0, 2].isnan()
    assert out[0, 0, [0, 1, 3, 4]].isfinite().all()
