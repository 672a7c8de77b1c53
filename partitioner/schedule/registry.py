"""The one table of pipeline schedules: each schedule's names, placement, backward and generator.

Legend: ``p`` ranks, ``m`` micro-batches, ``v`` stages per rank, ``S = p * v`` stages.

Every other module reads the facts about a schedule from :data:`SCHEDULES`: the planner (which
schedules train, how many stages a device holds, the order ties are broken in), the simulator
(whether the backward is split into ``I`` and ``W``), the runtime's placement and the command
line's choices. Adding a schedule is one :class:`ScheduleInfo` row here plus its generator.
"""

from __future__ import annotations

import difflib
import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from partitioner.schedule.errors import ScheduleError, UnknownScheduleError
from partitioner.schedule.generators import check_size, forward_only, gpipe, interleaved, one_f_one_b
from partitioner.schedule.ir import Schedule
from partitioner.schedule.zero_bubble import zbh1, zbv

__all__ = [
    "ScheduleInfo",
    "SCHEDULES",
    "TRAINING_SCHEDULES",
    "schedule_info",
    "schedule_names",
    "stages_per_rank",
    "get_schedule",
    "placement",
    "stage_schedule",
    "check_schedule_size",
]


@dataclass(frozen=True)
class ScheduleInfo:
    """What pipecut knows about one schedule.

    Attributes:
        name: the registry name (lower case), as plans and timelines print it.
        generator: builds the schedule from ``(p, m)`` (and ``v=`` if ``any_stages_per_rank``).
        summary: one line for help texts and docs.
        aliases: other accepted spellings (any case).
        stages_per_rank: ``v``, stages a rank holds by default (2 for the interleaved and V
            placements, else 1).
        any_stages_per_rank: the placement takes any ``v >= 1`` (passed to the generator as
            ``v=``); otherwise ``v`` is fixed at ``stages_per_rank``.
        split_backward: the backward runs as ``I`` (input gradients) then ``W`` (weight
            gradients) instead of one ``B``; the simulator and the executor split it.
        trains: runs a backward (a forward-only schedule does not).
        tie_break: among training schedules whose predicted steps tie, the lower wins (the
            simpler schedule first); ``None`` for schedules the planner does not choose.
    """

    name: str
    generator: Callable[..., Schedule]
    summary: str
    aliases: tuple[str, ...] = ()
    stages_per_rank: int = 1
    any_stages_per_rank: bool = False
    split_backward: bool = False
    trains: bool = True
    tie_break: int | None = None


SCHEDULES: tuple[ScheduleInfo, ...] = (
    ScheduleInfo("gpipe", gpipe, "all forwards, then all backwards", tie_break=4),
    ScheduleInfo("1f1b", one_f_one_b, "one forward, one backward in the steady state", tie_break=0),
    ScheduleInfo("forward", forward_only, "forwards only (inference)", trains=False),
    ScheduleInfo(
        "interleaved",
        interleaved,
        "1F1B over v stages per rank, stage s on rank s % p",
        aliases=("interleaved-1f1b",),
        stages_per_rank=2,
        any_stages_per_rank=True,
        tie_break=2,
    ),
    ScheduleInfo("zbh1", zbh1, "zero-bubble H1: 1F1B with weight gradients deferred", split_backward=True,
                 tie_break=1),
    ScheduleInfo(
        "zbv", zbv, "zero-bubble V: two stages per rank in a V, split backward", stages_per_rank=2,
        split_backward=True, tie_break=3,
    ),
)

# Schedules the planner may choose, in the order ties are broken (simplest first).
TRAINING_SCHEDULES: tuple[str, ...] = tuple(
    info.name for info in sorted((i for i in SCHEDULES if i.tie_break is not None), key=lambda i: i.tie_break or 0)
)

_BY_NAME = {key: info for info in SCHEDULES for key in (info.name, *info.aliases)}


