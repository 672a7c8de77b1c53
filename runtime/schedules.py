"""Pipeline schedules as data: the action and schedule IR, its text form, and the registry.

Legend: ``p`` ranks, ``m`` micro-batches, ``v`` stages (chunks) per rank, ``S`` stages in all
(``S = p * v``; ``v = 1`` for GPipe and 1F1B), ``s`` a stage index, ``r`` a rank, ``mb`` a
micro-batch index.

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

The rest of the schedule machinery lives beside this module, one idea each:
``generators`` (GPipe, 1F1B, forward-only, interleaved 1F1B), ``zero_bubble`` (ZB-H1, ZB-V),
``validation`` (the unit-time run, the grid, ``validate``, ``peak_inflight``) and ``comm``
(the sends and receives a schedule implies).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

__all__ = [
    "Action",
    "Kind",
    "Schedule",
    "ScheduleError",
    "ScheduleFormatError",
    "UnknownScheduleError",
    "dependencies",
    "get_schedule",
    "schedule_names",
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
        from .validation import (
            format_grid,  # the grid runs the schedule; that lives there
        )

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


def dependencies(action: Action, present: set[Action], num_stages: int) -> tuple[Action, ...]:
    """The actions whose results ``action`` reads, on whichever rank they run (chain of stages).

    ``F`` of ``s`` reads ``F`` of ``s - 1``; ``B`` and ``I`` of ``s`` read their own ``F`` and the
    input gradients of ``s + 1`` (its ``I`` if the schedule has one, else its ``B``); the last
    stage starts its backward from its own loss; ``W`` reads its own ``I``.

    Args:
        action: the action.
        present: every action of the schedule (to tell a split backward from a fused one).
        num_stages: ``S``.

    Example:
        >>> a = Action.parse
        >>> [str(d) for d in dependencies(a("1I0"), {a("2I0"), a("2W0")}, 3)]
        ['1F0', '2I0']
    """
    if action.kind is F:
        return (Action(action.stage - 1, F, action.mb),) if action.stage > 0 else ()
    if action.kind is W:
        return (Action(action.stage, I, action.mb),)
    if action.stage >= num_stages - 1:  # the last stage starts the backward from its own loss
        return (Action(action.stage, F, action.mb),)
    grad = Action(action.stage + 1, I, action.mb)
    if grad not in present:
        grad = Action(action.stage + 1, B, action.mb)
    return (Action(action.stage, F, action.mb), grad)


# -- the registry -----------------------------------------------------------------------------

_ALIASES = {"interleaved-1f1b": "interleaved"}


def _generators() -> dict[str, Callable[..., Schedule]]:
    # Imported here: the generators build Actions and Schedules, so they import this module.
    from .generators import forward_only, gpipe, interleaved, one_f_one_b
    from .zero_bubble import zbh1, zbv

    return {
        "gpipe": gpipe,
        "1f1b": one_f_one_b,
        "forward": forward_only,
        "interleaved": interleaved,
        "zbh1": zbh1,
        "zbv": zbv,
    }


def schedule_names() -> tuple[str, ...]:
    """The names :func:`get_schedule` knows (aliases aside: ``'interleaved-1f1b'``)."""
    return tuple(_generators())


def get_schedule(name: str, p: int, m: int, **kw: Any) -> Schedule:
    """Build a registered schedule by name.

    Args:
        name: one of :func:`schedule_names` (any case): ``'gpipe'``, ``'1f1b'``, ``'forward'``,
            ``'interleaved'`` (alias ``'interleaved-1f1b'``), ``'zbh1'``, ``'zbv'``.
        p: ranks.
        m: micro-batches per step.
        **kw: passed to the generator, e.g. ``v=3`` for ``'interleaved'``.

    Raises:
        UnknownScheduleError: the name is not registered; the message lists the known ones.
        ScheduleError: ``p`` or ``m`` (or a keyword) is out of range for the generator.

    Example:
        >>> get_schedule("1F1B", 4, 8).name
        '1f1b'
        >>> s = get_schedule("interleaved-1f1b", 2, 4, v=2)
        >>> s.name, s.stage_to_rank
        ('interleaved', (0, 1, 0, 1))
    """
    generators = _generators()
    key = _ALIASES.get(name.lower(), name.lower())
    generator = generators.get(key)
    if generator is None:
        names = [*generators, *_ALIASES]
        close = difflib.get_close_matches(name.lower(), names, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        known = ", ".join(map(repr, names))
        raise UnknownScheduleError(f"unknown schedule {name!r} (known: {known}){hint}")
    return generator(p, m, **kw)
