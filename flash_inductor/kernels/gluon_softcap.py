"""Soft-capping for the Gluon Hopper kernels (kernels/hopper_fwd.py, hopper_bwd_tile.py):
FlashAttention-2's capped score s = c·tanh(u / c), u = scale·q·k, in fp32, before the mask.

Gluon has no tanh, and ``tanh.approx.f32`` (one MUFU op) is off by up to 2^-10.7 relative: at
c = 50 that moves a logit by 0.02, a 2 % change of its probability, some five times bf16's rounding
of P. ``softcap_tanh`` is the Triton kernels' formula (``kernels/common._tanh``), so either path
caps a score the same way:

  |y| >= 1/4   (1 − e) / (1 + e), e = exp2(−2·log2(e)·|y|) in (0, 0.61], sign restored: one ex2
               and one rcp (the denominator lies in (1, 2], so ``rcp.approx`` needs none of a full
               division's range handling), and it saturates to ±1 without overflow;
  |y| <  1/4   the odd Taylor series to y⁹ (the next term is under fp32's ulp there), where 1 − e
               would cancel: an absolute error of an ulp of 1 near 0 would be a large relative one.

Error against tanh in fp64 (tools: an fp32 emulation of these steps over 3·10⁶ points in [−12, 12]
and 10⁻⁸ <= |y| <= 16): below |y| = 1/4 at most 1.1 ulp; above, at most 3.7 ulp with exactly
rounded ex2 and rcp, and at most 14 ulp (8·10⁻⁷ relative), near |y| = 1/4, with ``ex2.approx`` and
``rcp.approx`` off by their documented worst (2^-22 and 2^-23 relative) in the worst direction. The
capped score in base 2 is then off by at most c·log2(e)·8·10⁻⁷ (5.8·10⁻⁵ at c = 50), a relative
change of P under 4·10⁻⁵, far below the 2^-8 of P's rounding to bf16.

Cost per score: two MUFU ops (ex2, rcp) and about 15 FMA-pipe instructions, both branches being
computed and one selected.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def _rcp(x):
    """1 / x to 1 ulp for x in (1, 2] (one MUFU.RCP; ``/`` would be a full division)."""
    return gl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def softcap_tanh(y):
    """tanh(y) in fp32 (module docstring): finite y only (the kernels mask after it)."""
    magnitude = gl.abs(y)
    e = gl.exp2(magnitude * (-2.0 * LOG2E))
    far = (1.0 - e) * _rcp(1.0 + e)
    far = gl.where(y < 0, -far, far)
    y2 = y * y
    # Odd, so it carries y's sign itself.
    near = y * (1.0 + y2 * (-1.0 / 3.0 + y2 * (2.0 / 15.0 + y2 * (-17.0 / 315.0 + y2 * (62.0 / 2835.0)))))
    return gl.where(magnitude < 0.25, near, far)


@gluon.jit
def softcap_slope(t):
    """d(c·tanh(u / c)) / du = 1 − t² at t = tanh(u / c): in [0, 1], dS's factor on its way to dQ
    and dK. One FFMA; near |t| = 1 its absolute error is fp32's ulp of 1, negligible beside dS's
    own rounding to 16 bits."""
    return gl.fma(-t, t, 1.0)
