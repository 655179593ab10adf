"""benchmarks.bench_attention and benchmarks.plot_results: time budget, partial records, resume, merging
and the issue-6 target report. No GPU: run_case is replaced by a fake that returns a measurement."""

from __future__ import annotations

import importlib
import json
import pathlib
import time

import pytest


def _load(name):
    return importlib.import_module(f"benchmarks.{name}")


@pytest.fixture(scope="module")
def bench():
    return _load("bench_attention")


@pytest.fixture(scope="module")
def common():
    return _load("common")


@pytest.fixture(scope="module")
def plots():
    return _load("plot_results")


def _args(bench, *extra):
    return bench.parse_args(["--dtypes", "bf16", "--head-dims", "128", "--seqs", "1024,4096", "--causal", "no",
                             "--modes", "fwd,fwd_bwd", "--providers", "ours,flash", *extra])


def _fake_run_case(speed):
    def run_case(case, provider, args, device="cuda", telemetry=None):
        return dict(section="attention", provider=provider, batch=1, heads=16, status="ok", ms=1.0,
                    tflops=speed[provider], **case)
    return run_case


def test_time_budget_records_the_rest_as_skipped_and_partial_file_has_each_measurement(bench, tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "run_case", _fake_run_case({"ours": 400.0, "flash": 300.0}))
    ticks = iter(range(0, 1000, 10))  # each clock() call advances 10 s
    args = _args(bench, "--time-budget", "25")
    partial = tmp_path / "bench_x.partial.jsonl"
    records = bench.run_all(args, partial_path=str(partial), clock=lambda: next(ticks))
    assert len(records) == 8  # 4 cells x 2 providers, every one recorded
    measured = [r for r in records if r["status"] == "ok"]
    skipped = [r for r in records if r["status"] == "skipped"]
    assert measured and skipped and len(measured) + len(skipped) == 8
    assert all(r["error"] == "--time-budget spent" for r in skipped)
    lines = [json.loads(x) for x in partial.read_text().splitlines()]
    assert [(r["provider"], r["seq"], r["mode"]) for r in lines] == \
        [(r["provider"], r["seq"], r["mode"]) for r in measured]


def test_resume_skips_measured_cells(bench, tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "run_case", _fake_run_case({"ours": 400.0, "flash": 300.0}))
    first = bench.run_all(_args(bench, "--seqs", "1024"), partial_path=str(tmp_path / "a.partial.jsonl"))
    assert len(first) == 4
    args = _args(bench, "--resume", str(tmp_path / "a.partial.jsonl"))
    second = bench.run_all(args, partial_path=str(tmp_path / "b.partial.jsonl"))
    assert {r["seq"] for r in second} == {4096} and len(second) == 4


def test_fresh_partial_path_never_reuses_an_existing_file(bench, tmp_path):
    stem = str(tmp_path / "bench_gpu_20261130")
    first = bench.fresh_partial_path(stem)
    assert first.endswith(".partial.jsonl")
    pathlib.Path(first).write_text("{}\n")
    assert bench.fresh_partial_path(stem).endswith(".partial-2.jsonl")


def _rec(provider, tflops, seq=4096, mode="fwd", status="ok", e=128, causal=False, dtype="bf16"):
    return dict(section="attention", provider=provider, dtype=dtype, head_dim=e, causal=causal, seq=seq,
                mode=mode, status=status, tflops=tflops if status == "ok" else None)


def test_merge_prefers_measured_records_then_the_later_file(plots):
    early = [_rec("ours", 400.0), _rec("flex", None, status="unsupported")]
    late = [_rec("ours", 410.0), _rec("flex", None, status="skipped"), _rec("flash", 300.0)]
    merged = {r["provider"]: r for r in plots.merge_records([early, late])}
    assert merged["ours"]["tflops"] == 410.0
    assert merged["flash"]["tflops"] == 300.0
    assert merged["flex"]["status"] == "skipped"
    assert {r["provider"]: r for r in plots.merge_records([late, [_rec("ours", 0, status="skipped")]])}[
        "ours"]["tflops"] == 410.0


