"""The split-KV decode forward (kernels/attn_decode.py, launch/decode.py) against the float64
reference, its dispatch from the op, a backward through it, and its tuning lookup.

Under the interpreter the key sequences are short (a few hundred keys) and the split count is
forced, so each case spans several splits, ragged split ends, and splits that some rows see
nothing of (a KV cache longer than the current length, causal offsets, dead rows).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import pytest
import torch
from bounds_check import ADDRESS_WATCH, watched_addresses

from flash_inductor import launch
from flash_inductor.launch import decode
from flash_inductor.tuning import cache
from flash_inductor.tuning.buckets import Bucket
from flash_inductor.tuning.configs import decode_split_count, select_decode_config
from flash_inductor.tuning.kernel_config import KernelConfig
from helpers import (
    assert_close_to_ref,
    assert_dead_rows_exact,
    launch_visibility,
    lse_baseline,
    make_qkv,
    randn,
    ref_forward_backward,
    sdpa_baseline,
    spy_on_launches,
)

pytestmark = pytest.mark.launches_kernels


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    batch: int = 2
    heads_q: int = 8
    heads_kv: int = 1
    seq_q: int = 1
    seq_k: int = 97
    head_dim: int = 24
    head_dim_v: Optional[int] = None  # None: head_dim
    mask: str = "none"  # see decode_mask
    causal: Optional[str] = None  # None | "top_left" | "bottom_right" | "cache" (bottom-right at a shorter length)
    window: Optional[tuple[int, int]] = None  # (left, right), FlashAttention's definition; -1: open
    splits: int = 3


def decode_mask(kind: str, case: DecodeCase, dtype, device) -> Optional[torch.Tensor]:
    """Masks as a KV cache produces them, all (B, Hq, L, S) views:

    * cache_bool / cache_float: keys past each batch element's cache length hidden (a (B, 1, 1, S)
      mask broadcast through stride 0), the lengths short enough that the last splits of batch 0
      see nothing;
    * bool / float: a random full mask (float: ~15 % -inf entries);
    * dead_rows: a random bool mask with query rows 0 and L - 1 of head 0 seeing no key.
    """
    b, h, lq, lk = case.batch, case.heads_q, case.seq_q, case.seq_k
    g = torch.Generator().manual_seed(5)
    if kind == "none":
        return None
    if kind in ("cache_bool", "cache_float"):
        lengths = torch.tensor([lk // 5 + 1] + [lk - 3 * i for i in range(1, b)])
        keep = torch.arange(lk)[None, :] < lengths[:, None]
        if kind == "cache_bool":
            small = keep
        else:
            small = torch.randn((b, lk), generator=g, dtype=torch.float64).masked_fill(~keep, float("-inf")).to(dtype)
        return small[:, None, None, :].to(device).expand(b, h, lq, lk)
    if kind == "bool":
        return (torch.rand((b, h, lq, lk), generator=g) < 0.7).to(device)
    if kind == "float":
        values = torch.randn((b, h, lq, lk), generator=g, dtype=torch.float64)
        return values.masked_fill(torch.rand(values.shape, generator=g) < 0.15, float("-inf")).to(dtype).to(device)
    if kind == "dead_rows":
        keep = torch.rand((b, h, lq, lk), generator=g) < 0.7
        keep[:, 0, sorted({0, lq - 1}), :] = False
        return keep.to(device)
    raise AssertionError(kind)


def causal_offset_of(case: DecodeCase) -> Optional[int]:
    return {None: None, "top_left": 0, "bottom_right": case.seq_k - case.seq_q,
            # A static cache of S slots holding S // 3 tokens: the splits share only the filled slots.
            "cache": case.seq_k // 3 - case.seq_q}[case.causal]


def with_window(mask, case: DecodeCase, dtype, device):
    """The mask with the window's invisible keys hidden as well (the reference's view of a window):
    query i sees key j iff -left <= j - (i + S - L) <= right, each side open at -1."""
    if case.window is None:
        return mask
    left, right = case.window
    i = torch.arange(case.seq_q, device=device)[:, None]
    j = torch.arange(case.seq_k, device=device)[None, :]
    inside = torch.ones((case.seq_q, case.seq_k), dtype=torch.bool, device=device)
    if left >= 0:
        inside &= j - (i + case.seq_k - case.seq_q) >= -left
    if right >= 0:
        inside &= j - (i + case.seq_k - case.seq_q) <= right
    full = (case.batch, case.heads_q, case.seq_q, case.seq_k)
    if mask is None:
        return inside.expand(full)
    if mask.dtype == torch.bool:
        return mask & inside
    return mask.masked_fill(~inside, float("-inf")).to(dtype)


def check_decode(case: DecodeCase, dtype, device, **launch_kwargs):
    head_dim_v = case.head_dim_v or case.head_dim
    q, k, v = make_qkv(case.batch, case.heads_q, case.heads_kv, case.seq_q, case.seq_k, case.head_dim,
                       head_dim_v, dtype, device, seed=3)
    mask = decode_mask(case.mask, case, dtype, device)
    offset = causal_offset_of(case)
    scale = case.head_dim ** -0.5
    out, lse = decode.decode_attention_forward(q, k, v, mask, scale, "stable",
                                               visibility=launch_visibility(offset, window=case.window),
                                               num_splits=case.splits, **launch_kwargs)
    mask = with_window(mask, case, dtype, device)
    assert out.shape == (case.batch, case.heads_q, case.seq_q, head_dim_v) and out.dtype == dtype
    assert lse.shape == out.shape[:-1] and lse.dtype == torch.float32
    ref = ref_forward_backward(q, k, v, mask, causal_offset=offset, scale=scale)
    base = sdpa_baseline(q, k, v, mask, causal_offset=offset, scale=scale)
    assert_close_to_ref("out", out, ref["out"], base["out"])
    assert_close_to_ref("lse", lse, ref["lse"], lse_baseline(q, k, mask, causal_offset=offset, scale=scale))
    dead = assert_dead_rows_exact(q, k, mask, offset, out, lse)
    return out, lse, dead


CASES = {
    "L1-gqa8-plain": DecodeCase(),
    "L4-gqa8-bottom_right": DecodeCase(seq_q=4, causal="bottom_right", splits=4),
    "L16-gqa8-top_left": DecodeCase(seq_q=16, causal="top_left", splits=2),
    "L16-gqa8-cache_bool": DecodeCase(seq_q=16, mask="cache_bool", splits=5),
    "L1-mha-cache_float": DecodeCase(heads_q=2, heads_kv=2, mask="cache_float", splits=6),
    "L4-mha-float": DecodeCase(heads_q=2, heads_kv=2, seq_q=4, mask="float"),
    "L4-gqa8-bool": DecodeCase(seq_q=4, mask="bool", splits=2),
    "L4-gqa8-cache_causal": DecodeCase(seq_q=4, causal="cache", splits=6),
    "L4-gqa4-dead_rows": DecodeCase(heads_q=8, heads_kv=2, seq_q=4, mask="dead_rows", splits=3),
    "L1-one_split": DecodeCase(splits=1, mask="cache_bool"),
    "L3-gqa4-E_ne_Ev": DecodeCase(heads_q=8, heads_kv=2, seq_q=3, head_dim=20, head_dim_v=36, causal="bottom_right"),
    # Sliding windows (Mistral's: causal plus a left bound), narrower than S, with masks and offsets.
    "L1-gqa8-window_causal": DecodeCase(window=(40, 0), causal="bottom_right", splits=3),
    "L4-gqa8-window_cache_bool": DecodeCase(seq_q=4, window=(30, -1), mask="cache_bool", splits=4),
    "L16-mha-window_both_float": DecodeCase(heads_q=2, heads_kv=2, seq_q=16, window=(20, 5), mask="float"),
    "L4-gqa8-window_top_left_empty_rows": DecodeCase(seq_q=4, window=(10, -1), causal="top_left", splits=5),
}


@pytest.mark.parametrize("case", [pytest.param(c, id=n) for n, c in CASES.items()])
def test_decode_matches_reference(case, kernel_dtype, device, monkeypatch):
    launched = []
    spy_on_launches(monkeypatch, lambda name, kwargs: launched.append(name))
    check_decode(case, kernel_dtype, device)
    # One split writes the result itself; several are merged.
    expected = ["_attn_decode_split"] + (["_attn_decode_merge"] if case.splits > 1 else [])
    assert launched == expected


def test_fully_masked_splits_and_rows(device):
    """Batch 0's cache holds 20 of 97 keys, so with 6 splits its last splits see nothing; rows of
    head 0 see no key at all in batch 1 too: out 0 and LSE -inf there, exactly, and no NaN."""
    case = DecodeCase(seq_q=4, mask="cache_bool", splits=6)
    out, lse, _ = check_decode(case, torch.float32, device)
    assert out.isfinite().all() and not lse.isnan().any()
    # Every row, every split empty: the whole output is 0, the LSE -inf.
    q, k, v = make_qkv(1, 8, 1, 4, 97, 24, 24, torch.float32, device)
    nothing = torch.zeros((1, 1, 1, 97), dtype=torch.bool, device=device).expand(1, 8, 4, 97)
    out, lse = decode.decode_attention_forward(q, k, v, nothing, 0.2, "stable", num_splits=4)
    assert (out == 0).all() and lse.isneginf().all()


def test_rows_beyond_one_block_and_configs(device):
    """GROUP x L = 64 packed rows with a cap of 16 rows per program: four row blocks, each its own
    heads; and a wider key block than the split."""
    case = DecodeCase(seq_q=16, heads_q=4, heads_kv=1, causal="bottom_right", splits=7)
    check_decode(case, torch.float32, device, config=KernelConfig(16, 32, 1, 1))


def _decode_launches(monkeypatch):
    names = []
    spy_on_launches(monkeypatch, lambda name, kwargs: names.append(name))
    monkeypatch.setattr(launch, "kernel_supports", lambda *tensors: True)  # the op's CUDA path, interpreted
    return names


@pytest.mark.parametrize("window", [None, (300, 0)], ids=["no_window", "window_causal"])
def test_backward_through_the_decode_forward(monkeypatch, device, window):
    """The op's forward takes the decode kernels; its autograd backward runs the normal backward
    from their out and LSE, and every gradient meets the tolerance rule (with a sliding window too:
    Mistral's, causal plus a left bound)."""
    names = _decode_launches(monkeypatch)
    case = DecodeCase(batch=1, heads_q=4, heads_kv=2, seq_q=3, seq_k=decode.DECODE_MIN_KEYS + 5, head_dim=16,
                      window=window, causal="bottom_right" if window else None)
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 4, 2, case.seq_q, case.seq_k, 16, 16, torch.float32, device))
    mask = decode_mask("cache_float", case, torch.float32, device)
    dout = randn((1, 4, case.seq_q, 16), torch.float32, device, 11)
    offset = causal_offset_of(case)
    left, right = window or (-1, -1)
    out, lse = torch.ops.flash_inductor.attention_forward(q, k, v, mask, None, 0.0, offset is not None, offset or 0,
                                                          0.25, "stable", left, right)
    assert "_attn_decode_split" in names and "_attn_fwd" not in names
    out.backward(dout)
    mask = with_window(mask, case, torch.float32, device)
    ref = ref_forward_backward(q, k, v, mask, causal_offset=offset, scale=0.25, grad_out=dout)
    base = sdpa_baseline(q, k, v, mask, causal_offset=offset, scale=0.25, grad_out=dout)
    for name, ours in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        assert_close_to_ref(name, ours, ref[name], base[name], terms=ref["terms"].get(name))


