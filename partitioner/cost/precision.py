"""Node costs under a mixed-precision policy: what autocast changes in memory, traffic and speed.

The runtime (``runtime.precision``) keeps parameters, gradients and optimizer state in fp32 and
runs each stage under ``torch.autocast``; cut values cross stages in the low dtype. The costs
are counted in fp32 (``partitioner.cost.costs``); this module rewrites them for that policy:

* which nodes compute in the low dtype is propagated over the graph as autocast decides it:
  nodes with FLOPs (matmuls, convolutions, attention: autocast's lower-precision list) do;
  normalisations, softmax, reductions, ``exp``/``log``/``pow`` and losses (its fp32 list) do
  not; any other op does when all its floating inputs are low (an ``fp32 + bf16`` residual sum
  promotes to fp32). Parameters, buffers and graph inputs are fp32.
* a low node's arithmetic runs at the device's 16-bit peak (``DeviceSpec.peak_flops``), its
  memory traffic and the activations it saves halve; a matmul whose input needs a gradient also
  saves autocast's low-precision copy of its weight, per micro-batch in flight (measured: that
  copy is what ``mm``'s backward keeps), which costs ``2`` bytes per weight element.
* every floating cut value crosses in the low dtype: output bytes halve.
* parameter, gradient and optimizer state are unchanged (``state_bytes_per_param``): the fp32
  parameters are the master weights, there is no second persistent copy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch.fx as fx

from partitioner.cost.nodecost import NodeCost
from partitioner.errors import PartitionOptionError

__all__ = ["PRECISIONS", "check_precision", "low_precision_nodes", "with_precision"]

#: The policies a plan can be costed for, and the dtype (as the costs spell it) each computes in.
PRECISIONS: dict[str, str] = {"fp32": "torch.float32", "bf16": "torch.bfloat16", "fp16": "torch.float16"}

# Ops autocast runs in fp32 whatever their inputs (a substring of the node's target name).
_FP32_OPS = (
    "norm", "softmax", "log", "exp", "pow", "sum", "mean", "cross_entropy", "nll", "mse", "loss",
    "cumsum", "prod", "rsqrt", "sqrt", "erf", "var", "std", "dist",
)


def check_precision(precision: str) -> str:
    """``precision`` if it is one of ``PRECISIONS``.

    Raises:
        PartitionOptionError: another name (a ``ValueError``); the message lists the known ones.
    """
    if precision not in PRECISIONS:
        raise PartitionOptionError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    return precision


def _is_float(dtype: str) -> bool:
    return "float" in dtype and "complex" not in dtype


def _target_name(gm: fx.GraphModule, node: fx.Node) -> str:
    t = node.target
    if node.op == "call_module" and isinstance(t, str):  # a leaf module: its class names the op
        return type(gm.get_submodule(t)).__name__.lower()
    return (t if isinstance(t, str) else getattr(t, "__name__", str(t))).lower()


def low_precision_nodes(gm: fx.GraphModule, costs: Mapping[str, NodeCost]) -> set[str]:
    """The compute nodes whose floating output autocast computes in the low dtype.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from partitioner.tracing.trace import trace
        >>> from partitioner.cost.costs import cost_graph
        >>> t = trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.LayerNorm(4)), (torch.randn(2, 4),))
        >>> sorted(low_precision_nodes(t.gm, cost_graph(t)))  # the norm runs in fp32
        ['_0', '_1']
    """
    low: set[str] = set()
    for node in gm.graph.nodes:
        cost = costs.get(node.name)
        if cost is None or not _is_float(cost.dtype):
            continue
        if cost.fwd_flops > 0:
            low.add(node.name)
            continue
        if any(k in _target_name(gm, node) for k in _FP32_OPS):
            continue
        floating = [a for a in node.all_input_nodes if a.name not in costs or _is_float(costs[a.name].dtype)]
        if floating and all(a.name in low for a in floating):
            low.add(node.name)
    return low


def with_precision(gm: fx.GraphModule, costs: Mapping[str, NodeCost], precision: str) -> dict[str, NodeCost]:
    """The fp32 ``costs`` of ``gm``'s nodes rewritten for ``precision`` (see the module docstring).

    Raises:
        PartitionOptionError: an unknown precision (a ``ValueError``).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from partitioner.tracing.trace import trace
        >>> from partitioner.cost.costs import cost_graph
        >>> t = trace(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)), (torch.randn(4, 64),))
        >>> c = cost_graph(t)
        >>> b = with_precision(t.gm, c, "bf16")
        >>> b["_0"].output_bytes * 2 == c["_0"].output_bytes, b["_0"].dtype
        (True, 'torch.bfloat16')
        >>> b["_2"].saved_bytes - c["_2"].saved_bytes // 2   # + bf16 copies of its 64 x 8 + 8 parameters
        1040
    """
    low_dtype = PRECISIONS[check_precision(precision)]
    if precision == "fp32":
        return dict(costs)
    low = low_precision_nodes(gm, costs)
    out: dict[str, NodeCost] = {}
    for name, c in costs.items():
        if c.dtype != "torch.float32":  # integer values, and models already in low precision
            out[name] = c
            continue
        wire = c.output_bytes // 2
        if name not in low:
            out[name] = replace(c, output_bytes=wire)
            continue
        weight_copy = 2 * c.param_count if c.param_names and c.fwd_flops > 0 and c.bwd_flops > c.fwd_flops else 0
        out[name] = replace(
            c, dtype=low_dtype, output_bytes=wire, io_bytes=c.io_bytes // 2,
            saved_bytes=c.saved_bytes // 2 + weight_copy,
        )
    return out
