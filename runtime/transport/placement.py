"""Placement: which of a plan's stages each rank runs, on which device, and whether messages fit the backend.

Legend: ``S`` stages (the plan's model chunks), ``p`` ranks, ``v`` stages per rank (``S = p * v``),
``s`` a stage, ``r`` a rank, ``m`` micro-batches.

GPipe, 1F1B and ZB-H1 put one stage on each rank; interleaved 1F1B puts ``v`` (stage ``s`` on
rank ``s % p``) and ZB-V two, in a V. The trainer asks here for the schedule that runs a plan's
``S`` stages, checks the devices it was given against it, and, on NCCL, that no rank must read a
peer's messages out of order. Every refusal is a :class:`PlacementError` naming the numbers and
the fix.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from partitioner.errors import PipecutError
from partitioner.schedule.comm import grouped_program_finishes, needs_early_receives
from partitioner.schedule.errors import ScheduleError, UnknownScheduleError
from partitioner.schedule.ir import Schedule
from partitioner.schedule.registry import placement, stage_schedule

__all__ = ["PlacementError", "check_backend", "placed_schedule", "stage_devices"]


class PlacementError(PipecutError, ValueError):
    """The plan's stages do not fit the schedule's placement, the job's ranks, or the devices."""


def placed_schedule(name: str, num_stages: int, m: int, chunks_per_rank: int | None = None) -> Schedule:
    """The schedule running ``num_stages`` stages: ``S / v`` ranks, ``v`` stages each.

    The placement rules are the registry's (``partitioner.schedule.registry.placement``); this
    reports their failures as the trainer's :class:`PlacementError`.

    Args:
        name: a registered schedule name.
        num_stages: ``S``, the plan's stages.
        m: micro-batches per step.
        chunks_per_rank: ``v``; default the schedule's stages per rank (2 for ``'interleaved'``
            and ``'zbv'``, else 1).

    Raises:
        PlacementError: ``v`` does not suit the schedule, or does not divide ``S``.
        UnknownScheduleError: the name is not registered.

    Example:
        >>> placed_schedule("zbv", 4, 4).stage_to_rank
        (0, 1, 1, 0)
        >>> placed_schedule("interleaved", 6, 4, chunks_per_rank=3).stage_to_rank
        (0, 1, 0, 1, 0, 1)
    """
    try:
        placement(name, num_stages, chunks_per_rank)
    except UnknownScheduleError:
        raise
    except ScheduleError as err:
        raise PlacementError(str(err)) from None
    return stage_schedule(name, num_stages, m, chunks_per_rank)


def stage_devices(
    devices: Sequence[str | torch.device] | str | torch.device | None, p: int, schedule: Schedule
) -> dict[int, torch.device]:
    """One device per stage for an in-process run (default all cpu); a rank's stages share one.

    Raises:
        PlacementError: not one device per stage, or one rank's stages on different devices.
    """
    if devices is None:
        return {s: torch.device("cpu") for s in range(p)}
    if isinstance(devices, (str, torch.device)):
        return {s: torch.device(devices) for s in range(p)}
    if len(devices) != p:
        raise PlacementError(f"give one device per stage: {p} stages, {len(devices)} devices")
    out = {s: torch.device(d) for s, d in enumerate(devices)}
    for r in range(schedule.num_ranks):
        own = schedule.stages_of(r)
        if len({out[s] for s in own}) > 1:
            # One thread runs a rank's stages one after another: spreading them over devices
            # would serialise those devices instead of pipelining them.
            want = [str(out[schedule.stages_of(q)[0]]) for q in schedule.stage_to_rank]
            raise PlacementError(
                f"schedule {schedule.name!r} runs stages {list(own)} on rank {r}, one thread, but "
                f"they were given devices {[str(out[s]) for s in own]}; give the stages of a "
                f"rank one device (stage_to_rank={schedule.stage_to_rank}), e.g. devices={want}"
            )
    return out


def check_backend(schedule: Schedule, ios: Sequence[Any]) -> None:
    """Refuse, on NCCL, a schedule under which a rank reads a peer's messages out of order.

    NCCL pairs the messages between two ranks in posting order; ``DistTransport`` tags every
    message, which gloo honours and NCCL ignores. ``ios`` is the plan's per-stage ``StageIO``.

    Also refuse a program that can wait in a circle when sends wait for their receives, as NCCL
    sends may (``partitioner.schedule.comm.grouped_program_finishes``): 1F1B or ZB-H1 with a skip connection
    over several stages, on 3 or more ranks.

    Raises:
        PlacementError: the backend is NCCL and ``needs_early_receives(schedule)``, or the
            grouped program does not finish.
    """
    if dist.get_backend() != "nccl":
        return  # gloo pairs them by tag (DistTransport tags every message)
    edges = {(v.producer, c) for io in ios for v in io.outputs if v.producer == io.stage for c in v.consumers}
    if needs_early_receives(schedule, edges=edges):
        raise PlacementError(
            f"schedule {schedule.name!r} with {schedule.num_ranks} ranks and "
            f"{schedule.num_microbatches} micro-batches reads some messages from a peer in another "
            "order than the peer sends them, which NCCL (pairing messages in posting order) cannot "
            "match yet; use 'gpipe', '1f1b' or 'zbh1' on NCCL, or gloo"
        )
    if not grouped_program_finishes(schedule, edges=edges):
        skips = sorted((a, b) for a, b in edges if b > a + 1)
        raise PlacementError(
            f"schedule {schedule.name!r} on {schedule.num_ranks} ranks with values sent past "
            f"intermediate stages {skips} (stage -> stage) can deadlock on NCCL, whose sends wait "
            "for their receives; use 'gpipe', cut the plan so skip connections end on the next "
            "stage (split_points), or run on gloo"
        )
