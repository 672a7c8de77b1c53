"""Stages of fixed, known cost for the schedule benchmark: autograd Functions that sleep.

``time.sleep`` releases the GIL and lasts the same whatever else the 2 cores are doing, so a
stage made of sleeps costs what it is told to, not what the shared machine allows. Not exactly,
though: on this machine a 20 ms sleep inside an autograd Function returns about 0.5 ms late
(the sleep's own overshoot, ~0.1 ms, plus the code after it running on a CPU that went cold
while the thread slept). That excess belongs to the benchmark's stand-in for compute, not to the
runtime, so :func:`calibrate` measures it on a block run alone, outside any pipeline, and every
sleep is shortened by it. What the executor and the transports add on top stays in the
measurement.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from torch import nn

ROWS, WIDTH = 2, 16  # a micro-batch's activations: (ROWS, WIDTH); their size does not matter

# Seconds each sleep is shortened by (set by calibrate(); per process).
_correction = 0.0


def _sleep(seconds: float) -> None:
    time.sleep(max(0.0, seconds - _correction))


class _SleepInput(torch.autograd.Function):
    """Identity whose forward sleeps ``f`` s and whose backward sleeps ``b`` s (the input gradient)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, f: float, b: float) -> torch.Tensor:
        _sleep(f)
        ctx.b = b
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        _sleep(ctx.b)
        return grad, None, None


class _SleepWeight(torch.autograd.Function):
    """Identity on a parameter whose backward sleeps ``w`` s (the weight gradient)."""

    @staticmethod
    def forward(ctx: Any, prm: torch.Tensor, w: float) -> torch.Tensor:
        ctx.w = w
        return prm.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        _sleep(ctx.w)
        return grad, None


class SleepBlock(nn.Module):
    """A stage of fixed cost: ``F`` s forward, ``B_in`` s input gradient, ``W`` s weight gradient."""

    def __init__(self, forward_s: float, input_grad_s: float, weight_grad_s: float) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(WIDTH))
        self.costs = (forward_s, input_grad_s, weight_grad_s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (ROWS, WIDTH) -> (ROWS, WIDTH)
        f, b, w = self.costs
        return _SleepInput.apply(x, f, b) + _SleepWeight.apply(self.bias, w)


def _block_times(cost_s: float, trials: int) -> tuple[float, float]:
    """Median forward and fused-backward wall time of one block run alone."""
    block = SleepBlock(cost_s, cost_s, cost_s)
    fwd, bwd = [], []
    for _ in range(trials):
        x = torch.zeros(ROWS, WIDTH, requires_grad=True)
        t0 = time.perf_counter()
        y = block(x)
        t1 = time.perf_counter()
        y.backward(torch.ones_like(y))
        t2 = time.perf_counter()
        fwd.append(t1 - t0)
        bwd.append(t2 - t1)
    return statistics.median(fwd), statistics.median(bwd)


def calibrate(cost_s: float, trials: int = 12) -> dict[str, float]:
    """Set the per-sleep correction from a block of ``cost_s`` per sleep; returns what was found.

    The correction is the forward's excess (one sleep, one Function call), capped at a quarter of
    ``cost_s``. Returned: the excess per sleep before and after, forward and backward (a fused
    backward has two sleeps), in seconds.
    """
    global _correction
    _correction = 0.0
    f0, b0 = _block_times(cost_s, trials)
    _correction = min(max(0.0, f0 - cost_s), cost_s / 4)
    f1, b1 = _block_times(cost_s, trials)
    return {"correction_s": _correction, "forward_excess_before_s": f0 - cost_s,
            "backward_excess_before_s": (b0 - 2 * cost_s) / 2, "forward_excess_after_s": f1 - cost_s,
            "backward_excess_after_s": (b1 - 2 * cost_s) / 2}
