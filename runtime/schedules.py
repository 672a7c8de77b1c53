"""Pipeline schedules as data: per-rank action lists, their checks, grid and text forms, comm plan.

Legend: ``p`` ranks, ``m`` micro-batches, ``v`` stages (chunks) per rank, ``S`` stages in all
(``S = p * v``; ``v = 1`` for GPipe and 1F1B), ``s`` a stage index, ``r`` a rank, ``mb`` a
micro-batch index, ``t`` a step of the unit-time simulation.

Notation: an action prints as ``<stage><kind><mb>``; ``1F3`` is stage 1's forward of
micro-batch 3. The kinds are torch.distributed.pipelining's letters:

* ``F`` forward;
* ``B`` full backward: input and weight gradients in one pass;
* ``I`` backward for inputs only (the gradient for the previous stage, sent early);
* ``W`` backward for weights only, after the ``I`` of the same stage and micro-batch.

Every (stage, micro-batch) runs ``F``, then either ``B`` or ``I`` and ``W`` (split backward).

A schedule is one action list per rank plus ``stage_to_rank``, so any placement fits the same IR:
``(0, 1, ..., p - 1)`` for GPipe and 1F1B, ``s % p`` for interleaved stages, and
``(0, ..., p - 1, p - 1, ..., 0)`` for V-shaped (ZB-V: rank ``r`` holds ``r`` and ``2p - 1 - r``).

Communication is implicit: it follows from the actions and the placement, so it can never
disagree with them. :func:`comm_plan` derives each rank's ordered sends and receives.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any, NoReturn

__all__ = [
    "Action",
    "Kind",
    "Op",
    "Recv",
    "Schedule",
    "ScheduleError",
    "ScheduleFormatError",
    "Send",
    "UnknownScheduleError",
    "comm_plan",
    "format_grid",
    "forward_only",
    "get_schedule",
    "gpipe",
    "one_f_one_b",
    "peak_inflight",
    "schedule_names",
    "validate",
]

_TEXT_HEADER = "pipecut schedule v1"


class ScheduleError(ValueError):
    """A schedule is invalid: an action misplaced, missing or repeated, or lists that deadlock.

    Attributes:
        rank: the rank where the problem shows, if one does.
        step: the step of the unit-time simulation where it shows, if one does.
        action: the offending action, if one is.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        step: int | None = None,
        action: Action | None = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.step = step
        self.action = action


class ScheduleFormatError(ScheduleError):
    """An action or a schedule's text form cannot be parsed."""


class UnknownScheduleError(ScheduleError):
    """A schedule name is not in the registry (see :func:`schedule_names`)."""


class Kind(str, Enum):
    """What an action computes; the value is its letter in the notation."""

    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"

    def __str__(self) -> str:
        return self.value


F, B, I, W = Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT

# ASCII digits without leading zeros, so that parse(text) prints back as text.
_ACTION_RE = re.compile(r"(0|[1-9][0-9]*)([FBIW])(0|[1-9][0-9]*)")


