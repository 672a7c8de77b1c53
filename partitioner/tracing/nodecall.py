"""One fx node made runnable on its own, on new tensors shaped like the ones it was traced with.

Both cost passes use it: the analytic one on fake tensors (or small random CPU ones), the profiler
on random tensors on a real device. A ``Prepared`` call is what the analytic pass records per node
so the profiler can time the same call again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

__all__ = ["Prepared", "Call", "label", "random_like"]

Prepared = tuple[fx.Node, "nn.Module | None", list[Any], Any]  # node, leaf module, arg leaves, spec


@dataclass
class Call:
    """One node made runnable on new tensors like its recorded inputs (fake or real)."""

    fn: Callable[..., Any]
    args: Any
    kwargs: Any
    fresh: list[Any]  # the flat argument leaves, as created
    state: dict[str, torch.Tensor]  # a call_module's parameters and buffers, as created
    grad_inputs: list[torch.Tensor]

    @staticmethod
    def prepare(
        node: fx.Node,
        module: nn.Module | None,
        leaves: list[Any],
        spec: Any,
        needs_grad: Callable[[torch.Tensor], bool],
        make: Callable[[torch.Tensor, bool], torch.Tensor],
        swap: Callable[[Any], Any],
    ) -> Call:
        fresh = [make(t, needs_grad(t)) if isinstance(t, torch.Tensor) else swap(t) for t in leaves]
        state: dict[str, torch.Tensor] = {}
        if module is not None:
            state.update((n, make(p, p.requires_grad)) for n, p in module.named_parameters())
            state.update((n, make(b, False)) for n, b in module.named_buffers())
        grad_inputs = [t for t in (*fresh, *state.values()) if isinstance(t, torch.Tensor) and t.requires_grad]
        args, kwargs = pytree.tree_unflatten(fresh, spec)
        return Call(_callable(node, module, state), args, kwargs, fresh, state, grad_inputs)

    def backward(self, outs: list[Any]) -> bool:
        """Gradients of ``outs`` for every input that needs one; False when there is nothing to do."""
        diff = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
        if not diff or not self.grad_inputs:
            return False
        torch.autograd.grad(diff, self.grad_inputs, [torch.ones_like(o) for o in diff], allow_unused=True)
        return True


def _callable(node: fx.Node, module: nn.Module | None, state: dict[str, torch.Tensor]) -> Callable[..., Any]:
    if module is not None:
        return lambda *a, **k: torch.func.functional_call(module, state, a, k)
    if node.op == "call_method":
        return lambda self, *a, **k: getattr(self, str(node.target))(*a, **k)
    return cast("Callable[..., Any]", node.target)  # call_function: the target is the function itself


def label(node: fx.Node) -> str:
    """What kind of call ``node`` is, for messages: ``'module h.0'``, ``'method view'``, ``'relu'``."""
    if node.op == "call_module":
        return f"module {node.target}"
    if isinstance(node.target, str):
        return f"method {node.target}"
    return str(getattr(node.target, "__name__", node.target))


def random_like(t: torch.Tensor, device: torch.device, requires_grad: bool) -> torch.Tensor:
    """Real random data with ``t``'s shape, strides and dtype on ``device``.

    Integer tensors are zeros (always valid indices), booleans are ones.
    """
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride())) if all(t.shape) else 0
    size = t.storage_offset() + span
    if t.dtype.is_floating_point or t.dtype.is_complex:
        base = torch.randn(size, dtype=t.dtype, device=device)
    elif t.dtype == torch.bool:
        base = torch.ones(size, dtype=t.dtype, device=device)
    else:
        base = torch.zeros(size, dtype=t.dtype, device=device)
    x = base.as_strided(tuple(t.shape), t.stride(), t.storage_offset())
    if requires_grad and (x.is_floating_point() or x.is_complex()):
        x = x.detach().requires_grad_(True)
    return x
