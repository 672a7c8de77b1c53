"""simulate.py: closed forms for the classic schedules, hand-computed links, and invariants on random ones.

Legend: ``p`` ranks, ``m`` micro-batches, ``v`` chunks per rank, ``S`` stages, ``s`` a stage,
``r`` a rank, ``mb`` a micro-batch; ``f``, ``b``, ``w`` forward, backward-input and
backward-weight seconds; ``L`` a link's latency.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from partitioner.schedule.actions import Action, Kind, dependencies
from partitioner.schedule.errors import ScheduleError, SimulationError
from partitioner.schedule.generators import gpipe, interleaved, one_f_one_b
from partitioner.schedule.ir import Schedule
from partitioner.schedule.registry import get_schedule
from partitioner.schedule.simulate import Link, Simulation, StageCosts, simulate
from partitioner.schedule.validation import peak_inflight_per_rank
from partitioner.schedule.zero_bubble import zbh1, zbv
from schedule_cases import GRID, makespan, quick, refuses, valid_schedules

F, B, I, W = Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT


def fused(S: int, f: float, b: float) -> StageCosts:
    """Costs for whole-backward schedules: B takes ``b`` (all of it the input part)."""
    return StageCosts.uniform(S, forward=f, backward_input=b, backward_weight=0.0)


# -- closed forms ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_take_m_plus_p_minus_1_slots(name: str) -> None:
    f, b = 1.5, 2.5
    for p, m in GRID:
        sim = simulate(get_schedule(name, p, m), fused(p, f, b))
        assert sim.step_time == (m + p - 1) * (f + b)
        assert sim.bubble == pytest.approx(((p - 1) / (m + p - 1),) * p)
        assert sim.bubble_total == pytest.approx((p - 1) / (m + p - 1))
        assert not sim.timeline.messages or p > 1


def test_split_costs_add_up_for_a_fused_backward() -> None:
    split = StageCosts.uniform(3, forward=1.0, backward_input=1.25, backward_weight=0.75)
    assert simulate(one_f_one_b(3, 5), split).step_time == 7 * 3.0


def test_interleaved_bubble_shrinks_by_v() -> None:
    # A chunk holds 1/v of a rank's layers: f / v and b / v per chunk, f == b.
    f = b = 1.0
    for p, m in GRID:
        if m < p:
            continue
        for v in (1, 2, 3):
            sim = simulate(interleaved(p, m, v), fused(p * v, f / v, b / v))
            assert sim.step_time == pytest.approx((m + (p - 1) / v) * (f + b))
            assert sim.bubble == pytest.approx(((p - 1) / (v * m + p - 1),) * p)


def test_zbh1_bubble_is_below_1f1b_s_with_equal_f_b_w() -> None:
    costs = StageCosts.uniform  # F = I = W = 1; 1F1B's fused B costs 2
    for p, m in GRID:
        ours, theirs = simulate(zbh1(p, m), costs(p)), simulate(one_f_one_b(p, m), costs(p))
        if p > 1:
            assert ours.bubble_total < theirs.bubble_total, (p, m)
        if m >= p:
            assert ours.step_time == 3 * m + p - 1
            assert max(ours.bubble) == pytest.approx((p - 1) / (3 * m + p - 1))


def test_zbv_bubble_is_near_zero() -> None:
    half = StageCosts.uniform  # each chunk is half a stage: F = I = W = 1/2
    for p, m in GRID:
        sim = simulate(zbv(p, m), half(2 * p, forward=0.5, backward_input=0.5, backward_weight=0.5))
        if m >= 2 * p - 1:  # only the p - 1 half-steps before rank p - 1's first input
            assert sim.step_time == 3 * m + (p - 1) / 2
            assert sim.bubble_total == pytest.approx((p - 1) / (6 * m + p - 1))
        if m >= p > 1:
            h1 = simulate(zbh1(p, m), StageCosts.uniform(p))
            assert sim.step_time <= h1.step_time
    assert (
        simulate(
            zbv(4, 16), half(8, forward=0.5, backward_input=0.5, backward_weight=0.5)
        ).bubble_total
        < 0.05
    )


# -- communication -----------------------------------------------------------------------------


def test_latency_adds_two_hops_to_a_two_stage_gpipe() -> None:
    # Hand-computed, f = b = 1, m = 2: rank 1 starts at 1 + L; the gradients land 4 + 2L, 5 + 2L.
    for L in (0.0, 0.25, 1.0, 3.0):
        sim = simulate(gpipe(2, 2), fused(2, 1.0, 1.0), links=Link(latency=L))
        assert sim.step_time == 6 + 2 * L
        assert [(x.label, x.start) for x in sim.timeline.of_rank(1)] == [
            ("1F0", 1 + L), ("1F1", 2 + L), ("1B0", 3 + L), ("1B1", 4 + L)
        ]  # fmt: skip


def test_bandwidth_serialises_messages_on_a_link() -> None:
    # f = 0.5, b = 2; 1 MB at 1 MB/s plus 0.5 s latency: 1.5 s a message, and the second
    # activation leaves only when the first is off the link (at 1.5, not at 1.0).
    costs = StageCosts((0.5, 0.5), (2.0, 2.0), (0.0, 0.0), output_bytes=(1e6,))
    sim = simulate(gpipe(2, 2), costs, links=[Link(latency=0.5, bandwidth=1e6)])
    spans = [(x.rank, x.label, x.start, x.end) for x in sim.timeline.spans]
    assert spans == [
        (0, "0F0", 0.0, 0.5), (0, "0F1", 0.5, 1.0), (0, "0B0", 7.0, 9.0), (0, "0B1", 9.0, 11.0),
        (1, "1F0", 2.0, 2.5), (1, "1F1", 3.0, 3.5), (1, "1B0", 3.5, 5.5), (1, "1B1", 5.5, 7.5),
    ]  # fmt: skip
    messages = [(x.src, x.dst, x.what, x.mb, x.send, x.recv) for x in sim.timeline.messages]
    assert messages == [
        (0, 1, "act", 0, 0.5, 2.0), (0, 1, "act", 1, 1.0, 3.0),
        (1, 0, "grad", 0, 5.5, 7.0), (1, 0, "grad", 1, 7.5, 9.0),
    ]  # fmt: skip
    assert all(x.nbytes == 1e6 for x in sim.timeline.messages)
    assert sim.step_time == 11.0 and sim.bubble == pytest.approx((6 / 11, 6 / 11))


def test_stages_on_one_rank_hand_over_for_free() -> None:
    slow = Link(latency=100.0, bandwidth=1.0)
    for m in (1, 3, 8):
        for schedule in (zbv(1, m), interleaved(1, m, 3)):
            costs = StageCosts.uniform(schedule.num_stages, output_bytes=1e3)
            sim = simulate(schedule, costs, links=slow)
            assert sim.timeline.messages == () and sim.bubble == (0.0,)
            assert sim.step_time == sum(costs.duration(a) for a in schedule.actions[0])
    # ZB-V's turn (stage p - 1 to p) stays on rank p - 1: no message crosses it.
    sim = simulate(zbv(3, 5), StageCosts.uniform(6), links=Link(latency=1.0))
    assert {(x.src_stage, x.dst_stage) for x in sim.timeline.messages} == {
        (s, s + 1) for s in range(5) if s != 2
    } | {(s + 1, s) for s in range(5) if s != 2}


def test_per_boundary_links() -> None:
    links = [Link(latency=0.0), Link(latency=10.0)]  # only boundary 1 (stage 1 -> 2) is slow
    sim = simulate(gpipe(3, 1), fused(3, 1.0, 1.0), links=links)
    assert sim.step_time == 6 + 2 * 10.0


# -- memory ------------------------------------------------------------------------------------


def test_peak_inflight_matches_the_list_count_and_bytes_follow_stages() -> None:
    for name, kw in [("gpipe", {}), ("1f1b", {}), ("interleaved", {"v": 2}), ("zbh1", {}),
                     ("zbv", {})]:  # fmt: skip
        for p, m in GRID:
            schedule = get_schedule(name, p, m, **kw)
            sim = simulate(schedule, StageCosts.uniform(schedule.num_stages))
            assert sim.peak_inflight == peak_inflight_per_rank(schedule), (name, p, m)
            assert sim.peak_bytes is None and sim.max_peak_bytes is None
    costs = StageCosts.uniform(4)
    costs = StageCosts(costs.forward, costs.backward_input, costs.backward_weight, (10, 20, 30, 40))
    sim = simulate(one_f_one_b(4, 8), costs)
    assert sim.peak_inflight == (4, 3, 2, 1)
    assert sim.peak_bytes == (40, 60, 60, 40) and sim.max_peak_bytes == 60
    assert simulate(get_schedule("forward", 3, 4), StageCosts.uniform(3)).peak_inflight == (0,) * 3


# -- input errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: StageCosts((1.0,), (1.0, 1.0), (1.0,)), r"backward_input has 2 entries but needs 1"),
        (lambda: StageCosts((1.0,), (-1.0,), (1.0,)), r"backward_input\[0\] = -1.0: use a number >= 0"),
        (lambda: StageCosts((math.nan,), (1.0,), (1.0,)), r"forward\[0\] = nan"),
        (lambda: StageCosts((math.inf,), (1.0,), (1.0,)), r"forward\[0\] = inf: use a finite"),
        (lambda: StageCosts((True,), (1.0,), (1.0,)), r"forward\[0\] = True"),
        (lambda: StageCosts.uniform(3, output_bytes=1.0).__class__((1.0,) * 3, (1.0,) * 3, (1.0,) * 3,
                                                                    None, (1.0,)),
         "output_bytes has 1 entries but needs 2, one per boundary"),
        (lambda: StageCosts.uniform(2, activation_bytes=-1.0), r"activation_bytes\[0\] = -1.0"),
        (lambda: Link(bandwidth=0.0), r"bandwidth = 0.0: use a number > 0"),
        (lambda: Link(latency=-1e-6), r"latency = -1e-06: use a number >= 0"),
    ],
)  # fmt: skip
def test_costs_and_links_say_what_is_wrong(build: Callable[[], object], match: str) -> None:
    refuses(SimulationError, build, match)


def test_simulate_checks_the_schedule_and_its_fit() -> None:
    with pytest.raises(SimulationError, match="costs are for 3 stages but schedule '1f1b' has 4"):
        simulate(one_f_one_b(4, 4), StageCosts.uniform(3))
    with pytest.raises(SimulationError, match="links has 2 entries but the schedule has 3 bound"):
        simulate(one_f_one_b(4, 4), StageCosts.uniform(4), links=[Link(), Link()])
    broken = Schedule(((Action(0, B, 0), Action(0, F, 0)),), (0,), 1)
    with pytest.raises(ScheduleError, match="deadlocks"):
        simulate(broken, StageCosts.uniform(1))


# -- invariants on random schedules ------------------------------------------------------------

durations = st.floats(0.0, 10.0, allow_nan=False)


@st.composite
def cases(draw: st.DrawFn) -> tuple[Schedule, StageCosts, list[Link]]:
    schedule = draw(valid_schedules())
    S = schedule.num_stages
    per_stage = st.lists(durations, min_size=S, max_size=S)
    costs = StageCosts(
        tuple(draw(per_stage)),
        tuple(draw(per_stage)),
        tuple(draw(per_stage)),
        tuple(draw(st.lists(st.floats(0.0, 1e9), min_size=S, max_size=S))),
        tuple(draw(st.lists(st.floats(0.0, 1e6), min_size=S - 1, max_size=S - 1))),
    )
    links = draw(
        st.lists(
            st.builds(Link, st.floats(0.0, 5.0), st.sampled_from([math.inf, 1e5, 1e6, 1e7])),
            min_size=S - 1,
            max_size=S - 1,
        )
    )
    return schedule, costs, links


def _critical_path(schedule: Schedule, costs: StageCosts, links: list[Link]) -> float:
    """Longest dependency chain: compute and an idle link's transfer on every cross-rank edge."""
    present = {a for row in schedule.actions for a in row}
    place, out = schedule.stage_to_rank, costs.output_bytes or ()
    done: dict[Action, float] = {}

    def finish(a: Action) -> float:
        if a not in done:
            start = 0.0
            for d in dependencies(a, present, schedule.num_stages):
                hop = 0.0
                if place[d.stage] != place[a.stage]:
                    boundary = min(d.stage, a.stage)
                    hop = links[boundary].transfer_time(out[boundary])
                start = max(start, finish(d) + hop)
            done[a] = start + costs.duration(a)
        return done[a]

    return max((finish(a) for a in present), default=0.0)