@pytest.mark.parametrize("seq_q, seq_k, dropout_p, expected", [
    (1, decode.DECODE_MIN_KEYS, 0.0, "_attn_decode_split"),
    (decode.DECODE_MAX_QUERY_ROWS, decode.DECODE_MIN_KEYS, 0.0, "_attn_decode_split"),
    (1, decode.DECODE_MIN_KEYS - 1, 0.0, "_attn_fwd"),
    (decode.DECODE_MAX_QUERY_ROWS + 1, decode.DECODE_MIN_KEYS, 0.0, "_attn_fwd"),
    (1, decode.DECODE_MIN_KEYS, 0.3, "_attn_fwd"),
])
def test_dispatch_threshold(monkeypatch, device, seq_q, seq_k, dropout_p, expected):
    names = _decode_launches(monkeypatch)
    q, k, v = make_qkv(1, 2, 1, seq_q, seq_k, 16, 16, torch.float32, device)
    seed = torch.tensor([7], dtype=torch.int64, device=device) if dropout_p else None
    out, _ = torch.ops.flash_inductor.attention_forward(q, k, v, None, seed, dropout_p, False, 0, 0.25, "stable")
    assert expected in names and out.isfinite().all()
    assert ("_attn_decode_split" in names) == (expected == "_attn_decode_split")


