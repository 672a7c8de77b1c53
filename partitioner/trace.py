"""Capture a model as one flat FX graph with a fake-tensor shape on every node.

``trace`` tries ``torch.fx.symbolic_trace`` first (readable graphs of ``call_module`` nodes, user
leaf modules honoured) and falls back to ``torch.export.export(strict=False)`` (ATen graphs; copes
with Hugging Face models and most Python control flow on shapes). Either way the result is a plain
``fx.GraphModule`` that takes one positional argument per flattened input tensor and returns a
flat tuple; ``TracedModel.unflatten_outputs`` rebuilds the model's own output structure.

Shapes come from ``FakeTensorMode``: nothing is allocated, so a model built under
``torch.device('meta')`` traces as well as a real one. A meta model is captured as if it lived on
the CPU (fake CPU tensors), so its graph is exactly the graph of the same model with real weights.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import inspect
import logging
import operator
import os
import traceback
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.utils import _pytree as pytree

from .errors import TraceError

__all__ = ["InputMeta", "TracedModel", "trace", "retarget_device", "graph_fingerprint", "CausalLMLogits"]

log = logging.getLogger(__name__)

Method = Literal["auto", "fx", "export"]

# Nodes that check, rather than compute: export's guard module and metadata asserts, and the
# asserts fx inserts for specialised (concrete) arguments. A pipeline stage has no use for them
# and they carry device constants that would pin a stage to the tracing device.
_ASSERT_TARGETS: tuple[Any, ...] = (
    torch.ops.aten._assert_tensor_metadata.default,
    torch._assert,
    torch.fx._symbolic_trace._assert_is_none,
)
_TORCH_DIR = os.path.dirname(torch.__file__)
_MAX_REASON = 1200


@dataclass(frozen=True)
class InputMeta:
    """Shape and dtype of one flattened example input (no data is kept).

    Attributes:
        name: the placeholder name in the traced graph.
        shape: the example's shape.
        dtype: the dtype as a string, like ``'torch.int64'``.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True, eq=False)
class TracedModel:
    """A captured model: a flat GraphModule and what is needed to read it.

    Attributes:
        gm: the graph; one placeholder per flattened input tensor, the output node returns a flat
            tuple. Every node has ``meta['val']``: a FakeTensor, a tuple/list of them, or a Python
            scalar (the output node's is the tuple it returns).
        method: ``'fx'`` or ``'export'``, the tracer that produced ``gm``.
        input_names: placeholder names, in call order.
        out_spec: pytree spec of the model's original output (see ``unflatten_outputs``).
        param_aliases: for tensors the model holds under several names (tied weights): the name
            ``gm`` uses -> every name of that tensor in the original model, graph name first.
            Tensors with one name are absent.
        example_inputs: shapes and dtypes of the example inputs, in call order.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> t = trace(nn.Sequential(nn.Linear(4, 8), nn.ReLU()), (torch.randn(2, 4),))
        >>> t.method, t.input_names, [t.module_path(n) for n in t.gm.graph.nodes]
        ('fx', ('input_1',), ['', '0', '1', ''])
        >>> t.gm.graph.output_node().meta["val"][0].shape
        torch.Size([2, 8])
    """

    gm: fx.GraphModule
    method: Literal["fx", "export"]
    input_names: tuple[str, ...]
    out_spec: pytree.TreeSpec
    param_aliases: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    example_inputs: tuple[InputMeta, ...] = ()

    def module_path(self, node: fx.Node) -> str:
        """Qualified name of the innermost module ``node`` was traced in, ``''`` at top level."""
        if node.op == "call_module":
            return str(node.target)
        if node.op == "get_attr":
            return str(node.target).rpartition(".")[0]
        stack = node.meta.get("nn_module_stack")
        if not stack:
            return ""
        path, _ = list(stack.values())[-1]
        return _clean_path(str(path))

    def fingerprint(self) -> str:
        """sha256 over the graph's ops, targets, argument structure, shapes and dtypes.

        Stable across traces of the same model. Devices are left out and a meta model is captured
        as if on the CPU, so a plan made from a meta-device model matches the same model with
        real weights (a model on another device matches when its code takes the same path there).
        """
        return graph_fingerprint(self.gm.graph)

    def unflatten_outputs(self, flat: Sequence[Any]) -> Any:
        """Rebuild the model's output structure from the flat tuple ``gm`` returns."""
        return pytree.tree_unflatten(list(flat), self.out_spec)


