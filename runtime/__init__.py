"""pipecut's runtime: schedules, simulation, and the executor that trains a plan as a pipeline."""

from __future__ import annotations

from partitioner.schedule.actions import Action, Kind
from partitioner.schedule.comm import Op, Recv, Send, comm_plan, needs_early_receives
from partitioner.schedule.errors import (
    ScheduleError,
    ScheduleFormatError,
    SimulationError,
    TimelineError,
    UnknownScheduleError,
)
from partitioner.schedule.generators import forward_only, gpipe, interleaved, one_f_one_b
from partitioner.schedule.grid import format_grid
from partitioner.schedule.ir import Schedule
from partitioner.schedule.registry import get_schedule, schedule_names
from partitioner.schedule.simulate import Link, Simulation, StageCosts, simulate
from partitioner.schedule.timeline import (
    Message,
    Span,
    Timeline,
    from_records,
    save_chrome_trace,
    save_gantt_png,
    to_chrome_trace,
)
from partitioner.schedule.validation import peak_inflight, peak_inflight_per_rank, validate
from partitioner.schedule.zero_bubble import zbh1, zbv
from runtime.errors import LossError, OptionKeywordError, StageError, TrainerOptionError
from runtime.execute.executor import ActionRecord, Executor, RunResult, StageRuntime
from runtime.execute.recompute import RecomputeOptionError
from runtime.execute.saved_memory import SavedBytes
from runtime.generate import GenerateError, Generation, Generator, Sampling
from runtime.metrics import TrainingProgress, step_metrics
from runtime.options import DataParallel, Execution, Init, TensorParallel
from runtime.parallel.data_parallel import GradAverager, PipelineMesh, pipeline_mesh
from runtime.parallel.fsdp import FSDPOptionError
from runtime.parallel.tensor import TensorParallelError
from runtime.state.integrity import ChecksumError, verify_manifest
from runtime.state.materialize import MaterializeError, empty_weights, initialize, materialize
from runtime.state.weight_errors import (
    AmbiguousPrefixError,
    CorruptFileError,
    MissingWeightsError,
    PartialLoadError,
    UnexpectedWeightsError,
    UnsafeFileError,
    WeightDtypeError,
    WeightProblem,
    WeightsDestinationError,
    WeightsError,
    WeightShapeError,
    WeightsSourceError,
)
from runtime.state.weight_export import SaveReport, save_safetensors
from runtime.state.weights import (
    LoadReport,
    PrefixMap,
    TensorInfo,
    Weights,
    checkpoint_index,
    detect_prefix,
    load_weights,
)
from runtime.trainer import MicrobatchError, PipelineTrainer, split_microbatches
from runtime.transport.launch import LaunchError, spawn
from runtime.transport.p2p import (
    DistTransport,
    Key,
    LocalTransport,
    PeerFailed,
    TensorMeta,
    Transport,
    TransportTimeout,
)
from runtime.transport.placement import PlacementError

__all__ = [
    "PipelineTrainer",
    "Generator",
    "Generation",
    "Sampling",
    "GenerateError",
    "Execution",
    "Init",
    "DataParallel",
    "TensorParallel",
    "TensorParallelError",
    "OptionKeywordError",
    "TrainerOptionError",
    "PipelineMesh",
    "pipeline_mesh",
    "GradAverager",
    "TrainingProgress",
    "step_metrics",
    "MicrobatchError",
    "PlacementError",
    "FSDPOptionError",
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
    "UnsafeFileError",
    "CorruptFileError",
    "ChecksumError",
    "verify_manifest",
    "RecomputeOptionError",
    "SavedBytes",
]
