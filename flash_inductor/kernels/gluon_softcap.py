"""Soft-capping for the Gluon Hopper kernels (kernels/hopper_fwd.py, hopper_bwd_tile.py):
FlashAttention-2's capped score s = c·tanh(u / c), u = scale·q·k, in fp32, before the mask.

Gluon has no tanh, and ``tanh.approx.f32`` (one MUFU op) is off by up to 2^-10.7 relative: at
c = 50 that moves a logit by 0.02, a 2 % change of its probability, some five times bf16's rounding
of P. ``softcap_tanh`` computes

  tanh(y) = 1 − 2 / (1 + e),  e = exp2(2·log2(e)·y)

with one ex2 and one ``rcp.approx`` (MUFU) and three FMA-pipe instructions per score. It saturates
without a branch: e = inf gives 1, e = 0 gives −1. What the softmax needs of t is a small *absolute*
error (the capped score is c·t): near y = 0 the form cancels, so its relative error there is large,
but its absolute error stays within a few ulps of 1 everywhere (2^-22 relative for each MUFU op,
and one rounding of 1 − 2r): at most 4·10⁻⁷, so the capped score in base 2 is off by at most
c·log2(e)·4·10⁻⁷ (3·10⁻⁵ at c = 50), a relative change of P under 3·10⁻⁵, far below the 2^-8 of
P's rounding to bf16. The Triton kernels (``kernels/common._tanh``) add a Taylor branch below
|y| = 1/4 for relative accuracy there; the two paths' t differ by at most that absolute error. The
forward and the backward both call this function, so the backward recomputes exactly the forward's
t (which `stable`'s exact P needs).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def _rcp(x):
    """1 / x to an ulp for x >= 1 (one MUFU.RCP; ``/`` would be a full division): inf gives 0."""
    return gl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def softcap_tanh(y):
    """tanh(y) in fp32 to a small absolute error (module docstring), for any y but NaN."""
    e = gl.exp2(y * (2.0 * LOG2E))
    return 1.0 - 2.0 * _rcp(1.0 + e)


@gluon.jit
def softcap_slope(t):
    """d(c·tanh(u / c)) / du = 1 − t² at t = tanh(u / c): in [0, 1], dS's factor on its way to dQ
    and dK. One FFMA; near |t| = 1 its absolute error is fp32's ulp of 1, negligible beside dS's
    own rounding to 16 bits."""
    return gl.fma(-t, t, 1.0)
