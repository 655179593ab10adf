"""``launch.Visibility``: the launchers' one argument for the causal side, the window and the
block-sparse layout (``flash_inductor/launch/visibility.py``)."""

from __future__ import annotations

import pytest
import torch

from flash_inductor import launch
from flash_inductor.launch import NO_MASKING, Visibility
from flash_inductor.launch.band import Band, resolve_band
from flash_inductor.launch.decode import decode_attention_forward
from flash_inductor.launch.fp8 import attention_forward_fp8


@pytest.mark.parametrize("rules", [
    dict(),
    dict(is_causal=True),
    dict(is_causal=True, causal_offset=5),
    dict(window=(3, 0)),
    dict(window=(-1, -1)),
    dict(is_causal=True, causal_offset=-2, window=(4, 1)),
], ids=str)
def test_band_is_resolve_band_of_its_fields(rules):
    seq_q, seq_k = 7, 11
    visibility = Visibility(**rules)
    expected = resolve_band(visibility.is_causal, visibility.causal_offset, visibility.window, seq_q, seq_k)
    assert visibility.band(seq_q, seq_k) == expected


def test_no_masking_sees_every_key():
    assert NO_MASKING.band(5, 9) == Band()
    assert NO_MASKING.block_map is None and (NO_MASKING.block_q, NO_MASKING.block_k) == (0, 0)


def test_causal_offset_counts_only_when_causal():
    assert Visibility(causal_offset=3).band(4, 4) == Band()
    assert Visibility(is_causal=True, causal_offset=3).band(4, 4) == Band(upper=3)


def test_without_block_layout_keeps_the_band():
    block_map = torch.ones((1, 1, 2, 2), dtype=torch.bool)
    visibility = Visibility(is_causal=True, causal_offset=1, window=(2, 0), block_map=block_map, block_q=4, block_k=4)
    stripped = visibility.without_block_layout()
    assert stripped.block_map is None and (stripped.block_q, stripped.block_k) == (0, 0)
    assert (stripped.is_causal, stripped.causal_offset, stripped.window) == (True, 1, (2, 0))
    assert visibility.block_map is block_map  # frozen: the original is unchanged


def test_is_frozen():
    with pytest.raises(AttributeError):
        NO_MASKING.is_causal = True


def _qkv(seq_q=4, seq_k=8):
    q = torch.randn(1, 2, seq_q, 16)
    k, v = torch.randn(1, 2, seq_k, 16), torch.randn(1, 2, seq_k, 16)
    return q, k, v


def test_the_launchers_refuse_the_causal_side_positionally():
    """The old call (is_causal and causal_offset between dropout_p and scale) must fail loudly, not
    be read with the offset as the scale."""
    q, k, v = _qkv()
    with pytest.raises(TypeError):
        launch.attention_forward(q, k, v, None, None, 0.0, True, 0, 0.25, "stable")
    out, lse = torch.zeros(1, 2, 4, 16), torch.zeros(1, 2, 4)
    with pytest.raises(TypeError):
        launch.attention_backward(out, q, k, v, None, out, lse, None, None, 0.0, True, 0, 0.25, "stable", False)


def test_decode_refuses_a_block_layout():
    q, k, v = _qkv()
    layout = Visibility(block_map=torch.ones((1, 1, 1, 1), dtype=torch.bool), block_q=4, block_k=8)
    with pytest.raises(ValueError, match="block-sparse"):
        decode_attention_forward(q, k, v, None, 0.25, "stable", visibility=layout)


def test_fp8_refuses_a_block_layout_it_was_not_given_as_a_mask():
    q, k, v = _qkv()
    layout = Visibility(block_map=torch.ones((1, 1, 1, 1), dtype=torch.bool), block_q=4, block_k=8)
    with pytest.raises(ValueError, match="fold it into attn_mask"):
        attention_forward_fp8(q, k, v, None, None, 0.0, 0.25, "fp8", visibility=layout)
