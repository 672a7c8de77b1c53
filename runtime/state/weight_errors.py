"""Errors of loading and exporting weights and checkpoints: which key, stage and file, what was expected, the fix.

A *name* is the model's fully qualified name of a tensor (``model.state_dict()``'s key), a *key*
the checkpoint's name for it; ``s`` is a stage. Every refusal before any data is copied is a
:class:`WeightsError` (a ``ValueError``); one during the copy is a :class:`PartialLoadError`
saying which destinations already hold new values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from partitioner.errors import PipecutError

__all__ = [
    "AmbiguousPrefixError",
    "CheckpointDtypeError",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointShapeError",
    "CorruptFileError",
    "MissingWeightsError",
    "NonFiniteWeightsError",
    "PartialLoadError",
    "UnexpectedWeightsError",
    "UnsafeFileError",
    "WeightDtypeError",
    "WeightProblem",
    "WeightShapeError",
    "WeightsDestinationError",
    "WeightsError",
    "WeightsSourceError",
]

# How many offending keys a message lists; the error's ``problems`` holds them all.
_SHOWN = 8


@dataclass(frozen=True)
class WeightProblem:
    """One offending tensor.

    Attributes:
        name: the model's name (``None`` for a checkpoint key no model name maps to).
        key: the checkpoint key looked up or found.
        stage: the stage holding ``name``, when the caller said.
        file: the checkpoint file holding ``key`` (``None`` for a missing key).
        expected: what the model has (``shape (64, 32)``), ``''`` when not applicable.
        found: what the checkpoint has, ``''`` when not applicable.
        close: checkpoint keys close to a missing ``key`` (difflib).
    """

    name: str | None
    key: str
    stage: int | None = None
    file: str | None = None
    expected: str = ""
    found: str = ""
    close: tuple[str, ...] = ()

    def __str__(self) -> str:
        who = f"{self.name!r}" if self.name is not None else f"key {self.key!r}"
        if self.stage is not None:
            who += f" (stage {self.stage})"
        if self.name is not None and self.name != self.key:
            who += f" as key {self.key!r}"
        where = f" in {self.file}" if self.file else ""
        if self.expected or self.found:
            return f"{who}{where}: model has {self.expected}, checkpoint has {self.found}"
        close = f"; close keys: {', '.join(map(repr, self.close))}" if self.close else ""
        return f"{who}{where}{close}"


class WeightsError(PipecutError, ValueError):
    """Weights cannot be loaded or exported as asked; nothing was copied.

    Attributes:
        source: the checkpoint (file or directory) as given.
        problems: every offending tensor, the message lists the first few.
    """

    def __init__(self, message: str, *, source: str = "", problems: Sequence[WeightProblem] = ()) -> None:
        super().__init__(message)
        self.source = source
        self.problems = tuple(problems)

    @property
    def keys(self) -> tuple[str, ...]:
        """The checkpoint keys of :attr:`problems`."""
        return tuple(p.key for p in self.problems)


class MissingWeightsError(WeightsError):
    """A destination's name maps to no key of the checkpoint (under any of its tied names)."""


class UnexpectedWeightsError(WeightsError):
    """A checkpoint key maps to no name of the whole model (refused unless ``strict=False``)."""


class NonFiniteWeightsError(WeightsError):
    """A loaded tensor holds NaN or infinity (and its name is not in ``allow_nonfinite``)."""


class WeightShapeError(WeightsError):
    """A destination's shape differs from the checkpoint tensor's."""


class WeightDtypeError(WeightsError):
    """A destination's dtype differs from the checkpoint tensor's (refused unless ``cast=True``)."""


class AmbiguousPrefixError(WeightsError):
    """Several prefix mappings match the most names; the caller must pick one with ``prefix=``.

    Attributes:
        candidates: ``(mapping, names matched)`` of each tied best mapping.
    """

    def __init__(self, message: str, *, source: str, candidates: Sequence[tuple[object, int]]) -> None:
        super().__init__(message, source=source)
        self.candidates = tuple(candidates)


class WeightsSourceError(WeightsError):
    """The checkpoint cannot be read: no such path, an unknown layout, a corrupt file or index."""


class WeightsDestinationError(WeightsError):
    """A destination cannot take weights: on ``meta``, not a tensor, or not a name of the model."""


class UnsafeFileError(PipecutError, ValueError):
    """A file holds a pickled class or function pipecut does not admit; nothing of it ran.

    Attributes:
        file: the file refused.
        refused: the ``module.name`` of each class or function it would have imported.
    """

    # Defaults, so that the error survives the pickling DCP does to report it to other ranks.
    def __init__(self, message: str = "", *, file: str = "", refused: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.file = file
        self.refused = tuple(refused)


class CorruptFileError(PipecutError, ValueError):
    """A checkpoint file is missing, truncated or damaged.

    Attributes:
        file: the file.
        key: the entry that could not be read (``''`` when the whole file is unreadable).
    """

    def __init__(self, message: str = "", *, file: str = "", key: str = "") -> None:
        super().__init__(message)
        self.file = file
        self.key = key


class CheckpointError(PipecutError, RuntimeError):
    """A checkpoint cannot be written or read as asked (not a checkpoint, missing entries, DCP failed).

    Defined here rather than in ``runtime.state.checkpoint`` (which re-exports it) so that
    ``runtime.state.safe_dcp``, below it, can raise it too.
    """


class CheckpointMismatchError(CheckpointError, ValueError):
    """Tensors of the trainer (or model) differ from the checkpoint's in shape or dtype; nothing was loaded.

    Attributes:
        source: the checkpoint directory.
        problems: every offending tensor (``key`` the checkpoint entry, ``expected`` what the
            trainer holds, ``found`` what the checkpoint holds); the message lists the first few.
    """

    # Defaults, so that the error survives the pickling that hands it between ranks.
    def __init__(self, message: str = "", *, source: str = "", problems: Sequence[WeightProblem] = ()) -> None:
        super().__init__(message)
        self.source = source
        self.problems = tuple(problems)


class CheckpointShapeError(CheckpointMismatchError):
    """A tensor's shape differs from the checkpoint's (another model, or another run's checkpoint)."""


class CheckpointDtypeError(CheckpointMismatchError):
    """A tensor's dtype differs from the checkpoint's (the shapes agree)."""


class PartialLoadError(WeightsError, RuntimeError):
    """Reading failed after some destinations were filled; the original error is ``__cause__``.

    Attributes:
        loaded: names whose destinations hold the checkpoint's values.
        pending: names whose destinations may hold old or partly new values.
    """

    def __init__(self, message: str, *, source: str, loaded: Sequence[str], pending: Sequence[str]) -> None:
        super().__init__(message, source=source)
        self.loaded = tuple(loaded)
        self.pending = tuple(pending)


def listing(problems: Sequence[WeightProblem]) -> str:
    """The first few problems, one per indented line, and how many more there are."""
    lines = [f"  {p}" for p in problems[:_SHOWN]]
    if len(problems) > _SHOWN:
        lines.append(f"  ... and {len(problems) - _SHOWN} more (the error's .problems lists all)")
    return "\n".join(lines)


def names_listing(names: Sequence[str]) -> str:
    """``'a', 'b', ... (+3 more)``: names as one line."""
    shown = ", ".join(map(repr, names[:_SHOWN]))
    return shown + (f", ... (+{len(names) - _SHOWN} more)" if len(names) > _SHOWN else "")
