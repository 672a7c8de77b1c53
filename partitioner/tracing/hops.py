"""Regions of a forward that are more than their ops: the mode regions ``torch.export`` leaves in a
graph as higher-order ops (made exception-safe and retargetable), and activation checkpoints.

A ``torch.no_grad()`` or ``torch.autocast(...)`` region inside a model's forward (the rotary
embedding of Llama, Mistral, Qwen, Gemma, Phi, GPT-NeoX...) is captured by ``torch.export`` as
one ``call_function`` node of a higher-order op, ``wrap_with_set_grad_enabled`` or
``wrap_with_autocast``, whose body is a ``GraphModule`` read by a ``get_attr`` node. torch's own
implementations set the mode, run the body, and set it back only if the body returned: when the
body raises (a cost pass trying shapes, a bad input at run time), grad mode stays switched off
for the rest of the thread.

``replace_mode_ops`` swaps those targets for :func:`run_with_grad_mode` and
:func:`run_with_autocast`, which do the same inside ``with`` blocks. Such a node stays one node:
the partitioner costs it by running the whole region (its FLOPs and saved tensors, under the
region's grad and autocast modes) and never puts a cut inside it, and a stage runs it with the
model's semantics.

**Activation checkpoints** (:func:`watching`, :func:`flagged_modules`). Neither tracer keeps a
checkpoint: ``torch.fx.symbolic_trace`` and ``torch.export`` run ``checkpoint(fn, *args,
use_reentrant=False)`` as the plain call it computes (the saved-tensor hooks that would recompute
it are not part of the graph), so the traced graph holds the region's ops and nothing says they
were to be recomputed. A reentrant checkpoint (``use_reentrant=True``) is worse: its forward runs
under ``torch.no_grad()`` inside an ``autograd.Function``; fx refuses the grad-mode region, and
export records it as a no-grad region, so gradients would stop there.

So tracing watches for it (:func:`watching`): a global module forward pre-hook, and the fx
tracer's node creation, look up the Python stack for ``torch.utils.checkpoint.checkpoint``'s own
frame and note the module running inside it (the module a node belongs to, under fx). A Hugging
Face model's ``gradient_checkpointing_enable()`` is read from its flags as well
(:func:`flagged_modules`: each ``GradientCheckpointingLayer`` whose ``gradient_checkpointing`` is
set), since it checkpoints only in training mode and the model may be traced in eval mode.
The planner then makes the stages holding those modules recompute (``partitioner.api``), which
is exact: pipecut's recomputation replays the stage's forward with the same RNG and autocast
state, as ``checkpoint`` does for its region.
"""

from __future__ import annotations

import contextvars
import copy
import inspect
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.fx as fx
import torch.utils.checkpoint as tuc
from torch import nn

__all__ = [
    "run_with_grad_mode", "run_with_autocast", "replace_mode_ops", "bodies", "unshare_bodies", "MODE_OPS",
    "watching", "note", "in_checkpoint", "flagged_modules", "holds", "outermost",
]


