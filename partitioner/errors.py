"""Typed errors of pipecut: each carries the offending values and says how to fix the problem.

Every error pipecut raises on purpose derives from :class:`PipecutError` and from the builtin a
caller would expect (``ValueError`` for a bad argument, ``TypeError`` for a wrong call, ...), so
``except PipecutError`` catches them all and ``except ValueError`` keeps working.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

# The root is defined at the bottom of the import graph, in the pure schedule layer.
from partitioner.schedule.errors import MissingDependencyError as MissingDependencyError
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
    "PlanFieldError",
    "UnknownDeviceError",
    "SplitPointError",
    "ReentrantCheckpointError",
    "AmbiguousSplitPointError",
    "PartitionOptionError",
    "PlannerKeywordError",
    "TraceOptionError",
    "TraceInputError",
    "ModeRegionError",
    "ClusterError",
    "ClusterFormatError",
    "CalibrationError",
    "CostOptionError",
    "AlgorithmInputError",
    "StageIndexError",
    "InputCountError",
    "MissingPredictionError",
    "MissingArgumentError",
    "MissingDependencyError",
    "ModelSpecError",
    "ModelFileNotFoundError",
    "ModelImportError",
    "ModelFactoryNotFoundError",
    "ModelFactoryError",
    "CliArgumentError",
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

    ``message`` replaces the text made of the stages' numbers, for a refusal that is not about one
    cut (the layout search's: ``partitioner.plan.capacity.refused``).
    """

    def __init__(
        self, needed: list[float], available: list[float], detail: str = "", *, message: str | None = None
    ) -> None:
        self.needed = list(needed)
        self.available = list(available)
        if message is not None:
            super().__init__(message)
            return
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


class PlanFieldError(PlanFormatError):
    """One field of a plan file is not what ``Plan.save`` writes: a wrong type (``true`` or ``4.5``
    for an integer), ``NaN``, a negative size or time, an unknown schedule, a key the format lacks.

    Attributes:
        field: the field's path in the file, e.g. ``'stages[1].memory'``.
        value: the value found there.
        allowed: what the field takes, in words (for a key the format lacks, the keys it has).
    """

    def __init__(self, where: str, field: str, value: object, allowed: str, *, unknown: bool = False) -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        problem = f"is not a field of this format ({allowed})" if unknown else f"is {shown}, expected {allowed}"
        super().__init__(
            f"{where}: field {field} {problem}. The file is corrupt or was edited by hand; re-create it "
            "with plan.save(...) or `pipecut plan ... --json`."
        )


class UnknownDeviceError(PipecutError, ValueError):
    """A device preset name is not known."""


class SplitPointError(PartitionError):
    """A manual split point does not name a module of the traced graph, or splits are out of order."""


class ReentrantCheckpointError(PipecutError, ValueError):
    """The model calls ``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)``: its region
    runs under ``no_grad`` inside an ``autograd.Function``, which neither tracer captures with its
    gradients (fx refuses the grad-mode region; torch.export keeps it as a no-grad region)."""

    def __init__(self, modules: Sequence[str]) -> None:
        self.modules = tuple(modules)
        shown = ", ".join(self.modules[:4]) + (f" and {len(self.modules) - 4} more" if len(self.modules) > 4 else "")
        super().__init__(
            f"the model checkpoints {shown} with torch.utils.checkpoint(use_reentrant=True), which cannot be "
            "traced with its gradients: pass use_reentrant=False (pipecut then recomputes the stages holding "
            "them), or drop the checkpoint and ask pipecut for recompute=True (`--recompute on`)"
        )


class AmbiguousSplitPointError(SplitPointError):
    """A split point is the dot-boundary suffix of more than one module name (``h.4`` of both
    ``encoder.h.4`` and ``decoder.h.4``); ``candidates`` are the full names it matches."""

    def __init__(self, name: str, candidates: Sequence[str]) -> None:
        self.name = name
        self.candidates = tuple(candidates)
        super().__init__(
            f"split point {name!r} is the end of {len(self.candidates)} module names: "
            f"{', '.join(self.candidates)}; give enough of the name to pick one (e.g. {self.candidates[0]!r})"
        )


