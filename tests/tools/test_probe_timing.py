"""benchmarks.probe_timing: the timing-reproducibility probe runs and writes every kind of sample."""

from __future__ import annotations

import json
import re

import pytest

from benchmarks import probe_timing as probe
from helpers import DEVICE, ON_CUDA


@pytest.mark.parametrize("mode", ["fwd", "bwd"])
def test_probe_writes_every_kind_with_its_samples(mode, tmp_path, capsys):
    argv = ["--quick", "--device", DEVICE, "--out", str(tmp_path), "--tag", "smoke", "--mode", mode]
    if ON_CUDA:
        argv += ["--providers", "ours,flash"]
    assert probe.main(argv) == 0
    (written,) = tmp_path.glob("probe_timing_*_smoke.json")
    results = json.loads(written.read_text())["results"]
    assert {r["kind"] for r in results} == set(probe.KINDS)
    assert {r["mode"] for r in results} == {mode}
    for r in results:
        assert "error" not in r, r  # on CUDA: the backward must be capturable into a CUDA graph
        assert len(r["samples_ms"]) == 3 and all(s > 0 for s in r["samples_ms"])
        assert r["min"] <= r["median"] <= r["max"] and r["max_over_min"] >= 1.0
    assert "fresh_inputs" in capsys.readouterr().out


def test_a_failing_kind_is_recorded_and_the_others_still_run(tmp_path, capsys, monkeypatch):
    real_sample = probe._sample

    def sample(kind, *args):
        if kind == "cudagraph":
            raise RuntimeError("operation failed due to a previous error during capture\nmore detail")
        return real_sample(kind, *args)

    monkeypatch.setattr(probe, "_sample", sample)
    assert probe.main(["--quick", "--device", "cpu", "--out", str(tmp_path), "--tag", "fail"]) == 0
    (written,) = tmp_path.glob("probe_timing_*_fail.json")
    results = json.loads(written.read_text())["results"]
    failed = [r for r in results if "error" in r]
    assert [r["kind"] for r in failed] == ["cudagraph"]
    assert failed[0]["error"] == "RuntimeError: operation failed due to a previous error during capture"
    assert {r["kind"] for r in results if "samples_ms" in r} == set(probe.KINDS) - {"cudagraph"}
    assert re.search(r"\bcudagraph +failed: RuntimeError", capsys.readouterr().out)
