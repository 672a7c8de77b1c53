"""The cost of any assignment of units to stages, its validity, and a lower bound on the best one.

Legend: ``n`` units, ``p`` stages, ``s`` a stage index, ``i`` a unit index, ``t`` a boundary
(between stage ``t - 1`` and ``t``, served by link ``t - 1``). The cost model is the one
``problem.py`` defines; this module is its reference implementation, written for clarity
(plain loops over units and tensors) so that the fast algorithms can be checked against it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from partitioner.algorithms.problem import Partition, Problem
from partitioner.errors import PartitionError

__all__ = ["Evaluation", "evaluate", "lower_bound", "check_assignment", "link_time"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Evaluation:
    """Per-stage cost of an assignment under the model of ``problem.py``.

    Attributes:
        compute: per stage, forward + backward seconds of its units on its device.
        transfer_in: per stage, seconds to receive the values crossing the boundary into it
            (0 for stage 0).
        transfer_out: per stage, seconds to send the values crossing the boundary out of it
            (0 for the last stage).
        time: per stage, ``compute + transfer_in + transfer_out``.
        memory: per stage, ``sum(state_bytes) + inflight * sum(act_bytes)`` of its units.
        boundary_bytes: ``p - 1`` entries; ``boundary_bytes[k]`` is the bytes crossing from stage
            ``k`` to stage ``k + 1`` for one micro-batch (boundary ``t = k + 1`` of
            ``problem.py``, carried by link ``k``).
        bottleneck: the largest stage time: what a pipeline's steady state runs at.
        bottleneck_stage: the (first) stage whose time is the bottleneck.
        feasible: whether every stage's memory fits its device's capacity.
    """

    compute: tuple[float, ...]
    transfer_in: tuple[float, ...]
    transfer_out: tuple[float, ...]
    time: tuple[float, ...]
    memory: tuple[float, ...]
    boundary_bytes: tuple[float, ...]
    bottleneck: float
    bottleneck_stage: int
    feasible: bool


def link_time(nbytes: float, bandwidth: float, latency: float) -> float:
    """Seconds to move ``nbytes`` over one link: ``latency + nbytes / bandwidth``, 0 if nothing moves.

    A link of bandwidth ``<= 0`` cannot move anything: its time is infinite.

    Example:
        >>> link_time(1e9, 100e9, 1e-5)
        0.01001
        >>> link_time(0.0, 100e9, 1e-5)
        0.0
    """
    if nbytes <= 0:
        return 0.0
    if bandwidth <= 0:
        return math.inf
    return latency + nbytes / bandwidth


def evaluate(problem: Problem, assignment: Partition | Sequence[int]) -> Evaluation:
    """Cost of placing unit ``i`` on stage ``assignment[i]``, contiguous or not.

    A tensor crosses boundary ``t`` when its producer's stage is ``< t`` and the stage of its
    last consumer is ``>= t`` (the graph output counts as a consumer on the last stage; graph
    inputs never cross). The assignment is not checked for forward data flow or empty stages
    (``check_assignment`` does that); values flowing backwards simply cross nothing.

    Args:
        problem: the costs.
        assignment: a ``Partition`` or the stage of each unit.

    Returns:
        The per-stage costs, the bytes per boundary, the bottleneck and memory feasibility.

    Raises:
        PartitionError: if the assignment has the wrong length or names a stage outside ``0..p-1``.

    Example:
        >>> from partitioner.algorithms.problem import Tensor
        >>> pb = Problem(compute=((1.0, 2.0, 3.0),) * 2, state_bytes=(0, 0, 0), act_bytes=(1, 1, 1),
        ...              tensors=(Tensor(0, (1, 3), 100.0), Tensor(1, (2,), 10.0)),
        ...              capacity=(10, 10), inflight=(2, 1), link_bandwidth=(10.0,), link_latency=(0.5,))
        >>> ev = evaluate(pb, [0, 1, 1])
        >>> ev.boundary_bytes, ev.time, ev.memory
        ((100.0,), (11.5, 15.5), (2.0, 2.0))
    """
    stage = _as_stages(problem, assignment)
    n, p = problem.n, problem.p
    compute = [0.0] * p
    state = [0.0] * p
    act = [0.0] * p
    for i, s in enumerate(stage):
        compute[s] += problem.compute[s][i]
        state[s] += problem.state_bytes[i]
        act[s] += problem.act_bytes[i]
    memory = [state[s] + problem.inflight[s] * act[s] for s in range(p)]

    # crossing[k]: bytes over boundary k + 1, built as a difference array over boundaries.
    diff = [0.0] * (p + 1)
    for tensor in problem.tensors:
        if tensor.producer < 0 or not tensor.consumers:
            continue
        first = stage[tensor.producer]
        last = max(p - 1 if c >= n else stage[c] for c in tensor.consumers)
        if last > first:  # crosses boundaries first + 1 .. last
            diff[first] += tensor.nbytes
            diff[last] -= tensor.nbytes
    crossing: list[float] = []
    running = 0.0
    for k in range(p - 1):
        running += diff[k]
        crossing.append(running)

    link = [
        link_time(crossing[k], problem.link_bandwidth[k], problem.link_latency[k]) for k in range(p - 1)
    ]
    t_in = [0.0, *link]
    t_out = [*link, 0.0]
    time = [compute[s] + t_in[s] + t_out[s] for s in range(p)]
    worst = max(range(p), key=lambda s: (time[s], -s))
    return Evaluation(
        compute=tuple(compute),
        transfer_in=tuple(t_in),
        transfer_out=tuple(t_out),
        time=tuple(time),
        memory=tuple(memory),
        boundary_bytes=tuple(crossing),
        bottleneck=time[worst],
        bottleneck_stage=worst,
        feasible=all(memory[s] <= problem.capacity[s] for s in range(p)),
    )


def lower_bound(problem: Problem) -> float:
    """A bottleneck no partition can beat: work over total speed, or the largest single unit.

    With device rows that are proportional (``compute[s][i] = w[i] * r[s]``, devices that differ
    only in speed) this is ``max(1 / sum_s(1 / sum_i compute[s][i]), max_i min_s compute[s][i])``:
    the total work spread perfectly over all devices, or the slowest unit on its fastest device.
    For rows that are not proportional that first term is not a bound (two units each fast on a
    different device), so each row is first lowered to ``w[i] * r[s]`` with ``w[i] =
    min_s compute[s][i]`` and ``r[s] = min_i compute[s][i] / w[i]``, which never exceeds the true
    costs and leaves proportional rows unchanged. Communication and memory are ignored.

    Example:
        >>> from partitioner.algorithms.problem import Tensor
        >>> pb = Problem(compute=((1.0, 1.0, 2.0), (2.0, 2.0, 4.0)), state_bytes=(0, 0, 0),
        ...              act_bytes=(0, 0, 0), tensors=(), capacity=(1, 1), inflight=(1, 1),
        ...              link_bandwidth=(1.0,), link_latency=(0.0,))
        >>> round(lower_bound(pb), 6)   # 1 / (1/4 + 1/8)
        2.666667
    """
    if problem.n == 0:
        return 0.0
    rows = np.asarray(problem.compute, dtype=float).reshape(problem.p, problem.n)
    w = rows.min(axis=0)
    largest = float(w.max())
    total = float(w.sum())
    if total <= 0:
        return max(largest, 0.0)
    used = w > 0
    # At extreme magnitudes a speed factor overflows to inf: that device then adds no speed,
    # which is the right limit, so the overflow warning is noise.
    with np.errstate(over="ignore"):
        r = (rows[:, used] / w[used]).min(axis=1)  # per device, its speed factor against w
        if np.any(r <= 0):
            return largest  # a device that does some unit for free: the work term says nothing
        speed = float(np.sum(1.0 / (r * total)))
    return max(1.0 / speed, largest) if speed > 0 else largest


def check_assignment(problem: Problem, assignment: Partition | Sequence[int]) -> None:
    """Raise unless the assignment is a valid pipeline: every stage used, data flowing forward.

    Valid means: one stage in ``0..p-1`` per unit; every stage holds a unit; every value is read
    only on its producer's stage or later ones (a pipeline sends activations forward only); and,
    when ``problem.cuts`` restricts the cut positions, units on either side of a position that is
    not allowed share a stage (for a contiguous assignment: every cut is an allowed position).

    Args:
        problem: the problem the assignment is for.
        assignment: a ``Partition`` or the stage of each unit.

    Raises:
        PartitionError: naming the offending stage, units and positions, and how to fix it.

    Example:
        >>> from partitioner.algorithms.problem import Tensor
        >>> pb = Problem(compute=((1.0, 1.0),) * 2, state_bytes=(0, 0), act_bytes=(0, 0),
        ...              tensors=(Tensor(0, (1,), 4.0),), capacity=(1, 1), inflight=(1, 1),
        ...              link_bandwidth=(1.0,), link_latency=(0.0,))
        >>> check_assignment(pb, [0, 1])
        >>> check_assignment(pb, [1, 0])
        Traceback (most recent call last):
          ...
        partitioner.errors.PartitionError: unit 1 (stage 0) reads the output of unit 0 (stage 1), but data must flow forward; put unit 1 on stage 1 or later, or unit 0 on stage 0 or earlier
    """  # noqa: E501 - the error message above is one line, as the doctest compares it
    stage = _as_stages(problem, assignment)
    n, p = problem.n, problem.p
    used = set(stage)
    empty = [s for s in range(p) if s not in used]
    if empty:
        raise PartitionError(
            f"stages {empty} hold no unit ({n} units on {p} stages); every stage needs at least "
            "one unit: ask for fewer stages or move units onto the empty ones"
        )
    for tensor in problem.tensors:
        if tensor.producer < 0:
            continue
        src = stage[tensor.producer]
        for c in tensor.consumers:
            if c < n and stage[c] < src:
                raise PartitionError(
                    f"{problem.unit_name(c)} (stage {stage[c]}) reads the output of "
                    f"{problem.unit_name(tensor.producer)} (stage {src}), but data must flow "
                    f"forward; put {problem.unit_name(c)} on stage {src} or later, or "
                    f"{problem.unit_name(tensor.producer)} on stage {stage[c]} or earlier"
                )
    if problem.cuts is not None:
        allowed = set(problem.cuts)
        for k in range(1, n):
            if stage[k] != stage[k - 1] and k not in allowed:
                raise PartitionError(
                    f"{problem.unit_name(k - 1)} (stage {stage[k - 1]}) and {problem.unit_name(k)} "
                    f"(stage {stage[k]}) are split at position {k}, which is not an allowed cut "
                    f"(allowed: {_short(problem.cuts)}); keep them on one stage, or use "
                    "granularity='node' to allow cuts inside modules"
                )


def _as_stages(problem: Problem, assignment: Partition | Sequence[int]) -> tuple[int, ...]:
    stage = tuple(assignment.assignment if isinstance(assignment, Partition) else assignment)
    if len(stage) != problem.n:
        raise PartitionError(
            f"assignment has {len(stage)} entries but the problem has {problem.n} units; "
            "give one stage index per unit"
        )
    bad = [i for i, s in enumerate(stage) if not 0 <= s < problem.p or int(s) != s]
    if bad:
        i = bad[0]
        raise PartitionError(
            f"{problem.unit_name(i)} is assigned to stage {stage[i]!r}, outside 0..{problem.p - 1}; "
            f"stages are numbered from 0 to p - 1 = {problem.p - 1}"
        )
    return tuple(int(s) for s in stage)


def _short(values: Sequence[int], limit: int = 12) -> str:
    items = ", ".join(str(v) for v in values[:limit])
    return f"[{items}, ... {len(values) - limit} more]" if len(values) > limit else f"[{items}]"