class PartitionOptionError(PipecutError, ValueError):
    """An argument of ``partition()`` (or of the planning helpers it calls) has a value it does not
    take: an unknown method, schedule, granularity, precision or recompute option, a stage count
    that is not positive or not a multiple of the schedule's stages per device, or a cluster with
    fewer devices than the stages need."""


class PlannerKeywordError(PipecutError, TypeError):
    """``partition``, ``plan_layout`` or ``LayoutSearch`` got a keyword that is neither its parameter nor
    an old keyword of an option object it takes (``partitioner.options.SHORTCUTS``); the message
    suggests the closest name."""


class TraceOptionError(PipecutError, ValueError):
    """An argument of ``trace()`` has a value it does not take (the method, the number of
    micro-batches in the example)."""


class TraceInputError(PipecutError, TypeError):
    """A tracer cannot take the model's inputs as given: ``forward`` takes ``*args``/``**kwargs``,
    an argument nests tensors, or the graph still reads a non-tensor argument it specialised.
    ``trace()`` reports it, with the other tracers' errors, in a :class:`TraceError`."""


class ModeRegionError(PipecutError, RuntimeError):
    """torch.fx met a ``torch.no_grad()`` or ``torch.autocast`` region inside ``forward``, which it
    would silently drop; ``trace(method='auto')`` then takes torch.export, which keeps it."""


class ClusterError(PipecutError, ValueError):
    """A ``Cluster`` is inconsistent (no devices, a link count that does not match the devices, a
    bandwidth that is not positive) or is asked for more devices than it has."""


class ClusterFormatError(ClusterError):
    """A saved cluster file (``Cluster.save``, ``pipecut calibrate --out``) is not JSON, is not a
    cluster file, is of an unknown format version, or holds fields a ``Cluster`` does not take."""


class CalibrationError(PipecutError, RuntimeError):
    """Measuring this host (``Cluster.measure``) failed: a measuring process raised or did not
    finish in time, or the timings cannot be fitted to a positive speed."""


class CostOptionError(PipecutError, ValueError):
    """An argument of the cost model has a value it does not take (profiling repeats, warm-up)."""


class AlgorithmInputError(PipecutError, ValueError):
    """A partitioning algorithm was given inconsistent input: a ``Problem`` whose tables disagree
    in length, cut positions out of range, or an option out of range."""


class StageIndexError(PipecutError, IndexError):
    """A stage index is outside ``-p..p-1`` for a model cut into ``p`` stages."""


class InputCountError(InputError, TypeError):
    """A staged model was called with another number of inputs than the traced model takes."""


class MissingPredictionError(PipecutError, KeyError):
    """A plan holds no prediction for the schedule asked about."""


class MissingArgumentError(PipecutError, TypeError):
    """A call lacks an argument that another one it was given needs."""


class ModelSpecError(PipecutError, ValueError):
    """A model spec (``--model``) is neither a built-in model name nor ``path/to/file.py:factory``."""


class ModelFileNotFoundError(PipecutError, FileNotFoundError):
    """The file a model spec names does not exist."""


class ModelImportError(PipecutError, ImportError):
    """The file a model spec names cannot be imported as a Python module."""


class ModelFactoryNotFoundError(PipecutError, AttributeError):
    """The file a model spec names has no callable of the factory's name."""


class ModelFactoryError(PipecutError, TypeError):
    """A model factory returned something other than ``(model, example_inputs)``."""


class CliArgumentError(PipecutError, argparse.ArgumentTypeError):
    """A command-line value cannot be converted; argparse reports it as a usage error."""


def _gib(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.2f} GiB"
