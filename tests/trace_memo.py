"""A test process's memo of ``torch.export``'s programs of Hugging Face models.

Tracing a tiny Hugging Face model with a dynamic batch and sequence takes 2-10 s on CI's cores, and
the suite traces the same tiny configurations again and again: each family on 2 and 4 stages, a
plan made in one test and a ``pipecut train`` of the same folder in the next. This memo keeps, per
test process (pytest worker or pooled rank), the ``ExportedProgram`` of each model and example it
exported, and hands it back when a structurally identical model is exported with the same example:
``export_trace.trace_export`` then makes its own graph of it (``ep.module()`` copies the graph) and
points that graph at the new model's own tensors, as it does after a fresh export.

What makes two exports the same (:func:`key`): the model's class and config (every attribute,
private ones included), every module's class, ``forward``, mode and plain attributes, every
tensor's name, shape, dtype, device and ``requires_grad``, the example's structure, shapes and
non-tensor values, the dynamic-shape specs, and the ambient grad, inference and autocast modes and
default dtype. A model with hooks, an instance-level ``forward`` or a class outside transformers
(pipecut's ``CausalLMLogits`` around a transformers model aside) is never memoised, nor one with
Hugging Face's gradient checkpointing on (the tracer watches its checkpoint calls as they run).
The tests of the tracer itself (``tests/partitioner/tracing/``) export afresh (:func:`off`), as
does any test marked ``fresh_trace``. Only successful exports are kept: an export that failed is
tried again, so its failure path runs every time.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

__all__ = ["install", "off", "key", "stats"]

_MEMO: dict[str, Any] = {}
_STATE = {"on": True, "hits": 0, "misses": 0}
_PLAIN = (bool, int, float, str, type(None))


def key(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], specs: Any) -> str | None:
    """What determines ``torch.export.export(model, args, kwargs, dynamic_shapes=specs)``'s program,
    hashed; ``None`` where the model is not one to memoise."""
    hf = _hugging_face(model)
    if hf is None:
        return None
    modules = []
    for name, m in model.named_modules():
        hooks = (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks, m._backward_pre_hooks)
        if any(hooks) or "forward" in vars(m) or getattr(m, "gradient_checkpointing", False):
            return None  # a checkpointed forward is watched while it is traced (partitioner.tracing.hops)
        plain = sorted((k, repr(v)) for k, v in vars(m).items() if isinstance(v, _PLAIN) or
                       (isinstance(v, tuple) and all(isinstance(x, _PLAIN) for x in v)))
        modules.append((name, type(m).__module__, type(m).__qualname__, id(type(m).forward), m.training, plain))
    config = getattr(hf, "config", None)
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    tensors = [(n, _tensor(t), type(t).__name__) for n, t in named]
    leaves, spec = pytree.tree_flatten((args, kwargs))
    example = [_tensor(t) if isinstance(t, torch.Tensor) else repr(t) for t in leaves]
    ambient = (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), str(torch.get_default_dtype()),
               torch.is_autocast_enabled("cpu"), str(torch.get_autocast_dtype("cpu")))
    parts = (type(model).__module__, type(model).__qualname__, _config(config), modules, tensors, str(spec), example,
             repr(specs), ambient)
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def _hugging_face(model: nn.Module) -> nn.Module | None:
    """The Hugging Face model that ``model`` is, or that pipecut's ``CausalLMLogits`` wraps (the
    zoo's ``gpt2-tiny``, most of the suite's GPT-2s: its ``forward`` reads nothing but the model it
    wraps, whose config then keys the program); ``None`` for any other model."""
    from partitioner.tracing.trace import CausalLMLogits

    inner = model.model if type(model) is CausalLMLogits else model
    return inner if type(inner).__module__.startswith("transformers.") else None


def _tensor(t: torch.Tensor) -> tuple[Any, ...]:
    return tuple(t.shape), str(t.dtype), str(t.device), t.requires_grad


def _config(config: Any) -> str:
    if config is None:
        return ""
    return repr(sorted((k, _config(v) if hasattr(v, "to_dict") else repr(v)) for k, v in vars(config).items()))


def install() -> None:
    """Memoise ``partitioner.tracing.export_trace._export`` in this process (once)."""
    from partitioner.tracing import export_trace

    export = export_trace._export
    if getattr(export, "memoised", False):
        return

    def memoised(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], specs: Any) -> Any:
        k = key(model, args, kwargs, specs) if _STATE["on"] else None
        if k is not None and k in _MEMO:
            _STATE["hits"] += 1
            return _MEMO[k]
        ep = export(model, args, kwargs, specs)
        if k is not None:
            _STATE["misses"] += 1
            _MEMO[k] = ep
        return ep

    memoised.memoised = True  # type: ignore[attr-defined]
    export_trace._export = memoised


@contextlib.contextmanager
def off() -> Iterator[None]:
    """Within: every export runs afresh (and is not kept)."""
    was = _STATE["on"]
    _STATE["on"] = False
    try:
        yield
    finally:
        _STATE["on"] = was


def stats() -> dict[str, int]:
    """Exports served from the memo (``hits``), and kept in it (``misses``), in this process."""
    return {"hits": _STATE["hits"], "misses": _STATE["misses"]}
