"""benchmarks/e2e_models.py on CPU: every family builds, trains and infers, and the harness
records, summarises and plots both contenders. Inductor's CPU code generation for five models would
take minutes, so the plain contender runs the eager model and ours runs the benchmark's own
``compile_with`` (flash_inductor's backend, its rewrite and our attention op) with Inductor's C++
code generation skipped (``model_zoo.inductor_codegen_skipped``); on a GPU the same cells compile."""

import json

import pytest
import torch

from benchmarks import e2e_models
from model_zoo import inductor_codegen_skipped


def _eager(contender, model):
    return model


def _ours_without_codegen(contender, model):
    """The plain contender eager, ours through the benchmark's flash_inductor backend."""
    return model if contender == "compile" else e2e_models.compile_with(contender, model)


def test_every_family_trains_and_infers_on_cpu(tmp_path, fresh_compiler):
    from flash_inductor.passes.report import REPORTS

    with inductor_codegen_skipped():
        records = e2e_models.main(["--tiny", "--seqs", "64", "--tokens", "128", "--device", "cpu", "--dtype", "fp32",
                                   "--attn", "sdpa", "--out", str(tmp_path), "--rep-steps", "1"],
                                  compile_fn=_ours_without_codegen)
    assert {r["model"] for r in records} == set(e2e_models.MODELS)
    assert all(r["status"] == "ok" for r in records), [r.get("error") for r in records]
    for r in records:
        assert r["ms"] > 0 and r["first_call_s"] > 0
        assert torch.isfinite(torch.tensor(r["first_output"]))
    # Ours rewrote every family's attention, so the comparison below is of our op against eager.
    # Ours rewrote the attention of every cell's compile, so the comparison below is of our op against eager.
    rewriting = [report for report in REPORTS if any(r.rewritten for r in report.records)]
    assert len(rewriting) >= len(e2e_models.MODELS) * len(e2e_models.TASKS), "\n".join(map(str, REPORTS))
    # Same model, same inputs: ours' first outputs agree with eager's element-wise, within fp32's tolerance.
    rows = e2e_models.summarise(records)
    assert len(rows) == len(e2e_models.MODELS) * len(e2e_models.TASKS)
    assert all(row["output_tolerance"] == e2e_models.OUTPUT_TOLERANCE["fp32"] for row in rows)
    # The tiny fp32 models here agree to a few 1e-7 of their largest logit: 1e-5 leaves margin and
    # still sees a 1 % error in the softmax scale (1e-4 in the Llama logits).
    assert all(row["output_within_tolerance"] and row["output_max_rel_diff"] <= 1e-5 for row in rows), rows
    written = list(tmp_path.glob("e2e_models_*.json"))
    assert len(written) == 1 and written[0].with_suffix(".png").exists()
    assert not list(tmp_path.glob("*.partial.jsonl"))  # removed once the JSON holds every record
    assert json.loads(written[0].read_text())["summary"] == rows


def test_outputs_compare_element_wise_at_the_dtype_tolerance():
    """A wrong output with the plain output's mean fails; the tolerance is the dtype's, relative to
    the output's largest magnitude (a mean or an element near zero does not inflate it)."""
    plain = torch.linspace(-1, 1, 101)  # mean 0
    same = e2e_models.compare_outputs(plain, plain + 5e-5, "fp32")
    assert same["output_within_tolerance"] and same["output_max_abs_diff"] == pytest.approx(5e-5, rel=1e-3)
    assert same["output_max_rel_diff"] == pytest.approx(5e-5, rel=1e-3)
    assert not e2e_models.compare_outputs(plain, plain.flip(0), "fp32")["output_within_tolerance"]  # same mean
    assert not e2e_models.compare_outputs(plain, plain + 5e-3, "fp32")["output_within_tolerance"]
    assert e2e_models.compare_outputs(plain.bfloat16(), (plain + 5e-3).bfloat16(), "bf16")["output_within_tolerance"]
    assert not e2e_models.compare_outputs(plain, plain[:-1], "fp32")["output_within_tolerance"]
    nan = plain.clone()
    nan[3] = float("nan")
    assert not e2e_models.compare_outputs(plain, nan, "fp32")["output_within_tolerance"]
    assert e2e_models.compare_outputs(nan, nan.clone(), "fp32")["output_within_tolerance"]
    assert e2e_models.compare_outputs(torch.tensor(2.5), torch.tensor(2.5001), "fp32")["output_within_tolerance"]


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


