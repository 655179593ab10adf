"""Sliding windows (``flash_attention(window=(left, right))``): the band each row sees, the tiles
the kernels visit for it, and the results against the float64 reference.

The band (``flash_inductor.launch.band``): query i sees key j iff ``-left <= j - (i + S - L) <=
right`` (-1 an open side), intersected with ``is_causal`` and any mask. The reference below
folds the band into a bool or float mask and runs the naive float64 attention of
``tests/helpers.py``, so the expected results never go through the package's own band code; the
kernels' results must meet the project's tolerance rule against it, and rows that see no key (and
keys no row sees) must come out exactly zero.

Under the interpreter the kernels run with 16 x 16 tiles, so the small shapes here still span
several tiles on both sides of a window's edges; on CUDA the same tests run on the GPU.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from bounds_check import ADDRESS_WATCH, watched_addresses

import flash_inductor
from flash_inductor import launch
from flash_inductor.launch import band as band_module
from flash_inductor.launch.band import Band, resolve_band, visited_tiles
from helpers import (
    DEVICE,
    ON_CUDA,
    assert_close_to_ref,
    assert_dead_rows_exact,
    assert_shadow_check_passes,
    attention_ref,
    dropout_keep,
    launch_visibility,
    lse_baseline,
    make_mask,
    make_qkv,
    mock_hopper,
    randn,
    ref_forward_backward,
    sdpa_baseline,
)


def fold_band(mask: Optional[torch.Tensor], visible: torch.Tensor) -> torch.Tensor:
    """``mask`` with every key outside the band hidden: the reference's statement of the window."""
    if mask is None:
        return visible
    if mask.dtype == torch.bool:
        return mask & visible
    return torch.where(visible, mask, torch.full_like(mask, float("-inf")))


def band_of(seq_q, seq_k, window, causal_offset=None, device=None) -> torch.Tensor:
    """The (L, S) band written out from the definition, independently of ``launch.band``."""
    i = torch.arange(seq_q, device=device)[:, None]
    j = torch.arange(seq_k, device=device)[None, :]
    rel = j - (i + seq_k - seq_q)
    visible = torch.ones((seq_q, seq_k), dtype=torch.bool, device=device)
    if window is not None:
        left, right = window
        if left >= 0:
            visible &= rel >= -left
        if right >= 0:
            visible &= rel <= right
    if causal_offset is not None:
        visible &= j <= i + causal_offset
    return visible


# ------------------------------------------------------------------------------------------
# The band and the tile ranges (pure Python)
# ------------------------------------------------------------------------------------------

BANDS = [
    ((3, 0), None), ((0, 0), None), ((5, 7), None), ((-1, 4), None), ((6, -1), None), ((200, 200), None),
    ((17, 17), 0), ((2, 40), 0), ((30, -1), 3), ((-1, -1), 0), ((40, 0), None),
]


@pytest.mark.parametrize("seq_q,seq_k", [(37, 45), (50, 20), (1, 37), (33, 33)])
@pytest.mark.parametrize("window,causal_offset", BANDS)
def test_band_matches_the_definition(seq_q, seq_k, window, causal_offset):
    band = resolve_band(causal_offset is not None, causal_offset or 0, window, seq_q, seq_k)
    assert torch.equal(band.visible(seq_q, seq_k), band_of(seq_q, seq_k, window, causal_offset))


def _forward_tiles(band, seq_q, seq_k, block_m, block_n):
    """{(query tile, key tile): checked} as the forward (and dQ) pass visits them."""
    tiles = {}
    for start_m in range(0, seq_q, block_m):
        lo, mid, split, hi = band_module.forward_key_ranges(band, start_m, block_m, block_n, seq_k)
        for a, b, checked in ((lo, mid, True), (mid, split, False), (split, hi, True)):
            for start_n in range(a, b, block_n):
                assert (start_m, start_n) not in tiles, "a tile is visited twice"
                assert start_n % block_n == 0
                tiles[start_m, start_n] = checked
    return tiles


