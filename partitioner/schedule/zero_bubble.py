"""Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): ZB-H1, ZB-V.

Legend: ``p`` ranks, ``m`` micro-batches, ``S`` stages, ``s`` a stage, ``r`` a rank, ``mb`` a
micro-batch.

Both split each backward into ``I`` (gradients of the stage's inputs, which the previous stage
waits for) and ``W`` (gradients of its weights, which nobody waits for). ``I`` stays on the
critical path; ``W`` moves into what would otherwise be bubbles. A micro-batch's activations are
held from its ``F`` until its ``W``. The schedules are the paper's handcrafted ones, which reach
their stated bubbles when ``F``, ``I`` and ``W`` take equal time; ``partitioner.schedule.simulate`` weighs
them with real costs.
"""

from __future__ import annotations

from partitioner.schedule.actions import Action, Kind
from partitioner.schedule.generators import _check_pm, check_size
from partitioner.schedule.ir import Schedule

__all__ = ["zbh1", "zbv"]

F, I, W = Kind.FORWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT


def zbh1(p: int, m: int, *, defer_w: bool = True) -> Schedule:
    """ZB-H1: 1F1B with split backward, each stage's first ``W`` passes moved to the tail.

    Stage ``s`` (on rank ``s``) runs 1F1B's ``p - 1 - s`` warm-up forwards, then ``F``, ``I``
    pairs, each followed by a ``W`` once ``s`` of them are outstanding; the ``s`` deferred ``W``
    fill the tail, where 1F1B idles. Every stage then holds up to ``min(p, m)`` micro-batches
    (counted until ``W``): 1F1B's peak (its stage 0), reached on every stage; the paper argues
    ``W`` needs less memory than a whole backward, so no stage exceeds 1F1B's stage 0.

    With ``F = I = W`` (one unit each; a fused ``B`` is two) and ``m >= p``, the step takes
    ``3 m + p - 1`` units: a bubble of ``p - 1`` units per rank, ``(p - 1)(F + B - W)`` in the
    paper's terms, a third of 1F1B's ``3 (p - 1)``.

    Args:
        p: ranks, one stage each.
        m: micro-batches per step, any ``m >= 1``.
        defer_w: ``False`` runs each ``W`` right after its ``I``: stage ``s`` holds 1F1B's
            ``min(m, p - s)``, and the bubble is ``2 (p - 1)`` units, between ZB-H1's and 1F1B's.

    Raises:
        ScheduleError: ``p`` or ``m`` is not an int >= 1.
        ScheduleSizeError: the schedule would hold more than ``MAX_ACTIONS`` actions.

    Example:
        >>> print(zbh1(2, 3))
        step    0   1   2   3   4   5   6   7   8   9
        rank 0  0F0 0F1     0I0 0W0 0F2 0I1 0W1 0I2 0W2
        rank 1      1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1W2
    """
    _check_pm("zbh1", p, m)
    check_size("zbh1", p, m, 3)
    rows = []
    for s in range(p):
        warmup = min(p - 1 - s, m)
        deferred = s if defer_w else 0
        row = [Action(s, F, mb) for mb in range(warmup)]
        weights = 0  # W passes run so far; they go in micro-batch order
        for k in range(m - warmup):
            row += [Action(s, F, warmup + k), Action(s, I, k)]
            if k >= deferred:
                row.append(Action(s, W, weights))
                weights += 1
        for k in range(m - warmup, m):  # cool-down: a W fills each wait for the next gradient
            row += [Action(s, I, k), Action(s, W, weights)]
            weights += 1
        row += [Action(s, W, mb) for mb in range(weights, m)]
        rows.append(tuple(row))
    return Schedule(tuple(rows), tuple(range(p)), m, name="zbh1")


