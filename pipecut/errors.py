"""Every error pipecut raises, in one place: catch ``PipecutError`` for all of them.

Each error also derives from the builtin a caller would expect (``ValueError`` for a bad
argument or plan, ``TypeError`` for a wrong call, ``RuntimeError`` for a failed run, ``KeyError``,
``IndexError``, ``ImportError``, ``FileNotFoundError``), so ``except ValueError`` keeps working.
The classes live with the code that raises them; this module only gathers them.

Example:
    >>> from pipecut.errors import PartitionOptionError, PipecutError
    >>> issubclass(PartitionOptionError, PipecutError) and issubclass(PartitionOptionError, ValueError)
    True
"""

from __future__ import annotations

from partitioner.errors import (
    AlgorithmInputError,
    CliArgumentError,
    ClusterError,
    CostOptionError,
    InfeasibleMemoryError,
    InputCountError,
    InputError,
    InputShapeError,
    MissingArgumentError,
    MissingDependencyError,
    MissingPredictionError,
    ModelFactoryError,
    ModelFactoryNotFoundError,
    ModelFileNotFoundError,
    ModelImportError,
    ModelSpecError,
    ModeRegionError,
    PartitionError,
    PartitionOptionError,
    PipecutError,
    PlanFormatError,
    PlanMismatchError,
    SplitPointError,
    StageIndexError,
    TooManyStagesError,
    TraceError,
    TraceInputError,
    TraceOptionError,
    UnknownDeviceError,
)
from partitioner.schedule.errors import (
    ScheduleError,
    ScheduleFormatError,
    SimulationError,
    TimelineError,
    UnknownScheduleError,
)
from runtime.errors import (
    ActionError,
    InconsistentScheduleError,
    LossError,
    MissingInputError,
    ProcessGroupError,
    StageError,
    TrainerStateError,
    TransportOptionError,
)
from runtime.execute.microbatch import MicrobatchError
from runtime.execute.recompute import RecomputeOptionError
from runtime.precision import PrecisionError
from runtime.state.checkpoint import CheckpointError
from runtime.state.materialize import MaterializeError
from runtime.state.weight_errors import (
    AmbiguousPrefixError,
    MissingWeightsError,
    PartialLoadError,
    UnexpectedWeightsError,
    WeightDtypeError,
    WeightsDestinationError,
    WeightsError,
    WeightShapeError,
    WeightsSourceError,
)
from runtime.transport.launch import LaunchError
from runtime.transport.p2p import PeerFailed, TransportTimeout
from runtime.transport.placement import PlacementError

__all__ = [
    "PipecutError",
    # tracing
    "TraceError",
    "TraceOptionError",
    "TraceInputError",
    "ModeRegionError",
    # partitioning and plans
    "PartitionError",
    "TooManyStagesError",
    "InfeasibleMemoryError",
    "SplitPointError",
    "PartitionOptionError",
    "AlgorithmInputError",
    "CostOptionError",
    "ClusterError",
    "UnknownDeviceError",
    "PlanMismatchError",
    "PlanFormatError",
    "MissingPredictionError",
    "MissingArgumentError",
    "StageIndexError",
    # inputs of a step or a staged model
    "InputError",
    "InputShapeError",
    "InputCountError",
    "MissingInputError",
    "MicrobatchError",
    # models named on the command line, optional dependencies
    "ModelSpecError",
    "ModelFileNotFoundError",
    "ModelImportError",
    "ModelFactoryNotFoundError",
    "ModelFactoryError",
    "MissingDependencyError",
    "CliArgumentError",
    # schedules and their simulation
    "ScheduleError",
    "ScheduleFormatError",
    "UnknownScheduleError",
    "SimulationError",
    "TimelineError",
    # running a pipeline
    "StageError",
    "LossError",
    "ActionError",
    "InconsistentScheduleError",
    "TrainerStateError",
    "PlacementError",
    "PrecisionError",
    "RecomputeOptionError",
    "TransportOptionError",
    "TransportTimeout",
    "PeerFailed",
    "ProcessGroupError",
    "LaunchError",
    "MaterializeError",
    "CheckpointError",
    # weights
    "WeightsError",
    "MissingWeightsError",
    "UnexpectedWeightsError",
    "WeightShapeError",
    "WeightDtypeError",
    "AmbiguousPrefixError",
    "WeightsSourceError",
    "WeightsDestinationError",
    "PartialLoadError",
]