def trace(
    model: nn.Module,
    example_inputs: tuple[Any, ...],
    *,
    example_kwargs: dict[str, Any] | None = None,
    leaf_modules: Sequence[type | str] = (),
    method: Method = "auto",
) -> TracedModel:
    """Capture ``model`` as a flat FX graph with fake-tensor shapes on every node.

    Args:
        model: the model, on any device including ``meta``. Its train/eval mode is what gets
            traced (dropout in training mode, for instance).
        example_inputs: one micro-batch of positional inputs (real, fake or meta tensors).
            A model on ``meta`` (and its inputs) is captured as if it lived on the CPU, with
            fake tensors, so its graph is the graph of the same model with real CPU weights.
        example_kwargs: keyword inputs. Non-tensor values are specialised into the graph.
        leaf_modules: module classes, or qualified names (``fnmatch`` patterns allowed, e.g.
            ``'h.*'``), to keep as single ``call_module`` nodes (fx only; export inlines all).
        method: ``'fx'``, ``'export'``, or ``'auto'`` (fx, then export if fx fails).

    Returns:
        a ``TracedModel``.

    Raises:
        TraceError: no tracer could capture the model; the message carries each tracer's error,
            where in the model it happened, and what to change.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> with torch.device("meta"):
        ...     big = nn.Sequential(nn.Linear(4096, 4096), nn.ReLU())
        >>> t = trace(big, (torch.randn(8, 4096),))
        >>> t.gm.graph.output_node().meta["val"][0].shape
        torch.Size([8, 4096])
    """
    if method not in ("auto", "fx", "export"):
        raise ValueError(f"method must be 'auto', 'fx' or 'export', got {method!r}")
    kwargs = dict(example_kwargs or {})
    args = tuple(example_inputs)
    if _on_meta(model):
        args, kwargs = pytree.tree_map_only(torch.Tensor, _to_meta, (args, kwargs))
    _check_leaf_names(model, leaf_modules)

    failures: list[tuple[str, BaseException]] = []
    if method in ("auto", "fx"):
        try:
            return _trace_fx(model, args, kwargs, leaf_modules)
        except Exception as e:  # any failure of fx means "try export" (or report it)
            log.info("torch.fx could not trace %s: %s", type(model).__name__, _first_line(e))
            failures.append(("torch.fx.symbolic_trace", e))
    if method in ("auto", "export"):
        if leaf_modules:
            log.warning(
                "leaf_modules %s are ignored: torch.export inlines every module", list(leaf_modules)
            )
        try:
            return _trace_export(model, args, kwargs)
        except Exception as e:
            failures.append(("torch.export.export(strict=False)", e))
    raise TraceError(_failure_message(model, failures, method))


def retarget_device(gm_or_graph: fx.GraphModule | fx.Graph, device: torch.device | str) -> int:
    """Point every device constant in the graph's calls at ``device``; returns how many changed.

    Export records the tracing device in factory calls (``arange`` for position ids, ``to``...):
    ``cpu`` for models on the CPU or on ``meta`` (captured as if on the CPU). Call this before
    running the graph, or a stage cut from it, on another device. A GraphModule is recompiled.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> class Pos(nn.Module):
        ...     def forward(self, x):
        ...         return x + torch.arange(x.shape[1], device=x.device)
        >>> t = trace(Pos(), (torch.zeros(2, 3, device="meta"),), method="export")
        >>> retarget_device(t.gm, "meta")
        1
        >>> t.gm(torch.zeros(2, 3, device="meta"))[0].device
        device(type='meta')
    """
    target = torch.device(device)
    graph = gm_or_graph.graph if isinstance(gm_or_graph, fx.GraphModule) else gm_or_graph
    changed = 0

    def swap(a: Any) -> Any:
        nonlocal changed
        if isinstance(a, torch.device) and a != target:
            changed += 1
            return target
        return a

    for node in graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        new_args = fx.node.map_aggregate(node.args, swap)
        new_kwargs = dict(node.kwargs)
        for key, value in node.kwargs.items():
            if key == "device" and isinstance(value, str):
                value = torch.device(value)
            new_kwargs[key] = fx.node.map_aggregate(value, swap)
        node.args, node.kwargs = new_args, new_kwargs
    if isinstance(gm_or_graph, fx.GraphModule):
        gm_or_graph.recompile()
    return changed


