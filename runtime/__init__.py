"""pipecut's runtime: schedules, simulation, and the executor that trains a plan as a pipeline."""

from __future__ import annotations

from runtime.options import DataParallel, Execution, Init

from .comm import Op, Recv, Send, comm_plan, needs_early_receives
from .data_parallel import GradAverager, PipelineMesh, pipeline_mesh
from .errors import LossError, OptionKeywordError, StageError, TrainerOptionError
from .executor import ActionRecord, Executor, RunResult, StageRuntime
from .generators import forward_only, gpipe, interleaved, one_f_one_b
from .launch import LaunchError, spawn
from .materialize import MaterializeError, empty_weights, initialize, materialize
from .metrics import TrainingProgress, step_metrics
from .placement import PlacementError
from .recompute import RecomputeOptionError
from .saved_memory import SavedBytes
from .schedules import (
    Action,
    Kind,
    Schedule,
    ScheduleError,
    ScheduleFormatError,
    UnknownScheduleError,
    get_schedule,
    schedule_names,
)
from .simulate import Link, Simulation, SimulationError, StageCosts, simulate
from .timeline import (
    Message,
    Span,
    Timeline,
    TimelineError,
    from_records,
    save_chrome_trace,
    save_gantt_png,
    to_chrome_trace,
)
from .trainer import MicrobatchError, PipelineTrainer, split_microbatches
from .transport import (
    DistTransport,
    Key,
    LocalTransport,
    PeerFailed,
    TensorMeta,
    Transport,
    TransportTimeout,
)
from .validation import format_grid, peak_inflight, peak_inflight_per_rank, validate
from .weight_errors import (
    AmbiguousPrefixError,
    MissingWeightsError,
    PartialLoadError,
    UnexpectedWeightsError,
    WeightDtypeError,
    WeightProblem,
    WeightsDestinationError,
    WeightsError,
    WeightShapeError,
    WeightsSourceError,
)
from .weight_export import SaveReport, save_safetensors
from .weights import (
    LoadReport,
    PrefixMap,
    TensorInfo,
    Weights,
    checkpoint_index,
    detect_prefix,
    load_weights,
)
from .zero_bubble import zbh1, zbv

__all__ = [
    "PipelineTrainer",
    "Execution",
    "Init",
    "DataParallel",
    "OptionKeywordError",
    "TrainerOptionError",
    "PipelineMesh",
    "pipeline_mesh",
    "GradAverager",
    "TrainingProgress",
    "step_metrics",
    "MicrobatchError",
    "PlacementError",
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
    "PeerFailed",
    "StageError",
    "LossError",
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
    "needs_early_receives",
    "format_grid",
    "forward_only",
    "get_schedule",
    "gpipe",
    "interleaved",
    "one_f_one_b",
    "peak_inflight",
    "peak_inflight_per_rank",
    "schedule_names",
    "validate",
    "zbh1",
    "zbv",
    "Link",
    "Simulation",
    "SimulationError",
    "StageCosts",
    "simulate",
    "Message",
    "Span",
    "Timeline",
    "TimelineError",
    "from_records",
    "save_chrome_trace",
    "save_gantt_png",
    "to_chrome_trace",
    "load_weights",
    "checkpoint_index",
    "detect_prefix",
    "save_safetensors",
    "LoadReport",
    "Weights",
    "empty_weights",
    "materialize",
    "initialize",
    "MaterializeError",
    "SaveReport",
    "PrefixMap",
    "TensorInfo",
    "WeightsError",
    "WeightProblem",
    "MissingWeightsError",
    "UnexpectedWeightsError",
    "WeightShapeError",
    "WeightDtypeError",
    "AmbiguousPrefixError",
    "WeightsSourceError",
    "WeightsDestinationError",
    "PartialLoadError",
    "RecomputeOptionError",
    "SavedBytes",
]
