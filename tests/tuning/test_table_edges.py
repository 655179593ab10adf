"""Every launch config the shipped tuning table picks, at the lengths that compile to other kernels.

Triton compiles an integer argument equal to 1 into the kernel as a constant, and Inductor does
the same for a size it knows to be 1 (``do_not_specialize`` does not stop it). So a query or key
length of 1 runs a kernel that the autotuner never compiled: its accuracy check runs at
L = S = 509. Such a kernel can fail where its general twin does not: on 2026-12-01 a Triton
3.6 fault in the dQ kernel that only S = 1 with 4-warp 64x64 tiles hit
(``benchmarks/results/backward_fault_nvidia-h200_20261201_s17.md``). Users reach these kernels
with any length: a 16k-token sequence attending to one key takes the s16384 bucket's configs.
So every distinct pick of the table is run here at S = 1 and at L = 1, forward and backward,
against the float64 reference with the usual tolerance rule.

On a GPU this uses the shipped table of that GPU; a GPU without one runs the heuristic's
configs, which ``test_kernels.py``'s L7_S1 shapes cover. On the CPU, Triton's interpreter does
not specialise, so it cannot meet a compiler fault; a few fp16 picks of the H200 table run there
to keep this file's own machinery (table reading, forced configs, the checks) tested.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flash_inductor import launch
from flash_inductor.tuning import cache
from flash_inductor.tuning.buckets import Bucket
from flash_inductor.tuning.configs import AttentionConfigs, KernelConfig
from flash_inductor.autotune.measure import sqnr_db
from flash_inductor.schedules import FP8_SQNR_BUDGET_DB
from helpers import (ON_CUDA, needs_hopper, assert_close_to_ref, assert_dead_rows_exact, launch_visibility, make_mask, make_qkv,
                     ref_forward_backward, sdpa_baseline)
from unit.test_kernels import Case, check_case  # tests/ is on the path (pyproject), unit/ a namespace

pytestmark = pytest.mark.launches_kernels

# (L, S): a key length of 1 (the dQ pass's loop over keys and the forward's), a query length of 1
# (the dK/dV pass's loop over queries).
EDGE_LENGTHS = {"L7_S1": (7, 1), "L1_S7": (1, 7)}
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass(frozen=True)
class Pick:
    """One distinct launch the table can make: the bucket family and its configs."""

    schedule: str
    dtype: str
    width: int
    mask: str
    configs: AttentionConfigs

    def label(self) -> str:
        c = self.configs
        roles = [c.forward.label()] + ([] if self.schedule == "fp8" else [c.backward_dkdv.label(), c.backward_dq.label()])
        return f"{self.schedule}-{self.dtype}-e{self.width}-{self.mask}-" + "+".join(roles)


SHIPPED_GPU = "nvidia-h200_sm90_132sm"


def _table_path():
    """This GPU's shipped table; on CPU, and on a GPU with none of its own (the H100 until it is
    tuned), the H200's: its configs are sm_90 launches any Hopper with its shared memory takes, so
    its picks still run at the edges here rather than the test collecting nothing."""
    if ON_CUDA:
        own = cache.shipped_tables_dir() / cache.table_filename(cache.device_gpu_key(torch.device("cuda")))
        if own.exists():
            return own
    return cache.shipped_tables_dir() / cache.table_filename(SHIPPED_GPU)


def _picks() -> list[Pick]:
    """The table's distinct (family, configs) pairs; a backward entry pairs with its bucket's
    forward entry (the backward needs a forward's output), fp8 entries are forward only."""
    table = cache.read_table(_table_path())
    if table is None:
        return []
    entries = table.entries
    picks = {}
    for key, entry in sorted(entries.items()):
        bucket = Bucket.parse(key)
        roles = entry["configs"]
        if bucket.schedule == "fp8":
            forward = KernelConfig.from_dict(roles["forward"])
            configs = AttentionConfigs(forward, forward, forward)  # only the forward runs
        elif bucket.pass_name == "backward":
            forward_entry = entries.get(bucket.replace(pass_name="forward").key())
            if forward_entry is None:
                continue  # the forward of this bucket takes the heuristic: test_kernels covers it
            configs = AttentionConfigs(KernelConfig.from_dict(forward_entry["configs"]["forward"]),
                                       KernelConfig.from_dict(roles["backward_dkdv"]),
                                       KernelConfig.from_dict(roles["backward_dq"]))
        else:
            continue  # a forward entry runs with its bucket's backward entry above
        pick = Pick(bucket.schedule, bucket.dtype, bucket.width, bucket.mask, configs)
        picks.setdefault(pick.label(), pick)
    chosen = list(picks.values())
    if not ON_CUDA:  # one fp16 E = 64 pick per schedule
        per_schedule = {}
        for p in chosen:
            if p.dtype == "fp16" and p.width == 64:
                per_schedule.setdefault(p.schedule, p)
        chosen = list(per_schedule.values())
    return chosen


PICKS = _picks()


def _decode_picks() -> list[tuple[str, str, int, str, KernelConfig]]:
    """The decode configs a launch takes with this table: (schedule, dtype, width, mask, config).
    A family (schedule, dtype, width, mask) with "decode" entries runs those; a family the table
    tunes for its other passes but not for decode runs the heuristic's decode config, which is
    what ``select_decode_config`` falls back to there (the shipped H200 table has no decode
    entries yet, so today these are all heuristic picks, and the test still runs each of them)."""
    from flash_inductor.tuning.configs import _heuristic_for

    table = cache.read_table(_table_path())
    entries = table.entries if table is not None else {}
    picks, with_decode, families = {}, set(), set()
    for key, entry in sorted(entries.items()):
        bucket = Bucket.parse(key)
        family = (bucket.schedule, bucket.dtype, bucket.width, bucket.mask)
        if bucket.pass_name == "decode":
            config = KernelConfig.from_dict(entry["configs"]["decode"])
            picks.setdefault(family + (config.label(),), family + (config,))
            with_decode.add(family)
        elif bucket.pass_name in ("forward", "backward") and bucket.schedule != "fp8":  # fp8: no decode kernel
            families.add(family)
    device = torch.device("cuda" if ON_CUDA else "cpu")
    for family in sorted(families - with_decode):
        schedule, dtype_name, width, mask = family
        config = _heuristic_for(device, _DTYPES[dtype_name], width, width, not ON_CUDA, schedule, mask).decode
        picks.setdefault(family + (config.label(),), family + (config,))
    chosen = list(picks.values())
    return chosen if ON_CUDA else [p for p in chosen if p[1] == "fp16" and p[2] == 64][:1]


DECODE_PICKS = _decode_picks()
# A decode step (one query row of a GQA group against a few hundred keys: L = 1 compiles its own
# kernel) and a key length of 1.
DECODE_LENGTHS = {"L1_S600": (1, 600), "L7_S1": (7, 1)}


def test_the_table_has_picks_to_check():
    """The list is not empty (this GPU's table, else the H200's: ``_table_path``), so the
    parametrised test below cannot pass by collecting nothing."""
    assert _table_path().exists()
    assert PICKS
    assert all(p.dtype in _DTYPES for p in PICKS)
    assert DECODE_PICKS
    if ON_CUDA:  # every 16-bit schedule and both mask kinds of the table are there
        assert {p.schedule for p in PICKS} >= {"stable", "fast"}
        assert {p.mask for p in PICKS} >= {"none", "causal"}


@pytest.mark.parametrize("lengths", list(EDGE_LENGTHS.values()), ids=list(EDGE_LENGTHS))
@pytest.mark.parametrize("pick", PICKS, ids=[p.label() for p in PICKS])
def test_table_pick_at_length_one(pick, lengths, device, monkeypatch):
    def table_lookup(*args, **kwargs):
        raise AssertionError("the launch looked its configs up instead of running the pick's")

    monkeypatch.setattr(launch.common, "select_configs", table_lookup)
    seq_q, seq_k = lengths
    dtype = _DTYPES[pick.dtype]
    # A head width is the padded max(E, Ev); E = width keeps the padding-free path the table
    # was tuned on, and B = H = 2 gives more than one program along the grid's second axis.
    # The table's mask kinds: none, causal, bool, float (buckets.MASK_KINDS).
    causal = "top_left" if pick.mask == "causal" else "none"
    mask = pick.mask if pick.mask in ("bool", "float") else "none"
    case = Case(batch=2, heads_q=2, heads_kv=2, seq_q=seq_q, seq_k=seq_k, head_dim=pick.width,
                head_dim_v=pick.width, causal=causal, mask=mask)
    if pick.schedule == "fp8":
        _check_fp8_forward(case, dtype, device, pick.configs)
    else:
        check_case(case, dtype, device, pick.schedule, configs=pick.configs)


def _check_fp8_forward(case: Case, dtype: torch.dtype, device: str, configs: AttentionConfigs):
    q, k, v = make_qkv(case.batch, case.heads_q, case.heads_kv, case.seq_q, case.seq_k, case.head_dim,
                       case.head_dim_v, dtype, device, seed=0)
    mask = make_mask(case.mask, case.batch, case.heads_q, case.seq_q, case.seq_k, dtype, device)
    scale = case.head_dim**-0.5
    out, _ = launch.attention_forward(q, k, v, mask, None, 0.0, scale, "fp8",
                                      visibility=launch_visibility(case.causal_offset), configs=configs)
    truth = ref_forward_backward(q, k, v, mask, causal_offset=case.causal_offset, scale=scale)["out"]
    assert torch.isfinite(out).all()
    assert sqnr_db(out, truth) >= FP8_SQNR_BUDGET_DB


@pytest.mark.parametrize("lengths", list(DECODE_LENGTHS.values()), ids=list(DECODE_LENGTHS))
@pytest.mark.parametrize("pick", DECODE_PICKS, ids=["-".join(map(str, p[:4])) + "-" + p[4].label() for p in DECODE_PICKS])
def test_table_decode_pick_at_length_one(pick, lengths, device):
    from flash_inductor.launch.decode import decode_attention_forward

    schedule, dtype_name, width, mask_kind, config = pick
    seq_q, seq_k = lengths
    dtype = _DTYPES[dtype_name]
    q, k, v = make_qkv(2, 8, 2, seq_q, seq_k, width, width, dtype, device, seed=0)
    mask = make_mask(mask_kind if mask_kind in ("bool", "float") else "none", 2, 8, seq_q, seq_k, dtype, device)
    offset = seq_k - seq_q if mask_kind == "causal" else None
    scale = width**-0.5
    out, lse = decode_attention_forward(q, k, v, mask, scale, schedule, visibility=launch_visibility(offset),
                                        config=config)
    ref = ref_forward_backward(q, k, v, mask, causal_offset=offset, scale=scale)
    base = sdpa_baseline(q, k, v, mask, causal_offset=offset, scale=scale)
    assert_close_to_ref("out", out, ref["out"], base["out"])
    assert_dead_rows_exact(q, k, mask, offset, out, lse)


def _gluon_picks() -> dict:
    """The table's distinct Gluon Hopper picks (tuning/hopper_configs.py), by label: (bucket, the
    configs to run, with the pick in its role and the built-in configs in the others)."""
    from flash_inductor.tuning import hopper_configs
    from flash_inductor.tuning.buckets import GLUON_PASSES
    from flash_inductor.tuning.kernel_config import role_config_from_dict

    table = cache.read_table(_table_path())
    picks = {}
    for key, entry in sorted((table.entries if table is not None else {}).items()):
        bucket = Bucket.parse(key)
        if bucket.pass_name not in GLUON_PASSES:
            continue
        (role, stored), = entry["configs"].items()
        config = role_config_from_dict(role, stored)
        built_in = {r: hopper_configs.default_for_bucket(r, bucket.replace(pass_name=r)) for r in GLUON_PASSES}
        configs = AttentionConfigs(None, None, None, **{**built_in, role: config})
        # The plain forward's kernel is the same under every schedule: one pick for all of them.
        schedule = "any" if role == "gluon_forward" else bucket.schedule
        label = f"{schedule}-{bucket.dtype}-e{bucket.width}-{bucket.mask}-{role}-{config.label()}"
        picks.setdefault(label, (bucket.replace(seq=128), configs))
    return picks


GLUON_PICKS = _gluon_picks()


def test_the_table_has_gluon_picks_to_check():
    """The H200 table holds Gluon entries (the CPU reads it too), so the test below cannot pass by
    collecting nothing there."""
    if _table_path().name == cache.table_filename(SHIPPED_GPU):
        assert {bucket.pass_name for bucket, _ in GLUON_PICKS.values()} == {
            "gluon_forward", "gluon_forward_exact", "gluon_backward"}


@needs_hopper
@pytest.mark.parametrize("lengths", list(EDGE_LENGTHS.values()), ids=list(EDGE_LENGTHS))
@pytest.mark.parametrize("label", list(GLUON_PICKS))
def test_table_gluon_pick_at_length_one(label, lengths):
    """Each Gluon pick at S = 1 and L = 1, through the autotuner's own check: within twice
    PyTorch's same-dtype error of fp64, finite on large logits (and fp16's large values in the
    backward), rows that see no key exactly 0."""
    from flash_inductor.autotune.measure import AccuracyCheck, LaunchRunner, Shape

    bucket, configs = GLUON_PICKS[label]
    seq_q, seq_k = lengths
    verdict = AccuracyCheck(bucket, Shape(2, 2, seq_q, seq_k), "cuda").verify(LaunchRunner(), configs, bucket.schedule)
    assert verdict.ok, verdict.reason
