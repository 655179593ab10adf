"""The adversarial cases: each builds one attention problem (inputs, mask, upstream gradient).

Every case is seeded, so a case × dtype is the same problem for every implementation and
every run. The fp64 reference is computed from the *rounded* fp16/bf16 inputs, so the error
measured is that of the computation, not of storing the inputs in 16 bits.

Long-sequence cases only compare a slice of query rows (the last ``slice_rows``, which see
every key under the causal mask): the upstream gradient is zero outside the slice, so the
exact dK/dV come from the slice alone and the fp64 reference stays O(slice × S), never
O(L × S). dQ outside the slice is then exactly zero, and compared as such.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
from torch import Tensor

FP16, BF16 = torch.float16, torch.bfloat16


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Problem sizes. ``full`` is what the GPU runs; ``quick`` and smaller ones are for CPU and CI."""

    batch: int
    heads: int
    seq: int
    head_dim: int
    long_seqs: tuple[int, ...]
    long_heads: int
    slice_rows: int


# The ANCHORS.md probe shape (B=2, H=4, L=S=2048, E=128) and 32k..128k for error growth.
FULL = Sizes(batch=2, heads=4, seq=2048, head_dim=128, long_seqs=(32768, 65536, 131072), long_heads=2, slice_rows=256)
QUICK = Sizes(batch=1, heads=2, seq=256, head_dim=64, long_seqs=(2048, 4096), long_heads=2, slice_rows=64)


@dataclasses.dataclass
class Problem:
    """One attention problem, SDPA semantics.

    query (B, H, L, E), key (B, H, S, E), value (B, H, S, Ev), grad_out (B, H, L, Ev), all in the
    case's dtype. ``attn_mask`` (bool, True = attend, or additive float, broadcastable to
    (B, H, L, S)) and ``is_causal`` are exclusive, as in SDPA: causal masks combined with
    padding are folded into ``attn_mask``. ``rows``: the query rows the reference covers
    (None = all); grad_out is zero outside them.
    """

    query: Tensor
    key: Tensor
    value: Tensor
    grad_out: Tensor
    attn_mask: Optional[Tensor] = None
    is_causal: bool = False
    scale: Optional[float] = None
    rows: Optional[slice] = None
    softcap: Optional[float] = None
    sinks: Optional[Tensor] = None
    cu_seqlens: Optional[Tensor] = None

    @property
    def variants(self) -> tuple[str, ...]:
        """The variants the problem uses, by their names in docs/variants.md."""
        used = (("softcap", self.softcap is not None), ("sinks", self.sinks is not None),
                ("packed", self.cu_seqlens is not None))
        return tuple(name for name, on in used if on)

    @property
    def scores_numel(self) -> int:
        """Elements of the (B, H, L, S) score matrix an unfused implementation would materialise."""
        b, h, seq_q, _ = self.query.shape
        return b * h * seq_q * self.key.shape[-2]


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    description: str
    build: Callable[[torch.dtype, str, Sizes, torch.Generator], Problem]
    dtypes: tuple[torch.dtype, ...] = (FP16, BF16)


# ------------------------------------------------------------------------------------------
# Building blocks
# ------------------------------------------------------------------------------------------


def _randn(shape, gen: torch.Generator, device: str, mult: float = 1.0) -> Tensor:
    # Drawn in fp32 on the target device (128k x 128 inputs would be slow to draw on the host).
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * mult


def _causal(seq_q: int, seq_k: int, device: str) -> Tensor:
    return torch.ones(seq_q, seq_k, dtype=torch.bool, device=device).tril()


def _standard(dtype, device, sz: Sizes, gen, *, q_mult=1.0, k_mult=1.0, v_mult=1.0, do_mult=1.0,
              seq: Optional[int] = None, heads: Optional[int] = None, batch: Optional[int] = None) -> Problem:
    b, h, n, e = batch or sz.batch, heads or sz.heads, seq or sz.seq, sz.head_dim
    q = _randn((b, h, n, e), gen, device, q_mult)
    k = _randn((b, h, n, e), gen, device, k_mult)
    v = _randn((b, h, n, e), gen, device, v_mult)
    do = _randn((b, h, n, e), gen, device, do_mult)
    return Problem(*(t.to(dtype) for t in (q, k, v, do)))


# ------------------------------------------------------------------------------------------
# The cases
# ------------------------------------------------------------------------------------------


def _qk_scaled(mult: float):
    def build(dtype, device, sz, gen):
        return _standard(dtype, device, sz, gen, q_mult=mult, k_mult=mult)
    return build


