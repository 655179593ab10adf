"""Every command-line tool turns a user's mistake into one line on stderr and exit code 2, before
any work starts, with no traceback.

Each bad argument runs the tool's ``__main__`` in a child process, as ``python -m`` does
(``runpy`` with ``run_name="__main__"``). Importing torch and flash_inductor costs a few seconds
of CPU per process, so one child runs all the cases of a tool, each with its own stderr, stdout
and exit code; one case per tool also runs as its own ``python -m`` process, to check the exit
status the shell sees. "Before any work" is checked as an empty stdout: each tool prints what it
is about to do only once its arguments have passed.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from helpers import ON_CUDA

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Runs each (module, argv) as `python -m module *argv` would, in this one process.
_DRIVER = r"""
import contextlib, io, json, runpy, sys, traceback
results = []
for module, argv in json.loads(sys.argv[1]):
    err, out = io.StringIO(), io.StringIO()
    sys.argv = [module, *argv]
    code = 0
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else 0 if exit.code is None else 1
            if not isinstance(exit.code, (int, type(None))):
                print(exit.code, file=sys.stderr)  # what the interpreter would print
        except BaseException:
            traceback.print_exc()
            code = 1
    results.append({"code": code, "stderr": err.getvalue(), "stdout": out.getvalue()})
