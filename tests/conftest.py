"""Test environment: the Triton interpreter when there is no GPU, and the device / dtype fixtures.

Triton decides between interpreter and compiler when a function is decorated with @triton.jit,
and that includes Triton's own library (triton.language.standard), which is decorated when
triton.language is first imported -- importing flash_inductor.kernels does that (a first launch,
or a test that imports the kernels). So TRITON_INTERPRET is set here, before any test module is
imported, and this file imports nothing that imports flash_inductor or triton.
"""

import importlib.metadata
import os
import re
import sys

import pytest
import torch

from helpers import DEVICE, KERNEL_DTYPES, dtype_id


def pytest_configure(config):
    _share_cores_among_workers()
    if not torch.cuda.is_available():
        if "triton.language" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            raise pytest.UsageError(
                "triton.language was imported before conftest could set TRITON_INTERPRET=1; "
                "the kernels would not run under the interpreter. Set TRITON_INTERPRET=1 in the environment."
            )
        os.environ["TRITON_INTERPRET"] = "1"


def _share_cores_among_workers():
    """Under pytest-xdist (``-n auto``: one worker per core) each worker would keep torch's default
    of one intra-op thread per core, so the workers' OpenMP threads oversubscribe the cores and
    spin against each other: on 2 cores that cost test_reference.py 2.5x its CPU time. Each worker
    gets its share of the cores instead, and so do the tools its tests start (OMP_NUM_THREADS)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // workers)
    torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))


def pytest_collection_modifyitems(config, items):
    _fail_empty_parameter_sets(items)
    _skip_fuller_suites_not_asked_for(config, items)
    _skip_kernel_launches_on_old_interpreters(items)


_EMPTY_PARAMETER_SET = "got empty parameter set"
_UNEXPECTED_EMPTY = pytest.StashKey()


def _fail_empty_parameter_sets(items):
    """A parametrised test whose case list comes out empty is collected as one item that pytest
    skips ("got empty parameter set"): a test that checks nothing would read as a skip, and a
    source of cases that dried up (a table without the entries it iterates) would go unseen. Such
    an item fails instead, unless it carries ``@pytest.mark.expected_empty(reason)`` saying why
    nothing is there to test."""
    for item in items:
        skips = [mark for mark in item.own_markers
                 if mark.name == "skip" and str(mark.kwargs.get("reason", "")).startswith(_EMPTY_PARAMETER_SET)]
        if not skips or item.get_closest_marker("expected_empty"):
            continue
        item.own_markers[:] = [mark for mark in item.own_markers if mark not in skips]
        item.stash[_UNEXPECTED_EMPTY] = skips[0].kwargs["reason"]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    reason = item.stash.get(_UNEXPECTED_EMPTY, None)
    if reason is not None:
        pytest.fail(f"{reason}: the test collected no cases. Give it a source of cases, or mark it "
                    "@pytest.mark.expected_empty(reason) with why it has none here.", pytrace=False)


# The fuller suites, each behind one marker (pyproject lists them): too slow for a plain run on a
# CPU, which runs a representative subset of the same checks. What each one is, for the skip reason.
FULLER_SUITES = {
    "models_full": "the full real-model list",
    "full_matrix": "the HF backend's fuller matrix",
    "distributed_full": "the wider context-parallel matrix",
    "tools_full": "the full form of a tool test",
}


def _skip_fuller_suites_not_asked_for(config, items):
    """A test with one of FULLER_SUITES' markers runs only when the ``-m`` expression names that
    marker (``pytest -m models_full``; ``-m "not distributed_full or models_full"`` runs the rest
    of the suite with it); a plain run skips it, with a reason naming the marker. Markers are the
    one opt-in: no environment variable or option turns these on."""
    named = set(re.findall(r"\w+", config.getoption("markexpr", "") or "")) & FULLER_SUITES.keys()
    for item in items:
        for marker, what in FULLER_SUITES.items():
            if marker not in named and item.get_closest_marker(marker):
                item.add_marker(pytest.mark.skip(reason=f"{what}: runs with -m {marker}"))
                break


def _skip_kernel_launches_on_old_interpreters(items):
    """Triton 3.6's interpreter (torch 2.11's Triton) returns tl.program_id as a 1-element array,
    which range() in a kernel loop cannot take, so every kernel fails there before computing
    anything; 3.7 fixed it. On CPU with Triton < 3.7 those tests are skipped with that reason:
    they run compiled on a GPU with 3.6, and interpreted on CPU with 3.7 (CI)."""
    if torch.cuda.is_available():
        return
    try:
        version = tuple(int(part) for part in importlib.metadata.version("triton").split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return  # no Triton (or an unparsable version): the kernel tests fail on import and say so
    if version >= (3, 7):
        return
    skip = pytest.mark.skip(reason=f"Triton {version[0]}.{version[1]}'s interpreter cannot run kernel loops "
                                   "bounded by tl.program_id (fixed in 3.7); these run on a GPU or with Triton >= 3.7")
    for item in items:
        if item.get_closest_marker("launches_kernels"):
            item.add_marker(skip)


@pytest.fixture
def device() -> str:
    """Where the package's kernels run: "cuda" when available, else "cpu" (the interpreter)."""
    return DEVICE


