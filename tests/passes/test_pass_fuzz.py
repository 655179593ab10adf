"""Fuzz: compiling with the pass never fails where eager runs, and never changes a result.

Random attention-shaped programs, drawn from a fixed seed so that every run checks the same
graphs: SDPA calls with broadcast batch and head dims, GQA with and without ``enable_gqa``,
masks of odd shapes and dtypes, ``is_causal``, scales; hand-written attention with scales,
divisions, biases, fills and casts in random order, repeated or broadcast K/V heads, fp32
softmaxes on fp16 inputs; ``nn.MultiheadAttention`` with its options; q, k and v as transposed,
expanded and reshaped views; fp16, fp32 and fp64; eval and training (gradients of every float
input); static and dynamic shapes.

For each program: if eager raises, compiling must raise too (the pass must not make an invalid
program run; except where eager fails for its own reasons, _EAGER_ONLY_ERRORS, where the compiled
program must run and be finite), and a further program is drawn in its place: CASES programs that
eager runs are compared, and the rejected ones are listed with eager's error and bounded. A
compared program is compiled with the pass and AOTAutograd (``model_zoo.pass_then_aot_eager``,
which runs the backend's pre-grad passes; Inductor's code generation is not what is fuzzed); its
outputs and gradients must match an fp64 run by the project's rule, err(ours) <= 2 err(eager,
same dtype) + floor, each tensor on its own scale, wherever eager is finite (a row that sees no
key is 0 in the op where SDPA's math path may give NaN, as documented). A program with dropout
draws another mask than eager, so its outputs and gradients are compared in distribution: mean and
spread over DROPOUT_SEEDS seeds. Scores stay within what attention computes: masks push them
down, never up to 1e38 (the op's backward recovers P from an fp32 log-sum-exp, which cannot hold
log(l) beside a score above ~1e6; eager's softmax has no such limit). The sites the pass rewrote
or kept are counted: the fuzz must exercise the rewrite, not only its refusals.

Sized to keep CI cheap: 48 compared programs (67 draws), about 60 s of CPU time.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import random
from typing import Any, Callable, Optional

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from flash_inductor.passes.report import REPORTS
from model_zoo import pass_then_aot_eager

SEED = 20240532
# Programs compared: 48 in CI; FLASH_INDUCTOR_FUZZ_CASES=500 draws further programs from the same
# seed (the first 48 are always the same).
CASES = int(os.environ.get("FLASH_INDUCTOR_FUZZ_CASES", "48"))
# The floor of the tolerance, in units of the dtype's eps times the tensor's own max-abs (see
# _assert_matches). fp64 has no higher-precision run to measure eager's own error by, so its floor
# is the whole tolerance.
FLOOR_ULPS = {torch.float64: 2**12, torch.float32: 16, torch.float16: 16}
# Programs eager rejects (odd mask shapes, mismatched heads) are checked for a matching refusal
# when compiled, and further programs are drawn in their place; at most REJECTED_AT_MOST of them
# per 48 compared (48 runnable programs take 67 draws, 19 of them rejected).
REJECTED_AT_MOST = 24
# Runs per dropout program for comparing distributions (_assert_same_distribution).
DROPOUT_SEEDS = 200

pytestmark = pytest.mark.usefixtures("fresh_compiler")


@dataclasses.dataclass
class Program:
    """One random program: ``module(*inputs)``; ``description`` says how it was drawn."""

    module: nn.Module
    inputs: list
    training: bool
    dynamic: bool
    description: str
    random_draws: bool = False  # dropout: the op's Philox stream is not eager's, values differ
    out_dtype: Optional[torch.dtype] = None  # eager's output dtype, once it ran


class _Fn(nn.Module):
    def __init__(self, fn: Callable, **submodules):
        super().__init__()
        self.fn = fn
        for name, module in submodules.items():
            setattr(self, name, module)

    def forward(self, *inputs):
        return self.fn(self, *inputs)


# ------------------------------------------------------------------------------------------
# Drawing programs
# ------------------------------------------------------------------------------------------


def _tensor(rng: random.Random, shape, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _mask_shape(rng: random.Random, batch: int, heads: int, seq_q: int, seq_k: int):
    """A shape broadcastable to (batch, heads, L, S), or an odd one eager may reject."""
    return rng.choice([(seq_q, seq_k), (batch, 1, 1, seq_k), (1, heads, seq_q, seq_k), (batch, heads, seq_q, seq_k),
                       (seq_k,), (batch, 1, seq_q, seq_k), (heads, 1, seq_k), (batch, seq_q, seq_k)])


def _mask(rng: random.Random, shape, dtype, training: bool):
    kind = rng.choice(["bool", "float", "float_inf", "finfo_min", "float_other_dtype"])
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    hidden = torch.rand(shape, generator=g) < rng.choice([0.0, 0.3, 0.7, 1.0])
    if kind == "bool":
        return ~hidden, kind
    mask_dtype = rng.choice([torch.float32, torch.float64, torch.float16]) if kind == "float_other_dtype" else dtype
    values = torch.randn(shape, generator=g, dtype=torch.float64)
    fill = {"float_inf": float("-inf"), "finfo_min": torch.finfo(mask_dtype).min}.get(kind, -3.0)
    mask = values.masked_fill(hidden, fill).to(mask_dtype)
    return mask.requires_grad_(training and rng.random() < 0.5), kind


def _qkv_views(rng: random.Random, q_shape, k_shape, v_shape, dtype, training):
    """q, k, v as the graph sees them, and the leaf tensors they are views of."""
    leaves, views = [], []
    for shape in (q_shape, k_shape, v_shape):
        layout = rng.choice(["plain", "transposed", "expanded"] if shape[0] == 1 else ["plain", "transposed"])
        if layout == "transposed" and len(shape) == 4:  # (B, L, H, E) storage, as projections make it
            leaf = _tensor(rng, (shape[0], shape[2], shape[1], shape[3]), dtype)
            leaves.append(leaf.requires_grad_(training))
            views.append(lambda t: t.transpose(1, 2))
        elif layout == "expanded":  # (1, ...) expanded to a batch of 2: stride 0
            leaf = _tensor(rng, shape, dtype)
            leaves.append(leaf.requires_grad_(training))
            views.append(lambda t: t.expand(2, *t.shape[1:]))
        else:
            leaves.append(_tensor(rng, shape, dtype).requires_grad_(training))
            views.append(lambda t: t)
    return leaves, views


def _draw_sdpa(rng: random.Random, training: bool) -> Program:
    dtype = rng.choice([torch.float32, torch.float64, torch.float16])
    batch, heads_q = rng.choice([1, 2, 3]), rng.choice([1, 2, 4])
    heads_kv = rng.choice([heads_q, 1, max(heads_q // 2, 1), 3])
    seq_q, seq_k, dim, dim_v = rng.choice([1, 3, 5]), rng.choice([1, 4, 7]), rng.choice([4, 8]), rng.choice([4, 6])
    kv_batch = rng.choice([batch, 1])
    q_batch = rng.choice([batch, batch, 1])
    q_shape, k_shape = (q_batch, heads_q, seq_q, dim), (kv_batch, heads_kv, seq_k, dim)
    v_shape = (kv_batch, rng.choice([heads_kv, heads_kv, 1]), seq_k, dim_v)
    if rng.random() < 0.2:  # 3-D (N, L, E): no head dim
        q_shape, k_shape, v_shape = q_shape[1:], k_shape[1:], v_shape[1:]
    leaves, views = _qkv_views(rng, q_shape, k_shape, v_shape, dtype, training)
    kwargs: dict[str, Any] = dict(enable_gqa=rng.random() < 0.4)
    mask_kind = "none"
    if rng.random() < 0.6:
        mask, mask_kind = _mask(rng, _mask_shape(rng, batch, heads_q, seq_q, seq_k), dtype, training)
        leaves.append(mask)
    elif rng.random() < 0.5:
        kwargs["is_causal"] = True
    if rng.random() < 0.4:
        kwargs["scale"] = rng.choice([0.3, 1.0, -0.2, 2.5])
    if training and rng.random() < 0.2:
        kwargs["dropout_p"] = 0.25
    has_mask = len(leaves) == 4

    def fn(self, q, k, v, *mask):
        q, k, v = (view(t) for view, t in zip(views, (q, k, v)))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[0] if mask else None, **kwargs)

    described = f"sdpa {dtype} q{q_shape} k{k_shape} v{v_shape} mask={mask_kind if has_mask else None} {kwargs}"
    return Program(_Fn(fn), leaves, training, rng.random() < 0.15, described, random_draws="dropout_p" in kwargs)


def _score_step(rng: random.Random, dtype, shape) -> tuple[str, Callable, Optional[torch.Tensor]]:
    """One step between Q·Kᵀ and the softmax: (name, fn(scores, extra), its extra tensor)."""
    kind = rng.choice(["scale", "scale", "div", "add", "add", "sub", "fill", "where", "cast", "inplace_scale"])
    if kind == "scale":
        c = rng.choice([0.35, 2.0, -0.5, 1e-3])
        return f"*{c}", (lambda s, x: s * c), None
    if kind == "inplace_scale":
        c = rng.choice([0.5, 3.0])

        def scale_in_place(s, x):
            s = s * 1.0  # a fresh tensor: never write into an input
            s *= c
            return s

        return f"*={c}", scale_in_place, None
    if kind == "div":
        d = rng.choice([math.sqrt(shape[-1]), 3.0])
        return f"/{d:.3g}", (lambda s, x: s / d), None
    bias_shape = rng.choice([shape, (1, *shape[1:]), (shape[0], 1, 1, shape[-1]), shape[-2:], (shape[-1],)])
    bias_shape = bias_shape[-len(shape):] if len(bias_shape) > len(shape) else bias_shape
    if kind in ("add", "sub"):
        bias = _tensor(rng, bias_shape, dtype)
        if rng.random() < 0.3:  # a mask: finfo.min added, or finfo.max subtracted (as models write them)
            hide = torch.rand(bias_shape, generator=torch.Generator().manual_seed(rng.randrange(2**31))) < 0.3
            bias = bias.masked_fill(hide, torch.finfo(dtype).min if kind == "add" else torch.finfo(dtype).max)
        return kind, ((lambda s, x: s + x) if kind == "add" else (lambda s, x: s - x)), bias
    hidden = torch.rand(bias_shape, generator=torch.Generator().manual_seed(rng.randrange(2**31))) < 0.3
    fill = rng.choice([float("-inf"), torch.finfo(dtype).min, -1e4 if dtype != torch.float16 else -6e4, 0.0, -5.0])
    if kind == "fill":
        return f"fill({fill:g})", (lambda s, x: s.masked_fill(x, fill)), hidden
    if kind == "where":
        return f"where({fill:g})", (lambda s, x: torch.where(x, s, torch.full([], fill, dtype=s.dtype))), ~hidden
    return "float", (lambda s, x: s.double() if _GOLDEN.active else s.float()), None


def _draw_handwritten(rng: random.Random, training: bool) -> Program:
    dtype = rng.choice([torch.float32, torch.float64, torch.float16])
    batch, heads_q, heads_kv = rng.choice([1, 2]), rng.choice([2, 4]), None
    heads_kv = rng.choice([heads_q, 1, heads_q // 2])
    seq_q, seq_k, dim = rng.choice([1, 4, 6]), rng.choice([3, 5]), rng.choice([4, 8])
    kv_batch = rng.choice([batch, batch, 1])
    leaves, views = _qkv_views(rng, (batch, heads_q, seq_q, dim), (kv_batch, heads_kv, seq_k, dim),
                               (kv_batch, heads_kv, seq_k, dim), dtype, training)
    repeat = heads_q // heads_kv if heads_kv not in (heads_q, 1) else 1
    spelling_kv = rng.choice(["repeat_interleave", "repeat_kv"]) if repeat > 1 else "none"
    steps = [_score_step(rng, dtype, (batch, heads_q, seq_q, seq_k)) for _ in range(rng.choice([0, 1, 2, 3]))]
    extras = [x for _, _, x in steps if x is not None]
    for extra in extras:
        if extra.is_floating_point():
            extra.requires_grad_(training and rng.random() < 0.5)
    # A softmax over the queries (dim -2) is not attention over the keys: rarely, as one refusal.
    softmax = rng.choice(["F.softmax", "method", "fp32_then_cast"] * 3 + ["dim-2"])
    dropout = 0.2 if training and rng.random() < 0.2 else 0.0
    n_steps = len(steps)

    def fn(self, q, k, v, *extra):
        q, k, v = (view(t) for view, t in zip(views, (q, k, v)))
        if spelling_kv == "repeat_interleave":
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        elif spelling_kv == "repeat_kv":
            b, h, s, d = k.shape
            k = k[:, :, None, :, :].expand(b, h, repeat, s, d).reshape(b, h * repeat, s, d)
            v = v[:, :, None, :, :].expand(b, h, repeat, s, d).reshape(b, h * repeat, s, d)
        scores = q @ k.transpose(-2, -1)
        extra_iter = iter(extra)
        for _, step, x in steps:
            scores = step(scores, next(extra_iter) if x is not None else None)
        if softmax == "F.softmax":
            probs = F.softmax(scores, dim=-1)
        elif softmax == "method":
            probs = scores.softmax(-1)
        elif softmax == "fp32_then_cast":
            wide = torch.float64 if _GOLDEN.active else torch.float32
            probs = torch.softmax(scores, dim=-1, dtype=wide).to(q.dtype)
        else:
            probs = F.softmax(scores, dim=-2)
        probs = F.dropout(probs, p=dropout, training=self.training)
        return probs.to(v.dtype) @ v

    described = (f"handwritten {dtype} q({batch},{heads_q},{seq_q},{dim}) kv({kv_batch},{heads_kv},{seq_k}) "
                 f"kv={spelling_kv} steps={[name for name, _, _ in steps]} softmax={softmax} dropout={dropout}")
    module = _Fn(fn)
    module.train(training)
    assert n_steps == len(steps)
    return Program(module, leaves + extras, training, rng.random() < 0.15, described, random_draws=dropout > 0)


def _draw_mha(rng: random.Random, training: bool) -> Program:
    dtype = rng.choice([torch.float32, torch.float64])
    heads, head_dim = rng.choice([1, 2, 4]), rng.choice([2, 4])
    embed, batch, seq_q, seq_k = heads * head_dim, rng.choice([1, 2]), rng.choice([1, 3, 5]), rng.choice([2, 4])
    batch_first, cross = rng.random() < 0.5, rng.random() < 0.4
    options = dict(bias=rng.random() < 0.7, add_bias_kv=rng.random() < 0.15, batch_first=batch_first,
                   kdim=rng.choice([None, 3]) if cross else None, vdim=rng.choice([None, 5]) if cross else None)
    mha = nn.MultiheadAttention(embed, heads, dropout=0.0, dtype=dtype, **options)
    x = _tensor(rng, (batch, seq_q, embed) if batch_first else (seq_q, batch, embed), dtype).requires_grad_(training)
    seq_kv = seq_k if cross else seq_q
    kv_dims = (options["kdim"] or embed, options["vdim"] or embed)
    kv = [_tensor(rng, (batch, seq_kv, d) if batch_first else (seq_kv, batch, d), dtype) for d in kv_dims]
    call: dict[str, Any] = dict(need_weights=rng.random() < 0.3)
    leaves = [x, *kv] if cross else [x]
    if rng.random() < 0.5:
        padded = torch.zeros(batch, seq_kv, dtype=torch.bool)
        padded[-1, -1] = seq_kv > 1
        leaves.append(padded if rng.random() < 0.6 else torch.zeros(batch, seq_kv, dtype=dtype).masked_fill(
            padded, float("-inf")))
        call["use_kpm"] = True
    if rng.random() < 0.4:
        causal = torch.triu(torch.ones(seq_q, seq_kv, dtype=torch.bool), diagonal=1)
        leaves.append(causal)
        call["use_attn_mask"] = True
        call["is_causal"] = seq_q == seq_kv and rng.random() < 0.5
    use_kpm, use_attn_mask = call.pop("use_kpm", False), call.pop("use_attn_mask", False)

    def fn(self, x, *rest):
        rest = list(rest)
        key, value = (rest.pop(0), rest.pop(0)) if cross else (x, x)
        kpm = rest.pop(0) if use_kpm else None
        mask = rest.pop(0) if use_attn_mask else None
        out, _ = self.mha(x, key, value, key_padding_mask=kpm, attn_mask=mask, **call)
        return out

    module = _Fn(fn, mha=mha)
    module.train(training)
    described = f"mha {dtype} heads={heads} L={seq_q} S={seq_kv} {options} kpm={use_kpm} mask={use_attn_mask} {call}"
    return Program(module, leaves, training, False, described)


def draw(index: int) -> Program:
    rng = random.Random(SEED + index)
    training = rng.random() < 0.5
    family = rng.choices([_draw_sdpa, _draw_handwritten, _draw_mha], weights=[4, 4, 1])[0]
    program = family(rng, training)
    program.description = f"#{index} {'training' if training else 'eval'}{' dynamic' if program.dynamic else ''} " \
                          + program.description
    return program


# ------------------------------------------------------------------------------------------
# Running them
# ------------------------------------------------------------------------------------------


class _Golden:
    """While ``active``, the programs' fp32 upcasts (``.float()``, ``softmax(dtype=float32)``) go to
    fp64 instead: the golden run of an fp16 or fp32 program is fp64 throughout."""

    active = False


_GOLDEN = _Golden()


def _run(fn, program: Program, seed: int = 0, golden: bool = False):
    """[output, gradients of the float inputs that require them]. ``golden``: the same program in
    fp64 (its float inputs, parameters and dO cast up from the values the program itself sees)."""
    if golden:
        assert fn is program.module, "the golden is eager's"
        fn = copy.deepcopy(program.module).double()
    leaves = [(t.detach().double() if golden and t.is_floating_point() else t.detach().clone())
              .requires_grad_(t.requires_grad) for t in program.inputs]
    torch.manual_seed(seed)
    _GOLDEN.active = golden
    try:
        if program.training:
            out = fn(*leaves)
            float_leaves = [t for t in leaves if t.requires_grad]
            grad_out = _grad_out(out.shape, program.out_dtype or out.dtype).to(out.dtype)
            grads = torch.autograd.grad(out, float_leaves, grad_out, allow_unused=True) if float_leaves else []
            return [out.detach(), *grads]
        with torch.no_grad():
            return [fn(*leaves)]
    finally:
        _GOLDEN.active = False


def _grad_out(shape, dtype):
    """dO in the program's output dtype (the golden run gets the same values, upcast)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype)