def test_target_report_counts_met_missed_and_unmeasured_cells(plots):
    records = [
        _rec("ours", 500.0), _rec("flash", 340.0), _rec("flex", 480.0), _rec("cudnn", 600.0),
        _rec("ours", 300.0, mode="fwd_bwd"), _rec("flash", 310.0, mode="fwd_bwd"),
        _rec("flex", 400.0, mode="fwd_bwd"), _rec("cudnn", None, mode="fwd_bwd", status="unsupported"),
        # outside the cuDNN target's scope (seq < 2k) and outside every target (fp32)
        _rec("ours", 200.0, seq=1024), _rec("cudnn", 400.0, seq=1024), _rec("flash", 100.0, seq=1024),
        _rec("ours", 1.0, dtype="fp32"), _rec("flash", 500.0, dtype="fp32"),
    ]
    rows, lines = plots.target_report(records)
    by = {(r["anchor"], r["mode"], r["seq"]): r for r in rows}
    assert by[("flash", "fwd", 4096)]["met"] and by[("flex", "fwd", 4096)]["met"]
    assert not by[("cudnn", "fwd", 4096)]["met"]  # 500 / 600 < 1.0
    assert by[("cudnn", "fwd", 4096)]["ratio"] == pytest.approx(500 / 600)
    assert not by[("flash", "fwd_bwd", 4096)]["met"] and not by[("flex", "fwd_bwd", 4096)]["met"]
    assert ("cudnn", "fwd", 1024) not in by and ("cudnn", "fwd_bwd", 4096) not in by
    assert all(r["dtype"] != "fp32" for r in rows)
    text = "\n".join(lines)
    assert "ours/cudnn fwd >= 1.0: 0/1 cells met" in text
    assert "ours/cudnn fwd_bwd: no cell measured for both" in text
    assert "ours/flash fwd >= 1.0: 2/2 cells met" in text


def test_target_table_summarises_each_target_by_head_dim(plots):
    records = [
        _rec("ours", 500.0), _rec("flash", 340.0), _rec("flex", 520.0),  # E 128, seq 4k: wins FA2, misses Flex
        _rec("ours", 300.0, seq=1024), _rec("flash", 200.0, seq=1024), _rec("flex", 200.0, seq=1024),
        _rec("ours", 90.0, e=64), _rec("flash", 100.0, e=64),  # E 64: a miss, no Flex run
        _rec("ours-fast", 600.0), _rec("flash", 340.0), _rec("flex", 520.0),
    ]
    text = plots.target_table(records)
    lines = text.splitlines()
    assert lines[0] == "| ours | E = 64 | E = 128 |"
    assert "| forward ≥ 1.0× FA2 | 0/1, 0.90× (0.90–0.90) | 2/2, 1.49× (1.47–1.50) |" in lines
    assert "| forward ≥ 1.0× Flex |  | 1/2, 1.23× (0.96–1.50) |" in lines
    assert not any("cuDNN" in x for x in lines)  # no cuDNN record: that target's row is left out
    at_4k = plots.target_table(records, min_seq=4096).splitlines()
    assert at_4k[0] == "| ours, seq ≥ 4096 | E = 64 | E = 128 |" and "| forward ≥ 1.0× Flex |  | 0/1, 0.96× (0.96–0.96) |" in at_4k
    assert "| forward ≥ 1.0× Flex | 1/1, 1.15× (1.15–1.15) |" in plots.target_table(records, ours="ours-fast")


def test_plot_results_merges_files_from_one_gpu_and_refuses_two(plots, tmp_path, capsys):
    header = dict(gpu="NVIDIA H200", torch="2.11.0", triton="3.6.0", date="2026-11-30T00:00:00")
    a, b, c = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    a.write_text(json.dumps(dict(header=header, results=[_rec("ours", 500.0), _rec("flash", 340.0)])))
    b.write_text(json.dumps(dict(header=dict(header, date="2026-11-30T01:00:00"),
                                 results=[_rec("ours", 450.0, dtype="fp16"), _rec("flash", 330.0, dtype="fp16")])))
    c.write_text(json.dumps(dict(header=dict(header, gpu="NVIDIA H100"), results=[])))
    pytest.importorskip("matplotlib")
    plots.main([str(a), str(b), "--out", str(tmp_path / "merged")])
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert len(merged["results"]) == 4 and merged["header"]["merged_from"] == ["a.json", "b.json"]
    assert merged["header"]["date"] == ["2026-11-30T00:00:00", "2026-11-30T01:00:00"]
    assert (tmp_path / "merged.png").stat().st_size > 10_000
    assert "ours/flash fwd >= 1.0: 2/2 cells met" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        plots.main([str(a), str(c), "--out", str(tmp_path / "bad")])


