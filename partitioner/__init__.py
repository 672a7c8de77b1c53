"""pipecut's partitioner: trace a model, cost its graph, cut it into pipeline stages, and show the plan."""

from __future__ import annotations

from .devices import DEVICE_PRESETS, Cluster, DeviceSpec
from .errors import (
    InfeasibleMemoryError,
    PartitionError,
    PipecutError,
    PlanFormatError,
    PlanMismatchError,
    SplitPointError,
    TooManyStagesError,
    TraceError,
    UnknownDeviceError,
)

__all__ = [
    "Cluster",
    "DeviceSpec",
    "DEVICE_PRESETS",
    "PipecutError",
    "TraceError",
    "PartitionError",
    "TooManyStagesError",
    "InfeasibleMemoryError",
    "PlanMismatchError",
    "PlanFormatError",
    "UnknownDeviceError",
    "SplitPointError",
]
