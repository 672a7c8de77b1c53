"""Activation checkpointing the model asks for: the modules it runs inside ``torch.utils.checkpoint``.

Neither tracer keeps a checkpoint: ``torch.fx.symbolic_trace`` and ``torch.export`` run
``checkpoint(fn, *args, use_reentrant=False)`` as the plain call it computes (the saved-tensor
hooks that would recompute it are not part of the graph), so the traced graph holds the region's
ops and nothing says they were to be recomputed. A reentrant checkpoint
(``use_reentrant=True``) is worse: its forward runs under ``torch.no_grad()`` inside an
``autograd.Function``; fx refuses the grad-mode region, and export records it as a no-grad
region, so gradients would stop there.

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
import inspect
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.utils.checkpoint as tuc
from torch import nn

__all__ = ["watching", "note", "in_checkpoint", "flagged_modules", "holds", "outermost"]

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