def zbv(p: int, m: int) -> Schedule:
    """ZB-V: two chunks per rank in a V, split backward; near-zero bubble at 1F1B's memory.

    Rank ``r`` holds stage ``r`` (chunk 0, on the way down the ranks) and stage ``2p - 1 - r``
    (chunk 1, on the way back up), so ``stage_to_rank = (0, ..., p - 1, p - 1, ..., 0)``: the
    turn at the bottom and the loss at the top stay on one rank, and every rank does the same
    work. Each rank, in five phases (``down`` its chunk-0 stage, ``up`` its chunk-1 stage):

    1. ``2 (p - r) - 1`` forwards of ``down``: the time its first ``up`` input takes to come round;
    2. ``r`` pairs ``F up, F down``: ``up`` inputs now arrive every other step;
    3. ``p - r`` triples ``F up, I up, W up``: backwards start at the top (rank 0 has the loss);
    4. steady state, until every forward ran: ``F down, I down, W down, F up, I up, W up``;
    5. cool-down: ``r`` pairs ``I down, I up``, ``p - r`` pairs ``I down, W down``, then the
       remaining ``W`` of ``up`` and of ``down``.

    The counts assume ``m >= 2p - 1``; for fewer, the schedule for ``2p - 1`` is built and the
    extra micro-batches are dropped (still valid, with more bubble).

    Each chunk is half a rank's layers, so with ``F = I = W`` (per whole stage; half that per
    chunk) and ``m >= 2p - 1`` only the ``p - 1`` chunk steps rank ``p - 1`` waits for its first
    input are idle: a bubble of ``(p - 1) / (6 m + p - 1)``. Every rank holds up to
    ``2 min(p, m)`` chunk activations, ``min(p, m)`` whole stages: 1F1B's peak (its stage 0).

    Args:
        p: ranks; ``S = 2p`` stages.
        m: micro-batches per step, any ``m >= 1``; zero bubble needs ``m >= 2p - 1``.

    Raises:
        ScheduleError: ``p`` or ``m`` is not an int >= 1.
        ScheduleSizeError: the schedule would hold more than ``MAX_ACTIONS`` actions.

    Example:
        >>> print(zbv(2, 3))
        step    0   1   2   3   4   5   6   7   8   9   10  11  12  13  14  15  16  17  18
        rank 0  0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0 3F2 3I2 3W2 0I1 0W1 0I2 0W2
        rank 1      1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1I1 2I2 1I2 1W1 2W2 1W2
    """
    _check_pm("zbv", p, m)
    check_size("zbv", 2 * p, m, 3)
    n = max(m, 2 * p - 1)
    rows = tuple(tuple(a for a in _zbv_row(p, r, n) if a.mb < m) for r in range(p))
    placement = tuple(range(p)) + tuple(reversed(range(p)))
    return Schedule(rows, placement, m, name="zbv")


def _zbv_row(p: int, r: int, n: int) -> list[Action]:
    """Rank ``r``'s list in :func:`zbv`'s five phases, for ``n >= 2p - 1`` micro-batches."""
    down, up = r, 2 * p - 1 - r
    row: list[Action] = []
    # Next micro-batch per (stage, letter): keyed by the letter, as an Enum hashes in Python.
    done = {(s, k.value): 0 for s in (down, up) for k in (F, I, W)}

    def run(stage: int, *kinds: Kind) -> None:
        for kind in kinds:
            key = (stage, kind._value_)
            row.append(Action(stage, kind, done[key]))
            done[key] += 1

    for _ in range(2 * (p - r) - 1):
        run(down, F)
    for _ in range(r):
        run(up, F)
        run(down, F)
    for _ in range(p - r):
        run(up, F, I, W)
    while done[up, "F"] < n:
        if done[down, "F"] < n:
            run(down, F)
        run(down, I, W)
        run(up, F, I, W)
    for _ in range(r):
        run(down, I)
        run(up, I)
    for _ in range(p - r):
        run(down, I, W)
    while done[up, "W"] < n:
        run(up, W)
    while done[down, "W"] < n:
        run(down, W)
    return row