@dataclass(frozen=True)
class Action:
    """One unit of work on one rank: stage ``stage`` runs ``kind`` on micro-batch ``mb``.

    Example:
        >>> a = Action(1, Kind.FORWARD, 3)
        >>> str(a), Action.parse("1F3") == a
        ('1F3', True)
    """

    stage: int
    kind: Kind
    mb: int

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", Kind(self.kind))
        except ValueError:
            raise ScheduleFormatError(
                f"unknown action kind {self.kind!r}; use one of F, B, I, W (Kind.FORWARD, ...)"
            ) from None
        for field, value in (("stage", self.stage), ("mb", self.mb)):
            if type(value) is not int or value < 0:
                raise ScheduleFormatError(
                    f"action {field} must be an int >= 0 (got {value!r} in "
                    f"Action(stage={self.stage!r}, kind={self.kind}, mb={self.mb!r}))"
                )

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.mb}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Read an action from its notation, the inverse of ``str(action)``.

        Args:
            text: ``<stage><kind><mb>`` with kind one of ``F B I W``, e.g. ``'1F3'``.

        Returns:
            The action.

        Raises:
            ScheduleFormatError: ``text`` is not exactly one action in the notation.

        Example:
            >>> Action.parse("0W11")
            Action(stage=0, kind=<Kind.BACKWARD_WEIGHT: 'W'>, mb=11)
        """
        match = _ACTION_RE.fullmatch(text)
        if match is None:
            raise ScheduleFormatError(
                f"cannot parse {text!r} as an action: write <stage><kind><micro-batch> with kind "
                "one of F (forward), B (full backward), I (input grads), W (weight grads), "
                "e.g. '1F3'"
            )
        return cls(int(match[1]), Kind(match[2]), int(match[3]))


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists and the stage placement. Construction does not check; :func:`validate` does.

    Attributes:
        actions: ``actions[r]`` is rank ``r``'s actions in the order it runs them (``p`` lists).
        stage_to_rank: ``stage_to_rank[s]`` is the rank holding stage ``s`` (``S`` entries).
        num_microbatches: ``m``; every micro-batch ``0..m-1`` must run through every stage.
        forward_only: inference: only ``F`` actions, nothing held for a backward.
        name: the registry name, for messages and the text form.

    Example:
        >>> s = get_schedule("1f1b", 2, 2)
        >>> [" ".join(map(str, row)) for row in s.actions]
        ['0F0 0F1 0B0 0B1', '1F0 1B0 1F1 1B1']
        >>> Schedule.from_text(s.to_text()) == s
        True
    """

    actions: tuple[tuple[Action, ...], ...]
    stage_to_rank: tuple[int, ...]
    num_microbatches: int
    forward_only: bool = False
    name: str = ""

    def __post_init__(self) -> None:
        # Lists are accepted for convenience; tuples keep the schedule hashable and immutable.
        object.__setattr__(self, "actions", tuple(tuple(row) for row in self.actions))
        object.__setattr__(self, "stage_to_rank", tuple(self.stage_to_rank))

    @property
    def num_ranks(self) -> int:
        """``p``, the number of action lists."""
        return len(self.actions)

    @property
    def num_stages(self) -> int:
        """``S``, the number of stages placed."""
        return len(self.stage_to_rank)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages rank ``rank`` holds, ascending."""
        return tuple(s for s, r in enumerate(self.stage_to_rank) if r == rank)

    def __str__(self) -> str:
        return format_grid(self)

    def to_text(self) -> str:
        """Lossless text form: a header, then one line per rank, ``rank 0: 0F0 0F1 0B0 ...``.

        Raises:
            ScheduleFormatError: the name spans lines or has surrounding spaces (it would not
                read back the same).

        Example:
            >>> print(get_schedule("forward", 2, 2).to_text(), end="")
            pipecut schedule v1
            name: forward
            microbatches: 2
            stage_to_rank: 0 1
            forward_only: yes
            rank 0: 0F0 0F1
            rank 1: 1F0 1F1
        """
        if self.name != self.name.strip() or len(self.name.splitlines()) > 1:
            raise ScheduleFormatError(
                f"schedule name {self.name!r} cannot be written as text: use one line without "
                "leading or trailing spaces"
            )
        lines = [
            _TEXT_HEADER,
            f"name: {self.name}",
            f"microbatches: {self.num_microbatches}",
            "stage_to_rank: " + " ".join(map(str, self.stage_to_rank)),
            f"forward_only: {'yes' if self.forward_only else 'no'}",
        ]
        lines += [f"rank {r}: " + " ".join(map(str, row)) for r, row in enumerate(self.actions)]
        return "\n".join(line.rstrip() for line in lines) + "\n"

    @classmethod
    def from_text(cls, text: str) -> Schedule:
        """Read a schedule written by :meth:`to_text`. Blank lines and ``#`` comments are skipped.

        The result is not validated, so that a broken schedule can be loaded and diagnosed.

        Raises:
            ScheduleFormatError: naming the line that does not parse and what was expected.
        """
        fields: dict[str, str] = {}
        rows: list[tuple[Action, ...]] = []
        body = [
            (n, line.strip())
            for n, line in enumerate(text.splitlines(), 1)
            if line.strip() and not line.lstrip().startswith("#")
        ]
        if not body or body[0][1] != _TEXT_HEADER:
            raise ScheduleFormatError(
                f"not a pipecut schedule: the first line must be {_TEXT_HEADER!r} "
                f"(got {body[0][1] if body else ''!r}); write it with Schedule.to_text()"
            )
        for n, line in body[1:]:
            key, colon, value = line.partition(":")
            key, value = key.strip(), value.strip()
            if not colon:
                raise ScheduleFormatError(f"line {n}: expected 'key: value', got {line!r}")
            if key == f"rank {len(rows)}":
                try:
                    rows.append(tuple(Action.parse(tok) for tok in value.split()))
                except ScheduleFormatError as err:
                    raise ScheduleFormatError(f"line {n}: {err}") from None
            elif key in ("name", "microbatches", "stage_to_rank", "forward_only") and not rows:
                if key in fields:
                    raise ScheduleFormatError(f"line {n}: {key!r} given twice")
                fields[key] = value
            else:
                raise ScheduleFormatError(
                    f"line {n}: unexpected {key!r}; after the header come name, microbatches, "
                    f"stage_to_rank, forward_only, then 'rank 0:' to 'rank p-1:' in order "
                    f"(next expected: 'rank {len(rows)}:')"
                )
        try:
            m = int(fields["microbatches"])
            placement = tuple(int(tok) for tok in fields["stage_to_rank"].split())
        except (KeyError, ValueError):
            raise ScheduleFormatError(
                "the header needs 'microbatches: <int>' and 'stage_to_rank: <int> <int> ...' "
                f"(got {fields})"
            ) from None
        flag = fields.get("forward_only", "no")
        if flag not in ("yes", "no"):
            raise ScheduleFormatError(f"forward_only must be 'yes' or 'no' (got {flag!r})")
        return cls(
            tuple(rows), placement, m, forward_only=flag == "yes", name=fields.get("name", "")
        )


@dataclass(frozen=True)
class Send:
    """Post the output of this rank's action ``{stage}{kind}{mb}`` for stage ``to_stage`` on rank ``peer``.

    ``F`` outputs activations (``to_stage > stage``); ``B`` and ``I`` output the gradients of
    their inputs (``to_stage < stage``). In ``runtime.transport`` terms this is the message
    ``Key(stage, to_stage, 'act' if kind is F else 'grad', mb)``.
    """

    peer: int
    stage: int
    kind: Kind
    mb: int
    to_stage: int

    def __str__(self) -> str:
        return f"send {self.stage}{self.kind.value}{self.mb} to stage {self.to_stage} on rank {self.peer}"


@dataclass(frozen=True)
class Recv:
    """Wait for the output of action ``{stage}{kind}{mb}`` of rank ``peer``, for local stage ``to_stage``."""

    peer: int
    stage: int
    kind: Kind
    mb: int
    to_stage: int

    def __str__(self) -> str:
        return f"recv {self.stage}{self.kind.value}{self.mb} for stage {self.to_stage} from rank {self.peer}"


Op = Action | Send | Recv
"""One entry of a rank's program in :func:`comm_plan`."""


