"""Shared test helpers: the float64 ground truth, same-dtype baselines, the tolerance rule and
random inputs.

Tolerance (FlashAttention's model): for every result ``x``,

    max|ours - fp64| <= 2 * max|pytorch_same_dtype - fp64| + floor
    floor = FLOOR_ULPS * eps(dtype) * max|fp64| + ARITH_ULPS * eps(fp32) * max sum|terms|

where "pytorch_same_dtype" is ``scaled_dot_product_attention`` in the input dtype (its fused and
CPU-flash paths accumulate in fp32). Where that baseline is non-finite (fully-masked rows give
NaN in SDPA) it is measured on its finite entries only; fully-masked rows are checked separately
and exactly (out 0, lse -inf, zero gradients).
"""

from __future__ import annotations

import importlib.util
import math
import warnings
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F

# No flash_inductor import at module level: conftest imports this module before it sets
# TRITON_INTERPRET, and flash_inductor's kernels import triton.language, whose own @jit helpers
# must be created after that variable is set.

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_CUDA = DEVICE == "cuda"

def spy_on_launches(monkeypatch, record) -> None:
    """Call ``record(kernel_name, launch_kwargs)`` at every kernel launch our launchers make
    (``launch.common.launcher``), then launch as usual."""
    from flash_inductor.launch import common

    real = common.launcher

    class Spied:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def call(*args, **kwargs):
                record(self.kernel.__name__, kwargs)
                return real(self.kernel)[grid](*args, **kwargs)
            return call

    monkeypatch.setattr(common, "launcher", Spied)


# Under the Triton interpreter (no GPU) bf16 is emulated through NumPy, which has no bf16 type;
# its results are not reliable. This is a limitation of the environment, not of the kernels, so
# interpreter runs cover fp16 and fp32 and the GPU run adds bf16.
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32) if ON_CUDA else (torch.float16, torch.float32)

# Rounding floor of the tolerance: FLOOR_ULPS ulps of the result's dtype at the result's magnitude,
# plus ARITH_ULPS ulps of the compute dtype (fp32 in the kernels) at the magnitude of the terms the
# result is summed from (see assert_close_to_ref).
FLOOR_ULPS = 2
ARITH_ULPS = 4

_DTYPE_IDS = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.float64: "fp64",
}


def dtype_id(dtype: torch.dtype) -> str:
    return _DTYPE_IDS[dtype]


# ------------------------------------------------------------------------------------------
# Random inputs
# ------------------------------------------------------------------------------------------


def randn(shape, dtype, device, seed, mult=1.0, generator=None) -> torch.Tensor:
    """Seeded standard-normal data (drawn on the CPU so CPU and GPU runs see the same values)."""
    g = generator if generator is not None else torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * mult).to(dtype).to(device)


def make_qkv(batch, heads_q, heads_kv, seq_q, seq_k, head_dim, head_dim_v, dtype, device, *, seed=0,
             noncontig=False, q_mult=1.0, k_mult=1.0, v_mult=1.0):
    """(B, Hq, L, E), (B, Hkv, S, E), (B, Hkv, S, Ev).

    ``noncontig`` builds each tensor as (B, seq, H, dim) and transposes it to (B, H, seq, dim),
    the layout a projection followed by ``.transpose(1, 2)`` produces.
    """
    g = torch.Generator().manual_seed(seed)

    def one(heads, seq, dim, mult):
        if noncontig:
            return randn((batch, seq, heads, dim), dtype, device, 0, mult, generator=g).transpose(1, 2)
        return randn((batch, heads, seq, dim), dtype, device, 0, mult, generator=g)

    return (
        one(heads_q, seq_q, head_dim, q_mult),
        one(heads_kv, seq_k, head_dim, k_mult),
        one(heads_kv, seq_k, head_dim_v, v_mult),
    )


def near_tied_qkv(shape, dtype, device, seed=0):
    """q, k, v, dO of ``shape`` (B, H, L, E), the keys one shared vector c (|c_e| ~ 50) plus a
    perturbation of a few ulps of the dtype at 50 (0.05 in fp16, 0.5 in bf16 and wider): logits
    of order 50 within a few 16-bit ulps of each other (the stability suite's near_tied case)."""
    g = torch.Generator().manual_seed(seed)
    spread = 0.05 if dtype == torch.float16 else 0.5
    shared = torch.randn((*shape[:2], 1, shape[3]), generator=g, dtype=torch.float64) * 50.0
    key = (shared + spread * torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype).to(device)
    query, value, grad_out = (randn(shape, dtype, device, 0, generator=g) for _ in range(3))
    return query, key, value, grad_out


