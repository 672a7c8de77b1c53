"""The schedule registry is the one place each schedule's facts live, and every reader agrees with it."""

from __future__ import annotations

import pytest

from partitioner.plan.predict import stage_inflight
from partitioner.schedule.actions import Kind
from partitioner.schedule.errors import PipecutError, ScheduleError, UnknownScheduleError
from partitioner.schedule.registry import (
    SCHEDULES,
    TRAINING_SCHEDULES,
    get_schedule,
    placement,
    schedule_info,
    schedule_names,
    stage_schedule,
    stages_per_rank,
)
from partitioner.schedule.validation import validate
from runtime.transport.placement import PlacementError, placed_schedule


@pytest.mark.parametrize("info", SCHEDULES, ids=lambda i: i.name)
def test_each_row_describes_what_its_generator_builds(info: object) -> None:
    from partitioner.schedule.registry import ScheduleInfo

    assert isinstance(info, ScheduleInfo)
    p, m = 3, 6
    sched = stage_schedule(info.name, p * info.stages_per_rank, m)
    validate(sched)
    assert sched.name == info.name
    assert sched.num_ranks == p and sched.num_stages == p * info.stages_per_rank
    kinds = {a.kind for row in sched.actions for a in row}
    assert (Kind.BACKWARD_WEIGHT in kinds) == info.split_backward
    assert (kinds != {Kind.FORWARD}) == info.trains
    assert sched.forward_only == (not info.trains)
    for alias in info.aliases:
        assert schedule_info(alias.upper()) is info


def test_names_aliases_and_training_order() -> None:
    assert schedule_names() == tuple(i.name for i in SCHEDULES)
    assert schedule_names(training=True) == TRAINING_SCHEDULES == ("1f1b", "zbh1", "interleaved", "zbv", "gpipe")
    assert "forward" not in TRAINING_SCHEDULES
    assert [stages_per_rank(n) for n in TRAINING_SCHEDULES] == [1, 1, 2, 2, 1]
    with pytest.raises(UnknownScheduleError, match="did you mean 'zbv'"):
        schedule_info("zvb")


def test_placement_rules_come_from_the_row() -> None:
    assert placement("interleaved", 6, 3) == (2, 3)
    assert placement("zbv", 8) == (4, 2)
    with pytest.raises(ScheduleError, match="exactly 2 stages per rank") as info:
        placement("zbv", 6, 3)
    assert isinstance(info.value, PipecutError) and isinstance(info.value, ValueError)
    with pytest.raises(ScheduleError, match=r"one stage per rank.*schedule='interleaved'"):
        placement("1f1b", 4, 2)
    with pytest.raises(ScheduleError, match="partition into 4 or 6 stages"):
        placement("interleaved", 5)
    with pytest.raises(ScheduleError, match="int >= 1"):
        placement("interleaved", 4, 0)


def test_planner_and_runtime_place_stages_alike() -> None:
    # The runtime's placement and the planner's are the registry's: the same schedule, rank for rank.
    for name in TRAINING_SCHEDULES:
        S = 2 * stages_per_rank(name) * 2
        assert placed_schedule(name, S, 8) == stage_schedule(name, S, 8) == get_schedule(
            name, S // stages_per_rank(name), 8, **({"v": 2} if name == "interleaved" else {})
        )
        assert len(stage_inflight(name, S, 8)) == S
    with pytest.raises(PlacementError, match="partition into 2 or 4 stages"):
        placed_schedule("zbv", 3, 4)


@pytest.mark.parametrize("enabled", [True, False])
def test_building_leaves_the_garbage_collector_as_it_found_it(enabled: bool) -> None:
    """The registry pauses the cyclic collector while a generator builds (fewer collections on a
    million new objects) and restores it, also when the generator raises."""
    import gc

    from partitioner.schedule.errors import ScheduleError
    from partitioner.schedule.registry import get_schedule, stage_schedule

    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        stage_schedule("zbv", 4, 3)
        get_schedule("1f1b", 2, 2)
        with pytest.raises(ScheduleError):
            get_schedule("1f1b", 2, 0)
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