def test_unsupported_reasons(device):
    q, k, _ = make_qkv(1, 2, 1, 2, decode.DECODE_MIN_KEYS, 16, 16, torch.float32, device)
    assert decode.decode_unsupported_reason(q, k, None, 0.0, "stable") is None
    assert decode.decode_unsupported_reason(q, k, None, 0.1, "stable").startswith("dropout")
    assert "fp8" in decode.decode_unsupported_reason(q, k, None, 0.0, "fp8")
    assert decode.decode_unsupported_reason(q, k[:, :, :10], None, 0.0, "stable") == decode.TOO_FEW_KEYS
    long_q = q[:, :, :1].expand(1, 2, decode.DECODE_MAX_QUERY_ROWS + 1, 16)
    assert decode.decode_unsupported_reason(long_q, k, None, 0.0, "stable") == decode.NOT_DECODE_SHAPE


# ------------------------------------------------------------------------------------------
# Tuning: the split heuristic and the table's decode buckets
# ------------------------------------------------------------------------------------------


def test_split_count_heuristic():
    slots = 2 * 132  # an H200: two decode programs per SM
    # A launch that fills the GPU on its own takes one split.
    assert decode_split_count(slots, 256, 131072) == 1
    assert decode_split_count(slots, 212, 131072) == 1
    # One batch element of 4 KV heads: splits until one wave is about full, never past the slots.
    splits = decode_split_count(slots, 4, 131072)
    assert 0.85 * slots <= 4 * splits <= slots
    # Short keys bound the split count by 256-key granules.
    assert decode_split_count(slots, 4, 300) == 2
    assert decode_split_count(slots, 4, 100) == 1
    for programs in (1, 3, 8, 33, 64, 150):
        for seq in (512, 4096, 65536):
            n = decode_split_count(slots, programs, seq)
            assert 1 <= n <= 128 and n <= max(1, -(-seq // 256))


def _decode_entry(block_m, block_n):
    return {"configs": {"decode": KernelConfig(block_m, block_n, 4, 2).to_dict()}}


def test_decode_bucket_key_and_entry_validation():
    bucket = Bucket.parse("stable/fp16/e32/none/s1024/decode")
    assert bucket.pass_name == "decode" and cache.kernel_family(bucket) == "decode"
    assert cache.entry_problem(bucket.key(), {**_decode_entry(32, 64), "kernel": "x", "triton": "y"}) is None
    wrong_role = {"configs": {"forward": KernelConfig(32, 64, 4, 2).to_dict()}, "kernel": "x", "triton": "y"}
    assert "decode" in cache.entry_problem(bucket.key(), wrong_role)


def test_the_table_decode_entry_is_used(monkeypatch, device):
    """A table entry at the decode bucket of S's length decides the launch's key block; a table
    without one leaves the heuristic."""
    q, k, v = make_qkv(1, 4, 1, 2, 200, 32, 32, torch.float16, device)
    table = cache.TuningTable.for_current_code("any", {"stable/fp16/e32/bool/s256/decode": _decode_entry(32, 64)})
    with cache.override_table(table):
        assert select_decode_config(q, 32, 32, True, seq_k=200, mask_kind="bool", schedule="stable") == \
            KernelConfig(32, 64, 4, 2)
        assert select_decode_config(q, 32, 32, True, seq_k=200, mask_kind="none", schedule="stable") == \
            KernelConfig(16, 16, 1, 1)
        seen = []
        spy_on_launches(monkeypatch, lambda name, kwargs: seen.append((name, kwargs.get("BLOCK_N"))))
        mask = torch.ones((1, 1, 1, 200), dtype=torch.bool, device=device).expand(1, 4, 2, 200)
        decode.decode_attention_forward(q, k, v, mask, 0.2, "stable", num_splits=2)
    assert ("_attn_decode_split", 64) in seen


# ------------------------------------------------------------------------------------------
# Addresses (the interpreter's check on CPU, compute-sanitizer on a GPU: tests/bounds_check.py)
# ------------------------------------------------------------------------------------------


@ADDRESS_WATCH
@pytest.mark.parametrize("config", [None, KernelConfig(64, 64, 4, 1)], ids=["interpreter", "wide"])
@pytest.mark.parametrize("case", [pytest.param(CASES[n], id=n) for n in (
    "L16-gqa8-cache_bool", "L4-gqa8-cache_causal", "L4-mha-float", "L4-gqa4-dead_rows")])
def test_decode_kernels_touch_only_their_tensors(case, config, device):
    with watched_addresses(device) as state:
        check_decode(case, torch.float16, device, config=config)
    assert state.violations == [] and state.accesses > 0


def test_explain_names_the_decode_kernels():
    """A rewritten decode-shaped site's report line says the decode kernels run it (on a GPU);
    a prefill site does not."""
    import torch.fx as fx

    from flash_inductor.passes.site import AttentionSite, describe_rewrite

    class Cuda(torch.Tensor):
        @property
        def is_cuda(self):
            return True

    graph = fx.Graph()

    def node(name, *shape, dtype=torch.bfloat16):
        n = graph.placeholder(name)
        n.meta["example_value"] = torch.empty(shape, dtype=dtype).as_subclass(Cuda)
        return n

    keys = decode.DECODE_MIN_KEYS * 2
    k, v = node("k", 2, 1, keys, 64), node("v", 2, 1, keys, 64)
    step = AttentionSite("sdpa", None, node("q", 2, 8, 1, 64), k, v, enable_gqa=True,
                         attn_mask=node("m", 2, 1, 1, keys, dtype=torch.bool))
    assert describe_rewrite(step, "stable").endswith("forward on the split-KV decode kernels")
    prefill = AttentionSite("sdpa", None, node("p", 2, 8, keys, 64), k, v, enable_gqa=True, is_causal=True)
    assert "decode" not in describe_rewrite(prefill, "stable")
    dropout = AttentionSite("sdpa", None, node("d", 2, 8, 1, 64), k, v, enable_gqa=True, dropout_p=0.1)
    assert "decode" not in describe_rewrite(dropout, "stable")
