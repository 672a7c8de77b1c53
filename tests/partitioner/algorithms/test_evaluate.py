"""evaluate / lower_bound / check_assignment: hand-checked costs and the validity rules."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from algo_cases import all_assignments, brute_best, examples, forward_valid, is_valid, problems
from partitioner.algorithms import Partition, Problem, Tensor, check_assignment, evaluate, lower_bound
from partitioner.errors import PartitionError

INF = math.inf


def worked_example() -> Problem:
    """Five units on three stages; unit 0's output skips to unit 4 across both boundaries.

    stages: [0, 1] | [2, 3] | [4]
    tensors: 0 -> (1, 4) 100 B (the skip), 1 -> 2 40 B, 2 -> 3 7 B, 3 -> (4, out) 10 B,
             input -> (0, 3) never crosses, 4 -> out stays on the last stage.
    """
    return Problem(
        compute=((1.0, 2.0, 3.0, 4.0, 5.0), (2.0, 4.0, 6.0, 8.0, 10.0), (0.5, 1.0, 1.5, 2.0, 2.5)),
        state_bytes=(10.0, 20.0, 30.0, 40.0, 50.0),
        act_bytes=(1.0, 2.0, 3.0, 4.0, 5.0),
        tensors=(Tensor(0, (1, 4), 100.0), Tensor(1, (2,), 40.0), Tensor(2, (3,), 7.0),
                 Tensor(3, (4, 5), 10.0), Tensor(-1, (0, 3), 1000.0), Tensor(4, (5,), 8.0)),
        capacity=(40.0, 100.0, 60.0),
        inflight=(3, 2, 1),
        link_bandwidth=(10.0, 100.0),
        link_latency=(1.0, 0.5),
    )


def test_worked_example_by_hand() -> None:
    ev = evaluate(worked_example(), [0, 0, 1, 1, 2])
    # boundary 0|1: skip 100 + 1->2 40 = 140 B -> 1 + 140/10 = 15 s
    # boundary 1|2: skip 100 + 3->4 10 = 110 B -> 0.5 + 110/100 = 1.6 s
    assert ev.boundary_bytes == (140.0, 110.0)
    assert ev.compute == (3.0, 6.0 + 8.0, 2.5)
    assert ev.transfer_in == (0.0, 15.0, pytest.approx(1.6))
    assert ev.transfer_out == (15.0, pytest.approx(1.6), 0.0)
    assert ev.time == pytest.approx((18.0, 30.6, 4.1))
    assert ev.bottleneck == pytest.approx(30.6) and ev.bottleneck_stage == 1
    # memory: state + inflight * act
    assert ev.memory == (30.0 + 3 * 3.0, 70.0 + 2 * 7.0, 50.0 + 1 * 5.0)
    assert ev.memory == (39.0, 84.0, 55.0)
    assert ev.feasible


def test_worked_example_memory_over_by_one_is_infeasible() -> None:
    pb = worked_example()
    tight = Problem(**{**pb.__dict__, "capacity": (38.0, 100.0, 60.0)})
    assert not evaluate(tight, [0, 0, 1, 1, 2]).feasible
    assert evaluate(pb, [0, 0, 1, 1, 2]).feasible


def test_non_contiguous_assignment_and_output_on_last_stage() -> None:
    pb = worked_example()
    # units 1, 2 on stage 1, unit 3 on stage 2: the skip still crosses both boundaries,
    # 1 -> 2 stays inside stage 1 and 2 -> 3 crosses the second boundary
    ev = evaluate(pb, [0, 1, 1, 2, 2])
    assert ev.boundary_bytes == (100.0, 100.0 + 7.0)
    # unit 3 on stage 0 while unit 2 is on stage 1: its output (to unit 4 and the graph output)
    # crosses both boundaries; the backward edge 2 -> 3 crosses nothing
    ev = evaluate(pb, [0, 0, 1, 0, 2])
    assert ev.boundary_bytes == (100.0 + 40.0 + 10.0, 100.0 + 10.0)


def test_zero_bytes_cost_no_latency_and_single_stage() -> None:
    pb = Problem(compute=((1.0, 1.0),) * 2, state_bytes=(0, 0), act_bytes=(0, 0),
                 tensors=(Tensor(0, (1,), 0.0),), capacity=(1, 1), inflight=(1, 1),
                 link_bandwidth=(1.0,), link_latency=(5.0,))
    assert evaluate(pb, [0, 1]).time == (1.0, 1.0)
    one = Problem(compute=((1.0, 2.0),), state_bytes=(0, 0), act_bytes=(0, 0),
                  tensors=(Tensor(0, (1, 2), 9.0),), capacity=(INF,), inflight=(1,),
                  link_bandwidth=(), link_latency=())
    ev = evaluate(one, Partition((0, 0), "x"))
    assert ev.boundary_bytes == () and ev.time == (3.0,) and ev.bottleneck == 3.0


@pytest.mark.parametrize("assignment", [[0, 0, 1, 1], [0, 0, 1, 3, 2], [0, -1, 1, 1, 2], [0, 0.5, 1, 1, 2]])
def test_malformed_assignments_are_rejected(assignment: list) -> None:
    with pytest.raises(PartitionError):
        evaluate(worked_example(), assignment)


def test_check_assignment_names_the_problem() -> None:
    pb = worked_example()
    check_assignment(pb, [0, 0, 1, 1, 2])
    with pytest.raises(PartitionError, match=r"stages \[1\] hold no unit"):
        check_assignment(pb, [0, 0, 2, 2, 2])
    with pytest.raises(PartitionError, match=r"unit 1 \(stage 0\) reads the output of unit 0 \(stage 1\)"):
        check_assignment(pb, [1, 0, 1, 1, 2])
    cut = Problem(**{**pb.__dict__, "cuts": (2, 4)})
    check_assignment(cut, [0, 0, 1, 1, 2])
    with pytest.raises(PartitionError, match="position 3, which is not an allowed cut"):
        check_assignment(cut, [0, 0, 1, 2, 2])
    named = Problem(**{**pb.__dict__, "names": ("emb", "a", "b", "c", "head")})
    with pytest.raises(PartitionError, match="emb"):
        check_assignment(named, [1, 0, 1, 1, 2])


@settings(max_examples=examples(150), deadline=None)
@given(problems(max_n=6, max_p=3))
def test_check_assignment_matches_an_independent_statement(pb: Problem) -> None:
    import itertools

    for stage in itertools.product(range(pb.p), repeat=pb.n):
        assert is_valid(pb, Partition(stage, "x")) == forward_valid(pb, stage), stage


def test_lower_bound_is_the_brief_formula_for_proportional_rows() -> None:
    w = (3.0, 1.0, 4.0, 1.0, 5.0)
    rows = tuple(tuple(x * r for x in w) for r in (1.0, 2.0, 0.5))
    pb = Problem(compute=rows, state_bytes=(0,) * 5, act_bytes=(0,) * 5, tensors=(),
                 capacity=(INF,) * 3, inflight=(1,) * 3, link_bandwidth=(1.0,) * 2, link_latency=(0.0,) * 2)
    formula = max(1 / sum(1 / sum(row) for row in rows), max(min(col) for col in zip(*rows)))
    assert lower_bound(pb) == pytest.approx(formula, rel=1e-12)
    # row sums 14, 28, 7: 1 / (1/14 + 1/28 + 1/7) = 4; the largest unit on its fastest device: 2.5
    assert lower_bound(pb) == pytest.approx(4.0, rel=1e-12)
    few = Problem(**{**pb.__dict__, "compute": rows[:1], "capacity": (INF,), "inflight": (1,),
                     "link_bandwidth": (), "link_latency": ()})
    assert lower_bound(few) == 14.0


def test_lower_bound_stays_a_bound_for_unrelated_devices() -> None:
    # each unit is fast on a different device: the plain work/speed formula (50.5) would exceed 1
    pb = Problem(compute=((1.0, 100.0), (100.0, 1.0)), state_bytes=(0, 0), act_bytes=(0, 0),
                 tensors=(), capacity=(INF, INF), inflight=(1, 1), link_bandwidth=(INF,), link_latency=(0.0,))
    assert evaluate(pb, [0, 1]).bottleneck == 1.0
    assert lower_bound(pb) <= 1.0


@settings(max_examples=examples(150), deadline=None)
@given(problems(max_n=6, max_p=3, memory=False))
def test_lower_bound_never_exceeds_any_valid_assignment(pb: Problem) -> None:
    bound = lower_bound(pb)
    for stage in all_assignments(pb):
        assert bound <= evaluate(pb, stage).bottleneck * (1 + 1e-9) + 1e-12
    contiguous = brute_best(pb)
    if contiguous is not None:
        assert bound <= contiguous * (1 + 1e-9) + 1e-12


def test_lower_bound_of_an_empty_or_free_problem() -> None:
    pb = Problem(compute=((0.0, 0.0),), state_bytes=(0, 0), act_bytes=(0, 0), tensors=(),
                 capacity=(INF,), inflight=(1,), link_bandwidth=(), link_latency=())
    assert lower_bound(pb) == 0.0


@settings(deadline=None)
@given(st.floats(0, 1e12), st.floats(1e-3, 1e12), st.floats(0, 1))
def test_link_time(nbytes: float, bw: float, lat: float) -> None:
    from partitioner.algorithms.evaluate import link_time

    t = link_time(nbytes, bw, lat)
    assert t == (0.0 if nbytes == 0 else lat + nbytes / bw)
    assert link_time(1.0, 0.0, lat) == INF