def test_ab_gives_after_over_before_per_provider_and_cell(plots, tmp_path, capsys):
    header = dict(gpu="NVIDIA H100 80GB HBM3")
    timed = lambda provider, ms, seq=4096: dict(_rec(provider, 1.0, seq=seq), ms=ms)  # noqa: E731
    before = [timed("ours", 2.0), timed("ours", 4.0, seq=16384), timed("cudnn", 2.0), _rec("flex", None, status="skipped")]
    after = [timed("ours", 1.9), timed("ours", 4.4, seq=16384), timed("cudnn", 2.02), timed("flex", 3.0)]
    ratios = plots.ab_ratios(before, after)
    assert set(ratios) == {"ours", "cudnn"}  # a cell measured on one side only has no ratio
    assert ratios["ours"]["cells"] == 2 and ratios["ours"]["min"] == pytest.approx(0.95)
    assert ratios["ours"]["max"] == pytest.approx(1.1) and ratios["ours"]["median"] == pytest.approx(1.025)
    assert ratios["ours"]["by_cell"]["bf16/128/False/16384/fwd"] == pytest.approx(1.1)
    a, b, other = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    a.write_text(json.dumps(dict(header=header, results=before)))
    b.write_text(json.dumps(dict(header=header, results=after)))
    other.write_text(json.dumps(dict(header=dict(gpu="NVIDIA H200"), results=after)))
    plots.main(["--ab", str(a), str(b), "--out", str(tmp_path / "ab")])
    written = json.loads((tmp_path / "ab.json").read_text())
    assert written["after_over_before"]["cudnn"]["median"] == pytest.approx(1.01)
    assert "ours" in capsys.readouterr().out
    for bad in ([str(a), str(other), "--out", str(tmp_path / "x")], [str(a), str(b)], [str(a), "--out", "x"]):
        with pytest.raises(SystemExit):
            plots.main(["--ab", *bad])


@pytest.fixture(scope="module")
def telemetry_module():
    return _load("gpu_telemetry")


def test_telemetry_keeps_only_this_gpus_readable_lines(telemetry_module):
    parse = telemetry_module.parse_sample
    assert parse("0, GPU-AB12-cd, 1980, 127.41, 39", "0") == (1980.0, 127.41, 39.0)
    assert parse("1, GPU-AB12-cd, 1980, 127.41, 39", "ab12-cd") == (1980.0, 127.41, 39.0)  # matched by UUID
    assert parse("1, GPU-ffff, 1980, 127.41, 39", "0") is None  # another GPU
    assert parse("0, GPU-AB12, 1980, [N/A], 39", "0") is None
    assert parse("garbage", "0") is None
    fields = telemetry_module.summarize([(1980.0, 100.0, 40.0), (1500.0, 690.0, 59.0), (1700.0, 680.0, 55.0)])
    assert fields == {"sm_mhz": 1700.0, "sm_mhz_min": 1500.0, "power_w": 680.0, "temp_c": 59.0}
    assert telemetry_module.summarize([]) == {}


