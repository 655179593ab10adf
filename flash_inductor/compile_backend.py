"""The torch.compile backend ``flash_inductor.backend``: TorchInductor with the attention rewrite added.

    model = torch.compile(model, backend=flash_inductor.backend)
    model = torch.compile(model, backend=flash_inductor.make_backend(schedule="accurate"))

Inductor config changes are scoped to our own compilation (``compile_fx(config_patches=)``):
nothing leaks into a later plain ``torch.compile``. A pre-grad pass the user already set is
kept and runs after ours.

The module is not named ``backend``: the package's ``backend`` is the callable above, and a
submodule of the same name would make ``flash_inductor.backend`` mean two things.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from .explanation import explain_with
from .passes.graph_pass import ChainedPass, FlashAttentionPass, RewriteOptions
from .passes.report import RewriteReport, one_report_per_compile
from .passes.site import relative_module_path


# The function the pass puts into graphs (passes/site.py). AOT autograd's cache refuses a graph
# that calls a function it does not know; torch 2.11 checks the graph after the pre-grad passes,
# so without this entry every warm start there retraced the whole joint graph
# (benchmarks/cold_start.py). It is keyed by the pass's uuid (our sources, the
# options, torch and Triton versions, the tuning tables): a cached graph holds what the call
# traced into, so any change to those must miss. The entry is one of this backend's config
# patches, like the pass itself.
_REWRITE_CALLS = ("flash_inductor.passes.site.rewritten_attention",
                  "flash_inductor.passes.site.packed_sequence_attention")


class FlashInductorBackend:
    """A torch.compile backend callable: ``backend(gm, example_inputs, mode=None, options=None)``.

    ``without_caches`` (used by :func:`flash_inductor.explain`) turns Inductor's FX graph cache
    off for this backend's compiles, and ``reports`` collects the report of each of them.
    """

    def __init__(self, options: RewriteOptions = RewriteOptions(), *, without_caches: bool = False):
        self.options = options
        self.graph_pass = FlashAttentionPass(options)
        self.without_caches = without_caches
        self.reports: Optional[list[RewriteReport]] = [] if without_caches else None
        # Per report: (parameter path relative to the compiled frame, the parameter itself) pairs,
        # which tell explain() where in the model a frame resumed after a graph break.
        self.frame_anchors: list[list[tuple[str, torch.Tensor]]] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], mode: Optional[str] = None,
                 options: Optional[dict] = None):
        from torch._inductor.compile_fx import compile_fx

        patches = self.config_patches(mode, options)
        with one_report_per_compile(verbose=self.options.report) as report:
            if self.reports is not None:
                self.reports.append(report)
                self.frame_anchors.append(_parameter_anchors(gm, example_inputs))
            return compile_fx(gm, example_inputs, config_patches=patches)

    def config_patches(self, mode: Optional[str] = None, options: Optional[dict] = None) -> dict[str, Any]:
        """The Inductor config this backend compiles under: torch.compile's mode and options, our
        pass first in the pre-grad passes, and the rewrite's call marked cacheable."""
        from torch._inductor import config as inductor_config

        patches: dict[str, Any] = {}
        if mode is not None:
            # torch.compile hands custom backends its mode/options untranslated; map them as
            # it would for Inductor itself.
            patches.update(torch._inductor.list_mode_options(mode))
        if options:
            patches.update(options)
        user_pass = patches.get("pre_grad_custom_pass", inductor_config.pre_grad_custom_pass)
        chained = [self.graph_pass]
        if user_pass is not None:
            chained.extend(user_pass if isinstance(user_pass, (list, tuple)) else [user_pass])
        patches["pre_grad_custom_pass"] = ChainedPass(chained) if len(chained) > 1 else self.graph_pass
        if self.without_caches:
            patches["fx_graph_cache"] = False
        elif hasattr(inductor_config, "unsafe_marked_cacheable_functions"):
            patches["unsafe_marked_cacheable_functions"] = {
                **patches.get("unsafe_marked_cacheable_functions", inductor_config.unsafe_marked_cacheable_functions),
                **{call: self.graph_pass.uuid() for call in _REWRITE_CALLS},
            }
        return patches

    def explain(self, fn_or_module: Callable, *args: Any, **kwargs: Any) -> RewriteReport:
        """:func:`flash_inductor.explain` with this backend's options."""
        return explain_with(FlashInductorBackend(self.options, without_caches=True), fn_or_module, args, kwargs)

    def __repr__(self) -> str:
        return f"flash_inductor.make_backend({self.options})"