def make_mask(kind: str, batch, heads_q, seq_q, seq_k, dtype, device, seed=1):
    """A (B, Hq, L, S)-broadcastable mask; ``*_bcast`` kinds return a stride-0 expanded view.

    kinds: none, bool, float (randn with ~15% -inf), bool_bcast ((B, 1, L, S) expanded),
    float_bcast ((B, 1, 1, S) key-padding style, expanded), bool_dead_rows / float_dead_rows
    (rows 0, L // 2 and L - 1 see no key), finfo_min (entries at finfo(dtype).min).
    """
    full = (batch, heads_q, seq_q, seq_k)
    g = torch.Generator().manual_seed(seed)
    if kind == "none":
        return None
    if kind == "bool":
        return (torch.rand(full, generator=g) < 0.75).to(device)
    if kind == "float":
        values = torch.randn(full, generator=g, dtype=torch.float64)
        values = values.masked_fill(torch.rand(full, generator=g) < 0.15, float("-inf"))
        return values.to(dtype).to(device)
    if kind == "bool_bcast":
        small = torch.rand((batch, 1, seq_q, seq_k), generator=g) < 0.7
        return small.to(device).expand(full)
    if kind == "float_bcast":
        small = torch.randn((batch, 1, 1, seq_k), generator=g, dtype=torch.float64)
        padded = torch.rand((batch, 1, 1, seq_k), generator=g) < 0.2
        padded[..., 0] = False  # every row keeps at least one key
        small = small.masked_fill(padded, float("-inf"))
        return small.to(dtype).to(device).expand(full)
    if kind in ("bool_dead_rows", "float_dead_rows"):
        dead = sorted({0, seq_q // 2, seq_q - 1})
        if kind == "bool_dead_rows":
            mask = torch.rand(full, generator=g) < 0.75
            mask[:, :, dead, :] = False
        else:
            mask = torch.randn(full, generator=g, dtype=torch.float64)
            mask[:, :, dead, :] = float("-inf")
            mask = mask.to(dtype)
        return mask.to(device)
    if kind == "finfo_min_rows":
        # Rows 0 and L // 2 entirely at finfo(dtype).min (HF-style padding of a query row): SDPA
        # gives them uniform attention over the keys (for fp32, finfo.min swamps the scores).
        values = torch.randn(full, generator=g, dtype=torch.float64).to(dtype)
        values[:, :, sorted({0, seq_q // 2}), :] = torch.finfo(dtype).min
        return values.to(device)
    if kind == "finfo_min":
        # HF-style additive masks: finfo(dtype).min instead of -inf, on about half the entries;
        # every row keeps at least one finite key.
        values = torch.randn(full, generator=g, dtype=torch.float64).to(dtype)
        hidden = torch.rand(full, generator=g) < 0.5
        hidden[..., 0] = False
        return values.masked_fill(hidden, torch.finfo(dtype).min).to(device)
    raise AssertionError(kind)


def dropout_keep(seed: int, batch, heads_q, seq_q, seq_k, dropout_p, device) -> torch.Tensor:
    """The keep mask the package draws: element (b, h, i, j) is kept iff
    ``tl.rand(seed, ((b*Hq + h)*L + i)*S + j) >= p`` (the Philox re-implementation is itself
    checked bit-for-bit against ``tl.rand`` in test_reference.py)."""
    from flash_inductor.ops.philox import philox_uniform

    shape = (batch, heads_q, seq_q, seq_k)
    offsets = torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape)
    return (philox_uniform(seed, offsets) >= dropout_p).to(device)


# ------------------------------------------------------------------------------------------
# Ground truth
# ------------------------------------------------------------------------------------------


def causal_visible(seq_q, seq_k, offset, device) -> torch.Tensor:
    """(L, S) bool: key j is visible to query i iff j <= i + offset."""
    i = torch.arange(seq_q, device=device)[:, None]
    j = torch.arange(seq_k, device=device)[None, :]
    return j <= i + offset


def launch_visibility(causal_offset: Optional[int] = None, **rules):
    """The launchers' ``launch.Visibility`` in these helpers' convention: ``causal_offset`` None is
    not causal; ``rules`` are its other fields (``window``, ``block_map``, ``block_q``, ``block_k``)."""
    from flash_inductor.launch import Visibility

    return Visibility(is_causal=causal_offset is not None, causal_offset=causal_offset or 0, **rules)


def visibility(query, key, attn_mask, causal_offset) -> torch.Tensor:
    """(..., Hq, L, S) bool: which scores are not masked (before dropout)."""
    seq_q, seq_k = query.shape[-2], key.shape[-2]
    shape = (*query.shape[:-1], seq_k)
    vis = torch.ones(shape, dtype=torch.bool, device=query.device)
    if attn_mask is not None:
        vis = vis & (attn_mask if attn_mask.dtype == torch.bool else ~attn_mask.isneginf())
    if causal_offset is not None:
        vis = vis & causal_visible(seq_q, seq_k, causal_offset, query.device)
    return vis


def _repeat_kv(query, t):
    if t.dim() >= 3 and query.shape[-3] != t.shape[-3]:
        return t.repeat_interleave(query.shape[-3] // t.shape[-3], dim=-3)
    return t


def attention_ref(query, key, value, attn_mask=None, *, causal_offset=None, scale=None,
                  dropout_mask=None, dropout_p=0.0, compute_dtype=torch.float64):
    """Naive materialised attention in ``compute_dtype`` (float64 for the ground truth).

    SDPA semantics plus the package's conventions: a row with no visible key has output 0 and
    lse -inf (and zero gradients, never NaN); causal means key j visible to query i iff
    j <= i + causal_offset (None = not causal); GQA by repeat_interleave of K/V (here only);
    dropout by an explicit boolean keep mask, kept probabilities scaled by 1 / (1 - p).
    Differentiable in every floating input. Returns (out, lse).
    """
    cd = compute_dtype
    q, k, v = query.to(cd), _repeat_kv(query, key).to(cd), _repeat_kv(query, value).to(cd)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if k.shape[-2] == 0:
        # No key: output 0, but still a function of every input (zero gradients, not None).
        inputs_sum = q.sum() + k.sum() + v.sum()
        if attn_mask is not None and attn_mask.is_floating_point():
            inputs_sum = inputs_sum + attn_mask.to(cd).sum()
        out = q.new_zeros((*q.shape[:-1], v.shape[-1])) + 0 * inputs_sum
        lse = q.new_full(q.shape[:-1], float("-inf"))
        return out, lse
    scores = (q @ k.transpose(-2, -1)) * scale
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.to(cd)
    if causal_offset is not None:
        scores = scores.masked_fill(~causal_visible(q.shape[-2], k.shape[-2], causal_offset, q.device),
                                    float("-inf"))
    # Softmax is shift-invariant, so the max is a constant for autograd; rows with no visible key
    # (max -inf) shift by 0 instead of forming -inf - -inf.
    row_max = scores.detach().amax(dim=-1, keepdim=True)
    row_max = row_max.masked_fill(row_max.isneginf(), 0.0)
    unnorm = torch.exp(scores - row_max)
    row_sum = unnorm.sum(dim=-1, keepdim=True)
    has_key = row_sum > 0
    safe_sum = torch.where(has_key, row_sum, torch.ones_like(row_sum))
    probs = unnorm / safe_sum
    lse = torch.where(has_key, row_max + torch.log(safe_sum), float("-inf")).squeeze(-1)
    if dropout_mask is not None:
        probs = probs * dropout_mask.to(cd) / (1.0 - dropout_p)
    return probs @ v, lse


def ref_forward_backward(query, key, value, attn_mask=None, *, causal_offset=None, scale=None,
                         dropout_mask=None, dropout_p=0.0, grad_out=None, grad_lse=None,
                         mask_grad=False):
    """float64 out, lse and (when grad_out is given) dq, dk, dv, dmask by autograd.

    With ``mask_grad`` the float mask is differentiated as a dense leaf of its own shape: pass the
    mask whose gradient you want (an expanded view gives the per-element dS; a small broadcast
    mask gives the gradient summed back to its shape).
    """
    leaves = [t.detach().double().requires_grad_(grad_out is not None) for t in (query, key, value)]
    mask = attn_mask
    if mask is not None and mask.is_floating_point():
        mask = mask.detach().double().contiguous().requires_grad_(mask_grad and grad_out is not None)
    out, lse = attention_ref(*leaves, mask, causal_offset=causal_offset, scale=scale,
                             dropout_mask=dropout_mask, dropout_p=dropout_p)
    result = dict(out=out.detach(), lse=lse.detach())
    if grad_out is None:
        return result
    outputs, grads = [out], [grad_out.double()]
    if grad_lse is not None:
        outputs.append(lse)
        grads.append(grad_lse.double())
    torch.autograd.backward(outputs, grads)
    result.update(dq=leaves[0].grad, dk=leaves[1].grad, dv=leaves[2].grad)
    if mask_grad:
        result["dmask"] = mask.grad
    result["terms"] = _term_magnitudes(*leaves, mask, causal_offset, scale, dropout_mask, dropout_p,
                                       grad_out, grad_lse, result["out"])
    return result


@torch.no_grad()
def _term_magnitudes(query, key, value, mask, causal_offset, scale, dropout_mask, dropout_p, grad_out,
                     grad_lse, out) -> dict:
    """Largest sum of |terms| behind each result, e.g. max_i scale * sum_j |dS_ij| |k_j| for dq with
    |dS_ij| <= P_ij (|dP_ij| + |Delta_i|). The fp32 arithmetic of any flash kernel errs in proportion
    to these, not to the result: with S = 1, dq is exactly 0 while dP and Delta are O(1)."""
    q, k, v = query.double(), _repeat_kv(query, key).double(), _repeat_kv(query, value).double()
    if k.shape[-2] == 0 or q.shape[-2] == 0:
        return {}
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    probs = attention_ref(q, k, torch.eye(k.shape[-2], dtype=q.dtype, device=q.device).expand(
        *k.shape[:-1], k.shape[-2]), mask, causal_offset=causal_offset, scale=scale)[0]
    dropped = probs if dropout_mask is None else probs * dropout_mask.double() / (1.0 - dropout_p)
    dout = grad_out.double()
    grad_probs = dout @ v.transpose(-2, -1)
    if dropout_mask is not None:
        grad_probs = grad_probs * dropout_mask.double() / (1.0 - dropout_p)
    delta = (dout * out.double()).sum(-1, keepdim=True)
    if grad_lse is not None:
        delta = delta - grad_lse.double()[..., None]
    ds_terms = probs * (grad_probs.abs() + delta.abs())

    def group_sum(t):  # (..., Hq, S, D) -> (..., Hkv, S, D)
        if query.dim() >= 3 and key.shape[-3] != query.shape[-3]:
            return t.unflatten(-3, (key.shape[-3], -1)).sum(-3)
        return t

    return dict(
        out=(dropped @ v.abs()).max().item(),
        dv=group_sum(dropped.transpose(-2, -1) @ dout.abs()).max().item(),
        dq=scale * (ds_terms @ k.abs()).max().item(),
        dk=scale * group_sum(ds_terms.transpose(-2, -1) @ q.abs()).max().item(),
        # A broadcast mask's gradient sums dS over the broadcast dims.
        dmask=(ds_terms.sum_to_size(mask.shape) if mask is not None else ds_terms).max().item(),
    )


# ------------------------------------------------------------------------------------------
# Same-dtype baselines
# ------------------------------------------------------------------------------------------


def _baseline_problem(query, key, attn_mask, causal_offset, grad_out, grad_lse):
    """Mask and upstream gradients for a baseline run, with fully-masked rows neutralised.

    SDPA turns a row with no visible key into NaN, and NaN in dS spreads to every dK/dV row. The
    baseline therefore lets such a row see key 0 and gives it a zero upstream gradient: in exact
    arithmetic that changes nothing in the other rows (their out, dq, dk, dv and dmask), and the
    rows themselves are excluded from the baseline error and checked exactly instead.
    Returns (mask for the baseline or None, is_causal flag, grad_out, grad_lse).
    """
    seq_q, seq_k = query.shape[-2], key.shape[-2]
    if causal_offset == 0 and attn_mask is None:
        return None, True, grad_out, grad_lse
    mask = attn_mask
    if causal_offset is not None:
        causal = causal_visible(seq_q, seq_k, causal_offset, query.device)
        if mask is None:
            mask = causal
        elif mask.dtype == torch.bool:
            mask = mask & causal
        else:
            mask = torch.where(causal, mask, torch.full_like(mask, float("-inf")))
    if mask is None:
        return None, False, grad_out, grad_lse
    vis = visibility(query, key, mask, None)
    dead = ~vis.any(dim=-1)
    if dead.any():
        first_key = torch.zeros(seq_k, dtype=torch.bool, device=query.device)
        first_key[0] = True
        patch = dead[..., None] & first_key
        # torch.where broadcasts, so a small (broadcast) mask leaf still receives its summed grad.
        mask = mask | patch if mask.dtype == torch.bool else torch.where(patch, 0.0, mask)
        if grad_out is not None:
            grad_out = grad_out.masked_fill(dead[..., None], 0.0)
        if grad_lse is not None:
            grad_lse = grad_lse.masked_fill(dead, 0.0)
    return mask, False, grad_out, grad_lse


def sdpa_baseline(query, key, value, attn_mask=None, *, causal_offset=None, scale=None,
                  dropout_mask=None, dropout_p=0.0, grad_out=None, grad_lse=None, mask_grad=False,
                  naive=False):
    """PyTorch's own computation in the input dtype: out and (with grad_out) dq, dk, dv, dmask.

    ``scaled_dot_product_attention`` (dropout through the math path's explicit ``dropout_mask``).
    SDPA cannot take an upstream gradient for the log-sum-exp; with ``grad_lse`` (or ``naive``)
    the baseline is the naive materialised attention run in the input dtype instead.
    """
    if key.shape[-2] == 0:
        zeros = dict(out=query.new_zeros((*query.shape[:-1], value.shape[-1])))
        if grad_out is not None:
            zeros.update(dq=torch.zeros_like(query), dk=torch.zeros_like(key), dv=torch.zeros_like(value))
            if mask_grad:
                zeros["dmask"] = torch.zeros_like(attn_mask)
        return zeros
    needs_grad = grad_out is not None
    mask_leaf = None
    mask = attn_mask
    if mask is not None and mask.is_floating_point():
        mask = mask_leaf = mask.detach().clone().requires_grad_(mask_grad and needs_grad)
    mask, is_causal, grad_out, grad_lse = _baseline_problem(query, key, mask, causal_offset, grad_out, grad_lse)
    leaves = [t.detach().clone().requires_grad_(needs_grad) for t in (query, key, value)]
    q, k, v = leaves
    enable_gqa = q.dim() >= 3 and q.shape[-3] != k.shape[-3]
    if naive or grad_lse is not None:
        out, lse = attention_ref(q, k, v, mask, causal_offset=(0 if is_causal else None), scale=scale,
                                 dropout_mask=dropout_mask, dropout_p=dropout_p, compute_dtype=q.dtype)
    elif dropout_mask is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Dropout mask should only be used for testing purposes"
            out, _ = torch.ops.aten._scaled_dot_product_attention_math(
                q, k, v, mask, dropout_p, is_causal, dropout_mask, scale=scale, enable_gqa=enable_gqa
            )
        lse = None
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                             enable_gqa=enable_gqa)
        lse = None
    result = dict(out=out.detach())
    if needs_grad:
        outputs, grads = [out], [grad_out]
        if grad_lse is not None:
            outputs.append(lse)
            grads.append(grad_lse.to(lse.dtype))
        torch.autograd.backward(outputs, grads)
        result.update(dq=q.grad, dk=k.grad, dv=v.grad)
        if mask_grad:
            result["dmask"] = mask_leaf.grad
    return result


def lse_baseline(query, key, attn_mask=None, *, causal_offset=None, scale=None) -> torch.Tensor:
    """The LSE the kernels produce is fp32: PyTorch's fp32 log-sum-exp of the same scores."""
    value = key[..., :1]
    _, lse = attention_ref(query, key, value, attn_mask, causal_offset=causal_offset, scale=scale,
                           compute_dtype=torch.float32)
    return lse


# ------------------------------------------------------------------------------------------
# Errors and the tolerance rule
# ------------------------------------------------------------------------------------------


def max_abs_error(actual: torch.Tensor, truth: torch.Tensor, where: Optional[torch.Tensor] = None) -> float:
    diff = (actual.double() - truth.double()).abs()
    if where is not None:
        diff = diff[where]
    return diff.max().item() if diff.numel() else 0.0


def assert_close_to_ref(name: str, ours: torch.Tensor, ref: torch.Tensor, baseline: Optional[torch.Tensor],
                        where: Optional[torch.Tensor] = None, terms: Optional[float] = None) -> None:
    """The project's tolerance rule (module docstring). Non-finite reference entries (lse = -inf)
    must be matched exactly; everywhere else ours must be finite. ``baseline=None`` means the
    result must agree with the fp64 reference within the rounding floor alone. ``where`` restricts
    every check to those entries (e.g. where the fp64 value is representable in the dtype).

    The floor is FLOOR_ULPS ulps of the result's dtype at the result's magnitude (its final
    rounding) plus ARITH_ULPS ulps of the compute dtype (fp32, or fp64 for fp64 inputs) at
    ``terms``, the magnitude of the terms summed to form it (see _term_magnitudes; default: the
    result's magnitude)."""
    ours = ours.detach()
    ref = ref.detach().double().to(ours.device)
    assert ours.shape == ref.shape, f"{name}: shape {tuple(ours.shape)} != reference {tuple(ref.shape)}"
    if where is not None:
        ours, ref = ours[where], ref[where]
        baseline = baseline[where] if baseline is not None else None
    assert not ours.isnan().any(), f"{name}: NaN in result ({ours.isnan().sum().item()} entries)"
    finite = ref.isfinite()
    assert torch.equal(ours.double()[~finite], ref[~finite]), f"{name}: non-finite entries differ from the reference"
    assert ours[finite].isfinite().all(), f"{name}: inf where the reference is finite"
    err = max_abs_error(ours, ref, finite)
    base_err = 0.0
    if baseline is not None:
        baseline = baseline.detach().to(ours.device)
        assert baseline.shape == ref.shape, f"{name}: baseline shape {tuple(baseline.shape)}"
        usable = finite & baseline.isfinite()
        base_err = max_abs_error(baseline, ref, usable)
    magnitude = ref[finite].abs().max().item() if finite.any() else 0.0
    compute_dtype = torch.float64 if ours.dtype == torch.float64 else torch.float32
    terms = magnitude if terms is None else max(terms, magnitude)
    floor = FLOOR_ULPS * torch.finfo(ours.dtype).eps * magnitude + ARITH_ULPS * torch.finfo(compute_dtype).eps * terms
    bound = 2 * base_err + floor
    assert err <= bound, (
        f"{name}: max error {err:.3e} > 2 x baseline error {base_err:.3e} + floor {floor:.3e} "
        f"(|ref| <= {magnitude:.3e})"
    )


def assert_dead_rows_exact(query, key, attn_mask, causal_offset, out, lse=None, dq=None, dk=None, dv=None,
                           dmask=None) -> int:
    """Rows with no visible key: out == 0, lse == -inf, dq == 0, dmask == 0 exactly; keys that no
    query of their KV group sees: dk == dv == 0 exactly. Returns the number of dead rows."""
    vis = visibility(query, key, attn_mask, causal_offset)
    dead = ~vis.any(dim=-1)
    if dead.any():
        assert (out[dead] == 0).all(), "fully-masked rows: output is not exactly 0"
        if lse is not None:
            assert lse[dead].isneginf().all(), "fully-masked rows: lse is not -inf"
        if dq is not None:
            assert (dq[dead] == 0).all(), "fully-masked rows: dq is not exactly 0"
        if dmask is not None:
            assert (dmask[dead] == 0).all(), "fully-masked rows: dmask is not exactly 0"
    if dk is not None and query.dim() == 4:
        batch, heads_kv, seq_k = key.shape[0], key.shape[1], key.shape[2]
        group = query.shape[1] // heads_kv
        unseen = ~vis.reshape(batch, heads_kv, group * query.shape[2], seq_k).any(dim=2)
        if unseen.any():
            assert (dk[unseen] == 0).all(), "keys no query sees: dk is not exactly 0"
            assert (dv[unseen] == 0).all(), "keys no query sees: dv is not exactly 0"
    return int(dead.sum())


def small_and_full(small: Any, full: Any) -> list:
    """The two forms of a tool or experiment test, as parameters: ``small`` runs by default (CI),
    ``full`` (marker ``tools_full``) only with ``pytest -m tools_full``."""
    return [pytest.param(small, id="small"), pytest.param(full, id="full", marks=pytest.mark.tools_full)]


def _hopper_skip_reason():
    """Why the Gluon Hopper kernels cannot run here, or None on an sm_90 GPU with Gluon."""
    if not ON_CUDA:
        return "needs a CUDA GPU"
    if torch.cuda.get_device_capability() != (9, 0):
        return f"needs sm_90 (Hopper), this GPU is sm_{''.join(map(str, torch.cuda.get_device_capability()))}"
    try:
        from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma  # noqa: F401
    except Exception:
        return "this Triton has no Gluon Hopper support"
    return None


needs_hopper = pytest.mark.skipif(_hopper_skip_reason() is not None, reason=str(_hopper_skip_reason()))
needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="transformers is not installed (pip install -e '.[test]')")


def spy_on(monkeypatch, module, name: str) -> list:
    """Replace ``module.name`` by a pass-through that records each call's causal side (its
    ``visibility`` keyword's ``is_causal``); returns the list it appends to (which Hopper entry ran,
    and how often)."""
    calls = []
    real = getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(kwargs["visibility"].is_causal)
        return real(*args, **kwargs)
    monkeypatch.setattr(module, name, spy)
    return calls


class CudaLooking(torch.Tensor):
    """A CPU tensor that says it is on a GPU: for support checks that read metadata only."""

    @property
    def is_cuda(self):
        return True


def assert_training_steps_match_fp64(compiled, eager, golden, make_input, steps: int = 4) -> None:
    """Train ``steps`` steps of three copies of one module (under ``mode="reduce-overhead"`` the
    first steps warm up and record CUDA graphs, the rest replay them): ``compiled`` and ``eager``
    on ``make_input(step)``, ``golden`` (its fp64 copy) on that input in fp64, each with the loss
    sum(out²) formed in fp64. Each step's out and every parameter's gradient of ``compiled`` must
    meet the tolerance rule against ``golden``, with ``eager``'s error as the baseline."""
    names = ["out", *(name for name, _ in eager.named_parameters())]
    for step in range(steps):
        x = make_input(step)
        results = []
        for module, inputs in ((compiled, x), (eager, x), (golden, x.double())):
            out = module(inputs)
            out.double().square().sum().backward()
            grads = [p.grad.clone() for p in module.parameters()]
            module.zero_grad(set_to_none=True)
            results.append([out.detach().clone(), *grads])
        for name, ours, baseline, ref in zip(names, *results):
            assert_close_to_ref(f"step {step} {name}", ours, ref, baseline)


def mock_hopper(monkeypatch):
    """Make the Hopper support checks see an sm_90 GPU with Gluon, and return a factory of
    ``CudaLooking`` tensors."""
    from flash_inductor.launch import hopper

    monkeypatch.setattr(hopper, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(hopper, "_gluon_available", lambda: True)

    def tensor(*shape, dtype=torch.bfloat16):
        return torch.empty(shape, dtype=dtype).as_subclass(CudaLooking)
    return tensor


def assert_shadow_check_passes(seq: int, **attention_kwargs) -> None:
    """A one-layer model whose attention is ``flash_attention(q, k, v, **attention_kwargs)`` (two
    heads of 8, batch 2, ``seq`` tokens) passes ``flash_inductor.debug.shadow``: one site, no
    failure, and out, dq, dk and dv all compared against the float64 twin."""
    import flash_inductor
    from flash_inductor import debug

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(16, 3 * 16)

        def forward(self, x):
            q, k, v = self.proj(x).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)
            return flash_inductor.flash_attention(q, k, v, **attention_kwargs).sum()

    torch.manual_seed(0)
    model = Attention()
    with debug.shadow(model) as check:
        model(torch.randn(2, seq, 16)).backward()
    report = check.report()
    assert report.sites == ["<model>"] and report.first_failure is None, str(report)
    assert {c.result for c in report.checks if c.compared} == {"out", "dq", "dk", "dv"}


def found_attention_sites(module, *inputs, dynamic=False) -> list:
    """The sites the rewrite's finders (SDPA and hand-written) return on the module's dynamo graph,
    nothing rewritten."""
    from flash_inductor.passes import handwritten, sdpa

    found = []

    def backend(gm, example_inputs):
        found.extend([*sdpa.find_sites(gm.graph), *handwritten.find_sites(gm.graph)])
        return gm.forward

    torch.compile(module, backend=backend, dynamic=dynamic, fullgraph=True)(*inputs)
    return found
