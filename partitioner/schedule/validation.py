"""Checking schedules: ``validate`` and ``peak_inflight``, on the unit-time run of ``grid``.

Legend: ``p`` ranks, ``m`` micro-batches, ``S`` stages, ``s`` a stage, ``r`` a rank, ``mb`` a
micro-batch, ``t`` a step of the unit-time run.

Every check here runs the schedule in unit time (``partitioner.schedule.grid.unit_run``): each
action takes one step and runs as soon as its rank reaches it and the results it reads are done;
communication is free. The cost-weighted prediction is ``partitioner.schedule.simulate``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import NoReturn

from partitioner.schedule.actions import Key, Kind, Numbered, dependencies, number
from partitioner.schedule.errors import ScheduleError
from partitioner.schedule.grid import UnitRun, draw_grid, unit_run
from partitioner.schedule.ir import Schedule

__all__ = ["peak_inflight", "peak_inflight_per_rank", "record_deadlock_free", "validate", "validate_numbered"]

F, B, I, W = Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT

_CHECKED = "_validated_numbering"  # where validate_numbered keeps its result on a schedule


# -- validation -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Report:
    """What :func:`validate`'s errors draw on: the schedule, its unit-time run and its title."""

    schedule: Schedule
    numbered: Numbered
    title: str

    @cached_property
    def run(self) -> UnitRun:
        """The unit-time run: the deadlock check's, or the picture in an error."""
        return unit_run(self.schedule, self.numbered)

    def fail(
        self,
        what: str,
        fix: str,
        *,
        cell: tuple[int, int] | None = None,
        note: tuple[int, str] | None = None,
    ) -> NoReturn:
        """Raise a ScheduleError: the title, what is wrong, the grid with ``cell`` marked, the fix."""
        schedule, run = self.schedule, self.run
        marks = {cell} if cell else set()
        grid = draw_grid(schedule, run, marks, dict([note]) if note else None)
        rank, action, step = None, None, None
        if cell:
            rank, action, step = (
                cell[0],
                schedule.actions[cell[0]][cell[1]],
                run.steps[cell[0]][cell[1]],
            )
        raise ScheduleError(
            f"{self.title}: {what}\n\n{grid}\n\n{fix}", rank=rank, step=step, action=action
        )


def _title(schedule: Schedule) -> str:
    """The schedule's name and sizes, e.g. ``schedule '1f1b' (2 ranks, 2 stages, 4 micro-batches)``."""
    p, S, m = schedule.num_ranks, schedule.num_stages, schedule.num_microbatches
    counts = ", ".join(
        f"{k} {word if k == 1 else words}"
        for k, word, words in (
            (p, "rank", "ranks"),
            (S, "stage", "stages"),
            (m, "micro-batch", "micro-batches"),
        )
    )
    return f"schedule {schedule.name!r} ({counts})"


def _check_placement(report: _Report) -> None:
    """Fail unless ``m >= 1`` and every stage sits on a rank ``0..p-1`` and every rank holds one."""
    schedule, fail = report.schedule, report.fail
    p, S, m = schedule.num_ranks, schedule.num_stages, schedule.num_microbatches
    if type(m) is not int or m < 1:
        fail(f"has num_microbatches={m!r}.", "Use an int >= 1.")
    if p < 1 or S < 1:
        fail("is empty.", "Give at least one rank's action list and one stage in stage_to_rank.")
    for s, r in enumerate(schedule.stage_to_rank):
        if type(r) is not int or not 0 <= r < p:
            fail(
                f"places stage {s} on rank {r!r}, but there are ranks 0..{p - 1}.",
                f"Fix stage_to_rank={schedule.stage_to_rank} or give {p} action lists.",
            )
    for r in range(p):
        if not schedule.stages_of(r):
            fail(
                f"places no stage on rank {r} (stage_to_rank={schedule.stage_to_rank}).",
                "Place a stage on every rank, or use fewer ranks.",
            )


def _check_actions(report: _Report) -> dict[Key, int]:
    """Fail on an action out of range, on the wrong rank, repeated, or a backward when forward-only.

    Returns each action's position in its rank's list, by key.
    """
    schedule = report.schedule
    S, m, place = schedule.num_stages, schedule.num_microbatches, schedule.stage_to_rank
    seen: dict[Key, int] = {}
    for r, row in enumerate(schedule.actions):
        for i, a in enumerate(row):
            key = a.key
            if a.stage >= S or a.mb >= m or place[a.stage] != r or key in seen or (
                schedule.forward_only and a.kind is not F
            ):
                _fail_action(report, r, i, seen)
            seen[key] = i
    return seen


