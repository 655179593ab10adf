"""The ``block_sparse`` part of ``benchmarks.sparse_attention``: random block-sparse layouts.

    python -m benchmarks.sparse_attention --part block_sparse                    # L 4k-16k, 50 % and 90 %
    python -m benchmarks.sparse_attention --part block_sparse --seqs 16384 --sparsities 0.9 --modes fwd

Each cell draws one layout of ``--block`` x ``--block`` blocks (128 by default), shared by every
batch element and head, with each block skipped with probability ``sparsity``, except that every
query block keeps its diagonal block, so that no row is empty (SDPA, the check of ours' output,
returns NaN on one). The contenders (``sparse_attention``'s module docstring says how they are
timed):

* ``ours``: ``flash_attention(q, k, v, block_mask=BlockSparseLayout(block_map, block))``;
* ``flex``: compiled FlexAttention with ``BlockMask.from_kv_blocks`` of the same map, every
  computed block a *full* block, so its kernel never runs the mask_mod (its best case); the
  mask_mod states the layout all the same, for Flex's eager path, which ignores the block lists;
* ``sdpa-mask`` / ``ours-mask``: dense SDPA / ours with the layout as an (L, S) bool mask.

Records carry ``style`` = ``bs<percent>`` (the sparsity) for the table and plot.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

PROVIDERS = ("ours", "flex", "sdpa-mask", "ours-mask")
DEFAULT_PROVIDERS = ("ours", "flex", "sdpa-mask")
DEFAULT_SEQS = (4096, 8192, 16384)
DEFAULT_SPARSITIES = (0.5, 0.9)
MIRROR_TILES = (128, 64)


def add_arguments(p) -> None:
    """The part's own flags on ``sparse_attention``'s parser."""
    p.add_argument("--sparsities", type=lambda t: [float(x) for x in t.split(",") if x],
                   default=list(DEFAULT_SPARSITIES), help="block_sparse: fractions of blocks skipped")
    p.add_argument("--block", type=int, default=128, help="block_sparse: the layout's block size")
    p.add_argument("--layout-seed", type=int, default=0, help="block_sparse: seed of the random layouts")


def cells(args, hidden: int):
    seqs = args.seqs if args.seqs_given else DEFAULT_SEQS
    out = []
    for sparsity in args.sparsities:
        for seq in seqs:
            for mode in args.modes:
                out.append(dict(part="block_sparse", dtype=args.dtype, head_dim=args.head_dim, seq=seq,
                                batch=max(1, args.tokens // seq), heads=max(1, hidden // args.head_dim),
                                style=f"bs{round(sparsity * 100)}", sparsity=sparsity, block=args.block,
                                layout_seed=args.layout_seed, mode=mode))
    return out


@functools.lru_cache(maxsize=8)
def _block_map_cpu(seq: int, block: int, sparsity: float, seed: int) -> torch.Tensor:
    blocks = -(-seq // block)
    g = torch.Generator().manual_seed(seed * 1_000_003 + seq)
    block_map = torch.rand((blocks, blocks), generator=g) >= sparsity
    block_map[torch.arange(blocks), torch.arange(blocks)] = True  # no empty row
    return block_map


def block_map(cell, device) -> torch.Tensor:
    """The cell's (1, 1, NB, NB) bool layout."""
    return _block_map_cpu(cell["seq"], cell["block"], cell["sparsity"], cell["layout_seed"])[None, None].to(device)


def flex_block_mask(layout_map: torch.Tensor, block: int, seq: int):
    """The layout as a Flex BlockMask whose computed blocks are all full blocks."""
    from torch.nn.attention.flex_attention import BlockMask

    dense = layout_map.to(torch.int32)
    num = dense.sum(-1, dtype=torch.int32)
    idx = torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)
    table = layout_map[0, 0]

    def in_layout(b, h, q_idx, kv_idx):
        return table[q_idx // block, kv_idx // block]

    return BlockMask.from_kv_blocks(torch.zeros_like(num), idx, num, idx, BLOCK_SIZE=block, mask_mod=in_layout,
                                    seq_lengths=(seq, seq))


def visible(cell, device) -> torch.Tensor:
    import flash_inductor

    return flash_inductor.BlockSparseLayout(block_map(cell, device), cell["block"]).to_dense(cell["seq"], cell["seq"])


def visible_count(cell) -> int:
    """Scores the layout keeps: computed blocks times their (ragged-aware) sizes."""
    seq, block = cell["seq"], cell["block"]
    layout = block_map(cell, "cpu")[0, 0].to(torch.int64)
    sizes = torch.full((layout.shape[0],), block, dtype=torch.int64)
    sizes[-1] = seq - block * (layout.shape[0] - 1)
    return int(sizes @ layout @ sizes)


def tile_fraction(cell) -> float:
    from flash_inductor.launch.block_tiles import SKIP, tile_classes

    seq, block = cell["seq"], cell["block"]
    classes = tile_classes(block_map(cell, "cpu"), block, block, seq, seq, *MIRROR_TILES)
    return float((classes != SKIP).float().mean())


def attention(provider, cell, device, compiled_flex):
    """``attn(q, k, v)`` of ``provider``; ``compiled_flex()`` gives the compiled flex_attention."""
    import flash_inductor

    seq, block = cell["seq"], cell["block"]
    layout_map = block_map(cell, device)
    if provider == "ours":
        layout = flash_inductor.BlockSparseLayout(layout_map, block)
        return lambda q, k, v: flash_inductor.flash_attention(q, k, v, block_mask=layout)
    if provider == "flex":
        mask = flex_block_mask(layout_map, block, seq)
        # Flex compiles only for CUDA here; elsewhere (the CPU smoke test) its eager path runs.
        flex = compiled_flex() if torch.device(device).type == "cuda" else _eager_flex()
        return lambda q, k, v: flex(q, k, v, block_mask=mask)
    mask = visible(cell, device)
    if provider == "ours-mask":
        return lambda q, k, v: flash_inductor.flash_attention(q, k, v, attn_mask=mask)
    if provider == "sdpa-mask":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    raise ValueError(f"unknown provider {provider!r}")


def _eager_flex():
    from torch.nn.attention.flex_attention import flex_attention
    return flex_attention
