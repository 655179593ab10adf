"""``flash_inductor.distributed``: ring attention across processes (CPU, gloo) against the fp64
reference, under the project's tolerance rule (tests/helpers.py), forward and backward.

The default run spawns one group of 4 processes (one spawn: importing torch and the package
dominates on a 2-core machine): two world-size-2 groups, ranks (0, 1) and (2, 3), share the
world-size-2 matrix (the second also checks group-rank to global-rank translation), then all
four run the world-size-4 cases. ``-m distributed_full`` runs the wider matrix at world size 4.
Sharding, planning and argument checks are tested in-process.
"""

from __future__ import annotations

import pytest
import torch

from distributed_worker import case_inputs, full_case, run_world, shards_of
from helpers import assert_close_to_ref, lse_baseline, ref_forward_backward, sdpa_baseline

F32, F64 = torch.float32, torch.float64

# World size 2: causal zig-zag, contiguous, non-causal, GQA, masks, uneven L, dLSE, a schedule.
_W2 = [
    dict(name="w2_causal_zigzag_fp64", dtype=F64),
    dict(name="w2_causal_zigzag_fp32", dtype=F32, L=40, seed=1),
    dict(name="w2_causal_contiguous_fp32", dtype=F32, layout="contiguous", seed=2),
    dict(name="w2_noncausal_fp64", dtype=F64, causal=False, seed=3),
    dict(name="w2_noncausal_fp32", dtype=F32, causal=False, seed=4),
    dict(name="w2_gqa_causal_fp32", dtype=F32, Hq=4, Hkv=2, Ev=12, seed=5),
    dict(name="w2_gqa_noncausal_fp64", dtype=F64, Hq=4, Hkv=1, causal=False, seed=6),
    dict(name="w2_padding_bool_noncausal_fp32", dtype=F32, causal=False, mask="bool", seed=7),
    dict(name="w2_padding_float_causal_fp64", dtype=F64, mask="float", seed=8),
    dict(name="w2_uneven_causal_zigzag_fp64", dtype=F64, L=13, seq_len_arg=True, seed=9),
    dict(name="w2_uneven_noncausal_contiguous_fp32", dtype=F32, L=13, layout="contiguous", causal=False,
         seq_len_arg=True, seed=10),
    dict(name="w2_grad_lse_causal_fp64", dtype=F64, grad_lse=True, seed=11),
    dict(name="w2_schedule_accurate_fp32", dtype=F32, schedule="accurate", mask="bool", seed=12),
    dict(name="w2_schedule_fp8_backward_reruns_ring_fp32", dtype=F32, schedule="fp8", seed=14),
]
_W4 = [
    dict(name="w4_gqa_causal_zigzag_uneven_padding_fp32", dtype=F32, Hq=4, Hkv=2, L=37, seq_len_arg=True,
         mask="bool", seed=13),
]
_W4_FULL = [
    dict(name="w4_causal_zigzag_fp64", dtype=F64, L=32, seed=20),
    dict(name="w4_causal_contiguous_fp64", dtype=F64, L=32, layout="contiguous", seed=21),
    dict(name="w4_noncausal_fp32", dtype=F32, L=32, causal=False, seed=22),
    dict(name="w4_gqa_noncausal_uneven_fp64", dtype=F64, Hq=6, Hkv=2, L=30, causal=False, seq_len_arg=True, seed=23),
    dict(name="w4_padding_float_causal_fp32", dtype=F32, L=48, mask="float", seed=24),
    dict(name="w4_uneven_causal_contiguous_fp64", dtype=F64, L=11, layout="contiguous", seq_len_arg=True,
         seed=25),
    dict(name="w4_uneven_tiny_zigzag_fp64", dtype=F64, L=6, seq_len_arg=True, seed=26),  # empty chunks
    dict(name="w4_grad_lse_gqa_causal_fp32", dtype=F32, Hq=4, Hkv=2, L=40, grad_lse=True, seed=27),
    dict(name="w4_long_causal_zigzag_fp32", dtype=F32, B=1, L=320, E=32, Ev=32, seed=28),
    # 16-bit: each block's output is rounded before the fp32 merge (the op returns the input dtype).
    dict(name="w4_causal_zigzag_fp16", dtype=torch.float16, L=64, seed=40),
    dict(name="w4_gqa_causal_zigzag_bf16", dtype=torch.bfloat16, Hq=4, Hkv=2, L=64, seed=42),
]

