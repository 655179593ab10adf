"""How the backward rounds dS before it meets the matrix unit, and the per-call choice of loop.

Glossary (the backward's own, ``attn_bwd.py``, has the derivation):

* B (``bound``): an upper bound on |dS| over the whole call, from three maxima the preprocess
  collects (``DS_STATS``: max ‖dO_i‖², max ‖v_j‖², max |dLSE_i|) and the dropout keep scale.
* ``ds_up``: the power of two the plain loop scales dS up by before the fp16 cast, so tiny dS
  keep their significant bits; 1 in the rescaling loop.
* ``DS_RESCALE`` (constexpr): the schedule rescales fp16 dS at all (fp16 `stable`).
* ``RESCALE`` (constexpr): this loop is the per-tile rescaling one (bound past ``DS_RESCALE_ABOVE``).
* ``DS_IN_FP32`` (constexpr): dS meets the matrix unit in fp32 (tf32x3, the `accurate` schedule).
* ``FP32_DOT``: the dot precision for fp32 operands.
"""

import triton
import triton.language as tl

# Under the fp16 schedules that rescale dS, a program takes the rescaling loop only when the
# bound on |dS| (``_ds_loop_choice``) passes this; below it no tile can reach fp16's
# 65504 (a 4x margin for the rounding of the recomputed P and of Δ), so the plain loop, which
# accumulates inside the dot, gives the same gradients. A NaN bound takes the rescaling loop.
DS_RESCALE_ABOVE = tl.constexpr(16384.0)
# Bounds below this (all |dS| under ~1.5e-8) get the largest plain-loop scale-up, 2^40, rather than
# one that grows without limit (a bound of 0 would give inf).
DS_UP_MIN_BOUND = tl.constexpr(2.0**-26)


@triton.jit
def _ds_loop_choice(DS_STATS, keep_scale):
    """(needs_rescale, ds_up) for this call, from the preprocess's statistics of its inputs.

    DS_STATS holds three fp32 maxima over the call (``_attn_bwd_preprocess``; an input's NaN is
    stored as +inf): max_i ‖dO_i‖², max_j ‖v_j‖² and max_i |dLSE_i|. dS_ij = P_ij (dP_ij - Δ_i)
    with 0 <= P_ij <= 1, dP_ij = k dO_i·v_j (k the dropout keep scale, else 1) and
    Δ_i = dO_i·O_i - dLSE_i, where O_i, a k-scaled convex combination of the v_j, has
    ‖O_i‖ <= k max_j ‖v_j‖; so |dS_ij| <= B = 2 k max‖dO_i‖ max‖v_j‖ + max|dLSE_i|. (A caller
    that forces B stores (0, 0, B).)

    needs_rescale: B passes DS_RESCALE_ABOVE, or is NaN; then ds_up = 1. Otherwise ds_up is the
    largest power of two with B * ds_up <= DS_RESCALE_ABOVE, within [1, 2^40]: the plain loop's
    scale-up (module docstring)."""
    # Correctly rounded square roots: scaling dO by 2^k then scales B by exactly 2^k, and ds_up
    # by 2^-k (test_plain_loop_scale_up_is_exact).
    bound = (2.0 * keep_scale) * tl.sqrt_rn(tl.load(DS_STATS)) * tl.sqrt_rn(tl.load(DS_STATS + 1))
    bound += tl.load(DS_STATS + 2)
    needs_rescale = (bound > DS_RESCALE_ABOVE) | (bound != bound)
    b = tl.minimum(tl.maximum(bound, DS_UP_MIN_BOUND), DS_RESCALE_ABOVE)
    # 2^floor(log2(DS_RESCALE_ABOVE / b)), written so the quotient is exact (a power of two
    # divides) and exp2 meets an integer (an exact power).
    ds_up = tl.math.exp2(-tl.ceil(tl.log2(b / DS_RESCALE_ABOVE)))
    # A log2 rounded down onto an integer gives one doubling too many; undo it (ds_up * b is exact).
    ds_up = tl.where(ds_up * b > DS_RESCALE_ABOVE, ds_up * 0.5, ds_up)
    return needs_rescale, tl.where(needs_rescale, 1.0, ds_up)


