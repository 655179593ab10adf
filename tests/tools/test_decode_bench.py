"""benchmarks/decode.py on CPU: the attention grid records every contender of every cell (SDPA
backends that do not run on a CPU as errors), summarises, plots and writes; the generate part
runs both contenders and compares their tokens: the plain one eager (Inductor's CPU compile would
take minutes), ours through the benchmark's own flash_inductor compile with Inductor's C++ code
generation skipped (``model_zoo.inductor_codegen_skipped``), so our rewrite and op generate."""

import json

import pytest
import torch

from benchmarks import decode
from model_zoo import inductor_codegen_skipped

TINY = dict(batches="1,2", seqs="40,600", query_rows="1,3", heads_q=4, heads_kv=1, head_dim=16, dtype="fp32",
            device="cpu", rep_steps=1)


def tiny(*extra, **overrides) -> list[str]:
    """The tiny grid's command line, with ``overrides`` of its flags and ``extra`` arguments."""
    flags = {**TINY, **overrides}
    return [arg for name, value in flags.items() for arg in (f"--{name.replace('_', '-')}", str(value))] + list(extra)


def test_attention_grid_records_summarises_and_writes(tmp_path):
    records = decode.main(tiny("--contenders", "ours,flash,cudnn,efficient", "--out", str(tmp_path)))
    assert len(records) == 2 * 2 * 2 * 4
    ours = [r for r in records if r["contender"] == "ours"]
    assert all(r["status"] == "ok" and r["ms"] > 0 for r in ours), [r.get("error") for r in ours]
    # Every contender that ran computed the same attention as the first (ours).
    assert all(r["max_abs_diff_vs_first"] < 1e-4 for r in records if r["status"] == "ok")
    rows = decode.summarise(records)
    assert len(rows) == 8 and all("ours_ms" in row for row in rows)
    written = list(tmp_path.glob("decode_*.json"))
    assert len(written) == 1 and written[0].with_suffix(".png").exists()
    assert not list(tmp_path.glob("*.partial.jsonl"))
    assert json.loads(written[0].read_text())["summary"] == json.loads(json.dumps(rows))


def test_cache_mask_and_time_budget(tmp_path):
    records = decode.main(tiny("--contenders", "ours,flash", "--mask", "cache", "--time-budget", "1e-9",
                               "--no-write"))
    assert {r["status"] for r in records} == {"skipped"} and len(records) == 2 * 8
    records = decode.main(tiny("--contenders", "ours", "--mask", "cache", "--no-write", batches=2, seqs=40))
    assert [r["status"] for r in records] == ["ok", "ok"]


def test_summary_ratios():
    records = [dict(batch=1, seq_k=8192, seq_q=1, contender=c, status="ok", ms=ms)
               for c, ms in (("ours", 1.0), ("flash", 2.0), ("cudnn", 1.5), ("flex", 3.0))]
    records.append(dict(batch=1, seq_k=8192, seq_q=1, contender="efficient", status="error", error="x"))
    (row,) = decode.summarise(records)
    assert row["best_sdpa"] == "cudnn" and row["vs_best_sdpa"] == pytest.approx(1.5)
    assert row["vs_flex"] == pytest.approx(3.0) and "efficient_ms" not in row


def test_generate_part_runs_both_contenders(tmp_path, fresh_compiler):
    pytest.importorskip("transformers")
    from flash_inductor.passes.report import REPORTS

    logits = {}

    def ours_without_codegen(contender, model):
        """The plain contender eager, ours compiled by the benchmark; each forward's logits kept."""
        if contender != "compile":
            model = decode.compile_forward(contender, model, None)
        forward = model.forward

        def recorded(*args, **kwargs):
            out = forward(*args, **kwargs)
            logits.setdefault(contender, []).append(out.logits.detach().clone())
            return out
        model.forward = recorded
        return model

    with inductor_codegen_skipped():
        records = decode.main(["--part", "generate", "--tiny", "--gen-batch", "2", "--prompt", "5", "--new-tokens",
                               "3", "--cache-len", "16", "--dtype", "fp32", "--device", "cpu", "--out", str(tmp_path)],
                              compile_fn=ours_without_codegen)
    assert [r["contender"] for r in records] == list(decode.GENERATE_CONTENDERS)
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 for r in records), records
    # Ours generated through our attention (the prefill's and the decode steps' compiles): its
    # greedy tokens are eager's, and so is every step's logits, element-wise at fp32's tolerance
    # (the tokens alone would not see a small error: a tiny random model's argmax has wide margins).
    assert sum(r.rewritten for report in REPORTS for r in report.records) >= 2, "\n".join(map(str, REPORTS))
    assert all(r["tokens_equal_fraction"] == 1.0 for r in records)
    plain, ours = logits["compile"], logits["flash_inductor"]
    assert len(plain) == len(ours) > 0
    for step, (a, b) in enumerate(zip(plain, ours)):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=lambda m: f"forward call {step}: {m}")
    assert len(list(tmp_path.glob("decode_generate_*.json"))) == 1


def test_unknown_contender_names_the_flag():
    with pytest.raises(SystemExit):
        decode.parse_args(["--contenders", "ours,fa3"])


@pytest.mark.tools_full
def test_flex_contender_with_the_cache_mask():
    """Compiled Flex (Inductor's CPU compile: tens of seconds) with GQA and the cache BlockMask
    computes what ours does."""
    records = decode.main(tiny("--contenders", "ours,flex", "--mask", "cache", "--no-write", batches=2, seqs=256,
                               query_rows=3))
    assert [r["status"] for r in records] == ["ok", "ok"], records
    assert records[1]["max_abs_diff_vs_first"] < 1e-5
