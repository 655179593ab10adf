"""Blocked attention in plain PyTorch: the readable statement of what the Triton kernel computes.

This is the CPU (and any-device) path of the attention op and the yardstick the kernels are
tested against. It follows the same contract as the Triton launcher and the same algorithm
as the kernels, written for clarity rather than speed:

* keys are visited in chunks of :data:`KEY_CHUNK`, with a running row maximum and running
  sum (online softmax), so memory is O(L * KEY_CHUNK) and never O(L * S);
* the backward pass recomputes the probabilities of each key chunk from the saved
  log-sum-exp instead of storing them;
* grouped-query attention never repeats K/V: the query heads of one KV group are stacked
  along the row axis, ``(B, Hq, L, E) -> (B, Hkv, G * L, E)``, so a plain matmul against that
  group's keys scores all of them at once (query head ``h = hk * G + g``, row ``g * L + i``);
* dropout keeps score ``(b, h, i, j)`` iff ``philox_uniform(seed, ((b*Hq + h)*L + i)*S + j) >=
  dropout_p``, the same draw as ``tl.rand`` in the kernel;
* a block-sparse layout (``flash_inductor.block_sparse``) is an element mask built per key
  chunk from the block map, ``block_map[b, h, i // block_q, j // block_k]``; rows whose blocks
  are all skipped are rows without a visible key;
* when ``out`` is rounded below the compute dtype (fp16/bf16 inputs), the backward's
  Delta_i is the P-weighted mean of row i's dP, summed over the keys in one extra pass, rather
  than rowsum(dO * O) from the rounded O: the Delta that the kernels' ``exact_delta``
  correction arrives at (see ``flash_inductor.kernels.attn_bwd``).

* logit soft-capping (``softcap`` > 0, FlashAttention-2's) replaces each scaled score s by
  ``softcap * tanh(s / softcap)`` before the mask is added; the backward multiplies dS by the
  slope ``1 - tanh(s / softcap) ** 2`` on its way to dQ and dK (a float mask's gradient is dS itself);

* causal masking and a sliding window both come down to a band of keys per row,
  ``i + lower <= j <= i + upper`` (``flash_inductor.launch.band``). With a band the forward
  takes the query rows in blocks of :data:`ROW_BLOCK` and each block visits only the key chunks
  its rows' bands reach, as the kernels skip their tiles: causal attention then does about half
  the work of non-causal. A chunk wholly inside every row's band skips the band's select too.

Arithmetic is float64 for float64 inputs and float32 otherwise; inputs are upcast chunk by
chunk. Rows that see no key at all (all-False mask, all -inf mask, causal or window with no
key, S == 0) give a zero output row, ``lse = -inf`` and zero gradients, never NaN.
"""

from dataclasses import dataclass, replace
from typing import Optional

import torch

from ..block_sparse import expand_block_map
from ..launch.band import Band, resolve_band
from .philox import philox_uniform

__all__ = ["KEY_CHUNK", "ROW_BLOCK", "reference_forward", "reference_backward"]

# Keys per block: large enough that the matmuls dominate the Python overhead, small enough
# that the (L, KEY_CHUNK) score block stays cheap for long sequences.
KEY_CHUNK = 128
# Query rows per block under a band (causal, window): the work past the diagonal is at most one
# block's worth per block, so smaller blocks skip more of it; below a few hundred rows the
# per-chunk Python overhead outweighs what they skip.
ROW_BLOCK = 256

# The kernel works in base 2, where finfo(float32).min * log2(e) overflows to -inf; it clamps
# float mask values to this floor, and so do we. Softmax is shift-invariant, so a row masked
# with finfo.min still gets the same (uniform) probabilities as with the unclamped value.
_MASK_FLOOR = -1e38


