"""zero_bubble.py: ZB-H1 and ZB-V are valid, beat 1F1B's bubble, and hold no more than 1F1B's peak.

Legend: ``p`` ranks, ``m`` micro-batches, ``S`` stages, ``s`` a stage, ``r`` a rank, ``mb`` a
micro-batch. Unit time: ``F``, ``I`` and ``W`` take one step each, a fused ``B`` two.
"""

from __future__ import annotations

from partitioner.schedule.actions import Action, Kind
from partitioner.schedule.generators import one_f_one_b
from partitioner.schedule.grid import format_grid
from partitioner.schedule.validation import peak_inflight, peak_inflight_per_rank, validate
from partitioner.schedule.zero_bubble import zbh1, zbv
from schedule_cases import GRID, makespan

F, I, W = Kind.FORWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT
FUSED_B = {Kind.BACKWARD: 2}  # a whole backward is I + W


def _split_backward_everywhere(actions: tuple[tuple[Action, ...], ...], S: int, m: int) -> None:
    present = {a for row in actions for a in row}
    assert present == {Action(s, k, mb) for s in range(S) for k in (F, I, W) for mb in range(m)}


# -- ZB-H1 -------------------------------------------------------------------------------------


def test_zbh1_is_valid_on_the_whole_grid() -> None:
    for p, m in GRID:
        for defer_w in (True, False):
            schedule = zbh1(p, m, defer_w=defer_w)
            validate(schedule)
            assert schedule.stage_to_rank == tuple(range(p)) and schedule.name == "zbh1"
            _split_backward_everywhere(schedule.actions, p, m)
            assert "[" not in format_grid(schedule)


def test_zbh1_holds_no_more_than_1f1b_s_peak() -> None:
    for p, m in GRID:
        ours, theirs = peak_inflight(zbh1(p, m)), peak_inflight(one_f_one_b(p, m))
        assert ours == (min(p, m),) * p  # every stage, counted until W
        assert max(ours) == max(theirs)
        # Without deferred W each stage holds exactly what 1F1B's same stage holds.
        assert peak_inflight(zbh1(p, m, defer_w=False)) == theirs


def test_zbh1_bubble_is_a_third_of_1f1b_s() -> None:
    for p, m in GRID:
        ours = makespan(zbh1(p, m))
        steady = makespan(zbh1(p, m, defer_w=False))
        theirs = makespan(one_f_one_b(p, m), FUSED_B)
        assert theirs == 3 * (m + p - 1)  # every rank works 3 m steps; 3 (p - 1) idle
        if m >= p:
            assert ours == 3 * m + p - 1, (p, m)  # (p - 1) idle: (p - 1)(F + B - W)
            assert steady == 3 * m + 2 * (p - 1), (p, m)
        if p > 1:
            assert ours < theirs and ours <= steady < theirs, (p, m)


def test_zbh1_grid_p4_m8() -> None:
    # Stage s defers its first s W passes: rank 1's 1W0 comes after 1I1.
    rank0, rank1 = format_grid(zbh1(4, 8)).splitlines()[1:3]
    assert rank0 == (
        "rank 0  0F0 0F1 0F2 0F3             0I0 0W0 0F4 0I1 0W1 0F5 0I2 0W2 0F6 0I3 0W3 0F7 "
        "0I4 0W4 0I5 0W5 0I6 0W6 0I7 0W7"
    )
    assert rank1 == (
        "rank 1      1F0 1F1 1F2         1I0 1F3 1I1 1W0 1F4 1I2 1W1 1F5 1I3 1W2 1F6 1I4 1W3 "
        "1F7 1I5 1W4 1I6 1W5 1I7 1W6 1W7"
    )


# -- ZB-V --------------------------------------------------------------------------------------


def test_zbv_is_valid_on_the_whole_grid() -> None:
    for p, m in GRID:
        schedule = zbv(p, m)
        validate(schedule)
        assert schedule.stage_to_rank == tuple(range(p)) + tuple(reversed(range(p)))
        assert schedule.stages_of(0) == (0, 2 * p - 1) and schedule.name == "zbv"
        _split_backward_everywhere(schedule.actions, 2 * p, m)
        assert [len(row) for row in schedule.actions] == [6 * m] * p
        assert "[" not in format_grid(schedule)


def test_zbv_holds_no_more_than_1f1b_s_peak() -> None:
    # A chunk is half a rank's layers: 2 chunk activations weigh one whole stage's.
    for p, m in GRID:
        ours = peak_inflight_per_rank(zbv(p, m))
        assert max(ours) <= 2 * max(peak_inflight(one_f_one_b(p, m))), (p, m, ours)
        if m >= 2 * p - 1:
            assert ours == (2 * p,) * p  # balanced: every rank holds the same


def test_zbv_is_zero_bubble_but_for_the_first_input() -> None:
    # Chunk steps: a rank works 6 m; rank p - 1 must wait p - 1 steps for its first input.
    for p, m in GRID:
        steps = makespan(zbv(p, m))
        assert steps >= 6 * m + p - 1
        if m >= 2 * p - 1:
            assert steps == 6 * m + p - 1, (p, m)
        # In whole-stage time (chunk steps are half) it beats 1F1B, and ZB-H1 once m >= 2p - 1.
        h1, f1b = 2 * makespan(zbh1(p, m)), 2 * makespan(one_f_one_b(p, m), FUSED_B)
        if m >= p > 1:
            assert steps <= h1 < f1b, (p, m)
        if m >= 2 * p - 1 and p > 1:
            assert steps < h1, (p, m)


def test_zbv_p1_is_both_chunks_on_one_rank() -> None:
    assert [str(a) for a in zbv(1, 2).actions[0]] == (
        ["0F0", "1F0", "1I0", "1W0", "0F1", "0I0", "0W0", "1F1", "1I1", "1W1", "0I1", "0W1"]
    )
