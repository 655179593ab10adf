"""Block-sparse attention: the layout type, FlexAttention BlockMask inputs, the kernels' tile lists,
the reference path and the kernels, against the float64 reference.

The truth for a layout is dense attention under its element mask (``layout & attn_mask``), so every
numerical check is the project's tolerance rule against that mask's fp64 attention, with SDPA
under the same mask as the same-dtype baseline. Kernel tests use layout blocks that straddle the
kernels' tiles (24 x 40 blocks over 16 x 16 interpreter tiles, 16-row blocks under 32-row tiles)
as well as blocks that nest, random layouts at 50 % and 90 % sparsity, rows whose blocks are all
skipped, broadcast layouts, GQA, dropout, causal masking and L != S.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import pytest
import torch

import flash_inductor
from flash_inductor import BlockSparseLayout, flash_attention, launch
from flash_inductor.block_sparse import expand_block_map, resolve_block_mask
from flash_inductor.launch import Visibility, block_tiles
from flash_inductor.tuning.kernel_config import AttentionConfigs, KernelConfig
from helpers import (
    DEVICE,
    ON_CUDA,
    assert_close_to_ref,
    assert_dead_rows_exact,
    dropout_keep,
    launch_visibility,
    lse_baseline,
    make_mask,
    make_qkv,
    randn,
    ref_forward_backward,
    sdpa_baseline,
    spy_on_launches,
)

flex = pytest.importorskip("torch.nn.attention.flex_attention")


def _cdiv(a, b):
    return -(-a // b)


def random_block_map(batch, heads, seq_q, seq_k, block, density, seed=0, empty_rows=()):
    """A random (batch, heads, NQ, NK) bool map with about ``density`` of its blocks computed;
    ``empty_rows`` query blocks skip every key block."""
    g = torch.Generator().manual_seed(seed)
    bq, bk = (block, block) if isinstance(block, int) else block
    shape = (batch, heads, _cdiv(seq_q, bq), _cdiv(seq_k, bk))
    block_map = torch.rand(shape, generator=g) < density
    for row in empty_rows:
        block_map[..., row, :] = False
    return block_map


def element_mask(block_map, block_size, seq_q, seq_k, attn_mask, full_shape):
    """The dense (B, Hq, L, S) element mask a layout and an attn_mask amount to."""
    bq, bk = (block_size, block_size) if isinstance(block_size, int) else block_size
    in_layout = expand_block_map(block_map, bq, bk, 0, seq_q, 0, seq_k).expand(full_shape)
    if attn_mask is None:
        return in_layout.contiguous()
    if attn_mask.dtype == torch.bool:
        return (attn_mask & in_layout).contiguous()
    return attn_mask.masked_fill(~in_layout, float("-inf"))


# ------------------------------------------------------------------------------------------
# The layout type and its validation
# ------------------------------------------------------------------------------------------


def test_layout_normalises_block_size_and_expands_to_the_element_mask():
    block_map = torch.tensor([[True, False], [True, True]])
    layout = BlockSparseLayout(block_map, 2)
    assert layout.block_size == (2, 2) and layout.block_q == 2 and layout.block_k == 2
    dense = layout.to_dense(4, 3)  # ragged last key block (one key)
    expected = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 1], [1, 1, 1]], dtype=torch.bool)
    assert torch.equal(dense, expected)
    assert layout.density() == 0.75
    wide = BlockSparseLayout(block_map, (1, 3))
    assert torch.equal(wide.to_dense(2, 5), block_map.repeat_interleave(3, dim=1)[:, :5])


@pytest.mark.parametrize("bad, error, words", [
    (dict(block_map=[[True]]), TypeError, "bool torch.Tensor"),
    (dict(block_map=torch.ones(2, 2)), TypeError, "block_map != 0"),
    (dict(block_map=torch.ones(3, dtype=torch.bool)), ValueError, "at least 2 dims"),
    (dict(block_map=torch.ones(2, 2, dtype=torch.bool), block_size=0), ValueError, "positive int"),
    (dict(block_map=torch.ones(2, 2, dtype=torch.bool), block_size=(64, 64, 1)), ValueError, "(block_q, block_k)"),
    (dict(block_map=torch.ones(2, 2, dtype=torch.bool), block_size=True), ValueError, "positive int"),
])
def test_layout_rejects_bad_arguments(bad, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        BlockSparseLayout(**bad)


def test_flash_attention_rejects_layouts_that_do_not_fit_the_problem():
    q, k, v = make_qkv(2, 3, 3, 40, 70, 8, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"needs \(ceil\(L / 16\), ceil\(S / 16\)\) = \(3, 5\)"):
        flash_attention(q, k, v, block_mask=BlockSparseLayout(torch.ones(3, 4, dtype=torch.bool), 16))
    with pytest.raises(ValueError, match="does not broadcast"):
        flash_attention(q, k, v, block_mask=BlockSparseLayout(torch.ones(2, 2, 3, 5, dtype=torch.bool), 16))
    with pytest.raises(TypeError, match="wrap a bool block map as BlockSparseLayout"):
        flash_attention(q, k, v, block_mask=torch.ones(3, 5, dtype=torch.bool))
    if ON_CUDA:
        with pytest.raises(ValueError, match="block map is on cpu"):
            flash_attention(*(t.cuda() for t in (q, k, v)),
                            block_mask=BlockSparseLayout(torch.ones(3, 5, dtype=torch.bool), 16))


def test_resolve_keeps_broadcast_dims_at_size_one():
    q = torch.zeros(2, 3, 40, 8)
    def ones(*shape):
        return torch.ones(shape, dtype=torch.bool)

    # A stride-0 expanded map is one layout for every batch element / head as much as a size-1 dim.
    for block_map, expected in [(ones(3, 5), (1, 1)), (ones(2, 1, 3, 5), (2, 1)), (ones(3, 3, 5), (1, 3)),
                                (ones(2, 3, 3, 5), (2, 3)), (ones(3, 5).expand(2, 3, 3, 5), (1, 1))]:
        resolved = resolve_block_mask(BlockSparseLayout(block_map, 16), False, q, (2,), 3, 40, 70)
        assert tuple(resolved.block_map.shape) == (*expected, 3, 5)
        assert (resolved.block_q, resolved.block_k) == (16, 16)
    # 3-D inputs (N, L, E): the map's leading dim is the batch, and a head dim of 1 is added.
    resolved = resolve_block_mask(BlockSparseLayout(torch.ones(2, 3, 5, dtype=torch.bool), 16), False,
                                  torch.zeros(2, 40, 8), (2,), 1, 40, 70)
    assert tuple(resolved.block_map.shape) == (2, 1, 3, 5)


def test_the_op_rejects_a_block_map_it_cannot_index():
    q, k, v = make_qkv(1, 2, 2, 40, 70, 8, 8, torch.float32, "cpu")
    args = (q, k, v, None, None, 0.0, False, 0, 0.35, "stable")
    with pytest.raises(ValueError, match="4-D bool block map"):
        torch.ops.flash_inductor.attention_forward(*args, -1, -1, torch.ones(3, 5, dtype=torch.bool), 16, 16)
    with pytest.raises(ValueError, match="must be positive"):
        torch.ops.flash_inductor.attention_forward(*args, -1, -1, torch.ones(1, 1, 3, 5, dtype=torch.bool), 0, 16)


# ------------------------------------------------------------------------------------------
# FlexAttention BlockMask inputs
# ------------------------------------------------------------------------------------------


def _checkerboard(block):
    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx // block + kv_idx // block) % 2 == 0
    return mask_mod


def _causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def test_block_mask_of_whole_blocks_needs_no_element_mask():
    """A mask_mod that is constant on every block yields only full and empty blocks: accepted as
    it is, and equal to the dense mask."""
    seq_q, seq_k = 64, 96
    block_mask = flex.create_block_mask(_checkerboard(32), None, None, seq_q, seq_k, device="cpu", BLOCK_SIZE=32,
                                        _compile=False)
    q, k, v = make_qkv(1, 2, 2, seq_q, seq_k, 8, 8, torch.float64, "cpu", seed=1)
    ours = flash_attention(q, k, v, block_mask=block_mask)
    dense = flex.create_mask(_checkerboard(32), None, None, seq_q, seq_k, device="cpu")
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    torch.testing.assert_close(ours, expected)


def test_block_mask_with_partial_blocks_needs_attn_mask():
    seq_q, seq_k = 80, 80
    block_mask = flex.create_block_mask(_causal, None, None, seq_q, seq_k, device="cpu", BLOCK_SIZE=32, _compile=False)
    q, k, v = make_qkv(1, 2, 2, seq_q, seq_k, 8, 8, torch.float64, "cpu", seed=2)
    with pytest.raises(ValueError, match=r"partial block.*mask_mod \(_causal\).*as attn_mask"):
        flash_attention(q, k, v, block_mask=block_mask)
    dense = flex.create_mask(_causal, None, None, seq_q, seq_k, device="cpu")
    ours = flash_attention(q, k, v, dense, block_mask=block_mask)
    expected = flex.flex_attention(q, k, v, block_mask=block_mask)
    torch.testing.assert_close(ours, expected)
    # The layout skips the blocks above the diagonal.
    layout = BlockSparseLayout.from_block_mask(block_mask, has_element_mask=True)
    assert torch.equal(layout.block_map[0, 0], torch.ones(3, 3, dtype=torch.bool).tril())


def test_block_mask_with_noop_mask_mod_and_partial_blocks():
    """BlockMask.from_kv_blocks without a mask_mod (noop_mask): its partial blocks are whole blocks."""
    kv_num_blocks = torch.tensor([[[1, 2, 0]]], dtype=torch.int32)
    kv_indices = torch.tensor([[[[2, 0, 0], [0, 1, 0], [0, 0, 0]]]], dtype=torch.int32)
    block_mask = flex.BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, BLOCK_SIZE=16, seq_lengths=(40, 48))
    layout = BlockSparseLayout.from_block_mask(block_mask)
    assert torch.equal(layout.block_map[0, 0], torch.tensor([[0, 0, 1], [1, 1, 0], [0, 0, 0]], dtype=torch.bool))
    q, k, v = make_qkv(1, 1, 1, 40, 48, 8, 8, torch.float64, "cpu", seed=3)
    out = flash_attention(q, k, v, block_mask=block_mask)
    assert (out[..., 32:, :] == 0).all()  # query block 2 computes nothing
    torch.testing.assert_close(out, flash_attention(q, k, v, block_mask=layout))


def test_block_mask_for_other_lengths_is_refused():
    block_mask = flex.create_block_mask(_causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=32, _compile=False)
    q, k, v = make_qkv(1, 1, 1, 40, 64, 8, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"create_block_mask\(..., Q_LEN=40, KV_LEN=64\)"):
        flash_attention(q, k, v, torch.ones(40, 64, dtype=torch.bool), block_mask=block_mask)


# ------------------------------------------------------------------------------------------
# Tile classes and lists
# ------------------------------------------------------------------------------------------


def _brute_force_classes(block_map, bq, bk, seq_q, seq_k, bm, bn, upper):
    """Per tile: whether any in-range element is visible and whether all are (and the tile whole)."""
    vis = expand_block_map(block_map, bq, bk, 0, seq_q, 0, seq_k)
    if upper is not None:
        i = torch.arange(seq_q)[:, None]
        j = torch.arange(seq_k)[None, :]
        vis = vis & (j <= i + upper)
    tiles_m, tiles_n = _cdiv(seq_q, bm), _cdiv(seq_k, bn)
    any_vis = torch.zeros((*block_map.shape[:2], tiles_m, tiles_n), dtype=torch.bool)
    all_vis = torch.zeros_like(any_vis)
    for tm in range(tiles_m):
        for tn in range(tiles_n):
            tile = vis[..., tm * bm:(tm + 1) * bm, tn * bn:(tn + 1) * bn]
            any_vis[..., tm, tn] = tile.flatten(-2).any(-1)
            all_vis[..., tm, tn] = tile.flatten(-2).all(-1) & ((tn + 1) * bn <= seq_k)
    return any_vis, all_vis


@pytest.mark.parametrize("bq, bk, bm, bn", [(16, 16, 16, 16), (32, 64, 16, 32), (16, 16, 32, 64), (24, 40, 16, 16),
                                            (128, 128, 64, 32), (20, 12, 32, 16)])
@pytest.mark.parametrize("upper", [None, 0, 13, -9])
def test_tile_classes_match_the_elements_they_cover(bq, bk, bm, bn, upper):
    seq_q, seq_k = 70, 90
    block_map = random_block_map(2, 1, seq_q, seq_k, (bq, bk), 0.5, seed=bq + bn)
    classes = block_tiles.tile_classes(block_map, bq, bk, seq_q, seq_k, bm, bn, band_upper=upper)
    any_vis, all_vis = _brute_force_classes(block_map, bq, bk, seq_q, seq_k, bm, bn, upper)
    assert classes.shape == any_vis.shape and classes.dtype == torch.int8
    # SKIP only where nothing is visible; FULL only where everything is (and the tile is whole).
    assert not (any_vis & (classes == block_tiles.SKIP)).any()
    assert not ((classes == block_tiles.FULL) & ~all_vis).any()
    if upper is None:
        # Without a band the layout test is exact (rows past L play no part in it).
        assert torch.equal(classes == block_tiles.SKIP, ~any_vis)
        assert torch.equal(classes == block_tiles.FULL, all_vis)
    nested = not block_tiles.needs_element_check(bq, bk, seq_q, seq_k, bm, bn)
    if nested and upper is None:
        # Tiles inside one layout block: PARTIAL only for the ragged last key tile.
        partial = classes == block_tiles.PARTIAL
        assert not partial[..., :-1].any() or seq_k % bn != 0


def test_needs_element_check():
    assert not block_tiles.needs_element_check(128, 128, 4096, 4096, 64, 128)
    assert block_tiles.needs_element_check(128, 128, 4096, 4096, 64, 256)
    assert block_tiles.needs_element_check(64, 128, 4096, 4096, 128, 64)
    assert not block_tiles.needs_element_check(4096, 128, 100, 4096, 128, 64)  # one block spans L


def test_tile_lists_hold_each_class_in_ascending_order():
    classes = torch.tensor([[[[2, 0, 1, 2], [0, 0, 0, 0], [1, 1, 2, 0]]]], dtype=torch.int8)
    rows = block_tiles.row_tile_lists(classes)  # FULL first
    assert rows.counts.tolist() == [[[[2, 1], [0, 0], [1, 2]]]]
    assert rows.order[0, 0, 0, :3].tolist() == [0, 3, 2]
    assert rows.order[0, 0, 2, :3].tolist() == [2, 0, 1]
    cols = block_tiles.column_tile_lists(classes)  # PARTIAL first
    assert cols.counts.tolist() == [[[[1, 1], [0, 1], [1, 1], [1, 0]]]]
    assert cols.order[0, 0, 0, :2].tolist() == [2, 0]
    assert cols.order[0, 0, 2, :2].tolist() == [0, 2]
    assert rows.order.dtype == torch.int32 and rows.counts.dtype == torch.int32
    assert rows.order.is_contiguous() and rows.counts.is_contiguous()


# ------------------------------------------------------------------------------------------
# Numerics: the reference path (public function on CPU) and the kernels (launchers)
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int = 1
    heads_q: int = 2
    heads_kv: int = 2
    seq_q: int = 45
    seq_k: int = 61
    head_dim: int = 16
    block: tuple = (24, 40)
    density: float = 0.5
    map_heads: Optional[int] = None  # None: one map per head; 1: broadcast
    map_batch: Optional[int] = None
    empty_rows: tuple = ()
    mask: str = "none"
    causal_offset: Optional[int] = None
    dropout_p: float = 0.0
    mask_grad: bool = False
    configs: Optional[tuple] = None  # (fwd, dkdv, dq) (block_m, block_n) to force


CASES = {
    "straddling_50": Case(),
    "straddling_90": Case(density=0.1, seq_q=70, seq_k=90, block=(16, 16)),
    "nested_50": Case(block=(32, 16)),
    "tiles_over_blocks": Case(block=(16, 16), configs=((32, 16), (16, 32), (32, 16))),
    "odd_blocks_wide_tiles": Case(block=(20, 12), configs=((32, 32), (32, 32), (32, 32))),
    "empty_rows": Case(empty_rows=(0,), block=(16, 24)),
    "broadcast_layout_gqa": Case(heads_q=4, heads_kv=2, map_heads=1, map_batch=1, batch=2),
    "gqa_per_head_layout": Case(heads_q=4, heads_kv=2, block=(16, 16), density=0.3),
    "l_greater_than_s": Case(seq_q=70, seq_k=33, block=(16, 16)),
    "bool_mask": Case(mask="bool"),
    "float_mask_grad": Case(mask="float", mask_grad=True, block=(16, 16)),
    "causal": Case(causal_offset=0, seq_q=61, seq_k=61, block=(16, 16), density=0.7),
    "causal_bottom_right": Case(causal_offset=61 - 45, block=(16, 24)),
    "dropout": Case(dropout_p=0.2, block=(16, 16)),
}


def _inputs(case: Case, dtype, device, seed=0):
    q, k, v = make_qkv(case.batch, case.heads_q, case.heads_kv, case.seq_q, case.seq_k, case.head_dim, case.head_dim,
                       dtype, device, seed=seed)
    block_map = random_block_map(case.map_batch or case.batch, case.map_heads or case.heads_q, case.seq_q, case.seq_k,
                                 case.block, case.density, seed=seed + 7, empty_rows=case.empty_rows).to(device)
    mask = make_mask(case.mask, case.batch, case.heads_q, case.seq_q, case.seq_k, dtype, device, seed=seed + 1)
    full = (case.batch, case.heads_q, case.seq_q, case.seq_k)
    dense = element_mask(block_map, case.block, case.seq_q, case.seq_k, mask, full)
    dout = randn((case.batch, case.heads_q, case.seq_q, case.head_dim), dtype, device, seed + 2)
    keep = rng_seed = None
    if case.dropout_p > 0:
        seed_value = 2**40 + 99 + seed
        rng_seed = torch.tensor([seed_value], dtype=torch.int64, device=device)
        keep = dropout_keep(seed_value, *full, case.dropout_p, device)
    return q, k, v, block_map, mask, dense, dout, keep, rng_seed


def _check(case, ours, q, k, v, dense, dout, keep, scale):
    kwargs = dict(causal_offset=case.causal_offset, scale=scale, dropout_mask=keep, dropout_p=case.dropout_p,
                  grad_out=dout, mask_grad=case.mask_grad)
    ref = ref_forward_backward(q, k, v, dense, **kwargs)
    base = sdpa_baseline(q, k, v, dense, **kwargs)
    names = ["out", "dq", "dk", "dv"] + (["dmask"] if case.mask_grad else [])
    for name in names:
        assert_close_to_ref(name, ours[name], ref[name], base[name], terms=ref["terms"].get(name))
    lse_base = lse_baseline(q, k, dense, causal_offset=case.causal_offset, scale=scale)
    assert_close_to_ref("lse", ours["lse"], ref["lse"], lse_base)
    dead = assert_dead_rows_exact(q, k, dense, case.causal_offset, ours["out"], ours["lse"], ours["dq"], ours["dk"],
                                  ours["dv"], ours.get("dmask"))
    if case.empty_rows:
        assert dead > 0


def _configs(case: Case):
    if case.configs is None:
        return None
    return AttentionConfigs(*(KernelConfig(m, n, 1 if not ON_CUDA else 4, 1) for m, n in case.configs))


@pytest.mark.launches_kernels
@pytest.mark.parametrize("case", [pytest.param(c, id=n) for n, c in CASES.items()])
def test_kernels_against_fp64(case, kernel_dtype, device):
    q, k, v, block_map, mask, dense, dout, keep, rng_seed = _inputs(case, kernel_dtype, device)
    if mask is not None and mask.is_floating_point() and case.mask_grad:
        mask = mask.clone()
    scale = case.head_dim**-0.5
    common = (rng_seed, case.dropout_p, scale, "stable")
    layout = dict(visibility=launch_visibility(case.causal_offset, block_map=block_map, block_q=case.block[0],
                                               block_k=case.block[1]))
    configs = _configs(case)
    out, lse = launch.attention_forward(q, k, v, mask, *common, configs=configs, **layout)
    dq, dk, dv, dmask = launch.attention_backward(dout, q, k, v, mask, out, lse, None, *common, case.mask_grad,
                                                  configs=configs, **layout)
    ours = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)
    if case.mask_grad:
        ours["dmask"] = dmask
    _check(case, ours, q, k, v, dense, dout, keep, scale)


@pytest.mark.parametrize("case", [pytest.param(CASES[n], id=n) for n in
                                  ("straddling_90", "empty_rows", "broadcast_layout_gqa", "float_mask_grad", "causal",
                                   "dropout", "l_greater_than_s")])
def test_public_function_against_fp64(case, device):
    """The public function, gradients through autograd: on CPU the reference path, on a GPU the
    kernels through the eager fast path."""
    q, k, v, block_map, mask, dense, dout, keep, rng_seed = _inputs(case, torch.float32, device)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    mask_leaf = mask.clone().requires_grad_() if case.mask_grad else mask
    torch.manual_seed(5)
    assert case.causal_offset in (None, 0)  # is_causal's offset
    out = flash_attention(*leaves, mask_leaf, dropout_p=case.dropout_p, is_causal=case.causal_offset == 0,
                          enable_gqa=case.heads_q != case.heads_kv, block_mask=BlockSparseLayout(block_map, case.block))
    if case.dropout_p > 0:
        # Read the seed the call drew back from the generator, then rebuild its keep mask.
        torch.manual_seed(5)
        seed_value = int(torch.randint(0, 2**62, (1,), dtype=torch.int64, device=device))
        keep = dropout_keep(seed_value, case.batch, case.heads_q, case.seq_q, case.seq_k, case.dropout_p, device)
    out.backward(dout)
    _, lse = torch.ops.flash_inductor.attention_forward(  # the LSE does not depend on dropout
        q, k, v, mask, None, 0.0, case.causal_offset is not None, case.causal_offset or 0,
        case.head_dim**-0.5, "stable", -1, -1, block_map, *case.block)
    ours = dict(out=out, lse=lse, dq=leaves[0].grad, dk=leaves[1].grad, dv=leaves[2].grad)
    if case.mask_grad:
        ours["dmask"] = mask_leaf.grad
    _check(case, ours, q, k, v, dense, dout, keep, case.head_dim**-0.5)


def test_a_layout_of_ones_is_dense_attention_and_of_zeros_is_empty():
    q, k, v = make_qkv(2, 2, 2, 33, 50, 8, 8, torch.float64, "cpu", seed=4)
    ones = BlockSparseLayout(torch.ones(3, 4, dtype=torch.bool), 16)
    torch.testing.assert_close(flash_attention(q, k, v, block_mask=ones), flash_attention(q, k, v))
    zeros = BlockSparseLayout(torch.zeros(3, 4, dtype=torch.bool), 16)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flash_attention(*leaves, block_mask=zeros)
    out.sum().backward()
    assert (out == 0).all() and all((t.grad == 0).all() for t in leaves)


# ------------------------------------------------------------------------------------------
# The op: opcheck, fake kernel, compile
# ------------------------------------------------------------------------------------------


def _op_args(device, dtype, requires_grad=False):
    q, k, v = make_qkv(1, 2, 2, 37, 45, 16, 16, dtype, device, seed=11)
    if requires_grad:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    block_map = random_block_map(1, 1, 37, 45, 16, 0.5, seed=3, empty_rows=(1,)).to(device)
    return (q, k, v, None, None, 0.0, False, 0, 0.25, "stable", -1, -1, block_map, 16, 16)


@pytest.mark.parametrize("device", list(dict.fromkeys([DEVICE, "cpu"])))
def test_opcheck(device):
    dtype = torch.float16 if device == "cuda" else torch.float32
    args = _op_args(device, dtype, requires_grad=True)
    torch.library.opcheck(torch.ops.flash_inductor.attention_forward.default, args)
    if device == "cpu":
        ref_args = tuple(t.detach() for t in args[:3]) + args[3:9] + args[10:]  # no autograd formula of its own
        torch.library.opcheck(torch.ops.flash_inductor.attention_forward_reference.default, ref_args)
    q, k, v = (t.detach() for t in args[:3])
    out, lse = torch.ops.flash_inductor.attention_forward(q, k, v, *args[3:])
    dout = torch.randn_like(out)
    bwd = (dout, q, k, v, None, out, lse, None, None, 0.0, False, 0, 0.25, "stable", False, *args[10:])
    torch.library.opcheck(torch.ops.flash_inductor.attention_backward.default, bwd)


def test_fake_kernel_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 4, 37, 16)
        k = v = torch.empty(2, 2, 45, 16)
        block_map = torch.empty(1, 4, 3, 3, dtype=torch.bool)
        out, lse = torch.ops.flash_inductor.attention_forward(q, k, v, None, None, 0.0, False, 0, 0.25, "stable",
                                                              -1, -1, block_map, 16, 16)
        assert out.shape == (2, 4, 37, 16) and lse.shape == (2, 4, 37)
        dq, dk, dv, dmask = torch.ops.flash_inductor.attention_backward(
            out, q, k, v, None, out, lse, None, None, 0.0, False, 0, 0.25, "stable", False, -1, -1, block_map, 16, 16)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape and dmask.numel() == 0


def test_compiles_with_a_layout():
    q, k, v = make_qkv(1, 2, 2, 37, 45, 16, 16, torch.float32, "cpu", seed=12)
    layout = BlockSparseLayout(random_block_map(1, 1, 37, 45, 16, 0.5, seed=5), 16)
    compiled = torch.compile(lambda q, k, v: flash_attention(q, k, v, block_mask=layout), backend="aot_eager",
                             fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), flash_attention(q, k, v, block_mask=layout))


# ------------------------------------------------------------------------------------------
# The kernels skip the work: launches, and keys they never read
# ------------------------------------------------------------------------------------------


@pytest.mark.launches_kernels
@pytest.mark.parametrize("block, straddles", [((16, 16), False), ((24, 40), True)])
def test_kernels_take_the_block_sparse_path(monkeypatch, device, block, straddles):
    seen = {}
    spy_on_launches(monkeypatch, lambda name, kwargs: seen.setdefault(name, kwargs))
    q, k, v = make_qkv(1, 2, 2, 45, 61, 16, 16, torch.float32, device, seed=8)
    block_map = random_block_map(1, 2, 45, 61, block, 0.5, seed=9).to(device)
    layout = dict(visibility=Visibility(block_map=block_map, block_q=block[0], block_k=block[1]))
    common = (None, 0.0, 0.25, "stable")
    out, lse = launch.attention_forward(q, k, v, None, *common, **layout)
    launch.attention_backward(torch.ones_like(out), q, k, v, None, out, lse, None, *common, False, **layout)
    for name in ("_attn_fwd", "_attn_bwd_dq", "_attn_bwd_dkdv"):
        assert seen[name]["HAS_BLOCK_SPARSITY"] is True, name
        # The per-element test is on exactly where the launched tiles straddle layout blocks:
        # (24, 40) blocks straddle every power-of-two tile; (16, 16) nest the interpreter's 16-wide
        # tiles, and a GPU's wider fp32 tiles straddle them.
        tiles_straddle = block[0] % seen[name]["BLOCK_M"] != 0 or block[1] % seen[name]["BLOCK_N"] != 0
        assert seen[name]["LAYOUT_CHECK"] is tiles_straddle, name
        if straddles:
            assert tiles_straddle, name
    # The layout is all the mask there is: no dense element mask reaches the kernels.
    assert seen["_attn_fwd"]["HAS_MASK"] is False and seen["_attn_bwd_dq"]["HAS_MASK"] is False


@pytest.mark.launches_kernels
@pytest.mark.parametrize("block", [(16, 16), (24, 40)])
def test_skipped_blocks_are_never_read(kernel_dtype, device, block):
    """NaN keys and values in the key tiles that lie in a key block no query block computes: a
    kernel that read them (even to multiply by a zero probability) would return NaN. Forward, dQ
    and dK/dV alike, at 16 x 16 tiles (a tile that straddles a computed block is read, and its
    keys outside the layout are selected out, as a mask's are)."""
    seq_q, seq_k = 45, 120
    q, k, v = make_qkv(1, 2, 2, seq_q, seq_k, 16, 16, kernel_dtype, device, seed=10)
    block_map = random_block_map(1, 1, seq_q, seq_k, block, 0.6, seed=11)
    dead_cols = [1]  # key block 1 is skipped by every query block
    block_map[..., dead_cols] = False
    block_map[..., 0] = True  # every row sees something
    tile = 16
    start = _cdiv(block[1] * dead_cols[0], tile) * tile  # the tiles wholly inside the dead block
    stop = min(block[1] * (dead_cols[0] + 1), seq_k) // tile * tile
    assert stop > start
    k[..., start:stop, :] = float("nan")
    v[..., start:stop, :] = float("nan")
    layout = dict(visibility=Visibility(block_map=block_map.to(device), block_q=block[0], block_k=block[1]),
                  configs=AttentionConfigs(*(KernelConfig(tile, tile, 4 if ON_CUDA else 1, 1),) * 3))
    common = (None, 0.0, 0.25, "stable")
    out, lse = launch.attention_forward(q, k, v, None, *common, **layout)
    dout = randn(out.shape, kernel_dtype, device, 12)
    dq, dk, dv, _ = launch.attention_backward(dout, q, k, v, None, out, lse, None, *common, False, **layout)
    assert out.isfinite().all() and lse.isfinite().all() and dq.isfinite().all()
    keep = torch.ones(seq_k, dtype=torch.bool)
    keep[start:stop] = False
    assert dk[..., keep, :].isfinite().all() and dv[..., keep, :].isfinite().all()
    assert (dk[..., ~keep, :] == 0).all() and (dv[..., ~keep, :] == 0).all()  # no query reaches them
    # The same inputs through the dense kernels with the layout as a mask: NaN, since they read it all.
    dense_out, _ = launch.attention_forward(q, k, v, element_mask(block_map.to(device), block, seq_q, seq_k, None,
                                                                  (1, 2, seq_q, seq_k)), *common)
    assert dense_out.isnan().any()


WITH_BAND = {
    "window": (Case(block=(16, 16), seq_q=61, seq_k=61, density=0.7), (20, 3)),
    "window_straddling_causal": (Case(block=(24, 40), causal_offset=0, seq_q=61, seq_k=61, density=0.7), (30, -1)),
}


@pytest.mark.launches_kernels
@pytest.mark.parametrize("case, window", [pytest.param(*v, id=k) for k, v in WITH_BAND.items()])
def test_kernels_with_a_window(case, window, device):
    """The band (causal and window) folds into the tile classes: tiles outside it are skipped,
    tiles its edges cross are checked."""
    q, k, v, block_map, mask, dense, dout, keep, rng_seed = _inputs(case, torch.float32, device)
    from flash_inductor.launch.band import resolve_band

    band = resolve_band(case.causal_offset is not None, case.causal_offset or 0, window, case.seq_q, case.seq_k)
    dense = dense & band.visible(case.seq_q, case.seq_k, device)
    scale = case.head_dim**-0.5
    common = (None, 0.0, scale, "stable")
    layout = dict(visibility=launch_visibility(case.causal_offset, window=window, block_map=block_map,
                                               block_q=case.block[0], block_k=case.block[1]))
    out, lse = launch.attention_forward(q, k, v, None, *common, **layout)
    dq, dk, dv, _ = launch.attention_backward(dout, q, k, v, None, out, lse, None, *common, False, **layout)
    _check(dataclasses.replace(case, causal_offset=None), dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv), q, k, v, dense,
           dout, keep, scale)