def _parameter_anchors(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                       limit: int = 8) -> list[tuple[str, torch.Tensor]]:
    """Up to ``limit`` graph inputs that dynamo lifted from module attributes, as (path relative to
    the traced frame's module, the real tensor passed in). Sources are dynamo's, read defensively:
    a graph without them just yields no anchors."""
    anchors = []
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    for node, value in zip(placeholders, example_inputs):
        source = getattr(node.meta.get("grapharg"), "source", None)
        name = getattr(source, "name", None)
        name = name() if callable(name) else name
        if not isinstance(name, str) or not isinstance(value, torch.Tensor) or "_parameters" not in name:
            continue
        path = relative_module_path(name)
        if path:
            anchors.append((path, value))
        if len(anchors) >= limit:
            break
    return anchors


def make_backend(*, schedule: Optional[str] = None, devices: Sequence[str] = ("cuda", "cpu"),
                 report: bool = False, monitor: bool = False, compile_ahead: bool = True) -> FlashInductorBackend:
    """A configured backend.

    Args:
        schedule: precision schedule of the rewritten attention (None = the default, "stable").
        devices: device types whose attention is rewritten; others keep Inductor's lowering.
        report: show each compile's table of sites rewritten or kept (and why): logged at INFO
            on the "flash_inductor" logger where logging is set up to show that, else written to
            stderr. Without it only the one-line summary is logged at INFO, which Python's default
            logging hides (``logging.basicConfig(level=logging.INFO)`` shows it), and the table at
            DEBUG. ``flash_inductor.last_report()`` returns it either way.
        monitor: compile the recording ops of ``flash_inductor.monitor()`` into every rewritten
            site (named by its module path); calls record into the session active when they run,
            and into nothing outside one. Off by default: the graph is then exactly as without
            monitoring, even when compiled inside a session.
        compile_ahead: while Inductor compiles the rest of the graph, compile our attention
            kernels in one background process per compile (``python -m
            flash_inductor.ops.compile_ahead_worker``), which runs each rewritten site's op once,
            forward and (where trained) backward, on random tensors of the site's shapes, so that
            Triton's on-disk cache holds them when the graph first runs instead of the first step
            compiling them one after the other. CUDA only, never under ``TRITON_INTERPRET``, only
            from each node's first rank (``LOCAL_RANK``), and only calls whose replay fits a
            quarter of the free device memory (4 GiB at most). The worker exits when it is done,
            when this process exits, or after 10 minutes; it cannot change any result, and a
            kernel it has not compiled in time compiles at the first run as before. The INFO log
            says how many attention variants it got, its pid and its log file. Nothing starts when
            the compiled graph comes from the caches (the pass does not run; the kernels are cached
            then too). Off: no process at all.
    """
    return FlashInductorBackend(RewriteOptions(schedule=schedule, devices=tuple(devices), report=report,
                                               monitor=monitor, compile_ahead=compile_ahead))


backend = make_backend()


def explain(fn_or_module: Callable, *args: Any, **kwargs: Any) -> RewriteReport:
    """Compile ``fn_or_module`` with ``flash_inductor.backend``, call it once with ``*args`` and
    ``**kwargs``, and return the report of every attention site the pass saw.

    Args:
        fn_or_module: a function or an ``nn.Module``, as you would pass to ``torch.compile`` (a
            module ``torch.compile`` already returned is explained from its original).
        *args, **kwargs: its inputs. The call runs as is: in the caller's grad mode and with the
            module's own ``training`` flag, which decide what is compiled (dropout is only a
            site argument in training; ``no_grad`` may select other module paths).

    Returns:
        A :class:`~flash_inductor.passes.report.RewriteReport`: ``.sites`` (each with
        ``.pattern``, ``.status`` "rewritten" / "kept", ``.reason``, ``.module``), ``.rewritten``
        (the count), and ``str(report)``, a table. With graph breaks, the sites of every compiled
        graph are listed in order.

    The compile is fresh, never served from a cache: a new backend instance (so dynamo's cache,
    whose entries are guarded on the backend, cannot serve an earlier compile of the same code)
    with the AOTAutograd and FX graph caches turned off for this compile only. The new dynamo
    cache entry stays on the function's code like any other compile; a later
    ``torch.compile(model, backend=flash_inductor.backend)`` is unaffected by it.
    Use ``flash_inductor.make_backend(...).explain(...)`` to explain a configured backend.
    """
    return FlashInductorBackend().explain(fn_or_module, *args, **kwargs)
