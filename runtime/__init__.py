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
from .executor import ActionRecord, Executor, RunResult, StageRuntime
from .launch import LaunchError, spawn
from .trainer import MicrobatchError, PipelineTrainer, split_microbatches
from .transport import DistTransport, Key, LocalTransport, TensorMeta, Transport, TransportTimeout

__all__ = [
    "PipelineTrainer",
    "MicrobatchError",
    "split_microbatches",
    "Executor",
    "StageRuntime",
    "RunResult",
    "ActionRecord",
    "Transport",
    "LocalTransport",
    "DistTransport",
    "Key",
    "TensorMeta",
    "TransportTimeout",
    "spawn",
    "LaunchError",
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
