"""benchmarks/cold_start.py on CPU: a child process measures our attention's first call at a
model's shapes, dynamo's phase times are read back, and failures become one table line."""

import pytest
import torch

from benchmarks import cold_start


@pytest.mark.timeout(300)
def test_attention_part_runs_in_a_fresh_process():
    records = cold_start.main(["--tiny", "--seqs", "64", "--tokens", "128", "--device", "cpu",
                               "--parts", "attention", "--no-write"])
    assert [r["part"] for r in records] == ["attention"]
    record = records[0]
    assert "error" not in record, record
    assert 0 < record["forward_s"] <= record["first_s"] < record["process_wall_s"]
    assert record["batch"] == 2 and record["contender"] == "flash_inductor"


def test_dynamo_phases_are_read_after_a_compile():
    torch._dynamo.reset()
    torch.compile(lambda x: x.sin() + 1, backend="eager")(torch.ones(3))
    phases = cold_start._dynamo_phases(min_seconds=0.0)
    assert phases and all(isinstance(v, float) and v >= 0.0 for v in phases.values())
    assert any("compile" in name for name in phases)


def test_a_failed_process_is_one_table_line():
    line = cold_start.table([dict(model="m", task="train", contender="compile", part="cold",
                                  error="RuntimeError: boom", process_wall_s=1.0)]).splitlines()[-1]
    assert "RuntimeError: boom" in line and line.startswith("| m | train | compile | cold |")