@pytest.mark.launches_kernels
def test_float_mask_at_the_clamp_with_a_layout(device):
    """Rows whose every visible key sits at finfo.min take the row reference's extra pass, which
    must not see keys outside the layout."""
    case = Case(block=(16, 24), mask="finfo_min", mask_grad=True)
    q, k, v, block_map, mask, dense, dout, keep, rng_seed = _inputs(case, torch.float32, device)
    scale = case.head_dim**-0.5
    common = (None, 0.0, scale, "stable")
    layout = dict(visibility=Visibility(block_map=block_map, block_q=case.block[0], block_k=case.block[1]))
    out, lse = launch.attention_forward(q, k, v, mask, *common, **layout)
    dq, dk, dv, dmask = launch.attention_backward(dout, q, k, v, mask, out, lse, None, *common, True, **layout)
    _check(case, dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv, dmask=dmask), q, k, v, dense, dout, keep, scale)


@pytest.mark.skipif(not ON_CUDA, reason="the Gluon Hopper forward's choice reads the device")
def test_hopper_forward_declines_a_layout_of_small_blocks():
    from flash_inductor.launch import hopper

    q, k, v = make_qkv(1, 2, 2, 256, 256, 64, 64, torch.bfloat16, "cuda", seed=13)
    reason = hopper.hopper_forward_unsupported_reason(q, k, v, block_sizes=(64, 64))
    dense_reason = hopper.hopper_forward_unsupported_reason(q, k, v)
    # On an sm_90 GPU with Gluon the layout's blocks are the reason; elsewhere the machine is. The
    # kernels take blocks of 128 x 128 (tests/unit/test_hopper_block_sparse.py).
    assert reason == (hopper.BLOCK_SPARSE if dense_reason is None else dense_reason)
    assert hopper.hopper_forward_unsupported_reason(q, k, v, block_sizes=(128, 128)) == dense_reason


def test_tile_lists_are_computed_once_per_layout_and_tile_shape(monkeypatch):
    calls = []
    real = block_tiles.tile_classes
    monkeypatch.setattr(block_tiles, "tile_classes", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    block_map = random_block_map(1, 1, 64, 64, 16, 0.5, seed=1)
    args = (16, 16, 1, 2, 64, 64, None, None, 16, 16)
    first = block_tiles.kernel_layout(block_map.expand(1, 2, 4, 4), *args[:2], *args[2:])
    again = block_tiles.kernel_layout(block_map.expand(1, 2, 4, 4), *args[:2], *args[2:])  # a new view
    assert len(calls) == 1 and first[0][0].data_ptr() == again[0][0].data_ptr()
    block_tiles.kernel_layout(block_map, 16, 16, 1, 2, 64, 64, None, None, 32, 16)  # another tile shape
    assert len(calls) == 2
    block_map[0, 0, 0, 0] = ~block_map[0, 0, 0, 0]  # in place: the version changes
    changed = block_tiles.kernel_layout(block_map.expand(1, 2, 4, 4), *args[:2], *args[2:])
    assert len(calls) == 3 and not torch.equal(changed[0][0], first[0][0])