def test_telemetry_windows_select_samples_by_time(telemetry_module, tmp_path):
    """A fake nvidia-smi prints a falling clock every 20 ms: a later window reads a lower clock."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/usr/bin/env python3\nimport sys, time\n"
                    "for i in range(400):\n"
                    "    print(f'0, GPU-x, {1980 - i}, 600, 50', flush=True); time.sleep(0.02)\n")
    fake.chmod(0o755)
    with telemetry_module.GpuTelemetry(period_ms=20, command=str(fake)) as t:
        t._identity = "0"  # this machine's torch may see no GPU; the fake prints GPU 0
        assert t.available
        first_start = t.now()
        time.sleep(0.3)
        first = t.window(first_start, t.now())
        time.sleep(0.3)
        second_start = t.now()
        time.sleep(0.3)
        second = t.window(second_start, t.now())
    assert first and second and second["sm_mhz"] < first["sm_mhz"] and first["power_w"] == 600.0
    assert telemetry_module.GpuTelemetry(command=None).window(0.0, 1.0) == {}  # no sampler: no fields


def test_heat_runs_the_step_for_the_asked_time_with_rare_syncs(common):
    now = [0.0]
    calls, syncs = [], []
    step = lambda: (calls.append(1), now.__setitem__(0, now[0] + 0.001))  # noqa: E731  1 ms a call
    common.heat(step, 500, clock=lambda: now[0], synchronize=lambda: syncs.append(1))
    assert 0.5 <= now[0] < 0.6 and len(calls) >= 500
    assert len(syncs) < 40  # batches grow to ~20 ms, not one sync a call
    now[0], calls[:] = 0.0, []
    common.heat(step, 0, clock=lambda: now[0], synchronize=lambda: None)
    assert calls == []


def test_clock_summary_reports_each_providers_median(bench):
    rows = [dict(section="attention", provider="ours", sm_mhz=m, power_w=w) for m, w in ((1500, 690), (1600, 680), (1900, 300))]
    rows.append(dict(section="attention", provider="flash", sm_mhz=1980, power_w=500))
    line = bench.clock_summary(rows)
    assert "ours 1600 MHz / 680 W" in line and "flash 1980 MHz / 500 W" in line
    assert bench.clock_summary([dict(section="attention", provider="ours")]) == ""


def test_heating_is_skipped_without_a_gpu(monkeypatch):
    """The tuner's and the harness's heat settles a GPU's clock; under the CPU interpreter it would
    only spend seconds per call, so without CUDA (and no explicit sync) it calls nothing."""
    import torch
    from flash_inductor.autotune.measure import run_for

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    calls = []
    run_for(lambda: calls.append(1), 500)
    assert calls == []


def test_busy_fraction_is_the_union_of_kernel_intervals_over_their_span():
    kernel_time = _load("kernel_time")
    assert kernel_time.busy_fraction([]) is None
    assert kernel_time.busy_fraction([(0.0, 10.0), (10.0, 20.0)]) == pytest.approx(1.0)
    # 6 of 12 us busy: a gap after each kernel, as when the host launches too slowly.
    assert kernel_time.busy_fraction([(0.0, 2.0), (4.0, 6.0), (10.0, 12.0)]) == pytest.approx(0.5)
    # Overlapping kernels (two streams) count once, in any order.
    assert kernel_time.busy_fraction([(5.0, 8.0), (0.0, 4.0), (3.0, 6.0), (9.0, 10.0)]) == pytest.approx(0.9)


def test_kernel_time_is_skipped_off_cuda():
    kernel_time = _load("kernel_time")
    calls = []
    assert kernel_time.gpu_busy(lambda: calls.append(1), 10, "cpu") == {}
    assert calls == []


def test_busy_summary_names_the_cells_with_an_idle_gpu(bench):
    def row(provider, busy, seq):
        return dict(section="attention", provider=provider, dtype="fp16", head_dim=64, causal=True, seq=seq,
                    mode="fwd", gpu_busy=busy)

    line = bench.busy_summary([row("ours", 0.62, 1024), row("ours", 0.97, 4096), row("flash", 0.99, 1024)])
    assert "ours 1/2 (fp16 E64 causal 1024 fwd 0.62)" in line and "flash 0/1" in line
    assert bench.busy_summary([dict(section="attention", provider="ours")]) == ""
    args = _args(bench, "--kernel-time")
    assert args.kernel_time and not _args(bench).kernel_time
    assert {"kernel_ms", "gpu_busy"} <= set(bench.CSV_FIELDS)


def test_kernel_time_summary_compares_the_kernels_alone(bench):
    """A cell lost on the timed ms but won on kernel time is a host-time loss; the summary counts
    cells by kernel_ms only, per anchor and mode, and says nothing without --kernel-time."""
    def row(provider, kernel_ms, seq, mode="fwd"):
        return dict(section="attention", provider=provider, dtype="bf16", head_dim=128, causal=True, seq=seq,
                    mode=mode, kernel_ms=kernel_ms)

    records = [row("ours", 0.22, 1024), row("flash", 0.28, 1024), row("ours", 1.0, 4096), row("flash", 0.8, 4096),
               row("ours", 1.2, 1024, "fwd_bwd"), row("flash", 1.3, 1024, "fwd_bwd"), row("cudnn", 0.2, 1024)]
    lines = bench.kernel_time_summary(records)
    assert "ours/flash fwd by kernel time alone: 1/2 cells >= 1.0, median 1.036" in lines
    assert "ours/flash fwd_bwd by kernel time alone: 1/1 cells >= 1.0, median 1.083" in lines
    assert "ours/cudnn fwd by kernel time alone: 0/1 cells >= 1.0, median 0.909" in lines
    assert len(lines) == 3
    assert bench.kernel_time_summary([dict(section="attention", provider="ours", mode="fwd")]) == []


def test_gpu_busy_sums_kernel_time_per_call_and_measures_the_gaps(monkeypatch):
    """The profiler's records stand in for a GPU: two steps of two kernels each, 1 us apart."""
    import types

    kernel_time = _load("kernel_time")

    def event(start, end):
        return types.SimpleNamespace(time_range=types.SimpleNamespace(start=start, end=end),
                                     device_time_total=end - start, name="k")

    events = [event(0, 3), event(3, 4), event(5, 8), event(8, 9)]
    monkeypatch.setattr(kernel_time, "_profile_kernels", lambda run, calls: events)
    result = kernel_time.gpu_busy(lambda: None, 2, "cuda")
    assert result["kernel_ms"] == pytest.approx(4e-3) and result["gpu_busy"] == pytest.approx(8 / 9)


