"""The export tracer: ``torch.export.export(strict=False)``, made into a plain flat GraphModule.

It copes with Hugging Face models and most Python control flow on shapes; every module is
inlined into ATen ops. The exported program is unlifted, stripped of its guard and assert nodes
and of the non-tensor inputs export specialised, and given back the model's own tensors.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.export import Dim
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.utils import _pytree as pytree

from partitioner.errors import TraceInputError
from partitioner.tracing.capture import (
    Capture,
    cpu_fake,
    cpu_fake_state,
    drop_asserts,
    fill_output_val,
    on_meta,
)
from partitioner.tracing.failures import first_line
from partitioner.tracing.fxutil import named_tensors, owner_of
from partitioner.tracing.guards import take_size_guards
from partitioner.tracing.hops import replace_mode_ops

__all__ = ["trace_export"]

log = logging.getLogger(__name__)


def trace_export(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    shape_args: tuple[Any, ...] | None = None,
    shape_kwargs: dict[str, Any] | None = None,
    dynamic: bool = True,
) -> Capture:
    """Capture ``model`` with ``torch.export.export(strict=False)`` as a flat ATen graph.

    The graph holds the model's own parameter and buffer objects (not export's copies), and
    non-tensor inputs export specialised are dropped from its placeholders.

    With ``dynamic``, every tensor input's first dimension (the batch) and the second dimension of
    integer inputs (token ids and masks: the sequence) are exported as ``Dim.AUTO``: dynamic where
    the model allows it, specialised where it does not (``Capture.dynamic_dims`` says which). An
    example batch of 1 is exported as a batch of 2 (repeated rows), since export specialises sizes
    of 1. The recorded shapes (``meta['val']``) are then those of ``shape_args``/``shape_kwargs``
    (default: the example): one micro-batch.

    Raises:
        TraceInputError: a non-tensor input is still read by the graph (a ``TypeError``).
        Exception: whatever ``torch.export`` raised.
    """
    if shape_args is None:
        shape_args, shape_kwargs = args, kwargs
    shape_kwargs = dict(shape_kwargs or {})
    # Export's guards describe the example tensors themselves, strides and views included: a view
    # (``x[:, :-1]``) would get guards on its base. Export plain contiguous tensors, so the guards
    # are about sizes only (``guards.SizeGuards`` checks micro-batches against them).
    args, kwargs, shape_args, shape_kwargs = pytree.tree_map_only(
        torch.Tensor, _plain_tensor, (args, kwargs, shape_args, shape_kwargs)
    )
    ep = _export_dynamic_or_static(model, args, kwargs, shape_args, shape_kwargs, dynamic=dynamic)
    unlifted = ep.module()
    graph = unlifted.graph
    flat = pytree.tree_leaves((shape_args, shape_kwargs))
    guards = take_size_guards(graph, unlifted, flat)
    out_spec = _plain_graph(graph)
    kept, dynamic_dims = _tensor_inputs(graph, flat)
    gm = fx.GraphModule(unlifted, graph, type(model).__name__)
    _restore_originals(gm, model)
    # no_grad / autocast regions: torch's ops leave the mode changed when their body raises.
    replace_mode_ops(gm)
    _record_shapes(gm, kept, dynamic_dims)
    return Capture(gm, out_spec, kept, tuple(dynamic_dims), guards if any(dynamic_dims) else None)


def _export_dynamic_or_static(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    shape_args: tuple[Any, ...],
    shape_kwargs: dict[str, Any],
    *,
    dynamic: bool,
) -> Any:
    """Export with a dynamic batch (and sequence); if that fails, with the static micro-batch shapes."""
    if dynamic:
        args, kwargs = _widen_unit_batch(args, kwargs)
    specs = _dynamic_specs(model, args, kwargs) if dynamic else None
    try:
        return _export(model, args, kwargs, specs)
    except Exception as e:
        if specs is None:
            raise
        log.info("export with a dynamic batch failed (%s); exporting with static shapes", first_line(e))
        return _export(model, shape_args, shape_kwargs, None)


def _plain_graph(graph: fx.Graph) -> Any:
    """Strip export's assert and unused attribute nodes, and use the plain calling convention.

    The guard call is taken out before, with its function kept (``guards.take_size_guards``).
    Returns the output's pytree spec, which the plain convention no longer applies.
    """
    # An exported graph's codegen is a _PyTreeCodeGen (typed as the base CodeGen): it has pytree_info.
    out_spec = graph._codegen.pytree_info.out_spec  # type: ignore[attr-defined]
    # Plain calling convention: flat positional inputs in, flat tuple out (output args already are).
    graph._codegen = fx.graph.CodeGen()
    drop_asserts(graph)
    for node in list(graph.nodes):
        if node.op == "get_attr" and not node.users:
            graph.erase_node(node)
    flat_out = graph.output_node().args[0]
    if not isinstance(flat_out, (tuple, list)):
        graph.output_node().args = ((flat_out,),)
    return out_spec


def _tensor_inputs(graph: fx.Graph, flat_inputs: list[Any]) -> tuple[list[torch.Tensor], list[tuple[int, ...]]]:
    """Keep the tensor inputs' placeholders and drop the scalars export specialised.

    Returns the tensor inputs and, for each, the dimensions export left dynamic.
    """
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    kept: list[torch.Tensor] = []
    dynamic_dims: list[tuple[int, ...]] = []
    for node, value in zip(placeholders, flat_inputs):
        if isinstance(value, torch.Tensor):
            kept.append(value)
            traced = node.meta.get("val")
            shape = tuple(traced.shape) if isinstance(traced, torch.Tensor) else ()
            dynamic_dims.append(tuple(i for i, d in enumerate(shape) if not isinstance(d, int)))
        elif not node.users:  # a scalar export specialised into the graph
            graph.erase_node(node)
        else:
            raise TraceInputError(f"non-tensor input {node.name!r} = {value!r} is read by the graph")
    return kept, dynamic_dims


def _record_shapes(gm: fx.GraphModule, kept: list[torch.Tensor], dynamic_dims: list[tuple[int, ...]]) -> None:
    """Give every node ``meta['val']`` of the micro-batch's shapes where export left none or symbolic ones."""
    missing = [n.name for n in gm.graph.nodes if n.op != "output" and "val" not in n.meta]
    if missing or any(dynamic_dims):
        # Symbolic sizes (or none) on the nodes: record the shapes of one micro-batch, which is
        # what the cost model and the wire specs describe.
        log.debug("propagating fake tensors of the micro-batch shapes (%d nodes had no 'val')", len(missing))
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with cpu_fake_state(gm, mode):
            FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*[cpu_fake(mode, t) for t in kept])
    fill_output_val(gm.graph)