def test_precompile_warms_every_contender_of_every_cell_before_timing(tmp_path, monkeypatch, capsys):
    """--precompile hands one item per (cell, contender) to benchmarks.precompile's workers,
    longest sequences first, before any cell is timed; a worker's item runs that contender's step."""
    from benchmarks import precompile

    order = []
    warmed = []

    def warm(items, workers, *, deadline=None, device="cuda", **_):
        order.append("warm")
        warmed.extend(items)
        return dict(items=len(items), workers=workers, compiled=len(items), failed=0, errors=[], stopped=False,
                    seconds=0.0)
    monkeypatch.setattr(precompile, "warm", warm)
    real_run_cell = e2e_models.run_cell

    def run_cell(*args, **kwargs):
        order.append("cell")
        return real_run_cell(*args, **kwargs)
    monkeypatch.setattr(e2e_models, "run_cell", run_cell)
    records = e2e_models.main(["--tiny", "--models", "gpt2,vit", "--seqs", "32,64", "--tokens", "128", "--device",
                               "cpu", "--dtype", "fp32", "--attn", "sdpa", "--tasks", "infer", "--out", str(tmp_path),
                               "--rep-steps", "1", "--precompile", "3"], compile_fn=_eager)
    assert order[0] == "warm" and order.count("cell") == 4
    assert all(r["status"] == "ok" for r in records)
    assert len(warmed) == 4 * len(e2e_models.CONTENDERS)
    assert {(it["model"], it["seq"], it["contender"]) for it in warmed} == {
        (m, s, c) for m in ("gpt2", "vit") for s in (32, 64) for c in e2e_models.CONTENDERS}
    assert [it["seq"] for it in warmed] == sorted((it["seq"] for it in warmed), reverse=True)
    assert "precompile: 8 of 8 cells compiled by 3 workers" in capsys.readouterr().out
    # A worker's side of one item: the contender's model is built, compiled and stepped once.
    compiled = []
    monkeypatch.setattr(e2e_models, "compile_with",
                        lambda contender, model, schedule=None: compiled.append(contender) or model)
    precompile.compile_item(warmed[0], "cpu")  # the worker hands the item to the module that planned it
    assert compiled == [warmed[0]["contender"]]
    assert precompile.label(warmed[0]).startswith(f"{warmed[0]['model']} sdpa infer seq=64")


def test_cold_and_precompile_exclude_each_other():
    with pytest.raises(SystemExit, match="choose one"):
        e2e_models.main(["--cold", "--precompile", "2", "--tiny", "--device", "cpu"], compile_fn=_eager)


def test_mode_reaches_both_contenders_compiles_and_the_records(monkeypatch):
    """--mode is torch.compile's mode for both contenders (our backend's and plain Inductor's),
    in the timed pass and in a precompile worker's item, and each record names it."""
    seen = []

    def fake_compile(model, *, backend="inductor", mode=None):
        seen.append((backend == "inductor", mode))
        return model
    monkeypatch.setattr(torch, "compile", fake_compile)
    args = e2e_models.parse_args(["--tiny", "--tokens", "64", "--device", "cpu", "--dtype", "fp32", "--rep-steps", "1",
                                  "--mode", "reduce-overhead"])
    compile_fn = e2e_models._compile_fn(args.schedule, args.mode)
    records = e2e_models.run_cell("gpt2", e2e_models.TINY_MODELS["gpt2"], 32, "sdpa", "infer", args, compile_fn)
    assert [r["status"] for r in records] == ["ok", "ok"]
    assert [r["mode"] for r in records] == ["reduce-overhead"] * 2
    assert seen == [(True, "reduce-overhead"), (False, "reduce-overhead")]
    item = e2e_models.precompile_items([("gpt2", e2e_models.TINY_MODELS["gpt2"], 32, "sdpa", "infer")], args)[1]
    seen.clear()
    e2e_models.compile_item(item, "cpu")
    assert seen == [(item["contender"] == "compile", "reduce-overhead")]
    assert e2e_models._compile_fn(None, None) is e2e_models.compile_with
    with pytest.raises(SystemExit):
        e2e_models.parse_args(["--mode", "fastest"])