print(json.dumps(results))
"""


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("TRITON_INTERPRET", None)  # autotune's "no GPU" check comes after its argument checks
    return env


def _run_all(cases: list[tuple[str, list[str]]]) -> list[dict]:
    done = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps(cases)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _check(result: dict, what: str, mentions: str) -> None:
    stderr = result["stderr"]
    assert result["code"] == 2, f"{what}: exit code {result['code']}, stderr:\n{stderr}"
    assert "Traceback" not in stderr, f"{what}:\n{stderr}"
    assert len(stderr.strip().splitlines()) == 1, f"{what}: not one line:\n{stderr}"
    assert mentions in stderr, f"{what}: {mentions!r} not in {stderr!r}"
    assert result["stdout"] == "", f"{what}: work started:\n{result['stdout']}"


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("cli_errors")
    (base / "a_file").write_text("")
    (base / "folder").mkdir()
    (base / "not_json.json").write_text("{not json")
    (base / "not_a_result.json").write_text(json.dumps({"results": 3}))
    (base / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    return {name: str(base / name) for name in ("a_file", "folder", "not_json.json", "not_a_result.json",
                                                  "deep.json")} | {"missing": str(base / "missing.json")}


STABILITY = "flash_inductor.stability"
AUTOTUNE = "flash_inductor.autotune"
DEBUG = "flash_inductor.debug"
BISECT = ["bisect-length", "benchmarks.overflow_demo:ramp_gpt"]


def _cases(p: dict[str, str]) -> dict[str, tuple[str, list[str], str]]:
    """name -> (module, argv, what the line must mention)."""
    return {
        # stability: names, numbers, the device, outputs, merge inputs
        "stability unknown dtype": (STABILITY, ["--dtypes", "fp8"], "--dtypes"),
        "stability unknown case": (STABILITY, ["--cases", "nope"], "--cases"),
        "stability unknown impl": (STABILITY, ["--impls", "ours:nope"], "--impls"),
        "stability unknown device": (STABILITY, ["--device", "tpu"], "--device"),
        "stability cuda without a GPU": (STABILITY, ["--device", "cuda:99"], "--device"),
        "stability negative seq": (STABILITY, ["--seq", "-4"], "--seq"),
        "stability seq not a number": (STABILITY, ["--seq", "many"], "--seq"),
        "stability malformed long seqs": (STABILITY, ["--long-seqs", "2048,4k"], "--long-seqs"),
        "stability out is a file": (STABILITY, ["--out", p["a_file"]], "--out"),
        "stability out under a file": (STABILITY, ["--out", p["a_file"] + "/results"], "--out"),
        "stability tag with a slash": (STABILITY, ["--tag", "a/b"], "--tag"),
        "stability negative time budget": (STABILITY, ["--time-budget", "-5"], "--time-budget"),
        "stability no case in the dtype": (STABILITY, ["--cases", "large_v", "--dtypes", "bf16"], "--dtypes"),
        "stability merge missing": (STABILITY, ["--merge", p["missing"]], "--merge"),
        "stability merge not JSON": (STABILITY, ["--merge", p["not_json.json"]], "--merge"),
        "stability merge not a result": (STABILITY, ["--merge", p["not_a_result.json"]], "--merge"),
        "stability merge nested too deeply": (STABILITY, ["--merge", p["deep.json"]], "--merge"),
        "stability merge a folder": (STABILITY, ["--merge", p["folder"]], "--merge"),
        # autotune: numbers in range, names, outputs, inputs, options that clash
        "autotune max seq 0": (AUTOTUNE, ["--max-seq", "0"], "--max-seq"),
        "autotune unknown dtype": (AUTOTUNE, ["--dtypes", "fp8"], "--dtypes"),
        "autotune negative budget": (AUTOTUNE, ["--time-budget", "-1"], "--time-budget"),
        "autotune head dim out of range": (AUTOTUNE, ["--head-dims", "512"], "--head-dims"),
        "autotune seqs not powers of two": (AUTOTUNE, ["--seqs", "1000"], "--seqs"),
        "autotune ship and out": (AUTOTUNE, ["--ship", "--out", p["folder"]], "--ship"),
        "autotune out under a file": (AUTOTUNE, ["--dry-run", "--out", p["a_file"] + "/t.json"], "--out"),
        "autotune summary is a folder": (AUTOTUNE, ["--dry-run", "--summary", p["folder"]], "--summary"),
        # Without a GPU (on one, --quick starts tuning: not a user error).
        **({} if ON_CUDA else {"autotune no GPU": (AUTOTUNE, ["--quick"], "TRITON_INTERPRET")}),
        # debug bisect-length: the target, numbers, the JSON output
        "debug no command": (DEBUG, [], "command"),
        "debug unknown command": (DEBUG, ["bisect"], "bisect-length"),
        "debug target without a colon": (DEBUG, ["bisect-length", "benchmarks.overflow_demo"], "MODULE:FACTORY"),
        "debug target module missing": (DEBUG, ["bisect-length", "no_such_module_xyz:f"], "no_such_module_xyz"),
        "debug target attribute missing": (DEBUG, ["bisect-length", "benchmarks.overflow_demo:nope"], "nope"),
        "debug target not callable": (DEBUG, ["bisect-length", "math:pi"], "not a function"),
        "debug target not a factory(length)": (DEBUG, ["bisect-length", "os:getcwd"], "factory(length)"),
        "debug unknown dtype": (DEBUG, [*BISECT, "--dtype", "fp8"], "--dtype"),
        "debug min length 0": (DEBUG, [*BISECT, "--min-length", "0"], "--min-length"),
        "debug min above max": (DEBUG, [*BISECT, "--min-length", "64", "--max-length", "16"], "--max-length"),
        "debug out is a folder": (DEBUG, [*BISECT, "--out", p["folder"]], "--out"),
        "debug out under a file": (DEBUG, [*BISECT, "--out", p["a_file"] + "/r.json"], "--out"),
    }


@pytest.fixture(scope="module")
def results(paths) -> dict[str, dict]:
    cases = _cases(paths)
    by_module: dict[str, list[str]] = {}
    for name, (module, _, _) in cases.items():
        by_module.setdefault(module, []).append(name)
    out = {}
    for module, names in by_module.items():
        for name, result in zip(names, _run_all([(module, cases[name][1]) for name in names])):
            out[name] = result
    return out


CASE_NAMES = list(_cases({k: "" for k in ("a_file", "folder", "not_json.json", "not_a_result.json", "deep.json",
                                           "missing")}))


@pytest.mark.parametrize("name", CASE_NAMES)
def test_a_user_error_is_one_line_and_exit_code_2(results, paths, name):
    _, _, mentions = _cases(paths)[name]
    _check(results[name], name, mentions)


@pytest.mark.parametrize("module, argv", [(STABILITY, ["--dtypes", "fp8"]), (AUTOTUNE, ["--max-seq", "0"]),
                                          (DEBUG, ["bisect-length", "math:pi"])], ids=[STABILITY, AUTOTUNE, DEBUG])
def test_the_shell_sees_exit_code_2(module, argv):
    done = subprocess.run([sys.executable, "-m", module, *argv], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=60)
    _check({"code": done.returncode, "stderr": done.stderr, "stdout": done.stdout}, module, "")


def test_an_unexpected_error_keeps_its_traceback(tmp_path):
    """Only a user's mistake is shortened: a factory that fails on its own keeps its traceback."""
    (tmp_path / "broken_factory.py").write_text("def make(length):\n    raise RuntimeError('a bug')\n")
    env = dict(_env(), PYTHONPATH=os.pathsep.join([str(tmp_path), _env()["PYTHONPATH"]]))
    done = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps([(DEBUG, ["bisect-length", "broken_factory:make",
                                                                                "--quiet"])])],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    result = json.loads(done.stdout.strip().splitlines()[-1])[0]
    assert result["code"] == 1 and "Traceback" in result["stderr"] and "a bug" in result["stderr"]


def test_a_reader_that_stops_early_gets_no_traceback():
    """`... | head`: the reader closes the pipe; the command ends quietly (code 141, as SIGPIPE's),
    where Python would print a BrokenPipeError traceback."""
    program = ("from flash_inductor import cli_args\n"
               "def main(argv):\n"
               "    for i in range(200_000):\n"
               "        print('line', i)\n"
               "    return 0\n"
               "raise SystemExit(cli_args.run(main, []))\n")
    process = subprocess.Popen([sys.executable, "-c", program], cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "line 0\n"
    process.stdout.close()
    stderr = process.stderr.read()
    assert process.wait(timeout=60) == 141
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr
