"""The error root of pipecut and the schedule layer's errors, importable without anything else of pipecut.

``PipecutError`` is defined here, at the bottom of the import graph, so that the pure schedule
layer can raise errors of the one root while importing nothing outside itself;
``partitioner.errors`` and ``pipecut.errors`` re-export it with every other error.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "PipecutError",
    "MissingDependencyError",
    "ScheduleError",
    "ScheduleFormatError",
    "ScheduleSizeError",
    "UnknownScheduleError",
    "SimulationError",
    "TimelineError",
]


class PipecutError(Exception):
    """Base class of every error pipecut raises on purpose."""


class MissingDependencyError(PipecutError, ImportError):
    """An optional dependency a feature needs is not installed; the message says what to install."""


class ScheduleError(PipecutError, ValueError):
    """A schedule is invalid: an action misplaced, missing or repeated, or lists that deadlock.

    Attributes:
        rank: the rank where the problem shows, if one does.
        step: the step of the unit-time simulation where it shows, if one does.
        action: the offending action (an ``Action``), if one is.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        step: int | None = None,
        action: Any = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.step = step
        self.action = action


class ScheduleFormatError(ScheduleError):
    """An action or a schedule's text form cannot be parsed."""


class ScheduleSizeError(ScheduleError):
    """A schedule would hold more actions than ``partitioner.schedule.generators.MAX_ACTIONS``.

    Raised before anything is built, so that a huge micro-batch count is refused at once
    instead of running for minutes; the message gives the largest count that fits.
    """


class UnknownScheduleError(ScheduleError):
    """A schedule name is not in the registry (see ``partitioner.schedule.registry.schedule_names``)."""


class SimulationError(PipecutError, ValueError):
    """The costs or links do not fit the schedule, or hold values that are not times or sizes."""


class TimelineError(PipecutError, ValueError):
    """A span, message or record is inconsistent (negative duration, rank out of range, ...)."""