def _assert_matches(program: Program, got: list, want: list, golden: list) -> None:
    """Each output and gradient against the fp64 golden, wherever eager and the golden are finite,
    by the project's rule: err(ours) <= 2 err(eager, same dtype) + floor, errors as max-abs, the
    floor FLOOR_ULPS[dtype] units of the dtype's eps times the tensor's own magnitude (its max-abs
    in the golden). A tensor that is ~1e-2 everywhere is held to its own scale, not to 1."""
    assert len(got) == len(want) == len(golden)
    for i, (a, b, g) in enumerate(zip(got, want, golden)):
        what = "output" if i == 0 else f"gradient {i}"
        if a is None or b is None:
            assert a is None or not a.any(), f"{program.description}: {what} None on one side only"
            continue
        assert a.shape == b.shape and a.dtype == b.dtype, f"{program.description}: {what} {a.shape} vs {b.shape}"
        finite = b.isfinite()
        assert a[finite].isfinite().all(), f"{program.description}: {what} is not finite where eager is"
        finite &= g.isfinite()
        if not finite.any():
            continue
        g = g[finite].double()
        scale = g.abs().max().item()
        ours, base = ((t[finite].double() - g).abs().max().item() for t in (a, b))
        floor = FLOOR_ULPS[b.dtype] * torch.finfo(b.dtype).eps * scale
        assert ours <= 2 * base + floor, (
            f"{program.description}: {what} error against fp64 {ours:.3e} > 2 x eager's {base:.3e} + floor "
            f"{floor:.3e} (max |fp64| {scale:.3e})")


