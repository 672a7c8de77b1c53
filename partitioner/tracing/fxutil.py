"""Small helpers over torch.fx graphs and their modules, shared across the partitioner."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch import nn

__all__ = ["COMPUTE_OPS", "compute_nodes", "flat_outputs", "named_tensors", "owner_of", "wire_form"]

# Nodes that do work and get a stage; placeholders are fed, get_attr copied, output gathered.
COMPUTE_OPS = ("call_function", "call_method", "call_module")


def compute_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes of ``gm`` that a partition assigns to stages, in graph order."""
    return [n for n in gm.graph.nodes if n.op in COMPUTE_OPS]


def flat_outputs(gm: fx.GraphModule) -> list[Any]:
    """The values the graph returns, flattened in order (nodes, or constants)."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    out: list[Any] = []

    def visit(a: Any) -> None:
        if isinstance(a, (tuple, list)):
            for b in a:
                visit(b)
        elif isinstance(a, dict):
            for b in a.values():
                visit(b)
        else:
            out.append(a)

    visit(output.args[0])
    return out


def named_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``module`` under every name it has (tied tensors repeat).

    Example:
        >>> from torch import nn
        >>> m = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
        >>> list(named_tensors(m))[:3], len(named_tensors(m))
        (['0.weight', '0.bias', '1.weight'], 7)
    """
    tensors: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
    tensors.update(module.named_buffers(remove_duplicate=False))
    return tensors


def owner_of(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The submodule holding attribute ``name`` (a qualified name) and the attribute's own name.

    Example:
        >>> from torch import nn
        >>> m = nn.Sequential(nn.Linear(2, 2))
        >>> owner, leaf = owner_of(m, "0.weight")
        >>> type(owner).__name__, leaf
        ('Linear', 'weight')
    """
    owner_name, _, leaf = name.rpartition(".")
    return (root.get_submodule(owner_name) if owner_name else root), leaf


def wire_form(node: fx.Node) -> tuple[str, tuple[int, ...], str] | None:
    """How ``node``'s value travels between stages: ``(kind, shape, dtype)``, or ``None`` if it cannot.

    Tensors travel as themselves; Python scalars and shapes as small tensors (kinds ``'int'``,
    ``'float'``, ``'bool'``, ``'ints'``). Anything else (a list of tensors from ``split``, ``None``)
    cannot cross a cut, so the partitioner never cuts between its producer and its readers.
    """
    val = node.meta.get("val", node.meta.get("example_value"))
    tm = node.meta.get("tensor_meta")
    if isinstance(val, torch.Tensor):
        return "tensor", tuple(int(d) for d in val.shape), str(val.dtype)
    if tm is not None and hasattr(tm, "shape"):
        return "tensor", tuple(int(d) for d in tm.shape), str(tm.dtype)
    if isinstance(val, bool):
        return "bool", (), "torch.int64"
    if isinstance(val, (int, torch.SymInt)):
        return "int", (), "torch.int64"
    if isinstance(val, (float, torch.SymFloat)):
        return "float", (), "torch.float64"
    if isinstance(val, (tuple, list, torch.Size)) and all(isinstance(d, (int, torch.SymInt)) for d in val):
        return "ints", (len(val),), "torch.int64"
    if val is None and tm is None and "val" not in node.meta:
        # No shape information at all: assume a tensor; shapes are then learned at run time.
        return "tensor", (), "torch.float32"
    return None