def _dkdv_tiles(band, seq_q, seq_k, block_m, block_n):
    tiles = {}
    for start_n in range(0, seq_k, block_n):
        lo, mid, mid_hi, hi = band_module.dkdv_query_ranges(band, start_n, block_m, block_n, seq_q, seq_k)
        for a, b, checked in ((lo, mid, True), (mid, mid_hi, False), (mid_hi, hi, True)):
            for start_m in range(a, b, block_m):
                assert (start_m, start_n) not in tiles, "a tile is visited twice"
                assert start_m % block_m == 0
                tiles[start_m, start_n] = checked
    return tiles


@pytest.mark.parametrize("blocks", [(16, 16), (32, 16), (16, 64), (64, 32)])
@pytest.mark.parametrize("seq_q,seq_k", [(37, 45), (130, 70), (70, 130), (96, 96)])
@pytest.mark.parametrize("window,causal_offset", BANDS)
def test_tile_ranges_cover_the_band_and_skip_the_rest(blocks, seq_q, seq_k, window, causal_offset):
    """The Python mirror of the kernels' loops: every visible score lies in a visited tile; an
    unchecked tile is whole (inside S) and every row of it sees every key of it; and every visited
    tile holds some score inside the band (a tile wholly outside it is never visited)."""
    block_m, block_n = blocks
    band = resolve_band(causal_offset is not None, causal_offset or 0, window, seq_q, seq_k)
    # The band over the padded rows too: the kernels' programs own whole tiles of rows.
    rows = -(-seq_q // block_m) * block_m
    cols = -(-seq_k // block_n) * block_n
    padded = band.visible(rows, cols)
    in_bounds = torch.zeros_like(padded)
    in_bounds[:seq_q, :seq_k] = True
    # A program owns a whole tile of its own dimension (rows in the forward and dQ pass, keys in
    # the dK/dV pass), padding included; the dimension it loops over stops at L or S.
    rows_ok = torch.arange(rows)[:, None] < seq_q
    keys_ok = torch.arange(cols)[None, :] < seq_k
    dkdv = _dkdv_tiles(band, seq_q, seq_k, block_m, block_n)
    for tiles, owned in ((_forward_tiles(band, seq_q, seq_k, block_m, block_n), padded & keys_ok),
                         (dkdv, padded & rows_ok)):
        covered = torch.zeros_like(padded)
        for (start_m, start_n), checked in tiles.items():
            tile = padded[start_m:start_m + block_m, start_n:start_n + block_n]
            reachable = owned[start_m:start_m + block_m, start_n:start_n + block_n]
            # (Causal masking alone, without a window, keeps its one known waste: the dK/dV pass of
            # a key tile past L + causal_offset that no row sees visits the last query tile.)
            if band.lower is not None or tiles is not dkdv:
                assert reachable.any(), f"tile ({start_m}, {start_n}) lies wholly outside the band"
            if not checked:
                assert start_n + block_n <= seq_k, "an unchecked tile runs past S"
                assert tile.all(), f"unchecked tile ({start_m}, {start_n}) holds invisible scores"
            covered[start_m:start_m + block_m, start_n:start_n + block_n] = True
        assert not (padded & in_bounds & ~covered).any(), "a visible score lies in a skipped tile"


@pytest.mark.parametrize("blocks", [(128, 64), (64, 64), (128, 128), (64, 32)])
def test_a_1k_window_at_16k_visits_about_a_sixteenth(blocks):
    """L = S = 16k with a 1k causal sliding window: the forward, dQ and dK/dV passes visit about
    1/16 of the dense tiles (at least the band's own share, at most a tile row and column more)."""
    block_m, block_n = blocks
    seq = 16 * 1024
    band = resolve_band(False, 0, (1023, 0), seq, seq)
    counts = visited_tiles(band, seq, seq, block_m, block_n)
    for name in ("forward", "dq", "dkdv"):
        fraction = counts[name] / counts["dense"]
        assert 1 / 17 < fraction < 1.25 / 16, (name, fraction)
    # Only the edge tiles take the visibility select: at most ceil(BM / BN) + 1 at each edge.
    query_tiles = seq // block_m
    assert counts["checked_forward"] <= query_tiles * 2 * (-(-block_m // block_n) + 1)
    causal = visited_tiles(resolve_band(True, 0, None, seq, seq), seq, seq, block_m, block_n)
    assert 0.49 < causal["forward"] / causal["dense"] < 0.52


# ------------------------------------------------------------------------------------------
# The kernels against the float64 reference
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WindowCase:
    window: tuple = (7, 0)
    batch: int = 1
    heads_q: int = 2
    heads_kv: int = 2
    seq_q: int = 37
    seq_k: int = 45
    head_dim: int = 24
    head_dim_v: int = 24
    mask: str = "none"
    causal: str = "none"  # none | top_left | bottom_right
    dropout_p: float = 0.0
    mask_grad: bool = False

    @property
    def causal_offset(self) -> Optional[int]:
        return {"none": None, "top_left": 0, "bottom_right": self.seq_k - self.seq_q}[self.causal]


if ON_CUDA:
    _W = dict(seq_q=300, seq_k=429, head_dim=64, head_dim_v=64, batch=2, heads_q=4, heads_kv=4)
    _SQ = dict(seq_q=300, seq_k=300)
    _LONG_Q = dict(seq_q=429, seq_k=300)
    _NARROW, _WIDE = 63, 130
else:
    _W = {}
    _SQ = dict(seq_q=45, seq_k=45)
    _LONG_Q = dict(seq_q=50, seq_k=30)
    _NARROW, _WIDE = 7, 20


def _w(**changes) -> WindowCase:
    return dataclasses.replace(WindowCase(**_W), **changes)


CASES = {
    "causal_sliding": _w(window=(_NARROW, 0)),
    "causal_sliding_square": _w(window=(_NARROW, 0), **_SQ),
    "symmetric": _w(window=(_NARROW, _NARROW)),
    "asymmetric_long_q": _w(window=(3, _WIDE), **_LONG_Q),
    "left_only": _w(window=(_WIDE, -1)),
    "right_only": _w(window=(-1, 2)),
    "diagonal_only": _w(window=(0, 0), **_SQ),
    "wider_than_s": _w(window=(10_000, 10_000)),
    "with_causal_top_left": _w(window=(_WIDE, _WIDE), causal="top_left", **_LONG_Q),
    "with_causal_bottom_right": _w(window=(_NARROW, 3), causal="bottom_right"),
    "empty_rows_long_q": _w(window=(2, 0), **_LONG_Q),  # the first L - S rows see no key
    # With is_causal top-left and L < S the window's left edge (j >= i + S - L - 2) lies right of
    # the causal one (j <= i): the two sides cross and no row sees any key.
    "empty_band_crossing": _w(window=(2, -1), causal="top_left"),
    "bool_mask": _w(window=(_NARROW, _NARROW), mask="bool"),
    "bool_mask_dead_rows": _w(window=(_NARROW, 0), mask="bool_dead_rows"),
    "float_mask_grad": _w(window=(_WIDE, 2), mask="float", mask_grad=True),
    "float_mask_broadcast_grad": _w(window=(_NARROW, 0), mask="float_bcast", mask_grad=True),
    "gqa": _w(window=(_NARROW, 1), heads_q=4, heads_kv=2),
    "mqa_causal": _w(window=(_WIDE, 0), heads_q=4, heads_kv=1, causal="top_left", **_SQ),
    "dropout": _w(window=(_NARROW, _NARROW), dropout_p=0.2),
    "dropout_gqa_float_mask": _w(window=(_WIDE, 0), heads_q=4, heads_kv=2, mask="float", dropout_p=0.3),
}


def run_window_case(case: WindowCase, dtype, device, schedule="stable", seed=0):
    """Forward and backward through the launchers, and the float64 reference with the band folded
    into the mask. Returns (ours, reference, baseline, inputs)."""
    q, k, v = make_qkv(case.batch, case.heads_q, case.heads_kv, case.seq_q, case.seq_k, case.head_dim,
                       case.head_dim_v, dtype, device, seed=seed)
    mask = make_mask(case.mask, case.batch, case.heads_q, case.seq_q, case.seq_k, dtype, device, seed=seed + 1)
    dout = randn((case.batch, case.heads_q, case.seq_q, case.head_dim_v), dtype, device, seed + 2)
    scale = case.head_dim ** -0.5
    rng_seed = keep = None
    if case.dropout_p > 0:
        seed_value = 2**40 + 777 + seed
        rng_seed = torch.tensor([seed_value], dtype=torch.int64, device=device)
        keep = dropout_keep(seed_value, case.batch, case.heads_q, case.seq_q, case.seq_k, case.dropout_p, device)
    offset = case.causal_offset
    common = (rng_seed, case.dropout_p, scale, schedule)
    visibility = launch_visibility(offset, window=case.window)
    out, lse = launch.attention_forward(q, k, v, mask, *common, visibility=visibility)
    dq, dk, dv, dmask = launch.attention_backward(dout, q, k, v, mask, out, lse, None, *common, case.mask_grad,
                                                  visibility=visibility)
    ours = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv, dmask=dmask)
    ref_mask = fold_band(mask, band_of(case.seq_q, case.seq_k, case.window, offset, device))
    kwargs = dict(scale=scale, dropout_mask=keep, dropout_p=case.dropout_p, grad_out=dout, mask_grad=case.mask_grad)
    ref = ref_forward_backward(q, k, v, ref_mask, **kwargs)
    base = sdpa_baseline(q, k, v, ref_mask, **kwargs)
    return ours, ref, base, dict(q=q, k=k, v=v, mask=ref_mask, scale=scale)


def check_window_case(case: WindowCase, dtype, device, schedule="stable", seed=0):
    ours, ref, base, x = run_window_case(case, dtype, device, schedule, seed)
    assert ours["out"].shape == (case.batch, case.heads_q, case.seq_q, case.head_dim_v)
    names = ["out", "dq", "dk", "dv"] + (["dmask"] if case.mask_grad else [])
    for name in names:
        assert_close_to_ref(name, ours[name], ref[name], base[name], terms=ref["terms"].get(name))
    lse_base = lse_baseline(x["q"], x["k"], x["mask"], scale=x["scale"])
    assert_close_to_ref("lse", ours["lse"], ref["lse"], lse_base)
    dead = assert_dead_rows_exact(x["q"], x["k"], x["mask"], None, ours["out"], ours["lse"], ours["dq"], ours["dk"],
                                  ours["dv"], ours["dmask"] if case.mask_grad else None)
    return dead


@pytest.mark.launches_kernels
@pytest.mark.parametrize("case", [pytest.param(c, id=n) for n, c in CASES.items()])
def test_window_kernels(case, kernel_dtype, device):
    check_window_case(case, kernel_dtype, device)


@pytest.mark.launches_kernels
def test_empty_rows_are_exercised(device):
    """The empty-row cases do produce rows that see no key (so their exact-zero check has teeth)."""
    assert check_window_case(CASES["empty_rows_long_q"], torch.float32, device) > 0
    case = CASES["empty_band_crossing"]
    assert check_window_case(case, torch.float32, device) == case.batch * case.heads_q * case.seq_q


@pytest.mark.launches_kernels
@pytest.mark.parametrize("schedule", ["fast", "accurate"])
def test_window_under_other_schedules(schedule, device):
    check_window_case(CASES["symmetric"], torch.float16, device, schedule=schedule)


@pytest.mark.launches_kernels
def test_scores_outside_the_band_are_never_read_unchecked(device):
    """A float mask that is NaN everywhere outside the band: a tile outside the band taken on the
    unchecked path would let the NaN into the results. The band's select replaces what the checked
    tiles read there, so the results must be those of the same mask with -inf outside the band."""
    case = _w(window=(_NARROW, 2), mask="float", mask_grad=True)
    q, k, v = make_qkv(case.batch, case.heads_q, case.heads_kv, case.seq_q, case.seq_k, case.head_dim,
                       case.head_dim_v, torch.float32, device, seed=4)
    visible = band_of(case.seq_q, case.seq_k, case.window, None, device)
    clean = make_mask("float", case.batch, case.heads_q, case.seq_q, case.seq_k, torch.float32, device, seed=5)
    dout = randn(q.shape[:-1] + (case.head_dim_v,), torch.float32, device, 6)
    common = (None, 0.0, case.head_dim ** -0.5, "stable")
    visibility = launch_visibility(window=case.window)
    results = []
    for outside in (float("nan"), float("-inf")):
        mask = torch.where(visible, clean, torch.full_like(clean, outside))
        out, lse = launch.attention_forward(q, k, v, mask, *common, visibility=visibility)
        grads = launch.attention_backward(dout, q, k, v, mask, out, lse, None, *common, True, visibility=visibility)
        results.append((out, lse, *grads))
    for name, poisoned, clean_result in zip(("out", "lse", "dq", "dk", "dv", "dmask"), *results):
        assert not poisoned.isnan().any(), f"{name}: a NaN outside the band reached the result"
        assert torch.equal(poisoned, clean_result), name


# ------------------------------------------------------------------------------------------
# The public function: reference path, autograd, broadcast forms, errors
# ------------------------------------------------------------------------------------------


def _naive(q, k, v, visible):
    out, _ = attention_ref(q, k, v, visible)
    return out


@pytest.mark.parametrize("window", [(4, 0), (3, 9), (-1, 0), (6, -1), (100, 100), (-1, -1)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_reference_path_float64(window, is_causal):
    """On CPU (and for float64 anywhere) the op runs the blocked PyTorch reference: exact to
    float64 rounding against the naive computation, gradients included."""
    q, k, v = make_qkv(2, 4, 2, 21, 300, 8, 8, torch.float64, "cpu", seed=2)  # S spans 3 reference chunks
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = flash_inductor.flash_attention(q, k, v, is_causal=is_causal, window=window, enable_gqa=True)
    visible = band_of(21, 300, window, 0 if is_causal else None)
    ref = _naive(*(t.detach().requires_grad_() for t in (q, k, v)), visible)
    torch.testing.assert_close(out, ref.detach(), rtol=1e-12, atol=1e-12)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    ref_grads = torch.autograd.grad(_naive(*leaves, visible), leaves, dout)
    for ours, theirs in zip(grads, ref_grads):
        torch.testing.assert_close(ours, theirs, rtol=1e-11, atol=1e-12)


def test_reference_path_skips_chunks_outside_the_band(monkeypatch):
    """The reference visits only the key chunks some row's band reaches (as the kernels skip tiles)."""
    from flash_inductor.ops import reference

    seen = []
    real = reference._chunk_scores
    monkeypatch.setattr(reference, "_chunk_scores",
                        lambda problem, gq, kc, mask, band, scale, start, stop, *rest: seen.append(start) or
                        real(problem, gq, kc, mask, band, scale, start, stop, *rest))
    q, k, v = make_qkv(1, 1, 1, 64, 1024, 8, 8, torch.float32, "cpu")
    flash_inductor.flash_attention(q, k, v, window=(100, 0))  # rows 0-63 see keys 860-1023 (S - L = 960)
    assert sorted(set(seen)) == [768, 896]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32] if ON_CUDA else [torch.float32])
def test_public_function_matches_a_band_mask(dtype, device):
    """flash_attention(window=...) against SDPA in float64 with the same band as a bool mask (3-D
    inputs, GQA, CausalBias lower-right combined with a window): the definition, not our op."""
    from torch.nn.attention.bias import causal_lower_right

    def sdpa64(q, k, v, mask, **kwargs):
        return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, **kwargs)

    q, k, v = make_qkv(2, 4, 2, 33, 47, 16, 16, dtype, device, seed=7)
    visible = band_of(33, 47, (5, 2), 47 - 33, device)
    ours = flash_inductor.flash_attention(q, k, v, attn_mask=causal_lower_right(33, 47), window=(5, 2),
                                          enable_gqa=True)
    torch.testing.assert_close(ours.double(), sdpa64(q, k, v, visible, enable_gqa=True), rtol=2e-3, atol=2e-3)
    q3, k3, v3 = q[:, 0], k[:, 0], v[:, 0]
    torch.testing.assert_close(flash_inductor.flash_attention(q3, k3, v3, window=[5, 2]).double(),
                               sdpa64(q3, k3, v3, band_of(33, 47, (5, 2), None, device)), rtol=2e-3, atol=2e-3)


def test_no_window_is_the_dense_call(device):
    q, k, v = make_qkv(1, 2, 2, 20, 30, 16, 16, torch.float32, device, seed=1)
    dense = flash_inductor.flash_attention(q, k, v, is_causal=True)
    assert torch.equal(flash_inductor.flash_attention(q, k, v, is_causal=True, window=None), dense)
    assert torch.equal(flash_inductor.flash_attention(q, k, v, is_causal=True, window=(-1, -1)), dense)
    # Sides wider than the sequence bind no row: the same call, whatever their size.
    assert torch.equal(flash_inductor.flash_attention(q, k, v, is_causal=True, window=(30, 20)), dense)
    assert torch.equal(flash_inductor.flash_attention(q, k, v, is_causal=True, window=(2**40, 2**62)), dense)


@pytest.mark.parametrize("window,match", [
    (5, "pair"), ((1, 2, 3), "pair"), ("ab", "pair"), ((1.5, 0), "left"), ((0, -2), "right"),
    ((True, 0), "left"), ((torch.tensor(3), 0), "left"), ({1: 2}, "pair"),
])
def test_bad_windows_are_refused(window, match):
    q = torch.randn(1, 2, 8, 8)
    with pytest.raises(ValueError, match=rf"window.*{match}|{match}.*window"):
        flash_inductor.flash_attention(q, q, q, window=window)


def test_fp8_refuses_a_window():
    q = torch.randn(1, 2, 8, 32)
    with pytest.raises(ValueError, match="fp8.*window"):
        flash_inductor.flash_attention(q, q, q, window=(4, 0), schedule="fp8")
    flash_inductor.flash_attention(q, q, q, window=(-1, -1), schedule="fp8")  # no window: runs


def test_hopper_kernels_take_a_window(monkeypatch):
    """The Gluon forward and backward both skip the tiles outside a window's band, so their static
    checks take a windowed call, under `fast` and (through the one-pass ops) `stable`."""
    from flash_inductor.launch import hopper, hopper_bwd

    t = mock_hopper(monkeypatch)
    q, kv = t(2, 8, 64, 128), t(2, 2, 64, 128)
    for window in (None, (-1, -1), (127, 0), (127, 5), (300, -1)):
        assert hopper.hopper_forward_unsupported_reason(q, kv, kv, None, 0.0, None, "stable", window=window) is None
        assert hopper_bwd.hopper_backward_unsupported_reason(q, kv, kv, None, 0.0, None, "fast", is_causal=True,
                                                             window=window) is None
        # `stable` through the one-pass ops (ops/one_pass.py), which take windows too.
        assert hopper_bwd.hopper_backward_unsupported_reason(q, kv, kv, None, 0.0, None, "stable", is_causal=True,
                                                             window=window) is None


def test_the_op_hands_the_window_to_the_hopper_forward(monkeypatch):
    """Runs anywhere: the op's forward gives the Hopper entry the window as its two ints (the opaque
    op's schema), and a call without one the open (-1, -1)."""
    from flash_inductor.launch import decode, hopper
    from flash_inductor.ops import attention as ops_attention

    q = torch.randn(1, 2, 8, 64)
    seen = []
    monkeypatch.setattr(decode, "decode_forward_or_none", lambda *a, **kw: None)
    monkeypatch.setattr(hopper, "hopper_forward_unsupported_reason", lambda *a, **kw: None)

    def hopper_call(*args):
        call = args[3]
        seen.append((call.visibility.is_causal, call.visibility.causal_offset, call.scale, call.schedule.name,
                     *call.visibility.window))
        return q, q.new_zeros(1, 2, 8)
    describe = ops_attention.describe_call
    ops_attention._kernel_forward(q, q, q, None, None, describe(q, q, q, 0.0, True, 0, 0.125, "stable", 5, 0),
                                  hopper_call=hopper_call)
    ops_attention._kernel_forward(q, q, q, None, None, describe(q, q, q, 0.0, False, 0, 0.125, "stable"),
                                  hopper_call=hopper_call)
    assert seen == [(True, 0, 0.125, "stable", 5, 0), (False, 0, 0.125, "stable", -1, -1)]


# ------------------------------------------------------------------------------------------
# The ops: fake kernels and opcheck with a window
# ------------------------------------------------------------------------------------------


def _op_args(device, dtype, requires_grad=False, mask_kind="none", p=0.0):
    q, k, v = make_qkv(1, 4, 2, 9, 13, 8, 8, dtype, device, seed=3)
    mask = make_mask(mask_kind, 1, 4, 9, 13, dtype, device, seed=4)
    if requires_grad:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    seed = torch.tensor([987654321], dtype=torch.int64, device=device) if p > 0 else None
    return q, k, v, mask, seed, p


# (mask kind, dropout_p, is_causal, window) at L = 9, S = 13 (S - L = 4).
OP_SAMPLES = {"window": ("none", 0.0, False, (3, 1)), "window_causal_bool": ("bool", 0.0, True, (6, -1)),
              "window_dropout_float": ("float", 0.2, False, (-1, 2)),
              "every_row_empty": ("none", 0.0, True, (2, -1))}  # j >= i + 2 and j <= i: no key at all


@pytest.mark.parametrize("sample", [pytest.param(s, id=n) for n, s in OP_SAMPLES.items()])
def test_opcheck_with_window(sample, device):
    mask_kind, p, is_causal, (left, right) = sample
    dtype = torch.float16 if device == "cuda" else torch.float32
    for requires_grad in (False, True):
        q, k, v, mask, seed, p = _op_args(device, dtype, requires_grad, mask_kind, p)
        torch.library.opcheck(torch.ops.flash_inductor.attention_forward.default,
                              (q, k, v, mask, seed, p, is_causal, 0, 8**-0.5, "stable", left, right))
    q, k, v, mask, seed, p = _op_args(device, dtype, False, mask_kind, p)
    fwd_args = (q, k, v, mask, seed, p, is_causal, 0, 8**-0.5)
    torch.library.opcheck(torch.ops.flash_inductor.attention_forward_reference.default, (*fwd_args, left, right))
    out, lse = torch.ops.flash_inductor.attention_forward(*fwd_args, "stable", left, right)
    dout = randn(out.shape, dtype, device, 5)
    mask_grad = mask is not None and mask.is_floating_point()
    common = (dout, q, k, v, mask, out, lse, None, seed, p, is_causal, 0, 8**-0.5)
    torch.library.opcheck(torch.ops.flash_inductor.attention_backward.default,
                          (*common, "stable", mask_grad, left, right))
    torch.library.opcheck(torch.ops.flash_inductor.attention_backward_reference.default,
                          (*common, mask_grad, left, right))


def test_fake_kernels_take_the_window():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = torch.empty(2, 4, 9, 8), torch.empty(2, 2, 13, 8), torch.empty(2, 2, 13, 6)
        out, lse = torch.ops.flash_inductor.attention_forward(q, k, v, None, None, 0.0, False, 0, 0.3, "stable", 4, 0)
        assert out.shape == (2, 4, 9, 6) and lse.shape == (2, 4, 9)
        grads = torch.ops.flash_inductor.attention_backward(torch.empty(2, 4, 9, 6), q, k, v, None, out, lse, None,
                                                            None, 0.0, False, 0, 0.3, "stable", False, 4, 0)
        assert [tuple(g.shape) for g in grads[:3]] == [(2, 4, 9, 8), (2, 2, 13, 8), (2, 2, 13, 6)]


def test_window_under_torch_compile(device):
    """The window reaches the op through a compiled graph (the op's schema carries it)."""
    q, k, v = make_qkv(1, 2, 2, 24, 24, 16, 16, torch.float32, device, seed=9)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    compiled = torch.compile(lambda q, k, v: flash_inductor.flash_attention(q, k, v, window=(5, 0)),
                             backend="aot_eager", fullgraph=True)
    out = compiled(*leaves)
    out.sum().backward()
    eager_leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    eager = flash_inductor.flash_attention(*eager_leaves, window=(5, 0))
    eager.sum().backward()
    torch.testing.assert_close(out, eager)
    for a, b in zip(leaves, eager_leaves):
        torch.testing.assert_close(a.grad, b.grad)


def test_debug_shadow_knows_the_window():
    """flash_inductor.debug's float64 twin of our op applies the window too: a twin without it
    would differ from the op and fail the check (its visibility is also the window's band)."""
    from flash_inductor.debug import sites

    assert_shadow_check_passes(40, window=(3, 1))
    q = torch.empty(1, 1, 7, 4)
    k = torch.empty(1, 1, 9, 4)
    assert torch.equal(sites.visibility(q, k, None, True, 0, (1, 0)), band_of(7, 9, (1, 0), 0))


# Wider tiles than the interpreter's 16 x 16, so lengths ragged for one are whole for the other.
_BOUNDS_CASES = ("causal_sliding", "asymmetric_long_q", "left_only", "with_causal_bottom_right",
                 "empty_rows_long_q", "empty_band_crossing", "float_mask_grad", "dropout_gqa_float_mask")


@pytest.mark.launches_kernels
@ADDRESS_WATCH
@pytest.mark.parametrize("tiles", ["interpreter", "wide"])
@pytest.mark.parametrize("name", _BOUNDS_CASES)
def test_window_kernels_touch_only_their_tensors(name, tiles, monkeypatch, device):
    """Every address the window's loops load from or store to lies inside the launch's tensors
    (tests/bounds_check.py): a skipped range computed past an edge would read out of bounds on a GPU."""
    from flash_inductor.tuning.configs import AttentionConfigs, KernelConfig

    if tiles == "wide":
        wide = AttentionConfigs(forward=KernelConfig(32, 64, 4, 1), backward_dkdv=KernelConfig(32, 64, 4, 1),
                                backward_dq=KernelConfig(32, 64, 4, 1))
        monkeypatch.setattr(launch.common, "launch_configs", lambda *args, **kwargs: wide)
    with watched_addresses(device) as state:
        ours, *_ = run_window_case(CASES[name], torch.float16, device)
    assert state.violations == []
    assert state.accesses > 0
    assert all(torch.isfinite(ours[n].float()).all() for n in ("out", "dq", "dk", "dv"))
