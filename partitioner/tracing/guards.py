"""The input sizes an exported graph is valid for: torch.export's own guards, kept to check sizes later.

``torch.export`` with a dynamic batch records every assumption the model's code makes about that
size (a branch on ``x.shape[0]``, a reshape into halves, a check) as a *guard* on the inputs, and
the exported program is valid exactly where its guards hold. pipecut strips the guard call out of
the stage graphs (a stage has no use for it) but keeps the guard function here, so that the
runtime can check each new micro-batch size against it before running anything: a size the
model's code treats differently is refused with the guard's text instead of silently running the
computation traced at another size.

Legend: ``mb`` a micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

__all__ = ["SizeGuards", "take_size_guards"]

# What the guard function is called in the graph of ``ExportedProgram.module()``.
_GUARDS = "_guards_fn"


@dataclass(frozen=True, eq=False)
class SizeGuards:
    """The guard function of an exported graph and how to call it with one micro-batch.

    Attributes:
        fn: ``torch.export``'s guard module; called with the graph's flat inputs, it raises an
            ``AssertionError`` naming the first guard that fails (``Guard failed: x.size()[0] >= 5``),
            or another error where a guard is undefined at the sizes (a modulo by a zero size).
        args: per argument of ``fn``: ``('input', name)`` for a graph input, by placeholder name,
            or ``('const', value)`` for an input export specialised (a Python scalar).
    """

    fn: Callable[..., Any]
    args: tuple[tuple[str, Any], ...]

    def failure(self, mb_inputs: Mapping[str, Any]) -> str | None:
        """The guard that fails for these inputs' sizes (its text), or ``None`` if all hold.

        Only sizes are read: each tensor is replaced by an empty ``meta`` tensor of its shape and
        dtype, so nothing is computed or copied.
        """
        args = []
        for kind, value in self.args:
            if kind == "const":
                args.append(value)
                continue
            x = mb_inputs.get(value)
            if isinstance(x, torch.Tensor):
                x = torch.empty(x.shape, dtype=x.dtype, device="meta")
            args.append(x)
        try:
            self.fn(*args)
        except AssertionError as e:
            text = str(e).strip() or type(e).__name__
            return text.removeprefix("Guard failed:").strip()
        except Exception as e:  # a guard undefined at these sizes (a modulo by a zero size)
            return f"{type(e).__name__}: {str(e).strip()} (evaluating the guards)"
        return None


def take_size_guards(graph: fx.Graph, owner: torch.nn.Module, flat_inputs: Sequence[Any]) -> SizeGuards | None:
    """Take the guard call out of ``graph`` (of ``ExportedProgram.module()``) and keep its function.

    Args:
        graph: the unlifted exported graph; its ``_guards_fn`` call node, if any, is erased.
        owner: the module holding ``_guards_fn`` (the unlifted module).
        flat_inputs: the example's flat inputs, one per placeholder, in order (for the values of
            inputs export specialised).

    Returns:
        The guards, or ``None`` when the graph has no guard call (nothing to check).
    """
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    example = {n.name: v for n, v in zip(placeholders, flat_inputs)}
    fn = getattr(owner, _GUARDS, None)
    calls = [n for n in graph.nodes if n.op == "call_module" and str(n.target) == _GUARDS]
    args: list[tuple[str, Any]] = []
    for a in calls[0].args if calls else ():
        if isinstance(a, fx.Node) and isinstance(example.get(a.name), torch.Tensor):
            args.append(("input", a.name))
        else:
            args.append(("const", example.get(a.name) if isinstance(a, fx.Node) else a))
    for node in calls:
        graph.erase_node(node)
    if fn is None or not calls:
        return None
    return SizeGuards(fn, tuple(args))
