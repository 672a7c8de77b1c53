"""Shared by the schedule tests: small builders, an independent executor model, hypothesis strategies.

Legend: ``p`` ranks, ``m`` micro-batches, ``v`` stages per rank, ``S`` stages, ``s`` a stage,
``r`` a rank, ``mb`` a micro-batch.

The executor-level checks (``run_buffered``, ``run_rendezvous``) re-derive dependencies and
message matching here, independently of the runtime modules, so they can disagree with them.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from partitioner.schedule.actions import Action, Kind
from partitioner.schedule.comm import Op, Recv, Send
from partitioner.schedule.errors import ScheduleError
from partitioner.schedule.ir import Schedule
from partitioner.schedule.validation import validate

A = Action.parse
GRID = [(p, m) for p in range(1, 7) for m in range(1, 13)]
TRAINING = ("gpipe", "1f1b")
DOCS = Path(__file__).resolve().parents[3] / "docs"


def sched(
    *rows: str, placement: tuple[int, ...] | None = None, m: int = 0, **kw: object
) -> Schedule:
    """A schedule from one string of actions per rank; ``m`` defaults to the largest mb + 1."""
    actions = [[A(tok) for tok in row.split()] for row in rows]
    m = m or 1 + max(a.mb for row in actions for a in row)
    return Schedule(tuples(actions), placement or tuple(range(len(rows))), m, **kw)  # type: ignore[arg-type]


def tuples(rows: list[list[Action]]) -> tuple[tuple[Action, ...], ...]:
    return tuple(map(tuple, rows))


def error_of(schedule: Schedule) -> ScheduleError:
    with pytest.raises(ScheduleError) as info:
        validate(schedule)
    return info.value


def refuses(error: type[Exception], build: Callable[[], object], match: str) -> None:
    """``build()`` raises ``error``, a ``ValueError`` too, with a message that matches ``match``."""
    with pytest.raises(error, match=match) as info:
        build()
    assert isinstance(info.value, ValueError)


# -- an independent model of what an executor does -------------------------------------------


def reads(x: Action, present: set[Action], S: int, edges: list[tuple[int, int]]) -> list[Action]:
    """What ``x`` reads, re-derived here: forward edges, own F before backward, own I before W."""
    if x.kind is Kind.FORWARD:
        return [Action(a, Kind.FORWARD, x.mb) for a, b in edges if b == x.stage]
    if x.kind is Kind.BACKWARD_WEIGHT:
        return [Action(x.stage, Kind.BACKWARD_INPUT, x.mb)]
    grads = []
    for a, b in edges:
        if a == x.stage:
            i = Action(b, Kind.BACKWARD_INPUT, x.mb)
            grads.append(i if i in present else Action(b, Kind.BACKWARD, x.mb))
    return [Action(x.stage, Kind.FORWARD, x.mb), *grads]


def chain(S: int) -> list[tuple[int, int]]:
    return [(s, s + 1) for s in range(S - 1)]


def deadlocks(schedule: Schedule) -> bool:
    """Greedy run in any order: running an action never blocks another, so the verdict is unique."""
    present = {a for row in schedule.actions for a in row}
    edges = chain(schedule.num_stages)
    pos, done = [0] * schedule.num_ranks, set[Action]()
    moved = True
    while moved:
        moved = False
        for r, row in enumerate(schedule.actions):
            while (
                pos[r] < len(row)
                and set(reads(row[pos[r]], present, schedule.num_stages, edges)) <= done
            ):
                done.add(row[pos[r]])
                pos[r] += 1
                moved = True
    return any(pos[r] < len(row) for r, row in enumerate(schedule.actions))


def run_buffered(
    schedule: Schedule, plans: tuple[tuple[Op, ...], ...], edges: list[tuple[int, int]]
) -> None:
    """Execute the programs: sends never block, receives block, untagged FIFO per rank pair.

    Asserts that every action finds its inputs (done locally, or received), every receive gets
    the message it names, nothing is left in flight, and no rank is stuck.
    """
    place, S = schedule.stage_to_rank, schedule.num_stages
    present = {a for row in schedule.actions for a in row}
    queues: dict[tuple[int, int], deque[tuple[int, Kind, int, int]]] = {}
    pos = [0] * len(plans)
    done: list[set[Action]] = [set() for _ in plans]
    inbox: list[set[tuple[Action, int]]] = [set() for _ in plans]
    moved = True
    while moved:
        moved = False
        for r, ops in enumerate(plans):
            while pos[r] < len(ops):
                op = ops[pos[r]]
                if isinstance(op, Recv):
                    queue = queues.get((op.peer, r))
                    if not queue:
                        break
                    assert queue.popleft() == (op.stage, op.kind, op.mb, op.to_stage), (
                        f"rank {r}: {op}"
                    )
                    inbox[r].add((Action(op.stage, op.kind, op.mb), op.to_stage))
                elif isinstance(op, Send):
                    assert Action(op.stage, op.kind, op.mb) in done[r]
                    assert place[op.to_stage] == op.peer != r
                    queues.setdefault((r, op.peer), deque()).append(
                        (op.stage, op.kind, op.mb, op.to_stage)
                    )
                else:
                    assert place[op.stage] == r
                    for src in reads(op, present, S, edges):
                        local = place[src.stage] == r
                        assert (src in done[r]) if local else ((src, op.stage) in inbox[r]), (
                            f"rank {r}: {op} before {src}"
                        )
                    done[r].add(op)
                pos[r] += 1
                moved = True
    assert all(pos[r] == len(ops) for r, ops in enumerate(plans)), f"deadlock at {pos}"
    assert not any(queues.values()), "messages sent but never received"


def run_rendezvous(plans: tuple[tuple[Op, ...], ...], *, batched: bool) -> bool:
    """Whether the programs finish when a send completes only once its receive is posted.

    ``batched``: each run of consecutive sends/receives between two actions is posted as one
    group (``batch_isend_irecv``) and waited on as a whole; else each op is waited on alone.
    Between two ranks in one direction the k-th send meets the k-th receive. Actions never block.
    """
    segments: list[
        list[list[tuple[str, int, int, int]]]
    ] = []  # rank -> group -> (side, src, dst, k)
    where: dict[tuple[str, int, int, int], tuple[int, int]] = {}  # op -> (rank, group)
    counts: dict[tuple[str, int, int], int] = {}
    for r, ops in enumerate(plans):
        groups: list[list[tuple[str, int, int, int]]] = []
        after_comm = False
        for op in ops:
            if isinstance(op, (Send, Recv)):
                side, src, dst = (
                    ("send", r, op.peer) if isinstance(op, Send) else ("recv", op.peer, r)
                )
                k = counts.get((side, src, dst), 0)
                counts[(side, src, dst)] = k + 1
                if not (batched and after_comm):
                    groups.append([])
                groups[-1].append((side, src, dst, k))
                where[(side, src, dst, k)] = (r, len(groups) - 1)
            after_comm = isinstance(op, (Send, Recv))
        segments.append(groups)
    at = [0] * len(plans)
    moved = True
    while moved:
        moved = False
        for r, groups in enumerate(segments):
            while at[r] < len(groups):
                partners = [
                    where[("recv" if side == "send" else "send", src, dst, k)]
                    for side, src, dst, k in groups[at[r]]
                ]
                if any(at[q] < g for q, g in partners):
                    break
                at[r] += 1
                moved = True
    return all(at[r] == len(groups) for r, groups in enumerate(segments))


# -- hypothesis strategies ---------------------------------------------------------------------


def placement_of(style: str, p: int, v: int, rnd: random.Random) -> tuple[int, ...]:
    if style == "interleaved":
        return tuple(s % p for s in range(p * v))
    if style == "v":  # chunk c runs up the ranks when even, back down when odd (ZB-V for v = 2)
        return tuple(r if c % 2 == 0 else p - 1 - r for c in range(v) for r in range(p))
    ranks = [r for r in range(p) for _ in range(v)]
    rnd.shuffle(ranks)
    return tuple(ranks)


@st.composite
def valid_schedules(draw: st.DrawFn) -> Schedule:
    """Random placements and split backwards; each rank's list projects one random valid run."""
    p, v, m = draw(st.integers(1, 4)), draw(st.integers(1, 3)), draw(st.integers(1, 5))
    rnd = draw(st.randoms(use_true_random=False))
    placement = placement_of(draw(st.sampled_from(["interleaved", "v", "random"])), p, v, rnd)
    S, infer = p * v, draw(st.booleans()) and draw(st.booleans())
    todo = {Action(s, Kind.FORWARD, mb) for s in range(S) for mb in range(m)}
    if not infer:
        for s in range(S):
            for mb in range(m):
                kinds = (
                    [Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT]
                    if rnd.random() < 0.5
                    else [Kind.BACKWARD]
                )
                todo |= {Action(s, k, mb) for k in kinds}
    present, done = set(todo), set[Action]()
    rows: list[list[Action]] = [[] for _ in range(p)]
    while todo:
        ready = sorted((a for a in todo if set(reads(a, present, S, chain(S))) <= done), key=str)
        a = rnd.choice(ready)
        todo.remove(a)
        done.add(a)
        rows[placement[a.stage]].append(a)
    name = draw(st.text("abcxyz-1_", max_size=8))
    return Schedule(tuples(rows), placement, m, forward_only=infer, name=name)


