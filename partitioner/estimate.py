"""Closed-form pipeline estimates: micro-batches held per stage, step time and bubble per schedule.

Legend: ``p`` stages, ``m`` micro-batches, ``s`` a stage index; ``f[s]`` and ``b[s]`` are the
forward and backward seconds of one micro-batch on stage ``s`` (communication included).

With identical micro-batches a pipeline is a permutation flow shop, whose makespan is
``sum(t) + (m - 1) * max(t)`` for stage times ``t``. GPipe runs that twice (all forwards, then all
backwards); 1F1B interleaves them but its critical path has the same length with ``t = f + b``.
These are exact for uniform stages -- ``(m + p - 1) * (f + b)``, bubble ``(p - 1) / (m + p - 1)``
-- and close otherwise; the event simulator in ``runtime.simulate`` is the precise tool.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["SCHEDULES", "inflight", "step_time", "bubble_fraction"]

SCHEDULES = ("gpipe", "1f1b")


def inflight(schedule: str, p: int, m: int) -> tuple[int, ...]:
    """Micro-batches whose activations stage ``s`` holds at its peak, for each stage.

    Example:
        >>> inflight("1f1b", 4, 8)
        (4, 3, 2, 1)
        >>> inflight("gpipe", 2, 8)
        (8, 8)
    """
    _check(schedule, p, m)
    if schedule == "gpipe":
        return (m,) * p
    return tuple(min(m, p - s) for s in range(p))


def step_time(schedule: str, f: Sequence[float], b: Sequence[float], m: int) -> float:
    """Predicted seconds for one optimizer step of ``m`` micro-batches (without the update).

    Example:
        >>> step_time("1f1b", [1.0, 1.0], [2.0, 2.0], 4)
        15.0
    """
    _check(schedule, len(f), m)
    if schedule == "gpipe":
        return sum(f) + (m - 1) * max(f) + sum(b) + (m - 1) * max(b)
    t = [x + y for x, y in zip(f, b)]
    return sum(t) + (m - 1) * max(t)


def bubble_fraction(schedule: str, f: Sequence[float], b: Sequence[float], m: int) -> float:
    """Fraction of device-time idle during a step: ``1 - busy / (p * step_time)``.

    Example:
        >>> round(bubble_fraction("gpipe", [1.0] * 4, [2.0] * 4, 8), 4)  # (p-1)/(m+p-1)
        0.2727
    """
    total = step_time(schedule, f, b, m)
    if total <= 0:
        return 0.0
    busy = m * (sum(f) + sum(b))
    return max(0.0, 1.0 - busy / (len(f) * total))


def _check(schedule: str, p: int, m: int) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if p < 1 or m < 1:
        raise ValueError(f"need at least one stage and one micro-batch (stages: {p}, micro-batches: {m})")
