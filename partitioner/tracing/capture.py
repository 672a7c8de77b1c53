"""The form both tracers bring a captured graph to: flat in, flat out, no asserts, meta seen as CPU.

Whichever tracer made it, a capture takes one positional argument per input tensor, returns a flat
tuple, carries a fake-tensor ``meta['val']`` on every node, and holds no assert nodes. A model on
``meta`` is captured as if it lived on the CPU: its parameters and inputs become fake CPU tensors
that allocate nothing, so its graph is the graph of the same model with real CPU weights.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils import _pytree as pytree

from partitioner.tracing.guards import SizeGuards

__all__ = [
    "Capture", "drop_asserts", "flatten_output", "fill_output_val",
    "cpu_fake", "cpu_fake_state", "on_meta", "to_meta",
]

# Nodes that check, rather than compute: export's guard module and metadata asserts, and the
# asserts fx inserts for specialised (concrete) arguments. A pipeline stage has no use for them
# and they carry device constants that would pin a stage to the tracing device.
_ASSERT_TARGETS: tuple[Any, ...] = (
    torch.ops.aten._assert_tensor_metadata.default,
    torch._assert,
    torch.fx._symbolic_trace._assert_is_none,
)


@dataclass(frozen=True, eq=False)
class Capture:
    """What a tracer hands back to ``trace``.

    Attributes:
        gm: the flat graph (see the module docstring).
        out_spec: pytree spec of the model's original output.
        inputs: the example tensors of one micro-batch, one per placeholder, in call order.
        dynamic_dims: per input, the dimensions the graph leaves free (any size runs); ``None``
            when the tracer does not fix sizes at all (fx: only the ops decide).
        size_guards: export's guards on those free sizes (``guards.SizeGuards``): the graph holds
            only where they do; ``None`` when the tracer recorded none.
    """

    gm: fx.GraphModule
    out_spec: pytree.TreeSpec
    inputs: list[torch.Tensor]
    dynamic_dims: tuple[tuple[int, ...], ...] | None = None
    size_guards: SizeGuards | None = None


def drop_asserts(graph: fx.Graph) -> None:
    """Erase unused assert nodes, and the comparisons that only fed them."""
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and node.target in _ASSERT_TARGETS and not node.users:
            inputs = node.all_input_nodes
            graph.erase_node(node)
            # The comparison feeding an assert is dead once the assert is gone.
            for a in inputs:
                if a.op == "call_function" and a.target is operator.eq and not a.users:
                    graph.erase_node(a)


def flatten_output(graph: fx.Graph) -> pytree.TreeSpec:
    """Make the output node return a flat tuple; returns the spec of what it returned before."""
    out = graph.output_node()
    flat, spec = pytree.tree_flatten(out.args[0])
    out.args = (tuple(flat),)
    return spec


def fill_output_val(graph: fx.Graph) -> None:
    """Set the output node's ``meta['val']`` to the tuple of values it returns."""
    out = graph.output_node()
    flat = cast("Sequence[Any]", out.args[0])  # flat by now: flatten_output's, or export's own convention
    out.meta["val"] = tuple(a.meta.get("val") if isinstance(a, fx.Node) else a for a in flat)


def cpu_fake(mode: FakeTensorMode, t: torch.Tensor) -> torch.Tensor:
    """A fake tensor that claims the CPU; a meta tensor is wrapped directly, allocating nothing."""
    if not t.is_meta:
        return mode.from_tensor(t)
    fake = FakeTensor(mode, t.detach(), torch.device("cpu"))
    if isinstance(t, nn.Parameter):
        return nn.Parameter(fake, requires_grad=t.requires_grad)
    return fake.requires_grad_(t.requires_grad) if t.requires_grad else fake


@contextlib.contextmanager
def cpu_fake_state(model: nn.Module, mode: FakeTensorMode) -> Iterator[None]:
    """Swap the model's meta parameters and buffers for CPU fakes in place (ties kept), and back."""
    fakes: dict[int, torch.Tensor] = {}
    swapped: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    try:
        for module in model.modules():
            stores: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
            for store in stores:
                for key, t in list(store.items()):
                    if t is None or not t.is_meta:
                        continue
                    if id(t) not in fakes:
                        fakes[id(t)] = cpu_fake(mode, t)
                    swapped.append((store, key, t))
                    store[key] = fakes[id(t)]
        yield
    finally:
        for store, key, t in swapped:
            store[key] = t


def on_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` lives on ``meta``."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def to_meta(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a meta tensor (itself if already one), keeping ``requires_grad``."""
    return t if t.is_meta else torch.empty_like(t, device="meta").requires_grad_(t.requires_grad)
