"""What installing the package gives a user beside ``import flash_inductor``: the console scripts
(``flash-inductor-autotune``, ``-stability``, ``-debug``), ``torch.compile(backend="flash_inductor")``
through the ``torch_dynamo_backends`` entry point, and tools that write nothing into the folder
they are run from.

The declarations are checked from pyproject.toml everywhere. What only an install creates (the
scripts on PATH, the entry point in the package metadata) is run for real where flash_inductor is
installed from this checkout, as CI's ``pip install -e ".[test]"`` does; elsewhere (a checkout used
through PYTHONPATH, or an install of another checkout) those tests skip and say how to run them.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import pathlib
import subprocess
import sys
import sysconfig
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = {"flash-inductor-autotune": "flash_inductor.autotune", "flash-inductor-stability": "flash_inductor.stability",
           "flash-inductor-debug": "flash_inductor.debug"}


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _load(spec: str):
    module, _, attr = spec.partition(":")
    target = importlib.import_module(module)
    for part in attr.split("."):
        target = getattr(target, part)
    return target


def test_pyproject_declares_the_scripts_and_the_dynamo_backend():
    import flash_inductor

    project = _pyproject()["project"]
    assert set(project["scripts"]) == set(SCRIPTS)
    for script, module in SCRIPTS.items():
        assert project["scripts"][script] == f"{module}.__main__:cli"
        assert callable(_load(project["scripts"][script]))
    backends = project["entry-points"]["torch_dynamo_backends"]
    assert _load(backends["flash_inductor"]) is flash_inductor.backend


def _installed_from_this_checkout() -> str | None:
    """None when the installed flash_inductor is this checkout, else why the install tests skip."""
    # The installed one records where it came from (direct_url.json); an egg-info that an editable
    # install leaves in the checkout, on sys.path under pytest, has no such record.
    urls = [json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
            for dist in importlib.metadata.distributions(name="flash_inductor")]
    urls = [url for url in urls if url]
    if not urls:
        return f"flash_inductor is not installed: pip install -e {ROOT}"
    if not any(url.startswith("file://") and pathlib.Path(url[len("file://"):]).resolve() == ROOT for url in urls):
        return f"the installed flash_inductor is not this checkout ({', '.join(urls)}): pip install -e {ROOT}"
    return None


needs_install = pytest.mark.skipif(_installed_from_this_checkout() is not None,
                                   reason=str(_installed_from_this_checkout()))


def _user_env(tmp_path: pathlib.Path) -> dict:
    """A new user's environment: nothing of the checkout on PYTHONPATH, a private user cache, and an
    empty Inductor cache (a graph an earlier run compiled is served from it without the pass running,
    which the report then says instead of the rewrite)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    env["FLASH_INDUCTOR_CACHE_DIR"] = str(tmp_path / "cache")
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor")
    return env


def _empty_cwd(tmp_path: pathlib.Path) -> pathlib.Path:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    return cwd


# ------------------------------------------------------------------------------------------
# torch.compile(backend="flash_inductor")
# ------------------------------------------------------------------------------------------

# Never imports flash_inductor itself: dynamo finds the name in the package metadata.
_COMPILE_BY_NAME = textwrap.dedent(
    """
    import sys
    import torch
    import torch.nn.functional as F

    def attention(q, k, v):
        return F.softmax(q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5, dim=-1) @ v

    q, k, v = (torch.randn(1, 2, 24, 8) for _ in range(3))
    assert "flash_inductor" not in sys.modules, "imported before the compile"
    compiled = torch.compile(attention, backend="flash_inductor")  # loads the entry point
    with torch.profiler.profile() as profile:
        out = compiled(q, k, v)
    torch.testing.assert_close(out, attention(q, k, v))

    import flash_inductor
    from torch._dynamo.backends.registry import lookup_backend
    assert lookup_backend("flash_inductor") is flash_inductor.backend
    assert "flash_inductor" in torch._dynamo.list_backends()
    print("report:", flash_inductor.last_report().summary())
    print("ops:", sorted({e.name for e in profile.events() if e.name.startswith("flash_inductor::")}))
    """
)


