"""Measured node times (``profile=True``): each distinct call timed on a real device.

Every distinct call (same op, shapes, strides, dtypes and constants) runs ``warmup + repeat`` times
on random tensors of the recorded shapes; the medians of the timed runs replace the roofline.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch
from torch.utils import _pytree as pytree

from partitioner.cost.nodecost import NodeCost
from partitioner.tracing.failures import first_line
from partitioner.tracing.nodecall import Call, Prepared, label, random_like

__all__ = ["profile_costs", "default_device"]

log = logging.getLogger(__name__)


def profile_costs(
    costs: dict[str, NodeCost],
    calls: Mapping[str, tuple[Any, Prepared]],
    needs_grad: Callable[[torch.Tensor], bool],
    device: torch.device,
    warmup: int,
    repeat: int,
) -> dict[str, NodeCost]:
    """``costs`` with measured times; each distinct call (cache key) is timed once.

    Args:
        costs: the analytic costs, by node name.
        calls: node name -> (cache key, prepared call), from ``Coster.calls``.
        needs_grad: whether a recorded input needs grad (``Coster.needs_grad``).
        device: where to time.
        warmup: untimed runs per distinct call.
        repeat: timed runs per distinct call; the median is kept.

    Returns:
        ``costs`` with ``measured_fwd_s``/``measured_bwd_s`` filled where timing worked; a node
        that cannot run on ``device`` keeps its analytic estimate (with a warning).
    """
    timed: dict[Any, tuple[float, float | None] | None] = {}
    out = dict(costs)
    for name, (key, call) in calls.items():
        if key not in timed:
            try:
                timed[key] = _measure(call, needs_grad, device, warmup, repeat)
            except Exception as e:  # keep the analytic estimate for this node
                log.warning("could not profile %s (%s): %s", name, label(call[0]), first_line(e))
                timed[key] = None
        measured = timed[key]
        if measured is not None:
            out[name] = replace(costs[name], measured_fwd_s=measured[0], measured_bwd_s=measured[1])
    return out


def _measure(
    call: Prepared, needs_grad: Callable[[torch.Tensor], bool], device: torch.device, warmup: int, repeat: int
) -> tuple[float, float | None]:
    """Median forward and backward seconds of one node on real random tensors on ``device``."""
    node, module, leaves, spec = call

    def make(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
        return random_like(t, device, requires_grad)

    def swap(v: Any) -> Any:  # device constants recorded at trace time (often 'meta')
        return device if isinstance(v, torch.device) else v

    fwd_times: list[float] = []
    bwd_times: list[float] = []
    for i in range(warmup + repeat):
        run = Call.prepare(node, module, leaves, spec, needs_grad, make, swap)
        _sync(device)
        t0 = time.perf_counter()
        out = run.fn(*run.args, **run.kwargs)
        _sync(device)
        t1 = time.perf_counter()
        ran_backward = run.backward(pytree.tree_leaves(out))
        _sync(device)
        if i >= warmup:
            fwd_times.append(t1 - t0)
            if ran_backward:
                bwd_times.append(time.perf_counter() - t1)
    return statistics.median(fwd_times), statistics.median(bwd_times) if bwd_times else None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def default_device() -> torch.device:
    """CUDA when available, else the CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
