"""Block-sparse layouts on the Gluon Hopper kernels (``HAS_BLOCK_SPARSITY`` in kernels/hopper_fwd.py
and kernels/hopper_bwd.py, their launchers' ``block_layout``).

Everywhere: which layouts the kernels take (blocks that are multiples of 128 x 128, so no kernel
tile straddles a computed and a skipped block) and the tile lists they walk, against a brute-force
count of the tiles that hold a visible element.

On an sm_90 GPU with Gluon: the public function under `fast` and `stable`, forward and backward,
against the fp64 attention of the element mask the layout amounts to (the project's tolerance
rule, SDPA in the same dtype as the baseline), with the calls checked to have run the Gluon
kernels with the layout: random layouts at 50 % and 90 % sparsity, per-head and broadcast maps,
GQA, causal masking, L != S with ragged tiles, query blocks with no computed block (out 0, LSE
-inf, dq 0: ``assert_dead_rows_exact``) and key blocks that no query sees (dk = dv = 0), a key
mask, a sliding window, and persistent CTAs.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import pytest
import torch

from flash_inductor import BlockSparseLayout, flash_attention
from flash_inductor.block_sparse import expand_block_map
from flash_inductor.launch import block_tiles
from flash_inductor.launch.band import resolve_band
from flash_inductor.launch.visibility import Visibility
from helpers import (
    assert_close_to_ref,
    assert_dead_rows_exact,
    lse_baseline,
    mock_hopper,
    needs_hopper,
    ref_forward_backward,
    sdpa_baseline,
)


def _cdiv(a, b):
    return -(-a // b)


def _random_map(shape, density, seed, empty_rows=()):
    block_map = torch.rand(shape, generator=torch.Generator().manual_seed(seed)) < density
    for row in empty_rows:
        block_map[..., row, :] = False
    return block_map


# ------------------------------------------------------------------------------------------
# The choice and the tile lists (no GPU)
# ------------------------------------------------------------------------------------------


def test_gluon_layout_fits_multiples_of_128():
    assert block_tiles.gluon_layout_fits(128, 128)
    assert block_tiles.gluon_layout_fits(256, 384)
    assert not block_tiles.gluon_layout_fits(64, 128)
    assert not block_tiles.gluon_layout_fits(128, 96)


def test_the_hopper_kernels_take_layouts_of_128_blocks(monkeypatch):
    from flash_inductor.launch import hopper, hopper_bwd

    t = mock_hopper(monkeypatch)
    q, kv = t(2, 8, 512, 128), t(2, 2, 512, 128)
    for sizes in ((128, 128), (256, 128), (128, 512)):
        assert hopper.hopper_forward_unsupported_reason(q, kv, kv, None, 0.0, None, "stable", block_sizes=sizes) is None
        assert hopper_bwd.hopper_backward_unsupported_reason(q, kv, kv, None, 0.0, None, "fast",
                                                             block_sizes=sizes) is None
        assert hopper_bwd.one_pass_unsupported_reason(q, kv, kv, None, 0.0, None, "stable", block_sizes=sizes) is None
    for sizes in ((64, 128), (128, 64), (16, 16)):
        assert hopper.hopper_forward_unsupported_reason(q, kv, kv, None, 0.0, None, "stable",
                                                        block_sizes=sizes) == hopper.BLOCK_SPARSE
        assert hopper_bwd.hopper_backward_unsupported_reason(q, kv, kv, None, 0.0, None, "fast",
                                                             block_sizes=sizes) == hopper.BLOCK_SPARSE
    # The layout does not lift the kernels' other limits.
    assert "dropout" in hopper.hopper_forward_unsupported_reason(q, kv, kv, None, 0.1, None, "stable",
                                                                 block_sizes=(128, 128))


def test_the_launchers_refuse_layouts_they_cannot_take():
    q = k = torch.zeros(1, 2, 256, 64)
    small = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"Hopper forward takes layout blocks that are multiples of 128 x 128, got "
                                         r"64 x 64; call it only where hopper_forward_unsupported_reason"):
        block_tiles.checked_gluon_layout((small, 64, 64), q, k, "forward")
    with pytest.raises(ValueError, match="does not cover|is not"):  # the map must fit the problem
        block_tiles.checked_gluon_layout((small, 128, 128), q, k, "backward")
    fits = torch.ones(1, 1, 2, 2, dtype=torch.bool)
    assert block_tiles.checked_gluon_layout((fits, 128, 128), q, k, "backward")[0] is fits


def _brute_force_tiles(block_map, bq, bk, seq_q, seq_k, bm, bn, band):
    """Per (row tile, key tile): whether some element in range is visible (layout and band)."""
    vis = expand_block_map(block_map, bq, bk, 0, seq_q, 0, seq_k) & band.visible(seq_q, seq_k)
    tiles = torch.zeros((*block_map.shape[:2], _cdiv(seq_q, bm), _cdiv(seq_k, bn)), dtype=torch.bool)
    for tm in range(tiles.shape[2]):
        for tn in range(tiles.shape[3]):
            tiles[..., tm, tn] = vis[..., tm * bm:(tm + 1) * bm, tn * bn:(tn + 1) * bn].flatten(-2).any(-1)
    return tiles


@pytest.mark.parametrize("seq_q, seq_k, block, tiles, is_causal, window", [
    (640, 640, (128, 128), (128, 128), False, None),
    (600, 700, (256, 128), (128, 64), True, None),   # ragged, causal, key tiles inside blocks
    (520, 900, (128, 256), (128, 128), False, (300, 40)),
    (300, 457, (128, 256), (64, 128), False, None),   # the backward's 64-row tiles
])
def test_gluon_tile_lists_list_exactly_the_visible_tiles(seq_q, seq_k, block, tiles, is_causal, window):
    nq, nk = _cdiv(seq_q, block[0]), _cdiv(seq_k, block[1])
    block_map = _random_map((2, 3, nq, nk), 0.5, seed=seq_q + seq_k, empty_rows=(1,))
    band = resolve_band(is_causal, 0, window, seq_q, seq_k)
    expected = _brute_force_tiles(block_map, *block, seq_q, seq_k, *tiles, band)
    for columns in (False, True):
        lists = block_tiles.gluon_tile_lists(block_map, *block, seq_q, seq_k, band.lower, band.upper, *tiles,
                                             columns=columns)
        want = expected.transpose(-2, -1) if columns else expected
        table = lists.lists
        assert table.dtype == torch.int32 and table.is_contiguous() and lists.row == want.shape[-1] + 1
        assert (lists.stride_b, lists.stride_h) == (table.stride(0), table.stride(1))
        counts = table[..., 0]
        assert torch.equal(counts, want.sum(-1, dtype=torch.int32))
        for index in torch.cartesian_prod(*(torch.arange(n) for n in want.shape[:3])).tolist():
            listed = table[(*index, slice(1, 1 + int(counts[tuple(index)])))]
            assert listed.tolist() == torch.nonzero(want[tuple(index)]).flatten().tolist()  # ascending


def test_broadcast_layouts_list_with_zero_strides():
    """The op hands the launchers broadcast dims at size 1 (``block_sparse.resolve_block_mask``): every
    batch element and head then reads the same lists."""
    lists = block_tiles.gluon_tile_lists(_random_map((1, 1, 4, 4), 0.5, seed=3), 128, 128, 512, 512, None, None,
                                         128, 128)
    assert lists.lists.shape[:2] == (1, 1) and (lists.stride_b, lists.stride_h) == (0, 0)
    per_head = block_tiles.gluon_tile_lists(_random_map((1, 3, 4, 4), 0.5, seed=3), 128, 128, 512, 512, None, None,
                                            128, 128)
    assert (per_head.stride_b, per_head.stride_h) == (0, 4 * 5)


# ------------------------------------------------------------------------------------------
# The kernels (sm_90 GPU)
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int = 2
    heads_q: int = 4
    heads_kv: int = 4
    seq_q: int = 640
    seq_k: int = 640
    block: tuple = (128, 128)
    density: float = 0.5
    map_batch: Optional[int] = None  # None: one map per batch element; 1: broadcast
    map_heads: Optional[int] = None
    empty_rows: tuple = ()
    is_causal: bool = False
    window: Optional[tuple] = None
    key_mask: bool = False


CASES = {
    "random_50_empty_row": Case(empty_rows=(2,)),
    "random_90_gqa_broadcast": Case(heads_q=8, heads_kv=2, seq_q=1024, seq_k=1024, density=0.1, map_batch=1,
                                    map_heads=1),
    "gqa_per_head_causal": Case(batch=1, heads_q=4, heads_kv=2, seq_q=768, seq_k=768, density=0.4, is_causal=True),
    "ragged_l_ne_s_wide_blocks": Case(batch=1, heads_q=2, heads_kv=1, seq_q=300, seq_k=457, block=(128, 256),
                                      density=0.6),
    "key_mask": Case(seq_q=512, seq_k=512, key_mask=True),
    "window": Case(batch=1, seq_q=1024, seq_k=1024, density=0.7, window=(300, 0)),
    "empty_row_causal": Case(empty_rows=(1,), is_causal=True),
}


def _inputs(case: Case, dtype, head_dim, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, device="cuda", dtype=dtype, generator=gen)
    q = randn(case.batch, case.heads_q, case.seq_q, head_dim)
    k = randn(case.batch, case.heads_kv, case.seq_k, head_dim)
    v = randn(case.batch, case.heads_kv, case.seq_k, head_dim)
    dout = randn(case.batch, case.heads_q, case.seq_q, head_dim)
    shape = (case.map_batch or case.batch, case.map_heads or case.heads_q, _cdiv(case.seq_q, case.block[0]),
             _cdiv(case.seq_k, case.block[1]))
    block_map = _random_map(shape, case.density, seed + 7, case.empty_rows).cuda()
    key_mask = None
    if case.key_mask:
        key_mask = torch.rand(case.batch, 1, 1, case.seq_k, device="cuda", generator=gen) < 0.8
    return q, k, v, dout, block_map, key_mask


def _element_mask(case: Case, block_map, key_mask):
    """The dense (B, Hq, L, S) bool mask the layout, the band and the key mask amount to."""
    full = (case.batch, case.heads_q, case.seq_q, case.seq_k)
    mask = expand_block_map(block_map, *case.block, 0, case.seq_q, 0, case.seq_k).expand(full)
    mask = mask & resolve_band(case.is_causal, 0, case.window, case.seq_q, case.seq_k).visible(
        case.seq_q, case.seq_k, device="cuda")
    if key_mask is not None:
        mask = mask & key_mask
    return mask.contiguous()


def _spy_on_gluon(monkeypatch):
    """Record, per Hopper launcher call, whether it got the layout."""
    from flash_inductor.launch import hopper, hopper_bwd

    calls = []
    for module, name in ((hopper, "hopper_attention_forward"), (hopper_bwd, "hopper_attention_backward")):
        real = getattr(module, name)

        def spied(*args, _real=real, _name=name, **kwargs):
            calls.append((_name, kwargs["visibility"].block_map is not None))
            return _real(*args, **kwargs)
        monkeypatch.setattr(module, name, spied)
    return calls


@needs_hopper
@pytest.mark.parametrize("schedule", ["stable", "fast"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", [pytest.param(c, id=n) for n, c in CASES.items()])
def test_gluon_block_sparse_against_fp64(case, dtype, head_dim, schedule, monkeypatch):
    from flash_inductor.launch import hopper

    calls = _spy_on_gluon(monkeypatch)
    q, k, v, dout, block_map, key_mask = _inputs(case, dtype, head_dim)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flash_attention(*leaves, key_mask, is_causal=case.is_causal, enable_gqa=case.heads_q != case.heads_kv,
                          schedule=schedule, window=case.window, block_mask=BlockSparseLayout(block_map, case.block))
    out.backward(dout)
    assert calls == [("hopper_attention_forward", True), ("hopper_attention_backward", True)], calls

    scale = head_dim**-0.5
    dense = _element_mask(case, block_map, key_mask)
    ref = ref_forward_backward(q, k, v, dense, scale=scale, grad_out=dout)
    base = sdpa_baseline(q, k, v, dense, scale=scale, grad_out=dout)
    ours = dict(out=out, dq=leaves[0].grad, dk=leaves[1].grad, dv=leaves[2].grad)
    for name, value in ours.items():
        assert_close_to_ref(name, value, ref[name], base[name], terms=ref["terms"].get(name))
    visibility = Visibility(is_causal=case.is_causal, window=case.window, block_map=block_map, block_q=case.block[0],
                            block_k=case.block[1])
    _, lse = hopper.hopper_attention_forward(q, k, v, scale=scale, visibility=visibility, attn_mask=key_mask)
    assert_close_to_ref("lse", lse, ref["lse"], lse_baseline(q, k, dense, scale=scale))
    # Rows with no visible key: out 0, LSE -inf, dq 0; keys no query of their group sees: dk = dv = 0.
    dead = assert_dead_rows_exact(q, k, dense, None, out, lse, ours["dq"], ours["dk"], ours["dv"])
    if case.empty_rows:
        assert dead > 0
