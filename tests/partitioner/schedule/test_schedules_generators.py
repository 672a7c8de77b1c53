"""generators.py: GPipe, 1F1B, forward-only and interleaved 1F1B are valid and hold what they promise.

Legend: ``p`` ranks, ``m`` micro-batches, ``v`` chunks per rank, ``S = p * v`` stages, ``s`` a
stage, ``r`` a rank, ``mb`` a micro-batch, ``G`` the first micro-batch group's size.
"""

from __future__ import annotations

import pytest

from partitioner.schedule.actions import Kind
from partitioner.schedule.generators import _groups, forward_only, gpipe, interleaved, one_f_one_b
from partitioner.schedule.grid import format_grid
from partitioner.schedule.registry import get_schedule
from partitioner.schedule.validation import peak_inflight, peak_inflight_per_rank, validate
from schedule_cases import GRID, makespan

# -- GPipe, 1F1B, forward-only -----------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "forward"])
def test_generators_are_valid_on_the_whole_grid(name: str) -> None:
    for p, m in GRID:
        schedule = get_schedule(name, p, m)
        validate(schedule)
        assert schedule.stage_to_rank == tuple(range(p)) and schedule.num_microbatches == m
        assert schedule.name == name and schedule.forward_only == (name == "forward")
        per_rank = m if name == "forward" else 2 * m
        assert [len(row) for row in schedule.actions] == [per_rank] * p
        assert "[" not in format_grid(schedule)  # nothing was forced to run


def test_gpipe_holds_every_micro_batch_on_every_stage() -> None:
    for p, m in GRID:
        assert peak_inflight(gpipe(p, m)) == (m,) * p


def test_1f1b_holds_at_most_p_minus_s_micro_batches() -> None:
    for p, m in GRID:
        peak = peak_inflight(one_f_one_b(p, m))
        assert all(peak[s] <= min(m, p - s) for s in range(p)), (p, m, peak)
        assert peak == tuple(min(m, p - s) for s in range(p))  # and the bound is reached


def test_1f1b_shape_warm_up_steady_cool_down() -> None:
    for p, m in GRID:
        for s, row in enumerate(one_f_one_b(p, m).actions):
            kinds = "".join(a.kind.value for a in row)
            warmup = min(p - 1 - s, m)
            assert kinds == "F" * warmup + "FB" * (m - warmup) + "B" * warmup
            assert [a.mb for a in row if a.kind is Kind.FORWARD] == list(range(m))
            assert [a.mb for a in row if a.kind is Kind.BACKWARD] == list(range(m))


def test_forward_only_holds_nothing_and_runs_only_forwards() -> None:
    for p, m in GRID:
        schedule = forward_only(p, m)
        assert peak_inflight(schedule) == (0,) * p
        assert {a.kind for row in schedule.actions for a in row} == {Kind.FORWARD}


# -- interleaved 1F1B --------------------------------------------------------------------------

VS = (1, 2, 3)


def test_groups_are_consecutive_at_least_p_and_even() -> None:
    assert _groups(4, 8) == [range(4), range(4, 8)]
    assert _groups(4, 10) == [range(5), range(5, 10)]
    assert _groups(4, 11) == [range(6), range(6, 11)]
    assert _groups(4, 3) == [range(3)]
    for p, m in GRID:
        sizes = [len(g) for g in _groups(p, m)]
        assert [mb for g in _groups(p, m) for mb in g] == list(range(m))
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
        assert min(sizes) >= min(p, m)


def test_interleaved_is_valid_on_the_whole_grid() -> None:
    for p, m in GRID:
        for v in VS:
            schedule = interleaved(p, m, v)
            validate(schedule)
            assert schedule.stage_to_rank == tuple(s % p for s in range(p * v))
            assert schedule.name == "interleaved" and schedule.num_microbatches == m
            assert [len(row) for row in schedule.actions] == [2 * v * m] * p
            assert "[" not in format_grid(schedule)


def test_interleaved_with_one_chunk_is_1f1b() -> None:
    for p, m in GRID:
        assert interleaved(p, m, 1).actions == one_f_one_b(p, m).actions


def test_interleaved_runs_chunks_depth_first_over_groups() -> None:
    # p = 2, m = 4: groups (0, 1) and (2, 3); chunk 0 then chunk 1 of each group.
    forwards = [str(a) for a in interleaved(2, 4).actions[0] if a.kind is Kind.FORWARD]
    assert forwards == ["0F0", "0F1", "2F0", "2F1", "0F2", "0F3", "2F2", "2F3"]
    backwards = [str(a) for a in interleaved(2, 4).actions[0] if a.kind is Kind.BACKWARD]
    assert backwards == ["2B0", "2B1", "0B0", "0B1", "2B2", "2B3", "0B2", "0B3"]


def test_interleaved_bubble_is_v_times_smaller_in_unit_time() -> None:
    # Unit time: each chunk's F or B takes one step, 1/v of a whole stage's. Every rank works
    # 2 v m steps; the step takes 2 (v m + p - 1), so the bubble is (p - 1) / (v m + p - 1).
    for p, m in GRID:
        for v in VS:
            steps = makespan(interleaved(p, m, v))
            if m >= p:
                assert steps == 2 * (v * m + p - 1), (p, m, v)
            assert steps >= 2 * (v * m + p - 1)


def test_interleaved_holds_megatron_s_activations() -> None:
    # Rank r holds its warm-up forwards plus one, in chunks (1/v of the rank's layers each).
    for p, m in GRID:
        for v in (2, 3):
            G = len(_groups(p, m)[0])
            expected = tuple(min(v * m, (v - 1) * G + 2 * (p - 1 - r) + 1) for r in range(p))
            assert peak_inflight_per_rank(interleaved(p, m, v)) == expected, (p, m, v)
    # p divides m: rank 0 holds p + (p - 1) / v whole stages against 1F1B's p.
    assert peak_inflight_per_rank(interleaved(4, 8, 2)) == (11, 9, 7, 5)
    # Per stage, the first chunk holds more than the last: its backwards come last.
    assert peak_inflight(interleaved(4, 8, 2)) == (8, 8, 7, 5, 4, 4, 3, 1)


def test_interleaved_grid_p2_m4() -> None:
    assert format_grid(get_schedule("interleaved", 2, 4)) == (
        "step    0   1   2   3   4   5   6   7   8   9   10  11  12  13  14  15  16  17\n"
        "rank 0  0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1     2B2     2B3 0B2 0B3\n"
        "rank 1      1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3"
    )
