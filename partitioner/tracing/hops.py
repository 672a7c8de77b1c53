"""Higher-order ops that ``torch.export`` leaves in a graph, made exception-safe and retargetable.

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
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch import nn

__all__ = ["run_with_grad_mode", "run_with_autocast", "replace_mode_ops", "bodies", "unshare_bodies", "MODE_OPS"]


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
