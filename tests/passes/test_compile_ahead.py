"""Compile-ahead from the pass (``flash_inductor/passes/compile_ahead.py``): the specs it records
from a real compiled graph, and the gates that keep it from starting a process.

The gate is CUDA-only and closed under the interpreter; these tests open it on CPU through the
pass's own ``compile_ahead`` hook (``CompileAhead(devices=("cpu",), allow_interpreter=True)``), with
``start`` recording the specs instead of starting a process, and a set of sent keys of their own.
Covers: op name, shapes, strides, dtypes and the rest of the arguments; ``requires_grad`` of a
trained site; a bool mask filled all-True; a dropout seed; dedupe across identical layers and
across recompiles; size hints under ``dynamic=True``; results unchanged. Gates: CPU by default,
the interpreter, the option off, a spec over the memory budget, a rank other than its node's first.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import flash_inductor
from flash_inductor.ops import compile_ahead as ops_compile_ahead
from flash_inductor.ops.compile_ahead import ALL_TRUE, RANDOM, SEED, TensorSpec
from flash_inductor.passes.compile_ahead import CompileAhead

E, H, L = 16, 2, 5

# Fresh dynamo and no AOTAutograd cache per test (conftest.py says why).
pytestmark = pytest.mark.usefixtures("fresh_compiler")


class _Block(nn.Module):
    """qkv projection -> SDPA -> out projection (nanoGPT's attention), causal unless given a mask."""

    def __init__(self, dropout_p: float = 0.0):
        super().__init__()
        self.qkv, self.out = nn.Linear(E, 3 * E), nn.Linear(E, E)
        self.dropout_p = dropout_p

    def forward(self, x, mask=None):
        batch, seq, _ = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, H, E // H).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           dropout_p=self.dropout_p if self.training else 0.0)
        return x + self.out(y.transpose(1, 2).reshape(batch, seq, E))


class _TwoLayers(nn.Module):
    def __init__(self, **block_kwargs):
        super().__init__()
        self.first, self.second = _Block(**block_kwargs), _Block(**block_kwargs)

    def forward(self, x, mask=None):
        return self.second(self.first(x, mask), mask)


def _recording_backend(**hook) -> tuple[flash_inductor.backend.__class__, list]:
    """Our backend with the compile-ahead gate open on CPU and the process start recorded: each
    entry of the returned list is the specs one start got."""
    starts: list = []
    backend = flash_inductor.make_backend(**hook.pop("options", {}))
    hook = dict(dict(devices=("cpu",), allow_interpreter=True, start=lambda specs: starts.append(list(specs)),
                     sent=set()), **hook)
    backend.graph_pass.compile_ahead = CompileAhead(**hook)
    return backend, starts


def _x(batch=2, seq=L, seed=0):
    return torch.randn(batch, seq, E, generator=torch.Generator().manual_seed(seed))


def _qkv_args(spec):
    return spec.args[:3]


# ------------------------------------------------------------------------------------------
# The specs of a compiled graph
# ------------------------------------------------------------------------------------------


def test_a_trained_model_sends_one_spec_for_two_identical_layers_and_results_are_unchanged():
    torch.manual_seed(0)
    model = _TwoLayers()
    backend, starts = _recording_backend()
    x = _x()
    out = torch.compile(model, backend=backend)(x)
    torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
    out.sum().backward()  # the backward graph compiles too: it has no site, so nothing more is sent

    assert len(starts) == 1 and len(starts[0]) == 1, "two identical layers: one spec, one start"
    spec = starts[0][0]
    assert spec.op == "flash_inductor::attention_forward" and spec.overload == "default"
    assert spec.trained
    q, k, v = _qkv_args(spec)
    for tensor, offset in ((q, 0), (k, E), (v, 2 * E)):
        # The q/k/v views of the fused projection: (B, H, L, E/H) read through its strides.
        assert tensor == TensorSpec(shape=(2, H, L, E // H), stride=(L * 3 * E, E // H, 3 * E, 1),
                                    storage_offset=offset, dtype="float32", device="cpu", requires_grad=True,
                                    fill=RANDOM)
    attn_mask, rng_seed, dropout_p, is_causal, causal_offset, scale, schedule = spec.args[3:10]
    assert (attn_mask, rng_seed, dropout_p, is_causal, causal_offset, schedule) == (None, None, 0.0, True, 0, "stable")
    assert scale == pytest.approx((E // H) ** -0.5)


def test_the_log_says_how_many_variants_are_compiled_ahead(caplog):
    class _Started:  # what start_worker returns, as far as the log reads it
        pid, log_path = 1234, "/tmp/flash_inductor_compile_ahead_x/worker.log"

        def poll(self):
            return 0

    torch.manual_seed(0)
    backend, _ = _recording_backend(start=lambda specs: _Started())
    with caplog.at_level("INFO", logger="flash_inductor"):
        torch.compile(_TwoLayers(), backend=backend)(_x(), torch.ones(L, L, dtype=torch.bool))
    [line] = [r.getMessage() for r in caplog.records if "ahead" in r.getMessage()]
    assert line == ("flash_inductor: compiling the kernels of 1 attention variant ahead in a background process (pid "
                    "1234, log /tmp/flash_inductor_compile_ahead_x/worker.log; make_backend(compile_ahead=False) "
                    "turns this off)")


def test_a_bool_mask_is_sent_all_true_and_an_inference_site_is_not_trained():
    torch.manual_seed(0)
    model = _Block()
    backend, starts = _recording_backend()
    mask = torch.ones(L, L, dtype=torch.bool).tril()
    with torch.no_grad():
        torch.compile(model, backend=backend)(_x(), mask)
    [[spec]] = starts
    assert not spec.trained and not any(t.requires_grad for t in spec.tensors)
    mask_spec = spec.args[3]
    # The (L, L) mask reaches the op broadcast to (B, H, L, L) with stride 0, never copied.
    assert mask_spec == TensorSpec(shape=(2, H, L, L), stride=(0, 0, L, 1), storage_offset=0, dtype="bool",
                                   device="cpu", requires_grad=False, fill=ALL_TRUE)
    assert mask_spec.storage_elements == L * L
    assert spec.args[6] is False  # is_causal: the mask says it


def test_a_dropout_site_sends_its_seed_as_a_seed():
    torch.manual_seed(0)
    model = _Block(dropout_p=0.25).train()
    backend, starts = _recording_backend()
    torch.compile(model, backend=backend)(_x())
    [[spec]] = starts
    rng_seed = spec.args[4]
    assert rng_seed.fill == SEED and rng_seed.dtype == "int64" and rng_seed.shape == (1,)
    assert spec.args[5] == 0.25 and spec.trained


def test_a_recompile_sends_only_new_shapes():
    torch.manual_seed(0)
    model = _Block()
    sent: set = set()
    backend, starts = _recording_backend(sent=sent)
    torch.compile(model, backend=backend)(_x())
    torch._dynamo.reset()
    backend_again, starts_again = _recording_backend(sent=sent)  # a new backend, the same process's set
    torch.compile(model, backend=backend_again)(_x(seed=1))
    assert len(starts) == 1 and starts_again == [], "the same call was sent again"
    torch._dynamo.reset()
    torch.compile(model, backend=backend_again)(_x(batch=3))
    [[spec]] = starts_again
    assert _qkv_args(spec)[0].shape == (3, H, L, E // H) and len(sent) == 2


def test_symbolic_sizes_are_sent_at_their_hints():
    torch.manual_seed(0)
    backend, starts = _recording_backend()
    torch.compile(_Block(), backend=backend, dynamic=True)(_x(batch=3, seq=7))
    [[spec]] = starts
    q = _qkv_args(spec)[0]
    assert q.shape == (3, H, 7, E // H) and q.stride == (7 * 3 * E, E // H, 3 * E, 1)


def test_a_spec_survives_its_json_round_trip():
    torch.manual_seed(0)
    backend, starts = _recording_backend()
    torch.compile(_Block(), backend=backend)(_x(), torch.ones(L, L, dtype=torch.bool))
    [[spec]] = starts
    again = ops_compile_ahead.OpCallSpec.from_json(spec.to_json())
    assert again == spec and again.key() == spec.key()


# ------------------------------------------------------------------------------------------
# The gates: no process
# ------------------------------------------------------------------------------------------


@pytest.fixture
def no_process(monkeypatch):
    """Fails the test if anything tries to start the worker process."""
    started = []
    monkeypatch.setattr(ops_compile_ahead.subprocess, "Popen", lambda *a, **k: started.append(a))
    yield started
    assert started == [], f"a process was started: {started}"


def test_the_default_backend_starts_nothing_on_cpu(no_process):
    torch.manual_seed(0)
    torch.compile(_Block(), backend=flash_inductor.backend)(_x())
    assert flash_inductor.last_report().rewritten == 1


def test_cpu_sites_are_not_sent_with_the_default_devices():
    backend, starts = _recording_backend(devices=("cuda",))
    torch.compile(_Block(), backend=backend)(_x())
    assert starts == []


def test_nothing_is_sent_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    backend, starts = _recording_backend(allow_interpreter=False)
    torch.compile(_Block(), backend=backend)(_x())
    assert starts == []


def test_nothing_is_sent_with_the_option_off():
    backend, starts = _recording_backend(options=dict(compile_ahead=False))
    assert backend.options.compile_ahead is False and "compile_ahead=False" in repr(backend)
    torch.compile(_Block(), backend=backend)(_x())
    assert starts == []


def test_a_spec_over_the_memory_budget_is_not_sent():
    budgets = []
    backend, starts = _recording_backend(memory_budget=lambda device: budgets.append(device) or 1024)
    torch.compile(_Block(), backend=backend)(_x())
    assert starts == [] and budgets == ["cpu"]


def test_a_spec_within_the_memory_budget_is_sent():
    # Trained: 4 x the bytes of the inputs, q, k and v, each an fp32 (2, H, L, E/H) view at
    # offset 0, E and 2E of a (2, L, 3E) projection.
    need = 4 * sum(4 * (offset + 1 + (2 - 1) * L * 3 * E + (H - 1) * (E // H) + (L - 1) * 3 * E + (E // H - 1))
                   for offset in (0, E, 2 * E))
    backend, starts = _recording_backend(memory_budget=lambda device: need)
    torch.compile(_Block(), backend=backend)(_x())
    [[spec]] = starts
    assert spec.estimated_bytes() == need


def test_a_rank_other_than_its_nodes_first_sends_nothing(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    backend, starts = _recording_backend()
    torch.compile(_Block(), backend=backend)(_x())
    assert starts == []
    monkeypatch.setenv("LOCAL_RANK", "0")
    torch._dynamo.reset()
    torch.compile(_Block(), backend=backend)(_x())
    assert len(starts) == 1


def test_a_failing_start_does_not_fail_the_compile():
    def broken_start(specs):
        raise OSError("no processes left")

    torch.manual_seed(0)
    model = _Block()
    backend, _ = _recording_backend(start=broken_start)
    torch.testing.assert_close(torch.compile(model, backend=backend)(_x()), model(_x()), rtol=1e-5, atol=1e-5)
    assert flash_inductor.last_report().rewritten == 1
    assert backend.graph_pass.compile_ahead.sent == set(), "a call that never reached a worker counts as unsent"


# ------------------------------------------------------------------------------------------
# The worker (flash_inductor/ops/compile_ahead_worker.py) on those specs
# ------------------------------------------------------------------------------------------


def _one_spec(model, *inputs, grad=True):
    backend, starts = _recording_backend()
    with torch.set_grad_enabled(grad):
        torch.compile(model, backend=backend)(*inputs)
    [[spec]] = starts
    return spec


def test_the_worker_runs_a_trained_spec_forward_and_backward():
    from flash_inductor.ops.compile_ahead_worker import run_call

    torch.manual_seed(0)
    assert run_call(_one_spec(_Block(), _x())) == ["forward", "backward"]


def test_the_worker_runs_an_inference_spec_forward_only_and_a_dropout_spec_with_its_seed():
    from flash_inductor.ops.compile_ahead_worker import run_call

    torch.manual_seed(0)
    masked = _one_spec(_Block(), _x(), torch.ones(L, L, dtype=torch.bool).tril(), grad=False)
    assert run_call(masked) == ["forward"]
    assert run_call(_one_spec(_Block(dropout_p=0.25).train(), _x())) == ["forward", "backward"]


def test_the_worker_goes_on_past_a_failing_spec():
    from flash_inductor.ops.compile_ahead_worker import run_all

    torch.manual_seed(0)
    good = _one_spec(_Block(), _x())
    # A head dim that differs between q and k: the op refuses it.
    q, k, v = _qkv_args(good)
    bad = ops_compile_ahead.OpCallSpec(good.op, good.overload, (q, _with_shape(k, (2, H, L, 4)), v, *good.args[3:]))
    assert run_all([bad, good]) == [None, ["forward", "backward"]]


def _with_shape(spec: TensorSpec, shape) -> TensorSpec:
    import dataclasses

    return dataclasses.replace(spec, shape=shape)


def test_build_tensor_keeps_broadcast_strides_and_offsets():
    from flash_inductor.ops.compile_ahead_worker import SeededGenerators, build_tensor

    spec = TensorSpec(shape=(2, 3, 4, 5), stride=(0, 0, 5, 1), storage_offset=7, dtype="bool", device="cpu",
                      requires_grad=False, fill=ALL_TRUE)
    mask = build_tensor(spec, SeededGenerators(0))
    assert mask.shape == (2, 3, 4, 5) and mask.stride() == (0, 0, 5, 1) and mask.storage_offset() == 7
    assert bool(mask.all())
    q = build_tensor(TensorSpec((2, 2, 3, 4), (48, 4, 16, 1), 4, "float16", "cpu", True, RANDOM), SeededGenerators(0))
    assert q.requires_grad and q.dtype == torch.float16 and q.stride() == (48, 4, 16, 1) and q.storage_offset() == 4
    assert bool(q.detach().isfinite().all()) and float(q.detach().float().std()) > 0.5


def test_calls_the_worker_cannot_reproduce_are_refused():
    q = torch.randn(1, 1, 4, 8)
    op = torch.ops.flash_inductor.attention_forward.default
    positions = torch.zeros(1, 1, 4, 4, dtype=torch.int32)  # integer mask-like tables: never made up
    with pytest.raises(ops_compile_ahead.NotReplayable, match="attn_mask is a torch.int32 tensor"):
        ops_compile_ahead.spec_from_call(op, (q, q, q, positions, None, 0.0, False, 0, 1.0, "stable"), {})
    block_map = torch.ones(1, 1, 1, 1, dtype=torch.bool)  # a block layout decides what the kernels read
    with pytest.raises(ops_compile_ahead.NotReplayable, match="block_map"):
        ops_compile_ahead.spec_from_call(op, (q, q, q, None, None, 0.0, False, 0, 1.0, "stable", -1, -1, block_map,
                                              16, 16), {})
    with pytest.raises(ops_compile_ahead.NotReplayable, match="not one of the ops"):
        ops_compile_ahead.spec_from_call(torch.ops.aten.add.Tensor, (q, q), {})


def test_the_worker_process_runs_its_specs_and_cleans_up():
    """The real thing: ``start_worker`` starts ``python -m flash_inductor.ops.compile_ahead_worker``,
    which exits 0 and deletes its directory; a failing spec exits 1 and keeps the log."""
    torch.manual_seed(0)
    spec = _one_spec(_Block(), _x())
    worker = ops_compile_ahead.start_worker([spec])
    assert worker.process.wait(timeout=100) == 0, worker.log_path.read_text()
    assert not worker.directory.exists()

    q, k, v = _qkv_args(spec)
    bad = ops_compile_ahead.OpCallSpec(spec.op, spec.overload, (q, _with_shape(k, (2, H, L, 4)), v, *spec.args[3:]))
    worker = ops_compile_ahead.start_worker([bad])
    try:
        assert worker.process.wait(timeout=100) == 1
        assert "call 0 (flash_inductor::attention_forward) failed" in worker.log_path.read_text()
    finally:
        import shutil

        shutil.rmtree(worker.directory, ignore_errors=True)
