"""The export tracer: ``torch.export.export(strict=False)``, made into a plain flat GraphModule.

It copes with Hugging Face models and most Python control flow on shapes; every module is
inlined into ATen ops. The exported program is unlifted, stripped of its guard and assert nodes
and of the non-tensor inputs export specialised, and given back the model's own tensors.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.utils import _pytree as pytree

from .capture import (
    Capture,
    cpu_fake,
    cpu_fake_state,
    drop_asserts,
    fill_output_val,
    on_meta,
)
from .fxutil import named_tensors, owner_of
from .hops import replace_mode_ops

__all__ = ["trace_export"]

log = logging.getLogger(__name__)


def trace_export(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Capture:
    """Capture ``model`` with ``torch.export.export(strict=False)`` as a flat ATen graph.

    The graph holds the model's own parameter and buffer objects (not export's copies), and
    non-tensor inputs export specialised are dropped from its placeholders.

    Raises:
        TypeError: a non-tensor input is still read by the graph.
        Exception: whatever ``torch.export`` raised.
    """
    if on_meta(model) or any(t.is_meta for t in _tensors((args, kwargs))):
        # On 'meta' some kernels report other strides than on a real device (attention outputs,
        # so Hugging Face's .contiguous() becomes a copy node): capture a meta model as if it
        # lived on the CPU, so that its graph -- node names and fingerprint included -- is the
        # graph of the same model with real weights, and a plan made on meta binds to it.
        mode = FakeTensorMode()
        fake_args, fake_kwargs = pytree.tree_map_only(torch.Tensor, lambda t: cpu_fake(mode, t), (args, kwargs))
        with cpu_fake_state(model, mode):
            ep = torch.export.export(model, fake_args, fake_kwargs, strict=False)
    else:
        ep = torch.export.export(model, args, kwargs, strict=False)
    unlifted = ep.module()
    graph = unlifted.graph
    out_spec = graph._codegen.pytree_info.out_spec  # type: ignore[attr-defined]
    # Plain calling convention: flat positional inputs in, flat tuple out (output args already are).
    graph._codegen = fx.graph.CodeGen()
    for node in list(graph.nodes):
        if node.op == "call_module" and str(node.target) == "_guards_fn":
            graph.erase_node(node)
    drop_asserts(graph)
    flat_inputs = pytree.tree_leaves((args, kwargs))
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    kept: list[torch.Tensor] = []
    for node, value in zip(placeholders, flat_inputs):
        if isinstance(value, torch.Tensor):
            kept.append(value)
        elif not node.users:  # a scalar export specialised into the graph
            graph.erase_node(node)
        else:
            raise TypeError(f"non-tensor input {node.name!r} = {value!r} is read by the graph")
    for node in list(graph.nodes):
        if node.op == "get_attr" and not node.users:
            graph.erase_node(node)
    flat_out = graph.output_node().args[0]
    if not isinstance(flat_out, (tuple, list)):
        graph.output_node().args = ((flat_out,),)
    gm = fx.GraphModule(unlifted, graph, type(model).__name__)
    _restore_originals(gm, model)
    # no_grad / autocast regions: torch's ops leave the mode changed when their body raises.
    replace_mode_ops(gm)
    missing = [n.name for n in gm.graph.nodes if n.op != "output" and "val" not in n.meta]
    if missing:
        log.debug("export left %d nodes without 'val'; propagating fake tensors", len(missing))
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with cpu_fake_state(gm, mode):
            FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*[cpu_fake(mode, t) for t in kept])
    fill_output_val(gm.graph)
    return Capture(gm, out_spec, kept)


def _restore_originals(gm: fx.GraphModule, model: nn.Module) -> None:
    """Point ``gm``'s attributes at the model's own tensors, whatever export held them as."""
    originals = named_tensors(model)
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        name = str(node.target)
        owner, leaf = owner_of(gm, name)
        current = getattr(owner, leaf)
        if name in originals and current is not originals[name]:
            if isinstance(originals[name], nn.Parameter):
                owner._parameters[leaf] = originals[name]  # type: ignore[assignment]
            else:
                owner._buffers[leaf] = originals[name]
        elif name not in originals and isinstance(current, FakeTensor):
            # A tensor constant made inside forward while tracing a meta model: no data either way.
            setattr(owner, leaf, torch.empty_strided(current.shape, current.stride(), dtype=current.dtype, device="meta"))


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]