@needs_install
def test_torch_compile_finds_the_backend_by_name(tmp_path):
    done = subprocess.run([sys.executable, "-c", _COMPILE_BY_NAME], cwd=_empty_cwd(tmp_path), env=_user_env(tmp_path),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "rewrote 1 of 1 attention site" in done.stdout, done.stdout
    assert "ops: ['flash_inductor::" in done.stdout, done.stdout  # our op ran in the compiled graph


# ------------------------------------------------------------------------------------------
# The console scripts, and the tools writing nothing where they are run
# ------------------------------------------------------------------------------------------


def _script(name: str) -> str:
    path = pathlib.Path(sysconfig.get_path("scripts")) / name
    return str(path) if path.exists() else name


@needs_install
@pytest.mark.parametrize("script", list(SCRIPTS))
def test_console_scripts_run_from_any_folder(tmp_path, script):
    cwd = _empty_cwd(tmp_path)
    done = subprocess.run([_script(script), "--help"], cwd=cwd, env=_user_env(tmp_path), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: {script} "), done.stdout[:200]
    assert list(cwd.iterdir()) == []


@needs_install
def test_a_console_script_names_itself_in_a_usage_error(tmp_path):
    done = subprocess.run([_script("flash-inductor-stability"), "--dtypes", "fp8"], cwd=_empty_cwd(tmp_path),
                          env=_user_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("flash-inductor-stability: error: --dtypes"), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


@needs_install
def test_a_console_script_finds_a_factory_in_the_current_folder(tmp_path):
    """As ``python -m`` does: MODULE:FACTORY may name a module of the folder the user is in."""
    cwd = _empty_cwd(tmp_path)
    (cwd / "my_factories.py").write_text("not_a_factory = 3\n")
    done = subprocess.run([_script("flash-inductor-debug"), "bisect-length", "my_factories:not_a_factory"], cwd=cwd,
                          env=_user_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "my_factories:not_a_factory is a int, not a function" in done.stderr, done.stderr


def _module_env(tmp_path: pathlib.Path) -> dict:
    env = _user_env(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return env


@pytest.mark.parametrize("module", list(SCRIPTS.values()))
def test_help_from_any_folder_writes_nothing_there(tmp_path, module):
    cwd = _empty_cwd(tmp_path)
    done = subprocess.run([sys.executable, "-m", module, "--help"], cwd=cwd, env=_module_env(tmp_path),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: python -m {module} ")
    assert list(cwd.iterdir()) == []


def test_stability_writes_to_the_user_cache_not_the_current_folder(tmp_path):
    """Without --out the suite's JSON goes to results/ in the user cache, and it says where."""
    cwd = _empty_cwd(tmp_path)
    done = subprocess.run([sys.executable, "-m", "flash_inductor.stability", "--device", "cpu", "--quick", "--seq", "16",
                           "--head-dim", "8", "--cases", "qk_x1", "--dtypes", "fp16", "--impls", "ours:stable",
                           "--no-plot", "--no-progress"], cwd=cwd, env=_module_env(tmp_path), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert list(cwd.iterdir()) == []
    (written,) = (tmp_path / "cache" / "results").glob("stability_*.json")
    assert f"wrote {written}" in done.stdout


# ------------------------------------------------------------------------------------------
# The shared option names
# ------------------------------------------------------------------------------------------


def test_old_output_option_names_still_work_with_a_note(capsys, tmp_path):
    """``--out`` is every tool's output option; autotune's ``--output`` and bisect-length's
    ``--json`` still work, hidden from --help, with a one-line note."""
    from flash_inductor.autotune import cli

    args = cli.parse_args(["--output", str(tmp_path / "t.json")])
    assert args.out == str(tmp_path / "t.json")
    assert "--output is now --out" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.parse_args(["--help"])
    helped = capsys.readouterr().out
    assert "--out OUT" in helped and "--output" not in helped

    from flash_inductor.debug.__main__ import main

    with pytest.raises(SystemExit, match="not a function"):  # stops at the factory, after the options
        main(["bisect-length", "math:pi", "--json", str(tmp_path / "r.json")])
    assert "--json is now --out" in capsys.readouterr().err


def test_console_script_names_replace_the_module_in_usage_lines(monkeypatch):
    from flash_inductor import cli_args

    monkeypatch.setattr(sys, "argv", ["/venv/bin/flash-inductor-stability", "--help"])
    assert cli_args.invoked_as("python -m flash_inductor.stability") == "flash-inductor-stability"
    assert cli_args.invoked_as("python -m flash_inductor.autotune") == "python -m flash_inductor.autotune"
    monkeypatch.setattr(sys, "argv", ["-m", "--help"])
    assert cli_args.invoked_as("python -m flash_inductor.stability") == "python -m flash_inductor.stability"