def _fail_action(report: _Report, r: int, i: int, seen: dict[Key, int]) -> NoReturn:
    """Say what is wrong with rank ``r``'s ``i``-th action (the first check it fails, in order)."""
    schedule, fail = report.schedule, report.fail
    S, m = schedule.num_stages, schedule.num_microbatches
    a = schedule.actions[r][i]
    where = f"rank {r} runs {a} (position {i} in its list)"
    if a.stage >= S:
        fail(
            f"{where}, but there are only stages 0..{S - 1}.",
            f"Remove {a}, or add stage {a.stage} to stage_to_rank.",
            cell=(r, i),
        )
    if a.mb >= m:
        fail(
            f"{where}, but there are only micro-batches 0..{m - 1}.",
            f"Remove {a}, or raise num_microbatches.",
            cell=(r, i),
        )
    if schedule.stage_to_rank[a.stage] != r:
        fail(
            f"{where}, but stage {a.stage} is on rank {schedule.stage_to_rank[a.stage]} "
            f"(stage_to_rank={schedule.stage_to_rank}).",
            f"Move {a} to rank {schedule.stage_to_rank[a.stage]}'s list, or change stage_to_rank.",
            cell=(r, i),
        )
    if schedule.forward_only and a.kind is not F:
        fail(
            f"{where} in a forward-only schedule.",
            f"Remove {a}, or build the schedule with forward_only=False.",
            cell=(r, i),
        )
    fail(
        f"{where} a second time (first at position {seen[a.key]}); each action runs exactly once.",
        f"Remove one of the two {a}.",
        cell=(r, i),
    )


def _check_complete(report: _Report, seen: dict[Key, int]) -> None:
    """Fail unless every stage and micro-batch runs ``F``, then ``B`` or both ``I`` and ``W``."""
    schedule = report.schedule
    runs: dict[tuple[int, int], str] = {}  # (stage, mb) -> the letters it runs (none repeated)
    for s, letter, mb in seen:
        runs[s, mb] = runs.get((s, mb), "") + letter
    for s in range(schedule.num_stages):
        for mb in range(schedule.num_microbatches):
            has = runs.get((s, mb), "")
            if schedule.forward_only:
                fine = "F" in has
            else:
                fine = "F" in has and (has.replace("F", "") in ("B", "IW", "WI"))
            if not fine:
                _fail_incomplete(report, seen, s, mb)


def _fail_incomplete(report: _Report, seen: dict[Key, int], s: int, mb: int) -> None:
    """Say what stage ``s`` runs wrong for micro-batch ``mb`` (the first check it fails, in order)."""
    schedule, fail = report.schedule, report.fail
    r = schedule.stage_to_rank[s]
    has = {k for k in Kind if (s, k.value, mb) in seen}
    cell = next(((r, seen[s, k.value, mb]) for k in (I, W, B) if k in has), None)
    if F not in has:
        fail(
            f"never runs {s}F{mb} (stage {s}, micro-batch {mb}).",
            f"Add {s}F{mb} to rank {r}'s list.",
            note=(r, f"missing {s}F{mb}"),
        )
    if schedule.forward_only:
        return
    if B in has and has & {I, W}:
        fail(
            f"runs both {s}B{mb} and a split backward ({s}I{mb}/{s}W{mb}) for stage {s}, micro-batch {mb}.",
            f"Keep either {s}B{mb} or both {s}I{mb} and {s}W{mb}.",
            cell=cell,
        )
    if not has & {B, I, W}:
        fail(
            f"never runs the backward of stage {s}, micro-batch {mb}.",
            f"Add {s}B{mb} (or {s}I{mb} then {s}W{mb}) to rank {r}'s list after {s}F{mb}.",
            note=(r, f"missing {s}B{mb}"),
        )
    if has & {I, W} and has & {I, W} != {I, W}:
        have, lack = (f"{s}I{mb}", f"{s}W{mb}") if I in has else (f"{s}W{mb}", f"{s}I{mb}")
        fail(
            f"runs {have} but never {lack}: a split backward needs both.",
            f"Add {lack} to rank {r}'s list ({s}I{mb} before {s}W{mb}), or use one {s}B{mb}.",
            cell=cell,
            note=(r, f"missing {lack}"),
        )


