"""Logit soft-capping in hand-written attention: ``cap * tanh(scores / cap)`` (Gemma 2, Grok).

The op's ``softcap=c`` computes ``c * tanh(scale * q·k / c)`` and then adds the mask. A site whose
score steps are

    Q·Kᵀ  ->  scales (casts, views)  ->  tanh  ->  * c  ->  masks (casts, views)  ->  softmax

is exactly that, with ``scale`` the product of every scale before the tanh and ``c``:
``c * tanh(a * s) = c * tanh((a * c) * s / c)`` however the model splits ``a`` between its softmax
scale and ``1 / c`` (Gemma 2: ``s * scaling / c``; Grok: ``s / c``). ``_masks`` multiplies the
scale steps up to the cap (no mask comes before them) into the op's scale, so the cap's factor
stays an ordinary scale step and only the tanh leaves the step list. Any other arrangement keeps
the site: a mask before the tanh is capped in eager but not by the op, a scale after the cap
would scale the capped scores, and a tanh without the factor is not a cap.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from .fx_match import Keep, is_function, is_method
from .handwritten_site import Product, Step

_NEUTRAL = ("cast", "view")  # steps that change no score value


def pattern_softcap(node: fx.Node, head_dim: Any = None) -> Optional[Step]:
    # Gemma 2 (HF eager_attention_forward): w = w / softcap; w = torch.tanh(w); w = w * softcap;
    # Grok-1: 30.0 * torch.tanh(scores / 30.0). The tanh alone: read_softcap checks its neighbours.
    if (is_function(node, torch.tanh, F.tanh) or is_method(node, "tanh")) and len(node.args) == 1 \
            and not node.kwargs and isinstance(node.args[0], fx.Node):
        return Step("tanh", node, node.args[0])
    return None


def read_softcap(product: Product, steps: list[Step]) -> Optional[float]:
    """The cap of a soft-capped site (the tanh step is removed from ``steps``), None without a
    tanh; raises Keep where the tanh is not exactly the op's soft-capping."""
    tanhs = [i for i, step in enumerate(steps) if step.kind == "tanh"]
    if not tanhs:
        return None
    at, tanh = tanhs[0], steps[tanhs[0]].node
    if len(tanhs) > 1:
        raise Keep(f"the scores go through tanh twice ({tanh.name}, {steps[tanhs[1]].node.name}); "
                   "the op's softcap applies one")
    if product.bias is not None:
        raise Keep(f"{product.node.name} adds a bias before the tanh at {tanh.name}: the op's softcap caps "
                   "the scaled scores and adds masks after it")
    before = next((s for s in steps[:at] if s.kind not in ("scale", *_NEUTRAL)), None)
    if before is not None:
        raise Keep(f"a mask is applied at {before.node.name} before the tanh at {tanh.name}: eager caps it "
                   "with the scores, the op's softcap adds masks after capping")
    cap_at = next((i for i in range(at + 1, len(steps)) if steps[i].kind not in _NEUTRAL), None)
    if cap_at is None or steps[cap_at].kind != "scale":
        raise Keep(f"the tanh at {tanh.name} is not followed by a multiplication by the cap: not soft-capping "
                   "(c * tanh(s / c))")
    cap = steps[cap_at]
    if cap.scale.head_dim_power != 0 or not cap.scale.coef > 0:
        raise Keep(f"the tanh at {tanh.name} is multiplied by {cap.scale.coef:g} at {cap.node.name}: "
                   "a soft cap is a positive constant")
    again = next((s for s in steps[cap_at + 1:] if s.kind == "scale"), None)
    if again is not None:
        raise Keep(f"the soft-capped scores are scaled again at {again.node.name}: the op's softcap is "
                   "followed by the mask only")
    del steps[at]
    return cap.scale.coef
