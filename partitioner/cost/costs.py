"""Per-node costs of a traced graph: FLOPs, parameter and activation bytes, and their time on a device.

How each number is obtained (all on fake tensors, so nothing is allocated):

* FLOPs. Every compute node is run on its own, on fresh fake inputs of the recorded shapes and
  strides, under ``FlopCounterMode``; its backward is then run the same way (``autograd.grad``
  of the outputs with respect to every input that needs grad: parameters and activations, not
  integer ids or graph inputs that do not require grad), again counted. So backward FLOPs are
  counted, not assumed: a Linear reading a graph input that needs no grad costs 1x its forward
  (weight gradient only), a later one 2x. FlopCounterMode counts matmuls, convolutions and
  attention; elementwise ops count 0 and are priced by their memory traffic instead.
* Saved activations. The same forward runs under ``saved_tensors_hooks``; each tensor autograd
  keeps is identified by its storage and charged once to the first node that saves it: a ReLU
  output saved by the ReLU and by the next matmul counts once, a view saved costs its whole base
  storage, parameters are never charged.
* Speed. Identical calls (same op, shapes, strides, dtypes, constants -- the 96 blocks of GPT-3)
  are run once and the result reused. Measured on the 175B GPT-2 (3,889 compute nodes, 1 x 2048
  tokens): 67 distinct calls, about 0.3 s on one core, so the exact counts are affordable and no
  backward rule of thumb (such as bwd = 2 x fwd) is needed.

``profile=True`` replaces the analytic times with measured ones: each distinct call is run on a
real device with random tensors of the recorded shapes.

Where the pieces live: ``nodecost`` (``NodeCost`` and the roofline ``node_time``), ``analytic``
(the counting on fake tensors), ``profiler`` (the timing), ``nodecall`` (one node made runnable on
its own, which both use).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from partitioner.cost.analytic import Coster
from partitioner.cost.nodecost import NodeCost, node_time, weight_share
from partitioner.cost.profiler import default_device, profile_costs
from partitioner.errors import CostOptionError
from partitioner.tracing.globalstate import preserved
from partitioner.tracing.trace import TracedModel

__all__ = ["NodeCost", "cost_graph", "node_time", "weight_share"]


def cost_graph(
    traced: TracedModel | fx.GraphModule,
    *,
    profile: bool = False,
    device: torch.device | str | None = None,
    warmup: int = 2,
    repeat: int = 5,
) -> dict[str, NodeCost]:
    """Cost every compute node of a traced graph.

    Args:
        traced: from ``trace`` (or a GraphModule whose nodes carry ``meta['val']``).
        profile: also time each node on ``device`` (real tensors of the recorded shapes, median
            of ``repeat`` runs after ``warmup``), filling ``measured_fwd_s``/``measured_bwd_s``.
        device: where to profile; default CUDA when available, else CPU.
        warmup: untimed runs per distinct call before timing.
        repeat: timed runs per distinct call.

    Returns:
        node name -> ``NodeCost`` for every ``call_function``/``call_method``/``call_module`` node.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from partitioner.tracing.trace import trace
        >>> t = trace(nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8)), (torch.randn(4, 64),))
        >>> c = cost_graph(t)
        >>> c["_0"].fwd_flops, c["_0"].bwd_flops, c["_2"].bwd_flops  # 2*4*64*32; no input grad for _0
        (16384, 16384, 4096)
        >>> c["_0"].param_names
        ('0.weight', '0.bias')
    """
    gm = traced.gm if isinstance(traced, TracedModel) else traced
    if repeat < 1 or warmup < 0:
        raise CostOptionError(f"need repeat >= 1 and warmup >= 0, got repeat={repeat}, warmup={warmup}")
    # Every node runs again here (random data for the profiler, regions that switch grad mode):
    # none of it may outlive the call.
    with preserved(what="cost_graph()"):
        coster = Coster(gm)
        costs = coster.run()
        if profile:
            dev = torch.device(device) if device is not None else default_device()
            costs = profile_costs(costs, coster.calls, coster.needs_grad, dev, warmup, repeat)
    return costs