class CausalLMLogits(nn.Module):
    """Wrap a Hugging Face causal LM so that ``forward(input_ids)`` returns only the logits.

    Caching is off and a plain tensor comes back, which is what a pipeline needs. The wrapped
    model is the ``model`` attribute, so parameter names gain a ``model.`` prefix.

    Example:
        >>> import transformers  # doctest: +SKIP
        >>> cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128)  # doctest: +SKIP
        >>> lm = CausalLMLogits(transformers.GPT2LMHeadModel(cfg))  # doctest: +SKIP
        >>> lm(torch.zeros(1, 8, dtype=torch.long)).shape  # doctest: +SKIP
        torch.Size([1, 8, 128])
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids, use_cache=False, return_dict=True)
        return out.logits  # type: ignore[no-any-return]


def graph_fingerprint(graph: fx.Graph) -> str:
    """sha256 of ``graph``'s structure, shapes and dtypes (see ``TracedModel.fingerprint``)."""
    index: dict[fx.Node, int] = {}
    h = hashlib.sha256()
    for i, node in enumerate(graph.nodes):
        index[node] = i
        record = (
            node.op,
            _target_str(node.target),
            _structure(node.args, index),
            _structure(node.kwargs, index),
            _val_signature(node.meta.get("val")),
        )
        h.update(repr(record).encode())
        h.update(b"\n")
    return h.hexdigest()


# --- fx ------------------------------------------------------------------------------------------


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


def _trace_fx(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    leaf_modules: Sequence[type | str],
) -> TracedModel:
    sig = inspect.signature(model.forward)
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in sig.parameters.values()):
        raise TypeError(f"forward{sig} takes *args/**kwargs, which fx cannot bind to inputs")
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    tensors: dict[str, torch.Tensor] = {}
    concrete: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        if isinstance(value, torch.Tensor):
            tensors[name] = value
        elif any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(value)):
            raise TypeError(f"input {name!r} nests tensors in a {type(value).__name__}; fx takes flat tensors")
        else:
            concrete[name] = value

    tracer = _LeafTracer(leaf_modules)
    graph = tracer.trace(model, concrete_args=concrete or None)
    gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
    _drop_asserts(gm.graph)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    # fx keeps a placeholder per signature argument; the specialised ones are now unused.
    inputs: list[torch.Tensor] = []
    for node, name in zip(placeholders, bound.arguments):
        if name in tensors:
            inputs.append(tensors[name])
        elif node.users:
            raise TypeError(f"argument {name!r} was specialised to {concrete[name]!r} but is still read")
        else:
            gm.graph.erase_node(node)
    out_spec = _flatten_output(gm.graph)
    gm.recompile()

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with _cpu_fake_state(gm, mode):  # a meta model is shaped as if on the CPU, as in export
        _LeafTolerantProp(gm, mode).propagate_dont_convert_inputs(*[_cpu_fake(mode, t) for t in inputs])
    _fill_output_val(gm.graph)
    return _traced(model, gm, "fx", out_spec, inputs)


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
                "CPU tensors to learn its output shapes", target, type(module).__name__, _first_line(e),
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


# --- export --------------------------------------------------------------------------------------


def _trace_export(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> TracedModel:
    if _on_meta(model) or any(t.is_meta for t in _tensors((args, kwargs))):
        # On 'meta' some kernels report other strides than on a real device (attention outputs,
        # so Hugging Face's .contiguous() becomes a copy node): capture a meta model as if it
        # lived on the CPU, so that its graph -- node names and fingerprint included -- is the
        # graph of the same model with real weights, and a plan made on meta binds to it.
        mode = FakeTensorMode()
        fake_args, fake_kwargs = pytree.tree_map_only(torch.Tensor, lambda t: _cpu_fake(mode, t), (args, kwargs))
        with _cpu_fake_state(model, mode):
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
    _drop_asserts(graph)
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
    missing = [n.name for n in gm.graph.nodes if n.op != "output" and "val" not in n.meta]
    if missing:
        log.debug("export left %d nodes without 'val'; propagating fake tensors", len(missing))
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with _cpu_fake_state(gm, mode):
            FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*[_cpu_fake(mode, t) for t in kept])
    _fill_output_val(gm.graph)
    return _traced(model, gm, "export", out_spec, kept)


