"""Small helpers over torch.fx graphs shared by graph.py, split.py and plan.py."""

from __future__ import annotations

from typing import Any

import torch.fx as fx

__all__ = ["COMPUTE_OPS", "compute_nodes", "flat_outputs"]

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
