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
from collections.abc import Container, Sequence
from dataclasses import dataclass
from enum import Enum
from itertools import chain
from typing import Any, Protocol

from partitioner.schedule.errors import ScheduleFormatError

__all__ = ["Action", "ActionLike", "KIND_CODE", "Kind", "Key", "Numbered", "dependencies", "dependency_keys", "number"]


class Kind(str, Enum):
    """What an action computes; the value is its letter in the notation."""

    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"

    def __str__(self) -> str:
        return self.value


F, B, I, W = Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT
# Each kind's number, by letter (F B I W: 0 1 2 3): ``number``'s codes and the simulator's classes.
KIND_CODE = {kind.value: code for code, kind in enumerate(Kind)}

# ASCII digits without leading zeros, so that parse(text) prints back as text.
_ACTION_RE = re.compile(r"(0|[1-9][0-9]*)([FBIW])(0|[1-9][0-9]*)")


Key = tuple[int, str, int]
"""An action as ``(stage, letter, mb)``, e.g. ``(1, 'F', 3)``: what the linear-time passes over a
schedule (``index``, ``validation``, ``comm``) hash instead of :class:`Action` objects."""


class ActionLike(Protocol):
    """What the executor reads from a schedule action (read-only, as ``Action``'s fields are)."""

    @property
    def stage(self) -> int: ...

    @property
    def kind(self) -> Any: ...

    @property
    def mb(self) -> int: ...


@dataclass(frozen=True, slots=True)  # slots: a schedule holds up to MAX_ACTIONS of them
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
        # Schedules hold up to MAX_ACTIONS of these: the common case (a Kind, two ints >= 0)
        # is tested first, before anything that builds strings.
        kind, stage, mb = self.kind, self.stage, self.mb
        if type(kind) is Kind and type(stage) is int and type(mb) is int and stage >= 0 and mb >= 0:
            return
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

    def __hash__(self) -> int:
        # The letter, not the Kind: an Enum hashes through a Python-level method.
        return hash((self.stage, self.kind._value_, self.mb))

    @property
    def key(self) -> Key:
        """``(stage, letter, mb)``: the action as a plain tuple, cheap to hash (see :data:`Key`)."""
        return (self.stage, self.kind._value_, self.mb)

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


def dependency_keys(stage: int, letter: str, mb: int, present: Container[Key], num_stages: int) -> tuple[Key, ...]:
    """:func:`dependencies` on keys: what action ``(stage, letter, mb)`` reads, as keys.

    Example:
        >>> dependency_keys(1, "I", 0, {(2, "I", 0), (2, "W", 0)}, 3)
        ((1, 'F', 0), (2, 'I', 0))
    """
    if letter == "F":
        return ((stage - 1, "F", mb),) if stage > 0 else ()
    if letter == "W":
        return ((stage, "I", mb),)
    if stage >= num_stages - 1:  # the last stage starts the backward from its own loss
        return ((stage, "F", mb),)
    grad = (stage + 1, "I", mb)
    if grad not in present:
        grad = (stage + 1, "B", mb)
    return ((stage, "F", mb), grad)


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
    keys = dependency_keys(*action.key, _AsKeys(present), num_stages)
    return tuple(Action(s, Kind(k), mb) for s, k, mb in keys)


@dataclass(frozen=True)
class _AsKeys:
    """A set of actions seen as a container of their keys (asked once or twice per call)."""

    actions: Container[Action]

    def __contains__(self, key: object) -> bool:
        assert isinstance(key, tuple)  # internal invariant: dependency_keys asks with keys
        return Action(key[0], Kind(key[1]), key[2]) in self.actions


# -- numbered actions: what every action reads, found once ---------------------------------------
#
# The unit-time run (``grid``) and the simulator (``simulate``) ask, action after action, whether
# the results it reads are there. Asked of Action objects with ``dependencies``, each question
# builds new actions and hashes dataclasses; ``number`` answers it once per action, on plain keys,
# and the runs then index lists. One pass over the lists: linear in the actions.


@dataclass(frozen=True)
class Numbered:
    """A schedule's actions as ids ``0..K-1`` (``K`` distinct actions; a repeated one shares its id).

    Attributes:
        ids: ``ids[r][i]``, the id of rank ``r``'s ``i``-th action.
        actions: ``actions[k]``, the action with id ``k``.
        reads: ``reads[k]``, the ids of the results action ``k`` reads, in
            ``actions.dependencies`` order; :attr:`missing` for one that no list holds.
        missing: ``K``: the id of a result no action produces (never done).
    """

    ids: tuple[tuple[int, ...], ...]
    actions: tuple[Action, ...]
    reads: tuple[tuple[int, ...], ...]
    missing: int


def number(actions: Sequence[Sequence[Action]], num_stages: int) -> Numbered:
    """Number the actions of per-rank lists ``actions`` running ``num_stages`` chained stages.

    Example:
        >>> from partitioner.schedule.registry import get_schedule
        >>> n = number(get_schedule("1f1b", 2, 1).actions, 2)
        >>> n.ids, [str(a) for a in n.actions], n.reads
        (((0, 1), (2, 3)), ['0F0', '0B0', '1F0', '1B0'], ((), (0, 3), (0,), (2,)))
    """
    # Comprehensions on int codes, not a loop per action on tuples: this runs on up to
    # MAX_ACTIONS actions. An action's code is (mb * width + stage) * 4 + its kind's number
    # (F B I W: 0 1 2 3), unique for stages below width - 1: its neighbours' codes are sums.
    width = 2 + max((a.stage for row in actions for a in row), default=0)
    rows = [[(a.mb * width + a.stage) * 4 + KIND_CODE[a.kind._value_] for a in row] for row in actions]
    # Code -> action, in first-run order; a repeated action is equal to its first.
    by_code: dict[int, Action] = dict(zip(chain.from_iterable(rows), chain.from_iterable(actions)))
    distinct = list(by_code.values())
    id_of = {code: k for k, code in enumerate(by_code)}
    ids = [tuple(map(id_of.__getitem__, row)) for row in rows]
    missing = len(distinct)
    get, last = id_of.get, num_stages - 1
    reads: list[tuple[int, ...]] = []
    for c, a in by_code.items():  # dependency_keys, on codes
        kind = c & 3
        if kind == 0:  # F reads the previous stage's F
            reads.append((get(c - 4, missing),) if a.stage > 0 else ())
        elif kind == 3:  # W reads its own I
            reads.append((get(c - 1, missing),))
        elif a.stage >= last:  # B or I on the last stage reads its own F
            reads.append((get(c - kind, missing),))
        else:  # B or I reads its own F, then the next stage's I, else its B
            grad = get(c - kind + 6)
            reads.append((get(c - kind, missing), get(c - kind + 5, missing) if grad is None else grad))
    return Numbered(tuple(ids), tuple(distinct), tuple(reads), missing)