def _assert_same_distribution(program: Program, compiled) -> None:
    """A program with dropout draws its mask from the op's Philox stream, not eager's, so single
    runs differ. Every output and gradient is linear in the keep mask scaled by 1/(1-p), so over
    DROPOUT_SEEDS seeds the compiled mean must match eager's mean (each element within 5 standard
    errors, plus the deterministic tolerance), and the spread must match too: a rewrite that
    dropped the dropout (no spread), changed p or lost the 1/(1-p) fails. Outputs must be
    finite wherever eager's are, in every run."""
    runs = {name: [_run(fn, program, seed=seed) for seed in range(DROPOUT_SEEDS)]
            for name, fn in (("eager", program.module), ("compiled", compiled))}
    for i, (eager, ours) in enumerate(zip(zip(*runs["eager"]), zip(*runs["compiled"]))):
        what = "output" if i == 0 else f"gradient {i}"
        if eager[0] is None or ours[0] is None:
            assert all(t is None or not t.any() for t in ours), f"{program.description}: {what} None on one side only"
            continue
        eager, ours = torch.stack(eager).double(), torch.stack(ours).double()
        finite = eager.isfinite().all(0)
        assert ours[:, finite].isfinite().all(), f"{program.description}: {what} is not finite where eager is"
        if not finite.any():
            continue
        eager, ours = eager[:, finite], ours[:, finite]
        scale = eager.abs().max().item()
        slack = FLOOR_ULPS[program.out_dtype] * torch.finfo(program.out_dtype).eps * scale
        stderr = ((eager.var(0) + ours.var(0)) / DROPOUT_SEEDS + slack ** 2).sqrt()
        differ = (ours.mean(0) - eager.mean(0)).abs()
        # An element that is the same in every run on both sides (0 everywhere) must agree exactly.
        z = torch.where(stderr > 0, differ / stderr.clamp_min(1e-300), differ * math.inf).nan_to_num(0.0).max().item()
        assert z < 5, f"{program.description}: {what}'s mean over {DROPOUT_SEEDS} seeds differs from eager's " \
                      f"by {z:.1f} standard errors"
        spread = ours.var(0).sum().item(), eager.var(0).sum().item()
        if spread[1] == 0:  # a gradient that no mask changes (dQ of a row with one visible key)
            assert i > 0, f"{program.description}: the output does not vary with the seed in eager"
            assert spread[0] <= slack ** 2 * eager[0].numel(), f"{program.description}: {what} varies, eager's does not"
            continue
        assert 0.7 < spread[0] / spread[1] < 1.4, (
            f"{program.description}: {what}'s variance over seeds is {spread[0] / spread[1]:.2f} x eager's")


