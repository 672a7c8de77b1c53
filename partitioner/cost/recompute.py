"""Activation recomputation in the plan: which stages recompute, and what that costs them.

Legend: ``n`` units, ``p`` stages, ``s`` a stage index, ``i`` a unit index, ``held[s]``
micro-batches stage ``s`` holds at its peak under the schedule.

A stage that recomputes (``runtime.execute.recompute``) keeps only its inputs per micro-batch in flight
and rebuilds its activations, one micro-batch at a time, in the backward:

* memory:  ``state + held * in_bytes + act_bytes`` instead of ``state + held * act_bytes``;
* time:    its backward runs its forward again: ``fwd + bwd`` becomes ``2 fwd + bwd``.

The cut algorithms know one memory model, ``state + inflight * act`` (``algorithms.problem``).
A cut for recomputing stages is found by handing them the problem with ``inflight = 1`` and
the forward added to every unit's compute (:func:`recomputing_problem`); the inputs held per
micro-batch depend on the cut, so they are checked after it and the capacity of a stage that
overflows is lowered by its inputs in flight for the next cut, a few rounds at most
(:func:`cut_recomputing`). Then only
the stages that do not fit without recomputation recompute (:func:`choose_recompute`): the
others keep their activations and their speed.

Pure: plain data in, plain data out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace

from partitioner.algorithms.problem import GRAPH_INPUT, Partition, Problem
from partitioner.errors import InfeasibleMemoryError, PartitionOptionError

__all__ = [
    "RECOMPUTE_FLAGS",
    "note_user_checkpoints",
    "RECOMPUTE_OPTIONS", "check_option", "choose_recompute", "cut_recomputing", "recomputing_problem",
    "stage_input_bytes", "stage_sums",
]

log = logging.getLogger(__name__)

RECOMPUTE_OPTIONS = ("auto", True, False)
# Rounds of lowering an overflowing stage's capacity by its input bytes before giving up.
_ROUNDS = 4


# The command line's ``--recompute auto|on|off`` (``pipecut plan`` and ``pipecut train``) as the
# ``recompute=`` value of ``partition`` and ``plan_layout``.
RECOMPUTE_FLAGS: dict[str, bool | str] = {"auto": "auto", "on": True, "off": False}


def check_option(recompute: object) -> bool | str:
    """``partition(recompute=...)``: ``'auto'``, ``True`` or ``False``.

    Raises:
        PartitionOptionError: anything else (a ``ValueError``).
    """
    if isinstance(recompute, bool):
        return recompute
    if recompute == "auto":
        return "auto"
    raise PartitionOptionError(
        f"recompute={recompute!r}: use 'auto' (recompute the stages that do not fit memory otherwise), "
        "True (every stage) or False (none)"
    )


def stage_sums(values: Sequence[float], assignment: Sequence[int], p: int) -> list[float]:
    """Per stage, the sum of its units' ``values``.

    Example:
        >>> stage_sums([1.0, 2.0, 4.0], [0, 0, 1], 2)
        [3.0, 4.0]
    """
    out = [0.0] * p
    for i, s in enumerate(assignment):
        out[s] += values[i]
    return out


def stage_input_bytes(problem: Problem, assignment: Sequence[int]) -> list[float]:
    """Per stage, bytes of its inputs for one micro-batch: values made by another stage (or graph
    inputs) that one of its units reads. Each value counts once per stage that reads it.

    Example:
        >>> from partitioner.algorithms.problem import Tensor
        >>> pb = Problem(compute=((1.0,) * 3,) * 2, state_bytes=(0,) * 3, act_bytes=(0,) * 3,
        ...              tensors=(Tensor(-1, (0,), 2.0), Tensor(0, (1, 2), 8.0), Tensor(1, (2,), 4.0)),
        ...              capacity=(1, 1), inflight=(1, 1), link_bandwidth=(1.0,), link_latency=(0.0,))
        >>> stage_input_bytes(pb, [0, 1, 1])
        [2.0, 8.0]
    """
    n, p = problem.n, problem.p
    out = [0.0] * p
    for t in problem.tensors:
        src = -1 if t.producer == GRAPH_INPUT else assignment[t.producer]
        for s in {assignment[c] for c in t.consumers if c < n}:
            if s != src:
                out[s] += t.nbytes
    return out


def recomputing_problem(problem: Problem, forward: Sequence[Sequence[float]]) -> Problem:
    """``problem`` as every stage recomputing sees it: one micro-batch's activations held, and
    each unit's forward run twice.

    Args:
        problem: the plain problem (``inflight`` from the schedule).
        forward: ``forward[s][i]``, the forward seconds of unit ``i`` on stage ``s``'s device.
    """
    compute = tuple(tuple(c + f for c, f in zip(row, frow)) for row, frow in zip(problem.compute, forward))
    return replace(problem, compute=compute, inflight=(1,) * problem.p)


def recompute_memory(problem: Problem, assignment: Sequence[int]) -> list[float]:
    """Per stage, peak bytes when it recomputes: ``state + held * in_bytes + act_bytes``."""
    p = problem.p
    state = stage_sums(problem.state_bytes, assignment, p)
    act = stage_sums(problem.act_bytes, assignment, p)
    ins = stage_input_bytes(problem, assignment)
    return [state[s] + problem.inflight[s] * ins[s] + act[s] for s in range(p)]


def cut_recomputing(
    problem: Problem, forward: Sequence[Sequence[float]], solve: Callable[[Problem], Partition]
) -> Partition:
    """A cut of ``problem`` under which every stage fits memory when it recomputes.

    Args:
        problem: the plain problem (``inflight`` from the schedule).
        forward: per stage, per unit, forward seconds (see :func:`recomputing_problem`).
        solve: the cut algorithm (raises ``InfeasibleMemoryError`` when nothing fits).

    Raises:
        InfeasibleMemoryError: no cut fits, even with every stage recomputing.
    """
    base = recomputing_problem(problem, forward)
    cap = list(problem.capacity)
    need: list[float] = []
    for _ in range(_ROUNDS):
        try:
            part = solve(replace(base, capacity=tuple(cap)))
        except InfeasibleMemoryError as e:
            raise InfeasibleMemoryError(
                e.needed, list(problem.capacity),
                "Even with activation recomputation on every stage (one micro-batch's activations "
                "held, plus the inputs of those in flight), no cut fits.",
            ) from e
        need = recompute_memory(problem, part.assignment)
        overflowing = [s for s in range(problem.p) if need[s] > problem.capacity[s]]
        if not overflowing:
            return part
        # The inputs in flight overflowed these stages: ask the next cut to leave them that room.
        ins = stage_input_bytes(problem, part.assignment)
        for s in overflowing:
            cap[s] = min(cap[s], problem.capacity[s] - problem.inflight[s] * ins[s])
        log.info("recompute: inputs in flight overflow stages %s; cutting again", overflowing)
    raise InfeasibleMemoryError(
        need, list(problem.capacity),
        f"Even with activation recomputation on every stage, the inputs of the micro-batches in "
        f"flight overflow a device after {_ROUNDS} cuts.",
    )


def choose_recompute(
    state: Sequence[float],
    act: Sequence[float],
    in_bytes: Sequence[float],
    held: Sequence[int],
    capacity: Sequence[float],
    recompute: bool | str,
) -> tuple[bool, ...]:
    """Per stage, whether it recomputes.

    ``True``: every stage; ``False``: none; ``'auto'``: the stages whose activations of the
    micro-batches in flight do not fit beside their state, when recomputing lowers their need.

    Example:
        >>> choose_recompute([50, 50], [10, 10], [1, 1], [4, 1], [80, 80], "auto")
        (True, False)
        >>> choose_recompute([50, 50], [10, 10], [1, 1], [4, 1], [80, 80], False)
        (False, False)
    """
    if isinstance(recompute, bool):
        return (recompute,) * len(state)
    out = []
    for s in range(len(state)):
        plain = state[s] + held[s] * act[s]
        recomputing = state[s] + held[s] * in_bytes[s] + act[s]
        out.append(plain > capacity[s] and recomputing < plain)
    return tuple(out)


def note_user_checkpoints(modules: Sequence[str], recompute: bool | str) -> None:
    """Warn what becomes of the activation checkpointing the model asks for (``modules``: where it
    checkpoints; once per partition): the stages holding them recompute, unless ``recompute=False``."""
    if not modules:
        return
    shown = ", ".join(modules[:4]) + (f" and {len(modules) - 4} more" if len(modules) > 4 else "")
    if recompute is False:
        log.warning(
            "the model checkpoints %s (torch.utils.checkpoint / gradient_checkpointing_enable), but recompute=False "
            "was asked: no stage recomputes, each keeps its activations. Pass recompute='auto' or True "
            "(`--recompute auto|on`) to have the stages holding them recompute", shown,
        )
    else:
        log.warning(
            "the model checkpoints %s (torch.utils.checkpoint / gradient_checkpointing_enable): the stages "
            "holding them recompute (pipecut's recomputation: the whole stage's forward again in its backward, "
            "exact; the plan's recompute column shows which)", shown,
        )
