"""benchmarks/train_stability.py on CPU: the task it generates; the verdict, which compares with
fp32 only once fp32 has learned; and one tiny run of fp32 eager, fp16 eager (autocast +
GradScaler) and fp16 compiled through flash_inductor.backend that writes its JSON and PNG. The
fp16 eager run must hit the overflow the script is about (every step non-finite, the scaler
backing off) and the compiled run must not. Two steps learn nothing, so that run must say it
checked finiteness only. The full form (-m tools_full) runs the --quick config, which must learn
and compare."""

from __future__ import annotations

import importlib.util
import json
import math
import pathlib
import sys

import pytest
import torch

_SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "train_stability.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("train_stability", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_task_answers_are_the_bound_values(script):
    task = script.Task(seq=96, pairs=5, context=24)
    tokens, targets = task.batch(3, step=7, seed=0, device="cpu")
    assert tokens.shape == targets.shape == (3, 96) and tokens.max() < task.vocab
    answered = targets != -100
    assert answered.sum(1).tolist() == [12 + 5] * 3  # 12 context pairs, then every key once
    for b in range(3):
        binding = {int(tokens[b, i]): int(tokens[b, i + 1]) for i in range(0, 24, 2)}
        for i in answered[b].nonzero().flatten().tolist():
            assert int(targets[b, i]) == int(tokens[b, i + 1])  # the logits at a key predict its value
            if int(tokens[b, i]) in binding:
                assert binding[int(tokens[b, i])] == int(targets[b, i])  # one value per key
        assert (tokens[b, 24:86] >= task.keys + task.values).all()  # the gap is filler only
    assert task.query_mask().nonzero().flatten().tolist() == list(range(86, 96, 2))
    assert task.gap == 62
    assert 0 < task.floor() < math.log(task.values)
    assert torch.equal(task.batch(3, 7, 0, "cpu")[0], tokens)  # same step, same data


@pytest.mark.usefixtures("fresh_compiler")
def test_smoke_run_writes_json_and_plot(script, tmp_path, capsys):
    code = script.main(["--quick", "--device", "cpu", "--steps", "2", "--seq", "48", "--width", "32",
                        "--layers", "1", "--pairs", "4", "--context", "16", "--runs", "fp32_eager,fp16_eager,fp16_flash",
                        "--out", str(tmp_path), "--tag", "smoke", "--no-progress"])
    printed = capsys.readouterr().out
    # 2 steps learn nothing: no comparison may be claimed, only finiteness.
    assert code == script.NOT_COMPARED, printed
    assert "within 2% of fp32" not in printed
    assert "not compared with fp32" in printed and "checked finiteness only: fp16_flash finite" in printed
    (json_path,) = tmp_path.glob("train_stability_*_smoke.json")
    runs = json.loads(json_path.read_text())["runs"]
    assert set(runs) == {"fp32_eager", "fp16_eager", "fp16_flash"}
    assert all(r["error"] is None for r in runs.values()), {k: r["error"] for k, r in runs.items()}
    eager, flash, fp32 = runs["fp16_eager"], runs["fp16_flash"], runs["fp32_eager"]
    # q . k ~ 256^2 = 65536 > 65504: the fp16 QK^T overflows, every step is skipped, the scale halves.
    assert eager["nonfinite_steps"] == [0, 1] and eager["final_loss"] is None
    assert eager["scale"][1] < eager["scale"][0]
    assert flash["nonfinite_steps"] == [] and flash["rewritten_sites"] == 1
    assert all(v is not None and math.isfinite(v) for v in flash["loss"] + fp32["loss"])
    assert abs(flash["loss"][0] - fp32["loss"][0]) < 0.05 * fp32["loss"][0]  # same weights, same first batch
    assert json_path.with_suffix(".png").stat().st_size > 10_000


def _log(script, name, final_loss, nonfinite_steps=()):
    return script.RunLog(name, loss=[final_loss], final_loss=final_loss, nonfinite_steps=list(nonfinite_steps))


def test_verdict_compares_only_with_a_baseline_that_learned(script):
    task = script.Task(seq=128, pairs=4, context=64)
    chance = math.log(task.values)
    learned = script.learned_below(task)
    assert task.floor() < learned < chance

    # fp32 near chance: a flash run within 2% of it learned nothing either, and no "yes" is printed.
    logs = {"fp32_eager": _log(script, "fp32_eager", chance + 0.3), "fp16_flash": _log(script, "fp16_flash", chance + 0.3)}
    result = script.verdict(logs, task)
    assert not result["compared"] and "within_2pct" not in result["runs"]["fp16_flash"]
    assert "yes" not in " ".join(script.verdict_lines(result))
    assert script.exit_code(result) == script.NOT_COMPARED

    # fp32 learned: a flash run is compared, and one that stayed at chance fails.
    logs["fp32_eager"] = _log(script, "fp32_eager", 0.9)
    logs["bf16_flash"] = _log(script, "bf16_flash", 0.91)
    result = script.verdict(logs, task)
    assert result["compared"] and result["runs"]["bf16_flash"]["within_2pct"]
    assert not result["runs"]["fp16_flash"]["within_2pct"]
    assert script.verdict_lines(result) == ["flash_inductor within 2% of fp32: fp16_flash NO, bf16_flash yes"]
    assert script.exit_code(result) == 1
    del logs["fp16_flash"]
    assert script.exit_code(script.verdict(logs, task)) == 0

    # No fp32 run, or a flash run with a non-finite loss: never a pass. A gradient overflow the
    # GradScaler skipped is its job, not a failure.
    no_baseline = script.verdict({"bf16_flash": logs["bf16_flash"]}, task)
    assert not no_baseline["compared"] and "no fp32_eager run" in script.verdict_lines(no_baseline)[0]
    logs["bf16_flash"] = _log(script, "bf16_flash", 0.91, nonfinite_steps=[3])
    assert script.exit_code(script.verdict(logs, task)) == 0
    logs["bf16_flash"].loss = [None, 0.91]
    assert script.exit_code(script.verdict(logs, task)) == 1


@pytest.mark.tools_full
@pytest.mark.usefixtures("fresh_compiler")
def test_quick_config_learns_and_compares(script, tmp_path, capsys):
    """The README's CPU command: fp32 must learn, so that the 2% comparison is a real one."""
    code = script.main(["--quick", "--device", "cpu", "--runs", "fp32_eager,fp16_flash", "--out", str(tmp_path),
                        "--no-progress"])
    printed = capsys.readouterr().out
    assert "flash_inductor within 2% of fp32: fp16_flash yes" in printed, printed
    assert code == 0