# Eager's own failures on valid programs, which the op does not share: SDPA's math path applies
# dropout in place on the broadcast scores of q and k with different batch or head dims.
_EAGER_ONLY_ERRORS = ("doesn't match the broadcast shape",)


def _rejected_alike(program: Program, eager_error: Exception) -> Optional[str]:
    """A program eager rejects must be rejected compiled too (the pass must not make an invalid
    program run), unless eager failed for one of _EAGER_ONLY_ERRORS: then the compiled program must
    run and give finite results. None if so, else what went wrong."""
    torch._dynamo.reset()
    compiled = torch.compile(program.module, backend=pass_then_aot_eager(), dynamic=program.dynamic)
    eager_only = any(text in str(eager_error) for text in _EAGER_ONLY_ERRORS)
    try:
        got = _run(compiled, program)
    except Exception as error:  # noqa: BLE001 -- any error: both sides refuse the program
        if not eager_only:
            return None
        return f"{program.description}: compiling failed: {type(error).__name__}: {error}"[:800]
    if not eager_only:
        return f"{program.description}: eager raised {type(eager_error).__name__}: {eager_error}, compiled ran"[:800]
    if not all(t is None or t.isfinite().all() for t in got):
        return f"{program.description}: not finite (eager cannot run it: {eager_error})"[:800]
    return None