def test_ours_compiled_runs_sdpa_through_our_backend(common):
    """The product path's provider: an SDPA call compiled with flash_inductor.backend, whose pass
    puts our op in its graph. It must reach our op, forward and backward, and match a float64
    SDPA within a small multiple of PyTorch's own fp32 error."""
    import torch

    torch._dynamo.reset()
    q, k, v = (torch.randn(2, 3, 24, 16, dtype=torch.float32, generator=torch.Generator().manual_seed(i))
               .requires_grad_(True) for i in range(3))
    dout = torch.randn(2, 3, 24, 16, generator=torch.Generator().manual_seed(3))
    with common.dynamo_limits():
        attn = common.make_attention("ours-compiled", True, 24, 24, "cpu")
        with torch.profiler.profile() as prof:
            out = attn(q, k, v)
            out.backward(dout)
    reached = {e.name for e in prof.events() if "flash_inductor::" in e.name}
    assert any("attention_forward" in name for name in reached), reached
    assert any("attention_backward" in name for name in reached), reached

    def sdpa_with_grads(dtype):
        leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
        result = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True)
        result.backward(dout.to(dtype))
        return [result] + [t.grad for t in leaves]

    exact, torch_fp32 = sdpa_with_grads(torch.float64), sdpa_with_grads(torch.float32)
    for ours, ref, theirs in zip([out, q.grad, k.grad, v.grad], exact, torch_fp32):
        torch_error = (theirs.detach().double() - ref).abs().max().item()
        ours_error = (ours.detach().double() - ref).abs().max().item()
        assert ours_error <= 4 * torch_error + 4 * torch.finfo(torch.float32).eps * ref.abs().max().item()


def test_kernel_time_plot_needs_both_providers_kernel_times(plots, tmp_path):
    def row(provider, ms, kernel_ms, mode="fwd"):
        return dict(section="attention", status="ok", provider=provider, dtype="bf16", head_dim=128, causal=True,
                    seq=1024, mode=mode, ms=ms, kernel_ms=kernel_ms)

    records = [row("ours", 0.33, 0.22), row("flash", 0.28, 0.28), row("ours", 1.4, 0.97, "fwd_bwd")]
    path = plots.plot_kernel_time(records, str(tmp_path / "k.png"))
    assert path and (tmp_path / "k.png").stat().st_size > 0
    assert plots.plot_kernel_time(records[2:], str(tmp_path / "none.png")) is None  # no anchor measured
    assert not (tmp_path / "none.png").exists()


# ----------------------------------------------------------------------------- benchmarks.precompile

@pytest.fixture(scope="module")
def precompile(bench):
    return _load("precompile")