@quick
@given(cases())
def test_random_schedules_obey_the_model(case: tuple[Schedule, StageCosts, list[Link]]) -> None:
    schedule, costs, links = case
    sim = simulate(schedule, costs, links=links)
    assert isinstance(sim, Simulation) and sim == simulate(schedule, costs, links=links)
    timeline = sim.timeline
    # Every action exactly once, on its rank, in its list's order, one at a time, for its cost.
    for r, row in enumerate(schedule.actions):
        spans = sorted(timeline.of_rank(r), key=lambda x: x.start)
        assert [x.action for x in spans] == list(row)
        assert all(x.duration == pytest.approx(costs.duration(x.action)) for x in spans)
        assert all(a.end <= b.start for a, b in itertools.pairwise(spans))
    assert len(timeline.spans) == sum(map(len, schedule.actions))
    # Nothing starts before its inputs are there.
    begin = {x.action: x for x in timeline.spans}
    arrival = {(x.src_stage, x.kind, x.mb, x.dst_stage): x.recv for x in timeline.messages}
    present = set(begin)
    for x in timeline.spans:
        for d in dependencies(x.action, present, schedule.num_stages):
            there = arrival.get((d.stage, d.kind, d.mb, x.stage), begin[d].end)
            assert x.start >= there - 1e-9
    # Bounds on the makespan.
    assert sim.step_time >= max(timeline.busy) - 1e-9
    assert sim.step_time >= _critical_path(schedule, costs, links) - 1e-6
    assert all(0.0 <= x <= 1.0 + 1e-12 for x in sim.bubble)
    assert sim.peak_inflight == peak_inflight_per_rank(schedule)


