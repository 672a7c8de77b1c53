"""pipecut's partitioner: trace a model, cost its graph, cut it into pipeline stages, and show the plan."""

from __future__ import annotations

from partitioner.api import METHODS, partition
from partitioner.cost.devices import DEVICE_PRESETS, Cluster, DeviceSpec
from partitioner.errors import (
    InfeasibleMemoryError,
    InputError,
    InputShapeError,
    PartitionError,
    PipecutError,
    PlanFormatError,
    PlanMismatchError,
    PlannerKeywordError,
    SplitPointError,
    TooManyStagesError,
    TraceError,
    UnknownDeviceError,
)
from partitioner.options import Capture, Costing, Cut, Inference, LayoutSpace
from partitioner.plan.layout import Layout
from partitioner.plan.plan import Plan, Prediction, StagePlan
from partitioner.plan.split import StagedModel, StageIO, ValueSpec
from partitioner.search import LayoutSearch, plan_layout
from partitioner.tracing.trace import TracedModel, trace

__all__ = [
    "partition",
    "plan_layout",
    "LayoutSearch",
    "Capture",
    "Costing",
    "Cut",
    "Inference",
    "LayoutSpace",
    "Layout",
    "METHODS",
    "Plan",
    "StagePlan",
    "Prediction",
    "StagedModel",
    "StageIO",
    "ValueSpec",
    "trace",
    "TracedModel",
    "Cluster",
    "DeviceSpec",
    "DEVICE_PRESETS",
    "PipecutError",
    "TraceError",
    "PartitionError",
    "TooManyStagesError",
    "InfeasibleMemoryError",
    "PlanMismatchError",
    "InputError",
    "InputShapeError",
    "PlanFormatError",
    "UnknownDeviceError",
    "SplitPointError",
    "PlannerKeywordError",
]
