"""The fx tracer: ``torch.fx.symbolic_trace`` with user leaf modules, shaped by fake tensors.

Its graphs are readable (``call_module`` nodes, one per leaf) and a module fx cannot look into
can be kept whole by naming it a leaf; a leaf that fake tensors cannot run (data-dependent code)
is run once for real on random CPU tensors to learn its output shapes.
"""

from __future__ import annotations

import fnmatch
import inspect
import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.utils import _pytree as pytree

from partitioner.errors import ModeRegionError, TraceInputError
from partitioner.tracing import hops
from partitioner.tracing.capture import (
    Capture,
    cpu_fake,
    cpu_fake_state,
    drop_asserts,
    fill_output_val,
    flatten_output,
)
from partitioner.tracing.failures import first_line

__all__ = ["trace_fx"]

log = logging.getLogger(__name__)


class _LeafTracer(fx.Tracer):
    """fx Tracer that also treats the user's classes and qualified names as leaves."""

    def __init__(self, leaf_modules: Sequence[type | str]) -> None:
        super().__init__()
        self._types = tuple(x for x in leaf_modules if isinstance(x, type))
        self._names = tuple(x for x in leaf_modules if isinstance(x, str))

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if self._types and isinstance(m, self._types):
            return True
        if any(fnmatch.fnmatchcase(module_qualified_name, p) for p in self._names):
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def trace(self, root: Any, concrete_args: dict[str, Any] | None = None) -> fx.Graph:
        self._modes = _modes()
        return super().trace(root, concrete_args)

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        # fx runs `with torch.no_grad()` / `torch.autocast(...)` while tracing and records none of
        # it: the graph would compute that region with gradients (or in another dtype). Refuse,
        # so that trace(method='auto') takes torch.export, which keeps such regions.
        now = _modes()
        if now != self._modes:
            raise ModeRegionError(
                "the forward changes grad mode or autocast inside (a torch.no_grad() or "
                f"torch.autocast region: {self._modes} -> {now}), which torch.fx cannot record; "
                "trace with method='export'"
            )
        node = super().create_node(*args, **kwargs)
        # A node traced inside torch.utils.checkpoint: its module is checkpointed (the tracer
        # records no checkpoint, and a leaf module runs no forward hook to see it by).
        inside = next(reversed(self.module_stack.values()), ("",))[0]
        hops.note(str(node.target) if node.op == "call_module" else inside)
        return node


def _modes() -> tuple[bool, bool, bool]:
    return torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"), torch.is_autocast_enabled("cuda")


def trace_fx(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    leaf_modules: Sequence[type | str],
) -> Capture:
    """Capture ``model`` with ``torch.fx.symbolic_trace``, keeping ``leaf_modules`` whole.

    Tensor arguments become placeholders; every other argument is specialised into the graph.
    Shapes come from fake-tensor propagation (a leaf fake tensors cannot run runs for real).

    Raises:
        TraceInputError: ``forward`` takes ``*args``/``**kwargs``, nests tensors in an argument, or
            still reads an argument that was specialised (a ``TypeError``).
        ModeRegionError: ``forward`` enters a ``torch.no_grad()`` or ``torch.autocast`` region.
        Exception: whatever ``symbolic_trace`` or shape propagation raised.
    """
    sig = inspect.signature(model.forward)
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in sig.parameters.values()):
        raise TraceInputError(f"forward{sig} takes *args/**kwargs, which fx cannot bind to inputs")
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    tensors: dict[str, torch.Tensor] = {}
    concrete: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        if isinstance(value, torch.Tensor):
            tensors[name] = value
        elif any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(value)):
            raise TraceInputError(f"input {name!r} nests tensors in a {type(value).__name__}; fx takes flat tensors")
        else:
            concrete[name] = value

    tracer = _LeafTracer(leaf_modules)
    tracer.record_stack_traces = True  # each node keeps its source line, for errors raised at run time
    own_attrs = set(vars(model))
    try:
        graph = tracer.trace(model, concrete_args=concrete or None)
        gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
    finally:
        # fx parks tensors the forward makes (`torch.tensor(...)`) on the model as
        # `_tensor_constantN`; the GraphModule has its own reference, the model keeps none.
        for name in set(vars(model)) - own_attrs:
            delattr(model, name)
    drop_asserts(gm.graph)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    # fx keeps a placeholder per signature argument; the specialised ones are now unused.
    inputs: list[torch.Tensor] = []
    for node, name in zip(placeholders, bound.arguments):
        if name in tensors:
            inputs.append(tensors[name])
        elif node.users:
            raise TraceInputError(f"argument {name!r} was specialised to {concrete[name]!r} but is still read")
        else:
            gm.graph.erase_node(node)
    out_spec = flatten_output(gm.graph)
    gm.recompile()

    # The model's own (real) buffers are read here, and a 0-dim one written in place stays
    # written under fake tensors (BatchNorm's num_batches_tracked); trace() runs inside
    # preserved(model), which puts every buffer back.
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with cpu_fake_state(gm, mode):  # a meta model is shaped as if on the CPU, as in export
        _LeafTolerantProp(gm, mode).propagate_dont_convert_inputs(*[cpu_fake(mode, t) for t in inputs])
    fill_output_val(gm.graph)
    return Capture(gm, out_spec, inputs)


class _LeafTolerantProp(FakeTensorProp):
    """FakeTensorProp that runs a leaf module fake tensors cannot (data-dependent code) for real.

    The module runs once on random CPU inputs and random weights of the recorded shapes; only
    the shapes of its outputs are kept. That is what lets a user fix a failing trace by marking
    the offending module as a leaf.
    """

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        try:
            return super().call_module(target, args, kwargs)
        except Exception as e:
            module = self.fetch_attr(target)
            log.warning(
                "leaf module %s (%s) cannot run on fake tensors (%s); running it once on random "
                "CPU tensors to learn its output shapes", target, type(module).__name__, first_line(e),
            )
            return _run_for_real(module, args, kwargs, self._mode)


def _run_for_real(module: nn.Module, args: Any, kwargs: Any, mode: FakeTensorMode) -> Any:
    def real(t: torch.Tensor) -> torch.Tensor:
        if t.dtype.is_floating_point or t.dtype.is_complex:
            return torch.randn(t.shape, dtype=t.dtype)
        return torch.zeros(t.shape, dtype=t.dtype)

    devices = [t.device for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    with unset_fake_temporarily(), torch.no_grad():
        state = {n: real(t) for n, t in (*module.named_parameters(), *module.named_buffers())}
        out = torch.func.functional_call(
            module, state, pytree.tree_map_only(torch.Tensor, real, args),
            pytree.tree_map_only(torch.Tensor, real, kwargs),
        )
    device = devices[0] if devices else torch.device("cpu")
    with mode:
        return pytree.tree_map_only(
            torch.Tensor, lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device), out
        )
