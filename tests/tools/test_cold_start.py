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


def test_the_no_compile_ahead_contender_is_our_backend_with_compile_ahead_off(monkeypatch):
    backends = []
    monkeypatch.setattr(torch, "compile", lambda model, backend=None, **_: backends.append(backend) or model)
    model = torch.nn.Linear(2, 2)
    for contender in ("flash_inductor", cold_start.NO_COMPILE_AHEAD, "compile"):
        assert cold_start.compile_contender(contender, model) is model
    ours, off, plain = backends
    assert ours.options.compile_ahead is True and off.options.compile_ahead is False and plain is None
    assert off.options.schedule is None and cold_start.NO_COMPILE_AHEAD in cold_start.CONTENDERS


def test_an_unknown_contender_is_refused_before_any_process_starts():
    with pytest.raises(SystemExit, match="unknown \\['nope'\\]"):
        cold_start.main(["--tiny", "--device", "cpu", "--contenders", "flash_inductor,nope", "--no-write"])
