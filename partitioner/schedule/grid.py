"""The unit-time run of a schedule and its picture: a rank x step grid of actions.

Legend: ``p`` ranks, ``S`` stages, ``r`` a rank, ``t`` a step of the unit-time run.

The unit-time run is the model the checks in ``validation`` use: each action takes one step and
runs as soon as its rank reaches it and the results it reads (:func:`dependencies`) are done, on
whichever rank; communication is free. It is a picture of the order; the cost-weighted prediction
is ``partitioner.schedule.simulate``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from partitioner.schedule.actions import Action, Numbered, number

__all__ = ["Grid", "UnitRun", "draw_grid", "format_grid", "unit_run"]


class Grid(Protocol):
    """What drawing needs of a schedule: its per-rank action lists and its number of stages."""

    @property
    def actions(self) -> Sequence[Sequence[Action]]: ...

    @property
    def num_stages(self) -> int: ...


@dataclass(frozen=True)
class UnitRun:
    """When each action ran in the unit-time run, which ran although blocked, and the first stuck step."""

    steps: tuple[tuple[int, ...], ...]  # steps[r][i]: the step rank r ran its i-th action at
    forced: frozenset[tuple[int, int]]  # (r, i) run although an input was not ready
    stuck_step: int | None  # the first step at which no rank could run its next action


def unit_run(schedule: Grid, numbered: Numbered | None = None) -> UnitRun:
    """Run ``schedule`` in unit time: each step, every rank whose next action has its inputs runs it.

    Tolerates any lists: when no rank can progress, all ranks' next actions run anyway (and are
    recorded as forced), so a broken schedule still draws as a full grid. ``numbered`` is
    ``actions.number(schedule.actions, schedule.num_stages)`` if the caller has it.

    Linear in the actions (plus ``p`` per forced step): instead of asking every rank at every
    step, a rank whose next action waits is parked on the one result it waits for, and looked
    at again when that result is done.
    """
    acts = schedule.actions
    numbered = numbered or number(acts, schedule.num_stages)
    ids, reads = numbered.ids, numbered.reads
    done = bytearray(numbered.missing + 1)  # per id; the last, ``missing``, is never done
    pos = [0] * len(acts)
    steps: list[list[int]] = [[] for _ in acts]
    forced: set[tuple[int, int]] = set()
    waiting: dict[int, list[int]] = {}  # id -> ranks whose next action waits for it
    stuck_step = None
    live = sum(1 for row in ids if row)
    ready = _heads_ready(range(len(acts)), ids, reads, pos, done, waiting)
    t = 0
    while live:
        if not ready:
            ready = [r for r in range(len(acts)) if pos[r] < len(ids[r])]
            forced.update((r, pos[r]) for r in ready)
            stuck_step = t if stuck_step is None else stuck_step
        woken = list(ready)
        for r in ready:
            steps[r].append(t)
            k = ids[r][pos[r]]
            pos[r] += 1
            live -= pos[r] == len(ids[r])
            if not done[k]:
                done[k] = 1
                woken += waiting.pop(k, ())
        ready = _heads_ready(dict.fromkeys(woken), ids, reads, pos, done, waiting)
        t += 1
    return UnitRun(tuple(map(tuple, steps)), frozenset(forced), stuck_step)


def _heads_ready(
    ranks: Iterable[int],
    ids: tuple[tuple[int, ...], ...],
    reads: tuple[tuple[int, ...], ...],
    pos: list[int],
    done: bytearray,
    waiting: dict[int, list[int]],
) -> list[int]:
    """Of ``ranks``, those whose next action can run; each other one waits on its first missing input."""
    ready = []
    for r in ranks:
        if pos[r] < len(ids[r]):
            blocker = next((d for d in reads[ids[r][pos[r]]] if not done[d]), None)
            if blocker is None:
                ready.append(r)
            else:
                waiting.setdefault(blocker, []).append(r)
    return ready


def draw_grid(
    schedule: Grid,
    run: UnitRun,
    marks: frozenset[tuple[int, int]] | set[tuple[int, int]] = frozenset(),
    notes: dict[int, str] | None = None,
) -> str:
    """The grid of ``run``: ``marks`` cells in ``[brackets]``, ``notes`` after their rank's row."""
    acts = schedule.actions
    n_steps = 1 + max((t for row in run.steps for t in row), default=-1)
    width = max([len(str(a)) for row in acts for a in row] + [len(str(n_steps - 1))])
    pad, sep = (1, "") if marks else (0, " ")  # room for the [brackets] of marked cells
    cells = [[" " * (width + 2 * pad)] * n_steps for _ in acts]
    for r, row in enumerate(acts):
        for i, (a, t) in enumerate(zip(row, run.steps[r])):
            text = f"[{a}]" if (r, i) in marks else " " * pad + str(a) + " " * pad
            cells[r][t] = text.ljust(width + 2 * pad)
    head = max(len("step"), len(f"rank {len(acts) - 1}"))
    lines = [
        "step".ljust(head)
        + "  "
        + sep.join((" " * pad + str(t)).ljust(width + 2 * pad) for t in range(n_steps))
    ]
    for r in range(len(acts)):
        note = f"  <- {notes[r]}" if notes and r in notes else ""
        lines.append(f"rank {r}".ljust(head) + "  " + sep.join(cells[r]) + note)
    return "\n".join(line.rstrip() for line in lines)


def format_grid(schedule: Grid) -> str:
    """Draw the schedule as a rank x step table: rows are ranks, columns steps of unit time.

    Every action takes one step and runs as soon as its rank reaches it and its inputs are done
    (communication is free), like torchgpipe's clock cycles; empty cells are bubbles. If the lists
    deadlock, the stuck actions are drawn in ``[brackets]`` and run anyway to draw the rest.

    Example:
        >>> from partitioner.schedule.registry import get_schedule
        >>> print(format_grid(get_schedule("1f1b", 3, 3)))
        step    0   1   2   3   4   5   6   7   8   9
        rank 0  0F0 0F1 0F2         0B0     0B1     0B2
        rank 1      1F0 1F1     1B0 1F2 1B1     1B2
        rank 2          2F0 2B0 2F1 2B1 2F2 2B2
    """
    run = unit_run(schedule)
    return draw_grid(schedule, run, run.forced)