@dataclass
class _GroupedProblem:
    """Geometry shared by forward and backward, in the grouped (B, Hkv, G * L, ...) layout."""

    batch: int
    query_heads: int
    kv_heads: int
    group_size: int
    query_len: int
    key_len: int
    compute_dtype: torch.dtype
    device: torch.device
    # The query rows [row_start, row_stop) this problem covers (all of them unless split by
    # rows_of); "rows" below are those, n = row_stop - row_start.
    row_start: int = 0
    row_stop: Optional[int] = None

    def __post_init__(self):
        if self.row_stop is None:
            self.row_stop = self.query_len

    @property
    def block_rows(self) -> int:
        return self.row_stop - self.row_start

    @property
    def grouped_rows(self) -> int:
        return self.group_size * self.block_rows

    def rows_of(self, start: int, stop: int) -> "_GroupedProblem":
        """The same problem restricted to query rows [start, stop)."""
        return replace(self, row_start=start, row_stop=stop)

    def row_slice(self, per_query_row: torch.Tensor, dim: int = 2) -> torch.Tensor:
        """``per_query_row``'s rows of this block along ``dim`` (a view)."""
        return per_query_row.narrow(dim, self.row_start, self.block_rows)

    def group(self, per_query_head: torch.Tensor) -> torch.Tensor:
        """(B, Hq, L, ...) -> (B, Hkv, G * n, ...) in the compute dtype (this block's rows)."""
        trailing = per_query_head.shape[3:]
        grouped = self.row_slice(per_query_head).reshape(self.batch, self.kv_heads, self.grouped_rows, *trailing)
        return grouped.to(self.compute_dtype)

    def ungroup(self, grouped: torch.Tensor) -> torch.Tensor:
        """(B, Hkv, G * n, ...) -> (B, Hq, n, ...)."""
        trailing = grouped.shape[3:]
        return grouped.reshape(self.batch, self.query_heads, self.block_rows, *trailing)

    def query_positions(self) -> torch.Tensor:
        """Position i inside its sequence of each grouped row (row g * n + i - row_start)."""
        local = torch.arange(self.grouped_rows, device=self.device) % max(self.block_rows, 1)
        return local + self.row_start

    def dropout_row_offsets(self) -> torch.Tensor:
        """Philox offset of key 0 for each grouped row, shape (B, Hkv, G * n, 1), int64.

        ``((b * Hq + h) * L + i) * S`` with ``h = hk * G + g``; because the heads of a group are
        contiguous, ``b * Hq + h == (b * Hkv + hk) * G + g``.
        """
        heads = torch.arange(self.batch * self.query_heads, dtype=torch.int64, device=self.device)
        rows = torch.arange(self.row_start, self.row_stop, dtype=torch.int64, device=self.device)
        offsets = (heads[:, None] * self.query_len + rows[None, :]) * self.key_len
        return offsets.reshape(self.batch, self.kv_heads, self.grouped_rows, 1)