def _left_padding(dtype, device, sz, gen):
    """HF-style left padding with a causal mask: query rows inside the padding see no key."""
    p = _standard(dtype, device, sz, gen)
    n = sz.seq
    pads = [max(1, n // 8 + i * n // 5) for i in range(sz.batch)]  # a different pad per sequence
    keep = torch.arange(n, device=device)[None, :] >= torch.tensor(pads, device=device)[:, None]  # (B, S)
    p.attn_mask = (_causal(n, n, device)[None] & keep[:, None, :])[:, None]  # (B, 1, L, S)
    return p


def _dead_rows_causal(dtype, device, sz, gen):
    """A random 90%-dense bool mask and the causal mask, with every 8th query row all False."""
    p = _standard(dtype, device, sz, gen)
    b, h, n = sz.batch, sz.heads, sz.seq
    mask = torch.rand((b, h, n, n), generator=gen, device=device) < 0.9
    mask &= _causal(n, n, device)
    mask[:, :, ::8, :] = False
    p.attn_mask = mask
    return p


def _finfo_min_mask(dtype, device, sz, gen):
    """Additive mask at finfo(dtype).min on half the keys, and two rows entirely at it."""
    p = _standard(dtype, device, sz, gen)
    b, h, n = sz.batch, sz.heads, sz.seq
    hidden = torch.rand((b, h, n, n), generator=gen, device=device) < 0.5
    hidden[..., 0] = False  # every other row keeps a visible key
    mask = torch.zeros((b, h, n, n), dtype=dtype, device=device).masked_fill(hidden, torch.finfo(dtype).min)
    mask[:, :, [0, n // 2], :] = torch.finfo(dtype).min  # HF-style padded query rows
    p.attn_mask = mask
    return p


def _near_tied(dtype, device, sz, gen):
    """Each key = one shared vector c (|c_e| ~ 50) + a small perturbation: logits of order 50
    within a few 16-bit ulps of each other, which an unfused QKᵀ rounded to 16 bits scrambles."""
    b, h, n, e = sz.batch, sz.heads, sz.seq, sz.head_dim
    spread = 0.05 if dtype == FP16 else 0.5  # a few ulps at |c_e| ~ 50 in the dtype, so it survives rounding
    shared = _randn((b, h, 1, e), gen, device, 50.0)
    p = _standard(dtype, device, sz, gen)
    p.key = (shared + _randn((b, h, n, e), gen, device, spread)).to(dtype)
    return p


def _scaled(scale: float):
    def build(dtype, device, sz, gen):
        p = _standard(dtype, device, sz, gen)
        p.scale = scale
        return p
    return build


def _large(what: str, mult: float):
    def build(dtype, device, sz, gen):
        return _standard(dtype, device, sz, gen, **{f"{what}_mult": mult})
    return build


def _long(seq: int):
    def build(dtype, device, sz, gen):
        p = _standard(dtype, device, sz, gen, seq=seq, heads=sz.long_heads, batch=1)
        rows = min(sz.slice_rows, seq)
        p.rows = slice(seq - rows, seq)  # the last rows see all `seq` keys under the causal mask
        grad = torch.zeros_like(p.grad_out)
        grad[:, :, p.rows] = p.grad_out[:, :, p.rows]
        p.grad_out = grad
        p.is_causal = True
        return p
    return build


def _softcapped(cap: float, qk_mult: float, sparse_mask: bool = False):
    """Gemma 2's cap (50 on its attention logits) over logits far past it: every tanh saturates
    where the largest scores sit, so the softmax sees many near-equal capped maxima. With
    ``sparse_mask``, a causal mask keeps ~10 % of each row's keys (its diagonal always: an anchor
    without a dead-row rule stays finite; rows with no key are tests/unit/test_stability.py's)."""
    def build(dtype, device, sz, gen):
        p = _standard(dtype, device, sz, gen)
        p.query, p.key = ((t.float() * qk_mult).to(dtype) for t in (p.query, p.key))
        if sparse_mask:
            b, h, n = sz.batch, sz.heads, sz.seq
            mask = (torch.rand((b, h, n, n), generator=gen, device=device) < 0.1) & _causal(n, n, device)
            p.attn_mask = mask | torch.eye(n, dtype=torch.bool, device=device)
        p.softcap = cap
        return p
    return build


def _with_sinks(qk_mult: float, sink_mean: float, sink_std: float, dead_rows: bool = False):
    """gpt-oss's learned per-head sinks, drawn around ``sink_mean`` (in logit units). Near the row
    maxima the sink takes a real share of each row; far above them it takes nearly all of it, and
    out and the gradients shrink with the rest, to be kept accurate relative to their own size.
    With dead rows, a row with no visible key returns 0 though its denominator holds the sink."""
    def build(dtype, device, sz, gen):
        p = _dead_rows_causal(dtype, device, sz, gen) if dead_rows else _standard(dtype, device, sz, gen)
        p.query, p.key = ((t.float() * qk_mult).to(dtype) for t in (p.query, p.key))
        p.sinks = sink_mean + _randn((sz.heads,), gen, device, sink_std)
        return p
    return build


def document_lengths(seq: int) -> list[int]:
    """A pack of ``seq`` rows as a padding-free collator makes one: a one-token document, a short
    one, and long ones of unequal length (so no document boundary falls on a tile boundary)."""
    lengths, left, size = [1, 7], seq - 8, max(8, seq // 3 + 5)
    while left > 0:
        lengths.append(min(size, left))
        left -= lengths[-1]
        size = max(8, size // 2 + 3)
    return lengths


def _packed(qk_mult: float):
    """A packed batch (B = 1) of causal documents: each row sees only its own document's earlier keys."""
    def build(dtype, device, sz, gen):
        p = _standard(dtype, device, sz, gen, batch=1)
        p.query, p.key = ((t.float() * qk_mult).to(dtype) for t in (p.query, p.key))
        lengths = torch.tensor(document_lengths(sz.seq), device=device)
        p.cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
        doc = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)
        p.attn_mask = ((doc[:, None] == doc[None, :]) & _causal(sz.seq, sz.seq, device))[None, None]
        return p
    return build


def long_case_name(seq: int) -> str:
    return f"long_{seq // 1024}k" if seq % 1024 == 0 else f"long_{seq}"


def all_cases(sizes: Sizes) -> list[Case]:
    """Every case, in report order; the long-sequence ones follow ``sizes.long_seqs``."""
    cases = [
        Case(f"qk_x{m:g}", f"q and k each x{m:g}: logits x{m * m:g}; unfused fp16 QKᵀ overflows 65504 from about x30",
             _qk_scaled(m))
        for m in (1, 10, 30, 100)
    ]
    cases += [
        Case("left_padding", "causal + left padding (bool): padded query rows see no key", _left_padding),
        Case("dead_rows_causal", "causal + random bool mask, every 8th row all False", _dead_rows_causal),
        Case("finfo_min_mask", "additive finfo(dtype).min mask on half the keys, two rows entirely at it",
             _finfo_min_mask),
        Case("near_tied", "logits ~50 within a few 16-bit ulps of each other", _near_tied),
        Case("scale_1e-4", "softmax scale 1e-4: nearly uniform attention", _scaled(1e-4)),
        Case("scale_1e2", "softmax scale 1e2: nearly one-hot attention", _scaled(1e2)),
    ]
    cases += [
        Case(f"large_{what}_{mult:.0e}".replace("+0", ""), f"|{label}| ~ {mult:.0e}: the fp16 backward's dP and dS pass 65504",
             _large(what, mult), dtypes=(FP16,))
        for what, label in (("v", "V"), ("do", "dO")) for mult in (1e3, 1e4)
    ]
    cases += [
        Case("softcap_qk_x30", "soft-cap 50 (Gemma 2) over logits x900: the cap saturates at the row maxima",
             _softcapped(50.0, 30.0)),
        Case("softcap_sparse_mask", "soft-cap 30 + causal random bool mask keeping ~10 % of keys, logits x9",
             _softcapped(30.0, 3.0, sparse_mask=True)),
        Case("sinks_qk_x10", "per-head sinks (gpt-oss) near the row maxima of logits x100",
             _with_sinks(10.0, 250.0, 30.0)),
        Case("sinks_dominant", "sinks ~12 logits above a row's keys: the sink takes ~99.7 % of each row",
             _with_sinks(1.0, 12.0, 1.0)),
        Case("sinks_dead_rows", "sinks + causal random bool mask, every 8th row all False: those rows return 0",
             _with_sinks(1.0, 0.0, 1.0, dead_rows=True)),
        Case("packed_docs", "packed causal documents of 1..L/3 tokens (varlen): no row sees another document",
             _packed(1.0)),
        Case("packed_qk_x30", "packed causal documents, logits x900", _packed(30.0)),
    ]
    cases += [
        Case(long_case_name(seq), f"causal, L = S = {seq}: error growth with length (last {sizes.slice_rows} rows vs fp64)",
             _long(seq))
        for seq in sizes.long_seqs
    ]
    return cases


def select(cases: list[Case], patterns: Optional[str]) -> list[Case]:
    """Cases named by the comma-separated patterns (None = all): a pattern that is a case's full
    name selects that case only ("qk_x1"), any other selects the cases it starts ("qk_")."""
    if not patterns:
        return cases
    names = {c.name for c in cases}
    chosen: set[str] = set()
    for pattern in (p.strip() for p in patterns.split(",") if p.strip()):
        matches = {pattern} if pattern in names else {n for n in names if n.startswith(pattern)}
        if not matches:
            raise ValueError(f"--cases: no case matches {pattern!r}; known cases: {', '.join(c.name for c in cases)}")
        chosen |= matches
    return [c for c in cases if c.name in chosen]