def test_fuzzed_programs_compile_and_match_eager():
    """CASES programs that eager runs are compared (the first CASES draws, and further draws in
    place of those eager rejects); the rejected ones are checked for a matching refusal, listed
    in the output with eager's error, and bounded: REJECTED_AT_MOST per 48 compared."""
    counts = dict(compared=0, dropout=0, rejected=0, rewritten=0, kept=0)
    rejected, failures = [], []
    index = -1
    while counts["compared"] + counts["dropout"] < CASES:
        index += 1
        program = draw(index)
        try:
            want = _run(program.module, program)
        except Exception as error:  # noqa: BLE001 -- compared below: compiling must reject it too
            counts["rejected"] += 1
            rejected.append(f"{program.description}: {type(error).__name__}: {str(error).splitlines()[0][:160]}")
            if (failure := _rejected_alike(program, error)) is not None:
                failures.append(failure)
            if counts["rejected"] > REJECTED_AT_MOST * CASES // 48:
                break
            continue
        program.out_dtype = want[0].dtype
        torch._dynamo.reset()
        REPORTS.clear()
        compiled = torch.compile(program.module, backend=pass_then_aot_eager(), dynamic=program.dynamic)
        try:
            got = _run(compiled, program)
        except Exception as error:  # noqa: BLE001 -- collected so that one run lists every failure
            failures.append(f"{program.description}: compiling failed: {type(error).__name__}: {error}"[:1500])
            counts["compared"] += 1
            continue
        sites = [site for report in REPORTS for site in report.sites]
        counts["rewritten"] += sum(site.rewritten for site in sites)
        counts["kept"] += sum(not site.rewritten for site in sites)
        try:
            if program.random_draws:
                counts["dropout"] += 1
                _assert_same_distribution(program, compiled)
            else:
                counts["compared"] += 1
                # Also for fp64 programs: their fp32 upcasts become fp64 there.
                golden = _run(program.module, program, golden=True)
                _assert_matches(program, got, want, golden)
        except AssertionError as error:
            failures.append(f"{error}\n    sites: {[(s.status, s.reason) for s in sites]}")
    print(f"fuzz: {index + 1} programs drawn, {counts}; eager rejects:\n  " + "\n  ".join(rejected))
    assert not failures, f"{len(failures)} of {index + 1} programs:\n" + "\n".join(failures)
    # Not vacuous: eager rejects few draws (the list above says which and why), dropout programs
    # are among those compared, and the pass rewrote many sites.
    assert counts["rejected"] <= REJECTED_AT_MOST * CASES // 48, (counts, rejected)
    assert counts["dropout"] >= 1, counts
    assert counts["rewritten"] >= CASES // 3, counts