@triton.jit
def _ds_scores(p, dp, delta, ds_up, DS_RESCALE: tl.constexpr, RESCALE: tl.constexpr):
    """dS = P * (dP - Δ) in fp32 (``delta`` broadcast to the tile's rows), and in DS_RESCALE's
    plain loop already times ds_up: the power of two rides in one FFMA, dP * ds_up - Δ * ds_up,
    instead of a multiply per score afterwards. The product is bitwise the same (scaling by a power
    of two commutes with rounding; |dP - Δ| is within the call's bound, so the scaled value stays
    below DS_RESCALE_ABOVE). ``_ds_unscale`` gives the factor back to dS's own units."""
    if DS_RESCALE and not RESCALE:
        return p * tl.fma(dp, ds_up, -(delta * ds_up))
    else:
        return p * (dp - delta)


@triton.jit
def _ds_unscale(ds_up, DS_RESCALE: tl.constexpr, RESCALE: tl.constexpr):
    """The factor that takes ``_ds_scores``' tile to dS's own units (exact: a power of two)."""
    if DS_RESCALE and not RESCALE:
        return 1.0 / ds_up
    else:
        return 1.0


@triton.jit
def _ds_operand(ds, dtype, DS_IN_FP32: tl.constexpr, RESCALE: tl.constexpr):
    """dS as the matrix unit receives it: (tile, factor), tile * factor being dS rounded only as the
    precision schedule allows (factor 1 unless the tile was rescaled)."""
    if DS_IN_FP32:
        return ds, 1.0
    elif RESCALE:
        # dS = P*(dP - delta) can exceed fp16's 65504 while the gradient it feeds is finite
        # (|V| or |dO| ~ 1e4). Scale the tile by a power of two (exact) so its largest
        # element stays below 2^14 when rounded, and undo the scale on the fp32 product.
        amax = tl.max(tl.abs(ds))
        exponent = tl.where(amax > 16384.0, tl.ceil(tl.log2(amax)) - 14.0, 0.0)  # not the row shift
        factor = tl.math.exp2(exponent)
        return (ds / factor).to(dtype), factor
    else:
        return ds.to(dtype), 1.0


@triton.jit
def _accumulate_ds_dot(acc, tile, factor, x, RESCALE: tl.constexpr, FP32_DOT: tl.constexpr):
    """acc + (tile * factor) @ x in fp32, for a (tile, factor) from ``_ds_operand``.

    Without a rescale the product accumulates into ``acc`` inside the dot, which lets the
    matrix unit keep the accumulator in its own registers; a rescaled tile's product must be
    multiplied by its factor first, so it takes a separate result and an add."""
    if RESCALE:
        return acc + tl.dot(tile, x.to(tile.dtype), input_precision=FP32_DOT) * factor
    else:
        return tl.dot(tile, x.to(tile.dtype), acc, input_precision=FP32_DOT)


@triton.jit
def _ds_tile(ds, dtype, ds_up, DS_IN_FP32: tl.constexpr, DS_RESCALE: tl.constexpr, RESCALE: tl.constexpr):
    """``_ds_operand`` for ``_ds_scores``' tile: (tile, factor), tile * factor being dS as the
    schedule rounds it. In DS_RESCALE's plain loop the tile is dS * ds_up and factor 1 / ds_up;
    ``_accumulate_ds_dot`` adds the plain loop's tiles without their factor, so dq and dk hold ds_up
    times their sums until the kernels' final scale."""
    if DS_RESCALE and not RESCALE:
        tile, _ = _ds_operand(ds, dtype, DS_IN_FP32=DS_IN_FP32, RESCALE=False)
        return tile, 1.0 / ds_up
    else:
        return _ds_operand(ds, dtype, DS_IN_FP32=DS_IN_FP32, RESCALE=RESCALE)


@triton.jit
def _max_as_stat(values):
    """The maximum of a block of non-negative values for ``_ds_loop_choice``'s statistics, with
    NaN read as +inf (a non-finite input must not look small; max would drop the NaN)."""
    return tl.max(tl.where(values == values, values, float("inf")), axis=0)
