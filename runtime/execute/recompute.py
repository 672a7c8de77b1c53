"""Activation recomputation per stage: a forward that keeps only its inputs, replayed before backward.

Legend: ``S`` stages, ``s`` a stage index.

GPipe's (torchgpipe's) "checkpoint" at the granularity of a whole stage: with recomputation on
stage ``s``, its forward runs without an autograd graph, so between ``F`` and its backward the
stage holds only its inputs (what crossed its incoming cut, and the graph inputs it reads);
the backward (``B``, or ``I`` under split backward) first runs the forward again with autograd,
from those inputs, then backpropagates as usual. Memory per micro-batch in flight falls from the
stage's saved activations to its input bytes; the backward costs one more forward.

The replay must compute what the first forward computed: the random numbers (dropout) are
replayed by saving the RNG state of the CPU and of the stage's device before the first forward
and restoring it, inside ``torch.random.fork_rng`` (so the caller's RNG state is left as found),
before the second; autocast is replayed as it was. This is what ``torch.utils.checkpoint`` does;
we replay the stage ourselves instead of wrapping it in that function because split backward
(``I`` then ``W``) walks the stage's graph twice, and a checkpointed graph would be recomputed
for each walk, where we recompute once, at ``I``.

Modules that change state in their forward (BatchNorm's running statistics) see it twice, as
with ``torch.utils.checkpoint``.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from partitioner.errors import PipecutError

__all__ = ["RecomputeOptionError", "Replay", "forward_again", "forward_without_graph", "stages_to_recompute"]

log = logging.getLogger(__name__)

RecomputeOption = bool | Collection[int] | None


class RecomputeOptionError(PipecutError, ValueError):
    """``recompute=`` names stages the plan does not have, or is of the wrong type."""


def stages_to_recompute(option: RecomputeOption, plan_flags: Sequence[bool]) -> frozenset[int]:
    """The stages that recompute, from a trainer's ``recompute=`` option.

    Args:
        option: ``None`` (what the plan chose per stage), ``True`` / ``False`` (every stage /
            none), or a collection of stage indices.
        plan_flags: per stage of the plan, whether it chose recomputation
            (``StagePlan.recompute``).

    Raises:
        RecomputeOptionError: an index is not a stage of the plan, or ``option`` is of another type.

    Example:
        >>> sorted(stages_to_recompute(None, [True, False, True]))
        [0, 2]
        >>> sorted(stages_to_recompute(True, [False, False])), sorted(stages_to_recompute({1}, [False] * 3))
        ([0, 1], [1])
    """
    S = len(plan_flags)
    if option is None:
        return frozenset(s for s, on in enumerate(plan_flags) if on)
    if isinstance(option, bool):
        return frozenset(range(S)) if option else frozenset()
    if isinstance(option, (str, bytes)) or not isinstance(option, Collection):
        raise RecomputeOptionError(
            f"recompute={option!r}: give None (the plan's choice), True or False (every stage or "
            "none), or a collection of stage indices such as {0, 1}"
        )
    bad = [s for s in option if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < S]
    if bad:
        raise RecomputeOptionError(
            f"recompute={sorted(option, key=repr)!r} names {bad!r}, which are not stages of this plan "
            f"(it has stages 0..{S - 1}); list stage indices in that range"
        )
    return frozenset(option)


@dataclass(frozen=True)
class Replay:
    """What a stage's replayed forward needs to compute exactly what its first forward did.

    Attributes:
        cpu_rng: the CPU generator's state before the first forward.
        device: the stage's device.
        device_rng: that device's generator state, when it is an accelerator with one.
        autocast: per device type, ``(enabled, dtype)`` of autocast during the first forward.
    """

    cpu_rng: torch.Tensor
    device: torch.device
    device_rng: torch.Tensor | None
    autocast: tuple[tuple[str, bool, torch.dtype], ...]


def forward_without_graph(module: nn.Module, args: Sequence[Any], device: torch.device) -> tuple[Any, Replay]:
    """Run ``module(*args)`` without autograd; return its outputs and what replaying it needs.

    Args:
        module: the stage.
        args: its inputs; those requiring grad keep doing so (the replay differentiates them).
        device: the device the stage runs on (its RNG state is saved too).

    Example:
        >>> lin = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5))
        >>> x = torch.randn(2, 3, requires_grad=True)
        >>> y0, replay = forward_without_graph(lin, [x], torch.device("cpu"))
        >>> y1 = forward_again(lin, [x], replay)
        >>> y0.requires_grad, y1.requires_grad, torch.equal(y0, y1)
        (False, True, True)
    """
    replay = Replay(
        cpu_rng=torch.get_rng_state(),
        device=device,
        device_rng=_device_rng(device),
        autocast=tuple(
            (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
            for kind in dict.fromkeys(("cpu", device.type))
        ),
    )
    with torch.no_grad():
        outputs = module(*args)
    return outputs, replay


def forward_again(module: nn.Module, args: Sequence[Any], replay: Replay) -> Any:
    """Run ``module(*args)`` again with autograd, with the RNG and autocast state of the first run.

    The caller's RNG state and grad mode are left as they were.
    """
    accel = [replay.device] if replay.device_rng is not None else []
    with torch.random.fork_rng(devices=accel, device_type=replay.device.type if accel else None):
        torch.set_rng_state(replay.cpu_rng)
        if replay.device_rng is not None:
            _device_module(replay.device).set_rng_state(replay.device_rng, replay.device)
        with torch.enable_grad(), ExitStack() as stack:
            for kind, on, dtype in replay.autocast:
                stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=on))
            return module(*args)


def _device_module(device: torch.device) -> Any:
    return torch.get_device_module(device.type)


def _device_rng(device: torch.device) -> torch.Tensor | None:
    """The device generator's state (CUDA and other accelerators); ``None`` for the CPU."""
    if device.type in ("cpu", "meta"):
        return None
    mod = _device_module(device)
    get = getattr(mod, "get_rng_state", None)
    return get(device) if get is not None else None