def run_with_grad_mode(enabled: bool, body: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``body(*args, **kwargs)`` with grad mode set to ``enabled``; the mode is restored on any exit.

    Example:
        >>> import torch
        >>> run_with_grad_mode(False, lambda x: (x * 2).requires_grad, torch.ones(2, requires_grad=True))
        False
        >>> torch.is_grad_enabled()
        True
    """
    with torch.set_grad_enabled(enabled):
        return body(*args, **kwargs)


def run_with_autocast(
    device_type: str, dtype: torch.dtype | None, enabled: bool, cache_enabled: bool | None,
    body: Callable[..., Any], *args: Any, **kwargs: Any,
) -> Any:
    """``body(*args, **kwargs)`` inside ``torch.autocast(device_type, dtype, enabled, cache_enabled)``.

    Example:
        >>> import torch
        >>> run_with_autocast("cpu", torch.bfloat16, True, None, lambda a: (a @ a).dtype, torch.ones(2, 2))
        torch.bfloat16
        >>> torch.is_autocast_enabled("cpu")
        False
    """
    with torch.autocast(device_type, dtype, enabled, cache_enabled):
        return body(*args, **kwargs)


# torch.export's op -> ours (same arguments, in the same order).
MODE_OPS: dict[Any, Callable[..., Any]] = {
    torch.ops.higher_order.wrap_with_set_grad_enabled: run_with_grad_mode,
    torch.ops.higher_order.wrap_with_autocast: run_with_autocast,
}


def replace_mode_ops(gm: fx.GraphModule) -> int:
    """Point every grad-mode and autocast region of ``gm`` (bodies included) at our safe versions.

    Returns how many nodes changed; ``gm`` and every changed body are recompiled.
    """
    changed = 0
    for module in (gm, *bodies(gm)):
        here = 0
        for node in module.graph.nodes:
            if node.op == "call_function" and node.target in MODE_OPS:
                node.target = MODE_OPS[node.target]
                here += 1
        if here:
            module.recompile()
        changed += here
    return changed


def bodies(gm: fx.GraphModule) -> Iterator[fx.GraphModule]:
    """Every GraphModule a node of ``gm`` reads through ``get_attr`` (region bodies), nested ones too."""
    seen: set[int] = set()
    stack = [gm]
    while stack:
        current = stack.pop()
        for node in current.graph.nodes:
            if node.op != "get_attr":
                continue
            sub = _attr(current, str(node.target))
            if isinstance(sub, fx.GraphModule) and id(sub) not in seen:
                seen.add(id(sub))
                yield sub
                stack.append(sub)


def unshare_bodies(gm: fx.GraphModule) -> int:
    """Give ``gm`` copies of its region bodies of its own; returns how many were copied.

    A stage cut from a traced graph reads the traced graph's body modules themselves; a change
    to a stage's bodies (:func:`~partitioner.tracing.trace.retarget_device` for its device)
    would otherwise change the traced graph's and every other stage's. Parameters and buffers a
    body holds stay shared (copied by reference), so training updates one tensor.

    Example:
        >>> import copy
        >>> gm = fx.symbolic_trace(nn.Identity())
        >>> gm.body = fx.symbolic_trace(nn.Identity())
        >>> with gm.graph.inserting_before(next(iter(gm.graph.nodes))):
        ...     _ = gm.graph.get_attr("body")
        >>> before = gm.body
        >>> unshare_bodies(gm), gm.body is before
        (1, False)
    """
    copied = 0
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        target = str(node.target)
        sub = _attr(gm, target)
        if not isinstance(sub, fx.GraphModule):
            continue
        memo: dict[int, Any] = {id(t): t for t in (*sub.parameters(), *sub.buffers())}
        owner_path, _, name = target.rpartition(".")
        owner = _attr(gm, owner_path) if owner_path else gm
        setattr(owner, name, copy.deepcopy(sub, memo))  # nested bodies are copied with it
        copied += 1
    return copied


def _attr(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for item in target.split("."):
        obj = getattr(obj, item, None)
        if obj is None:
            return None
    return obj


# -- activation checkpoints ---------------------------------------------------------------

_CHECKPOINT = inspect.unwrap(tuc.checkpoint).__code__
_REENTRANT = tuc.CheckpointFunction.forward.__code__

# The modules noted by the trace running now: name -> whether a reentrant checkpoint ran it.
_SEEN: contextvars.ContextVar[dict[str, bool] | None] = contextvars.ContextVar("pipecut_checkpoints", default=None)


def in_checkpoint() -> bool | None:
    """``None`` outside any ``torch.utils.checkpoint.checkpoint`` call on this thread's stack;
    else whether it is a reentrant one.

    Example:
        >>> import torch
        >>> in_checkpoint() is None
        True
        >>> x = torch.ones(1, requires_grad=True)
        >>> tuc.checkpoint(lambda t: (in_checkpoint(), t)[1], x, use_reentrant=False) is not None
        True
    """
    frame: Any = sys._getframe(1)
    seen = False
    while frame is not None:
        if frame.f_code is _REENTRANT:
            return True
        if frame.f_code is _CHECKPOINT:
            seen = True
        frame = frame.f_back
    return False if seen else None


def note(name: str) -> None:
    """Record that module ``name`` runs inside a checkpoint, when :func:`watching` and it does."""
    seen = _SEEN.get()
    if seen is None:
        return
    mode = in_checkpoint()
    if mode is not None:
        seen[name] = seen.get(name, False) or mode


@contextmanager
def watching(model: nn.Module) -> Iterator[dict[str, bool]]:
    """Within: every module of ``model`` that runs inside ``torch.utils.checkpoint`` is recorded
    in the dict yielded (its name -> whether the checkpoint was reentrant). The hook is removed
    on exit.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        >>> with watching(net) as seen:
        ...     _ = tuc.checkpoint(net[1], net[0](torch.ones(1, 2)), use_reentrant=False)
        >>> seen
        {'1': False}
    """
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False) if n}
    seen: dict[str, bool] = {}

    def hook(module: nn.Module, args: Any) -> None:
        name = names.get(id(module))
        if name is not None:
            note(name)

    token = _SEEN.set(seen)
    handle = nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()
        _SEEN.reset(token)


def flagged_modules(model: nn.Module) -> list[str]:
    """The modules a Hugging Face model checkpoints once training: each ``GradientCheckpointingLayer``
    (a decoder layer) whose ``gradient_checkpointing`` flag ``gradient_checkpointing_enable()``
    set. Empty for any other model.

    Example:
        >>> flagged_modules(nn.Linear(2, 2))
        []
    """
    return [
        name for name, m in model.named_modules()
        if name and getattr(m, "gradient_checkpointing", False) is True
        and any(c.__name__ == "GradientCheckpointingLayer" for c in type(m).__mro__)
    ]


def holds(path: str, modules: tuple[str, ...]) -> bool:
    """Whether a node of module ``path`` lies inside one of ``modules`` (itself or a child).

    Example:
        >>> holds("h.1.attn", ("h.1",)), holds("h.10", ("h.1",))
        (True, False)
    """
    return any(path == m or path.startswith(m + ".") for m in modules)


def outermost(modules: set[str] | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """``modules`` without those inside another of them, sorted.

    Example:
        >>> outermost({"h.1", "h.1.attn", "h.10", "h.2.mlp"})
        ('h.1', 'h.10', 'h.2.mlp')
    """
    names = set(modules)
    return tuple(sorted(n for n in names if not any(n.startswith(o + ".") for o in names if o != n)))