# --- shared --------------------------------------------------------------------------------------


def _traced(
    model: nn.Module,
    gm: fx.GraphModule,
    method: Literal["fx", "export"],
    out_spec: pytree.TreeSpec,
    inputs: list[torch.Tensor],
) -> TracedModel:
    gm.graph.lint()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, t in zip(placeholders, inputs):
        val = node.meta.get("val")
        # Shape propagation detaches; remember which inputs the caller wants gradients for.
        if isinstance(val, torch.Tensor) and t.requires_grad and not val.requires_grad:
            val.requires_grad_(True)
    names = tuple(n.name for n in placeholders)
    metas = tuple(
        InputMeta(name, tuple(int(d) for d in t.shape), str(t.dtype)) for name, t in zip(names, inputs)
    )
    return TracedModel(
        gm=gm,
        method=method,
        input_names=names,
        out_spec=out_spec,
        param_aliases=_aliases(model, gm),
        example_inputs=metas,
    )


def _aliases(model: nn.Module, gm: fx.GraphModule) -> dict[str, tuple[str, ...]]:
    """Graph name -> all names of that tensor in ``model``, for tensors with more than one name."""
    names_of: dict[int, list[str]] = {}
    for name, t in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)):
        names_of.setdefault(id(t), []).append(name)
    used: list[str] = []
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            used.append(str(node.target))
        elif node.op == "call_module":
            sub = gm.get_submodule(str(node.target))
            prefix = f"{node.target}."
            used.extend(prefix + n for n, _ in sub.named_parameters(remove_duplicate=False))
            used.extend(prefix + n for n, _ in sub.named_buffers(remove_duplicate=False))
    model_tensors: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    model_tensors.update(model.named_buffers(remove_duplicate=False))
    aliases: dict[str, tuple[str, ...]] = {}
    for name in used:
        found = model_tensors.get(name)
        group = names_of.get(id(found), []) if found is not None else []
        if len(group) > 1:
            aliases[name] = (name, *(n for n in group if n != name))
    return aliases


def _drop_asserts(graph: fx.Graph) -> None:
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and node.target in _ASSERT_TARGETS and not node.users:
            inputs = node.all_input_nodes
            graph.erase_node(node)
            # The comparison feeding an assert is dead once the assert is gone.
            for a in inputs:
                if a.op == "call_function" and a.target is operator.eq and not a.users:
                    graph.erase_node(a)


def _flatten_output(graph: fx.Graph) -> pytree.TreeSpec:
    out = graph.output_node()
    flat, spec = pytree.tree_flatten(out.args[0])
    out.args = (tuple(flat),)
    return spec


def _fill_output_val(graph: fx.Graph) -> None:
    out = graph.output_node()
    flat: Sequence[Any] = out.args[0]  # type: ignore[assignment]
    out.meta["val"] = tuple(a.meta.get("val") if isinstance(a, fx.Node) else a for a in flat)


def _cpu_fake(mode: FakeTensorMode, t: torch.Tensor) -> torch.Tensor:
    """A fake tensor that claims the CPU; a meta tensor is wrapped directly, allocating nothing."""
    if not t.is_meta:
        return mode.from_tensor(t)
    fake = FakeTensor(mode, t.detach(), torch.device("cpu"))
    if isinstance(t, nn.Parameter):
        return nn.Parameter(fake, requires_grad=t.requires_grad)
    return fake.requires_grad_(t.requires_grad) if t.requires_grad else fake


@contextlib.contextmanager
def _cpu_fake_state(model: nn.Module, mode: FakeTensorMode) -> Iterator[None]:
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
                        fakes[id(t)] = _cpu_fake(mode, t)
                    swapped.append((store, key, t))
                    store[key] = fakes[id(t)]
        yield
    finally:
        for store, key, t in swapped:
            store[key] = t


