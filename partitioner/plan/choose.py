"""``schedule='auto'`` and ``microbatches='auto'``: price every candidate, keep the fastest that fits.

Legend: ``p`` devices, ``S`` stages (``p`` or ``2p``), ``m`` micro-batches.

Each candidate (schedule, micro-batch count) is cut optimally for its own memory profile (GPipe
holds ``m`` micro-batches per stage, 1F1B ``p - s``, ...), then one step is simulated with the
event simulator. The objective is time per micro-batch, ``step_time / m``: the micro-batch size
is fixed by the example inputs, so this is the inverse of throughput. Candidates within 1% of the
best are ties, broken towards fewer micro-batches (less memory, smaller global batch), then
towards the simpler schedule (the order of ``TRAINING_SCHEDULES``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace

from partitioner.errors import InfeasibleMemoryError, PartitionError, TooManyStagesError
from partitioner.plan.plan import Candidate, Plan
from partitioner.plan.render import fmt_bytes, fmt_time
from partitioner.schedule.registry import TRAINING_SCHEDULES, stages_per_rank

__all__ = ["choose", "pick", "microbatch_candidates", "TIE"]

log = logging.getLogger(__name__)

TIE = 0.01  # candidates within 1% of the best time per micro-batch are ties

# price(schedule, stages, m, split) -> a plan, or an error saying why the candidate is impossible.
Pricer = Callable[[str, int, int, bool], Plan]


def microbatch_candidates(p: int) -> tuple[int, ...]:
    """The micro-batch counts ``microbatches='auto'`` tries on ``p`` devices: p, 2p, 4p, 8p.

    Example:
        >>> microbatch_candidates(4)
        (4, 8, 16, 32)
    """
    return tuple(k * p for k in (1, 2, 4, 8))


def choose(
    price: Pricer,
    devices: int,
    schedules: Sequence[str],
    microbatches: Sequence[int],
) -> Plan:
    """Price every (schedule, m) on ``devices`` devices and return the winner's plan.

    Args:
        price: cuts and simulates one candidate (``split=False``: without building stages).
        devices: ``p``; a schedule with two chunks per device cuts ``2p`` stages.
        schedules: the schedules to try.
        microbatches: the micro-batch counts to try.

    Returns:
        The winning plan, with every candidate in ``plan.candidates`` and the reason in
        ``plan.choice``.

    Raises:
        InfeasibleMemoryError: no candidate fits the devices' memory.
    """
    rows: list[Candidate] = []
    for sched in schedules:
        S = devices * stages_per_rank(sched)
        for m in microbatches:
            try:
                plan = price(sched, S, m, False)
            except (InfeasibleMemoryError, TooManyStagesError) as e:
                rows.append(Candidate(sched, m, S, 0.0, 0.0, 0.0, 0.0, 0.0, False, _first_sentence(e)))
                continue
            pr = plan.prediction(sched)
            capacity = min(st.capacity for st in plan.stages)
            fits = pr.memory <= capacity
            recomputing = sum(st.recompute for st in plan.stages)
            note = f"recomputes {recomputing} of {S} stages" if recomputing else ""
            if not fits:
                note = "; ".join(x for x in ("simulated peak memory exceeds a device", note) if x)
            rows.append(
                Candidate(sched, m, S, pr.step_time, pr.step_time / m, pr.bubble, pr.memory, capacity, fits, note)
            )
    best, reason = pick(rows)
    log.info("auto schedule: %s", reason)
    plan = price(best.schedule, best.stages, best.microbatches, True)
    return replace(plan, candidates=tuple(rows), choice=reason)


def pick(rows: Sequence[Candidate]) -> tuple[Candidate, str]:
    """The winning candidate and a sentence saying why it won.

    Raises:
        InfeasibleMemoryError: no candidate fits.

    Example:
        >>> a = Candidate("1f1b", 8, 4, 11.0, 1.375, 0.27, 5.0, 10.0, True)
        >>> b = Candidate("zbh1", 8, 4, 9.0, 1.125, 0.11, 5.0, 10.0, True)
        >>> pick([a, b])[0].schedule
        'zbh1'
    """
    fit = [c for c in rows if c.fits]
    if not fit:
        tried = ", ".join(f"{c.schedule}/m={c.microbatches}" for c in rows)
        needed = [c.memory for c in rows if c.memory > 0]
        cap = max((c.capacity for c in rows), default=0.0)
        raise InfeasibleMemoryError(
            [min(needed)] if needed else [float("inf")], [cap],
            f"No schedule and micro-batch count fits (tried {tried}).",
        )
    fastest = min(c.time_per_microbatch for c in fit)
    ties = [c for c in fit if c.time_per_microbatch <= fastest * (1 + TIE)]
    order = {name: i for i, name in enumerate(TRAINING_SCHEDULES)}
    best = min(ties, key=lambda c: (c.microbatches, order.get(c.schedule, len(order)), c.time_per_microbatch))
    others = sorted((c for c in fit if c is not best), key=lambda c: c.time_per_microbatch)
    why = (
        f"{best.schedule} with {best.microbatches} micro-batches: "
        f"{fmt_time(best.time_per_microbatch)} per micro-batch, bubble {best.bubble:.1%}, "
        f"peak memory {fmt_bytes(best.memory)} of {fmt_bytes(best.capacity)}"
    )
    if others:
        nxt = others[0]
        gain = nxt.time_per_microbatch / best.time_per_microbatch - 1
        why += f"; {gain:.1%} faster than {nxt.schedule} with {nxt.microbatches}"
        if len(ties) > 1:
            why += " (candidates within 1% count as ties: fewer micro-batches, then the simpler schedule, win)"
    skipped = len(rows) - len(fit)
    if skipped:
        why += f"; {skipped} candidate(s) do not fit memory"
    return best, why


def _first_sentence(e: Exception) -> str:
    text = str(e)
    if isinstance(e, TooManyStagesError):
        return "more stages than units"
    if isinstance(e, InfeasibleMemoryError):
        return "no cut fits memory"
    return text.split(". ")[0] if isinstance(e, PartitionError) else type(e).__name__
