"""Actions: one unit of pipeline work (stage, kind, micro-batch), its notation, and what it reads.

Notation: an action prints as ``<stage><kind><mb>``; ``1F3`` is stage 1's forward of
micro-batch 3. The kinds are torch.distributed.pipelining's letters:

* ``F`` forward;
* ``B`` full backward: input and weight gradients in one pass;
* ``I`` backward for inputs only (the gradient for the previous stage, sent early);
* ``W`` backward for weights only, after the ``I`` of the same stage and micro-batch.

Every (stage, micro-batch) runs ``F``, then either ``B`` or ``I`` and ``W`` (split backward).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from partitioner.schedule.errors import ScheduleFormatError

__all__ = ["Action", "Kind", "dependencies"]


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