actions = st.builds(
    Action, st.integers(0, 10**6), st.sampled_from(list(Kind)), st.integers(0, 10**6)
)
quick = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def over_valid_schedules(test: Callable[[Schedule, random.Random], None]) -> Callable[..., None]:
    """``test(schedule, rnd)`` run, under :data:`quick`, over :func:`valid_schedules`, each with a seeded
    ``random.Random`` to vary it with."""
    return quick(given(valid_schedules(), st.randoms(use_true_random=False))(test))


def makespan(schedule: Schedule, cost: dict[Kind, int] | None = None) -> int:
    """Steps a valid schedule takes when each rank runs its list in order as soon as it can.

    Re-derived here, independently of ``partitioner.schedule.validation`` and
    ``partitioner.schedule.simulate``: an action
    starts when its rank's previous action ended and the actions it reads (``reads``) ended;
    ``cost[kind]`` steps each (default one), communication free.
    """
    cost = cost or {}
    present = {a for row in schedule.actions for a in row}
    edges = chain(schedule.num_stages)
    end: dict[Action, int] = {}
    pos, free = [0] * schedule.num_ranks, [0] * schedule.num_ranks
    moved = True
    while moved:
        moved = False
        for r, row in enumerate(schedule.actions):
            while pos[r] < len(row):
                a = row[pos[r]]
                inputs = reads(a, present, schedule.num_stages, edges)
                if not all(x in end for x in inputs):
                    break
                start = max([free[r]] + [end[x] for x in inputs])
                end[a] = free[r] = start + cost.get(a.kind, 1)
                pos[r] += 1
                moved = True
    assert all(pos[r] == len(row) for r, row in enumerate(schedule.actions)), "deadlock"
    return max(free)
