"""Capture a model as one flat FX graph with a fake-tensor shape on every node.

``trace`` tries ``torch.fx.symbolic_trace`` first (readable graphs of ``call_module`` nodes, user
leaf modules honoured) and falls back to ``torch.export.export(strict=False)`` (ATen graphs; copes
with Hugging Face models and most Python control flow on shapes; a ``transformers`` model goes
straight to export, its cache off: ``hf``). Either way the result is a plain
``fx.GraphModule`` that takes one positional argument per flattened input tensor and returns a
flat tuple; ``TracedModel.unflatten_outputs`` rebuilds the model's own output structure. The two
tracers live in ``fx_trace`` and ``export_trace``; the form they share, in ``capture``.

Shapes come from ``FakeTensorMode``: nothing is allocated, so a model built under
``torch.device('meta')`` traces as well as a real one. A meta model is captured as if it lived on
the CPU (fake CPU tensors), so its graph is exactly the graph of the same model with real weights.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from partitioner.errors import ReentrantCheckpointError, TraceError, TraceOptionError
from partitioner.tracing import capture, export_trace, fx_trace, hf, hops
from partitioner.tracing.capture import Capture, on_meta, to_meta
from partitioner.tracing.failures import first_line, trace_failure_message
from partitioner.tracing.fingerprint import graph_fingerprint
from partitioner.tracing.fxutil import named_tensors
from partitioner.tracing.globalstate import preserved
from partitioner.tracing.guards import SizeGuards
from partitioner.tracing.hops import bodies, run_with_autocast

__all__ = [
    "InputMeta", "TracedModel", "trace", "first_microbatch", "retarget_device", "retargeted", "graph_fingerprint",
    "CausalLMLogits", "node_module_path", "clean_module_path", "module_call_index",
]

log = logging.getLogger(__name__)

Method = Literal["auto", "fx", "export"]

# Frames in the tracing modules are ours, not the user's: a TraceError points past them.
_TRACER_FILES = frozenset(
    os.path.abspath(str(m.__file__)) for m in (capture, export_trace, fx_trace)
) | {os.path.abspath(__file__)}


@dataclass(frozen=True)
class InputMeta:
    """Shape and dtype of one flattened example input (no data is kept).

    Attributes:
        name: the placeholder name in the traced graph.
        shape: the shape of one micro-batch of it (what the plan is costed for).
        dtype: the dtype as a string, like ``'torch.int64'``.
        dynamic: the dimensions the graph leaves free: any size runs there (export: the batch,
            and the sequence of integer inputs, where the model allows). Other dimensions must
            keep the traced size. ``None`` for fx graphs, which fix no size themselves (their
            ops decide).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    dynamic: tuple[int, ...] | None = None


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
        size_guards: for an exported graph with free sizes, torch.export's guards on them: the
            sizes the graph is valid for (``guards.SizeGuards``; the runtime checks every new
            micro-batch size against them). ``None`` for fx graphs, whose ops read every size they
            use from the inputs, and for graphs with no free size.
        checkpointed: the modules the model runs inside ``torch.utils.checkpoint`` (seen while
            tracing, or a Hugging Face model's ``gradient_checkpointing`` flags): the planner
            makes the stages holding them recompute (``partitioner.tracing.hops``).

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
    size_guards: SizeGuards | None = field(default=None, repr=False)
    checkpointed: tuple[str, ...] = ()

    def module_path(self, node: fx.Node) -> str:
        """Qualified name of the innermost module ``node`` was traced in, ``''`` at top level."""
        return node_module_path(node)

    def fingerprint(self) -> str:
        """sha256 over the graph's ops, targets, argument structure, shapes and dtypes.

        Stable across traces of the same model. Devices are left out and a meta model is captured
        as if on the CPU, so a plan made from a meta-device model matches the same model with
        real weights (a model on another device matches when its code takes the same path there).
        """
        main = graph_fingerprint(self.gm.graph)
        regions = [graph_fingerprint(body.graph, shapes=False) for body in bodies(self.gm)]
        if not regions:
            return main
        # no_grad / autocast regions: what their bodies compute is part of the graph too.
        return hashlib.sha256("\n".join((main, *regions)).encode()).hexdigest()

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
    example_microbatches: int = 1,
) -> TracedModel:
    """Capture ``model`` as a flat FX graph with fake-tensor shapes on every node.

    Args:
        model: the model, on any device including ``meta``. Its train/eval mode is what gets
            traced (dropout in training mode, for instance).
        example_inputs: positional inputs (real, fake or meta tensors): one micro-batch, or
            ``example_microbatches`` of them stacked along dimension 0 (the whole batch).
            A model on ``meta`` (and its inputs) is captured as if it lived on the CPU, with
            fake tensors, so its graph is the graph of the same model with real CPU weights.
        example_kwargs: keyword inputs (``attention_mask``, ``labels``, ``decoder_input_ids``...).
            Tensors become graph inputs after the positional ones, in this dict's order, named
            by their keys; non-tensor values are specialised into the graph.
        leaf_modules: module classes, or qualified names (``fnmatch`` patterns allowed, e.g.
            ``'h.*'``), to keep as single ``call_module`` nodes (fx only; export inlines all).
        method: ``'fx'``, ``'export'``, or ``'auto'`` (fx, then export if fx fails; export at
            once for a Hugging Face model). Export makes the batch dimension (and integer
            inputs' sequence dimension) dynamic where the model allows, so the graph runs any
            micro-batch size (see ``InputMeta.dynamic``).

    A Hugging Face ``transformers`` model is traced as it is, with no wrapper: with
    ``use_cache=False`` (and ``return_dict=True`` where it would return a tuple) added to
    ``example_kwargs`` (the caller's values win; the model and its config are not changed), so
    ``out_spec`` is its ``ModelOutput`` (``unflatten_outputs(flat).logits``) and parameter names
    are its own (``partitioner.tracing.hf``).
        example_microbatches: how many micro-batches the example holds along dimension 0; the
            recorded shapes (and so the costs) are those of one micro-batch.

    Returns:
        a ``TracedModel``.

    Raises:
        TraceError: no tracer could capture the model; the message carries each tracer's error,
            where in the model it happened, and what to change.
        ReentrantCheckpointError: the model calls ``torch.utils.checkpoint.checkpoint`` with
            ``use_reentrant=True``, which no tracer captures with its gradients.

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
        raise TraceOptionError(f"method must be 'auto', 'fx' or 'export', got {method!r}")
    with preserved(model, what="trace()"), hops.watching(model) as seen:
        traced = _trace(model, example_inputs, example_kwargs, leaf_modules, method, example_microbatches)
    reentrant = hops.outermost([name for name, r in seen.items() if r])
    if reentrant:
        raise ReentrantCheckpointError(reentrant)
    marked = hops.outermost(set(seen) | set(hops.flagged_modules(model)))
    if marked:
        log.info("trace: the model checkpoints %d modules (%s...)", len(marked), ", ".join(marked[:3]))
    return dataclasses.replace(traced, checkpointed=marked) if marked else traced


def _trace(
    model: nn.Module, example_inputs: tuple[Any, ...], example_kwargs: dict[str, Any] | None,
    leaf_modules: Sequence[type | str], method: Method, k: int,
) -> TracedModel:
    kwargs = dict(example_kwargs or {})
    args = tuple(example_inputs)
    is_hf = hf.is_hf_model(model)
    asked = method
    if is_hf:
        # The cache off, a ModelOutput out, and torch.export: transformers v5 has no fx tracer.
        kwargs = hf.trace_kwargs(model, kwargs)
        if method == "auto":
            method = "export"
    if on_meta(model):
        args, kwargs = pytree.tree_map_only(torch.Tensor, to_meta, (args, kwargs))
    _check_leaf_names(model, leaf_modules)
    mb_args, mb_kwargs = first_microbatch((args, kwargs), k)

    failures: list[tuple[str, BaseException]] = []
    if method in ("auto", "fx"):
        try:
            return _traced(model, "fx", fx_trace.trace_fx(model, mb_args, mb_kwargs, leaf_modules))
        except Exception as e:  # any failure of fx means "try export" (or report it)
            log.info("torch.fx could not trace %s: %s", type(model).__name__, first_line(e))
            failures.append(("torch.fx.symbolic_trace", e))
    if method in ("auto", "export"):
        if leaf_modules:
            log.warning(
                "leaf_modules %s are ignored: torch.export inlines every module", list(leaf_modules)
            )
        try:
            captured = export_trace.trace_export(model, args, kwargs, shape_args=mb_args, shape_kwargs=mb_kwargs)
            return _traced(model, "export", captured)
        except Exception as e:
            failures.append(("torch.export.export(strict=False)", e))
    hint = hf.failure_hint(model, failures) if is_hf else None
    raise TraceError(trace_failure_message(model, failures, asked, _TRACER_FILES, hint))


def first_microbatch(example: Any, k: int) -> Any:
    """The first of ``k`` equal micro-batches of ``example`` (every tensor cut along dimension 0).

    Raises:
        TraceError: a tensor's first dimension is not divisible by ``k``.

    Example:
        >>> import torch
        >>> first_microbatch((torch.zeros(8, 3), 5), 4)[0].shape
        torch.Size([2, 3])
    """
    if not isinstance(k, int) or k < 1:
        raise TraceOptionError(f"example_microbatches must be a positive int, got {k!r}")
    if k == 1:
        return example

    def cut(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0 or t.shape[0] % k:
            raise TraceError(
                f"an example input of shape {tuple(t.shape)} cannot be cut into {k} equal "
                f"micro-batches along dimension 0; give a batch divisible by {k}, or pass one "
                "micro-batch as the example"
            )
        return t[: t.shape[0] // k]

    return pytree.tree_map_only(torch.Tensor, cut, example)


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
    # no_grad / autocast regions keep their bodies as GraphModules of their own.
    if isinstance(gm_or_graph, fx.GraphModule):
        modules = [gm_or_graph, *bodies(gm_or_graph)]
        graphs = [m.graph for m in modules]
    else:
        modules, graphs = [], [gm_or_graph]
    changed = 0

    def swap(a: Any) -> Any:
        nonlocal changed
        if isinstance(a, torch.device) and a != target:
            changed += 1
            return target
        return a

    for node in (n for g in graphs for n in g.nodes):
        if node.op not in ("call_function", "call_method"):
            continue
        if node.target is run_with_autocast and node.args[0] != target.type and target.type != "meta":
            # An autocast region traced on the CPU governs the device the stage runs on.
            node.args = (target.type, *node.args[1:])
            changed += 1
        new_args = fx.node.map_aggregate(node.args, swap)
        new_kwargs = dict(node.kwargs)
        for key, value in node.kwargs.items():
            if key == "device" and isinstance(value, str):
                value = torch.device(value)
            new_kwargs[key] = fx.node.map_aggregate(value, swap)
        node.args, node.kwargs = new_args, new_kwargs
    for m in modules:
        m.recompile()
    return changed


@contextmanager
def retargeted(gm: fx.GraphModule, device: torch.device | str) -> Iterator[int]:
    """Within: :func:`retarget_device` applied to ``gm`` (and its region bodies); the calls as
    they were on exit. For a one-off run of the whole traced graph on a device (a fake run under
    autocast on the GPU), where the graph itself must stay as traced. Yields how many changed.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> class Pos(nn.Module):
        ...     def forward(self, x):
        ...         return x + torch.arange(x.shape[1], device=x.device)
        >>> t = trace(Pos(), (torch.zeros(2, 3),), method="export")
        >>> with retargeted(t.gm, "meta") as n:
        ...     t.gm(torch.zeros(2, 3, device="meta"))[0].device, n
        (device(type='meta'), 1)
        >>> t.gm(torch.zeros(2, 3))[0].device
        device(type='cpu')
    """
    modules = [gm, *bodies(gm)]
    saved = [(node, node.args, node.kwargs) for m in modules for node in m.graph.nodes]
    changed = retarget_device(gm, device)
    try:
        yield changed
    finally:
        if changed:
            for node, args, kwargs in saved:
                node.args, node.kwargs = args, kwargs
            for m in modules:
                m.recompile()


class CausalLMLogits(nn.Module):
    """Wrap a Hugging Face causal LM so that ``forward(input_ids)`` returns only the logits.

    No longer needed: ``partition(hf_model, (input_ids,), ...)`` takes the model itself (the
    cache is turned off for the trace, the last stage returns the model's ``ModelOutput`` and
    parameter names stay the model's own; see ``partitioner.tracing.hf``). Kept for plans and
    checkpoints made with it: caching is off and a plain tensor comes back. The wrapped model is
    the ``model`` attribute, so parameter names gain a ``model.`` prefix (load the model's own
    checkpoint with ``Weights(path, prefix='model.')``).

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
        logits: torch.Tensor = out.logits  # (B, T, vocab)
        return logits


# --- helpers -------------------------------------------------------------------------------------


def _traced(model: nn.Module, method: Literal["fx", "export"], captured: Capture) -> TracedModel:
    gm, out_spec, inputs = captured.gm, captured.out_spec, captured.inputs
    gm.graph.lint()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, t in zip(placeholders, inputs):
        val = node.meta.get("val")
        # Shape propagation detaches; remember which inputs the caller wants gradients for.
        if isinstance(val, torch.Tensor) and t.requires_grad and not val.requires_grad:
            val.requires_grad_(True)
    names = tuple(n.name for n in placeholders)
    dynamic = captured.dynamic_dims or (None,) * len(inputs)
    metas = tuple(
        InputMeta(name, tuple(int(d) for d in t.shape), str(t.dtype), dims)
        for name, t, dims in zip(names, inputs, dynamic)
    )
    return TracedModel(
        gm=gm,
        method=method,
        input_names=names,
        out_spec=out_spec,
        param_aliases=_aliases(model, gm),
        example_inputs=metas,
        size_guards=captured.size_guards,
    )


def _aliases(model: nn.Module, gm: fx.GraphModule) -> dict[str, tuple[str, ...]]:
    """Graph name -> all names of that tensor in ``model``, for tensors with more than one name."""
    model_tensors = named_tensors(model)
    names_of: dict[int, list[str]] = {}
    for name, t in model_tensors.items():
        names_of.setdefault(id(t), []).append(name)
    used: list[str] = []
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            used.append(str(node.target))
        elif node.op == "call_module":
            sub = gm.get_submodule(str(node.target))
            used.extend(f"{node.target}.{n}" for n in named_tensors(sub))
    aliases: dict[str, tuple[str, ...]] = {}
    for name in used:
        found = model_tensors.get(name)
        group = names_of.get(id(found), []) if found is not None else []
        if len(group) > 1:
            aliases[name] = (name, *(n for n in group if n != name))
    return aliases


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


def node_module_path(node: fx.Node) -> str:
    """Qualified name of the innermost module ``node`` was traced in, ``''`` at top level.

    Works on the traced graph and on the stage graphs cut from it (their nodes keep the trace's
    metadata and the model's module names).
    """
    if node.op == "call_module":
        return str(node.target)
    if node.op == "get_attr":
        return str(node.target).rpartition(".")[0]
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path, _ = list(stack.values())[-1]
    return clean_module_path(str(path))


def module_call_index(node: fx.Node, path: str) -> int:
    """Which call of the module ``path`` traced ``node``: 0 for its first (or only) call in the
    forward, ``k`` for its ``k+1``-th (export's module stack spells that call ``...@k``).

    A module a forward calls twice (NanoChat's final norm, run on the embeddings too) owns nodes
    of both calls; this tells them apart.
    """
    for key, (name, _) in (node.meta.get("nn_module_stack") or {}).items():
        if clean_module_path(str(name)) == path:
            _, at, n = str(key).rpartition("@")
            return int(n) if at and n.isdigit() else 0
    return 0


def clean_module_path(path: str) -> str:
    """A module stack entry's path as the model names the module: ``'L__self__.model.norm@1'`` is
    ``'model.norm'`` (Dynamo-style stacks spell the root ``L['self']`` or ``L__self__``; a module's
    repeated calls add ``@N``), ``''`` for the root."""
    for prefix in ("L['self'].", "L__self__."):
        path = path.removeprefix(prefix)
    # Export gives the size reads of dynamic inputs (sym_size) a placeholder stack of this name.
    if path in ("L['self']", "L__self__") or path.startswith("_empty_nn_module_stack"):
        return ""
    return path.split("@")[0]
