"""Schedule generators for whole backward passes: GPipe, 1F1B, forward-only and interleaved 1F1B.

Legend: ``p`` ranks, ``m`` micro-batches, ``v`` stages (chunks) per rank, ``S = p * v`` stages,
``s`` a stage, ``r`` a rank, ``mb`` a micro-batch, ``c`` a chunk (rank ``r``'s chunk ``c`` is
stage ``c * p + r`` in the interleaved placement).

Each generator is a small pure function of ``(p, m)`` returning a :class:`Schedule`; the
registry in ``partitioner.schedule.ir`` names them. Split-backward schedules are in ``zero_bubble``.
"""

from __future__ import annotations

from collections.abc import Sequence

from partitioner.schedule.actions import Action, Kind
from partitioner.schedule.errors import ScheduleError, ScheduleSizeError
from partitioner.schedule.ir import Schedule

__all__ = ["MAX_ACTIONS", "check_size", "forward_only", "gpipe", "interleaved", "one_f_one_b"]

F, B = Kind.FORWARD, Kind.BACKWARD

MAX_ACTIONS = 1 << 21
"""The most actions a schedule may hold (2,097,152): ``S * m`` times 1 (forward only), 2 (``F``,
``B``) or 3 (``F``, ``I``, ``W``). Enough for 64 stages x 4096 micro-batches with split backward
(786,432 actions, planned and simulated in seconds: docs/schedules.md), and a bound on the time
and memory building, checking and simulating one takes (all linear in the actions, about 200
bytes each). Past it a generator raises :class:`ScheduleSizeError` before building anything."""


def check_size(name: str, num_stages: int, m: int, per_microbatch: int) -> None:
    """Refuse a schedule of ``num_stages * m * per_microbatch`` actions above :data:`MAX_ACTIONS`.

    Args:
        name: the schedule, for the message.
        num_stages: ``S``.
        m: micro-batches per step.
        per_microbatch: actions per stage and micro-batch: 1 forward only, 2 (``F``, ``B``),
            3 with split backward (``F``, ``I``, ``W``).

    Raises:
        ScheduleSizeError: too many actions; the message gives the largest ``m`` that fits.

    Example:
        >>> check_size("1f1b", 64, 4096, 2)  # 524,288 actions: fine
        >>> try:
        ...     check_size("zbh1", 64, 10**7, 3)
        ... except ScheduleSizeError as err:
        ...     print(err)  # doctest: +NORMALIZE_WHITESPACE
        schedule 'zbh1' with 64 stages and 10000000 micro-batches would hold 1,920,000,000 actions
        (3 per stage and micro-batch), more than MAX_ACTIONS = 2,097,152
        (partitioner.schedule.generators.MAX_ACTIONS): use at most 10922 micro-batches (cut
        the batch into fewer, larger micro-batches), or fewer stages
    """
    total = num_stages * m * per_microbatch
    if total > MAX_ACTIONS:
        most = MAX_ACTIONS // (num_stages * per_microbatch)
        fix = (
            f"use at most {most} micro-batches (cut the batch into fewer, larger micro-batches), or fewer stages"
            if most >= 1
            else f"use fewer stages (at most {MAX_ACTIONS // per_microbatch})"
        )
        raise ScheduleSizeError(
            f"schedule {name!r} with {num_stages} stages and {m} micro-batches would hold {total:,} actions "
            f"({per_microbatch} per stage and micro-batch), more than MAX_ACTIONS = {MAX_ACTIONS:,} "
            f"(partitioner.schedule.generators.MAX_ACTIONS): {fix}"
        )


def _check_pm(name: str, p: object, m: object, v: object = 1) -> None:
    for letter, value, what in (
        ("p", p, "ranks"),
        ("m", m, "micro-batches"),
        ("v", v, "stages per rank"),
    ):
        if type(value) is not int or value < 1:
            raise ScheduleError(f"{name}: {letter} ({what}) must be an int >= 1 (got {value!r})")


