"""benchmarks/variants.py on CPU: its packs and its argument errors (the timed steps need a GPU)."""

import pytest

from benchmarks import variants


@pytest.mark.parametrize("total", [16384, 65536, 1000])
def test_document_lengths_fill_the_pack_within_bounds(total):
    lengths = variants.document_lengths(total, seed=total)
    assert sum(lengths) == total
    assert all(128 <= n <= 8192 for n in lengths[:-1]) or total < 128
    assert len(lengths) > 1 or total <= 8192
    assert variants.document_lengths(total, seed=total) == lengths  # seeded


@pytest.mark.parametrize("argv, message", [
    (["--head-dims", "96"], "--head-dims takes"),
    (["--packs", "abc"], "comma-separated integers"),
    (["--seqs", "64"], "at least 128"),
    (["--part", "packed", "--smoke"], "--smoke covers the hf_step part only"),
])
def test_bad_arguments_are_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        variants.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_ratios_pair_each_contender_with_ours(tmp_path):
    records = [
        dict(part="packed", pack=16384, head_dim=64, provider="ours", causal=True, status="ok", ms=2.0),
        dict(part="packed", pack=16384, head_dim=64, provider="flex", causal=True, status="ok", ms=3.0),
        dict(part="packed", pack=16384, head_dim=64, provider="sdpa-nested", causal=False, status="ok", ms=5.0),
        dict(part="packed", pack=16384, head_dim=64, provider="ours-noncausal", causal=False, status="ok", ms=4.0),
        dict(part="overhead", seq=4096, head_dim=64, mode="fwd", variant="plain", status="ok", ms=1.0),
        dict(part="overhead", seq=4096, head_dim=64, mode="fwd", variant="sinks", status="ok", ms=1.04),
        dict(part="overhead", seq=4096, head_dim=64, mode="fwd", variant="flex", status="ok", ms=2.0),
        dict(part="overhead", seq=4096, head_dim=64, mode="fwd", variant="flex+softcap", status="ok", ms=2.6),
        dict(part="hf_step", pack=16384, provider="packed-position-ids", status="ok", ms=10.0),
        dict(part="hf_step", pack=16384, provider="dense-block-diagonal", status="ok", ms=15.0),
        dict(part="hf_step", pack=16384, provider="packed-hf-mask", status="ok", ms=13.0),
    ]
    lines = variants.ratios(records)
    assert any("flex" in line and "ours 1.50x" in line for line in lines)
    # SDPA on nested tensors has no causal mask: it meets ours run without one, and only that.
    nested = [line for line in lines if "sdpa-nested" in line]
    assert len(nested) == 1 and "ours-noncausal" in nested[0] and "ours 1.25x" in nested[0]
    assert not any("flex" in line and "noncausal" in line for line in lines)
    assert any("sinks" in line and "1.040x plain" in line for line in lines)
    # Flex's cap is measured against Flex without it, never against our plain kernel.
    capped_flex = [line for line in lines if "flex+softcap" in line]
    assert len(capped_flex) == 1 and "1.300x flex" in capped_flex[0]
    assert not any(line.split()[4] == "flex" for line in lines if line.startswith("overhead"))
    assert any("hf_step" in line and "1.50x the dense-block-diagonal" in line for line in lines)
    assert any("hf_step" in line and "1.30x the packed-hf-mask" in line for line in lines)
    pytest.importorskip("matplotlib")
    assert variants.plot(records, tmp_path / "variants.png").stat().st_size > 0


def test_hf_step_smoke_runs_on_cpu(capsys):
    """--smoke: the HF step's three contenders once on a tiny Llama on the CPU; the packed one hands
    attention no mask, the other two a mask, and all three agree (checked inside)."""
    pytest.importorskip("transformers")
    assert variants.main(["--part", "hf_step", "--smoke"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    assert "packed-position-ids" in lines[0] and "False" not in lines[0]
    assert all("True" not in line for line in lines[1:])


def test_a_part_run_alone_keeps_the_other_parts_of_the_days_file(tmp_path):
    import json

    earlier = dict(header=dict(gpu="NVIDIA H100 80GB HBM3", command="variants --part all", git_commit="abc",
                               date="2026-12-07T10:00:00"),
                   records=[dict(part="packed", provider="ours", ms=2.0), dict(part="overhead", variant="plain", ms=1.0)])
    path = tmp_path / "variants_x.json"
    path.write_text(json.dumps(earlier))
    env = dict(gpu="NVIDIA H100 80GB HBM3")
    new = [dict(part="overhead", variant="plain", ms=0.9)]
    records, kept = variants.with_earlier_parts(str(path), new, env)
    # The part re-run replaces its records; the part not run stays, with where it came from.
    assert records == new + [earlier["records"][0]]
    assert kept == {"kept_parts": {"packed": dict(command="variants --part all", git_commit="abc",
                                                  date="2026-12-07T10:00:00")}}
    # Another GPU's file, no file, or an unreadable one: this run's records alone.
    assert variants.with_earlier_parts(str(path), new, dict(gpu="NVIDIA H200")) == (new, {})
    assert variants.with_earlier_parts(str(tmp_path / "none.json"), new, env) == (new, {})
    (tmp_path / "bad.json").write_text("{")
    assert variants.with_earlier_parts(str(tmp_path / "bad.json"), new, env) == (new, {})
