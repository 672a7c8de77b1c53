"""pipecut's runtime: schedules, simulation, and the executor that trains a plan as a pipeline."""

from __future__ import annotations

from .schedules import (
    Action,
    Kind,
    Op,
    Recv,
    Schedule,
    ScheduleError,
    ScheduleFormatError,
    Send,
    UnknownScheduleError,
    comm_plan,
    format_grid,
    forward_only,
    get_schedule,
    gpipe,
    one_f_one_b,
    peak_inflight,
    schedule_names,
    validate,
)

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