def _restore_originals(gm: fx.GraphModule, model: nn.Module) -> None:
    """Point ``gm``'s attributes at the model's own tensors, whatever export held them as."""
    originals: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    originals.update(model.named_buffers(remove_duplicate=False))
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        name = str(node.target)
        owner_name, _, leaf = name.rpartition(".")
        owner = gm.get_submodule(owner_name) if owner_name else gm
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


def _on_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def _to_meta(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_meta else torch.empty_like(t, device="meta").requires_grad_(t.requires_grad)


def _check_leaf_names(model: nn.Module, leaf_modules: Sequence[type | str]) -> None:
    names = [n for n, _ in model.named_modules() if n]
    for item in leaf_modules:
        if isinstance(item, str) and not any(fnmatch.fnmatchcase(n, item) for n in names):
            close = [n for n in names if item.split(".")[-1] in n][:5] or names[:5]
            raise TraceError(
                f"leaf_modules entry {item!r} matches no submodule of {type(model).__name__}; "
                f"give a qualified name from model.named_modules(), e.g. {close}"
            )
        if not isinstance(item, (str, type)):
            raise TraceError(
                f"leaf_modules entries must be module classes or qualified names, got {item!r}"
            )


def _clean_path(path: str) -> str:
    # Dynamo-style stacks spell the root L['self'] or L__self__; repeated calls add '@N'.
    for prefix in ("L['self'].", "L__self__."):
        path = path.removeprefix(prefix)
    if path in ("L['self']", "L__self__"):
        return ""
    return path.split("@")[0]


def _target_str(target: Any) -> str:
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    try:
        return fx.node._get_qualified_name(target)
    except Exception:  # builtins without a module; avoid reprs with memory addresses
        return getattr(target, "__qualname__", type(target).__name__)


def _structure(a: Any, index: Mapping[fx.Node, int]) -> Any:
    if isinstance(a, fx.Node):
        return f"%{index[a]}"
    if isinstance(a, (tuple, list)):
        return (type(a).__name__, tuple(_structure(b, index) for b in a))
    if isinstance(a, dict):
        return tuple((str(k), _structure(v, index)) for k, v in a.items())
    if isinstance(a, slice):
        return ("slice", _structure((a.start, a.stop, a.step), index))
    if isinstance(a, torch.device):
        return "<device>"
    if a is None or isinstance(a, (bool, int, float, str, torch.dtype, torch.layout, torch.memory_format)):
        return repr(a)
    return type(a).__qualname__


def _val_signature(val: Any) -> Any:
    if isinstance(val, torch.Tensor):
        return (tuple(int(d) for d in val.shape), str(val.dtype))
    if isinstance(val, (tuple, list)):
        return tuple(_val_signature(v) for v in val)
    if val is None or isinstance(val, (bool, int, float, str)):
        return repr(val)
    return type(val).__qualname__


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _user_frame(e: BaseException) -> str:
    """The innermost traceback frame outside torch and this module, as 'file:line in fn: code'."""
    here = os.path.abspath(__file__)
    found = ""
    seen: set[int] = set()
    exc: BaseException | None = e
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        for fr in traceback.extract_tb(exc.__traceback__):
            path = os.path.abspath(fr.filename)
            if path.startswith(_TORCH_DIR) or path == here or "<" in fr.filename:
                continue
            found = f"{fr.filename}:{fr.lineno} in {fr.name}: {(fr.line or '').strip()}"
        exc = exc.__cause__ or exc.__context__
    return found


def _failure_message(model: nn.Module, failures: list[tuple[str, BaseException]], method: str) -> str:
    lines = [f"could not trace {type(model).__name__} (method={method!r})."]
    for tracer, e in failures:
        reason = str(e).strip() or type(e).__name__
        if len(reason) > _MAX_REASON:
            reason = reason[:_MAX_REASON] + " ..."
        where = _user_frame(e)
        lines.append(f"- {tracer} failed with {type(e).__name__}: {reason}")
        if where:
            lines.append(f"  at {where}")
    lines.append(
        "To fix: mark the module that holds the failing code as a leaf, "
        "trace(..., leaf_modules=[TheModuleClass or 'its.qualified.name']) (fx keeps leaves as "
        "single nodes); or make it exportable (replace Python control flow on tensor values with "
        "torch.where / torch.cond, avoid .item() and data-dependent shapes) and use "
        "method='export'."
    )
    return "\n".join(lines)