def test_precompile_plans_one_item_per_compiling_provider_and_shape(bench, precompile):
    args = bench.parse_args(["--dtypes", "bf16", "--head-dims", "64,128", "--seqs", "1024,4096", "--causal", "yes",
                             "--modes", "fwd,fwd_bwd", "--providers", "ours,flash,flex,cudnn"])
    grid = [(c, p) for c in bench.build_grid(args) for p in args.providers]
    items = precompile.plan(grid, lambda case: bench.cell_shape(case, args.tokens))
    # SDPA's backends compile nothing; fwd and fwd_bwd of one shape share a single fwd_bwd item.
    assert len(items) == 2 * 2 * 2  # providers ours, flex x E 64, 128 x seq 1k, 4k
    assert {it["provider"] for it in items} == {"ours", "flex"}
    assert all(it["mode"] == "fwd_bwd" for it in items)
    assert [it["seq"] for it in items] == [4096] * 4 + [1024] * 4  # longest first
    first = items[0]
    assert (first["batch"], first["heads"]) == (16384 // 4096, 2048 // first["head_dim"])
    fwd_only = precompile.plan([({**c, "mode": "fwd"}, "ours") for c, _ in grid[:1]],
                               lambda case: bench.cell_shape(case, args.tokens))
    assert [it["mode"] for it in fwd_only] == ["fwd"]


def test_precompile_shards_cover_every_item_once(precompile):
    items = list(range(11))
    shards = [precompile.shard(items, i, 3) for i in range(3)]
    assert sorted(x for s in shards for x in s) == items
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


def _cpu_item(**over):
    item = dict(provider="ours", mode="fwd_bwd", batch=1, heads=2, dtype="fp32", head_dim=16, causal=True, seq=32)
    return {**item, **over}


def test_precompile_workers_run_every_item_and_report_failures(precompile):
    items = [_cpu_item(), _cpu_item(causal=False, mode="fwd"), _cpu_item(provider="no-such-provider", seq=48)]
    summary = precompile.warm(items, 2, device="cpu")
    assert summary["workers"] == 2 and summary["items"] == 3 and not summary["stopped"]
    assert summary["compiled"] == 2, summary
    # A failing item's error comes back named, and the other items still ran.
    assert summary["failed"] == 1 and summary["errors"][0].startswith("no-such-provider fp32 E16 causal=True seq=48")
    line = precompile.describe(summary)
    assert "2 of 3 cells compiled by 2 workers" in line and "1 failed" in line


def test_precompile_stops_its_workers_at_the_deadline(precompile):
    ticks = iter(range(0, 10_000, 100))
    summary = precompile.warm([_cpu_item(seq=32 + i) for i in range(4)], 2, device="cpu", deadline=50,
                              clock=lambda: next(ticks))
    assert summary["stopped"] and summary["compiled"] < 4
    assert "stopped at the time budget" in precompile.describe(summary)


def test_bench_runs_precompile_before_timing_within_the_budget(bench, monkeypatch, capsys):
    from benchmarks import precompile as module
    calls = []
    monkeypatch.setattr(module, "warm", lambda items, workers, **kw: calls.append((items, workers, kw)) or
                        dict(items=len(items), workers=workers, compiled=len(items), failed=0, errors=[],
                             stopped=False, seconds=1.0))
    monkeypatch.setattr(bench, "run_case", _fake_run_case({"ours": 400.0, "flash": 300.0}))
    records = bench.run_all(_args(bench, "--precompile", "3", "--time-budget", "100"), clock=lambda: 7.0)
    (items, workers, kw), = calls
    assert workers == 3 and kw["deadline"] == 107.0
    assert len(items) == 2 and {it["provider"] for it in items} == {"ours"}  # flash compiles nothing
    assert len(records) == 8 and "precompile: 2 of 2 cells compiled" in capsys.readouterr().err


def test_precompile_reads_only_complete_lines(precompile, tmp_path):
    log = tmp_path / "shard0.jsonl"
    log.write_text(json.dumps({"status": "ok"}) + "\n" + '{"status": "o')  # a worker mid-write
    assert precompile._read_lines(str(log)) == [{"status": "ok"}]
    assert precompile._read_lines(str(tmp_path / "missing.jsonl")) == []