def _export(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], specs: Any) -> Any:
    if on_meta(model) or any(t.is_meta for t in _tensors((args, kwargs))):
        # On 'meta' some kernels report other strides than on a real device (attention outputs,
        # so Hugging Face's .contiguous() becomes a copy node): capture a meta model as if it
        # lived on the CPU, so that its graph -- node names and fingerprint included -- is the
        # graph of the same model with real weights, and a plan made on meta binds to it.
        mode = FakeTensorMode()
        fake_args, fake_kwargs = pytree.tree_map_only(torch.Tensor, lambda t: cpu_fake(mode, t), (args, kwargs))
        with cpu_fake_state(model, mode):
            return torch.export.export(model, fake_args, fake_kwargs, dynamic_shapes=specs, strict=False)
    return torch.export.export(model, args, kwargs, dynamic_shapes=specs, strict=False)


def _dynamic_specs(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``dynamic_shapes`` for export, by ``forward``'s parameter names (export binds the inputs to
    the signature: keywords in signature order, the ones ``**kwargs`` takes as one dict, as a
    Hugging Face model's ``return_dict``); positional specs, then keyword specs in order, when
    the signature cannot be read or bound."""

    def spec(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return None
        dims = {0: Dim.AUTO}
        if t.dim() >= 2 and not (t.is_floating_point() or t.is_complex()):
            dims[1] = Dim.AUTO  # token ids, attention masks: (batch, sequence)
        return dims

    try:
        params = inspect.signature(model.forward).parameters
        bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return tuple(pytree.tree_map(spec, a) for a in (*args, *kwargs.values()))
    specs: dict[str, Any] = {}
    for name, value in bound.items():
        kind = params[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            specs[name] = {k: pytree.tree_map(spec, v) for k, v in value.items()}
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            specs[name] = tuple(pytree.tree_map(spec, v) for v in value)
        else:
            specs[name] = pytree.tree_map(spec, value)
    return specs


def _widen_unit_batch(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The example with a batch of 2 (rows repeated) when every batched input has a batch of 1."""
    batched = [t for t in _tensors((args, kwargs)) if t.dim() >= 1]
    if not batched or any(t.shape[0] != 1 for t in batched):
        return args, kwargs

    def widen(t: torch.Tensor) -> torch.Tensor:
        return t.repeat(2, *([1] * (t.dim() - 1))) if t.dim() >= 1 else t

    widened: tuple[tuple[Any, ...], dict[str, Any]] = pytree.tree_map_only(torch.Tensor, widen, (args, kwargs))
    return widened


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
            original = originals[name]
            if isinstance(original, nn.Parameter):
                owner._parameters[leaf] = original
            else:
                owner._buffers[leaf] = original
        elif name not in originals and isinstance(current, FakeTensor):
            # A tensor constant made inside forward while tracing a meta model: no data either way.
            empty = torch.empty_strided(current.shape, current.stride(), dtype=current.dtype, device="meta")
            setattr(owner, leaf, empty)


def _plain_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself if it is contiguous and no view, else a contiguous copy (same ``requires_grad``)."""
    if t._base is None and t.is_contiguous():
        return t
    return t.detach().clone(memory_format=torch.contiguous_format).requires_grad_(t.requires_grad)


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]