_SPLIT = len(_W2) // 2
DEFAULT_PLAN = {(0, 1): _W2[:_SPLIT], (2, 3): _W2[_SPLIT:], (0, 1, 2, 3): _W4}
FULL_PLAN = {(0, 1, 2, 3): _W4_FULL}
_RESULTS = ("out", "lse", "dq", "dk", "dv")


@pytest.fixture(scope="module")
def default_runs(tmp_path_factory):
    return run_world(4, DEFAULT_PLAN, str(tmp_path_factory.mktemp("cp_default")))


@pytest.fixture(scope="module")
def full_runs(tmp_path_factory):
    # Only the distributed_full tests use it, and tests/conftest.py skips them unless -m names it.
    return run_world(4, FULL_PLAN, str(tmp_path_factory.mktemp("cp_full")), timeout_s=600.0)


def _check_case(runs, case):
    from flash_inductor.distributed import unshard_shards

    c = full_case(case)
    shards = shards_of(runs, c["name"])
    ours = {n: unshard_shards([s[n] for s in shards], 2, layout=c["layout"]) for n in _RESULTS}
    x = case_inputs(c)
    mask = None if x["mask"] is None else x["mask"][:, None, None, :]
    offset = 0 if c["causal"] else None
    ref = ref_forward_backward(x["q"], x["k"], x["v"], mask, causal_offset=offset, grad_out=x["dout"],
                               grad_lse=x["dlse"])
    base = sdpa_baseline(x["q"], x["k"], x["v"], mask, causal_offset=offset, grad_out=x["dout"],
                         grad_lse=x["dlse"])
    lse_base = None if c["dtype"] == F64 else lse_baseline(x["q"], x["k"], mask, causal_offset=offset)
    assert_close_to_ref(f"{c['name']} lse", ours["lse"], ref["lse"], lse_base)
    for name in ("out", "dq", "dk", "dv"):
        assert_close_to_ref(f"{c['name']} {name}", ours[name], ref[name], base[name], terms=ref["terms"].get(name))
    # And against the single-process op itself: within the same rule with the op as the baseline.
    import flash_inductor

    q, k, v = (x[n].clone().requires_grad_() for n in "qkv")
    out = flash_inductor.flash_attention(q, k, v, attn_mask=mask if not c["causal"] or mask is None else
                                         _causal_and(mask, c["L"]), is_causal=c["causal"] and mask is None,
                                         enable_gqa=True, schedule=c["schedule"])
    out.backward(x["dout"]) if x["dlse"] is None else None
    assert_close_to_ref(f"{c['name']} out vs op", ours["out"], ref["out"], out.detach())
    if x["dlse"] is None:
        for name, grad in (("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
            assert_close_to_ref(f"{c['name']} {name} vs op", ours[name], ref[name], grad, terms=ref["terms"][name])


def _causal_and(mask, seq_len):
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    if mask.dtype == torch.bool:
        return mask & causal
    return torch.where(causal, mask, torch.full_like(mask, float("-inf")))


@pytest.mark.parametrize("case", _W2 + _W4, ids=lambda c: c["name"])
def test_matches_reference(default_runs, case):
    _check_case(default_runs, case)


@pytest.mark.distributed_full
@pytest.mark.parametrize("case", _W4_FULL, ids=lambda c: c["name"])
def test_matches_reference_world_size_4_full(full_runs, case):
    _check_case(full_runs, case)


# ------------------------------------------------------------------------------------------
# In-process: layouts, plans, errors
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seq_len", [8, 13, 37, 3])
@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_shard_unshard_round_trip(layout, world_size, seq_len):
    from flash_inductor.distributed import SequenceLayout, shard_sequence, unshard_shards

    full = torch.arange(2 * seq_len).reshape(2, seq_len)
    shards = [shard_sequence(full, 1, layout=layout, rank=r, world_size=world_size) for r in range(world_size)]
    plan = SequenceLayout(seq_len, world_size, layout)
    assert [s.shape[1] for s in shards] == [plan.local_len(r) for r in range(world_size)]
    assert max(s.shape[1] for s in shards) - min(s.shape[1] for s in shards) <= (2 if layout == "zigzag" else 1)
    for r, s in enumerate(shards):
        assert torch.equal(s[0], plan.positions(r))
    assert torch.equal(unshard_shards(shards, 1, layout=layout), full)


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_zigzag_matches_torch_head_tail_order(world_size):
    """The zig-zag layout is the order of torch's own causal load balancer, so batches sharded by
    torch's context_parallel(...) buffers work here unchanged."""
    balancer = pytest.importorskip("torch.distributed.tensor.experimental._context_parallel._load_balancer")
    from flash_inductor.distributed import SequenceLayout

    seq_len = 4 * world_size
    torch_order = balancer._HeadTailLoadBalancer(seq_len, world_size, torch.device("cpu"))._generate_indices()
    assert torch.equal(torch_order.flatten(), SequenceLayout(seq_len, world_size, "zigzag").permutation())


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_causal_plan_covers_each_visible_pair_once(world_size):
    """Every (query, key) pair with key <= query is computed exactly once across the ring's steps,
    and zig-zag balances the work: ranks differ by at most one chunk pair."""
    from flash_inductor.distributed.plan import block_calls
    from flash_inductor.distributed import SequenceLayout

    for seq_len in (4 * world_size, 4 * world_size + 3):
        plan = SequenceLayout(seq_len, world_size, "zigzag")
        seen = torch.zeros(seq_len, seq_len, dtype=torch.int64)
        work = []
        for rank in range(world_size):
            q_pos = plan.positions(rank)
            pairs = 0
            for source in range(world_size):
                k_pos = plan.positions(source)
                for call in block_calls(plan, rank, source, True):
                    qs, ks = q_pos[call.q], k_pos[call.k]
                    visible = torch.ones(len(qs), len(ks), dtype=torch.bool)
                    if call.is_causal:
                        i, j = torch.arange(len(qs))[:, None], torch.arange(len(ks))[None, :]
                        visible = j <= i + call.causal_offset
                    seen[qs[:, None].expand_as(visible)[visible], ks[None, :].expand_as(visible)[visible]] += 1
                    pairs += int(visible.sum())
            work.append(pairs)
        assert torch.equal(seen, torch.ones(seq_len, seq_len, dtype=torch.int64).tril())
        chunk = seq_len // (2 * world_size) + 1
        assert max(work) - min(work) <= 2 * chunk * chunk + 2 * chunk


@pytest.fixture
def single_process_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_world_size_1_is_the_op(single_process_group):
    """At world size 1 the same code path makes one call: results are bitwise the plain op's."""
    import flash_inductor
    from flash_inductor.distributed import context_parallel_attention

    x = case_inputs(dict(dtype=F32, Hq=4, Hkv=2, L=33))
    ours = [t.clone().requires_grad_() for t in (x["q"], x["k"], x["v"])]
    plain = [t.clone().requires_grad_() for t in (x["q"], x["k"], x["v"])]
    out = context_parallel_attention(*ours, is_causal=True, enable_gqa=True, seq_len=33)
    expected = flash_inductor.flash_attention(*plain, is_causal=True, enable_gqa=True)
    out.backward(x["dout"])
    expected.backward(x["dout"])
    assert torch.equal(out, expected)
    for a, b in zip(ours, plain):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("kwargs, message", [
    (dict(dropout_p=0.1), "dropout_p=0.1 is not supported under context parallelism"),
    (dict(layout="striped"), "not a sequence layout"),
    (dict(schedule="fastest"), "not a known precision schedule"),
    (dict(key_padding_mask=torch.ones(2, 2, 5, 5, dtype=torch.bool)), "key_padding_mask must be (B, L_r)"),
    (dict(seq_len=9), "a zigzag split of 9 tokens over 1 ranks gives shards of [9]"),
])
def test_errors_name_the_argument(single_process_group, kwargs, message):
    from flash_inductor.distributed import context_parallel_attention

    q = torch.randn(2, 2, 5, 8)
    with pytest.raises(ValueError) as info:
        context_parallel_attention(q, q, q, **kwargs)
    assert message in str(info.value)


def test_gqa_needs_enable_gqa(single_process_group):
    from flash_inductor.distributed import context_parallel_attention

    with pytest.raises(ValueError, match="pass enable_gqa=True"):
        context_parallel_attention(torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8))


def test_needs_a_process_group():
    import torch.distributed as dist
    from flash_inductor.distributed import context_parallel_attention

    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        context_parallel_attention(q, q, q)


# ------------------------------------------------------------------------------------------
# The kernels with a row split across calls (what each rank's calls are): interpreter on CPU
# ------------------------------------------------------------------------------------------


@pytest.mark.launches_kernels
@pytest.mark.parametrize("schedule", ["stable", "accurate"])
def test_kernels_backward_with_keys_split_across_calls(schedule, device):
    """The ring's block calls on the Triton kernels: fp16 under schedules with exact Δ. Each call
    sees half the keys; the merged fp32 O and LSE go to every call's backward, which must then use
    rowsum(dO∘O) as given (the exact-Δ correction re-derives Δ from the call's own keys: wrong here)."""
    from flash_inductor import launch

    dtype, seq, split = torch.float16, 40, 24
    x = case_inputs(dict(dtype=F64, B=1, Hq=2, Hkv=2, L=seq, E=16, Ev=16, seed=30))
    q, k, v, dout = (x[n].to(dtype).to(device) for n in ("q", "k", "v", "dout"))
    scale = 0.25
    calls = [(slice(0, split), 0), (slice(split, seq), -split)]  # (keys, causal_offset): top-left causal
    out_acc = torch.zeros(q.shape, dtype=F32, device=device)
    lse_acc = torch.full(q.shape[:3], float("-inf"), dtype=F32, device=device)
    for keys, offset in calls:
        out_b, lse_b = launch.attention_forward(q, k[:, :, keys], v[:, :, keys], None, None, 0.0, scale, schedule,
                                                visibility=launch.Visibility(is_causal=True, causal_offset=offset))
        merged = torch.logaddexp(lse_acc, lse_b)
        shift = torch.where(merged.isneginf(), 0.0, merged)
        out_acc = out_acc * torch.exp(lse_acc - shift)[..., None] + out_b.float() * torch.exp(lse_b - shift)[..., None]
        lse_acc = merged
    dq = torch.zeros(q.shape, dtype=F32, device=device)
    dk, dv = [], []
    for keys, offset in calls:
        dq_b, dk_b, dv_b, _ = launch.attention_backward(
            dout, q, k[:, :, keys], v[:, :, keys], None, out_acc, lse_acc, None, None, 0.0, scale, schedule, False,
            visibility=launch.Visibility(is_causal=True, causal_offset=offset))
        dq += dq_b.float()
        dk.append(dk_b)
        dv.append(dv_b)
    ours = dict(out=out_acc.to(dtype), dq=dq.to(dtype), dk=torch.cat(dk, 2), dv=torch.cat(dv, 2))
    ref = ref_forward_backward(q, k, v, causal_offset=0, scale=scale, grad_out=dout)
    base = sdpa_baseline(q, k, v, causal_offset=0, scale=scale, grad_out=dout)
    for name, value in ours.items():
        assert_close_to_ref(f"{schedule} {name}", value.cpu(), ref[name], base[name].cpu(),
                            terms=ref["terms"].get(name))


def test_cp_scaling_benchmark_at_world_size_1(tmp_path):
    """benchmarks/cp_scaling.py through the same code path at world size 1 (gloo, in-process):
    the command the H200 runs for the overhead against the plain op, at toy sizes."""
    import json

    import torch.distributed as dist
    from benchmarks import cp_scaling

    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    records = cp_scaling.main(["--device", "cpu", "--seq", "96", "--heads", "2", "--kv-heads", "1", "--head-dim",
                               "16", "--dtype", "fp32", "--warmup", "1", "--rep", "1", "--baseline",
                               "--out", str(tmp_path)])
    assert not dist.is_initialized()
    (record,) = records
    assert record["world_size"] == 1 and record["local_tokens"] == 96
    assert {"ring_ms", "compute_only_ms", "plain_op_ms", "overhead_vs_plain"} <= set(record)
    (written,) = tmp_path.glob("cp_scaling_cpu_*_w1.json")
    assert json.loads(written.read_text())["records"] == records