@pytest.fixture(params=KERNEL_DTYPES, ids=dtype_id)
def kernel_dtype(request) -> torch.dtype:
    """fp16, bf16 and fp32 on CUDA; fp16 and fp32 under the interpreter, whose NumPy-emulated
    bf16 is unreliable (an environment limitation, see helpers.KERNEL_DTYPES)."""
    return request.param


_CALL_REPORT = pytest.StashKey()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Keep each test's call-phase report on the item, for ``_cuda_error_isolation``."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        item.stash[_CALL_REPORT] = report


@pytest.fixture(autouse=True)
def _cuda_error_isolation(request):
    """A kernel fault (illegal memory access) is reported asynchronously and poisons the process's
    CUDA context: every later CUDA call in the process fails. Synchronise after each test so the
    fault is charged to the test that caused it, then stop this process: under pytest-xdist the
    worker exits and is replaced by a fresh one; in a plain run the session stops with the name
    of the culprit instead of failing every later test."""
    yield
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return
    try:
        torch.cuda.synchronize()
    except Exception as error:  # torch.AcceleratorError (RuntimeError on older torch)
        message = f"CUDA context poisoned during {request.node.nodeid}: {error}"
        # Stopping the session drops the failure section, and with it the traceback that names
        # the launch which faulted (a fault raises at the next launch or synchronisation): keep it.
        report = request.node.stash.get(_CALL_REPORT, None)
        if report is not None and report.failed:
            message += "\nthe test's own failure:\n" + report.longreprtext[-8000:]
        if os.environ.get("PYTEST_XDIST_WORKER"):
            sys.stderr.write(message + "\n")
            sys.stderr.flush()
            os._exit(3)
        pytest.exit(message, returncode=3)


@pytest.fixture
def fresh_compiler():
    """A fresh dynamo per test, and no AOTAutograd cache: on a cache hit (a graph compiled by an
    earlier run) Inductor skips the pre-grad passes, so the pass would record no report. The
    FX graph cache (after the pass) still spares recompiling the C++ kernels."""
    from flash_inductor.passes.report import REPORTS

    torch._dynamo.reset()
    REPORTS.clear()
    with torch._functorch.config.patch(enable_autograd_cache=False):
        yield
    torch._dynamo.reset()


def pytest_runtest_logreport(report):
    """With FLASH_INDUCTOR_FAILURE_LOG set (device runs), append each failure to that file the
    moment it happens: a run cut off by a time limit still says what failed and why."""
    path = os.environ.get("FLASH_INDUCTOR_FAILURE_LOG")
    # Under pytest-xdist the controller replays each worker's report: log it once, there.
    if not path or not report.failed or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    with open(path, "a") as log:
        log.write(f"=== FAILED {report.nodeid} ({report.when}, {report.duration:.1f}s)\n{report.longreprtext[-20000:]}\n\n")