def _plainly_complete(schedule: Schedule, numbered: Numbered) -> bool:
    """What :func:`_check_actions` and :func:`_check_complete` check, proved in whole-list passes.

    ``True`` when every action is in range, on its stage's rank, unrepeated, and every stage and
    micro-batch runs ``F`` and then ``B`` or both ``I`` and ``W`` (only ``F`` when forward-only).
    ``False`` sends the caller to the action-by-action checks, which say what is wrong.
    """
    S, m, place = schedule.num_stages, schedule.num_microbatches, schedule.stage_to_rank
    acts = numbered.actions
    if len(acts) != sum(map(len, numbered.ids)) or not acts:  # an action repeated, or none
        return False
    if max(a.stage for a in acts) >= S or max(a.mb for a in acts) >= m:
        return False
    if any(place[s] != r for r, row in enumerate(schedule.actions) for s in {a.stage for a in row}):
        return False
    # Each (stage, micro-batch) as one int, per kind: unrepeated and in range, so sets count exactly.
    of = {kind: {a.mb * S + a.stage for a in acts if a.kind is kind} for kind in (F, B, I, W)}
    if len(of[F]) != S * m:
        return False
    if schedule.forward_only:
        return len(of[F]) == len(acts)
    return len(of[B]) + len(of[I]) == S * m and of[I] == of[W] and not of[B] & of[I]


def _positions(schedule: Schedule) -> dict[Key, int]:
    """Each action's position in its rank's list, by key."""
    return {a.key: i for row in schedule.actions for i, a in enumerate(row)}


def _check_deadlock(report: _Report) -> None:
    """Fail if the run gets stuck; at the first stuck step, say what each rank waits for."""
    schedule, run = report.schedule, report.run
    if run.stuck_step is None:
        return
    seen = _positions(schedule)
    t = run.stuck_step
    acts = schedule.actions
    done = {a for r, row in enumerate(acts) for a, u in zip(row, run.steps[r]) if u < t}
    heads = {r: i for r, i in run.forced if run.steps[r][i] == t}
    present = {a for row in acts for a in row}
    reasons = []
    for r, i in sorted(heads.items()):
        a = acts[r][i]
        for d in dependencies(a, present, schedule.num_stages):
            if d in done:
                continue
            q = schedule.stage_to_rank[d.stage]
            j = seen[d.key]  # its position: complete and unrepeated, checked before
            if q == r:
                reasons.append(
                    f"  rank {r} waits at {a} (position {i}) for {d}, which comes later "
                    f"in its own list (position {j}); move {d} before {a}."
                )
            elif j == heads[q]:
                reasons.append(
                    f"  rank {r} waits at {a} (position {i}) for {d}, rank {q}'s next "
                    "action, which waits too."
                )
            else:
                reasons.append(
                    f"  rank {r} waits at {a} (position {i}) for {d}, which rank {q} runs "
                    f"later (position {j}), behind its own waiting {acts[q][heads[q]]}."
                )
    grid = draw_grid(schedule, run, run.forced)
    raise ScheduleError(
        f"{report.title}: deadlocks at step {t}: no rank can run its next action.\n"
        + "\n".join(reasons)
        + f"\n\n{grid}\n\nCells in [brackets] wait for an input that is never ready; the grid runs "
        "them anyway to draw the rest. Reorder the lists so that every action's inputs come first "
        "(an F after the previous stage's F, a B or I after the next stage's backward), e.g. start "
        "from get_schedule('1f1b', p, m).",
        rank=min(heads),
        step=t,
        action=acts[min(heads)][heads[min(heads)]],
    )


def validate(schedule: Schedule) -> None:
    """Prove the schedule runs every micro-batch through the pipeline exactly once, without deadlock.

    Checks, in order: the placement (every stage on a rank ``0..p-1``, every rank holding one);
    each action (stage and micro-batch in range, on the rank holding its stage, not repeated,
    no backward in a forward-only schedule); completeness (each stage and micro-batch runs ``F``
    and then ``B`` or both ``I`` and ``W``); and that the lists cannot deadlock. An action
    depends on the forward of the previous stage (``F``), on its own ``F`` and the backward of
    the next stage (``B``, ``I``), or on its own ``I`` (``W``), on whichever rank those run;
    simulating the lists under these dependencies must never leave every rank waiting.

    Raises:
        ScheduleError: saying what is wrong and how to fix it, with the grid of the schedule
            (see ``grid.format_grid``) where the offending cells are in ``[brackets]``.

    Example:
        >>> from partitioner.schedule.ir import Schedule
        >>> from partitioner.schedule.registry import get_schedule
        >>> validate(get_schedule("gpipe", 2, 2))  # passes: returns None
        >>> broken = Schedule.from_text('''pipecut schedule v1
        ... microbatches: 2
        ... stage_to_rank: 0 1
        ... rank 0: 0F0 0B0 0F1 0B1
        ... rank 1: 1F0 1F1 1B0 1B1''')
        >>> try:
        ...     validate(broken)
        ... except ScheduleError as err:
        ...     print(err)  # doctest: +ELLIPSIS
        schedule '' (2 ranks, 2 stages, 2 micro-batches): deadlocks at step 2: no rank can run ...
          rank 0 waits at 0B0 (position 1) for 1B0, which rank 1 runs later (position 2), ...
          rank 1 waits at 1F1 (position 1) for 0F1, which rank 0 runs later (position 2), ...
        <BLANKLINE>
        step     0    1    2    3    4    5
        rank 0   0F0      [0B0] 0F1       0B1
        rank 1        1F0 [1F1] 1B0  1B1
        <BLANKLINE>
        Cells in [brackets] wait for an input that is never ready; ...
    """
    validate_numbered(schedule)