def _describe_problem(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> _GroupedProblem:
    batch, query_heads, query_len, _ = query.shape
    _, kv_heads, key_len, _ = key.shape
    if (kv_heads == 0 and query_heads != 0) or (kv_heads != 0 and query_heads % kv_heads != 0):
        raise ValueError(
            f"reference attention: query heads ({query_heads}) must be a multiple of key/value "
            f"heads ({kv_heads}); repeat the key/value heads or fix the head counts"
        )
    if value.shape[:3] != key.shape[:3]:
        raise ValueError(
            f"reference attention: value {tuple(value.shape)} must match key {tuple(key.shape)} "
            "in batch, heads and sequence length"
        )
    compute_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    return _GroupedProblem(
        batch=batch,
        query_heads=query_heads,
        kv_heads=kv_heads,
        group_size=query_heads // kv_heads if kv_heads else 1,  # no heads at all: an empty problem
        query_len=query_len,
        key_len=key_len,
        compute_dtype=compute_dtype,
        device=query.device,
    )


def _key_chunks(problem: _GroupedProblem, band: Optional[Band] = None):
    """Key chunks [start, stop); with a band, only those the band of some row of ``problem`` reaches."""
    first, last = 0, problem.key_len
    if band is not None and band.lower is not None:
        first = max(first, problem.row_start + band.lower)  # the first row's first key; later rows start later
    if band is not None and band.upper is not None:
        last = min(last, problem.row_stop - 1 + band.upper + 1)  # the last row's last key, exclusive
    for start in range(first // KEY_CHUNK * KEY_CHUNK, max(last, 0), KEY_CHUNK):
        yield start, min(start + KEY_CHUNK, problem.key_len)


def _row_blocks(problem: _GroupedProblem, band: Band):
    """``problem`` split into blocks of :data:`ROW_BLOCK` query rows when a band lets a block skip
    key chunks, else whole."""
    if (band.lower is None and band.upper is None) or problem.query_len <= ROW_BLOCK:
        yield problem
        return
    for start in range(0, problem.query_len, ROW_BLOCK):
        yield problem.rows_of(start, min(start + ROW_BLOCK, problem.query_len))


def _chunk_scores(
    problem: _GroupedProblem,
    grouped_query: torch.Tensor,
    key_chunk: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    band: Band,
    scale: float,
    start: int,
    stop: int,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Masked scores ``scale * q k^T + mask`` of one key chunk, (B, Hkv, G * L, stop - start), the
    scaled products soft-capped first when ``softcap`` > 0.

    Invisible keys are -inf.
    """
    scores = scale * (grouped_query @ key_chunk.to(problem.compute_dtype).transpose(-2, -1))
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if attn_mask is not None:
        # Slice before reshaping so a broadcast (stride-0) mask is only materialised per chunk.
        mask_chunk = problem.row_slice(attn_mask)[..., start:stop].reshape(scores.shape)
        if mask_chunk.dtype == torch.bool:
            scores = scores.masked_fill(~mask_chunk, float("-inf"))
        else:
            mask_chunk = mask_chunk.to(problem.compute_dtype)
            clamped = torch.where(mask_chunk.isneginf(), mask_chunk, mask_chunk.clamp(min=_MASK_FLOOR))
            scores = scores + clamped
    # A side of the band that no (row, key) of this chunk crosses hides nothing: no select.
    crosses_upper = band.upper is not None and stop - 1 > problem.row_start + band.upper
    crosses_lower = band.lower is not None and start < problem.row_stop - 1 + band.lower
    if not (crosses_upper or crosses_lower):
        return scores
    key_positions = torch.arange(start, stop, device=problem.device)[None, :]
    query_positions = problem.query_positions()[:, None]
    if crosses_upper:
        scores = scores.masked_fill(key_positions > query_positions + band.upper, float("-inf"))
    if crosses_lower:
        scores = scores.masked_fill(key_positions < query_positions + band.lower, float("-inf"))
    return scores


def _layout_scores(problem: _GroupedProblem, scores: torch.Tensor, block_layout: Optional[tuple], start: int,
                   stop: int) -> torch.Tensor:
    """``scores`` of keys [start, stop) with -inf outside a block-sparse layout (None: as they are);
    ``block_layout`` is ``(block_map, block_q, block_k)``."""
    if block_layout is None:
        return scores
    block_map, block_q, block_k = block_layout
    in_layout = expand_block_map(block_map, block_q, block_k, problem.row_start, problem.row_stop, start, stop)
    in_layout = in_layout.expand(problem.batch, problem.query_heads, problem.block_rows, stop - start)
    return scores.masked_fill(~in_layout.reshape(scores.shape), float("-inf"))


def _visible_score_chunks(problem, grouped_query, key, attn_mask, band, scale, block_layout, softcap=0.0):
    """(start, stop, scores) of each chunk of keys the band reaches: the scores of keys
    [start, stop) with the soft cap, the mask, the band and the block layout applied (-inf where
    invisible)."""
    for start, stop in _key_chunks(problem, band):
        scores = _chunk_scores(problem, grouped_query, key[..., start:stop, :], attn_mask, band, scale, start, stop,
                               softcap)
        yield start, stop, _layout_scores(problem, scores, block_layout, start, stop)


def _running_max(row_max, scores):
    """(new row max, the shift to exponentiate against) after one more chunk of scores. A row with
    no visible key so far has max -inf; shifting by it would give -inf - -inf = NaN, so it shifts by 0."""
    new_max = torch.maximum(row_max, scores.amax(dim=-1))
    return new_max, torch.where(new_max.isneginf(), torch.zeros_like(new_max), new_max)


def _dropout_scale(
    problem: _GroupedProblem,
    rng_seed: Optional[torch.Tensor],
    dropout_p: float,
    start: int,
    stop: int,
) -> Optional[torch.Tensor]:
    """keep / (1 - p) for one key chunk, or None without dropout."""
    if dropout_p <= 0:
        return None
    if rng_seed is None:
        raise ValueError("reference attention: dropout_p > 0 needs rng_seed, an int64 tensor of shape (1,)")
    offsets = problem.dropout_row_offsets() + torch.arange(start, stop, device=problem.device)
    keep = philox_uniform(int(rng_seed.item()), offsets) >= dropout_p
    # dropout_p == 1 drops everything; 1 / (1 - p) would turn the zeros into 0 * inf = NaN.
    rescale = 1.0 / (1.0 - dropout_p) if dropout_p < 1 else 0.0
    return keep.to(problem.compute_dtype) * rescale


def reference_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    rng_seed: Optional[torch.Tensor],
    dropout_p: float,
    is_causal: bool,
    causal_offset: int,
    scale: float,
    window: Optional[tuple[int, int]] = None,
    block_layout: Optional[tuple] = None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward; returns ``(out, lse)``.

    Args:
        query: (B, Hq, L, E); key: (B, Hkv, S, E); value: (B, Hkv, S, Ev); Hq % Hkv == 0.
        attn_mask: None, or (B, Hq, L, S) bool (True = attend) or float (added to the scores);
            may be an expanded view.
        rng_seed: int64 tensor of shape (1,) when ``dropout_p > 0``.
        dropout_p: probability of dropping each attention probability.
        is_causal: key j is visible to query i iff ``j <= i + causal_offset``.
        scale: multiplies ``q . k`` before the mask is added.
        window: None or ``(left, right)``: key j is visible to query i iff
            ``-left <= j - (i + S - L) <= right``, -1 an open side (``flash_attention``'s).
        block_layout: None, or ``(block_map, block_q, block_k)``: a (Bm, Hm, ceil(L / block_q),
            ceil(S / block_k)) bool map (Bm in {1, B}, Hm in {1, Hq}); key j is visible to row i
            only where ``block_map[b, h, i // block_q, j // block_k]``.
        softcap: 0, or the soft cap c > 0: the scaled score s becomes ``c * tanh(s / c)`` before
            the mask is added.

    Returns:
        out: (B, Hq, L, Ev) in the query dtype, ``dropout(softmax(s)) @ V``.
        lse: (B, Hq, L) natural-log log-sum-exp of the undropped scores, -inf for rows without
            a visible key; float32, or float64 for float64 inputs.
    """
    problem = _describe_problem(query, key, value)
    band = resolve_band(is_causal, causal_offset, window, problem.query_len, problem.key_len)
    blocks = list(_row_blocks(problem, band))
    if len(blocks) == 1:
        out, lse = _forward_rows(problem, query, key, value, attn_mask, band, scale, rng_seed, dropout_p, block_layout,
                                 softcap)
        return out.to(query.dtype).contiguous(), lse.contiguous()
    out = query.new_empty((*query.shape[:3], value.shape[-1]))
    lse = torch.empty(query.shape[:3], dtype=problem.compute_dtype, device=problem.device)
    for block in blocks:
        block_out, block_lse = _forward_rows(block, query, key, value, attn_mask, band, scale, rng_seed, dropout_p,
                                             block_layout, softcap)
        block.row_slice(out).copy_(block_out)
        block.row_slice(lse).copy_(block_lse)
    return out, lse


def _forward_rows(problem, query, key, value, attn_mask, band, scale, rng_seed, dropout_p, block_layout, softcap=0.0):
    """(out, lse) of ``problem``'s query rows, (B, Hq, n, Ev) and (B, Hq, n), in the compute dtype."""
    grouped_query = problem.group(query)
    rows_shape = grouped_query.shape[:3]
    running_max = torch.full(rows_shape, float("-inf"), dtype=problem.compute_dtype, device=problem.device)
    running_sum = torch.zeros(rows_shape, dtype=problem.compute_dtype, device=problem.device)
    accumulator = torch.zeros(
        (*rows_shape, value.shape[-1]), dtype=problem.compute_dtype, device=problem.device
    )

    for start, stop, scores in _visible_score_chunks(problem, grouped_query, key, attn_mask, band, scale, block_layout,
                                                     softcap):
        new_max, shift = _running_max(running_max, scores)
        correction = torch.exp(running_max - shift)
        probs = torch.exp(scores - shift[..., None])
        running_sum = running_sum * correction + probs.sum(dim=-1)
        dropout_scale = _dropout_scale(problem, rng_seed, dropout_p, start, stop)
        if dropout_scale is not None:
            probs = probs * dropout_scale
        value_chunk = value[..., start:stop, :].to(problem.compute_dtype)
        accumulator = accumulator * correction[..., None] + probs @ value_chunk
        running_max = new_max

    # l == 0 exactly when no key was visible (the kernel's test too). Not "l > 0": a NaN score
    # makes l NaN, and that row must come out NaN, not pass for a fully-masked row with output 0.
    has_visible_key = running_sum != 0
    safe_sum = torch.where(has_visible_key, running_sum, torch.ones_like(running_sum))
    out = torch.where(has_visible_key[..., None], accumulator / safe_sum[..., None], 0.0)
    lse = torch.where(has_visible_key, running_max + torch.log(safe_sum), float("-inf"))
    return problem.ungroup(out), problem.ungroup(lse)


def _softcap_slope(scaled_products: torch.Tensor, softcap: float) -> torch.Tensor:
    """d(c * tanh(s / c)) / ds = 1 - tanh(s / c) ** 2 at the scaled products s."""
    return 1.0 - torch.tanh(scaled_products / softcap).square()


# LSEs below this only come from rows whose every visible key sits at the mask clamp.
_LSE_SATURATED = -1e37


def _row_reference(problem, grouped_query, key, attn_mask, band, scale, grouped_lse, block_layout=None, softcap=0.0):
    """Per row, the (reference, shift) the backward recomputes P with: P = exp((s - reference) - shift).

    Normally reference = lse and shift = 0; rows with no visible key get reference = +inf, so P
    is 0 there instead of NaN. A row whose every visible key sits at the -1e38 mask clamp
    (finfo(fp32/bf16).min masks) has lse ~ -1e38, which cannot also hold log(l) in fp32 (nor
    fp64): for such rows one more pass over the keys recovers the max and log-sum separately,
    exactly as the kernel's _attn_bwd_row_reference does.
    """
    reference = grouped_lse.masked_fill(grouped_lse.isneginf(), float("inf"))
    shift = torch.zeros_like(reference)
    saturated = (grouped_lse < _LSE_SATURATED) & grouped_lse.isfinite()
    if saturated.any():
        row_max = torch.full_like(reference, float("-inf"))
        row_sum = torch.zeros_like(reference)
        for _, _, scores in _visible_score_chunks(problem, grouped_query, key, attn_mask, band, scale, block_layout,
                                                  softcap):
            new_max, safe_max = _running_max(row_max, scores)
            row_sum = row_sum * torch.exp(row_max - safe_max) + torch.exp(scores - safe_max[..., None]).sum(dim=-1)
            row_max = new_max
        reference = torch.where(saturated, row_max, reference)
        shift = torch.where(saturated, torch.log(torch.where(saturated, row_sum, torch.ones_like(row_sum))), shift)
    return reference[..., None], shift[..., None]


def reference_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    out: torch.Tensor,
    lse: torch.Tensor,
    rng_seed: Optional[torch.Tensor],
    dropout_p: float,
    is_causal: bool,
    causal_offset: int,
    scale: float,
    compute_mask_grad: bool,
    grad_lse: Optional[torch.Tensor] = None,
    exact_delta: bool = True,
    window: Optional[tuple[int, int]] = None,
    block_layout: Optional[tuple] = None,
    softcap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention backward; returns ``(dq, dk, dv, dmask)``.

    The arguments are those of :func:`reference_forward` plus ``grad_out`` (B, Hq, L, Ev) and its
    outputs ``out`` / ``lse``; ``grad_lse`` (B, Hq, L), if given, is the gradient flowing into
    ``lse`` (d lse / d s = P, so it enters as ``dS = P * (dP - Delta + grad_lse)``). dk and dv are
    summed over the query heads of each KV group.
    ``dmask`` is the dense (B, Hq, L, S) gradient of a floating ``attn_mask`` in the mask's dtype
    when ``compute_mask_grad`` is set (it equals dS, the gradient of the pre-softmax scores);
    otherwise, and for None or bool masks, it is ``query.new_empty(0)``.

    ``exact_delta``: when ``out`` is rounded below the compute dtype, form Delta from P and dP
    (one more pass over the keys) instead of from that ``out``; False gives FlashAttention-2's
    Delta, whose error peaked or near-tied attention amplifies in dq. The attention ops always
    use True: this path keeps P and dS in fp32 under every schedule too.
    ``block_layout`` and ``softcap`` are :func:`reference_forward`'s; under a soft cap dS reaches
    dQ and dK through the cap's slope, ``1 - tanh(s / c) ** 2``. ``sinks`` (Hq,): the attention
    sinks that ``out`` and ``lse`` carry (ops/sinks.py); only the exact Delta's mean reads them.
    """
    problem = _describe_problem(query, key, value)
    band = resolve_band(is_causal, causal_offset, window, problem.query_len, problem.key_len)
    grouped_query = problem.group(query)
    grouped_grad_out = problem.group(grad_out)
    row_reference, row_shift = _row_reference(
        problem, grouped_query, key, attn_mask, band, scale, problem.group(lse), block_layout, softcap
    )

    def chunk(start, stop):
        """Keys [start, stop): K, V, the probabilities P, dP (through dropout), the dropout scale."""
        key_chunk = key[..., start:stop, :].to(problem.compute_dtype)
        value_chunk = value[..., start:stop, :].to(problem.compute_dtype)
        scores = _layout_scores(problem, _chunk_scores(problem, grouped_query, key_chunk, attn_mask, band, scale, start,
                                                       stop, softcap), block_layout, start, stop)
        probs = torch.exp((scores - row_reference) - row_shift)
        grad_probs = grouped_grad_out @ value_chunk.transpose(-2, -1)
        dropout_scale = _dropout_scale(problem, rng_seed, dropout_p, start, stop)
        if dropout_scale is not None:
            grad_probs = grad_probs * dropout_scale
        return key_chunk, value_chunk, probs, grad_probs, dropout_scale

    # Delta_i = sum_j P_ij dP_ij is what the softmax backward subtracts; rowsum(dO * O) equals it
    # (O is the dropped output, matching dP) as long as O is not rounded.
    delta = (grouped_grad_out * problem.group(out)).sum(dim=-1, keepdim=True)
    if exact_delta and torch.finfo(out.dtype).bits < torch.finfo(problem.compute_dtype).bits:
        # O stored in 16 bits puts u |dO| |O| into Delta and so into every dS of the row. Sum
        # P * dP instead, divided by sum P: the mean under the P this backward recomputes, which
        # an LSE rounded in fp32 can make sum to 1 - 1e-3 at large logits.
        weighted = torch.zeros_like(delta)
        total = torch.zeros_like(delta)
        if sinks is not None:
            # The sink is one more column, with no value (dP = 0): it adds its weight to the total
            # only, so the mean divides by 1 up to the LSE's rounding, not by the keys' 1 - p_s.
            sink_lse = sinks.to(lse.dtype)[None, :, None] - lse
            total += problem.group(torch.where(lse.isfinite(), torch.exp(sink_lse), 0.0))[..., None].to(total.dtype)
        for start, stop in _key_chunks(problem, band):
            _, _, probs, grad_probs, _ = chunk(start, stop)
            weighted += (probs * grad_probs).sum(dim=-1, keepdim=True)
            total += probs.sum(dim=-1, keepdim=True)
        # Rows that see no key have P = 0 (so dS = 0 whatever Delta is): keep theirs.
        delta = torch.where(total > 0, weighted / torch.where(total > 0, total, 1.0), delta)
    if grad_lse is not None:
        delta = delta - problem.group(grad_lse)[..., None]

    wants_mask_grad = compute_mask_grad and attn_mask is not None and attn_mask.is_floating_point()
    grad_mask = (
        torch.empty(attn_mask.shape, dtype=attn_mask.dtype, device=problem.device)
        if wants_mask_grad
        else query.new_empty(0)
    )
    grad_query = torch.zeros_like(grouped_query)
    # Zero-filled: key chunks no row's band reaches are skipped and keep a zero gradient.
    grad_key = torch.zeros(key.shape, dtype=key.dtype, device=problem.device)
    grad_value = torch.zeros(value.shape, dtype=value.dtype, device=problem.device)
    if wants_mask_grad:
        grad_mask.zero_()

    for start, stop in _key_chunks(problem, band):
        key_chunk, value_chunk, probs, grad_probs, dropout_scale = chunk(start, stop)
        dropped_probs = probs if dropout_scale is None else probs * dropout_scale
        grad_scores = probs * (grad_probs - delta)
        # The gradient of the raw products: through the cap's slope (the mask's is dS itself).
        grad_products = grad_scores if softcap <= 0 else grad_scores * _softcap_slope(
            scale * (grouped_query @ key_chunk.transpose(-2, -1)), softcap)

        grad_value[..., start:stop, :] = dropped_probs.transpose(-2, -1) @ grouped_grad_out
        grad_key[..., start:stop, :] = scale * (grad_products.transpose(-2, -1) @ grouped_query)
        grad_query += scale * (grad_products @ key_chunk)
        if wants_mask_grad:
            grad_mask[..., start:stop] = problem.ungroup(grad_scores)

    return problem.ungroup(grad_query).to(query.dtype), grad_key, grad_value, grad_mask
