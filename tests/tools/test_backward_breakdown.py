"""benchmarks.backward_breakdown: the per-launch backward breakdown runs, sweeps and writes its record."""

from __future__ import annotations

import json

from benchmarks import backward_breakdown
from helpers import DEVICE, ON_CUDA


def test_config_labels_parse_into_launch_configs():
    cfg = backward_breakdown.parse_config("64x128/w8/s3")
    assert (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages) == (64, 128, 8, 3)
    assert cfg.label() == "64x128/w8/s3"
    for labels in backward_breakdown.SWEEP.values():
        assert all(backward_breakdown.parse_config(label).label() == label for label in labels)


def test_breakdown_writes_a_record_per_schedule(tmp_path, capsys):
    assert backward_breakdown.main(["--quick", "--device", DEVICE, "--out", str(tmp_path), "--tag", "smoke"]) == 0
    (written,) = tmp_path.glob("backward_breakdown_*_smoke.json")
    data = json.loads(written.read_text())
    assert [r["schedule"] for r in data["results"]] == ["stable", "fast"]
    for record in data["results"]:
        assert set(record["table_configs"]) == {"forward", "backward_dkdv", "backward_dq"}
        if ON_CUDA:
            # Every pass was timed, and the two main passes ran at a positive rate.
            kernels = record["table"]["kernels"]
            assert any("_attn_bwd_dq" in name for name in kernels)
            assert any("_attn_bwd_dkdv" in name for name in kernels)
            assert all(row["us"] > 0 for row in kernels.values())
    if ON_CUDA:
        assert any(r["n_regs"] for r in data["compiled"])
    assert "table configs" in capsys.readouterr().out


def test_step_mode_times_whole_training_steps(tmp_path):
    argv = ["--quick", "--device", DEVICE, "--step", "--out", str(tmp_path), "--tag", "step"]
    assert backward_breakdown.main(argv) == 0
    (written,) = tmp_path.glob("backward_breakdown_*_step.json")
    steps = json.loads(written.read_text())["steps"]
    assert [s["name"] for s in steps][:2] == ["ours:stable", "ours:fast"]
    assert all(s["wall_ms"] > 0 for s in steps)
    if ON_CUDA:
        assert all(s["kernel_ms"] > 0 for s in steps) and steps[-1]["name"] == "sdpa:flash"


def test_force_rescale_runs_the_rescaling_loop(tmp_path, monkeypatch):
    seen = []
    real = backward_breakdown.launch.attention_backward

    def spy(*args, **kwargs):
        seen.append(float(kwargs["ds_bound"]) if kwargs.get("ds_bound") is not None else None)
        return real(*args, **kwargs)

    # main() wraps whatever attention_backward is (the spy); monkeypatch restores the real one.
    monkeypatch.setattr(backward_breakdown.launch, "attention_backward", spy)
    argv = ["--quick", "--device", DEVICE, "--schedules", "stable", "--force-rescale", "--no-write"]
    if ON_CUDA:
        argv += ["--dtype", "fp16"]
    assert backward_breakdown.main(argv) == 0
    assert seen and all(b == float("inf") for b in seen)