@quick
@given(valid_schedules())
def test_unit_costs_agree_with_an_independent_list_run(schedule: Schedule) -> None:
    sim = simulate(schedule, StageCosts.uniform(schedule.num_stages))
    assert sim.step_time == makespan(schedule, {B: 2})


# -- the counted metrics and the timeline -----------------------------------------------------


@quick
@given(cases(), st.data())
def test_counted_metrics_are_the_timeline_s_bit_for_bit(
    case: tuple[Schedule, StageCosts, list[Link]], data: st.DataObject
) -> None:
    """simulate counts its metrics during the run and builds the timeline only when asked: the
    numbers are the ones ``Timeline`` computes from the spans, to the last bit, replayed bytes
    (recomputing stages) and stages without byte sizes included."""
    schedule, costs, links = case
    S = schedule.num_stages
    replay = data.draw(st.none() | st.lists(st.floats(0.0, 1e9), min_size=S, max_size=S).map(tuple))
    act = data.draw(st.sampled_from([costs.activation_bytes, None]))
    costs = StageCosts(costs.forward, costs.backward_input, costs.backward_weight, act, costs.output_bytes, replay)
    sim = simulate(schedule, costs, links=links)
    t = sim.timeline
    counted = (sim.step_time, sim.bubble, sim.bubble_total, sim.peak_inflight, sim.peak_bytes, sim.busy)
    timed = (t.step_time, t.bubble, t.bubble_total, t.peak_inflight, t.peak_bytes, t.busy)
    assert repr(counted) == repr(timed)  # repr: equal bits, -0.0 and 0.0 told apart
    assert sim.timeline is t  # built once


