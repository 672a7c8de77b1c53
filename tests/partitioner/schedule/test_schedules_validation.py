"""validation.py: the unit-time grid, ``validate`` catching broken lists, and ``peak_inflight``.

Legend: ``p`` ranks, ``m`` micro-batches, ``S`` stages, ``s`` a stage, ``r`` a rank, ``mb`` a
micro-batch.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from partitioner.schedule.actions import Action, Kind
from partitioner.schedule.comm import comm_plan
from partitioner.schedule.errors import ScheduleError
from partitioner.schedule.generators import forward_only, gpipe, one_f_one_b
from partitioner.schedule.grid import format_grid
from partitioner.schedule.ir import Schedule
from partitioner.schedule.registry import get_schedule
from partitioner.schedule.validation import peak_inflight, peak_inflight_per_rank, validate
from schedule_cases import (
    DOCS,
    TRAINING,
    A,
    actions,
    chain,
    deadlocks,
    error_of,
    over_valid_schedules,
    quick,
    run_buffered,
    sched,
    tuples,
)

# -- the grid ----------------------------------------------------------------------------------


def test_grid_of_1f1b_p2_m4() -> None:
    assert format_grid(one_f_one_b(2, 4)) == (
        "step    0   1   2   3   4   5   6   7   8   9\n"
        "rank 0  0F0 0F1     0B0 0F2 0B1 0F3 0B2     0B3\n"
        "rank 1      1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3"
    )
    assert str(one_f_one_b(2, 4)) == format_grid(one_f_one_b(2, 4))


def test_grid_of_gpipe_p3_m2_and_wide_labels() -> None:
    assert format_grid(gpipe(3, 2)) == (
        "step    0   1   2   3   4   5   6   7\n"
        "rank 0  0F0 0F1                 0B0 0B1\n"
        "rank 1      1F0 1F1         1B0 1B1\n"
        "rank 2          2F0 2F1 2B0 2B1"
    )
    assert format_grid(forward_only(1, 12)).splitlines() == [
        "step    0    1    2    3    4    5    6    7    8    9    10   11",
        "rank 0  0F0  0F1  0F2  0F3  0F4  0F5  0F6  0F7  0F8  0F9  0F10 0F11",
    ]


def test_docs_show_the_generated_grids() -> None:
    docs = (DOCS / "reference" / "schedule-ir.md").read_text()
    assert docs.startswith("# Reference: the schedule IR\n") and "\n## The grid\n" in docs
    for name in TRAINING:
        assert format_grid(get_schedule(name, 4, 8)) in docs, (
            f"docs/reference/schedule-ir.md has a stale {name} grid"
        )


# -- memory ------------------------------------------------------------------------------------


def test_split_backward_holds_the_micro_batch_until_w() -> None:
    assert peak_inflight(sched("0F0 0I0 0F1 0W0 0I1 0W1")) == (2,)
    assert peak_inflight(sched("0F0 0I0 0W0 0F1 0I1 0W1")) == (1,)
    two_stages = sched("0F0 0F1 0I0 0I1 0W0 0W1", "1F0 1B0 1F1 1B1")
    assert peak_inflight(two_stages) == (2, 1)


def test_peak_inflight_per_rank_sums_a_rank_s_stages_in_its_own_order() -> None:
    v_shape = sched("0F0 3F0 3B0 0B0", "1F0 2F0 2B0 1B0", placement=(0, 1, 1, 0))
    assert peak_inflight(v_shape) == (1, 1, 1, 1)
    assert peak_inflight_per_rank(v_shape) == (2, 2)
    assert peak_inflight_per_rank(one_f_one_b(4, 8)) == peak_inflight(one_f_one_b(4, 8))
    assert peak_inflight_per_rank(forward_only(3, 4)) == (0, 0, 0)
    with pytest.raises(ScheduleError, match="deadlocks"):
        peak_inflight_per_rank(sched("0B0 0F0"))


# -- validate catches ------------------------------------------------------------------------


def test_validate_catches_a_missing_backward() -> None:
    schedule = one_f_one_b(3, 4)
    broken = Schedule((schedule.actions[0][:-1], *schedule.actions[1:]), (0, 1, 2), 4, name="1f1b")
    err = error_of(broken)
    message = str(err)
    assert message.startswith(
        "schedule '1f1b' (3 ranks, 3 stages, 4 micro-batches): never runs the backward"
    )
    assert "rank 0  0F0 0F1 0F2" in message and "<- missing 0B3" in message
    assert "Add 0B3 (or 0I3 then 0W3) to rank 0's list after 0F3." in message


def test_validate_catches_a_missing_backward_that_others_wait_for() -> None:
    rows = [" ".join(map(str, row)) for row in one_f_one_b(2, 4).actions]
    message = str(error_of(sched(rows[0], rows[1].replace(" 1B2", ""), name="1f1b")))
    assert (
        "never runs the backward of stage 1, micro-batch 2" in message
        and "<- missing 1B2" in message
    )


def test_validate_catches_a_backward_before_its_forward() -> None:
    err = error_of(sched("0F0 0F1 0B0 0B1", "1B0 1F0 1F1 1B1"))
    message = str(err)
    assert "deadlocks at step 2" in message
    assert (
        "rank 1 waits at 1B0 (position 0) for 1F0, which comes later in its own list (position 1); move 1F0 before 1B0."
        in message
    )
    assert (
        "rank 0 waits at 0B0 (position 2) for 1B0, rank 1's next action, which waits too."
        in message
    )
    assert (
        "rank 0   0F0  0F1 [0B0]                0B1\nrank 1            [1B0] 1F0  1F1  1B1\n"
        in message
    )
    assert (err.rank, err.step, err.action) == (0, 2, A("0B0"))


def test_validate_catches_an_action_on_the_wrong_rank() -> None:
    err = error_of(sched("0F0 1F0 0B0", "1B0"))
    assert (err.rank, err.action, err.step) == (0, A("1F0"), 1)
    message = str(err)
    assert (
        "rank 0 runs 1F0 (position 1 in its list), but stage 1 is on rank 1 (stage_to_rank=(0, 1))"
        in message
    )
    assert "rank 0   0F0 [1F0]      0B0" in message
    assert "Move 1F0 to rank 1's list" in message


def test_validate_catches_a_deadlocking_swap_with_grid_and_marker() -> None:
    swapped = sched("0F0 0B0 0F1 0B1", "1F0 1F1 1B0 1B1", name="gpipe")
    err = error_of(swapped)
    assert (err.step, err.rank, err.action) == (2, 0, A("0B0"))
    assert str(err) == (
        "schedule 'gpipe' (2 ranks, 2 stages, 2 micro-batches): deadlocks at step 2: no rank can run its next action.\n"
        "  rank 0 waits at 0B0 (position 1) for 1B0, which rank 1 runs later (position 2), "
        "behind its own waiting 1F1.\n"
        "  rank 1 waits at 1F1 (position 1) for 0F1, which rank 0 runs later (position 2), "
        "behind its own waiting 0B0.\n"
        "\n"
        "step     0    1    2    3    4    5\n"
        "rank 0   0F0      [0B0] 0F1       0B1\n"
        "rank 1        1F0 [1F1] 1B0  1B1\n"
        "\n"
        "Cells in [brackets] wait for an input that is never ready; the grid runs them anyway to draw "
        "the rest. Reorder the lists so that every action's inputs come first (an F after the previous "
        "stage's F, a B or I after the next stage's backward), e.g. start from get_schedule('1f1b', p, m)."
    )
    assert "[0B0]" in format_grid(swapped)  # the grid alone marks it too


@pytest.mark.parametrize(
    "schedule, match",
    [
        (
            sched("0F0 0B0", "1F0 1B0 1F0"),
            r"rank 1 runs 1F0 \(position 2 in its list\) a second time \(first at position 0\)",
        ),
        (sched("0F0 0B0", "1F0 1B0", m=1, placement=(0, 1)), None),
        (sched("0F0 0F1 0B0", "1F0 1B0", m=1), "there are only micro-batches 0..0"),
        (sched("0F0 0B0 2F0", "1F0 1B0"), r"2F0 .*there are only stages 0..1"),
        (
            sched("0F0 0B0", "1F0", forward_only=True),
            r"rank 0 runs 0B0 \(position 1 in its list\) in a forward-only schedule",
        ),
        (sched("0F0 0B0 0I0 0W0"), "runs both 0B0 and a split backward"),
        (sched("0F0 0I0"), "runs 0I0 but never 0W0"),
        (sched("0F0 0W0"), "runs 0W0 but never 0I0"),
        (
            sched("0F0 0W0 0I0"),
            r"waits at 0W0 \(position 1\) for 0I0, which comes later in its own list",
        ),
        (sched("0B0", m=2), "never runs 0F0"),
        (
            sched("0F0 0B0", "1F0 1B0", placement=(0, 2)),
            r"places stage 1 on rank 2, but there are ranks 0..1",
        ),
        (sched("0F0 0B0", "", placement=(0,)), "places no stage on rank 1"),
        (Schedule(((A("0F0"),),), (0,), 0), "has num_microbatches=0"),
        (Schedule((), (), 1), "is empty"),
    ],
)
def test_validate_catches(schedule: Schedule, match: str | None) -> None:
    if match is None:
        validate(schedule)
        return
    with pytest.raises(ScheduleError, match=match) as info:
        validate(schedule)
    assert isinstance(info.value, ValueError) and "step" in str(info.value)


@over_valid_schedules
def test_validate_agrees_with_an_independent_deadlock_check(
    schedule: Schedule, rnd: random.Random
) -> None:
    validate(schedule)
    rows = [list(row) for row in schedule.actions]
    rnd.shuffle(rows[rnd.randrange(len(rows))])
    shuffled = Schedule(
        tuples(rows), schedule.stage_to_rank, schedule.num_microbatches, schedule.forward_only
    )
    if deadlocks(shuffled):
        message = str(error_of(shuffled))
        assert "deadlocks at step" in message and "[" in message
    else:
        validate(shuffled)
        run_buffered(shuffled, comm_plan(shuffled), chain(shuffled.num_stages))


def _mutated(schedule: Schedule, rnd: random.Random) -> Schedule:
    """``schedule`` with one random slip: an action dropped, repeated, moved to another rank,
    pointed at a stage or micro-batch out of range, or given another kind."""
    rows = [list(row) for row in schedule.actions]
    r = rnd.randrange(len(rows))
    i = rnd.randrange(len(rows[r]))
    a = rows[r][i]
    S, m = schedule.num_stages, schedule.num_microbatches
    how = rnd.choice(["drop", "repeat", "move", "stage", "mb", "kind"])
    if how == "drop":
        del rows[r][i]
    elif how == "repeat":
        rows[rnd.randrange(len(rows))].append(a)
    elif how == "move":
        rows[rnd.randrange(len(rows))].append(rows[r].pop(i))
    elif how == "stage":
        rows[r][i] = Action(rnd.randrange(S + 2), a.kind, a.mb)
    elif how == "mb":
        rows[r][i] = Action(a.stage, a.kind, rnd.randrange(m + 2))
    else:
        rows[r][i] = Action(a.stage, rnd.choice(list(Kind)), a.mb)
    return Schedule(tuples(rows), schedule.stage_to_rank, m, schedule.forward_only)


@over_valid_schedules
def test_the_whole_list_check_agrees_with_the_action_by_action_checks(
    schedule: Schedule, rnd: random.Random
) -> None:
    """validate proves a schedule complete in whole-list passes (``_plainly_complete``) and
    explains a failure action by action: both must say the same of any slip."""
    from partitioner.schedule.actions import number
    from partitioner.schedule.validation import (
        _check_actions,
        _check_complete,
        _plainly_complete,
        _Report,
        _title,
    )

    for candidate in (schedule, _mutated(schedule, rnd)):
        numbered = number(candidate.actions, candidate.num_stages)
        report = _Report(candidate, numbered, _title(candidate))
        try:
            _check_complete(report, _check_actions(report))
            explained_fine = True
        except ScheduleError:
            explained_fine = False
        assert _plainly_complete(candidate, numbered) == explained_fine, str(candidate)


@quick
@given(st.lists(st.lists(actions.map(lambda a: Action(a.stage % 5, a.kind, a.mb % 4)), max_size=8),
                min_size=1, max_size=3), st.integers(1, 5))
def test_numbering_reads_what_dependencies_says(rows: list[list[Action]], S: int) -> None:
    """``number`` works on int codes; its reads are ``dependencies`` on any lists, repeated
    actions and stages out of range included."""
    from partitioner.schedule.actions import dependencies, number

    numbered = number(tuples(rows), S)
    present = {a for row in rows for a in row}
    assert list(numbered.actions) == list(dict.fromkeys(a for row in rows for a in row))
    assert [[numbered.actions[k] for k in row] for row in numbered.ids] == rows
    missing = numbered.missing
    for a, reads in zip(numbered.actions, numbered.reads):
        expected = list(dependencies(a, present, S))
        got = [numbered.actions[k] if k < missing else None for k in reads]
        assert got == [d if d in present else None for d in expected]