def validate_numbered(schedule: Schedule, *, deadlock: bool = True) -> Numbered:
    """:func:`validate`, then the schedule's actions numbered (``actions.number``) for the caller's run.

    A schedule is frozen, so it is checked once: the numbered actions are kept on the schedule
    object and later calls (the planner's memory count, then its predictions) return them.

    Args:
        schedule: the schedule.
        deadlock: also prove that the lists cannot deadlock (the unit-time run). ``False``
            for a caller that runs the lists itself and calls :func:`record_deadlock_free`
            when the run completes, or :func:`validate` (which raises) when it stalls: the
            simulator, whose run proves the same thing.

    Raises:
        ScheduleError: as :func:`validate`.
    """
    cached: tuple[Numbered, bool] | None = schedule.__dict__.get(_CHECKED)
    if cached is not None and (cached[1] or not deadlock):
        return cached[0]
    numbered = number(schedule.actions, schedule.num_stages)
    report = _Report(schedule, numbered, _title(schedule))
    _check_placement(report)
    if not _plainly_complete(schedule, numbered):
        _check_complete(report, _check_actions(report))  # say what is wrong
    if deadlock:
        _check_deadlock(report)
    object.__setattr__(schedule, _CHECKED, (numbered, deadlock))  # frozen dataclass: a cache, not a field
    return numbered


def record_deadlock_free(schedule: Schedule, numbered: Numbered) -> None:
    """Note that a run of ``schedule``'s lists (numbered by :func:`validate_numbered`) completed.

    Every action ran in list order once its inputs were done, which is what the deadlock check
    asks; later :func:`validate` calls skip it.
    """
    cached = schedule.__dict__.get(_CHECKED)
    if cached is not None and cached[0] is numbered:
        object.__setattr__(schedule, _CHECKED, (numbered, True))


def peak_inflight(schedule: Schedule) -> tuple[int, ...]:
    """Per stage, the most micro-batches whose activations it holds at once.

    A micro-batch is held on stage ``s`` from its ``F`` until its last backward action there:
    ``B``, or ``W`` for a split backward (``I`` frees the output gradient's consumers but the
    layer inputs stay until ``W`` reads them, so the micro-batch still counts). A stage's memory
    depends only on its own rank's order, so this counts along each list, not in time. A
    forward-only schedule keeps nothing for a backward: all zeros.

    Raises:
        ScheduleError: the schedule is invalid (see :func:`validate`).

    Example:
        >>> from partitioner.schedule.registry import get_schedule
        >>> peak_inflight(get_schedule("gpipe", 4, 8)), peak_inflight(get_schedule("1f1b", 4, 8))
        ((8, 8, 8, 8), (4, 3, 2, 1))
    """
    validate(schedule)
    peak = [0] * schedule.num_stages
    if schedule.forward_only:
        return tuple(peak)
    held = [0] * schedule.num_stages
    for row in schedule.actions:
        for a in row:
            if a.kind is F:
                held[a.stage] += 1
                peak[a.stage] = max(peak[a.stage], held[a.stage])
            elif a.kind in (B, W):
                held[a.stage] -= 1
    return tuple(peak)


def peak_inflight_per_rank(schedule: Schedule) -> tuple[int, ...]:
    """Per rank, the most (stage, micro-batch) activations it holds at once, over all its stages.

    Counted as :func:`peak_inflight` does (from ``F`` to ``B`` or ``W``), along the rank's own
    list. With one stage per rank it equals :func:`peak_inflight`; with ``v`` chunks per rank, a
    chunk holds ``1/v`` of the rank's layers, so divide by ``v`` to compare with one-stage
    schedules in units of a whole rank's activations.

    Raises:
        ScheduleError: the schedule is invalid (see :func:`validate`).

    Example:
        >>> from partitioner.schedule.registry import get_schedule
        >>> peak_inflight_per_rank(get_schedule("zbv", 4, 8))  # 2 chunks: 8 halves = 4 wholes
        (8, 8, 8, 8)
    """
    validate(schedule)
    peak = [0] * schedule.num_ranks
    if schedule.forward_only:
        return tuple(peak)
    for r, row in enumerate(schedule.actions):
        held = 0
        for a in row:
            if a.kind is F:
                held += 1
                peak[r] = max(peak[r], held)
            elif a.kind in (B, W):
                held -= 1
    return tuple(peak)
