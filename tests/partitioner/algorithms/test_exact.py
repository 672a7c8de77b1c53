"""exact: equal to brute force on small problems, to an independent DP at transformer size.

Run as a script to time it: ``python tests/partitioner/algorithms/test_exact.py``.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings

from algo_cases import brute_best, contiguous_partitions, dp_best, examples, is_valid, problems, transformer_problem
from partitioner.algorithms import Partition, Problem, Tensor, evaluate, exact, lower_bound
from partitioner.errors import InfeasibleMemoryError, PartitionError, TooManyStagesError

INF = math.inf


@settings(max_examples=examples(400), deadline=None)
@given(problems())
def test_exact_equals_brute_force(pb: Problem) -> None:
    blocks = len(set(pb.allowed_cuts())) + 1
    if pb.p > blocks:
        with pytest.raises(TooManyStagesError):
            exact(pb)
        return
    best = brute_best(pb)
    if best is None:
        with pytest.raises(InfeasibleMemoryError):
            exact(pb)
        return
    part = exact(pb)
    assert part.method == "exact"
    assert is_valid(pb, part)
    assert list(part.assignment) == sorted(part.assignment)  # contiguous
    ev = evaluate(pb, part)
    assert ev.feasible
    assert ev.bottleneck == pytest.approx(best, rel=1e-9, abs=1e-12)


@settings(max_examples=examples(100), deadline=None)
@given(problems(max_n=8, max_p=3))
def test_independent_dp_agrees_with_brute_force(pb: Problem) -> None:
    """The reference DP used at large sizes is itself checked here."""
    if pb.p > len(set(pb.allowed_cuts())) + 1:
        return
    best = brute_best(pb)
    got = dp_best(pb)
    assert (got is None) == (best is None)
    if got is not None:
        assert got[0] == pytest.approx(best, rel=1e-9, abs=1e-12)
        ev = evaluate(pb, Partition.from_cuts(got[1], pb.n, "dp"))
        assert ev.feasible and ev.bottleneck == pytest.approx(best, rel=1e-9, abs=1e-12)


def test_boundary_cost_is_not_monotone_and_exact_finds_the_cheap_cut() -> None:
    # Unit 1's output is read by units 2 and 3, so positions 2 and 3 carry 50 bytes and 1 and 4
    # carry 1. A probe that extends stage 0 while it fits the threshold 4.1 stops at position 1
    # (position 2 costs 2 + 5) and then fails; the optimum cuts at 4.
    pb = Problem(
        compute=((1.0, 1.0, 1.0, 1.0, 1.0, 1.0),) * 2, state_bytes=(0,) * 6, act_bytes=(0,) * 6,
        tensors=(Tensor(0, (1,), 1.0), Tensor(1, (2, 3), 50.0), Tensor(2, (3,), 1.0),
                 Tensor(3, (4,), 1.0), Tensor(4, (5,), 1.0)),
        capacity=(INF, INF), inflight=(1, 1), link_bandwidth=(10.0,), link_latency=(0.0,),
    )
    costs = {part.cuts(): evaluate(pb, part).bottleneck for part in contiguous_partitions(pb)}
    assert costs == pytest.approx({(1,): 5.1, (2,): 9.0, (3,): 8.1, (4,): 4.1, (5,): 5.1})
    assert exact(pb).cuts() == (4,)


def test_heterogeneous_devices_get_more_work_on_the_fast_one() -> None:
    pb = Problem(compute=((1.0,) * 8, (3.0,) * 8), state_bytes=(0,) * 8, act_bytes=(0,) * 8,
                 tensors=(), capacity=(INF, INF), inflight=(1, 1), link_bandwidth=(1.0,), link_latency=(0.0,))
    assert exact(pb).cuts() == (6,)  # 6 x 1 vs 2 x 3
    swapped = Problem(**{**pb.__dict__, "compute": pb.compute[::-1]})
    assert exact(swapped).cuts() == (2,)


def test_memory_decides_the_cut() -> None:
    pb = Problem(compute=((1.0,) * 6,) * 2, state_bytes=(5, 5, 1, 1, 1, 1), act_bytes=(0,) * 6,
                 tensors=(), capacity=(INF, INF), inflight=(1, 1), link_bandwidth=(1.0,), link_latency=(0.0,))
    assert exact(pb).cuts() == (3,)
    tight = Problem(**{**pb.__dict__, "capacity": (INF, 2.0)})
    assert exact(tight).cuts() == (4,)  # the last stage holds at most two 1-byte units


def test_too_many_stages() -> None:
    pb = Problem(compute=((1.0,) * 3,) * 4, state_bytes=(0,) * 3, act_bytes=(0,) * 3, tensors=(),
                 capacity=(INF,) * 4, inflight=(1,) * 4, link_bandwidth=(1.0,) * 3, link_latency=(0.0,) * 3)
    with pytest.raises(TooManyStagesError, match=r"stages: 4, units: 3"):
        exact(pb)
    pb3 = Problem(**{**pb.__dict__, "compute": pb.compute[:3], "capacity": (INF,) * 3,
                     "inflight": (1,) * 3, "link_bandwidth": (1.0,) * 2, "link_latency": (0.0,) * 2,
                     "cuts": (2,)})
    with pytest.raises(TooManyStagesError, match="granularity='node'"):
        exact(pb3)


def test_infeasible_memory_reports_the_closest_partition() -> None:
    # 4 units of 4 bytes on 2 devices of 6 bytes: any split puts 8 bytes somewhere.
    pb = Problem(compute=((1.0,) * 4,) * 2, state_bytes=(4.0,) * 4, act_bytes=(0,) * 4, tensors=(),
                 capacity=(6.0, 6.0), inflight=(1, 1), link_bandwidth=(1.0,), link_latency=(0.0,),
                 names=("a", "b", "c", "d"))
    with pytest.raises(InfeasibleMemoryError) as info:
        exact(pb)
    err = info.value
    assert err.needed == [8.0, 8.0] and err.available == [6.0, 6.0]
    assert "1.33x the capacity of stage 0 (a .. b)" in str(err)
    # unequal devices: the closest split puts 3 units on the big one
    pb2 = Problem(**{**pb.__dict__, "capacity": (11.0, 3.0)})
    with pytest.raises(InfeasibleMemoryError) as info:
        exact(pb2)
    assert info.value.needed == [12.0, 4.0]


@settings(max_examples=examples(100), deadline=None)
@given(problems(max_n=7, max_p=3))
def test_infeasible_needed_is_the_least_max_memory_ratio(pb: Problem) -> None:
    if pb.p > len(set(pb.allowed_cuts())) + 1 or brute_best(pb) is not None:
        return
    with pytest.raises(InfeasibleMemoryError) as info:
        exact(pb)
    needed = info.value.needed
    assert len(needed) == pb.p

    def ratio(memory: tuple[float, ...] | list[float]) -> float:
        return max((m / c if c > 0 else (INF if m > 0 else 0.0)) for m, c in zip(memory, pb.capacity))

    options = [evaluate(pb, part).memory for part in contiguous_partitions(pb)]
    assert tuple(needed) in {tuple(m) for m in options}
    best = min(ratio(m) for m in options)
    if math.isfinite(best):
        assert ratio(needed) == pytest.approx(best, rel=1e-6)


def test_units_out_of_topological_order_are_rejected() -> None:
    pb = Problem(compute=((1.0,) * 3,) * 2, state_bytes=(0,) * 3, act_bytes=(0,) * 3,
                 tensors=(Tensor(2, (1,), 4.0),), capacity=(INF, INF), inflight=(1, 1),
                 link_bandwidth=(1.0,), link_latency=(0.0,))
    with pytest.raises(PartitionError, match="not in a topological order"):
        exact(pb)


def test_single_stage_and_one_unit_per_stage() -> None:
    one = Problem(compute=((2.0, 3.0),), state_bytes=(1, 1), act_bytes=(0, 0), tensors=(),
                  capacity=(2.0,), inflight=(1,), link_bandwidth=(), link_latency=())
    assert exact(one).assignment == (0, 0)
    many = Problem(compute=((1.0, 2.0, 3.0),) * 3, state_bytes=(0,) * 3, act_bytes=(0,) * 3,
                   tensors=(Tensor(0, (1, 3), 2.0),), capacity=(INF,) * 3, inflight=(1,) * 3,
                   link_bandwidth=(1.0,) * 2, link_latency=(0.0,) * 2)
    assert exact(many).assignment == (0, 1, 2)


@pytest.mark.parametrize("module_cuts", [False, True])
def test_transformer_size_matches_an_independent_dp(module_cuts: bool) -> None:
    """n = 4000 units, p = 64 stages: exact's bottleneck is the DP optimum (timed in __main__)."""
    pb = transformer_problem(module_cuts=module_cuts)
    assert (pb.n, pb.p) == (4000, 64)
    part = exact(pb)
    assert is_valid(pb, part)
    ev = evaluate(pb, part)
    assert ev.feasible
    assert max(m / c for m, c in zip(ev.memory, pb.capacity)) > 0.9  # memory does bind here
    ref = dp_best(pb, upper=ev.bottleneck)
    assert ref is not None
    assert ev.bottleneck == pytest.approx(ref[0], rel=1e-9)
    assert evaluate(pb, Partition.from_cuts(ref[1], pb.n, "dp")).bottleneck == pytest.approx(ref[0], rel=1e-9)
    assert lower_bound(pb) <= ev.bottleneck


if __name__ == "__main__":
    import statistics
    import time

    for cuts in (False, True):
        pb = transformer_problem(module_cuts=cuts)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            part = exact(pb)
            times.append(time.perf_counter() - start)
        print(f"exact n={pb.n} p={pb.p} module_cuts={cuts}: median {statistics.median(times):.3f} s, "
              f"min {min(times):.3f} s, bottleneck {evaluate(pb, part).bottleneck * 1e3:.3f} ms")