def schedule_info(name: str) -> ScheduleInfo:
    """The registry row of ``name`` (any case, aliases included).

    Raises:
        UnknownScheduleError: the name is not registered; the message lists the known ones and
            the closest.

    Example:
        >>> schedule_info("Interleaved-1F1B").name, schedule_info("zbv").stages_per_rank
        ('interleaved', 2)
    """
    info = _BY_NAME.get(name.lower())
    if info is None:
        names = [i.name for i in SCHEDULES] + [a for i in SCHEDULES for a in i.aliases]
        close = difflib.get_close_matches(name.lower(), names, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        known = ", ".join(map(repr, names))
        raise UnknownScheduleError(f"unknown schedule {name!r} (known: {known}){hint}")
    return info


def schedule_names(*, training: bool = False) -> tuple[str, ...]:
    """The names :func:`get_schedule` knows (aliases aside), or with ``training`` those the planner chooses from.

    Example:
        >>> schedule_names()
        ('gpipe', '1f1b', 'forward', 'interleaved', 'zbh1', 'zbv')
        >>> schedule_names(training=True)
        ('1f1b', 'zbh1', 'interleaved', 'zbv', 'gpipe')
    """
    return TRAINING_SCHEDULES if training else tuple(info.name for info in SCHEDULES)


def stages_per_rank(name: str) -> int:
    """``v``, the stages a rank holds by default under ``name``: 2 for interleaved and ZB-V, else 1.

    Example:
        >>> stages_per_rank("zbv"), stages_per_rank("1f1b")
        (2, 1)
    """
    return schedule_info(name).stages_per_rank


def get_schedule(name: str, p: int, m: int, **kw: Any) -> Schedule:
    """Build a registered schedule by name.

    Args:
        name: one of :func:`schedule_names` (any case): ``'gpipe'``, ``'1f1b'``, ``'forward'``,
            ``'interleaved'`` (alias ``'interleaved-1f1b'``), ``'zbh1'``, ``'zbv'``.
        p: ranks.
        m: micro-batches per step.
        **kw: passed to the generator, e.g. ``v=3`` for ``'interleaved'``.

    Raises:
        UnknownScheduleError: the name is not registered; the message lists the known ones.
        ScheduleError: ``p`` or ``m`` (or a keyword) is out of range for the generator.

    Example:
        >>> get_schedule("1F1B", 4, 8).name
        '1f1b'
        >>> s = get_schedule("interleaved-1f1b", 2, 4, v=2)
        >>> s.name, s.stage_to_rank
        ('interleaved', (0, 1, 0, 1))
    """
    return _generate(schedule_info(name), p, m, **kw)


def placement(name: str, num_stages: int, chunks_per_rank: int | None = None) -> tuple[int, int]:
    """``(p, v)``: the ranks and stages per rank that run ``num_stages`` stages under ``name``.

    Args:
        name: a registered schedule name.
        num_stages: ``S``, the plan's stages.
        chunks_per_rank: ``v``; default the schedule's :attr:`ScheduleInfo.stages_per_rank`.

    Raises:
        UnknownScheduleError: the name is not registered.
        ScheduleError: ``v`` does not suit the schedule, or does not divide ``S``; the message
            says which stage counts would fit.

    Example:
        >>> placement("zbv", 4), placement("interleaved", 6, 3), placement("1f1b", 3)
        ((2, 2), (2, 3), (3, 1))
    """
    info = schedule_info(name)
    v = info.stages_per_rank if chunks_per_rank is None else chunks_per_rank
    if type(v) is not int or v < 1:
        raise ScheduleError(f"chunks_per_rank must be an int >= 1, got {v!r}")
    if v != info.stages_per_rank and not info.any_stages_per_rank:
        several = [i.name for i in SCHEDULES if i.any_stages_per_rank]
        if info.stages_per_rank == 1:
            what = "one stage per rank"
        else:
            what = f"exactly {info.stages_per_rank} stages per rank"
        raise ScheduleError(
            f"schedule {name!r} places {what}, got chunks_per_rank={v}; omit chunks_per_rank, or use "
            f"schedule={several[0]!r} for {'several' if info.stages_per_rank == 1 else 'other'} stages per rank"
        )
    if num_stages % v:
        lower, upper = num_stages - num_stages % v, num_stages - num_stages % v + v
        fix = f"{lower} or {upper}" if lower else f"{upper}"
        raise ScheduleError(
            f"schedule {name!r} places {v} stages per rank, but the plan has {num_stages} "
            f"stages, not a multiple of {v}; partition into {fix} stages "
            f"(partition(..., num_stages=...)), or pick chunks_per_rank dividing {num_stages}"
        )
    return num_stages // v, v


def _generate(info: ScheduleInfo, p: int, m: int, **kw: Any) -> Schedule:
    """``info.generator(p, m, **kw)`` with the cyclic garbage collector paused, as it was found after.

    A schedule is up to ``MAX_ACTIONS`` new objects, none of them garbage: building ``64 x 4096``
    takes about half as long without the collections their number triggers on the way.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return info.generator(p, m, **kw)
    finally:
        if was_enabled:
            gc.enable()


def stage_schedule(name: str, num_stages: int, m: int, chunks_per_rank: int | None = None) -> Schedule:
    """The schedule running ``num_stages`` stages with ``m`` micro-batches: ``S / v`` ranks, ``v`` stages each.

    Raises:
        UnknownScheduleError, ScheduleError: as :func:`placement` and the generator raise them.

    Example:
        >>> stage_schedule("zbv", 4, 4).stage_to_rank
        (0, 1, 1, 0)
        >>> stage_schedule("interleaved", 6, 4, chunks_per_rank=3).stage_to_rank
        (0, 1, 0, 1, 0, 1)
    """
    info = schedule_info(name)
    p, v = placement(name, num_stages, chunks_per_rank)
    return _generate(info, p, m, v=v) if info.any_stages_per_rank else _generate(info, p, m)


def check_schedule_size(name: str, num_stages: int, m: int) -> None:
    """Refuse at once a schedule ``name`` of ``num_stages`` stages and ``m`` micro-batches that
    would hold more than ``generators.MAX_ACTIONS`` actions (the generators check it too; this
    lets a caller check before costlier work, e.g. tracing a model).

    Raises:
        UnknownScheduleError: the name is not registered.
        ScheduleSizeError: too many actions; the message gives the largest ``m`` that fits.

    Example:
        >>> check_schedule_size("zbv", 64, 4096)  # 786,432 actions: fine
    """
    info = schedule_info(name)
    check_size(info.name, num_stages, m, 3 if info.split_backward else 2 if info.trains else 1)
