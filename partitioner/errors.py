"""Typed errors of pipecut: each carries the offending values and says how to fix the problem."""

from __future__ import annotations

# The root is defined at the bottom of the import graph, in the pure schedule layer.
from partitioner.schedule.errors import PipecutError as PipecutError

__all__ = [
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
]


class TraceError(PipecutError, RuntimeError):
    """Neither torch.fx nor torch.export could capture the model as a graph."""


class PartitionError(PipecutError, ValueError):
    """The graph cannot be cut as asked."""


class TooManyStagesError(PartitionError):
    """More stages were asked for than there are units (nodes or modules) to place in them."""

    def __init__(self, num_stages: int, num_units: int, granularity: str = "node") -> None:
        self.num_stages = num_stages
        self.num_units = num_units
        hint = (
            " or use granularity='node' to cut inside modules" if granularity == "module" else ""
        )
        super().__init__(
            f"cannot cut {num_units} {granularity} units into {num_stages} non-empty stages "
            f"(stages: {num_stages}, units: {num_units}); ask for at most {num_units} stages{hint}"
        )


class InfeasibleMemoryError(PartitionError):
    """No partition fits every stage into its device's memory.

    Attributes:
        needed: per stage, the least memory (bytes) the best attempt needed.
        available: per stage, the device capacity (bytes).
    """

    def __init__(self, needed: list[float], available: list[float], detail: str = "") -> None:
        self.needed = list(needed)
        self.available = list(available)
        rows = ", ".join(
            f"stage {s}: needs {_gib(n)} of {_gib(a)}" for s, (n, a) in enumerate(zip(needed, available))
        )
        extra = f" {detail}" if detail else ""
        super().__init__(
            f"no partition into {len(available)} stages fits device memory ({rows}).{extra} "
            "Use more stages or devices, devices with more memory, fewer micro-batches in flight "
            "(schedule='1f1b' holds fewer than 'gpipe'), or a smaller optimizer state "
            "(state_bytes_per_param)."
        )


class PlanMismatchError(PipecutError, ValueError):
    """A saved plan was made for a different graph than the one it is applied to."""


class InputError(PipecutError, ValueError):
    """A training batch does not match the plan: the number of inputs, a dtype, a shape, or the
    targets' rows. Raised before the step starts, naming the input, what the plan expects, what
    came, and the fix."""


class InputShapeError(InputError, PlanMismatchError):
    """An input's size differs from the traced one in a dimension the traced graph keeps fixed
    (or, for a graph from torch.fx, in a way its ops cannot run)."""


class PlanFormatError(PipecutError, ValueError):
    """A plan file is corrupt, hand-edited inconsistently, or of an unknown format version."""


class UnknownDeviceError(PipecutError, ValueError):
    """A device preset name is not known."""


class SplitPointError(PartitionError):
    """A manual split point does not name a module of the traced graph, or splits are out of order."""


def _gib(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.2f} GiB"