def gpipe(p: int, m: int) -> Schedule:
    """GPipe: each stage runs all ``m`` forwards, then all ``m`` backwards; stage ``s`` on rank ``s``.

    Holds ``m`` micro-batches of activations on every stage.

    Args:
        p: ranks, one stage each (stage ``s`` on rank ``s``).
        m: micro-batches per step; any ``m >= 1``, fewer than ``p`` included.

    Raises:
        ScheduleError: ``p`` or ``m`` is not an int >= 1.
        ScheduleSizeError: the schedule would hold more than ``MAX_ACTIONS`` actions.

    Example:
        >>> print(gpipe(2, 2))
        step    0   1   2   3   4   5
        rank 0  0F0 0F1         0B0 0B1
        rank 1      1F0 1F1 1B0 1B1
    """
    _check_pm("gpipe", p, m)
    check_size("gpipe", p, m, 2)
    rows = [
        [Action(s, F, mb) for mb in range(m)] + [Action(s, B, mb) for mb in range(m)]
        for s in range(p)
    ]
    return Schedule(tuple(map(tuple, rows)), tuple(range(p)), m, name="gpipe")


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B: stage ``s`` runs ``min(p - 1 - s, m)`` warm-up forwards, then alternates F and B, then cools down.

    Holds ``min(m, p - s)`` micro-batches of activations on stage ``s``; same bubble as GPipe.

    Args:
        p: ranks, one stage each (stage ``s`` on rank ``s``).
        m: micro-batches per step; any ``m >= 1``, fewer than ``p`` included.

    Raises:
        ScheduleError: ``p`` or ``m`` is not an int >= 1.
        ScheduleSizeError: the schedule would hold more than ``MAX_ACTIONS`` actions.

    Example:
        >>> print(one_f_one_b(2, 3))
        step    0   1   2   3   4   5   6   7
        rank 0  0F0 0F1     0B0 0F2 0B1     0B2
        rank 1      1F0 1B0 1F1 1B1 1F2 1B2
    """
    _check_pm("1f1b", p, m)
    check_size("1f1b", p, m, 2)
    rows = []
    for s in range(p):
        warmup = min(p - 1 - s, m)
        row = [Action(s, F, mb) for mb in range(warmup)]
        for mb in range(m - warmup):
            row += [Action(s, F, warmup + mb), Action(s, B, mb)]
        row += [Action(s, B, mb) for mb in range(m - warmup, m)]
        rows.append(tuple(row))
    return Schedule(tuple(rows), tuple(range(p)), m, name="1f1b")


def forward_only(p: int, m: int, *, stage_to_rank: Sequence[int] | None = None) -> Schedule:
    """Inference: stage ``s`` runs the ``m`` forwards in order; nothing is kept for a backward.

    Args:
        p: ranks, one stage each (stage ``s`` on rank ``s``) unless ``stage_to_rank`` says otherwise.
        m: micro-batches per step; any ``m >= 1``, fewer than ``p`` included.
        stage_to_rank: another placement (a training schedule's, e.g. interleaved or V-shaped,
            to run inference on the same ranks): each rank runs all ``m`` forwards of its first
            stage, then of its next, in ascending stage order (never stuck: a stage only waits
            for lower stages).

    Raises:
        ScheduleError: ``p`` or ``m`` is not an int >= 1.
        ScheduleSizeError: the schedule would hold more than ``MAX_ACTIONS`` actions.

    Example:
        >>> print(forward_only(2, 2))
        step    0   1   2
        rank 0  0F0 0F1
        rank 1      1F0 1F1
        >>> print(forward_only(2, 2, stage_to_rank=(0, 1, 1, 0)))
        step    0   1   2   3   4   5
        rank 0  0F0 0F1         3F0 3F1
        rank 1      1F0 1F1 2F0 2F1
    """
    _check_pm("forward", p, m)
    placement = tuple(range(p)) if stage_to_rank is None else tuple(stage_to_rank)
    check_size("forward", len(placement), m, 1)
    rows = tuple(
        tuple(Action(s, F, mb) for s, owner in enumerate(placement) if owner == r for mb in range(m))
        for r in range(p)
    )
    return Schedule(rows, placement, m, forward_only=True, name="forward")


def _groups(p: int, m: int) -> list[range]:
    """Cut micro-batches ``0..m-1`` into ``max(1, m // p)`` consecutive groups, larger first.

    Megatron-LM runs the chunks of a rank over groups of ``p`` micro-batches; when ``p`` does not
    divide ``m`` the groups here differ in size by at most one, and each has ``>= p``
    micro-batches when ``m >= p`` (a group smaller than ``p`` would stall rank 0 waiting for the
    group's first micro-batch to come round to its next chunk).
    """
    rounds = max(1, m // p)
    base, extra = divmod(m, rounds)
    groups, start = [], 0
    for size in [base + 1] * extra + [base] * (rounds - extra):
        groups.append(range(start, start + size))
        start += size
    return groups


def interleaved(p: int, m: int, v: int = 2) -> Schedule:
    """Interleaved 1F1B (Megatron-LM, Narayanan et al. 2021): ``v`` chunks per rank, depth first.

    Stage ``s`` is on rank ``s % p``: rank ``r`` holds chunks ``c = 0..v-1``, stages ``c * p + r``.
    Micro-batches go in groups of ``p`` (see below): a rank runs chunk 0 of a group, then chunk 1
    of the same group, and so on, then the next group. Rank ``r`` runs
    ``(v - 1) * G + 2 * (p - 1 - r)`` warm-up forwards (``G`` the first group's size), then
    alternates one forward and one backward, then drains the backwards; backwards go over the
    same groups with the chunks in reverse. With ``v = 1`` it is exactly :func:`one_f_one_b`.

    In unit time (a chunk's forward or backward takes ``1 / v`` of a whole stage's) the bubble is
    ``(p - 1) / (v * m + p - 1)`` of each rank's time when ``m >= p``: ``v`` times smaller than
    1F1B's. The price is memory and messages: rank ``r`` holds up to
    ``(v - 1) * G + 2 * (p - 1 - r) + 1`` chunk activations (each ``1 / v`` of the rank's layers;
    rank 0: ``p + (p - 1) / v`` whole stages against 1F1B's ``p``), and ``v`` times as many
    activations cross between ranks.

    Groups: ``max(1, m // p)`` groups of consecutive micro-batches, larger first, sizes differing
    by at most one: ``p`` each when ``p`` divides ``m`` (Megatron's schedule exactly); e.g.
    ``p = 4, m = 10`` gives groups of 5 and 5, so ``G = 5``. Any ``m >= 1`` works; with
    ``m < p`` there is one group of ``m`` and rank 0 waits for each chunk's input.

    Args:
        p: ranks.
        m: micro-batches per step, any ``m >= 1``.
        v: chunks (stages) per rank; ``S = p * v`` stages.

    Raises:
        ScheduleError: ``p``, ``m`` or ``v`` is not an int >= 1.
        ScheduleSizeError: the schedule would hold more than ``MAX_ACTIONS`` actions.

    Example:
        >>> print(interleaved(2, 2))
        step    0   1   2   3   4   5   6   7   8   9
        rank 0  0F0 0F1 2F0 2F1     2B0     2B1 0B0 0B1
        rank 1      1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1
    """
    _check_pm("interleaved", p, m, v)
    check_size("interleaved", p * v, m, 2)
    groups = _groups(p, m)
    order = [(c, mb) for group in groups for c in range(v) for mb in group]  # (chunk, mb)
    rows = []
    for r in range(p):
        forwards = [Action(c * p + r, F, mb) for c, mb in order]
        backwards = [Action((v - 1 - c) * p + r, B, mb) for c, mb in order]
        # Warm-up: rank r's first backward (last chunk, micro-batch 0) waits for the earlier
        # chunks' (v - 1) G forwards and for a trip out to rank p - 1 and back, two steps per
        # rank in between; Megatron fills that wait with forwards. With one chunk there is
        # nothing else to fill it with (extra forwards would only hold memory), so 1F1B's count.
        depth = p - 1 - r if v == 1 else (v - 1) * len(groups[0]) + 2 * (p - 1 - r)
        warmup = min(v * m, depth)
        row = forwards[:warmup]
        for k in range(v * m - warmup):
            row += [forwards[warmup + k], backwards[k]]
        row += backwards[v * m - warmup :]
        rows.append(tuple(row))
    return Schedule(tuple(rows), tuple(s % p for s in range(p * v)), m, name="interleaved")
