"""Errors of a pipelined step: which rank, stage, action and model node failed, and what to do.

Legend: ``s`` a stage index, ``mb`` a micro-batch index; an action is written ``1F3`` (stage 1,
forward, micro-batch 3), as in schedules.

An exception raised while a stage runs (its forward, backward, input- or weight-gradient, or
the loss) reaches the user as a :class:`StageError` with the original chained as its cause.
The model node it came from is found from the traceback: a stage is an ``fx.GraphModule``
whose generated ``forward`` has one line per node, so the innermost frame in that code names
the node, and the node's trace metadata names its module (``model.layers.3.mlp``) and its
source line. A backward runs in autograd's engine, outside that code, so there the node is
not known; the message says how to find it.

The other errors here name a misuse of the runtime: a trainer asked for what it was not built
for, a schedule that turns out inconsistent while it runs, an option it does not take.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from partitioner.errors import InputError, PipecutError
from partitioner.tracing.trace import node_module_path

__all__ = [
    "StageError", "LossError", "InconsistentScheduleError", "ActionError", "MissingInputError",
    "TrainerStateError", "ProcessGroupError", "RankDisagreementError",
    "TransportOptionError", "OptionKeywordError", "TrainerOptionError",
    "NodeInfo", "failing_node", "describe_value",
]

# What each action kind does, for messages.
PHASES = {"F": "forward", "B": "backward", "I": "input-gradient backward", "W": "weight-gradient backward"}

# Frames of the tracing machinery, not the user's model, in a node's recorded stack.
_TORCH_DIR = str(Path(torch.__file__).resolve().parent)
_TRACERS = tuple(str(Path(__file__).resolve().parents[1] / "partitioner" / "tracing" / f) for f in (
    "fx_trace.py", "export_trace.py", "trace.py", "hops.py"))


@dataclass(frozen=True)
class NodeInfo:
    """The node of the original model an error was raised in.

    Attributes:
        name: the node's name in the stage graph (``linear_3``).
        module: qualified name of the module it was traced in (``model.layers.3.mlp``), ``''``
            for the model's own ``forward``.
        source: ``file:line in function: code`` where the trace recorded it, else ``None``.
    """

    name: str
    module: str
    source: str | None

    def __str__(self) -> str:
        where = f"module {self.module!r}" if self.module else "the model's own forward"
        text = f"{where} (node {self.name!r}"
        return text + (f", {self.source})" if self.source else ")")


class StageError(PipecutError, RuntimeError):
    """An exception raised while a stage ran an action; the original is ``__cause__``.

    Attributes:
        rank: the rank that ran the action.
        stage: the stage (``s``).
        action: the action, as ``1F3``.
        kind: ``'F'``, ``'B'``, ``'I'``, ``'W'``, or ``'loss'``.
        mb: the micro-batch.
        node: the model node that raised it, when known.
    """

    def __init__(
        self, message: str, *, rank: int, stage: int, action: str, kind: str, mb: int, node: NodeInfo | None
    ) -> None:
        super().__init__(message)
        self.rank, self.stage, self.action, self.kind, self.mb, self.node = rank, stage, action, kind, mb, node

    @classmethod
    def wrap(
        cls, error: BaseException, *, rank: int, stage: int, kind: str, mb: int,
        module: nn.Module | None = None, detail: str = "",
    ) -> StageError:
        """The error for ``error`` raised by action ``stage kind mb`` on ``rank``.

        ``module`` (the stage's module) lets the failing node be found from the traceback;
        ``detail`` adds what the caller knows (the loss's arguments, say).
        """
        action = f"{stage}{'F' if kind == 'loss' else kind}{mb}"
        phase = "loss" if kind == "loss" else PHASES.get(kind, kind)
        node = failing_node(error, module) if module is not None and kind in ("F", "loss") else None
        where = f" in {node}" if node is not None else ""
        head = f"rank {rank}, stage {stage}, action {action} ({phase} of micro-batch {mb}) failed{where}"
        text = f"{head}: {type(error).__name__}: {_message(error)}"
        if detail:
            text += f"\n  {detail}"
        if kind in ("B", "I", "W"):
            text += (
                "\n  A backward runs in autograd's engine, so the failing node is not known here: run "
                "the step under torch.autograd.set_detect_anomaly(True) to see the forward call that "
                "made it."
            )
        return cls(text, rank=rank, stage=stage, action=action, kind=kind, mb=mb, node=node)


class LossError(PipecutError, ValueError):
    """``loss_fn`` broke its contract (a scalar tensor), or an opt-in finite check failed."""


class InconsistentScheduleError(PipecutError, RuntimeError):
    """A schedule turned out inconsistent while it ran: a message sent or its receive posted
    twice, read before the action that makes it, actions that cannot progress, or activations
    never backpropagated. ``partitioner.schedule.validation.validate`` finds these before a step; a
    hand-built schedule that skipped it meets them here."""


class ActionError(PipecutError, ValueError):
    """An executor was given an action it cannot run: of an unknown kind, or for a stage its
    rank does not hold."""


class MissingInputError(InputError, KeyError):
    """A stage reads a graph input that the step was not given."""


class TrainerStateError(PipecutError, RuntimeError):
    """A trainer was asked for what it was not built for, or has not done yet: a step without an
    optimizer, a backward without a ``loss_fn``, a timeline without ``record=True`` or before
    any step."""


class ProcessGroupError(PipecutError, RuntimeError):
    """torch.distributed is not set up as a distributed pipeline needs (no process group)."""


class RankDisagreementError(PipecutError, ValueError):
    """Ranks of one job built their trainers, or called a step, with settings that must agree
    and do not: micro-batches, schedule, plan, precision, or the batch's sizes. Raised on every
    rank at once (``runtime.transport.agreement``), before any message is sent; the message
    lists what each rank had and the fix."""


class TransportOptionError(PipecutError, ValueError):
    """``transport=`` names no transport (``'auto'``, ``'local'``, ``'sequential'``, ``'dist'``)."""


def failing_node(error: BaseException, module: nn.Module) -> NodeInfo | None:
    """The node of ``module``'s graphs whose generated line was running when ``error`` rose.

    The innermost matching frame wins, so an error inside a no_grad / autocast region's body
    names the body's node. ``None`` when no frame is in a graph's code (the error came from
    outside, or torch's code layout changed).

    Example:
        >>> gm = fx.symbolic_trace(nn.Sequential(nn.Linear(16, 4), nn.ReLU()))
        >>> try:
        ...     gm(torch.randn(2, 8))
        ... except RuntimeError as e:
        ...     print(failing_node(e, gm).module)
        0
    """
    graphs = {}
    for sub in module.modules():
        code = getattr(getattr(sub, "forward", None), "__code__", None)
        if isinstance(sub, fx.GraphModule) and code is not None:
            graphs[code.co_filename] = (sub, code.co_firstlineno)
    found = None
    for frame, lineno in traceback.walk_tb(error.__traceback__):
        hit = graphs.get(frame.f_code.co_filename)
        if hit is not None:
            found = (hit, lineno)
    if found is None:
        return None
    (gm, first), lineno = found
    # fx's codegen keeps a generated-line -> node-index map (private; as dynamo reads it).
    lines: dict[int, int | None] | None = getattr(gm, "_lineno_map", None)
    index = lines.get(lineno - first) if lines else None
    if index is None:
        return None
    node = list(gm.graph.nodes)[index]
    return NodeInfo(node.name, node_module_path(node), _source(node.meta.get("stack_trace")))


def describe_value(value: Any) -> str:
    """``tensor (2, 16) float32`` / ``tuple of 2: ...`` / ``int 3``: a value as errors show it."""
    if isinstance(value, torch.Tensor):
        return f"tensor {tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, (tuple, list)):
        inner = ", ".join(describe_value(v) for v in value[:4]) + (", ..." if len(value) > 4 else "")
        return f"{type(value).__name__} of {len(value)}: ({inner})"
    return f"{type(value).__name__} {value!r}"[:80]


def _source(stack: str | None) -> str | None:
    """The innermost frame of a recorded stack that is the model's code, as ``file:line in fn: code``."""
    if not stack:
        return None
    best = None
    for entry in stack.split('File "')[1:]:
        head, _, code = entry.partition("\n")
        path, _, rest = head.partition('", line ')
        if path.startswith((_TORCH_DIR, "<")) or path.endswith(_TRACERS):
            continue
        lineno, _, fn = rest.partition(", in ")
        best = f"{path}:{lineno.strip()} in {fn.strip()}: {code.strip().splitlines()[0] if code.strip() else ''}"
    return best.rstrip(": ") if best else None


def _message(error: BaseException, limit: int = 2000) -> str:
    """The original message (indented when it spans lines), cut at ``limit`` characters."""
    text = str(error).strip() or "(no message)"
    if len(text) > limit:
        text = text[:limit] + " ..."
    return text.replace("\n", "\n    ")


class OptionKeywordError(PipecutError, TypeError):
    """``PipelineTrainer`` got a keyword that is neither its parameter nor a documented shortcut
    (``runtime.options.SHORTCUTS``); the message suggests the closest name."""


class TrainerOptionError(PipecutError, ValueError):
    """A trainer option was given twice (a shortcut keyword beside the object that holds its
    field), or an option object is not of its type; the message shows where the value belongs."""
