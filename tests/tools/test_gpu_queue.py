"""tools/gpu_queue.py, the resumable GPU work queue, on CPU with stand-in items: order, the budget,
outcomes (done, failed, partial at a limit), resuming from the state a call returns, and its flags."""

from __future__ import annotations

import json
import signal
import tarfile

import pytest

from tools import gpu_queue
from tools.gpu_queue import Item


def _items(*specs):
    return [Item(name, command, cost, name) for name, command, cost in specs]


def _run(tmp_path, items, budget=60.0, state=None, **kwargs):
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    said = []
    outcomes = gpu_queue.run_queue(items, out, state or tmp_path / "none.json", budget, say=said.append, **kwargs)
    return out, outcomes, said


def test_items_run_in_order_and_each_folder_comes_back_packed(tmp_path):
    items = _items(("a", 'echo one > "$OUT/a.txt"', 5), ("b", "exit 3", 5), ("c", 'echo "$LIMIT" > "$OUT/limit"', 7))
    out, outcomes, said = _run(tmp_path, items)
    assert [(n, o.state, o.rc) for n, o in outcomes.items()] == [("a", "done", 0), ("b", "failed", 3), ("c", "done", 0)]
    with tarfile.open(out / "c.tgz") as archive:
        assert archive.extractfile("c/limit").read().strip() == b"7"
    assert json.loads((out / gpu_queue.STATE_NAME).read_text())["items"]["b"]["state"] == "failed"
    assert "==== a:" in (out / "gpu_queue.log").read_text()


def test_the_budget_stops_the_queue_before_an_item_that_does_not_fit(tmp_path):
    items = _items(("a", "true", 5), ("big", "true", 100), ("small", "true", 1))
    _, outcomes, said = _run(tmp_path, items, budget=50)
    assert list(outcomes) == ["a"]  # "small" waits behind "big": the queue keeps its order of value
    assert any("big: needs ~100 s" in line for line in said)


def test_an_item_past_its_limit_is_interrupted_and_partial(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_queue, "MARGIN", 1)
    items = _items(("slow", "trap 'exit 5' INT; sleep 30 & wait", 1), ("inner_timeout", "exit 124", 5))
    # Run as from a parent that ignores SIGINT (nohup's children, a pytest-xdist worker): the item
    # must still get it, not inherit the ignore (which a shell cannot trap) and wait for SIGKILL.
    ignored = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _, outcomes, _ = _run(tmp_path, items)
    finally:
        signal.signal(signal.SIGINT, ignored)
    assert outcomes["slow"].state == "partial" and outcomes["slow"].seconds < 20
    assert outcomes["inner_timeout"].state == "partial"


def _started(said):
    return [line.split(":")[0] for line in said if "(~" in line]


def test_a_later_call_resumes_after_what_finished(tmp_path):
    items = _items(("a", "true", 5), ("b", "exit 1", 5), ("c", "true", 40))
    out, first, said = _run(tmp_path, items, budget=20)
    assert _started(said) == ["a", "b"]
    state = tmp_path / "returned.json"
    state.write_text((out / gpu_queue.STATE_NAME).read_text())
    _, second, said = _run(tmp_path, items, budget=60, state=state)
    assert _started(said) == ["c"] and second["b"].state == "failed"  # a failure is not retried by default
    _, _, said = _run(tmp_path, items, budget=60, state=state, retry_failed=True)
    assert _started(said) == ["b", "c"]  # the returned state predates c


def test_flags_are_checked_before_anything_runs(tmp_path, capsys):
    code = gpu_queue.cli_args.run(gpu_queue.main, ["--only", "suite-1of3,nope", "--out", str(tmp_path)],
                                  prog=gpu_queue.PROG)
    err = capsys.readouterr().err
    assert code == 2 and "--only: unknown 'nope'" in err and len(err.strip().splitlines()) == 1
    bad_state = tmp_path / "state.json"
    bad_state.write_text("{}")
    assert gpu_queue.cli_args.run(gpu_queue.main, ["--list", "--state", str(bad_state)], prog=gpu_queue.PROG) == 2
    assert "delete it to start the queue afresh" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu_queue.parse_args(["--budget", "-3"])


def test_list_shows_every_item_with_its_state(tmp_path, capsys):
    state = tmp_path / "state.json"
    gpu_queue.save_state(state, {"suite-1of3": gpu_queue.Outcome("done", 400.0, 0, "2026-12-07 12:00:00")})
    assert gpu_queue.main(["--list", "--state", str(state)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["item", "cost", "s"]
    assert [line.split()[0] for line in lines[2:]] == [i.name for i in gpu_queue.ITEMS]
    assert lines[2].split()[2] == "done" and lines[3].split()[2] == "-"
