"""What a rank's step holds: its stages, the stash a forward keeps for its backward, and what ran when.

Legend: ``s`` a stage index, ``mb`` a micro-batch index.

Plain records the executor fills and the trainer reads; the executor (``executor``) runs the
actions over them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from partitioner.plan.split import StagedModel, StageIO
from partitioner.schedule.actions import ActionLike as ActionLike
from runtime.execute.recompute import Replay
from runtime.execute.split_backward import PendingWeights
from runtime.execute.wgrad_fusion import fuse_weight_grad_accumulation
from runtime.transport.p2p import Key, TensorMeta

__all__ = ["ActionLike", "StageRuntime", "stage_runtimes", "ActionRecord", "RunResult", "Stash", "StepState"]


@dataclass
class StageRuntime:
    """One stage as this rank runs it."""

    index: int
    module: nn.Module
    io: StageIO
    device: torch.device


def stage_runtimes(
    staged: StagedModel, devices: Mapping[int, torch.device], *, fuse_wgrad: bool
) -> dict[int, StageRuntime]:
    """This process's stages (those ``devices`` names) as the executor runs them, weight-gradient
    accumulation fused (``runtime.execute.wgrad_fusion``) unless told not to.

    Example:
        >>> from torch import fx, nn
        >>> from partitioner.plan.split import split_graph
        >>> gm = fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
        >>> staged = split_graph(gm, {"_0": 0, "_1": 1}, 2)
        >>> sorted(stage_runtimes(staged, {1: torch.device("cpu")}, fuse_wgrad=True))
        [1]
    """
    # Parameters several stages hold (tied weights): another thread may write their .grad.
    tied = [prm for st in staged.stages for name, prm in st.named_parameters(remove_duplicate=False)
            if name in staged.shared_params]
    out = {}
    for s in devices:
        module = staged.stages[s]
        if fuse_wgrad:
            fuse_weight_grad_accumulation(module, skip=tied)  # in place: a fresh stage module
        out[s] = StageRuntime(s, module, staged.io[s], devices[s])
    return out


@dataclass(frozen=True)
class ActionRecord:
    """When one action ran on this rank (``time.perf_counter`` seconds).

    ``start`` is when its inputs had arrived and its compute began; ``waited`` is how long the
    rank sat in receives before that (idle time, part of the bubble, not of the action).
    """

    rank: int
    stage: int
    kind: str
    mb: int
    start: float
    end: float
    waited: float = 0.0


@dataclass
class RunResult:
    """What one rank's run of a step produced.

    Attributes:
        losses: per micro-batch, the scaled loss (last stage only), detached.
        outputs: per micro-batch, the flat model outputs (last stage only, forward-only runs).
        peak_inflight: per stage of this rank, the most micro-batches whose activations were
            held at once.
        records: per action, when it ran (when recording was asked for).
        busy: seconds this rank's actions ran, not counting their waits for messages (host
            time: on a GPU, the time to launch the work).
    """

    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    outputs: dict[int, tuple[Any, ...]] = field(default_factory=dict)
    peak_inflight: dict[int, int] = field(default_factory=dict)
    records: list[ActionRecord] = field(default_factory=list)
    busy: float = 0.0


@dataclass
class Stash:
    """What a forward keeps for its backward."""

    args: list[Any]
    outputs: tuple[Any, ...]
    loss: torch.Tensor | None = None
    # Split backward: what ``W`` needs after ``I`` ran (see ``runtime.execute.split_backward``).
    pending_w: PendingWeights | None = None
    # Recomputation: the forward ran without a graph; the backward replays it (and the loss).
    replay: Replay | None = None
    target: Any = None
    scale: float = 1.0


@dataclass
class StepState:
    """The state of one step on one rank, between ``Executor.start`` and ``Executor.finish``."""

    inputs: Sequence[Mapping[str, Any]]
    targets: Sequence[Any] | None
    scales: list[float]
    train: bool
    mb_shapes: Mapping[int, Mapping[str, tuple[int, ...]]] | None
    result: RunResult
    held: dict[int, int]
    stash: dict[tuple[int, int], Stash] = field(default_factory=dict)
    # Receives to post ahead (``run`` on transports that post receives), in reading order.
    ahead: list[tuple[Key, list[TensorMeta], torch.device]] = field(default_factory=list)
    posted: int = 0
    # ``run(on_stage_done=...)``: the index of each stage's last backward action, and the count run.
    last_backward: dict[int, int] = field(default_factory=dict)
    on_stage_done: Callable[[int], None] | None = None
    executed: int = 0