def test_a_stalled_run_says_where_the_lists_deadlock() -> None:
    """The simulator proves a schedule deadlock-free by running it; when it stalls, the error is
    validate's, with the grid."""
    crossed = Schedule(
        ((Action(0, F, 0), Action(0, B, 0), Action(0, F, 1), Action(0, B, 1)),
         (Action(1, F, 1), Action(1, F, 0), Action(1, B, 0), Action(1, B, 1))),
        (0, 1), 2,
    )  # fmt: skip
    with pytest.raises(ScheduleError, match="deadlocks at step") as info:
        simulate(crossed, StageCosts.uniform(2))
    assert "rank 1 waits at 1F1" in str(info.value)


def test_a_schedule_is_checked_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A frozen schedule is numbered and checked once, however often it is simulated or counted;
    a run that completes stands in for the unit-time deadlock check."""
    import partitioner.schedule.validation as validation

    calls = {"number": 0, "unit_run": 0}

    def counting(name: str, fn: object) -> object:
        def wrapped(*args: object, **kwargs: object) -> object:
            calls[name] += 1
            return fn(*args, **kwargs)  # type: ignore[operator]

        return wrapped

    monkeypatch.setattr(validation, "number", counting("number", validation.number))
    monkeypatch.setattr(validation, "unit_run", counting("unit_run", validation.unit_run))
    schedule = zbh1(3, 5)
    first = simulate(schedule, StageCosts.uniform(3))
    assert calls == {"number": 1, "unit_run": 0}
    validation.validate(schedule)
    validation.peak_inflight(schedule)
    assert simulate(schedule, StageCosts.uniform(3)) == first
    assert calls == {"number": 1, "unit_run": 0}
    # An equal schedule built again is another object: checked again.
    simulate(zbh1(3, 5), StageCosts.uniform(3))
    assert calls == {"number": 2, "unit_run": 0}
    validation.validate(gpipe(2, 2))
    assert calls == {"number": 3, "unit_run": 1}
