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

from partitioner.errors import AlgorithmInputError as AlgorithmInputError
from partitioner.errors import AmbiguousSplitPointError as AmbiguousSplitPointError
from partitioner.errors import CalibrationError as CalibrationError
from partitioner.errors import CliArgumentError as CliArgumentError
from partitioner.errors import ClusterError as ClusterError
from partitioner.errors import ClusterFormatError as ClusterFormatError
from partitioner.errors import CostOptionError as CostOptionError
from partitioner.errors import InfeasibleMemoryError as InfeasibleMemoryError
from partitioner.errors import InputCountError as InputCountError
from partitioner.errors import InputError as InputError
from partitioner.errors import InputShapeError as InputShapeError
from partitioner.errors import MissingArgumentError as MissingArgumentError
from partitioner.errors import MissingDependencyError as MissingDependencyError
from partitioner.errors import MissingPredictionError as MissingPredictionError
from partitioner.errors import ModelFactoryError as ModelFactoryError
from partitioner.errors import ModelFactoryNotFoundError as ModelFactoryNotFoundError
from partitioner.errors import ModelFileNotFoundError as ModelFileNotFoundError
from partitioner.errors import ModelImportError as ModelImportError
from partitioner.errors import ModelSpecError as ModelSpecError
from partitioner.errors import ModeRegionError as ModeRegionError
from partitioner.errors import PartitionError as PartitionError
from partitioner.errors import PartitionOptionError as PartitionOptionError
from partitioner.errors import PipecutError as PipecutError
from partitioner.errors import PlanFieldError as PlanFieldError
from partitioner.errors import PlanFormatError as PlanFormatError
from partitioner.errors import PlanMismatchError as PlanMismatchError
from partitioner.errors import PlannerKeywordError as PlannerKeywordError
from partitioner.errors import ReentrantCheckpointError as ReentrantCheckpointError
from partitioner.errors import SplitPointError as SplitPointError
from partitioner.errors import StageIndexError as StageIndexError
from partitioner.errors import TooManyStagesError as TooManyStagesError
from partitioner.errors import TraceError as TraceError
from partitioner.errors import TraceInputError as TraceInputError
from partitioner.errors import TraceOptionError as TraceOptionError
from partitioner.errors import UnknownDeviceError as UnknownDeviceError
from partitioner.schedule.errors import ScheduleError as ScheduleError
from partitioner.schedule.errors import ScheduleFormatError as ScheduleFormatError
from partitioner.schedule.errors import ScheduleSizeError as ScheduleSizeError
from partitioner.schedule.errors import SimulationError as SimulationError
from partitioner.schedule.errors import TimelineError as TimelineError
from partitioner.schedule.errors import UnknownScheduleError as UnknownScheduleError
from pipecut.folder import FolderError as FolderError
from pipecut.folder import RemoteCodeError as RemoteCodeError
from pipecut.folder import UnsupportedModelError as UnsupportedModelError
from pipecut.generate.folder_generator import NoTokenizerError as NoTokenizerError
from pipecut.generate.job import GenerateJobError as GenerateJobError
from pipecut.generate.prompts import PromptsError as PromptsError
from pipecut.train.config import TrainConfigError as TrainConfigError
from pipecut.train.data import DataError as DataError
from pipecut.train.finite import NonFiniteLossError as NonFiniteLossError
from pipecut.train.layout_choice import PlanModelError as PlanModelError
from pipecut.train.layout_choice import PlanWorldError as PlanWorldError
from pipecut.train.layout_choice import TrainPlanError as TrainPlanError
from pipecut.train.metrics_log import MetricsFileError as MetricsFileError
from pipecut.train.runfolder import DiskFullError as DiskFullError
from pipecut.train.runfolder import RunFolderError as RunFolderError
from pipecut.train.runfolder import RunLockedError as RunLockedError
from runtime.errors import ActionError as ActionError
from runtime.errors import InconsistentScheduleError as InconsistentScheduleError
from runtime.errors import LossError as LossError
from runtime.errors import MissingInputError as MissingInputError
from runtime.errors import OptionKeywordError as OptionKeywordError
from runtime.errors import ProcessGroupError as ProcessGroupError
from runtime.errors import RankDisagreementError as RankDisagreementError
from runtime.errors import StageError as StageError
from runtime.errors import TrainerOptionError as TrainerOptionError
from runtime.errors import TrainerStateError as TrainerStateError
from runtime.errors import TransportOptionError as TransportOptionError
from runtime.execute.microbatch import MicrobatchError as MicrobatchError
from runtime.execute.recompute import RecomputeOptionError as RecomputeOptionError
from runtime.generate.errors import CutInsideBlockError as CutInsideBlockError
from runtime.generate.errors import GenerateError as GenerateError
from runtime.generate.errors import GenerateFamilyError as GenerateFamilyError
from runtime.generate.errors import GenerateModelError as GenerateModelError
from runtime.generate.errors import GenerateOptionError as GenerateOptionError
from runtime.generate.errors import SelfCheckError as SelfCheckError
from runtime.parallel.fsdp import FSDPOptionError as FSDPOptionError
from runtime.parallel.tensor import TensorParallelError as TensorParallelError
from runtime.parallel.tensor_stages import TensorParallelOptionError as TensorParallelOptionError
from runtime.parallel.vocab import VocabLossError as VocabLossError
from runtime.parallel.vocab import VocabParallelError as VocabParallelError
from runtime.precision import AutocastConflictError as AutocastConflictError
from runtime.precision import PrecisionError as PrecisionError
from runtime.state.checkpoint import CheckpointDtypeError as CheckpointDtypeError
from runtime.state.checkpoint import CheckpointError as CheckpointError
from runtime.state.checkpoint import CheckpointMismatchError as CheckpointMismatchError
from runtime.state.checkpoint import CheckpointShapeError as CheckpointShapeError
from runtime.state.integrity import ChecksumError as ChecksumError
from runtime.state.materialize import MaterializeError as MaterializeError
from runtime.state.weight_errors import AmbiguousPrefixError as AmbiguousPrefixError
from runtime.state.weight_errors import CorruptFileError as CorruptFileError
from runtime.state.weight_errors import MissingWeightsError as MissingWeightsError
from runtime.state.weight_errors import NonFiniteWeightsError as NonFiniteWeightsError
from runtime.state.weight_errors import PartialLoadError as PartialLoadError
from runtime.state.weight_errors import UnexpectedWeightsError as UnexpectedWeightsError
from runtime.state.weight_errors import UnsafeFileError as UnsafeFileError
from runtime.state.weight_errors import WeightDtypeError as WeightDtypeError
from runtime.state.weight_errors import WeightsDestinationError as WeightsDestinationError
from runtime.state.weight_errors import WeightsError as WeightsError
from runtime.state.weight_errors import WeightShapeError as WeightShapeError
from runtime.state.weight_errors import WeightsSourceError as WeightsSourceError
from runtime.transport.launch import LaunchError as LaunchError
from runtime.transport.launch import StartMethodError as StartMethodError
from runtime.transport.p2p import PeerFailed as PeerFailed
from runtime.transport.p2p import PeerGone as PeerGone
from runtime.transport.p2p import TransportTimeout as TransportTimeout
from runtime.transport.placement import PlacementError as PlacementError

# Every error class imported above (each ``X as X``, so type checkers see it re-exported).
__all__ = [name for name, obj in list(globals().items()) if isinstance(obj, type) and issubclass(obj, PipecutError)]
