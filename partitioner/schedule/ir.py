"""The schedule IR: per-rank action lists plus the stage placement, and its lossless text form.

Legend: ``p`` ranks, ``m`` micro-batches, ``v`` stages (chunks) per rank, ``S`` stages in all
(``S = p * v``; ``v = 1`` for GPipe and 1F1B), ``s`` a stage index, ``r`` a rank, ``mb`` a
micro-batch index. Actions and their notation (``1F3``) are in ``actions``.

A schedule is one action list per rank plus ``stage_to_rank``, so any placement fits the same IR:
``(0, 1, ..., p - 1)`` for GPipe and 1F1B, ``s % p`` for interleaved stages, and
``(0, ..., p - 1, p - 1, ..., 0)`` for V-shaped (ZB-V: rank ``r`` holds ``r`` and ``2p - 1 - r``).

The rest of the schedule layer lives beside this module, one idea each: ``registry`` (the one
table of schedules), ``generators`` (GPipe, 1F1B, forward-only, interleaved 1F1B),
``zero_bubble`` (ZB-H1, ZB-V), ``grid`` (the unit-time run and its picture), ``validation``
(``validate``, ``peak_inflight``), ``comm`` (the sends and receives a schedule implies),
``simulate`` and ``timeline``.
"""

from __future__ import annotations

from dataclasses import dataclass

from partitioner.schedule.actions import Action
from partitioner.schedule.errors import ScheduleFormatError
from partitioner.schedule.grid import format_grid

__all__ = ["Schedule"]

_TEXT_HEADER = "pipecut schedule v1"


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
        >>> from partitioner.schedule.registry import get_schedule
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
            >>> from partitioner.schedule.registry import get_schedule
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
