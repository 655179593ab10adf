"""benchmarks/e2e_models.py on CPU: every family builds, trains and infers, and the harness
records, summarises and plots both contenders. The compile itself is swapped for the eager model
here (Inductor's CPU compile of five models would take minutes); on a GPU the same cells compile."""

import json

import pytest
import torch

from benchmarks import e2e_models


def _eager(contender, model):
    return model


def test_every_family_trains_and_infers_on_cpu(tmp_path):
    records = e2e_models.main(["--tiny", "--seqs", "64", "--tokens", "128", "--device", "cpu", "--dtype", "fp32",
                               "--attn", "sdpa", "--out", str(tmp_path), "--rep-steps", "1"], compile_fn=_eager)
    assert {r["model"] for r in records} == set(e2e_models.MODELS)
    assert all(r["status"] == "ok" for r in records), [r.get("error") for r in records]
    for r in records:
        assert r["ms"] > 0 and r["first_call_s"] > 0
        assert torch.isfinite(torch.tensor(r["first_output"]))
    # Same model, same inputs, same (eager) function: the two contenders' first outputs agree, so
    # the summary's check of the result is live.
    rows = e2e_models.summarise(records)
    assert len(rows) == len(e2e_models.MODELS) * len(e2e_models.TASKS)
    assert all(row["output_rel_diff"] < 1e-5 for row in rows)
    written = list(tmp_path.glob("e2e_models_*.json"))
    assert len(written) == 1 and written[0].with_suffix(".png").exists()
    assert not list(tmp_path.glob("*.partial.jsonl"))  # removed once the JSON holds every record
    assert json.loads(written[0].read_text())["summary"] == rows


def test_bert_batches_carry_padding():
    spec = e2e_models.TINY_MODELS["bert"]
    inputs = e2e_models.make_batch(spec, 64, 4, "cpu", torch.float32)
    assert inputs["attention_mask"][0, -1] == 0 and inputs["attention_mask"][1, -1] == 1


def test_a_failing_contender_is_recorded_not_raised():
    def broken(contender, model):
        if contender == "flash_inductor":
            raise RuntimeError("no backend here")
        return model
    args = e2e_models.parse_args(["--tiny", "--tokens", "64", "--device", "cpu", "--dtype", "fp32", "--rep-steps", "1"])
    records = e2e_models.run_cell("gpt2", e2e_models.TINY_MODELS["gpt2"], 32, "sdpa", "infer", args, broken)
    assert [r["status"] for r in records] == ["ok", "error"]
    assert "no backend here" in records[1]["error"]
    assert "speedup" not in e2e_models.summarise(records)[0]


def test_unknown_model_names_the_flag():
    with pytest.raises(SystemExit, match="--models"):
        e2e_models.plan(e2e_models.parse_args(["--models", "llama-e32"]))
