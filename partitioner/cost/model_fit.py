"""Fit a device's speed and per-op overhead to the model's own forward and backward, timed on this process.

Legend: ``b`` rows per micro-batch, ``T(b)`` the measured seconds of one forward and backward of
the whole model at ``b`` rows, ``R(b)`` the roofline's seconds for it without per-op overhead,
``K`` the ops it runs (forward nodes, and again the backward of those that have one).

The roofline prices each op at the device's peak (or memory bandwidth) plus a fixed overhead. On
a CPU the overhead of a small op (Python, the dispatcher, the autograd engine) and the speed a
process gets beside others are what decide a step, and a synthetic probe measures neither the
way the model meets them. So: time the model itself at two sizes and solve

    T(b1) = R(b1) / s + K * overhead,     T(b2) = R(b2) / s + K * overhead

for the speed factor ``s`` (the device's FLOP/s and bandwidth are multiplied by it) and the
overhead. Run it in every process of the job at once and the sharing of cores is in the figures.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from partitioner.cost.devices import Cluster, DeviceSpec
from partitioner.errors import CalibrationError

__all__ = ["fit_speed_and_overhead", "time_forward_backward", "with_fit", "rows_like"]


def fit_speed_and_overhead(
    roofline: tuple[float, float], measured: tuple[float, float], ops: int
) -> tuple[float, float]:
    """``(s, overhead)`` with ``measured[i] = roofline[i] / s + ops * overhead`` at two sizes.

    Raises:
        CalibrationError: the larger size was not measured slower (noise swamped the timing), or
            the roofline does not grow with the size.

    Example:
        >>> s, overhead = fit_speed_and_overhead((1.0, 4.0), (0.6, 2.1), ops=100)   # s = 3 / 1.5; 0.1 / 100
        >>> s, round(overhead, 9)
        (2.0, 0.001)
    """
    (r1, r2), (t1, t2) = roofline, measured
    if not (r2 > r1 and t2 > t1 and ops > 0):
        raise CalibrationError(
            f"cannot fit speed and overhead: the roofline gives {r1:.4g} s then {r2:.4g} s and the model was "
            f"measured at {t1:.4g} s then {t2:.4g} s ({ops} ops); the larger micro-batch must take longer: time "
            "more repeats, larger sizes, or on a quieter machine"
        )
    s = (r2 - r1) / (t2 - t1)
    return s, max(0.0, (t1 - r1 / s) / ops)


def with_fit(cluster: Cluster, speed: float, overhead: float) -> Cluster:
    """``cluster`` with every device ``speed`` times as fast (FLOP/s and bandwidth) and ``overhead`` per op.

    Example:
        >>> c = with_fit(Cluster.uniform(2, "cpu"), 0.5, 1e-5)
        >>> c.devices[0].peak_flops_fp32, c.devices[0].op_overhead, c.devices[0].name
        (25000000000.0, 1e-05, 'cpu (fitted to the model)')
    """
    def fitted(d: DeviceSpec) -> DeviceSpec:
        name = d.name if d.name.endswith("(fitted to the model)") else f"{d.name} (fitted to the model)"
        return replace(d, name=name, peak_flops=d.peak_flops * speed, peak_flops_fp32=d.peak_flops_fp32 * speed,
                       mem_bandwidth=d.mem_bandwidth * speed, op_overhead=overhead)

    return replace(cluster, devices=tuple(fitted(d) for d in cluster.devices))


def rows_like(x: Any, rows: int) -> Any:
    """``x`` (a tensor with a batch dimension, or anything else, kept) with ``rows`` rows, its rows repeated."""
    if isinstance(x, torch.Tensor) and x.dim() and x.device.type != "meta":
        return x[torch.arange(rows) % x.shape[0]]
    return x


def time_forward_backward(
    model: Callable[..., Any], batches: Sequence[tuple[Sequence[Any], Mapping[str, Any]]], *, repeat: int = 7,
    warmup: int = 3, clock: Callable[[], float] = time.perf_counter,
) -> list[float]:
    """Per batch (inputs, keyword inputs), the median seconds of ``model``'s forward (a module, or
    the stages a plan builds) and a backward from the sum of its float outputs. The batches take
    turns, round by round, so a burst of other work on the machine slows them alike.

    Raises:
        CalibrationError: the inputs are on ``meta`` (nothing to run), or the outputs need no gradient.
    """
    for inputs, kwargs in batches:
        if any(isinstance(x, torch.Tensor) and x.device.type == "meta" for x in (*inputs, *kwargs.values())):
            raise CalibrationError("the example inputs are on meta: fitting to the model needs real inputs and weights")
    times: list[list[float]] = [[] for _ in batches]
    for k in range(warmup + repeat):
        for i, (inputs, kwargs) in enumerate(batches):
            t0 = clock()
            out = model(*inputs, **kwargs)
            leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)
                      and t.is_floating_point() and t.requires_grad]
            if not leaves:
                raise CalibrationError("the model's outputs need no gradient: nothing to time a backward of")
            sum(t.float().sum() for t in leaves).backward()  # type: ignore[union-attr]
            if k >= warmup:
                times[i].append(clock() - t0)
    if isinstance(model, nn.Module):
        model.zero_grad(set_to_none=True)
    return [statistics.median(t) for t in times]