# -- generators -------------------------------------------------------------------------------


def _check_pm(name: str, p: object, m: object) -> None:
    for letter, value, what in (("p", p, "ranks"), ("m", m, "micro-batches")):
        if type(value) is not int or value < 1:
            raise ScheduleError(f"{name}: {letter} ({what}) must be an int >= 1 (got {value!r})")


def gpipe(p: int, m: int) -> Schedule:
    """GPipe: each stage runs all ``m`` forwards, then all ``m`` backwards; stage ``s`` on rank ``s``.

    Holds ``m`` micro-batches of activations on every stage.

    Args:
        p: ranks, one stage each (stage ``s`` on rank ``s``).
        m: micro-batches per step; any ``m >= 1``, fewer than ``p`` included.

    Raises:
        ScheduleError: ``p`` or ``m`` is not an int >= 1.

    Example:
        >>> print(gpipe(2, 2))
        step    0   1   2   3   4   5
        rank 0  0F0 0F1         0B0 0B1
        rank 1      1F0 1F1 1B0 1B1
    """
    _check_pm("gpipe", p, m)
    rows = [
        [Action(s, F, mb) for mb in range(m)] + [Action(s, B, mb) for mb in range(m)]
        for s in range(p)
    ]
    return Schedule(tuple(map(tuple, rows)), tuple(range(p)), m, name="gpipe")


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B: stage ``s`` runs ``min(p - 1 - s, m)`` warm-up forwards, then alternates F and B, then cools down.

    Holds ``min(m, p - s)`` micro-batches of activations on stage ``s``; same bubble as GPipe.

    Args:
        p: ranks, one stage each (stage ``s`` on rank ``s``).
        m: micro-batches per step; any ``m >= 1``, fewer than ``p`` included.

    Raises:
        ScheduleError: ``p`` or ``m`` is not an int >= 1.

    Example:
        >>> print(one_f_one_b(2, 3))
        step    0   1   2   3   4   5   6   7
        rank 0  0F0 0F1     0B0 0F2 0B1     0B2
        rank 1      1F0 1B0 1F1 1B1 1F2 1B2
    """
    _check_pm("1f1b", p, m)
    rows = []
    for s in range(p):
        warmup = min(p - 1 - s, m)
        row = [Action(s, F, mb) for mb in range(warmup)]
        for mb in range(m - warmup):
            row += [Action(s, F, warmup + mb), Action(s, B, mb)]
        row += [Action(s, B, mb) for mb in range(m - warmup, m)]
        rows.append(tuple(row))
    return Schedule(tuple(rows), tuple(range(p)), m, name="1f1b")


def forward_only(p: int, m: int) -> Schedule:
    """Inference: stage ``s`` runs the ``m`` forwards in order; nothing is kept for a backward.

    Args:
        p: ranks, one stage each (stage ``s`` on rank ``s``).
        m: micro-batches per step; any ``m >= 1``, fewer than ``p`` included.

    Raises:
        ScheduleError: ``p`` or ``m`` is not an int >= 1.

    Example:
        >>> print(forward_only(2, 2))
        step    0   1   2
        rank 0  0F0 0F1
        rank 1      1F0 1F1
    """
    _check_pm("forward", p, m)
    rows = tuple(tuple(Action(s, F, mb) for mb in range(m)) for s in range(p))
    return Schedule(rows, tuple(range(p)), m, forward_only=True, name="forward")


_GENERATORS: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "forward": forward_only,
}


def schedule_names() -> tuple[str, ...]:
    """The names :func:`get_schedule` knows."""
    return tuple(_GENERATORS)


def get_schedule(name: str, p: int, m: int, **kw: Any) -> Schedule:
    """Build a registered schedule by name.

    Args:
        name: one of :func:`schedule_names`: ``'gpipe'``, ``'1f1b'``, ``'forward'`` (any case).
        p: ranks, one stage each.
        m: micro-batches per step.
        **kw: passed to the generator.

    Raises:
        UnknownScheduleError: the name is not registered; the message lists the known ones.
        ScheduleError: ``p`` or ``m`` is not an int >= 1.

    Example:
        >>> get_schedule("1F1B", 4, 8).name
        '1f1b'
    """
    generator = _GENERATORS.get(name.lower())
    if generator is None:
        close = difflib.get_close_matches(name.lower(), _GENERATORS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        known = ", ".join(map(repr, _GENERATORS))
        raise UnknownScheduleError(f"unknown schedule {name!r} (known: {known}){hint}")
    return generator(p, m, **kw)


# -- dependencies and the unit-time simulation ------------------------------------------------


def _deps(a: Action, present: set[Action], num_stages: int) -> tuple[Action, ...]:
    """The actions whose results ``a`` reads, on whichever rank they run."""
    if a.kind is F:
        return (Action(a.stage - 1, F, a.mb),) if a.stage > 0 else ()
    if a.kind is W:
        return (Action(a.stage, I, a.mb),)
    if a.stage >= num_stages - 1:  # the last stage starts the backward from its own loss
        return (Action(a.stage, F, a.mb),)
    grad = Action(a.stage + 1, I, a.mb)
    if grad not in present:
        grad = Action(a.stage + 1, B, a.mb)
    return (Action(a.stage, F, a.mb), grad)


@dataclass(frozen=True)
class _Run:
    steps: tuple[tuple[int, ...], ...]  # steps[r][i]: the step rank r ran its i-th action at
    forced: frozenset[tuple[int, int]]  # (r, i) run although an input was not ready
    stuck_step: int | None  # the first step at which no rank could run its next action


def _simulate(schedule: Schedule) -> _Run:
    """Unit-time run: each step, every rank whose next action has its inputs runs it.

    Tolerates any lists: when no rank can progress, all ranks' next actions run anyway (and are
    recorded as forced), so a broken schedule still draws as a full grid.
    """
    acts = schedule.actions
    present = {a for row in acts for a in row}
    deps = {a: _deps(a, present, schedule.num_stages) for a in present}
    done: set[Action] = set()
    pos = [0] * len(acts)
    steps: list[list[int]] = [[] for _ in acts]
    forced: set[tuple[int, int]] = set()
    stuck_step = None
    t = 0
    while live := [r for r in range(len(acts)) if pos[r] < len(acts[r])]:
        ready = [r for r in live if all(d in done for d in deps[acts[r][pos[r]]])]
        if not ready:
            ready = live
            forced.update((r, pos[r]) for r in live)
            stuck_step = t if stuck_step is None else stuck_step
        for r in ready:
            steps[r].append(t)
        done.update(acts[r][pos[r]] for r in ready)
        for r in ready:
            pos[r] += 1
        t += 1
    return _Run(tuple(map(tuple, steps)), frozenset(forced), stuck_step)


def _grid(
    schedule: Schedule,
    run: _Run,
    marks: frozenset[tuple[int, int]] | set[tuple[int, int]] = frozenset(),
    notes: dict[int, str] | None = None,
) -> str:
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


def format_grid(schedule: Schedule) -> str:
    """Draw the schedule as a rank x step table: rows are ranks, columns steps of unit time.

    Every action takes one step and runs as soon as its rank reaches it and its inputs are done
    (communication is free), like torchgpipe's clock cycles; empty cells are bubbles. If the lists
    deadlock, the stuck actions are drawn in ``[brackets]`` and run anyway to draw the rest.

    Example:
        >>> print(format_grid(get_schedule("1f1b", 3, 3)))
        step    0   1   2   3   4   5   6   7   8   9
        rank 0  0F0 0F1 0F2         0B0     0B1     0B2
        rank 1      1F0 1F1     1B0 1F2 1B1     1B2
        rank 2          2F0 2B0 2F1 2B1 2F2 2B2
    """
    run = _simulate(schedule)
    return _grid(schedule, run, run.forced)


# -- validation -------------------------------------------------------------------------------


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
            (see :func:`format_grid`) where the offending cells are in ``[brackets]``.

    Example:
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
    run = _simulate(schedule)
    p, S, m = schedule.num_ranks, schedule.num_stages, schedule.num_microbatches
    counts = ", ".join(
        f"{k} {word if k == 1 else words}"
        for k, word, words in (
            (p, "rank", "ranks"),
            (S, "stage", "stages"),
            (m, "micro-batch", "micro-batches"),
        )
    )
    title = f"schedule {schedule.name!r} ({counts})"

    def fail(
        what: str,
        fix: str,
        *,
        cell: tuple[int, int] | None = None,
        note: tuple[int, str] | None = None,
    ) -> NoReturn:
        marks = {cell} if cell else set()
        grid = _grid(schedule, run, marks, dict([note]) if note else None)
        rank, action, step = None, None, None
        if cell:
            rank, action, step = (
                cell[0],
                schedule.actions[cell[0]][cell[1]],
                run.steps[cell[0]][cell[1]],
            )
        raise ScheduleError(
            f"{title}: {what}\n\n{grid}\n\n{fix}", rank=rank, step=step, action=action
        )

    # The placement.
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

    # Each action on its own.
    seen: dict[Action, int] = {}
    for r, row in enumerate(schedule.actions):
        for i, a in enumerate(row):
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
            if a in seen:
                fail(
                    f"{where} a second time (first at position {seen[a]}); each action runs exactly once.",
                    f"Remove one of the two {a}.",
                    cell=(r, i),
                )
            seen[a] = i

    # Completeness: F, then B or I and W, for every stage and micro-batch.
    for s in range(S):
        r = schedule.stage_to_rank[s]
        for mb in range(m):
            has = {k for k in Kind if Action(s, k, mb) in seen}
            cell = next(((r, seen[Action(s, k, mb)]) for k in (I, W, B) if k in has), None)
            if F not in has:
                fail(
                    f"never runs {s}F{mb} (stage {s}, micro-batch {mb}).",
                    f"Add {s}F{mb} to rank {r}'s list.",
                    note=(r, f"missing {s}F{mb}"),
                )
            if schedule.forward_only:
                continue
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

    # Deadlock: at the first step where no rank can run, say what each one waits for.
    if run.stuck_step is not None:
        t = run.stuck_step
        acts = schedule.actions
        done = {a for r, row in enumerate(acts) for a, u in zip(row, run.steps[r]) if u < t}
        heads = {r: i for r, i in run.forced if run.steps[r][i] == t}
        present = set(seen)
        reasons = []
        for r, i in sorted(heads.items()):
            a = acts[r][i]
            for d in _deps(a, present, S):
                if d in done:
                    continue
                q = schedule.stage_to_rank[d.stage]
                j = acts[q].index(d)
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
        grid = _grid(schedule, run, run.forced)
        raise ScheduleError(
            f"{title}: deadlocks at step {t}: no rank can run its next action.\n"
            + "\n".join(reasons)
            + f"\n\n{grid}\n\nCells in [brackets] wait for an input that is never ready; the grid runs "
            "them anyway to draw the rest. Reorder the lists so that every action's inputs come first "
            "(an F after the previous stage's F, a B or I after the next stage's backward), e.g. start "
            "from get_schedule('1f1b', p, m).",
            rank=min(heads),
            step=t,
            action=acts[min(heads)][heads[min(heads)]],
        )


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


# -- communication ----------------------------------------------------------------------------


def comm_plan(
    schedule: Schedule, *, edges: Iterable[tuple[int, int]] | None = None
) -> tuple[tuple[Op, ...], ...]:
    """Each rank's program: its actions with the sends and receives they imply, in running order.

    Activations flow along ``edges``, pairs ``(a, b)`` of stages with ``a < b`` where ``b`` reads
    an output of ``a``: the chain ``(s, s + 1)`` by default; a plan whose skip connections cross
    several stages at once adds those pairs. ``F`` of ``a`` sends to every ``b``; ``B`` or ``I`` of
    ``b`` sends input gradients back to every ``a``; ``W`` and the last stage's ``F`` send nothing.
    Stages on the same rank hand over locally (no op). Sends directly follow the action that
    produces them, in ascending ``to_stage``; the receives an action needs directly precede it, in
    ascending stage of the producer.

    The model under which a program cannot deadlock: sends are posted without waiting for the
    peer (buffered, e.g. ``isend`` waited at the end of the step) and receives block. Then a rank
    only ever waits for an input, exactly as :func:`validate` simulates, so a valid schedule
    cannot deadlock (its chain dependencies imply those of any forward ``edges``). Messages need no
    tags: between two ranks in one direction the k-th ``Recv`` matches the k-th ``Send``, as
    torch.distributed P2P pairs them. To keep that order a rank may receive a message early,
    before an action that does not read it, and hold it until the reader runs; GPipe and 1F1B
    never need that, so for them receiving lazily in action order is the same program.

    Where a send may wait for its receive (NCCL: a send kernel blocks its stream until the peer
    receives), post each run of consecutive ``Send``/``Recv`` between two actions as one
    ``batch_isend_irecv`` and wait for it; GPipe and 1F1B are tested deadlock-free that way.

    Args:
        schedule: a valid schedule.
        edges: the stage pairs activations flow along; default the chain.

    Returns:
        Per rank, its ops: :class:`Action`, :class:`Send`, :class:`Recv`.

    Raises:
        ScheduleError: the schedule is invalid (see :func:`validate`), or an edge does not go
            forward between two of its stages.

    Example:
        >>> for op in comm_plan(get_schedule("1f1b", 2, 2))[0]:
        ...     print(op)
        0F0
        send 0F0 to stage 1 on rank 1
        0F1
        send 0F1 to stage 1 on rank 1
        recv 1B0 for stage 0 from rank 1
        0B0
        recv 1B1 for stage 0 from rank 1
        0B1
    """
    validate(schedule)
    place, S = schedule.stage_to_rank, schedule.num_stages
    flow = sorted(set(edges) if edges is not None else {(s, s + 1) for s in range(S - 1)})
    for a, b in flow:
        if not 0 <= a < b < S:
            raise ScheduleError(
                f"edge {(a, b)} does not go forward between stages 0..{S - 1}; each edge (a, b) "
                "says stage b reads an output of stage a, so a < b"
            )
    readers = {a: [b for x, b in flow if x == a] for a in range(S)}
    feeders = {b: [a for a, y in flow if y == b] for b in range(S)}
    present = {a for row in schedule.actions for a in row}

    def grad_of(stage: int, mb: int) -> Action:  # the action producing stage's input gradients
        return Action(stage, I, mb) if Action(stage, I, mb) in present else Action(stage, B, mb)

    def inputs(x: Action) -> list[Action]:  # remote-or-local actions whose outputs x reads
        if x.kind is F:
            return [Action(a, F, x.mb) for a in feeders[x.stage]]
        return [grad_of(b, x.mb) for b in readers[x.stage]] if x.kind in (B, I) else []

    def outputs(x: Action) -> list[int]:  # the stages x sends its output to
        if x.kind is F:
            return readers[x.stage]
        return feeders[x.stage] if x.kind in (B, I) else []

    # Each (source rank, destination rank) channel carries messages in the order they are sent.
    channel: dict[tuple[int, int], list[tuple[Action, int]]] = {}
    for r, row in enumerate(schedule.actions):
        for x in row:
            for dst in outputs(x):
                if place[dst] != r:
                    channel.setdefault((r, place[dst]), []).append((x, dst))
    plans: list[tuple[Op, ...]] = []
    for r, row in enumerate(schedule.actions):
        ops: list[Op] = []
        taken: dict[int, int] = {}  # per source rank, how many of its messages r has received
        got: set[tuple[Action, int]] = set()
        for x in row:
            for src in inputs(x):
                q = place[src.stage]
                while q != r and (src, x.stage) not in got:  # earlier messages come first
                    k = taken.get(q, 0)
                    y, dst = channel[(q, r)][k]
                    taken[q] = k + 1
                    got.add((y, dst))
                    ops.append(Recv(q, y.stage, y.kind, y.mb, dst))
            ops.append(x)
            ops += [Send(place[d], x.stage, x.kind, x.mb, d) for d in outputs(x) if place[d] != r]
        plans.append(tuple(ops))
    return tuple(plans)
