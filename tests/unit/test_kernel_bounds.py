"""Every kernel load and store stays inside the launch's tensors (the interpreter's check on CPU,
compute-sanitizer on a GPU: tests/bounds_check.py).

tests/unit/test_kernels.py checks the results; a load past a tensor's end whose value is masked out
later leaves the results right under the interpreter and faults on a GPU (or reads a neighbour's
bytes). These tests run the same cases with tests/bounds_check.py watching every address, under
the interpreter's small tiles and under wider ones, so a length is ragged for one and a whole
number of blocks for the other, and the kernels' "cannot run past the end" variants run too.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from bounds_check import ADDRESS_WATCH, checked_addresses, watched_addresses
from helpers import ON_CUDA
from unit.test_kernels import DROPOUT, FEATURES, SHAPES, run_case

from flash_inductor import launch
from flash_inductor.tuning.configs import AttentionConfigs, KernelConfig

pytestmark = [pytest.mark.launches_kernels, ADDRESS_WATCH]


@triton.jit
def _copy(src, dst, n, BLOCK: tl.constexpr, MASKED: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    if MASKED:
        tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)
    else:
        tl.store(dst + offs, tl.load(src + offs))


@pytest.mark.skipif(ON_CUDA, reason="the interpreter's check; on a GPU the memcheck step's canary checks the sanitizer")
def test_the_check_catches_a_load_past_the_end_and_passes_masked_lanes():
    src = torch.randn(8)
    dst = torch.zeros(16)
    with checked_addresses() as state:
        _copy[(1,)](src, dst, 8, BLOCK=16, MASKED=True)
        assert torch.equal(dst[:8], src)
        with pytest.raises(Exception, match="OutOfBoundsAccess.*_copy: load of 8 of 16"):
            _copy[(1,)](src, dst, 8, BLOCK=16, MASKED=False)
    assert state.violations == ["_copy: load of 8 of 16 enabled lanes outside every tensor of the launch"]
    assert state.accesses >= 3
    # Outside the block the interpreter is itself again.
    _copy[(1,)](src, dst[:8], 8, BLOCK=8, MASKED=False)


# Tiles for the second run. Lengths that are whole numbers of the interpreter's 16 x 16 tiles (the
# whole-block cases' 48) are ragged for 32 x 64 ones, so each such case runs both the unmasked and
# the masked load variants across the two runs; the ragged cases run masked in both.
_WIDE = AttentionConfigs(forward=KernelConfig(32, 64, 4, 1), backward_dkdv=KernelConfig(32, 64, 4, 1),
                         backward_dq=KernelConfig(32, 64, 4, 1))
_CASES = {
    **{f"shape_{name}": case for name, case in SHAPES.items()},
    **{name: FEATURES[name] for name in (
        "float_mask_broadcast_grad", "causal_bottom_right_L>S_dead_rows", "gqa_causal_float_mask_grad",
        "noncontig_causal_bool_broadcast_gqa", "grad_lse_dead_rows_causal", "no_keys_S0", "E_ne_Ev_odd",
        "whole_blocks_causal_gqa_float_mask_grad", "whole_queries_ragged_keys_causal",
        "ragged_queries_whole_keys_E_padded")},
    "dropout_p0.17_causal_bottom_right_gqa": DROPOUT["p0.17_causal_bottom_right_gqa"],
}


@pytest.mark.parametrize("tiles", ["interpreter", "wide"])
@pytest.mark.parametrize("case", [pytest.param(c, id=n) for n, c in _CASES.items()])
@pytest.mark.parametrize("schedule,dtype", [("stable", torch.float16), ("fast", torch.float32)],
                         ids=["stable-fp16", "fast-fp32"])
def test_kernels_touch_only_their_tensors(case, schedule, dtype, tiles, monkeypatch, device):
    if tiles == "wide":
        monkeypatch.setattr(launch.common, "launch_configs", lambda *args, **kwargs: _WIDE)
    with watched_addresses(device) as state:
        ours, _ = run_case(case, dtype, device, schedule)
    assert state.violations == []
    assert state.accesses > 0
    assert all(torch.isfinite(ours[name].float()).all() for name in ("dq", "dk", "dv"))
